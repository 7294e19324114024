//! Shared code of the ds4 binaries: one module per subcommand. Loading, planning and the
//! conversation driver live in `ds4-runtime` (shared with `ds4-server`); `load` and `plan`
//! are re-exported under their old paths.

pub mod chat;
pub mod generate;
pub mod imatrix;
pub mod inspect;
pub mod logging;
pub mod logits;
pub mod perplexity;
pub mod pull;
pub mod repl;
pub mod sessions;
pub mod signals;
pub mod textcmd;
pub mod vectors;
pub mod verify_curve;

pub use ds4_runtime::{load, plan};
