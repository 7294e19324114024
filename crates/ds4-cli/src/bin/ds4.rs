//! `ds4`: the user-facing command. `ds4 -p PROMPT` answers once, `ds4` alone chats;
//! subcommands inspect, plan and check models.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use ds4_chat::render::{ThinkingMode, DEFAULT_SYSTEM};
use ds4_cli::generate::{GenSettings, OneShotEnd};
use ds4_cli::load::{BackendChoice, LoadOptions, LoadReport, ModeChoice, PlacementFlags};
use ds4_cli::signals::Interrupts;
use ds4_engine::SamplerConfig;
use ds4_model::Strictness;
use ds4_runtime::config::{Config, ConfigFlags};
use ds4_runtime::DraftMode;

#[derive(Parser)]
#[command(
    name = "ds4",
    version,
    about = "DeepSeek V4 Flash inference engine (ds4-rs)",
    long_about = "DeepSeek V4 Flash inference engine (ds4-rs).\n\n\
        `ds4 -p TEXT` answers one prompt and exits; `ds4` with no prompt starts an interactive \
        chat (type /help there). The model's text goes to stdout, everything else to stderr.",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    /// More log output (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

/// How to load the model (shared by generation, chat and `ds4 vectors`).
#[derive(clap::Args)]
struct ModelArgs {
    /// The model GGUF.
    #[arg(short, long, default_value = "ds4flash.gguf")]
    model: PathBuf,
    /// Backend: auto (CUDA when a device answers, else the CPU), cpu, cuda, rocm.
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// Numeric mode: official (FP8/FP4 QAT simulation, the default where the model allows it)
    /// or exact (HF transformers' graph).
    #[arg(long, value_enum)]
    mode: Option<ModeChoice>,
    /// CPU threads (0 = one per core).
    #[arg(short, long, default_value_t = 0)]
    threads: usize,
    /// Prefill chunk in tokens (bounds scratch memory; results do not depend on it).
    #[arg(long, visible_alias = "chunk", default_value_t = ds4_engine::DEFAULT_PREFILL_CHUNK)]
    prefill_chunk: usize,
    /// Pedantic f32 prefill GEMM instead of the default fast TF32 path (CUDA; also
    /// DS4_QUALITY=1). Slower prefill, logits closer to the f32 reference.
    #[arg(long)]
    quality: bool,
    /// Skip the warm-up at load (one prefill chunk and a decode step on a GPU, so the first
    /// prompt does not pay first-use costs; also DS4_WARMUP=0).
    #[arg(long)]
    no_warmup: bool,
    #[command(flatten)]
    placement: PlacementFlags,
    /// The file holding the MTP block (`mtp.0.*`, ds4's sidecar that `ds4-convert` writes
    /// as OUT-mtp.gguf), the drafter of `--draft mtp`; without it, the model file's own
    /// block when it has one. Also DS4_MTP.
    #[arg(long, value_name = "FILE")]
    mtp: Option<PathBuf>,
    /// Generation flags that are settings too (`ds4` runs set them; other subcommands
    /// leave them unset).
    #[arg(skip)]
    draft: DraftFlags,
}

/// Speculative decoding (docs/speculative.md): the generation's own flags, kept in the one
/// place settings are resolved (`Config`).
#[derive(clap::Args, Clone, Copy, Default)]
struct DraftFlags {
    /// Draft tokens and verify them in one forward pass: mtp (the checkpoint's MTP block,
    /// `--mtp`), lookup (prompt lookup: the tokens that followed the context's last n-gram
    /// earlier), auto (mtp when a block is loaded, else lookup; paused while it is measured
    /// slower than plain decoding) or off; the output is unchanged (greedy: token for
    /// token). Also DS4_DRAFT.
    #[arg(long, value_parser = parse_draft)]
    draft: Option<DraftMode>,
    /// Most drafted tokens per step, 1 to 16 (default 3; beyond 3 a partly accepted draft
    /// costs a second evaluation on DeepSeek V4). Also DS4_DRAFT_MAX.
    #[arg(long)]
    draft_max: Option<usize>,
    /// The longest n-gram the lookup drafter matches (then shorter ones, down to 1;
    /// default 3). Also DS4_DRAFT_NGRAM.
    #[arg(long)]
    draft_ngram: Option<usize>,
}

fn parse_draft(s: &str) -> Result<DraftMode, String> {
    s.parse()
}

impl ModelArgs {
    /// The run's settings from these flags and the environment.
    fn config(&self) -> anyhow::Result<Config> {
        Config::resolve(
            ConfigFlags {
                quality: self.quality,
                no_warmup: self.no_warmup,
                draft: self.draft.draft,
                draft_max: self.draft.draft_max,
                draft_ngram: self.draft.draft_ngram,
            },
            |k| std::env::var(k).ok(),
        )
        .map(|c| c.with_mtp_flag(self.mtp.clone()))
        .context("invalid setting")
    }

    fn load_options(&self, ctx: usize, report: LoadReport) -> anyhow::Result<LoadOptions> {
        Ok(LoadOptions {
            model: self.model.clone(),
            backend: self.backend,
            mode: self.mode,
            ctx,
            kv_states: 1,
            prefill_chunk: self.prefill_chunk.max(1),
            threads: self.threads,
            placement: self.placement.to_overrides(),
            report,
            config: self.config()?,
        })
    }
}

#[derive(clap::Args)]
#[group(id = "thinking", multiple = false)]
struct ThinkFlags {
    /// Thinking on, normal effort (the default).
    #[arg(long)]
    think: bool,
    /// Think Max (needs -c >= 393216, else normal thinking with a warning).
    #[arg(long)]
    think_max: bool,
    /// No reasoning: the answer starts at once.
    #[arg(long)]
    nothink: bool,
}

/// Generation and chat flags (docs/server.md §2).
#[derive(clap::Args)]
struct RunArgs {
    /// Answer this prompt and exit (without -p or --prompt-file: interactive chat).
    #[arg(short, long, conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// Answer the prompt in FILE and exit.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    draft: DraftFlags,
    /// Context size in tokens.
    #[arg(short, long, default_value_t = 32768)]
    ctx: usize,
    /// Most tokens per answer (clamped to the context room).
    #[arg(short = 'n', long, default_value_t = 50000)]
    tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = ds4_cli::generate::DEFAULT_TEMP)]
    temp: f32,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = ds4_cli::generate::DEFAULT_TOP_P)]
    top_p: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, default_value_t = ds4_cli::generate::DEFAULT_TOP_K)]
    top_k: usize,
    /// Drop tokens below this fraction of the top probability.
    #[arg(long, default_value_t = ds4_cli::generate::DEFAULT_MIN_P)]
    min_p: f32,
    /// RNG seed (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// System prompt (`-sys` works too); "" for none.
    #[arg(long, default_value = DEFAULT_SYSTEM)]
    system: String,
    #[command(flatten)]
    think: ThinkFlags,
    /// Never stop at EOS (its logit is masked): fixed-length answers for benchmarks and tests.
    #[arg(long)]
    ignore_eos: bool,
    /// Directory of the disk KV store for /save, /load and /list.
    #[arg(long)]
    kv_disk_dir: Option<PathBuf>,
    /// Disk budget of the KV store in MiB.
    #[arg(long, default_value_t = 4096)]
    kv_disk_space_mb: u64,
    /// Print nothing on stderr but errors (the interactive chat keeps its per-answer status
    /// line). By default the load says one line per decision (backend, placement, model);
    /// -v prints the whole placement plan.
    #[arg(short, long)]
    quiet: bool,
    /// Print the settings this run would use — precision and the GPU kernels it selects,
    /// warm-up, load pipeline, placement — each with where it came from (default, a
    /// DS4_* variable or a flag; docs/configuration.md), and exit without loading.
    #[arg(long)]
    print_config: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum Rules {
    /// ds4 rules for real-size files, layout rules for others.
    Auto,
    /// ds4's exact rules (the real Flash dims and types).
    Ds4,
    /// Consistent ds4 layout, any dims and supported types.
    Layout,
}

/// The full-size layouts `--synthetic` plans (`TypeRecipe::NAMED` less f32).
#[derive(Clone, Copy, ValueEnum)]
enum SyntheticLayout {
    Q2,
    Q4,
    Mxfp4,
}

impl SyntheticLayout {
    fn recipe(self) -> ds4_model::layout::TypeRecipe {
        use ds4_model::layout::TypeRecipe;
        match self {
            SyntheticLayout::Q2 => TypeRecipe::Q2,
            SyntheticLayout::Q4 => TypeRecipe::Q4,
            SyntheticLayout::Mxfp4 => TypeRecipe::MXFP4,
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Plan memory placement for a model on this machine's GPU (its memory facts are read;
    /// nothing is allocated, no weights read); exits 3 on a refusal.
    Plan {
        /// The model file.
        #[arg(short, long, conflicts_with = "synthetic", required_unless_present_any = ["synthetic", "help_overrides"])]
        model: Option<PathBuf>,
        /// Plan the real full-size layout from its tensor table alone (no file needed).
        #[arg(long, value_enum)]
        synthetic: Option<SyntheticLayout>,
        /// Include the MTP sidecar: a file with -m, or the published layout with --synthetic.
        #[arg(long, num_args = 0..=1)]
        mtp: Option<Option<PathBuf>>,
        /// Context length in tokens.
        #[arg(short, long, default_value_t = 32768)]
        ctx: u64,
        /// Prefill chunk in tokens.
        #[arg(long, default_value_t = 2048)]
        prefill_chunk: u64,
        /// Replay a described machine (JSON: host and device facts) instead of this one.
        #[arg(long)]
        machine: Option<PathBuf>,
        /// The device to plan for when no --machine is given: auto (CUDA, then ROCm, then
        /// none), cpu (no GPU), cuda or rocm.
        #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
        backend: BackendChoice,
        #[command(flatten)]
        placement: PlacementFlags,
        /// The plan (or the refusal) as JSON on stdout.
        #[arg(long)]
        json: bool,
        /// Print the table of placement flags and environment variables, then exit.
        #[arg(long)]
        help_overrides: bool,
    },
    /// Compare this engine with DeepSeek's official API vectors (top-20 logprobs).
    #[command(after_long_help = ds4_cli::vectors::THRESHOLDS_HELP)]
    Vectors {
        /// The vectors directory (manifest.json, prompts/, official/).
        #[arg(long)]
        dir: PathBuf,
        #[command(flatten)]
        model: ModelArgs,
        /// Context (0 = just large enough for the longest case).
        #[arg(short, long, default_value_t = 0)]
        ctx: usize,
        /// Only check the prompt token counts (needs only the vocabulary: any GGUF with
        /// tokenizer tables, such as a vocabulary-only file).
        #[arg(long)]
        counts_only: bool,
        /// Run only these cases (repeatable).
        #[arg(long)]
        only: Vec<String>,
        /// Leave out these cases (repeatable).
        #[arg(long)]
        skip: Vec<String>,
        /// Least top-20 overlap with the official list.
        #[arg(long, default_value_t = 17)]
        min_overlap: usize,
        /// Largest |delta logprob| on the official top-5, in nats.
        #[arg(long, default_value_t = 0.5)]
        max_top5_delta: f64,
        /// Machine-readable JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Show a GGUF's metadata, tensor summary, validation verdict and byte accounting.
    Inspect {
        /// The GGUF file to inspect.
        file: PathBuf,
        /// Machine-readable JSON on stdout.
        #[arg(long)]
        json: bool,
        /// Which validation rules apply: ds4's exact ones, any consistent ds4 layout, or
        /// auto (by the file's size class).
        #[arg(long, value_enum, default_value = "auto")]
        rules: Rules,
    },
    /// Write the raw logits of a token sequence ([positions, vocab] float32 .npy) and/or
    /// print each position's top-K ids and log-probabilities as JSON.
    Logits {
        #[command(flatten)]
        model: ModelArgs,
        /// The token ids (comma- or space-separated, or a JSON list).
        #[arg(long, conflicts_with = "prompt", required_unless_present = "prompt")]
        tokens: Option<String>,
        /// Text tokenized as `ds4 tokenize --special chat` does: plain text stays text, ds4's
        /// chat markers become their ids (so `ds4 render` output can be passed verbatim).
        #[arg(long)]
        prompt: Option<String>,
        /// Prefill the first N tokens in one pass (all their logits), then feed the rest one
        /// token at a time as decoding does (default: prefill everything).
        #[arg(long)]
        decode_from: Option<usize>,
        /// The .npy file to write ([positions, vocab] float32, C order).
        #[arg(long, required_unless_present = "top")]
        out: Option<PathBuf>,
        /// Print the top K ids and log-probabilities of every position as JSON on stdout.
        #[arg(long)]
        top: Option<usize>,
    },
    /// Perplexity of a text, llama.cpp style (chunks of --ctx tokens, the second half of each
    /// scored), and KL divergence against a saved base run (docs/perplexity.md).
    Perplexity {
        #[command(flatten)]
        model: ModelArgs,
        /// The text (UTF-8), tokenized as plain text (no special tokens).
        #[arg(short, long)]
        file: PathBuf,
        /// Tokens per chunk; the first half is context, the rest is scored (default 512, or
        /// the base's with --kl-base).
        #[arg(short, long)]
        ctx: Option<usize>,
        /// Evaluate at most K chunks (default: every whole chunk of the text, or the base's).
        #[arg(long, value_name = "K")]
        chunks: Option<usize>,
        /// Write every scored token's log-probabilities (full float32 rows) to FILE, as the
        /// base of a later --kl-base run.
        #[arg(long, value_name = "FILE", conflicts_with = "kl_base")]
        save_logits: Option<PathBuf>,
        /// Compare with a base written by --save-logits (same vocabulary, text and context):
        /// KL divergence, top-1 agreement, PPL ratio and difference.
        #[arg(long, value_name = "FILE")]
        kl_base: Option<PathBuf>,
        /// The final report as one JSON object on stdout (no per-chunk lines).
        #[arg(long)]
        json: bool,
        /// Score each token with its own decode step (the path generation takes: int8
        /// activations under the default precision) instead of one prefill of the scored half.
        #[arg(long)]
        decode: bool,
        /// Print nothing on stderr but errors.
        #[arg(short, long)]
        quiet: bool,
    },
    /// Collect an importance matrix of the routed experts from a text with the engine on
    /// any backend (--backend cpu|cuda|rocm|auto; llama.cpp's legacy .dat format, for
    /// `ds4-convert --imatrix`).
    Imatrix {
        #[command(flatten)]
        model: ModelArgs,
        /// The text (UTF-8), tokenized as plain text (no special tokens).
        #[arg(short, long)]
        file: PathBuf,
        /// The .dat file to write.
        #[arg(short, long)]
        out: PathBuf,
        /// Tokens per chunk; each chunk starts from an empty state.
        #[arg(short, long, default_value_t = 512)]
        ctx: usize,
        /// Evaluate at most K chunks (default: every whole chunk of the text).
        #[arg(long, value_name = "K")]
        chunks: Option<usize>,
        /// Print nothing on stderr but errors.
        #[arg(short, long)]
        quiet: bool,
    },
    /// Print the token ids of a text (only the GGUF's vocabulary is read).
    Tokenize(ds4_cli::textcmd::TokenizeArgs),
    /// Print the exact text (bytes) of a list of token ids.
    Detokenize(ds4_cli::textcmd::DetokenizeArgs),
    /// Print the rendered prompt (or its ids) of an OpenAI-style message list.
    Render(ds4_cli::textcmd::RenderArgs),
    /// Download the published weights (q2, q4) or any file of a Hugging Face repository,
    /// resumably, checked against the repository's SHA-256.
    Pull(ds4_cli::pull::PullArgs),
}

/// ds4 spellings clap cannot express: `-sys` is `--system`; `--server` is refused.
fn args() -> Result<Vec<std::ffi::OsString>, String> {
    let mut out = Vec::new();
    for a in std::env::args_os() {
        if a == "--server" {
            return Err("ds4: --server is not a ds4 flag; use ds4-server".into());
        }
        out.push(if a == "-sys" { "--system".into() } else { a });
    }
    Ok(out)
}

fn main() -> ExitCode {
    let argv = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let cli = Cli::parse_from(argv);
    ds4_cli::logging::init(cli.verbose);
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", ds4_runtime::error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let Some(command) = cli.command else {
        return run_model(cli.run, cli.verbose);
    };
    match command {
        Command::Logits {
            model,
            tokens,
            prompt,
            decode_from,
            out,
            top,
        } => {
            let tokens = match (tokens, prompt) {
                (Some(t), _) => ds4_cli::textcmd::parse_ids(&t).context("--tokens")?,
                (None, Some(p)) => ds4_cli::textcmd::load_tokenizer(&model.model)?
                    .encode_chat(&p)
                    .context("tokenizing --prompt")?,
                (None, None) => anyhow::bail!("give --tokens IDS or --prompt TEXT"),
            };
            if tokens.is_empty() {
                anyhow::bail!("the token sequence is empty: nothing to evaluate");
            }
            let decode_from = decode_from.unwrap_or(tokens.len());
            if decode_from > tokens.len() {
                anyhow::bail!(
                    "--decode-from {decode_from} is past the end of the {} tokens",
                    tokens.len()
                );
            }
            // Checked before loading: a bad id should not cost a load of the real model.
            let n_vocab = {
                let f = ds4_cli::load::open_gguf(&model.model)?;
                ds4_model::ModelSpec::from_header(f.header(), Strictness::Auto)
                    .with_context(|| format!("{} is not a valid model", model.model.display()))?
                    .hparams
                    .n_vocab
            };
            if let Some((i, t)) = tokens
                .iter()
                .enumerate()
                .find(|(_, &t)| t as usize >= n_vocab)
            {
                anyhow::bail!(
                    "token {t} (entry {}) is outside the model's vocabulary of {n_vocab}",
                    i + 1
                );
            }
            let opts = model.load_options(tokens.len(), LoadReport::Quiet)?;
            let mut loaded = ds4_cli::load::load(&opts, &mut std::io::stderr())?;
            let logits = ds4_cli::logits::compute(&mut loaded.engine, &tokens, decode_from)?;
            if let Some(path) = &out {
                ds4_cli::logits::save_npy_f32(path, tokens.len(), n_vocab, &logits)?;
                eprintln!(
                    "ds4: wrote {} x {n_vocab} float32 logits to {} ({decode_from} prefilled, {} decoded)",
                    tokens.len(),
                    path.display(),
                    tokens.len() - decode_from
                );
            }
            if let Some(k) = top {
                let rows = ds4_cli::logits::top_k(&logits, n_vocab, &tokens, decode_from, k);
                println!("{}", serde_json::to_string(&rows)?);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Perplexity {
            model,
            file,
            ctx,
            chunks,
            save_logits,
            kl_base,
            json,
            decode,
            quiet,
        } => {
            let req = ds4_cli::perplexity::Request {
                file,
                ctx,
                chunks,
                save_logits,
                kl_base,
                json,
                decode,
            };
            let report = load_report(quiet, cli.verbose);
            let opts = model.load_options(0, report)?;
            let (mut sink, mut stderr) = (std::io::sink(), std::io::stderr());
            let log: &mut dyn std::io::Write = if quiet { &mut sink } else { &mut stderr };
            ds4_cli::perplexity::run(&req, &opts, &mut std::io::stdout().lock(), log)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Imatrix {
            model,
            file,
            out,
            ctx,
            chunks,
            quiet,
        } => {
            let req = ds4_cli::imatrix::Request {
                file,
                out: out.clone(),
                ctx,
                chunks,
            };
            let report = load_report(quiet, cli.verbose);
            let opts = model.load_options(ctx, report)?;
            let (mut sink, mut stderr) = (std::io::sink(), std::io::stderr());
            let log: &mut dyn std::io::Write = if quiet { &mut sink } else { &mut stderr };
            let (n, entries) = ds4_cli::imatrix::run(&req, &opts, log)?;
            println!(
                "{}: {entries} entries from {n} chunks of {ctx} tokens",
                out.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Tokenize(a) => {
            ds4_cli::textcmd::run_tokenize(&a, &mut std::io::stdout().lock())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Detokenize(a) => {
            ds4_cli::textcmd::run_detokenize(&a, &mut std::io::stdout().lock())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Render(a) => {
            ds4_cli::textcmd::run_render(&a, &mut std::io::stdout().lock())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Pull(a) => {
            ds4_cli::pull::run(&a)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Vectors {
            dir,
            model,
            ctx,
            counts_only,
            only,
            skip,
            min_overlap,
            max_top5_delta,
            json,
        } => {
            if min_overlap > ds4_cli::vectors::TOP {
                anyhow::bail!(
                    "--min-overlap {min_overlap} exceeds the list size {}",
                    ds4_cli::vectors::TOP
                );
            }
            if !(max_top5_delta >= 0.0 && max_top5_delta.is_finite()) {
                anyhow::bail!("--max-top5-delta must be a finite value >= 0");
            }
            let args = ds4_cli::vectors::VectorsRun {
                dir,
                // A parity check compares against references: always the f32 path.
                load: LoadOptions {
                    config: Config::resolve(
                        ConfigFlags {
                            quality: true,
                            no_warmup: model.no_warmup,
                            ..ConfigFlags::default()
                        },
                        |k| std::env::var(k).ok(),
                    )
                    .context("invalid setting")?,
                    ..model.load_options(ctx, LoadReport::Quiet)?
                },
                counts_only,
                thresholds: ds4_cli::vectors::Thresholds {
                    min_overlap,
                    max_top5_delta,
                },
                only,
                skip,
            };
            let report = match ds4_cli::vectors::run(&args, &mut std::io::stderr()) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("error: {}", ds4_runtime::error_chain(e.as_ref()));
                    return Ok(ExitCode::from(2));
                }
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", ds4_cli::vectors::render(&report));
            }
            Ok(if report.pass {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Command::Plan {
            model,
            synthetic,
            mtp,
            ctx,
            prefill_chunk,
            machine,
            backend,
            placement,
            json,
            help_overrides,
        } => {
            if help_overrides {
                print!("{}", ds4_placement::override_table_markdown());
                return Ok(ExitCode::SUCCESS);
            }
            use ds4_cli::plan::{PlanArgs, Source};
            let source = match (model, synthetic) {
                (Some(p), _) => Source::File(p),
                (None, Some(l)) => Source::Synthetic(l.recipe()),
                (None, None) => anyhow::bail!("give -m MODEL or --synthetic q2|q4|mxfp4"),
            };
            let args = PlanArgs {
                source,
                mtp,
                ctx,
                kv_states: 1,
                prefill_chunk,
                device: if machine.is_none() {
                    ds4_cli::load::probe_device(backend, LoadReport::Quiet)?.plan_device()
                } else {
                    None
                },
                machine,
                overrides: placement.to_overrides(),
            };
            let planned = ds4_cli::plan::run(&args, |k| std::env::var(k).ok())?;
            match planned.result {
                Ok(plan) => {
                    if json {
                        println!("{}", plan.to_json());
                    } else {
                        println!("plan for {}\n", planned.description);
                        print!("{}", plan.render_text());
                    }
                    Ok(ExitCode::SUCCESS)
                }
                Err(refusal) => {
                    if json {
                        println!("{}", refusal.to_json());
                    } else {
                        println!("plan for {}\n", planned.description);
                        println!("REFUSED: {refusal}");
                    }
                    Ok(ExitCode::from(3))
                }
            }
        }
        Command::Inspect { file, json, rules } => {
            let strictness = match rules {
                Rules::Auto => Strictness::Auto,
                Rules::Ds4 => Strictness::Ds4,
                Rules::Layout => Strictness::Layout,
            };
            let report = ds4_cli::inspect::inspect(&file, strictness)
                .with_context(|| format!("cannot read {}", file.display()))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", ds4_cli::inspect::render(&report));
            }
            Ok(if report.verdict.valid {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(2)
            })
        }
    }
}

fn default_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    (t ^ (u64::from(std::process::id()) << 32)).max(1)
}

/// `~/.ds4_history` unless `DS4_HISTORY` names another file (empty: no history).
fn history_file() -> Option<PathBuf> {
    match std::env::var_os("DS4_HISTORY") {
        Some(v) if v.is_empty() => None,
        Some(v) => Some(PathBuf::from(v)),
        None => std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".ds4_history")),
    }
}

/// One-shot generation or the interactive chat.
/// How much of the load a command prints: nothing with `--quiet`, everything at `-v`, the
/// summary otherwise.
fn load_report(quiet: bool, verbose: u8) -> LoadReport {
    if quiet {
        LoadReport::Quiet
    } else if verbose > 0 {
        LoadReport::Full
    } else {
        LoadReport::Summary
    }
}

fn run_model(mut a: RunArgs, verbose: u8) -> anyhow::Result<ExitCode> {
    a.model.draft = a.draft;
    if a.print_config {
        let config = a.model.config()?;
        let placement = ds4_placement::resolve_overrides(&a.model.placement.to_overrides(), |k| {
            std::env::var(k).ok()
        })
        .context("invalid placement override")?;
        print!("{}", config.render(&placement));
        return Ok(ExitCode::SUCCESS);
    }
    if a.tokens == 0 {
        anyhow::bail!("-n/--tokens must be at least 1");
    }
    if a.ctx == 0 {
        anyhow::bail!("-c/--ctx must be at least 1");
    }
    if !(0.0..=100.0).contains(&a.temp) {
        anyhow::bail!("--temp must be in 0..100");
    }
    let prompt = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => Some(p.clone()),
        (None, Some(f)) => Some(
            std::fs::read_to_string(f)
                .with_context(|| format!("cannot read the prompt file {}", f.display()))?,
        ),
        (None, None) => None,
    };
    let thinking = if a.think.nothink {
        ThinkingMode::NoThink
    } else if a.think.think_max {
        ThinkingMode::ThinkMax
    } else {
        ThinkingMode::Think
    };
    let sampler = SamplerConfig {
        temperature: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        seed: a.seed.unwrap_or_else(default_seed),
        ..SamplerConfig::default()
    };
    ds4_engine::Sampler::new(sampler.clone()).context("invalid sampling flags")?;
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    let settings = GenSettings {
        draft: a.model.config()?.draft_config(),
        system: Some(a.system.clone()),
        thinking,
        sampler,
        max_tokens: a.tokens,
        ignore_eos: a.ignore_eos,
        color: std::io::stdout().is_terminal() && !no_color,
        terminal: std::io::stdout().is_terminal(),
        progress: std::io::stderr().is_terminal(),
    };
    let report = load_report(a.quiet, verbose);
    let load_opts = a.model.load_options(a.ctx, report)?;
    let intr = Interrupts::install()?;
    let loaded = ds4_cli::load::load(&load_opts, &mut std::io::stderr())?;
    if let Some(p) = prompt {
        // -q: the answer alone (errors still reach stderr through the return value).
        let (mut stderr, mut sink) = (std::io::stderr(), std::io::sink());
        let log: &mut dyn std::io::Write = if a.quiet { &mut sink } else { &mut stderr };
        let end =
            ds4_cli::generate::one_shot(loaded, &p, &settings, &intr, &mut std::io::stdout(), log)?;
        return Ok(match end.end {
            OneShotEnd::Done => ExitCode::SUCCESS,
            OneShotEnd::Interrupted => ExitCode::from(130),
        });
    }
    let opts = ds4_cli::repl::ReplOptions {
        settings,
        kv_dir: a.kv_disk_dir,
        kv_budget_bytes: a.kv_disk_space_mb.saturating_mul(1 << 20),
        history: history_file(),
        load: load_opts,
    };
    if a.kv_disk_space_mb == 0 {
        anyhow::bail!("--kv-disk-space-mb must be at least 1");
    }
    if std::io::stdin().is_terminal() {
        let mut src = ds4_cli::repl::EditorSource::new(opts.history.clone())?;
        ds4_cli::repl::run(loaded, opts, &mut src, &intr)?;
    } else {
        let stdin = std::io::stdin();
        let mut src = ds4_cli::repl::PipeSource::new(stdin.lock());
        ds4_cli::repl::run(loaded, opts, &mut src, &intr)?;
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// `--help` explains every argument a user can pass.
    #[test]
    fn every_argument_has_help_text() {
        let missing = ds4_runtime::cli_help::undocumented_arguments(&Cli::command());
        assert!(missing.is_empty(), "arguments without help: {missing:?}");
    }
}
