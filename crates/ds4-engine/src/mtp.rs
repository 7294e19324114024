//! The multi-token-prediction (MTP) block as a drafter (docs/forward.md §10,
//! docs/speculative.md §4).
//!
//! The block at position `i` reads the main model's final HC streams `h_i` (after the last
//! block, before the head) and the token `t_{i+1}`, and predicts `t_{i+2}`. It is one
//! window-only transformer block, run by the same [`forward`] as the main model's layers
//! over a one-layer view of the model; only its input differs: every stream `j` becomes
//! `W_h·RMS(h_i,j; hnorm) + W_e·RMS(Emb[t_{i+1}]; enorm)`, and its head is its own HC head
//! and `norm` with the main model's output matrix.
//!
//! State. The block's only cache is its sliding-window ring, and the KV row it stores at
//! position `x` depends on `(h_x, t_{x+1}, x)` alone, so a draft at position `P−1` needs
//! the rows of positions `P−W … P−1` and nothing older. The engine therefore keeps the main
//! model's final streams of the last `W` positions it evaluated (`hist`, a ring written
//! after every single-sequence call) and, when asked to draft, evaluates the block over the
//! positions its ring lacks ("catch-up"; one chunk) and then, for depth 2 and on, over its
//! own output streams and the drafted token (chaining). Chained rows are provisional: the
//! ring slots they overwrite are saved first and put back afterwards, so the ring only ever
//! holds rows computed from the main model's real streams and real tokens, whatever was
//! drafted or rejected.

use std::sync::Arc;

use ds4_gguf::GgufFile;
use ds4_model::{HParams, LayerTensor};

use crate::backend::{Backend, Buf, Weight, WeightUse};
use crate::config::NumericMode;
use crate::error::{EngineError, Result};
use crate::forward::{forward, Model, Scratch, Seq, Want};
use crate::state::KvState;
use crate::weights::{HcWeights, LayerWeights, ModelWeights};

/// The block's own tensors besides those of an ordinary layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MtpProj {
    e_proj: Weight,
    h_proj: Weight,
    enorm: Weight,
    hnorm: Weight,
}

/// A loaded MTP block and its state.
pub(crate) struct Mtp {
    /// The main model's hparams reduced to the block: one window-only, non-hash layer.
    hp: HParams,
    /// The block as a one-layer model: the main embedding and output matrix, the block's
    /// HC head and `norm`.
    w: ModelWeights,
    proj: MtpProj,
    scratch: Scratch,
    /// Row `i` of its token list is `t_{i+1}`; `pos()` is the number of rows computed.
    state: KvState,
    /// Positions `[ring_lo, state.pos())` of the ring hold rows computed from the main
    /// model's real streams and tokens.
    ring_lo: usize,
    /// The main tokens `t_0 … t_{pos}` the rows were computed from.
    seen: Vec<u32>,
    /// The main model's final streams, slot `p mod W` for position `p`.
    hist: Buf,
    /// The main tokens whose streams `hist` holds; rows `[hist_lo, hist_tokens.len())`.
    hist_tokens: Vec<u32>,
    hist_lo: usize,
    /// Normed inputs and the embedding's projection, `[cap, n·D]` each.
    tmp_a: Buf,
    tmp_b: Buf,
    /// Ring slots saved before chained rows overwrite them.
    undo: Buf,
    undo_rows: usize,
}

impl Mtp {
    /// Validates the `mtp.0.*` tensors of `file` against the main model and loads them.
    pub(crate) fn load(
        be: &mut dyn Backend,
        file: &Arc<GgufFile>,
        spec: &ds4_model::ModelSpec,
        main: &ModelWeights,
        config: &crate::config::EngineConfig,
        fingerprint: u64,
    ) -> Result<Mtp> {
        let main_hp = &spec.hparams;
        let strict = spec.strictness == ds4_model::Strictness::Ds4;
        let (ctx, cap) = (config.ctx, config.prefill_chunk);
        ds4_model::mtp::validate_mtp(file.header(), main_hp, strict)?;
        use LayerTensor as L;
        use WeightUse::{Matrix as M, Vector as V};
        let order: Vec<(LayerTensor, WeightUse)> = vec![
            (L::HcAttnFn, M),
            (L::HcAttnBase, V),
            (L::HcAttnScale, V),
            (L::AttnNorm, V),
            (L::AttnQA, M),
            (L::AttnQANorm, V),
            (L::AttnQB, M),
            (L::AttnKv, M),
            (L::AttnKvNorm, V),
            (L::AttnSinks, V),
            (L::AttnOutputA, M),
            (L::AttnOutputB, M),
            (L::HcFfnFn, M),
            (L::HcFfnBase, V),
            (L::HcFfnScale, V),
            (L::FfnNorm, V),
            (L::RouterGate, M),
            (L::RouterBias, V),
            (L::GateExps, M),
            (L::UpExps, M),
            (L::DownExps, M),
            (L::GateShexp, M),
            (L::UpShexp, M),
            (L::DownShexp, M),
            (L::MtpHcHeadFn, M),
            (L::MtpHcHeadBase, V),
            (L::MtpHcHeadScale, V),
            (L::MtpNorm, V),
            (L::MtpEProj, M),
            (L::MtpHProj, M),
            (L::MtpENorm, V),
            (L::MtpHNorm, V),
        ];
        let list: Vec<(String, WeightUse)> =
            order.iter().map(|&(t, u)| (t.mtp_name(), u)).collect();
        let ws = be.load_weights(file, &list)?;
        if ws.len() != list.len() {
            return Err(EngineError::Config(format!(
                "MTP block: {} weights loaded for {} tensors",
                ws.len(),
                list.len()
            )));
        }
        let g = |t: LayerTensor| ws[order.iter().position(|&(x, _)| x == t).expect("listed")];
        let layer = LayerWeights {
            hc_attn: HcWeights {
                fn_: g(L::HcAttnFn),
                base: g(L::HcAttnBase),
                scale: g(L::HcAttnScale),
            },
            attn_norm: g(L::AttnNorm),
            q_a: g(L::AttnQA),
            q_a_norm: g(L::AttnQANorm),
            q_b: g(L::AttnQB),
            kv: g(L::AttnKv),
            kv_norm: g(L::AttnKvNorm),
            sinks: g(L::AttnSinks),
            out_a: g(L::AttnOutputA),
            out_b: g(L::AttnOutputB),
            comp: None,
            indexer: None,
            hc_ffn: HcWeights {
                fn_: g(L::HcFfnFn),
                base: g(L::HcFfnBase),
                scale: g(L::HcFfnScale),
            },
            ffn_norm: g(L::FfnNorm),
            router: g(L::RouterGate),
            router_bias: Some(g(L::RouterBias)),
            tid2eid: None,
            gate_exps: g(L::GateExps),
            up_exps: g(L::UpExps),
            down_exps: g(L::DownExps),
            gate_sh: g(L::GateShexp),
            up_sh: g(L::UpShexp),
            down_sh: g(L::DownShexp),
        };
        let w = ModelWeights {
            tok_embd: main.tok_embd,
            head_hc: HcWeights {
                fn_: g(L::MtpHcHeadFn),
                base: g(L::MtpHcHeadBase),
                scale: g(L::MtpHcHeadScale),
            },
            output_norm: g(L::MtpNorm),
            output: main.output,
            layers: vec![layer],
        };
        let proj = MtpProj {
            e_proj: g(L::MtpEProj),
            h_proj: g(L::MtpHProj),
            enorm: g(L::MtpENorm),
            hnorm: g(L::MtpHNorm),
        };
        let hp = ds4_model::mtp::block_hparams(main_hp);
        let win = hp.sliding_window;
        // Catch-up covers at most a window; chunks of `cap` rows.
        let cap = cap.min(win).max(1);
        let xw = hp.hc_mult * hp.n_embd;
        let scratch = Scratch::new(be, &hp, cap, 1)?;
        let state = KvState::new(be, &hp, ctx, fingerprint)?;
        Ok(Mtp {
            proj,
            scratch,
            state,
            ring_lo: 0,
            seen: Vec::new(),
            hist: be.alloc(win * xw)?,
            hist_tokens: Vec::new(),
            hist_lo: 0,
            tmp_a: be.alloc(cap * xw)?,
            tmp_b: be.alloc(cap * xw)?,
            undo: be.alloc(win * hp.head_dim)?,
            undo_rows: 0,
            hp,
            w,
        })
    }

    pub(crate) fn free(self, be: &mut dyn Backend) {
        self.scratch.free(be);
        self.state.free(be);
        for b in [self.hist, self.tmp_a, self.tmp_b, self.undo] {
            be.free(b);
        }
    }

    /// Records the main model's final streams of a call that evaluated `n` tokens at
    /// `pos0` (`x` holds them, one row each) for the sequence now holding `tokens`.
    pub(crate) fn record(
        &mut self,
        be: &mut dyn Backend,
        x: Buf,
        pos0: usize,
        n: usize,
        tokens: &[u32],
    ) -> Result<()> {
        let win = self.hp.sliding_window;
        let xw = self.hp.hc_mult * self.hp.n_embd;
        let end = pos0 + n;
        let continuing = self.hist_tokens.len() >= pos0
            && self.hist_lo <= pos0
            && self.hist_tokens[..pos0] == tokens[..pos0];
        let first = end.saturating_sub(win).max(pos0);
        for p in first..end {
            let src = x.rows(p - pos0, 1, xw);
            be.copy(src, self.hist.rows(p % win, 1, xw))?;
        }
        self.hist_lo = if continuing {
            self.hist_lo.max(end.saturating_sub(win))
        } else {
            first
        };
        self.hist_tokens.clear();
        self.hist_tokens.extend_from_slice(&tokens[..end]);
        Ok(())
    }

    /// Drafts up to `k` tokens after `main` (the main sequence's tokens) and `next` (the
    /// token about to be fed): depth 1 from the main model's streams, depth 2 on chained.
    /// `pick` gets each depth's logits and returns the draft (or `None` to stop). Returns
    /// nothing when the main streams the block needs were not recorded (a state restored
    /// from a snapshot, a batched step): the caller decodes without drafts.
    pub(crate) fn draft(
        &mut self,
        be: &mut dyn Backend,
        mode: NumericMode,
        main: &[u32],
        next: u32,
        k: usize,
        pick: &mut dyn FnMut(&[f32]) -> Option<u32>,
    ) -> Result<Vec<u32>> {
        let win = self.hp.sliding_window;
        let p = main.len();
        let mut drafts = Vec::new();
        if k == 0 || p == 0 {
            return Ok(drafts);
        }
        let need_lo = p.saturating_sub(win);
        if self.hist_tokens.len() < p || self.hist_tokens[..p] != *main {
            return Ok(drafts);
        }
        // Rows that still match the main tokens (row i used t_0 … t_{i+1}).
        let common = self
            .seen
            .iter()
            .zip(main.iter().chain(std::iter::once(&next)))
            .take_while(|(a, b)| a == b)
            .count();
        let keep = self.state.pos().min(common.saturating_sub(1));
        let written = self.state.pos();
        if keep < written {
            // Rows past `keep` were computed from other tokens; slots they overwrote are lost.
            self.ring_lo = self.ring_lo.max(written.saturating_sub(win)).min(keep);
            self.state.tokens.truncate(keep);
            self.seen.truncate(keep + usize::from(keep > 0));
        }
        let start = if self.ring_lo > need_lo || keep < need_lo {
            need_lo
        } else {
            keep
        };
        // The main streams of the rows to compute must still be kept.
        if self.hist_lo > start {
            return Ok(drafts);
        }
        if start != keep {
            self.state.tokens.resize(start, 0);
            self.ring_lo = start;
        }
        self.seen.clear();
        self.seen.extend_from_slice(&main[..p]);
        self.seen.push(next);
        // Catch-up: rows start … p−1 from the recorded streams (the last one yields depth 1).
        let cap = self.scratch_cap();
        let mut row = start;
        let mut logits = Vec::new();
        while row < p {
            let n = (p - row).min(cap);
            let toks: Vec<u32> = (row..row + n).map(|i| self.seen[i + 1]).collect();
            self.input_from_hist(be, row, n)?;
            self.block(be, mode, &toks, row + n == p)?;
            row += n;
        }
        self.logits(be, &mut logits)?;
        let Some(d) = pick(&logits) else {
            return Ok(drafts);
        };
        drafts.push(d);
        // Chained depths: provisional rows, their ring slots saved and put back.
        let committed = self.state.pos();
        self.undo_rows = 0;
        let r = (|| {
            while drafts.len() < k && self.undo_rows < win {
                let pos = self.state.pos();
                let slot = self.state.layers[0]
                    .ring
                    .rows(pos % win, 1, self.hp.head_dim);
                be.copy(slot, self.undo.rows(self.undo_rows, 1, self.hp.head_dim))?;
                self.undo_rows += 1;
                // The previous row's output streams are in row 0 of `x` (Mtp::block).
                self.input(be, 1, &[*drafts.last().expect("one draft")])?;
                self.block(be, mode, &[*drafts.last().expect("one draft")], true)?;
                self.logits(be, &mut logits)?;
                match pick(&logits) {
                    Some(d) => drafts.push(d),
                    None => break,
                }
            }
            Ok::<(), EngineError>(())
        })();
        for i in 0..self.undo_rows {
            let slot = self.state.layers[0]
                .ring
                .rows((committed + i) % win, 1, self.hp.head_dim);
            be.copy(self.undo.rows(i, 1, self.hp.head_dim), slot)?;
        }
        self.state.tokens.truncate(committed);
        r?;
        Ok(drafts)
    }

    fn scratch_cap(&self) -> usize {
        self.tmp_a.len() / (self.hp.hc_mult * self.hp.n_embd)
    }

    /// The input streams of `n` rows at `row…` from the recorded main streams.
    fn input_from_hist(&mut self, be: &mut dyn Backend, row: usize, n: usize) -> Result<()> {
        let win = self.hp.sliding_window;
        let xw = self.hp.hc_mult * self.hp.n_embd;
        for i in 0..n {
            let src = self.hist.rows((row + i) % win, 1, xw);
            be.copy(src, self.scratch.x.rows(i, 1, xw))?;
        }
        let toks: Vec<u32> = (row..row + n).map(|i| self.seen[i + 1]).collect();
        self.input(be, n, &toks)
    }

    /// Turns the streams in the scratch's `x` (`n` rows) into the block's input with the
    /// tokens `toks`: each stream `W_h·RMS(h; hnorm)`, plus `W_e·RMS(Emb[t]; enorm)`
    /// (the same for every stream; computed per stream row, so the embedding's projection
    /// runs on identical rows).
    fn input(&mut self, be: &mut dyn Backend, n: usize, toks: &[u32]) -> Result<()> {
        let (d, nh) = (self.hp.n_embd, self.hp.hc_mult);
        let eps = self.hp.rms_eps;
        let rows = n * nh;
        let x = self.scratch.x.rows(0, n, nh * d);
        let a = self.tmp_a.rows(0, n, nh * d);
        let b = self.tmp_b.rows(0, n, nh * d);
        be.rms_norm(x, Some(self.proj.hnorm), rows, d, eps, a)?;
        be.matmul(self.proj.h_proj, 0, a, rows, x)?;
        let ids: Vec<i32> = toks.iter().map(|&t| t as i32).collect();
        be.upload_i32(self.scratch.tokens, 0, &ids)?;
        be.embed(self.w.tok_embd, self.scratch.tokens, n, nh, b)?;
        be.rms_norm(b, Some(self.proj.enorm), rows, d, eps, a)?;
        be.matmul(self.proj.e_proj, 0, a, rows, b)?;
        be.add(x, b)?;
        Ok(())
    }

    /// Runs the block over the rows in the scratch's `x` with tokens `toks` at the state's
    /// next positions; `last`: the last row's logits.
    fn block(
        &mut self,
        be: &mut dyn Backend,
        mode: NumericMode,
        toks: &[u32],
        last: bool,
    ) -> Result<()> {
        let mut m = Model {
            hp: &self.hp,
            w: &self.w,
            mode,
            stream: None,
            census: None,
            streams_in: true,
        };
        let want = if last { Want::Last } else { Want::None };
        forward(
            be,
            &mut m,
            &self.scratch,
            &mut [Seq {
                state: &mut self.state,
                tokens: toks,
            }],
            want,
        )?;
        if last && toks.len() > 1 {
            // The chain continues from the last row's output streams.
            let xw = self.hp.hc_mult * self.hp.n_embd;
            be.copy(
                self.scratch.x.rows(toks.len() - 1, 1, xw),
                self.tmp_b.rows(0, 1, xw),
            )?;
            be.copy(self.tmp_b.rows(0, 1, xw), self.scratch.x.rows(0, 1, xw))?;
        }
        Ok(())
    }

    fn logits(&mut self, be: &mut dyn Backend, out: &mut Vec<f32>) -> Result<()> {
        let v = self.hp.n_vocab;
        out.resize(v, 0.0);
        be.download(self.scratch.logits.rows(0, 1, v), out)?;
        Ok(())
    }
}
