//! What the ds4 front ends (`ds4`, `ds4-bench`, `ds4-server`) share below their user
//! interfaces, so they cannot drift apart:
//!
//! - [`config`]: the run's settings from flags and the environment, read once at start
//!   (`ds4 --print-config` prints them);
//! - [`load`]: backend choice, the placement plan for the device that will run the model,
//!   GPU weights placed by that plan, and the load report;
//! - [`plan`]: the planner's view of a model file (also what `ds4 plan` prints);
//! - [`driver`]: the conversation driver — the live session, its logits, prefix reuse,
//!   step-wise generation, checkpoints;
//! - [`draft`]: speculative decoding's drafters and settings (docs/speculative.md);
//! - [`slots`]: several conversations on one engine, decoded in batched steps (the
//!   server's `--parallel N`);
//! - [`checkpoint`]: the one payload format of disk checkpoints, read by both binaries.

pub mod checkpoint;
pub mod cli_help;
pub mod config;
pub mod draft;
pub mod drafting;
pub mod driver;
pub mod error;
pub mod load;
pub mod plan;
pub mod slots;
pub mod step;

pub use checkpoint::{Checkpoint, CheckpointError, Format};
pub use draft::{DraftConfig, DraftMode, DraftStats, Drafter, Governor};
pub use drafting::{draft_step, DraftScratch, DraftTarget, Drafted, Verified};
pub use driver::{
    continuation, Conversation, DriverError, Flow, GenLimits, GenOutcome, GenState, GenStop, Pick,
    Steer, SyncStats,
};
pub use error::{error_chain, LoadError};
pub use slots::{HostStep, SlotTarget, Slots, SlotsError};
pub use step::StepLogits;
