//! `ds4-chat`: everything between text and token ids for DeepSeek V4 Flash.
//!
//! * [`Tokenizer`]: exact V4 byte-level BPE (HF `tokenizers` configured from GGUF tables),
//!   three special-token policies, exact decoding and a UTF-8-safe streaming decoder.
//! * [`render`]: byte-exact chat prompt rendering (ds4's algorithm, docs/chat.md §2).
//! * [`parse`] / [`stream`]: generated text → reasoning, content and DSML tool calls, both
//!   final and as a streaming state machine (docs/chat.md §3).

mod bpe;
pub mod error;
pub mod json;
pub mod parse;
mod pretok;
pub mod render;
pub mod request;
pub mod stream;
pub mod tokenizer;

pub use error::ChatError;
pub use tokenizer::{ChatMarkers, SpecialTokens, StreamDecoder, Tokenizer, Utf8Stream};
