//! A fault-injecting allocator drives the executor: fallbacks, admission, rollback.

mod common;

use common::*;
use ds4_placement::{
    execute, plan, AllocError, Allocator, ManagedAdvice, MemKind, Plan, Policy, WeightsMode,
};

/// Per-kind byte capacities (None = unsupported), plus "fail the Nth allocation".
struct Fake {
    cap: Vec<(MemKind, Option<u64>)>,
    used: Vec<(MemKind, u64)>,
    live: Vec<(u32, MemKind, u64)>,
    next: u32,
    fail_call: Option<u32>,
    calls: u32,
    deny_admission: Vec<MemKind>,
    advice_seen: Vec<ManagedAdvice>,
}

impl Fake {
    fn new(cap: &[(MemKind, Option<u64>)]) -> Self {
        Fake {
            cap: cap.to_vec(),
            used: Vec::new(),
            live: Vec::new(),
            next: 0,
            fail_call: None,
            calls: 0,
            deny_admission: Vec::new(),
            advice_seen: Vec::new(),
        }
    }
    fn used(&self, k: MemKind) -> u64 {
        self.live.iter().filter(|l| l.1 == k).map(|l| l.2).sum()
    }
}

impl Allocator for Fake {
    type Handle = u32;
    fn allocate(
        &mut self,
        kind: MemKind,
        bytes: u64,
        advice: ManagedAdvice,
    ) -> Result<u32, AllocError> {
        self.calls += 1;
        if Some(self.calls) == self.fail_call {
            return Err(AllocError("injected failure".into()));
        }
        let cap = self.cap.iter().find(|c| c.0 == kind).and_then(|c| c.1);
        let Some(cap) = cap else {
            return Err(AllocError(format!("{kind} unsupported")));
        };
        if self.used(kind) + bytes > cap {
            return Err(AllocError("out of memory".into()));
        }
        self.advice_seen.push(advice);
        self.next += 1;
        self.live.push((self.next, kind, bytes));
        self.used.push((kind, bytes));
        Ok(self.next)
    }
    fn free(&mut self, h: u32) {
        let i = self
            .live
            .iter()
            .position(|l| l.0 == h)
            .expect("double free");
        self.live.remove(i);
    }
    fn admit(&mut self, kind: MemKind, _bytes: u64) -> Result<(), AllocError> {
        if self.deny_admission.contains(&kind) {
            Err(AllocError("usable host memory too low".into()))
        } else {
            Ok(())
        }
    }
}

fn stock_q2() -> Plan {
    let m = machine("strix-halo-stock");
    let p = plan(
        &m.host,
        &m.device,
        &flash(Quant::Q2),
        &request(4096, scratch_for(4096)),
        &Policy::default(),
    )
    .unwrap();
    assert_eq!(p.mode, WeightsMode::PinnedHost);
    p
}

#[test]
fn plan_holds_when_memory_is_there() {
    let p = stock_q2();
    let mut a = Fake::new(&[
        (MemKind::PinnedHost, Some(200 * GIB)),
        (MemKind::Managed, Some(200 * GIB)),
        (MemKind::Device, Some(60 * GIB)),
    ]);
    let got = execute(&p, &mut a).unwrap();
    assert_eq!(got.arenas.len(), p.arenas.len());
    assert_eq!(got.buffers.len(), p.buffers.len());
    assert_eq!(got.actual.fallbacks().count(), 0);
    assert_eq!(got.actual.bytes_in(MemKind::PinnedHost), p.weights_bytes());
    // Allocation order is plan order: arenas, then buffers.
    let sizes: Vec<u64> = a.used.iter().map(|u| u.1).collect();
    let want: Vec<u64> = p
        .arenas
        .iter()
        .map(|x| x.bytes)
        .chain(p.buffers.iter().map(|b| b.bytes))
        .collect();
    assert_eq!(sizes, want);
    assert!(a.advice_seen.iter().all(|x| *x == ManagedAdvice::None));
}

#[test]
fn pinned_failure_falls_to_managed_with_advice() {
    let p = stock_q2();
    // Pinned host runs out after 40 GiB: the rest goes managed (coarse-grain advice).
    let mut a = Fake::new(&[
        (MemKind::PinnedHost, Some(40 * GIB)),
        (MemKind::Managed, Some(200 * GIB)),
        (MemKind::Device, Some(60 * GIB)),
    ]);
    let got = execute(&p, &mut a).unwrap();
    let pinned = got.actual.bytes_in(MemKind::PinnedHost);
    assert!(pinned <= 40 * GIB && pinned > 38 * GIB);
    assert_eq!(
        got.actual.bytes_in(MemKind::Managed),
        p.weights_bytes() - pinned
    );
    let fb: Vec<_> = got.actual.fallbacks().collect();
    assert!(!fb.is_empty());
    assert!(fb
        .iter()
        .all(|e| e.used == MemKind::Managed && e.steps[0].error == "out of memory"));
    assert!(a.advice_seen.contains(&ManagedAdvice::CoarseGrain));
    let text = got.actual.render_text(&p);
    assert!(
        text.contains("pinned host failed (out of memory) -> managed"),
        "{text}"
    );
}

#[test]
fn managed_unsupported_falls_to_device() {
    let p = stock_q2();
    let mut a = Fake::new(&[
        (MemKind::PinnedHost, Some(30 * GIB)),
        (MemKind::Managed, None),
        (MemKind::Device, Some(60 * GIB)),
    ]);
    let got = execute(&p, &mut a).unwrap();
    let e = got.actual.fallbacks().next().unwrap();
    assert_eq!(e.used, MemKind::Device);
    assert_eq!(e.steps.len(), 2);
    assert_eq!(e.steps[1].error, "managed unsupported");
    assert_eq!(
        got.actual.bytes_in(MemKind::Device),
        p.weights_bytes() - got.actual.bytes_in(MemKind::PinnedHost)
            + p.buffers.iter().map(|b| b.bytes).sum::<u64>()
    );
}

#[test]
fn admission_is_rechecked_before_a_fallback() {
    let p = stock_q2();
    let mut a = Fake::new(&[
        (MemKind::PinnedHost, Some(30 * GIB)),
        (MemKind::Managed, Some(200 * GIB)),
        (MemKind::Device, Some(200 * GIB)),
    ]);
    a.deny_admission = vec![MemKind::Managed];
    let got = execute(&p, &mut a).unwrap();
    let e = got.actual.fallbacks().next().unwrap();
    assert_eq!(e.used, MemKind::Device);
    assert!(e.steps[1].error.starts_with("not admitted"));
    assert_eq!(got.actual.bytes_in(MemKind::Managed), 0);
}

#[test]
fn failure_mid_load_frees_everything_and_refuses_clearly() {
    let p = stock_q2();
    // Device pool too small for the rest, managed gone: the load cannot finish.
    let mut a = Fake::new(&[
        (MemKind::PinnedHost, Some(30 * GIB)),
        (MemKind::Managed, None),
        (MemKind::Device, Some(20 * GIB)),
    ]);
    let err = execute(&p, &mut a).err().unwrap();
    assert!(a.live.is_empty(), "rollback frees every allocation");
    assert!(err.freed > 0 && err.freed_bytes > 49 * GIB);
    assert_eq!(err.steps.len(), 3);
    let text = err.to_string();
    assert!(text.starts_with("load refused: allocating arena"), "{text}");
    assert!(
        text.contains(
            "pinned host: out of memory; managed: managed unsupported; device: out of memory"
        ),
        "{text}"
    );
    // A forced plan has no chain: one injected failure ends the load.
    let m = machine("h200-128g");
    let p = plan(
        &m.host,
        &m.device,
        &flash(Quant::Q2),
        &request(4096, GIB),
        &Policy::default(),
    )
    .unwrap();
    let mut a = Fake::new(&[(MemKind::Device, Some(200 * GIB))]);
    a.fail_call = Some(50);
    let err = execute(&p, &mut a).err().unwrap();
    assert_eq!((err.freed, err.steps.len()), (49, 1));
    assert!(a.live.is_empty());
}
