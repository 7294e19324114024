//! Tunable constants of the placement policy, with the values ds4 measured its way to.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::bytes::{GIB, MIB};
use crate::device::DeviceKind;
use crate::plan::MemKind;

/// Policy knobs. [`Policy::default`] is ds4's behaviour (PR #1028, upstream admission,
/// the managed-KV rule); change fields to experiment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// A tensor at least this large gets its own exact-size allocation (ds4: 256 MiB), so
    /// big spans never strand hundreds of MiB in rounded chunks.
    pub large_span_bytes: u64,
    /// Upper bound of a shared arena for smaller tensors (ds4: 1792 MiB); small tensors
    /// share arenas to avoid thousands of driver allocations.
    pub shared_arena_bytes: u64,
    /// Offset alignment of each tensor inside a shared arena.
    pub span_alignment: u64,
    /// Host memory left to the OS (ds4: 2 GiB), unless overridden.
    pub os_reserve: u64,
    /// Device-pool bytes never planned, left for runtime-internal allocations (BLAS
    /// workspaces, module images) made after the plan.
    pub device_reserve: u64,
    /// Weights fallback chain on an integrated (AMD-style) UMA device: PR #1028.
    pub integrated_weights_chain: Vec<MemKind>,
    /// Weights fallback chain on a coherent UMA device (GB10): managed first, single
    /// residency, as the placement research recommends.
    pub coherent_weights_chain: Vec<MemKind>,
    /// ds4 managed-KV rule: KV at least this large goes managed on unified memory.
    pub kv_managed_bytes: u64,
    /// ds4 rule: context buffers (KV + scratch) below this stay in the device pool.
    pub context_small_bytes: u64,
    /// ds4 rule: the device pool must keep clamp(total/4, min, max) free after the
    /// context buffers, else they go managed.
    pub context_reserve_min: u64,
    pub context_reserve_max: u64,
    /// Optional caches are admitted only if they leave this much free (ds4: 8 GiB).
    pub optional_reserve: u64,
    /// Discrete GPU that cannot hold everything: keep per-token tensors on the device and
    /// put routed experts in pinned host memory instead of refusing.
    pub allow_hybrid: bool,
    /// In a hybrid plan, move routed-expert tensors back onto the device while room
    /// remains (fewer bytes over PCIe per token).
    pub hybrid_fill_device: bool,
    /// Refuse instead of using any fallback kind (chains of length one).
    pub strict: bool,
    /// A streamed-experts plan needs room for one token's experts plus this much more
    /// cache (or every expert, if fewer), so hot experts can stay while the next layer's
    /// are read; below that it is refused.
    #[serde(default = "default_stream_min_extra")]
    pub stream_min_extra_cache: u64,
    /// Sequential read rate assumed for the model file's disk when the request carries
    /// no measured one (a mid-range NVMe drive); only feeds the speed estimate.
    #[serde(default = "default_stream_read")]
    pub stream_assumed_read_bytes_per_s: u64,
}

fn default_stream_min_extra() -> u64 {
    2 * GIB
}

fn default_stream_read() -> u64 {
    3_000_000_000
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            large_span_bytes: 256 * MIB,
            shared_arena_bytes: 1792 * MIB,
            span_alignment: 256,
            os_reserve: 2 * GIB,
            device_reserve: 512 * MIB,
            integrated_weights_chain: vec![MemKind::PinnedHost, MemKind::Managed, MemKind::Device],
            coherent_weights_chain: vec![MemKind::Managed, MemKind::PinnedHost, MemKind::Device],
            kv_managed_bytes: 8 * GIB,
            context_small_bytes: 8 * GIB,
            context_reserve_min: 8 * GIB,
            context_reserve_max: 40 * GIB,
            optional_reserve: 8 * GIB,
            allow_hybrid: true,
            hybrid_fill_device: true,
            strict: false,
            stream_min_extra_cache: default_stream_min_extra(),
            stream_assumed_read_bytes_per_s: default_stream_read(),
        }
    }
}

/// A policy whose numbers contradict each other.
#[derive(Debug, Clone, PartialEq, Eq, Error, Serialize)]
pub enum PolicyError {
    #[error("span_alignment {0} must be a power of two between 1 and 1 MiB")]
    Alignment(u64),
    #[error("large_span_bytes must be at least 1 (got 0)")]
    ZeroLargeSpan,
    #[error("shared_arena_bytes ({arena}) must be at least large_span_bytes ({large}) so every small tensor fits a shared arena")]
    ArenaSmallerThanSpan { arena: u64, large: u64 },
    #[error("{which} weights chain is empty or lists a kind twice")]
    Chain { which: &'static str },
    #[error("context_reserve_min ({min}) exceeds context_reserve_max ({max})")]
    ReserveRange { min: u64, max: u64 },
}

impl Policy {
    pub fn validate(&self) -> Result<(), PolicyError> {
        if !self.span_alignment.is_power_of_two() || self.span_alignment > MIB {
            return Err(PolicyError::Alignment(self.span_alignment));
        }
        if self.large_span_bytes == 0 {
            return Err(PolicyError::ZeroLargeSpan);
        }
        if self.shared_arena_bytes < self.large_span_bytes {
            return Err(PolicyError::ArenaSmallerThanSpan {
                arena: self.shared_arena_bytes,
                large: self.large_span_bytes,
            });
        }
        for (which, c) in [
            ("integrated", &self.integrated_weights_chain),
            ("coherent", &self.coherent_weights_chain),
        ] {
            let dup = c.iter().enumerate().any(|(i, k)| c[..i].contains(k));
            if c.is_empty() || dup {
                return Err(PolicyError::Chain { which });
            }
        }
        if self.context_reserve_min > self.context_reserve_max {
            return Err(PolicyError::ReserveRange {
                min: self.context_reserve_min,
                max: self.context_reserve_max,
            });
        }
        Ok(())
    }

    /// ds4's arena-size rule for a request of `need` bytes: a dedicated allocation of
    /// exactly `need` at or above the large-span threshold, else a shared arena.
    pub fn arena_bytes_for(&self, need: u64) -> u64 {
        if need >= self.large_span_bytes {
            need
        } else {
            self.shared_arena_bytes
        }
    }

    /// The device-pool bytes the context buffers must leave free: clamp(total/4, min, max).
    pub fn context_reserve(&self, pool_total: u64) -> u64 {
        (pool_total / 4).clamp(self.context_reserve_min, self.context_reserve_max)
    }
}

/// Cap for a streaming model/layer-span cache (ds4 upstream): a third of the pool on
/// unified memory, two thirds on a discrete card, clamped to [8, 48] GiB. A cap, not an
/// eager allocation.
pub fn stream_cache_cap(kind: DeviceKind, pool_total: u64) -> u64 {
    let raw = if kind.is_unified() {
        pool_total / 3
    } else {
        pool_total / 3 * 2
    };
    raw.clamp(8 * GIB, 48 * GIB)
}

/// ds4's admission test for one allocation: admitted iff usable ≥ reserve and
/// `bytes ≤ usable − reserve`.
pub fn admit(bytes: u64, usable: u64, reserve: u64) -> bool {
    usable >= reserve && bytes <= usable - reserve
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ds4_arena_sizes() {
        // ds4's unit test: 64 MiB → a shared 1792 MiB arena; large spans are exact.
        let p = Policy::default();
        assert_eq!(p.arena_bytes_for(64 * MIB), 1792 * MIB);
        for m in [256, 640, 896, 1024, 1152, 2049] {
            assert_eq!(p.arena_bytes_for(m * MIB), m * MIB);
        }
        assert_eq!(p.arena_bytes_for(256 * MIB - 1), 1792 * MIB);
    }

    #[test]
    fn ds4_stream_cache_caps() {
        assert_eq!(
            stream_cache_cap(DeviceKind::IntegratedUma, 96 * GIB),
            32 * GIB
        );
        assert_eq!(
            stream_cache_cap(DeviceKind::IntegratedUma, 16 * GIB),
            8 * GIB
        );
        assert_eq!(stream_cache_cap(DeviceKind::Discrete, 24 * GIB), 16 * GIB);
        assert_eq!(stream_cache_cap(DeviceKind::Discrete, 1024 * GIB), 48 * GIB);
    }

    #[test]
    fn ds4_admission() {
        let usable = 10 * GIB;
        // An allocation equal to all usable memory is refused (the reserve must stay).
        assert!(!admit(usable, usable, 2 * GIB));
        assert!(admit(8 * GIB, usable, 2 * GIB));
        assert!(!admit(8 * GIB + 1, usable, 2 * GIB));
        assert!(
            !admit(0, GIB, 2 * GIB),
            "usable below the reserve admits nothing"
        );
    }

    #[test]
    fn context_reserve_clamp() {
        let p = Policy::default();
        assert_eq!(p.context_reserve(16 * GIB), 8 * GIB);
        assert_eq!(p.context_reserve(96 * GIB), 24 * GIB);
        assert_eq!(p.context_reserve(400 * GIB), 40 * GIB);
    }

    #[test]
    fn policy_validation() {
        assert_eq!(Policy::default().validate(), Ok(()));
        let bad = Policy {
            span_alignment: 3,
            ..Policy::default()
        };
        assert_eq!(bad.validate(), Err(PolicyError::Alignment(3)));
        let bad = Policy {
            shared_arena_bytes: 100,
            ..Policy::default()
        };
        assert!(matches!(
            bad.validate(),
            Err(PolicyError::ArenaSmallerThanSpan { .. })
        ));
        let bad = Policy {
            integrated_weights_chain: vec![MemKind::Device, MemKind::Device],
            ..Policy::default()
        };
        assert_eq!(
            bad.validate(),
            Err(PolicyError::Chain {
                which: "integrated"
            })
        );
        let bad = Policy {
            context_reserve_min: 50 * GIB,
            ..Policy::default()
        };
        assert!(matches!(
            bad.validate(),
            Err(PolicyError::ReserveRange { .. })
        ));
    }
}
