//! `ds4 logits` against the library path: the `.npy` rows must be the logits the engine gives
//! through `Session::prefill_all` / `Session::decode` on the same backend, and `--top K` must
//! be those rows' top-K with their log-softmax.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{ds4_cmd, root, text, tiny_gguf};
use ds4_engine::{Engine, EngineConfig, Session};
use ds4_gguf::GgufFile;

const DEMO: &str = "tests/fixtures/demo/ds4-demo.gguf";

/// Reads a float32 C-order 2-D `.npy` file: (rows, cols, values).
fn read_npy(path: &Path) -> (usize, usize, Vec<f32>) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..8], b"\x93NUMPY\x01\x00", "not an npy v1.0 file");
    let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
    assert_eq!((10 + hl) % 64, 0, "data not 64-byte aligned");
    let h = std::str::from_utf8(&b[10..10 + hl]).unwrap();
    assert!(h.contains("'descr': '<f4'"), "{h}");
    assert!(h.contains("'fortran_order': False"), "{h}");
    let shape = h.split("'shape': (").nth(1).unwrap();
    let shape = shape.split(')').next().unwrap();
    let dims: Vec<usize> = shape
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    assert_eq!(dims.len(), 2, "{h}");
    let data: Vec<f32> = b[10 + hl..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(data.len(), dims[0] * dims[1]);
    (dims[0], dims[1], data)
}

/// The library's logits: prefill `tokens[..from]` (all rows), then decode the rest.
fn library(model: &Path, tokens: &[u32], from: usize, chunk: usize) -> Vec<f32> {
    let file = Arc::new(GgufFile::open(model).unwrap());
    let mut backend = Box::new(ds4_cpu::CpuBackend::new(1).unwrap());
    // `ds4 logits` without --quality: the default (int8 activations in one-token matmuls).
    ds4_engine::Backend::set_activation_q8(
        backend.as_mut(),
        ds4_cli::load::Precision::default().activation_q8(),
    )
    .unwrap();
    let cfg = EngineConfig {
        mode: None,
        ctx: tokens.len(),
        prefill_chunk: chunk,
    };
    let mut s = Session::new(Engine::load(file, backend, cfg).unwrap()).unwrap();
    let mut out = if from > 0 {
        s.prefill_all(&tokens[..from]).unwrap()
    } else {
        Vec::new()
    };
    for &t in &tokens[from..] {
        out.extend(s.decode(t).unwrap());
    }
    out
}

fn run_logits(model: &Path, extra: &[&str], out: &Path) -> std::process::Output {
    let m = model.to_str().unwrap();
    let o = out.to_str().unwrap();
    let mut args = vec!["logits", "-m", m, "--backend", "cpu", "-t", "1", "--out", o];
    args.extend_from_slice(extra);
    ds4_cmd().args(&args).output().unwrap()
}

fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    let scale = b
        .iter()
        .fold(0f64, |m, &v| m.max(f64::from(v).abs()))
        .max(1e-30);
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).abs() / scale)
        .fold(0f64, f64::max)
}

#[test]
fn npy_rows_are_the_library_logits_for_prefill_and_decode() {
    let model = tiny_gguf();
    let spec = {
        let f = GgufFile::open(model).unwrap();
        ds4_model::ModelSpec::from_header(f.header(), ds4_model::Strictness::Auto).unwrap()
    };
    let v = spec.hparams.n_vocab;
    let tokens: Vec<u32> = (0..12u32).map(|i| (i * 37 + 5) % v as u32).collect();
    let ids = tokens
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let dir = tempfile::tempdir().unwrap();
    for (from, chunk) in [(12usize, 2048usize), (5, 2048), (0, 2048), (12, 5)] {
        let out = dir.path().join(format!("l-{from}-{chunk}.npy"));
        let o = run_logits(
            model,
            &[
                "--tokens",
                &ids,
                "--decode-from",
                &from.to_string(),
                "--chunk",
                &chunk.to_string(),
            ],
            &out,
        );
        assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
        let (rows, cols, got) = read_npy(&out);
        assert_eq!((rows, cols), (tokens.len(), v));
        let want = library(model, &tokens, from, chunk);
        assert!(
            got == want,
            "decode-from {from}, chunk {chunk}: CLI and library logits differ (max rel {:.3e})",
            max_rel(&got, &want)
        );
        assert!(got.iter().all(|x| x.is_finite()));
    }
    // The two paths agree with each other (engine consistency, not bit equality).
    let all_prefill = library(model, &tokens, 12, 2048);
    let all_decode = library(model, &tokens, 0, 2048);
    let r = max_rel(&all_decode, &all_prefill);
    assert!(r < 1e-4, "prefill vs decode max rel {r:.3e}");
}

#[test]
fn top_k_json_is_the_top_of_each_row() {
    let demo = root().join(DEMO);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("demo.npy");
    let prompt = "<｜begin▁of▁sentence｜><｜User｜>Hello, world<｜Assistant｜></think>";
    let o = run_logits(
        &demo,
        &["--prompt", prompt, "--decode-from", "3", "--top", "5"],
        &out,
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    // --prompt is tokenized with the chat markers as single ids.
    let f = GgufFile::open(&demo).unwrap();
    let tok = ds4_chat::Tokenizer::from_gguf_header(f.header()).unwrap();
    let tokens = tok.encode_chat(prompt).unwrap();
    assert_eq!(tokens[0], tok.markers().bos);
    let (rows, cols, got) = read_npy(&out);
    assert_eq!((rows, cols), (tokens.len(), 129_280));
    assert!(got == library(&demo, &tokens, 3, 2048));

    let rows: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), tokens.len());
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r["pos"], i);
        assert_eq!(r["token"], tokens[i]);
        assert_eq!(r["path"], if i < 3 { "prefill" } else { "decode" });
        let row = &got[i * cols..(i + 1) * cols];
        let max = row
            .iter()
            .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
        let lse = max
            + row
                .iter()
                .map(|&x| (f64::from(x) - max).exp())
                .sum::<f64>()
                .ln();
        let mut order: Vec<usize> = (0..cols).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let top = r["top"].as_array().unwrap();
        assert_eq!(top.len(), 5);
        for (j, e) in top.iter().enumerate() {
            assert_eq!(e["id"], order[j], "pos {i} rank {j}");
            let lp = e["logprob"].as_f64().unwrap();
            let want = f64::from(row[order[j]]) - lse;
            assert!((lp - want).abs() < 1e-9, "pos {i} rank {j}: {lp} vs {want}");
        }
    }
}

#[test]
fn bad_requests_are_refused_with_the_reason() {
    let m = tiny_gguf().to_str().unwrap().to_string();
    let cases: [(&[&str], &str); 5] = [
        (
            &["--tokens", "1,2,999999", "--top", "1"],
            "token 999999 (entry 3) is outside",
        ),
        (
            &["--tokens", "1,2", "--decode-from", "3", "--top", "1"],
            "--decode-from 3 is past the end of the 2 tokens",
        ),
        (
            &["--tokens", "", "--top", "1"],
            "the token sequence is empty",
        ),
        (&["--tokens", "1,x", "--top", "1"], "not a token id"),
        // Neither --out nor --top: nothing would come out.
        (&["--tokens", "1"], "--out <OUT>"),
    ];
    for (extra, want) in cases {
        let mut args = vec!["logits", "-m", &m];
        args.extend_from_slice(extra);
        let o = ds4_cmd().args(&args).output().unwrap();
        assert_ne!(o.status.code(), Some(0), "{extra:?}");
        let err = text(&o.stderr);
        assert!(err.contains(want), "{extra:?}: {err}");
    }
}
