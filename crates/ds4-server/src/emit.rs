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

/// `usage.draft` (an extension): verify steps, tokens drafted and accepted, when drafting
/// ran for the request.
pub fn draft_usage(o: Obj, u: &Usage) -> Obj {
    match &u.draft {
        Some(d) => o.raw(
            "draft",
            &Obj::new()
                .num("drafted", d.drafted)
                .num("accepted", d.accepted)
                .num("verify_steps", d.steps)
                .end(),
        ),
        None => o,
    }
}

pub fn openai_usage(u: &Usage) -> String {
    draft_usage(Obj::new(), u)
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

/// A log probability as JSON. A token the model rules out entirely (−∞, NaN) is reported
/// as −9999, as OpenAI does: JSON has no infinity.
pub(crate) fn logprob_json(x: f32) -> String {
    let x = if x.is_finite() {
        x.max(-9999.0)
    } else {
        -9999.0
    };
    serde_json::Number::from_f64(f64::from(x)).map_or_else(|| "-9999".into(), |n| n.to_string())
}

/// Bytes as a JSON array of numbers (OpenAI's `bytes`).
pub(crate) fn bytes_json(b: &[u8]) -> String {
    crate::json_out::arr(b.iter().map(|x| x.to_string()))
}

/// OpenAI chat `choices[].logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
pub fn chat_logprobs(lps: &[crate::worker::TokenLogprob]) -> String {
    let entry = |b: &[u8], lp: f32| {
        Obj::new()
            .str("token", &String::from_utf8_lossy(b))
            .raw("logprob", &logprob_json(lp))
            .raw("bytes", &bytes_json(b))
    };
    let content = crate::json_out::arr(lps.iter().map(|t| {
        let top = crate::json_out::arr(t.top.iter().map(|(b, lp)| entry(b, *lp).end()));
        entry(&t.bytes, t.logprob).raw("top_logprobs", &top).end()
    }));
    Obj::new().raw("content", &content).null("refusal").end()
}

/// OpenAI completions `choices[].logprobs`: parallel `tokens`, `token_logprobs`,
/// `top_logprobs` (token → log probability) and `text_offset` (each token's start in the
/// text, in bytes).
pub fn completion_logprobs(lps: &[crate::worker::TokenLogprob]) -> String {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let tokens = crate::json_out::arr(lps.iter().map(|t| s(&text(&t.bytes))));
    let values = crate::json_out::arr(lps.iter().map(|t| logprob_json(t.logprob)));
    let tops = crate::json_out::arr(lps.iter().map(|t| {
        t.top
            .iter()
            .fold(Obj::new(), |o, (b, lp)| o.raw(&text(b), &logprob_json(*lp)))
            .end()
    }));
    let mut at = 0u64;
    let offsets = crate::json_out::arr(lps.iter().map(|t| {
        let o = at;
        at += t.bytes.len() as u64;
        o.to_string()
    }));
    Obj::new()
        .raw("tokens", &tokens)
        .raw("token_logprobs", &values)
        .raw("top_logprobs", &tops)
        .raw("text_offset", &offsets)
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
