//! Feeds arbitrary bytes to the GGUF parser and, when it accepts them, to model validation
//! and to a re-write: nothing may panic, and accepted images must round-trip.

/// The `gguf_parse` fuzz target's entry: panics on a finding.
pub fn gguf_parse(data: &[u8]) {
    if let Ok((header, _layout)) = ds4_gguf::parse(data) {
        let _ = ds4_model::ModelSpec::from_header(&header, ds4_model::Strictness::Auto);
        let _ = ds4_model::ModelSpec::from_header(&header, ds4_model::Strictness::Layout);
        // Any accepted header must encode again without error.
        ds4_gguf::encode_header(&header).expect("accepted header must re-encode");
    }
}
