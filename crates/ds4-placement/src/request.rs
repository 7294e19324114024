//! What the user asked for: context, per-session buffer sizes and placement overrides.
//!
//! Overrides are resolved once at start-up by [`resolve_overrides`] from the CLI and an
//! environment *lookup function* (so tests never touch the process environment):
//! CLI > environment > automatic. Every variable is value-based: `=0` means off, unlike
//! ds4 where setting a switch to 0 still turned it on. [`OVERRIDE_TABLE`] is the one
//! documented table of them all.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::bytes::gib_to_bytes;

/// A requested memory kind for one class of allocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum MemChoice {
    /// Let the planner decide.
    #[default]
    Auto,
    /// Device pool (`cudaMalloc` / `hipMalloc`).
    Device,
    /// Pinned host memory the device reads directly.
    Host,
    /// Managed (unified) memory.
    Managed,
}

impl MemChoice {
    pub fn as_str(self) -> &'static str {
        match self {
            MemChoice::Auto => "auto",
            MemChoice::Device => "device",
            MemChoice::Host => "host",
            MemChoice::Managed => "managed",
        }
    }
}

impl fmt::Display for MemChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for MemChoice {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "auto" => Ok(MemChoice::Auto),
            "device" => Ok(MemChoice::Device),
            "host" => Ok(MemChoice::Host),
            "managed" => Ok(MemChoice::Managed),
            _ => Err(()),
        }
    }
}

/// Whether routed experts must be resident or may be streamed from the model file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ExpertsChoice {
    /// Resident when anything resident fits; streamed only when nothing does.
    #[default]
    Auto,
    /// Resident or refused (never streamed).
    Resident,
    /// Streamed even when a resident plan would fit.
    Stream,
}

impl ExpertsChoice {
    pub fn as_str(self) -> &'static str {
        match self {
            ExpertsChoice::Auto => "auto",
            ExpertsChoice::Resident => "resident",
            ExpertsChoice::Stream => "stream",
        }
    }
}

impl fmt::Display for ExpertsChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ExpertsChoice {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "auto" => Ok(ExpertsChoice::Auto),
            "resident" => Ok(ExpertsChoice::Resident),
            "stream" => Ok(ExpertsChoice::Stream),
            _ => Err(()),
        }
    }
}

/// Where a setting's value came from (shown in the report next to each decision).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case", tag = "from")]
pub enum Source {
    #[default]
    Default,
    Env {
        var: String,
        value: String,
    },
    Cli {
        flag: String,
        value: String,
    },
}

impl Source {
    pub fn is_default(&self) -> bool {
        matches!(self, Source::Default)
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::Env { var, value } => write!(f, "{var}={value}"),
            Source::Cli { flag, value } if value.is_empty() => f.write_str(flag),
            Source::Cli { flag, value } => write!(f, "{flag} {value}"),
        }
    }
}

/// A value plus its provenance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Setting<T> {
    pub value: T,
    #[serde(default)]
    pub source: Source,
}

impl<T> Setting<T> {
    pub fn new(value: T, source: Source) -> Self {
        Setting { value, source }
    }
}

/// Resolved placement overrides.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Overrides {
    #[serde(default)]
    pub weights: Setting<MemChoice>,
    #[serde(default)]
    pub kv: Setting<MemChoice>,
    #[serde(default)]
    pub scratch: Setting<MemChoice>,
    /// OS reserve in bytes; `None` = the policy's default (2 GiB).
    #[serde(default)]
    pub os_reserve: Setting<Option<u64>>,
    /// Cap on the device pool in bytes (reproduces small-pool machines on big GPUs).
    #[serde(default)]
    pub device_mem_limit: Setting<Option<u64>>,
    /// Resident or streamed routed experts.
    #[serde(default)]
    pub experts: Setting<ExpertsChoice>,
    /// Largest expert cache of a streamed plan, in bytes; `None` = as large as fits.
    #[serde(default)]
    pub expert_cache: Setting<Option<u64>>,
}

impl Overrides {
    /// Overrides with only the weights kind set (tests, programmatic callers).
    pub fn weights(choice: MemChoice) -> Self {
        Overrides {
            weights: Setting::new(
                choice,
                Source::Cli {
                    flag: "--weights-mem".into(),
                    value: choice.as_str().into(),
                },
            ),
            ..Overrides::default()
        }
    }
}

/// Raw CLI values (as typed), `None` where the flag was not given.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CliOverrides {
    pub weights_mem: Option<String>,
    pub kv_mem: Option<String>,
    pub scratch_mem: Option<String>,
    pub os_reserve_gib: Option<String>,
    pub device_mem_limit_gib: Option<String>,
    pub experts: Option<String>,
    pub expert_cache_gib: Option<String>,
}

/// A flag or variable with a value the planner does not accept.
#[derive(Debug, Clone, PartialEq, Eq, Error, Serialize)]
pub enum OverrideError {
    #[error("{name}={value:?}: expected one of {expected}")]
    BadValue {
        name: String,
        value: String,
        expected: &'static str,
    },
    #[error("{a} and {b} disagree; unset one of them")]
    Conflict { a: String, b: String },
}

/// One row of the documented override table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct OverrideDoc {
    pub flag: &'static str,
    pub env: &'static str,
    pub values: &'static str,
    pub default: &'static str,
    pub effect: &'static str,
}

/// Every placement knob. CLI > environment > automatic; read once at start-up.
pub const OVERRIDE_TABLE: &[OverrideDoc] = &[
    OverrideDoc {
        flag: "--weights-mem",
        env: "DS4_WEIGHTS_MEM",
        values: "auto|device|host|managed",
        default: "auto",
        effect: "memory kind for all weights; a forced kind has no fallback chain",
    },
    OverrideDoc {
        flag: "--weights-mem device",
        env: "DS4_ROCM_FORCE_DEVICE_MEM",
        values: "0|1",
        default: "0",
        effect: "ds4 name: 1 = weights in the device pool even on an integrated GPU",
    },
    OverrideDoc {
        flag: "--kv-mem",
        env: "DS4_KV_MEM",
        values: "auto|device|host|managed",
        default: "auto",
        effect: "memory kind for the KV cache (auto: ds4's managed-KV rule on unified memory)",
    },
    OverrideDoc {
        flag: "--scratch-mem",
        env: "DS4_SCRATCH_MEM",
        values: "auto|device|host|managed",
        default: "auto",
        effect: "memory kind for prefill/graph scratch (auto: same rule as KV on unified memory)",
    },
    OverrideDoc {
        flag: "--scratch-mem managed",
        env: "DS4_CUDA_MANAGED",
        values: "0|1",
        default: "0",
        effect: "ds4 name (PR #361): 1 = scratch in managed memory",
    },
    OverrideDoc {
        flag: "--os-reserve-gib",
        env: "DS4_OS_RESERVE_GIB",
        values: "GiB (>= 0, fractional ok)",
        default: "2",
        effect: "host memory left to the OS; usable host = MemAvailable - CmaFree - reserve",
    },
    OverrideDoc {
        flag: "--device-mem-limit-gib",
        env: "DS4_DEVICE_MEM_LIMIT_GIB",
        values: "GiB (0 = no limit)",
        default: "0",
        effect: "caps the device pool, to reproduce small-pool machines on big GPUs",
    },
    OverrideDoc {
        flag: "--experts",
        env: "DS4_EXPERTS",
        values: "auto|resident|stream",
        default: "auto",
        effect: "routed experts resident, or streamed from the model file through an expert cache (auto: streamed only when nothing resident fits)",
    },
    OverrideDoc {
        flag: "--expert-cache-gib",
        env: "DS4_EXPERT_CACHE_GIB",
        values: "GiB (0 = as large as fits)",
        default: "0",
        effect: "caps the expert cache of a streamed plan (docs/placement.md §9); below the plan's minimum the plan is refused",
    },
];

/// Renders [`OVERRIDE_TABLE`] as a Markdown table (for docs and `--help`).
pub fn override_table_markdown() -> String {
    let mut s =
        String::from("| flag | environment | values | default | effect |\n|---|---|---|---|---|\n");
    for d in OVERRIDE_TABLE {
        s.push_str(&format!(
            "| `{}` | `{}` | {} | {} | {} |\n",
            d.flag, d.env, d.values, d.default, d.effect
        ));
    }
    s
}

const CHOICES: &str = "auto, device, host, managed";

fn parse_choice(name: &str, value: &str) -> Result<MemChoice, OverrideError> {
    value.parse().map_err(|_| OverrideError::BadValue {
        name: name.to_string(),
        value: value.to_string(),
        expected: CHOICES,
    })
}

fn parse_gib(name: &str, value: &str) -> Result<u64, OverrideError> {
    value
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|g| *g <= 1_048_576.0)
        .and_then(gib_to_bytes)
        .ok_or_else(|| OverrideError::BadValue {
            name: name.to_string(),
            value: value.to_string(),
            expected: "a number of GiB >= 0",
        })
}

fn env_src(var: &str, value: &str) -> Source {
    Source::Env {
        var: var.to_string(),
        value: value.to_string(),
    }
}

fn cli_src(flag: &str, value: &str) -> Source {
    Source::Cli {
        flag: flag.to_string(),
        value: value.to_string(),
    }
}

/// A memory-kind setting from its flag, generic variable and optional ds4 alias
/// (a 0/1 variable meaning "this kind").
fn resolve_choice(
    flag: &str,
    cli: Option<&str>,
    var: &str,
    alias: Option<(&str, MemChoice)>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Setting<MemChoice>, OverrideError> {
    // Parse every source even when a higher one wins, so a typo never hides.
    let from_env = match env(var) {
        Some(v) => Some(Setting::new(parse_choice(var, &v)?, env_src(var, &v))),
        None => None,
    };
    let from_alias = match alias {
        Some((name, kind)) => match env(name) {
            Some(v) => crate::switch::parse_switch(name, &v)?
                .then(|| Setting::new(kind, env_src(name, &v))),
            None => None,
        },
        None => None,
    };
    let from_cli = match cli {
        Some(v) => Some(Setting::new(parse_choice(flag, v)?, cli_src(flag, v))),
        None => None,
    };
    if let (Some(e), Some(a)) = (&from_env, &from_alias) {
        if e.value != a.value && e.value != MemChoice::Auto {
            return Err(OverrideError::Conflict {
                a: e.source.to_string(),
                b: a.source.to_string(),
            });
        }
    }
    Ok(from_cli
        .or(from_env.filter(|e| e.value != MemChoice::Auto || from_alias.is_none()))
        .or(from_alias)
        .unwrap_or_default())
}

fn resolve_gib(
    flag: &str,
    cli: Option<&str>,
    var: &str,
    zero_is_none: bool,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Setting<Option<u64>>, OverrideError> {
    let conv = |b: u64| {
        if zero_is_none && b == 0 {
            None
        } else {
            Some(b)
        }
    };
    let from_env = match env(var) {
        Some(v) => Some(Setting::new(conv(parse_gib(var, &v)?), env_src(var, &v))),
        None => None,
    };
    let from_cli = match cli {
        Some(v) => Some(Setting::new(conv(parse_gib(flag, v)?), cli_src(flag, v))),
        None => None,
    };
    Ok(from_cli.or(from_env).unwrap_or_default())
}

/// Resolves all overrides: CLI > environment > automatic. `env` looks a variable up
/// (pass `|k| std::env::var(k).ok()` in a binary).
pub fn resolve_overrides(
    cli: &CliOverrides,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Overrides, OverrideError> {
    let env: &dyn Fn(&str) -> Option<String> = &env;
    Ok(Overrides {
        weights: resolve_choice(
            "--weights-mem",
            cli.weights_mem.as_deref(),
            "DS4_WEIGHTS_MEM",
            Some(("DS4_ROCM_FORCE_DEVICE_MEM", MemChoice::Device)),
            env,
        )?,
        kv: resolve_choice("--kv-mem", cli.kv_mem.as_deref(), "DS4_KV_MEM", None, env)?,
        scratch: resolve_choice(
            "--scratch-mem",
            cli.scratch_mem.as_deref(),
            "DS4_SCRATCH_MEM",
            Some(("DS4_CUDA_MANAGED", MemChoice::Managed)),
            env,
        )?,
        os_reserve: resolve_gib(
            "--os-reserve-gib",
            cli.os_reserve_gib.as_deref(),
            "DS4_OS_RESERVE_GIB",
            false,
            env,
        )?,
        device_mem_limit: resolve_gib(
            "--device-mem-limit-gib",
            cli.device_mem_limit_gib.as_deref(),
            "DS4_DEVICE_MEM_LIMIT_GIB",
            true,
            env,
        )?,
        experts: resolve_experts(cli.experts.as_deref(), env)?,
        expert_cache: resolve_gib(
            "--expert-cache-gib",
            cli.expert_cache_gib.as_deref(),
            "DS4_EXPERT_CACHE_GIB",
            true,
            env,
        )?,
    })
}

fn resolve_experts(
    cli: Option<&str>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Setting<ExpertsChoice>, OverrideError> {
    let parse = |name: &str, v: &str| {
        v.parse::<ExpertsChoice>()
            .map_err(|_| OverrideError::BadValue {
                name: name.to_string(),
                value: v.to_string(),
                expected: "auto, resident, stream",
            })
    };
    let var = "DS4_EXPERTS";
    let from_env = match env(var) {
        Some(v) => Some(Setting::new(parse(var, &v)?, env_src(var, &v))),
        None => None,
    };
    let from_cli = match cli {
        Some(v) => Some(Setting::new(
            parse("--experts", v)?,
            cli_src("--experts", v),
        )),
        None => None,
    };
    Ok(from_cli.or(from_env).unwrap_or_default())
}

/// An extra buffer that speeds things up but is not required (a Q8→F16 expansion, a
/// bigger expert cache). Admitted last, and only if it leaves the policy's workspace
/// reserve free; otherwise dropped with a note instead of refusing the plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OptionalCache {
    pub name: String,
    pub bytes: u64,
}

/// Per-run sizes; KV and scratch sizes are the caller's (the model knows them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Context length in tokens.
    pub ctx: u64,
    /// Prefill chunk (tokens); reported only, its cost is inside `scratch_bytes`.
    #[serde(default)]
    pub prefill_chunk: u64,
    /// KV bytes that grow with each token of context.
    pub kv_bytes_per_token: u64,
    /// KV bytes independent of context (compressor state, snapshots).
    #[serde(default)]
    pub kv_fixed_bytes: u64,
    /// Graph / prefill scratch for one session at this context and chunk.
    pub scratch_bytes: u64,
    /// How `scratch_bytes` grows with the context, in bytes per 4 tokens (0: it does not),
    /// so a smaller-context remedy re-sizes scratch as a plan at that context would.
    #[serde(default)]
    pub scratch_bytes_per_4_ctx: u64,
    #[serde(default)]
    pub optional_caches: Vec<OptionalCache>,
    #[serde(default)]
    pub overrides: Overrides,
    /// How routed-expert tensors split into experts; needed to plan streamed experts
    /// (`None`: they can only be resident).
    #[serde(default)]
    pub routed_experts: Option<RoutedExperts>,
    /// A measured sequential read rate of the model file's disk (bytes/s), for the
    /// streamed plan's speed estimate; `None`: the policy's assumed rate.
    #[serde(default)]
    pub disk_read_bytes_per_s: Option<u64>,
    /// The MTP block's session memory (its KV ring, its scratch for a window of rows, the
    /// ring of the main model's final streams it reads; `ds4_model::mtp::state_bytes`),
    /// placed with the KV cache when the inventory holds the block's tensors
    /// ([`crate::WeightSet::Mtp`]); 0 without a block.
    #[serde(default)]
    pub mtp_state_bytes: u64,
}

/// The routed-expert shape of the model: every routed-expert tensor of a layer holds
/// `per_layer` experts of equal size, contiguous along its outermost dimension, and a
/// token uses `per_token` of them in every layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutedExperts {
    pub per_layer: u32,
    pub per_token: u32,
}

/// A request that cannot be planned at all.
#[derive(Debug, Clone, PartialEq, Eq, Error, Serialize)]
pub enum RequestError {
    #[error("context length must be at least 1 token")]
    ZeroContext,
    #[error("KV bytes for {ctx} tokens x {per_token} B/token overflow 64 bits")]
    KvOverflow { ctx: u64, per_token: u64 },
    #[error("optional cache {name:?} has 0 bytes")]
    EmptyOptional { name: String },
}

impl Request {
    /// A request with no overrides and no optional caches.
    pub fn new(ctx: u64, kv_bytes_per_token: u64, scratch_bytes: u64) -> Self {
        Request {
            ctx,
            prefill_chunk: 0,
            kv_bytes_per_token,
            kv_fixed_bytes: 0,
            scratch_bytes,
            scratch_bytes_per_4_ctx: 0,
            optional_caches: Vec::new(),
            overrides: Overrides::default(),
            routed_experts: None,
            disk_read_bytes_per_s: None,
            mtp_state_bytes: 0,
        }
    }

    /// KV bytes at this context: `ctx × per_token + fixed`, checked.
    pub fn kv_bytes(&self) -> Result<u64, RequestError> {
        self.ctx
            .checked_mul(self.kv_bytes_per_token)
            .and_then(|b| b.checked_add(self.kv_fixed_bytes))
            .ok_or(RequestError::KvOverflow {
                ctx: self.ctx,
                per_token: self.kv_bytes_per_token,
            })
    }

    /// This request at another context: KV grows with it by construction, scratch by
    /// `scratch_bytes_per_4_ctx`.
    pub fn at_context(&self, ctx: u64) -> Request {
        let mut r = self.clone();
        let per4 = self.scratch_bytes_per_4_ctx;
        r.scratch_bytes = self
            .scratch_bytes
            .saturating_sub(per4.saturating_mul(self.ctx / 4))
            .saturating_add(per4.saturating_mul(ctx / 4));
        r.ctx = ctx;
        r
    }

    pub(crate) fn validate(&self) -> Result<(), RequestError> {
        if self.ctx == 0 {
            return Err(RequestError::ZeroContext);
        }
        self.kv_bytes()?;
        if let Some(c) = self.optional_caches.iter().find(|c| c.bytes == 0) {
            return Err(RequestError::EmptyOptional {
                name: c.name.clone(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::GIB;
    use std::collections::BTreeMap;

    fn envmap(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn defaults_are_auto() {
        let o = resolve_overrides(&CliOverrides::default(), envmap(&[])).unwrap();
        assert_eq!(o, Overrides::default());
        assert_eq!(o.weights.value, MemChoice::Auto);
        assert!(o.weights.source.is_default());
    }

    #[test]
    fn ds4_aliases_are_value_based() {
        let o = resolve_overrides(
            &CliOverrides::default(),
            envmap(&[("DS4_ROCM_FORCE_DEVICE_MEM", "1")]),
        )
        .unwrap();
        assert_eq!(o.weights.value, MemChoice::Device);
        assert_eq!(o.weights.source.to_string(), "DS4_ROCM_FORCE_DEVICE_MEM=1");
        let off = resolve_overrides(
            &CliOverrides::default(),
            envmap(&[("DS4_ROCM_FORCE_DEVICE_MEM", "0")]),
        )
        .unwrap();
        assert_eq!(off.weights.value, MemChoice::Auto);
        let m = resolve_overrides(
            &CliOverrides::default(),
            envmap(&[("DS4_CUDA_MANAGED", "1")]),
        )
        .unwrap();
        assert_eq!(m.scratch.value, MemChoice::Managed);
        assert_eq!(m.kv.value, MemChoice::Auto);
        // The aliases read on/off like every switch (ds4_placement::parse_switch).
        let m = resolve_overrides(
            &CliOverrides::default(),
            envmap(&[("DS4_CUDA_MANAGED", "yes")]),
        )
        .unwrap();
        assert_eq!(m.scratch.value, MemChoice::Managed);
        assert!(matches!(
            resolve_overrides(
                &CliOverrides::default(),
                envmap(&[("DS4_CUDA_MANAGED", "2")])
            ),
            Err(OverrideError::BadValue { .. })
        ));
    }

    #[test]
    fn cli_beats_env_beats_auto() {
        let cli = CliOverrides {
            weights_mem: Some("managed".into()),
            ..Default::default()
        };
        let o = resolve_overrides(
            &cli,
            envmap(&[("DS4_WEIGHTS_MEM", "host"), ("DS4_KV_MEM", "device")]),
        )
        .unwrap();
        assert_eq!(o.weights.value, MemChoice::Managed);
        assert_eq!(o.weights.source.to_string(), "--weights-mem managed");
        assert_eq!(o.kv.value, MemChoice::Device);
        // The CLI wins over the ds4 alias too.
        let o = resolve_overrides(&cli, envmap(&[("DS4_ROCM_FORCE_DEVICE_MEM", "1")])).unwrap();
        assert_eq!(o.weights.value, MemChoice::Managed);
    }

    #[test]
    fn conflicting_env_is_an_error_and_typos_surface() {
        assert!(matches!(
            resolve_overrides(
                &CliOverrides::default(),
                envmap(&[
                    ("DS4_WEIGHTS_MEM", "host"),
                    ("DS4_ROCM_FORCE_DEVICE_MEM", "1")
                ])
            ),
            Err(OverrideError::Conflict { .. })
        ));
        // Agreeing values are fine; generic `auto` defers to the alias.
        let o = resolve_overrides(
            &CliOverrides::default(),
            envmap(&[
                ("DS4_WEIGHTS_MEM", "auto"),
                ("DS4_ROCM_FORCE_DEVICE_MEM", "1"),
            ]),
        )
        .unwrap();
        assert_eq!(o.weights.value, MemChoice::Device);
        let cli = CliOverrides {
            weights_mem: Some("device".into()),
            ..Default::default()
        };
        let e = resolve_overrides(&cli, envmap(&[("DS4_KV_MEM", "vram")])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "DS4_KV_MEM=\"vram\": expected one of auto, device, host, managed"
        );
    }

    #[test]
    fn gib_settings() {
        let cli = CliOverrides {
            os_reserve_gib: Some("0".into()),
            device_mem_limit_gib: Some("24".into()),
            ..Default::default()
        };
        let o = resolve_overrides(&cli, envmap(&[("DS4_OS_RESERVE_GIB", "4")])).unwrap();
        assert_eq!(
            o.os_reserve.value,
            Some(0),
            "=0 means no reserve, not the default"
        );
        assert_eq!(o.device_mem_limit.value, Some(24 * GIB));
        let o = resolve_overrides(
            &CliOverrides::default(),
            envmap(&[
                ("DS4_OS_RESERVE_GIB", "1.5"),
                ("DS4_DEVICE_MEM_LIMIT_GIB", "0"),
            ]),
        )
        .unwrap();
        assert_eq!(o.os_reserve.value, Some(3 * GIB / 2));
        assert_eq!(o.device_mem_limit.value, None, "=0 means no limit");
        for bad in ["-1", "lots", "NaN", "1e300"] {
            assert!(resolve_overrides(
                &CliOverrides::default(),
                envmap(&[("DS4_OS_RESERVE_GIB", bad)])
            )
            .is_err());
        }
    }

    #[test]
    fn every_documented_variable_is_read() {
        for d in OVERRIDE_TABLE {
            let val = match d.values {
                "0|1" => "1",
                "auto|resident|stream" => "stream",
                v if v.starts_with("auto") => "managed",
                _ => "3",
            };
            let o = resolve_overrides(&CliOverrides::default(), envmap(&[(d.env, val)])).unwrap();
            assert_ne!(o, Overrides::default(), "{} has no effect", d.env);
        }
        let md = override_table_markdown();
        assert_eq!(md.lines().count(), OVERRIDE_TABLE.len() + 2);
        assert!(md.contains("`DS4_CUDA_MANAGED`"));
    }

    #[test]
    fn request_validation() {
        assert_eq!(
            Request::new(0, 1, 1).validate(),
            Err(RequestError::ZeroContext)
        );
        assert!(matches!(
            Request::new(u64::MAX, 2, 0).validate(),
            Err(RequestError::KvOverflow { .. })
        ));
        let mut r = Request::new(4096, 14_000, GIB);
        r.kv_fixed_bytes = 10;
        assert_eq!(r.kv_bytes().unwrap(), 4096 * 14_000 + 10);
        r.optional_caches.push(OptionalCache {
            name: "q8f16".into(),
            bytes: 0,
        });
        assert!(matches!(
            r.validate(),
            Err(RequestError::EmptyOptional { .. })
        ));
    }
}
