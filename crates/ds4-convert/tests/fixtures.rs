//! Committed fixtures: the vocabulary-only GGUF, and the transformers-made tiny models under
//! `tests/fixtures/tiny-*` (config.json + model.safetensors from `save_pretrained`).

mod common;

use std::path::{Path, PathBuf};
use std::time::Instant;

use ds4_convert::{convert_hf, HfOptions, NoProgress};
use ds4_gguf::{GgmlType, GgufFile, Value};
use ds4_model::{ModelSpec, Strictness};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn vocab_fixture_matches_the_independent_python_dump() {
    let path = repo().join("tests/fixtures/vocab/deepseek-v4-vocab.gguf");
    let f = GgufFile::open(&path).unwrap();
    let h = f.header();
    assert!(h.tensors.is_empty());
    assert!(std::fs::metadata(&path).unwrap().len() < 6_000_000);
    let strings = |k: &str| -> Vec<String> {
        h.get(k)
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect()
    };
    let tokens = strings("tokenizer.ggml.tokens");
    let merges = strings("tokenizer.ggml.merges");
    assert_eq!(tokens.len(), 129_280);
    assert_eq!(merges.len(), 127_741);
    let types: Vec<i64> = h
        .get("tokenizer.ggml.token_type")
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_int().unwrap() as i64)
        .collect();
    assert_eq!(
        h.get("tokenizer.ggml.model"),
        Some(&Value::String("gpt2".into()))
    );
    assert_eq!(tokens[0], "<｜begin▁of▁sentence｜>");
    assert_eq!(tokens[128_803], "<｜User｜>");
    assert_eq!(tokens[128_821], "<think>");

    // tools/tokenizer/dump_vocab.py wrote the same tables from the same tokenizer.json with
    // Python; they must agree entry for entry.
    let gz = std::fs::File::open(repo().join("tests/corpus/v4-vocab.json.gz")).unwrap();
    let doc: serde_json::Value = serde_json::from_reader(flate2::read::GzDecoder::new(gz)).unwrap();
    let py = |k: &str| doc[k].as_array().unwrap().clone();
    let py_tokens: Vec<String> = py("tokens")
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    let py_merges: Vec<String> = py("merges")
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    let py_types: Vec<i64> = py("token_type")
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect();
    assert!(tokens == py_tokens, "tokens differ");
    assert!(merges == py_merges, "merges differ");
    assert!(types == py_types, "token types differ");
}

fn fixture_dirs() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(repo().join("tests/fixtures"))
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("tiny-"))
                && p.join("config.json").is_file()
                && p.join("model.safetensors").is_file()
        })
        .collect();
    v.sort();
    v
}

/// Spec-derived expectations (tests/common) for a fixture's config.
fn dims_of(cfg: &serde_json::Value) -> common::Dims {
    let u = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let rates = &cfg["compress_rates"];
    let ratios = cfg["layer_types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| match t.as_str().unwrap() {
            "sliding_attention" => 0,
            "compressed_sparse_attention" => {
                rates["compressed_sparse_attention"].as_u64().unwrap() as usize
            }
            _ => rates["heavily_compressed_attention"].as_u64().unwrap() as usize,
        })
        .collect();
    let hash = cfg["mlp_layer_types"]
        .as_array()
        .unwrap()
        .iter()
        .take_while(|t| t.as_str() == Some("hash_moe"))
        .count();
    common::Dims {
        e: u("hidden_size"),
        v: u("vocab_size"),
        h: u("num_attention_heads"),
        d: u("head_dim"),
        r: u("qk_rope_head_dim"),
        q: u("q_lora_rank"),
        g: u("o_groups"),
        o: u("o_lora_rank"),
        n: u("n_routed_experts"),
        k: u("num_experts_per_tok"),
        f: u("moe_intermediate_size"),
        m: u("hc_mult"),
        ih: u("index_n_heads"),
        id: u("index_head_dim"),
        ratios,
        hash,
    }
}

#[test]
fn oracle_fixtures_convert_and_validate() {
    let dirs = fixture_dirs();
    assert!(
        dirs.len() >= 3,
        "expected the oracle's tiny-* fixtures, found {dirs:?}"
    );
    let tmp = tempfile::tempdir().unwrap();
    for dir in &dirs {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        let d = dims_of(&cfg);
        let st_bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&st_bytes).unwrap();

        for types in ["f32", "q2", "q4", "mxfp4"] {
            let out = tmp.path().join(format!("{name}-{types}.gguf"));
            let t0 = Instant::now();
            let r = convert_hf(dir, &out, &HfOptions::new(types).unwrap(), &mut NoProgress);
            // Q8_0 rows (e, q, h·d/g, g·o, f wide) and MXFP4 experts need ne0 % 32; the
            // q2/q4 experts need ne0 % 256 (docs/gguf.md §5.7).
            let q8_rows = [d.e, d.q, d.h * d.d / d.g, d.g * d.o, d.f];
            let aligned = match types {
                "mxfp4" => q8_rows.iter().all(|n| n.is_multiple_of(32)),
                _ => d.e.is_multiple_of(256) && d.f.is_multiple_of(256),
            };
            if types != "f32" && !aligned {
                let e = r.unwrap_err().to_string();
                assert!(
                    e.contains("is not a multiple of the"),
                    "{name} {types}: {e}"
                );
                continue;
            }
            let r = r.unwrap_or_else(|e| panic!("{name} {types}: {e}"));
            eprintln!(
                "{name} --types {types}: {} bytes, {} tensors, {:.2} s",
                r.bytes,
                r.tensors,
                t0.elapsed().as_secs_f64()
            );
            let f = GgufFile::open(&out).unwrap();
            let spec = ModelSpec::from_header(f.header(), Strictness::Layout)
                .unwrap_or_else(|e| panic!("{name} {types}: {e}"));
            assert_eq!(spec.hparams.n_layer, d.ratios.len());
            assert_eq!(
                spec.hparams.compress_ratios,
                d.ratios.iter().map(|&r| r as u32).collect::<Vec<_>>()
            );
            assert_eq!(spec.hparams.hash_layer_count, d.hash);
            if types != "f32" {
                for t in &spec.tensors {
                    assert!(
                        t.expected.rule.accepted(true).contains(&t.ty),
                        "{}",
                        t.expected.name
                    );
                }
                continue;
            }
            // Every source tensor lands, bit for bit, where docs/gguf.md §5.3 says.
            let srcs = common::tensors(&d, common::Naming::Saved);
            assert_eq!(srcs.len(), st.len(), "{name}: tensor count");
            for s in &srcs {
                let view = st
                    .tensor(&s.name)
                    .unwrap_or_else(|_| panic!("{name}: {}", s.name));
                assert_eq!(view.shape(), &s.shape[..], "{}", s.name);
                let (info, bytes) = f.tensor_bytes(&s.gguf).unwrap();
                if s.int {
                    assert_eq!(info.ty, GgmlType::I32);
                    let src: Vec<i64> = view
                        .data()
                        .chunks_exact(8)
                        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                        .collect();
                    let got: Vec<i64> = bytes
                        .chunks_exact(4)
                        .map(|c| i64::from(i32::from_le_bytes(c.try_into().unwrap())))
                        .collect();
                    assert_eq!(src, got, "{}", s.name);
                    continue;
                }
                assert_eq!(view.dtype(), safetensors::Dtype::F32);
                let src = view.data();
                let slice = match s.expert {
                    Some(x) => &bytes[x * src.len()..(x + 1) * src.len()],
                    None => bytes,
                };
                assert!(slice == src, "{name}: {} differs from {}", s.gguf, s.name);
            }
        }
    }
}
