//! The quality yardstick on a GPU (`ds4-engine-check quality`, issue 52): what each fast path
//! of a backend costs in KL divergence and perplexity on the trained demo model
//! (`tests/fixtures/kjv`), against the CPU engine on the same file, with a bound per path.
//!
//! The runs are `ds4 perplexity` processes (the command users run, not a copy of its loop):
//! for each file (f32, q4, q2) the CPU engine in exact mode and `--quality` writes the base
//! (`--save-logits`); then the backend under test runs the same file and text in exact mode
//! once per path ([`PATHS`]) with `--kl-base`. Exact mode keeps the official mode's FP8/FP4
//! simulation out of the comparison, so each row's KLD is the path's own cost: the backend's
//! summation order alone (`--quality`), TF32 prefill matmuls with or without the quantized
//! tensor-core tiles, the int8 activations of decode steps.
//!
//! The bounds are set per path at about ten times the largest mean KLD measured over the three
//! files on an H100 (BENCHMARKS.md, "Quality on the GPU"): room for another card and driver,
//! not for a kernel that loses quality. The f32 paths' bound sits below what TF32 costs, so a
//! `--quality` kernel that fell back to reduced precision fails too.

use serde_json::Value;

/// One way of running the backend under test.
#[derive(Debug, Clone, Copy)]
pub struct Path {
    /// Its name in the report.
    pub name: &'static str,
    /// `ds4 perplexity` arguments beyond model, text and base.
    pub args: &'static [&'static str],
    /// Environment for the run (the prefill-tiles setting has no flag in `ds4`).
    pub env: &'static [(&'static str, &'static str)],
    /// What the path changes against the CPU's f32 arithmetic.
    pub what: &'static str,
    /// Largest mean KLD (nats per token) accepted against the CPU base of the same file.
    pub max_kld: f64,
    /// Smallest top-1 agreement accepted.
    pub min_same_top: f64,
}

/// The paths checked, each against the CPU engine's exact-mode `--quality` run of the same
/// file. Prefill paths score the second half of each chunk in one evaluation; decode paths
/// (`--decode`) one token per step.
pub const PATHS: &[Path] = &[
    Path {
        name: "quality",
        args: &["--quality"],
        env: &[],
        what: "f32 everywhere: the backend's own summation order",
        max_kld: 1e-7,
        min_same_top: 0.999,
    },
    Path {
        name: "quality decode",
        args: &["--quality", "--decode"],
        env: &[],
        what: "f32 decode steps",
        max_kld: 1e-7,
        min_same_top: 0.999,
    },
    Path {
        name: "default",
        args: &[],
        env: &[],
        what: "what `ds4` runs: TF32 prefill, routed experts on quantized tiles",
        max_kld: 5e-5,
        min_same_top: 0.995,
    },
    Path {
        name: "tiles off",
        args: &[],
        env: &[("DS4_PREFILL_TILES", "off")],
        what: "TF32 prefill matmuls alone",
        max_kld: 5e-5,
        min_same_top: 0.995,
    },
    Path {
        name: "tiles all",
        args: &[],
        env: &[("DS4_PREFILL_TILES", "all")],
        what: "every prefill matmul on quantized half tiles",
        max_kld: 5e-5,
        min_same_top: 0.995,
    },
    Path {
        name: "decode",
        args: &["--decode"],
        env: &[],
        what: "decode steps with int8 activations (generation's path)",
        max_kld: 5e-4,
        min_same_top: 0.985,
    },
];

/// The demo model's files checked, by file name in the demo directory.
pub const FILES: &[&str] = &["ds4-kjv.gguf", "ds4-kjv-q4.gguf", "ds4-kjv-q2.gguf"];

/// The statistics of one run against its base, read from `ds4 perplexity --json`.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured {
    pub ppl: f64,
    pub ppl_diff: f64,
    pub ppl_diff_err: f64,
    pub kld_mean: f64,
    pub kld_p99: f64,
    pub kld_max: f64,
    pub same_top: f64,
    pub tokens_per_second: f64,
}

impl Measured {
    /// Reads the report `ds4 perplexity --json --kl-base` printed; a field missing or not a
    /// finite number is an error naming it.
    pub fn from_report(report: &Value) -> Result<Self, String> {
        let num = |v: &Value, k: &str| -> Result<f64, String> {
            match v.get(k).and_then(Value::as_f64) {
                Some(x) if x.is_finite() => Ok(x),
                Some(x) => Err(format!("`{k}` is {x}")),
                None => Err(format!("no number `{k}` in the report")),
            }
        };
        let kl = report
            .get("kl")
            .filter(|k| !k.is_null())
            .ok_or("the report has no `kl` section (was --kl-base given?)")?;
        Ok(Self {
            ppl: num(report, "ppl")?,
            ppl_diff: num(kl, "ppl_diff")?,
            ppl_diff_err: num(kl, "ppl_diff_err")?,
            kld_mean: num(kl, "kld_mean")?,
            kld_p99: num(kl, "kld_p99")?,
            kld_max: num(kl, "kld_max")?,
            same_top: num(kl, "same_top")?,
            tokens_per_second: num(report, "tokens_per_second")?,
        })
    }

    /// `Ok` within the path's bounds, else what exceeded them.
    pub fn judge(&self, path: &Path) -> Result<(), String> {
        let mut bad = Vec::new();
        if self.kld_mean > path.max_kld {
            bad.push(format!(
                "mean KLD {:.3e} > {:.1e}",
                self.kld_mean, path.max_kld
            ));
        }
        if self.same_top < path.min_same_top {
            bad.push(format!(
                "same top {:.2} % < {:.1} %",
                100.0 * self.same_top,
                100.0 * path.min_same_top
            ));
        }
        if bad.is_empty() {
            Ok(())
        } else {
            Err(bad.join(", "))
        }
    }

    /// One row of the report table (markdown, as BENCHMARKS.md keeps it).
    pub fn row(&self, file: &str, path: &Path, verdict: &str) -> String {
        format!(
            "| {file} | {} | {:.4} | {:+.4} ± {:.4} | {:.2e} | {:.2e} | {:.2e} | {:.2} % | {:.0} | {verdict} |",
            path.name,
            self.ppl,
            self.ppl_diff,
            self.ppl_diff_err,
            self.kld_mean,
            self.kld_p99,
            self.kld_max,
            100.0 * self.same_top,
            self.tokens_per_second
        )
    }
}

/// The table's header, matching [`Measured::row`].
pub const TABLE_HEADER: &str = "| file | path | PPL | ΔPPL | mean KLD | 99 % KLD | max KLD | same top | tok/s | verdict |\n|---|---|---|---|---|---|---|---|---|---|";

#[cfg(test)]
mod tests {
    use super::*;

    fn report(kld: f64, top: f64) -> Value {
        serde_json::json!({
            "ppl": 36.2, "tokens_per_second": 5000.0,
            "kl": {"ppl_diff": 0.01, "ppl_diff_err": 0.005, "kld_mean": kld,
                   "kld_p99": 10.0 * kld, "kld_max": 100.0 * kld, "same_top": top}
        })
    }

    #[test]
    fn a_path_within_its_bounds_passes_and_one_outside_fails_with_the_reason() {
        let p = &PATHS[2];
        let good_top = (1.0 + p.min_same_top) / 2.0;
        let ok = Measured::from_report(&report(p.max_kld / 2.0, good_top)).unwrap();
        assert!(ok.judge(p).is_ok());
        let kld = Measured::from_report(&report(p.max_kld * 2.0, good_top)).unwrap();
        assert!(kld.judge(p).unwrap_err().contains("mean KLD"));
        let top = Measured::from_report(&report(0.0, p.min_same_top - 0.01)).unwrap();
        assert!(top.judge(p).unwrap_err().contains("same top"));
    }

    #[test]
    fn reports_without_statistics_are_refused_with_the_field() {
        let mut r = report(1e-4, 0.99);
        r["kl"]["kld_mean"] = Value::Null;
        assert!(Measured::from_report(&r).unwrap_err().contains("kld_mean"));
        assert!(Measured::from_report(&serde_json::json!({"ppl": 1.0}))
            .unwrap_err()
            .contains("kl"));
    }

    #[test]
    fn paths_are_named_once_and_bounded() {
        let mut names: Vec<_> = PATHS.iter().map(|p| p.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), PATHS.len());
        for p in PATHS {
            assert!(p.max_kld > 0.0 && p.max_kld < 0.01, "{}", p.name);
            assert!(p.min_same_top > 0.9 && p.min_same_top <= 1.0, "{}", p.name);
        }
    }
}
