//! The scheduler (docs/server.md §9): one thread that owns the engine and its KV slots
//! (`--parallel N`, [`ds4_runtime::Slots`]) and serves up to N jobs at once.
//!
//! A job is taken off the queue only when a slot is idle, and lands in the idle slot that
//! reuses most of its prompt ([`crate::reuse`]). Then every step runs:
//! 1. at most `--prefill-chunk-per-step` prompt tokens of the oldest job still evaluating
//!    its prompt, in pieces that end at fixed absolute positions ([`crate::cuts`]), so a long
//!    prompt delays the running streams by one piece per token instead of stalling them;
//! 2. one batched decode step: every generating slot picks its next token
//!    ([`crate::turn`]) and all of them are fed in one forward pass.
//!
//! The slots' state (KV, reuse memory, snapshots, disk, tool binding) belongs to
//! [`crate::reuse::SlotCache`]; a slot's generation is [`crate::turn::Gen`]. Dependencies
//! run one way: `sched` → `turn` → `reuse` → `worker` (the job and its events).
//!
//! With one slot this is the single worker it replaced: the prompt is evaluated in pieces,
//! then tokens are decoded one by one, with the same reuse, checkpoints and events.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ds4_chat::Tokenizer;
use ds4_runtime::{Pick, Slots, SlotsError};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TryRecvError;

use crate::config::ServerConfig;
use crate::cuts::Cuts;
use crate::error::{ApiError, ServerError};
use crate::live::{self, ToolBinding};
use crate::reuse::{SlotCache, TurnSnap};
use crate::stats::Stats;
use crate::toolmem::ToolMemory;
use crate::trace::StepEvent;
use crate::turn::Gen;
use crate::worker::{send, Job, JobEvent, Usage};

/// What the slots hold, for the startup line (docs/server.md §9): the placement plan
/// budgeted exactly this many KV states of this context, so saying it at startup tells a
/// user what `--parallel` and `-c` bought before the first request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotsInfo {
    pub slots: usize,
    /// Tokens of context each slot holds.
    pub ctx: usize,
    /// KV bytes of all the slots together.
    pub kv_bytes: u64,
}

impl std::fmt::Display for SlotsInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} slot{} × {} ctx, KV {:.2} GiB",
            self.slots,
            if self.slots == 1 { "" } else { "s" },
            self.ctx,
            self.kv_bytes as f64 / (1u64 << 30) as f64
        )
    }
}

/// A job in a slot.
pub(crate) struct Task<'t> {
    pub job: Job,
    pub t0: Instant,
    /// Start order (the oldest prompt is evaluated first).
    pub seq: u64,
    pub usage0: Usage,
    pub source: &'static str,
    pub phase: Phase<'t>,
    /// Time spent in the decode steps that fed this job's tokens (the whole step when
    /// batched), for the "request done" line: what the rest of the generation's wall time
    /// spent outside the engine.
    pub decode_time: std::time::Duration,
    /// Host time blocked waiting for the device within those steps ([`ds4_engine::Counters`]):
    /// near `decode_time` when the device is the bottleneck, small when issuing launches is.
    pub wait_ns: u64,
    /// Time spent keeping the prompt's state for reuse (the turn snapshot): its logits row
    /// at the prompt's end, its state once the first token has gone out.
    pub snapshot_time: std::time::Duration,
    /// Host time picking this job's tokens and sending them (sampling, detokenizing, the
    /// stream's events): the scheduler does it between two forward steps, so with N
    /// streams each step waits for N of these.
    pub pick_time: std::time::Duration,
    /// Wall time of the scheduler's decode steps that fed this job, picks and snapshots of
    /// every slot included: what `decode_time` leaves of it is the step's host work.
    pub step_time: std::time::Duration,
    /// The turn snapshot's first half, waiting for the first token to go out.
    pub turn: Option<TurnSnap>,
}

pub(crate) enum Phase<'t> {
    /// Evaluating `tokens[done..]` after the slot's state.
    Prefill {
        tokens: Vec<u32>,
        done: usize,
        /// Where a cold prompt is checkpointed (docs/server.md §11 `cold`).
        cold_at: Option<usize>,
        /// The prompt's own cut position besides the grids ([`SlotCache::prompt_mark`]).
        mark: Option<usize>,
    },
    Decode(Box<Gen<'t>>),
}

/// The scheduler's state: the jobs' steps over the slots, which [`SlotCache`] owns.
pub struct Worker {
    cache: SlotCache,
    tok: Arc<Tokenizer>,
    eos: u32,
    ctx: usize,
    /// Most prompt tokens evaluated per step.
    piece: usize,
    /// The fewest tokens a piece needs to join a joint prefill with other prompts' pieces
    /// in one step ([`Slots::prefill_joint`]); `None`: one piece per step (one slot, or an
    /// engine that cannot).
    joint_min: Option<usize>,
    /// Most tokens of one forward pass (the engine's prefill chunk).
    chunk: usize,
    /// The grids every prompt piece ends on ([`crate::cuts`]).
    cuts: Cuts,
    stats: Arc<Stats>,
    cfg: Arc<ServerConfig>,
    shutdown: Arc<AtomicBool>,
}

/// Prompt tokens a task has still to evaluate (`None`: it is generating).
fn remaining(t: &Task<'_>) -> Option<usize> {
    match &t.phase {
        Phase::Prefill { tokens, done, .. } => Some(tokens.len() - done),
        Phase::Decode(_) => None,
    }
}

/// Shares one step's prompt budget among `n` evaluating prompts, oldest first (docs/server.md
/// §9): `piece(k, limit)` is prompt `k`'s next piece (start, end) of at most `limit` tokens,
/// `None` where it takes none now (its client left). The oldest piece comes first; then the
/// next prompts' pieces while the budget lasts, each at least `min` tokens (a shorter one
/// waits). Returns (k, piece) for each; nothing when the oldest piece is shorter than `min`
/// (it runs alone, as every piece did before joint prefills).
fn share_budget(
    min: usize,
    mut budget: usize,
    n: usize,
    mut piece: impl FnMut(usize, usize) -> Option<(usize, usize)>,
) -> Vec<(usize, (usize, usize))> {
    let mut out = Vec::new();
    for k in 0..n {
        if budget < min {
            break;
        }
        let Some((start, end)) = piece(k, budget) else {
            continue;
        };
        if end - start < min {
            if out.is_empty() {
                return Vec::new();
            }
            continue;
        }
        budget -= end - start;
        out.push((k, (start, end)));
    }
    out
}

/// The startup error of slots that do not fit, naming the remedy.
fn slots_error(e: SlotsError, parallel: usize) -> ServerError {
    match e {
        SlotsError::Zero => ServerError::Config("--parallel must be at least 1".into()),
        SlotsError::Alloc { .. } => ServerError::Model(format!(
            "{e}; --parallel {parallel} needs {parallel} KV states of the whole context: lower --parallel (or -c/--ctx)"
        )),
    }
}

impl Worker {
    /// Opens the disk cache (evicting it to its budget; tool maps saved with disk entries are
    /// loaded into tool memory), then allocates the slots (`cfg.parallel` KV states of the
    /// engine's context).
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
        // One prefill chunk per piece by default: a cancel is noticed after at most one
        // chunk, and running streams wait at most one chunk per token.
        let chunk = engine.config().prefill_chunk.max(1);
        let piece = match cfg.prefill_per_step {
            0 => chunk,
            n => n,
        };
        let disk = crate::reuse::open_disk(&cfg, identity, &engine, &toolmem, &stats)?;
        let parallel = cfg.parallel;
        let slots = Slots::new(engine, parallel).map_err(|e| slots_error(e, parallel))?;
        let joint_min = if parallel > 1 {
            slots.joint_min_rows()
        } else {
            None
        };
        let kv = slots.kv_bytes_per_slot();
        tracing::info!(
            slots = parallel,
            ctx,
            kv_bytes_per_slot = kv,
            kv_mib_total = (kv.saturating_mul(parallel as u64)) as f64 / (1u64 << 20) as f64,
            prefill_per_step = piece,
            joint_prefill_min_tokens = joint_min.unwrap_or(0),
            "KV slots allocated"
        );
        stats.slots.store(parallel as u64, Ordering::Relaxed);
        let eos = tok.markers().eos;
        let cache = SlotCache::new(
            slots,
            disk,
            tok.clone(),
            cfg.clone(),
            toolmem,
            published,
            stats.clone(),
        );
        let cuts = Cuts::new(piece, chunk, cache.bounds());
        Ok(Worker {
            cache,
            tok,
            eos,
            ctx,
            piece,
            joint_min,
            chunk,
            cuts,
            stats,
            cfg,
            shutdown,
        })
    }

    /// The slots allocated ([`SlotsInfo`]).
    pub fn slots_info(&self) -> SlotsInfo {
        let slots = self.cache.slots.len();
        SlotsInfo {
            slots,
            ctx: self.ctx,
            kv_bytes: self
                .cache
                .slots
                .kv_bytes_per_slot()
                .saturating_mul(slots as u64),
        }
    }

    /// Runs jobs until the queue closes and the running ones end, then saves a `shutdown`
    /// checkpoint of every slot.
    pub fn run(mut self, mut rx: mpsc::Receiver<Job>) {
        let tok = self.tok.clone();
        let mut tasks: Vec<Option<Task<'_>>> = (0..self.cache.slots.len()).map(|_| None).collect();
        let mut closed = false;
        let mut seq = 0u64;
        loop {
            // Take jobs while a slot is idle: blocking when nothing runs.
            while !closed && tasks.iter().any(Option::is_none) {
                let busy = tasks.iter().any(Option::is_some);
                let job = if busy {
                    match rx.try_recv() {
                        Ok(j) => j,
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => {
                            closed = true;
                            break;
                        }
                    }
                } else {
                    match rx.blocking_recv() {
                        Some(j) => j,
                        None => {
                            closed = true;
                            break;
                        }
                    }
                };
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
                seq += 1;
                let events = job.events.clone();
                let idle: Vec<usize> = (0..tasks.len()).filter(|&i| tasks[i].is_none()).collect();
                // Running from the moment it leaves the queue (`/health` never shows a taken
                // job as neither queued nor running).
                Stats::add(&self.stats.running, 1);
                let r = catch_unwind(AssertUnwindSafe(|| self.start(job, seq, &idle)));
                match r {
                    Ok(Ok((slot, task))) => tasks[slot] = Some(task),
                    Ok(Err(e)) => {
                        Stats::sub(&self.stats.running, 1);
                        let _ = events.try_send(JobEvent::Failed(e));
                        self.cache.publish();
                    }
                    Err(_) => {
                        Stats::sub(&self.stats.running, 1);
                        self.panicked(&mut tasks);
                        let _ =
                            events.try_send(JobEvent::Failed(ApiError::internal("internal error")));
                    }
                }
            }
            if tasks.iter().all(Option::is_none) {
                if closed {
                    break;
                }
                continue;
            }
            let r = catch_unwind(AssertUnwindSafe(|| self.step(&mut tasks, &tok)));
            if r.is_err() {
                self.panicked(&mut tasks);
            }
        }
        for i in 0..self.cache.slots.len() {
            self.cache.disk_save(i, "shutdown");
        }
    }

    /// A panic inside a step: every running job fails and every slot is discarded (their
    /// states may be half-updated).
    fn panicked(&mut self, tasks: &mut [Option<Task<'_>>]) {
        Stats::add(&self.stats.worker_panics, 1);
        tracing::error!("the worker panicked; the live states were discarded");
        for (i, t) in tasks.iter_mut().enumerate() {
            if let Some(t) = t.take() {
                Stats::sub(&self.stats.running, 1);
                let _ = t
                    .job
                    .events
                    .try_send(JobEvent::Failed(ApiError::internal("internal error")));
            }
            self.cache.discard_live(i);
        }
        self.cache.publish();
    }

    /// Records one forward pass in the test hook's step log, when there is one.
    fn trace(&self, e: StepEvent) {
        if let Some(t) = &self.cfg.step_trace {
            t.push(e);
        }
    }

    pub(crate) fn stopping(&self, job: &Job) -> bool {
        job.cancel.load(Ordering::Relaxed)
            || job.events.is_closed()
            || self.shutdown.load(Ordering::Relaxed)
    }

    /// Places a job: picks its slot, brings the slot to the longest reusable prefix of the
    /// prompt and tells the client what is reused. The prompt's rest is evaluated by the
    /// following steps.
    fn start<'t>(
        &mut self,
        job: Job,
        seq: u64,
        idle: &[usize],
    ) -> Result<(usize, Task<'t>), ApiError> {
        let t0 = Instant::now();
        // Time in the queue is not the client's stall.
        job.taken_ms
            .store(crate::limits::now_ms(), Ordering::Relaxed);
        let slot = self.cache.place(&job, idle);
        self.cache.touch(slot);
        let (cached, suffix, source) = match self.cache.live_tail(slot, &job) {
            Some(r) => r,
            // Only the live state could serve it, and it moved since the request was
            // accepted: nothing was touched, so the binding (if any) stays.
            None => match job.prepared.live_tail.as_ref().filter(|t| t.required) {
                Some(t) => return Err(live::conflict(&t.continuation)),
                None => {
                    self.cache.unbind(slot);
                    self.cache.reuse(slot, &job.prepared)?
                }
            },
        };
        let usage0 = Usage {
            prompt_tokens: cached + suffix.len(),
            cached_tokens: cached,
            completion_tokens: 0,
            draft: None,
        };
        if usage0.prompt_tokens >= self.ctx {
            return Err(ApiError::context_overflow(
                usage0.prompt_tokens,
                self.ctx,
                job.prompt_param,
            ));
        }
        tracing::debug!(slot, source, cached, prefill = suffix.len(), "prompt");
        send(
            &self.stats,
            &self.cfg,
            &job,
            JobEvent::Started {
                usage: usage0,
                source,
            },
        );
        Stats::add(&self.stats.cached_tokens, cached as u64);
        let cold_at = if cached == 0 {
            self.cache.cold_boundary(&suffix)
        } else {
            None
        };
        // A tool-output continuation's prepared tokens are only its suffix (after generated
        // tokens): no cut of the whole prompt can be read from them.
        let mark = match &job.prepared.live_tail {
            Some(t) if t.required => None,
            _ => self.cache.prompt_mark(&job.prepared.tokens),
        };
        Ok((
            slot,
            Task {
                job,
                t0,
                seq,
                usage0,
                source,
                decode_time: std::time::Duration::ZERO,
                wait_ns: 0,
                snapshot_time: std::time::Duration::ZERO,
                pick_time: std::time::Duration::ZERO,
                step_time: std::time::Duration::ZERO,
                turn: None,
                phase: Phase::Prefill {
                    tokens: suffix,
                    done: 0,
                    cold_at,
                    mark,
                },
            },
        ))
    }

    /// One scheduler step: the oldest evaluating job's next prompt pieces up to the step's
    /// budget (or one joint prefill of several jobs' pieces), then one batched decode step of
    /// every generating slot. A job whose prompt is wholly reused starts
    /// generating at once (it has no piece to wait for); a job still evaluating its prompt
    /// whose client went away frees its slot at once, not at its next piece.
    fn step<'t>(&mut self, tasks: &mut [Option<Task<'t>>], tok: &'t Tokenizer) {
        for (i, entry) in tasks.iter_mut().enumerate() {
            match entry.as_ref().and_then(remaining) {
                Some(0) => self.prefill_step(i, entry, tok),
                Some(_) if entry.as_ref().is_some_and(|t| self.stopping(&t.job)) => {
                    Stats::add(&self.stats.cancelled, 1);
                    self.end(entry);
                }
                _ => {}
            }
        }
        let mut evaluating: Vec<(u64, usize)> = tasks
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.as_ref().map(|t| (i, t)))
            .filter(|(_, t)| remaining(t).is_some())
            .map(|(i, t)| (t.seq, i))
            .collect();
        evaluating.sort_unstable();
        let order: Vec<usize> = evaluating.into_iter().map(|(_, i)| i).collect();
        let joint = self.joint_pieces(tasks, &order);
        if joint.len() > 1 {
            self.joint_prefill(tasks, &joint, tok);
        } else if let Some(&i) = order.first() {
            self.prefill_step(i, &mut tasks[i], tok);
        }
        self.decode_step(tasks);
    }

    /// Where slot `i`'s next prompt piece ends: at the prompt's next cut position
    /// ([`crate::cuts`]: the grids, the prompt's `mark`), so disk checkpoints land exactly
    /// at their boundaries and every run of a prompt is cut alike, cold or resumed.
    fn piece_end(&self, i: usize, len: usize, done: usize, mark: Option<usize>) -> usize {
        let pos = self.cache.slots.pos(i);
        done + (self.cuts.next(pos, pos + (len - done), mark) - pos)
    }

    /// The pieces of this step's joint prefill, (slot, start, end) oldest prompt first:
    /// the oldest's piece and then the next ones' while the step's budget (`piece` tokens,
    /// at most one engine chunk) lasts, each at least `joint_min` tokens and each whole up to
    /// its next cut (a piece cut short by the budget would be evaluated in other pieces than
    /// the same prompt alone). Fewer than two: the step runs the oldest piece alone.
    fn joint_pieces(
        &self,
        tasks: &[Option<Task<'_>>],
        order: &[usize],
    ) -> Vec<(usize, usize, usize)> {
        let Some(min) = self.joint_min else {
            return Vec::new();
        };
        let shares =
            share_budget(
                min,
                self.piece.min(self.chunk),
                order.len(),
                |k, limit| match tasks[order[k]].as_ref() {
                    Some(Task {
                        phase:
                            Phase::Prefill {
                                tokens, done, mark, ..
                            },
                        job,
                        ..
                    }) if !self.stopping(job) => {
                        let end = self.piece_end(order[k], tokens.len(), *done, *mark);
                        (end - *done <= limit).then_some((*done, end))
                    }
                    _ => None,
                },
            );
        shares
            .into_iter()
            .map(|(k, (start, end))| (order[k], start, end))
            .collect()
    }

    /// Evaluates `pieces` (from [`Worker::joint_pieces`]) in one forward pass; then each
    /// slot goes on as after its own piece. If the pass fails, every named slot's job
    /// fails and its state is discarded.
    fn joint_prefill<'t>(
        &mut self,
        tasks: &mut [Option<Task<'t>>],
        pieces: &[(usize, usize, usize)],
        tok: &'t Tokenizer,
    ) {
        let r = {
            let refs: Vec<(usize, &[u32])> = pieces
                .iter()
                .filter_map(|&(i, a, b)| match tasks[i].as_ref().map(|t| &t.phase) {
                    Some(Phase::Prefill { tokens, .. }) => Some((i, &tokens[a..b])),
                    _ => None,
                })
                .collect();
            self.cache.slots.prefill_joint(&refs)
        };
        if let Err(e) = r {
            for &(i, _, _) in pieces {
                self.cache.discard_live(i);
                if let Some(task) = tasks[i].as_ref() {
                    send(
                        &self.stats,
                        &self.cfg,
                        &task.job,
                        JobEvent::Failed(ApiError::internal(e.to_string())),
                    );
                }
                self.end(&mut tasks[i]);
            }
            return;
        }
        Stats::add(&self.stats.joint_pieces, pieces.len() as u64);
        for &(i, start, end) in pieces {
            if let Some(t) = tasks[i].as_ref() {
                self.trace(StepEvent::Prefill {
                    job: t.seq,
                    tokens: end - start,
                });
            }
        }
        for &(i, _, end) in pieces {
            self.piece_landed(i, &mut tasks[i], end, tok);
        }
    }

    /// Evaluates the next pieces of slot `i`'s prompt, each up to its next cut position,
    /// while the step's budget (`--prefill-chunk-per-step` tokens) lasts; at the prompt's end
    /// the generation starts. A cancelled or failed job leaves its slot.
    fn prefill_step<'t>(&mut self, i: usize, slot: &mut Option<Task<'t>>, tok: &'t Tokenizer) {
        let mut budget = self.piece;
        loop {
            let Some(task) = slot.as_mut() else { return };
            let Phase::Prefill {
                tokens, done, mark, ..
            } = &mut task.phase
            else {
                return;
            };
            if *done >= tokens.len() {
                return self.begin_generation(i, slot, tok);
            }
            if self.stopping(&task.job) {
                Stats::add(&self.stats.cancelled, 1);
                self.end(slot);
                return;
            }
            let end = self.piece_end(i, tokens.len(), *done, *mark);
            // The first piece always fits: a piece is at most one grid cell, the grid at
            // most the budget.
            if end - *done > budget {
                return;
            }
            if let Err(e) = self.cache.slots.prefill(i, &tokens[*done..end]) {
                // The state is unchanged or partial; nothing after it can be trusted.
                self.cache.discard_live(i);
                send(
                    &self.stats,
                    &self.cfg,
                    &task.job,
                    JobEvent::Failed(ApiError::internal(e.to_string())),
                );
                self.end(slot);
                return;
            }
            self.trace(StepEvent::Prefill {
                job: task.seq,
                tokens: end - *done,
            });
            budget -= end - *done;
            self.piece_landed(i, slot, end, tok);
            if budget == 0 {
                return;
            }
        }
    }

    /// Slot `i`'s prompt has been evaluated up to `end`: counts it, saves the disk
    /// checkpoint that lands there, and starts the generation at the prompt's end.
    fn piece_landed<'t>(
        &mut self,
        i: usize,
        slot: &mut Option<Task<'t>>,
        end: usize,
        tok: &'t Tokenizer,
    ) {
        let Some(Task {
            phase:
                Phase::Prefill {
                    tokens,
                    done,
                    cold_at,
                    ..
                },
            ..
        }) = slot.as_mut()
        else {
            return;
        };
        Stats::add(&self.stats.prefilled_tokens, (end - *done) as u64);
        *done = end;
        let finished = *done == tokens.len();
        let pos = self.cache.slots.pos(i);
        if *cold_at == Some(pos) {
            self.cache.disk_save(i, "cold");
        } else if self.cache.continued_due(i) {
            self.cache.disk_save(i, "continued");
        }
        if finished {
            self.begin_generation(i, slot, tok);
        }
    }

    /// Slot `i`'s prompt is all in its state: the turn snapshot's first half, then the
    /// generation (or the job's failure).
    fn begin_generation<'t>(&mut self, i: usize, slot: &mut Option<Task<'t>>, tok: &'t Tokenizer) {
        let Some(task) = slot.as_mut() else { return };
        let t_prefill = task.t0.elapsed();
        // The turn snapshot's logits now (the first pick edits the row); its state after the
        // first token has gone out (decode_step), so the snapshot does not delay it.
        let t_snap = Instant::now();
        task.turn = self.cache.turn_begin(i);
        task.snapshot_time = t_snap.elapsed();
        let limit = task
            .job
            .max_tokens
            .map_or(self.cfg.default_max_tokens, |m| {
                m.min(usize::MAX as u64) as usize
            })
            .min(self.cfg.max_tokens)
            .min(self.ctx - task.usage0.prompt_tokens);
        // Drafting (docs/server.md §9): the job's drafter, when the backend verifies bit
        // for bit. A request's `"draft": "mtp"` on a server without the block was refused
        // before the job was queued (`http::admit_and_prepare`).
        let d = task.job.draft;
        let drafter = if d.on() && self.cache.slots.can_verify() {
            d.drafter(self.cache.slots.engine().has_mtp())
        } else {
            ds4_runtime::Drafter::None
        };
        let made = Gen::new(&task.job, tok, self.eos, limit, t_prefill, drafter);
        match made {
            Ok(g) => {
                // A default min-p draw needs only the logits near the maximum: lone decode
                // steps leave that band and the row stays on the device (docs/server.md §6).
                self.cache.slots.set_band(i, g.band_span());
                task.phase = Phase::Decode(Box::new(g));
            }
            Err(e) => {
                send(&self.stats, &self.cfg, &task.job, JobEvent::Failed(e));
                self.end(slot);
            }
        }
    }

    /// Every generating slot's pick for this step, in slot order (`ids`). Two or more
    /// draw at once on the thread pool: each touches only its own generation and its
    /// slot's logits ([`Slots::host_steps`]), and a full-row draw (top-p, top-k, a min-p
    /// band the device's capacity cut short) scans the whole vocabulary — one after
    /// another they held the device idle for milliseconds a step (docs/server.md §9). A
    /// pick that wanted a row still on the device, and every pick when the rows could not
    /// be fetched, runs again alone (nothing was drawn or sent by the first try).
    fn pick_all(
        &mut self,
        tasks: &mut [Option<Task<'_>>],
        ids: &[usize],
    ) -> Vec<Result<Pick, ds4_runtime::DriverError>> {
        use rayon::prelude::*;
        let mut out: Vec<Option<Result<Pick, ds4_runtime::DriverError>>> =
            ids.iter().map(|_| None).collect();
        let (stats, cfg, shutdown) = (&self.stats, &self.cfg, &self.shutdown);
        if ids.len() > 1 {
            if let Ok(steps) = self.cache.slots.host_steps(ids) {
                let mut work: Vec<_> = tasks
                    .iter_mut()
                    .enumerate()
                    .filter(|(i, _)| ids.contains(i))
                    .filter_map(|(_, t)| t.as_mut())
                    .zip(steps)
                    .zip(out.iter_mut())
                    .collect();
                work.par_iter_mut().for_each(|((task, step), slot)| {
                    let Phase::Decode(gen) = &mut task.phase else {
                        return;
                    };
                    let t_pick = Instant::now();
                    **slot = Some(match step {
                        None => Err(ds4_runtime::DriverError::NoLogits),
                        Some(d) => gen.pick(&task.job, d, stats, cfg, shutdown),
                    });
                    task.pick_time += t_pick.elapsed();
                });
            }
        }
        ids.iter()
            .zip(out)
            .map(|(&i, done)| match done {
                Some(r) if !matches!(r, Err(ds4_runtime::DriverError::RowOnDevice)) => r,
                _ => {
                    let Some(Task {
                        phase: Phase::Decode(gen),
                        job,
                        pick_time,
                        ..
                    }) = tasks[i].as_mut()
                    else {
                        return Err(ds4_runtime::DriverError::NoLogits);
                    };
                    let t_pick = Instant::now();
                    let r = match self.cache.slots.step(i) {
                        None => Err(ds4_runtime::DriverError::NoLogits),
                        Some(mut d) => gen.pick(job, &mut d, stats, cfg, shutdown),
                    };
                    *pick_time += t_pick.elapsed();
                    r
                }
            })
            .collect()
    }

    /// One token for every generating slot: each picks its token, then all are fed in one
    /// batched forward step; slots whose generation ended are finished.
    fn decode_step(&mut self, tasks: &mut [Option<Task<'_>>]) {
        let t_enter = Instant::now();
        let ids: Vec<usize> = tasks
            .iter()
            .enumerate()
            .filter(|(_, t)| {
                matches!(
                    t,
                    Some(Task {
                        phase: Phase::Decode(_),
                        ..
                    })
                )
            })
            .map(|(i, _)| i)
            .collect();
        // A token a verify step picked in place of a draft is fed without a pick.
        let mut pending: Vec<(usize, (u32, ds4_runtime::Flow))> = Vec::new();
        for &i in &ids {
            if let Some(Task {
                phase: Phase::Decode(gen),
                ..
            }) = tasks[i].as_mut()
            {
                if let Some(p) = gen.take_pending() {
                    pending.push((i, p));
                }
            }
        }
        let to_pick: Vec<usize> = ids
            .iter()
            .copied()
            .filter(|i| pending.iter().all(|p| p.0 != *i))
            .collect();
        let mut picked = self.pick_all(tasks, &to_pick).into_iter();
        let picks: Vec<Result<Pick, ds4_runtime::DriverError>> = ids
            .iter()
            .map(|i| match pending.iter().find(|p| p.0 == *i) {
                Some(&(_, (tok, flow))) => Ok(Pick::Feed { tok, flow }),
                None => picked
                    .next()
                    .unwrap_or(Err(ds4_runtime::DriverError::NoLogits)),
            })
            .collect();
        // Turn snapshots a later one of this step would push out at once are not taken.
        let turns: Vec<(usize, &TurnSnap)> = ids
            .iter()
            .filter_map(|&i| Some((i, tasks[i].as_ref()?.turn.as_ref()?)))
            .collect();
        let dropped: Vec<usize> = if turns.len() > 1 {
            let marks = self.cache.turns_pushed_out(&turns);
            turns
                .iter()
                .zip(marks)
                .filter_map(|(&(i, _), m)| m.then_some(i))
                .collect()
        } else {
            Vec::new()
        };
        let mut feeds = Vec::new();
        let mut flows = Vec::new();
        for (&i, picked) in ids.iter().zip(picks) {
            let entry = &mut tasks[i];
            let Some(task) = entry.as_mut() else {
                continue;
            };
            // The first token has gone out: the prompt's state, not yet fed anything, is
            // kept now (before this step feeds it, or before the job ends).
            if let Some(t) = task.turn.take() {
                if dropped.contains(&i) {
                    Stats::add(&self.stats.turn_snapshots_skipped, 1);
                } else {
                    let t_snap = Instant::now();
                    self.cache.turn_finish(i, t);
                    task.snapshot_time += t_snap.elapsed();
                }
            }
            match picked {
                Ok(Pick::Feed { tok, flow }) => {
                    feeds.push((i, tok));
                    flows.push(flow);
                }
                Ok(Pick::Stop(stop)) => self.finish(i, entry, Ok(stop)),
                Err(e) => self.finish(i, entry, Err(e)),
            }
        }
        if feeds.is_empty() {
            return;
        }
        // A slot that decodes alone drafts (docs/server.md §9); batched steps do not.
        if let [(i, tok)] = feeds[..] {
            if self.draft_step(tasks, i, tok, flows[0], t_enter) {
                return;
            }
        }
        let (t_step, w0) = (Instant::now(), self.cache.slots.engine().counters().wait_ns);
        let fed = self.cache.slots.decode(&feeds);
        let step = t_step.elapsed();
        if let [(i, _)] = feeds[..] {
            if let Some(Task {
                phase: Phase::Decode(gen),
                ..
            }) = tasks[i].as_mut()
            {
                gen.plain_step(step.as_secs_f64());
            }
        }
        let waited = self
            .cache
            .slots
            .engine()
            .counters()
            .wait_ns
            .saturating_sub(w0);
        for &(i, _) in &feeds {
            if let Some(t) = tasks[i].as_mut() {
                t.decode_time += step;
                t.wait_ns += waited;
            }
        }
        if fed.is_ok() {
            self.trace(StepEvent::Decode {
                jobs: feeds
                    .iter()
                    .filter_map(|&(i, _)| tasks[i].as_ref().map(|t| t.seq))
                    .collect(),
            });
        }
        if let Err(e) = fed {
            let why = e.to_string();
            for &(i, _) in &feeds {
                self.finish(
                    i,
                    &mut tasks[i],
                    Err(ds4_runtime::DriverError::Engine(
                        ds4_engine::EngineError::Config(why.clone()),
                    )),
                );
            }
            return;
        }
        for (&(i, _), flow) in feeds.iter().zip(flows) {
            if flow == ds4_runtime::Flow::Stop {
                self.finish(i, &mut tasks[i], Ok(ds4_runtime::GenStop::Halted));
                continue;
            }
            let Some(Task {
                phase: Phase::Decode(gen),
                ..
            }) = tasks[i].as_ref()
            else {
                continue;
            };
            if self.cache.continued_due(i) && !gen.in_tool_call() {
                self.cache.disk_save(i, "continued");
            }
        }
        let whole = t_enter.elapsed();
        for &(i, _) in &feeds {
            if let Some(t) = tasks[i].as_mut() {
                t.step_time += whole;
            }
        }
        if let Some(d) = self.cfg.token_delay {
            if tasks.iter().any(Option::is_some) {
                std::thread::sleep(d);
            }
        }
    }

    /// Slot `i`, the only one decoding this step, feeds `tok` (picked, emitted) with its
    /// drafter's proposals in one verify pass ([`ds4_runtime::draft_step`]). Returns
    /// whether it did; `false`: no drafts (drafting off or paused, no proposal, a token
    /// that ends the generation), and `tok` is still to be fed.
    fn draft_step(
        &mut self,
        tasks: &mut [Option<Task<'_>>],
        i: usize,
        tok: u32,
        flow: ds4_runtime::Flow,
        t_enter: Instant,
    ) -> bool {
        let Some(Task {
            phase: Phase::Decode(gen),
            job,
            ..
        }) = tasks[i].as_mut()
        else {
            return false;
        };
        if !gen.wants_drafts(flow) {
            return false;
        }
        let (stats, cfg, shutdown) = (&self.stats, &self.cfg, &self.shutdown);
        let (t_step, w0) = (Instant::now(), self.cache.slots.engine().counters().wait_ns);
        let ran = match self.cache.slots.draft_target(i) {
            Ok(mut target) => gen.draft_step(job, &mut target, tok, stats, cfg, shutdown),
            Err(e) => Err(e),
        };
        let drafted = match ran {
            Ok(None) => return false,
            Ok(Some(d)) => d,
            Err(e) => {
                self.finish(i, &mut tasks[i], Err(e));
                return true;
            }
        };
        let n_vocab = self.cache.slots.engine().hparams().n_vocab;
        self.cache
            .slots
            .set_logits(i, gen.verify_row(&drafted, n_vocab));
        let step = t_step.elapsed();
        let waited = self
            .cache
            .slots
            .engine()
            .counters()
            .wait_ns
            .saturating_sub(w0);
        if let Some(t) = tasks[i].as_mut() {
            t.decode_time += step;
            t.wait_ns += waited;
            self.trace(StepEvent::Decode { jobs: vec![t.seq] });
        }
        if let ds4_runtime::Verified::Stop(stop) = drafted.outcome {
            self.finish(i, &mut tasks[i], Ok(stop));
            return true;
        }
        if let Some(Task {
            phase: Phase::Decode(gen),
            ..
        }) = tasks[i].as_ref()
        {
            if self.cache.continued_due(i) && !gen.in_tool_call() {
                self.cache.disk_save(i, "continued");
            }
        }
        if let Some(t) = tasks[i].as_mut() {
            t.step_time += t_enter.elapsed();
        }
        if let Some(d) = self.cfg.token_delay {
            std::thread::sleep(d);
        }
        true
    }

    /// Empties a task's slot (the job ended without an outcome).
    pub(crate) fn end(&mut self, slot: &mut Option<Task<'_>>) {
        if slot.take().is_some() {
            Stats::sub(&self.stats.running, 1);
            self.cache.publish();
        }
    }

    /// Finishes slot `i`'s generation (`ran`: how it stopped, or the error that stopped
    /// it), sends the outcome and frees the slot.
    fn finish(
        &mut self,
        i: usize,
        slot: &mut Option<Task<'_>>,
        ran: Result<ds4_runtime::GenStop, ds4_runtime::DriverError>,
    ) {
        let Some(task) = slot.take() else { return };
        Stats::sub(&self.stats.running, 1);
        let Phase::Decode(gen) = task.phase else {
            self.cache.publish();
            return;
        };
        let (mut outcome, t_prefill) = gen.conclude(&mut self.cache, i, &task.job, ran);
        let usage0 = task.usage0;
        outcome.usage = Usage {
            completion_tokens: outcome.usage.completion_tokens,
            draft: outcome.usage.draft,
            ..usage0
        };
        tracing::info!(
            endpoint = ?task.job.endpoint,
            slot = i,
            source = task.source,
            prompt = usage0.prompt_tokens,
            cached = usage0.cached_tokens,
            generated = outcome.usage.completion_tokens,
            finish = outcome.output.finish.as_str(),
            prefill_ms = t_prefill.as_millis() as u64,
            decode_ms = task.decode_time.as_millis() as u64,
            decode_wait_ms = task.wait_ns / 1_000_000,
            snapshot_ms = task.snapshot_time.as_millis() as u64,
            pick_us = task.pick_time.as_micros() as u64,
            steps_ms = task.step_time.as_millis() as u64,
            total_ms = task.t0.elapsed().as_millis() as u64,
            "request done"
        );
        send(
            &self.stats,
            &self.cfg,
            &task.job,
            JobEvent::Done(Box::new(outcome)),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Prompts wanting `want[k]` more tokens (`None`: cancelled), from position 0.
    fn shares(min: usize, budget: usize, want: &[Option<usize>]) -> Vec<(usize, usize)> {
        share_budget(min, budget, want.len(), |k, limit| {
            want[k].map(|w| (0, w.min(limit)))
        })
        .into_iter()
        .map(|(k, (a, b))| (k, b - a))
        .collect()
    }

    #[test]
    fn a_steps_budget_is_shared_oldest_first() {
        // The oldest takes what it needs, the next the rest, the third nothing is left.
        assert_eq!(
            shares(5, 64, &[Some(40), Some(30), Some(10)]),
            vec![(0, 40), (1, 24)]
        );
        // A piece shorter than the minimum waits; a later one may still join.
        assert_eq!(
            shares(5, 64, &[Some(40), Some(3), Some(20)]),
            vec![(0, 40), (2, 20)]
        );
        // The oldest piece too short: it runs alone (no joint pass).
        assert!(shares(5, 64, &[Some(3), Some(40)]).is_empty());
        // Cancelled prompts take nothing; the next one counts as the oldest.
        assert_eq!(
            shares(5, 64, &[None, Some(10), Some(9)]),
            vec![(1, 10), (2, 9)]
        );
        // Less than the minimum left: the step ends there.
        assert_eq!(shares(5, 64, &[Some(60), Some(30)]), vec![(0, 60)]);
        // A long prompt takes the whole budget.
        assert_eq!(shares(5, 64, &[Some(500), Some(30)]), vec![(0, 64)]);
    }

    #[test]
    fn slots_that_do_not_fit_name_the_remedy() {
        let e = SlotsError::Alloc {
            slot: 3,
            slots: 4,
            ctx: 32768,
            source: ds4_engine::EngineError::Config("out of device memory".into()),
        };
        let msg = slots_error(e, 4).to_string();
        for want in [
            "slot 3 of 4",
            "out of device memory",
            "--parallel 4",
            "lower --parallel",
        ] {
            assert!(msg.contains(want), "{want:?} missing from {msg:?}");
        }
        assert!(slots_error(SlotsError::Zero, 0)
            .to_string()
            .contains("--parallel"));
    }
}
