//! The DeepSeek V4 Flash inference engine: the forward pass written once over an op-level
//! [`Backend`] trait (`docs/forward.md`), the decode-time KV state with byte snapshots,
//! a session/generation API and a sampler.
//!
//! ```text
//! Engine::load(file, Box<dyn Backend>, EngineConfig)   weights bound, mode chosen
//!   → Session::new(engine)                              KV state for `ctx` tokens
//!   → prefill(tokens) / decode(token) → logits          chunked prefill, T = 1 decode
//!   → Sampler::sample(logits, history) → token          or Session::generate(...)
//! ```
//!
//! Numeric modes ([`NumericMode`]): `exact` computes HF transformers' graph (no QAT
//! simulation); `official` adds the FP8/FP4 simulations the checkpoint was trained with
//! (docs/forward.md §2.7). `official` is the default wherever the model's dims allow it.

pub mod backend;
pub mod census;
pub mod config;
pub mod device;
pub mod engine;
pub mod error;
pub mod expert_cache;
mod expert_host;
pub mod expert_stream;
pub mod forward;
pub mod fused;
mod mtp;
pub mod numerics;
pub mod sampler;
pub mod session;
pub mod speculate;
pub mod state;
pub mod validate;
pub mod weights;

pub use backend::{
    Backend, BackendError, BandJob, Buf, Counters, GraphTiming, HeapSlab, HostSlab, IBuf,
    MatmulPair, ProfileRow, SlabMat, Slice, TaggedSlabs, Weight, WeightInfo, WeightUse,
};
pub use census::RouteCensus;
pub use config::{EngineConfig, NumericMode, DEFAULT_PREFILL_CHUNK};
pub use engine::{BatchRow, Engine, Logits, SHORT_PREFILL_ROWS};
pub use error::{EngineError, Result};
pub use expert_stream::{
    ExpertPlacement, StreamConfig, StreamError, StreamStats, MIN_HOST_SLOTS, PREDICT_ROWS,
};
pub use sampler::{argmax, Rng, Sampler, SamplerConfig};
pub use session::Session;
pub use speculate::Verify;
pub use state::{KvState, Snapshot};
