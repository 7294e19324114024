//! OpenAI Responses (`POST /v1/responses`): the family's request parser (input items,
//! `previous_response_id`), its `response` body and its SSE event stream.

use std::collections::HashMap;

use ds4_chat::render::{Message, ToolCall};
use ds4_chat::stream::FinishReason;
use serde_json::value::RawValue;
use serde_json::Value;

use super::{EventStream, Family};
use crate::api::GenRequest;
use crate::api::{Continuation, Endpoint};
use crate::emit::{data, named, Ctx, Frame};
use crate::error::ApiError;
use crate::error::Shape;
use crate::json_out::{arr, Obj};
use crate::request::{
    bad, check_media, check_roles, content_text, max_tokens, raw_array, raw_object, require_items,
    schema_lines, value, Fields, Thinking, INVALID,
};
use crate::worker::random_id;
use crate::worker::{Delta, Outcome, Usage};

pub struct Responses;

/// Tool outputs (and `previous_response_id`) continue the live state.
pub const CONTINUATION: Continuation = Continuation {
    protocol: "Responses",
    history: "input",
    call_id_field: "call_id",
    tool_output_source: "responses-tool-output",
    response_ids: true,
};

impl Family for Responses {
    fn endpoint(&self) -> Endpoint {
        Endpoint::Responses
    }
    fn path(&self) -> &'static str {
        "/v1/responses"
    }
    fn prompt_param(&self) -> &'static str {
        "input"
    }
    fn response_id(&self, _counter: u64) -> String {
        random_id("resp_", 24)
    }
    fn parse(&self, body: &[u8], ctx: u64) -> Result<GenRequest, ApiError> {
        parse(body, ctx)
    }
    fn body(&self, ctx: &Ctx, o: &Outcome) -> String {
        body_json(ctx, o)
    }
    fn stream(&self, ctx: Ctx) -> Box<dyn EventStream> {
        Box::new(ResponsesStream::new(ctx))
    }
}

impl EventStream for ResponsesStream {
    fn start(&mut self, _usage: &Usage) -> Vec<Frame> {
        ResponsesStream::start(self)
    }
    fn delta(&mut self, d: &Delta) -> Vec<Frame> {
        ResponsesStream::delta(self, d)
    }
    fn done(&mut self, o: &Outcome) -> Vec<Frame> {
        ResponsesStream::done(self, o)
    }
    fn error(&mut self, e: &ApiError) -> Vec<Frame> {
        ResponsesStream::error(self, e)
    }
}

// ---- request parsing ----------------------------------------------------------------------

/// `POST /v1/responses`.
pub fn parse(body: &[u8], ctx: u64) -> Result<GenRequest, ApiError> {
    let f = Fields::parse(body)?;
    let model = f.model()?;
    if f.raw("conversation").is_some() {
        return Err(bad(
            "conversation is not supported; replay full input instead",
        ));
    }
    // Only the response the live state ends with can be continued; `prepare` checks it.
    let previous_response_id = f.string("previous_response_id")?;
    let mut messages = Vec::new();
    if let Some(instr) = f.string("instructions")? {
        messages.push(Message::system(&instr));
    }
    let mut extra_schemas = Vec::new();
    match f.raw("input") {
        None => return Err(bad("missing input")),
        Some(raw) => match value(raw) {
            Value::String(s) => messages.push(Message::user(&s)),
            Value::Array(all) => {
                require_items("input", all.is_empty())?;
                check_media("input", &all)?;
                drop(all);
                let items = raw_array(raw).unwrap_or_default();
                responses_items(&items, &mut messages, &mut extra_schemas)?;
            }
            _ => {
                return Err(bad(format!(
                    "{INVALID}: `input` must be a string or an array"
                )))
            }
        },
    }
    check_roles(&messages)?;
    let mut tools_on = true;
    match f.val("tool_choice") {
        None => {}
        Some(Value::String(s)) if s == "none" => tools_on = false,
        Some(Value::String(s)) if s == "auto" => {}
        Some(Value::String(s)) => return Err(bad(format!("tool_choice={s} not supported"))),
        Some(_) => return Err(bad("forced tool_choice not supported")),
    }
    let mut namespaces = HashMap::new();
    if let Some(Value::Array(tools)) = f.val("tools") {
        for t in &tools {
            if t.get("type").and_then(Value::as_str) != Some("namespace") {
                continue;
            }
            let Some(ns) = t.get("name").and_then(Value::as_str) else {
                continue;
            };
            for inner in t
                .get("tools")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                if let Some(n) = inner.get("name").and_then(Value::as_str) {
                    namespaces.insert(format!("{ns}{n}"), (ns.to_string(), n.to_string()));
                }
            }
        }
    }
    let mut tool_schemas = Vec::new();
    if tools_on {
        tool_schemas = schema_lines(f.raw("tools"))?;
        tool_schemas.extend(extra_schemas);
    }
    let mut th = Thinking::new();
    let mut summary = false;
    match f.val("reasoning") {
        None => {}
        Some(Value::Object(r)) => {
            th.effort_field(r.get("effort").cloned().filter(|v| !v.is_null()), true)?;
            match r.get("summary") {
                None | Some(Value::Null) => {}
                Some(Value::String(s)) => {
                    summary = matches!(s.as_str(), "auto" | "concise" | "detailed")
                }
                Some(_) => {
                    return Err(bad(format!(
                        "{INVALID}: `reasoning.summary` must be a string"
                    )))
                }
            }
        }
        Some(_) => return Err(bad(format!("{INVALID}: `reasoning` must be an object"))),
    }
    Ok(GenRequest {
        continuation: Some(CONTINUATION),
        endpoint: Endpoint::Responses,
        mode: th.mode(&model, ctx),
        model,
        messages,
        tool_schemas,
        stop: Vec::new(),
        max_tokens: max_tokens(&f, &["max_output_tokens", "max_tokens"])?,
        sampling: f.sampling(false, false)?,
        stream: f.boolean("stream")?.unwrap_or(false),
        include_usage: false,
        completion_prompt: None,
        logprobs: None,
        draft: f.draft()?,
        reasoning_summary: summary,
        namespaces,
        previous_response_id,
    })
}

/// Responses input items → messages (docs/chat.md §2.6).
fn responses_items(
    items: &[Box<RawValue>],
    out: &mut Vec<Message>,
    schemas: &mut Vec<String>,
) -> Result<(), ApiError> {
    let mut pending_reasoning: Option<String> = None;
    let flush = |out: &mut Vec<Message>, pending: &mut Option<String>| {
        if let Some(r) = pending.take() {
            out.push(Message::assistant("", &r));
        }
    };
    for raw in items {
        let m = raw_object(raw.get())?;
        let get = |k: &str| m.get(k).map(|r| value(r)).filter(|v| !v.is_null());
        let ty = match get("type") {
            Some(Value::String(s)) => s,
            None if m.contains_key("role") => "message".into(),
            _ => return Err(bad(format!("{INVALID}: input item without a type"))),
        };
        match get("status") {
            None => {}
            Some(Value::String(s)) if s == "completed" => {}
            Some(_) => {
                return Err(bad(format!(
                    "{INVALID}: input item status must be completed"
                )))
            }
        }
        match ty.as_str() {
            "message" => {
                let role = match get("role") {
                    Some(Value::String(s)) => s,
                    None => "user".into(),
                    Some(_) => {
                        return Err(bad(format!("{INVALID}: message role must be a string")))
                    }
                };
                let content = match get("content") {
                    None => String::new(),
                    Some(Value::String(s)) => s,
                    Some(Value::Array(blocks)) => {
                        let mut s = String::new();
                        for b in blocks {
                            let bt = b.get("type").and_then(Value::as_str).unwrap_or("");
                            if !matches!(
                                bt,
                                "input_text"
                                    | "output_text"
                                    | "text"
                                    | "summary_text"
                                    | "reasoning_text"
                            ) {
                                return Err(bad(format!(
                                    "{INVALID}: unsupported content block {bt:?}"
                                )));
                            }
                            s.push_str(b.get("text").and_then(Value::as_str).unwrap_or(""));
                        }
                        s
                    }
                    Some(_) => {
                        return Err(bad(format!(
                            "{INVALID}: message content must be a string or an array"
                        )))
                    }
                };
                if role == "assistant" {
                    let r = pending_reasoning.take().unwrap_or_default();
                    out.push(Message::assistant(&content, &r));
                } else {
                    flush(out, &mut pending_reasoning);
                    out.push(Message {
                        role,
                        content,
                        ..Message::default()
                    });
                }
            }
            "reasoning" => {
                let mut parts = Vec::new();
                for k in ["summary", "content"] {
                    if let Some(Value::Array(a)) = get(k) {
                        parts.extend(a.iter().filter_map(|b| {
                            b.get("text").and_then(Value::as_str).map(str::to_string)
                        }));
                    }
                }
                let text = parts.join("\n");
                match &mut pending_reasoning {
                    Some(p) => {
                        if !p.is_empty() && !text.is_empty() {
                            p.push('\n');
                        }
                        p.push_str(&text);
                    }
                    None => pending_reasoning = Some(text),
                }
            }
            "function_call"
            | "custom_tool_call"
            | "local_shell_call"
            | "tool_search_call"
            | "web_search_call"
            | "image_generation_call" => {
                let id = match (get("call_id"), get("id")) {
                    (Some(Value::String(s)), _) | (None, Some(Value::String(s))) => s,
                    _ => String::new(),
                };
                let base = match ty.as_str() {
                    "local_shell_call" => "local_shell".to_string(),
                    "tool_search_call" => "tool_search".to_string(),
                    "web_search_call" => "web_search".to_string(),
                    "image_generation_call" => "image_generation".to_string(),
                    _ => match get("name") {
                        Some(Value::String(s)) => s,
                        _ => return Err(bad(format!("{INVALID}: {ty} without a name"))),
                    },
                };
                let name = match get("namespace") {
                    Some(Value::String(ns)) => format!("{ns}{base}"),
                    _ => base,
                };
                let arguments = ["arguments", "input", "action"]
                    .iter()
                    .find_map(|k| {
                        let r = m.get(*k)?;
                        match value(r) {
                            Value::Null => None,
                            Value::String(s) => Some(s),
                            _ => Some(r.get().to_string()),
                        }
                    })
                    .unwrap_or_else(|| "{}".into());
                let call = ToolCall {
                    id,
                    name,
                    arguments,
                };
                match (pending_reasoning.take(), out.last_mut()) {
                    (None, Some(last)) if last.role == "assistant" => last.tool_calls.push(call),
                    (r, _) => {
                        let mut msg = Message::assistant("", &r.unwrap_or_default());
                        msg.tool_calls.push(call);
                        out.push(msg);
                    }
                }
            }
            t if t.ends_with("_call_output") || t == "tool_search_output" => {
                flush(out, &mut pending_reasoning);
                let id = match (get("call_id"), get("id")) {
                    (Some(Value::String(s)), _) | (None, Some(Value::String(s))) => s,
                    _ => String::new(),
                };
                let content = match m.get("output") {
                    None => String::new(),
                    Some(r) => match value(r) {
                        Value::Null => String::new(),
                        Value::String(s) => s,
                        v @ Value::Array(_)
                            if v.as_array()
                                .is_some_and(|a| a.iter().all(|b| b.get("text").is_some())) =>
                        {
                            content_text(&v)
                        }
                        _ => r.get().to_string(),
                    },
                };
                if t == "tool_search_output" {
                    if let Some(tools) = m.get("tools") {
                        schemas.extend(schema_lines(Some(tools))?);
                    }
                }
                let mut msg = Message::tool(&id, &content);
                if id.is_empty() {
                    msg.tool_call_ids.clear();
                }
                out.push(msg);
            }
            "compaction" | "context_compaction" => {}
            other => {
                return Err(bad(format!(
                    "{INVALID}: unsupported input item type {other:?}"
                )))
            }
        }
    }
    flush(out, &mut pending_reasoning);
    Ok(())
}

// ---- response emitting ---------------------------------------------------------------------

pub fn responses_usage(u: &Usage) -> String {
    crate::emit::draft_usage(Obj::new(), u)
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
pub fn body_json(ctx: &Ctx, o: &Outcome) -> String {
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
