//! Run-time kernel compilation with NVRTC, the on-disk image cache, module loading and
//! raw kernel launches.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys;
use cudarc::nvrtc::sys as nv;

use super::device::CudaDevice;
use super::driver::{check, probe_libraries, Ctx};
use crate::cache::{cache_key, CacheKeyParts, KernelCache};
use crate::error::{GpuError, Result};
use crate::kernels::KernelSource;

/// NVRTC options used for every kernel (besides the architecture).
pub const NVRTC_OPTIONS: &[&str] = &["-std=c++17"];

/// How a module was obtained, for the load report and the check tool.
#[derive(Debug, Clone, PartialEq)]
pub struct ModuleOrigin {
    /// True when the image came from the disk cache.
    pub cached: bool,
    /// Compile (or cache read + load) time in milliseconds.
    pub millis: f64,
    pub key: String,
    /// NVRTC's log (warnings), empty when cached.
    pub log: String,
}

fn nvrtc_text(res: nv::nvrtcResult) -> String {
    // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string for any value.
    let p = unsafe { nv::nvrtcGetErrorString(res) };
    if p.is_null() {
        format!("nvrtcResult {}", res as i32)
    } else {
        // SAFETY: non-null static string (above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

fn nvrtc_check(res: nv::nvrtcResult, call: &'static str, kernel: &str) -> Result<()> {
    if res == nv::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Nvrtc {
            call,
            kernel: kernel.to_string(),
            code: nvrtc_text(res),
        })
    }
}

/// NVRTC's version as `major.minor`. Needs only libnvrtc (no GPU).
pub fn nvrtc_version() -> Result<String> {
    if !probe_libraries().nvrtc {
        return Err(GpuError::CudaUnavailable(
            "the NVRTC library (libnvrtc.so) cannot be loaded".into(),
        ));
    }
    let (mut major, mut minor) = (0 as c_int, 0 as c_int);
    // SAFETY: library present; out-pointers are locals.
    nvrtc_check(
        unsafe { nv::nvrtcVersion(&mut major, &mut minor) },
        "nvrtcVersion",
        "-",
    )?;
    Ok(format!("{major}.{minor}"))
}

/// Compile `src` for `arch` (e.g. `sm_90`) to a CUBIN. Needs only libnvrtc, so it also
/// runs on machines without a GPU (the check tool's `compile` mode uses this).
pub fn nvrtc_compile(src: &KernelSource, arch: &str) -> Result<(Vec<u8>, String)> {
    nvrtc_compile_with(src, arch, &[])
}

/// [`nvrtc_compile`] with extra options after the standard ones.
pub fn nvrtc_compile_with(
    src: &KernelSource,
    arch: &str,
    extra: &[String],
) -> Result<(Vec<u8>, String)> {
    if !probe_libraries().nvrtc {
        return Err(GpuError::CudaUnavailable(
            "the NVRTC library (libnvrtc.so) cannot be loaded".into(),
        ));
    }
    let cstr = |s: &str| {
        CString::new(s).map_err(|_| GpuError::BadArgument {
            op: "nvrtc compile",
            detail: format!("{}: source or option contains a NUL byte", src.name),
        })
    };
    let source = cstr(src.source)?;
    let name = cstr(src.name)?;
    let header_texts = src
        .headers
        .iter()
        .map(|(_, t)| cstr(t))
        .collect::<Result<Vec<_>>>()?;
    let header_names = src
        .headers
        .iter()
        .map(|(n, _)| cstr(n))
        .collect::<Result<Vec<_>>>()?;
    let header_ptrs: Vec<*const c_char> = header_texts.iter().map(|c| c.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = header_names.iter().map(|c| c.as_ptr()).collect();
    let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: all strings are NUL-terminated and outlive the program (they live until the
    // end of this function, after nvrtcDestroyProgram); the header arrays have
    // `headers.len()` entries each.
    nvrtc_check(
        unsafe {
            nv::nvrtcCreateProgram(
                &mut prog,
                source.as_ptr(),
                name.as_ptr(),
                header_ptrs.len() as c_int,
                header_ptrs.as_ptr(),
                name_ptrs.as_ptr(),
            )
        },
        "nvrtcCreateProgram",
        src.name,
    )?;
    struct Prog(nv::nvrtcProgram);
    impl Drop for Prog {
        fn drop(&mut self) {
            // SAFETY: created above, destroyed exactly once here.
            unsafe { nv::nvrtcDestroyProgram(&mut self.0) };
        }
    }
    let prog = Prog(prog);
    let mut opts: Vec<CString> = vec![cstr(&format!("--gpu-architecture={arch}"))?];
    for o in NVRTC_OPTIONS
        .iter()
        .copied()
        .chain(extra.iter().map(String::as_str))
    {
        opts.push(cstr(o)?);
    }
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
    // SAFETY: valid program; option array of opt_ptrs.len() NUL-terminated strings.
    let compiled =
        unsafe { nv::nvrtcCompileProgram(prog.0, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
    let log = program_log(prog.0, src.name)?;
    if compiled != nv::nvrtcResult::NVRTC_SUCCESS {
        return Err(GpuError::Compile {
            kernel: src.name.to_string(),
            arch: arch.to_string(),
            log: format!("{}\n{log}", nvrtc_text(compiled)),
        });
    }
    let mut size = 0usize;
    // SAFETY: compiled program; out-pointer is a local.
    nvrtc_check(
        unsafe { nv::nvrtcGetCUBINSize(prog.0, &mut size) },
        "nvrtcGetCUBINSize",
        src.name,
    )?;
    if size == 0 {
        return Err(GpuError::Compile {
            kernel: src.name.to_string(),
            arch: arch.to_string(),
            log: format!("NVRTC produced no CUBIN (is {arch} a real architecture, sm_XX?)\n{log}"),
        });
    }
    let mut image = vec![0u8; size];
    // SAFETY: the buffer holds exactly the size NVRTC reported.
    nvrtc_check(
        unsafe { nv::nvrtcGetCUBIN(prog.0, image.as_mut_ptr().cast()) },
        "nvrtcGetCUBIN",
        src.name,
    )?;
    Ok((image, log))
}

fn program_log(prog: nv::nvrtcProgram, kernel: &str) -> Result<String> {
    let mut size = 0usize;
    // SAFETY: valid program; out-pointer is a local.
    nvrtc_check(
        unsafe { nv::nvrtcGetProgramLogSize(prog, &mut size) },
        "nvrtcGetProgramLogSize",
        kernel,
    )?;
    if size <= 1 {
        return Ok(String::new());
    }
    let mut buf = vec![0u8; size];
    // SAFETY: the buffer holds the reported size, including the NUL.
    nvrtc_check(
        unsafe { nv::nvrtcGetProgramLog(prog, buf.as_mut_ptr().cast()) },
        "nvrtcGetProgramLog",
        kernel,
    )?;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).trim().to_string())
}

pub(crate) struct ModuleInner {
    pub(crate) ctx: Arc<Ctx>,
    pub(crate) module: sys::CUmodule,
}

// SAFETY: module handles are context-scoped and thread-agnostic; users bind the context.
unsafe impl Send for ModuleInner {}
// SAFETY: as above; the module is immutable after loading.
unsafe impl Sync for ModuleInner {}

impl Drop for ModuleInner {
    fn drop(&mut self) {
        // SAFETY: queued launches finish before unloading; handle unloaded once.
        unsafe {
            sys::cuCtxSetCurrent(self.ctx.ctx);
            sys::cuStreamSynchronize(self.ctx.stream);
            sys::cuModuleUnload(self.module);
        }
    }
}

/// A loaded kernel module.
#[derive(Clone)]
pub struct CudaModule {
    pub(crate) inner: Arc<ModuleInner>,
    pub origin: ModuleOrigin,
}

impl std::fmt::Debug for CudaModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaModule")
            .field("origin", &self.origin)
            .finish()
    }
}

/// One kernel entry point of a loaded module.
#[derive(Clone)]
pub struct CudaFunction {
    pub(crate) module: Arc<ModuleInner>,
    pub(crate) func: sys::CUfunction,
    pub name: String,
    /// Dynamic shared memory the function's limit was raised to (0: never raised; shared
    /// by clones: the limit belongs to the driver's function).
    smem_allowed: Arc<std::sync::atomic::AtomicU32>,
}

// SAFETY: function handles are immutable and context-scoped; launches bind the context.
unsafe impl Send for CudaFunction {}
// SAFETY: as above.
unsafe impl Sync for CudaFunction {}

/// Resource usage of a compiled kernel, as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FunctionAttrs {
    pub registers: i32,
    /// Local memory per thread (spills): should be 0.
    pub local_bytes: i32,
    pub static_shared_bytes: i32,
    pub max_threads_per_block: i32,
}

impl CudaDevice {
    /// Load `src` compiled for this device, from `cache` when a valid image is there,
    /// else by compiling with NVRTC and storing the image.
    pub fn load_module(&self, src: &KernelSource, cache: &KernelCache) -> Result<CudaModule> {
        self.load_module_with(src, cache, &[])
    }

    /// [`Self::load_module`] with extra NVRTC options (e.g. `-DDS4_EMU_ONE_TABLE`-style
    /// build flags of the kernels; the tunables are constants, not options); they are part of
    /// the cache key.
    pub fn load_module_with(
        &self,
        src: &KernelSource,
        cache: &KernelCache,
        extra: &[String],
    ) -> Result<CudaModule> {
        let arch = self.info().arch();
        let nvrtc = nvrtc_version()?;
        let mut options: Vec<String> = NVRTC_OPTIONS.iter().map(|s| s.to_string()).collect();
        options.extend(extra.iter().cloned());
        let key = cache_key(
            src,
            &CacheKeyParts {
                runtime: "cuda",
                arch: &arch,
                driver_version: i64::from(self.info().driver_version),
                compiler_version: &nvrtc,
                options: &options,
            },
        );
        let t0 = Instant::now();
        if let Some(image) = cache.load(&key, "cubin")? {
            match self.load_image(&image, src.name) {
                Ok(module) => {
                    return Ok(CudaModule {
                        inner: Arc::new(ModuleInner {
                            ctx: self.ctx.clone(),
                            module,
                        }),
                        origin: ModuleOrigin {
                            cached: true,
                            millis: t0.elapsed().as_secs_f64() * 1e3,
                            key,
                            log: String::new(),
                        },
                    })
                }
                // A rejected cached image (truncated, other driver): recompile below.
                Err(_) => cache.evict(&key, "cubin"),
            }
        }
        let (image, log) = nvrtc_compile_with(src, &arch, extra)?;
        let module = self.load_image(&image, src.name)?;
        cache.store(&key, "cubin", &image)?;
        Ok(CudaModule {
            inner: Arc::new(ModuleInner {
                ctx: self.ctx.clone(),
                module,
            }),
            origin: ModuleOrigin {
                cached: false,
                millis: t0.elapsed().as_secs_f64() * 1e3,
                key,
                log,
            },
        })
    }

    fn load_image(&self, image: &[u8], name: &str) -> Result<sys::CUmodule> {
        self.ctx.bind()?;
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: `image` is a complete CUBIN (ELF) image held for the duration of the
        // call; the driver copies what it needs.
        check(
            unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr().cast::<c_void>()) },
            "cuModuleLoadData",
            || format!("loading the compiled {name} ({} bytes)", image.len()),
        )?;
        Ok(module)
    }
}

impl CudaModule {
    /// The entry point `name` (an `extern "C"` kernel).
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        let cname = CString::new(name).map_err(|_| GpuError::BadArgument {
            op: "function",
            detail: format!("kernel name {name:?} contains NUL"),
        })?;
        self.inner.ctx.bind()?;
        let mut func: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: loaded module; NUL-terminated name; out-pointer is a local.
        check(
            unsafe { sys::cuModuleGetFunction(&mut func, self.inner.module, cname.as_ptr()) },
            "cuModuleGetFunction",
            || format!("looking up kernel {name}"),
        )?;
        Ok(CudaFunction {
            module: self.inner.clone(),
            func,
            name: name.to_string(),
            smem_allowed: Arc::new(std::sync::atomic::AtomicU32::new(0)),
        })
    }
}

impl CudaModule {
    /// Read the `extern "C" __device__ const int NAME[N]` array of this module (launch
    /// configuration compiled into the kernels).
    pub fn read_i32_global<const N: usize>(&self, name: &str) -> Result<[i32; N]> {
        let cname = CString::new(name).map_err(|_| GpuError::BadArgument {
            op: "read_i32_global",
            detail: format!("symbol name {name:?} contains NUL"),
        })?;
        self.inner.ctx.bind()?;
        let (mut ptr, mut bytes): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: loaded module; NUL-terminated name; out-pointers are locals.
        check(
            unsafe {
                sys::cuModuleGetGlobal_v2(&mut ptr, &mut bytes, self.inner.module, cname.as_ptr())
            },
            "cuModuleGetGlobal",
            || format!("looking up the module global {name}"),
        )?;
        if bytes != 4 * N {
            return Err(GpuError::BadArgument {
                op: "read_i32_global",
                detail: format!("{name} is {bytes} bytes, expected {}", 4 * N),
            });
        }
        let mut out = [0i32; N];
        // SAFETY: the global is exactly 4·N bytes (checked) and `out` holds 4·N bytes.
        check(
            unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), ptr, bytes) },
            "cuMemcpyDtoH",
            || format!("reading the module global {name}"),
        )?;
        Ok(out)
    }
}

impl CudaFunction {
    /// Registers, spills and shared memory of this kernel.
    pub fn attrs(&self) -> Result<FunctionAttrs> {
        use sys::CUfunction_attribute as F;
        self.module.ctx.bind()?;
        let get = |a: F, what: &'static str| -> Result<i32> {
            let mut v = 0;
            // SAFETY: valid function handle; out-pointer is a local.
            check(
                unsafe { sys::cuFuncGetAttribute(&mut v, a, self.func) },
                "cuFuncGetAttribute",
                || format!("reading {what} of {}", self.name),
            )?;
            Ok(v)
        };
        Ok(FunctionAttrs {
            registers: get(F::CU_FUNC_ATTRIBUTE_NUM_REGS, "registers")?,
            local_bytes: get(F::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, "local memory")?,
            static_shared_bytes: get(F::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, "shared memory")?,
            max_threads_per_block: get(F::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, "max threads")?,
        })
    }

    /// Queue a launch on the device's stream.
    ///
    /// # Safety
    /// `params` must point to values whose types and order match the kernel's signature
    /// exactly, and every device address among them must be valid for all accesses the
    /// kernel makes with the given grid (callers check shapes against buffer sizes).
    pub(crate) unsafe fn launch(
        &self,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the caller upholds this function's contract, which is launch_smem's.
        unsafe { self.launch_smem(grid, block, 0, params) }
    }

    /// [`Self::launch`] with `smem` bytes of dynamic shared memory; the function's limit is
    /// raised to it first (the device must have them: the caller checks against the
    /// device's opt-in maximum).
    ///
    /// # Safety
    /// As [`Self::launch`].
    pub(crate) unsafe fn launch_smem(
        &self,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let ctx = &self.module.ctx;
        ctx.bind()?;
        use std::sync::atomic::Ordering;
        // Static and dynamic shared memory together may not pass 48 KiB without the raise,
        // so any dynamic amount above what was allowed raises it (once per size).
        if smem > 0 && smem > self.smem_allowed.load(Ordering::Relaxed) {
            // SAFETY: valid function handle of the bound context; a plain attribute write.
            check(
                unsafe {
                    sys::cuFuncSetAttribute(
                        self.func,
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        smem as c_int,
                    )
                },
                "cuFuncSetAttribute",
                || format!("allowing {} {smem} bytes of shared memory", self.name),
            )?;
            self.smem_allowed.fetch_max(smem, Ordering::Relaxed);
        }
        let what = || {
            format!(
                "launching {} with grid {grid:?} x {block} threads",
                self.name
            )
        };
        if ctx.pdl && ctx.pdl_now.load(std::sync::atomic::Ordering::Relaxed) {
            let mut attr = sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value: sys::CUlaunchAttributeValue { pad: [0; 64] },
            };
            attr.value.programmaticStreamSerializationAllowed = 1;
            let config = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: smem,
                hStream: ctx.stream,
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: as the plain launch below; `config` and `attr` are locals that outlive
            // the call. Every kernel waits (ds4_grid_wait) before touching data an earlier
            // kernel wrote, which is what the serialization attribute requires.
            return check(
                unsafe {
                    sys::cuLaunchKernelEx(
                        &config,
                        self.func,
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                },
                "cuLaunchKernelEx",
                what,
            );
        }
        // SAFETY: per the function contract; `smem` bytes of dynamic shared memory were
        // allowed above; `params` stays borrowed for the call and the driver copies the
        // argument values at launch.
        check(
            unsafe {
                sys::cuLaunchKernel(
                    self.func,
                    grid.0,
                    grid.1,
                    grid.2,
                    block,
                    1,
                    1,
                    smem,
                    ctx.stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "cuLaunchKernel",
            what,
        )
    }

    pub(crate) fn ctx_id(&self) -> usize {
        Arc::as_ptr(&self.module.ctx) as usize
    }
}
