//! `config.json` → [`HParams`], for both config dialects (docs/gguf.md §3.2, §5.6):
//!
//! * transformers 5.x (`save_pretrained`): `layer_types` + `compress_rates`, `mlp_layer_types`,
//!   `rope_parameters.{main,compress}`, `partial_rotary_factor`;
//! * the official DeepSeek release: `compress_ratios` (per layer, possibly with a trailing
//!   entry for the MTP block), `num_hash_layers`, `rope_scaling`, `qk_rope_head_dim`.
//!
//! Where a key is absent the value transformers would use is taken (so a checkpoint converts
//! to the model transformers would build from it), except where ds4 cannot represent the
//! result: those are refused with the key named.

use ds4_model::{HParams, Yarn};
use serde_json::{Map, Value};

use crate::error::{ConvertError, Result};

fn cfg_err(msg: impl Into<String>) -> ConvertError {
    ConvertError::Config(msg.into())
}

struct Cfg<'a>(&'a Map<String, Value>);

impl<'a> Cfg<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    /// A positive-or-zero integer that fits u32 (every dimension ds4 stores is a u32).
    fn uint(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => uint_value(key, v).map(Some),
        }
    }

    fn req_uint(&self, key: &str) -> Result<usize> {
        self.uint(key)?
            .ok_or_else(|| cfg_err(format!("required key {key:?} is missing")))
    }

    fn float(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(Some)
                .ok_or_else(|| cfg_err(format!("{key:?} must be a finite number, found {v}"))),
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(cfg_err(format!("{key:?} must be a boolean, found {v}"))),
        }
    }

    fn str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(cfg_err(format!("{key:?} must be a string, found {v}"))),
        }
    }

    fn object(&self, key: &str) -> Result<Option<Cfg<'a>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(Cfg(m))),
            Some(v) => Err(cfg_err(format!("{key:?} must be an object, found {v}"))),
        }
    }

    fn array(&self, key: &str) -> Result<Option<&'a Vec<Value>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(cfg_err(format!("{key:?} must be an array, found {v}"))),
        }
    }
}

fn uint_value(key: &str, v: &Value) -> Result<usize> {
    v.as_u64()
        .filter(|x| *x <= u64::from(u32::MAX))
        .map(|x| x as usize)
        .ok_or_else(|| {
            cfg_err(format!(
                "{key:?} must be a non-negative integer below 2^32, found {v}"
            ))
        })
}

/// Upper bound on `num_hidden_layers` before any per-layer vector is sized from it.
const MAX_LAYERS: usize = 4096;

/// Reads a parsed `config.json` into hyper-parameters.
pub fn hparams_from_config(json: &Value) -> Result<HParams> {
    let Value::Object(map) = json else {
        return Err(cfg_err("the top level must be a JSON object"));
    };
    let c = Cfg(map);
    if let Some(mt) = c.str("model_type")? {
        if !mt.starts_with("deepseek_v4") {
            return Err(cfg_err(format!(
                "model_type is {mt:?}; only DeepSeek V4 (\"deepseek_v4\") checkpoints are supported"
            )));
        }
    }
    let n_layer = c.req_uint("num_hidden_layers")?;
    if n_layer == 0 || n_layer > MAX_LAYERS {
        return Err(cfg_err(format!(
            "num_hidden_layers = {n_layer} is outside 1..={MAX_LAYERS}"
        )));
    }
    let head_dim = c.uint("head_dim")?.unwrap_or(512);
    let compress_ratios = layer_schedule(&c, n_layer)?;
    let hash_layer_count = hash_layers(&c, n_layer)?;

    if let Some(f) = c.str("scoring_func")? {
        if f != "sqrtsoftplus" {
            return Err(cfg_err(format!(
                "scoring_func is {f:?}; ds4's layout fixes the router to \"sqrtsoftplus\""
            )));
        }
    }
    if let Some(a) = c.str("hidden_act")? {
        if a != "silu" {
            return Err(cfg_err(format!(
                "hidden_act is {a:?}; DeepSeek V4 experts use \"silu\""
            )));
        }
    }
    if c.bool("tie_word_embeddings")? == Some(true) {
        return Err(cfg_err(
            "tie_word_embeddings is true; ds4's layout stores a separate output head",
        ));
    }

    let rope_dim = rope_dim(&c, head_dim)?;
    let (rope_freq_base, compress_rope_freq_base, yarn) = rope(&c)?;
    let max_pos = c.uint("max_position_embeddings")?;
    let swiglu = c.float("swiglu_limit")?.unwrap_or(10.0) as f32;

    Ok(HParams {
        n_layer,
        n_embd: c.req_uint("hidden_size")?,
        n_head: c.req_uint("num_attention_heads")?,
        n_head_kv: c.uint("num_key_value_heads")?.unwrap_or(1),
        head_dim,
        rope_dim,
        q_lora_rank: c.req_uint("q_lora_rank")?,
        o_lora_rank: c.req_uint("o_lora_rank")?,
        o_groups: c.req_uint("o_groups")?,
        n_vocab: c.req_uint("vocab_size")?,
        n_expert: c.req_uint("n_routed_experts")?,
        n_expert_used: c.req_uint("num_experts_per_tok")?,
        n_expert_shared: c.uint("n_shared_experts")?.unwrap_or(1),
        expert_ff: c.req_uint("moe_intermediate_size")?,
        expert_weights_scale: c.float("routed_scaling_factor")?.unwrap_or(1.5) as f32,
        expert_weights_norm: c.bool("norm_topk_prob")?.unwrap_or(true),
        hash_layer_count,
        swiglu_clamp: vec![swiglu; n_layer],
        sliding_window: c.uint("sliding_window")?.unwrap_or(128),
        compress_ratios,
        indexer_heads: c.uint("index_n_heads")?.unwrap_or(64),
        indexer_head_dim: c.uint("index_head_dim")?.unwrap_or(128),
        indexer_top_k: c.uint("index_topk")?.unwrap_or(512),
        hc_mult: c.uint("hc_mult")?.unwrap_or(4),
        hc_sinkhorn_iters: c.uint("hc_sinkhorn_iters")?.unwrap_or(20),
        hc_eps: c.float("hc_eps")?.unwrap_or(1e-6) as f32,
        rms_eps: c.float("rms_norm_eps")?.unwrap_or(1e-6) as f32,
        rope_freq_base,
        compress_rope_freq_base,
        yarn,
        context_length: max_pos.map(|m| m as u64).or(Some(1 << 20)),
    })
}

/// Per-layer compress ratios: official `compress_ratios`, else `layer_types` mapped through
/// `compress_rates`, else transformers' default (the V4-Pro pattern: two HCA layers, then
/// HCA/CSA alternating — docs/gguf.md §5.6 warns this is *not* Flash's schedule, but it is what
/// transformers builds from such a config, and the tensor shapes are checked against it).
fn layer_schedule(c: &Cfg<'_>, n_layer: usize) -> Result<Vec<u32>> {
    let mut csa = 4usize;
    let mut hca = 128usize;
    if let Some(rates) = c.object("compress_rates")? {
        if let Some(v) = rates.uint("compressed_sparse_attention")? {
            csa = v;
        }
        if let Some(v) = rates.uint("heavily_compressed_attention")? {
            hca = v;
        }
    }
    if let Some(v) = c.uint("compress_rate_csa")? {
        csa = v;
    }
    if let Some(v) = c.uint("compress_rate_hca")? {
        hca = v;
    }
    if csa != 4 {
        return Err(cfg_err(format!(
            "compress_rates.compressed_sparse_attention = {csa}; ds4's layout identifies CSA layers by ratio 4"
        )));
    }
    if hca <= 1 || hca == 4 {
        return Err(cfg_err(format!(
            "compress_rates.heavily_compressed_attention = {hca}; it must be at least 2 and not 4 (4 means CSA)"
        )));
    }
    let ratios: Vec<u32> = if let Some(types) = c.array("layer_types")? {
        if types.len() < n_layer {
            return Err(cfg_err(format!(
                "layer_types has {} entries, num_hidden_layers is {n_layer}",
                types.len()
            )));
        }
        types[..n_layer]
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                Some("sliding_attention") => Ok(0),
                Some("compressed_sparse_attention") => Ok(csa as u32),
                Some("heavily_compressed_attention") => Ok(hca as u32),
                _ => Err(cfg_err(format!(
                    "layer_types[{i}] = {t} is not one of sliding_attention, compressed_sparse_attention, heavily_compressed_attention"
                ))),
            })
            .collect::<Result<_>>()?
    } else if let Some(rs) = c.array("compress_ratios")? {
        if rs.len() < n_layer {
            return Err(cfg_err(format!(
                "compress_ratios has {} entries, num_hidden_layers is {n_layer}",
                rs.len()
            )));
        }
        rs[..n_layer]
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let r = uint_value(&format!("compress_ratios[{i}]"), v)?;
                if r == 1 {
                    return Err(cfg_err(format!(
                        "compress_ratios[{i}] = 1 is not a compression"
                    )));
                }
                Ok(r as u32)
            })
            .collect::<Result<_>>()?
    } else {
        (0..n_layer)
            .map(|i| {
                if i < 2 || i % 2 == 0 {
                    hca as u32
                } else {
                    csa as u32
                }
            })
            .collect()
    };
    Ok(ratios)
}

/// Hash-routed layers must be a leading run (ds4's rule: `il < hash_layer_count`).
fn hash_layers(c: &Cfg<'_>, n_layer: usize) -> Result<usize> {
    if let Some(types) = c.array("mlp_layer_types")? {
        if types.len() < n_layer {
            return Err(cfg_err(format!(
                "mlp_layer_types has {} entries, num_hidden_layers is {n_layer}",
                types.len()
            )));
        }
        let mut count = 0;
        for (i, t) in types[..n_layer].iter().enumerate() {
            match t.as_str() {
                Some("hash_moe") if count == i => count += 1,
                Some("hash_moe") => {
                    return Err(cfg_err(format!(
                        "mlp_layer_types[{i}] is hash_moe after a moe layer; ds4's layout needs the hash layers to come first"
                    )))
                }
                Some("moe") => {}
                _ => {
                    return Err(cfg_err(format!(
                        "mlp_layer_types[{i}] = {t} is not one of hash_moe, moe"
                    )))
                }
            }
        }
        return Ok(count);
    }
    let n = c.uint("num_hash_layers")?.unwrap_or(3);
    Ok(n.min(n_layer))
}

fn rope_dim(c: &Cfg<'_>, head_dim: usize) -> Result<usize> {
    if let Some(r) = c.uint("qk_rope_head_dim")? {
        return Ok(r);
    }
    let factor = c.float("partial_rotary_factor")?.unwrap_or(64.0 / 512.0);
    let r = head_dim as f64 * factor;
    if (r - r.round()).abs() > 1e-9 || r < 0.0 {
        return Err(cfg_err(format!(
            "head_dim {head_dim} x partial_rotary_factor {factor} = {r} is not a whole number of rope dims"
        )));
    }
    Ok(r.round() as usize)
}

/// (main theta, compressed theta, YaRN of the compressed layers).
///
/// A config without YaRN on the compressed branch maps to factor 1: with factor 1 the YaRN
/// blend ω·(1−γ) + (ω/1)·γ is exactly ω, i.e. plain RoPE, and V4 applies no YaRN magnitude
/// scale, so this is the same model.
fn rope(c: &Cfg<'_>) -> Result<(f32, f32, Yarn)> {
    let mut main_theta = c.float("rope_theta")?.unwrap_or(10_000.0);
    let mut comp_theta = c.float("compress_rope_theta")?.unwrap_or(160_000.0);
    let max_pos = c.uint("max_position_embeddings")?.unwrap_or(1 << 20) as u64;
    let mut yarn_src: Option<Cfg<'_>> = None;
    if let Some(rp) = c.object("rope_parameters")? {
        match (rp.object("main")?, rp.object("compress")?) {
            (Some(main), Some(comp)) => {
                if let Some(t) = main.float("rope_theta")? {
                    main_theta = t;
                }
                if let Some(t) = comp.float("rope_theta")? {
                    comp_theta = t;
                }
                yarn_src = Some(comp);
            }
            (None, None) => yarn_src = Some(rp),
            _ => {
                return Err(cfg_err(
                    "rope_parameters must have both \"main\" and \"compress\" (or neither)",
                ))
            }
        }
    }
    if yarn_src.as_ref().map(rope_type).transpose()?.flatten() != Some("yarn".into()) {
        if let Some(rs) = c.object("rope_scaling")? {
            yarn_src = Some(rs);
        }
    }
    let yarn = match yarn_src {
        Some(y) if rope_type(&y)?.as_deref() == Some("yarn") => Yarn {
            factor: y
                .float("factor")?
                .ok_or_else(|| cfg_err("YaRN rope parameters lack \"factor\""))?
                as f32,
            original_context: y.uint("original_max_position_embeddings")?.ok_or_else(|| {
                cfg_err("YaRN rope parameters lack \"original_max_position_embeddings\"")
            })? as u64,
            beta_fast: y.float("beta_fast")?.unwrap_or(32.0) as f32,
            beta_slow: y.float("beta_slow")?.unwrap_or(1.0) as f32,
        },
        Some(y) if !matches!(rope_type(&y)?.as_deref(), None | Some("default")) => {
            return Err(cfg_err(format!(
                "rope type {:?} is not supported (only default and yarn)",
                rope_type(&y)?.unwrap_or_default()
            )))
        }
        _ => Yarn {
            factor: 1.0,
            original_context: max_pos,
            beta_fast: 32.0,
            beta_slow: 1.0,
        },
    };
    Ok((main_theta as f32, comp_theta as f32, yarn))
}

fn rope_type(c: &Cfg<'_>) -> Result<Option<String>> {
    Ok(match c.str("rope_type")? {
        Some(t) => Some(t.to_string()),
        None => c.str("type")?.map(str::to_string),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn hf5() -> Value {
        json!({
            "model_type": "deepseek_v4", "num_hidden_layers": 4, "hidden_size": 256,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
            "q_lora_rank": 64, "o_lora_rank": 32, "o_groups": 2, "vocab_size": 512,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "moe_intermediate_size": 256, "routed_scaling_factor": 1.5, "norm_topk_prob": true,
            "swiglu_limit": 10.0, "sliding_window": 16, "index_n_heads": 4, "index_head_dim": 32,
            "index_topk": 4, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
            "rms_norm_eps": 1e-6, "partial_rotary_factor": 0.25, "max_position_embeddings": 1048576,
            "layer_types": ["sliding_attention", "sliding_attention",
                            "compressed_sparse_attention", "heavily_compressed_attention"],
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
            "rope_parameters": {
                "main": {"rope_theta": 10000.0, "rope_type": "default"},
                "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0,
                             "original_max_position_embeddings": 65536, "beta_fast": 32.0,
                             "beta_slow": 1.0, "attention_factor": 1.0}
            }
        })
    }

    #[test]
    fn transformers5_keys_map() {
        let h = hparams_from_config(&hf5()).unwrap();
        assert_eq!(h.compress_ratios, vec![0, 0, 4, 16]);
        assert_eq!(h.hash_layer_count, 2);
        assert_eq!(h.rope_dim, 16);
        assert_eq!(h.yarn.factor, 16.0);
        assert_eq!(h.yarn.original_context, 65536);
        assert_eq!(h.compress_rope_freq_base, 160000.0);
        assert_eq!(h.swiglu_clamp, vec![10.0; 4]);
    }

    #[test]
    fn official_keys_map() {
        let mut v = hf5();
        let m = v.as_object_mut().unwrap();
        for k in [
            "layer_types",
            "compress_rates",
            "mlp_layer_types",
            "rope_parameters",
            "partial_rotary_factor",
        ] {
            m.remove(k);
        }
        m.insert("compress_ratios".into(), json!([0, 0, 4, 128, 0]));
        m.insert("num_hash_layers".into(), json!(3));
        m.insert("qk_rope_head_dim".into(), json!(16));
        m.insert("rope_theta".into(), json!(10000.0));
        m.insert("compress_rope_theta".into(), json!(160000.0));
        m.insert(
            "rope_scaling".into(),
            json!({"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                   "beta_fast": 32, "beta_slow": 1}),
        );
        let h = hparams_from_config(&v).unwrap();
        assert_eq!(h.compress_ratios, vec![0, 0, 4, 128]);
        assert_eq!(h.hash_layer_count, 3);
        assert_eq!(h.rope_dim, 16);
        assert_eq!(h.yarn.factor, 16.0);
    }

    #[test]
    fn refusals_name_the_key() {
        let mut v = hf5();
        v["mlp_layer_types"] = json!(["moe", "hash_moe", "moe", "moe"]);
        let e = hparams_from_config(&v).unwrap_err().to_string();
        assert!(e.contains("mlp_layer_types[1]"), "{e}");

        let mut v = hf5();
        v["compress_rates"]["compressed_sparse_attention"] = json!(8);
        let e = hparams_from_config(&v).unwrap_err().to_string();
        assert!(e.contains("compressed_sparse_attention = 8"), "{e}");

        let mut v = hf5();
        v.as_object_mut().unwrap().remove("hidden_size");
        let e = hparams_from_config(&v).unwrap_err().to_string();
        assert!(e.contains("\"hidden_size\" is missing"), "{e}");

        let mut v = hf5();
        v["num_hidden_layers"] = json!(5);
        let e = hparams_from_config(&v).unwrap_err().to_string();
        assert!(e.contains("layer_types has 4 entries"), "{e}");

        let mut v = hf5();
        v["scoring_func"] = json!("softmax");
        assert!(hparams_from_config(&v).is_err());
    }

    #[test]
    fn no_yarn_means_factor_one() {
        let mut v = hf5();
        v["rope_parameters"]["compress"] = json!({"rope_type": "default", "rope_theta": 160000.0});
        let h = hparams_from_config(&v).unwrap();
        assert_eq!(h.yarn.factor, 1.0);
    }
}
