//! `ds4-convert hf` on tiny checkpoints built in the test (both naming schemes and the packed
//! in-memory form), checked with ds4-model's validation and by comparing payloads.

mod common;

use std::path::{Path, PathBuf};

use common::{dims, tensors, write_checkpoint, Dims, Naming, Src};
use ds4_convert::{convert_hf, ConvertError, HfOptions, NoProgress};
use ds4_gguf::{GgmlType, GgufFile, Value};
use ds4_model::{expected_tensors, ModelSpec, Strictness};
use safetensors::Dtype;

fn opts(types: &str) -> HfOptions {
    let mut o = HfOptions::new(types).unwrap();
    o.name = Some("tiny test".into());
    o
}

fn build(dir: &Path, naming: Naming, dtype_of: &dyn Fn(&Src) -> Dtype) -> (Dims, Vec<Src>) {
    let d = dims();
    let srcs = tensors(&d, naming);
    write_checkpoint(dir, &d, &common::config_json(&d), &srcs, dtype_of);
    (d, srcs)
}

fn convert(dir: &Path, out: &Path, types: &str) -> Result<ds4_convert::Report, ConvertError> {
    convert_hf(dir, out, &opts(types), &mut NoProgress)
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Expected GGUF payload (F32) of a tensor, from the test's own value generator.
fn expected_payload(d: &Dims, gguf: &str, n: usize) -> Vec<f32> {
    if gguf.ends_with("_exps.weight") {
        let per = n / d.n;
        (0..d.n)
            .flat_map(|x| common::values(&format!("{gguf}#{x}"), per))
            .collect()
    } else {
        common::values(gguf, n)
    }
}

#[test]
fn f32_conversion_validates_and_round_trips() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let (d, srcs) = build(&dir, Naming::Saved, &common::f32_all);
    let out = tmp.path().join("out.gguf");
    let r = convert(&dir, &out, "f32").unwrap();
    assert_eq!(r.scheme, ds4_convert::mapping::Scheme::HfSaved);

    let f = GgufFile::open(&out).unwrap();
    let h = f.header();
    let spec = ModelSpec::from_header(h, Strictness::Layout).unwrap();
    assert_eq!(spec.hparams.n_layer, 4);
    assert_eq!(spec.hparams.compress_ratios, vec![0, 0, 4, 16]);
    assert_eq!(spec.hparams.hash_layer_count, 2);
    assert_eq!(spec.hparams.rope_dim, 16);
    assert_eq!(spec.hparams.yarn.factor, 16.0);
    assert_eq!(
        h.get("deepseek4.attention.compress_ratios"),
        Some(&Value::Array(ds4_gguf::Array::i32s([0, 0, 4, 16, 0])))
    );
    assert_eq!(r.bytes, std::fs::metadata(&out).unwrap().len());

    // Per the spec: globals 6; per layer 24 + bias (non-hash) or tid2eid (hash)
    // + compressor 4 (ratio != 0) + indexer 6 (ratio 4). The test model has no optional gaps.
    let per_layer: usize = d
        .ratios
        .iter()
        .map(|&r| 23 + 1 + if r != 0 { 4 } else { 0 } + if r == 4 { 6 } else { 0 })
        .sum();
    assert_eq!(h.tensors.len(), 6 + per_layer);
    assert_eq!(h.tensors.len(), expected_tensors(&spec.hparams).len());

    let t = h.tensor("blk.2.ffn_gate_exps.weight").unwrap();
    assert_eq!((t.dims.clone(), t.ty), (vec![256, 256, 4], GgmlType::F32));
    let t = h.tensor("blk.3.ffn_down_exps.weight").unwrap();
    assert_eq!(t.dims, vec![256, 256, 4]);
    let t = h.tensor("blk.1.ffn_gate_tid2eid.weight").unwrap();
    assert_eq!((t.dims.clone(), t.ty), (vec![2, 300], GgmlType::I32));
    let t = h.tensor("blk.3.attn_compressor_ape.weight").unwrap();
    assert_eq!(t.dims, vec![64, 16]);
    let t = h.tensor("output_hc_scale.weight").unwrap();
    assert_eq!(t.dims, vec![1]);
    assert!(h.tensor("blk.0.exp_probs_b.bias").is_none());
    assert!(h.tensor("blk.1.attn_compressor_kv.weight").is_none());
    for t in &h.tensors {
        let want = if t.name.ends_with("tid2eid.weight") {
            GgmlType::I32
        } else {
            GgmlType::F32
        };
        assert_eq!(t.ty, want, "{}", t.name);
    }

    // Every payload equals the source values bit for bit (F32 keeps full precision).
    let mut seen = std::collections::HashSet::new();
    for s in &srcs {
        if !seen.insert(s.gguf.clone()) {
            continue;
        }
        let (info, bytes) = f.tensor_bytes(&s.gguf).unwrap();
        let n = info.n_elements().unwrap() as usize;
        if s.int {
            let got: Vec<i64> = bytes
                .chunks_exact(4)
                .map(|c| i64::from(i32::from_le_bytes(c.try_into().unwrap())))
                .collect();
            assert_eq!(got, common::tid2eid(d.v, d.k, d.n), "{}", s.gguf);
        } else {
            let want = expected_payload(&d, &s.gguf, n);
            assert!(
                f32s(bytes)
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{} differs",
                s.gguf
            );
        }
    }
    assert_eq!(seen.len(), h.tensors.len());
}

#[test]
fn three_namings_and_packed_experts_give_identical_files() {
    let tmp = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    for naming in [Naming::Saved, Naming::Official, Naming::Module] {
        let dir = tmp.path().join(format!("{naming:?}"));
        build(&dir, naming, &common::f32_all);
        let out = tmp.path().join(format!("{naming:?}.gguf"));
        convert(&dir, &out, "f32").unwrap();
        files.push(std::fs::read(&out).unwrap());
    }
    assert!(files[0] == files[1], "official vs saved naming differ");
    assert!(files[0] == files[2], "packed in-memory form differs");
}

#[test]
fn bf16_and_f16_sources_widen_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let pick = |s: &Src| {
        if s.name.contains("wq_b") || s.name.contains(".w1.") {
            Dtype::BF16
        } else if s.name.contains("wkv") {
            Dtype::F16
        } else {
            Dtype::F32
        }
    };
    let (d, _) = build(&dir, Naming::Saved, &pick);
    let out = tmp.path().join("out.gguf");
    convert(&dir, &out, "f32").unwrap();
    let f = GgufFile::open(&out).unwrap();
    let (_, b) = f.tensor_bytes("blk.0.attn_q_b.weight").unwrap();
    let want: Vec<f32> = common::values("blk.0.attn_q_b.weight", d.h * d.d * d.q)
        .iter()
        .map(|v| half::bf16::from_f32(*v).to_f32())
        .collect();
    assert_eq!(f32s(b), want);
    let (_, b) = f.tensor_bytes("blk.2.attn_kv.weight").unwrap();
    let want: Vec<f32> = common::values("blk.2.attn_kv.weight", d.d * d.e)
        .iter()
        .map(|v| half::f16::from_f32(*v).to_f32())
        .collect();
    assert_eq!(f32s(b), want);
    let (_, b) = f.tensor_bytes("blk.3.ffn_gate_exps.weight").unwrap();
    let want: Vec<f32> = expected_payload(&d, "blk.3.ffn_gate_exps.weight", d.e * d.f * d.n)
        .iter()
        .map(|v| half::bf16::from_f32(*v).to_f32())
        .collect();
    assert_eq!(f32s(b), want);
}

#[test]
fn quantized_conversions_are_deterministic_and_use_ds4_types() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let (d, _) = build(&dir, Naming::Saved, &common::f32_all);
    for types in ["q2", "q4", "mxfp4"] {
        let a = tmp.path().join(format!("{types}-a.gguf"));
        let b = tmp.path().join(format!("{types}-b.gguf"));
        convert(&dir, &a, types).unwrap();
        convert(&dir, &b, types).unwrap();
        let (ba, bb) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
        assert!(ba == bb, "{types}: two conversions differ");

        let f = GgufFile::open(&a).unwrap();
        let spec = ModelSpec::from_header(f.header(), Strictness::Layout).unwrap();
        // Every tensor has exactly ds4's type for its family (the strict rule set).
        for t in &spec.tensors {
            assert!(
                t.expected.rule.accepted(true).contains(&t.ty),
                "{}: {}",
                t.expected.name,
                t.ty
            );
        }
        let (gate, down) = match types {
            "q2" => (GgmlType::Iq2Xxs, GgmlType::Q2K),
            "q4" => (GgmlType::Q4K, GgmlType::Q4K),
            _ => (GgmlType::Mxfp4, GgmlType::Mxfp4),
        };
        assert_eq!(spec.tensor("blk.2.ffn_up_exps.weight").unwrap().ty, gate);
        assert_eq!(spec.tensor("blk.2.ffn_down_exps.weight").unwrap().ty, down);
        assert_eq!(spec.tensor("output.weight").unwrap().ty, GgmlType::Q8_0);
        assert_eq!(spec.tensor("token_embd.weight").unwrap().ty, GgmlType::F16);

        // Dequantized experts stay close to the source (each expert quantized on its own).
        let (info, bytes) = f.tensor_bytes("blk.3.ffn_gate_exps.weight").unwrap();
        let n = info.n_elements().unwrap() as usize;
        let mut got = vec![0f32; n];
        ds4_gguf::quant::dequantize(info.ty, bytes, &mut got).unwrap();
        let want = expected_payload(&d, "blk.3.ffn_gate_exps.weight", n);
        let err: f64 = got
            .iter()
            .zip(&want)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum::<f64>()
            / want.iter().map(|b| f64::from(*b).powi(2)).sum::<f64>();
        let limit = match types {
            "q2" => 0.25,
            "q4" => 0.02,
            _ => 0.03,
        };
        eprintln!("{types}: relative squared error of blk.3.ffn_gate_exps {err:.5}");
        assert!(err < limit, "{types}: relative squared error {err}");
        // Quantizing the first expert alone gives its slice: experts are independent.
        let per = n / d.n;
        let alone = ds4_gguf::quant::quantize_matrix(info.ty, &want[..per], d.e, None).unwrap();
        assert_eq!(&bytes[..alone.len()], &alone[..]);
    }
}

fn refuse(mutate: impl Fn(&mut Vec<Src>, &mut serde_json::Value)) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let d = dims();
    let mut srcs = tensors(&d, Naming::Saved);
    let mut cfg = common::config_json(&d);
    mutate(&mut srcs, &mut cfg);
    write_checkpoint(&dir, &d, &cfg, &srcs, &common::f32_all);
    let out = tmp.path().join("out.gguf");
    let e = convert(&dir, &out, "f32").unwrap_err().to_string();
    assert!(!out.exists(), "no output may be left after a refusal");
    assert!(!PathBuf::from(format!("{}.partial", out.display())).exists());
    e
}

#[test]
fn renamed_missing_and_misshaped_tensors_are_refused() {
    let e = refuse(|s, _| {
        let t = s
            .iter_mut()
            .find(|t| t.name == "model.layers.0.attn.wq_a.weight")
            .unwrap();
        t.name = "model.layers.0.attn.wq_x.weight".into();
    });
    assert!(
        e.contains("unexpected tensor model.layers.0.attn.wq_x.weight"),
        "{e}"
    );
    assert!(
        e.contains("missing tensor model.layers.0.attn.wq_a.weight (expected shape [64, 256]"),
        "{e}"
    );

    let e = refuse(|s, _| s.retain(|t| t.name != "model.layers.1.ffn_norm.weight"));
    assert!(
        e.contains("missing tensor model.layers.1.ffn_norm.weight (expected shape [256]"),
        "{e}"
    );

    let e = refuse(|s, _| s.retain(|t| t.name != "model.layers.3.ffn.experts.2.w2.weight"));
    assert!(
        e.contains(
            "missing tensor model.layers.3.ffn.experts.2.w2.weight (expected shape [256, 256]"
        ),
        "{e}"
    );

    let e = refuse(|s, _| {
        let t = s
            .iter_mut()
            .find(|t| t.name == "model.layers.2.attn.wkv.weight")
            .unwrap();
        t.shape = vec![64, 128];
    });
    assert!(
        e.contains(
            "tensor model.layers.2.attn.wkv.weight has shape [64, 128], config implies [64, 256]"
        ),
        "{e}"
    );

    // A compressor in a sliding layer does not belong there.
    let e = refuse(|s, _| {
        let mut t = s
            .iter()
            .find(|t| t.name == "model.layers.3.attn.compressor.norm.weight")
            .unwrap()
            .clone();
        t.name = "model.layers.0.attn.compressor.norm.weight".into();
        s.push(t);
    });
    assert!(
        e.contains("unexpected tensor model.layers.0.attn.compressor.norm.weight"),
        "{e}"
    );

    // A config that disagrees with the tensors: every affected tensor is named.
    let e = refuse(|_, c| c["q_lora_rank"] = serde_json::json!(32));
    assert!(
        e.contains(
            "tensor model.layers.0.attn.wq_a.weight has shape [64, 256], config implies [32, 256]"
        ),
        "{e}"
    );
    assert!(
        e.contains("model.layers.0.attn.wq_b.weight has shape [256, 64], config implies [256, 32]"),
        "{e}"
    );
}

#[test]
fn bad_values_and_types_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    // tid2eid naming an expert that does not exist.
    let dir = tmp.path().join("ckpt");
    let d = dims();
    let cfg = common::config_json(&d);
    let srcs = tensors(&d, Naming::Saved);
    write_checkpoint(&dir, &d, &cfg, &srcs, &common::f32_all);
    // Overwrite tid2eid of layer 0 with an out-of-range id by rewriting the file.
    let st = std::fs::read(dir.join("model.safetensors")).unwrap();
    let parsed = safetensors::SafeTensors::deserialize(&st).unwrap();
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = parsed
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let tid = owned
        .iter_mut()
        .find(|t| t.0 == "model.layers.0.ffn.gate.tid2eid")
        .unwrap();
    tid.3[8 * 5..8 * 6].copy_from_slice(&9i64.to_le_bytes());
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, dt, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*dt, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let e = convert(&dir, &tmp.path().join("o.gguf"), "f32")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.layers.0.ffn.gate.tid2eid: element 5 (token 2, slot 1) is expert id 9, outside 0..4"),
        "{e}"
    );

    // Integer weights where floats are needed.
    let dir2 = tmp.path().join("ckpt2");
    write_checkpoint(&dir2, &d, &common::config_json(&d), &srcs, &|s: &Src| {
        if s.name.ends_with("attn_sink") {
            Dtype::I64
        } else {
            Dtype::F32
        }
    });
    let e = convert(&dir2, &tmp.path().join("o2.gguf"), "f32");
    let e = e.unwrap_err().to_string();
    assert!(
        e.contains("tensor model.layers.0.attn.attn_sink has dtype I64; only F32, BF16, F16, and F8_E4M3 / packed-FP4 I8 weights with F8_E8M0 .scale tensors can be converted"),
        "{e}"
    );

    // Dims that the q2 recipe cannot hold are refused before anything is written.
    let dir3 = tmp.path().join("ckpt3");
    let mut d3 = dims();
    d3.e = 128;
    d3.f = 128;
    let srcs3 = tensors(&d3, Naming::Saved);
    write_checkpoint(
        &dir3,
        &d3,
        &common::config_json(&d3),
        &srcs3,
        &common::f32_all,
    );
    let e = convert(&dir3, &tmp.path().join("o3.gguf"), "q2")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("ne0 = 128 is not a multiple of the IQ2_XXS block (256)"),
        "{e}"
    );
    assert!(!tmp.path().join("o3.gguf").exists());
    // ... while f32 converts the same checkpoint.
    convert(&dir3, &tmp.path().join("o3.gguf"), "f32").unwrap();
}

#[test]
fn tokenizer_json_is_embedded() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let (d, _) = build(&dir, Naming::Saved, &common::f32_all);
    // A tokenizer.json with the 7 ds4 strings and BPE filler up to vocab_size.
    let mut vocab = serde_json::Map::new();
    for i in 0..(d.v - 7) {
        vocab.insert(format!("t{i}"), serde_json::json!(i + 7));
    }
    let added: Vec<serde_json::Value> = [
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<think>",
        "</think>",
        "｜DSML｜",
    ]
    .iter()
    .enumerate()
    .map(|(i, s)| serde_json::json!({"id": i, "content": s, "special": i < 2}))
    .collect();
    let tj = serde_json::json!({"model": {"type": "BPE", "vocab": vocab, "merges": [["t1", "t2"]]},
                                "added_tokens": added});
    let tpath = tmp.path().join("tokenizer.json");
    std::fs::write(&tpath, serde_json::to_vec(&tj).unwrap()).unwrap();
    let mut o = opts("f32");
    o.tokenizer = Some(tpath.clone());
    let out = tmp.path().join("out.gguf");
    convert_hf(&dir, &out, &o, &mut NoProgress).unwrap();
    let f = GgufFile::open(&out).unwrap();
    ModelSpec::from_header(f.header(), Strictness::Layout).unwrap();
    let toks = f
        .header()
        .get("tokenizer.ggml.tokens")
        .unwrap()
        .as_array()
        .unwrap();
    assert_eq!(toks.len(), d.v);
    assert_eq!(toks.get(2).unwrap().as_str(), Some("<｜User｜>"));
    assert_eq!(toks.get(7).unwrap().as_str(), Some("t0"));
    let types = f
        .header()
        .get("tokenizer.ggml.token_type")
        .unwrap()
        .as_array()
        .unwrap();
    let t: Vec<i128> = types.iter().take(8).map(|v| v.as_int().unwrap()).collect();
    // BOS/EOS special → control; <｜User｜>/<｜Assistant｜> look special → control;
    // <think>, </think>, ｜DSML｜ → user-defined; BPE → normal.
    assert_eq!(t, vec![3, 3, 3, 3, 4, 4, 4, 1]);
    assert_eq!(
        f.header()
            .get("tokenizer.ggml.merges")
            .unwrap()
            .as_array()
            .unwrap()
            .get(0)
            .unwrap()
            .as_str(),
        Some("t1 t2")
    );

    // A tokenizer larger than the model's vocabulary is refused.
    let mut o2 = opts("f32");
    let mut big = tj.clone();
    big["model"]["vocab"]["extra"] = serde_json::json!(d.v + 5);
    let bpath = tmp.path().join("big.json");
    std::fs::write(&bpath, serde_json::to_vec(&big).unwrap()).unwrap();
    o2.tokenizer = Some(bpath);
    let e = convert_hf(&dir, &tmp.path().join("o2.gguf"), &o2, &mut NoProgress)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("has 306 tokens but config.json says vocab_size = 300"),
        "{e}"
    );
}
