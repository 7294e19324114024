//! Host memory facts and pure parsers for the Linux files they come from.
//!
//! The planner never reads files: [`crate::probe`] reads `/proc/meminfo`, the cgroup files
//! and `/proc/self/limits` and hands the text to the parsers here, so every rule about
//! those formats (CmaFree absent → 0, MemAvailable missing → error, kB overflow → error,
//! cgroup "max" → unlimited) is tested on fixtures instead of on whatever machine CI runs.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::bytes::{opt_size, size};

/// Which operating system the numbers describe (usable memory is computed differently).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum HostOs {
    #[default]
    Linux,
    /// No CMA; usable = min(available physical, available commit).
    Windows,
    Other,
}

/// cgroup hierarchy version the limit came from (reported, not used in arithmetic).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CgroupVersion {
    V1,
    V2,
}

/// The tightest memory limit of the process's cgroup (and its usage at probe time).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CgroupFacts {
    pub version: CgroupVersion,
    /// `memory.max` (v2) or `memory.limit_in_bytes` (v1).
    #[serde(with = "size")]
    pub limit: u64,
    /// `memory.current` (v2) or `memory.usage_in_bytes` (v1); 0 when unknown.
    #[serde(default, with = "size")]
    pub usage: u64,
}

impl CgroupFacts {
    /// Bytes the cgroup still lets this process charge.
    pub fn available(&self) -> u64 {
        self.limit.saturating_sub(self.usage)
    }
}

/// Everything the planner needs to know about host RAM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostFacts {
    #[serde(default)]
    pub os: HostOs,
    #[serde(with = "size")]
    pub mem_total: u64,
    #[serde(with = "size")]
    pub mem_available: u64,
    /// Free CMA pages: they can back movable allocations but not pinned GPU pages, so they
    /// are subtracted from what a GPU can pin (ds4's rule). Absent in meminfo → 0.
    #[serde(default, with = "size")]
    pub cma_free: u64,
    #[serde(default, with = "opt_size")]
    pub swap_free: Option<u64>,
    /// Windows only: available commit (page file) bytes.
    #[serde(default, with = "opt_size")]
    pub commit_available: Option<u64>,
    #[serde(default)]
    pub cgroup: Option<CgroupFacts>,
    /// Soft RLIMIT_MEMLOCK in bytes; `None` = unlimited.
    #[serde(default, with = "opt_size")]
    pub memlock_limit: Option<u64>,
}

impl HostFacts {
    /// Builds Linux facts from parsed meminfo plus the optional cgroup limit and memlock.
    pub fn from_linux(mem: &MemInfo, cgroup: Option<CgroupFacts>, memlock: Option<u64>) -> Self {
        HostFacts {
            os: HostOs::Linux,
            mem_total: mem.mem_total,
            mem_available: mem.mem_available,
            cma_free: mem.cma_free.unwrap_or(0),
            swap_free: mem.swap_free,
            commit_available: None,
            cgroup,
            memlock_limit: memlock,
        }
    }

    /// What the OS could still give a GPU to pin: MemAvailable − CmaFree on Linux (floored
    /// at 0), min(available, commit) on Windows. Excludes the cgroup limit and OS reserve.
    pub fn os_available(&self) -> u64 {
        match self.os {
            HostOs::Windows => self
                .mem_available
                .min(self.commit_available.unwrap_or(self.mem_available)),
            HostOs::Linux | HostOs::Other => self.mem_available.saturating_sub(self.cma_free),
        }
    }

    /// [`Self::os_available`] further bounded by the cgroup's remaining allowance: a
    /// container killed by its memory limit is as dead as one killed by the OS.
    pub fn available(&self) -> u64 {
        match &self.cgroup {
            Some(cg) => self.os_available().min(cg.available()),
            None => self.os_available(),
        }
    }

    /// True when the cgroup, not the machine, is the binding host limit.
    pub fn cgroup_binds(&self) -> bool {
        self.cgroup
            .as_ref()
            .is_some_and(|cg| cg.available() < self.os_available())
    }
}

/// A problem in the text of `/proc/meminfo`, a cgroup file or `/proc/self/limits`.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HostParseError {
    #[error("/proc/meminfo has no {0} line (cannot read usable host memory)")]
    MissingKey(&'static str),
    #[error("/proc/meminfo line for {key}: {value:?} is not '<integer> kB'")]
    BadValue { key: &'static str, value: String },
    #[error("/proc/meminfo {key}: {kib} kB does not fit in 64-bit bytes")]
    Overflow { key: &'static str, kib: u64 },
    #[error("/proc/meminfo has two {0} lines")]
    DuplicateKey(&'static str),
    #[error("cgroup file {file}: {value:?} is not an integer or 'max'")]
    BadCgroupValue { file: &'static str, value: String },
    #[error("/proc/self/limits has no 'Max locked memory' line")]
    MissingMemlock,
    #[error("/proc/self/limits 'Max locked memory': {0:?} is not an integer or 'unlimited'")]
    BadMemlock(String),
    #[error("/proc/self/cgroup path longer than {max} bytes")]
    PathTooLong { max: usize },
}

/// The `/proc/meminfo` fields the planner uses, in bytes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MemInfo {
    pub mem_total: u64,
    pub mem_available: u64,
    pub cma_free: Option<u64>,
    pub cma_total: Option<u64>,
    pub swap_free: Option<u64>,
}

/// Parses `/proc/meminfo` text. MemTotal and MemAvailable are required (a kernel without
/// MemAvailable predates 3.14 and its "free" numbers would over-promise); CmaFree,
/// CmaTotal and SwapFree are optional. Other keys are ignored without being inspected.
pub fn parse_meminfo(text: &str) -> Result<MemInfo, HostParseError> {
    const KEYS: [&str; 5] = [
        "MemTotal",
        "MemAvailable",
        "CmaFree",
        "CmaTotal",
        "SwapFree",
    ];
    let mut vals: [Option<u64>; 5] = [None; 5];
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let Some(idx) = KEYS.iter().position(|k| *k == key.trim()) else {
            continue;
        };
        let key = KEYS[idx];
        if vals[idx].is_some() {
            return Err(HostParseError::DuplicateKey(key));
        }
        let bad = || HostParseError::BadValue {
            key,
            value: rest.trim().chars().take(64).collect(),
        };
        let mut parts = rest.split_whitespace();
        let num = parts.next().ok_or_else(bad)?;
        let unit = parts.next();
        if parts.next().is_some() || !matches!(unit, Some("kB") | None) {
            return Err(bad());
        }
        let kib: u64 = num.parse().map_err(|_| bad())?;
        // A unit-less value would be a count of pages (HugePages_*); none of our keys is.
        if unit.is_none() {
            return Err(bad());
        }
        let bytes = kib
            .checked_mul(1024)
            .ok_or(HostParseError::Overflow { key, kib })?;
        vals[idx] = Some(bytes);
    }
    Ok(MemInfo {
        mem_total: vals[0].ok_or(HostParseError::MissingKey("MemTotal"))?,
        mem_available: vals[1].ok_or(HostParseError::MissingKey("MemAvailable"))?,
        cma_free: vals[2],
        cma_total: vals[3],
        swap_free: vals[4],
    })
}

/// Parses cgroup v2 `memory.max`: an integer, or `max` = unlimited (`None`).
pub fn parse_cgroup_v2_max(text: &str) -> Result<Option<u64>, HostParseError> {
    let t = text.trim();
    if t == "max" {
        return Ok(None);
    }
    t.parse()
        .map(Some)
        .map_err(|_| HostParseError::BadCgroupValue {
            file: "memory.max",
            value: t.chars().take(64).collect(),
        })
}

/// Parses cgroup v1 `memory.limit_in_bytes`. v1 spells "unlimited" as a huge number
/// (`PAGE_COUNTER_MAX` × page size, 0x7FFFFFFFFFFFF000 on x86-64, or i64::MAX), which maps
/// to `None`.
pub fn parse_cgroup_v1_limit(text: &str) -> Result<Option<u64>, HostParseError> {
    let t = text.trim();
    let v: u64 = t.parse().map_err(|_| HostParseError::BadCgroupValue {
        file: "memory.limit_in_bytes",
        value: t.chars().take(64).collect(),
    })?;
    Ok(if v >= 0x7FFF_FFFF_FFFF_F000 {
        None
    } else {
        Some(v)
    })
}

/// Parses a usage file (`memory.current` or `memory.usage_in_bytes`).
pub fn parse_cgroup_usage(file: &'static str, text: &str) -> Result<u64, HostParseError> {
    let t = text.trim();
    t.parse().map_err(|_| HostParseError::BadCgroupValue {
        file,
        value: t.chars().take(64).collect(),
    })
}

/// Where this process sits in each cgroup hierarchy (from `/proc/self/cgroup`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProcCgroup {
    /// The unified (v2) path, line `0::/path`.
    pub v2: Option<String>,
    /// The v1 memory controller path, line `N:...memory...:/path`.
    pub v1_memory: Option<String>,
}

/// Parses `/proc/self/cgroup`. Unknown lines are skipped; a path longer than 4096 bytes
/// (PATH_MAX) is an error rather than an allocation sized by the file.
pub fn parse_proc_self_cgroup(text: &str) -> Result<ProcCgroup, HostParseError> {
    const MAX: usize = 4096;
    let mut out = ProcCgroup::default();
    for line in text.lines() {
        let mut it = line.splitn(3, ':');
        let (Some(id), Some(ctrl), Some(path)) = (it.next(), it.next(), it.next()) else {
            continue;
        };
        if path.len() > MAX {
            return Err(HostParseError::PathTooLong { max: MAX });
        }
        if id == "0" && ctrl.is_empty() {
            out.v2 = Some(path.to_string());
        } else if ctrl.split(',').any(|c| c == "memory") {
            out.v1_memory = Some(path.to_string());
        }
    }
    Ok(out)
}

/// Parses the soft "Max locked memory" limit from `/proc/self/limits` (`None` = unlimited).
pub fn parse_memlock_limit(text: &str) -> Result<Option<u64>, HostParseError> {
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("Max locked memory"))
        .ok_or(HostParseError::MissingMemlock)?;
    let soft = line
        .split_whitespace()
        .next()
        .ok_or_else(|| HostParseError::BadMemlock(String::new()))?;
    if soft == "unlimited" {
        return Ok(None);
    }
    soft.parse()
        .map(Some)
        .map_err(|_| HostParseError::BadMemlock(soft.chars().take(64).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::GIB;

    const STRIX: &str = "MemTotal:       131072000 kB\nMemFree:        120000000 kB\n\
MemAvailable:   125829120 kB\nBuffers:            1234 kB\nSwapFree:        8388604 kB\n\
HugePages_Total:       0\nCmaTotal:          65536 kB\nCmaFree:           65536 kB\n";

    #[test]
    fn meminfo_with_cma() {
        let m = parse_meminfo(STRIX).unwrap();
        assert_eq!(m.mem_total, 131_072_000 * 1024);
        assert_eq!(m.mem_available, 120 * GIB);
        assert_eq!(m.cma_free, Some(64 << 20));
        assert_eq!(m.swap_free, Some(8_388_604 * 1024));
        let h = HostFacts::from_linux(&m, None, None);
        assert_eq!(h.os_available(), 120 * GIB - (64 << 20));
        assert_eq!(h.available(), h.os_available());
    }

    #[test]
    fn meminfo_without_cma_counts_zero() {
        let m = parse_meminfo("MemTotal: 100 kB\nMemAvailable: 50 kB\n").unwrap();
        assert_eq!(m.cma_free, None);
        assert_eq!(
            HostFacts::from_linux(&m, None, None).os_available(),
            50 * 1024
        );
    }

    #[test]
    fn cma_larger_than_available_floors_at_zero() {
        let m = parse_meminfo("MemTotal: 100 kB\nMemAvailable: 50 kB\nCmaFree: 80 kB\n").unwrap();
        assert_eq!(HostFacts::from_linux(&m, None, None).os_available(), 0);
    }

    #[test]
    fn meminfo_errors() {
        assert_eq!(
            parse_meminfo("MemTotal: 100 kB\nMemFree: 50 kB\n"),
            Err(HostParseError::MissingKey("MemAvailable"))
        );
        assert_eq!(
            parse_meminfo("MemAvailable: 100 kB\n"),
            Err(HostParseError::MissingKey("MemTotal"))
        );
        assert!(matches!(
            parse_meminfo("MemTotal: lots kB\nMemAvailable: 1 kB"),
            Err(HostParseError::BadValue {
                key: "MemTotal",
                ..
            })
        ));
        assert!(matches!(
            parse_meminfo("MemTotal: 1 MB\nMemAvailable: 1 kB"),
            Err(HostParseError::BadValue {
                key: "MemTotal",
                ..
            })
        ));
        assert!(matches!(
            parse_meminfo("MemTotal: 1\nMemAvailable: 1 kB"),
            Err(HostParseError::BadValue {
                key: "MemTotal",
                ..
            })
        ));
        assert_eq!(
            parse_meminfo("MemTotal: 18446744073709551615 kB\nMemAvailable: 1 kB"),
            Err(HostParseError::Overflow {
                key: "MemTotal",
                kib: u64::MAX
            })
        );
        assert_eq!(
            parse_meminfo("MemTotal: 1 kB\nMemTotal: 2 kB\nMemAvailable: 1 kB"),
            Err(HostParseError::DuplicateKey("MemTotal"))
        );
    }

    #[test]
    fn cgroup_files() {
        assert_eq!(parse_cgroup_v2_max("max\n"), Ok(None));
        assert_eq!(parse_cgroup_v2_max("68719476736\n"), Ok(Some(64 * GIB)));
        assert!(parse_cgroup_v2_max("lots").is_err());
        assert_eq!(parse_cgroup_v1_limit("9223372036854771712\n"), Ok(None));
        assert_eq!(parse_cgroup_v1_limit("9223372036854775807"), Ok(None));
        assert_eq!(parse_cgroup_v1_limit("34359738368"), Ok(Some(32 * GIB)));
        assert_eq!(parse_cgroup_usage("memory.current", "1024\n"), Ok(1024));
        assert!(parse_cgroup_usage("memory.current", "-5").is_err());
    }

    #[test]
    fn cgroup_limit_binds_host() {
        let m = parse_meminfo(STRIX).unwrap();
        let cg = CgroupFacts {
            version: CgroupVersion::V2,
            limit: 48 * GIB,
            usage: 2 * GIB,
        };
        let h = HostFacts::from_linux(&m, Some(cg), None);
        assert_eq!(h.available(), 46 * GIB);
        assert!(h.cgroup_binds());
    }

    #[test]
    fn proc_self_cgroup() {
        let v2 = parse_proc_self_cgroup("0::/user.slice/session-2.scope\n").unwrap();
        assert_eq!(v2.v2.as_deref(), Some("/user.slice/session-2.scope"));
        assert_eq!(v2.v1_memory, None);
        let v1 =
            parse_proc_self_cgroup("12:cpu,cpuacct:/a\n9:memory:/docker/abc\n1:name=systemd:/x\n")
                .unwrap();
        assert_eq!(v1.v1_memory.as_deref(), Some("/docker/abc"));
        assert_eq!(v1.v2, None);
        let long = format!("0::/{}", "a".repeat(5000));
        assert_eq!(
            parse_proc_self_cgroup(&long),
            Err(HostParseError::PathTooLong { max: 4096 })
        );
    }

    #[test]
    fn memlock() {
        let limits =
            "Limit                     Soft Limit           Hard Limit           Units     \n\
Max cpu time              unlimited            unlimited            seconds   \n\
Max locked memory         8388608              8388608              bytes     \n";
        assert_eq!(parse_memlock_limit(limits), Ok(Some(8 << 20)));
        let unl = "Max locked memory         unlimited            unlimited            bytes\n";
        assert_eq!(parse_memlock_limit(unl), Ok(None));
        assert_eq!(
            parse_memlock_limit("Max cpu time unlimited unlimited seconds"),
            Err(HostParseError::MissingMemlock)
        );
        assert!(matches!(
            parse_memlock_limit("Max locked memory  lots  lots bytes"),
            Err(HostParseError::BadMemlock(_))
        ));
    }

    #[test]
    fn windows_uses_commit() {
        let h = HostFacts {
            os: HostOs::Windows,
            mem_total: 96 * GIB,
            mem_available: 80 * GIB,
            cma_free: 0,
            swap_free: None,
            commit_available: Some(70 * GIB),
            cgroup: None,
            memlock_limit: None,
        };
        assert_eq!(h.available(), 70 * GIB);
    }

    #[test]
    fn json_accepts_size_strings() {
        let h: HostFacts = serde_json::from_str(
            r#"{"mem_total":"128 GiB","mem_available":"120 GiB","cma_free":0,
                "cgroup":{"version":"v2","limit":"48 GiB"}}"#,
        )
        .unwrap();
        assert_eq!(h.mem_total, 128 * GIB);
        assert_eq!(h.cgroup.as_ref().unwrap().limit, 48 * GIB);
        assert_eq!(h.memlock_limit, None);
        assert!(
            serde_json::from_str::<HostFacts>(r#"{"mem_total":"x","mem_available":1}"#).is_err()
        );
    }
}
