//! Kernel launches with typed arguments: the one place the backend passes raw parameter
//! lists to the driver.

use std::ffi::c_void;

use ds4_engine::backend::{BResult, BackendError};

use super::{gerr, GpuBackend};
use crate::api::GpuApi;

/// One kernel parameter. Device pointers and 64-bit sizes are 8 bytes, `int`/`float` 4.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    Ptr(u64),
    U64(u64),
    I32(i32),
    F32(f32),
}

/// Threads per block of the grid-stride kernels.
const STRIDE_THREADS: u32 = 256;

impl<D: GpuApi> GpuBackend<D> {
    /// Queues `name` with `args` in the kernel's parameter order.
    ///
    /// Callers (the op methods) have checked every pointer argument against the buffer it
    /// came from and every count against the shapes, as each kernel's contract in
    /// `kernels/*.cu` requires.
    pub(crate) fn launch(
        &self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> BResult<()> {
        self.launch_fn(self.kernel(name)?, name, grid, block, args)
    }

    /// [`Self::launch`] with `smem` bytes of dynamic shared memory (at most
    /// `GpuApi::max_dynamic_smem`, checked by the caller's choice of kernel).
    pub(crate) fn launch_smem(
        &self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> BResult<()> {
        self.launch_params(self.kernel(name)?, name, grid, (block, smem), args, None)
    }

    fn kernel(&self, name: &'static str) -> BResult<&D::Function> {
        self.funcs.get(name).ok_or(BackendError::Invalid {
            op: "launch",
            problem: format!("kernel {name} is not loaded"),
        })
    }

    /// [`Self::launch`] of a kernel that also takes a struct by value: its bytes, `blob`
    /// (laid out as the kernel's struct, 8-byte aligned), are parameter number `blob_at`.
    pub(crate) fn launch_blob(
        &self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
        blob_at: usize,
        blob: &[u64],
    ) -> BResult<()> {
        self.launch_blob_smem(name, grid, block, 0, args, blob_at, blob)
    }

    /// [`Self::launch_blob`] with `smem` bytes of dynamic shared memory.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_blob_smem(
        &self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
        blob_at: usize,
        blob: &[u64],
    ) -> BResult<()> {
        self.launch_params(
            self.kernel(name)?,
            name,
            grid,
            (block, smem),
            args,
            Some((blob_at, blob)),
        )
    }

    pub(crate) fn launch_fn(
        &self,
        f: &D::Function,
        name: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> BResult<()> {
        self.launch_fn_smem(f, name, grid, (block, 0), args)
    }

    /// [`Self::launch_fn`] with `smem` bytes of dynamic shared memory.
    pub(crate) fn launch_fn_smem(
        &self,
        f: &D::Function,
        name: &'static str,
        grid: (u32, u32, u32),
        (block, smem): (u32, u32),
        args: &[Arg],
    ) -> BResult<()> {
        self.launch_params(f, name, grid, (block, smem), args, None)
    }

    fn launch_params(
        &self,
        f: &D::Function,
        name: &'static str,
        grid: (u32, u32, u32),
        (block, smem): (u32, u32),
        args: &[Arg],
        blob: Option<(usize, &[u64])>,
    ) -> BResult<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        // Each value lives in its own 8-byte slot; the driver copies as many bytes as the
        // kernel's parameter has, and on little-endian x86-64/arm64 the low bytes of the
        // slot are the 4-byte value.
        let mut store: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(p) | Arg::U64(p) => p,
                Arg::I32(v) => u64::from(v as u32),
                Arg::F32(v) => u64::from(v.to_bits()),
            })
            .collect();
        let mut params: Vec<*mut c_void> = store
            .iter_mut()
            .map(|v| (v as *mut u64).cast::<c_void>())
            .collect();
        // The driver reads the struct's size in bytes from this pointer; `blob_store`
        // outlives the call like `store`.
        let mut blob_store: Vec<u64> = blob.map(|(_, b)| b.to_vec()).unwrap_or_default();
        if let Some((at, _)) = blob {
            params.insert(at, blob_store.as_mut_ptr().cast::<c_void>());
        }
        self.mark_launch(name)?;
        self.launches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let t0 = self.profile.as_ref().map(|_| {
            let _ = self.dev.synchronize();
            std::time::Instant::now()
        });
        // SAFETY: `args` follow the kernel's parameter list (types and order), and the op
        // methods checked every pointer and count against live buffers of this device
        // before calling (see the launch contract above), a blob is the kernel's struct
        // parameter at its place; `store` and `blob_store` outlive the call.
        unsafe { self.dev.launch_smem(f, grid, block, smem, &mut params) }.map_err(gerr(name))?;
        if let (Some(p), Some(t0)) = (&self.profile, t0) {
            let _ = self.dev.synchronize();
            let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
            let e = p.entry(name).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += t0.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// A grid-stride kernel over `n` elements whose first parameters are `args` followed
    /// by the element count (u64), except where the kernel takes the count elsewhere:
    /// `args` then already holds it and `n` only sizes the grid.
    pub(crate) fn elementwise(&self, name: &'static str, n: usize, args: &[Arg]) -> BResult<()> {
        if n == 0 {
            return Ok(());
        }
        let mut a = args.to_vec();
        // ds4_fill(p, n, v) takes the count in the middle: the caller passes a placeholder.
        if name == "ds4_fill" {
            a[1] = Arg::U64(n as u64);
        } else {
            a.push(Arg::U64(n as u64));
        }
        self.launch(name, (grid_for(n), 1, 1), STRIDE_THREADS, &a)
    }
}

/// Blocks for a grid-stride loop over `n` elements.
pub(crate) fn grid_for(n: usize) -> u32 {
    (n.div_ceil(STRIDE_THREADS as usize)).clamp(1, 1 << 16) as u32
}
