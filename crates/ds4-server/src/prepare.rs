//! Request preparation, after parsing: a [`GenRequest`] rendered to the prompt text and
//! tokenized, with exact DSML replayed from tool memory and tool-output continuations of the
//! live state planned ([`crate::live`]). Kept apart from the parsers so that parsing stays
//! a pure function of the body.

use ds4_chat::render;
use ds4_chat::Tokenizer;

use crate::api::GenRequest;
use crate::error::ApiError;
use crate::live::{self, LiveTail, ToolBinding};
use crate::toolmem::ToolMemory;

/// A rendered, tokenized request.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    pub text: String,
    /// Byte ranges of `text` the renderer wrote (the only places chat markers are control
    /// tokens; the whole text with `--content-special-tokens`).
    pub trusted: Vec<std::ops::Range<usize>>,
    pub tokens: Vec<u32>,
    /// The prompt ends with `<think>`: output starts inside reasoning.
    pub thinking: bool,
    /// Tools are live: DSML is streamed as tool calls and its end tag stops generation.
    pub tools: bool,
    /// Tools, tool calls or tool results anywhere (old reasoning is then kept).
    pub tool_context: bool,
    /// Assistant tool-call messages replayed with their exact sampled DSML.
    pub exact_replays: usize,
    /// The request continues the live state after tool calls ([`crate::live`]). When
    /// `required`, `text` and `tokens` hold only the continuation suffix.
    pub live_tail: Option<LiveTail>,
}

impl Prepared {
    /// Tokens of `text[from..]` (a char boundary) under the same special-token policy as
    /// the whole prompt: used when a cached prefix ends inside the prompt's text.
    pub fn suffix_tokens(
        &self,
        tok: &Tokenizer,
        from: usize,
    ) -> Result<Vec<u32>, ds4_chat::ChatError> {
        let r = render::Rendered {
            text: self.text.clone(),
            trusted: self.trusted.clone(),
        };
        r.suffix(from).tokens(tok)
    }
}

/// Renders and tokenizes a request. Assistant tool-call messages are first resolved against
/// tool memory for exact replay (when enabled). `binding` is what the live state ends with
/// now (tool-output continuations are checked against it, [`crate::live::plan`]).
/// `content_specials`: chat markers in client text become control tokens too (ds4's
/// behaviour); otherwise only the renderer's markers do.
pub fn prepare(
    req: &mut GenRequest,
    toolmem: Option<&mut ToolMemory>,
    binding: Option<&ToolBinding>,
    tok: &Tokenizer,
    content_specials: bool,
) -> Result<Prepared, ApiError> {
    let policy = |r: render::Rendered| {
        if content_specials {
            render::Rendered::all_trusted(r.text)
        } else {
            r
        }
    };
    let tokenize = |r: &render::Rendered| {
        r.tokens(tok)
            .map_err(|e| ApiError::internal(format!("tokenizer: {e}")))
    };
    let thinking = req.mode.is_thinking();
    if let Some(p) = &req.completion_prompt {
        // The raw prompt, as OpenAI-compatible servers take it: the client wrote all of it
        // (there is no template whose turns it could forge), so chat markers in it are
        // control tokens, and nothing is added (not even ⟨BOS⟩).
        let r = render::Rendered::all_trusted(p.clone());
        let tokens = tokenize(&r)?;
        return Ok(Prepared {
            text: r.text,
            trusted: r.trusted,
            tokens,
            thinking: false,
            tools: false,
            tool_context: false,
            exact_replays: 0,
            live_tail: None,
        });
    }
    let exact = match toolmem {
        Some(tm) => tm.apply(&mut req.messages).0,
        None => 0,
    };
    let mut live_tail = live::plan(req, binding)?;
    if let Some(t) = &mut live_tail {
        let r = policy(render::Rendered {
            text: std::mem::take(&mut t.suffix_text),
            trusted: std::mem::take(&mut t.suffix_trusted),
        });
        t.suffix_tokens = tokenize(&r)?;
        t.suffix_text = r.text;
        t.suffix_trusted = r.trusted;
    }
    let mut tools = !req.tool_schemas.is_empty();
    let mut tool_context = tools
        || req.messages.iter().any(|m| {
            !m.tool_calls.is_empty()
                || !m.tool_call_ids.is_empty()
                || m.role == "tool"
                || m.role == "function"
        });
    if let Some(t) = live_tail.as_ref().filter(|t| t.required) {
        // Only the suffix exists; the tools (and the tool context) are the live state's.
        tools |= binding.is_some_and(|b| b.tools);
        tool_context = true;
        return Ok(Prepared {
            text: t.suffix_text.clone(),
            trusted: t.suffix_trusted.clone(),
            tokens: t.suffix_tokens.clone(),
            thinking,
            tools,
            tool_context,
            exact_replays: exact,
            live_tail,
        });
    }
    let r = policy(render::render_prompt_spans(
        &req.messages,
        &req.tool_schemas,
        req.mode,
    ));
    let tokens = tokenize(&r)?;
    Ok(Prepared {
        text: r.text,
        trusted: r.trusted,
        tokens,
        thinking,
        tools,
        tool_context,
        exact_replays: exact,
        live_tail,
    })
}
