//! The server's use of the disk KV store (docs/server.md §9, §11): which entry serves a prompt, and
//! reading tool maps back at startup. The payload format is `ds4_runtime::checkpoint`,
//! shared with the `ds4` chat's `/save`.
//!
//! `ds4-kvstore` owns durability, identity, integrity and the space budget; entries are
//! keyed by token ids. ds4 keys by rendered bytes instead; we get the same effect by
//! matching an entry when its tokens are a token prefix of the prompt *or* decode to a byte
//! prefix of the rendered prompt (then the rest is tokenized on its own, docs/chat.md §4.4).

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use ds4_chat::Tokenizer;

use crate::prepare::Prepared;
use ds4_kvstore::format::{self, Header, FLAG_TOOL_MAP, HEADER_LEN};

/// Tool maps larger than this are not read back at startup (replay is an optimisation).
const MAX_TOOL_MAP_READ: u64 = 64 << 20;

/// How a candidate prefix (live state, snapshot or disk entry) continues into a prompt:
/// the tokens to evaluate after it, or `None` if it is not a prefix.
pub fn continuation(tok: &Tokenizer, prefix: &[u32], p: &Prepared) -> Option<Vec<u32>> {
    // Same special-token policy as the prompt: markers only where the renderer wrote them.
    ds4_runtime::driver::continuation(tok, prefix, &p.tokens, &p.text, |at| {
        p.suffix_tokens(tok, at).ok()
    })
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
