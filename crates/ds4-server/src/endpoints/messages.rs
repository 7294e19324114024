//! Anthropic messages (`POST /v1/messages`): the family's request parser (content blocks,
//! `tool_result` continuations), its `message` body and its SSE event stream.

use std::collections::HashMap;

use ds4_chat::render::{self, Message, ToolCall};
use ds4_chat::stream::FinishReason;
use serde_json::value::RawValue;
use serde_json::Value;

use super::{EventStream, Family};
use crate::api::GenRequest;
use crate::api::{Continuation, Endpoint};
use crate::emit::{named, non_empty, Ctx, Frame};
use crate::error::ApiError;
use crate::error::Shape;
use crate::json_out::{arr, Obj};
use crate::request::{
    bad, check_forced_tool, check_roles, content_text, max_tokens, raw_array, raw_object,
    refuse_media, require_items, schema_lines, value, Fields, Thinking, INVALID,
};
use crate::worker::{Delta, Outcome, Usage};

pub struct Messages;

/// `tool_result` blocks continue the live state.
pub const CONTINUATION: Continuation = Continuation {
    protocol: "Anthropic",
    history: "messages",
    call_id_field: "tool_use_id",
    tool_output_source: "anthropic-tool-output",
    response_ids: false,
};

impl Family for Messages {
    fn endpoint(&self) -> Endpoint {
        Endpoint::Messages
    }
    fn path(&self) -> &'static str {
        "/v1/messages"
    }
    fn shape(&self) -> Shape {
        Shape::Anthropic
    }
    fn prompt_param(&self) -> &'static str {
        "messages"
    }
    fn tool_id_prefix(&self) -> &'static str {
        "toolu_"
    }
    /// Anthropic clients read the id of a message; ds4 numbers them like chat answers.
    fn response_id(&self, counter: u64) -> String {
        format!("chatcmpl-{counter}")
    }
    fn parse(&self, body: &[u8], ctx: u64) -> Result<GenRequest, ApiError> {
        parse(body, ctx)
    }
    fn body(&self, ctx: &Ctx, o: &Outcome) -> String {
        body_json(ctx, o)
    }
    /// Anthropic has no stop reason for a generation that failed: it is answered as an
    /// error, as a stream ends with its `error` event ([`AnthropicStream::done`]).
    fn outcome_error(&self, o: &Outcome) -> Option<ApiError> {
        (o.output.finish == FinishReason::Error).then(|| failed(o))
    }
    fn stream(&self, ctx: Ctx) -> Box<dyn EventStream> {
        Box::new(AnthropicStream::new(ctx))
    }
}

/// `message_start` carries the prompt's usage.
impl EventStream for AnthropicStream {
    fn start(&mut self, usage: &Usage) -> Vec<Frame> {
        AnthropicStream::start(self, usage)
    }
    fn delta(&mut self, d: &Delta) -> Vec<Frame> {
        AnthropicStream::delta(self, d)
    }
    fn done(&mut self, o: &Outcome) -> Vec<Frame> {
        AnthropicStream::done(self, o)
    }
    fn error(&mut self, e: &ApiError) -> Vec<Frame> {
        AnthropicStream::error(self, e)
    }
}

// ---- request parsing ----------------------------------------------------------------------

/// `POST /v1/messages` (Anthropic).
pub fn parse(body: &[u8], ctx: u64) -> Result<GenRequest, ApiError> {
    let f = Fields::parse(body)?;
    let model = f.model()?;
    let Some(raw_msgs) = f.raw("messages") else {
        return Err(bad("missing messages"));
    };
    let items = raw_array(raw_msgs)
        .ok_or_else(|| bad(format!("{INVALID}: `messages` must be an array")))?;
    let mut messages = Vec::new();
    // System prompt: string, or blocks joined with "\n"; `x-anthropic-*` parts skipped.
    if let Some(sys) = f.val("system") {
        let parts: Vec<String> = match sys {
            Value::String(s) => vec![s],
            Value::Array(a) => a
                .iter()
                .filter_map(|b| match b {
                    Value::String(s) => Some(s.clone()),
                    Value::Object(o) => o.get("text").and_then(Value::as_str).map(str::to_string),
                    _ => None,
                })
                .collect(),
            _ => {
                return Err(bad(format!(
                    "{INVALID}: `system` must be a string or an array"
                )))
            }
        };
        let mut text = String::new();
        for p in parts.iter().filter(|p| !p.starts_with("x-anthropic-")) {
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str(p);
        }
        if !text.is_empty() {
            messages.push(Message::system(&text));
        }
    }
    for (i, raw) in items.iter().enumerate() {
        let m = raw_object(raw.get())?;
        let mut msg = Message {
            role: match m.get("role").map(|r| value(r)) {
                Some(Value::String(s)) => s,
                None | Some(Value::Null) => "user".into(),
                Some(_) => return Err(bad(format!("{INVALID}: message `role` must be a string"))),
            },
            ..Message::default()
        };
        match m.get("content") {
            None => {}
            Some(c) => match value(c) {
                Value::String(s) => msg.content = s,
                Value::Null => {}
                Value::Array(_) => {
                    let blocks = raw_array(c).unwrap_or_default();
                    for (j, b) in blocks.iter().enumerate() {
                        anthropic_block(b, &mut msg, || format!("messages[{i}].content[{j}]"))?;
                    }
                }
                _ => {
                    return Err(bad(format!(
                        "{INVALID}: message `content` must be a string or an array"
                    )))
                }
            },
        }
        messages.push(msg);
    }
    let empty = items.is_empty();
    check_roles(&messages)?;
    let mut tools_on = true;
    if let Some(Value::Object(tc)) = f.val("tool_choice") {
        match tc.get("type").and_then(Value::as_str) {
            Some("none") => tools_on = false,
            Some("tool") => check_forced_tool(
                Some(tc.get("name").and_then(Value::as_str).unwrap_or("")),
                f.val("tools"),
            )?,
            _ => {}
        }
    }
    let tool_schemas = if tools_on {
        schema_lines(f.raw("tools"))?
    } else {
        Vec::new()
    };
    let mut th = Thinking::new();
    th.thinking_field(f.val("thinking"))?;
    if let Some(Value::Object(oc)) = f.val("output_config") {
        th.effort_field(oc.get("effort").cloned().filter(|v| !v.is_null()), false)?;
    }
    th.effort_field(f.val("reasoning_effort"), false)?;
    let req = GenRequest {
        continuation: Some(CONTINUATION),
        endpoint: Endpoint::Messages,
        mode: th.mode(&model, ctx),
        model,
        messages,
        tool_schemas,
        stop: f.stops("stop_sequences")?,
        max_tokens: max_tokens(&f, &["max_tokens"])?,
        sampling: f.sampling(false, false)?,
        stream: f.boolean("stream")?.unwrap_or(false),
        include_usage: false,
        completion_prompt: None,
        logprobs: None,
        draft: f.draft()?,
        reasoning_summary: false,
        namespaces: HashMap::new(),
        previous_response_id: None,
    };
    // After the other fields, so their errors come first.
    require_items("messages", empty)?;
    Ok(req)
}

fn anthropic_block(
    raw: &RawValue,
    msg: &mut Message,
    at: impl FnOnce() -> String,
) -> Result<(), ApiError> {
    let v = value(raw);
    refuse_media(at, &v)?;
    let Value::Object(o) = &v else {
        if let Value::String(s) = v {
            msg.content.push_str(&s);
        }
        return Ok(());
    };
    match o.get("type").and_then(Value::as_str) {
        Some("text") => msg
            .content
            .push_str(o.get("text").and_then(Value::as_str).unwrap_or("")),
        Some("thinking") => msg
            .reasoning
            .push_str(o.get("thinking").and_then(Value::as_str).unwrap_or("")),
        Some("tool_use") => {
            let m = raw_object(raw.get())?;
            let id = o
                .get("id")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            let name = o
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("{INVALID}: tool_use block without a name")))?
                .to_string();
            let arguments = m
                .get("input")
                .map(|r| r.get().to_string())
                .unwrap_or_else(|| "{}".into());
            msg.tool_calls.push(ToolCall {
                id,
                name,
                arguments,
            });
        }
        Some("tool_result") => {
            let id = o.get("tool_use_id").and_then(Value::as_str).unwrap_or("");
            let text = o.get("content").map(content_text).unwrap_or_default();
            msg.content.push_str("<tool_result>");
            msg.content.push_str(&render::escape_tool_result(&text));
            msg.content.push_str("</tool_result>");
            msg.tool_call_ids.push(id.to_string());
        }
        _ => {}
    }
    Ok(())
}

// ---- response emitting ---------------------------------------------------------------------

/// Anthropic usage: P − R − W is 0 (every prompt token is either read from or written to
/// the cache), as ds4 reports it.
pub fn anthropic_usage(u: &Usage) -> String {
    crate::emit::draft_usage(Obj::new(), u)
        .num("input_tokens", 0)
        .num("output_tokens", u.completion_tokens as u64)
        .num("cache_read_input_tokens", u.cached_tokens as u64)
        .num("cache_creation_input_tokens", u.prefilled() as u64)
        .end()
}

fn anthropic_stop(f: FinishReason) -> &'static str {
    match f {
        FinishReason::ToolCalls => "tool_use",
        FinishReason::Length => "max_tokens",
        _ => "end_turn",
    }
}

/// `message` body.
pub fn body_json(ctx: &Ctx, o: &Outcome) -> String {
    let m = &o.output.message;
    let mut blocks = Vec::new();
    let reasoning = non_empty(&m.reasoning);
    if let Some(r) = reasoning {
        blocks.push(
            Obj::new()
                .str("type", "thinking")
                .str("thinking", r)
                .str("signature", &ctx.id)
                .end(),
        );
    }
    if !m.content.is_empty() {
        blocks.push(Obj::new().str("type", "text").str("text", &m.content).end());
    }
    for (c, id) in m.tool_calls.iter().zip(&o.tool_ids) {
        blocks.push(
            Obj::new()
                .str("type", "tool_use")
                .str("id", id)
                .str("name", &c.name)
                .raw("input", &c.arguments_compact())
                .end(),
        );
    }
    if m.content.is_empty() && m.tool_calls.is_empty() {
        blocks.push(Obj::new().str("type", "text").str("text", "").end());
    }
    Obj::new()
        .str("id", &ctx.id)
        .str("type", "message")
        .str("role", "assistant")
        .str("model", &ctx.model)
        .raw("content", &arr(blocks))
        .str("stop_reason", anthropic_stop(o.output.finish))
        .null("stop_sequence")
        .raw("usage", &anthropic_usage(&o.usage))
        .end()
}

/// The error a failed generation (finish `error`) is reported as.
fn failed(o: &Outcome) -> ApiError {
    let why = o.output.error.as_deref().unwrap_or("generation failed");
    ApiError::internal(format!("generation ended early: {why}"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Thinking,
    Text,
    Tool,
}

/// SSE for `/v1/messages`: `message_start`, content blocks (thinking, text, tool_use) with
/// increasing indexes, `message_delta`, `message_stop`.
pub struct AnthropicStream {
    ctx: Ctx,
    next: usize,
    open: Option<Block>,
    thinking_sent: bool,
    text_sent: bool,
    tools_sent: bool,
}

impl AnthropicStream {
    pub fn new(ctx: Ctx) -> Self {
        AnthropicStream {
            ctx,
            next: 0,
            open: None,
            thinking_sent: false,
            text_sent: false,
            tools_sent: false,
        }
    }

    fn open_block(&mut self, kind: Block, block: String, out: &mut Vec<Frame>) {
        self.close(out);
        out.push(named(
            "content_block_start",
            Obj::new()
                .str("type", "content_block_start")
                .num("index", self.next as u64)
                .raw("content_block", &block)
                .end(),
        ));
        self.open = Some(kind);
        match kind {
            Block::Thinking => self.thinking_sent = true,
            Block::Text => self.text_sent = true,
            Block::Tool => self.tools_sent = true,
        }
    }

    fn block_delta(&self, delta: String) -> Frame {
        named(
            "content_block_delta",
            Obj::new()
                .str("type", "content_block_delta")
                .num("index", self.next as u64)
                .raw("delta", &delta)
                .end(),
        )
    }

    fn close(&mut self, out: &mut Vec<Frame>) {
        let Some(kind) = self.open.take() else { return };
        if kind == Block::Thinking {
            out.push(
                self.block_delta(
                    Obj::new()
                        .str("type", "signature_delta")
                        .str("signature", &self.ctx.id)
                        .end(),
                ),
            );
        }
        out.push(named(
            "content_block_stop",
            Obj::new()
                .str("type", "content_block_stop")
                .num("index", self.next as u64)
                .end(),
        ));
        self.next += 1;
    }

    pub fn start(&mut self, u: &Usage) -> Vec<Frame> {
        let start_usage = Usage {
            completion_tokens: 0,
            draft: None,
            ..*u
        };
        let msg = Obj::new()
            .str("id", &self.ctx.id)
            .str("type", "message")
            .str("role", "assistant")
            .str("model", &self.ctx.model)
            .raw("content", "[]")
            .null("stop_reason")
            .null("stop_sequence")
            .raw("usage", &anthropic_usage(&start_usage))
            .end();
        vec![named(
            "message_start",
            Obj::new()
                .str("type", "message_start")
                .raw("message", &msg)
                .end(),
        )]
    }

    pub fn delta(&mut self, d: &Delta) -> Vec<Frame> {
        let mut out = Vec::new();
        match d {
            Delta::Reasoning(t) => {
                if self.open != Some(Block::Thinking) {
                    let b = Obj::new()
                        .str("type", "thinking")
                        .str("thinking", "")
                        .str("signature", "")
                        .end();
                    self.open_block(Block::Thinking, b, &mut out);
                }
                out.push(
                    self.block_delta(
                        Obj::new()
                            .str("type", "thinking_delta")
                            .str("thinking", t)
                            .end(),
                    ),
                );
            }
            Delta::Content(t) => {
                if self.open != Some(Block::Text) {
                    let b = Obj::new().str("type", "text").str("text", "").end();
                    self.open_block(Block::Text, b, &mut out);
                }
                out.push(
                    self.block_delta(Obj::new().str("type", "text_delta").str("text", t).end()),
                );
            }
            Delta::ToolStart { id, name, .. } => {
                let b = Obj::new()
                    .str("type", "tool_use")
                    .str("id", id)
                    .str("name", name)
                    .raw("input", "{}")
                    .end();
                self.open_block(Block::Tool, b, &mut out);
            }
            Delta::ToolArgs { fragment, .. } => {
                if self.open == Some(Block::Tool) {
                    out.push(
                        self.block_delta(
                            Obj::new()
                                .str("type", "input_json_delta")
                                .str("partial_json", fragment)
                                .end(),
                        ),
                    );
                }
            }
            Delta::ToolEnd { .. } => self.close(&mut out),
        }
        out
    }

    pub fn done(&mut self, o: &Outcome) -> Vec<Frame> {
        let mut out = Vec::new();
        self.close(&mut out);
        if o.output.finish == FinishReason::Error {
            // Cut short (an engine failure, shutdown, a tool call the output limit cut):
            // Anthropic has no stop reason for that, so the stream ends with its `error`
            // event instead of a `message_delta` claiming `end_turn`.
            out.extend(self.error(&failed(o)));
            return out;
        }
        if !self.text_sent && !self.tools_sent {
            let b = Obj::new().str("type", "text").str("text", "").end();
            self.open_block(Block::Text, b, &mut out);
            self.close(&mut out);
        }
        out.push(named(
            "message_delta",
            Obj::new()
                .str("type", "message_delta")
                .raw(
                    "delta",
                    &Obj::new()
                        .str("stop_reason", anthropic_stop(o.output.finish))
                        .null("stop_sequence")
                        .end(),
                )
                .raw(
                    "usage",
                    &crate::emit::draft_usage(Obj::new(), &o.usage)
                        .num("output_tokens", o.usage.completion_tokens as u64)
                        .end(),
                )
                .end(),
        ));
        out.push(named(
            "message_stop",
            Obj::new().str("type", "message_stop").end(),
        ));
        out
    }

    pub fn error(&mut self, e: &ApiError) -> Vec<Frame> {
        vec![named("error", e.sse_payload(Shape::Anthropic))]
    }
}
