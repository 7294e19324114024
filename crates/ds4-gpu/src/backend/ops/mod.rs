//! The engine ops: launches of the kernels (`kernels/*.cu`), one file per kernel family.
//! Arguments arrive checked by `ds4_engine::validate` (the `Backend` impl in `../mod.rs`
//! calls it); what is checked here is only what the kernels add: handle lookups and their
//! capacity limits. This file holds what the families share: limits, launch plans and helpers.

mod attention;
mod gemv;
mod hc;
mod indexer;
mod matmul;
mod moe;
mod norm_rope;
mod sampling;
mod tiles;

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
/// Indexer rows scored per block (`DS4_IDX_ROWS` in indexer.cu).
const IDX_ROWS_PER_BLOCK: usize = 16;
/// Length of the on-device 0..n sequence used as group ids.
const IOTA_LEN: usize = 64;
/// Keys per block of the split-key (decode) attention.
const ATT_KEYS_PER_SPLIT: usize = 32;
/// Splits the combine kernel holds weights for (`DS4_ATT_MAX_SPLITS` in attention.cu).
const ATT_MAX_SPLITS: usize = 1024;
/// Below this many (token, head) blocks attention splits the keys over blocks too.
const ATT_SPLIT_BELOW_BLOCKS: usize = 1024;
/// Chunks of at least this many tokens run the compressor in parallel over their completed
/// windows (`ds4_compressor_windows` + `ds4_compressor_tail`) instead of one block walking
/// the tokens (`ds4_compressor`); both give the same bits.
const COMP_WINDOWS_FROM: usize = 8;
/// Widest overlapping window the tail kernel holds in registers
/// (`DS4_COMP_MAX_OVERLAP_M` in compressor.cu).
const COMP_MAX_OVERLAP_M: usize = 8;
/// The tensor-core indexer scores (`DS4_IMMA_*` in indexer.cu): 64 heads of 128 dims, 4 tokens
/// and 512 rows per block; only for prefill chunks (decode keeps the exact-order kernel).
const IMMA_HEADS: usize = 64;
const IMMA_DIM: usize = 128;
const IMMA_TOKENS: usize = 4;
const IMMA_ROWS: usize = 512;
const IMMA_MIN_TOKENS: usize = 16;
/// Head dim and heads per block of the tensor-core attention (`DS4_AMMA_HD`,
/// `DS4_AMMA_HEADS` in attention.cu), and its threads.
const AMMA_HD: usize = 512;
const AMMA_HEADS: usize = 64;
const AMMA_THREADS: u32 = 512;
/// Sequences of one batched attention launch (`DS4_ATT_SEQS` in attention.cu).
const ATT_SEQS: usize = 16;
/// Bands per `ds4_logit_bands` launch (`DS4_BANDS_MAX`, kernels/sampling.cu).
pub(crate) const BANDS_MAX: usize = 16;
/// Most partial-result bytes of one batched attention launch (beyond: one sequence at a
/// time, each with its own, smaller partials).
const ATT_BATCH_PART_BYTES: usize = 256 << 20;

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

/// `ds4_hc_pre_regs` (kernels/hc.cu): streams and width it holds in registers
/// (DS4_HCR_N, DS4_HCR_CT x DS4_HCR_J) and its block (DS4_HCR_CT + one Sinkhorn warp).
pub(crate) const HC_REGS_MAX_STREAMS: usize = 4;
pub(crate) const HC_REGS_MAX_DIM: usize = 512 * 8;
pub(crate) const HC_REGS_THREADS: u32 = 512 + 32;

/// `ds4_hc_mix_part` / `ds4_hc_mix_apply` (kernels/hc.cu): columns of each stream per
/// partial block (DS4_HCM_COLS), Gram entries per partial (DS4_HCM_G) and the block size
/// of both kernels (DS4_HCM_WARPS x 32 = DS4_HCM_APPLY).
pub(crate) const HC_MIX_COLS: usize = 64;
pub(crate) const HC_MIX_GRAM: usize = 10;
pub(crate) const HC_MIX_THREADS: u32 = 256;
/// Most partial blocks per token `ds4_hc_mix_apply` stages (DS4_HCM_PARTS): width ≤ 64 × 64.
pub(crate) const HC_MIX_MAX_PARTS: usize = 64;
/// Tokens per block of `ds4_hc_mix_part_tpb_*` (`DS4_HCM_TPB`).
pub(crate) const HC_MIX_TPB: usize = 4;
/// Passes of at least this many tokens use `ds4_hc_mix_part_tpb_*` (the same values,
/// docs/gpu.md §11): prompt pieces, where a block per token made the op grow with the
/// tokens, not the 16 sequences of a batched decode step, where four tokens per block
/// measured slower (BENCHMARKS.md, four-token HC blocks).
pub(crate) const HC_MIX_TPB_FROM: usize = 17;
/// Paired head preparations of at least this many rows (heads x tokens) run a warp per row
/// (`ds4_norm_rope2_warps`, the same values as a block per row, docs/gpu.md §21): prefill
/// chunks, not a one-token step's 65 rows, which keep a block each on 65 multiprocessors.
pub(crate) const NORM_ROPE_WARPS_FROM: usize = 256;

/// `ds4_router_warp` (kernels/moe.cu): experts per token it holds (32 lanes x
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
