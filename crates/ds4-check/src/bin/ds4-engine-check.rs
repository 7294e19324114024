//! ds4-engine-check: the CUDA engine backend against the CPU reference.
//!
//! * `ops [MODELS] [--tiny N] [--flash-layers L] [--tokens T] [--seed S] [--chunk C] [--act-q8]
//!   [--tiles off|experts|all] [--attn-mma]` — every op of
//!   the forward pass run on both backends through [`ds4_check::mirror::Mirror`],
//!   on the given GGUF files and on `N` freshly generated random tiny models (and a
//!   real-dimension synthetic q2 model of `L` layers), with random tokens: per op, the
//!   worst relative error, NaN count and integer mismatches. Fails above tolerance.
//!
//! The CUDA backend's kernels are chosen by the flags alone (`Knobs`, no environment):
//! f32 everywhere (`ds4 --quality`'s kernels, cuBLAS in full f32) unless `--act-q8` (int8
//! one-token activations), `--tiles` (quantized tiles at prefill) and `--attn-mma` (prefill
//! attention and indexer scores on the tensor cores) say otherwise; `ds4` runs all three
//! (`--tiles experts`), with cuBLAS in TF32.
//! * `parity [MODELS] [--tiny N] [--tokens T] [--seed S] [--act-q8]` — whole-model logits of the CUDA
//!   engine against the CPU engine, through prefill, token-by-token decode and chunked
//!   prefill, in exact mode (tolerance 1e-4, the CPU-vs-HF tolerance) and official mode where
//!   the model allows it (the reordered bound of `ds4_check::refcheck`, pooled over the run's
//!   official-mode paths, each with its own tokens, at least 100 of them: `ds4_check::parity`).
//! * `batch [MODELS] [--tiny N] [--tokens T] [--seed S] [--act-q8] [--seqs N] [--gpu-only]` — batched decode
//!   (`Engine::eval_batch`, N (default 4) sequences of different prompt lengths, 6 steps) against the
//!   same sequences decoded alone, on the CPU engine and the CUDA engine when a device
//!   answers: no greedy token may differ and every row must be within 1e-6 (bit-for-bit
//!   equality is reported). What `ds4-server --parallel` will rely on (issue 22).
//! * `joint [MODELS] [--tiny N] [--tokens T] [--chunk PIECE] [--seed S] [--act-q8] [--seqs N] [--gpu-only]`
//!   — prompt pieces of N sequences prefilled in one pass (`Engine::eval_joint`, pieces of at
//!   least the engine's minimum) against the same pieces prefilled alone: the last logits rows
//!   and two decode steps after them, the same pass rule as `batch`, with both ways timed
//!   (docs/forward.md §14: what the server's joint prefill relies on).
//! * `reference [FIXTURES_DIR] [--cpu-only] [--act-q8] [--control NAME|all]... [--paths P,..] [--only FIX]...
//!   [--seed S] [--dump FILE]` — official mode against the official-mode reference logits of
//!   the tiny fixtures (`tests/fixtures/tiny-*/official.safetensors`, written by
//!   `tools/oracle/make_official.py` from DeepSeek's reference semantics): every fixture and
//!   q2/q4 variant is converted and run through prefill, token-by-token decode and chunked
//!   prefill. The CPU engine is judged by the strict bound of
//!   `crates/ds4-cpu/tests/official_reference.rs`; the CUDA backend, whose f32 arithmetic order
//!   is its own, by the reordered bound of [`ds4_check::refcheck::Reordered`] (clean first-100
//!   prefixes), with the strict verdict printed for information and its error against the CPU
//!   engine reported apart. `--control` adds CPU runs under a control backend
//!   ([`ds4_check::refcheck::controls`]): correct reorderings must pass the reordered bound and
//!   planted bugs must fail it, or the command fails. `--cpu-only` skips the GPU (a machine
//!   without one can check the command, the CPU numbers and the controls).
//! * `quality [DEMO_DIR (default tests/fixtures/kjv)] [--ds4 PATH] [--backend B] [--chunks K]`
//!   — the trained demo model's held-out perplexity and KL divergence of each path of backend
//!   B (default cuda) against the CPU engine on the same file ([`ds4_check::quality`]): runs
//!   the `ds4` binary (default: the one beside this binary), prints a markdown table, fails
//!   when a path exceeds its bound.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use ds4_check::mirror::{rel_err, Mirror, OpRule};
use ds4_check::parity;
use ds4_check::refcheck::{self, controls::Control, controls::Controlled};
use ds4_convert::SyntheticModel;
use ds4_cpu::CpuBackend;
use ds4_engine::{Engine, EngineConfig, Logits, NumericMode, Rng};
use ds4_gguf::GgufFile;
use ds4_gpu::backend::{CudaBackend, CudaOptions, Knobs, PrefillTiles};
use ds4_model::layout::{placeholder_tokenizer, TypeRecipe};

struct Args {
    models: Vec<String>,
    tiny: usize,
    flash_layers: usize,
    tokens: usize,
    seed: u64,
    /// Fixed prefill chunk for `ops`/`parity` (0: a random chunk of 3..16 per model).
    chunk: usize,
    /// `ops`/`parity`: int8 activations on both backends (`Backend::set_activation_q8`).
    act_q8: bool,
    /// `ops`: which multi-token matmuls the GPU runs on quantized half-precision tiles.
    tiles: PrefillTiles,
    /// Prefill attention and indexer scores on the tensor cores (half operands).
    attn_mma: bool,
    /// `batch`: sequences decoded together.
    seqs: usize,
    /// `batch`: the GPU engine only (long prompts of real-dimension models take the CPU
    /// engine minutes).
    gpu_only: bool,
}

fn parse(args: &[String]) -> Result<Args> {
    let mut a = Args {
        models: Vec::new(),
        tiny: 2,
        flash_layers: 0,
        tokens: 48,
        chunk: 0,
        act_q8: false,
        tiles: PrefillTiles::Off,
        attn_mma: false,
        seqs: ds4_check::batch::SEQS,
        gpu_only: false,
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
            "--chunk" => a.chunk = v(i)?.parse()?,
            "--gpu-only" => {
                a.gpu_only = true;
                i += 1;
                continue;
            }
            "--seqs" => {
                a.seqs = v(i)?.parse()?;
                if a.seqs == 0 {
                    bail!("--seqs must be at least 1");
                }
            }
            "--tiles" => {
                a.tiles = PrefillTiles::parse(v(i)?).with_context(|| {
                    format!("--tiles {:?}: use off, experts or all", args[i + 1])
                })?
            }
            "--act-q8" => {
                a.act_q8 = true;
                i += 1;
                continue;
            }
            "--attn-mma" => {
                a.attn_mma = true;
                i += 1;
                continue;
            }
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
        let h = parity::tiny_hparams();
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

/// A fresh CUDA (`gpu`) or CPU engine backend with the given activation mode.
fn engine_backend(gpu: bool, act_q8: bool) -> Result<Box<dyn ds4_engine::Backend>> {
    let mut be: Box<dyn ds4_engine::Backend> = if gpu {
        Box::new(cuda()?)
    } else {
        Box::new(CpuBackend::new(0)?)
    };
    be.set_activation_q8(act_q8)?;
    Ok(be)
}

/// The closing line of a check: "NAME: ALL PASSED", or the error naming what failed.
fn verdict(name: &str, failed: &[String]) -> Result<()> {
    if failed.is_empty() {
        println!("\n{name}: ALL PASSED");
        Ok(())
    } else {
        bail!("{} failed: {}", name.to_lowercase(), failed.join(", "))
    }
}

/// The f32 kernels (`ds4 --quality`'s): what every check starts from.
fn cuda() -> Result<CudaBackend> {
    cuda_with(Knobs::quality())
}

/// The CUDA backend with `knobs` (see the module doc).
fn cuda_with(knobs: Knobs) -> Result<CudaBackend> {
    cuda_opts(CudaOptions {
        knobs,
        ..CudaOptions::default()
    })
}

/// The kernels `ops` checks: [`cuda`]'s, with the flags' tiles, activations and attention.
fn op_knobs(a: &Args) -> Knobs {
    Knobs {
        prefill_tiles: a.tiles,
        activation_q8: a.act_q8,
        tensor_core_attention: a.attn_mma,
        ..Knobs::quality()
    }
}

fn cuda_opts(opts: CudaOptions) -> Result<CudaBackend> {
    CudaBackend::new(opts).context("starting the CUDA backend")
}

fn ops(a: &Args) -> Result<()> {
    let mut failed = Vec::new();
    let mut rng = Rng::new(a.seed);
    println!("ops: seed {}", a.seed);
    for (label, file) in models(a)? {
        for mode in modes(&file)? {
            let t0 = Instant::now();
            let mut mirror = Mirror::new(CpuBackend::new(0)?, cuda_with(op_knobs(a))?);
            ds4_engine::Backend::set_activation_q8(&mut mirror, a.act_q8)?;
            let stats_handle = mirror.stats.clone();
            let random_chunk = 3 + (rng.next_f64() * 14.0) as usize;
            let chunk = if a.chunk > 0 { a.chunk } else { random_chunk };
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
            let rule = OpRule {
                mode,
                act_q8: a.act_q8,
                tiles: a.tiles,
                attn_half: a.attn_mma,
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
                let ok = rule.passes(op, s);
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
    verdict("OPS", &failed)
}

/// Logits of the three evaluation paths ([`parity::PATHS`]), each on a fresh backend and with
/// its own token sequence.
fn paths(
    file: &Arc<GgufFile>,
    mode: NumericMode,
    toks: &[Vec<u32>; 3],
    gpu: bool,
    act_q8: bool,
) -> Result<[Vec<f32>; 3]> {
    let mut out: [Vec<f32>; 3] = Default::default();
    for (i, o) in out.iter_mut().enumerate() {
        *o = parity::eval_path(file, mode, &toks[i], i, engine_backend(gpu, act_q8)?)?;
    }
    Ok(out)
}

fn parity(a: &Args) -> Result<()> {
    let mut rng = Rng::new(a.seed);
    let mut failed = Vec::new();
    let mut pooled = refcheck::Reordered::default();
    println!("parity: seed {}", a.seed);
    for (label, file) in models(a)? {
        for mode in modes(&file)? {
            let spec =
                ds4_model::ModelSpec::from_header(file.header(), ds4_model::Strictness::Auto)?;
            let vocab = spec.hparams.n_vocab;
            let official = mode == NumericMode::Official;
            // Exact mode: one token sequence for all three paths. Official mode: at least
            // OFFICIAL_MIN_TOKENS tokens and a sequence of its own per path (`ds4_check::parity`).
            let n = if official {
                a.tokens.max(parity::OFFICIAL_MIN_TOKENS)
            } else {
                a.tokens
            };
            let toks: [Vec<u32>; 3] = if official {
                std::array::from_fn(|_| random_tokens(&mut rng, n, vocab))
            } else {
                let t = random_tokens(&mut rng, n, vocab);
                [t.clone(), t.clone(), t]
            };
            let t0 = Instant::now();
            let cpu = paths(&file, mode, &toks, false, a.act_q8)?;
            let gpu = paths(&file, mode, &toks, true, a.act_q8)?;
            println!(
                "{label} · {mode} · {n} tokens ({:.1} s):",
                t0.elapsed().as_secs_f64()
            );
            for (i, name) in parity::PATHS.iter().enumerate() {
                if official {
                    let (e, clean) = parity::add_official(&mut pooled, &gpu[i], &cpu[i], vocab)
                        .map_err(|e| anyhow::anyhow!("{label} {mode} {name}: {e}"))?;
                    println!(
                        "  {name:8} {} [{}]",
                        e.summary(),
                        match &clean {
                            Ok(()) => "clean".to_string(),
                            Err(w) => format!("not clean: {w}"),
                        }
                    );
                } else {
                    let r = rel_err(&gpu[i], &cpu[i]);
                    let ok = r <= parity::TOL_EXACT && gpu[i].len() == cpu[i].len();
                    println!(
                        "  {name:8} max rel {r:.2e}{}",
                        if ok { "" } else { " FAIL" }
                    );
                    if !ok {
                        failed.push(format!("{label} {mode} {name}"));
                    }
                }
            }
        }
    }
    println!(
        "official mode (reordered bound: every sequence-path < {} positions clean, >= {:.0}% of the others; clean = first {} positions within {:e}, same top-1 where the CPU's gap > {:e}): short {}/{}, longer {}/{} clean",
        refcheck::PREFIX,
        100.0 * refcheck::CLEAN_SHARE,
        refcheck::PREFIX,
        refcheck::PREFIX_MAX,
        refcheck::TOP1_GAP,
        pooled.short.0,
        pooled.short.1,
        pooled.long.0,
        pooled.long.1
    );
    if let Err(w) = pooled.verdict() {
        failed.push(format!("official mode: {w}"));
    }
    if failed.is_empty() {
        println!(
            "PARITY: ALL PASSED (exact tol {:e}, official: reordered bound)",
            parity::TOL_EXACT
        );
        Ok(())
    } else {
        bail!("parity failed: {}", failed.join(", "))
    }
}

fn st_f32(st: &safetensors::SafeTensors, name: &str) -> Result<Vec<f32>> {
    let t = st
        .tensor(name)
        .with_context(|| format!("no tensor {name}"))?;
    if t.dtype() != safetensors::Dtype::F32 {
        bail!("{name} is {:?}, expected F32", t.dtype());
    }
    Ok(t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn st_tokens(st: &safetensors::SafeTensors, name: &str) -> Result<Vec<u32>> {
    let t = st
        .tensor(name)
        .with_context(|| format!("no tensor {name}"))?;
    if t.dtype() != safetensors::Dtype::I32 {
        bail!("{name} is {:?}, expected I32", t.dtype());
    }
    t.data()
        .chunks_exact(4)
        .map(|c| {
            u32::try_from(i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .with_context(|| format!("negative token in {name}"))
        })
        .collect()
}

/// Options of the `reference` subcommand.
struct RefArgs {
    fixtures: String,
    cpu_only: bool,
    controls: Vec<Control>,
    /// Which of prefill (0), decode (1), chunked (2) to run.
    paths: Vec<usize>,
    only: Vec<String>,
    seed: u64,
    /// Writes every per-position error here (JSON), for studying the bound.
    dump: Option<String>,
    /// Int8 activations on every backend (`--act-q8`): the error the fast default adds
    /// against the reference (the q2/q4 variants have low-bit weights; f32/f16 fixtures are
    /// unaffected).
    act_q8: bool,
}

const PATHS: [&str; 3] = ["prefill", "decode", "chunked"];

fn parse_reference(args: &[String]) -> Result<RefArgs> {
    let mut a = RefArgs {
        fixtures: "tests/fixtures".into(),
        cpu_only: false,
        controls: Vec::new(),
        paths: vec![0, 1, 2],
        only: Vec::new(),
        seed: 1,
        dump: None,
        act_q8: false,
    };
    let mut i = 0;
    while i < args.len() {
        let v = |i: usize| -> Result<&String> {
            args.get(i + 1)
                .with_context(|| format!("{} needs a value", args[i]))
        };
        match args[i].as_str() {
            "--cpu-only" => {
                a.cpu_only = true;
                i += 1;
                continue;
            }
            "--act-q8" => {
                a.act_q8 = true;
                i += 1;
                continue;
            }
            "--control" => {
                let c = v(i)?;
                if c == "all" {
                    for n in Control::NAMES {
                        a.controls
                            .push(Control::parse(n).map_err(anyhow::Error::msg)?);
                    }
                } else {
                    a.controls
                        .push(Control::parse(c).map_err(anyhow::Error::msg)?);
                }
            }
            "--paths" => {
                a.paths = v(i)?
                    .split(',')
                    .map(|p| {
                        PATHS.iter().position(|&n| n == p).with_context(|| {
                            format!("unknown path {p:?} (prefill, decode, chunked)")
                        })
                    })
                    .collect::<Result<_>>()?;
            }
            "--only" => a.only.push(v(i)?.clone()),
            "--seed" => a.seed = v(i)?.parse().context("--seed")?,
            "--dump" => a.dump = Some(v(i)?.clone()),
            s if s.starts_with("--") => bail!("unknown option {s}"),
            s => {
                a.fixtures = s.to_string();
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    Ok(a)
}

/// One judged run (a backend, or the CPU with a control) over every sequence.
struct RunTally {
    label: String,
    control: Option<Control>,
    /// (positions within TIGHT, positions, worst).
    pooled: (usize, usize, f64),
    /// Sequences that failed the strict bound (CPU engine), with the reason.
    failed: Vec<String>,
    /// The reordered bound's tally (GPU and controls).
    reordered: refcheck::Reordered,
    /// Earliest departure from the reference over all sequences.
    first_departure: Option<usize>,
}

fn reference(a: &RefArgs) -> Result<()> {
    let root = std::path::Path::new(&a.fixtures);
    let mut dirs: Vec<_> = std::fs::read_dir(root)
        .with_context(|| format!("reading {}", a.fixtures))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("official.json").exists())
        .filter(|p| {
            a.only.is_empty()
                || a.only
                    .iter()
                    .any(|o| p.file_name().is_some_and(|n| n.to_string_lossy() == *o))
        })
        .collect();
    dirs.sort();
    if dirs.is_empty() {
        bail!("no fixture with official.json under {}", a.fixtures);
    }
    let work = std::env::temp_dir().join(format!("ds4-engine-check-ref-{}", std::process::id()));
    // Run 0 is the CPU engine (strict bound), then the GPU (reordered bound), then controls.
    let mut runs: Vec<(String, Option<Control>)> = vec![("cpu".into(), None)];
    if !a.cpu_only {
        runs.push(("gpu".into(), None));
    }
    for c in &a.controls {
        runs.push((format!("cpu+{c}"), Some(*c)));
    }
    let mut tally: Vec<RunTally> = runs
        .iter()
        .map(|(l, c)| RunTally {
            label: l.clone(),
            control: *c,
            pooled: (0, 0, 0.0),
            failed: Vec::new(),
            reordered: refcheck::Reordered::default(),
            first_departure: None,
        })
        .collect();
    let mut dump = serde_json::Map::new();
    for dir in dirs {
        let name = dir
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        let meta: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("official.json"))?)
                .with_context(|| format!("{name}/official.json"))?;
        let inputs_bytes = std::fs::read(dir.join("reference.safetensors"))?;
        let inputs = safetensors::SafeTensors::deserialize(&inputs_bytes)?;
        let official_bytes = std::fs::read(dir.join("official.safetensors"))?;
        let official = safetensors::SafeTensors::deserialize(&official_bytes)?;
        let variants = meta["variants"]
            .as_object()
            .context("official.json: variants")?;
        for (variant, info) in variants {
            let src = work.join(&name).join("hf");
            std::fs::create_dir_all(&src)?;
            for f in ["config.json", "model.safetensors"] {
                std::fs::copy(dir.join(f), src.join(f))?;
            }
            let out = work.join(&name).join(format!("{variant}.gguf"));
            let opts = ds4_convert::HfOptions::new(variant)
                .with_context(|| format!("{name}: unknown variant {variant}"))?;
            ds4_convert::convert_hf(&src, &out, &opts, &mut ds4_convert::NoProgress)
                .with_context(|| format!("converting {name} as {variant}"))?;
            let file = Arc::new(GgufFile::open(&out)?);
            let spec =
                ds4_model::ModelSpec::from_header(file.header(), ds4_model::Strictness::Auto)?;
            let vocab = spec.hparams.n_vocab;
            let seqs = info["sequences"]
                .as_object()
                .context("official.json: sequences")?;
            for (seq, sinfo) in seqs {
                let toks = st_tokens(&inputs, &format!("tokens.{seq}"))?;
                let chunk = sinfo["chunk_size"].as_u64().context("chunk_size")? as usize;
                let want = st_f32(&official, &format!("{variant}.{seq}.logits"))?;
                let gaps = st_f32(&official, &format!("{variant}.{seq}.top1_gap"))?;
                let t0 = Instant::now();
                let mut logits = Vec::new();
                for (label, control) in &runs {
                    let gpu = label == "gpu";
                    logits.push(reference_paths(&file, &toks, chunk, gpu, *control, a)?);
                }
                let mut line = format!("{name} {variant} {seq} ({} tokens):", toks.len());
                for (r, t) in tally.iter_mut().enumerate() {
                    for &p in &a.paths {
                        let path = PATHS[p];
                        let e =
                            refcheck::compare(&logits[r][p], &want, &gaps, vocab).map_err(|e| {
                                anyhow::anyhow!("{name}/{variant}/{seq}/{}/{path}: {e}", t.label)
                            })?;
                        // The CPU engine keeps its strict bound; everything else is judged
                        // as an implementation with its own arithmetic order.
                        let verdict = if r == 0 {
                            refcheck::strict(&e)
                        } else {
                            t.reordered.add(&e)
                        };
                        if a.dump.is_some() {
                            dump.insert(
                                format!("{name}/{variant}/{seq}/{}/{path}", t.label),
                                serde_json::json!(e.errors),
                            );
                        }
                        t.pooled.0 += e.tight();
                        t.pooled.1 += e.len();
                        t.pooled.2 = t.pooled.2.max(e.worst());
                        if let Some(d) = e.departure() {
                            t.first_departure = Some(t.first_departure.map_or(d, |f| f.min(d)));
                        }
                        line += &format!(
                            "\n  {:<26} {path:7}: {}{}",
                            t.label,
                            e.summary(),
                            match &verdict {
                                Ok(()) => String::new(),
                                Err(w) if r == 0 => format!("  FAIL ({w})"),
                                Err(w) => format!("  prefix not clean ({w})"),
                            }
                        );
                        if r == 1 && !a.cpu_only {
                            if let Err(w) = refcheck::strict(&e) {
                                line +=
                                    &format!("\n    (not met: the CPU engine's strict bound: {w})");
                            }
                        }
                        if let (0, Err(w)) = (r, verdict) {
                            t.failed.push(format!("{name}/{variant}/{seq}/{path}: {w}"));
                        }
                    }
                }
                if !a.cpu_only {
                    line += "\n  gpu vs cpu engine:";
                    for &p in &a.paths {
                        line += &format!(
                            " {} {:.2e}",
                            PATHS[p],
                            rel_err(&logits[1][p], &logits[0][p])
                        );
                    }
                }
                println!("{line} ({:.1} s)", t0.elapsed().as_secs_f64());
            }
        }
    }
    let _ = std::fs::remove_dir_all(&work);
    if let Some(p) = &a.dump {
        std::fs::write(p, serde_json::to_vec(&dump)?).with_context(|| format!("writing {p}"))?;
    }
    let mut failed = Vec::new();
    println!(
        "\nbounds: cpu engine strict (>= {:.0}% within {:e} per sequence, >= {:.0}% pooled, max {:e}, top-1 where the gap > {:e});\n        others reordered (a prefix is clean when its first {} positions are within {:e} with identical top-1; every shorter sequence-path clean, >= {:.0}% of the others clean, no NaN)",
        100.0 * refcheck::STRICT_SHARE_PER_SEQ,
        refcheck::TIGHT,
        100.0 * refcheck::STRICT_SHARE_POOLED,
        refcheck::STRICT_LOOSE,
        refcheck::TOP1_GAP,
        refcheck::PREFIX,
        refcheck::PREFIX_MAX,
        100.0 * refcheck::CLEAN_SHARE
    );
    for (r, t) in tally.iter().enumerate() {
        let (tight, n, worst) = t.pooled;
        let share = tight as f64 / n.max(1) as f64;
        let rb = &t.reordered;
        let verdict = if r == 0 {
            if share < refcheck::STRICT_SHARE_POOLED {
                failed.push(format!("cpu: pooled share {:.2}%", 100.0 * share));
                "FAIL (pooled share)".to_string()
            } else if !t.failed.is_empty() {
                failed.push(format!("cpu: {}", t.failed.join(", ")));
                format!("FAIL ({} sequence-paths)", t.failed.len())
            } else {
                "ok (strict)".into()
            }
        } else {
            let v = rb.verdict();
            match (t.control, v) {
                (None, Ok(())) => "ok (reordered)".into(),
                (None, Err(w)) => {
                    failed.push(format!("{}: {w}", t.label));
                    format!("FAIL ({w})")
                }
                // A correct control must pass; a planted bug must be caught.
                (Some(c), Ok(())) if c.is_correct() => "ok (correct control accepted)".into(),
                (Some(c), Err(w)) if c.is_correct() => {
                    failed.push(format!("{} (a correct control) rejected: {w}", t.label));
                    format!("FAIL: the bound rejects a correct control ({w})")
                }
                (Some(_), Ok(())) => {
                    failed.push(format!("{} (a planted bug) accepted", t.label));
                    "FAIL: the bound accepts a planted bug".into()
                }
                (Some(_), Err(w)) => format!("ok (bug caught: {w})"),
            }
        };
        let clean = if r == 0 {
            String::new()
        } else {
            format!(
                ", clean prefixes {}/{} short + {}/{} long",
                rb.short.0, rb.short.1, rb.long.0, rb.long.1
            )
        };
        println!(
            "{:<26} {n} position-paths, {:.2}% within {:e}, worst {worst:.2e}, earliest departure {}{clean}: {verdict}",
            t.label,
            100.0 * share,
            refcheck::TIGHT,
            t.first_departure.map_or("-".into(), |d| d.to_string()),
        );
    }
    if failed.is_empty() {
        println!("REFERENCE: ALL PASSED");
        Ok(())
    } else {
        bail!("reference check failed: {}", failed.join("; "))
    }
}

/// Official-mode logits of whole prefill, token-by-token decode and chunked prefill.
fn reference_paths(
    file: &Arc<GgufFile>,
    toks: &[u32],
    chunk: usize,
    gpu: bool,
    control: Option<Control>,
    a: &RefArgs,
) -> Result<[Vec<f32>; 3]> {
    let mut out: [Vec<f32>; 3] = Default::default();
    for (i, c) in [toks.len(), 1, chunk].into_iter().enumerate() {
        if !a.paths.contains(&i) {
            continue;
        }
        let mut be: Box<dyn ds4_engine::Backend> = if gpu {
            Box::new(cuda()?)
        } else {
            Box::new(CpuBackend::new(0)?)
        };
        be.set_activation_q8(a.act_q8)?;
        if let Some(c) = control {
            be = Box::new(Controlled::new(be, c, a.seed.wrapping_add(i as u64)));
        }
        let cfg = EngineConfig {
            mode: Some(NumericMode::Official),
            ctx: 1024,
            prefill_chunk: c,
        };
        let mut eng = Engine::load(file.clone(), be, cfg)?;
        let mut st = eng.new_state()?;
        out[i] = if i == 1 {
            let mut all = Vec::new();
            for t in toks {
                all.extend(eng.eval(&mut st, std::slice::from_ref(t), Logits::Last, None)?);
            }
            all
        } else {
            eng.eval(&mut st, toks, Logits::All, None)?
        };
    }
    Ok(out)
}

/// `batch`: batched decode rows against the same rows decoded alone, on the CPU engine and
/// (when a device answers) the CUDA engine. Passes when no greedy token differs and every
/// row is within 1e-6 of its alone twin; says whether they were bit-for-bit equal.
fn batch(a: &Args) -> Result<()> {
    let mut rng = Rng::new(a.seed);
    let mut failed = Vec::new();
    println!("batch: seed {}", a.seed);
    let gpu_ok = cuda().is_ok();
    if !gpu_ok {
        println!("no CUDA device answered: CPU engine only");
    }
    for (label, file) in models(a)? {
        for mode in modes(&file)? {
            for gpu in [false, true] {
                if (gpu && !gpu_ok) || (!gpu && a.gpu_only) {
                    continue;
                }
                let be = engine_backend(gpu, a.act_q8)?;
                let r =
                    ds4_check::batch::batch_vs_alone(&file, mode, be, a.tokens, a.seqs, &mut rng)?;
                let ok = r.passes();
                let ds4_check::batch::BatchVsAlone {
                    worst,
                    exact,
                    greedy,
                    bands_bad,
                    bands,
                } = r;
                println!(
                    "{label} · {mode} · {}: batched vs alone max rel {worst:.2e}, bit-exact {}, greedy differences {greedy}, bands {}/{bands} as defined{}",
                    if gpu { "cuda" } else { "cpu" },
                    if exact { "yes" } else { "no" },
                    bands - bands_bad,
                    if ok { "" } else { " FAIL" }
                );
                if !ok {
                    failed.push(format!(
                        "{label} {mode} {}",
                        if gpu { "cuda" } else { "cpu" }
                    ));
                }
            }
        }
    }
    verdict("BATCH", &failed)
}

/// `joint`: prompt pieces of several sequences prefilled in one pass (`Engine::eval_joint`)
/// against the same pieces prefilled alone, on the CPU engine and (when a device answers)
/// the CUDA engine: the last logits rows and two decode steps after them. Passes when no
/// greedy token differs and every row is within 1e-6 of its alone twin; says whether they
/// were bit-for-bit equal, and the time of both ways (`--tokens`: the prompts before the
/// pieces; `--chunk`: the piece length, at least the engine's minimum). The GPU engine is
/// the fast default's (expert tiles, TF32 cuBLAS; `--tiles all` moves the dense matmuls to
/// tiles too).
fn joint(a: &Args) -> Result<()> {
    let mut rng = Rng::new(a.seed);
    let mut failed = Vec::new();
    println!("joint: seed {}", a.seed);
    let gpu_ok = cuda().is_ok();
    if !gpu_ok {
        println!("no CUDA device answered: CPU engine only");
    }
    for (label, file) in models(a)? {
        for mode in modes(&file)? {
            for gpu in [false, true] {
                if (gpu && !gpu_ok) || (!gpu && a.gpu_only) {
                    continue;
                }
                let dev = if gpu { "cuda" } else { "cpu" };
                let be: Box<dyn ds4_engine::Backend> = if gpu {
                    // The fast default's GPU backend (the CLI's and the server's): expert
                    // tiles (or `--tiles all`) and cuBLAS in TF32; without tiles a GPU runs
                    // no joint prefill.
                    let tiles = match a.tiles {
                        PrefillTiles::Off => PrefillTiles::Experts,
                        t => t,
                    };
                    let mut be: Box<dyn ds4_engine::Backend> = Box::new(cuda_with(Knobs {
                        prefill_tiles: tiles,
                        cublas: Some(ds4_gpu::cuda::GemmPrecision::Tf32),
                        ..Knobs::quality()
                    })?);
                    be.set_activation_q8(a.act_q8)?;
                    be
                } else {
                    engine_backend(false, a.act_q8)?
                };
                let r = ds4_check::batch::joint_vs_alone(
                    &file,
                    mode,
                    be,
                    (a.tokens, a.chunk),
                    a.seqs,
                    &mut rng,
                )?;
                let ok = r.rows.passes();
                println!(
                    "{label} · {mode} · {dev}: joint vs alone (pieces ≥ {}) max rel {:.2e}, bit-exact {}, greedy differences {}; {} pieces alone {:.1} ms, joint {:.1} ms{}",
                    r.min_rows,
                    r.rows.worst,
                    if r.rows.exact { "yes" } else { "no" },
                    r.rows.greedy,
                    a.seqs,
                    r.alone_ms,
                    r.joint_ms,
                    if ok { "" } else { " FAIL" }
                );
                if !ok {
                    failed.push(format!("{label} {mode} {dev}"));
                }
            }
        }
    }
    verdict("JOINT", &failed)
}

/// The subcommands and their options (the module documentation says what each checks).
const USAGE: &str = "usage: ds4-engine-check ops [MODEL.gguf...] [--tiny N] [--flash-layers L] [--tokens T] [--seed S] [--chunk C] [--act-q8] [--tiles off|experts|all]
       ds4-engine-check parity [MODEL.gguf...] [--tiny N] [--tokens T] [--seed S] [--act-q8]
       ds4-engine-check batch [MODEL.gguf...] [--tiny N] [--tokens T] [--seed S] [--act-q8] [--seqs N] [--gpu-only]
       ds4-engine-check joint [MODEL.gguf...] [--tiny N] [--tokens T] [--chunk PIECE] [--seed S] [--act-q8] [--seqs N] [--gpu-only] [--tiles experts|all]
       ds4-engine-check quality [DEMO_DIR (default tests/fixtures/kjv)] [--ds4 PATH] [--backend cuda|rocm|cpu] [--chunks K]
       ds4-engine-check reference [FIXTURES_DIR (default tests/fixtures)] [--cpu-only] [--act-q8] [--control NAME|all]... [--paths prefill,decode,chunked] [--only FIXTURE]... [--seed S] [--dump ERRORS.json]";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return Ok(());
    }
    let rest = || parse(args.get(1..).unwrap_or(&[]));
    match args.first().map(String::as_str) {
        Some("ops") => ops(&rest()?),
        Some("parity") => parity(&rest()?),
        Some("batch") => batch(&rest()?),
        Some("joint") => joint(&rest()?),
        Some("quality") => quality(args.get(1..).unwrap_or(&[])),
        Some("reference") => reference(&parse_reference(args.get(1..).unwrap_or(&[]))?),
        _ => bail!("{USAGE}"),
    }
}

/// `ds4-engine-check quality`: see the module documentation and [`ds4_check::quality`].
fn quality(args: &[String]) -> Result<()> {
    use ds4_check::quality::{Measured, FILES, PATHS, TABLE_HEADER};
    use std::process::Command;

    let mut dir = std::path::PathBuf::from("tests/fixtures/kjv");
    let mut ds4 = std::env::current_exe()
        .context("locating this binary")?
        .with_file_name("ds4");
    let mut backend = "cuda".to_string();
    let mut chunks: Option<String> = None;
    let mut i = 0;
    while i < args.len() {
        let v = |i: usize| -> Result<&String> {
            args.get(i + 1)
                .with_context(|| format!("{} needs a value", args[i]))
        };
        match args[i].as_str() {
            "--ds4" => ds4 = v(i)?.into(),
            "--backend" => backend = v(i)?.clone(),
            "--chunks" => {
                let k: usize = v(i)?.parse().context("--chunks")?;
                chunks = Some(k.to_string());
            }
            s if s.starts_with("--") => bail!("unknown option {s}"),
            s => {
                dir = s.into();
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    if !ds4.is_file() {
        bail!(
            "{} is not a file: build `ds4` beside this binary or name it with --ds4",
            ds4.display()
        );
    }
    let text = dir.join("heldout.txt");
    if !text.is_file() {
        bail!(
            "{} not found: DEMO_DIR must hold the demo model's heldout.txt",
            text.display()
        );
    }
    let scratch = std::env::temp_dir().join(format!("ds4-quality-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).with_context(|| format!("creating {}", scratch.display()))?;
    let run = |model: &std::path::Path,
               extra: &[&str],
               env: &[(&str, &str)]|
     -> Result<serde_json::Value> {
        let mut c = Command::new(&ds4);
        c.arg("perplexity")
            .arg("-m")
            .arg(model)
            .arg("-f")
            .arg(&text);
        c.args(["--ctx", "256", "--mode", "exact", "-q", "--json"]);
        c.args(extra);
        for (k, v) in env {
            c.env(k, v);
        }
        let o = c
            .output()
            .with_context(|| format!("running {}", ds4.display()))?;
        if !o.status.success() {
            bail!(
                "ds4 perplexity {} {}: {}",
                model.display(),
                extra.join(" "),
                String::from_utf8_lossy(&o.stderr).trim()
            );
        }
        serde_json::from_slice(&o.stdout).context("reading ds4 perplexity --json")
    };
    println!(
        "quality: {} against the CPU engine (exact mode, --quality), {}",
        backend,
        dir.display()
    );
    println!("{TABLE_HEADER}");
    let mut failed = Vec::new();
    let result = (|| -> Result<()> {
        for f in FILES {
            let model = dir.join(f);
            let base = scratch.join("base.logp");
            let base_s = base.to_str().context("temporary path is not UTF-8")?;
            let mut extra = vec!["--backend", "cpu", "--quality", "--save-logits", base_s];
            if let Some(k) = &chunks {
                extra.extend(["--chunks", k.as_str()]);
            }
            let cpu = run(&model, &extra, &[])?;
            println!(
                "| {f} | CPU base | {:.4} | | | | | | {:.0} | |",
                cpu["ppl"].as_f64().unwrap_or(f64::NAN),
                cpu["tokens_per_second"].as_f64().unwrap_or(f64::NAN)
            );
            for p in PATHS {
                let mut extra = vec!["--backend", backend.as_str(), "--kl-base", base_s];
                extra.extend_from_slice(p.args);
                let r = run(&model, &extra, p.env)?;
                let m = Measured::from_report(&r)
                    .map_err(|e| anyhow::anyhow!("{f} {}: {e}", p.name))?;
                let verdict = match m.judge(p) {
                    Ok(()) => "ok".to_string(),
                    Err(w) => {
                        failed.push(format!("{f} {}: {w}", p.name));
                        format!("FAIL ({w})")
                    }
                };
                println!("{}", m.row(f, p, &verdict));
            }
            std::fs::remove_file(&base).ok();
        }
        Ok(())
    })();
    std::fs::remove_dir_all(&scratch).ok();
    result?;
    for p in PATHS {
        println!(
            "* {}: {} (bounds: mean KLD ≤ {:.0e}, same top ≥ {:.1} %)",
            p.name,
            p.what,
            p.max_kld,
            100.0 * p.min_same_top
        );
    }
    if failed.is_empty() {
        println!(
            "quality: PASSED ({} files × {} paths)",
            FILES.len(),
            PATHS.len()
        );
        Ok(())
    } else {
        bail!("quality: FAILED: {}", failed.join("; "))
    }
}
