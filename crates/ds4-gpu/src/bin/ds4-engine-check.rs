//! ds4-engine-check: the CUDA engine backend against the CPU reference.
//!
//! * `ops [MODELS] [--tiny N] [--flash-layers L] [--tokens T] [--seed S]` — every op of
//!   the forward pass run on both backends through [`ds4_gpu::backend::mirror::Mirror`],
//!   on the given GGUF files and on `N` freshly generated random tiny models (and a
//!   real-dimension synthetic q2 model of `L` layers), with random tokens: per op, the
//!   worst relative error, NaN count and integer mismatches. Fails above tolerance.
//! * `parity [MODELS] [--tiny N] [--tokens T] [--seed S]` — whole-model logits of the CUDA
//!   engine against the CPU engine, through prefill, token-by-token decode and chunked
//!   prefill, in exact mode (tolerance 1e-4, the CPU-vs-HF tolerance) and official mode
//!   (1e-3) where the model allows it.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use ds4_convert::SyntheticModel;
use ds4_cpu::CpuBackend;
use ds4_engine::{Engine, EngineConfig, Logits, NumericMode, Rng};
use ds4_gguf::GgufFile;
use ds4_gpu::backend::mirror::{rel_err, Mirror};
use ds4_gpu::backend::{CudaBackend, CudaOptions};
use ds4_model::layout::{placeholder_tokenizer, TypeRecipe};
use ds4_model::HParams;

const TOL_EXACT: f64 = 1e-4;
const TOL_OFFICIAL: f64 = 1e-3;

struct Args {
    models: Vec<String>,
    tiny: usize,
    flash_layers: usize,
    tokens: usize,
    seed: u64,
}

fn parse(args: &[String]) -> Result<Args> {
    let mut a = Args {
        models: Vec::new(),
        tiny: 2,
        flash_layers: 0,
        tokens: 48,
        seed: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1),
    };
    let mut i = 0;
    while i < args.len() {
        let v = |i: usize| -> Result<&String> {
            args.get(i + 1)
                .with_context(|| format!("{} needs a value", args[i]))
        };
        match args[i].as_str() {
            "--tiny" => a.tiny = v(i)?.parse()?,
            "--flash-layers" => a.flash_layers = v(i)?.parse()?,
            "--tokens" => a.tokens = v(i)?.parse()?,
            "--seed" => a.seed = v(i)?.parse()?,
            s if s.starts_with("--") => bail!("unknown option {s}"),
            s => {
                a.models.push(s.to_string());
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    Ok(a)
}

/// Small dims that reach every path: window roll-over, CSA selection with scoring, HCA,
/// hash and top-k routing, K-quant blocks (256-multiples), partial FP8 blocks.
fn tiny_hparams() -> HParams {
    let n_layer = 4;
    HParams {
        n_layer,
        n_embd: 256,
        n_head: 4,
        head_dim: 64,
        rope_dim: 16,
        q_lora_rank: 64,
        o_lora_rank: 32,
        o_groups: 2,
        n_vocab: 97,
        n_expert: 8,
        n_expert_used: 2,
        expert_ff: 256,
        hash_layer_count: 2,
        swiglu_clamp: vec![10.0; n_layer],
        sliding_window: 8,
        compress_ratios: vec![0, 0, 4, 16],
        indexer_heads: 16,
        indexer_head_dim: 32,
        indexer_top_k: 3,
        context_length: Some(4096),
        yarn: ds4_model::Yarn {
            factor: 4.0,
            original_context: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
        },
        compress_rope_freq_base: 1000.0,
        ..HParams::flash()
    }
}

fn in_memory(m: &SyntheticModel) -> Result<Arc<GgufFile>> {
    let (bytes, _) = m.write_to(Vec::new(), &mut ds4_convert::NoProgress)?;
    Ok(Arc::new(GgufFile::from_bytes(bytes)?))
}

/// (label, file) for every model of the run.
fn models(a: &Args) -> Result<Vec<(String, Arc<GgufFile>)>> {
    let mut out = Vec::new();
    for p in &a.models {
        let f = GgufFile::open(p).with_context(|| format!("opening {p}"))?;
        out.push((p.clone(), Arc::new(f)));
    }
    for i in 0..a.tiny {
        let seed = a.seed.wrapping_add(i as u64 * 7919);
        let recipe = if i % 2 == 0 {
            TypeRecipe::Q2
        } else {
            TypeRecipe::Q4
        };
        let h = tiny_hparams();
        let tok = placeholder_tokenizer(h.n_vocab);
        let m = SyntheticModel::from_hparams(h, recipe, seed, &tok)?;
        out.push((
            format!(
                "random tiny {} (seed {seed})",
                if i % 2 == 0 { "q2" } else { "q4" }
            ),
            in_memory(&m)?,
        ));
    }
    if a.flash_layers > 0 {
        let t0 = Instant::now();
        let m = SyntheticModel::new(TypeRecipe::Q2, a.flash_layers, a.seed)?;
        let f = in_memory(&m)?;
        println!(
            "generated a {}-layer full-dimension q2 model ({:.2} GB) in {:.1} s",
            a.flash_layers,
            f.bytes().len() as f64 / 1e9,
            t0.elapsed().as_secs_f64()
        );
        out.push((format!("flash q2 x{} layers", a.flash_layers), f));
    }
    Ok(out)
}

fn random_tokens(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|_| (rng.next_f64() * vocab as f64) as u32 % vocab as u32)
        .collect()
}

fn modes(file: &GgufFile) -> Result<Vec<NumericMode>> {
    let spec = ds4_model::ModelSpec::from_header(file.header(), ds4_model::Strictness::Auto)?;
    let mut m = vec![NumericMode::Exact];
    if NumericMode::official_unsupported(&spec.hparams).is_none() {
        m.push(NumericMode::Official);
    }
    Ok(m)
}

fn cuda() -> Result<CudaBackend> {
    CudaBackend::new(CudaOptions::default()).context("starting the CUDA backend")
}

fn ops(a: &Args) -> Result<()> {
    let mut failed = Vec::new();
    let mut rng = Rng::new(a.seed);
    println!("ops: seed {}", a.seed);
    for (label, file) in models(a)? {
        for mode in modes(&file)? {
            let t0 = Instant::now();
            let mirror = Mirror::new(CpuBackend::new(0)?, cuda()?);
            let stats_handle = mirror.stats.clone();
            let chunk = 3 + (rng.next_f64() * 14.0) as usize;
            let cfg = EngineConfig {
                mode: Some(mode),
                ctx: 4096,
                prefill_chunk: chunk,
            };
            let mut eng = Engine::load(file.clone(), Box::new(mirror), cfg)?;
            let vocab = eng.hparams().n_vocab;
            let toks = random_tokens(&mut rng, a.tokens + 4, vocab);
            let mut st = eng.new_state()?;
            eng.eval(&mut st, &toks[..a.tokens], Logits::Last, None)?;
            for t in &toks[a.tokens..] {
                eng.eval(&mut st, std::slice::from_ref(t), Logits::Last, None)?;
            }
            // Greedy steps (the device argmax op is mirrored too).
            let mut next = toks[a.tokens];
            for _ in 0..3 {
                next = eng.eval_argmax(&mut st, &[next])?;
            }
            drop(eng);
            let stats = stats_handle.lock().map(|s| s.clone()).unwrap_or_default();
            let tol = if mode == NumericMode::Exact {
                TOL_EXACT
            } else {
                TOL_OFFICIAL
            };
            println!(
                "\n{label} · {mode} · prefill {} tokens in chunks of {chunk} + 4 decode · {:.1} s",
                a.tokens,
                t0.elapsed().as_secs_f64()
            );
            println!(
                "  {:<18} {:>6} {:>12} {:>5} {:>9}  verdict",
                "op", "calls", "max rel err", "NaN", "int diff"
            );
            for (op, s) in &stats {
                let bad_int = s.int_mismatches > 0 && *op != "indexer_topk";
                let ok = s.max_rel <= tol && s.nan == 0 && !bad_int;
                println!(
                    "  {:<18} {:>6} {:>12.3e} {:>5} {:>9}  {}",
                    op,
                    s.calls,
                    s.max_rel,
                    s.nan,
                    s.int_mismatches,
                    if ok { "ok" } else { "FAIL" }
                );
                if !ok {
                    failed.push(format!("{label} {mode} {op}"));
                }
            }
        }
    }
    if failed.is_empty() {
        println!("\nOPS: ALL PASSED");
        Ok(())
    } else {
        bail!("ops failed: {}", failed.join(", "))
    }
}

/// Logits of the three evaluation paths: all-at-once prefill (all rows), token-by-token
/// decode, and prefill in chunks of 5.
fn paths(
    file: &Arc<GgufFile>,
    mode: NumericMode,
    toks: &[u32],
    gpu: bool,
) -> Result<[Vec<f32>; 3]> {
    let mut out: [Vec<f32>; 3] = Default::default();
    for (i, chunk) in [toks.len(), 1, 5].into_iter().enumerate() {
        let be: Box<dyn ds4_engine::Backend> = if gpu {
            Box::new(cuda()?)
        } else {
            Box::new(CpuBackend::new(0)?)
        };
        let cfg = EngineConfig {
            mode: Some(mode),
            ctx: 4096,
            prefill_chunk: chunk,
        };
        let mut eng = Engine::load(file.clone(), be, cfg)?;
        let mut st = eng.new_state()?;
        let v = if i == 1 {
            let mut all = Vec::new();
            for t in toks {
                all.extend(eng.eval(&mut st, std::slice::from_ref(t), Logits::Last, None)?);
            }
            all
        } else {
            eng.eval(&mut st, toks, Logits::All, None)?
        };
        out[i] = v;
    }
    Ok(out)
}

fn parity(a: &Args) -> Result<()> {
    let mut rng = Rng::new(a.seed);
    let mut failed = Vec::new();
    println!("parity: seed {}", a.seed);
    for (label, file) in models(a)? {
        for mode in modes(&file)? {
            let spec =
                ds4_model::ModelSpec::from_header(file.header(), ds4_model::Strictness::Auto)?;
            let toks = random_tokens(&mut rng, a.tokens, spec.hparams.n_vocab);
            let t0 = Instant::now();
            let cpu = paths(&file, mode, &toks, false)?;
            let gpu = paths(&file, mode, &toks, true)?;
            let tol = if mode == NumericMode::Exact {
                TOL_EXACT
            } else {
                TOL_OFFICIAL
            };
            let names = ["prefill", "decode", "chunked"];
            let mut line = format!("{label} · {mode} · {} tokens:", toks.len());
            for i in 0..3 {
                let r = rel_err(&gpu[i], &cpu[i]);
                let ok = r <= tol && gpu[i].len() == cpu[i].len();
                line += &format!(" {} {:.2e}{}", names[i], r, if ok { "" } else { " FAIL" });
                if !ok {
                    failed.push(format!("{label} {mode} {}", names[i]));
                }
            }
            println!("{line} ({:.1} s)", t0.elapsed().as_secs_f64());
        }
    }
    if failed.is_empty() {
        println!("PARITY: ALL PASSED (exact tol {TOL_EXACT:e}, official tol {TOL_OFFICIAL:e})");
        Ok(())
    } else {
        bail!("parity failed: {}", failed.join(", "))
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rest = parse(args.get(1..).unwrap_or(&[]))?;
    match args.first().map(String::as_str) {
        Some("ops") => ops(&rest),
        Some("parity") => parity(&rest),
        _ => bail!("usage: ds4-engine-check (ops|parity) [MODEL.gguf...] [--tiny N] [--flash-layers L] [--tokens T] [--seed S]"),
    }
}
