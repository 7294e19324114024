//! The five official DeepSeek API test vectors (docs/chat.md §5): each prompt rendered as one
//! non-thinking user turn must give the API's `usage.prompt_tokens`. The data is committed in
//! `tests/fixtures/official-vectors/` (provenance note there); `DS4_TEST_VECTORS` overrides it.

mod common;

use ds4_chat::render::{self, Message, ThinkingMode};
use ds4_chat::request::ChatRequest;

fn vectors_dir() -> std::path::PathBuf {
    let dir = std::env::var_os("DS4_TEST_VECTORS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures/official-vectors")
        });
    assert!(
        dir.join("manifest.json").is_file(),
        "official test vectors not found at {} (expected <repo>/tests/fixtures/official-vectors, or set DS4_TEST_VECTORS)",
        dir.display()
    );
    dir
}

#[test]
fn official_prompt_token_counts() {
    let dir = vectors_dir();
    let tok = common::tokenizer();
    let expected = [
        ("short_italian_fact", 21usize),
        ("short_code_completion", 27),
        ("short_reasoning_plain", 18),
        ("long_memory_archive", 3353),
        ("long_code_audit", 3844),
    ];
    for (id, count) in expected {
        let prompt =
            std::fs::read_to_string(dir.join("prompts").join(format!("{id}.txt"))).unwrap();
        let official: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("official").join(format!("{id}.official.json")))
                .unwrap(),
        )
        .unwrap();
        // The data file agrees with the spec's table.
        let usage = official
            .pointer("/usage/prompt_tokens")
            .and_then(|v| v.as_u64())
            .expect("usage.prompt_tokens");
        assert_eq!(
            usage as usize, count,
            "{id}: official file disagrees with the spec table"
        );
        // Server path: the recorded API request (one user turn, thinking disabled) rendered and
        // tokenized as rendered chat (both special-token policies).
        let request = official.get("request").expect("request").to_string();
        let req = ChatRequest::from_openai_json(&request, 1 << 20).unwrap();
        assert_eq!(req.mode, ThinkingMode::NoThink, "{id}");
        let rendered = req.render();
        assert_eq!(
            rendered,
            render::render_prompt::<&str>(&[Message::user(&prompt)], &[], ThinkingMode::NoThink)
        );
        let ids = tok.encode_chat(&rendered).unwrap();
        assert_eq!(ids.len(), count, "{id}: rendered-chat token count");
        assert_eq!(
            tok.encode(&rendered, true).unwrap(),
            ids,
            "{id}: HF policy differs"
        );
        // Token-level path of ds4_test (docs/chat.md §2.7): same ids.
        assert_eq!(
            render::official_vector_tokens(tok, &prompt).unwrap(),
            ids,
            "{id}: token-level render differs"
        );
    }
}

#[test]
fn official_short_prompt_ids() {
    let dir = vectors_dir();
    let tok = common::tokenizer();
    let cases: [(&str, &[u32]); 3] = [
        (
            "short_italian_fact",
            &[
                0, 128803, 52, 278, 4908, 75, 295, 89034, 399, 3919, 123003, 28, 23442, 9861,
                63030, 47121, 317, 805, 33, 128804, 128822,
            ],
        ),
        (
            "short_code_completion",
            &[
                0, 128803, 41174, 270, 345, 6809, 418, 270, 2894, 6319, 17840, 1353, 1137, 3916,
                6400, 15626, 97201, 14, 36220, 97201, 754, 51663, 70, 1760, 1990, 128804, 128822,
            ],
        ),
        (
            "short_reasoning_plain",
            &[
                0, 128803, 7805, 418, 1353, 270, 1167, 28, 223, 11154, 26, 7203, 513, 223, 7833,
                344, 128804, 128822,
            ],
        ),
    ];
    for (id, ids) in cases {
        let prompt =
            std::fs::read_to_string(dir.join("prompts").join(format!("{id}.txt"))).unwrap();
        assert_eq!(
            render::official_vector_tokens(tok, &prompt).unwrap(),
            ids,
            "{id}"
        );
    }
}
