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
    /// Bytes `offset..offset + len` through the host mapping *without* waiting for queued
    /// work (a per-token path must not add a host wait); `None` for device memory.
    ///
    /// # Safety
    /// No queued or running device work may access the range: the caller knows every
    /// copy touching it has completed (a host wait since) and no kernel uses it.
    unsafe fn host_range_unsynced(
        &mut self,
        offset: usize,
        len: usize,
    ) -> Result<Option<&mut [u8]>>;
}

/// A GPU runtime bound to one device.
pub trait GpuApi: Send + Sync + Sized {
    type Buffer: DeviceBuffer + 'static;
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
    /// Most dynamic shared memory one block may be given ([`Self::launch_smem`]); 0 when
    /// the runtime does not implement it.
    fn max_dynamic_smem(&self) -> u32 {
        0
    }
    /// [`Self::launch`] with `smem` bytes of dynamic shared memory. Runtimes that do not
    /// implement it refuse any non-zero amount (the backend then keeps kernels that need
    /// none).
    ///
    /// # Safety
    /// As [`Self::launch`].
    unsafe fn launch_smem(
        &self,
        f: &Self::Function,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        if smem != 0 {
            return Err(crate::error::GpuError::BadArgument {
                op: "launch",
                detail: format!("{smem} bytes of dynamic shared memory: not on this runtime"),
            });
        }
        // SAFETY: the caller upholds this method's contract, which is `launch`'s.
        unsafe { self.launch(f, grid, block, params) }
    }
    /// Whether later launches may overlap the kernel before them (CUDA's programmatic
    /// dependent launch, docs/gpu.md §6). The backend turns it on for decode-sized forward
    /// passes and off for prefill, where it measured slower. Runtimes without it ignore
    /// the call.
    fn set_overlapped_launches(&self, _on: bool) {}
    /// Waits for all queued work, surfacing asynchronous faults.
    fn synchronize(&self) -> Result<()>;
    /// A new timing event (runtimes without wired events refuse: attribution off).
    fn timing_event(&self) -> Result<Self::Event>;
    /// Records `e` at the current end of the stream (no host wait).
    fn record_event(&self, e: &Self::Event) -> Result<()>;
    /// Milliseconds between two recorded events (waits for `b`).
    fn event_ms(&self, a: &Self::Event, b: &Self::Event) -> Result<f32>;

    /// Starts recording the work queued on the kernels' stream into a graph instead of
    /// running it; `Ok(false)` where the runtime has no graphs (nothing recorded).
    fn begin_capture(&self) -> Result<bool> {
        Ok(false)
    }
    /// Ends the recording, instantiates the graph, replays it once untimed and `replays`
    /// times between two timing events, waits, and destroys it (`replays` 0: only ends it).
    fn end_capture_replay(&self, _replays: usize) -> Result<ds4_engine::GraphTiming> {
        Err(crate::error::GpuError::BadArgument {
            op: "end_capture_replay",
            detail: format!("the {} runtime records no graphs", self.runtime()),
        })
    }

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

    // ---- per-token traffic ------------------------------------------------------------

    /// Queues a copy of `len` bytes from the host-resident (pinned) buffer `src` at
    /// `src_off` to `dst` at `dst_off`, on the stream the kernels run on, without waiting:
    /// kernels queued later see the bytes. Unlike [`GpuApi::copy_to_device_async`] this is
    /// asynchronous on every runtime (the token-id upload of a decode step).
    ///
    /// # Safety
    /// `src`'s range must not be modified until a host wait for the stream has returned.
    unsafe fn queue_upload(
        &self,
        src: &Self::Buffer,
        src_off: usize,
        dst: &Self::Buffer,
        dst_off: usize,
        len: usize,
    ) -> Result<()>;
    /// Queues a copy of `len` bytes from `src` at `src_off` into the host-resident
    /// (pinned) buffer `dst` at `dst_off`, on the kernels' stream, without waiting; the
    /// bytes are valid on the host once a later host wait for the stream has returned (the
    /// device fault word rides along with the wait for a result).
    ///
    /// # Safety
    /// `dst`'s range must not be accessed from the host until such a wait has returned.
    unsafe fn queue_download(
        &self,
        src: &Self::Buffer,
        src_off: usize,
        dst: &Self::Buffer,
        dst_off: usize,
        len: usize,
    ) -> Result<()>;
}
