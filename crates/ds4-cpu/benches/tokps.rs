//! Plain timing of CPU prefill and decode throughput (for information; nothing asserts).
//!
//! `cargo bench -p ds4-cpu --bench tokps` runs the tiny HF fixtures (converted to f32).
//! With `DS4_BENCH_REAL=1` it also writes (or reuses `DS4_BENCH_MODEL=PATH`) a synthetic
//! model at the real Flash width with 2 layers (one CSA, one HCA; q2 recipe, ~5.5 GB) and
//! times it. `DS4_BENCH_THREADS` sets the thread count (default: all cores).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use ds4_cpu::CpuBackend;
use ds4_engine::{Engine, EngineConfig, NumericMode, Rng, Session};
use ds4_gguf::GgufFile;

fn threads() -> usize {
    std::env::var("DS4_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn session(file: &Arc<GgufFile>, mode: NumericMode, ctx: usize, chunk: usize) -> Session {
    let cfg = EngineConfig {
        mode: Some(mode),
        ctx,
        prefill_chunk: chunk,
    };
    let be = Box::new(CpuBackend::new(threads()).expect("thread pool"));
    Session::new(Engine::load(Arc::clone(file), be, cfg).expect("load")).expect("session")
}

fn bench(name: &str, file: &Arc<GgufFile>, mode: NumericMode, n_prefill: usize, n_decode: usize) {
    let n_vocab = {
        let s = session(file, mode, 16, 16);
        s.engine().hparams().n_vocab
    };
    let mut rng = Rng::new(1);
    let toks: Vec<u32> = (0..n_prefill + n_decode)
        .map(|_| (rng.next_u64() % n_vocab as u64) as u32)
        .collect();
    let mut s = session(file, mode, n_prefill + n_decode + 1, 128);
    let t0 = Instant::now();
    s.prefill(&toks[..n_prefill]).expect("prefill");
    let tp = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for &t in &toks[n_prefill..] {
        s.decode(t).expect("decode");
    }
    let td = t1.elapsed().as_secs_f64();
    println!(
        "{name:26} {:8} {:16} prefill {n_prefill:4} tok {:9.1} tok/s   decode {n_decode:3} tok {:8.2} tok/s",
        mode.as_str(),
        s.engine().backend_name(),
        n_prefill as f64 / tp,
        n_decode as f64 / td
    );
}

fn convert(dir: &Path, out: &Path) -> Arc<GgufFile> {
    let src = out.join("hf");
    std::fs::create_dir_all(&src).expect("mkdir");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(dir.join(f), src.join(f)).expect("copy fixture");
    }
    let path = out.join("f32.gguf");
    let opts = ds4_convert::HfOptions::new("f32").expect("recipe");
    ds4_convert::convert_hf(&src, &path, &opts, &mut ds4_convert::NoProgress).expect("convert");
    Arc::new(GgufFile::open(&path).expect("open"))
}

fn real_width_model(tmp: &Path) -> PathBuf {
    if let Ok(p) = std::env::var("DS4_BENCH_MODEL") {
        if Path::new(&p).exists() {
            return PathBuf::from(p);
        }
    }
    let mut h = ds4_model::HParams::flash();
    h.n_layer = 2;
    h.compress_ratios = vec![4, 128];
    h.swiglu_clamp = vec![10.0; 2];
    h.hash_layer_count = 0;
    let tok = ds4_model::layout::placeholder_tokenizer(h.n_vocab);
    let m =
        ds4_convert::SyntheticModel::from_hparams(h, ds4_model::layout::TypeRecipe::Q2, 7, &tok)
            .expect("synthetic model");
    let path = std::env::var("DS4_BENCH_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|_| tmp.join("real-width-2l.gguf"));
    let f = std::io::BufWriter::new(std::fs::File::create(&path).expect("create"));
    let t = Instant::now();
    m.write_to(f, &mut ds4_convert::NoProgress).expect("write");
    println!(
        "wrote {} in {:.0}s",
        path.display(),
        t.elapsed().as_secs_f64()
    );
    path
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    dirs.retain(|p| p.join("model.safetensors").exists());
    dirs.sort();
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let file = convert(&dir, &tmp.path().join(&name));
        for mode in [NumericMode::Exact, NumericMode::Official] {
            bench(&name, &file, mode, 512, 64);
        }
    }
    // On/off as every ds4 switch reads it (ds4_placement::parse_switch).
    let real = std::env::var("DS4_BENCH_REAL").is_ok_and(|v| {
        ds4_placement::parse_switch("DS4_BENCH_REAL", &v).unwrap_or_else(|e| panic!("{e}"))
    });
    if real {
        let path = real_width_model(tmp.path());
        let file = Arc::new(GgufFile::open(&path).expect("open"));
        bench(
            "real-width 2 layers (q2)",
            &file,
            NumericMode::Official,
            32,
            4,
        );
    }
}
