//! Binding the model's tensors to backend weight handles, grouped the way the forward pass
//! uses them.

use std::sync::Arc;

use ds4_gguf::GgufFile;
use ds4_model::{AttnKind, GlobalTensor, LayerTensor, ModelSpec};

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
        Self::load_with(backend, file, spec, None)
    }

    /// [`ModelWeights::load`]; with `routed = Some([gate, up, down])` the layers' routed
    /// tensors are not loaded and every layer gets these weights instead (the slot pools
    /// of streamed experts, docs/placement.md §9).
    pub fn load_with(
        backend: &mut dyn Backend,
        file: &Arc<GgufFile>,
        spec: &ModelSpec,
        routed: Option<[Weight; 3]>,
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
        Self::assemble(spec, routed, &mut |name, usage| {
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
        Self::assemble(spec, routed, &mut |name, _| match next.next() {
            Some((w, (n, _))) if n == name => Ok(w),
            _ => Err(EngineError::MissingTensor { name }),
        })
    }

    /// Builds the model's weight structure, asking `get` for each tensor in a fixed order.
    fn assemble(
        spec: &ModelSpec,
        routed: Option<[Weight; 3]>,
        get: &mut dyn FnMut(String, WeightUse) -> Result<Weight>,
    ) -> Result<ModelWeights> {
        use GlobalTensor as G;
        use LayerTensor as L;
        use WeightUse::{Matrix as M, Table as T, Vector as V};
        let hp = &spec.hparams;
        let mut global = |g: GlobalTensor, usage| get(g.name().to_string(), usage);
        let tok_embd = global(G::TokenEmbd, T)?;
        let head_hc = HcWeights {
            fn_: global(G::OutputHcFn, M)?,
            base: global(G::OutputHcBase, V)?,
            scale: global(G::OutputHcScale, V)?,
        };
        let output_norm = global(G::OutputNorm, V)?;
        let output = global(G::Output, M)?;
        let mut layers = Vec::with_capacity(hp.n_layer);
        for il in 0..hp.n_layer {
            let mut get = |t: LayerTensor, usage| get(t.name(il), usage);
            let mut hc = |ffn: bool| -> Result<HcWeights> {
                let [fn_, base, scale] = L::hc(ffn);
                Ok(HcWeights {
                    fn_: get(fn_, M)?,
                    base: get(base, V)?,
                    scale: get(scale, V)?,
                })
            };
            let hc_attn = hc(false)?;
            let hc_ffn = hc(true)?;
            let kind = hp.attn_kind(il);
            let mut comp = |indexer: bool| -> Result<CompressorWeights> {
                let [kv, gate, ape, norm] = L::compressor(indexer);
                Ok(CompressorWeights {
                    kv: get(kv, M)?,
                    gate: get(gate, M)?,
                    ape: get(ape, V)?,
                    norm: get(norm, V)?,
                })
            };
            let comp_w = match kind {
                AttnKind::Sliding => None,
                _ => Some(comp(false)?),
            };
            let indexer = match kind {
                AttnKind::Csa => Some(IndexerWeights {
                    comp: comp(true)?,
                    q_b: get(L::IndexerQB, M)?,
                    proj: get(L::IndexerProj, M)?,
                }),
                _ => None,
            };
            let hash = hp.is_hash_layer(il);
            let router_bias = if !hash && spec.layer_tensor(il, L::RouterBias).is_some() {
                Some(get(L::RouterBias, V)?)
            } else {
                None
            };
            let tid2eid = if hash {
                Some(get(L::Tid2Eid, T)?)
            } else {
                None
            };
            layers.push(LayerWeights {
                hc_attn,
                attn_norm: get(L::AttnNorm, V)?,
                q_a: get(L::AttnQA, M)?,
                q_a_norm: get(L::AttnQANorm, V)?,
                q_b: get(L::AttnQB, M)?,
                kv: get(L::AttnKv, M)?,
                kv_norm: get(L::AttnKvNorm, V)?,
                sinks: get(L::AttnSinks, V)?,
                out_a: get(L::AttnOutputA, M)?,
                out_b: get(L::AttnOutputB, M)?,
                comp: comp_w,
                indexer,
                hc_ffn,
                ffn_norm: get(L::FfnNorm, V)?,
                router: get(L::RouterGate, M)?,
                router_bias,
                tid2eid,
                gate_exps: match routed {
                    Some(p) => p[0],
                    None => get(L::GateExps, M)?,
                },
                up_exps: match routed {
                    Some(p) => p[1],
                    None => get(L::UpExps, M)?,
                },
                down_exps: match routed {
                    Some(p) => p[2],
                    None => get(L::DownExps, M)?,
                },
                gate_sh: get(L::GateShexp, M)?,
                up_sh: get(L::UpShexp, M)?,
                down_sh: get(L::DownShexp, M)?,
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
