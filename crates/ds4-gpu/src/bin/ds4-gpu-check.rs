//! ds4-gpu-check: kernel correctness and speed checks for the GPU layer.
//!
//! Subcommands:
//! * `gen-tables` — print `kernels/ds4_iq2xxs_tables.h` from the Rust codec tables.
//! * `compile [--arch sm_80,sm_90] [--out DIR] [-D...]` (or the older `compile ARCH [OUTDIR]`)
//!   — compile every kernel module with NVRTC through the engine's own compile function and
//!   options, for each architecture (needs libnvrtc only, no driver or GPU); the CUBINs go to
//!   DIR when given. Any compile error is the exit status, which is what CI relies on.
//! * `hip [ARCH] [OPTIONS]` — load the HIP runtime and hiprtc, list devices (or report
//!   that there are none) and compile every kernel module with hiprtc (default gfx1030).
//! * `run [--quick]` (default) — on a CUDA device: device facts, kernel compile + cache,
//!   copy bandwidth, every GEMV type against `ds4_gguf::quant::dot` on fresh random data
//!   with NaN-poisoned outputs, timings over rotated buffers larger than L2, the placement
//!   kinds (device, pinned host, managed, registered host), and grouped expert GEMVs.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use ds4_gguf::quant;
use ds4_gpu::cuda::{CudaBuffer, CudaDevice, GemvKernels, GroupedGemv, GroupedSwiglu};
use ds4_gpu::{kernels, tables, GemvType, KernelCache};
use ds4_placement::MemKind;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("gen-tables") => {
            print!("{}", tables::iq2xxs_header());
            Ok(())
        }
        Some("compile") => {
            let c = parse_compile_args(&args[1..])?;
            compile(&c)
        }
        Some("run") | None => run(args.iter().any(|a| a == "--quick")),
        Some("hip") => hip(
            args.get(1).map(String::as_str).unwrap_or("gfx1030"),
            &args[args.len().min(2)..],
        ),
        Some(other) => bail!("unknown subcommand {other:?}; use gen-tables, compile or run"),
    }
}

/// ROCm checks that need no AMD GPU: load the HIP runtime, report devices (or the clear
/// "no ROCm device" error), and compile every kernel module with hiprtc for `arch`.
fn hip(arch: &str, extra: &[String]) -> Result<()> {
    use ds4_gpu::hip::{HipRtc, HipRuntime};
    let rt = HipRuntime::load()?;
    println!(
        "HIP runtime {} version {}",
        rt.path.display(),
        rt.runtime_version()?
    );
    match rt.device_count() {
        Ok(n) => {
            for i in 0..n {
                let info = rt.device_info(i)?;
                println!("device {i}: {info:?}");
                println!(
                    "placement facts: {}",
                    serde_json::to_string(&info.device_facts())?
                );
            }
        }
        Err(e) => println!("{e}"),
    }
    let rtc = HipRtc::load()?;
    println!("hiprtc {} version {}", rtc.path.display(), rtc.version()?);
    for src in kernels::ALL {
        let t = Instant::now();
        let (code, log) = rtc.compile(src, arch, extra)?;
        println!(
            "{}: {} bytes of code object for {arch} in {:.0} ms{}",
            src.name,
            code.len(),
            t.elapsed().as_secs_f64() * 1e3,
            if log.is_empty() {
                String::new()
            } else {
                format!("\n{log}")
            }
        );
    }
    Ok(())
}

/// What `compile` was asked for.
#[derive(Debug, PartialEq)]
struct CompileArgs {
    archs: Vec<String>,
    out: Option<String>,
    /// Extra NVRTC options (after the engine's own).
    extra: Vec<String>,
}

/// `--arch A,B --out DIR -D...`, or the positional form `ARCH [OUTDIR] [-D...]`.
fn parse_compile_args(args: &[String]) -> Result<CompileArgs> {
    let mut c = CompileArgs {
        archs: Vec::new(),
        out: None,
        extra: Vec::new(),
    };
    let mut positional = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--arch" => {
                let v = it
                    .next()
                    .context("--arch needs a value (e.g. sm_80,sm_90)")?;
                c.archs.extend(
                    v.split(',')
                        .map(str::trim)
                        .filter(|s| !s.is_empty())
                        .map(String::from),
                );
            }
            "--out" => c.out = Some(it.next().context("--out needs a directory")?.clone()),
            s if s.starts_with('-') => c.extra.push(s.to_string()),
            s => positional.push(s.to_string()),
        }
    }
    let mut positional = positional.into_iter();
    if c.archs.is_empty() {
        c.archs
            .push(positional.next().unwrap_or_else(|| "sm_90".into()));
    }
    if c.out.is_none() {
        c.out = positional.next();
    }
    if let Some(extra) = positional.next() {
        bail!("unexpected argument {extra:?} for compile");
    }
    if let Some(bad) = c.archs.iter().find(|a| !a.starts_with("sm_")) {
        bail!("architecture {bad:?} is not of the form sm_XX (a real GPU, for a CUBIN)");
    }
    Ok(c)
}

/// Compiles every kernel module for every architecture with the function and options the
/// engine uses at run time ([`ds4_gpu::cuda::nvrtc_compile_with`], `NVRTC_OPTIONS`), so
/// a kernel that fails here would fail on the GPU too. All files and architectures are
/// tried; the error lists every failure.
fn compile(c: &CompileArgs) -> Result<()> {
    println!("NVRTC {}", ds4_gpu::cuda::nvrtc_version()?);
    let mut failed = Vec::new();
    for arch in &c.archs {
        for src in kernels::ALL {
            let t = Instant::now();
            match ds4_gpu::cuda::nvrtc_compile_with(src, arch, &c.extra) {
                Ok((image, log)) => {
                    println!(
                        "{}: {} bytes of CUBIN for {arch} in {:.0} ms{}",
                        src.name,
                        image.len(),
                        t.elapsed().as_secs_f64() * 1e3,
                        if log.is_empty() {
                            String::new()
                        } else {
                            format!("\n{log}")
                        }
                    );
                    if let Some(dir) = &c.out {
                        std::fs::create_dir_all(dir)?;
                        let file = src.name.replace(".cu", &format!(".{arch}.cubin"));
                        let path = std::path::Path::new(dir).join(file);
                        std::fs::write(&path, &image)
                            .with_context(|| format!("writing {}", path.display()))?;
                    }
                }
                Err(e) => {
                    println!("{}: FAILED for {arch}: {e}", src.name);
                    failed.push(format!("{} ({arch})", src.name));
                }
            }
        }
    }
    if !failed.is_empty() {
        bail!("NVRTC compile failed: {}", failed.join(", "));
    }
    println!(
        "all {} kernel files compiled for {}",
        kernels::ALL.len(),
        c.archs.join(", ")
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Random data (xorshift; fresh seed per run from the clock).
// ---------------------------------------------------------------------------------------

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
    fn range(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * (self.unit() * 0.5 + 0.5)
    }
}

fn f16_bits(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// Random bytes of `rows` rows of `ty`, with every scale field set to a finite f16 so
/// values stay O(1): all other bits (codes, grid indices, signs, sub-scales) are uniform.
fn random_weights(ty: GemvType, n_in: usize, rows: usize, seed: u64) -> Vec<u8> {
    let row_bytes = ty.row_bytes(n_in as u64).unwrap() as usize;
    let mut out = vec![0u8; row_bytes * rows];
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let per = rows.div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (t, chunk) in out.chunks_mut(per * row_bytes).enumerate() {
            s.spawn(move || {
                let mut r = Rng::new(seed ^ ((t as u64 + 1) << 32));
                match ty {
                    GemvType::F32 => {
                        for v in chunk.chunks_exact_mut(4) {
                            v.copy_from_slice(&r.unit().to_le_bytes());
                        }
                    }
                    GemvType::F16 => {
                        for v in chunk.chunks_exact_mut(2) {
                            v.copy_from_slice(&f16_bits(r.unit()));
                        }
                    }
                    _ => {
                        for w in chunk.chunks_exact_mut(8) {
                            w.copy_from_slice(&r.next().to_le_bytes());
                        }
                        let bb = ty.block_bytes() as usize;
                        for b in chunk.chunks_exact_mut(bb) {
                            match ty {
                                GemvType::Q8_0 => {
                                    b[0..2].copy_from_slice(&f16_bits(r.range(0.002, 0.008)))
                                }
                                GemvType::Q2K => {
                                    b[80..82].copy_from_slice(&f16_bits(r.range(0.01, 0.05)));
                                    b[82..84].copy_from_slice(&f16_bits(r.range(0.005, 0.03)));
                                }
                                GemvType::Q4K => {
                                    b[0..2].copy_from_slice(&f16_bits(r.range(0.001, 0.005)));
                                    b[2..4].copy_from_slice(&f16_bits(r.range(0.001, 0.01)));
                                }
                                GemvType::Iq2Xxs => {
                                    b[0..2].copy_from_slice(&f16_bits(r.range(0.005, 0.02)))
                                }
                                // E8M0 scale 2^(e-128): 2^-10 .. 2^-7.
                                GemvType::Mxfp4 => b[0] = 118 + (r.next() % 4) as u8,
                                _ => {}
                            }
                        }
                    }
                }
            });
        }
    });
    out
}

/// CPU reference: y[r] = quant::dot(row r, x), rows spread over all cores.
fn reference(ty: GemvType, w: &[u8], x: &[f32], rows: usize) -> Result<Vec<f32>> {
    let row_bytes = ty.row_bytes(x.len() as u64)? as usize;
    let mut y = vec![0f32; rows];
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let per = rows.div_ceil(threads).max(1);
    let g = ty.ggml();
    std::thread::scope(|s| -> Result<()> {
        let mut hs = Vec::new();
        for (t, ys) in y.chunks_mut(per).enumerate() {
            hs.push(s.spawn(move || -> Result<()> {
                for (i, yv) in ys.iter_mut().enumerate() {
                    let r = t * per + i;
                    *yv = quant::dot(g, &w[r * row_bytes..(r + 1) * row_bytes], x)?;
                }
                Ok(())
            }));
        }
        for h in hs {
            h.join()
                .map_err(|_| anyhow::anyhow!("reference thread panicked"))??;
        }
        Ok(())
    })?;
    Ok(y)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|f| f.to_le_bytes()).collect()
}

fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// (relative L2 error, max |err| / max |ref|, count of non-finite outputs).
fn compare(y: &[f32], r: &[f32]) -> (f64, f64, usize) {
    let (mut num, mut den, mut maxe, mut maxr, mut bad) = (0f64, 0f64, 0f64, 0f64, 0usize);
    for (a, b) in y.iter().zip(r) {
        if !a.is_finite() {
            bad += 1;
            continue;
        }
        let d = f64::from(*a) - f64::from(*b);
        num += d * d;
        den += f64::from(*b) * f64::from(*b);
        maxe = maxe.max(d.abs());
        maxr = maxr.max(f64::from(*b).abs());
    }
    (
        num.sqrt() / den.sqrt().max(1e-30),
        maxe / maxr.max(1e-30),
        bad,
    )
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

const POISON: u32 = 0x7fc0_0000; // quiet NaN
const REL_TOL: f64 = 1e-4;

/// True only for a finite error under the tolerance (NaN fails).
fn within_tol(rel: f64) -> bool {
    rel.is_finite() && rel < REL_TOL
}

struct Report {
    lines: Vec<String>,
    failures: Vec<String>,
}

impl Report {
    fn line(&mut self, s: String) {
        println!("{s}");
        self.lines.push(s);
    }
    fn fail(&mut self, s: String) {
        println!("FAIL: {s}");
        self.failures.push(s);
    }
}

/// Launch y = W x once with poisoned y, return y.
fn run_once(
    k: &GemvKernels,
    ty: GemvType,
    w: &CudaBuffer,
    x: &CudaBuffer,
    y: &mut CudaBuffer,
    n_in: usize,
    n_out: usize,
) -> Result<Vec<f32>> {
    y.fill_u32(POISON)?;
    k.gemv(ty, w.as_view(), x.as_view(), y.as_view_mut(), n_in, n_out)?;
    let mut out = vec![0u8; 4 * n_out];
    y.read(0, &mut out)?;
    Ok(bytes_f32(&out))
}

struct Timing {
    /// Median per-launch time, launches queued one by one on the stream.
    us: f64,
    gbs: f64,
    /// Median per-launch time inside a CUDA graph of the same launches.
    graph_us: f64,
    graph_gbs: f64,
    copies: usize,
}

/// Median per-launch time over `samples` batches, each launching once per copy of W
/// (copies rotate so the working set exceeds L2): queued launch by launch, then the same
/// batch captured once in a CUDA graph and replayed.
#[allow(clippy::too_many_arguments)]
fn time_gemv(
    dev: &CudaDevice,
    k: &GemvKernels,
    ty: GemvType,
    ws: &[CudaBuffer],
    x: &CudaBuffer,
    y: &mut CudaBuffer,
    n_in: usize,
    n_out: usize,
    samples: usize,
) -> Result<Timing> {
    let wbytes = ws[0].len() as f64;
    let per_batch = ws.len().max(32);
    for w in ws.iter().take(3) {
        k.gemv(ty, w.as_view(), x.as_view(), y.as_view_mut(), n_in, n_out)?;
    }
    let (e0, e1) = (dev.event()?, dev.event()?);
    let mut t = Vec::new();
    for _ in 0..samples {
        e0.record()?;
        for i in 0..per_batch {
            k.gemv(
                ty,
                ws[i % ws.len()].as_view(),
                x.as_view(),
                y.as_view_mut(),
                n_in,
                n_out,
            )?;
        }
        e1.record()?;
        t.push(f64::from(e0.elapsed_ms(&e1)?) * 1e3 / per_batch as f64);
    }
    let us = median(&mut t);
    let graph_us = dev.with_graph(
        || {
            for i in 0..per_batch {
                k.gemv(
                    ty,
                    ws[i % ws.len()].as_view(),
                    x.as_view(),
                    y.as_view_mut(),
                    n_in,
                    n_out,
                )?;
            }
            Ok(())
        },
        |g| {
            g.launch()?;
            let mut t = Vec::new();
            for _ in 0..samples {
                e0.record()?;
                g.launch()?;
                e1.record()?;
                t.push(f64::from(e0.elapsed_ms(&e1)?) * 1e3 / per_batch as f64);
            }
            Ok(median(&mut t))
        },
    )?;
    Ok(Timing {
        us,
        gbs: wbytes / (us * 1e-6) / 1e9,
        graph_us,
        graph_gbs: wbytes / (graph_us * 1e-6) / 1e9,
        copies: ws.len(),
    })
}

/// One checked + timed GEMV case on fresh random data: (rel error, non-finite, timing).
/// `wh` as the kernels read it: Q8_0 rows in the GPU's split layout (docs/gpu.md §7).
fn dev_layout(t: GemvType, wh: &[u8], n_in: usize) -> Result<Vec<u8>> {
    let mut b = wh.to_vec();
    if t == GemvType::Q8_0 {
        ds4_gpu::kernels::q8_0_split_rows(&mut b, n_in)?;
    }
    Ok(b)
}

#[allow(clippy::too_many_arguments)]
fn bench_case(
    dev: &CudaDevice,
    k: &GemvKernels,
    rng: &mut Rng,
    t: GemvType,
    n_in: usize,
    n_out: usize,
    samples: usize,
    rotate_bytes: usize,
) -> Result<(f64, f64, usize, bool, Timing)> {
    let wh = random_weights(t, n_in, n_out, rng.next());
    let x: Vec<f32> = (0..n_in).map(|_| rng.unit()).collect();
    let yref = reference(t, &wh, &x, n_out)?;
    let mut w = dev.alloc(MemKind::Device, wh.len())?;
    w.write(0, &dev_layout(t, &wh, n_in)?)?;
    let mut xb = dev.alloc(MemKind::Device, 4 * n_in)?;
    xb.write(0, &f32_bytes(&x))?;
    let mut y = dev.alloc(MemKind::Device, 4 * n_out)?;
    let y1 = run_once(k, t, &w, &xb, &mut y, n_in, n_out)?;
    let y2 = run_once(k, t, &w, &xb, &mut y, n_in, n_out)?;
    let (rel, maxrel, bad) = compare(&y1, &yref);
    let same = y1.iter().zip(&y2).all(|(a, b)| a.to_bits() == b.to_bits());
    let copies = rotate_bytes.div_ceil(wh.len()).clamp(1, 256);
    let mut ws = vec![w];
    for _ in 1..copies {
        let mut c = dev.alloc(MemKind::Device, wh.len())?;
        c.copy_from(0, &ws[0], 0, wh.len())?;
        ws.push(c);
    }
    let tm = time_gemv(dev, k, t, &ws, &xb, &mut y, n_in, n_out, samples)?;
    Ok((rel, maxrel, bad, same, tm))
}

fn run(quick: bool) -> Result<()> {
    let mut rep = Report {
        lines: Vec::new(),
        failures: Vec::new(),
    };
    let libs = ds4_gpu::cuda::probe_libraries();
    rep.line(format!(
        "libraries: libcuda {} libnvrtc {}",
        libs.driver, libs.nvrtc
    ));
    let dev = CudaDevice::open(0).context("opening CUDA device 0")?;
    let info = dev.info().clone();
    rep.line(format!("device: {info:?}"));
    rep.line(format!(
        "placement facts: {}",
        serde_json::to_string(&dev.placement_facts()?)?
    ));
    rep.line(format!("NVRTC {}", ds4_gpu::cuda::nvrtc_version()?));

    // Compile twice: cold (fresh cache dir) then from the cache.
    let cache_dir =
        std::env::temp_dir().join(format!("ds4-gpu-check-cache-{}", std::process::id()));
    let cache = KernelCache::at(&cache_dir);
    let k = GemvKernels::load(&dev, &cache)?;
    rep.line(format!(
        "gemv.cu compile: {:.1} ms (cached: {}) key {}",
        k.module.origin.millis, k.module.origin.cached, k.module.origin.key
    ));
    if !k.module.origin.log.is_empty() {
        rep.line(format!("NVRTC log:\n{}", k.module.origin.log));
    }
    let k2 = GemvKernels::load(&dev, &cache)?;
    rep.line(format!(
        "gemv.cu reload: {:.1} ms (cached: {})",
        k2.module.origin.millis, k2.module.origin.cached
    ));
    if !k2.module.origin.cached {
        rep.fail("second load did not come from the disk cache".into());
    }
    drop(k2);
    for t in GemvType::ALL {
        let a = k.function(t).attrs()?;
        let g = k.grouped_function(t).attrs()?;
        rep.line(format!(
            "attrs {:8}: regs {} local {} B smem {} B | grouped regs {} local {} B",
            t.suffix(),
            a.registers,
            a.local_bytes,
            a.static_shared_bytes,
            g.registers,
            g.local_bytes
        ));
        if a.local_bytes > 0 || g.local_bytes > 0 {
            rep.line(format!("note: {} spills to local memory", t.suffix()));
        }
    }

    // Copy bandwidth: device-to-device, bytes read + written.
    let copy_bytes: usize = 4 << 30;
    let (mut a, b) = (
        dev.alloc(MemKind::Device, copy_bytes)?,
        dev.alloc(MemKind::Device, copy_bytes)?,
    );
    a.copy_from(0, &b, 0, copy_bytes)?;
    let (e0, e1) = (dev.event()?, dev.event()?);
    let mut ts = Vec::new();
    for _ in 0..10 {
        e0.record()?;
        a.copy_from(0, &b, 0, copy_bytes)?;
        e1.record()?;
        ts.push(f64::from(e0.elapsed_ms(&e1)?));
    }
    let ms = median(&mut ts);
    let copy_gbs = 2.0 * copy_bytes as f64 / (ms * 1e-3) / 1e9;
    rep.line(format!(
        "copy bandwidth: {:.0} GB/s (read+write, {} GiB dtod, median of 10: {:.3} ms)",
        copy_gbs,
        copy_bytes >> 30,
        ms
    ));
    drop((a, b));

    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    rep.line(format!("seed {seed}"));
    let mut rng = Rng::new(seed);
    // (type, n_in, n_out): ds4 shapes (ggml ne0 = n_in) plus edge cases.
    let mut cases: Vec<(GemvType, usize, usize)> = Vec::new();
    for t in [
        GemvType::Q8_0,
        GemvType::F16,
        GemvType::F32,
        GemvType::Q4K,
        GemvType::Q2K,
        GemvType::Iq2Xxs,
        GemvType::Mxfp4,
    ] {
        for (n_in, n_out) in [(4096, 1024), (1024, 32768), (4096, 2048), (2048, 4096)] {
            if t.row_bytes(n_in as u64).is_ok() {
                cases.push((t, n_in, n_out));
            }
        }
    }
    cases.extend([
        (GemvType::Q8_0, 4096, 8192),
        (GemvType::Q8_0, 8192, 4096),
        (GemvType::F16, 16384, 24),
        (GemvType::F16, 4096, 256),
        (GemvType::F16, 1024, 8192),
        (GemvType::Q8_0, 256, 3),
        (GemvType::Q8_0, 32768, 7),
        (GemvType::Q2K, 4096 + 256 * 4, 5),
        (GemvType::Q4K, 256 * 3, 13),
        (GemvType::Iq2Xxs, 2048 * 3, 9),
        (GemvType::F32, 8, 1),
    ]);
    if !quick {
        cases.push((GemvType::Q8_0, 4096, 129280));
    }
    let rotate_bytes: usize = 256 << 20;
    let samples = if quick { 5 } else { 15 };
    let mut table = Vec::new();
    for &(t, n_in, n_out) in &cases {
        let tag = format!("{:8} in {:6} out {:6}", t.suffix(), n_in, n_out);
        let (rel, maxrel, bad, same, tm) =
            bench_case(&dev, &k, &mut rng, t, n_in, n_out, samples, rotate_bytes)?;
        let l = k.launch_for(t, n_in, n_out)?;
        if bad > 0 || !within_tol(rel) {
            rep.fail(format!(
                "{tag}: rel err {rel:.3e}, {bad} non-finite outputs"
            ));
        }
        if !same {
            rep.fail(format!(
                "{tag}: two launches on the same input differ (race?)"
            ));
        }
        let wbytes = l.row_bytes as usize * n_out;
        let line = format!(
            "{tag}: rel {rel:.2e} max {maxrel:.2e} nonfinite {bad} det {same} | wpr {} | stream {:7.2} us {:5.0} GB/s | graph {:7.2} us {:5.0} GB/s ({:4.1}% of copy) | {} B x{}",
            l.wpr, tm.us, tm.gbs, tm.graph_us, tm.graph_gbs, 100.0 * tm.graph_gbs / copy_gbs, wbytes, tm.copies
        );
        rep.line(line.clone());
        table.push(line);
    }

    // Placement kinds: allocate each kind and run a Q8_0 GEMV whose weights live there.
    let (t, n_in, n_out) = (GemvType::Q8_0, 4096usize, 8192usize);
    let wh = random_weights(t, n_in, n_out, rng.next());
    let x: Vec<f32> = (0..n_in).map(|_| rng.unit()).collect();
    let yref = reference(t, &wh, &x, n_out)?;
    let mut xb = dev.alloc(MemKind::Device, 4 * n_in)?;
    xb.write(0, &f32_bytes(&x))?;
    let mut y = dev.alloc(MemKind::Device, 4 * n_out)?;
    for kind in [
        MemKind::Device,
        MemKind::PinnedHost,
        MemKind::Managed,
        MemKind::HostRegistered,
    ] {
        let mut w = match dev.alloc(kind, wh.len()) {
            Ok(w) => w,
            Err(e) => {
                rep.fail(format!(
                    "placement {}: allocation failed: {e}",
                    kind.label()
                ));
                continue;
            }
        };
        let wd = dev_layout(t, &wh, n_in)?;
        match w.host_bytes_mut()? {
            Some(h) => h[..wd.len()].copy_from_slice(&wd),
            None => w.write(0, &wd)?,
        }
        let got = run_once(&k, t, &w, &xb, &mut y, n_in, n_out)?;
        let (rel, _, bad) = compare(&got, &yref);
        if bad > 0 || !within_tol(rel) {
            rep.fail(format!(
                "placement {}: rel err {rel:.3e}, {bad} non-finite",
                kind.label()
            ));
        }
        let ws = vec![w];
        let tm = time_gemv(&dev, &k, t, &ws, &xb, &mut y, n_in, n_out, samples)?;
        let line = format!(
            "placement {:16}: q8_0 4096x8192 rel {rel:.2e} | {:9.1} us {:7.1} GB/s",
            kind.label(),
            tm.us,
            tm.gbs
        );
        rep.line(line.clone());
        table.push(line);
    }
    // A registered Vec (caller-owned memory) also works.
    let mut owned = dev.register_host(dev_layout(t, &wh, n_in)?.into_boxed_slice())?;
    let got = run_once(&k, t, &owned, &xb, &mut y, n_in, n_out)?;
    let (rel, _, bad) = compare(&got, &yref);
    rep.line(format!(
        "placement registered Box<[u8]>: rel {rel:.2e} nonfinite {bad}"
    ));
    if bad > 0 || !within_tol(rel) {
        rep.fail("registered caller-owned memory gave wrong results".into());
    }
    owned
        .host_bytes_mut()?
        .context("registered buffer has host bytes")?[0] ^= 1;
    drop(owned);
    // Managed memory larger than free memory must be refused before the driver call.
    let (free, _) = dev.mem_info()?;
    match dev.alloc(MemKind::Managed, free as usize + (1 << 30)) {
        Err(ds4_gpu::GpuError::ManagedTooLarge { .. }) => {
            rep.line("managed > free: refused as expected".into())
        }
        Err(e) => rep.fail(format!("managed > free: wrong error {e}")),
        Ok(_) => rep.fail("managed > free was allocated".into()),
    }

    // Grouped routed experts: 6 of 256, gate+up in one launch, then down per expert.
    for (t_gu, t_down) in [
        (GemvType::Iq2Xxs, GemvType::Q2K),
        (GemvType::Q4K, GemvType::Q4K),
        (GemvType::Mxfp4, GemvType::Mxfp4),
    ] {
        let (n_exp, n_sel, e_in, e_ff) = (256usize, 6usize, 4096usize, 2048usize);
        let gate = random_weights(t_gu, e_in, n_exp * e_ff, rng.next());
        let up = random_weights(t_gu, e_in, n_exp * e_ff, rng.next());
        let down = random_weights(t_down, e_ff, n_exp * e_in, rng.next());
        let mut ids: Vec<i32> = Vec::new();
        while ids.len() < n_sel {
            let id = (rng.next() % n_exp as u64) as i32;
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        let x: Vec<f32> = (0..e_in).map(|_| rng.unit()).collect();
        let xd: Vec<f32> = (0..n_sel * e_ff).map(|_| rng.unit()).collect();
        let mut bufs = Vec::new();
        for h in [&gate, &up, &down] {
            let mut b = dev.alloc(MemKind::Device, h.len())?;
            b.write(0, h)?;
            bufs.push(b);
        }
        let mut idb = dev.alloc(MemKind::Device, 4 * n_sel)?;
        idb.write(
            0,
            &ids.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<_>>(),
        )?;
        let mut xb = dev.alloc(MemKind::Device, 4 * e_in)?;
        xb.write(0, &f32_bytes(&x))?;
        let mut xdb = dev.alloc(MemKind::Device, 4 * n_sel * e_ff)?;
        xdb.write(0, &f32_bytes(&xd))?;
        let mut yg = dev.alloc(MemKind::Device, 4 * n_sel * e_ff)?;
        let mut yu = dev.alloc(MemKind::Device, 4 * n_sel * e_ff)?;
        let mut yd = dev.alloc(MemKind::Device, 4 * n_sel * e_in)?;
        let rb_gu = t_gu.row_bytes(e_in as u64)? as usize;
        let rb_d = t_down.row_bytes(e_ff as u64)? as usize;
        let launch_gu = |idb: &CudaBuffer, yg: &mut CudaBuffer, yu: &mut CudaBuffer| {
            k.gemv_grouped(
                t_gu,
                GroupedGemv {
                    w0: bufs[0].as_view(),
                    w1: Some(bufs[1].as_view()),
                    n_experts: n_exp,
                    ids: idb.as_view(),
                    n_sel,
                    x: xb.as_view(),
                    x_per_selection: false,
                    y0: yg.as_view_mut(),
                    y1: Some(yu.as_view_mut()),
                    n_in: e_in,
                    n_out: e_ff,
                },
            )
        };
        let launch_d = |idb: &CudaBuffer, yd: &mut CudaBuffer| {
            k.gemv_grouped(
                t_down,
                GroupedGemv {
                    w0: bufs[2].as_view(),
                    w1: None,
                    n_experts: n_exp,
                    ids: idb.as_view(),
                    n_sel,
                    x: xdb.as_view(),
                    x_per_selection: true,
                    y0: yd.as_view_mut(),
                    y1: None,
                    n_in: e_ff,
                    n_out: e_in,
                },
            )
        };
        yg.fill_u32(POISON)?;
        yu.fill_u32(POISON)?;
        yd.fill_u32(POISON)?;
        launch_gu(&idb, &mut yg, &mut yu)?;
        launch_d(&idb, &mut yd)?;
        let mut out = vec![0u8; 4 * n_sel * e_ff];
        yg.read(0, &mut out)?;
        let got_g = bytes_f32(&out);
        yu.read(0, &mut out)?;
        let got_u = bytes_f32(&out);
        let mut outd = vec![0u8; 4 * n_sel * e_in];
        yd.read(0, &mut outd)?;
        let got_d = bytes_f32(&outd);
        let (mut rg, mut ru, mut rd) = (Vec::new(), Vec::new(), Vec::new());
        for (s, &id) in ids.iter().enumerate() {
            let id = id as usize;
            rg.extend(reference(
                t_gu,
                &gate[id * e_ff * rb_gu..(id + 1) * e_ff * rb_gu],
                &x,
                e_ff,
            )?);
            ru.extend(reference(
                t_gu,
                &up[id * e_ff * rb_gu..(id + 1) * e_ff * rb_gu],
                &x,
                e_ff,
            )?);
            rd.extend(reference(
                t_down,
                &down[id * e_in * rb_d..(id + 1) * e_in * rb_d],
                &xd[s * e_ff..(s + 1) * e_ff],
                e_in,
            )?);
        }
        let cg = compare(&got_g, &rg);
        let cu = compare(&got_u, &ru);
        let cd = compare(&got_d, &rd);
        for (name, c) in [("gate", cg), ("up", cu), ("down", cd)] {
            if c.2 > 0 || !within_tol(c.0) {
                rep.fail(format!(
                    "grouped {}/{} {name}: rel {:.3e}, {} non-finite",
                    t_gu.suffix(),
                    t_down.suffix(),
                    c.0,
                    c.2
                ));
            }
        }
        // A bad id yields NaN rows for that selection only.
        let mut bad_ids = ids.clone();
        bad_ids[2] = n_exp as i32 + 5;
        idb.write(
            0,
            &bad_ids
                .iter()
                .flat_map(|i| i.to_le_bytes())
                .collect::<Vec<_>>(),
        )?;
        yd.fill_u32(0)?;
        launch_d(&idb, &mut yd)?;
        yd.read(0, &mut outd)?;
        let v = bytes_f32(&outd);
        let nan_ok = v[2 * e_in..3 * e_in].iter().all(|f| f.is_nan())
            && v[..2 * e_in]
                .iter()
                .chain(&v[3 * e_in..])
                .all(|f| f.is_finite());
        if !nan_ok {
            rep.fail("grouped: an out-of-range expert id did not give exactly its rows NaN".into());
        }
        idb.write(
            0,
            &ids.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<_>>(),
        )?;
        // The kernels decode runs at one token (docs/gpu.md §25, §17): gate/up by
        // ds4_gemv_grouped_q_<t>, down by ds4_gemv_grouped_swiglu_q_<t> (SwiGLU and the route
        // weight in its input stage), int8 activations, the backend's launch. Checked against
        // the CPU's int8-activation dot (ds4_gguf::quant::q8act), then timed below.
        let clamp = 10.0f32;
        let gin: Vec<f32> = (0..n_sel * e_ff).map(|_| 4.0 * rng.unit()).collect();
        let uin: Vec<f32> = (0..n_sel * e_ff).map(|_| 4.0 * rng.unit()).collect();
        let route: Vec<f32> = (0..n_sel).map(|_| 0.2 + 0.8 * rng.unit().abs()).collect();
        let mut gb = dev.alloc(MemKind::Device, 4 * n_sel * e_ff)?;
        gb.write(0, &f32_bytes(&gin))?;
        let mut ub = dev.alloc(MemKind::Device, 4 * n_sel * e_ff)?;
        ub.write(0, &f32_bytes(&uin))?;
        let mut rwb = dev.alloc(MemKind::Device, 4 * n_sel)?;
        rwb.write(0, &f32_bytes(&route))?;
        let mut faultb = dev.alloc(MemKind::Device, 4)?;
        faultb.fill_u32(0)?;
        let launch_gu_q = |idb: &CudaBuffer, yg: &mut CudaBuffer, yu: &mut CudaBuffer| {
            k.gemv_grouped_q(
                t_gu,
                GroupedGemv {
                    w0: bufs[0].as_view(),
                    w1: Some(bufs[1].as_view()),
                    n_experts: n_exp,
                    ids: idb.as_view(),
                    n_sel,
                    x: xb.as_view(),
                    x_per_selection: false,
                    y0: yg.as_view_mut(),
                    y1: Some(yu.as_view_mut()),
                    n_in: e_in,
                    n_out: e_ff,
                },
            )
        };
        let launch_d_q = |idb: &CudaBuffer, yd: &mut CudaBuffer, fault: &mut CudaBuffer| {
            k.gemv_grouped_swiglu_q(
                t_down,
                GroupedSwiglu {
                    w: bufs[2].as_view(),
                    n_experts: n_exp,
                    ids: idb.as_view(),
                    n_sel,
                    g: gb.as_view(),
                    u: ub.as_view(),
                    route_w: rwb.as_view(),
                    clamp,
                    y: yd.as_view_mut(),
                    fault: fault.as_view_mut(),
                    n_in: e_ff,
                    n_out: e_in,
                },
            )
        };
        let (rq_gu, rq_d) = {
            use ds4_gguf::quant::q8act::{dot, ActQ8};
            let mut xq = ActQ8::default();
            xq.quantize(&x)?;
            let (mut rg, mut ru, mut rd) = (Vec::new(), Vec::new(), Vec::new());
            for (s, &id) in ids.iter().enumerate() {
                let id = id as usize;
                for r in 0..e_ff {
                    let o = (id * e_ff + r) * rb_gu;
                    rg.push(dot(t_gu.ggml(), &gate[o..o + rb_gu], &xq)?);
                    ru.push(dot(t_gu.ggml(), &up[o..o + rb_gu], &xq)?);
                }
                // route_w · swiglu(g, u, clamp) as ds4_swiglu1 (ds4_quant.h).
                let xin: Vec<f32> = (0..e_ff)
                    .map(|i| {
                        let (g, u) = (gin[s * e_ff + i].min(clamp), uin[s * e_ff + i]);
                        route[s] * (g / (1.0 + (-g).exp())) * u.clamp(-clamp, clamp)
                    })
                    .collect();
                let mut xdq = ActQ8::default();
                xdq.quantize(&xin)?;
                for r in 0..e_in {
                    let o = (id * e_in + r) * rb_d;
                    rd.push(dot(t_down.ggml(), &down[o..o + rb_d], &xdq)?);
                }
            }
            rg.extend(ru);
            (rg, rd)
        };
        yg.fill_u32(POISON)?;
        yu.fill_u32(POISON)?;
        yd.fill_u32(POISON)?;
        launch_gu_q(&idb, &mut yg, &mut yu)?;
        launch_d_q(&idb, &mut yd, &mut faultb)?;
        yg.read(0, &mut out)?;
        let mut got_gu = bytes_f32(&out);
        yu.read(0, &mut out)?;
        got_gu.extend(bytes_f32(&out));
        yd.read(0, &mut outd)?;
        let got_dq = bytes_f32(&outd);
        let mut fb = [0u8; 4];
        faultb.read(0, &mut fb)?;
        let cq_gu = compare(&got_gu, &rq_gu);
        let cq_d = compare(&got_dq, &rq_d);
        // Gate/up: the same integer sums as the CPU, only the float scaling's order differs.
        // Down: the GPU's expf may move an activation code by one against the CPU's exp.
        if cq_gu.2 > 0 || !within_tol(cq_gu.0) {
            rep.fail(format!(
                "decode grouped_q {} gate/up: rel {:.3e}, {} non-finite",
                t_gu.suffix(),
                cq_gu.0,
                cq_gu.2
            ));
        }
        if cq_d.2 > 0 || !(cq_d.0.is_finite() && cq_d.0 < 1e-3) || fb != [0; 4] {
            rep.fail(format!(
                "decode grouped_swiglu_q {} down: rel {:.3e}, {} non-finite, fault {:?}",
                t_down.suffix(),
                cq_d.0,
                cq_d.2,
                fb
            ));
        }
        // Timing: experts spread over 553+ MB tensors; rotate the selected ids.
        let (e0, e1) = (dev.event()?, dev.event()?);
        let mut tgu = Vec::new();
        let mut td = Vec::new();
        let (mut tgu_q, mut td_q) = (Vec::new(), Vec::new());
        for _ in 0..samples {
            let shift: Vec<i32> = (0..n_sel)
                .map(|_| (rng.next() % n_exp as u64) as i32)
                .collect();
            idb.write(
                0,
                &shift
                    .iter()
                    .flat_map(|i| i.to_le_bytes())
                    .collect::<Vec<_>>(),
            )?;
            e0.record()?;
            launch_gu(&idb, &mut yg, &mut yu)?;
            e1.record()?;
            tgu.push(f64::from(e0.elapsed_ms(&e1)?) * 1e3);
            e0.record()?;
            launch_d(&idb, &mut yd)?;
            e1.record()?;
            td.push(f64::from(e0.elapsed_ms(&e1)?) * 1e3);
            e0.record()?;
            launch_gu_q(&idb, &mut yg, &mut yu)?;
            e1.record()?;
            tgu_q.push(f64::from(e0.elapsed_ms(&e1)?) * 1e3);
            e0.record()?;
            launch_d_q(&idb, &mut yd, &mut faultb)?;
            e1.record()?;
            td_q.push(f64::from(e0.elapsed_ms(&e1)?) * 1e3);
        }
        let (ugu_q, ud_q) = (median(&mut tgu_q), median(&mut td_q));
        let (ugu, ud) = (median(&mut tgu), median(&mut td));
        // Graph: 16 layers' worth of gate+up and down launches, each with its own random
        // ids, in one graph (what a decode step does).
        let mut id_sets = Vec::new();
        for _ in 0..16 {
            let mut b = dev.alloc(MemKind::Device, 4 * n_sel)?;
            let ids: Vec<i32> = (0..n_sel)
                .map(|_| (rng.next() % n_exp as u64) as i32)
                .collect();
            b.write(
                0,
                &ids.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<_>>(),
            )?;
            id_sets.push(b);
        }
        let (ggu, gd, ggu_q, gd_q) = {
            // which: 0 gate/up, 1 down (the f32-activation kernels), 2 gate/up, 3 down
            // (decode's kernels).
            let time_graph =
                |which: u8, yg: &mut CudaBuffer, yu: &mut CudaBuffer, yd: &mut CudaBuffer| {
                    let mut fault = dev.alloc(MemKind::Device, 4)?;
                    fault.fill_u32(0)?;
                    dev.with_graph(
                        || {
                            for ids in &id_sets {
                                match which {
                                    0 => launch_gu(ids, yg, yu)?,
                                    1 => launch_d(ids, yd)?,
                                    2 => launch_gu_q(ids, yg, yu)?,
                                    _ => launch_d_q(ids, yd, &mut fault)?,
                                };
                            }
                            Ok(())
                        },
                        |g| {
                            g.launch()?;
                            let mut t = Vec::new();
                            for _ in 0..samples {
                                e0.record()?;
                                g.launch()?;
                                e1.record()?;
                                t.push(f64::from(e0.elapsed_ms(&e1)?) * 1e3 / id_sets.len() as f64);
                            }
                            Ok(median(&mut t))
                        },
                    )
                };
            (
                time_graph(0, &mut yg, &mut yu, &mut yd)?,
                time_graph(1, &mut yg, &mut yu, &mut yd)?,
                time_graph(2, &mut yg, &mut yu, &mut yd)?,
                time_graph(3, &mut yg, &mut yu, &mut yd)?,
            )
        };
        let bgu = (2 * n_sel * e_ff * rb_gu) as f64;
        let bd = (n_sel * e_in * rb_d) as f64;
        let gbs = |b: f64, us: f64| b / (us * 1e-6) / 1e9;
        let line = format!(
            "grouped {}/{}: rel gate {:.2e} up {:.2e} down {:.2e} | single launch: gate+up {:6.2} us {:5.0} GB/s, down {:6.2} us {:5.0} GB/s | graph: gate+up {:6.2} us {:5.0} GB/s, down {:6.2} us {:5.0} GB/s",
            t_gu.suffix(), t_down.suffix(), cg.0, cu.0, cd.0, ugu, gbs(bgu, ugu), ud, gbs(bd, ud), ggu, gbs(bgu, ggu), gd, gbs(bd, gd)
        );
        rep.line(line.clone());
        table.push(line);
        // Decode's kernels: bytes, µs and the fraction of copy bandwidth per launch (the
        // graph's per-launch time: 16 layers' launches back to back, as in a decode step).
        let pct = |b: f64, us: f64| 100.0 * gbs(b, us) / copy_gbs;
        let line = format!(
            "decode routed {}/{}: rel gate/up {:.2e} down {:.2e} | gate/up {:.1} MB: single {:6.2} us, graph {:6.2} us {:5.0} GB/s ({:4.1}% of copy) | down+swiglu {:.1} MB: single {:6.2} us, graph {:6.2} us {:5.0} GB/s ({:4.1}% of copy)",
            t_gu.suffix(), t_down.suffix(), cq_gu.0, cq_d.0,
            bgu / 1e6, ugu_q, ggu_q, gbs(bgu, ggu_q), pct(bgu, ggu_q),
            bd / 1e6, ud_q, gd_q, gbs(bd, gd_q), pct(bd, gd_q)
        );
        rep.line(line.clone());
        table.push(line);
    }

    let _ = std::fs::remove_dir_all(&cache_dir);
    println!("\n==== summary ({} failures) ====", rep.failures.len());
    println!("copy bandwidth {:.0} GB/s", copy_gbs);
    for l in &table {
        println!("{l}");
    }
    if let Ok(out) = std::env::var("OUT") {
        let _ = std::fs::write(
            std::path::Path::new(&out).join("ds4-gpu-check.log"),
            rep.lines.join("\n"),
        );
    }
    if !rep.failures.is_empty() {
        for f in &rep.failures {
            println!("FAIL: {f}");
        }
        bail!("{} check(s) failed", rep.failures.len());
    }
    println!("ALL CHECKS PASSED");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(a: &[&str]) -> Result<CompileArgs> {
        parse_compile_args(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn compile_arguments() {
        let c = parse(&["--arch", "sm_80,sm_90", "--out", "d", "-DX=1"]).unwrap();
        assert_eq!(c.archs, vec!["sm_80", "sm_90"]);
        assert_eq!(c.out.as_deref(), Some("d"));
        assert_eq!(c.extra, vec!["-DX=1"]);
        let c = parse(&["sm_86", "outdir"]).unwrap();
        assert_eq!(
            (c.archs, c.out),
            (vec!["sm_86".to_string()], Some("outdir".into()))
        );
        assert_eq!(parse(&[]).unwrap().archs, vec!["sm_90"]);
        assert!(parse(&["--arch", "compute_90"]).is_err());
        assert!(parse(&["--arch"]).is_err());
        assert!(parse(&["sm_90", "d", "extra"]).is_err());
    }
}
