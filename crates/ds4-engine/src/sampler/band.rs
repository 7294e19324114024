//! The sampling band: the part of a logits row that a min-p draw can reach.
//!
//! Why it exists: with min-p on (the CLI's default sampler: temperature 1, min-p 0.05) and
//! neither top-p nor a repetition penalty, the drawn token depends only on the row's
//! maximum and on the logits at or above `max + T·ln(min_p)`, usually a handful of the
//! 129,280. A GPU backend can find those on the device ([`crate::Backend::logit_band`]) and
//! copy back a few hundred bytes instead of the whole row (517 KB) each decoded token,
//! and the host then scans a few candidates instead of the vocabulary twice.
//!
//! The band is a superset of what the draw needs: every value `>= max - span`, where the
//! caller's `span` exceeds the min-p distance by a margin ([`SamplerConfig::band_span`]).
//! [`crate::Sampler::sample_band`] checks that the band's threshold lies at or below the
//! exact cut it computes and that no item was cut off by the capacity; otherwise it
//! declines before drawing, and the caller samples the full row with the same generator
//! state. So the token is always the one [`crate::Sampler::sample`] picks from the row
//! (docs/server.md §6).
//!
//! The band as words (what the device writes and the host reads back): a header of
//! [`BAND_HEAD`] i32 — the maximum's bits, the threshold's bits, the number of values in
//! the band, the first NaN's index (or -1), the first +inf's index (or -1), three zeros —
//! then up to `cap` (index, value bits) pairs in index order.

use super::SamplerConfig;

/// i32 words before the items.
pub const BAND_HEAD: usize = 8;
/// Items a decode step's band buffer holds (8 KB): a min-p 0.05 band of a real model's
/// row holds at most a few dozen; a flatter row falls back to the full row.
pub const BAND_CAP: usize = 1024;
/// Items copied back in the first read; a larger band needs a second one.
pub const BAND_FIRST_READ: usize = 64;

/// The band of one logits row (see the module docs).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogitBand {
    /// The largest value (NaN and the excluded index ignored; -inf for none).
    pub max: f32,
    /// `max - span`, as the device computed it: the band is every value `>=` this.
    pub threshold: f32,
    /// Values in the band (may exceed `items.len()` when the capacity cut it).
    pub count: usize,
    pub first_nan: Option<u32>,
    pub first_pos_inf: Option<u32>,
    /// (index, value) in index order; complete iff `items.len() == count`.
    pub items: Vec<(u32, f32)>,
}

impl LogitBand {
    /// Reads the band from its words (header, then as many items as `words` holds, at
    /// most `count`). `None` for fewer than [`BAND_HEAD`] words or a negative count.
    pub fn from_words(words: &[i32]) -> Option<LogitBand> {
        let head = words.get(..BAND_HEAD)?;
        let count = usize::try_from(head[2]).ok()?;
        let opt = |w: i32| u32::try_from(w).ok();
        let pairs = &words[BAND_HEAD..];
        let n = count.min(pairs.len() / 2);
        let items = pairs[..2 * n]
            .chunks_exact(2)
            .map(|p| (p[0] as u32, f32::from_bits(p[1] as u32)))
            .collect();
        Some(LogitBand {
            max: f32::from_bits(head[0] as u32),
            threshold: f32::from_bits(head[1] as u32),
            count,
            first_nan: opt(head[3]),
            first_pos_inf: opt(head[4]),
            items,
        })
    }

    /// Whether every value of the band came back.
    pub fn is_complete(&self) -> bool {
        self.items.len() == self.count
    }
}

/// The definition of the band's words for `x` (what every backend must write): index
/// `exclude` counts as -inf (the EOS mask of `--ignore-eos`) and is never reported; at most
/// `cap` items. The CPU backend's implementation and the reference for the GPU kernel.
pub fn band_words(x: &[f32], span: f32, exclude: Option<u32>, cap: usize) -> Vec<i32> {
    let skip = |i: usize| exclude.is_some_and(|e| e as usize == i);
    let mut max = f32::NEG_INFINITY;
    let (mut nan, mut inf) = (-1i32, -1i32);
    for (i, &v) in x.iter().enumerate() {
        if skip(i) {
            continue;
        }
        if v.is_nan() {
            if nan < 0 {
                nan = i as i32;
            }
        } else {
            if v > max {
                max = v;
            }
            if v == f32::INFINITY && inf < 0 {
                inf = i as i32;
            }
        }
    }
    // Either zero may win a reduction on a device; the definition says +0.
    if max == 0.0 {
        max = 0.0;
    }
    let thr = max - span;
    let mut out = vec![0i32; BAND_HEAD];
    let mut count = 0i32;
    for (i, &v) in x.iter().enumerate() {
        if !skip(i) && v >= thr {
            if (count as usize) < cap {
                out.push(i as i32);
                out.push(v.to_bits() as i32);
            }
            count = count.saturating_add(1);
        }
    }
    out[0] = max.to_bits() as i32;
    out[1] = thr.to_bits() as i32;
    out[2] = count;
    out[3] = nan;
    out[4] = inf;
    out.resize(BAND_HEAD + 2 * cap, 0);
    out
}

impl SamplerConfig {
    /// The band a draw with these settings needs, as `span` below the maximum, when it needs
    /// only a band: greedy decoding (span 0: the values equal to the maximum, the first of
    /// which is the token), or temperature > 0 with min-p on, top-k and top-p off and no
    /// repetition penalty. `None` otherwise (the draw needs the whole row). The margin (1 %
    /// plus 1e-3) keeps the band's f32 threshold below the exact f64 cut for logits up to
    /// ~1e3 in size; beyond that [`crate::Sampler::sample_band`] finds the band short and
    /// declines.
    pub fn band_span(&self) -> Option<f32> {
        if self.is_greedy() {
            return Some(0.0);
        }
        let eligible = self.temperature > 0.0
            && self.min_p > 0.0
            && self.top_k == 0
            && self.top_p >= 1.0
            && self.repeat_penalty == 1.0;
        if !eligible {
            return None;
        }
        let d = -(self.temperature as f64) * (self.min_p as f64).ln();
        let span = (d * 1.01 + 1e-3) as f32;
        span.is_finite().then_some(span)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip_and_follow_the_definition() {
        let x = [1.0f32, 5.0, f32::NAN, 4.5, -2.0, 5.0, 3.9];
        let w = band_words(&x, 1.0, None, 2);
        assert_eq!(w.len(), BAND_HEAD + 4);
        let b = LogitBand::from_words(&w).unwrap();
        assert_eq!(b.max, 5.0);
        assert_eq!(b.threshold, 4.0);
        assert_eq!(b.count, 3);
        assert_eq!(b.first_nan, Some(2));
        assert_eq!(b.first_pos_inf, None);
        assert_eq!(b.items, vec![(1, 5.0), (3, 4.5)]);
        assert!(!b.is_complete());
        // The excluded index is -inf: the maximum moves, the band follows it.
        let b = LogitBand::from_words(&band_words(&x, 1.0, Some(1), 8)).unwrap();
        assert_eq!((b.max, b.count), (5.0, 2));
        assert_eq!(b.items, vec![(3, 4.5), (5, 5.0)]);
        let b = LogitBand::from_words(&band_words(&x, 1.0, Some(5), 8)).unwrap();
        assert_eq!(b.items, vec![(1, 5.0), (3, 4.5)]);
        assert!(b.is_complete());
        let inf = [0.0f32, f32::INFINITY, 1.0, f32::INFINITY];
        let b = LogitBand::from_words(&band_words(&inf, 1.0, None, 8)).unwrap();
        assert_eq!(
            (b.max, b.first_pos_inf, b.count),
            (f32::INFINITY, Some(1), 2)
        );
        assert!(LogitBand::from_words(&[0; 3]).is_none());
        let mut bad = band_words(&x, 1.0, None, 2);
        bad[2] = -1;
        assert!(LogitBand::from_words(&bad).is_none());
    }

    #[test]
    fn only_min_p_and_greedy_settings_have_a_band() {
        let c = SamplerConfig {
            temperature: 1.0,
            min_p: 0.05,
            ..SamplerConfig::default()
        };
        let s = c.band_span().unwrap();
        assert!(s > -(0.05f32.ln()) && s < 3.1, "{s}");
        let greedy = SamplerConfig {
            temperature: 0.0,
            ..c.clone()
        };
        assert_eq!(greedy.band_span(), Some(0.0));
        for off in [
            SamplerConfig {
                repeat_penalty: 1.1,
                ..greedy
            },
            SamplerConfig {
                min_p: 0.0,
                ..c.clone()
            },
            SamplerConfig {
                top_k: 40,
                ..c.clone()
            },
            SamplerConfig {
                top_p: 0.9,
                ..c.clone()
            },
            SamplerConfig {
                repeat_penalty: 1.1,
                ..c.clone()
            },
        ] {
            assert_eq!(off.band_span(), None, "{off:?}");
        }
    }
}
