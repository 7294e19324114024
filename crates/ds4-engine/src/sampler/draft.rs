//! Accepting or rejecting a drafted token so that the emitted tokens have exactly the
//! sampler's distribution (speculative sampling, docs/speculative.md §3).
//!
//! Let `p` be the distribution the sampler draws from at a position (the repetition
//! penalty, temperature, top-k, min-p and top-p applied, in the sampler's order) and `x`
//! the drafted token. The drafters here are deterministic: their proposal is the point
//! mass `q = δ_x`. The general rule — accept `x` with probability `min(1, p(x)/q(x))`, on
//! rejection draw from `max(0, p − q)` normalised — then reads:
//! - accept with probability `p(x)`;
//! - on rejection draw from `p` with `x` removed, renormalised: `max(0, p(y) − δ_x(y))` is
//!   `p(y)` for `y ≠ x` and `max(0, p(x) − 1) = 0` for `x`.
//!
//! The emitted token `y` then has `P(y = x) = p(x)` and, for `y ≠ x`,
//! `P(y) = (1 − p(x)) · p(y) / (1 − p(x)) = p(y)`: exactly `p`, whatever the draft. Later
//! positions are verified only while every earlier draft was accepted, so each is
//! conditioned on the same history the sampler would have seen (which is why `history`
//! must hold the accepted drafts: the repetition penalty reads it).
//!
//! Greedy sampling (temperature 0) is the case `p = δ_argmax`: accept exactly when the
//! draft is the token the sampler picks, and that token is emitted either way.
//!
//! A drafter with a distribution `q` (the MTP block's logits through this sampler) draws its
//! draft `x` from `q`; then the rule is used as it stands ([`Sampler::sample_draft_from`]):
//! accept with probability `min(1, p(x)/q(x))`, else draw from `max(0, p − q)` normalised.
//! `P(emit y) = q(y)·min(1, p(y)/q(y)) + (1 − Σ_z min(p(z), q(z)))·max(0, p(y) − q(y)) /
//! Σ_z max(0, p(z) − q(z)) = min(p(y), q(y)) + max(0, p(y) − q(y)) = p(y)`, since both sums
//! equal `1 − Σ_z min(p(z), q(z))`.
//!
//! `p` is computed by the formulation the fast sampler is tested against (the whole
//! vocabulary sorted, lower id first on ties): the same kept set, and probabilities equal
//! up to the summation order of the normalisers. That is O(V log V) per verified draft;
//! ordinary steps keep the fast path.

use super::{argmax, Sampler};
use crate::error::{EngineError, Result};

impl Sampler {
    /// The distribution this sampler draws from after `logits` and `history`: the kept
    /// tokens with their probabilities (summing to 1), by decreasing probability, lower id
    /// first on ties. Greedy: the argmax with probability 1.
    pub fn distribution(&mut self, logits: &[f32], history: &[u32]) -> Result<Vec<(u32, f64)>> {
        if logits.is_empty() {
            return Err(EngineError::Sampler("empty logits".into()));
        }
        if let Some(i) = logits.iter().position(|x| x.is_nan()) {
            return Err(EngineError::Sampler(format!("logit {i} is NaN")));
        }
        let cfg = &self.cfg;
        let mut l = logits.to_vec();
        if cfg.repeat_penalty != 1.0 {
            let start = history.len().saturating_sub(cfg.repeat_window);
            let mut seen = vec![false; l.len()];
            for &t in &history[start..] {
                if let Some(s) = seen.get_mut(t as usize) {
                    if !*s {
                        *s = true;
                        let v = &mut l[t as usize];
                        *v = if *v > 0.0 {
                            *v / cfg.repeat_penalty
                        } else {
                            *v * cfg.repeat_penalty
                        };
                    }
                }
            }
        }
        if cfg.temperature == 0.0 {
            return Ok(vec![(argmax(&l), 1.0)]);
        }
        let top32 = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if top32 == f32::INFINITY {
            return Err(EngineError::Sampler("a logit is +inf".into()));
        }
        if top32 == f32::NEG_INFINITY {
            return Err(EngineError::Sampler("every logit is -inf".into()));
        }
        let mut idx: Vec<u32> = (0..l.len() as u32).collect();
        idx.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
        if cfg.top_k > 0 && cfg.top_k < idx.len() {
            idx.truncate(cfg.top_k);
        }
        let inv_t = 1.0 / cfg.temperature as f64;
        let top = top32 as f64;
        let mut p: Vec<f64> = idx
            .iter()
            .map(|&i| ((l[i as usize] as f64 - top) * inv_t).exp())
            .collect();
        let z: f64 = p.iter().sum();
        for v in &mut p {
            *v /= z;
        }
        if cfg.min_p > 0.0 {
            let floor = cfg.min_p as f64 * p[0];
            let keep = p.iter().take_while(|&&v| v >= floor).count().max(1);
            p.truncate(keep);
        }
        if cfg.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = p.len();
            for (i, v) in p.iter().enumerate() {
                acc += v;
                if acc >= cfg.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            p.truncate(keep);
        }
        let total: f64 = p.iter().sum();
        Ok(idx
            .into_iter()
            .zip(p)
            .map(|(i, v)| (i, v / total))
            .collect())
    }

    /// Draws a token from `dist` (a distribution as [`Sampler::distribution`] returns it)
    /// with this sampler's random numbers: a drafter's proposal from its own distribution.
    pub fn draw(&mut self, dist: &[(u32, f64)]) -> Option<u32> {
        let mut r = self.rng.next_f64() * dist.iter().map(|&(_, v)| v).sum::<f64>();
        for &(t, v) in dist {
            if r < v {
                return Some(t);
            }
            r -= v;
        }
        dist.last().map(|&(t, _)| t)
    }

    /// The token emitted at a position whose draft `draft` was drawn from the distribution
    /// `q` (pairs of token and probability, summing to 1): `draft` with probability
    /// `min(1, p(draft)/q(draft))`, else a draw from `max(0, p − q)` normalised (the module
    /// doc derives why the result has exactly [`Sampler::sample`]'s distribution). An empty
    /// `q`, or one without mass on `draft`, is the point mass on `draft`
    /// ([`Sampler::sample_draft`]).
    pub fn sample_draft_from(
        &mut self,
        logits: &[f32],
        history: &[u32],
        draft: u32,
        q: &[(u32, f64)],
    ) -> Result<u32> {
        let q_of = |t: u32| q.iter().find(|&&(u, _)| u == t).map_or(0.0, |&(_, v)| v);
        let q_draft = q_of(draft);
        if self.cfg.temperature == 0.0 || q_draft <= 0.0 {
            return self.sample_draft(logits, history, draft);
        }
        let dist = self.distribution(logits, history)?;
        let p_draft = dist
            .iter()
            .find(|&&(t, _)| t == draft)
            .map_or(0.0, |&(_, v)| v);
        if self.rng.next_f64() * q_draft < p_draft {
            return Ok(draft);
        }
        let mut dense = vec![0f64; logits.len()];
        for &(t, v) in q {
            if let Some(d) = dense.get_mut(t as usize) {
                *d = v;
            }
        }
        let resid: Vec<(u32, f64)> = dist
            .iter()
            .map(|&(t, v)| {
                (
                    t,
                    (v - dense.get(t as usize).copied().unwrap_or(0.0)).max(0.0),
                )
            })
            .filter(|&(_, v)| v > 0.0)
            .collect();
        // A rejection with nothing left over is a rounding case of p = q: keep the draft.
        Ok(self.draw(&resid).unwrap_or(draft))
    }

    /// The token emitted at a position whose drafted token is `draft`: `draft` itself when
    /// accepted, else a draw from the sampler's distribution without it (the module doc
    /// derives why the result is distributed exactly as [`Sampler::sample`]'s draw).
    /// `history` is what [`Sampler::sample`] would get (the accepted drafts included).
    pub fn sample_draft(&mut self, logits: &[f32], history: &[u32], draft: u32) -> Result<u32> {
        if self.cfg.temperature == 0.0 {
            // p is a point mass: the draft stands exactly when it is the sampler's pick.
            return self.sample(logits, history);
        }
        let dist = self.distribution(logits, history)?;
        let p_draft = dist
            .iter()
            .find(|&&(t, _)| t == draft)
            .map_or(0.0, |&(_, v)| v);
        if self.rng.next_f64() < p_draft {
            return Ok(draft);
        }
        // Rejected (p(draft) < 1 here, so another token has mass): p without the draft.
        let rest: f64 = dist
            .iter()
            .filter(|&&(t, _)| t != draft)
            .map(|&(_, v)| v)
            .sum();
        let mut r = self.rng.next_f64() * rest;
        let mut last = None;
        for &(t, v) in dist.iter().filter(|&&(t, _)| t != draft) {
            if r < v {
                return Ok(t);
            }
            r -= v;
            last = Some(t);
        }
        // Rounding left `r` past the end: the last kept token other than the draft.
        last.ok_or_else(|| EngineError::Sampler("no token besides the draft to draw".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::super::SamplerConfig;
    use super::*;

    /// A two-step "model" over a vocabulary of 10: fixed first logits, second logits that
    /// depend on the first token.
    fn first() -> Vec<f32> {
        vec![2.0, 1.5, 1.4, 0.3, -0.5, 0.9, 1.1, -2.0, 0.0, 0.6]
    }
    fn second(t1: u32) -> Vec<f32> {
        (0..10u32)
            .map(|i| ((i * 7 + t1 * 3) % 10) as f32 * 0.35 - 1.0)
            .collect()
    }

    fn cfg(seed: u64) -> SamplerConfig {
        SamplerConfig {
            temperature: 0.9,
            top_k: 8,
            top_p: 0.97,
            min_p: 0.03,
            repeat_penalty: 1.4,
            repeat_window: 64,
            seed,
        }
    }

    /// Pearson's chi-square of `counts` against `probs · n` (cells with expected count
    /// under 5 pooled into one) and its degrees of freedom.
    fn chi_square(counts: &[u64], probs: &[f64], n: u64) -> (f64, usize) {
        let (mut chi, mut cells) = (0.0, 0usize);
        let (mut pool_o, mut pool_e) = (0.0, 0.0);
        for (&o, &p) in counts.iter().zip(probs) {
            let e = p * n as f64;
            if e < 5.0 {
                pool_o += o as f64;
                pool_e += e;
                continue;
            }
            chi += (o as f64 - e).powi(2) / e;
            cells += 1;
        }
        if pool_e > 0.0 || pool_o > 0.0 {
            // A count where the exact probability is 0 counts enormously.
            chi += (pool_o - pool_e).powi(2) / pool_e.max(1e-12);
            cells += 1;
        }
        (chi, cells.saturating_sub(1))
    }

    /// The first two emitted tokens of speculative sampling with drafts `(x1, x2)`, over
    /// many seeded draws, against the exact joint distribution `p(t1) · p(t2 | t1)`.
    /// A wrong acceptance rule (drawing from `p` instead of `p` without the draft on
    /// rejection, accepting with `p(x)` without a redraw, …) moves mass onto or off the
    /// draft and fails by orders of magnitude.
    #[test]
    fn speculative_sampling_keeps_the_distribution() {
        let prompt = [3u32, 9];
        let mut exact = Sampler::new(cfg(0)).unwrap();
        let p1 = exact.distribution(&first(), &prompt).unwrap();
        let mut joint = vec![0.0f64; 100];
        for &(t1, a) in &p1 {
            let h = [prompt[0], prompt[1], t1];
            for (t2, b) in exact.distribution(&second(t1), &h).unwrap() {
                joint[(t1 * 10 + t2) as usize] += a * b;
            }
        }
        assert!((joint.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        // Drafts of high and middle probability, and one the filters cut (7: top-k, min-p).
        for (x1, x2) in [(0u32, 4u32), (2, 5), (7, 0)] {
            let n = 60_000u64;
            let mut s = Sampler::new(cfg(1234 + u64::from(x1))).unwrap();
            let mut counts = vec![0u64; 100];
            for _ in 0..n {
                let t1 = s.sample_draft(&first(), &prompt, x1).unwrap();
                let h = [prompt[0], prompt[1], t1];
                let t2 = if t1 == x1 {
                    s.sample_draft(&second(t1), &h, x2).unwrap()
                } else {
                    s.sample(&second(t1), &h).unwrap()
                };
                counts[(t1 * 10 + t2) as usize] += 1;
            }
            let (chi, df) = chi_square(&counts, &joint, n);
            // Far above df (mean df, sd sqrt(2 df)): p < 1e-6 for df around 30.
            let bound = df as f64 + 8.0 * (2.0 * df as f64).sqrt();
            assert!(
                chi < bound,
                "drafts ({x1}, {x2}): chi-square {chi:.1} with {df} degrees of freedom"
            );
        }
    }

    /// Drafts drawn from a distribution `q` (another model's, through the same sampler)
    /// and accepted by `min(1, p/q)` with the residual `max(0, p − q)`: the first two
    /// tokens again have the exact joint `p(t1)·p(t2 | t1)`. Treating the draft as a point
    /// mass, or redrawing from `p` on rejection, fails it.
    #[test]
    fn speculative_sampling_from_a_draft_distribution_keeps_the_distribution() {
        let prompt = [3u32, 9];
        let mut exact = Sampler::new(cfg(0)).unwrap();
        let p1 = exact.distribution(&first(), &prompt).unwrap();
        let mut joint = vec![0.0f64; 100];
        for &(t1, a) in &p1 {
            let h = [prompt[0], prompt[1], t1];
            for (t2, b) in exact.distribution(&second(t1), &h).unwrap() {
                joint[(t1 * 10 + t2) as usize] += a * b;
            }
        }
        // The draft model: other logits, no penalty history (a proposal may be anything).
        let draft1: Vec<f32> = first().iter().rev().map(|x| x * 0.8).collect();
        let draft2 = |t1: u32| -> Vec<f32> { second((t1 + 3) % 10) };
        let n = 60_000u64;
        let mut s = Sampler::new(cfg(4321)).unwrap();
        let mut counts = vec![0u64; 100];
        let mut accepted = 0u64;
        for _ in 0..n {
            let q1 = s.distribution(&draft1, &[]).unwrap();
            let x1 = s.draw(&q1).unwrap();
            let t1 = s.sample_draft_from(&first(), &prompt, x1, &q1).unwrap();
            let h = [prompt[0], prompt[1], t1];
            let t2 = if t1 == x1 {
                accepted += 1;
                let q2 = s.distribution(&draft2(t1), &[]).unwrap();
                let x2 = s.draw(&q2).unwrap();
                s.sample_draft_from(&second(t1), &h, x2, &q2).unwrap()
            } else {
                s.sample(&second(t1), &h).unwrap()
            };
            counts[(t1 * 10 + t2) as usize] += 1;
        }
        assert!(accepted > n / 10 && accepted < n - n / 10, "{accepted}");
        let (chi, df) = chi_square(&counts, &joint, n);
        let bound = df as f64 + 8.0 * (2.0 * df as f64).sqrt();
        assert!(
            chi < bound,
            "chi-square {chi:.1} with {df} degrees of freedom"
        );
    }

    #[test]
    fn greedy_drafts_stand_only_when_they_are_the_pick() {
        let mut s = Sampler::new(SamplerConfig::default()).unwrap();
        let l = first();
        assert_eq!(s.sample_draft(&l, &[], 0).unwrap(), 0);
        assert_eq!(s.sample_draft(&l, &[], 3).unwrap(), 0);
        // With a repetition penalty the pick moves, and so does acceptance.
        let mut s = Sampler::new(SamplerConfig {
            repeat_penalty: 2.0,
            ..SamplerConfig::default()
        })
        .unwrap();
        assert_eq!(s.sample_draft(&l, &[0], 1).unwrap(), 1);
        assert_eq!(s.sample_draft(&l, &[0], 0).unwrap(), 1);
        assert_eq!(s.distribution(&l, &[0]).unwrap(), vec![(1, 1.0)]);
    }

    #[test]
    fn the_distribution_is_what_sample_draws() {
        // Frequencies of plain `sample` against `distribution`, same config.
        let mut s = Sampler::new(cfg(77)).unwrap();
        let p = s.distribution(&first(), &[3, 9]).unwrap();
        let mut probs = vec![0.0; 10];
        for (t, v) in p {
            probs[t as usize] = v;
        }
        let n = 60_000u64;
        let mut counts = vec![0u64; 10];
        for _ in 0..n {
            counts[s.sample(&first(), &[3, 9]).unwrap() as usize] += 1;
        }
        let (chi, df) = chi_square(&counts, &probs, n);
        assert!(
            chi < df as f64 + 8.0 * (2.0 * df as f64).sqrt() + 10.0,
            "{chi} {df}"
        );
    }

    #[test]
    fn bad_logits_are_errors() {
        let mut s = Sampler::new(cfg(1)).unwrap();
        assert!(s.sample_draft(&[], &[], 0).is_err());
        assert!(s.sample_draft(&[0.0, f32::NAN], &[], 0).is_err());
        assert!(s.sample_draft(&[f32::NEG_INFINITY; 3], &[], 0).is_err());
        // A draft outside the vocabulary is simply never accepted.
        let t = s.sample_draft(&first(), &[], 1000).unwrap();
        assert!(t < 10);
    }
}
