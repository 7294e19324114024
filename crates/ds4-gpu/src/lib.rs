//! GPU layer of ds4-rs, underneath the engine's op-level backend.
//!
//! * [`kernels`]: the one kernel source tree (`kernels/*.cu`, CUDA dialect plus
//!   `ds4_port.h`), embedded at build time, and each kernel's host-side contract.
//! * [`cache`]: compiled images on disk, keyed by source hash, architecture, driver and
//!   compiler versions.
//! * [`cuda`]: CUDA through cudarc's driver + NVRTC bindings, loaded at run time:
//!   device facts for the placement planner, allocators for every placement kind,
//!   module loading, GEMV launches.
//! * [`hip`]: ROCm/HIP: `libamdhip64` / `libhiprtc` loaded with libloading, allocation
//!   with ds4's integrated-GPU policy, hiprtc modules cached on disk, launches; a fake
//!   runtime for tests.
//! * [`api`]: [`api::GpuApi`], the runtime interface the engine backend runs on (CUDA and
//!   HIP implement it).
//!
//! No function here panics because a GPU library is missing; all report
//! [`GpuError`] instead.

pub mod api;
pub mod backend;
pub mod cache;
pub mod cuda;
pub mod emu;
pub mod error;
pub mod hip;
pub mod kernels;
pub mod loader;
pub mod tables;

pub use cache::KernelCache;
pub use error::{GpuError, Result};
pub use kernels::{GemvConfig, GemvLaunch, GemvType, KernelSource};
