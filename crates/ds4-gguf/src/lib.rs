//! GGUF v3 container (read over mmap, write streaming) and the ggml block codecs that
//! DeepSeek V4 Flash files in ds4's layout use.

pub mod quant;
pub mod types;

pub use types::GgmlType;
