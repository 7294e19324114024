//! The cost curve of speculative verification (`ds4-bench --verify K`, docs/speculative.md
//! §7): how long a verify step of `n` rows (the token and `n − 1` drafts) takes against one
//! decode step, and what that predicts for the speed-up at a given acceptance rate.
//!
//! Why a curve and not one number: drafting pays only if a verify of `k + 1` rows costs
//! well under `k + 1` decode steps. On a GPU at batch 1 the rows share one read of the
//! weights, so the curve is flat until the extra rows' compute and the distinct experts
//! they route to catch up; the predicted table tells which draft depth is worth it at each
//! acceptance rate before any drafter is measured.

use std::time::Instant;

use anyhow::{bail, Result};
use ds4_engine::{Engine, KvState};

/// The measured time of a verify step of `rows` rows (eval_verify + settle keeping one).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VerifyPoint {
    pub rows: usize,
    pub ms: f64,
}

/// Times verify steps of 1..=`max_rows` rows after `state`, `reps` of each, every one
/// rejecting all its drafts (`settle` keeps the first token), so each advances the state by
/// one token as a decode step would. The drafts are random tokens: what a verify costs does
/// not depend on whether they are accepted. The state needs `reps · max_rows + max_rows`
/// free positions.
pub fn measure(
    eng: &mut Engine,
    st: &mut KvState,
    mut next: u32,
    max_rows: usize,
    reps: usize,
    mut random_token: impl FnMut() -> u32,
) -> Result<Vec<VerifyPoint>> {
    if max_rows == 0 || reps == 0 {
        bail!("--verify needs at least one row and one repetition");
    }
    if !eng.can_verify() {
        bail!("this backend runs no verify steps (no decode rows)");
    }
    let mut out = Vec::with_capacity(max_rows);
    let mut logits = Vec::new();
    for rows in 1..=max_rows {
        // One untimed step first: scratch sizes and kernels of this row count.
        for timed in [false, true] {
            let n = if timed { reps } else { 1 };
            let t = Instant::now();
            for _ in 0..n {
                let mut toks = vec![next];
                toks.extend((1..rows).map(|_| random_token()));
                let v = eng.eval_verify(st, &toks, &mut logits)?;
                eng.settle(st, v, 1)?;
                let vocab = logits.len() / rows;
                next = ds4_engine::argmax(&logits[..vocab]) as u32;
            }
            if timed {
                out.push(VerifyPoint {
                    rows,
                    ms: 1e3 * t.elapsed().as_secs_f64() / reps as f64,
                });
            }
        }
    }
    Ok(out)
}

/// Expected tokens a verify of `k` drafts yields when each draft is accepted with
/// probability `a` independently of the others (until the first rejection) — the standard
/// speculative-decoding count: `1 + a + … + a^k`, the bonus or corrected token included.
pub fn expected_tokens(k: usize, a: f64) -> f64 {
    (0..=k).map(|i| a.powi(i as i32)).sum()
}

/// The predicted speed-up over plain decoding for `k` drafts at acceptance `a`: tokens per
/// verify over the verify's cost in decode steps. Drafting itself is free here (prompt
/// lookup); a drafter with a cost (MTP) adds its time per draft to `verify_ms`.
pub fn predicted_speedup(k: usize, a: f64, verify_ms: f64, decode_ms: f64) -> f64 {
    expected_tokens(k, a) * decode_ms / verify_ms
}

/// The curve and the predicted table as text (markdown tables), for the bench's stderr
/// and BENCHMARKS.md.
pub fn report(frontier: usize, decode_ms: f64, points: &[VerifyPoint]) -> String {
    let mut s = format!(
        "verify curve @{frontier} (decode step {decode_ms:.3} ms)\n\
         | rows | ms per verify | in decode steps |\n|---:|---:|---:|\n"
    );
    for p in points {
        s += &format!(
            "| {} | {:.3} | {:.2} |\n",
            p.rows,
            p.ms,
            p.ms / decode_ms.max(1e-9)
        );
    }
    s += &format!(
        "predicted speed-up @{frontier} (free drafts, acceptance independent per token; \
         PREDICTED, not measured)\n| acceptance |"
    );
    let drafts: Vec<usize> = points.iter().skip(1).map(|p| p.rows - 1).collect();
    for k in &drafts {
        s += &format!(" k={k} |");
    }
    s += " best |\n|---:|";
    s += &"---:|".repeat(drafts.len() + 1);
    s += "\n";
    for a in [0.5, 0.6, 0.7, 0.8, 0.9] {
        s += &format!("| {a:.1} |");
        let mut best = (0usize, 1.0f64);
        for p in points.iter().skip(1) {
            let k = p.rows - 1;
            let x = predicted_speedup(k, a, p.ms, decode_ms);
            if x > best.1 {
                best = (k, x);
            }
            s += &format!(" {x:.2}× |");
        }
        s += &if best.0 == 0 {
            " no drafts |\n".to_string()
        } else {
            format!(" k={} ({:.2}×) |\n", best.0, best.1)
        };
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_tokens_is_the_geometric_sum() {
        assert_eq!(expected_tokens(0, 0.7), 1.0);
        assert!((expected_tokens(3, 0.5) - 1.875).abs() < 1e-12);
        // All drafts accepted: every one counts, plus the bonus token.
        assert_eq!(expected_tokens(4, 1.0), 5.0);
        assert_eq!(expected_tokens(4, 0.0), 1.0);
    }

    #[test]
    fn a_verify_as_cheap_as_a_decode_gains_the_expected_tokens() {
        assert!((predicted_speedup(2, 0.5, 8.0, 8.0) - 1.75).abs() < 1e-12);
        // Twice the cost of a step halves it.
        assert!((predicted_speedup(2, 0.5, 16.0, 8.0) - 0.875).abs() < 1e-12);
    }

    #[test]
    fn the_report_names_the_best_depth_and_says_predicted() {
        let pts = [
            VerifyPoint { rows: 1, ms: 8.0 },
            VerifyPoint { rows: 2, ms: 9.0 },
            VerifyPoint { rows: 3, ms: 30.0 },
        ];
        let r = report(2048, 8.0, &pts);
        assert!(r.contains("PREDICTED"));
        // At 0.9: k=1 gives 1.9·8/9 = 1.69, k=2 gives 2.71·8/30 = 0.72.
        assert!(r.contains("| 0.9 | 1.69× | 0.72× | k=1 (1.69×) |"), "{r}");
        // At 0.5 k=1 gives 1.5·8/9 = 1.33.
        assert!(r.contains("| 0.5 | 1.33× |"), "{r}");
    }
}
