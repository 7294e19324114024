//! The FFI boundary to the CUDA driver: library probing, result checking with context, and
//! the shared context (primary context + the stream all work is queued on).
//!
//! `unsafe` lives in this module and its siblings under `cuda/` only; each block says
//! why it is sound.

use std::ffi::{c_char, CStr};
use std::sync::Arc;

use cudarc::driver::sys;

use crate::error::{GpuError, Result};

/// Whether the CUDA driver and NVRTC libraries can be loaded here. cudarc panics on the
/// first call into a library it cannot load, so this runs before anything else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaLibraries {
    pub driver: bool,
    pub nvrtc: bool,
}

/// Probe for libcuda and libnvrtc without calling into them.
pub fn probe_libraries() -> CudaLibraries {
    // SAFETY: both functions only try `dlopen` on a list of library names and drop the
    // handles; they call no CUDA function and touch no global state of ours.
    unsafe {
        CudaLibraries {
            driver: sys::is_culib_present(),
            nvrtc: cudarc::nvrtc::sys::is_culib_present(),
        }
    }
}

/// `CUDA_ERROR_OUT_OF_MEMORY (out of memory)`, or the raw number if the driver cannot
/// name it.
pub(crate) fn error_text(res: sys::CUresult) -> String {
    let mut name: *const c_char = std::ptr::null();
    let mut desc: *const c_char = std::ptr::null();
    // SAFETY: only called after the driver library was probed present (every caller
    // holds a `Ctx` or is inside `CudaDevice::open` after the probe). The driver writes a
    // pointer to a static string or leaves the out-parameter untouched on failure.
    let (rn, rd) = unsafe {
        (
            sys::cuGetErrorName(res, &mut name),
            sys::cuGetErrorString(res, &mut desc),
        )
    };
    let read = |ok: sys::CUresult, p: *const c_char| -> Option<String> {
        if ok != sys::CUresult::CUDA_SUCCESS || p.is_null() {
            return None;
        }
        // SAFETY: the driver returned a non-null pointer to a NUL-terminated static string.
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    match (read(rn, name), read(rd, desc)) {
        (Some(n), Some(d)) => format!("{n} ({d})"),
        (Some(n), None) => n,
        _ => format!("CUresult {}", res as i32),
    }
}

/// Turn a driver result into `Ok` or an error naming the call and what it was doing.
pub(crate) fn check(
    res: sys::CUresult,
    call: &'static str,
    context: impl FnOnce() -> String,
) -> Result<()> {
    if res == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Cuda {
            call,
            context: context(),
            code: error_text(res),
        })
    }
}

/// The device's primary context and the one stream all of this crate's work goes to.
/// Everything that owns device resources (buffers, modules, events) holds an
/// `Arc<Ctx>`, so the context outlives them and is released last.
#[derive(Debug)]
pub(crate) struct Ctx {
    pub(crate) device: sys::CUdevice,
    pub(crate) ordinal: usize,
    pub(crate) ctx: sys::CUcontext,
    pub(crate) stream: sys::CUstream,
    /// Kernels are launched with programmatic stream serialization (sm_90 and later): see
    /// `kernels/ds4_port.h`'s `ds4_grid_wait` and docs/gpu.md §6.
    pub(crate) pdl: bool,
    /// Overlap for the launches queued now (the backend's choice per forward pass); only
    /// used where `pdl` is on.
    pub(crate) pdl_now: std::sync::atomic::AtomicBool,
}

// SAFETY: CUDA contexts and streams are usable from any thread once made current there;
// every method that calls the driver first calls `bind()` on its own thread.
unsafe impl Send for Ctx {}
// SAFETY: as above; the driver API is thread-safe for these handles.
unsafe impl Sync for Ctx {}

impl Ctx {
    /// Retain the primary context of `ordinal` and create a non-blocking stream on it.
    pub(crate) fn open(ordinal: usize) -> Result<Arc<Ctx>> {
        let ord = i32::try_from(ordinal).map_err(|_| GpuError::BadArgument {
            op: "open CUDA device",
            detail: format!("device ordinal {ordinal} is out of range"),
        })?;
        let mut device: sys::CUdevice = 0;
        // SAFETY: the caller probed the driver library; out-pointer is a valid local.
        check(
            unsafe { sys::cuDeviceGet(&mut device, ord) },
            "cuDeviceGet",
            || format!("opening CUDA device {ordinal}"),
        )?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `device` is a valid handle from cuDeviceGet; out-pointer is a local.
        check(
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, device) },
            "cuDevicePrimaryCtxRetain",
            || format!("retaining the primary context of device {ordinal}"),
        )?;
        // From here on, a failure must release the retained context.
        let release = |e: GpuError| {
            // SAFETY: balances the successful retain above.
            unsafe { sys::cuDevicePrimaryCtxRelease_v2(device) };
            e
        };
        // SAFETY: `ctx` was just retained and is valid.
        check(
            unsafe { sys::cuCtxSetCurrent(ctx) },
            "cuCtxSetCurrent",
            || format!("making device {ordinal}'s context current"),
        )
        .map_err(release)?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: a context is current; out-pointer is a local.
        check(
            unsafe {
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                )
            },
            "cuStreamCreate",
            || format!("creating a stream on device {ordinal}"),
        )
        .map_err(release)?;
        let mut major = 0;
        // SAFETY: valid device handle; out-pointer is a local.
        check(
            unsafe {
                sys::cuDeviceGetAttribute(
                    &mut major,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                    device,
                )
            },
            "cuDeviceGetAttribute",
            || format!("reading device {ordinal}'s compute capability"),
        )
        .map_err(release)?;
        // Overlapped launches (docs/gpu.md §6) need sm_90's grid dependency control.
        let pdl = major >= 9;
        Ok(Arc::new(Ctx {
            device,
            ordinal,
            ctx,
            stream,
            pdl,
            pdl_now: std::sync::atomic::AtomicBool::new(true),
        }))
    }

    /// Make this context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        // SAFETY: `self.ctx` is retained for the lifetime of `self`.
        check(
            unsafe { sys::cuCtxSetCurrent(self.ctx) },
            "cuCtxSetCurrent",
            || format!("binding device {}'s context to this thread", self.ordinal),
        )
    }

    /// Wait for all work queued on the stream.
    pub(crate) fn sync(&self, what: &str) -> Result<()> {
        self.bind()?;
        // SAFETY: the stream belongs to this context, which is current.
        check(
            unsafe { sys::cuStreamSynchronize(self.stream) },
            "cuStreamSynchronize",
            || format!("waiting for {what} on device {}", self.ordinal),
        )
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: last owner: no buffer, module or event of this context is alive (they
        // hold Arcs). Errors cannot be reported from drop and leave nothing to clean up.
        unsafe {
            sys::cuCtxSetCurrent(self.ctx);
            sys::cuStreamSynchronize(self.stream);
            sys::cuStreamDestroy_v2(self.stream);
            sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}
