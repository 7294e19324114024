//! Progress reporting hook. The library never prints; the binary plugs in an indicatif bar.

/// Receives progress of a long write. All methods default to doing nothing.
pub trait Progress {
    /// Called once before the first byte, with the payload bytes that will be produced.
    fn start(&mut self, _total_bytes: u64) {}
    /// Called when a tensor begins.
    fn tensor(&mut self, _name: &str) {}
    /// Called after `bytes` more payload bytes were written.
    fn advance(&mut self, _bytes: u64) {}
    /// Called once after the last byte.
    fn finish(&mut self) {}
}

/// A [`Progress`] that ignores everything.
pub struct NoProgress;

impl Progress for NoProgress {}
