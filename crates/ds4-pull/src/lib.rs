//! Downloads one file from a Hugging Face repository, safely enough for an 81 GiB GGUF.
//!
//! The published DeepSeek V4 Flash weights are single files of 81–153 GiB; a plain `curl`
//! leaves a truncated file under the real name when the connection drops, and nothing checks
//! the bytes. Here:
//!
//! * the bytes go to `FILE.part`; only a complete file whose SHA-256 matches the repository's
//!   LFS metadata is renamed to `FILE` (atomically, after an fsync);
//! * a `FILE.part` left by an earlier run is resumed with an HTTP `Range` request;
//! * a connection dropped mid-body is retried from the bytes already written, a bounded
//!   number of times in a row without progress;
//! * free space is checked before the first byte is fetched;
//! * on a SHA-256 mismatch the `.part` is deleted (resuming from known-bad bytes would give the
//!   same mismatch) and the error says so.
//!
//! Size and SHA-256 come from a HEAD on the `resolve` URL whose redirect is not followed
//! ([`remote_file`]). The bytes are fetched from the redirect's target; the token is sent only
//! to the hub's own origin, never to the CDN, whose URLs are pre-signed.

mod error;
mod pull;
mod remote;
mod source;

use std::path::{Path, PathBuf};
use std::time::Duration;

pub use error::PullError;
pub use pull::{part_path, pull};
pub use remote::{remote_file, RemoteFile};
pub use source::{Source, DEFAULT_ENDPOINT};

/// How to talk to the hub.
#[derive(Debug, Clone)]
pub struct Options {
    /// Sent as `Authorization: Bearer` to the hub (not to the CDN).
    pub token: Option<String>,
    /// Failed attempts in a row (without a byte of progress) before giving up.
    pub retries: u32,
    /// Delay before the first retry; doubled after each further failure, capped at a minute.
    pub retry_delay: Duration,
    /// Limit for opening a connection.
    pub connect_timeout: Duration,
    /// Limit for any one read: a stalled connection becomes a retry instead of a hang.
    pub read_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            token: None,
            retries: 8,
            retry_delay: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(30),
            read_timeout: Duration::from_secs(60),
        }
    }
}

/// Free space of the filesystem holding a directory. A trait so that tests can pretend the
/// disk is full without filling one.
pub trait FreeSpace {
    /// Bytes an unprivileged user may still write under `dir`.
    fn available(&self, dir: &Path) -> std::io::Result<u64>;
}

/// The real answer, from `statvfs` (`GetDiskFreeSpaceExW` on Windows) via `fs4`.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemFreeSpace;

impl FreeSpace for SystemFreeSpace {
    fn available(&self, dir: &Path) -> std::io::Result<u64> {
        fs4::available_space(dir)
    }
}

/// What the download is doing, for a progress display.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Hashing the bytes of a `.part` left by an earlier run before resuming.
    Rehash,
    /// Fetching bytes.
    Download,
}

/// Receives progress; every method has a default that does nothing.
pub trait Progress {
    /// A phase starts: `done` of `total` bytes are already accounted for.
    fn begin(&mut self, _phase: Phase, _total: u64, _done: u64) {}
    /// `n` more bytes hashed or written.
    fn advance(&mut self, _n: u64) {}
    /// Something worth a line of its own (a retry, a restart from zero).
    fn note(&mut self, _msg: &str) {}
    /// The phase is over.
    fn end(&mut self) {}
}

/// A [`Progress`] that shows nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProgress;

impl Progress for NoProgress {}

/// What [`pull`] produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pulled {
    /// The final file.
    pub path: PathBuf,
    /// Its size in bytes.
    pub size: u64,
    /// The SHA-256 it was checked against (`None`: the hub gave none, nothing was checked).
    pub sha256: Option<String>,
    /// The file was already there with the right size; nothing was fetched or re-hashed.
    pub already_present: bool,
    /// Bytes fetched by this run (less than `size` after a resume).
    pub fetched: u64,
}
