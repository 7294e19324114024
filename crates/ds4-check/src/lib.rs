//! Checking backends against each other, kept apart from the backends themselves so that
//! a backend crate carries no test tooling and depends on no sibling backend.
//!
//! * [`batch`]: batched decode rows against the same rows decoded alone.
//! * [`mirror`]: [`mirror::Mirror`], a `Backend` that runs every op on a reference backend
//!   and on a candidate backend and compares them op by op (the CPU reference against
//!   CUDA or HIP on a GPU machine; the CPU against itself or a perturbed copy in tests).
//! * [`parity`]: whole-model logits of a backend against the CPU engine, and how each
//!   numeric mode is judged (shared by `ds4-engine-check parity` and its tests).
//! * [`quality`]: the paths of a backend checked on the trained demo model, each against
//!   the CPU engine in KL divergence with a bound per path (`ds4 perplexity` runs).
//! * [`refcheck`]: judging official-mode logits against the fixtures' float64 reference, and
//!   the control backends (reorder noise, planted bugs) that calibrate the bound.
//! * `ds4-engine-check` (binary): the op mirror on real and random models, whole-model
//!   logit parity, and the official-mode reference on the GPU.

pub mod batch;
pub mod mirror;
pub mod parity;
pub mod quality;
pub mod refcheck;
