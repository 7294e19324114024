//! Why a plan was refused, by how much, and what would change it.
//!
//! Every remedy in a [`FitRefusal`] has been checked by re-running the planner with that
//! one change applied, so the message never suggests something that would not fit.

use std::fmt;

use serde::Serialize;
use thiserror::Error;

use crate::bytes::{fmt_bytes, fmt_gib};
use crate::device::DeviceKind;
use crate::inventory::InventoryError;
use crate::plan::{BudgetFacts, Pool};
use crate::policy::PolicyError;
use crate::request::RequestError;

/// The planner's error type.
#[derive(Debug, Clone, PartialEq, Eq, Error, Serialize)]
#[serde(tag = "refusal", content = "detail", rename_all = "snake_case")]
pub enum Refusal {
    /// The inputs themselves are wrong (empty inventory, zero context, bad policy).
    #[error("invalid placement input: {0}")]
    InvalidInput(InputError),
    /// An override asks for something the device cannot do.
    #[error("{0}")]
    Unsupported(Unsupported),
    /// Nothing the planner may choose fits the machine.
    #[error("{0}")]
    DoesNotFit(Box<FitRefusal>),
}

impl Refusal {
    /// JSON form (for `ds4 plan --json`).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// The fit refusal, if that is what this is.
    pub fn fit(&self) -> Option<&FitRefusal> {
        match self {
            Refusal::DoesNotFit(f) => Some(f),
            _ => None,
        }
    }
}

/// Input problems, wrapped.
#[derive(Debug, Clone, PartialEq, Eq, Error, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InputError {
    #[error(transparent)]
    Inventory(#[from] InventoryError),
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

impl From<InventoryError> for Refusal {
    fn from(e: InventoryError) -> Self {
        Refusal::InvalidInput(e.into())
    }
}
impl From<RequestError> for Refusal {
    fn from(e: RequestError) -> Self {
        Refusal::InvalidInput(e.into())
    }
}
impl From<PolicyError> for Refusal {
    fn from(e: PolicyError) -> Self {
        Refusal::InvalidInput(e.into())
    }
}

/// An override the device cannot honour.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Unsupported {
    /// The setting, with its source (e.g. "--weights-mem host").
    pub setting: String,
    pub reason: String,
    /// What to do instead.
    pub change: String,
}

impl fmt::Display for Unsupported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "placement refused: {} cannot be honoured: {}. {}",
            self.setting, self.reason, self.change
        )
    }
}

/// One budget that an option exceeded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Shortfall {
    pub pool: Pool,
    /// Bytes the option needed from this pool.
    pub needed: u64,
    pub budget: u64,
    pub weights: u64,
    pub kv: u64,
    pub scratch: u64,
    /// Device-pool bytes that draw on host RAM (unified memory).
    pub via_device: u64,
}

impl Shortfall {
    pub fn short(&self) -> u64 {
        self.needed.saturating_sub(self.budget)
    }
}

impl fmt::Display for Shortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} short by {} (needs {}",
            self.pool.label(),
            fmt_gib(self.short()),
            fmt_gib(self.needed)
        )?;
        let mut parts = Vec::new();
        for (name, b) in [
            ("weights", self.weights),
            ("KV", self.kv),
            ("scratch", self.scratch),
            ("device pool in RAM", self.via_device),
        ] {
            if b > 0 {
                parts.push(format!("{name} {}", fmt_bytes(b)));
            }
        }
        if !parts.is_empty() {
            write!(f, ": {}", parts.join(" + "))?;
        }
        write!(f, "; budget {})", fmt_gib(self.budget))
    }
}

/// One option the planner tried.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FailedOption {
    pub option: String,
    pub shortfalls: Vec<Shortfall>,
    /// Set when the option was not even possible (no shortfall numbers).
    pub note: Option<String>,
}

/// A change that would make the plan fit (each verified by re-planning).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "remedy", rename_all = "snake_case")]
pub enum Remedy {
    /// `--ctx N` or smaller fits (scratch re-sized for that context).
    SmallerContext { max_ctx: u64 },
    /// Removing an override lets automatic placement fit.
    DropOverride { setting: String },
    /// `--kv-mem host`: KV in pinned host memory.
    KvInHost,
    /// `--os-reserve-gib` down to this many bytes fits.
    LowerOsReserve { max_reserve: u64 },
    /// Raise the AMD GTT pool (kernel parameter `ttm.pages_limit`).
    RaiseGtt { pool_gib: u64, pages_limit: u64 },
    /// Raise the container's memory limit to at least this.
    RaiseCgroupLimit { limit: u64 },
    /// Raise RLIMIT_MEMLOCK.
    RaiseMemlock,
    /// Routed experts at half their size (a 2-bit instead of 4-bit file) would fit.
    /// `bits_per_weight_milli`: their current average, ×1000, when the inventory knows it.
    SmallerExpertQuant {
        routed_bytes: u64,
        bits_per_weight_milli: Option<u64>,
    },
    /// Free at least this much host memory.
    FreeHostMemory { bytes: u64 },
    /// Let the planner use the hybrid plan (policy `allow_hybrid`).
    EnableHybrid,
}

impl Remedy {
    pub fn text(&self) -> String {
        match self {
            Remedy::SmallerContext { max_ctx } => {
                format!("--ctx {max_ctx} or smaller fits")
            }
            Remedy::DropOverride { setting } => {
                format!("drop {setting}: automatic placement fits")
            }
            Remedy::KvInHost => {
                "--kv-mem host: KV cache in pinned host memory (attention reads it over the bus)".into()
            }
            Remedy::LowerOsReserve { max_reserve } => format!(
                "--os-reserve-gib {:.2}: leave less host memory to the OS (risky)",
                (*max_reserve as f64 / (1u64 << 30) as f64 * 100.0).floor() / 100.0
            ),
            Remedy::RaiseGtt { pool_gib, pages_limit } => format!(
                "raise the GPU's GTT pool to at least {pool_gib} GiB: kernel parameter \
                 ttm.pages_limit={pages_limit} (GiB x 262144 pages; do not also set amdgpu.gttsize), then reboot"
            ),
            Remedy::RaiseCgroupLimit { limit } => format!(
                "raise the container memory limit to at least {} (e.g. docker --memory, memory.max)",
                fmt_gib(*limit)
            ),
            Remedy::RaiseMemlock => {
                "raise RLIMIT_MEMLOCK (ulimit -l unlimited, or LimitMEMLOCK=infinity in the service unit)".into()
            }
            Remedy::SmallerExpertQuant {
                routed_bytes,
                bits_per_weight_milli: Some(m),
            } => format!(
                "a 2-bit quantization of the routed experts (q2 instead of q4 or mxfp4): they are {} at {:.2} bits/weight here, half that fits",
                fmt_gib(*routed_bytes),
                *m as f64 / 1000.0
            ),
            Remedy::SmallerExpertQuant {
                routed_bytes,
                bits_per_weight_milli: None,
            } => format!(
                "if the routed experts ({}) are 4-bit, their 2-bit quantization (q2 instead of q4 or mxfp4) fits",
                fmt_gib(*routed_bytes)
            ),
            Remedy::FreeHostMemory { bytes } => format!(
                "free at least {} of host memory (other programs, page cache) and retry",
                fmt_gib(*bytes)
            ),
            Remedy::EnableHybrid => "allow the hybrid plan (policy allow_hybrid = true)".into(),
        }
    }
}

/// Nothing fits: the options tried, the facts, and the verified remedies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FitRefusal {
    pub device_name: String,
    pub device_kind: DeviceKind,
    pub ctx: u64,
    pub weights_bytes: u64,
    pub kv_bytes: u64,
    pub scratch_bytes: u64,
    pub facts: BudgetFacts,
    pub tried: Vec<FailedOption>,
    pub remedies: Vec<Remedy>,
}

impl FitRefusal {
    /// The smallest shortfall over all options tried (how far the best option missed).
    pub fn best_shortfall(&self) -> Option<&Shortfall> {
        self.tried
            .iter()
            .filter(|o| !o.shortfalls.is_empty())
            .min_by_key(|o| o.shortfalls.iter().map(Shortfall::short).sum::<u64>())
            .and_then(|o| o.shortfalls.iter().max_by_key(|s| s.short()))
    }
}

impl fmt::Display for FitRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fa = &self.facts;
        writeln!(
            f,
            "placement refused: weights {} + KV {} + scratch {} (ctx {}) do not fit {} ({}); nothing was allocated.",
            fmt_gib(self.weights_bytes),
            fmt_bytes(self.kv_bytes),
            fmt_bytes(self.scratch_bytes),
            self.ctx,
            self.device_name,
            self.device_kind.describe()
        )?;
        writeln!(
            f,
            "  host: usable {} = available {} - OS reserve {}; device pool: budget {} of {} total",
            fmt_gib(fa.host_budget),
            fmt_gib(fa.host_available),
            fmt_gib(fa.os_reserve),
            fmt_gib(fa.device_budget),
            fmt_gib(fa.pool_total)
        )?;
        writeln!(f, "  tried:")?;
        for (i, o) in self.tried.iter().enumerate() {
            let why = if let Some(n) = &o.note {
                n.clone()
            } else {
                o.shortfalls
                    .iter()
                    .map(|s| s.to_string())
                    .collect::<Vec<_>>()
                    .join("; ")
            };
            writeln!(f, "    {}. {}: {}", i + 1, o.option, why)?;
        }
        if self.remedies.is_empty() {
            write!(
                f,
                "  no single setting makes it fit: this model needs a machine with more memory"
            )
        } else {
            write!(f, "  any one of these would make it fit:")?;
            for r in &self.remedies {
                write!(f, "\n    - {}", r.text())?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::GIB;

    #[test]
    fn shortfall_text() {
        let s = Shortfall {
            pool: Pool::Host,
            needed: 155 * GIB,
            budget: 120 * GIB,
            weights: 153 * GIB,
            kv: 0,
            scratch: 2 * GIB,
            via_device: 0,
        };
        assert_eq!(s.short(), 35 * GIB);
        assert_eq!(
            s.to_string(),
            "host memory short by 35.00 GiB (needs 155.00 GiB: weights 153.00 GiB + scratch 2.00 GiB; budget 120.00 GiB)"
        );
    }

    #[test]
    fn remedy_texts_carry_numbers() {
        let r = Remedy::RaiseGtt {
            pool_gib: 84,
            pages_limit: 84 * 262_144,
        };
        assert!(r.text().contains("ttm.pages_limit=22020096"));
        assert_eq!(
            Remedy::LowerOsReserve {
                max_reserve: GIB + GIB / 2
            }
            .text(),
            "--os-reserve-gib 1.50: leave less host memory to the OS (risky)"
        );
        assert!(Remedy::SmallerContext { max_ctx: 65536 }
            .text()
            .starts_with("--ctx 65536"));
    }
}
