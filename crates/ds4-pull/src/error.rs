//! What can go wrong when pulling a file, each case named so that the message tells the user
//! what to do next (a token, a different name, more disk) instead of a bare HTTP status.

use std::path::PathBuf;

/// An error from [`crate::pull`] or [`crate::remote_file`].
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// The repository, revision or file name cannot name a file on the hub.
    #[error("bad {what} {value:?}: {why}")]
    BadName {
        what: &'static str,
        value: String,
        why: &'static str,
    },
    /// HTTP 404 for the file itself (the hub's `X-Error-Code: EntryNotFound`, or no code).
    #[error("no file {file} in repository {repo} at revision {revision} (HTTP 404 from {url})")]
    NoSuchFile {
        repo: String,
        revision: String,
        file: String,
        url: String,
    },
    /// HTTP 404 with `X-Error-Code: RevisionNotFound`.
    #[error("repository {repo} has no revision {revision} (HTTP 404 from {url})")]
    NoSuchRevision {
        repo: String,
        revision: String,
        url: String,
    },
    /// HTTP 404 with `X-Error-Code: RepoNotFound`; the hub also answers so for a private
    /// repository when no token was sent.
    #[error(
        "no repository {repo} (HTTP 404 from {url}); if it is private, pass a token with \
         --token or HF_TOKEN"
    )]
    NoSuchRepo { repo: String, url: String },
    /// HTTP 401/403: a token is missing, wrong, or lacks access (gated repositories need the
    /// terms accepted on the repository's page first).
    #[error(
        "HTTP {status} from {url}: repository {repo} needs a Hugging Face token with access to it \
         ({hint})"
    )]
    NeedsToken {
        status: u16,
        repo: String,
        url: String,
        hint: &'static str,
    },
    /// Any other status that retrying will not fix.
    #[error("HTTP {status} from {url}")]
    Http { status: u16, url: String },
    /// The hub's answer named no size for the file.
    #[error("the answer from {url} gives no size for the file (neither X-Linked-Size nor Content-Length)")]
    NoSize { url: String },
    /// A server answer that contradicts the protocol (wrong range, more bytes than announced).
    #[error("unexpected answer from {url}: {what}")]
    Protocol { url: String, what: String },
    /// The file on the hub changed (other SHA-256 or size) while this download was running.
    #[error(
        "{file} changed on the hub during the download (was {before}, now {after}); run the \
         command again to fetch the new version"
    )]
    RemoteChanged {
        file: String,
        before: String,
        after: String,
    },
    /// Too little free space on the target filesystem for the bytes still to download.
    #[error(
        "not enough disk space in {dir}: {needed} bytes ({needed_gib:.2} GiB) still to download, \
         {available} bytes ({available_gib:.2} GiB) available"
    )]
    NoSpace {
        dir: PathBuf,
        needed: u64,
        needed_gib: f64,
        available: u64,
        available_gib: f64,
    },
    /// A file of another size already sits under the final name.
    #[error(
        "{path} already exists with {size} bytes, but the file on the hub has {expected}; move \
         it away or delete it, then run again"
    )]
    ExistingDiffers {
        path: PathBuf,
        size: u64,
        expected: u64,
    },
    /// The downloaded bytes do not hash to the repository's LFS SHA-256. The partial file is
    /// deleted: resuming from bytes known to be wrong would only reproduce the mismatch.
    #[error(
        "SHA-256 mismatch for {file}: expected {expected}, got {actual}; nothing was written \
         under the final name and the download {part} {fate}; run again to download from the \
         start"
    )]
    Mismatch {
        file: String,
        expected: String,
        actual: String,
        part: PathBuf,
        /// "was deleted", or why it could not be.
        fate: String,
    },
    /// Every retry of an interrupted transfer failed.
    #[error(
        "download of {file} failed after {attempts} attempts without progress ({have} of {size} \
         bytes kept in {part}; run again to resume): {last}"
    )]
    RetriesExhausted {
        file: String,
        attempts: u32,
        have: u64,
        size: u64,
        part: PathBuf,
        last: String,
    },
    /// The hub could not be reached (connection, TLS, timeout, 5xx) on any attempt.
    #[error("could not reach {url} after {attempts} attempts: {last}")]
    Unreachable {
        url: String,
        attempts: u32,
        last: String,
    },
    /// A local file operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl PullError {
    pub(crate) fn io(what: &'static str, path: &std::path::Path, source: std::io::Error) -> Self {
        PullError::Io {
            what,
            path: path.to_path_buf(),
            source,
        }
    }
}
