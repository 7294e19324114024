//! The tensor table a model must have, derived from its hyper-parameters (docs/gguf.md §4).
//! Shapes are GGUF dims (ne0 first). Names follow ds4's spelling exactly.

use ds4_gguf::GgmlType;
use serde::Serialize;

use crate::hparams::{AttnKind, HParams};
use crate::names::{GlobalTensor, LayerTensor, TensorName};

/// What a tensor is for: the one class enum of the workspace. `inspect` summaries, the byte
/// accounting and the placement planner (`ds4_placement` re-exports this type) group by it;
/// which tensor has which class is decided in [`crate::names`]. The declaration order is the
/// order the placement report lists classes in.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum TensorClass {
    /// q/kv/output projections, `e_proj`/`h_proj` and sinks.
    Attention,
    /// Routed expert stacks (`ffn_{gate,up,down}_exps`): most of the bytes, 6 of 256 read
    /// per layer per token.
    RoutedExperts,
    SharedExpert,
    /// `ffn_gate_inp`, `exp_probs_b`, `tid2eid`.
    Router,
    HyperConnection,
    Compressor,
    Indexer,
    /// `token_embd`: one row read per token.
    Embedding,
    /// `output.weight` and the output hyper-connection head.
    OutputHead,
    Norms,
}

impl TensorClass {
    /// Every class, in the order `ds4 inspect` lists them.
    pub const ALL: [TensorClass; 10] = [
        TensorClass::Embedding,
        TensorClass::Attention,
        TensorClass::Compressor,
        TensorClass::Indexer,
        TensorClass::HyperConnection,
        TensorClass::Router,
        TensorClass::RoutedExperts,
        TensorClass::SharedExpert,
        TensorClass::Norms,
        TensorClass::OutputHead,
    ];

    /// Whether every decoded token reads the whole tensor. The planner keeps those on the
    /// device in a hybrid plan; routed experts (a few slices per token) and the embedding
    /// (one row per token) can be read from host memory at little cost.
    pub fn read_whole_every_token(self) -> bool {
        !matches!(self, TensorClass::RoutedExperts | TensorClass::Embedding)
    }

    /// Label used in placement reports ("routed experts").
    pub fn label(self) -> &'static str {
        match self {
            TensorClass::Attention => "attention",
            TensorClass::RoutedExperts => "routed experts",
            TensorClass::SharedExpert => "shared expert",
            TensorClass::Router => "router",
            TensorClass::HyperConnection => "hyper-connections",
            TensorClass::Compressor => "compressor",
            TensorClass::Indexer => "indexer",
            TensorClass::Embedding => "embedding",
            TensorClass::OutputHead => "output head",
            TensorClass::Norms => "norms",
        }
    }

    /// Short label used in `ds4 inspect` output.
    pub fn name(self) -> &'static str {
        match self {
            TensorClass::Embedding => "embedding",
            TensorClass::Attention => "attention",
            TensorClass::Compressor => "compressor",
            TensorClass::Indexer => "indexer",
            TensorClass::HyperConnection => "hc",
            TensorClass::Router => "router",
            TensorClass::RoutedExperts => "experts",
            TensorClass::SharedExpert => "shared",
            TensorClass::Norms => "norms",
            TensorClass::OutputHead => "head",
        }
    }
}

impl std::fmt::Display for TensorClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// The storage family a tensor belongs to in ds4's recipe. Under [`crate::Strictness::Ds4`]
/// each maps to exact types; under `Layout` the matrix families accept any supported type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum TypeRule {
    /// 2-D "plain" matrices ds4 keeps in F16 (HC, compressor, indexer, router, embedding).
    Plain,
    /// 1-D vectors (norms, sinks, biases, HC base/scale): F32.
    Vector,
    /// Attention projections, shared expert, output head: Q8_0 in ds4.
    Q8,
    /// Routed experts: IQ2_XXS, Q2_K or Q4_K in ds4's q2/q4 files, MXFP4 in the native layout
    /// that keeps the official checkpoint's FP4 experts as trained (docs/gguf.md §4.6).
    Routed,
    /// The hash-routing table: I32.
    Index,
}

pub const MATRIX_TYPES: [GgmlType; 8] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Bf16,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q4K,
    GgmlType::Iq2Xxs,
    GgmlType::Mxfp4,
];

/// Routed-expert types accepted at ds4's strictness: the q2 pair, Q4_K, and MXFP4.
pub const ROUTED_TYPES: [GgmlType; 4] = [
    GgmlType::Iq2Xxs,
    GgmlType::Q2K,
    GgmlType::Q4K,
    GgmlType::Mxfp4,
];

impl TypeRule {
    /// Types accepted for this family at the given strictness.
    pub fn accepted(self, strict: bool) -> &'static [GgmlType] {
        match (self, strict) {
            (TypeRule::Plain, true) => &[GgmlType::F16],
            (TypeRule::Vector, true) => &[GgmlType::F32],
            (TypeRule::Vector, false) => &[GgmlType::F32, GgmlType::F16, GgmlType::Bf16],
            (TypeRule::Q8, true) => &[GgmlType::Q8_0],
            (TypeRule::Routed, true) => &ROUTED_TYPES,
            (TypeRule::Index, _) => &[GgmlType::I32],
            (TypeRule::Plain | TypeRule::Q8 | TypeRule::Routed, false) => &MATRIX_TYPES,
        }
    }
}

/// One tensor the model requires (or may have).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExpectedTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub rule: TypeRule,
    pub class: TensorClass,
    pub layer: Option<usize>,
    /// ds4 treats `exp_probs_b.bias` as optional in the main model.
    pub optional: bool,
}

/// Every tensor of the main model, in ds4's catalogue order (globals first, then layers).
pub fn expected_tensors(h: &HParams) -> Vec<ExpectedTensor> {
    use GlobalTensor as G;
    use LayerTensor as L;
    use TypeRule as T;
    let u = |x: usize| x as u64;
    let (e, v, m) = (u(h.n_embd), u(h.n_vocab), u(h.hc_mult));
    let mut out = Vec::new();
    for (g, dims, rule) in [
        (G::TokenEmbd, vec![e, v], T::Plain),
        (G::OutputHcFn, vec![m * e, m], T::Plain),
        (G::OutputHcBase, vec![m], T::Vector),
        (G::OutputHcScale, vec![1], T::Vector),
        (G::OutputNorm, vec![e], T::Vector),
        (G::Output, vec![e, v], T::Q8),
    ] {
        out.push(ExpectedTensor {
            name: g.name().to_string(),
            dims,
            rule,
            class: g.class(),
            layer: None,
            optional: false,
        });
    }
    let hd = u(h.n_head * h.head_dim);
    let (q, d, f, n) = (
        u(h.q_lora_rank),
        u(h.head_dim),
        u(h.expert_ff),
        u(h.n_expert),
    );
    let (g, o) = (u(h.o_groups), u(h.o_lora_rank));
    let mix = u(h.hc_mix());
    let (ih, id) = (u(h.indexer_heads), u(h.indexer_head_dim));
    for il in 0..h.n_layer {
        let mut add = |t: LayerTensor, dims: Vec<u64>, rule: TypeRule, optional: bool| {
            out.push(ExpectedTensor {
                name: t.name(il),
                dims,
                rule,
                class: t.class(),
                layer: Some(il),
                optional,
            })
        };
        for ffn in [false, true] {
            let [fn_, base, scale] = L::hc(ffn);
            add(fn_, vec![m * e, mix], T::Plain, false);
            add(scale, vec![3], T::Vector, false);
            add(base, vec![mix], T::Vector, false);
        }
        add(L::AttnNorm, vec![e], T::Vector, false);
        add(L::AttnQA, vec![e, q], T::Q8, false);
        add(L::AttnQANorm, vec![q], T::Vector, false);
        add(L::AttnQB, vec![q, hd], T::Q8, false);
        add(L::AttnKv, vec![e, d], T::Q8, false);
        add(L::AttnKvNorm, vec![d], T::Vector, false);
        add(L::AttnSinks, vec![u(h.n_head)], T::Vector, false);
        add(L::AttnOutputA, vec![hd / g.max(1), g * o], T::Q8, false);
        add(L::AttnOutputB, vec![g * o, e], T::Q8, false);
        add(L::FfnNorm, vec![e], T::Vector, false);
        add(L::RouterGate, vec![e, n], T::Plain, false);
        add(L::GateExps, vec![e, f, n], T::Routed, false);
        add(L::UpExps, vec![e, f, n], T::Routed, false);
        add(L::DownExps, vec![f, e, n], T::Routed, false);
        add(L::GateShexp, vec![e, f], T::Q8, false);
        add(L::UpShexp, vec![e, f], T::Q8, false);
        add(L::DownShexp, vec![f, e], T::Q8, false);
        if h.is_hash_layer(il) {
            add(L::Tid2Eid, vec![u(h.n_expert_used), v], T::Index, false);
        } else {
            // ds4 treats the selection bias as optional in the main model.
            add(L::RouterBias, vec![n], T::Vector, true);
        }
        let kind = h.attn_kind(il);
        if kind != AttnKind::Sliding {
            let cw = u(h.compressor_width(il));
            let r = u(h.compress_ratios[il] as usize);
            add(L::CompressorApe, vec![cw, r], T::Plain, false);
            add(L::CompressorKv, vec![e, cw], T::Plain, false);
            add(L::CompressorGate, vec![e, cw], T::Plain, false);
            add(L::CompressorNorm, vec![d], T::Vector, false);
        }
        if kind == AttnKind::Csa {
            add(L::IndexerQB, vec![q, ih * id], T::Plain, false);
            add(L::IndexerProj, vec![e, ih], T::Plain, false);
            add(L::IndexerCompressorApe, vec![2 * id, 4], T::Plain, false);
            add(L::IndexerCompressorKv, vec![e, 2 * id], T::Plain, false);
            add(L::IndexerCompressorGate, vec![e, 2 * id], T::Plain, false);
            add(L::IndexerCompressorNorm, vec![id], T::Vector, false);
        }
    }
    out
}

/// Class of a tensor by name: exact for every name of the layout ([`TensorName::parse`]), a
/// best guess from the spelling for anything else.
pub fn classify(name: &str) -> TensorClass {
    match TensorName::parse(name) {
        Some(t) => t.class(),
        None => classify_by_spelling(name),
    }
}

/// The fallback of [`classify`] for names outside the layout.
fn classify_by_spelling(name: &str) -> TensorClass {
    // Strip a `blk.N.` or `mtp.N.` prefix.
    let s = match name.split_once('.') {
        Some(("blk" | "mtp", rest)) => rest.split_once('.').map_or(rest, |x| x.1),
        _ => name,
    };
    match s {
        _ if s.starts_with("token_embd") => TensorClass::Embedding,
        _ if s.starts_with("output") || s.starts_with("hc_head") => TensorClass::OutputHead,
        _ if s.starts_with("e_proj") || s.starts_with("h_proj") => TensorClass::Attention,
        _ if s.contains("_exps") => TensorClass::RoutedExperts,
        _ if s.contains("shexp") => TensorClass::SharedExpert,
        _ if s.starts_with("hc_") => TensorClass::HyperConnection,
        _ if s.starts_with("indexer") => TensorClass::Indexer,
        _ if s.starts_with("attn_compressor") => TensorClass::Compressor,
        _ if s.starts_with("ffn_gate_inp")
            || s.starts_with("ffn_gate_tid2eid")
            || s.starts_with("exp_probs_b") =>
        {
            TensorClass::Router
        }
        _ if s.contains("norm") || s.starts_with("attn_sinks") => TensorClass::Norms,
        _ => TensorClass::Attention,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flash_catalogue_has_1328_tensors_and_classify_agrees() {
        let t = expected_tensors(&HParams::flash());
        assert_eq!(t.len(), 1328);
        for x in &t {
            assert_eq!(classify(&x.name), x.class, "{}", x.name);
            // The spelling heuristic (used for names outside the layout) agrees too.
            assert_eq!(classify_by_spelling(&x.name), x.class, "{}", x.name);
        }
        for t in crate::names::LayerTensor::ALL {
            assert_eq!(classify_by_spelling(&t.mtp_name()), t.class(), "{t:?}");
        }
        let per_layer = |il: usize| t.iter().filter(|x| x.layer == Some(il)).count();
        assert_eq!(
            (per_layer(0), per_layer(2), per_layer(3), per_layer(4)),
            (24, 34, 28, 34)
        );
    }
}
