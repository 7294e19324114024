//! `ds4`: the user-facing command.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use ds4_model::Strictness;

#[derive(Parser)]
#[command(
    name = "ds4",
    version,
    about = "DeepSeek V4 Flash inference engine (ds4-rs)"
)]
struct Cli {
    /// More log output (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
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

/// Placement overrides shared by every command that loads a model. CLI > environment >
/// automatic; `ds4 plan --help-overrides` prints the whole table.
#[derive(clap::Args, Default)]
struct PlacementFlags {
    /// Where weights go: auto|device|host|managed.
    #[arg(long)]
    weights_mem: Option<String>,
    /// Where the KV state goes: auto|device|host|managed.
    #[arg(long)]
    kv_mem: Option<String>,
    /// Where scratch goes: auto|device|host|managed.
    #[arg(long)]
    scratch_mem: Option<String>,
    /// Host memory kept free for the OS, GiB (default 2).
    #[arg(long)]
    os_reserve_gib: Option<String>,
    /// Cap the device pool (GiB), to reproduce small-pool machines on big GPUs.
    #[arg(long)]
    device_mem_limit_gib: Option<String>,
}

impl PlacementFlags {
    fn to_overrides(&self) -> ds4_placement::CliOverrides {
        ds4_placement::CliOverrides {
            weights_mem: self.weights_mem.clone(),
            kv_mem: self.kv_mem.clone(),
            scratch_mem: self.scratch_mem.clone(),
            os_reserve_gib: self.os_reserve_gib.clone(),
            device_mem_limit_gib: self.device_mem_limit_gib.clone(),
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum SyntheticLayout {
    Q2,
    Q4,
}

#[derive(Subcommand)]
enum Command {
    /// Plan memory placement for a model (no GPU touched, no weights read); exits 3 on a refusal.
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
        #[command(flatten)]
        placement: PlacementFlags,
        #[arg(long)]
        json: bool,
        /// Print the table of placement flags and environment variables, then exit.
        #[arg(long)]
        help_overrides: bool,
    },
    /// Show a GGUF's metadata, tensor summary, validation verdict and byte accounting.
    Inspect {
        file: PathBuf,
        /// Machine-readable JSON on stdout.
        #[arg(long)]
        json: bool,
        #[arg(long, value_enum, default_value = "auto")]
        rules: Rules,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    ds4_cli::logging::init(cli.verbose);
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Plan {
            model,
            synthetic,
            mtp,
            ctx,
            prefill_chunk,
            machine,
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
                (None, Some(SyntheticLayout::Q2)) => {
                    Source::Synthetic(ds4_model::layout::TypeRecipe::Q2)
                }
                (None, Some(SyntheticLayout::Q4)) => {
                    Source::Synthetic(ds4_model::layout::TypeRecipe::Q4)
                }
                (None, None) => anyhow::bail!("give -m MODEL or --synthetic q2|q4"),
            };
            let args = PlanArgs {
                source,
                mtp,
                ctx,
                prefill_chunk,
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
