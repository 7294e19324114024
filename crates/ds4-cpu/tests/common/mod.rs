//! Test helpers: in-memory GGUF files (arbitrary tensors, or whole synthetic models in the
//! ds4 layout with random weights) and comparison helpers.
#![allow(dead_code)]

use std::sync::Arc;

use ds4_engine::Rng;
use ds4_gguf::quant;
use ds4_gguf::{GgmlType, GgufFile, GgufWriter, Header, TensorInfo};
use ds4_model::layout::{model_header, placeholder_tokenizer, TypeRecipe};
use ds4_model::HParams;

/// Normal-ish values (sum of uniforms) with standard deviation `std`.
pub fn randn(rng: &mut Rng, n: usize, std: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let s: f64 = (0..4).map(|_| rng.next_f64() - 0.5).sum();
            (s * (3.0f64).sqrt()) as f32 * std
        })
        .collect()
}

pub fn uniform(rng: &mut Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n)
        .map(|_| lo + (hi - lo) * rng.next_f64() as f32)
        .collect()
}

/// Encodes `data` (row-major, rows of `dims[0]`) as `ty`.
pub fn encode(ty: GgmlType, data: &[f32], ne0: usize) -> Vec<u8> {
    if ty.is_quantized() {
        quant::quantize_matrix(ty, data, ne0, None).unwrap()
    } else {
        quant::quantize(ty, data, None).unwrap()
    }
}

/// A GGUF image holding exactly these tensors `(name, dims, type, values)`.
pub fn make_file(tensors: Vec<(String, Vec<u64>, GgmlType, Vec<f32>)>) -> Arc<GgufFile> {
    let header = Header {
        metadata: Vec::new(),
        tensors: tensors
            .iter()
            .map(|(n, d, t, _)| TensorInfo {
                name: n.clone(),
                dims: d.clone(),
                ty: *t,
                offset: 0,
            })
            .collect(),
    };
    let mut w = GgufWriter::new(Vec::new(), header).unwrap();
    for (_, dims, ty, data) in &tensors {
        w.write_tensor(&encode(*ty, data, dims[0] as usize))
            .unwrap();
    }
    let (bytes, _) = w.finish().unwrap();
    Arc::new(GgufFile::from_bytes(bytes).unwrap())
}

/// Small dims that exercise everything: window roll-over, CSA selection (top-k 3), HCA
/// rows, hash and top-k MoE, partial FP8 blocks (48 nope dims).
pub fn tiny_hparams() -> HParams {
    let n_layer = 6;
    HParams {
        n_layer,
        n_embd: 64,
        n_head: 4,
        head_dim: 64,
        rope_dim: 16,
        q_lora_rank: 32,
        o_lora_rank: 32,
        o_groups: 2,
        n_vocab: 97,
        n_expert: 8,
        n_expert_used: 2,
        expert_ff: 32,
        hash_layer_count: 3,
        swiglu_clamp: vec![10.0; n_layer],
        sliding_window: 8,
        compress_ratios: vec![0, 0, 4, 16, 4, 16],
        indexer_heads: 16,
        indexer_head_dim: 32,
        indexer_top_k: 3,
        context_length: Some(4096),
        yarn: ds4_model::Yarn {
            factor: 4.0,
            original_context: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
        },
        compress_rope_freq_base: 1000.0,
        ..HParams::flash()
    }
}

/// Dims with 256-multiples where K-quants need them.
pub fn quant_hparams() -> HParams {
    HParams {
        n_embd: 256,
        expert_ff: 256,
        n_layer: 4,
        compress_ratios: vec![0, 0, 4, 16],
        swiglu_clamp: vec![10.0; 4],
        hash_layer_count: 2,
        ..tiny_hparams()
    }
}

/// A complete ds4-layout model with random weights (HF-like init, docs/forward.md §11).
pub fn synthetic_model(hp: &HParams, recipe: &TypeRecipe, seed: u64) -> Arc<GgufFile> {
    synthetic_pair(hp, recipe, seed).0
}

/// The model of [`synthetic_model`] and its twin with every weight dequantized and stored
/// as F32 (same values), for checking quantized kernels inside the whole forward pass.
pub fn synthetic_pair(
    hp: &HParams,
    recipe: &TypeRecipe,
    seed: u64,
) -> (Arc<GgufFile>, Arc<GgufFile>) {
    let header = model_header(hp, recipe, "test model", &placeholder_tokenizer(hp.n_vocab));
    let f32_header = model_header(
        hp,
        &TypeRecipe::F32,
        "test model (dequantized)",
        &placeholder_tokenizer(hp.n_vocab),
    );
    let mut rng = Rng::new(seed);
    let mut payloads = Vec::new();
    let mut f32_payloads = Vec::new();
    for t in &header.tensors {
        let n: usize = t.dims.iter().product::<u64>() as usize;
        let name = t.name.as_str();
        let v = if name.ends_with("tid2eid.weight") {
            let k = t.dims[0] as usize;
            let mut v = Vec::with_capacity(n);
            for _ in 0..t.dims[1] {
                let mut ids: Vec<usize> = (0..hp.n_expert).collect();
                for i in (1..ids.len()).rev() {
                    ids.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
                }
                v.extend(ids[..k].iter().map(|&e| e as f32));
            }
            v
        } else if name.contains("norm") {
            uniform(&mut rng, n, 0.8, 1.2)
        } else if name.ends_with("attn_sinks.weight") {
            randn(&mut rng, n, 1.0)
        } else if name.ends_with("_ape.weight") {
            randn(&mut rng, n, 0.7)
        } else if name.ends_with("_base.weight") {
            randn(&mut rng, n, 0.5)
        } else if name.ends_with("_scale.weight") {
            uniform(&mut rng, n, 0.7, 1.3)
        } else if name.ends_with("exp_probs_b.bias") {
            randn(&mut rng, n, 0.1)
        } else if name == "token_embd.weight" {
            randn(&mut rng, n, 1.0)
        } else {
            randn(&mut rng, n, (t.dims[0] as f32).powf(-0.5))
        };
        let bytes = encode(t.ty, &v, t.dims[0] as usize);
        let mut back = vec![0f32; n];
        quant::dequantize(t.ty, &bytes, &mut back).unwrap();
        let f32_ty = f32_header.tensor(&t.name).unwrap().ty;
        f32_payloads.push(encode(f32_ty, &back, t.dims[0] as usize));
        payloads.push(bytes);
    }
    let write = |h: Header, p: &[Vec<u8>]| {
        // Payloads follow the header's table order, which is the same for both recipes.
        let mut w = GgufWriter::new(Vec::new(), h).unwrap();
        for b in p {
            w.write_tensor(b).unwrap();
        }
        Arc::new(GgufFile::from_bytes(w.finish().unwrap().0).unwrap())
    };
    (write(header, &payloads), write(f32_header, &f32_payloads))
}

/// Largest `|a-b| / max(scale, |b|)`; NaN if anything is NaN (so it never passes).
pub fn max_rel(a: &[f32], b: &[f32], scale: f64) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let mut m = 0f64;
    for (x, y) in a.iter().zip(b) {
        let d = (*x as f64 - *y as f64).abs() / (y.abs() as f64).max(scale);
        if d.is_nan() {
            return f64::NAN;
        }
        m = m.max(d);
    }
    m
}

pub fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let d = (*g as f64 - w).abs();
        assert!(
            d <= tol * w.abs().max(1.0),
            "{what}[{i}]: got {g}, want {w} (|d| = {d:e})"
        );
    }
}

/// An MTP sidecar (docs/gguf.md §4.7) for the main model `hp`: the 32 `mtp.0.*` tensors,
/// all F32, random with the init of [`synthetic_pair`]. `edit` may change a tensor's dims or
/// type before it is written (the refusal tests).
pub fn mtp_sidecar(hp: &HParams, seed: u64, edit: &dyn Fn(&mut TensorInfo)) -> Arc<GgufFile> {
    let mut rng = Rng::new(seed);
    let tensors = ds4_model::layout::mtp_tensor_table(hp)
        .into_iter()
        .map(|mut t| {
            t.ty = GgmlType::F32;
            edit(&mut t);
            let n: usize = t.dims.iter().product::<u64>() as usize;
            let name = t.name.as_str();
            let v = if name.contains("norm") {
                uniform(&mut rng, n, 0.8, 1.2)
            } else if name.ends_with("attn_sinks.weight") {
                randn(&mut rng, n, 1.0)
            } else if name.ends_with("_base.weight") {
                randn(&mut rng, n, 0.5)
            } else if name.ends_with("_scale.weight") {
                uniform(&mut rng, n, 0.7, 1.3)
            } else if name.ends_with("exp_probs_b.bias") {
                randn(&mut rng, n, 0.1)
            } else {
                randn(&mut rng, n, (t.dims[0] as f32).powf(-0.5))
            };
            (t.name, t.dims, t.ty, v)
        })
        .collect();
    make_file(tensors)
}
