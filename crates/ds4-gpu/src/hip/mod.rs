//! ROCm/HIP groundwork: the HIP runtime and hiprtc loaded at run time with libloading.
//!
//! Search order for each library: `$ROCM_PATH/lib` (default `/opt/rocm/lib`), then the
//! system loader path, trying the development name (`libamdhip64.so`) and then the
//! versioned runtime names (`.so.7`, `.so.6`, `.so.5`) because runtime-only installs ship
//! no unversioned symlink. ROCm 5.2 (Debian 12) has no separate `libhiprtc`: its hiprtc
//! entry points live in `libamdhip64`, which is used as the fallback.
//!
//! Device attributes are read with `hipDeviceGetAttribute` and the numeric values of
//! `hipDeviceAttribute_t`'s CUDA-compatible range (stable since ROCm 5). The GPU
//! architecture name (`gfx1151`) is read from the KFD topology in sysfs, which does not
//! depend on the version-specific layout of `hipDeviceProp_t`.
//!
//! Verified here without AMD hardware: loading, "no device" reporting and hiprtc
//! compiles of the kernel tree (ROCm 5.2's hiprtc, gfx1030). The allocation, module and
//! launch layer ([`device`]) runs on the [`HipCalls`] function table: the real runtime
//! here, or [`fake::FakeHip`] in tests (Strix Halo profiles, fault injection).

pub mod device;
pub mod fake;

pub use device::{HipAllocator, HipBuffer, HipDevice, HipFunction, HipModule, HostMemory};

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};

use ds4_placement::{DeviceCaps, DeviceFacts, DeviceKind};

use crate::error::{GpuError, Result};
use crate::kernels::KernelSource;

/// `hipDeviceAttribute_t` values used here (CUDA-compatible range, same in ROCm 5.x–7.x).
mod attr {
    pub const CAN_MAP_HOST_MEMORY: i32 = 3;
    pub const CONCURRENT_MANAGED_ACCESS: i32 = 9;
    pub const INTEGRATED: i32 = 16;
    pub const MANAGED_MEMORY: i32 = 24;
    pub const MULTIPROCESSOR_COUNT: i32 = 63;
    pub const PAGEABLE_MEMORY_ACCESS: i32 = 65;
    pub const WARP_SIZE: i32 = 87;
}

const HIP_SUCCESS: c_int = 0;
const HIP_ERROR_NO_DEVICE: c_int = 100;
const HIP_ERROR_INSUFFICIENT_DRIVER: c_int = 35;

/// Candidate paths for a ROCm library, in search order.
pub fn library_candidates(rocm_path: Option<&Path>, stem: &str) -> Vec<PathBuf> {
    let root = rocm_path
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("/opt/rocm"));
    let names: Vec<String> = std::iter::once(format!("lib{stem}.so"))
        .chain(["7", "6", "5"].iter().map(|v| format!("lib{stem}.so.{v}")))
        .collect();
    let mut out: Vec<PathBuf> = names.iter().map(|n| root.join("lib").join(n)).collect();
    out.extend(names.iter().map(PathBuf::from));
    out
}

/// Open the first loadable candidate, or report every path tried.
pub(crate) fn open_first(cands: &[PathBuf], what: &str) -> Result<(libloading::Library, PathBuf)> {
    let mut tried = Vec::new();
    for c in cands {
        // SAFETY: loading a shared library runs its initialisers; the ROCm libraries'
        // initialisers only set up their own state.
        match unsafe { libloading::Library::new(c) } {
            Ok(lib) => return Ok((lib, c.clone())),
            Err(e) => tried.push(format!("{}: {e}", c.display())),
        }
    }
    Err(GpuError::HipUnavailable(format!(
        "{what} not found; tried {}",
        tried.join("; ")
    )))
}

/// `gfx_target_version` from the KFD topology (major·10000 + minor·100 + stepping) as the
/// LLVM target name: 110501 → `gfx1151`, 90010 → `gfx90a`, 100300 → `gfx1030`.
pub fn gfx_name_from_target_version(v: u32) -> Option<String> {
    if v == 0 {
        return None;
    }
    let (major, minor, step) = (v / 10000, (v / 100) % 100, v % 100);
    if minor > 15 || step > 15 {
        return None;
    }
    Some(format!("gfx{major}{minor:x}{step:x}"))
}

/// GPU targets of the KFD topology under `root` (normally
/// `/sys/class/kfd/kfd/topology/nodes`), in node order; CPU nodes (version 0) skipped.
pub fn kfd_gfx_targets(root: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut nodes: Vec<(u32, String)> = Vec::new();
    for e in entries.flatten() {
        let Some(idx) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(text) = std::fs::read_to_string(e.path().join("properties")) else {
            continue;
        };
        let version = text.lines().find_map(|l| {
            let mut it = l.split_whitespace();
            (it.next() == Some("gfx_target_version"))
                .then(|| it.next().and_then(|v| v.parse::<u32>().ok()))
                .flatten()
        });
        if let Some(name) = version.and_then(gfx_name_from_target_version) {
            nodes.push((idx, name));
        }
    }
    nodes.sort();
    nodes.into_iter().map(|(_, n)| n).collect()
}

type FnInt = unsafe extern "C" fn(*mut c_int) -> c_int;
type FnVoid = unsafe extern "C" fn() -> c_int;
type FnMalloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type FnMallocFlags = unsafe extern "C" fn(*mut *mut c_void, usize, u32) -> c_int;
type FnFree = unsafe extern "C" fn(*mut c_void) -> c_int;
type FnHostDevPtr = unsafe extern "C" fn(*mut *mut c_void, *mut c_void, u32) -> c_int;
type FnHostRegister = unsafe extern "C" fn(*mut c_void, usize, u32) -> c_int;
type FnMemcpy = unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> c_int;
type FnMemcpyAsync =
    unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, *mut c_void) -> c_int;
type FnMemsetD32 = unsafe extern "C" fn(*mut c_void, c_int, usize) -> c_int;
type FnModuleLoad = unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> c_int;
type FnModuleUnload = unsafe extern "C" fn(*mut c_void) -> c_int;
type FnModuleGetFunction =
    unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> c_int;
type FnModuleGetGlobal =
    unsafe extern "C" fn(*mut *mut c_void, *mut usize, *mut c_void, *const c_char) -> c_int;
type FnLaunch = unsafe extern "C" fn(
    *mut c_void,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut c_void,
) -> c_int;
type FnAttr = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
type FnSetDevice = unsafe extern "C" fn(c_int) -> c_int;
type FnMemInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> c_int;
type FnErrStr = unsafe extern "C" fn(c_int) -> *const c_char;
type FnName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;

/// Facts about one HIP device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HipDeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// LLVM target (`gfx1151`), from the KFD topology; `None` if unreadable.
    pub arch: Option<String>,
    pub integrated: bool,
    pub managed_memory: bool,
    pub concurrent_managed_access: bool,
    pub can_map_host_memory: bool,
    pub pageable_memory_access: bool,
    /// 32 on RDNA, 64 on CDNA/GCN.
    pub warp_size: u32,
    pub multiprocessors: u32,
    pub free_bytes: u64,
    pub total_bytes: u64,
}

impl HipDeviceInfo {
    /// The planner's view. Integrated AMD devices are `IntegratedUma` (Strix Halo: the
    /// device pool is carve-out + GTT, smaller than RAM at stock settings); the clamp of
    /// free memory to MemAvailable − CmaFree is the planner's job.
    pub fn device_facts(&self) -> DeviceFacts {
        DeviceFacts {
            name: self.name.clone(),
            kind: if self.integrated {
                DeviceKind::IntegratedUma
            } else {
                DeviceKind::Discrete
            },
            pool_total: self.total_bytes,
            pool_free: self.free_bytes,
            carve_out_free: 0,
            caps: DeviceCaps {
                pinned_host: true,
                managed: self.managed_memory,
                host_register: true,
                host_mapped: self.can_map_host_memory,
                pageable_access: self.pageable_memory_access,
                coarse_grain_advice: true,
                pinned_counts_against_memlock: false,
            },
        }
    }
}

/// The HIP runtime library with the entry points this crate uses.
pub struct HipRuntime {
    _lib: libloading::Library,
    pub path: PathBuf,
    get_device_count: FnInt,
    runtime_get_version: FnInt,
    device_get_attribute: FnAttr,
    set_device: FnSetDevice,
    mem_get_info: FnMemInfo,
    get_error_string: FnErrStr,
    device_get_name: FnName,
    malloc: FnMalloc,
    free: FnFree,
    host_malloc: FnMallocFlags,
    host_free: FnFree,
    host_get_device_pointer: FnHostDevPtr,
    malloc_managed: FnMallocFlags,
    host_register: FnHostRegister,
    host_unregister: FnFree,
    memcpy: FnMemcpy,
    memcpy_async: FnMemcpyAsync,
    memset_d32: FnMemsetD32,
    module_load_data: FnModuleLoad,
    module_unload: FnModuleUnload,
    module_get_function: FnModuleGetFunction,
    module_get_global: FnModuleGetGlobal,
    module_launch_kernel: FnLaunch,
    device_synchronize: FnVoid,
}

impl std::fmt::Debug for HipRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipRuntime")
            .field("path", &self.path)
            .finish()
    }
}

/// Resolve the first of `names` that `lib` exports (entry points renamed across ROCm
/// versions: `hipHostMalloc` → `hipHostAlloc`, `hipHostFree` → `hipFreeHost`).
///
/// # Safety
/// `T` must be the exact C signature of every listed symbol.
unsafe fn sym_any<T: Copy>(lib: &libloading::Library, names: &[&str], path: &Path) -> Result<T> {
    let mut last = None;
    for n in names {
        // SAFETY: guaranteed by the caller.
        match unsafe { sym::<T>(lib, n, path) } {
            Ok(f) => return Ok(f),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| GpuError::HipUnavailable("no symbol names given".into())))
}

/// Resolve `name` in `lib` as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the exact C signature of the symbol.
unsafe fn sym<T: Copy>(lib: &libloading::Library, name: &str, path: &Path) -> Result<T> {
    let cname = format!("{name}\0");
    // SAFETY: guaranteed by the caller (signature matches).
    let s: libloading::Symbol<'_, T> = unsafe { lib.get(cname.as_bytes()) }
        .map_err(|e| GpuError::HipUnavailable(format!("{} has no {name}: {e}", path.display())))?;
    Ok(*s)
}

impl HipRuntime {
    /// Load from `$ROCM_PATH` (default /opt/rocm), then the loader path.
    pub fn load() -> Result<HipRuntime> {
        let rocm = std::env::var_os("ROCM_PATH").map(PathBuf::from);
        Self::load_from(rocm.as_deref())
    }

    pub fn load_from(rocm_path: Option<&Path>) -> Result<HipRuntime> {
        let (lib, path) = open_first(
            &library_candidates(rocm_path, "amdhip64"),
            "the HIP runtime (libamdhip64)",
        )?;
        // SAFETY: each signature below is the C prototype from hip_runtime_api.h
        // (hipError_t is a C enum, i.e. int; hipDevice_t is int).
        unsafe {
            Ok(HipRuntime {
                get_device_count: sym(&lib, "hipGetDeviceCount", &path)?,
                runtime_get_version: sym(&lib, "hipRuntimeGetVersion", &path)?,
                device_get_attribute: sym(&lib, "hipDeviceGetAttribute", &path)?,
                set_device: sym(&lib, "hipSetDevice", &path)?,
                mem_get_info: sym(&lib, "hipMemGetInfo", &path)?,
                get_error_string: sym(&lib, "hipGetErrorString", &path)?,
                device_get_name: sym(&lib, "hipDeviceGetName", &path)?,
                malloc: sym(&lib, "hipMalloc", &path)?,
                free: sym(&lib, "hipFree", &path)?,
                host_malloc: sym_any(&lib, &["hipHostMalloc", "hipHostAlloc"], &path)?,
                host_free: sym_any(&lib, &["hipHostFree", "hipFreeHost"], &path)?,
                host_get_device_pointer: sym(&lib, "hipHostGetDevicePointer", &path)?,
                malloc_managed: sym(&lib, "hipMallocManaged", &path)?,
                host_register: sym(&lib, "hipHostRegister", &path)?,
                host_unregister: sym(&lib, "hipHostUnregister", &path)?,
                memcpy: sym(&lib, "hipMemcpy", &path)?,
                memcpy_async: sym(&lib, "hipMemcpyAsync", &path)?,
                memset_d32: sym(&lib, "hipMemsetD32", &path)?,
                module_load_data: sym(&lib, "hipModuleLoadData", &path)?,
                module_unload: sym(&lib, "hipModuleUnload", &path)?,
                module_get_function: sym(&lib, "hipModuleGetFunction", &path)?,
                module_get_global: sym(&lib, "hipModuleGetGlobal", &path)?,
                module_launch_kernel: sym(&lib, "hipModuleLaunchKernel", &path)?,
                device_synchronize: sym(&lib, "hipDeviceSynchronize", &path)?,
                _lib: lib,
                path,
            })
        }
    }

    pub fn error_text(&self, code: c_int) -> String {
        // SAFETY: hipGetErrorString returns a static string for any code (or null).
        let p = unsafe { (self.get_error_string)(code) };
        if p.is_null() {
            return format!("hipError {code}");
        }
        // SAFETY: non-null, NUL-terminated static string.
        let s = unsafe { CStr::from_ptr(p) }.to_string_lossy();
        format!("{s} ({code})")
    }

    fn check(
        &self,
        code: c_int,
        call: &'static str,
        context: impl FnOnce() -> String,
    ) -> Result<()> {
        if code == HIP_SUCCESS {
            Ok(())
        } else {
            Err(GpuError::Hip {
                call,
                context: context(),
                code: self.error_text(code),
            })
        }
    }

    /// HIP runtime version (e.g. 50221153 for ROCm 5.2).
    pub fn runtime_version(&self) -> Result<i32> {
        let mut v = 0;
        // SAFETY: out-pointer is a local.
        let r = unsafe { (self.runtime_get_version)(&mut v) };
        self.check(r, "hipRuntimeGetVersion", || {
            "reading the HIP runtime version".into()
        })?;
        Ok(v)
    }

    /// Number of HIP devices; "no device" and "no driver" become [`GpuError::NoHipDevice`]
    /// with the runtime's own words.
    pub fn device_count(&self) -> Result<usize> {
        let mut n = 0;
        // SAFETY: out-pointer is a local.
        let r = unsafe { (self.get_device_count)(&mut n) };
        match r {
            HIP_SUCCESS if n > 0 => Ok(n as usize),
            HIP_SUCCESS | HIP_ERROR_NO_DEVICE | HIP_ERROR_INSUFFICIENT_DRIVER => Err(GpuError::NoHipDevice(format!(
                "the HIP runtime at {} reports no usable GPU ({}); is the amdgpu kernel driver loaded and /dev/kfd accessible?",
                self.path.display(),
                if r == HIP_SUCCESS { "0 devices".to_string() } else { self.error_text(r) }
            ))),
            other => self.check(other, "hipGetDeviceCount", || "counting HIP devices".into()).map(|_| 0),
        }
    }

    /// Facts of device `ordinal` (makes it the current device of this thread).
    pub fn device_info(&self, ordinal: usize) -> Result<HipDeviceInfo> {
        let n = self.device_count()?;
        if ordinal >= n {
            return Err(GpuError::NoHipDevice(format!(
                "device {ordinal} requested, {n} present"
            )));
        }
        let dev = ordinal as c_int;
        // SAFETY: valid ordinal (checked).
        let r = unsafe { (self.set_device)(dev) };
        self.check(r, "hipSetDevice", || format!("selecting device {ordinal}"))?;
        let get = |a: i32, what: &str| -> Result<i32> {
            let mut v = 0;
            // SAFETY: valid device; out-pointer is a local.
            let r = unsafe { (self.device_get_attribute)(&mut v, a, dev) };
            self.check(r, "hipDeviceGetAttribute", || {
                format!("reading {what} of device {ordinal}")
            })?;
            Ok(v)
        };
        let mut name = [0 as c_char; 256];
        // SAFETY: 256-byte buffer, 255 passed so it stays NUL-terminated.
        let r = unsafe { (self.device_get_name)(name.as_mut_ptr(), 255, dev) };
        self.check(r, "hipDeviceGetName", || {
            format!("reading the name of device {ordinal}")
        })?;
        // SAFETY: NUL-terminated within the zeroed array.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: current device set above; out-pointers are locals.
        let r = unsafe { (self.mem_get_info)(&mut free, &mut total) };
        self.check(r, "hipMemGetInfo", || {
            format!("reading free memory of device {ordinal}")
        })?;
        let arch = kfd_gfx_targets(Path::new("/sys/class/kfd/kfd/topology/nodes"))
            .into_iter()
            .nth(ordinal);
        Ok(HipDeviceInfo {
            ordinal,
            name,
            arch,
            integrated: get(attr::INTEGRATED, "integrated")? != 0,
            managed_memory: get(attr::MANAGED_MEMORY, "managed memory")? != 0,
            concurrent_managed_access: get(
                attr::CONCURRENT_MANAGED_ACCESS,
                "concurrent managed access",
            )? != 0,
            can_map_host_memory: get(attr::CAN_MAP_HOST_MEMORY, "can map host memory")? != 0,
            pageable_memory_access: get(attr::PAGEABLE_MEMORY_ACCESS, "pageable memory access")?
                != 0,
            warp_size: get(attr::WARP_SIZE, "warp size")?.max(0) as u32,
            multiprocessors: get(attr::MULTIPROCESSOR_COUNT, "compute units")?.max(0) as u32,
            free_bytes: free as u64,
            total_bytes: total as u64,
        })
    }
}

/// `hipMemcpyKind` values (stable across ROCm versions).
const HIP_MEMCPY_HOST_TO_DEVICE: c_int = 1;
const HIP_MEMCPY_DEVICE_TO_HOST: c_int = 2;
/// `hipHostMallocPortable | hipHostMallocMapped` (also the `hipHostRegister` flags).
const HIP_HOST_MAPPED_PORTABLE: u32 = 0x1 | 0x2;
/// `hipMemAttachGlobal`.
const HIP_MEM_ATTACH_GLOBAL: u32 = 0x1;

/// The HIP runtime entry points the allocation, module and launch layer uses, as a table
/// so that tests can substitute [`fake::FakeHip`]. Errors are the runtime's `hipError_t`
/// codes; [`HipCalls::error_text`] names them. Pointers travel as integers (device
/// addresses as `u64`, host addresses as `usize`).
pub trait HipCalls: Send + Sync {
    /// Where the runtime came from (library path, or "fake").
    fn describe(&self) -> String;
    /// `hipGetErrorString` with the code.
    fn error_text(&self, code: c_int) -> String;
    /// `hipSetDevice`.
    fn set_device(&self, ordinal: usize) -> c_int;
    /// `hipMalloc`: device-pool memory.
    fn malloc(&self, bytes: usize) -> std::result::Result<u64, c_int>;
    /// `hipMallocManaged(.., hipMemAttachGlobal)`.
    fn malloc_managed(&self, bytes: usize) -> std::result::Result<u64, c_int>;
    /// `hipHostMalloc(.., hipHostMallocMapped | hipHostMallocPortable)`: the host address.
    fn host_malloc_mapped(&self, bytes: usize) -> std::result::Result<usize, c_int>;
    /// `hipHostGetDevicePointer` of pinned or registered host memory.
    fn host_device_pointer(&self, host: usize) -> std::result::Result<u64, c_int>;
    /// `hipHostRegister(.., hipHostRegisterMapped | hipHostRegisterPortable)`.
    ///
    /// # Safety
    /// `host..host+bytes` must be live memory that stays valid until unregistered.
    unsafe fn host_register(&self, host: usize, bytes: usize) -> c_int;
    /// `hipHostUnregister`.
    ///
    /// # Safety
    /// `host` must have been registered and no queued work may still use it.
    unsafe fn host_unregister(&self, host: usize) -> c_int;
    /// `hipFree` (device or managed).
    ///
    /// # Safety
    /// `dptr` came from `malloc`/`malloc_managed` and no queued work still uses it.
    unsafe fn free(&self, dptr: u64) -> c_int;
    /// `hipHostFree`.
    ///
    /// # Safety
    /// `host` came from `host_malloc_mapped` and no queued work still uses it.
    unsafe fn host_free(&self, host: usize) -> c_int;
    /// `hipMemcpy` host → device (synchronous).
    ///
    /// # Safety
    /// `dst..dst+src.len()` must lie inside one live allocation of this runtime.
    unsafe fn memcpy_htod(&self, dst: u64, src: &[u8]) -> c_int;
    /// `hipMemcpy` device → host (synchronous, after queued work on the null stream).
    ///
    /// # Safety
    /// `src..src+dst.len()` must lie inside one live allocation of this runtime.
    unsafe fn memcpy_dtoh(&self, dst: &mut [u8], src: u64) -> c_int;
    /// `hipMemcpyAsync` on the null stream (the kernels' stream), host → device when
    /// `to_device`, else device → host: queued, no wait. `host` is a pinned host address.
    ///
    /// # Safety
    /// `device..device+bytes` must lie inside one live allocation of this runtime and
    /// `host..host+bytes` inside one pinned host allocation; the host range must not be
    /// touched until the null stream has been waited for.
    unsafe fn memcpy_async(&self, device: u64, host: usize, bytes: usize, to_device: bool)
        -> c_int;
    /// `hipMemsetD32`.
    ///
    /// # Safety
    /// `dst..dst+4·count` must lie inside one live allocation of this runtime.
    unsafe fn memset_d32(&self, dst: u64, value: u32, count: usize) -> c_int;
    /// `hipMemGetInfo`: (free, total) of the device pool, unclamped.
    fn mem_get_info(&self) -> std::result::Result<(u64, u64), c_int>;
    /// `hipModuleLoadData` of a code object: the module handle.
    fn module_load_data(&self, image: &[u8]) -> std::result::Result<usize, c_int>;
    /// `hipModuleUnload`.
    ///
    /// # Safety
    /// `module` came from `module_load_data`; no function of it is used afterwards.
    unsafe fn module_unload(&self, module: usize) -> c_int;
    /// `hipModuleGetFunction`.
    fn module_get_function(&self, module: usize, name: &CStr) -> std::result::Result<usize, c_int>;
    /// `hipModuleGetGlobal`: (device address, bytes).
    fn module_get_global(
        &self,
        module: usize,
        name: &CStr,
    ) -> std::result::Result<(u64, usize), c_int>;
    /// `hipModuleLaunchKernel` on the null stream, no dynamic shared memory.
    ///
    /// # Safety
    /// As [`crate::api::GpuApi::launch`].
    unsafe fn launch(
        &self,
        function: usize,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> c_int;
    /// `hipDeviceSynchronize`.
    fn synchronize(&self) -> c_int;
    /// Dynamic shared memory `launch` may be asked for; the real runtime's launch passes
    /// none, so 0.
    fn dynamic_smem_limit(&self) -> u32 {
        0
    }
}

/// `value` when the runtime call returned `hipSuccess`, else its error code.
fn hip_result<T>(r: c_int, value: T) -> std::result::Result<T, c_int> {
    if r == HIP_SUCCESS {
        Ok(value)
    } else {
        Err(r)
    }
}

impl HipCalls for HipRuntime {
    fn describe(&self) -> String {
        self.path.display().to_string()
    }
    fn error_text(&self, code: c_int) -> String {
        HipRuntime::error_text(self, code)
    }
    fn set_device(&self, ordinal: usize) -> c_int {
        // SAFETY: hipSetDevice validates the ordinal itself.
        unsafe { (self.set_device)(ordinal as c_int) }
    }
    fn malloc(&self, bytes: usize) -> std::result::Result<u64, c_int> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer is a local.
        let r = unsafe { (self.malloc)(&mut p, bytes) };
        hip_result(r, p as u64)
    }
    fn malloc_managed(&self, bytes: usize) -> std::result::Result<u64, c_int> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer is a local.
        let r = unsafe { (self.malloc_managed)(&mut p, bytes, HIP_MEM_ATTACH_GLOBAL) };
        hip_result(r, p as u64)
    }
    fn host_malloc_mapped(&self, bytes: usize) -> std::result::Result<usize, c_int> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer is a local.
        let r = unsafe { (self.host_malloc)(&mut p, bytes, HIP_HOST_MAPPED_PORTABLE) };
        hip_result(r, p as usize)
    }
    fn host_device_pointer(&self, host: usize) -> std::result::Result<u64, c_int> {
        let mut d: *mut c_void = std::ptr::null_mut();
        // SAFETY: the runtime looks `host` up in its own tables and returns an error for
        // memory it did not pin or register; out-pointer is a local.
        let r = unsafe { (self.host_get_device_pointer)(&mut d, host as *mut c_void, 0) };
        hip_result(r, d as u64)
    }
    unsafe fn host_register(&self, host: usize, bytes: usize) -> c_int {
        // SAFETY: guaranteed by the caller.
        unsafe { (self.host_register)(host as *mut c_void, bytes, HIP_HOST_MAPPED_PORTABLE) }
    }
    unsafe fn host_unregister(&self, host: usize) -> c_int {
        // SAFETY: guaranteed by the caller.
        unsafe { (self.host_unregister)(host as *mut c_void) }
    }
    unsafe fn free(&self, dptr: u64) -> c_int {
        // SAFETY: guaranteed by the caller.
        unsafe { (self.free)(dptr as *mut c_void) }
    }
    unsafe fn host_free(&self, host: usize) -> c_int {
        // SAFETY: guaranteed by the caller.
        unsafe { (self.host_free)(host as *mut c_void) }
    }
    unsafe fn memcpy_htod(&self, dst: u64, src: &[u8]) -> c_int {
        // SAFETY: destination range guaranteed by the caller; `src` is a live slice.
        unsafe {
            (self.memcpy)(
                dst as *mut c_void,
                src.as_ptr().cast(),
                src.len(),
                HIP_MEMCPY_HOST_TO_DEVICE,
            )
        }
    }
    unsafe fn memcpy_dtoh(&self, dst: &mut [u8], src: u64) -> c_int {
        // SAFETY: source range guaranteed by the caller; `dst` is a live slice.
        unsafe {
            (self.memcpy)(
                dst.as_mut_ptr().cast(),
                src as *const c_void,
                dst.len(),
                HIP_MEMCPY_DEVICE_TO_HOST,
            )
        }
    }
    unsafe fn memcpy_async(
        &self,
        device: u64,
        host: usize,
        bytes: usize,
        to_device: bool,
    ) -> c_int {
        let (dst, src, kind) = if to_device {
            (
                device as *mut c_void,
                host as *const c_void,
                HIP_MEMCPY_HOST_TO_DEVICE,
            )
        } else {
            (
                host as *mut c_void,
                device as *const c_void,
                HIP_MEMCPY_DEVICE_TO_HOST,
            )
        };
        // SAFETY: ranges guaranteed by the caller; the null stream orders the copy with
        // the kernels.
        unsafe { (self.memcpy_async)(dst, src, bytes, kind, std::ptr::null_mut()) }
    }
    unsafe fn memset_d32(&self, dst: u64, value: u32, count: usize) -> c_int {
        // SAFETY: range guaranteed by the caller.
        unsafe { (self.memset_d32)(dst as *mut c_void, value as c_int, count) }
    }
    fn mem_get_info(&self) -> std::result::Result<(u64, u64), c_int> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers are locals.
        let r = unsafe { (self.mem_get_info)(&mut free, &mut total) };
        hip_result(r, (free as u64, total as u64))
    }
    fn module_load_data(&self, image: &[u8]) -> std::result::Result<usize, c_int> {
        let mut m: *mut c_void = std::ptr::null_mut();
        // SAFETY: `image` is a whole code object held for the call; the runtime validates
        // it (an ELF it cannot use is an error code) and copies what it keeps.
        let r = unsafe { (self.module_load_data)(&mut m, image.as_ptr().cast()) };
        hip_result(r, m as usize)
    }
    unsafe fn module_unload(&self, module: usize) -> c_int {
        // SAFETY: guaranteed by the caller.
        unsafe { (self.module_unload)(module as *mut c_void) }
    }
    fn module_get_function(&self, module: usize, name: &CStr) -> std::result::Result<usize, c_int> {
        let mut f: *mut c_void = std::ptr::null_mut();
        // SAFETY: a loaded module handle (HipModule keeps it alive); NUL-terminated name.
        let r = unsafe { (self.module_get_function)(&mut f, module as *mut c_void, name.as_ptr()) };
        hip_result(r, f as usize)
    }
    fn module_get_global(
        &self,
        module: usize,
        name: &CStr,
    ) -> std::result::Result<(u64, usize), c_int> {
        let (mut d, mut bytes): (*mut c_void, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: a loaded module handle; NUL-terminated name; out-pointers are locals.
        let r = unsafe {
            (self.module_get_global)(&mut d, &mut bytes, module as *mut c_void, name.as_ptr())
        };
        hip_result(r, (d as u64, bytes))
    }
    unsafe fn launch(
        &self,
        function: usize,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> c_int {
        // SAFETY: guaranteed by the caller; null stream, no `extra` array, and the runtime
        // copies the argument values at launch.
        unsafe {
            (self.module_launch_kernel)(
                function as *mut c_void,
                grid.0,
                grid.1,
                grid.2,
                block,
                1,
                1,
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
    }
    fn synchronize(&self) -> c_int {
        // SAFETY: no arguments; waits for the current device.
        unsafe { (self.device_synchronize)() }
    }
}

type RtcCreate = unsafe extern "C" fn(
    *mut *mut c_void,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type RtcCompile = unsafe extern "C" fn(*mut c_void, c_int, *const *const c_char) -> c_int;
type RtcDestroy = unsafe extern "C" fn(*mut *mut c_void) -> c_int;
type RtcSize = unsafe extern "C" fn(*mut c_void, *mut usize) -> c_int;
type RtcGet = unsafe extern "C" fn(*mut c_void, *mut c_char) -> c_int;
type RtcVersion = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;

/// hiprtc, the run-time compiler for the kernel tree on ROCm.
pub struct HipRtc {
    _lib: libloading::Library,
    pub path: PathBuf,
    create: RtcCreate,
    compile: RtcCompile,
    destroy: RtcDestroy,
    code_size: RtcSize,
    code: RtcGet,
    log_size: RtcSize,
    log: RtcGet,
    version: RtcVersion,
}

impl std::fmt::Debug for HipRtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipRtc").field("path", &self.path).finish()
    }
}

/// hiprtc options for every kernel besides the architecture.
pub const HIPRTC_OPTIONS: &[&str] = &["-std=c++17", "-O3"];

impl HipRtc {
    pub fn load() -> Result<HipRtc> {
        let rocm = std::env::var_os("ROCM_PATH").map(PathBuf::from);
        Self::load_from(rocm.as_deref())
    }

    /// `libhiprtc` (ROCm ≥ 5.3), else the hiprtc entry points inside `libamdhip64`.
    pub fn load_from(rocm_path: Option<&Path>) -> Result<HipRtc> {
        let (lib, path) = open_first(
            &library_candidates(rocm_path, "hiprtc"),
            "hiprtc (libhiprtc)",
        )
        .or_else(|_| {
            open_first(
                &library_candidates(rocm_path, "amdhip64"),
                "hiprtc (in libamdhip64)",
            )
        })?;
        // SAFETY: signatures from hiprtc.h (hiprtcResult is a C enum; hiprtcProgram a pointer).
        unsafe {
            Ok(HipRtc {
                create: sym(&lib, "hiprtcCreateProgram", &path)?,
                compile: sym(&lib, "hiprtcCompileProgram", &path)?,
                destroy: sym(&lib, "hiprtcDestroyProgram", &path)?,
                code_size: sym(&lib, "hiprtcGetCodeSize", &path)?,
                code: sym(&lib, "hiprtcGetCode", &path)?,
                log_size: sym(&lib, "hiprtcGetProgramLogSize", &path)?,
                log: sym(&lib, "hiprtcGetProgramLog", &path)?,
                version: sym(&lib, "hiprtcVersion", &path)?,
                _lib: lib,
                path,
            })
        }
    }

    pub fn version(&self) -> Result<String> {
        let (mut a, mut b) = (0, 0);
        // SAFETY: out-pointers are locals.
        let r = unsafe { (self.version)(&mut a, &mut b) };
        if r != 0 {
            return Err(GpuError::Hip {
                call: "hiprtcVersion",
                context: "reading the hiprtc version".into(),
                code: format!("hiprtcResult {r}"),
            });
        }
        Ok(format!("{a}.{b}"))
    }

    /// Compile `src` for `arch` (`gfx1151`) to a code object.
    pub fn compile(
        &self,
        src: &KernelSource,
        arch: &str,
        extra: &[String],
    ) -> Result<(Vec<u8>, String)> {
        let cstr = |s: &str| {
            CString::new(s).map_err(|_| GpuError::BadArgument {
                op: "hiprtc compile",
                detail: format!("{}: NUL byte in source or option", src.name),
            })
        };
        let source = cstr(src.source)?;
        let name = cstr(src.name)?;
        let texts = src
            .headers
            .iter()
            .map(|(_, t)| cstr(t))
            .collect::<Result<Vec<_>>>()?;
        let names = src
            .headers
            .iter()
            .map(|(n, _)| cstr(n))
            .collect::<Result<Vec<_>>>()?;
        let tp: Vec<*const c_char> = texts.iter().map(|c| c.as_ptr()).collect();
        let np: Vec<*const c_char> = names.iter().map(|c| c.as_ptr()).collect();
        let fail = |call: &'static str, r: c_int| GpuError::Hip {
            call,
            context: format!("compiling {} for {arch}", src.name),
            code: format!("hiprtcResult {r}"),
        };
        let mut prog: *mut c_void = std::ptr::null_mut();
        // SAFETY: NUL-terminated strings that outlive the program; arrays of equal length.
        let r = unsafe {
            (self.create)(
                &mut prog,
                source.as_ptr(),
                name.as_ptr(),
                tp.len() as c_int,
                tp.as_ptr(),
                np.as_ptr(),
            )
        };
        if r != 0 {
            return Err(fail("hiprtcCreateProgram", r));
        }
        struct Prog(*mut c_void, RtcDestroy);
        impl Drop for Prog {
            fn drop(&mut self) {
                // SAFETY: created above, destroyed once.
                unsafe { (self.1)(&mut self.0) };
            }
        }
        let prog = Prog(prog, self.destroy);
        let mut opts = vec![cstr(&format!("--offload-arch={arch}"))?];
        for o in HIPRTC_OPTIONS
            .iter()
            .copied()
            .chain(extra.iter().map(String::as_str))
        {
            opts.push(cstr(o)?);
        }
        let op: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
        // SAFETY: valid program; option array of op.len() strings.
        let compiled = unsafe { (self.compile)(prog.0, op.len() as c_int, op.as_ptr()) };
        let mut ls = 0usize;
        // SAFETY: valid program; out-pointer is a local.
        let mut log = String::new();
        if unsafe { (self.log_size)(prog.0, &mut ls) } == 0 && ls > 1 {
            let mut buf = vec![0u8; ls];
            // SAFETY: buffer of the reported size.
            if unsafe { (self.log)(prog.0, buf.as_mut_ptr().cast()) } == 0 {
                let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
                log = String::from_utf8_lossy(&buf[..end]).trim().to_string();
            }
        }
        if compiled != 0 {
            return Err(GpuError::Compile {
                kernel: src.name.to_string(),
                arch: arch.to_string(),
                log: format!("hiprtcResult {compiled}\n{log}"),
            });
        }
        let mut size = 0usize;
        // SAFETY: compiled program; out-pointer is a local.
        let r = unsafe { (self.code_size)(prog.0, &mut size) };
        if r != 0 || size == 0 {
            return Err(fail("hiprtcGetCodeSize", r));
        }
        let mut code = vec![0u8; size];
        // SAFETY: buffer of the reported size.
        let r = unsafe { (self.code)(prog.0, code.as_mut_ptr().cast()) };
        if r != 0 {
            return Err(fail("hiprtcGetCode", r));
        }
        Ok((code, log))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_follow_rocm_path_then_loader() {
        let c = library_candidates(Some(Path::new("/x/rocm")), "amdhip64");
        assert_eq!(c[0], PathBuf::from("/x/rocm/lib/libamdhip64.so"));
        assert_eq!(c[1], PathBuf::from("/x/rocm/lib/libamdhip64.so.7"));
        assert_eq!(c[4], PathBuf::from("libamdhip64.so"));
        assert_eq!(c.last().unwrap(), &PathBuf::from("libamdhip64.so.5"));
        let d = library_candidates(None, "hiprtc");
        assert_eq!(d[0], PathBuf::from("/opt/rocm/lib/libhiprtc.so"));
    }

    #[test]
    fn missing_library_lists_what_was_tried() {
        let e = open_first(&[PathBuf::from("/nonexistent/libnothing.so")], "test lib").unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("/nonexistent/libnothing.so") && s.contains("test lib"),
            "{s}"
        );
    }

    #[test]
    fn gfx_names_from_kfd_versions() {
        assert_eq!(
            gfx_name_from_target_version(110501).as_deref(),
            Some("gfx1151")
        );
        assert_eq!(
            gfx_name_from_target_version(90010).as_deref(),
            Some("gfx90a")
        );
        assert_eq!(
            gfx_name_from_target_version(100300).as_deref(),
            Some("gfx1030")
        );
        assert_eq!(
            gfx_name_from_target_version(110000).as_deref(),
            Some("gfx1100")
        );
        assert_eq!(gfx_name_from_target_version(0), None);
        assert_eq!(gfx_name_from_target_version(91699), None);
    }

    #[test]
    fn kfd_topology_parsing_skips_cpu_nodes() {
        let d = tempfile::tempdir().unwrap();
        for (node, props) in [
            ("0", "cpu_cores_count 16\ngfx_target_version 0\n"),
            (
                "1",
                "simd_count 80\ngfx_target_version 110501\nmax_waves_per_simd 16\n",
            ),
            ("2", "gfx_target_version 100300\n"),
        ] {
            std::fs::create_dir_all(d.path().join(node)).unwrap();
            std::fs::write(d.path().join(node).join("properties"), props).unwrap();
        }
        assert_eq!(kfd_gfx_targets(d.path()), vec!["gfx1151", "gfx1030"]);
        assert!(kfd_gfx_targets(Path::new("/nonexistent")).is_empty());
    }

    #[test]
    fn integrated_amd_devices_are_integrated_uma() {
        let info = HipDeviceInfo {
            ordinal: 0,
            name: "AMD Radeon 8060S".into(),
            arch: Some("gfx1151".into()),
            integrated: true,
            managed_memory: true,
            concurrent_managed_access: false,
            can_map_host_memory: true,
            pageable_memory_access: false,
            warp_size: 32,
            multiprocessors: 40,
            free_bytes: 61 << 30,
            total_bytes: 62 << 30,
        };
        let f = info.device_facts();
        assert_eq!(f.kind, DeviceKind::IntegratedUma);
        assert!(f.caps.coarse_grain_advice && f.caps.host_mapped);
        let discrete = HipDeviceInfo {
            integrated: false,
            ..info
        };
        assert_eq!(discrete.device_facts().kind, DeviceKind::Discrete);
    }

    /// Where a HIP runtime is installed (CI installs Debian's for the hipcc check) but no
    /// GPU exists, loading works and the device count is a clear "no ROCm device".
    #[test]
    fn runtime_without_gpu_reports_no_device() {
        let Ok(rt) = HipRuntime::load() else {
            return; // no HIP runtime installed: nothing to check here
        };
        if std::path::Path::new("/dev/kfd").exists() {
            return; // a real AMD GPU machine
        }
        match rt.device_count() {
            Err(GpuError::NoHipDevice(m)) => assert!(m.contains("no usable GPU"), "{m}"),
            other => panic!("expected NoHipDevice, got {other:?}"),
        }
    }
}
