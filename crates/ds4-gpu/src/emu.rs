//! The kernels on the CPU: the kernel modules (`kernels/gemv.cu`, `ops.cu`, `tiles.cu`, with
//! every file they include) compiled by the host's C++ compiler against a CPU version of
//! `ds4_port.h` (`crates/ds4-gpu/emu/`), loaded as a shared library and run block by block
//! with each GPU thread a fiber. The fake HIP runtime
//! ([`crate::hip::fake::FakeHip::with_kernels`]) launches through it, so the whole GPU
//! backend — host logic and kernels — runs in ordinary tests and meets the CPU backend in
//! the op mirror without a GPU.
//!
//! Why not trust the kernels to the H200 runs alone: device time is scarce, and most kernel
//! bugs are logic (an index, a barrier, a decode, a fragment layout) that an emulation
//! finds as well. What it cannot find: speed, the GPU memory model, and the exact rounding
//! of the GPU's math library (`expf` differs by ulps).
//!
//! Needs a C++20 compiler (`$CXX`, else `c++`); the library is cached in the temp
//! directory by a hash of the sources.

use std::ffi::{c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::kernels::{KernelSource, ALL};

const CPU_PORT_H: &str = include_str!("../emu/ds4_port.h");
const RUNTIME_CPP: &str = include_str!("../emu/runtime.cpp");

/// Errors of the emulation (building it, or a launch it refused).
#[derive(Debug, thiserror::Error)]
pub enum EmuError {
    #[error("kernel emulation: {0}")]
    Build(String),
    #[error("kernel emulation: {kernel}: {problem}")]
    Launch { kernel: String, problem: String },
}

type Thunk = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
type RunFn = unsafe extern "C" fn(
    Thunk,
    *mut *mut c_void,
    c_int,
    u32,
    u32,
    u32,
    u32,
    *mut c_char,
    c_int,
) -> c_int;

/// The compiled kernels.
pub struct EmuKernels {
    lib: libloading::Library,
    run: RunFn,
}

impl std::fmt::Debug for EmuKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EmuKernels")
    }
}

fn compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".into())
}

/// `-fno-gnu-unique` for GCC. GCC gives the static locals of inline functions and
/// templates — here the kernels' `__shared__` arrays, emulated as function statics — the
/// binding STB_GNU_UNIQUE: one object per process across every library loaded, even with
/// RTLD_LOCAL. Two builds with different defines in one test process then shared each
/// other's "shared memory" (a build whose table array was smaller, loaded first, made the
/// default build's IQ2_XXS rows wrong). Clang emits no such symbols and has no such flag.
fn gnu_unique_off() -> Vec<&'static str> {
    let version = Command::new(compiler()).arg("--version").output();
    let clang = version.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("clang"));
    if clang {
        Vec::new()
    } else {
        vec!["-fno-gnu-unique"]
    }
}

fn run(cmd: &mut Command, what: &str) -> Result<Vec<u8>, EmuError> {
    let out = cmd
        .output()
        .map_err(|e| EmuError::Build(format!("{what}: cannot run {:?}: {e}", cmd.get_program())))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: String = err.lines().take(40).collect::<Vec<_>>().join("\n");
        return Err(EmuError::Build(format!("{what} failed:\n{tail}")));
    }
    Ok(out.stdout)
}

/// Names of the `extern "C"` kernels of a preprocessed source: with `__global__` defined
/// as a marker, every kernel reads `<marker> void <name>(`.
fn kernel_names(preprocessed: &str) -> Vec<String> {
    const MARK: &str = "__ds4emu_kernel__";
    let mut names = Vec::new();
    for piece in preprocessed.split(MARK).skip(1) {
        let rest = piece.trim_start();
        let Some(rest) = rest.strip_prefix("void") else {
            continue;
        };
        let name: String = rest
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() && !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

fn write(dir: &Path, name: &str, text: &str) -> Result<(), EmuError> {
    std::fs::write(dir.join(name), text)
        .map_err(|e| EmuError::Build(format!("writing {}: {e}", dir.join(name).display())))
}

impl EmuKernels {
    /// Builds (or finds in the cache) the emulation of every kernel module.
    pub fn build() -> Result<EmuKernels, EmuError> {
        Self::build_with(&[])
    }

    /// [`EmuKernels::build`] with extra compiler arguments (e.g. `-DDS4_EMU_NO_MMA`: the
    /// kernels' paths for GPUs without matrix instructions, as on HIP).
    pub fn build_with(extra: &[&str]) -> Result<EmuKernels, EmuError> {
        let mut h = Sha256::new();
        for e in extra {
            h.update(e.as_bytes());
            h.update([0]);
        }
        h.update(CPU_PORT_H.as_bytes());
        h.update(RUNTIME_CPP.as_bytes());
        h.update(compiler().as_bytes());
        h.update(b"-fno-gnu-unique");
        for k in ALL {
            h.update(k.hash());
        }
        let key: String = h.finalize()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let lib_path = std::env::temp_dir().join(format!("ds4-emu-{key}.so"));
        if !lib_path.exists() {
            Self::compile(&lib_path, extra)?;
        }
        Self::open(&lib_path)
    }

    fn compile(lib_path: &Path, extra: &[&str]) -> Result<(), EmuError> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |t| t.subsec_nanos());
        let dir =
            std::env::temp_dir().join(format!("ds4-emu-build-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .map_err(|e| EmuError::Build(format!("creating {}: {e}", dir.display())))?;
        let result = Self::compile_in(&dir, lib_path, extra);
        let _ = std::fs::remove_dir_all(&dir);
        result
    }

    fn compile_in(d: &Path, lib_path: &Path, extra: &[&str]) -> Result<(), EmuError> {
        // The CPU port takes the name of the GPU one, so the sources' #include finds it.
        write(d, "ds4_port.h", CPU_PORT_H)?;
        write(d, "runtime.cpp", RUNTIME_CPP)?;
        let mut units = vec![PathBuf::from("runtime.cpp")];
        for k in ALL {
            Self::unit(d, k, &mut units)?;
        }
        // Unique per process *and* per call: tests build in parallel threads of one process.
        static BUILDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = lib_path.with_extension(format!("{}-{n}.tmp", std::process::id()));
        let mut cmd = Command::new(compiler());
        cmd.current_dir(d)
            .args([
                "-std=c++20",
                "-O1",
                "-fPIC",
                "-shared",
                "-ffp-contract=off",
                "-w",
            ])
            .args(gnu_unique_off())
            .args(extra)
            .args(&units)
            .arg("-o")
            .arg(&tmp);
        run(&mut cmd, "compiling the kernel emulation")?;
        std::fs::rename(&tmp, lib_path)
            .map_err(|e| EmuError::Build(format!("caching {}: {e}", lib_path.display())))
    }

    /// Writes kernel module `k` (its root and the files it includes) and a translation unit exporting one unpacking thunk per
    /// kernel (`ds4emu_t_<name>`).
    fn unit(d: &Path, k: &KernelSource, units: &mut Vec<PathBuf>) -> Result<(), EmuError> {
        for (name, text) in k.headers {
            if *name != "ds4_port.h" {
                write(d, name, text)?;
            }
        }
        write(d, k.name, k.source)?;
        let pre = run(
            Command::new(compiler()).current_dir(d).args([
                "-std=c++20",
                "-E",
                "-D__global__=__ds4emu_kernel__",
                "-x",
                "c++",
                k.name,
            ]),
            "preprocessing",
        )?;
        let names = kernel_names(&String::from_utf8_lossy(&pre));
        if names.is_empty() {
            return Err(EmuError::Build(format!("{}: no kernels found", k.name)));
        }
        let mut reg = format!(
            "#include \"{}\"\n#include <utility>\n\
             template <class... A, unsigned long... I>\n\
             static void ds4emu_call(void (*f)(A...), void** p, std::index_sequence<I...>) {{ f(*(A*)p[I]...); }}\n\
             template <class... A> static int ds4emu_thunk(void (*f)(A...), void** p, int n) {{\n\
               if (n < 0) return (int)sizeof...(A) == -n ? 0 : 1;\n\
               ds4emu_call(f, p, std::index_sequence_for<A...>{{}});\n  return 0;\n}}\n",
            k.name
        );
        for n in &names {
            reg += &format!(
                "extern \"C\" int ds4emu_t_{n}(void** p, int n) {{ return ds4emu_thunk({n}, p, n); }}\n"
            );
        }
        let unit = format!("reg_{}.cpp", k.name.trim_end_matches(".cu"));
        write(d, &unit, &reg)?;
        units.push(PathBuf::from(unit));
        Ok(())
    }

    fn open(path: &Path) -> Result<EmuKernels, EmuError> {
        // SAFETY: a library this module compiled from the project's own sources; its
        // initialisers only set up statics.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| EmuError::Build(format!("loading {}: {e}", path.display())))?;
        // SAFETY: `ds4emu_run` is defined in runtime.cpp with exactly this signature.
        let run = unsafe { lib.get::<RunFn>(b"ds4emu_run\0") }
            .map_err(|e| EmuError::Build(format!("ds4emu_run: {e}")))?;
        let run = *run;
        Ok(EmuKernels { lib, run })
    }

    /// Whether kernel `name` exists.
    pub fn has(&self, name: &str) -> bool {
        self.thunk(name).is_some()
    }

    fn thunk(&self, name: &str) -> Option<Thunk> {
        let sym = format!("ds4emu_t_{name}\0");
        // SAFETY: every `ds4emu_t_*` symbol is a thunk of type `Thunk` (generated above).
        unsafe { self.lib.get::<Thunk>(sym.as_bytes()) }
            .ok()
            .map(|s| *s)
    }

    /// Address of module global `name` (e.g. a GEMV configuration), if defined.
    pub fn global(&self, name: &str) -> Option<u64> {
        let sym = format!("{name}\0");
        // SAFETY: only the address is taken; the symbol is data of the library, alive as
        // long as `self`.
        unsafe { self.lib.get::<*const c_void>(sym.as_bytes()) }
            .ok()
            .map(|s| *s as u64)
    }

    /// Runs kernel `name` over `grid` with `block` threads; `params` point at the
    /// argument values (the CUDA/HIP launch convention).
    ///
    /// # Safety
    /// Every pointer argument must be valid for what the kernel reads and writes, as on a
    /// GPU; `params` must hold the kernel's parameters in order.
    pub unsafe fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), EmuError> {
        let thunk = self.thunk(name).ok_or_else(|| EmuError::Launch {
            kernel: name.into(),
            problem: "no such kernel".into(),
        })?;
        let mut err = vec![0 as c_char; 512];
        let n = c_int::try_from(params.len()).unwrap_or(c_int::MAX);
        // SAFETY: thunk and run come from the library; the caller vouches for params.
        let rc = unsafe {
            (self.run)(
                thunk,
                params.as_mut_ptr(),
                n,
                grid.0,
                grid.1,
                grid.2,
                block,
                err.as_mut_ptr(),
                err.len() as c_int,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: runtime.cpp wrote a NUL-terminated message into err (snprintf).
        let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        Err(EmuError::Launch {
            kernel: name.into(),
            problem: msg,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A xorshift64 stream (test data only).
    fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        }
    }

    /// Runs GEMV `name` (y = W x with the plain entry points' parameters) over `grid_x`
    /// blocks; the outputs start as NaN, so a row left unwritten shows.
    #[allow(clippy::too_many_arguments)]
    fn run_gemv(
        k: &EmuKernels,
        name: &str,
        grid_x: u32,
        block: u32,
        w: &[u8],
        x: &[f32],
        n_out: usize,
        wpr: u32,
    ) -> Vec<f32> {
        let mut y = vec![f32::NAN; n_out];
        let (mut wp, mut xp, mut yp) =
            (w.as_ptr() as u64, x.as_ptr() as u64, y.as_mut_ptr() as u64);
        let (mut ni, mut no, mut wpr) = (x.len() as i32, n_out as i32, wpr as i32);
        let mut params: Vec<*mut c_void> = vec![
            (&mut wp as *mut u64).cast(),
            (&mut xp as *mut u64).cast(),
            (&mut yp as *mut u64).cast(),
            (&mut ni as *mut i32).cast(),
            (&mut no as *mut i32).cast(),
            (&mut wpr as *mut i32).cast(),
        ];
        // SAFETY: callers pass n_out rows of x.len() values in the kernel's layout and x, y
        // as sized; the parameters are the GEMV entry point's, in order.
        unsafe { k.launch(name, (grid_x, 1, 1), block, &mut params) }.unwrap();
        y
    }

    /// Runs a several-column GEMV (`ds4_gemv_cols_<t>`) over `grid_x` blocks: x holds `cols`
    /// rows of `x_stride` floats, the result `cols` rows of `y_stride` floats starting as NaN.
    #[allow(clippy::too_many_arguments)]
    fn run_gemv_cols(
        k: &EmuKernels,
        name: &str,
        (grid_x, block): (u32, u32),
        w: &[u8],
        (x, x_stride): (&[f32], usize),
        (n_in, n_out, cols, y_stride): (usize, usize, usize, usize),
        wpr: u32,
    ) -> Vec<f32> {
        let mut y = vec![f32::NAN; cols * y_stride];
        let (mut wp, mut xp, mut yp) =
            (w.as_ptr() as u64, x.as_ptr() as u64, y.as_mut_ptr() as u64);
        let (mut xs, mut ys) = (x_stride as u64, y_stride as u64);
        let (mut ni, mut no, mut nc, mut wpr) =
            (n_in as i32, n_out as i32, cols as i32, wpr as i32);
        let mut params: Vec<*mut c_void> = vec![
            (&mut wp as *mut u64).cast(),
            (&mut xp as *mut u64).cast(),
            (&mut xs as *mut u64).cast(),
            (&mut yp as *mut u64).cast(),
            (&mut ys as *mut u64).cast(),
            (&mut ni as *mut i32).cast(),
            (&mut no as *mut i32).cast(),
            (&mut nc as *mut i32).cast(),
            (&mut wpr as *mut i32).cast(),
        ];
        let grid = (grid_x, 1, 1);
        // SAFETY: callers pass n_out rows of n_in values in the kernel's layout, x of cols
        // rows of x_stride floats; y is sized here; the parameters are the entry point's.
        unsafe { k.launch(name, grid, block, &mut params) }.unwrap();
        y
    }

    #[test]
    fn kernel_names_read_the_marker() {
        let t = "extern \"C\" __ds4emu_kernel__ void ds4_a(int x) {}\n\
                 extern \"C\" __ds4emu_kernel__ void  ds4_b (float* y);\n\
                 __ds4emu_kernel__ int not_a_kernel;";
        assert_eq!(kernel_names(t), vec!["ds4_a", "ds4_b"]);
    }

    /// The emulation builds, runs a kernel and refuses a wrong parameter count.
    #[test]
    fn a_kernel_runs_on_the_cpu() {
        let k = EmuKernels::build().unwrap();
        assert!(k.has("ds4_fill") && k.has("ds4_mm_tiles") && k.has("ds4_gemv_q8_0"));
        let mut out = vec![0f32; 1000];
        let (mut p, mut n, mut v) = (out.as_mut_ptr() as u64, 1000u64, 2.5f32);
        let mut params: Vec<*mut c_void> = vec![
            (&mut p as *mut u64).cast(),
            (&mut n as *mut u64).cast(),
            (&mut v as *mut f32).cast(),
        ];
        // SAFETY: out holds n floats; the parameters are ds4_fill's (ptr, count, value).
        unsafe { k.launch("ds4_fill", (2, 1, 1), 256, &mut params) }.unwrap();
        assert!(out.iter().all(|&x| x == 2.5));
        // SAFETY: refused before running (parameter count).
        let e = unsafe { k.launch("ds4_fill", (1, 1, 1), 32, &mut params[..2]) };
        assert!(e.is_err());
    }

    /// The split-layout Q8_0 path on shapes the tiny models do not reach (several vectors
    /// per lane, the depth-D main loop, several warps per row): the device-side split
    /// equals the host's, and the GEMV of the split rows equals the CPU's dot product of
    /// the file's rows, also for rows past the last full group and for wide rows.
    #[test]
    fn q8_0_split_and_gemv_match_the_cpu() {
        q8_0_cases(&EmuKernels::build().unwrap());
    }

    /// `n_out` random Q8_0 rows of `n_in` values in ggml's layout (small positive scales)
    /// and an input in [-1, 1].
    fn random_q8_0(
        next: &mut impl FnMut() -> u64,
        n_in: usize,
        n_out: usize,
    ) -> (Vec<u8>, Vec<f32>) {
        let mut w = vec![0u8; n_out * n_in / 32 * 34];
        for (i, b) in w.iter_mut().enumerate() {
            *b = (next() >> (i % 7)) as u8;
        }
        for blk in w.chunks_exact_mut(34) {
            let d = half::f16::from_f32(0.001 + (next() % 1000) as f32 * 1e-5);
            blk[..2].copy_from_slice(&d.to_bits().to_le_bytes());
        }
        let x = (0..n_in)
            .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        (w, x)
    }

    fn q8_0_cases(k: &EmuKernels) {
        use crate::kernels::{gemv_launch, q8_0_split_rows, GemvType};
        use ds4_gguf::GgmlType;
        let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
        for (n_in, n_out) in [
            (4096usize, 21usize),
            (1024, 64),
            (8192, 3),
            (256, 5),
            (1536, 7),
        ] {
            let nb = n_in / 32;
            let (w, x) = random_q8_0(&mut next, n_in, n_out);
            let want: Vec<f32> = w
                .chunks_exact(nb * 34)
                .map(|row| ds4_gguf::quant::dot(GgmlType::Q8_0, row, &x).unwrap())
                .collect();
            // The device split, in place, against the host's.
            let mut dev = w.clone();
            let mut host = w.clone();
            q8_0_split_rows(&mut host, n_in).unwrap();
            let (mut p, mut rows, mut n) = (dev.as_mut_ptr() as u64, n_out as u64, n_in as i32);
            let mut params: Vec<*mut c_void> = vec![
                (&mut p as *mut u64).cast(),
                (&mut rows as *mut u64).cast(),
                (&mut n as *mut i32).cast(),
            ];
            // SAFETY: dev holds n_out rows of n_in Q8_0 values.
            unsafe { k.launch("ds4_q8_0_split", (4, 1, 1), 256, &mut params) }.unwrap();
            assert!(
                dev == host,
                "{n_in}x{n_out}: device split differs from the host's"
            );
            for target in [1u64, 1 << 20] {
                let cfg = crate::kernels::GemvType::Q8_0.default_config();
                let l =
                    gemv_launch(GemvType::Q8_0, cfg, n_in as u64, n_out as u64, target).unwrap();
                let y = run_gemv(
                    k,
                    "ds4_gemv_q8_0",
                    l.grid_x,
                    l.block,
                    &dev,
                    &x,
                    n_out,
                    l.wpr,
                );
                for (r, (g, c)) in y.iter().zip(&want).enumerate() {
                    let tol = 1e-5 * (1.0 + c.abs());
                    assert!(
                        (g - c).abs() <= tol,
                        "{n_in}x{n_out} wpr {}: row {r}: {g} vs {c}",
                        l.wpr
                    );
                }
            }
        }
    }

    /// The split-layout Q8_0 GEMV with int8 activations (`ds4_gemvq_q8s`): persistent
    /// grids of 1, 2, 3 blocks and the full grid, warps per row 1 to 8 (units of 32 per
    /// part, as `GemvSet::q8_launch` configures it) and one and several items per step: the
    /// outputs equal the CPU's int8-activation dot products of the unsplit rows.
    #[test]
    fn q8_0_int8_gemv_matches_the_cpu() {
        use crate::kernels::{gemv_launch, q8_0_split_rows, GemvConfig, GemvType};
        use ds4_gguf::quant::q8act::{dot, ActQ8};
        use ds4_gguf::GgmlType;
        let mut next = xorshift(0xD1B5_4A32_D192_ED03);
        let k = EmuKernels::build().unwrap();
        for (n_in, n_out) in [
            (4096usize, 21usize),
            (1024, 64),
            (8192, 3),
            (256, 5),
            (2048, 40),
        ] {
            let nb = n_in / 32;
            let (w, x) = random_q8_0(&mut next, n_in, n_out);
            let mut xq = ActQ8::default();
            xq.quantize(&x).unwrap();
            let want: Vec<f32> = w
                .chunks_exact(nb * 34)
                .map(|row| dot(GgmlType::Q8_0, row, &xq).unwrap())
                .collect();
            let mut split = w.clone();
            q8_0_split_rows(&mut split, n_in).unwrap();
            let cfg = GemvConfig {
                rows: GemvType::Q8_0.default_config().rows,
                chunk_blocks: 32,
            };
            for target in [1u64, 1 << 20] {
                let l =
                    gemv_launch(GemvType::Q8_0, cfg, n_in as u64, n_out as u64, target).unwrap();
                for grid_x in [1, 2, 3, l.grid_x] {
                    let y = run_gemv(
                        &k,
                        "ds4_gemv_q_q8_0",
                        grid_x,
                        l.block,
                        &split,
                        &x,
                        n_out,
                        l.wpr,
                    );
                    for (r, (g, c)) in y.iter().zip(&want).enumerate() {
                        assert!(
                            (g - c).abs() <= 1e-5 * (1.0 + c.abs()),
                            "{n_in}x{n_out} wpr {} grid {grid_x}: row {r}: {g} vs {c}",
                            l.wpr
                        );
                    }
                }
            }
        }
    }

    /// `ds4_quantize_q8_rows` over `rows` rows of `n_in` floats `row_stride` apart, then
    /// `ds4_gemv_cols_q_q8_0` over `groups` matrices of `n_out` rows (`group_bytes` apart)
    /// for `cols` tokens, outputs `y_stride` apart (NaN where nothing was written).
    #[allow(clippy::too_many_arguments)]
    fn run_q8_cols(
        k: &EmuKernels,
        grid_x: u32,
        block: u32,
        (w, group_bytes, groups): (&[u8], usize, usize),
        (x, row_stride): (&[f32], usize),
        (n_in, n_out, cols, y_stride): (usize, usize, usize, usize),
        wpr: u32,
    ) -> Vec<f32> {
        let rows = cols * groups;
        let mut q = vec![0u128; rows * n_in / 16];
        let mut d = vec![0f32; rows * n_in / 32];
        let mut s16 = vec![0i32; rows * n_in / 16];
        let (mut xp, mut rs, mut ni) = (x.as_ptr() as u64, row_stride as u64, n_in as i32);
        let (mut qp, mut dp, mut sp) = (
            q.as_mut_ptr() as u64,
            d.as_mut_ptr() as u64,
            s16.as_mut_ptr() as u64,
        );
        let mut params: Vec<*mut c_void> = vec![
            (&mut xp as *mut u64).cast(),
            (&mut rs as *mut u64).cast(),
            (&mut ni as *mut i32).cast(),
            (&mut qp as *mut u64).cast(),
            (&mut dp as *mut u64).cast(),
            (&mut sp as *mut u64).cast(),
        ];
        // SAFETY: x holds `rows` rows of n_in floats row_stride apart; q, d and s16 are sized
        // for them here; the parameters are the entry point's.
        unsafe {
            k.launch(
                "ds4_quantize_q8_rows",
                (rows as u32, 1, 1),
                block,
                &mut params,
            )
        }
        .unwrap();
        let mut y = vec![f32::NAN; cols * y_stride];
        let (mut wp, mut gb, mut yp) =
            (w.as_ptr() as u64, group_bytes as u64, y.as_mut_ptr() as u64);
        let (mut qc, mut ys) = (groups as i32, y_stride as u64);
        let (mut no, mut nc, mut wpr) = (n_out as i32, cols as i32, wpr as i32);
        let mut params: Vec<*mut c_void> = vec![
            (&mut wp as *mut u64).cast(),
            (&mut gb as *mut u64).cast(),
            (&mut qp as *mut u64).cast(),
            (&mut dp as *mut u64).cast(),
            (&mut qc as *mut i32).cast(),
            (&mut yp as *mut u64).cast(),
            (&mut ys as *mut u64).cast(),
            (&mut ni as *mut i32).cast(),
            (&mut no as *mut i32).cast(),
            (&mut nc as *mut i32).cast(),
            (&mut wpr as *mut i32).cast(),
        ];
        let grid = (grid_x, groups as u32, 1);
        // SAFETY: w holds `groups` matrices of n_out split-layout rows group_bytes apart, q / d
        // the quantized rows made above, y cols rows of y_stride; the entry point's parameters.
        unsafe { k.launch("ds4_gemv_cols_q_q8_0", grid, block, &mut params) }.unwrap();
        y
    }

    /// The several-column Q8_0 GEMV (`ds4_gemv_cols_q_q8_0`, batched decode) on inputs
    /// quantized once (`ds4_quantize_q8_rows`): for 1 to 8 columns with padded strides, one
    /// matrix or two groups (grid y, `out_a`'s shape), persistent grids of 1, 3 and the full
    /// grid, every column's outputs are bit-for-bit the one-token kernel's on that column
    /// alone (the host relies on it: a batched decode row equals the row decoded alone).
    #[test]
    fn q8_0_columns_equal_one_token_each() {
        use crate::kernels::{gemv_launch, q8_0_split_rows, GemvConfig, GemvType};
        let k = EmuKernels::build().unwrap();
        let mut next = xorshift(0xA076_1D64_78BD_642F);
        for (n_in, n_out, cols, groups) in [
            (4096usize, 21usize, 8usize, 1usize),
            (1024, 64, 3, 1),
            (8192, 5, 4, 1),
            // Eight columns of out_b's width: 64 K codes (CUDA's dynamic staging).
            (8192, 6, 8, 1),
            (256, 7, 2, 1),
            // A short last run of units (40 = 32 + 8): the split code layout's edge.
            (1280, 9, 3, 1),
            (2048, 13, 5, 2),
        ] {
            let (w, _) = random_q8_0(&mut next, n_in, n_out * groups);
            let mut split = w.clone();
            q8_0_split_rows(&mut split, n_in).unwrap();
            let group_bytes = n_out * n_in / 32 * 34;
            // One matrix: padded rows; groups: each token's groups follow each other.
            let xs = if groups == 1 {
                n_in + 32
            } else {
                groups * n_in
            };
            let row_stride = if groups == 1 { xs } else { n_in };
            let ys = groups * n_out + 3;
            let x: Vec<f32> = (0..cols * xs)
                .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            let cfg = GemvConfig {
                rows: GemvType::Q8_0.default_config().rows,
                chunk_blocks: 32,
            };
            for target in [1u64, 1 << 20] {
                let l =
                    gemv_launch(GemvType::Q8_0, cfg, n_in as u64, n_out as u64, target).unwrap();
                // alone[c][g]: column c through matrix g, one token.
                let alone: Vec<Vec<Vec<f32>>> = (0..cols)
                    .map(|c| {
                        (0..groups)
                            .map(|g| {
                                let x0 = c * xs + g * n_in;
                                run_gemv(
                                    &k,
                                    "ds4_gemv_q_q8_0",
                                    l.grid_x,
                                    l.block,
                                    &split[g * group_bytes..(g + 1) * group_bytes],
                                    &x[x0..x0 + n_in],
                                    n_out,
                                    l.wpr,
                                )
                            })
                            .collect()
                    })
                    .collect();
                for grid_x in [1, 3, l.grid_x] {
                    let y = run_q8_cols(
                        &k,
                        grid_x,
                        l.block,
                        (&split, group_bytes, groups),
                        (&x, row_stride),
                        (n_in, n_out, cols, ys),
                        l.wpr,
                    );
                    for (c, per_group) in alone.iter().enumerate() {
                        for (g, want) in per_group.iter().enumerate() {
                            for (r, v) in want.iter().enumerate() {
                                let got = y[c * ys + g * n_out + r];
                                assert_eq!(
                                    got.to_bits(),
                                    v.to_bits(),
                                    "{n_in}x{n_out} col {c} group {g} row {r} wpr {} grid {grid_x}: {got} vs {v}",
                                    l.wpr
                                );
                            }
                        }
                        assert!(
                            y[c * ys + groups * n_out..c * ys + ys]
                                .iter()
                                .all(|v| v.is_nan()),
                            "wrote past the rows"
                        );
                    }
                }
            }
        }
    }

    /// `ds4_repeat_rows` gives selection j its token's row j / k.
    #[test]
    fn repeat_rows_gives_each_selection_its_token() {
        let k = EmuKernels::build().unwrap();
        let (toks, sel_per_tok, d) = (3usize, 6usize, 40usize);
        let x: Vec<f32> = (0..toks * d).map(|i| i as f32).collect();
        let mut out = vec![f32::NAN; toks * sel_per_tok * d];
        let (mut xp, mut op) = (x.as_ptr() as u64, out.as_mut_ptr() as u64);
        let (mut kk, mut n, mut dd) = (sel_per_tok as i32, (toks * sel_per_tok) as i32, d as i32);
        let mut params: Vec<*mut c_void> = vec![
            (&mut xp as *mut u64).cast(),
            (&mut kk as *mut i32).cast(),
            (&mut n as *mut i32).cast(),
            (&mut dd as *mut i32).cast(),
            (&mut op as *mut u64).cast(),
        ];
        // SAFETY: x holds toks rows of d, out toks * k rows of d; the kernel's parameters.
        unsafe { k.launch("ds4_repeat_rows", (2, 1, 1), 256, &mut params) }.unwrap();
        for j in 0..toks * sel_per_tok {
            assert_eq!(
                &out[j * d..(j + 1) * d],
                &x[(j / sel_per_tok) * d..(j / sel_per_tok + 1) * d],
                "selection {j}"
            );
        }
    }

    /// The several-column F32/F16 GEMVs (`ds4_gemv_cols_<t>`, batched decode): for 1 to 8
    /// columns with padded strides, with the one-token launch's warps per row (several and
    /// one) and the kernel's own rows per warp (its grid from `cols_grid_x`), every column's
    /// outputs are bit-for-bit the one-token GEMV's on that column, and rows past the end
    /// stay unwritten.
    #[test]
    fn plain_columns_equal_one_token_each() {
        use crate::kernels::{cols_grid_x, gemv_launch, GemvType};
        let k = EmuKernels::build().unwrap();
        let at = k.global("ds4_gemv_cols_rows").expect("ds4_gemv_cols_rows");
        // SAFETY: the global is a const int[2] of the library, alive as long as `k`.
        let rows = u32::try_from(unsafe { *(at as *const i32) }).unwrap();
        assert!(rows >= 1, "rows per warp {rows}");
        let mut next = xorshift(0x6C8E_9CF5_7093_2BD5);
        for (ty, name) in [(GemvType::F16, "f16"), (GemvType::F32, "f32")] {
            for (n_in, n_out, cols) in [
                (4096usize, 21usize, 8usize),
                (1024, 64, 3),
                (1024, 100, 8),
                (256, 7, 2),
                (16384, 24, 5),
            ] {
                let vals: Vec<f32> = (0..n_in * n_out)
                    .map(|_| (next() % 2001) as f32 / 4000.0 - 0.25)
                    .collect();
                let w: Vec<u8> = match ty {
                    GemvType::F16 => vals
                        .iter()
                        .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes())
                        .collect(),
                    _ => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
                };
                let (xs, ys) = (n_in + 8, n_out + 3);
                let x: Vec<f32> = (0..cols * xs)
                    .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
                    .collect();
                for target in [1u64, 1 << 20] {
                    let l = gemv_launch(ty, ty.default_config(), n_in as u64, n_out as u64, target)
                        .unwrap();
                    // The several-column kernel's own grid: more rows per warp (§35).
                    let grid = cols_grid_x(n_out as u64, l.wpr, rows).unwrap();
                    let y = run_gemv_cols(
                        &k,
                        &format!("ds4_gemv_cols_{name}"),
                        (grid, l.block),
                        &w,
                        (&x, xs),
                        (n_in, n_out, cols, ys),
                        l.wpr,
                    );
                    for c in 0..cols {
                        let xc = &x[c * xs..c * xs + n_in];
                        let alone = run_gemv(
                            &k,
                            &format!("ds4_gemv_{name}"),
                            l.grid_x,
                            l.block,
                            &w,
                            xc,
                            n_out,
                            l.wpr,
                        );
                        for (r, v) in alone.iter().enumerate() {
                            assert_eq!(
                                y[c * ys + r].to_bits(),
                                v.to_bits(),
                                "{name} {n_in}x{n_out} col {c} row {r} wpr {}: {} vs {v}",
                                l.wpr,
                                y[c * ys + r]
                            );
                        }
                        assert!(y[c * ys + n_out..c * ys + ys].iter().all(|v| v.is_nan()));
                    }
                }
            }
        }
    }

    /// The persistent int8-activation GEMV (`ds4_gemvq_quant`): with fewer blocks than row
    /// steps (each block walks several, prefetching the next step's first chunk) and with
    /// the full grid, the outputs equal the CPU's int8-activation dot products of the same
    /// rows, for one and several chunks per row and several warps per row, for Q2_K (units
    /// of 16 values) and IQ2_XXS (units of one 32-value group, the CPU's term exactly; also
    /// in HIP's form, one static table and masks from the sign table, `-DDS4_EMU_ONE_TABLE`).
    #[test]
    fn persistent_int8_gemv_matches_the_cpu() {
        use crate::kernels::{gemv_launch, GemvType};
        use ds4_gguf::quant::q8act::{dot, ActQ8};
        use ds4_gguf::GgmlType;
        // The default build first (builds with other defines share nothing with it: see
        // `gnu_unique_off`).
        let k = EmuKernels::build().unwrap();
        let one_table = EmuKernels::build_with(&["-DDS4_EMU_ONE_TABLE"]).unwrap();
        let mut next = xorshift(0x2545_F491_4F6C_DD1D);
        let cases = [
            (GemvType::Q2K, GgmlType::Q2K, "ds4_gemv_q_q2_k", &k, ""),
            (
                GemvType::Iq2Xxs,
                GgmlType::Iq2Xxs,
                "ds4_gemv_q_iq2_xxs",
                &k,
                "",
            ),
            (
                GemvType::Iq2Xxs,
                GgmlType::Iq2Xxs,
                "ds4_gemv_q_iq2_xxs",
                &one_table,
                " (one table, HIP's form)",
            ),
            (GemvType::Mxfp4, GgmlType::Mxfp4, "ds4_gemv_q_mxfp4", &k, ""),
        ];
        for (ty, gty, kernel, k, variant) in cases {
            for (n_in, n_out) in [(4096usize, 70usize), (2048, 33), (8192, 9)] {
                let rb = ty.row_bytes(n_in as u64).unwrap() as usize;
                let mut w = vec![0u8; n_out * rb];
                for b in w.iter_mut() {
                    *b = next() as u8;
                }
                // Random codes; the f16 block scales set to small finite values.
                let d = |next: &mut dyn FnMut() -> u64, base: f32| {
                    half::f16::from_f32(base + (next() % 100) as f32 * 1e-4)
                        .to_bits()
                        .to_le_bytes()
                };
                if gty == GgmlType::Q2K {
                    for blk in w.chunks_exact_mut(84) {
                        blk[80..82].copy_from_slice(&d(&mut next, 0.01));
                        blk[82..84].copy_from_slice(&d(&mut next, 0.005));
                    }
                } else if gty == GgmlType::Mxfp4 {
                    // E8M0 scales 2^-10 .. 2^-5 (byte e is 2^(e-128)), every code random.
                    for blk in w.chunks_exact_mut(17) {
                        blk[0] = 118 + (next() % 6) as u8;
                    }
                } else {
                    for blk in w.chunks_exact_mut(66) {
                        blk[0..2].copy_from_slice(&d(&mut next, 0.01));
                    }
                }
                let x: Vec<f32> = (0..n_in)
                    .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
                    .collect();
                let mut xq = ActQ8::default();
                xq.quantize(&x).unwrap();
                let want: Vec<f32> = w
                    .chunks_exact(rb)
                    .map(|row| dot(gty, row, &xq).unwrap())
                    .collect();
                for target in [1u64, 1 << 20] {
                    let l = gemv_launch(ty, ty.default_config(), n_in as u64, n_out as u64, target)
                        .unwrap();
                    for grid_x in [1, 2, l.grid_x] {
                        let y = run_gemv(k, kernel, grid_x, l.block, &w, &x, n_out, l.wpr);
                        for (r, (g, c)) in y.iter().zip(&want).enumerate() {
                            assert!(
                                g.is_finite() && (g - c).abs() <= 1e-5 * (1.0 + c.abs()),
                                "{kernel}{variant} {n_in}x{n_out} wpr {} grid {grid_x}: row {r}: {g} vs {c}",
                                l.wpr
                            );
                        }
                    }
                }
            }
        }
    }

    /// The f32-activation MXFP4 GEMVs (`ds4_gemv_mxfp4`, `ds4_gemv_grouped_mxfp4`: `--quality`
    /// decode) against the dequantized rows in f64, within f32 rounding of the terms' sizes;
    /// every scale byte a block can hold that keeps the row finite, every code; several warps
    /// per row and one; the grouped kernel's selections with an id out of range as NaN rows.
    #[test]
    fn mxfp4_f32_gemv_matches_the_cpu() {
        use crate::kernels::{gemv_launch, GemvType};
        use ds4_gguf::quant;
        use ds4_gguf::GgmlType;
        let k = EmuKernels::build().unwrap();
        let mut next = xorshift(0xD1B5_4A32_D192_ED03);
        let ty = GemvType::Mxfp4;
        for (n_in, n_out) in [(4096usize, 37usize), (2048, 70), (512, 5)] {
            let rb = ty.row_bytes(n_in as u64).unwrap() as usize;
            let mut w: Vec<u8> = (0..n_out * rb).map(|_| next() as u8).collect();
            for (i, blk) in w.chunks_exact_mut(17).enumerate() {
                // Scales 2^-128 .. 2^-1 (e = 0, 1 are the subnormal halves), cycling.
                blk[0] = (i % 128) as u8;
            }
            let x: Vec<f32> = (0..n_in)
                .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            let (want, size): (Vec<f64>, Vec<f64>) = w
                .chunks_exact(rb)
                .map(|row| {
                    let mut d = vec![0f32; n_in];
                    quant::dequantize(GgmlType::Mxfp4, row, &mut d).unwrap();
                    d.iter().zip(&x).fold((0f64, 0f64), |(s, a), (wv, xv)| {
                        let t = f64::from(*wv) * f64::from(*xv);
                        (s + t, a + t.abs())
                    })
                })
                .unzip();
            for target in [1u64, 1 << 20] {
                let l = gemv_launch(ty, ty.default_config(), n_in as u64, n_out as u64, target)
                    .unwrap();
                let y = run_gemv(
                    &k,
                    "ds4_gemv_mxfp4",
                    l.grid_x,
                    l.block,
                    &w,
                    &x,
                    n_out,
                    l.wpr,
                );
                for (r, g) in y.iter().enumerate() {
                    assert!(
                        g.is_finite() && (f64::from(*g) - want[r]).abs() <= 1e-6 * size[r] + 1e-30,
                        "{n_in}x{n_out} wpr {}: row {r}: {g} vs {}",
                        l.wpr,
                        want[r]
                    );
                }
                // Grouped: two selections of the one expert here and one bad id.
                let ids = [0i32, -3, 0];
                let mut y0 = vec![f32::NAN; 3 * n_out];
                let mut y1 = vec![f32::NAN; 3 * n_out];
                launch_args(
                    &k,
                    "ds4_gemv_grouped_mxfp4",
                    (l.grid_x, 3, 1),
                    l.block,
                    &[
                        P::U(w.as_ptr() as u64),
                        P::U(w.as_ptr() as u64),
                        P::U(w.len() as u64),
                        P::U(ids.as_ptr() as u64),
                        P::I(1),
                        P::U(x.as_ptr() as u64),
                        P::U(0),
                        P::U(y0.as_mut_ptr() as u64),
                        P::U(y1.as_mut_ptr() as u64),
                        P::I(n_in as i32),
                        P::I(n_out as i32),
                        P::I(l.wpr as i32),
                    ],
                );
                assert!(y0[n_out..2 * n_out].iter().all(|v| v.is_nan()), "bad id");
                for s in [0, 2] {
                    assert_eq!(&y0[s * n_out..(s + 1) * n_out], &y[..], "selection {s}");
                }
            }
        }
    }

    /// A kernel parameter for [`launch_args`]: pointers and sizes, ints, floats.
    enum P {
        U(u64),
        I(i32),
        F(f32),
    }

    /// Launches `name` with `args` (each value in an 8-byte slot whose low bytes are the
    /// parameter, as the device backends pass them).
    fn launch_args(k: &EmuKernels, name: &str, grid: (u32, u32, u32), block: u32, args: &[P]) {
        let mut slots: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                P::U(v) => v,
                P::I(v) => u64::from(v as u32),
                P::F(v) => u64::from(v.to_bits()),
            })
            .collect();
        let mut params: Vec<*mut c_void> =
            slots.iter_mut().map(|v| (v as *mut u64).cast()).collect();
        // SAFETY: the callers pass each kernel's parameters in order, with buffers of the
        // sizes its contract names.
        unsafe { k.launch(name, grid, block, &mut params) }.unwrap();
    }

    /// The routed experts' GEMVs on one flat grid (`ds4_gemv_flat_q_<t>`,
    /// `ds4_gemv_flat_swiglu_q_<t>`, docs/gpu.md §25) write, bit for bit, what the one-token
    /// kernel writes for each selection and matrix alone: selections of several tokens (each
    /// reading its token's row), repeated experts, flat grids of one block, a few blocks
    /// (ranges that cross matrices and inputs mid-way) and one per step; an expert id out of
    /// range gives NaN rows for its selection only (and the down kernel's fault bit).
    #[test]
    fn flat_grouped_gemvs_equal_one_matrix_each() {
        use crate::kernels::{gemv_launch, GemvType};
        let k = EmuKernels::build().unwrap();
        let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
        let (n_exp, per_tok, n_tok) = (5usize, 3usize, 2usize);
        let n_sel = per_tok * n_tok;
        for (ty, suffix, bb) in [
            (GemvType::Iq2Xxs, "iq2_xxs", 66usize),
            (GemvType::Q2K, "q2_k", 84),
            (GemvType::Q4K, "q4_k", 144),
            (GemvType::Mxfp4, "mxfp4", 17),
        ] {
            for (n_in, n_out) in [(2048usize, 40usize), (4096, 17)] {
                let rb = ty.row_bytes(n_in as u64).unwrap() as usize;
                let eb = rb * n_out;
                // Random codes with small finite f16 scales (each format's scale bytes).
                let mut mats: Vec<Vec<u8>> = (0..2)
                    .map(|_| (0..n_exp * eb).map(|_| next() as u8).collect())
                    .collect();
                for m in mats.iter_mut() {
                    for blk in m.chunks_exact_mut(bb) {
                        let h = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
                        let a = h(0.01 + (next() % 100) as f32 * 1e-4);
                        let b = h(0.005 + (next() % 100) as f32 * 1e-4);
                        match suffix {
                            "iq2_xxs" => blk[0..2].copy_from_slice(&a),
                            "mxfp4" => blk[0] = 118 + (next() % 6) as u8,
                            "q2_k" => {
                                blk[80..82].copy_from_slice(&a);
                                blk[82..84].copy_from_slice(&b);
                            }
                            _ => {
                                blk[0..2].copy_from_slice(&a);
                                blk[2..4].copy_from_slice(&b);
                            }
                        }
                    }
                }
                let x: Vec<f32> = (0..n_tok * n_in)
                    .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
                    .collect();
                let g: Vec<f32> = (0..n_sel * n_in)
                    .map(|_| (next() % 2001) as f32 / 500.0 - 2.0)
                    .collect();
                let u: Vec<f32> = (0..n_sel * n_in)
                    .map(|_| (next() % 2001) as f32 / 500.0 - 2.0)
                    .collect();
                let rw: Vec<f32> = (0..n_sel).map(|i| 0.25 + i as f32 * 0.1).collect();
                let clamp = 1.5f32;
                let l = gemv_launch(ty, ty.default_config(), n_in as u64, n_out as u64, 1 << 12)
                    .unwrap();
                for ids in [vec![4i32, 0, 4, 2, 1, 3], vec![1, 7, 0, -1, 2, 2]] {
                    let bad = |s: usize| ids[s] < 0 || ids[s] >= n_exp as i32;
                    // One token's kernel per selection and matrix (the reference).
                    let alone = |m: usize, s: usize, xin: &[f32]| -> Vec<f32> {
                        let e = ids[s] as usize;
                        run_gemv(
                            &k,
                            &format!("ds4_gemv_q_{suffix}"),
                            l.grid_x,
                            l.block,
                            &mats[m][e * eb..(e + 1) * eb],
                            xin,
                            n_out,
                            l.wpr,
                        )
                    };
                    let steps = l.grid_x * (2 * n_sel) as u32;
                    for grid_x in [1, 4, steps] {
                        let mut y0 = vec![f32::NAN; n_sel * n_out];
                        let mut y1 = vec![f32::NAN; n_sel * n_out];
                        launch_args(
                            &k,
                            &format!("ds4_gemv_flat_q_{suffix}"),
                            (grid_x, 1, 1),
                            l.block,
                            &[
                                P::U(mats[0].as_ptr() as u64),
                                P::U(mats[1].as_ptr() as u64),
                                P::U(eb as u64),
                                P::U(ids.as_ptr() as u64),
                                P::I(n_exp as i32),
                                P::I(n_sel as i32),
                                P::I(2),
                                P::U(x.as_ptr() as u64),
                                P::U(n_in as u64),
                                P::I(per_tok as i32),
                                P::U(y0.as_mut_ptr() as u64),
                                P::U(y1.as_mut_ptr() as u64),
                                P::I(n_in as i32),
                                P::I(n_out as i32),
                                P::I(l.wpr as i32),
                            ],
                        );
                        for s in 0..n_sel {
                            let t = s / per_tok;
                            for (m, y) in [&y0, &y1].into_iter().enumerate() {
                                let got = &y[s * n_out..(s + 1) * n_out];
                                if bad(s) {
                                    assert!(got.iter().all(|v| v.is_nan()), "{suffix} bad id");
                                    continue;
                                }
                                let want = alone(m, s, &x[t * n_in..(t + 1) * n_in]);
                                for (r, (a, b)) in got.iter().zip(&want).enumerate() {
                                    assert!(
                                        a.to_bits() == b.to_bits() && a.is_finite(),
                                        "{suffix} {n_in}x{n_out} grid {grid_x} sel {s} mat {m} row {r}: {a} vs {b}"
                                    );
                                }
                            }
                        }
                        // Down: the grouped SwiGLU kernel on its per-selection grid.
                        let mut want = vec![f32::NAN; n_sel * n_out];
                        let mut got = vec![f32::NAN; n_sel * n_out];
                        let (mut fault_a, mut fault_b) = (0i32, 0i32);
                        for (name, grid, y, fault) in [
                            (
                                format!("ds4_gemv_grouped_swiglu_q_{suffix}"),
                                (l.grid_x, n_sel as u32, 1),
                                &mut want,
                                &mut fault_a,
                            ),
                            (
                                format!("ds4_gemv_flat_swiglu_q_{suffix}"),
                                (grid_x, 1, 1),
                                &mut got,
                                &mut fault_b,
                            ),
                        ] {
                            let flat = name.contains("flat");
                            let mut a = vec![
                                P::U(mats[0].as_ptr() as u64),
                                P::U(eb as u64),
                                P::U(ids.as_ptr() as u64),
                                P::I(n_exp as i32),
                            ];
                            if flat {
                                a.push(P::I(n_sel as i32));
                            }
                            a.extend([
                                P::U(g.as_ptr() as u64),
                                P::U(u.as_ptr() as u64),
                                P::U(rw.as_ptr() as u64),
                                P::F(clamp),
                                P::U(y.as_mut_ptr() as u64),
                                P::I(n_in as i32),
                                P::I(n_out as i32),
                                P::I(l.wpr as i32),
                                P::U(fault as *mut i32 as u64),
                            ]);
                            launch_args(&k, &name, grid, l.block, &a);
                        }
                        assert_eq!(fault_a, fault_b, "{suffix} fault bits");
                        assert_eq!(
                            fault_b != 0,
                            ids.iter().any(|&e| e < 0 || e >= n_exp as i32)
                        );
                        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                            let s = i / n_out;
                            assert!(
                                a.to_bits() == b.to_bits() && (bad(s) || a.is_finite()),
                                "{suffix} down grid {grid_x} sel {s} row {}: {a} vs {b}",
                                i % n_out
                            );
                        }
                    }
                }
            }
        }
    }

    /// The head preparation with one warp per row (`ds4_norm_rope2_warps`) writes the same
    /// bits as the block per row (`ds4_norm_rope2`) it replaces for prefill-sized launches:
    /// query heads with and without a norm weight, a KV row with FP8 dims, positions from a
    /// start and step or per row, widths of the real model and of the tiny ones. (The host
    /// compiler contracts nothing; the GPU run compares whole prefills, docs/gpu.md §21.)
    #[test]
    fn norm_rope_warps_equal_a_block_per_row() {
        let k = EmuKernels::build().unwrap();
        let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
        let mut rnd = |scale: f32| ((next() % 20001) as f32 / 10000.0 - 1.0) * scale;
        // (width, rope_dim, heads_a, fp8_a, fp8_b, tokens, weight a, per-row positions)
        let cases = [
            (512usize, 64usize, 8usize, 0i32, 448i32, 5usize, true, false),
            (512, 64, 3, 448, 448, 4, false, true),
            (96, 32, 4, 0, 64, 7, true, false),
            (64, 16, 2, 32, 48, 3, true, true),
            (1024, 64, 2, 0, 960, 2, true, false),
        ];
        for (width, rope_dim, heads_a, fp8_a, fp8_b, tokens, with_w, per_row) in cases {
            let rows_a = heads_a * tokens;
            let xa0: Vec<f32> = (0..rows_a * width).map(|_| rnd(3.0)).collect();
            let xb0: Vec<f32> = (0..tokens * width).map(|_| rnd(3.0)).collect();
            let wa: Vec<f32> = (0..width).map(|_| rnd(1.0) + 1.5).collect();
            let wb: Vec<f32> = (0..width).map(|_| rnd(1.0) + 1.5).collect();
            let freqs: Vec<f32> = (0..rope_dim / 2)
                .map(|j| 10000f32.powf(-(2.0 * j as f32) / rope_dim as f32))
                .collect();
            let pos: Vec<i32> = (0..tokens as i32).map(|t| 3 * t + 11).collect();
            let run = |name: &str, grid: u32| {
                let (mut xa, mut xb) = (xa0.clone(), xb0.clone());
                let mut v: Vec<u64> = vec![
                    xa.as_mut_ptr() as u64,
                    if with_w { wa.as_ptr() as u64 } else { 0 },
                    heads_a as u64,
                    fp8_a as u32 as u64,
                    rows_a as u64,
                    xb.as_mut_ptr() as u64,
                    wb.as_ptr() as u64,
                    1,
                    fp8_b as u32 as u64,
                    width as u64,
                    u64::from(1e-6f32.to_bits()),
                    freqs.as_ptr() as u64,
                    rope_dim as u64,
                    7,
                    1,
                    if per_row { pos.as_ptr() as u64 } else { 0 },
                    0,
                    0,
                    (rows_a + tokens) as u64,
                ];
                if name == "ds4_norm_rope2" {
                    v.pop();
                }
                let mut params: Vec<*mut c_void> =
                    v.iter_mut().map(|p| (p as *mut u64).cast()).collect();
                // SAFETY: the parameters are the kernel's, in order (4-byte values in the low
                // bytes of their slots); xa, xb hold rows_a and `tokens` rows of `width`, the
                // weights `width`, freqs rope_dim / 2 and pos `tokens` values.
                unsafe { k.launch(name, (grid, 1, 1), 256, &mut params) }.unwrap();
                (xa, xb)
            };
            let rows = rows_a + tokens;
            let (ba, bb) = run("ds4_norm_rope2", rows as u32);
            let (wa_, wb_) = run("ds4_norm_rope2_warps", rows.div_ceil(8) as u32);
            assert!(ba.iter().chain(&bb).all(|x| x.is_finite()), "width {width}");
            assert_ne!(ba, xa0, "width {width}: the block kernel changed nothing");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&wa_), bits(&ba), "width {width}: query heads");
            assert_eq!(bits(&wb_), bits(&bb), "width {width}: KV rows");
        }
    }

    /// HCPost over the 2-D grid (`ds4_hc_post4`: tokens on y, streams unrolled) writes the
    /// same bits as the flat grid-stride `ds4_hc_post`, with and without the fused residual
    /// add, for a width that is not a multiple of the block (docs/gpu.md §21).
    #[test]
    fn hc_post4_equals_the_flat_kernel() {
        let k = EmuKernels::build().unwrap();
        let mut next = xorshift(0xD1B5_4A32_D192_ED03);
        let mut rnd = |scale: f32| ((next() % 20001) as f32 / 10000.0 - 1.0) * scale;
        let n = 4usize;
        for (t, d, fused) in [(5usize, 4096usize, true), (3, 96, false), (2, 300, true)] {
            let x0: Vec<f32> = (0..t * n * d).map(|_| rnd(2.0)).collect();
            let f0: Vec<f32> = (0..t * d).map(|_| rnd(1.0)).collect();
            let f2: Vec<f32> = (0..t * d).map(|_| rnd(1.0)).collect();
            let post: Vec<f32> = (0..t * n).map(|_| rnd(1.0) + 1.0).collect();
            let comb: Vec<f32> = (0..t * n * n).map(|_| rnd(0.5) + 0.25).collect();
            let run = |flat: bool| {
                let (mut x, mut f) = (x0.clone(), f0.clone());
                let mut v: Vec<u64> = vec![
                    x.as_mut_ptr() as u64,
                    f.as_mut_ptr() as u64,
                    if fused { f2.as_ptr() as u64 } else { 0 },
                    post.as_ptr() as u64,
                    comb.as_ptr() as u64,
                    t as u64,
                    n as u64,
                    d as u64,
                ];
                let (name, grid) = if flat {
                    ("ds4_hc_post", ((t * d).div_ceil(256) as u32, 1, 1))
                } else {
                    v.remove(6);
                    ("ds4_hc_post4", (d.div_ceil(256) as u32, t as u32, 1))
                };
                let mut params: Vec<*mut c_void> =
                    v.iter_mut().map(|p| (p as *mut u64).cast()).collect();
                // SAFETY: the kernel's parameters in order; x holds t·n·d values, f and f2
                // t·d, post t·n, comb t·n·n.
                unsafe { k.launch(name, grid, 256, &mut params) }.unwrap();
                (x, f)
            };
            let (xf, ff) = run(true);
            let (x4, f4) = run(false);
            assert_ne!(xf, x0, "{t}x{d}: the flat kernel changed nothing");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&x4), bits(&xf), "{t}x{d}: streams");
            assert_eq!(bits(&f4), bits(&ff), "{t}x{d}: f");
        }
    }

    /// The mixing partials with four tokens per block (`ds4_hc_mix_part_tpb_*`) are the
    /// one-token blocks' bits (`ds4_hc_mix_part_*`, a block per token), with and without
    /// the previous sublayer's HCPost folded in (streams and f written back alike), for
    /// token counts that fill the last block and that do not, f16 and f32 weights.
    #[test]
    fn hc_mix_parts_of_four_tokens_per_block_equal_one_per_block() {
        let k = EmuKernels::build().unwrap();
        let mut next = xorshift(0x94D0_49BB_1331_11EB);
        let mut rnd = |scale: f32| ((next() % 20001) as f32 / 10000.0 - 1.0) * scale;
        let (n, d) = (4usize, 192usize);
        let nm = 2 * n + n * n;
        let nb = d.div_ceil(64);
        for (t, prev, f16w) in [
            (7usize, true, true),
            (8, false, true),
            // A prompt piece's size (where the backend takes these blocks).
            (49, true, true),
            (5, true, false),
            (2, false, false),
        ] {
            let w32: Vec<f32> = (0..nm * n * d).map(|_| rnd(0.5)).collect();
            let w16: Vec<u16> = w32
                .iter()
                .map(|&v| half::f16::from_f32(v).to_bits())
                .collect();
            let x0: Vec<f32> = (0..t * n * d).map(|_| rnd(2.0)).collect();
            let f0: Vec<f32> = (0..t * d).map(|_| rnd(1.0)).collect();
            let f2: Vec<f32> = (0..t * d).map(|_| rnd(1.0)).collect();
            let post: Vec<f32> = (0..t * n).map(|_| rnd(1.0) + 1.0).collect();
            let comb: Vec<f32> = (0..t * n * n).map(|_| rnd(0.5) + 0.25).collect();
            let run = |tpb: bool| {
                let (mut x, mut f) = (x0.clone(), f0.clone());
                let mut pf = vec![f32::NAN; t * nb * nm];
                let mut pd = vec![f64::NAN; t * nb * 10];
                let wp = if f16w {
                    w16.as_ptr() as u64
                } else {
                    w32.as_ptr() as u64
                };
                let pv = |p: u64| if prev { p } else { 0 };
                let mut v: Vec<u64> = vec![
                    wp,
                    x.as_mut_ptr() as u64,
                    n as u64,
                    d as u64,
                    nm as u64,
                    pf.as_mut_ptr() as u64,
                    pd.as_mut_ptr() as u64,
                    pv(f.as_mut_ptr() as u64),
                    pv(f2.as_ptr() as u64),
                    pv(post.as_ptr() as u64),
                    pv(comb.as_ptr() as u64),
                ];
                let ty = if f16w { "f16" } else { "f32" };
                let (name, grid) = if tpb {
                    v.push(t as u64);
                    (
                        format!("ds4_hc_mix_part_tpb_{ty}"),
                        (nb as u32, t.div_ceil(4) as u32, 1),
                    )
                } else {
                    (format!("ds4_hc_mix_part_{ty}"), (nb as u32, t as u32, 1))
                };
                let mut params: Vec<*mut c_void> =
                    v.iter_mut().map(|p| (p as *mut u64).cast()).collect();
                // SAFETY: the kernel's parameters in order; the weights hold nm·n·d values,
                // x t·n·d, f and f2 t·d, post t·n, comb t·n·n, the partials t·nb·nm and
                // t·nb·10.
                unsafe { k.launch(&name, grid, 256, &mut params) }.unwrap();
                (x, f, pf, pd)
            };
            let (x1, f1, pf1, pd1) = run(false);
            let (x4, f4, pf4, pd4) = run(true);
            let what = format!("{t} tokens, prev {prev}, f16 {f16w}");
            assert!(
                pf1.iter().all(|v| v.is_finite()),
                "{what}: one per block left a gap"
            );
            assert!(
                pd1.iter().all(|v| v.is_finite()),
                "{what}: one per block left a gap"
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let bits_d = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&pf4), bits(&pf1), "{what}: mix partials");
            assert_eq!(bits_d(&pd4), bits_d(&pd1), "{what}: Gram partials");
            assert_eq!(bits(&x4), bits(&x1), "{what}: streams");
            assert_eq!(bits(&f4), bits(&f1), "{what}: f");
            assert_eq!(prev, x1 != x0, "{what}: HCPost applied iff prev");
        }
    }
}
