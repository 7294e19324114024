//! `ds4 vectors` end to end: the tiny oracle fixture against vectors computed by HF
//! transformers (tests/fixtures/vectors-tiny, made by its make_vectors.py), the official
//! DeepSeek vectors' prompt counts with the vocabulary-only GGUF, and bad inputs.

mod common;

use std::path::{Path, PathBuf};

use common::{ds4, root, text, tiny_gguf};
use serde_json::Value;

const TINY_VECTORS: &str = "tests/fixtures/vectors-tiny";
const VOCAB: &str = "tests/fixtures/vocab/deepseek-v4-vocab.gguf";

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

fn json(o: &std::process::Output) -> Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{e}: stdout {} stderr {}", text(&o.stdout), text(&o.stderr)))
}

#[test]
fn tiny_vectors_from_the_hf_oracle_pass_in_exact_mode() {
    let m = tiny_gguf().to_str().unwrap();
    let o = ds4(&[
        "vectors",
        "-m",
        m,
        "--dir",
        TINY_VECTORS,
        "--mode",
        "exact",
        "--backend",
        "cpu",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let v = json(&o);
    assert_eq!(v["pass"], true);
    assert_eq!(v["mode"], "exact");
    assert!(v["backend"].as_str().unwrap().starts_with("cpu"), "{v}");
    let cases = v["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    let mut steps = 0;
    for c in cases {
        assert_eq!(c["count_match"], true, "{c}");
        for s in c["steps"].as_array().unwrap() {
            steps += 1;
            assert_eq!(s["chosen_match"], true, "{s}");
            assert_eq!(s["degenerate"], false, "{s}");
            assert_eq!(s["overlap_informative"], 20, "{s}");
            // f32 engine vs f32 HF: agreement far inside the 0.5 nat threshold.
            assert!(s["max_delta_all"].as_f64().unwrap() < 1e-3, "{s}");
        }
    }
    assert_eq!(steps, 20);
}

#[test]
fn tampered_tiny_vectors_fail_with_reasons() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("v");
    copy_dir(&root().join(TINY_VECTORS), &d);
    // Case 1: another chosen token at step 1 (bytes "zz"). Case 2: the official top-5 shifted
    // by 1 nat at step 0. Case 3: a wrong prompt token count.
    let edit = |id: &str, f: &dyn Fn(&mut Value)| {
        let p = d.join(format!("official/{id}.official.json"));
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        f(&mut v);
        std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
    };
    edit("tiny_greeting", &|v| {
        v["steps"][1]["token"]["bytes"] = serde_json::json!([122, 122])
    });
    edit("tiny_code", &|v| {
        for e in v["steps"][0]["top_logprobs"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .take(5)
        {
            let lp = e["logprob"].as_f64().unwrap();
            e["logprob"] = (lp - 1.0).into();
        }
    });
    edit("tiny_numbers", &|v| v["usage"]["prompt_tokens"] = 46.into());
    let m = tiny_gguf().to_str().unwrap();
    let only = [
        "--only",
        "tiny_greeting",
        "--only",
        "tiny_code",
        "--only",
        "tiny_numbers",
        "--only",
        "tiny_accents",
    ];
    let dpath = d.to_str().unwrap();
    let mut args = vec![
        "vectors", "-m", m, "--dir", dpath, "--mode", "exact", "--json",
    ];
    args.extend(only);
    let o = ds4(&args);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let v = json(&o);
    assert_eq!(v["pass"], false);
    let case = |id: &str| {
        v["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == id)
            .unwrap()
            .clone()
    };
    let g = case("tiny_greeting");
    assert_eq!(g["steps"][1]["chosen_match"], false);
    assert_eq!(g["steps"][0]["pass"], true);
    let c = case("tiny_code");
    assert_eq!(c["steps"][0]["chosen_match"], true);
    assert!(
        (c["steps"][0]["max_delta_top5"].as_f64().unwrap() - 1.0).abs() < 1e-3,
        "{c}"
    );
    assert_eq!(c["steps"][0]["pass"], false);
    let n = case("tiny_numbers");
    assert_eq!(
        (n["count_match"].clone(), n["prompt_tokens"].clone()),
        (Value::Bool(false), Value::from(45))
    );
    assert_eq!(case("tiny_accents")["pass"], true);
    // The text report names the problems and the verdict.
    args.retain(|a| *a != "--json");
    let o = ds4(&args);
    let s = text(&o.stdout);
    assert!(
        s.contains("verdict: FAIL — 1 of 4 cases agree (mode exact"),
        "{s}"
    );
    assert!(
        s.contains("chose \"ek\"") || s.contains("where the official answer is \"zz\""),
        "{s}"
    );
    assert!(s.contains("on the official top-5 exceeds 0.5"), "{s}");
    assert!(
        s.contains("the rendered prompt has 45 tokens, the API counted 46"),
        "{s}"
    );
}

/// The committed `<repo>/tests/fixtures/official-vectors`, or `DS4_TEST_VECTORS`. Missing data is a failure, not a
/// skip: the official counts are part of the check.
fn official_vectors() -> PathBuf {
    let dir = std::env::var_os("DS4_TEST_VECTORS")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("tests/fixtures/official-vectors"));
    assert!(
        dir.join("manifest.json").is_file(),
        "official test vectors not found at {} (expected <repo>/tests/fixtures/official-vectors, or set DS4_TEST_VECTORS)",
        dir.display()
    );
    dir
}

#[test]
fn official_vectors_prompt_counts_match_with_the_vocabulary_gguf() {
    let dir = official_vectors();
    let d = dir.to_str().unwrap();
    let o = ds4(&[
        "vectors",
        "-m",
        VOCAB,
        "--dir",
        d,
        "--counts-only",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let v = json(&o);
    assert_eq!(v["pass"], true);
    assert_eq!(v["counts_only"], true);
    assert_eq!(v["mode"], Value::Null);
    let want = [
        ("short_italian_fact", 21),
        ("short_code_completion", 27),
        ("short_reasoning_plain", 18),
        ("long_memory_archive", 3353),
        ("long_code_audit", 3844),
    ];
    let cases = v["cases"].as_array().unwrap();
    assert_eq!(cases.len(), want.len());
    for (id, n) in want {
        let c = cases
            .iter()
            .find(|c| c["id"] == id)
            .unwrap_or_else(|| panic!("{id} missing"));
        assert_eq!(c["prompt_tokens"], n, "{id}");
        assert_eq!(c["official_prompt_tokens"], n, "{id}");
    }
    let o = ds4(&["vectors", "-m", VOCAB, "--dir", d, "--counts-only"]);
    let s = text(&o.stdout);
    assert!(
        s.contains("verdict: PASS — 5 of 5 prompt token counts match"),
        "{s}"
    );
    // The full check needs weights; the vocabulary file is refused with a hint.
    let o = ds4(&["vectors", "-m", VOCAB, "--dir", d]);
    assert_eq!(o.status.code(), Some(2));
    let e = text(&o.stderr);
    assert!(
        e.contains("no model weights") && e.contains("--counts-only"),
        "{e}"
    );
}

#[test]
fn missing_and_malformed_vector_files_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |dir: &Path| {
        let o = ds4(&[
            "vectors",
            "-m",
            VOCAB,
            "--counts-only",
            "--dir",
            dir.to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o.stdout));
        text(&o.stderr)
    };
    let e = run(&tmp.path().join("absent"));
    assert!(
        e.contains("vectors directory") && e.contains("not found"),
        "{e}"
    );
    let e = run(tmp.path());
    assert!(e.contains("manifest.json not found"), "{e}");
    let d = tmp.path().join("v");
    copy_dir(&root().join(TINY_VECTORS), &d);
    std::fs::remove_file(d.join("official/tiny_code.official.json")).unwrap();
    let e = run(&d);
    assert!(
        e.contains("official file")
            && e.contains("tiny_code.official.json")
            && e.contains("not found"),
        "{e}"
    );
    std::fs::write(d.join("official/tiny_code.official.json"), "{\"usage\": ").unwrap();
    let e = run(&d);
    assert!(
        e.contains("tiny_code.official.json is not valid JSON"),
        "{e}"
    );
    std::fs::write(
        d.join("official/tiny_code.official.json"),
        r#"{"usage":{"prompt_tokens":3},"steps":[{"token":{"bytes":[1]}}]}"#,
    )
    .unwrap();
    let e = run(&d);
    assert!(e.contains("steps[0]: missing \"top_logprobs\""), "{e}");
    std::fs::write(d.join("manifest.json"), "[]").unwrap();
    let e = run(&d);
    assert!(e.contains("missing \"prompts\""), "{e}");
    // A model path that does not exist.
    let o = ds4(&[
        "vectors",
        "-m",
        "/nonexistent/m.gguf",
        "--dir",
        TINY_VECTORS,
        "--counts-only",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("model file /nonexistent/m.gguf not found"));
}

#[test]
fn unavailable_gpu_backends_are_refused_with_the_reason() {
    let m = tiny_gguf().to_str().unwrap();
    let no_cuda = ds4_gpu::cuda::CudaDevice::count().map_or(true, |n| n == 0);
    for b in ["cuda", "rocm"] {
        if (b == "cuda" && !no_cuda) || (b == "rocm" && std::path::Path::new("/dev/kfd").exists()) {
            continue;
        }
        let o = ds4(&[
            "vectors",
            "-m",
            m,
            "--dir",
            TINY_VECTORS,
            "--backend",
            b,
            "--only",
            "tiny_numbers",
        ]);
        assert_eq!(o.status.code(), Some(2));
        let e = text(&o.stderr);
        // No GPU here: "CUDA is not available" / "no ROCm device" (HIP runtime installed,
        // as CI does for the hipcc check) / "ROCm is not available" (no runtime).
        let ok = if b == "cuda" {
            e.contains("CUDA")
        } else {
            e.contains("no ROCm device") || e.contains("ROCm is not available")
        };
        assert!(ok, "{e}");
        assert!(!e.contains("panicked"), "{e}");
    }
}
