//! Streaming output parser: ds4's emission rules, tool-call streaming, stop conditions, and
//! chunking independence (every split point, random chunkings, garbage input).

use ds4_chat::stream::{
    coalesce, DsmlState, EndCause, FinalOutput, FinishReason, Halt, OutputStream, StreamEvent,
    StreamOptions,
};
use proptest::prelude::*;

fn opts(thinking: bool, tools: bool, stop: &[&str]) -> StreamOptions {
    StreamOptions {
        thinking,
        tools,
        stop: stop.iter().map(|s| s.to_string()).collect(),
    }
}

/// Feeds `chunks` and returns (all events incl. the final flush, final output).
fn run(o: &StreamOptions, chunks: &[&str], cause: EndCause) -> (Vec<StreamEvent>, FinalOutput) {
    let mut s = OutputStream::new(o.clone());
    let mut ev = Vec::new();
    for c in chunks {
        ev.extend(s.push(c));
    }
    let (tail, fin) = s.finish(cause);
    ev.extend(tail);
    (ev, fin)
}

fn chars(text: &str) -> Vec<&str> {
    text.char_indices()
        .map(|(i, c)| &text[i..i + c.len_utf8()])
        .collect()
}

/// Reference = one char at a time; every 2-way split must coalesce to the same events.
fn assert_split_invariant(
    o: &StreamOptions,
    text: &str,
    cause: EndCause,
) -> (Vec<StreamEvent>, FinalOutput) {
    let (ref_ev, ref_fin) = run(o, &chars(text), cause.clone());
    let ref_ev = coalesce(&ref_ev);
    let (whole_ev, whole_fin) = run(o, &[text], cause.clone());
    assert_eq!(
        coalesce(&whole_ev),
        ref_ev,
        "one chunk vs char-by-char: {text:?}"
    );
    assert_eq!(whole_fin, ref_fin);
    for (i, _) in text.char_indices().skip(1) {
        let (ev, fin) = run(o, &[&text[..i], &text[i..]], cause.clone());
        assert_eq!(coalesce(&ev), ref_ev, "split at byte {i} of {text:?}");
        assert_eq!(fin, ref_fin, "split at byte {i}");
    }
    (ref_ev, ref_fin)
}

const TOOL_TEXT: &str = "Run ls.</think>Sure.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"bash\">\n<｜DSML｜parameter name=\"command\" string=\"true\">ls &amp; \"x\"</｜DSML｜parameter>\n<｜DSML｜parameter name=\"timeout\" string=\"false\">{ \"s\": 10 }</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";

#[test]
fn spec_openai_stream_example() {
    // docs/server.md §7.2: reasoning, content, one tool call, fragments.
    let o = opts(true, true, &[]);
    let (ev, fin) = assert_split_invariant(&o, TOOL_TEXT, EndCause::Eos);
    assert_eq!(
        ev,
        vec![
            StreamEvent::Reasoning("Run ls.".into()),
            StreamEvent::Content("Sure.".into()),
            StreamEvent::ToolCallStart {
                index: 0,
                name: "bash".into()
            },
            StreamEvent::ToolCallArguments {
                index: 0,
                fragment: r#"{"command":"ls & \"x\"","timeout":{ "s": 10 }}"#.into()
            },
            StreamEvent::ToolCallEnd { index: 0 },
        ]
    );
    // Token-like chunking reproduces the spec's fragment boundaries.
    let toks = [
        "Run ls.",
        "</think>",
        "Sure",
        ".",
        "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"bash\">\n",
        "<｜DSML｜parameter name=\"command\" string=\"true\">",
        "ls",
        " ",
        "&amp;",
        " \"",
        "x",
        "\"",
        "</｜DSML｜parameter>\n<｜DSML｜parameter name=\"timeout\" string=\"false\">",
        "{",
        " \"",
        "s",
        "\":",
        " ",
        "10",
        " }",
        "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
    ];
    assert_eq!(toks.concat(), TOOL_TEXT);
    let (ev, _) = run(&o, &toks, EndCause::Eos);
    let frags: Vec<&str> = ev
        .iter()
        .filter_map(|e| match e {
            StreamEvent::ToolCallArguments { fragment, .. } => Some(fragment.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        frags,
        [
            "{",
            "\"command\":\"",
            "ls",
            " ",
            "&",
            " \\\"",
            "x",
            "\\\"",
            "\"",
            ",\"timeout\":",
            "{",
            " \"",
            "s",
            "\":",
            " ",
            "10",
            " }",
            "}"
        ]
    );
    let contents: Vec<&StreamEvent> = ev
        .iter()
        .filter(|e| matches!(e, StreamEvent::Content(_)))
        .collect();
    assert_eq!(
        contents,
        [
            &StreamEvent::Content("Sure".into()),
            &StreamEvent::Content(".".into())
        ]
    );
    // Final message: compact arguments, raw block for replay, tool_calls finish.
    assert_eq!(fin.finish, FinishReason::ToolCalls);
    assert_eq!(fin.message.reasoning.as_deref(), Some("Run ls."));
    assert_eq!(fin.message.content, "Sure.");
    assert_eq!(
        fin.message.tool_calls[0].arguments_compact(),
        r#"{"command":"ls & \"x\"","timeout":{"s":10}}"#
    );
    assert!(fin
        .message
        .raw_dsml
        .as_deref()
        .unwrap()
        .starts_with("\n\n<｜DSML｜tool_calls>"));
}

#[test]
fn tool_end_halts_and_cuts() {
    let o = opts(true, true, &[]);
    let mut s = OutputStream::new(o);
    s.push("r</think>ok<｜DSML｜tool_calls><｜DSML｜invoke name=\"f\"></｜DSML｜invoke>");
    assert_eq!(s.halted(), None);
    assert!(s.saw_tool_start());
    s.push("</｜DSML｜tool_calls>TRAILING");
    assert_eq!(s.halted(), Some(Halt::ToolCalls));
    assert!(s.push("more").is_empty());
    let (_, fin) = s.finish(EndCause::Eos);
    assert!(fin.text.ends_with("</｜DSML｜tool_calls>"), "{}", fin.text);
    assert_eq!(fin.finish, FinishReason::ToolCalls);
    assert_eq!(fin.message.tool_calls.len(), 1);
}

#[test]
fn dsml_inside_reasoning_is_reasoning() {
    let o = opts(true, true, &[]);
    let text = "think <｜DSML｜tool_calls><｜DSML｜invoke name=\"f\"></｜DSML｜invoke></｜DSML｜tool_calls> more</think>answer";
    let (ev, fin) = assert_split_invariant(&o, text, EndCause::Eos);
    assert_eq!(
        ev[0],
        StreamEvent::Reasoning(text[..text.find("</think>").unwrap()].into())
    );
    assert_eq!(ev[1], StreamEvent::Content("answer".into()));
    assert_eq!(fin.finish, FinishReason::Stop);
    assert!(fin.message.tool_calls.is_empty());
}

#[test]
fn reasoning_holds_partial_close_and_open_prefix() {
    let o = opts(true, false, &[]);
    let mut s = OutputStream::new(o);
    assert!(s.push("<thi").is_empty());
    // "<think>abc</th": the last 7 bytes are held, so nothing of "abc" is certain yet.
    assert!(s.push("nk>abc</th").is_empty());
    assert_eq!(
        s.push("ink>x"),
        vec![
            StreamEvent::Reasoning("abc".into()),
            StreamEvent::Content("x".into())
        ]
    );
    let (tail, fin) = s.finish(EndCause::Eos);
    assert!(tail.is_empty());
    assert_eq!(fin.message.reasoning.as_deref(), Some("abc"));
    // Never a partial "</think>" in reasoning.
    let mut s = OutputStream::new(opts(true, false, &[]));
    for e in s.push("abc</thi") {
        assert!(
            !matches!(&e, StreamEvent::Reasoning(r) if r.contains('<')),
            "{e:?}"
        );
    }
}

#[test]
fn length_truncated_reasoning_is_content_in_final_message() {
    // ds4 quirk (docs/chat.md §3.1): no </think> => reasoning none, content = whole text.
    let (ev, fin) =
        assert_split_invariant(&opts(true, false, &[]), "still thinking", EndCause::Length);
    assert_eq!(ev, vec![StreamEvent::Reasoning("still thinking".into())]);
    assert_eq!(fin.finish, FinishReason::Length);
    assert_eq!(fin.message.reasoning, None);
    assert_eq!(fin.message.content, "still thinking");
}

#[test]
fn stop_sequences_cut_and_hold() {
    let o = opts(false, false, &["STOP", "END!"]);
    let mut s = OutputStream::new(o.clone());
    let ev = s.push("hello ST");
    // Holds max_len - 1 = 3 bytes.
    assert_eq!(ev, vec![StreamEvent::Content("hello".into())]);
    let ev = s.push("OP tail");
    assert_eq!(s.halted(), Some(Halt::StopSequence));
    assert_eq!(ev, vec![StreamEvent::Content(" ".into())]);
    let (tail, fin) = s.finish(EndCause::Eos);
    assert!(tail.is_empty(), "{tail:?}");
    assert_eq!(fin.text, "hello ");
    assert_eq!(fin.finish, FinishReason::Stop);
    let (ev, fin) = assert_split_invariant(&o, "a STOP b", EndCause::Length);
    assert_eq!(ev, vec![StreamEvent::Content("a ".into())]);
    assert_eq!(fin.finish, FinishReason::Stop);
    // Not hit: everything flushed at the end.
    let (ev, fin) = assert_split_invariant(&o, "no sto", EndCause::Length);
    assert_eq!(ev, vec![StreamEvent::Content("no sto".into())]);
    assert_eq!(fin.finish, FinishReason::Length);
}

#[test]
fn text_phase_holds_whitespace_and_partial_marker() {
    let o = opts(false, true, &[]);
    let mut s = OutputStream::new(o.clone());
    assert_eq!(
        s.push("Hello  \n"),
        vec![StreamEvent::Content("Hello".into())]
    );
    assert!(s.push("\n<｜DS").is_empty());
    assert!(s.push("ML｜tool").is_empty());
    // Whitespace before the block is never streamed as content.
    let (ev, fin) = run(
        &o,
        &[
            "Hello  \n",
            "\n<｜DS",
            "ML｜tool_calls><｜DSML｜invoke name=\"a\"></｜DSML｜invoke></｜DSML｜tool_calls>",
        ],
        EndCause::Eos,
    );
    assert_eq!(coalesce(&ev)[0], StreamEvent::Content("Hello".into()));
    assert_eq!(fin.message.content, "Hello");
    // A '<' that is not a marker is released once it is 80 bytes back, or at the end.
    let text = format!("a < b{}", "x".repeat(100));
    let (ev, _) = assert_split_invariant(&o, &text, EndCause::Eos);
    assert_eq!(ev, vec![StreamEvent::Content(text.clone())]);
}

#[test]
fn unterminated_tool_call_is_an_error() {
    let o = opts(false, true, &[]);
    let text = "x<｜DSML｜tool_calls><｜DSML｜invoke name=\"f\"><｜DSML｜parameter name=\"p\" string=\"true\">v";
    let (ev, fin) = assert_split_invariant(&o, text, EndCause::Length);
    assert_eq!(fin.finish, FinishReason::Error);
    assert_eq!(fin.error.as_deref(), Some("unterminated tool call"));
    assert!(fin.message.tool_calls.is_empty());
    assert!(ev.contains(&StreamEvent::ToolCallStart {
        index: 0,
        name: "f".into()
    }));
}

#[test]
fn malformed_dsml_becomes_text() {
    let o = opts(false, true, &[]);
    let text = "see:\n\n<｜DSML｜tool_calls>garbage</｜DSML｜tool_calls>";
    let (ev, fin) = assert_split_invariant(&o, text, EndCause::Eos);
    assert_eq!(fin.finish, FinishReason::Stop);
    assert_eq!(fin.error.as_deref(), Some("invalid tool call"));
    assert!(fin.tool_parse_failed);
    assert_eq!(fin.message.content, text);
    // The held block is released as content, so the client saw the whole text.
    assert_eq!(ev, vec![StreamEvent::Content(text.into())]);
}

#[test]
fn without_tools_dsml_streams_as_content_but_parses_at_the_end() {
    let o = opts(false, false, &[]);
    let text = "a\n\n<tool_calls><invoke name=\"g\"><parameter name=\"k\" string=\"false\">[1, 2]</parameter></invoke></tool_calls>";
    let (ev, fin) = assert_split_invariant(&o, text, EndCause::Eos);
    assert_eq!(ev[0], StreamEvent::Content(text.into()));
    assert_eq!(fin.finish, FinishReason::ToolCalls);
    assert_eq!(fin.message.tool_calls[0].arguments, r#"{"k": [1,2]}"#);
    // Calls not streamed live are announced at the end with their compact arguments.
    assert_eq!(
        ev[1],
        StreamEvent::ToolCallStart {
            index: 0,
            name: "g".into()
        }
    );
    assert_eq!(
        ev[2],
        StreamEvent::ToolCallArguments {
            index: 0,
            fragment: r#"{"k":[1,2]}"#.into()
        }
    );
}

#[test]
fn two_calls_and_short_family() {
    let o = opts(false, true, &[]);
    let text = "<DSML｜tool_calls>\n<DSML｜invoke name=\"a\">\n<DSML｜parameter name=\"x\" string=\"true\">1&lt;2 &quot;q&quot;</DSML｜parameter>\n</DSML｜invoke>\n<DSML｜invoke name=\"b\">\n</DSML｜invoke>\n</DSML｜tool_calls>";
    let (ev, fin) = assert_split_invariant(&o, text, EndCause::Eos);
    assert_eq!(
        ev,
        vec![
            StreamEvent::ToolCallStart {
                index: 0,
                name: "a".into()
            },
            StreamEvent::ToolCallArguments {
                index: 0,
                fragment: r#"{"x":"1<2 \"q\""}"#.into()
            },
            StreamEvent::ToolCallEnd { index: 0 },
            StreamEvent::ToolCallStart {
                index: 1,
                name: "b".into()
            },
            StreamEvent::ToolCallArguments {
                index: 1,
                fragment: "{}".into()
            },
            StreamEvent::ToolCallEnd { index: 1 },
        ]
    );
    assert_eq!(fin.message.tool_calls.len(), 2);
    assert_eq!(
        fin.message.tool_calls[0].arguments_compact(),
        r#"{"x":"1<2 \"q\""}"#
    );
}

#[test]
fn dsml_state_for_sampler() {
    let mut s = OutputStream::new(opts(false, true, &[]));
    assert_eq!(s.dsml_state(), DsmlState::Outside);
    s.push("<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">");
    assert_eq!(s.dsml_state(), DsmlState::Structural);
    s.push("<｜DSML｜parameter name=\"a\" string=\"true\">hel");
    assert_eq!(s.dsml_state(), DsmlState::StringBody);
    assert!(s.dsml_state().uses_payload_sampling());
    s.push("lo</");
    assert_eq!(s.dsml_state(), DsmlState::Structural);
    s.push("｜DSML｜parameter><｜DSML｜parameter name=\"b\" string=\"false\">{\"k\": \"v");
    assert_eq!(s.dsml_state(), DsmlState::JsonString);
    s.push("\"");
    assert_eq!(s.dsml_state(), DsmlState::JsonStructural);
    s.push("}</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>");
    assert_eq!(s.dsml_state(), DsmlState::Outside);
    assert_eq!(s.halted(), Some(Halt::ToolCalls));
    // Without tools the sampler is never told it is inside DSML.
    let mut s = OutputStream::new(opts(false, false, &[]));
    s.push("<｜DSML｜tool_calls>");
    assert_eq!(s.dsml_state(), DsmlState::Outside);
}

fn random_chunks(text: &str, cuts: &[usize]) -> Vec<String> {
    let mut bounds: Vec<usize> = cuts
        .iter()
        .map(|&c| {
            let mut i = c % (text.len() + 1);
            while !text.is_char_boundary(i) {
                i -= 1;
            }
            i
        })
        .collect();
    bounds.push(0);
    bounds.push(text.len());
    bounds.sort_unstable();
    bounds.dedup();
    bounds
        .windows(2)
        .map(|w| text[w[0]..w[1]].to_string())
        .collect()
}

fn check_chunking(o: &StreamOptions, text: &str, cuts: &[usize], cause: EndCause) {
    let (ref_ev, ref_fin) = run(o, &chars(text), cause.clone());
    let chunks = random_chunks(text, cuts);
    let refs: Vec<&str> = chunks.iter().map(String::as_str).collect();
    let (ev, fin) = run(o, &refs, cause);
    assert_eq!(coalesce(&ev), coalesce(&ref_ev), "chunks {chunks:?}");
    assert_eq!(fin, ref_fin, "chunks {chunks:?}");
}

const PIECES: &[&str] = &[
    "<｜DSML｜tool_calls>",
    "</｜DSML｜tool_calls>",
    "<｜DSML｜invoke name=\"f\">",
    "</｜DSML｜invoke>",
    "<｜DSML｜parameter name=\"p\" string=\"true\">",
    "<｜DSML｜parameter name=\"q\" string=\"false\">",
    "<｜DSML｜parameter name=\"n\">",
    "</｜DSML｜parameter>",
    "<DSML｜tool_calls>",
    "<tool_calls>",
    "</tool_calls>",
    "<invoke name=\"g\">",
    "</invoke>",
    "<parameter name=\"r\" string=\"true\">",
    "</parameter>",
    "<think>",
    "</think>",
    "\n\n",
    " ",
    "\n",
    "&amp;",
    "&lt;",
    "&",
    "&q",
    "\"",
    "{",
    "}",
    "[1, 2]",
    "\\",
    "<",
    ">",
    "</",
    "｜",
    "DSML",
    "é",
    "日本",
    "😀",
    "text",
    "STOP",
    "ST",
    "OP",
    "x",
    "=",
    "name=\"",
    "string=\"true\"",
];

fn text_strategy() -> impl Strategy<Value = String> {
    prop::collection::vec(0..PIECES.len(), 0..40)
        .prop_map(|ix| ix.into_iter().map(|i| PIECES[i]).collect())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, .. ProptestConfig::default() })]

    #[test]
    fn any_chunking_same_events_and_message(
        text in text_strategy(),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
        thinking in any::<bool>(),
        tools in any::<bool>(),
        with_stop in any::<bool>(),
        length in any::<bool>(),
    ) {
        let o = opts(thinking, tools, if with_stop { &["STOP", "</invoke>"] } else { &[] });
        let cause = if length { EndCause::Length } else { EndCause::Eos };
        check_chunking(&o, &text, &cuts, cause);
    }

    #[test]
    fn well_formed_calls_survive_any_chunking(
        value in "[a-z &<>\"{}é]{0,20}",
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let escaped = value.replace('&', "&amp;").replace('<', "&lt;");
        let text = format!("pre\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"t\">\n<｜DSML｜parameter name=\"v\" string=\"true\">{escaped}</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>");
        let o = opts(false, true, &[]);
        check_chunking(&o, &text, &cuts, EndCause::Eos);
        let (ev, fin) = run(&o, &[&text], EndCause::Eos);
        prop_assert_eq!(fin.finish, FinishReason::ToolCalls);
        let mut expected_args = String::from("{\"v\":");
        expected_args.push_str(&ds4_chat::json::escape(&value));
        expected_args.push('}');
        prop_assert_eq!(fin.message.tool_calls[0].arguments_compact(), expected_args.clone());
        // Streamed arguments equal the final ones for string values.
        let streamed: String = ev.iter().filter_map(|e| match e { StreamEvent::ToolCallArguments { fragment, .. } => Some(fragment.as_str()), _ => None }).collect();
        prop_assert_eq!(streamed, expected_args);
    }

    #[test]
    fn arbitrary_text_never_panics(text in "\\PC{0,200}", cuts in prop::collection::vec(any::<usize>(), 0..8), tools in any::<bool>(), thinking in any::<bool>()) {
        let o = opts(thinking, tools, &["\n\n\n"]);
        check_chunking(&o, &text, &cuts, EndCause::Eos);
    }
}
