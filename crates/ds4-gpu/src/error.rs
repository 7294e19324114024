//! Errors of the GPU layer. Every variant names the call or input that failed and carries
//! enough context (sizes, kernel, device) to act on without a debugger.

use std::path::PathBuf;

/// Why a GPU operation failed.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The CUDA driver or NVRTC library cannot be loaded on this machine (no NVIDIA
    /// driver, CI, a CPU-only box). Never a panic: callers fall back to the CPU.
    #[error("CUDA is not available: {0}")]
    CudaUnavailable(String),
    /// A CUDA driver call returned an error.
    #[error("{call} failed while {context}: {code}")]
    Cuda {
        call: &'static str,
        context: String,
        code: String,
    },
    /// An NVRTC call other than the compile itself failed.
    #[error("NVRTC {call} failed for {kernel}: {code}")]
    Nvrtc {
        call: &'static str,
        kernel: String,
        code: String,
    },
    /// NVRTC or hiprtc rejected a kernel source; `log` is the compiler's own output.
    #[error("compiling {kernel} for {arch} failed:\n{log}")]
    Compile {
        kernel: String,
        arch: String,
        log: String,
    },
    /// A managed allocation larger than the device's free memory was refused up front:
    /// oversubscribing managed memory can hang an NVIDIA GPU, not just this process.
    #[error(
        "managed allocation of {requested} bytes refused: the device has only {free} bytes free"
    )]
    ManagedTooLarge { requested: u64, free: u64 },
    /// The device does not support the requested memory kind.
    #[error("{kind} memory is not supported by {device}")]
    KindUnsupported { kind: &'static str, device: String },
    /// A kernel argument does not fit the kernel's contract (shape, alignment, type).
    #[error("{op}: {detail}")]
    BadArgument { op: &'static str, detail: String },
    /// A buffer or view is too small or misaligned for the requested operation.
    #[error("{op}: {what} needs {needed} bytes at offset {offset}, the buffer has {len}")]
    OutOfBounds {
        op: &'static str,
        what: &'static str,
        needed: u64,
        offset: u64,
        len: u64,
    },
    /// Reading or writing the on-disk kernel cache failed.
    #[error("kernel cache {path}: {source}")]
    Cache {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The HIP runtime or hiprtc cannot be loaded.
    #[error("ROCm is not available: {0}")]
    HipUnavailable(String),
    /// The HIP runtime loaded but reports no usable device.
    #[error("no ROCm device: {0}")]
    NoHipDevice(String),
    /// ds4's host admission refused an allocation: pinning it would leave the OS less than
    /// its reserve (usable = MemAvailable − CmaFree, read live before each allocation).
    #[error("{kind} allocation of {requested_mib} MiB not admitted: {usable_gib:.2} GiB usable host memory after excluding CMA, {reserve_gib:.2} GiB OS reserve")]
    NotAdmitted {
        kind: &'static str,
        requested_mib: u64,
        usable_gib: f64,
        reserve_gib: f64,
    },
    /// Usable host memory could not be read (ds4 refuses host allocations then).
    #[error("cannot read usable host memory: {0}")]
    HostMemoryUnknown(String),
    /// A HIP runtime or hiprtc call returned an error.
    #[error("{call} failed while {context}: {code}")]
    Hip {
        call: &'static str,
        context: String,
        code: String,
    },
}

pub type Result<T, E = GpuError> = std::result::Result<T, E>;
