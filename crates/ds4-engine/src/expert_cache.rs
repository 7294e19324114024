//! Which (layer, expert) units sit in which slot of a streamed-expert cache, and how a
//! chunk's tokens are split so that each run's experts fit (docs/placement.md §9
//! "Streamed routed experts").
//!
//! Pure bookkeeping: no I/O and no backend here ([`crate::expert_stream`] does the reads
//! and the writes). The policy is least-recently-used over slots: every acquisition of a
//! run stamps its units with the run's tick, and a miss takes the slot with the oldest
//! stamp that is not part of the current run, so the units one `moe` call needs never
//! evict each other.

use std::collections::HashMap;
use std::ops::Range;

/// One routed expert of one layer: the slice of the layer's gate, up and down tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Unit {
    pub layer: u32,
    pub expert: u32,
}

/// Where [`ExpertCache::acquire`] put a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Already resident in this slot.
    Hit(u32),
    /// Not resident: the caller must fill this slot (its previous unit, if any, was evicted).
    Miss { slot: u32, evicted: Option<Unit> },
}

impl Access {
    pub fn slot(self) -> u32 {
        match self {
            Access::Hit(s) | Access::Miss { slot: s, .. } => s,
        }
    }
}

/// Why a set of units cannot be made resident together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    #[error("a run needs {needed} distinct experts but the cache holds {slots} slots")]
    RunTooLarge { needed: usize, slots: usize },
    #[error("expert cache of 0 slots")]
    Empty,
}

/// An LRU map from units to a fixed number of slots.
#[derive(Debug, Clone)]
pub struct ExpertCache {
    /// `slot → (unit, last tick)`; `None` while never filled.
    slots: Vec<Option<(Unit, u64)>>,
    where_is: HashMap<Unit, u32>,
    /// Stamp of the current run (starts at 1: 0 is never current).
    tick: u64,
}

impl ExpertCache {
    pub fn new(slots: usize) -> Result<ExpertCache, CacheError> {
        if slots == 0 {
            return Err(CacheError::Empty);
        }
        Ok(ExpertCache {
            slots: vec![None; slots],
            where_is: HashMap::with_capacity(slots),
            tick: 0,
        })
    }

    pub fn n_slots(&self) -> usize {
        self.slots.len()
    }

    /// The slot holding `u`, if resident.
    pub fn slot_of(&self, u: Unit) -> Option<u32> {
        self.where_is.get(&u).copied()
    }

    /// Makes every unit of `units` (duplicates allowed) resident at once and returns one
    /// access per entry of `units`, in order (a repeated unit gets `Hit` after its first
    /// entry). Fails without changing anything when the distinct units exceed the slots.
    pub fn acquire(&mut self, units: &[Unit]) -> Result<Vec<Access>, CacheError> {
        let mut distinct: Vec<Unit> = units.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() > self.slots.len() {
            return Err(CacheError::RunTooLarge {
                needed: distinct.len(),
                slots: self.slots.len(),
            });
        }
        self.tick += 1;
        let now = self.tick;
        // Stamp the hits first, so no miss of this run can evict them.
        for u in &distinct {
            if let Some(&s) = self.where_is.get(u) {
                if let Some(e) = self.slots[s as usize].as_mut() {
                    e.1 = now;
                }
            }
        }
        let mut out = Vec::with_capacity(units.len());
        for &u in units {
            if let Some(&s) = self.where_is.get(&u) {
                out.push(Access::Hit(s));
                continue;
            }
            let slot = self.victim(now);
            let evicted = self.slots[slot].map(|(old, _)| old);
            if let Some(old) = evicted {
                self.where_is.remove(&old);
            }
            self.slots[slot] = Some((u, now));
            self.where_is.insert(u, slot as u32);
            out.push(Access::Miss {
                slot: slot as u32,
                evicted,
            });
        }
        Ok(out)
    }

    /// A never-filled slot, else the least recently used one not stamped `now`. The
    /// caller checked that the run's distinct units fit, so one exists.
    fn victim(&self, now: u64) -> usize {
        let mut best: Option<(u64, usize)> = None;
        for (i, s) in self.slots.iter().enumerate() {
            match s {
                None => return i,
                Some((_, t)) if *t < now => {
                    if best.is_none_or(|(bt, _)| *t < bt) {
                        best = Some((*t, i));
                    }
                }
                Some(_) => {}
            }
        }
        best.map(|(_, i)| i).expect("distinct units <= slots")
    }

    /// Forgets every unit (e.g. after a failed fill left a slot's contents unknown).
    pub fn clear(&mut self) {
        self.slots.iter_mut().for_each(|s| *s = None);
        self.where_is.clear();
    }

    /// Forgets one unit (its slot becomes free).
    pub fn forget(&mut self, u: Unit) {
        if let Some(s) = self.where_is.remove(&u) {
            self.slots[s as usize] = None;
        }
    }
}

/// Splits `n_tok` tokens whose expert ids are `ids` (`[n_tok, k]`) into consecutive runs
/// whose distinct experts fit in `slots`, each run at least `min_run` tokens long (the
/// last one too, when `n_tok >= min_run`).
///
/// `min_run` exists because a backend may compute a one-token `moe` differently from a
/// longer one (int8 activations apply to calls of at most the decode rows: see
/// `Backend::set_activation_q8`), so a prefill must never be cut into one-token runs.
/// Greedy: each run takes tokens while they fit; a short last run takes tokens from the
/// run before it. With `slots >= (min_run + 1) · k` that always succeeds.
pub fn split_runs(
    ids: &[i32],
    k: usize,
    slots: usize,
    min_run: usize,
) -> Result<Vec<Range<usize>>, CacheError> {
    let n_tok = ids.len().checked_div(k).unwrap_or(0);
    let distinct = |r: Range<usize>| -> usize {
        let mut v: Vec<i32> = ids[r.start * k..r.end * k].to_vec();
        v.sort_unstable();
        v.dedup();
        v.len()
    };
    let mut runs: Vec<Range<usize>> = Vec::new();
    let mut start = 0;
    while start < n_tok {
        let mut seen: Vec<i32> = Vec::new();
        let mut end = start;
        while end < n_tok {
            let mut next = seen.clone();
            next.extend_from_slice(&ids[end * k..(end + 1) * k]);
            next.sort_unstable();
            next.dedup();
            if next.len() > slots {
                break;
            }
            seen = next;
            end += 1;
        }
        if end == start {
            return Err(CacheError::RunTooLarge {
                needed: distinct(start..start + 1),
                slots,
            });
        }
        runs.push(start..end);
        start = end;
    }
    if let [.., prev, last] = runs.as_mut_slice() {
        let short = min_run.saturating_sub(last.len());
        if short > 0 {
            let cut = prev.end - short;
            if cut < prev.start + min_run || distinct(cut..last.end) > slots {
                return Err(CacheError::RunTooLarge {
                    needed: distinct(cut..last.end),
                    slots,
                });
            }
            prev.end = cut;
            last.start = cut;
        }
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u(layer: u32, expert: u32) -> Unit {
        Unit { layer, expert }
    }

    #[test]
    fn lru_evicts_the_oldest_unit_outside_the_run() {
        let mut c = ExpertCache::new(3).unwrap();
        let a = c.acquire(&[u(0, 1), u(0, 2)]).unwrap();
        assert!(matches!(a[0], Access::Miss { evicted: None, .. }));
        assert!(matches!(a[1], Access::Miss { evicted: None, .. }));
        c.acquire(&[u(0, 3)]).unwrap();
        // (0,1) is used again, so (0,2) is now the oldest.
        assert!(matches!(c.acquire(&[u(0, 1)]).unwrap()[0], Access::Hit(_)));
        let r = c.acquire(&[u(1, 1)]).unwrap();
        assert_eq!(
            r[0],
            Access::Miss {
                slot: a[1].slot(),
                evicted: Some(u(0, 2))
            }
        );
        assert_eq!(c.slot_of(u(0, 2)), None);
        assert_eq!(c.slot_of(u(1, 1)), Some(a[1].slot()));
    }

    #[test]
    fn a_run_never_evicts_its_own_units() {
        let mut c = ExpertCache::new(2).unwrap();
        c.acquire(&[u(0, 0), u(0, 1)]).unwrap();
        // (0,1) is a hit of this run: the miss must take (0,0)'s slot, not (0,1)'s.
        let r = c.acquire(&[u(0, 5), u(0, 1)]).unwrap();
        assert_eq!(r[0].slot(), c.slot_of(u(0, 5)).unwrap());
        assert!(matches!(
            r[0],
            Access::Miss {
                evicted: Some(Unit {
                    layer: 0,
                    expert: 0
                }),
                ..
            }
        ));
        assert!(matches!(r[1], Access::Hit(_)));
        assert_ne!(r[0].slot(), r[1].slot());
        // Duplicates: one slot, the repeat is a hit.
        let d = c.acquire(&[u(2, 2), u(2, 2)]).unwrap();
        assert!(matches!(d[0], Access::Miss { .. }));
        assert_eq!(d[1], Access::Hit(d[0].slot()));
        assert_eq!(
            c.acquire(&[u(3, 0), u(3, 1), u(3, 2)]),
            Err(CacheError::RunTooLarge {
                needed: 3,
                slots: 2
            })
        );
        assert_eq!(ExpertCache::new(0).unwrap_err(), CacheError::Empty);
    }

    #[test]
    fn runs_fit_the_slots_and_are_never_shorter_than_asked() {
        // k = 2, tokens with mostly distinct experts.
        let ids: Vec<i32> = (0..7).flat_map(|t| [2 * t, 2 * t + 1]).collect();
        let runs = split_runs(&ids, 2, 6, 2).unwrap();
        assert_eq!(runs, vec![0..3, 3..5, 5..7]);
        // Greedy would leave one token last: it borrows from the run before.
        let ids: Vec<i32> = (0..4).flat_map(|t| [2 * t, 2 * t + 1]).collect();
        assert_eq!(split_runs(&ids, 2, 6, 2).unwrap(), vec![0..2, 2..4]);
        assert_eq!(split_runs(&ids, 2, 6, 1).unwrap(), vec![0..3, 3..4]);
        // Repeated experts share slots.
        let ids = vec![1, 2, 1, 2, 2, 1, 3, 1];
        assert_eq!(split_runs(&ids, 2, 3, 2).unwrap(), vec![0..4]);
        // Every run's distinct experts fit; the runs cover every token once.
        let ids: Vec<i32> = (0..50).map(|i| i * 7919 % 13).collect();
        for slots in [6, 7, 9, 13] {
            let runs = split_runs(&ids, 2, slots, 2).unwrap();
            assert_eq!(runs.first().unwrap().start, 0);
            assert_eq!(runs.last().unwrap().end, 25);
            for w in runs.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            for r in &runs {
                assert!(r.len() >= 2, "{r:?}");
                let mut v = ids[r.start * 2..r.end * 2].to_vec();
                v.sort_unstable();
                v.dedup();
                assert!(v.len() <= slots);
            }
        }
        assert!(split_runs(&[1, 2, 3], 3, 2, 1).is_err());
    }
}
