//! The tensor table a model must have, derived from its hyper-parameters (docs/gguf.md §4).
//! Shapes are GGUF dims (ne0 first). Names follow ds4's spelling exactly.

use ds4_gguf::GgmlType;
use serde::Serialize;

use crate::hparams::{AttnKind, HParams};

/// What a tensor is for; used by `inspect` summaries and by the placement planner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum TensorClass {
    Embedding,
    Attention,
    Compressor,
    Indexer,
    Hc,
    Router,
    Experts,
    Shared,
    Norm,
    Head,
}

impl TensorClass {
    pub const ALL: [TensorClass; 10] = [
        TensorClass::Embedding,
        TensorClass::Attention,
        TensorClass::Compressor,
        TensorClass::Indexer,
        TensorClass::Hc,
        TensorClass::Router,
        TensorClass::Experts,
        TensorClass::Shared,
        TensorClass::Norm,
        TensorClass::Head,
    ];

    pub fn name(self) -> &'static str {
        match self {
            TensorClass::Embedding => "embedding",
            TensorClass::Attention => "attention",
            TensorClass::Compressor => "compressor",
            TensorClass::Indexer => "indexer",
            TensorClass::Hc => "hc",
            TensorClass::Router => "router",
            TensorClass::Experts => "experts",
            TensorClass::Shared => "shared",
            TensorClass::Norm => "norms",
            TensorClass::Head => "head",
        }
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
    /// Routed experts: IQ2_XXS, Q2_K or Q4_K in ds4.
    Routed,
    /// The hash-routing table: I32.
    Index,
}

pub const MATRIX_TYPES: [GgmlType; 7] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Bf16,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q4K,
    GgmlType::Iq2Xxs,
];

impl TypeRule {
    /// Types accepted for this family at the given strictness.
    pub fn accepted(self, strict: bool) -> &'static [GgmlType] {
        match (self, strict) {
            (TypeRule::Plain, true) => &[GgmlType::F16],
            (TypeRule::Vector, true) => &[GgmlType::F32],
            (TypeRule::Vector, false) => &[GgmlType::F32, GgmlType::F16, GgmlType::Bf16],
            (TypeRule::Q8, true) => &[GgmlType::Q8_0],
            (TypeRule::Routed, true) => &[GgmlType::Iq2Xxs, GgmlType::Q2K, GgmlType::Q4K],
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
    let u = |x: usize| x as u64;
    let (e, v, m) = (u(h.n_embd), u(h.n_vocab), u(h.hc_mult));
    let mut out = Vec::new();
    let mut add = |name: String, dims: Vec<u64>, rule, class, layer, optional| {
        out.push(ExpectedTensor {
            name,
            dims,
            rule,
            class,
            layer,
            optional,
        })
    };
    use TensorClass as C;
    use TypeRule as T;
    add(
        "token_embd.weight".into(),
        vec![e, v],
        T::Plain,
        C::Embedding,
        None,
        false,
    );
    add(
        "output_hc_fn.weight".into(),
        vec![m * e, m],
        T::Plain,
        C::Head,
        None,
        false,
    );
    add(
        "output_hc_base.weight".into(),
        vec![m],
        T::Vector,
        C::Head,
        None,
        false,
    );
    add(
        "output_hc_scale.weight".into(),
        vec![1],
        T::Vector,
        C::Head,
        None,
        false,
    );
    add(
        "output_norm.weight".into(),
        vec![e],
        T::Vector,
        C::Head,
        None,
        false,
    );
    add(
        "output.weight".into(),
        vec![e, v],
        T::Q8,
        C::Head,
        None,
        false,
    );
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
        let p = |s: &str| format!("blk.{il}.{s}");
        let l = Some(il);
        for hc in ["hc_attn", "hc_ffn"] {
            add(
                p(&format!("{hc}_fn.weight")),
                vec![m * e, mix],
                T::Plain,
                C::Hc,
                l,
                false,
            );
            add(
                p(&format!("{hc}_scale.weight")),
                vec![3],
                T::Vector,
                C::Hc,
                l,
                false,
            );
            add(
                p(&format!("{hc}_base.weight")),
                vec![mix],
                T::Vector,
                C::Hc,
                l,
                false,
            );
        }
        add(p("attn_norm.weight"), vec![e], T::Vector, C::Norm, l, false);
        add(
            p("attn_q_a.weight"),
            vec![e, q],
            T::Q8,
            C::Attention,
            l,
            false,
        );
        add(
            p("attn_q_a_norm.weight"),
            vec![q],
            T::Vector,
            C::Norm,
            l,
            false,
        );
        add(
            p("attn_q_b.weight"),
            vec![q, hd],
            T::Q8,
            C::Attention,
            l,
            false,
        );
        add(
            p("attn_kv.weight"),
            vec![e, d],
            T::Q8,
            C::Attention,
            l,
            false,
        );
        add(
            p("attn_kv_a_norm.weight"),
            vec![d],
            T::Vector,
            C::Norm,
            l,
            false,
        );
        add(
            p("attn_sinks.weight"),
            vec![u(h.n_head)],
            T::Vector,
            C::Norm,
            l,
            false,
        );
        add(
            p("attn_output_a.weight"),
            vec![hd / g.max(1), g * o],
            T::Q8,
            C::Attention,
            l,
            false,
        );
        add(
            p("attn_output_b.weight"),
            vec![g * o, e],
            T::Q8,
            C::Attention,
            l,
            false,
        );
        add(p("ffn_norm.weight"), vec![e], T::Vector, C::Norm, l, false);
        add(
            p("ffn_gate_inp.weight"),
            vec![e, n],
            T::Plain,
            C::Router,
            l,
            false,
        );
        add(
            p("ffn_gate_exps.weight"),
            vec![e, f, n],
            T::Routed,
            C::Experts,
            l,
            false,
        );
        add(
            p("ffn_up_exps.weight"),
            vec![e, f, n],
            T::Routed,
            C::Experts,
            l,
            false,
        );
        add(
            p("ffn_down_exps.weight"),
            vec![f, e, n],
            T::Routed,
            C::Experts,
            l,
            false,
        );
        add(
            p("ffn_gate_shexp.weight"),
            vec![e, f],
            T::Q8,
            C::Shared,
            l,
            false,
        );
        add(
            p("ffn_up_shexp.weight"),
            vec![e, f],
            T::Q8,
            C::Shared,
            l,
            false,
        );
        add(
            p("ffn_down_shexp.weight"),
            vec![f, e],
            T::Q8,
            C::Shared,
            l,
            false,
        );
        if h.is_hash_layer(il) {
            add(
                p("ffn_gate_tid2eid.weight"),
                vec![u(h.n_expert_used), v],
                T::Index,
                C::Router,
                l,
                false,
            );
        } else {
            add(
                p("exp_probs_b.bias"),
                vec![n],
                T::Vector,
                C::Router,
                l,
                true,
            );
        }
        let kind = h.attn_kind(il);
        if kind != AttnKind::Sliding {
            let cw = u(h.compressor_width(il));
            let r = u(h.compress_ratios[il] as usize);
            add(
                p("attn_compressor_ape.weight"),
                vec![cw, r],
                T::Plain,
                C::Compressor,
                l,
                false,
            );
            add(
                p("attn_compressor_kv.weight"),
                vec![e, cw],
                T::Plain,
                C::Compressor,
                l,
                false,
            );
            add(
                p("attn_compressor_gate.weight"),
                vec![e, cw],
                T::Plain,
                C::Compressor,
                l,
                false,
            );
            add(
                p("attn_compressor_norm.weight"),
                vec![d],
                T::Vector,
                C::Compressor,
                l,
                false,
            );
        }
        if kind == AttnKind::Csa {
            add(
                p("indexer.attn_q_b.weight"),
                vec![q, ih * id],
                T::Plain,
                C::Indexer,
                l,
                false,
            );
            add(
                p("indexer.proj.weight"),
                vec![e, ih],
                T::Plain,
                C::Indexer,
                l,
                false,
            );
            add(
                p("indexer_compressor_ape.weight"),
                vec![2 * id, 4],
                T::Plain,
                C::Indexer,
                l,
                false,
            );
            add(
                p("indexer_compressor_kv.weight"),
                vec![e, 2 * id],
                T::Plain,
                C::Indexer,
                l,
                false,
            );
            add(
                p("indexer_compressor_gate.weight"),
                vec![e, 2 * id],
                T::Plain,
                C::Indexer,
                l,
                false,
            );
            add(
                p("indexer_compressor_norm.weight"),
                vec![id],
                T::Vector,
                C::Indexer,
                l,
                false,
            );
        }
    }
    out
}

/// Class of a tensor by name, for tensors outside the catalogue too (best effort).
pub fn classify(name: &str) -> TensorClass {
    // Strip a `blk.N.` or `mtp.N.` prefix.
    let s = match name.split_once('.') {
        Some(("blk" | "mtp", rest)) => rest.split_once('.').map_or(rest, |x| x.1),
        _ => name,
    };
    match s {
        _ if s.starts_with("token_embd") => TensorClass::Embedding,
        _ if s.starts_with("output") || s.starts_with("hc_head") => TensorClass::Head,
        _ if s.starts_with("e_proj") || s.starts_with("h_proj") => TensorClass::Attention,
        _ if s.contains("_exps") => TensorClass::Experts,
        _ if s.contains("shexp") => TensorClass::Shared,
        _ if s.starts_with("hc_") => TensorClass::Hc,
        _ if s.starts_with("indexer") => TensorClass::Indexer,
        _ if s.starts_with("attn_compressor") => TensorClass::Compressor,
        _ if s.starts_with("ffn_gate_inp")
            || s.starts_with("ffn_gate_tid2eid")
            || s.starts_with("exp_probs_b") =>
        {
            TensorClass::Router
        }
        _ if s.contains("norm") || s.starts_with("attn_sinks") => TensorClass::Norm,
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
        }
        let per_layer = |il: usize| t.iter().filter(|x| x.layer == Some(il)).count();
        assert_eq!(
            (per_layer(0), per_layer(2), per_layer(3), per_layer(4)),
            (24, 34, 28, 34)
        );
    }
}
