//! Encode throughput on 1 MB of mixed corpus text (issue 5: must be under 0.5 s on 2 cores).
//! Run: `cargo bench -p ds4-chat --bench encode`; criterion prints time and MB/s.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ds4_chat::SpecialTokens;

#[path = "../tests/common/mod.rs"]
mod common;

fn corpus() -> std::path::PathBuf {
    common::corpus_dir()
}

/// About 1 MB: round-robin 8 KB slices of every corpus file (all scripts, code, emoji,
/// whitespace, digits, special strings), cut at char boundaries.
fn mixed_mb() -> String {
    let mut files: Vec<String> = std::fs::read_dir(corpus().join("text"))
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
        .collect();
    files.sort();
    let mut out = String::new();
    let mut offs = vec![0usize; files.len()];
    while out.len() < 1 << 20 {
        for (f, off) in files.iter().zip(offs.iter_mut()) {
            let mut end = (*off + 8192).min(f.len());
            while !f.is_char_boundary(end) {
                end -= 1;
            }
            out.push_str(&f[*off..end]);
            *off = if end >= f.len() { 0 } else { end };
        }
    }
    out
}

fn bench(c: &mut Criterion) {
    let tok = common::tokenizer();
    let text = mixed_mb();
    let mut g = c.benchmark_group("encode_1mb_mixed");
    g.throughput(Throughput::Bytes(text.len() as u64));
    g.sample_size(10);
    for (name, mode) in [
        ("plain", SpecialTokens::None),
        ("all_specials", SpecialTokens::All),
        ("chat_markers", SpecialTokens::ChatMarkers),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| tok.encode_with(std::hint::black_box(&text), mode).unwrap())
        });
    }
    // Cold word cache: the first MB a fresh process tokenizes.
    g.bench_function("plain_cold_cache", |b| {
        b.iter(|| {
            tok.clear_cache();
            tok.encode_with(std::hint::black_box(&text), SpecialTokens::None)
                .unwrap()
        })
    });
    // HF's complete pipeline (regex pre-tokenizer), for comparison: same ids, much slower.
    common::hf_reference();
    g.bench_function("hf_reference_plain", |b| {
        b.iter(|| common::hf_plain_ids(std::hint::black_box(&text)))
    });
    g.finish();
    let ids = tok.encode(&text, true).unwrap();
    c.bench_function("decode_1mb_mixed", |b| {
        b.iter(|| tok.decode(std::hint::black_box(&ids)).unwrap())
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
