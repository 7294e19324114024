//! `ds4-convert`: HF checkpoint → ds4 GGUF, vocabulary-only GGUF, synthetic models.

use std::fs::File;
use std::io::BufWriter;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use ds4_convert::synthetic::SyntheticModel;
use ds4_convert::{tokenizer, vocab, HfOptions, Progress};
use ds4_gguf::GgufFile;
use ds4_model::layout::TypeRecipe;
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Parser)]
#[command(
    name = "ds4-convert",
    version,
    about = "Make ds4-layout DeepSeek V4 GGUF files"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// No progress bar.
    #[arg(long, global = true)]
    quiet: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum Types {
    F32,
    Q2,
    Q4,
    Mxfp4,
}

impl Types {
    /// The recipe name `HfOptions::new` takes.
    fn recipe(self) -> &'static str {
        match self {
            Types::F32 => "f32",
            Types::Q2 => "q2",
            Types::Q4 => "q4",
            Types::Mxfp4 => "mxfp4",
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum Layout {
    Q2,
    Q4,
    Mxfp4,
}

#[derive(Subcommand)]
enum Cmd {
    /// Convert a checkpoint directory (config.json + *.safetensors, sharded with an index or
    /// not) to a GGUF: transformers' F32/BF16/F16 saves and DeepSeek's official FP8/FP4
    /// release alike (FP8 E4M3 / FP4 E2M1 weights with E8M0 `.scale` tensors are detected per
    /// tensor and decoded exactly). `official` is the same command.
    #[command(visible_alias = "official")]
    Hf {
        /// The checkpoint directory (config.json and *.safetensors).
        dir: PathBuf,
        /// The GGUF to write (written under a temporary name and renamed when complete).
        #[arg(required_unless_present = "dry_run")]
        out: Option<PathBuf>,
        /// Print the exact output size of every layout (q2, q4, mxfp4, f32; the MTP sidecar
        /// too) from the checkpoint's headers, after the same checks as a conversion, and
        /// write nothing. Reads no tensor data.
        #[arg(long)]
        dry_run: bool,
        /// f32 keeps everything F32 (oracle parity); q2/q4 apply ds4's recipes; mxfp4 puts
        /// the routed experts in MXFP4 (the rest as q2/q4).
        #[arg(long, value_enum, default_value = "f32")]
        types: Types,
        /// Embed this HF tokenizer.json instead of a generated vocabulary.
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        /// general.name of the output.
        #[arg(long)]
        name: Option<String>,
        /// Where to write the MTP sidecar (ds4's `--mtp` file) when the checkpoint has an MTP
        /// block (`mtp.*`, the official release); default: OUT with `.gguf` → `-mtp.gguf`.
        #[arg(long, conflicts_with = "no_mtp")]
        mtp: Option<PathBuf>,
        /// Do not write the MTP sidecar even when the checkpoint has an MTP block.
        #[arg(long)]
        no_mtp: bool,
        /// Weight the routed experts' q2/q4 quantization with this importance matrix
        /// (llama.cpp's legacy .dat format, one vector per expert; every routed tensor needs
        /// an entry).
        #[arg(long)]
        imatrix: Option<PathBuf>,
    },
    /// Re-encode a ds4-layout GGUF (normally an f32 one) with the q2 or q4 recipe, optionally
    /// weighted by an importance matrix (e.g. from `ds4 imatrix`).
    Requant {
        /// The GGUF to read.
        input: PathBuf,
        /// The GGUF to write (through OUT.partial).
        out: PathBuf,
        /// The recipe.
        #[arg(long, value_enum)]
        types: Types,
        /// Weight the routed experts' quantization with this importance matrix (.dat).
        #[arg(long)]
        imatrix: Option<PathBuf>,
        /// general.name of the output (default: the input's).
        #[arg(long)]
        name: Option<String>,
    },
    /// Write a vocabulary-only GGUF (general.* + tokenizer.ggml.*, no tensors).
    Vocab {
        /// The HF tokenizer.json to take the vocabulary from.
        #[arg(long)]
        tokenizer: PathBuf,
        /// The GGUF to write.
        out: PathBuf,
        /// general.name of the output.
        #[arg(long, default_value = "DeepSeek V4 vocabulary")]
        name: String,
    },
    /// Random weights in the exact real layout (benchmarks at real shapes).
    Synthetic {
        /// The type recipe: q2 (the published q2 file's types), q4, or mxfp4 (native MXFP4
        /// routed experts).
        #[arg(long, value_enum)]
        layout: Layout,
        /// Layers (43 = the real model; fewer for a smaller file with the same shapes).
        #[arg(long, default_value_t = 43)]
        layers: usize,
        /// Seed of the random weights (the same seed writes the same bytes).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Print the exact file size and write nothing.
        #[arg(long)]
        dry_run: bool,
        /// Leave the routed-expert tensors as holes (a sparse file that reads back zeros
        /// there, valid blocks): the full-size q2 file then takes ~4 GB of disk.
        #[arg(long)]
        sparse_experts: bool,
        /// Zipf-like router skew S >= 0 (0: every expert equally likely): each layer
        /// favours its experts of low (random) rank r, the top-k bias lowered by
        /// S·ln(1+r) and hash-layer experts drawn ∝ 1/(1+r)^S (synthetic.rs "Router skew").
        #[arg(long, default_value_t = 0.0)]
        router_skew: f32,
        /// Embed this HF tokenizer.json.
        #[arg(long, conflicts_with = "vocab_gguf")]
        tokenizer: Option<PathBuf>,
        /// Take tokenizer.ggml.* from this GGUF (e.g. the vocabulary-only fixture).
        #[arg(long)]
        vocab_gguf: Option<PathBuf>,
        /// Also write a synthetic MTP block to this file (ds4's sidecar layout, for `ds4
        /// --draft mtp --mtp FILE`; random weights, so its drafts are mostly rejected).
        #[arg(long, value_name = "FILE")]
        mtp: Option<PathBuf>,
        /// The GGUF to write (required unless --dry-run).
        out: Option<PathBuf>,
    },
    /// The tiny random-weight demo model (tests/fixtures/demo/ds4-demo.gguf) for a vocabulary.
    Demo {
        /// Take tokenizer.ggml.* from this GGUF (the vocabulary-only fixture).
        #[arg(long)]
        vocab_gguf: PathBuf,
        /// The GGUF to write.
        out: PathBuf,
    },
}

struct Bar(Option<ProgressBar>);

impl Bar {
    fn new(quiet: bool) -> Bar {
        Bar((!quiet).then(ProgressBar::hidden))
    }
}

impl Progress for Bar {
    fn start(&mut self, total: u64) {
        if let Some(b) = &mut self.0 {
            *b = ProgressBar::new(total);
            b.set_style(
                ProgressStyle::with_template(
                    "{elapsed_precise} [{wide_bar}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta} {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
        }
    }
    fn tensor(&mut self, name: &str) {
        if let Some(b) = &self.0 {
            b.set_message(name.to_string());
        }
    }
    fn advance(&mut self, bytes: u64) {
        if let Some(b) = &self.0 {
            b.inc(bytes);
        }
    }
    fn finish(&mut self) {
        if let Some(b) = &self.0 {
            b.finish_and_clear();
        }
    }
}

/// `VmHWM` of this process from /proc (Linux), e.g. "123.4 MiB", or "unknown". It includes the
/// checkpoint pages the kernel keeps mapped after they were read (reclaimable page cache, not
/// the converter's own allocations: those are the "largest f32 buffer").
fn peak_rss() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().strip_suffix("kB"))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .map_or_else(
            || "unknown".to_string(),
            |kb| format!("{:.1} MiB", kb as f64 / 1024.0),
        )
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let t0 = Instant::now();
    match cli.cmd {
        Cmd::Hf {
            dir,
            out,
            types,
            tokenizer,
            name,
            mtp,
            no_mtp,
            imatrix,
            dry_run,
        } => {
            let mut opts = HfOptions::new(types.recipe()).context("unknown recipe")?;
            opts.tokenizer = tokenizer;
            opts.name = name;
            opts.mtp_out = mtp;
            opts.skip_mtp = no_mtp;
            if let Some(p) = imatrix {
                let im = ds4_convert::imatrix::Imatrix::read(&p)?;
                opts.imatrix = Some((p, std::sync::Arc::new(im)));
            }
            if dry_run {
                let sizes = ds4_convert::dry_run(&dir, &opts)
                    .with_context(|| format!("planning {}", dir.display()))?;
                println!(
                    "{}: exact output sizes (headers only, nothing written)",
                    dir.display()
                );
                let mine = types.recipe();
                for (recipe, r) in &sizes {
                    let mark = if *recipe == mine { "  <- --types" } else { "" };
                    match r {
                        Ok(s) => {
                            let mtp = s.mtp_bytes.map_or_else(String::new, |b| {
                                format!("; MTP sidecar {b} bytes ({:.2} GiB)", gib(b))
                            });
                            println!(
                                "{recipe:<6} {} bytes ({:.2} GiB), tensor data {} bytes{mtp}{mark}",
                                s.file_bytes,
                                gib(s.file_bytes),
                                s.tensor_bytes,
                            );
                        }
                        Err(e) => {
                            println!("{recipe:<6} cannot be made from this checkpoint: {e}{mark}")
                        }
                    }
                }
                return Ok(());
            }
            let Some(out) = out else {
                bail!("an output path is required unless --dry-run is given");
            };
            let r = ds4_convert::convert_hf(&dir, &out, &opts, &mut Bar::new(cli.quiet))
                .with_context(|| format!("converting {}", dir.display()))?;
            let secs = t0.elapsed().as_secs_f64();
            println!(
                "{}: {} tensors, {} bytes ({:.3} GiB), {:?} naming, {:.1} s ({:.2} GB/s written); \
                 largest f32 buffer {:.1} MiB, peak RSS {}",
                out.display(),
                r.tensors,
                r.bytes,
                gib(r.bytes),
                r.scheme,
                secs,
                r.bytes as f64 / secs.max(1e-9) / 1e9,
                r.peak_f32_bytes as f64 / (1u64 << 20) as f64,
                peak_rss()
            );
            if let Some((path, bytes, tensors)) = &r.mtp {
                println!(
                    "{}: MTP sidecar, {tensors} tensors, {bytes} bytes (use with ds4 --mtp)",
                    path.display()
                );
            }
            if !r.skipped.is_empty() {
                println!(
                    "left out {} MTP tensors (mtp.*, --no-mtp): no sidecar written",
                    r.skipped.len()
                );
            }
        }
        Cmd::Requant {
            input,
            out,
            types,
            imatrix,
            name,
        } => {
            let mut opts = HfOptions::new(types.recipe()).context("unknown recipe")?;
            opts.name = name;
            if let Some(p) = imatrix {
                let im = ds4_convert::imatrix::Imatrix::read(&p)?;
                opts.imatrix = Some((p, std::sync::Arc::new(im)));
            }
            let bytes =
                ds4_convert::requant::requantize(&input, &out, &opts, &mut Bar::new(cli.quiet))
                    .with_context(|| format!("re-encoding {}", input.display()))?;
            println!(
                "{}: {bytes} bytes, {:.1} s",
                out.display(),
                t0.elapsed().as_secs_f64()
            );
        }
        Cmd::Vocab {
            tokenizer,
            out,
            name,
        } => {
            let bytes = vocab::write_vocab(&tokenizer, &out, &name)
                .with_context(|| format!("writing {}", out.display()))?;
            let f = GgufFile::open(&out)?;
            let count = |k: &str| {
                f.header()
                    .get(k)
                    .and_then(|v| v.as_array())
                    .map_or(0, |a| a.len())
            };
            println!(
                "{}: {bytes} bytes, {} tokens, {} merges",
                out.display(),
                count("tokenizer.ggml.tokens"),
                count("tokenizer.ggml.merges")
            );
        }
        Cmd::Synthetic {
            layout,
            layers,
            seed,
            dry_run,
            sparse_experts,
            router_skew,
            tokenizer,
            vocab_gguf,
            mtp,
            out,
        } => {
            let recipe = match layout {
                Layout::Q2 => TypeRecipe::Q2,
                Layout::Q4 => TypeRecipe::Q4,
                Layout::Mxfp4 => TypeRecipe::MXFP4,
            };
            let n_vocab = ds4_model::HParams::flash().n_vocab;
            let tok = match (tokenizer, vocab_gguf) {
                (Some(p), _) => Some(tokenizer::from_hf_json(&p, n_vocab)?),
                (None, Some(p)) => {
                    let f =
                        GgufFile::open(&p).with_context(|| format!("opening {}", p.display()))?;
                    Some(tokenizer::from_gguf(&p, f.header())?)
                }
                (None, None) => None,
            };
            let model = match &tok {
                Some(t) => SyntheticModel::with_tokenizer(recipe, layers, seed, t)?,
                None => SyntheticModel::new(recipe, layers, seed)?,
            };
            let model = model.with_router_skew(router_skew)?;
            let size = model.file_size();
            let head = ds4_gguf::encode_header(model.header())?.len();
            println!(
                "{} tensors, {} KVs, header {head} bytes, data at {}, file {} bytes ({:.2} GiB)",
                model.header().tensors.len(),
                model.header().metadata.len(),
                model.data_offset(),
                size,
                gib(size)
            );
            if dry_run {
                return Ok(());
            }
            let Some(out) = out else {
                bail!("an output path is required unless --dry-run is given");
            };
            if let Some(path) = &mtp {
                let side = model.mtp_sidecar()?;
                let bytes = write_model(&side, path, cli.quiet)?;
                println!("{}: synthetic MTP block, {bytes} bytes", path.display());
            }
            if sparse_experts {
                let tmp = PathBuf::from(format!("{}.partial", out.display()));
                let f =
                    File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
                let written = model.write_sparse_experts(&f, &tmp, &mut Bar::new(cli.quiet))?;
                f.sync_all()?;
                drop(f);
                std::fs::rename(&tmp, &out)?;
                println!(
                    "wrote {} ({} bytes, {:.2} GiB apparent; {:.2} GiB written, experts left as holes)",
                    out.display(),
                    size,
                    gib(size),
                    gib(written)
                );
                return Ok(());
            }
            let bytes = write_model(&model, &out, cli.quiet)?;
            println!(
                "{}: {bytes} bytes written in {:.1} s",
                out.display(),
                t0.elapsed().as_secs_f64()
            );
        }
        Cmd::Demo { vocab_gguf, out } => {
            let f = GgufFile::open(&vocab_gguf)
                .with_context(|| format!("opening {}", vocab_gguf.display()))?;
            let tok = tokenizer::from_gguf(&vocab_gguf, f.header())?;
            let model = ds4_convert::demo::demo_model(&tok)?;
            let bytes = write_model(&model, &out, cli.quiet)?;
            println!(
                "{}: demo model, {} tensors, {bytes} bytes, {} tokens in the vocabulary",
                out.display(),
                model.header().tensors.len(),
                tok.tokens.len()
            );
        }
    }
    Ok(())
}

/// Streams `model` to `out` through a `.partial` file renamed at the end, so an interrupted
/// run never leaves a truncated file under the final name. Returns the bytes written.
fn write_model(model: &SyntheticModel, out: &std::path::Path, quiet: bool) -> Result<u64> {
    let size = model.file_size();
    let tmp = PathBuf::from(format!("{}.partial", out.display()));
    let f = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let (w, bytes) = model.write_to(BufWriter::with_capacity(8 << 20, f), &mut Bar::new(quiet))?;
    let f = w.into_inner().map_err(|e| e.into_error())?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, out)?;
    if bytes != size {
        bail!("wrote {bytes} bytes but the planned size is {size}");
    }
    Ok(bytes)
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
