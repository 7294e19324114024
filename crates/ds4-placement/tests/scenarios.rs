//! Simulated machines × real inventories: the decisions the issue asks for.

mod common;

use common::*;
use ds4_placement::{
    plan, resolve_overrides, BufferPurpose, CliOverrides, DeviceFacts, HostFacts, MemChoice,
    MemKind, OptionalCache, Overrides, Plan, Policy, Refusal, Remedy, Request, Rule, Setting,
    Source, TensorClass, TensorInventory, WeightSet, WeightsMode,
};

fn run(m: &str, inv: &TensorInventory, req: &Request) -> Result<Plan, Refusal> {
    let mf = machine(m);
    plan(&mf.host, &mf.device, inv, req, &Policy::default())
}

fn fit_err(r: Result<Plan, Refusal>) -> Box<ds4_placement::FitRefusal> {
    match r {
        Err(Refusal::DoesNotFit(f)) => f,
        Err(e) => panic!("expected a fit refusal, got {e}"),
        Ok(p) => panic!("expected a refusal, got a plan:\n{}", p.render_text()),
    }
}

fn env(pairs: &[(&str, &str)]) -> Overrides {
    let pairs: Vec<(String, String)> = pairs
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    resolve_overrides(&CliOverrides::default(), move |k| {
        pairs.iter().find(|(a, _)| a == k).map(|(_, b)| b.clone())
    })
    .unwrap()
}

// ---------------------------------------------------------------------------------------
// Inventories match the independently computed totals.

#[test]
fn inventories_match_the_layout_spec() {
    let q2 = flash(Quant::Q2);
    let q4 = flash(Quant::Q4);
    assert_eq!(q2.len(), 1328);
    assert_eq!(q4.len(), 1328);
    let experts_q2 = q2.class_bytes(TensorClass::RoutedExperts);
    assert_eq!(experts_q2, 77_913_391_104);
    assert_eq!(q4.class_bytes(TensorClass::RoutedExperts), 155_826_782_208);
    // 8,801,386,560 B after 32-byte padding, of which padding is 1,764 B.
    assert_eq!(q2.total_bytes() - experts_q2, 8_801_386_560 - 1_764);
    assert_eq!(q2.total_bytes() + 1_764, 86_714_777_664);
    assert_eq!(q4.total_bytes() + 1_764, 164_628_168_768);
    // MXFP4: 17 B per 32 values, 4096·2048·256 values per routed tensor.
    let mx = flash(Quant::Mxfp4);
    assert_eq!(mx.len(), 1328);
    let mx_gate = mx
        .tensors
        .iter()
        .find(|t| t.name == "blk.7.ffn_gate_exps.weight")
        .unwrap()
        .bytes;
    assert_eq!(mx_gate, 1_140_850_688);
    assert_eq!(mx.class_bytes(TensorClass::RoutedExperts), 147_169_738_752);
    assert_eq!(mx.total_bytes() + 1_764, 155_971_125_312);
    let exp = |name: &str| q2.tensors.iter().find(|t| t.name == name).unwrap().bytes;
    assert_eq!(exp("blk.0.ffn_gate_exps.weight"), 553_648_128);
    assert_eq!(exp("blk.0.ffn_down_exps.weight"), 704_643_072);
    assert_eq!(exp("token_embd.weight"), 1_059_061_760);
    assert_eq!(exp("output.weight"), 562_626_560);
    let mtp = mtp_tensors();
    assert_eq!(mtp.len(), 32);
    assert_eq!(
        mtp.iter().map(|t| t.bytes).sum::<u64>() + 2208,
        3_807_602_400
    );
    assert_eq!(tiny().len(), 116);
    assert!(tiny().validate().is_ok() && flash_with_mtp(Quant::Q2).validate().is_ok());
}

// ---------------------------------------------------------------------------------------
// Strix Halo stock: the case the project exists for.

#[test]
fn strix_stock_q2_goes_to_pinned_host_and_fits() {
    let inv = flash(Quant::Q2);
    let p = run("strix-halo-stock", &inv, &request(4096, scratch_for(4096))).unwrap();
    assert_eq!(p.mode, WeightsMode::PinnedHost);
    assert!(p.arenas.iter().all(|a| a.kind == MemKind::PinnedHost));
    assert!(p
        .arenas
        .iter()
        .all(|a| a.fallback == vec![MemKind::Managed, MemKind::Device]));
    let w = p.decision("weights").unwrap();
    assert_eq!(w.rule, Rule::UmaWeightsChain);
    assert!(w.rejected.is_empty());
    // Budgets: usable host = 121 GiB − 64 MiB CMA − 2 GiB; device = min(61.5, 0.5 + host) − 0.5.
    assert_eq!(p.facts.host_budget, 121 * GIB - 64 * MIB - 2 * GIB);
    assert_eq!(p.facts.device_budget, 61 * GIB);
    // Arenas: the 129 expert stacks + token_embd + output are dedicated and exact.
    let dedicated: Vec<_> = p.arenas.iter().filter(|a| a.dedicated).collect();
    assert_eq!(dedicated.len(), 131);
    assert!(dedicated
        .iter()
        .all(|a| a.spans.len() == 1 && a.bytes == a.spans[0].bytes));
    let small = inv.total_bytes() - dedicated.iter().map(|a| a.bytes).sum::<u64>();
    let shared = p.arenas.len() - 131;
    let min_shared = small.div_ceil(1792 * MIB) as usize;
    assert!(
        (min_shared..=min_shared + 1).contains(&shared),
        "{shared} shared arenas"
    );
    assert!(p
        .arenas
        .iter()
        .all(|a| a.dedicated || a.bytes <= 1792 * MIB));
    assert!(p.stranded_bytes() < 1328 * 256);
    // KV and scratch are small: device pool (ds4 rule), with managed as the fallback.
    let kv = p.buffer(BufferPurpose::Kv).unwrap();
    assert_eq!(kv.kind, MemKind::Device);
    assert_eq!(kv.bytes, 4096 * KV_PER_TOKEN + KV_FIXED);
    assert_eq!(kv.fallback, vec![MemKind::Managed]);
    assert_eq!(p.decision("kv").unwrap().rule, Rule::ContextSmall);
    assert!(p.ledger.fits());
    assert_eq!(
        p.ledger.host.weights,
        inv.total_bytes() + p.stranded_bytes()
    );
}

#[test]
fn strix_stock_q2_at_1m_context_puts_kv_in_managed() {
    let p = run(
        "strix-halo-stock",
        &flash(Quant::Q2),
        &request(1 << 20, scratch_for(1 << 20)),
    )
    .unwrap();
    assert_eq!(p.mode, WeightsMode::PinnedHost);
    assert_eq!(p.buffer(BufferPurpose::Kv).unwrap().kind, MemKind::Managed);
    assert_eq!(p.decision("kv").unwrap().rule, Rule::KvLarge);
    assert_eq!(
        p.buffer(BufferPurpose::Scratch).unwrap().kind,
        MemKind::Managed
    );
}

#[test]
fn strix_stock_q4_is_refused_naming_the_shortfall() {
    let inv = flash(Quant::Q4);
    let f = fit_err(run(
        "strix-halo-stock",
        &inv,
        &request(4096, scratch_for(4096)),
    ));
    let opts: Vec<&str> = f.tried.iter().map(|o| o.option.as_str()).collect();
    assert_eq!(
        opts,
        [
            "weights in pinned host",
            "weights in managed",
            "weights in device"
        ]
    );
    let host = &f.tried[0].shortfalls[0];
    assert_eq!(host.pool, ds4_placement::Pool::Host);
    assert_eq!(host.budget, 121 * GIB - 64 * MIB - 2 * GIB);
    assert!(
        host.short() > 34 * GIB && host.short() < 37 * GIB,
        "{}",
        host.short()
    );
    // RAM is the limit, so raising GTT is not offered; q2 is.
    assert!(f.remedies.contains(&Remedy::SmallerExpertQuant {
        routed_bytes: 155_826_782_208,
        bits_per_weight_milli: Some(4500)
    }));
    assert!(!f
        .remedies
        .iter()
        .any(|r| matches!(r, Remedy::RaiseGtt { .. })));
    let msg = Refusal::DoesNotFit(f).to_string();
    assert!(msg.contains("host memory short by"), "{msg}");
    assert!(msg.contains("q2 instead of q4"), "{msg}");
    assert!(msg.contains("145.12 GiB at 4.50 bits/weight"), "{msg}");
    assert!(msg.contains("nothing was allocated"), "{msg}");
}

#[test]
fn strix_stock_forced_device_is_refused_with_gtt_remedy() {
    let mut req = request(4096, scratch_for(4096));
    req.overrides = env(&[("DS4_ROCM_FORCE_DEVICE_MEM", "1")]);
    let inv = flash(Quant::Q2);
    let f = fit_err(run("strix-halo-stock", &inv, &req));
    assert_eq!(f.tried.len(), 1);
    assert_eq!(f.tried[0].shortfalls[0].pool, ds4_placement::Pool::Device);
    assert!(f.remedies.contains(&Remedy::DropOverride {
        setting: "DS4_ROCM_FORCE_DEVICE_MEM=1".into()
    }));
    let (g, pages) = f
        .remedies
        .iter()
        .find_map(|r| match r {
            Remedy::RaiseGtt {
                pool_gib,
                pages_limit,
            } => Some((*pool_gib, *pages_limit)),
            _ => None,
        })
        .expect("GTT remedy");
    assert_eq!(pages, g * 262_144);
    // The experts are already 2-bit: no "use q2" advice.
    assert!(!f
        .remedies
        .iter()
        .any(|r| matches!(r, Remedy::SmallerExpertQuant { .. })));
    // Independent check: the pool must hold the weights + the 0.5 GiB device reserve +
    // the 0.5 GiB the runtime already uses; KV and scratch then no longer fit beside
    // them, so the ds4 rule sends them to managed memory.
    // (Alignment padding adds at most 256 B per small tensor.)
    let need = inv.total_bytes() + GIB;
    let (lo, hi) = (need.div_ceil(GIB), (need + 1328 * 256).div_ceil(GIB));
    assert!((lo..=hi).contains(&g), "{g} GiB for {need}");
    let mut m = machine("strix-halo-stock");
    let at = |m: &mut ds4_placement::MachineFacts, g: u64| {
        m.device.pool_total = g * GIB;
        m.device.pool_free = g * GIB - GIB / 2;
        plan(&m.host, &m.device, &inv, &req, &Policy::default())
    };
    let p = at(&mut m, g).unwrap();
    assert_eq!(p.mode, WeightsMode::Device);
    assert!(
        p.arenas.iter().all(|a| a.fallback.is_empty()),
        "forced: no fallback"
    );
    assert_eq!(p.buffer(BufferPurpose::Kv).unwrap().kind, MemKind::Managed);
    assert!(at(&mut m, g - 1).is_err());
    let text = Refusal::DoesNotFit(f).to_string();
    assert!(text.contains(&format!("ttm.pages_limit={pages}")), "{text}");
}

#[test]
fn raised_gtt_keeps_pinned_host_and_force_device_works() {
    let inv = flash(Quant::Q2);
    let p = run(
        "strix-halo-gtt124",
        &inv,
        &request(65_536, scratch_for(65_536)),
    )
    .unwrap();
    assert_eq!(p.mode, WeightsMode::PinnedHost);
    let mut req = request(65_536, scratch_for(65_536));
    req.overrides = env(&[("DS4_ROCM_FORCE_DEVICE_MEM", "1")]);
    let p = run("strix-halo-gtt124", &inv, &req).unwrap();
    assert_eq!(p.mode, WeightsMode::Device);
    let w = p.decision("weights").unwrap();
    assert_eq!(w.rule, Rule::Override);
    assert_eq!(w.source.to_string(), "DS4_ROCM_FORCE_DEVICE_MEM=1");
    // On unified memory the device pool is RAM: the host ledger carries it.
    assert!(p.ledger.host.via_device > 80 * GIB);
    assert!(p.ledger.fits());
}

#[test]
fn carveout_96g_at_16k_puts_weights_in_device_and_scratch_in_managed() {
    // ds4 #359/#361: weights fit the carve-out, 16k-context scratch does not.
    let inv = flash(Quant::Q2);
    let p = run("strix-halo-carveout96", &inv, &request(16_384, 17 * GIB)).unwrap();
    assert_eq!(p.mode, WeightsMode::Device);
    let w = p.decision("weights").unwrap();
    let rej: Vec<&str> = w.rejected.iter().map(|a| a.option.as_str()).collect();
    assert_eq!(rej, ["weights in pinned host", "weights in managed"]);
    assert_eq!(p.ledger.host.via_device, 0, "the carve-out is not OS RAM");
    assert_eq!(
        p.buffer(BufferPurpose::Scratch).unwrap().kind,
        MemKind::Managed
    );
    assert_eq!(p.buffer(BufferPurpose::Kv).unwrap().kind, MemKind::Managed);
    assert_eq!(
        p.decision("scratch").unwrap().rule,
        Rule::ContextExceedsDevice
    );
    // At 4k with small scratch everything stays in the carve-out.
    let p = run(
        "strix-halo-carveout96",
        &inv,
        &request(4096, scratch_for(4096)),
    )
    .unwrap();
    assert_eq!(
        p.buffer(BufferPurpose::Scratch).unwrap().kind,
        MemKind::Device
    );
    // DS4_CUDA_MANAGED=1 forces managed scratch even then.
    let mut req = request(4096, scratch_for(4096));
    req.overrides = env(&[("DS4_CUDA_MANAGED", "1")]);
    let p = run("strix-halo-carveout96", &inv, &req).unwrap();
    let s = p.decision("scratch").unwrap();
    assert_eq!((s.kind, s.rule), (Some(MemKind::Managed), Rule::Override));
    assert_eq!(p.buffer(BufferPurpose::Kv).unwrap().kind, MemKind::Device);
}

#[test]
fn gb10_q2_goes_managed_with_read_mostly_advice() {
    let p = run(
        "dgx-spark-gb10",
        &flash(Quant::Q2),
        &request(4096, scratch_for(4096)),
    )
    .unwrap();
    assert_eq!(p.mode, WeightsMode::Managed);
    assert!(p
        .arenas
        .iter()
        .all(|a| a.advice == ds4_placement::ManagedAdvice::ReadMostlyPreferDevice));
    assert_eq!(
        p.arenas[0].fallback,
        vec![MemKind::PinnedHost, MemKind::Device]
    );
    let f = fit_err(run(
        "dgx-spark-gb10",
        &flash(Quant::Q4),
        &request(4096, scratch_for(4096)),
    ));
    assert!(f
        .remedies
        .iter()
        .any(|r| matches!(r, Remedy::SmallerExpertQuant { .. })));
}

#[test]
fn discrete_24g_q2_is_hybrid() {
    let inv = flash(Quant::Q2);
    let p = run("discrete-24g-64g", &inv, &request(4096, scratch_for(4096))).unwrap();
    assert_eq!(p.mode, WeightsMode::Hybrid);
    for a in &p.arenas {
        for s in &a.spans {
            let t = &inv.tensors[s.tensor];
            if t.class.read_whole_every_token() {
                assert_eq!(
                    a.kind,
                    MemKind::Device,
                    "{} must stay on the device",
                    t.name
                );
            }
        }
    }
    let on_dev = p.class_bytes_in(TensorClass::RoutedExperts, MemKind::Device);
    let on_host = p.class_bytes_in(TensorClass::RoutedExperts, MemKind::PinnedHost);
    assert_eq!(
        on_dev + on_host,
        inv.class_bytes(TensorClass::RoutedExperts)
    );
    assert!(
        on_dev > 10 * GIB,
        "free device room is refilled with experts: {on_dev}"
    );
    assert!(on_host > 55 * GIB);
    assert!(p.buffers.iter().all(|b| b.kind == MemKind::Device));
    let w = p.decision("weights").unwrap();
    assert_eq!(w.rule, Rule::DiscreteHybrid);
    assert_eq!(w.rejected[0].option, "everything in the device pool");
    assert!(p.ledger.fits());
    assert!(p.ledger.device.headroom() < 600 * MIB, "device filled");
    assert!(p.warnings.iter().any(|w| w.contains("hybrid")));
}

#[test]
fn discrete_16g_32g_q2_is_refused() {
    let f = fit_err(run(
        "discrete-16g-32g",
        &flash(Quant::Q2),
        &request(4096, scratch_for(4096)),
    ));
    assert_eq!(f.tried.len(), 2);
    assert_eq!(f.tried[0].option, "everything in the device pool");
    assert!(f.tried[1].option.starts_with("hybrid"));
    assert_eq!(f.tried[1].shortfalls[0].pool, ds4_placement::Pool::Host);
    let text = Refusal::DoesNotFit(f.clone()).to_string();
    assert!(text.contains("device pool short by"), "{text}");
    assert!(text.contains("host memory short by"), "{text}");
}

#[test]
fn h200_q2_is_resident_and_q4_hybrid() {
    let p = run(
        "h200-128g",
        &flash(Quant::Q2),
        &request(65_536, scratch_for(65_536)),
    )
    .unwrap();
    assert_eq!(p.mode, WeightsMode::Device);
    assert_eq!(p.decision("weights").unwrap().rule, Rule::DiscreteFits);
    assert_eq!(
        p.ledger.host.used(),
        0,
        "never host memory on a discrete GPU with room"
    );
    assert!(p
        .arenas
        .iter()
        .all(|a| a.kind == MemKind::Device && a.fallback.is_empty()));
    let q4 = flash(Quant::Q4);
    let p = run("h200-128g", &q4, &request(65_536, scratch_for(65_536))).unwrap();
    assert_eq!(p.mode, WeightsMode::Hybrid);
    let host: u64 = p
        .arenas
        .iter()
        .filter(|a| a.kind == MemKind::PinnedHost)
        .map(|a| a.bytes)
        .sum();
    // 153.3 GiB of weights, ~139 GiB of device budget: only the overflow goes to the host.
    assert!(host > 14 * GIB && host < 22 * GIB, "{host}");
    // The native MXFP4 layout (145.3 GiB) overflows by ~8 GiB less than q4.
    let p = run(
        "h200-128g",
        &flash(Quant::Mxfp4),
        &request(65_536, scratch_for(65_536)),
    )
    .unwrap();
    assert_eq!(p.mode, WeightsMode::Hybrid);
    let host_mx: u64 = p
        .arenas
        .iter()
        .filter(|a| a.kind == MemKind::PinnedHost)
        .map(|a| a.bytes)
        .sum();
    let saved = (164_628_168_768u64 - 155_971_125_312) as f64;
    assert!(
        (host as f64 - host_mx as f64 - saved).abs() < (2 * GIB) as f64,
        "q4 host {host}, mxfp4 host {host_mx}"
    );
}

#[test]
fn device_mem_limit_reproduces_a_small_card() {
    let mut req = request(4096, scratch_for(4096));
    req.overrides = env(&[("DS4_DEVICE_MEM_LIMIT_GIB", "24")]);
    let p = run("h200-128g", &flash(Quant::Q2), &req).unwrap();
    assert_eq!(p.mode, WeightsMode::Hybrid);
    assert!(p.ledger.device.used() <= 24 * GIB - 512 * MIB);
    assert_eq!(p.facts.device_limit, Some(24 * GIB));
}

#[test]
fn cgroup_limited_container_is_refused_with_the_limit_named() {
    let inv = flash(Quant::Q2);
    let req = request(4096, scratch_for(4096));
    let f = fit_err(run("container-cgroup64", &inv, &req));
    assert_eq!(f.facts.cgroup_available, Some(63 * GIB));
    assert_eq!(f.facts.host_budget, 61 * GIB);
    let limit = f
        .remedies
        .iter()
        .find_map(|r| match r {
            Remedy::RaiseCgroupLimit { limit } => Some(*limit),
            _ => None,
        })
        .expect("cgroup remedy");
    let mut m = machine("container-cgroup64");
    m.host.cgroup.as_mut().unwrap().limit = limit;
    assert_eq!(
        plan(&m.host, &m.device, &inv, &req, &Policy::default())
            .unwrap()
            .mode,
        WeightsMode::PinnedHost
    );
    m.host.cgroup.as_mut().unwrap().limit = limit - GIB;
    assert!(plan(&m.host, &m.device, &inv, &req, &Policy::default()).is_err());
    assert!(Refusal::DoesNotFit(f)
        .to_string()
        .contains("container memory limit"));
}

#[test]
fn tiny_memlock_moves_weights_to_managed_where_it_binds() {
    let inv = flash(Quant::Q2);
    let req = request(4096, scratch_for(4096));
    let p = run("strix-halo-memlock64k", &inv, &req).unwrap();
    assert_eq!(p.mode, WeightsMode::Managed);
    let w = p.decision("weights").unwrap();
    assert_eq!(w.rejected[0].option, "weights in pinned host");
    assert!(
        w.rejected[0].reason.contains("RLIMIT_MEMLOCK short by"),
        "{}",
        w.rejected[0].reason
    );
    assert!(p.ledger.memlock.is_some());
    assert_eq!(
        p.arenas[0].advice,
        ds4_placement::ManagedAdvice::CoarseGrain
    );
    // A runtime that pins outside mlock: pinned host, with a warning.
    let mut m = machine("strix-halo-memlock64k");
    m.device.caps.pinned_counts_against_memlock = false;
    let p = plan(&m.host, &m.device, &inv, &req, &Policy::default()).unwrap();
    assert_eq!(p.mode, WeightsMode::PinnedHost);
    assert!(p
        .warnings
        .iter()
        .any(|w| w.contains("RLIMIT_MEMLOCK is 64.00 KiB")));
    // With strict managed unsupported too, the refusal names the memlock remedy.
    let mut m = machine("strix-halo-memlock64k");
    m.device.caps.managed = false;
    let mut req = req.clone();
    req.overrides = Overrides::weights(MemChoice::Host);
    let f = fit_err(plan(&m.host, &m.device, &inv, &req, &Policy::default()));
    assert!(f.remedies.contains(&Remedy::RaiseMemlock));
}

#[test]
fn mtp_sidecar_is_placed_with_the_main_model() {
    let inv = flash_with_mtp(Quant::Q2);
    let p = run("strix-halo-stock", &inv, &request(4096, scratch_for(4096))).unwrap();
    assert_eq!(p.mode, WeightsMode::PinnedHost);
    let mtp: u64 = p
        .classes
        .iter()
        .filter(|r| r.set == WeightSet::Mtp)
        .map(|r| r.bytes)
        .sum();
    assert_eq!(mtp, inv.set_bytes(WeightSet::Mtp));
    assert!(
        p.mtp.as_ref().is_some_and(|m| m.resident),
        "{}",
        p.render_text()
    );
    // 3.5 GiB more than q2 alone on a machine that barely holds q2 hybrid: the model's own
    // plan, the block left out (docs/placement.md §10).
    let req = request(4096, scratch_for(4096));
    let p = run("discrete-24g-64g", &inv, &req).unwrap();
    let alone = run("discrete-24g-64g", &flash(Quant::Q2), &req).unwrap();
    assert_eq!(p.mode, WeightsMode::Hybrid);
    assert_eq!((&p.arenas, &p.buffers), (&alone.arenas, &alone.buffers));
    let m = p
        .mtp
        .as_ref()
        .expect("the plan says what became of the block");
    assert!(!m.resident);
    assert_eq!(m.weight_bytes, inv.set_bytes(WeightSet::Mtp));
    assert!(
        m.reason.contains("does not fit next to the model"),
        "{}",
        m.reason
    );
    assert!(m.reason.contains("hybrid"), "{}", m.reason);
    let d = p
        .decisions
        .iter()
        .find(|d| d.subject == "weights.mtp")
        .unwrap();
    assert_eq!((d.kind, d.rule), (None, Rule::MtpLeftOut));
    assert!(p.warnings.iter().any(|w| w.contains("prompt lookup")));
    let text = p.render_text();
    assert!(text.contains("MTP block: LEFT OUT"), "{text}");
    assert!(text.contains("weights.mtp -> dropped"), "{text}");
    assert!(p.summary_line().contains("MTP block LEFT OUT"));
    assert!(!p.classes.iter().any(|r| r.set == WeightSet::Mtp));
}

/// The block never changes how the model itself is placed: a q2 model that fits the
/// device alone keeps its device plan, and the block, which would only fit by moving
/// routed experts to pinned host memory, is left out with that reason.
#[test]
fn an_mtp_block_never_makes_a_device_plan_hybrid() {
    let req0 = request(4096, scratch_for(4096));
    let alone = run("h200-128g", &flash(Quant::Q2), &req0).unwrap();
    assert_eq!(alone.mode, WeightsMode::Device);
    // A device pool with 1 GiB to spare beyond the model alone.
    let used = alone.ledger.device.used();
    let mut req = req0.clone();
    req.overrides.device_mem_limit = Setting::new(
        Some(used + GIB + GIB / 2),
        Source::Cli {
            flag: "--device-mem-limit-gib".into(),
            value: "test".into(),
        },
    );
    let p = run("h200-128g", &flash(Quant::Q2), &req).unwrap();
    assert_eq!(p.mode, WeightsMode::Device);
    let p = run("h200-128g", &flash_with_mtp(Quant::Q2), &req).unwrap();
    assert_eq!(p.mode, WeightsMode::Device, "{}", p.render_text());
    let m = p.mtp.as_ref().unwrap();
    assert!(!m.resident);
    assert!(
        m.reason
            .contains("fits only if the model's weights go hybrid"),
        "{}",
        m.reason
    );
}

/// The block's session memory is one more buffer, placed and charged as the KV cache is,
/// only when the inventory holds the block.
#[test]
fn the_mtp_state_is_placed_with_the_kv_cache() {
    let mut req = request(4096, scratch_for(4096));
    req.mtp_state_bytes = 131 * 1_000_000;
    let inv = flash_with_mtp(Quant::Q2);
    let with = run("h200-128g", &inv, &req).unwrap();
    let mut req0 = req.clone();
    req0.mtp_state_bytes = 0;
    let without = run("h200-128g", &flash(Quant::Q2), &req0).unwrap();
    let st = with
        .buffers
        .iter()
        .find(|b| b.purpose == BufferPurpose::MtpState)
        .expect("an MTP state buffer");
    let kv = with
        .buffers
        .iter()
        .find(|b| b.purpose == BufferPurpose::Kv)
        .unwrap();
    assert_eq!((st.bytes, st.kind), (req.mtp_state_bytes, kv.kind));
    assert_eq!(
        with.ledger.device.kv,
        without.ledger.device.kv + req.mtp_state_bytes
    );
    // Its 32 tensors' bytes, plus at most their 256-byte alignment in the arenas.
    let grew = with.ledger.device.weights - without.ledger.device.weights;
    let mtp = inv.set_bytes(WeightSet::Mtp);
    assert!(grew >= mtp && grew < mtp + 32 * 256, "{grew} vs {mtp}");
    let m = with.mtp.as_ref().unwrap();
    assert!(m.resident && m.reason.is_empty());
    assert_eq!(m.state_bytes, req.mtp_state_bytes);
    assert!(with
        .render_text()
        .contains("MTP block: 3.55 GiB of weights"));
    assert!(
        with.summary_line().contains("MTP block 3.55 GiB"),
        "{}",
        with.summary_line()
    );
    // Without the block's tensors its state is not planned either.
    let p = run("h200-128g", &flash(Quant::Q2), &req).unwrap();
    assert!(p.mtp.is_none());
    assert!(!p
        .buffers
        .iter()
        .any(|b| b.purpose == BufferPurpose::MtpState));
}

#[test]
fn tiny_fixture_fits_everywhere_in_one_shared_arena() {
    let inv = tiny();
    for m in ALL_MACHINES {
        let p = run(m, &inv, &request(4096, 64 * MIB)).unwrap_or_else(|e| panic!("{m}: {e}"));
        assert_eq!(p.arenas.len(), 1, "{m}");
        assert!(!p.arenas[0].dedicated);
        assert_eq!(p.arenas[0].spans.len(), 116);
        assert!(p.arenas[0].spans.iter().all(|s| s.offset % 256 == 0));
        let expected = match machine(m).device.kind {
            ds4_placement::DeviceKind::Discrete => WeightsMode::Device,
            ds4_placement::DeviceKind::CoherentUma => WeightsMode::Managed,
            _ if m.contains("memlock") => WeightsMode::Managed,
            _ => WeightsMode::PinnedHost,
        };
        assert_eq!(p.mode, expected, "{m}");
    }
}

#[test]
fn cpu_backend_uses_host_memory_and_rejects_device_overrides() {
    let host = machine("h200-128g").host;
    let cpu = DeviceFacts::cpu();
    let inv = flash(Quant::Q2);
    let p = plan(
        &host,
        &cpu,
        &inv,
        &request(4096, scratch_for(4096)),
        &Policy::default(),
    )
    .unwrap();
    assert_eq!(p.mode, WeightsMode::Pageable);
    assert_eq!(p.load, ds4_placement::LoadStrategy::Mmap);
    assert!(p.buffers.iter().all(|b| b.kind == MemKind::Pageable));
    let mut req = request(4096, scratch_for(4096));
    req.overrides = Overrides::weights(MemChoice::Device);
    match plan(&host, &cpu, &inv, &req, &Policy::default()) {
        Err(Refusal::Unsupported(u)) => {
            assert!(u.reason.contains("only host memory"), "{u}");
            assert!(u.setting.contains("--weights-mem device"));
        }
        other => panic!("{other:?}"),
    }
    let small = machine("discrete-16g-32g").host;
    let f = fit_err(plan(
        &small,
        &cpu,
        &inv,
        &request(4096, scratch_for(4096)),
        &Policy::default(),
    ));
    assert_eq!(f.tried[0].option, "weights in host memory");
}

#[test]
fn host_override_needs_host_mapped_access() {
    let mut m = machine("discrete-24g-64g");
    m.device.caps.host_mapped = false;
    let mut req = request(4096, scratch_for(4096));
    req.overrides = Overrides::weights(MemChoice::Host);
    let r = plan(&m.host, &m.device, &tiny(), &req, &Policy::default());
    assert!(matches!(r, Err(Refusal::Unsupported(_))), "{r:?}");
    // Without host-mapped access there is no hybrid either: q2 is refused, not host-mapped.
    let f = fit_err(plan(
        &m.host,
        &m.device,
        &flash(Quant::Q2),
        &request(4096, GIB),
        &Policy::default(),
    ));
    assert!(f.tried[1]
        .note
        .as_deref()
        .unwrap()
        .contains("cannot read pinned host memory"));
}

#[test]
fn optional_caches_are_admitted_only_with_reserve_left() {
    let mut req = request(4096, scratch_for(4096));
    req.optional_caches.push(OptionalCache {
        name: "q8-f16".into(),
        bytes: 20 * GIB,
    });
    let p = run("h200-128g", &flash(Quant::Q2), &req).unwrap();
    let d = p.decision("optional:q8-f16").unwrap();
    assert_eq!(
        (d.kind, d.rule),
        (Some(MemKind::Device), Rule::OptionalAdmitted)
    );
    assert!(p.ledger.device.headroom() >= 8 * GIB);
    let p = run("discrete-24g-64g", &flash(Quant::Q2), &req).unwrap();
    let d = p.decision("optional:q8-f16").unwrap();
    assert_eq!((d.kind, d.rule), (None, Rule::OptionalDropped));
    assert!(p.buffer(BufferPurpose::OptionalCache).is_none());
}

#[test]
fn smaller_context_remedy_is_exact() {
    // 24 GB card, q2 at 1M context: KV alone is 13.4 GiB on the device.
    let inv = flash(Quant::Q2);
    let req = request(1 << 20, scratch_for(4096));
    let f = fit_err(run("discrete-24g-64g", &inv, &req));
    let max_ctx = f
        .remedies
        .iter()
        .find_map(|r| match r {
            Remedy::SmallerContext { max_ctx } => Some(*max_ctx),
            _ => None,
        })
        .expect("ctx remedy");
    let at = |c: u64| {
        let mut r = req.clone();
        r.ctx = c;
        run("discrete-24g-64g", &inv, &r).is_ok()
    };
    assert!(at(max_ctx) && !at(max_ctx + 1), "{max_ctx}");
    assert!(max_ctx > 1000 && max_ctx < 1 << 20);
}

#[test]
fn smaller_context_remedy_resizes_scratch() {
    // Resident q2 on a 24 GB card with 64 GB of RAM, whose scratch grows with the context
    // (as the indexer's rows do; steeper here so that it matters): the remedy is the
    // largest context that fits with the scratch of that context, not with the scratch of
    // the refused one (which offered 824 where 8151 fits).
    let inv = flash(Quant::Q2);
    let per4 = 256 * 1024;
    let mut req = request(32768, GIB + per4 * 32768 / 4);
    req.scratch_bytes_per_4_ctx = per4;
    let f = fit_err(run("discrete-24g-64g", &inv, &req));
    let max_ctx = f
        .remedies
        .iter()
        .find_map(|r| match r {
            Remedy::SmallerContext { max_ctx } => Some(*max_ctx),
            _ => None,
        })
        .expect("ctx remedy");
    let at = |c: u64| run("discrete-24g-64g", &inv, &req.at_context(c)).is_ok();
    assert!(at(max_ctx) && !at(max_ctx + 1), "{max_ctx}");
    // With the refused context's scratch kept, the answer would be smaller.
    let mut same_scratch = req.clone();
    same_scratch.ctx = max_ctx;
    assert!(
        run("discrete-24g-64g", &inv, &same_scratch).is_err(),
        "{max_ctx}: the test needs scratch to matter"
    );
}

#[test]
fn invalid_inputs_are_named() {
    let m = machine("h200-128g");
    let r = plan(
        &m.host,
        &m.device,
        &TensorInventory::default(),
        &request(1, 0),
        &Policy::default(),
    );
    assert_eq!(
        r.unwrap_err().to_string(),
        "invalid placement input: the tensor inventory is empty"
    );
    let r = plan(
        &m.host,
        &m.device,
        &tiny(),
        &request(0, 0),
        &Policy::default(),
    );
    assert!(r.unwrap_err().to_string().contains("at least 1 token"));
    let bad = Policy {
        span_alignment: 100,
        ..Policy::default()
    };
    assert!(matches!(
        plan(&m.host, &m.device, &tiny(), &request(1, 0), &bad),
        Err(Refusal::InvalidInput(_))
    ));
}

#[test]
fn report_text_and_json() {
    let p = run(
        "strix-halo-stock",
        &flash(Quant::Q2),
        &request(4096, scratch_for(4096)),
    )
    .unwrap();
    let t = p.render_text();
    for needle in [
        "weights: pinned host",
        "OS reserve 2.00 GiB (default)",
        "routed experts",
        "pinned host",
        "KV cache",
        "arenas: ",
        "131 dedicated exact-size",
        "weights -> pinned host",
        "change with --weights-mem auto|device|host|managed",
        "unified-memory clamp",
    ] {
        assert!(t.contains(needle), "missing {needle:?} in\n{t}");
    }
    let back: Plan = serde_json::from_str(&p.to_json()).unwrap();
    assert_eq!(back, p);
    let f = run(
        "strix-halo-stock",
        &flash(Quant::Q4),
        &request(4096, scratch_for(4096)),
    )
    .unwrap_err();
    let j: serde_json::Value = serde_json::from_str(&f.to_json()).unwrap();
    assert_eq!(j["refusal"], "does_not_fit");
    assert_eq!(j["detail"]["tried"][0]["shortfalls"][0]["pool"], "host");
}

#[test]
fn identical_facts_give_identical_plans() {
    let inv = flash(Quant::Q2);
    for m in ALL_MACHINES {
        let a = run(m, &inv, &request(65_536, scratch_for(65_536)));
        let b = run(m, &inv, &request(65_536, scratch_for(65_536)));
        assert_eq!(a, b, "{m}");
    }
}

/// The full matrix: every machine × {q2, q4, q2+MTP} × {4k, 64k, 1M}.
#[test]
fn machine_matrix() {
    use WeightsMode::*;
    let refused = None;
    // (machine, [q2, q4, q2+mtp] for each of 4k, 64k, 1M)
    let table: [(&str, [[Option<WeightsMode>; 3]; 3]); 9] = [
        (
            "strix-halo-stock",
            [[Some(PinnedHost), refused, Some(PinnedHost)]; 3],
        ),
        (
            "strix-halo-gtt124",
            [[Some(PinnedHost), refused, Some(PinnedHost)]; 3],
        ),
        (
            "strix-halo-carveout96",
            [[Some(Device), refused, Some(Device)]; 3],
        ),
        (
            "dgx-spark-gb10",
            [[Some(Managed), refused, Some(Managed)]; 3],
        ),
        (
            "discrete-24g-64g",
            [
                // q2+MTP: the model's hybrid plan, the block left out.
                [Some(Hybrid), refused, Some(Hybrid)],
                [refused, refused, refused],
                [refused, refused, refused],
            ],
        ),
        ("discrete-16g-32g", [[refused; 3]; 3]),
        ("h200-128g", [[Some(Device), Some(Hybrid), Some(Device)]; 3]),
        ("container-cgroup64", [[refused; 3]; 3]),
        (
            "strix-halo-memlock64k",
            [[Some(Managed), refused, Some(Managed)]; 3],
        ),
    ];
    let invs = [
        flash(Quant::Q2),
        flash(Quant::Q4),
        flash_with_mtp(Quant::Q2),
    ];
    for (m, rows) in table {
        let mf = machine(m);
        for (ci, ctx) in [4096u64, 65_536, 1 << 20].into_iter().enumerate() {
            for (ii, inv) in invs.iter().enumerate() {
                let req = request(ctx, scratch_for(ctx));
                let got = plan(&mf.host, &mf.device, inv, &req, &Policy::default());
                let want = rows[ci][ii];
                match (&got, want) {
                    (Ok(p), Some(mode)) => {
                        assert_eq!(p.mode, mode, "{m} inv{ii} ctx {ctx}");
                        assert!(p.ledger.fits());
                        assert_eq!(p.mtp.is_some(), ii == 2, "{m} inv{ii} ctx {ctx}");
                        let _ = p.render_text();
                    }
                    (Err(Refusal::DoesNotFit(f)), None) => {
                        assert!(!f.tried.is_empty());
                        let _ = f.to_string();
                    }
                    _ => panic!(
                        "{m} inv{ii} ctx {ctx}: want {want:?}, got {}",
                        match &got {
                            Ok(p) => p.render_text(),
                            Err(e) => e.to_string(),
                        }
                    ),
                }
            }
        }
    }
}

#[test]
fn host_facts_unused_field_roundtrip() {
    // Machine files reject typos instead of silently planning for a different machine.
    let bad = r#"{"host":{"mem_total":1,"mem_avail":1},"device":{"name":"x","kind":"discrete","pool_total":1,"pool_free":1}}"#;
    assert!(ds4_placement::MachineFacts::from_json(bad).is_err());
    let h: HostFacts =
        serde_json::from_str(r#"{"mem_total":"1 GiB","mem_available":"1 GiB"}"#).unwrap();
    assert_eq!(h.mem_total, GIB);
}

#[test]
#[ignore = "prints the reports for the issue note: cargo test -- --ignored --nocapture"]
fn print_reports() {
    let q2 = flash(Quant::Q2);
    println!(
        "{}",
        run("strix-halo-stock", &q2, &request(4096, scratch_for(4096)))
            .unwrap()
            .render_text()
    );
    println!(
        "{}",
        run("discrete-24g-64g", &q2, &request(4096, scratch_for(4096)))
            .unwrap()
            .render_text()
    );
    println!(
        "{}",
        run(
            "strix-halo-stock",
            &flash(Quant::Q4),
            &request(4096, scratch_for(4096))
        )
        .unwrap_err()
    );
    let mut req = request(4096, scratch_for(4096));
    req.overrides = env(&[("DS4_ROCM_FORCE_DEVICE_MEM", "1")]);
    println!("\n{}", run("strix-halo-stock", &q2, &req).unwrap_err());
    println!(
        "\n{}",
        run("container-cgroup64", &q2, &request(4096, scratch_for(4096))).unwrap_err()
    );
    println!(
        "\n{}",
        run(
            "discrete-24g-64g",
            &q2,
            &request(1 << 20, scratch_for(1 << 20))
        )
        .unwrap_err()
    );
}
