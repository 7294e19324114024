//! ds4-bench: prefill and decode speed at context frontiers, as CSV.
//!
//! `ds4-bench --synthetic q2` builds the full-size synthetic model (real shapes and types,
//! random valid blocks) straight into the memory the placement plan chose — no file of
//! 80 GiB is needed — and measures, for each frontier (default 2048, 8192, 32768): the
//! prefill speed of the interval since the previous frontier, the decode speed of
//! `--decode` tokens there, the KV bytes held, and decode as a fraction of the bandwidth
//! limit (measured device copy bandwidth ÷ weight bytes read per token).
//!
//! `ds4-bench --e2e -m FILE` measures what a user of `ds4 -p` gets instead: the CLI's own
//! load (placement plan, backend choice, fast-default precision), prompt rendering, the
//! `Session` prefill/generate path with the CLI's default sampler, detokenisation and the
//! streaming writer (into a sink), on any backend (the CPU too). It prints the load time,
//! prefill t/s and generation t/s as one CSV row.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use ds4_convert::SyntheticModel;
use ds4_engine::{Engine, EngineConfig, ExpertPlacement, Logits, NumericMode, Rng, StreamStats};
use ds4_gguf::GgufFile;
use ds4_gpu::backend::{CudaBackend, CudaOptions, WeightSource};
use ds4_gpu::cuda::CudaDevice;
use ds4_model::accounting::ByteAccounting;
use ds4_model::layout::TypeRecipe;
use ds4_model::{ModelSpec, Strictness};
use ds4_placement::{MemKind, WeightSet};

#[derive(Parser)]
#[command(
    name = "ds4-bench",
    version,
    about = "ds4-rs prefill/decode benchmark (CSV)"
)]
struct Args {
    /// A model GGUF (or use --synthetic).
    #[arg(short, long, conflicts_with = "synthetic")]
    model: Option<std::path::PathBuf>,
    /// Full-size synthetic model generated in memory: q2, q4 or mxfp4.
    #[arg(long)]
    synthetic: Option<String>,
    /// Layers of the synthetic model (43 = the real model).
    #[arg(long, default_value_t = 43)]
    layers: usize,
    /// --synthetic: skew its router Zipf-like by S (as `ds4-convert synthetic
    /// --router-skew`: each layer favours its own few experts; 0 = every expert equally
    /// likely). --batch reports the expert use it gave (max/mean load, top-10 % share) beside
    /// the bound, so a skew can be matched to a real router's statistics (docs/server.md §12).
    #[arg(long, default_value_t = 0.0)]
    router_skew: f32,
    /// Context frontiers, comma separated.
    #[arg(long, default_value = "2048,8192,32768", value_delimiter = ',')]
    frontiers: Vec<usize>,
    /// Decode tokens measured at each frontier.
    #[arg(long, default_value_t = 32)]
    decode: usize,
    /// Prefill chunk.
    #[arg(long, default_value_t = ds4_engine::DEFAULT_PREFILL_CHUNK)]
    prefill_chunk: usize,
    /// Numeric mode (default: the model's default).
    #[arg(long)]
    mode: Option<String>,
    #[command(flatten)]
    placement: ds4_cli::load::PlacementFlags,
    /// Write the CSV here too.
    #[arg(long)]
    csv: Option<std::path::PathBuf>,
    /// Seed of the synthetic weights and the random prompt.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Prefill GEMM: f32 (cuBLAS, no TF32), tf32 (cuBLAS tensor cores) or builtin (the
    /// backend's own tiled f32 kernel). Default: what `ds4` runs with the same --quality
    /// and variables (tf32; f32 with --quality).
    #[arg(long)]
    gemm: Option<String>,
    /// Multi-token matmuls on quantized tensor-core tiles: off (panels + the --gemm GEMM,
    /// what `ds4 --quality` runs), experts (routed experts on tiles: what `ds4` runs by
    /// default) or all. Default: what `ds4` runs (DS4_PREFILL_TILES, --quality).
    #[arg(long)]
    tiles: Option<String>,
    /// One-token matmul activations: q8 (int8 blocks and integer dot products, what `ds4`
    /// runs by default) or f32 (as `ds4 --quality`). Default: what `ds4` runs.
    #[arg(long)]
    act: Option<String>,
    /// After each frontier's decode, decode this many more tokens with device-time
    /// attribution on (events before every launch, resolved per token) and print where the
    /// time goes by section and kernel. 0: off.
    #[arg(long, default_value_t = 0)]
    profile: usize,
    /// After each frontier's decode, record one decode step as a CUDA graph and replay it
    /// this many times: the device time per replayed step beside the decode's (what one
    /// graph per step would save, docs/gpu.md §18). The replays rewrite one position, so
    /// the state afterwards is only good for timing. 0: off.
    #[arg(long, default_value_t = 0)]
    graph_probe: usize,
    /// After each frontier's decode, serialise the state (what `ds4-server` does to every
    /// prompt before its first token, to reuse it later) into a fresh buffer and into that
    /// one's again, then restore it, printing the size and the three times.
    #[arg(long)]
    snapshot: bool,
    /// Before anything is timed, prefill this many tokens once (then empty the state), so
    /// the timed prefills do not carry the process's first-use costs (kernels loaded on
    /// first launch, cuBLAS's first calls), which made a process's first prefill several
    /// times slower than the next (BENCHMARKS.md). Default: the first frontier's size, at most one
    /// prefill chunk (0 with streamed experts, whose cache it would fill); 0: off (`--e2e`
    /// always measures the user's cold first prompt).
    #[arg(long)]
    warmup: Option<usize>,
    /// After the frontiers: batched decode (one forward pass for several sequences) at
    /// each of these batch sizes, comma separated (e.g. 1,2,4,8): every sequence gets a
    /// --batch-prompt-token prompt, then --decode steps; prints aggregate tok/s and the
    /// step latency, then counts the distinct (layer, expert) units the batch's tokens route
    /// to over --decode more steps and prints the step's bandwidth bound (dense weights once
    /// + those experts, over the measured copy bandwidth) and the fraction of it reached.
    #[arg(long, value_delimiter = ',')]
    batch: Vec<usize>,
    /// After each frontier's decode, time speculative verify steps of 1 to this many rows
    /// (the token and up to K−1 drafts, every draft rejected) against the decode step, and
    /// print the predicted speed-up at acceptance rates 0.5–0.9 (docs/speculative.md §7).
    /// 0: off.
    #[arg(long, default_value_t = 0)]
    verify: usize,
    /// Verify steps timed per row count for --verify.
    #[arg(long, default_value_t = 8)]
    verify_reps: usize,
    /// Prompt tokens per sequence for --batch.
    #[arg(long, default_value_t = 256)]
    batch_prompt: usize,
    /// Before the frontiers, prefill this many tokens in a fresh state with device-time
    /// attribution on and print where the time goes. 0: off.
    #[arg(long, default_value_t = 0)]
    profile_prefill: usize,
    /// Also print the last logits' checksum (to compare placements: equal weights and
    /// tokens must give equal logits whatever memory holds the weights).
    #[arg(long)]
    checksum: bool,
    /// End-to-end: the CLI's load and one-shot generation path (needs -m; a full-size
    /// synthetic file comes from `ds4-convert synthetic --sparse-experts`).
    #[arg(long)]
    e2e: bool,
    /// --e2e: backend (auto, cpu, cuda, rocm), as `ds4 --backend`.
    #[arg(long, value_enum, default_value_t = ds4_cli::load::BackendChoice::Auto)]
    backend: ds4_cli::load::BackendChoice,
    /// --e2e: context size in tokens (as `ds4 -c`).
    #[arg(short, long, default_value_t = 8192)]
    ctx: usize,
    /// --e2e: tokens to generate (EOS is masked so every run generates exactly this many).
    #[arg(short = 'n', long, default_value_t = 200)]
    tokens: usize,
    /// --e2e: prompt text file (default: a generated text of --prompt-words words).
    #[arg(long)]
    prompt_file: Option<std::path::PathBuf>,
    /// --e2e: words of the generated prompt.
    #[arg(long, default_value_t = 1500)]
    prompt_words: usize,
    /// --e2e: sampling temperature (default: the CLI's; 0 = greedy, which the bench's own
    /// decode is). A synthetic model's flat logits overflow the default sampler's device
    /// band every token, so its sampled rate is not the one a trained model's would be
    /// (BENCHMARKS.md); --temp 0 compares the CLI's loop with the bench's.
    #[arg(long)]
    temp: Option<f32>,
    /// --e2e: skip the CLI's warm-up at load (`ds4 --no-warmup`; also DS4_WARMUP=0).
    #[arg(long)]
    no_warmup: bool,
    /// The kernels of `ds4 --quality` (f32 activations, f32 GEMM and panels, f32
    /// attention; also DS4_QUALITY=1) instead of the fast default.
    #[arg(long)]
    quality: bool,
    /// --e2e: CPU threads (0 = one per core; as `ds4 -t`).
    #[arg(short, long, default_value_t = 0)]
    threads: usize,
    /// --e2e: speculative decoding as `ds4 --draft` (off, lookup, auto; also DS4_DRAFT);
    /// the CSV then says what it drafted and accepted (docs/speculative.md).
    #[arg(long, value_parser = |s: &str| s.parse::<ds4_runtime::DraftMode>())]
    draft: Option<ds4_runtime::DraftMode>,
    /// --e2e: most drafted tokens per step, as `ds4 --draft-max`.
    #[arg(long)]
    draft_max: Option<usize>,
    /// --e2e: the lookup drafter's longest n-gram, as `ds4 --draft-ngram`.
    #[arg(long)]
    draft_ngram: Option<usize>,
}

/// The settings `ds4` would run with the same --quality, --no-warmup and variables.
fn run_config(args: &Args) -> Result<ds4_runtime::config::Config> {
    ds4_runtime::config::Config::resolve(
        ds4_runtime::config::ConfigFlags {
            quality: args.quality,
            no_warmup: args.no_warmup,
            draft: args.draft,
            draft_max: args.draft_max,
            draft_ngram: args.draft_ngram,
        },
        |k| std::env::var(k).ok(),
    )
    .context("invalid setting")
}

/// `--e2e`: the CLI's own path, timed.
fn e2e(args: &Args) -> Result<()> {
    use ds4_cli::generate::{default_sampler, one_shot, GenSettings};
    use ds4_cli::load::{LoadOptions, ModeChoice};
    let Some(model) = &args.model else {
        bail!("--e2e needs -m FILE (a full-size synthetic file: ds4-convert synthetic --sparse-experts)");
    };
    let mode = match args.mode.as_deref() {
        None => None,
        Some("exact") => Some(ModeChoice::Exact),
        Some("official") => Some(ModeChoice::Official),
        Some(o) => bail!("--mode {o:?}: use exact or official"),
    };
    if args.tokens == 0 || args.ctx == 0 {
        bail!("--tokens and --ctx must be at least 1");
    }
    let prompt = match &args.prompt_file {
        Some(f) => std::fs::read_to_string(f)
            .with_context(|| format!("cannot read the prompt file {}", f.display()))?,
        None => {
            const WORDS: [&str; 12] = [
                "the",
                "model",
                "reads",
                "a",
                "long",
                "prompt",
                "about",
                "rivers",
                "and",
                "mountains",
                "before",
                "answering",
            ];
            (0..args.prompt_words)
                .map(|i| WORDS[i % WORDS.len()])
                .collect::<Vec<_>>()
                .join(" ")
        }
    };
    let config = run_config(args)?;
    let draft = config.draft_config();
    let precision = config.precision.value;
    let opts = LoadOptions {
        model: model.clone(),
        backend: args.backend,
        mode,
        ctx: args.ctx,
        kv_states: 1,
        prefill_chunk: args.prefill_chunk.max(1),
        threads: args.threads,
        placement: args.placement.to_overrides(),
        report: ds4_runtime::load::LoadReport::Quiet,
        config,
    };
    let t0 = Instant::now();
    let loaded = ds4_cli::load::load(&opts, &mut std::io::stderr())?;
    let load_s = t0.elapsed().as_secs_f64();
    let settings = GenSettings {
        system: Some(ds4_chat::render::DEFAULT_SYSTEM.to_string()),
        thinking: ds4_chat::render::ThinkingMode::Think,
        sampler: {
            let mut c = default_sampler(args.seed);
            if let Some(t) = args.temp {
                c.temperature = t;
            }
            c
        },
        max_tokens: args.tokens,
        ignore_eos: true,
        color: false,
        terminal: false,
        progress: false,
        draft,
    };
    let intr = ds4_cli::signals::Interrupts::default();
    let stats = one_shot(
        loaded,
        &prompt,
        &settings,
        &intr,
        &mut std::io::sink(),
        &mut std::io::stderr(),
    )?;
    let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    let d = stats.draft;
    let csv = format!(
        "bench,precision,load_s,prompt_tokens,prefill_s,prefill_tok_s,generated,gen_s,gen_tok_s,\
         draft,drafted,accepted,verify_steps,tokens_per_step\n\
         e2e,{},{load_s:.3},{},{:.3},{:.1},{},{:.3},{:.2},{},{},{},{},{:.3}\n",
        precision.label(),
        stats.prefilled,
        stats.prefill_secs,
        rate(stats.prefilled, stats.prefill_secs),
        stats.generated,
        stats.gen_secs,
        rate(stats.generated, stats.gen_secs),
        draft.mode,
        d.drafted,
        d.accepted,
        d.steps,
        d.tokens_per_step(),
    );
    print!("{csv}");
    if let Some(p) = &args.csv {
        std::fs::File::create(p)?.write_all(csv.as_bytes())?;
    }
    Ok(())
}

struct Synth(SyntheticModel);

impl WeightSource for Synth {
    fn fill(&self, name: &str, out: &mut [u8]) -> Result<(), String> {
        let i = self
            .0
            .tensor_index(name)
            .ok_or_else(|| format!("no synthetic tensor {name}"))?;
        self.0.fill_tensor(i, out).map_err(|e| e.to_string())
    }

    /// Rows: so the loader fills staging-buffer-sized pieces, not whole tensors on the heap.
    fn granule(&self, name: &str) -> Option<usize> {
        let i = self.0.tensor_index(name)?;
        let (_, row_bytes) = self.0.rows(i).ok()?;
        usize::try_from(row_bytes).ok().filter(|&b| b > 0)
    }

    fn fill_range(&self, name: &str, start: usize, out: &mut [u8]) -> Result<(), String> {
        let i = self
            .0
            .tensor_index(name)
            .ok_or_else(|| format!("no synthetic tensor {name}"))?;
        let (_, row_bytes) = self.0.rows(i).map_err(|e| e.to_string())?;
        let rb = row_bytes as usize;
        if rb == 0 || !start.is_multiple_of(rb) {
            return Err(format!(
                "{name}: piece at byte {start} is not on a {rb}-byte row"
            ));
        }
        self.0
            .fill_rows(i, (start / rb) as u64, out)
            .map_err(|e| e.to_string())
    }
}

/// Device-to-device copy bandwidth (read + write bytes per second), timed with events.
fn copy_bandwidth(dev: &CudaDevice) -> Result<f64> {
    let bytes = 2usize << 30;
    let src = dev.alloc(MemKind::Device, bytes)?;
    let mut dst = dev.alloc(MemKind::Device, bytes)?;
    dst.copy_from(0, &src, 0, bytes)?;
    let (a, b) = (dev.event()?, dev.event()?);
    let reps = 5;
    a.record()?;
    for _ in 0..reps {
        dst.copy_from(0, &src, 0, bytes)?;
    }
    b.record()?;
    let ms = a.elapsed_ms(&b)? as f64;
    Ok(2.0 * (bytes * reps) as f64 / (ms / 1e3))
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    ds4_cli::logging::init(0);
    let run = if args.e2e {
        e2e(&args)
    } else {
        frontiers(&args)
    };
    match run {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", ds4_runtime::error_chain(e.as_ref()));
            std::process::ExitCode::FAILURE
        }
    }
}

/// The frontier benchmark (the default mode): CUDA only, since it times device kernels
/// with device events.
fn frontiers(args: &Args) -> Result<()> {
    let mut frontiers = args.frontiers.clone();
    frontiers.sort_unstable();
    frontiers.dedup();
    if frontiers.is_empty() || frontiers[0] == 0 {
        bail!("--frontiers needs positive token counts");
    }
    // Room for each frontier's decode and, with --verify, its verify steps (each advances
    // the state by one token; the last needs its rows free).
    let verify_room = args.verify * (args.verify_reps + 1) + args.verify;
    let ctx = frontiers.last().copied().unwrap_or(2048)
        + (args.decode + verify_room) * frontiers.len()
        + 16;

    let t_gen = Instant::now();
    let (file, source, label): (Arc<GgufFile>, Option<Arc<dyn WeightSource>>, String) =
        match (&args.model, &args.synthetic) {
            (Some(_), None) if args.router_skew != 0.0 => bail!(
                "--router-skew applies to --synthetic; a file's router is its own \
                 (ds4-convert synthetic --router-skew S writes a skewed one)"
            ),
            (Some(p), None) => (
                Arc::new(GgufFile::open(p).with_context(|| format!("opening {}", p.display()))?),
                None,
                p.display().to_string(),
            ),
            (None, Some(r)) => {
                let recipe = match TypeRecipe::from_name(r) {
                    Some(rc) if r != "f32" => rc,
                    _ => bail!("--synthetic {r:?}: use q2, q4 or mxfp4"),
                };
                let m = SyntheticModel::new(recipe, args.layers, args.seed)?
                    .with_router_skew(args.router_skew)?;
                let file = Arc::new(GgufFile::header_only(m.header().clone())?);
                (
                    file,
                    Some(Arc::new(Synth(m)) as Arc<dyn WeightSource>),
                    format!("synthetic {r} ({} layers)", args.layers),
                )
            }
            _ => bail!("give -m MODEL or --synthetic q2|q4|mxfp4"),
        };
    let header = file.header().clone();
    let spec = ModelSpec::from_header(&header, Strictness::Auto)?;
    let acct = ByteAccounting::of(&spec);

    // Plan for this device.
    let dev = CudaDevice::open(0).context(
        "the frontier benchmark needs a CUDA GPU and could not open CUDA device 0; \
         on a machine without one, `ds4-bench --e2e -m MODEL --backend cpu` measures the \
         CPU engine the way `ds4 -p` runs it",
    )?;
    let facts = dev.placement_facts()?;
    let bw = copy_bandwidth(&dev)?;
    drop(dev);
    let host = ds4_placement::probe::host_facts()?;
    let inventory = ds4_cli::plan::inventory_of(&header.tensors, WeightSet::Main);
    let plan_args = ds4_cli::plan::PlanArgs {
        source: ds4_cli::plan::Source::File(std::path::PathBuf::from(&label)),
        mtp: None,
        ctx: ctx as u64,
        kv_states: 1,
        prefill_chunk: args.prefill_chunk as u64,
        machine: None,
        device: Some((facts.clone(), "CUDA device 0".into())),
        overrides: args.placement.to_overrides(),
    };
    let plan = match ds4_cli::plan::plan_inventory(
        &spec.hparams,
        &inventory,
        &host,
        &facts,
        &plan_args,
        |k| std::env::var(k).ok(),
    )? {
        Ok(p) => p,
        Err(refusal) => bail!("placement refused: {refusal}"),
    };
    eprintln!("{}", plan.render_text());

    let config = run_config(args)?;
    let mut knobs = config.knobs();
    if let Some(g) = &args.gemm {
        knobs.cublas = match g.as_str() {
            "f32" => Some(ds4_gpu::cuda::GemmPrecision::F32),
            "tf32" => Some(ds4_gpu::cuda::GemmPrecision::Tf32),
            "builtin" => None,
            o => bail!("--gemm {o:?}: use f32, tf32 or builtin"),
        };
    }
    if let Some(a) = &args.act {
        knobs.activation_q8 = match a.as_str() {
            "q8" => true,
            "f32" => false,
            o => bail!("--act {o:?}: use q8 or f32"),
        };
    }
    if let Some(t) = &args.tiles {
        knobs.prefill_tiles = ds4_gpu::backend::PrefillTiles::parse(t)
            .with_context(|| format!("--tiles {t:?}: use off, experts or all"))?;
    }
    let be = CudaBackend::new(CudaOptions {
        plan: Some(plan.clone()),
        source,
        knobs,
        ..CudaOptions::default()
    })?;
    eprintln!("prefill tiles: {}", knobs.prefill_tiles.name());
    eprintln!(
        "one-token activations: {}",
        if knobs.activation_q8 { "q8" } else { "f32" }
    );
    eprintln!(
        "prefill attention and indexer scores: {}",
        if knobs.tensor_core_attention {
            "tensor cores"
        } else {
            "f32 kernels"
        }
    );
    eprintln!(
        "prefill GEMM: {}",
        match (be.cublas_path(), knobs.cublas) {
            (Some(p), Some(g)) => format!("cuBLAS {g:?} ({})", p.display()),
            _ => "built-in tiled f32 kernel".into(),
        }
    );
    if let Some(actual) = be.actual_placement() {
        eprintln!("{}", actual.render_text(&plan));
    }
    let mode = match args.mode.as_deref() {
        None => None,
        Some("exact") => Some(NumericMode::Exact),
        Some("official") => Some(NumericMode::Official),
        Some(o) => bail!("--mode {o:?}: use exact or official"),
    };
    let cfg = EngineConfig {
        mode,
        ctx,
        prefill_chunk: args.prefill_chunk,
    };
    let t_load = Instant::now();
    let experts = ds4_cli::load::expert_placement(&plan, config.expert_readahead.value);
    if experts != ExpertPlacement::Resident && args.model.is_none() {
        bail!("streamed experts are read from a file: use -m FILE (ds4-convert synthetic --sparse-experts makes a full-size one)");
    }
    let mut eng = Engine::load_with(file.clone(), Box::new(be), cfg, experts)?;
    let load_s = t_load.elapsed().as_secs_f64();
    eprintln!(
        "loaded {label} in {load_s:.1} s ({:.1} s since start) · backend {} · mode {}",
        t_gen.elapsed().as_secs_f64(),
        eng.backend_name(),
        eng.mode()
    );
    let per_token = acct.per_token_short as f64;
    let limit = bw / per_token;
    eprintln!(
        "device copy bandwidth {:.0} GB/s · weights read per token {:.2} GB (short ctx) → \
         bandwidth limit {:.0} tok/s",
        bw / 1e9,
        per_token / 1e9,
        limit
    );

    let hp = eng.hparams().clone();
    let mut rng = Rng::new(args.seed ^ 0x5eed);
    let mut st = eng.new_state()?;
    let first = frontiers[0];
    // Not by default with streamed experts: a warm-up would fill the expert cache, and
    // the first frontier's hit rate is part of what that bench reports.
    let default_warmup = if eng.expert_stats().is_some() {
        0
    } else {
        first.min(args.prefill_chunk.max(1))
    };
    let warmup = args.warmup.unwrap_or(default_warmup).min(eng.config().ctx);
    if warmup > 0 {
        let mut wrng = Rng::new(args.seed ^ 0x3a3a);
        let toks: Vec<u32> = (0..warmup)
            .map(|_| (wrng.next_f64() * hp.n_vocab as f64) as u32 % hp.n_vocab as u32)
            .collect();
        let t = Instant::now();
        eng.eval(&mut st, &toks, Logits::Last, None)?;
        eng.reset_state(&mut st)?;
        eprintln!(
            "warm-up prefill of {warmup} tokens (not counted): {:.3} s",
            t.elapsed().as_secs_f64()
        );
    }
    let mut csv = String::from(
        "frontier,prefill_tokens,prefill_s,prefill_tok_s,decode_tokens,decode_s,decode_tok_s,\
         kv_bytes,decode_limit_tok_s,decode_fraction_of_limit\n",
    );
    let mut last = Vec::new();
    let mut stream_csv = String::from(
        "frontier,phase,tokens,tok_s,lookups,hit_rate,misses_per_token,host_hits,reads_per_token,\
         readahead_reads,readahead_used,prediction_accuracy,bytes_read,read_gb_s,wait_s,\
         slot_write_s,moe_runs,host_buffers,host_pinned\n",
    );
    if args.profile_prefill > 0 {
        profile_prefill(&mut eng, args.profile_prefill, args.seed)?;
    }
    for &f in &frontiers {
        let pos = st.pos();
        if f <= pos {
            continue;
        }
        let n = f - pos;
        let toks: Vec<u32> = (0..n)
            .map(|_| (rng.next_f64() * hp.n_vocab as f64) as u32 % hp.n_vocab as u32)
            .collect();
        eng.reset_expert_stats();
        let t0 = Instant::now();
        let mut logits = eng.eval(&mut st, &toks, Logits::Last, None)?;
        let pf = t0.elapsed().as_secs_f64();
        if let Some(s) = eng.expert_stats() {
            stream_csv += &stream_line(f, "prefill", n, pf, &s);
        }
        eng.reset_expert_stats();
        let mut next = ds4_engine::argmax(&logits) as u32;
        let c0 = eng.backend_mut().counters();
        let t1 = Instant::now();
        for _ in 0..args.decode {
            next = eng.eval_argmax(&mut st, &[next])?;
        }
        let dc = t1.elapsed().as_secs_f64();
        if let Some(s) = eng.expert_stats() {
            eprintln!("{}", ds4_cli::chat::expert_line(&s));
            stream_csv += &stream_line(f, "decode", args.decode, dc, &s);
        }
        let c1 = eng.backend_mut().counters();
        let per = args.decode.max(1) as f64;
        eprintln!(
            "decode @{f}: {:.1} launches, {:.1} host syncs per token, {:.3} ms of {:.3} per \
             token waiting for the device",
            (c1.launches - c0.launches) as f64 / per,
            (c1.syncs - c0.syncs) as f64 / per,
            (c1.wait_ns - c0.wait_ns) as f64 * 1e-6 / per,
            1e3 * dc / per
        );
        if args.profile > 0 {
            profile_decode(&mut eng, &mut st, &mut next, args.profile, f)?;
        }
        if args.verify > 0 {
            let pts = ds4_cli::verify_curve::measure(
                &mut eng,
                &mut st,
                next,
                args.verify,
                args.verify_reps,
                || (rng.next_f64() * hp.n_vocab as f64) as u32 % hp.n_vocab as u32,
            )?;
            let step_ms = 1e3 * dc / args.decode.max(1) as f64;
            eprint!("{}", ds4_cli::verify_curve::report(f, step_ms, &pts));
        }
        if args.graph_probe > 0 {
            // A failed probe is reported, not fatal: the frontiers go on.
            match eng.probe_graph(&mut st, next, args.graph_probe) {
                Ok(Some(g)) => eprintln!(
                    "graph probe @{f}: {} nodes, instantiated in {:.1} ms; {:.3} ms per \
                     replayed step ({:.2} tok/s) against {:.3} ms per decoded token",
                    g.nodes,
                    g.instantiate_ms,
                    g.replay_ms,
                    1e3 / g.replay_ms.max(1e-9),
                    1e3 * dc / args.decode.max(1) as f64
                ),
                Ok(None) => eprintln!("graph probe: this backend records no graphs"),
                Err(e) => eprintln!("graph probe @{f} failed: {e}"),
            }
        }
        if args.snapshot {
            // Into a fresh buffer, then into that one's (the server's steady state).
            let t = Instant::now();
            let snap = eng.snapshot(&st)?;
            let fresh = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let snap = eng.snapshot_into(&st, snap.into_bytes())?;
            let reused = t.elapsed().as_secs_f64();
            let t = Instant::now();
            eng.restore(&mut st, &snap)?;
            eprintln!(
                "snapshot @{}: {:.1} MB taken in {:.1} ms ({:.1} ms into a reused buffer), \
                 restored in {:.1} ms",
                st.pos(),
                snap.as_bytes().len() as f64 * 1e-6,
                1e3 * fresh,
                1e3 * reused,
                1e3 * t.elapsed().as_secs_f64()
            );
        }
        logits = eng.eval(&mut st, &[next], Logits::Last, None)?;
        let kv = ds4_model::kv::kv_fixed_bytes(&hp)
            + ds4_model::kv::kv_growth_per_token(&hp) * st.pos() as u64;
        let dtps = args.decode as f64 / dc;
        let line = format!(
            "{f},{n},{pf:.3},{:.1},{},{dc:.3},{dtps:.2},{kv},{limit:.1},{:.4}\n",
            n as f64 / pf,
            args.decode,
            dtps / limit
        );
        eprint!("{line}");
        csv += &line;
        last = logits;
    }
    let mut batch_csv = String::from(BATCH_CSV_HEADER);
    for &b in &args.batch {
        batch_csv += &batch_decode(
            &mut eng,
            b,
            args.batch_prompt,
            args.decode.max(1),
            &mut rng,
            (&acct, bw, limit),
            args.profile,
        )?;
    }
    print!("{csv}");
    if !args.batch.is_empty() {
        println!("# batched decode, router skew {}", args.router_skew);
        print!("{batch_csv}");
    }
    if let Some(s) = eng.expert_stats() {
        println!(
            "# streamed experts: {} slots of {:.2} MiB ({:.2} GiB cache)",
            s.slots,
            s.slot_bytes as f64 / (1u64 << 20) as f64,
            (s.slot_bytes * s.slots as u64) as f64 / (1u64 << 30) as f64
        );
        print!("{stream_csv}");
    }
    if args.checksum {
        let sum: f64 = last.iter().map(|&v| v as f64).sum();
        let am = ds4_engine::argmax(&last);
        println!(
            "checksum: sum {sum:.6e} argmax {am} first {:?}",
            &last[..4.min(last.len())]
        );
    }
    if let Some(p) = &args.csv {
        std::fs::File::create(p)?.write_all(csv.as_bytes())?;
    }
    Ok(())
}

/// Decodes `n` tokens with device-time attribution on and prints it: per section (layer
/// kind) and per kernel, in microseconds per token, with the device's total against the
/// host's wall time (they agree when the GPU never waits for the host).
fn profile_decode(
    eng: &mut Engine,
    st: &mut ds4_engine::KvState,
    next: &mut u32,
    n: usize,
    frontier: usize,
) -> Result<()> {
    if !eng.backend_mut().set_profiling(true)? {
        eprintln!("profile: this backend has no device-time attribution");
        return Ok(());
    }
    let (rows, device, wall) = profiled_passes(eng, n, |eng| {
        *next = eng.eval_argmax(st, &[*next])?;
        Ok(())
    })?;
    let per = n as f64;
    eprintln!(
        "profile @{frontier} ({n} tokens): device {:.3} ms/token, host wall {:.3} ms/token \
         (device/wall {:.1} %)",
        device / per,
        wall / per,
        100.0 * device / wall.max(1e-9)
    );
    print_profile(&rows, per, device, "token");
    Ok(())
}

/// Columns of the batched-decode CSV, one row per batch size ([`batch_decode`]).
const BATCH_CSV_HEADER: &str = "batch,steps,step_ms,agg_tok_s,distinct_units_per_layer,\
uniform_units_per_layer,step_bytes,bound_tok_s,fraction_of_bound,max_over_mean_load,\
top10_share\n";

/// A batch size's bandwidth bound (issue 51): what its measured routing implies.
#[derive(Debug, Clone, PartialEq)]
struct BatchBound {
    /// Distinct (layer, expert) units per layer and step, averaged over the layers.
    distinct: f64,
    /// The same for a router spreading tokens evenly ([`ByteAccounting::uniform_distinct`]).
    uniform: f64,
    /// Weight bytes a step must read: the dense weights once, an embedding row per
    /// sequence, each distinct expert once ([`ByteAccounting::step_bytes`]).
    step_bytes: f64,
    /// Aggregate tok/s at the measured copy bandwidth if the step read nothing else.
    bound_tok_s: f64,
    /// The measured aggregate over the bound.
    fraction: f64,
}

/// The bound of `batch` sequences whose steps routed as `census` counted, at `bandwidth`
/// bytes/s, against a measured `tok_s`.
fn batch_bound(
    acct: &ByteAccounting,
    census: &ds4_engine::RouteCensus,
    batch: usize,
    bandwidth: f64,
    tok_s: f64,
) -> BatchBound {
    let per_layer = census.mean_distinct();
    let distinct = if per_layer.is_empty() {
        0.0
    } else {
        per_layer.iter().sum::<f64>() / per_layer.len() as f64
    };
    let step_bytes = acct.step_bytes(&per_layer, batch);
    let bound_tok_s = ByteAccounting::bound_tok_s(step_bytes, bandwidth, batch);
    BatchBound {
        distinct,
        uniform: acct.uniform_distinct(batch),
        step_bytes,
        bound_tok_s,
        fraction: if bound_tok_s > 0.0 {
            tok_s / bound_tok_s
        } else {
            0.0
        },
    }
}

/// `b` sequences with `prompt`-token random prompts, then `steps` batched greedy decode
/// steps; prints aggregate and per-sequence speed (the engine-level measurement, without
/// the server), then the step's bandwidth bound from `steps` more steps with the routing
/// census on. Returns the batch CSV row ([`BATCH_CSV_HEADER`]).
fn batch_decode(
    eng: &mut Engine,
    b: usize,
    prompt: usize,
    steps: usize,
    rng: &mut Rng,
    (acct, bw, limit): (&ByteAccounting, f64, f64),
    profile: usize,
) -> Result<String> {
    if b == 0 {
        bail!("--batch sizes must be at least 1");
    }
    let vocab = eng.hparams().n_vocab;
    let mut states = Vec::with_capacity(b);
    let mut next = Vec::with_capacity(b);
    for _ in 0..b {
        let toks: Vec<u32> = (0..prompt.max(1))
            .map(|_| (rng.next_f64() * vocab as f64) as u32 % vocab as u32)
            .collect();
        let mut st = eng.new_state()?;
        next.push(eng.eval_argmax(&mut st, &toks)?);
        states.push(st);
    }
    let c0 = eng.backend_mut().counters();
    let t = Instant::now();
    for _ in 0..steps {
        let mut refs: Vec<&mut ds4_engine::KvState> = states.iter_mut().collect();
        next = eng.eval_batch_argmax(&mut refs, &next)?;
    }
    let s = t.elapsed().as_secs_f64();
    let c1 = eng.backend_mut().counters();
    let agg = (b * steps) as f64 / s;
    // limit_b: the step's bandwidth limit when the router spreads tokens evenly over the
    // experts (docs/gguf.md §7.3).
    let limit_b = bw * b as f64 / acct.per_step_short(b);
    eprintln!(
        "batch {b}: {steps} steps in {s:.3} s · step {:.2} ms · aggregate {agg:.2} tok/s \
         ({:.1} % of the batch-1 bandwidth limit {limit:.0}; {:.1} % of this batch's \
         {limit_b:.0} = {:.2}x one sequence's) · per sequence {:.2} tok/s · \
         {:.0} launches, {:.1} host syncs per step",
        1e3 * s / steps as f64,
        100.0 * agg / limit,
        100.0 * agg / limit_b,
        limit_b / limit,
        steps as f64 / s,
        (c1.launches - c0.launches) as f64 / steps as f64,
        (c1.syncs - c0.syncs) as f64 / steps as f64
    );
    // The bound from the units this batch's tokens really chose, counted over as many
    // more steps (untimed: the census reads each layer's ids back to the host).
    eng.set_route_census(true);
    for _ in 0..steps {
        let mut refs: Vec<&mut ds4_engine::KvState> = states.iter_mut().collect();
        next = eng.eval_batch_argmax(&mut refs, &next)?;
    }
    let census = eng.route_census().cloned().unwrap_or_default();
    eng.set_route_census(false);
    let bound = batch_bound(acct, &census, b, bw, agg);
    let (skew, top10) = (census.max_over_mean(), census.top_share(0.1));
    eprintln!(
        "batch {b} bound: {:.1} distinct experts per layer and step (uniform router {:.1}) · \
         {:.2} GB a step · bound {:.0} tok/s at {:.0} GB/s · reached {:.1} % · expert use: \
         hottest {skew:.2}x the mean, top 10 % of experts {:.1} % of the picks",
        bound.distinct,
        bound.uniform,
        bound.step_bytes / 1e9,
        bound.bound_tok_s,
        bw / 1e9,
        100.0 * bound.fraction,
        100.0 * top10
    );
    let row = format!(
        "{b},{steps},{:.3},{agg:.2},{:.2},{:.2},{:.0},{:.1},{:.4},{skew:.3},{top10:.4}\n",
        1e3 * s / steps as f64,
        bound.distinct,
        bound.uniform,
        bound.step_bytes,
        bound.bound_tok_s,
        bound.fraction
    );
    // Then `profile` more steps with device-time attribution (what an added sequence costs).
    if profile > 0 && eng.backend_mut().set_profiling(true)? {
        let (rows, device, wall) = profiled_passes(eng, profile, |eng| {
            let mut refs: Vec<&mut ds4_engine::KvState> = states.iter_mut().collect();
            next = eng.eval_batch_argmax(&mut refs, &next)?;
            Ok(())
        })?;
        let per = profile as f64;
        eprintln!(
            "profile batch {b} ({profile} steps): device {:.3} ms/step, host wall {:.3} ms/step",
            device / per,
            wall / per
        );
        print_profile(&rows, per, device, "step");
    }
    for st in states {
        eng.free_state(st);
    }
    Ok(row)
}

/// One prefill of `n` random tokens in a fresh state with device-time attribution on,
/// printed per chunk-token (cuBLAS GEMMs are not launches of ours: the backend marks them
/// as `cublas_gemm_nt`, so their time is not charged to the panel's dequantization).
fn profile_prefill(eng: &mut Engine, n: usize, seed: u64) -> Result<()> {
    if !eng.backend_mut().set_profiling(true)? {
        eprintln!("profile: this backend has no device-time attribution");
        return Ok(());
    }
    eng.backend_mut().take_profile()?;
    let vocab = eng.hparams().n_vocab;
    let mut rng = Rng::new(seed ^ 0x9f1f);
    let toks: Vec<u32> = (0..n)
        .map(|_| (rng.next_f64() * vocab as f64) as u32 % vocab as u32)
        .collect();
    let mut st = eng.new_state()?;
    let t = Instant::now();
    eng.eval(&mut st, &toks, Logits::Last, None)?;
    let wall = t.elapsed().as_secs_f64() * 1e3;
    let mut rows = ProfileRows::default();
    let mut device = 0.0;
    if let Some((r, ms)) = eng.backend_mut().take_profile()? {
        device = ms;
        add_profile_rows(&mut rows, r);
    }
    eng.backend_mut().set_profiling(false)?;
    eprintln!(
        "profile prefill ({n} tokens): device {device:.1} ms, host wall {wall:.1} ms \
         ({:.0} tok/s wall); times below are per prefill",
        n as f64 / (wall * 1e-3)
    );
    print_profile(&rows, 1.0, device, "prefill");
    Ok(())
}

/// Attribution rows summed by (section, kernel).
type ProfileRows = std::collections::HashMap<(&'static str, &'static str), (u64, f64)>;

/// Runs `pass` `n` times with attribution on (the caller turned it on), then turns it off:
/// the rows summed by (section, kernel), the device milliseconds and the host's wall
/// milliseconds of the passes.
fn profiled_passes(
    eng: &mut Engine,
    n: usize,
    mut pass: impl FnMut(&mut Engine) -> Result<()>,
) -> Result<(ProfileRows, f64, f64)> {
    eng.backend_mut().take_profile()?; // drop anything recorded before
    let (mut rows, mut device, mut wall) = (ProfileRows::default(), 0.0, 0.0);
    for _ in 0..n {
        let t = Instant::now();
        pass(eng)?;
        wall += t.elapsed().as_secs_f64() * 1e3;
        if let Some((r, ms)) = eng.backend_mut().take_profile()? {
            device += ms;
            add_profile_rows(&mut rows, r);
        }
    }
    eng.backend_mut().set_profiling(false)?;
    Ok((rows, device, wall))
}

/// Adds one pass's attribution to `rows`.
fn add_profile_rows(rows: &mut ProfileRows, r: Vec<ds4_engine::backend::ProfileRow>) {
    for x in r {
        let e = rows.entry((x.tag, x.kernel)).or_insert((0, 0.0));
        e.0 += x.launches;
        e.1 += x.ms;
    }
}

/// Prints attribution rows by section, by kernel and by pair, divided by `per`.
fn print_profile(rows: &ProfileRows, per: f64, device: f64, unit: &str) {
    let mut by_tag: std::collections::BTreeMap<&str, (u64, f64)> = Default::default();
    let mut by_kernel: std::collections::BTreeMap<&str, (u64, f64)> = Default::default();
    for (&(tag, kernel), &(c, ms)) in rows {
        let e = by_tag.entry(tag).or_default();
        e.0 += c;
        e.1 += ms;
        let e = by_kernel.entry(kernel).or_default();
        e.0 += c;
        e.1 += ms;
    }
    let print = |title: &str, m: &std::collections::BTreeMap<&str, (u64, f64)>| {
        let mut v: Vec<_> = m.iter().collect();
        v.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        eprintln!("  by {title}: name, launches/{unit}, us/{unit}, share");
        for (k, (c, ms)) in v {
            eprintln!(
                "    {k:<24} {:>8.1} {:>9.1} {:>6.1}%",
                *c as f64 / per,
                1e3 * ms / per,
                100.0 * ms / device.max(1e-12)
            );
        }
    };
    print("section", &by_tag);
    print("kernel", &by_kernel);
    let mut v: Vec<_> = rows.iter().collect();
    v.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
    eprintln!("  top section/kernel pairs: us/{unit}, us/launch");
    for ((tag, kernel), (c, ms)) in v.into_iter().take(25) {
        eprintln!(
            "    {tag:<13} {kernel:<24} {:>9.1} {:>8.2}",
            1e3 * ms / per,
            1e3 * ms / (*c).max(1) as f64
        );
    }
}

/// One row of the streamed-experts CSV: `n` tokens in `secs`, and what the expert cache
/// did meanwhile: device-cache hit rate, misses the host tier held, file reads (demand and
/// read-ahead) and how much read-ahead was used, the prediction's accuracy, the bytes read
/// over the phase's wall time (`read_gb_s`), the time the forward pass waited for reads
/// (`wait_s`) and spent writing slots.
fn stream_line(frontier: usize, phase: &str, n: usize, secs: f64, s: &StreamStats) -> String {
    let rate = |x: f64| if secs > 0.0 { x / secs } else { 0.0 };
    let per_tok = |x: u64| x as f64 / n.max(1) as f64;
    format!(
        "{frontier},{phase},{n},{:.2},{},{:.4},{:.1},{},{:.1},{},{},{:.4},{},{:.2},{:.3},{:.3},{},{},{}\n",
        rate(n as f64),
        s.lookups,
        s.hit_rate(),
        per_tok(s.misses),
        s.host_hits,
        per_tok(s.reads),
        s.readahead_reads,
        s.readahead_used,
        s.prediction_accuracy(),
        s.bytes_read,
        rate(s.bytes_read as f64) / 1e9,
        s.read_secs,
        s.write_secs,
        s.runs,
        s.host_buffers,
        s.host_pinned
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// `--help` explains every argument a user can pass.
    #[test]
    fn every_argument_has_help_text() {
        let missing = ds4_runtime::cli_help::undocumented_arguments(&Args::command());
        assert!(missing.is_empty(), "arguments without help: {missing:?}");
    }

    /// The bound of a batch from its routing census: the real q2 layout's bytes, a census
    /// of two steps of 8 tokens, and the bandwidth and speed given.
    #[test]
    fn the_bound_is_the_census_bytes_over_the_bandwidth() {
        let h = ds4_model::layout::model_header(
            &ds4_model::HParams::flash(),
            &TypeRecipe::Q2,
            "t",
            &ds4_model::layout::placeholder_tokenizer(129_280),
        );
        let spec = ModelSpec::from_header(&h, Strictness::Auto).unwrap();
        let acct = ByteAccounting::of(&spec);
        let (layers, e, k) = (spec.hparams.n_layer, spec.hparams.n_expert, 6);
        assert_eq!(spec.hparams.n_expert_used, k);
        let mut census = ds4_engine::RouteCensus::new(layers, e);
        for step in 0..2 {
            for il in 0..layers {
                // 8 tokens: in even layers all pick the same k experts, in odd layers
                // disjoint ones (the extremes a router can give).
                let ids: Vec<i32> = (0..8 * k)
                    .map(|j| (if il % 2 == 0 { j % k } else { j }) as i32 + step)
                    .collect();
                census.record(il, &ids);
            }
            census.calls += 1;
        }
        let b = batch_bound(&acct, &census, 8, 3.0e12, 500.0);
        let odd = layers / 2;
        let mean = (k * (layers - odd) + 8 * k * odd) as f64 / layers as f64;
        assert!((b.distinct - mean).abs() < 1e-9, "{b:?}");
        let units: f64 = acct
            .expert_unit_bytes
            .iter()
            .enumerate()
            .map(|(il, &u)| u as f64 * (if il % 2 == 0 { k } else { 8 * k }) as f64)
            .sum();
        let dense = acct.per_token_short as f64 - acct.per_token_parts[0].1 as f64;
        let embd = acct
            .per_token_parts
            .iter()
            .find(|p| p.0 == "embedding row")
            .unwrap()
            .1 as f64;
        assert_eq!(acct.per_token_parts[0].0, "routed experts");
        assert!(
            (b.step_bytes - (dense + 7.0 * embd + units)).abs() < 1.0,
            "{b:?}"
        );
        assert!((b.bound_tok_s - 8.0 * 3.0e12 / b.step_bytes).abs() < 1e-6);
        assert!((b.fraction - 500.0 / b.bound_tok_s).abs() < 1e-12);
        assert!(b.uniform > k as f64 && b.uniform < 8.0 * k as f64, "{b:?}");
        // Nothing counted: the dense weights alone bound it; no speed, no fraction.
        let empty = batch_bound(&acct, &ds4_engine::RouteCensus::default(), 8, 3.0e12, 0.0);
        assert_eq!((empty.distinct, empty.fraction), (0.0, 0.0));
    }
}
