//! Sampler cost per token over a full DeepSeek V4 vocabulary (129,280 logits): the CLI's
//! default settings and the usual top-k / top-p / min-p combinations. The target is
//! ≤ 0.3 ms per token on a 2-core machine (issue 16), small next to a decode step.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use ds4_engine::{Rng, Sampler, SamplerConfig};

const VOCAB: usize = 129_280;

/// `peaked`: shaped like a language model's logits: a bulk roughly normal around 0
/// (σ ≈ 2) and a few strong candidates 14 to 20 above it, so the filters keep a handful.
/// Otherwise `broad`: the bulk only (σ ≈ 3.5), where the bulk holds most of the mass and
/// top-p / plain temperature sampling must walk deep into the sorted order (worst case).
fn logits(seed: u64, peaked: bool) -> Vec<f32> {
    let mut r = Rng::new(seed);
    let sigma = if peaked { 2.0 } else { 3.5 };
    let mut l: Vec<f32> = (0..VOCAB)
        .map(|_| {
            // Irwin–Hall(4): variance 1/3.
            let s: f64 = (0..4).map(|_| r.next_f64()).sum::<f64>() - 2.0;
            (s * sigma * 3f64.sqrt()) as f32
        })
        .collect();
    if peaked {
        for k in 0..12 {
            l[(r.next_u64() % VOCAB as u64) as usize] = 20.0 - 0.5 * k as f32;
        }
    }
    l
}

fn bench(c: &mut Criterion) {
    let base = SamplerConfig {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.05,
        seed: 1,
        ..SamplerConfig::default()
    };
    let cases: Vec<(&str, SamplerConfig)> = vec![
        ("cli_default_t1_minp0.05", base.clone()),
        (
            "greedy",
            SamplerConfig {
                temperature: 0.0,
                ..base.clone()
            },
        ),
        (
            "top_k40",
            SamplerConfig {
                top_k: 40,
                min_p: 0.0,
                ..base.clone()
            },
        ),
        (
            "top_k40_top_p0.95_min_p0.05",
            SamplerConfig {
                top_k: 40,
                top_p: 0.95,
                ..base.clone()
            },
        ),
        (
            "top_p0.9",
            SamplerConfig {
                top_p: 0.9,
                min_p: 0.0,
                ..base.clone()
            },
        ),
        (
            "top_p0.9_min_p0.05",
            SamplerConfig {
                top_p: 0.9,
                ..base.clone()
            },
        ),
        (
            "temperature_only",
            SamplerConfig {
                min_p: 0.0,
                ..base.clone()
            },
        ),
        (
            "cli_default_repeat_penalty1.1",
            SamplerConfig {
                repeat_penalty: 1.1,
                ..base.clone()
            },
        ),
    ];
    let history: Vec<u32> = (0..64).map(|i| i * 997 % VOCAB as u32).collect();
    for peaked in [true, false] {
        let l = logits(7, peaked);
        let group = if peaked { "peaked" } else { "broad" };
        let mut g = c.benchmark_group(format!("sample_129280_{group}"));
        for (name, cfg) in &cases {
            let mut s = Sampler::new(cfg.clone()).expect("valid config");
            g.bench_function(*name, |b| {
                b.iter(|| s.sample(black_box(&l), &history).expect("sampled"))
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
