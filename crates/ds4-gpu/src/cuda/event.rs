//! CUDA events on the device's stream, for timing kernels without host clocks.

use std::sync::Arc;

use cudarc::driver::sys;

use super::device::CudaDevice;
use super::driver::{check, Ctx};
use crate::error::Result;

/// A timing event recorded on the device's stream.
pub struct CudaEvent {
    ctx: Arc<Ctx>,
    ev: sys::CUevent,
}

// SAFETY: event handles are thread-agnostic; methods bind the context first.
unsafe impl Send for CudaEvent {}
// SAFETY: the methods take `&self` and only pass the handle to the driver, which
// serialises event calls internally; no Rust-side state is mutated.
unsafe impl Sync for CudaEvent {}

impl CudaDevice {
    pub fn event(&self) -> Result<CudaEvent> {
        self.ctx.bind()?;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: context current; out-pointer is a local.
        check(
            unsafe { sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DEFAULT as u32) },
            "cuEventCreate",
            || "creating a timing event".into(),
        )?;
        Ok(CudaEvent {
            ctx: self.ctx.clone(),
            ev,
        })
    }
}

impl CudaDevice {
    /// An event for ordering only (`CU_EVENT_DISABLE_TIMING`: cheaper to record and query).
    pub fn ordering_event(&self) -> Result<CudaEvent> {
        self.ctx.bind()?;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: context current; out-pointer is a local.
        check(
            unsafe {
                sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
            },
            "cuEventCreate",
            || "creating a copy-ordering event".into(),
        )?;
        Ok(CudaEvent {
            ctx: self.ctx.clone(),
            ev,
        })
    }
}

impl CudaEvent {
    /// Blocks until the work before the event's last record has completed.
    pub fn wait(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: valid event of this context.
        check(
            unsafe { sys::cuEventSynchronize(self.ev) },
            "cuEventSynchronize",
            || "waiting for queued copies".into(),
        )
    }

    /// Whether the work before the event's last record has completed.
    pub fn query(&self) -> Result<bool> {
        self.ctx.bind()?;
        // SAFETY: valid event of this context.
        let r = unsafe { sys::cuEventQuery(self.ev) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check(r, "cuEventQuery", || "polling queued copies".into())?;
        Ok(true)
    }

    /// Record the event at the current end of the stream.
    pub fn record(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: event and stream belong to the bound context.
        check(
            unsafe { sys::cuEventRecord(self.ev, self.ctx.stream) },
            "cuEventRecord",
            || "recording a timing event".into(),
        )
    }

    /// Milliseconds from `self` to `end`, waiting for `end` to complete.
    pub fn elapsed_ms(&self, end: &CudaEvent) -> Result<f32> {
        self.ctx.bind()?;
        // SAFETY: valid event of this context.
        check(
            unsafe { sys::cuEventSynchronize(end.ev) },
            "cuEventSynchronize",
            || "waiting for a timing event (a kernel fault shows here)".into(),
        )?;
        let mut ms = 0f32;
        // SAFETY: both events recorded on this context; out-pointer is a local.
        check(
            unsafe { sys::cuEventElapsedTime(&mut ms, self.ev, end.ev) },
            "cuEventElapsedTime",
            || "reading elapsed time between events".into(),
        )?;
        Ok(ms)
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // SAFETY: destroyed once; pending records complete on their own.
        unsafe {
            sys::cuCtxSetCurrent(self.ctx.ctx);
            sys::cuEventDestroy_v2(self.ev);
        }
    }
}
