//! Shared code of the ds4 binaries: one module per subcommand.

pub mod inspect;
pub mod logging;
pub mod plan;
