//! Judging official-mode logits against the float64 reference of the tiny fixtures
//! (`tests/fixtures/tiny-*/official.safetensors`, written by `tools/oracle/make_official.py`).
//!
//! Two bounds, both on the per-position error e_t = max_v |got − ref| / max(1, |ref|):
//!
//! * [`strict`]: the CPU engine's bound (the one of `crates/ds4-cpu/tests/official_reference.rs`):
//!   ≥ 85 % of positions within 1e-4 per sequence (≥ 95 % pooled), every position within 5e-3,
//!   identical top-1 where the reference's top-1/top-2 gap exceeds 1e-2. It holds for the CPU
//!   engine because the engine's f32 rounding happens to sit close to the reference's; it is not
//!   a property every correct implementation has.
//! * [`reordered`]: the bound for any implementation with its own (f32-accurate) arithmetic
//!   order, such as the GPU backend. FP8/FP4 simulations turn a last-bit difference next to a
//!   rounding boundary into a whole grid step, and a changed KV or indexer row reaches every
//!   later position that reads it, so after the first such flip a long sequence may legitimately
//!   wander far from the reference (the reference itself in float32 reaches 0.70 with three
//!   top-1 changes on one sequence). What stays true of a correct implementation is the
//!   *prefix*: until the first flip every position agrees to f32 noise, and flips are rare, so
//!   the first departure lies well into the sequence. A semantic bug departs at once. The bound
//!   is therefore on the prefix (see [`reordered`] and tools/oracle/README.md, "Reorder and
//!   negative controls", for the measurements behind each number).

pub mod controls;

/// A position "agrees" when e_t is at most this.
pub const TIGHT: f64 = 1e-4;
/// Strict bound: share of positions within [`TIGHT`], pooled and per sequence.
pub const STRICT_SHARE_POOLED: f64 = 0.95;
pub const STRICT_SHARE_PER_SEQ: f64 = 0.85;
/// Strict bound: every position.
pub const STRICT_LOOSE: f64 = 5e-3;
/// Top-1 changes are excused where the reference's top-1/top-2 gap is at most this.
pub const TOP1_GAP: f32 = 1e-2;

/// Reordered bound: every position before this one must agree (e_t ≤ [`TIGHT`]) with an
/// identical top-1 wherever the gap exceeds [`TOP1_GAP`].
pub const PREFIX: usize = 64;
/// Reordered bound: within the prefix, the largest e_t must also stay below this (f32 noise
/// is ≤ 1e-5 on every sequence; a bug that sneaks under [`TIGHT`] would still show here).
pub const PREFIX_MAX: f64 = 3e-5;

/// Per-position errors of one sequence and the top-1 comparison.
#[derive(Debug, Clone)]
pub struct SeqErrors {
    /// e_t per position; NaN in the logits becomes +inf (fails every bound).
    pub errors: Vec<f64>,
    /// Positions whose argmax differs although the reference gap exceeds [`TOP1_GAP`].
    pub top1_mismatch: Vec<usize>,
    /// Positions whose argmax differs within the excused gap.
    pub top1_excused: usize,
}

/// Index of the largest value, the first on ties (NaN never wins unless first).
fn argmax(r: &[f32]) -> usize {
    r.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0
}

/// Compares `got` with `want` (`[T, vocab]` each); `gaps` is the reference's per-position
/// top-1/top-2 gap. Errors (not panics) on inconsistent lengths.
pub fn compare(got: &[f32], want: &[f32], gaps: &[f32], vocab: usize) -> Result<SeqErrors, String> {
    if vocab == 0 || want.len() % vocab != 0 {
        return Err(format!(
            "reference of {} values is not a whole number of rows of {vocab}",
            want.len()
        ));
    }
    if got.len() != want.len() {
        return Err(format!(
            "{} logits, the reference has {}",
            got.len(),
            want.len()
        ));
    }
    if gaps.len() != want.len() / vocab {
        return Err(format!(
            "{} top-1 gaps for {} positions",
            gaps.len(),
            want.len() / vocab
        ));
    }
    let mut out = SeqErrors {
        errors: Vec::with_capacity(gaps.len()),
        top1_mismatch: Vec::new(),
        top1_excused: 0,
    };
    for (t, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let e = g.iter().zip(w).fold(0f64, |m, (a, b)| {
            let d = (*a as f64 - *b as f64).abs() / (*b as f64).abs().max(1.0);
            if d.is_nan() || m.is_infinite() {
                f64::INFINITY
            } else {
                m.max(d)
            }
        });
        out.errors.push(e);
        if argmax(g) != argmax(w) {
            if gaps[t] > TOP1_GAP {
                out.top1_mismatch.push(t);
            } else {
                out.top1_excused += 1;
            }
        }
    }
    Ok(out)
}

impl SeqErrors {
    pub fn len(&self) -> usize {
        self.errors.len()
    }
    pub fn is_empty(&self) -> bool {
        self.errors.is_empty()
    }
    /// Positions with e_t ≤ [`TIGHT`].
    pub fn tight(&self) -> usize {
        self.errors.iter().filter(|&&e| e <= TIGHT).count()
    }
    pub fn share_tight(&self) -> f64 {
        self.tight() as f64 / self.len().max(1) as f64
    }
    pub fn worst(&self) -> f64 {
        self.errors.iter().fold(0f64, |m, &e| m.max(e))
    }
    /// The q-quantile of e_t (nearest rank).
    pub fn quantile(&self, q: f64) -> f64 {
        let mut s = self.errors.clone();
        s.sort_by(f64::total_cmp);
        s.get(((s.len().max(1) - 1) as f64 * q).round() as usize)
            .copied()
            .unwrap_or(0.0)
    }
    /// First position with e_t > [`TIGHT`] or a top-1 change beyond the gap: where the run
    /// leaves the reference.
    pub fn departure(&self) -> Option<usize> {
        let e = self.errors.iter().position(|&e| e > TIGHT);
        let t = self.top1_mismatch.first().copied();
        match (e, t) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
    /// Largest e_t over the first `n` positions.
    pub fn prefix_worst(&self, n: usize) -> f64 {
        self.errors[..n.min(self.len())]
            .iter()
            .fold(0f64, |m, &e| m.max(e))
    }
    /// One line of statistics.
    pub fn summary(&self) -> String {
        format!(
            "{:5.1}% <= {TIGHT:e}, median {:.1e}, p90 {:.1e}, max {:.1e}, departs at {}, max over first {PREFIX} {:.1e}, top-1 mismatches {} (+{} within gap)",
            100.0 * self.share_tight(),
            self.quantile(0.5),
            self.quantile(0.9),
            self.worst(),
            self.departure().map_or("-".to_string(), |d| d.to_string()),
            self.prefix_worst(PREFIX),
            self.top1_mismatch.len(),
            self.top1_excused
        )
    }
}

/// The CPU engine's per-sequence bound (the pooled share is checked by the caller).
pub fn strict(s: &SeqErrors) -> Result<(), String> {
    let mut why = Vec::new();
    if s.share_tight() < STRICT_SHARE_PER_SEQ {
        why.push(format!(
            "{:.1}% within {TIGHT:e} (< {:.0}%)",
            100.0 * s.share_tight(),
            100.0 * STRICT_SHARE_PER_SEQ
        ));
    }
    if s.worst() > STRICT_LOOSE {
        why.push(format!("max {:.2e} > {STRICT_LOOSE:e}", s.worst()));
    }
    if !s.top1_mismatch.is_empty() {
        why.push(format!(
            "top-1 differs at {} positions",
            s.top1_mismatch.len()
        ));
    }
    if why.is_empty() {
        Ok(())
    } else {
        Err(why.join("; "))
    }
}

/// The bound for an implementation with its own f32 arithmetic order: over the first
/// [`PREFIX`] positions (the whole sequence if shorter) every e_t ≤ [`PREFIX_MAX`] and the
/// top-1 is identical wherever the gap exceeds [`TOP1_GAP`]. Later positions are reported,
/// not judged (a boundary flip may move them arbitrarily far).
pub fn reordered(s: &SeqErrors) -> Result<(), String> {
    let n = PREFIX.min(s.len());
    let mut why = Vec::new();
    let w = s.prefix_worst(n);
    if w > PREFIX_MAX {
        let at = s.errors[..n].iter().position(|&e| e > PREFIX_MAX);
        why.push(format!(
            "max over the first {n} positions {w:.2e} > {PREFIX_MAX:e} (first at {})",
            at.map_or("?".into(), |a| a.to_string())
        ));
    }
    let early: Vec<_> = s.top1_mismatch.iter().filter(|&&t| t < n).collect();
    if !early.is_empty() {
        why.push(format!(
            "top-1 differs at {} of the first {n} positions",
            early.len()
        ));
    }
    if why.is_empty() {
        Ok(())
    } else {
        Err(why.join("; "))
    }
}
