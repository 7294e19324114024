//! One slot's generation (docs/server.md §9): the runtime's per-step decisions
//! ([`ds4_runtime::GenState::pick`], the loop `Conversation::generate_with` runs too),
//! steered per token by the server — the forced or greedy token, the streamed text (stop
//! sequences, tool calls, deltas to the client) — and, when it ends, the outcome and the
//! bookkeeping that lets the next request reuse the slot.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ds4_chat::stream::{EndCause, Halt, OutputStream, StreamOptions};
use ds4_chat::tokenizer::THINK_CLOSE_TEXT;
use ds4_chat::Tokenizer;
use ds4_engine::{argmax, EngineError, Sampler};
use ds4_runtime::{
    draft_step, DraftConfig, DraftScratch, DraftTarget, Drafted, Drafter, DriverError, Flow,
    GenLimits, GenState, GenStop, Governor, Pick, Steer, StepLogits,
};

use crate::config::ServerConfig;
use crate::error::{engine_err, ApiError};
use crate::reuse::SlotCache;
use crate::stats::Stats;
use crate::worker::{emit, random_id, Job, Outcome, TokenLogprob, Usage};

/// Why [`Steering::halt`] ended a generation.
enum Halted {
    /// The client went away.
    Cancelled,
    /// The server is stopping.
    Shutdown,
}

/// A slot's generation in progress.
pub(crate) struct Gen<'t> {
    sampler: Sampler,
    state: GenState,
    stream: OutputStream,
    dec: ds4_chat::StreamDecoder<'t>,
    forced: Option<Vec<u32>>,
    /// Tool-call ids, in call order, assigned when a call is announced.
    ids: Vec<String>,
    /// Tokens emitted so far (EOS excluded).
    stream_tokens: usize,
    halted: Option<Halted>,
    eos: u32,
    /// Time from the job's start to its first token.
    t_prefill: Duration,
    /// Token log probabilities, when the job asked for them.
    lp: Option<Logprobs<'t>>,
    /// Speculative decoding (docs/server.md §9): the job's settings, the drafter that runs
    /// (none when off, or when the backend cannot verify), `auto`'s governor, buffers.
    draft: DraftConfig,
    drafter: Drafter,
    governor: Option<Governor>,
    scratch: DraftScratch,
    /// A token a verify step picked in place of a draft: emitted, fed by the next step
    /// without a pick.
    pending: Option<(u32, Flow)>,
}

/// Collects the log probability of each generated token: the step's row is kept as the
/// runtime hands it over (before the sampler edits it), then read once the token is known.
struct Logprobs<'t> {
    tok: &'t Tokenizer,
    /// Alternatives to report per token.
    top: usize,
    row: Vec<f32>,
    /// log Σ exp(row): logprob(t) = row[t] − lse.
    lse: f32,
    out: Vec<TokenLogprob>,
}

impl Logprobs<'_> {
    fn see(&mut self, row: &[f32]) {
        self.row.clear();
        self.row.extend_from_slice(row);
        let max = row
            .iter()
            .copied()
            .filter(|x| !x.is_nan())
            .fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = row
            .iter()
            .filter(|x| !x.is_nan())
            .map(|&x| f64::from(x - max).exp())
            .sum();
        self.lse = max + sum.ln() as f32;
    }

    fn record(&mut self, t: u32) {
        let lp = |x: f32| {
            if x.is_nan() {
                f32::NEG_INFINITY
            } else {
                x - self.lse
            }
        };
        let bytes = |t: u32| self.tok.token_bytes(t).unwrap_or(&[]).to_vec();
        let logprob = self
            .row
            .get(t as usize)
            .map_or(f32::NEG_INFINITY, |&x| lp(x));
        let mut best: Vec<(u32, f32)> = Vec::with_capacity(self.top + 1);
        if self.top > 0 {
            for (i, &x) in self.row.iter().enumerate() {
                if x.is_nan() || (best.len() == self.top && x <= best[self.top - 1].1) {
                    continue;
                }
                let at = best.partition_point(|&(_, y)| y >= x);
                best.insert(at, (i as u32, x));
                best.truncate(self.top);
            }
        }
        let top = best.into_iter().map(|(i, x)| (bytes(i), lp(x))).collect();
        self.out.push(TokenLogprob {
            bytes: bytes(t),
            logprob,
            top,
        });
    }
}

/// What the runtime's step asks the server about one slot's token.
struct Steering<'a, 't> {
    job: &'a Job,
    eos: u32,
    stream: &'a mut OutputStream,
    dec: &'a mut ds4_chat::StreamDecoder<'t>,
    forced: &'a Option<Vec<u32>>,
    ids: &'a mut Vec<String>,
    stream_tokens: &'a mut usize,
    halted: &'a mut Option<Halted>,
    lp: &'a mut Option<Logprobs<'t>>,
    stats: &'a Stats,
    cfg: &'a ServerConfig,
    shutdown: &'a AtomicBool,
}

impl<'t> Gen<'t> {
    /// A generation of at most `limit` tokens for `job`, drafting with `drafter` (from the
    /// job's settings and the engine: [`DraftConfig::drafter`]).
    pub fn new(
        job: &Job,
        tok: &'t Tokenizer,
        eos: u32,
        limit: usize,
        t_prefill: Duration,
        drafter: Drafter,
    ) -> Result<Gen<'t>, ApiError> {
        let p = &job.prepared;
        let sampler =
            Sampler::new(job.sampling.clone()).map_err(|e| ApiError::bad(e.to_string()))?;
        let forced = match &job.forced {
            Some(t) => Some(tok.encode_chat(t).map_err(engine_err)?),
            None => None,
        };
        Ok(Gen {
            sampler,
            state: GenState::new(GenLimits {
                max_tokens: limit,
                eos,
                ignore_eos: false,
                feed_all: true,
            }),
            stream: OutputStream::new(StreamOptions {
                thinking: p.thinking,
                tools: p.tools,
                stop: job.stop.clone(),
            }),
            dec: tok.stream_decoder(),
            forced,
            ids: Vec::new(),
            stream_tokens: 0,
            halted: None,
            eos,
            t_prefill,
            lp: job.logprobs.map(|top| Logprobs {
                tok,
                top,
                row: Vec::new(),
                lse: 0.0,
                out: Vec::new(),
            }),
            draft: job.draft,
            drafter,
            governor: (job.draft.mode == ds4_runtime::DraftMode::Auto).then(Governor::new),
            scratch: DraftScratch::default(),
            pending: None,
        })
    }

    /// The token a verify step picked in place of a draft, to be fed now without a pick.
    pub fn take_pending(&mut self) -> Option<(u32, Flow)> {
        self.pending.take()
    }

    /// Whether this step may draft after `flow`'s token (the governor of `auto` may pause).
    pub fn wants_drafts(&self, flow: Flow) -> bool {
        flow == Flow::Continue
            && self.drafter != Drafter::None
            && self
                .governor
                .as_ref()
                .is_none_or(|g| g.drafting(self.state.tokens().len()))
    }

    /// A drafting step after `tok` on the slot's state `target` ([`draft_step`]; `None`:
    /// no drafts, `tok` is to be fed as usual). A replacement pick is kept to be fed next
    /// ([`Gen::take_pending`]); the logits after the state are the scratch row
    /// [`Gen::verify_row`] names.
    pub fn draft_step(
        &mut self,
        job: &Job,
        target: &mut dyn DraftTarget,
        tok: u32,
        stats: &Stats,
        cfg: &ServerConfig,
        shutdown: &AtomicBool,
    ) -> Result<Option<Drafted>, DriverError> {
        let mut steer = Steering {
            job,
            eos: self.eos,
            stream: &mut self.stream,
            dec: &mut self.dec,
            forced: &self.forced,
            ids: &mut self.ids,
            stream_tokens: &mut self.stream_tokens,
            halted: &mut self.halted,
            lp: &mut self.lp,
            stats,
            cfg,
            shutdown,
        };
        let t0 = std::time::Instant::now();
        let before = self.state.draft_stats();
        let d = draft_step(
            target,
            &self.draft,
            self.drafter,
            &mut self.state,
            tok,
            &mut self.scratch,
            &mut self.sampler,
            &job.cancel,
            &mut steer,
        )?;
        if let Some(d) = &d {
            let now = self.state.draft_stats();
            Stats::add(&stats.draft_steps, 1);
            Stats::add(&stats.drafted_tokens, now.drafted - before.drafted);
            Stats::add(&stats.accepted_tokens, now.accepted - before.accepted);
            if let Some(g) = self.governor.as_mut() {
                let advanced = 1 + (now.accepted - before.accepted) as usize;
                g.verify_step(
                    t0.elapsed().as_secs_f64(),
                    advanced,
                    self.state.tokens().len(),
                );
            }
            if let ds4_runtime::Verified::Replaced(p) = d.outcome {
                self.pending = Some(p);
            }
        }
        Ok(d)
    }

    /// The verify row after the state once a drafting step kept `d.kept` tokens.
    pub fn verify_row(&self, d: &Drafted, n_vocab: usize) -> &[f32] {
        self.scratch.row(d.kept - 1, n_vocab)
    }

    /// A plain decode step of this slot alone took `secs` (`auto`'s governor compares).
    pub fn plain_step(&mut self, secs: f64) {
        if let Some(g) = self.governor.as_mut() {
            g.plain_step(secs);
        }
    }

    /// The band width of this generation's lone decode steps ([`ds4_runtime::Slots::set_band`]):
    /// the sampler's, when its draw depends only on the logits near the maximum.
    pub fn band_span(&self) -> Option<f32> {
        if self.lp.is_some() {
            // Log probabilities need every step's whole row.
            return None;
        }
        self.sampler.config().band_span()
    }

    /// Decides this step from the distribution after the slot's state (emitting the
    /// token's text to the client).
    pub fn pick(
        &mut self,
        job: &Job,
        dist: &mut dyn StepLogits,
        stats: &Stats,
        cfg: &ServerConfig,
        shutdown: &AtomicBool,
    ) -> Result<Pick, DriverError> {
        let mut steer = Steering {
            job,
            eos: self.eos,
            stream: &mut self.stream,
            dec: &mut self.dec,
            forced: &self.forced,
            ids: &mut self.ids,
            stream_tokens: &mut self.stream_tokens,
            halted: &mut self.halted,
            lp: &mut self.lp,
            stats,
            cfg,
            shutdown,
        };
        self.state
            .pick(dist, &mut self.sampler, &job.cancel, &mut steer)
    }

    /// Inside a tool call (no `continued` checkpoint is cut there).
    pub fn in_tool_call(&self) -> bool {
        self.stream.dsml_state().in_tool_call()
    }
}

impl Steering<'_, '_> {
    /// Inside a tool call's structure, where the greedy token is taken.
    fn structured(&self) -> bool {
        let st = self.stream.dsml_state();
        st.in_tool_call() && !st.uses_payload_sampling()
    }
}

impl Steer for Steering<'_, '_> {
    fn halt(&mut self) -> bool {
        if self.job.cancel.load(Ordering::Relaxed) || self.job.events.is_closed() {
            *self.halted = Some(Halted::Cancelled);
        } else if self.shutdown.load(Ordering::Relaxed) {
            *self.halted = Some(Halted::Shutdown);
        }
        self.halted.is_some()
    }

    fn choose(&mut self, step: usize, logits: Option<&[f32]>) -> Option<u32> {
        if let (Some(lp), Some(row)) = (self.lp.as_mut(), logits) {
            lp.see(row);
        }
        if let Some(f) = self.forced {
            return Some(f.get(step).copied().unwrap_or(self.eos));
        }
        // Inside a tool call's structure (names, keys) the most likely token is taken, so
        // the sampler's randomness cannot break the DSML (docs/chat.md).
        if self.structured() {
            return logits.map(argmax);
        }
        None
    }

    fn wants_row(&mut self, _step: usize) -> bool {
        self.lp.is_some() || (self.forced.is_none() && self.structured())
    }

    fn token(&mut self, t: u32) -> Flow {
        if let Some(lp) = self.lp.as_mut() {
            lp.record(t);
        }
        *self.stream_tokens += 1;
        let text = self.dec.push(t).unwrap_or_default();
        let evs = self.stream.push(&text);
        emit(self.stats, self.cfg, self.job, self.ids, evs);
        Stats::add(&self.stats.generated_tokens, 1);
        if self.stream.halted().is_some() {
            Flow::Stop
        } else {
            Flow::Continue
        }
    }
}

impl Gen<'_> {
    /// Ends slot `i`'s generation: the final text, tool-call ids and the slot's bookkeeping
    /// in `cache` (tool binding, exact DSML, thinking-visible). Returns the outcome (usage:
    /// only the completion tokens) and the time to the first token.
    pub(crate) fn conclude(
        self,
        cache: &mut SlotCache,
        i: usize,
        job: &Job,
        ran: Result<GenStop, DriverError>,
    ) -> (Outcome, Duration) {
        let p = &job.prepared;
        let Gen {
            state,
            mut stream,
            mut dec,
            mut ids,
            stream_tokens,
            mut halted,
            t_prefill,
            lp,
            ..
        } = self;
        let mut cancelled = false;
        let draft = Some(state.draft_stats()).filter(|d| d.steps > 0);
        let (generated, cause) = match ran {
            Ok(stop) => {
                let g = state.finish(stop);
                let n = g.tokens.len() - usize::from(g.stop == GenStop::Eos);
                let cause = match g.stop {
                    GenStop::Eos => EndCause::Eos,
                    GenStop::Length => EndCause::Length,
                    GenStop::Interrupted => {
                        cancelled = true;
                        EndCause::Error("cancelled".into())
                    }
                    GenStop::Halted => match halted.take() {
                        // A stop sequence (or complete tool calls) ended the text.
                        None => EndCause::Eos,
                        Some(Halted::Cancelled) => {
                            cancelled = true;
                            EndCause::Error("cancelled".into())
                        }
                        Some(Halted::Shutdown) => EndCause::Error("shutdown requested".into()),
                    },
                };
                (n, cause)
            }
            Err(e) => {
                let n = stream_tokens;
                if !matches!(
                    e,
                    DriverError::NoLogits | DriverError::Engine(EngineError::Sampler(_))
                ) {
                    // The state is partial; nothing after it can be trusted.
                    cache.discard_live(i);
                }
                (n, EndCause::Error(e.to_string()))
            }
        };
        if cancelled {
            Stats::add(&cache.stats.cancelled, 1);
        }
        let rest = dec.finish();
        if !rest.is_empty() {
            let evs = stream.push(&rest);
            emit(&cache.stats, &cache.cfg, job, &mut ids, evs);
        }
        let stop_hit = stream.halted() == Some(Halt::StopSequence);
        let reasoning_closed = !p.thinking || stream.text().contains(THINK_CLOSE_TEXT);
        let (evs, output) = stream.finish(cause);
        emit(&cache.stats, &cache.cfg, job, &mut ids, evs);
        while ids.len() < output.message.tool_calls.len() {
            ids.push(random_id(job.tool_id_prefix, 32));
        }
        ids.truncate(output.message.tool_calls.len());
        cache.remember(i, job, &output, &ids, stop_hit || cancelled);
        cache.publish();
        let outcome = Outcome {
            output,
            tool_ids: ids,
            usage: Usage {
                completion_tokens: generated,
                draft,
                ..Usage::default()
            },
            reasoning_closed,
            logprobs: lp.map(|l| l.out),
        };
        (outcome, t_prefill)
    }
}
