//! The engine ops: launches of `kernels/ops.cu` / `gemv.cu`. Arguments arrive checked by
//! `ds4_engine::validate` (the `Backend` impl in `mod.rs` calls it); what is checked here
//! is only what the kernels add: handle lookups and their capacity limits.

use ds4_engine::backend::{
    AttnArgs, BResult, BackendError, BandJob, CompSel, CompressorArgs, CompressorCall, HcArgs,
    HcPost, IBuf, IndexerArgs, IndexerCall, MoeArgs, NormRopeCall, RingStoreCall, RopeArgs,
    RouterArgs, Routing, Slice, Weight,
};
use ds4_engine::numerics::rope_freqs;
use ds4_gguf::GgmlType;
use ds4_placement::MemKind;

use super::launch::{grid_for, Arg};
use super::{gerr, GpuBackend, PrefillTiles};
use crate::api::{DeviceBuffer, GpuApi};
use crate::kernels::{GemvLaunch, GemvType};

/// f32 elements of one dequantized weight panel (256 MiB).
const PANEL_ELEMS: usize = 64 << 20;
/// Largest selection count routed experts run through the grouped GEMV.
pub(super) const GROUPED_MAX_SEL: usize = 64;
/// Output rows and tokens of one `ds4_mm_tiles` block (see tiles.cu).
const TILE_ROWS: usize = 128;
const TILE_TOKENS: usize = 64;
/// The same for `ds4_mm_tiles_wide` (dense matmuls of more than TILE_TOKENS tokens: each
/// weight decoded once per 128 tokens).
const WIDE_ROWS: usize = 64;
/// Output rows of one `ds4_mm_rtiles` block (tiles.cu DS4_RT_ROWS; its tokens: TILE_TOKENS).
const RTILE_ROWS: usize = 256;
const WIDE_TOKENS: usize = 128;
/// Most blocks per (row tile, group) that split a group's token tiles (`gridDim.z`).
const TILE_MAX_SPLIT: usize = 4;
/// Head dims the attention kernel holds in registers.
const ATT_MAX_HD: usize = 512;
/// Indexer rows scored per block (`DS4_IDX_ROWS` in ops.cu).
const IDX_ROWS_PER_BLOCK: usize = 16;
/// Length of the on-device 0..n sequence used as group ids.
const IOTA_LEN: usize = 64;
/// Keys per block of the split-key (decode) attention.
const ATT_KEYS_PER_SPLIT: usize = 32;
/// Splits the combine kernel holds weights for (`DS4_ATT_MAX_SPLITS` in ops.cu).
const ATT_MAX_SPLITS: usize = 1024;
/// Below this many (token, head) blocks attention splits the keys over blocks too.
const ATT_SPLIT_BELOW_BLOCKS: usize = 1024;
/// Chunks of at least this many tokens run the compressor in parallel over their completed
/// windows (`ds4_compressor_windows` + `ds4_compressor_tail`) instead of one block walking
/// the tokens (`ds4_compressor`); both give the same bits.
const COMP_WINDOWS_FROM: usize = 8;
/// Widest overlapping window the tail kernel holds in registers
/// (`DS4_COMP_MAX_OVERLAP_M` in ops.cu).
const COMP_MAX_OVERLAP_M: usize = 8;
/// The tensor-core indexer scores (`DS4_IMMA_*` in ops.cu): 64 heads of 128 dims, 4 tokens
/// and 512 rows per block; only for prefill chunks (decode keeps the exact-order kernel).
const IMMA_HEADS: usize = 64;
const IMMA_DIM: usize = 128;
const IMMA_TOKENS: usize = 4;
const IMMA_ROWS: usize = 512;
const IMMA_MIN_TOKENS: usize = 16;
/// Head dim and heads per block of the tensor-core attention (`DS4_AMMA_HD`,
/// `DS4_AMMA_HEADS` in ops.cu), and its threads.
const AMMA_HD: usize = 512;
const AMMA_HEADS: usize = 64;
const AMMA_THREADS: u32 = 512;
/// Fewest keys per split of the tensor-core decode attention: each block loads its 64
/// query rows and writes 64 partial rows whatever its keys, so splits of one 32-key tile
/// would mostly move partials.
const AMMA_MIN_KEYS_PER_SPLIT: usize = 64;
/// Sequences of one batched attention launch (`DS4_ATT_SEQS` in ops.cu).
const ATT_SEQS: usize = 16;
/// Bands per `ds4_logit_bands` launch (`DS4_BANDS_MAX`, kernels/ops.cu).
pub(crate) const BANDS_MAX: usize = 16;
/// Most partial-result bytes of one batched attention launch (beyond: one sequence at a
/// time, each with its own, smaller partials).
const ATT_BATCH_PART_BYTES: usize = 256 << 20;

/// Keys per split and splits of the tensor-core decode attention over `n_keys` keys: whole
/// 32-key tiles, at least [`AMMA_MIN_KEYS_PER_SPLIT`], at most [`ATT_MAX_SPLITS`] splits.
fn amma_splits(n_keys: usize) -> (usize, usize) {
    let kps = AMMA_MIN_KEYS_PER_SPLIT
        .max(n_keys.div_ceil(ATT_MAX_SPLITS))
        .next_multiple_of(32);
    (kps, n_keys.div_ceil(kps).max(1))
}

/// Whether `s` is row `i` (of `w` values) after `first` in the same buffer.
fn rows_follow(s: Slice, i: usize, w: usize, first: Slice) -> bool {
    s.buf == first.buf && s.off == first.off + i * w && s.len >= w
}

/// Whether no two of `slices` share an element (a batched launch writes them all at once).
fn pairwise_disjoint(slices: &[Slice]) -> bool {
    (0..slices.len()).all(|i| (0..i).all(|j| !slices[i].overlaps(slices[j])))
}

/// See [`GpuBackend::att_plan`].
struct AttPlan {
    mode: i32,
    crows: u64,
    ratio: usize,
    idx: u64,
    k_sel: usize,
    n_crows: usize,
    kps: usize,
    splits: usize,
    /// Whether this call alone runs the split-key kernels (else `ds4_attention`).
    split: bool,
    /// Keys of the call's last token (the most of any of its tokens).
    n_keys: usize,
}

/// One tile GEMM launch (`ds4_mm_tiles`): device addresses, shapes, and the groups (routed
/// experts at `offs`, or one group of `n_tok` tokens when `offs` is 0).
#[derive(Debug, Clone, Copy)]
struct TileMm {
    w: u64,
    w2: u64,
    mat_bytes: usize,
    ty: GgmlType,
    row_bytes: usize,
    n_rows: usize,
    cols: usize,
    x: u64,
    offs: u64,
    groups: usize,
    n_tok: usize,
    split: u32,
    y: u64,
    y2: u64,
    y_stride: usize,
    /// `ds4_mm_tiles_wide` (blocks of WIDE_ROWS x WIDE_TOKENS) instead of `ds4_mm_tiles`.
    wide: bool,
    /// `ds4_mm_rtiles` (IQ2_XXS decoded into the MMA registers, blocks of RTILE_ROWS rows;
    /// see [`GpuBackend::rtiles_for`]).
    regs: bool,
}

/// The routing side of a routed-expert op on tiles (device addresses and counts).
#[derive(Debug, Clone, Copy)]
struct MoeTiles {
    x: u64,
    ids: u64,
    weights: u64,
    out: u64,
    n_tok: usize,
    k: usize,
    n_exp: usize,
}

/// What a several-column launch's quantized input is: (input pointer, row stride, inputs per
/// row, rows). Equal keys within one matmul set are equal codes (`GpuBackend::q8_input_memo`).
pub(crate) type Q8InputKey = (u64, usize, usize, usize);

/// Decode rows of a Q8_0 matrix (or of `groups` matrices of `n_out` rows, `group_bytes`
/// apart, group g reading inputs g·n_in.. of each token and writing outputs g·n_out..) for
/// the several-column kernel. Addresses are device addresses; strides are in floats.
#[derive(Debug, Clone, Copy)]
struct ColsQ8 {
    w: u64,
    group_bytes: usize,
    groups: usize,
    n_in: usize,
    n_out: usize,
    x: u64,
    x_stride: usize,
    n_tok: usize,
    y: u64,
    y_stride: usize,
}

/// A matmul over rows `row0..row0+n_rows` of a quantized matrix at `w` (device address).
#[derive(Debug, Clone, Copy)]
struct Mm {
    w: u64,
    ty: GgmlType,
    row_bytes: usize,
    row0: usize,
    n_rows: usize,
    cols: usize,
    x: u64,
    x_stride: usize,
    n_tok: usize,
    y: u64,
    y_stride: usize,
    /// Int8 activations (the op's rule: act_q8 and one token in the op).
    q8: bool,
    /// Matrices the op's one-token launch runs side by side (1, or an op's groups or pair
    /// taken by the grouped GEMV): the warps per row of every launch of this matmul come
    /// from it, so a decode row sums exactly as that token's one-token launch sums it
    /// (docs/gpu.md §10).
    copies: u64,
}

impl Mm {
    /// The first weight row of `self` when a several-column GEMV launched as `l` can read
    /// it: rows of the launch's size, weights, x and every token's x 16-byte aligned.
    fn columns_base(&self, l: &GemvLaunch) -> Option<u64> {
        let wbase = self.w + (self.row0 * self.row_bytes) as u64;
        (l.row_bytes as usize == self.row_bytes
            && wbase.is_multiple_of(16)
            && self.x.is_multiple_of(16)
            && (4 * self.x_stride).is_multiple_of(16))
        .then_some(wbase)
    }
}

/// Forward passes of at most this many tokens (decode, batched decode) launch their kernels
/// overlapped (docs/gpu.md §6).
const OVERLAP_MAX_TOKENS: usize = 64;

/// `ds4_hc_pre_regs` (kernels/ops.cu): streams and width it holds in registers
/// (DS4_HCR_N, DS4_HCR_CT x DS4_HCR_J) and its block (DS4_HCR_CT + one Sinkhorn warp).
pub(crate) const HC_REGS_MAX_STREAMS: usize = 4;
pub(crate) const HC_REGS_MAX_DIM: usize = 512 * 8;
pub(crate) const HC_REGS_THREADS: u32 = 512 + 32;

/// `ds4_hc_mix_part` / `ds4_hc_mix_apply` (kernels/ops.cu): columns of each stream per
/// partial block (DS4_HCM_COLS), Gram entries per partial (DS4_HCM_G) and the block size
/// of both kernels (DS4_HCM_WARPS x 32 = DS4_HCM_APPLY).
pub(crate) const HC_MIX_COLS: usize = 64;
pub(crate) const HC_MIX_GRAM: usize = 10;
pub(crate) const HC_MIX_THREADS: u32 = 256;
/// Most partial blocks per token `ds4_hc_mix_apply` stages (DS4_HCM_PARTS): width ≤ 64 × 64.
pub(crate) const HC_MIX_MAX_PARTS: usize = 64;
/// Tokens per block of `ds4_hc_mix_part_tpb_*` (`DS4_HCM_TPB`).
pub(crate) const HC_MIX_TPB: usize = 4;
/// Passes of at least this many tokens use `ds4_hc_mix_part_tpb_*` (more than the 16
/// sequences of a batched decode step; `DS4_HC_MIX_TPB=n` overrides, 0: never).
pub(crate) const HC_MIX_TPB_FROM: usize = 17;

/// `ds4_router_warp` (kernels/ops.cu): experts per token it holds (32 lanes x
/// DS4_RW_PER_LANE), most selections (one per lane) and tokens per 256-thread block.
pub(crate) const ROUTER_WARP_MAX_EXPERTS: usize = 256;
pub(crate) const ROUTER_WARP_MAX_K: usize = 32;
pub(crate) const ROUTER_WARP_TOKENS: usize = 8;

fn i32v(op: &'static str, what: &str, v: usize) -> BResult<i32> {
    i32::try_from(v).map_err(|_| BackendError::Invalid {
        op,
        problem: format!("{what} = {v} exceeds the kernels' 32-bit range"),
    })
}

fn i32a(op: &'static str, what: &str, v: usize) -> BResult<Arg> {
    i32v(op, what, v).map(Arg::I32)
}

fn u(v: usize) -> Arg {
    Arg::U64(v as u64)
}

/// Threads of a one-block-per-row kernel: 1024 when the rows are few (decode: the whole row
/// is one multiprocessor's work, so more loads in flight), else 256.
fn row_threads(rows: usize) -> u32 {
    if rows < 64 {
        1024
    } else {
        256
    }
}

fn g32(v: usize) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

impl<D: GpuApi> GpuBackend<D> {
    /// The int8-activation rule (`Backend::set_activation_q8`, `set_decode_rows`): on, and
    /// no more tokens than decode rows.
    pub(super) fn q8_rows(&self, n_tok: usize) -> bool {
        self.act_q8 && n_tok <= self.decode_rows
    }

    /// Queues one matmul by the best path for its shape.
    fn mm(&mut self, m: Mm, op: &'static str) -> BResult<()> {
        if m.n_rows == 0 || m.n_tok == 0 {
            return Ok(());
        }
        let gty = GemvType::from_ggml(m.ty).ok();
        if m.q8 && ds4_gguf::quant::q8act::applies(m.ty) {
            // Decode rows: each token as it runs alone; Q8_0 several tokens per launch
            // (the same sums, the matrix read once for all of them).
            if m.n_tok > 1 && self.mm_q8_cols(m, op)? {
                return Ok(());
            }
            for t in 0..m.n_tok {
                self.mm_q8(
                    Mm {
                        x: m.x + (4 * t * m.x_stride) as u64,
                        y: m.y + (4 * t * m.y_stride) as u64,
                        n_tok: 1,
                        ..m
                    },
                    op,
                )?;
            }
            return Ok(());
        }
        if m.n_tok == 1 {
            if let Some(gty) = gty {
                let wbase = m.w + (m.row0 * m.row_bytes) as u64;
                if let Ok(l) = self
                    .gemv
                    .launch_for_grouped(gty, m.cols, m.n_rows, m.copies)
                {
                    if l.row_bytes as usize == m.row_bytes
                        && wbase.is_multiple_of(16)
                        && m.x.is_multiple_of(16)
                    {
                        let f = self.gemv.function(gty);
                        return self.launch_fn(
                            f,
                            gty.label(false),
                            (l.grid_x, 1, 1),
                            l.block,
                            &[
                                Arg::Ptr(wbase),
                                Arg::Ptr(m.x),
                                Arg::Ptr(m.y),
                                i32a(op, "cols", m.cols)?,
                                i32a(op, "rows", m.n_rows)?,
                                Arg::I32(l.wpr as i32),
                            ],
                        );
                    }
                }
            }
        }
        // Batched decode only for now: the several-column GEMV has been checked in the
        // kernel emulation, not yet on a GPU, so short prompt evaluations keep their kernel.
        if self.decode_rows > 1 && m.n_tok <= self.decode_rows && self.mm_plain_cols(m, op)? {
            return Ok(());
        }
        let ty = Arg::I32(m.ty.code() as i32);
        if m.n_tok < self.panel_from_tokens {
            return self.launch(
                "ds4_matmul_generic",
                (g32(m.n_rows.div_ceil(8)), g32(m.n_tok.div_ceil(4)), 1),
                256,
                &[
                    Arg::Ptr(m.w),
                    ty,
                    u(m.row_bytes),
                    u(m.row0),
                    i32a(op, "rows", m.n_rows)?,
                    i32a(op, "cols", m.cols)?,
                    Arg::Ptr(m.x),
                    u(m.x_stride),
                    i32a(op, "tokens", m.n_tok)?,
                    Arg::Ptr(m.y),
                    u(m.y_stride),
                ],
            );
        }
        if self.tiles == PrefillTiles::All && self.tiles_ok(m.ty, m.cols, m.w, m.row_bytes) {
            return self.mm_tiles(m, op);
        }
        // Q8_0 (split layout) rows with 16-byte aligned code runs take the vectorised kernel.
        let q8_fast = m.ty == GgmlType::Q8_0
            && m.cols.is_multiple_of(32)
            && m.row_bytes.is_multiple_of(16)
            && (m.w + (m.row0 * m.row_bytes) as u64).is_multiple_of(16);
        let f16_rows = m.ty == GgmlType::F16 && m.row_bytes == 2 * m.cols;
        if self.dense_half
            && (q8_fast || f16_rows)
            && self.cublas.as_ref().is_some_and(|c| c.has_half())
        {
            return self.mm_dense_half(m, op);
        }
        // Dequantized panels of rows, then the f32 GEMM.
        let panel_rows = (PANEL_ELEMS / m.cols.max(1)).clamp(1, m.n_rows);
        let panel = self.scratch("panel", 4 * panel_rows * m.cols)?;
        let mut r = 0;
        while r < m.n_rows {
            let n = panel_rows.min(m.n_rows - r);
            if q8_fast {
                self.q8_panel("ds4_dequant_q8_rows", &m, r, n, panel, op)?;
            } else {
                self.launch(
                    "ds4_dequant_rows",
                    (grid_for(n * m.cols), 1, 1),
                    256,
                    &[
                        Arg::Ptr(m.w),
                        ty,
                        u(m.row_bytes),
                        u(m.row0 + r),
                        i32a(op, "rows", n)?,
                        i32a(op, "cols", m.cols)?,
                        Arg::Ptr(panel),
                    ],
                )?;
            }
            if let Some(cb) = &self.cublas {
                // The device-time profile charges what follows to the GEMM, not to the
                // panel's dequantization before it.
                self.mark_launch("cublas_gemm_nt")?;
                // SAFETY: x holds n_tok rows of x_stride (checked by the op), the panel
                // n rows of cols, y n_tok rows of y_stride from column r; all device
                // memory of this context, alive until the stream drains.
                unsafe {
                    cb.gemm_nt(
                        m.x,
                        m.x_stride,
                        panel,
                        m.cols,
                        m.y + 4 * r as u64,
                        m.y_stride,
                        m.n_tok,
                        n,
                        m.cols,
                    )
                }
                .map_err(gerr(op))?;
                r += n;
                continue;
            }
            self.launch(
                "ds4_gemm_nt",
                (g32(n.div_ceil(64)), g32(m.n_tok.div_ceil(64)), 1),
                256,
                &[
                    Arg::Ptr(m.x),
                    u(m.x_stride),
                    Arg::Ptr(panel),
                    u(m.cols),
                    Arg::Ptr(m.y + 4 * r as u64),
                    u(m.y_stride),
                    i32a(op, "tokens", m.n_tok)?,
                    i32a(op, "rows", n)?,
                    i32a(op, "cols", m.cols)?,
                ],
            )?;
            r += n;
        }
        Ok(())
    }

    /// Rows `r..r + n` of a split-layout Q8_0 matmul decoded into `panel` by `kernel`
    /// (`ds4_dequant_q8_rows`: f32, `ds4_dequant_q8_rows_h`: f16; one thread per 16 codes).
    fn q8_panel(
        &self,
        kernel: &'static str,
        m: &Mm,
        r: usize,
        n: usize,
        panel: u64,
        op: &'static str,
    ) -> BResult<()> {
        self.launch(
            kernel,
            (g32(n), g32(m.cols.div_ceil(16 * 256)), 1),
            256,
            &[
                Arg::Ptr(m.w),
                u(m.row_bytes),
                u(m.row0 + r),
                i32a(op, "cols", m.cols)?,
                Arg::Ptr(panel),
            ],
        )
    }

    /// The matmul's activations (n_tok rows of cols, row stride x_stride) as contiguous
    /// halves in scratch, for the tile kernels and the f16 GEMM.
    fn x_as_half(&mut self, m: &Mm, op: &'static str) -> BResult<u64> {
        let xh = self.scratch("tiles_xd", 2 * m.n_tok * m.cols)?;
        self.launch(
            "ds4_to_half",
            (grid_for(m.n_tok * m.cols), 1, 1),
            256,
            &[
                Arg::Ptr(m.x),
                u(m.x_stride),
                i32a(op, "tokens", m.n_tok)?,
                i32a(op, "cols", m.cols)?,
                Arg::Ptr(xh),
            ],
        )?;
        Ok(xh)
    }

    /// A dense multi-token matmul through cuBLAS's f16 GEMM (docs/gpu.md §16): the
    /// activations as halves once, then per panel of rows the Q8_0 rows decoded to halves
    /// (F16 weights are used where they lie) and one `cublasGemmEx` with f32 accumulation.
    /// The caller has checked the weight type, the layout and that cuBLAS has GemmEx.
    fn mm_dense_half(&mut self, m: Mm, op: &'static str) -> BResult<()> {
        let xh = self.x_as_half(&m, op)?;
        let direct = m.ty == GgmlType::F16;
        let panel_rows = if direct {
            m.n_rows
        } else {
            (PANEL_ELEMS / m.cols.max(1)).clamp(1, m.n_rows)
        };
        let panel = if direct {
            0
        } else {
            self.scratch("panel", 2 * panel_rows * m.cols)?
        };
        let cb = self.cublas.as_ref().ok_or_else(|| {
            gerr(op)(crate::error::GpuError::BadArgument {
                op: "dense f16 GEMM",
                detail: "no cuBLAS".into(),
            })
        })?;
        let mut r = 0;
        while r < m.n_rows {
            let n = panel_rows.min(m.n_rows - r);
            let w = if direct {
                m.w + (m.row0 * m.row_bytes) as u64
            } else {
                self.q8_panel("ds4_dequant_q8_rows_h", &m, r, n, panel, op)?;
                panel
            };
            self.mark_launch("cublas_gemm_nt_f16")?;
            // SAFETY: xh holds n_tok rows of cols halves (written above), w n rows of cols
            // halves (the panel just decoded, or the F16 tensor's rows from row0 + r), y
            // n_tok rows of y_stride f32 from column r; all device memory of this
            // context, alive until the stream drains.
            unsafe {
                cb.gemm_nt_half(
                    xh,
                    m.cols,
                    w,
                    m.cols,
                    m.y + 4 * r as u64,
                    m.y_stride,
                    m.n_tok,
                    n,
                    m.cols,
                )
            }
            .map_err(gerr(op))?;
            r += n;
        }
        Ok(())
    }

    /// Whether `ds4_mm_tiles` decodes `ty` rows of `cols` values at `w` (row starts
    /// aligned for its loads: 16-byte loads of float rows, u16 loads of Q8_0 blocks, u32
    /// of the K-quants, so that the raw bytes prefetched across the tensor-core step take
    /// few registers; the K step needs `cols` in whole 32-value groups). GGUF tensors are
    /// 32-byte aligned, so real models always qualify.
    fn tiles_ok(&self, ty: GgmlType, cols: usize, w: u64, row_bytes: usize) -> bool {
        let align = match ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => 16,
            GgmlType::Q2K | GgmlType::Q4K => 4,
            GgmlType::Iq2Xxs | GgmlType::Q8_0 => 2,
            _ => return false,
        };
        cols.is_multiple_of(32)
            && cols > 0
            && w.is_multiple_of(align)
            && row_bytes.is_multiple_of(align as usize)
    }

    /// Whether a prefill's routed experts (more than [`GROUPED_MAX_SEL`] selections, not
    /// decode rows) take the tiles: on, and every matrix as [`Self::tiles_ok`] asks.
    pub(super) fn moe_takes_tiles(&self, gate: Weight, up: Weight, down: Weight) -> bool {
        let ok = |w: Weight, cols: usize| {
            let (Ok(gw), Ok(p)) = (self.weight(w, "moe"), self.wraw(w, "moe")) else {
                return false;
            };
            self.tiles_ok(gw.info.ty, cols, p, gw.row_bytes)
        };
        let (d, f) = (gate.info.cols(), gate.info.rows());
        self.tiles != PrefillTiles::Off && ok(gate, d) && ok(up, d) && ok(down, f)
    }

    /// Whether a routed-expert matmul takes `ds4_mm_rtiles` (tiles.cu: the weights decoded
    /// straight into the MMA registers; `DS4_RTILES=1`, off until the H200 has measured
    /// it): IQ2_XXS or Q2_K rows of a multiple of 256 values, aligned as [`Self::tiles_ok`]
    /// asks, and the device allowing the kernel's shared memory.
    fn rtiles_for(&self, ty: GgmlType, cols: usize, row_bytes: usize, w: u64, w2: u64) -> bool {
        // 0 bytes: a build without mma.sync, whose ds4_mm_rtiles is a NaN stub (tiles.cu).
        self.rtiles
            && self.rtiles_smem > 0
            && matches!(ty, GgmlType::Iq2Xxs | GgmlType::Q2K)
            && cols >= 256
            && cols.is_multiple_of(256)
            && self.tiles_ok(ty, cols, w, row_bytes)
            && (w2 == 0 || self.tiles_ok(ty, cols, w2, row_bytes))
            && self.rtiles_smem <= self.max_dyn_smem
    }

    /// One `ds4_mm_tiles` launch: `y = W·x` for every group (see tiles.cu), with a second
    /// matrix of the same shape when `t.w2`/`t.y2` are set.
    fn launch_tiles(&mut self, t: TileMm, op: &'static str) -> BResult<()> {
        let groups = t.groups * if t.w2 != 0 { 2 } else { 1 };
        let (kernel, rows, smem) = if t.regs {
            ("ds4_mm_rtiles", RTILE_ROWS, self.rtiles_smem)
        } else if t.wide {
            ("ds4_mm_tiles_wide", WIDE_ROWS, self.tiles_smem)
        } else {
            ("ds4_mm_tiles", TILE_ROWS, self.tiles_smem)
        };
        if smem > self.max_dyn_smem {
            return Err(BackendError::Invalid {
                op,
                problem: format!(
                    "{kernel} was built for {smem} bytes of shared memory; this device allows {}",
                    self.max_dyn_smem
                ),
            });
        }
        self.launch_smem(
            kernel,
            (g32(t.n_rows.div_ceil(rows)), g32(groups), t.split),
            256,
            smem,
            &[
                Arg::Ptr(t.w),
                Arg::Ptr(t.w2),
                u(t.mat_bytes),
                Arg::I32(t.ty.code() as i32),
                u(t.row_bytes),
                i32a(op, "rows", t.n_rows)?,
                i32a(op, "cols", t.cols)?,
                Arg::Ptr(t.x),
                Arg::Ptr(t.offs),
                i32a(op, "tokens", t.n_tok)?,
                Arg::Ptr(t.y),
                Arg::Ptr(t.y2),
                u(t.y_stride),
            ],
        )
    }

    /// A dense multi-token matmul on tiles: the activations as halves, then one launch.
    fn mm_tiles(&mut self, m: Mm, op: &'static str) -> BResult<()> {
        let xh = self.x_as_half(&m, op)?;
        // More than one token tile of 64: blocks of 128 tokens (half the weight decoding).
        let wide = self.tiles_wide && m.n_tok > TILE_TOKENS;
        let tokens = if wide { WIDE_TOKENS } else { TILE_TOKENS };
        self.launch_tiles(
            TileMm {
                w: m.w + (m.row0 * m.row_bytes) as u64,
                w2: 0,
                mat_bytes: 0,
                ty: m.ty,
                row_bytes: m.row_bytes,
                n_rows: m.n_rows,
                cols: m.cols,
                x: xh,
                offs: 0,
                groups: 1,
                n_tok: m.n_tok,
                split: g32(m.n_tok.div_ceil(tokens)),
                y: m.y,
                y2: 0,
                y_stride: m.y_stride,
                wide,
                regs: false,
            },
            op,
        )
    }

    /// Queues `m` (several decode rows of a Q8_0 matrix) through the several-column int8
    /// GEMV in groups of at most `cols_max` tokens; false (nothing queued) when the
    /// shape or alignment does not suit it. The warps per row are the one-token launch's,
    /// so every row is summed exactly as [`Self::mm_q8`] sums it alone.
    fn mm_q8_cols(&mut self, m: Mm, op: &'static str) -> BResult<bool> {
        if m.ty != GgmlType::Q8_0 {
            return Ok(false);
        }
        let Ok(l) = self
            .gemv
            .q8_launch(GemvType::Q8_0, m.cols, m.n_rows, m.copies)
        else {
            return Ok(false);
        };
        let Some(w) = m.columns_base(&l) else {
            return Ok(false);
        };
        let c = ColsQ8 {
            w,
            group_bytes: 0,
            groups: 1,
            n_in: m.cols,
            n_out: m.n_rows,
            x: m.x,
            x_stride: m.x_stride,
            n_tok: m.n_tok,
            y: m.y,
            y_stride: m.y_stride,
        };
        self.q8_cols(c, &l, op)
    }

    /// Queues `c` through `ds4_quantize_q8_rows` (every input row quantized once) and the
    /// several-column Q8_0 GEMV in groups of at most `cols_max` tokens, launched as `l`
    /// (the one-token launch's warps per row); false (nothing queued) when the shape does not
    /// suit it: inputs wider than the kernel's shared memory takes for two tokens or not a
    /// multiple of 32, or a group's inputs not following each other.
    fn q8_cols(&mut self, c: ColsQ8, l: &GemvLaunch, op: &'static str) -> BResult<bool> {
        let n_in = c.n_in;
        let per = self
            .gemv
            .cols_max
            .min(self.gemv.q8_cols_codes / n_in.max(1));
        if per < 2
            || n_in > self.gemv.q8_max_in
            || !n_in.is_multiple_of(32)
            || c.groups == 0
            || (c.groups > 1 && c.x_stride != c.groups * n_in)
        {
            return Ok(false);
        }
        // Rows (token, group): contiguous when grouped, else x_stride apart.
        let rows = c.n_tok * c.groups;
        let row_stride = if c.groups > 1 { n_in } else { c.x_stride };
        let q = self.scratch("q8c_codes", rows * n_in)?;
        let d = self.scratch("q8c_scales", 4 * rows * (n_in / 32))?;
        let s16 = self.scratch("q8c_sums", 4 * rows * (n_in / 16))?;
        // Within a matmul set the scratch may already hold this input's codes (only these
        // launches write it, and the set's matmuls write no input; docs/gpu.md §29). The
        // codes do not depend on the launch's block size.
        let key = (c.x, row_stride, n_in, rows);
        if self.q8_input_memo != Some(Some(key)) {
            self.launch_fn(
                &self.gemv.q8_quantize_rows,
                "quantize_q8_rows",
                (g32(rows), 1, 1),
                l.block,
                &[
                    Arg::Ptr(c.x),
                    u(row_stride),
                    i32a(op, "cols", n_in)?,
                    Arg::Ptr(q),
                    Arg::Ptr(d),
                    Arg::Ptr(s16),
                ],
            )?;
            if self.q8_input_memo.is_some() {
                self.q8_input_memo = Some(Some(key));
            }
        }
        let grid = (
            self.gemv.q8_grid_x(l.grid_x, g32(c.groups)),
            g32(c.groups),
            1,
        );
        let mut t = 0;
        while t < c.n_tok {
            let n = per.min(c.n_tok - t);
            let first = t * c.groups;
            let smem = self.gemv.q8_cols_smem(n * n_in);
            self.launch_fn_smem(
                &self.gemv.q8_cols,
                self.shape_name("gemvq_cols_q8_0", c.n_out, n_in, c.groups),
                grid,
                (l.block, smem),
                &[
                    Arg::Ptr(c.w),
                    u(c.group_bytes),
                    Arg::Ptr(q + (first * n_in) as u64),
                    Arg::Ptr(d + (4 * first * (n_in / 32)) as u64),
                    i32a(op, "groups", c.groups)?,
                    Arg::Ptr(c.y + (4 * t * c.y_stride) as u64),
                    u(c.y_stride),
                    i32a(op, "cols", n_in)?,
                    i32a(op, "rows", c.n_out)?,
                    i32a(op, "tokens", n)?,
                    Arg::I32(l.wpr as i32),
                ],
            )?;
            t += n;
        }
        Ok(true)
    }

    /// Queues `m` (decode rows of an F32 or F16 matrix: batched decode) through the
    /// several-column plain GEMV in groups of at most `cols_max` tokens, with the one-token
    /// launch's warps per row (its own rows per warp and grid, docs/gpu.md §35), so each
    /// token's row is summed as the one-token GEMV sums it; false when it does not apply. (Wider steps had gone to the generic matmul,
    /// whose other summation order broke batched-equals-alone at 16 sequences on the H200.)
    fn mm_plain_cols(&mut self, m: Mm, op: &'static str) -> BResult<bool> {
        let idx = match m.ty {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            _ => return Ok(false),
        };
        let Ok(gty) = GemvType::from_ggml(m.ty) else {
            return Ok(false);
        };
        let Ok(l) = self
            .gemv
            .launch_for_grouped(gty, m.cols, m.n_rows, m.copies)
        else {
            return Ok(false);
        };
        let Some(wbase) = m.columns_base(&l) else {
            return Ok(false);
        };
        let per = self.gemv.cols_max;
        if per == 0 {
            return Ok(false);
        }
        let warps = u64::from(l.grid_x) * u64::from(crate::kernels::GEMV_WARPS);
        if warps < self.cols_split_warps && m.n_tok <= 65_535 {
            // A small one-token grid: one column per grid y, each block a one-token block.
            self.launch_fn(
                &self.gemv.plain_colsplit[idx],
                if idx == 0 {
                    "gemv_colsplit_f32"
                } else {
                    "gemv_colsplit_f16"
                },
                (l.grid_x, g32(m.n_tok), 1),
                l.block,
                &[
                    Arg::Ptr(wbase),
                    Arg::Ptr(m.x),
                    u(m.x_stride),
                    Arg::Ptr(m.y),
                    u(m.y_stride),
                    i32a(op, "cols", m.cols)?,
                    i32a(op, "rows", m.n_rows)?,
                    Arg::I32(l.wpr as i32),
                ],
            )?;
            return Ok(true);
        }
        self.launch_column_groups(idx, &l, wbase, m, per, op)?;
        Ok(true)
    }

    /// Launches `m`'s tokens through the several-column plain GEMV `idx` (0: F32, 1: F16)
    /// in groups of at most `per`, as `l`.
    fn launch_column_groups(
        &self,
        idx: usize,
        l: &GemvLaunch,
        wbase: u64,
        m: Mm,
        per: usize,
        op: &'static str,
    ) -> BResult<()> {
        let f = &self.gemv.plain_cols[idx];
        let label = if idx == 0 {
            "gemv_cols_f32"
        } else {
            "gemv_cols_f16"
        };
        let grid_x = crate::kernels::cols_grid_x(m.n_rows as u64, l.wpr, self.gemv.plain_cols_rows)
            .map_err(gerr(op))?;
        let mut t = 0;
        while t < m.n_tok {
            let n = per.min(m.n_tok - t);
            self.launch_fn(
                f,
                self.shape_name(label, m.n_rows, m.cols, n),
                (grid_x, 1, 1),
                l.block,
                &[
                    Arg::Ptr(wbase),
                    Arg::Ptr(m.x + (4 * t * m.x_stride) as u64),
                    u(m.x_stride),
                    Arg::Ptr(m.y + (4 * t * m.y_stride) as u64),
                    u(m.y_stride),
                    i32a(op, "cols", m.cols)?,
                    i32a(op, "rows", m.n_rows)?,
                    i32a(op, "tokens", n)?,
                    Arg::I32(l.wpr as i32),
                ],
            )?;
            t += n;
        }
        Ok(())
    }

    fn mm_q8(&mut self, m: Mm, op: &'static str) -> BResult<()> {
        if m.cols > self.gemv.q8_max_in || !m.cols.is_multiple_of(32) {
            return Err(BackendError::Invalid {
                op,
                problem: format!(
                    "int8 activations: an input of {} values (at most {}, a multiple of 32)",
                    m.cols, self.gemv.q8_max_in
                ),
            });
        }
        let gty = GemvType::from_ggml(m.ty).map_err(gerr(op))?;
        let wbase = m.w + (m.row0 * m.row_bytes) as u64;
        if let (Ok(l), Some((f, _))) = (
            self.gemv.q8_launch(gty, m.cols, m.n_rows, m.copies),
            self.gemv.q8_functions(gty),
        ) {
            if l.row_bytes as usize == m.row_bytes
                && wbase.is_multiple_of(16)
                && m.x.is_multiple_of(16)
            {
                return self.launch_fn_smem(
                    f,
                    gty.label_q8(false),
                    (self.gemv.q8_grid_x(l.grid_x, 1), 1, 1),
                    (l.block, self.gemv.q8_smem(gty)),
                    &[
                        Arg::Ptr(wbase),
                        Arg::Ptr(m.x),
                        Arg::Ptr(m.y),
                        i32a(op, "cols", m.cols)?,
                        i32a(op, "rows", m.n_rows)?,
                        Arg::I32(l.wpr as i32),
                    ],
                );
            }
        }
        self.launch_fn(
            &self.gemv.q8_generic,
            "gemvq_generic",
            (g32(m.n_rows.div_ceil(8)), 1, 1),
            256,
            &[
                Arg::Ptr(wbase),
                Arg::I32(m.ty.code() as i32),
                u(m.row_bytes),
                Arg::Ptr(m.x),
                Arg::Ptr(m.y),
                i32a(op, "cols", m.cols)?,
                i32a(op, "rows", m.n_rows)?,
            ],
        )
    }

    /// One decode row of `out = W · swiglu(gate, up, clamp)` through the int8 GEMV that
    /// computes SwiGLU while it quantizes its input (`ds4_gemv_swiglu_q_<t>`, docs/gpu.md
    /// §17); `Ok(false)` (nothing launched) where the type, shape or alignment does not
    /// allow it. The caller has validated the shapes and checked the int8 rule.
    pub(super) fn op_swiglu_gemv(
        &mut self,
        gate: Slice,
        up: Slice,
        clamp: f32,
        w: Weight,
        out: Slice,
    ) -> BResult<bool> {
        const OP: &str = "swiglu_matmul";
        let (gp, up_) = (self.fptr(gate, OP)?, self.fptr(up, OP)?);
        self.input_stage_gemv(OP, w, out, [gp, up_], Arg::F32(clamp), None, |g, t| {
            g.q8_swiglu_function(t)
        })
    }

    /// One decode row of `out = W · (rms_norm(x) · norm)` through the int8 GEMV that
    /// normalizes its input itself (`ds4_gemv_rmsnorm_q_<t>`, docs/gpu.md §17: the same
    /// scale as the one-row `ds4_rms_norm` launch, bit for bit), the normalized row also
    /// written to `h`; `Ok(false)` where it does not apply. The caller has validated the
    /// shapes and checked the int8 rule.
    pub(super) fn op_rms_norm_gemv(
        &mut self,
        x: Slice,
        norm: Weight,
        eps: f32,
        h: Slice,
        w: Weight,
        out: Slice,
    ) -> BResult<bool> {
        const OP: &str = "rms_norm_matmul";
        let xp = self.fptr(x, OP)?;
        let np = self.wvec(norm, OP, w.info.cols())?;
        let hp = self.fptr(h, OP)?;
        if !hp.is_multiple_of(16) {
            return Ok(false);
        }
        self.input_stage_gemv(OP, w, out, [xp, np], Arg::F32(eps), Some(hp), |g, t| {
            g.q8_rmsnorm_function(t)
        })
    }

    /// One decode row of `out_a` with the attention output's de-rotation in its input
    /// stage (`ds4_gemv_grouped_rope_q_q8_0`, docs/gpu.md §17): all groups in one launch as
    /// `op_matmul_grouped`'s one-token path, each block rotating its heads on the way in;
    /// `Ok(false)` (nothing launched) where the weight is not Q8_0 in a grouped-GEMV shape,
    /// a group does not start at a head, or a pointer is misaligned.
    pub(super) fn op_rope_grouped_gemv(
        &mut self,
        x: Slice,
        a: RopeArgs,
        w: Weight,
        groups: usize,
        y: Slice,
    ) -> BResult<bool> {
        const OP: &str = "rope_matmul_grouped";
        let (cols, rows) = (w.info.cols(), w.info.rows());
        let r = rows / groups.max(1);
        let gw = self.weight(w, OP)?;
        let (ty, row_bytes) = (gw.info.ty, gw.row_bytes);
        let (hd, rd) = (a.head_dim, a.freq.rope_dim);
        let wp = self.wraw(w, OP)?;
        let (xp, yp) = (self.fptr(x, OP)?, self.fptr(y, OP)?);
        let shape_ok = ty == GgmlType::Q8_0
            && groups > 0
            && a.n_rows == 1
            && a.row_pos.is_none()
            && hd > 0
            && a.n_heads * hd == groups * cols
            && cols.is_multiple_of(hd)
            && (hd - rd).is_multiple_of(4)
            && rd.is_multiple_of(4)
            && cols <= self.gemv.q8_max_in
            && cols.is_multiple_of(32)
            && self.grouped_ok(ty, cols, r, wp)
            && xp.is_multiple_of(16);
        if !shape_ok {
            return Ok(false);
        }
        let Ok(l) = self.gemv.q8_launch(GemvType::Q8_0, cols, r, groups as u64) else {
            return Ok(false);
        };
        if l.row_bytes as usize != row_bytes {
            return Ok(false);
        }
        let fp = self.freqs_ptr(&a)?;
        let grid = (self.gemv.q8_grid_x(l.grid_x, g32(groups)), g32(groups), 1);
        self.launch_fn(
            &self.gemv.q8_grouped_rope,
            GemvType::Q8_0.label_q8(true),
            grid,
            l.block,
            &[
                Arg::Ptr(wp),
                u(r * row_bytes),
                Arg::Ptr(xp),
                Arg::Ptr(fp),
                i32a(OP, "head dim", hd)?,
                i32a(OP, "rope dim", rd)?,
                Arg::F32(a.pos0 as f32),
                Arg::I32(i32::from(a.inverse)),
                Arg::Ptr(yp),
                i32a(OP, "n_in", cols)?,
                i32a(OP, "n_out", r)?,
                Arg::I32(l.wpr as i32),
            ],
        )?;
        Ok(true)
    }

    /// Launches a one-row int8 GEMV whose input stage forms the input from two vectors
    /// `inputs` and a constant (`(W, in0, in1, constant, y, n_in, n_out, wpr[, tail])`),
    /// picked by `pick`; `Ok(false)` (nothing launched) where the weight type has no such
    /// kernel, the input is too wide or not a multiple of 32, or a pointer is not 16-byte
    /// aligned.
    #[allow(clippy::too_many_arguments)]
    fn input_stage_gemv(
        &mut self,
        op: &'static str,
        w: Weight,
        out: Slice,
        inputs: [u64; 2],
        constant: Arg,
        tail: Option<u64>,
        pick: impl for<'a> Fn(&'a super::GemvSet<D>, GemvType) -> Option<&'a D::Function>,
    ) -> BResult<bool> {
        let (cols, rows) = (w.info.cols(), w.info.rows());
        let gw = self.weight(w, op)?;
        let (ty, row_bytes) = (gw.info.ty, gw.row_bytes);
        let Ok(gt) = GemvType::from_ggml(ty) else {
            return Ok(false);
        };
        if !ds4_gguf::quant::q8act::applies(ty)
            || cols > self.gemv.q8_max_in
            || !cols.is_multiple_of(32)
        {
            return Ok(false);
        }
        let (Ok(l), Some(f)) = (self.gemv.q8_launch(gt, cols, rows, 1), pick(&self.gemv, gt))
        else {
            return Ok(false);
        };
        let wp = self.wraw(w, op)?;
        let yp = self.fptr(out, op)?;
        if l.row_bytes as usize != row_bytes
            || !wp.is_multiple_of(16)
            || inputs.iter().any(|p| !p.is_multiple_of(16))
        {
            return Ok(false);
        }
        let mut args = vec![
            Arg::Ptr(wp),
            Arg::Ptr(inputs[0]),
            Arg::Ptr(inputs[1]),
            constant,
            Arg::Ptr(yp),
            i32a(op, "cols", cols)?,
            i32a(op, "rows", rows)?,
            Arg::I32(l.wpr as i32),
        ];
        args.extend(tail.map(Arg::Ptr));
        let grid = (self.gemv.q8_grid_x(l.grid_x, 1), 1, 1);
        self.launch_fn(f, gt.label_q8(false), grid, l.block, &args)?;
        Ok(true)
    }

    pub(super) fn op_matmul(
        &mut self,
        w: Weight,
        mat: usize,
        x: Slice,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()> {
        self.matmul_copies(w, mat, x, n_tok, y, 1)
    }

    /// [`Self::op_matmul`] with the warps per row of a one-token launch of `copies`
    /// matrices side by side ([`Mm::copies`]).
    fn matmul_copies(
        &mut self,
        w: Weight,
        mat: usize,
        x: Slice,
        n_tok: usize,
        y: Slice,
        copies: u64,
    ) -> BResult<()> {
        const OP: &str = "matmul";
        let (cols, rows) = (w.info.cols(), w.info.rows());
        let gw = self.weight(w, OP)?;
        let (ty, row_bytes) = (gw.info.ty, gw.row_bytes);
        let wp = self.wraw(w, OP)? + (mat * rows * row_bytes) as u64;
        let (xp, yp) = (self.fptr(x, OP)?, self.fptr(y, OP)?);
        self.mm(
            Mm {
                w: wp,
                ty,
                row_bytes,
                row0: 0,
                n_rows: rows,
                cols,
                x: xp,
                x_stride: cols,
                n_tok,
                y: yp,
                y_stride: rows,
                q8: self.q8_rows(n_tok),
                copies,
            },
            OP,
        )
    }

    pub(super) fn op_matmul_grouped(
        &mut self,
        w: Weight,
        groups: usize,
        x: Slice,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()> {
        const OP: &str = "matmul_grouped";
        let (cols, rows) = (w.info.cols(), w.info.rows());
        let r = rows / groups;
        let gw = self.weight(w, OP)?;
        let (ty, row_bytes) = (gw.info.ty, gw.row_bytes);
        let wp = self.wraw(w, OP)?;
        let (xp, yp) = (self.fptr(x, OP)?, self.fptr(y, OP)?);
        // One token: all groups in one launch of the grouped GEMV (group g = "expert" g of
        // r rows reading its own slice of x), instead of one launch per group. Several
        // tokens (decode rows) run per group with that launch's warps per row.
        let one_launch = groups <= IOTA_LEN
            && self.grouped_ok(ty, cols, r, wp)
            && xp.is_multiple_of(16)
            && (4 * cols).is_multiple_of(16);
        if n_tok == 1 && one_launch {
            let ids = self.iota()?;
            return self.grouped(
                ty,
                (wp, None),
                r * row_bytes,
                ids,
                groups,
                xp,
                1,
                (yp, None),
                (groups, groups),
                cols,
                r,
                self.act_q8,
            );
        }
        let copies = if one_launch { groups as u64 } else { 1 };
        // Decode rows of a Q8_0 out_a: every group in one several-column launch per 8 tokens
        // (grid y = group) with that one-token launch's warps per row.
        if n_tok > 1 && one_launch && self.q8_rows(n_tok) && ty == GgmlType::Q8_0 {
            if let Ok(l) = self.gemv.q8_launch(GemvType::Q8_0, cols, r, copies) {
                if l.row_bytes as usize == row_bytes && (r * row_bytes).is_multiple_of(16) {
                    let c = ColsQ8 {
                        w: wp,
                        group_bytes: r * row_bytes,
                        groups,
                        n_in: cols,
                        n_out: r,
                        x: xp,
                        x_stride: groups * cols,
                        n_tok,
                        y: yp,
                        y_stride: rows,
                    };
                    if self.q8_cols(c, &l, OP)? {
                        return Ok(());
                    }
                }
            }
        }
        for g in 0..groups {
            self.mm(
                Mm {
                    w: wp,
                    ty,
                    row_bytes,
                    row0: g * r,
                    n_rows: r,
                    cols,
                    x: xp + (4 * g * cols) as u64,
                    x_stride: groups * cols,
                    n_tok,
                    y: yp + (4 * g * r) as u64,
                    y_stride: rows,
                    q8: self.q8_rows(n_tok),
                    copies,
                },
                OP,
            )?;
        }
        Ok(())
    }

    pub(super) fn op_rms_norm(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        rows: usize,
        width: usize,
        eps: f32,
        out: Slice,
    ) -> BResult<()> {
        const OP: &str = "rms_norm";
        if width == 0 || rows == 0 {
            return Ok(());
        }
        let wp = match w {
            Some(w) => self.wvec(w, OP, width)?,
            None => 0,
        };
        let (xp, op_) = (self.fptr(x, OP)?, self.fptr(out, OP)?);
        self.launch(
            "ds4_rms_norm",
            (g32(rows), 1, 1),
            row_threads(rows),
            &[
                Arg::Ptr(xp),
                Arg::Ptr(wp),
                Arg::Ptr(op_),
                i32a(OP, "width", width)?,
                Arg::F32(eps),
            ],
        )
    }

    fn freqs_ptr(&mut self, a: &RopeArgs) -> BResult<u64> {
        let f = &a.freq;
        let y = f.yarn;
        let key = [
            f.base.to_bits(),
            f.rope_dim as u32,
            u32::from(y.is_some()),
            y.map_or(0, |y| y.factor.to_bits()),
            y.map_or(0, |y| y.original_context as u32),
            y.map_or(0, |y| y.beta_fast.to_bits()),
            y.map_or(0, |y| y.beta_slow.to_bits()),
        ];
        if !self.freqs.contains_key(&key) {
            let v = rope_freqs(f);
            let raw: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            let mut b = self
                .dev
                .alloc(MemKind::Device, raw.len().max(4))
                .map_err(gerr("rope"))?;
            b.write(0, &raw).map_err(gerr("rope"))?;
            self.freqs.insert(key, b);
        }
        Ok(self.freqs[&key].device_address())
    }

    /// The device address of `a.row_pos` (0: positions from `pos0`/`pos_step`).
    fn row_pos_ptr(&self, a: &RopeArgs, op: &'static str) -> BResult<u64> {
        a.row_pos.map_or(Ok(0), |p| self.iptr(p, op))
    }

    pub(super) fn op_rope(&mut self, x: Slice, a: RopeArgs) -> BResult<()> {
        const OP: &str = "rope";
        let rd = a.freq.rope_dim;
        let n = a.n_rows * a.n_heads * (rd / 2);
        if n == 0 {
            return Ok(());
        }
        let fp = self.freqs_ptr(&a)?;
        let xp = self.fptr(x, OP)?;
        let pp = self.row_pos_ptr(&a, OP)?;
        self.launch(
            "ds4_rope",
            (grid_for(n), 1, 1),
            256,
            &[
                Arg::Ptr(xp),
                Arg::Ptr(fp),
                i32a(OP, "rows", a.n_rows)?,
                i32a(OP, "heads", a.n_heads)?,
                i32a(OP, "head dim", a.head_dim)?,
                i32a(OP, "rope dim", rd)?,
                u(a.pos0),
                u(a.pos_step),
                Arg::Ptr(pp),
                Arg::I32(i32::from(a.inverse)),
            ],
        )
    }

    pub(super) fn op_qat_fp8(
        &mut self,
        x: Slice,
        rows: usize,
        width: usize,
        n_dims: usize,
    ) -> BResult<()> {
        const OP: &str = "qat_fp8";
        let n = rows * n_dims.div_ceil(64);
        if n == 0 {
            return Ok(());
        }
        let xp = self.fptr(x, OP)?;
        // One 32-lane warp per 64-value block.
        self.launch(
            "ds4_qat_fp8",
            (grid_for(n * 32), 1, 1),
            256,
            &[
                Arg::Ptr(xp),
                i32a(OP, "rows", rows)?,
                i32a(OP, "width", width)?,
                i32a(OP, "dims", n_dims)?,
            ],
        )
    }

    pub(super) fn op_qat_hfp4(&mut self, x: Slice, rows: usize, width: usize) -> BResult<()> {
        const OP: &str = "qat_hadamard_fp4";
        if !width.is_power_of_two() || width > 4096 {
            return Err(BackendError::Invalid {
                op: OP,
                problem: format!("width {width} is not a power of two up to 4096"),
            });
        }
        if rows == 0 {
            return Ok(());
        }
        if width < 32 {
            return Err(BackendError::Invalid {
                op: OP,
                problem: format!("width {width} is less than one FP4 block of 32"),
            });
        }
        let norm = (1.0 / (width as f64).sqrt()) as f32;
        let xp = self.fptr(x, OP)?;
        self.launch(
            "ds4_qat_hfp4",
            (g32(rows), 1, 1),
            256,
            &[Arg::Ptr(xp), i32a(OP, "width", width)?, Arg::F32(norm)],
        )
    }

    /// One block per row: RoPE, then the Hadamard FP4 simulation, when the rows are the
    /// rotated heads (one row per head, width = head dim, forward rotation); else the two
    /// launches.
    pub(super) fn op_rope_qat_hfp4(
        &mut self,
        x: Slice,
        a: RopeArgs,
        rows: usize,
        width: usize,
    ) -> BResult<()> {
        const OP: &str = "qat_hadamard_fp4";
        let rd = a.freq.rope_dim;
        let fits = self.fusions.rope_qat
            && !a.inverse
            && a.head_dim == width
            && a.n_rows * a.n_heads == rows
            && rd <= width
            && rd.is_multiple_of(2)
            && width.is_power_of_two()
            && (32..=4096).contains(&width);
        if !fits {
            self.op_rope(x, a)?;
            return self.op_qat_hfp4(x, rows, width);
        }
        if rows == 0 {
            return Ok(());
        }
        let norm = (1.0 / (width as f64).sqrt()) as f32;
        let fp = self.freqs_ptr(&a)?;
        let xp = self.fptr(x, OP)?;
        let pp = self.row_pos_ptr(&a, OP)?;
        self.launch(
            "ds4_rope_qat_hfp4",
            (g32(rows), 1, 1),
            256,
            &[
                Arg::Ptr(xp),
                i32a(OP, "width", width)?,
                Arg::F32(norm),
                Arg::Ptr(fp),
                i32a(OP, "heads", a.n_heads)?,
                i32a(OP, "rope dim", rd)?,
                u(a.pos0),
                u(a.pos_step),
                Arg::Ptr(pp),
            ],
        )
    }

    pub(super) fn op_embed(
        &mut self,
        table: Weight,
        tokens: IBuf,
        n_tok: usize,
        n_streams: usize,
        out: Slice,
    ) -> BResult<()> {
        const OP: &str = "embed";
        let (d, n_vocab) = (table.info.cols(), table.info.rows());
        if n_tok == 0 {
            return Ok(());
        }
        // The embedding starts every forward pass: overlapped launches for decode-sized
        // passes (+16 % decode on the H200), plain ones for prefill chunks (measured ~9 %
        // slower at 32k with overlap; BENCHMARKS.md).
        self.dev
            .set_overlapped_launches(n_tok <= OVERLAP_MAX_TOKENS);
        let gw = self.weight(table, OP)?;
        let (ty, rb) = (gw.info.ty, gw.row_bytes);
        let tp = self.wraw(table, OP)?;
        let (ip, op_) = (self.iptr(tokens, OP)?, self.fptr(out, OP)?);
        self.launch(
            "ds4_embed",
            (g32(n_tok), 1, 1),
            256,
            &[
                Arg::Ptr(tp),
                Arg::I32(ty.code() as i32),
                u(rb),
                i32a(OP, "vocab", n_vocab)?,
                Arg::Ptr(ip),
                i32a(OP, "streams", n_streams)?,
                i32a(OP, "width", d)?,
                Arg::Ptr(op_),
                Arg::Ptr(self.fault_ptr()),
            ],
        )
    }

    #[allow(clippy::too_many_arguments)]
    /// HCPre; with `norm = Some((w, out))` also `out = rms_norm(y) · w` in the same kernel.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_hc_pre(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        a: HcArgs,
        y: Slice,
        post: Slice,
        comb: Slice,
        norm: Option<(Weight, Slice)>,
    ) -> BResult<()> {
        const OP: &str = "hc_pre";
        let (n, d, t) = (a.n_hc, a.dim, a.n_tok);
        if n == 0 || n > 8 {
            return Err(BackendError::Invalid {
                op: OP,
                problem: format!("{n} streams (1..=8 supported)"),
            });
        }
        let nm = 2 * n + n * n;
        if t == 0 {
            return Ok(());
        }
        let (bp, sp) = (self.wvec(base, OP, nm)?, self.wvec(scale, OP, 3)?);
        let (nw, np) = match norm {
            Some((w, out)) => (self.wvec(w, OP, d)?, self.fptr(out.sub(0, t * d), OP)?),
            None => (0, 0),
        };
        let args = [
            Arg::Ptr(self.fptr(mix, OP)?),
            Arg::Ptr(self.fptr(x, OP)?),
            Arg::Ptr(bp),
            Arg::Ptr(sp),
            i32a(OP, "streams", n)?,
            i32a(OP, "dim", d)?,
            i32a(OP, "iterations", a.sinkhorn_iters)?,
            Arg::F32(a.hc_eps),
            Arg::F32(a.rms_eps),
            Arg::Ptr(self.fptr(y, OP)?),
            Arg::Ptr(self.fptr(post, OP)?),
            Arg::Ptr(self.fptr(comb, OP)?),
            Arg::Ptr(nw),
            Arg::Ptr(np),
        ];
        // Decode-sized passes of the model's shape: everything in registers (one global
        // round trip, one block reduction; `ds4_hc_pre_regs`). Prefill keeps the general
        // kernel.
        if t <= OVERLAP_MAX_TOKENS && n <= HC_REGS_MAX_STREAMS && d <= HC_REGS_MAX_DIM {
            return self.launch("ds4_hc_pre_regs", (g32(t), 1, 1), HC_REGS_THREADS, &args);
        }
        self.launch("ds4_hc_pre", (g32(t), 1, 1), row_threads(t), &args)
    }

    /// The mixing matmul and HCPre + RMSNorm in two kernels (`ds4_hc_mix_part`,
    /// `ds4_hc_mix_apply`; docs/gpu.md §11) for decode-sized passes of the model's shape;
    /// `Ok(false)` (nothing launched) where they do not apply, for the caller's two ops.
    /// With `prev`, the part kernel first applies the previous sublayer's HCPost to the
    /// columns it reads (one launch and one pass over `x` fewer).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_hc_mix_pre(
        &mut self,
        prev: Option<HcPost>,
        fn_: Weight,
        x: Slice,
        mix: Slice,
        base: Weight,
        scale: Weight,
        a: HcArgs,
        y: Slice,
        post: Slice,
        comb: Slice,
        (norm, out): (Weight, Slice),
    ) -> BResult<bool> {
        const OP: &str = "hc_mix_pre_norm";
        let (n, d, t) = (a.n_hc, a.dim, a.n_tok);
        let nm = 2 * n + n * n;
        let gw = self.weight(fn_, OP)?;
        let tpb = self.hc_mix_tpb_from > 0 && t >= self.hc_mix_tpb_from.max(2);
        let kernel = match (gw.info.ty, tpb) {
            (GgmlType::F16, false) => "ds4_hc_mix_part_f16",
            (GgmlType::F32, false) => "ds4_hc_mix_part_f32",
            (GgmlType::F16, true) => "ds4_hc_mix_part_tpb_f16",
            (GgmlType::F32, true) => "ds4_hc_mix_part_tpb_f32",
            _ => return Ok(false),
        };
        let fits = t > 0
            && t <= OVERLAP_MAX_TOKENS
            && (1..=HC_REGS_MAX_STREAMS).contains(&n)
            && d.is_multiple_of(2)
            && fn_.info.rows() == nm
            && fn_.info.cols() == n * d;
        if !fits {
            return Ok(false);
        }
        let wp = self.wraw(fn_, OP)?;
        if !wp.is_multiple_of(8) {
            return Ok(false);
        }
        let nb = d.div_ceil(HC_MIX_COLS);
        if nb > HC_MIX_MAX_PARTS {
            return Ok(false);
        }
        let (fbytes, dbytes) = (t * nb * nm * 4, t * nb * HC_MIX_GRAM * 8);
        let foff = dbytes.next_multiple_of(8);
        let part = self.scratch("hc_mix", foff + fbytes)?;
        let (pd, pf) = (part, part + foff as u64);
        let (xp, nb32) = (self.fptr(x, OP)?, i32a(OP, "blocks", nb)?);
        let dims = [
            i32a(OP, "streams", n)?,
            i32a(OP, "dim", d)?,
            i32a(OP, "mix", nm)?,
        ];
        let prev_ptrs = match prev {
            Some(p) => [
                self.fptr(p.f, OP)?,
                match p.f2 {
                    Some(f2) => self.fptr(f2, OP)?,
                    None => 0,
                },
                self.fptr(p.post, OP)?,
                self.fptr(p.comb, OP)?,
            ],
            None => [0; 4],
        };
        let mut args = vec![Arg::Ptr(wp), Arg::Ptr(xp)];
        args.extend(dims);
        args.extend([Arg::Ptr(pf), Arg::Ptr(pd)]);
        args.extend(prev_ptrs.map(Arg::Ptr));
        if tpb {
            args.push(i32a(OP, "tokens", t)?);
            let rows = g32(t.div_ceil(HC_MIX_TPB));
            self.launch(kernel, (g32(nb), rows, 1), HC_MIX_THREADS, &args)?;
        } else {
            self.launch(kernel, (g32(nb), g32(t), 1), HC_MIX_THREADS, &args)?;
        }
        let (bp, sp) = (self.wvec(base, OP, nm)?, self.wvec(scale, OP, 3)?);
        let (nw, np) = (self.wvec(norm, OP, d)?, self.fptr(out.sub(0, t * d), OP)?);
        let args = [
            Arg::Ptr(pf),
            Arg::Ptr(pd),
            nb32,
            Arg::Ptr(xp),
            Arg::Ptr(bp),
            Arg::Ptr(sp),
            dims[0],
            dims[1],
            dims[2],
            i32a(OP, "iterations", a.sinkhorn_iters)?,
            Arg::F32(a.hc_eps),
            Arg::F32(a.rms_eps),
            Arg::Ptr(self.fptr(mix, OP)?),
            Arg::Ptr(self.fptr(y, OP)?),
            Arg::Ptr(self.fptr(post, OP)?),
            Arg::Ptr(self.fptr(comb, OP)?),
            Arg::Ptr(nw),
            Arg::Ptr(np),
        ];
        let grid = g32(d.div_ceil(HC_MIX_THREADS as usize) + 1);
        self.launch("ds4_hc_mix_apply", (grid, g32(t), 1), HC_MIX_THREADS, &args)?;
        Ok(true)
    }

    /// HCPost; with `f2 = Some(s)`, `f += s` first in the same kernel.
    pub(super) fn op_hc_post(
        &mut self,
        x: Slice,
        f: Slice,
        f2: Option<Slice>,
        post: Slice,
        comb: Slice,
        a: HcArgs,
    ) -> BResult<()> {
        const OP: &str = "hc_post";
        let (n, d, t) = (a.n_hc, a.dim, a.n_tok);
        if n == 0 || n > 8 {
            return Err(BackendError::Invalid {
                op: OP,
                problem: format!("{n} streams (1..=8 supported)"),
            });
        }
        if t * d == 0 {
            return Ok(());
        }
        let f2p = match f2 {
            Some(s) => self.fptr(s, OP)?,
            None => 0,
        };
        let mut args = vec![
            Arg::Ptr(self.fptr(x, OP)?),
            Arg::Ptr(self.fptr(f, OP)?),
            Arg::Ptr(f2p),
            Arg::Ptr(self.fptr(post, OP)?),
            Arg::Ptr(self.fptr(comb, OP)?),
            i32a(OP, "tokens", t)?,
        ];
        if n == self.hc_post4 {
            // Tokens on the grid's y (docs/gpu.md §21): no per-element division; the stream
            // count is the kernel's own.
            args.push(i32a(OP, "dim", d)?);
            let grid = (g32(d.div_ceil(256)), g32(t.min(65_535)), 1);
            return self.launch("ds4_hc_post4", grid, 256, &args);
        }
        args.extend([i32a(OP, "streams", n)?, i32a(OP, "dim", d)?]);
        self.launch("ds4_hc_post", (grid_for(t * d), 1, 1), 256, &args)
    }

    pub(super) fn op_hc_head(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        a: HcArgs,
        y: Slice,
    ) -> BResult<()> {
        const OP: &str = "hc_head";
        let (n, d, t) = (a.n_hc, a.dim, a.n_tok);
        if n == 0 || n > 8 {
            return Err(BackendError::Invalid {
                op: OP,
                problem: format!("{n} streams (1..=8 supported)"),
            });
        }
        if t == 0 {
            return Ok(());
        }
        let (bp, sp) = (self.wvec(base, OP, n)?, self.wvec(scale, OP, 1)?);
        let args = [
            Arg::Ptr(self.fptr(mix, OP)?),
            Arg::Ptr(self.fptr(x, OP)?),
            Arg::Ptr(bp),
            Arg::Ptr(sp),
            i32a(OP, "streams", n)?,
            i32a(OP, "dim", d)?,
            Arg::F32(a.hc_eps),
            Arg::F32(a.rms_eps),
            Arg::Ptr(self.fptr(y, OP)?),
        ];
        self.launch("ds4_hc_head", (g32(t), 1, 1), 256, &args)
    }

    pub(super) fn op_compressor(
        &mut self,
        acc: Slice,
        uu: Slice,
        z: Slice,
        ape: Weight,
        a: CompressorArgs,
        rows: Slice,
    ) -> BResult<()> {
        const OP: &str = "compressor";
        let pw = a.proj_width();
        let cap = rows.len / a.width;
        if a.n_tok == 0 {
            return Ok(());
        }
        let apep = self.wvec(ape, OP, a.ratio * pw)?;
        if a.n_tok >= COMP_WINDOWS_FROM && (!a.overlap || a.ratio <= COMP_MAX_OVERLAP_M) {
            // Every completed window pooled at once, then the accumulator's final state.
            let (accp, up, zp) = (self.fptr(acc, OP)?, self.fptr(uu, OP)?, self.fptr(z, OP)?);
            let n_win = (a.pos0 + a.n_tok) / a.ratio - a.pos0 / a.ratio;
            self.launch(
                "ds4_compressor_windows",
                (g32(n_win), g32(a.width.div_ceil(256)), 1),
                256,
                &[
                    Arg::Ptr(accp),
                    Arg::Ptr(up),
                    Arg::Ptr(zp),
                    Arg::Ptr(apep),
                    u(a.pos0),
                    i32a(OP, "ratio", a.ratio)?,
                    i32a(OP, "width", a.width)?,
                    Arg::I32(i32::from(a.overlap)),
                    Arg::Ptr(self.fptr(rows, OP)?),
                    u(cap),
                ],
            )?;
            return self.launch(
                "ds4_compressor_tail",
                (g32(pw.div_ceil(256)), 1, 1),
                256,
                &[
                    Arg::Ptr(accp),
                    Arg::Ptr(up),
                    Arg::Ptr(zp),
                    Arg::Ptr(apep),
                    u(a.pos0),
                    i32a(OP, "tokens", a.n_tok)?,
                    i32a(OP, "ratio", a.ratio)?,
                    i32a(OP, "width", a.width)?,
                    Arg::I32(i32::from(a.overlap)),
                ],
            );
        }
        let args = [
            Arg::Ptr(self.fptr(acc, OP)?),
            Arg::Ptr(self.fptr(uu, OP)?),
            Arg::Ptr(self.fptr(z, OP)?),
            Arg::Ptr(apep),
            u(a.pos0),
            i32a(OP, "tokens", a.n_tok)?,
            i32a(OP, "ratio", a.ratio)?,
            i32a(OP, "width", a.width)?,
            Arg::I32(i32::from(a.overlap)),
            Arg::Ptr(self.fptr(rows, OP)?),
            u(cap),
        ];
        self.launch("ds4_compressor", (1, 1, 1), 256, &args)
    }

    /// Two independent compressors in one `ds4_compressor2` launch (block 0 the first, block
    /// 1 the second: each `ds4_compressor`'s code) when both take the sequential kernel and
    /// their states are separate buffers; else one call after the other.
    pub(super) fn op_compressor_pair(
        &mut self,
        a: CompressorCall,
        b: CompressorCall,
    ) -> BResult<()> {
        const OP: &str = "compressor";
        let sequential = |c: &CompressorCall| {
            c.args.n_tok > 0
                && !(c.args.n_tok >= COMP_WINDOWS_FROM
                    && (!c.args.overlap || c.args.ratio <= COMP_MAX_OVERLAP_M))
        };
        if !self.fusions.compressors
            || !sequential(&a)
            || !sequential(&b)
            || !pairwise_disjoint(&[a.acc, a.rows, b.acc, b.rows])
        {
            self.op_compressor(a.acc, a.u, a.z, a.ape, a.args, a.rows)?;
            return self.op_compressor(b.acc, b.u, b.z, b.ape, b.args, b.rows);
        }
        let mut args = Vec::with_capacity(22);
        for c in [a, b] {
            let pw = c.args.proj_width();
            let apep = self.wvec(c.ape, OP, c.args.ratio * pw)?;
            args.extend([
                Arg::Ptr(self.fptr(c.acc, OP)?),
                Arg::Ptr(self.fptr(c.u, OP)?),
                Arg::Ptr(self.fptr(c.z, OP)?),
                Arg::Ptr(apep),
                u(c.args.pos0),
                i32a(OP, "tokens", c.args.n_tok)?,
                i32a(OP, "ratio", c.args.ratio)?,
                i32a(OP, "width", c.args.width)?,
                Arg::I32(i32::from(c.args.overlap)),
                Arg::Ptr(self.fptr(c.rows, OP)?),
                u(c.rows.len / c.args.width),
            ]);
        }
        self.launch("ds4_compressor2", (2, 1, 1), 256, &args)
    }

    /// One token of each of up to ATT_SEQS sequences' compressors in one
    /// `ds4_compressor_seqs` launch when their u / z rows follow each other and they share
    /// the compressor (the same code per sequence as alone); else one call at a time.
    pub(super) fn op_compressor_batch(&mut self, calls: &[CompressorCall]) -> BResult<()> {
        const OP: &str = "compressor";
        for group in calls.chunks(ATT_SEQS) {
            let c0 = group[0];
            let pw = c0.args.proj_width();
            let mut own: Vec<Slice> = Vec::new();
            for c in group {
                own.push(c.acc);
                own.push(c.rows);
            }
            let batchable = group.len() >= 2
                && group.iter().enumerate().all(|(i, c)| {
                    c.args.n_tok == 1
                        && (c.args.ratio, c.args.width, c.args.overlap)
                            == (c0.args.ratio, c0.args.width, c0.args.overlap)
                        && c.ape == c0.ape
                        && rows_follow(c.u, i, pw, c0.u)
                        && rows_follow(c.z, i, pw, c0.z)
                })
                && pairwise_disjoint(&own);
            if !batchable {
                for c in group {
                    self.op_compressor(c.acc, c.u, c.z, c.ape, c.args, c.rows)?;
                }
                continue;
            }
            // `ds4_comp_seqs`: acc, rows (pointers), pos0, cap.
            let mut blob = vec![0u64; 4 * ATT_SEQS];
            for (i, c) in group.iter().enumerate() {
                blob[i] = self.fptr(c.acc, OP)?;
                blob[ATT_SEQS + i] = self.fptr(c.rows, OP)?;
                blob[2 * ATT_SEQS + i] = c.args.pos0 as u64;
                blob[3 * ATT_SEQS + i] = (c.rows.len / c.args.width) as u64;
            }
            let apep = self.wvec(c0.ape, OP, c0.args.ratio * pw)?;
            self.launch_blob(
                "ds4_compressor_seqs",
                (g32(group.len()), 1, 1),
                256,
                &[
                    Arg::Ptr(self.fptr(c0.u, OP)?),
                    Arg::Ptr(self.fptr(c0.z, OP)?),
                    Arg::Ptr(apep),
                    i32a(OP, "ratio", c0.args.ratio)?,
                    i32a(OP, "width", c0.args.width)?,
                    Arg::I32(i32::from(c0.args.overlap)),
                ],
                3,
                &blob,
            )?;
        }
        Ok(())
    }

    /// One token of each of up to ATT_SEQS sequences' indexers in one
    /// `ds4_indexer_scores_seqs` + one `ds4_topk_select_seqs` launch when their q / w rows
    /// follow each other and they share the shapes (the same code per sequence as alone);
    /// else one call at a time.
    pub(super) fn op_indexer_topk_batch(&mut self, calls: &[IndexerCall]) -> BResult<()> {
        const OP: &str = "indexer_topk";
        for group in calls.chunks(ATT_SEQS) {
            let c0 = group[0];
            let (nh, hd, k) = (c0.args.n_heads, c0.args.head_dim, c0.args.top_k);
            let batchable = group.len() >= 2
                && group.iter().enumerate().all(|(i, c)| {
                    c.args.n_tok == 1
                        && (c.args.ratio, c.args.n_heads, c.args.head_dim, c.args.top_k)
                            == (c0.args.ratio, nh, hd, k)
                        && c.args.weight_scale.to_bits() == c0.args.weight_scale.to_bits()
                        && rows_follow(c.q, i, nh * hd, c0.q)
                        && rows_follow(c.w, i, nh, c0.w)
                })
                && (0..group.len()).all(|i| (0..i).all(|j| group[i].out.id() != group[j].out.id()));
            if !batchable {
                for c in group {
                    self.op_indexer_topk(c.q, c.w, c.rows, c.args, c.out)?;
                }
                continue;
            }
            let n_last: Vec<usize> = group
                .iter()
                .map(|c| (c.args.pos0 + 1) / c.args.ratio)
                .collect();
            let scoring: Vec<bool> = n_last.iter().map(|&n| n > k).collect();
            if scoring.iter().any(|&s| s) && (nh * hd > 8192 || nh > 64 || !hd.is_multiple_of(8)) {
                return Err(BackendError::Invalid {
                    op: OP,
                    problem: format!(
                        "{nh} heads of {hd} (at most 64 heads, 8192 values, dims a multiple of 8)"
                    ),
                });
            }
            for (c, &sc) in group.iter().zip(&scoring) {
                if sc && !self.fptr(c.rows, OP)?.is_multiple_of(16) {
                    return Err(BackendError::Invalid {
                        op: OP,
                        problem: "indexer rows must start 16-byte aligned".into(),
                    });
                }
            }
            let total: usize = n_last
                .iter()
                .zip(&scoring)
                .map(|(&n, &s)| if s { n } else { 0 })
                .sum();
            let sp = self.scratch("scores", 4 * total.max(1))?;
            // `ds4_idx_seqs`: rows, scores, out (pointers), pos0, then n_cols (4 bytes each).
            let mut blob = vec![0u64; 4 * ATT_SEQS + ATT_SEQS / 2];
            let mut at = 0u64;
            for (i, c) in group.iter().enumerate() {
                blob[i] = self.fptr(c.rows, OP)?;
                if scoring[i] {
                    blob[ATT_SEQS + i] = sp + at;
                    at += 4 * n_last[i] as u64;
                }
                blob[2 * ATT_SEQS + i] = self.iptr(c.out, OP)?;
                blob[3 * ATT_SEQS + i] = c.args.pos0 as u64;
            }
            for (i, &n) in n_last.iter().enumerate() {
                let v = u64::from(u32::try_from(n).map_err(|_| BackendError::Invalid {
                    op: OP,
                    problem: format!("{n} compressed rows"),
                })?);
                blob[4 * ATT_SEQS + i / 2] |= v << (32 * (i % 2));
            }
            let max_rows = n_last
                .iter()
                .zip(&scoring)
                .map(|(&n, &s)| if s { n } else { 0 })
                .max()
                .unwrap_or(0);
            if max_rows > 0 {
                self.launch_blob(
                    "ds4_indexer_scores_seqs",
                    (
                        g32(max_rows.div_ceil(IDX_ROWS_PER_BLOCK)),
                        g32(group.len()),
                        1,
                    ),
                    256,
                    &[
                        Arg::Ptr(self.fptr(c0.q, OP)?),
                        Arg::Ptr(self.fptr(c0.w, OP)?),
                        i32a(OP, "heads", nh)?,
                        i32a(OP, "head dim", hd)?,
                        Arg::F32(c0.args.weight_scale),
                        i32a(OP, "ratio", c0.args.ratio)?,
                    ],
                    2,
                    &blob,
                )?;
            }
            self.launch_blob(
                "ds4_topk_select_seqs",
                (g32(group.len()), 1, 1),
                1024,
                &[i32a(OP, "ratio", c0.args.ratio)?, i32a(OP, "top k", k)?],
                0,
                &blob,
            )?;
        }
        Ok(())
    }

    /// One token of each of up to ATT_SEQS sequences' ring stores in one
    /// `ds4_ring_store_seqs` launch when their kv rows follow each other; else one call at
    /// a time.
    pub(super) fn op_ring_store_batch(&mut self, calls: &[RingStoreCall]) -> BResult<()> {
        const OP: &str = "ring_store";
        for group in calls.chunks(ATT_SEQS) {
            let c0 = group[0];
            let d = c0.ring.len / c0.window.max(1);
            let rings: Vec<Slice> = group.iter().map(|c| c.ring).collect();
            let batchable = group.len() >= 2
                && group.iter().enumerate().all(|(i, c)| {
                    c.n_tok == 1
                        && c.window == c0.window
                        && c.ring.len == c0.ring.len
                        && rows_follow(c.kv, i, d, c0.kv)
                })
                && pairwise_disjoint(&rings);
            if !batchable || d == 0 {
                for c in group {
                    self.op_ring_store(c.ring, c.kv, c.pos0, c.n_tok, c.window)?;
                }
                continue;
            }
            let mut blob = vec![0u64; 2 * ATT_SEQS];
            for (i, c) in group.iter().enumerate() {
                blob[i] = self.fptr(c.ring, OP)?;
                blob[ATT_SEQS + i] = c.pos0 as u64;
            }
            self.launch_blob(
                "ds4_ring_store_seqs",
                (g32(d.div_ceil(256)), g32(group.len()), 1),
                256,
                &[
                    Arg::Ptr(self.fptr(c0.kv, OP)?),
                    i32a(OP, "window", c0.window)?,
                    i32a(OP, "dim", d)?,
                ],
                1,
                &blob,
            )?;
        }
        Ok(())
    }

    pub(super) fn op_indexer_topk(
        &mut self,
        q: Slice,
        w: Slice,
        rows: Slice,
        a: IndexerArgs,
        out: IBuf,
    ) -> BResult<()> {
        const OP: &str = "indexer_topk";
        let (t, k, hd, nh) = (a.n_tok, a.top_k, a.head_dim, a.n_heads);
        let n_last = (a.pos0 + t) / a.ratio;
        if t == 0 {
            return Ok(());
        }
        let scoring = n_last > k;
        let mut sp = 0u64;
        if scoring {
            if nh * hd > 8192 || nh > 64 || !hd.is_multiple_of(8) {
                return Err(BackendError::Invalid {
                    op: OP,
                    problem: format!(
                        "{nh} heads of {hd} (at most 64 heads, 8192 values, dims a multiple of 8)"
                    ),
                });
            }
            if !self.fptr(rows, OP)?.is_multiple_of(16) {
                return Err(BackendError::Invalid {
                    op: OP,
                    problem: "indexer rows must start 16-byte aligned".into(),
                });
            }
            sp = self.scratch("scores", 4 * t * n_last)?;
            if self.idx_mma
                && t >= IMMA_MIN_TOKENS
                && (nh, hd) == (IMMA_HEADS, IMMA_DIM)
                && self.imma_smem <= self.max_dyn_smem
                && self.fptr(q, OP)?.is_multiple_of(16)
            {
                let args = [
                    Arg::Ptr(self.fptr(q, OP)?),
                    Arg::Ptr(self.fptr(w, OP)?),
                    Arg::Ptr(self.fptr(rows, OP)?),
                    Arg::F32(a.weight_scale),
                    u(a.pos0),
                    i32a(OP, "ratio", a.ratio)?,
                    i32a(OP, "tokens", t)?,
                    i32a(OP, "rows", n_last)?,
                    Arg::Ptr(sp),
                ];
                self.launch_smem(
                    "ds4_indexer_scores_mma",
                    (
                        g32(t.div_ceil(IMMA_TOKENS)),
                        g32(n_last.div_ceil(IMMA_ROWS)),
                        1,
                    ),
                    512,
                    self.imma_smem,
                    &args,
                )?;
            } else {
                let args = [
                    Arg::Ptr(self.fptr(q, OP)?),
                    Arg::Ptr(self.fptr(w, OP)?),
                    Arg::Ptr(self.fptr(rows, OP)?),
                    i32a(OP, "heads", nh)?,
                    i32a(OP, "head dim", hd)?,
                    Arg::F32(a.weight_scale),
                    u(a.pos0),
                    i32a(OP, "ratio", a.ratio)?,
                    i32a(OP, "rows", n_last)?,
                    Arg::Ptr(sp),
                ];
                self.launch(
                    "ds4_indexer_scores",
                    (g32(n_last.div_ceil(IDX_ROWS_PER_BLOCK)), g32(t), 1),
                    256,
                    &args,
                )?;
            }
        }
        let args = [
            Arg::Ptr(sp),
            i32a(OP, "rows", n_last)?,
            u(a.pos0),
            i32a(OP, "ratio", a.ratio)?,
            i32a(OP, "top k", k)?,
            Arg::Ptr(self.iptr(out, OP)?),
        ];
        self.launch("ds4_topk_select", (g32(t), 1, 1), 1024, &args)
    }

    /// What the attention kernels take for `a` besides its slices: the compressed-row
    /// mode and pointers, and the split of every (token, head)'s keys over blocks.
    fn att_plan(&self, a: &AttnArgs) -> BResult<AttPlan> {
        const OP: &str = "attention";
        let (t, nh, hd, win) = (a.n_tok, a.n_head, a.head_dim, a.window);
        if hd > ATT_MAX_HD {
            return Err(BackendError::Invalid {
                op: OP,
                problem: format!("head dim {hd} (at most {ATT_MAX_HD})"),
            });
        }
        let last = a.pos0 + t;
        let (mode, crows, ratio, idx, k_sel, n_crows) = match a.comp {
            CompSel::None => (0, 0u64, 1usize, 0u64, 0usize, 0usize),
            CompSel::All { rows, ratio } => (1, self.fptr(rows, OP)?, ratio, 0, 0, rows.len / hd),
            CompSel::Top {
                rows,
                ratio,
                idx,
                k,
            } => (
                2,
                self.fptr(rows, OP)?,
                ratio,
                self.iptr(idx, OP)?,
                k,
                rows.len / hd,
            ),
        };
        // Few tokens: split every (token, head)'s keys over blocks (flash decoding).
        let n_keys = win.min(last)
            + match a.comp {
                CompSel::None => 0,
                CompSel::All { .. } => last / ratio,
                CompSel::Top { .. } => k_sel,
            };
        let kps = ATT_KEYS_PER_SPLIT.max(n_keys.div_ceil(ATT_MAX_SPLITS));
        let splits = n_keys.div_ceil(kps);
        Ok(AttPlan {
            mode,
            crows,
            ratio,
            idx,
            k_sel,
            n_crows,
            kps,
            splits,
            split: t * nh < ATT_SPLIT_BELOW_BLOCKS && splits > 1,
            n_keys,
        })
    }

    /// Whether the tensor-core attention can run this call (docs/gpu.md §14): 512-dim heads
    /// in groups of 64, the device gives a block the kernel's shared memory, and every row
    /// the kernel reads with 16-byte loads is 16-byte aligned. (Whether it is switched on
    /// is the caller's test: `attn_mma` for prefill, `attn_mma_decode` for the split path.)
    fn att_mma_ok(&self, a: &AttnArgs) -> BResult<bool> {
        const OP: &str = "attention";
        if a.head_dim != AMMA_HD
            || !a.n_head.is_multiple_of(AMMA_HEADS)
            || self.amma_smem > self.max_dyn_smem
        {
            return Ok(false);
        }
        let mut ptrs = vec![
            self.fptr(a.q, OP)?,
            self.fptr(a.kv, OP)?,
            self.fptr(a.ring, OP)?,
        ];
        match a.comp {
            CompSel::None => {}
            CompSel::All { rows, .. } | CompSel::Top { rows, .. } => {
                ptrs.push(self.fptr(rows, OP)?)
            }
        }
        Ok(ptrs.iter().all(|p| p % 16 == 0))
    }

    /// The leading arguments every attention kernel of one call shares, in their order:
    /// q, kv, ring, compressed rows, selection, the sinks (kernels that normalise), the
    /// first position, heads, the head dim (the single-query kernels; the tensor-core ones
    /// fix it at 512), window, row mode, ratio, k, rows and scale.
    fn att_args(
        &self,
        a: &AttnArgs,
        pl: &AttPlan,
        sinks: Option<u64>,
        with_head_dim: bool,
    ) -> BResult<Vec<Arg>> {
        const OP: &str = "attention";
        let mut v = vec![
            Arg::Ptr(self.fptr(a.q, OP)?),
            Arg::Ptr(self.fptr(a.kv, OP)?),
            Arg::Ptr(self.fptr(a.ring, OP)?),
            Arg::Ptr(pl.crows),
            Arg::Ptr(pl.idx),
        ];
        v.extend(sinks.map(Arg::Ptr));
        v.extend([u(a.pos0), i32a(OP, "heads", a.n_head)?]);
        if with_head_dim {
            v.push(i32a(OP, "head dim", a.head_dim)?);
        }
        v.extend([
            i32a(OP, "window", a.window)?,
            Arg::I32(pl.mode),
            i32a(OP, "ratio", pl.ratio)?,
            i32a(OP, "k", pl.k_sel)?,
            u(pl.n_crows),
            Arg::F32(a.scale),
        ]);
        Ok(v)
    }

    pub(super) fn op_attention(&mut self, a: AttnArgs) -> BResult<()> {
        const OP: &str = "attention";
        let (t, nh, hd) = (a.n_tok, a.n_head, a.head_dim);
        let pl = self.att_plan(&a)?;
        if t * nh == 0 {
            return Ok(());
        }
        let sinks = self.wvec(a.sinks, OP, nh)?;
        if !pl.split && self.attn_mma && self.att_mma_ok(&a)? {
            let mut args = self.att_args(&a, &pl, Some(sinks), false)?;
            args.extend([Arg::Ptr(self.fptr(a.out, OP)?), Arg::Ptr(self.fault_ptr())]);
            return self.launch_smem(
                "ds4_attention_mma",
                (g32(t), g32(nh / AMMA_HEADS), 1),
                AMMA_THREADS,
                self.amma_smem,
                &args,
            );
        }
        if pl.split && self.attn_mma_decode && self.att_mma_ok(&a)? {
            // The combine is the single-query one.
            let (kps, splits) = amma_splits(pl.n_keys);
            let part = self.scratch("att_part", 4 * t * nh * splits * (hd + 2))?;
            let mut args = self.att_args(&a, &pl, None, false)?;
            args.extend([
                i32a(OP, "keys per split", kps)?,
                Arg::Ptr(part),
                Arg::Ptr(self.fault_ptr()),
            ]);
            self.launch_smem(
                "ds4_attention_mma_split",
                (g32(t), g32(splits), g32(nh / AMMA_HEADS)),
                AMMA_THREADS,
                self.amma_smem,
                &args,
            )?;
            return self.launch(
                "ds4_attention_combine",
                (g32(t * nh), 1, 1),
                256,
                &[
                    Arg::Ptr(part),
                    Arg::Ptr(sinks),
                    i32a(OP, "heads", nh)?,
                    i32a(OP, "head dim", hd)?,
                    i32a(OP, "splits", splits)?,
                    Arg::Ptr(self.fptr(a.out, OP)?),
                ],
            );
        }
        if pl.split {
            let part = self.scratch("att_part", 4 * t * nh * pl.splits * (hd + 2))?;
            let mut args = self.att_args(&a, &pl, None, true)?;
            args.extend([
                i32a(OP, "keys per split", pl.kps)?,
                Arg::Ptr(part),
                Arg::Ptr(self.fault_ptr()),
            ]);
            if self.fusions.att_combine {
                // One zeroed counter per (token, head); the kernel leaves them zeroed.
                if !self.has_scratch("att_count") {
                    self.upload_scratch_i32("att_count", &[0; ATT_SPLIT_BELOW_BLOCKS])?;
                }
                let counters = self.scratch("att_count", 4 * ATT_SPLIT_BELOW_BLOCKS)?;
                args.extend([
                    Arg::Ptr(sinks),
                    Arg::Ptr(self.fptr(a.out, OP)?),
                    Arg::Ptr(counters),
                ]);
                return self.launch(
                    "ds4_attention_split_combine",
                    (g32(t * nh), g32(pl.splits), 1),
                    128,
                    &args,
                );
            }
            self.launch(
                "ds4_attention_split",
                (g32(t * nh), g32(pl.splits), 1),
                128,
                &args,
            )?;
            return self.launch(
                "ds4_attention_combine",
                (g32(t * nh), 1, 1),
                256,
                &[
                    Arg::Ptr(part),
                    Arg::Ptr(sinks),
                    i32a(OP, "heads", nh)?,
                    i32a(OP, "head dim", hd)?,
                    i32a(OP, "splits", pl.splits)?,
                    Arg::Ptr(self.fptr(a.out, OP)?),
                ],
            );
        }
        let mut args = self.att_args(&a, &pl, Some(sinks), true)?;
        args.extend([Arg::Ptr(self.fptr(a.out, OP)?), Arg::Ptr(self.fault_ptr())]);
        self.launch("ds4_attention", (g32(t * nh), 1, 1), 128, &args)
    }

    /// One token of each of several sequences (a batched decode step): groups of up to
    /// ATT_SEQS sequences whose rows of q, kv and out follow each other in one buffer each
    /// and that share every shape and the sinks run as one `ds4_attention_split_seqs` +
    /// one `ds4_attention_combine_seqs` launch (each sequence with the splits it has alone:
    /// the same results bit for bit); anything else runs one sequence at a time.
    pub(super) fn op_attention_batch(&mut self, args: &[AttnArgs]) -> BResult<()> {
        const OP: &str = "attention";
        for group in args.chunks(ATT_SEQS) {
            let plans = group
                .iter()
                .map(|a| self.att_plan(a))
                .collect::<BResult<Vec<_>>>()?;
            if !self.att_batchable(group, &plans) {
                for &a in group {
                    self.op_attention(a)?;
                }
                continue;
            }
            let a0 = group[0];
            let (n, nh, hd) = (group.len(), a0.n_head, a0.head_dim);
            // The tensor-core kernel splits differently (whole tiles of keys).
            let mut mma = self.attn_mma_decode;
            for a in group {
                mma = mma && self.att_mma_ok(a)?;
            }
            let plans: Vec<AttPlan> = plans
                .into_iter()
                .map(|p| {
                    if mma {
                        let (kps, splits) = amma_splits(p.n_keys);
                        AttPlan { kps, splits, ..p }
                    } else {
                        p
                    }
                })
                .collect();
            let max_splits = plans.iter().map(|p| p.splits).max().unwrap_or(1);
            // Per-sequence arguments, laid out as `ds4_att_seqs` in ops.cu: ring, crows,
            // idx, pos0, n_crows (8 bytes each), then kps and splits (4 bytes each).
            let mut blob = vec![0u64; 5 * ATT_SEQS + ATT_SEQS];
            for (i, (a, p)) in group.iter().zip(&plans).enumerate() {
                blob[i] = self.fptr(a.ring, OP)?;
                blob[ATT_SEQS + i] = p.crows;
                blob[2 * ATT_SEQS + i] = p.idx;
                blob[3 * ATT_SEQS + i] = a.pos0 as u64;
                blob[4 * ATT_SEQS + i] = p.n_crows as u64;
            }
            let ints: Vec<u32> = plans
                .iter()
                .map(|p| p.kps)
                .chain((n..ATT_SEQS).map(|_| 0))
                .chain(plans.iter().map(|p| p.splits))
                .chain((n..ATT_SEQS).map(|_| 0))
                .map(|v| u32::try_from(v).unwrap_or(u32::MAX))
                .collect();
            for (j, pair) in ints.chunks_exact(2).enumerate() {
                blob[5 * ATT_SEQS + j] = u64::from(pair[0]) | (u64::from(pair[1]) << 32);
            }
            let part = self.scratch("att_part", 4 * n * nh * max_splits * (hd + 2))?;
            let sinks = self.wvec(a0.sinks, OP, nh)?;
            let p0 = &plans[0];
            // The two kernels take the same arguments but the head dim (the tensor-core one
            // fixes it at 512) and launch differently.
            let mut args = vec![
                Arg::Ptr(self.fptr(a0.q, OP)?),
                Arg::Ptr(self.fptr(a0.kv, OP)?),
                i32a(OP, "heads", nh)?,
                i32a(OP, "window", a0.window)?,
                Arg::I32(p0.mode),
                i32a(OP, "ratio", p0.ratio)?,
                i32a(OP, "k", p0.k_sel)?,
                Arg::F32(a0.scale),
                i32a(OP, "splits", max_splits)?,
                Arg::Ptr(part),
                Arg::Ptr(self.fault_ptr()),
            ];
            let (name, grid, threads, smem) = if mma {
                let grid = (g32(n), g32(max_splits), g32(nh / AMMA_HEADS));
                (
                    "ds4_attention_mma_split_seqs",
                    grid,
                    AMMA_THREADS,
                    self.amma_smem,
                )
            } else {
                args.insert(3, i32a(OP, "head dim", hd)?);
                let grid = (g32(n * nh), g32(max_splits), 1);
                ("ds4_attention_split_seqs", grid, 128, 0)
            };
            self.launch_blob_smem(name, grid, threads, smem, &args, 2, &blob)?;
            self.launch_blob(
                "ds4_attention_combine_seqs",
                (g32(n * nh), 1, 1),
                256,
                &[
                    Arg::Ptr(part),
                    Arg::Ptr(sinks),
                    i32a(OP, "heads", nh)?,
                    i32a(OP, "head dim", hd)?,
                    i32a(OP, "splits", max_splits)?,
                    Arg::Ptr(self.fptr(a0.out, OP)?),
                ],
                2,
                &blob,
            )?;
        }
        Ok(())
    }

    /// Whether `group` can run as one batched launch (see [`Self::op_attention_batch`]):
    /// at least two sequences, one token each, each on the split path alone, the same
    /// shapes, sinks and compressed-row mode, rows following each other, and partials
    /// within [`ATT_BATCH_PART_BYTES`].
    fn att_batchable(&self, group: &[AttnArgs], plans: &[AttPlan]) -> bool {
        let (a0, p0) = (&group[0], &plans[0]);
        let (nh, hd) = (a0.n_head, a0.head_dim);
        let max_splits = plans.iter().map(|p| p.splits).max().unwrap_or(0);
        // The launch writes every output row while reading every q and kv row.
        let span = |first: Slice, w: usize| Slice {
            len: group.len() * w,
            ..first
        };
        let outs = span(a0.out, nh * hd);
        group.len() >= 2
            && !outs.overlaps(span(a0.q, nh * hd))
            && !outs.overlaps(span(a0.kv, hd))
            && 4 * group.len() * nh * max_splits * (hd + 2) <= ATT_BATCH_PART_BYTES
            && group.iter().zip(plans).enumerate().all(|(i, (a, p))| {
                a.n_tok == 1
                    && p.split
                    && a.n_head == nh
                    && a.head_dim == hd
                    && a.window == a0.window
                    && a.scale.to_bits() == a0.scale.to_bits()
                    && a.sinks == a0.sinks
                    && (p.mode, p.ratio, p.k_sel) == (p0.mode, p0.ratio, p0.k_sel)
                    && rows_follow(a.q, i, nh * hd, a0.q)
                    && rows_follow(a.kv, i, hd, a0.kv)
                    && rows_follow(a.out, i, nh * hd, a0.out)
            })
    }

    pub(super) fn op_ring_store(
        &mut self,
        ring: Slice,
        kv: Slice,
        pos0: usize,
        n_tok: usize,
        window: usize,
    ) -> BResult<()> {
        const OP: &str = "ring_store";
        let d = ring.len / window;
        let n = n_tok.min(window) * d;
        if n == 0 {
            return Ok(());
        }
        let args = [
            Arg::Ptr(self.fptr(ring, OP)?),
            Arg::Ptr(self.fptr(kv, OP)?),
            u(pos0),
            i32a(OP, "tokens", n_tok)?,
            i32a(OP, "window", window)?,
            i32a(OP, "dim", d)?,
        ];
        self.launch("ds4_ring_store", (grid_for(n), 1, 1), 256, &args)
    }

    /// The router's matmul and the router: for one token of an F16 matrix that the plain
    /// GEMV takes, one launch (`ds4_gemv_router_f16`: its last block routes); else the two.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_router_matmul(
        &mut self,
        w: Weight,
        x: Slice,
        logits: Slice,
        routing: Routing,
        a: RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()> {
        const OP: &str = "router";
        let (cols, rows) = (w.info.cols(), w.info.rows());
        let gw = self.weight(w, OP)?;
        let (ty, row_bytes) = (gw.info.ty, gw.row_bytes);
        let wp = self.wraw(w, OP)?;
        let xp = self.fptr(x, OP)?;
        let launch = self
            .gemv
            .launch_for(GemvType::F16, cols, rows)
            .ok()
            .filter(|l| l.row_bytes as usize == row_bytes);
        let fits = self.fusions.router
            && a.n_tok == 1
            && ty == GgmlType::F16
            && rows == a.n_expert
            && a.k >= 1
            && a.k <= a.n_expert
            && a.n_expert <= ROUTER_WARP_MAX_EXPERTS
            && a.k <= ROUTER_WARP_MAX_K
            && wp.is_multiple_of(16)
            && xp.is_multiple_of(16);
        let Some(l) = launch.filter(|_| fits) else {
            self.op_matmul(w, 0, x, a.n_tok, logits)?;
            return self.op_router(logits, routing, a, ids, weights);
        };
        let (mode, bias, table, table_rows, toks) =
            self.routing_args(routing, a.n_expert, a.row0)?;
        // One zeroed counter; the kernel leaves it zeroed.
        if !self.has_scratch("router_count") {
            self.upload_scratch_i32("router_count", &[0])?;
        }
        let counter = self.scratch("router_count", 4)?;
        let args = [
            Arg::Ptr(wp),
            Arg::Ptr(xp),
            Arg::Ptr(self.fptr(logits, OP)?),
            i32a(OP, "cols", cols)?,
            i32a(OP, "rows", rows)?,
            Arg::I32(l.wpr as i32),
            i32a(OP, "k", a.k)?,
            Arg::F32(a.scale),
            Arg::I32(mode),
            Arg::Ptr(bias),
            Arg::Ptr(table),
            i32a(OP, "table rows", table_rows)?,
            Arg::Ptr(toks),
            Arg::Ptr(self.router_ids(ids, &a)?),
            Arg::Ptr(self.fptr(weights, OP)?),
            Arg::Ptr(self.fault_ptr()),
            Arg::Ptr(counter),
        ];
        self.launch_fn(
            &self.gemv.f16_router,
            "ds4_gemv_router_f16",
            (l.grid_x, 1, 1),
            l.block,
            &args,
        )
    }

    /// The router kernels' routing arguments: (mode 0 top-k / 1 hash, bias, hash table,
    /// its rows, token ids), null pointers where a mode has none.
    /// Token ids are read from row `row0` on (RouterArgs::row0).
    fn routing_args(
        &mut self,
        routing: Routing,
        e: usize,
        row0: usize,
    ) -> BResult<(i32, u64, u64, usize, u64)> {
        const OP: &str = "router";
        Ok(match routing {
            Routing::TopK { bias } => {
                let b = match bias {
                    Some(b) => self.wvec(b, OP, e)?,
                    None => 0,
                };
                (0, b, 0, 0, 0)
            }
            Routing::Hash { table, tokens } => (
                1,
                0,
                self.wraw(table, OP)?,
                table.info.rows(),
                self.iptr(tokens, OP)? + 4 * row0 as u64,
            ),
        })
    }

    /// Where a router call's expert ids start: row `row0` of `ids` (RouterArgs::row0; the
    /// validation checked the length).
    fn router_ids(&self, ids: IBuf, a: &RouterArgs) -> BResult<u64> {
        Ok(self.iptr(ids, "router")? + 4 * (a.row0 * a.k) as u64)
    }

    pub(super) fn op_router(
        &mut self,
        logits: Slice,
        routing: Routing,
        a: RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()> {
        const OP: &str = "router";
        let (t, e, k) = (a.n_tok, a.n_expert, a.k);
        if k == 0 || k > e || e > 1024 || k > 64 {
            return Err(BackendError::Invalid {
                op: OP,
                problem: format!("{k} of {e} experts (at most 64 of 1024)"),
            });
        }
        if t == 0 {
            return Ok(());
        }
        let (mode, bias, table, table_rows, toks) = self.routing_args(routing, e, a.row0)?;
        let mut args = vec![
            Arg::Ptr(self.fptr(logits, OP)?),
            i32a(OP, "experts", e)?,
            i32a(OP, "k", k)?,
            Arg::F32(a.scale),
            Arg::I32(mode),
            Arg::Ptr(bias),
            Arg::Ptr(table),
            i32a(OP, "table rows", table_rows)?,
            Arg::Ptr(toks),
            Arg::Ptr(self.router_ids(ids, &a)?),
            Arg::Ptr(self.fptr(weights, OP)?),
            Arg::Ptr(self.fault_ptr()),
        ];
        // One warp per token where the experts fit its registers (`ds4_router_warp`).
        if e <= ROUTER_WARP_MAX_EXPERTS && k <= ROUTER_WARP_MAX_K {
            args.insert(1, i32a(OP, "tokens", t)?);
            let grid = g32(t.div_ceil(ROUTER_WARP_TOKENS));
            return self.launch("ds4_router_warp", (grid, 1, 1), 256, &args);
        }
        self.launch("ds4_router", (g32(t), 1, 1), 256, &args)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_moe(
        &mut self,
        x: Slice,
        ids: IBuf,
        weights: Slice,
        gate: Weight,
        up: Weight,
        down: Weight,
        a: MoeArgs,
        out: Slice,
    ) -> BResult<()> {
        const OP: &str = "moe";
        let (t, k) = (a.n_tok, a.k);
        let (d, f, ne) = (gate.info.cols(), gate.info.rows(), gate.info.mats());
        let n_sel = t * k;
        if n_sel == 0 {
            return Ok(());
        }
        let (gw, _, dw) = (
            self.weight(gate, OP)?,
            self.weight(up, OP)?,
            self.weight(down, OP)?,
        );
        let (gty, grb, drb) = (gw.info.ty, gw.row_bytes, dw.row_bytes);
        let dty = dw.info.ty;
        let (gp, upp, dp) = (
            self.wraw(gate, OP)?,
            self.wraw(up, OP)?,
            self.wraw(down, OP)?,
        );
        let (xp, wp, ip, op_) = (
            self.fptr(x, OP)?,
            self.fptr(weights, OP)?,
            self.iptr(ids, OP)?,
            self.fptr(out, OP)?,
        );
        let sg = self.scratch("moe_g", 4 * n_sel * f)?;
        let su = self.scratch("moe_u", 4 * n_sel * f)?;
        let sh = self.scratch("moe_h", 4 * n_sel * f)?;
        let so = self.scratch("moe_o", 4 * n_sel * d)?;
        if n_sel > GROUPED_MAX_SEL && !self.q8_rows(t) && self.moe_takes_tiles(gate, up, down) {
            let sel = MoeTiles {
                x: xp,
                ids: ip,
                weights: wp,
                out: op_,
                n_tok: t,
                k,
                n_exp: ne,
            };
            return self.moe_tiles(sel, (gp, upp, gty, grb), (dp, dty, drb), (d, f), a.clamp);
        }
        // Batched decode steps (decode rows) stay on the grouped GEMVs at any width: 16
        // sequences are 96 selections, and the host-grouped path costs a synchronisation
        // per layer (44 per step measured at 16 sequences on the H200).
        let grouped = (n_sel <= GROUPED_MAX_SEL || self.q8_rows(t))
            && self.grouped_ok(gty, d, f, gp)
            && self.grouped_ok(gty, d, f, upp)
            && self.grouped_ok(dty, f, d, dp);
        if grouped {
            // Inputs per selection: the token's x (shared when there is one token; a flat
            // grid reads each token's row for its selections, docs/gpu.md §25).
            let (xsrc, x_div) = if t == 1 {
                (xp, 0)
            } else if self
                .flat_functions(gty, n_sel, k, self.q8_rows(t))
                .is_some()
            {
                (xp, k)
            } else {
                // Each token's x once per selection, on the device (no host index list).
                let xs = self.scratch("moe_xs", 4 * n_sel * d)?;
                self.launch(
                    "ds4_repeat_rows",
                    (grid_for(n_sel * d), 1, 1),
                    256,
                    &[
                        Arg::Ptr(xp),
                        i32a(OP, "k", k)?,
                        i32a(OP, "selections", n_sel)?,
                        i32a(OP, "dim", d)?,
                        Arg::Ptr(xs),
                    ],
                )?;
                (xs, 1)
            };
            self.grouped(
                gty,
                (gp, Some(upp)),
                grb * f,
                ip,
                ne,
                xsrc,
                x_div,
                (sg, Some(su)),
                (n_sel, k),
                d,
                f,
                self.q8_rows(t),
            )?;
            if self.fusions.swiglu && self.q8_rows(t) {
                let (sg_, su_) = ((sg, su), (wp, a.clamp));
                if self.grouped_swiglu(
                    dty,
                    dp,
                    drb * d,
                    (ip, ne),
                    sg_,
                    su_,
                    so,
                    (n_sel, k),
                    f,
                    d,
                )? {
                    return self.sum_slots(so, t, k, d, op_);
                }
            }
            self.launch(
                "ds4_moe_act",
                (grid_for(n_sel * f), 1, 1),
                256,
                &[
                    Arg::Ptr(sg),
                    Arg::Ptr(su),
                    Arg::Ptr(wp),
                    Arg::Ptr(0),
                    i32a(OP, "selections", n_sel)?,
                    i32a(OP, "ff", f)?,
                    Arg::F32(a.clamp),
                    Arg::Ptr(sh),
                    // The id range check rides along (the grouped GEMVs read the ids).
                    Arg::Ptr(ip),
                    i32a(OP, "experts", ne)?,
                    Arg::Ptr(self.fault_ptr()),
                ],
            )?;
            self.grouped(
                dty,
                (dp, None),
                drb * d,
                ip,
                ne,
                sh,
                1,
                (so, None),
                (n_sel, k),
                f,
                d,
                self.q8_rows(t),
            )?;
        } else {
            // Host-side grouping by expert: (token, slot) pairs in token order per expert.
            let mut idv = vec![0i32; n_sel];
            ds4_engine::Backend::download_i32(self, ids, 0, &mut idv)?;
            let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); ne];
            for (i, &e) in idv.iter().enumerate() {
                let e = usize::try_from(e).ok().filter(|&e| e < ne).ok_or_else(|| {
                    BackendError::Invalid {
                        op: OP,
                        problem: format!("expert id {e} of {ne}"),
                    }
                })?;
                by_expert[e].push(i);
            }
            let mut src = Vec::with_capacity(n_sel);
            let mut slot = Vec::with_capacity(n_sel);
            let mut groups = Vec::new();
            for (e, pairs) in by_expert.iter().enumerate() {
                if pairs.is_empty() {
                    continue;
                }
                groups.push((e, slot.len(), pairs.len()));
                for &i in pairs {
                    src.push((i / k) as i32);
                    slot.push(i as i32);
                }
            }
            let srcp = self.upload_scratch_i32("moe_src", &src)?;
            let slotp = self.upload_scratch_i32("moe_slot", &slot)?;
            let xs = self.scratch("moe_xs", 4 * n_sel * d)?;
            self.launch(
                "ds4_gather_rows",
                (grid_for(n_sel * d), 1, 1),
                256,
                &[
                    Arg::Ptr(xp),
                    Arg::Ptr(srcp),
                    i32a(OP, "selections", n_sel)?,
                    i32a(OP, "dim", d)?,
                    Arg::Ptr(xs),
                ],
            )?;
            for &(e, off, n) in &groups {
                for (wbase, y) in [(gp, sg), (upp, su)] {
                    self.mm(
                        Mm {
                            w: wbase + (e * f * grb) as u64,
                            ty: gty,
                            row_bytes: grb,
                            row0: 0,
                            n_rows: f,
                            cols: d,
                            x: xs + (4 * off * d) as u64,
                            x_stride: d,
                            n_tok: n,
                            y: y + (4 * off * f) as u64,
                            y_stride: f,
                            q8: self.q8_rows(t),
                            copies: 1,
                        },
                        OP,
                    )?;
                }
            }
            self.launch(
                "ds4_moe_act",
                (grid_for(n_sel * f), 1, 1),
                256,
                &[
                    Arg::Ptr(sg),
                    Arg::Ptr(su),
                    Arg::Ptr(wp),
                    Arg::Ptr(slotp),
                    i32a(OP, "selections", n_sel)?,
                    i32a(OP, "ff", f)?,
                    Arg::F32(a.clamp),
                    Arg::Ptr(sh),
                    Arg::Ptr(0),
                    Arg::I32(0),
                    Arg::Ptr(0),
                ],
            )?;
            let ob = self.scratch("moe_ob", 4 * n_sel * d)?;
            for &(e, off, n) in &groups {
                self.mm(
                    Mm {
                        w: dp + (e * d * drb) as u64,
                        ty: dty,
                        row_bytes: drb,
                        row0: 0,
                        n_rows: d,
                        cols: f,
                        x: sh + (4 * off * f) as u64,
                        x_stride: f,
                        n_tok: n,
                        y: ob + (4 * off * d) as u64,
                        y_stride: d,
                        q8: self.q8_rows(t),
                        copies: 1,
                    },
                    OP,
                )?;
            }
            self.launch(
                "ds4_scatter_rows",
                (grid_for(n_sel * d), 1, 1),
                256,
                &[
                    Arg::Ptr(ob),
                    Arg::Ptr(slotp),
                    i32a(OP, "selections", n_sel)?,
                    i32a(OP, "dim", d)?,
                    Arg::Ptr(so),
                ],
            )?;
        }
        self.sum_slots(so, t, k, d, op_)
    }

    /// `out[t] = Σ_s per_slot[t·k + s]` in slot order (rows of d).
    fn sum_slots(&self, per_slot: u64, t: usize, k: usize, d: usize, out: u64) -> BResult<()> {
        const OP: &str = "moe";
        self.launch(
            "ds4_sum_slots",
            (grid_for(t * d), 1, 1),
            256,
            &[
                Arg::Ptr(per_slot),
                i32a(OP, "tokens", t)?,
                i32a(OP, "k", k)?,
                i32a(OP, "dim", d)?,
                Arg::Ptr(out),
            ],
        )
    }

    /// The routed experts' down projection with `ds4_moe_act` folded into its input
    /// quantization (`ds4_gemv_grouped_swiglu_q_<t>`, docs/gpu.md §17): selection s reads
    /// `route_w[s] · swiglu(g[s], u[s], clamp)`. `Ok(false)` (nothing launched) where the
    /// type, shape or alignment does not allow it.
    #[allow(clippy::too_many_arguments)]
    fn grouped_swiglu(
        &self,
        ty: GgmlType,
        w: u64,
        expert_bytes: usize,
        (ids, n_experts): (u64, usize),
        (g, u_): (u64, u64),
        (route_w, clamp): (u64, f32),
        y: u64,
        (n_sel, per_tok): (usize, usize),
        n_in: usize,
        n_out: usize,
    ) -> BResult<bool> {
        const OP: &str = "moe";
        let Ok(gt) = GemvType::from_ggml(ty) else {
            return Ok(false);
        };
        let Some(f) = self.gemv.q8_grouped_swiglu_function(gt) else {
            return Ok(false);
        };
        let Ok(l) = self.gemv.q8_launch(gt, n_in, n_out, per_tok.max(1) as u64) else {
            return Ok(false);
        };
        if n_in > self.gemv.q8_max_in
            || !n_in.is_multiple_of(32)
            || !g.is_multiple_of(16)
            || !u_.is_multiple_of(16)
        {
            return Ok(false);
        }
        let mut args = vec![
            Arg::Ptr(w),
            u(expert_bytes),
            Arg::Ptr(ids),
            i32a(OP, "experts", n_experts)?,
            Arg::Ptr(g),
            Arg::Ptr(u_),
            Arg::Ptr(route_w),
            Arg::F32(clamp),
            Arg::Ptr(y),
            i32a(OP, "n_in", n_in)?,
            i32a(OP, "n_out", n_out)?,
            Arg::I32(l.wpr as i32),
            Arg::Ptr(self.fault_ptr()),
        ];
        // A batched step: one flat grid (docs/gpu.md §25), which takes the selection count
        // after the expert count instead of a grid y.
        let (f, grid) = match self.flat_functions(ty, n_sel, per_tok, true) {
            Some((_, ff)) => {
                args.insert(4, i32a(OP, "selections", n_sel)?);
                let steps = u64::from(l.grid_x) * n_sel as u64;
                (ff, (self.gemv.q8_flat_grid_x(steps), 1, 1))
            }
            _ => (
                f,
                (self.gemv.q8_grid_x(l.grid_x, g32(n_sel)), g32(n_sel), 1),
            ),
        };
        self.launch_fn_smem(
            f,
            gt.label_q8(true),
            grid,
            (l.block, self.gemv.q8_smem(gt)),
            &args,
        )?;
        Ok(true)
    }

    /// Routed experts on tiles: selections grouped by expert on the device, gate and up
    /// in one launch, SwiGLU · route weight as halves, down, then the slot-ordered sum.
    fn moe_tiles(
        &mut self,
        s: MoeTiles,
        (gp, upp, gty, grb): (u64, u64, GgmlType, usize),
        (dp, dty, drb): (u64, GgmlType, usize),
        (d, f): (usize, usize),
        clamp: f32,
    ) -> BResult<()> {
        const OP: &str = "moe";
        let n_sel = s.n_tok * s.k;
        let offs = self.scratch("tiles_offs", 4 * (s.n_exp + 2))?;
        let order = self.scratch("tiles_order", 4 * n_sel)?;
        let inv = self.scratch("tiles_inv", 4 * n_sel)?;
        self.launch(
            "ds4_moe_sort",
            (g32(s.n_exp + 1), 1, 1),
            256,
            &[
                Arg::Ptr(s.ids),
                i32a(OP, "selections", n_sel)?,
                i32a(OP, "experts", s.n_exp)?,
                Arg::Ptr(offs),
                Arg::Ptr(order),
                Arg::Ptr(inv),
                Arg::Ptr(self.fault_ptr()),
            ],
        )?;
        let xh = self.scratch("tiles_x", 2 * n_sel * d)?;
        self.launch(
            "ds4_gather_rows_h",
            (grid_for(n_sel * d), 1, 1),
            256,
            &[
                Arg::Ptr(s.x),
                Arg::Ptr(order),
                i32a(OP, "k", s.k)?,
                i32a(OP, "selections", n_sel)?,
                i32a(OP, "dim", d)?,
                Arg::Ptr(xh),
            ],
        )?;
        // Token tiles of one expert are split over at most TILE_MAX_SPLIT blocks; blocks
        // beyond an expert's tiles return at once.
        let split = g32(n_sel.div_ceil(TILE_TOKENS).clamp(1, TILE_MAX_SPLIT));
        let sg = self.scratch("moe_g", 4 * n_sel * f)?;
        let su = self.scratch("moe_u", 4 * n_sel * f)?;
        self.launch_tiles(
            TileMm {
                w: gp,
                w2: upp,
                mat_bytes: grb * f,
                ty: gty,
                row_bytes: grb,
                n_rows: f,
                cols: d,
                x: xh,
                offs,
                groups: s.n_exp,
                n_tok: n_sel,
                split,
                y: sg,
                y2: su,
                y_stride: f,
                wide: false,
                regs: self.rtiles_for(gty, d, grb, gp, upp),
            },
            OP,
        )?;
        let hh = self.scratch("tiles_h", 2 * n_sel * f)?;
        self.launch(
            "ds4_moe_act_h",
            (grid_for(n_sel * f), 1, 1),
            256,
            &[
                Arg::Ptr(sg),
                Arg::Ptr(su),
                Arg::Ptr(s.weights),
                Arg::Ptr(order),
                i32a(OP, "selections", n_sel)?,
                i32a(OP, "ff", f)?,
                Arg::F32(clamp),
                Arg::Ptr(hh),
            ],
        )?;
        let so = self.scratch("moe_o", 4 * n_sel * d)?;
        self.launch_tiles(
            TileMm {
                w: dp,
                w2: 0,
                mat_bytes: drb * d,
                ty: dty,
                row_bytes: drb,
                n_rows: d,
                cols: f,
                x: hh,
                offs,
                groups: s.n_exp,
                n_tok: n_sel,
                split,
                y: so,
                y2: 0,
                y_stride: d,
                wide: false,
                regs: self.rtiles_for(dty, f, drb, dp, 0),
            },
            OP,
        )?;
        self.launch(
            "ds4_moe_sum_sorted",
            (grid_for(s.n_tok * d), 1, 1),
            256,
            &[
                Arg::Ptr(so),
                Arg::Ptr(inv),
                Arg::Ptr(s.ids),
                i32a(OP, "tokens", s.n_tok)?,
                i32a(OP, "k", s.k)?,
                i32a(OP, "dim", d)?,
                i32a(OP, "experts", s.n_exp)?,
                Arg::Ptr(s.out),
            ],
        )
    }

    /// Whether the grouped GEMV takes experts of `n_out × n_in` of `ty` at `w`.
    /// Device address of the i32 sequence 0, 1, …, IOTA_LEN-1 (uploaded once).
    fn iota(&mut self) -> BResult<u64> {
        if let Some(b) = self.scratch.get("iota") {
            return Ok(b.device_address());
        }
        let v: Vec<i32> = (0..IOTA_LEN as i32).collect();
        self.upload_scratch_i32("iota", &v)
    }

    /// The flat entry points (gate/up, down) a grouped launch of `n_sel` selections
    /// (`per_tok` per token) of `ty` runs on (docs/gpu.md §25): int8 activations, a batched
    /// step, a low-bit type (the ones that have them), not switched off.
    fn flat_functions(
        &self,
        ty: GgmlType,
        n_sel: usize,
        per_tok: usize,
        q8: bool,
    ) -> Option<&(D::Function, D::Function)> {
        if !(self.grouped_flat && q8 && n_sel > per_tok) {
            return None;
        }
        self.gemv.q8_flat_functions(GemvType::from_ggml(ty).ok()?)
    }

    fn grouped_ok(&self, ty: GgmlType, n_in: usize, n_out: usize, w: u64) -> bool {
        match GemvType::from_ggml(ty) {
            Ok(g) => self.gemv.launch_for(g, n_in, n_out).is_ok() && w.is_multiple_of(16),
            Err(_) => false,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn grouped(
        &self,
        ty: GgmlType,
        w: (u64, Option<u64>),
        expert_bytes: usize,
        ids: u64,
        n_experts: usize,
        x: u64,
        x_div: usize,
        y: (u64, Option<u64>),
        (n_sel, per_tok): (usize, usize),
        n_in: usize,
        n_out: usize,
        q8: bool,
    ) -> BResult<()> {
        const OP: &str = "moe";
        let g = GemvType::from_ggml(ty).map_err(gerr(OP))?;
        let mats = if w.1.is_some() { 2 } else { 1 };
        let q8f = if q8 && ds4_gguf::quant::q8act::applies(ty) {
            self.gemv.q8_functions(g)
        } else {
            None
        };
        // Warps per row from one token's selections, never the step's: a decode row then
        // sums as it does alone (docs/gpu.md §10).
        let copies = (per_tok.max(1) as u64) * u64::from(mats);
        let l = if q8f.is_some() {
            self.gemv.q8_launch(g, n_in, n_out, copies)
        } else {
            self.gemv.launch_for_grouped(g, n_in, n_out, copies)
        }
        .map_err(gerr(OP))?;
        if q8 && q8f.is_some() && n_in > self.gemv.q8_max_in {
            return Err(BackendError::Invalid {
                op: OP,
                problem: format!(
                    "int8 activations: an input of {n_in} values (at most {})",
                    self.gemv.q8_max_in
                ),
            });
        }
        // A batched step (more selections than one token's): one flat grid (docs/gpu.md §25).
        if let Some((ff, _)) = self.flat_functions(ty, n_sel, per_tok, q8) {
            let jobs = n_sel as u64 * u64::from(mats);
            return self.launch_fn_smem(
                ff,
                g.label_q8(true),
                (self.gemv.q8_flat_grid_x(u64::from(l.grid_x) * jobs), 1, 1),
                (l.block, self.gemv.q8_smem(g)),
                &[
                    Arg::Ptr(w.0),
                    Arg::Ptr(w.1.unwrap_or(w.0)),
                    u(expert_bytes),
                    Arg::Ptr(ids),
                    i32a(OP, "experts", n_experts)?,
                    i32a(OP, "selections", n_sel)?,
                    Arg::I32(mats as i32),
                    Arg::Ptr(x),
                    u(if x_div == 0 { 0 } else { n_in }),
                    i32a(OP, "selections per input", x_div.max(1))?,
                    Arg::Ptr(y.0),
                    Arg::Ptr(y.1.unwrap_or(y.0)),
                    i32a(OP, "n_in", n_in)?,
                    i32a(OP, "n_out", n_out)?,
                    Arg::I32(l.wpr as i32),
                ],
            );
        }
        if x_div > 1 {
            return Err(BackendError::Invalid {
                op: OP,
                problem: format!("{x_div} selections per input row without a flat grid"),
            });
        }
        let (f, label, grid_x, smem) = match q8f {
            Some((_, gf)) => (
                gf,
                g.label_q8(true),
                self.gemv
                    .q8_grid_x(l.grid_x, g32(n_sel).saturating_mul(mats)),
                self.gemv.q8_smem(g),
            ),
            None => (self.gemv.grouped_function(g), g.label(true), l.grid_x, 0),
        };
        self.launch_fn_smem(
            f,
            label,
            (grid_x, g32(n_sel), mats),
            (l.block, smem),
            &[
                Arg::Ptr(w.0),
                Arg::Ptr(w.1.unwrap_or(w.0)),
                u(expert_bytes),
                Arg::Ptr(ids),
                i32a(OP, "experts", n_experts)?,
                Arg::Ptr(x),
                u(if x_div == 0 { 0 } else { n_in }),
                Arg::Ptr(y.0),
                Arg::Ptr(y.1.unwrap_or(y.0)),
                i32a(OP, "n_in", n_in)?,
                i32a(OP, "n_out", n_out)?,
                Arg::I32(l.wpr as i32),
            ],
        )
    }

    pub(super) fn op_argmax(&mut self, x: Slice, out: IBuf) -> BResult<()> {
        const OP: &str = "argmax";
        let (xp, op_) = (self.fptr(x, OP)?, self.iptr(out, OP)?);
        self.launch(
            "ds4_argmax",
            (1, 1, 1),
            1024,
            &[Arg::Ptr(xp), i32a(OP, "values", x.len)?, Arg::Ptr(op_)],
        )
    }

    pub(super) fn op_logit_band(
        &mut self,
        x: Slice,
        span: f32,
        exclude: Option<u32>,
        out: IBuf,
    ) -> BResult<()> {
        const OP: &str = "logit_band";
        let cap = (out.len() - ds4_engine::sampler::BAND_HEAD) / 2;
        // An index past the row excludes nothing (the definition's reading).
        let ex = exclude
            .filter(|&e| (e as usize) < x.len)
            .map_or(-1, |e| e as i32);
        let (xp, op_) = (self.fptr(x, OP)?, self.iptr(out, OP)?);
        self.launch(
            "ds4_logit_band",
            (1, 1, 1),
            1024,
            &[
                Arg::Ptr(xp),
                i32a(OP, "values", x.len)?,
                Arg::F32(span),
                Arg::I32(ex),
                i32a(OP, "capacity", cap)?,
                Arg::Ptr(op_),
            ],
        )
    }

    /// Up to `BANDS_MAX` bands of rows of `x` per launch of `ds4_logit_bands` (docs/gpu.md
    /// §31): a block per row, each the one-row kernel, side by side.
    pub(super) fn op_logit_bands(&mut self, x: Slice, n: usize, jobs: &[BandJob]) -> BResult<()> {
        const OP: &str = "logit_bands";
        let xp = self.fptr(x, OP)?;
        for group in jobs.chunks(BANDS_MAX) {
            // Laid out as Ds4BandJobs in ops.cu: the out pointers, then rows, spans and
            // capacities (4 bytes each, two per word), then the count.
            let mut blob = vec![0u64; BANDS_MAX + 3 * BANDS_MAX / 2 + 1];
            let mut ints = [0u32; 3 * BANDS_MAX];
            for (i, j) in group.iter().enumerate() {
                blob[i] = self.iptr(j.out, OP)?;
                ints[i] = i32v(OP, "row", j.row)? as u32;
                ints[BANDS_MAX + i] = j.span.to_bits();
                ints[2 * BANDS_MAX + i] = ((j.out.len() - ds4_engine::sampler::BAND_HEAD) / 2)
                    .try_into()
                    .unwrap_or(i32::MAX as u32);
            }
            for (k, pair) in ints.chunks_exact(2).enumerate() {
                blob[BANDS_MAX + k] = u64::from(pair[0]) | (u64::from(pair[1]) << 32);
            }
            blob[BANDS_MAX + 3 * BANDS_MAX / 2] = group.len() as u64;
            self.launch_blob(
                "ds4_logit_bands",
                (g32(group.len()), 1, 1),
                1024,
                &[Arg::Ptr(xp), i32a(OP, "values", n)?],
                2,
                &blob,
            )?;
        }
        Ok(())
    }

    pub(super) fn op_norm_rope(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        eps: f32,
        a: RopeArgs,
        fp8_dims: Option<usize>,
    ) -> BResult<()> {
        const OP: &str = "norm_rope";
        let (rows, width, rd) = (a.n_rows * a.n_heads, a.head_dim, a.freq.rope_dim);
        let n8 = fp8_dims.unwrap_or(0);
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let wp = match w {
            Some(w) => self.wvec(w, OP, width)?,
            None => 0,
        };
        let fp = self.freqs_ptr(&a)?;
        let xp = self.fptr(x, OP)?;
        let pp = self.row_pos_ptr(&a, OP)?;
        self.launch(
            "ds4_norm_rope",
            (g32(rows), 1, 1),
            256,
            &[
                Arg::Ptr(xp),
                Arg::Ptr(wp),
                i32a(OP, "width", width)?,
                Arg::F32(eps),
                Arg::Ptr(fp),
                i32a(OP, "heads", a.n_heads)?,
                i32a(OP, "rope dim", rd)?,
                u(a.pos0),
                u(a.pos_step),
                Arg::Ptr(pp),
                i32a(OP, "fp8 dims", n8)?,
            ],
        )
    }

    /// Two head preparations in one launch (`ds4_norm_rope2`) when they share the width,
    /// eps and rotation (positions, frequencies) and differ only in their heads, weight and
    /// FP8 dims — the attention's query heads and KV row; otherwise two launches.
    /// `store`: b's one row also goes to its window ring (checked by the caller), from the
    /// block that finishes it; without the paired launch, a ring-store launch after it.
    pub(super) fn op_norm_rope_pair(
        &mut self,
        a: NormRopeCall,
        b: NormRopeCall,
        store: Option<RingStoreCall>,
    ) -> BResult<()> {
        const OP: &str = "norm_rope";
        let same_rotation = RopeArgs {
            n_heads: a.rope.n_heads,
            ..b.rope
        } == a.rope;
        let (rows_a, rows_b) = (
            a.rope.n_rows * a.rope.n_heads,
            b.rope.n_rows * b.rope.n_heads,
        );
        // Rows of one buffer go one call after the other (they could overlap).
        if !self.fusions.norm_rope
            || a.x.buf.id() == b.x.buf.id()
            || !same_rotation
            || a.eps.to_bits() != b.eps.to_bits()
            || a.rope.inverse
            || rows_a == 0
            || rows_b == 0
            || a.rope.head_dim == 0
        {
            self.op_norm_rope(a.x, a.w, a.eps, a.rope, a.fp8_dims)?;
            self.op_norm_rope(b.x, b.w, b.eps, b.rope, b.fp8_dims)?;
            if let Some(c) = store {
                self.op_ring_store(c.ring, c.kv, c.pos0, c.n_tok, c.window)?;
            }
            return Ok(());
        }
        let width = a.rope.head_dim;
        let (ring, slot) = match store {
            Some(c) => (self.fptr(c.ring, OP)?, (c.pos0 % c.window) as u64),
            None => (0, 0),
        };
        let wptr = |be: &mut Self, w: Option<Weight>| match w {
            Some(w) => be.wvec(w, OP, width),
            None => Ok(0),
        };
        let (wa, wb) = (wptr(self, a.w)?, wptr(self, b.w)?);
        let fp = self.freqs_ptr(&a.rope)?;
        let (xa, xb) = (self.fptr(a.x, OP)?, self.fptr(b.x, OP)?);
        let pp = self.row_pos_ptr(&a.rope, OP)?;
        let rows = rows_a + rows_b;
        // One warp per row for prefill-sized launches (docs/gpu.md §21), a block per row
        // otherwise; the same values either way.
        let warps = rows >= self.norm_rope_warp_rows && width <= self.norm_rope_warps_width;
        let (name, grid) = if warps {
            ("ds4_norm_rope2_warps", g32(rows.div_ceil(8)))
        } else {
            ("ds4_norm_rope2", g32(rows))
        };
        let mut args = vec![
            Arg::Ptr(xa),
            Arg::Ptr(wa),
            i32a(OP, "heads", a.rope.n_heads)?,
            i32a(OP, "fp8 dims", a.fp8_dims.unwrap_or(0))?,
            i32a(OP, "rows", rows_a)?,
            Arg::Ptr(xb),
            Arg::Ptr(wb),
            i32a(OP, "heads", b.rope.n_heads)?,
            i32a(OP, "fp8 dims", b.fp8_dims.unwrap_or(0))?,
            i32a(OP, "width", width)?,
            Arg::F32(a.eps),
            Arg::Ptr(fp),
            i32a(OP, "rope dim", a.rope.freq.rope_dim)?,
            u(a.rope.pos0),
            u(a.rope.pos_step),
            Arg::Ptr(pp),
            Arg::Ptr(ring),
            Arg::U64(slot),
        ];
        if warps {
            args.push(i32a(OP, "rows", rows)?);
        }
        self.launch(name, (grid, 1, 1), 256, &args)
    }

    /// Two same-shaped matmuls on one input: one grouped-GEMV launch (matrix z of the grid
    /// = which weight) for a single token, else two matmuls.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_matmul_pair(
        &mut self,
        wa: Weight,
        wb: Weight,
        x: Slice,
        n_tok: usize,
        ya: Slice,
        yb: Slice,
    ) -> BResult<()> {
        const OP: &str = "matmul_pair";
        if wa.info != wb.info || wa.info.mats() != 1 {
            self.op_matmul(wa, 0, x, n_tok, ya)?;
            return self.op_matmul(wb, 0, x, n_tok, yb);
        }
        let (cols, rows) = (wa.info.cols(), wa.info.rows());
        let ty = self.weight(wa, OP)?.info.ty;
        let (pa, pb) = (self.wraw(wa, OP)?, self.wraw(wb, OP)?);
        let xp = self.fptr(x, OP)?;
        if !(self.grouped_ok(ty, cols, rows, pa)
            && self.grouped_ok(ty, cols, rows, pb)
            && xp.is_multiple_of(16))
        {
            self.op_matmul(wa, 0, x, n_tok, ya)?;
            return self.op_matmul(wb, 0, x, n_tok, yb);
        }
        if n_tok != 1 {
            // Decode rows: each token summed as its one-token pair launch sums it, the
            // input quantized once for both.
            return self.input_once(n_tok, |b| {
                b.matmul_copies(wa, 0, x, n_tok, ya, 2)?;
                b.matmul_copies(wb, 0, x, n_tok, yb, 2)
            });
        }
        let (ap, bp) = (self.fptr(ya, OP)?, self.fptr(yb, OP)?);
        let ids = self.iota()?;
        self.grouped(
            ty,
            (pa, Some(pb)),
            0,
            ids,
            1,
            xp,
            0,
            (ap, Some(bp)),
            (1, 1),
            cols,
            rows,
            self.act_q8,
        )
    }
    /// [`ds4_engine::Backend::matmul_set`]: each matrix as its own op would run it (pairs
    /// through [`Self::op_matmul_pair`]), the input's int8 codes made once for all of them
    /// at decode rows (docs/gpu.md §29).
    pub(super) fn op_matmul_set(
        &mut self,
        x: Slice,
        n_tok: usize,
        singles: &[(Weight, Slice)],
        pairs: &[ds4_engine::MatmulPair],
    ) -> BResult<()> {
        self.input_once(n_tok, |b| {
            for &(w, y) in singles {
                b.op_matmul(w, 0, x, n_tok, y)?;
            }
            for p in pairs {
                b.op_matmul_pair(p.wa, p.wb, x, n_tok, p.ya, p.yb)?;
            }
            Ok(())
        })
    }

    /// Runs `f` (matmuls of one input that write no input) with the several-column GEMVs'
    /// quantized input kept between its launches: a launch whose input was quantized
    /// before in `f` reuses the codes. Nested calls join the outer one.
    fn input_once(
        &mut self,
        n_tok: usize,
        f: impl FnOnce(&mut Self) -> BResult<()>,
    ) -> BResult<()> {
        let own = self.q8_input_once && n_tok > 1 && self.q8_input_memo.is_none();
        if own {
            self.q8_input_memo = Some(None);
        }
        let r = f(self);
        if own {
            self.q8_input_memo = None;
        }
        r
    }
}
