//! Dot-product throughput per type, reported as weight bytes per second (the number that
//! matters for a bandwidth-bound matvec). One 4096-element row, as in a hidden-size matvec.
//!
//!     cargo bench -p ds4-gguf --bench codecs

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use ds4_gguf::quant;
use ds4_gguf::GgmlType;

fn bench_dot(c: &mut Criterion) {
    const N: usize = 4096;
    let mut s = 0x1234_5678_9abc_def0u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let w: Vec<f32> = (0..N).map(|_| next()).collect();
    let x: Vec<f32> = (0..N).map(|_| next()).collect();
    let mut g = c.benchmark_group("dot_4096");
    for ty in [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Bf16,
        GgmlType::Q8_0,
        GgmlType::Q2K,
        GgmlType::Q4K,
        GgmlType::Iq2Xxs,
    ] {
        let data = quant::quantize(ty, &w, None).unwrap();
        g.throughput(Throughput::Bytes(data.len() as u64));
        g.bench_function(ty.name(), |b| {
            b.iter(|| quant::dot(ty, black_box(&data), black_box(&x)).unwrap())
        });
    }
    g.finish();
}

fn bench_dequantize(c: &mut Criterion) {
    const N: usize = 4096;
    let w: Vec<f32> = (0..N)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let mut out = vec![0f32; N];
    let mut g = c.benchmark_group("dequantize_4096");
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q2K,
        GgmlType::Q4K,
        GgmlType::Iq2Xxs,
    ] {
        let data = quant::quantize(ty, &w, None).unwrap();
        g.throughput(Throughput::Elements(N as u64));
        g.bench_function(ty.name(), |b| {
            b.iter(|| quant::dequantize(ty, black_box(&data), &mut out).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, bench_dot, bench_dequantize);
criterion_main!(benches);
