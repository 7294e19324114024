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
//! * [`Reordered`]: the bound for any implementation with its own (f32-accurate) arithmetic
//!   order, such as the GPU backend. FP8/FP4 simulations turn a last-bit difference next to a
//!   rounding boundary into a whole grid step, and a changed KV or indexer row reaches every
//!   later position that reads it, so after the first such flip a long sequence may legitimately
//!   wander far from the reference (the reference itself in float32 reaches 0.70 with three
//!   top-1 changes on one sequence). What stays true of a correct implementation is the
//!   *prefix*: until the first flip every position agrees to f32 noise, and a flip lands at a
//!   random position in a minority of sequences, while a semantic bug acts in
//!   every sequence from the first position where its op runs. The bound ([`Reordered`]) is
//!   therefore on the first [`PREFIX`] positions, counted over sequences (see
//!   tools/oracle/README.md, "Reorder and negative controls", for the measurements behind each
//!   number).

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

/// Reordered bound: how many leading positions of a sequence are judged. By position 100
/// every simulation has acted on every fixture (raw KV FP8 from 0, compressed-row FP8 from 3,
/// indexer scoring from 35 or 67), and a correct implementation's boundary flips have mostly
/// not yet propagated far.
pub const PREFIX: usize = 100;
/// Reordered bound: the largest e_t a *clean* prefix may have. Measured: correct controls
/// without a flip stay within 2.7e-3 over the first 100 positions, one FP8 flip in a
/// compressed row reaches 5.8e-3, the smallest planted bug 1.5e-2; 5e-3 is also the strict
/// bound's every-position limit.
pub const PREFIX_MAX: f64 = 5e-3;
/// Reordered bound: the share of sequence-paths with at least [`PREFIX`] positions whose
/// prefix must be clean. Measured over prefill, decode and chunked: correct controls 60–100 %
/// (the harshest, 16-ulp noise on every op, 60 %; the reference itself in float32 100 %),
/// every planted bug 0 %.
pub const CLEAN_SHARE: f64 = 1.0 / 3.0;

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

/// Per position of `logits` (`[T, vocab]`), the largest minus the second largest value: the
/// top-1/top-2 gap the fixtures record for their reference, computed here for a reference that
/// is another engine run (`ds4-engine-check parity`). A row with a NaN gives NaN; [`compare`]
/// then rates that position as infinitely wrong anyway.
pub fn top1_gaps(logits: &[f32], vocab: usize) -> Result<Vec<f32>, String> {
    if vocab < 2 || !logits.len().is_multiple_of(vocab) {
        return Err(format!(
            "{} logits are not a whole number of rows of {vocab} (>= 2)",
            logits.len()
        ));
    }
    Ok(logits
        .chunks(vocab)
        .map(|r| {
            let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &v in r {
                if v.is_nan() {
                    return f32::NAN;
                }
                if v > a {
                    b = a;
                    a = v;
                } else if v > b {
                    b = v;
                }
            }
            a - b
        })
        .collect())
}

/// [`compare`] against another run's logits: the top-1 gaps are taken from `want` itself.
pub fn compare_runs(got: &[f32], want: &[f32], vocab: usize) -> Result<SeqErrors, String> {
    compare(got, want, &top1_gaps(want, vocab)?, vocab)
}

/// Compares `got` with `want` (`[T, vocab]` each); `gaps` is the reference's per-position
/// top-1/top-2 gap. Errors (not panics) on inconsistent lengths.
pub fn compare(got: &[f32], want: &[f32], gaps: &[f32], vocab: usize) -> Result<SeqErrors, String> {
    if vocab == 0 || !want.len().is_multiple_of(vocab) {
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

/// Whether one sequence-path's prefix is clean: over the first [`PREFIX`] positions (the whole
/// sequence if shorter) every e_t ≤ [`PREFIX_MAX`] and the top-1 is identical wherever the
/// reference gap exceeds [`TOP1_GAP`]. The error says why not.
pub fn clean_prefix(s: &SeqErrors) -> Result<(), String> {
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
    let early = s.top1_mismatch.iter().filter(|&&t| t < n).count();
    if early > 0 {
        why.push(format!(
            "top-1 differs at {early} of the first {n} positions"
        ));
    }
    if why.is_empty() {
        Ok(())
    } else {
        Err(why.join("; "))
    }
}

/// The reordered bound, pooled over every sequence-path of a run (see [`Reordered::verdict`]).
#[derive(Debug, Clone, Default)]
pub struct Reordered {
    /// Sequence-paths shorter than [`PREFIX`]: (clean, all).
    pub short: (usize, usize),
    /// Sequence-paths of at least [`PREFIX`] positions: (clean, all).
    pub long: (usize, usize),
    /// Sequence-paths with a NaN (or infinite) logit anywhere.
    pub nan: usize,
}

impl Reordered {
    /// Adds one sequence-path; returns its [`clean_prefix`] verdict.
    pub fn add(&mut self, s: &SeqErrors) -> Result<(), String> {
        let v = clean_prefix(s);
        let c = usize::from(v.is_ok());
        if s.len() < PREFIX {
            self.short.0 += c;
            self.short.1 += 1;
        } else {
            self.long.0 += c;
            self.long.1 += 1;
        }
        if s.errors.iter().any(|e| e.is_infinite()) {
            self.nan += 1;
        }
        v
    }

    /// The bound for an implementation with its own f32 arithmetic order:
    /// * every sequence-path shorter than [`PREFIX`] is clean (no flip has room to grow);
    /// * at least [`CLEAN_SHARE`] of the longer sequence-paths are clean: a correct
    ///   implementation's flips are rare and land at random positions, a semantic bug acts
    ///   in every sequence as soon as its op runs;
    /// * no NaN anywhere.
    pub fn verdict(&self) -> Result<(), String> {
        let mut why = Vec::new();
        if self.short.0 < self.short.1 {
            why.push(format!(
                "{} of {} short sequence-paths not clean",
                self.short.1 - self.short.0,
                self.short.1
            ));
        }
        let share = self.long.0 as f64 / self.long.1.max(1) as f64;
        if self.long.1 > 0 && share < CLEAN_SHARE {
            why.push(format!(
                "{} of {} sequence-paths of >= {PREFIX} positions clean ({:.0}% < {:.0}%)",
                self.long.0,
                self.long.1,
                100.0 * share,
                100.0 * CLEAN_SHARE
            ));
        }
        if self.nan > 0 {
            why.push(format!("NaN in {} sequence-paths", self.nan));
        }
        if why.is_empty() {
            Ok(())
        } else {
            Err(why.join("; "))
        }
    }
}
