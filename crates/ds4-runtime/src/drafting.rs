//! One drafting step of a generation (docs/speculative.md §1): the drafter's proposals
//! after the token about to be fed, one verify pass of the token and the drafts, the picks
//! from its rows ([`GenState::pick_draft`]) and the exact rollback of what was rejected.
//! [`crate::Conversation::generate_with`] (the CLI) and the server's scheduler (a slot
//! that decodes alone, [`crate::Slots::draft_target`]) both run it, on a
//! [`DraftTarget`]: one sequence's state on its engine.

use std::sync::atomic::{AtomicBool, Ordering};

use ds4_engine::{Engine, EngineError, Sampler, Session, Verify};

use crate::draft::{DraftConfig, Drafter};
use crate::driver::{DriverError, Flow, GenState, GenStop, Pick, Steer};

/// One sequence's state on its engine, as a drafting step uses it.
pub trait DraftTarget {
    /// The tokens the state holds.
    fn tokens(&self) -> &[u32];
    fn engine(&self) -> &Engine;
    /// [`Engine::mtp_draft`] after the state and `next`.
    fn mtp_draft(
        &mut self,
        next: u32,
        k: usize,
        pick: &mut dyn FnMut(&[f32]) -> Option<u32>,
    ) -> Result<Vec<u32>, EngineError>;
    /// [`Engine::eval_verify`] of `span` after the state.
    fn verify(&mut self, span: &[u32], rows: &mut Vec<f32>) -> Result<Verify, EngineError>;
    /// [`Engine::settle`]: keep the first `keep` tokens of the last verify.
    fn settle(&mut self, v: Verify, keep: usize) -> Result<(), EngineError>;
}

impl DraftTarget for Session {
    fn tokens(&self) -> &[u32] {
        Session::tokens(self)
    }
    fn engine(&self) -> &Engine {
        Session::engine(self)
    }
    fn mtp_draft(
        &mut self,
        next: u32,
        k: usize,
        pick: &mut dyn FnMut(&[f32]) -> Option<u32>,
    ) -> Result<Vec<u32>, EngineError> {
        Session::mtp_draft(self, next, k, pick)
    }
    fn verify(&mut self, span: &[u32], rows: &mut Vec<f32>) -> Result<Verify, EngineError> {
        Session::verify(self, span, rows)
    }
    fn settle(&mut self, v: Verify, keep: usize) -> Result<(), EngineError> {
        Session::settle(self, v, keep)
    }
}

/// Buffers a generation's drafting steps reuse: every row of the last verify pass, the
/// drafter's context and the MTP drafter's distributions.
#[derive(Debug, Default)]
pub struct DraftScratch {
    rows: Vec<f32>,
    context: Vec<u32>,
    q: Vec<Vec<(u32, f64)>>,
}

impl DraftScratch {
    /// Row `i` of the last verify pass: the distribution after its first `i + 1` tokens
    /// (after a step that kept `keep` tokens, row `keep − 1` is the one after the state).
    pub fn row(&self, i: usize, n_vocab: usize) -> &[f32] {
        &self.rows[i * n_vocab..(i + 1) * n_vocab]
    }
}

/// How a drafting step ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verified {
    /// Every draft was picked and fed; the next distribution is the last row.
    AllKept,
    /// A pick replaced a draft: that token is fed next (it was emitted already).
    Replaced((u32, Flow)),
    /// The generation ended.
    Stop(GenStop),
}

/// What a drafting step did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drafted {
    pub outcome: Verified,
    /// Tokens the state kept of the verify pass (the token and the drafts that stood):
    /// [`DraftScratch::row`] `kept − 1` is the distribution after the state.
    pub kept: usize,
}

/// Drafts after `tok` (the token about to be fed to `target`, already emitted) and, when
/// the drafter proposes anything, verifies `tok` and the drafts in one pass and picks the
/// drafts' positions from its rows with `gen`'s per-step decisions. `None`: no drafts
/// (nothing was fed; the caller feeds `tok` as usual). Under [`crate::GenLimits::feed_all`]
/// every emitted token but an EOS is fed (a draft that stands as the generation stops is
/// kept, and a replacement is fed by the caller even when its flow stops); otherwise the
/// last emitted token is never fed. Drafts are capped by the configured maximum, the
/// tokens left to generate, the context room and the prefill chunk.
#[allow(clippy::too_many_arguments)]
pub fn draft_step(
    target: &mut dyn DraftTarget,
    cfg: &DraftConfig,
    drafter: Drafter,
    gen: &mut GenState,
    tok: u32,
    scratch: &mut DraftScratch,
    sampler: &mut Sampler,
    cancel: &AtomicBool,
    steer: &mut dyn Steer,
) -> Result<Option<Drafted>, DriverError> {
    let engine = target.engine();
    let limit = (gen.limits.max_tokens.saturating_sub(gen.tokens().len()))
        .saturating_sub(1)
        .min(
            engine
                .config()
                .ctx
                .saturating_sub(target.tokens().len() + 1),
        )
        .min(engine.config().prefill_chunk.saturating_sub(1));
    scratch.q.clear();
    let drafts = match drafter {
        Drafter::None => return Ok(None),
        Drafter::Mtp => {
            // Greedy: the block's most likely token at each depth (a point mass).
            // Sampling: a draw from the block's logits through the sampler, whose
            // distribution the acceptance rule then takes as `q` (docs/speculative.md §3).
            let k = limit.min(cfg.max);
            let greedy = sampler.config().temperature == 0.0;
            let qs = &mut scratch.q;
            let smp = &mut *sampler;
            target.mtp_draft(tok, k, &mut |l: &[f32]| {
                if greedy {
                    return Some(ds4_engine::argmax(l));
                }
                let q = smp.distribution(l, &[]).ok()?;
                let x = smp.draw(&q)?;
                qs.push(q);
                Some(x)
            })?
        }
        Drafter::Lookup => {
            scratch.context.clear();
            scratch.context.extend_from_slice(target.tokens());
            scratch.context.push(tok);
            cfg.propose(&scratch.context, limit).to_vec()
        }
    };
    if drafts.is_empty() {
        return Ok(None);
    }
    verify_step(target, gen, tok, &drafts, scratch, sampler, cancel, steer).map(Some)
}

/// Feeds `tok` with `drafts` after it in one verify pass, then picks from its rows: row
/// `i` (the distribution after `tok, d1 … di`) is picked with draft `d(i+1)` in mind
/// until a pick replaces its draft or the generation stops. The state keeps `tok` and
/// the drafts that were picked and are fed (see [`draft_step`] for `feed_all`).
#[allow(clippy::too_many_arguments)]
fn verify_step(
    target: &mut dyn DraftTarget,
    gen: &mut GenState,
    tok: u32,
    drafts: &[u32],
    scratch: &mut DraftScratch,
    sampler: &mut Sampler,
    cancel: &AtomicBool,
    steer: &mut dyn Steer,
) -> Result<Drafted, DriverError> {
    let feed_all = gen.limits.feed_all;
    let mut span = Vec::with_capacity(drafts.len() + 1);
    span.push(tok);
    span.extend_from_slice(drafts);
    let v = target.verify(&span, &mut scratch.rows)?;
    gen.draft.steps += 1;
    gen.draft.drafted += drafts.len() as u64;
    let n_vocab = target.engine().hparams().n_vocab;
    let mut keep = 1;
    let mut outcome = Verified::AllKept;
    for (i, &d) in drafts.iter().enumerate() {
        // The pick masks EOS in the row in place (`ignore_eos`); its logit is put back
        // after, since the row of the state's last token becomes the logits after the
        // state (the caller's, a checkpoint's), which must be the model's own.
        let mut row = &mut scratch.rows[i * n_vocab..(i + 1) * n_vocab];
        let eos = gen.limits.eos as usize;
        let eos_logit = gen
            .limits
            .ignore_eos
            .then(|| row.get(eos).copied())
            .flatten();
        let q = scratch.q.get(i).map_or(&[][..], Vec::as_slice);
        let picked = gen.pick_draft(&mut row, sampler, cancel, steer, Some((d, q)));
        if let (Some(l), Some(slot)) = (eos_logit, row.get_mut(eos)) {
            *slot = l;
        }
        let (t, flow) = match picked {
            Ok(Pick::Stop(stop)) => {
                outcome = Verified::Stop(stop);
                break;
            }
            Ok(Pick::Feed { tok, flow }) => (tok, flow),
            Err(e) => {
                // The state keeps what was fed; the logits after it are gone.
                target.settle(v, keep)?;
                return Err(e);
            }
        };
        if feed_all {
            // Every emitted token is fed: a replacement by the caller, a draft here; the
            // next pick stops at the limit or on cancel by itself.
            if t != d {
                outcome = Verified::Replaced((t, flow));
                break;
            }
            gen.draft.accepted += 1;
            keep += 1;
            if flow == Flow::Stop {
                outcome = Verified::Stop(GenStop::Halted);
                break;
            }
            continue;
        }
        let stop = if flow == Flow::Stop {
            Some(GenStop::Halted)
        } else if gen.tokens().len() >= gen.limits.max_tokens {
            Some(GenStop::Length)
        } else if cancel.load(Ordering::Relaxed) {
            Some(GenStop::Interrupted)
        } else {
            None
        };
        if t != d {
            outcome = match stop {
                Some(s) => Verified::Stop(s),
                None => Verified::Replaced((t, flow)),
            };
            break;
        }
        gen.draft.accepted += 1;
        if let Some(s) = stop {
            outcome = Verified::Stop(s);
            break;
        }
        keep += 1;
    }
    target.settle(v, keep)?;
    Ok(Drafted {
        outcome,
        kept: keep,
    })
}
