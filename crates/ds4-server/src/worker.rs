//! The one inference worker (docs/server.md §9): a thread that owns the engine session (one live KV
//! state) and runs jobs strictly one at a time from a bounded queue. For each job it picks
//! the cheapest way to reach the prompt (live state, an in-memory turn snapshot, a disk
//! checkpoint, or a cold prefill), evaluates only what is missing, generates, and streams
//! events back to the request's handler. Clients never back-pressure it: a client that
//! stops reading (its buffer fills) or disconnects (its receiver drops) cancels its job.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ds4_chat::stream::{EndCause, FinalOutput, Halt, OutputStream, StreamEvent, StreamOptions};
use ds4_chat::tokenizer::{THINK_CLOSE_TEXT, THINK_OPEN_TEXT};
use ds4_chat::Tokenizer;
use ds4_engine::{argmax, EngineError, Sampler, SamplerConfig, Snapshot};
use ds4_kvstore::{KvStore, Mode, StoreConfig, StoreOutcome};
use ds4_runtime::checkpoint::Format;
use ds4_runtime::driver::{Conversation, DriverError, Flow, GenLimits, GenStop, Steer};
use tokio::sync::mpsc;

use crate::config::{DiskCacheConfig, ServerConfig};
use crate::diskcache::{self, continuation};

use crate::api::Endpoint;
use crate::error::{ApiError, ServerError};
use crate::live::{self, ToolBinding};
use crate::prepare::Prepared;
use crate::stats::Stats;
use crate::toolmem::ToolMemory;

/// One generation request, rendered and tokenized, waiting for the worker.
#[derive(Debug)]
pub struct Job {
    pub endpoint: Endpoint,
    pub prepared: Prepared,
    pub stop: Vec<String>,
    /// Client limit (`None`: the server default).
    pub max_tokens: Option<u64>,
    pub sampling: SamplerConfig,
    /// Send per-token deltas (streaming); otherwise only start and end.
    pub deltas: bool,
    /// Forced output (test hook, see [`crate::script`]).
    pub forced: Option<String>,
    /// Responses: the `resp_…` id the client will see (a later `previous_response_id`).
    pub response_id: Option<String>,
    /// The request field that holds the prompt (a context overflow names it) and the
    /// prefix of tool-call ids: the family's, given by the handler so the worker needs no
    /// endpoint code.
    pub prompt_param: &'static str,
    pub tool_id_prefix: &'static str,
    /// How the request's family continues the live state (`None`: it does not, and a turn
    /// leaves no binding).
    pub continuation: Option<crate::api::Continuation>,
    pub events: mpsc::Sender<JobEvent>,
    /// Set by the handler when the client goes away.
    pub cancel: Arc<AtomicBool>,
    /// When the client last took an event ([`crate::limits::now_ms`]): a streaming client
    /// that takes nothing for [`ServerConfig::stall_timeout`] while events wait has stopped
    /// reading, and its generation is cancelled instead of holding the worker.
    pub taken_ms: Arc<std::sync::atomic::AtomicU64>,
}

/// Token accounting of one request (docs/server.md §7.1: P, R, C).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Tokens of the effective prompt.
    pub prompt_tokens: usize,
    /// Reused (not evaluated) prompt tokens.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
}

impl Usage {
    /// Prompt tokens evaluated for this request.
    pub fn prefilled(&self) -> usize {
        self.prompt_tokens - self.cached_tokens
    }
}

/// A streamed piece of output, with tool-call ids assigned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    ToolStart {
        index: usize,
        id: String,
        name: String,
    },
    ToolArgs {
        index: usize,
        fragment: String,
    },
    ToolEnd {
        index: usize,
    },
}

/// The end of a job.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub output: FinalOutput,
    /// One id per tool call of `output.message`, the streamed ones reused.
    pub tool_ids: Vec<String>,
    pub usage: Usage,
    /// The model closed its reasoning (`</think>` seen).
    pub reasoning_closed: bool,
}

#[derive(Debug)]
pub enum JobEvent {
    /// The worker took the job; the prompt is about to be evaluated.
    Started {
        usage: Usage,
        source: &'static str,
    },
    Delta(Delta),
    Done(Box<Outcome>),
    /// The job failed (before `Started`: answer with this error; after: in-stream error).
    Failed(ApiError),
}

/// A random id: `prefix` + `hex_len` lowercase hex digits.
pub fn random_id(prefix: &str, hex_len: usize) -> String {
    let mut bytes = vec![0u8; hex_len.div_ceil(2)];
    if getrandom::fill(&mut bytes).is_err() {
        // No OS randomness: fall back to time and a counter (ids stay unique per process).
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
            ^ N.fetch_add(1, Ordering::Relaxed).rotate_left(32);
        let mut r = ds4_engine::Rng::new(seed);
        for b in bytes.iter_mut() {
            *b = r.next_u64() as u8;
        }
    }
    let mut s = String::with_capacity(prefix.len() + hex_len);
    s.push_str(prefix);
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s.truncate(prefix.len() + hex_len);
    s
}

struct MemSnapshot {
    tokens: Vec<u32>,
    snap: Snapshot,
    logits: Vec<f32>,
}

/// After a tool-less thinking answer the client replays it without the reasoning; this
/// remembers the text it will send, so the live state (which has the reasoning) still counts
/// as its prefix (docs/server.md §9 `thinking-visible`).
struct Visible {
    text: String,
    live_len: usize,
}

struct Disk {
    store: KvStore,
    cfg: DiskCacheConfig,
    /// Live length at the last save or load (the `continued` schedule counts from it).
    frontier: usize,
}

/// Why a prefill ended early.
enum Stop {
    /// The client went away or the server is stopping.
    Cancelled,
    /// The engine failed (already reported to the client).
    Failed,
}

/// The worker's state: the session and everything tied to its live KV.
pub struct Worker {
    /// The live session and the logits after it (the runtime's conversation driver).
    conv: Conversation,
    tok: Arc<Tokenizer>,
    eos: u32,
    ctx: usize,
    piece: usize,
    visible: Option<Visible>,
    snapshots: VecDeque<MemSnapshot>,
    disk: Option<Disk>,
    toolmem: Arc<Mutex<ToolMemory>>,
    /// What the live state ends with after a clean Responses/Messages turn (docs/server.md §9);
    /// `None` once anything else touched the live state.
    binding: Option<ToolBinding>,
    /// Where handlers read `binding`. Published only between jobs, so a request planned
    /// while another job runs still sees the binding it was accepted with, and the worker
    /// answers 409 if that job moved the live state (docs/server.md §8).
    published: Arc<Mutex<Option<ToolBinding>>>,
    stats: Arc<Stats>,
    cfg: Arc<ServerConfig>,
    shutdown: Arc<AtomicBool>,
}

fn lock(m: &Mutex<ToolMemory>) -> std::sync::MutexGuard<'_, ToolMemory> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn engine_err(e: impl std::fmt::Display) -> ApiError {
    ApiError::internal(e.to_string())
}

impl Worker {
    /// Creates the session and opens the disk cache (evicting it to its budget). Tool maps
    /// saved with disk entries are loaded into tool memory.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        engine: ds4_engine::Engine,
        tok: Arc<Tokenizer>,
        identity: [u8; 32],
        cfg: Arc<ServerConfig>,
        toolmem: Arc<Mutex<ToolMemory>>,
        published: Arc<Mutex<Option<ToolBinding>>>,
        stats: Arc<Stats>,
        shutdown: Arc<AtomicBool>,
    ) -> Result<Worker, ServerError> {
        let ctx = engine.config().ctx;
        // One prefill chunk per piece: a cancel is noticed after at most one chunk.
        let piece = engine.config().prefill_chunk.max(1);
        let mode = match engine.mode() {
            ds4_engine::NumericMode::Exact => Mode::Exact,
            ds4_engine::NumericMode::Official => Mode::Official,
        };
        let disk = match &cfg.disk {
            None => None,
            Some(d) => {
                d.validate().map_err(ServerError::Config)?;
                let (store, rejected) = KvStore::open(StoreConfig {
                    dir: d.dir.clone(),
                    budget_bytes: d.budget_bytes,
                    model_id: identity,
                    mode,
                    ctx: ctx as u64,
                })?;
                for r in &rejected {
                    tracing::warn!(entry = %r.name, reason = %r.reason, "disk KV entry removed");
                }
                Stats::add(&stats.disk_rejected, rejected.len() as u64);
                if cfg.exact_dsml_replay {
                    let maps = diskcache::read_tool_maps(&d.dir);
                    let mut tm = lock(&toolmem);
                    for (id, block) in maps {
                        tm.insert(&id, Arc::from(block.as_str()));
                    }
                }
                tracing::info!(
                    dir = %d.dir.display(),
                    entries = store.entries().len(),
                    bytes = store.total_bytes(),
                    "disk KV cache open"
                );
                Some(Disk {
                    store,
                    cfg: d.clone(),
                    frontier: 0,
                })
            }
        };
        let eos = tok.markers().eos;
        Ok(Worker {
            conv: Conversation::new(engine).map_err(|e| ServerError::Model(e.to_string()))?,
            tok,
            eos,
            ctx,
            piece,
            visible: None,
            snapshots: VecDeque::new(),
            disk,
            toolmem,
            binding: None,
            published,
            stats,
            cfg,
            shutdown,
        })
    }

    /// Runs jobs until the queue closes, then saves a `shutdown` checkpoint.
    pub fn run(mut self, mut rx: mpsc::Receiver<Job>) {
        while let Some(job) = rx.blocking_recv() {
            Stats::sub(&self.stats.queued, 1);
            if job.events.is_closed() || job.cancel.load(Ordering::Relaxed) {
                Stats::add(&self.stats.cancelled, 1);
                continue;
            }
            if self.shutdown.load(Ordering::Relaxed) {
                let _ = job
                    .events
                    .try_send(JobEvent::Failed(ApiError::shutting_down()));
                continue;
            }
            let events = job.events.clone();
            Stats::add(&self.stats.running, 1);
            let r = catch_unwind(AssertUnwindSafe(|| self.run_job(job)));
            Stats::sub(&self.stats.running, 1);
            match r {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    let _ = events.try_send(JobEvent::Failed(e));
                }
                Err(_) => {
                    Stats::add(&self.stats.worker_panics, 1);
                    tracing::error!("the worker panicked; the live state was discarded");
                    self.discard_live();
                    let _ = events.try_send(JobEvent::Failed(ApiError::internal("internal error")));
                }
            }
            self.publish();
        }
        self.disk_save("shutdown");
    }

    /// Makes the binding visible to handlers. Called when a job ends (before its `Done` is
    /// sent, so a client that answers a tool call at once finds it) and after every job.
    fn publish(&self) {
        *self.published.lock().unwrap_or_else(|p| p.into_inner()) = self.binding.clone();
    }

    fn discard_live(&mut self) {
        let _ = self.conv.reset();
        self.visible = None;
        self.binding = None;
        self.snapshots.clear();
    }

    fn send(&self, job: &Job, ev: JobEvent) {
        send(&self.stats, &self.cfg, job, ev);
    }

    fn stopping(&self, job: &Job) -> bool {
        job.cancel.load(Ordering::Relaxed)
            || job.events.is_closed()
            || self.shutdown.load(Ordering::Relaxed)
    }

    fn run_job(&mut self, job: Job) -> Result<(), ApiError> {
        let t0 = Instant::now();
        // Time in the queue is not the client's stall.
        job.taken_ms
            .store(crate::limits::now_ms(), Ordering::Relaxed);
        let (cached, suffix, source) = match self.live_tail(&job) {
            Some(r) => r,
            // Only the live state could serve it, and it moved since the request was
            // accepted: nothing was touched, so the binding (if any) stays.
            None => match job.prepared.live_tail.as_ref().filter(|t| t.required) {
                Some(t) => return Err(live::conflict(&t.continuation)),
                None => {
                    self.binding = None;
                    self.reuse(&job.prepared)?
                }
            },
        };
        let usage0 = Usage {
            prompt_tokens: cached + suffix.len(),
            cached_tokens: cached,
            completion_tokens: 0,
        };
        if usage0.prompt_tokens >= self.ctx {
            return Err(ApiError::context_overflow(
                usage0.prompt_tokens,
                self.ctx,
                job.prompt_param,
            ));
        }
        tracing::debug!(source, cached, prefill = suffix.len(), "prompt");
        self.send(
            &job,
            JobEvent::Started {
                usage: usage0,
                source,
            },
        );
        Stats::add(&self.stats.cached_tokens, cached as u64);
        match self.prefill(&job, &suffix, cached == 0) {
            Ok(()) => {}
            Err(Stop::Cancelled) => {
                Stats::add(&self.stats.cancelled, 1);
                return Ok(());
            }
            Err(Stop::Failed) => return Ok(()),
        }
        let t_prefill = t0.elapsed();
        self.turn_snapshot();
        let limit = job
            .max_tokens
            .map_or(self.cfg.max_tokens, |m| m.min(usize::MAX as u64) as usize)
            .min(self.cfg.max_tokens)
            .min(self.ctx - usage0.prompt_tokens);
        let mut outcome = self.generate(&job, limit)?;
        outcome.usage = Usage {
            completion_tokens: outcome.usage.completion_tokens,
            ..usage0
        };
        tracing::info!(
            endpoint = ?job.endpoint,
            source,
            prompt = usage0.prompt_tokens,
            cached,
            generated = outcome.usage.completion_tokens,
            finish = outcome.output.finish.as_str(),
            prefill_ms = t_prefill.as_millis() as u64,
            total_ms = t0.elapsed().as_millis() as u64,
            "request done"
        );
        self.send(&job, JobEvent::Done(Box::new(outcome)));
        Ok(())
    }

    /// A tool-output continuation (docs/server.md §9 steps 2–3): when the job's tail answers the
    /// binding the live state ends with, the live tokens are reused and only the tail's
    /// suffix is evaluated. Consumes the binding. Returns what [`Worker::reuse`] returns.
    fn live_tail(&mut self, job: &Job) -> Option<(usize, Vec<u32>, &'static str)> {
        let t = job.prepared.live_tail.as_ref()?;
        let b = self.binding.as_ref()?;
        let live_len = self.conv.pos();
        if b.frontier != live_len
            || live_len == 0
            || self.conv.logits().is_none()
            || !t.matches(job.endpoint, b)
        {
            return None;
        }
        self.binding = None;
        self.visible = None;
        Some((live_len, t.suffix_tokens.clone(), t.source()))
    }

    /// Picks how to reach the prompt and puts the session there. Returns (reused tokens,
    /// tokens still to evaluate, where the reuse came from).
    fn reuse(&mut self, p: &Prepared) -> Result<(usize, Vec<u32>, &'static str), ApiError> {
        let live_len = self.conv.pos();
        if live_len > 0 {
            if let Some(s) = continuation(&self.tok, self.conv.live(), p) {
                if !s.is_empty() || self.conv.logits().is_some() {
                    return Ok((live_len, s, "live"));
                }
            }
            if let Some(v) = &self.visible {
                if v.live_len == live_len
                    && p.text.len() > v.text.len()
                    && p.text.starts_with(&v.text)
                {
                    let s = p
                        .suffix_tokens(&self.tok, v.text.len())
                        .map_err(engine_err)?;
                    return Ok((live_len, s, "thinking-visible"));
                }
            }
        }
        for i in (0..self.snapshots.len()).rev() {
            let m = &self.snapshots[i];
            if let Some(s) = continuation(&self.tok, &m.tokens, p) {
                self.conv
                    .restore(&m.snap, Some(m.logits.clone()))
                    .map_err(engine_err)?;
                self.visible = None;
                let n = m.tokens.len();
                if let Some(d) = &mut self.disk {
                    d.frontier = d.frontier.min(n);
                }
                Stats::add(&self.stats.snapshot_hits, 1);
                return Ok((n, s, "snapshot"));
            }
        }
        if let Some(hit) = self.disk_lookup(p) {
            self.disk_save("evict");
            if let Some(r) = self.disk_load(&hit.0, hit.1) {
                return Ok(r);
            }
        }
        if live_len > 0 {
            self.disk_save("evict");
        }
        self.conv.reset().map_err(engine_err)?;
        self.visible = None;
        if let Some(d) = &mut self.disk {
            d.frontier = 0;
        }
        Ok((0, p.tokens.clone(), "cold"))
    }

    /// The longest usable disk entry that prefixes the prompt: (name, continuation).
    fn disk_lookup(&self, p: &Prepared) -> Option<(String, Vec<u32>)> {
        let d = self.disk.as_ref()?;
        let sc = d.store.config();
        let mut best: Option<(usize, String, Vec<u32>)> = None;
        for e in d.store.entries() {
            if e.tokens.len() < d.cfg.min_tokens.max(1) || e.mode != sc.mode || e.ctx > sc.ctx {
                continue;
            }
            if best.as_ref().is_some_and(|b| b.0 >= e.tokens.len()) {
                continue;
            }
            if let Some(s) = continuation(&self.tok, &e.tokens, p) {
                best = Some((e.tokens.len(), e.name.clone(), s));
            }
        }
        best.map(|(_, n, s)| (n, s))
    }

    fn disk_load(
        &mut self,
        name: &str,
        suffix: Vec<u32>,
    ) -> Option<(usize, Vec<u32>, &'static str)> {
        let d = self.disk.as_mut()?;
        let loaded = match d.store.load(name) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(entry = name, error = %e, "disk KV entry not loaded");
                Stats::add(&self.stats.disk_rejected, 1);
                return None;
            }
        };
        // Without stored logits the entry can only serve a prompt that goes on after it.
        // `Err(None)`: restored fine but not usable for this prompt; `Err(Some(why))`: broken.
        let resumed = match self.conv.resume(&loaded.payload, &loaded.tokens) {
            Ok(_) if suffix.is_empty() && self.conv.logits().is_none() => Err(None),
            Ok(format) => Ok(format),
            Err(e) => Err(Some(e.to_string())),
        };
        let d = self.disk.as_mut()?;
        match resumed {
            Ok(format) => {
                self.visible = None;
                d.frontier = loaded.tokens.len();
                if self.cfg.exact_dsml_replay {
                    let mut tm = lock(&self.toolmem);
                    for (id, block) in &loaded.tool_map {
                        tm.insert(id, Arc::from(block.as_str()));
                    }
                }
                Stats::add(&self.stats.disk_hits, 1);
                tracing::info!(entry = name, tokens = loaded.tokens.len(), "disk KV hit");
                if format.is_legacy() {
                    self.migrate(name, &loaded, format);
                }
                Some((loaded.tokens.len(), suffix, "disk"))
            }
            Err(None) => {
                // A usable entry for a longer prompt: kept.
                tracing::info!(entry = name, "disk KV entry has no logits for this prompt");
                let _ = self.conv.reset();
                None
            }
            Err(Some(why)) => {
                tracing::warn!(entry = name, reason = %why, "disk KV entry unusable; removed");
                let _ = d.store.remove(name);
                Stats::add(&self.stats.disk_rejected, 1);
                None
            }
        }
    }

    /// Rewrites an entry written in a legacy payload format (by an older `ds4` or
    /// `ds4-server`) in the current one, keeping its tokens and tool map. The live state
    /// holds exactly the entry's tokens here.
    fn migrate(&mut self, name: &str, loaded: &ds4_kvstore::Loaded, from: Format) {
        let payload = match self.conv.checkpoint() {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(entry = name, error = %e, "legacy disk KV entry not migrated");
                return;
            }
        };
        let Some(d) = &mut self.disk else { return };
        match d.store.store(&loaded.tokens, &payload, &loaded.tool_map) {
            Ok(StoreOutcome::Stored { .. }) => {
                tracing::info!(entry = name, from = from.name(), "disk KV entry migrated")
            }
            Ok(StoreOutcome::SkippedTooLarge { .. }) => {
                tracing::warn!(
                    entry = name,
                    "legacy disk KV entry not migrated: over the budget"
                )
            }
            Err(e) => {
                tracing::warn!(entry = name, error = %e, "legacy disk KV entry not migrated")
            }
        }
    }

    /// Saves the live state as a disk checkpoint (if enabled and long enough).
    fn disk_save(&mut self, reason: &str) {
        let ctx = SaveCtx {
            tok: &self.tok,
            toolmem: &self.toolmem,
            cfg: &self.cfg,
            stats: &self.stats,
        };
        disk_save(&mut self.conv, &mut self.disk, &ctx, reason);
    }

    /// Where a cold prompt is checkpointed (docs/server.md §11 `cold`): the shared system/tools prefix
    /// (up to the last `⟨U⟩` before the first `⟨A⟩`), else the trimmed, aligned length.
    fn cold_boundary(&self, tokens: &[u32]) -> Option<usize> {
        let d = self.disk.as_ref()?;
        let len = tokens.len();
        if d.cfg.cold_max_tokens == 0
            || len < d.cfg.min_tokens.max(1)
            || len > d.cfg.cold_max_tokens
        {
            return None;
        }
        let m = self.tok.markers();
        let first_a = tokens.iter().position(|&t| t == m.assistant).unwrap_or(len);
        if let Some(u) = tokens[..first_a].iter().rposition(|&t| t == m.user) {
            if u >= d.cfg.min_tokens.max(1) {
                return Some(u);
            }
        }
        let mut b = len.saturating_sub(d.cfg.boundary_trim_tokens);
        if let Some(q) = b.checked_div(d.cfg.boundary_align_tokens) {
            b = q * d.cfg.boundary_align_tokens;
        }
        Some(if b >= d.cfg.min_tokens.max(1) { b } else { len })
    }

    /// The next `continued` checkpoint position, if any.
    fn next_continued(&self) -> Option<usize> {
        next_continued(&self.disk)
    }

    /// Evaluates `tokens` after the live state in pieces (so a cancel is noticed and disk
    /// checkpoints land exactly at their boundaries). `Err` = cancelled.
    fn prefill(&mut self, job: &Job, tokens: &[u32], cold: bool) -> Result<(), Stop> {
        let cold_at = if cold {
            self.cold_boundary(tokens)
        } else {
            None
        };
        let mut done = 0;
        while done < tokens.len() {
            if self.stopping(job) {
                return Err(Stop::Cancelled);
            }
            let pos = self.conv.pos();
            let mut end = tokens.len().min(done + self.piece);
            for b in [cold_at, self.next_continued()].into_iter().flatten() {
                if b > pos && b < pos + (end - done) {
                    end = done + (b - pos);
                }
            }
            match self.conv.prefill(&tokens[done..end]) {
                Ok(()) => {}
                Err(e) => {
                    // The state is unchanged or partial; nothing after it can be trusted.
                    self.discard_live();
                    self.send(job, JobEvent::Failed(ApiError::internal(e.to_string())));
                    return Err(Stop::Failed);
                }
            }
            Stats::add(&self.stats.prefilled_tokens, (end - done) as u64);
            done = end;
            let pos = self.conv.pos();
            if cold_at == Some(pos) {
                self.disk_save("cold");
            } else if self.next_continued() == Some(pos) {
                self.disk_save("continued");
            }
        }
        Ok(())
    }

    /// Keeps an in-memory snapshot of the state at the end of this prompt.
    fn turn_snapshot(&mut self) {
        if self.cfg.snapshot_slots == 0 {
            return;
        }
        let Some(logits) = self.conv.logits().map(<[f32]>::to_vec) else {
            return;
        };
        let tokens = self.conv.live().to_vec();
        if self.snapshots.back().is_some_and(|s| s.tokens == tokens) {
            return;
        }
        match self.conv.snapshot() {
            Ok(snap) if snap.as_bytes().len() <= self.cfg.snapshot_max_bytes => {
                self.snapshots.retain(|s| s.tokens != tokens);
                self.snapshots.push_back(MemSnapshot {
                    tokens,
                    snap,
                    logits,
                });
                while self.snapshots.len() > self.cfg.snapshot_slots {
                    self.snapshots.pop_front();
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "turn snapshot failed"),
        }
    }

    /// Generates the answer through the runtime's one generation loop
    /// ([`Conversation::generate_with`]); [`Turn`] answers its per-step questions.
    fn generate(&mut self, job: &Job, limit: usize) -> Result<Outcome, ApiError> {
        let p = &job.prepared;
        let tok = self.tok.clone();
        let mut sampler =
            Sampler::new(job.sampling.clone()).map_err(|e| ApiError::bad(e.to_string()))?;
        let forced = match &job.forced {
            Some(t) => Some(tok.encode_chat(t).map_err(engine_err)?),
            None => None,
        };
        let mut turn = Turn {
            job,
            eos: self.eos,
            stream: OutputStream::new(StreamOptions {
                thinking: p.thinking,
                tools: p.tools,
                stop: job.stop.clone(),
            }),
            dec: tok.stream_decoder(),
            forced,
            ids: Vec::new(),
            stream_tokens: 0,
            halted: None,
            save: SaveCtx {
                tok: &self.tok,
                toolmem: &self.toolmem,
                cfg: &self.cfg,
                stats: &self.stats,
            },
            disk: &mut self.disk,
            shutdown: &self.shutdown,
        };
        let limits = GenLimits {
            max_tokens: limit,
            eos: self.eos,
            ignore_eos: false,
            feed_all: true,
        };
        let ran = self
            .conv
            .generate_with(&mut sampler, limits, &job.cancel, &mut turn);
        let Turn {
            mut stream,
            mut dec,
            mut ids,
            stream_tokens,
            mut halted,
            ..
        } = turn;
        let mut cancelled = false;
        let (generated, cause) = match ran {
            Ok(g) => {
                let n = g.tokens.len() - usize::from(g.stop == GenStop::Eos);
                let cause = match g.stop {
                    GenStop::Eos => EndCause::Eos,
                    GenStop::Length => EndCause::Length,
                    GenStop::Interrupted => {
                        cancelled = true;
                        EndCause::Error("cancelled".into())
                    }
                    GenStop::Halted => match halted.take() {
                        // A stop sequence (or complete tool calls) ended the text.
                        None => EndCause::Eos,
                        Some(Halted::Cancelled) => {
                            cancelled = true;
                            EndCause::Error("cancelled".into())
                        }
                        Some(Halted::Shutdown) => EndCause::Error("shutdown requested".into()),
                    },
                };
                (n, cause)
            }
            Err(e) => {
                let n = stream_tokens;
                if !matches!(
                    e,
                    DriverError::NoLogits | DriverError::Engine(EngineError::Sampler(_))
                ) {
                    // The state is partial; nothing after it can be trusted.
                    self.discard_live();
                }
                (n, EndCause::Error(e.to_string()))
            }
        };
        if cancelled {
            Stats::add(&self.stats.cancelled, 1);
        }
        let rest = dec.finish();
        if !rest.is_empty() {
            let evs = stream.push(&rest);
            emit(&self.stats, &self.cfg, job, &mut ids, evs);
        }
        let stop_hit = stream.halted() == Some(Halt::StopSequence);
        let reasoning_closed = !p.thinking || stream.text().contains(THINK_CLOSE_TEXT);
        let (evs, output) = stream.finish(cause);
        emit(&self.stats, &self.cfg, job, &mut ids, evs);
        while ids.len() < output.message.tool_calls.len() {
            ids.push(random_id(job.tool_id_prefix, 32));
        }
        ids.truncate(output.message.tool_calls.len());
        self.remember(job, &output, &ids, stop_hit || cancelled);
        self.publish();
        Ok(Outcome {
            output,
            tool_ids: ids,
            usage: Usage {
                completion_tokens: generated,
                ..Usage::default()
            },
            reasoning_closed,
        })
    }

    /// Bookkeeping after a turn: exact DSML for the call ids, the thinking-visible binding.
    fn remember(&mut self, job: &Job, out: &FinalOutput, ids: &[String], tainted: bool) {
        if self.cfg.exact_dsml_replay && !ids.is_empty() {
            if let Some(raw) = &out.message.raw_dsml {
                let block: Arc<str> = Arc::from(raw.as_str());
                let mut tm = lock(&self.toolmem);
                for id in ids {
                    tm.insert(id, block.clone());
                }
            }
        }
        self.visible = None;
        let p = &job.prepared;
        let clean = !tainted && out.finish == ds4_chat::stream::FinishReason::Stop;
        // A turn that ended by itself (EOS or complete tool calls) can be continued with
        // tool outputs or, on Responses, a `previous_response_id`.
        let ended = !tainted
            && matches!(
                out.finish,
                ds4_chat::stream::FinishReason::Stop | ds4_chat::stream::FinishReason::ToolCalls
            );
        self.binding =
            (ended && job.continuation.is_some() && self.conv.pos() > 0).then(|| ToolBinding {
                endpoint: job.endpoint,
                response_id: job.response_id.clone(),
                call_ids: ids.to_vec(),
                tools: p.tools,
                frontier: self.conv.pos(),
            });
        if clean
            && p.thinking
            && !p.tool_context
            && out.message.tool_calls.is_empty()
            && out.message.reasoning.is_some()
        {
            if let Some(prefix) = p.text.strip_suffix(THINK_OPEN_TEXT) {
                self.visible = Some(Visible {
                    text: format!("{prefix}{THINK_CLOSE_TEXT}{}", out.message.content),
                    live_len: self.conv.pos(),
                });
            }
        }
    }
}

/// Why [`Turn::halt`] ended a generation.
enum Halted {
    /// The client went away.
    Cancelled,
    /// The server is stopping.
    Shutdown,
}

/// The server's side of one generation: what the runtime's loop asks at each step — the
/// forced or greedy token, the streamed text (stop sequences, tool calls, deltas to the
/// client), and the `continued` disk checkpoints between tokens.
struct Turn<'a, 't> {
    job: &'a Job,
    eos: u32,
    stream: OutputStream,
    /// Borrows the tokenizer, not the worker: it outlives the turn's borrows of the worker.
    dec: ds4_chat::StreamDecoder<'t>,
    forced: Option<Vec<u32>>,
    /// Tool-call ids, in call order, assigned when a call is announced.
    ids: Vec<String>,
    /// Tokens emitted so far (EOS excluded).
    stream_tokens: usize,
    halted: Option<Halted>,
    save: SaveCtx<'a>,
    disk: &'a mut Option<Disk>,
    shutdown: &'a AtomicBool,
}

/// Maps parser events to deltas, assigning a tool-call id when a call is announced.
fn emit(
    stats: &Stats,
    cfg: &ServerConfig,
    job: &Job,
    ids: &mut Vec<String>,
    evs: Vec<StreamEvent>,
) {
    for e in evs {
        let d = match e {
            StreamEvent::Reasoning(s) => Delta::Reasoning(s),
            StreamEvent::Content(s) => Delta::Content(s),
            StreamEvent::ToolCallStart { index, name } => {
                while ids.len() <= index {
                    ids.push(random_id(job.tool_id_prefix, 32));
                }
                Delta::ToolStart {
                    index,
                    id: ids[index].clone(),
                    name,
                }
            }
            StreamEvent::ToolCallArguments { index, fragment } => {
                Delta::ToolArgs { index, fragment }
            }
            StreamEvent::ToolCallEnd { index } => Delta::ToolEnd { index },
        };
        send(stats, cfg, job, JobEvent::Delta(d));
    }
}

impl Steer for Turn<'_, '_> {
    fn halt(&mut self) -> bool {
        if self.job.cancel.load(Ordering::Relaxed) || self.job.events.is_closed() {
            self.halted = Some(Halted::Cancelled);
        } else if self.shutdown.load(Ordering::Relaxed) {
            self.halted = Some(Halted::Shutdown);
        }
        self.halted.is_some()
    }

    fn choose(&mut self, step: usize, logits: Option<&[f32]>) -> Option<u32> {
        if let Some(f) = &self.forced {
            return Some(f.get(step).copied().unwrap_or(self.eos));
        }
        // Inside a tool call's structure (names, keys) the most likely token is taken, so
        // the sampler's randomness cannot break the DSML (docs/chat.md).
        let st = self.stream.dsml_state();
        if st.in_tool_call() && !st.uses_payload_sampling() {
            return logits.map(argmax);
        }
        None
    }

    fn token(&mut self, t: u32) -> Flow {
        self.stream_tokens += 1;
        let text = self.dec.push(t).unwrap_or_default();
        let evs = self.stream.push(&text);
        emit(self.save.stats, self.save.cfg, self.job, &mut self.ids, evs);
        Stats::add(&self.save.stats.generated_tokens, 1);
        if self.stream.halted().is_some() {
            Flow::Stop
        } else {
            Flow::Continue
        }
    }

    fn fed(&mut self, conv: &mut Conversation) {
        if next_continued(self.disk) == Some(conv.pos()) && !self.stream.dsml_state().in_tool_call()
        {
            disk_save(conv, self.disk, &self.save, "continued");
        }
        if let Some(d) = self.save.cfg.token_delay {
            std::thread::sleep(d);
        }
    }
}

/// Sends one event to the job's handler; a client that is gone or stopped reading
/// cancels its job.
fn send(stats: &Stats, cfg: &ServerConfig, job: &Job, ev: JobEvent) {
    if matches!(ev, JobEvent::Delta(_)) && !job.deltas {
        return;
    }
    if job.events.try_send(ev).is_err() {
        // Receiver gone (disconnect) or buffer full (stalled client): stop the job.
        if !job.events.is_closed() && !job.cancel.swap(true, Ordering::Relaxed) {
            Stats::add(&stats.stalled, 1);
        }
        job.cancel.store(true, Ordering::Relaxed);
        return;
    }
    // Back-pressure: events are waiting and the client has taken none for the stall
    // timeout (its socket stopped draining). Cancel instead of generating into buffers.
    let waiting = job.events.max_capacity() - job.events.capacity();
    if job.deltas && waiting > 1 && !job.cancel.load(Ordering::Relaxed) {
        let idle = crate::limits::now_ms().saturating_sub(job.taken_ms.load(Ordering::Relaxed));
        if idle > cfg.stall_timeout.as_millis() as u64 {
            tracing::warn!(
                idle_ms = idle,
                waiting,
                "streaming client stopped reading; cancelling"
            );
            Stats::add(&stats.stalled, 1);
            job.cancel.store(true, Ordering::Relaxed);
        }
    }
}

/// What writing a disk checkpoint needs besides the conversation and the store.
struct SaveCtx<'a> {
    tok: &'a Tokenizer,
    toolmem: &'a Mutex<ToolMemory>,
    cfg: &'a ServerConfig,
    stats: &'a Stats,
}

/// Saves the live state as a disk checkpoint (if enabled and long enough).
fn disk_save(conv: &mut Conversation, disk: &mut Option<Disk>, c: &SaveCtx<'_>, reason: &str) {
    let n = conv.pos();
    let Some(d) = &*disk else { return };
    if n == 0 || n < d.cfg.min_tokens {
        return;
    }
    // Server checkpoints always carry the logits: a prompt that ends exactly at one
    // then starts sampling at once.
    if conv.logits().is_none() {
        return;
    }
    let payload = match conv.checkpoint() {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "cannot snapshot for the disk cache");
            return;
        }
    };
    let tool_map = if c.cfg.exact_dsml_replay {
        let text = c.tok.decode_lossy(conv.live()).unwrap_or_default();
        lock(c.toolmem).blocks_in(&text)
    } else {
        Default::default()
    };
    let tokens = conv.live().to_vec();
    let Some(d) = disk else { return };
    match d.store.store(&tokens, &payload, &tool_map) {
        Ok(StoreOutcome::Stored { name, evicted }) => {
            d.frontier = n;
            Stats::add(&c.stats.disk_stores, 1);
            tracing::info!(reason, tokens = n, entry = %name, evicted = evicted.len(), "disk KV checkpoint saved");
        }
        Ok(StoreOutcome::SkippedTooLarge { needed, budget }) => {
            tracing::warn!(
                reason,
                needed,
                budget,
                "disk KV checkpoint larger than the budget; skipped"
            );
        }
        Err(e) => tracing::warn!(reason, error = %e, "disk KV checkpoint failed"),
    }
}

/// The next `continued` checkpoint position (docs/server.md §11), if any.
fn next_continued(disk: &Option<Disk>) -> Option<usize> {
    let d = disk.as_ref()?;
    let step = d.cfg.continued_step();
    (step > 0).then(|| d.frontier + step)
}

/// Resolves a request's sampling (docs/server.md §6): defaults temperature 1, top_p 1, min_p 0.05,
/// top_k 0 (values above 1024 capped), seed 0 = time-derived; in thinking modes the client's
/// knobs are ignored and the defaults forced (as DeepSeek's API does).
pub fn sampler_config(
    s: &crate::api::Sampling,
    thinking: bool,
    fallback_seed: u64,
) -> SamplerConfig {
    let d = crate::api::Sampling::default();
    let s = if thinking { &d } else { s };
    let mut top_p = s.top_p.unwrap_or(1.0);
    let mut top_k = s.top_k.unwrap_or(0).min(1024) as usize;
    if top_p <= 0.0 {
        // top_p 0 keeps only the most likely token.
        top_p = 1.0;
        top_k = 1;
    }
    let seed = match s.seed {
        Some(0) | None => fallback_seed,
        Some(x) => x,
    };
    SamplerConfig {
        temperature: s.temperature.unwrap_or(1.0),
        top_k,
        top_p,
        min_p: s.min_p.unwrap_or(0.05),
        repeat_penalty: 1.0,
        repeat_window: 64,
        seed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Sampling;

    #[test]
    fn ids_have_the_right_shape() {
        let a = random_id("call_", 32);
        assert!(a.starts_with("call_") && a.len() == 37);
        assert!(a[5..].bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(a, random_id("call_", 32));
        assert_eq!(random_id("x", 3).len(), 4);
    }

    #[test]
    fn sampling_defaults_and_thinking_override() {
        let s = Sampling {
            temperature: Some(0.0),
            top_p: Some(0.0),
            min_p: None,
            top_k: Some(5000),
            seed: Some(7),
        };
        let c = sampler_config(&s, false, 99);
        assert_eq!(
            (c.temperature, c.top_p, c.top_k, c.min_p, c.seed),
            (0.0, 1.0, 1, 0.05, 7)
        );
        let c = sampler_config(&s, true, 99);
        assert_eq!((c.temperature, c.top_p, c.top_k, c.seed), (1.0, 1.0, 0, 99));
        let c = sampler_config(
            &Sampling {
                top_k: Some(5000),
                ..Sampling::default()
            },
            false,
            1,
        );
        assert_eq!(c.top_k, 1024);
    }
}
