//! OpenAI text completions (`POST /v1/completions`): the prompt string is the model's input
//! as sent (tokenized as it is, chat markers in it being control tokens; no chat template);
//! streamed with the chat family's chunk writer.

use std::collections::HashMap;

use ds4_chat::render::ThinkingMode;
use serde_json::Value;

use super::{EventStream, Family};
use crate::api::Endpoint;
use crate::api::GenRequest;
use crate::emit::{openai_usage, Ctx};
use crate::error::ApiError;
use crate::json_out::{arr, Obj};
use crate::request::{bad, max_tokens, Fields, INVALID};
use crate::worker::Outcome;

pub struct Completions;

/// Most alternatives per token completions' `logprobs` may ask for (OpenAI's limit).
pub const MAX_COMPLETION_LOGPROBS: usize = 5;

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

/// `POST /v1/completions`. The prompt is the model's input as sent (no chat template), so
/// the thinking controls of the chat families do not apply here.
pub fn parse(body: &[u8], _ctx: u64) -> Result<GenRequest, ApiError> {
    let f = Fields::parse(body)?;
    let prompt = match f.val("prompt") {
        None => return Err(bad("missing prompt")),
        Some(Value::String(s)) => s,
        Some(Value::Array(a)) => {
            if a.len() > 1 {
                return Err(bad(format!(
                    "`prompt` holds {} prompts: this server answers one prompt per request",
                    a.len()
                )));
            }
            match a.into_iter().next() {
                Some(Value::String(s)) => s,
                _ => {
                    return Err(bad(format!(
                        "{INVALID}: `prompt` must be a string or an array of one string"
                    )))
                }
            }
        }
        Some(_) => return Err(bad(format!("{INVALID}: `prompt` must be a string"))),
    };
    let mut req = GenRequest {
        continuation: None,
        endpoint: Endpoint::Completions,
        mode: ThinkingMode::NoThink,
        model: f.model()?,
        messages: Vec::new(),
        tool_schemas: Vec::new(),
        stop: f.stops("stop")?,
        max_tokens: max_tokens(&f, &["max_tokens"])?,
        sampling: f.sampling(true, true)?,
        stream: f.boolean("stream")?.unwrap_or(false),
        include_usage: f.stream_options_usage()?,
        completion_prompt: Some(prompt),
        logprobs: None,
        draft: f.draft()?,
        reasoning_summary: false,
        namespaces: HashMap::new(),
        previous_response_id: None,
    };
    f.single_choice(&["n", "best_of"])?;
    if let Some(n) = f.uint("logprobs")? {
        if n > MAX_COMPLETION_LOGPROBS as u64 {
            return Err(bad(format!(
                "`logprobs` must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {n}"
            )));
        }
        super::chat::logprobs_allowed(&req)?;
        req.logprobs = Some(n as usize);
    }
    if req.completion_prompt.as_deref() == Some("") {
        return Err(bad("`prompt` is empty: send the text to continue"));
    }
    Ok(req)
}

// ---- response emitting ---------------------------------------------------------------------

/// `text_completion` body (raw text: no reasoning split).
pub fn body_json(ctx: &Ctx, o: &Outcome) -> String {
    let choice = Obj::new()
        .str("text", &o.output.text)
        .num("index", 0)
        .raw(
            "logprobs",
            &o.logprobs
                .as_deref()
                .map_or_else(|| "null".to_string(), crate::emit::completion_logprobs),
        )
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
