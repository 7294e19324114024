//! The CPU kernels: pure functions over validated slices.
//!
//! Determinism: every output element is produced by exactly one task with a fixed
//! reduction order (lane-parallel f32 sums combined in lane order, or f64 sums), so results
//! do not depend on the thread count or on how tokens are batched.

use ds4_engine::backend::{BResult, BackendError, RopeArgs};
use ds4_engine::numerics::{
    fp4_roundtrip, fp8_roundtrip, hadamard, rope_angle, rope_freqs, sigmoid, silu, sqrtsoftplus,
};
use rayon::prelude::*;

use crate::weights::CpuWeight;

/// Rows per parallel task in matmuls (amortises scheduling without starving threads).
const ROWS_PER_TASK: usize = 16;

/// Whether an op runs on the pool (`true`) or inline on the caller's thread. Small ops run
/// inline: handing a few microseconds of work to another thread costs more than the work.
/// The choice never changes results (each element is computed the same way either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Par(pub bool);

/// `f(i, chunk_i)` over `chunk`-sized pieces of `data`, in parallel when `par` says so.
pub fn rows_mut<T: Send>(
    par: Par,
    data: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) {
    if par.0 {
        data.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
    } else {
        data.chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
    }
}

/// Fallible [`rows_mut`]; the first error (in an unspecified order) is returned.
pub fn try_rows_mut<T: Send, E: Send>(
    par: Par,
    data: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) -> Result<(), E> + Sync + Send,
) -> Result<(), E> {
    if par.0 {
        data.par_chunks_mut(chunk)
            .enumerate()
            .try_for_each(|(i, c)| f(i, c))
    } else {
        data.chunks_mut(chunk)
            .enumerate()
            .try_for_each(|(i, c)| f(i, c))
    }
}

/// f32 dot product with 8 independent lanes, combined in lane order.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    acc.iter().sum::<f32>() + tail
}

/// `y[t, r] = W[mat][r] · x[t]`; with `q8`, through int8 activations, each token's `x`
/// quantized on its own (see `Backend::set_activation_q8`), so a token's results do not
/// depend on the other tokens of the call.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    par: Par,
    w: &CpuWeight,
    mat: usize,
    row0: usize,
    n_rows: usize,
    x: &[f32],
    x_stride: usize,
    n_tok: usize,
    y: &mut [f32],
    y_stride: usize,
    q8: bool,
) -> BResult<()> {
    let cols = w.info.cols();
    let err = |e: ds4_gguf::quant::QuantError| BackendError::Invalid {
        op: "matmul",
        problem: format!("{}: {e}", w.name),
    };
    if n_tok == 1 {
        // Int8 activations (Backend::set_activation_q8): x quantized once for all rows.
        let xq = if q8 && ds4_gguf::quant::q8act::applies(w.info.ty) {
            let mut a = ds4_gguf::quant::q8act::ActQ8::default();
            a.quantize(&x[..cols]).map_err(err)?;
            Some(a)
        } else {
            None
        };
        return try_rows_mut(par, &mut y[..n_rows], ROWS_PER_TASK, |ci, yc| {
            for (i, yv) in yc.iter_mut().enumerate() {
                let row = w.row(mat, row0 + ci * ROWS_PER_TASK + i);
                *yv = match &xq {
                    Some(a) => ds4_gguf::quant::q8act::dot(w.info.ty, row, a),
                    None => ds4_gguf::quant::dot(w.info.ty, row, &x[..cols]),
                }
                .map_err(err)?;
            }
            Ok(())
        });
    }
    let xq = if q8 && ds4_gguf::quant::q8act::applies(w.info.ty) {
        let mut v = Vec::with_capacity(n_tok);
        for t in 0..n_tok {
            let mut a = ds4_gguf::quant::q8act::ActQ8::default();
            a.quantize(&x[t * x_stride..t * x_stride + cols])
                .map_err(err)?;
            v.push(a);
        }
        Some(v)
    } else {
        None
    };
    // Row-major results per weight row (each row read once for all tokens), then transposed.
    let mut tmp = vec![0f32; n_rows * n_tok];
    try_rows_mut(par, &mut tmp, ROWS_PER_TASK * n_tok, |ci, c| {
        for (i, rowout) in c.chunks_mut(n_tok).enumerate() {
            let r = row0 + ci * ROWS_PER_TASK + i;
            let row = w.row(mat, r);
            for (t, o) in rowout.iter_mut().enumerate() {
                *o = match &xq {
                    Some(q) => ds4_gguf::quant::q8act::dot(w.info.ty, row, &q[t]),
                    None => {
                        let xt = &x[t * x_stride..t * x_stride + cols];
                        ds4_gguf::quant::dot(w.info.ty, row, xt)
                    }
                }
                .map_err(err)?;
            }
        }
        Ok::<(), BackendError>(())
    })?;
    for r in 0..n_rows {
        for t in 0..n_tok {
            y[t * y_stride + r] = tmp[r * n_tok + t];
        }
    }
    Ok(())
}

/// `(mean(x²) + eps)^(-1/2)` with the sum of squares in f64.
#[inline]
pub fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    (1.0 / (ss / x.len() as f64 + eps as f64).sqrt()) as f32
}

/// RMSNorm of one row, in place.
pub fn rms_norm_row(x: &mut [f32], w: Option<&[f32]>, eps: f32) {
    let s = rms_scale(x, eps);
    match w {
        Some(w) => {
            for (v, g) in x.iter_mut().zip(w) {
                *v = (*v * s) * g;
            }
        }
        None => {
            for v in x.iter_mut() {
                *v *= s;
            }
        }
    }
}

/// In-place RoPE over `x` (`n_rows` rows of `n_heads · head_dim`), row `r` at position
/// `pos[r]` (the caller resolves [`RopeArgs::pos0`]/`pos_step` or `row_pos`).
pub fn rope(par: Par, x: &mut [f32], a: &RopeArgs, pos: &[usize]) {
    let freqs = rope_freqs(&a.freq);
    let rd = a.freq.rope_dim;
    let off = a.head_dim - rd;
    let row_w = a.n_heads * a.head_dim;
    rows_mut(par, &mut x[..a.n_rows * row_w], row_w, |r, row| {
        let p = pos[r];
        let cs: Vec<(f32, f32)> = freqs
            .iter()
            .map(|&w| {
                let ang = rope_angle(p, w);
                let s = ang.sin() as f32;
                (ang.cos() as f32, if a.inverse { -s } else { s })
            })
            .collect();
        for head in row.chunks_mut(a.head_dim) {
            let tail = &mut head[off..];
            for (j, &(c, s)) in cs.iter().enumerate() {
                let (u, v) = (tail[2 * j], tail[2 * j + 1]);
                tail[2 * j] = u * c - v * s;
                tail[2 * j + 1] = u * s + v * c;
            }
        }
    });
}

/// Sinkhorn projection of an `n × n` matrix, in place (docs/forward.md §2.5).
pub fn sinkhorn(z: &mut [f32], n: usize, iters: usize, eps: f32) {
    for i in 0..n {
        let row = &mut z[i * n..(i + 1) * n];
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut s = 0f32;
        for v in row.iter_mut() {
            *v = (*v - m).exp();
            s += *v;
        }
        for v in row.iter_mut() {
            *v = *v / s + eps;
        }
    }
    let col_norm = |z: &mut [f32]| {
        for j in 0..n {
            let s: f32 = (0..n).map(|i| z[i * n + j]).sum::<f32>() + eps;
            for i in 0..n {
                z[i * n + j] /= s;
            }
        }
    };
    col_norm(z);
    for _ in 1..iters {
        for i in 0..n {
            let row = &mut z[i * n..(i + 1) * n];
            let s: f32 = row.iter().sum::<f32>() + eps;
            for v in row.iter_mut() {
                *v /= s;
            }
        }
        col_norm(z);
    }
}

/// HCPre coefficients of one token (docs/forward.md §4.1): writes `[pre (n) | post (n) | P (n·n)]`
/// into `coef` from the raw mix `φ·x̂` and the token's streams `x`.
#[allow(clippy::too_many_arguments)]
pub fn hc_pre_coeffs(
    mix: &[f32],
    x: &[f32],
    base: &[f32],
    scale: &[f32],
    n: usize,
    iters: usize,
    hc_eps: f32,
    rms_eps: f32,
    coef: &mut [f32],
) {
    let rho = rms_scale(x, rms_eps);
    let mu = |i: usize| mix[i] * rho;
    let (pre, rest) = coef.split_at_mut(n);
    let (post, comb) = rest.split_at_mut(n);
    for i in 0..n {
        pre[i] = sigmoid(scale[0] * mu(i) + base[i]) + hc_eps;
        post[i] = 2.0 * sigmoid(scale[1] * mu(n + i) + base[n + i]);
    }
    for k in 0..n * n {
        comb[k] = scale[2] * mu(2 * n + k) + base[2 * n + k];
    }
    sinkhorn(comb, n, iters, hc_eps);
}

/// `y = Σ_i w_i · X_i` over the `n` streams of one token.
pub fn mix_streams(w: &[f32], x: &[f32], dim: usize, y: &mut [f32]) {
    for (d, yv) in y.iter_mut().enumerate().take(dim) {
        let mut acc = 0f32;
        for (i, wi) in w.iter().enumerate() {
            acc += wi * x[i * dim + d];
        }
        *yv = acc;
    }
}

/// HCPost for one token, in place on its streams.
pub fn hc_post_token(x: &mut [f32], f: &[f32], post: &[f32], comb: &[f32], n: usize, dim: usize) {
    let old = x[..n * dim].to_vec();
    for j in 0..n {
        let out = &mut x[j * dim..(j + 1) * dim];
        for (d, o) in out.iter_mut().enumerate() {
            let mut acc = 0f32;
            for i in 0..n {
                acc += comb[i * n + j] * old[i * dim + d];
            }
            *o = post[j] * f[d] + acc;
        }
    }
}

/// HCHead stream weights of one token (docs/forward.md §4.3).
pub fn hc_head_weights(
    mix: &[f32],
    x: &[f32],
    base: &[f32],
    scale: f32,
    n: usize,
    hc_eps: f32,
    rms_eps: f32,
) -> Vec<f32> {
    let rho = rms_scale(x, rms_eps);
    (0..n)
        .map(|i| sigmoid(scale * (mix[i] * rho) + base[i]) + hc_eps)
        .collect()
}

/// Softmax-weighted pooling over candidates `(u, z)` for one output dim.
#[inline]
fn pool(cands: &[(f32, f32)]) -> f32 {
    let m = cands.iter().fold(f32::NEG_INFINITY, |a, c| a.max(c.1));
    let mut s = 0f32;
    for c in cands {
        s += (c.1 - m).exp();
    }
    let mut out = 0f32;
    for c in cands {
        out += ((c.1 - m).exp() / s) * c.0;
    }
    out
}

/// Compressor accumulate-and-pool over a chunk (layout: `acc = [u slots | z slots]`).
#[allow(clippy::too_many_arguments)]
pub fn compressor(
    par: Par,
    acc: &mut [f32],
    u: &[f32],
    z: &[f32],
    ape: &[f32],
    pos0: usize,
    n_tok: usize,
    m: usize,
    c: usize,
    overlap: bool,
    rows: &mut [f32],
) -> BResult<()> {
    let pw = if overlap { 2 * c } else { c };
    let slots = if overlap { 2 * m } else { m };
    let (au, az) = acc.split_at_mut(slots * pw);
    let cap = rows.len() / c;
    for t in 0..n_tok {
        let p = pos0 + t;
        let j = p % m;
        let slot = if overlap { m + j } else { j };
        au[slot * pw..(slot + 1) * pw].copy_from_slice(&u[t * pw..(t + 1) * pw]);
        for e in 0..pw {
            az[slot * pw + e] = z[t * pw + e] + ape[j * pw + e];
        }
        if j + 1 != m {
            continue;
        }
        let w = p / m;
        if w >= cap {
            return Err(BackendError::Invalid {
                op: "compressor",
                problem: format!("row {w} is beyond the {cap} rows of the cache"),
            });
        }
        let out = &mut rows[w * c..(w + 1) * c];
        let (aur, azr) = (&*au, &*az);
        rows_mut(par, out, 1, |e, o| {
            let o = &mut o[0];
            let mut cands = Vec::with_capacity(2 * m);
            if overlap {
                if w > 0 {
                    for s in 0..m {
                        cands.push((aur[s * pw + e], azr[s * pw + e]));
                    }
                }
                for s in m..2 * m {
                    cands.push((aur[s * pw + c + e], azr[s * pw + c + e]));
                }
            } else {
                for s in 0..m {
                    cands.push((aur[s * pw + e], azr[s * pw + e]));
                }
            }
            *o = pool(&cands);
        });
        if overlap {
            let (prev, cur) = au.split_at_mut(m * pw);
            prev.copy_from_slice(&cur[..m * pw]);
            let (prev, cur) = az.split_at_mut(m * pw);
            prev.copy_from_slice(&cur[..m * pw]);
        }
    }
    Ok(())
}

/// Indices of the `k` largest `scores`, ascending; ties go to the lower index.
pub fn top_k_lowest_tie(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    let cmp = |a: &usize, b: &usize| scores[*b].total_cmp(&scores[*a]).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k, cmp);
        idx.truncate(k);
    }
    idx.sort_unstable();
    idx
}

/// Lightning indexer scores for one query over `rows[0..n]` (docs/forward.md §5.5).
#[allow(clippy::too_many_arguments)]
pub fn indexer_scores(
    par: Par,
    q: &[f32],
    w: &[f32],
    rows: &[f32],
    n: usize,
    heads: usize,
    dim: usize,
    wscale: f32,
) -> Vec<f32> {
    let mut out = vec![0f32; n];
    rows_mut(par, &mut out, 64, |ci, oc| {
        for (i, o) in oc.iter_mut().enumerate() {
            let s = ci * 64 + i;
            let k = &rows[s * dim..(s + 1) * dim];
            let mut acc = 0f32;
            for h in 0..heads {
                let d = dot_f32(&q[h * dim..(h + 1) * dim], k);
                acc += (w[h] * wscale) * d.max(0.0);
            }
            *o = acc;
        }
    });
    out
}

/// Per-head sink attention for one query over `keys` (docs/forward.md §5.6).
pub fn attend_head(q: &[f32], keys: &[&[f32]], sink: f32, scale: f32, out: &mut [f32]) {
    let logits: Vec<f32> = keys.iter().map(|k| dot_f32(q, k) * scale).collect();
    let m = logits.iter().fold(sink, |a, &b| a.max(b));
    let mut denom = (sink - m).exp();
    let e: Vec<f32> = logits.iter().map(|&l| (l - m).exp()).collect();
    for v in &e {
        denom += v;
    }
    out.fill(0.0);
    for (k, ev) in keys.iter().zip(&e) {
        let p = ev / denom;
        for (o, kv) in out.iter_mut().zip(k.iter()) {
            *o += p * kv;
        }
    }
}

/// Router for one token: `(ids, weights)`.
pub fn route_topk(logits: &[f32], bias: Option<&[f32]>, k: usize) -> Vec<usize> {
    let sel: Vec<f32> = logits
        .iter()
        .enumerate()
        .map(|(e, &l)| sqrtsoftplus(l) + bias.map_or(0.0, |b| b[e]))
        .collect();
    // Descending score, lower index first on ties.
    let mut idx: Vec<usize> = (0..sel.len()).collect();
    idx.sort_by(|a, b| sel[*b].total_cmp(&sel[*a]).then(a.cmp(b)));
    idx.truncate(k);
    idx
}

/// Expert weights `λ·π_e / Σπ` for the chosen ids (docs/forward.md §6 step 3).
pub fn route_weights(logits: &[f32], ids: &[usize], scale: f32, out: &mut [f32]) {
    let pi: Vec<f32> = ids.iter().map(|&e| sqrtsoftplus(logits[e])).collect();
    let sum: f32 = pi.iter().sum();
    for (o, p) in out.iter_mut().zip(&pi) {
        *o = if sum > 0.0 { p / sum * scale } else { 0.0 };
    }
}

/// The clamped SwiGLU of one value pair.
#[inline]
pub fn swiglu(g: f32, u: f32, c: f32) -> f32 {
    silu(g.min(c)) * u.clamp(-c, c)
}

/// FP8 simulation over the first `n_dims` of a row, blocks of 64.
pub fn qat_fp8_row(row: &mut [f32], n_dims: usize) {
    for b in row[..n_dims].chunks_mut(64) {
        fp8_roundtrip(b);
    }
}

/// Hadamard then FP4 simulation of a row, blocks of 32.
pub fn qat_h_fp4_row(row: &mut [f32]) {
    hadamard(row);
    for b in row.chunks_mut(32) {
        fp4_roundtrip(b);
    }
}
