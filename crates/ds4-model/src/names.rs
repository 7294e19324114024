//! Every tensor name of the ds4 GGUF layout, spelled once (docs/gguf.md §4.2, §4.3, §4.7).
//!
//! The engine binds weights, the converter maps checkpoints, the catalogue validates files
//! and the accounting sums bytes by these names; a typo in one of them used to be a
//! missing-tensor error at run time in only that one place. Here each tensor is an enum
//! variant that knows its spelling and its [`TensorClass`], so the compiler checks the
//! callers and a name can only be wrong once.

use serde::Serialize;

use crate::catalogue::TensorClass;

/// The model-level tensors (no layer prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum GlobalTensor {
    TokenEmbd,
    OutputHcFn,
    OutputHcBase,
    OutputHcScale,
    OutputNorm,
    Output,
}

impl GlobalTensor {
    /// In ds4's catalogue order.
    pub const ALL: [GlobalTensor; 6] = [
        GlobalTensor::TokenEmbd,
        GlobalTensor::OutputHcFn,
        GlobalTensor::OutputHcBase,
        GlobalTensor::OutputHcScale,
        GlobalTensor::OutputNorm,
        GlobalTensor::Output,
    ];

    /// The GGUF name, e.g. `output_hc_fn.weight`.
    pub fn name(self) -> &'static str {
        match self {
            GlobalTensor::TokenEmbd => "token_embd.weight",
            GlobalTensor::OutputHcFn => "output_hc_fn.weight",
            GlobalTensor::OutputHcBase => "output_hc_base.weight",
            GlobalTensor::OutputHcScale => "output_hc_scale.weight",
            GlobalTensor::OutputNorm => "output_norm.weight",
            GlobalTensor::Output => "output.weight",
        }
    }

    pub fn class(self) -> TensorClass {
        match self {
            GlobalTensor::TokenEmbd => TensorClass::Embedding,
            _ => TensorClass::OutputHead,
        }
    }

    pub fn from_name(name: &str) -> Option<GlobalTensor> {
        GlobalTensor::ALL.into_iter().find(|g| g.name() == name)
    }
}

/// The tensors of one block, named `blk.{layer}.{suffix}` in the main model and
/// `mtp.0.{suffix}` in the MTP sidecar. The last eight exist only in the sidecar.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum LayerTensor {
    HcAttnFn,
    HcAttnScale,
    HcAttnBase,
    AttnNorm,
    AttnQA,
    AttnQANorm,
    AttnQB,
    AttnKv,
    AttnKvNorm,
    AttnSinks,
    AttnOutputA,
    AttnOutputB,
    HcFfnFn,
    HcFfnScale,
    HcFfnBase,
    FfnNorm,
    /// The router matrix (`ffn_gate_inp`).
    RouterGate,
    GateExps,
    UpExps,
    DownExps,
    GateShexp,
    UpShexp,
    DownShexp,
    /// Hash layers: expert ids per token.
    Tid2Eid,
    /// Biased top-k layers: the selection bias (`exp_probs_b.bias`, no `ffn_` prefix).
    RouterBias,
    CompressorApe,
    CompressorKv,
    CompressorGate,
    CompressorNorm,
    /// Spelled with a dot: `indexer.attn_q_b`.
    IndexerQB,
    /// Spelled with a dot: `indexer.proj`.
    IndexerProj,
    IndexerCompressorApe,
    IndexerCompressorKv,
    IndexerCompressorGate,
    IndexerCompressorNorm,
    MtpHcHeadBase,
    MtpHcHeadFn,
    MtpHcHeadScale,
    MtpEProj,
    MtpHProj,
    MtpENorm,
    MtpHNorm,
    MtpNorm,
}

impl LayerTensor {
    pub const ALL: [LayerTensor; 43] = {
        use LayerTensor::*;
        [
            HcAttnFn,
            HcAttnScale,
            HcAttnBase,
            AttnNorm,
            AttnQA,
            AttnQANorm,
            AttnQB,
            AttnKv,
            AttnKvNorm,
            AttnSinks,
            AttnOutputA,
            AttnOutputB,
            HcFfnFn,
            HcFfnScale,
            HcFfnBase,
            FfnNorm,
            RouterGate,
            GateExps,
            UpExps,
            DownExps,
            GateShexp,
            UpShexp,
            DownShexp,
            Tid2Eid,
            RouterBias,
            CompressorApe,
            CompressorKv,
            CompressorGate,
            CompressorNorm,
            IndexerQB,
            IndexerProj,
            IndexerCompressorApe,
            IndexerCompressorKv,
            IndexerCompressorGate,
            IndexerCompressorNorm,
            MtpHcHeadBase,
            MtpHcHeadFn,
            MtpHcHeadScale,
            MtpEProj,
            MtpHProj,
            MtpENorm,
            MtpHNorm,
            MtpNorm,
        ]
    };

    /// The name without its `blk.N.` / `mtp.0.` prefix, e.g. `attn_q_a.weight`.
    pub fn suffix(self) -> &'static str {
        use LayerTensor::*;
        match self {
            HcAttnFn => "hc_attn_fn.weight",
            HcAttnScale => "hc_attn_scale.weight",
            HcAttnBase => "hc_attn_base.weight",
            AttnNorm => "attn_norm.weight",
            AttnQA => "attn_q_a.weight",
            AttnQANorm => "attn_q_a_norm.weight",
            AttnQB => "attn_q_b.weight",
            AttnKv => "attn_kv.weight",
            AttnKvNorm => "attn_kv_a_norm.weight",
            AttnSinks => "attn_sinks.weight",
            AttnOutputA => "attn_output_a.weight",
            AttnOutputB => "attn_output_b.weight",
            HcFfnFn => "hc_ffn_fn.weight",
            HcFfnScale => "hc_ffn_scale.weight",
            HcFfnBase => "hc_ffn_base.weight",
            FfnNorm => "ffn_norm.weight",
            RouterGate => "ffn_gate_inp.weight",
            GateExps => "ffn_gate_exps.weight",
            UpExps => "ffn_up_exps.weight",
            DownExps => "ffn_down_exps.weight",
            GateShexp => "ffn_gate_shexp.weight",
            UpShexp => "ffn_up_shexp.weight",
            DownShexp => "ffn_down_shexp.weight",
            Tid2Eid => "ffn_gate_tid2eid.weight",
            RouterBias => "exp_probs_b.bias",
            CompressorApe => "attn_compressor_ape.weight",
            CompressorKv => "attn_compressor_kv.weight",
            CompressorGate => "attn_compressor_gate.weight",
            CompressorNorm => "attn_compressor_norm.weight",
            IndexerQB => "indexer.attn_q_b.weight",
            IndexerProj => "indexer.proj.weight",
            IndexerCompressorApe => "indexer_compressor_ape.weight",
            IndexerCompressorKv => "indexer_compressor_kv.weight",
            IndexerCompressorGate => "indexer_compressor_gate.weight",
            IndexerCompressorNorm => "indexer_compressor_norm.weight",
            MtpHcHeadBase => "hc_head_base.weight",
            MtpHcHeadFn => "hc_head_fn.weight",
            MtpHcHeadScale => "hc_head_scale.weight",
            MtpEProj => "e_proj.weight",
            MtpHProj => "h_proj.weight",
            MtpENorm => "enorm.weight",
            MtpHNorm => "hnorm.weight",
            MtpNorm => "norm.weight",
        }
    }

    /// What the tensor is for (inspect summaries, byte accounting, placement).
    pub fn class(self) -> TensorClass {
        use LayerTensor::*;
        use TensorClass as C;
        match self {
            HcAttnFn | HcAttnScale | HcAttnBase | HcFfnFn | HcFfnScale | HcFfnBase => {
                C::HyperConnection
            }
            AttnNorm | AttnQANorm | AttnKvNorm | AttnSinks | FfnNorm => C::Norms,
            AttnQA | AttnQB | AttnKv | AttnOutputA | AttnOutputB => C::Attention,
            RouterGate | Tid2Eid | RouterBias => C::Router,
            GateExps | UpExps | DownExps => C::RoutedExperts,
            GateShexp | UpShexp | DownShexp => C::SharedExpert,
            CompressorApe | CompressorKv | CompressorGate | CompressorNorm => C::Compressor,
            IndexerQB
            | IndexerProj
            | IndexerCompressorApe
            | IndexerCompressorKv
            | IndexerCompressorGate
            | IndexerCompressorNorm => C::Indexer,
            MtpHcHeadBase | MtpHcHeadFn | MtpHcHeadScale => C::OutputHead,
            MtpEProj | MtpHProj => C::Attention,
            MtpENorm | MtpHNorm | MtpNorm => C::Norms,
        }
    }

    /// `blk.{layer}.{suffix}`.
    pub fn name(self, layer: usize) -> String {
        format!("blk.{layer}.{}", self.suffix())
    }

    /// `mtp.0.{suffix}`: the sidecar's single block.
    pub fn mtp_name(self) -> String {
        format!("mtp.0.{}", self.suffix())
    }

    pub fn from_suffix(suffix: &str) -> Option<LayerTensor> {
        LayerTensor::ALL.into_iter().find(|t| t.suffix() == suffix)
    }

    /// The (φ, b, α) mixer of one sublayer: `[fn, base, scale]`.
    pub fn hc(ffn: bool) -> [LayerTensor; 3] {
        use LayerTensor::*;
        if ffn {
            [HcFfnFn, HcFfnBase, HcFfnScale]
        } else {
            [HcAttnFn, HcAttnBase, HcAttnScale]
        }
    }

    /// One compressor's tensors, `[kv, gate, ape, norm]`: the attention compressor, or the
    /// indexer's own.
    pub fn compressor(indexer: bool) -> [LayerTensor; 4] {
        use LayerTensor::*;
        if indexer {
            [
                IndexerCompressorKv,
                IndexerCompressorGate,
                IndexerCompressorApe,
                IndexerCompressorNorm,
            ]
        } else {
            [CompressorKv, CompressorGate, CompressorApe, CompressorNorm]
        }
    }
}

/// A parsed tensor name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorName {
    Global(GlobalTensor),
    Layer(usize, LayerTensor),
    /// A tensor of MTP block `n` (the sidecar has block 0 only).
    Mtp(usize, LayerTensor),
}

impl TensorName {
    /// Parses `token_embd.weight`, `blk.3.attn_q_a.weight`, `mtp.0.e_proj.weight`; `None`
    /// for a name outside the layout.
    pub fn parse(name: &str) -> Option<TensorName> {
        if let Some(g) = GlobalTensor::from_name(name) {
            return Some(TensorName::Global(g));
        }
        let (prefix, rest) = name.split_once('.')?;
        let (n, suffix) = rest.split_once('.')?;
        let n: usize = n.parse().ok()?;
        let t = LayerTensor::from_suffix(suffix)?;
        match prefix {
            "blk" => Some(TensorName::Layer(n, t)),
            "mtp" => Some(TensorName::Mtp(n, t)),
            _ => None,
        }
    }

    pub fn class(self) -> TensorClass {
        match self {
            TensorName::Global(g) => g.class(),
            TensorName::Layer(_, t) | TensorName::Mtp(_, t) => t.class(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn names_are_distinct_and_parse_back() {
        let suffixes: HashSet<_> = LayerTensor::ALL.iter().map(|t| t.suffix()).collect();
        assert_eq!(suffixes.len(), LayerTensor::ALL.len());
        for t in LayerTensor::ALL {
            assert_eq!(TensorName::parse(&t.name(7)), Some(TensorName::Layer(7, t)));
            assert_eq!(
                TensorName::parse(&t.mtp_name()),
                Some(TensorName::Mtp(0, t))
            );
        }
        for g in GlobalTensor::ALL {
            assert_eq!(TensorName::parse(g.name()), Some(TensorName::Global(g)));
        }
        for bad in [
            "blk.x.attn_q_a.weight",
            "blk.1.attn_q_a",
            "foo.1.attn_kv.weight",
            "",
        ] {
            assert_eq!(TensorName::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn spellings_that_differ_from_the_pattern_are_kept() {
        // The dots and the missing `ffn_` prefix are ds4's spelling, not typos.
        assert_eq!(
            LayerTensor::IndexerQB.name(2),
            "blk.2.indexer.attn_q_b.weight"
        );
        assert_eq!(LayerTensor::IndexerProj.suffix(), "indexer.proj.weight");
        assert_eq!(LayerTensor::RouterBias.name(3), "blk.3.exp_probs_b.bias");
        assert_eq!(LayerTensor::AttnKvNorm.suffix(), "attn_kv_a_norm.weight");
    }
}
