//! Named chat sessions on disk (`/save NAME`, `/load NAME`, `/list`), on top of the
//! `ds4-kvstore` checkpoint store.
//!
//! The store keys entries by token prefix (that is what makes them reusable as a cache);
//! names are a small index beside the entries, `ds4-sessions.json`, mapping a name to the
//! entry file and the chat settings of the moment. The store ignores files that are not
//! entries, and the index is replaced atomically (temp file + rename), so a crash leaves the
//! old or the new index, never a torn one. An index row whose entry was evicted or removed
//! (another model, corruption) is reported as gone, not silently dropped.
//!
//! The store is shared with `ds4-server` (same model identity, same payload format,
//! `ds4_runtime::checkpoint`): a server checkpoint has no name here, but `/list` shows it
//! by its entry file name and `/load` takes that name, so a conversation moves from the
//! server to the chat as well as the other way.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use ds4_kvstore::{format::is_entry_name, KvStore, Loaded, Mode, StoreConfig, StoreOutcome};
use serde::{Deserialize, Serialize};

pub const INDEX_FILE: &str = "ds4-sessions.json";
/// An index larger than this is refused (it holds a few lines per session).
const MAX_INDEX_BYTES: u64 = 16 << 20;

/// One named session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Named {
    /// Store entry file name.
    pub entry: String,
    pub tokens: usize,
    /// `nothink`, `think` or `think-max` at save time.
    pub thinking: String,
    pub saved_unix: u64,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Index {
    version: u32,
    sessions: BTreeMap<String, Named>,
}

/// Where sessions live and what they must match.
#[derive(Debug, Clone)]
pub struct DiskSessions {
    pub dir: PathBuf,
    pub budget_bytes: u64,
    pub model_id: [u8; 32],
    pub mode: Mode,
}

/// A row of `/list`.
#[derive(Debug, Clone, PartialEq)]
pub struct ListRow {
    pub name: String,
    pub info: Named,
    /// The entry is still in the store.
    pub present: bool,
}

/// What `/list` shows.
#[derive(Debug, Clone, PartialEq)]
pub struct Listing {
    pub named: Vec<ListRow>,
    /// Store entries not referenced by a name (cache checkpoints, e.g. `ds4-server`'s):
    /// entry file name and token count. `/load` takes the file name.
    pub unnamed: Vec<(String, usize)>,
    pub total_bytes: u64,
    pub budget_bytes: u64,
}

/// Session names: 1–64 of `A-Z a-z 0-9 . _ -`, not starting with a dot (they are keys in a
/// file, shown in listings, and typed at a prompt).
pub fn check_name(name: &str) -> anyhow::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if !ok {
        bail!("invalid session name {name:?}: use 1-64 letters, digits, '.', '_' or '-'");
    }
    Ok(())
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl DiskSessions {
    fn open(&self, ctx: usize) -> anyhow::Result<(KvStore, Vec<String>)> {
        let (store, rejected) = KvStore::open(StoreConfig {
            dir: self.dir.clone(),
            budget_bytes: self.budget_bytes,
            model_id: self.model_id,
            mode: self.mode,
            ctx: ctx as u64,
        })
        .with_context(|| format!("opening the KV store {}", self.dir.display()))?;
        let notes = rejected
            .into_iter()
            .map(|r| format!("removed unusable KV entry {}: {}", r.name, r.reason))
            .collect();
        Ok((store, notes))
    }

    fn index_path(&self) -> PathBuf {
        self.dir.join(INDEX_FILE)
    }

    fn read_index(&self) -> anyhow::Result<Index> {
        let p = self.index_path();
        let meta = match std::fs::metadata(&p) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Index {
                    version: 1,
                    ..Index::default()
                })
            }
            Err(e) => return Err(e).with_context(|| format!("reading {}", p.display())),
        };
        if meta.len() > MAX_INDEX_BYTES {
            bail!(
                "{} is {} bytes, more than an index can be",
                p.display(),
                meta.len()
            );
        }
        let text = std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
        let idx: Index = serde_json::from_slice(&text)
            .with_context(|| format!("{} is not a valid session index", p.display()))?;
        if idx.version != 1 {
            bail!(
                "{}: index version {} is not supported",
                p.display(),
                idx.version
            );
        }
        Ok(idx)
    }

    fn write_index(&self, idx: &Index) -> anyhow::Result<()> {
        let p = self.index_path();
        let tmp = self
            .dir
            .join(format!("{INDEX_FILE}.tmp.{}", std::process::id()));
        let bytes = serde_json::to_vec_pretty(idx)?;
        std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &p).with_context(|| format!("replacing {}", p.display()))?;
        Ok(())
    }

    /// Stores `payload` (a KV snapshot after exactly `tokens`) under `name`. Returns the
    /// lines to show (eviction, removed entries).
    pub fn save(
        &self,
        name: &str,
        tokens: &[u32],
        payload: &[u8],
        ctx: usize,
        thinking: &str,
    ) -> anyhow::Result<Vec<String>> {
        check_name(name)?;
        let (entry, notes) = self.store(tokens, payload, &BTreeMap::new(), ctx)?;
        let mut idx = self.read_index()?;
        idx.version = 1;
        idx.sessions.insert(
            name.to_string(),
            Named {
                entry,
                tokens: tokens.len(),
                thinking: thinking.to_string(),
                saved_unix: now_unix(),
            },
        );
        self.write_index(&idx)?;
        Ok(notes)
    }

    /// Writes one entry (replacing a same-token one): its file name and the notes to show.
    fn store(
        &self,
        tokens: &[u32],
        payload: &[u8],
        tool_map: &BTreeMap<String, String>,
        ctx: usize,
    ) -> anyhow::Result<(String, Vec<String>)> {
        let (mut store, mut notes) = self.open(ctx)?;
        let outcome = store
            .store(tokens, payload, tool_map)
            .context("writing the session")?;
        let entry = match outcome {
            StoreOutcome::Stored { name, evicted } => {
                for e in evicted {
                    notes.push(format!("evicted {e} to stay within the disk budget"));
                }
                name
            }
            StoreOutcome::SkippedTooLarge { needed, budget } => bail!(
                "the session needs {:.1} MiB, more than the whole disk budget of {:.1} MiB \
                 (raise --kv-disk-space-mb)",
                needed as f64 / 1048576.0,
                budget as f64 / 1048576.0
            ),
        };
        Ok((entry, notes))
    }

    /// Rewrites a loaded entry with a new payload (a legacy payload migrated to the current
    /// format), keeping its tokens (so its file name and any index row stay valid) and tool
    /// map.
    pub fn rewrite(&self, entry: &Loaded, payload: &[u8], ctx: usize) -> anyhow::Result<()> {
        self.store(&entry.tokens, payload, &entry.tool_map, ctx)
            .map(|_| ())
    }

    /// Reads session `name` — a saved name, or the file name of any entry in the store —
    /// with its settings when it has a name.
    pub fn load(&self, name: &str, ctx: usize) -> anyhow::Result<(Loaded, Option<Named>)> {
        if is_entry_name(name) {
            return Ok((self.load_entry(name, name, ctx)?, None));
        }
        check_name(name)?;
        let idx = self.read_index()?;
        let Some(info) = idx.sessions.get(name).cloned() else {
            let known: Vec<&str> = idx.sessions.keys().map(String::as_str).collect();
            if known.is_empty() {
                bail!(
                    "no session named {name:?} (none saved in {})",
                    self.dir.display()
                );
            }
            bail!("no session named {name:?} (saved: {})", known.join(", "));
        };
        Ok((self.load_entry(name, &info.entry, ctx)?, Some(info)))
    }

    fn load_entry(&self, name: &str, entry: &str, ctx: usize) -> anyhow::Result<Loaded> {
        let (mut store, _) = self.open(ctx)?;
        let Some(meta) = store.entries().iter().find(|e| e.name == entry).cloned() else {
            bail!(
                "session {name:?} is gone from {}: its KV entry was evicted or removed \
                 (another model or numeric mode, or corruption)",
                self.dir.display()
            );
        };
        // The state restores into any context that holds its tokens (plus room to go on).
        if meta.tokens.len() + 2 > ctx {
            bail!(
                "session {name:?} holds {} tokens; the current context is {ctx} (use /ctx {} first)",
                meta.tokens.len(),
                meta.tokens.len() + 2
            );
        }
        store.load(entry).context("reading the session")
    }

    /// Named sessions and a summary of the store.
    pub fn list(&self, ctx: usize) -> anyhow::Result<(Listing, Vec<String>)> {
        let (store, notes) = self.open(ctx)?;
        let idx = self.read_index()?;
        let mut named = Vec::new();
        for (name, info) in idx.sessions {
            let present = store.entries().iter().any(|e| e.name == info.entry);
            named.push(ListRow {
                name,
                info,
                present,
            });
        }
        let unnamed = store
            .entries()
            .iter()
            .filter(|e| !named.iter().any(|r| r.info.entry == e.name))
            .map(|e| (e.name.clone(), e.tokens.len()))
            .collect();
        Ok((
            Listing {
                named,
                unnamed,
                total_bytes: store.total_bytes(),
                budget_bytes: self.budget_bytes,
            },
            notes,
        ))
    }
}

/// Renders a listing for the terminal.
pub fn render_listing(l: &Listing, dir: &Path) -> String {
    let mut s = String::new();
    if l.named.is_empty() {
        s.push_str(&format!("no saved sessions in {}\n", dir.display()));
    } else {
        s.push_str(&format!("sessions in {}:\n", dir.display()));
        for r in &l.named {
            s.push_str(&format!(
                "  {:<24} {:>8} tokens  {:<9} {}\n",
                r.name,
                r.info.tokens,
                r.info.thinking,
                if r.present {
                    ""
                } else {
                    "(gone: evicted or removed)"
                }
            ));
        }
    }
    for (entry, tokens) in &l.unnamed {
        s.push_str(&format!("  {entry} {tokens:>8} tokens  (checkpoint)\n"));
    }
    s.push_str(&format!(
        "store: {} other checkpoint(s), {:.1} MiB used of {:.1} MiB\n",
        l.unnamed.len(),
        l.total_bytes as f64 / 1048576.0,
        l.budget_bytes as f64 / 1048576.0
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sessions(dir: &Path) -> DiskSessions {
        DiskSessions {
            dir: dir.to_path_buf(),
            budget_bytes: 1 << 20,
            model_id: [7; 32],
            mode: Mode::Exact,
        }
    }

    #[test]
    fn names_are_checked() {
        for ok in ["a", "chat-1", "x.y_z", &"n".repeat(64)] {
            check_name(ok).unwrap();
        }
        for bad in ["", ".hidden", "a/b", "sp ace", &"n".repeat(65), "ü"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn save_list_load_and_gone_entries() {
        let dir = tempfile::tempdir().unwrap();
        let s = sessions(dir.path());
        let (l, _) = s.list(64).unwrap();
        assert!(l.named.is_empty());
        s.save("one", &[1, 2, 3], b"payload-1", 64, "think")
            .unwrap();
        s.save("two", &[1, 2, 3, 4], b"payload-2", 64, "nothink")
            .unwrap();
        let (l, _) = s.list(64).unwrap();
        assert_eq!(l.named.len(), 2);
        assert!(l.named.iter().all(|r| r.present));
        assert!(l.unnamed.is_empty());
        let (e, info) = s.load("two", 64).unwrap();
        assert_eq!(e.tokens, vec![1, 2, 3, 4]);
        assert_eq!(e.payload, b"payload-2");
        assert_eq!(info.unwrap().thinking, "nothink");
        // An entry is also reachable by its file name, without settings.
        let (e, info) = s.load(&ds4_kvstore::file_name(&[1, 2, 3, 4]), 64).unwrap();
        assert_eq!((e.payload.as_slice(), info), (&b"payload-2"[..], None));
        // A smaller context cannot hold a session saved for a larger one.
        let e = s.load("one", 4).unwrap_err().to_string();
        assert!(e.contains("holds 3 tokens") && e.contains("/ctx 5"), "{e}");
        s.load("one", 5).unwrap();
        // Unknown names list what exists.
        let e = s.load("three", 64).unwrap_err().to_string();
        assert!(e.contains("one, two"), "{e}");
        // An entry removed behind the index's back is reported as gone.
        std::fs::remove_file(dir.path().join(ds4_kvstore::file_name(&[1, 2, 3]))).unwrap();
        let (l, _) = s.list(64).unwrap();
        assert!(!l.named.iter().find(|r| r.name == "one").unwrap().present);
        assert!(render_listing(&l, dir.path()).contains("gone"));
        let e = s.load("one", 64).unwrap_err().to_string();
        assert!(e.contains("is gone"), "{e}");
        // Another model's store sees no usable entry for the name.
        let other = DiskSessions {
            model_id: [8; 32],
            ..sessions(dir.path())
        };
        assert!(other.load("two", 64).is_err());
    }

    #[test]
    fn corrupt_index_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(INDEX_FILE), b"{not json").unwrap();
        let e = format!("{:#}", sessions(dir.path()).list(64).unwrap_err());
        assert!(e.contains("not a valid session index"), "{e}");
    }
}
