//! The DeepSeek V4 forward pass, written once over [`Backend`] ops (docs/forward.md §3–§7).
//!
//! One call processes a chunk of `T` consecutive tokens at positions `pos0..pos0+T`
//! against a [`KvState`] holding everything before `pos0`. Prefill, chunked prefill and
//! decode (`T = 1`) are the same code; the math per token is identical in all three (docs/forward.md §3
//! "Causality"), and the CPU backend's ops make them agree bit for bit.

use ds4_model::{AttnKind, HParams};

use crate::backend::{
    AttnArgs, Backend, Buf, CompSel, CompressorCall, HcArgs, HcPost, IBuf, IndexerArgs,
    IndexerCall, MatmulPair, MoeArgs, NormRopeCall, RingStoreCall, RopeArgs, RopeFreq, RouterArgs,
    Routing, Slice, Weight,
};
use crate::config::NumericMode;
use crate::error::{EngineError, Result};
use crate::expert_stream::ExpertStream;
use crate::state::{CompState, KvState};
use crate::weights::{CompressorWeights, ModelWeights};

/// Which logits a chunk must produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    None,
    Last,
    All,
}

/// Sequences of a batched decode step whose attention runs as one op
/// ([`Backend::attention_batch`]).
const BATCH_SELS: usize = 64;

/// Activation buffers for chunks of up to `cap` tokens, allocated once per engine.
#[derive(Debug)]
pub(crate) struct Scratch {
    pub logit_rows: usize,
    pub(crate) tokens: IBuf,
    /// Each row's position in a batched decode step (one row per sequence).
    pos: IBuf,
    /// The HC streams `[cap, n·D]`; after a call, each row's final streams (the MTP
    /// block's input, docs/forward.md §10).
    pub(crate) x: Buf,
    mix: Buf,
    y: Buf,
    post: Buf,
    comb: Buf,
    a: Buf,
    cq: Buf,
    cqn: Buf,
    q: Buf,
    kv: Buf,
    cu: Buf,
    cz: Buf,
    /// The indexer compressor's projections (apart from `cu`/`cz`: both compressors'
    /// matmuls run over every row of a step before the per-sequence ops).
    icu: Buf,
    icz: Buf,
    iq: Buf,
    iw: Buf,
    sel: IBuf,
    /// One indexer selection per sequence of a batched decode step (up to this many
    /// sequences; beyond, their attention runs one sequence at a time through `sel`).
    sels: Vec<IBuf>,
    o: Buf,
    low: Buf,
    f: Buf,
    rl: Buf,
    eids: IBuf,
    ew: Buf,
    sg: Buf,
    su: Buf,
    sh: Buf,
    sf: Buf,
    hmix: Buf,
    pub logits: Buf,
    /// One i32: the greedy token of the last logits row ([`Backend::argmax`]).
    pub argmax: IBuf,
    /// The sampling band of the last logits row ([`Backend::logit_band`]).
    pub band: IBuf,
    /// One band per row of a batched decode step ([`crate::Engine::eval_batch_bands`]),
    /// for up to [`BATCH_SELS`] rows.
    pub bands: Vec<IBuf>,
}

impl Scratch {
    pub fn new(
        be: &mut dyn Backend,
        hp: &HParams,
        cap: usize,
        logit_rows: usize,
    ) -> Result<Scratch> {
        let d = hp.n_embd;
        let n = hp.hc_mult;
        let proj = 2 * hp.head_dim;
        let iproj = (2 * hp.indexer_head_dim).max(1);
        let k_sel = hp.indexer_top_k.max(1);
        Ok(Scratch {
            logit_rows,
            tokens: be.alloc_i32(cap)?,
            pos: be.alloc_i32(cap)?,
            x: be.alloc(cap * n * d)?,
            mix: be.alloc(cap * hp.hc_mix())?,
            y: be.alloc(cap * d)?,
            post: be.alloc(cap * n)?,
            comb: be.alloc(cap * n * n)?,
            a: be.alloc(cap * d)?,
            cq: be.alloc(cap * hp.q_lora_rank)?,
            cqn: be.alloc(cap * hp.q_lora_rank)?,
            q: be.alloc(cap * hp.n_head * hp.head_dim)?,
            kv: be.alloc(cap * hp.head_dim)?,
            cu: be.alloc(cap * proj)?,
            cz: be.alloc(cap * proj)?,
            icu: be.alloc(cap * iproj)?,
            icz: be.alloc(cap * iproj)?,
            iq: be.alloc(cap * (hp.indexer_heads * hp.indexer_head_dim).max(1))?,
            iw: be.alloc(cap * hp.indexer_heads.max(1))?,
            sel: be.alloc_i32(cap * k_sel)?,
            sels: (0..BATCH_SELS.min(cap))
                .map(|_| be.alloc_i32(k_sel))
                .collect::<std::result::Result<_, _>>()?,
            o: be.alloc(cap * hp.n_head * hp.head_dim)?,
            low: be.alloc(cap * hp.o_groups * hp.o_lora_rank)?,
            f: be.alloc(cap * d)?,
            rl: be.alloc(cap * hp.n_expert)?,
            eids: be.alloc_i32(cap * hp.n_expert_used)?,
            ew: be.alloc(cap * hp.n_expert_used)?,
            sg: be.alloc(cap * hp.expert_ff)?,
            su: be.alloc(cap * hp.expert_ff)?,
            sh: be.alloc(cap * hp.expert_ff)?,
            sf: be.alloc(cap * d)?,
            hmix: be.alloc(cap * n)?,
            logits: be.alloc(logit_rows.max(1) * hp.n_vocab)?,
            argmax: be.alloc_i32(1)?,
            band: be.alloc_i32(crate::sampler::BAND_HEAD + 2 * crate::sampler::BAND_CAP)?,
            bands: (0..if logit_rows > 1 {
                BATCH_SELS.min(logit_rows)
            } else {
                0
            })
                .map(|_| be.alloc_i32(crate::sampler::BAND_HEAD + 2 * crate::sampler::BAND_CAP))
                .collect::<std::result::Result<_, _>>()?,
        })
    }

    pub fn free(self, be: &mut dyn Backend) {
        for b in [
            self.x,
            self.mix,
            self.y,
            self.post,
            self.comb,
            self.a,
            self.cq,
            self.cqn,
            self.q,
            self.kv,
            self.cu,
            self.cz,
            self.icu,
            self.icz,
            self.iq,
            self.iw,
            self.o,
            self.low,
            self.f,
            self.rl,
            self.ew,
            self.sg,
            self.su,
            self.sh,
            self.sf,
            self.hmix,
            self.logits,
        ] {
            be.free(b);
        }
        for b in [
            self.tokens,
            self.pos,
            self.sel,
            self.eids,
            self.argmax,
            self.band,
        ] {
            be.free_i32(b);
        }
        for b in self.sels.into_iter().chain(self.bands) {
            be.free_i32(b);
        }
    }
}

/// RoPE schedule of layer `il` (docs/forward.md §2.3): plain base on sliding layers, the compressed
/// base with YaRN on compressed layers.
pub fn layer_rope(hp: &HParams, il: usize) -> RopeFreq {
    match hp.attn_kind(il) {
        AttnKind::Sliding => RopeFreq {
            base: hp.rope_freq_base,
            yarn: None,
            rope_dim: hp.rope_dim,
        },
        _ => RopeFreq {
            base: hp.compress_rope_freq_base,
            yarn: Some(hp.yarn),
            rope_dim: hp.rope_dim,
        },
    }
}

/// Everything a chunk needs besides the backend, the scratch and the state.
pub(crate) struct Model<'a> {
    pub hp: &'a HParams,
    pub w: &'a ModelWeights,
    pub mode: NumericMode,
    /// Streamed routed experts: the layers' routed weights are its slot pools and the
    /// router's ids go through its cache (docs/placement.md §9).
    pub stream: Option<&'a mut ExpertStream>,
    /// Routing counts ([`crate::Engine::set_route_census`]), when on.
    pub census: Option<&'a mut crate::census::RouteCensus>,
    /// The caller has written the chunk's input streams into the scratch's `x` (the MTP
    /// block, docs/forward.md §10) instead of the token embedding.
    pub streams_in: bool,
}

/// One sequence's part of a forward call: its state and the tokens that follow it.
pub(crate) struct Seq<'a> {
    pub state: &'a mut KvState,
    pub tokens: &'a [u32],
}

/// Runs one chunk. `toks` must be non-empty, at most `s.cap` long, valid ids, and fit in
/// the state's context (checked by the caller). Logits land in `s.logits`
/// (`[rows, n_vocab]`, rows = 1 for `Last`, `T` for `All`).
pub(crate) fn forward_chunk(
    be: &mut dyn Backend,
    m: &mut Model,
    s: &Scratch,
    st: &mut KvState,
    toks: &[u32],
    want: Want,
) -> Result<()> {
    forward(
        be,
        m,
        s,
        &mut [Seq {
            state: st,
            tokens: toks,
        }],
        want,
    )
}

/// Runs the tokens of several sequences in one pass (rows in sequence order). Two shapes:
/// - a batched decode step (every sequence brings one token): every op that only mixes a
///   row with weights runs once over all rows (weights read once), and the ops that
///   depend on a sequence's positions and cache (RoPE, compressors, indexer, attention,
///   ring) run per sequence; `Want::Last` yields one logits row per sequence;
/// - a joint prefill (several sequences, some with more tokens): each sequence's ops run
///   as in a call of its own rows alone, except the routed experts, which run once over
///   every row (docs/forward.md §14); `Want::Last` yields each sequence's last row, in
///   sequence order. The caller checks that every sequence's rows are that alone
///   ([`Backend::moe_joint_min_rows`]); no expert streaming, no `Want::All`.
///
/// The caller checks sizes, ids and contexts.
pub(crate) fn forward(
    be: &mut dyn Backend,
    m: &mut Model,
    s: &Scratch,
    seqs: &mut [Seq],
    want: Want,
) -> Result<()> {
    let hp = m.hp;
    let t_all: usize = seqs.iter().map(|q| q.tokens.len()).sum();
    let batched_step = seqs.len() > 1 && seqs.iter().all(|q| q.tokens.len() == 1);
    let joint = seqs.len() > 1 && !batched_step;
    if joint && (m.stream.is_some() || want == Want::All) {
        return Err(EngineError::Config(
            "a joint prefill streams no experts and yields only each sequence's last logits".into(),
        ));
    }
    // (first row, rows, position of the first row) of every sequence.
    let spans_all: Vec<(usize, usize, usize)> = seqs
        .iter()
        .scan(0, |r, q| {
            let span = (*r, q.tokens.len(), q.state.pos());
            *r += q.tokens.len();
            Some(span)
        })
        .collect();
    // The rows whose dense ops run as one call: each sequence of a joint prefill alone,
    // else every row.
    let groups: Vec<Group> = if joint {
        spans_all
            .iter()
            .enumerate()
            .map(|(i, &(r0, t, _))| Group {
                s0: i,
                ns: 1,
                r0,
                t,
            })
            .collect()
    } else {
        vec![Group {
            s0: 0,
            ns: seqs.len(),
            r0: 0,
            t: t_all,
        }]
    };
    let (dm, nh, hd) = (hp.n_embd, hp.n_head, hp.head_dim);
    let n_hc = hp.hc_mult;
    let xw = n_hc * dm;
    let eps = hp.rms_eps;
    let official = m.mode == NumericMode::Official;
    let nope = hd - hp.rope_dim;
    let ids: Vec<i32> = seqs
        .iter()
        .flat_map(|q| q.tokens.iter().map(|&x| x as i32))
        .collect();
    be.upload_i32(s.tokens, 0, &ids)?;
    // A batched step's rows are at their own sequences' positions: RoPE reads them from
    // the device (one launch for all rows); a single sequence's rows are consecutive.
    let step_pos = if batched_step {
        let pos: Vec<i32> = spans_all
            .iter()
            .map(|&(_, _, p)| {
                i32::try_from(p).map_err(|_| {
                    EngineError::Config(format!("position {p} beyond the 32-bit rows of RoPE"))
                })
            })
            .collect::<Result<_>>()?;
        be.upload_i32(s.pos, 0, &pos)?;
        Some(s.pos)
    } else {
        None
    };
    let hc_all = HcArgs {
        n_tok: t_all,
        n_hc,
        dim: dm,
        sinkhorn_iters: hp.hc_sinkhorn_iters,
        hc_eps: hp.hc_eps,
        rms_eps: eps,
    };

    if !m.streams_in {
        be.annotate("embed");
        be.embed(m.w.tok_embd, s.tokens, t_all, n_hc, s.x.rows(0, t_all, xw))?;
    }

    // The HCPost of the sublayer just finished waits for the next sublayer's HCPre, which
    // applies it on the way (Backend::hc_post_mix_pre_norm); the last one is applied
    // before the head. Kept over all rows; each group applies its own.
    let mut pending_all: Option<HcPost> = None;
    let weights = m.w;
    let k = hp.n_expert_used;
    for (il, lw) in weights.layers.iter().enumerate() {
        let freq = layer_rope(hp, il);
        for g in &groups {
            let (r0, t) = (g.r0, g.t);
            let seqs = &mut seqs[g.s0..g.s0 + g.ns];
            let spans: Vec<(usize, usize, usize)> = spans_all[g.s0..g.s0 + g.ns]
                .iter()
                .map(|&(r, n, p)| (r - r0, n, p))
                .collect();
            let batched = g.ns > 1;
            let row_pos = if batched { step_pos } else { None };
            let pos_first = spans[0].2;
            let x = s.x.rows(r0, t, xw);
            let hc = HcArgs { n_tok: t, ..hc_all };
            let y = s.y.rows(r0, t, dm);
            let a = s.a.rows(r0, t, dm);
            let mix = s.mix.rows(r0, t, hp.hc_mix());
            let post = s.post.rows(r0, t, n_hc);
            let comb = s.comb.rows(r0, t, n_hc * n_hc);
            let f = s.f.rows(r0, t, dm);
            let mut pending = pending_all;
            let rope =
                |n_rows: usize, n_heads: usize, head_dim: usize, p0: usize, step: usize| RopeArgs {
                    n_rows,
                    n_heads,
                    head_dim,
                    pos0: p0,
                    pos_step: step,
                    freq,
                    inverse: false,
                    row_pos: None,
                };
            // Every row of the step at its own position (see `step_pos`).
            let rope_step = |n_heads: usize, inverse: bool| RopeArgs {
                inverse,
                row_pos,
                ..rope(t, n_heads, hd, pos_first, 1)
            };
            // ---- attention sublayer (docs/forward.md §5) ----
            be.annotate(match hp.attn_kind(il) {
                AttnKind::Sliding => "attn.sliding",
                AttnKind::Csa => "attn.csa",
                AttnKind::Hca(_) => "attn.hca",
            });
            let (hf, hb, hs) = (lw.hc_attn.fn_, lw.hc_attn.base, lw.hc_attn.scale);
            hc_enter(
                be,
                pending.take().map(|p| p.rows(r0, t, dm, n_hc)),
                (hf, hb, hs),
                x,
                mix,
                hc,
                lw.attn_norm,
                y,
                post,
                comb,
                a,
            )?;

            // Every matmul of the sublayer's input `a` in one op (Backend::matmul_set: a device
            // prepares `a` once for all of them): the low-rank query, the KV row, and the
            // compressors' and the indexer's projections, which read only the rows, not
            // positions or caches, so they run once over every row of the step (each weight
            // read once for all sequences); the position-dependent ops come after them per
            // sequence.
            let cq_all = s.cq.rows(r0, t, hp.q_lora_rank);
            let kv_all = s.kv.rows(r0, t, hd);
            let ls0 = seqs[0].state.layers[il];
            let (ih, id) = (hp.indexer_heads, hp.indexer_head_dim);
            let iq_all = s.iq.rows(r0, t, ih * id);
            let iw_all = s.iw.rows(r0, t, ih);
            let mut singles = vec![(lw.q_a, cq_all), (lw.kv, kv_all)];
            let mut pairs = Vec::with_capacity(2);
            let comp_proj = match (ls0.comp, lw.comp.as_ref()) {
                (Some(cs), Some(cw)) => {
                    let pw = cs.chunk_args(0, t).proj_width();
                    let (cu, cz) = (s.cu.rows(r0, t, pw), s.cz.rows(r0, t, pw));
                    pairs.push(MatmulPair {
                        wa: cw.kv,
                        wb: cw.gate,
                        ya: cu,
                        yb: cz,
                    });
                    Some((cu, cz))
                }
                _ => None,
            };
            // Indexer scores are only needed once some query sees more rows than it may pick.
            let mut index_scores = false;
            let index_proj = match (ls0.index, lw.indexer.as_ref()) {
                (Some(is), Some(iw)) if comp_proj.is_some() => {
                    let pw = is.chunk_args(0, t).proj_width();
                    let (cu, cz) = (s.icu.rows(r0, t, pw), s.icz.rows(r0, t, pw));
                    pairs.push(MatmulPair {
                        wa: iw.comp.kv,
                        wb: iw.comp.gate,
                        ya: cu,
                        yb: cz,
                    });
                    index_scores = spans
                        .iter()
                        .any(|&(_, n, p0)| (p0 + n) / is.ratio > hp.indexer_top_k);
                    if index_scores {
                        singles.push((iw.proj, iw_all));
                    }
                    Some((cu, cz))
                }
                _ => None,
            };
            be.matmul_set(a, t, &singles, &pairs)?;
            // The query's norm (into cqn) and q_b in one op (Backend::rms_norm_matmul); the
            // indexer's up-projection reads cqn below.
            let cqn = s.cqn.rows(r0, t, hp.q_lora_rank);
            let q_all = s.q.rows(r0, t, nh * hd);
            be.rms_norm_matmul(cq_all, lw.q_a_norm, eps, cqn, lw.q_b, t, q_all)?;
            let o_all = s.o.rows(r0, t, nh * hd);
            let q_call = NormRopeCall {
                x: q_all,
                w: None,
                eps,
                rope: rope_step(nh, false),
                fp8_dims: None,
            };
            let kv_call = NormRopeCall {
                x: kv_all,
                w: Some(lw.kv_norm),
                eps,
                rope: rope_step(1, false),
                fp8_dims: official.then_some(nope),
            };
            // A one-token step stores its KV row in the ring right away (its attention never
            // reads that slot); longer chunks store after their attention, which still reads
            // the slots their rows would overwrite.
            let store_early = !batched && t == 1;
            if store_early {
                let store = RingStoreCall {
                    ring: seqs[0].state.layers[il].ring.all(),
                    kv: kv_all,
                    pos0: spans[0].2,
                    n_tok: 1,
                    window: hp.sliding_window,
                };
                be.norm_rope_pair_store(q_call, kv_call, store)?;
            } else {
                be.norm_rope_pair(q_call, kv_call)?;
            }
            if let (true, Some(iw)) = (index_scores, lw.indexer.as_ref()) {
                be.matmul(iw.q_b, 0, cqn, t, iq_all)?;
                // Every row at its own position (rows of sequences that need no scores are
                // rotated too and never read).
                let iq_rope = RopeArgs {
                    row_pos,
                    ..rope(t, ih, id, pos_first, 1)
                };
                if official {
                    be.rope_qat_hadamard_fp4(iq_all, iq_rope, t * ih, id)?;
                } else {
                    be.rope(iq_all, iq_rope)?;
                }
            }

            // The ops that read a sequence's caches, in phases; in a batched step each phase is
            // one batch op over a group of sequences (one launch each on a device, each
            // sequence with its own indexer selection buffer): compressor state updates, then
            // the rows they emitted finished, the indexer's the same, its top-k, attention and
            // the ring stores.
            let group_len = if batched { s.sels.len().max(1) } else { 1 };
            let sel_of = |i: usize| if batched { s.sels[i] } else { s.sel };
            let seq_rows = |x: Slice, width: usize, (r0, t, _): (usize, usize, usize)| {
                x.sub(r0 * width, t * width)
            };
            let no_state =
                || EngineError::Config(format!("layer {il}: a sequence has no compressor state"));
            for (g, group) in spans.chunks(group_len).enumerate() {
                let gseqs = &seqs[g * group_len..g * group_len + group.len()];
                let mut comp = vec![CompSel::None; group.len()];
                // One sequence with both compressors (a CSA layer): their updates are independent,
                // so they go first as one op (Backend::compressor_pair), then each one's rows are
                // finished.
                let ls = gseqs[0].state.layers[il];
                let paired = match (comp_proj, lw.comp.as_ref(), ls.comp) {
                    (Some(cp), Some(cw), Some(cs)) if !batched => {
                        match (index_proj, lw.indexer.as_ref(), ls.index) {
                            (Some(ip), Some(iw), Some(is)) => {
                                let a = compressor_call(&cs, group[0], cp, cw.ape);
                                let b = compressor_call(&is, group[0], ip, iw.comp.ape);
                                be.compressor_pair(a, b)?;
                                true
                            }
                            _ => false,
                        }
                    }
                    _ => false,
                };
                if let (Some((cu, cz)), Some(cw)) = (comp_proj, lw.comp.as_ref()) {
                    let states = gseqs
                        .iter()
                        .map(|q| q.state.layers[il].comp.ok_or_else(no_state))
                        .collect::<Result<Vec<_>>>()?;
                    if !paired {
                        compressors(be, &states, group, (cu, cz), cw.ape, batched)?;
                    }
                    for (i, (cs, &(_, t, pos0))) in states.iter().zip(group).enumerate() {
                        finish_rows(be, *cs, cw, pos0, t, eps, |be, rows, n, w0| {
                            be.rope(rows, rope(n, 1, hd, w0 * cs.ratio, cs.ratio))?;
                            if official {
                                be.qat_fp8(rows, n, hd, nope)?;
                            }
                            Ok(())
                        })?;
                        comp[i] = CompSel::All {
                            rows: cs.rows.all(),
                            ratio: cs.ratio,
                        };
                    }
                }
                if let (Some((icu, icz)), Some(iw)) = (index_proj, lw.indexer.as_ref()) {
                    let states = gseqs
                        .iter()
                        .map(|q| q.state.layers[il].index.ok_or_else(no_state))
                        .collect::<Result<Vec<_>>>()?;
                    if !paired {
                        compressors(be, &states, group, (icu, icz), iw.comp.ape, batched)?;
                    }
                    let mut calls = Vec::with_capacity(group.len());
                    for (i, (is, &sp)) in states.iter().zip(group).enumerate() {
                        let (_, t, pos0) = sp;
                        finish_rows(be, *is, &iw.comp, pos0, t, eps, |be, rows, n, w0| {
                            be.rope(rows, rope(n, 1, id, w0 * is.ratio, is.ratio))?;
                            if official {
                                be.qat_hadamard_fp4(rows, n, id)?;
                            }
                            Ok(())
                        })?;
                        let (iq, iwt) = (seq_rows(iq_all, ih * id, sp), seq_rows(iw_all, ih, sp));
                        let sel = sel_of(g * group_len + i);
                        calls.push(IndexerCall {
                            q: iq,
                            w: iwt,
                            rows: is.rows.all(),
                            args: IndexerArgs {
                                pos0,
                                n_tok: t,
                                ratio: is.ratio,
                                n_heads: ih,
                                head_dim: id,
                                top_k: hp.indexer_top_k,
                                weight_scale: (1.0 / ((id * ih) as f64).sqrt()) as f32,
                            },
                            out: sel,
                        });
                        if let CompSel::All { rows, ratio } = comp[i] {
                            comp[i] = CompSel::Top {
                                rows,
                                ratio,
                                idx: sel,
                                k: hp.indexer_top_k,
                            };
                        }
                    }
                    if batched {
                        be.indexer_topk_batch(&calls)?;
                    } else {
                        for c in &calls {
                            be.indexer_topk(c.q, c.w, c.rows, c.args, c.out)?;
                        }
                    }
                }
                let attn: Vec<AttnArgs> = gseqs
                    .iter()
                    .zip(group)
                    .zip(&comp)
                    .map(|((seq, &sp), &comp)| AttnArgs {
                        q: seq_rows(q_all, nh * hd, sp),
                        kv: seq_rows(kv_all, hd, sp),
                        ring: seq.state.layers[il].ring.all(),
                        comp,
                        sinks: lw.sinks,
                        pos0: sp.2,
                        n_tok: sp.1,
                        n_head: nh,
                        head_dim: hd,
                        window: hp.sliding_window,
                        scale: (1.0 / (hd as f64).sqrt()) as f32,
                        out: seq_rows(o_all, nh * hd, sp),
                    })
                    .collect();
                let stores: Vec<RingStoreCall> = attn
                    .iter()
                    .map(|a| RingStoreCall {
                        ring: a.ring,
                        kv: a.kv,
                        pos0: a.pos0,
                        n_tok: a.n_tok,
                        window: a.window,
                    })
                    .collect();
                if batched {
                    be.attention_batch(&attn)?;
                    be.ring_store_batch(&stores)?;
                } else {
                    for (a, r) in attn.iter().zip(&stores) {
                        be.attention(*a)?;
                        if !store_early {
                            be.ring_store(r.ring, r.kv, r.pos0, r.n_tok, r.window)?;
                        }
                    }
                }
            }
            let low = s.low.rows(r0, t, hp.o_groups * hp.o_lora_rank);
            be.rope_matmul_grouped(o_all, rope_step(nh, true), lw.out_a, hp.o_groups, t, low)?;
            be.matmul(lw.out_b, 0, low, t, f)?;
            pending = Some(HcPost {
                f,
                f2: None,
                post,
                comb,
            });

            // ---- MoE sublayer (docs/forward.md §6): HCPre and the router per group ----
            be.annotate(if lw.tid2eid.is_some() {
                "moe.hash"
            } else {
                "moe.topk"
            });
            let (hf, hb, hs) = (lw.hc_ffn.fn_, lw.hc_ffn.base, lw.hc_ffn.scale);
            hc_enter(
                be,
                pending.take(),
                (hf, hb, hs),
                x,
                mix,
                hc,
                lw.ffn_norm,
                y,
                post,
                comb,
                a,
            )?;
            let rl = s.rl.rows(r0, t, hp.n_expert);
            let routing = match lw.tid2eid {
                Some(table) => Routing::Hash {
                    table,
                    tokens: s.tokens,
                },
                None => Routing::TopK {
                    bias: lw.router_bias,
                },
            };
            be.router_matmul(
                lw.router,
                a,
                rl,
                routing,
                RouterArgs {
                    n_tok: t,
                    n_expert: hp.n_expert,
                    k,
                    scale: hp.expert_weights_scale,
                    row0: r0,
                },
                s.eids,
                s.ew.rows(r0, t, k),
            )?;
        }

        if let Some(c) = m.census.as_deref_mut() {
            let mut ids = vec![0i32; t_all * k];
            be.download_i32(s.eids, 0, &mut ids)?;
            c.record(il, &ids);
        }
        // The routed experts: one call over every row (docs/forward.md §14).
        let a = s.a.rows(0, t_all, dm);
        let f = s.f.rows(0, t_all, dm);
        let ew = s.ew.rows(0, t_all, k);
        let clamp = hp.swiglu_clamp[il];
        let margs = MoeArgs {
            n_tok: t_all,
            k,
            clamp,
        };
        match m.stream.as_deref_mut() {
            None => be.moe(
                a,
                s.eids,
                ew,
                lw.gate_exps,
                lw.up_exps,
                lw.down_exps,
                margs,
                f,
            )?,
            Some(stream) => {
                // A prefill is never cut into one-token runs: the int8-activation rule
                // treats a call of at most the decode rows as decode
                // (Backend::set_activation_q8); a batched decode step's rows are all
                // decode rows, so any run of them is computed as in the whole step.
                let min_run = if batched_step { 1 } else { 2 };
                if let Some(next) = m.w.layers.get(il + 1) {
                    let rargs = RouterArgs {
                        n_tok: t_all,
                        n_expert: hp.n_expert,
                        k,
                        scale: hp.expert_weights_scale,
                        row0: 0,
                    };
                    stream.predict(be, il + 1, next, a, s.tokens, rargs)?;
                }
                stream.moe(be, il, a, s.eids, ew, margs, f, min_run)?
            }
        }
        // The shared expert per group (a dense op).
        let ff = hp.expert_ff;
        for g in &groups {
            let (r0, t) = (g.r0, g.t);
            let a = s.a.rows(r0, t, dm);
            let (sg, su, sh) = (
                s.sg.rows(r0, t, ff),
                s.su.rows(r0, t, ff),
                s.sh.rows(r0, t, ff),
            );
            be.matmul_pair(lw.gate_sh, lw.up_sh, a, t, sg, su)?;
            let sf = s.sf.rows(r0, t, dm);
            be.swiglu_matmul(sg, su, clamp, sh, lw.down_sh, t, sf)?;
        }
        pending_all = Some(HcPost {
            f,
            f2: Some(s.sf.rows(0, t_all, dm)),
            post: s.post.rows(0, t_all, n_hc),
            comb: s.comb.rows(0, t_all, n_hc * n_hc),
        });
    }
    for g in &groups {
        let hc = HcArgs {
            n_tok: g.t,
            ..hc_all
        };
        let x = s.x.rows(g.r0, g.t, xw);
        match pending_all.map(|p| p.rows(g.r0, g.t, dm, n_hc)) {
            Some(HcPost {
                f,
                f2: Some(f2),
                post,
                comb,
            }) => be.hc_post_add(x, f, f2, post, comb, hc)?,
            Some(HcPost {
                f,
                f2: None,
                post,
                comb,
            }) => be.hc_post(x, f, post, comb, hc)?,
            None => {}
        }
    }
    for q in seqs.iter_mut() {
        q.state.tokens.extend_from_slice(q.tokens);
    }
    if let Some(c) = m.census.as_deref_mut() {
        c.calls += 1;
    }

    // ---- head (docs/forward.md §4.3, §7): per group, logits rows in sequence order ----
    if want == Want::None {
        return Ok(());
    }
    be.annotate("head");
    for g in &groups {
        let (t0, nt) = match want {
            Want::Last if g.ns > 1 => (0, g.t),
            Want::Last => (g.t - 1, 1),
            _ => (0, g.t),
        };
        let xs = s.x.rows(g.r0 + t0, nt, xw);
        let hmix = s.hmix.rows(0, nt, n_hc);
        let hy = s.y.rows(0, nt, dm);
        let hc1 = HcArgs {
            n_tok: nt,
            ..hc_all
        };
        be.matmul(m.w.head_hc.fn_, 0, xs, nt, hmix)?;
        be.hc_head(hmix, xs, m.w.head_hc.base, m.w.head_hc.scale, hc1, hy)?;
        be.rms_norm(hy, Some(m.w.output_norm), nt, dm, eps, hy)?;
        be.matmul(m.w.output, 0, hy, nt, s.logits.rows(g.s0, nt, hp.n_vocab))?;
    }
    Ok(())
}

/// Rows of a forward call whose dense ops run as one call: a sequence of a joint prefill,
/// or every sequence of a batched decode step (or the one sequence of a chunk).
#[derive(Debug, Clone, Copy)]
struct Group {
    /// First sequence and number of sequences.
    s0: usize,
    ns: usize,
    /// First row and number of rows.
    r0: usize,
    t: usize,
}

/// A sublayer's HCPre (mixing matmul, HCPre, input RMSNorm), with the previous sublayer's
/// HCPost folded in when there is one.
#[allow(clippy::too_many_arguments)]
fn hc_enter(
    be: &mut dyn Backend,
    prev: Option<HcPost>,
    (fn_, base, scale): (Weight, Weight, Weight),
    x: Slice,
    mix: Slice,
    hc: HcArgs,
    norm: Weight,
    y: Slice,
    post: Slice,
    comb: Slice,
    out: Slice,
) -> Result<()> {
    match prev {
        Some(p) => {
            be.hc_post_mix_pre_norm(p, fn_, x, mix, base, scale, hc, norm, y, post, comb, out)?
        }
        None => be.hc_mix_pre_norm(fn_, x, mix, base, scale, hc, norm, y, post, comb, out)?,
    }
    Ok(())
}

/// Feeds each sequence of a group its rows of the step's projections `(u, z)` (computed
/// over the whole step) through its compressor: one batch op for a batched step's
/// sequences, else the plain op. `spans` are the sequences' (first row, rows, position).
fn compressors(
    be: &mut dyn Backend,
    states: &[CompState],
    spans: &[(usize, usize, usize)],
    (u, z): (Slice, Slice),
    ape: crate::backend::Weight,
    batched: bool,
) -> Result<()> {
    let calls: Vec<CompressorCall> = states
        .iter()
        .zip(spans)
        .map(|(cs, &sp)| compressor_call(cs, sp, (u, z), ape))
        .collect();
    if batched {
        be.compressor_batch(&calls)?;
    } else {
        for c in &calls {
            be.compressor(c.acc, c.u, c.z, c.ape, c.args, c.rows)?;
        }
    }
    Ok(())
}

/// The compressor call of one sequence (first row `r0`, `t` rows at `pos0`) over the step's
/// projections `(u, z)`.
fn compressor_call(
    cs: &CompState,
    (r0, t, pos0): (usize, usize, usize),
    (u, z): (Slice, Slice),
    ape: Weight,
) -> CompressorCall {
    let args = cs.chunk_args(pos0, t);
    let pw = args.proj_width();
    CompressorCall {
        acc: cs.acc.all(),
        u: u.sub(r0 * pw, t * pw),
        z: z.sub(r0 * pw, t * pw),
        ape,
        args,
        rows: cs.rows.all(),
    }
}

/// Finishes the rows a compressor emitted for a chunk of `t` tokens at `pos0`: RMSNorm with
/// the compressor's weight, then `finish` (RoPE at the window's first position, QAT).
#[allow(clippy::too_many_arguments)]
fn finish_rows(
    be: &mut dyn Backend,
    cs: CompState,
    cw: &CompressorWeights,
    pos0: usize,
    t: usize,
    eps: f32,
    finish: impl Fn(&mut dyn Backend, Slice, usize, usize) -> Result<()>,
) -> Result<()> {
    let (w0, w1) = (cs.rows_at(pos0), cs.rows_at(pos0 + t));
    if w1 > w0 {
        let n = w1 - w0;
        let rows = cs.rows.rows(w0, n, cs.width);
        be.rms_norm(rows, Some(cw.norm), n, cs.width, eps, rows)?;
        finish(be, rows, n, w0)?;
    }
    Ok(())
}
