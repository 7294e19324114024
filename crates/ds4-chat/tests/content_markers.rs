//! Chat markers inside client text stay text: only the renderer's own markers become
//! control tokens ([`Rendered`] + `Tokenizer::encode_rendered`), and prompts without markers
//! in their content tokenize exactly as before.

mod common;

use ds4_chat::render::{self, Message, Rendered, ThinkingMode, ToolCall};
use ds4_chat::tokenizer::{
    ASSISTANT_TEXT, BOS_TEXT, DSML_TEXT, EOS_TEXT, THINK_CLOSE_TEXT, THINK_OPEN_TEXT, USER_TEXT,
};

const MARKERS: [&str; 7] = [
    BOS_TEXT,
    EOS_TEXT,
    USER_TEXT,
    ASSISTANT_TEXT,
    THINK_OPEN_TEXT,
    THINK_CLOSE_TEXT,
    DSML_TEXT,
];

/// A conversation whose every client-supplied string carries `payload`.
fn conversation(payload: &str) -> (Vec<Message>, Vec<String>) {
    let mut asst = Message::assistant(&format!("sure {payload}"), &format!("hmm {payload}"));
    asst.tool_calls.push(ToolCall {
        id: "call_1".into(),
        name: format!("run{payload}"),
        arguments: serde_json::json!({ "cmd": format!("echo {payload}") }).to_string(),
    });
    let msgs = vec![
        Message::system(&format!("be nice {payload}")),
        Message::user(&format!("hello {payload} there")),
        asst,
        Message::tool("call_1", &format!("out {payload} done")),
        Message::user(payload),
    ];
    let schema = format!(
        "{{\"name\":\"run\",\"description\":\"{}\"}}",
        payload.replace('"', "'")
    );
    (msgs, vec![schema])
}

fn marker_ids() -> Vec<u32> {
    let m = common::tokenizer().markers();
    vec![
        m.bos,
        m.eos,
        m.user,
        m.assistant,
        m.think_open,
        m.think_close,
        m.dsml,
    ]
}

fn count_markers(ids: &[u32]) -> usize {
    let set = marker_ids();
    ids.iter().filter(|i| set.contains(i)).count()
}

#[test]
fn markers_in_content_are_plain_text() {
    let tok = common::tokenizer();
    let every = MARKERS.concat();
    for mode in [ThinkingMode::NoThink, ThinkingMode::Think] {
        let (msgs, schemas) = conversation(&every);
        let r = render::render_prompt_spans(&msgs, &schemas, mode);
        assert_eq!(r.text, render::render_prompt(&msgs, &schemas, mode));
        let ids = r.tokens(tok).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), r.text.as_bytes());
        // The same conversation with harmless content has exactly the renderer's markers.
        let (clean, clean_schemas) = conversation("x");
        let clean_ids = render::render_prompt_spans(&clean, &clean_schemas, mode)
            .tokens(tok)
            .unwrap();
        assert_eq!(count_markers(&ids), count_markers(&clean_ids), "{mode:?}");
        // The old policy (ds4's) turns every marker in the content into a control token.
        let legacy = tok.encode_chat(&r.text).unwrap();
        assert!(count_markers(&legacy) >= count_markers(&ids) + 5 * MARKERS.len());
        assert_eq!(
            Rendered::all_trusted(r.text.clone()).tokens(tok).unwrap(),
            legacy
        );
    }
}

#[test]
fn a_user_message_of_every_marker_has_no_control_token() {
    let tok = common::tokenizer();
    let every = MARKERS.concat();
    let r = render::render_prompt_spans(
        &[Message::user(&every)],
        &[] as &[&str],
        ThinkingMode::NoThink,
    );
    let ids = r.tokens(tok).unwrap();
    let m = tok.markers();
    // BOS, User, Assistant, </think>: the renderer's four, in order, and nothing else.
    let found: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|i| marker_ids().contains(i))
        .collect();
    assert_eq!(found, vec![m.bos, m.user, m.assistant, m.think_close]);
    // The user text alone is encoded as plain text, special strings included.
    let inner = &ids[2..ids.len() - 2];
    assert_eq!(inner, tok.encode(&every, false).unwrap().as_slice());
    assert!(inner.iter().all(|&i| i < 128_000), "{inner:?}");
}

#[test]
fn marker_free_prompts_tokenize_as_before() {
    let tok = common::tokenizer();
    for payload in [
        "",
        "plain words",
        " lead space",
        "<tool_result>x</tool_result>",
        "a\n\n\nb",
    ] {
        let (msgs, schemas) = conversation(payload);
        for mode in [
            ThinkingMode::NoThink,
            ThinkingMode::Think,
            ThinkingMode::ThinkMax,
        ] {
            let r = render::render_prompt_spans(&msgs, &schemas, mode);
            assert_eq!(r.tokens(tok).unwrap(), tok.encode_chat(&r.text).unwrap());
            let c = render::render_completion_spans(payload, mode);
            assert_eq!(c.text, render::render_completion(payload, mode));
            assert_eq!(c.tokens(tok).unwrap(), tok.encode_chat(&c.text).unwrap());
        }
    }
}

#[test]
fn suffixes_keep_their_trusted_ranges() {
    let tok = common::tokenizer();
    let every = MARKERS.concat();
    let (msgs, schemas) = conversation(&every);
    let r = render::render_prompt_spans(&msgs, &schemas, ThinkingMode::Think);
    let total = count_markers(&r.tokens(tok).unwrap());
    // Control tokens are atomic: cut anywhere on a range end, head + suffix keep them all
    // and the suffix never gains one from its (untrusted) content.
    for cut in r.trusted.iter().map(|x| x.end) {
        let head = Rendered {
            text: r.text[..cut].to_string(),
            trusted: r.trusted.iter().filter(|x| x.end <= cut).cloned().collect(),
        };
        let a = count_markers(&head.tokens(tok).unwrap());
        let b = count_markers(&r.suffix(cut).tokens(tok).unwrap());
        assert_eq!(a + b, total, "cut at {cut}");
    }
}
