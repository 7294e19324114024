//! What the request parsers of the four endpoint families share (each family's own parser
//! lives in its module under `crate::endpoints`, docs/server.md §5, docs/chat.md §2.1,
//! §2.4, §2.6): typed field access, thinking controls, role and tool checks, and the cheap
//! bounds taken before parsing. Unknown fields are accepted and ignored, as ds4 does and as
//! SDKs need (they send fields a local server has no use for); a known field with the wrong
//! type or an out-of-range value is a 400 that names the field. Values that become prompt
//! bytes (tool schemas, tool-call arguments) are kept as the exact bytes sent.

use std::collections::BTreeMap;

use ds4_chat::render::{self, Message, ThinkingMode};
use serde_json::value::RawValue;
use serde_json::Value;

pub use crate::api::{Endpoint, GenRequest, Sampling};
use crate::error::ApiError;

/// Roles the renderer understands; anything else used to be dropped silently.
pub(crate) const KNOWN_ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

pub(crate) fn check_roles(messages: &[Message]) -> Result<(), ApiError> {
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
pub(crate) fn check_forced_tool(name: Option<&str>, tools: Option<Value>) -> Result<(), ApiError> {
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

pub(crate) const INVALID: &str = "invalid JSON request";

pub(crate) fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::bad(msg)
}

pub(crate) type RawMap = BTreeMap<String, Box<RawValue>>;

pub(crate) fn raw_object(raw: &str) -> Result<RawMap, ApiError> {
    serde_json::from_str(raw).map_err(|_| bad(INVALID))
}

pub(crate) fn raw_array(raw: &RawValue) -> Option<Vec<Box<RawValue>>> {
    serde_json::from_str(raw.get()).ok()
}

pub(crate) fn value(raw: &RawValue) -> Value {
    serde_json::from_str(raw.get()).unwrap_or(Value::Null)
}

/// Typed access to a request object's members.
pub(crate) struct Fields {
    pub(crate) map: RawMap,
}

impl Fields {
    pub(crate) fn parse(body: &[u8]) -> Result<Fields, ApiError> {
        let text =
            std::str::from_utf8(body).map_err(|_| bad(format!("{INVALID}: body is not UTF-8")))?;
        // Straight into a map of raw members: no `Value` tree of the whole body (an ignored
        // member of millions of tiny objects used to be built in full).
        if text.trim_start().as_bytes().first() != Some(&b'{') {
            return Err(bad(format!("{INVALID}: the body must be a JSON object")));
        }
        let map = serde_json::from_str(text).map_err(|e| bad(format!("{INVALID}: {e}")))?;
        Ok(Fields { map })
    }

    pub(crate) fn raw(&self, k: &str) -> Option<&RawValue> {
        self.map.get(k).map(|b| &**b).filter(|r| r.get() != "null")
    }

    pub(crate) fn val(&self, k: &str) -> Option<Value> {
        self.raw(k).map(value)
    }

    pub(crate) fn number(&self, k: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
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

    pub(crate) fn uint(&self, k: &str) -> Result<Option<u64>, ApiError> {
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
    pub(crate) fn seed(&self, k: &str) -> Result<Option<u64>, ApiError> {
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

    pub(crate) fn boolean(&self, k: &str) -> Result<Option<bool>, ApiError> {
        match self.val(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(_) => Err(bad(format!("{INVALID}: `{k}` must be a boolean"))),
        }
    }

    pub(crate) fn string(&self, k: &str) -> Result<Option<String>, ApiError> {
        match self.val(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(bad(format!("{INVALID}: `{k}` must be a string"))),
        }
    }

    pub(crate) fn model(&self) -> Result<String, ApiError> {
        Ok(self
            .string("model")?
            .unwrap_or_else(|| crate::config::MODEL_ID.to_string()))
    }

    pub(crate) fn stream_options_usage(&self) -> Result<bool, ApiError> {
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

    pub(crate) fn sampling(&self, min_p: bool, seed: bool) -> Result<Sampling, ApiError> {
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

    /// The extension fields `draft` (`"off"`, `"lookup"`, `"mtp"`, `"auto"`) and
    /// `draft_max` (1 to [`ds4_runtime::draft::MAX_DRAFT_MAX`]): this request's drafting.
    pub(crate) fn draft(&self) -> Result<crate::api::DraftRequest, ApiError> {
        use ds4_runtime::draft::MAX_DRAFT_MAX;
        let mode = match self.val("draft") {
            None => None,
            Some(Value::String(s)) => Some(match s.as_str() {
                "off" => ds4_runtime::DraftMode::Off,
                "lookup" => ds4_runtime::DraftMode::Lookup,
                "mtp" => ds4_runtime::DraftMode::Mtp,
                "auto" => ds4_runtime::DraftMode::Auto,
                _ => {
                    return Err(bad(format!(
                        "`draft` must be \"off\", \"lookup\", \"mtp\" or \"auto\", got {s:?}"
                    )))
                }
            }),
            Some(_) => return Err(bad(format!("{INVALID}: `draft` must be a string"))),
        };
        let max = match self.uint("draft_max")? {
            None => None,
            Some(n) if (1..=MAX_DRAFT_MAX as u64).contains(&n) => Some(n as usize),
            Some(n) => {
                return Err(bad(format!(
                    "`draft_max` must be between 1 and {MAX_DRAFT_MAX}, got {n}"
                )))
            }
        };
        Ok(crate::api::DraftRequest { mode, max })
    }

    /// `stop` / `stop_sequences`: a string or an array of strings, at most
    /// [`MAX_STOP_SEQUENCES`] of at most [`MAX_STOP_BYTES`] bytes each (the list travels
    /// with the queued job and is matched against every generated piece).
    pub(crate) fn stops(&self, k: &str) -> Result<Vec<String>, ApiError> {
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
        if out.len() > MAX_STOP_SEQUENCES {
            return Err(bad(format!(
                "`{k}` holds {} sequences; at most {MAX_STOP_SEQUENCES} are accepted",
                out.len()
            )));
        }
        if let Some((i, s)) = out
            .iter()
            .enumerate()
            .find(|(_, s)| s.len() > MAX_STOP_BYTES)
        {
            return Err(bad(format!(
                "`{k}[{i}]` is {} bytes long; a stop sequence may be at most {MAX_STOP_BYTES} bytes",
                s.len()
            )));
        }
        out.retain(|s| !s.is_empty());
        Ok(out)
    }

    /// `n` (and `best_of`): this server answers with one choice, so asking for more is a
    /// 400 rather than a silently shorter answer.
    pub(crate) fn single_choice(&self, keys: &[&str]) -> Result<(), ApiError> {
        for k in keys {
            if let Some(n) = self.uint(k)? {
                if n != 1 {
                    return Err(bad(format!(
                        "`{k}` must be 1: this server returns exactly one choice, got {n}"
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Most stop sequences a request may give (`stop`, `stop_sequences`).
pub const MAX_STOP_SEQUENCES: usize = 16;

/// Longest stop sequence, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;

/// Refuses an empty conversation: there is nothing to answer, and a bare prompt would
/// only run to the output limit.
pub(crate) fn require_items(field: &str, empty: bool) -> Result<(), ApiError> {
    if empty {
        Err(bad(format!(
            "`{field}` is empty: send at least one message"
        )))
    } else {
        Ok(())
    }
}

/// Content part types that carry media this text-only model cannot see: refused, so the
/// model never answers as if the image or audio had not been sent.
const MEDIA_PARTS: [&str; 9] = [
    "image_url",
    "image",
    "input_image",
    "input_audio",
    "audio",
    "file",
    "input_file",
    "document",
    "video_url",
];

/// Refuses media parts in the content arrays of `items` (messages or input items),
/// naming the part as `field[i].content[j]`.
pub(crate) fn check_media(field: &str, items: &[Value]) -> Result<(), ApiError> {
    for (i, it) in items.iter().enumerate() {
        refuse_media(|| format!("{field}[{i}]"), it)?;
        if let Some(Value::Array(parts)) = it.get("content") {
            for (j, p) in parts.iter().enumerate() {
                refuse_media(|| format!("{field}[{i}].content[{j}]"), p)?;
            }
        }
    }
    Ok(())
}

/// A 400 naming `at()` when `v` is a media part.
pub(crate) fn refuse_media(at: impl FnOnce() -> String, v: &Value) -> Result<(), ApiError> {
    match v.get("type").and_then(Value::as_str) {
        Some(t) if MEDIA_PARTS.contains(&t) => Err(bad(format!(
            "`{}` has type {t:?}: this model reads text only (send text instead)",
            at()
        ))),
        _ => Ok(()),
    }
}

/// Thinking controls shared by messages, responses and completions (docs/chat.md §2.1).
#[derive(Debug, Default)]
pub(crate) struct Thinking {
    pub(crate) explicit: bool,
    pub(crate) enabled: bool,
    pub(crate) effort: Option<ThinkingMode>,
}

impl Thinking {
    pub(crate) fn new() -> Thinking {
        Thinking {
            explicit: false,
            enabled: true,
            effort: None,
        }
    }

    pub(crate) fn thinking_field(&mut self, v: Option<Value>) -> Result<(), ApiError> {
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

    pub(crate) fn effort_field(
        &mut self,
        v: Option<Value>,
        counts_as_control: bool,
    ) -> Result<(), ApiError> {
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

    pub(crate) fn mode(&self, model: &str, ctx: u64) -> ThinkingMode {
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

pub(crate) fn max_tokens(f: &Fields, keys: &[&str]) -> Result<Option<u64>, ApiError> {
    for k in keys {
        if let Some(v) = f.uint(k)? {
            return Ok(Some(v));
        }
    }
    Ok(None)
}

pub(crate) fn schema_lines(raw_tools: Option<&RawValue>) -> Result<Vec<String>, ApiError> {
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

/// Text of a content value: a string, null, or an array of strings / `{text}` blocks
/// concatenated with no separator (other blocks dropped).
pub(crate) fn content_text(v: &Value) -> String {
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
