//! Device-visible buffers of every placement kind, freed the way they were allocated.
//!
//! | kind | allocation | device pointer | host pointer |
//! |---|---|---|---|
//! | `Device` | cuMemAlloc | itself | none |
//! | `PinnedHost` | cuMemHostAlloc(DEVICEMAP \| PORTABLE) | cuMemHostGetDevicePointer | the allocation |
//! | `Managed` | cuMemAllocManaged(GLOBAL), refused above the device's free memory | itself | itself |
//! | `HostRegistered` | host memory + cuMemHostRegister(DEVICEMAP \| PORTABLE) | cuMemHostGetDevicePointer | the memory |
//!
//! Host access goes through methods that first wait for the stream, so the CPU never
//! reads memory a queued kernel is still writing. Dropping a buffer also waits for the
//! stream before freeing, so a kernel still in flight never reads freed memory.

use std::alloc::Layout;
use std::any::Any;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::sys;
use ds4_placement::{AllocError, Allocator, ManagedAdvice, MemKind};

use super::device::{mem_get_info, CudaDevice};
use super::driver::{check, Ctx};
use crate::error::{GpuError, Result};

const HOST_PAGE: usize = 4096;

enum Owner {
    /// Freed by the driver call matching the kind.
    Driver,
    /// Host memory this crate allocated (page aligned) and registered.
    Aligned(Layout),
    /// Host memory owned by the caller's object (an mmap, a Vec), registered; dropped
    /// after unregistering.
    External(#[allow(dead_code)] Box<dyn Any + Send>),
}

/// A buffer the device can read and write, of one placement kind.
pub struct CudaBuffer {
    ctx: Arc<Ctx>,
    kind: MemKind,
    dptr: sys::CUdeviceptr,
    host: *mut u8,
    len: usize,
    owner: Owner,
}

// SAFETY: the buffer exclusively owns its allocation; the raw host pointer is only
// dereferenced through &self/&mut self methods that follow Rust's borrow rules, after the
// stream has been synchronised.
unsafe impl Send for CudaBuffer {}
// SAFETY: shared access only reads (host reads after a stream sync, device views).
unsafe impl Sync for CudaBuffer {}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("kind", &self.kind)
            .field("len", &self.len)
            .field("dptr", &format_args!("{:#x}", self.dptr))
            .finish()
    }
}

/// A read-only window of a buffer, to pass to a kernel.
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) len: usize,
    pub(crate) ctx: usize,
    _b: PhantomData<&'a CudaBuffer>,
}

/// A writable window of a buffer (exclusive borrow), to pass to a kernel.
#[derive(Debug)]
pub struct ViewMut<'a> {
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) len: usize,
    pub(crate) ctx: usize,
    _b: PhantomData<&'a mut CudaBuffer>,
}

impl View<'_> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl ViewMut<'_> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

fn bounds(
    op: &'static str,
    what: &'static str,
    offset: usize,
    needed: usize,
    len: usize,
) -> Result<()> {
    if offset.checked_add(needed).is_none_or(|end| end > len) {
        return Err(GpuError::OutOfBounds {
            op,
            what,
            needed: needed as u64,
            offset: offset as u64,
            len: len as u64,
        });
    }
    Ok(())
}

impl CudaDevice {
    /// Allocate `bytes` of `kind`. `Pageable` is not a device allocation and is refused;
    /// `Managed` is refused up front when larger than the device's free memory.
    pub fn alloc(&self, kind: MemKind, bytes: usize) -> Result<CudaBuffer> {
        if bytes == 0 {
            return Err(GpuError::BadArgument {
                op: "alloc",
                detail: format!("a zero-byte {} buffer", kind.label()),
            });
        }
        let ctx = &self.ctx;
        ctx.bind()?;
        let what = || {
            format!(
                "allocating {bytes} bytes of {} memory on device {}",
                kind.label(),
                ctx.ordinal
            )
        };
        let info = self.info();
        match kind {
            MemKind::Device => {
                let mut d: sys::CUdeviceptr = 0;
                // SAFETY: context current; out-pointer is a local.
                check(
                    unsafe { sys::cuMemAlloc_v2(&mut d, bytes) },
                    "cuMemAlloc",
                    what,
                )?;
                Ok(self.wrap(kind, d, std::ptr::null_mut(), bytes, Owner::Driver))
            }
            MemKind::PinnedHost => {
                if !(info.can_map_host_memory && info.unified_addressing) {
                    return Err(GpuError::KindUnsupported {
                        kind: "mapped pinned host",
                        device: info.name.clone(),
                    });
                }
                let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
                let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
                // SAFETY: context current; out-pointer is a local.
                check(
                    unsafe { sys::cuMemHostAlloc(&mut p, bytes, flags) },
                    "cuMemHostAlloc",
                    what,
                )?;
                match self.device_pointer_of(p) {
                    Ok(d) => Ok(self.wrap(kind, d, p.cast(), bytes, Owner::Driver)),
                    Err(e) => {
                        // SAFETY: `p` came from cuMemHostAlloc above and is not used again.
                        unsafe { sys::cuMemFreeHost(p) };
                        Err(e)
                    }
                }
            }
            MemKind::Managed => {
                if !info.managed_memory {
                    return Err(GpuError::KindUnsupported {
                        kind: "managed",
                        device: info.name.clone(),
                    });
                }
                let (free, _) = mem_get_info(ctx.ordinal)?;
                if bytes as u64 > free {
                    return Err(GpuError::ManagedTooLarge {
                        requested: bytes as u64,
                        free,
                    });
                }
                let mut d: sys::CUdeviceptr = 0;
                let flags = sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL as u32;
                // SAFETY: context current; size checked against free memory above.
                check(
                    unsafe { sys::cuMemAllocManaged(&mut d, bytes, flags) },
                    "cuMemAllocManaged",
                    what,
                )?;
                Ok(self.wrap(kind, d, d as *mut u8, bytes, Owner::Driver))
            }
            MemKind::HostRegistered => {
                let size = bytes.div_ceil(HOST_PAGE) * HOST_PAGE;
                let layout = Layout::from_size_align(size, HOST_PAGE).map_err(|e| {
                    GpuError::BadArgument {
                        op: "alloc",
                        detail: format!("{bytes} bytes of host memory: {e}"),
                    }
                })?;
                // SAFETY: layout has non-zero size (bytes > 0).
                let p = unsafe { std::alloc::alloc_zeroed(layout) };
                if p.is_null() {
                    return Err(GpuError::Cuda {
                        call: "alloc",
                        context: what(),
                        code: "host allocation failed".into(),
                    });
                }
                // SAFETY: p..p+size is a live allocation we own until the buffer drops.
                match unsafe { self.register(p, size) } {
                    Ok(d) => Ok(self.wrap(kind, d, p, bytes, Owner::Aligned(layout))),
                    Err(e) => {
                        // SAFETY: allocated above with this layout, never registered.
                        unsafe { std::alloc::dealloc(p, layout) };
                        Err(e)
                    }
                }
            }
            MemKind::Pageable => Err(GpuError::KindUnsupported {
                kind: "pageable (unregistered) host",
                device: info.name.clone(),
            }),
        }
    }

    /// Register memory the caller already owns (an mmap, a Vec) for device access and
    /// keep `owner` alive inside the buffer until it drops. The slice `owner` derefs to
    /// must not move while owned (true for Vec, Box<[u8]> and memory maps).
    pub fn register_host<T>(&self, mut owner: T) -> Result<CudaBuffer>
    where
        T: std::ops::DerefMut<Target = [u8]> + Send + 'static,
    {
        let slice: &mut [u8] = &mut owner;
        let (p, len) = (slice.as_mut_ptr(), slice.len());
        if len == 0 {
            return Err(GpuError::BadArgument {
                op: "register_host",
                detail: "an empty host region".into(),
            });
        }
        self.ctx.bind()?;
        // SAFETY: p..p+len is memory owned by `owner`, which the buffer keeps alive and
        // never touches except through this pointer.
        let d = unsafe { self.register(p, len)? };
        Ok(self.wrap(
            MemKind::HostRegistered,
            d,
            p,
            len,
            Owner::External(Box::new(owner)),
        ))
    }

    /// # Safety
    /// `p..p+len` must be live host memory that stays valid until unregistered.
    unsafe fn register(&self, p: *mut u8, len: usize) -> Result<sys::CUdeviceptr> {
        let info = self.info();
        if !info.host_register_supported || !info.can_map_host_memory {
            return Err(GpuError::KindUnsupported {
                kind: "registered host",
                device: info.name.clone(),
            });
        }
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: guaranteed by the caller; context bound by the caller.
        check(
            unsafe { sys::cuMemHostRegister_v2(p.cast(), len, flags) },
            "cuMemHostRegister",
            || {
                format!(
                    "registering {len} bytes of host memory with device {}",
                    self.ctx.ordinal
                )
            },
        )?;
        match self.device_pointer_of(p.cast()) {
            Ok(d) => Ok(d),
            Err(e) => {
                // SAFETY: registered just above.
                unsafe { sys::cuMemHostUnregister(p.cast()) };
                Err(e)
            }
        }
    }

    fn device_pointer_of(&self, p: *mut std::ffi::c_void) -> Result<sys::CUdeviceptr> {
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: `p` is pinned or registered host memory of this context (callers).
        check(
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, p, 0) },
            "cuMemHostGetDevicePointer",
            || format!("mapping host memory into device {}", self.ctx.ordinal),
        )?;
        Ok(d)
    }

    fn wrap(
        &self,
        kind: MemKind,
        dptr: sys::CUdeviceptr,
        host: *mut u8,
        len: usize,
        owner: Owner,
    ) -> CudaBuffer {
        CudaBuffer {
            ctx: self.ctx.clone(),
            kind,
            dptr,
            host,
            len,
            owner,
        }
    }
}

impl CudaBuffer {
    pub fn kind(&self) -> MemKind {
        self.kind
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address kernels use (for host kinds: the mapped device address).
    pub fn device_address(&self) -> u64 {
        self.dptr
    }

    /// Read-only window `[offset, offset + len)` for a kernel argument.
    pub fn view(&self, offset: usize, len: usize) -> Result<View<'_>> {
        bounds("view", "window", offset, len, self.len)?;
        Ok(View {
            ptr: self.dptr + offset as u64,
            len,
            ctx: Arc::as_ptr(&self.ctx) as usize,
            _b: PhantomData,
        })
    }

    /// The whole buffer, read-only.
    pub fn as_view(&self) -> View<'_> {
        View {
            ptr: self.dptr,
            len: self.len,
            ctx: Arc::as_ptr(&self.ctx) as usize,
            _b: PhantomData,
        }
    }

    /// Writable window `[offset, offset + len)` for a kernel argument.
    pub fn view_mut(&mut self, offset: usize, len: usize) -> Result<ViewMut<'_>> {
        bounds("view_mut", "window", offset, len, self.len)?;
        Ok(ViewMut {
            ptr: self.dptr + offset as u64,
            len,
            ctx: Arc::as_ptr(&self.ctx) as usize,
            _b: PhantomData,
        })
    }

    /// The whole buffer, writable.
    pub fn as_view_mut(&mut self) -> ViewMut<'_> {
        ViewMut {
            ptr: self.dptr,
            len: self.len,
            ctx: Arc::as_ptr(&self.ctx) as usize,
            _b: PhantomData,
        }
    }

    /// Queue a copy of `src` into the buffer at `offset` on the stream, without waiting
    /// (the load pipeline overlaps file reads with these copies).
    ///
    /// # Safety
    /// `src` must stay allocated and unmodified until the copy has completed (an event
    /// recorded after this call completed, or a stream sync).
    pub unsafe fn write_async(&self, offset: usize, src: &[u8]) -> Result<()> {
        bounds("write", "source", offset, src.len(), self.len)?;
        if src.is_empty() {
            return Ok(());
        }
        self.ctx.bind()?;
        // SAFETY: destination range checked above; the caller keeps `src` alive and
        // unmodified until the copy completes.
        check(
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    self.dptr + offset as u64,
                    src.as_ptr().cast(),
                    src.len(),
                    self.ctx.stream,
                )
            },
            "cuMemcpyHtoDAsync",
            || {
                format!(
                    "queueing a copy of {} bytes to a {} buffer",
                    src.len(),
                    self.kind.label()
                )
            },
        )
    }

    /// Copy `src` into the buffer at `offset` and wait for the copy.
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        // SAFETY: `src` stays borrowed until the stream sync below completes the copy.
        unsafe { self.write_async(offset, src)? };
        if src.is_empty() {
            return Ok(());
        }
        self.ctx.sync("a host-to-device copy")
    }

    /// Copy `dst.len()` bytes from `offset` into `dst`, after all queued work.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        bounds("read", "destination", offset, dst.len(), self.len)?;
        if dst.is_empty() {
            return Ok(());
        }
        self.ctx.bind()?;
        // SAFETY: source range checked above; `dst` is exclusively borrowed until the
        // sync below completes the copy.
        check(
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    dst.as_mut_ptr().cast(),
                    self.dptr + offset as u64,
                    dst.len(),
                    self.ctx.stream,
                )
            },
            "cuMemcpyDtoHAsync",
            || {
                format!(
                    "copying {} bytes from a {} buffer",
                    dst.len(),
                    self.kind.label()
                )
            },
        )?;
        self.ctx.sync("a device-to-host copy")
    }

    /// Queue a device-side copy of `len` bytes from `src[src_offset..]` to
    /// `self[offset..]` (no wait).
    pub fn copy_from(
        &mut self,
        offset: usize,
        src: &CudaBuffer,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        bounds("copy_from", "destination", offset, len, self.len)?;
        bounds("copy_from", "source", src_offset, len, src.len)?;
        if !Arc::ptr_eq(&self.ctx, &src.ctx) {
            return Err(GpuError::BadArgument {
                op: "copy_from",
                detail: "buffers belong to different devices".into(),
            });
        }
        self.ctx.bind()?;
        // SAFETY: both ranges checked; both buffers live until the stream drains (drop
        // syncs the stream before freeing).
        check(
            unsafe {
                sys::cuMemcpyDtoDAsync_v2(
                    self.dptr + offset as u64,
                    src.dptr + src_offset as u64,
                    len,
                    self.ctx.stream,
                )
            },
            "cuMemcpyDtoDAsync",
            || format!("copying {len} bytes between buffers"),
        )
    }

    /// Queue a fill of the whole buffer with a 32-bit pattern (len must be a multiple of
    /// 4). NaN poisoning before kernel tests uses this.
    pub fn fill_u32(&mut self, value: u32) -> Result<()> {
        if !self.len.is_multiple_of(4) {
            return Err(GpuError::BadArgument {
                op: "fill_u32",
                detail: format!("buffer of {} bytes is not whole u32 words", self.len),
            });
        }
        self.ctx.bind()?;
        // SAFETY: exactly len/4 words inside the allocation.
        check(
            unsafe { sys::cuMemsetD32Async(self.dptr, value, self.len / 4, self.ctx.stream) },
            "cuMemsetD32Async",
            || format!("filling {} bytes", self.len),
        )
    }

    /// Bytes `offset..offset + len` of a host-resident buffer through its host mapping,
    /// without waiting for the stream; `None` for device memory.
    ///
    /// # Safety
    /// No queued or running device work may access the range (see
    /// [`crate::api::DeviceBuffer::host_range_unsynced`]).
    pub unsafe fn host_range_unsynced(
        &mut self,
        offset: usize,
        len: usize,
    ) -> Result<Option<&mut [u8]>> {
        bounds("host_range", "range", offset, len, self.len)?;
        if self.host.is_null() {
            return Ok(None);
        }
        // SAFETY: inside this buffer's host allocation (checked); `&mut self` makes the
        // slice the only host accessor and the caller guarantees no device access.
        Ok(Some(unsafe {
            std::slice::from_raw_parts_mut(self.host.add(offset), len)
        }))
    }

    /// Queue a copy of `len` bytes from host-resident `src` at `src_off` into this buffer
    /// at `offset`, on the stream, without waiting.
    ///
    /// # Safety
    /// `src`'s range must stay unmodified until the stream has been waited for.
    pub unsafe fn upload_from_host_async(
        &self,
        offset: usize,
        src: &CudaBuffer,
        src_off: usize,
        len: usize,
    ) -> Result<()> {
        bounds("queue_upload", "destination", offset, len, self.len)?;
        bounds("queue_upload", "source", src_off, len, src.len)?;
        if src.host.is_null() {
            return Err(GpuError::BadArgument {
                op: "queue_upload",
                detail: format!("the source is {}, not host memory", src.kind.label()),
            });
        }
        if len == 0 {
            return Ok(());
        }
        self.ctx.bind()?;
        // SAFETY: both ranges checked; the source is page-locked host memory the caller
        // keeps unmodified until the stream is waited for; the destination lives until its
        // drop, which drains the stream first.
        check(
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    self.dptr + offset as u64,
                    src.host.add(src_off).cast(),
                    len,
                    self.ctx.stream,
                )
            },
            "cuMemcpyHtoDAsync",
            || format!("queueing a {len}-byte upload from pinned memory"),
        )
    }

    /// Queue a copy of `len` bytes of this buffer at `offset` into host-resident `dst` at
    /// `dst_off`, on the stream, without waiting.
    ///
    /// # Safety
    /// `dst`'s range must not be read or written from the host until the stream has been
    /// waited for.
    pub unsafe fn download_to_host_async(
        &self,
        offset: usize,
        dst: &CudaBuffer,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        bounds("queue_download", "source", offset, len, self.len)?;
        bounds("queue_download", "destination", dst_off, len, dst.len)?;
        if dst.host.is_null() {
            return Err(GpuError::BadArgument {
                op: "queue_download",
                detail: format!("the destination is {}, not host memory", dst.kind.label()),
            });
        }
        if len == 0 {
            return Ok(());
        }
        self.ctx.bind()?;
        // SAFETY: both ranges checked; the destination is page-locked host memory the
        // caller does not touch until the stream is waited for.
        check(
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    dst.host.add(dst_off).cast(),
                    self.dptr + offset as u64,
                    len,
                    self.ctx.stream,
                )
            },
            "cuMemcpyDtoHAsync",
            || format!("queueing a {len}-byte download into pinned memory"),
        )
    }

    /// Host view of a host-resident buffer (pinned, managed, registered), after waiting
    /// for queued work; `None` for device memory.
    pub fn host_bytes(&self) -> Result<Option<&[u8]>> {
        if self.host.is_null() {
            return Ok(None);
        }
        self.ctx.sync("work touching a host-resident buffer")?;
        // SAFETY: host memory of `len` bytes owned by this buffer; no kernel is running
        // (stream synced) and no writer can exist while &self is borrowed.
        Ok(Some(unsafe {
            std::slice::from_raw_parts(self.host, self.len)
        }))
    }

    /// Mutable host view of a host-resident buffer, after waiting for queued work.
    pub fn host_bytes_mut(&mut self) -> Result<Option<&mut [u8]>> {
        if self.host.is_null() {
            return Ok(None);
        }
        self.ctx.sync("work touching a host-resident buffer")?;
        // SAFETY: as in host_bytes, and &mut self makes this the only accessor.
        Ok(Some(unsafe {
            std::slice::from_raw_parts_mut(self.host, self.len)
        }))
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        // SAFETY: the stream is drained first so no queued kernel or copy still uses the
        // memory; each kind is freed by the call matching its allocation, once. Errors
        // cannot be reported from drop.
        unsafe {
            sys::cuCtxSetCurrent(self.ctx.ctx);
            sys::cuStreamSynchronize(self.ctx.stream);
            match (&self.owner, self.kind) {
                (Owner::Driver, MemKind::PinnedHost) => {
                    sys::cuMemFreeHost(self.host.cast());
                }
                (Owner::Driver, _) => {
                    sys::cuMemFree_v2(self.dptr);
                }
                (Owner::Aligned(layout), _) => {
                    sys::cuMemHostUnregister(self.host.cast());
                    std::alloc::dealloc(self.host, *layout);
                }
                (Owner::External(_), _) => {
                    sys::cuMemHostUnregister(self.host.cast());
                    // The owner box drops after this, with the struct's fields.
                }
            }
        }
    }
}

/// The placement executor's allocator for a CUDA device: it performs exactly the kind
/// the plan names (advice is not applied on CUDA yet; the allocation is still made).
pub struct CudaAllocator<'a> {
    pub device: &'a CudaDevice,
}

impl Allocator for CudaAllocator<'_> {
    type Handle = CudaBuffer;

    fn allocate(
        &mut self,
        kind: MemKind,
        bytes: u64,
        _advice: ManagedAdvice,
    ) -> std::result::Result<CudaBuffer, AllocError> {
        let bytes = usize::try_from(bytes)
            .map_err(|_| AllocError(format!("{bytes} bytes do not fit in memory")))?;
        self.device
            .alloc(kind, bytes)
            .map_err(|e| AllocError(e.to_string()))
    }

    fn free(&mut self, handle: CudaBuffer) {
        drop(handle);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_checks_overflow_and_ends() {
        assert!(bounds("t", "w", 0, 10, 10).is_ok());
        assert!(bounds("t", "w", 1, 10, 10).is_err());
        assert!(bounds("t", "w", usize::MAX, 2, 10).is_err());
        let e = bounds("read", "destination", 8, 4, 10)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("needs 4 bytes at offset 8") && e.contains("has 10"),
            "{e}"
        );
    }
}
