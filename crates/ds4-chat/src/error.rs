//! Errors of the chat crate: every failure names the offending input.

use thiserror::Error;

/// Everything that can go wrong while building a tokenizer, encoding, decoding or reading a
/// chat request. Parsing *model output* never fails: malformed DSML becomes plain text.
#[derive(Debug, Error)]
pub enum ChatError {
    /// The vocabulary tables are inconsistent (lengths, types, merges, missing markers).
    #[error("invalid tokenizer vocabulary: {0}")]
    Vocab(String),
    /// The underlying HF `tokenizers` library refused the input.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A token id outside the vocabulary was given to the decoder.
    #[error("token id {id} is outside the vocabulary of {vocab_size} tokens")]
    UnknownTokenId { id: u32, vocab_size: usize },
    /// A chat request (messages / tools JSON) is malformed; the string says which field.
    #[error("invalid chat request: {0}")]
    Request(String),
    /// Reading a file (tokenizer.json, messages file) failed.
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}
