//! What the HTTP side and the scheduler exchange (docs/server.md §9): a [`Job`] (a prepared
//! request waiting for a slot) and the [`JobEvent`]s streamed back to its handler, plus the
//! helpers both sides use (event sending with back-pressure, tool-call ids, sampling
//! defaults). The scheduler that runs jobs is [`crate::sched`]. Clients never back-pressure
//! it: a client that stops reading (its buffer fills) or disconnects (its receiver drops)
//! cancels its job.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ds4_chat::stream::{FinalOutput, StreamEvent};
use ds4_engine::SamplerConfig;
use tokio::sync::mpsc;

use crate::api::Endpoint;
use crate::config::ServerConfig;
use crate::error::ApiError;
use crate::prepare::Prepared;
use crate::stats::Stats;

/// One generation request, rendered and tokenized, waiting for the worker.
#[derive(Debug)]
pub struct Job {
    pub endpoint: Endpoint,
    pub prepared: Prepared,
    pub stop: Vec<String>,
    /// Client limit (`None`: the server default).
    pub max_tokens: Option<u64>,
    pub sampling: SamplerConfig,
    /// Report token log probabilities with this many alternatives each
    /// ([`Outcome::logprobs`]).
    pub logprobs: Option<usize>,
    /// Send per-token deltas (streaming); otherwise only start and end.
    pub deltas: bool,
    /// Drafting: the server's `--draft` settings with the request's overrides.
    pub draft: ds4_runtime::DraftConfig,
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
    /// A streaming job's view of its client's progress (unacknowledged bytes, events
    /// waiting); `None` for a non-streaming job.
    pub watch: Option<Arc<crate::limits::StreamWatch>>,
}

/// Bytes of the SSE frame around one event's text, as an estimate (a chat chunk's JSON
/// wrapper is about 170 bytes).
const EVENT_FRAME_BYTES: u64 = 160;

/// Estimated bytes `ev` takes on the wire once framed.
pub fn event_bytes(ev: &JobEvent) -> u64 {
    let text = match ev {
        JobEvent::Delta(Delta::Reasoning(s) | Delta::Content(s)) => s.len(),
        JobEvent::Delta(Delta::ToolStart { id, name, .. }) => id.len() + name.len(),
        JobEvent::Delta(Delta::ToolArgs { fragment, .. }) => fragment.len(),
        _ => 0,
    };
    text as u64 + EVENT_FRAME_BYTES
}

/// Token accounting of one request (docs/server.md §7.1: P, R, C).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Tokens of the effective prompt.
    pub prompt_tokens: usize,
    /// Reused (not evaluated) prompt tokens.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// What speculative decoding did, when it ran (reported as `usage.draft`).
    pub draft: Option<ds4_runtime::DraftStats>,
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
    /// One entry per generated token (EOS excluded) when the job asked for them.
    pub logprobs: Option<Vec<TokenLogprob>>,
}

/// A generated token's log probability under the model's distribution (the logits before
/// temperature and the other sampling knobs), with the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token's bytes (a piece of a UTF-8 character for some tokens).
    pub bytes: Vec<u8>,
    pub logprob: f32,
    /// The most likely tokens at this step, most likely first: (bytes, log probability).
    pub top: Vec<(Vec<u8>, f32)>,
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

/// Maps parser events to deltas, assigning a tool-call id when a call is announced.
pub(crate) fn emit(
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

/// Sends one event to the job's handler; a client that is gone or stopped reading
/// cancels its job.
pub(crate) fn send(stats: &Stats, cfg: &ServerConfig, job: &Job, ev: JobEvent) {
    if matches!(ev, JobEvent::Delta(_)) && !job.deltas {
        return;
    }
    let bytes = event_bytes(&ev);
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
    if waiting <= 1 {
        // Nothing was waiting: the client had taken everything, so its stall clock starts
        // now. A long stretch without events (a prompt evaluated between other slots'
        // steps, a tool call's structure before its name) is not a stall.
        job.taken_ms
            .store(crate::limits::now_ms(), Ordering::Relaxed);
    }
    if let Some(w) = &job.watch {
        let queued = w.queued.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if !job.cancel.load(Ordering::Relaxed) {
            stream_progress(stats, cfg, job, w, queued);
        }
    }
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

/// Cancels a streaming job whose client is not keeping up: more than
/// [`crate::limits::STREAM_BUFFER_CAP_BYTES`] of events waiting for its connection, or more
/// than [`ServerConfig::unread_cap_bytes`] unread while it takes nothing for longer than the
/// stall timeout (see [`crate::limits::StreamWatch`]).
fn stream_progress(
    stats: &Stats,
    cfg: &ServerConfig,
    job: &Job,
    w: &crate::limits::StreamWatch,
    queued: u64,
) {
    let cancel = |why: &str, bytes: u64, ms: u64| {
        tracing::warn!(
            unread_bytes = bytes,
            for_ms = ms,
            "streaming client {why}; cancelling its generation"
        );
        Stats::add(&stats.stalled, 1);
        job.cancel.store(true, Ordering::Relaxed);
    };
    if queued > crate::limits::STREAM_BUFFER_CAP_BYTES {
        cancel("left over 1 MiB of events waiting", queued, 0);
        return;
    }
    if let Some((ms, bytes)) = w.stalled(cfg.unread_cap_bytes) {
        if ms > cfg.stall_timeout.as_millis() as u64 {
            cancel(
                "took nothing of its stream with more than the unread-bytes cap waiting",
                bytes,
                ms,
            );
        }
    }
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
