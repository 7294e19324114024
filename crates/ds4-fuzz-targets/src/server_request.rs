//! Feeds arbitrary bytes to the four ds4-server request parsers (chat, completions, messages,
//! responses) and, when one accepts them, renders and tokenizes the request with the real V4
//! tokenizer (`prepare::prepare`): once plainly, once with tool memory and a live binding that
//! the request's own tool ids resolve against. Nothing may panic, and the prompt tokens must
//! decode back to exactly the prompt text.

use std::sync::{Arc, OnceLock};

use ds4_chat::Tokenizer;
use ds4_server::endpoints;
use ds4_server::live::ToolBinding;
use ds4_server::prepare;
use ds4_server::request::GenRequest;
use ds4_server::toolmem::ToolMemory;

/// The committed vocabulary-only GGUF (real V4 tokenizer, no tensors), loaded once.
fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/vocab/deepseek-v4-vocab.gguf"
        );
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let (header, _) = ds4_gguf::parse(&bytes).expect("vocabulary GGUF parses");
        Tokenizer::from_gguf_header(&header).expect("V4 vocabulary builds")
    })
}

fn check_prepared(p: &prepare::Prepared, tok: &Tokenizer) {
    let bytes = tok
        .decode(&p.tokens)
        .expect("prompt tokens are in the vocabulary");
    assert_eq!(
        bytes,
        p.text.as_bytes(),
        "prompt tokens must decode to the prompt"
    );
}

fn exercise(req: GenRequest, tok: &Tokenizer) {
    // Plain: no tool memory, nothing live.
    let mut plain = req.clone();
    if let Ok(p) = prepare::prepare(&mut plain, None, None, tok, false) {
        check_prepared(&p, tok);
    }

    // Tool memory knowing every call id of the request, and a live binding holding every id
    // the request answers (and its previous_response_id): the exact-replay and live-tail paths.
    let mut mem = ToolMemory::new(64, 1 << 20);
    let mut call_ids = Vec::new();
    for m in &req.messages {
        for c in &m.tool_calls {
            let block: Arc<str> = Arc::from(format!("<dsml {}>{}</dsml>", c.name, c.arguments));
            mem.insert(&c.id, block);
        }
        call_ids.extend(m.tool_call_ids.iter().cloned());
    }
    let binding = ToolBinding {
        endpoint: req.endpoint,
        response_id: req.previous_response_id.clone(),
        call_ids,
        tools: !req.tool_schemas.is_empty(),
        frontier: 0,
    };
    let mut live = req;
    if let Ok(p) = prepare::prepare(&mut live, Some(&mut mem), Some(&binding), tok, false) {
        check_prepared(&p, tok);
        if let Some(t) = &p.live_tail {
            let _ = t.matches(live.endpoint, &binding);
            let _ = t.source();
        }
    }
}

/// The `server_request` fuzz target's entry: panics on a finding.
pub fn server_request(data: &[u8]) {
    let tok = tokenizer();
    // Small contexts exercise the thinking-mode downgrade (`ThinkingMode::for_context`).
    let ctx = [4096u64, 1 << 20, 0][data.len() % 3];
    for family in endpoints::ALL {
        if let Ok(req) = family.parse(data, ctx) {
            exercise(req, tok);
        }
    }
}
