//! Validation and byte accounting against the real published layouts (described by
//! metadata + tensor table only) and against deliberately broken variants.

use ds4_gguf::{file_size, GgmlType, Header, Value};
use ds4_model::layout::{model_header, placeholder_tokenizer, TypeRecipe};
use ds4_model::{ByteAccounting, HParams, ModelError, ModelSpec, Problem, Strictness};

fn flash(recipe: TypeRecipe) -> Header {
    let h = HParams::flash();
    model_header(
        &h,
        &recipe,
        "DeepSeek V4 Flash",
        &placeholder_tokenizer(h.n_vocab),
    )
}

fn problems(h: &Header, s: Strictness) -> Vec<Problem> {
    match ModelSpec::from_header(h, s) {
        Err(ModelError::Invalid(p)) => p,
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => vec![],
    }
}

/// Data section bytes with each payload padded to 32 B, as the writer lays them out.
fn padded_data(h: &Header) -> u64 {
    let mut h = h.clone();
    h.assign_offsets().unwrap()
}

const GIB: f64 = (1u64 << 30) as f64;

#[test]
fn real_q2_layout_sizes() {
    let h = flash(TypeRecipe::Q2);
    assert_eq!(h.tensors.len(), 1328);
    let spec = ModelSpec::from_header(&h, Strictness::Ds4).unwrap();
    assert_eq!(spec.strictness, Strictness::Ds4);
    assert_eq!(spec.routed_bits(), 2);
    let acc = ByteAccounting::of(&spec);
    // docs/gguf.md §7.1: tensor data 86,714,777,664 B once each payload is padded to 32 B; the
    // unpadded sum is 1,764 B less.
    assert_eq!(acc.tensor_bytes, 86_714_777_664 - 1_764);
    assert_eq!(padded_data(&h), 86_714_777_664);
    let file = file_size(&h).unwrap();
    let gib = file as f64 / GIB;
    // Our placeholder vocabulary is smaller than the real one (~5.24 MB of KV), so the
    // exact byte count differs by a few MB, but both print as 80.76 GiB.
    assert_eq!(format!("{gib:.2}"), "80.76", "{file} bytes");
    let by_type: Vec<(String, u64, usize)> = acc.by_type.clone();
    let get = |t: &str| {
        by_type
            .iter()
            .find(|x| x.0 == t)
            .map(|x| (x.1, x.2))
            .unwrap()
    };
    assert_eq!(get("IQ2_XXS"), (47_613_739_008, 86));
    assert_eq!(get("Q2_K"), (30_299_652_096, 43));
    assert_eq!(get("Q8_0"), (6_598_885_376, 345));
    assert_eq!(get("I32"), (9_308_160, 3));
    assert_eq!(get("F16").1, 359);
    assert_eq!(get("F32").1, 492);
    // docs/gguf.md §7.2: weight bytes per decoded token.
    assert_eq!(acc.per_token_short, 9_195_786_660);
    assert_eq!(acc.per_token_long, 9_559_118_244);
    assert_eq!(format!("{:.2}", acc.per_token_short as f64 / 1e9), "9.20");
    // docs/gguf.md §7.3: a batched step reads the distinct experts its tokens picked.
    assert!((acc.per_step_short(1) - acc.per_token_short as f64).abs() < 1.0);
    let step = |b: usize| format!("{:.2}", acc.per_step_short(b) / 1e9);
    assert_eq!(
        [1, 2, 4, 8, 16].map(step),
        ["9.20", "10.98", "14.42", "20.83", "31.97"]
    );
    let ratio = |b: usize| b as f64 * acc.per_token_short as f64 / acc.per_step_short(b);
    assert_eq!(format!("{:.2}", ratio(8)), "3.53");
    assert_eq!(acc.per_step_short(0), 0.0);
}

#[test]
fn real_q4_layout_sizes() {
    let h = flash(TypeRecipe::Q4);
    let spec = ModelSpec::from_header(&h, Strictness::Auto).unwrap();
    assert_eq!(spec.strictness, Strictness::Ds4);
    assert_eq!(spec.routed_bits(), 4);
    let acc = ByteAccounting::of(&spec);
    assert_eq!(acc.tensor_bytes, 164_628_168_768 - 1_764);
    // With our placeholder vocabulary the file is a few MB smaller than the real one; with
    // the real vocabulary the data section starts at byte 5,328,480 (docs/gguf.md §7.1, measured on
    // a file ds4 accepted), which gives the published 153.33 GiB.
    let header_len = file_size(&h).unwrap() - padded_data(&h);
    assert!(header_len < 5_328_480, "{header_len}");
    assert_eq!(padded_data(&h), 164_628_168_768);
    assert_eq!(
        format!("{:.2}", (padded_data(&h) + 5_328_480) as f64 / GIB),
        "153.33"
    );
    assert_eq!(acc.per_token_short, 11_021_881_764);
    assert_eq!(acc.per_token_long, 11_385_213_348);
}

/// The native MXFP4 layout: every routed tensor MXFP4 (17 B per 32 values), the rest as q4.
/// Totals derived by hand in docs/gguf.md §7.1: 4096·2048·256·17/32 = 1,140,850,688 B per
/// routed tensor, and the q4 per-token figures less 6·3·43 experts' Q4_K − MXFP4 difference.
#[test]
fn real_mxfp4_layout_sizes() {
    let h = flash(TypeRecipe::MXFP4);
    let spec = ModelSpec::from_header(&h, Strictness::Auto).unwrap();
    assert_eq!(spec.strictness, Strictness::Ds4);
    assert_eq!(spec.routed_bits(), 4);
    let acc = ByteAccounting::of(&spec);
    let get = |t: &str| acc.by_type.iter().find(|x| x.0 == t).map(|x| (x.1, x.2));
    assert_eq!(get("MXFP4"), Some((43 * 3 * 1_140_850_688, 129)));
    assert_eq!(get("Q4_K"), None);
    assert_eq!(padded_data(&h), 155_971_125_312);
    assert_eq!(
        format!("{:.2}", (padded_data(&h) + 5_328_480) as f64 / GIB),
        "145.26"
    );
    assert_eq!(acc.per_token_short, 10_818_982_308);
    assert_eq!(acc.per_token_long, 11_182_313_892);
    assert_eq!(
        h.get("general.file_type").and_then(|v| v.as_int()),
        Some(38)
    );
    // Gate and up must still agree.
    let mut bad = h.clone();
    bad.tensors
        .iter_mut()
        .find(|t| t.name == "blk.5.ffn_up_exps.weight")
        .unwrap()
        .ty = GgmlType::Q4K;
    let p = problems(&bad, Strictness::Ds4);
    assert!(
        matches!(p.as_slice(), [Problem::GateUpMismatch { layer: 5, .. }]),
        "{p:?}"
    );
}

#[test]
fn recipes_round_trip_their_names() {
    for (name, r) in TypeRecipe::NAMED {
        assert_eq!(TypeRecipe::from_name(name), Some(r));
        assert_eq!(r.name(), Some(name));
    }
    assert_eq!(TypeRecipe::from_name("fp4"), None);
}

#[test]
fn wrong_values_name_the_key() {
    let mut h = flash(TypeRecipe::Q2);
    h.set("deepseek4.expert_used_count", Value::U32(8));
    let p = problems(&h, Strictness::Ds4);
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(
        p[0].to_string(),
        "metadata key deepseek4.expert_used_count = 8, expected 6"
    );

    let mut h = flash(TypeRecipe::Q2);
    h.set("deepseek4.embedding_length", Value::U64(4096));
    let p = problems(&h, Strictness::Ds4);
    assert_eq!(
        p[0].to_string(),
        "metadata key deepseek4.embedding_length has type u64, expected u32"
    );

    let mut h = flash(TypeRecipe::Q2);
    h.metadata
        .retain(|(k, _)| k != "deepseek4.hash_layer_count");
    let p = problems(&h, Strictness::Ds4);
    assert_eq!(
        p[0].to_string(),
        "metadata key deepseek4.hash_layer_count is missing"
    );

    let mut h = flash(TypeRecipe::Q2);
    h.set(
        "deepseek4.swiglu_clamp_exp",
        Value::Array(ds4_gguf::Array::f32s(vec![10.0; 40])),
    );
    let p = problems(&h, Strictness::Ds4);
    assert!(p[0].to_string().contains("at least 43 entries"), "{p:?}");

    let mut h = flash(TypeRecipe::Q2);
    let mut r = ds4_model::hparams::flash_schedule(43)
        .into_iter()
        .map(|x| x as i32)
        .collect::<Vec<_>>();
    r[5] = 4;
    h.set(
        "deepseek4.attention.compress_ratios",
        Value::Array(ds4_gguf::Array::i32s(r)),
    );
    assert!(problems(&h, Strictness::Ds4)[0]
        .to_string()
        .contains("compress_ratios"));

    let mut h = flash(TypeRecipe::Q2);
    h.set("deepseek4.expert_group_count", Value::U32(8));
    assert!(problems(&h, Strictness::Ds4)[0]
        .to_string()
        .contains("absent or 0"));

    // Float-ish keys accept integers and f64 like ds4.
    let mut h = flash(TypeRecipe::Q2);
    h.set("deepseek4.rope.freq_base", Value::U32(10000));
    h.set("deepseek4.expert_weights_scale", Value::F64(1.5));
    assert!(problems(&h, Strictness::Ds4).is_empty());
}

#[test]
fn wrong_tensors_name_the_tensor() {
    let mut h = flash(TypeRecipe::Q2);
    h.tensors.retain(|t| t.name != "blk.7.attn_q_b.weight");
    let p = problems(&h, Strictness::Ds4);
    assert_eq!(
        p,
        vec![Problem::MissingTensor {
            name: "blk.7.attn_q_b.weight".into()
        }]
    );

    let mut h = flash(TypeRecipe::Q2);
    h.tensors
        .iter_mut()
        .find(|t| t.name == "blk.2.indexer.proj.weight")
        .unwrap()
        .dims = vec![4096, 32];
    let p = problems(&h, Strictness::Ds4);
    assert_eq!(
        p[0].to_string(),
        "tensor blk.2.indexer.proj.weight has dims [4096, 32], expected [4096, 64]"
    );

    let mut h = flash(TypeRecipe::Q2);
    h.tensors
        .iter_mut()
        .find(|t| t.name == "output.weight")
        .unwrap()
        .ty = GgmlType::F16;
    let p = problems(&h, Strictness::Ds4);
    assert_eq!(
        p[0].to_string(),
        "tensor output.weight has type F16, expected Q8_0"
    );

    let mut h = flash(TypeRecipe::Q2);
    h.tensors
        .iter_mut()
        .find(|t| t.name == "blk.9.ffn_up_exps.weight")
        .unwrap()
        .ty = GgmlType::Q4K;
    let p = problems(&h, Strictness::Ds4);
    assert_eq!(
        p[0].to_string(),
        "layer 9: routed gate is IQ2_XXS but up is Q4_K (they must share a type)"
    );

    // exp_probs_b.bias is optional; extra tensors are ignored (like ds4).
    let mut h = flash(TypeRecipe::Q2);
    h.tensors.retain(|t| t.name != "blk.10.exp_probs_b.bias");
    h.tensors.push(ds4_gguf::TensorInfo {
        name: "extra".into(),
        dims: vec![4],
        ty: GgmlType::F32,
        offset: 0,
    });
    assert!(problems(&h, Strictness::Ds4).is_empty());

    // A per-layer mixed file (Q4_K experts in some layers) is valid.
    let mut h = flash(TypeRecipe::Q2);
    for t in h
        .tensors
        .iter_mut()
        .filter(|t| t.name.starts_with("blk.40.ffn_") && t.name.contains("_exps"))
    {
        t.ty = GgmlType::Q4K;
    }
    assert!(problems(&h, Strictness::Ds4).is_empty());
}

#[test]
fn tokenizer_requirements() {
    let mut h = flash(TypeRecipe::Q2);
    let mut tok = placeholder_tokenizer(129_280);
    tok.tokens[128_803] = "User".into();
    let toks = ds4_gguf::Array::strings(tok.tokens);
    h.set("tokenizer.ggml.tokens", Value::Array(toks));
    let p = problems(&h, Strictness::Ds4);
    assert!(p[0].to_string().contains("<｜User｜>"), "{p:?}");
    let mut h = flash(TypeRecipe::Q2);
    h.metadata.retain(|(k, _)| k != "tokenizer.ggml.merges");
    assert_eq!(
        problems(&h, Strictness::Ds4)[0].to_string(),
        "metadata key tokenizer.ggml.merges is missing"
    );
}

fn tiny() -> HParams {
    let n_layer = 4;
    HParams {
        n_layer,
        n_embd: 64,
        n_head: 4,
        head_dim: 32,
        rope_dim: 8,
        q_lora_rank: 32,
        o_lora_rank: 32,
        o_groups: 2,
        n_vocab: 300,
        n_expert: 4,
        n_expert_used: 2,
        expert_ff: 32,
        hash_layer_count: 1,
        swiglu_clamp: vec![10.0; n_layer],
        sliding_window: 16,
        compress_ratios: vec![0, 0, 4, 16],
        indexer_heads: 16,
        indexer_head_dim: 16,
        indexer_top_k: 4,
        ..HParams::flash()
    }
}

#[test]
fn tiny_models_pass_layout_rules_and_fail_ds4_rules() {
    let hp = tiny();
    let h = model_header(
        &hp,
        &TypeRecipe::F32,
        "tiny",
        &placeholder_tokenizer(hp.n_vocab),
    );
    let spec = ModelSpec::from_header(&h, Strictness::Auto).unwrap();
    assert_eq!(spec.strictness, Strictness::Layout);
    assert_eq!(spec.hparams, hp);
    assert_eq!(spec.hparams.attn_kind(3), ds4_model::AttnKind::Hca(16));
    let p = problems(&h, Strictness::Ds4);
    assert!(
        p.iter()
            .any(|p| p.to_string() == "metadata key deepseek4.block_count = 4, expected 43"),
        "{p:?}"
    );
    // Layout rules still check consistency.
    let mut bad = hp.clone();
    bad.o_groups = 3;
    let h = model_header(
        &bad,
        &TypeRecipe::F32,
        "tiny",
        &placeholder_tokenizer(bad.n_vocab),
    );
    let p = problems(&h, Strictness::Layout);
    assert!(
        p[0].to_string()
            .contains("divisible by output_group_count 3"),
        "{p:?}"
    );
}

#[test]
fn absurd_block_count_does_not_allocate() {
    let mut h = flash(TypeRecipe::Q2);
    h.set("deepseek4.block_count", Value::U32(u32::MAX));
    let p = problems(&h, Strictness::Auto);
    assert!(p[0].to_string().contains("block_count"), "{p:?}");
}
