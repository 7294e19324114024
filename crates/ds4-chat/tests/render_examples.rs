//! The fully rendered examples of docs/chat.md §2.9 (real ds4 output): byte length, SHA1 and
//! token ids/counts. Expected values are copied from the spec, never computed here.

mod common;

use ds4_chat::render::{self, Message, ThinkingMode, ToolCall, MAX_PREFIX, TOOLS_HEAD, TOOLS_TAIL};
use ds4_chat::request::ChatRequest;

fn sha1(s: &str) -> String {
    sha1_smol::Sha1::from(s.as_bytes()).digest().to_string()
}

/// Checks bytes, SHA1 and (both special-token policies agree here) the token count / ids.
fn check(
    name: &str,
    rendered: &str,
    bytes: usize,
    sha: Option<&str>,
    tokens: usize,
    ids: Option<&[u32]>,
) {
    assert_eq!(
        rendered.len(),
        bytes,
        "{name}: byte length; rendered:\n{rendered}"
    );
    if let Some(sha) = sha {
        assert_eq!(sha1(rendered), sha, "{name}: SHA1; rendered:\n{rendered}");
    }
    let tok = common::tokenizer();
    let chat = tok.encode_chat(rendered).unwrap();
    let hf = tok.encode(rendered, true).unwrap();
    assert_eq!(
        chat, hf,
        "{name}: ds4 marker tokenization differs from HF added-token tokenization"
    );
    assert_eq!(chat.len(), tokens, "{name}: token count");
    if let Some(ids) = ids {
        assert_eq!(chat, ids, "{name}: ids");
    }
    assert_eq!(
        tok.decode(&chat).unwrap(),
        rendered.as_bytes(),
        "{name}: decode"
    );
}

const CTX: u64 = 1 << 20;

#[test]
fn fixed_blocks() {
    assert_eq!(sha1(MAX_PREFIX), "bed6f7c6d90743ed442f3da80117db88a8fc16a6");
    assert_eq!(sha1(TOOLS_HEAD), "a1799c665cc488953159d077e5aa5cc7f4ee1218");
    assert_eq!(sha1(TOOLS_TAIL), "ebfe73f1c2b10a58c2e5ef37bbd4bc5d21f770b0");
}

#[test]
fn ex1_system_user_default_thinking() {
    let r = ChatRequest::from_openai_json(
        r#"{"model":"deepseek-v4-flash","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Hi"}]}"#,
        CTX,
    )
    .unwrap();
    let s = r.render();
    assert_eq!(
        s,
        "<｜begin▁of▁sentence｜>You are terse.<｜User｜>Hi<｜Assistant｜><think>"
    );
    check(
        "ex1",
        &s,
        81,
        Some("11b6e82aedda08ee8214ccd7acb8bee2b49ea636"),
        10,
        Some(&[0, 3476, 477, 259, 10935, 16, 128803, 23166, 128804, 128821]),
    );
}

#[test]
fn ex2_multi_turn_reasoning_dropped_developer_hoisted() {
    let r = ChatRequest::from_openai_json(
        r#"{"model":"deepseek-v4-flash","messages":[{"role":"system","content":"S1"},{"role":"user","content":"first"},{"role":"assistant","content":"first answer","reasoning_content":"old hidden reasoning"},{"role":"developer","content":"S2"},{"role":"user","content":[{"type":"text","text":"sec"},{"type":"text","text":"ond"}]}]}"#,
        CTX,
    )
    .unwrap();
    check(
        "ex2",
        &r.render(),
        158,
        Some("0e5f9eaa9c15000b0d6b5cea1409398a62d0b40c"),
        17,
        Some(&[
            0, 53, 19, 271, 53, 20, 128803, 13213, 128804, 128822, 13213, 3287, 1, 128803, 10930,
            128804, 128821,
        ]),
    );
    let r = ChatRequest::from_openai_json(
        r#"{"model":"deepseek-chat","messages":[{"role":"user","content":"first"},{"role":"assistant","content":"first answer","reasoning_content":"old hidden reasoning"},{"role":"user","content":[{"type":"text","text":"sec"},{"type":"text","text":"ond"}]}]}"#,
        CTX,
    )
    .unwrap();
    assert_eq!(r.mode, ThinkingMode::NoThink);
    check(
        "ex2-nothink",
        &r.render(),
        153,
        Some("39be2eb95197aa7feddc2838f820183aa6ad103a"),
        12,
        Some(&[
            0, 128803, 13213, 128804, 128822, 13213, 3287, 1, 128803, 10930, 128804, 128822,
        ]),
    );
}

#[test]
fn ex3_tools_canonical_dsml_tool_result() {
    let body = concat!(
        r#"{"model":"deepseek-v4-flash","messages":[{"role":"system","content":"Be careful."},{"role":"user","content":"List /tmp"},{"role":"assistant","content":"","reasoning_content":"I should run ls.","tool_calls":[{"id":"call_abc","type":"function","function":{"name":"bash","arguments":"{\"command\":\"ls /tmp\",\"timeout\":10}"}}]},{"role":"tool","tool_call_id":"call_abc","content":"a.txt\nb.txt"}],"#,
        "\n",
        r#""tools":[{"type":"function","function":{"name":"bash","description":"Run a shell command","parameters":{"type":"object","properties":{"command":{"type":"string"},"timeout":{"type":"integer"}},"required":["command"]}}}]}"#
    );
    let r = ChatRequest::from_openai_json(body, CTX).unwrap();
    assert!(r.has_tools());
    let s = r.render();
    let tail = "<｜User｜>List /tmp<｜Assistant｜><think>I should run ls.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"bash\">\n<｜DSML｜parameter name=\"command\" string=\"true\">ls /tmp</｜DSML｜parameter>\n<｜DSML｜parameter name=\"timeout\" string=\"false\">10</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>a.txt\nb.txt</tool_result><｜Assistant｜><think>";
    assert!(
        s.starts_with(&format!(
            "<｜begin▁of▁sentence｜>{TOOLS_HEAD}{{\"name\":\"bash\""
        )),
        "{s}"
    );
    assert!(
        s.ends_with(&format!("{TOOLS_TAIL}\n\nBe careful.{tail}")),
        "{s}"
    );
    check(
        "ex3",
        &s,
        1973,
        Some("c37d415011af0ba2ed2d37c91d84ca0bb870199f"),
        429,
        None,
    );
}

#[test]
fn ex4_think_max() {
    let body = r#"{"model":"deepseek-v4-flash","reasoning_effort":"max","messages":[{"role":"user","content":"Prove it."}]}"#;
    let r = ChatRequest::from_openai_json(body, 393_216).unwrap();
    assert_eq!(r.mode, ThinkingMode::ThinkMax);
    check(
        "ex4",
        &r.render(),
        550,
        Some("bd1aed4fba6129dbb841b5a09ecd446d9b5f33d6"),
        87,
        None,
    );
    let small = ChatRequest::from_openai_json(body, 393_215).unwrap();
    assert_eq!(
        small.render(),
        "<｜begin▁of▁sentence｜><｜User｜>Prove it.<｜Assistant｜><think>"
    );
}

#[test]
fn ex5_nothink_tool_choice_none_two_calls_two_results() {
    let r = ChatRequest::from_openai_json(
        r#"{"think":false,"tool_choice":"none","tools":[{"type":"function","function":{"name":"f","parameters":{}}}],"messages":[{"role":"user","content":"Q"},{"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}},{"id":"c2","type":"function","function":{"name":"g","arguments":"not json"}}]},{"role":"tool","tool_call_id":"c1","content":"r1"},{"role":"tool","tool_call_id":"c2","content":"r2"},{"role":"user","content":"thanks"}]}"#,
        CTX,
    )
    .unwrap();
    let s = r.render();
    let expected = "<｜begin▁of▁sentence｜><｜User｜>Q<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"false\">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"g\">\n<｜DSML｜parameter name=\"arguments\" string=\"true\">not json</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>r1</tool_result><tool_result>r2</tool_result><｜User｜>thanks<｜Assistant｜></think>";
    assert_eq!(s, expected);
    check(
        "ex5",
        &s,
        503,
        Some("2b50a9ea2f238d7900309e488d99541f28cf044c"),
        102,
        None,
    );
}

#[test]
fn ex6_anthropic_shape() {
    // Messages as the Anthropic normalization produces them (docs/chat.md §2.6): private system part
    // skipped, thinking → reasoning, tool_use → call with the raw input JSON, tool_result
    // appended to a user message's content.
    let schemas = render::tool_schema_lines(r#"{"name":"Read","description":"Read a file","input_schema":{"type":"object","properties":{"path":{"type":"string"}}}}"#).unwrap();
    let mut assistant = Message::assistant("", "Need to read.");
    assistant.tool_calls = vec![ToolCall {
        id: "toolu_1".into(),
        name: "Read".into(),
        arguments: r#"{"path":"a.txt"}"#.into(),
    }];
    let result = format!(
        "<tool_result>{}</tool_result>",
        render::escape_tool_result("hello <b> & </tool_result> end")
    );
    let msgs = vec![
        Message::system("You are Claude Code."),
        Message::user("Open a.txt"),
        assistant,
        Message::user(&result),
    ];
    let s = render::render_prompt(&msgs, &schemas, ThinkingMode::Think);
    assert!(s.ends_with("<｜User｜><tool_result>hello <b> & &lt;/tool_result> end</tool_result><｜Assistant｜><think>"), "{s}");
    check(
        "ex6",
        &s,
        1860,
        Some("b51e7df5fde17c67da192cbfc5639df18c65cd41"),
        406,
        None,
    );
}

#[test]
fn responses_shape_and_completions() {
    let schemas = render::tool_schema_lines(r#"{"type":"function","name":"shell","description":"Run","parameters":{"type":"object","properties":{"cmd":{"type":"array"}}}}"#).unwrap();
    let mut assistant = Message::assistant("", "Use shell.");
    assistant.tool_calls = vec![ToolCall {
        id: "call_9".into(),
        name: "shell".into(),
        arguments: r#"{"cmd":["pwd"]}"#.into(),
    }];
    let msgs = vec![
        Message::system("You are Codex."),
        Message::user("run pwd"),
        assistant,
        Message::tool("call_9", "/home"),
    ];
    let s = render::render_prompt(&msgs, &schemas, ThinkingMode::Think);
    check(
        "responses",
        &s,
        1830,
        Some("889d1c3a4d137089711e9a18573a504b9b9a5494"),
        396,
        None,
    );

    let c = render::render_completion("Once upon a time", ThinkingMode::Think);
    check(
        "completions",
        &c,
        108,
        None,
        13,
        Some(&[
            0, 3476, 477, 260, 11502, 22896, 128803, 16600, 4465, 260, 1014, 128804, 128821,
        ]),
    );
}

#[test]
fn dsml_tag_tokens_in_context() {
    // docs/chat.md §1.
    let tok = common::tokenizer();
    let cases: [(&str, &[u32]); 8] = [
        (
            "\n\n<｜DSML｜tool_calls>\n",
            &[271, 30, 128825, 72461, 4941, 12548, 1018],
        ),
        (
            "<｜DSML｜invoke name=\"bash\">\n",
            &[30, 128825, 40148, 5406, 2329, 1281, 61159, 3816],
        ),
        (
            "<｜DSML｜parameter name=\"command\" string=\"true\">",
            &[
                30, 128825, 41523, 2329, 1281, 28381, 4, 3418, 1281, 11476, 3320,
            ],
        ),
        ("</｜DSML｜parameter>\n", &[1718, 128825, 41523, 1018]),
        ("</｜DSML｜invoke>\n", &[1718, 128825, 40148, 5406, 1018]),
        (
            "</｜DSML｜tool_calls>",
            &[1718, 128825, 72461, 4941, 12548, 32],
        ),
        ("<tool_result>", &[30, 72461, 46148, 32]),
        ("</tool_result>", &[1718, 72461, 46148, 32]),
    ];
    for (text, ids) in cases {
        assert_eq!(tok.encode_chat(text).unwrap(), ids, "{text:?}");
    }
    // Plain mode: special strings are text.
    let plain = tok.encode("</think>", false).unwrap();
    assert_eq!(tok.decode(&plain).unwrap(), b"</think>");
    assert!(plain.len() > 1 && !plain.contains(&128822), "{plain:?}");
    // Markers mode leaves other added tokens as text, All mode matches them.
    assert!(tok.encode_chat("<｜tool▁sep｜>").unwrap().len() > 1);
    assert_eq!(tok.encode("<｜tool▁sep｜>", true).unwrap(), vec![128814]);
}
