//! The request model every endpoint family parses into: which endpoint a request came in
//! on and what it asks for, normalized. Its own module so that the parsers
//! ([`crate::request`]), the live-state continuations ([`crate::live`]) and preparation
//! ([`crate::prepare`]) all depend on it and not on each other.

use std::collections::HashMap;

use ds4_chat::render::{Message, ThinkingMode};

use crate::error::Shape;

/// Which endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    Responses,
    Messages,
}

impl Endpoint {
    pub fn shape(self) -> Shape {
        if self == Endpoint::Messages {
            Shape::Anthropic
        } else {
            Shape::OpenAi
        }
    }

    /// The request field that holds the prompt (context-overflow errors name it).
    pub fn prompt_param(self) -> &'static str {
        match self {
            Endpoint::Chat | Endpoint::Messages => "messages",
            Endpoint::Completions => "prompt",
            Endpoint::Responses => "input",
        }
    }

    /// Tool-call id prefix (docs/server.md §7.1).
    pub fn tool_id_prefix(self) -> &'static str {
        if self == Endpoint::Messages {
            "toolu_"
        } else {
            "call_"
        }
    }
}

/// Client sampling knobs (`None` = not sent).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub top_k: Option<u64>,
    pub seed: Option<u64>,
}

/// What every generation endpoint asks for, normalized.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    pub endpoint: Endpoint,
    /// Echoed back.
    pub model: String,
    pub messages: Vec<Message>,
    /// Rendered schema lines (empty when tools are off or `tool_choice` is none).
    pub tool_schemas: Vec<String>,
    pub mode: ThinkingMode,
    pub stop: Vec<String>,
    pub max_tokens: Option<u64>,
    pub sampling: Sampling,
    pub stream: bool,
    pub include_usage: bool,
    /// `/v1/completions`: the prompt text.
    pub completion_prompt: Option<String>,
    /// Responses: `reasoning.summary` asks for reasoning items.
    pub reasoning_summary: bool,
    /// Responses: wire tool name (`NS+name`) → (namespace, name).
    pub namespaces: HashMap<String, (String, String)>,
    /// Responses: continue this response on the live state ([`crate::live`]).
    pub previous_response_id: Option<String>,
}
