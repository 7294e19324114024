//! What a ds4-layout DeepSeek V4 Flash GGUF must contain, read from its metadata.
//!
//! Two strictness levels exist because tests need tiny models: [`Strictness::Ds4`] applies
//! ds4's own rules (the real Flash dims, fixed tensor types); [`Strictness::Layout`] takes
//! every dimension from the metadata and checks the tensor table is consistent with it, in
//! the same layout, while allowing any supported element type (e.g. `F32` for oracle parity).

pub mod accounting;
pub mod catalogue;
pub mod error;
pub mod hparams;
pub mod kv;
pub mod layout;
pub mod mtp;
pub mod names;
pub mod spec;

pub use accounting::ByteAccounting;
pub use catalogue::{expected_tensors, ExpectedTensor, TensorClass, TypeRule};
pub use error::{ModelError, Problem};
pub use hparams::{AttnKind, HParams, Yarn};
pub use names::{GlobalTensor, LayerTensor, TensorName};
pub use spec::{ModelSpec, Strictness};
