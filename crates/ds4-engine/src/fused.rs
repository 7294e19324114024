//! The fused ops of [`Backend`] as the sequences of ops they stand for: their meaning, what
//! a device that does not fuse one runs ([`crate::device::Device`]'s defaults), and what a
//! wrapper runs ([`crate::device::Forward`]), so that the ops it intercepts are seen inside
//! them. A fused op must give the bits of its sequence; each sequence here calls back into
//! `be`, so each step is checked and dispatched as if the engine had issued it.
//!
//! Why fusions live behind the trait and not in the forward pass: the model is written once
//! against the coarse ops, and which neighbours a device can run in one pass (an HCPost
//! folded into the next mixing matmul, a norm into a matmul's input stage) is the device's
//! business, as a graph backend fuses the ops of its graph it recognises. The engine names
//! the sequence once (a method here and on [`Backend`]); each device chooses whether to
//! fuse it.

use crate::backend::*;

/// [`Backend::compressor_batch`] as its sequence of ops.
pub fn compressor_batch<B: Backend + ?Sized>(be: &mut B, calls: &[CompressorCall]) -> BResult<()> {
    calls
        .iter()
        .try_for_each(|c| be.compressor(c.acc, c.u, c.z, c.ape, c.args, c.rows))
}

/// [`Backend::indexer_topk_batch`] as its sequence of ops.
pub fn indexer_topk_batch<B: Backend + ?Sized>(be: &mut B, calls: &[IndexerCall]) -> BResult<()> {
    calls
        .iter()
        .try_for_each(|c| be.indexer_topk(c.q, c.w, c.rows, c.args, c.out))
}

/// [`Backend::attention_batch`] as its sequence of ops.
pub fn attention_batch<B: Backend + ?Sized>(be: &mut B, args: &[AttnArgs]) -> BResult<()> {
    args.iter().try_for_each(|&a| be.attention(a))
}

/// [`Backend::ring_store_batch`] as its sequence of ops.
pub fn ring_store_batch<B: Backend + ?Sized>(be: &mut B, calls: &[RingStoreCall]) -> BResult<()> {
    calls
        .iter()
        .try_for_each(|c| be.ring_store(c.ring, c.kv, c.pos0, c.n_tok, c.window))
}

/// [`Backend::matmul_pair`] as its sequence of ops.
#[allow(clippy::too_many_arguments)]
pub fn matmul_pair<B: Backend + ?Sized>(
    be: &mut B,
    wa: Weight,
    wb: Weight,
    x: Slice,
    n_tok: usize,
    ya: Slice,
    yb: Slice,
) -> BResult<()> {
    be.matmul(wa, 0, x, n_tok, ya)?;
    be.matmul(wb, 0, x, n_tok, yb)
}

/// [`Backend::matmul_set`] as its sequence of ops.
pub fn matmul_set<B: Backend + ?Sized>(
    be: &mut B,
    x: Slice,
    n_tok: usize,
    singles: &[(Weight, Slice)],
    pairs: &[MatmulPair],
) -> BResult<()> {
    for &(w, y) in singles {
        be.matmul(w, 0, x, n_tok, y)?;
    }
    for p in pairs {
        be.matmul_pair(p.wa, p.wb, x, n_tok, p.ya, p.yb)?;
    }
    Ok(())
}

/// [`Backend::hc_pre_norm`] as its sequence of ops.
#[allow(clippy::too_many_arguments)]
pub fn hc_pre_norm<B: Backend + ?Sized>(
    be: &mut B,
    mix: Slice,
    x: Slice,
    base: Weight,
    scale: Weight,
    args: HcArgs,
    norm: Weight,
    y: Slice,
    post: Slice,
    comb: Slice,
    out: Slice,
) -> BResult<()> {
    be.hc_pre(mix, x, base, scale, args, y, post, comb)?;
    be.rms_norm(y, Some(norm), args.n_tok, args.dim, args.rms_eps, out)
}

/// [`Backend::hc_mix_pre_norm`] as its sequence of ops.
#[allow(clippy::too_many_arguments)]
pub fn hc_mix_pre_norm<B: Backend + ?Sized>(
    be: &mut B,
    fn_: Weight,
    x: Slice,
    mix: Slice,
    base: Weight,
    scale: Weight,
    args: HcArgs,
    norm: Weight,
    y: Slice,
    post: Slice,
    comb: Slice,
    out: Slice,
) -> BResult<()> {
    be.matmul(fn_, 0, x, args.n_tok, mix)?;
    be.hc_pre_norm(mix, x, base, scale, args, norm, y, post, comb, out)
}

/// [`Backend::hc_post_mix_pre_norm`] as its sequence of ops.
#[allow(clippy::too_many_arguments)]
pub fn hc_post_mix_pre_norm<B: Backend + ?Sized>(
    be: &mut B,
    prev: HcPost,
    fn_: Weight,
    x: Slice,
    mix: Slice,
    base: Weight,
    scale: Weight,
    args: HcArgs,
    norm: Weight,
    y: Slice,
    post: Slice,
    comb: Slice,
    out: Slice,
) -> BResult<()> {
    match prev.f2 {
        Some(f2) => be.hc_post_add(x, prev.f, f2, prev.post, prev.comb, args)?,
        None => be.hc_post(x, prev.f, prev.post, prev.comb, args)?,
    }
    be.hc_mix_pre_norm(fn_, x, mix, base, scale, args, norm, y, post, comb, out)
}

/// [`Backend::norm_rope`] as its sequence of ops.
pub fn norm_rope<B: Backend + ?Sized>(
    be: &mut B,
    x: Slice,
    w: Option<Weight>,
    eps: f32,
    rope: RopeArgs,
    fp8_dims: Option<usize>,
) -> BResult<()> {
    let (rows, width) = (rope.n_rows * rope.n_heads, rope.head_dim);
    be.rms_norm(x, w, rows, width, eps, x)?;
    be.rope(x, rope)?;
    match fp8_dims {
        Some(n) => be.qat_fp8(x, rows, width, n),
        None => Ok(()),
    }
}

/// [`Backend::compressor_pair`] as its sequence of ops.
pub fn compressor_pair<B: Backend + ?Sized>(
    be: &mut B,
    a: CompressorCall,
    b: CompressorCall,
) -> BResult<()> {
    be.compressor(a.acc, a.u, a.z, a.ape, a.args, a.rows)?;
    be.compressor(b.acc, b.u, b.z, b.ape, b.args, b.rows)
}

/// [`Backend::norm_rope_pair`] as its sequence of ops.
pub fn norm_rope_pair<B: Backend + ?Sized>(
    be: &mut B,
    a: NormRopeCall,
    b: NormRopeCall,
) -> BResult<()> {
    be.norm_rope(a.x, a.w, a.eps, a.rope, a.fp8_dims)?;
    be.norm_rope(b.x, b.w, b.eps, b.rope, b.fp8_dims)
}

/// [`Backend::router_matmul`] as its sequence of ops.
#[allow(clippy::too_many_arguments)]
pub fn router_matmul<B: Backend + ?Sized>(
    be: &mut B,
    w: Weight,
    x: Slice,
    logits: Slice,
    routing: Routing,
    args: RouterArgs,
    ids: IBuf,
    weights: Slice,
) -> BResult<()> {
    be.matmul(w, 0, x, args.n_tok, logits)?;
    be.router(logits, routing, args, ids, weights)
}

/// [`Backend::rope_qat_hadamard_fp4`] as its sequence of ops.
pub fn rope_qat_hadamard_fp4<B: Backend + ?Sized>(
    be: &mut B,
    x: Slice,
    rope: RopeArgs,
    rows: usize,
    width: usize,
) -> BResult<()> {
    be.rope(x, rope)?;
    be.qat_hadamard_fp4(x, rows, width)
}

/// [`Backend::norm_rope_pair_store`] as its sequence of ops.
pub fn norm_rope_pair_store<B: Backend + ?Sized>(
    be: &mut B,
    a: NormRopeCall,
    b: NormRopeCall,
    store: RingStoreCall,
) -> BResult<()> {
    be.norm_rope_pair(a, b)?;
    be.ring_store(store.ring, store.kv, store.pos0, store.n_tok, store.window)
}

/// [`Backend::rope_matmul_grouped`] as its sequence of ops.
pub fn rope_matmul_grouped<B: Backend + ?Sized>(
    be: &mut B,
    x: Slice,
    rope: RopeArgs,
    w: Weight,
    groups: usize,
    n_tok: usize,
    y: Slice,
) -> BResult<()> {
    be.rope(x, rope)?;
    be.matmul_grouped(w, groups, x, n_tok, y)
}

/// [`Backend::rms_norm_matmul`] as its sequence of ops.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_matmul<B: Backend + ?Sized>(
    be: &mut B,
    x: Slice,
    norm: Weight,
    eps: f32,
    h: Slice,
    w: Weight,
    n_tok: usize,
    out: Slice,
) -> BResult<()> {
    be.rms_norm(x, Some(norm), n_tok, w.info.cols(), eps, h)?;
    be.matmul(w, 0, h, n_tok, out)
}

/// [`Backend::swiglu_matmul`] as its sequence of ops.
#[allow(clippy::too_many_arguments)]
pub fn swiglu_matmul<B: Backend + ?Sized>(
    be: &mut B,
    gate: Slice,
    up: Slice,
    clamp: f32,
    h: Slice,
    w: Weight,
    n_tok: usize,
    out: Slice,
) -> BResult<()> {
    be.swiglu(gate, up, clamp, h)?;
    be.matmul(w, 0, h, n_tok, out)
}

/// [`Backend::hc_post_add`] as its sequence of ops.
pub fn hc_post_add<B: Backend + ?Sized>(
    be: &mut B,
    x: Slice,
    f: Slice,
    f2: Slice,
    post: Slice,
    comb: Slice,
    args: HcArgs,
) -> BResult<()> {
    be.add(f, f2)?;
    be.hc_post(x, f, post, comb, args)
}

/// [`Backend::argmax`] as its sequence of ops.
pub fn argmax<B: Backend + ?Sized>(be: &mut B, x: Slice, out: IBuf) -> BResult<()> {
    let mut v = vec![0f32; x.len];
    be.download(x, &mut v)?;
    let i = crate::sampler::argmax(&v);
    be.upload_i32(out, 0, &[i as i32])
}

/// [`Backend::logit_band`] as its sequence of ops.
pub fn logit_band<B: Backend + ?Sized>(
    be: &mut B,
    x: Slice,
    span: f32,
    exclude: Option<u32>,
    out: IBuf,
) -> BResult<()> {
    let mut v = vec![0f32; x.len];
    be.download(x, &mut v)?;
    let cap = (out.len() - crate::sampler::BAND_HEAD) / 2;
    let words = crate::sampler::band_words(&v, span, exclude, cap);
    be.upload_i32(out, 0, &words)
}

/// [`Backend::logit_bands`] as its sequence of ops.
pub fn logit_bands<B: Backend + ?Sized>(
    be: &mut B,
    x: Slice,
    n: usize,
    jobs: &[BandJob],
) -> BResult<()> {
    for j in jobs {
        be.logit_band(x.sub(j.row * n, n), j.span, None, j.out)?;
    }
    Ok(())
}
