//! Loading a model for the commands that run it: the tokenizer from the GGUF's own tables,
//! the backend chosen by `--backend`, the numeric mode, the placement report, the engine.

use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{error_chain, LoadError};
use ds4_chat::Tokenizer;
use ds4_engine::{Backend, Engine, EngineConfig, ExpertPlacement, NumericMode, StreamConfig};
use ds4_gguf::GgufFile;

/// `--backend`: which [`Backend`] runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum BackendChoice {
    /// The best available backend: CUDA when a device answers, then ROCm, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda,
    Rocm,
}

impl fmt::Display for BackendChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendChoice::Auto => "auto",
            BackendChoice::Cpu => "cpu",
            BackendChoice::Cuda => "cuda",
            BackendChoice::Rocm => "rocm",
        })
    }
}

/// `--mode`: the numeric mode; `None` = the engine's default for the model (official where
/// the model's dims allow it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeChoice {
    /// HF transformers' graph, no QAT simulation (what the tiny oracle fixtures compute).
    Exact,
    /// The FP8/FP4 simulations the checkpoint was trained with (DeepSeek's own graph).
    Official,
}

impl From<NumericMode> for ModeChoice {
    fn from(m: NumericMode) -> ModeChoice {
        match m {
            NumericMode::Exact => ModeChoice::Exact,
            NumericMode::Official => ModeChoice::Official,
        }
    }
}

impl From<ModeChoice> for NumericMode {
    fn from(m: ModeChoice) -> NumericMode {
        match m {
            ModeChoice::Exact => NumericMode::Exact,
            ModeChoice::Official => NumericMode::Official,
        }
    }
}

/// Prefill GEMM precision on CUDA: what users run is the fastest verified path; the
/// pedantic f32 path is one flag away for anyone who wants bit-closer logits, and parity
/// checks (`ds4 vectors`) always use it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// Int8 activations in one-token matmuls and cuBLAS TF32 (f32 accumulation,
    /// 10-bit-mantissa products) in prefill: the default.
    #[default]
    Fast,
    /// f32 activations and cuBLAS in full f32 (`--quality` or `DS4_QUALITY=1`;
    /// [`crate::config::Config`] resolves it).
    Quality,
}

impl Precision {
    /// Whether one-token matmuls use int8 activations (`Backend::set_activation_q8`).
    pub fn activation_q8(self) -> bool {
        self == Precision::Fast
    }

    /// `fast` or `quality`.
    pub fn label(self) -> &'static str {
        match self {
            Precision::Fast => "fast",
            Precision::Quality => "quality",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::Fast => "fast (int8 decode activations, TF32 prefill GEMM)",
            Precision::Quality => "quality (f32 activations, f32 prefill GEMM)",
        }
    }
}

/// What `--backend` resolves to on this machine. GPU variants hold the opened device (the
/// backend is built on it, so it is opened once) and its facts, so the placement plan is
/// made for the device that will run the model.
pub enum Resolved {
    Cpu,
    Cuda {
        dev: ds4_gpu::cuda::CudaDevice,
        facts: ds4_placement::DeviceFacts,
        desc: String,
    },
    Rocm {
        dev: ds4_gpu::hip::HipDevice,
        facts: ds4_placement::DeviceFacts,
        desc: String,
    },
}

impl Resolved {
    /// The device for the planner (`None`: plan as CPU-only).
    pub fn plan_device(&self) -> Option<(ds4_placement::DeviceFacts, String)> {
        match self {
            Resolved::Cpu => None,
            Resolved::Cuda { facts, desc, .. } | Resolved::Rocm { facts, desc, .. } => {
                Some((facts.clone(), desc.clone()))
            }
        }
    }
}

/// "RUNTIME device 0: NAME, ARCH, integrated|discrete" for the plan's heading.
fn device_desc(runtime: &str, name: &str, arch: &str, integrated: bool) -> String {
    let kind = if integrated { "integrated" } else { "discrete" };
    format!("{runtime} device 0: {name}, {arch}, {kind}")
}

/// Wraps a GPU runtime error with the step it failed in.
fn gpu(step: &'static str) -> impl FnOnce(ds4_gpu::GpuError) -> LoadError {
    move |source| LoadError::Gpu { step, source }
}

fn probe_cuda() -> Result<Resolved, LoadError> {
    let dev = ds4_gpu::cuda::CudaDevice::open(0).map_err(gpu("starting the CUDA backend"))?;
    let facts = dev
        .placement_facts()
        .map_err(gpu("reading the CUDA device's memory"))?;
    let i = dev.info();
    let desc = device_desc("CUDA", &i.name, &i.arch(), i.integrated);
    Ok(Resolved::Cuda { dev, facts, desc })
}

fn probe_rocm() -> Result<Resolved, LoadError> {
    let dev = ds4_gpu::hip::HipDevice::open(0).map_err(gpu("starting the ROCm backend"))?;
    let facts = dev
        .placement_facts()
        .map_err(gpu("reading the ROCm device's memory"))?;
    let desc = device_desc("ROCm", &dev.info().name, dev.arch(), dev.info().integrated);
    Ok(Resolved::Rocm { dev, facts, desc })
}

/// Resolves `--backend` on this machine. `auto` takes CUDA when a device answers, then
/// ROCm, then the CPU, and says which it chose on stderr: in one line with
/// [`LoadReport::Summary`], with each runtime's reason (the library paths tried, say) with
/// [`LoadReport::Full`]. `cuda` / `rocm` fail with the runtime's reason ("CUDA is not
/// available: ...", "no ROCm device: ...") instead of falling back.
pub fn probe_device(choice: BackendChoice, report: LoadReport) -> Result<Resolved, LoadError> {
    match choice {
        BackendChoice::Cpu => Ok(Resolved::Cpu),
        BackendChoice::Cuda => probe_cuda(),
        BackendChoice::Rocm => probe_rocm(),
        BackendChoice::Auto => {
            let why_not_cuda = match ds4_gpu::cuda::CudaDevice::count() {
                Ok(n) if n > 0 => return probe_cuda(),
                Ok(_) => "the CUDA driver reports no devices".to_string(),
                Err(e) => e.to_string(),
            };
            let why_not_rocm = match probe_rocm() {
                Ok(r) => {
                    match report {
                        LoadReport::Quiet => {}
                        LoadReport::Summary => {
                            eprintln!("ds4: backend auto -> rocm (no CUDA device)")
                        }
                        LoadReport::Full => {
                            eprintln!("ds4: backend auto -> rocm (no CUDA: {why_not_cuda})")
                        }
                    }
                    return Ok(r);
                }
                Err(e) => error_chain(&e),
            };
            match report {
                LoadReport::Quiet => {}
                LoadReport::Summary => eprintln!(
                    "ds4: backend auto -> cpu (no CUDA or ROCm GPU answered; -v says why)"
                ),
                LoadReport::Full => {
                    eprintln!("ds4: backend auto -> cpu ({why_not_cuda}; {why_not_rocm})")
                }
            }
            Ok(Resolved::Cpu)
        }
    }
}

/// Creates the backend `resolved` names, on its already opened device; GPU weights go
/// where `plan` says (its arenas, memory kinds and fallbacks). When `auto` resolved to ROCm
/// and the ROCm backend cannot start, the CPU runs the model (said on stderr).
pub fn make_planned_backend(
    resolved: Resolved,
    choice: BackendChoice,
    threads: usize,
    plan: Option<ds4_placement::Plan>,
    knobs: ds4_gpu::backend::Knobs,
) -> Result<Box<dyn Backend>, LoadError> {
    let cpu = || -> Result<Box<dyn Backend>, LoadError> {
        let be = ds4_cpu::CpuBackend::new(threads).map_err(LoadError::Cpu)?;
        Ok(Box::new(be))
    };
    let opts = gpu_options(plan, knobs);
    match resolved {
        Resolved::Cpu => cpu(),
        Resolved::Cuda { dev, .. } => {
            let be = ds4_gpu::backend::CudaBackend::on_device(dev, opts)
                .map_err(gpu("starting the CUDA backend"))?;
            Ok(Box::new(be))
        }
        Resolved::Rocm { dev, .. } => match ds4_gpu::backend::HipBackend::on_device(dev, opts) {
            Ok(be) => {
                for f in be.alloc_fallbacks() {
                    eprintln!("ds4: rocm: {f}");
                }
                Ok(Box::new(be))
            }
            Err(e) if choice == BackendChoice::Auto => {
                eprintln!("ds4: backend auto -> cpu (the ROCm backend did not start: {e})");
                cpu()
            }
            Err(e) => Err(gpu("starting the ROCm backend")(e)),
        },
    }
}

/// The GPU backend options the CLI, the server and the bench use: the plan and the run's
/// [`ds4_gpu::backend::Knobs`] ([`crate::config::Config::knobs`]).
pub fn gpu_options(
    plan: Option<ds4_placement::Plan>,
    knobs: ds4_gpu::backend::Knobs,
) -> ds4_gpu::backend::GpuOptions {
    ds4_gpu::backend::GpuOptions {
        plan,
        knobs,
        ..ds4_gpu::backend::GpuOptions::default()
    }
}

/// The model's tokenizer (built by `ds4_chat::Tokenizer::from_gguf_header`).
pub fn tokenizer_from_gguf(file: &GgufFile) -> Result<Tokenizer, LoadError> {
    Tokenizer::from_gguf_header(file.header()).map_err(LoadError::Tokenizer)
}

/// What to tell a user whose model file does not exist: a bare "file not found" does not say
/// what kind of file is wanted or where one comes from, and a newcomer has none yet. Shared by
/// `ds4` and `ds4-server` (both take `-m FILE` with the default `./ds4flash.gguf`).
pub fn missing_model_message(path: &Path) -> String {
    format!(
        "model file {} not found.\n\
         ds4 runs DeepSeek V4 Flash from one GGUF file in ds4's layout, given with -m FILE \
         (default ./ds4flash.gguf). Where such a file comes from:\n\
         \x20 * the real weights: `ds4 pull q2` (81 GB) or `ds4 pull q4` (153 GB) \
         downloads the GGUF files the ds4 project publishes on Hugging Face \
         (antirez/deepseek-v4-gguf)\n\
         \x20 * to see the engine run without them: -m tests/fixtures/kjv/ds4-kjv-q2.gguf (in the \
         ds4-rs repository; a small DeepSeek V4 trained on the King James Bible)\n\
         \x20 * random weights at the real shapes, for benchmarks: \
         ds4-convert synthetic --layout q2 OUT.gguf",
        path.display()
    )
}

/// Opens a GGUF (memory-mapped), with the path in the error.
pub fn open_gguf(path: &Path) -> Result<Arc<GgufFile>, LoadError> {
    if !path.exists() {
        return Err(LoadError::MissingModel(path.to_path_buf()));
    }
    let f = GgufFile::open(path).map_err(|source| LoadError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(Arc::new(f))
}

/// Placement overrides, the same flags for every program that loads a model (`ds4`,
/// `ds4-server`, `ds4-bench`). CLI > environment > automatic; `ds4 plan --help-overrides`
/// prints the whole table.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct PlacementFlags {
    /// Where weights go: auto|device|host|managed.
    #[arg(long)]
    pub weights_mem: Option<String>,
    /// Where the KV state goes: auto|device|host|managed.
    #[arg(long)]
    pub kv_mem: Option<String>,
    /// Where scratch goes: auto|device|host|managed.
    #[arg(long)]
    pub scratch_mem: Option<String>,
    /// Host memory kept free for the OS, GiB (default 2).
    #[arg(long)]
    pub os_reserve_gib: Option<String>,
    /// Cap the device pool (GiB), to reproduce small-pool machines on big GPUs.
    #[arg(long)]
    pub device_mem_limit_gib: Option<String>,
    /// Routed experts: auto|resident|stream (stream: read from the model file through an
    /// expert cache; auto streams only when nothing resident fits).
    #[arg(long)]
    pub experts: Option<String>,
    /// Largest expert cache of a streamed plan, GiB (0: as large as fits).
    #[arg(long)]
    pub expert_cache_gib: Option<String>,
}

impl PlacementFlags {
    pub fn to_overrides(&self) -> ds4_placement::CliOverrides {
        ds4_placement::CliOverrides {
            weights_mem: self.weights_mem.clone(),
            kv_mem: self.kv_mem.clone(),
            scratch_mem: self.scratch_mem.clone(),
            os_reserve_gib: self.os_reserve_gib.clone(),
            device_mem_limit_gib: self.device_mem_limit_gib.clone(),
            experts: self.experts.clone(),
            expert_cache_gib: self.expert_cache_gib.clone(),
        }
    }
}

/// How much a load reports: a user wants one line per decision that matters (backend,
/// where the weights go, the context), the whole placement table only when asking for it
/// (`-v`, or `ds4 plan`), and nothing but errors with `-q`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadReport {
    /// Errors only.
    Quiet,
    /// The backend, a one-line placement summary, the model line, notes and the warm-up.
    #[default]
    Summary,
    /// As `Summary`, with the whole placement plan and why `auto` passed over each GPU
    /// runtime.
    Full,
}

/// Everything needed to (re)build an engine: `/ctx N` reloads with another context.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub model: PathBuf,
    pub backend: BackendChoice,
    pub mode: Option<ModeChoice>,
    pub ctx: usize,
    /// KV states of `ctx` tokens the caller will allocate (the server's `--parallel`; 1
    /// otherwise): the placement plan budgets all of them.
    pub kv_states: usize,
    pub prefill_chunk: usize,
    pub threads: usize,
    pub placement: ds4_placement::CliOverrides,
    /// What the load says about itself on the log writer.
    pub report: LoadReport,
    /// The run's settings (precision, warm-up, GPU kernels; [`crate::config::Config`]).
    pub config: crate::config::Config,
}

/// A model ready to run: the engine, its tokenizer, and what the store needs to know.
pub struct Loaded {
    pub engine: Engine,
    pub tokenizer: Arc<Tokenizer>,
    pub file: Arc<GgufFile>,
    /// SHA-256 of the GGUF header bytes (metadata + tensor table): identity for disk sessions.
    pub model_id: [u8; 32],
}

/// Canonical bytes of a model's identity: the encoded header (metadata and tensor table,
/// offsets included), which is what tells two model files apart without hashing gigabytes.
pub fn model_id(file: &GgufFile) -> Result<[u8; 32], LoadError> {
    ds4_kvstore::header_identity(file.header()).map_err(LoadError::Identity)
}

/// What placing a model needs besides the file: the request the planner sees.
#[derive(Debug, Clone)]
pub struct PlacementRequest<'a> {
    pub model: &'a Path,
    pub ctx: usize,
    /// KV states of `ctx` tokens to budget.
    pub kv_states: usize,
    pub prefill_chunk: usize,
    pub overrides: ds4_placement::CliOverrides,
    /// The MTP block the engine will load, to be placed with the model
    /// ([`crate::plan::PlanArgs::mtp`]).
    pub mtp: Option<Option<PathBuf>>,
}

/// Runs the placement planner for this model and request on the device the model will run
/// on, like `ds4 plan`: a refusal is an error (with the planner's reason and remedy), a plan
/// is printed to `log` (when given) and returned.
pub fn placement_plan(
    req: &PlacementRequest<'_>,
    resolved: &Resolved,
    log: Option<&mut dyn Write>,
    report: LoadReport,
) -> Result<ds4_placement::Plan, LoadError> {
    let args = crate::plan::PlanArgs {
        source: crate::plan::Source::File(req.model.to_path_buf()),
        mtp: req.mtp.clone(),
        ctx: req.ctx as u64,
        kv_states: req.kv_states as u64,
        prefill_chunk: req.prefill_chunk as u64,
        machine: None,
        device: resolved.plan_device(),
        overrides: req.overrides.clone(),
    };
    let planned = crate::plan::run(&args, |k| std::env::var(k).ok())?;
    match planned.result {
        Ok(plan) => {
            match (log, report) {
                (Some(log), LoadReport::Full) => {
                    writeln!(log, "placement plan for {}", planned.description)?;
                    write!(log, "{}", plan.render_text())?;
                }
                (Some(log), LoadReport::Summary) => {
                    let states = match req.kv_states {
                        0 | 1 => String::new(),
                        n => format!(" ({n} KV states of ctx {})", req.ctx),
                    };
                    writeln!(log, "ds4: {}{states}", plan.summary_line())?
                }
                _ => {}
            }
            Ok(plan)
        }
        Err(refusal) => Err(LoadError::Refused {
            what: planned.description,
            refusal: Box::new(refusal),
            states: req.kv_states as u64,
            fewer_states: planned.fewer_states,
        }),
    }
}

/// How a plan places routed experts in the engine: resident, or streamed through a cache
/// of the plan's `cache_slots` units and a host tier of its `host_tier_slots`
/// (docs/placement.md §9), with read-ahead of the next layer's predicted experts when
/// `readahead` ([`crate::config::Config::expert_readahead`]).
pub fn expert_placement(plan: &ds4_placement::Plan, readahead: bool) -> ExpertPlacement {
    match &plan.stream {
        None => ExpertPlacement::Resident,
        Some(st) => ExpertPlacement::Streamed(StreamConfig {
            slots: usize::try_from(st.cache_slots).unwrap_or(usize::MAX),
            host_slots: usize::try_from(st.host_tier_slots).unwrap_or(usize::MAX),
            readahead,
        }),
    }
}

/// A backend built by a placement plan and what the plan decided for the engine.
pub struct PlannedBackend {
    pub backend: Box<dyn Backend>,
    /// How the engine places the routed experts.
    pub experts: ExpertPlacement,
    /// What the plan did with the MTP block, when one was asked for
    /// ([`PlacementRequest::mtp`]): the engine loads it only when `resident`.
    pub mtp: Option<ds4_placement::MtpPlacement>,
}

/// The backend `--backend` asks for, with the model's weights to be placed by a plan made
/// for that device before anything is allocated (the CLI and `ds4-server` both load this
/// way), how the engine must place the routed experts by the plan, and whether the MTP
/// block fits. The choice and the plan are reported to `log` as `report` says.
pub fn planned_backend_and_experts(
    choice: BackendChoice,
    threads: usize,
    req: &PlacementRequest<'_>,
    log: &mut dyn Write,
    report: LoadReport,
    config: &crate::config::Config,
) -> Result<PlannedBackend, LoadError> {
    let resolved = probe_device(choice, report)?;
    let plan = placement_plan(req, &resolved, Some(log), report)?;
    let experts = expert_placement(&plan, config.expert_readahead.value);
    let mtp = plan.mtp.clone();
    let gpu_plan = (!matches!(resolved, Resolved::Cpu)).then_some(plan);
    let mut backend = make_planned_backend(resolved, choice, threads, gpu_plan, config.knobs())?;
    backend
        .set_activation_q8(config.precision.value.activation_q8())
        .map_err(LoadError::ActivationPrecision)?;
    Ok(PlannedBackend {
        backend,
        experts,
        mtp,
    })
}

/// Opens the model, builds the tokenizer and the engine, warms it up (when asked and the
/// backend has first-use costs), and prints the load report (model, mode, backend, context,
/// warm-up) to `log`.
pub fn load(opts: &LoadOptions, log: &mut dyn Write) -> Result<Loaded, LoadError> {
    load_wrapped(opts, log, &mut |be| be)
}

/// A backend wrapper a command puts around the backend the load chose, before the engine
/// is built on it (`ds4 imatrix`'s statistics collector): the wrapper then sees every op,
/// weight load and allocation, on whichever device `--backend` resolved to.
pub type WrapBackend<'a> = &'a mut dyn FnMut(Box<dyn Backend>) -> Box<dyn Backend>;

/// [`load`] with the backend wrapped by `wrap` (placed by the same plan, the same
/// settings, the same report and warm-up), so a command that observes the ops runs on
/// the GPU exactly as `ds4` does instead of building a backend of its own.
pub fn load_wrapped(
    opts: &LoadOptions,
    log: &mut dyn Write,
    wrap: WrapBackend<'_>,
) -> Result<Loaded, LoadError> {
    let mut sink = std::io::sink();
    let log: &mut dyn Write = if opts.report == LoadReport::Quiet {
        &mut sink
    } else {
        log
    };
    if opts.report == LoadReport::Full {
        // -v: every setting of the run and where it came from (`ds4 --print-config`).
        let placement =
            ds4_placement::resolve_overrides(&opts.placement, |k| std::env::var(k).ok())
                .map_err(LoadError::Override)?;
        writeln!(log, "ds4: settings:")?;
        for line in opts.config.render(&placement).lines() {
            writeln!(log, "ds4:   {line}")?;
        }
    }
    let file = open_gguf(&opts.model)?;
    let tokenizer = Arc::new(tokenizer_from_gguf(&file)?);
    let model_id = model_id(&file)?;
    let mut engine = build_engine_logged(&file, opts, opts.ctx, Some(log), wrap)?;
    if engine.hparams().n_vocab != tokenizer.vocab_size() {
        return Err(LoadError::VocabMismatch {
            path: opts.model.clone(),
            tokenizer: tokenizer.vocab_size(),
            model: engine.hparams().n_vocab,
        });
    }
    writeln!(
        log,
        "ds4: model {} · mode {} · backend {} · ctx {}",
        opts.model.display(),
        engine.mode(),
        engine.backend_name(),
        engine.config().ctx
    )?;
    if let Some(s) = engine.expert_stats() {
        writeln!(
            log,
            "ds4: routed experts streamed from the file through a cache of {} units ({:.2} GiB; docs/placement.md §9)",
            s.slots,
            (s.slot_bytes * s.slots as u64) as f64 / (1u64 << 30) as f64
        )?;
    }
    if let Some(note) = ds4_model::layout::random_weights_note(file.header()) {
        writeln!(log, "ds4: NOTE: {note}")?;
    }
    if opts.config.warmup.value {
        let t = std::time::Instant::now();
        let n = engine
            .warm_up(opts.prefill_chunk)
            .map_err(|source| LoadError::Engine {
                path: opts.model.clone(),
                source,
            })?;
        if n > 0 {
            writeln!(
                log,
                "ds4: warm-up: a {}-token prefill and a decode step in {:.2} s (--no-warmup skips it)",
                n - 1,
                t.elapsed().as_secs_f64()
            )?;
        }
    }
    Ok(Loaded {
        engine,
        tokenizer,
        file,
        model_id,
    })
}

/// An engine for `file` with context `ctx` (used at load and by `/ctx N`).
pub fn build_engine(
    file: &Arc<GgufFile>,
    opts: &LoadOptions,
    ctx: usize,
) -> Result<Engine, LoadError> {
    build_engine_logged(file, opts, ctx, None, &mut |be| be)
}

/// [`build_engine`], printing the placement plan to `log` when given, on the backend
/// `wrap` makes of the chosen one. The plan is made for the device that will run the
/// model, before anything is allocated, and the GPU backends place the weights by it: a
/// model that cannot fit is refused here, not by an allocation failing halfway through
/// the load.
fn build_engine_logged(
    file: &Arc<GgufFile>,
    opts: &LoadOptions,
    ctx: usize,
    log: Option<&mut dyn Write>,
    wrap: WrapBackend<'_>,
) -> Result<Engine, LoadError> {
    if ctx == 0 {
        return Err(LoadError::ZeroContext);
    }
    let mtp = mtp_source(file, opts)?;
    let req = PlacementRequest {
        model: &opts.model,
        ctx,
        kv_states: opts.kv_states,
        prefill_chunk: opts.prefill_chunk,
        overrides: opts.placement.clone(),
        mtp: mtp.as_ref().map(|(p, _)| p.clone()),
    };
    let mut sink = std::io::sink();
    let (log, report): (&mut dyn Write, _) = match log {
        Some(l) => (l, opts.report),
        None => (&mut sink, LoadReport::Quiet),
    };
    let PlannedBackend {
        backend,
        experts,
        mtp: placed,
    } = planned_backend_and_experts(opts.backend, opts.threads, &req, log, report, &opts.config)?;
    let cfg = EngineConfig {
        mode: opts.mode.map(NumericMode::from),
        ctx,
        prefill_chunk: opts.prefill_chunk,
    };
    let backend = wrap(backend);
    let mut engine = Engine::load_with(file.clone(), backend, cfg, experts).map_err(|source| {
        LoadError::Engine {
            path: opts.model.clone(),
            source,
        }
    })?;
    if let Some((_, (path, mfile))) = mtp {
        match placed {
            Some(p) if !p.resident => writeln!(
                log,
                "ds4: WARNING: the MTP block is not loaded: {}; --draft mtp|auto draft by prompt lookup",
                p.reason
            )?,
            _ => engine
                .load_mtp(mfile)
                .map_err(|source| LoadError::Engine { path, source })?,
        }
    }
    Ok(engine)
}

/// The MTP block to load, when drafting may use it (`--draft mtp|auto`, or `--mtp`
/// given): from `--mtp FILE`, else from the model file when it carries `mtp.0.*`; with the
/// placement request's form of it ([`PlacementRequest::mtp`]), so the plan counts it
/// before anything is allocated. `--draft mtp` without a block is refused, saying where
/// one comes from.
#[allow(clippy::type_complexity)]
fn mtp_source(
    file: &Arc<GgufFile>,
    opts: &LoadOptions,
) -> Result<Option<(Option<PathBuf>, (PathBuf, Arc<GgufFile>))>, LoadError> {
    use crate::draft::DraftMode;
    let mode = opts.config.draft.value;
    if !matches!(mode, DraftMode::Mtp | DraftMode::Auto) && opts.config.mtp.value.is_none() {
        return Ok(None);
    }
    Ok(Some(match &opts.config.mtp.value {
        Some(p) => (Some(p.clone()), (p.clone(), open_gguf(p)?)),
        None if ds4_model::mtp::has_mtp(file.header()) => {
            (None, (opts.model.clone(), file.clone()))
        }
        None if mode == DraftMode::Mtp => return Err(LoadError::NoMtp(opts.model.clone())),
        None => return Ok(None),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, ConfigFlags};
    use ds4_gpu::cuda::GemmPrecision;

    /// The backend options carry the run's knobs: `--quality` the pedantic f32 GEMM, the
    /// default the fast TF32 one (which a hand-built backend also starts with).
    #[test]
    fn precision_selects_the_cublas_gemm() {
        let quality = Config::resolve(
            ConfigFlags {
                quality: true,
                ..ConfigFlags::default()
            },
            |_| None,
        )
        .unwrap();
        assert_eq!(
            gpu_options(None, quality.knobs()).knobs.cublas,
            Some(GemmPrecision::F32)
        );
        let fast = Config::default();
        assert_eq!(
            gpu_options(None, fast.knobs()).knobs.cublas,
            Some(GemmPrecision::Tf32)
        );
        assert_eq!(
            ds4_gpu::backend::GpuOptions::default().knobs.cublas,
            Some(GemmPrecision::Tf32)
        );
        assert_eq!(Precision::default(), Precision::Fast);
    }
}
