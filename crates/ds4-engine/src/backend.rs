//! The op-level `Backend` trait the forward pass is written against.
//!
//! Why op-level: the model is written once (`forward.rs`), and every device (the CPU
//! reference here, CUDA/HIP later) implements the same list of coarse operations. An op is
//! one "kernel's worth" of work over a whole chunk of tokens (a matmul over all tokens, the
//! attention of all heads and tokens, the Sinkhorn mixing of all tokens), so a GPU needs one
//! launch per op, never one per scalar, while each op stays small enough to be tested alone
//! against a scalar reference.
//!
//! Memory model: the forward code never sees numbers. It holds opaque handles to
//! backend-owned f32 buffers ([`Buf`], sub-ranges as [`Slice`]), i32 buffers ([`IBuf`]) and
//! weights ([`Weight`]); only [`Backend::upload`]/[`Backend::download`] cross the boundary.
//! An operand an op writes shares no buffer with its other operands, except the exact
//! in-place forms an op documents ([`crate::validate`] states the rule and why; a backend
//! refuses anything else with [`BackendError::Aliasing`]).
//!
//! Argument checks live in [`crate::validate`], one function per op, and run in exactly one
//! place: a device implements [`crate::device::Device`] (the same ops, unchecked), and its
//! `Backend` is the blanket implementation that checks each call before passing it on. No
//! caller reaches a device's op without the check and no backend has to remember it, so
//! every backend refuses the same calls with the same error.
//!
//! Shapes are row-major with the token index slowest: `[T, width]` means token `t`'s values
//! are `t*width .. (t+1)*width`. Weight matrices follow GGUF: a weight with dims
//! `[ne0, ne1, ne2]` holds `ne2` matrices of `ne1` rows, each row `ne0` contiguous elements,
//! so `y = W x` is one dot product per row (`in = ne0`, `out = ne1`).

use std::sync::Arc;

use ds4_gguf::{GgmlType, GgufFile};

/// Why a backend refused or failed an op. Every variant names the op and the numbers.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BackendError {
    #[error("{op}: buffer #{id} is unknown or was freed")]
    BadHandle { op: &'static str, id: u32 },
    #[error("{op}: range {off}..{end} lies outside buffer #{id} of {len} elements")]
    OutOfRange {
        op: &'static str,
        id: u32,
        off: usize,
        end: usize,
        len: usize,
    },
    #[error("{op}: an output shares buffer #{id} with another operand of the op")]
    Aliasing { op: &'static str, id: u32 },
    #[error("{op}: {what} is {found}, expected {expected}")]
    Shape {
        op: &'static str,
        what: String,
        expected: usize,
        found: usize,
    },
    #[error("{op}: weight type {ty} is not supported here")]
    UnsupportedType { op: &'static str, ty: GgmlType },
    #[error("weight {name:?}: {problem}")]
    Weight { name: String, problem: String },
    #[error("{op}: {problem}")]
    Invalid { op: &'static str, problem: String },
    #[error("out of memory allocating {elems} elements: {problem}")]
    Alloc { elems: usize, problem: String },
}

pub type BResult<T> = Result<T, BackendError>;

/// The bytes of `m` in `slab`, or an error naming the range that lies outside it.
pub fn slab_mat_bytes<'a>(slab: &'a dyn HostSlab, m: &SlabMat) -> BResult<&'a [u8]> {
    let b = slab.bytes();
    b.get(m.range.clone()).ok_or_else(|| BackendError::Invalid {
        op: "write_weight_mats",
        problem: format!(
            "matrix {} of weight #{}: bytes {}..{} lie outside a slab of {}",
            m.mat,
            m.weight.id(),
            m.range.start,
            m.range.end,
            b.len()
        ),
    })
}

/// Handle to a backend-owned buffer of `len` f32 values (zero-initialised at allocation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Buf {
    id: u32,
    len: usize,
}

impl Buf {
    /// For backends: wrap an id they issued.
    pub fn new(id: u32, len: usize) -> Buf {
        Buf { id, len }
    }
    pub fn id(self) -> u32 {
        self.id
    }
    pub fn len(self) -> usize {
        self.len
    }
    pub fn is_empty(self) -> bool {
        self.len == 0
    }
    /// The whole buffer.
    pub fn all(self) -> Slice {
        Slice {
            buf: self,
            off: 0,
            len: self.len,
        }
    }
    /// Elements `off .. off+len` (checked by the backend when used).
    pub fn slice(self, off: usize, len: usize) -> Slice {
        Slice {
            buf: self,
            off,
            len,
        }
    }
    /// Rows `row0 .. row0+n` of a `[rows, width]` view.
    pub fn rows(self, row0: usize, n: usize, width: usize) -> Slice {
        self.slice(row0 * width, n * width)
    }
}

/// A contiguous range of a [`Buf`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Slice {
    pub buf: Buf,
    pub off: usize,
    pub len: usize,
}

impl Slice {
    pub fn end(self) -> usize {
        self.off + self.len
    }
    /// A sub-range of this slice (relative offsets).
    pub fn sub(self, off: usize, len: usize) -> Slice {
        Slice {
            buf: self.buf,
            off: self.off + off,
            len,
        }
    }
    /// Whether two slices share any element.
    pub fn overlaps(self, other: Slice) -> bool {
        self.buf.id == other.buf.id && self.off < other.end() && other.off < self.end()
    }
}

/// Handle to a backend-owned buffer of `len` i32 values (token ids, expert ids, row indices).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IBuf {
    id: u32,
    len: usize,
}

impl IBuf {
    pub fn new(id: u32, len: usize) -> IBuf {
        IBuf { id, len }
    }
    pub fn id(self) -> u32 {
        self.id
    }
    pub fn len(self) -> usize {
        self.len
    }
    pub fn is_empty(self) -> bool {
        self.len == 0
    }
}

/// Shape and type of a loaded weight, known to the engine so it can check shapes without
/// asking the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightInfo {
    pub ty: GgmlType,
    /// GGUF dims, ne0 first; missing trailing dims are 1.
    pub dims: [usize; 3],
}

impl WeightInfo {
    /// Elements per row (`ne0`, the input width of a matmul).
    pub fn cols(&self) -> usize {
        self.dims[0]
    }
    /// Rows per matrix (`ne1`, the output width of a matmul).
    pub fn rows(&self) -> usize {
        self.dims[1]
    }
    /// Number of matrices (`ne2`; experts for routed tensors).
    pub fn mats(&self) -> usize {
        self.dims[2]
    }
    pub fn n_elements(&self) -> usize {
        self.dims[0] * self.dims[1] * self.dims[2]
    }
}

/// Handle to a backend-resident weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Weight {
    id: u32,
    pub info: WeightInfo,
}

impl Weight {
    pub fn new(id: u32, info: WeightInfo) -> Weight {
        Weight { id, info }
    }
    pub fn id(self) -> u32 {
        self.id
    }
}

/// Host memory that streamed expert reads land in (docs/placement.md §9): a reader thread
/// fills it from the model file, then [`Backend::write_weight_mats`] stores its matrices.
/// The default is ordinary heap memory ([`HeapSlab`]); a GPU backend hands out
/// page-locked memory instead, which its copy engine reads directly and asynchronously
/// (no staging copy, no host wait per matrix).
pub trait HostSlab: Send + std::any::Any {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
    /// Whether the memory is page-locked (reports and tests).
    fn pinned(&self) -> bool {
        false
    }
}

/// Ordinary heap memory as a [`HostSlab`] (zeroed lazily by the allocator).
#[derive(Debug)]
pub struct HeapSlab(Box<[u8]>);

impl HeapSlab {
    pub fn zeroed(bytes: usize) -> HeapSlab {
        HeapSlab(vec![0u8; bytes].into_boxed_slice())
    }
}

impl HostSlab for HeapSlab {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

/// Slabs a backend hands back, with the tags they were stored with.
pub type TaggedSlabs = Vec<(u64, Box<dyn HostSlab>)>;

/// One matrix of a [`HostSlab`] for [`Backend::write_weight_mats`]: bytes `range` of the
/// slab become matrix `mat` of `weight`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlabMat {
    pub weight: Weight,
    pub mat: usize,
    pub range: std::ops::Range<usize>,
}

/// How the forward pass reads a weight, so a backend can choose a storage form
/// (e.g. keep matrices quantized in place but widen small vectors to f32 once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightUse {
    /// Multiplied with activations (`matmul`, `moe`).
    Matrix,
    /// Read elementwise: norm weights, sinks, biases, mHC base/scale, compressor `ape`.
    Vector,
    /// Rows gathered by index: the embedding table, the hash-routing table (I32).
    Table,
}

/// RoPE frequency schedule of a layer (docs/forward.md §2.3). Backends derive the per-pair frequencies
/// with [`crate::numerics::rope_freqs`] so every device uses the same formula.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeFreq {
    pub base: f32,
    /// `Some` on compressed layers only.
    pub yarn: Option<ds4_model::Yarn>,
    pub rope_dim: usize,
}

/// Arguments of [`Backend::rope`]: rotate the last `rope_dim` dims of every head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeArgs {
    /// Rows (tokens, or compressed rows).
    pub n_rows: usize,
    /// Heads per row; a row is `n_heads * head_dim` values.
    pub n_heads: usize,
    pub head_dim: usize,
    /// Row `r` is rotated at position `pos0 + r * pos_step` …
    pub pos0: usize,
    pub pos_step: usize,
    pub freq: RopeFreq,
    /// Rotate by `-p·ω` (the output de-rotation, docs/forward.md §5.7).
    pub inverse: bool,
    /// … unless this is set: then row `r` is at position `row_pos[r]` (`pos0`, `pos_step`
    /// unused). A batched decode step's rows belong to different sequences, each at its
    /// own position, and one launch rotates them all (docs/forward.md §3 "Batched decode").
    pub row_pos: Option<IBuf>,
}

/// Constants of the mHC ops (docs/forward.md §4).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HcArgs {
    pub n_tok: usize,
    /// Streams (`hc_mult`, 4).
    pub n_hc: usize,
    /// Hidden width per stream.
    pub dim: usize,
    pub sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub rms_eps: f32,
}

/// The HCPost of a finished sublayer, applied by [`Backend::hc_post_mix_pre_norm`] just before
/// the next sublayer's HCPre: the sublayer's output `f` (plus `f2`, the shared expert's
/// output, after an MoE sublayer) and the `post` / `comb` coefficients of its own HCPre.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HcPost {
    pub f: Slice,
    pub f2: Option<Slice>,
    pub post: Slice,
    pub comb: Slice,
}

impl HcPost {
    /// The same post for rows `r0..r0 + n` of the step (`dim` wide outputs, `n_hc`
    /// streams): each row's post reads only that row.
    pub fn rows(self, r0: usize, n: usize, dim: usize, n_hc: usize) -> HcPost {
        HcPost {
            f: self.f.sub(r0 * dim, n * dim),
            f2: self.f2.map(|f2| f2.sub(r0 * dim, n * dim)),
            post: self.post.sub(r0 * n_hc, n * n_hc),
            comb: self.comb.sub(r0 * n_hc * n_hc, n * n_hc * n_hc),
        }
    }
}

/// One [`Backend::norm_rope`] call, for [`Backend::norm_rope_pair`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormRopeCall {
    pub x: Slice,
    pub w: Option<Weight>,
    pub eps: f32,
    pub rope: RopeArgs,
    pub fp8_dims: Option<usize>,
}

/// One [`Backend::compressor`] call of a batched decode step ([`Backend::compressor_batch`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CompressorCall {
    pub acc: Slice,
    pub u: Slice,
    pub z: Slice,
    pub ape: Weight,
    pub args: CompressorArgs,
    pub rows: Slice,
}

/// One [`Backend::indexer_topk`] call of a batched decode step
/// ([`Backend::indexer_topk_batch`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IndexerCall {
    pub q: Slice,
    pub w: Slice,
    pub rows: Slice,
    pub args: IndexerArgs,
    pub out: IBuf,
}

/// Two matrices of one shape and type reading the same input ([`Backend::matmul_pair`]'s
/// arguments, as one entry of [`Backend::matmul_set`]).
#[derive(Debug, Clone, Copy)]
pub struct MatmulPair {
    pub wa: Weight,
    pub wb: Weight,
    pub ya: Slice,
    pub yb: Slice,
}

/// One [`Backend::ring_store`] call of a batched decode step ([`Backend::ring_store_batch`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RingStoreCall {
    pub ring: Slice,
    pub kv: Slice,
    pub pos0: usize,
    pub n_tok: usize,
    pub window: usize,
}

/// Arguments of [`Backend::compressor`] (docs/forward.md §5.3): feed `n_tok` tokens at positions
/// `pos0..` into the accumulator and pool every window that completes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CompressorArgs {
    pub pos0: usize,
    pub n_tok: usize,
    /// Window length `m`.
    pub ratio: usize,
    /// Output row width `c`.
    pub width: usize,
    /// Overlapping windows (ratio 4): projections are `2c` wide.
    pub overlap: bool,
}

impl CompressorArgs {
    /// Width of the per-token projections `u`, `z` (`κ·c`).
    pub fn proj_width(&self) -> usize {
        if self.overlap {
            2 * self.width
        } else {
            self.width
        }
    }
    /// Accumulator slots (tokens kept): previous + current window with overlap, else one window.
    pub fn slots(&self) -> usize {
        if self.overlap {
            2 * self.ratio
        } else {
            self.ratio
        }
    }
    /// f32 elements of the accumulator: `(u, z) × slots × proj_width`.
    pub fn acc_len(&self) -> usize {
        2 * self.slots() * self.proj_width()
    }
}

/// Arguments of [`Backend::indexer_topk`] (docs/forward.md §5.5).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IndexerArgs {
    pub pos0: usize,
    pub n_tok: usize,
    pub ratio: usize,
    pub n_heads: usize,
    pub head_dim: usize,
    pub top_k: usize,
    /// Multiplies the head weights (`1/√(head_dim·n_heads)`).
    pub weight_scale: f32,
}

/// Which compressed rows a query attends to (docs/forward.md §5.4).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CompSel {
    /// Sliding-only layer.
    None,
    /// All `⌊(p+1)/ratio⌋` visible rows of `rows` (HCA).
    All { rows: Slice, ratio: usize },
    /// The indexer's choice: `idx` is `[T, k]`, ascending row indices padded with −1 (CSA).
    /// Each index must be a visible row (`< ⌊(p+1)/ratio⌋`).
    Top {
        rows: Slice,
        ratio: usize,
        idx: IBuf,
        k: usize,
    },
}

/// Arguments of [`Backend::attention`] (docs/forward.md §5.2, §5.6).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnArgs {
    /// `[T, n_head, head_dim]`, normed and roped queries.
    pub q: Slice,
    /// `[T, head_dim]`: this chunk's KV rows (key = value).
    pub kv: Slice,
    /// `[window, head_dim]`: KV rows of earlier positions, row of position `p` in slot `p % window`.
    pub ring: Slice,
    pub comp: CompSel,
    /// `[n_head]` sink logits.
    pub sinks: Weight,
    pub pos0: usize,
    pub n_tok: usize,
    pub n_head: usize,
    pub head_dim: usize,
    pub window: usize,
    pub scale: f32,
    /// `[T, n_head, head_dim]`.
    pub out: Slice,
}

/// One band of [`Backend::logit_bands`]: row `row` of the rows, the span, where it goes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BandJob {
    pub row: usize,
    pub span: f32,
    pub out: IBuf,
}

/// Arguments of [`Backend::router`] (docs/forward.md §6 steps 1–3).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterArgs {
    pub n_tok: usize,
    pub n_expert: usize,
    /// Experts per token.
    pub k: usize,
    /// Routed scaling factor λ.
    pub scale: f32,
    /// The call's first row within the step: token ids are read from `tokens[row0..]` and
    /// expert ids written from `ids[row0 * k]` on (logits and weights are slices the caller
    /// offsets). Each sequence of a joint prefill routes its own rows into the step's one
    /// id buffer this way (docs/forward.md §14).
    pub row0: usize,
}

/// How experts are chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Routing {
    /// Top-k of `sqrtsoftplus(logits) + bias` (bias absent = 0).
    TopK { bias: Option<Weight> },
    /// `tid2eid[token]` (I32 table `[k, n_vocab]`), `tokens` is `[T]`.
    Hash { table: Weight, tokens: IBuf },
}

/// Arguments of [`Backend::moe`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeArgs {
    pub n_tok: usize,
    pub k: usize,
    pub clamp: f32,
}

/// Host↔device traffic and launches a backend has issued since it was created, so
/// benchmarks can show per-token overhead (launches and synchronisations per token).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Kernel launches (0 on backends without kernels).
    pub launches: u64,
    /// Host waits for the device (explicit synchronisations and blocking copies back).
    pub syncs: u64,
    /// Host time blocked in those waits, nanoseconds: near a token's time when the device
    /// is the bottleneck, near zero when issuing the launches is.
    pub wait_ns: u64,
}

/// One row of a device-time attribution: the time the device spent on launches of
/// `kernel` issued while the forward pass was in section `tag` (e.g. a layer kind).
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileRow {
    pub tag: &'static str,
    pub kernel: &'static str,
    pub launches: u64,
    pub ms: f64,
}

/// What a forward pass recorded as a device graph costs ([`Backend::end_capture_replay`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GraphTiming {
    /// Nodes of the graph (kernel launches and copies).
    pub nodes: usize,
    /// Host time to end the recording and instantiate the graph.
    pub instantiate_ms: f64,
    /// Device time per replay (events around the timed replays).
    pub replay_ms: f64,
}

/// An execution device, as the engine sees it. Object safe: the engine holds a
/// `Box<dyn Backend>`.
///
/// Implemented only by the blanket `impl<D: Device> Backend for D` of [`crate::device`], which
/// runs the op's [`crate::validate`] check and then the device's op: a backend implements
/// [`crate::device::Device`], a wrapper around another backend [`crate::device::Forward`].
/// Where a method's doc speaks of "the default", it is `Device`'s, for backends that do not
/// provide their own; the fused ops' defaults are the sequences in [`crate::fused`].
///
/// Determinism contract: for fixed inputs an op's output must not depend on the number of
/// threads (fixed reduction orders), and a token's results must not depend on which other
/// tokens share its chunk where the math does not couple them (matmuls, norms, MoE), so that
/// prefill, chunked prefill and decode agree.
pub trait Backend: Send {
    /// Short name for logs ("cpu").
    fn name(&self) -> String;

    /// Whether the first forward pass of a shape pays one-time costs that a warm-up pass
    /// at load should take instead of the first request: a GPU's lazily loaded kernels and
    /// library kernels, scratch buffers grown to the chunk size, pinned staging. False on
    /// the CPU, where a chunk of a full-size model takes minutes and its scratch is cheap.
    fn warms_up(&self) -> bool;

    // ---- memory -------------------------------------------------------------------------

    /// A zero-filled f32 buffer.
    fn alloc(&mut self, len: usize) -> BResult<Buf>;
    /// A zero-filled i32 buffer.
    fn alloc_i32(&mut self, len: usize) -> BResult<IBuf>;
    fn free(&mut self, buf: Buf);
    fn free_i32(&mut self, buf: IBuf);
    fn upload(&mut self, dst: Slice, src: &[f32]) -> BResult<()>;
    fn download(&mut self, src: Slice, dst: &mut [f32]) -> BResult<()>;
    fn upload_i32(&mut self, dst: IBuf, off: usize, src: &[i32]) -> BResult<()>;
    fn download_i32(&mut self, src: IBuf, off: usize, dst: &mut [i32]) -> BResult<()>;
    /// `dst = src`; two buffers (the aliasing rule of [`crate::validate`]).
    fn copy(&mut self, src: Slice, dst: Slice) -> BResult<()>;
    fn fill(&mut self, dst: Slice, value: f32) -> BResult<()>;

    // ---- weights ------------------------------------------------------------------------

    /// Makes tensor `name` of `file` available to ops. CPU backends reference the mapping;
    /// device backends copy it.
    fn load_weight(
        &mut self,
        file: &Arc<GgufFile>,
        name: &str,
        usage: WeightUse,
    ) -> BResult<Weight>;

    /// Loads many tensors at once, in `list` order; the result holds one weight per entry.
    /// Device backends override this to overlap file reads with host-to-device copies;
    /// the default loads them one by one.
    fn load_weights(
        &mut self,
        file: &Arc<GgufFile>,
        list: &[(String, WeightUse)],
    ) -> BResult<Vec<Weight>>;

    /// A zero-filled weight of `info` that no file backs: the slot pools of streamed
    /// routed experts (docs/placement.md §9), filled matrix by matrix with
    /// [`Backend::write_weight_mat`]. The default refuses (the backend cannot stream).
    fn alloc_weight(&mut self, name: &str, info: WeightInfo) -> BResult<Weight>;

    /// Stores `raw`, one matrix's bytes exactly as the GGUF file holds them (`rows` rows
    /// of the type's row size), as matrix `mat` of `w` (a weight from
    /// [`Backend::alloc_weight`]). Ops issued afterwards see the new bytes; the caller
    /// must not overwrite a matrix an earlier op still reads (the engine downloads the
    /// router's ids, a synchronisation, before it writes). The backend stores them as its
    /// load path would (e.g. repacked), so ops give what they give on a loaded weight.
    fn write_weight_mat(&mut self, w: Weight, mat: usize, raw: &[u8]) -> BResult<()>;

    /// Host memory of `bytes` for streamed expert reads. The default is heap memory; a GPU
    /// backend returns page-locked memory when the system grants it (heap memory when not:
    /// then its writes copy and wait, as [`Backend::write_weight_mat`] does).
    fn alloc_host_slab(&mut self, bytes: usize) -> BResult<Box<dyn HostSlab>>;

    /// Stores matrices of `slab` as [`Backend::write_weight_mat`] would (same ordering
    /// rule: ops issued afterwards see the new bytes), and gives the slab back when done
    /// with it. A backend that queues asynchronous copies out of the slab keeps it until
    /// they have completed and returns `None`: [`Backend::reclaim_host_slabs`] hands it
    /// back later with `tag`, so the caller cannot refill memory a copy still reads. The
    /// default writes each matrix with `write_weight_mat` and returns the slab at once.
    fn write_weight_mats(
        &mut self,
        slab: Box<dyn HostSlab>,
        tag: u64,
        mats: &[SlabMat],
    ) -> BResult<Option<Box<dyn HostSlab>>>;

    /// The slabs kept by [`Backend::write_weight_mats`] whose copies have completed, with
    /// their tags; with `wait`, first waits until every one has (then all come back). The
    /// default keeps none.
    fn reclaim_host_slabs(&mut self, wait: bool) -> BResult<TaggedSlabs>;

    // ---- dense algebra ------------------------------------------------------------------

    /// `y[t] = W[mat] · x[t]` for `t < n_tok`; `x` is `[T, cols]`, `y` is `[T, rows]`.
    fn matmul(&mut self, w: Weight, mat: usize, x: Slice, n_tok: usize, y: Slice) -> BResult<()>;
    /// Block-diagonal matmul: `W` has `groups·r` rows of `c` inputs; group `g` maps
    /// `x[t, g·c .. (g+1)·c]` to `y[t, g·r .. (g+1)·r]` with rows `g·r .. (g+1)·r`.
    fn matmul_grouped(
        &mut self,
        w: Weight,
        groups: usize,
        x: Slice,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()>;
    /// RMSNorm of `rows` rows of `width`, times `w` if given (docs/forward.md §2.1). `out` may be
    /// exactly `x` (in place).
    fn rms_norm(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        rows: usize,
        width: usize,
        eps: f32,
        out: Slice,
    ) -> BResult<()>;
    /// In-place interleaved RoPE on the last `rope_dim` dims of every head (docs/forward.md §2.3).
    fn rope(&mut self, x: Slice, args: RopeArgs) -> BResult<()>;
    /// `acc += x`.
    fn add(&mut self, acc: Slice, x: Slice) -> BResult<()>;
    /// `out = SiLU(min(g, c)) · clamp(u, −c, c)` elementwise (docs/forward.md §6 step 4).
    fn swiglu(&mut self, gate: Slice, up: Slice, clamp: f32, out: Slice) -> BResult<()>;

    // ---- QAT simulations (docs/forward.md §2.7), in place ------------------------------------------

    /// FP8-E4M3 round trip of the first `n_dims` values of every row, in blocks of 64
    /// (a shorter last block if `n_dims` is not a multiple of 64).
    fn qat_fp8(&mut self, x: Slice, rows: usize, width: usize, n_dims: usize) -> BResult<()>;
    /// Per row of `width` (a power of two): normalised Walsh–Hadamard transform, then the
    /// FP4-E2M1 round trip in blocks of 32.
    fn qat_hadamard_fp4(&mut self, x: Slice, rows: usize, width: usize) -> BResult<()>;

    // ---- model-specific ops -------------------------------------------------------------

    /// `out[t, s] = table[tokens[t]]` for every stream `s < n_streams` (embedding + mHC expand).
    fn embed(
        &mut self,
        table: Weight,
        tokens: IBuf,
        n_tok: usize,
        n_streams: usize,
        out: Slice,
    ) -> BResult<()>;
    /// HCPre after the mixing matmul (docs/forward.md §4.1): `mix` is `[T, 2n+n²]` = φ·x̂ (not yet
    /// scaled by ρ), `x` is `[T, n·D]`; writes `y [T, D]`, `post [T, n]`, `comb [T, n·n]`.
    #[allow(clippy::too_many_arguments)]
    fn hc_pre(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        y: Slice,
        post: Slice,
        comb: Slice,
    ) -> BResult<()>;
    /// HCPost in place on `x [T, n·D]` (docs/forward.md §4.2): `X'_j = post_j·f + Σ_i comb[i][j]·X_i`.
    fn hc_post(
        &mut self,
        x: Slice,
        f: Slice,
        post: Slice,
        comb: Slice,
        args: HcArgs,
    ) -> BResult<()>;
    /// HCHead (docs/forward.md §4.3): `mix` is `[T, n]` = φ_h·x̂; writes `y [T, D]`.
    fn hc_head(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        y: Slice,
    ) -> BResult<()>;
    /// Compressor accumulate-and-pool (docs/forward.md §5.3, state layout §8.1): `u`, `z` are
    /// `[T, κc]` projections (z without the `ape` bias, which this op adds); `acc` is the
    /// layer's accumulator (`args.acc_len()` values); each completed window `w` writes its
    /// pooled (not yet normed) row to `rows[w]`.
    #[allow(clippy::too_many_arguments)]
    fn compressor(
        &mut self,
        acc: Slice,
        u: Slice,
        z: Slice,
        ape: Weight,
        args: CompressorArgs,
        rows: Slice,
    ) -> BResult<()>;
    /// Lightning indexer (docs/forward.md §5.5): for every query, the scores over its visible rows and
    /// their top-k (lowest index wins ties), written to `out [T, k]` ascending, padded −1.
    /// Queries with at most `k` visible rows select all of them without scoring.
    /// `q` is `[T, heads·dim]`, `w` is `[T, heads]` (unscaled), `rows` the indexer rows.
    fn indexer_topk(
        &mut self,
        q: Slice,
        w: Slice,
        rows: Slice,
        args: IndexerArgs,
        out: IBuf,
    ) -> BResult<()>;
    /// [`Backend::compressor`] for each of `calls` in turn (one token of each of several
    /// sequences, docs/forward.md §3 "Batched decode"); a device may run them in one launch.
    /// Each call's results must equal that call alone, bit for bit.
    fn compressor_batch(&mut self, calls: &[CompressorCall]) -> BResult<()>;
    /// [`Backend::indexer_topk`] for each of `calls` in turn (as
    /// [`Backend::compressor_batch`]).
    fn indexer_topk_batch(&mut self, calls: &[IndexerCall]) -> BResult<()>;
    /// Sink attention over window rows and compressed rows (docs/forward.md §5.2, §5.4, §5.6).
    fn attention(&mut self, args: AttnArgs) -> BResult<()>;
    /// [`Backend::attention`] for each of `args` in turn: one token of each of several
    /// sequences (a batched decode step, docs/forward.md §3 "Batched decode"); a device may
    /// run them in one launch. Each output must equal that call alone, bit for bit.
    fn attention_batch(&mut self, args: &[AttnArgs]) -> BResult<()>;
    /// Stores the chunk's KV rows `kv [T, dim]` of positions `pos0..` into the ring
    /// (`[window, dim]`, slot `p % window`); only the last `window` rows matter.
    fn ring_store(
        &mut self,
        ring: Slice,
        kv: Slice,
        pos0: usize,
        n_tok: usize,
        window: usize,
    ) -> BResult<()>;
    /// [`Backend::ring_store`] for each of `calls` in turn (as
    /// [`Backend::compressor_batch`]).
    fn ring_store_batch(&mut self, calls: &[RingStoreCall]) -> BResult<()>;
    /// Router (docs/forward.md §6 steps 1–3): `logits [T, E]` → expert ids `[T, k]` and weights `[T, k]`.
    fn router(
        &mut self,
        logits: Slice,
        routing: Routing,
        args: RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()>;
    /// Routed experts (docs/forward.md §6 step 4): `out[t] = Σ_i W2_e (g_i · SwiGLU_c(W1_e x, W3_e x))`,
    /// summed in slot order `i = 0..k`.
    #[allow(clippy::too_many_arguments)]
    fn moe(
        &mut self,
        x: Slice,
        ids: IBuf,
        weights: Slice,
        gate: Weight,
        up: Weight,
        down: Weight,
        args: MoeArgs,
        out: Slice,
    ) -> BResult<()>;

    // ---- fused ops (each defaults to the ops it fuses; backends may do it in one pass) --

    /// `ya = Wa·x`, `yb = Wb·x`: two matrices of one shape and type reading one input
    /// (compressor kv/gate, shared-expert gate/up), so a device can stream both in one pass.
    #[allow(clippy::too_many_arguments)]
    fn matmul_pair(
        &mut self,
        wa: Weight,
        wb: Weight,
        x: Slice,
        n_tok: usize,
        ya: Slice,
        yb: Slice,
    ) -> BResult<()>;
    /// Several matrices reading one input: `y = W·x` for each of `singles` and
    /// [`Backend::matmul_pair`] for each of `pairs` (the attention input's q_a, kv,
    /// compressor and indexer projections), so a device can prepare `x` once for all of
    /// them (its int8 codes at decode rows, docs/gpu.md §29). Every output must be apart
    /// from `x`.
    fn matmul_set(
        &mut self,
        x: Slice,
        n_tok: usize,
        singles: &[(Weight, Slice)],
        pairs: &[MatmulPair],
    ) -> BResult<()>;
    /// [`Backend::hc_pre`] then `out = rms_norm(y) · norm` (the sublayer's input norm).
    /// `out` may be exactly `y` (in place).
    #[allow(clippy::too_many_arguments)]
    fn hc_pre_norm(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()>;
    /// The sublayer's mixing matmul `mix = fn_·x` then [`Backend::hc_pre_norm`]: one op so a
    /// device can spread the few-row matmul over many blocks and fold the streams' sums of
    /// squares into it (docs/forward.md §4.1; the GPU's version: docs/gpu.md §11). `mix` is
    /// written too (`[T, 2n+n²]`), as by the two ops.
    #[allow(clippy::too_many_arguments)]
    fn hc_mix_pre_norm(
        &mut self,
        fn_: Weight,
        x: Slice,
        mix: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()>;
    /// The previous sublayer's HCPost on `x` ([`Backend::hc_post`], or
    /// [`Backend::hc_post_add`] when `prev.f2` is given), then this sublayer's
    /// [`Backend::hc_mix_pre_norm`] on the updated `x`. One op because the HCPost is
    /// elementwise along the hidden dimension: a device can apply it to the columns each
    /// block of the mixing matmul reads anyway, and save the launch and the pass over `x`
    /// (docs/gpu.md §11). `prev.post` / `prev.comb` may be the very buffers this op's
    /// HCPre writes as `post` / `comb`: they are read before they are overwritten.
    #[allow(clippy::too_many_arguments)]
    fn hc_post_mix_pre_norm(
        &mut self,
        prev: HcPost,
        fn_: Weight,
        x: Slice,
        mix: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()>;
    /// Head preparation in place on `x` (`rope.n_rows · rope.n_heads` rows of
    /// `rope.head_dim`): RMSNorm (times `w` if given), RoPE, then — with `fp8_dims = Some(n)`
    /// — the FP8 round trip of the first `n` dims of every row.
    fn norm_rope(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        eps: f32,
        rope: RopeArgs,
        fp8_dims: Option<usize>,
    ) -> BResult<()>;

    /// Two independent [`Backend::compressor`] calls (a CSA layer's compressor and its
    /// indexer's), in one op so a device can run both in one launch.
    fn compressor_pair(&mut self, a: CompressorCall, b: CompressorCall) -> BResult<()>;

    /// Two [`Backend::norm_rope`] calls on disjoint rows (the attention's query heads and its
    /// KV row): one op so a device can prepare both in one launch.
    fn norm_rope_pair(&mut self, a: NormRopeCall, b: NormRopeCall) -> BResult<()>;

    /// [`Backend::matmul`] of `w` (matrix 0) over `args.n_tok` rows of `x` into `logits`,
    /// then [`Backend::router`] of them: the router's projection and the routing in one op,
    /// so a device can route in the kernel that finishes the logits.
    #[allow(clippy::too_many_arguments)]
    fn router_matmul(
        &mut self,
        w: Weight,
        x: Slice,
        logits: Slice,
        routing: Routing,
        args: RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()>;

    /// [`Backend::rope`] of `x` with `rope`, then [`Backend::qat_hadamard_fp4`] of its
    /// `rows` rows of `width` (= the head dim): the indexer's query heads in official mode,
    /// in one op so a device can rotate a row in the block that transforms it.
    fn rope_qat_hadamard_fp4(
        &mut self,
        x: Slice,
        rope: RopeArgs,
        rows: usize,
        width: usize,
    ) -> BResult<()>;

    /// [`Backend::norm_rope_pair`], then [`Backend::ring_store`] of `store` (whose `kv` is
    /// `b.x`): a one-token step's KV row prepared and put in its window ring in one op, so a
    /// device can store the row from the kernel that finishes it. Only for one-token steps,
    /// whose attention never reads the slot being written (it holds the position a window
    /// back, outside the window: docs/forward.md §5.2), so the store may precede it.
    fn norm_rope_pair_store(
        &mut self,
        a: NormRopeCall,
        b: NormRopeCall,
        store: RingStoreCall,
    ) -> BResult<()>;

    /// [`Backend::rope`] of `x` with `rope`, then [`Backend::matmul_grouped`] of the rotated
    /// `x`: the attention output's de-rotation before `out_a`, in one op so a device can
    /// rotate inside the matmul's input stage. `x` is scratch afterwards (rotated or not).
    fn rope_matmul_grouped(
        &mut self,
        x: Slice,
        rope: RopeArgs,
        w: Weight,
        groups: usize,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()>;

    /// `h = rms_norm(x)·norm` ([`Backend::rms_norm`] of `n_tok` rows as wide as `W`'s input),
    /// then `out = W·h` ([`Backend::matmul`] of matrix 0): the query path's low-rank norm
    /// before its up-projection, in one op so a device can normalize inside the matmul's
    /// input stage (it must still write `h`: the indexer's up-projection reads it).
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul(
        &mut self,
        x: Slice,
        norm: Weight,
        eps: f32,
        h: Slice,
        w: Weight,
        n_tok: usize,
        out: Slice,
    ) -> BResult<()>;

    /// `h = swiglu(gate, up, clamp)` ([`Backend::swiglu`]), then `out = W·h` for `n_tok`
    /// rows ([`Backend::matmul`] of matrix 0): the shared expert's activation and down
    /// projection. `h` is scratch: a backend that computes SwiGLU inside the matmul's
    /// input stage may leave it unwritten.
    #[allow(clippy::too_many_arguments)]
    fn swiglu_matmul(
        &mut self,
        gate: Slice,
        up: Slice,
        clamp: f32,
        h: Slice,
        w: Weight,
        n_tok: usize,
        out: Slice,
    ) -> BResult<()>;

    /// `f += f2` (the shared expert's output onto the routed experts'), then
    /// [`Backend::hc_post`] with the sum.
    fn hc_post_add(
        &mut self,
        x: Slice,
        f: Slice,
        f2: Slice,
        post: Slice,
        comb: Slice,
        args: HcArgs,
    ) -> BResult<()>;

    // ---- decode helpers and instrumentation (defaults made of the ops above) -----------

    /// `out[0]` = index of the largest value of `x`, the first one on ties, NaN never
    /// chosen (unless `x[0]` is NaN: then 0) — exactly [`crate::sampler::argmax`]. Greedy
    /// decoding copies back this one integer instead of the whole logits row.
    fn argmax(&mut self, x: Slice, out: IBuf) -> BResult<()>;
    /// The sampling band of the logits row `x` into `out` ([`crate::sampler::band_words`]
    /// defines the words: a header, then up to `(out.len() - BAND_HEAD) / 2` items of
    /// every value `>= max(x) - span` in index order; index `exclude` counts as -inf).
    /// A min-p sampler then reads back a few hundred bytes instead of the row
    /// ([`crate::Engine::eval_band`]).
    fn logit_band(&mut self, x: Slice, span: f32, exclude: Option<u32>, out: IBuf) -> BResult<()>;
    /// [`Backend::logit_band`] of several rows of `x` (whole rows of `n` values; nothing
    /// excluded): the bands of a batched decode step's rows
    /// ([`crate::Engine::eval_batch_bands`]), which a device can find side by side instead of
    /// one row after another. Default: one `logit_band` per job.
    fn logit_bands(&mut self, x: Slice, n: usize, jobs: &[BandJob]) -> BResult<()>;
    /// Names the section of the forward pass the following ops belong to (layer kinds),
    /// for [`Backend::take_profile`]. No effect unless profiling is on.
    fn annotate(&mut self, tag: &'static str);
    /// Turns device-time attribution on or off; returns whether the backend supports it.
    fn set_profiling(&mut self, on: bool) -> BResult<bool>;
    /// The attribution gathered since the last call (waits for the device), and the
    /// device time it covers in milliseconds.
    fn take_profile(&mut self) -> BResult<Option<(Vec<ProfileRow>, f64)>>;
    /// Starts recording the work the following ops queue into a device graph instead of
    /// running it (CUDA graphs; docs/gpu.md §18). `Ok(false)` where the backend has none:
    /// the ops then run as usual. While recording, an op that would wait for the device or
    /// allocate fails.
    fn begin_capture(&mut self) -> BResult<bool>;
    /// Ends the recording [`Backend::begin_capture`] started, instantiates the graph,
    /// replays it once untimed and `replays` times timed, waits, and destroys it. With
    /// `replays` 0 it only ends the recording (after a failed op). The buffers the recorded
    /// ops named must still be allocated.
    fn end_capture_replay(&mut self, replays: usize) -> BResult<GraphTiming>;
    /// Launch and synchronisation counts so far.
    fn counters(&self) -> Counters;
    /// Selects int8 activations (`true`) or f32 activations (`false`, the default) for
    /// one-token matmuls.
    ///
    /// The rule, identical on every backend so that they stay comparable op by op: when on,
    /// every `matmul`, `matmul_grouped`, `matmul_pair` and `moe` call whose token count is
    /// 1 quantizes its input (and, in `moe`, the down projection's input) to int8 blocks of
    /// 32 and multiplies the low-bit weights (Q2_K, Q4_K, IQ2_XXS:
    /// `ds4_gguf::quant::q8act::applies`) in integer arithmetic, as `q8act` defines; other
    /// weights (Q8_0, F16, F32) and calls with more than one token are unchanged. Decode is bandwidth-bound and the integer dot products
    /// are what let the GPU read weights at memory speed; the error this adds is measured
    /// in BENCHMARKS.md. Returns an error if the backend cannot do it.
    fn set_activation_q8(&mut self, on: bool) -> BResult<()>;
    /// The fewest rows a sequence must bring for [`Backend::moe`] over the rows of several
    /// sequences (at one decode row, [`Backend::set_decode_rows`]) to give each of its rows
    /// the bits a call of that sequence's rows alone gives; `None` where no count does.
    /// `gate`, `up` and `down` are one layer's routed weights, `k` the experts per token.
    /// A joint prefill ([`crate::Engine::eval_joint`]) runs the routed experts of several
    /// prompts in one call only for sequences at least this long (docs/forward.md §14);
    /// the default, `None`, keeps every prompt on its own.
    fn moe_joint_min_rows(&self, gate: Weight, up: Weight, down: Weight, k: usize)
        -> Option<usize>;
    /// How many rows of the next ops are decode rows: one token of each of `n` independent
    /// sequences (a batched decode step), 1 otherwise. It widens the int8-activation rule of
    /// [`Backend::set_activation_q8`] from "one token" to "at most `n` tokens", applied row
    /// by row, so a sequence decoded in a batch gets exactly the results it gets alone.
    /// The default supports only `n = 1` (a backend that cannot keep that promise refuses
    /// batches instead of computing them differently).
    fn set_decode_rows(&mut self, n: usize) -> BResult<()>;
}
