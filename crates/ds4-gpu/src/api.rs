//! The runtime interface the engine backend runs on: one trait, [`GpuApi`], implemented by
//! CUDA ([`crate::cuda::CudaDevice`], the code verified on the H200, unchanged underneath),
//! HIP ([`crate::hip::HipDevice`] over the real `libamdhip64`) and the same HIP layer over
//! a fake runtime ([`crate::hip::fake::FakeHip`]) for tests without hardware.
//!
//! The backend never sees a runtime type: it allocates [`DeviceBuffer`]s by placement
//! kind, loads modules from the kernel tree, looks up functions and launches them with a
//! raw parameter list. Placement decisions stay in `ds4-placement`; an implementation
//! only performs the kind it is asked for (and, on HIP, the live admission re-check).

use std::ffi::c_void;

use ds4_placement::{Allocated, LoadFailure, MemKind, Plan};

use crate::cache::KernelCache;
use crate::error::Result;
use crate::kernels::KernelSource;

/// One allocation of any placement kind, freed when dropped.
pub trait DeviceBuffer: Send + Sync {
    /// The memory kind actually allocated.
    fn kind(&self) -> MemKind;
    /// Size in bytes.
    fn len(&self) -> usize;
    /// Whether the buffer has no bytes (never true for a live allocation).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The address kernels use.
    fn device_address(&self) -> u64;
    /// Copies `src` to byte `offset` and waits for the copy.
    fn write(&mut self, offset: usize, src: &[u8]) -> Result<()>;
    /// Copies from byte `offset` into `dst` (after all queued work) and waits.
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()>;
    /// Fills the whole buffer with a 32-bit pattern (queued).
    fn fill_u32(&mut self, value: u32) -> Result<()>;
    /// The bytes through the host mapping, for host-resident kinds (after queued work);
    /// `None` for device memory.
    fn host_bytes_mut(&mut self) -> Result<Option<&mut [u8]>>;
}

/// A GPU runtime bound to one device.
pub trait GpuApi: Send + Sync + Sized {
    type Buffer: DeviceBuffer;
    type Module: Send + Sync;
    type Function: Send + Sync;
    /// A timing event on the device's stream (device-time attribution).
    type Event: Send + Sync;

    /// `cuda` or `rocm`.
    fn runtime(&self) -> &'static str;
    /// Device name for logs and the backend name.
    fn device_name(&self) -> String;
    /// Streaming multiprocessors / compute units (GEMV launch heuristics).
    fn multiprocessors(&self) -> u32;
    /// Allocates `bytes` of `kind`.
    fn alloc(&self, kind: MemKind, bytes: usize) -> Result<Self::Buffer>;
    /// A weight tensor's own allocation when no plan places it. CUDA: device memory. HIP:
    /// ds4's integrated-GPU chain (pinned host → managed → device), see `hip::device`.
    fn alloc_weights(&self, bytes: usize) -> Result<Self::Buffer> {
        self.alloc(MemKind::Device, bytes)
    }
    /// Engine buffers (activations, KV) and scratch. CUDA: device memory. HIP: managed
    /// with `DS4_CUDA_MANAGED=1` (ds4 PR #361), else device memory.
    fn alloc_scratch(&self, bytes: usize) -> Result<Self::Buffer> {
        self.alloc(MemKind::Device, bytes)
    }
    /// Allocates a plan's arenas and buffers through `ds4_placement::execute`, with this
    /// runtime's allocator (fallback chains and live admission included).
    fn execute_plan(&self, plan: &Plan) -> Result<Allocated<Self::Buffer>, LoadFailure>;
    /// `src` compiled for this device (from `cache` when valid), with extra options.
    fn load_module(
        &self,
        src: &KernelSource,
        cache: &KernelCache,
        extra: &[String],
    ) -> Result<Self::Module>;
    /// Entry point `name` of `module`.
    fn function(&self, module: &Self::Module, name: &str) -> Result<Self::Function>;
    /// The first two `int`s of a `__device__` global of `module` (GEMV configurations).
    fn read_i32x2_global(&self, module: &Self::Module, name: &str) -> Result<[i32; 2]>;
    /// Queues `f` on the device's stream.
    ///
    /// # Safety
    /// `params` must match the kernel's parameter list (types and order) and every device
    /// address among them must be valid for every access the kernel makes with this grid.
    unsafe fn launch(
        &self,
        f: &Self::Function,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<()>;
    /// Waits for all queued work, surfacing asynchronous faults.
    fn synchronize(&self) -> Result<()>;
    /// A new timing event (runtimes without wired events refuse: attribution off).
    fn timing_event(&self) -> Result<Self::Event>;
    /// Records `e` at the current end of the stream (no host wait).
    fn record_event(&self, e: &Self::Event) -> Result<()>;
    /// Milliseconds between two recorded events (waits for `b`).
    fn event_ms(&self, a: &Self::Event, b: &Self::Event) -> Result<f32>;

    // ---- load pipeline ----------------------------------------------------------------

    /// An event used only for ordering (the load pipeline recycles a staging buffer once
    /// the copy out of it has completed); no timing, so it is cheaper to record.
    fn copy_event(&self) -> Result<Self::Event>;
    /// Blocks until the work queued before `e`'s last record has completed.
    fn event_wait(&self, e: &Self::Event) -> Result<()>;
    /// Whether the work queued before `e`'s last record has completed (never blocks).
    fn event_query(&self, e: &Self::Event) -> Result<bool>;
    /// Queues a copy of `src` (host memory, page-locked for a truly asynchronous copy) to
    /// `dst` at byte `offset`, without waiting. Runtimes without asynchronous copies may
    /// complete it before returning.
    ///
    /// # Safety
    /// `src` must stay allocated and unmodified until an event recorded after this call
    /// has completed (or the device has been synchronised): the device reads it later.
    unsafe fn copy_to_device_async(
        &self,
        dst: &Self::Buffer,
        offset: usize,
        src: &[u8],
    ) -> Result<()>;
}
