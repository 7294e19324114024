//! The O(vocab) path for the settings whose draw depends on the whole vocabulary's mass
//! (top-k off, and top-p on or min-p off): plain temperature sampling and nucleus
//! sampling.
//!
//! Why it exists: the exact path sums `exp` in f64 over all 129,280 logits (a libm call
//! per token) and then sorts as deep as the draw walks, milliseconds per token on a small
//! CPU. Here one vectorisable pass puts every logit on a grid of step `h` (a power of two
//! near `T/64`, so the split `l = k·h + b` is exact in f32), and adds `1 + (e^(b/T) - 1)`
//! into the bin of `k`; a bin's mass is then that sum times `e^((k·h - max)/T)`, one f64
//! exponential per bin rather than per token. Bins are contiguous runs of the sorted order
//! (the bin is a monotone function of the logit), so cumulative masses over bins locate
//! the band of bins where a walk (the nucleus boundary, the draw) stops; only that band's
//! tokens are sorted, with their masses recomputed by the exact path's own formula.
//!
//! Why the token is the exact path's token: every decision is a comparison of a
//! cumulative mass with a target. This path's masses are within [`REL_ERR`] of the true
//! ones, and the exact path's own f64 sums within a few `n · 2⁻⁵³` of the total. A
//! decision is taken here only when the two sides differ by more than twice the sum of
//! those bounds ([`margin`]); then both computations take the same side. When a
//! comparison is closer (below 0.3 % of draws on a flat 129,280-logit distribution, far
//! fewer on a peaked one), this path answers `None` and the caller runs the exact path
//! with the same uniform draw, so the chosen token never differs.

use super::{collect_at_least, id, key, SamplerConfig};

/// Bound on a token's relative mass error here (f32 rounding of `b/T` and of the
/// polynomial for `e^(b/T) - 1` with `|b/T| ≤ 1/128`, and the bin exponentials); measured
/// below 1.5e-9 by a test.
pub(super) const REL_ERR: f64 = 4e-9;
/// Logits more than this many temperatures below the maximum share the last bin (their
/// mass, `n · e⁻⁴⁰` at most, is part of the margin), so a walk that stops there is left
/// to the exact path.
const SPAN_T: f32 = 40.0;
/// At most `SPAN_T · 128` bins, plus the last.
const MAX_BINS: usize = 5122;
/// Four bins per band: a band is under `T/16` wide, so the band where a walk stops holds
/// a few hundred tokens of a 129,280 vocabulary at T = 1.
const SHIFT: u32 = 2;
/// Interleaved histogram copies, so consecutive tokens in the same bin do not wait on
/// each other's add.
const COPIES: usize = 2;

/// A stopping band with more tokens than this (only at very high temperatures) is left
/// to the exact path rather than sorted.
const MAX_MEMBERS: usize = 16_384;
/// Tokens binned per vector step of [`bin_pass`] (64 measured faster than 16).
const BLOCK: usize = 64;
/// 1.5 · 2^23: adding and subtracting it rounds an f32 below 2^22 to an integer, which
/// then sits in the low mantissa bits.
const ROUND: f32 = 12_582_912.0;

/// Buffers reused across tokens (no per-token allocation once warm).
#[derive(Debug, Clone, Default)]
pub(super) struct Scratch {
    /// Per bin: the sum of `e^(b/T)` over its tokens (then its mass).
    hist: Vec<f64>,
    /// Per band: its mass.
    band_mass: Vec<f64>,
    /// Every token's band.
    bands: Vec<u16>,
    members: Vec<u64>,
}

/// The comparison margin for `n` logits of total mass `z`: twice the sum of both paths'
/// error bounds (n roundings of each running sum, the per-token error, the last bin).
fn margin(n: usize, z: f64) -> f64 {
    let n = n as f64;
    z * (8.0 * n * f64::EPSILON / 2.0 + 4.0 * REL_ERR) + 2.0 * n * (-39f64).exp()
}

/// The grid of one call.
#[derive(Debug, Clone, Copy)]
pub(super) struct Grid {
    /// Step `h` (a power of two in `(T/128, T/64]`) and its inverse.
    h: f32,
    s: f32,
    /// Logits are raised to this before binning (so `-inf` bins too).
    floor: f32,
    /// Grid index of the maximum; a token's bin is `ktop - k`.
    ktop: i32,
    /// The last bin.
    last: i32,
    inv_t: f32,
}

impl Grid {
    /// `None` where the grid cannot be exact (a temperature or logits out of f32's
    /// comfortable range): the exact path decides.
    pub(super) fn new(top: f32, temp: f32) -> Option<Grid> {
        let q = temp / 64.0;
        if !q.is_normal() || !(1.0 / q).is_normal() {
            return None;
        }
        let h = f32::from_bits(q.to_bits() & 0xff80_0000);
        let s = 1.0 / h;
        let floor = top - (SPAN_T + 1.0) * temp;
        let lim = (1u32 << 21) as f32;
        if !((top * s).abs() < lim && (floor * s).abs() < lim) {
            return None;
        }
        let ktop = ((top * s + ROUND).to_bits() as i32) - ROUND.to_bits() as i32;
        let last = ((SPAN_T * temp * s) as i32 + 1).min(MAX_BINS as i32 - 1);
        Some(Grid {
            h,
            s,
            floor,
            ktop,
            last,
            inv_t: 1.0 / temp,
        })
    }

    /// A logit's bin and `e^(b/T) - 1` for its remainder `b = l - k·h` (exact).
    #[inline(always)]
    pub(super) fn split(&self, x: f32) -> (i32, f32) {
        let x = x.max(self.floor);
        let t = x * self.s + ROUND;
        let k = t - ROUND;
        let y = (x - k * self.h) * self.inv_t;
        let e = y * (1.0 + y * (0.5 + y * (1.0 / 6.0 + y * (1.0 / 24.0))));
        let kb = t.to_bits() as i32 - ROUND.to_bits() as i32;
        ((self.ktop - kb).min(self.last), e)
    }

    /// `e^((k·h - max)/T)` for bins `0..=n-1` into `out` (libm every 32 bins, products
    /// between: relative error below 1e-14).
    fn bin_scales(&self, top: f64, inv_t: f64, n: usize, out: &mut [f64]) {
        let h = self.h as f64;
        let step = (-h * inv_t).exp();
        let mut v = 0.0;
        for (j, o) in out.iter_mut().take(n).enumerate() {
            v = if j % 32 == 0 {
                (((self.ktop - j as i32) as f64 * h - top) * inv_t).exp()
            } else {
                v * step
            };
            *o = v;
        }
    }
}

/// A token's approximate mass (for the error test).
#[cfg(test)]
pub(super) fn mass(x: f32, top: f32, temp: f32) -> Option<f64> {
    let g = Grid::new(top, temp)?;
    let (j, e) = g.split(x);
    let mut sc = vec![0.0; j as usize + 1];
    g.bin_scales(top as f64, 1.0 / temp as f64, j as usize + 1, &mut sc);
    Some(sc[j as usize] * (1.0 + e as f64))
}

/// Bins every token (recording its band) and turns the bins into band masses; returns
/// the total mass.
fn histogram(s: &mut Scratch, g: &Grid, l: &[f32], top: f64, inv_t: f64) -> f64 {
    let Scratch {
        hist,
        band_mass,
        bands,
        ..
    } = s;
    let bins = g.last as usize + 1;
    hist.clear();
    hist.resize(bins * (COPIES + 1), 0.0);
    bands.clear();
    bands.resize(l.len(), 0);
    {
        let (h0, rest) = hist.split_at_mut(bins);
        bin_pass(g, l, h0, &mut rest[..bins], bands);
    }
    let (first, rest) = hist.split_at_mut(bins);
    for (a, b) in first.iter_mut().zip(&rest[..bins]) {
        *a += b;
    }
    let used = first.iter().rposition(|&a| a != 0.0).map_or(0, |u| u + 1);
    let (first, rest) = hist.split_at_mut(bins);
    g.bin_scales(top, inv_t, used, rest);
    band_mass.clear();
    band_mass.resize(((g.last as usize) >> SHIFT) + 1, 0.0);
    for (jj, (a, sc)) in first[..used].iter().zip(rest.iter()).enumerate() {
        band_mass[jj >> SHIFT] += a * sc;
    }
    band_mass.iter().sum()
}

/// The per-token pass of [`histogram`]: every token's bin and band, and `e^(b/T)` added
/// into two interleaved copies of the bins (`h0`, `h1`), so consecutive tokens in the same
/// bin do not wait on each other's add.
///
/// This loop is nearly all of the sampler's time, and the baseline x86-64 target has only
/// 4-lane SSE2; compiled again for AVX2 (8 lanes) and AVX-512 (16) and picked at run time
/// it runs several times faster. The arithmetic is the same plain multiplies and adds on
/// every target (no fused multiply-add: Rust never contracts), so every CPU computes the
/// same bits and the same token.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+avx+fma",
    "x86_64+avx2+avx+fma",
))]
fn bin_pass(g: &Grid, l: &[f32], h0: &mut [f64], h1: &mut [f64], bands: &mut [u16]) {
    for (blk, bb) in l.chunks(BLOCK).zip(bands.chunks_mut(BLOCK)) {
        // The vector part fills small arrays, the scalar part only adds.
        let mut j = [0i32; BLOCK];
        let mut v = [0f64; BLOCK];
        for (((&x, j), v), b) in blk.iter().zip(&mut j).zip(&mut v).zip(bb.iter_mut()) {
            let (jj, e) = g.split(x);
            *j = jj;
            *v = 1.0 + f64::from(e);
            *b = (jj >> SHIFT) as u16;
        }
        let n = blk.len();
        let mut i = 0;
        while i + 1 < n {
            h0[j[i] as usize] += v[i];
            h1[j[i + 1] as usize] += v[i + 1];
            i += 2;
        }
        if i < n {
            h0[j[i] as usize] += v[i];
        }
    }
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
    for (b, &h) in s.band_mass.iter().enumerate() {
        if before + h > target {
            stop = Some(b);
            break;
        }
        before += h;
    }
    let want = stop? as u16;
    if want as usize + 1 == s.band_mass.len() {
        return None;
    }
    if !band_members(&s.bands, want, v.l, &mut s.members) {
        return None;
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

/// Collects the sort keys of band `want`'s tokens into `out` (cleared first); `false`
/// when there are more than [`MAX_MEMBERS`]. A whole-vocabulary scan of the band array,
/// multiversioned like [`bin_pass`] (a block is tested at once, only hits are visited).
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+avx+fma",
    "x86_64+avx2+avx+fma",
))]
fn band_members(bands: &[u16], want: u16, l: &[f32], out: &mut Vec<u64>) -> bool {
    out.clear();
    // Blocks of 64 tested with an integer OR (reorderable, so whole-register compares);
    // plain loops, as closures in iterator adapters are not inlined into the clones.
    const BLK: usize = 64;
    let visit = |base: usize, blk: &[u16], out: &mut Vec<u64>| {
        for (j, &b) in blk.iter().enumerate() {
            if b == want {
                out.push(key(l[base + j], base + j));
            }
        }
        out.len() <= MAX_MEMBERS
    };
    let mut blocks = bands.chunks_exact(BLK);
    for (bi, blk) in (&mut blocks).enumerate() {
        let mut any = [0u16; 32];
        for k in 0..BLK / 32 {
            for j in 0..32 {
                any[j] |= u16::from(blk[k * 32 + j] == want);
            }
        }
        let mut hit = 0u16;
        for &a in &any {
            hit |= a;
        }
        if hit != 0 && !visit(bi * BLK, blk, out) {
            return false;
        }
    }
    let rest = blocks.remainder();
    visit(bands.len() - rest.len(), rest, out)
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
    let g = Grid::new(top32, cfg.temperature)?;
    let z = histogram(s, &g, l, top, inv_t);
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
    if !collect_at_least(v.l, cut, &mut s.members, MAX_MEMBERS) {
        return None;
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
