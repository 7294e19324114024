//! What a backend reports about its device.
//!
//! Backends fill [`DeviceFacts`] from the runtime (`integrated`, mem-get-info, attribute
//! queries) through [`DeviceProbe`]; tests and `--machine` files fill it from JSON. The
//! planner treats the runtime's free number as authoritative for the device pool and
//! only ever lowers it (integrated clamp, `--device-mem-limit-gib`).

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::bytes::size;

/// How the device's memory relates to host RAM; this picks the weights policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    /// Own VRAM over PCIe (any NVIDIA/AMD card, H200).
    Discrete,
    /// Integrated GPU sharing RAM through an aperture (AMD APU: Strix Halo). The device
    /// pool (carve-out + GTT) is smaller than RAM at stock settings.
    IntegratedUma,
    /// Integrated and cache-coherent with the CPU (NVIDIA GB10 / DGX Spark: managed and
    /// pageable memory access are native).
    CoherentUma,
    /// No accelerator: the CPU backend. Everything is ordinary host memory.
    CpuOnly,
}

impl DeviceKind {
    /// Device memory is carved from the same RAM the OS uses.
    pub fn is_unified(self) -> bool {
        matches!(self, DeviceKind::IntegratedUma | DeviceKind::CoherentUma)
    }

    pub fn describe(self) -> &'static str {
        match self {
            DeviceKind::Discrete => "discrete GPU",
            DeviceKind::IntegratedUma => "integrated GPU, unified memory",
            DeviceKind::CoherentUma => "integrated GPU, coherent unified memory",
            DeviceKind::CpuOnly => "CPU only",
        }
    }
}

/// Allocation kinds the runtime supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceCaps {
    /// `cudaHostAlloc` / `hipHostMalloc` work.
    #[serde(default = "yes")]
    pub pinned_host: bool,
    /// `cudaMallocManaged` / `hipMallocManaged` work (Windows APUs: often not).
    #[serde(default = "yes")]
    pub managed: bool,
    /// `cudaHostRegister` / `hipHostRegister` of ordinary memory works (not on GB10).
    #[serde(default)]
    pub host_register: bool,
    /// Kernels can read pinned host memory directly (mapped, zero-copy). Required for
    /// host-resident weights on any GPU, and for the hybrid plan.
    #[serde(default = "yes")]
    pub host_mapped: bool,
    /// Kernels can read ordinary pageable memory (HMM/ATS; GB10).
    #[serde(default)]
    pub pageable_access: bool,
    /// The runtime accepts a coarse-grain hint for managed memory (AMD; best effort).
    #[serde(default)]
    pub coarse_grain_advice: bool,
    /// The runtime pins host memory through `mlock`, so RLIMIT_MEMLOCK bounds pinned and
    /// registered allocations. CUDA and HIP drivers pin outside it (default false).
    #[serde(default)]
    pub pinned_counts_against_memlock: bool,
}

fn yes() -> bool {
    true
}

impl Default for DeviceCaps {
    fn default() -> Self {
        DeviceCaps {
            pinned_host: true,
            managed: true,
            host_register: false,
            host_mapped: true,
            pageable_access: false,
            coarse_grain_advice: false,
            pinned_counts_against_memlock: false,
        }
    }
}

/// The device facts the planner consumes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceFacts {
    pub name: String,
    pub kind: DeviceKind,
    /// Device pool total as the runtime reports it (`cudaMemGetInfo` total).
    #[serde(with = "size")]
    pub pool_total: u64,
    /// Device pool free right now (mem-get-info free).
    #[serde(with = "size")]
    pub pool_free: u64,
    /// Integrated only: free bytes of a BIOS carve-out (dedicated VRAM the OS does not
    /// see as RAM). Device allocations up to this much do not consume MemAvailable.
    #[serde(default, with = "size")]
    pub carve_out_free: u64,
    #[serde(default)]
    pub caps: DeviceCaps,
}

impl DeviceFacts {
    /// A CPU-only "device" for the CPU backend.
    pub fn cpu() -> Self {
        DeviceFacts {
            name: "CPU".to_string(),
            kind: DeviceKind::CpuOnly,
            pool_total: 0,
            pool_free: 0,
            carve_out_free: 0,
            caps: DeviceCaps {
                pinned_host: false,
                managed: false,
                host_register: false,
                host_mapped: false,
                pageable_access: true,
                coarse_grain_advice: false,
                pinned_counts_against_memlock: false,
            },
        }
    }
}

/// A runtime query that failed.
#[derive(Debug, Error)]
#[error("device query {what} failed: {detail}")]
pub struct DeviceProbeError {
    pub what: &'static str,
    pub detail: String,
}

/// Implemented by each backend (CUDA, ROCm, CPU); the planner only sees the result.
pub trait DeviceProbe {
    fn device_facts(&self) -> Result<DeviceFacts, DeviceProbeError>;
}

/// Facts fixed in advance (a `--machine` file, a test).
#[derive(Debug, Clone)]
pub struct FixedDevice(pub DeviceFacts);

impl DeviceProbe for FixedDevice {
    fn device_facts(&self) -> Result<DeviceFacts, DeviceProbeError> {
        Ok(self.0.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::GIB;

    #[test]
    fn json_defaults_and_sizes() {
        let d: DeviceFacts = serde_json::from_str(
            r#"{"name":"Radeon 8060S","kind":"integrated_uma","pool_total":"62 GiB","pool_free":"61.5 GiB"}"#,
        )
        .unwrap();
        assert_eq!(d.pool_total, 62 * GIB);
        assert_eq!(d.pool_free, 61 * GIB + GIB / 2);
        assert_eq!(d.carve_out_free, 0);
        assert!(d.caps.pinned_host && d.caps.managed && d.caps.host_mapped);
        assert!(!d.caps.pinned_counts_against_memlock);
        assert!(d.kind.is_unified());
        assert!(serde_json::from_str::<DeviceFacts>(
            r#"{"name":"x","kind":"quantum","pool_total":1,"pool_free":1}"#
        )
        .is_err());
    }

    #[test]
    fn fixed_probe_returns_its_facts() {
        let f = DeviceFacts::cpu();
        assert_eq!(FixedDevice(f.clone()).device_facts().unwrap(), f);
        assert!(!DeviceKind::CpuOnly.is_unified() && !DeviceKind::Discrete.is_unified());
    }
}
