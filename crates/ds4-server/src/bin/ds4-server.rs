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
    /// Context size of the single session (allocated at startup).
    #[arg(short = 'c', long, default_value_t = 32768)]
    ctx: usize,
    /// Default and maximum output tokens per request.
    #[arg(short = 'n', long = "tokens", default_value_t = 393_216)]
    tokens: usize,
    /// CPU threads (0 = one per core).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: usize,
    /// Backend: auto (CUDA when a device answers, then ROCm, then the CPU, saying why),
    /// cpu, cuda, rocm. GPU weights are placed by the same plan `ds4 plan` prints (the
    /// DS4_WEIGHTS_MEM / DS4_DEVICE_MEM_LIMIT_GIB / ... variables override it).
    #[arg(long, value_enum, default_value_t = ds4_cli::load::BackendChoice::Auto)]
    backend: ds4_cli::load::BackendChoice,
    /// Pedantic f32 prefill GEMM instead of the default fast TF32 path (CUDA; also
    /// DS4_QUALITY=1).
    #[arg(long)]
    quality: bool,
    /// Prefill chunk size in tokens.
    #[arg(long, default_value_t = 128)]
    prefill_chunk: usize,
    /// Numeric mode: exact or official (default: official where the model allows it).
    #[arg(long)]
    mode: Option<String>,
    /// Change directory before loading.
    #[arg(long)]
    chdir: Option<PathBuf>,
    /// Address to bind (IPv4; `localhost` = 127.0.0.1).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require this key as `Authorization: Bearer KEY` or `x-api-key: KEY`.
    #[arg(long)]
    api_key: Option<String>,
    /// Add permissive CORS headers.
    #[arg(long)]
    cors: bool,
    /// Requests that may wait while one runs; more get 429.
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
    #[arg(long, default_value_t = 4096)]
    kv_disk_space_mb: u64,
    #[arg(long, default_value_t = 512)]
    kv_cache_min_tokens: usize,
    #[arg(long, default_value_t = 30000)]
    kv_cache_cold_max_tokens: usize,
    #[arg(long, default_value_t = 10000)]
    kv_cache_continued_interval_tokens: usize,
    #[arg(long, default_value_t = 32)]
    kv_cache_boundary_trim_tokens: usize,
    #[arg(long, default_value_t = 2048)]
    kv_cache_boundary_align_tokens: usize,
    /// Canonical JSON→DSML rendering only.
    #[arg(long)]
    disable_exact_dsml_tool_replay: bool,
    #[arg(long, default_value_t = 100_000)]
    tool_memory_max_ids: usize,
    /// Test hook: JSON file of forced outputs `[{"when": "...", "output": "..."}]`.
    #[arg(long, hide = true)]
    test_script: Option<PathBuf>,
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

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let a = Args::parse();
    if a.ctx == 0 || a.tokens == 0 || a.prefill_chunk == 0 {
        bail!("--ctx, --tokens and --prefill-chunk must be > 0");
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
    let disk = match &a.kv_disk_dir {
        None => None,
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
            }
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
        queue_capacity: a.queue,
        max_body_bytes: a.max_body_bytes,
        api_key: a.api_key.clone(),
        cors: a.cors,
        snapshot_slots: a.snapshot_slots,
        disk,
        exact_dsml_replay: !a.disable_exact_dsml_tool_replay,
        tool_memory_max_ids: a.tool_memory_max_ids,
        script,
        ..ServerConfig::default()
    };
    let opts = ModelOptions {
        ctx: a.ctx,
        threads: a.threads,
        prefill_chunk: a.prefill_chunk,
        mode,
    };
    let t0 = std::time::Instant::now();
    let req = ds4_cli::load::PlacementRequest {
        model: &a.model,
        ctx: a.ctx,
        prefill_chunk: a.prefill_chunk.max(1),
        overrides: Default::default(),
    };
    let precision = ds4_cli::load::Precision::from_env(a.quality);
    tracing::info!("prefill precision: {}", precision.name());
    let backend = ds4_cli::load::planned_backend(
        a.backend,
        a.threads,
        &req,
        Some(&mut std::io::stderr()),
        precision,
    )
    .with_context(|| format!("placing {}", a.model.display()))?;
    let model = LoadedModel::open_with_backend(&a.model, &opts, backend)
        .with_context(|| format!("loading {}", a.model.display()))?;
    tracing::info!(
        model = %model.name,
        backend = %model.engine.backend_name(),
        mode = %model.engine.mode(),
        ctx = a.ctx,
        load_ms = t0.elapsed().as_millis() as u64,
        "model loaded"
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let server = Server::bind(addr, cfg, model).await?;
        eprintln!("ds4-server: listening on http://{}", server.local_addr());
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
