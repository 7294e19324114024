//! Feeds arbitrary bytes to the disk KV store as an entry file: the header decoder, the
//! store's open-time index, `load`, `tool_map`, the server's startup tool-map reader and its
//! payload decoder. The bytes are tried as written and once more with the checksum repaired
//! (so mutations reach the token, payload and tool-map parsing behind it). Nothing may panic;
//! a decoded header must re-encode to itself; an entry that loads must store and load again
//! unchanged.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ds4_kvstore::format::{self, Header, HEADER_LEN};
use ds4_kvstore::{KvStore, Mode, StoreConfig};

/// One scratch directory per fuzzing process (tmpfs when there is one: entries are fsynced).
fn scratch() -> &'static Path {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| {
        let shm = Path::new("/dev/shm");
        let base = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        let d = base.join(format!("ds4-fuzz-kvstore-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("scratch directory");
        d
    })
}

fn clear(dir: &Path) {
    if let Ok(rd) = std::fs::read_dir(dir) {
        for item in rd.flatten() {
            let _ = std::fs::remove_file(item.path());
        }
    }
}

/// The entry name the store expects for these bytes: the hash of the tokens they hold, so
/// the file passes the name check and gets indexed (a fixed valid name otherwise).
fn entry_name(data: &[u8], h: Option<&Header>) -> String {
    let tokens = h
        .and_then(|h| {
            let end = HEADER_LEN.checked_add(4 * h.n_tokens as usize)?;
            data.get(HEADER_LEN..end)
        })
        .map(format::tokens_from_bytes)
        .unwrap_or_default();
    format::file_name(&tokens)
}

fn run_one(dir: &Path, data: &[u8]) {
    clear(dir);
    let header = Header::decode(data).ok();
    let name = entry_name(data, header.as_ref());
    assert!(format::is_entry_name(&name));
    std::fs::write(dir.join(&name), data).expect("write entry");

    // The server reads tool maps of every entry at startup, before the store verifies them.
    let _ = ds4_server::diskcache::read_tool_maps(dir);

    // A store for exactly this entry's model, mode and context, so nothing but the bytes
    // themselves can reject it.
    let cfg = StoreConfig {
        dir: dir.to_path_buf(),
        budget_bytes: 1 << 40,
        model_id: data
            .get(16..48)
            .and_then(|b| b.try_into().ok())
            .unwrap_or([0; 32]),
        mode: header.as_ref().map_or(Mode::Exact, |h| h.mode),
        ctx: header.as_ref().map_or(0, |h| h.ctx),
    };
    let Ok((mut store, _rejected)) = KvStore::open(cfg) else {
        return;
    };
    let entries = store.entries().to_vec();
    for e in &entries {
        let _ = store.lookup(&e.tokens);
        let map = store.tool_map(&e.name);
        let Ok(loaded) = store.load(&e.name) else {
            continue;
        };
        assert_eq!(
            loaded.tokens, e.tokens,
            "loaded tokens differ from the indexed ones"
        );
        if let Ok(map) = map {
            assert_eq!(map, loaded.tool_map, "tool_map and load disagree");
        }
        // The shared checkpoint payload: logits + snapshot, with the count each layout
        // claims (the legacy server layout at 8, the current one at 12) and a wrong one.
        for at in [8usize, 12] {
            if let Some(n) = loaded.payload.get(at..at + 8) {
                let n = u64::from_le_bytes(n.try_into().unwrap_or([0; 8]));
                if n <= loaded.payload.len() as u64 {
                    let _ = ds4_runtime::checkpoint::decode(&loaded.payload, n as usize);
                }
            }
        }
        let _ = ds4_runtime::checkpoint::decode(&loaded.payload, 3);
        // Round trip through the writer.
        if !loaded.tokens.is_empty() {
            if let Ok(ds4_kvstore::StoreOutcome::Stored { name, .. }) =
                store.store(&loaded.tokens, &loaded.payload, &loaded.tool_map)
            {
                let again = store.load(&name).expect("a freshly stored entry loads");
                assert_eq!(again, loaded, "store/load round trip changed the entry");
            }
        }
    }
}

/// Recomputes the checksum over the header and body (what a writer would have stored).
fn repaired(data: &[u8]) -> Option<Vec<u8>> {
    if data.len() < HEADER_LEN {
        return None;
    }
    let mut out = data.to_vec();
    let head: [u8; HEADER_LEN] = out[..HEADER_LEN].try_into().ok()?;
    let sum = format::checksum(&head, &[&data[HEADER_LEN..]]);
    if out[96..128] == sum {
        return None;
    }
    out[96..128].copy_from_slice(&sum);
    Some(out)
}

/// The `kvstore_load` fuzz target's entry: panics on a finding.
pub fn kvstore_load(data: &[u8]) {
    if let Ok(h) = Header::decode(data) {
        let re = Header::decode(&h.encode()).expect("an encoded header decodes");
        assert_eq!(re, h, "header must round-trip through encode");
        let _ = h.file_len();
    }
    let dir = scratch();
    run_one(dir, data);
    if let Some(fixed) = repaired(data) {
        run_one(dir, &fixed);
    }
    clear(dir);
}
