//! Streamed routed experts: chosen only when nothing resident fits (or when asked), the
//! cache sized from the budgets, refused only below one token's experts plus the policy's
//! extra, and the plan's data enough to build an expert cache from.

mod common;

use common::*;
use ds4_placement::bytes::GIB;
use ds4_placement::{
    plan, BufferPurpose, ExpertsChoice, MemKind, Plan, Policy, Refusal, Request, RoutedExperts,
    Rule, Setting, Source, TensorClass, TensorInventory, WeightSet, WeightsMode,
};

fn streaming_request(ctx: u64) -> Request {
    let mut r = request(ctx, scratch_for(ctx));
    r.routed_experts = Some(RoutedExperts {
        per_layer: 256,
        per_token: 6,
    });
    r
}

fn with_experts(mut r: Request, c: ExpertsChoice) -> Request {
    r.overrides.experts = Setting::new(
        c,
        Source::Cli {
            flag: "--experts".into(),
            value: c.as_str().into(),
        },
    );
    r
}

fn run(m: &str, inv: &TensorInventory, req: &Request) -> Result<Plan, Refusal> {
    let mf = machine(m);
    plan(&mf.host, &mf.device, inv, req, &Policy::default())
}

/// The invariants every streamed plan keeps, checked against its inventory.
fn check_streamed(p: &Plan, inv: &TensorInventory, cache_kind: MemKind) {
    assert_eq!(p.mode, WeightsMode::Streamed);
    assert!(p.ledger.fits(), "{}", p.render_text());
    let st = p
        .stream
        .as_ref()
        .expect("a streamed plan describes its stream");
    // Every routed-expert tensor is streamed, and no arena holds one; every other tensor
    // sits in exactly one span, named as in the inventory.
    let mut placed = vec![0usize; inv.tensors.len()];
    for a in &p.arenas {
        for s in &a.spans {
            assert_eq!(inv.tensors[s.tensor].name, s.name);
            assert_ne!(inv.tensors[s.tensor].class, TensorClass::RoutedExperts);
            placed[s.tensor] += 1;
        }
    }
    let mut streamed = vec![false; inv.tensors.len()];
    for t in &st.tensors {
        assert_eq!(inv.tensors[t.tensor].name, t.name);
        assert_eq!(t.expert_bytes * u64::from(st.experts_per_layer), t.bytes);
        streamed[t.tensor] = true;
    }
    for (i, t) in inv.tensors.iter().enumerate() {
        let expert = t.class == TensorClass::RoutedExperts;
        assert_eq!(streamed[i], expert, "{}", t.name);
        assert_eq!(placed[i], usize::from(!expert), "{}", t.name);
    }
    // Units and sizes.
    let all: u64 = st.tensors.iter().map(|t| t.bytes).sum();
    assert_eq!(st.all_bytes, all);
    assert_eq!(st.cache.kind, cache_kind);
    assert_eq!(st.cache.bytes, st.cache_slots * st.slot_bytes);
    assert!(st.cache.bytes >= st.min_cache_bytes && st.min_cache_bytes > st.per_token_bytes);
    assert_eq!(
        p.buffer(BufferPurpose::ExpertCache).map(|b| b.bytes),
        Some(st.cache.bytes)
    );
    let cached = (st.cache.bytes + st.host_tier.as_ref().map_or(0, |t| t.bytes)).min(all);
    assert!((st.assumed_hit_rate - cached as f64 / all as f64).abs() < 1e-12);
    match st.predicted_tokens_per_s {
        Some(t) => {
            let want = st.read_bytes_per_s as f64 / st.disk_bytes_per_token as f64;
            assert!((t - want).abs() <= 1e-9 * want);
        }
        None => assert_eq!(st.disk_bytes_per_token, 0),
    }
    let text = p.render_text();
    assert!(text.contains("streamed routed experts:"), "{text}");
    assert!(text.contains("ASSUMED"), "{text}");
}

#[test]
fn discrete_16g_32g_q2_streams_instead_of_refusing() {
    let inv = flash(Quant::Q2);
    let p = run("discrete-16g-32g", &inv, &streaming_request(32_768)).unwrap();
    check_streamed(&p, &inv, MemKind::Device);
    let st = p.stream.as_ref().unwrap();
    // V4 Flash: 43 layers × 6 experts of 256 per token.
    assert_eq!(st.units, 43 * 256);
    assert!(st.per_token_bytes > GIB && st.per_token_bytes < 2 * GIB);
    // The device holds the rest, the session and the cache; a pinned host tier takes RAM
    // but leaves the optional-cache reserve free.
    let tier = st
        .host_tier
        .as_ref()
        .expect("32 GB of RAM leave room for a host tier");
    assert_eq!(tier.kind, MemKind::PinnedHost);
    assert!(p.ledger.host.headroom() >= Policy::default().optional_reserve);
    let d = p.decision("weights.routed_experts").unwrap();
    assert_eq!(d.rule, Rule::ExpertsStreamed);
    // Why: the resident options that failed.
    assert_eq!(d.rejected.len(), 2, "{:?}", d.rejected);
    assert!(p.stream.as_ref().unwrap().predicted_tokens_per_s.unwrap() > 0.0);
}

#[test]
fn a_64g_cpu_machine_streams_into_pageable_memory() {
    let inv = flash(Quant::Q2);
    let p = run("cpu-64g", &inv, &streaming_request(32_768)).unwrap();
    check_streamed(&p, &inv, MemKind::Pageable);
    let st = p.stream.as_ref().unwrap();
    assert!(st.host_tier.is_none());
    assert!(st.cache.bytes > 30 * GIB);
    assert!(p.ledger.host.headroom() >= Policy::default().optional_reserve);
}

#[test]
fn a_24g_cpu_machine_streams_with_the_minimum_cache() {
    // Room for the minimum cache but not for the policy's reserve beyond it: the cache is
    // the minimum, in whole slots. The minimum used to be met before rounding to slots and
    // lost after it, refusing with an empty reason.
    let inv = flash(Quant::Q2);
    let p = run("cpu-24g", &inv, &streaming_request(32_768)).unwrap();
    check_streamed(&p, &inv, MemKind::Pageable);
    let st = p.stream.as_ref().unwrap();
    assert_eq!(st.cache.bytes, st.min_cache_bytes);
    assert_eq!(st.min_cache_bytes % st.slot_bytes, 0);
}

#[test]
fn resident_is_kept_where_it_fits_unless_streaming_is_forced() {
    let inv = flash(Quant::Q2);
    let auto = run("h200-128g", &inv, &streaming_request(32_768)).unwrap();
    assert_eq!(auto.mode, WeightsMode::Device);
    assert!(auto.stream.is_none());
    let forced = run(
        "h200-128g",
        &inv,
        &with_experts(streaming_request(32_768), ExpertsChoice::Stream),
    )
    .unwrap();
    check_streamed(&forced, &inv, MemKind::Device);
    let st = forced.stream.as_ref().unwrap();
    assert_eq!(st.cache.bytes, st.all_bytes, "the H200 caches every expert");
    assert_eq!(st.predicted_tokens_per_s, None);
    assert_eq!(
        forced.decision("weights.routed_experts").unwrap().rule,
        Rule::Override
    );
}

#[test]
fn resident_only_or_no_expert_shape_refuses_as_before() {
    let inv = flash(Quant::Q2);
    for req in [
        with_experts(streaming_request(4096), ExpertsChoice::Resident),
        request(4096, scratch_for(4096)),
    ] {
        match run("discrete-16g-32g", &inv, &req) {
            Err(Refusal::DoesNotFit(f)) => {
                assert_eq!(f.tried.len(), 2);
                assert!(f.tried.iter().all(|o| !o.option.contains("stream")));
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
}

#[test]
fn refused_only_when_the_minimum_cache_does_not_fit() {
    let inv = flash(Quant::Q2);
    let limit = |gib: f64| {
        let mut r = streaming_request(4096);
        r.overrides.device_mem_limit = Setting::new(
            Some((gib * GIB as f64) as u64),
            Source::Cli {
                flag: "--device-mem-limit-gib".into(),
                value: gib.to_string(),
            },
        );
        r
    };
    // Room for the rest and the session, not for one token's experts plus the extra.
    match run("discrete-16g-32g", &inv, &limit(11.0)) {
        Err(Refusal::DoesNotFit(f)) => {
            let s = f
                .tried
                .iter()
                .find(|o| o.option.starts_with("streamed"))
                .expect("the streamed option is reported");
            assert_eq!(s.shortfalls[0].pool, ds4_placement::Pool::Device, "{s:?}");
            assert!(s.option.contains("at least"), "{}", s.option);
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // A little more room and it plans, with the cache at or above its minimum.
    let p = run("discrete-16g-32g", &inv, &limit(14.0)).unwrap();
    check_streamed(&p, &inv, MemKind::Device);
}

#[test]
fn a_measured_read_rate_replaces_the_assumption() {
    let inv = flash(Quant::Q2);
    let mut req = streaming_request(4096);
    req.disk_read_bytes_per_s = Some(7_000_000_000);
    let p = run("cpu-64g", &inv, &req).unwrap();
    let st = p.stream.as_ref().unwrap();
    assert!(st.read_rate_measured);
    assert_eq!(st.read_bytes_per_s, 7_000_000_000);
    assert!(p.render_text().contains("7.00 GB/s measured"));
}

#[test]
fn the_expert_cache_cap_shrinks_the_cache_and_refuses_below_the_minimum() {
    let inv = flash(Quant::Q2);
    let capped = |gib: u64| {
        let mut r = with_experts(streaming_request(4096), ExpertsChoice::Stream);
        r.overrides.expert_cache = Setting::new(
            Some(gib * GIB),
            Source::Cli {
                flag: "--expert-cache-gib".into(),
                value: gib.to_string(),
            },
        );
        r
    };
    // The H200 would cache every expert; capped at 8 GiB it caches at most that much.
    let p = run("h200-128g", &inv, &capped(8)).unwrap();
    check_streamed(&p, &inv, MemKind::Device);
    let st = p.stream.as_ref().unwrap();
    assert!(st.cache.bytes <= 8 * GIB && st.cache.bytes + st.slot_bytes > 8 * GIB);
    assert_eq!(st.cache_slots, st.cache.bytes / st.slot_bytes);
    assert!(st.assumed_hit_rate < 0.5);
    // Below one token's experts plus the extra: refused, naming the minimum.
    match run("h200-128g", &inv, &capped(1)) {
        Err(Refusal::DoesNotFit(f)) => {
            let s = f
                .tried
                .iter()
                .find(|o| o.option.contains("--expert-cache-gib"))
                .expect("the capped option is reported");
            assert!(
                s.note.as_deref().unwrap_or("").contains("at least"),
                "{s:?}"
            );
            // The remedy names the cap, not "a machine with more memory".
            assert!(
                f.remedies.iter().any(|r| matches!(r,
                    ds4_placement::Remedy::DropOverride { setting } if setting.contains("--expert-cache-gib"))),
                "{:?}",
                f.remedies
            );
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// With streamed experts the MTP block is resident beside the rest — its routed experts
/// too (the engine runs the block without the stream) — and the expert cache gives up
/// its room; where the cache's minimum would not survive that, the block is left out and
/// the model keeps its streamed plan.
#[test]
fn a_streamed_plan_keeps_the_mtp_block_resident_or_leaves_it_out() {
    let inv = flash_with_mtp(Quant::Q2);
    let req = with_experts(streaming_request(4096), ExpertsChoice::Stream);
    let alone = run("cpu-64g", &flash(Quant::Q2), &req).unwrap();
    let p = run("cpu-64g", &inv, &req).unwrap();
    assert_eq!(p.mode, WeightsMode::Streamed);
    assert!(
        p.mtp.as_ref().is_some_and(|m| m.resident),
        "{}",
        p.render_text()
    );
    let st = p.stream.as_ref().unwrap();
    assert!(st.tensors.iter().all(|t| !t.name.starts_with("mtp.")));
    let mut in_arenas: Vec<&str> = p
        .arenas
        .iter()
        .flat_map(|a| a.spans.iter())
        .filter(|s| inv.tensors[s.tensor].set == WeightSet::Mtp)
        .map(|s| s.name.as_str())
        .collect();
    in_arenas.sort();
    assert_eq!(in_arenas.len(), 32);
    assert!(in_arenas.contains(&"mtp.0.ffn_gate_exps.weight"));
    let room = inv.set_bytes(WeightSet::Mtp);
    let (a, b) = (alone.stream.as_ref().unwrap(), st);
    assert!(
        b.cache.bytes < a.cache.bytes && a.cache.bytes - b.cache.bytes <= room + b.slot_bytes,
        "cache {} -> {}",
        a.cache.bytes,
        b.cache.bytes
    );
    // A cache capped at its minimum leaves no room to give: on a machine whose rest and
    // minimum cache barely fit, the block is left out and the plan is the model's own.
    let tight = run("discrete-16g-32g", &flash(Quant::Q2), &req).unwrap();
    let p = run("discrete-16g-32g", &inv, &req).unwrap();
    assert_eq!(p.mode, WeightsMode::Streamed);
    let m = p.mtp.as_ref().unwrap();
    if !m.resident {
        assert_eq!(p.buffers, tight.buffers);
        assert!(m.reason.contains("does not fit"), "{}", m.reason);
    }
}
