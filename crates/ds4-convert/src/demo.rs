//! The committed demo model (`tests/fixtures/demo/ds4-demo.gguf`): what a newcomer runs first.
//!
//! The point is to exercise the engine's whole path on any machine with nothing downloaded:
//! chat-template rendering and the real V4 tokenizer (the file carries the real 129,280-token
//! vocabulary), the forward pass through every attention kind (sliding window, CSA with the
//! indexer, HCA), hash and top-k routing, the q2 kernels (IQ2_XXS gate/up, Q2_K down, Q8_0
//! attention), sampling, detokenization and streaming. The weights are random, so the text
//! is meaningless; the file says so in [`RANDOM_WEIGHTS_NOTE_KEY`] and `ds4` prints it.
//!
//! # Why two tensors leave the q2 recipe
//! IQ2_XXS and Q2_K blocks hold 256 values, and the expert matrices are `n_embd` wide, so the
//! hidden size cannot go below 256. At that width the two vocabulary-sized matrices would
//! dominate: `token_embd` in F16 is 66 MB and `output` in Q8_0 35 MB, far over the 25 MB a
//! committed fixture may take. Both are therefore IQ2_XXS here (8.5 MB each); everything
//! else has the published q2 types. The engine reads embedding rows and runs the output
//! head through the same per-type code as every other matrix, so nothing is special-cased.

use ds4_gguf::{GgmlType, Value};
use ds4_model::layout::{model_header, TokenizerData, TypeRecipe, RANDOM_WEIGHTS_NOTE_KEY};
use ds4_model::HParams;

use crate::error::{ConvertError, Result};
use crate::synthetic::SyntheticModel;

/// Seed of the committed file (regenerating with it gives the same bytes).
pub const DEMO_SEED: u64 = 4;

/// `general.name` of the demo file.
pub const DEMO_NAME: &str = "ds4-rs demo (tiny, random weights)";

/// What `ds4` prints when it loads the demo file.
pub const DEMO_NOTE: &str = "this is the ds4-rs demo model: tiny dimensions and RANDOM \
weights, so its text is meaningless. It shows the whole path running (prompt rendering, the \
real V4 tokenizer, the forward pass with the q2 kernels, sampling, detokenizing, streaming). \
For real answers give -m with a ds4-layout GGUF of DeepSeek V4 Flash.";

/// Tiny dimensions that still reach every code path: a hash-routed sliding-window layer, a
/// CSA layer (compress ratio 4; the indexer's top-k is below the number of compressed rows
/// once the prompt passes 32 tokens) and a top-k-routed HCA layer; 256-wide rows so the q2
/// block types apply. Four experts with one routed per token (plus the shared expert) keep
/// the file under 25 MB: the hash layer's token→expert table has `n_expert_used` entries
/// for each of the 129,280 tokens, so every routed slot costs 0.5 MB.
pub fn demo_hparams(n_vocab: usize) -> HParams {
    let n_layer = 3;
    HParams {
        n_layer,
        n_embd: 256,
        n_head: 4,
        head_dim: 64,
        rope_dim: 16,
        q_lora_rank: 64,
        o_lora_rank: 32,
        o_groups: 2,
        n_vocab,
        n_expert: 4,
        n_expert_used: 1,
        expert_ff: 256,
        hash_layer_count: 1,
        swiglu_clamp: vec![10.0; n_layer],
        sliding_window: 16,
        compress_ratios: vec![0, 4, 16],
        indexer_heads: 4,
        indexer_head_dim: 32,
        indexer_top_k: 8,
        ..HParams::flash()
    }
}

/// The demo model for a vocabulary (normally the real V4 one from the vocabulary fixture).
pub fn demo_model(tok: &TokenizerData) -> Result<SyntheticModel> {
    if tok.tokens.is_empty() {
        return Err(ConvertError::Usage(
            "the demo model needs a vocabulary".into(),
        ));
    }
    let h = demo_hparams(tok.tokens.len());
    let recipe = TypeRecipe::Q2;
    let mut header = model_header(&h, &recipe, DEMO_NAME, tok);
    for t in &mut header.tensors {
        if t.name == ds4_model::GlobalTensor::TokenEmbd.name()
            || t.name == ds4_model::GlobalTensor::Output.name()
        {
            t.ty = GgmlType::Iq2Xxs;
        }
    }
    header.metadata.push((
        RANDOM_WEIGHTS_NOTE_KEY.to_string(),
        Value::String(DEMO_NOTE.into()),
    ));
    SyntheticModel::from_header(h, recipe, DEMO_SEED, header)
}
