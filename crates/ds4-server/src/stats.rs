//! Counters the server exposes on `GET /health`: they make queueing, prefix reuse and the
//! disk cache observable (tests assert on them; operators read them).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::json_out::Obj;

#[derive(Debug, Default)]
pub struct Stats {
    /// Generation requests accepted into the queue.
    pub requests: AtomicU64,
    /// Requests waiting for a slot right now.
    pub queued: AtomicU64,
    /// Jobs in slots right now (at most `slots`).
    pub running: AtomicU64,
    /// KV slots (`--parallel`), set at startup.
    pub slots: AtomicU64,
    /// 429 answers.
    pub rejected_busy: AtomicU64,
    /// Prompt tokens evaluated (not reused).
    pub prefilled_tokens: AtomicU64,
    /// Prompt pieces evaluated in joint prefills (several prompts in one forward pass,
    /// docs/server.md §9).
    pub joint_pieces: AtomicU64,
    /// Prompt tokens reused from the live state, a snapshot or the disk.
    pub cached_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Speculative decoding: verify steps, tokens drafted, drafts accepted.
    pub draft_steps: AtomicU64,
    pub drafted_tokens: AtomicU64,
    pub accepted_tokens: AtomicU64,
    /// Generations stopped because the client went away.
    pub cancelled: AtomicU64,
    pub snapshot_hits: AtomicU64,
    /// Turn snapshots not taken because a later one of the same step would have pushed
    /// them out at once (docs/server.md §9).
    pub turn_snapshots_skipped: AtomicU64,
    pub disk_hits: AtomicU64,
    pub disk_stores: AtomicU64,
    /// Disk entries found unusable and removed.
    pub disk_rejected: AtomicU64,
    /// Assistant tool-call turns rendered with their exact sampled DSML.
    pub exact_replays: AtomicU64,
    pub worker_panics: AtomicU64,
    /// Open client connections right now.
    pub connections: AtomicU64,
    /// Connections refused with 503 because the connection cap was reached.
    pub rejected_connections: AtomicU64,
    /// Requests answered 408 because the body stalled or took too long.
    pub timed_out: AtomicU64,
    /// Requests refused by the Host / Origin / Content-Type checks.
    pub rejected_origin: AtomicU64,
    /// Requests refused before rendering because they cannot fit the context.
    pub rejected_early: AtomicU64,
    /// Request bodies refused with 503 because the process-wide body budget stayed taken.
    pub rejected_body_budget: AtomicU64,
    /// Streaming generations cancelled because the client stopped reading.
    pub stalled: AtomicU64,
    /// Handler panics answered with 500.
    pub handler_panics: AtomicU64,
}

impl Stats {
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub fn sub(c: &AtomicU64, n: u64) {
        let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
            Some(v.saturating_sub(n))
        });
    }

    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }

    pub fn to_json(&self) -> String {
        let g = Stats::get;
        Obj::new()
            .num("requests", g(&self.requests))
            .num("queued", g(&self.queued))
            .num("running", g(&self.running))
            .num("slots", g(&self.slots))
            .num("rejected_busy", g(&self.rejected_busy))
            .num("prefilled_tokens", g(&self.prefilled_tokens))
            .num("joint_pieces", g(&self.joint_pieces))
            .num("cached_tokens", g(&self.cached_tokens))
            .num("generated_tokens", g(&self.generated_tokens))
            .num("draft_steps", g(&self.draft_steps))
            .num("drafted_tokens", g(&self.drafted_tokens))
            .num("accepted_tokens", g(&self.accepted_tokens))
            .num("cancelled", g(&self.cancelled))
            .num("snapshot_hits", g(&self.snapshot_hits))
            .num("turn_snapshots_skipped", g(&self.turn_snapshots_skipped))
            .num("disk_hits", g(&self.disk_hits))
            .num("disk_stores", g(&self.disk_stores))
            .num("disk_rejected", g(&self.disk_rejected))
            .num("exact_replays", g(&self.exact_replays))
            .num("worker_panics", g(&self.worker_panics))
            .num("connections", g(&self.connections))
            .num("rejected_connections", g(&self.rejected_connections))
            .num("timed_out", g(&self.timed_out))
            .num("rejected_origin", g(&self.rejected_origin))
            .num("rejected_early", g(&self.rejected_early))
            .num("rejected_body_budget", g(&self.rejected_body_budget))
            .num("stalled", g(&self.stalled))
            .num("handler_panics", g(&self.handler_panics))
            .end()
    }
}
