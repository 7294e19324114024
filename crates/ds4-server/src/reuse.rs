//! The slots' state and prefix reuse (docs/server.md §9, §11): [`SlotCache`] owns the KV
//! slots and everything tied to their live state — which slot a job lands in, the cheapest
//! way to bring that slot to the job's prompt (its tool binding, its live tokens, its
//! thinking-visible text, an in-memory turn snapshot, a disk checkpoint, or a cold
//! prefill), the disk checkpoints written from a slot, and the bookkeeping a finished turn
//! leaves for the next request.
//!
//! Per slot: the live tokens and logits, the thinking-visible text, the `continued`
//! schedule. Shared by the slots: the turn snapshots and the disk store (either restores
//! into whichever slot a job lands in), and the one tool binding (the latest clean turn's).
//!
//! This module sits below the scheduler ([`crate::sched`]) and a slot's generation
//! ([`crate::turn`]): both act on the slots through it, and it knows neither.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use ds4_chat::stream::FinalOutput;
use ds4_chat::tokenizer::{THINK_CLOSE_TEXT, THINK_OPEN_TEXT};
use ds4_chat::Tokenizer;
use ds4_kvstore::{KvStore, Mode, StoreConfig, StoreOutcome};
use ds4_runtime::checkpoint::Format;
use ds4_runtime::Slots;

use crate::config::{DiskCacheConfig, ServerConfig};
use crate::cuts;
use crate::diskcache::{self, continuation};
use crate::error::{engine_err, ApiError, ServerError};
use crate::live::ToolBinding;
use crate::prepare::Prepared;
use crate::stats::Stats;
use crate::toolmem::{lock, ToolMemory};
use crate::worker::Job;

pub(crate) struct MemSnapshot {
    pub tokens: Vec<u32>,
    pub snap: ds4_engine::Snapshot,
    pub logits: Vec<f32>,
}

/// A turn snapshot between its halves ([`SlotCache::turn_begin`] at the end of a prompt,
/// [`SlotCache::turn_finish`] once the first token has gone out): the prompt's tokens, its
/// logits row, and the byte buffer the state will be written into.
pub(crate) struct TurnSnap {
    tokens: Vec<u32>,
    buf: Vec<u8>,
    logits: Vec<f32>,
}

/// After a tool-less thinking answer the client replays it without the reasoning; this
/// remembers the text it will send, so the live state (which has the reasoning) still counts
/// as its prefix (docs/server.md §9 `thinking-visible`).
pub(crate) struct Visible {
    pub text: String,
    pub live_len: usize,
}

pub(crate) struct Disk {
    pub store: KvStore,
    pub cfg: DiskCacheConfig,
}

/// What a slot remembers between jobs, besides its KV state.
#[derive(Default)]
struct SlotMemo {
    /// The thinking-visible text of its last answer (docs/server.md §9).
    visible: Option<Visible>,
    /// Live length at the slot's last disk save or load (the `continued` schedule counts
    /// from it).
    frontier: usize,
    /// When a job last landed here (least recently used slots are reused first).
    used: u64,
}

/// What a prompt reuses: (reused tokens, tokens still to evaluate, where the reuse came
/// from).
pub(crate) type Reuse = (usize, Vec<u32>, &'static str);

/// The KV slots and everything tied to their live state, with one owner: the scheduler
/// holds it, and every change to a slot's state goes through it, so the per-slot memory
/// (thinking-visible text, checkpoint schedule), the shared snapshots and the tool binding
/// cannot drift from the states they describe.
pub(crate) struct SlotCache {
    pub(crate) slots: Slots,
    memo: Vec<SlotMemo>,
    tok: Arc<Tokenizer>,
    /// The checkpoint settings the cuts follow: the disk cache's, or their defaults.
    bounds: DiskCacheConfig,
    /// In-memory turn snapshots, shared by the slots (any slot can restore one).
    snapshots: VecDeque<MemSnapshot>,
    disk: Option<Disk>,
    toolmem: Arc<Mutex<ToolMemory>>,
    /// What a slot's live state ends with after a clean Responses/Messages turn
    /// (docs/server.md §9): the latest such turn only; `None` once anything else touched
    /// that slot's state.
    binding: Option<(usize, ToolBinding)>,
    /// Where handlers read `binding`. Published only when a job ends, so a request
    /// planned while another job runs still sees the binding it was accepted with, and the
    /// worker answers 409 if that job moved the live state (docs/server.md §8).
    published: Arc<Mutex<Option<ToolBinding>>>,
    pub(crate) stats: Arc<Stats>,
    pub(crate) cfg: Arc<ServerConfig>,
    /// Counts placements (the least recently used idle slot is reused first).
    clock: u64,
}

/// Opens the disk cache `cfg.disk` names (evicting it to its budget) for `engine`'s model
/// (`identity`), context and numeric mode; tool maps saved with its entries go into tool
/// memory. Done before the slots are allocated, so a bad cache is reported first.
pub(crate) fn open_disk(
    cfg: &ServerConfig,
    identity: [u8; 32],
    engine: &ds4_engine::Engine,
    toolmem: &Mutex<ToolMemory>,
    stats: &Stats,
) -> Result<Option<Disk>, ServerError> {
    let ctx = engine.config().ctx;
    let mode = match engine.mode() {
        ds4_engine::NumericMode::Exact => Mode::Exact,
        ds4_engine::NumericMode::Official => Mode::Official,
    };
    let Some(d) = &cfg.disk else { return Ok(None) };
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
        let mut tm = lock(toolmem);
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
    Ok(Some(Disk {
        store,
        cfg: d.clone(),
    }))
}

impl SlotCache {
    /// Takes the slots and the disk cache ([`open_disk`]).
    pub(crate) fn new(
        slots: Slots,
        disk: Option<Disk>,
        tok: Arc<Tokenizer>,
        cfg: Arc<ServerConfig>,
        toolmem: Arc<Mutex<ToolMemory>>,
        published: Arc<Mutex<Option<ToolBinding>>>,
        stats: Arc<Stats>,
    ) -> SlotCache {
        let bounds = cfg
            .disk
            .clone()
            .unwrap_or_else(|| DiskCacheConfig::new(std::path::PathBuf::new()));
        SlotCache {
            memo: (0..slots.len()).map(|_| SlotMemo::default()).collect(),
            slots,
            tok,
            bounds,
            snapshots: VecDeque::new(),
            disk,
            toolmem,
            binding: None,
            published,
            stats,
            cfg,
            clock: 0,
        }
    }

    /// The checkpoint settings prompt cuts follow ([`crate::cuts::Cuts`]).
    pub(crate) fn bounds(&self) -> &DiskCacheConfig {
        &self.bounds
    }

    /// Makes the binding visible to handlers. Called when a job ends (before its `Done` is
    /// sent, so a client that answers a tool call at once finds it).
    pub(crate) fn publish(&self) {
        *self.published.lock().unwrap_or_else(|p| p.into_inner()) =
            self.binding.as_ref().map(|(_, b)| b.clone());
    }

    /// Forgets slot `i`'s state and everything derived from it.
    pub(crate) fn discard_live(&mut self, i: usize) {
        let _ = self.slots.reset(i);
        self.memo[i].visible = None;
        self.unbind(i);
        self.snapshots.clear();
    }

    /// Drops the tool binding if slot `i` holds it (its state is about to change).
    pub(crate) fn unbind(&mut self, i: usize) {
        if self.binding.as_ref().is_some_and(|(s, _)| *s == i) {
            self.binding = None;
        }
    }

    /// Marks slot `i` as the most recently used.
    pub(crate) fn touch(&mut self, i: usize) {
        self.clock += 1;
        self.memo[i].used = self.clock;
    }

    /// The idle slot for `job`: the one holding its tool binding when the job continues it,
    /// else the one whose live tokens give the longest reusable prefix, else the least
    /// recently used one. Some slot is idle when this is called.
    pub(crate) fn place(&self, job: &Job, idle: &[usize]) -> usize {
        if let (Some(t), Some((s, b))) = (job.prepared.live_tail.as_ref(), &self.binding) {
            if idle.contains(s) && b.frontier == self.slots.pos(*s) && t.matches(job.endpoint, b) {
                return *s;
            }
        }
        let p = &job.prepared;
        let reusable = |i: usize| -> usize {
            let n = self.slots.pos(i);
            if n == 0 {
                return 0;
            }
            let live = continuation(&self.tok, self.slots.live(i), p)
                .is_some_and(|s| !s.is_empty() || self.slots.has_logits(i));
            let visible = self.memo[i].visible.as_ref().is_some_and(|v| {
                v.live_len == n && p.text.len() > v.text.len() && p.text.starts_with(&v.text)
            });
            if live || visible {
                n
            } else {
                0
            }
        };
        let best = idle
            .iter()
            .map(|&i| (reusable(i), i))
            .filter(|&(n, _)| n > 0)
            .max_by_key(|&(n, i)| (n, std::cmp::Reverse(i)));
        match best {
            Some((_, i)) => i,
            None => idle
                .iter()
                .copied()
                .min_by_key(|&i| (self.memo[i].used, i))
                .unwrap_or(0),
        }
    }

    /// A tool-output continuation (docs/server.md §9 steps 2–3): when the job's tail answers the
    /// binding slot `i` ends with, the live tokens are reused and only the tail's suffix is
    /// evaluated. Consumes the binding.
    pub(crate) fn live_tail(&mut self, i: usize, job: &Job) -> Option<Reuse> {
        let t = job.prepared.live_tail.as_ref()?;
        let (s, b) = self.binding.as_ref()?;
        let live_len = self.slots.pos(i);
        if *s != i
            || b.frontier != live_len
            || live_len == 0
            || !self.slots.has_logits(i)
            || !t.matches(job.endpoint, b)
        {
            return None;
        }
        self.binding = None;
        self.memo[i].visible = None;
        Some((live_len, t.suffix_tokens.clone(), t.source()))
    }

    /// Picks how to reach the prompt and puts slot `i` there.
    pub(crate) fn reuse(&mut self, i: usize, p: &Prepared) -> Result<Reuse, ApiError> {
        let live_len = self.slots.pos(i);
        if live_len > 0 {
            if let Some(s) = continuation(&self.tok, self.slots.live(i), p) {
                if !s.is_empty() || self.slots.has_logits(i) {
                    return Ok((live_len, s, "live"));
                }
            }
            if let Some(v) = &self.memo[i].visible {
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
        for k in (0..self.snapshots.len()).rev() {
            let m = &self.snapshots[k];
            if let Some(s) = continuation(&self.tok, &m.tokens, p) {
                self.slots
                    .restore(i, &m.snap, Some(m.logits.clone()))
                    .map_err(engine_err)?;
                self.memo[i].visible = None;
                let n = m.tokens.len();
                self.memo[i].frontier = self.memo[i].frontier.min(n);
                Stats::add(&self.stats.snapshot_hits, 1);
                return Ok((n, s, "snapshot"));
            }
        }
        if let Some(hit) = self.disk_lookup(p) {
            self.disk_save(i, "evict");
            if let Some(r) = self.disk_load(i, &hit.0, hit.1) {
                return Ok(r);
            }
        }
        if live_len > 0 {
            self.disk_save(i, "evict");
        }
        self.slots.reset(i).map_err(engine_err)?;
        self.memo[i].visible = None;
        self.memo[i].frontier = 0;
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

    fn disk_load(&mut self, i: usize, name: &str, suffix: Vec<u32>) -> Option<Reuse> {
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
        let resumed = match self.slots.resume(i, &loaded.payload, &loaded.tokens) {
            Ok(_) if suffix.is_empty() && !self.slots.has_logits(i) => Err(None),
            Ok(format) => Ok(format),
            Err(e) => Err(Some(e.to_string())),
        };
        match resumed {
            Ok(format) => {
                self.memo[i].visible = None;
                self.memo[i].frontier = loaded.tokens.len();
                if self.cfg.exact_dsml_replay {
                    let mut tm = lock(&self.toolmem);
                    for (id, block) in &loaded.tool_map {
                        tm.insert(id, Arc::from(block.as_str()));
                    }
                }
                Stats::add(&self.stats.disk_hits, 1);
                tracing::info!(
                    slot = i,
                    entry = name,
                    tokens = loaded.tokens.len(),
                    "disk KV hit"
                );
                if format.is_legacy() {
                    self.migrate(i, name, &loaded, format);
                }
                Some((loaded.tokens.len(), suffix, "disk"))
            }
            Err(None) => {
                // A usable entry for a longer prompt: kept.
                tracing::info!(entry = name, "disk KV entry has no logits for this prompt");
                let _ = self.slots.reset(i);
                None
            }
            Err(Some(why)) => {
                tracing::warn!(entry = name, reason = %why, "disk KV entry unusable; removed");
                if let Some(d) = self.disk.as_mut() {
                    let _ = d.store.remove(name);
                }
                Stats::add(&self.stats.disk_rejected, 1);
                None
            }
        }
    }

    /// Rewrites an entry written in a legacy payload format (by an older `ds4` or
    /// `ds4-server`) in the current one, keeping its tokens and tool map. Slot `i` holds
    /// exactly the entry's tokens here.
    fn migrate(&mut self, i: usize, name: &str, loaded: &ds4_kvstore::Loaded, from: Format) {
        let payload = match self.slots.checkpoint(i) {
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

    /// Saves slot `i`'s state as a disk checkpoint (if enabled and long enough).
    pub(crate) fn disk_save(&mut self, i: usize, reason: &str) {
        let n = self.slots.pos(i);
        let Some(d) = &self.disk else { return };
        if n == 0 || n < d.cfg.min_tokens {
            return;
        }
        // Server checkpoints always carry the logits: a prompt that ends exactly at one
        // then starts sampling at once.
        if !self.slots.has_logits(i) {
            return;
        }
        let payload = match self.slots.checkpoint(i) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "cannot snapshot for the disk cache");
                return;
            }
        };
        let tool_map = if self.cfg.exact_dsml_replay {
            let text = self
                .tok
                .decode_lossy(self.slots.live(i))
                .unwrap_or_default();
            lock(&self.toolmem).blocks_in(&text)
        } else {
            Default::default()
        };
        let tokens = self.slots.live(i).to_vec();
        let Some(d) = &mut self.disk else { return };
        match d.store.store(&tokens, &payload, &tool_map) {
            Ok(StoreOutcome::Stored { name, evicted }) => {
                self.memo[i].frontier = n;
                Stats::add(&self.stats.disk_stores, 1);
                tracing::info!(reason, slot = i, tokens = n, entry = %name, evicted = evicted.len(), "disk KV checkpoint saved");
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

    /// Where a cold prompt is checkpointed (docs/server.md §11 `cold`): the shared system/tools prefix
    /// (up to the last `⟨U⟩` before the first `⟨A⟩`), else the trimmed, aligned length; `None`
    /// without a disk cache or outside its cold-save lengths.
    pub(crate) fn cold_boundary(&self, tokens: &[u32]) -> Option<usize> {
        let d = self.disk.as_ref()?;
        if d.cfg.cold_max_tokens == 0 || tokens.len() > d.cfg.cold_max_tokens {
            return None;
        }
        let m = self.tok.markers();
        cuts::cold_position(tokens, m.user, m.assistant, &d.cfg)
    }

    /// The position besides the grids where a prompt of `tokens` is cut (docs/server.md §9
    /// "Prefill boundaries"), with or without a disk cache: its cold checkpoint's, whether
    /// or not it is saved.
    pub(crate) fn prompt_mark(&self, tokens: &[u32]) -> Option<usize> {
        let m = self.tok.markers();
        cuts::cold_position(tokens, m.user, m.assistant, &self.bounds)
    }

    /// Whether slot `i` is at a `continued` checkpoint position (docs/server.md §11): a
    /// multiple of the step past its last save or load.
    pub(crate) fn continued_due(&self, i: usize) -> bool {
        let Some(d) = self.disk.as_ref() else {
            return false;
        };
        let step = d.cfg.continued_step();
        let pos = self.slots.pos(i);
        step > 0 && pos > self.memo[i].frontier && pos.is_multiple_of(step)
    }

    /// The first half of the turn snapshot (docs/server.md §9): whether slot `i`'s state at
    /// the end of its prompt is to be kept and, if so, its tokens and logits row, copied
    /// before the first pick edits the row. It reuses the buffers of the snapshot it will
    /// push out (the oldest, when all `--snapshot-slots` are taken): that one is dropped
    /// here, even if the snapshot then fails.
    pub(crate) fn turn_begin(&mut self, i: usize) -> Option<TurnSnap> {
        if self.cfg.snapshot_slots == 0 || !self.slots.has_logits(i) {
            return None;
        }
        if self
            .snapshots
            .back()
            .is_some_and(|s| s.tokens == self.slots.live(i))
        {
            return None;
        }
        let full = self.snapshots.len() >= self.cfg.snapshot_slots;
        let (buf, mut logits) = full
            .then(|| self.snapshots.pop_front())
            .flatten()
            .map(|s| (s.snap.into_bytes(), s.logits))
            .unwrap_or_default();
        match self.slots.logits(i) {
            Ok(Some(l)) => {
                logits.clear();
                logits.extend_from_slice(l);
            }
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!(error = %e, "turn snapshot: the logits could not be read");
                return None;
            }
        }
        Some(TurnSnap {
            tokens: self.slots.live(i).to_vec(),
            buf,
            logits,
        })
    }

    /// Which of the turn snapshots one step is about to finish (`turns`: slot and snapshot,
    /// in the order [`SlotCache::turn_finish`] would keep them) would be pushed out again by
    /// a later one of the same step: when a burst of new requests starts generating
    /// together, only the last `--snapshot-slots` distinct states that fit are left after
    /// the step, and serialising the others (on the scheduler thread, with the device idle;
    /// BENCHMARKS.md, 2026-12-07 01:05) bought nothing. `true` marks
    /// one to drop unserialised; the kept ones and their order are what finishing all of
    /// them would leave (docs/server.md §9).
    pub(crate) fn turns_pushed_out(&self, turns: &[(usize, &TurnSnap)]) -> Vec<bool> {
        let lens: Vec<Option<usize>> = turns
            .iter()
            .map(|&(i, t)| {
                (self.slots.live(i) == t.tokens.as_slice())
                    .then(|| self.slots.snapshot_len(i).ok())
                    .flatten()
            })
            .collect();
        let tokens: Vec<&[u32]> = turns.iter().map(|(_, t)| t.tokens.as_slice()).collect();
        pushed_out(
            &tokens,
            &lens,
            self.cfg.snapshot_slots,
            self.cfg.snapshot_max_bytes,
        )
    }

    /// The second half: slot `i`'s state (still the one at the end of its prompt: its
    /// first token is picked and sent, not yet fed) into the kept snapshots.
    pub(crate) fn turn_finish(&mut self, i: usize, t: TurnSnap) {
        let TurnSnap {
            tokens,
            buf,
            logits,
        } = t;
        if self.slots.live(i) != tokens.as_slice() {
            tracing::warn!("turn snapshot: the slot moved on before its state was kept");
            return;
        }
        match self.slots.snapshot_into(i, buf) {
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

    /// Bookkeeping after a turn in slot `i`: exact DSML for the call ids, the tool
    /// binding, the thinking-visible text.
    pub(crate) fn remember(
        &mut self,
        i: usize,
        job: &Job,
        out: &FinalOutput,
        ids: &[String],
        tainted: bool,
    ) {
        if self.cfg.exact_dsml_replay && !ids.is_empty() {
            if let Some(raw) = &out.message.raw_dsml {
                let block: Arc<str> = Arc::from(raw.as_str());
                let mut tm = lock(&self.toolmem);
                for id in ids {
                    tm.insert(id, block.clone());
                }
            }
        }
        self.memo[i].visible = None;
        let p = &job.prepared;
        let clean = !tainted && out.finish == ds4_chat::stream::FinishReason::Stop;
        // A turn that ended by itself (EOS or complete tool calls) can be continued with
        // tool outputs or, on Responses, a `previous_response_id`.
        let ended = !tainted
            && matches!(
                out.finish,
                ds4_chat::stream::FinishReason::Stop | ds4_chat::stream::FinishReason::ToolCalls
            );
        let pos = self.slots.pos(i);
        if ended && job.continuation.is_some() && pos > 0 {
            // The latest turn's binding replaces any other slot's (only the latest
            // response can be continued).
            self.binding = Some((
                i,
                ToolBinding {
                    endpoint: job.endpoint,
                    response_id: job.response_id.clone(),
                    call_ids: ids.to_vec(),
                    tools: p.tools,
                    frontier: pos,
                },
            ));
        } else if self.binding.as_ref().is_some_and(|(s, _)| *s == i) {
            self.binding = None;
        }
        if clean
            && p.thinking
            && !p.tool_context
            && out.message.tool_calls.is_empty()
            && out.message.reasoning.is_some()
        {
            if let Some(prefix) = p.text.strip_suffix(THINK_OPEN_TEXT) {
                self.memo[i].visible = Some(Visible {
                    text: format!("{prefix}{THINK_CLOSE_TEXT}{}", out.message.content),
                    live_len: pos,
                });
            }
        }
    }
}

/// [`SlotCache::turns_pushed_out`] on plain data: `tokens[k]` and `lens[k]` (the snapshot's
/// bytes; `None` when it will not be kept at all: the slot moved on, or its size is unknown)
/// of the k-th snapshot finished in a step, `slots` kept snapshots at most, each at most
/// `max_bytes`. Walking from the last one back, a snapshot survives the step when it will be
/// kept (known size within the limit), no later one has its tokens (that one replaces it)
/// and fewer than `slots` later ones survive; every one that will be kept but does not
/// survive is marked.
pub(crate) fn pushed_out(
    tokens: &[&[u32]],
    lens: &[Option<usize>],
    slots: usize,
    max_bytes: usize,
) -> Vec<bool> {
    let mut out = vec![false; tokens.len()];
    let mut survivors: Vec<&[u32]> = Vec::new();
    for k in (0..tokens.len()).rev() {
        if lens[k].is_none_or(|n| n > max_bytes) {
            continue;
        }
        if survivors.contains(&tokens[k]) || survivors.len() >= slots {
            out[k] = true;
        } else {
            survivors.push(tokens[k]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::pushed_out;

    #[test]
    fn only_the_last_distinct_snapshots_that_fit_survive_a_step() {
        let (a, b, c, d) = (&[1u32, 2][..], &[3u32][..], &[4u32, 5, 6][..], &[7u32][..]);
        // One kept snapshot: only the last of four survives.
        let all = [Some(10); 4];
        assert_eq!(
            pushed_out(&[a, b, c, d], &all, 1, 100),
            [true, true, true, false]
        );
        // Two kept: the last two.
        assert_eq!(
            pushed_out(&[a, b, c, d], &all, 2, 100),
            [true, true, false, false]
        );
        // As many kept as finished: none dropped.
        assert_eq!(pushed_out(&[a, b, c], &all[..3], 3, 100), [false; 3]);
        // A later one too large is not kept, so it pushes nothing out (and is not marked:
        // it is never kept anyway).
        assert_eq!(
            pushed_out(&[a, b, c], &[Some(10), Some(10), Some(101)], 1, 100),
            [true, false, false]
        );
        // A slot that moved on (no size) keeps nothing and pushes nothing out.
        assert_eq!(
            pushed_out(&[a, b, c], &[Some(10), Some(10), None], 1, 100),
            [true, false, false]
        );
        // The same tokens later replace the earlier one whatever the slots.
        assert_eq!(
            pushed_out(&[a, b, a], &[Some(10); 3], 3, 100),
            [true, false, false]
        );
        // No kept snapshots at all: everything that would be kept is marked.
        assert_eq!(pushed_out(&[a, b], &[Some(10); 2], 0, 100), [true, true]);
        assert!(pushed_out(&[], &[], 1, 100).is_empty());
    }
}
