//! Checkpoint tensor names → ds4 GGUF names (docs/gguf.md §5.2–5.3).
//!
//! Three spellings exist for the same tensors: the official DeepSeek checkpoint (a), the
//! transformers in-memory module names (b), and what transformers 5.23 `save_pretrained`
//! writes (c: (a)-style names under a `model.` prefix, with the quirks that the embedding
//! stays `embed_tokens`, the HC head stays `hc_head.hc_*`, and the attention kv-norm becomes
//! `attn.norm.weight`). A leading `model.` is stripped and every spelling is accepted; the
//! detected scheme only decides how *missing* tensors are named in error messages.

use ds4_model::{GlobalTensor, LayerTensor};

/// Which naming a checkpoint uses, detected from its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// (a) Official DeepSeek names, no prefix.
    Official,
    /// (b) transformers module names (`model.layers.N.self_attn...`, packed experts).
    HfModule,
    /// (c) transformers `save_pretrained` output.
    HfSaved,
}

impl Scheme {
    pub fn detect<'a>(names: impl IntoIterator<Item = &'a str>) -> Scheme {
        let mut prefixed = false;
        for n in names {
            let s = n.strip_prefix("model.").unwrap_or(n);
            if s.contains(".self_attn.") || s.contains(".mlp.") || n.starts_with("lm_head.") {
                return Scheme::HfModule;
            }
            prefixed |= n.starts_with("model.");
        }
        if prefixed {
            Scheme::HfSaved
        } else {
            Scheme::Official
        }
    }
}

/// Which routed matrix an expert tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ExpertPart {
    Gate,
    Up,
    Down,
}

impl ExpertPart {
    /// The GGUF tensor the expert matrices are stacked into.
    pub fn tensor(self) -> LayerTensor {
        match self {
            ExpertPart::Gate => LayerTensor::GateExps,
            ExpertPart::Up => LayerTensor::UpExps,
            ExpertPart::Down => LayerTensor::DownExps,
        }
    }

    pub fn gguf_suffix(self) -> &'static str {
        self.tensor().suffix()
    }

    fn official(self) -> &'static str {
        match self {
            ExpertPart::Gate => "w1",
            ExpertPart::Up => "w3",
            ExpertPart::Down => "w2",
        }
    }
}

/// Packed (transformers in-memory) expert tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PackedPart {
    /// `(N, 2F, E)`: gate = rows `0..F`, up = rows `F..2F` of each expert (concatenated).
    GateUp,
    /// `(N, E, F)`.
    Down,
}

/// What a source key is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mapped {
    /// A tensor copied one to one.
    Tensor(String),
    /// One expert's matrix.
    Expert {
        layer: usize,
        expert: usize,
        part: ExpertPart,
    },
    /// All experts of a layer, packed.
    Packed {
        layer: usize,
        part: PackedPart,
    },
    /// A tensor deliberately not converted (the MTP block goes into a separate sidecar).
    Skipped,
    Unknown,
}

/// Global tensors: GGUF name, official (a), saved (c) after stripping `model.`, module (b).
const GLOBALS: [(GlobalTensor, &str, &str, &str); 6] = [
    (
        GlobalTensor::TokenEmbd,
        "embed.weight",
        "embed_tokens.weight",
        "embed_tokens.weight",
    ),
    (
        GlobalTensor::Output,
        "head.weight",
        "head.weight",
        "lm_head.weight",
    ),
    (
        GlobalTensor::OutputNorm,
        "norm.weight",
        "norm.weight",
        "norm.weight",
    ),
    (
        GlobalTensor::OutputHcFn,
        "hc_head_fn",
        "hc_head.hc_fn",
        "hc_head.hc_fn",
    ),
    (
        GlobalTensor::OutputHcBase,
        "hc_head_base",
        "hc_head.hc_base",
        "hc_head.hc_base",
    ),
    (
        GlobalTensor::OutputHcScale,
        "hc_head_scale",
        "hc_head.hc_scale",
        "hc_head.hc_scale",
    ),
];

/// Per-layer tensors: GGUF suffix, official/saved suffix (a)/(c), module suffix (b).
/// The saved kv-norm spelling differs and is handled separately.
const LAYER: [(LayerTensor, &str, &str); 35] = [
    (LayerTensor::HcAttnFn, "hc_attn_fn", "attn_hc.fn"),
    (LayerTensor::HcAttnBase, "hc_attn_base", "attn_hc.base"),
    (LayerTensor::HcAttnScale, "hc_attn_scale", "attn_hc.scale"),
    (LayerTensor::HcFfnFn, "hc_ffn_fn", "ffn_hc.fn"),
    (LayerTensor::HcFfnBase, "hc_ffn_base", "ffn_hc.base"),
    (LayerTensor::HcFfnScale, "hc_ffn_scale", "ffn_hc.scale"),
    (
        LayerTensor::AttnNorm,
        "attn_norm.weight",
        "input_layernorm.weight",
    ),
    (
        LayerTensor::FfnNorm,
        "ffn_norm.weight",
        "post_attention_layernorm.weight",
    ),
    (
        LayerTensor::AttnQA,
        "attn.wq_a.weight",
        "self_attn.q_a_proj.weight",
    ),
    (
        LayerTensor::AttnQANorm,
        "attn.q_norm.weight",
        "self_attn.q_a_norm.weight",
    ),
    (
        LayerTensor::AttnQB,
        "attn.wq_b.weight",
        "self_attn.q_b_proj.weight",
    ),
    (
        LayerTensor::AttnKv,
        "attn.wkv.weight",
        "self_attn.kv_proj.weight",
    ),
    (
        LayerTensor::AttnKvNorm,
        "attn.kv_norm.weight",
        "self_attn.kv_norm.weight",
    ),
    (LayerTensor::AttnSinks, "attn.attn_sink", "self_attn.sinks"),
    (
        LayerTensor::AttnOutputA,
        "attn.wo_a.weight",
        "self_attn.o_a_proj.weight",
    ),
    (
        LayerTensor::AttnOutputB,
        "attn.wo_b.weight",
        "self_attn.o_b_proj.weight",
    ),
    (
        LayerTensor::CompressorApe,
        "attn.compressor.ape",
        "self_attn.compressor.position_bias",
    ),
    (
        LayerTensor::CompressorKv,
        "attn.compressor.wkv.weight",
        "self_attn.compressor.kv_proj.weight",
    ),
    (
        LayerTensor::CompressorGate,
        "attn.compressor.wgate.weight",
        "self_attn.compressor.gate_proj.weight",
    ),
    (
        LayerTensor::CompressorNorm,
        "attn.compressor.norm.weight",
        "self_attn.compressor.kv_norm.weight",
    ),
    (
        LayerTensor::IndexerQB,
        "attn.indexer.wq_b.weight",
        "self_attn.compressor.indexer.q_b_proj.weight",
    ),
    (
        LayerTensor::IndexerProj,
        "attn.indexer.weights_proj.weight",
        "self_attn.compressor.indexer.scorer.weights_proj.weight",
    ),
    (
        LayerTensor::IndexerCompressorApe,
        "attn.indexer.compressor.ape",
        "self_attn.compressor.indexer.position_bias",
    ),
    (
        LayerTensor::IndexerCompressorKv,
        "attn.indexer.compressor.wkv.weight",
        "self_attn.compressor.indexer.kv_proj.weight",
    ),
    (
        LayerTensor::IndexerCompressorGate,
        "attn.indexer.compressor.wgate.weight",
        "self_attn.compressor.indexer.gate_proj.weight",
    ),
    (
        LayerTensor::IndexerCompressorNorm,
        "attn.indexer.compressor.norm.weight",
        "self_attn.compressor.indexer.kv_norm.weight",
    ),
    (
        LayerTensor::RouterGate,
        "ffn.gate.weight",
        "mlp.gate.weight",
    ),
    (
        LayerTensor::RouterBias,
        "ffn.gate.bias",
        "mlp.gate.e_score_correction_bias",
    ),
    (LayerTensor::Tid2Eid, "ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    (
        LayerTensor::GateShexp,
        "ffn.shared_experts.w1.weight",
        "mlp.shared_experts.gate_proj.weight",
    ),
    (
        LayerTensor::UpShexp,
        "ffn.shared_experts.w3.weight",
        "mlp.shared_experts.up_proj.weight",
    ),
    (
        LayerTensor::DownShexp,
        "ffn.shared_experts.w2.weight",
        "mlp.shared_experts.down_proj.weight",
    ),
    // Aliases that only appear in one direction.
    // save_pretrained writes the kv-norm as `attn.norm.weight` (the `.norm.`→`.kv_norm.`
    // rename reversed); accept it.
    (LayerTensor::AttnKvNorm, "attn.norm.weight", ""),
    // Tolerate compressor norms spelled with the module's `kv_norm` under (a)-style paths.
    (
        LayerTensor::CompressorNorm,
        "attn.compressor.kv_norm.weight",
        "",
    ),
    (
        LayerTensor::IndexerCompressorNorm,
        "attn.indexer.compressor.kv_norm.weight",
        "",
    ),
];

fn parse_index(s: &str) -> Option<usize> {
    // Reject signs, leading zeros and absurd lengths: the index names a slot, not a number
    // to be parsed leniently.
    if s.is_empty() || s.len() > 9 || (s.len() > 1 && s.starts_with('0')) {
        return None;
    }
    if !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// Maps one checkpoint key.
pub fn map_name(key: &str) -> Mapped {
    let s = key.strip_prefix("model.").unwrap_or(key);
    if s.starts_with("mtp.") {
        return Mapped::Skipped;
    }
    for (gguf, a, c, b) in GLOBALS {
        if s == a || s == c || s == b || key == b {
            return Mapped::Tensor(gguf.name().to_string());
        }
    }
    let Some(rest) = s.strip_prefix("layers.") else {
        return Mapped::Unknown;
    };
    let Some((idx, rest)) = rest.split_once('.') else {
        return Mapped::Unknown;
    };
    let Some(layer) = parse_index(idx) else {
        return Mapped::Unknown;
    };
    for (gguf, a, b) in LAYER {
        if rest == a || (!b.is_empty() && rest == b) {
            return Mapped::Tensor(gguf.name(layer));
        }
    }
    for pre in ["ffn.experts.", "mlp.experts."] {
        let Some(e) = rest.strip_prefix(pre) else {
            continue;
        };
        match e {
            "gate_up_proj" => {
                return Mapped::Packed {
                    layer,
                    part: PackedPart::GateUp,
                }
            }
            "down_proj" => {
                return Mapped::Packed {
                    layer,
                    part: PackedPart::Down,
                }
            }
            _ => {}
        }
        let Some((eidx, leaf)) = e.split_once('.') else {
            return Mapped::Unknown;
        };
        let Some(expert) = parse_index(eidx) else {
            return Mapped::Unknown;
        };
        let part = match leaf {
            "w1.weight" | "gate_proj.weight" => ExpertPart::Gate,
            "w3.weight" | "up_proj.weight" => ExpertPart::Up,
            "w2.weight" | "down_proj.weight" => ExpertPart::Down,
            _ => return Mapped::Unknown,
        };
        return Mapped::Expert {
            layer,
            expert,
            part,
        };
    }
    Mapped::Unknown
}

/// The tensors only the MTP block has: GGUF tensor, official key after `mtp.0.`.
const MTP_ONLY: [(LayerTensor, &str); 8] = [
    (LayerTensor::MtpEProj, "e_proj.weight"),
    (LayerTensor::MtpHProj, "h_proj.weight"),
    (LayerTensor::MtpENorm, "enorm.weight"),
    (LayerTensor::MtpHNorm, "hnorm.weight"),
    (LayerTensor::MtpNorm, "norm.weight"),
    (LayerTensor::MtpHcHeadFn, "hc_head_fn"),
    (LayerTensor::MtpHcHeadBase, "hc_head_base"),
    (LayerTensor::MtpHcHeadScale, "hc_head_scale"),
];

/// Maps one checkpoint key for the MTP sidecar (docs/gguf.md §5.3): `mtp.0.X` maps
/// like a layer's `X` onto `mtp.0.<suffix>`, its experts onto layer 0's expert slots, plus the
/// MTP-only tensors; every key outside `mtp.` is [`Mapped::Skipped`] (it belongs to the main
/// model), and a block other than 0 is unknown (ds4's sidecar holds one block).
pub fn map_mtp_name(key: &str) -> Mapped {
    let s = key.strip_prefix("model.").unwrap_or(key);
    let Some(rest) = s.strip_prefix("mtp.") else {
        return Mapped::Skipped;
    };
    let Some(rest) = rest.strip_prefix("0.") else {
        return Mapped::Unknown;
    };
    if let Some((t, _)) = MTP_ONLY.iter().find(|(_, k)| *k == rest) {
        return Mapped::Tensor(t.mtp_name());
    }
    match map_name(&format!("layers.0.{rest}")) {
        Mapped::Tensor(g) => match g.strip_prefix("blk.0.") {
            Some(suffix) => Mapped::Tensor(format!("mtp.0.{suffix}")),
            None => Mapped::Unknown,
        },
        m @ (Mapped::Expert { .. } | Mapped::Packed { .. }) => m,
        _ => Mapped::Unknown,
    }
}

/// The official key of an MTP sidecar tensor (`mtp.0.<suffix>`), for "missing" messages.
pub fn mtp_source_name(gguf: &str) -> String {
    let Some(suffix) = gguf.strip_prefix("mtp.0.") else {
        return gguf.to_string();
    };
    if let Some((_, k)) = MTP_ONLY.iter().find(|(t, _)| t.suffix() == suffix) {
        return format!("mtp.0.{k}");
    }
    let layer = source_name(&format!("blk.0.{suffix}"), Scheme::Official);
    match layer.strip_prefix("layers.0.") {
        Some(rest) => format!("mtp.0.{rest}"),
        None => gguf.to_string(),
    }
}

/// The name a GGUF tensor has in `scheme`, for "missing tensor" messages.
pub fn source_name(gguf: &str, scheme: Scheme) -> String {
    let prefix = match scheme {
        Scheme::Official => "",
        Scheme::HfModule | Scheme::HfSaved => "model.",
    };
    for (g, a, c, b) in GLOBALS {
        if g.name() == gguf {
            return match scheme {
                Scheme::Official => a.to_string(),
                Scheme::HfSaved if g == GlobalTensor::Output => c.to_string(),
                Scheme::HfSaved => format!("{prefix}{c}"),
                Scheme::HfModule if g == GlobalTensor::Output => b.to_string(),
                Scheme::HfModule => format!("{prefix}{b}"),
            };
        }
    }
    let Some((layer, suffix)) = gguf.strip_prefix("blk.").and_then(|r| r.split_once('.')) else {
        return gguf.to_string();
    };
    if scheme == Scheme::HfSaved && suffix == LayerTensor::AttnKvNorm.suffix() {
        return format!("{prefix}layers.{layer}.attn.norm.weight");
    }
    for (g, a, b) in LAYER {
        if g.suffix() == suffix {
            let leaf = if scheme == Scheme::HfModule { b } else { a };
            return format!("{prefix}layers.{layer}.{leaf}");
        }
    }
    for part in [ExpertPart::Gate, ExpertPart::Up, ExpertPart::Down] {
        if part.gguf_suffix() == suffix {
            return match scheme {
                Scheme::HfModule => {
                    let p = if part == ExpertPart::Down {
                        "down_proj"
                    } else {
                        "gate_up_proj"
                    };
                    format!("{prefix}layers.{layer}.mlp.experts.{p}")
                }
                _ => format!(
                    "{prefix}layers.{layer}.ffn.experts.{{0..N}}.{}.weight",
                    part.official()
                ),
            };
        }
    }
    gguf.to_string()
}

/// Name of one expert's matrix in `scheme` (per-expert form).
pub fn expert_source_name(layer: usize, expert: usize, part: ExpertPart, scheme: Scheme) -> String {
    let prefix = if scheme == Scheme::Official {
        ""
    } else {
        "model."
    };
    format!(
        "{prefix}layers.{layer}.ffn.experts.{expert}.{}.weight",
        part.official()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_schemes_map_to_the_same_names() {
        let cases = [
            ("embed.weight", "token_embd.weight"),
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("head.weight", "output.weight"),
            ("lm_head.weight", "output.weight"),
            ("model.norm.weight", "output_norm.weight"),
            ("hc_head_fn", "output_hc_fn.weight"),
            ("model.hc_head.hc_scale", "output_hc_scale.weight"),
            (
                "layers.3.attn.kv_norm.weight",
                "blk.3.attn_kv_a_norm.weight",
            ),
            (
                "model.layers.3.attn.norm.weight",
                "blk.3.attn_kv_a_norm.weight",
            ),
            (
                "model.layers.3.self_attn.kv_norm.weight",
                "blk.3.attn_kv_a_norm.weight",
            ),
            (
                "model.layers.2.attn.indexer.compressor.norm.weight",
                "blk.2.indexer_compressor_norm.weight",
            ),
            (
                "model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight",
                "blk.2.indexer.proj.weight",
            ),
            ("layers.0.hc_ffn_scale", "blk.0.hc_ffn_scale.weight"),
            ("model.layers.0.attn_hc.fn", "blk.0.hc_attn_fn.weight"),
            ("layers.7.ffn.gate.bias", "blk.7.exp_probs_b.bias"),
            (
                "model.layers.1.ffn.gate.tid2eid",
                "blk.1.ffn_gate_tid2eid.weight",
            ),
        ];
        for (src, want) in cases {
            assert_eq!(map_name(src), Mapped::Tensor(want.into()), "{src}");
        }
        assert_eq!(
            map_name("model.layers.4.ffn.experts.17.w3.weight"),
            Mapped::Expert {
                layer: 4,
                expert: 17,
                part: ExpertPart::Up
            }
        );
        assert_eq!(
            map_name("model.layers.4.mlp.experts.gate_up_proj"),
            Mapped::Packed {
                layer: 4,
                part: PackedPart::GateUp
            }
        );
        assert_eq!(map_name("mtp.0.attn.wq_a.weight"), Mapped::Skipped);
        for bad in [
            "layers.0.attn.foo.weight",
            "layers.01.attn_norm.weight",
            "layers.-1.attn_norm.weight",
            "layers.0.ffn.experts.x.w1.weight",
            "layers.0.ffn.experts.0.w4.weight",
            "whatever",
        ] {
            assert_eq!(map_name(bad), Mapped::Unknown, "{bad}");
        }
    }

    #[test]
    fn source_names_round_trip_through_map_name() {
        for scheme in [Scheme::Official, Scheme::HfSaved, Scheme::HfModule] {
            for (g, ..) in GLOBALS {
                assert_eq!(
                    map_name(&source_name(g.name(), scheme)),
                    Mapped::Tensor(g.name().into())
                );
            }
            for (g, _, b) in LAYER {
                if b.is_empty() {
                    continue;
                }
                let full = g.name(5);
                assert_eq!(
                    map_name(&source_name(&full, scheme)),
                    Mapped::Tensor(full.clone()),
                    "{scheme:?} {full}"
                );
            }
        }
        assert_eq!(
            source_name("blk.5.attn_kv_a_norm.weight", Scheme::HfSaved),
            "model.layers.5.attn.norm.weight"
        );
        assert_eq!(source_name("output.weight", Scheme::HfSaved), "head.weight");
    }

    #[test]
    fn mtp_names_map_onto_the_sidecar() {
        let cases = [
            ("mtp.0.attn.wq_a.weight", "mtp.0.attn_q_a.weight"),
            ("mtp.0.e_proj.weight", "mtp.0.e_proj.weight"),
            ("mtp.0.hc_head_fn", "mtp.0.hc_head_fn.weight"),
            ("mtp.0.hc_attn_fn", "mtp.0.hc_attn_fn.weight"),
            ("mtp.0.norm.weight", "mtp.0.norm.weight"),
            ("mtp.0.ffn.gate.bias", "mtp.0.exp_probs_b.bias"),
        ];
        for (src, want) in cases {
            assert_eq!(map_mtp_name(src), Mapped::Tensor(want.into()), "{src}");
            assert_eq!(mtp_source_name(want), src);
        }
        assert_eq!(
            map_mtp_name("mtp.0.ffn.experts.3.w2.weight"),
            Mapped::Expert {
                layer: 0,
                expert: 3,
                part: ExpertPart::Down
            }
        );
        assert_eq!(map_mtp_name("layers.0.attn.wq_a.weight"), Mapped::Skipped);
        assert_eq!(map_mtp_name("mtp.1.attn.wq_a.weight"), Mapped::Unknown);
        assert_eq!(map_mtp_name("mtp.0.attn.bogus.weight"), Mapped::Unknown);
    }

    #[test]
    fn scheme_detection() {
        assert_eq!(
            Scheme::detect(["embed.weight", "layers.0.attn.wq_a.weight"]),
            Scheme::Official
        );
        assert_eq!(
            Scheme::detect(["head.weight", "model.embed_tokens.weight"]),
            Scheme::HfSaved
        );
        assert_eq!(
            Scheme::detect(["lm_head.weight", "model.layers.0.self_attn.sinks"]),
            Scheme::HfModule
        );
    }
}
