//! OpenAI chat request → render input (docs/chat.md §2.1, §2.4, §2.6), read the way ds4
//! reads it: the same leniency, the same defaults, raw bytes where the prompt copies bytes.
//! Used by `ds4 render --messages FILE.json` and by the server's `/v1/chat/completions`.

use crate::error::ChatError;
use crate::json::Scanner;
use crate::render::{self, Message, ThinkingMode, ToolCall};

/// What a `/v1/chat/completions` body asks the renderer and the output parser for.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    /// Schema lines of the request's `tools` (empty when absent).
    pub tool_schemas: Vec<String>,
    /// `tool_choice: "none"` was given: schemas are not rendered and tools are not streamed.
    pub tool_choice_none: bool,
    pub model: Option<String>,
    /// Final thinking mode (aliases and the Think Max context rule applied).
    pub mode: ThinkingMode,
    /// Non-empty stop sequences.
    pub stop: Vec<String>,
}

impl ChatRequest {
    /// Tools are active: schemas present and `tool_choice` is not "none".
    pub fn has_tools(&self) -> bool {
        !self.tool_schemas.iter().all(|s| s.is_empty()) && !self.tool_choice_none
    }

    /// The schema lines that are rendered (none unless [`Self::has_tools`]).
    pub fn active_tool_schemas(&self) -> &[String] {
        if self.has_tools() {
            &self.tool_schemas
        } else {
            &[]
        }
    }

    /// The rendered prompt string (docs/chat.md §2.3).
    pub fn render(&self) -> String {
        render::render_prompt(&self.messages, self.active_tool_schemas(), self.mode)
    }

    /// Parses a chat request body. `ctx_size` decides the Think Max downgrade.
    pub fn from_openai_json(body: &str, ctx_size: u64) -> Result<Self, ChatError> {
        let bad = || ChatError::Request("invalid JSON request".into());
        let mut req = ChatRequest::default();
        let mut got_messages = false;
        let mut got_thinking = false;
        let mut thinking_enabled = true;
        let mut effort = ThinkingMode::Think;
        let mut sc = Scanner::new(body);
        walk_object(&mut sc, |key, sc| {
            match key {
                "messages" => {
                    req.messages = parse_messages(sc)?;
                    got_messages = true;
                }
                "tools" => req.tool_schemas = parse_tools(sc)?,
                "tool_choice" => {
                    sc.ws();
                    if sc.peek() == Some(b'"') {
                        req.tool_choice_none = sc.string()? == "none";
                    } else if !sc.skip_value() {
                        return None;
                    }
                }
                "model" => req.model = Some(sc.string()?),
                "thinking" => {
                    parse_thinking_control(sc, &mut thinking_enabled)?;
                    got_thinking = true;
                }
                "think" => {
                    thinking_enabled = parse_bool(sc)?;
                    got_thinking = true;
                }
                "reasoning_effort" => {
                    sc.ws();
                    if !sc.lit("null") {
                        effort = ThinkingMode::from_effort(&sc.string()?)?;
                    }
                }
                "stop" => req.stop = parse_stop(sc)?,
                _ => {
                    if !sc.skip_value() {
                        return None;
                    }
                }
            }
            Some(())
        })
        .ok_or_else(bad)?;
        if !got_messages {
            return Err(ChatError::Request("missing messages".into()));
        }
        if !got_thinking {
            match req.model.as_deref() {
                Some("deepseek-chat") => thinking_enabled = false,
                Some("deepseek-reasoner") => thinking_enabled = true,
                _ => {}
            }
        }
        let mode = if !thinking_enabled {
            ThinkingMode::NoThink
        } else {
            effort
        };
        req.mode = mode.for_context(ctx_size);
        Ok(req)
    }
}

/// Parses an OpenAI `messages` array (the `--messages FILE.json` of `ds4 render`).
pub fn messages_from_json(json: &str) -> Result<Vec<Message>, ChatError> {
    let mut sc = Scanner::new(json);
    let msgs = parse_messages(&mut sc)
        .ok_or_else(|| ChatError::Request("messages: not a valid message array".into()))?;
    sc.ws();
    if sc.pos != json.len() {
        return Err(ChatError::Request(format!(
            "messages: unexpected text at byte {}",
            sc.pos
        )));
    }
    Ok(msgs)
}

/// Parses a `tools` array (the `--tools FILE.json` of `ds4 render`) into schema lines.
pub fn tool_schemas_from_json(json: &str) -> Result<Vec<String>, ChatError> {
    let mut sc = Scanner::new(json);
    let lines = parse_tools(&mut sc)
        .ok_or_else(|| ChatError::Request("tools: not a valid tools array".into()))?;
    sc.ws();
    if sc.pos != json.len() {
        return Err(ChatError::Request(format!(
            "tools: unexpected text at byte {}",
            sc.pos
        )));
    }
    Ok(lines)
}

/// ds4's object walk: members with optional commas; `f` consumes each value.
fn walk_object(
    sc: &mut Scanner<'_>,
    mut f: impl FnMut(&str, &mut Scanner<'_>) -> Option<()>,
) -> Option<()> {
    sc.ws();
    if sc.peek() != Some(b'{') {
        return None;
    }
    sc.pos += 1;
    sc.ws();
    while let Some(b) = sc.peek() {
        if b == b'}' {
            sc.pos += 1;
            return Some(());
        }
        let key = sc.string()?;
        sc.ws();
        if sc.peek() != Some(b':') {
            return None;
        }
        sc.pos += 1;
        f(&key, sc)?;
        sc.ws();
        if sc.peek() == Some(b',') {
            sc.pos += 1;
        }
        sc.ws();
    }
    None
}

/// ds4's array walk: items with optional commas; `f` consumes each item.
fn walk_array(
    sc: &mut Scanner<'_>,
    mut f: impl FnMut(&mut Scanner<'_>) -> Option<()>,
) -> Option<()> {
    sc.ws();
    if sc.peek() != Some(b'[') {
        return None;
    }
    sc.pos += 1;
    sc.ws();
    while let Some(b) = sc.peek() {
        if b == b']' {
            sc.pos += 1;
            return Some(());
        }
        f(sc)?;
        sc.ws();
        if sc.peek() == Some(b',') {
            sc.pos += 1;
        }
        sc.ws();
    }
    None
}

fn parse_bool(sc: &mut Scanner<'_>) -> Option<bool> {
    sc.ws();
    if sc.lit("true") {
        Some(true)
    } else if sc.lit("false") {
        Some(false)
    } else {
        None
    }
}

/// `thinking`: null (no change), a bool, or `{"type":"enabled"|"disabled"}` (other types
/// ignored); any other value is skipped.
fn parse_thinking_control(sc: &mut Scanner<'_>, enabled: &mut bool) -> Option<()> {
    sc.ws();
    match sc.peek() {
        _ if sc.lit("null") => Some(()),
        Some(b't' | b'f') => {
            *enabled = parse_bool(sc)?;
            Some(())
        }
        Some(b'{') => walk_object(sc, |k, sc| {
            if k == "type" {
                match sc.string()?.as_str() {
                    "enabled" => *enabled = true,
                    "disabled" => *enabled = false,
                    _ => {}
                }
                Some(())
            } else {
                sc.skip_value().then_some(())
            }
        }),
        _ => sc.skip_value().then_some(()),
    }
}

fn parse_stop(sc: &mut Scanner<'_>) -> Option<Vec<String>> {
    sc.ws();
    let mut out = Vec::new();
    match sc.peek() {
        Some(b'"') => out.push(sc.string()?),
        Some(b'[') => walk_array(sc, |sc| {
            sc.ws();
            if sc.peek() == Some(b'"') {
                out.push(sc.string()?);
                Some(())
            } else {
                sc.skip_value().then_some(())
            }
        })?,
        _ => {
            if !sc.skip_value() {
                return None;
            }
        }
    }
    out.retain(|s| !s.is_empty());
    Some(out)
}

/// ds4 `json_content`: a string, null (empty), an array whose strings and objects' `text`
/// members are concatenated with no separator, or anything else (empty).
fn parse_content(sc: &mut Scanner<'_>) -> Option<String> {
    sc.ws();
    match sc.peek() {
        Some(b'"') => sc.string(),
        Some(b'[') => {
            let mut out = String::new();
            walk_array(sc, |sc| {
                sc.ws();
                match sc.peek() {
                    Some(b'"') => out.push_str(&sc.string()?),
                    Some(b'{') => walk_object(sc, |k, sc| {
                        if k == "text" {
                            out.push_str(&sc.string()?);
                            Some(())
                        } else {
                            sc.skip_value().then_some(())
                        }
                    })?,
                    _ => {
                        if !sc.skip_value() {
                            return None;
                        }
                    }
                }
                Some(())
            })?;
            Some(out)
        }
        _ if sc.lit("null") => Some(String::new()),
        _ => sc.skip_value().then(String::new),
    }
}

fn parse_tool_calls(sc: &mut Scanner<'_>) -> Option<Vec<ToolCall>> {
    sc.ws();
    if sc.lit("null") {
        return Some(Vec::new());
    }
    let mut calls = Vec::new();
    walk_array(sc, |sc| {
        let mut id = None;
        let mut name = None;
        let mut arguments = None;
        walk_object(sc, |k, sc| {
            match k {
                "id" => id = Some(sc.string()?),
                "function" => walk_object(sc, |k, sc| {
                    match k {
                        "name" => name = Some(sc.string()?),
                        "arguments" => {
                            sc.ws();
                            arguments = Some(if sc.peek() == Some(b'"') {
                                sc.string()?
                            } else {
                                sc.raw_value()?.to_owned()
                            });
                        }
                        _ => {
                            if !sc.skip_value() {
                                return None;
                            }
                        }
                    }
                    Some(())
                })?,
                _ => {
                    if !sc.skip_value() {
                        return None;
                    }
                }
            }
            Some(())
        })?;
        // Entries lacking a name or arguments are dropped (docs/chat.md §2.6).
        if let (Some(name), Some(arguments)) = (name, arguments) {
            calls.push(ToolCall {
                id: id.unwrap_or_default(),
                name,
                arguments,
            });
        }
        Some(())
    })?;
    Some(calls)
}

fn parse_messages(sc: &mut Scanner<'_>) -> Option<Vec<Message>> {
    let mut msgs = Vec::new();
    walk_array(sc, |sc| {
        let mut m = Message::default();
        let mut role = None;
        walk_object(sc, |k, sc| {
            match k {
                "role" => role = Some(sc.string()?),
                "content" => m.content = parse_content(sc)?,
                "reasoning_content" => m.reasoning = parse_content(sc)?,
                "tool_call_id" => m.tool_call_ids.push(sc.string()?),
                "tool_calls" => m.tool_calls = parse_tool_calls(sc)?,
                _ => {
                    if !sc.skip_value() {
                        return None;
                    }
                }
            }
            Some(())
        })?;
        m.role = role.unwrap_or_else(|| "user".to_owned());
        msgs.push(m);
        Some(())
    })?;
    Some(msgs)
}

fn parse_tools(sc: &mut Scanner<'_>) -> Option<Vec<String>> {
    sc.ws();
    if sc.lit("null") {
        return Some(Vec::new());
    }
    let mut lines = Vec::new();
    walk_array(sc, |sc| {
        let raw = sc.raw_value()?;
        lines.extend(render::tool_schema_lines(raw).ok()?);
        Some(())
    })?;
    Some(lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_and_aliases() {
        let m = |body: &str| ChatRequest::from_openai_json(body, 1 << 20).unwrap().mode;
        assert_eq!(m(r#"{"messages":[]}"#), ThinkingMode::Think);
        assert_eq!(
            m(r#"{"model":"deepseek-chat","messages":[]}"#),
            ThinkingMode::NoThink
        );
        assert_eq!(
            m(r#"{"model":"deepseek-chat","think":true,"messages":[]}"#),
            ThinkingMode::Think
        );
        assert_eq!(
            m(r#"{"thinking":{"type":"disabled"},"messages":[]}"#),
            ThinkingMode::NoThink
        );
        assert_eq!(
            m(r#"{"thinking":{"type":"weird"},"messages":[]}"#),
            ThinkingMode::Think
        );
        assert_eq!(
            m(r#"{"reasoning_effort":"max","messages":[]}"#),
            ThinkingMode::ThinkMax
        );
        assert_eq!(
            m(r#"{"reasoning_effort":"none","messages":[]}"#),
            ThinkingMode::NoThink
        );
        assert_eq!(
            m(r#"{"reasoning_effort":null,"messages":[]}"#),
            ThinkingMode::Think
        );
        let small =
            ChatRequest::from_openai_json(r#"{"reasoning_effort":"max","messages":[]}"#, 4096)
                .unwrap();
        assert_eq!(small.mode, ThinkingMode::Think);
        assert!(
            ChatRequest::from_openai_json(r#"{"reasoning_effort":"huge","messages":[]}"#, 0)
                .is_err()
        );
        assert!(
            matches!(ChatRequest::from_openai_json(r#"{"model":"x"}"#, 0), Err(ChatError::Request(m)) if m == "missing messages")
        );
        assert!(ChatRequest::from_openai_json("[", 0).is_err());
    }

    #[test]
    fn messages_content_and_calls() {
        let msgs = messages_from_json(
            r#"[{"content":null},{"role":"user","content":["a",{"type":"text","text":"b"},{"type":"image_url","image_url":{"url":"x"}},3]},
               {"role":"assistant","content":"","tool_calls":[{"id":"1","function":{"name":"f","arguments":{"a" : 1}}},{"id":"2","function":{"name":"g"}}]},
               {"role":"tool","tool_call_id":"1","content":"r"}]"#,
        )
        .unwrap();
        assert_eq!(msgs[0].role, "user");
        assert_eq!(msgs[0].content, "");
        assert_eq!(msgs[1].content, "ab");
        assert_eq!(
            msgs[2].tool_calls,
            vec![ToolCall {
                id: "1".into(),
                name: "f".into(),
                arguments: "{\"a\" : 1}".into()
            }]
        );
        assert_eq!(msgs[3].tool_call_ids, vec!["1".to_string()]);
        assert!(messages_from_json(r#"[{"role":1}]"#).is_err());
        assert!(messages_from_json(r#"[] x"#).is_err());
    }

    #[test]
    fn stops_and_tool_choice() {
        let r = ChatRequest::from_openai_json(
            r#"{"stop":["","END",5,"x"],"tool_choice":"none","tools":[{"type":"function","function":{"name":"f"}}],"messages":[]}"#,
            0,
        )
        .unwrap();
        assert_eq!(r.stop, vec!["END", "x"]);
        assert!(!r.has_tools());
        assert!(r.active_tool_schemas().is_empty());
        assert_eq!(r.tool_schemas, vec![r#"{"name":"f"}"#]);
    }
}
