//! CUDA backend layer: driver API and NVRTC through cudarc, loaded at run time.
//!
//! Nothing here links against CUDA: on a machine without libcuda/libnvrtc every entry
//! point returns [`crate::GpuError::CudaUnavailable`], so the workspace builds and tests
//! everywhere. `unsafe` is confined to this module (FFI, allocation, launch), each block
//! with a `// SAFETY:` note.

mod api;
mod cublas;
mod device;
mod driver;
mod event;
mod gemv;
mod graph;
mod memory;
mod module;

pub use cublas::{Cublas, GemmPrecision};
pub use device::{CudaDevice, CudaDeviceInfo};
pub use driver::{probe_libraries, CudaLibraries};
pub use event::CudaEvent;
pub use gemv::{GemvKernels, GroupedGemv, GroupedSwiglu};
pub use graph::GraphExec;
pub use memory::{CudaAllocator, CudaBuffer, View, ViewMut};
pub use module::{
    nvrtc_compile, nvrtc_compile_with, nvrtc_version, CudaFunction, CudaModule, FunctionAttrs,
    ModuleOrigin, NVRTC_OPTIONS,
};
