//! `ModelSpec`: validated hyper-parameters plus the bound tensor table.

use std::collections::HashMap;

use ds4_gguf::{GgmlType, Header, TensorInfo};
use serde::Serialize;

use crate::catalogue::{expected_tensors, ExpectedTensor, TensorClass};
use crate::error::{ModelError, Problem};
use crate::hparams::{self, flash_schedule, HParams, ARCH_PREFIX};
use crate::names::LayerTensor;

/// How strictly to validate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Strictness {
    /// ds4's rules: the real Flash dimensions and ds4's exact tensor types.
    Ds4,
    /// Any dimensions, as long as metadata and tensor table are consistent in ds4's layout;
    /// matrix tensors may use any supported type. For tiny test models and F32 conversions.
    Layout,
    /// `Ds4` when the file claims the real Flash size (43 layers, 4096 hidden), else `Layout`.
    Auto,
}

/// A tensor of the catalogue bound to its record in the file.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BoundTensor {
    pub expected: ExpectedTensor,
    #[serde(serialize_with = "ser_type")]
    pub ty: GgmlType,
    /// Index into the header's tensor table.
    pub index: usize,
    pub offset: u64,
    pub n_bytes: u64,
}

fn ser_type<S: serde::Serializer>(t: &GgmlType, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&t.name())
}

/// A validated model description.
#[derive(Debug, Clone, Serialize)]
pub struct ModelSpec {
    pub hparams: HParams,
    pub strictness: Strictness,
    /// Every catalogue tensor that is present, in catalogue order.
    pub tensors: Vec<BoundTensor>,
    #[serde(skip)]
    by_name: HashMap<String, usize>,
}

impl ModelSpec {
    /// Validates `header` and binds its tensors. All problems are reported together.
    pub fn from_header(header: &Header, strictness: Strictness) -> Result<ModelSpec, ModelError> {
        let mut problems = Vec::new();
        check_tokenizer(header, &mut problems);
        let hp = hparams::read(header, &mut problems);
        if !problems.is_empty() {
            return Err(ModelError::Invalid(problems));
        }
        let strictness = match strictness {
            Strictness::Auto if hp.n_layer == 43 && hp.n_embd == 4096 => Strictness::Ds4,
            Strictness::Auto => Strictness::Layout,
            s => s,
        };
        match strictness {
            Strictness::Ds4 => check_flash_values(&hp, &mut problems),
            _ => check_consistency(&hp, &mut problems),
        }
        if !problems.is_empty() {
            return Err(ModelError::Invalid(problems));
        }
        let strict = strictness == Strictness::Ds4;
        let index: HashMap<&str, (usize, &TensorInfo)> = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.as_str(), (i, t)))
            .collect();
        let mut tensors = Vec::new();
        for exp in expected_tensors(&hp) {
            let Some(&(i, t)) = index.get(exp.name.as_str()) else {
                if !exp.optional {
                    problems.push(Problem::MissingTensor {
                        name: exp.name.clone(),
                    });
                }
                continue;
            };
            if t.dims != exp.dims {
                problems.push(Problem::TensorDims {
                    name: exp.name.clone(),
                    expected: exp.dims.clone(),
                    found: t.dims.clone(),
                });
            }
            let ok = exp.rule.accepted(strict);
            if !ok.contains(&t.ty) {
                problems.push(Problem::TensorType {
                    name: exp.name.clone(),
                    expected: ok.iter().map(|t| t.name()).collect::<Vec<_>>().join(" or "),
                    found: t.ty.name(),
                });
            } else if t.ty.row_bytes(t.dims[0]).is_none() {
                problems.push(Problem::TensorType {
                    name: exp.name.clone(),
                    expected: format!("a type whose block divides ne0 = {}", t.dims[0]),
                    found: t.ty.name(),
                });
            }
            tensors.push(BoundTensor {
                ty: t.ty,
                index: i,
                offset: t.offset,
                n_bytes: t.n_bytes().unwrap_or(0),
                expected: exp,
            });
        }
        let by_name: HashMap<String, usize> = tensors
            .iter()
            .enumerate()
            .map(|(i, b)| (b.expected.name.clone(), i))
            .collect();
        for il in 0..hp.n_layer {
            let ty = |t: LayerTensor| by_name.get(&t.name(il)).map(|&i| tensors[i].ty);
            if let (Some(g), Some(u)) = (ty(LayerTensor::GateExps), ty(LayerTensor::UpExps)) {
                if g != u {
                    problems.push(Problem::GateUpMismatch {
                        layer: il,
                        gate: g.name(),
                        up: u.name(),
                    });
                }
            }
        }
        if !problems.is_empty() {
            return Err(ModelError::Invalid(problems));
        }
        Ok(ModelSpec {
            hparams: hp,
            strictness,
            tensors,
            by_name,
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&BoundTensor> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// A layer's tensor, e.g. `layer_tensor(3, LayerTensor::AttnQA)`.
    pub fn layer_tensor(&self, layer: usize, t: LayerTensor) -> Option<&BoundTensor> {
        self.tensor(&t.name(layer))
    }

    /// "Routed quant bits" as ds4 reports it: 4 if layer-0 gate is Q4_K or MXFP4 (4-bit
    /// codes; both spend a little more per value on scales), else 2.
    pub fn routed_bits(&self) -> u32 {
        match self.layer_tensor(0, LayerTensor::GateExps).map(|t| t.ty) {
            Some(GgmlType::Q4K | GgmlType::Mxfp4) => 4,
            _ => 2,
        }
    }

    /// Total payload bytes per class.
    pub fn bytes_by_class(&self) -> Vec<(TensorClass, u64, usize)> {
        TensorClass::ALL
            .iter()
            .map(|&c| {
                let ts = self.tensors.iter().filter(|t| t.expected.class == c);
                let (b, n) = ts.fold((0, 0), |(b, n), t| (b + t.n_bytes, n + 1));
                (c, b, n)
            })
            .collect()
    }
}

const SPECIAL_TOKENS: [&str; 7] = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
];

/// ds4's tokenizer checks: string arrays `tokens` and `merges`, and the 7 special strings.
fn check_tokenizer(h: &Header, problems: &mut Vec<Problem>) {
    for key in ["tokenizer.ggml.tokens", "tokenizer.ggml.merges"] {
        match h.get(key) {
            None => problems.push(Problem::MissingKey { key: key.into() }),
            Some(v) => {
                let ok = v
                    .as_array()
                    .is_some_and(|a| a.elem_type() == ds4_gguf::ValueType::String);
                if !ok {
                    problems.push(Problem::KeyType {
                        key: key.into(),
                        expected: "array of string".into(),
                        found: v.value_type().to_string(),
                    });
                } else if key.ends_with("tokens") {
                    let a = v.as_array();
                    for s in SPECIAL_TOKENS {
                        if !a.is_some_and(|a| a.iter().any(|t| t.as_str() == Some(s))) {
                            problems.push(Problem::Inconsistent {
                                what: format!("tokenizer.ggml.tokens lacks the special token {s}"),
                            });
                        }
                    }
                }
            }
        }
    }
}

fn key(k: &str) -> String {
    format!("{ARCH_PREFIX}{k}")
}

/// ds4 hardcodes the Flash dims: each must match exactly (floats within 1e-6 relative).
fn check_flash_values(h: &HParams, problems: &mut Vec<Problem>) {
    let f = HParams::flash();
    let mut ints = |k: &str, got: usize, want: usize| {
        if got != want {
            problems.push(Problem::KeyValue {
                key: key(k),
                expected: want.to_string(),
                found: got.to_string(),
            });
        }
    };
    ints("block_count", h.n_layer, f.n_layer);
    ints("embedding_length", h.n_embd, f.n_embd);
    ints("attention.head_count", h.n_head, f.n_head);
    ints("attention.head_count_kv", h.n_head_kv, f.n_head_kv);
    ints("attention.key_length", h.head_dim, f.head_dim);
    ints("rope.dimension_count", h.rope_dim, f.rope_dim);
    ints("attention.q_lora_rank", h.q_lora_rank, f.q_lora_rank);
    ints("attention.output_lora_rank", h.o_lora_rank, f.o_lora_rank);
    ints("attention.output_group_count", h.o_groups, f.o_groups);
    ints("vocab_size", h.n_vocab, f.n_vocab);
    ints("expert_count", h.n_expert, f.n_expert);
    ints("expert_used_count", h.n_expert_used, f.n_expert_used);
    ints("expert_shared_count", h.n_expert_shared, f.n_expert_shared);
    ints("expert_feed_forward_length", h.expert_ff, f.expert_ff);
    ints("hash_layer_count", h.hash_layer_count, f.hash_layer_count);
    ints(
        "attention.sliding_window",
        h.sliding_window,
        f.sliding_window,
    );
    ints(
        "attention.indexer.head_count",
        h.indexer_heads,
        f.indexer_heads,
    );
    ints(
        "attention.indexer.key_length",
        h.indexer_head_dim,
        f.indexer_head_dim,
    );
    ints("attention.indexer.top_k", h.indexer_top_k, f.indexer_top_k);
    ints("hyper_connection.count", h.hc_mult, f.hc_mult);
    ints(
        "hyper_connection.sinkhorn_iterations",
        h.hc_sinkhorn_iters,
        f.hc_sinkhorn_iters,
    );
    ints(
        "rope.scaling.original_context_length",
        h.yarn.original_context as usize,
        f.yarn.original_context as usize,
    );
    let mut floats = |k: &str, got: f32, want: f32| {
        if ((got - want) / want).abs() > 1e-6 || got.is_nan() {
            problems.push(Problem::KeyValue {
                key: key(k),
                expected: want.to_string(),
                found: got.to_string(),
            });
        }
    };
    floats(
        "expert_weights_scale",
        h.expert_weights_scale,
        f.expert_weights_scale,
    );
    floats("hyper_connection.epsilon", h.hc_eps, f.hc_eps);
    floats("attention.layer_norm_rms_epsilon", h.rms_eps, f.rms_eps);
    floats("rope.freq_base", h.rope_freq_base, f.rope_freq_base);
    floats(
        "attention.compress_rope_freq_base",
        h.compress_rope_freq_base,
        f.compress_rope_freq_base,
    );
    floats("rope.scaling.factor", h.yarn.factor, f.yarn.factor);
    floats(
        "rope.scaling.yarn_beta_fast",
        h.yarn.beta_fast,
        f.yarn.beta_fast,
    );
    floats(
        "rope.scaling.yarn_beta_slow",
        h.yarn.beta_slow,
        f.yarn.beta_slow,
    );
    if h.compress_ratios != flash_schedule(f.n_layer) {
        problems.push(Problem::KeyValue {
            key: key("attention.compress_ratios"),
            expected: "0,0 then 4 on even and 128 on odd layers".into(),
            found: format!("{:?}", h.compress_ratios),
        });
    }
    if let Some((il, c)) = h.swiglu_clamp.iter().enumerate().find(|(_, c)| **c != 10.0) {
        problems.push(Problem::KeyValue {
            key: key("swiglu_clamp_exp"),
            expected: "10.0 for every layer".into(),
            found: format!("{c} at layer {il}"),
        });
    }
    if !h.expert_weights_norm {
        problems.push(Problem::KeyValue {
            key: key("expert_weights_norm"),
            expected: "true".into(),
            found: "false".into(),
        });
    }
}

/// Rules any model must satisfy for the forward pass to be well defined.
fn check_consistency(h: &HParams, problems: &mut Vec<Problem>) {
    let mut need = |ok: bool, what: String| {
        if !ok {
            problems.push(Problem::Inconsistent { what });
        }
    };
    let dims = [
        ("block_count", h.n_layer),
        ("embedding_length", h.n_embd),
        ("attention.head_count", h.n_head),
        ("attention.key_length", h.head_dim),
        ("attention.q_lora_rank", h.q_lora_rank),
        ("attention.output_lora_rank", h.o_lora_rank),
        ("attention.output_group_count", h.o_groups),
        ("vocab_size", h.n_vocab),
        ("expert_count", h.n_expert),
        ("expert_used_count", h.n_expert_used),
        ("expert_feed_forward_length", h.expert_ff),
        ("attention.sliding_window", h.sliding_window),
        ("hyper_connection.count", h.hc_mult),
        ("hyper_connection.sinkhorn_iterations", h.hc_sinkhorn_iters),
    ];
    for (k, v) in dims {
        need(v > 0, format!("{} must be positive, found {v}", key(k)));
    }
    need(
        h.n_head_kv == 1,
        format!(
            "{} must be 1 (shared K=V head), found {}",
            key("attention.head_count_kv"),
            h.n_head_kv
        ),
    );
    need(
        h.n_expert_shared == 1,
        format!(
            "{} must be 1, found {}",
            key("expert_shared_count"),
            h.n_expert_shared
        ),
    );
    need(
        h.rope_dim.is_multiple_of(2) && h.rope_dim <= h.head_dim,
        format!(
            "rope.dimension_count {} must be even and at most the head dim {}",
            h.rope_dim, h.head_dim
        ),
    );
    need(
        h.o_groups > 0
            && (h.n_head * h.head_dim).is_multiple_of(h.o_groups)
            && h.n_head.is_multiple_of(h.o_groups),
        format!(
            "head_count {} must be divisible by output_group_count {}",
            h.n_head, h.o_groups
        ),
    );
    need(
        h.n_expert_used <= h.n_expert,
        format!(
            "expert_used_count {} exceeds expert_count {}",
            h.n_expert_used, h.n_expert
        ),
    );
    need(
        h.hash_layer_count <= h.n_layer,
        format!(
            "hash_layer_count {} exceeds block_count {}",
            h.hash_layer_count, h.n_layer
        ),
    );
    need(
        h.expert_weights_norm,
        format!("{} must be true", key("expert_weights_norm")),
    );
    need(
        h.rms_eps > 0.0 && h.hc_eps > 0.0,
        "epsilons must be positive".into(),
    );
    need(
        h.rope_freq_base > 0.0 && h.compress_rope_freq_base > 0.0,
        "RoPE bases must be positive".into(),
    );
    need(
        h.swiglu_clamp.iter().all(|c| *c > 0.0),
        "swiglu_clamp_exp entries must be positive".into(),
    );
    for (il, &r) in h.compress_ratios.iter().enumerate() {
        need(
            r != 1,
            format!("compress ratio 1 at layer {il} is not a compression"),
        );
    }
    if h.compress_ratios.contains(&4) {
        need(
            h.indexer_heads > 0 && h.indexer_top_k > 0,
            "CSA layers need indexer head_count and top_k".into(),
        );
        need(
            h.indexer_head_dim >= h.rope_dim && h.indexer_head_dim.is_multiple_of(2),
            format!(
                "indexer key_length {} must be even and at least the rope dim {}",
                h.indexer_head_dim, h.rope_dim
            ),
        );
    }
    need(
        h.yarn.factor > 0.0 && h.yarn.original_context > 0,
        "YaRN factor and original context must be positive".into(),
    );
}
