//! GGUF v3 container (read over mmap, write streaming) and the ggml block codecs that
//! DeepSeek V4 Flash files in ds4's layout use.
//!
//! Reading validates everything that can be checked from the bytes alone (counts bounded by
//! the bytes present, UTF-8, tensor spans aligned, inside the file and disjoint) so that
//! higher layers only ever see a well-formed file. Model-level rules live in `ds4-model`.

pub mod error;
pub mod header;
pub mod quant;
pub mod reader;
pub mod types;
pub mod value;
pub mod writer;

pub use error::{GgufError, Result};
pub use header::{Header, TensorInfo, DEFAULT_ALIGNMENT};
pub use reader::{parse, GgufFile, Layout, PARSE_MEMORY_SLACK};
pub use types::GgmlType;
pub use value::{Array, Elem, Value, ValueType};
pub use writer::{encode_header, file_size, GgufWriter};
