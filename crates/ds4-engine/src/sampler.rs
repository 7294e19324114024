//! Token sampling: greedy, temperature, top-k, top-p, min-p, optional repetition penalty,
//! with a seeded RNG so a run is reproducible from its seed.
//!
//! Order of the filters (fixed, documented so results are explainable): repetition penalty
//! on the raw logits → greedy if `temperature == 0` → top-k on logits → softmax at
//! `temperature` → min-p (relative to the top probability) → top-p (nucleus, smallest prefix
//! of the sorted distribution reaching `p`) → draw. Ties in every sort are broken by the
//! lower token id, so the kept set never depends on sort stability.

use crate::error::{EngineError, Result};

mod band;
mod draft;
mod fast;

pub use band::{band_words, LogitBand, BAND_CAP, BAND_FIRST_READ, BAND_HEAD};

/// Sampling parameters. The defaults are greedy decoding.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    /// 0 = greedy (argmax, lowest id on ties).
    pub temperature: f32,
    /// Keep the `top_k` highest logits; 0 = off.
    pub top_k: usize,
    /// Nucleus mass in (0, 1]; 1 = off.
    pub top_p: f32,
    /// Drop tokens with probability below `min_p · p_max`; 0 = off.
    pub min_p: f32,
    /// Values above 1 penalise tokens seen in the last `repeat_window` tokens (CTRL-style:
    /// positive logits divided, negative multiplied); 1 = off.
    pub repeat_penalty: f32,
    pub repeat_window: usize,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_window: 64,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    /// Whether [`Sampler::sample`] returns exactly [`argmax`] of the logits whatever the
    /// history (temperature 0 and no repetition penalty). Such a sampler needs only the
    /// argmax id, not the logits, so a GPU backend can compute it on the device and copy
    /// back 4 bytes instead of the whole vocabulary.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 && self.repeat_penalty == 1.0
    }

    /// Refuses values that have no meaning (negative temperature, p outside [0, 1], …).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(EngineError::Sampler(m));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(format!(
                "temperature {} must be finite and >= 0",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p {} must be in [0, 1]", self.min_p));
        }
        if !(self.repeat_penalty > 0.0 && self.repeat_penalty.is_finite()) {
            return bad(format!(
                "repeat penalty {} must be finite and > 0",
                self.repeat_penalty
            ));
        }
        Ok(())
    }
}

/// xoshiro256** seeded through splitmix64: small, fast, and stable across versions (a
/// dependency's generator could change its stream and silently change seeded outputs).
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^ (x >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Draws tokens from logits with a [`SamplerConfig`].
///
/// Cost per call is O(vocab) with no vocab-sized allocation after the first call: one pass
/// checks for NaN and finds the maximum, min-p (when it can be applied first) and top-k
/// shrink the candidates by a threshold and a selection, and only the candidates that the
/// filters and the draw actually walk are sorted. The kept set and the drawn token are the
/// ones the straightforward "sort the whole vocabulary" formulation gives (a test keeps
/// that formulation as a reference); only the floating-point summation order of
/// normalisers may differ, which can change a token only when the uniform draw lands
/// within rounding (~1e-16 relative) of a boundary.
///
/// The whole-vocabulary passes (maximum and NaN scan, threshold counts and collections,
/// the fast path's binning) are compiled for AVX2 and AVX-512 too and picked at run time
/// (`multiversion`): the default x86-64 target has only 4-lane SSE2, and these passes are
/// nearly all of a token's cost. They are compares, maxima and unfused IEEE arithmetic, so
/// every variant gives the same bits.
///
/// Plain temperature and nucleus sampling (top-k off) go through a banded-mass fast path
/// first (`sampler/fast.rs`) that returns this exact path's token or, when a comparison
/// is too close to call, nothing, and then the exact path decides with the same draw.
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
    /// Reused across calls: the penalised logits (only with a repetition penalty).
    work: Vec<f32>,
    /// Reused across calls: candidates as sort keys (see [`key`]).
    keys: Vec<u64>,
    /// Reused across calls: distinct ids of the repetition window.
    seen: Vec<u32>,
    /// Reused across calls: the banded-mass fast path's buffers (see `fast`).
    fast: fast::Scratch,
    /// Whether the fast path may answer first (tests turn it off to get the exact path).
    use_fast: bool,
}

/// Candidate sets up to this size are sorted whole at once (cheap, and the normaliser is
/// then summed in exactly the reference order).
const SORT_WHOLE: usize = 4096;

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Result<Sampler> {
        cfg.validate()?;
        let rng = Rng::new(cfg.seed);
        Ok(Sampler {
            cfg,
            rng,
            work: Vec::new(),
            keys: Vec::new(),
            seen: Vec::new(),
            fast: fast::Scratch::default(),
            use_fast: true,
        })
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// See [`SamplerConfig::is_greedy`].
    pub fn is_greedy(&self) -> bool {
        self.cfg.is_greedy()
    }

    /// Picks the next token from `logits`; `history` feeds the repetition penalty.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Result<u32> {
        if logits.is_empty() {
            return Err(EngineError::Sampler("empty logits".into()));
        }
        if u32::try_from(logits.len()).is_err() {
            return Err(EngineError::Sampler(format!(
                "{} logits: token ids must fit in 32 bits",
                logits.len()
            )));
        }
        let (raw_top, any_nan) = scan(logits);
        if any_nan {
            let i = logits.iter().position(|x| x.is_nan()).unwrap_or(0);
            return Err(EngineError::Sampler(format!("logit {i} is NaN")));
        }
        let Sampler {
            cfg,
            rng,
            work,
            keys,
            seen,
            fast,
            use_fast,
        } = self;
        let l: &[f32] = if cfg.repeat_penalty != 1.0 {
            work.clear();
            work.extend_from_slice(logits);
            let start = history.len().saturating_sub(cfg.repeat_window);
            seen.clear();
            seen.extend(
                history[start..]
                    .iter()
                    .copied()
                    .filter(|&t| (t as usize) < work.len()),
            );
            seen.sort_unstable();
            seen.dedup();
            for &t in seen.iter() {
                let v = &mut work[t as usize];
                *v = if *v > 0.0 {
                    *v / cfg.repeat_penalty
                } else {
                    *v * cfg.repeat_penalty
                };
            }
            work
        } else {
            logits
        };
        // The penalty changes logits, so their maximum is scanned again; otherwise the
        // first scan's maximum is the one (a full pass less per token).
        let top32 = if cfg.repeat_penalty != 1.0 {
            scan(l).0
        } else {
            raw_top
        };
        if cfg.temperature == 0.0 {
            return Ok(first_index_of(l, top32));
        }
        if top32 == f32::INFINITY {
            let i = l.iter().position(|&x| x == f32::INFINITY).unwrap_or(0);
            return Err(EngineError::Sampler(format!("logit {i} is +inf")));
        }
        if top32 == f32::NEG_INFINITY {
            return Err(EngineError::Sampler("every logit is -inf".into()));
        }
        let top = top32 as f64;
        let temp = cfg.temperature as f64;
        let inv_t = 1.0 / temp;
        // The unnormalised probability of token `i`, bit for bit the reference formula.
        let e = |i: u32| ((l[i as usize] as f64 - top) * inv_t).exp();

        let n = l.len();
        let top_k = if cfg.top_k > 0 && cfg.top_k < n {
            cfg.top_k
        } else {
            0
        };
        // Top-p compares cumulative mass with the mass of the whole top-k set (or the
        // vocabulary), so it needs that normaliser `z`.
        let need_z = cfg.top_p < 1.0;
        // Every filter keeps a prefix of the sorted order, so the candidates can be cut at
        // a logit threshold first as long as the cut keeps that whole prefix:
        // * min-p: p_i >= min_p · p_max  ⇔  l_i >= max + T·ln(min_p) (with a little
        //   slack; the exact test below decides);
        // * top-k: a threshold with at least k logits above it, then a selection;
        // * otherwise a guessed threshold holding the mass the walks need, checked
        //   afterwards (a walk that runs off its end starts again with every token).
        let min_p_cut = if cfg.min_p > 0.0 {
            min_p_cut(top, temp, cfg.min_p)
        } else {
            f32::NEG_INFINITY
        };
        // The uniform draw (exactly one per sampled token, as the reference).
        let u = rng.next_f64();
        // Settings whose draw depends on the whole vocabulary's mass: the banded fast
        // path decides unless a comparison is too close to call, then the exact path
        // below runs with the same draw.
        if *use_fast && top_k == 0 && (need_z || cfg.min_p == 0.0) {
            if let Some(t) = fast::sample(fast, l, top32, cfg, u, min_p_cut) {
                return Ok(t);
            }
        }
        if top_k == 0 && !need_z && cfg.min_p > 0.0 {
            // Min-p alone: the draw depends only on the logits at or above the cut (the
            // same walk as `sample_band`'s).
            if min_p_cut == f32::NEG_INFINITY {
                keys.clear();
                keys.extend(l.iter().enumerate().map(|(i, &x)| key(x, i)));
            } else {
                collect_at_least(l, min_p_cut, keys, usize::MAX);
            }
            return Ok(walk_min_p(keys, top, inv_t, cfg.min_p, u));
        }
        let mut vocab_mass = f64::NAN;
        let (cut, mut z, complete) = if top_k > 0 {
            let mut d = 4.0f64;
            let cut = loop {
                let c = round_down(top - d * temp);
                if c == f32::NEG_INFINITY || count_at_least(l, c) >= top_k {
                    break c;
                }
                d *= 2.0;
            };
            // z is over the whole top-k set, so min-p may cut first only without top-p.
            let cut = if need_z { cut } else { cut.max(min_p_cut) };
            (cut, 1.0, true)
        } else {
            // Top-k off and not min-p alone (that returned above): top-p or plain
            // temperature sampling. z (or the total mass) over the vocabulary.
            let z: f64 = l.iter().map(|&x| ((x as f64 - top) * inv_t).exp()).sum();
            vocab_mass = z;
            if cfg.min_p > 0.0 {
                (min_p_cut, if need_z { z } else { 1.0 }, true)
            } else {
                // Mass the walks need (the top-p nucleus, or the draw itself), in units of
                // z, with a margin for summation order.
                let need = if need_z { cfg.top_p as f64 } else { u } + 1e-9;
                let mut d = 8.0f64;
                let cut = loop {
                    let c = round_down(top - d * temp);
                    if c == f32::NEG_INFINITY || mass_at_least(l, c, top, inv_t) / z >= need {
                        break c;
                    }
                    d *= 2.0;
                };
                (cut, if need_z { z } else { 1.0 }, cut == f32::NEG_INFINITY)
            }
        };
        let mut cut = cut;
        let mut complete = complete;
        loop {
            if cut == f32::NEG_INFINITY {
                keys.clear();
                keys.reserve(n);
                keys.extend(l.iter().enumerate().map(|(i, &x)| key(x, i)));
            } else {
                collect_at_least(l, cut, keys, usize::MAX);
            }
            if top_k > 0 && top_k < keys.len() {
                keys.select_nth_unstable_by(top_k - 1, |a, b| b.cmp(a));
                keys.truncate(top_k);
            }
            let mut sorted = 0usize;
            let n_keys = keys.len();
            if n_keys <= SORT_WHOLE {
                ensure_sorted(keys, &mut sorted, n_keys);
            }
            let sum_prefix = |keys: &[u64], m: usize, z: f64| -> f64 {
                keys[..m].iter().map(|&k| e(id(k)) / z).sum()
            };
            if top_k > 0 && need_z {
                // The whole top-k set, summed in sorted order when small (as the reference).
                z = sum_prefix(keys, n_keys, 1.0);
            }
            let p = |k: u64| e(id(k)) / z;
            ensure_sorted(keys, &mut sorted, 1);
            let p0 = p(keys[0]);
            let mut keep = n_keys;
            // Whether a walk ended because the candidates ran out (not by its own rule).
            let mut ran_out = true;
            if cfg.min_p > 0.0 {
                let floor = cfg.min_p as f64 * p0;
                let mut m = 0;
                while m < n_keys {
                    ensure_sorted(keys, &mut sorted, m + 1);
                    if p(keys[m]) < floor {
                        ran_out = false;
                        break;
                    }
                    m += 1;
                }
                keep = m.max(1);
            }
            if need_z {
                let mut acc = 0.0;
                let mut i = 0;
                while i < keep {
                    ensure_sorted(keys, &mut sorted, i + 1);
                    acc += p(keys[i]);
                    i += 1;
                    if acc >= cfg.top_p as f64 {
                        ran_out = false;
                        break;
                    }
                }
                keep = i;
            }
            if need_z && ran_out && !complete {
                cut = f32::NEG_INFINITY;
                complete = true;
                continue;
            }
            // Summed in sorted order when that prefix is sorted (always, except when every
            // candidate of a large set is kept: then any order is the same sum up to
            // rounding).
            let total = if top_k == 0 && !need_z && cfg.min_p == 0.0 {
                // Plain temperature sampling: the total is the vocabulary's mass.
                vocab_mass
            } else {
                sum_prefix(keys, keep, z)
            };
            let mut r = u * total;
            for i in 0..keep {
                ensure_sorted(keys, &mut sorted, i + 1);
                let v = p(keys[i]);
                if r < v {
                    return Ok(id(keys[i]));
                }
                r -= v;
            }
            if !complete {
                cut = f32::NEG_INFINITY;
                complete = true;
                continue;
            }
            ensure_sorted(keys, &mut sorted, keep);
            return Ok(id(keys[keep - 1]));
        }
    }
}

impl Sampler {
    /// [`Sampler::sample`] from a [`LogitBand`] of the row instead of the row: the same
    /// token, the same errors, one uniform draw. `Ok(None)` (nothing drawn) when these
    /// settings need more than a band ([`SamplerConfig::band_span`]) or this band is short
    /// (its threshold above the exact cut, or items cut off by its capacity): then sample
    /// the full row.
    pub fn sample_band(&mut self, band: &LogitBand) -> Result<Option<u32>> {
        if let Some(i) = band.first_nan {
            return Err(EngineError::Sampler(format!("logit {i} is NaN")));
        }
        let cfg = &self.cfg;
        if cfg.band_span().is_none() {
            return Ok(None);
        }
        if cfg.is_greedy() {
            // `sample` takes the lowest index holding the maximum: the band's first item
            // when the band holds every value equal to it (a complete band whose threshold
            // is the maximum itself or below).
            let reaches = band.threshold <= band.max;
            return Ok(match band.items.first() {
                // (An all -inf row leaves it to the row: with an excluded index the row's
                // first -inf may be that index.)
                Some(&(i, x))
                    if reaches
                        && band.is_complete()
                        && x == band.max
                        && band.max > f32::NEG_INFINITY =>
                {
                    Some(i)
                }
                _ => None,
            });
        }
        let top32 = band.max;
        if top32 == f32::INFINITY {
            let i = band.first_pos_inf.unwrap_or(0);
            return Err(EngineError::Sampler(format!("logit {i} is +inf")));
        }
        if top32 == f32::NEG_INFINITY {
            return Err(EngineError::Sampler("every logit is -inf".into()));
        }
        let (top, temp) = (top32 as f64, cfg.temperature as f64);
        let cut = min_p_cut(top, temp, cfg.min_p);
        let reaches = band.threshold <= cut; // false for a NaN threshold too
        if !reaches || !band.is_complete() {
            return Ok(None);
        }
        let u = self.rng.next_f64();
        let keys = &mut self.keys;
        keys.clear();
        keys.extend(
            band.items
                .iter()
                .filter(|&&(_, x)| x >= cut)
                .map(|&(i, x)| key(x, i as usize)),
        );
        if keys.is_empty() {
            // The band lacks its own maximum: not a band of one row.
            return Err(EngineError::Sampler(
                "a logits band without its maximum".into(),
            ));
        }
        Ok(Some(walk_min_p(keys, top, 1.0 / temp, cfg.min_p, u)))
    }
}

/// The min-p cut of [`Sampler::sample`]: `max + T·ln(min_p)` with a little slack, as an
/// f32 at or below it (the exact probability test of [`walk_min_p`] decides).
fn min_p_cut(top: f64, temp: f64, min_p: f32) -> f32 {
    let c = top + temp * (min_p as f64).ln();
    round_down(c - 1e-6 * (1.0 + c.abs()))
}

/// The value of a candidate's sort key ([`key`] inverted): the logit's exact bits.
fn key_value(k: u64) -> f32 {
    let o = (k >> 32) as u32;
    f32::from_bits(if o >> 31 == 1 { o & 0x7fff_ffff } else { !o })
}

/// The min-p draw (top-k and top-p off) over `keys`, every candidate at or above the cut
/// in index order: keep the sorted prefix with probability >= min_p · p_max, then walk it
/// with the uniform `u` against its mass. What [`Sampler::sample`]'s general walk does for
/// these settings, shared with [`Sampler::sample_band`] so both give the same token.
fn walk_min_p(keys: &mut [u64], top: f64, inv_t: f64, min_p: f32, u: f64) -> u32 {
    let e = |k: u64| ((key_value(k) as f64 - top) * inv_t).exp();
    let n_keys = keys.len();
    let mut sorted = 0usize;
    if n_keys <= SORT_WHOLE {
        ensure_sorted(keys, &mut sorted, n_keys);
    }
    ensure_sorted(keys, &mut sorted, 1);
    let floor = min_p as f64 * e(keys[0]);
    let mut m = 0;
    while m < n_keys {
        ensure_sorted(keys, &mut sorted, m + 1);
        if e(keys[m]) < floor {
            break;
        }
        m += 1;
    }
    let keep = m.max(1);
    let total: f64 = keys[..keep].iter().map(|&k| e(k)).sum();
    let mut r = u * total;
    for i in 0..keep {
        ensure_sorted(keys, &mut sorted, i + 1);
        let v = e(keys[i]);
        if r < v {
            return id(keys[i]);
        }
        r -= v;
    }
    ensure_sorted(keys, &mut sorted, keep);
    id(keys[keep - 1])
}

/// The largest f32 at or below `c` (so `x >= result` keeps every `x >= c`).
fn round_down(c: f64) -> f32 {
    let c32 = c as f32;
    if c32 as f64 > c {
        c32.next_down()
    } else {
        c32
    }
}

/// The sort keys of the values `>= cut` into `out` (cleared first), in index order;
/// `false` (with `out` incomplete) once there are more than `limit`. Survivors are rare:
/// a block is tested at once (vector code), only blocks with a hit are visited.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+avx+fma",
    "x86_64+avx2+avx+fma",
))]
fn collect_at_least(l: &[f32], cut: f32, out: &mut Vec<u64>, limit: usize) -> bool {
    out.clear();
    // Blocks of 4·LANES decided by their maximum, kept in LANES vertical lanes (the shape
    // of `scan`): this compiles to whole-register compares. A closure in an iterator
    // adapter would not be inlined into the target-feature clone.
    const BLK: usize = 4 * LANES;
    let visit = |base: usize, b: &[f32], out: &mut Vec<u64>| {
        for (j, &x) in b.iter().enumerate() {
            if x >= cut {
                out.push(key(x, base + j));
            }
        }
        out.len() <= limit
    };
    let mut blocks = l.chunks_exact(BLK);
    for (bi, b) in (&mut blocks).enumerate() {
        let mut m = [f32::NEG_INFINITY; LANES];
        for k in 0..BLK / LANES {
            for j in 0..LANES {
                let x = b[k * LANES + j];
                m[j] = if x > m[j] { x } else { m[j] };
            }
        }
        // An integer OR reduces in any order (a float max does not).
        let mut any = 0u32;
        for &x in &m {
            any |= u32::from(x >= cut);
        }
        if any != 0 && !visit(bi * BLK, b, out) {
            return false;
        }
    }
    let rest = blocks.remainder();
    visit(l.len() - rest.len(), rest, out)
}

/// Whether at least `k` values are `>= c` (counted in vectorised blocks).
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+avx+fma",
    "x86_64+avx2+avx+fma",
))]
fn count_at_least(l: &[f32], c: f32) -> usize {
    // Counted in f32 lanes (exact below 2^24 per lane): compiles to compares and adds,
    // where integer lanes compiled to a loop many times slower.
    let mut n = [0f32; LANES];
    let mut blocks = l.chunks_exact(LANES);
    for b in &mut blocks {
        for j in 0..LANES {
            n[j] += if b[j] >= c { 1.0 } else { 0.0 };
        }
    }
    let mut total: usize = n.iter().map(|&v| v as usize).sum();
    for &x in blocks.remainder() {
        total += usize::from(x >= c);
    }
    total
}

/// Unnormalised mass of the values `>= c`.
fn mass_at_least(l: &[f32], c: f32, top: f64, inv_t: f64) -> f64 {
    l.iter()
        .filter(|&&x| x >= c)
        .map(|&x| ((x as f64 - top) * inv_t).exp())
        .sum()
}

/// A candidate's sort key: descending key order is descending logit (in `total_cmp`
/// order) with the lower id first on ties, so one integer comparison replaces an indirect
/// float comparison and the order never depends on sort stability.
fn key(x: f32, i: usize) -> u64 {
    let b = x.to_bits();
    let ordered = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    (u64::from(ordered) << 32) | u64::from(u32::MAX - i as u32)
}

fn id(k: u64) -> u32 {
    u32::MAX - k as u32
}

/// Makes sure `keys[..n]` holds the `n` largest keys in descending order, given that
/// `keys[..*sorted]` already does. Grows the sorted prefix geometrically so walks that go
/// deep cost a few selections, not one per step.
fn ensure_sorted(keys: &mut [u64], sorted: &mut usize, n: usize) {
    let n = n.min(keys.len());
    if n <= *sorted {
        return;
    }
    let want = n.max(*sorted * 4).max(256).min(keys.len());
    let rest = &mut keys[*sorted..];
    let m = want - *sorted;
    if m < rest.len() {
        rest.select_nth_unstable_by(m - 1, |a, b| b.cmp(a));
    }
    rest[..m].sort_unstable_by(|a, b| b.cmp(a));
    *sorted = want;
}

/// Index of the largest value, lowest index on ties (NaN-free input; `-0.0 == 0.0`).
pub fn argmax(x: &[f32]) -> u32 {
    first_index_of(x, scan(x).0)
}

/// The lowest index holding `m` (0 when none: an all-NaN or empty input).
fn first_index_of(x: &[f32], m: f32) -> u32 {
    x.iter().position(|&v| v == m).unwrap_or(0) as u32
}

/// Independent accumulators per pass, so the scans below compile to vector code.
const LANES: usize = 16;

/// The largest value (NaNs ignored; -inf for none) and whether any value is NaN, in one
/// vectorised pass (multiversioned like the fast path's binning: a full pass per token).
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+avx+fma",
    "x86_64+avx2+avx+fma",
))]
fn scan(l: &[f32]) -> (f32, bool) {
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut nan = [false; LANES];
    let mut blocks = l.chunks_exact(LANES);
    for b in &mut blocks {
        for j in 0..LANES {
            let x = b[j];
            nan[j] |= x.is_nan();
            m[j] = if x > m[j] { x } else { m[j] };
        }
    }
    let mut top = f32::NEG_INFINITY;
    let mut any_nan = false;
    for &x in blocks.remainder().iter().chain(m.iter()) {
        any_nan |= x.is_nan();
        if x > top {
            top = x;
        }
    }
    (top, any_nan || nan.iter().any(|&n| n))
}

/// The sampler as it was before the O(vocab) rewrite, kept verbatim as the reference the
/// new one must agree with (it sorts the whole vocabulary per token).
#[cfg(test)]
mod reference {
    use super::{argmax, Rng, SamplerConfig};
    use crate::error::{EngineError, Result};

    #[derive(Debug, Clone)]
    pub struct RefSampler {
        cfg: SamplerConfig,
        rng: Rng,
    }

    impl RefSampler {
        pub fn new(cfg: SamplerConfig) -> Result<RefSampler> {
            cfg.validate()?;
            let rng = Rng::new(cfg.seed);
            Ok(RefSampler { cfg, rng })
        }

        /// Picks the next token from `logits`; `history` feeds the repetition penalty.
        pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Result<u32> {
            if logits.is_empty() {
                return Err(EngineError::Sampler("empty logits".into()));
            }
            if let Some(i) = logits.iter().position(|x| x.is_nan()) {
                return Err(EngineError::Sampler(format!("logit {i} is NaN")));
            }
            let mut l = logits.to_vec();
            if self.cfg.repeat_penalty != 1.0 {
                let start = history.len().saturating_sub(self.cfg.repeat_window);
                let mut seen = vec![false; l.len()];
                for &t in &history[start..] {
                    if let Some(s) = seen.get_mut(t as usize) {
                        if !*s {
                            *s = true;
                            let v = &mut l[t as usize];
                            *v = if *v > 0.0 {
                                *v / self.cfg.repeat_penalty
                            } else {
                                *v * self.cfg.repeat_penalty
                            };
                        }
                    }
                }
            }
            if self.cfg.temperature == 0.0 {
                return Ok(argmax(&l));
            }
            // Candidates sorted by logit descending, lower id first on ties.
            let mut idx: Vec<u32> = (0..l.len() as u32).collect();
            idx.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
            if self.cfg.top_k > 0 && self.cfg.top_k < idx.len() {
                idx.truncate(self.cfg.top_k);
            }
            let inv_t = 1.0 / self.cfg.temperature as f64;
            let top = l[idx[0] as usize] as f64;
            let mut p: Vec<f64> = idx
                .iter()
                .map(|&i| ((l[i as usize] as f64 - top) * inv_t).exp())
                .collect();
            let z: f64 = p.iter().sum();
            for v in &mut p {
                *v /= z;
            }
            if self.cfg.min_p > 0.0 {
                let floor = self.cfg.min_p as f64 * p[0];
                let keep = p.iter().take_while(|&&v| v >= floor).count().max(1);
                p.truncate(keep);
                idx.truncate(keep);
            }
            if self.cfg.top_p < 1.0 {
                let mut acc = 0.0;
                let mut keep = p.len();
                for (i, v) in p.iter().enumerate() {
                    acc += v;
                    if acc >= self.cfg.top_p as f64 {
                        keep = i + 1;
                        break;
                    }
                }
                p.truncate(keep);
                idx.truncate(keep);
            }
            let total: f64 = p.iter().sum();
            let mut r = self.rng.next_f64() * total;
            for (i, v) in p.iter().enumerate() {
                if r < *v {
                    return Ok(idx[i]);
                }
                r -= v;
            }
            Ok(*idx.last().expect("at least one candidate"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(t: f32) -> SamplerConfig {
        SamplerConfig {
            temperature: t,
            seed: 7,
            ..SamplerConfig::default()
        }
    }

    #[test]
    fn greedy_takes_lowest_id_among_ties() {
        let mut s = Sampler::new(cfg(0.0)).unwrap();
        assert_eq!(s.sample(&[1.0, 3.0, 3.0, -1.0], &[]).unwrap(), 1);
    }

    #[test]
    fn nan_and_bad_configs_are_refused() {
        let mut s = Sampler::new(cfg(1.0)).unwrap();
        assert!(s.sample(&[0.0, f32::NAN], &[]).is_err());
        assert!(s.sample(&[], &[]).is_err());
        for bad in [
            SamplerConfig {
                temperature: -1.0,
                ..cfg(0.0)
            },
            SamplerConfig {
                top_p: 0.0,
                ..cfg(1.0)
            },
            SamplerConfig {
                min_p: 1.5,
                ..cfg(1.0)
            },
            SamplerConfig {
                repeat_penalty: 0.0,
                ..cfg(1.0)
            },
        ] {
            assert!(Sampler::new(bad).is_err());
        }
    }

    #[test]
    fn same_seed_same_stream_and_frequencies_follow_softmax() {
        let logits = [0.0f32, (2f32).ln(), (3f32).ln(), f32::NEG_INFINITY];
        let mut a = Sampler::new(cfg(1.0)).unwrap();
        let mut b = Sampler::new(cfg(1.0)).unwrap();
        let mut counts = [0usize; 4];
        let n = 60_000;
        for _ in 0..n {
            let x = a.sample(&logits, &[]).unwrap();
            assert_eq!(x, b.sample(&logits, &[]).unwrap());
            counts[x as usize] += 1;
        }
        assert_eq!(counts[3], 0);
        for (i, want) in [1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0].iter().enumerate() {
            let got = counts[i] as f64 / n as f64;
            assert!((got - want).abs() < 0.01, "token {i}: {got} vs {want}");
        }
    }

    #[test]
    fn top_k_top_p_min_p_restrict_the_support() {
        let logits = [4.0f32, 3.0, 2.0, 1.0, 0.0];
        let draw = |c: SamplerConfig| {
            let mut s = Sampler::new(c).unwrap();
            let mut seen = [false; 5];
            for _ in 0..2000 {
                seen[s.sample(&logits, &[]).unwrap() as usize] = true;
            }
            seen
        };
        assert_eq!(
            draw(SamplerConfig {
                top_k: 2,
                ..cfg(1.0)
            }),
            [true, true, false, false, false]
        );
        // p = softmax: 0.636, 0.234, 0.086, ... -> nucleus 0.8 keeps 2 tokens.
        assert_eq!(
            draw(SamplerConfig {
                top_p: 0.8,
                ..cfg(1.0)
            }),
            [true, true, false, false, false]
        );
        // min_p 0.1: keeps p >= 0.0636 -> 3 tokens.
        assert_eq!(
            draw(SamplerConfig {
                min_p: 0.1,
                ..cfg(1.0)
            }),
            [true, true, true, false, false]
        );
    }

    #[test]
    fn repetition_penalty_changes_the_greedy_choice() {
        let c = SamplerConfig {
            repeat_penalty: 2.0,
            ..cfg(0.0)
        };
        let mut s = Sampler::new(c).unwrap();
        assert_eq!(s.sample(&[2.0, 1.5], &[]).unwrap(), 0);
        assert_eq!(s.sample(&[2.0, 1.5], &[0]).unwrap(), 1);
        // Negative logits get more negative.
        assert_eq!(s.sample(&[-1.0, -1.5], &[0]).unwrap(), 1);
    }

    /// Random logits of a few shapes the model produces: broad, peaked, quantised (ties),
    /// with masked (-inf) entries and signed zeros.
    fn random_logits(rng: &mut Rng, n: usize, shape: u64) -> Vec<f32> {
        let mut l: Vec<f32> = (0..n)
            .map(|_| {
                let u = rng.next_f64() as f32;
                match shape {
                    0 => u * 8.0 - 4.0,
                    1 => (u * 8.0 - 4.0).powi(3) * 0.5,
                    2 => ((u * 16.0).floor() - 8.0) * 0.25,
                    3 => -20.0 * u,
                    // Peaked: a bulk around 0 and (below) a few strong candidates.
                    _ => u * 6.0 - 3.0,
                }
            })
            .collect();
        if shape == 3 {
            for v in l.iter_mut().step_by(7) {
                *v = f32::NEG_INFINITY;
            }
            l[1] = 3.0;
            l[n / 2] = 3.0;
            l[2] = -0.0;
            l[3] = 0.0;
        }
        if shape == 4 {
            for k in 0..12 {
                let i = (rng.next_u64() % n as u64) as usize;
                l[i] = 14.0 - 0.5 * k as f32;
            }
        }
        l
    }

    fn configs() -> Vec<SamplerConfig> {
        let mut out = Vec::new();
        for &temperature in &[0.0f32, 0.4, 1.0, 1.7] {
            for &top_k in &[0usize, 1, 5, 40, 3000] {
                for &top_p in &[1.0f32, 0.95, 0.5] {
                    for &min_p in &[0.0f32, 0.05, 0.3] {
                        out.push(SamplerConfig {
                            temperature,
                            top_k,
                            top_p,
                            min_p,
                            repeat_penalty: if top_k == 5 { 1.3 } else { 1.0 },
                            repeat_window: 16,
                            seed: (top_k as u64) * 31 + (min_p * 100.0) as u64,
                        });
                    }
                }
            }
        }
        out
    }

    #[test]
    fn agrees_with_the_whole_vocabulary_reference() {
        let mut g = Rng::new(2024);
        let mut cases = 0;
        for (ci, c) in configs().into_iter().enumerate() {
            let n = [37usize, 1000, 9000][ci % 3];
            let shape = (ci / 3) as u64 % 5;
            let logits = random_logits(&mut g, n, shape);
            let history: Vec<u32> = (0..40).map(|i| (i * 13 % n) as u32).collect();
            let mut new = Sampler::new(c.clone()).unwrap();
            let mut old = reference::RefSampler::new(c.clone()).unwrap();
            for step in 0..20 {
                let h = &history[..step * 2];
                let a = new.sample(&logits, h).unwrap();
                let b = old.sample(&logits, h).unwrap();
                assert_eq!(a, b, "config {c:?} shape {shape} n {n} step {step}");
                cases += 1;
            }
        }
        assert!(cases > 3000);
    }

    #[test]
    fn agrees_with_the_reference_at_full_vocabulary() {
        let n = 129_280;
        let mut g = Rng::new(99);
        for (i, c) in [
            SamplerConfig {
                temperature: 1.0,
                min_p: 0.05,
                seed: 1,
                ..SamplerConfig::default()
            },
            SamplerConfig {
                temperature: 1.0,
                seed: 2,
                ..SamplerConfig::default()
            },
            SamplerConfig {
                temperature: 0.8,
                top_p: 0.9,
                seed: 3,
                ..SamplerConfig::default()
            },
            SamplerConfig {
                temperature: 1.0,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.05,
                seed: 4,
                ..SamplerConfig::default()
            },
        ]
        .into_iter()
        .enumerate()
        {
            for shape in [0, 1, 4] {
                let logits = random_logits(&mut g, n, shape);
                let mut new = Sampler::new(c.clone()).unwrap();
                let mut old = reference::RefSampler::new(c.clone()).unwrap();
                for step in 0..6 {
                    assert_eq!(
                        new.sample(&logits, &[]).unwrap(),
                        old.sample(&logits, &[]).unwrap(),
                        "{c:?} case {i} shape {shape} step {step}"
                    );
                }
            }
        }
    }

    /// Logits shaped like the criterion bench's: an Irwin–Hall bulk of width `sigma`,
    /// optionally with a few strong candidates far above it.
    fn bench_like(rng: &mut Rng, n: usize, sigma: f64, peaked: bool) -> Vec<f32> {
        let mut l: Vec<f32> = (0..n)
            .map(|_| {
                let s: f64 = (0..4).map(|_| rng.next_f64()).sum::<f64>() - 2.0;
                (s * sigma * 3f64.sqrt()) as f32
            })
            .collect();
        if peaked {
            for k in 0..12 {
                l[(rng.next_u64() % n as u64) as usize] = 20.0 - 0.5 * k as f32;
            }
        }
        l
    }

    fn exact_only(c: &SamplerConfig) -> Sampler {
        let mut s = Sampler::new(c.clone()).unwrap();
        s.use_fast = false;
        s
    }

    #[test]
    fn fast_masses_are_within_their_stated_error_of_libm() {
        // Random logits, maxima and temperatures of every scale in use, against the exact
        // path's f64 formula (tokens within the grid's 40 temperatures of the maximum).
        let mut g = Rng::new(11);
        let mut worst = 0f64;
        let mut checked = 0;
        for i in 0..300_000 {
            let temp = [0.05f32, 0.3, 0.7, 1.0, 1.3, 2.0, 5.0][i % 7];
            let top = (g.next_f64() * 60.0 - 20.0) as f32;
            let x = top - (g.next_f64() * 39.0 * temp as f64) as f32;
            let want = ((x as f64 - top as f64) * (1.0 / temp as f64)).exp();
            let got = fast::mass(x, top, temp).expect("grid");
            worst = worst.max((got - want).abs() / want);
            checked += 1;
        }
        assert_eq!(checked, 300_000);
        assert!(worst < fast::REL_ERR, "worst relative error {worst:e}");
        eprintln!("worst relative mass error {worst:e}");
    }

    /// The fast path against the exact path (the sampler before it) with the same draw:
    /// it answers the exact path's token or nothing, and it answers almost always.
    #[test]
    fn fast_path_draws_the_exact_paths_token() {
        let mut g = Rng::new(77);
        let mut answered = 0usize;
        let mut asked = 0usize;
        let settings = [
            (1.0f32, 1.0f32, 0.0f32),
            (0.7, 1.0, 0.0),
            (1.6, 1.0, 0.0),
            (1.0, 0.9, 0.0),
            (0.8, 0.5, 0.0),
            (1.0, 0.95, 0.05),
            (1.3, 0.9, 0.3),
        ];
        for (si, &(temperature, top_p, min_p)) in settings.iter().enumerate() {
            for (li, &(n, sigma, peaked)) in [
                (129_280usize, 3.5f64, false),
                (129_280, 2.0, true),
                (5000, 1.0, false),
                (300, 6.0, true),
            ]
            .iter()
            .enumerate()
            {
                let l = bench_like(&mut g, n, sigma, peaked);
                let c = SamplerConfig {
                    temperature,
                    top_p,
                    min_p,
                    seed: (si * 10 + li) as u64,
                    ..SamplerConfig::default()
                };
                let mut exact = exact_only(&c);
                let mut new = Sampler::new(c.clone()).unwrap();
                let mut probe = Rng::new(c.seed);
                let top = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let cut = if min_p > 0.0 {
                    let c = top as f64 + temperature as f64 * (min_p as f64).ln();
                    round_down(c - 1e-6 * (1.0 + c.abs()))
                } else {
                    f32::NEG_INFINITY
                };
                let mut scratch = fast::Scratch::default();
                for step in 0..60 {
                    let want = exact.sample(&l, &[]).unwrap();
                    assert_eq!(new.sample(&l, &[]).unwrap(), want, "{c:?} {li} {step}");
                    // The same draw, straight into the fast path: never a wrong token.
                    let u = probe.next_f64();
                    asked += 1;
                    let got = fast::sample(&mut scratch, &l, top, &c, u, cut);
                    if got.is_none() {
                        eprintln!("declined si {si} li {li} u {u}");
                    }
                    if let Some(t) = got {
                        assert_eq!(t, want, "{c:?} {li} step {step} u {u}");
                        answered += 1;
                    }
                }
            }
        }
        // Closeness to a boundary is rare; if the fast path declined often this test
        // would be checking the exact path against itself.
        assert!(
            answered * 100 >= asked * 97,
            "answered {answered} of {asked}"
        );
    }

    #[test]
    fn fast_path_declines_a_draw_on_a_boundary() {
        // Two equal logits: mass 1 each, so u = 0.5 lands exactly on the boundary.
        let l = [0.5f32, 0.5, -30.0];
        let c = SamplerConfig {
            temperature: 1.0,
            ..SamplerConfig::default()
        };
        let mut s = fast::Scratch::default();
        let mut at = |u: f64| fast::sample(&mut s, &l, 0.5, &c, u, f32::NEG_INFINITY);
        assert_eq!(at(0.5), None);
        assert_eq!(at(0.5 + 1e-9), None);
        assert_eq!(at(0.5 + 1e-6), Some(1));
        assert_eq!(at(0.5 - 1e-6), Some(0));
        assert_eq!(at(0.3), Some(0));
        assert_eq!(at(0.7), Some(1));
        // A nucleus of 0.5 ends exactly at token 0's mass: too close to call.
        let c = SamplerConfig { top_p: 0.5, ..c };
        assert_eq!(
            fast::sample(&mut s, &l, 0.5, &c, 0.1, f32::NEG_INFINITY),
            None
        );
    }

    #[test]
    fn infinite_logits_are_refused_by_name() {
        let mut s = Sampler::new(cfg(1.0)).unwrap();
        let e = s
            .sample(&[0.0, f32::INFINITY], &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("logit 1 is +inf"), "{e}");
        let e = s
            .sample(&[f32::NEG_INFINITY, f32::NEG_INFINITY], &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("every logit is -inf"), "{e}");
        // Masked entries next to a finite one are fine.
        assert_eq!(s.sample(&[f32::NEG_INFINITY, 2.0], &[]).unwrap(), 1);
    }

    #[test]
    fn greedy_flag_means_argmax_whatever_the_history() {
        assert!(SamplerConfig::default().is_greedy());
        assert!(!cfg(0.7).is_greedy());
        let pen = SamplerConfig {
            repeat_penalty: 1.5,
            ..cfg(0.0)
        };
        assert!(!pen.is_greedy());
        let mut s = Sampler::new(cfg(0.0)).unwrap();
        assert!(s.is_greedy());
        let mut g = Rng::new(5);
        let l = random_logits(&mut g, 5000, 1);
        assert_eq!(s.sample(&l, &[1, 2, 3]).unwrap(), argmax(&l));
    }

    /// The criterion bench's settings on logits shaped like its own, token for token
    /// against the whole-vocabulary reference (the fast path, the selections and the
    /// run-time-dispatched passes all on).
    #[test]
    fn bench_settings_agree_with_the_reference() {
        let n = 129_280;
        let mut g = Rng::new(4242);
        let base = SamplerConfig {
            temperature: 1.0,
            min_p: 0.05,
            ..SamplerConfig::default()
        };
        let settings = [
            base.clone(),
            SamplerConfig {
                temperature: 0.0,
                ..base.clone()
            },
            SamplerConfig {
                top_k: 40,
                min_p: 0.0,
                ..base.clone()
            },
            SamplerConfig {
                top_k: 40,
                top_p: 0.95,
                ..base.clone()
            },
            SamplerConfig {
                top_p: 0.9,
                min_p: 0.0,
                ..base.clone()
            },
            SamplerConfig {
                top_p: 0.9,
                ..base.clone()
            },
            SamplerConfig {
                min_p: 0.0,
                ..base.clone()
            },
            SamplerConfig {
                repeat_penalty: 1.1,
                ..base.clone()
            },
        ];
        let history: Vec<u32> = (0..64).map(|i| i * 997 % n as u32).collect();
        for (peaked, sigma) in [(true, 2.0), (false, 3.5)] {
            let l = bench_like(&mut g, n, sigma, peaked);
            for (si, c) in settings.iter().enumerate() {
                let c = SamplerConfig {
                    seed: 100 + si as u64,
                    ..c.clone()
                };
                let mut new = Sampler::new(c.clone()).unwrap();
                let mut old = reference::RefSampler::new(c.clone()).unwrap();
                for step in 0..8 {
                    assert_eq!(
                        new.sample(&l, &history).unwrap(),
                        old.sample(&l, &history).unwrap(),
                        "{c:?} peaked {peaked} step {step}"
                    );
                }
            }
        }
    }

    /// The vectorised passes against their one-line definitions, on lengths that are not
    /// multiples of the block sizes and with ties, -inf and signed zeros.
    #[test]
    fn vector_passes_match_their_definitions() {
        let mut g = Rng::new(8);
        for n in [1usize, 15, 16, 17, 63, 64, 65, 1000, 4099] {
            let mut l: Vec<f32> = (0..n)
                .map(|_| ((g.next_f64() * 16.0).floor() - 8.0) as f32 * 0.5)
                .collect();
            l[0] = f32::NEG_INFINITY;
            if n > 3 {
                l[n - 1] = -0.0;
                l[n / 2] = f32::NEG_INFINITY;
            }
            let want_top = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(scan(&l), (want_top, false), "n {n}");
            let mut keys = Vec::new();
            for cut in [-4.0f32, -0.0, 0.0, 1.5, 3.5, 9.0, f32::NEG_INFINITY] {
                let want: Vec<u64> = l
                    .iter()
                    .enumerate()
                    .filter(|(_, &x)| x >= cut)
                    .map(|(i, &x)| key(x, i))
                    .collect();
                assert_eq!(count_at_least(&l, cut), want.len(), "n {n} cut {cut}");
                assert!(collect_at_least(&l, cut, &mut keys, usize::MAX));
                assert_eq!(keys, want, "n {n} cut {cut}");
                if want.len() > 1 {
                    assert!(!collect_at_least(&l, cut, &mut keys, want.len() - 1));
                }
            }
            let mut with_nan = l.clone();
            with_nan[n - 1] = f32::NAN;
            assert!(scan(&with_nan).1, "n {n}");
        }
    }

    /// The band path against the row path: same token stream for the same seed (ties,
    /// -0.0, -inf rows, excluded indices, flat rows whose band overflows its capacity and
    /// falls back), and declining never consumes a draw.
    #[test]
    fn band_draws_the_rows_token() {
        let mut rng = Rng::new(77);
        let mut declined = 0;
        let mut drawn = 0;
        for (case, &(n, shape, temperature, min_p)) in [
            (2000usize, 0u64, 1.0f32, 0.05f32),
            (2000, 1, 0.7, 0.1),
            (2000, 2, 1.0, 0.3),
            (2000, 3, 1.3, 0.05),
            (5000, 4, 1.0, 0.05),
            (3000, 0, 1.0, 0.001),
            (3000, 0, 4.0, 0.05),
            (129_280, 4, 1.0, 0.05),
            // Greedy (span 0): quantized values tie at the maximum; ±0; peaked.
            (2000, 2, 0.0, 0.05),
            (2000, 3, 0.0, 0.05),
            (129_280, 4, 0.0, 0.05),
        ]
        .iter()
        .enumerate()
        {
            let cfg = SamplerConfig {
                temperature,
                min_p,
                seed: 1000 + case as u64,
                ..SamplerConfig::default()
            };
            let span = cfg.band_span().unwrap();
            let (mut by_row, mut by_band) = (
                Sampler::new(cfg.clone()).unwrap(),
                Sampler::new(cfg).unwrap(),
            );
            for step in 0..24 {
                let mut l = random_logits(&mut rng, n, shape);
                let exclude = (step % 3 == 0).then_some((step * 131 % n) as u32);
                let cap = if step % 4 == 1 { 8 } else { BAND_CAP };
                let band = LogitBand::from_words(&band_words(&l, span, exclude, cap)).unwrap();
                if let Some(e) = exclude {
                    l[e as usize] = f32::NEG_INFINITY;
                }
                let want = by_row.sample(&l, &[]).unwrap();
                let got = match by_band.sample_band(&band).unwrap() {
                    Some(t) => {
                        drawn += 1;
                        t
                    }
                    None => {
                        declined += 1;
                        by_band.sample(&l, &[]).unwrap()
                    }
                };
                assert_eq!(got, want, "case {case} step {step}");
            }
        }
        // Both outcomes ran (flat rows and capacity 8 overflow; peaked rows fit).
        assert!(
            drawn > 50 && declined > 10,
            "drawn {drawn} declined {declined}"
        );
    }

    /// Greedy decoding from a band (span 0) takes the token `sample` takes on the rows the
    /// argmax finds awkward: ties, ±0 and ±inf maxima, an excluded first index.
    #[test]
    fn greedy_band_takes_the_rows_argmax() {
        let cfg = SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        };
        assert_eq!(cfg.band_span(), Some(0.0));
        let mut s = Sampler::new(cfg).unwrap();
        let inf = f32::INFINITY;
        let mut drawn = 0;
        for (l, exclude) in [
            (vec![1.0f32, 3.0, 2.0, 3.0], None),
            (vec![1.0f32, 3.0, 2.0, 3.0], Some(1)),
            (vec![-1.0f32, -0.0, 0.0, -2.0], None),
            (vec![-1.0f32, 0.0, -0.0, -2.0], None),
            (vec![1.0f32, inf, 2.0, inf], None),
            (vec![f32::NEG_INFINITY; 4], None),
            (vec![f32::NEG_INFINITY; 4], Some(0)),
            (vec![f32::NEG_INFINITY, -inf, 5.0], Some(2)),
        ] {
            let band = LogitBand::from_words(&band_words(&l, 0.0, exclude, 16)).unwrap();
            let mut masked = l.clone();
            if let Some(e) = exclude {
                masked[e as usize] = f32::NEG_INFINITY;
            }
            let want = s.sample(&masked, &[]).unwrap();
            let got = match s.sample_band(&band).unwrap() {
                Some(t) => {
                    drawn += 1;
                    t
                }
                None => s.sample(&masked, &[]).unwrap(),
            };
            assert_eq!(got, want, "{l:?} exclude {exclude:?}");
        }
        assert_eq!(drawn, 5);
        let nan = [1.0, f32::NAN, 2.0];
        let band = LogitBand::from_words(&band_words(&nan, 0.0, None, 16)).unwrap();
        assert_eq!(
            s.sample_band(&band).unwrap_err().to_string(),
            s.sample(&nan, &[]).unwrap_err().to_string()
        );
    }

    #[test]
    fn band_errors_match_the_rows() {
        let cfg = SamplerConfig {
            temperature: 1.0,
            min_p: 0.05,
            ..SamplerConfig::default()
        };
        let span = cfg.band_span().unwrap();
        let mut s = Sampler::new(cfg.clone()).unwrap();
        for l in [
            vec![1.0f32, f32::NAN, 2.0, f32::NAN],
            vec![1.0, f32::INFINITY, 2.0, f32::INFINITY],
            vec![f32::NEG_INFINITY; 5],
        ] {
            let band = LogitBand::from_words(&band_words(&l, span, None, 16)).unwrap();
            let want = s.sample(&l, &[]).unwrap_err().to_string();
            let got = s.sample_band(&band).unwrap_err().to_string();
            assert_eq!(got, want);
        }
        // Settings that need the whole row decline without drawing.
        let mut greedyish = Sampler::new(SamplerConfig { top_p: 0.9, ..cfg }).unwrap();
        let band = LogitBand::from_words(&band_words(&[1.0, 2.0], span, None, 16)).unwrap();
        assert_eq!(greedyish.sample_band(&band).unwrap(), None);
        // A band that does not hold its own maximum is refused by name.
        let mut broken = band.clone();
        broken.items.clear();
        broken.count = 0;
        assert!(s
            .sample_band(&broken)
            .unwrap_err()
            .to_string()
            .contains("maximum"));
    }
}
