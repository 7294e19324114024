//! Server configuration: everything the `ds4-server` flags set, as one plain struct so tests
//! build servers without going through the command line.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::script::Script;

/// The id `/v1/models` lists (any model string is accepted on requests and echoed back,
/// docs/chat.md §2.1).
pub const MODEL_ID: &str = "deepseek-v4-flash";

/// Output tokens a request may generate when it sets no limit of its own
/// (`--default-max-tokens`): enough for a long answer with its reasoning, and far below the
/// whole context (hundreds of thousands of tokens), which would let one request without a
/// limit hold a slot for hours. The effective limit is also bounded by `-n` and by the
/// context left.
pub const DEFAULT_MAX_TOKENS: usize = 8192;

/// Disk KV cache settings (docs/server.md §3, §11).
#[derive(Debug, Clone, PartialEq)]
pub struct DiskCacheConfig {
    pub dir: PathBuf,
    pub budget_bytes: u64,
    /// No save or load below this many tokens.
    pub min_tokens: usize,
    /// Cold saves only for prompts up to this length; 0 disables cold saves.
    pub cold_max_tokens: usize,
    /// A `continued` checkpoint every this many tokens (rounded up to `align`); 0 disables.
    pub continued_interval_tokens: usize,
    /// Tokens left out at the end of a cold save (so the next turn's suffix can differ).
    pub boundary_trim_tokens: usize,
    /// Cold boundaries are aligned down to a multiple of this; 0 disables.
    pub boundary_align_tokens: usize,
}

impl DiskCacheConfig {
    /// ds4's defaults for a directory.
    pub fn new(dir: impl Into<PathBuf>) -> DiskCacheConfig {
        DiskCacheConfig {
            dir: dir.into(),
            budget_bytes: 4096 << 20,
            min_tokens: 512,
            cold_max_tokens: 30_000,
            continued_interval_tokens: 10_000,
            boundary_trim_tokens: 32,
            boundary_align_tokens: 2048,
        }
    }

    /// The `continued` step: the interval rounded up to the alignment (10240 by default).
    pub fn continued_step(&self) -> usize {
        let i = self.continued_interval_tokens;
        let a = self.boundary_align_tokens;
        if i == 0 {
            0
        } else if a == 0 {
            i
        } else {
            i.div_ceil(a) * a
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.budget_bytes == 0 {
            return Err("--kv-disk-space-mb must be > 0".into());
        }
        if self.cold_max_tokens != 0 && self.cold_max_tokens < self.min_tokens {
            return Err(format!(
                "--kv-cache-cold-max-tokens ({}) must be 0 or >= --kv-cache-min-tokens ({})",
                self.cold_max_tokens, self.min_tokens
            ));
        }
        Ok(())
    }
}

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Most output tokens a request may ask for (`-n`); larger client limits are cut to it.
    pub max_tokens: usize,
    /// Output tokens of a request that sets no limit (`--default-max-tokens`, default
    /// [`DEFAULT_MAX_TOKENS`]; also bounded by `max_tokens` and the context left).
    pub default_max_tokens: usize,
    /// Requests that may wait for the worker; `parallel` more can be running. Full ⇒ 429.
    pub queue_capacity: usize,
    /// Seconds in the `Retry-After` of a 429.
    pub retry_after_secs: u64,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// `Some`: clients must send `Authorization: Bearer KEY` or `x-api-key: KEY`. An empty
    /// key is refused at bind time: an empty `x-api-key:` header would match it.
    pub api_key: Option<String>,
    /// Browser origins allowed to call the API cross-origin (`--cors`); `*` allows any.
    /// Empty: a POST carrying an `Origin` of another site is refused (CSRF from a web page).
    pub cors_origins: Vec<String>,
    /// Extra `Host` header values accepted when the server is bound to loopback without a
    /// key (loopback names are always accepted). Guards against DNS rebinding.
    pub allowed_hosts: Vec<String>,
    /// Time a client has to send a complete request head (also closes idle keep-alive
    /// connections).
    pub header_timeout: Duration,
    /// Longest pause between two pieces of a request body.
    pub body_idle_timeout: Duration,
    /// Longest time to receive a whole request body.
    pub body_timeout: Duration,
    /// Open connections at most; past it new ones get 503 and are closed. 0 = from the
    /// descriptor limit.
    pub max_connections: usize,
    /// Request-body bytes buffered at once across all connections (a body takes its share,
    /// by `Content-Length` or as it arrives, before it is read, and gives it back when the
    /// buffered body is dropped). 0 = [`crate::limits::BODY_BUDGET_BODIES`] × the body limit.
    pub body_budget_bytes: usize,
    /// How long a body may wait for its share of the body budget before it is refused with
    /// 503 and `Retry-After`.
    pub body_budget_wait: Duration,
    /// After a shutdown request, how long open connections may take to finish before they
    /// are dropped (a stalled client must not keep the process alive).
    pub shutdown_grace: Duration,
    /// Requests parsed, rendered and tokenized at the same time (the rest wait): bounds the
    /// memory hostile bodies can take. 0 = from the cores and memory.
    pub prepare_concurrency: usize,
    /// A streaming client that has not taken an event for this long while events wait is
    /// treated as gone and its generation is cancelled (back-pressure).
    pub stall_timeout: Duration,
    /// A streaming client with more than this many bytes of its stream unread (as far as
    /// this host can see, `limits::StreamWatch`) that takes nothing for longer than
    /// `stall_timeout` is cancelled.
    pub unread_cap_bytes: u64,
    /// Kernel send buffer of each connection (0 = the kernel's autotuned default, which
    /// grows to megabytes: a client that stopped reading then absorbs tens of thousands of
    /// tokens before back-pressure reaches the worker).
    pub send_buffer_bytes: usize,
    /// Match chat markers inside message text, tool results and tool arguments as control
    /// tokens (ds4's behaviour). Off by default: only the renderer emits control tokens, so
    /// content cannot forge turns.
    pub content_special_tokens: bool,
    /// Conversations served at once (`--parallel`): one KV state ("slot") each, decoded
    /// together in batched steps (docs/server.md §9). 1 serves one request at a time.
    pub parallel: usize,
    /// Most prompt tokens evaluated per scheduler step, between two batched decode steps of
    /// the running streams (`--prefill-chunk-per-step`); 0 = the engine's prefill chunk.
    pub prefill_per_step: usize,
    /// In-memory KV snapshots kept at turn boundaries (0 disables).
    pub snapshot_slots: usize,
    /// Snapshots bigger than this are not kept.
    pub snapshot_max_bytes: usize,
    pub disk: Option<DiskCacheConfig>,
    /// Exact-DSML tool replay (docs/server.md §10); off = canonical DSML only.
    pub exact_dsml_replay: bool,
    pub tool_memory_max_ids: usize,
    pub tool_memory_max_bytes: usize,
    /// Events buffered for a streaming client before it counts as stalled and is dropped.
    pub stream_buffer_events: usize,
    /// SSE keep-alive comment interval during long prefills.
    pub keep_alive: Duration,
    /// Serve the chat page at `/` and `/chat` (`webchat.rs`); off with `--no-webchat`.
    pub webchat: bool,
    /// Speculative decoding's defaults (`--draft`, `--draft-max`, `--draft-ngram`; a request
    /// overrides the first two): a slot that decodes alone drafts (docs/server.md §9).
    pub draft: ds4_runtime::DraftConfig,
    /// Test hook: forced model outputs (see [`Script`]). Not a user feature.
    pub script: Option<Arc<Script>>,
    /// Test hook: sleep this long after every decode step (one token of every running
    /// stream).
    pub token_delay: Option<Duration>,
    /// Test hook: a generation request whose body contains this string panics inside its
    /// handler (the panic-containment test). Not a user feature.
    pub test_panic_marker: Option<String>,
    /// Test hook: the scheduler records every forward pass here ([`crate::trace`]), so a test
    /// can check how prompts and decode steps interleave by counting. Not a user feature.
    pub step_trace: Option<Arc<crate::trace::StepTrace>>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_tokens: 393_216,
            default_max_tokens: DEFAULT_MAX_TOKENS,
            queue_capacity: 32,
            retry_after_secs: 1,
            max_body_bytes: 64 << 20,
            api_key: None,
            cors_origins: Vec::new(),
            allowed_hosts: Vec::new(),
            header_timeout: Duration::from_secs(10),
            body_idle_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_connections: 0,
            body_budget_bytes: 0,
            body_budget_wait: Duration::from_secs(1),
            shutdown_grace: Duration::from_secs(10),
            prepare_concurrency: 0,
            stall_timeout: Duration::from_secs(2),
            unread_cap_bytes: crate::limits::UNREAD_CAP_BYTES,
            send_buffer_bytes: 128 << 10,
            content_special_tokens: false,
            parallel: 1,
            prefill_per_step: 0,
            snapshot_slots: 1,
            snapshot_max_bytes: 1 << 30,
            draft: ds4_runtime::DraftConfig::default(),
            disk: None,
            exact_dsml_replay: true,
            tool_memory_max_ids: 100_000,
            tool_memory_max_bytes: 512 << 20,
            stream_buffer_events: 4096,
            keep_alive: Duration::from_secs(5),
            webchat: true,
            script: None,
            token_delay: None,
            test_panic_marker: None,
            step_trace: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continued_step_rounds_up() {
        let mut d = DiskCacheConfig::new("/x");
        assert_eq!(d.continued_step(), 10240);
        d.boundary_align_tokens = 0;
        assert_eq!(d.continued_step(), 10000);
        d.continued_interval_tokens = 0;
        assert_eq!(d.continued_step(), 0);
        assert!(d.validate().is_ok());
        d.cold_max_tokens = 10;
        assert!(d.validate().is_err());
        d.budget_bytes = 0;
        assert!(d.validate().is_err());
    }
}
