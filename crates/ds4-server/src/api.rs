//! The request model every endpoint family parses into: which endpoint a request came in
//! on and what it asks for, normalized. Its own module so that the parsers
//! ([`crate::request`]), the live-state continuations ([`crate::live`]) and preparation
//! ([`crate::prepare`]) all depend on it and not on each other.

use std::collections::HashMap;

use ds4_chat::render::{Message, ThinkingMode};

/// Which endpoint a request came in on. What differs per endpoint (its wire format, ids,
/// field names) is answered by its family module, found through
/// `crate::endpoints::family`, the one place an endpoint is mapped to code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    Responses,
    Messages,
}

/// How a family continues the live state with tool outputs (docs/server.md §9). Given by
/// the family's parser in [`GenRequest::continuation`], so the continuation code
/// (`crate::live`) and the worker ask the request instead of matching on the endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Continuation {
    /// The protocol's name in errors ("Responses", "Anthropic").
    pub protocol: &'static str,
    /// The request field a client replays in full when the state is gone.
    pub history: &'static str,
    /// The field that names a tool call in a tool output.
    pub call_id_field: &'static str,
    /// Where a tool-output continuation came from (logs, `/health`).
    pub tool_output_source: &'static str,
    /// Whether a later request can name this answer (`previous_response_id`).
    pub response_ids: bool,
}

/// Client sampling knobs (`None` = not sent).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub top_k: Option<u64>,
    pub seed: Option<u64>,
}

/// What every generation endpoint asks for, normalized.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    pub endpoint: Endpoint,
    /// `Some` for families whose turns the live state can continue with tool outputs.
    pub continuation: Option<Continuation>,
    /// Echoed back.
    pub model: String,
    pub messages: Vec<Message>,
    /// Rendered schema lines (empty when tools are off or `tool_choice` is none).
    pub tool_schemas: Vec<String>,
    pub mode: ThinkingMode,
    pub stop: Vec<String>,
    pub max_tokens: Option<u64>,
    pub sampling: Sampling,
    pub stream: bool,
    pub include_usage: bool,
    /// Report each generated token's log probability with its `n` most likely
    /// alternatives (`Some(n)`; chat `logprobs`/`top_logprobs`, completions `logprobs`).
    pub logprobs: Option<usize>,
    /// `/v1/completions`: the prompt text.
    pub completion_prompt: Option<String>,
    /// Responses: `reasoning.summary` asks for reasoning items.
    pub reasoning_summary: bool,
    /// Responses: wire tool name (`NS+name`) → (namespace, name).
    pub namespaces: HashMap<String, (String, String)>,
    /// Responses: continue this response on the live state ([`crate::live`]).
    pub previous_response_id: Option<String>,
    /// The request's drafting overrides (extension fields `draft`, `draft_max`).
    pub draft: DraftRequest,
}

/// A request's speculative-decoding overrides of the server's `--draft` and `--draft-max`
/// (extension fields `"draft": "off|lookup|mtp|auto"`, `"draft_max": 1..16`; docs/server.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DraftRequest {
    pub mode: Option<ds4_runtime::DraftMode>,
    pub max: Option<usize>,
}

impl DraftRequest {
    /// The drafting settings of a job: the server's defaults with this request's
    /// overrides.
    pub fn apply(&self, defaults: ds4_runtime::DraftConfig) -> ds4_runtime::DraftConfig {
        ds4_runtime::DraftConfig {
            mode: self.mode.unwrap_or(defaults.mode),
            max: self.max.unwrap_or(defaults.max),
            ngram: defaults.ngram,
        }
    }
}
