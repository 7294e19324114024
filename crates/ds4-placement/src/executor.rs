//! Runs a [`Plan`] through a backend's allocator, in plan order.
//!
//! The GPU and CPU backends implement [`Allocator`]; this module owns the rules that
//! must be identical everywhere: allocate exactly what the plan lists, in its order; on a
//! failed allocation move down that entry's fallback chain, re-checking admission first
//! (live numbers shrink as pinned memory is taken); if an entry runs out of kinds, free
//! everything already allocated and return a [`LoadFailure`] that says what failed.
//! What was actually used is returned as an [`Actual`] for the report's second column.

use std::fmt;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::bytes::{fmt_bytes, fmt_gib};
use crate::plan::{ManagedAdvice, MemKind, Plan};

/// A failed runtime allocation or admission check.
#[derive(Debug, Clone, PartialEq, Eq, Error, Serialize, Deserialize)]
#[error("{0}")]
pub struct AllocError(pub String);

/// A backend's allocator. Implementations do the FFI; they never decide placement.
pub trait Allocator {
    type Handle;
    /// Allocates `bytes` of `kind`, applying `advice` best-effort.
    fn allocate(
        &mut self,
        kind: MemKind,
        bytes: u64,
        advice: ManagedAdvice,
    ) -> Result<Self::Handle, AllocError>;
    /// Frees an allocation made by [`Self::allocate`].
    fn free(&mut self, handle: Self::Handle);
    /// Re-checks admission with live numbers before a fallback attempt (ds4 re-reads
    /// meminfo on each call). The default admits everything.
    fn admit(&mut self, kind: MemKind, bytes: u64) -> Result<(), AllocError> {
        let _ = (kind, bytes);
        Ok(())
    }
}

/// Which plan entry an allocation is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "entry", content = "index")]
pub enum Entry {
    Arena(usize),
    Buffer(usize),
}

/// One kind tried and refused for an entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedStep {
    pub kind: MemKind,
    pub error: String,
}

/// What happened to one plan entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActualEntry {
    pub entry: Entry,
    pub name: String,
    pub bytes: u64,
    pub planned: MemKind,
    pub used: MemKind,
    /// Kinds that failed before `used` succeeded (empty: the plan held).
    pub steps: Vec<FailedStep>,
}

/// The actual placement after loading.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Actual {
    pub entries: Vec<ActualEntry>,
}

impl Actual {
    /// Bytes that ended up in `kind`.
    pub fn bytes_in(&self, kind: MemKind) -> u64 {
        self.entries
            .iter()
            .filter(|e| e.used == kind)
            .map(|e| e.bytes)
            .sum()
    }

    /// Entries that took a fallback step.
    pub fn fallbacks(&self) -> impl Iterator<Item = &ActualEntry> {
        self.entries.iter().filter(|e| e.used != e.planned)
    }

    /// Planned vs actual bytes per kind, then each fallback step taken.
    pub fn render_text(&self, plan: &Plan) -> String {
        use std::fmt::Write;
        let mut s = String::from("  memory             planned       actual\n");
        for kind in [
            MemKind::Device,
            MemKind::PinnedHost,
            MemKind::Managed,
            MemKind::HostRegistered,
            MemKind::Pageable,
        ] {
            let planned: u64 = plan
                .arenas
                .iter()
                .filter(|a| a.kind == kind)
                .map(|a| a.bytes)
                .chain(
                    plan.buffers
                        .iter()
                        .filter(|b| b.kind == kind)
                        .map(|b| b.bytes),
                )
                .sum();
            let actual = self.bytes_in(kind);
            if planned > 0 || actual > 0 {
                let _ = writeln!(
                    s,
                    "  {:<16} {:>12} {:>12}",
                    kind.label(),
                    fmt_gib(planned),
                    fmt_gib(actual)
                );
            }
        }
        for e in self.fallbacks() {
            let steps: Vec<String> = e
                .steps
                .iter()
                .map(|f| format!("{} failed ({})", f.kind, f.error))
                .collect();
            let _ = writeln!(
                s,
                "  fallback: {} ({}): {} -> {}",
                e.name,
                fmt_bytes(e.bytes),
                steps.join(", "),
                e.used
            );
        }
        s
    }
}

/// A load that could not complete; everything allocated before it was freed.
#[derive(Debug, Clone, PartialEq, Eq, Error, Serialize, Deserialize)]
pub struct LoadFailure {
    pub entry: Entry,
    pub name: String,
    pub bytes: u64,
    pub steps: Vec<FailedStep>,
    /// Allocations freed during rollback.
    pub freed: usize,
    pub freed_bytes: u64,
}

impl fmt::Display for LoadFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let steps: Vec<String> = self
            .steps
            .iter()
            .map(|s| format!("{}: {}", s.kind, s.error))
            .collect();
        write!(
            f,
            "load refused: allocating {} ({}) failed in every kind its plan allows [{}]; \
             freed the {} allocations ({}) made before it. The machine has less free memory \
             than when the plan was made: free memory, or re-plan with a smaller --ctx or \
             another --weights-mem.",
            self.name,
            fmt_bytes(self.bytes),
            steps.join("; "),
            self.freed,
            fmt_bytes(self.freed_bytes)
        )
    }
}

/// Handles for every plan entry, in plan order, plus what was actually used.
pub struct Allocated<H> {
    /// One handle per arena, indexed like `plan.arenas`.
    pub arenas: Vec<H>,
    /// One handle per buffer, indexed like `plan.buffers`.
    pub buffers: Vec<H>,
    pub actual: Actual,
}

/// Allocates every arena, then every buffer, exactly as planned (see the module docs).
pub fn execute<A: Allocator>(
    plan: &Plan,
    alloc: &mut A,
) -> Result<Allocated<A::Handle>, LoadFailure> {
    let mut done: Vec<(A::Handle, u64)> = Vec::new();
    let mut actual = Actual::default();
    let items = plan
        .arenas
        .iter()
        .enumerate()
        .map(|(i, a)| {
            (
                Entry::Arena(i),
                format!("arena {} ({} tensors)", a.id, a.spans.len()),
                a.kind,
                &a.fallback,
                a.advice,
                a.bytes,
            )
        })
        .chain(plan.buffers.iter().enumerate().map(|(i, b)| {
            (
                Entry::Buffer(i),
                b.name.clone(),
                b.kind,
                &b.fallback,
                ManagedAdvice::None,
                b.bytes,
            )
        }));
    for (entry, name, kind, fallback, advice, bytes) in items {
        let mut steps = Vec::new();
        let mut got = None;
        for (i, &k) in std::iter::once(&kind).chain(fallback.iter()).enumerate() {
            // The planned kind was admitted by the plan; fallbacks are re-checked live.
            if i > 0 {
                if let Err(e) = alloc.admit(k, bytes) {
                    steps.push(FailedStep {
                        kind: k,
                        error: format!("not admitted: {e}"),
                    });
                    continue;
                }
            }
            let adv = if k == MemKind::Managed {
                advice
            } else {
                ManagedAdvice::None
            };
            match alloc.allocate(k, bytes, adv) {
                Ok(h) => {
                    got = Some((h, k));
                    break;
                }
                Err(e) => steps.push(FailedStep {
                    kind: k,
                    error: e.0,
                }),
            }
        }
        match got {
            Some((h, used)) => {
                done.push((h, bytes));
                actual.entries.push(ActualEntry {
                    entry,
                    name,
                    bytes,
                    planned: kind,
                    used,
                    steps,
                });
            }
            None => {
                let freed = done.len();
                let freed_bytes = done.iter().map(|d| d.1).sum();
                while let Some((h, _)) = done.pop() {
                    alloc.free(h);
                }
                return Err(LoadFailure {
                    entry,
                    name,
                    bytes,
                    steps,
                    freed,
                    freed_bytes,
                });
            }
        }
    }
    let n_arenas = plan.arenas.len();
    let mut handles: Vec<A::Handle> = done.into_iter().map(|d| d.0).collect();
    let buffers = handles.split_off(n_arenas);
    Ok(Allocated {
        arenas: handles,
        buffers,
        actual,
    })
}
