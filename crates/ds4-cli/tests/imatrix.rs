//! `ds4 imatrix` on the trained demo model (tests/fixtures/kjv): the routed experts'
//! activation statistics, collected by the CPU engine, written in llama.cpp's legacy format,
//! read back, and used by `ds4-convert requant` to weight the q2 experts. The weighted error
//! on those statistics must not grow (docs/gguf.md §5.4). The same statistics collected on
//! the GPU backend (its kernels emulated on the CPU) equal the CPU's.

use std::path::{Path, PathBuf};

use std::sync::{Arc, Mutex};

use ds4_cli::imatrix::{collect, Collecting};
use ds4_convert::imatrix::{Collector, Imatrix};
use ds4_engine::{Backend, Engine, EngineConfig, NumericMode};
use ds4_gguf::GgufFile;
use ds4_runtime::load::{BackendChoice, LoadOptions, LoadReport};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Σ over experts, rows and columns of imp_e[c] · (w − ŵ)² of one routed tensor.
fn weighted_error(f32_file: &GgufFile, q: &GgufFile, name: &str, im: &Imatrix) -> f64 {
    let (t, w) = f32_file.tensor_bytes(name).unwrap();
    let w: Vec<f32> = w
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let (tq, data) = q.tensor_bytes(name).unwrap();
    let mut got = vec![0f32; w.len()];
    ds4_gguf::quant::dequantize(tq.ty, data, &mut got).unwrap();
    let (ne0, ne1, n) = (t.dims[0] as usize, t.dims[1] as usize, t.dims[2] as usize);
    let mut sum = 0f64;
    for e in 0..n {
        let imp = im
            .importance(name, ne0, Some((e, n)))
            .unwrap()
            .unwrap_or_else(|| vec![0.0; ne0]);
        for r in 0..ne1 {
            let at = (e * ne1 + r) * ne0;
            for (c, p) in imp.iter().enumerate() {
                sum += f64::from(*p) * f64::from(w[at + c] - got[at + c]).powi(2);
            }
        }
    }
    sum
}

/// How the tests load a model: the CPU backend, one thread, the default settings.
fn cpu_load(model: &Path) -> LoadOptions {
    LoadOptions {
        model: model.to_path_buf(),
        backend: BackendChoice::Cpu,
        mode: None,
        ctx: 64,
        kv_states: 1,
        prefill_chunk: 64,
        threads: 1,
        placement: ds4_placement::CliOverrides::default(),
        report: LoadReport::Quiet,
        config: ds4_runtime::config::Config::default(),
    }
}

#[test]
fn collected_imatrix_round_trips_and_lowers_the_weighted_q2_error() {
    let tmp = tempfile::tempdir().unwrap();
    let model = root().join("tests/fixtures/kjv/ds4-kjv.gguf");
    let text = tmp.path().join("text.txt");
    let heldout = std::fs::read_to_string(root().join("tests/fixtures/kjv/heldout.txt")).unwrap();
    std::fs::write(&text, &heldout[..6000]).unwrap();
    let out = tmp.path().join("kjv.dat");
    let req = ds4_cli::imatrix::Request {
        file: text,
        out: out.clone(),
        ctx: 64,
        chunks: Some(2),
    };
    let (chunks, entries) =
        ds4_cli::imatrix::run(&req, &cpu_load(&model), &mut std::io::sink()).unwrap();
    assert_eq!(chunks, 2);
    let bytes = std::fs::read(&out).unwrap();
    let im = Imatrix::parse(&bytes).unwrap();
    assert_eq!(im.to_bytes(), bytes, "the file round-trips byte for byte");
    assert_eq!(im.entries.len(), entries);
    assert_eq!(im.chunks, Some(2));
    // Every routed tensor of the 4 layers, with n_expert · ne0 values and some expert used.
    let f = GgufFile::open(&model).unwrap();
    let routed: Vec<String> = f
        .header()
        .tensors
        .iter()
        .filter(|t| t.name.ends_with("_exps.weight"))
        .map(|t| t.name.clone())
        .collect();
    assert_eq!(routed.len(), 12);
    for name in &routed {
        let t = f.header().tensor(name).unwrap();
        let e = &im.entries[name];
        assert_eq!(e.values.len() as u64, t.dims[0] * t.dims[2], "{name}");
        assert!(e.values.iter().any(|v| *v > 0.0), "{name}: no activation");
    }
    // q2 with and without it; the weighted error on the collected statistics.
    let plain = tmp.path().join("q2.gguf");
    let weighted = tmp.path().join("q2-imatrix.gguf");
    let mut o = ds4_convert::HfOptions::new("q2").unwrap();
    ds4_convert::requant::requantize(&model, &plain, &o, &mut ds4_convert::NoProgress).unwrap();
    o.imatrix = Some((out, std::sync::Arc::new(im.clone())));
    ds4_convert::requant::requantize(&model, &weighted, &o, &mut ds4_convert::NoProgress).unwrap();
    let (fp, fw) = (
        GgufFile::open(&plain).unwrap(),
        GgufFile::open(&weighted).unwrap(),
    );
    let (mut tp, mut tw) = (0f64, 0f64);
    for name in &routed {
        let ep = weighted_error(&f, &fp, name, &im);
        let ew = weighted_error(&f, &fw, name, &im);
        eprintln!("{name}: weighted error {ew:.4e} with the imatrix, {ep:.4e} without");
        assert!(ew <= ep, "{name}: {ew} > {ep}");
        tp += ep;
        tw += ew;
    }
    eprintln!("total: {tw:.4e} with, {tp:.4e} without");
}

/// The imatrix of `tokens` (chunks of `ctx`) collected on `backend`, `mode` forced.
fn collected_on(
    file: &Arc<GgufFile>,
    backend: Box<dyn Backend>,
    tokens: &[u32],
    ctx: usize,
) -> Imatrix {
    let stats = Arc::new(Mutex::new(Collector::default()));
    let be = Box::new(Collecting::new(backend, stats.clone(), false));
    let cfg = EngineConfig {
        mode: Some(NumericMode::Exact),
        ctx,
        prefill_chunk: ctx,
    };
    let mut engine = Engine::load(file.clone(), be, cfg).unwrap();
    collect(&mut engine, &stats, tokens, ctx, "t", &mut std::io::sink()).unwrap()
}

/// The collector on the GPU backend (HIP over the fake runtime running the emulated
/// kernels, f32 paths) reads the rows, expert ids and SwiGLU rows back from device buffers
/// and gives the CPU backend's statistics: every routed tensor present on both, every value
/// within 1e-5 of the CPU's relative to the entry's largest (the forward passes differ only
/// by summation order).
#[test]
fn imatrix_on_the_emulated_gpu_equals_the_cpu_one() {
    use ds4_gpu::backend::{GpuBackend, GpuOptions, Knobs};
    use ds4_gpu::hip::device::HipSettings;
    use ds4_gpu::hip::fake::{FakeHip, Faults};

    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("tiny.gguf");
    let opts = ds4_convert::HfOptions::new("f32").unwrap();
    ds4_convert::convert_hf(
        &root().join("tests/fixtures/tiny-hca16"),
        &gguf,
        &opts,
        &mut ds4_convert::NoProgress,
    )
    .unwrap();
    let file = Arc::new(GgufFile::open(&gguf).unwrap());
    // 3 chunks of 40 tokens: past the window (16) and two HCA windows (16).
    let ctx = 40;
    let mut x = 12345u32;
    let tokens: Vec<u32> = (0..3 * ctx)
        .map(|_| {
            x = x.wrapping_mul(1664525).wrapping_add(1013904223);
            2 + (x >> 8) % 300
        })
        .collect();

    let cpu = collected_on(
        &file,
        Box::new(ds4_cpu::CpuBackend::new(1).unwrap()),
        &tokens,
        ctx,
    );

    let m = ds4_placement::MachineFacts::from_json(
        &std::fs::read_to_string(
            root().join("crates/ds4-placement/machines/strix-halo-stock.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let fake = FakeHip::for_machine(&m, Faults::default());
    fake.set_kernels(Arc::new(ds4_gpu::emu::EmuKernels::build().unwrap()));
    let gopts = GpuOptions {
        cache: ds4_gpu::KernelCache::at(tmp.path().join("kernels")),
        pread_load: true,
        knobs: Knobs {
            cublas: None,
            ..Knobs::quality()
        },
        ..GpuOptions::default()
    };
    let gpu_be =
        GpuBackend::with_device(fake.device(&m, HipSettings::default()), gopts, None).unwrap();
    let gpu = collected_on(&file, Box::new(gpu_be), &tokens, ctx);

    assert_eq!(cpu.chunks, Some(3));
    assert_eq!(
        cpu.entries.keys().collect::<Vec<_>>(),
        gpu.entries.keys().collect::<Vec<_>>()
    );
    // 6 layers × gate, up, down.
    assert_eq!(cpu.entries.len(), 18);
    let mut worst = 0f64;
    for (name, c) in &cpu.entries {
        let g = &gpu.entries[name];
        assert_eq!(c.ncall, g.ncall, "{name}");
        assert_eq!(c.values.len(), g.values.len(), "{name}");
        let scale = c.values.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
        assert!(scale > 0.0, "{name}: no activation");
        for (a, b) in c.values.iter().zip(&g.values) {
            let d = f64::from(a - b).abs() / scale;
            worst = worst.max(d);
        }
    }
    eprintln!("largest difference, relative to the entry's largest value: {worst:.3e}");
    assert!(worst < 1e-5, "{worst}");
}
