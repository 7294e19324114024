//! Encode throughput on 1 MB of mixed corpus text (issue 5: must be under 0.5 s on 2 cores).
//! Run: `cargo bench -p ds4-chat --bench encode`; criterion prints time and MB/s.

use std::io::Read;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ds4_chat::{SpecialTokens, Tokenizer};

fn corpus() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/corpus")
}

fn tokenizer() -> Tokenizer {
    #[derive(serde::Deserialize)]
    struct V {
        tokens: Vec<String>,
        merges: Vec<String>,
        token_type: Vec<i32>,
    }
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(corpus().join("v4-vocab.json.gz")).unwrap())
        .read_to_end(&mut raw)
        .unwrap();
    let v: V = serde_json::from_slice(&raw).unwrap();
    Tokenizer::from_vocab(&v.tokens, &v.merges, &v.token_type).unwrap()
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
    let tok = tokenizer();
    let text = mixed_mb();
    let mut g = c.benchmark_group("encode_1mb_mixed");
    g.throughput(Throughput::Bytes(text.len() as u64));
    g.sample_size(10);
    for (name, mode) in [("plain", SpecialTokens::None), ("all_specials", SpecialTokens::All), ("chat_markers", SpecialTokens::ChatMarkers)] {
        g.bench_function(name, |b| b.iter(|| tok.encode_with(std::hint::black_box(&text), mode).unwrap()));
    }
    // HF's complete pipeline (regex pre-tokenizer), for comparison: same ids, much slower.
    g.bench_function("hf_reference_plain", |b| b.iter(|| tok.encode_plain_hf_reference(std::hint::black_box(&text)).unwrap()));
    g.finish();
    let ids = tok.encode(&text, true).unwrap();
    c.bench_function("decode_1mb_mixed", |b| b.iter(|| tok.decode(std::hint::black_box(&ids)).unwrap()));
}

criterion_group!(benches, bench);
criterion_main!(benches);
