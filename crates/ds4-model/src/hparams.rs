//! Hyper-parameters from `deepseek4.*` metadata, read with ds4's accepted types.

use ds4_gguf::{Elem, Header, Value};
use serde::Serialize;

use crate::error::Problem;

pub const ARCH_PREFIX: &str = "deepseek4.";

/// Attention flavour of a layer, from its compress ratio.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum AttnKind {
    /// Ratio 0: raw sliding window only.
    Sliding,
    /// Ratio 4: overlapping compressor plus the lightning indexer.
    Csa,
    /// Any other ratio: non-overlapping compressor, no indexer.
    Hca(u32),
}

/// YaRN parameters applied to the compressed layers' RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Yarn {
    pub factor: f32,
    pub original_context: u64,
    pub beta_fast: f32,
    pub beta_slow: f32,
}

/// Every dimension and constant the forward pass needs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HParams {
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub q_lora_rank: usize,
    pub o_lora_rank: usize,
    pub o_groups: usize,
    pub n_vocab: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub n_expert_shared: usize,
    pub expert_ff: usize,
    pub expert_weights_scale: f32,
    pub expert_weights_norm: bool,
    pub hash_layer_count: usize,
    /// Per-layer SwiGLU clamp limit (first `n_layer` entries).
    pub swiglu_clamp: Vec<f32>,
    pub sliding_window: usize,
    /// Per-layer compress ratio (first `n_layer` entries).
    pub compress_ratios: Vec<u32>,
    pub indexer_heads: usize,
    pub indexer_head_dim: usize,
    pub indexer_top_k: usize,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub rms_eps: f32,
    pub rope_freq_base: f32,
    pub compress_rope_freq_base: f32,
    pub yarn: Yarn,
    /// Trained context length, if the file says (informative).
    pub context_length: Option<u64>,
}

impl HParams {
    pub fn attn_kind(&self, layer: usize) -> AttnKind {
        match self.compress_ratios[layer] {
            0 => AttnKind::Sliding,
            4 => AttnKind::Csa,
            r => AttnKind::Hca(r),
        }
    }

    pub fn is_hash_layer(&self, layer: usize) -> bool {
        layer < self.hash_layer_count
    }

    /// Width of a layer's attention compressor output (2·D with overlap for CSA, D for HCA).
    pub fn compressor_width(&self, layer: usize) -> usize {
        match self.attn_kind(layer) {
            AttnKind::Sliding => 0,
            AttnKind::Csa => 2 * self.head_dim,
            AttnKind::Hca(_) => self.head_dim,
        }
    }

    /// `2M + M²`: pre, post and comb rows of an mHC mixing matrix.
    pub fn hc_mix(&self) -> usize {
        2 * self.hc_mult + self.hc_mult * self.hc_mult
    }

    /// The real DeepSeek V4 Flash values, as ds4 hardcodes them.
    pub fn flash() -> HParams {
        let n_layer = 43;
        HParams {
            n_layer,
            n_embd: 4096,
            n_head: 64,
            n_head_kv: 1,
            head_dim: 512,
            rope_dim: 64,
            q_lora_rank: 1024,
            o_lora_rank: 1024,
            o_groups: 8,
            n_vocab: 129_280,
            n_expert: 256,
            n_expert_used: 6,
            n_expert_shared: 1,
            expert_ff: 2048,
            expert_weights_scale: 1.5,
            expert_weights_norm: true,
            hash_layer_count: 3,
            swiglu_clamp: vec![10.0; n_layer],
            sliding_window: 128,
            compress_ratios: flash_schedule(n_layer),
            indexer_heads: 64,
            indexer_head_dim: 128,
            indexer_top_k: 512,
            hc_mult: 4,
            hc_sinkhorn_iters: 20,
            hc_eps: 1e-6,
            rms_eps: 1e-6,
            rope_freq_base: 10_000.0,
            compress_rope_freq_base: 160_000.0,
            yarn: Yarn {
                factor: 16.0,
                original_context: 65_536,
                beta_fast: 32.0,
                beta_slow: 1.0,
            },
            context_length: Some(1_048_576),
        }
    }
}

/// ds4's layer schedule: 0, 0, then 4 on even and 128 on odd layers.
pub fn flash_schedule(n_layer: usize) -> Vec<u32> {
    (0..n_layer)
        .map(|il| match il {
            0 | 1 => 0,
            il if il % 2 == 0 => 4,
            _ => 128,
        })
        .collect()
}

/// Reads keys, recording a [`Problem`] for each missing or mistyped one.
pub(crate) struct KeyReader<'a> {
    pub header: &'a Header,
    pub problems: Vec<Problem>,
}

fn type_name(v: &Value) -> String {
    match v {
        Value::Array(a) => format!("array of {}", a.elem_type()),
        other => other.value_type().to_string(),
    }
}

impl<'a> KeyReader<'a> {
    fn get(&mut self, key: &str) -> Option<&'a Value> {
        let full = format!("{ARCH_PREFIX}{key}");
        let v = self.header.get(&full);
        if v.is_none() {
            self.problems.push(Problem::MissingKey { key: full });
        }
        v
    }

    fn wrong(&mut self, key: &str, expected: &str, v: &Value) {
        self.problems.push(Problem::KeyType {
            key: format!("{ARCH_PREFIX}{key}"),
            expected: expected.into(),
            found: type_name(v),
        });
    }

    /// A u32 key (ds4 accepts only u32 for dimensions).
    pub fn u32(&mut self, key: &str) -> usize {
        match self.get(key) {
            Some(Value::U32(v)) => *v as usize,
            Some(v) => {
                self.wrong(key, "u32", v);
                0
            }
            None => 0,
        }
    }

    /// u32 or u64.
    pub fn u32_or_u64(&mut self, key: &str) -> u64 {
        match self.get(key) {
            Some(Value::U32(v)) => u64::from(*v),
            Some(Value::U64(v)) => *v,
            Some(v) => {
                self.wrong(key, "u32 or u64", v);
                0
            }
            None => 0,
        }
    }

    /// ds4's "float-ish": f32, f64, u32 or i32.
    pub fn float(&mut self, key: &str) -> f32 {
        match self.get(key) {
            Some(v @ (Value::F32(_) | Value::F64(_) | Value::U32(_) | Value::I32(_))) => {
                v.as_f64_lenient().unwrap_or(0.0) as f32
            }
            Some(v) => {
                self.wrong(key, "f32, f64, u32 or i32", v);
                0.0
            }
            None => 0.0,
        }
    }

    pub fn bool(&mut self, key: &str) -> bool {
        match self.get(key) {
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                self.wrong(key, "bool", v);
                false
            }
            None => false,
        }
    }

    /// An array of non-negative i32/u32 with at least `min_len` entries; first `min_len` kept.
    pub fn uint_array(&mut self, key: &str, min_len: usize) -> Vec<u32> {
        let Some(v) = self.get(key) else {
            return vec![0; min_len];
        };
        let out: Option<Vec<u32>> = v.as_array().and_then(|a| {
            a.iter()
                .map(|e| match e {
                    Elem::I32(x) => u32::try_from(x).ok(),
                    Elem::U32(x) => Some(x),
                    _ => None,
                })
                .collect()
        });
        match out {
            Some(xs) if xs.len() >= min_len => xs[..min_len].to_vec(),
            Some(xs) => {
                self.problems.push(Problem::KeyValue {
                    key: format!("{ARCH_PREFIX}{key}"),
                    expected: format!("at least {min_len} entries"),
                    found: format!("{} entries", xs.len()),
                });
                vec![0; min_len]
            }
            None => {
                self.wrong(key, "array of non-negative i32 or u32", v);
                vec![0; min_len]
            }
        }
    }

    pub fn float_array(&mut self, key: &str, min_len: usize) -> Vec<f32> {
        let Some(v) = self.get(key) else {
            return vec![0.0; min_len];
        };
        let out: Option<Vec<f32>> = v.as_array().and_then(|a| {
            a.iter()
                .map(|e| match e {
                    Elem::F32(x) => Some(x),
                    Elem::F64(x) => Some(x as f32),
                    _ => None,
                })
                .collect()
        });
        match out {
            Some(xs) if xs.len() >= min_len => xs[..min_len].to_vec(),
            Some(xs) => {
                self.problems.push(Problem::KeyValue {
                    key: format!("{ARCH_PREFIX}{key}"),
                    expected: format!("at least {min_len} entries"),
                    found: format!("{} entries", xs.len()),
                });
                vec![0.0; min_len]
            }
            None => {
                self.wrong(key, "array of f32 or f64", v);
                vec![0.0; min_len]
            }
        }
    }

    /// Optional u32 that must be 0 when present (expert group counts).
    pub fn absent_or_zero(&mut self, key: &str) {
        let full = format!("{ARCH_PREFIX}{key}");
        if let Some(v) = self.header.get(&full) {
            if v.as_int() != Some(0) {
                self.problems.push(Problem::KeyValue {
                    key: full,
                    expected: "absent or 0".into(),
                    found: v.display_short(4),
                });
            }
        }
    }
}

/// Reads every required key. Problems are appended; the returned values are only
/// meaningful when no problem was recorded.
pub(crate) fn read(header: &Header, problems: &mut Vec<Problem>) -> HParams {
    let mut r = KeyReader {
        header,
        problems: Vec::new(),
    };
    let n_layer = r.u32("block_count");
    // Bound by something sane before sizing per-layer vectors: a layer needs >= 24 tensors.
    let n_layer_safe = n_layer.min(header.tensors.len() / 24 + 1).min(4096);
    if n_layer != n_layer_safe {
        r.problems.push(Problem::KeyValue {
            key: format!("{ARCH_PREFIX}block_count"),
            expected: format!(
                "at most {} (the tensor table has {} tensors)",
                n_layer_safe,
                header.tensors.len()
            ),
            found: n_layer.to_string(),
        });
    }
    let n_layer = n_layer_safe;
    let h = HParams {
        n_layer,
        n_embd: r.u32("embedding_length"),
        n_head: r.u32("attention.head_count"),
        n_head_kv: r.u32("attention.head_count_kv"),
        head_dim: r.u32("attention.key_length"),
        rope_dim: r.u32("rope.dimension_count"),
        q_lora_rank: r.u32("attention.q_lora_rank"),
        o_lora_rank: r.u32("attention.output_lora_rank"),
        o_groups: r.u32("attention.output_group_count"),
        n_vocab: r.u32("vocab_size"),
        n_expert: r.u32("expert_count"),
        n_expert_used: r.u32("expert_used_count"),
        n_expert_shared: r.u32("expert_shared_count"),
        expert_ff: r.u32("expert_feed_forward_length"),
        expert_weights_scale: r.float("expert_weights_scale"),
        expert_weights_norm: r.bool("expert_weights_norm"),
        hash_layer_count: r.u32("hash_layer_count"),
        swiglu_clamp: r.float_array("swiglu_clamp_exp", n_layer),
        sliding_window: r.u32("attention.sliding_window"),
        compress_ratios: r.uint_array("attention.compress_ratios", n_layer),
        indexer_heads: r.u32("attention.indexer.head_count"),
        indexer_head_dim: r.u32("attention.indexer.key_length"),
        indexer_top_k: r.u32("attention.indexer.top_k"),
        hc_mult: r.u32("hyper_connection.count"),
        hc_sinkhorn_iters: r.u32("hyper_connection.sinkhorn_iterations"),
        hc_eps: r.float("hyper_connection.epsilon"),
        rms_eps: r.float("attention.layer_norm_rms_epsilon"),
        rope_freq_base: r.float("rope.freq_base"),
        compress_rope_freq_base: r.float("attention.compress_rope_freq_base"),
        yarn: Yarn {
            factor: r.float("rope.scaling.factor"),
            original_context: r.u32_or_u64("rope.scaling.original_context_length"),
            beta_fast: r.float("rope.scaling.yarn_beta_fast"),
            beta_slow: r.float("rope.scaling.yarn_beta_slow"),
        },
        context_length: header
            .get(&format!("{ARCH_PREFIX}context_length"))
            .and_then(|v| v.as_int())
            .and_then(|v| u64::try_from(v).ok()),
    };
    let v_key = r.u32("attention.value_length");
    if v_key != h.head_dim && r.problems.is_empty() {
        r.problems.push(Problem::KeyValue {
            key: format!("{ARCH_PREFIX}attention.value_length"),
            expected: format!("{} (= key_length: K and V share one head)", h.head_dim),
            found: v_key.to_string(),
        });
    }
    r.absent_or_zero("expert_group_count");
    r.absent_or_zero("expert_group_used_count");
    problems.append(&mut r.problems);
    h
}
