//! cargo-fuzz wrapper: the body is `ds4_fuzz_targets::kvstore_load` (crates/ds4-fuzz-targets), which
//! the workspace tests also run over every committed seed and crash input.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| ds4_fuzz_targets::kvstore_load(data));
