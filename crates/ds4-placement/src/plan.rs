//! The planner's output: what a backend allocator must do, in order.
//!
//! A [`Plan`] lists weight [`Arena`]s (memory kind, exact size, fallback chain, and the
//! tensor spans with their offsets inside the arena), then the session [`Buffer`]s (KV,
//! scratch, admitted optional caches). An allocator walks both lists in order, allocates
//! each entry with its kind, and on failure tries the entry's `fallback` kinds after
//! re-checking admission; it allocates nothing that is not listed.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::device::DeviceKind;
use crate::inventory::{TensorClass, WeightSet};
use crate::request::Source;

/// Memory kinds a backend allocator provides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemKind {
    /// Device pool (`cudaMalloc` / `hipMalloc`).
    Device,
    /// Pinned host memory mapped into the device (`cudaHostAlloc` / `hipHostMalloc`,
    /// default flags); the device reads it in place.
    PinnedHost,
    /// Managed memory (`cudaMallocManaged` / `hipMallocManaged`) with the arena's advice.
    Managed,
    /// Ordinary host memory registered with the device (`cudaHostRegister`).
    HostRegistered,
    /// Ordinary pageable host memory (CPU backend).
    Pageable,
}

impl MemKind {
    pub fn label(self) -> &'static str {
        match self {
            MemKind::Device => "device",
            MemKind::PinnedHost => "pinned host",
            MemKind::Managed => "managed",
            MemKind::HostRegistered => "registered host",
            MemKind::Pageable => "host (pageable)",
        }
    }

    /// Whether this kind lives in host RAM on a discrete machine.
    pub fn is_host(self) -> bool {
        !matches!(self, MemKind::Device)
    }

    /// Whether RLIMIT_MEMLOCK can bound this kind (when the runtime pins via mlock).
    pub fn is_locked(self) -> bool {
        matches!(self, MemKind::PinnedHost | MemKind::HostRegistered)
    }
}

impl fmt::Display for MemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// Advice the allocator applies to a managed arena (best effort: errors are cleared).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ManagedAdvice {
    #[default]
    None,
    /// AMD coarse-grain hint (`hipMemAdviseSetCoarseGrain`): large speed-up on APUs.
    CoarseGrain,
    /// CUDA read-mostly + preferred location = device (coherent UMA weights).
    ReadMostlyPreferDevice,
}

/// One tensor inside an arena.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    /// Index into the inventory's tensor list.
    pub tensor: usize,
    pub name: String,
    pub offset: u64,
    pub bytes: u64,
}

/// One allocation holding weights.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arena {
    /// Position in allocation order.
    pub id: usize,
    pub kind: MemKind,
    /// Kinds to try, in order, if allocating `kind` fails (empty: fail).
    pub fallback: Vec<MemKind>,
    /// Applied if the arena is allocated as managed (planned or by fallback).
    pub advice: ManagedAdvice,
    /// A single large tensor with an exact-size allocation.
    pub dedicated: bool,
    /// Allocation size (exact: the end of the last span).
    pub bytes: u64,
    pub spans: Vec<Span>,
    /// Bytes in the arena not covered by a span (alignment padding).
    pub stranded: u64,
}

/// What a session buffer holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferPurpose {
    Kv,
    Scratch,
    OptionalCache,
    /// Slots for routed experts streamed from the model file (see [`ExpertStream`]).
    ExpertCache,
    /// The MTP block's session memory ([`crate::Request::mtp_state_bytes`]).
    MtpState,
}

/// A non-weight allocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Buffer {
    pub purpose: BufferPurpose,
    pub name: String,
    pub kind: MemKind,
    pub fallback: Vec<MemKind>,
    pub bytes: u64,
}

/// Overall weights placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightsMode {
    Device,
    PinnedHost,
    Managed,
    Pageable,
    /// Per-token tensors on the device, (most) routed experts in pinned host memory.
    Hybrid,
    /// Everything but the routed experts resident; routed experts read from the model
    /// file on demand into a fixed expert cache ([`Plan::stream`]).
    Streamed,
}

impl WeightsMode {
    pub fn label(self) -> &'static str {
        match self {
            WeightsMode::Device => "device",
            WeightsMode::PinnedHost => "pinned host",
            WeightsMode::Managed => "managed",
            WeightsMode::Pageable => "host (pageable)",
            WeightsMode::Hybrid => "hybrid (device + pinned host)",
            WeightsMode::Streamed => "streamed routed experts (resident rest + expert cache)",
        }
    }
}

/// The rule that made a decision (stable identifiers for JSON and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// A CLI flag or variable forced this kind.
    Override,
    /// Integrated/coherent UMA: first kind of the weights chain that fits.
    UmaWeightsChain,
    /// Discrete GPU: everything fits the device pool.
    DiscreteFits,
    /// Discrete GPU too small: per-token tensors on the device, experts in pinned host.
    DiscreteHybrid,
    /// CPU backend: only host memory exists.
    CpuOnly,
    /// ds4 managed-KV rule: KV ≥ 8 GiB goes managed.
    KvLarge,
    /// Context buffers larger than the device room.
    ContextExceedsDevice,
    /// ds4 rule: context buffers < 8 GiB stay in the device pool.
    ContextSmall,
    /// ds4 rule: the device pool would keep less than clamp(total/4, 8, 40) GiB free.
    ContextPressure,
    /// ds4 rule: the device pool keeps its reserve after the context buffers.
    ContextRoom,
    /// Discrete GPU: session buffers stay on the device.
    DiscreteContext,
    /// Managed memory was chosen but the runtime lacks it.
    ManagedUnavailable,
    /// Optional cache admitted: it leaves the workspace reserve free.
    OptionalAdmitted,
    /// Optional cache dropped: it would eat into the workspace reserve.
    OptionalDropped,
    /// Nothing resident fits: routed experts are streamed through an expert cache.
    ExpertsStreamed,
    MtpLeftOut,
}

impl Rule {
    pub fn text(self) -> &'static str {
        match self {
            Rule::Override => "forced by an override",
            Rule::UmaWeightsChain => "unified memory: first kind of the weights chain that fits",
            Rule::DiscreteFits => "discrete GPU: everything fits the device pool",
            Rule::DiscreteHybrid => "discrete GPU too small: per-token tensors on the device, routed experts in pinned host",
            Rule::CpuOnly => "CPU backend: host memory only",
            Rule::KvLarge => "ds4 managed-KV rule: KV >= 8 GiB goes managed",
            Rule::ContextExceedsDevice => "context buffers exceed the device room",
            Rule::ContextSmall => "ds4 rule: context buffers < 8 GiB stay on the device",
            Rule::ContextPressure => "ds4 rule: the device would keep less than clamp(total/4, 8, 40) GiB free",
            Rule::ContextRoom => "ds4 rule: the device keeps its reserve after the context buffers",
            Rule::DiscreteContext => "discrete GPU: session buffers on the device",
            Rule::ManagedUnavailable => "managed memory unsupported by the runtime",
            Rule::OptionalAdmitted => "optional cache leaves the workspace reserve free",
            Rule::OptionalDropped => "optional cache would eat into the workspace reserve",
            Rule::ExpertsStreamed => "nothing resident fits: routed experts streamed from the file through an expert cache",
            Rule::MtpLeftOut => "the MTP block does not fit next to the model under the model's own plan: left out, drafting falls back to prompt lookup",
        }
    }
}

/// An option considered and rejected before the decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attempt {
    pub option: String,
    pub reason: String,
}

/// One decision, with everything the report shows about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// "weights", "kv", "scratch", or `optional:<name>`.
    pub subject: String,
    /// `None` for a dropped optional cache.
    pub kind: Option<MemKind>,
    pub bytes: u64,
    pub rule: Rule,
    /// Numbers behind the rule.
    pub detail: String,
    /// Options tried first (the fallback steps the planner took).
    pub rejected: Vec<Attempt>,
    /// Where the setting came from (default / env / CLI).
    pub source: Source,
    /// The override that would change this decision.
    pub change: String,
}

/// Which budget a ledger line is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pool {
    Host,
    Device,
    Memlock,
}

impl Pool {
    pub fn label(self) -> &'static str {
        match self {
            Pool::Host => "host memory",
            Pool::Device => "device pool",
            Pool::Memlock => "RLIMIT_MEMLOCK",
        }
    }
}

/// Bytes charged to one budget, by purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolLedger {
    pub pool: Pool,
    pub budget: u64,
    pub weights: u64,
    pub kv: u64,
    pub scratch: u64,
    pub optional: u64,
    /// Host pool on unified memory: device-pool bytes beyond the carve-out (GTT is RAM).
    pub via_device: u64,
}

impl PoolLedger {
    pub fn new(pool: Pool, budget: u64) -> Self {
        PoolLedger {
            pool,
            budget,
            weights: 0,
            kv: 0,
            scratch: 0,
            optional: 0,
            via_device: 0,
        }
    }

    pub fn used(&self) -> u64 {
        self.weights
            .saturating_add(self.kv)
            .saturating_add(self.scratch)
            .saturating_add(self.optional)
            .saturating_add(self.via_device)
    }

    pub fn fits(&self) -> bool {
        self.used() <= self.budget
    }

    pub fn headroom(&self) -> u64 {
        self.budget.saturating_sub(self.used())
    }

    pub fn short(&self) -> u64 {
        self.used().saturating_sub(self.budget)
    }
}

/// All budgets a plan was checked against.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ledger {
    pub host: PoolLedger,
    pub device: PoolLedger,
    /// Present when the runtime pins through mlock and a limit is set.
    pub memlock: Option<PoolLedger>,
}

impl Ledger {
    pub fn fits(&self) -> bool {
        self.host.fits() && self.device.fits() && self.memlock.as_ref().is_none_or(PoolLedger::fits)
    }

    pub fn pools(&self) -> impl Iterator<Item = &PoolLedger> {
        [Some(&self.host), Some(&self.device), self.memlock.as_ref()]
            .into_iter()
            .flatten()
    }
}

/// The facts and derived budgets, as the report prints them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetFacts {
    pub device_name: String,
    pub device_kind: DeviceKind,
    pub mem_total: u64,
    pub mem_available: u64,
    pub cma_free: u64,
    /// MemAvailable − CmaFree (Linux) / min(avail, commit) (Windows).
    pub os_available: u64,
    /// The cgroup's remaining allowance, if a limit is set.
    pub cgroup_available: Option<u64>,
    /// min(os_available, cgroup_available).
    pub host_available: u64,
    pub os_reserve: u64,
    pub os_reserve_source: Source,
    /// host_available − os_reserve (0 if the reserve does not fit).
    pub host_budget: u64,
    pub runtime_total: u64,
    pub runtime_free: u64,
    pub device_limit: Option<u64>,
    pub device_limit_source: Source,
    pub carve_out_free: u64,
    /// Unified memory: carve-out + host_available, the bound on device free (ds4 clamp).
    pub uma_clamp: Option<u64>,
    /// Device pool total after the limit.
    pub pool_total: u64,
    /// Device free after the limit and the clamp.
    pub pool_free: u64,
    pub device_reserve: u64,
    /// pool_free − device_reserve.
    pub device_budget: u64,
    pub memlock_limit: Option<u64>,
    pub memlock_enforced: bool,
}

/// Tensors of one class (and weight set) in one memory kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassRow {
    pub class: TensorClass,
    pub set: WeightSet,
    pub kind: MemKind,
    pub tensors: usize,
    pub bytes: u64,
}

/// How the loader should fill the arenas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadStrategy {
    /// `pread` straight into the final host-visible buffer, then drop the page cache
    /// (`POSIX_FADV_DONTNEED`): no mmap→device copy (slow on ROCm), no double residency.
    PreadIntoHostDropCache,
    /// `pread` into pinned staging buffers and copy to the device.
    PreadStagedCopy,
    /// Map the file (CPU backend); the page cache is the weights' memory.
    Mmap,
}

impl LoadStrategy {
    pub fn text(self) -> &'static str {
        match self {
            LoadStrategy::PreadIntoHostDropCache => {
                "pread into the final buffers, then drop the page cache"
            }
            LoadStrategy::PreadStagedCopy => {
                "pread through pinned staging buffers, copy to the device"
            }
            LoadStrategy::Mmap => "mmap the file",
        }
    }
}

/// Everything decided before the first byte is copied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub mode: WeightsMode,
    pub ctx: u64,
    pub facts: BudgetFacts,
    /// Weight arenas in allocation order.
    pub arenas: Vec<Arena>,
    /// Session buffers in allocation order (after the arenas).
    pub buffers: Vec<Buffer>,
    pub classes: Vec<ClassRow>,
    pub decisions: Vec<Decision>,
    pub ledger: Ledger,
    pub load: LoadStrategy,
    pub warnings: Vec<String>,
    /// With [`WeightsMode::Streamed`]: how routed experts are streamed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<ExpertStream>,
    /// The MTP block, when the inventory held one: resident, or left out because it does
    /// not fit next to the model under the plan the model alone gets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtp: Option<MtpPlacement>,
}

/// What the plan did with the MTP block ([`crate::WeightSet::Mtp`] tensors and
/// [`crate::Request::mtp_state_bytes`]).
///
/// The block is optional (a drafter) and never changes how the model itself is placed:
/// the model is planned alone first, and the block is added only when the plan with it
/// fits in the same weights mode ([`WeightsMode`]): a model that fits the device is never
/// made hybrid or streamed for the block's sake. Otherwise the model's plan is used and
/// the block is left out (`resident: false`, `reason` says why), and drafting falls back
/// to prompt lookup.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MtpPlacement {
    /// Bytes of the block's tensors (dense weights and its routed experts).
    pub weight_bytes: u64,
    /// Its session memory (KV ring, scratch, stream ring).
    pub state_bytes: u64,
    /// Whether the plan holds it (its tensors in the arenas, its state in the buffers).
    pub resident: bool,
    /// Why it was left out (empty when resident).
    pub reason: String,
}

/// What a streamed plan promises an expert cache built from it.
///
/// * The tensors in [`ExpertStream::tensors`] are **not** in any arena: they stay in the
///   model file. Expert `e` of tensor `t` is the `expert_bytes` bytes at
///   `e · expert_bytes` within that tensor's data (experts are the outermost dimension),
///   so one (layer, expert) unit is that slice of each of the layer's tensors.
/// * [`ExpertStream::cache`] (the `ExpertCache` buffer in [`Plan::buffers`], already
///   charged to its pool) holds `cache_slots` units of `slot_bytes` each (the largest
///   unit of any layer); `host_tier` is an optional second tier in host memory.
/// * One token needs `per_token_bytes` of units (its experts in every layer); the
///   cache is at least that plus the policy's extra, so a layer's experts never evict
///   each other while it runs and the next layer's can be read ahead.
/// * `predicted_tokens_per_s` is an estimate from two stated **assumptions**, not a
///   measurement: the disk's read rate and the hit rate (uniform routing: the cached
///   fraction of all units).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertStream {
    pub tensors: Vec<StreamedTensor>,
    /// Experts per routed tensor and used per token per layer.
    pub experts_per_layer: u32,
    pub experts_per_token: u32,
    /// Largest (layer, expert) unit: one expert's slice of all the layer's tensors.
    pub slot_bytes: u64,
    /// Units of all layers (experts × layers) and their bytes.
    pub units: u64,
    pub all_bytes: u64,
    /// One token's units over all layers.
    pub per_token_bytes: u64,
    /// Smallest cache the plan accepts (per-token set + the policy's extra).
    pub min_cache_bytes: u64,
    pub cache: Buffer,
    pub cache_slots: u64,
    /// Second tier in host memory (pinned host on a discrete GPU), if any.
    pub host_tier: Option<Buffer>,
    pub host_tier_slots: u64,
    /// Assumed (or, when the request carried one, measured) disk read rate.
    pub read_bytes_per_s: u64,
    pub read_rate_measured: bool,
    /// Assumed fraction of a token's units found in the cache tiers (uniform routing).
    pub assumed_hit_rate: f64,
    /// Disk bytes per token at that hit rate, and the tokens/s the disk alone allows.
    pub disk_bytes_per_token: u64,
    pub predicted_tokens_per_s: Option<f64>,
}

/// A routed-expert tensor left in the file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamedTensor {
    /// Index into the inventory's tensor list.
    pub tensor: usize,
    pub name: String,
    pub layer: Option<u32>,
    pub bytes: u64,
    pub expert_bytes: u64,
}

impl Plan {
    /// Total bytes of all weight arenas.
    pub fn weights_bytes(&self) -> u64 {
        self.arenas.iter().map(|a| a.bytes).sum()
    }

    /// Stranded bytes over all arenas.
    pub fn stranded_bytes(&self) -> u64 {
        self.arenas.iter().map(|a| a.stranded).sum()
    }

    /// The decision about one subject ("weights", "kv", "scratch", `optional:<name>`).
    pub fn decision(&self, subject: &str) -> Option<&Decision> {
        self.decisions.iter().find(|d| d.subject == subject)
    }

    /// The buffer for a purpose (first one).
    pub fn buffer(&self, purpose: BufferPurpose) -> Option<&Buffer> {
        self.buffers.iter().find(|b| b.purpose == purpose)
    }

    /// Bytes of weights of `class` placed in `kind`.
    pub fn class_bytes_in(&self, class: TensorClass, kind: MemKind) -> u64 {
        self.classes
            .iter()
            .filter(|r| r.class == class && r.kind == kind)
            .map(|r| r.bytes)
            .sum()
    }

    /// JSON form (for `ds4 plan --json`).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}
