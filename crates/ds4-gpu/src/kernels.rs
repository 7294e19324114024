//! The kernel source tree (`kernels/*.cu` at the repository root, embedded at build time)
//! and the host-side contract of each kernel: which shapes it accepts and how it is
//! launched. Everything here is pure so it is tested without a GPU.

use ds4_gguf::GgmlType;
use sha2::{Digest, Sha256};

use crate::error::{GpuError, Result};

/// One module: a compilable root kernel file plus every file it includes (headers and, for
/// gemv.cu and ops.cu, the kernel files of the module), all held in memory so the run-time
/// compiler (NVRTC, hiprtc) never needs the source tree or a toolkit on disk.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// File name, as it appears in compiler messages (`gemv.cu`).
    pub name: &'static str,
    pub source: &'static str,
    /// `(include name, contents)` for every `#include "..."` of the file and of the files it
    /// includes.
    pub headers: &'static [(&'static str, &'static str)],
}

impl KernelSource {
    /// SHA-256 over names and contents of the file and its headers: the source part of
    /// the compile-cache key.
    pub fn hash(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        for (name, text) in
            std::iter::once((self.name, self.source)).chain(self.headers.iter().copied())
        {
            h.update((name.len() as u64).to_le_bytes());
            h.update(name.as_bytes());
            h.update((text.len() as u64).to_le_bytes());
            h.update(text.as_bytes());
        }
        h.finalize().into()
    }
}

/// The portability header every kernel includes first.
pub const PORT_H: (&str, &str) = ("ds4_port.h", include_str!("../../../kernels/ds4_port.h"));
/// Generated IQ2_XXS tables (see [`crate::tables`]).
pub const IQ2XXS_TABLES_H: (&str, &str) = (
    "ds4_iq2xxs_tables.h",
    include_str!("../../../kernels/ds4_iq2xxs_tables.h"),
);

/// Block-format pieces shared by the kernel files.
pub const QUANT_H: (&str, &str) = ("ds4_quant.h", include_str!("../../../kernels/ds4_quant.h"));

/// Device helpers several files of the ops module share.
pub const OPS_H: (&str, &str) = ("ds4_ops.h", include_str!("../../../kernels/ds4_ops.h"));

/// What the files of the GEMV module share: knobs, loaders, block formats, the row engine.
pub const GEMV_H: (&str, &str) = ("ds4_gemv.h", include_str!("../../../kernels/ds4_gemv.h"));

/// `(file name, contents)` of `kernels/<name>`.
macro_rules! kernel_file {
    ($name:literal) => {
        ($name, include_str!(concat!("../../../kernels/", $name)))
    };
}

const GEMV_HEADERS: &[(&str, &str)] = &[
    PORT_H,
    IQ2XXS_TABLES_H,
    QUANT_H,
    GEMV_H,
    kernel_file!("gemv_plain.cu"),
    kernel_file!("gemv_quant.cu"),
    kernel_file!("gemv_q8.cu"),
];

/// The GEMV module's own files besides gemv.cu: its header and the kernel files gemv.cu
/// includes, in order.
pub const GEMV_FILES: &[(&str, &str)] = GEMV_HEADERS.split_at(3).1;

/// Batch-1 GEMV for every ds4 weight type (plain and grouped-expert entry points): one
/// module, gemv.cu, which includes the engines of gemv_plain.cu (F32/F16), gemv_quant.cu
/// (split-layout Q8_0, f32 activations) and gemv_q8.cu (int8 activations) and instantiates
/// them in its entry points.
pub const GEMV: KernelSource = KernelSource {
    name: "gemv.cu",
    source: include_str!("../../../kernels/gemv.cu"),
    headers: GEMV_HEADERS,
};

const OPS_HEADERS: &[(&str, &str)] = &[
    PORT_H,
    IQ2XXS_TABLES_H,
    QUANT_H,
    OPS_H,
    kernel_file!("dequant.cu"),
    kernel_file!("norm_rope.cu"),
    kernel_file!("hc.cu"),
    kernel_file!("compressor.cu"),
    kernel_file!("indexer.cu"),
    kernel_file!("attention.cu"),
    kernel_file!("moe.cu"),
    kernel_file!("sampling.cu"),
    kernel_file!("prefill_mma.cu"),
];

/// The ops module's own files: its header and the kernel files ops.cu includes, in order.
pub const OPS_FILES: &[(&str, &str)] = OPS_HEADERS.split_at(3).1;

/// Every engine op besides the batch-1 GEMV: one module, ops.cu, which includes one file
/// per op family (dequantization and the prefill GEMM, norms and RoPE, embedding and mHC,
/// compressor, indexer, attention, router and MoE helpers, sampling, tensor-core prefill).
pub const OPS: KernelSource = KernelSource {
    name: "ops.cu",
    source: include_str!("../../../kernels/ops.cu"),
    headers: OPS_HEADERS,
};

/// Prefill matmuls from quantized tiles on the tensor cores, and the on-device grouping of
/// routed experts they use (the fast default's prefill; `--quality` keeps the f32 panels).
pub const TILES: KernelSource = KernelSource {
    name: "tiles.cu",
    source: include_str!("../../../kernels/tiles.cu"),
    headers: &[PORT_H, IQ2XXS_TABLES_H, QUANT_H],
};

/// Every kernel file and module header, module by module, roots first (what the source
/// tests read).
pub const FILES: &[&[(&str, &str)]] = &[
    &[("gemv.cu", GEMV.source)],
    GEMV_FILES,
    &[("ops.cu", OPS.source)],
    OPS_FILES,
    &[("tiles.cu", TILES.source)],
];

/// Every module (one run-time compiled program each), for tools that compile them all
/// (cache warm-up, NVRTC and hiprtc checks).
pub const ALL: &[KernelSource] = &[GEMV, OPS, TILES];

/// Threads per block of the GEMV kernels (8 logical warps).
pub const GEMV_THREADS: u32 = 256;
/// Logical warps per block.
pub const GEMV_WARPS: u32 = GEMV_THREADS / 32;

/// The weight types the GEMV kernels implement, with their per-format constants. These
/// mirror the `Ds4*` structs of the GEMV module (`kernels/ds4_gemv.h`, `gemv_plain.cu`);
/// keep the two in step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemvType {
    F32,
    F16,
    Q8_0,
    Q2K,
    Q4K,
    Iq2Xxs,
    /// The official checkpoint's routed-expert format (docs/gpu.md §41).
    Mxfp4,
}

impl GemvType {
    pub const ALL: [GemvType; 7] = [
        GemvType::F32,
        GemvType::F16,
        GemvType::Q8_0,
        GemvType::Q2K,
        GemvType::Q4K,
        GemvType::Iq2Xxs,
        GemvType::Mxfp4,
    ];

    /// The GEMV type for a GGUF tensor type, or an error naming the unsupported type.
    pub fn from_ggml(ty: GgmlType) -> Result<Self> {
        Ok(match ty {
            GgmlType::F32 => GemvType::F32,
            GgmlType::F16 => GemvType::F16,
            GgmlType::Q8_0 => GemvType::Q8_0,
            GgmlType::Q2K => GemvType::Q2K,
            GgmlType::Q4K => GemvType::Q4K,
            GgmlType::Iq2Xxs => GemvType::Iq2Xxs,
            GgmlType::Mxfp4 => GemvType::Mxfp4,
            other => {
                return Err(GpuError::BadArgument {
                    op: "gemv",
                    detail: format!("no GPU GEMV kernel for weight type {}", other.name()),
                })
            }
        })
    }

    pub fn ggml(self) -> GgmlType {
        match self {
            GemvType::F32 => GgmlType::F32,
            GemvType::F16 => GgmlType::F16,
            GemvType::Q8_0 => GgmlType::Q8_0,
            GemvType::Q2K => GgmlType::Q2K,
            GemvType::Q4K => GgmlType::Q4K,
            GemvType::Iq2Xxs => GgmlType::Iq2Xxs,
            GemvType::Mxfp4 => GgmlType::Mxfp4,
        }
    }

    /// Suffix of the kernel entry points (`ds4_gemv_<suffix>`).
    /// Kernel label for timing attribution (`gemv_<suffix>`).
    pub fn label(self, grouped: bool) -> &'static str {
        match (self, grouped) {
            (GemvType::F32, false) => "gemv_f32",
            (GemvType::F16, false) => "gemv_f16",
            (GemvType::Q8_0, false) => "gemv_q8_0",
            (GemvType::Q2K, false) => "gemv_q2_k",
            (GemvType::Q4K, false) => "gemv_q4_k",
            (GemvType::Iq2Xxs, false) => "gemv_iq2_xxs",
            (GemvType::Mxfp4, false) => "gemv_mxfp4",
            (GemvType::F32, true) => "gemv_grouped_f32",
            (GemvType::F16, true) => "gemv_grouped_f16",
            (GemvType::Q8_0, true) => "gemv_grouped_q8_0",
            (GemvType::Q2K, true) => "gemv_grouped_q2_k",
            (GemvType::Q4K, true) => "gemv_grouped_q4_k",
            (GemvType::Iq2Xxs, true) => "gemv_grouped_iq2_xxs",
            (GemvType::Mxfp4, true) => "gemv_grouped_mxfp4",
        }
    }

    /// Kernel label of the int8-activation variant (`gemv_q_<suffix>`).
    pub fn label_q8(self, grouped: bool) -> &'static str {
        match (self, grouped) {
            (GemvType::Q8_0, false) => "gemvq_q8_0",
            (GemvType::Q8_0, true) => "gemvq_grouped_q8_0",
            (GemvType::Q2K, false) => "gemvq_q2_k",
            (GemvType::Q4K, false) => "gemvq_q4_k",
            (GemvType::Iq2Xxs, false) => "gemvq_iq2_xxs",
            (GemvType::Mxfp4, false) => "gemvq_mxfp4",
            (GemvType::Q2K, true) => "gemvq_grouped_q2_k",
            (GemvType::Q4K, true) => "gemvq_grouped_q4_k",
            (GemvType::Iq2Xxs, true) => "gemvq_grouped_iq2_xxs",
            (GemvType::Mxfp4, true) => "gemvq_grouped_mxfp4",
            (_, g) => self.label(g),
        }
    }

    pub fn suffix(self) -> &'static str {
        match self {
            GemvType::F32 => "f32",
            GemvType::F16 => "f16",
            GemvType::Q8_0 => "q8_0",
            GemvType::Q2K => "q2_k",
            GemvType::Q4K => "q4_k",
            GemvType::Iq2Xxs => "iq2_xxs",
            GemvType::Mxfp4 => "mxfp4",
        }
    }

    /// Elements per block (for F32/F16: per 16-byte vector, the kernels' unit).
    pub fn block_elems(self) -> u64 {
        match self {
            GemvType::F32 => 4,
            GemvType::F16 => 8,
            GemvType::Q8_0 | GemvType::Mxfp4 => 32,
            GemvType::Q2K | GemvType::Q4K | GemvType::Iq2Xxs => 256,
        }
    }

    /// Bytes per block (per vector for F32/F16).
    pub fn block_bytes(self) -> u64 {
        match self {
            GemvType::F32 | GemvType::F16 => 16,
            GemvType::Q8_0 => 34,
            GemvType::Q2K => 84,
            GemvType::Q4K => 144,
            GemvType::Iq2Xxs => 66,
            GemvType::Mxfp4 => 17,
        }
    }

    /// The configuration the GEMV module compiles (its per-format `DS4_ROWS_*` constants and
    /// `DS4_GEMV_PLAIN_ROWS` = 2); the CUDA loader reads the real one from the module
    /// (`ds4_gemv_config_<t>`).
    pub fn default_config(self) -> GemvConfig {
        let (rows, chunk_blocks) = match self {
            GemvType::F32 | GemvType::F16 => (2, 32),
            GemvType::Q8_0 => (2, 16),
            GemvType::Q2K => (2, 12),
            GemvType::Q4K => (2, 6),
            GemvType::Iq2Xxs => (2, 16),
            GemvType::Mxfp4 => (2, 32),
        };
        GemvConfig { rows, chunk_blocks }
    }

    /// Bytes of one row of `n_in` elements, or an error if `n_in` is not a whole number
    /// of blocks or the row would not be 16-byte aligned (the kernels load 16 bytes).
    pub fn row_bytes(self, n_in: u64) -> Result<u64> {
        let be = self.block_elems();
        if n_in == 0 || !n_in.is_multiple_of(be) {
            return Err(GpuError::BadArgument {
                op: "gemv",
                detail: format!(
                    "{}: n_in = {n_in} is not a positive multiple of {be}",
                    self.ggml().name()
                ),
            });
        }
        let bytes =
            (n_in / be)
                .checked_mul(self.block_bytes())
                .ok_or_else(|| GpuError::BadArgument {
                    op: "gemv",
                    detail: format!("n_in = {n_in} overflows"),
                })?;
        if !bytes.is_multiple_of(16) {
            return Err(GpuError::BadArgument {
                op: "gemv",
                detail: format!(
                    "{}: a row of {n_in} elements is {bytes} bytes, not a multiple of 16 \
                     (the kernels need 16-byte aligned rows; n_in must be a multiple of {})",
                    self.ggml().name(),
                    self.aligned_multiple()
                ),
            });
        }
        Ok(bytes)
    }

    /// The smallest n_in multiple that gives 16-byte aligned rows.
    fn aligned_multiple(self) -> u64 {
        let be = self.block_elems();
        let mut k = 1;
        while !(k * self.block_bytes()).is_multiple_of(16) {
            k += 1;
        }
        k * be
    }
}

/// Rearranges Q8_0 rows of `n_in` values from ggml's interleaved blocks (per 32 values an
/// f16 scale, then 32 int8 codes) into the GPU's split layout (the row's codes, then its
/// scales), in place on the host: what `ds4_q8_0_split` (dequant.cu) does on the device
/// after a load (docs/gpu.md §7). For tools that upload weights straight to kernels.
pub fn q8_0_split_rows(bytes: &mut [u8], n_in: usize) -> Result<()> {
    let nb = n_in / 32;
    let row = nb * 34;
    if n_in == 0 || !n_in.is_multiple_of(32) || !bytes.len().is_multiple_of(row) {
        return Err(GpuError::BadArgument {
            op: "q8_0_split_rows",
            detail: format!(
                "{} bytes are not whole Q8_0 rows of {n_in} values",
                bytes.len()
            ),
        });
    }
    let mut tmp = vec![0u8; row];
    for r in bytes.chunks_exact_mut(row) {
        for b in 0..nb {
            tmp[32 * b..32 * b + 32].copy_from_slice(&r[34 * b + 2..34 * b + 34]);
            tmp[n_in + 2 * b..n_in + 2 * b + 2].copy_from_slice(&r[34 * b..34 * b + 2]);
        }
        r.copy_from_slice(&tmp);
    }
    Ok(())
}

/// What a compiled GEMV kernel does per warp: `rows` output rows, streamed in chunks of
/// `chunk_blocks` blocks (for F16/F32: 16-byte vectors per lane pass, 32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemvConfig {
    pub rows: u32,
    pub chunk_blocks: u32,
}

/// How one GEMV launch is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemvLaunch {
    /// Warps that share one output row (1, 2, 4 or 8).
    pub wpr: u32,
    /// Blocks along x (row groups).
    pub grid_x: u32,
    /// Threads per block.
    pub block: u32,
    /// Bytes of one weight row.
    pub row_bytes: u64,
}

/// Largest power of two in {1, 2, 4, 8} that is <= `parts` and, where possible, makes at
/// least `target_warps` warps in flight.
pub fn choose_wpr(n_out: u64, parts: u64, target_warps: u64) -> u32 {
    let mut wpr = 1u64;
    while wpr < 8 && n_out * wpr < target_warps && wpr * 2 <= parts {
        wpr *= 2;
    }
    wpr as u32
}

/// Blocks of the several-column F16/F32 GEMV (`ds4_gemv_cols_<t>`) for `n_out` rows at the
/// one-token launch's warps per row `wpr` and `rows` rows per warp (`ds4_gemv_cols_rows`,
/// docs/gpu.md §35): it keeps the one-token kernel's split of each row over its warps and
/// takes more rows per warp, so it needs fewer blocks.
pub fn cols_grid_x(n_out: u64, wpr: u32, rows: u32) -> Result<u32> {
    let per_block = u64::from(GEMV_WARPS / wpr.clamp(1, GEMV_WARPS) * rows.max(1));
    u32::try_from(n_out.div_ceil(per_block)).map_err(|_| GpuError::BadArgument {
        op: "gemv",
        detail: format!("n_out = {n_out} needs more blocks than a grid holds"),
    })
}

/// Validate a GEMV shape and compute its launch for kernels compiled with `cfg`.
/// `target_warps` is how many warps the device needs in flight to hide memory latency
/// (e.g. 48 per multiprocessor).
pub fn gemv_launch(
    ty: GemvType,
    cfg: GemvConfig,
    n_in: u64,
    n_out: u64,
    target_warps: u64,
) -> Result<GemvLaunch> {
    if !matches!(cfg.rows, 1 | 2 | 4) || cfg.chunk_blocks == 0 {
        return Err(GpuError::BadArgument {
            op: "gemv",
            detail: format!("kernel configuration {cfg:?} is not one this crate launches"),
        });
    }
    let row_bytes = ty.row_bytes(n_in)?;
    if n_out == 0 || n_out > i32::MAX as u64 || n_in > i32::MAX as u64 {
        return Err(GpuError::BadArgument {
            op: "gemv",
            detail: format!("shape {n_out}x{n_in} is empty or exceeds the kernels' i32 indices"),
        });
    }
    let blocks = n_in / ty.block_elems();
    let parts = blocks.div_ceil(u64::from(cfg.chunk_blocks));
    let groups = n_out.div_ceil(u64::from(cfg.rows));
    let wpr = choose_wpr(groups, parts, target_warps);
    let rows_per_block = u64::from(GEMV_WARPS / wpr * cfg.rows);
    let grid_x = n_out.div_ceil(rows_per_block);
    let grid_x = u32::try_from(grid_x).map_err(|_| GpuError::BadArgument {
        op: "gemv",
        detail: format!("n_out = {n_out} needs {grid_x} blocks, more than a grid holds"),
    })?;
    Ok(GemvLaunch {
        wpr,
        grid_x,
        block: GEMV_THREADS,
        row_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The files of a module, one after another (what its tests search).
    fn module_text(files: &[(&str, &str)]) -> String {
        files.iter().map(|(_, text)| *text).collect()
    }

    /// The contents of kernel file `name` (one of [`FILES`]).
    fn file(name: &str) -> &'static str {
        FILES
            .iter()
            .copied()
            .flatten()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("no kernel file {name}"))
            .1
    }

    #[test]
    fn types_match_ggml_table() {
        for t in GemvType::ALL {
            assert_eq!(GemvType::from_ggml(t.ggml()).unwrap(), t);
            let g = t.ggml();
            // Block formats: the kernel's block equals ggml's; plain types use 16-byte vectors.
            if g.is_quantized() {
                assert_eq!(Some(t.block_elems()), g.block_elems());
                assert_eq!(Some(t.block_bytes()), g.block_bytes());
            } else {
                assert_eq!(t.block_bytes(), t.block_elems() * g.block_bytes().unwrap());
            }
            // A full chunk must be whole 16-byte vectors (mirrors the static_assert).
            let c = t.default_config();
            assert!(
                (u64::from(c.chunk_blocks) * t.block_bytes()).is_multiple_of(16),
                "{t:?}"
            );
        }
        assert!(GemvType::from_ggml(GgmlType::I32).is_err());
    }

    #[test]
    fn kernel_source_declares_each_entry_point_and_chunk() {
        let gemv_text = GEMV.source.to_string() + &module_text(GEMV_FILES);
        for t in GemvType::ALL {
            let name = format!("DS4_GEMV_ENTRY({},", t.suffix());
            assert!(gemv_text.contains(&name), "missing {name}");
        }
        // The default configuration in Rust must equal the kernels': rows from the
        // DS4_ROWS_<TYPE> constants (the suffix in capitals), chunk blocks from cb(rows).
        let define = |name: &str| -> u32 {
            let key = format!("#define {name} ");
            gemv_text
                .lines()
                .filter_map(|l| l.strip_prefix(&key))
                .find_map(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("no numeric #define {name}"))
        };
        let rows_of = |t: GemvType| define(&format!("DS4_ROWS_{}", t.suffix().to_uppercase()));
        for (t, cb_decl) in [
            (GemvType::Q2K, "R == 1 ? 24 : R == 2 ? 12 : 4"),
            (GemvType::Q4K, "R == 1 ? 14 : R == 2 ? 6 : 2"),
            (GemvType::Iq2Xxs, "R == 1 ? 32 : R == 2 ? 16 : 8"),
        ] {
            assert!(gemv_text.contains(cb_decl), "{t:?}: {cb_decl}");
            let c = t.default_config();
            assert_eq!(c.rows, rows_of(t), "{t:?}");
            let nums: Vec<u32> = cb_decl
                .split(|ch: char| !ch.is_ascii_digit())
                .filter_map(|n| n.parse().ok())
                .collect();
            // nums = [1, cb1, 2, cb2, cb4]
            let cb = match c.rows {
                1 => nums[1],
                2 => nums[3],
                _ => nums[4],
            };
            assert_eq!(c.chunk_blocks, cb, "{t:?}");
        }
        // MXFP4: 32 blocks per chunk at any rows (one unit per block, one per lane).
        assert!(gemv_text.contains("static constexpr int cb(int) { return 32; }"));
        let c = GemvType::Mxfp4.default_config();
        assert_eq!((c.rows, c.chunk_blocks), (rows_of(GemvType::Mxfp4), 32));
        // Split-layout Q8_0: its rows constant, 16 blocks per lane pass (32 lanes x 16
        // codes).
        assert!(gemv_text.contains("DS4_GEMV_CONFIG(q8_0, Ds4Q8S::ROWS, 16)"));
        let c = GemvType::Q8_0.default_config();
        assert_eq!((c.rows, c.chunk_blocks), (rows_of(GemvType::Q8_0), 16));
        // F16/F32: the plain rows constant.
        let plain = define("DS4_GEMV_PLAIN_ROWS");
        assert_eq!(GemvType::F16.default_config().rows, plain);
        assert_eq!(GemvType::F32.default_config().rows, plain);
    }

    #[test]
    fn row_bytes_and_alignment() {
        assert_eq!(GemvType::Q8_0.row_bytes(4096).unwrap(), 4352);
        assert_eq!(GemvType::Q2K.row_bytes(2048).unwrap(), 672);
        assert_eq!(GemvType::Iq2Xxs.row_bytes(4096).unwrap(), 1056);
        assert_eq!(GemvType::Q4K.row_bytes(256).unwrap(), 144);
        assert_eq!(GemvType::F16.row_bytes(24).unwrap(), 48);
        assert!(GemvType::Q8_0.row_bytes(0).is_err());
        assert!(GemvType::Q8_0.row_bytes(33).is_err());
        // 128 Q8_0 values = 136 bytes: not 16-aligned; the message names the fix (256).
        let e = GemvType::Q8_0.row_bytes(128).unwrap_err().to_string();
        assert!(e.contains("multiple of 256"), "{e}");
        // One IQ2_XXS block is 66 bytes; eight make 528 = 33*16.
        let e = GemvType::Iq2Xxs.row_bytes(256).unwrap_err().to_string();
        assert!(e.contains("multiple of 2048"), "{e}");
        assert!(GemvType::F16.row_bytes(12).is_err());
        // MXFP4: 17-byte blocks, so rows of 512 values (272 bytes) are the smallest aligned.
        assert_eq!(GemvType::Mxfp4.row_bytes(4096).unwrap(), 2176);
        let e = GemvType::Mxfp4.row_bytes(256).unwrap_err().to_string();
        assert!(e.contains("multiple of 512"), "{e}");
    }

    #[test]
    fn wpr_fills_the_gpu_without_idle_warps() {
        // Many rows: one warp each.
        assert_eq!(choose_wpr(32768, 100, 6336), 1);
        // Few rows, long: up to 8 warps per row.
        assert_eq!(choose_wpr(24, 1000, 6336), 8);
        // Never more warps than chunks.
        assert_eq!(choose_wpr(24, 3, 6336), 2);
        assert_eq!(choose_wpr(24, 1, 6336), 1);
        assert_eq!(choose_wpr(2048, 8, 6336), 4);
    }

    /// The several-column grid covers every row, leaves no block without rows, and needs
    /// `rows / 2` times fewer blocks than the one-token grid of two rows per warp.
    #[test]
    fn cols_grid_covers_the_rows() {
        for n_out in [1u64, 7, 21, 256, 1000, 1024, 8192] {
            for wpr in [1u32, 2, 4, 8] {
                for rows in [1u32, 2, 4, 8] {
                    let g = u64::from(cols_grid_x(n_out, wpr, rows).unwrap());
                    let per = u64::from(GEMV_WARPS / wpr * rows);
                    assert!(g * per >= n_out, "{n_out} {wpr} {rows}");
                    assert!((g - 1) * per < n_out, "{n_out} {wpr} {rows}");
                }
            }
        }
        assert_eq!(cols_grid_x(1024, 8, 8).unwrap(), 128);
        assert_eq!(cols_grid_x(1024, 8, 2).unwrap(), 512);
        assert!(cols_grid_x(u64::MAX, 8, 1).is_err());
    }

    #[test]
    fn launch_covers_every_row() {
        for (t, n_in, n_out) in [
            (GemvType::Q8_0, 4096u64, 1024u64),
            (GemvType::Q8_0, 1024, 32768),
            (GemvType::Q8_0, 256, 3),
            (GemvType::F16, 16384, 24),
            (GemvType::Iq2Xxs, 4096, 2048),
            (GemvType::Q2K, 2048, 4096),
            (GemvType::Mxfp4, 2048, 4096),
            (GemvType::F32, 4096, 3),
        ] {
            for rows in [1, 2, 4] {
                let cfg = GemvConfig {
                    rows,
                    ..t.default_config()
                };
                let l = gemv_launch(t, cfg, n_in, n_out, 6336).unwrap();
                let rows_per_block = u64::from(GEMV_WARPS / l.wpr * rows);
                assert!(
                    u64::from(l.grid_x) * rows_per_block >= n_out,
                    "{t:?} {rows}"
                );
                assert!(
                    u64::from(l.grid_x - 1) * rows_per_block < n_out,
                    "{t:?} {rows}"
                );
                assert!([1, 2, 4, 8].contains(&l.wpr));
                assert_eq!(l.row_bytes, t.row_bytes(n_in).unwrap());
            }
        }
        let c = GemvType::Q8_0.default_config();
        assert!(gemv_launch(GemvType::Q8_0, c, 4096, 0, 1).is_err());
        assert!(gemv_launch(GemvType::Q8_0, c, 4096, 1 << 40, 1).is_err());
        let bad = GemvConfig {
            rows: 3,
            chunk_blocks: 8,
        };
        assert!(gemv_launch(GemvType::Q8_0, bad, 4096, 16, 1).is_err());
    }

    #[test]
    fn source_hash_changes_with_any_header() {
        let a = GEMV.hash();
        let other = KernelSource {
            headers: &[PORT_H],
            ..GEMV
        };
        assert_ne!(a, other.hash());
        assert_eq!(a, GEMV.hash());
    }

    /// Overlapped launches (`ds4_grid_wait`) are only safe if every kernel waits before it
    /// touches data an earlier kernel wrote: each entry point's body must call the wait
    /// itself or go through a GEMV row engine (which waits after its first weight loads).
    #[test]
    fn every_kernel_waits_for_the_previous_one() {
        // `ENGINE<`: the entry-point macros' engine parameter (each instantiated with one below).
        let engines = [
            "ds4_gemv_quant<",
            "ds4_gemv_plain<",
            "ds4_gemv_plain_cols<",
            "ds4_gemvq_quant<",
            "ds4_gemvq_jobs<",
            "ds4_gemvq_q8s<",
            "ENGINE<",
        ];
        let mut seen = 0;
        for (name, src) in FILES.iter().copied().flatten().copied() {
            let mut from = 0;
            while let Some(at) = src[from..].find("extern \"C\" __global__") {
                let start = from + at;
                let open = start + src[start..].find('{').expect("kernel body");
                // The body ends at the matching brace.
                let mut depth = 0;
                let mut end = open;
                for (i, c) in src[open..].char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = open + i;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                let body = &src[open..end];
                let head = &src[start..open.min(start + 200)];
                assert!(
                    body.contains("ds4_grid_wait()") || engines.iter().any(|e| body.contains(e)),
                    "{name}: kernel `{head}` never calls ds4_grid_wait"
                );
                seen += 1;
                from = end;
            }
        }
        assert!(seen >= 39, "found only {seen} kernels");
    }

    /// Activations are never read through the non-coherent read-only path, which the
    /// compiler may move above the wait for the previous kernel (docs/gpu.md §6: the race
    /// found on the H200). The ops module's kernels read activations (none of them weights
    /// worth it), so it has no `__ldg` at all; the GEMVs' x loader and the HCPre loads go through
    /// `ds4_ld_act`, and the port header's ds4_ld_act is a coherent load.
    #[test]
    fn activations_never_take_the_read_only_path() {
        for bad in ["ds4_ldg(", "__ldg("] {
            for (name, src) in std::iter::once(&("ops.cu", OPS.source)).chain(OPS_FILES) {
                assert!(!src.contains(bad), "{name} uses {bad}");
            }
        }
        let loader = GEMV_H
            .1
            .split("ds4_ld_x4(const float* p) {")
            .nth(1)
            .and_then(|rest| rest.split('}').next())
            .expect("ds4_gemv.h defines ds4_ld_x4");
        assert!(
            loader.contains("ds4_ld_act("),
            "ds4_ld_x4 must use ds4_ld_act: {loader}"
        );
        assert!(PORT_H
            .1
            .contains("ds4_ld_act(const T* p) { return __ldcg(p); }"));
    }

    #[test]
    fn q8_0_split_moves_codes_first_scales_last() {
        // Two rows of 64 values: blocks (scale s, codes c..c+31).
        let mut rows = Vec::new();
        for r in 0..2u8 {
            for b in 0..2u8 {
                rows.extend_from_slice(&[10 * r + b, 0xF0 + b]);
                rows.extend((0..32u8).map(|i| 100 * r + 40 * b + i));
            }
        }
        let orig = rows.clone();
        q8_0_split_rows(&mut rows, 64).unwrap();
        for r in 0..2usize {
            let (o, s) = (&orig[68 * r..68 * r + 68], &rows[68 * r..68 * r + 68]);
            for b in 0..2 {
                assert_eq!(&s[32 * b..32 * b + 32], &o[34 * b + 2..34 * b + 34]);
                assert_eq!(&s[64 + 2 * b..66 + 2 * b], &o[34 * b..34 * b + 2]);
            }
        }
        assert!(q8_0_split_rows(&mut rows[..67], 64).is_err());
        assert!(q8_0_split_rows(&mut rows, 48).is_err());
    }

    /// The host's limits for the register HCPre are the kernel's register arrays and block.
    #[test]
    fn hc_pre_regs_limits_match_the_kernel() {
        use crate::backend::ops::{HC_REGS_MAX_DIM, HC_REGS_MAX_STREAMS, HC_REGS_THREADS};
        let (ct, j) = (512usize, 8usize);
        for d in [
            format!("#define DS4_HCR_CT {ct}"),
            format!("#define DS4_HCR_J {j}"),
            format!("#define DS4_HCR_N {HC_REGS_MAX_STREAMS}"),
        ] {
            assert!(file("hc.cu").contains(&d), "hc.cu lacks `{d}`");
        }
        assert_eq!(HC_REGS_MAX_DIM, ct * j);
        assert_eq!(HC_REGS_THREADS as usize, ct + 32);
    }

    /// The host's launch of the fused HCPre (`op_hc_mix_pre`) follows the kernels' constants:
    /// columns per partial block, block size, streams held in registers, Gram entries, and
    /// enough register outputs per warp for 2n+n² mix rows.
    #[test]
    fn hc_mix_limits_match_the_kernel() {
        use crate::backend::ops::{
            HC_MIX_COLS, HC_MIX_GRAM, HC_MIX_MAX_PARTS, HC_MIX_THREADS, HC_REGS_MAX_STREAMS,
        };
        let (warps, maxo, n) = (8usize, 3usize, HC_REGS_MAX_STREAMS);
        for d in [
            format!("#define DS4_HCM_COLS {HC_MIX_COLS}"),
            format!("#define DS4_HCM_WARPS {warps}"),
            format!("#define DS4_HCM_N {n}"),
            format!("#define DS4_HCM_MAXO {maxo}"),
            format!("#define DS4_HCM_APPLY {HC_MIX_THREADS}"),
            format!("#define DS4_HCM_PARTS {HC_MIX_MAX_PARTS}"),
        ] {
            assert!(file("hc.cu").contains(&d), "hc.cu lacks `{d}`");
        }
        assert_eq!(HC_MIX_THREADS as usize, warps * 32);
        assert_eq!(HC_MIX_COLS, 2 * 32, "two columns per lane");
        assert_eq!(HC_MIX_GRAM, n * (n + 1) / 2);
        assert!(warps * maxo >= 2 * n + n * n);
    }

    /// The host packs at most `BANDS_MAX` bands into one `ds4_logit_bands` launch, the
    /// kernel's struct size.
    #[test]
    fn band_jobs_match_the_kernel() {
        use crate::backend::ops::BANDS_MAX;
        let d = format!("#define DS4_BANDS_MAX {BANDS_MAX}");
        assert!(file("sampling.cu").contains(&d), "sampling.cu lacks `{d}`");
    }

    /// The host sends the router to `ds4_router_token` (`ds4_router_warp`, the fused router
    /// GEMV) only within its register arrays: 32 lanes of DS4_RW_PER_LANE experts, one
    /// selection per lane, a warp per token.
    #[test]
    fn router_warp_limits_match_the_kernel() {
        use crate::backend::ops::{ROUTER_WARP_MAX_EXPERTS, ROUTER_WARP_MAX_K, ROUTER_WARP_TOKENS};
        let per_lane = ROUTER_WARP_MAX_EXPERTS / 32;
        let d = format!("#define DS4_RW_PER_LANE {per_lane}");
        assert!(QUANT_H.1.contains(&d), "ds4_quant.h lacks `{d}`");
        assert_eq!(ROUTER_WARP_MAX_EXPERTS, 32 * per_lane);
        assert_eq!(ROUTER_WARP_MAX_K, 32);
        assert_eq!(ROUTER_WARP_TOKENS, 256 / 32);
    }

    /// The host's limit on Q8_0 row width is the split kernel's shared-memory row.
    #[test]
    fn q8_split_limit_matches_the_kernel() {
        let define = format!("#define DS4_Q8S_MAX_IN {}", crate::backend::Q8_SPLIT_MAX_IN);
        assert!(
            file("dequant.cu").contains(&define),
            "dequant.cu lacks `{define}`"
        );
    }
}
