//! The store: a flat directory of entries, an in-memory index of their headers and tokens,
//! crash-safe writes (temp file, fsync, rename, fsync of the directory) and LRU eviction
//! within a byte budget.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::format::{self, FormatError, Header, Mode, FLAG_TOOL_MAP, HEADER_LEN};

#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error("KV store {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("KV entry {name} rejected and removed: {reason}")]
    Rejected { name: String, reason: String },
    #[error("no KV entry named {0}")]
    NoSuchEntry(String),
    #[error("cannot store: {0}")]
    Invalid(String),
    #[error("unsafe KV cache directory: {0}")]
    UnsafeDir(String),
}

/// Makes sure `dir` can hold the cache safely. A missing directory is created with mode
/// 0700; an existing one is used as it is — its permissions are never changed (the server
/// used to chmod a shared 1777 directory to 0700) — but refused when other users may write
/// to it, since they could plant or swap entries. As ssh does for its files, the directory
/// must belong to the current user (or root), and no directory above it may be
/// world-writable without the sticky bit (anyone could rename it away and put their own in
/// its place).
pub fn prepare_dir(dir: &Path) -> Result<(), KvError> {
    check_ancestors(dir)?;
    match fs::metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut b = fs::DirBuilder::new();
            b.recursive(true);
            #[cfg(unix)]
            {
                use std::os::unix::fs::DirBuilderExt;
                b.mode(0o700);
            }
            b.create(dir).map_err(io(dir))
        }
        Err(e) => Err(KvError::Io {
            path: dir.to_path_buf(),
            source: e,
        }),
        Ok(m) if !m.is_dir() => Err(KvError::UnsafeDir(format!(
            "{} exists and is not a directory",
            dir.display()
        ))),
        Ok(_m) => {
            #[cfg(unix)]
            {
                use std::os::unix::fs::{MetadataExt, PermissionsExt};
                let mode = _m.permissions().mode() & 0o7777;
                if mode & 0o022 != 0 {
                    return Err(KvError::UnsafeDir(format!(
                        "{} is writable by other users (mode {mode:o}), who could plant or replace cache entries; use a private directory (a missing one is created with mode 0700)",
                        dir.display()
                    )));
                }
                let me = current_uid();
                if _m.uid() != me && _m.uid() != 0 {
                    return Err(KvError::UnsafeDir(format!(
                        "{} belongs to user id {}, not to this user (id {me}); its owner could plant or replace cache entries; use a directory of your own",
                        dir.display(),
                        _m.uid()
                    )));
                }
            }
            Ok(())
        }
    }
}

#[cfg(unix)]
fn current_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Refuses a path below a world-writable directory without the sticky bit (`/tmp` has it:
/// there, only a directory's owner may rename or remove it). The existing directories
/// above `dir` are checked, after resolving symlinks.
fn check_ancestors(dir: &Path) -> Result<(), KvError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let abs = if dir.is_absolute() {
            dir.to_path_buf()
        } else {
            std::env::current_dir().map_err(io(dir))?.join(dir)
        };
        // The deepest existing ancestor, resolved; a missing tail is created below it.
        let mut at = abs.parent();
        while let Some(p) = at {
            if let Ok(real) = fs::canonicalize(p) {
                for a in real.ancestors() {
                    let m = fs::metadata(a).map_err(io(a))?;
                    let mode = m.permissions().mode() & 0o7777;
                    if mode & 0o002 != 0 && mode & 0o1000 == 0 {
                        return Err(KvError::UnsafeDir(format!(
                            "{} is inside {}, which any user may write to (mode {mode:o}, no sticky bit) and so rename the cache directory away and put their own in its place; use a directory under a private parent",
                            dir.display(),
                            a.display()
                        )));
                    }
                }
                break;
            }
            at = p.parent();
        }
    }
    let _ = dir;
    Ok(())
}

/// Opens an existing entry file without following a symlink and without blocking on a FIFO,
/// and only if it is a regular file (checked on the opened descriptor, so a swap between
/// check and use cannot redirect it). Every entry read or write goes through here, so the
/// store never touches anything outside its directory.
pub fn open_entry(path: &Path, write: bool) -> std::io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(!write).write(write);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
    }
    let f = o.open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    Ok(f)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> KvError + '_ {
    move |source| KvError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What the store is for: entries from another model or mode are never loaded.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub dir: PathBuf,
    /// Upper bound on the bytes of all entries together.
    pub budget_bytes: u64,
    /// SHA-256 of the model's metadata and tensor table.
    pub model_id: [u8; 32],
    pub mode: Mode,
    /// The live context size: entries made for a larger context cannot be restored.
    pub ctx: u64,
}

/// An entry as indexed at open / after a store.
#[derive(Debug, Clone)]
pub struct EntryMeta {
    pub name: String,
    pub tokens: Vec<u32>,
    pub file_len: u64,
    pub ctx: u64,
    pub mode: Mode,
    pub created: u64,
    pub last_used: u64,
    pub hits: u64,
}

/// A file that was found unusable and removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    pub name: String,
    pub reason: String,
}

/// A restored entry.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    pub tokens: Vec<u32>,
    pub payload: Vec<u8>,
    pub tool_map: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreOutcome {
    Stored {
        name: String,
        evicted: Vec<String>,
    },
    /// The entry alone is larger than the whole budget.
    SkippedTooLarge {
        needed: u64,
        budget: u64,
    },
}

pub struct KvStore {
    cfg: StoreConfig,
    entries: Vec<EntryMeta>,
}

/// Milliseconds since the epoch: fine enough that LRU order within one second is kept.
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

impl KvStore {
    /// Opens (creating) the directory, removes temp files of dead writers, indexes every
    /// entry and removes the ones that can never be loaded (other model or format version,
    /// corrupt or truncated header). Returns the removed files so the caller can report them.
    pub fn open(cfg: StoreConfig) -> Result<(KvStore, Vec<Rejected>), KvError> {
        prepare_dir(&cfg.dir)?;
        let mut entries = Vec::new();
        let mut rejected = Vec::new();
        for item in fs::read_dir(&cfg.dir).map_err(io(&cfg.dir))? {
            let item = item.map_err(io(&cfg.dir))?;
            let name = item.file_name().to_string_lossy().into_owned();
            let path = item.path();
            if let Some(pid) = tmp_owner(&name) {
                if !pid_alive(pid) {
                    let _ = fs::remove_file(&path);
                }
                continue;
            }
            if !format::is_entry_name(&name) {
                continue;
            }
            // Symlinks, FIFOs, devices, directories: never opened (a FIFO hung startup).
            if !item.file_type().is_ok_and(|t| t.is_file()) {
                tracing::warn!(entry = %name, "ignoring a KV entry name that is not a regular file");
                continue;
            }
            match index_entry(&path, &name, &cfg) {
                Ok(meta) => entries.push(meta),
                Err(reason) => {
                    tracing::warn!(entry = %name, %reason, "removing unusable KV entry");
                    let _ = fs::remove_file(&path);
                    rejected.push(Rejected { name, reason });
                }
            }
        }
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        let mut store = KvStore { cfg, entries };
        store.evict_to(store.cfg.budget_bytes, None)?;
        Ok((store, rejected))
    }

    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    pub fn entries(&self) -> &[EntryMeta] {
        &self.entries
    }

    pub fn total_bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.file_len).sum()
    }

    fn usable(&self, e: &EntryMeta) -> bool {
        e.mode == self.cfg.mode && e.ctx <= self.cfg.ctx
    }

    /// The entry holding the longest stored prefix of `tokens` (ties: most recently used).
    pub fn lookup(&self, tokens: &[u32]) -> Option<&EntryMeta> {
        self.entries
            .iter()
            .filter(|e| self.usable(e) && tokens.starts_with(&e.tokens))
            .max_by_key(|e| (e.tokens.len(), e.last_used))
    }

    fn path(&self, name: &str) -> PathBuf {
        self.cfg.dir.join(name)
    }

    /// Reads and verifies an entry. A corrupt or truncated file is removed and reported;
    /// a good one has its hit count and last-used time updated in place.
    pub fn load(&mut self, name: &str) -> Result<Loaded, KvError> {
        let idx = self
            .entries
            .iter()
            .position(|e| e.name == name)
            .ok_or_else(|| KvError::NoSuchEntry(name.to_string()))?;
        let path = self.path(name);
        match read_verified(&path, &self.cfg) {
            Ok((header, loaded)) => {
                let e = &mut self.entries[idx];
                // The counters are outside the checksum: a torn or corrupt one may hold
                // anything, including u64::MAX.
                e.hits = header.hits.saturating_add(1);
                e.last_used = now_ms().max(e.last_used.saturating_add(1));
                let _ = update_counters(&path, e.last_used, e.hits);
                Ok(loaded)
            }
            Err(reason) => {
                tracing::warn!(entry = %name, %reason, "removing corrupt KV entry");
                let _ = fs::remove_file(&path);
                self.entries.remove(idx);
                Err(KvError::Rejected {
                    name: name.to_string(),
                    reason,
                })
            }
        }
    }

    /// The tool-call map of an entry (empty if it has none), verified against the entry's
    /// checksum without keeping the payload: the file is hashed in one streaming pass, so
    /// reading the maps of a large cache at startup needs little memory. A server must not
    /// replay DSML from a torn or tampered file, so a corrupt entry is removed and reported
    /// exactly as [`KvStore::load`] does.
    pub fn tool_map(&mut self, name: &str) -> Result<BTreeMap<String, String>, KvError> {
        let idx = self
            .entries
            .iter()
            .position(|e| e.name == name)
            .ok_or_else(|| KvError::NoSuchEntry(name.to_string()))?;
        let path = self.path(name);
        match read_tool_map_verified(&path, &self.cfg) {
            Ok(map) => Ok(map),
            Err(reason) => {
                tracing::warn!(entry = %name, %reason, "removing corrupt KV entry");
                let _ = fs::remove_file(&path);
                self.entries.remove(idx);
                Err(KvError::Rejected {
                    name: name.to_string(),
                    reason,
                })
            }
        }
    }

    /// Stores the state after `tokens`. Evicts least-recently-used entries first so the
    /// directory never exceeds the budget, then writes atomically.
    pub fn store(
        &mut self,
        tokens: &[u32],
        payload: &[u8],
        tool_map: &BTreeMap<String, String>,
    ) -> Result<StoreOutcome, KvError> {
        if tokens.is_empty() {
            return Err(KvError::Invalid("an entry needs at least one token".into()));
        }
        if tokens.len() as u64 > format::MAX_TOKENS {
            return Err(KvError::Invalid(format!(
                "{} tokens exceed the format limit {}",
                tokens.len(),
                format::MAX_TOKENS
            )));
        }
        let map_bytes = if tool_map.is_empty() {
            Vec::new()
        } else {
            serde_json::to_vec(tool_map).map_err(|e| KvError::Invalid(e.to_string()))?
        };
        let name = format::file_name(tokens);
        let now = now_ms();
        let mut header = Header {
            flags: if map_bytes.is_empty() {
                0
            } else {
                FLAG_TOOL_MAP
            },
            model_id: self.cfg.model_id,
            mode: self.cfg.mode,
            ctx: self.cfg.ctx,
            n_tokens: tokens.len() as u64,
            payload_len: payload.len() as u64,
            tool_map_len: map_bytes.len() as u64,
            created: now,
            checksum: [0; 32],
            last_used: now,
            hits: 0,
        };
        let needed = header.file_len();
        if needed > self.cfg.budget_bytes {
            return Ok(StoreOutcome::SkippedTooLarge {
                needed,
                budget: self.cfg.budget_bytes,
            });
        }
        // A same-key entry is replaced: its bytes do not count against the new one.
        let replaced = self.entries.iter().position(|e| e.name == name);
        let replaced_len = replaced.map(|i| self.entries[i].file_len).unwrap_or(0);
        let mut evicted =
            self.evict_to(self.cfg.budget_bytes + replaced_len - needed, Some(&name))?;
        let token_bytes = format::tokens_to_bytes(tokens);
        let head = header.encode();
        header.checksum = format::checksum(&head, &[&token_bytes, payload, &map_bytes]);
        let head = header.encode();
        let final_path = self.path(&name);
        let tmp = self
            .cfg
            .dir
            .join(format!("{name}.tmp.{}.{}", std::process::id(), now));
        let write = || -> std::io::Result<()> {
            let mut o = OpenOptions::new();
            // A new file only: never write through something planted at the temp name.
            o.write(true).create_new(true);
            #[cfg(unix)]
            {
                use std::os::unix::fs::OpenOptionsExt;
                o.mode(0o600).custom_flags(libc::O_NOFOLLOW);
            }
            let mut f = o.open(&tmp)?;
            f.write_all(&head)?;
            f.write_all(&token_bytes)?;
            f.write_all(payload)?;
            f.write_all(&map_bytes)?;
            f.sync_all()?;
            fs::rename(&tmp, &final_path)?;
            File::open(&self.cfg.dir)?.sync_all()
        };
        if let Err(e) = write() {
            let _ = fs::remove_file(&tmp);
            return Err(KvError::Io {
                path: final_path,
                source: e,
            });
        }
        if let Some(i) = self.entries.iter().position(|e| e.name == name) {
            self.entries.remove(i);
        }
        self.entries.push(EntryMeta {
            name: name.clone(),
            tokens: tokens.to_vec(),
            file_len: needed,
            ctx: self.cfg.ctx,
            mode: self.cfg.mode,
            created: now,
            last_used: now,
            hits: 0,
        });
        evicted.retain(|e| *e != name);
        Ok(StoreOutcome::Stored { name, evicted })
    }

    /// Removes an entry.
    pub fn remove(&mut self, name: &str) -> Result<(), KvError> {
        let i = self
            .entries
            .iter()
            .position(|e| e.name == name)
            .ok_or_else(|| KvError::NoSuchEntry(name.to_string()))?;
        let path = self.path(name);
        fs::remove_file(&path).map_err(io(&path))?;
        self.entries.remove(i);
        Ok(())
    }

    /// Evicts least-recently-used entries (never `protect`) until the total is <= `limit`.
    fn evict_to(&mut self, limit: u64, protect: Option<&str>) -> Result<Vec<String>, KvError> {
        let mut evicted = Vec::new();
        while self.total_bytes() > limit {
            let victim = self
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| Some(e.name.as_str()) != protect)
                .min_by_key(|(_, e)| (e.last_used, e.created))
                .map(|(i, _)| i);
            let Some(i) = victim else { break };
            let e = self.entries.remove(i);
            let path = self.path(&e.name);
            if let Err(err) = fs::remove_file(&path) {
                if err.kind() != std::io::ErrorKind::NotFound {
                    return Err(KvError::Io { path, source: err });
                }
            }
            evicted.push(e.name);
        }
        Ok(evicted)
    }
}

/// `<entry>.tmp.<pid>.<stamp>` → pid.
fn tmp_owner(name: &str) -> Option<u32> {
    let (_, rest) = name.split_once(".kv.tmp.")?;
    rest.split('.').next()?.parse().ok()
}

/// Reads the header and tokens only (cheap), checking identity and length.
fn index_entry(path: &Path, name: &str, cfg: &StoreConfig) -> Result<EntryMeta, String> {
    let mut f = open_entry(path, false).map_err(|e| e.to_string())?;
    let len = f.metadata().map_err(|e| e.to_string())?.len();
    let mut head = [0u8; HEADER_LEN];
    f.read_exact(&mut head)
        .map_err(|_| FormatError::Short.to_string())?;
    let h = Header::decode(&head).map_err(|e| e.to_string())?;
    if h.model_id != cfg.model_id {
        return Err("made by another model (identity differs)".into());
    }
    if h.file_len() != len {
        return Err(FormatError::Length {
            expected: h.file_len(),
            actual: len,
        }
        .to_string());
    }
    let mut tb = vec![0u8; (4 * h.n_tokens) as usize];
    f.read_exact(&mut tb).map_err(|e| e.to_string())?;
    let tokens = format::tokens_from_bytes(&tb);
    if format::file_name(&tokens) != name {
        return Err("file name does not match its tokens".into());
    }
    Ok(EntryMeta {
        name: name.to_string(),
        tokens,
        file_len: len,
        ctx: h.ctx,
        mode: h.mode,
        created: h.created,
        last_used: h.last_used,
        hits: h.hits,
    })
}

fn read_verified(path: &Path, cfg: &StoreConfig) -> Result<(Header, Loaded), String> {
    let mut bytes = Vec::new();
    open_entry(path, false)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|e| e.to_string())?;
    let h = Header::decode(&bytes).map_err(|e| e.to_string())?;
    if h.model_id != cfg.model_id {
        return Err("made by another model (identity differs)".into());
    }
    if h.file_len() != bytes.len() as u64 {
        return Err(FormatError::Length {
            expected: h.file_len(),
            actual: bytes.len() as u64,
        }
        .to_string());
    }
    let t_end = HEADER_LEN + 4 * h.n_tokens as usize;
    let p_end = t_end + h.payload_len as usize;
    let head: [u8; HEADER_LEN] = bytes[..HEADER_LEN].try_into().map_err(|_| "short")?;
    let sum = format::checksum(&head, &[&bytes[HEADER_LEN..]]);
    if sum != h.checksum {
        return Err(FormatError::Checksum.to_string());
    }
    let tool_map = if h.flags & FLAG_TOOL_MAP != 0 {
        serde_json::from_slice(&bytes[p_end..])
            .map_err(|e| FormatError::ToolMap(e.to_string()).to_string())?
    } else {
        BTreeMap::new()
    };
    Ok((
        h.clone(),
        Loaded {
            tokens: format::tokens_from_bytes(&bytes[HEADER_LEN..t_end]),
            payload: bytes[t_end..p_end].to_vec(),
            tool_map,
        },
    ))
}

/// Streams an entry through the checksum and returns its tool map (see [`KvStore::tool_map`]).
fn read_tool_map_verified(
    path: &Path,
    cfg: &StoreConfig,
) -> Result<BTreeMap<String, String>, String> {
    use sha2::{Digest, Sha256};
    let mut f = open_entry(path, false).map_err(|e| e.to_string())?;
    let len = f.metadata().map_err(|e| e.to_string())?.len();
    let mut head = [0u8; HEADER_LEN];
    f.read_exact(&mut head)
        .map_err(|_| FormatError::Short.to_string())?;
    let h = Header::decode(&head).map_err(|e| e.to_string())?;
    if h.model_id != cfg.model_id {
        return Err("made by another model (identity differs)".into());
    }
    if h.file_len() != len {
        return Err(FormatError::Length {
            expected: h.file_len(),
            actual: len,
        }
        .to_string());
    }
    let mut hasher = Sha256::new();
    hasher.update(&head[0..96]);
    // Tokens and payload: hashed, not kept.
    let mut rest = len - HEADER_LEN as u64 - h.tool_map_len;
    let mut buf = vec![0u8; 1 << 20];
    while rest > 0 {
        let n = rest.min(buf.len() as u64) as usize;
        f.read_exact(&mut buf[..n]).map_err(|e| e.to_string())?;
        hasher.update(&buf[..n]);
        rest -= n as u64;
    }
    // The map: its length is bounded by the file's actual size (checked above), and the
    // buffer only grows as bytes really arrive.
    let mut map_bytes = Vec::new();
    (&mut f)
        .take(h.tool_map_len)
        .read_to_end(&mut map_bytes)
        .map_err(|e| e.to_string())?;
    if map_bytes.len() as u64 != h.tool_map_len {
        return Err(FormatError::Length {
            expected: h.file_len(),
            actual: len,
        }
        .to_string());
    }
    hasher.update(&map_bytes);
    let sum: [u8; 32] = hasher.finalize().into();
    if sum != h.checksum {
        return Err(FormatError::Checksum.to_string());
    }
    if h.flags & FLAG_TOOL_MAP == 0 {
        return Ok(BTreeMap::new());
    }
    serde_json::from_slice(&map_bytes).map_err(|e| FormatError::ToolMap(e.to_string()).to_string())
}

/// Rewrites the mutable counters in place (outside the checksum).
fn update_counters(path: &Path, last_used: u64, hits: u64) -> std::io::Result<()> {
    let mut f = open_entry(path, true)?;
    f.seek(SeekFrom::Start(128))?;
    f.write_all(&last_used.to_le_bytes())?;
    f.write_all(&hits.to_le_bytes())?;
    f.sync_data()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `kvstore_load` fuzz target: the hit and last-used counters live outside
    /// the checksum, so an entry whose counters read u64::MAX is still valid and must load
    /// (it used to panic on `hits + 1` with overflow checks on).
    #[test]
    fn saturated_counters_load_without_overflow() {
        let d = tempfile::tempdir().unwrap();
        let cfg = StoreConfig {
            dir: d.path().to_path_buf(),
            budget_bytes: 1 << 20,
            model_id: [3; 32],
            mode: Mode::Exact,
            ctx: 4096,
        };
        let (mut s, _) = KvStore::open(cfg.clone()).unwrap();
        let StoreOutcome::Stored { name, .. } =
            s.store(&[1, 2, 3], b"payload", &BTreeMap::new()).unwrap()
        else {
            panic!("not stored");
        };
        drop(s);
        update_counters(&d.path().join(&name), u64::MAX, u64::MAX).unwrap();
        let (mut s, rejected) = KvStore::open(cfg).unwrap();
        assert!(rejected.is_empty());
        let l = s.load(&name).unwrap();
        assert_eq!(l.payload, b"payload");
        let e = s.entries().iter().find(|e| e.name == name).unwrap();
        assert_eq!((e.hits, e.last_used), (u64::MAX, u64::MAX));
    }
}
