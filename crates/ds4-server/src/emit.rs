//! Worker events → wire format, per protocol (docs/server.md §7): the non-stream JSON bodies and the
//! SSE event sequences of OpenAI chat/completions, Anthropic messages and OpenAI Responses.
//! Each emitter is a small state machine fed in order: `start`, `delta`…, then `done` (or
//! `error` after a start).

use std::collections::HashMap;

use ds4_chat::stream::FinishReason;

use crate::api::{Endpoint, GenRequest};
use crate::error::{ApiError, Shape};
use crate::json_out::{arr, s, Obj};
use crate::worker::{random_id, Delta, Outcome, Usage};

/// One SSE event: optional `event:` name and the `data:` payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub event: Option<&'static str>,
    pub data: String,
}

fn data(d: String) -> Frame {
    Frame {
        event: None,
        data: d,
    }
}

fn named(event: &'static str, d: String) -> Frame {
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
    pub fn new(req: &GenRequest, counter: u64, created: u64) -> Ctx {
        let id = match req.endpoint {
            Endpoint::Chat | Endpoint::Messages => format!("chatcmpl-{counter}"),
            Endpoint::Completions => format!("cmpl-{counter}"),
            Endpoint::Responses => random_id("resp_", 24),
        };
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

pub fn responses_usage(u: &Usage) -> String {
    Obj::new()
        .num("input_tokens", u.prompt_tokens as u64)
        .raw(
            "input_tokens_details",
            &Obj::new()
                .num("cached_tokens", u.cached_tokens as u64)
                .num("cache_write_tokens", u.prefilled() as u64)
                .end(),
        )
        .num("output_tokens", u.completion_tokens as u64)
        .raw(
            "output_tokens_details",
            &Obj::new().num("reasoning_tokens", 0).end(),
        )
        .num(
            "total_tokens",
            (u.prompt_tokens + u.completion_tokens) as u64,
        )
        .end()
}

/// Anthropic usage: P − R − W is 0 (every prompt token is either read from or written to
/// the cache), as ds4 reports it.
pub fn anthropic_usage(u: &Usage) -> String {
    Obj::new()
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

fn non_empty(s: &Option<String>) -> Option<&str> {
    s.as_deref().filter(|r| !r.is_empty())
}

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
pub fn chat_body(ctx: &Ctx, o: &Outcome) -> String {
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

/// `text_completion` body (raw text: no reasoning split).
pub fn completion_body(ctx: &Ctx, o: &Outcome) -> String {
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

/// SSE for `/v1/chat/completions` and `/v1/completions`.
pub struct OpenAiStream {
    ctx: Ctx,
}

impl OpenAiStream {
    pub fn new(ctx: Ctx) -> Self {
        OpenAiStream { ctx }
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

    fn chat(&self) -> bool {
        self.ctx.endpoint == Endpoint::Chat
    }

    pub fn start(&mut self) -> Vec<Frame> {
        if self.chat() {
            vec![self.chat_chunk(r#"{"role":"assistant"}"#, None)]
        } else {
            Vec::new()
        }
    }

    pub fn delta(&mut self, d: &Delta) -> Vec<Frame> {
        if !self.chat() {
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
        let mut out = vec![if self.chat() {
            self.chat_chunk("{}", Some(f))
        } else {
            self.text_chunk("", Some(f))
        }];
        if self.ctx.include_usage {
            let obj = if self.chat() {
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

// ---- Anthropic ---------------------------------------------------------------------------

/// `message` body.
pub fn anthropic_body(ctx: &Ctx, o: &Outcome) -> String {
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
                    &Obj::new()
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

// ---- OpenAI Responses --------------------------------------------------------------------

fn responses_status(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length => "incomplete",
        FinishReason::Error => "failed",
        _ => "completed",
    }
}

/// The items of a finished response, in output order.
struct Items {
    reasoning: Option<(String, String)>,
    message: Option<(String, String)>,
    calls: Vec<CallItem>,
}

struct CallItem {
    fc_id: String,
    call_id: String,
    wire_name: String,
    arguments: String,
}

impl CallItem {
    fn json(&self, ctx: &Ctx, status: &str, with_args: bool) -> String {
        let args = if with_args {
            self.arguments.as_str()
        } else {
            ""
        };
        call_item(
            ctx,
            &self.fc_id,
            &self.call_id,
            &self.wire_name,
            args,
            status,
        )
    }
}

fn reasoning_item(id: &str, text: &str, status: &str) -> String {
    let summary = if text.is_empty() {
        "[]".to_string()
    } else {
        arr([Obj::new()
            .str("type", "summary_text")
            .str("text", text)
            .end()])
    };
    Obj::new()
        .str("id", id)
        .str("type", "reasoning")
        .raw("summary", &summary)
        .str("status", status)
        .end()
}

fn output_text_part(text: &str) -> String {
    Obj::new()
        .str("type", "output_text")
        .str("text", text)
        .raw("annotations", "[]")
        .raw("logprobs", "[]")
        .end()
}

fn message_item(id: &str, text: Option<&str>, status: &str) -> String {
    let content = match text {
        Some(t) => arr([output_text_part(t)]),
        None => "[]".into(),
    };
    Obj::new()
        .str("id", id)
        .str("type", "message")
        .str("status", status)
        .str("role", "assistant")
        .raw("content", &content)
        .end()
}

/// A `function_call` item (tool names rendered `NS+name` are mapped back).
fn call_item(
    ctx: &Ctx,
    fc_id: &str,
    call_id: &str,
    wire_name: &str,
    args: &str,
    status: &str,
) -> String {
    let mut o = Obj::new()
        .str("id", fc_id)
        .str("type", "function_call")
        .str("status", status);
    match ctx.namespaces.get(wire_name) {
        Some((ns, name)) => o = o.str("name", name).str("namespace", ns),
        None => o = o.str("name", wire_name),
    }
    o.str("call_id", call_id).str("arguments", args).end()
}

fn response_obj(ctx: &Ctx, status: &str, output: &str, usage: Option<&Usage>) -> String {
    let mut o = Obj::new()
        .str("id", &ctx.id)
        .str("object", "response")
        .num("created_at", ctx.created)
        .str("status", status);
    o = match status {
        "failed" => o.raw(
            "error",
            &Obj::new()
                .str("code", "server_error")
                .str("message", "generation failed")
                .end(),
        ),
        _ => o.null("error"),
    };
    o = match status {
        "incomplete" => o.raw(
            "incomplete_details",
            &Obj::new().str("reason", "max_output_tokens").end(),
        ),
        _ => o.null("incomplete_details"),
    };
    o.null("instructions")
        .str("model", &ctx.model)
        .raw("output", output)
        .bool("parallel_tool_calls", true)
        .str("tool_choice", "auto")
        .raw("tools", "[]")
        .raw("metadata", "{}")
        .maybe_raw("usage", usage.map(responses_usage).as_deref())
        .end()
}

fn final_items(ctx: &Ctx, o: &Outcome, reasoning: &str, content: &str, ids: &mut ItemIds) -> Items {
    let f = o.output.finish;
    let item_status = if matches!(f, FinishReason::Length | FinishReason::Error) {
        "incomplete"
    } else {
        "completed"
    };
    let reasoning = (ctx.reasoning_summary && !reasoning.is_empty()).then(|| {
        let st = if o.reasoning_closed {
            "completed"
        } else {
            "incomplete"
        };
        let id = ids.reasoning();
        (id.clone(), reasoning_item(&id, reasoning, st))
    });
    let calls: Vec<CallItem> = o
        .output
        .message
        .tool_calls
        .iter()
        .zip(&o.tool_ids)
        .map(|(c, call_id)| CallItem {
            fc_id: random_id("fc_", 24),
            call_id: call_id.clone(),
            wire_name: c.name.clone(),
            arguments: c.arguments_compact(),
        })
        .collect();
    let message = (!content.is_empty() || calls.is_empty()).then(|| {
        let id = ids.message();
        (id.clone(), message_item(&id, Some(content), item_status))
    });
    Items {
        reasoning,
        message,
        calls,
    }
}

/// Item ids, stable between the streamed events and the final response.
#[derive(Default)]
struct ItemIds {
    reasoning: Option<String>,
    message: Option<String>,
}

impl ItemIds {
    fn reasoning(&mut self) -> String {
        self.reasoning
            .get_or_insert_with(|| random_id("rs_", 24))
            .clone()
    }
    fn message(&mut self) -> String {
        self.message
            .get_or_insert_with(|| random_id("msg_", 24))
            .clone()
    }
}

/// The non-stream Responses body.
pub fn responses_body(ctx: &Ctx, o: &Outcome) -> String {
    let m = &o.output.message;
    let mut ids = ItemIds::default();
    let items = final_items(
        ctx,
        o,
        m.reasoning.as_deref().unwrap_or(""),
        &m.content,
        &mut ids,
    );
    let calls: Vec<String> = items
        .calls
        .iter()
        .map(|c| c.json(ctx, "completed", true))
        .collect();
    let output = arr(items
        .reasoning
        .map(|r| r.1)
        .into_iter()
        .chain(items.message.map(|m| m.1))
        .chain(calls));
    response_obj(
        ctx,
        responses_status(o.output.finish),
        &output,
        Some(&o.usage),
    )
}

/// SSE for `/v1/responses`: `data:` events only, each with `sequence_number` as its second
/// key; created → (reasoning summary) → message text → closes → function calls → terminal.
pub struct ResponsesStream {
    ctx: Ctx,
    seq: u64,
    ids: ItemIds,
    next_index: u64,
    reasoning_index: Option<u64>,
    message_index: Option<u64>,
    reasoning: String,
    content: String,
}

impl ResponsesStream {
    pub fn new(ctx: Ctx) -> Self {
        ResponsesStream {
            ctx,
            seq: 0,
            ids: ItemIds::default(),
            next_index: 0,
            reasoning_index: None,
            message_index: None,
            reasoning: String::new(),
            content: String::new(),
        }
    }

    fn ev(&mut self, ty: &str) -> Obj {
        let o = Obj::new().str("type", ty).num("sequence_number", self.seq);
        self.seq += 1;
        o
    }

    pub fn start(&mut self) -> Vec<Frame> {
        let r = response_obj(&self.ctx, "in_progress", "[]", None);
        let created = self.ev("response.created").raw("response", &r).end();
        let progress = self.ev("response.in_progress").raw("response", &r).end();
        vec![data(created), data(progress)]
    }

    fn open_message(&mut self, out: &mut Vec<Frame>) {
        if self.message_index.is_some() {
            return;
        }
        let idx = self.next_index;
        self.next_index += 1;
        self.message_index = Some(idx);
        let id = self.ids.message();
        let item = message_item(&id, None, "in_progress");
        out.push(data(
            self.ev("response.output_item.added")
                .num("output_index", idx)
                .raw("item", &item)
                .end(),
        ));
        out.push(data(
            self.ev("response.content_part.added")
                .str("item_id", &id)
                .num("output_index", idx)
                .num("content_index", 0)
                .raw("part", &output_text_part(""))
                .end(),
        ));
    }

    pub fn delta(&mut self, d: &Delta) -> Vec<Frame> {
        let mut out = Vec::new();
        match d {
            Delta::Reasoning(t) => {
                self.reasoning.push_str(t);
                if !self.ctx.reasoning_summary {
                    return out;
                }
                let id = self.ids.reasoning();
                let idx = match self.reasoning_index {
                    Some(i) => i,
                    None => {
                        let idx = self.next_index;
                        self.next_index += 1;
                        self.reasoning_index = Some(idx);
                        let item = Obj::new()
                            .str("id", &id)
                            .str("type", "reasoning")
                            .raw("summary", "[]")
                            .str("status", "in_progress")
                            .end();
                        out.push(data(
                            self.ev("response.output_item.added")
                                .num("output_index", idx)
                                .raw("item", &item)
                                .end(),
                        ));
                        let part = Obj::new().str("type", "summary_text").str("text", "").end();
                        out.push(data(
                            self.ev("response.reasoning_summary_part.added")
                                .str("item_id", &id)
                                .num("output_index", idx)
                                .num("summary_index", 0)
                                .raw("part", &part)
                                .end(),
                        ));
                        idx
                    }
                };
                out.push(data(
                    self.ev("response.reasoning_summary_text.delta")
                        .str("item_id", &id)
                        .num("output_index", idx)
                        .num("summary_index", 0)
                        .str("delta", t)
                        .end(),
                ));
            }
            Delta::Content(t) => {
                self.content.push_str(t);
                self.open_message(&mut out);
                let id = self.ids.message();
                let idx = self.message_index.unwrap_or(0);
                out.push(data(
                    self.ev("response.output_text.delta")
                        .str("item_id", &id)
                        .num("output_index", idx)
                        .num("content_index", 0)
                        .str("delta", t)
                        .raw("logprobs", "[]")
                        .end(),
                ));
            }
            // Tool arguments are not streamed incrementally (docs/server.md §7.4).
            Delta::ToolStart { .. } | Delta::ToolArgs { .. } | Delta::ToolEnd { .. } => {}
        }
        out
    }

    pub fn done(&mut self, o: &Outcome) -> Vec<Frame> {
        let mut out = Vec::new();
        let (reasoning, content) = (self.reasoning.clone(), self.content.clone());
        let items = final_items(&self.ctx, o, &reasoning, &content, &mut self.ids);
        // Reasoning close.
        if let (Some(idx), Some((id, item))) = (self.reasoning_index, &items.reasoning) {
            let part = Obj::new()
                .str("type", "summary_text")
                .str("text", &reasoning)
                .end();
            out.push(data(
                self.ev("response.reasoning_summary_text.done")
                    .str("item_id", id)
                    .num("output_index", idx)
                    .num("summary_index", 0)
                    .str("text", &reasoning)
                    .end(),
            ));
            out.push(data(
                self.ev("response.reasoning_summary_part.done")
                    .str("item_id", id)
                    .num("output_index", idx)
                    .num("summary_index", 0)
                    .raw("part", &part)
                    .end(),
            ));
            out.push(data(
                self.ev("response.output_item.done")
                    .num("output_index", idx)
                    .raw("item", item)
                    .end(),
            ));
        }
        // Message close.
        let mut ordered: Vec<(u64, String)> = Vec::new();
        if let (Some(idx), Some((_, item))) = (self.reasoning_index, &items.reasoning) {
            ordered.push((idx, item.clone()));
        }
        if let Some((id, item)) = &items.message {
            self.open_message(&mut out);
            let idx = self.message_index.unwrap_or(0);
            out.push(data(
                self.ev("response.output_text.done")
                    .str("item_id", id)
                    .num("output_index", idx)
                    .num("content_index", 0)
                    .str("text", &content)
                    .raw("logprobs", "[]")
                    .end(),
            ));
            out.push(data(
                self.ev("response.content_part.done")
                    .str("item_id", id)
                    .num("output_index", idx)
                    .num("content_index", 0)
                    .raw("part", &output_text_part(&content))
                    .end(),
            ));
            out.push(data(
                self.ev("response.output_item.done")
                    .num("output_index", idx)
                    .raw("item", item)
                    .end(),
            ));
            ordered.push((idx, item.clone()));
        }
        // Function calls: added, one arguments delta, done.
        for c in &items.calls {
            let idx = self.next_index;
            self.next_index += 1;
            let added = c.json(&self.ctx, "in_progress", false);
            let item = c.json(&self.ctx, "completed", true);
            out.push(data(
                self.ev("response.output_item.added")
                    .num("output_index", idx)
                    .raw("item", &added)
                    .end(),
            ));
            out.push(data(
                self.ev("response.function_call_arguments.delta")
                    .str("item_id", &c.fc_id)
                    .num("output_index", idx)
                    .str("delta", &c.arguments)
                    .end(),
            ));
            let mut done = self
                .ev("response.function_call_arguments.done")
                .str("item_id", &c.fc_id)
                .num("output_index", idx);
            match self.ctx.namespaces.get(&c.wire_name) {
                Some((ns, name)) => done = done.str("name", name).str("namespace", ns),
                None => done = done.str("name", &c.wire_name),
            }
            out.push(data(done.str("arguments", &c.arguments).end()));
            out.push(data(
                self.ev("response.output_item.done")
                    .num("output_index", idx)
                    .raw("item", &item)
                    .end(),
            ));
            ordered.push((idx, item));
        }
        ordered.sort_by_key(|x| x.0);
        let output = arr(ordered.into_iter().map(|x| x.1));
        let status = responses_status(o.output.finish);
        let terminal = match status {
            "incomplete" => "response.incomplete",
            "failed" => "response.failed",
            _ => "response.completed",
        };
        let r = response_obj(&self.ctx, status, &output, Some(&o.usage));
        out.push(data(self.ev(terminal).raw("response", &r).end()));
        out
    }

    pub fn error(&mut self, e: &ApiError) -> Vec<Frame> {
        let r = response_obj(&self.ctx, "failed", "[]", None);
        let mut out = vec![data(self.ev("response.failed").raw("response", &r).end())];
        out.push(named("error", e.sse_payload(Shape::OpenAi)));
        out
    }
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
