//! Shared code of the ds4 binaries: one module per subcommand, plus the generation core.

pub mod chat;
pub mod generate;
pub mod inspect;
pub mod load;
pub mod logging;
pub mod logits;
pub mod plan;
pub mod repl;
pub mod sessions;
pub mod signals;
pub mod textcmd;
pub mod vectors;
