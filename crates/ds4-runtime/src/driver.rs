//! The conversation driver: one live engine session, the logits after its last token, and
//! the moves every front end makes on it — bring it to a token sequence reusing the live
//! prefix, evaluate more, generate step by step with stop conditions and cancellation,
//! checkpoint it and resume a checkpoint.
//!
//! The live state is the only copy of the context. A new turn normally extends it, so only
//! the new tokens are evaluated; a sequence that does not extend it (another conversation,
//! an edited history) resets and refills it, because the engine has no partial rewind.
//! Keeping the logits beside the state is what lets a prompt that ends exactly at the live
//! state (or at a checkpoint) start sampling without evaluating anything.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use ds4_chat::Tokenizer;
use ds4_engine::{Engine, EngineError, Sampler, Session, Snapshot};
use thiserror::Error;

use crate::checkpoint::{self, CheckpointError, Format};
use crate::draft::{DraftConfig, DraftMode, DraftStats, Drafter, Governor};
use crate::drafting::{draft_step, DraftScratch, Verified};
use crate::step::{band_fits_mask, Left, SessionStep, StepLogits};

/// Why a driver operation failed.
#[derive(Debug, Error)]
pub enum DriverError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("nothing to evaluate: the token sequence is empty")]
    Empty,
    #[error("{tokens} tokens do not fit the context of {ctx} (use a larger -c/--ctx or /ctx N)")]
    TooLong { tokens: usize, ctx: usize },
    #[error("interrupted")]
    Interrupted,
    #[error("the restored state holds other tokens than the checkpoint says")]
    Inconsistent,
    #[error("no logits to sample from (nothing was evaluated since the state last changed)")]
    NoLogits,
    /// A [`crate::HostStep`]'s pick needed the row while it was still on the device: the
    /// caller picks again through [`crate::Slots::step`], which fetches it (nothing was
    /// drawn or sent before the row was asked for).
    #[error("the logits row is still on the device")]
    RowOnDevice,
}

/// What one [`Conversation::sync`] did.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SyncStats {
    /// Tokens that were already live and kept.
    pub reused: usize,
    /// Tokens evaluated now.
    pub prefilled: usize,
    pub secs: f64,
}

impl SyncStats {
    pub fn tokens_per_sec(&self) -> f64 {
        rate(self.prefilled, self.secs)
    }
}

fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GenStop {
    /// The model sampled EOS.
    Eos,
    /// The token limit was reached.
    Length,
    /// The cancel flag was raised.
    Interrupted,
    /// The front end's [`Steer`] ended it (a stop sequence matched, the server is stopping,
    /// the client went away).
    Halted,
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenOutcome {
    /// Sampled tokens in order (an EOS is included).
    pub tokens: Vec<u32>,
    pub stop: GenStop,
    pub secs: f64,
    /// What drafting did (all zero without drafting).
    pub draft: DraftStats,
}

impl GenOutcome {
    pub fn tokens_per_sec(&self) -> f64 {
        rate(self.tokens.len(), self.secs)
    }
}

/// The stop conditions of one [`Conversation::generate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GenLimits {
    /// Most tokens to sample.
    pub max_tokens: usize,
    pub eos: u32,
    /// Mask EOS out of every distribution (fixed-length runs for benchmarks and tests).
    pub ignore_eos: bool,
    /// Feed every emitted token, the last one too, and keep the logits after it. A server
    /// wants this: its next request may continue exactly where this one stopped, and its
    /// mid-generation checkpoints need the logits. Off (the CLI), the last token is left for
    /// the next turn to feed with its own tokens, and greedy decoding asks the backend for
    /// the argmax alone.
    pub feed_all: bool,
}

/// Whether a generation goes on after a token ([`Steer::token`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// End after this token ([`GenStop::Halted`]).
    Stop,
}

/// What a front end decides during [`Conversation::generate_with`]. The driver owns the
/// loop (limits, cancellation, EOS, sampling, feeding the state), so the CLI and the server
/// cannot drift apart on it; the front end only answers these questions at each step.
pub trait Steer {
    /// Asked before every step, after the cancel flag: `true` ends the generation with
    /// [`GenStop::Halted`] (e.g. the server is shutting down, the client disconnected).
    fn halt(&mut self) -> bool {
        false
    }

    /// The token of step `step` (0-based) when the front end decides it instead of the
    /// sampler: forced output, or a greedy pick inside a structured span. `logits` are the
    /// distribution of this step, `None` when the backend already picked the argmax (greedy
    /// decoding without [`GenLimits::feed_all`]). `None` lets the sampler choose.
    fn choose(&mut self, _step: usize, _logits: Option<&[f32]>) -> Option<u32> {
        None
    }

    /// Whether [`Steer::choose`] needs the logits row at step `step`. The driver hands
    /// `choose` the row whenever it is on the host anyway; when the backend left only a
    /// band or its argmax, the row is fetched for `choose` only if this says so.
    fn wants_row(&mut self, _step: usize) -> bool {
        false
    }

    /// An emitted token (never EOS), before it is fed to the state. [`Flow::Stop`] ends the
    /// generation with [`GenStop::Halted`] (the token is still fed under `feed_all`).
    fn token(&mut self, tok: u32) -> Flow;

    /// After a token was fed under [`GenLimits::feed_all`] and the generation goes on: the
    /// conversation holds it and the logits after it (a checkpoint can be written here).
    fn fed(&mut self, _conv: &mut Conversation) {}
}

/// [`Steer`] for a front end that only watches the tokens go by.
struct Watch<'a>(&'a mut dyn FnMut(u32));

impl Steer for Watch<'_> {
    fn token(&mut self, tok: u32) -> Flow {
        (self.0)(tok);
        Flow::Continue
    }
}

/// How a candidate prefix (the live state, a snapshot, a disk checkpoint) continues into a
/// target: the tokens to evaluate after it, or `None` if it is not a prefix.
///
/// A prefix matches when its tokens start the target's tokens, or when its decoded bytes
/// start the target's text at a character boundary: the same text can tokenize differently
/// when it is split (a cached prefix was tokenized on its own), so a byte match is still a
/// valid reuse; `suffix_from(bytes)` then tokenizes the rest of the target from that byte
/// offset under the caller's special-token policy.
pub fn continuation(
    tok: &Tokenizer,
    prefix: &[u32],
    target_tokens: &[u32],
    target_text: &str,
    suffix_from: impl FnOnce(usize) -> Option<Vec<u32>>,
) -> Option<Vec<u32>> {
    if prefix.is_empty() {
        return None;
    }
    if target_tokens.starts_with(prefix) {
        return Some(target_tokens[prefix.len()..].to_vec());
    }
    let bytes = tok.decode(prefix).ok()?;
    if bytes.len() <= target_text.len()
        && target_text.as_bytes().starts_with(&bytes)
        && target_text.is_char_boundary(bytes.len())
    {
        return suffix_from(bytes.len());
    }
    None
}

/// A live session plus the logits of its last evaluated token.
pub struct Conversation {
    session: Session,
    /// Logits after `session.tokens()`, when known.
    last_logits: Option<Vec<f32>>,
    /// Speculative decoding in [`Conversation::generate_with`] (docs/speculative.md).
    draft: DraftConfig,
}

impl Conversation {
    /// A new, empty conversation on `engine` (its KV state is allocated here).
    pub fn new(engine: Engine) -> Result<Conversation, DriverError> {
        Ok(Conversation {
            session: Session::new(engine)?,
            last_logits: None,
            draft: DraftConfig::default(),
        })
    }

    /// Drafting for the generations that follow (off by default). It never changes what
    /// is generated: greedy output is token for token the same, sampled output has the
    /// same distribution (docs/speculative.md).
    pub fn set_draft(&mut self, draft: DraftConfig) {
        self.draft = draft;
    }

    pub fn draft(&self) -> DraftConfig {
        self.draft
    }

    pub fn engine(&self) -> &Engine {
        self.session.engine()
    }

    pub fn ctx(&self) -> usize {
        self.session.ctx()
    }

    /// Tokens held by the live state.
    pub fn live(&self) -> &[u32] {
        self.session.tokens()
    }

    /// Number of live tokens.
    pub fn pos(&self) -> usize {
        self.session.pos()
    }

    /// The logits after the live state, when known.
    pub fn logits(&self) -> Option<&[f32]> {
        self.last_logits.as_deref()
    }

    /// Forgets the logits (the caller changed what they would be, or cannot trust them).
    pub fn forget_logits(&mut self) {
        self.last_logits = None;
    }

    /// Empties the live state.
    pub fn reset(&mut self) -> Result<(), DriverError> {
        self.last_logits = None;
        self.session.reset()?;
        Ok(())
    }

    pub fn snapshot(&mut self) -> Result<Snapshot, DriverError> {
        Ok(self.session.snapshot()?)
    }

    /// Replaces the live state with a snapshot; `logits` are the ones after it, if known.
    pub fn restore(
        &mut self,
        snap: &Snapshot,
        logits: Option<Vec<f32>>,
    ) -> Result<(), DriverError> {
        self.last_logits = None;
        self.session.restore(snap)?;
        self.last_logits = logits;
        Ok(())
    }

    /// The live state as a checkpoint payload ([`checkpoint::encode`], with the logits
    /// when known).
    pub fn checkpoint(&mut self) -> Result<Vec<u8>, DriverError> {
        let snap = self.session.snapshot()?;
        Ok(checkpoint::encode(self.logits(), snap.as_bytes()))
    }

    /// Restores a checkpoint payload of any known format whose state must hold exactly
    /// `tokens`. Returns the payload's format (a legacy one should be rewritten by the
    /// caller). On any failure the live state is empty.
    pub fn resume(&mut self, payload: &[u8], tokens: &[u32]) -> Result<Format, DriverError> {
        let n_vocab = self.engine().hparams().n_vocab;
        let resumed = checkpoint::decode(payload, n_vocab)
            .map_err(DriverError::from)
            .and_then(|c| {
                self.restore(&Snapshot::from_bytes(c.snapshot), c.logits)?;
                if self.live() != tokens {
                    return Err(DriverError::Inconsistent);
                }
                Ok(c.format)
            });
        if resumed.is_err() {
            let _ = self.reset();
        }
        resumed
    }

    /// Evaluates `tokens` after the live state in one call and keeps the logits. On an
    /// engine error the state is partial and the logits are forgotten.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<(), DriverError> {
        match self.session.prefill(tokens) {
            Ok(l) => {
                self.last_logits = Some(l);
                Ok(())
            }
            Err(e) => {
                self.last_logits = None;
                Err(e.into())
            }
        }
    }

    /// One generation step: feeds `tok` and keeps the logits after it, reusing one buffer
    /// (no vocabulary-sized allocation per token).
    pub fn advance(&mut self, tok: u32) -> Result<(), DriverError> {
        let mut buf = self.last_logits.take().unwrap_or_default();
        self.session.decode_into(tok, &mut buf)?;
        self.last_logits = Some(buf);
        Ok(())
    }

    /// Makes the live state hold exactly `target` and returns the logits after its last
    /// token, or `None` if `cancel` was raised between prefill chunks (the state then holds
    /// a prefix of `target`). `progress(done, total)` is called after every chunk.
    pub fn sync(
        &mut self,
        target: &[u32],
        cancel: &AtomicBool,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(SyncStats, Option<Vec<f32>>), DriverError> {
        let t0 = Instant::now();
        if target.is_empty() {
            return Err(DriverError::Empty);
        }
        if target.len() > self.ctx() {
            return Err(DriverError::TooLong {
                tokens: target.len(),
                ctx: self.ctx(),
            });
        }
        if !target.starts_with(self.live()) {
            self.reset()?;
        }
        let reused = self.live().len();
        if reused == target.len() {
            if let Some(l) = self.last_logits.clone() {
                let stats = SyncStats {
                    reused,
                    prefilled: 0,
                    secs: t0.elapsed().as_secs_f64(),
                };
                return Ok((stats, Some(l)));
            }
            // Logits unknown (after a restore without them): evaluate from scratch.
            self.reset()?;
            return self.sync(target, cancel, progress);
        }
        let todo = &target[reused..];
        let chunk = self.engine().config().prefill_chunk.max(1);
        let mut done = 0;
        for piece in todo.chunks(chunk) {
            if cancel.load(Ordering::Relaxed) {
                self.last_logits = None;
                let stats = SyncStats {
                    reused,
                    prefilled: done,
                    secs: t0.elapsed().as_secs_f64(),
                };
                return Ok((stats, None));
            }
            self.prefill(piece)?;
            done += piece.len();
            progress(done, todo.len());
        }
        let stats = SyncStats {
            reused,
            prefilled: todo.len(),
            secs: t0.elapsed().as_secs_f64(),
        };
        Ok((stats, self.last_logits.clone()))
    }

    /// Makes the live state hold exactly `target`, without needing logits (before a
    /// snapshot): nothing is evaluated when it already does.
    pub fn sync_state(&mut self, target: &[u32], cancel: &AtomicBool) -> Result<(), DriverError> {
        if self.live() == target {
            return Ok(());
        }
        if target.is_empty() {
            return self.reset();
        }
        let (_, logits) = self.sync(target, cancel, &mut |_, _| {})?;
        if logits.is_none() {
            return Err(DriverError::Interrupted);
        }
        Ok(())
    }

    /// Samples up to `limits.max_tokens` tokens starting from `logits` (the logits after the
    /// live state), calling `on_token` with each. Stops at EOS (included in the result), at
    /// the limit, or when `cancel` is raised. Without [`GenLimits::feed_all`], every sampled
    /// token except the last is fed to the state, so the live state afterwards holds the
    /// prompt and all but the last sampled token: a one-shot run does not pay for a step
    /// nobody reads, and the next turn feeds that token with its own.
    pub fn generate(
        &mut self,
        logits: Vec<f32>,
        sampler: &mut Sampler,
        limits: GenLimits,
        cancel: &AtomicBool,
        on_token: &mut dyn FnMut(u32),
    ) -> Result<GenOutcome, DriverError> {
        self.last_logits = Some(logits);
        self.generate_with(sampler, limits, cancel, &mut Watch(on_token))
    }

    /// The one generation loop of the front ends: samples from the logits after the live
    /// state ([`DriverError::NoLogits`] when unknown) until EOS (included in the result), the
    /// limit, `cancel`, or `steer` ends it. See [`GenLimits::feed_all`] for which tokens the
    /// state holds afterwards. On an engine error while feeding, the state is partial and
    /// the logits are forgotten; a sampler error leaves both as they were.
    ///
    /// With drafting on ([`Conversation::set_draft`]), each token to feed (whose steer
    /// verdict is [`Flow::Continue`]) goes with the drafter's proposals in one verify pass;
    /// the drafts are then picked one by one from that pass's rows by the same per-step
    /// decisions ([`GenState::pick_draft`]) until one is replaced, and the state keeps
    /// exactly the tokens that were fed ([`ds4_engine::Engine::settle`]). Under `feed_all`
    /// the verify pass feeds several tokens at once, so [`Steer::fed`] is called once
    /// after it (when the generation goes on), with the state holding all of them and
    /// the logits after the last: every state the steer sees is one plain decoding passes
    /// through, but not every one of them. An error inside a verify step leaves the state
    /// holding the tokens fed and forgets the logits.
    pub fn generate_with(
        &mut self,
        sampler: &mut Sampler,
        limits: GenLimits,
        cancel: &AtomicBool,
        steer: &mut dyn Steer,
    ) -> Result<GenOutcome, DriverError> {
        let mut gen = GenState::new(limits);
        let GenLimits {
            max_tokens,
            ignore_eos,
            feed_all,
            ..
        } = limits;
        let mut logits = self.last_logits.take().ok_or(DriverError::NoLogits)?;
        // The sampler's draw needs only the band of logits near the maximum (greedy: the
        // values equal to it; min-p: those within T·ln(1/min_p)): the backend finds it and
        // a few hundred bytes cross back (the EOS mask applied there); a band short for the
        // draw brings the row after all (docs/server.md §6). Not when the logits must be
        // kept (feed_all).
        let band_span = if feed_all {
            None
        } else {
            sampler.config().band_span()
        };
        let mask = ignore_eos.then_some(limits.eos);
        // A backend without decode rows cannot verify bit for bit: no drafts there.
        let drafter = self.draft.drafter(self.session.engine().has_mtp());
        let drafting = self.draft.on() && drafter != Drafter::None && self.session.can_verify();
        // `--draft auto`: whether to draft this step, from this run's measured rates.
        let mut governor = (self.draft.mode == DraftMode::Auto).then(Governor::new);
        // Every row of a verify step, the context the drafter reads, the MTP drafter's
        // distributions.
        let mut scratch = DraftScratch::default();
        // What the last step left: the row in `logits`, or the argmax / band with the row
        // in the backend's scratch (fetched by the pick only when needed).
        let mut left = Left::Row;
        // A token picked from a verify row in place of a draft: fed next, with no pick.
        let mut replaced: Option<(u32, Flow)> = None;
        let stop = loop {
            let (tok, flow) = match replaced.take() {
                Some(picked) => picked,
                None => {
                    let mut dist = SessionStep {
                        left: &mut left,
                        row: &mut logits,
                        session: &mut self.session,
                    };
                    match gen.pick(&mut dist, sampler, cancel, steer) {
                        Ok(Pick::Stop(stop)) => break stop,
                        Ok(Pick::Feed { tok, flow }) => (tok, flow),
                        Err(e) => {
                            if feed_all {
                                self.last_logits = Some(logits);
                            }
                            return Err(e);
                        }
                    }
                }
            };
            if !feed_all {
                if flow == Flow::Stop {
                    break GenStop::Halted;
                }
                if gen.tokens().len() >= max_tokens {
                    break GenStop::Length;
                }
                if cancel.load(Ordering::Relaxed) {
                    break GenStop::Interrupted;
                }
            }
            let emitted = gen.tokens().len();
            // A token whose flow stops the generation is fed alone (under feed_all; without
            // it the loop has ended): nothing may be emitted after it.
            if drafting
                && flow == Flow::Continue
                && governor.as_ref().is_none_or(|g| g.drafting(emitted))
            {
                let (t0, accepted) = (Instant::now(), gen.draft.accepted);
                let drafted = draft_step(
                    &mut self.session,
                    &self.draft,
                    drafter,
                    &mut gen,
                    tok,
                    &mut scratch,
                    sampler,
                    cancel,
                    steer,
                )?;
                if let Some(d) = drafted {
                    if let Some(g) = governor.as_mut() {
                        let advanced = 1 + (gen.draft.accepted - accepted) as usize;
                        g.verify_step(t0.elapsed().as_secs_f64(), advanced, gen.tokens().len());
                    }
                    // The row of the state's last token is the distribution after it: the
                    // next step's when every draft stood, the one kept under feed_all.
                    if feed_all || d.outcome == Verified::AllKept {
                        let v = self.session.engine().hparams().n_vocab;
                        logits.clear();
                        logits.extend_from_slice(scratch.row(d.kept - 1, v));
                        left = Left::Row;
                    }
                    match d.outcome {
                        Verified::Stop(stop) => break stop,
                        Verified::Replaced(picked) => replaced = Some(picked),
                        Verified::AllKept => {}
                    }
                    if feed_all {
                        self.last_logits = Some(logits);
                        steer.fed(self);
                        logits = self.last_logits.take().ok_or(DriverError::NoLogits)?;
                    }
                    continue;
                }
            }
            let t0 = Instant::now();
            left = if let Some(span) = band_span {
                Left::Band(self.session.decode_band(tok, span, mask)?)
            } else {
                self.session.decode_into(tok, &mut logits)?;
                Left::Row
            };
            if let Some(g) = governor.as_mut() {
                g.plain_step(t0.elapsed().as_secs_f64());
            }
            if flow == Flow::Stop {
                break GenStop::Halted;
            }
            if feed_all {
                self.last_logits = Some(logits);
                steer.fed(self);
                logits = self.last_logits.take().ok_or(DriverError::NoLogits)?;
            }
        };
        if feed_all {
            // Every emitted token but an EOS was fed: these are the logits after the state.
            self.last_logits = Some(logits);
        }
        Ok(gen.finish(stop))
    }
}

/// What one step of the generation loop decided ([`GenState::pick`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// The generation ends here (nothing more is fed).
    Stop(GenStop),
    /// Feed `tok` to the state; after the feed, [`Flow::Stop`] ends the generation with
    /// [`GenStop::Halted`].
    Feed { tok: u32, flow: Flow },
}

/// The per-step decisions of one generation, apart from feeding the state: the checks
/// before a step (limit, cancel, [`Steer::halt`]), the token (the steer's choice, else the
/// sampler's), EOS, and the steer's verdict on the token. [`Conversation::generate_with`]
/// feeds its one state with it; a scheduler that feeds several states in one batched step
/// (`crate::slots`) uses the same decisions, so the two loops cannot drift apart.
#[derive(Debug)]
pub struct GenState {
    pub(crate) limits: GenLimits,
    out: Vec<u32>,
    t0: Instant,
    pub(crate) draft: DraftStats,
}

impl GenState {
    pub fn new(limits: GenLimits) -> GenState {
        GenState {
            limits,
            out: Vec::new(),
            t0: Instant::now(),
            draft: DraftStats::default(),
        }
    }

    /// Tokens chosen so far (an EOS included).
    pub fn tokens(&self) -> &[u32] {
        &self.out
    }

    /// What drafting did so far ([`crate::draft_step`]).
    pub fn draft_stats(&self) -> DraftStats {
        self.draft
    }

    /// Decides the next step from `dist`, the distribution after the state: the steer's
    /// token, else the backend's pick, else the sampler's draw (from the band when it
    /// stands for the row, else from the row, fetched only then). `ignore_eos` masks EOS
    /// in the row. A sampler error leaves the step undone.
    pub fn pick(
        &mut self,
        dist: &mut dyn StepLogits,
        sampler: &mut Sampler,
        cancel: &AtomicBool,
        steer: &mut dyn Steer,
    ) -> Result<Pick, DriverError> {
        self.pick_draft(dist, sampler, cancel, steer, None)
    }

    /// [`GenState::pick`] at a position whose token was drafted: the steer's token as
    /// usual, else the sampler's acceptance rule ([`Sampler::sample_draft_from`]; `draft`
    /// is the token and the distribution it was drawn from, empty for a deterministic
    /// draft), which emits the draft or a replacement so that the token has exactly the
    /// distribution `pick` would draw from. The caller compares the result with the draft.
    pub fn pick_draft(
        &mut self,
        dist: &mut dyn StepLogits,
        sampler: &mut Sampler,
        cancel: &AtomicBool,
        steer: &mut dyn Steer,
        draft: Option<(u32, &[(u32, f64)])>,
    ) -> Result<Pick, DriverError> {
        let GenLimits {
            max_tokens,
            eos,
            ignore_eos,
            ..
        } = self.limits;
        if self.out.len() >= max_tokens {
            return Ok(Pick::Stop(GenStop::Length));
        }
        if cancel.load(Ordering::Relaxed) {
            return Ok(Pick::Stop(GenStop::Interrupted));
        }
        if steer.halt() {
            return Ok(Pick::Stop(GenStop::Halted));
        }
        let mask = ignore_eos.then_some(eos);
        let step = self.out.len();
        let on_host = dist.band().is_none();
        let chosen = if on_host || steer.wants_row(step) {
            steer.choose(step, Some(masked_row(dist, mask)?))
        } else {
            steer.choose(step, None)
        };
        let tok = match (chosen, draft) {
            (Some(t), _) => t,
            (None, Some((d, q))) => {
                sampler.sample_draft_from(masked_row(dist, mask)?, &self.out, d, q)?
            }
            (None, None) => {
                let drawn = match dist.band() {
                    Some(b) if band_fits_mask(b, mask) => sampler.sample_band(b)?,
                    _ => None,
                };
                match drawn {
                    Some(t) => t,
                    // The tokens generated so far feed a repetition penalty.
                    None => sampler.sample(masked_row(dist, mask)?, &self.out)?,
                }
            }
        };
        self.out.push(tok);
        if tok == eos {
            return Ok(Pick::Stop(GenStop::Eos));
        }
        let flow = steer.token(tok);
        Ok(Pick::Feed { tok, flow })
    }

    /// The generation's outcome, ended by `stop`.
    pub fn finish(self, stop: GenStop) -> GenOutcome {
        GenOutcome {
            tokens: self.out,
            stop,
            secs: self.t0.elapsed().as_secs_f64(),
            draft: self.draft,
        }
    }
}

/// `dist`'s row with EOS masked (`mask`): what the row path samples.
fn masked_row(dist: &mut dyn StepLogits, mask: Option<u32>) -> Result<&mut [f32], DriverError> {
    let row = dist.row()?;
    if let Some(l) = mask.and_then(|eos| row.get_mut(eos as usize)) {
        *l = f32::NEG_INFINITY;
    }
    Ok(row)
}
