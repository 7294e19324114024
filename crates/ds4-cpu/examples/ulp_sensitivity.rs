//! How far the logits move when every per-layer norm weight is nudged by one ulp, in
//! `exact` and `official` mode, on random 40-token prompts (CPU engine only).
//!
//! Why: any two correct backends differ in the last ulp (summation order), and official
//! mode's FP8/FP4 simulation turns a last-ulp difference at a rounding boundary into a
//! whole quantisation step. This measures how large that effect is on a model, so a GPU
//! vs CPU parity deviation in official mode can be told apart from a kernel bug.
//!
//! `cargo run --release -p ds4-cpu --example ulp_sensitivity -- MODEL.gguf [PROMPTS]`
//! (writes the perturbed copy to the system temp directory).

use std::error::Error;
use std::path::Path;
use std::sync::Arc;

use ds4_engine::{Engine, EngineConfig, Logits, NumericMode, Rng};
use ds4_gguf::{GgmlType, GgufFile, GgufWriter};

type R<T> = Result<T, Box<dyn Error>>;

/// max |a - b| / max |b|, as the GPU parity check measures it.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let (mut md, mut mb) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        md = md.max((x as f64 - y as f64).abs());
        mb = mb.max((y as f64).abs());
    }
    md / mb
}

fn logits(file: &Arc<GgufFile>, mode: NumericMode, toks: &[u32]) -> R<Vec<f32>> {
    let be = Box::new(ds4_cpu::CpuBackend::new(0)?);
    let cfg = EngineConfig {
        mode: Some(mode),
        ctx: 4096,
        prefill_chunk: toks.len(),
    };
    let mut eng = Engine::load(file.clone(), be, cfg)?;
    let mut st = eng.new_state()?;
    Ok(eng.eval(&mut st, toks, Logits::All, None)?)
}

/// A copy of `f` whose F32 `blk.*_norm.weight` values are each one ulp larger.
fn perturbed_copy(f: &GgufFile, out: &Path) -> R<()> {
    let sink = std::io::BufWriter::new(std::fs::File::create(out)?);
    let mut w = GgufWriter::new(sink, f.header().clone())?;
    for t in &f.header().tensors {
        let mut d = f.tensor_data(t)?.to_vec();
        if t.ty == GgmlType::F32 && t.name.starts_with("blk.") && t.name.ends_with("_norm.weight") {
            for c in d.chunks_exact_mut(4) {
                let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                c.copy_from_slice(&f32::from_bits(v.to_bits() + 1).to_le_bytes());
            }
        }
        w.write_tensor(&d)?;
    }
    w.finish()?;
    Ok(())
}

fn main() -> R<()> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: ulp_sensitivity MODEL.gguf [PROMPTS]")?;
    let runs: usize = args
        .next()
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(20)
        .max(1);
    let a = Arc::new(GgufFile::open(Path::new(&path))?);
    let copy = std::env::temp_dir().join("ds4-ulp-perturbed.gguf");
    perturbed_copy(&a, &copy)?;
    let b = Arc::new(GgufFile::open(&copy)?);
    let vocab = a
        .header()
        .tensors
        .iter()
        .find(|t| t.name == "token_embd.weight")
        .and_then(|t| t.dims.get(1).copied())
        .ok_or("no token_embd.weight")? as usize;
    let mut rng = Rng::new(7);
    for mode in [NumericMode::Exact, NumericMode::Official] {
        let mut errs = Vec::new();
        for _ in 0..runs {
            let toks: Vec<u32> = (0..40)
                .map(|_| (rng.next_f64() * vocab as f64) as u32 % vocab as u32)
                .collect();
            errs.push(rel_err(
                &logits(&b, mode, &toks)?,
                &logits(&a, mode, &toks)?,
            ));
        }
        errs.sort_by(|x, y| x.total_cmp(y));
        let over = errs.iter().filter(|&&e| e > 1e-3).count();
        println!(
            "{path} {mode}: {runs} prompts, median {:.2e}, max {:.2e}, above 1e-3: {over}",
            errs[runs / 2],
            errs[runs - 1]
        );
    }
    std::fs::remove_file(&copy)?;
    Ok(())
}
