//! OpenAI chat completions (`POST /v1/chat/completions`): the family's request parser, its
//! `chat.completion` body and the OpenAI chunk stream (which completions reuses).

use std::collections::HashMap;

use ds4_chat::request::ChatRequest;
use serde_json::Value;

use super::{EventStream, Family};
use crate::api::Endpoint;
use crate::api::GenRequest;
use crate::emit::{data, named, non_empty, openai_usage, Ctx, Frame};
use crate::error::ApiError;
use crate::error::Shape;
use crate::json_out::{arr, Obj};
use crate::request::{
    bad, check_forced_tool, check_media, check_roles, max_tokens, require_items, Fields, INVALID,
};
use crate::worker::{Delta, Outcome, Usage};

pub struct Chat;

impl Family for Chat {
    fn endpoint(&self) -> Endpoint {
        Endpoint::Chat
    }
    fn path(&self) -> &'static str {
        "/v1/chat/completions"
    }
    fn prompt_param(&self) -> &'static str {
        "messages"
    }
    fn response_id(&self, counter: u64) -> String {
        format!("chatcmpl-{counter}")
    }
    fn parse(&self, body: &[u8], ctx: u64) -> Result<GenRequest, ApiError> {
        parse(body, ctx)
    }
    fn body(&self, ctx: &Ctx, o: &Outcome) -> String {
        body_json(ctx, o)
    }
    fn stream(&self, ctx: Ctx) -> Box<dyn EventStream> {
        Box::new(OpenAiStream::chat(ctx))
    }
}

/// Chat and completions stream the same chunk objects (the `object` field differs, by
/// the context's endpoint).
impl EventStream for OpenAiStream {
    fn start(&mut self, _usage: &Usage) -> Vec<Frame> {
        OpenAiStream::start(self)
    }
    fn delta(&mut self, d: &Delta) -> Vec<Frame> {
        OpenAiStream::delta(self, d)
    }
    fn done(&mut self, o: &Outcome) -> Vec<Frame> {
        OpenAiStream::done(self, o)
    }
    fn error(&mut self, e: &ApiError) -> Vec<Frame> {
        OpenAiStream::error(self, e)
    }
}

// ---- request parsing ----------------------------------------------------------------------

/// `POST /v1/chat/completions`.
pub fn parse(body: &[u8], ctx: u64) -> Result<GenRequest, ApiError> {
    let f = Fields::parse(body)?;
    let text = std::str::from_utf8(body).map_err(|_| bad(INVALID))?;
    let chat = ChatRequest::from_openai_json(text, ctx).map_err(|e| match e {
        ds4_chat::ChatError::Request(m) => bad(m),
        other => bad(other.to_string()),
    })?;
    let mut empty = false;
    if let Some(v) = f.val("messages") {
        let Value::Array(items) = &v else {
            return Err(bad(format!("{INVALID}: `messages` must be an array")));
        };
        empty = items.is_empty();
        check_media("messages", items)?;
    }
    check_roles(&chat.messages)?;
    match f.val("tool_choice") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if matches!(s.as_str(), "none" | "auto" | "required") => {}
        Some(Value::String(s)) => {
            return Err(bad(format!(
                "tool_choice {s:?} is not one of none, auto, required or a tool"
            )))
        }
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            check_forced_tool(name, f.val("tools"))?;
        }
        Some(_) => {
            return Err(bad(format!(
                "{INVALID}: `tool_choice` must be a string or an object"
            )))
        }
    }
    let tool_schemas = chat.active_tool_schemas().to_vec();
    let mut req = GenRequest {
        continuation: None,
        endpoint: Endpoint::Chat,
        model: f.model()?,
        messages: chat.messages,
        tool_schemas,
        mode: chat.mode,
        stop: f.stops("stop")?,
        max_tokens: max_tokens(&f, &["max_completion_tokens", "max_tokens"])?,
        sampling: f.sampling(true, true)?,
        stream: f.boolean("stream")?.unwrap_or(false),
        include_usage: f.stream_options_usage()?,
        completion_prompt: None,
        logprobs: None,
        draft: f.draft()?,
        reasoning_summary: false,
        namespaces: HashMap::new(),
        previous_response_id: None,
    };
    f.single_choice(&["n"])?;
    req.logprobs = chat_logprobs(&f, &req)?;
    require_items("messages", empty)?;
    Ok(req)
}

/// `logprobs: true` with `top_logprobs` (0–[`MAX_TOP_LOGPROBS`]) → the alternatives to
/// report. Reported for the answer's text only, so a request whose output would hold
/// reasoning or tool calls, or a stream, is refused rather than answered without them.
fn chat_logprobs(f: &Fields, req: &GenRequest) -> Result<Option<usize>, ApiError> {
    let on = f.boolean("logprobs")?.unwrap_or(false);
    let top = f.uint("top_logprobs")?;
    if let Some(n) = top {
        if n > MAX_TOP_LOGPROBS as u64 {
            return Err(bad(format!(
                "`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"
            )));
        }
        if !on && n > 0 {
            return Err(bad("`top_logprobs` needs `logprobs: true`"));
        }
    }
    if !on {
        return Ok(None);
    }
    logprobs_allowed(req)?;
    Ok(Some(top.unwrap_or(0) as usize))
}

/// Most alternatives per token `top_logprobs` may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Log probabilities are reported for non-streamed plain answers: not in thinking modes
/// (the reasoning tokens are not content), not with tools, not on streams.
pub(crate) fn logprobs_allowed(req: &GenRequest) -> Result<(), ApiError> {
    if req.stream {
        return Err(bad(
            "`logprobs` is reported on non-streamed answers only (set `stream` to false)",
        ));
    }
    if req.mode.is_thinking() {
        return Err(bad(
            "`logprobs` needs thinking disabled (the reasoning tokens are not content): send `thinking: {\"type\": \"disabled\"}` or `reasoning_effort: \"none\"`",
        ));
    }
    if !req.tool_schemas.is_empty() {
        return Err(bad("`logprobs` cannot be combined with `tools`"));
    }
    Ok(())
}

// ---- response emitting ---------------------------------------------------------------------

// ---- OpenAI chat -------------------------------------------------------------------------

fn tool_calls_json(o: &Outcome) -> String {
    arr(o
        .output
        .message
        .tool_calls
        .iter()
        .zip(&o.tool_ids)
        .map(|(c, id)| {
            Obj::new()
                .str("id", id)
                .str("type", "function")
                .raw(
                    "function",
                    &Obj::new()
                        .str("name", &c.name)
                        .str("arguments", &c.arguments_compact())
                        .end(),
                )
                .end()
        }))
}

/// `chat.completion` body.
pub fn body_json(ctx: &Ctx, o: &Outcome) -> String {
    let m = &o.output.message;
    let mut msg = Obj::new()
        .str("role", "assistant")
        .str("content", &m.content);
    if let Some(r) = non_empty(&m.reasoning) {
        msg = msg.str("reasoning_content", r);
    }
    if !m.tool_calls.is_empty() {
        msg = msg.raw("tool_calls", &tool_calls_json(o));
    }
    let choice = Obj::new()
        .num("index", 0)
        .raw("message", &msg.end())
        .maybe_raw(
            "logprobs",
            o.logprobs
                .as_deref()
                .map(crate::emit::chat_logprobs)
                .as_deref(),
        )
        .str("finish_reason", o.output.finish.as_str())
        .end();
    Obj::new()
        .str("id", &ctx.id)
        .str("object", "chat.completion")
        .num("created", ctx.created)
        .str("model", &ctx.model)
        .raw("choices", &arr([choice]))
        .raw("usage", &openai_usage(&o.usage))
        .end()
}

/// SSE for `/v1/chat/completions` and `/v1/completions`.
pub struct OpenAiStream {
    ctx: Ctx,
    /// Chat chunks (`chat.completion.chunk`, a role delta first) rather than text
    /// completion chunks; chosen by the family that builds the stream.
    chat: bool,
}

impl OpenAiStream {
    /// The chat family's stream.
    pub fn chat(ctx: Ctx) -> Self {
        OpenAiStream { ctx, chat: true }
    }

    /// The completions family's stream (same envelope, `text_completion` chunks).
    pub fn text(ctx: Ctx) -> Self {
        OpenAiStream { ctx, chat: false }
    }

    fn chat_chunk(&self, delta: &str, finish: Option<&str>) -> Frame {
        let choice = Obj::new()
            .num("index", 0)
            .raw("delta", delta)
            .opt_str("finish_reason", finish)
            .end();
        data(self.envelope("chat.completion.chunk", &arr([choice])))
    }

    fn text_chunk(&self, text: &str, finish: Option<&str>) -> Frame {
        let choice = Obj::new()
            .str("text", text)
            .num("index", 0)
            .null("logprobs")
            .opt_str("finish_reason", finish)
            .end();
        data(self.envelope("text_completion", &arr([choice])))
    }

    fn envelope(&self, object: &str, choices: &str) -> String {
        Obj::new()
            .str("id", &self.ctx.id)
            .str("object", object)
            .num("created", self.ctx.created)
            .str("model", &self.ctx.model)
            .raw("choices", choices)
            .end()
    }

    pub fn start(&mut self) -> Vec<Frame> {
        if self.chat {
            vec![self.chat_chunk(r#"{"role":"assistant"}"#, None)]
        } else {
            Vec::new()
        }
    }

    pub fn delta(&mut self, d: &Delta) -> Vec<Frame> {
        if !self.chat {
            return match d {
                Delta::Content(t) | Delta::Reasoning(t) => vec![self.text_chunk(t, None)],
                _ => Vec::new(),
            };
        }
        let delta = match d {
            Delta::Reasoning(t) => Obj::new().str("reasoning_content", t).end(),
            Delta::Content(t) => Obj::new().str("content", t).end(),
            Delta::ToolStart { index, id, name } => {
                let call = Obj::new()
                    .num("index", *index as u64)
                    .str("id", id)
                    .str("type", "function")
                    .raw(
                        "function",
                        &Obj::new().str("name", name).str("arguments", "").end(),
                    )
                    .end();
                Obj::new().raw("tool_calls", &arr([call])).end()
            }
            Delta::ToolArgs { index, fragment } => {
                let call = Obj::new()
                    .num("index", *index as u64)
                    .raw("function", &Obj::new().str("arguments", fragment).end())
                    .end();
                Obj::new().raw("tool_calls", &arr([call])).end()
            }
            Delta::ToolEnd { .. } => return Vec::new(),
        };
        vec![self.chat_chunk(&delta, None)]
    }

    pub fn done(&mut self, o: &Outcome) -> Vec<Frame> {
        let f = o.output.finish.as_str();
        let mut out = vec![if self.chat {
            self.chat_chunk("{}", Some(f))
        } else {
            self.text_chunk("", Some(f))
        }];
        if self.ctx.include_usage {
            let obj = if self.chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            };
            out.push(data(
                Obj::new()
                    .str("id", &self.ctx.id)
                    .str("object", obj)
                    .num("created", self.ctx.created)
                    .str("model", &self.ctx.model)
                    .raw("choices", "[]")
                    .raw("usage", &openai_usage(&o.usage))
                    .end(),
            ));
        }
        out.push(data("[DONE]".into()));
        out
    }

    pub fn error(&mut self, e: &ApiError) -> Vec<Frame> {
        vec![named("error", e.sse_payload(Shape::OpenAi))]
    }
}
