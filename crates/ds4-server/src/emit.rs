//! What the response emitters of the endpoint families share (docs/server.md §7): the SSE
//! frame, the per-request context, OpenAI usage (chat and completions) and SSE formatting.
//! Each family's bodies and stream state machines (fed `start`, `delta`…, then `done`, or
//! `error` after a start) live in its module under `crate::endpoints`.

use std::collections::HashMap;

use crate::api::{Endpoint, GenRequest};
use crate::json_out::{s, Obj};
use crate::worker::Usage;

/// One SSE event: optional `event:` name and the `data:` payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub event: Option<&'static str>,
    pub data: String,
}

pub(crate) fn data(d: String) -> Frame {
    Frame {
        event: None,
        data: d,
    }
}

pub(crate) fn named(event: &'static str, d: String) -> Frame {
    Frame {
        event: Some(event),
        data: d,
    }
}

/// What every emitter needs to know about its request.
#[derive(Debug, Clone)]
pub struct Ctx {
    pub endpoint: Endpoint,
    /// `chatcmpl-n`, `cmpl-n` or `resp_…`.
    pub id: String,
    pub created: u64,
    pub model: String,
    pub include_usage: bool,
    pub reasoning_summary: bool,
    pub namespaces: HashMap<String, (String, String)>,
}

impl Ctx {
    /// `id` is the answer's id, made by the request's family.
    pub fn new(req: &GenRequest, id: String, created: u64) -> Ctx {
        Ctx {
            endpoint: req.endpoint,
            id,
            created,
            model: req.model.clone(),
            include_usage: req.include_usage,
            reasoning_summary: req.reasoning_summary,
            namespaces: req.namespaces.clone(),
        }
    }
}

pub fn openai_usage(u: &Usage) -> String {
    Obj::new()
        .num("prompt_tokens", u.prompt_tokens as u64)
        .num("completion_tokens", u.completion_tokens as u64)
        .num(
            "total_tokens",
            (u.prompt_tokens + u.completion_tokens) as u64,
        )
        .raw(
            "prompt_tokens_details",
            &Obj::new()
                .num("cached_tokens", u.cached_tokens as u64)
                .num("cache_write_tokens", u.prefilled() as u64)
                .end(),
        )
        .end()
}

pub(crate) fn non_empty(s: &Option<String>) -> Option<&str> {
    s.as_deref().filter(|r| !r.is_empty())
}

/// Formats a frame as SSE bytes (tests and raw writers; axum's `Event` does the same).
pub fn frame_text(f: &Frame) -> String {
    let mut out = String::new();
    if let Some(e) = f.event {
        out.push_str("event: ");
        out.push_str(e);
        out.push('\n');
    }
    out.push_str("data: ");
    out.push_str(&f.data);
    out.push_str("\n\n");
    out
}

/// A JSON string (for callers that build small bodies).
pub fn json_str(v: &str) -> String {
    s(v)
}
