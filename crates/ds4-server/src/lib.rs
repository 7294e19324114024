//! `ds4-server`: an OpenAI- and Anthropic-compatible HTTP API over one ds4 engine and its
//! `--parallel N` KV slots.
//!
//! ```text
//! HTTP (axum) → endpoints::family(ep): parse (request) → prepare (render, exact DSML, tokenize)
//!   → bounded queue (429 when full) → scheduler thread (sched: ds4_runtime Slots, one
//!     engine, N KV states) → the idle slot that reuses most (reuse):
//!       tool binding | live prefix | thinking-visible | turn snapshot | disk | cold
//!     each step: prompt pieces up to the step's budget, cut at fixed positions (cuts),
//!     with cold/continued disk saves, then one batched decode step of every generating
//!     slot (turn: pick + sample per slot) → OutputStream
//!   → JobEvents → the family's EventStream (emit) → SSE / JSON body
//! ```
//!
//! Module dependencies run one way: `api` (the request model) ← `request` (parsers),
//! `live` ← `prepare` ← `endpoints` → `emit`; nothing below `http` imports it.
//! The worker side: `sched` (the steps) → `turn` (a slot's generation) → `reuse` (the
//! slots and their reuse state, one owner) → `worker` (jobs and their events).
//!
//! Endpoints: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`,
//! `/v1/completions`, `/v1/responses`, `/v1/messages`, `GET /health` (status + counters),
//! `POST /tokenize`, `/detokenize`. Wire formats follow `docs/server.md` §4–8.

pub mod api;
pub mod bodyscan;
pub mod config;
mod cuts;
pub mod diskcache;
pub mod emit;
pub mod endpoints;
pub mod error;
pub mod http;
pub mod json_out;
pub mod limits;
pub mod live;
pub mod loading;
pub mod model;
pub mod prepare;
pub mod request;
mod reuse;
mod sched;
pub mod script;
pub mod stats;
pub mod toolmem;
pub mod trace;
mod turn;
pub mod webchat;
pub mod worker;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

pub use config::{DiskCacheConfig, ServerConfig, DEFAULT_MAX_TOKENS, MODEL_ID};
pub use error::{ApiError, ServerError};
pub use model::{LoadedModel, ModelOptions};
pub use sched::SlotsInfo;
pub use script::Script;
pub use stats::Stats;

use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// A server ready to serve: the worker is running and the socket is listening.
pub struct Server {
    listener: TcpListener,
    router: axum::Router,
    worker: std::thread::JoinHandle<()>,
    stats: Arc<Stats>,
    shutting_down: Arc<AtomicBool>,
    cfg: Arc<ServerConfig>,
    max_connections: usize,
    slots: SlotsInfo,
}

impl Server {
    /// Binds `addr`, then starts the scheduler ([`Server::from_listener`]).
    pub async fn bind(
        addr: SocketAddr,
        cfg: ServerConfig,
        model: LoadedModel,
    ) -> Result<Server, ServerError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| ServerError::Io {
                what: format!("cannot listen on {addr}"),
                source,
            })?;
        Server::from_listener(listener, cfg, model)
    }

    /// Starts the scheduler (allocating the `cfg.parallel` KV slots and opening the disk
    /// cache) on a listener bound earlier: the binary binds before loading the model and
    /// answers 503 meanwhile ([`loading::Loading`]).
    pub fn from_listener(
        listener: TcpListener,
        cfg: ServerConfig,
        model: LoadedModel,
    ) -> Result<Server, ServerError> {
        let addr = listener.local_addr().map_err(|source| ServerError::Io {
            what: "cannot read the listening address".into(),
            source,
        })?;
        if cfg.queue_capacity == 0 {
            return Err(ServerError::Config(
                "the queue capacity must be at least 1".into(),
            ));
        }
        if cfg.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
            return Err(ServerError::Config(
                "the API key is empty: an empty key would accept an empty `x-api-key:` header; give a non-empty key or none".into(),
            ));
        }
        if !addr.ip().is_loopback() && cfg.api_key.is_none() {
            tracing::warn!(
                %addr,
                "listening on a non-loopback address without an API key: anyone who can reach it can run generations (set --api-key-file or DS4_API_KEY)"
            );
        }
        let max_connections = limits::max_connections(cfg.max_connections);
        let prepare = limits::prepare_concurrency(cfg.prepare_concurrency, cfg.max_body_bytes);
        tracing::info!(
            max_connections,
            prepare_concurrency = prepare,
            "request limits"
        );
        let cfg = Arc::new(cfg);
        let stats = Arc::new(Stats::default());
        let shutting_down = Arc::new(AtomicBool::new(false));
        let toolmem = Arc::new(Mutex::new(toolmem::ToolMemory::new(
            cfg.tool_memory_max_ids,
            cfg.tool_memory_max_bytes,
        )));
        // What the live state ends with after a clean Responses/Messages turn: the worker
        // publishes it after each job, handlers read it to plan tool-output continuations.
        let binding = Arc::new(Mutex::new(None));
        let ctx = model.engine.config().ctx;
        let has_mtp = model.engine.has_mtp();
        let tok = model.tokenizer.clone();
        let w = sched::Worker::new(
            model.engine,
            tok.clone(),
            model.identity,
            cfg.clone(),
            toolmem.clone(),
            binding.clone(),
            stats.clone(),
            shutting_down.clone(),
        )?;
        let slots = w.slots_info();
        let (tx, rx) = mpsc::channel(cfg.queue_capacity);
        let worker = std::thread::Builder::new()
            .name("ds4-worker".into())
            .spawn(move || w.run(rx))
            .map_err(|source| ServerError::Io {
                what: "cannot start the worker thread".into(),
                source,
            })?;
        let state = Arc::new(http::AppState::new(
            cfg.clone(),
            tok,
            toolmem,
            binding,
            tx,
            stats.clone(),
            shutting_down.clone(),
            ctx,
            model.name,
            has_mtp,
            addr.ip().is_loopback(),
            prepare,
        ));
        Ok(Server {
            listener,
            router: http::router(state),
            worker,
            stats,
            shutting_down,
            cfg,
            max_connections,
            slots,
        })
    }

    /// The KV slots the scheduler allocated (the binary's startup line prints them).
    pub fn slots(&self) -> SlotsInfo {
        self.slots
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// Serves until `shutdown` resolves. Then: no new connections, the running generation
    /// ends with finish `error` ("shutdown requested"), queued requests get 503, open
    /// connections get [`ServerConfig::shutdown_grace`] to finish (then they are dropped, so
    /// a stalled client cannot hold the process), and the worker saves a `shutdown` disk
    /// checkpoint and exits.
    pub async fn serve<F>(self, shutdown: F) -> Result<(), ServerError>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let flag = self.shutting_down.clone();
        let signal = async move {
            shutdown.await;
            flag.store(true, Ordering::Relaxed);
            tracing::info!("shutdown requested; draining");
        };
        let served = limits::serve_connections(
            self.listener,
            self.router,
            &self.cfg,
            self.max_connections,
            self.stats.clone(),
            signal,
        )
        .await;
        // Every connection (and with it the router's queue sender) is gone: the worker
        // drains and exits.
        let worker = self.worker;
        let joined = tokio::task::spawn_blocking(move || worker.join()).await;
        served.map_err(|source| ServerError::Io {
            what: "server".into(),
            source,
        })?;
        match joined {
            Ok(Ok(())) => Ok(()),
            _ => Err(ServerError::Model("the worker thread panicked".into())),
        }
    }

    /// Serves in the background (tests, embedding); stop with [`Running::shutdown`].
    pub fn spawn(self) -> Running {
        let addr = self.local_addr();
        let stats = self.stats.clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(self.serve(async move {
            let _ = rx.await;
        }));
        Running {
            addr,
            stats,
            stop: Some(tx),
            task,
        }
    }
}

/// A server running on the current tokio runtime.
pub struct Running {
    pub addr: SocketAddr,
    pub stats: Arc<Stats>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), ServerError>>,
}

impl Running {
    /// Requests a graceful shutdown and waits for it (worker joined, checkpoint saved).
    pub async fn shutdown(mut self) -> Result<(), ServerError> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        match self.task.await {
            Ok(r) => r,
            Err(e) => Err(ServerError::Model(format!("server task failed: {e}"))),
        }
    }
}
