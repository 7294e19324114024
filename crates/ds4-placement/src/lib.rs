//! Memory placement planner for ds4-rs: decides, before a single byte is allocated or
//! copied, where every weight tensor, the KV cache and the scratch buffers live, and
//! refuses with numbers when nothing fits.
//!
//! # Why a planner
//! On unified-memory machines (AMD Strix Halo: 128 GB of RAM but a ~62 GiB device pool at
//! stock kernel settings; NVIDIA GB10) a resident 80.76 GiB DeepSeek V4 Flash q2 used to
//! die with an opaque out-of-memory halfway through preparing tensors. The fix (ds4
//! PR #1028) is to put weights in pinned host memory the GPU reads directly. This crate
//! turns that, and the neighbouring rules ds4 learned, into one pure function,
//! [`plan()`], whose decisions are all visible in a report together with the override
//! that would change each of them. The planner decides; allocators obey.
//!
//! # Budgets
//! - Usable host = MemAvailable − CmaFree (CMA pages cannot back pinned GPU pages),
//!   further bounded by the cgroup's remaining allowance, minus the OS reserve (2 GiB,
//!   `--os-reserve-gib`). Every allocation backed by host RAM is charged here: pinned,
//!   managed, pageable, and on unified memory also device-pool bytes beyond a BIOS
//!   carve-out (GTT pages are RAM).
//! - Device pool = runtime free, capped by `--device-mem-limit-gib`; on unified memory
//!   clamped to carve-out + host available (ds4's mem-get-info clamp, which with no
//!   carve-out is exactly min(runtime free, MemAvailable − CmaFree)); minus a small
//!   device reserve for runtime-internal allocations.
//! - RLIMIT_MEMLOCK bounds pinned memory only where the runtime pins through mlock
//!   ([`DeviceCaps::pinned_counts_against_memlock`]); otherwise a low limit is a warning.
//!
//! # Weights
//! - Integrated UMA (AMD APU): pinned host → managed → device; the first kind that fits
//!   (with KV and scratch) wins, the rest of the chain is the load-time fallback.
//! - Coherent UMA (GB10): managed (read-mostly, preferred on device) → pinned → device.
//! - Discrete: the device pool if everything fits. Otherwise a **hybrid** plan: tensors
//!   read whole for every token (attention, shared expert, router, norms, HC,
//!   compressor, indexer, head) stay on the device with the session buffers; routed
//!   experts (6 of 256 per layer per token) and the embedding (one row per token) go to
//!   pinned host memory, then as many experts as fit are moved back onto the device.
//!   Host memory is never used on a discrete GPU that has room, and never without the
//!   device being able to read it in place; else a refusal with numbers.
//! - CPU backend: pageable host memory.
//! - `--weights-mem device|host|managed` forces a kind with no fallback chain.
//!
//! # Streamed experts
//! When nothing resident fits (or with `--experts stream` / `DS4_EXPERTS=stream`), and
//! the request gives the routed-expert shape, the plan keeps every routed-expert tensor
//! in the model file and plans the rest exactly like a resident model without them. The
//! expert cache then takes the room left in the pool the device computes from (device
//! memory on a discrete GPU, the weights' kind on unified memory, host memory on the
//! CPU; in host memory beyond its minimum it leaves the optional-cache reserve free), in
//! whole (layer, expert) units; a discrete GPU gets a second tier in pinned host memory
//! where RAM allows. The plan is refused only when the cache cannot hold one token's
//! units plus [`Policy::stream_min_extra_cache`]. Its speed estimate (tokens/s the disk
//! allows) rests on two assumptions it states: the disk's read rate (measured when the
//! request carries one, else the policy's) and a hit rate equal to the cached share of
//! all units (uniform routing). [`plan::ExpertStream`] says what an expert cache may
//! rely on. `--experts resident` never streams. `--expert-cache-gib N` caps the cache
//! (refused below the minimum; a capped cache gets no host tier). The engine runs such a
//! plan with an LRU cache of `cache_slots` units behind a host tier of `host_tier_slots`
//! (at least the engine's minimum, which holds its reads in flight), reading the next
//! layer's predicted experts ahead (docs/placement.md §9).
//!
//! # Arenas
//! A tensor of at least 256 MiB gets its own allocation of exactly its size (rounded
//! chunks stranded up to 13 GiB in ds4); smaller tensors are bump-allocated, 256-byte
//! aligned, into shared arenas of at most 1792 MiB (thousands of driver allocations are
//! slow), each sized to what it holds. Both sizes are [`Policy`] fields.
//!
//! # KV and scratch
//! ds4's managed-KV rule on unified memory: KV ≥ 8 GiB → managed; context buffers that
//! exceed the device room → managed; < 8 GiB → device; otherwise managed when the device
//! would keep less than clamp(total/4, 8 GiB, 40 GiB) free. Scratch follows the same
//! rule (ds4 PR #361: a 96 GB carve-out left no room for 16k-context scratch).
//! `DS4_CUDA_MANAGED=1` forces managed scratch. Discrete GPUs keep both on the device.
//! Optional caches are admitted last and only when they leave 8 GiB free.
//!
//! # Refusals
//! A [`Refusal`] lists each option tried with the pool that was short and by how much,
//! and remedies (smaller `--ctx`, q2 instead of q4, raising GTT via `ttm.pages_limit`, a
//! bigger container limit, dropping an override, …), each verified by re-planning with
//! only that change.
//!
//! # Layout
//! [`host`] and [`device`] facts (pure parsers; [`probe`] is the only I/O), the
//! [`inventory`], the [`request`] and its overrides (one table: [`OVERRIDE_TABLE`]), the
//! [`policy`], the output [`plan`](mod@plan) types, the [`refusal`], and the [`executor`]
//! that runs a plan through a backend's [`Allocator`] (fallback chains, rollback).

pub mod bytes;
pub mod device;
pub mod executor;
pub mod host;
pub mod inventory;
pub mod plan;
mod planner;
pub mod policy;
pub mod probe;
pub mod refusal;
mod report;
pub mod request;
pub mod switch;

pub use device::{DeviceCaps, DeviceFacts, DeviceKind, DeviceProbe, FixedDevice};
pub use executor::{execute, Actual, AllocError, Allocated, Allocator, LoadFailure};
pub use host::{parse_meminfo, CgroupFacts, CgroupVersion, HostFacts, HostOs, MemInfo};
pub use inventory::{TensorClass, TensorInventory, TensorSpec, WeightSet};
pub use plan::{
    Arena, BudgetFacts, Buffer, BufferPurpose, ClassRow, Decision, ExpertStream, Ledger,
    LoadStrategy, ManagedAdvice, MemKind, MtpPlacement, Plan, Pool, PoolLedger, Rule, Span,
    StreamedTensor, WeightsMode,
};
pub use planner::plan;
pub use policy::{admit, stream_cache_cap, Policy};
pub use refusal::{FitRefusal, Refusal, Remedy, Shortfall, Unsupported};
pub use request::{
    override_table_markdown, resolve_overrides, CliOverrides, ExpertsChoice, MemChoice,
    OptionalCache, Overrides, Request, RoutedExperts, Setting, Source, OVERRIDE_TABLE,
};
pub use switch::{parse_switch, resolve_switch, SWITCH_WORDS};

/// A described machine, as `ds4 plan --machine FILE.json` reads it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineFacts {
    /// Free-form description shown in reports and tests.
    #[serde(default)]
    pub description: String,
    pub host: HostFacts,
    pub device: DeviceFacts,
}

impl MachineFacts {
    /// Parses a machine file.
    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }
}
