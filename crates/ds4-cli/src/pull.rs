//! `ds4 pull`: fetch the published weights (or any file of a Hugging Face repository) into a
//! models directory, with the downloading itself in `ds4-pull`. This module maps the short
//! names to files, picks the directory and the token, and draws the progress.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use ds4_pull::{NoProgress, Options, Phase, Progress, Source, SystemFreeSpace, DEFAULT_ENDPOINT};

/// The published GGUFs `ds4 pull NAME` knows. The file names are those of the download
/// script of the ds4 project that publishes them (`download_model.sh`, targets `q2-imatrix`
/// and `q4-imatrix`, the ones it recommends); for any other file use `--hf REPO/FILE`.
/// [`Published::location`] is this table in code.
///
/// | name | repository | file | size |
/// |---|---|---|---|
/// | q2 | antirez/deepseek-v4-gguf | DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix.gguf | about 81 GB |
/// | q4 | antirez/deepseek-v4-gguf | DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2-imatrix.gguf | about 153 GB |
pub const DS4_REPO: &str = "antirez/deepseek-v4-gguf";

/// A published model by its short name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Published {
    /// 2-bit routed experts (IQ2_XXS gate/up, Q2_K down), about 81 GB: for 96–128 GB of memory.
    Q2,
    /// 4-bit routed experts (Q4_K), about 153 GB: for 256 GB of memory or more.
    Q4,
}

impl Published {
    /// Repository and file of this model.
    pub fn location(self) -> (&'static str, &'static str) {
        match self {
            Published::Q2 => (
                DS4_REPO,
                "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix.gguf",
            ),
            Published::Q4 => (
                DS4_REPO,
                "DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2-imatrix.gguf",
            ),
        }
    }
}

/// Arguments of `ds4 pull`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = "\
The file goes to DIR/FILE.part first and gets its final name only once its SHA-256 matches \
the repository's; running the same command again resumes an interrupted download.\n\n\
Default directory: $XDG_DATA_HOME/ds4/models, else ~/.local/share/ds4/models.\n\
Token: --token, else HF_TOKEN, else the file `huggingface-cli login` writes \
($HF_TOKEN_PATH, else $HF_HOME/token, else ~/.cache/huggingface/token).")]
pub struct PullArgs {
    /// A published model: q2 (about 81 GB) or q4 (about 153 GB).
    #[arg(value_enum, required_unless_present = "hf", conflicts_with = "hf")]
    pub model: Option<Published>,
    /// Any file instead: OWNER/REPO/PATH/OF/FILE.
    #[arg(long, value_name = "REPO/FILE")]
    pub hf: Option<String>,
    /// Directory to download into (see below for the default).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Branch, tag or commit of the repository.
    #[arg(long, default_value = "main")]
    pub revision: String,
    /// Hugging Face token, sent as Bearer auth to the hub (private or gated repositories).
    #[arg(long)]
    pub token: Option<String>,
    /// Base URL of the hub [default: $HF_ENDPOINT, else https://huggingface.co].
    #[arg(long)]
    pub endpoint: Option<String>,
    /// Retries in a row of a transfer that breaks off without progress.
    #[arg(long, default_value_t = 8)]
    pub retries: u32,
    /// Print nothing but errors and, on stdout, the final path.
    #[arg(short, long)]
    pub quiet: bool,
}

/// Runs `ds4 pull`: downloads, then prints the path on stdout and the next command on stderr.
pub fn run(args: &PullArgs) -> anyhow::Result<()> {
    let (repo, file) = match (&args.hf, args.model) {
        (Some(spec), _) => Source::split_repo_file(spec)?,
        (None, Some(m)) => {
            let (r, f) = m.location();
            (r.to_string(), f.to_string())
        }
        (None, None) => anyhow::bail!("give a model name (q2 or q4) or --hf REPO/FILE"),
    };
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let endpoint = args
        .endpoint
        .clone()
        .or_else(|| env("HF_ENDPOINT"))
        .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
    let source = Source::new(&endpoint, &repo, &args.revision, &file)?;
    let dir = match &args.dir {
        Some(d) => d.clone(),
        None => default_dir(env("XDG_DATA_HOME"), env("HOME")).context(
            "no default models directory: neither XDG_DATA_HOME nor HOME is set; give --dir DIR",
        )?,
    };
    let token = match args.token.clone().or_else(|| env("HF_TOKEN")) {
        Some(t) => Some(t),
        None => token_file(env("HF_TOKEN_PATH"), env("HF_HOME"), env("HOME")).and_then(read_token),
    };
    let opts = Options {
        token,
        retries: args.retries,
        ..Options::default()
    };

    if !args.quiet {
        eprintln!(
            "ds4 pull: {file}\n  from {}/{repo} (revision {})\n  into {}",
            source.endpoint,
            args.revision,
            dir.display()
        );
    }
    let mut bar;
    let mut lines;
    let mut none = NoProgress;
    let progress: &mut dyn Progress = if args.quiet {
        &mut none
    } else if std::io::stderr().is_terminal() {
        bar = Bar::default();
        &mut bar
    } else {
        lines = Lines::default();
        &mut lines
    };
    let got = ds4_pull::pull(&source, &dir, &opts, &SystemFreeSpace, progress)?;

    if !args.quiet {
        let how = match (&got.sha256, got.already_present) {
            (_, true) => "already downloaded (size matches; not re-hashed)".to_string(),
            (Some(s), false) => format!("SHA-256 {s} verified"),
            (None, false) => "the hub gives no SHA-256 for this file: not verified".to_string(),
        };
        eprintln!(
            "ds4 pull: {} ({} bytes, {how})\nnext: ds4 -m {}",
            got.path.display(),
            got.size,
            shell_quote(&got.path)
        );
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", got.path.display())?;
    Ok(())
}

/// `$XDG_DATA_HOME/ds4/models`, else `$HOME/.local/share/ds4/models` (the XDG default): the
/// weights are data, not cache — nothing should delete 81 GB to reclaim space unasked.
pub fn default_dir(xdg_data_home: Option<String>, home: Option<String>) -> Option<PathBuf> {
    match (xdg_data_home, home) {
        (Some(x), _) if Path::new(&x).is_absolute() => Some(PathBuf::from(x).join("ds4/models")),
        (_, Some(h)) => Some(PathBuf::from(h).join(".local/share/ds4/models")),
        _ => None,
    }
}

/// Where huggingface_hub's `login` stores the token.
pub fn token_file(
    hf_token_path: Option<String>,
    hf_home: Option<String>,
    home: Option<String>,
) -> Option<PathBuf> {
    hf_token_path
        .map(PathBuf::from)
        .or_else(|| hf_home.map(|h| PathBuf::from(h).join("token")))
        .or_else(|| home.map(|h| PathBuf::from(h).join(".cache/huggingface/token")))
}

fn read_token(path: PathBuf) -> Option<String> {
    let t = std::fs::read_to_string(path).ok()?;
    let t = t.trim();
    (!t.is_empty()).then(|| t.to_string())
}

/// The path as one shell word (single quotes when it needs any).
fn shell_quote(p: &Path) -> String {
    let s = p.display().to_string();
    if s.chars()
        .all(|c| c.is_ascii_alphanumeric() || "/._-+:@%,".contains(c))
    {
        s
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// An indicatif bar on a terminal: bytes, GB/s, ETA.
#[derive(Default)]
struct Bar(Option<indicatif::ProgressBar>);

impl Progress for Bar {
    fn begin(&mut self, phase: Phase, total: u64, done: u64) {
        let pb = indicatif::ProgressBar::with_draw_target(
            Some(total),
            indicatif::ProgressDrawTarget::stderr(),
        );
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{msg:>11} [{bar:32}] {decimal_bytes}/{decimal_total_bytes} \
             {decimal_bytes_per_sec} ETA {eta}",
        ) {
            pb.set_style(style.progress_chars("=> "));
        }
        pb.set_message(match phase {
            Phase::Rehash => "checking",
            Phase::Download => "downloading",
        });
        pb.set_position(done);
        pb.reset_eta();
        self.0 = Some(pb);
    }
    fn advance(&mut self, n: u64) {
        if let Some(pb) = &self.0 {
            pb.inc(n);
        }
    }
    fn note(&mut self, msg: &str) {
        match &self.0 {
            Some(pb) => pb.println(format!("ds4 pull: {msg}")),
            None => eprintln!("ds4 pull: {msg}"),
        }
    }
    fn end(&mut self) {
        if let Some(pb) = self.0.take() {
            pb.finish();
        }
    }
}

/// Without a terminal (a log file, CI): one line every 5 %.
#[derive(Default)]
struct Lines {
    phase: Option<Phase>,
    total: u64,
    pos: u64,
    start_pos: u64,
    next_pct: u64,
    started: Option<Instant>,
}

impl Progress for Lines {
    fn begin(&mut self, phase: Phase, total: u64, done: u64) {
        *self = Lines {
            phase: Some(phase),
            total,
            pos: done,
            start_pos: done,
            next_pct: pct(done, total) / 5 * 5 + 5,
            started: Some(Instant::now()),
        };
    }
    fn advance(&mut self, n: u64) {
        self.pos += n;
        let p = pct(self.pos, self.total);
        if p < self.next_pct {
            return;
        }
        self.next_pct = p / 5 * 5 + 5;
        let secs = self.started.map_or(0.0, |s| s.elapsed().as_secs_f64());
        let rate = (self.pos - self.start_pos) as f64 / secs.max(1e-9) / 1e9;
        let what = match self.phase {
            Some(Phase::Rehash) => "checked",
            _ => "downloaded",
        };
        eprintln!(
            "ds4 pull: {what} {p}% ({:.2} of {:.2} GB, {rate:.2} GB/s)",
            self.pos as f64 / 1e9,
            self.total as f64 / 1e9
        );
    }
    fn note(&mut self, msg: &str) {
        eprintln!("ds4 pull: {msg}");
    }
}

fn pct(pos: u64, total: u64) -> u64 {
    if total == 0 {
        100
    } else {
        (pos as u128 * 100 / total as u128) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_published_name_maps_to_a_gguf_in_the_ds4_repository() {
        for m in [Published::Q2, Published::Q4] {
            let (repo, file) = m.location();
            assert_eq!(repo, "antirez/deepseek-v4-gguf");
            assert!(file.starts_with("DeepSeek-V4-Flash-") && file.ends_with(".gguf"));
            Source::new(DEFAULT_ENDPOINT, repo, "main", file).unwrap();
        }
        assert_ne!(Published::Q2.location(), Published::Q4.location());
    }

    #[test]
    fn default_dir_prefers_xdg_data_home() {
        let s = |v: &str| Some(v.to_string());
        assert_eq!(
            default_dir(s("/x"), s("/h")),
            Some(PathBuf::from("/x/ds4/models"))
        );
        // A relative XDG_DATA_HOME is invalid per the spec and ignored.
        assert_eq!(
            default_dir(s("rel"), s("/h")),
            Some(PathBuf::from("/h/.local/share/ds4/models"))
        );
        assert_eq!(default_dir(None, None), None);
    }

    #[test]
    fn token_file_follows_huggingface_hub() {
        let s = |v: &str| Some(v.to_string());
        assert_eq!(
            token_file(s("/t"), s("/hf"), s("/h")),
            Some(PathBuf::from("/t"))
        );
        assert_eq!(
            token_file(None, s("/hf"), s("/h")),
            Some(PathBuf::from("/hf/token"))
        );
        assert_eq!(
            token_file(None, None, s("/h")),
            Some(PathBuf::from("/h/.cache/huggingface/token"))
        );
    }

    #[test]
    fn shell_quote_quotes_only_when_needed() {
        assert_eq!(shell_quote(Path::new("/a/b.gguf")), "/a/b.gguf");
        assert_eq!(shell_quote(Path::new("/a b/c")), "'/a b/c'");
        assert_eq!(shell_quote(Path::new("/it's")), "'/it'\\''s'");
    }

    #[test]
    fn lines_print_every_five_percent() {
        let mut l = Lines::default();
        l.begin(Phase::Download, 1000, 120);
        assert_eq!(l.next_pct, 15);
        l.advance(30);
        assert_eq!(l.next_pct, 20);
        l.advance(1);
        assert_eq!(l.next_pct, 20);
    }
}
