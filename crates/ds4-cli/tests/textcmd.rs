//! `ds4 tokenize`, `ds4 detokenize` and `ds4 render` end to end, on the vocabulary-only GGUF
//! fixture. Expected values are independent of the code under test: ids from Python HF
//! `tokenizers` (tests/corpus/expected) and from docs/chat.md, byte lengths and SHA1s of the
//! fully rendered examples (docs/chat.md §2.9); plus agreement with the `ds4_chat` library.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

const VOCAB: &str = "tests/fixtures/vocab/deepseek-v4-vocab.gguf";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn ds4_stdin(args: &[&str], stdin: &[u8]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ds4"))
        .args(args)
        .current_dir(root())
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running ds4");
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    child.wait_with_output().unwrap()
}

fn ds4(args: &[&str]) -> Output {
    ds4_stdin(args, b"")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Asserts success and returns stdout.
fn ok(o: Output) -> Vec<u8> {
    assert_eq!(
        o.status.code(),
        Some(0),
        "stderr: {}\nstdout: {}",
        text(&o.stderr),
        text(&o.stdout)
    );
    o.stdout
}

/// Asserts a clean failure (exit code != 0, no panic) whose stderr contains every `needle`.
fn fails(o: Output, needles: &[&str]) {
    let err = text(&o.stderr);
    assert!(
        o.status.code().is_some_and(|c| c != 0),
        "expected a failure, got {:?}; stdout {} stderr {err}",
        o.status,
        text(&o.stdout)
    );
    assert!(!err.contains("panicked"), "panic: {err}");
    for n in needles {
        assert!(err.contains(n), "stderr lacks {n:?}: {err}");
    }
}

/// Comma-separated ids on one line, as `ds4 tokenize` prints them.
fn parse_line(out: &[u8]) -> Vec<u32> {
    let s = std::str::from_utf8(out).unwrap();
    let s = s.strip_suffix('\n').expect("one line ending in a newline");
    assert!(!s.contains('\n'), "more than one line: {s:?}");
    if s.is_empty() {
        return Vec::new();
    }
    s.split(',').map(|x| x.parse().unwrap()).collect()
}

fn tokenize(t: &str, special: &str) -> Vec<u32> {
    parse_line(&ok(ds4(&[
        "tokenize",
        "-m",
        VOCAB,
        "--special",
        special,
        "--text",
        t,
    ])))
}

fn join(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// The library tokenizer built from the same fixture, for agreement checks.
fn library() -> &'static ds4_chat::Tokenizer {
    static T: OnceLock<ds4_chat::Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let f = ds4_gguf::GgufFile::open(root().join(VOCAB)).unwrap();
        ds4_chat::Tokenizer::from_gguf_header(f.header()).unwrap()
    })
}

/// Reference ids of a corpus file from Python HF `tokenizers` (u32 LE, gzip).
fn expected_ids(name: &str, mode: &str) -> Vec<u32> {
    let dir = root().join("tests/corpus/expected");
    let mut path = dir.join(format!("{name}.{mode}.u32.gz"));
    if !path.exists() {
        // Only written where the mode's ids differ from `.all`.
        path = dir.join(format!("{name}.all.u32.gz"));
    }
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(&path).unwrap())
        .read_to_end(&mut raw)
        .unwrap();
    raw.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn corpus_file(name: &str) -> String {
    format!("tests/corpus/text/{name}.txt")
}

#[test]
fn tokenize_matches_hf_reference_on_corpus_files() {
    // gen_specials: special-token strings and near misses in every context, so the three
    // --special policies give three different id lists.
    for name in ["gen_specials", "hand_it", "hand_zh", "hand_code"] {
        for (special, mode) in [("all", "all"), ("none", "plain"), ("chat", "markers")] {
            let got = parse_line(&ok(ds4(&[
                "tokenize",
                "-m",
                VOCAB,
                "--file",
                &corpus_file(name),
                "--special",
                special,
            ])));
            assert!(
                got == expected_ids(name, mode),
                "{name} --special {special}: ids differ from the HF reference"
            );
        }
    }
    // The default policy is "all" (HF `encode`).
    let got = parse_line(&ok(ds4(&[
        "tokenize",
        "-m",
        VOCAB,
        "--file",
        &corpus_file("gen_specials"),
    ])));
    assert!(got == expected_ids("gen_specials", "all"));
}

#[test]
fn tokenize_known_ids_and_special_tokens() {
    // docs/chat.md §5: body tokens of two official test-vector prompts.
    let it = "Rispondi in italiano con una frase: chi era Ada Lovelace?";
    let it_ids = [
        52, 278, 4908, 75, 295, 89034, 399, 3919, 123003, 28, 23442, 9861, 63030, 47121, 317, 805,
        33,
    ];
    for special in ["all", "chat", "none"] {
        assert_eq!(tokenize(it, special), it_ids, "--special {special}");
    }
    assert_eq!(
        tokenize(
            "Answer with only the number: 2048 divided by 128 is",
            "none"
        ),
        [7805, 418, 1353, 270, 1167, 28, 223, 11154, 26, 7203, 513, 223, 7833, 344]
    );
    // docs/chat.md §1: `<tool_result>` is plain text; `<｜tool▁sep｜>` is an added token only HF matches.
    assert_eq!(tokenize("<tool_result>", "all"), [30, 72461, 46148, 32]);
    assert_eq!(tokenize("<｜tool▁sep｜>", "all"), [128814]);
    assert!(tokenize("<｜tool▁sep｜>", "chat").len() > 1);
    assert_eq!(tokenize("</think>", "chat"), [128822]);
    let plain = tokenize("</think>", "none");
    assert!(plain.len() > 1 && !plain.contains(&128822), "{plain:?}");
    // docs/chat.md §2.9 Ex1, the rendered string tokenized with the chat markers.
    assert_eq!(
        tokenize(
            "<｜begin▁of▁sentence｜>You are terse.<｜User｜>Hi<｜Assistant｜><think>",
            "chat"
        ),
        [0, 3476, 477, 259, 10935, 16, 128803, 23166, 128804, 128821]
    );
    // Agreement with the library for a few mixed strings, every policy.
    let lib = library();
    for s in [
        "",
        " ",
        "Hello, world!\n\n\n   x",
        "<｜User｜>ciao <think>pensiero</think> 12345 ｜DSML｜ <｜fim▁hole｜>",
        "日本語のテキストと한국어 텍스트 and العربية 👨‍👩‍👧 🇮🇹",
    ] {
        for (special, mode) in [
            ("all", ds4_chat::SpecialTokens::All),
            ("chat", ds4_chat::SpecialTokens::ChatMarkers),
            ("none", ds4_chat::SpecialTokens::None),
        ] {
            assert_eq!(
                tokenize(s, special),
                lib.encode_with(s, mode).unwrap(),
                "{s:?} --special {special}"
            );
        }
    }
    // JSON output and standard input.
    let o = ok(ds4_stdin(
        &["tokenize", "-m", VOCAB, "--file", "-", "--json"],
        it.as_bytes(),
    ));
    let v: serde_json::Value = serde_json::from_slice(&o).unwrap();
    assert_eq!(v["count"], 17);
    assert_eq!(v["ids"], serde_json::json!(it_ids));
}

#[test]
fn detokenize_inverts_tokenize() {
    let multilingual = "English, italiano (perché sì), 中文文本, 日本語のかなとカナ, 한국어, \
        العربية, Ελληνικά, русский, हिन्दी, ไทย; emoji 👩🏽‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 1️⃣;\r\n\ttabs\u{3000}\u{a0}and    spaces\n\n\n\
        digits 1234567 ١٢٣ and <｜User｜> </think> ｜DSML｜ <｜tool▁sep｜>";
    for special in ["all", "chat", "none"] {
        let ids = tokenize(multilingual, special);
        let back = ok(ds4(&["detokenize", "-m", VOCAB, "--ids", &join(&ids)]));
        assert_eq!(text(&back), multilingual, "--special {special}");
    }
    // Through files: ids as tokenize prints them, and its JSON output; corpus files byte for
    // byte (whitespace runs, emoji, every script).
    let dir = tempfile::tempdir().unwrap();
    for name in [
        "gen_whitespace",
        "gen_emoji",
        "gen_other_scripts",
        "hand_ar",
    ] {
        let src = corpus_file(name);
        let original = std::fs::read(root().join(&src)).unwrap();
        for json in [false, true] {
            let mut args = vec!["tokenize", "-m", VOCAB, "--file", &src];
            if json {
                args.push("--json");
            }
            let ids_file = dir.path().join(format!("{name}-{json}.ids"));
            std::fs::write(&ids_file, ok(ds4(&args))).unwrap();
            let back = ok(ds4(&[
                "detokenize",
                "-m",
                VOCAB,
                "--file",
                ids_file.to_str().unwrap(),
            ]));
            assert!(
                back == original,
                "{name} (json {json}): not the original bytes"
            );
        }
    }
    // Other id spellings: whitespace-separated, a JSON array, standard input.
    let ids = tokenize("ciao mondo", "all");
    let spaced = ids
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(" \n");
    for input in [
        spaced,
        format!("[{}]", join(&ids)),
        format!(" [ {} ] ", join(&ids).replace(',', " , ")),
    ] {
        let back = ok(ds4_stdin(
            &["detokenize", "-m", VOCAB, "--file", "-"],
            input.as_bytes(),
        ));
        assert_eq!(text(&back), "ciao mondo", "{input:?}");
    }
    // Empty list: empty output.
    assert!(ok(ds4(&["detokenize", "-m", VOCAB, "--ids", ""])).is_empty());
}

#[test]
fn detokenize_json_and_split_utf8() {
    let crab = "🦀";
    let ids = tokenize(crab, "all");
    let lib = library();
    // The emoji is more than one token here; the first alone is a cut UTF-8 sequence.
    assert!(ids.len() > 1, "{ids:?}");
    let first = ok(ds4(&[
        "detokenize",
        "-m",
        VOCAB,
        "--ids",
        &ids[0].to_string(),
    ]));
    assert!(!first.is_empty() && crab.as_bytes().starts_with(&first));
    assert!(std::str::from_utf8(&first).is_err());
    assert_eq!(first, lib.token_bytes(ids[0]).unwrap());
    let o = ok(ds4(&[
        "detokenize",
        "-m",
        VOCAB,
        "--json",
        "--ids",
        &ids[0].to_string(),
    ]));
    let v: serde_json::Value = serde_json::from_slice(&o).unwrap();
    assert_eq!(v["valid_utf8"], false);
    assert_eq!(v["bytes"], first.len());
    let o = ok(ds4(&[
        "detokenize",
        "-m",
        VOCAB,
        "--json",
        "--ids",
        &join(&ids),
    ]));
    let v: serde_json::Value = serde_json::from_slice(&o).unwrap();
    assert_eq!(v["text"], crab);
    assert_eq!(v["valid_utf8"], true);
    assert_eq!(v["bytes"], 4);
}

fn sha1(b: &[u8]) -> String {
    sha1_smol::Sha1::from(b).digest().to_string()
}

/// Writes `files` into a temp dir and runs `ds4 render -m VOCAB` with `args`, where `{name}`
/// stands for the path of the file `name`.
fn render(files: &[(&str, &str)], args: &[&str]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let path = |n: &str| dir.path().join(n).to_str().unwrap().to_owned();
    for (n, body) in files {
        std::fs::write(path(n), body).unwrap();
    }
    let mut full = vec!["render".to_owned(), "-m".into(), VOCAB.into()];
    for a in args {
        full.push(
            match a.strip_prefix('{').and_then(|r| r.strip_suffix('}')) {
                Some(n) => path(n),
                None => (*a).to_owned(),
            },
        );
    }
    let refs: Vec<&str> = full.iter().map(String::as_str).collect();
    ds4(&refs)
}

/// Checks a render against the spec: byte length, SHA1, token count (and ids when given).
fn check_render(
    name: &str,
    files: &[(&str, &str)],
    args: &[&str],
    bytes: usize,
    sha: &str,
    tokens: usize,
    ids: Option<&[u32]>,
) {
    let out = ok(render(files, args));
    assert_eq!(
        out.len(),
        bytes,
        "{name}: byte length; rendered:\n{}",
        text(&out)
    );
    assert_eq!(sha1(&out), sha, "{name}: SHA1; rendered:\n{}", text(&out));
    let mut targs = args.to_vec();
    targs.push("--tokens");
    let got = parse_line(&ok(render(files, &targs)));
    assert_eq!(got.len(), tokens, "{name}: token count");
    if let Some(ids) = ids {
        assert_eq!(got, ids, "{name}: ids");
    }
    // JSON forms carry the same prompt and ids.
    targs.push("--json");
    let v: serde_json::Value = serde_json::from_slice(&ok(render(files, &targs))).unwrap();
    assert_eq!(v["count"], tokens);
    assert_eq!(v["ids"], serde_json::json!(got));
    let mut jargs = args.to_vec();
    jargs.push("--json");
    let v: serde_json::Value = serde_json::from_slice(&ok(render(files, &jargs))).unwrap();
    assert_eq!(v["bytes"], bytes);
    assert_eq!(v["prompt"].as_str().unwrap().as_bytes(), &out[..]);
}

// docs/chat.md §2.9 requests, verbatim.
const EX1: &str = r#"{"model":"deepseek-v4-flash","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Hi"}]}"#;
const EX2: &str = r#"{"model":"deepseek-v4-flash","messages":[{"role":"system","content":"S1"},{"role":"user","content":"first"},{"role":"assistant","content":"first answer","reasoning_content":"old hidden reasoning"},{"role":"developer","content":"S2"},{"role":"user","content":[{"type":"text","text":"sec"},{"type":"text","text":"ond"}]}]}"#;
const EX2_NOTHINK: &str = r#"{"model":"deepseek-chat","messages":[{"role":"user","content":"first"},{"role":"assistant","content":"first answer","reasoning_content":"old hidden reasoning"},{"role":"user","content":[{"type":"text","text":"sec"},{"type":"text","text":"ond"}]}]}"#;
const EX3_MESSAGES: &str = r#"[{"role":"system","content":"Be careful."},{"role":"user","content":"List /tmp"},{"role":"assistant","content":"","reasoning_content":"I should run ls.","tool_calls":[{"id":"call_abc","type":"function","function":{"name":"bash","arguments":"{\"command\":\"ls /tmp\",\"timeout\":10}"}}]},{"role":"tool","tool_call_id":"call_abc","content":"a.txt\nb.txt"}]"#;
const EX3_TOOLS: &str = r#"[{"type":"function","function":{"name":"bash","description":"Run a shell command","parameters":{"type":"object","properties":{"command":{"type":"string"},"timeout":{"type":"integer"}},"required":["command"]}}}]"#;
const EX4: &str = r#"{"model":"deepseek-v4-flash","reasoning_effort":"max","messages":[{"role":"user","content":"Prove it."}]}"#;
const EX5: &str = r#"{"think":false,"tool_choice":"none","tools":[{"type":"function","function":{"name":"f","parameters":{}}}],"messages":[{"role":"user","content":"Q"},{"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}},{"id":"c2","type":"function","function":{"name":"g","arguments":"not json"}}]},{"role":"tool","tool_call_id":"c1","content":"r1"},{"role":"tool","tool_call_id":"c2","content":"r2"},{"role":"user","content":"thanks"}]}"#;
const EX5_MESSAGES: &str = r#"[{"role":"user","content":"Q"},{"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}},{"id":"c2","type":"function","function":{"name":"g","arguments":"not json"}}]},{"role":"tool","tool_call_id":"c1","content":"r1"},{"role":"tool","tool_call_id":"c2","content":"r2"},{"role":"user","content":"thanks"}]"#;

#[test]
fn render_spec_examples_from_request_objects() {
    let ex1_ids: &[u32] = &[0, 3476, 477, 259, 10935, 16, 128803, 23166, 128804, 128821];
    check_render(
        "ex1",
        &[("m.json", EX1)],
        &["--messages", "{m.json}"],
        81,
        "11b6e82aedda08ee8214ccd7acb8bee2b49ea636",
        10,
        Some(ex1_ids),
    );
    check_render(
        "ex2",
        &[("m.json", EX2)],
        &["--messages", "{m.json}"],
        158,
        "0e5f9eaa9c15000b0d6b5cea1409398a62d0b40c",
        17,
        Some(&[
            0, 53, 19, 271, 53, 20, 128803, 13213, 128804, 128822, 13213, 3287, 1, 128803, 10930,
            128804, 128821,
        ]),
    );
    let ex2n: &[u32] = &[
        0, 128803, 13213, 128804, 128822, 13213, 3287, 1, 128803, 10930, 128804, 128822,
    ];
    check_render(
        "ex2-nothink",
        &[("m.json", EX2_NOTHINK)],
        &["--messages", "{m.json}"],
        153,
        "39be2eb95197aa7feddc2838f820183aa6ad103a",
        12,
        Some(ex2n),
    );
    // The request's own "tools", with the newline between messages and tools as in the spec.
    let ex3 = format!(
        "{{\"model\":\"deepseek-v4-flash\",\"messages\":{EX3_MESSAGES},\n\"tools\":{EX3_TOOLS}}}"
    );
    check_render(
        "ex3",
        &[("m.json", &ex3)],
        &["--messages", "{m.json}"],
        1973,
        "c37d415011af0ba2ed2d37c91d84ca0bb870199f",
        429,
        None,
    );
    // reasoning_effort max is rendered as asked (no context downgrade in `ds4 render`).
    check_render(
        "ex4",
        &[("m.json", EX4)],
        &["--messages", "{m.json}"],
        550,
        "bd1aed4fba6129dbb841b5a09ecd446d9b5f33d6",
        87,
        None,
    );
    check_render(
        "ex5",
        &[("m.json", EX5)],
        &["--messages", "{m.json}"],
        503,
        "2b50a9ea2f238d7900309e488d99541f28cf044c",
        102,
        None,
    );
    // A flag overrides the request's mode: Ex4 with --think is the plain HIGH render.
    let out = ok(render(
        &[("m.json", EX4)],
        &["--messages", "{m.json}", "--think"],
    ));
    assert_eq!(
        text(&out),
        "<｜begin▁of▁sentence｜><｜User｜>Prove it.<｜Assistant｜><think>"
    );
}

#[test]
fn render_spec_examples_from_message_arrays_and_flags() {
    check_render(
        "ex3 --tools",
        &[("m.json", EX3_MESSAGES), ("t.json", EX3_TOOLS)],
        &["--messages", "{m.json}", "--tools", "{t.json}"],
        1973,
        "c37d415011af0ba2ed2d37c91d84ca0bb870199f",
        429,
        None,
    );
    check_render(
        "ex4 --think-max",
        &[("m.json", r#"[{"role":"user","content":"Prove it."}]"#)],
        &["--messages", "{m.json}", "--think-max"],
        550,
        "bd1aed4fba6129dbb841b5a09ecd446d9b5f33d6",
        87,
        None,
    );
    // Ex5 without tools (its tool_choice is "none") and --nothink.
    check_render(
        "ex5 --nothink",
        &[("m.json", EX5_MESSAGES)],
        &["--messages", "{m.json}", "--nothink"],
        503,
        "2b50a9ea2f238d7900309e488d99541f28cf044c",
        102,
        None,
    );
    // Ex1 messages, default mode = thinking.
    let ex1_msgs =
        r#"[{"role":"system","content":"You are terse."},{"role":"user","content":"Hi"}]"#;
    check_render(
        "ex1 array",
        &[("m.json", ex1_msgs)],
        &["--messages", "{m.json}"],
        81,
        "11b6e82aedda08ee8214ccd7acb8bee2b49ea636",
        10,
        None,
    );
    // Ex6 (Anthropic) and the Responses example, written as the OpenAI messages they
    // normalize to (docs/chat.md §2.6): tool schemas copied raw, tool-call arguments given as objects.
    check_render(
        "ex6 as OpenAI",
        &[
            (
                "m.json",
                r#"[{"role":"system","content":"You are Claude Code."},{"role":"user","content":"Open a.txt"},{"role":"assistant","content":"","reasoning_content":"Need to read.","tool_calls":[{"id":"toolu_1","function":{"name":"Read","arguments":{"path":"a.txt"}}}]},{"role":"user","content":"<tool_result>hello <b> & &lt;/tool_result> end</tool_result>"}]"#,
            ),
            (
                "t.json",
                r#"[{"name":"Read","description":"Read a file","input_schema":{"type":"object","properties":{"path":{"type":"string"}}}}]"#,
            ),
        ],
        &["--messages", "{m.json}", "--tools", "{t.json}"],
        1860,
        "b51e7df5fde17c67da192cbfc5639df18c65cd41",
        406,
        None,
    );
    check_render(
        "responses as OpenAI",
        &[
            (
                "m.json",
                r#"[{"role":"system","content":"You are Codex."},{"role":"user","content":"run pwd"},{"role":"assistant","content":"","reasoning_content":"Use shell.","tool_calls":[{"id":"call_9","function":{"name":"shell","arguments":"{\"cmd\":[\"pwd\"]}"}}]},{"role":"tool","tool_call_id":"call_9","content":"/home"}]"#,
            ),
            (
                "t.json",
                r#"[{"type":"function","name":"shell","description":"Run","parameters":{"type":"object","properties":{"cmd":{"type":"array"}}}}]"#,
            ),
        ],
        &["--messages", "{m.json}", "--tools", "{t.json}"],
        1830,
        "889d1c3a4d137089711e9a18573a504b9b9a5494",
        396,
        None,
    );
    // Standard input.
    let o = ok(ds4_stdin(
        &["render", "-m", VOCAB, "--messages", "-", "--nothink"],
        br#"[{"role":"user","content":"Q"}]"#,
    ));
    assert_eq!(
        text(&o),
        "<｜begin▁of▁sentence｜><｜User｜>Q<｜Assistant｜></think>"
    );
}

#[test]
fn tokenize_and_detokenize_errors() {
    let dir = tempfile::tempdir().unwrap();
    let bad_utf8 = dir.path().join("bad.txt");
    std::fs::write(&bad_utf8, b"abc\xff\xfe").unwrap();
    let b = bad_utf8.to_str().unwrap();
    fails(
        ds4(&["tokenize", "-m", VOCAB, "--file", b]),
        &["not valid UTF-8", "offset 3"],
    );
    fails(
        ds4(&["tokenize", "-m", VOCAB, "--file", "/nonexistent/x.txt"]),
        &["cannot read /nonexistent/x.txt"],
    );
    fails(
        ds4(&["tokenize", "-m", "/nonexistent.gguf", "--text", "x"]),
        &["/nonexistent.gguf", "not found"],
    );
    let not_gguf = dir.path().join("not.gguf");
    std::fs::write(&not_gguf, b"this is not a gguf file at all, just some text").unwrap();
    fails(
        ds4(&["tokenize", "-m", not_gguf.to_str().unwrap(), "--text", "x"]),
        &["cannot read"],
    );
    // A valid GGUF without tokenizer arrays.
    let mut h = ds4_gguf::Header::default();
    h.set("general.name", ds4_gguf::Value::String("no vocab".into()));
    let mut img = ds4_gguf::encode_header(&h).unwrap();
    img.resize(img.len().div_ceil(32) * 32, 0);
    let no_vocab = dir.path().join("novocab.gguf");
    std::fs::write(&no_vocab, img).unwrap();
    fails(
        ds4(&["tokenize", "-m", no_vocab.to_str().unwrap(), "--text", "x"]),
        &["no usable vocabulary", "tokenizer.ggml.tokens is missing"],
    );
    // Usage errors: exactly one input.
    fails(ds4(&["tokenize", "-m", VOCAB]), &[]);
    fails(
        ds4(&["tokenize", "-m", VOCAB, "--text", "a", "--file", b]),
        &["cannot be used with"],
    );
    fails(
        ds4(&["tokenize", "-m", VOCAB, "--text", "a", "--special", "weird"]),
        &["invalid value"],
    );

    let de = |ids: &str| ds4(&["detokenize", "-m", VOCAB, "--ids", ids]);
    fails(de("1,x,3"), &["id entry 2", "\"x\"", "not a token id"]);
    fails(de("1,,3"), &["id entry 2", "empty entry"]);
    fails(de("5,-1"), &["id entry 2", "not a token id"]);
    fails(de("+7"), &["id entry 1", "not a token id"]);
    fails(de("1 2.5"), &["id entry 2", "not a token id"]);
    fails(de("1,99999999999"), &["id entry 2", "too large"]);
    fails(
        de("0,129279,129280"),
        &[
            "id entry 3",
            "129280",
            "outside the vocabulary of 129280 tokens",
        ],
    );
    fails(de("4294967295"), &["outside the vocabulary"]);
    fails(de("[1,2"), &["does not end with ']'"]);
    fails(de("{\"count\":1}"), &["no \"ids\" array"]);
    fails(de("{\"ids\":[1,-2]}"), &["ids[1]", "not a token id"]);
    fails(de("{\"ids\":[1,"), &["not valid JSON"]);
    let bad_ids = dir.path().join("bad.ids");
    std::fs::write(&bad_ids, "1,2,\n3,zz\n").unwrap();
    fails(
        ds4(&[
            "detokenize",
            "-m",
            VOCAB,
            "--file",
            bad_ids.to_str().unwrap(),
        ]),
        &["bad.ids", "id entry 4", "\"zz\""],
    );
    fails(ds4(&["detokenize", "-m", VOCAB]), &[]);
}

#[test]
fn render_errors() {
    let r = |m: &str, extra: &[&str]| {
        let mut args = vec!["--messages", "{m.json}"];
        args.extend_from_slice(extra);
        render(&[("m.json", m), ("t.json", EX3_TOOLS)], &args)
    };
    // Malformed JSON, including what ds4's lenient reader would accept (missing comma).
    fails(
        r(r#"[{"role":"user","content":"hi"}"#, &[]),
        &["messages: invalid JSON", "line 1"],
    );
    fails(
        r(r#"[{"role":"user" "content":"hi"}]"#, &[]),
        &["messages: invalid JSON"],
    );
    fails(r("", &[]), &["messages: invalid JSON"]);
    fails(
        r("\"just a string\"", &[]),
        &["expected a JSON array of messages or a chat request object"],
    );
    fails(r(r#"["hi"]"#, &[]), &["messages"]);
    fails(
        r(r#"[{"role":"critic","content":"x"}]"#, &[]),
        &["messages[0]", "unknown role \"critic\""],
    );
    fails(
        r(
            r#"{"messages":[{"role":"user","content":"a"},{"role":"robot","content":"b"}]}"#,
            &[],
        ),
        &["messages[1]", "unknown role \"robot\""],
    );
    fails(r(r#"[{"role":5,"content":"x"}]"#, &[]), &["messages"]);
    fails(r(r#"{"model":"x"}"#, &[]), &["missing messages"]);
    fails(
        r(r#"{"reasoning_effort":"huge","messages":[]}"#, &[]),
        &["invalid"],
    );
    // Tools given twice, malformed tools.
    let ex3 = format!("{{\"messages\":{EX3_MESSAGES},\"tools\":{EX3_TOOLS}}}");
    fails(r(&ex3, &["--tools", "{t.json}"]), &["own \"tools\""]);
    fails(
        render(
            &[("m.json", EX3_MESSAGES), ("t.json", "[{\"type\":")],
            &["--messages", "{m.json}", "--tools", "{t.json}"],
        ),
        &["tools: invalid JSON"],
    );
    fails(
        render(
            &[("m.json", EX3_MESSAGES), ("t.json", "{}")],
            &["--messages", "{m.json}", "--tools", "{t.json}"],
        ),
        &["tools: expected a JSON array"],
    );
    // Two thinking flags, missing files.
    fails(r("[]", &["--think", "--nothink"]), &["cannot be used with"]);
    fails(
        ds4(&["render", "-m", VOCAB, "--messages", "/nonexistent/m.json"]),
        &["cannot read /nonexistent/m.json"],
    );
    fails(
        render(
            &[("m.json", "[]")],
            &["--messages", "{m.json}", "--tools", "/nonexistent/t.json"],
        ),
        &["cannot read /nonexistent/t.json"],
    );
    fails(
        ds4_stdin(&["render", "-m", VOCAB, "--messages", "-"], b"[\xff]"),
        &["not valid UTF-8"],
    );
}
