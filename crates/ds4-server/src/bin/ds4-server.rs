//! `ds4-server`: serve a ds4 GGUF over the OpenAI and Anthropic HTTP APIs.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use ds4_server::{DiskCacheConfig, LoadedModel, ModelOptions, Script, Server, ServerConfig};

#[derive(Parser, Debug)]
#[command(
    name = "ds4-server",
    version,
    about = "OpenAI- and Anthropic-compatible HTTP server for DeepSeek V4 Flash GGUFs"
)]
struct Args {
    /// Model GGUF.
    #[arg(short = 'm', long, default_value = "ds4flash.gguf")]
    model: PathBuf,
    /// The file holding the MTP block (`mtp.0.*`, ds4's sidecar; also DS4_MTP), as `ds4
    /// --mtp`: the drafter of `--draft mtp` (and of `auto`).
    #[arg(long, value_name = "FILE")]
    mtp: Option<PathBuf>,
    /// Speculative decoding, as `ds4 --draft`: mtp, lookup, auto or off (default off; also
    /// DS4_DRAFT). A slot that decodes alone drafts and verifies the drafts in one forward
    /// pass; the output is unchanged. A request may override it (`"draft"`).
    #[arg(long, value_parser = parse_draft)]
    draft: Option<ds4_runtime::DraftMode>,
    /// Most drafted tokens per step, 1 to 16 (default 3; also DS4_DRAFT_MAX). A request may
    /// override it (`"draft_max"`).
    #[arg(long)]
    draft_max: Option<usize>,
    /// The longest n-gram the lookup drafter matches (default 3; also DS4_DRAFT_NGRAM).
    #[arg(long)]
    draft_ngram: Option<usize>,
    /// Context size of each slot (allocated at startup).
    #[arg(short = 'c', long, default_value_t = 32768)]
    ctx: usize,
    /// Conversations served at once: N KV states of the whole context ("slots") on one
    /// engine, their tokens decoded together in batched steps (default 1, or DS4_PARALLEL).
    #[arg(long, value_name = "N")]
    parallel: Option<usize>,
    /// Most prompt tokens evaluated per scheduler step between two decode steps of the
    /// running streams (0 = the prefill chunk): smaller keeps streams smoother while a
    /// long prompt is evaluated, larger evaluates it faster.
    #[arg(long, default_value_t = 0, value_name = "TOKENS")]
    prefill_chunk_per_step: usize,
    /// Most output tokens a request may ask for (larger client limits are cut to it).
    #[arg(short = 'n', long = "tokens", default_value_t = 393_216)]
    tokens: usize,
    /// Output tokens of a request that sends no `max_tokens` (also bounded by -n and by
    /// the context left).
    #[arg(long, default_value_t = ds4_server::DEFAULT_MAX_TOKENS, value_name = "TOKENS")]
    default_max_tokens: usize,
    /// CPU threads (0 = one per core).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: usize,
    /// Backend: auto (CUDA when a device answers, then ROCm, then the CPU, saying why),
    /// cpu, cuda, rocm. GPU weights are placed by the same plan `ds4 plan` prints; the
    /// placement flags below (as in `ds4`) or their DS4_* variables override it.
    #[arg(long, value_enum, default_value_t = ds4_runtime::load::BackendChoice::Auto)]
    backend: ds4_runtime::load::BackendChoice,
    #[command(flatten)]
    placement: ds4_runtime::load::PlacementFlags,
    /// More log output (-v: the whole placement plan at load and info logs, -vv debug);
    /// RUST_LOG overrides the log level.
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Pedantic f32 prefill GEMM instead of the default fast TF32 path (CUDA; also
    /// DS4_QUALITY=1).
    #[arg(long)]
    quality: bool,
    /// Skip the warm-up at load (one prefill chunk and a decode step on a GPU, so the first
    /// request does not pay first-use costs; also DS4_WARMUP=0).
    #[arg(long)]
    no_warmup: bool,
    /// Prefill chunk size in tokens (the same default as `ds4`).
    #[arg(long, default_value_t = ds4_engine::DEFAULT_PREFILL_CHUNK)]
    prefill_chunk: usize,
    /// Numeric mode: exact or official (default: official where the model allows it).
    #[arg(long)]
    mode: Option<String>,
    /// Change to this directory before loading (relative paths are then taken from it).
    #[arg(long)]
    chdir: Option<PathBuf>,
    /// Address to bind (IPv4; `localhost` = 127.0.0.1).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// TCP port to listen on (0 = any free port; the address is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require this key as `Authorization: Bearer KEY` or `x-api-key: KEY`. Visible to
    /// other local users in the process list: prefer --api-key-file or DS4_API_KEY.
    #[arg(long)]
    api_key: Option<String>,
    /// Read the API key from this file (first line, surrounding whitespace removed).
    #[arg(long, conflicts_with = "api_key")]
    api_key_file: Option<PathBuf>,
    /// Let a browser page from ORIGIN (e.g. http://localhost:3000) call the API; `--cors`
    /// alone allows any origin. Repeatable. Without it, cross-origin POSTs are refused.
    #[arg(long, value_name = "ORIGIN", num_args = 0..=1, default_missing_value = "*", action = clap::ArgAction::Append)]
    cors: Vec<String>,
    /// Accept this Host name too when listening on loopback, key or not (loopback names
    /// are always accepted; others are refused against DNS rebinding). Repeatable.
    #[arg(long, value_name = "NAME", action = clap::ArgAction::Append)]
    allowed_host: Vec<String>,
    /// Do not serve the chat page at / and /chat (the API only).
    #[arg(long)]
    no_webchat: bool,
    /// Seconds a client has to send a request head (also closes idle connections).
    #[arg(long, default_value_t = 10)]
    header_timeout_secs: u64,
    /// Longest pause in a request body upload, in seconds.
    #[arg(long, default_value_t = 10)]
    body_idle_timeout_secs: u64,
    /// Longest whole request body upload, in seconds.
    #[arg(long, default_value_t = 30)]
    body_timeout_secs: u64,
    /// Open connections at most (0 = from the descriptor limit); past it: 503.
    #[arg(long, default_value_t = 0)]
    max_connections: usize,
    /// Request-body bytes buffered at once across all connections, in MiB (0 = 4 × the
    /// body limit); a body that cannot get its share in time: 503 + Retry-After.
    #[arg(long, default_value_t = 0)]
    body_budget_mib: usize,
    /// Milliseconds a request body may wait for its share of the body budget.
    #[arg(long, default_value_t = 1000)]
    body_budget_wait_ms: u64,
    /// Seconds open connections may take to finish after SIGTERM before they are dropped.
    #[arg(long, default_value_t = 10)]
    shutdown_grace_secs: u64,
    /// Requests parsed and tokenized at once (0 = from the cores and memory).
    #[arg(long, default_value_t = 0)]
    prepare_concurrency: usize,
    /// Milliseconds a streaming client may stop reading before its generation is cancelled.
    #[arg(long, default_value_t = 2000)]
    stall_timeout_ms: u64,
    /// KiB of a stream a client may leave unread (send queue, waiting events and, for a
    /// client on this host, its receive queue) while taking nothing for the stall timeout.
    #[arg(long, default_value_t = 128)]
    stream_unread_cap_kib: u64,
    /// Kernel send buffer per connection in KiB (0 = kernel default, autotuned to MBs).
    #[arg(long, default_value_t = 128)]
    send_buffer_kib: usize,
    /// Treat chat markers inside message text, tool results and tool arguments as control
    /// tokens (ds4's behaviour; lets content forge turns). Off: they are plain text.
    #[arg(long)]
    content_special_tokens: bool,
    /// Requests that may wait while the slots are busy; more get 429.
    #[arg(long, default_value_t = 32)]
    queue: usize,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    max_body_bytes: usize,
    /// In-memory KV snapshots kept at turn boundaries (0 disables).
    #[arg(long, default_value_t = 1)]
    snapshot_slots: usize,
    /// Enable the disk KV cache in DIR.
    #[arg(long)]
    kv_disk_dir: Option<PathBuf>,
    /// Byte budget of the disk KV cache in MiB (least recently used entries are evicted).
    #[arg(long, default_value_t = 4096)]
    kv_disk_space_mb: u64,
    /// Prompts shorter than this many tokens are neither saved to nor loaded from disk.
    #[arg(long, default_value_t = 512)]
    kv_cache_min_tokens: usize,
    /// Longest fresh prompt saved as a cold checkpoint, in tokens (0 disables cold saves).
    #[arg(long, default_value_t = 30000)]
    kv_cache_cold_max_tokens: usize,
    /// A `continued` checkpoint every this many tokens while a session grows (rounded up
    /// to the alignment; 0 disables).
    #[arg(long, default_value_t = 10000)]
    kv_cache_continued_interval_tokens: usize,
    /// Tokens left out at the end of a cold save, so the next turn's differing tail is
    /// not part of it.
    #[arg(long, default_value_t = 32)]
    kv_cache_boundary_trim_tokens: usize,
    /// Cold save boundaries are aligned down to a multiple of this many tokens (0 = no
    /// alignment).
    #[arg(long, default_value_t = 2048)]
    kv_cache_boundary_align_tokens: usize,
    /// Canonical JSON→DSML rendering only.
    #[arg(long)]
    disable_exact_dsml_tool_replay: bool,
    /// Tool-call ids whose sampled DSML is remembered for exact replay (least recently
    /// used are forgotten).
    #[arg(long, default_value_t = 100_000)]
    tool_memory_max_ids: usize,
    /// Test hook: JSON file of forced outputs `[{"when": "...", "output": "..."}]`.
    #[arg(long, hide = true)]
    test_script: Option<PathBuf>,
}

fn parse_draft(s: &str) -> Result<ds4_runtime::DraftMode, String> {
    s.parse()
}

fn host_addr(host: &str, port: u16) -> Result<SocketAddr> {
    let ip: Ipv4Addr = if host == "localhost" {
        Ipv4Addr::LOCALHOST
    } else {
        host.parse()
            .with_context(|| format!("--host {host:?} is not an IPv4 address"))?
    };
    Ok(SocketAddr::new(IpAddr::V4(ip), port))
}

/// What to do when `-m` does not name a GGUF file: opening a directory used to end in
/// "No such device" (the mmap error), printed twice.
fn check_model_path(p: &std::path::Path) -> Result<()> {
    const HELP: &str = "ds4-server serves a DeepSeek V4 Flash GGUF in the ds4 layout, given with -m PATH. \
Make one from a Hugging Face checkpoint with `ds4-convert hf CHECKPOINT_DIR OUT.gguf` (see the README), \
or try the server on the small random-weight demo model: -m tests/fixtures/demo/ds4-demo.gguf";
    match std::fs::metadata(p) {
        Ok(m) if m.is_file() => Ok(()),
        Ok(m) if m.is_dir() => bail!(
            "model {} is a directory, not a GGUF file.\n{HELP}",
            p.display()
        ),
        Ok(_) => bail!("model {} is not a regular file.\n{HELP}", p.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("model file {} not found.\n{HELP}", p.display())
        }
        Err(e) => bail!("cannot read model file {}: {e}", p.display()),
    }
}

/// The slot count from --parallel, else DS4_PARALLEL, else 1.
fn parallel(a: &Args) -> Result<usize> {
    let (n, from) = match (a.parallel, std::env::var("DS4_PARALLEL")) {
        (Some(n), _) => (n, "--parallel".to_string()),
        (None, Ok(v)) => (
            v.trim()
                .parse()
                .with_context(|| format!("DS4_PARALLEL={v:?} is not a number"))?,
            "DS4_PARALLEL".to_string(),
        ),
        (None, Err(_)) => (1, String::new()),
    };
    if n == 0 {
        bail!("{from} must be at least 1");
    }
    Ok(n)
}

/// The API key from --api-key, --api-key-file or DS4_API_KEY (in that order); an empty one
/// is refused (it would accept an empty `x-api-key:` header).
fn api_key(a: &Args) -> Result<Option<String>> {
    let (key, from) = if let Some(k) = &a.api_key {
        (k.clone(), "--api-key".to_string())
    } else if let Some(p) = &a.api_key_file {
        let text = std::fs::read_to_string(p)
            .with_context(|| format!("cannot read --api-key-file {}", p.display()))?;
        (
            text.lines().next().unwrap_or("").trim().to_string(),
            format!("--api-key-file {}", p.display()),
        )
    } else if let Ok(k) = std::env::var("DS4_API_KEY") {
        (k.trim().to_string(), "DS4_API_KEY".to_string())
    } else {
        return Ok(None);
    };
    if key.trim().is_empty() {
        bail!(
            "the API key from {from} is empty; give a non-empty key (or none for an open server)"
        );
    }
    Ok(Some(key))
}

fn main() -> Result<()> {
    let a = Args::parse();
    let level = match a.verbose {
        0 | 1 => "info",
        2 => "debug",
        _ => "trace",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| level.into()),
        )
        .with_writer(std::io::stderr)
        // Plain text for log files and pipes; colour only on a terminal.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if a.ctx == 0 || a.tokens == 0 || a.prefill_chunk == 0 || a.default_max_tokens == 0 {
        bail!("--ctx, --tokens, --default-max-tokens and --prefill-chunk must be > 0");
    }
    if let Some(dir) = &a.chdir {
        std::env::set_current_dir(dir)
            .with_context(|| format!("cannot chdir to {}", dir.display()))?;
    }
    let mode = a
        .mode
        .as_deref()
        .map(str::parse)
        .transpose()
        .context("--mode")?;
    let addr = host_addr(&a.host, a.port)?;
    let parallel = parallel(&a)?;
    let disk = match &a.kv_disk_dir {
        None => None,
        Some(dir) => {
            // The store creates a missing directory 0700 and refuses a shared one, one of
            // another user or one under a world-writable parent without the sticky bit; it
            // never changes the permissions of an existing directory. Checked before the
            // (long) model load, so a bad directory is reported at once.
            let d = DiskCacheConfig {
                budget_bytes: a.kv_disk_space_mb.saturating_mul(1 << 20),
                min_tokens: a.kv_cache_min_tokens,
                cold_max_tokens: a.kv_cache_cold_max_tokens,
                continued_interval_tokens: a.kv_cache_continued_interval_tokens,
                boundary_trim_tokens: a.kv_cache_boundary_trim_tokens,
                boundary_align_tokens: a.kv_cache_boundary_align_tokens,
                ..DiskCacheConfig::new(dir)
            };
            d.validate().map_err(anyhow::Error::msg)?;
            ds4_kvstore::prepare_dir(&d.dir)
                .with_context(|| format!("--kv-disk-dir {}", d.dir.display()))?;
            Some(d)
        }
    };
    let script = match &a.test_script {
        None => None,
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read {}", p.display()))?;
            Some(Arc::new(
                Script::from_json(&text).map_err(anyhow::Error::msg)?,
            ))
        }
    };
    let cfg = ServerConfig {
        max_tokens: a.tokens,
        default_max_tokens: a.default_max_tokens,
        queue_capacity: a.queue,
        max_body_bytes: a.max_body_bytes,
        api_key: api_key(&a)?,
        cors_origins: a.cors.clone(),
        allowed_hosts: a.allowed_host.clone(),
        header_timeout: Duration::from_secs(a.header_timeout_secs.max(1)),
        body_idle_timeout: Duration::from_secs(a.body_idle_timeout_secs.max(1)),
        body_timeout: Duration::from_secs(a.body_timeout_secs.max(1)),
        max_connections: a.max_connections,
        body_budget_bytes: a.body_budget_mib.saturating_mul(1 << 20),
        body_budget_wait: Duration::from_millis(a.body_budget_wait_ms),
        shutdown_grace: Duration::from_secs(a.shutdown_grace_secs),
        prepare_concurrency: a.prepare_concurrency,
        stall_timeout: Duration::from_millis(a.stall_timeout_ms.max(1)),
        unread_cap_bytes: a.stream_unread_cap_kib.max(1) << 10,
        content_special_tokens: a.content_special_tokens,
        send_buffer_bytes: a.send_buffer_kib << 10,
        parallel,
        prefill_per_step: a.prefill_chunk_per_step,
        snapshot_slots: a.snapshot_slots,
        disk,
        exact_dsml_replay: !a.disable_exact_dsml_tool_replay,
        tool_memory_max_ids: a.tool_memory_max_ids,
        script,
        webchat: !a.no_webchat,
        ..ServerConfig::default()
    };
    // Every setting is read (and a typo reported) before the port is taken.
    let config = ds4_runtime::config::Config::resolve(
        ds4_runtime::config::ConfigFlags {
            quality: a.quality,
            no_warmup: a.no_warmup,
            draft: a.draft,
            draft_max: a.draft_max,
            draft_ngram: a.draft_ngram,
        },
        |k| std::env::var(k).ok(),
    )
    .map(|c| c.with_mtp_flag(a.mtp.clone()))
    .context("invalid setting")?;
    let cfg = ServerConfig {
        draft: config.draft_config(),
        ..cfg
    };
    check_model_path(&a.model)?;
    // The port is taken before the (long) load; until the model is ready every request is
    // answered 503, `/health` with `{"status":"loading"}` (docs/server.md §4).
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let header_timeout = cfg.header_timeout;
    let loading = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let bound = listener.local_addr()?;
        eprintln!("ds4-server: bound http://{bound}; loading the model (every request gets 503, /health {{\"status\":\"loading\"}}, until it is ready)");
        Ok::<_, anyhow::Error>(ds4_server::loading::Loading::start(listener, header_timeout))
    })?;
    let t0 = std::time::Instant::now();
    tracing::info!("prefill precision: {}", config.precision.value.name());
    // The CLI's loader: backend, placement plan (printed), engine, tokenizer, identity.
    let opts = ds4_runtime::load::LoadOptions {
        backend: a.backend,
        report: if a.verbose > 0 {
            ds4_runtime::load::LoadReport::Full
        } else {
            ds4_runtime::load::LoadReport::Summary
        },
        placement: a.placement.to_overrides(),
        config,
        kv_states: parallel,
        ..ModelOptions {
            ctx: a.ctx,
            threads: a.threads,
            prefill_chunk: a.prefill_chunk,
            mode,
        }
        .load_options(&a.model, a.backend)
    };
    let model: LoadedModel = ds4_runtime::load::load(&opts, &mut std::io::stderr())
        .with_context(|| match parallel {
            1 => format!("loading {}", a.model.display()),
            n => format!(
                "loading {} for --parallel {n} ({n} KV states of {} tokens; lower --parallel or -c/--ctx if they do not fit)",
                a.model.display(),
                a.ctx
            ),
        })?
        .into();
    tracing::info!(
        model = %model.name,
        backend = %model.engine.backend_name(),
        mode = %model.engine.mode(),
        ctx = a.ctx,
        parallel,
        load_ms = t0.elapsed().as_millis() as u64,
        "model loaded"
    );
    let chat_page = cfg.webchat;
    rt.block_on(async move {
        let listener = loading.finish().await?;
        let server = Server::from_listener(listener, cfg, model)?;
        // What the plan sized: N slots of the context, and their KV bytes.
        eprintln!("ds4-server: {}", server.slots());
        // Scripts wait for this line: the server is ready when it is printed.
        eprintln!("ds4-server: listening on http://{}", server.local_addr());
        if chat_page {
            eprintln!("ds4-server: chat page at http://{}/", server.local_addr());
        }
        server.serve(shutdown_signal()).await?;
        eprintln!("ds4-server: stopped");
        Ok::<(), anyhow::Error>(())
    })?;
    rt.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}

/// The first SIGINT/SIGTERM starts a graceful drain; a second one exits at once (130).
async fn shutdown_signal() {
    wait_signal().await;
    eprintln!("ds4-server: shutting down (signal again to exit immediately)");
    tokio::spawn(async {
        wait_signal().await;
        std::process::exit(130);
    });
}

async fn wait_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// `--help` explains every argument a user can pass.
    #[test]
    fn every_flag_has_help_text() {
        let missing = ds4_runtime::cli_help::undocumented_arguments(&Args::command());
        assert!(missing.is_empty(), "arguments without help: {missing:?}");
    }
}
