//! A fake HIP runtime for tests: host memory stands in for every kind, calls are
//! recorded, and faults are injectable (hipHostMalloc failing, no managed memory as on
//! Windows, a small device pool). It models a unified-memory APU: every allocation draws
//! from host RAM (what `/proc/meminfo` would show), device allocations also from the
//! device pool (GTT). Every allocation is real memory: an anonymous `MAP_NORESERVE`
//! mapping, so tens of GiB at Strix Halo sizes cost nothing until touched, while copies
//! and host mappings behave as on the real runtime.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void, CStr};
use std::sync::{Arc, Mutex};

use ds4_placement::MachineFacts;

use super::device::{HipDevice, HipSettings, HostMemory, KernelCompiler};
use super::{HipCalls, HipDeviceInfo};
use crate::emu::EmuKernels;
use crate::error::Result;
use crate::kernels::KernelSource;

const HIP_ERROR_OUT_OF_MEMORY: c_int = 2;
const HIP_ERROR_INVALID_VALUE: c_int = 1;
const HIP_ERROR_NOT_FOUND: c_int = 500;
const HIP_ERROR_NOT_SUPPORTED: c_int = 801;
const HIP_ERROR_LAUNCH_FAILURE: c_int = 719;

/// One recorded launch: kernel, grid, block, parameter count.
pub type Launch = (String, (u32, u32, u32), u32, usize);

/// Faults to inject.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Faults {
    /// hipHostMalloc returns out-of-memory.
    pub host_malloc_fails: bool,
    /// hipMallocManaged returns not-supported (Windows APUs).
    pub managed_unsupported: bool,
    /// hipHostRegister returns not-supported.
    pub host_register_fails: bool,
    /// hipMemGetInfo fails.
    pub mem_info_fails: bool,
}

/// An anonymous mapping, unmapped on drop.
#[derive(Debug)]
struct Mapping {
    addr: usize,
    len: usize,
}

impl Mapping {
    fn new(len: usize) -> Option<Mapping> {
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        (p != libc::MAP_FAILED).then_some(Mapping {
            addr: p as usize,
            len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with this length, unmapped once.
        unsafe { libc::munmap(self.addr as *mut c_void, self.len) };
    }
}

#[derive(Debug)]
struct Alloc {
    kind: &'static str,
    bytes: u64,
    /// The memory (`None` for caller-owned registered memory and module globals).
    _map: Option<Mapping>,
    /// Counted against host memory (false for registered memory and module globals).
    counted: bool,
    /// Counted against the device pool too.
    pool: bool,
}

#[derive(Debug, Default)]
struct State {
    host_available: u64,
    cma_free: u64,
    pool_free: u64,
    pool_total: u64,
    allocs: BTreeMap<u64, Alloc>,
    calls: Vec<String>,
    launches: Vec<Launch>,
    functions: Vec<String>,
    modules: usize,
    /// Host-to-device copies so far (not in `calls`: a model load makes thousands).
    htod_copies: u64,
    /// Kernels run on the CPU at each launch ([`FakeHip::set_kernels`]); `None`: launches
    /// are only recorded.
    kernels: Option<Arc<EmuKernels>>,
    /// Launches the emulation refused (kernel, message).
    kernel_errors: Vec<String>,
    /// Calls after which the host has waited for the device: `hipDeviceSynchronize` and
    /// the synchronous `hipMemcpy` (either direction).
    host_waits: u64,
    /// `hipMemcpyAsync` calls (no wait).
    async_copies: u64,
    /// How long each host wait lasts ([`FakeHip::set_wait_delay`]): a device still busy.
    wait_delay: Option<std::time::Duration>,
    /// A "kernel" that reports a device fault: when `.0` launches, parameter `.1` is read
    /// as a device address and `.2` is ORed into the word there.
    kernel_fault: Option<(String, usize, u32)>,
}

/// The fake runtime (see the module docs).
#[derive(Debug)]
pub struct FakeHip {
    state: Mutex<State>,
    pub faults: Faults,
}

impl FakeHip {
    /// A fake with `host_available` bytes of MemAvailable, `cma_free` of CmaFree and a
    /// device pool of `pool_free` of `pool_total`.
    pub fn new(
        host_available: u64,
        cma_free: u64,
        pool_free: u64,
        pool_total: u64,
        faults: Faults,
    ) -> Arc<FakeHip> {
        Arc::new(FakeHip {
            state: Mutex::new(State {
                host_available,
                cma_free,
                pool_free,
                pool_total,
                ..State::default()
            }),
            faults,
        })
    }

    fn st(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// MemAvailable − CmaFree as `/proc/meminfo` would now show it.
    pub fn usable_host(&self) -> u64 {
        let s = self.st();
        s.host_available.saturating_sub(s.cma_free)
    }

    /// The device pool's free bytes (what hipMemGetInfo reports, unclamped).
    pub fn mem_info_free(&self) -> u64 {
        self.st().pool_free
    }

    /// Every call so far, in order (`hipMalloc 1024`, `hipHostMalloc 4096 -> oom`, ...).
    pub fn calls(&self) -> Vec<String> {
        self.st().calls.clone()
    }

    /// Host-to-device copies (`hipMemcpy` host → device) so far.
    pub fn htod_copies(&self) -> u64 {
        self.st().htod_copies
    }

    /// Runs every later launch's kernel on the CPU (see [`crate::emu`]): the backend then
    /// computes for real, so its results can be compared with the CPU backend's.
    pub fn set_kernels(&self, kernels: Arc<EmuKernels>) {
        self.st().kernels = Some(kernels);
    }

    /// Launches the kernel emulation refused, with its message (a deadlock, a wrong
    /// parameter count, an unknown kernel).
    pub fn kernel_errors(&self) -> Vec<String> {
        self.st().kernel_errors.clone()
    }

    /// Launches so far: (kernel, grid, block, parameter count).
    /// Makes every host wait (synchronisation, synchronous copy) last `d`, as if the device
    /// were still busy (tests of the host-wait accounting).
    pub fn set_wait_delay(&self, d: Option<std::time::Duration>) {
        self.st().wait_delay = d;
    }

    /// Sleeps for the configured wait delay, outside the state lock.
    fn wait_like_a_device(&self) {
        let d = self.st().wait_delay;
        if let Some(d) = d {
            std::thread::sleep(d);
        }
    }

    /// Calls so far after which the host waited for the device (see `State::host_waits`).
    pub fn host_waits(&self) -> u64 {
        self.st().host_waits
    }

    /// Asynchronous copies queued so far.
    pub fn async_copies(&self) -> u64 {
        self.st().async_copies
    }

    /// From now on, every launch of `kernel` sets `bits` in the word whose device address
    /// is its parameter `param` (as a kernel reporting invalid input sets the fault word);
    /// `None` stops it.
    pub fn set_kernel_fault(&self, fault: Option<(&str, usize, u32)>) {
        self.st().kernel_fault = fault.map(|(k, p, b)| (k.to_string(), p, b));
    }

    pub fn launches(&self) -> Vec<Launch> {
        self.st().launches.clone()
    }

    /// Live allocations made through the runtime: (kind, bytes).
    pub fn live(&self) -> Vec<(&'static str, u64)> {
        self.st()
            .allocs
            .values()
            .filter(|a| a.kind != "module global")
            .map(|a| (a.kind, a.bytes))
            .collect()
    }

    fn record(&self, s: String) {
        self.st().calls.push(s);
    }

    fn take(
        &self,
        kind: &'static str,
        bytes: usize,
        pool: bool,
    ) -> std::result::Result<u64, c_int> {
        let mut s = self.st();
        let b = bytes as u64;
        if b == 0 {
            s.calls.push(format!("{kind} 0 -> invalid"));
            return Err(HIP_ERROR_INVALID_VALUE);
        }
        // Pinned pages cannot come from CMA; the pool is GTT on an APU.
        let host_room = s.host_available.saturating_sub(s.cma_free);
        if b > host_room || (pool && b > s.pool_free) {
            s.calls.push(format!("{kind} {bytes} -> out of memory"));
            return Err(HIP_ERROR_OUT_OF_MEMORY);
        }
        let Some(map) = Mapping::new(bytes) else {
            s.calls.push(format!("{kind} {bytes} -> mmap failed"));
            return Err(HIP_ERROR_OUT_OF_MEMORY);
        };
        s.host_available -= b;
        if pool {
            s.pool_free -= b;
        }
        let addr = map.addr as u64;
        s.allocs.insert(
            addr,
            Alloc {
                kind,
                bytes: b,
                _map: Some(map),
                counted: true,
                pool,
            },
        );
        s.calls.push(format!("{kind} {bytes}"));
        Ok(addr)
    }

    fn release(&self, kind: &'static str, addr: u64) -> c_int {
        let mut s = self.st();
        match s.allocs.remove(&addr) {
            Some(a) => {
                if a.counted {
                    s.host_available += a.bytes;
                }
                if a.pool {
                    s.pool_free += a.bytes;
                }
                s.calls.push(format!("{kind} {}", a.bytes));
                0
            }
            None => {
                s.calls.push(format!("{kind} {addr:#x} -> invalid"));
                HIP_ERROR_INVALID_VALUE
            }
        }
    }

    /// Whether `addr..addr+n` lies in one live allocation.
    fn backed(&self, addr: u64, n: usize) -> bool {
        let s = self.st();
        s.allocs
            .range(..=addr)
            .next_back()
            .is_some_and(|(&base, a)| {
                addr.checked_add(n as u64)
                    .is_some_and(|e| e <= base + a.bytes)
            })
    }

    /// A [`HipDevice`] over this fake for `machine` (a machine file of
    /// `ds4-placement/machines`), with `settings` and the given faults already set.
    pub fn device(self: &Arc<Self>, machine: &MachineFacts, settings: HipSettings) -> HipDevice {
        let f = self.clone();
        let host: HostMemory = Arc::new(move || Ok(f.usable_host()));
        let d = &machine.device;
        let info = HipDeviceInfo {
            ordinal: 0,
            name: d.name.clone(),
            arch: Some("gfx1151".into()),
            integrated: d.kind.is_unified(),
            managed_memory: d.caps.managed && !self.faults.managed_unsupported,
            concurrent_managed_access: false,
            can_map_host_memory: d.caps.host_mapped,
            pageable_memory_access: d.caps.pageable_access,
            warp_size: 32,
            multiprocessors: 40,
            free_bytes: d.pool_free,
            total_bytes: d.pool_total,
        };
        HipDevice::with_calls(
            self.clone(),
            Arc::new(FakeCompiler),
            info,
            "gfx1151".into(),
            60_000_000,
            host,
            settings,
        )
    }

    /// A fake for `machine`: MemAvailable, CmaFree and the device pool from the file.
    pub fn for_machine(machine: &MachineFacts, faults: Faults) -> Arc<FakeHip> {
        FakeHip::new(
            machine.host.mem_available,
            machine.host.cma_free,
            machine.device.pool_free,
            machine.device.pool_total,
            faults,
        )
    }
}

impl HipCalls for FakeHip {
    fn describe(&self) -> String {
        "fake HIP runtime".into()
    }
    fn error_text(&self, code: c_int) -> String {
        let name = match code {
            HIP_ERROR_OUT_OF_MEMORY => "hipErrorOutOfMemory",
            HIP_ERROR_INVALID_VALUE => "hipErrorInvalidValue",
            HIP_ERROR_NOT_FOUND => "hipErrorNotFound",
            HIP_ERROR_NOT_SUPPORTED => "hipErrorNotSupported",
            _ => "hipErrorUnknown",
        };
        format!("{name} ({code})")
    }
    fn set_device(&self, _ordinal: usize) -> c_int {
        0
    }
    fn malloc(&self, bytes: usize) -> std::result::Result<u64, c_int> {
        self.take("hipMalloc", bytes, true)
    }
    fn malloc_managed(&self, bytes: usize) -> std::result::Result<u64, c_int> {
        if self.faults.managed_unsupported {
            self.record(format!("hipMallocManaged {bytes} -> not supported"));
            return Err(HIP_ERROR_NOT_SUPPORTED);
        }
        self.take("hipMallocManaged", bytes, false)
    }
    fn host_malloc_mapped(&self, bytes: usize) -> std::result::Result<usize, c_int> {
        if self.faults.host_malloc_fails {
            self.record(format!("hipHostMalloc {bytes} -> out of memory"));
            return Err(HIP_ERROR_OUT_OF_MEMORY);
        }
        Ok(self.take("hipHostMalloc", bytes, false)? as usize)
    }
    fn host_device_pointer(&self, host: usize) -> std::result::Result<u64, c_int> {
        // Unified addressing, as on AMD: the device address is the host address.
        if self.backed(host as u64, 1) {
            Ok(host as u64)
        } else {
            Err(HIP_ERROR_INVALID_VALUE)
        }
    }
    unsafe fn host_register(&self, host: usize, bytes: usize) -> c_int {
        if self.faults.host_register_fails {
            self.record(format!("hipHostRegister {bytes} -> not supported"));
            return HIP_ERROR_NOT_SUPPORTED;
        }
        let mut s = self.st();
        s.calls.push(format!("hipHostRegister {bytes}"));
        // Registered memory is the caller's; record it without backing so it can be found.
        s.allocs.insert(
            host as u64,
            Alloc {
                kind: "hipHostRegister",
                bytes: bytes as u64,
                _map: None,
                counted: false,
                pool: false,
            },
        );
        0
    }
    unsafe fn host_unregister(&self, host: usize) -> c_int {
        self.release("hipHostUnregister", host as u64)
    }
    unsafe fn free(&self, dptr: u64) -> c_int {
        self.release("hipFree", dptr)
    }
    unsafe fn host_free(&self, host: usize) -> c_int {
        self.release("hipHostFree", host as u64)
    }
    unsafe fn memcpy_htod(&self, dst: u64, src: &[u8]) -> c_int {
        if !self.backed(dst, src.len()) {
            return HIP_ERROR_INVALID_VALUE;
        }
        let mut s = self.st();
        s.htod_copies += 1;
        s.host_waits += 1;
        drop(s);
        // SAFETY: dst..dst+len lies inside a live boxed allocation of this fake (checked).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        0
    }
    unsafe fn memcpy_dtoh(&self, dst: &mut [u8], src: u64) -> c_int {
        if !self.backed(src, dst.len()) {
            return HIP_ERROR_INVALID_VALUE;
        }
        self.st().host_waits += 1;
        self.wait_like_a_device();
        // SAFETY: src..src+len lies inside a live boxed allocation of this fake (checked).
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        0
    }
    unsafe fn memcpy_async(
        &self,
        device: u64,
        host: usize,
        bytes: usize,
        to_device: bool,
    ) -> c_int {
        if !self.backed(device, bytes) || !self.backed(host as u64, bytes) {
            return HIP_ERROR_INVALID_VALUE;
        }
        self.st().async_copies += 1;
        // The fake runs nothing in the background, so a queued copy is done at once.
        let (dst, src) = if to_device {
            (device as *mut u8, host as *const u8)
        } else {
            (host as *mut u8, device as *const u8)
        };
        // SAFETY: both ranges lie inside live allocations of this fake (checked); distinct
        // allocations never overlap.
        unsafe { std::ptr::copy(src, dst, bytes) };
        0
    }
    unsafe fn memset_d32(&self, dst: u64, value: u32, count: usize) -> c_int {
        let Some(n) = count.checked_mul(4) else {
            return HIP_ERROR_INVALID_VALUE;
        };
        if !self.backed(dst, n) {
            return HIP_ERROR_INVALID_VALUE;
        }
        for i in 0..count {
            // SAFETY: inside a live boxed allocation (checked); unaligned write is fine.
            unsafe { std::ptr::write_unaligned((dst as *mut u32).add(i), value) };
        }
        0
    }
    fn mem_get_info(&self) -> std::result::Result<(u64, u64), c_int> {
        if self.faults.mem_info_fails {
            return Err(HIP_ERROR_NOT_SUPPORTED);
        }
        let s = self.st();
        Ok((s.pool_free, s.pool_total))
    }
    fn module_load_data(&self, image: &[u8]) -> std::result::Result<usize, c_int> {
        if !image.starts_with(b"FAKE") {
            return Err(HIP_ERROR_INVALID_VALUE);
        }
        let mut s = self.st();
        s.modules += 1;
        Ok(s.modules)
    }
    unsafe fn module_unload(&self, _module: usize) -> c_int {
        0
    }
    fn module_get_function(
        &self,
        _module: usize,
        name: &CStr,
    ) -> std::result::Result<usize, c_int> {
        let mut s = self.st();
        s.functions.push(name.to_string_lossy().into_owned());
        Ok(s.functions.len())
    }
    fn module_get_global(
        &self,
        _module: usize,
        name: &CStr,
    ) -> std::result::Result<(u64, usize), c_int> {
        // Every GEMV configuration reads {2 rows per warp, 32 blocks per chunk}, unless the
        // kernels run: then the compiled value.
        static CONFIG: [i32; 2] = [2, 32];
        let mut s = self.st();
        let a = match &s.kernels {
            Some(k) => k
                .global(&name.to_string_lossy())
                .ok_or(HIP_ERROR_NOT_FOUND)?,
            None => CONFIG.as_ptr() as u64,
        };
        s.allocs.entry(a).or_insert_with(|| Alloc {
            kind: "module global",
            bytes: 8,
            _map: None,
            counted: false,
            pool: false,
        });
        drop(s);
        Ok((a, 8))
    }
    /// The emulated kernels give every block its kernel's largest dynamic shared memory
    /// as a static array, so any amount may be asked for.
    fn dynamic_smem_limit(&self) -> u32 {
        u32::MAX
    }
    unsafe fn launch(
        &self,
        function: usize,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> c_int {
        let mut s = self.st();
        let name = s
            .functions
            .get(function.wrapping_sub(1))
            .cloned()
            .unwrap_or_default();
        let fault = match &s.kernel_fault {
            Some((k, p, bits)) if *k == name => Some((*p, *bits)),
            _ => None,
        };
        s.launches.push((name.clone(), grid, block, params.len()));
        let kernels = s.kernels.clone();
        drop(s);
        if let Some(k) = kernels {
            // SAFETY: the backend passes device addresses of this fake's allocations, which
            // are host memory, and the kernel's parameters in order (checked by count).
            if let Err(e) = unsafe { k.launch(&name, grid, block, params) } {
                self.st().kernel_errors.push(e.to_string());
                return HIP_ERROR_LAUNCH_FAILURE;
            }
        }
        if let Some((p, bits)) = fault {
            let Some(&arg) = params.get(p) else {
                return HIP_ERROR_INVALID_VALUE;
            };
            // SAFETY: the caller's contract: every parameter points at a live value of
            // the kernel's parameter type; this one is a device address (a u64).
            let addr = unsafe { std::ptr::read_unaligned(arg as *const u64) };
            if !self.backed(addr, 4) {
                return HIP_ERROR_INVALID_VALUE;
            }
            // SAFETY: inside a live allocation of this fake (checked); the fake's device
            // addresses are host addresses.
            unsafe {
                let w = addr as *mut u32;
                std::ptr::write_unaligned(w, std::ptr::read_unaligned(w) | bits);
            }
        }
        0
    }
    fn synchronize(&self) -> c_int {
        self.st().host_waits += 1;
        self.wait_like_a_device();
        0
    }
}

/// A compiler that produces a marker image the fake runtime accepts.
pub struct FakeCompiler;

impl KernelCompiler for FakeCompiler {
    fn version(&self) -> Result<String> {
        Ok("fake".into())
    }
    fn compile(
        &self,
        src: &KernelSource,
        arch: &str,
        _extra: &[String],
    ) -> Result<(Vec<u8>, String)> {
        Ok((
            format!("FAKE {} {arch}", src.name).into_bytes(),
            String::new(),
        ))
    }
}
