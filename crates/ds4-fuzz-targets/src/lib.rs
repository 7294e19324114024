//! The bodies of the cargo-fuzz targets in `fuzz/`, as plain functions.
//!
//! Fuzzing needs nightly and cargo-fuzz, so the fuzz crate lives outside the workspace. The
//! inputs it found and the seeds it starts from would then be checked only when someone
//! fuzzes. Keeping each target's body here lets `fuzz/fuzz_targets/*.rs` stay one-line
//! wrappers, and lets this crate's tests replay every committed seed
//! (`fuzz/corpus_seeds/<target>/`) and crash input (`fuzz/regressions/<target>/`) through
//! exactly the code the fuzzer runs, on stable, in `cargo test --workspace`.
//!
//! Each function panics on a finding, as a fuzz target must.

mod gguf_parse;
mod kvstore_load;
mod server_request;

pub use gguf_parse::gguf_parse;
pub use kvstore_load::kvstore_load;
pub use server_request::server_request;

/// A target's entry function.
pub type Target = fn(&[u8]);

/// Every target by name, as the fuzz crate's `[[bin]]` names them.
pub const TARGETS: &[(&str, Target)] = &[
    ("gguf_parse", gguf_parse),
    ("server_request", server_request),
    ("kvstore_load", kvstore_load),
];
