//! Engine errors. Bad input (token ids, snapshot bytes, context overflow, mode/model
//! mismatches) is reported here with the offending numbers; it never panics.

use crate::backend::BackendError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("backend: {0}")]
    Backend(#[from] BackendError),
    #[error("model: {0}")]
    Model(#[from] ds4_model::ModelError),
    #[error("model has no tensor {name:?}")]
    MissingTensor { name: String },
    #[error("token id {token} at position {index} is outside the vocabulary of {n_vocab}")]
    BadToken {
        token: u32,
        index: usize,
        n_vocab: usize,
    },
    #[error("context full: {pos} tokens held, {adding} more requested, context is {ctx}")]
    ContextFull {
        pos: usize,
        adding: usize,
        ctx: usize,
    },
    #[error("numeric mode {mode} cannot run this model: {reason}")]
    ModeUnsupported { mode: String, reason: String },
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("snapshot: {0}")]
    Snapshot(String),
    #[error("sampler: {0}")]
    Sampler(String),
    #[error("nothing to decode: the token list is empty")]
    Empty,
    #[error("streamed experts: {0}")]
    Stream(#[from] crate::expert_stream::StreamError),
}

pub type Result<T> = std::result::Result<T, EngineError>;
