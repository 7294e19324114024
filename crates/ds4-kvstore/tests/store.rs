//! KV store behaviour: round trip, longest-prefix lookup, LRU eviction within budget,
//! refusal of foreign/corrupt/truncated files, and crash safety under SIGKILL.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use ds4_kvstore::{KvStore, Mode, StoreConfig, StoreOutcome};

fn cfg(dir: &Path, budget: u64) -> StoreConfig {
    StoreConfig {
        dir: dir.to_path_buf(),
        budget_bytes: budget,
        model_id: [7; 32],
        mode: Mode::Official,
        ctx: 65536,
    }
}

fn payload(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(17) ^ seed).collect()
}

#[test]
fn store_lookup_load_round_trip() {
    let d = tempfile::tempdir().unwrap();
    let (mut s, rejected) = KvStore::open(cfg(d.path(), 1 << 30)).unwrap();
    assert!(rejected.is_empty());
    let mut map = BTreeMap::new();
    map.insert(
        "call_1".to_string(),
        "<｜DSML｜invoke name=\"x\">".to_string(),
    );
    s.store(&[1, 2, 3], &payload(1000, 1), &BTreeMap::new())
        .unwrap();
    s.store(&[1, 2, 3, 4, 5], &payload(2000, 2), &map).unwrap();
    s.store(&[9, 9], &payload(10, 3), &BTreeMap::new()).unwrap();
    // Longest stored prefix wins; a non-prefix is never returned.
    assert_eq!(
        s.lookup(&[1, 2, 3, 4, 5, 6]).unwrap().tokens,
        vec![1, 2, 3, 4, 5]
    );
    assert_eq!(s.lookup(&[1, 2, 3, 4]).unwrap().tokens, vec![1, 2, 3]);
    assert!(s.lookup(&[2, 3]).is_none());
    // Survives reopening (a restarted server).
    drop(s);
    let (mut s, rejected) = KvStore::open(cfg(d.path(), 1 << 30)).unwrap();
    assert!(rejected.is_empty());
    let name = s.lookup(&[1, 2, 3, 4, 5, 6]).unwrap().name.clone();
    let l = s.load(&name).unwrap();
    assert_eq!(l.tokens, vec![1, 2, 3, 4, 5]);
    assert_eq!(l.payload, payload(2000, 2));
    assert_eq!(l.tool_map, map);
    assert_eq!(s.entries().iter().find(|e| e.name == name).unwrap().hits, 1);
    // Entries of another mode or a larger context are not offered.
    let mut c = cfg(d.path(), 1 << 30);
    c.mode = Mode::Exact;
    let (s2, _) = KvStore::open(c).unwrap();
    assert!(s2.lookup(&[1, 2, 3, 4, 5]).is_none());
    let mut c = cfg(d.path(), 1 << 30);
    c.ctx = 1024;
    let (s3, _) = KvStore::open(c).unwrap();
    assert!(s3.lookup(&[1, 2, 3]).is_none());
}

/// `tool_map` returns exactly what was stored, verified: a flipped byte anywhere (payload
/// or map) makes it fail and removes the entry; entries without a map give an empty one.
#[test]
fn tool_map_is_read_verified() {
    let d = tempfile::tempdir().unwrap();
    let (mut s, _) = KvStore::open(cfg(d.path(), 1 << 30)).unwrap();
    let mut map = BTreeMap::new();
    map.insert(
        "call_a".to_string(),
        "\n\n<｜DSML｜tool_calls>A".to_string(),
    );
    map.insert(
        "toolu_b".to_string(),
        "\n\n<｜DSML｜tool_calls>B".to_string(),
    );
    // A payload over the 1 MiB streaming buffer, so the hash is fed in several pieces.
    let big = payload(3 << 20, 5);
    let with = match s.store(&[4, 5, 6], &big, &map).unwrap() {
        StoreOutcome::Stored { name, .. } => name,
        other => panic!("{other:?}"),
    };
    let without = match s.store(&[7], &payload(10, 1), &BTreeMap::new()).unwrap() {
        StoreOutcome::Stored { name, .. } => name,
        other => panic!("{other:?}"),
    };
    drop(s);
    let (mut s, _) = KvStore::open(cfg(d.path(), 1 << 30)).unwrap();
    assert_eq!(s.tool_map(&with).unwrap(), map);
    assert!(s.tool_map(&without).unwrap().is_empty());
    assert!(matches!(
        s.tool_map("nope.kv"),
        Err(ds4_kvstore::KvError::NoSuchEntry(_))
    ));
    // Reading the map does not count as a use.
    assert_eq!(s.entries().iter().find(|e| e.name == with).unwrap().hits, 0);
    // Corrupt one payload byte: the map is refused and the entry removed.
    let path = d.path().join(&with);
    let mut b = std::fs::read(&path).unwrap();
    b[160 + 12 + (2 << 20)] ^= 0x40;
    std::fs::write(&path, &b).unwrap();
    assert!(matches!(
        s.tool_map(&with),
        Err(ds4_kvstore::KvError::Rejected { .. })
    ));
    assert!(!path.exists());
    assert!(s.entries().iter().all(|e| e.name != with));
    // Corrupt the map itself (last byte) of a fresh entry: refused too.
    let name = match s.store(&[8, 8], &payload(100, 2), &map).unwrap() {
        StoreOutcome::Stored { name, .. } => name,
        other => panic!("{other:?}"),
    };
    let path = d.path().join(&name);
    let mut b = std::fs::read(&path).unwrap();
    let n = b.len();
    b[n - 3] ^= 0x01;
    std::fs::write(&path, &b).unwrap();
    assert!(s.tool_map(&name).is_err());
    assert!(!path.exists());
}

#[test]
fn lru_eviction_keeps_the_budget() {
    let d = tempfile::tempdir().unwrap();
    let entry = 160 + 4 + 10_000;
    let (mut s, _) = KvStore::open(cfg(d.path(), 3 * entry + 10)).unwrap();
    for t in 0..3u32 {
        s.store(&[t], &payload(10_000, t as u8), &BTreeMap::new())
            .unwrap();
        std::thread::sleep(Duration::from_millis(3));
    }
    // Touch entry 0 so entry 1 is the least recently used.
    let n0 = s.lookup(&[0]).unwrap().name.clone();
    s.load(&n0).unwrap();
    let out = s
        .store(&[3], &payload(10_000, 3), &BTreeMap::new())
        .unwrap();
    match out {
        StoreOutcome::Stored { evicted, .. } => {
            assert_eq!(evicted, vec![ds4_kvstore::file_name(&[1])]);
        }
        other => panic!("{other:?}"),
    }
    assert!(s.total_bytes() <= 3 * entry + 10);
    assert!(s.lookup(&[1]).is_none() && s.lookup(&[0]).is_some());
    // Too large for the whole budget: skipped, nothing evicted.
    let big = s
        .store(&[4], &payload(100_000, 4), &BTreeMap::new())
        .unwrap();
    assert!(matches!(big, StoreOutcome::SkippedTooLarge { .. }));
    assert_eq!(s.entries().len(), 3);
    // Shrinking the budget evicts at open.
    drop(s);
    let (s, _) = KvStore::open(cfg(d.path(), entry)).unwrap();
    assert_eq!(s.entries().len(), 1);
}

#[test]
fn foreign_corrupt_and_truncated_files_are_reported_once_and_removed() {
    let d = tempfile::tempdir().unwrap();
    let (mut s, _) = KvStore::open(cfg(d.path(), 1 << 30)).unwrap();
    for t in 0..4u32 {
        s.store(&[t, t], &payload(5000, t as u8), &BTreeMap::new())
            .unwrap();
    }
    let path = |t: u32| d.path().join(ds4_kvstore::file_name(&[t, t]));
    // 0: another model; 1: truncated; 2: a flipped payload byte; 3: a future format version.
    let mut b = std::fs::read(path(0)).unwrap();
    b[16] ^= 1;
    std::fs::write(path(0), &b).unwrap();
    let b = std::fs::read(path(1)).unwrap();
    std::fs::write(path(1), &b[..b.len() - 7]).unwrap();
    let mut b = std::fs::read(path(2)).unwrap();
    let n = b.len();
    b[n - 100] ^= 0x40;
    std::fs::write(path(2), &b).unwrap();
    let mut b = std::fs::read(path(3)).unwrap();
    b[8] = 2;
    std::fs::write(path(3), &b).unwrap();
    // Junk with an entry-like name, and an unrelated file that must be left alone.
    std::fs::write(d.path().join(format!("{}.kv", "a".repeat(64))), b"garbage").unwrap();
    std::fs::write(d.path().join("notes.txt"), b"keep me").unwrap();
    drop(s);
    let (mut s, rejected) = KvStore::open(cfg(d.path(), 1 << 30)).unwrap();
    let reasons: Vec<String> = rejected.iter().map(|r| r.reason.clone()).collect();
    assert_eq!(rejected.len(), 4, "{reasons:?}");
    assert!(reasons.iter().any(|r| r.contains("another model")));
    assert!(reasons.iter().any(|r| r.contains("header implies")));
    assert!(reasons.iter().any(|r| r.contains("version 2")));
    assert!(reasons.iter().any(|r| r.contains("shorter than")));
    assert!(!path(0).exists() && !path(1).exists() && !path(3).exists());
    // The payload corruption is only visible on load: rejected, removed, never returned.
    let name = s.lookup(&[2, 2]).unwrap().name.clone();
    let e = s.load(&name).unwrap_err().to_string();
    assert!(e.contains("checksum"), "{e}");
    assert!(!path(2).exists() && s.lookup(&[2, 2]).is_none());
    assert!(d.path().join("notes.txt").exists());
    // Reported once: a second open finds nothing more to reject.
    let (_, again) = KvStore::open(cfg(d.path(), 1 << 30)).unwrap();
    assert!(again.is_empty());
}

#[test]
fn sigkilled_writers_never_leave_an_entry_that_loads_wrong() {
    let d = tempfile::tempdir().unwrap();
    let budget: u64 = 6 << 20;
    let bin = env!("CARGO_BIN_EXE_ds4-kvstore-crash-writer");
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut loaded_ok = 0usize;
    let mut killed_mid_write = 0usize;
    for round in 0..100u64 {
        let mut child = Command::new(bin)
            .args([
                d.path().to_str().unwrap(),
                &budget.to_string(),
                &(round + 1).to_string(),
            ])
            .spawn()
            .unwrap();
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        std::thread::sleep(Duration::from_micros(2_000 + rng % 40_000));
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        let _ = child.wait();
        killed_mid_write += count_tmp(d.path());
        let (mut s, rejected) = KvStore::open(cfg(d.path(), budget)).unwrap();
        assert!(
            rejected.is_empty(),
            "round {round}: a complete-looking entry was bad: {rejected:?}"
        );
        assert!(
            s.total_bytes() <= budget,
            "round {round}: {} > {budget}",
            s.total_bytes()
        );
        let names: Vec<(String, Vec<u32>)> = s
            .entries()
            .iter()
            .map(|e| (e.name.clone(), e.tokens.clone()))
            .collect();
        for (name, tokens) in names {
            let l = s
                .load(&name)
                .unwrap_or_else(|e| panic!("round {round}: {e}"));
            assert_eq!(l.tokens, tokens);
            assert_eq!(
                l.payload,
                expected_payload(&tokens),
                "round {round}: wrong payload"
            );
            loaded_ok += 1;
        }
        // No stray temp files survive a reopen (the killed writer is dead).
        assert_eq!(count_tmp(d.path()), 0, "round {round}");
    }
    assert!(
        loaded_ok > 100,
        "the writer must have completed entries: {loaded_ok}"
    );
    // The kills must really have interrupted writes, or this test proves nothing.
    assert!(
        killed_mid_write > 10,
        "only {killed_mid_write} kills landed mid-write"
    );
    eprintln!("100 SIGKILLs: {killed_mid_write} mid-write, {loaded_ok} entry loads verified");
}

fn count_tmp(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .contains(".tmp.")
        })
        .count()
}

/// Same generator as the crash writer's.
fn expected_payload(tokens: &[u32]) -> Vec<u8> {
    let mut s = tokens.iter().fold(0x9e37_79b9_7f4a_7c15u64, |h, &t| {
        (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3)
    }) | 1;
    let len = 4096 + (s % (1 << 20)) as usize;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect()
}

/// Issue 24: the cache directory is used as it is found (never chmod-ed), created 0700 when
/// missing, and refused when other users can write to it.
#[cfg(unix)]
#[test]
fn directory_permissions_are_never_changed() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    let shared = d.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let cfg = |dir: &std::path::Path| StoreConfig {
        dir: dir.to_path_buf(),
        budget_bytes: 1 << 20,
        model_id: [1; 32],
        mode: Mode::Exact,
        ctx: 4096,
    };
    let err = KvStore::open(cfg(&shared))
        .err()
        .expect("a 1777 directory is refused");
    assert!(err.to_string().contains("writable by other users"), "{err}");
    let mode = std::fs::metadata(&shared).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o1777, "permissions of an existing directory changed");
    let fresh = d.path().join("a/b/kv");
    KvStore::open(cfg(&fresh)).unwrap();
    let mode = std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
    // A private existing directory keeps its mode.
    let private = d.path().join("private");
    std::fs::create_dir(&private).unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o750)).unwrap();
    KvStore::open(cfg(&private)).unwrap();
    let mode = std::fs::metadata(&private).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o750);
}

/// A cache directory below a world-writable parent without the sticky bit is refused
/// (anyone could swap it), existing or not, and nothing is created there; one owned by
/// another user is refused (checked where the test can chown, i.e. as root).
#[cfg(unix)]
#[test]
fn cache_directory_owner_and_open_parents_are_checked() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    let cfg = |dir: &std::path::Path| StoreConfig {
        dir: dir.to_path_buf(),
        budget_bytes: 1 << 20,
        model_id: [1; 32],
        mode: Mode::Exact,
        ctx: 4096,
    };
    let open = d.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let inside = open.join("kv");
    std::fs::create_dir(&inside).unwrap();
    std::fs::set_permissions(&inside, std::fs::Permissions::from_mode(0o700)).unwrap();
    let err = KvStore::open(cfg(&inside))
        .err()
        .expect("a directory under a world-writable parent is refused");
    let msg = err.to_string();
    assert!(
        msg.contains("no sticky bit") && msg.contains(&*open.to_string_lossy()),
        "{msg}"
    );
    let missing = open.join("new/kv");
    assert!(KvStore::open(cfg(&missing)).is_err());
    assert!(!open.join("new").exists(), "created under an open parent");
    // With the sticky bit (as /tmp has) the parent is fine.
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
    KvStore::open(cfg(&inside)).unwrap();

    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let theirs = d.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
        let c = std::ffi::CString::new(theirs.to_string_lossy().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path; chown only reads it.
        assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0);
        let err = KvStore::open(cfg(&theirs))
            .err()
            .expect("another user's directory is refused");
        assert!(
            err.to_string().contains("belongs to user id 65534"),
            "{err}"
        );
    }
}

/// Issue 24: an entry name that is a symlink out of the directory is never followed (the
/// hit counters used to be written through it), and an entry-named FIFO does not hang open.
#[cfg(unix)]
#[test]
fn symlinks_and_fifos_are_not_followed() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("kv");
    let cfg = StoreConfig {
        dir: dir.clone(),
        budget_bytes: 1 << 20,
        model_id: [2; 32],
        mode: Mode::Exact,
        ctx: 4096,
    };
    let (mut s, _) = KvStore::open(cfg.clone()).unwrap();
    let StoreOutcome::Stored { name, .. } = s
        .store(&[5, 6, 7], b"payload", &std::collections::BTreeMap::new())
        .unwrap()
    else {
        panic!("not stored")
    };
    drop(s);
    // Move the real entry outside and leave a symlink to it under the entry's name.
    let outside = d.path().join("outside.bin");
    std::fs::rename(dir.join(&name), &outside).unwrap();
    std::os::unix::fs::symlink(&outside, dir.join(&name)).unwrap();
    let before = std::fs::read(&outside).unwrap();
    let (mut s, _) = KvStore::open(cfg.clone()).unwrap();
    assert!(s.entries().is_empty(), "a symlink was indexed");
    assert!(s.load(&name).is_err());
    drop(s);
    assert_eq!(
        std::fs::read(&outside).unwrap(),
        before,
        "written through a symlink"
    );

    // A FIFO under an entry name: open must return (run it on a thread with a deadline).
    std::fs::remove_file(dir.join(&name)).unwrap();
    let fifo = std::ffi::CString::new(dir.join(&name).to_str().unwrap()).unwrap();
    // SAFETY: mkfifo reads a NUL-terminated path that lives for the call.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = KvStore::open(cfg).map(|(s, _)| s.entries().len());
        let _ = tx.send(r.map_err(|e| e.to_string()));
    });
    let r = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("opening a store with an entry-named FIFO hung");
    assert_eq!(r.unwrap(), 0);
    assert!(ds4_kvstore::open_entry(&dir.join(&name), false).is_err());
}
