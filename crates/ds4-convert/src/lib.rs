//! `ds4-convert`: HF DeepSeek V4 checkpoints → ds4-layout GGUF, vocabulary-only GGUFs, and
//! synthetic full-size models.
//!
//! * [`convert`]: `config.json` + `*.safetensors` (official or transformers naming, F32/BF16/
//!   F16, or the official release's FP8/FP4 with E8M0 scales, decoded by [`official`]) → GGUF with exactly the keys, names, dims and order `ds4_model` validates, encoded
//!   per a [`ds4_model::layout::TypeRecipe`] (`f32` for oracle parity, ds4's `q2`/`q4`).
//! * [`vocab`]: a `tokenizer.json` → GGUF with metadata only.
//! * [`synthetic`]: random weights at the real shapes, generated straight into a caller's
//!   buffer ([`synthetic::SyntheticModel::fill_rows`]) or streamed to a file.
//! * [`demo`]: the tiny random-weight model with the real vocabulary that the README's
//!   first command runs.

pub mod checkpoint;
pub mod config;
pub mod convert;
pub mod demo;
pub mod error;
pub mod imatrix;
pub mod mapping;
pub mod official;
pub mod progress;
pub mod requant;
pub mod synthetic;
pub mod tokenizer;
pub mod vocab;

pub use convert::{convert_hf, dry_run, HfOptions, LayoutSize, Report};
pub use error::{CheckpointProblem, ConvertError, Result};
pub use progress::{NoProgress, Progress};
pub use synthetic::SyntheticModel;
