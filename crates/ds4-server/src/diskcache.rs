//! The server's use of the disk KV store (docs/server.md §9, §11): what a checkpoint payload holds,
//! which entry serves a prompt, and reading tool maps back at startup.
//!
//! `ds4-kvstore` owns durability, identity, integrity and the space budget; entries are
//! keyed by token ids. ds4 keys by rendered bytes instead; we get the same effect by
//! matching an entry when its tokens are a token prefix of the prompt *or* decode to a byte
//! prefix of the rendered prompt (then the rest is tokenized on its own, docs/chat.md §4.4).

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use ds4_chat::Tokenizer;

use crate::request::Prepared;
use ds4_kvstore::format::{self, Header, FLAG_TOOL_MAP, HEADER_LEN};

const PAYLOAD_MAGIC: &[u8; 8] = b"DS4SRV1\0";
/// Tool maps larger than this are not read back at startup (replay is an optimisation).
const MAX_TOOL_MAP_READ: u64 = 64 << 20;

/// A checkpoint payload: the next-token logits (so a prompt that ends exactly at the
/// checkpoint needs no evaluation) followed by the engine's state snapshot.
pub fn encode_payload(logits: &[f32], snapshot: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + 4 * logits.len() + snapshot.len());
    out.extend_from_slice(PAYLOAD_MAGIC);
    out.extend_from_slice(&(logits.len() as u64).to_le_bytes());
    for v in logits {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(snapshot);
    out
}

/// Splits a payload into (logits, snapshot bytes); `n_vocab` bounds what the header may
/// claim.
pub fn decode_payload(payload: &[u8], n_vocab: usize) -> Result<(Vec<f32>, Vec<u8>), String> {
    if payload.len() < 16 || &payload[..8] != PAYLOAD_MAGIC {
        return Err("not a ds4-server checkpoint payload".into());
    }
    let n = u64::from_le_bytes(payload[8..16].try_into().map_err(|_| "short")?);
    if n != n_vocab as u64 {
        return Err(format!("{n} logits, the model has {n_vocab}"));
    }
    let end = 16 + 4 * n_vocab;
    if payload.len() < end {
        return Err("payload truncated".into());
    }
    let logits = payload[16..end]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok((logits, payload[end..].to_vec()))
}

/// How a candidate prefix (live state, snapshot or disk entry) continues into a prompt:
/// the tokens to evaluate after it, or `None` if it is not a prefix.
pub fn continuation(tok: &Tokenizer, prefix: &[u32], p: &Prepared) -> Option<Vec<u32>> {
    if prefix.is_empty() {
        return None;
    }
    if p.tokens.starts_with(prefix) {
        return Some(p.tokens[prefix.len()..].to_vec());
    }
    let bytes = tok.decode(prefix).ok()?;
    if bytes.len() <= p.text.len()
        && p.text.as_bytes().starts_with(&bytes)
        && p.text.is_char_boundary(bytes.len())
    {
        // Same special-token policy as the prompt: markers only where the renderer wrote them.
        return p.suffix_tokens(tok, bytes.len()).ok();
    }
    None
}

/// Reads the tool maps of every entry that has one, without reading payloads (so replay of
/// tool calls survives restarts, docs/server.md §10). Unreadable maps are skipped: the entry itself is
/// verified by its checksum when it is loaded.
pub fn read_tool_maps(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for item in rd.flatten() {
        let name = item.file_name().to_string_lossy().into_owned();
        if !format::is_entry_name(&name) {
            continue;
        }
        if let Some(map) = read_tool_map(&item.path()) {
            out.extend(map);
        }
    }
    out
}

fn read_tool_map(path: &Path) -> Option<BTreeMap<String, String>> {
    let mut f = ds4_kvstore::open_entry(path, false).ok()?;
    let mut head = [0u8; HEADER_LEN];
    f.read_exact(&mut head).ok()?;
    let h = Header::decode(&head).ok()?;
    if h.flags & FLAG_TOOL_MAP == 0 || h.tool_map_len == 0 || h.tool_map_len > MAX_TOOL_MAP_READ {
        return None;
    }
    let len = f.metadata().ok()?.len();
    if len != h.file_len() {
        return None;
    }
    f.seek(SeekFrom::Start(h.file_len() - h.tool_map_len))
        .ok()?;
    let mut buf = vec![0u8; h.tool_map_len as usize];
    f.read_exact(&mut buf).ok()?;
    serde_json::from_slice(&buf).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_round_trip_and_rejects() {
        let p = encode_payload(&[1.0, -2.5, 3.0], b"SNAP");
        let (l, s) = decode_payload(&p, 3).unwrap();
        assert_eq!(l, vec![1.0, -2.5, 3.0]);
        assert_eq!(s, b"SNAP");
        assert!(decode_payload(&p, 4).is_err());
        assert!(decode_payload(&p[..20], 3).is_err());
        assert!(decode_payload(b"garbage garbage garbage", 3).is_err());
    }
}
