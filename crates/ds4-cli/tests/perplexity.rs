//! `ds4 perplexity` against an independent computation: the library's per-row logits of each
//! chunk (one `Engine::eval` of the whole chunk, not the command's two calls), their
//! log-softmax and the NLL statistics computed here in f64; the saved base file read back;
//! KL divergence of a base against itself (0, top-1 100 %) and of `--mode exact` against an
//! `official` base (> 0, equal to the KL computed here); and the refusals of a base that does
//! not fit the run (model, text, context, chunks, truncation, corruption, short text).

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{ds4_cmd, root, text, tiny_gguf};
use ds4_cli::perplexity::{BaseReader, ENCODING_F32};
use ds4_engine::{Engine, EngineConfig, Logits, NumericMode};
use ds4_gguf::GgufFile;

const DEMO: &str = "tests/fixtures/demo/ds4-demo.gguf";
/// Committed English prose (tests/corpus/README.md): 752 tokens with the V4 vocabulary.
const TEXT: &str = "tests/corpus/text/hand_en.txt";
/// 40 context + 39 scored tokens per chunk: both halves are longer than the engine's
/// short-prefill threshold (32), so they run the prefill path as the one-call reference does.
const CTX: usize = 80;
const CHUNKS: usize = 3;

fn demo() -> std::path::PathBuf {
    root().join(DEMO)
}

fn run(args: &[&str]) -> std::process::Output {
    let mut all = vec!["perplexity", "--backend", "cpu", "-t", "1", "-q"];
    all.extend_from_slice(args);
    ds4_cmd().args(&all).output().unwrap()
}

fn json_of(o: &std::process::Output) -> serde_json::Value {
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&o.stdout)))
}

fn f(v: &serde_json::Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

/// The text's chunks as the command forms them (plain-text tokens, whole chunks; the demo's
/// GGUF does not ask for BOS).
fn chunks(model: &Path) -> Vec<Vec<u32>> {
    let f = GgufFile::open(model).unwrap();
    let tok = ds4_chat::Tokenizer::from_gguf_header(f.header()).unwrap();
    let text = std::fs::read_to_string(root().join(TEXT)).unwrap();
    let ids = tok.encode(&text, false).unwrap();
    assert_eq!(ids.len(), 752, "the committed text changed");
    ids.chunks_exact(CTX)
        .take(CHUNKS)
        .map(<[u32]>::to_vec)
        .collect()
}

/// Row-wise log-softmax in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let m = row
        .iter()
        .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
    let lse = m + row
        .iter()
        .map(|&v| (f64::from(v) - m).exp())
        .sum::<f64>()
        .ln();
    row.iter().map(|&v| f64::from(v) - lse).collect()
}

fn argmax(row: &[f64]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// The library's log-probabilities of the scored rows of every chunk (`[chunk][row][id]`):
/// one `Logits::All` evaluation of the chunk's first `ctx - 1` tokens on a fresh state.
fn library_logprobs(model: &Path, mode: NumericMode) -> Vec<Vec<Vec<f64>>> {
    let file = Arc::new(GgufFile::open(model).unwrap());
    let mut backend = Box::new(ds4_cpu::CpuBackend::new(1).unwrap());
    ds4_engine::Backend::set_activation_q8(
        backend.as_mut(),
        ds4_cli::load::Precision::default().activation_q8(),
    )
    .unwrap();
    let cfg = EngineConfig {
        mode: Some(mode),
        ctx: CTX,
        prefill_chunk: CTX,
    };
    let mut engine = Engine::load(file, backend, cfg).unwrap();
    let v = engine.hparams().n_vocab;
    let first = CTX / 2;
    chunks(model)
        .iter()
        .map(|c| {
            let mut st = engine.new_state().unwrap();
            let logits = engine
                .eval(&mut st, &c[..CTX - 1], Logits::All, None)
                .unwrap();
            engine.free_state(st);
            (first..CTX - 1)
                .map(|p| log_softmax(&logits[p * v..(p + 1) * v]))
                .collect()
        })
        .collect()
}

/// NLL of every scored token, chunk by chunk.
fn nlls(lp: &[Vec<Vec<f64>>], chunks: &[Vec<u32>]) -> Vec<Vec<f64>> {
    let first = CTX / 2;
    lp.iter()
        .zip(chunks)
        .map(|(rows, c)| {
            rows.iter()
                .enumerate()
                .map(|(r, row)| -row[c[first + r + 1] as usize])
                .collect()
        })
        .collect()
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * b.abs().max(1e-12)
}

#[test]
fn perplexity_is_the_mean_nll_of_the_engine_rows() {
    let demo = demo();
    let o = run(&[
        "-m",
        demo.to_str().unwrap(),
        "-f",
        TEXT,
        "--ctx",
        &CTX.to_string(),
        "--chunks",
        &CHUNKS.to_string(),
        "--json",
    ]);
    let r = json_of(&o);
    assert_eq!(r["ctx"], CTX);
    assert_eq!(r["chunks"], CHUNKS);
    assert_eq!(r["text_tokens"], 752);
    assert_eq!(r["scored_per_chunk"], CTX - 1 - CTX / 2);
    assert_eq!(r["bos"], false);
    assert_eq!(r["tokens_evaluated"], CHUNKS * (CTX - 1));
    assert!(f(&r, "tokens_per_second") > 0.0);

    let nll = nlls(
        &library_logprobs(&demo, NumericMode::Official),
        &chunks(&demo),
    );
    let all: Vec<f64> = nll.iter().flatten().copied().collect();
    let n = all.len() as f64;
    let mean = all.iter().sum::<f64>() / n;
    let var = all.iter().map(|x| x * x).sum::<f64>() / n - mean * mean;
    let ppl = mean.exp();
    let err = ppl * (var / (n - 1.0)).sqrt();
    assert!(close(f(&r, "nll_mean"), mean, 1e-6), "{r}");
    assert!(close(f(&r, "ppl"), ppl, 1e-5), "{} vs {ppl}", r["ppl"]);
    assert!(
        close(f(&r, "ppl_err"), err, 1e-4),
        "{} vs {err}",
        r["ppl_err"]
    );
    let running = r["running_ppl"].as_array().unwrap();
    assert_eq!(running.len(), CHUNKS);
    for (i, v) in running.iter().enumerate() {
        let so_far: Vec<f64> = nll[..=i].iter().flatten().copied().collect();
        let want = (so_far.iter().sum::<f64>() / so_far.len() as f64).exp();
        assert!(close(v.as_f64().unwrap(), want, 1e-5), "chunk {}", i + 1);
    }

    // The text output: running values, the final estimate, the speed.
    let o = run(&[
        "-m",
        demo.to_str().unwrap(),
        "-f",
        TEXT,
        "--ctx",
        &CTX.to_string(),
        "--chunks",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert!(out.starts_with("[1]") && out.contains(",[2]"), "{out}");
    assert!(out.contains("Final estimate: PPL = "), "{out}");
    assert!(out.contains(" tokens/s ("), "{out}");
    assert!(o.stderr.is_empty(), "-q: {}", text(&o.stderr));
}

#[test]
fn kl_divergence_against_a_saved_base() {
    let demo = demo();
    let m = demo.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("official.logp");
    let b = base.to_str().unwrap();
    let ctx = CTX.to_string();
    let n = CHUNKS.to_string();
    // The base: the default (official) mode.
    let saved = json_of(&run(&[
        "-m",
        m,
        "-f",
        TEXT,
        "--ctx",
        &ctx,
        "--chunks",
        &n,
        "--save-logits",
        b,
        "--json",
    ]));
    assert!(!dir.path().join("official.logp.partial").exists());

    // The file holds the library's log-probabilities of every scored row.
    let chunks = chunks(&demo);
    let official = library_logprobs(&demo, NumericMode::Official);
    let mut rd = BaseReader::open(&base).unwrap();
    let v = rd.header.n_vocab;
    assert_eq!(
        (v, rd.header.ctx, rd.header.n_chunks),
        (129_280, CTX, CHUNKS)
    );
    assert!(!rd.header.bos);
    assert!(
        rd.header.model.contains("ds4-demo.gguf"),
        "{}",
        rd.header.model
    );
    assert_eq!(
        std::fs::metadata(&base).unwrap().len(),
        rd.header.file_len()
    );
    assert_eq!(ENCODING_F32, 0);
    let mut row = vec![0f32; v];
    let mut worst = 0f64;
    for (c, rows) in official.iter().enumerate() {
        assert_eq!(rd.begin_chunk().unwrap(), chunks[c]);
        for want in rows {
            rd.read_row(&mut row).unwrap();
            for (&g, &w) in row.iter().zip(want) {
                worst = worst.max((f64::from(g) - w).abs() / w.abs().max(1.0));
            }
        }
    }
    assert!(worst < 1e-6, "saved log-probs vs library: {worst:.3e}");

    // Against itself: KLD 0, same top 100 %, no PPL change.
    let same = json_of(&run(&["-m", m, "-f", TEXT, "--kl-base", b, "--json"]));
    assert_eq!(same["ctx"], CTX, "the base's context is the default");
    assert_eq!(same["chunks"], CHUNKS);
    let k = &same["kl"];
    assert_eq!(f(k, "kld_mean"), 0.0, "{k}");
    assert_eq!(f(k, "kld_max"), 0.0);
    assert_eq!(f(k, "kld_min"), 0.0);
    assert_eq!(f(k, "same_top"), 1.0);
    assert_eq!(f(k, "ppl_diff"), 0.0);
    assert_eq!(f(k, "ln_ppl_ratio"), 0.0);
    assert_eq!(f(k, "dp_rms"), 0.0);
    assert_eq!(f(k, "ppl"), f(&saved, "ppl"));
    assert_eq!(f(k, "ppl_base"), f(&saved, "ppl"));
    assert_eq!(k["tokens"], CHUNKS * (CTX - 1 - CTX / 2));

    // Exact mode against the official base: KL(base || exact) as computed here.
    let o = run(&[
        "-m",
        m,
        "-f",
        TEXT,
        "--kl-base",
        b,
        "--mode",
        "exact",
        "--json",
    ]);
    let r = json_of(&o);
    let k = &r["kl"];
    let exact = library_logprobs(&demo, NumericMode::Exact);
    let mut klds = Vec::new();
    let mut same_top = 0usize;
    let (mut nq, mut nb, mut nqb) = (Vec::new(), Vec::new(), 0f64);
    for ((q_rows, b_rows), c) in exact.iter().zip(&official).zip(&chunks) {
        for (i, (q, bb)) in q_rows.iter().zip(b_rows).enumerate() {
            klds.push(
                bb.iter()
                    .zip(q)
                    .map(|(&lb, &lq)| lb.exp() * (lb - lq))
                    .sum::<f64>(),
            );
            same_top += usize::from(argmax(q) == argmax(bb));
            let t = c[CTX / 2 + i + 1] as usize;
            nq.push(-q[t]);
            nb.push(-bb[t]);
            nqb += q[t] * bb[t];
        }
    }
    let cnt = klds.len() as f64;
    let mean_kld = klds.iter().sum::<f64>() / cnt;
    assert!(
        mean_kld > 1e-4,
        "exact and official should differ: {mean_kld}"
    );
    assert!(
        close(f(k, "kld_mean"), mean_kld, 1e-4),
        "KLD {} vs {mean_kld}",
        k["kld_mean"]
    );
    let max_kld = klds.iter().copied().fold(f64::MIN, f64::max);
    assert!(
        close(f(k, "kld_max"), max_kld, 1e-4),
        "{} vs {max_kld}",
        k["kld_max"]
    );
    let top = same_top as f64 / cnt;
    assert!(
        (f(k, "same_top") - top).abs() <= 1.0 / cnt + 1e-12,
        "{} vs {top}",
        k["same_top"]
    );
    // ΔPPL and its error with the correlation of the two runs' NLLs.
    let mq = nq.iter().sum::<f64>() / cnt;
    let mb = nb.iter().sum::<f64>() / cnt;
    let se = |x: &[f64], m: f64| {
        ((x.iter().map(|v| v * v).sum::<f64>() / cnt - m * m) / (cnt - 1.0)).sqrt()
    };
    let (sq, sb) = (se(&nq, mq), se(&nb, mb));
    let cov = (nqb / cnt - mq * mb) / (cnt - 1.0);
    let (pq, pb) = (mq.exp(), mb.exp());
    let diff_err = ((pq * sq).powi(2) + (pb * sb).powi(2) - 2.0 * pq * pb * cov).sqrt();
    assert!(close(f(k, "ppl_base"), pb, 1e-5));
    assert!(close(f(k, "ppl"), pq, 1e-5));
    assert!(
        close(f(k, "ppl_diff"), pq - pb, 1e-3),
        "{} vs {}",
        k["ppl_diff"],
        pq - pb
    );
    assert!(
        close(f(k, "ppl_diff_err"), diff_err, 1e-3),
        "{} vs {diff_err}",
        k["ppl_diff_err"]
    );
    assert!(close(f(k, "cor_ln_ppl"), cov / (sq * sb), 1e-4));

    // The text report names llama.cpp's statistics.
    let o = run(&[
        "-m",
        m,
        "-f",
        TEXT,
        "--kl-base",
        b,
        "--mode",
        "exact",
        "--chunks",
        "1",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    for want in [
        "KL Divergence",
        "Mean PPL(Q)-PPL(base)",
        "Mean    KLD:",
        "99.0%   KLD:",
        "Median  KLD:",
        "Maximum KLD:",
        "RMS Δp",
        "Same top p:",
    ] {
        assert!(out.contains(want), "{want} missing:\n{out}");
    }
}

#[test]
fn bases_that_do_not_fit_the_run_are_refused_with_the_reason() {
    let demo = demo();
    let m = demo.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("b.logp");
    let b = base.to_str().unwrap();
    let o = run(&[
        "-m",
        m,
        "-f",
        TEXT,
        "--ctx",
        "64",
        "--chunks",
        "2",
        "--save-logits",
        b,
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let bytes = std::fs::read(&base).unwrap();
    let truncated = dir.path().join("truncated.logp");
    std::fs::write(&truncated, &bytes[..bytes.len() - 100]).unwrap();
    let corrupt = dir.path().join("corrupt.logp");
    let mut flipped = bytes.clone();
    let at = bytes.len() - 1000;
    flipped[at] ^= 0x04;
    std::fs::write(&corrupt, &flipped).unwrap();
    let garbage = dir.path().join("garbage.logp");
    std::fs::write(&garbage, b"not a base file at all, just some text").unwrap();
    let short = dir.path().join("short.txt");
    std::fs::write(&short, "A short text.").unwrap();
    let tiny = tiny_gguf().to_str().unwrap().to_string();
    let (t, c, g, s) = (
        truncated.to_str().unwrap(),
        corrupt.to_str().unwrap(),
        garbage.to_str().unwrap(),
        short.to_str().unwrap(),
    );
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["-m", m, "-f", TEXT, "--kl-base", b, "--ctx", "128"],
            "--ctx 128 does not match the base",
        ),
        (
            vec![
                "-m",
                m,
                "-f",
                "tests/corpus/text/hand_it.txt",
                "--kl-base",
                b,
            ],
            "was computed on another text",
        ),
        (
            vec!["-m", &tiny, "-f", TEXT, "--kl-base", b],
            "another model vocabulary",
        ),
        (
            vec!["-m", m, "-f", TEXT, "--kl-base", b, "--chunks", "3"],
            "--chunks 3: the base",
        ),
        (vec!["-m", m, "-f", TEXT, "--kl-base", t], "truncated"),
        (
            vec!["-m", m, "-f", TEXT, "--kl-base", c],
            "checksum of chunk 2",
        ),
        (
            vec!["-m", m, "-f", TEXT, "--kl-base", g],
            "not a usable base file",
        ),
        (
            vec!["-m", m, "-f", s, "--ctx", "64"],
            "one chunk of --ctx 64 needs 64",
        ),
        (
            vec!["-m", m, "-f", TEXT, "--ctx", "2"],
            "--ctx 2 is too small",
        ),
        (vec!["-m", m, "-f", TEXT, "--chunks", "0"], "--chunks 0"),
    ];
    for (args, want) in cases {
        let o = run(&args);
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: wanted {want:?} in {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    // A failed --save-logits run leaves no file behind.
    let none = dir.path().join("none.logp");
    let o = run(&["-m", m, "-f", s, "--save-logits", none.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(!none.exists());
    assert!(!dir.path().join("none.logp.partial").exists());
}
