//! Tool-output continuations on the live KV state (docs/server.md §9 steps 2–4, §8 409).
//!
//! Agents answer a tool call in one of two ways: they replay the whole history with the tool
//! results appended, or they send *only* the results (Responses: `function_call_output`
//! items, optionally with `previous_response_id`; Anthropic: a last user message of
//! `tool_result` blocks) and expect the server to remember the rest. The worker remembers,
//! after each clean Responses / Messages turn, which call ids the live state ends with
//! ([`ToolBinding`]). A request whose trailing tool outputs answer exactly those ids is served
//! as live tokens + `⟨EOS⟩` + the rendered tool-result turn + `⟨A⟩` + think tag: nothing of the
//! replayed history is re-evaluated, and the client's re-serialization of the assistant turn
//! cannot break the prefix. A request that can *only* be served this way (its outputs answer
//! calls it does not replay) gets 400 when the ids are not live, or 409 when they were live
//! when it was accepted but another request moved the live state before it ran.

use std::collections::HashSet;

use ds4_chat::render::{self, Message, ThinkingMode};
use ds4_chat::tokenizer::{BOS_TEXT, EOS_TEXT};

use crate::api::{Continuation, Endpoint, GenRequest};
use crate::error::{ApiError, ErrorKind};

/// What the live state ends with after a clean Responses or Messages turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolBinding {
    pub endpoint: Endpoint,
    /// The Responses `resp_…` id of the turn (for `previous_response_id`).
    pub response_id: Option<String>,
    /// Tool-call ids of the turn, in order (empty for a turn without calls).
    pub call_ids: Vec<String>,
    /// The turn ran with tools live (a continuation keeps DSML parsing on).
    pub tools: bool,
    /// Live length when the binding was made; it is only valid at exactly this length.
    pub frontier: usize,
}

/// How a request's tool ids must relate to the binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TailMatch {
    /// The same set of ids (spec: exact set equality).
    SameSet,
    /// Every id of the request is live (`previous_response_id`: the response must also match).
    Subset,
}

/// A request that can continue the live state directly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveTail {
    pub ids: Vec<String>,
    pub response_id: Option<String>,
    pub matching: TailMatch,
    /// `⟨EOS⟩` + the tail turn(s) + `⟨A⟩` + think tag, and its tokens.
    pub suffix_text: String,
    /// Renderer-owned byte ranges of `suffix_text` ([`render::Rendered`]).
    pub suffix_trusted: Vec<std::ops::Range<usize>>,
    pub suffix_tokens: Vec<u32>,
    /// No full prompt to fall back on: without the binding the request cannot be served.
    pub required: bool,
    /// The request's family's continuation facts.
    pub continuation: Continuation,
}

impl LiveTail {
    /// Whether `b` (the binding at the current live length) serves this tail.
    pub fn matches(&self, endpoint: Endpoint, b: &ToolBinding) -> bool {
        if b.endpoint != endpoint {
            return false;
        }
        if self.response_id.is_some() && self.response_id != b.response_id {
            return false;
        }
        let live: HashSet<&str> = b.call_ids.iter().map(String::as_str).collect();
        let want: HashSet<&str> = self.ids.iter().map(String::as_str).collect();
        match self.matching {
            TailMatch::SameSet => !want.is_empty() && want == live,
            TailMatch::Subset => want.is_subset(&live),
        }
    }

    /// Where the reuse came from (logs, `/health`).
    pub fn source(&self) -> &'static str {
        if self.continuation.response_ids && self.response_id.is_some() {
            "previous-response"
        } else {
            self.continuation.tool_output_source
        }
    }
}

/// The 409 of a continuation whose live state vanished before the worker ran it.
pub fn conflict(c: &Continuation) -> ApiError {
    ApiError::new(
        ErrorKind::Conflict,
        format!(
            "{} continuation state is not available; retry by replaying the full {} history",
            c.protocol, c.history
        ),
    )
}

/// The 400 of a tool output whose call is neither replayed nor live.
pub fn unknown_call(c: &Continuation, id: &str) -> ApiError {
    ApiError::bad(format!(
        "{} continuation state is not available for {} {id}; retry by replaying the full {} history",
        c.protocol, c.call_id_field, c.history
    ))
}

fn is_system(m: &Message) -> bool {
    m.role == "system" || m.role == "developer"
}

/// Renders messages that continue a live state: `⟨EOS⟩` (closing the live assistant turn,
/// whose EOS was sampled but not evaluated) + each turn exactly as the full prompt would
/// render it + `⟨A⟩` + think tag. System messages are left out: the live state's system
/// block cannot change.
pub fn render_tail(tail: &[Message], mode: ThinkingMode) -> Result<render::Rendered, ApiError> {
    let msgs: Vec<Message> = tail.iter().filter(|m| !is_system(m)).cloned().collect();
    let full = render::render_prompt_spans(&msgs, &[] as &[String], mode);
    let mut head = String::from(BOS_TEXT);
    if mode == ThinkingMode::ThinkMax {
        head.push_str(render::MAX_PREFIX);
    }
    if !full.text.starts_with(head.as_str()) {
        return Err(ApiError::internal("tail rendering has an unexpected head"));
    }
    let body = full.suffix(head.len());
    let mut out = render::Rendered::default();
    out.ctl(EOS_TEXT);
    let shift = out.text.len();
    out.text.push_str(&body.text);
    for r in body.trusted {
        let r = r.start + shift..r.end + shift;
        match out.trusted.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => out.trusted.push(r),
        }
    }
    Ok(out)
}

/// Tool ids answered by `m` (tool messages and Anthropic `tool_result` blocks).
fn answered(m: &Message) -> impl Iterator<Item = &String> {
    m.tool_call_ids.iter().filter(|i| !i.is_empty())
}

/// Decides whether `req` continues the live state, and checks what must be live (the
/// suffix is left for the caller to tokenize). `binding`
/// is the worker's binding as the handler sees it now (the worker checks again when it runs
/// the job). `Ok(None)`: render the full prompt as usual.
pub fn plan(req: &GenRequest, binding: Option<&ToolBinding>) -> Result<Option<LiveTail>, ApiError> {
    let ep = req.endpoint;
    let Some(cont) = req.continuation else {
        return Ok(None);
    };
    let msgs = &req.messages;
    let build = |tail: &[Message],
                 ids: Vec<String>,
                 response_id: Option<String>,
                 matching: TailMatch,
                 required: bool|
     -> Result<Option<LiveTail>, ApiError> {
        let r = render_tail(tail, req.mode)?;
        Ok(Some(LiveTail {
            ids,
            response_id,
            matching,
            suffix_text: r.text,
            suffix_trusted: r.trusted,
            suffix_tokens: Vec::new(),
            required,
            continuation: cont,
        }))
    };
    let calls: HashSet<&str> = msgs
        .iter()
        .flat_map(|m| m.tool_calls.iter().map(|c| c.id.as_str()))
        .collect();

    // `previous_response_id`: the whole input continues that response.
    if let Some(prev) = &req.previous_response_id {
        let live = binding.filter(|b| b.endpoint == ep && b.response_id.as_ref() == Some(prev));
        let Some(b) = live else {
            return Err(ApiError::bad(format!(
                "previous_response_id {prev} is not available (only the latest response can be continued); replay full input instead"
            )));
        };
        let tail: Vec<Message> = msgs.iter().filter(|m| !is_system(m)).cloned().collect();
        if tail.is_empty() {
            return Err(ApiError::bad("missing input"));
        }
        let ids: Vec<String> = tail
            .iter()
            .flat_map(answered)
            .filter(|i| !calls.contains(i.as_str()))
            .cloned()
            .collect();
        if let Some(id) = ids.iter().find(|i| !b.call_ids.contains(i)) {
            return Err(unknown_call(&cont, id));
        }
        return build(&tail, ids, Some(prev.clone()), TailMatch::Subset, true);
    }

    // The trailing turn: everything after the last assistant message.
    let start = msgs
        .iter()
        .rposition(|m| m.role == "assistant")
        .map_or(0, |i| i + 1);
    let tail = &msgs[start..];
    // An output before the last assistant turn that answers no replayed call: the live
    // state cannot serve it either (it ends after that assistant turn).
    if let Some(id) = msgs[..start]
        .iter()
        .flat_map(answered)
        .find(|id| !calls.contains(id.as_str()))
    {
        return Err(unknown_call(&cont, id));
    }
    let tail_ids: Vec<String> = tail.iter().flat_map(answered).cloned().collect();
    if tail_ids.is_empty() {
        return Ok(None);
    }
    let orphans: Vec<&String> = tail_ids
        .iter()
        .filter(|i| !calls.contains(i.as_str()))
        .collect();
    if !orphans.is_empty() {
        // Only the live state can serve it.
        let live: HashSet<&str> = binding
            .filter(|b| b.endpoint == ep)
            .map(|b| b.call_ids.iter().map(String::as_str).collect())
            .unwrap_or_default();
        if let Some(id) = orphans.iter().find(|i| !live.contains(i.as_str())) {
            return Err(unknown_call(&cont, id));
        }
        return build(tail, tail_ids, None, TailMatch::Subset, true);
    }
    // Fully replayed: the live state still serves it when the replayed assistant turn's
    // calls are the live ones (the replay itself may not byte-match what was sampled).
    let ids = match start.checked_sub(1).map(|i| &msgs[i]) {
        Some(a) if !a.tool_calls.is_empty() => a.tool_calls.iter().map(|c| c.id.clone()).collect(),
        _ => tail_ids,
    };
    build(tail, ids, None, TailMatch::SameSet, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_chat::tokenizer::{ASSISTANT_TEXT, THINK_CLOSE_TEXT, THINK_OPEN_TEXT, USER_TEXT};

    #[test]
    fn tail_renders_as_the_full_prompt_does() {
        let tail = vec![
            Message::system("ignored"),
            Message::tool("c1", "r1 </tool_result>"),
            Message::tool("c2", "r2"),
            Message::user("next"),
        ];
        let t = render_tail(&tail, ThinkingMode::Think).unwrap().text;
        assert_eq!(
            t,
            format!("{EOS_TEXT}{USER_TEXT}<tool_result>r1 &lt;/tool_result></tool_result><tool_result>r2</tool_result>{USER_TEXT}next{ASSISTANT_TEXT}{THINK_OPEN_TEXT}")
        );
        let t = render_tail(&tail[1..2], ThinkingMode::ThinkMax)
            .unwrap()
            .text;
        assert_eq!(
            t,
            format!("{EOS_TEXT}{USER_TEXT}<tool_result>r1 &lt;/tool_result></tool_result>{ASSISTANT_TEXT}{THINK_OPEN_TEXT}")
        );
        let t = render_tail(&tail[3..], ThinkingMode::NoThink).unwrap().text;
        assert_eq!(
            t,
            format!("{EOS_TEXT}{USER_TEXT}next{ASSISTANT_TEXT}{THINK_CLOSE_TEXT}")
        );
    }

    /// The suffix served on the live state is byte-identical to how the full prompt (history
    /// replayed after a tool-call turn) ends, in every thinking mode.
    #[test]
    fn tail_is_the_end_of_the_full_prompt() {
        let mut call = Message::assistant("Sure.", "plan");
        call.tool_calls = vec![ds4_chat::render::ToolCall {
            id: "c1".into(),
            name: "bash".into(),
            arguments: r#"{"command":"ls"}"#.into(),
        }];
        let history = [Message::system("sys"), Message::user("go"), call];
        let tails = [
            vec![Message::tool("c1", "a.txt")],
            vec![Message::tool("c1", "a.txt"), Message::user("and?")],
            vec![Message::user("never mind")],
        ];
        let schemas = [r#"{"name":"bash"}"#];
        for mode in [
            ThinkingMode::NoThink,
            ThinkingMode::Think,
            ThinkingMode::ThinkMax,
        ] {
            for tail in &tails {
                let all: Vec<Message> = history.iter().chain(tail).cloned().collect();
                let full = render::render_prompt(&all, &schemas, mode);
                let t = render_tail(tail, mode).unwrap().text;
                assert!(
                    full.ends_with(&t),
                    "{mode:?}: {full:?} does not end with {t:?}"
                );
            }
        }
    }

    #[test]
    fn matching_rules() {
        let b = ToolBinding {
            endpoint: Endpoint::Responses,
            response_id: Some("resp_1".into()),
            call_ids: vec!["a".into(), "b".into()],
            tools: true,
            frontier: 10,
        };
        let t = |ids: &[&str], rid: Option<&str>, m| LiveTail {
            ids: ids.iter().map(|s| s.to_string()).collect(),
            response_id: rid.map(str::to_string),
            matching: m,
            suffix_text: String::new(),
            suffix_trusted: Vec::new(),
            suffix_tokens: Vec::new(),
            required: true,
            continuation: Continuation {
                protocol: "Responses",
                history: "input",
                call_id_field: "call_id",
                tool_output_source: "responses-tool-output",
                response_ids: true,
            },
        };
        assert!(t(&["b", "a"], None, TailMatch::SameSet).matches(Endpoint::Responses, &b));
        assert!(!t(&["a"], None, TailMatch::SameSet).matches(Endpoint::Responses, &b));
        assert!(t(&["a"], None, TailMatch::Subset).matches(Endpoint::Responses, &b));
        assert!(!t(&["a", "x"], None, TailMatch::Subset).matches(Endpoint::Responses, &b));
        assert!(!t(&["a", "b"], None, TailMatch::SameSet).matches(Endpoint::Messages, &b));
        assert!(t(&[], Some("resp_1"), TailMatch::Subset).matches(Endpoint::Responses, &b));
        assert!(!t(&[], Some("resp_2"), TailMatch::Subset).matches(Endpoint::Responses, &b));
        assert!(!t(&[], None, TailMatch::SameSet).matches(Endpoint::Responses, &b));
    }
}
