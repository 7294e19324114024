//! Engine configuration: numeric mode, context length, prefill chunk size.

use std::fmt;
use std::str::FromStr;

use ds4_model::HParams;

use crate::error::EngineError;

/// Which graph the engine computes (docs/forward.md §2.7, §9.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NumericMode {
    /// No quantization simulation: the graph HF transformers computes (parity tests).
    Exact,
    /// The official reference's graph: FP8-E4M3 round trip of the non-RoPE KV dims (raw and
    /// compressed rows) and Hadamard + FP4-E2M1 of indexer queries and rows. This is what the
    /// checkpoint was trained with.
    Official,
}

impl NumericMode {
    pub fn as_str(self) -> &'static str {
        match self {
            NumericMode::Exact => "exact",
            NumericMode::Official => "official",
        }
    }

    /// Why `official` cannot run a model with these dims, if it cannot: the Hadamard needs a
    /// power-of-two indexer head width. (Block sizes need not divide the widths: a shorter
    /// last block is used, which the real model never needs.)
    pub fn official_unsupported(hp: &HParams) -> Option<String> {
        let has_csa = hp.compress_ratios.contains(&4);
        if has_csa && !hp.indexer_head_dim.is_power_of_two() {
            return Some(format!(
                "the indexer head width {} is not a power of two (Hadamard transform)",
                hp.indexer_head_dim
            ));
        }
        None
    }

    /// `official` where the model supports it, else `exact`.
    pub fn default_for(hp: &HParams) -> NumericMode {
        if Self::official_unsupported(hp).is_none() {
            NumericMode::Official
        } else {
            NumericMode::Exact
        }
    }
}

impl fmt::Display for NumericMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for NumericMode {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self, EngineError> {
        match s {
            "exact" => Ok(NumericMode::Exact),
            "official" => Ok(NumericMode::Official),
            other => Err(EngineError::Config(format!(
                "unknown numeric mode {other:?} (expected exact or official)"
            ))),
        }
    }
}

/// The prefill chunk every front end uses unless told otherwise (`ds4`, `ds4-server`,
/// `ds4-bench`, the library default): one value, so the server never prefills slower than
/// the CLI. 2048 is where the GPU's multi-token matmuls reach their measured throughput
/// (BENCHMARKS.md: the bench and the CLI prefill at 2048); its scratch is part of the
/// placement plan's buffers.
pub const DEFAULT_PREFILL_CHUNK: usize = 2048;

/// How an [`crate::Engine`] runs.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// `None`: [`NumericMode::default_for`] the model.
    pub mode: Option<NumericMode>,
    /// Maximum tokens a KV state holds (sizes the compressed-row caches).
    pub ctx: usize,
    /// Tokens per prefill chunk (bounds scratch memory; results do not depend on it).
    pub prefill_chunk: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            mode: None,
            ctx: 4096,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
        }
    }
}
