//! Property tests on random machines, inventories, requests and policies.

use ds4_placement::{
    plan, BufferPurpose, CgroupFacts, CgroupVersion, DeviceCaps, DeviceFacts, DeviceKind,
    HostFacts, HostOs, MemChoice, MemKind, OptionalCache, Overrides, Plan, Policy, Refusal, Remedy,
    Request, Setting, Source, TensorClass, TensorInventory, TensorSpec,
};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn host_strategy() -> impl Strategy<Value = HostFacts> {
    (
        1u64..256 * 1024,
        0u64..=1000,
        0u64..1024,
        prop::option::of((1u64..256 * 1024, 0u64..4096)),
        prop::option::of(0u64..4096),
    )
        .prop_map(
            |(total_mib, avail_permille, cma_mib, cg, memlock_mib)| HostFacts {
                os: HostOs::Linux,
                mem_total: total_mib * MIB,
                mem_available: total_mib * MIB / 1000 * avail_permille,
                cma_free: cma_mib * MIB,
                swap_free: None,
                commit_available: None,
                cgroup: cg.map(|(l, u)| CgroupFacts {
                    version: CgroupVersion::V2,
                    limit: l * MIB,
                    usage: u * MIB,
                }),
                memlock_limit: memlock_mib.map(|m| m * MIB),
            },
        )
}

fn device_strategy() -> impl Strategy<Value = DeviceFacts> {
    (
        prop_oneof![
            Just(DeviceKind::Discrete),
            Just(DeviceKind::IntegratedUma),
            Just(DeviceKind::CoherentUma),
            Just(DeviceKind::CpuOnly)
        ],
        0u64..200 * 1024,
        0u64..=1000,
        0u64..=1000,
        prop::array::uniform7(any::<bool>()),
    )
        .prop_map(|(kind, total_mib, free_permille, carve_permille, c)| {
            if kind == DeviceKind::CpuOnly {
                return DeviceFacts::cpu();
            }
            let total = total_mib * MIB;
            let free = total / 1000 * free_permille;
            DeviceFacts {
                name: format!("{kind:?}"),
                kind,
                pool_total: total,
                pool_free: free,
                carve_out_free: if kind.is_unified() {
                    free / 1000 * carve_permille
                } else {
                    0
                },
                caps: DeviceCaps {
                    pinned_host: c[0] || c[6],
                    managed: c[1],
                    host_register: c[2],
                    host_mapped: c[3] || c[6],
                    pageable_access: c[4],
                    coarse_grain_advice: c[5],
                    pinned_counts_against_memlock: c[4] && c[5],
                },
            }
        })
}

fn class_strategy() -> impl Strategy<Value = TensorClass> {
    prop::sample::select(TensorClass::ALL.to_vec())
}

fn inventory_strategy() -> impl Strategy<Value = TensorInventory> {
    prop::collection::vec(
        (
            prop_oneof![1u64..64 * 1024, 1u64..64 * MIB, 200 * MIB..3 * GIB],
            class_strategy(),
            prop::option::of(0u32..64),
        ),
        1..60,
    )
    .prop_map(|v| {
        TensorInventory::new(
            v.into_iter()
                .enumerate()
                .map(|(i, (b, c, l))| TensorSpec::new(format!("t{i}"), b, c, l))
                .collect(),
        )
    })
}

fn choice() -> impl Strategy<Value = MemChoice> {
    prop_oneof![
        6 => Just(MemChoice::Auto),
        1 => Just(MemChoice::Device),
        1 => Just(MemChoice::Host),
        1 => Just(MemChoice::Managed),
    ]
}

fn cli(c: MemChoice) -> Setting<MemChoice> {
    let source = if c == MemChoice::Auto {
        Source::Default
    } else {
        Source::Cli {
            flag: "--x".into(),
            value: c.to_string(),
        }
    };
    Setting::new(c, source)
}

fn request_strategy() -> impl Strategy<Value = Request> {
    (
        1u64..2_000_000,
        0u64..40_000,
        0u64..20 * 1024,
        (choice(), choice(), choice()),
        prop::option::of(0u64..8 * 1024),
        prop::option::of(1u64..64 * 1024),
        prop::collection::vec(1u64..16 * 1024, 0..3),
    )
        .prop_map(|(ctx, kvpt, scratch_mib, (w, k, s), reserve, limit, opt)| {
            let mut r = Request::new(ctx, kvpt, scratch_mib * MIB);
            let gib_setting = |v: Option<u64>| match v {
                Some(m) => Setting::new(
                    Some(m * MIB),
                    Source::Cli {
                        flag: "--g".into(),
                        value: m.to_string(),
                    },
                ),
                None => Setting::default(),
            };
            r.overrides = Overrides {
                weights: cli(w),
                kv: cli(k),
                scratch: cli(s),
                os_reserve: gib_setting(reserve),
                device_mem_limit: gib_setting(limit),
                ..Overrides::default()
            };
            r.optional_caches = opt
                .into_iter()
                .enumerate()
                .map(|(i, m)| OptionalCache {
                    name: format!("opt{i}"),
                    bytes: m * MIB,
                })
                .collect();
            r
        })
}

fn policy_strategy() -> impl Strategy<Value = Policy> {
    prop_oneof![
        2 => Just(Policy::default()),
        1 => (1u64..512, 0u64..2048, 0u32..13, any::<bool>(), any::<bool>(), any::<bool>()).prop_map(
            |(large_mib, extra_mib, align_log, hybrid, fill, strict)| Policy {
                large_span_bytes: large_mib * MIB,
                shared_arena_bytes: (large_mib + extra_mib) * MIB,
                span_alignment: 1 << align_log,
                allow_hybrid: hybrid,
                hybrid_fill_device: fill,
                strict,
                ..Policy::default()
            }
        ),
    ]
}

fn kind_of(device: &DeviceFacts, c: MemChoice) -> Option<MemKind> {
    match c {
        MemChoice::Auto => None,
        MemChoice::Host if device.kind == DeviceKind::CpuOnly => Some(MemKind::Pageable),
        MemChoice::Host => Some(MemKind::PinnedHost),
        MemChoice::Device => Some(MemKind::Device),
        MemChoice::Managed => Some(MemKind::Managed),
    }
}

/// Budgets recomputed from the facts, independently of the planner's own ledger.
fn independent_budgets(
    host: &HostFacts,
    device: &DeviceFacts,
    req: &Request,
    policy: &Policy,
) -> (u64, u64) {
    let mut avail = host.mem_available.saturating_sub(host.cma_free);
    if let Some(cg) = &host.cgroup {
        avail = avail.min(cg.limit.saturating_sub(cg.usage));
    }
    let reserve = req.overrides.os_reserve.value.unwrap_or(policy.os_reserve);
    let host_budget = avail.saturating_sub(reserve);
    if device.kind == DeviceKind::CpuOnly {
        return (host_budget, 0);
    }
    let mut free = device.pool_free.min(device.pool_total);
    if let Some(l) = req.overrides.device_mem_limit.value {
        free = free.min(l);
    }
    if device.kind.is_unified() {
        free = free.min(device.carve_out_free + avail);
    }
    (host_budget, free.saturating_sub(policy.device_reserve))
}

fn check_plan(
    host: &HostFacts,
    device: &DeviceFacts,
    inv: &TensorInventory,
    req: &Request,
    policy: &Policy,
    p: &Plan,
) {
    // Every tensor placed exactly once.
    let mut seen: Vec<usize> = p
        .arenas
        .iter()
        .flat_map(|a| a.spans.iter().map(|s| s.tensor))
        .collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..inv.len()).collect::<Vec<_>>());
    // Arena geometry.
    for a in &p.arenas {
        let mut spans = a.spans.clone();
        spans.sort_by_key(|s| s.offset);
        let mut end = 0;
        for s in &spans {
            assert!(s.offset >= end, "overlap in arena {}", a.id);
            assert_eq!(s.bytes, inv.tensors[s.tensor].bytes);
            end = s.offset + s.bytes;
            if !a.dedicated {
                assert_eq!(s.offset % policy.span_alignment, 0);
            }
        }
        assert_eq!(end, a.bytes, "arena {} is sized to its contents", a.id);
        assert_eq!(
            a.stranded,
            a.bytes - a.spans.iter().map(|s| s.bytes).sum::<u64>()
        );
        if a.dedicated {
            assert_eq!(a.spans.len(), 1);
            assert!(a.bytes >= policy.large_span_bytes);
        } else {
            assert!(a.bytes <= policy.shared_arena_bytes);
            assert!(a.spans.iter().all(|s| s.bytes < policy.large_span_bytes));
        }
        // No arena strands more than the threshold.
        assert!(
            a.stranded
                < policy
                    .large_span_bytes
                    .max(policy.span_alignment * a.spans.len() as u64 + 1)
        );
        assert!(a.stranded <= (policy.span_alignment - 1) * a.spans.len() as u64);
        if policy.strict {
            assert!(a.fallback.is_empty());
        }
        assert!(!a.fallback.contains(&a.kind));
    }
    // Budgets, recomputed independently.
    let (host_budget, dev_budget) = independent_budgets(host, device, req, policy);
    assert_eq!(p.facts.host_budget, host_budget);
    assert_eq!(p.facts.device_budget, dev_budget);
    let mut dev = 0u64;
    let mut hostc = 0u64;
    let mut locked = 0u64;
    let allocs = p
        .arenas
        .iter()
        .map(|a| (a.kind, a.bytes))
        .chain(p.buffers.iter().map(|b| (b.kind, b.bytes)));
    for (k, b) in allocs {
        if k == MemKind::Device {
            dev += b;
        } else {
            hostc += b;
        }
        if matches!(k, MemKind::PinnedHost | MemKind::HostRegistered) {
            locked += b;
        }
    }
    if device.kind.is_unified() {
        hostc += dev.saturating_sub(device.carve_out_free);
    }
    assert!(dev <= dev_budget, "device {dev} > {dev_budget}");
    assert!(hostc <= host_budget, "host {hostc} > {host_budget}");
    if device.caps.pinned_counts_against_memlock {
        if let Some(l) = host.memlock_limit {
            assert!(locked <= l);
        }
    }
    assert_eq!(p.ledger.device.used(), dev);
    assert_eq!(p.ledger.host.used(), hostc);
    // Overrides always win.
    let o = &req.overrides;
    if let Some(k) = kind_of(device, o.weights.value) {
        assert!(p
            .arenas
            .iter()
            .all(|a| a.kind == k && a.fallback.is_empty()));
    }
    for (c, purpose) in [
        (o.kv.value, BufferPurpose::Kv),
        (o.scratch.value, BufferPurpose::Scratch),
    ] {
        if let (Some(k), Some(b)) = (kind_of(device, c), p.buffer(purpose)) {
            assert_eq!(b.kind, k);
        }
    }
    // Session buffers are exactly what was asked.
    let kv = req.kv_bytes().unwrap();
    assert_eq!(p.buffer(BufferPurpose::Kv).map_or(0, |b| b.bytes), kv);
    assert_eq!(
        p.buffer(BufferPurpose::Scratch).map_or(0, |b| b.bytes),
        req.scratch_bytes
    );
    // Every class row adds up to the inventory.
    for c in TensorClass::ALL {
        let rows: u64 = p
            .classes
            .iter()
            .filter(|r| r.class == c)
            .map(|r| r.bytes)
            .sum();
        assert_eq!(rows, inv.class_bytes(c));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, ..ProptestConfig::default() })]

    #[test]
    fn plans_respect_budgets_and_place_everything_once(
        host in host_strategy(),
        device in device_strategy(),
        inv in inventory_strategy(),
        req in request_strategy(),
        policy in policy_strategy(),
    ) {
        let r = plan(&host, &device, &inv, &req, &policy);
        // Identical facts, identical plans.
        prop_assert_eq!(&r, &plan(&host, &device, &inv, &req, &policy));
        match &r {
            Ok(p) => {
                check_plan(&host, &device, &inv, &req, &policy, p);
                // Never host memory on a discrete GPU that could hold everything.
                if device.kind == DeviceKind::Discrete && req.overrides.weights.value == MemChoice::Auto
                    && p.arenas.iter().any(|a| a.kind != MemKind::Device)
                {
                    let no_hybrid = Policy { allow_hybrid: false, ..policy.clone() };
                    prop_assert!(plan(&host, &device, &inv, &req, &no_hybrid).is_err());
                }
                let _ = p.render_text();
            }
            Err(Refusal::DoesNotFit(f)) => {
                prop_assert!(!f.tried.is_empty());
                prop_assert!(!f.to_string().is_empty());
                // Every option tried names why it failed: a shortfall, or a note.
                for t in &f.tried {
                    prop_assert!(
                        !t.shortfalls.is_empty() || t.note.as_deref().is_some_and(|n| !n.is_empty()),
                        "{} gives no reason", t.option
                    );
                }
                // Remedies are real: each verified one fits when applied.
                for rem in &f.remedies {
                    let mut r2 = req.clone();
                    match rem {
                        Remedy::SmallerContext { max_ctx } => {
                            r2 = req.at_context(*max_ctx);
                            prop_assert!(*max_ctx < req.ctx);
                        }
                        Remedy::LowerOsReserve { max_reserve } => {
                            r2.overrides.os_reserve = Setting::new(Some(*max_reserve), Source::Default);
                        }
                        _ => continue,
                    }
                    let p2 = plan(&host, &device, &inv, &r2, &policy);
                    prop_assert!(p2.is_ok(), "remedy {:?} does not fit", rem);
                }
            }
            Err(Refusal::Unsupported(u)) => prop_assert!(!u.reason.is_empty()),
            Err(Refusal::InvalidInput(e)) => prop_assert!(false, "generated input is valid: {}", e),
        }
    }

    #[test]
    fn plan_is_monotone_in_host_memory(
        host in host_strategy(),
        device in device_strategy(),
        inv in inventory_strategy(),
        req in request_strategy(),
    ) {
        // A machine with more available RAM (and no cgroup) never refuses what a smaller one accepts.
        let policy = Policy::default();
        if plan(&host, &device, &inv, &req, &policy).is_ok() {
            let mut bigger = host.clone();
            bigger.cgroup = None;
            bigger.mem_available = bigger.mem_total;
            bigger.cma_free = 0;
            prop_assert!(plan(&bigger, &device, &inv, &req, &policy).is_ok());
        }
    }
}
