//! On-disk entry format (version 1), little-endian:
//!
//! ```text
//!   0  [u8; 8]  magic "DS4KVC\0\x01"
//!   8  u32      format version (1)
//!  12  u32      flags (bit 0: tool map present)
//!  16  [u8;32]  model identity (SHA-256 of the GGUF metadata + tensor table)
//!  48  u8       numeric mode (0 exact, 1 official); 7 bytes zero
//!  56  u64      context size the state was made for
//!  64  u64      token count T
//!  72  u64      payload bytes P
//!  80  u64      tool-map bytes M
//!  88  u64      created (unix seconds)
//!  96  [u8;32]  SHA-256 over bytes 0..96 and everything after byte 160
//! 128  u64      last used (unix seconds)   -- mutable, outside the checksum
//! 136  u64      hits                       -- mutable, outside the checksum
//! 144  [u8;16]  zero
//! 160  u32[T]   tokens
//!      [u8; P]  payload (engine state, opaque here)
//!      [u8; M]  tool map: JSON object {tool-call id: exact DSML text}
//! ```
//! The mutable counters live outside the checksum so a lookup hit can update them in place
//! without rewriting the file; a torn counter only perturbs eviction order.

use sha2::{Digest, Sha256};

pub const MAGIC: [u8; 8] = *b"DS4KVC\0\x01";
pub const VERSION: u32 = 1;
pub const HEADER_LEN: usize = 160;
pub const FLAG_TOOL_MAP: u32 = 1;
/// Hard limits on what a header may claim, so a corrupt header never sizes an allocation.
pub const MAX_TOKENS: u64 = 1 << 24;
pub const MAX_PAYLOAD: u64 = 1 << 40;
pub const MAX_TOOL_MAP: u64 = 1 << 30;

/// Numeric mode the state was computed in; a state from one mode never restores into another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Mode {
    Exact,
    Official,
}

impl Mode {
    pub fn code(self) -> u8 {
        match self {
            Mode::Exact => 0,
            Mode::Official => 1,
        }
    }

    pub fn from_code(c: u8) -> Option<Mode> {
        match c {
            0 => Some(Mode::Exact),
            1 => Some(Mode::Official),
            _ => None,
        }
    }
}

/// The fixed-size header of an entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub flags: u32,
    pub model_id: [u8; 32],
    pub mode: Mode,
    pub ctx: u64,
    pub n_tokens: u64,
    pub payload_len: u64,
    pub tool_map_len: u64,
    pub created: u64,
    pub checksum: [u8; 32],
    pub last_used: u64,
    pub hits: u64,
}

/// Why a header or an entry was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("shorter than the {HEADER_LEN}-byte header")]
    Short,
    #[error("not a ds4-rs KV file (bad magic)")]
    Magic,
    #[error("format version {0}, this build reads version {VERSION}")]
    Version(u32),
    #[error("unknown numeric mode code {0}")]
    Mode(u8),
    #[error("header claims {what} = {value}, above the limit {limit}")]
    Absurd {
        what: &'static str,
        value: u64,
        limit: u64,
    },
    #[error("file is {actual} bytes, the header implies {expected}")]
    Length { expected: u64, actual: u64 },
    #[error("checksum mismatch (corrupt or torn file)")]
    Checksum,
    #[error("tool map is not a JSON object of strings: {0}")]
    ToolMap(String),
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or([0; 4]))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]))
}

impl Header {
    /// Total file length implied by the header.
    pub fn file_len(&self) -> u64 {
        HEADER_LEN as u64 + 4 * self.n_tokens + self.payload_len + self.tool_map_len
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.flags.to_le_bytes());
        b[16..48].copy_from_slice(&self.model_id);
        b[48] = self.mode.code();
        b[56..64].copy_from_slice(&self.ctx.to_le_bytes());
        b[64..72].copy_from_slice(&self.n_tokens.to_le_bytes());
        b[72..80].copy_from_slice(&self.payload_len.to_le_bytes());
        b[80..88].copy_from_slice(&self.tool_map_len.to_le_bytes());
        b[88..96].copy_from_slice(&self.created.to_le_bytes());
        b[96..128].copy_from_slice(&self.checksum);
        b[128..136].copy_from_slice(&self.last_used.to_le_bytes());
        b[136..144].copy_from_slice(&self.hits.to_le_bytes());
        b
    }

    /// Parses and bounds-checks a header (the checksum is verified with the body).
    pub fn decode(b: &[u8]) -> Result<Header, FormatError> {
        if b.len() < HEADER_LEN {
            return Err(FormatError::Short);
        }
        if b[0..8] != MAGIC {
            return Err(FormatError::Magic);
        }
        let v = u32_at(b, 8);
        if v != VERSION {
            return Err(FormatError::Version(v));
        }
        let mode = Mode::from_code(b[48]).ok_or(FormatError::Mode(b[48]))?;
        let h = Header {
            flags: u32_at(b, 12),
            model_id: b[16..48].try_into().unwrap_or([0; 32]),
            mode,
            ctx: u64_at(b, 56),
            n_tokens: u64_at(b, 64),
            payload_len: u64_at(b, 72),
            tool_map_len: u64_at(b, 80),
            created: u64_at(b, 88),
            checksum: b[96..128].try_into().unwrap_or([0; 32]),
            last_used: u64_at(b, 128),
            hits: u64_at(b, 136),
        };
        for (what, value, limit) in [
            ("token count", h.n_tokens, MAX_TOKENS),
            ("payload bytes", h.payload_len, MAX_PAYLOAD),
            ("tool-map bytes", h.tool_map_len, MAX_TOOL_MAP),
        ] {
            if value > limit {
                return Err(FormatError::Absurd { what, value, limit });
            }
        }
        Ok(h)
    }
}

/// SHA-256 over the immutable header bytes and the body.
pub fn checksum(header: &[u8; HEADER_LEN], body: &[&[u8]]) -> [u8; 32] {
    let mut s = Sha256::new();
    s.update(&header[0..96]);
    for part in body {
        s.update(part);
    }
    s.finalize().into()
}

pub fn tokens_to_bytes(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

pub fn tokens_from_bytes(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Entry file name for a token prefix: SHA-256 of the token ids, hex, `.kv`.
pub fn file_name(tokens: &[u32]) -> String {
    let d: [u8; 32] = Sha256::digest(tokens_to_bytes(tokens)).into();
    let mut s = String::with_capacity(67);
    for byte in d {
        s.push_str(&format!("{byte:02x}"));
    }
    s.push_str(".kv");
    s
}

pub fn is_entry_name(name: &str) -> bool {
    name.len() == 67 && name.ends_with(".kv") && name[..64].bytes().all(|c| c.is_ascii_hexdigit())
}
