//! The multi-token-prediction (MTP) block's tensors (docs/gguf.md §4.7): what they must be,
//! checked against a file's header before an engine loads them.
//!
//! The block sits either in the main file or in ds4's sidecar (`OUT-mtp.gguf`). Its
//! dimensions come from the main model's metadata (the sidecar carries none, docs/gguf.md
//! §3.5), so the check takes the main model's [`HParams`].

use ds4_gguf::{GgmlType, Header};

use crate::catalogue::{TypeRule, MATRIX_TYPES};
use crate::error::{ModelError, Problem};
use crate::hparams::HParams;
use crate::layout::mtp_tensor_table;
use crate::names::{LayerTensor, TensorName};

/// The storage family of an MTP tensor under the same rules as the main model's
/// ([`TypeRule`]), except that the sidecar keeps its HC mixers and router in F32 where the
/// main model keeps F16 (docs/gguf.md §4.7), so both are accepted for those at ds4's
/// strictness.
fn rule(t: LayerTensor) -> TypeRule {
    use LayerTensor::*;
    match t {
        MtpHcHeadFn | HcAttnFn | HcFfnFn | RouterGate => TypeRule::Plain,
        GateExps | UpExps | DownExps => TypeRule::Routed,
        AttnQA | AttnQB | AttnKv | AttnOutputA | AttnOutputB | GateShexp | UpShexp | DownShexp
        | MtpEProj | MtpHProj => TypeRule::Q8,
        _ => TypeRule::Vector,
    }
}

fn accepted(t: LayerTensor, strict: bool) -> &'static [GgmlType] {
    match (rule(t), strict) {
        (TypeRule::Plain, true) => &[GgmlType::F16, GgmlType::F32],
        (TypeRule::Plain | TypeRule::Q8 | TypeRule::Routed, false) => &MATRIX_TYPES,
        (r, s) => r.accepted(s),
    }
}

/// Checks the 32 `mtp.0.*` tensors of `header` against the main model `hp`: each present,
/// with the exact dims and an accepted type (`strict`: ds4's types), gate and up of the
/// routed experts of one type. Every problem is reported, each naming its tensor.
pub fn validate_mtp(header: &Header, hp: &HParams, strict: bool) -> Result<(), ModelError> {
    let mut problems = Vec::new();
    let mut routed = Vec::new();
    for exp in mtp_tensor_table(hp) {
        let Some(TensorName::Mtp(0, t)) = TensorName::parse(&exp.name) else {
            continue;
        };
        let Some(found) = header.tensors.iter().find(|x| x.name == exp.name) else {
            problems.push(Problem::MissingTensor { name: exp.name });
            continue;
        };
        if found.dims != exp.dims {
            problems.push(Problem::TensorDims {
                name: exp.name.clone(),
                expected: exp.dims.clone(),
                found: found.dims.clone(),
            });
        }
        let ok = accepted(t, strict);
        if !ok.contains(&found.ty) {
            problems.push(Problem::TensorType {
                name: exp.name.clone(),
                expected: ok.iter().map(|t| t.name()).collect::<Vec<_>>().join(" or "),
                found: found.ty.name(),
            });
        } else if found.ty.row_bytes(found.dims[0]).is_none() {
            problems.push(Problem::TensorType {
                name: exp.name.clone(),
                expected: format!("a type whose block divides ne0 = {}", found.dims[0]),
                found: found.ty.name(),
            });
        }
        if matches!(t, LayerTensor::GateExps | LayerTensor::UpExps) {
            routed.push(found.ty);
        }
    }
    if let [g, u] = routed[..] {
        if g != u {
            problems.push(Problem::Inconsistent {
                what: format!(
                    "mtp.0.ffn_gate_exps.weight is {} but mtp.0.ffn_up_exps.weight is {}",
                    g.name(),
                    u.name()
                ),
            });
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ModelError::Invalid(problems))
    }
}

/// Whether `header` holds an MTP block at all (any `mtp.0.*` tensor), so a main file that
/// carries one is recognised without a `--mtp` file.
pub fn has_mtp(header: &Header) -> bool {
    header
        .tensors
        .iter()
        .any(|t| matches!(TensorName::parse(&t.name), Some(TensorName::Mtp(0, _))))
}

/// The main model's hparams reduced to the MTP block: one window-only layer with the
/// plain RoPE base (docs/forward.md §2.3), biased top-k routing, the last layer's clamp.
/// The engine runs the block as a one-layer model of these, and the planner sizes its
/// state from them ([`state_bytes`]).
pub fn block_hparams(main: &HParams) -> HParams {
    let mut hp = main.clone();
    hp.n_layer = 1;
    hp.compress_ratios = vec![0];
    hp.hash_layer_count = 0;
    hp.swiglu_clamp = vec![main.swiglu_clamp.last().copied().unwrap_or(0.0)];
    hp
}

/// The block's session memory in bytes at context `ctx` and prefill chunk
/// `prefill_chunk`, as the engine allocates it (`ds4_engine`'s `Mtp::load`): its KV state
/// (one sliding-window ring, [`crate::kv::kv_fixed_bytes`] of [`block_hparams`]), its
/// scratch for a chunk of at most a window of rows ([`crate::kv::scratch_estimate`]), the
/// ring of the main model's final streams of the last `window` positions, two row
/// buffers of a chunk of streams, and the undo rows of its ring. On Flash (window 128,
/// chunk 2048) 122 MiB, most of it scratch.
pub fn state_bytes(main: &HParams, ctx: u64, prefill_chunk: u64) -> u64 {
    let hp = block_hparams(main);
    let win = hp.sliding_window as u64;
    let cap = prefill_chunk.min(win).max(1);
    let xw = (hp.hc_mult * hp.n_embd) as u64;
    let kv = crate::kv::kv_fixed_bytes(&hp)
        + crate::kv::kv_bytes_per_token_x(&hp, ctx)
            .saturating_sub(crate::kv::kv_bytes_per_token_x(&hp, 0));
    let scratch = crate::kv::scratch_estimate(&hp, ctx, cap);
    let rows = (win * xw + 2 * cap * xw + win * hp.head_dim as u64) * crate::kv::KV_ELEM_BYTES;
    kv.saturating_add(scratch).saturating_add(rows)
}
