//! Errors of the GGUF container layer. Every variant names what was wrong and where, so a
//! user handed a corrupt or foreign file learns why it was refused.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot open {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("I/O error while {context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("file is {len} bytes: too small to be a GGUF file (the header alone is 24 bytes)")]
    TooSmall { len: u64 },
    #[error("bad magic {found:#010x}: not a GGUF file (expected 0x46554747, \"GGUF\")")]
    BadMagic { found: u32 },
    #[error("unsupported GGUF version {found} (only version 3 is supported)")]
    BadVersion { found: u32 },
    #[error(
        "truncated file: {what} at byte {offset} needs {needed} bytes, only {available} remain"
    )]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        available: u64,
    },
    #[error("{what} count {count} at byte {offset} is impossible: the {remaining} remaining bytes can hold at most {max}")]
    AbsurdCount {
        what: String,
        count: u64,
        offset: u64,
        remaining: u64,
        max: u64,
    },
    #[error("invalid UTF-8 in {what} at byte {offset}")]
    InvalidUtf8 { what: String, offset: u64 },
    #[error("unknown metadata value type {code} for key {key:?} at byte {offset}")]
    UnknownValueType { key: String, code: u32, offset: u64 },
    #[error("metadata key {key:?}: {problem}")]
    BadValue { key: String, problem: String },
    #[error("metadata key {key:?}: arrays nested deeper than {max} levels")]
    NestingTooDeep { key: String, max: usize },
    #[error("duplicate metadata key {key:?}")]
    DuplicateKey { key: String },
    #[error("general.alignment must be a nonzero u32 power of two, found {found}")]
    BadAlignment { found: String },
    #[error("tensor {name:?}: {problem}")]
    BadTensor { name: String, problem: String },
    #[error("duplicate tensor name {name:?}")]
    DuplicateTensor { name: String },
    #[error("tensors {a:?} and {b:?} overlap in the data section")]
    Overlap { a: String, b: String },
    #[error("no tensor named {name:?}")]
    NoSuchTensor { name: String },
    #[error("{what} would need {needed} bytes of memory, more than a {file_len}-byte file may use (its size plus {slack} bytes): the header is not a plausible GGUF")]
    TooMuchMemory {
        what: String,
        needed: u64,
        file_len: u64,
        slack: u64,
    },
    #[error("writer: {0}")]
    Writer(String),
}

pub type Result<T, E = GgufError> = std::result::Result<T, E>;
