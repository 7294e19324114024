//! Binding the model's tensors to backend weight handles, grouped the way the forward pass
//! uses them.

use std::sync::Arc;

use ds4_gguf::GgufFile;
use ds4_model::{AttnKind, ModelSpec};

use crate::backend::{Backend, Weight, WeightInfo, WeightUse};
use crate::error::{EngineError, Result};

/// One mHC sublayer's parameters (φ, b, α).
#[derive(Debug, Clone, Copy)]
pub struct HcWeights {
    pub fn_: Weight,
    pub base: Weight,
    pub scale: Weight,
}

/// A compressor's parameters (docs/forward.md §5.3).
#[derive(Debug, Clone, Copy)]
pub struct CompressorWeights {
    pub kv: Weight,
    pub gate: Weight,
    pub ape: Weight,
    pub norm: Weight,
}

/// The lightning indexer of a CSA layer (docs/forward.md §5.5).
#[derive(Debug, Clone, Copy)]
pub struct IndexerWeights {
    pub q_b: Weight,
    pub proj: Weight,
    pub comp: CompressorWeights,
}

#[derive(Debug, Clone, Copy)]
pub struct LayerWeights {
    pub hc_attn: HcWeights,
    pub attn_norm: Weight,
    pub q_a: Weight,
    pub q_a_norm: Weight,
    pub q_b: Weight,
    pub kv: Weight,
    pub kv_norm: Weight,
    pub sinks: Weight,
    pub out_a: Weight,
    pub out_b: Weight,
    pub comp: Option<CompressorWeights>,
    pub indexer: Option<IndexerWeights>,
    pub hc_ffn: HcWeights,
    pub ffn_norm: Weight,
    pub router: Weight,
    pub router_bias: Option<Weight>,
    pub tid2eid: Option<Weight>,
    pub gate_exps: Weight,
    pub up_exps: Weight,
    pub down_exps: Weight,
    pub gate_sh: Weight,
    pub up_sh: Weight,
    pub down_sh: Weight,
}

#[derive(Debug, Clone)]
pub struct ModelWeights {
    pub tok_embd: Weight,
    pub head_hc: HcWeights,
    pub output_norm: Weight,
    pub output: Weight,
    pub layers: Vec<LayerWeights>,
}

impl ModelWeights {
    /// Loads every tensor the forward pass needs. `spec` must have been validated against
    /// `file`'s header (so every required tensor exists with the expected dims).
    ///
    /// The tensor list is collected first and handed to the backend in one
    /// [`Backend::load_weights`] call, so a device backend can overlap file reads with
    /// host-to-device copies across tensors.
    pub fn load(
        backend: &mut dyn Backend,
        file: &Arc<GgufFile>,
        spec: &ModelSpec,
    ) -> Result<ModelWeights> {
        // Pass 1: the names in the order the model is assembled (placeholder weights).
        let mut list: Vec<(String, WeightUse)> = Vec::new();
        let placeholder = Weight::new(
            u32::MAX,
            WeightInfo {
                ty: ds4_gguf::GgmlType::F32,
                dims: [1, 1, 1],
            },
        );
        Self::assemble(spec, &mut |name, usage| {
            if spec.tensor(&name).is_none() {
                return Err(EngineError::MissingTensor { name });
            }
            list.push((name, usage));
            Ok(placeholder)
        })?;
        let loaded = backend
            .load_weights(file, &list)
            .map_err(EngineError::from)?;
        if loaded.len() != list.len() {
            return Err(EngineError::from(crate::backend::BackendError::Invalid {
                op: "load_weights",
                problem: format!("{} weights for {} tensors", loaded.len(), list.len()),
            }));
        }
        // Pass 2: the same walk, handing out the loaded weights in order.
        let mut next = loaded.into_iter().zip(list);
        Self::assemble(spec, &mut |name, _| match next.next() {
            Some((w, (n, _))) if n == name => Ok(w),
            _ => Err(EngineError::MissingTensor { name }),
        })
    }

    /// Builds the model's weight structure, asking `get` for each tensor in a fixed order.
    fn assemble(
        spec: &ModelSpec,
        get: &mut dyn FnMut(String, WeightUse) -> Result<Weight>,
    ) -> Result<ModelWeights> {
        use WeightUse::{Matrix as M, Table as T, Vector as V};
        let hp = &spec.hparams;
        let tok_embd = get("token_embd.weight".into(), T)?;
        let head_hc = HcWeights {
            fn_: get("output_hc_fn.weight".into(), M)?,
            base: get("output_hc_base.weight".into(), V)?,
            scale: get("output_hc_scale.weight".into(), V)?,
        };
        let output_norm = get("output_norm.weight".into(), V)?;
        let output = get("output.weight".into(), M)?;
        let mut layers = Vec::with_capacity(hp.n_layer);
        for il in 0..hp.n_layer {
            let p = |s: &str| format!("blk.{il}.{s}");
            let mut hc = |pre: &str| -> Result<HcWeights> {
                Ok(HcWeights {
                    fn_: get(p(&format!("{pre}_fn.weight")), M)?,
                    base: get(p(&format!("{pre}_base.weight")), V)?,
                    scale: get(p(&format!("{pre}_scale.weight")), V)?,
                })
            };
            let hc_attn = hc("hc_attn")?;
            let hc_ffn = hc("hc_ffn")?;
            let kind = hp.attn_kind(il);
            let mut comp = |pre: &str| -> Result<CompressorWeights> {
                Ok(CompressorWeights {
                    kv: get(p(&format!("{pre}_kv.weight")), M)?,
                    gate: get(p(&format!("{pre}_gate.weight")), M)?,
                    ape: get(p(&format!("{pre}_ape.weight")), V)?,
                    norm: get(p(&format!("{pre}_norm.weight")), V)?,
                })
            };
            let comp_w = match kind {
                AttnKind::Sliding => None,
                _ => Some(comp("attn_compressor")?),
            };
            let indexer = match kind {
                AttnKind::Csa => Some(IndexerWeights {
                    comp: comp("indexer_compressor")?,
                    q_b: get(p("indexer.attn_q_b.weight"), M)?,
                    proj: get(p("indexer.proj.weight"), M)?,
                }),
                _ => None,
            };
            let hash = hp.is_hash_layer(il);
            let bias_name = p("exp_probs_b.bias");
            let router_bias = if !hash && spec.tensor(&bias_name).is_some() {
                Some(get(bias_name, V)?)
            } else {
                None
            };
            let tid2eid = if hash {
                Some(get(p("ffn_gate_tid2eid.weight"), T)?)
            } else {
                None
            };
            layers.push(LayerWeights {
                hc_attn,
                attn_norm: get(p("attn_norm.weight"), V)?,
                q_a: get(p("attn_q_a.weight"), M)?,
                q_a_norm: get(p("attn_q_a_norm.weight"), V)?,
                q_b: get(p("attn_q_b.weight"), M)?,
                kv: get(p("attn_kv.weight"), M)?,
                kv_norm: get(p("attn_kv_a_norm.weight"), V)?,
                sinks: get(p("attn_sinks.weight"), V)?,
                out_a: get(p("attn_output_a.weight"), M)?,
                out_b: get(p("attn_output_b.weight"), M)?,
                comp: comp_w,
                indexer,
                hc_ffn,
                ffn_norm: get(p("ffn_norm.weight"), V)?,
                router: get(p("ffn_gate_inp.weight"), M)?,
                router_bias,
                tid2eid,
                gate_exps: get(p("ffn_gate_exps.weight"), M)?,
                up_exps: get(p("ffn_up_exps.weight"), M)?,
                down_exps: get(p("ffn_down_exps.weight"), M)?,
                gate_sh: get(p("ffn_gate_shexp.weight"), M)?,
                up_sh: get(p("ffn_up_shexp.weight"), M)?,
                down_sh: get(p("ffn_down_shexp.weight"), M)?,
            });
        }
        Ok(ModelWeights {
            tok_embd,
            head_hc,
            output_norm,
            output,
            layers,
        })
    }
}
