//! Opening a CUDA device and reading the facts the placement planner needs.

use std::sync::Arc;

use cudarc::driver::sys;
use ds4_placement::device::DeviceProbeError;
use ds4_placement::{DeviceCaps, DeviceFacts, DeviceKind, DeviceProbe};

use super::driver::{check, probe_libraries, Ctx};
use crate::error::{GpuError, Result};

/// Everything read from the driver about one device, as plain values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaDeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (9, 0) on the H200.
    pub compute_capability: (i32, i32),
    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    pub driver_version: i32,
    /// CU_DEVICE_ATTRIBUTE_INTEGRATED: the GPU shares the host's memory.
    pub integrated: bool,
    /// CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY.
    pub managed_memory: bool,
    /// CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS (CPU and GPU may touch managed
    /// memory at once; true on GB10 and Linux discrete cards with HMM).
    pub concurrent_managed_access: bool,
    /// CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: kernels can read pinned host memory.
    pub can_map_host_memory: bool,
    /// CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS: kernels can read ordinary malloc'd
    /// memory (HMM/ATS).
    pub pageable_memory_access: bool,
    /// CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED: cuMemHostRegister works.
    pub host_register_supported: bool,
    pub unified_addressing: bool,
    pub multiprocessors: u32,
    pub l2_bytes: u64,
    /// Largest shared memory a block may opt in to.
    pub max_shared_per_block_optin: u64,
    /// cuMemGetInfo at the time of the query.
    pub free_bytes: u64,
    pub total_bytes: u64,
}

impl CudaDeviceInfo {
    /// NVRTC target for this device (`sm_90`).
    pub fn arch(&self) -> String {
        format!(
            "sm_{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }

    /// The planner's view of this device. An integrated GPU whose memory is coherent with
    /// the CPU (pageable access or concurrent managed access: NVIDIA GB10) is
    /// `CoherentUma`; other integrated GPUs are `IntegratedUma`; the rest are discrete.
    pub fn device_facts(&self) -> DeviceFacts {
        let kind = if self.integrated {
            if self.pageable_memory_access || self.concurrent_managed_access {
                DeviceKind::CoherentUma
            } else {
                DeviceKind::IntegratedUma
            }
        } else {
            DeviceKind::Discrete
        };
        DeviceFacts {
            name: self.name.clone(),
            kind,
            pool_total: self.total_bytes,
            pool_free: self.free_bytes,
            carve_out_free: 0,
            caps: DeviceCaps {
                // cuMemHostAlloc is part of every CUDA driver; mapping it needs the
                // attribute, recorded separately below.
                pinned_host: true,
                managed: self.managed_memory,
                host_register: self.host_register_supported,
                host_mapped: self.can_map_host_memory && self.unified_addressing,
                pageable_access: self.pageable_memory_access,
                coarse_grain_advice: false,
                pinned_counts_against_memlock: false,
            },
        }
    }
}

/// An open CUDA device: its primary context, a stream, and its facts.
#[derive(Debug, Clone)]
pub struct CudaDevice {
    pub(crate) ctx: Arc<Ctx>,
    info: CudaDeviceInfo,
}

impl CudaDevice {
    /// Number of CUDA devices, or why there are none (library missing, no device,
    /// driver error).
    pub fn count() -> Result<usize> {
        init()?;
        let mut n = 0i32;
        // SAFETY: init() succeeded, so the driver is loaded and initialised.
        check(
            unsafe { sys::cuDeviceGetCount(&mut n) },
            "cuDeviceGetCount",
            || "counting CUDA devices".into(),
        )?;
        Ok(n.max(0) as usize)
    }

    /// Open device `ordinal`. Fails with [`GpuError::CudaUnavailable`] when libcuda or
    /// libnvrtc cannot be loaded or no device exists, never panics.
    pub fn open(ordinal: usize) -> Result<CudaDevice> {
        let n = Self::count()?;
        if ordinal >= n {
            return Err(GpuError::CudaUnavailable(if n == 0 {
                "the CUDA driver reports no devices".into()
            } else {
                format!("device {ordinal} requested, the driver reports {n}")
            }));
        }
        let ctx = Ctx::open(ordinal)?;
        let info = query_info(&ctx)?;
        Ok(CudaDevice { ctx, info })
    }

    /// Facts read at open time (memory numbers as of then; see [`Self::mem_info`]).
    pub fn info(&self) -> &CudaDeviceInfo {
        &self.info
    }

    /// Current (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(u64, u64)> {
        self.ctx.bind()?;
        mem_get_info(self.ctx.ordinal)
    }

    /// Facts for the planner, with fresh free/total numbers.
    pub fn placement_facts(&self) -> Result<DeviceFacts> {
        let (free, total) = self.mem_info()?;
        let mut info = self.info.clone();
        info.free_bytes = free;
        info.total_bytes = total;
        Ok(info.device_facts())
    }

    /// Wait until all queued work has finished, surfacing any asynchronous kernel fault.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.sync("queued work")
    }
}

impl DeviceProbe for CudaDevice {
    fn device_facts(&self) -> std::result::Result<DeviceFacts, DeviceProbeError> {
        self.placement_facts().map_err(|e| DeviceProbeError {
            what: "cuMemGetInfo",
            detail: e.to_string(),
        })
    }
}

/// Load and initialise the driver, after checking both libraries are loadable.
fn init() -> Result<()> {
    let libs = probe_libraries();
    if !libs.driver {
        return Err(GpuError::CudaUnavailable(
            "the CUDA driver library (libcuda.so) cannot be loaded: no NVIDIA driver is installed \
             or it is not on the loader path"
                .into(),
        ));
    }
    if !libs.nvrtc {
        return Err(GpuError::CudaUnavailable(
            "the NVRTC library (libnvrtc.so) cannot be loaded: install the CUDA toolkit's NVRTC \
             (or add its lib directory to LD_LIBRARY_PATH); ds4 compiles its kernels at run time"
                .into(),
        ));
    }
    // SAFETY: the driver library is present (probed above); cuInit is idempotent.
    let res = unsafe { sys::cuInit(0) };
    if res == sys::CUresult::CUDA_ERROR_NO_DEVICE {
        return Err(GpuError::CudaUnavailable(
            "the CUDA driver is installed but reports no device".into(),
        ));
    }
    check(res, "cuInit", || "initialising the CUDA driver".into())
}

pub(crate) fn mem_get_info(ordinal: usize) -> Result<(u64, u64)> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: the caller bound a context of this device; out-pointers are locals.
    check(
        unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
        "cuMemGetInfo",
        || format!("reading free memory of device {ordinal}"),
    )?;
    Ok((free as u64, total as u64))
}

fn attr(ctx: &Ctx, a: sys::CUdevice_attribute, name: &'static str) -> Result<i32> {
    let mut v = 0i32;
    // SAFETY: `ctx.device` is a valid device handle; out-pointer is a local.
    check(
        unsafe { sys::cuDeviceGetAttribute(&mut v, a, ctx.device) },
        "cuDeviceGetAttribute",
        || format!("reading {name} of device {}", ctx.ordinal),
    )?;
    Ok(v)
}

fn query_info(ctx: &Ctx) -> Result<CudaDeviceInfo> {
    use sys::CUdevice_attribute as A;
    ctx.bind()?;
    let mut name = [0 as std::ffi::c_char; 256];
    // SAFETY: the buffer holds 256 bytes and we pass 255 so the result stays
    // NUL-terminated (the array starts zeroed).
    check(
        unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), 255, ctx.device) },
        "cuDeviceGetName",
        || format!("reading the name of device {}", ctx.ordinal),
    )?;
    // SAFETY: NUL-terminated within the array (see above).
    let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let mut driver_version = 0i32;
    // SAFETY: out-pointer is a local.
    check(
        unsafe { sys::cuDriverGetVersion(&mut driver_version) },
        "cuDriverGetVersion",
        || "reading the driver version".into(),
    )?;
    let flag = |a, n| attr(ctx, a, n).map(|v| v != 0);
    let (free_bytes, total_bytes) = mem_get_info(ctx.ordinal)?;
    Ok(CudaDeviceInfo {
        ordinal: ctx.ordinal,
        name,
        compute_capability: (
            attr(
                ctx,
                A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                "compute capability",
            )?,
            attr(
                ctx,
                A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                "compute capability",
            )?,
        ),
        driver_version,
        integrated: flag(A::CU_DEVICE_ATTRIBUTE_INTEGRATED, "integrated")?,
        managed_memory: flag(A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, "managed memory")?,
        concurrent_managed_access: flag(
            A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS,
            "concurrent managed access",
        )?,
        can_map_host_memory: flag(
            A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY,
            "can map host memory",
        )?,
        pageable_memory_access: flag(
            A::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS,
            "pageable memory access",
        )?,
        host_register_supported: flag(
            A::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED,
            "host register supported",
        )?,
        unified_addressing: flag(
            A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING,
            "unified addressing",
        )?,
        multiprocessors: attr(
            ctx,
            A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            "multiprocessors",
        )?
        .max(0) as u32,
        l2_bytes: attr(ctx, A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, "L2 size")?.max(0) as u64,
        max_shared_per_block_optin: attr(
            ctx,
            A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            "shared memory per block",
        )?
        .max(0) as u64,
        free_bytes,
        total_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h200() -> CudaDeviceInfo {
        CudaDeviceInfo {
            ordinal: 0,
            name: "NVIDIA H200".into(),
            compute_capability: (9, 0),
            driver_version: 13000,
            integrated: false,
            managed_memory: true,
            concurrent_managed_access: true,
            can_map_host_memory: true,
            pageable_memory_access: false,
            host_register_supported: true,
            unified_addressing: true,
            multiprocessors: 132,
            l2_bytes: 60 << 20,
            max_shared_per_block_optin: 227 << 10,
            free_bytes: 139 << 30,
            total_bytes: 140 << 30,
        }
    }

    #[test]
    fn discrete_card_facts() {
        let f = h200().device_facts();
        assert_eq!(f.kind, DeviceKind::Discrete);
        assert_eq!(f.pool_free, 139 << 30);
        assert!(f.caps.managed && f.caps.host_mapped && f.caps.host_register);
        assert!(!f.caps.pageable_access);
        assert_eq!(h200().arch(), "sm_90");
    }

    #[test]
    fn integrated_devices_are_classified_by_coherence() {
        let mut gb10 = h200();
        gb10.integrated = true;
        gb10.pageable_memory_access = true;
        gb10.host_register_supported = false;
        let f = gb10.device_facts();
        assert_eq!(f.kind, DeviceKind::CoherentUma);
        assert!(!f.caps.host_register && f.caps.pageable_access);
        let mut jetson = h200();
        jetson.integrated = true;
        jetson.concurrent_managed_access = false;
        assert_eq!(jetson.device_facts().kind, DeviceKind::IntegratedUma);
    }

    #[test]
    fn mapping_needs_unified_addressing() {
        let mut d = h200();
        d.unified_addressing = false;
        assert!(!d.device_facts().caps.host_mapped);
    }

    #[test]
    fn open_without_cuda_is_an_error_not_a_panic() {
        // On machines without libcuda (CI) this must return CudaUnavailable; where CUDA
        // exists it opens device 0 or reports a real driver error. Either way no panic.
        match CudaDevice::open(0) {
            Ok(d) => assert!(!d.info().name.is_empty()),
            Err(e) => {
                let libs = probe_libraries();
                if !libs.driver || !libs.nvrtc {
                    assert!(matches!(e, GpuError::CudaUnavailable(_)), "{e}");
                    assert!(e.to_string().contains("cannot be loaded"), "{e}");
                }
            }
        }
    }
}
