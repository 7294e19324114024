//! Whole-model logit parity (`ds4-engine-check parity`): one model and token sequence through
//! all-at-once prefill, token-by-token decode and chunked prefill on a candidate backend and
//! on a reference backend (the CPU engine), compared path by path.
//!
//! Why two judgments. Exact mode is continuous, so one tolerance fits ([`TOL_EXACT`], the
//! CPU-vs-HF tolerance of docs/forward.md §9.5). Official mode's FP8/FP4 simulations are not:
//! a last-bit difference next to a rounding boundary becomes a whole grid step that every
//! later position reads, so a correct backend with its own f32 arithmetic order can leave the
//! CPU engine by far more than f32 noise (a fixed 1e-3 failed 2 of 10 GPU runs with 5.8e-2 on
//! a random tiny q2 model, issue 18). Official mode is therefore judged like the GPU against
//! the fixtures' reference: [`crate::refcheck::Reordered`] over every official-mode
//! sequence-path of the run, with the CPU engine's logits as the reference and their own
//! top-1/top-2 gaps ([`crate::refcheck::compare_runs`]).
//!
//! Two choices make that bound usable here. Official-mode sequences have at least
//! [`OFFICIAL_MIN_TOKENS`] tokens, so each is judged on a full first-100 prefix under the
//! one-third allowance (a shorter sequence-path must be clean, so one flip would fail the run,
//! which is the fixed tolerance's problem again). And each path gets its own tokens, so a
//! flip in one path does not take the other two with it: with `--tiny 2` the run has six
//! independent sequence-paths, of which two must be clean.

use std::sync::Arc;

use ds4_engine::{Backend, Engine, EngineConfig, EngineError, Logits, NumericMode};
use ds4_gguf::GgufFile;
use ds4_model::HParams;

use crate::refcheck;

/// Exact mode: [`crate::mirror::rel_err`] (max |candidate − reference| / max |reference|) of a path.
pub const TOL_EXACT: f64 = 1e-4;
/// The three paths, in the order [`eval_path`] numbers them.
pub const PATHS: [&str; 3] = ["prefill", "decode", "chunked"];
/// Prefill chunk of the `chunked` path.
pub const CHUNK: usize = 5;
/// Official mode: the shortest sequence judged (see the module comment).
pub const OFFICIAL_MIN_TOKENS: usize = refcheck::PREFIX;

/// Small dims that reach every path: window roll-over, CSA selection with scoring, HCA,
/// hash and top-k routing, K-quant blocks (256-multiples), partial FP8 blocks.
pub fn tiny_hparams() -> HParams {
    let n_layer = 4;
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
        hash_layer_count: 2,
        swiglu_clamp: vec![10.0; n_layer],
        sliding_window: 8,
        compress_ratios: vec![0, 0, 4, 16],
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

/// Logits (`[T, vocab]`) of one path (index into [`PATHS`]) on `backend`: prefill of all
/// tokens at once, one token per call, or chunks of [`CHUNK`].
pub fn eval_path(
    file: &Arc<GgufFile>,
    mode: NumericMode,
    toks: &[u32],
    path: usize,
    backend: Box<dyn Backend>,
) -> Result<Vec<f32>, EngineError> {
    let chunk = match path {
        0 => toks.len().max(1),
        1 => 1,
        2 => CHUNK,
        _ => return Err(EngineError::Config(format!("no parity path {path}"))),
    };
    let cfg = EngineConfig {
        mode: Some(mode),
        ctx: 4096,
        prefill_chunk: chunk,
    };
    let mut eng = Engine::load(file.clone(), backend, cfg)?;
    let mut st = eng.new_state()?;
    if path == 1 {
        let mut all = Vec::with_capacity(toks.len() * eng.hparams().n_vocab);
        for t in toks {
            all.extend(eng.eval(&mut st, std::slice::from_ref(t), Logits::Last, None)?);
        }
        Ok(all)
    } else {
        eng.eval(&mut st, toks, Logits::All, None)
    }
}

/// Judges one official-mode path and adds it to `pooled`; returns its errors and whether its
/// prefix is clean (the run's verdict is `pooled.verdict()`).
pub fn add_official(
    pooled: &mut refcheck::Reordered,
    got: &[f32],
    want: &[f32],
    vocab: usize,
) -> Result<(refcheck::SeqErrors, Result<(), String>), String> {
    let e = refcheck::compare_runs(got, want, vocab)?;
    let clean = pooled.add(&e);
    Ok((e, clean))
}
