//! OpenAI text completions (`POST /v1/completions`): a prompt string rendered as one user
//! turn; streamed with the chat family's chunk writer.

use std::collections::HashMap;

use serde_json::Value;

use super::{EventStream, Family};
use crate::api::Endpoint;
use crate::api::GenRequest;
use crate::emit::{openai_usage, Ctx};
use crate::error::ApiError;
use crate::json_out::{arr, Obj};
use crate::request::{bad, max_tokens, Fields, Thinking, INVALID};
use crate::worker::Outcome;

pub struct Completions;

impl Family for Completions {
    fn endpoint(&self) -> Endpoint {
        Endpoint::Completions
    }
    fn path(&self) -> &'static str {
        "/v1/completions"
    }
    fn prompt_param(&self) -> &'static str {
        "prompt"
    }
    fn response_id(&self, counter: u64) -> String {
        format!("cmpl-{counter}")
    }
    fn parse(&self, body: &[u8], ctx: u64) -> Result<GenRequest, ApiError> {
        parse(body, ctx)
    }
    fn body(&self, ctx: &Ctx, o: &Outcome) -> String {
        body_json(ctx, o)
    }
    fn stream(&self, ctx: Ctx) -> Box<dyn EventStream> {
        Box::new(super::chat::OpenAiStream::text(ctx))
    }
}

// ---- request parsing ----------------------------------------------------------------------

/// `POST /v1/completions`.
pub fn parse(body: &[u8], ctx: u64) -> Result<GenRequest, ApiError> {
    let f = Fields::parse(body)?;
    let prompt = match f.val("prompt") {
        None => return Err(bad("missing prompt")),
        Some(Value::String(s)) => s,
        Some(Value::Array(a)) => match a.into_iter().find_map(|v| v.as_str().map(str::to_string)) {
            Some(s) => s,
            None => return Err(bad("missing prompt")),
        },
        Some(_) => return Err(bad(format!("{INVALID}: `prompt` must be a string"))),
    };
    let model = f.model()?;
    let mut th = Thinking::new();
    th.thinking_field(f.val("thinking"))?;
    if let Some(b) = f.boolean("think")? {
        th.enabled = b;
        th.explicit = true;
    }
    th.effort_field(f.val("reasoning_effort"), false)?;
    Ok(GenRequest {
        continuation: None,
        endpoint: Endpoint::Completions,
        mode: th.mode(&model, ctx),
        model,
        messages: Vec::new(),
        tool_schemas: Vec::new(),
        stop: f.stops("stop")?,
        max_tokens: max_tokens(&f, &["max_tokens"])?,
        sampling: f.sampling(true, true)?,
        stream: f.boolean("stream")?.unwrap_or(false),
        include_usage: f.stream_options_usage()?,
        completion_prompt: Some(prompt),
        reasoning_summary: false,
        namespaces: HashMap::new(),
        previous_response_id: None,
    })
}

// ---- response emitting ---------------------------------------------------------------------

/// `text_completion` body (raw text: no reasoning split).
pub fn body_json(ctx: &Ctx, o: &Outcome) -> String {
    let choice = Obj::new()
        .str("text", &o.output.text)
        .num("index", 0)
        .null("logprobs")
        .str("finish_reason", o.output.finish.as_str())
        .end();
    Obj::new()
        .str("id", &ctx.id)
        .str("object", "text_completion")
        .num("created", ctx.created)
        .str("model", &ctx.model)
        .raw("choices", &arr([choice]))
        .raw("usage", &openai_usage(&o.usage))
        .end()
}
