//! The planning algorithm (see the crate docs for the policy in words).

use std::collections::BTreeMap;

use crate::bytes::{fmt_bytes, fmt_gib, GIB, MIB};
use crate::device::{DeviceFacts, DeviceKind};
use crate::host::HostFacts;
use crate::inventory::WeightSet;
use crate::inventory::{TensorClass, TensorInventory};
use crate::plan::{
    Arena, Attempt, BudgetFacts, Buffer, BufferPurpose, ClassRow, Decision, Ledger, LoadStrategy,
    ManagedAdvice, MemKind, Plan, Pool, PoolLedger, Rule, Span, WeightsMode,
};
use crate::plan::{ExpertStream, MtpPlacement, StreamedTensor};
use crate::policy::Policy;
use crate::refusal::{FailedOption, FitRefusal, Refusal, Remedy, Shortfall, Unsupported};
use crate::request::{ExpertsChoice, MemChoice, Request, Setting, Source};

macro_rules! debug {
    ($($t:tt)*) => {
        #[cfg(feature = "tracing")]
        tracing::debug!($($t)*);
    };
}

/// Plans where every tensor and session buffer goes, or refuses with the reason.
///
/// Pure: no I/O, no environment, no global state; identical inputs give identical plans.
///
/// An MTP block in the inventory ([`WeightSet::Mtp`] tensors, with
/// [`Request::mtp_state_bytes`]) is optional: the model is planned without it (a refusal
/// is the model's own), then with it, and the plan with the block is taken only when it
/// fits in the same [`crate::WeightsMode`]; otherwise the model's plan is returned with
/// the block left out ([`Plan::mtp`], a `weights.mtp` decision and a warning say so).
pub fn plan(
    host: &HostFacts,
    device: &DeviceFacts,
    inventory: &TensorInventory,
    request: &Request,
    policy: &Policy,
) -> Result<Plan, Refusal> {
    let has_mtp = inventory.tensors.iter().any(|t| t.set == WeightSet::Mtp);
    if !has_mtp {
        let mut req = request.clone();
        req.mtp_state_bytes = 0;
        return plan_inner(host, device, inventory, &req, policy, true);
    }
    let main = TensorInventory::new(
        inventory
            .tensors
            .iter()
            .filter(|t| t.set != WeightSet::Mtp)
            .cloned()
            .collect(),
    );
    let mut main_req = request.clone();
    main_req.mtp_state_bytes = 0;
    let mut base = plan_inner(host, device, &main, &main_req, policy, true)?;
    let weight_bytes = inventory.set_bytes(WeightSet::Mtp);
    let state_bytes = request.mtp_state_bytes;
    let what = format!(
        "the MTP block ({} of weights + {} of state)",
        fmt_gib(weight_bytes),
        fmt_gib(state_bytes)
    );
    let reason = match plan_inner(host, device, inventory, request, policy, false) {
        Ok(mut p) if p.mode == base.mode => {
            p.mtp = Some(MtpPlacement {
                weight_bytes,
                state_bytes,
                resident: true,
                reason: String::new(),
            });
            return Ok(p);
        }
        Ok(p) => format!(
            "{what} fits only if the model's weights go {} instead of {}",
            p.mode.label(),
            base.mode.label()
        ),
        Err(Refusal::DoesNotFit(f)) => {
            let short: Vec<String> = f
                .tried
                .iter()
                .map(|o| match &o.note {
                    Some(n) if o.shortfalls.is_empty() => format!("{}: {n}", o.option),
                    _ => format!("{}: {}", o.option, describe_shortfalls(&o.shortfalls)),
                })
                .collect();
            format!(
                "{what} does not fit next to the model ({})",
                short.join("; ")
            )
        }
        Err(other) => return Err(other),
    };
    base.warnings.push(format!(
        "{reason}: the block is left out, and --draft mtp|auto draft by prompt lookup instead"
    ));
    base.decisions.push(Decision {
        subject: "weights.mtp".into(),
        kind: None,
        bytes: weight_bytes.saturating_add(state_bytes),
        rule: Rule::MtpLeftOut,
        detail: reason.clone(),
        rejected: Vec::new(),
        source: Source::Default,
        change: "a smaller context (-c), --experts stream, or --draft lookup (no block)".into(),
    });
    base.mtp = Some(MtpPlacement {
        weight_bytes,
        state_bytes,
        resident: false,
        reason,
    });
    Ok(base)
}

fn plan_inner(
    host: &HostFacts,
    device: &DeviceFacts,
    inv: &TensorInventory,
    req: &Request,
    policy: &Policy,
    want_remedies: bool,
) -> Result<Plan, Refusal> {
    policy.validate()?;
    inv.validate()?;
    req.validate()?;
    check_overrides(device, req)?;
    let kv = req.kv_bytes()?;
    let cx = Cx {
        device,
        inv,
        req,
        policy,
        facts: budget_facts(host, device, req, policy),
        kv,
        scratch: req.scratch_bytes,
    };
    let experts = req.overrides.experts.value;
    let result = if experts == ExpertsChoice::Stream {
        streamed_plan(host, device, inv, req, policy, &[])
    } else {
        let resident = match device.kind {
            DeviceKind::CpuOnly => cpu_plan(&cx),
            DeviceKind::Discrete => discrete_plan(&cx),
            DeviceKind::IntegratedUma | DeviceKind::CoherentUma => uma_plan(&cx),
        };
        // Streaming is the last resort: only when nothing resident fits.
        match resident {
            Err(mut tried) if experts == ExpertsChoice::Auto && req.routed_experts.is_some() => {
                match streamed_plan(host, device, inv, req, policy, &tried) {
                    Ok(p) => Ok(p),
                    Err(more) => {
                        tried.extend(more);
                        Err(tried)
                    }
                }
            }
            r => r,
        }
    };
    result.map_err(|tried| {
        let remedies = if want_remedies {
            find_remedies(host, device, inv, req, policy)
        } else {
            Vec::new()
        };
        Refusal::DoesNotFit(Box::new(FitRefusal {
            device_name: device.name.clone(),
            device_kind: device.kind,
            ctx: req.ctx,
            weights_bytes: inv.total_bytes(),
            kv_bytes: kv,
            scratch_bytes: req.scratch_bytes,
            facts: cx.facts.clone(),
            tried,
            remedies,
        }))
    })
}

/// Everything the planning steps share.
struct Cx<'a> {
    device: &'a DeviceFacts,
    inv: &'a TensorInventory,
    req: &'a Request,
    policy: &'a Policy,
    facts: BudgetFacts,
    kv: u64,
    scratch: u64,
}

fn budget_facts(
    host: &HostFacts,
    device: &DeviceFacts,
    req: &Request,
    policy: &Policy,
) -> BudgetFacts {
    let host_available = host.available();
    let (os_reserve, os_reserve_source) = match req.overrides.os_reserve.value {
        Some(b) => (b, req.overrides.os_reserve.source.clone()),
        None => (policy.os_reserve, Source::Default),
    };
    // ds4 admission: admitted iff usable ≥ reserve and bytes ≤ usable − reserve.
    let host_budget = host_available.saturating_sub(os_reserve);
    let device_limit = req.overrides.device_mem_limit.value;
    let (mut pool_total, mut pool_free) = match device.kind {
        DeviceKind::CpuOnly => (0, 0),
        _ => (device.pool_total, device.pool_free.min(device.pool_total)),
    };
    if let Some(l) = device_limit {
        pool_total = pool_total.min(l);
        pool_free = pool_free.min(l);
    }
    let uma_clamp = device
        .kind
        .is_unified()
        .then(|| device.carve_out_free.saturating_add(host_available));
    if let Some(c) = uma_clamp {
        pool_free = pool_free.min(c);
    }
    BudgetFacts {
        device_name: device.name.clone(),
        device_kind: device.kind,
        mem_total: host.mem_total,
        mem_available: host.mem_available,
        cma_free: host.cma_free,
        os_available: host.os_available(),
        cgroup_available: host.cgroup.as_ref().map(|c| c.available()),
        host_available,
        os_reserve,
        os_reserve_source,
        host_budget,
        runtime_total: device.pool_total,
        runtime_free: device.pool_free,
        device_limit,
        device_limit_source: req.overrides.device_mem_limit.source.clone(),
        carve_out_free: if device.kind.is_unified() {
            device.carve_out_free
        } else {
            0
        },
        uma_clamp,
        pool_total,
        pool_free,
        device_reserve: policy.device_reserve,
        device_budget: pool_free.saturating_sub(policy.device_reserve),
        memlock_limit: host.memlock_limit,
        memlock_enforced: device.caps.pinned_counts_against_memlock && host.memlock_limit.is_some(),
    }
}

fn supports(device: &DeviceFacts, kind: MemKind) -> bool {
    let c = &device.caps;
    match (device.kind, kind) {
        (DeviceKind::CpuOnly, MemKind::Pageable) => true,
        (DeviceKind::CpuOnly, _) => false,
        (_, MemKind::Device) => true,
        (_, MemKind::PinnedHost) => c.pinned_host && c.host_mapped,
        (_, MemKind::Managed) => c.managed,
        (_, MemKind::HostRegistered) => c.host_register && c.host_mapped,
        (_, MemKind::Pageable) => c.pageable_access,
    }
}

/// The kind a non-auto choice means on this device.
fn choice_kind(device: &DeviceFacts, c: MemChoice) -> Option<MemKind> {
    match (c, device.kind) {
        (MemChoice::Auto, _) => None,
        (MemChoice::Host, DeviceKind::CpuOnly) => Some(MemKind::Pageable),
        (MemChoice::Host, _) => Some(MemKind::PinnedHost),
        (MemChoice::Device, _) => Some(MemKind::Device),
        (MemChoice::Managed, _) => Some(MemKind::Managed),
    }
}

fn check_overrides(device: &DeviceFacts, req: &Request) -> Result<(), Refusal> {
    let o = &req.overrides;
    for (name, s) in [
        ("weights", &o.weights),
        ("KV", &o.kv),
        ("scratch", &o.scratch),
    ] {
        let Some(kind) = choice_kind(device, s.value) else {
            continue;
        };
        if supports(device, kind) {
            continue;
        }
        let reason = match (device.kind, kind) {
            (DeviceKind::CpuOnly, _) => "the CPU backend has only host memory".to_string(),
            (_, MemKind::PinnedHost) => format!(
                "{} cannot read pinned host memory directly (no host-mapped access)",
                device.name
            ),
            _ => format!("{} does not support {} memory", device.name, kind),
        };
        return Err(Refusal::Unsupported(Unsupported {
            setting: format!("{name} = {} ({})", s.value, s.source),
            reason,
            change: "Use `auto` or another kind (see the override table).".into(),
        }));
    }
    Ok(())
}

fn align_up(x: u64, a: u64) -> u64 {
    // `a` is a validated power of two ≤ 1 MiB and x ≤ a few arena sizes: no overflow.
    (x + a - 1) & !(a - 1)
}

/// A set of tensors that share a memory kind and fallback chain.
#[derive(Clone)]
struct Group {
    kind: MemKind,
    fallback: Vec<MemKind>,
    advice: ManagedAdvice,
}

/// Advice an arena gets if it ends up managed, as planned or by fallback.
fn advice_for(device: &DeviceFacts, kind: MemKind, fallback: &[MemKind]) -> ManagedAdvice {
    if kind != MemKind::Managed && !fallback.contains(&MemKind::Managed) {
        return ManagedAdvice::None;
    }
    match device.kind {
        DeviceKind::CoherentUma => ManagedAdvice::ReadMostlyPreferDevice,
        _ if device.caps.coarse_grain_advice => ManagedAdvice::CoarseGrain,
        _ => ManagedAdvice::None,
    }
}

/// Builds arenas: each tensor ≥ the large-span threshold gets an exact-size allocation;
/// smaller ones are bump-allocated (aligned) into shared arenas of at most the shared
/// size, each closed at its used size, so nothing but alignment padding is stranded.
fn build_arenas(cx: &Cx, groups: &[Group], assign: &[usize]) -> Vec<Arena> {
    let p = cx.policy;
    let mut arenas = Vec::new();
    for (gi, g) in groups.iter().enumerate() {
        let new_arena = |dedicated| Arena {
            id: 0,
            kind: g.kind,
            fallback: g.fallback.clone(),
            advice: g.advice,
            dedicated,
            bytes: 0,
            spans: Vec::new(),
            stranded: 0,
        };
        let mut open: Option<Arena> = None;
        for (ti, t) in cx.inv.tensors.iter().enumerate() {
            if assign[ti] != gi {
                continue;
            }
            let span = |offset| Span {
                tensor: ti,
                name: t.name.clone(),
                offset,
                bytes: t.bytes,
            };
            if t.bytes >= p.large_span_bytes {
                let mut a = new_arena(true);
                a.bytes = t.bytes;
                a.spans.push(span(0));
                arenas.push(a);
                continue;
            }
            let mut off = open
                .as_ref()
                .map_or(0, |a| align_up(a.bytes, p.span_alignment));
            if off + t.bytes > p.shared_arena_bytes {
                arenas.extend(open.take());
                off = 0;
            }
            let a = open.get_or_insert_with(|| new_arena(false));
            a.spans.push(span(off));
            a.bytes = off + t.bytes;
        }
        arenas.extend(open.take());
    }
    for (i, a) in arenas.iter_mut().enumerate() {
        a.id = i;
        a.stranded = a.bytes - a.spans.iter().map(|s| s.bytes).sum::<u64>();
    }
    arenas
}

fn ledger_for(cx: &Cx, arenas: &[Arena], buffers: &[Buffer]) -> Ledger {
    let f = &cx.facts;
    let mut host = PoolLedger::new(Pool::Host, f.host_budget);
    let mut dev = PoolLedger::new(Pool::Device, f.device_budget);
    let mut lock = f
        .memlock_enforced
        .then(|| PoolLedger::new(Pool::Memlock, f.memlock_limit.unwrap_or(u64::MAX)));
    for a in arenas {
        charge_weights(a.kind, a.bytes, &mut dev, &mut host, lock.as_mut());
    }
    for b in buffers {
        let mut targets: Vec<&mut PoolLedger> = vec![if b.kind == MemKind::Device {
            &mut dev
        } else {
            &mut host
        }];
        if b.kind.is_locked() {
            if let Some(l) = lock.as_mut() {
                targets.push(l);
            }
        }
        for t in targets {
            let slot = match b.purpose {
                // The MTP block's ring, stream ring and scratch: its session state.
                BufferPurpose::Kv | BufferPurpose::MtpState => &mut t.kv,
                BufferPurpose::Scratch => &mut t.scratch,
                BufferPurpose::OptionalCache => &mut t.optional,
                // The cache holds weights (streamed routed experts).
                BufferPurpose::ExpertCache => &mut t.weights,
            };
            *slot = slot.saturating_add(b.bytes);
        }
    }
    if cx.device.kind.is_unified() {
        host.via_device = dev.used().saturating_sub(f.carve_out_free);
    }
    Ledger {
        host,
        device: dev,
        memlock: lock,
    }
}

fn charge_weights(
    kind: MemKind,
    bytes: u64,
    dev: &mut PoolLedger,
    host: &mut PoolLedger,
    lock: Option<&mut PoolLedger>,
) {
    let t = if kind == MemKind::Device { dev } else { host };
    t.weights = t.weights.saturating_add(bytes);
    if kind.is_locked() {
        if let Some(l) = lock {
            l.weights = l.weights.saturating_add(bytes);
        }
    }
}

/// Largest additional allocation of `kind` that still fits every budget.
fn room_for(cx: &Cx, l: &Ledger, kind: MemKind) -> u64 {
    if kind == MemKind::Device {
        let d = l.device.headroom();
        if cx.device.kind.is_unified() {
            // Device bytes beyond the carve-out come out of host RAM too.
            let carve_left = cx.facts.carve_out_free.saturating_sub(l.device.used());
            d.min(carve_left.saturating_add(l.host.headroom()))
        } else {
            d
        }
    } else {
        let mut r = l.host.headroom();
        if kind.is_locked() {
            if let Some(m) = &l.memlock {
                r = r.min(m.headroom());
            }
        }
        r
    }
}

fn shortfalls(l: &Ledger) -> Vec<Shortfall> {
    l.pools()
        .filter(|p| !p.fits())
        .map(|p| Shortfall {
            pool: p.pool,
            needed: p.used(),
            budget: p.budget,
            weights: p.weights,
            kv: p.kv,
            scratch: p.scratch,
            via_device: p.via_device,
        })
        .collect()
}

fn describe_shortfalls(s: &[Shortfall]) -> String {
    s.iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

/// The result of laying out one candidate.
struct Built {
    arenas: Vec<Arena>,
    buffers: Vec<Buffer>,
    ledger: Ledger,
    decisions: Vec<Decision>,
}

fn change_hint(subject: &str) -> &'static str {
    match subject {
        "kv" => "--kv-mem auto|device|host|managed (DS4_KV_MEM)",
        "scratch" => "--scratch-mem auto|device|host|managed (DS4_SCRATCH_MEM; DS4_CUDA_MANAGED=1 = managed)",
        _ => "--weights-mem auto|device|host|managed (DS4_WEIGHTS_MEM; DS4_ROCM_FORCE_DEVICE_MEM=1 = device)",
    }
}

/// Places KV and scratch given the weights' ledger: overrides first, then the device
/// kind's rule (ds4's managed-KV rule on unified memory, applied to scratch as well).
fn place_context(cx: &Cx, weights_ledger: &Ledger) -> (Vec<Buffer>, Vec<Decision>) {
    let o = &cx.req.overrides;
    let kv_forced = choice_kind(cx.device, o.kv.value);
    let sc_forced = choice_kind(cx.device, o.scratch.value);
    // The MTP block's state is placed as the KV cache is (it is one more, small, ring).
    let mtp_state = cx.req.mtp_state_bytes;
    let auto_kv = if kv_forced.is_none() {
        cx.kv.saturating_add(mtp_state)
    } else {
        0
    };
    let auto_sc = if sc_forced.is_none() { cx.scratch } else { 0 };
    let context = auto_kv.saturating_add(auto_sc);
    let p = cx.policy;
    let (mut kind, mut rule, mut detail) = match cx.device.kind {
        DeviceKind::CpuOnly => (MemKind::Pageable, Rule::CpuOnly, String::new()),
        DeviceKind::Discrete => (MemKind::Device, Rule::DiscreteContext, String::new()),
        DeviceKind::IntegratedUma | DeviceKind::CoherentUma => {
            let free = room_for(cx, weights_ledger, MemKind::Device);
            let reserve = p.context_reserve(cx.facts.pool_total);
            let detail = format!(
                "context buffers {} (KV {} + scratch {}); device room {}; reserve clamp(total/4, {}, {}) = {}",
                fmt_bytes(context),
                fmt_bytes(auto_kv),
                fmt_bytes(auto_sc),
                fmt_gib(free),
                fmt_gib(p.context_reserve_min),
                fmt_gib(p.context_reserve_max),
                fmt_gib(reserve)
            );
            let (k, r) = if auto_kv >= p.kv_managed_bytes {
                (MemKind::Managed, Rule::KvLarge)
            } else if context > free {
                (MemKind::Managed, Rule::ContextExceedsDevice)
            } else if context < p.context_small_bytes {
                (MemKind::Device, Rule::ContextSmall)
            } else if free - context < reserve {
                (MemKind::Managed, Rule::ContextPressure)
            } else {
                (MemKind::Device, Rule::ContextRoom)
            };
            (k, r, detail)
        }
    };
    if kind == MemKind::Managed && !supports(cx.device, MemKind::Managed) {
        kind = if supports(cx.device, MemKind::PinnedHost) {
            MemKind::PinnedHost
        } else {
            MemKind::Device
        };
        detail = format!("{detail}; managed unsupported, using {kind}");
        rule = Rule::ManagedUnavailable;
    }
    let auto_fallback = if cx.device.kind.is_unified()
        && kind == MemKind::Device
        && !p.strict
        && supports(cx.device, MemKind::Managed)
    {
        vec![MemKind::Managed]
    } else {
        Vec::new()
    };
    let mut buffers = Vec::new();
    let mut decisions = Vec::new();
    for (subject, name, purpose, bytes, forced, setting) in [
        ("kv", "KV cache", BufferPurpose::Kv, cx.kv, kv_forced, &o.kv),
        (
            "scratch",
            "scratch",
            BufferPurpose::Scratch,
            cx.scratch,
            sc_forced,
            &o.scratch,
        ),
        (
            "mtp_state",
            "MTP state",
            BufferPurpose::MtpState,
            mtp_state,
            kv_forced,
            &o.kv,
        ),
    ] {
        if purpose == BufferPurpose::MtpState && bytes == 0 {
            continue;
        }
        let (k, r, d, fb) = match forced {
            Some(k) => (
                k,
                Rule::Override,
                format!("{} forced", fmt_bytes(bytes)),
                Vec::new(),
            ),
            None => (kind, rule, detail.clone(), auto_fallback.clone()),
        };
        if bytes > 0 {
            buffers.push(Buffer {
                purpose,
                name: name.to_string(),
                kind: k,
                fallback: fb,
                bytes,
            });
        }
        decisions.push(Decision {
            subject: subject.to_string(),
            kind: Some(k),
            bytes,
            rule: r,
            detail: d,
            rejected: Vec::new(),
            source: setting.source.clone(),
            change: change_hint(subject).to_string(),
        });
    }
    (buffers, decisions)
}

/// A candidate that did not fit: the pools it overflowed and its full ledger.
struct Rejected_ {
    shortfalls: Vec<Shortfall>,
    ledger: Ledger,
}

type Rejected = Box<Rejected_>;

/// Lays out one candidate assignment and checks every budget.
fn evaluate(cx: &Cx, groups: &[Group], assign: &[usize]) -> Result<Built, Rejected> {
    let arenas = build_arenas(cx, groups, assign);
    let wl = ledger_for(cx, &arenas, &[]);
    let (mut buffers, mut decisions) = place_context(cx, &wl);
    let mut ledger = ledger_for(cx, &arenas, &buffers);
    if !ledger.fits() {
        return Err(Box::new(Rejected_ {
            shortfalls: shortfalls(&ledger),
            ledger,
        }));
    }
    // Optional caches last, only if they leave the workspace reserve free.
    for c in &cx.req.optional_caches {
        let kind = if cx.device.kind == DeviceKind::CpuOnly {
            MemKind::Pageable
        } else {
            MemKind::Device
        };
        let room = room_for(cx, &ledger, kind);
        let admitted = room >= c.bytes.saturating_add(cx.policy.optional_reserve);
        let detail = format!(
            "{} requested; room {} in {}; must leave {}",
            fmt_bytes(c.bytes),
            fmt_gib(room),
            kind,
            fmt_gib(cx.policy.optional_reserve)
        );
        if admitted {
            buffers.push(Buffer {
                purpose: BufferPurpose::OptionalCache,
                name: c.name.clone(),
                kind,
                fallback: Vec::new(),
                bytes: c.bytes,
            });
            ledger = ledger_for(cx, &arenas, &buffers);
        }
        decisions.push(Decision {
            subject: format!("optional:{}", c.name),
            kind: admitted.then_some(kind),
            bytes: c.bytes,
            rule: if admitted {
                Rule::OptionalAdmitted
            } else {
                Rule::OptionalDropped
            },
            detail,
            rejected: Vec::new(),
            source: Source::Default,
            change:
                "optional: not required to run; free memory or shrink other buffers to admit it"
                    .into(),
        });
    }
    Ok(Built {
        arenas,
        buffers,
        ledger,
        decisions,
    })
}

fn weights_decision(
    subject: &str,
    kind: MemKind,
    bytes: u64,
    rule: Rule,
    detail: String,
    rejected: Vec<Attempt>,
    setting: &Setting<MemChoice>,
) -> Decision {
    Decision {
        subject: subject.to_string(),
        kind: Some(kind),
        bytes,
        rule,
        detail,
        rejected,
        source: setting.source.clone(),
        change: change_hint("weights").to_string(),
    }
}

fn chain_text(chain: &[MemKind]) -> String {
    if chain.is_empty() {
        "none".into()
    } else {
        chain
            .iter()
            .map(|k| k.label())
            .collect::<Vec<_>>()
            .join(" -> ")
    }
}

fn uma_plan(cx: &Cx) -> Result<Plan, Vec<FailedOption>> {
    let setting = &cx.req.overrides.weights;
    let forced = choice_kind(cx.device, setting.value);
    let chain: Vec<MemKind> = match forced {
        Some(k) => vec![k],
        None if cx.device.kind == DeviceKind::CoherentUma => {
            cx.policy.coherent_weights_chain.clone()
        }
        None => cx.policy.integrated_weights_chain.clone(),
    };
    let mut rejected = Vec::new();
    let mut tried = Vec::new();
    let usable: Vec<MemKind> = chain
        .iter()
        .copied()
        .filter(|k| {
            let ok = supports(cx.device, *k);
            if !ok {
                rejected.push(Attempt {
                    option: format!("weights in {k}"),
                    reason: "not supported by the runtime".into(),
                });
                tried.push(FailedOption {
                    option: format!("weights in {k}"),
                    shortfalls: Vec::new(),
                    note: Some("not supported by the runtime".into()),
                });
            }
            ok
        })
        .collect();
    let n = cx.inv.len();
    for (i, &kind) in usable.iter().enumerate() {
        let fallback = if forced.is_some() || cx.policy.strict {
            Vec::new()
        } else {
            usable[i + 1..].to_vec()
        };
        let group = Group {
            kind,
            fallback: fallback.clone(),
            advice: advice_for(cx.device, kind, &fallback),
        };
        match evaluate(cx, &[group], &vec![0; n]) {
            Ok(b) => {
                let (rule, detail) = match forced {
                    Some(_) => (Rule::Override, format!("forced by {}", setting.source)),
                    None => (
                        Rule::UmaWeightsChain,
                        format!(
                            "chain {}; fits {} (budget {}); load-time fallback: {}",
                            chain_text(&chain),
                            kind,
                            fmt_gib(pool_budget(&b.ledger, kind)),
                            chain_text(&fallback)
                        ),
                    ),
                };
                debug!(?kind, "uma weights placed");
                let bytes = b.arenas.iter().map(|a| a.bytes).sum();
                let d = weights_decision("weights", kind, bytes, rule, detail, rejected, setting);
                let mode = match kind {
                    MemKind::Device => WeightsMode::Device,
                    MemKind::Managed => WeightsMode::Managed,
                    MemKind::Pageable => WeightsMode::Pageable,
                    MemKind::PinnedHost | MemKind::HostRegistered => WeightsMode::PinnedHost,
                };
                return Ok(finish(cx, b, mode, vec![d]));
            }
            Err(r) => {
                let sf = r.shortfalls;
                rejected.push(Attempt {
                    option: format!("weights in {kind}"),
                    reason: describe_shortfalls(&sf),
                });
                tried.push(FailedOption {
                    option: format!("weights in {kind}"),
                    shortfalls: sf,
                    note: None,
                });
            }
        }
    }
    Err(tried)
}

fn pool_budget(l: &Ledger, kind: MemKind) -> u64 {
    if kind == MemKind::Device {
        l.device.budget
    } else {
        l.host.budget
    }
}

fn discrete_plan(cx: &Cx) -> Result<Plan, Vec<FailedOption>> {
    let setting = &cx.req.overrides.weights;
    let n = cx.inv.len();
    let mut tried = Vec::new();
    if let Some(kind) = choice_kind(cx.device, setting.value) {
        let g = Group {
            kind,
            fallback: Vec::new(),
            advice: advice_for(cx.device, kind, &[]),
        };
        let option = format!("weights in {kind} (forced by {})", setting.source);
        return match evaluate(cx, &[g], &vec![0; n]) {
            Ok(b) => {
                let bytes = b.arenas.iter().map(|a| a.bytes).sum();
                let d = weights_decision(
                    "weights",
                    kind,
                    bytes,
                    Rule::Override,
                    format!("forced by {}", setting.source),
                    Vec::new(),
                    setting,
                );
                let mode = match kind {
                    MemKind::Device => WeightsMode::Device,
                    MemKind::Managed => WeightsMode::Managed,
                    _ => WeightsMode::PinnedHost,
                };
                Ok(finish(cx, b, mode, vec![d]))
            }
            Err(r) => Err(vec![FailedOption {
                option,
                shortfalls: r.shortfalls,
                note: None,
            }]),
        };
    }
    // 1. Everything resident on the device.
    let dev = Group {
        kind: MemKind::Device,
        fallback: Vec::new(),
        advice: ManagedAdvice::None,
    };
    let all_dev = match evaluate(cx, std::slice::from_ref(&dev), &vec![0; n]) {
        Ok(b) => {
            let bytes = b.arenas.iter().map(|a| a.bytes).sum();
            let detail = format!(
                "weights + session buffers fit the device budget {}",
                fmt_gib(b.ledger.device.budget)
            );
            let d = weights_decision(
                "weights",
                MemKind::Device,
                bytes,
                Rule::DiscreteFits,
                detail,
                Vec::new(),
                setting,
            );
            return Ok(finish(cx, b, WeightsMode::Device, vec![d]));
        }
        Err(r) => r.shortfalls,
    };
    let all_dev_reason = describe_shortfalls(&all_dev);
    tried.push(FailedOption {
        option: "everything in the device pool".into(),
        shortfalls: all_dev,
        note: None,
    });
    // 2. Hybrid: per-token tensors on the device, routed experts in pinned host.
    if !cx.policy.allow_hybrid {
        tried.push(FailedOption {
            option: "hybrid (device + pinned host)".into(),
            shortfalls: Vec::new(),
            note: Some("disabled by policy (allow_hybrid = false)".into()),
        });
        return Err(tried);
    }
    if !supports(cx.device, MemKind::PinnedHost) {
        tried.push(FailedOption {
            option: "hybrid (device + pinned host)".into(),
            shortfalls: Vec::new(),
            note: Some(format!(
                "{} cannot read pinned host memory directly",
                cx.device.name
            )),
        });
        return Err(tried);
    }
    let host_fb = if !cx.policy.strict && supports(cx.device, MemKind::HostRegistered) {
        vec![MemKind::HostRegistered]
    } else {
        Vec::new()
    };
    let groups = [
        dev,
        Group {
            kind: MemKind::PinnedHost,
            fallback: host_fb,
            advice: ManagedAdvice::None,
        },
    ];
    let mut assign: Vec<usize> = cx
        .inv
        .tensors
        .iter()
        .map(|t| usize::from(!t.class.read_whole_every_token()))
        .collect();
    let first = evaluate(cx, &groups, &assign);
    let ledger = match &first {
        Ok(b) => b.ledger.clone(),
        Err(r) => r.ledger.clone(),
    };
    if !ledger.device.fits() {
        let sf = match first {
            Err(r) => r.shortfalls,
            Ok(_) => Vec::new(),
        };
        tried.push(FailedOption {
            option: "hybrid: per-token tensors + session buffers on the device".into(),
            shortfalls: sf,
            note: None,
        });
        return Err(tried);
    }
    let mut moved = 0u64;
    if cx.policy.hybrid_fill_device {
        // Move cold tensors back onto the device while room remains: routed experts
        // first (each saves PCIe traffic every token), then the rest, in load order.
        let mut room = room_for(cx, &ledger, MemKind::Device);
        let mut order: Vec<usize> = (0..n).filter(|&i| assign[i] == 1).collect();
        order.sort_by_key(|&i| (cx.inv.tensors[i].class != TensorClass::RoutedExperts, i));
        for i in order {
            let b = cx.inv.tensors[i].bytes;
            let cost = if b >= cx.policy.large_span_bytes {
                b
            } else {
                align_up(b, cx.policy.span_alignment)
            };
            if cost <= room {
                room -= cost;
                assign[i] = 0;
                moved += b;
            }
        }
    }
    match evaluate(cx, &groups, &assign) {
        Ok(b) => {
            let dev_bytes: u64 = b
                .arenas
                .iter()
                .filter(|a| a.kind == MemKind::Device)
                .map(|a| a.bytes)
                .sum();
            let host_bytes: u64 = b
                .arenas
                .iter()
                .filter(|a| a.kind != MemKind::Device)
                .map(|a| a.bytes)
                .sum();
            let rej = vec![Attempt {
                option: "everything in the device pool".into(),
                reason: all_dev_reason,
            }];
            let d1 = weights_decision(
                "weights",
                MemKind::Device,
                dev_bytes,
                Rule::DiscreteHybrid,
                format!(
                    "per-token tensors on the device; {} of routed experts moved back onto the device to fill it",
                    fmt_gib(moved)
                ),
                rej,
                setting,
            );
            let d2 = weights_decision(
                "weights.host",
                MemKind::PinnedHost,
                host_bytes,
                Rule::DiscreteHybrid,
                "routed experts (6 of 256 read per layer per token) and the embedding (one row per token), read in place over the bus".into(),
                Vec::new(),
                setting,
            );
            Ok(finish(cx, b, WeightsMode::Hybrid, vec![d1, d2]))
        }
        Err(r) => {
            let sf = r.shortfalls;
            tried.push(FailedOption {
                option: format!(
                    "hybrid: per-token tensors + {} of experts on the device, the rest in pinned host",
                    fmt_gib(moved)
                ),
                shortfalls: sf,
                note: None,
            });
            Err(tried)
        }
    }
}

fn cpu_plan(cx: &Cx) -> Result<Plan, Vec<FailedOption>> {
    let setting = &cx.req.overrides.weights;
    let g = Group {
        kind: MemKind::Pageable,
        fallback: Vec::new(),
        advice: ManagedAdvice::None,
    };
    match evaluate(cx, &[g], &vec![0; cx.inv.len()]) {
        Ok(b) => {
            let bytes = b.arenas.iter().map(|a| a.bytes).sum();
            let d = weights_decision(
                "weights",
                MemKind::Pageable,
                bytes,
                Rule::CpuOnly,
                format!("host budget {}", fmt_gib(b.ledger.host.budget)),
                Vec::new(),
                setting,
            );
            Ok(finish(cx, b, WeightsMode::Pageable, vec![d]))
        }
        Err(r) => Err(vec![FailedOption {
            option: "weights in host memory".into(),
            shortfalls: r.shortfalls,
            note: None,
        }]),
    }
}

fn finish(cx: &Cx, b: Built, mode: WeightsMode, weights: Vec<Decision>) -> Plan {
    let mut rows: BTreeMap<(TensorClass, crate::inventory::WeightSet, MemKind), (usize, u64)> =
        BTreeMap::new();
    for a in &b.arenas {
        for s in &a.spans {
            let t = &cx.inv.tensors[s.tensor];
            let e = rows.entry((t.class, t.set, a.kind)).or_default();
            e.0 += 1;
            e.1 += s.bytes;
        }
    }
    let classes = rows
        .into_iter()
        .map(|((class, set, kind), (tensors, bytes))| ClassRow {
            class,
            set,
            kind,
            tensors,
            bytes,
        })
        .collect();
    let mut warnings = Vec::new();
    let pinned: u64 = b
        .arenas
        .iter()
        .filter(|a| a.kind.is_locked())
        .map(|a| a.bytes)
        .sum::<u64>()
        + b.buffers
            .iter()
            .filter(|x| x.kind.is_locked())
            .map(|x| x.bytes)
            .sum::<u64>();
    if let (Some(lim), false) = (cx.facts.memlock_limit, cx.facts.memlock_enforced) {
        if pinned > lim {
            warnings.push(format!(
                "RLIMIT_MEMLOCK is {} but {} will be pinned; the GPU driver pins outside that limit, \
                 but if pinned allocations fail, raise it (ulimit -l unlimited)",
                fmt_bytes(lim),
                fmt_gib(pinned)
            ));
        }
    }
    if cx.device.kind == DeviceKind::IntegratedUma
        && b.arenas
            .iter()
            .any(|a| a.kind == MemKind::Managed && a.advice == ManagedAdvice::None)
    {
        warnings.push(
            "managed weights without coarse-grain advice are slow on AMD APUs (fine-grained by default)".into(),
        );
    }
    if mode == WeightsMode::Hybrid {
        warnings.push(
            "hybrid plan: routed experts are read from host memory over the bus; decode is slower than fully resident".into(),
        );
    }
    if cx.facts.host_budget > 0 && b.ledger.host.headroom() < GIB && b.ledger.host.used() > 0 {
        warnings.push(format!(
            "host memory headroom is only {} after the plan",
            fmt_bytes(b.ledger.host.headroom())
        ));
    }
    let load = match mode {
        WeightsMode::Pageable => LoadStrategy::Mmap,
        WeightsMode::Device => LoadStrategy::PreadStagedCopy,
        _ => LoadStrategy::PreadIntoHostDropCache,
    };
    let mut decisions = weights;
    decisions.extend(b.decisions);
    debug!(?mode, arenas = b.arenas.len(), "plan finished");
    Plan {
        mode,
        ctx: cx.req.ctx,
        facts: cx.facts.clone(),
        arenas: b.arenas,
        buffers: b.buffers,
        classes,
        decisions,
        ledger: b.ledger,
        load,
        warnings,
        stream: None,
        mtp: None,
    }
}

/// Routed experts streamed from the model file: everything else is planned as a resident
/// model without them (same rules, same pools), then the expert cache takes the room that
/// leaves in the pool the device computes from (device memory on a discrete GPU, the
/// weights' kind on unified memory, host memory on the CPU), rounded down to whole
/// (layer, expert) units, with a second tier in pinned host memory on a discrete GPU
/// where RAM allows. Refused only when the cache cannot hold one token's units plus the
/// policy's extra. `resident_tried` are the resident options that failed (reported as
/// the reason for streaming).
fn streamed_plan(
    host: &HostFacts,
    device: &DeviceFacts,
    inv: &TensorInventory,
    req: &Request,
    policy: &Policy,
    resident_tried: &[FailedOption],
) -> Result<Plan, Vec<FailedOption>> {
    let option = "streamed routed experts (resident rest + expert cache)";
    let fail = |note: String| {
        vec![FailedOption {
            option: option.into(),
            shortfalls: Vec::new(),
            note: Some(note),
        }]
    };
    let Some(shape) = req.routed_experts else {
        return Err(fail(
            "the request does not say how routed-expert tensors split into experts".into(),
        ));
    };
    if shape.per_layer == 0 || shape.per_token == 0 || shape.per_token > shape.per_layer {
        return Err(fail(format!(
            "{} experts per token of {} per layer is not a routed-expert shape",
            shape.per_token, shape.per_layer
        )));
    }
    let per_layer = u64::from(shape.per_layer);
    let mut rest = Vec::new();
    let mut map = Vec::new();
    let mut tensors = Vec::new();
    let mut unit_of_layer: BTreeMap<Option<u32>, u64> = BTreeMap::new();
    for (i, t) in inv.tensors.iter().enumerate() {
        if t.class == TensorClass::RoutedExperts && t.set == WeightSet::Main {
            if !t.bytes.is_multiple_of(per_layer) {
                return Err(fail(format!(
                    "{} ({} bytes) does not split into {per_layer} equal experts",
                    t.name, t.bytes
                )));
            }
            let expert_bytes = t.bytes / per_layer;
            *unit_of_layer.entry(t.layer).or_default() += expert_bytes;
            tensors.push(StreamedTensor {
                tensor: i,
                name: t.name.clone(),
                layer: t.layer,
                bytes: t.bytes,
                expert_bytes,
            });
        } else {
            map.push(i);
            rest.push(t.clone());
        }
    }
    let Some(&slot) = unit_of_layer.values().max().filter(|&&b| b > 0) else {
        return Err(fail("the model has no routed-expert tensors".into()));
    };
    let all_bytes: u64 = tensors.iter().map(|t| t.bytes).sum();
    let units = unit_of_layer.len() as u64 * per_layer;
    let per_token_bytes: u64 = unit_of_layer
        .values()
        .map(|u| u * u64::from(shape.per_token))
        .sum();
    // In whole slots: the cache is sized in slots (rounded down below), so a minimum that
    // is not a multiple of one would be met by a fitting cache and then lost to rounding.
    let min_cache = (per_token_bytes
        + policy
            .stream_min_extra_cache
            .min(all_bytes.saturating_sub(per_token_bytes)))
    .div_ceil(slot)
        * slot;

    // Everything else, planned as a resident model.
    let inv2 = TensorInventory::new(rest);
    let mut req2 = req.clone();
    req2.overrides.experts = Setting::new(ExpertsChoice::Resident, Source::Default);
    let mut p = match plan_inner(host, device, &inv2, &req2, policy, false) {
        Ok(p) => p,
        Err(Refusal::DoesNotFit(f)) => {
            return Err(f
                .tried
                .into_iter()
                .map(|mut o| {
                    o.option = format!("streamed experts; the rest resident: {}", o.option);
                    o
                })
                .collect())
        }
        Err(other) => return Err(fail(other.to_string())),
    };
    let cache_kind = match device.kind {
        DeviceKind::CpuOnly => MemKind::Pageable,
        DeviceKind::Discrete => MemKind::Device,
        DeviceKind::IntegratedUma | DeviceKind::CoherentUma => {
            p.arenas.first().map_or(MemKind::PinnedHost, |a| a.kind)
        }
    };
    let tier_kind = (device.kind == DeviceKind::Discrete && supports(device, MemKind::PinnedHost))
        .then_some(MemKind::PinnedHost);
    let cx = Cx {
        device,
        inv: &inv2,
        req: &req2,
        policy,
        facts: p.facts.clone(),
        kv: req.kv_bytes().unwrap_or(0),
        scratch: req.scratch_bytes,
    };
    let buffer = |name: &str, kind: MemKind, bytes: u64| Buffer {
        purpose: BufferPurpose::ExpertCache,
        name: name.into(),
        kind,
        fallback: Vec::new(),
        bytes,
    };
    let with = |cache: u64, tier: u64| {
        let mut b = p.buffers.clone();
        b.push(buffer("expert cache", cache_kind, cache));
        if let (Some(k), true) = (tier_kind, tier > 0) {
            b.push(buffer("expert cache (host tier)", k, tier));
        }
        b
    };
    // In host memory, the cache beyond its minimum leaves the policy's reserve free (the
    // OS and the page cache under the streamed reads need it).
    let cache_fits = |x: u64| {
        let l = ledger_for(&cx, &p.arenas, &with(x, 0));
        l.fits()
            && (cache_kind == MemKind::Device
                || x <= min_cache
                || l.host.headroom() >= policy.optional_reserve)
    };
    let cap = req.overrides.expert_cache.value.unwrap_or(u64::MAX);
    let cache = max_true(0, all_bytes, cache_fits).min(cap) / slot * slot;
    if cache < min_cache && cap < min_cache {
        return Err(vec![FailedOption {
            option: format!(
                "{option}: a cache of at most {} (--expert-cache-gib)",
                fmt_gib(cap)
            ),
            shortfalls: Vec::new(),
            note: Some(format!(
                "a streamed plan needs a cache of at least {} ({} for one token's experts + {} extra)",
                fmt_gib(min_cache),
                fmt_gib(per_token_bytes),
                fmt_gib(min_cache - per_token_bytes)
            )),
        }]);
    }
    if cache < min_cache {
        let l = ledger_for(&cx, &p.arenas, &with(min_cache, 0));
        return Err(vec![FailedOption {
            option: format!(
                "{option}: the rest resident, a cache of at least {} ({} for one token's experts + {} extra)",
                fmt_gib(min_cache),
                fmt_gib(per_token_bytes),
                fmt_gib(min_cache - per_token_bytes)
            ),
            shortfalls: shortfalls(&l),
            note: None,
        }]);
    }
    // The host tier is optional: like any optional cache it must leave the policy's
    // reserve of host memory free.
    let tier_fits = |x: u64| {
        let l = ledger_for(&cx, &p.arenas, &with(cache, x));
        l.fits() && (x == 0 || l.host.headroom() >= policy.optional_reserve)
    };
    let tier = match tier_kind {
        // A capped cache (--expert-cache-gib) is the whole cache: no second tier.
        Some(_) if cache < all_bytes && cap == u64::MAX => {
            max_true(0, all_bytes - cache, tier_fits) / slot * slot
        }
        _ => 0,
    };
    let buffers = with(cache, tier);
    p.ledger = ledger_for(&cx, &p.arenas, &buffers);
    let host_tier = (tier > 0).then(|| buffers.last().cloned()).flatten();
    p.buffers = buffers;
    for a in &mut p.arenas {
        for sp in &mut a.spans {
            sp.tensor = map[sp.tensor];
        }
    }
    let cached = (cache + tier).min(all_bytes);
    let hit = cached as f64 / all_bytes as f64;
    let disk_bytes_per_token = (per_token_bytes as f64 * (1.0 - hit)).round() as u64;
    let (read, measured) = match req.disk_read_bytes_per_s {
        Some(r) if r > 0 => (r, true),
        _ => (policy.stream_assumed_read_bytes_per_s, false),
    };
    let predicted = (disk_bytes_per_token > 0).then(|| read as f64 / disk_bytes_per_token as f64);
    let forced = req.overrides.experts.value == ExpertsChoice::Stream;
    p.decisions.insert(
        0,
        Decision {
            subject: "weights.routed_experts".into(),
            kind: Some(cache_kind),
            bytes: cache,
            rule: if forced {
                Rule::Override
            } else {
                Rule::ExpertsStreamed
            },
            detail: format!(
                "{} of routed experts stay in the model file; a {} expert cache ({} units of {})",
                fmt_gib(all_bytes),
                fmt_gib(cache),
                cache / slot,
                fmt_bytes(slot)
            ),
            rejected: resident_tried
                .iter()
                .map(|o| Attempt {
                    option: o.option.clone(),
                    reason: o
                        .note
                        .clone()
                        .unwrap_or_else(|| describe_shortfalls(&o.shortfalls)),
                })
                .collect(),
            source: req.overrides.experts.source.clone(),
            change: "--experts resident (refuse instead) or --experts stream (always)".into(),
        },
    );
    p.warnings.push(
        "streamed experts: every cache miss is a read from the model file; decode speed depends on the disk and on how skewed the routing is".into(),
    );
    p.mode = WeightsMode::Streamed;
    p.stream = Some(ExpertStream {
        tensors,
        experts_per_layer: shape.per_layer,
        experts_per_token: shape.per_token,
        slot_bytes: slot,
        units,
        all_bytes,
        per_token_bytes,
        min_cache_bytes: min_cache,
        cache: buffer("expert cache", cache_kind, cache),
        cache_slots: cache / slot,
        host_tier,
        host_tier_slots: tier / slot,
        read_bytes_per_s: read,
        read_rate_measured: measured,
        assumed_hit_rate: hit,
        disk_bytes_per_token,
        predicted_tokens_per_s: predicted,
    });
    Ok(p)
}

// ---------------------------------------------------------------------------------------
// Remedies: each is verified by re-planning with exactly that change.

/// Smallest x in [lo, hi] with f(x), given f monotone (false…true) and f(hi).
fn min_true(mut lo: u64, mut hi: u64, f: impl Fn(u64) -> bool) -> u64 {
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if f(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    hi
}

/// Largest x in [lo, hi] with f(x), given f monotone (true…false) and f(lo).
fn max_true(mut lo: u64, mut hi: u64, f: impl Fn(u64) -> bool) -> u64 {
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if f(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

fn find_remedies(
    host: &HostFacts,
    device: &DeviceFacts,
    inv: &TensorInventory,
    req: &Request,
    policy: &Policy,
) -> Vec<Remedy> {
    let fits = |h: &HostFacts, d: &DeviceFacts, i: &TensorInventory, r: &Request, p: &Policy| {
        plan_inner(h, d, i, r, p, false).is_ok()
    };
    let mut out = Vec::new();
    let o = &req.overrides;

    // Overrides that block an automatic plan.
    type Reset = fn(&mut Request);
    let resets: [(&Source, Reset); 6] = [
        (&o.weights.source, |r| {
            r.overrides.weights = Setting::default()
        }),
        (&o.kv.source, |r| r.overrides.kv = Setting::default()),
        (&o.scratch.source, |r| {
            r.overrides.scratch = Setting::default()
        }),
        (&o.device_mem_limit.source, |r| {
            r.overrides.device_mem_limit = Setting::default()
        }),
        (&o.os_reserve.source, |r| {
            r.overrides.os_reserve = Setting::default()
        }),
        // A cap below the streamed plan's minimum cache.
        (&o.expert_cache.source, |r| {
            r.overrides.expert_cache = Setting::default()
        }),
    ];
    for (src, reset) in resets {
        if src.is_default() {
            continue;
        }
        let mut r2 = req.clone();
        reset(&mut r2);
        if fits(host, device, inv, &r2, policy) {
            out.push(Remedy::DropOverride {
                setting: src.to_string(),
            });
        }
    }

    // A smaller context.
    if req.ctx > 1 && req.kv_bytes_per_token > 0 {
        let at = |c: u64| fits(host, device, inv, &req.at_context(c), policy);
        if at(1) {
            out.push(Remedy::SmallerContext {
                max_ctx: max_true(1, req.ctx - 1, at),
            });
        }
    }

    // KV in pinned host on a discrete card.
    if device.kind == DeviceKind::Discrete
        && o.kv.value == MemChoice::Auto
        && supports(device, MemKind::PinnedHost)
    {
        let mut r2 = req.clone();
        r2.overrides.kv = Setting::new(MemChoice::Host, Source::Default);
        if fits(host, device, inv, &r2, policy) {
            out.push(Remedy::KvInHost);
        }
    }

    // A smaller OS reserve (never below 512 MiB).
    let reserve = o.os_reserve.value.unwrap_or(policy.os_reserve);
    let floor = 512 * MIB;
    if reserve > floor {
        let at = |b: u64| {
            let mut r2 = req.clone();
            r2.overrides.os_reserve = Setting::new(Some(b), Source::Default);
            fits(host, device, inv, &r2, policy)
        };
        if at(floor) {
            let step = 16 * MIB;
            let k = max_true(0, (reserve - 1 - floor) / step, |k| at(floor + k * step));
            out.push(Remedy::LowerOsReserve {
                max_reserve: floor + k * step,
            });
        }
    }

    // A bigger GTT pool (AMD integrated): ttm.pages_limit.
    if device.kind == DeviceKind::IntegratedUma {
        let used = device.pool_total.saturating_sub(device.pool_free);
        let cur_gib = device.pool_total.div_ceil(GIB);
        let max_gib = host.mem_total.saturating_sub(4 * GIB) / GIB;
        let at = |g: u64| {
            let mut d2 = device.clone();
            d2.pool_total = g * GIB;
            d2.pool_free = (g * GIB).saturating_sub(used);
            fits(host, &d2, inv, req, policy)
        };
        if max_gib > cur_gib && at(max_gib) {
            let g = min_true(cur_gib + 1, max_gib, at);
            out.push(Remedy::RaiseGtt {
                pool_gib: g,
                pages_limit: g * 262_144,
            });
        }
    }

    // A bigger container limit.
    if let Some(cg) = &host.cgroup {
        let at = |g: u64| {
            let mut h2 = host.clone();
            if let Some(c) = h2.cgroup.as_mut() {
                c.limit = g * GIB;
            }
            fits(&h2, device, inv, req, policy)
        };
        let cur = cg.limit / GIB + 1;
        let max = (host.mem_total / GIB).max(cur) + cg.usage.div_ceil(GIB);
        if at(max) {
            out.push(Remedy::RaiseCgroupLimit {
                limit: min_true(cur, max, at) * GIB,
            });
        }
    }

    // RLIMIT_MEMLOCK, where the runtime honours it.
    if device.caps.pinned_counts_against_memlock && host.memlock_limit.is_some() {
        let mut h2 = host.clone();
        h2.memlock_limit = None;
        if fits(&h2, device, inv, req, policy) {
            out.push(Remedy::RaiseMemlock);
        }
    }

    // Routed experts at half the size (q2 instead of q4 or mxfp4), unless they already are
    // about 2-bit (then halving them is not a file anyone can download).
    let routed = inv.class_bytes(TensorClass::RoutedExperts);
    let bpw = inv.class_bits_per_weight(TensorClass::RoutedExperts);
    if routed > 0 && bpw.is_none_or(|b| b > 3.0) {
        let mut i2 = inv.clone();
        for t in &mut i2.tensors {
            if t.class == TensorClass::RoutedExperts {
                t.bytes = (t.bytes / 2).max(1);
            }
        }
        if fits(host, device, &i2, req, policy) {
            out.push(Remedy::SmallerExpertQuant {
                routed_bytes: routed,
                bits_per_weight_milli: bpw.map(|b| (b * 1000.0).round() as u64),
            });
        }
    }

    // More free host memory.
    if host.mem_available < host.mem_total {
        let at = |extra_gib: u64| {
            let mut h2 = host.clone();
            h2.mem_available = (host.mem_available + extra_gib * GIB).min(host.mem_total);
            fits(&h2, device, inv, req, policy)
        };
        let max = (host.mem_total - host.mem_available).div_ceil(GIB);
        if max > 0 && at(max) {
            out.push(Remedy::FreeHostMemory {
                bytes: min_true(1, max, at) * GIB,
            });
        }
    }

    // Hybrid when the policy forbids it.
    if device.kind == DeviceKind::Discrete && !policy.allow_hybrid {
        let p2 = Policy {
            allow_hybrid: true,
            ..policy.clone()
        };
        if fits(host, device, inv, req, &p2) {
            out.push(Remedy::EnableHybrid);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_searches() {
        assert_eq!(min_true(0, 100, |x| x >= 37), 37);
        assert_eq!(min_true(5, 5, |_| true), 5);
        assert_eq!(max_true(0, 100, |x| x <= 63), 63);
        assert_eq!(max_true(1, 1, |_| true), 1);
        assert_eq!(max_true(1, u64::MAX - 1, |x| x <= 1 << 40), 1 << 40);
    }

    #[test]
    fn alignment() {
        assert_eq!(align_up(0, 256), 0);
        assert_eq!(align_up(1, 256), 256);
        assert_eq!(align_up(256, 256), 256);
        assert_eq!(align_up(257, 256), 512);
    }
}
