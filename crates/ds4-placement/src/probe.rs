//! The only module that touches the file system: reads the host's memory facts.
//!
//! Kept tiny on purpose. Everything it reads is handed to the pure parsers in
//! [`crate::host`], so this file only decides *which* files to read. RLIMIT_MEMLOCK comes
//! from `/proc/self/limits` rather than `getrlimit(2)`, which keeps the crate free of
//! `unsafe` and of a libc dependency.

use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::host::{
    parse_cgroup_usage, parse_cgroup_v1_limit, parse_cgroup_v2_max, parse_meminfo,
    parse_memlock_limit, parse_proc_self_cgroup, CgroupFacts, CgroupVersion, HostFacts,
    HostParseError,
};

/// Why the host could not be probed.
#[derive(Debug, Error)]
pub enum ProbeError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: PathBuf,
        source: HostParseError,
    },
}

/// Files are small; refuse anything absurdly large instead of reading it whole.
const MAX_FILE: u64 = 1 << 20;

fn read(path: &Path) -> Result<String, ProbeError> {
    use std::io::Read;
    let err = |source| ProbeError::Read {
        path: path.to_path_buf(),
        source,
    };
    let f = std::fs::File::open(path).map_err(err)?;
    let mut s = String::new();
    f.take(MAX_FILE).read_to_string(&mut s).map_err(err)?;
    Ok(s)
}

fn parsed<T>(path: &Path, r: Result<T, HostParseError>) -> Result<T, ProbeError> {
    r.map_err(|source| ProbeError::Parse {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads `/proc/meminfo`, the process's cgroup memory limit and RLIMIT_MEMLOCK.
///
/// meminfo is required (no meminfo → no admission, as in ds4). A missing cgroup or limits
/// file only means "no limit known".
pub fn host_facts() -> Result<HostFacts, ProbeError> {
    host_facts_at(Path::new("/"))
}

/// Same as [`host_facts`] with every path below `root` (tests point it at a fixture tree).
pub fn host_facts_at(root: &Path) -> Result<HostFacts, ProbeError> {
    let meminfo_path = root.join("proc/meminfo");
    let mem = parsed(&meminfo_path, parse_meminfo(&read(&meminfo_path)?))?;
    let cgroup = cgroup_facts(root)?;
    let limits_path = root.join("proc/self/limits");
    let memlock = match read(&limits_path) {
        Ok(t) => parsed(&limits_path, parse_memlock_limit(&t))?,
        Err(_) => None,
    };
    Ok(HostFacts::from_linux(&mem, cgroup, memlock))
}

fn rel(p: &str) -> &str {
    p.trim_start_matches('/')
}

/// Walks the process's cgroup and its ancestors (any of them may carry the limit) and
/// keeps the one that leaves the least room.
fn cgroup_facts(root: &Path) -> Result<Option<CgroupFacts>, ProbeError> {
    let self_path = root.join("proc/self/cgroup");
    let Ok(text) = read(&self_path) else {
        return Ok(None);
    };
    let cg = parsed(&self_path, parse_proc_self_cgroup(&text))?;
    let mut best: Option<CgroupFacts> = None;
    let mut consider = |f: CgroupFacts| {
        if best.as_ref().is_none_or(|b| f.available() < b.available()) {
            best = Some(f);
        }
    };
    if let Some(p) = &cg.v2 {
        let base = root.join("sys/fs/cgroup");
        for dir in ancestors(&base, rel(p)) {
            let max_path = dir.join("memory.max");
            let Ok(t) = read(&max_path) else { continue };
            if let Some(limit) = parsed(&max_path, parse_cgroup_v2_max(&t))? {
                let cur = dir.join("memory.current");
                let usage = match read(&cur) {
                    Ok(t) => parsed(&cur, parse_cgroup_usage("memory.current", &t))?,
                    Err(_) => 0,
                };
                consider(CgroupFacts {
                    version: CgroupVersion::V2,
                    limit,
                    usage,
                });
            }
        }
    }
    if let Some(p) = &cg.v1_memory {
        let base = root.join("sys/fs/cgroup/memory");
        for dir in ancestors(&base, rel(p)) {
            let lim_path = dir.join("memory.limit_in_bytes");
            let Ok(t) = read(&lim_path) else { continue };
            if let Some(limit) = parsed(&lim_path, parse_cgroup_v1_limit(&t))? {
                let cur = dir.join("memory.usage_in_bytes");
                let usage = match read(&cur) {
                    Ok(t) => parsed(&cur, parse_cgroup_usage("memory.usage_in_bytes", &t))?,
                    Err(_) => 0,
                };
                consider(CgroupFacts {
                    version: CgroupVersion::V1,
                    limit,
                    usage,
                });
            }
        }
    }
    Ok(best)
}

/// `base/a/b/c`, `base/a/b`, `base/a`, `base` (inside a container namespace the path is
/// often just `/`, so `base` itself is always tried).
fn ancestors(base: &Path, rel: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut p = base.join(rel);
    loop {
        out.push(p.clone());
        if p == base || !p.pop() || !p.starts_with(base) {
            break;
        }
    }
    if out.last().map(PathBuf::as_path) != Some(base) {
        out.push(base.to_path_buf());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::GIB;
    use std::fs;

    fn tree(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("ds4-placement-probe-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(d.join("proc/self")).unwrap();
        fs::write(
            d.join("proc/meminfo"),
            "MemTotal: 134217728 kB\nMemAvailable: 125829120 kB\nCmaFree: 0 kB\n",
        )
        .unwrap();
        d
    }

    #[test]
    fn reads_fixture_tree_with_v2_limit_on_parent() {
        let d = tree("v2");
        fs::write(d.join("proc/self/cgroup"), "0::/kubepods/pod1/ctr\n").unwrap();
        fs::write(
            d.join("proc/self/limits"),
            "Max locked memory         65536                65536                bytes\n",
        )
        .unwrap();
        let ctr = d.join("sys/fs/cgroup/kubepods/pod1/ctr");
        fs::create_dir_all(&ctr).unwrap();
        fs::write(ctr.join("memory.max"), "max\n").unwrap();
        let pod = d.join("sys/fs/cgroup/kubepods/pod1");
        fs::write(pod.join("memory.max"), format!("{}\n", 48 * GIB)).unwrap();
        fs::write(pod.join("memory.current"), format!("{}\n", GIB)).unwrap();
        let h = host_facts_at(&d).unwrap();
        assert_eq!(h.mem_available, 120 * GIB);
        let cg = h.cgroup.clone().unwrap();
        assert_eq!((cg.limit, cg.usage), (48 * GIB, GIB));
        assert_eq!(h.available(), 47 * GIB);
        assert_eq!(h.memlock_limit, Some(65536));
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn v1_limit_and_missing_optional_files() {
        let d = tree("v1");
        fs::write(d.join("proc/self/cgroup"), "4:memory:/docker/x\n").unwrap();
        let m = d.join("sys/fs/cgroup/memory/docker/x");
        fs::create_dir_all(&m).unwrap();
        fs::write(m.join("memory.limit_in_bytes"), format!("{}\n", 32 * GIB)).unwrap();
        let h = host_facts_at(&d).unwrap();
        assert_eq!(h.cgroup.unwrap().limit, 32 * GIB);
        assert_eq!(h.memlock_limit, None);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn missing_meminfo_is_an_error() {
        let d = tree("nomem");
        fs::remove_file(d.join("proc/meminfo")).unwrap();
        assert!(matches!(host_facts_at(&d), Err(ProbeError::Read { .. })));
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn ancestors_walk_to_base() {
        let b = Path::new("/b");
        assert_eq!(
            ancestors(b, "x/y"),
            vec![
                PathBuf::from("/b/x/y"),
                PathBuf::from("/b/x"),
                PathBuf::from("/b")
            ]
        );
        assert_eq!(ancestors(b, ""), vec![PathBuf::from("/b")]);
    }
}
