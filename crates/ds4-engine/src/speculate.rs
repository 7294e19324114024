//! Verifying drafted tokens in one forward pass, and rolling the state back exactly to the
//! tokens that were accepted (speculative decoding, docs/speculative.md).
//!
//! A verify step evaluates `[t, d1 … dk]` after a state at position `P` (one chunk of
//! `n = k + 1` rows, all logits kept) and then keeps the first `keep` of them (`t` and the
//! accepted drafts). The state afterwards must be, in every buffer and bit for bit, the
//! state of a run that evaluated only those `keep` tokens: no trace of a rejected draft may
//! survive, or later logits would differ from decoding without drafts.
//!
//! Why an undo record and not a snapshot: [`crate::Engine::snapshot`] serialises the whole
//! state, which for the full-size model is ≈ 23.5 MB of rings and accumulators plus 13,760
//! bytes per token (≈ 65 MB after 3k tokens, ≈ 474 MB at 32k: docs/forward.md §8.2–§8.3),
//! copied to the host and checksummed — far more than a decode step costs. A verify pass of
//! `n` rows overwrites only:
//! - in each layer's ring, the `n` slots `p mod window` of its positions;
//! - in each compressor's accumulator, the slots `p mod ratio` of its positions (for the
//!   overlapping ratio-4 kind also the previous-window half, replaced when a window
//!   completes; that accumulator is `2·2·ratio·2c` values, so it is saved whole);
//! - the compressed rows of windows that complete inside the span (at most `⌈n/ratio⌉`);
//! - the token list.
//!
//! [`crate::Engine::eval_verify`] copies exactly those ranges into one engine-owned device
//! buffer before the pass (device to device; for Flash with `n = 4` about 2.4 MB, no host
//! transfer), and [`crate::Engine::settle`] copies back the ones the rejected positions
//! wrote. That is exact when no slot is written twice in the span (`n ≤ ratio` of every
//! compressor and `n ≤ window`): a rejected position's slot then held, before the pass,
//! what it must hold afterwards (the value of the position one period earlier, which is
//! before the span), and at most one window completes in the span, so the previous-window
//! half is the saved one exactly when that completion was rejected. Longer spans
//! ([`crate::Engine::exact_draft_span`] is the limit) are still exact but slower: every
//! saved range is restored (the state before the pass) and the kept tokens are evaluated
//! again as one chunk of decode rows.
//!
//! The pass itself runs its rows as decode rows ([`crate::Backend::set_decode_rows`]):
//! each row's matmuls then get the bits its token gets when decoded alone, and the CPU
//! backend's attention and compressors are per row, so row `i`'s logits are bit for bit
//! those a one-token decode of `d_i` would give (docs/forward.md §13) — the condition for
//! greedy drafting to be lossless. A backend that refuses decode rows refuses the verify.

use crate::backend::{Buf, Slice};
use crate::engine::{Engine, Logits};
use crate::error::{EngineError, Result};
use crate::state::KvState;

/// One saved range and where to put it back.
#[derive(Debug, Clone, Copy)]
enum Saved {
    /// Slots of a circular region (`period` slots of `width` values at `base` of `buf`; the
    /// position `p` lives in slot `p mod period`) for positions `first ..` of the span, in
    /// position order at `at` of the undo buffer. `whole`: the span is longer than the
    /// period and the whole region was saved (slot order) instead.
    Circ {
        buf: Buf,
        base: usize,
        period: usize,
        width: usize,
        whole: bool,
        at: usize,
    },
    /// The previous-window half of an overlapping compressor's accumulator (the `u` and the
    /// `z` block, `ratio · pw` values each), saved with the accumulator; restored when the
    /// window completion inside the span was rejected.
    Prev {
        buf: Buf,
        ratio: usize,
        pw: usize,
        at: usize,
    },
    /// Compressed rows `w0 .. w1` (`width` wide, one per `ratio` positions) of `buf`.
    Rows {
        buf: Buf,
        width: usize,
        ratio: usize,
        w0: usize,
        w1: usize,
        at: usize,
    },
}

/// What [`Engine::eval_verify`] saved: hand it to [`Engine::settle`] with the number of
/// tokens to keep. Valid until the next verify on the same engine.
#[derive(Debug)]
pub struct Verify {
    pos0: usize,
    n: usize,
    generation: u64,
    saved: Vec<Saved>,
    /// Whether putting back the rejected positions' ranges is exact (see the module doc).
    exact: bool,
}

impl Verify {
    /// The position of the first verified token.
    pub fn pos0(&self) -> usize {
        self.pos0
    }
    /// Rows evaluated (the token before the drafts and the drafts).
    pub fn len(&self) -> usize {
        self.n
    }
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
}

/// The engine's undo buffer and the generation of the last verify that used it.
#[derive(Debug, Default)]
pub(crate) struct UndoArea {
    buf: Option<Buf>,
    generation: u64,
}

impl UndoArea {
    pub(crate) fn free(&mut self, be: &mut dyn crate::Backend) {
        if let Some(b) = self.buf.take() {
            be.free(b);
        }
    }
}

/// The ranges a span of `n` tokens at `pos0` writes, laid out one after another from 0.
fn plan(state: &KvState, window: usize, pos0: usize, n: usize) -> (Vec<Saved>, usize, bool) {
    let mut saved = Vec::new();
    let mut at = 0;
    let mut exact = n <= window;
    let circ = |saved: &mut Vec<Saved>, at: &mut usize, buf: Buf, base, period, width| {
        let whole = n > period;
        saved.push(Saved::Circ {
            buf,
            base,
            period,
            width,
            whole,
            at: *at,
        });
        *at += if whole { period } else { n } * width;
    };
    for l in state.layers() {
        let hd = l.ring.len() / window;
        circ(&mut saved, &mut at, l.ring, 0, window, hd);
        for c in [l.comp, l.index].into_iter().flatten() {
            let args = c.chunk_args(pos0, n);
            let (pw, slots) = (args.proj_width(), args.slots());
            exact &= n <= c.ratio;
            if c.overlap {
                // Current-window slots `ratio + j` of u and z, and the previous half.
                circ(&mut saved, &mut at, c.acc, c.ratio * pw, c.ratio, pw);
                circ(
                    &mut saved,
                    &mut at,
                    c.acc,
                    (slots + c.ratio) * pw,
                    c.ratio,
                    pw,
                );
                saved.push(Saved::Prev {
                    buf: c.acc,
                    ratio: c.ratio,
                    pw,
                    at,
                });
                at += 2 * c.ratio * pw;
            } else {
                circ(&mut saved, &mut at, c.acc, 0, c.ratio, pw);
                circ(&mut saved, &mut at, c.acc, slots * pw, c.ratio, pw);
            }
            let (w0, w1) = (c.rows_at(pos0), c.rows_at(pos0 + n).min(c.cap));
            if w1 > w0 {
                saved.push(Saved::Rows {
                    buf: c.rows,
                    width: c.width,
                    ratio: c.ratio,
                    w0,
                    w1,
                    at,
                });
                at += (w1 - w0) * c.width;
            }
        }
    }
    (saved, at, exact)
}

/// Copies between the state and the undo buffer: `save` true copies state → undo.
/// `from` is the first position (absolute) whose ranges move; positions before it and
/// rows of windows completed before it stay.
fn transfer(
    be: &mut dyn crate::Backend,
    undo: Buf,
    saved: &[Saved],
    (pos0, n): (usize, usize),
    from: usize,
    save: bool,
) -> Result<()> {
    let mut mv = |state: Slice, at: usize| -> Result<()> {
        let u = undo.slice(at, state.len);
        if save {
            be.copy(state, u)?;
        } else {
            be.copy(u, state)?;
        }
        Ok(())
    };
    for s in saved {
        match *s {
            Saved::Circ {
                buf,
                base,
                period,
                width,
                whole,
                at,
            } => {
                if whole {
                    mv(buf.slice(base, period * width), at)?;
                    continue;
                }
                // Positions from..pos0+n in runs of consecutive slots.
                let mut p = from;
                while p < pos0 + n {
                    let slot = p % period;
                    let run = (period - slot).min(pos0 + n - p);
                    mv(
                        buf.slice(base + slot * width, run * width),
                        at + (p - pos0) * width,
                    )?;
                    p += run;
                }
            }
            Saved::Prev { buf, ratio, pw, at } => {
                // The completion in the span (if any) is at or after `from`.
                let completes = (from..pos0 + n).any(|p| (p + 1) % ratio == 0);
                if save || completes {
                    let half = ratio * pw;
                    mv(buf.slice(0, half), at)?;
                    mv(buf.slice(2 * half, half), at + half)?;
                }
            }
            Saved::Rows {
                buf,
                width,
                ratio,
                w0,
                w1,
                at,
            } => {
                // Rows of windows completed at a position >= from (the rows complete after
                // the tokens before `from` are `from / ratio`).
                let first = if save { w0 } else { (from / ratio).max(w0) };
                if first < w1 {
                    mv(
                        buf.slice(first * width, (w1 - first) * width),
                        at + (first - w0) * width,
                    )?;
                }
            }
        }
    }
    Ok(())
}

impl Engine {
    /// The longest span (the token before the drafts plus the drafts) that
    /// [`Engine::settle`] rolls back by copying saved ranges alone: the sliding window and
    /// every compressor's ratio bound it (a longer span writes some slot twice, and the
    /// earlier value, from an accepted position, is not saved). Longer spans are settled by
    /// evaluating the kept tokens again. 4 for DeepSeek V4 (its CSA layers' ratio).
    pub fn exact_draft_span(&self) -> usize {
        let hp = self.hparams();
        (0..hp.n_layer)
            .filter_map(|il| match hp.attn_kind(il) {
                ds4_model::AttnKind::Sliding => None,
                ds4_model::AttnKind::Csa => Some(4),
                ds4_model::AttnKind::Hca(r) => Some(r as usize),
            })
            .fold(hp.sliding_window, usize::min)
            .max(1)
    }

    /// Whether this engine runs verify steps: its backend evaluates decode rows
    /// ([`crate::Backend::set_decode_rows`]), which give a verify's rows the bits of
    /// one-token decodes. A caller without it decodes one token at a time.
    pub fn can_verify(&mut self) -> bool {
        let (be, _) = self.undo_parts();
        let ok = be.set_decode_rows(2).is_ok();
        ok && be.set_decode_rows(1).is_ok()
    }

    /// Evaluates `tokens` (the token after the state and the drafts after it) as one chunk
    /// of decode rows and writes every row's logits into `out` (`[tokens, n_vocab]`, cleared
    /// first), after saving the state ranges the chunk overwrites. Hand the result to
    /// [`Engine::settle`] before anything else evaluates this state. At most
    /// `config.prefill_chunk` tokens; a backend without decode rows refuses (its chunk
    /// logits could differ from decoding one token at a time).
    pub fn eval_verify(
        &mut self,
        state: &mut KvState,
        tokens: &[u32],
        out: &mut Vec<f32>,
    ) -> Result<Verify> {
        out.clear();
        let n = tokens.len();
        if n == 0 {
            return Err(EngineError::Empty);
        }
        if n > self.config().prefill_chunk {
            return Err(EngineError::Config(format!(
                "a verify step of {n} tokens exceeds the chunk size {}",
                self.config().prefill_chunk
            )));
        }
        if state.fingerprint != self.fingerprint() {
            return Err(EngineError::Config(
                "this KV state belongs to another engine".into(),
            ));
        }
        if n > state.ctx - state.pos() {
            return Err(EngineError::ContextFull {
                pos: state.pos(),
                adding: n,
                ctx: state.ctx,
            });
        }
        let pos0 = state.pos();
        let window = self.hparams().sliding_window;
        let (saved, len, exact) = plan(state, window, pos0, n);
        let (be, undo) = self.undo_parts();
        be.set_decode_rows(n)?;
        be.set_decode_rows(1)?;
        let need = len.max(1);
        if undo.buf.is_none_or(|b| b.len() < need) {
            undo.free(be);
            undo.buf = Some(be.alloc(need)?);
        }
        let buf = undo.buf.expect("allocated above");
        undo.generation += 1;
        let generation = undo.generation;
        transfer(be, buf, &saved, (pos0, n), pos0, true)?;
        self.eval_decode_rows(state, tokens, Logits::All, out)?;
        Ok(Verify {
            pos0,
            n,
            generation,
            saved,
            exact,
        })
    }

    /// Keeps the first `keep` tokens of a verify step (`1 ..= v.len()`) and removes the
    /// rest from `state`, leaving it bit for bit as evaluating only the kept tokens would
    /// have (see the module doc). The logits of the kept tokens are the verify's rows.
    pub fn settle(&mut self, state: &mut KvState, v: Verify, keep: usize) -> Result<()> {
        let (be, undo) = self.undo_parts();
        if v.generation != undo.generation || state.pos() != v.pos0 + v.n {
            return Err(EngineError::Config(
                "settle needs the state and the record of the engine's last verify".into(),
            ));
        }
        if keep == 0 || keep > v.n {
            return Err(EngineError::Config(format!(
                "a verify of {} tokens keeps 1 to {} of them, not {keep}",
                v.n, v.n
            )));
        }
        if keep == v.n {
            return Ok(());
        }
        let buf = undo.buf.ok_or(EngineError::Empty)?;
        if v.exact {
            transfer(be, buf, &v.saved, (v.pos0, v.n), v.pos0 + keep, false)?;
            state.tokens.truncate(v.pos0 + keep);
            return Ok(());
        }
        // Back to the state before the pass, then the kept tokens again.
        transfer(be, buf, &v.saved, (v.pos0, v.n), v.pos0, false)?;
        let kept = state.tokens[v.pos0..v.pos0 + keep].to_vec();
        state.tokens.truncate(v.pos0);
        let mut none = Vec::new();
        self.eval_decode_rows(state, &kept, Logits::None, &mut none)
    }
}
