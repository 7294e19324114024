//! Helpers shared by the ds4-check test files: machine files and a tiny q2 model.
#![allow(dead_code)]

use std::sync::Arc;

use ds4_convert::SyntheticModel;
use ds4_gguf::GgufFile;
use ds4_model::layout::{placeholder_tokenizer, TypeRecipe};
use ds4_model::HParams;
use ds4_placement::MachineFacts;

pub fn machine(name: &str) -> MachineFacts {
    let path = format!(
        "{}/../ds4-placement/machines/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    MachineFacts::from_json(&std::fs::read_to_string(path).unwrap()).unwrap()
}

pub fn tiny_hparams() -> HParams {
    let n_layer = 2;
    HParams {
        n_layer,
        n_embd: 256,
        n_head: 4,
        head_dim: 64,
        rope_dim: 16,
        q_lora_rank: 64,
        o_lora_rank: 32,
        o_groups: 2,
        n_vocab: 97,
        n_expert: 8,
        n_expert_used: 2,
        expert_ff: 256,
        hash_layer_count: 1,
        swiglu_clamp: vec![10.0; n_layer],
        sliding_window: 8,
        compress_ratios: vec![0, 4],
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

pub fn model_file(dir: &std::path::Path) -> Arc<GgufFile> {
    model_file_with(dir, TypeRecipe::Q2)
}

/// The tiny model with `recipe`'s types (q2: IQ2_XXS/Q2_K experts; q4: Q4_K experts, which
/// fit the grouped expert GEMV at these widths, IQ2_XXS does not: its 256-element rows are
/// not 16-byte multiples).
pub fn model_file_with(dir: &std::path::Path, recipe: TypeRecipe) -> Arc<GgufFile> {
    let h = tiny_hparams();
    let tok = placeholder_tokenizer(h.n_vocab);
    let m = SyntheticModel::from_hparams(h, recipe, 7, &tok).unwrap();
    let (bytes, _) = m
        .write_to(Vec::new(), &mut ds4_convert::NoProgress)
        .unwrap();
    let p = dir.join("tiny.gguf");
    std::fs::write(&p, bytes).unwrap();
    Arc::new(GgufFile::open(&p).unwrap())
}
