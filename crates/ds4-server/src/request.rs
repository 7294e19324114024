//! Request bodies of the four generation endpoints → one [`GenRequest`] (docs/server.md §5,
//! docs/chat.md §2.1, §2.4, §2.6). Unknown fields are accepted and ignored, as ds4 does and
//! as SDKs need (they send fields a local server has no use for); a known field with the
//! wrong type or an out-of-range value is a 400 that names the field. Values that become
//! prompt bytes (tool schemas, tool-call arguments) are kept as the exact bytes sent.

use std::collections::{BTreeMap, HashMap};

use ds4_chat::render::{self, Message, ThinkingMode, ToolCall};
use ds4_chat::request::ChatRequest;
use serde_json::value::RawValue;
use serde_json::Value;

pub use crate::api::{Endpoint, GenRequest, Sampling};
use crate::error::ApiError;

/// Roles the renderer understands; anything else used to be dropped silently.
const KNOWN_ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

fn check_roles(messages: &[Message]) -> Result<(), ApiError> {
    match messages
        .iter()
        .enumerate()
        .find(|(_, m)| !KNOWN_ROLES.contains(&m.role.as_str()))
    {
        Some((i, m)) => Err(bad(format!(
            "message {i} has unknown role {:?} (expected one of {})",
            m.role,
            KNOWN_ROLES.join(", ")
        ))),
        None => Ok(()),
    }
}

/// A forced `tool_choice` must name a tool the request defines: forcing a missing one was
/// silently ignored.
fn check_forced_tool(name: Option<&str>, tools: Option<Value>) -> Result<(), ApiError> {
    let Some(name) = name else {
        return Ok(());
    };
    let defined = tools
        .as_ref()
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|t| {
            let n = t
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| t.get("name"));
            n.and_then(Value::as_str) == Some(name)
        });
    if defined {
        Ok(())
    } else {
        Err(bad(format!(
            "tool_choice forces tool {name:?}, which `tools` does not define"
        )))
    }
}

/// User and assistant turns a body holds, counted without building it: each renders at
/// least one control token, so more of them than the context holds can be refused before
/// any parsing (a body of millions of tiny messages took gigabytes to parse and render).
/// Also returns how many items the arrays hold in all (system messages included).
/// (0, 0) when the body is not shaped as expected (the real parser reports that).
pub fn count_turns(body: &[u8]) -> (usize, usize) {
    use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
    use std::fmt;

    struct Turns(usize, usize);
    impl<'de> serde::Deserialize<'de> for Turns {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Turns;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("anything")
                }
                fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Turns, A::Error> {
                    let (mut n, mut items) = (0, 0);
                    while let Some(t) = seq.next_element::<IsTurn>()? {
                        n += t.0 as usize;
                        items += 1;
                    }
                    Ok(Turns(n, items))
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Turns, A::Error> {
                    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                    Ok(Turns(0, 0))
                }
                fn visit_str<E>(self, _: &str) -> Result<Turns, E> {
                    Ok(Turns(0, 0))
                }
                fn visit_bool<E>(self, _: bool) -> Result<Turns, E> {
                    Ok(Turns(0, 0))
                }
                fn visit_i64<E>(self, _: i64) -> Result<Turns, E> {
                    Ok(Turns(0, 0))
                }
                fn visit_u64<E>(self, _: u64) -> Result<Turns, E> {
                    Ok(Turns(0, 0))
                }
                fn visit_f64<E>(self, _: f64) -> Result<Turns, E> {
                    Ok(Turns(0, 0))
                }
                fn visit_unit<E>(self) -> Result<Turns, E> {
                    Ok(Turns(0, 0))
                }
            }
            d.deserialize_any(V)
        }
    }

    /// An array item whose `role` is `user` or `assistant`.
    struct IsTurn(bool);
    impl<'de> serde::Deserialize<'de> for IsTurn {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = IsTurn;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("anything")
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<IsTurn, A::Error> {
                    let mut turn = false;
                    while let Some(k) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                        if k == "role" {
                            let r = map.next_value::<Option<std::borrow::Cow<'de, str>>>();
                            turn = matches!(
                                r.as_ref().map(|r| r.as_deref()),
                                Ok(Some("user" | "assistant"))
                            );
                            r.map(|_| ()).or_else(|_| Ok::<(), A::Error>(()))?;
                        } else {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                    Ok(IsTurn(turn))
                }
                fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<IsTurn, A::Error> {
                    while seq.next_element::<IgnoredAny>()?.is_some() {}
                    Ok(IsTurn(false))
                }
                fn visit_str<E>(self, _: &str) -> Result<IsTurn, E> {
                    Ok(IsTurn(false))
                }
                fn visit_bool<E>(self, _: bool) -> Result<IsTurn, E> {
                    Ok(IsTurn(false))
                }
                fn visit_i64<E>(self, _: i64) -> Result<IsTurn, E> {
                    Ok(IsTurn(false))
                }
                fn visit_u64<E>(self, _: u64) -> Result<IsTurn, E> {
                    Ok(IsTurn(false))
                }
                fn visit_f64<E>(self, _: f64) -> Result<IsTurn, E> {
                    Ok(IsTurn(false))
                }
                fn visit_unit<E>(self) -> Result<IsTurn, E> {
                    Ok(IsTurn(false))
                }
            }
            d.deserialize_any(V)
        }
    }

    #[derive(serde::Deserialize)]
    struct Top {
        messages: Option<Turns>,
        input: Option<Turns>,
    }
    match serde_json::from_slice::<Top>(body) {
        Ok(t) => {
            let (m, i) = (
                t.messages.unwrap_or(Turns(0, 0)),
                t.input.unwrap_or(Turns(0, 0)),
            );
            (m.0 + i.0, m.1 + i.1)
        }
        Err(_) => (0, 0),
    }
}

/// A lower bound on a parsed request's prompt tokens, before rendering: one control token
/// per user or assistant turn, plus the client text (contents, reasoning, schemas, a
/// completion prompt) divided by the longest token's length. Rendering only adds bytes.
pub fn token_lower_bound(req: &GenRequest, max_token_bytes: usize) -> usize {
    let turns = req
        .messages
        .iter()
        .filter(|m| m.role == "user" || m.role == "assistant")
        .count();
    let bytes: usize = req
        .messages
        .iter()
        .map(|m| m.content.len() + m.reasoning.len())
        .sum::<usize>()
        + req.tool_schemas.iter().map(String::len).sum::<usize>()
        + req.completion_prompt.as_ref().map_or(0, String::len);
    turns + bytes / max_token_bytes.max(1)
}

const INVALID: &str = "invalid JSON request";

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::bad(msg)
}

type RawMap = BTreeMap<String, Box<RawValue>>;

fn raw_object(raw: &str) -> Result<RawMap, ApiError> {
    serde_json::from_str(raw).map_err(|_| bad(INVALID))
}

fn raw_array(raw: &RawValue) -> Option<Vec<Box<RawValue>>> {
    serde_json::from_str(raw.get()).ok()
}

fn value(raw: &RawValue) -> Value {
    serde_json::from_str(raw.get()).unwrap_or(Value::Null)
}

/// Typed access to a request object's members.
struct Fields {
    map: RawMap,
}

impl Fields {
    fn parse(body: &[u8]) -> Result<Fields, ApiError> {
        let text =
            std::str::from_utf8(body).map_err(|_| bad(format!("{INVALID}: body is not UTF-8")))?;
        let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("{INVALID}: {e}")))?;
        if !v.is_object() {
            return Err(bad(format!("{INVALID}: the body must be a JSON object")));
        }
        Ok(Fields {
            map: raw_object(text)?,
        })
    }

    fn raw(&self, k: &str) -> Option<&RawValue> {
        self.map.get(k).map(|b| &**b).filter(|r| r.get() != "null")
    }

    fn val(&self, k: &str) -> Option<Value> {
        self.raw(k).map(value)
    }

    fn number(&self, k: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
        match self.val(k) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                let x = n.as_f64().unwrap_or(f64::NAN);
                if x.is_finite() && (lo..=hi).contains(&x) {
                    Ok(Some(x as f32))
                } else {
                    Err(bad(format!("`{k}` must be between {lo} and {hi}, got {n}")))
                }
            }
            Some(_) => Err(bad(format!("{INVALID}: `{k}` must be a number"))),
        }
    }

    fn uint(&self, k: &str) -> Result<Option<u64>, ApiError> {
        match self.val(k) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_u64() {
                Some(x) => Ok(Some(x)),
                None => match n.as_f64() {
                    Some(f) if f >= 0.0 && f.fract() == 0.0 && f < 1.8e19 => Ok(Some(f as u64)),
                    _ => Err(bad(format!(
                        "`{k}` must be a non-negative integer, got {n}"
                    ))),
                },
            },
            Some(_) => Err(bad(format!("{INVALID}: `{k}` must be an integer"))),
        }
    }

    /// Any integer; negative seeds wrap (clients use them as opaque numbers).
    fn seed(&self, k: &str) -> Result<Option<u64>, ApiError> {
        match self.val(k) {
            None => Ok(None),
            Some(Value::Number(n)) => n
                .as_u64()
                .or_else(|| n.as_i64().map(|i| i as u64))
                .map(Some)
                .ok_or_else(|| bad(format!("`{k}` must be an integer, got {n}"))),
            Some(_) => Err(bad(format!("{INVALID}: `{k}` must be an integer"))),
        }
    }

    fn boolean(&self, k: &str) -> Result<Option<bool>, ApiError> {
        match self.val(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(_) => Err(bad(format!("{INVALID}: `{k}` must be a boolean"))),
        }
    }

    fn string(&self, k: &str) -> Result<Option<String>, ApiError> {
        match self.val(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(bad(format!("{INVALID}: `{k}` must be a string"))),
        }
    }

    fn model(&self) -> Result<String, ApiError> {
        Ok(self
            .string("model")?
            .unwrap_or_else(|| crate::config::MODEL_ID.to_string()))
    }

    fn stream_options_usage(&self) -> Result<bool, ApiError> {
        match self.val("stream_options") {
            None => Ok(false),
            Some(Value::Object(o)) => match o.get("include_usage") {
                None | Some(Value::Null) => Ok(false),
                Some(Value::Bool(b)) => Ok(*b),
                Some(_) => Err(bad(format!(
                    "{INVALID}: `stream_options.include_usage` must be a boolean"
                ))),
            },
            Some(_) => Err(bad(format!(
                "{INVALID}: `stream_options` must be an object"
            ))),
        }
    }

    fn sampling(&self, min_p: bool, seed: bool) -> Result<Sampling, ApiError> {
        Ok(Sampling {
            temperature: self.number("temperature", 0.0, 100.0)?,
            top_p: self.number("top_p", 0.0, 1.0)?,
            min_p: if min_p {
                self.number("min_p", 0.0, 1.0)?
            } else {
                None
            },
            top_k: self.uint("top_k")?,
            seed: if seed { self.seed("seed")? } else { None },
        })
    }

    /// `stop` / `stop_sequences`: a string or an array of strings.
    fn stops(&self, k: &str) -> Result<Vec<String>, ApiError> {
        let mut out = match self.val(k) {
            None => Vec::new(),
            Some(Value::String(s)) => vec![s],
            Some(Value::Array(a)) => a
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s),
                    _ => Err(bad(format!("{INVALID}: `{k}` must be strings"))),
                })
                .collect::<Result<_, _>>()?,
            Some(_) => Err(bad(format!(
                "{INVALID}: `{k}` must be a string or an array of strings"
            )))?,
        };
        out.retain(|s| !s.is_empty());
        Ok(out)
    }
}

/// Thinking controls shared by messages, responses and completions (docs/chat.md §2.1).
#[derive(Debug, Default)]
struct Thinking {
    explicit: bool,
    enabled: bool,
    effort: Option<ThinkingMode>,
}

impl Thinking {
    fn new() -> Thinking {
        Thinking {
            explicit: false,
            enabled: true,
            effort: None,
        }
    }

    fn thinking_field(&mut self, v: Option<Value>) -> Result<(), ApiError> {
        match v {
            None => {}
            Some(Value::Bool(b)) => {
                self.enabled = b;
                self.explicit = true;
            }
            Some(Value::Object(o)) => {
                match o.get("type").and_then(Value::as_str) {
                    Some("enabled") => self.enabled = true,
                    Some("disabled") => self.enabled = false,
                    _ => {}
                }
                self.explicit = true;
            }
            Some(_) => {}
        }
        Ok(())
    }

    fn effort_field(&mut self, v: Option<Value>, counts_as_control: bool) -> Result<(), ApiError> {
        match v {
            None => Ok(()),
            Some(Value::String(s)) => {
                let m = ThinkingMode::from_effort(&s)
                    .ok_or_else(|| bad(format!("{INVALID}: unknown reasoning effort {s:?}")))?;
                self.effort = Some(m);
                if counts_as_control {
                    self.explicit = true;
                    self.enabled = m != ThinkingMode::NoThink;
                }
                Ok(())
            }
            Some(_) => Err(bad(format!("{INVALID}: reasoning effort must be a string"))),
        }
    }

    fn mode(&self, model: &str, ctx: u64) -> ThinkingMode {
        let mut enabled = self.enabled;
        if !self.explicit {
            match model {
                "deepseek-chat" => enabled = false,
                "deepseek-reasoner" => enabled = true,
                _ => {}
            }
        }
        let m = if !enabled || self.effort == Some(ThinkingMode::NoThink) {
            ThinkingMode::NoThink
        } else if self.effort == Some(ThinkingMode::ThinkMax) {
            ThinkingMode::ThinkMax
        } else {
            ThinkingMode::Think
        };
        m.for_context(ctx)
    }
}

fn max_tokens(f: &Fields, keys: &[&str]) -> Result<Option<u64>, ApiError> {
    for k in keys {
        if let Some(v) = f.uint(k)? {
            return Ok(Some(v));
        }
    }
    Ok(None)
}

fn schema_lines(raw_tools: Option<&RawValue>) -> Result<Vec<String>, ApiError> {
    let Some(raw) = raw_tools else {
        return Ok(Vec::new());
    };
    let items =
        raw_array(raw).ok_or_else(|| bad(format!("{INVALID}: `tools` must be an array")))?;
    let mut lines = Vec::new();
    for it in items {
        lines.extend(render::tool_schema_lines(it.get()).map_err(|e| bad(e.to_string()))?);
    }
    Ok(lines)
}

/// `POST /v1/chat/completions`.
pub fn parse_chat(body: &[u8], ctx: u64) -> Result<GenRequest, ApiError> {
    let f = Fields::parse(body)?;
    let text = std::str::from_utf8(body).map_err(|_| bad(INVALID))?;
    let chat = ChatRequest::from_openai_json(text, ctx).map_err(|e| match e {
        ds4_chat::ChatError::Request(m) => bad(m),
        other => bad(other.to_string()),
    })?;
    if let Some(v) = f.val("messages") {
        if !v.is_array() {
            return Err(bad(format!("{INVALID}: `messages` must be an array")));
        }
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
    Ok(GenRequest {
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
        reasoning_summary: false,
        namespaces: HashMap::new(),
        previous_response_id: None,
    })
}

/// `POST /v1/completions`.
pub fn parse_completions(body: &[u8], ctx: u64) -> Result<GenRequest, ApiError> {
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

/// Text of a content value: a string, null, or an array of strings / `{text}` blocks
/// concatenated with no separator (other blocks dropped).
fn content_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(items) => {
            let mut out = String::new();
            for it in items {
                match it {
                    Value::String(s) => out.push_str(s),
                    Value::Object(o) => {
                        if let Some(Value::String(t)) = o.get("text") {
                            out.push_str(t);
                        }
                    }
                    _ => {}
                }
            }
            out
        }
        _ => String::new(),
    }
}

/// `POST /v1/messages` (Anthropic).
pub fn parse_messages(body: &[u8], ctx: u64) -> Result<GenRequest, ApiError> {
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
    for raw in items {
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
                    for b in blocks {
                        anthropic_block(&b, &mut msg)?;
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
    Ok(GenRequest {
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
        reasoning_summary: false,
        namespaces: HashMap::new(),
        previous_response_id: None,
    })
}

fn anthropic_block(raw: &RawValue, msg: &mut Message) -> Result<(), ApiError> {
    let v = value(raw);
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

/// `POST /v1/responses`.
pub fn parse_responses(body: &[u8], ctx: u64) -> Result<GenRequest, ApiError> {
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
            Value::Array(_) => {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live;

    const CTX: u64 = 4096;

    #[test]
    fn chat_fields_and_errors() {
        let r = parse_chat(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"temperature":0.5,"top_k":3,"seed":-1,"stream":true,"stream_options":{"include_usage":true},"stop":"X","unknown_field":{"a":1}}"#,
            CTX,
        )
        .unwrap();
        assert_eq!(r.model, "m");
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.sampling.temperature, Some(0.5));
        assert_eq!(r.sampling.top_k, Some(3));
        assert_eq!(r.sampling.seed, Some(u64::MAX));
        assert!(r.stream && r.include_usage);
        assert_eq!(r.stop, vec!["X"]);
        let err = |b: &[u8]| parse_chat(b, CTX).unwrap_err().message;
        assert!(err(b"{").contains("invalid JSON request"));
        assert!(err(b"[]").contains("JSON object"));
        assert_eq!(err(br#"{"model":"m"}"#), "missing messages");
        assert!(err(br#"{"messages":[],"temperature":"hot"}"#)
            .contains("`temperature` must be a number"));
        assert!(err(br#"{"messages":[],"temperature":101}"#).contains("between"));
        assert!(err(br#"{"messages":[],"top_p":1.5}"#).contains("top_p"));
        assert!(err(br#"{"messages":[],"max_tokens":-1}"#).contains("max_tokens"));
        assert!(err(br#"{"messages":[],"stream":"yes"}"#).contains("stream"));
        assert!(err(br#"{"messages":"hi"}"#).contains("invalid JSON request"));
        assert!(
            err(br#"{"messages":[],"reasoning_effort":"huge"}"#).contains("invalid JSON request")
        );
    }

    #[test]
    fn anthropic_normalization() {
        let r = parse_messages(
            br#"{"model":"claude","max_tokens":10,"system":[{"type":"text","text":"x-anthropic-billing"},{"type":"text","text":"A"},"B"],
                "tools":[{"name":"Read","input_schema":{"type":"object"}}],
                "messages":[{"role":"user","content":[{"type":"text","text":"open"}]},
                  {"role":"assistant","content":[{"type":"thinking","thinking":"t"},{"type":"tool_use","id":"toolu_1","name":"Read","input":{"z":1,"a":"q"}}]},
                  {"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":[{"type":"text","text":"x</tool_result>"}]}]}],
                "thinking":{"type":"disabled"},"stop_sequences":["S"]}"#,
            CTX,
        )
        .unwrap();
        assert_eq!(r.messages[0].content, "A\nB");
        assert_eq!(r.messages[2].reasoning, "t");
        assert_eq!(r.messages[2].tool_calls[0].arguments, r#"{"z":1,"a":"q"}"#);
        assert_eq!(
            r.messages[3].content,
            "<tool_result>x&lt;/tool_result></tool_result>"
        );
        assert_eq!(r.messages[3].tool_call_ids, vec!["toolu_1"]);
        assert_eq!(r.mode, ThinkingMode::NoThink);
        assert_eq!(
            r.tool_schemas,
            vec![r#"{"name":"Read","input_schema":{"type":"object"}}"#]
        );
        assert_eq!(r.stop, vec!["S"]);
        // A result for a call that is neither replayed nor live: 400 naming the id (the
        // check needs the live binding, so it happens when the request is prepared).
        let orphan = parse_messages(
            br#"{"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"gone","content":"r"}]}]}"#,
            CTX,
        )
        .unwrap();
        let e = live::plan(&orphan, None).unwrap_err();
        assert!(e.message.contains("tool_use_id gone"), "{}", e.message);
        let none = parse_messages(
            br#"{"messages":[],"tools":[{"name":"f"}],"tool_choice":{"type":"none"}}"#,
            CTX,
        )
        .unwrap();
        assert!(none.tool_schemas.is_empty());
    }

    #[test]
    fn responses_items_and_rules() {
        let r = parse_responses(
            br#"{"model":"m","instructions":"You are Codex.","input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"run pwd"}]},{"type":"reasoning","summary":[{"type":"summary_text","text":"Use shell."}]},{"type":"function_call","call_id":"call_9","name":"shell","arguments":"{\"cmd\":[\"pwd\"]}"},{"type":"function_call_output","call_id":"call_9","output":"/home"}],"tools":[{"type":"function","name":"shell","description":"Run","parameters":{"type":"object","properties":{"cmd":{"type":"array"}}}}],"reasoning":{"effort":"high","summary":"auto"},"stream":true}"#,
            CTX,
        )
        .unwrap();
        assert!(r.reasoning_summary);
        assert_eq!(r.mode, ThinkingMode::Think);
        assert_eq!(r.messages.len(), 4);
        assert_eq!(r.messages[2].reasoning, "Use shell.");
        assert_eq!(r.messages[2].tool_calls[0].id, "call_9");
        assert_eq!(r.messages[3].role, "tool");
        let err = |b: &[u8]| parse_responses(b, CTX).unwrap_err().message;
        assert_eq!(err(br#"{"model":"m"}"#), "missing input");
        assert_eq!(
            err(br#"{"input":"x","tool_choice":"required"}"#),
            "tool_choice=required not supported"
        );
        assert_eq!(
            err(br#"{"input":"x","tool_choice":{"type":"function"}}"#),
            "forced tool_choice not supported"
        );
        assert_eq!(
            err(br#"{"input":"x","conversation":"c"}"#),
            "conversation is not supported; replay full input instead"
        );
        assert!(err(br#"{"input":"x","previous_response_id":7}"#).contains("previous_response_id"));
        let plan_err = |b: &[u8]| {
            live::plan(&parse_responses(b, CTX).unwrap(), None)
                .unwrap_err()
                .message
        };
        assert!(plan_err(br#"{"input":"x","previous_response_id":"r"}"#)
            .starts_with("previous_response_id r is not available"));
        assert!(err(
            br#"{"input":[{"type":"message","role":"user","content":"x","status":"in_progress"}]}"#
        )
        .contains("status"));
        assert!(err(br#"{"input":[{"type":"bogus"}]}"#).contains("bogus"));
        assert!(plan_err(
            br#"{"input":[{"type":"function_call_output","call_id":"c","output":"o"}]}"#
        )
        .contains("call_id c"));
        let off = parse_responses(br#"{"input":"x","reasoning":{"effort":"none"}}"#, CTX).unwrap();
        assert_eq!(off.mode, ThinkingMode::NoThink);
    }

    #[test]
    fn completions_prompt_forms() {
        let r = parse_completions(br#"{"prompt":["a","b"],"think":false}"#, CTX).unwrap();
        assert_eq!(r.completion_prompt.as_deref(), Some("a"));
        assert_eq!(r.mode, ThinkingMode::NoThink);
        assert_eq!(
            parse_completions(br#"{}"#, CTX).unwrap_err().message,
            "missing prompt"
        );
        assert_eq!(
            parse_completions(br#"{"prompt":"x","model":"deepseek-chat"}"#, CTX)
                .unwrap()
                .mode,
            ThinkingMode::NoThink
        );
    }
}
