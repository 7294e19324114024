//! The GPU engine backend: `ds4_engine::Backend` over any [`GpuApi`] runtime — CUDA
//! ([`CudaBackend`]: driver API, NVRTC, optional cuBLAS) and ROCm/HIP ([`HipBackend`]:
//! `libamdhip64`, hiprtc, the built-in tiled GEMM) run the same ops, the same kernels from
//! `kernels/*.cu` and the same launch arguments; weights are placed where the placement
//! plan says.
//!
//! * Activations, KV state and small weight vectors are f32 device buffers (one allocation
//!   each; the engine allocates them once per engine/state).
//! * Weight matrices stay in their GGUF type. Without a plan each gets an exact-size device
//!   allocation; with a plan ([`CudaOptions::plan`]) the plan's arenas are allocated first
//!   (device, pinned host, managed, registered: whatever the planner chose, with its
//!   fallbacks) and each tensor is copied to its span — kernels read host-resident spans in
//!   place through the mapped device pointer.
//! * Matmuls: batch-1 rows go to the GEMV kernels (`gemv.cu`), small batches to a direct
//!   quantized kernel, larger batches to a dequantized f32 panel times an f32 tiled GEMM
//!   (`dequant.cu`). Routed experts: grouped GEMV at decode, per-expert panels at prefill.
//! * Device-only errors (a token id outside the table, an expert id out of range) set a
//!   fault word that every download checks, so they surface as errors, never silently.
//! * A greedy decode step waits for the device once: the token id goes up through pinned
//!   memory and a queued copy, and the fault word comes back in the same wait as the
//!   argmax (see `HostIo`).

mod host_slabs;
mod knobs;
mod launch;
mod load_pipeline;
pub(crate) mod ops;

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use ds4_engine::backend::{
    BResult, BackendError, BandJob, Buf, Counters, HcPost, HostSlab, IBuf, NormRopeCall,
    ProfileRow, SlabMat, Slice, TaggedSlabs, Weight, WeightInfo, WeightUse,
};
use ds4_engine::validate;
use ds4_gguf::{GgmlType, GgufFile};
use ds4_placement::{Actual, MemKind, Plan};
use ops::Q8InputKey;

use crate::api::{DeviceBuffer, GpuApi};
use crate::cache::KernelCache;
use crate::cuda::{Cublas, CudaDevice};
use crate::error::GpuError;
use crate::hip::HipDevice;
use crate::kernels::{gemv_launch, GemvConfig, GemvLaunch, GemvType, GEMV, OPS, TILES};

pub use knobs::{Knobs, PrefillTiles};
pub use launch::Arg;
pub use load_pipeline::{default_load_threads, LoadConfig, DEFAULT_STAGING_MIB};

/// Supplies tensor bytes instead of the GGUF file's payload (synthetic full-size models
/// generated straight into their final buffers, where no file of that size exists).
pub trait WeightSource: Send + Sync {
    /// Fill `out` (exactly the tensor's byte size) with tensor `name`'s bytes.
    fn fill(&self, name: &str, out: &mut [u8]) -> Result<(), String>;

    /// The unit (bytes, e.g. one row) at which this source can start and end a piece of
    /// tensor `name`. With an answer the loader fills tensors in pieces of at most its
    /// staging-buffer size through [`WeightSource::fill_range`], so no reader holds more
    /// than that (or one unit, if larger) on the heap; without one (the default) a
    /// tensor bound for device memory is staged whole on the heap first, which at full
    /// size is gigabytes per reader thread.
    fn granule(&self, _name: &str) -> Option<usize> {
        None
    }

    /// Fill `out` with bytes `start .. start + out.len()` of tensor `name`. Called only
    /// when [`WeightSource::granule`] answers `g`: `start` is a multiple of `g`, and so is
    /// `out.len()` unless the piece ends the tensor.
    fn fill_range(&self, name: &str, _start: usize, _out: &mut [u8]) -> Result<(), String> {
        Err(format!(
            "{name}: this weight source fills whole tensors only"
        ))
    }
}

/// How to build a [`GpuBackend`] (the name predates ROCm; [`GpuOptions`] is the same).
pub struct CudaOptions {
    /// Device ordinal (CUDA or HIP).
    pub ordinal: usize,
    /// Where weights go. `None`: every tensor in its own device allocation.
    pub plan: Option<Plan>,
    /// Tensor bytes from somewhere other than the file (see [`WeightSource`]).
    pub source: Option<Arc<dyn WeightSource>>,
    /// Compiled-kernel cache.
    pub cache: KernelCache,
    /// Token count from which matmuls use the dequantized-panel GEMM instead of the direct
    /// quantized kernel.
    pub panel_from_tokens: usize,
    /// Read host-resident weights from the file with `pread` straight into their final
    /// pinned buffer, dropping the page cache behind (no mmap-to-device copies, no double
    /// residency). Default: on for ROCm ([`HipBackend::new`] sets it), off for CUDA.
    pub pread_load: bool,
    /// Kernel choices and diagnostics (default: what the binaries run, [`Knobs::fast`]).
    pub knobs: Knobs,
}

/// Options of either runtime.
pub type GpuOptions = CudaOptions;

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            ordinal: 0,
            plan: None,
            source: None,
            cache: KernelCache::default_location(),
            panel_from_tokens: 9,
            pread_load: false,
            knobs: Knobs::default(),
        }
    }
}

/// Where a weight's raw bytes live.
enum Storage<B> {
    /// Its own allocation.
    Own(B),
    /// A span of plan arena `arena`.
    Arena { arena: usize, offset: usize },
}

pub(crate) struct GpuWeight<B> {
    pub name: String,
    pub info: WeightInfo,
    pub row_bytes: usize,
    storage: Option<Storage<B>>,
    /// f32 copy on the device for `WeightUse::Vector`.
    vector: Option<B>,
    pub kind: MemKind,
}

/// Bytes of weights by memory kind, as loaded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadedBytes {
    pub device: u64,
    pub pinned_host: u64,
    pub managed: u64,
    pub registered: u64,
    /// f32 copies of small vectors (always device memory).
    pub vectors: u64,
}

impl LoadedBytes {
    fn add(&mut self, kind: MemKind, bytes: u64) {
        match kind {
            MemKind::Device => self.device += bytes,
            MemKind::PinnedHost => self.pinned_host += bytes,
            MemKind::Managed => self.managed += bytes,
            MemKind::HostRegistered => self.registered += bytes,
            MemKind::Pageable => {}
        }
    }
}

/// Warps per multiprocessor the GEMV launch heuristics aim to keep busy (as
/// `cuda::GemvKernels`).
const WARPS_PER_SM_TARGET: u64 = 48;

/// Blocks of an int8-activation GEMV resident per multiprocessor (the kernels' minimum
/// blocks, `DS4_MINB_*` = 2 for the low-bit formats: 128 registers per thread).
pub(crate) const Q8_RESIDENT_BLOCKS: u64 = 2;

/// The GEMV module of a runtime: one function per weight type, plain and grouped, with
/// the configuration compiled into the kernels (same lookups as `cuda::GemvKernels`).
pub(crate) struct GemvSet<D: GpuApi> {
    _module: D::Module,
    plain: Vec<D::Function>,
    grouped: Vec<D::Function>,
    /// Int8-activation entry points (plain, grouped) per type; `None` for F32/F16.
    q8: Vec<Option<(D::Function, D::Function)>>,
    /// The same with the input computed by SwiGLU on the way (docs/gpu.md §17): plain
    /// (`ds4_gemv_swiglu_q_q8_0`, Q8_0 only: the shared expert's down) and grouped
    /// (`ds4_gemv_grouped_swiglu_q_<t>`, every int8-activation type: the routed experts').
    q8_swiglu: Vec<Option<D::Function>>,
    q8_grouped_swiglu: Vec<Option<D::Function>>,
    /// The routed experts' int8 GEMVs on a flat grid (`ds4_gemv_flat_q_<t>`, gate/up, and
    /// `ds4_gemv_flat_swiglu_q_<t>`, down; docs/gpu.md §25) for the low-bit types.
    q8_flat: Vec<Option<(D::Function, D::Function)>>,
    /// Int8-activation GEMVs that RMS-normalize their input first (`ds4_gemv_rmsnorm_q_q8_0`,
    /// Q8_0 only: q_b).
    q8_rmsnorm: Vec<Option<D::Function>>,
    /// The grouped int8 GEMV that de-rotates its input first (`ds4_gemv_grouped_rope_q_q8_0`:
    /// `out_a`).
    pub(crate) q8_grouped_rope: D::Function,
    /// The any-alignment int8-activation GEMV (`ds4_gemvq_generic`).
    pub(crate) q8_generic: D::Function,
    /// The F16 GEMV whose last block runs the router (`ds4_gemv_router_f16`).
    pub(crate) f16_router: D::Function,
    /// Widest input the int8-activation kernels quantize (`ds4_gemvq_max_in`).
    pub(crate) q8_max_in: usize,
    /// The several-column int8 Q8_0 GEMV (`ds4_gemv_cols_q_q8_0`: batched decode reads
    /// each matrix once for all its tokens) and the quantization of its inputs, once per
    /// matmul (`ds4_quantize_q8_rows`).
    pub(crate) q8_cols: D::Function,
    pub(crate) q8_quantize_rows: D::Function,
    /// The several-column F32 and F16 GEMVs (`ds4_gemv_cols_f32`, `_f16`).
    pub(crate) plain_cols: [D::Function; 2],
    /// Rows per warp of `plain_cols` (`ds4_gemv_cols_rows`, docs/gpu.md §35): its grid.
    pub(crate) plain_cols_rows: u32,
    /// Most columns of every several-column GEMV, and the most codes (columns x inputs)
    /// the Q8_0 one's shared memory holds (`ds4_gemvq_cols_max`).
    pub(crate) cols_max: usize,
    pub(crate) q8_cols_codes: usize,
    /// Whether the several-column Q8_0 GEMV stages its codes in dynamic shared memory,
    /// which the launch then passes (`ds4_gemvq_cols_dyn`, docs/gpu.md §28).
    pub(crate) q8_cols_dyn: bool,
    configs: Vec<GemvConfig>,
    target_warps: u64,
    sms: u64,
    /// Dynamic shared memory of the int8-activation IQ2_XXS launches: the grid's
    /// lane-private copies (`ds4_gemvq_iq2_smem`, docs/gpu.md §20); 0 where the runtime
    /// gives none (the kernels then read one shared table).
    iq2_smem: u32,
}

/// Bytes `ds4_gemv_cols_q_q8_0` stages for `codes` codes: the codes, then one f32 scale per
/// 32 (the kernel's `ncodes + ncodes / 8`).
fn cols_smem_bytes(codes: usize) -> usize {
    codes + 4 * (codes / 32)
}

fn gemv_index(ty: GemvType) -> usize {
    GemvType::ALL.iter().position(|t| *t == ty).unwrap_or(0)
}

impl<D: GpuApi> GemvSet<D> {
    fn load(dev: &D, cache: &KernelCache) -> Result<Self, GpuError> {
        let module = dev.load_module(&GEMV, cache, &[])?;
        let mut plain = Vec::new();
        let mut grouped = Vec::new();
        let mut configs = Vec::new();
        let mut q8 = Vec::new();
        let mut q8_swiglu = Vec::new();
        let mut q8_grouped_swiglu = Vec::new();
        let mut q8_flat = Vec::new();
        let mut q8_rmsnorm = Vec::new();
        for t in GemvType::ALL {
            let int8 = ds4_gguf::quant::q8act::applies(t.ggml());
            // `prefix<t>` where `when`, else none.
            let get = |prefix: &str, when: bool| -> Result<_, GpuError> {
                when.then(|| dev.function(&module, &format!("{prefix}{}", t.suffix())))
                    .transpose()
            };
            q8.push(
                match (get("ds4_gemv_q_", int8)?, get("ds4_gemv_grouped_q_", int8)?) {
                    (Some(p), Some(g)) => Some((p, g)),
                    _ => None,
                },
            );
            let q8_0 = t == GemvType::Q8_0;
            q8_swiglu.push(get("ds4_gemv_swiglu_q_", q8_0)?);
            q8_grouped_swiglu.push(get("ds4_gemv_grouped_swiglu_q_", int8)?);
            let low_bit = int8 && !q8_0;
            q8_flat.push(
                match (
                    get("ds4_gemv_flat_q_", low_bit)?,
                    get("ds4_gemv_flat_swiglu_q_", low_bit)?,
                ) {
                    (Some(a), Some(b)) => Some((a, b)),
                    _ => None,
                },
            );
            q8_rmsnorm.push(get("ds4_gemv_rmsnorm_q_", q8_0)?);
            plain.push(dev.function(&module, &format!("ds4_gemv_{}", t.suffix()))?);
            grouped.push(dev.function(&module, &format!("ds4_gemv_grouped_{}", t.suffix()))?);
            let [rows, cb] =
                dev.read_i32x2_global(&module, &format!("ds4_gemv_config_{}", t.suffix()))?;
            configs.push(GemvConfig {
                rows: u32::try_from(rows).unwrap_or(0),
                chunk_blocks: u32::try_from(cb).unwrap_or(0),
            });
        }
        let sms = u64::from(dev.multiprocessors().max(1));
        let q8_generic = dev.function(&module, "ds4_gemvq_generic")?;
        let f16_router = dev.function(&module, "ds4_gemv_router_f16")?;
        let q8_grouped_rope = dev.function(&module, "ds4_gemv_grouped_rope_q_q8_0")?;
        let q8_cols = dev.function(&module, "ds4_gemv_cols_q_q8_0")?;
        let q8_quantize_rows = dev.function(&module, "ds4_quantize_q8_rows")?;
        let plain_cols = [
            dev.function(&module, "ds4_gemv_cols_f32")?,
            dev.function(&module, "ds4_gemv_cols_f16")?,
        ];
        let [cols_max, cols_codes] = dev.read_i32x2_global(&module, "ds4_gemvq_cols_max")?;
        let [plain_cols_rows, _] = dev.read_i32x2_global(&module, "ds4_gemv_cols_rows")?;
        let [cols_dyn, _] = dev.read_i32x2_global(&module, "ds4_gemvq_cols_dyn")?;
        // A device allowing less dynamic shared memory than the codes need takes fewer.
        let cols_dyn = cols_dyn != 0;
        let cols_codes = usize::try_from(cols_codes).unwrap_or(0);
        let cols_codes = if cols_dyn {
            // cols_smem_bytes: 36 bytes per 32 codes.
            cols_codes.min(dev.max_dynamic_smem() as usize / 36 * 32)
        } else {
            cols_codes
        };
        let [max_in, _] = dev.read_i32x2_global(&module, "ds4_gemvq_max_in")?;
        let [iq2_smem, _] = dev.read_i32x2_global(&module, "ds4_gemvq_iq2_smem")?;
        let iq2_smem = u32::try_from(iq2_smem)
            .ok()
            .filter(|&b| b <= dev.max_dynamic_smem())
            .unwrap_or(0);
        Ok(GemvSet {
            _module: module,
            plain,
            grouped,
            q8,
            q8_swiglu,
            q8_grouped_swiglu,
            q8_flat,
            q8_rmsnorm,
            q8_grouped_rope,
            q8_generic,
            f16_router,
            q8_max_in: usize::try_from(max_in).unwrap_or(0),
            q8_cols,
            q8_quantize_rows,
            plain_cols,
            plain_cols_rows: u32::try_from(plain_cols_rows).unwrap_or(1).max(1),
            cols_max: usize::try_from(cols_max).unwrap_or(0),
            q8_cols_codes: cols_codes,
            q8_cols_dyn: cols_dyn,
            configs,
            target_warps: sms * WARPS_PER_SM_TARGET,
            sms,
            iq2_smem,
        })
    }

    /// Blocks along x for a persistent int8-activation GEMV (`ds4_gemvq_quant` walks row
    /// steps with a grid stride) whose grid has `others` blocks along y and z: one wave of
    /// Q8_RESIDENT_BLOCKS per multiprocessor, never more than the `full` grid.
    pub(crate) fn q8_grid_x(&self, full: u32, others: u32) -> u32 {
        let wave = (self.sms * Q8_RESIDENT_BLOCKS).div_ceil(u64::from(others.max(1)));
        full.min(u32::try_from(wave.max(1)).unwrap_or(u32::MAX))
    }

    /// Dynamic shared memory of a several-column Q8_0 launch staging `codes` codes: none
    /// where the module keeps them in static memory (docs/gpu.md §28).
    pub(crate) fn q8_cols_smem(&self, codes: usize) -> u32 {
        if self.q8_cols_dyn {
            u32::try_from(cols_smem_bytes(codes)).unwrap_or(u32::MAX)
        } else {
            0
        }
    }

    /// Blocks of a flat grouped launch (docs/gpu.md §25): one wave of resident blocks, or
    /// one per step where there are fewer steps.
    pub(crate) fn q8_flat_grid_x(&self, steps: u64) -> u32 {
        u32::try_from((self.sms * Q8_RESIDENT_BLOCKS).min(steps).max(1)).unwrap_or(u32::MAX)
    }

    /// The flat grouped entry points of `ty` (gate/up, down), if it has them.
    pub(crate) fn q8_flat_functions(&self, ty: GemvType) -> Option<&(D::Function, D::Function)> {
        self.q8_flat[gemv_index(ty)].as_ref()
    }

    /// Dynamic shared memory to launch the int8-activation GEMVs of `ty` with.
    pub(crate) fn q8_smem(&self, ty: GemvType) -> u32 {
        if ty == GemvType::Iq2Xxs {
            self.iq2_smem
        } else {
            0
        }
    }

    pub(crate) fn function(&self, ty: GemvType) -> &D::Function {
        &self.plain[gemv_index(ty)]
    }

    pub(crate) fn grouped_function(&self, ty: GemvType) -> &D::Function {
        &self.grouped[gemv_index(ty)]
    }

    /// The int8-activation (plain, grouped) entry points of `ty`, if it has them.
    pub(crate) fn q8_functions(&self, ty: GemvType) -> Option<&(D::Function, D::Function)> {
        self.q8[gemv_index(ty)].as_ref()
    }

    /// The int8-activation GEMV of `ty` that RMS-normalizes its input first.
    pub(crate) fn q8_rmsnorm_function(&self, ty: GemvType) -> Option<&D::Function> {
        self.q8_rmsnorm[gemv_index(ty)].as_ref()
    }

    /// The SwiGLU-input int8-activation GEMV of `ty` (one row).
    pub(crate) fn q8_swiglu_function(&self, ty: GemvType) -> Option<&D::Function> {
        self.q8_swiglu[gemv_index(ty)].as_ref()
    }

    /// The SwiGLU-input int8-activation grouped (routed experts) GEMV of `ty`.
    pub(crate) fn q8_grouped_swiglu_function(&self, ty: GemvType) -> Option<&D::Function> {
        self.q8_grouped_swiglu[gemv_index(ty)].as_ref()
    }

    pub(crate) fn launch_for(
        &self,
        ty: GemvType,
        n_in: usize,
        n_out: usize,
    ) -> Result<GemvLaunch, GpuError> {
        self.launch_for_grouped(ty, n_in, n_out, 1)
    }

    /// The launch of an int8-activation GEMV of `ty` in a grid that repeats the matrix
    /// `copies` times along y and z. Q8_0's engine (`ds4_gemvq_q8s`) gives each lane whole
    /// 32-value units, so a row splits into parts of 32 units, and its warps per row are
    /// chosen to fill the persistent grid's resident warps; the low-bit formats keep the
    /// plain engine's launch.
    pub(crate) fn q8_launch(
        &self,
        ty: GemvType,
        n_in: usize,
        n_out: usize,
        copies: u64,
    ) -> Result<GemvLaunch, GpuError> {
        if ty != GemvType::Q8_0 {
            return self.launch_for_grouped(ty, n_in, n_out, copies);
        }
        let cfg = GemvConfig {
            rows: self.configs[gemv_index(ty)].rows,
            chunk_blocks: 32,
        };
        let resident = self.sms * Q8_RESIDENT_BLOCKS * u64::from(crate::kernels::GEMV_WARPS);
        gemv_launch(
            ty,
            cfg,
            n_in as u64,
            n_out as u64,
            (resident / copies.max(1)).max(1),
        )
    }

    /// [`Self::launch_for`] for a grid that repeats the matrix `copies` times along y and z
    /// (grouped GEMVs: selections x matrices). The warps per row are chosen for the whole
    /// grid: sized for one matrix, `out_a`'s 8 groups split each row over 8 warps with one
    /// vector per lane and ran in ~8 waves of short blocks (ncu: see BENCHMARKS.md, grouped
    /// `out_a`).
    pub(crate) fn launch_for_grouped(
        &self,
        ty: GemvType,
        n_in: usize,
        n_out: usize,
        copies: u64,
    ) -> Result<GemvLaunch, GpuError> {
        gemv_launch(
            ty,
            self.configs[gemv_index(ty)],
            n_in as u64,
            n_out as u64,
            (self.target_warps / copies.max(1)).max(1),
        )
    }
}

/// The engine backend on runtime `D`.
pub struct GpuBackend<D: GpuApi> {
    pub(crate) dev: D,
    pub(crate) gemv: GemvSet<D>,
    _ops_module: D::Module,
    _tiles_module: D::Module,
    pub(crate) funcs: HashMap<&'static str, D::Function>,
    bufs: Vec<Option<D::Buffer>>,
    ibufs: Vec<Option<D::Buffer>>,
    pub(crate) weights: Vec<GpuWeight<D::Buffer>>,
    arenas: Vec<D::Buffer>,
    spans: HashMap<String, (usize, usize)>,
    actual: Option<Actual>,
    source: Option<Arc<dyn WeightSource>>,
    staging: Vec<u8>,
    pub(crate) scratch: HashMap<&'static str, D::Buffer>,
    pub(crate) freqs: HashMap<[u32; 7], D::Buffer>,
    fault: D::Buffer,
    /// Pinned host memory for the per-token traffic (`None` when pinned memory was
    /// refused: then every upload and fault check waits, as before).
    io: Option<HostIo<D::Buffer>>,
    /// Host waits for the stream so far: a slab stored at count `n` is free once the
    /// count has passed `n` (host_slabs.rs).
    host_waits: u64,
    /// Streamed experts' page-locked slabs whose queued copies may still read them.
    lent_slabs: Vec<host_slabs::LentSlab<D::Buffer>>,
    /// Whether slabs are still asked for in page-locked memory (until the first refusal).
    slabs_pinned: bool,
    pub(crate) panel_from_tokens: usize,
    pub(crate) cublas: Option<Cublas>,
    loaded: LoadedBytes,
    pread_load: bool,
    /// Load pipeline settings ([`Knobs::load`], or [`Self::set_load_config`]'s).
    load_config: LoadConfig,
    /// [`Knobs::profile`]: per-kernel launch counts and synchronised wall time (slows
    /// everything down; for finding where time goes, not for speed numbers).
    pub(crate) profile: Option<std::sync::Mutex<HashMap<&'static str, (u64, f64)>>>,
    /// Device-time attribution by events (see [`Timeline`]); `None` when off.
    pub(crate) timeline: Option<std::sync::Mutex<Timeline<D::Event>>>,
    /// The forward pass's current section ([`ds4_engine::Backend::annotate`]).
    pub(crate) tag: &'static str,
    /// Kernel launches and host waits so far.
    pub(crate) launches: std::sync::atomic::AtomicU64,
    pub(crate) syncs: std::sync::atomic::AtomicU64,
    /// Host time blocked in those waits, nanoseconds ([`Counters::wait_ns`]).
    pub(crate) wait_ns: std::sync::atomic::AtomicU64,
    /// Int8 activations for one-token matmuls ([`ds4_engine::Backend::set_activation_q8`]).
    pub(crate) act_q8: bool,
    /// Multi-token matmuls on quantized tiles ([`Knobs::prefill_tiles`]).
    pub(crate) tiles: PrefillTiles,
    /// Rows of a batched decode step ([`ds4_engine::Backend::set_decode_rows`]).
    pub(crate) decode_rows: usize,
    /// Whether the decode launch fusions run (docs/gpu.md §17): always, except in the test
    /// that proves each computes the same values as the launches it replaces
    /// ([`Self::set_fused_launches`]).
    pub(crate) fused: bool,
    /// Widest row `ds4_norm_rope2_warps` takes (`ds4_norm_rope_warps_max`).
    pub(crate) norm_rope_warps_width: usize,
    /// The stream count `ds4_hc_post4` is built for (`ds4_hc_post4_streams`); other counts
    /// take the flat `ds4_hc_post` (the same values, docs/gpu.md §21).
    pub(crate) hc_post4: usize,
    /// While a matmul set runs (`matmul_set`, `matmul_pair`: one input at decode rows,
    /// quantized once, docs/gpu.md §29): `Some(key)` of the input whose int8 codes the
    /// several-column GEMV's scratch holds (`Some(None)`: none yet); `None` outside a set,
    /// where every several-column launch quantizes its input.
    pub(crate) q8_input_memo: Option<Option<Q8InputKey>>,
    /// Multi-token attention on the tensor cores (`ds4_attention_mma`) where the shapes
    /// and the device allow it ([`Knobs::tensor_core_attention`], docs/gpu.md §14).
    pub(crate) attn_mma: bool,
    /// Prefill indexer scores on the tensor cores (`ds4_indexer_scores_mma`; the same
    /// knob, docs/gpu.md §15).
    pub(crate) idx_mma: bool,
    pub(crate) imma_smem: u32,
    /// Dynamic shared memory `ds4_attention_mma` declares, and what the device allows.
    pub(crate) amma_smem: u32,
    /// Dynamic shared memory of `ds4_mm_rtiles` (the routed IQ2_XXS / Q2_K experts' tile
    /// kernel where the device has the shared memory and `mma.sync`, docs/gpu.md §4).
    pub(crate) rtiles_smem: u32,
    pub(crate) max_dyn_smem: u32,
}

/// Upload slots of [`HostIo`]: a decode step queues one upload and waits once, so two
/// would do; four leave room for a caller that uploads more between waits.
const IO_SLOTS: usize = 4;
/// Bytes per upload slot (1024 token ids: a decode step's, or a small prefill chunk's).
const IO_SLOT_BYTES: usize = 4096;
/// Where the fault word lands, after the slots.
const IO_FAULT_OFF: usize = IO_SLOTS * IO_SLOT_BYTES;
/// Bytes of pinned host memory every backend allocates for its per-token traffic (tests
/// tell this allocation from weight placements by its size).
pub const HOST_IO_BYTES: usize = IO_FAULT_OFF + 4;

/// Pinned host memory that keeps a decode step at one host wait (issue 16).
///
/// * Token ids are written into a slot of a small ring and copied to the device by a
///   queued copy on the kernels' stream: no wait. A slot is written again only once the
///   copy out of it is known complete: every host wait for the stream completes all
///   copies queued before it, so `queued` counts the slots used since the last wait, and
///   a full ring waits first (never in a decode step, which waits once per token).
/// * Before a read-back the fault word is queued into `IO_FAULT_OFF`; the read-back's own
///   wait then makes it valid on the host, so checking it costs no second wait.
struct HostIo<B> {
    buf: B,
    next: usize,
    queued: usize,
}

/// Device-time attribution without host synchronisation: an event is recorded on the
/// stream before every launch; once resolved (after a token), the time between event `i`
/// and event `i+1` is launch `i`'s device time (its run plus any idle gap before it, so the
/// rows add up to the device's wall time over the span).
pub(crate) struct Timeline<E> {
    events: Vec<E>,
    /// (section, kernel) of the launch that follows event `i`.
    marks: Vec<(&'static str, &'static str)>,
    rows: HashMap<(&'static str, &'static str), (u64, f64)>,
    total_ms: f64,
}

/// Launches recorded before the timeline resolves itself (bounds the event pool).
const TIMELINE_MAX_MARKS: usize = 1 << 15;

impl<E> Timeline<E> {
    fn new() -> Self {
        Timeline {
            events: Vec::new(),
            marks: Vec::new(),
            rows: HashMap::new(),
            total_ms: 0.0,
        }
    }
}

/// The CUDA backend (verified on the H200).
pub type CudaBackend = GpuBackend<CudaDevice>;
/// The ROCm/HIP backend.
pub type HipBackend = GpuBackend<HipDevice>;

impl<D: GpuApi> Drop for GpuBackend<D> {
    fn drop(&mut self) {
        if !self.lent_slabs.is_empty() {
            // Their copies must have completed before the slabs' memory is freed.
            if let Err(e) = self.dev.synchronize() {
                tracing::warn!("waiting for streamed experts' copies at shutdown: {e}");
            }
        }
        if let Some(p) = &self.profile {
            let p = p.lock().unwrap_or_else(|e| e.into_inner());
            let mut v: Vec<_> = p.iter().collect();
            v.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
            let total: f64 = v.iter().map(|x| x.1 .1).sum();
            eprintln!("DS4_CUDA_PROFILE: kernel, launches, seconds, share");
            for (k, (n, s)) in v {
                eprintln!(
                    "  {k:<22} {n:>9} {s:>9.3} {:>6.1}%",
                    100.0 * s / total.max(1e-12)
                );
            }
        }
    }
}

impl<D: GpuApi> std::fmt::Debug for GpuBackend<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuBackend")
            .field("runtime", &self.dev.runtime())
            .field("device", &self.dev.device_name())
            .field("weights", &self.weights.len())
            .finish()
    }
}

/// Every kernel of the ops module (`ops.cu` and the files it includes) the backend launches.
/// Widest Q8_0 row the in-place split kernel takes (`DS4_Q8S_MAX_IN` in dequant.cu; DeepSeek V4
/// Flash's widest Q8_0 row is 8192).
pub(crate) const Q8_SPLIT_MAX_IN: usize = 32768;

const OP_KERNELS: &[&str] = &[
    "ds4_dequant_rows",
    "ds4_dequant_q8_rows",
    "ds4_gemm_nt",
    "ds4_matmul_generic",
    "ds4_fill",
    "ds4_copy",
    "ds4_add",
    "ds4_swiglu",
    "ds4_rms_norm",
    "ds4_rope",
    "ds4_qat_fp8",
    "ds4_qat_hfp4",
    "ds4_embed",
    "ds4_hc_pre",
    "ds4_hc_pre_regs",
    "ds4_hc_mix_part_f16",
    "ds4_hc_mix_part_f32",
    "ds4_hc_mix_part_tpb_f16",
    "ds4_hc_mix_part_tpb_f32",
    "ds4_hc_mix_apply",
    "ds4_repeat_rows",
    "ds4_hc_post",
    "ds4_hc_head",
    "ds4_compressor",
    "ds4_indexer_scores",
    "ds4_topk_select",
    "ds4_attention",
    "ds4_ring_store",
    "ds4_router",
    "ds4_router_warp",
    "ds4_gather_rows",
    "ds4_moe_act",
    "ds4_scatter_rows",
    "ds4_sum_slots",
    "ds4_argmax",
    "ds4_logit_band",
    "ds4_logit_bands",
    "ds4_attention_split",
    "ds4_attention_combine",
    "ds4_attention_split_combine",
    "ds4_rope_qat_hfp4",
    "ds4_attention_split_seqs",
    "ds4_compressor_seqs",
    "ds4_compressor2",
    "ds4_compressor_windows",
    "ds4_compressor_tail",
    "ds4_indexer_scores_seqs",
    "ds4_topk_select_seqs",
    "ds4_ring_store_seqs",
    "ds4_attention_combine_seqs",
    "ds4_norm_rope",
    "ds4_norm_rope2",
    "ds4_norm_rope2_warps",
    "ds4_hc_post4",
    "ds4_q8_0_split",
    "ds4_attention_mma",
    "ds4_indexer_scores_mma",
];

/// Every kernel of `tiles.cu` the backend launches.
const TILE_KERNELS: &[&str] = &[
    "ds4_moe_sort",
    "ds4_gather_rows_h",
    "ds4_to_half",
    "ds4_moe_act_h",
    "ds4_moe_sum_sorted",
    "ds4_mm_tiles",
    "ds4_mm_tiles_wide",
    "ds4_mm_rtiles",
];

/// A GPU-layer error as a backend error of `op`.
pub(crate) fn gerr(op: &'static str) -> impl Fn(GpuError) -> BackendError {
    move |e| BackendError::Invalid {
        op,
        problem: e.to_string(),
    }
}

impl GpuBackend<CudaDevice> {
    /// Opens the CUDA device, compiles (or loads from the cache) every kernel, loads
    /// cuBLAS when asked, and allocates the plan's weight arenas when a plan is given.
    pub fn new(opts: CudaOptions) -> Result<CudaBackend, GpuError> {
        let dev = CudaDevice::open(opts.ordinal)?;
        Self::on_device(dev, opts)
    }

    /// [`Self::new`] on a device the caller already opened (the loader reads its facts
    /// for the planner first; `opts.ordinal` is not used).
    pub fn on_device(dev: CudaDevice, opts: CudaOptions) -> Result<CudaBackend, GpuError> {
        let cublas = match opts.knobs.cublas {
            Some(p) => match Cublas::load(&dev, p) {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::info!("prefill GEMM: built-in kernel ({e})");
                    None
                }
            },
            None => None,
        };
        Self::with_device(dev, opts, cublas)
    }
}

impl GpuBackend<HipDevice> {
    /// Opens the ROCm device (`ROCM_PATH`, default /opt/rocm), compiles every kernel with
    /// hiprtc for its architecture (or loads it from the cache), and allocates the plan's
    /// weight arenas when a plan is given. Host-resident weights are read with `pread`.
    pub fn new(opts: CudaOptions) -> Result<HipBackend, GpuError> {
        let dev = HipDevice::open(opts.ordinal)?;
        Self::on_device(dev, opts)
    }

    /// [`Self::new`] on a device the caller already opened (`opts.ordinal` is not used).
    pub fn on_device(dev: HipDevice, mut opts: CudaOptions) -> Result<HipBackend, GpuError> {
        opts.pread_load = true;
        Self::with_device(dev, opts, None)
    }

    /// Where weight allocations fell back (for the load report).
    pub fn alloc_fallbacks(&self) -> Vec<String> {
        self.dev.alloc_stats().fallbacks
    }
}

impl<D: GpuApi> GpuBackend<D> {
    /// The backend on an opened device (the fake HIP runtime in tests).
    pub fn with_device(
        dev: D,
        opts: CudaOptions,
        cublas: Option<Cublas>,
    ) -> Result<GpuBackend<D>, GpuError> {
        let knobs = opts.knobs;
        let gemv = GemvSet::load(&dev, &opts.cache)?;
        let module = dev.load_module(&OPS, &opts.cache, &[])?;
        let mut funcs = HashMap::new();
        for name in OP_KERNELS {
            funcs.insert(*name, dev.function(&module, name)?);
        }
        let [amma_smem, _] = dev.read_i32x2_global(&module, "ds4_attention_mma_smem")?;
        let [nrw_max, _] = dev.read_i32x2_global(&module, "ds4_norm_rope_warps_max")?;
        let [post4, _] = dev.read_i32x2_global(&module, "ds4_hc_post4_streams")?;
        let amma_smem = u32::try_from(amma_smem).unwrap_or(u32::MAX);
        let [imma_smem, _] = dev.read_i32x2_global(&module, "ds4_indexer_scores_mma_smem")?;
        let imma_smem = u32::try_from(imma_smem).unwrap_or(u32::MAX);
        let tiles_module = dev.load_module(&TILES, &opts.cache, &[])?;
        for name in TILE_KERNELS {
            funcs.insert(*name, dev.function(&tiles_module, name)?);
        }
        let [rtiles_smem, _] = dev.read_i32x2_global(&tiles_module, "ds4_mm_rtiles_smem")?;
        let rtiles_smem = u32::try_from(rtiles_smem).unwrap_or(u32::MAX);
        let mut fault = dev.alloc(MemKind::Device, 4)?;
        fault.fill_u32(0)?;
        let io = match dev.alloc(MemKind::PinnedHost, HOST_IO_BYTES) {
            Ok(buf) if buf.kind() == MemKind::PinnedHost => Some(HostIo {
                buf,
                next: 0,
                queued: 0,
            }),
            Ok(_) => None,
            Err(e) => {
                tracing::info!("per-token staging: pinned memory refused ({e}); waiting copies");
                None
            }
        };
        let mut be = GpuBackend {
            dev,
            gemv,
            _ops_module: module,
            _tiles_module: tiles_module,
            funcs,
            bufs: Vec::new(),
            ibufs: Vec::new(),
            weights: Vec::new(),
            arenas: Vec::new(),
            spans: HashMap::new(),
            actual: None,
            source: opts.source,
            staging: Vec::new(),
            host_waits: 0,
            lent_slabs: Vec::new(),
            slabs_pinned: true,
            scratch: HashMap::new(),
            freqs: HashMap::new(),
            fault,
            io,
            panel_from_tokens: opts.panel_from_tokens.max(2),
            cublas,
            loaded: LoadedBytes::default(),
            pread_load: opts.pread_load,
            load_config: knobs.load,
            profile: knobs.profile.then(|| std::sync::Mutex::new(HashMap::new())),
            timeline: None,
            tag: "",
            launches: Default::default(),
            syncs: Default::default(),
            wait_ns: Default::default(),
            act_q8: knobs.activation_q8,
            tiles: knobs.prefill_tiles,
            decode_rows: 1,
            fused: true,
            norm_rope_warps_width: usize::try_from(nrw_max).unwrap_or(0),
            hc_post4: usize::try_from(post4).unwrap_or(0),
            q8_input_memo: None,
            attn_mma: knobs.tensor_core_attention,
            idx_mma: knobs.tensor_core_attention,
            imma_smem,
            amma_smem,
            rtiles_smem,
            max_dyn_smem: 0,
        };
        be.max_dyn_smem = be.dev.max_dynamic_smem();
        if let Some(plan) = opts.plan {
            be.allocate_plan(&plan)?;
        }
        Ok(be)
    }

    /// Allocates the plan's weight arenas (session buffers are the engine's, allocated
    /// through [`ds4_engine::Backend::alloc`]).
    fn allocate_plan(&mut self, plan: &Plan) -> Result<(), GpuError> {
        let mut arenas_only = plan.clone();
        arenas_only.buffers.clear();
        let done = self
            .dev
            .execute_plan(&arenas_only)
            .map_err(|f| GpuError::BadArgument {
                op: "load",
                detail: f.to_string(),
            })?;
        for (i, a) in plan.arenas.iter().enumerate() {
            for s in &a.spans {
                self.spans
                    .insert(s.name.clone(), (i, usize::try_from(s.offset).unwrap_or(0)));
            }
        }
        self.arenas = done.arenas;
        self.actual = Some(done.actual);
        Ok(())
    }

    /// What the plan's allocations actually got (fallbacks included), if a plan was used.
    pub fn actual_placement(&self) -> Option<&Actual> {
        self.actual.as_ref()
    }

    /// Weight bytes by memory kind.
    pub fn loaded_bytes(&self) -> &LoadedBytes {
        &self.loaded
    }

    /// The raw bytes of weight `name` as the device holds them, read back from its buffer
    /// (checks and diagnostics): the file's bytes, except Q8_0 rows in the split layout
    /// once the split kernel has run (docs/gpu.md §7).
    pub fn weight_bytes(&self, name: &str) -> Result<Option<Vec<u8>>, GpuError> {
        let Some(w) = self.weights.iter().find(|w| w.name == name) else {
            return Ok(None);
        };
        let bytes = w.row_bytes * w.info.dims[1] * w.info.dims[2];
        let mut out = vec![0u8; bytes];
        match &w.storage {
            Some(Storage::Own(b)) => b.read(0, &mut out)?,
            Some(Storage::Arena { arena, offset }) => {
                self.arenas[*arena].read(*offset, &mut out)?
            }
            None => return Ok(None),
        }
        Ok(Some(out))
    }

    /// The memory kind tensor `name` was loaded into.
    pub fn weight_kind(&self, name: &str) -> Option<MemKind> {
        self.weights.iter().find(|w| w.name == name).map(|w| w.kind)
    }

    /// Where the prefill GEMM's cuBLAS came from (`None`: the built-in kernel).
    pub fn cublas_path(&self) -> Option<&std::path::Path> {
        self.cublas.as_ref().map(|c| c.path.as_path())
    }

    pub fn device(&self) -> &D {
        &self.dev
    }

    /// Separate launches instead of the decode launch fusions (docs/gpu.md §17) when
    /// `on` is false. The values are the same bit for bit; this exists for the test that
    /// proves it (`emulated_fused_launches_equal_the_separate_ones`).
    pub fn set_fused_launches(&mut self, on: bool) {
        self.fused = on;
    }

    /// Waits for all queued work (for timing) and reports any device fault.
    pub fn sync(&mut self) -> BResult<()> {
        let queued = self.queue_fault("sync")?;
        host_wait(&self.syncs, &self.wait_ns, || self.dev.synchronize()).map_err(gerr("sync"))?;
        self.waited();
        self.fault_after_wait(queued, "sync")
    }

    /// Records that the host has just waited for the stream: every queued copy is done.
    fn waited(&mut self) {
        self.host_waits += 1;
        if let Some(io) = &mut self.io {
            io.queued = 0;
        }
    }

    /// Queues the fault word's copy into pinned memory, so that the host wait that
    /// follows also brings it back; `false` without pinned memory.
    fn queue_fault(&mut self, op: &'static str) -> BResult<bool> {
        let Some(io) = &self.io else {
            return Ok(false);
        };
        // SAFETY: the fault slot is read on the host only after a host wait
        // (`fault_after_wait`), and no upload uses it.
        unsafe {
            self.dev
                .queue_download(&self.fault, 0, &io.buf, IO_FAULT_OFF, 4)
        }
        .map_err(gerr(op))?;
        Ok(true)
    }

    /// After a host wait: the fault word as [`Self::queue_fault`] brought it back
    /// (`queued`), or read with a wait of its own; an error if a kernel set it.
    fn fault_after_wait(&mut self, queued: bool, op: &'static str) -> BResult<()> {
        let bits = match (&mut self.io, queued) {
            (Some(io), true) => {
                // SAFETY: the caller has just waited for the stream, which completed the
                // queued copy into this word; nothing else writes it.
                let w = unsafe { io.buf.host_range_unsynced(IO_FAULT_OFF, 4) }
                    .map_err(gerr(op))?
                    .ok_or_else(|| {
                        gerr(op)(GpuError::BadArgument {
                            op,
                            detail: "per-token staging is not host memory".into(),
                        })
                    })?;
                u32::from_le_bytes([w[0], w[1], w[2], w[3]])
            }
            _ => {
                let mut b = [0u8; 4];
                host_wait(&self.syncs, &self.wait_ns, || self.fault.read(0, &mut b))
                    .map_err(gerr(op))?;
                self.waited();
                u32::from_le_bytes(b)
            }
        };
        self.report_fault(bits, op)
    }

    /// `base` when no profile is being taken; else `base` with the launch's shape (rows ×
    /// inputs × groups or columns), so a profile tells the matrices of one kernel apart (the
    /// batched step's several-column GEMVs: which matrices take the time). Each distinct
    /// name is leaked once (profiling only; a model has a few dozen shapes).
    pub(crate) fn shape_name(
        &self,
        base: &'static str,
        rows: usize,
        cols: usize,
        n: usize,
    ) -> &'static str {
        if self.timeline.is_none() && self.profile.is_none() {
            return base;
        }
        static NAMES: std::sync::Mutex<Vec<(&'static str, [usize; 3], &'static str)>> =
            std::sync::Mutex::new(Vec::new());
        let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
        let key = [rows, cols, n];
        if let Some(&(_, _, name)) = names.iter().find(|e| e.0 == base && e.1 == key) {
            return name;
        }
        let name: &'static str = Box::leak(format!("{base} {rows}x{cols}x{n}").into_boxed_str());
        names.push((base, key, name));
        name
    }

    /// Records the timing mark of the launch about to be queued (timeline on only).
    pub(crate) fn mark_launch(&self, kernel: &'static str) -> BResult<()> {
        let Some(tl) = &self.timeline else {
            return Ok(());
        };
        let mut tl = tl.lock().unwrap_or_else(|e| e.into_inner());
        if tl.marks.len() + 1 >= TIMELINE_MAX_MARKS {
            self.resolve_timeline(&mut tl)?;
        }
        let i = tl.marks.len();
        if i == tl.events.len() {
            let e = self.dev.timing_event().map_err(gerr("profile"))?;
            tl.events.push(e);
        }
        self.dev
            .record_event(&tl.events[i])
            .map_err(gerr("profile"))?;
        tl.marks.push((self.tag, kernel));
        Ok(())
    }

    /// Records the closing event, waits for it and adds every interval to the rows.
    fn resolve_timeline(&self, tl: &mut Timeline<D::Event>) -> BResult<()> {
        let n = tl.marks.len();
        if n == 0 {
            return Ok(());
        }
        if n == tl.events.len() {
            let e = self.dev.timing_event().map_err(gerr("profile"))?;
            tl.events.push(e);
        }
        self.dev
            .record_event(&tl.events[n])
            .map_err(gerr("profile"))?;
        self.syncs.fetch_add(1, Relaxed);
        for i in 0..n {
            let ms = f64::from(
                self.dev
                    .event_ms(&tl.events[i], &tl.events[i + 1])
                    .map_err(gerr("profile"))?,
            );
            let key = tl.marks[i];
            let r = tl.rows.entry(key).or_insert((0, 0.0));
            r.0 += 1;
            r.1 += ms;
            tl.total_ms += ms;
        }
        tl.marks.clear();
        Ok(())
    }

    /// See [`ds4_engine::Backend::take_profile`].
    pub(crate) fn take_timeline(&mut self) -> BResult<Option<(Vec<ProfileRow>, f64)>> {
        let Some(tl) = &self.timeline else {
            return Ok(None);
        };
        let mut tl = tl.lock().unwrap_or_else(|e| e.into_inner());
        self.resolve_timeline(&mut tl)?;
        let mut rows: Vec<ProfileRow> = tl
            .rows
            .drain()
            .map(|((tag, kernel), (launches, ms))| ProfileRow {
                tag,
                kernel,
                launches,
                ms,
            })
            .collect();
        rows.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        let total = std::mem::take(&mut tl.total_ms);
        Ok(Some((rows, total)))
    }

    /// An error naming what a kernel reported in fault word `bits` (none when 0); the
    /// device word is cleared for the next step.
    fn report_fault(&mut self, bits: u32, op: &'static str) -> BResult<()> {
        if bits == 0 {
            return Ok(());
        }
        self.fault.fill_u32(0).map_err(gerr(op))?;
        let mut what = Vec::new();
        if bits & 1 != 0 {
            what.push("a token id outside the embedding or hash table");
        }
        if bits & 2 != 0 {
            what.push("an expert id outside the expert tensors");
        }
        if bits & 4 != 0 {
            what.push("an attention selection of a compressed row that is not visible");
        }
        Err(BackendError::Invalid {
            op,
            problem: format!(
                "a kernel reported invalid device-side input: {}",
                what.join(", ")
            ),
        })
    }

    pub(crate) fn fault_ptr(&self) -> u64 {
        self.fault.device_address()
    }

    // ---- handles ----------------------------------------------------------------------

    fn slot<'a>(
        v: &'a [Option<D::Buffer>],
        id: u32,
        len: usize,
        op: &'static str,
    ) -> BResult<&'a D::Buffer> {
        match v.get(id as usize) {
            Some(Some(b)) if b.len() >= 4 * len.max(1) => Ok(b),
            _ => Err(BackendError::BadHandle { op, id }),
        }
    }

    /// Device address of `s`, after checking the handle and the range.
    pub(crate) fn fptr(&self, s: Slice, op: &'static str) -> BResult<u64> {
        let b = Self::slot(&self.bufs, s.buf.id(), s.buf.len(), op)?;
        validate::in_range(s, op)?;
        Ok(b.device_address() + 4 * s.off as u64)
    }

    pub(crate) fn iptr(&self, b: IBuf, op: &'static str) -> BResult<u64> {
        Ok(Self::slot(&self.ibufs, b.id(), b.len(), op)?.device_address())
    }

    pub(crate) fn weight(&self, w: Weight, op: &'static str) -> BResult<&GpuWeight<D::Buffer>> {
        let gw = self
            .weights
            .get(w.id() as usize)
            .ok_or(BackendError::BadHandle { op, id: w.id() })?;
        if gw.info != w.info {
            return Err(BackendError::BadHandle { op, id: w.id() });
        }
        Ok(gw)
    }

    /// Device address of a weight's raw bytes.
    pub(crate) fn wraw(&self, w: Weight, op: &'static str) -> BResult<u64> {
        let gw = self.weight(w, op)?;
        match &gw.storage {
            Some(Storage::Own(b)) => Ok(b.device_address()),
            Some(Storage::Arena { arena, offset }) => {
                Ok(self.arenas[*arena].device_address() + *offset as u64)
            }
            None => Err(BackendError::Invalid {
                op,
                problem: format!("weight {} was loaded as a vector only", gw.name),
            }),
        }
    }

    /// Device address of a vector weight's f32 values, checking their count.
    pub(crate) fn wvec(&self, w: Weight, op: &'static str, len: usize) -> BResult<u64> {
        let gw = self.weight(w, op)?;
        let v = gw.vector.as_ref().ok_or_else(|| BackendError::Invalid {
            op,
            problem: format!("weight {} was not loaded as a vector", gw.name),
        })?;
        if gw.info.n_elements() != len {
            return Err(BackendError::Shape {
                op,
                what: format!("{} length", gw.name),
                expected: len,
                found: gw.info.n_elements(),
            });
        }
        Ok(v.device_address())
    }

    /// A device scratch buffer of at least `bytes`, kept for reuse.
    ///
    /// Grows geometrically (to the next power of two): a scratch whose need creeps up with
    /// the context (indexer scores, attention partials) is re-allocated O(log n) times, not
    /// every few tokens — freeing device memory waits for the device mid-token.
    pub(crate) fn scratch(&mut self, name: &'static str, bytes: usize) -> BResult<u64> {
        let need = bytes.max(4);
        let grow = self.scratch.get(name).is_none_or(|b| b.len() < need);
        if grow {
            let bytes = need.checked_next_power_of_two().unwrap_or(need);
            self.scratch.remove(name);
            let b = self
                .dev
                .alloc_scratch(bytes)
                .map_err(|e| BackendError::Alloc {
                    elems: bytes / 4,
                    problem: format!("scratch {name}: {e}"),
                })?;
            self.scratch.insert(name, b);
        }
        Ok(self.scratch[name].device_address())
    }

    /// Whether scratch `name` exists (its contents survive until it grows).
    pub(crate) fn has_scratch(&self, name: &'static str) -> bool {
        self.scratch.contains_key(name)
    }

    /// Copies `src` into scratch `name` (i32 values) and returns its address.
    pub(crate) fn upload_scratch_i32(&mut self, name: &'static str, src: &[i32]) -> BResult<u64> {
        let p = self.scratch(name, 4 * src.len())?;
        let bytes: Vec<u8> = src.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.scratch
            .get_mut(name)
            .expect("allocated above")
            .write(0, &bytes)
            .map_err(gerr("upload"))?;
        Ok(p)
    }

    fn new_buf(&mut self, elems: usize, op: &'static str, int: bool) -> BResult<u32> {
        let bytes = elems.checked_mul(4).ok_or(BackendError::Alloc {
            elems,
            problem: "size overflows".into(),
        })?;
        let mut b = self
            .dev
            .alloc_scratch(bytes.max(4))
            .map_err(|e| BackendError::Alloc {
                elems,
                problem: e.to_string(),
            })?;
        b.fill_u32(0).map_err(gerr(op))?;
        let v = if int { &mut self.ibufs } else { &mut self.bufs };
        let id = match v.iter().position(|s| s.is_none()) {
            Some(i) => {
                v[i] = Some(b);
                i
            }
            None => {
                v.push(Some(b));
                v.len() - 1
            }
        };
        u32::try_from(id).map_err(|_| BackendError::Alloc {
            elems,
            problem: "too many buffers".into(),
        })
    }

    // ---- weights ----------------------------------------------------------------------

    /// The bytes of tensor `name` into `out` (from the source, else the file). With
    /// `pread` and a file on disk, the bytes are read with `pread` straight into `out` and
    /// the page cache behind them is dropped (`out` is the final pinned buffer on ROCm).
    fn tensor_into(
        source: &Option<Arc<dyn WeightSource>>,
        file: &GgufFile,
        name: &str,
        out: &mut [u8],
        pread: bool,
    ) -> BResult<()> {
        let werr = |problem: String| BackendError::Weight {
            name: name.to_string(),
            problem,
        };
        match source {
            Some(s) => s.fill(name, out).map_err(werr),
            None => {
                if pread {
                    if let Some(path) = file.path() {
                        let t = file
                            .header()
                            .tensor(name)
                            .ok_or_else(|| werr("not in the file's tensor table".into()))?;
                        let n = t.n_bytes().unwrap_or(u64::MAX);
                        if n != out.len() as u64 {
                            return Err(werr(format!(
                                "{n} bytes in the file, {} expected",
                                out.len()
                            )));
                        }
                        let offset = file
                            .layout()
                            .data_offset
                            .checked_add(t.offset)
                            .ok_or_else(|| werr("offset overflows".into()))?;
                        return crate::loader::pread_into(path, offset, out)
                            .map_err(|e| werr(e.to_string()));
                    }
                }
                let (_, data) = file.tensor_bytes(name).map_err(|e| werr(e.to_string()))?;
                if data.len() != out.len() {
                    return Err(werr(format!(
                        "{} bytes in the file, {} expected",
                        data.len(),
                        out.len()
                    )));
                }
                out.copy_from_slice(data);
                Ok(())
            }
        }
    }

    fn load(&mut self, file: &Arc<GgufFile>, name: &str, usage: WeightUse) -> BResult<Weight> {
        self.load_inner(file, name, usage, false)
    }

    /// Rearranges weight `wi`'s rows in place into the GPU's split Q8_0 layout (its codes,
    /// then its scales; docs/gpu.md §7) once its bytes are on the device. Other types and
    /// vectors are left alone. Every Q8_0 consumer on the GPU (GEMVs, panels, tiles, the
    /// embedding) reads that layout; the bytes per row do not change.
    pub(crate) fn split_q8_0(&self, wi: usize) -> BResult<()> {
        let w = &self.weights[wi];
        if w.info.ty != GgmlType::Q8_0 {
            return Ok(());
        }
        let ptr = match &w.storage {
            Some(Storage::Own(b)) => b.device_address(),
            Some(Storage::Arena { arena, offset }) => {
                self.arenas[*arena].device_address() + *offset as u64
            }
            None => return Ok(()),
        };
        let rows = w.info.dims[1] * w.info.dims[2];
        self.split_q8_0_rows(ptr, rows, w.info.dims[0])
    }

    /// [`Self::split_q8_0`] of `rows` Q8_0 rows of `cols` values at device address `ptr`.
    fn split_q8_0_rows(&self, ptr: u64, rows: usize, cols: usize) -> BResult<()> {
        let n = i32::try_from(cols).map_err(|_| BackendError::Invalid {
            op: "load_weight",
            problem: format!("Q8_0 row of {cols} values"),
        })?;
        self.launch(
            "ds4_q8_0_split",
            (rows.clamp(1, 1 << 16) as u32, 1, 1),
            256,
            &[
                launch::Arg::Ptr(ptr),
                launch::Arg::U64(rows as u64),
                launch::Arg::I32(n),
            ],
        )
    }

    /// [`ds4_engine::Backend::alloc_weight`]: a zero-filled matrix weight in its own
    /// allocation (the slot pools of streamed experts, docs/placement.md §9).
    fn alloc_pool(&mut self, name: &str, info: WeightInfo) -> BResult<Weight> {
        let werr = |problem: String| BackendError::Weight {
            name: name.to_string(),
            problem,
        };
        let bytes = validate::alloc_weight(name, info)?;
        if !matches!(
            info.ty,
            GgmlType::F32
                | GgmlType::F16
                | GgmlType::Bf16
                | GgmlType::Q8_0
                | GgmlType::Q2K
                | GgmlType::Q4K
                | GgmlType::Iq2Xxs
                | GgmlType::Mxfp4
        ) || (info.ty == GgmlType::Q8_0 && info.cols() > Q8_SPLIT_MAX_IN)
        {
            return Err(werr(format!(
                "type {} [{}] is not supported",
                info.ty,
                info.cols()
            )));
        }
        let row_bytes = bytes / (info.rows() * info.mats());
        let mut b = self
            .dev
            .alloc_weights(bytes.max(16))
            .map_err(|e| werr(e.to_string()))?;
        b.fill_u32(0).map_err(|e| werr(e.to_string()))?;
        let kind = b.kind();
        self.loaded.add(kind, bytes as u64);
        let id = u32::try_from(self.weights.len()).map_err(|_| werr("too many weights".into()))?;
        self.weights.push(GpuWeight {
            name: name.to_string(),
            info,
            row_bytes,
            storage: Some(Storage::Own(b)),
            vector: None,
            kind,
        });
        Ok(Weight::new(id, info))
    }

    /// [`ds4_engine::Backend::write_weight_mat`]: waits for queued work (an op still
    /// reading the slot), copies the bytes, then repacks them as the load path does
    /// (Q8_0: the split layout, docs/gpu.md §7).
    fn write_pool_mat(&mut self, w: Weight, mat: usize, raw: &[u8]) -> BResult<()> {
        const OP: &str = "write_weight_mat";
        let bytes = validate::write_weight_mat(w, mat, raw.len())?;
        self.weight(w, OP)?;
        self.sync()?;
        let offset = mat * bytes;
        let gw = &mut self.weights[w.id() as usize];
        let ptr = match &mut gw.storage {
            Some(Storage::Own(b)) => {
                b.write(offset, raw).map_err(gerr(OP))?;
                b.device_address() + offset as u64
            }
            _ => {
                return Err(BackendError::Invalid {
                    op: OP,
                    problem: format!("weight {} is not a slot pool", gw.name),
                })
            }
        };
        if w.info.ty == GgmlType::Q8_0 {
            self.split_q8_0_rows(ptr, w.info.rows(), w.info.cols())?;
        }
        Ok(())
    }

    /// Allocates weight `name` and, unless `defer`, copies its bytes. Deferred matrices
    /// and tables are filled later by the load pipeline (small vectors never are).
    fn load_inner(
        &mut self,
        file: &Arc<GgufFile>,
        name: &str,
        usage: WeightUse,
        defer: bool,
    ) -> BResult<Weight> {
        let werr = |problem: String| BackendError::Weight {
            name: name.to_string(),
            problem,
        };
        let t = file
            .header()
            .tensor(name)
            .ok_or_else(|| werr("not in the file's tensor table".into()))?;
        if t.dims.is_empty() || t.dims.len() > 3 {
            return Err(werr(format!("{} dims, at most 3 supported", t.dims.len())));
        }
        let mut dims = [1usize; 3];
        for (d, &v) in dims.iter_mut().zip(&t.dims) {
            *d = usize::try_from(v).map_err(|_| werr(format!("dim {v} too large")))?;
        }
        let ty = t.ty;
        let row_bytes = ty
            .row_bytes(dims[0] as u64)
            .ok_or_else(|| werr(format!("type {ty} cannot hold rows of {}", dims[0])))?
            as usize;
        let bytes = row_bytes
            .checked_mul(dims[1] * dims[2])
            .ok_or_else(|| werr("size overflows".into()))?;
        let supported = matches!(
            ty,
            GgmlType::F32
                | GgmlType::F16
                | GgmlType::Bf16
                | GgmlType::Q8_0
                | GgmlType::Q2K
                | GgmlType::Q4K
                | GgmlType::Iq2Xxs
                | GgmlType::Mxfp4
        ) || (usage == WeightUse::Table && ty == GgmlType::I32);
        if !supported {
            return Err(werr(format!(
                "type {ty} is not supported for {usage:?} use"
            )));
        }
        let info = WeightInfo { ty, dims };
        let source = self.source.clone();
        let pread = self.pread_load;
        let (storage, vector, kind) = if usage == WeightUse::Vector {
            if self.staging.len() < bytes {
                self.staging.resize(bytes, 0);
            }
            Self::tensor_into(&source, file, name, &mut self.staging[..bytes], false)?;
            let mut vals = vec![0f32; info.n_elements()];
            ds4_gguf::quant::dequantize(ty, &self.staging[..bytes], &mut vals)
                .map_err(|e| werr(e.to_string()))?;
            let raw: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
            let mut b = self
                .dev
                .alloc(MemKind::Device, raw.len().max(4))
                .map_err(|e| werr(e.to_string()))?;
            b.write(0, &raw).map_err(|e| werr(e.to_string()))?;
            self.loaded.vectors += raw.len() as u64;
            (None, Some(b), MemKind::Device)
        } else if let Some(&(arena, offset)) = self.spans.get(name) {
            let kind = self
                .actual
                .as_ref()
                .and_then(|a| a.entries.get(arena))
                .map_or(MemKind::Device, |e| e.used);
            let buf = &mut self.arenas[arena];
            if offset.checked_add(bytes).is_none_or(|e| e > buf.len()) {
                return Err(werr(format!(
                    "the plan's span at {offset} does not hold {bytes} bytes"
                )));
            }
            let host = if defer {
                Ok(None)
            } else {
                buf.host_bytes_mut().map_err(|e| werr(e.to_string()))
            };
            match host? {
                _ if defer => {}
                Some(h) => {
                    Self::tensor_into(&source, file, name, &mut h[offset..offset + bytes], pread)?
                }
                None => {
                    if self.staging.len() < bytes {
                        self.staging.resize(bytes, 0);
                    }
                    Self::tensor_into(&source, file, name, &mut self.staging[..bytes], false)?;
                    buf.write(offset, &self.staging[..bytes])
                        .map_err(|e| werr(e.to_string()))?;
                }
            }
            self.loaded.add(kind, bytes as u64);
            (Some(Storage::Arena { arena, offset }), None, kind)
        } else {
            // CUDA: device memory. ROCm: ds4's chain (pinned host first on integrated GPUs).
            let mut b = self
                .dev
                .alloc_weights(bytes.max(16))
                .map_err(|e| werr(e.to_string()))?;
            let kind = b.kind();
            let host = if defer {
                Ok(None)
            } else {
                b.host_bytes_mut().map_err(|e| werr(e.to_string()))
            };
            match host? {
                _ if defer => {}
                Some(h) => Self::tensor_into(&source, file, name, &mut h[..bytes], pread)?,
                None => {
                    if self.staging.len() < bytes {
                        self.staging.resize(bytes, 0);
                    }
                    Self::tensor_into(&source, file, name, &mut self.staging[..bytes], false)?;
                    b.write(0, &self.staging[..bytes])
                        .map_err(|e| werr(e.to_string()))?;
                }
            }
            self.loaded.add(kind, bytes as u64);
            (Some(Storage::Own(b)), None, kind)
        };
        // Big staging buffers are not kept past the tensor that needed them.
        if self.staging.len() > (64 << 20) {
            self.staging = Vec::new();
        }
        let id = u32::try_from(self.weights.len()).map_err(|_| werr("too many weights".into()))?;
        if ty == GgmlType::Q8_0 && storage.is_some() && dims[0] > Q8_SPLIT_MAX_IN {
            return Err(werr(format!(
                "Q8_0 rows of {} values: the GPU takes at most {Q8_SPLIT_MAX_IN}",
                dims[0]
            )));
        }
        self.weights.push(GpuWeight {
            name: name.to_string(),
            info,
            row_bytes,
            storage,
            vector,
            kind,
        });
        if !defer {
            self.split_q8_0(self.weights.len() - 1)?;
        }
        Ok(Weight::new(id, info))
    }
}

/// The launch code in `ops/` (one file per kernel family); every call has passed
/// `ds4_engine::validate` first (the blanket `Backend` impl over `Device` runs it).
impl<D: GpuApi> ds4_engine::device::Device for GpuBackend<D> {
    fn name(&self) -> String {
        format!("{} ({})", self.dev.runtime(), self.dev.device_name())
    }

    fn warms_up(&self) -> bool {
        true
    }

    fn alloc(&mut self, len: usize) -> BResult<Buf> {
        Ok(Buf::new(self.new_buf(len, "alloc", false)?, len))
    }

    fn alloc_i32(&mut self, len: usize) -> BResult<IBuf> {
        Ok(IBuf::new(self.new_buf(len, "alloc_i32", true)?, len))
    }

    fn free(&mut self, buf: Buf) {
        if let Some(s) = self.bufs.get_mut(buf.id() as usize) {
            *s = None;
        }
    }

    fn free_i32(&mut self, buf: IBuf) {
        if let Some(s) = self.ibufs.get_mut(buf.id() as usize) {
            *s = None;
        }
    }

    fn upload(&mut self, dst: Slice, src: &[f32]) -> BResult<()> {
        self.fptr(dst, "upload")?;
        // Device buffers hold little-endian f32: on a little-endian host the values' own
        // bytes go (no copy: a KV snapshot restores tens of MB through here).
        let bytes: std::borrow::Cow<[u8]> = if cfg!(target_endian = "little") {
            bytemuck::cast_slice(src).into()
        } else {
            src.iter().flat_map(|v| v.to_le_bytes()).collect()
        };
        let b = self.bufs[dst.buf.id() as usize].as_mut().expect("checked");
        host_wait(&self.syncs, &self.wait_ns, || b.write(4 * dst.off, &bytes))
            .map_err(gerr("upload"))?;
        if !bytes.is_empty() {
            self.waited();
        }
        Ok(())
    }

    fn download(&mut self, src: Slice, dst: &mut [f32]) -> BResult<()> {
        self.fptr(src, "download")?;
        if dst.is_empty() {
            // No read, so no wait for the fault word to ride along with.
            return self.fault_after_wait(false, "download");
        }
        let queued = self.queue_fault("download")?;
        // Straight into `dst`'s bytes (no staging buffer to fault in and convert from: the
        // logits row every token, a KV snapshot's tens of MB), then from little-endian.
        let b = self.bufs[src.buf.id() as usize].as_ref().expect("checked");
        host_wait(&self.syncs, &self.wait_ns, || {
            b.read(4 * src.off, bytemuck::cast_slice_mut(dst))
        })
        .map_err(gerr("download"))?;
        self.waited();
        if cfg!(target_endian = "big") {
            for d in dst.iter_mut() {
                *d = f32::from_bits(u32::from_le(d.to_bits()));
            }
        }
        self.fault_after_wait(queued, "download")
    }

    fn upload_i32(&mut self, dst: IBuf, off: usize, src: &[i32]) -> BResult<()> {
        const OP: &str = "upload_i32";
        self.iptr(dst, OP)?;
        let n = 4 * src.len();
        if n > 0 && n <= IO_SLOT_BYTES && self.io.is_some() {
            // Through a ring slot and a queued copy (see `HostIo`): no host wait.
            if self.io.as_ref().is_some_and(|io| io.queued == IO_SLOTS) {
                host_wait(&self.syncs, &self.wait_ns, || self.dev.synchronize())
                    .map_err(gerr(OP))?;
                self.waited();
            }
            let io = self.io.as_mut().expect("checked");
            let at = io.next * IO_SLOT_BYTES;
            // SAFETY: the slot's last copy completed (fewer than IO_SLOTS copies were
            // queued since the last host wait, and slots are used in turn) and no kernel
            // reads pinned staging.
            let slot = unsafe { io.buf.host_range_unsynced(at, n) }
                .map_err(gerr(OP))?
                .ok_or_else(|| {
                    gerr(OP)(GpuError::BadArgument {
                        op: OP,
                        detail: "per-token staging is not host memory".into(),
                    })
                })?;
            for (d, v) in slot.chunks_exact_mut(4).zip(src) {
                d.copy_from_slice(&v.to_le_bytes());
            }
            let b = self.ibufs[dst.id() as usize].as_ref().expect("checked");
            // SAFETY: the slot is not written again before a host wait (ring invariant).
            unsafe { self.dev.queue_upload(&io.buf, at, b, 4 * off, n) }.map_err(gerr(OP))?;
            io.next = (io.next + 1) % IO_SLOTS;
            io.queued += 1;
            return Ok(());
        }
        let bytes: Vec<u8> = src.iter().flat_map(|v| v.to_le_bytes()).collect();
        let b = self.ibufs[dst.id() as usize].as_mut().expect("checked");
        host_wait(&self.syncs, &self.wait_ns, || b.write(4 * off, &bytes)).map_err(gerr(OP))?;
        if !bytes.is_empty() {
            self.waited();
        }
        Ok(())
    }

    fn download_i32(&mut self, src: IBuf, off: usize, dst: &mut [i32]) -> BResult<()> {
        self.iptr(src, "download_i32")?;
        if dst.is_empty() {
            // No read, so no wait for the fault word to ride along with.
            return self.fault_after_wait(false, "download_i32");
        }
        // The fault word rides along with this read's wait (the step's only one).
        let queued = self.queue_fault("download_i32")?;
        let mut bytes = vec![0u8; 4 * dst.len()];
        let b = self.ibufs[src.id() as usize].as_ref().expect("checked");
        host_wait(&self.syncs, &self.wait_ns, || b.read(4 * off, &mut bytes))
            .map_err(gerr("download_i32"))?;
        self.waited();
        for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
            *d = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        self.fault_after_wait(queued, "download_i32")
    }

    fn copy(&mut self, src: Slice, dst: Slice) -> BResult<()> {
        let (s, d) = (self.fptr(src, "copy")?, self.fptr(dst, "copy")?);
        self.elementwise("ds4_copy", src.len, &[Arg::Ptr(d), Arg::Ptr(s)])
    }

    fn fill(&mut self, dst: Slice, value: f32) -> BResult<()> {
        let d = self.fptr(dst, "fill")?;
        self.elementwise(
            "ds4_fill",
            dst.len,
            &[Arg::Ptr(d), Arg::U64(0), Arg::F32(value)],
        )
    }

    fn load_weight(
        &mut self,
        file: &Arc<GgufFile>,
        name: &str,
        usage: WeightUse,
    ) -> BResult<Weight> {
        self.load(file, name, usage)
    }

    fn load_weights(
        &mut self,
        file: &Arc<GgufFile>,
        list: &[(String, WeightUse)],
    ) -> BResult<Vec<Weight>> {
        self.load_batch(file, list)
    }

    fn alloc_weight(&mut self, name: &str, info: WeightInfo) -> BResult<Weight> {
        self.alloc_pool(name, info)
    }

    fn write_weight_mat(&mut self, w: Weight, mat: usize, raw: &[u8]) -> BResult<()> {
        self.write_pool_mat(w, mat, raw)
    }

    fn alloc_host_slab(&mut self, bytes: usize) -> BResult<Box<dyn HostSlab>> {
        self.alloc_slab(bytes)
    }

    fn write_weight_mats(
        &mut self,
        slab: Box<dyn HostSlab>,
        tag: u64,
        mats: &[SlabMat],
    ) -> BResult<Option<Box<dyn HostSlab>>> {
        self.write_slab_mats(slab, tag, mats)
    }

    fn reclaim_host_slabs(&mut self, wait: bool) -> BResult<TaggedSlabs> {
        self.reclaim_slabs(wait)
    }

    fn argmax(&mut self, x: Slice, out: IBuf) -> BResult<()> {
        self.op_argmax(x, out)
    }

    fn logit_band(&mut self, x: Slice, span: f32, exclude: Option<u32>, out: IBuf) -> BResult<()> {
        self.op_logit_band(x, span, exclude, out)
    }

    fn logit_bands(&mut self, x: Slice, n: usize, jobs: &[BandJob]) -> BResult<()> {
        self.op_logit_bands(x, n, jobs)
    }

    fn annotate(&mut self, tag: &'static str) {
        self.tag = tag;
    }

    fn set_activation_q8(&mut self, on: bool) -> BResult<()> {
        self.act_q8 = on;
        Ok(())
    }

    /// Above [`ops::GROUPED_MAX_SEL`] selections a prefill's routed experts take the tiles
    /// (`op_moe`), which sort the selections by expert and sum each row over its whole
    /// width in one block, whatever rows share its tile; fewer take the grouped GEMVs.
    fn moe_joint_min_rows(
        &self,
        gate: Weight,
        up: Weight,
        down: Weight,
        k: usize,
    ) -> Option<usize> {
        (k > 0 && self.moe_takes_tiles(gate, up, down)).then(|| ops::GROUPED_MAX_SEL / k + 1)
    }

    fn set_decode_rows(&mut self, n: usize) -> BResult<()> {
        self.decode_rows = n.max(1);
        Ok(())
    }

    fn set_profiling(&mut self, on: bool) -> BResult<bool> {
        if !on {
            self.timeline = None;
            return Ok(true);
        }
        if self.timeline.is_none() {
            // Probe: a runtime without timing events says so here, not mid-forward.
            self.dev.timing_event().map_err(gerr("profile"))?;
            self.timeline = Some(std::sync::Mutex::new(Timeline::new()));
        }
        Ok(true)
    }

    fn take_profile(&mut self) -> BResult<Option<(Vec<ProfileRow>, f64)>> {
        self.take_timeline()
    }

    fn begin_capture(&mut self) -> BResult<bool> {
        self.dev.begin_capture().map_err(gerr("begin_capture"))
    }

    fn end_capture_replay(&mut self, replays: usize) -> BResult<ds4_engine::GraphTiming> {
        self.dev
            .end_capture_replay(replays)
            .map_err(gerr("end_capture_replay"))
    }

    fn counters(&self) -> Counters {
        Counters {
            launches: self.launches.load(Relaxed),
            syncs: self.syncs.load(Relaxed),
            wait_ns: self.wait_ns.load(Relaxed),
        }
    }

    fn matmul(&mut self, w: Weight, mat: usize, x: Slice, n_tok: usize, y: Slice) -> BResult<()> {
        self.op_matmul(w, mat, x, n_tok, y)
    }

    fn matmul_grouped(
        &mut self,
        w: Weight,
        groups: usize,
        x: Slice,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()> {
        self.op_matmul_grouped(w, groups, x, n_tok, y)
    }

    fn rms_norm(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        rows: usize,
        width: usize,
        eps: f32,
        out: Slice,
    ) -> BResult<()> {
        self.op_rms_norm(x, w, rows, width, eps, out)
    }

    fn rope(&mut self, x: Slice, args: ds4_engine::backend::RopeArgs) -> BResult<()> {
        self.op_rope(x, args)
    }

    fn add(&mut self, acc: Slice, x: Slice) -> BResult<()> {
        let (a, b) = (self.fptr(acc, "add")?, self.fptr(x, "add")?);
        self.elementwise("ds4_add", acc.len, &[Arg::Ptr(a), Arg::Ptr(b)])
    }

    fn swiglu(&mut self, gate: Slice, up: Slice, clamp: f32, out: Slice) -> BResult<()> {
        let (g, u, o) = (
            self.fptr(gate, "swiglu")?,
            self.fptr(up, "swiglu")?,
            self.fptr(out, "swiglu")?,
        );
        self.elementwise(
            "ds4_swiglu",
            out.len,
            &[Arg::Ptr(g), Arg::Ptr(u), Arg::F32(clamp), Arg::Ptr(o)],
        )
    }

    fn qat_fp8(&mut self, x: Slice, rows: usize, width: usize, n_dims: usize) -> BResult<()> {
        self.op_qat_fp8(x, rows, width, n_dims)
    }

    fn qat_hadamard_fp4(&mut self, x: Slice, rows: usize, width: usize) -> BResult<()> {
        self.op_qat_hfp4(x, rows, width)
    }

    fn rope_qat_hadamard_fp4(
        &mut self,
        x: Slice,
        rope: ds4_engine::backend::RopeArgs,
        rows: usize,
        width: usize,
    ) -> BResult<()> {
        self.op_rope_qat_hfp4(x, rope, rows, width)
    }

    fn embed(
        &mut self,
        table: Weight,
        tokens: IBuf,
        n_tok: usize,
        n_streams: usize,
        out: Slice,
    ) -> BResult<()> {
        self.op_embed(table, tokens, n_tok, n_streams, out)
    }

    fn hc_pre(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: ds4_engine::backend::HcArgs,
        y: Slice,
        post: Slice,
        comb: Slice,
    ) -> BResult<()> {
        self.op_hc_pre(mix, x, base, scale, args, y, post, comb, None)
    }

    fn hc_pre_norm(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: ds4_engine::backend::HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()> {
        self.op_hc_pre(mix, x, base, scale, args, y, post, comb, Some((norm, out)))
    }

    fn hc_mix_pre_norm(
        &mut self,
        fn_: Weight,
        x: Slice,
        mix: Slice,
        base: Weight,
        scale: Weight,
        args: ds4_engine::backend::HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()> {
        if self.op_hc_mix_pre(
            None,
            fn_,
            x,
            mix,
            base,
            scale,
            args,
            y,
            post,
            comb,
            (norm, out),
        )? {
            return Ok(());
        }
        self.op_matmul(fn_, 0, x, args.n_tok, mix)?;
        self.op_hc_pre(mix, x, base, scale, args, y, post, comb, Some((norm, out)))
    }

    fn hc_post_mix_pre_norm(
        &mut self,
        prev: HcPost,
        fn_: Weight,
        x: Slice,
        mix: Slice,
        base: Weight,
        scale: Weight,
        args: ds4_engine::backend::HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()> {
        if self.fused {
            let a = (base, scale);
            let no = (norm, out);
            if self.op_hc_mix_pre(Some(prev), fn_, x, mix, a.0, a.1, args, y, post, comb, no)? {
                return Ok(());
            }
        }
        self.op_hc_post(x, prev.f, prev.f2, prev.post, prev.comb, args)?;
        ds4_engine::Backend::hc_mix_pre_norm(
            self, fn_, x, mix, base, scale, args, norm, y, post, comb, out,
        )
    }

    fn norm_rope(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        eps: f32,
        rope: ds4_engine::backend::RopeArgs,
        fp8_dims: Option<usize>,
    ) -> BResult<()> {
        self.op_norm_rope(x, w, eps, rope, fp8_dims)
    }

    fn compressor_pair(
        &mut self,
        a: ds4_engine::backend::CompressorCall,
        b: ds4_engine::backend::CompressorCall,
    ) -> BResult<()> {
        self.op_compressor_pair(a, b)
    }

    fn rope_matmul_grouped(
        &mut self,
        x: Slice,
        rope: ds4_engine::backend::RopeArgs,
        w: Weight,
        groups: usize,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()> {
        if self.fused
            && n_tok == 1
            && self.q8_rows(1)
            && self.op_rope_grouped_gemv(x, rope, w, groups, y)?
        {
            return Ok(());
        }
        self.op_rope(x, rope)?;
        self.op_matmul_grouped(w, groups, x, n_tok, y)
    }

    fn rms_norm_matmul(
        &mut self,
        x: Slice,
        norm: Weight,
        eps: f32,
        h: Slice,
        w: Weight,
        n_tok: usize,
        out: Slice,
    ) -> BResult<()> {
        let width = w.info.cols();
        if self.fused
            && n_tok == 1
            && self.q8_rows(1)
            && self.op_rms_norm_gemv(x, norm, eps, h, w, out)?
        {
            return Ok(());
        }
        ds4_engine::Backend::rms_norm(self, x, Some(norm), n_tok, width, eps, h)?;
        self.op_matmul(w, 0, h, n_tok, out)
    }

    fn swiglu_matmul(
        &mut self,
        gate: Slice,
        up: Slice,
        clamp: f32,
        h: Slice,
        w: Weight,
        n_tok: usize,
        out: Slice,
    ) -> BResult<()> {
        if self.fused
            && n_tok == 1
            && self.q8_rows(1)
            && self.op_swiglu_gemv(gate, up, clamp, w, out)?
        {
            return Ok(());
        }
        ds4_engine::Backend::swiglu(self, gate, up, clamp, h)?;
        self.op_matmul(w, 0, h, n_tok, out)
    }

    fn norm_rope_pair(&mut self, a: NormRopeCall, b: NormRopeCall) -> BResult<()> {
        self.op_norm_rope_pair(a, b, None)
    }

    fn norm_rope_pair_store(
        &mut self,
        a: NormRopeCall,
        b: NormRopeCall,
        store: ds4_engine::backend::RingStoreCall,
    ) -> BResult<()> {
        // The fused store writes b's rows, so `store` must name exactly those.
        let one_row = store.n_tok == 1
            && b.rope.n_rows * b.rope.n_heads == 1
            && store.kv == b.x.sub(0, store.kv.len)
            && store.kv.len == b.rope.head_dim
            && store.ring.len == store.window * b.rope.head_dim;
        if self.fused && one_row {
            return self.op_norm_rope_pair(a, b, Some(store));
        }
        self.op_norm_rope_pair(a, b, None)?;
        self.op_ring_store(store.ring, store.kv, store.pos0, store.n_tok, store.window)
    }

    fn matmul_pair(
        &mut self,
        wa: Weight,
        wb: Weight,
        x: Slice,
        n_tok: usize,
        ya: Slice,
        yb: Slice,
    ) -> BResult<()> {
        self.op_matmul_pair(wa, wb, x, n_tok, ya, yb)
    }

    fn matmul_set(
        &mut self,
        x: Slice,
        n_tok: usize,
        singles: &[(Weight, Slice)],
        pairs: &[ds4_engine::MatmulPair],
    ) -> BResult<()> {
        self.op_matmul_set(x, n_tok, singles, pairs)
    }

    fn hc_post(
        &mut self,
        x: Slice,
        f: Slice,
        post: Slice,
        comb: Slice,
        args: ds4_engine::backend::HcArgs,
    ) -> BResult<()> {
        self.op_hc_post(x, f, None, post, comb, args)
    }

    fn hc_post_add(
        &mut self,
        x: Slice,
        f: Slice,
        f2: Slice,
        post: Slice,
        comb: Slice,
        args: ds4_engine::backend::HcArgs,
    ) -> BResult<()> {
        self.op_hc_post(x, f, Some(f2), post, comb, args)
    }

    fn hc_head(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: ds4_engine::backend::HcArgs,
        y: Slice,
    ) -> BResult<()> {
        self.op_hc_head(mix, x, base, scale, args, y)
    }

    fn compressor(
        &mut self,
        acc: Slice,
        u: Slice,
        z: Slice,
        ape: Weight,
        args: ds4_engine::backend::CompressorArgs,
        rows: Slice,
    ) -> BResult<()> {
        self.op_compressor(acc, u, z, ape, args, rows)
    }

    fn indexer_topk(
        &mut self,
        q: Slice,
        w: Slice,
        rows: Slice,
        args: ds4_engine::backend::IndexerArgs,
        out: IBuf,
    ) -> BResult<()> {
        self.op_indexer_topk(q, w, rows, args, out)
    }

    fn attention(&mut self, args: ds4_engine::backend::AttnArgs) -> BResult<()> {
        self.op_attention(args)
    }

    fn compressor_batch(&mut self, calls: &[ds4_engine::backend::CompressorCall]) -> BResult<()> {
        self.op_compressor_batch(calls)
    }

    fn indexer_topk_batch(&mut self, calls: &[ds4_engine::backend::IndexerCall]) -> BResult<()> {
        self.op_indexer_topk_batch(calls)
    }

    fn ring_store_batch(&mut self, calls: &[ds4_engine::backend::RingStoreCall]) -> BResult<()> {
        self.op_ring_store_batch(calls)
    }

    fn attention_batch(&mut self, args: &[ds4_engine::backend::AttnArgs]) -> BResult<()> {
        self.op_attention_batch(args)
    }

    fn ring_store(
        &mut self,
        ring: Slice,
        kv: Slice,
        pos0: usize,
        n_tok: usize,
        window: usize,
    ) -> BResult<()> {
        self.op_ring_store(ring, kv, pos0, n_tok, window)
    }

    fn router(
        &mut self,
        logits: Slice,
        routing: ds4_engine::backend::Routing,
        args: ds4_engine::backend::RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()> {
        self.op_router(logits, routing, args, ids, weights)
    }

    fn router_matmul(
        &mut self,
        w: Weight,
        x: Slice,
        logits: Slice,
        routing: ds4_engine::backend::Routing,
        args: ds4_engine::backend::RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()> {
        self.op_router_matmul(w, x, logits, routing, args, ids, weights)
    }

    fn moe(
        &mut self,
        x: Slice,
        ids: IBuf,
        weights: Slice,
        gate: Weight,
        up: Weight,
        down: Weight,
        args: ds4_engine::backend::MoeArgs,
        out: Slice,
    ) -> BResult<()> {
        self.op_moe(x, ids, weights, gate, up, down, args, out)
    }
}

/// Runs a blocking host wait for the device (a synchronisation or a copy back), counting
/// it in `syncs` and its duration in `wait_ns`: with the launch count this tells whether a
/// token's time is the device's (long waits) or the host's (short waits).
fn host_wait<T>(
    syncs: &std::sync::atomic::AtomicU64,
    wait_ns: &std::sync::atomic::AtomicU64,
    f: impl FnOnce() -> T,
) -> T {
    syncs.fetch_add(1, Relaxed);
    let t = std::time::Instant::now();
    let r = f();
    wait_ns.fetch_add(
        u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX),
        Relaxed,
    );
    r
}
