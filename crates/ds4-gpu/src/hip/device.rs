//! The HIP device: allocation by placement kind with ds4's integrated-GPU policy (PR #1028
//! and upstream admission), modules compiled by hiprtc and cached on disk, launches.
//!
//! Everything here runs on a [`HipCalls`] table, so the same code is unit-tested against
//! [`super::fake::FakeHip`] (Strix Halo stock and raised-GTT pools, hipHostMalloc
//! failures, no managed memory as on Windows) and runs on `libamdhip64` for users.
//!
//! The seed behaviour, exactly:
//! * Weights without a plan, on an integrated device, unless `DS4_ROCM_FORCE_DEVICE_MEM=1`
//!   (or `DS4_WEIGHTS_MEM=device`): admission check, pinned host (`hipHostMalloc`), then
//!   managed (`hipMallocManaged`, admission re-checked), then the raw `hipMalloc` (no
//!   admission, as in the seed: a refused host allocation still gets a device try).
//!   Discrete devices: `hipMalloc`.
//! * Admission: usable = MemAvailable − CmaFree, re-read before every host, managed and
//!   (integrated only) device allocation; admitted iff usable ≥ reserve and
//!   bytes ≤ usable − reserve, reserve 2 GiB (`DS4_OS_RESERVE_GIB`). Unreadable → refused.
//! * [`HipDevice::mem_info`]: on integrated devices free = min(hipMemGetInfo free, usable
//!   host) (no reserve); unreadable → error. Discrete: unchanged.
//! * `DS4_CUDA_MANAGED=1` (or `DS4_SCRATCH_MEM=managed`): engine buffers and scratch in
//!   managed memory (PR #361); otherwise device memory.

use std::alloc::Layout;
use std::ffi::{c_void, CString};
use std::sync::Arc;
use std::time::Instant;

use ds4_placement::{
    admit, execute, AllocError, Allocated, Allocator, DeviceFacts, LoadFailure, ManagedAdvice,
    MemChoice, MemKind, Plan,
};

use super::{HipCalls, HipDeviceInfo, HipRtc, HipRuntime, HIPRTC_OPTIONS};
use crate::api::{DeviceBuffer, GpuApi};
use crate::cache::{cache_key, CacheKeyParts, KernelCache};
use crate::error::{GpuError, Result};
use crate::kernels::KernelSource;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
const HOST_PAGE: usize = 4096;

/// Live usable host memory in bytes (Linux: MemAvailable − CmaFree), or why not.
pub type HostMemory = Arc<dyn Fn() -> std::result::Result<u64, String> + Send + Sync>;

/// MemAvailable − CmaFree from `/proc/meminfo` (floored at 0), re-read on every call.
pub fn linux_usable_host() -> std::result::Result<u64, String> {
    let text =
        std::fs::read_to_string("/proc/meminfo").map_err(|e| format!("/proc/meminfo: {e}"))?;
    let m = ds4_placement::parse_meminfo(&text).map_err(|e| format!("/proc/meminfo: {e}"))?;
    Ok(m.mem_available.saturating_sub(m.cma_free.unwrap_or(0)))
}

/// Compiles the kernel tree for a HIP architecture (hiprtc, or a fake in tests).
pub trait KernelCompiler: Send + Sync {
    /// Compiler version, part of the cache key.
    fn version(&self) -> Result<String>;
    /// A code object for `arch`, and the compiler's log.
    fn compile(
        &self,
        src: &KernelSource,
        arch: &str,
        extra: &[String],
    ) -> Result<(Vec<u8>, String)>;
}

impl KernelCompiler for HipRtc {
    fn version(&self) -> Result<String> {
        HipRtc::version(self)
    }
    fn compile(
        &self,
        src: &KernelSource,
        arch: &str,
        extra: &[String],
    ) -> Result<(Vec<u8>, String)> {
        HipRtc::compile(self, src, arch, extra)
    }
}

/// Memory settings read once at start-up (the placement crate's override rules:
/// CLI > environment > automatic, `0`/`1` only for the ds4 aliases).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HipSettings {
    /// Weights kind when no plan is given (`Auto` = the seed chain).
    pub weights: MemChoice,
    /// Engine buffers and scratch (`Managed` = `DS4_CUDA_MANAGED=1`).
    pub scratch: MemChoice,
    /// Host memory left to the OS (2 GiB).
    pub os_reserve: u64,
}

impl Default for HipSettings {
    fn default() -> Self {
        HipSettings {
            weights: MemChoice::Auto,
            scratch: MemChoice::Auto,
            os_reserve: 2 * GIB,
        }
    }
}

impl HipSettings {
    /// From `DS4_WEIGHTS_MEM` / `DS4_ROCM_FORCE_DEVICE_MEM`, `DS4_SCRATCH_MEM` /
    /// `DS4_CUDA_MANAGED` and `DS4_OS_RESERVE_GIB`, via `env`.
    pub fn from_env(env: impl Fn(&str) -> Option<String>) -> Result<HipSettings> {
        let o = ds4_placement::resolve_overrides(&ds4_placement::CliOverrides::default(), env)
            .map_err(|e| GpuError::BadArgument {
                op: "rocm settings",
                detail: e.to_string(),
            })?;
        Ok(HipSettings {
            weights: o.weights.value,
            scratch: o.scratch.value,
            os_reserve: o.os_reserve.value.unwrap_or(2 * GIB),
        })
    }
}

/// Counts of what the weight allocations actually got (for the load report).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HipAllocStats {
    /// Allocations that fell back past their first kind, with the reasons.
    pub fallbacks: Vec<String>,
}

/// An open HIP device.
pub struct HipDevice {
    calls: Arc<dyn HipCalls>,
    compiler: Arc<dyn KernelCompiler>,
    info: HipDeviceInfo,
    arch: String,
    runtime_version: i32,
    host: HostMemory,
    settings: HipSettings,
    stats: std::sync::Mutex<HipAllocStats>,
}

impl std::fmt::Debug for HipDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipDevice")
            .field("runtime", &self.calls.describe())
            .field("name", &self.info.name)
            .field("arch", &self.arch)
            .field("integrated", &self.info.integrated)
            .finish()
    }
}

impl HipDevice {
    /// Opens device `ordinal` of the installed ROCm runtime: "ROCm is not available" when
    /// the libraries are missing, "no ROCm device" when they load but find no GPU.
    /// The architecture comes from `DS4_HIP_ARCH` when set, else the KFD topology.
    pub fn open(ordinal: usize) -> Result<HipDevice> {
        let rt = HipRuntime::load()?;
        let info = rt.device_info(ordinal)?;
        let runtime_version = rt.runtime_version()?;
        let arch = std::env::var("DS4_HIP_ARCH")
            .ok()
            .filter(|a| !a.is_empty())
            .or_else(|| info.arch.clone())
            .ok_or_else(|| {
                GpuError::NoHipDevice(format!(
                    "cannot read the GPU architecture of device {ordinal} ({}) from \
                     /sys/class/kfd/kfd/topology; set DS4_HIP_ARCH (e.g. gfx1151)",
                    info.name
                ))
            })?;
        let rtc = HipRtc::load()?;
        let settings = HipSettings::from_env(|k| std::env::var(k).ok())?;
        Ok(Self::with_calls(
            Arc::new(rt),
            Arc::new(rtc),
            info,
            arch,
            runtime_version,
            Arc::new(linux_usable_host),
            settings,
        ))
    }

    /// A device over any runtime table (the fake in tests).
    pub fn with_calls(
        calls: Arc<dyn HipCalls>,
        compiler: Arc<dyn KernelCompiler>,
        info: HipDeviceInfo,
        arch: String,
        runtime_version: i32,
        host: HostMemory,
        settings: HipSettings,
    ) -> HipDevice {
        HipDevice {
            calls,
            compiler,
            info,
            arch,
            runtime_version,
            host,
            settings,
            stats: std::sync::Mutex::new(HipAllocStats::default()),
        }
    }

    pub fn info(&self) -> &HipDeviceInfo {
        &self.info
    }

    /// LLVM target the kernels are compiled for (`gfx1151`).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    pub fn settings(&self) -> &HipSettings {
        &self.settings
    }

    /// Where the runtime library came from.
    pub fn runtime_path(&self) -> String {
        self.calls.describe()
    }

    /// Weight allocations that fell back, with reasons.
    pub fn alloc_stats(&self) -> HipAllocStats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn err(&self, call: &'static str, code: i32, context: impl FnOnce() -> String) -> GpuError {
        GpuError::Hip {
            call,
            context: context(),
            code: self.calls.error_text(code),
        }
    }

    fn usable_host(&self) -> Result<u64> {
        (self.host)().map_err(GpuError::HostMemoryUnknown)
    }

    /// Current (free, total) of the device pool; on integrated devices free is clamped
    /// to usable host memory (ds4's mem-get-info clamp).
    pub fn mem_info(&self) -> Result<(u64, u64)> {
        let (free, total) = self
            .calls
            .mem_get_info()
            .map_err(|c| self.err("hipMemGetInfo", c, || "reading free device memory".into()))?;
        if !self.info.integrated {
            return Ok((free, total));
        }
        Ok((free.min(self.usable_host()?), total))
    }

    /// Facts for the planner, with fresh (clamped) free/total numbers.
    pub fn placement_facts(&self) -> Result<DeviceFacts> {
        let (free, total) = self.mem_info()?;
        let mut info = self.info.clone();
        info.free_bytes = free;
        info.total_bytes = total;
        Ok(info.device_facts())
    }

    /// ds4's admission check for `bytes` of `kind`, with live numbers: host kinds always,
    /// device memory only on integrated devices.
    pub fn admit(&self, kind: MemKind, bytes: u64) -> Result<()> {
        let checked = kind.is_host() || kind == MemKind::Managed || self.info.integrated;
        if !checked {
            return Ok(());
        }
        let usable = self.usable_host()?;
        let reserve = self.settings.os_reserve;
        if admit(bytes, usable, reserve) {
            return Ok(());
        }
        Err(GpuError::NotAdmitted {
            kind: kind.label(),
            requested_mib: bytes.div_ceil(MIB),
            usable_gib: usable as f64 / GIB as f64,
            reserve_gib: reserve as f64 / GIB as f64,
        })
    }

    /// Admission check, then the allocation.
    pub fn alloc_admitted(&self, kind: MemKind, bytes: usize) -> Result<HipBuffer> {
        self.admit(kind, bytes as u64)?;
        self.alloc_raw(kind, bytes)
    }

    /// The kinds weights try, in order, when no plan is given; the last `bool` says
    /// whether that step is admission-checked.
    pub fn weights_chain(&self) -> Vec<(MemKind, bool)> {
        match self.settings.weights {
            MemChoice::Auto if self.info.integrated => vec![
                (MemKind::PinnedHost, true),
                (MemKind::Managed, true),
                (MemKind::Device, false),
            ],
            MemChoice::Auto | MemChoice::Device => vec![(MemKind::Device, false)],
            MemChoice::Host => vec![(MemKind::PinnedHost, true)],
            MemChoice::Managed => vec![(MemKind::Managed, true)],
        }
    }

    /// A weight allocation by [`Self::weights_chain`]; every refused step is logged and
    /// recorded, and an error lists all of them.
    pub fn alloc_weights(&self, bytes: usize) -> Result<HipBuffer> {
        let mut steps = Vec::new();
        for (kind, checked) in self.weights_chain() {
            let r = if checked {
                self.alloc_admitted(kind, bytes)
            } else {
                self.alloc_raw(kind, bytes)
            };
            match r {
                Ok(b) => {
                    if !steps.is_empty() {
                        let note = format!(
                            "{} MiB of weights in {} memory after: {}",
                            bytes.div_ceil(MIB as usize),
                            kind.label(),
                            steps.join("; ")
                        );
                        tracing::info!("{note}");
                        self.stats
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .fallbacks
                            .push(note);
                    }
                    return Ok(b);
                }
                Err(e) => steps.push(format!("{}: {e}", kind.label())),
            }
        }
        Err(GpuError::BadArgument {
            op: "weights allocation",
            detail: format!(
                "{bytes} bytes could not be allocated in any allowed kind [{}]",
                steps.join("; ")
            ),
        })
    }

    /// Engine buffers and scratch: managed with `DS4_CUDA_MANAGED=1` (admission-checked,
    /// falling back to device memory with a log line), else device memory.
    pub fn alloc_scratch(&self, bytes: usize) -> Result<HipBuffer> {
        match self.settings.scratch {
            MemChoice::Managed => match self.alloc_admitted(MemKind::Managed, bytes) {
                Ok(b) => Ok(b),
                Err(e) => {
                    tracing::warn!(
                        "managed scratch of {bytes} bytes refused ({e}); using device memory"
                    );
                    self.alloc_raw(MemKind::Device, bytes)
                }
            },
            MemChoice::Host => self.alloc_admitted(MemKind::PinnedHost, bytes),
            MemChoice::Auto | MemChoice::Device => self.alloc_raw(MemKind::Device, bytes),
        }
    }

    /// Exactly `kind`, no admission check.
    pub fn alloc_raw(&self, kind: MemKind, bytes: usize) -> Result<HipBuffer> {
        if bytes == 0 {
            return Err(GpuError::BadArgument {
                op: "alloc",
                detail: format!("a zero-byte {} buffer", kind.label()),
            });
        }
        let what = || {
            format!(
                "allocating {bytes} bytes of {} memory on {}",
                kind.label(),
                self.info.name
            )
        };
        let wrap = |dptr: u64, host: usize, owner: Owner| HipBuffer {
            calls: self.calls.clone(),
            kind,
            dptr,
            host,
            len: bytes,
            owner,
        };
        match kind {
            MemKind::Device => {
                let d = self
                    .calls
                    .malloc(bytes)
                    .map_err(|c| self.err("hipMalloc", c, what))?;
                Ok(wrap(d, 0, Owner::Device))
            }
            MemKind::PinnedHost => {
                if !self.info.can_map_host_memory {
                    return Err(GpuError::KindUnsupported {
                        kind: "mapped pinned host",
                        device: self.info.name.clone(),
                    });
                }
                let h = self
                    .calls
                    .host_malloc_mapped(bytes)
                    .map_err(|c| self.err("hipHostMalloc", c, what))?;
                match self.calls.host_device_pointer(h) {
                    Ok(d) => Ok(wrap(d, h, Owner::HostAlloc)),
                    Err(c) => {
                        // SAFETY: `h` came from hipHostMalloc above, nothing used it yet.
                        unsafe { self.calls.host_free(h) };
                        Err(self.err("hipHostGetDevicePointer", c, what))
                    }
                }
            }
            MemKind::Managed => {
                if !self.info.managed_memory {
                    return Err(GpuError::KindUnsupported {
                        kind: "managed",
                        device: self.info.name.clone(),
                    });
                }
                let d = self
                    .calls
                    .malloc_managed(bytes)
                    .map_err(|c| self.err("hipMallocManaged", c, what))?;
                Ok(wrap(d, d as usize, Owner::Device))
            }
            MemKind::HostRegistered => {
                let size = bytes.div_ceil(HOST_PAGE) * HOST_PAGE;
                let layout = Layout::from_size_align(size, HOST_PAGE).map_err(|e| {
                    GpuError::BadArgument {
                        op: "alloc",
                        detail: format!("{bytes} bytes of host memory: {e}"),
                    }
                })?;
                // SAFETY: non-zero size (bytes > 0).
                let p = unsafe { std::alloc::alloc_zeroed(layout) };
                if p.is_null() {
                    return Err(GpuError::Hip {
                        call: "alloc",
                        context: what(),
                        code: "host allocation failed".into(),
                    });
                }
                let h = p as usize;
                // SAFETY: p..p+size is ours until the buffer drops (or the error path).
                let r = unsafe { self.calls.host_register(h, size) };
                if r != 0 {
                    // SAFETY: allocated above with this layout, not registered.
                    unsafe { std::alloc::dealloc(p, layout) };
                    return Err(self.err("hipHostRegister", r, what));
                }
                match self.calls.host_device_pointer(h) {
                    Ok(d) => Ok(wrap(d, h, Owner::Registered(layout))),
                    Err(c) => {
                        // SAFETY: registered above, unused; then freed with its layout.
                        unsafe {
                            self.calls.host_unregister(h);
                            std::alloc::dealloc(p, layout);
                        }
                        Err(self.err("hipHostGetDevicePointer", c, what))
                    }
                }
            }
            MemKind::Pageable => Err(GpuError::KindUnsupported {
                kind: "pageable (unregistered) host",
                device: self.info.name.clone(),
            }),
        }
    }

    fn load_image(&self, image: &[u8], name: &str) -> Result<HipModule> {
        let m = self.calls.module_load_data(image).map_err(|c| {
            self.err("hipModuleLoadData", c, || {
                format!(
                    "loading the compiled {name} ({} bytes) for {}",
                    image.len(),
                    self.arch
                )
            })
        })?;
        Ok(HipModule {
            calls: self.calls.clone(),
            handle: m,
            name: name.to_string(),
        })
    }
}

enum Owner {
    /// hipMalloc / hipMallocManaged: hipFree.
    Device,
    /// hipHostMalloc: hipHostFree.
    HostAlloc,
    /// Page-aligned Rust allocation + hipHostRegister: unregister, then dealloc.
    Registered(Layout),
}

/// One HIP allocation; freed (after the device is idle) when dropped.
pub struct HipBuffer {
    calls: Arc<dyn HipCalls>,
    kind: MemKind,
    dptr: u64,
    /// Host address for host-resident kinds (0: none).
    host: usize,
    len: usize,
    owner: Owner,
}

impl std::fmt::Debug for HipBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipBuffer")
            .field("kind", &self.kind)
            .field("dptr", &format_args!("{:#x}", self.dptr))
            .field("len", &self.len)
            .finish()
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

impl HipBuffer {
    fn check(&self, call: &'static str, code: i32, context: impl FnOnce() -> String) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        Err(GpuError::Hip {
            call,
            context: context(),
            code: self.calls.error_text(code),
        })
    }
}

impl HipBuffer {
    /// Queues `hipMemcpyAsync` between this buffer at `offset` and host-resident `host`
    /// at `host_off` (towards this buffer when `to_device`).
    ///
    /// # Safety
    /// `host`'s range must not be touched from the host until the null stream has been
    /// waited for.
    unsafe fn queue_copy(
        &self,
        offset: usize,
        host: &HipBuffer,
        host_off: usize,
        len: usize,
        to_device: bool,
    ) -> Result<()> {
        let op = if to_device {
            "queue_upload"
        } else {
            "queue_download"
        };
        bounds(op, "device range", offset, len, self.len)?;
        bounds(op, "host range", host_off, len, host.len)?;
        if host.host == 0 {
            return Err(GpuError::BadArgument {
                op,
                detail: format!("the host side is {}, not host memory", host.kind.label()),
            });
        }
        if len == 0 {
            return Ok(());
        }
        // SAFETY: both ranges checked against live allocations; the host side is pinned
        // (hipHostMalloc) and the caller leaves it alone until the stream is waited for.
        let r = unsafe {
            self.calls.memcpy_async(
                self.dptr + offset as u64,
                host.host + host_off,
                len,
                to_device,
            )
        };
        self.check("hipMemcpyAsync", r, || {
            format!("queueing a {len}-byte copy through pinned memory")
        })
    }

    /// Copies `src` to byte `offset` through a shared reference (the load pipeline
    /// writes disjoint ranges of one buffer). `hipMemcpy` is synchronous, so the copy
    /// has completed when this returns.
    pub(crate) fn write_shared(&self, offset: usize, src: &[u8]) -> Result<()> {
        bounds("write", "source", offset, src.len(), self.len)?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: offset + len checked against this live allocation above.
        let r = unsafe { self.calls.memcpy_htod(self.dptr + offset as u64, src) };
        self.check("hipMemcpy", r, || {
            format!(
                "copying {} bytes to a {} buffer",
                src.len(),
                self.kind.label()
            )
        })
    }
}

impl DeviceBuffer for HipBuffer {
    fn kind(&self) -> MemKind {
        self.kind
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device_address(&self) -> u64 {
        self.dptr
    }
    fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        bounds("write", "source", offset, src.len(), self.len)?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: offset + len checked against this live allocation above.
        let r = unsafe { self.calls.memcpy_htod(self.dptr + offset as u64, src) };
        self.check("hipMemcpy", r, || {
            format!(
                "copying {} bytes to a {} buffer",
                src.len(),
                self.kind.label()
            )
        })
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        bounds("read", "destination", offset, dst.len(), self.len)?;
        if dst.is_empty() {
            return Ok(());
        }
        let n = dst.len();
        // SAFETY: offset + len checked against this live allocation above.
        let r = unsafe { self.calls.memcpy_dtoh(dst, self.dptr + offset as u64) };
        self.check("hipMemcpy", r, || {
            format!("copying {n} bytes from a {} buffer", self.kind.label())
        })
    }
    fn fill_u32(&mut self, value: u32) -> Result<()> {
        if !self.len.is_multiple_of(4) {
            return Err(GpuError::BadArgument {
                op: "fill_u32",
                detail: format!("buffer of {} bytes is not whole u32 words", self.len),
            });
        }
        // SAFETY: the whole allocation, len/4 words.
        let r = unsafe { self.calls.memset_d32(self.dptr, value, self.len / 4) };
        self.check("hipMemsetD32", r, || format!("filling {} bytes", self.len))
    }
    unsafe fn host_range_unsynced(
        &mut self,
        offset: usize,
        len: usize,
    ) -> Result<Option<&mut [u8]>> {
        bounds("host_range", "range", offset, len, self.len)?;
        if self.host == 0 {
            return Ok(None);
        }
        // SAFETY: inside this buffer's host mapping (checked), alive while `self` is;
        // `&mut self` makes the slice the only host accessor and the caller guarantees
        // that no device work touches the range.
        Ok(Some(unsafe {
            std::slice::from_raw_parts_mut((self.host + offset) as *mut u8, len)
        }))
    }
    fn host_bytes_mut(&mut self) -> Result<Option<&mut [u8]>> {
        if self.host == 0 {
            return Ok(None);
        }
        let r = self.calls.synchronize();
        self.check("hipDeviceSynchronize", r, || {
            "work touching a host-resident buffer".into()
        })?;
        // SAFETY: host..host+len is this buffer's host mapping, alive while `self` is, and
        // the device is idle (synchronised above); `&mut self` makes the slice unique.
        Ok(Some(unsafe {
            std::slice::from_raw_parts_mut(self.host as *mut u8, self.len)
        }))
    }
}

impl Drop for HipBuffer {
    fn drop(&mut self) {
        // Queued kernels may still use the memory: wait first. Errors cannot be reported
        // from drop; a failing free leaks rather than crashes.
        let _ = self.calls.synchronize();
        // SAFETY: each handle came from the matching allocation call, the device is idle,
        // and nothing uses the buffer after drop.
        unsafe {
            match self.owner {
                Owner::Device => {
                    self.calls.free(self.dptr);
                }
                Owner::HostAlloc => {
                    self.calls.host_free(self.host);
                }
                Owner::Registered(layout) => {
                    self.calls.host_unregister(self.host);
                    std::alloc::dealloc(self.host as *mut u8, layout);
                }
            }
        }
    }
}

/// A loaded code object.
pub struct HipModule {
    calls: Arc<dyn HipCalls>,
    handle: usize,
    pub name: String,
}

impl Drop for HipModule {
    fn drop(&mut self) {
        let _ = self.calls.synchronize();
        // SAFETY: loaded by load_image; functions of it are owned by whoever owns the
        // module and dropped with it (the backend keeps both for its lifetime).
        unsafe { self.calls.module_unload(self.handle) };
    }
}

/// An entry point of a [`HipModule`].
#[derive(Debug, Clone)]
pub struct HipFunction {
    handle: usize,
    pub name: String,
}

/// The placement executor's allocator on HIP: live admission before every host, managed
/// and (integrated) device allocation, then exactly the kind asked for.
pub struct HipAllocator<'a> {
    pub device: &'a HipDevice,
}

impl Allocator for HipAllocator<'_> {
    type Handle = HipBuffer;

    fn allocate(
        &mut self,
        kind: MemKind,
        bytes: u64,
        _advice: ManagedAdvice,
    ) -> std::result::Result<HipBuffer, AllocError> {
        let bytes = usize::try_from(bytes)
            .map_err(|_| AllocError(format!("{bytes} bytes do not fit in memory")))?;
        self.device
            .alloc_admitted(kind, bytes)
            .map_err(|e| AllocError(e.to_string()))
    }

    fn free(&mut self, handle: HipBuffer) {
        drop(handle);
    }

    fn admit(&mut self, kind: MemKind, bytes: u64) -> std::result::Result<(), AllocError> {
        self.device
            .admit(kind, bytes)
            .map_err(|e| AllocError(e.to_string()))
    }
}

impl GpuApi for HipDevice {
    type Buffer = HipBuffer;
    type Module = HipModule;
    type Function = HipFunction;
    /// Timing events are not wired to hipEvent* yet: attribution is CUDA-only for now.
    type Event = ();

    fn runtime(&self) -> &'static str {
        "rocm"
    }
    fn device_name(&self) -> String {
        format!("{}, {}", self.info.name, self.arch)
    }
    fn multiprocessors(&self) -> u32 {
        self.info.multiprocessors
    }
    fn alloc(&self, kind: MemKind, bytes: usize) -> Result<HipBuffer> {
        self.alloc_raw(kind, bytes)
    }
    fn alloc_weights(&self, bytes: usize) -> Result<HipBuffer> {
        HipDevice::alloc_weights(self, bytes)
    }
    fn alloc_scratch(&self, bytes: usize) -> Result<HipBuffer> {
        HipDevice::alloc_scratch(self, bytes)
    }
    fn execute_plan(&self, plan: &Plan) -> Result<Allocated<HipBuffer>, LoadFailure> {
        execute(plan, &mut HipAllocator { device: self })
    }
    fn load_module(
        &self,
        src: &KernelSource,
        cache: &KernelCache,
        extra: &[String],
    ) -> Result<HipModule> {
        let compiler = self.compiler.version()?;
        let mut options: Vec<String> = HIPRTC_OPTIONS.iter().map(|s| s.to_string()).collect();
        options.extend(extra.iter().cloned());
        let key = cache_key(
            src,
            &CacheKeyParts {
                runtime: "hip",
                arch: &self.arch,
                driver_version: i64::from(self.runtime_version),
                compiler_version: &compiler,
                options: &options,
            },
        );
        let t0 = Instant::now();
        if let Some(image) = cache.load(&key, "hsaco")? {
            match self.load_image(&image, src.name) {
                Ok(m) => {
                    tracing::debug!(
                        "{} for {} from the kernel cache ({key})",
                        src.name,
                        self.arch
                    );
                    return Ok(m);
                }
                Err(e) => {
                    tracing::info!("cached {key} rejected ({e}); recompiling");
                    cache.evict(&key, "hsaco");
                }
            }
        }
        let (image, log) = self.compiler.compile(src, &self.arch, extra)?;
        if !log.is_empty() {
            tracing::debug!("hiprtc log for {}: {log}", src.name);
        }
        let m = self.load_image(&image, src.name)?;
        cache.store(&key, "hsaco", &image)?;
        tracing::info!(
            "compiled {} for {} with hiprtc {compiler} in {:.1} s",
            src.name,
            self.arch,
            t0.elapsed().as_secs_f64()
        );
        Ok(m)
    }
    fn function(&self, module: &HipModule, name: &str) -> Result<HipFunction> {
        let c = CString::new(name).map_err(|_| GpuError::BadArgument {
            op: "function",
            detail: format!("kernel name {name:?} contains NUL"),
        })?;
        let handle = self
            .calls
            .module_get_function(module.handle, &c)
            .map_err(|code| {
                self.err("hipModuleGetFunction", code, || {
                    format!("looking up {name} in {}", module.name)
                })
            })?;
        Ok(HipFunction {
            handle,
            name: name.to_string(),
        })
    }
    fn read_i32x2_global(&self, module: &HipModule, name: &str) -> Result<[i32; 2]> {
        let c = CString::new(name).map_err(|_| GpuError::BadArgument {
            op: "read_i32_global",
            detail: format!("symbol name {name:?} contains NUL"),
        })?;
        let (d, bytes) = self
            .calls
            .module_get_global(module.handle, &c)
            .map_err(|code| {
                self.err("hipModuleGetGlobal", code, || {
                    format!("looking up the module global {name}")
                })
            })?;
        if bytes != 8 {
            return Err(GpuError::BadArgument {
                op: "read_i32_global",
                detail: format!("{name} is {bytes} bytes, expected 8"),
            });
        }
        let mut raw = [0u8; 8];
        // SAFETY: the global is exactly 8 bytes at `d` (checked).
        let r = unsafe { self.calls.memcpy_dtoh(&mut raw, d) };
        if r != 0 {
            return Err(self.err("hipMemcpy", r, || {
                format!("reading the module global {name}")
            }));
        }
        Ok([
            i32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]),
            i32::from_le_bytes([raw[4], raw[5], raw[6], raw[7]]),
        ])
    }
    fn max_dynamic_smem(&self) -> u32 {
        self.calls.dynamic_smem_limit()
    }
    unsafe fn launch_smem(
        &self,
        f: &HipFunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        if smem > self.calls.dynamic_smem_limit() {
            return Err(GpuError::BadArgument {
                op: "launch",
                detail: format!(
                    "{} with {smem} bytes of dynamic shared memory: not on this runtime",
                    f.name
                ),
            });
        }
        // SAFETY: the caller upholds this trait method's contract; a runtime whose limit
        // is non-zero (the test fake) gives every block the memory it declares.
        unsafe { self.launch(f, grid, block, params) }
    }
    unsafe fn launch(
        &self,
        f: &HipFunction,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the caller upholds this trait method's contract.
        let r = unsafe { self.calls.launch(f.handle, grid, block, params) };
        if r != 0 {
            return Err(self.err("hipModuleLaunchKernel", r, || {
                format!("launching {} with grid {grid:?} x {block} threads", f.name)
            }));
        }
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        let r = self.calls.synchronize();
        if r != 0 {
            return Err(self.err("hipDeviceSynchronize", r, || {
                "waiting for queued work".into()
            }));
        }
        Ok(())
    }
    fn timing_event(&self) -> Result<()> {
        Err(GpuError::BadArgument {
            op: "profile",
            detail: "device-time attribution needs timing events, not wired for ROCm yet".into(),
        })
    }
    fn record_event(&self, _e: &()) -> Result<()> {
        Ok(())
    }
    fn event_ms(&self, _a: &(), _b: &()) -> Result<f32> {
        Ok(0.0)
    }
    /// Copies are synchronous on this layer: every event has completed.
    fn copy_event(&self) -> Result<()> {
        Ok(())
    }
    fn event_wait(&self, _e: &()) -> Result<()> {
        Ok(())
    }
    fn event_query(&self, _e: &()) -> Result<bool> {
        Ok(true)
    }
    unsafe fn copy_to_device_async(
        &self,
        dst: &HipBuffer,
        offset: usize,
        src: &[u8],
    ) -> Result<()> {
        dst.write_shared(offset, src)
    }
    unsafe fn queue_upload(
        &self,
        src: &HipBuffer,
        src_off: usize,
        dst: &HipBuffer,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        // SAFETY: the caller upholds the trait method's contract (the same).
        unsafe { dst.queue_copy(dst_off, src, src_off, len, true) }
    }
    unsafe fn queue_download(
        &self,
        src: &HipBuffer,
        src_off: usize,
        dst: &HipBuffer,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        // SAFETY: the caller upholds the trait method's contract (the same).
        unsafe { src.queue_copy(src_off, dst, dst_off, len, false) }
    }
}
