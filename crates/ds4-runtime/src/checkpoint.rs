//! The one payload a disk checkpoint holds, whoever wrote it: `ds4`'s `/save` and
//! `ds4-server`'s cache checkpoints both store this, so a session saved by one resumes in
//! the other.
//!
//! Layout (all integers little-endian):
//!
//! ```text
//! "DS4CKPT\0" | version u32 (= 1) | n_logits u64 | n_logits × f32 | engine snapshot bytes
//! ```
//!
//! `n_logits` is the vocabulary size when the next-token logits after the checkpoint are
//! known (a prompt that ends exactly at the checkpoint then needs no evaluation), or 0 when
//! they are not. The snapshot bytes are the engine's own format, checked when restored.
//!
//! Two older payloads are still read, so that stores written before the formats were
//! unified keep working; callers rewrite such entries in the current format
//! ([`Format::is_legacy`]) instead of discarding them:
//! - `ds4-server`'s `"DS4SRV1\0" | n_logits u64 | logits | snapshot` (logits always present);
//! - `ds4`'s raw engine snapshot (no logits).

use thiserror::Error;

const MAGIC: &[u8; 8] = b"DS4CKPT\0";
/// The version [`encode`] writes. A reader meets a larger one only from a newer build.
pub const VERSION: u32 = 1;
const SERVER_V1_MAGIC: &[u8; 8] = b"DS4SRV1\0";
/// Bytes before the logits: magic, version, count.
const HEAD: usize = 8 + 4 + 8;

/// Why a payload could not be read.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum CheckpointError {
    #[error("checkpoint payload version {found} is newer than this build reads ({VERSION})")]
    UnsupportedVersion { found: u32 },
    #[error("the checkpoint holds {found} logits but the model's vocabulary is {expected}")]
    Vocabulary { found: u64, expected: usize },
    #[error("the checkpoint payload is truncated ({len} bytes, the header needs {needed})")]
    Truncated { len: usize, needed: usize },
}

/// Which writer produced a payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// [`encode`]'s format.
    Current,
    /// `ds4-server` before the formats were unified (`DS4SRV1`).
    ServerV1,
    /// `ds4`'s `/save` before the formats were unified: the bare engine snapshot.
    CliSnapshot,
}

impl Format {
    /// The entry should be rewritten in the current format once restored.
    pub fn is_legacy(self) -> bool {
        self != Format::Current
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::Current => "current",
            Format::ServerV1 => "ds4-server v1",
            Format::CliSnapshot => "ds4 raw snapshot",
        }
    }
}

/// A decoded payload.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// Next-token logits after the checkpoint's last token, when stored.
    pub logits: Option<Vec<f32>>,
    /// The engine snapshot (validated by `Session::restore`).
    pub snapshot: Vec<u8>,
    pub format: Format,
}

/// The current payload for a state snapshot and, when known, the logits after it.
pub fn encode(logits: Option<&[f32]>, snapshot: &[u8]) -> Vec<u8> {
    let logits = logits.unwrap_or(&[]);
    let mut out = Vec::with_capacity(HEAD + 4 * logits.len() + snapshot.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(logits.len() as u64).to_le_bytes());
    for v in logits {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(snapshot);
    out
}

/// Reads a payload of any known format. `n_vocab` bounds the logits a header may claim (a
/// corrupt count must not make us allocate or slice past the payload).
pub fn decode(payload: &[u8], n_vocab: usize) -> Result<Checkpoint, CheckpointError> {
    if payload.starts_with(MAGIC) {
        let version = read_u32(payload, 8, HEAD)?;
        if version != VERSION {
            return Err(CheckpointError::UnsupportedVersion { found: version });
        }
        let n = read_u64(payload, 12, HEAD)?;
        let (logits, rest) = logits_after(payload, HEAD, n, n_vocab, true)?;
        return Ok(Checkpoint {
            logits,
            snapshot: rest.to_vec(),
            format: Format::Current,
        });
    }
    if payload.starts_with(SERVER_V1_MAGIC) {
        let n = read_u64(payload, 8, 16)?;
        let (logits, rest) = logits_after(payload, 16, n, n_vocab, false)?;
        return Ok(Checkpoint {
            logits,
            snapshot: rest.to_vec(),
            format: Format::ServerV1,
        });
    }
    Ok(Checkpoint {
        logits: None,
        snapshot: payload.to_vec(),
        format: Format::CliSnapshot,
    })
}

fn read_u32(b: &[u8], at: usize, needed: usize) -> Result<u32, CheckpointError> {
    let s = b.get(at..at + 4).ok_or(CheckpointError::Truncated {
        len: b.len(),
        needed,
    })?;
    Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

fn read_u64(b: &[u8], at: usize, needed: usize) -> Result<u64, CheckpointError> {
    let s = b.get(at..at + 8).ok_or(CheckpointError::Truncated {
        len: b.len(),
        needed,
    })?;
    let mut a = [0u8; 8];
    a.copy_from_slice(s);
    Ok(u64::from_le_bytes(a))
}

/// The `n` logits starting at `at` and the bytes after them. `optional`: 0 means "not
/// stored" (the current format); otherwise the count must be the vocabulary size.
fn logits_after(
    b: &[u8],
    at: usize,
    n: u64,
    n_vocab: usize,
    optional: bool,
) -> Result<(Option<Vec<f32>>, &[u8]), CheckpointError> {
    if optional && n == 0 {
        return Ok((None, &b[at..]));
    }
    if n != n_vocab as u64 {
        return Err(CheckpointError::Vocabulary {
            found: n,
            expected: n_vocab,
        });
    }
    let end = at + 4 * n_vocab;
    let body = b.get(at..end).ok_or(CheckpointError::Truncated {
        len: b.len(),
        needed: end,
    })?;
    let logits = body
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok((Some(logits), &b[end..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_format_round_trips_with_and_without_logits() {
        let p = encode(Some(&[1.0, -2.5, 3.0]), b"SNAP");
        let c = decode(&p, 3).unwrap();
        assert_eq!(c.logits, Some(vec![1.0, -2.5, 3.0]));
        assert_eq!(c.snapshot, b"SNAP");
        assert_eq!(c.format, Format::Current);
        assert!(!c.format.is_legacy());

        let p = encode(None, b"SNAP");
        let c = decode(&p, 3).unwrap();
        assert_eq!((c.logits, c.snapshot.as_slice()), (None, &b"SNAP"[..]));
    }

    #[test]
    fn bad_headers_are_named_errors() {
        let p = encode(Some(&[1.0, 2.0, 3.0]), b"SNAP");
        assert_eq!(
            decode(&p, 4),
            Err(CheckpointError::Vocabulary {
                found: 3,
                expected: 4
            })
        );
        assert!(matches!(
            decode(&p[..HEAD + 4], 3),
            Err(CheckpointError::Truncated { .. })
        ));
        assert!(matches!(
            decode(&p[..10], 3),
            Err(CheckpointError::Truncated { .. })
        ));
        let mut newer = p.clone();
        newer[8..12].copy_from_slice(&2u32.to_le_bytes());
        assert_eq!(
            decode(&newer, 3),
            Err(CheckpointError::UnsupportedVersion { found: 2 })
        );
        // A count that would overflow a slice bound is refused, not trusted.
        let mut huge = p;
        huge[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode(&huge, 3).is_err());
    }

    /// The server's payload as it was written before the formats were unified.
    fn server_v1(logits: &[f32], snap: &[u8]) -> Vec<u8> {
        let mut out = b"DS4SRV1\0".to_vec();
        out.extend_from_slice(&(logits.len() as u64).to_le_bytes());
        for v in logits {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(snap);
        out
    }

    #[test]
    fn both_legacy_formats_are_read() {
        let c = decode(&server_v1(&[0.5, 1.5], b"S1"), 2).unwrap();
        assert_eq!(c.format, Format::ServerV1);
        assert!(c.format.is_legacy());
        assert_eq!(c.logits, Some(vec![0.5, 1.5]));
        assert_eq!(c.snapshot, b"S1");
        assert!(decode(&server_v1(&[0.5, 1.5], b"S1"), 3).is_err());
        assert!(decode(&server_v1(&[0.5, 1.5], b"S1")[..17], 2).is_err());
        // Anything else is taken for the CLI's bare snapshot; restoring it validates it.
        let c = decode(b"DS4KVST\0rest", 2).unwrap();
        assert_eq!(c.format, Format::CliSnapshot);
        assert_eq!(
            (c.logits, c.snapshot.as_slice()),
            (None, &b"DS4KVST\0rest"[..])
        );
    }
}
