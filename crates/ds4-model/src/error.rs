//! Validation problems. Validation collects every problem instead of stopping at the first,
//! so `ds4 inspect` can show the whole verdict at once.

use std::fmt;

/// One reason a file is not an acceptable model.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub enum Problem {
    MissingKey {
        key: String,
    },
    KeyType {
        key: String,
        expected: String,
        found: String,
    },
    KeyValue {
        key: String,
        expected: String,
        found: String,
    },
    MissingTensor {
        name: String,
    },
    TensorDims {
        name: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
    TensorType {
        name: String,
        expected: String,
        found: String,
    },
    GateUpMismatch {
        layer: usize,
        gate: String,
        up: String,
    },
    Inconsistent {
        what: String,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::MissingKey { key } => write!(f, "metadata key {key} is missing"),
            Problem::KeyType {
                key,
                expected,
                found,
            } => {
                write!(
                    f,
                    "metadata key {key} has type {found}, expected {expected}"
                )
            }
            Problem::KeyValue {
                key,
                expected,
                found,
            } => {
                write!(f, "metadata key {key} = {found}, expected {expected}")
            }
            Problem::MissingTensor { name } => write!(f, "tensor {name} is missing"),
            Problem::TensorDims {
                name,
                expected,
                found,
            } => {
                write!(f, "tensor {name} has dims {found:?}, expected {expected:?}")
            }
            Problem::TensorType {
                name,
                expected,
                found,
            } => {
                write!(f, "tensor {name} has type {found}, expected {expected}")
            }
            Problem::GateUpMismatch { layer, gate, up } => write!(
                f,
                "layer {layer}: routed gate is {gate} but up is {up} (they must share a type)"
            ),
            Problem::Inconsistent { what } => f.write_str(what),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("not a valid DeepSeek V4 Flash model ({} problem{}):\n  - {}", .0.len(), if .0.len() == 1 { "" } else { "s" }, .0.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("\n  - "))]
    Invalid(Vec<Problem>),
    #[error(transparent)]
    Gguf(#[from] ds4_gguf::GgufError),
}
