//! Replays every committed fuzz input through its target's entry function: the seeds in
//! `fuzz/corpus_seeds/<target>/` and the crash inputs in `fuzz/regressions/<target>/`. A
//! crash input stays committed after its fix, so this test is what keeps it fixed.

use std::path::{Path, PathBuf};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

/// Every file under `dir` (none when it does not exist), sorted for a stable order.
fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .map(|e| e.expect("readable directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    v.sort();
    v
}

/// Runs `target` over every seed and crash input; returns how many inputs ran. A panic is
/// reported with the input's path.
fn replay(target: &str) -> usize {
    let run = ds4_fuzz_targets::TARGETS
        .iter()
        .find(|(n, _)| *n == target)
        .unwrap_or_else(|| panic!("no target {target}"))
        .1;
    let root = fuzz_dir();
    let mut inputs = files(&root.join("corpus_seeds").join(target));
    assert!(
        !inputs.is_empty(),
        "no committed seeds for {target} in fuzz/corpus_seeds/{target}"
    );
    inputs.extend(files(&root.join("regressions").join(target)));
    for path in &inputs {
        let data = std::fs::read(path).unwrap();
        let r = std::panic::catch_unwind(|| run(&data));
        assert!(r.is_ok(), "{target} panicked on {}", path.display());
    }
    inputs.len()
}

#[test]
fn every_target_has_a_replay_test() {
    let names: Vec<&str> = ds4_fuzz_targets::TARGETS.iter().map(|t| t.0).collect();
    // The fuzz crate's [[bin]] list and this crate's table must name the same targets.
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).unwrap();
    let bins: Vec<&str> = manifest
        .lines()
        .filter_map(|l| l.strip_prefix("name = \""))
        .filter_map(|l| l.strip_suffix('"'))
        .filter(|n| *n != "ds4-fuzz")
        .collect();
    let mut a = names.clone();
    let mut b = bins.clone();
    a.sort();
    b.sort();
    assert_eq!(a, b, "fuzz/Cargo.toml targets vs ds4_fuzz_targets::TARGETS");
    for t in bins {
        let wrapper =
            std::fs::read_to_string(fuzz_dir().join(format!("fuzz_targets/{t}.rs"))).unwrap();
        assert!(
            wrapper.contains(&format!("ds4_fuzz_targets::{t}(data)")),
            "fuzz_targets/{t}.rs does not call ds4_fuzz_targets::{t}"
        );
    }
}

#[test]
fn gguf_parse_replays() {
    assert!(replay("gguf_parse") >= 3);
}

#[test]
fn server_request_replays() {
    assert!(replay("server_request") >= 10);
}

#[test]
fn kvstore_load_replays() {
    assert!(replay("kvstore_load") >= 5);
}

/// Committed `*.proptest-regressions` files replay only while failure persistence is on
/// (proptest's default); a test that turns it off silently skips its saved cases.
#[test]
fn proptest_failure_persistence_is_never_turned_off() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut stack = vec![crates];
    let mut offenders = Vec::new();
    let mut scanned = 0;
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n != "target") {
                    stack.push(p);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                scanned += 1;
                let text = std::fs::read_to_string(&p).unwrap();
                // Split so this file does not match itself.
                if text.contains(concat!("failure_persistence", ": None")) {
                    offenders.push(p.display().to_string());
                }
            }
        }
    }
    assert!(
        scanned > 50,
        "only {scanned} Rust files found under crates/"
    );
    assert!(
        offenders.is_empty(),
        "failure persistence off in {offenders:?}"
    );
}
