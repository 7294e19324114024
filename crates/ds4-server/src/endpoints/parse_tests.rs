//! Tests of the four families' request parsers (and the shared bounds in
//! `crate::request`), kept together: they compare the families on the same inputs.

use crate::endpoints::chat::parse as parse_chat;
use crate::endpoints::completions::parse as parse_completions;
use crate::endpoints::messages::parse as parse_messages;
use crate::endpoints::responses::parse as parse_responses;
use crate::live;
use ds4_chat::render::ThinkingMode;

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
    assert!(
        err(br#"{"messages":[],"temperature":"hot"}"#).contains("`temperature` must be a number")
    );
    assert!(err(br#"{"messages":[],"temperature":101}"#).contains("between"));
    assert!(err(br#"{"messages":[],"top_p":1.5}"#).contains("top_p"));
    assert!(err(br#"{"messages":[],"max_tokens":-1}"#).contains("max_tokens"));
    assert!(err(br#"{"messages":[],"stream":"yes"}"#).contains("stream"));
    assert!(err(br#"{"messages":"hi"}"#).contains("invalid JSON request"));
    assert!(err(br#"{"messages":[],"reasoning_effort":"huge"}"#).contains("invalid JSON request"));
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
        br#"{"messages":[{"role":"user","content":"x"}],"tools":[{"name":"f"}],"tool_choice":{"type":"none"}}"#,
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
    assert!(
        plan_err(br#"{"input":[{"type":"function_call_output","call_id":"c","output":"o"}]}"#)
            .contains("call_id c")
    );
    let off = parse_responses(br#"{"input":"x","reasoning":{"effort":"none"}}"#, CTX).unwrap();
    assert_eq!(off.mode, ThinkingMode::NoThink);
}

#[test]
fn completions_prompt_forms() {
    // One prompt, as it is: an array of one string, never more; thinking controls do not
    // apply (no template), so the mode is always non-thinking.
    let r = parse_completions(br#"{"prompt":["a"],"think":true}"#, CTX).unwrap();
    assert_eq!(r.completion_prompt.as_deref(), Some("a"));
    assert_eq!(r.mode, ThinkingMode::NoThink);
    assert!(parse_completions(br#"{"prompt":["a","b"]}"#, CTX)
        .unwrap_err()
        .message
        .contains("2 prompts"));
    assert!(parse_completions(br#"{"prompt":[1,2]}"#, CTX)
        .unwrap_err()
        .message
        .contains("`prompt`"));
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
