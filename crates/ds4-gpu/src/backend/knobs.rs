//! [`Knobs`]: every choice the GPU backend makes among kernels, and its diagnostics, in one
//! value given at construction. The backend reads no environment variable: the binaries
//! resolve flags and variables once at start (`ds4_runtime::config`) and pass the result
//! here, and a backend built by hand (tests, `ds4-engine-check`) starts from
//! [`Knobs::default`], which is what the binaries run when nothing is set — so the
//! checks test the kernels users run.

use crate::cuda::GemmPrecision;

use super::LoadConfig;

/// Multi-token matmuls on quantized tiles (`kernels/tiles.cu`): half-precision operands
/// (11 significant bits, TF32's class), f32 accumulation, no dequantized panels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillTiles {
    /// Every multi-token matmul through panels (f32 or cuBLAS).
    #[default]
    Off,
    /// Routed experts on tiles, grouped on the device; dense matmuls through panels.
    Experts,
    /// Routed experts and every dense multi-token matmul on tiles.
    All,
}

impl PrefillTiles {
    /// What the fast default (CLI, server, bench) uses: routed experts on tiles. `All` also
    /// moves the dense matmuls off cuBLAS, where it measured slower than cuBLAS TF32
    /// (BENCHMARKS.md, "Prefill tiles: speed and numeric cost"); it is kept for GPUs without
    /// cuBLAS, where it has not been measured yet.
    pub const FAST: PrefillTiles = PrefillTiles::Experts;

    /// The name [`Self::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            PrefillTiles::Off => "off",
            PrefillTiles::Experts => "experts",
            PrefillTiles::All => "all",
        }
    }

    /// Parses `off`, `experts` or `all`.
    pub fn parse(s: &str) -> Option<PrefillTiles> {
        match s {
            "off" => Some(PrefillTiles::Off),
            "experts" => Some(PrefillTiles::Experts),
            "all" => Some(PrefillTiles::All),
            _ => None,
        }
    }
}

/// The GPU backend's kernel choices and diagnostics (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Knobs {
    /// Prefill GEMM: cuBLAS at this precision when the library is found (`None`: always
    /// the built-in tiled f32 kernel). CUDA only; ROCm always uses the built-in kernel.
    pub cublas: Option<GemmPrecision>,
    /// Which multi-token matmuls run on quantized tiles instead of dequantized panels.
    pub prefill_tiles: PrefillTiles,
    /// Multi-token attention and the indexer's scores on the tensor cores
    /// (`ds4_attention_mma`, `ds4_indexer_scores_mma`: half-precision operands, f32
    /// accumulation; docs/gpu.md §14, §15) where the shapes and the device allow them.
    pub tensor_core_attention: bool,
    /// Int8 activations in one-token matmuls (the engine may change it later through
    /// `Backend::set_activation_q8`, which the binaries call for every backend).
    pub activation_q8: bool,
    /// Per-kernel launch counts and synchronised wall time, printed when the backend is
    /// dropped (slows everything down: for finding where time goes, not for speed numbers).
    pub profile: bool,
    /// How the weight load pipeline reads and stages.
    pub load: LoadConfig,
}

impl Knobs {
    /// The default of every binary: int8 activations in one-token matmuls, cuBLAS TF32
    /// prefill GEMM, routed experts on tiles, prefill attention and indexer scores on the
    /// tensor cores.
    pub fn fast() -> Knobs {
        Knobs {
            cublas: Some(GemmPrecision::Tf32),
            prefill_tiles: PrefillTiles::FAST,
            tensor_core_attention: true,
            activation_q8: true,
            profile: false,
            load: LoadConfig::default(),
        }
    }

    /// `--quality`: f32 everywhere (activations, cuBLAS's full f32 GEMM, panels, the f32
    /// attention kernels) — logits closest to the f32 reference.
    pub fn quality() -> Knobs {
        Knobs {
            cublas: Some(GemmPrecision::F32),
            prefill_tiles: PrefillTiles::Off,
            tensor_core_attention: false,
            activation_q8: false,
            ..Knobs::fast()
        }
    }
}

impl Default for Knobs {
    /// [`Knobs::fast`]: what the binaries run when no flag or variable says otherwise.
    fn default() -> Knobs {
        Knobs::fast()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quality_is_f32_everywhere_and_the_default_is_fast() {
        let q = Knobs::quality();
        assert_eq!(q.cublas, Some(GemmPrecision::F32));
        assert_eq!(q.prefill_tiles, PrefillTiles::Off);
        assert!(!q.tensor_core_attention && !q.activation_q8);
        let f = Knobs::default();
        assert_eq!(f, Knobs::fast());
        assert_eq!(f.cublas, Some(GemmPrecision::Tf32));
        assert_eq!(f.prefill_tiles, PrefillTiles::Experts);
        assert!(f.tensor_core_attention && f.activation_q8 && !f.profile);
    }

    #[test]
    fn tiles_names_round_trip() {
        for t in [PrefillTiles::Off, PrefillTiles::Experts, PrefillTiles::All] {
            assert_eq!(PrefillTiles::parse(t.name()), Some(t));
        }
        assert_eq!(PrefillTiles::parse("some"), None);
    }
}
