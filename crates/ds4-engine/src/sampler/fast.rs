//! The O(vocab) path for the settings whose draw depends on the whole vocabulary's mass
//! (top-k off, and top-p on or min-p off): plain temperature sampling and nucleus
//! sampling.
//!
//! Why it exists: the exact path sums `exp` in f64 over all 129,280 logits (a libm call
//! per token) and then sorts as deep as the draw walks, milliseconds per token on a small
//! CPU. Here one pass computes every token's unnormalised probability from a table of
//! `e^(-j/64)` and a short polynomial (f64, within a few ulps of libm) and adds it into a
//! histogram of narrow bands of `(logit - max) / T`. A band is a contiguous run of the
//! sorted order (the band index is a monotone function of the logit), so the cumulative
//! mass over bands locates the band where a walk (the nucleus boundary, the draw) stops;
//! only that band's tokens are sorted, and their masses are recomputed with the exact
//! path's own formula.
//!
//! Why the token is the exact path's token: every decision is a comparison of a
//! cumulative mass with a target. Both this path's sums and the exact path's differ from
//! the true sums by at most a few `n · 2⁻⁵³` of the total (summation order, libm's ulp,
//! this path's polynomial). A decision is taken here only when the two sides differ by
//! more than twice the sum of those bounds ([`margin`]); then both computations take the
//! same side. When a comparison is closer (about `2 · margin · n` per token, ~3e-5 at
//! 129,280 logits in the worst, flat case), this path answers `None` and the caller runs
//! the exact path with the same uniform draw, so the chosen token never differs.

use super::{id, key, SamplerConfig};

/// Bound on the relative error of [`exp_neg`] against libm over `[-40, 0]` (measured a
/// few 1e-16; checked by a test).
pub(super) const REL_ERR: f64 = 1e-14;
/// Table steps per unit of `(logit - max) / T`; the polynomial covers half a step.
const STEPS: f64 = 64.0;
/// Arguments below this share the last table entry and the last band: their mass
/// (`n · e⁻⁴⁰` at most) is part of the margin, so a walk that stops there is left to the
/// exact path.
const FLOOR: f64 = -40.0;
const TABLE: usize = 2561;
/// Four table steps per band: 16 bands per unit of `(logit - max) / T`, narrow enough
/// that the band where a walk stops holds a few hundred tokens of a 129,280 vocabulary
/// at T = 1.
const SHIFT: u32 = 2;
const BANDS: usize = ((TABLE - 1) >> SHIFT) + 1;
const LAST: u16 = (BANDS - 1) as u16;
/// Interleaved histogram copies, so consecutive tokens in the same band do not wait on
/// each other's add.
const COPIES: usize = 4;
/// A stopping band with more tokens than this (only at very high temperatures) is left
/// to the exact path rather than sorted.
const MAX_MEMBERS: usize = 16_384;
const BLOCK: usize = 16;

/// Buffers reused across tokens (no per-token allocation once warm).
#[derive(Debug, Clone, Default)]
pub(super) struct Scratch {
    /// `e^(-j/64)` for `j = 0..TABLE` (libm, built on first use).
    table: Vec<f64>,
    hist: Vec<f64>,
    /// Every token's band.
    bands: Vec<u16>,
    members: Vec<u64>,
}

/// The comparison margin for `n` logits of total mass `z`: twice the sum of both paths'
/// error bounds (n roundings of each running sum, the polynomial, the floor).
fn margin(n: usize, z: f64) -> f64 {
    let n = n as f64;
    z * (8.0 * n * f64::EPSILON / 2.0 + 4.0 * REL_ERR) + 2.0 * n * FLOOR.exp()
}

/// Table index (`round(-64 · a)`) and remainder of `a = (x - top) / T`, clamped at
/// [`FLOOR`]: the exact path's argument, bit for bit, before the clamp.
#[inline(always)]
fn split(x: f32, top: f64, inv_t: f64) -> (usize, f64) {
    // 1.5 · 2^52: adding and subtracting it rounds to the nearest integer.
    const ROUND: f64 = 6_755_399_441_055_744.0;
    let a = ((x as f64 - top) * inv_t).max(FLOOR);
    let k = (a * STEPS + ROUND) - ROUND;
    // Exact: `k / 64` is a multiple of 1/64 within 1/128 of `a`.
    let r = a - k * (1.0 / STEPS);
    ((-k) as i32 as usize, r)
}

/// `e^a` from its [`split`]: the table entry times a degree-6 Taylor polynomial of the
/// remainder (|r| ≤ 1/128, truncation below 1e-18).
#[inline(always)]
fn exp_split(table: &[f64], j: usize, r: f64) -> f64 {
    let mut p = 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    table[j.min(TABLE - 1)] * p
}

/// `e^a` for `a` in `[FLOOR, 0]` (for the error test).
#[cfg(test)]
pub(super) fn exp_neg(a: f64) -> f64 {
    let mut s = Scratch::default();
    s.build_table();
    let (j, r) = split(0.0, -a, 1.0);
    exp_split(&s.table, j, r)
}

impl Scratch {
    fn build_table(&mut self) {
        if self.table.len() != TABLE {
            self.table = (0..TABLE).map(|j| (-(j as f64) / STEPS).exp()).collect();
        }
    }
}

/// Adds every token's mass into its band (and records the band); returns the total.
fn histogram(s: &mut Scratch, l: &[f32], top: f64, inv_t: f64) -> f64 {
    s.build_table();
    let Scratch {
        table, hist, bands, ..
    } = s;
    hist.clear();
    hist.resize(BANDS * COPIES, 0.0);
    bands.clear();
    bands.resize(l.len(), 0);
    for (blk, bb) in l.chunks(BLOCK).zip(bands.chunks_mut(BLOCK)) {
        let mut j = [0usize; BLOCK];
        let mut r = [0f64; BLOCK];
        for ((&x, j), r) in blk.iter().zip(j.iter_mut()).zip(r.iter_mut()) {
            (*j, *r) = split(x, top, inv_t);
        }
        for (i, b) in bb.iter_mut().enumerate() {
            let band = (j[i] >> SHIFT).min(BANDS - 1);
            *b = band as u16;
            hist[(i % COPIES) * BANDS + band] += exp_split(table, j[i], r[i]);
        }
    }
    let (first, rest) = hist.split_at_mut(BANDS);
    for c in rest.chunks_exact(BANDS) {
        for (a, b) in first.iter_mut().zip(c) {
            *a += b;
        }
    }
    hist.truncate(BANDS);
    hist.iter().sum()
}

/// What one call needs besides the scratch: the (penalised) logits and the exact path's
/// formula for a token's unnormalised probability.
struct View<'a> {
    l: &'a [f32],
    top: f64,
    inv_t: f64,
}

impl View<'_> {
    /// Bit for bit the exact path's unnormalised probability.
    fn exact(&self, i: u32) -> f64 {
        ((self.l[i as usize] as f64 - self.top) * self.inv_t).exp()
    }
}

/// The first token of the sorted order whose cumulative mass exceeds `target`, and that
/// cumulative mass (approximate), or `None` when the stop is within `m` of a boundary
/// (or in a band this path does not sort).
fn locate(v: &View, s: &mut Scratch, target: f64, m: f64) -> Option<(u32, f64)> {
    let mut before = 0.0;
    let mut stop = None;
    for (b, &h) in s.hist.iter().enumerate() {
        if before + h > target {
            stop = Some(b);
            break;
        }
        before += h;
    }
    let want = stop? as u16;
    if want == LAST {
        return None;
    }
    s.members.clear();
    for (bi, blk) in s.bands.chunks(BLOCK).enumerate() {
        if blk.iter().fold(false, |h, &b| h | (b == want)) {
            for (j, &b) in blk.iter().enumerate() {
                if b == want {
                    let i = bi * BLOCK + j;
                    s.members.push(key(v.l[i], i));
                }
            }
            if s.members.len() > MAX_MEMBERS {
                return None;
            }
        }
    }
    s.members.sort_unstable_by(|a, b| b.cmp(a));
    let mut c = before;
    for &k in &s.members {
        let prev = c;
        c += v.exact(id(k));
        if c > target {
            return (prev < target - m && c > target + m).then_some((id(k), c));
        }
    }
    None
}

/// The token the exact path would draw with uniform `u`, or `None` to let it decide.
/// Only for `top_k == 0` with top-p on or min-p off; `top32` is the largest (finite)
/// logit and `min_p_cut` the exact path's logit threshold for min-p (a little below
/// `max + T·ln(min_p)`).
pub(super) fn sample(
    s: &mut Scratch,
    l: &[f32],
    top32: f32,
    cfg: &SamplerConfig,
    u: f64,
    min_p_cut: f32,
) -> Option<u32> {
    let top = top32 as f64;
    let inv_t = 1.0 / cfg.temperature as f64;
    let v = View { l, top, inv_t };
    let z = histogram(s, l, top, inv_t);
    let m = margin(l.len(), z);
    if cfg.top_p >= 1.0 {
        // Plain temperature sampling (min-p is off here): the draw walks the vocabulary.
        return locate(&v, s, u * z, m).map(|(t, _)| t);
    }
    let nucleus = cfg.top_p as f64 * z;
    if cfg.min_p > 0.0 {
        return min_p_nucleus(&v, s, cfg.min_p as f64, nucleus, m, u, min_p_cut);
    }
    let keep_mass = locate(&v, s, nucleus, m)?.1;
    let target = u * keep_mass;
    if target > keep_mass - m {
        return None;
    }
    locate(&v, s, target, m).map(|(t, _)| t)
}

/// Min-p then top-p: the min-p set (logits at or above `cut`) is small and summed exactly;
/// only its comparison with the nucleus mass uses the approximate total.
fn min_p_nucleus(
    v: &View,
    s: &mut Scratch,
    floor: f64,
    nucleus: f64,
    m: f64,
    u: f64,
    cut: f32,
) -> Option<u32> {
    s.members.clear();
    for (bi, blk) in v.l.chunks(BLOCK).enumerate() {
        if blk.iter().fold(false, |h, &x| h | (x >= cut)) {
            for (j, &x) in blk.iter().enumerate() {
                if x >= cut {
                    s.members.push(key(x, bi * BLOCK + j));
                }
            }
            if s.members.len() > MAX_MEMBERS {
                return None;
            }
        }
    }
    s.members.sort_unstable_by(|a, b| b.cmp(a));
    let mut c = 0.0;
    let mut kept = 0usize;
    for &k in &s.members {
        let e = v.exact(id(k));
        // p_i >= min_p · p_max  ⇔  e_i >= min_p (e_max = 1); too close to call here.
        if (e - floor).abs() <= 1e-12 * floor {
            return None;
        }
        if e < floor {
            break;
        }
        let prev = c;
        c += e;
        kept += 1;
        if c > nucleus - m {
            if prev < nucleus - m && c > nucleus + m {
                break;
            }
            return None;
        }
    }
    // The draw within the kept prefix: exact masses on both sides, so only the exact
    // path's own rounding needs a margin.
    let target = u * c;
    let m2 = 1e-9 * c;
    let mut acc = 0.0;
    for &k in &s.members[..kept] {
        let prev = acc;
        acc += v.exact(id(k));
        if acc > target {
            return (prev < target - m2 && acc > target + m2).then_some(id(k));
        }
    }
    None
}
