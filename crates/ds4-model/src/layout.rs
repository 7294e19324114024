//! Builds the metadata and tensor table of a ds4-layout file from hyper-parameters and a
//! type recipe. The converter and the synthetic generator both use it, so every file we
//! write has exactly the keys, types and names that validation expects.

use ds4_gguf::{Array, GgmlType, Header, TensorInfo, Value};

use crate::catalogue::{expected_tensors, ExpectedTensor, TypeRule};
use crate::hparams::{HParams, ARCH_PREFIX};
use crate::names::{LayerTensor, TensorName};

/// Which ggml type each storage family gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TypeRecipe {
    pub plain: GgmlType,
    pub vector: GgmlType,
    pub q8: GgmlType,
    pub gate_up: GgmlType,
    pub down: GgmlType,
}

impl TypeRecipe {
    /// ds4's published q2: IQ2_XXS gate/up, Q2_K down.
    pub const Q2: TypeRecipe = TypeRecipe {
        plain: GgmlType::F16,
        vector: GgmlType::F32,
        q8: GgmlType::Q8_0,
        gate_up: GgmlType::Iq2Xxs,
        down: GgmlType::Q2K,
    };
    /// ds4's published q4: Q4_K experts.
    pub const Q4: TypeRecipe = TypeRecipe {
        gate_up: GgmlType::Q4K,
        down: GgmlType::Q4K,
        ..TypeRecipe::Q2
    };
    /// Native MXFP4 routed experts (gate, up and down): the format DeepSeek trained and
    /// published the experts in, so converting the official checkpoint to it loses nothing.
    /// Everything else is as in q2/q4 (F16 plain, Q8_0 projections, F32 vectors); the shared
    /// spec does not describe ds4's own MXFP4 file, so this follows issue 54's "dense as in
    /// q4, experts MXFP4".
    pub const MXFP4: TypeRecipe = TypeRecipe {
        gate_up: GgmlType::Mxfp4,
        down: GgmlType::Mxfp4,
        ..TypeRecipe::Q2
    };
    /// Full precision everywhere (oracle parity).
    pub const F32: TypeRecipe = TypeRecipe {
        plain: GgmlType::F32,
        vector: GgmlType::F32,
        q8: GgmlType::F32,
        gate_up: GgmlType::F32,
        down: GgmlType::F32,
    };

    /// The named recipes, in the order the command lines list them.
    pub const NAMED: [(&'static str, TypeRecipe); 4] = [
        ("q2", TypeRecipe::Q2),
        ("q4", TypeRecipe::Q4),
        ("mxfp4", TypeRecipe::MXFP4),
        ("f32", TypeRecipe::F32),
    ];

    pub fn from_name(s: &str) -> Option<TypeRecipe> {
        TypeRecipe::NAMED
            .iter()
            .find(|(n, _)| *n == s)
            .map(|(_, r)| *r)
    }

    /// The name of a named recipe (`None` for a hand-made one).
    pub fn name(&self) -> Option<&'static str> {
        TypeRecipe::NAMED
            .iter()
            .find(|(_, r)| r == self)
            .map(|(n, _)| *n)
    }

    /// `general.file_type` (llama.cpp's `llama_ftype`) of a file with this recipe, from its
    /// routed gate type: 19 MOSTLY_IQ2_XXS as the published q2 carries, 15 MOSTLY_Q4_K_M,
    /// 38 MOSTLY_MXFP4_MOE, 0 ALL_F32, else 1 MOSTLY_F16. Informative only: no reader
    /// (ds4's or ours) looks at it.
    pub fn file_type(&self) -> u32 {
        match self.gate_up {
            GgmlType::Iq2Xxs => 19,
            GgmlType::Q4K => 15,
            GgmlType::Mxfp4 => 38,
            GgmlType::F32 => 0,
            _ => 1,
        }
    }

    pub fn type_for(&self, t: &ExpectedTensor) -> GgmlType {
        match t.rule {
            TypeRule::Plain => self.plain,
            TypeRule::Vector => self.vector,
            TypeRule::Q8 => self.q8,
            TypeRule::Index => GgmlType::I32,
            TypeRule::Routed if t.name.ends_with(LayerTensor::DownExps.suffix()) => self.down,
            TypeRule::Routed => self.gate_up,
        }
    }
}

/// Tokenizer metadata to embed.
#[derive(Debug, Clone, Default)]
pub struct TokenizerData {
    pub tokens: Vec<String>,
    pub merges: Vec<String>,
    pub token_types: Vec<i32>,
    pub bos: u32,
    pub eos: u32,
    pub pad: u32,
}

fn k(s: &str) -> String {
    format!("{ARCH_PREFIX}{s}")
}

/// `deepseek4.*` keys in the order of the real file (docs/gguf.md §3.2), with the writer's types.
pub fn arch_metadata(h: &HParams) -> Vec<(String, Value)> {
    let u = |x: usize| Value::U32(x as u32);
    let mut ratios: Vec<i32> = h.compress_ratios.iter().map(|&r| r as i32).collect();
    ratios.push(0); // the MTP layer, as the published files carry it
    vec![
        (k("block_count"), u(h.n_layer)),
        (
            k("context_length"),
            Value::U32(h.context_length.unwrap_or(1 << 20) as u32),
        ),
        (k("embedding_length"), u(h.n_embd)),
        (k("attention.head_count"), u(h.n_head)),
        (k("attention.head_count_kv"), u(h.n_head_kv)),
        (k("rope.scaling.type"), Value::String("yarn".into())),
        (k("rope.scaling.factor"), Value::F32(h.yarn.factor)),
        (
            k("rope.scaling.original_context_length"),
            Value::U32(h.yarn.original_context as u32),
        ),
        (
            k("rope.scaling.yarn_beta_fast"),
            Value::F32(h.yarn.beta_fast),
        ),
        (
            k("rope.scaling.yarn_beta_slow"),
            Value::F32(h.yarn.beta_slow),
        ),
        (k("rope.freq_base"), Value::F32(h.rope_freq_base)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(h.rms_eps)),
        (k("expert_used_count"), u(h.n_expert_used)),
        (k("expert_gating_func"), Value::U32(4)),
        (k("attention.key_length"), u(h.head_dim)),
        (k("attention.value_length"), u(h.head_dim)),
        (k("vocab_size"), u(h.n_vocab)),
        (k("rope.dimension_count"), u(h.rope_dim)),
        (k("attention.q_lora_rank"), u(h.q_lora_rank)),
        (k("attention.output_lora_rank"), u(h.o_lora_rank)),
        (k("attention.output_group_count"), u(h.o_groups)),
        (
            k("attention.compress_ratios"),
            Value::Array(Array::i32s(ratios)),
        ),
        (
            k("attention.compress_rope_freq_base"),
            Value::F32(h.compress_rope_freq_base),
        ),
        (k("expert_feed_forward_length"), u(h.expert_ff)),
        (k("expert_count"), u(h.n_expert)),
        (k("expert_shared_count"), u(h.n_expert_shared)),
        (
            k("expert_weights_scale"),
            Value::F32(h.expert_weights_scale),
        ),
        (k("hash_layer_count"), u(h.hash_layer_count)),
        (k("expert_weights_norm"), Value::Bool(h.expert_weights_norm)),
        (
            k("swiglu_clamp_exp"),
            Value::Array(Array::f32s(h.swiglu_clamp.iter().copied())),
        ),
        (k("attention.sliding_window"), u(h.sliding_window)),
        (k("attention.indexer.head_count"), u(h.indexer_heads)),
        (k("attention.indexer.key_length"), u(h.indexer_head_dim)),
        (k("attention.indexer.top_k"), u(h.indexer_top_k)),
        (k("nextn_predict_layers"), Value::U32(1)),
        (k("hyper_connection.count"), u(h.hc_mult)),
        (
            k("hyper_connection.sinkhorn_iterations"),
            u(h.hc_sinkhorn_iters),
        ),
        (k("hyper_connection.epsilon"), Value::F32(h.hc_eps)),
    ]
}

/// Metadata key (a string) that marks a file whose weights are random: the committed demo
/// model carries it, and the `ds4` CLI prints its text, so nobody mistakes the demo's output
/// for what the real model would say.
pub const RANDOM_WEIGHTS_NOTE_KEY: &str = "ds4.random_weights_note";

/// The [`RANDOM_WEIGHTS_NOTE_KEY`] text of a file, if it has one.
pub fn random_weights_note(header: &Header) -> Option<&str> {
    header.get(RANDOM_WEIGHTS_NOTE_KEY).and_then(|v| v.as_str())
}

/// `general.*` keys as the published q2 file has them.
pub fn general_metadata(name: &str, file_type: u32) -> Vec<(String, Value)> {
    vec![
        (
            "general.architecture".into(),
            Value::String("deepseek4".into()),
        ),
        ("general.type".into(), Value::String("model".into())),
        ("general.name".into(), Value::String(name.into())),
        (
            "general.size_label".into(),
            Value::String("256x8.4B".into()),
        ),
        ("general.license".into(), Value::String("mit".into())),
        ("general.sampling.temp".into(), Value::F32(1.0)),
        ("general.sampling.top_p".into(), Value::F32(1.0)),
        ("general.file_type".into(), Value::U32(file_type)),
        ("general.quantization_version".into(), Value::U32(2)),
    ]
}

pub fn tokenizer_metadata(t: &TokenizerData) -> Vec<(String, Value)> {
    vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        (
            "tokenizer.ggml.pre".into(),
            Value::String("joyai-llm".into()),
        ),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(Array::strings(t.tokens.iter().cloned())),
        ),
        (
            "tokenizer.ggml.merges".into(),
            Value::Array(Array::strings(t.merges.iter().cloned())),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(Array::i32s(t.token_types.iter().copied())),
        ),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(t.bos)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(t.eos)),
        ("tokenizer.ggml.padding_token_id".into(), Value::U32(t.pad)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
        ("tokenizer.ggml.add_eos_token".into(), Value::Bool(false)),
    ]
}

/// Position of a per-layer suffix in the published file's order (docs/gguf.md §4.5, official
/// checkpoint key order within a layer).
fn layer_rank(t: LayerTensor) -> usize {
    use LayerTensor::*;
    const ORDER: [LayerTensor; 34] = [
        AttnSinks,
        CompressorApe,
        CompressorNorm,
        CompressorGate,
        CompressorKv,
        IndexerCompressorApe,
        IndexerCompressorNorm,
        IndexerCompressorGate,
        IndexerCompressorKv,
        IndexerProj,
        IndexerQB,
        AttnKvNorm,
        AttnQANorm,
        AttnKv,
        AttnOutputA,
        AttnOutputB,
        AttnQA,
        AttnQB,
        AttnNorm,
        RouterBias,
        RouterGate,
        GateShexp,
        DownShexp,
        UpShexp,
        FfnNorm,
        HcAttnBase,
        HcAttnFn,
        HcAttnScale,
        HcFfnBase,
        HcFfnFn,
        HcFfnScale,
        GateExps,
        DownExps,
        UpExps,
    ];
    ORDER.iter().position(|x| *x == t).unwrap_or(ORDER.len())
}

/// The tensor table in the published order: tid2eid tables, routed experts layer by layer
/// (gate, down, up), the per-layer rest, then the globals.
pub fn tensor_table(h: &HParams, recipe: &TypeRecipe) -> Vec<TensorInfo> {
    let all = expected_tensors(h);
    let info = |t: &ExpectedTensor| TensorInfo {
        name: t.name.clone(),
        dims: t.dims.clone(),
        ty: recipe.type_for(t),
        offset: 0,
    };
    let rank = |t: &ExpectedTensor| match TensorName::parse(&t.name) {
        Some(TensorName::Layer(_, lt)) => layer_rank(lt),
        _ => usize::MAX,
    };
    let mut out: Vec<TensorInfo> = all
        .iter()
        .filter(|t| t.name.ends_with(LayerTensor::Tid2Eid.suffix()))
        .map(info)
        .collect();
    for il in 0..h.n_layer {
        let mut exps: Vec<&ExpectedTensor> = all
            .iter()
            .filter(|t| t.layer == Some(il) && t.rule == TypeRule::Routed)
            .collect();
        exps.sort_by_key(|t| rank(t));
        out.extend(exps.into_iter().map(info));
    }
    for il in 0..h.n_layer {
        let mut rest: Vec<&ExpectedTensor> = all
            .iter()
            .filter(|t| {
                t.layer == Some(il) && t.rule != TypeRule::Routed && t.rule != TypeRule::Index
            })
            .collect();
        rest.sort_by_key(|t| rank(t));
        out.extend(rest.into_iter().map(info));
    }
    out.extend(all.iter().filter(|t| t.layer.is_none()).map(info));
    out
}

/// A complete header for a ds4-layout model (offsets assigned by the writer).
pub fn model_header(h: &HParams, recipe: &TypeRecipe, name: &str, tok: &TokenizerData) -> Header {
    let mut metadata = general_metadata(name, recipe.file_type());
    metadata.extend(arch_metadata(h));
    metadata.extend(tokenizer_metadata(tok));
    Header {
        metadata,
        tensors: tensor_table(h, recipe),
    }
}

/// A placeholder tokenizer with `n_vocab` entries that satisfies ds4's checks: the 7
/// special strings at the V4 ids where they fit, byte-level-looking filler elsewhere.
/// Used for tiny test models and the synthetic full-size model when no real vocabulary is
/// supplied.
pub fn placeholder_tokenizer(n_vocab: usize) -> TokenizerData {
    const SPECIAL: [(&str, usize); 7] = [
        ("<｜begin▁of▁sentence｜>", 0),
        ("<｜end▁of▁sentence｜>", 1),
        ("<｜User｜>", 128_803),
        ("<｜Assistant｜>", 128_804),
        ("<think>", 128_821),
        ("</think>", 128_822),
        ("｜DSML｜", 128_825),
    ];
    let mut tokens: Vec<String> = (0..n_vocab).map(|i| format!("tok{i}")).collect();
    let mut types = vec![1i32; n_vocab];
    let mut next_free = 2usize;
    for (s, id) in SPECIAL {
        let id = if id < n_vocab {
            id
        } else {
            let i = next_free;
            next_free += 1;
            i
        };
        if let Some(slot) = tokens.get_mut(id) {
            *slot = s.to_string();
            types[id] = 3;
        }
    }
    TokenizerData {
        tokens,
        merges: Vec::new(),
        token_types: types,
        bos: 0,
        eos: 1,
        pad: 1,
    }
}

/// The MTP sidecar's 32 tensors with the published types and data order (docs/gguf.md §4.7).
/// Only their sizes matter to the planner; an engine that runs MTP validates the real file.
pub fn mtp_tensor_table(h: &HParams) -> Vec<TensorInfo> {
    let u = |x: usize| x as u64;
    let (e, m, f, n) = (u(h.n_embd), u(h.hc_mult), u(h.expert_ff), u(h.n_expert));
    let (q, hd, g, o) = (
        u(h.q_lora_rank),
        u(h.n_head * h.head_dim),
        u(h.o_groups),
        u(h.o_lora_rank),
    );
    let mix = u(h.hc_mix());
    use GgmlType::{F32, Q4K, Q8_0};
    use LayerTensor::*;
    let rows: Vec<(LayerTensor, Vec<u64>, GgmlType)> = vec![
        (MtpHcHeadBase, vec![m], F32),
        (MtpHcHeadFn, vec![m * e, m], F32),
        (MtpHcHeadScale, vec![1], F32),
        (HcAttnBase, vec![mix], F32),
        (HcFfnBase, vec![mix], F32),
        (HcAttnFn, vec![m * e, mix], F32),
        (HcAttnScale, vec![3], F32),
        (HcFfnFn, vec![m * e, mix], F32),
        (HcFfnScale, vec![3], F32),
        (AttnSinks, vec![u(h.n_head)], F32),
        (AttnQA, vec![e, q], Q8_0),
        (AttnQB, vec![q, hd], Q8_0),
        (AttnQANorm, vec![q], F32),
        (AttnOutputA, vec![hd / g.max(1), g * o], Q8_0),
        (AttnKv, vec![e, u(h.head_dim)], Q8_0),
        (AttnKvNorm, vec![u(h.head_dim)], F32),
        (AttnOutputB, vec![g * o, e], Q8_0),
        (AttnNorm, vec![e], F32),
        (FfnNorm, vec![e], F32),
        (GateShexp, vec![e, f], Q8_0),
        (UpShexp, vec![e, f], Q8_0),
        (DownShexp, vec![f, e], Q8_0),
        (GateExps, vec![e, f, n], Q4K),
        (UpExps, vec![e, f, n], Q4K),
        (DownExps, vec![f, e, n], Q4K),
        (RouterGate, vec![e, n], F32),
        (RouterBias, vec![n], F32),
        (MtpEProj, vec![e, e], Q8_0),
        (MtpHProj, vec![e, e], Q8_0),
        (MtpENorm, vec![e], F32),
        (MtpHNorm, vec![e], F32),
        (MtpNorm, vec![e], F32),
    ];
    rows.into_iter()
        .map(|(s, dims, ty)| TensorInfo {
            name: s.mtp_name(),
            dims,
            ty,
            offset: 0,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtp_sidecar_matches_the_published_file() {
        let mut h = Header {
            metadata: vec![],
            tensors: mtp_tensor_table(&HParams::flash()),
        };
        assert_eq!(h.tensors.len(), 32);
        // Data section of the published sidecar: 3,807,602,400 B file − 2,208 B header.
        assert_eq!(h.assign_offsets().unwrap(), 3_807_602_400 - 2_208);
        // Spot-check published offsets (docs/gguf.md §4.7).
        let off = |n: &str| h.tensors.iter().find(|t| t.name == n).unwrap().offset;
        assert_eq!(off("mtp.0.ffn_gate_exps.weight"), 143_825_472);
        assert_eq!(off("mtp.0.e_proj.weight"), 3_771_899_456);
    }
}
