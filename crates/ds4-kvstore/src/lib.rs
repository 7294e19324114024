//! On-disk KV checkpoints keyed by token prefix.
//!
//! DeepSeek V4's compressed KV state (~14 KB per token) makes the disk a first-class home for
//! long contexts: a conversation resumes after a restart without re-prefilling. The engine's
//! state is opaque bytes here; this crate owns durability, identity, integrity and space.
//!
//! Guarantees: an entry is either absent or complete (temp file, fsync, rename, directory
//! fsync); an entry from another model or format version, or a corrupt or truncated one, is
//! never loaded — it is reported once and removed; the directory never holds more than the
//! budget of entries (eviction happens before a write).

pub mod format;
pub mod store;

pub use format::{file_name, Mode};
pub use store::{
    open_entry, prepare_dir, EntryMeta, KvError, KvStore, Loaded, Rejected, StoreConfig,
    StoreOutcome,
};

/// The identity of a model file: SHA-256 of its encoded GGUF header (metadata and tensor
/// table, offsets included). The CLI and the server both use this, so a session saved by one
/// restores in the other.
pub fn header_identity(h: &ds4_gguf::Header) -> Result<[u8; 32], ds4_gguf::GgufError> {
    Ok(model_identity(&ds4_gguf::encode_header(h)?))
}

/// Model identity for the store: SHA-256 over a canonical rendering of the GGUF metadata
/// and tensor table (names, dims, types, offsets) — the same file gives the same id.
pub fn model_identity(canonical: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(canonical).into()
}
