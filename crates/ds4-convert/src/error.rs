//! Errors of the converter library. Every variant names the file, key or tensor at fault, so a
//! user handed a checkpoint that does not fit learns exactly what to fix.

use std::fmt;
use std::path::PathBuf;

use ds4_gguf::quant::QuantError;
use ds4_gguf::GgufError;
use ds4_model::ModelError;

/// One reason a checkpoint cannot be converted. Conversion collects all of them before
/// refusing, so a single run shows everything that is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckpointProblem {
    /// A tensor the name mapping does not know (or one for a layer/expert that does not exist).
    Unexpected { name: String },
    /// A tensor the config requires is absent. `source` is the name in the checkpoint's own
    /// naming scheme; `shape` the PyTorch shape the config implies.
    Missing {
        source: String,
        gguf: String,
        shape: Vec<u64>,
    },
    /// A tensor is present with the wrong shape (PyTorch order).
    Shape {
        name: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },
    /// The element type cannot be converted (e.g. FP8 weights of the official release).
    Dtype {
        name: String,
        dtype: String,
        accepted: &'static str,
    },
    /// Two source tensors map onto the same GGUF tensor (or expert slot).
    Duplicate {
        name: String,
        other: String,
        gguf: String,
    },
    /// Experts of one layer are given both per expert and packed.
    MixedExperts { layer: usize },
}

impl fmt::Display for CheckpointProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CheckpointProblem::Unexpected { name } => write!(f, "unexpected tensor {name}"),
            CheckpointProblem::Missing {
                source,
                gguf,
                shape,
            } => write!(
                f,
                "missing tensor {source} (expected shape {shape:?}; GGUF name {gguf})"
            ),
            CheckpointProblem::Shape {
                name,
                found,
                expected,
            } => write!(
                f,
                "tensor {name} has shape {found:?}, config implies {expected:?}"
            ),
            CheckpointProblem::Dtype {
                name,
                dtype,
                accepted,
            } => write!(
                f,
                "tensor {name} has dtype {dtype}; only {accepted} can be converted"
            ),
            CheckpointProblem::Duplicate { name, other, gguf } => write!(
                f,
                "tensors {other} and {name} both map to {gguf}; keep only one"
            ),
            CheckpointProblem::MixedExperts { layer } => write!(
                f,
                "layer {layer} has both per-expert (w1/w2/w3) and packed (gate_up_proj/down_proj) expert tensors"
            ),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    /// config.json lacks a key, has a wrong type, or describes something ds4's layout
    /// cannot hold.
    #[error("config.json: {0}")]
    Config(String),
    #[error("{path}: not a readable safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error("no *.safetensors files in {0}")]
    NoSafetensors(PathBuf),
    #[error("checkpoint {dir} cannot be converted ({} problem(s)):\n  - {}", problems.len(),
        problems.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("\n  - "))]
    Checkpoint {
        dir: PathBuf,
        problems: Vec<CheckpointProblem>,
    },
    /// A tensor's ne0 is not a whole number of blocks of its target type.
    #[error("tensor {name}: ne0 = {ne0} is not a multiple of the {ty} block ({block}); these dims cannot use --types {recipe} (use --types f32)")]
    NotBlockAligned {
        name: String,
        ty: String,
        ne0: u64,
        block: u64,
        recipe: String,
    },
    /// A value that cannot be stored, e.g. a tid2eid entry outside `0..n_expert`.
    #[error("tensor {name}: {message}")]
    BadValue { name: String, message: String },
    #[error("tensor {name}: {source}")]
    Quant { name: String, source: QuantError },
    /// An importance-matrix file that cannot be read or does not fit the model.
    #[error("imatrix {path}: {message}")]
    Imatrix { path: PathBuf, message: String },
    #[error("tokenizer {path}: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// The header we built does not pass model validation (a converter bug or a config the
    /// engine cannot run).
    #[error("the converted model would not pass validation: {0}")]
    Invalid(#[from] ModelError),
    /// A request outside what the generator supports (tensor index, buffer size, ...).
    #[error("{0}")]
    Usage(String),
}

pub type Result<T, E = ConvertError> = std::result::Result<T, E>;

pub(crate) fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> ConvertError {
    let path = path.into();
    move |source| ConvertError::Io { path, source }
}
