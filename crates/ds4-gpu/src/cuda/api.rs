//! [`GpuApi`] for CUDA: pure delegation to the verified driver-API code in this module
//! (same allocation calls and flags, same stream, same launch), so the engine backend
//! behaves exactly as it did when it was CUDA-only.

use std::ffi::c_void;

use ds4_placement::{execute, Allocated, LoadFailure, MemKind, Plan};

use super::device::CudaDevice;
use super::memory::{CudaAllocator, CudaBuffer};
use super::module::{CudaFunction, CudaModule};
use crate::api::{DeviceBuffer, GpuApi};
use crate::cache::KernelCache;
use crate::error::Result;
use crate::kernels::KernelSource;

impl DeviceBuffer for CudaBuffer {
    fn kind(&self) -> MemKind {
        CudaBuffer::kind(self)
    }
    fn len(&self) -> usize {
        CudaBuffer::len(self)
    }
    fn device_address(&self) -> u64 {
        CudaBuffer::device_address(self)
    }
    fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        CudaBuffer::write(self, offset, src)
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        CudaBuffer::read(self, offset, dst)
    }
    fn fill_u32(&mut self, value: u32) -> Result<()> {
        CudaBuffer::fill_u32(self, value)
    }
    fn host_bytes_mut(&mut self) -> Result<Option<&mut [u8]>> {
        CudaBuffer::host_bytes_mut(self)
    }
    unsafe fn host_range_unsynced(
        &mut self,
        offset: usize,
        len: usize,
    ) -> Result<Option<&mut [u8]>> {
        // SAFETY: the caller upholds the trait method's contract (the same).
        unsafe { CudaBuffer::host_range_unsynced(self, offset, len) }
    }
}

impl GpuApi for CudaDevice {
    type Buffer = CudaBuffer;
    type Module = CudaModule;
    type Function = CudaFunction;
    type Event = super::event::CudaEvent;

    fn runtime(&self) -> &'static str {
        "cuda"
    }
    fn device_name(&self) -> String {
        self.info().name.clone()
    }
    fn multiprocessors(&self) -> u32 {
        self.info().multiprocessors
    }
    fn alloc(&self, kind: MemKind, bytes: usize) -> Result<CudaBuffer> {
        CudaDevice::alloc(self, kind, bytes)
    }
    fn execute_plan(&self, plan: &Plan) -> Result<Allocated<CudaBuffer>, LoadFailure> {
        execute(plan, &mut CudaAllocator { device: self })
    }
    fn load_module(
        &self,
        src: &KernelSource,
        cache: &KernelCache,
        extra: &[String],
    ) -> Result<CudaModule> {
        self.load_module_with(src, cache, extra)
    }
    fn function(&self, module: &CudaModule, name: &str) -> Result<CudaFunction> {
        module.function(name)
    }
    fn read_i32x2_global(&self, module: &CudaModule, name: &str) -> Result<[i32; 2]> {
        module.read_i32_global::<2>(name)
    }
    unsafe fn launch(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the caller upholds CudaFunction::launch's contract (this trait's).
        unsafe { f.launch(grid, block, params) }
    }
    fn max_dynamic_smem(&self) -> u32 {
        u32::try_from(self.info().max_shared_per_block_optin).unwrap_or(u32::MAX)
    }
    unsafe fn launch_smem(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: as `launch`.
        unsafe { f.launch_smem(grid, block, smem, params) }
    }
    fn set_overlapped_launches(&self, on: bool) {
        self.ctx
            .pdl_now
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }
    fn synchronize(&self) -> Result<()> {
        CudaDevice::synchronize(self)
    }
    fn timing_event(&self) -> Result<Self::Event> {
        self.event()
    }
    fn record_event(&self, e: &Self::Event) -> Result<()> {
        e.record()
    }
    fn event_ms(&self, a: &Self::Event, b: &Self::Event) -> Result<f32> {
        a.elapsed_ms(b)
    }
    fn begin_capture(&self) -> Result<bool> {
        CudaDevice::begin_capture(self)?;
        Ok(true)
    }
    fn end_capture_replay(&self, replays: usize) -> Result<ds4_engine::GraphTiming> {
        CudaDevice::end_capture_replay(self, replays)
    }
    fn copy_event(&self) -> Result<Self::Event> {
        self.ordering_event()
    }
    fn event_wait(&self, e: &Self::Event) -> Result<()> {
        e.wait()
    }
    fn event_query(&self, e: &Self::Event) -> Result<bool> {
        e.query()
    }
    unsafe fn copy_to_device_async(
        &self,
        dst: &CudaBuffer,
        offset: usize,
        src: &[u8],
    ) -> Result<()> {
        // SAFETY: the caller keeps `src` alive and unmodified until a later event completes.
        unsafe { dst.write_async(offset, src) }
    }
    unsafe fn queue_upload(
        &self,
        src: &CudaBuffer,
        src_off: usize,
        dst: &CudaBuffer,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        // SAFETY: the caller upholds the trait method's contract (the same).
        unsafe { dst.upload_from_host_async(dst_off, src, src_off, len) }
    }
    unsafe fn queue_download(
        &self,
        src: &CudaBuffer,
        src_off: usize,
        dst: &CudaBuffer,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        // SAFETY: the caller upholds the trait method's contract (the same).
        unsafe { src.download_to_host_async(src_off, dst, dst_off, len) }
    }
}
