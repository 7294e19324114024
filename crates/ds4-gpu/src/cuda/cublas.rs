//! cuBLAS SGEMM for the prefill matmuls, loaded at run time with libloading.
//!
//! Why not cudarc's cuBLAS module: its dynamic loader looks for the library names of the
//! CUDA version it was built for, while the machines here ship cuBLAS 13 (toolkit) or the
//! copy inside PyTorch's wheels. The C entry points used here have had the same ABI
//! since CUDA 10, so they are resolved directly from whichever `libcublas` is found.
//! Absent cuBLAS is not an error: the backend then uses its own tiled GEMM kernel.

use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::sync::Arc;

use super::device::CudaDevice;
use super::driver::Ctx;
use crate::error::{GpuError, Result};

type Handle = *mut c_void;
type CreateFn = unsafe extern "C" fn(*mut Handle) -> c_int;
type DestroyFn = unsafe extern "C" fn(Handle) -> c_int;
type SetStreamFn = unsafe extern "C" fn(Handle, *mut c_void) -> c_int;
type SetMathFn = unsafe extern "C" fn(Handle, c_int) -> c_int;
#[allow(clippy::type_complexity)]
type SgemmFn = unsafe extern "C" fn(
    Handle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const f32,
    *const f32,
    c_int,
    *const f32,
    c_int,
    *const f32,
    *mut f32,
    c_int,
) -> c_int;

const OP_N: c_int = 0;
const OP_T: c_int = 1;
/// `CUBLAS_PEDANTIC_MATH`: true f32 (no TF32), for parity with the CPU reference.
const PEDANTIC_MATH: c_int = 2;
/// `CUBLAS_TF32_TENSOR_OP_MATH`: f32 in and out, TF32 tensor cores inside.
const TF32_MATH: c_int = 3;

/// Precision of the prefill GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmPrecision {
    /// Plain f32 (matches the CPU reference to ~1e-6).
    F32,
    /// TF32 tensor cores: f32 operands rounded to 10-bit mantissas (~1e-3 relative).
    Tf32,
}

/// A cuBLAS handle bound to one device's stream.
pub struct Cublas {
    _lib: libloading::Library,
    handle: Handle,
    destroy: DestroyFn,
    sgemm: SgemmFn,
    ctx: Arc<Ctx>,
    pub path: PathBuf,
}

// SAFETY: the handle is used only through &self methods that bind the context first; cuBLAS
// handles may be used from any thread as long as calls are not concurrent, which the
// backend's &mut access guarantees.
unsafe impl Send for Cublas {}

fn candidates() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = Vec::new();
    if let Ok(p) = std::env::var("DS4_CUBLAS") {
        v.push(p.into());
    }
    for name in ["libcublas.so.13", "libcublas.so.12", "libcublas.so"] {
        v.push(name.into());
        v.push(PathBuf::from("/usr/local/cuda/lib64").join(name));
    }
    // PyTorch's wheels (nvidia-cublas-cu12/13) on machines with no system toolkit.
    for base in ["/usr/local/lib", "/usr/lib"] {
        if let Ok(rd) = std::fs::read_dir(base) {
            for e in rd.flatten() {
                let sp = e.path().join("dist-packages/nvidia/cublas/lib");
                let sp2 = e.path().join("site-packages/nvidia/cublas/lib");
                for d in [sp, sp2] {
                    for name in ["libcublas.so.13", "libcublas.so.12"] {
                        v.push(d.join(name));
                    }
                }
            }
        }
    }
    v
}

impl Cublas {
    /// Loads cuBLAS and creates a handle on `dev`'s stream.
    pub fn load(dev: &CudaDevice, precision: GemmPrecision) -> Result<Cublas> {
        let mut last = String::from("no candidate");
        for c in candidates() {
            // SAFETY: loading a shared library runs its initialisers; libcublas has no
            // initialisers with preconditions.
            let lib = match unsafe { libloading::Library::new(&c) } {
                Ok(l) => l,
                Err(e) => {
                    last = e.to_string();
                    continue;
                }
            };
            // SAFETY: symbol types match the cuBLAS v2 C API declarations.
            let syms = unsafe {
                (
                    lib.get::<CreateFn>(b"cublasCreate_v2\0").map(|s| *s),
                    lib.get::<DestroyFn>(b"cublasDestroy_v2\0").map(|s| *s),
                    lib.get::<SetStreamFn>(b"cublasSetStream_v2\0").map(|s| *s),
                    lib.get::<SetMathFn>(b"cublasSetMathMode\0").map(|s| *s),
                    lib.get::<SgemmFn>(b"cublasSgemm_v2\0").map(|s| *s),
                )
            };
            let (Ok(create), Ok(destroy), Ok(set_stream), Ok(set_math), Ok(sgemm)) = syms else {
                last = format!("{} lacks the cuBLAS v2 entry points", c.display());
                continue;
            };
            let ctx = dev.ctx.clone();
            ctx.bind()?;
            let mut handle: Handle = std::ptr::null_mut();
            // SAFETY: out-pointer to a local; the device's context is current.
            let st = unsafe { create(&mut handle) };
            if st != 0 {
                return Err(GpuError::Cuda {
                    call: "cublasCreate",
                    context: format!("creating a cuBLAS handle from {}", c.display()),
                    code: format!("status {st}"),
                });
            }
            let math = match precision {
                GemmPrecision::F32 => PEDANTIC_MATH,
                GemmPrecision::Tf32 => TF32_MATH,
            };
            // SAFETY: valid handle; the stream belongs to the current context.
            let (s1, s2) = unsafe {
                (
                    set_stream(handle, ctx.stream.cast()),
                    set_math(handle, math),
                )
            };
            if s1 != 0 || s2 != 0 {
                // SAFETY: handle created above, destroyed once.
                unsafe { destroy(handle) };
                return Err(GpuError::Cuda {
                    call: "cublasSetStream/SetMathMode",
                    context: "configuring the cuBLAS handle".into(),
                    code: format!("status {s1}/{s2}"),
                });
            }
            return Ok(Cublas {
                _lib: lib,
                handle,
                destroy,
                sgemm,
                ctx,
                path: c,
            });
        }
        Err(GpuError::CudaUnavailable(format!(
            "cuBLAS not found ({last})"
        )))
    }

    /// Queues `Y[t][r] = Σ_c X[t][c] · W[r][c]` for `t < n_tok`, `r < n_rows` (row-major
    /// X with row stride `x_stride`, W with `w_stride`, Y with `y_stride`, all f32 on the
    /// device).
    ///
    /// # Safety
    /// The three device addresses must hold the addressed rows (n_tok rows of X, n_rows
    /// rows of W, n_tok rows of Y, with the given strides) for the kernel's duration.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn gemm_nt(
        &self,
        x: u64,
        x_stride: usize,
        w: u64,
        w_stride: usize,
        y: u64,
        y_stride: usize,
        n_tok: usize,
        n_rows: usize,
        k: usize,
    ) -> Result<()> {
        let i = |v: usize, what: &str| -> Result<c_int> {
            c_int::try_from(v).map_err(|_| GpuError::BadArgument {
                op: "cublas gemm",
                detail: format!("{what} = {v} exceeds cuBLAS's int range"),
            })
        };
        self.ctx.bind()?;
        let (one, zero) = (1f32, 0f32);
        // Column-major view: Yc (n_rows × n_tok, ld y_stride) = Wc^T (n_rows × k) · Xc (k × n_tok).
        // SAFETY: per this function's contract; alpha/beta are host scalars (default
        // pointer mode) that live across the call.
        let st = unsafe {
            (self.sgemm)(
                self.handle,
                OP_T,
                OP_N,
                i(n_rows, "rows")?,
                i(n_tok, "tokens")?,
                i(k, "k")?,
                &one,
                w as *const f32,
                i(w_stride, "w stride")?,
                x as *const f32,
                i(x_stride, "x stride")?,
                &zero,
                y as *mut f32,
                i(y_stride, "y stride")?,
            )
        };
        if st != 0 {
            return Err(GpuError::Cuda {
                call: "cublasSgemm",
                context: format!("{n_tok}x{n_rows}x{k} GEMM"),
                code: format!("status {st}"),
            });
        }
        Ok(())
    }
}

impl Drop for Cublas {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: the handle was created by this object and is destroyed once.
        unsafe { (self.destroy)(self.handle) };
    }
}
