//! Builds tiny DeepSeek V4 checkpoints on disk, written from the spec's name table
//! (docs/gguf.md §5.3) independently of the converter's own mapping code.
#![allow(dead_code)]

use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// Tiny dims that still allow every ds4 type: E and F multiples of 256, Q8_0 dims of 32.
pub struct Dims {
    pub e: usize,
    pub v: usize,
    pub h: usize,
    pub d: usize,
    pub r: usize,
    pub q: usize,
    pub g: usize,
    pub o: usize,
    pub n: usize,
    pub k: usize,
    pub f: usize,
    pub m: usize,
    pub ih: usize,
    pub id: usize,
    pub ratios: Vec<usize>,
    pub hash: usize,
}

pub fn dims() -> Dims {
    Dims {
        e: 256,
        v: 300,
        h: 4,
        d: 64,
        r: 16,
        q: 64,
        g: 2,
        o: 32,
        n: 4,
        k: 2,
        f: 256,
        m: 4,
        ih: 4,
        id: 32,
        ratios: vec![0, 0, 4, 16],
        hash: 2,
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Naming {
    /// (a) official DeepSeek.
    Official,
    /// (c) transformers save_pretrained.
    Saved,
    /// (b) transformers module names with packed experts.
    Module,
}

/// One source tensor: checkpoint name, PyTorch shape, GGUF name it must end up in and, for
/// experts, which expert slot (and, for the packed form, nothing: handled separately).
#[derive(Clone, Debug)]
pub struct Src {
    pub name: String,
    pub shape: Vec<usize>,
    pub gguf: String,
    pub expert: Option<usize>,
    pub int: bool,
}

pub fn config_json(d: &Dims) -> serde_json::Value {
    let layer_types: Vec<&str> = d
        .ratios
        .iter()
        .map(|r| match r {
            0 => "sliding_attention",
            4 => "compressed_sparse_attention",
            _ => "heavily_compressed_attention",
        })
        .collect();
    let hca = d.ratios.iter().copied().find(|&r| r > 4).unwrap_or(128);
    let mlp: Vec<&str> = (0..d.ratios.len())
        .map(|i| if i < d.hash { "hash_moe" } else { "moe" })
        .collect();
    let mut c = serde_json::json!({
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": d.v, "hidden_size": d.e, "moe_intermediate_size": d.f,
        "num_hidden_layers": d.ratios.len(), "num_attention_heads": d.h, "num_key_value_heads": 1,
        "head_dim": d.d, "q_lora_rank": d.q, "num_experts_per_tok": d.k, "n_routed_experts": d.n,
        "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "norm_topk_prob": true,
        "routed_scaling_factor": 1.5, "max_position_embeddings": 1048576, "rope_theta": 10000.0,
        "layer_types": layer_types,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": hca},
        "compress_rope_theta": 160000.0, "hc_mult": d.m, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6
    });
    let more = serde_json::json!({
        "mlp_layer_types": mlp, "swiglu_limit": 10.0, "sliding_window": 16, "o_groups": d.g,
        "o_lora_rank": d.o, "index_n_heads": d.ih, "index_head_dim": d.id, "index_topk": 4,
        "num_nextn_predict_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "tie_word_embeddings": false, "partial_rotary_factor": d.r as f64 / d.d as f64,
        "qk_rope_head_dim": d.r
    });
    let rope = serde_json::json!({
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0,
                     "original_max_position_embeddings": 65536, "beta_fast": 32.0,
                     "beta_slow": 1.0, "attention_factor": 1.0, "partial_rotary_factor": 0.25}
    });
    let obj = c.as_object_mut().unwrap();
    obj.extend(more.as_object().unwrap().clone());
    obj.insert("rope_parameters".into(), rope);
    c
}

/// The tensors of a checkpoint, from docs/gguf.md §5.3 (column "checkpoint key (a)/(c)" or "(b)").
pub fn tensors(d: &Dims, naming: Naming) -> Vec<Src> {
    let mut out = Vec::new();
    let p = match naming {
        Naming::Official => "",
        _ => "model.",
    };
    macro_rules! add {
        ($name:expr, $shape:expr, $gguf:expr, $int:expr $(,)?) => {
            out.push(Src {
                name: $name,
                shape: $shape,
                gguf: ($gguf).to_string(),
                expert: None,
                int: $int,
            })
        };
    }
    let (e, m) = (d.e, d.m);
    match naming {
        Naming::Official => {
            add!(
                "embed.weight".into(),
                vec![d.v, e],
                "token_embd.weight",
                false
            );
            add!("head.weight".into(), vec![d.v, e], "output.weight", false);
            add!("norm.weight".into(), vec![e], "output_norm.weight", false);
            add!(
                "hc_head_fn".into(),
                vec![m, m * e],
                "output_hc_fn.weight",
                false
            );
            add!(
                "hc_head_base".into(),
                vec![m],
                "output_hc_base.weight",
                false
            );
            add!(
                "hc_head_scale".into(),
                vec![1],
                "output_hc_scale.weight",
                false
            );
        }
        Naming::Saved | Naming::Module => {
            add!(
                "model.embed_tokens.weight".into(),
                vec![d.v, e],
                "token_embd.weight",
                false,
            );
            let head = if naming == Naming::Saved {
                "head.weight"
            } else {
                "lm_head.weight"
            };
            add!(head.into(), vec![d.v, e], "output.weight", false);
            add!(
                "model.norm.weight".into(),
                vec![e],
                "output_norm.weight",
                false
            );
            add!(
                "model.hc_head.hc_fn".into(),
                vec![m, m * e],
                "output_hc_fn.weight",
                false,
            );
            add!(
                "model.hc_head.hc_base".into(),
                vec![m],
                "output_hc_base.weight",
                false,
            );
            add!(
                "model.hc_head.hc_scale".into(),
                vec![1],
                "output_hc_scale.weight",
                false,
            );
        }
    }
    let mix = 2 * m + m * m;
    for (il, &ratio) in d.ratios.iter().enumerate() {
        let l = |s: &str| format!("{p}layers.{il}.{s}");
        let g = |s: &str| format!("blk.{il}.{s}");
        let module = naming == Naming::Module;
        // (official/saved name, module name, shape, gguf suffix)
        let mut rows: Vec<(&str, &str, Vec<usize>, &str)> = vec![
            (
                "hc_attn_fn",
                "attn_hc.fn",
                vec![mix, m * e],
                "hc_attn_fn.weight",
            ),
            (
                "hc_attn_base",
                "attn_hc.base",
                vec![mix],
                "hc_attn_base.weight",
            ),
            (
                "hc_attn_scale",
                "attn_hc.scale",
                vec![3],
                "hc_attn_scale.weight",
            ),
            (
                "hc_ffn_fn",
                "ffn_hc.fn",
                vec![mix, m * e],
                "hc_ffn_fn.weight",
            ),
            (
                "hc_ffn_base",
                "ffn_hc.base",
                vec![mix],
                "hc_ffn_base.weight",
            ),
            (
                "hc_ffn_scale",
                "ffn_hc.scale",
                vec![3],
                "hc_ffn_scale.weight",
            ),
            (
                "attn_norm.weight",
                "input_layernorm.weight",
                vec![e],
                "attn_norm.weight",
            ),
            (
                "ffn_norm.weight",
                "post_attention_layernorm.weight",
                vec![e],
                "ffn_norm.weight",
            ),
            (
                "attn.wq_a.weight",
                "self_attn.q_a_proj.weight",
                vec![d.q, e],
                "attn_q_a.weight",
            ),
            (
                "attn.q_norm.weight",
                "self_attn.q_a_norm.weight",
                vec![d.q],
                "attn_q_a_norm.weight",
            ),
            (
                "attn.wq_b.weight",
                "self_attn.q_b_proj.weight",
                vec![d.h * d.d, d.q],
                "attn_q_b.weight",
            ),
            (
                "attn.wkv.weight",
                "self_attn.kv_proj.weight",
                vec![d.d, e],
                "attn_kv.weight",
            ),
            (
                if naming == Naming::Saved {
                    "attn.norm.weight"
                } else {
                    "attn.kv_norm.weight"
                },
                "self_attn.kv_norm.weight",
                vec![d.d],
                "attn_kv_a_norm.weight",
            ),
            (
                "attn.attn_sink",
                "self_attn.sinks",
                vec![d.h],
                "attn_sinks.weight",
            ),
            (
                "attn.wo_a.weight",
                "self_attn.o_a_proj.weight",
                vec![d.g * d.o, d.h * d.d / d.g],
                "attn_output_a.weight",
            ),
            (
                "attn.wo_b.weight",
                "self_attn.o_b_proj.weight",
                vec![e, d.g * d.o],
                "attn_output_b.weight",
            ),
            (
                "ffn.gate.weight",
                "mlp.gate.weight",
                vec![d.n, e],
                "ffn_gate_inp.weight",
            ),
            (
                "ffn.shared_experts.w1.weight",
                "mlp.shared_experts.gate_proj.weight",
                vec![d.f, e],
                "ffn_gate_shexp.weight",
            ),
            (
                "ffn.shared_experts.w3.weight",
                "mlp.shared_experts.up_proj.weight",
                vec![d.f, e],
                "ffn_up_shexp.weight",
            ),
            (
                "ffn.shared_experts.w2.weight",
                "mlp.shared_experts.down_proj.weight",
                vec![e, d.f],
                "ffn_down_shexp.weight",
            ),
        ];
        if il >= d.hash {
            rows.push((
                "ffn.gate.bias",
                "mlp.gate.e_score_correction_bias",
                vec![d.n],
                "exp_probs_b.bias",
            ));
        }
        if ratio != 0 {
            let cw = if ratio == 4 { 2 * d.d } else { d.d };
            rows.extend([
                (
                    "attn.compressor.ape",
                    "self_attn.compressor.position_bias",
                    vec![ratio, cw],
                    "attn_compressor_ape.weight",
                ),
                (
                    "attn.compressor.wkv.weight",
                    "self_attn.compressor.kv_proj.weight",
                    vec![cw, e],
                    "attn_compressor_kv.weight",
                ),
                (
                    "attn.compressor.wgate.weight",
                    "self_attn.compressor.gate_proj.weight",
                    vec![cw, e],
                    "attn_compressor_gate.weight",
                ),
                (
                    "attn.compressor.norm.weight",
                    "self_attn.compressor.kv_norm.weight",
                    vec![d.d],
                    "attn_compressor_norm.weight",
                ),
            ]);
        }
        if ratio == 4 {
            rows.extend([
                (
                    "attn.indexer.wq_b.weight",
                    "self_attn.compressor.indexer.q_b_proj.weight",
                    vec![d.ih * d.id, d.q],
                    "indexer.attn_q_b.weight",
                ),
                (
                    "attn.indexer.weights_proj.weight",
                    "self_attn.compressor.indexer.scorer.weights_proj.weight",
                    vec![d.ih, e],
                    "indexer.proj.weight",
                ),
                (
                    "attn.indexer.compressor.ape",
                    "self_attn.compressor.indexer.position_bias",
                    vec![4, 2 * d.id],
                    "indexer_compressor_ape.weight",
                ),
                (
                    "attn.indexer.compressor.wkv.weight",
                    "self_attn.compressor.indexer.kv_proj.weight",
                    vec![2 * d.id, e],
                    "indexer_compressor_kv.weight",
                ),
                (
                    "attn.indexer.compressor.wgate.weight",
                    "self_attn.compressor.indexer.gate_proj.weight",
                    vec![2 * d.id, e],
                    "indexer_compressor_gate.weight",
                ),
                (
                    "attn.indexer.compressor.norm.weight",
                    "self_attn.compressor.indexer.kv_norm.weight",
                    vec![d.id],
                    "indexer_compressor_norm.weight",
                ),
            ]);
        }
        for (a, b, shape, gguf) in rows {
            add!(l(if module { b } else { a }), shape, &g(gguf), false);
        }
        if il < d.hash {
            let n = if module {
                "mlp.gate.tid2eid"
            } else {
                "ffn.gate.tid2eid"
            };
            add!(l(n), vec![d.v, d.k], &g("ffn_gate_tid2eid.weight"), true);
        }
        if module {
            add!(
                l("mlp.experts.gate_up_proj"),
                vec![d.n, 2 * d.f, e],
                &g("ffn_gate_exps.weight+ffn_up_exps.weight"),
                false,
            );
            add!(
                l("mlp.experts.down_proj"),
                vec![d.n, e, d.f],
                &g("ffn_down_exps.weight"),
                false,
            );
        } else {
            for x in 0..d.n {
                for (w, shape, gguf) in [
                    ("w1", vec![d.f, e], "ffn_gate_exps.weight"),
                    ("w3", vec![d.f, e], "ffn_up_exps.weight"),
                    ("w2", vec![e, d.f], "ffn_down_exps.weight"),
                ] {
                    out.push(Src {
                        name: l(&format!("ffn.experts.{x}.{w}.weight")),
                        shape,
                        gguf: g(gguf),
                        expert: Some(x),
                        int: false,
                    });
                }
            }
        }
    }
    out
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn key(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Deterministic values of a tensor, identified by its GGUF name (and expert), so the same
/// logical tensor has the same values in every naming scheme.
pub fn values(id: &str, n: usize) -> Vec<f32> {
    let k = key(id);
    (0..n)
        .map(|i| ((mix(k ^ (i as u64)) >> 40) as f32 / 16_777_216.0 - 0.5) * 0.2)
        .collect()
}

/// tid2eid rows: `k` distinct experts per token.
pub fn tid2eid(v: usize, k: usize, n: usize) -> Vec<i64> {
    (0..v)
        .flat_map(|t| (0..k).map(move |s| ((t + s * 3) % n) as i64))
        .collect()
}

/// Source data of one tensor in a given dtype.
pub fn payload(d: &Dims, s: &Src, dtype: Dtype) -> Vec<u8> {
    let n: usize = s.shape.iter().product();
    if s.int {
        return tid2eid(d.v, d.k, d.n)
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
    }
    let vals: Vec<f32> = if s.gguf.contains('+') {
        // Packed gate_up: per expert, gate rows then up rows.
        let (gate, up) = s.gguf.split_once('+').unwrap();
        let blk = gate.split('.').take(2).collect::<Vec<_>>().join(".");
        let up = format!("{blk}.{}", up);
        let per = d.f * d.e;
        (0..d.n)
            .flat_map(|x| {
                let mut v = values(&format!("{gate}#{x}"), per);
                v.extend(values(&format!("{up}#{x}"), per));
                v
            })
            .collect()
    } else if s.name.ends_with("experts.down_proj") {
        let per = d.f * d.e;
        (0..d.n)
            .flat_map(|x| values(&format!("{}#{x}", s.gguf), per))
            .collect()
    } else if let Some(x) = s.expert {
        values(&format!("{}#{x}", s.gguf), n)
    } else {
        values(&s.gguf, n)
    };
    match dtype {
        Dtype::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::BF16 => vals
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect(),
        Dtype::F16 => vals
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes())
            .collect(),
        // Integer storage of float weights (to test that it is refused).
        Dtype::I64 => vals
            .iter()
            .flat_map(|v| (*v as i64).to_le_bytes())
            .collect(),
        other => panic!("test payload dtype {other:?}"),
    }
}

/// Writes `config.json` and `model.safetensors` into `dir`. `dtype_of` picks each tensor's
/// stored dtype (ints are always I64, as transformers saves tid2eid).
pub fn write_checkpoint(
    dir: &Path,
    d: &Dims,
    config: &serde_json::Value,
    srcs: &[Src],
    dtype_of: &dyn Fn(&Src) -> Dtype,
) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(config).unwrap(),
    )
    .unwrap();
    let data: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = srcs
        .iter()
        .map(|s| {
            let dt = if s.int { Dtype::I64 } else { dtype_of(s) };
            (s.name.clone(), dt, s.shape.clone(), payload(d, s, dt))
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = data
        .iter()
        .map(|(n, dt, shape, bytes)| {
            (
                n.clone(),
                TensorView::new(*dt, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

pub fn f32_all(_: &Src) -> Dtype {
    Dtype::F32
}
