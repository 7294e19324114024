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

#[derive(Subcommand)]
enum Command {
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
