//! Token sampling: greedy, temperature, top-k, top-p, min-p, optional repetition penalty,
//! with a seeded RNG so a run is reproducible from its seed.
//!
//! Order of the filters (fixed, documented so results are explainable): repetition penalty
//! on the raw logits → greedy if `temperature == 0` → top-k on logits → softmax at
//! `temperature` → min-p (relative to the top probability) → top-p (nucleus, smallest prefix
//! of the sorted distribution reaching `p`) → draw. Ties in every sort are broken by the
//! lower token id, so the kept set never depends on sort stability.

use crate::error::{EngineError, Result};

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

#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Result<Sampler> {
        cfg.validate()?;
        let rng = Rng::new(cfg.seed);
        Ok(Sampler { cfg, rng })
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
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

/// Index of the largest value, lowest index on ties (NaN-free input).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
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
}
