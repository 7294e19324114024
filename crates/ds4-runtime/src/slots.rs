//! Several conversations on one engine: the weights are loaded once and each slot owns a
//! KV state and the logits after it. A scheduler (the server's `--parallel N`) prefills one
//! slot at a time and decodes every generating slot in one batched forward step
//! ([`Slots::decode`] over [`Engine::eval_batch`]), so N streams cost one weight read per
//! token instead of N.
//!
//! Each slot offers the moves [`crate::Conversation`] offers on its one state (prefill,
//! snapshot, restore, checkpoint, resume) with the same meaning, so the payloads and
//! snapshots of either restore into the other.

use ds4_engine::sampler::LogitBand;
use ds4_engine::{BatchRow, Engine, EngineError, KvState, Logits, Snapshot};
use thiserror::Error;

use crate::checkpoint::{self, Format};
use crate::driver::DriverError;
use crate::step::StepLogits;

/// Why the slots could not be created.
#[derive(Debug, Error)]
pub enum SlotsError {
    #[error("at least one slot is needed")]
    Zero,
    /// The backend could not hold another KV state (memory): fewer slots or a smaller
    /// context would fit.
    #[error("cannot allocate the KV state of slot {slot} of {slots} (context {ctx}): {source}")]
    Alloc {
        slot: usize,
        slots: usize,
        ctx: usize,
        #[source]
        source: EngineError,
    },
}

/// What a slot knows of the logits after its state.
enum After {
    Unknown,
    Row(Vec<f32>),
    /// The band of the row near its maximum; the row itself is in the engine's scratch
    /// (only ever for the slots [`Slots::banded`] names).
    Band(LogitBand),
}

struct Slot {
    state: KvState,
    after: After,
    /// A row buffer kept while the slot holds a band, so the next fetch does not allocate.
    spare: Vec<f32>,
    /// Band width of this slot's decode steps ([`Slots::set_band`]).
    band_span: Option<f32>,
}

impl Slot {
    /// Takes the row buffer out (the stale row or the spare), leaving nothing known.
    fn take_buf(&mut self) -> Vec<f32> {
        match std::mem::replace(&mut self.after, After::Unknown) {
            After::Row(v) => v,
            _ => std::mem::take(&mut self.spare),
        }
    }
}

/// One engine and its slots. Slot indices are `0..len()`; an index out of range is a
/// caller bug and panics, as a slice index does.
pub struct Slots {
    engine: Engine,
    slots: Vec<Slot>,
    /// The slots whose logits rows are rows of the engine's scratch, (slot, row) (each
    /// holds [`After::Band`]). Every other engine call fetches those rows first
    /// ([`Slots::settle`]).
    banded: Vec<(usize, usize)>,
    /// Staging for [`Slots::fetch_rows`] (kept: several MB each step otherwise).
    rows_buf: Vec<f32>,
}

impl std::fmt::Debug for Slots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slots")
            .field("engine", &self.engine)
            .field("slots", &self.slots.len())
            .finish()
    }
}

impl Slots {
    /// `n` empty slots of `engine.config().ctx` tokens each, allocated now (a slot that
    /// does not fit is reported with its number; the ones before it are released).
    pub fn new(mut engine: Engine, n: usize) -> Result<Slots, SlotsError> {
        if n == 0 {
            return Err(SlotsError::Zero);
        }
        let ctx = engine.config().ctx;
        let mut slots = Vec::with_capacity(n);
        for i in 0..n {
            match engine.new_state() {
                Ok(state) => slots.push(Slot {
                    state,
                    after: After::Unknown,
                    spare: Vec::new(),
                    band_span: None,
                }),
                Err(source) => {
                    for s in slots {
                        engine.free_state(s.state);
                    }
                    return Err(SlotsError::Alloc {
                        slot: i + 1,
                        slots: n,
                        ctx,
                        source,
                    });
                }
            }
        }
        Ok(Slots {
            engine,
            slots,
            banded: Vec::new(),
            rows_buf: Vec::new(),
        })
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Always false: there is at least one slot.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn ctx(&self) -> usize {
        self.engine.config().ctx
    }

    /// KV bytes one slot holds at the engine's context (as the placement planner counts
    /// them, docs/forward.md §8).
    pub fn kv_bytes_per_slot(&self) -> u64 {
        let hp = self.engine.hparams();
        ds4_model::kv::kv_bytes_per_token_x(hp, self.ctx() as u64)
            + ds4_model::kv::kv_fixed_bytes(hp)
    }

    /// Most slots one batched decode step takes ([`Slots::decode`] splits larger sets).
    pub fn batch_max(&self) -> usize {
        self.engine.config().prefill_chunk.max(1)
    }

    /// Tokens held by slot `i`.
    pub fn live(&self, i: usize) -> &[u32] {
        self.slots[i].state.tokens()
    }

    pub fn pos(&self, i: usize) -> usize {
        self.slots[i].state.pos()
    }

    /// Whether the logits after slot `i`'s tokens are known (on the host or, for the last
    /// lone-decoded slot, as a band with the row in the engine).
    pub fn has_logits(&self, i: usize) -> bool {
        !matches!(self.slots[i].after, After::Unknown)
    }

    /// The logits row after slot `i`'s tokens, when known (fetched from the engine when the
    /// slot holds a band).
    pub fn logits(&mut self, i: usize) -> Result<Option<&[f32]>, DriverError> {
        self.fetch(i)?;
        Ok(match &self.slots[i].after {
            After::Row(v) => Some(v),
            _ => None,
        })
    }

    /// Slot `i`'s distribution for a generation step ([`crate::GenState::pick`]; the pick
    /// may edit the row in place), `None` when its logits are unknown.
    pub fn step(&mut self, i: usize) -> Option<SlotStep<'_>> {
        self.has_logits(i).then_some(SlotStep { slots: self, i })
    }

    /// The distributions of slots `ids` for one generation step, each apart from the
    /// engine and the other slots, so several picks may run at once (a batched step's
    /// draws: a full-row draw — top-p, top-k, a band the capacity cut short — scans the
    /// 129,280 logits, and eight of them one after another held the device idle for
    /// milliseconds each step). The rows those draws are known to need (a slot without a
    /// band, a band cut short) are fetched first; a pick that still wants a row gets
    /// [`DriverError::RowOnDevice`] before drawing anything and is picked again through
    /// [`Slots::step`]. `None` for a slot whose logits are unknown. Naming a slot twice or
    /// one that does not exist is an error.
    pub fn host_steps(&mut self, ids: &[usize]) -> Result<Vec<Option<HostStep<'_>>>, DriverError> {
        named(&mut self.slots, ids, "a step's picks")?;
        let short: Vec<(usize, usize)> = self
            .banded
            .iter()
            .copied()
            .filter(|&(i, _)| ids.contains(&i))
            .filter(|&(i, _)| matches!(&self.slots[i].after, After::Band(b) if !b.is_complete()))
            .collect();
        self.fetch_rows(&short)?;
        let named = named(&mut self.slots, ids, "a step's picks")?;
        Ok(named
            .into_iter()
            .map(|s| {
                (!matches!(s.after, After::Unknown)).then_some(HostStep {
                    after: &mut s.after,
                })
            })
            .collect())
    }

    /// Decode steps of slot `i`, lone or batched, leave the band of width `span` near the
    /// row's maximum instead of fetching the row (`None`: the row). A generation sets it
    /// from its sampler ([`ds4_engine::SamplerConfig::band_span`]).
    pub fn set_band(&mut self, i: usize, span: Option<f32>) {
        self.slots[i].band_span = span;
    }

    /// Fetches every banded slot's row from the engine (before anything else uses the
    /// engine). On failure the failing slot's logits are forgotten and the slots not yet
    /// fetched stay banded (the engine was not used, so their rows are intact).
    fn settle(&mut self) -> Result<(), DriverError> {
        while let Some(&(i, _)) = self.banded.first() {
            self.fetch(i)?;
        }
        Ok(())
    }

    /// Fetches slot `i`'s row if it is banded (the others stay banded). On failure its
    /// logits are forgotten.
    fn fetch(&mut self, i: usize) -> Result<(), DriverError> {
        let Some(at) = self.banded.iter().position(|b| b.0 == i) else {
            return Ok(());
        };
        let (_, row) = self.banded.remove(at);
        let s = &mut self.slots[i];
        let mut buf = s.take_buf();
        if let Err(e) = self.engine.batch_row_into(row, &mut buf) {
            s.spare = buf;
            return Err(e.into());
        }
        s.after = After::Row(buf);
        Ok(())
    }

    /// Fetches the rows of the banded slots `wanted` ((slot, row) pairs of
    /// [`Slots::banded`]) in one read-back of the rows they span; one row is a plain
    /// [`Slots::fetch`]. On failure the slots stay banded (their rows are intact).
    fn fetch_rows(&mut self, wanted: &[(usize, usize)]) -> Result<(), DriverError> {
        let (Some(lo), Some(hi)) = (
            wanted.iter().map(|w| w.1).min(),
            wanted.iter().map(|w| w.1).max(),
        ) else {
            return Ok(());
        };
        if wanted.len() == 1 {
            return self.fetch(wanted[0].0);
        }
        let mut all = std::mem::take(&mut self.rows_buf);
        let r = self.engine.batch_rows_into(lo, hi - lo + 1, &mut all);
        if let Err(e) = r {
            self.rows_buf = all;
            return Err(e.into());
        }
        let v = all.len() / (hi - lo + 1);
        for &(i, row) in wanted {
            self.banded.retain(|b| b.0 != i);
            let s = &mut self.slots[i];
            let mut buf = s.take_buf();
            buf.clear();
            buf.extend_from_slice(&all[(row - lo) * v..(row - lo + 1) * v]);
            s.after = After::Row(buf);
        }
        self.rows_buf = all;
        Ok(())
    }

    /// Forgets slot `i`'s logits (keeping its buffer).
    fn forget(&mut self, i: usize) {
        self.banded.retain(|b| b.0 != i);
        let s = &mut self.slots[i];
        s.spare = s.take_buf();
    }

    /// Empties slot `i`.
    pub fn reset(&mut self, i: usize) -> Result<(), DriverError> {
        self.forget(i);
        self.settle()?;
        self.engine.reset_state(&mut self.slots[i].state)?;
        Ok(())
    }

    /// Evaluates `tokens` after slot `i`'s state and keeps the logits. On an engine error
    /// the state is partial and the logits are forgotten.
    pub fn prefill(&mut self, i: usize, tokens: &[u32]) -> Result<(), DriverError> {
        self.forget(i);
        self.settle()?;
        let s = &mut self.slots[i];
        let mut buf = s.take_buf();
        let r = self
            .engine
            .eval_into(&mut s.state, tokens, Logits::Last, None, &mut buf);
        s.after = if r.is_ok() {
            After::Row(buf)
        } else {
            s.spare = buf;
            After::Unknown
        };
        Ok(r?)
    }

    /// The fewest tokens a piece must have to join [`Slots::prefill_joint`]; `None`: the
    /// engine runs pieces one at a time ([`Engine::joint_min_rows`]).
    pub fn joint_min_rows(&self) -> Option<usize> {
        self.engine.joint_min_rows()
    }

    /// Evaluates several slots' prompt pieces in one forward pass ([`Engine::eval_joint`]:
    /// each piece's dense ops alone, the routed experts once for all), so each slot ends
    /// as [`Slots::prefill`] of its piece alone leaves it, logits row included. One piece
    /// is a plain prefill. On an engine error the named slots' states are unchanged or
    /// partial and their logits are forgotten.
    pub fn prefill_joint(&mut self, pieces: &[(usize, &[u32])]) -> Result<(), DriverError> {
        if let [(i, tokens)] = pieces {
            return self.prefill(*i, tokens);
        }
        for &(i, _) in pieces {
            if i < self.slots.len() {
                self.forget(i);
            }
        }
        self.settle()?;
        let ids: Vec<usize> = pieces.iter().map(|&(i, _)| i).collect();
        let named = named(&mut self.slots, &ids, "a joint prefill")?;
        let mut states: Vec<&mut KvState> = named.into_iter().map(|s| &mut s.state).collect();
        let tokens: Vec<&[u32]> = pieces.iter().map(|&(_, t)| t).collect();
        self.engine.eval_joint(&mut states, &tokens)?;
        drop(states);
        for (j, &i) in ids.iter().enumerate() {
            let s = &mut self.slots[i];
            let mut buf = s.take_buf();
            match self.engine.batch_row_into(j, &mut buf) {
                Ok(()) => s.after = After::Row(buf),
                Err(e) => {
                    s.spare = buf;
                    return Err(e.into());
                }
            }
        }
        Ok(())
    }

    pub fn snapshot(&mut self, i: usize) -> Result<Snapshot, DriverError> {
        self.snapshot_into(i, Vec::new())
    }

    /// [`Slots::snapshot`] written into `buf`'s allocation ([`Engine::snapshot_into`]).
    pub fn snapshot_into(&mut self, i: usize, buf: Vec<u8>) -> Result<Snapshot, DriverError> {
        self.settle()?;
        Ok(self.engine.snapshot_into(&self.slots[i].state, buf)?)
    }

    /// The bytes [`Slots::snapshot`] of slot `i` would hold now ([`Engine::snapshot_len`]).
    pub fn snapshot_len(&self, i: usize) -> Result<usize, DriverError> {
        Ok(self.engine.snapshot_len(&self.slots[i].state)?)
    }

    /// Replaces slot `i`'s state with a snapshot; `logits` are the ones after it, if known.
    pub fn restore(
        &mut self,
        i: usize,
        snap: &Snapshot,
        logits: Option<Vec<f32>>,
    ) -> Result<(), DriverError> {
        self.forget(i);
        self.settle()?;
        let s = &mut self.slots[i];
        self.engine.restore(&mut s.state, snap)?;
        if let Some(l) = logits {
            s.after = After::Row(l);
        }
        Ok(())
    }

    /// Slot `i` as a checkpoint payload (as [`crate::Conversation::checkpoint`]).
    pub fn checkpoint(&mut self, i: usize) -> Result<Vec<u8>, DriverError> {
        let snap = self.snapshot(i)?;
        Ok(checkpoint::encode(self.logits(i)?, snap.as_bytes()))
    }

    /// Restores a checkpoint payload into slot `i`, whose state must then hold exactly
    /// `tokens` (as [`crate::Conversation::resume`]). On any failure the slot is empty.
    pub fn resume(
        &mut self,
        i: usize,
        payload: &[u8],
        tokens: &[u32],
    ) -> Result<Format, DriverError> {
        let n_vocab = self.engine.hparams().n_vocab;
        let resumed = checkpoint::decode(payload, n_vocab)
            .map_err(DriverError::from)
            .and_then(|c| {
                self.restore(i, &Snapshot::from_bytes(c.snapshot), c.logits)?;
                if self.live(i) != tokens {
                    return Err(DriverError::Inconsistent);
                }
                Ok(c.format)
            });
        if resumed.is_err() {
            let _ = self.reset(i);
        }
        resumed
    }

    /// One decode step for several slots: `feeds[k] = (slot, token)` appends `token` to
    /// `slot` and keeps the logits after it. The slots must be distinct. One slot runs the
    /// plain decode (leaving a band when [`Slots::set_band`] asked for one); more run
    /// batched forward steps of at most [`Slots::batch_max`] slots, whose rows equal the
    /// plain decode's ([`Engine::eval_batch`]). On an engine error the logits of every slot
    /// of the failed step are forgotten (their states may be partial).
    pub fn decode(&mut self, feeds: &[(usize, u32)]) -> Result<(), DriverError> {
        for &(i, _) in feeds {
            if i < self.slots.len() {
                self.forget(i);
            }
        }
        self.settle()?;
        if let [(i, tok)] = feeds {
            let s = &mut self.slots[*i];
            if let Some(span) = s.band_span {
                let band = self.engine.eval_band(&mut s.state, &[*tok], span, None)?;
                s.after = After::Band(band);
                self.banded.push((*i, 0));
                return Ok(());
            }
            let mut buf = s.take_buf();
            let r = self
                .engine
                .eval_into(&mut s.state, &[*tok], Logits::Last, None, &mut buf);
            if r.is_ok() {
                s.after = After::Row(buf);
            } else {
                s.spare = buf;
            }
            return Ok(r?);
        }
        for group in feeds.chunks(self.batch_max()) {
            // A previous group's banded rows are overwritten by this group's step.
            self.settle()?;
            let ids: Vec<usize> = group.iter().map(|&(i, _)| i).collect();
            let named = named(&mut self.slots, &ids, "a batched decode step")?;
            let spans: Vec<Option<f32>> = named.iter().map(|s| s.band_span).collect();
            let mut states: Vec<&mut KvState> = named.into_iter().map(|s| &mut s.state).collect();
            let tokens: Vec<u32> = group.iter().map(|&(_, t)| t).collect();
            let rows = self.engine.eval_batch_bands(&mut states, &tokens, &spans)?;
            drop(states);
            for (j, (&(i, _), row)) in group.iter().zip(rows).enumerate() {
                let s = &mut self.slots[i];
                match row {
                    BatchRow::Band(band) => {
                        s.after = After::Band(band);
                        self.banded.push((i, j));
                    }
                    BatchRow::Row(v) => s.after = After::Row(v),
                }
            }
        }
        Ok(())
    }
}

impl Slots {
    /// Whether the backend can verify drafts bit for bit ([`Engine::can_verify`]).
    pub fn can_verify(&mut self) -> bool {
        self.engine.can_verify()
    }

    /// Slot `i`'s state on the engine, for a drafting step ([`crate::draft_step`]). Its
    /// logits are forgotten (the step is about to feed it) and every banded slot's row is
    /// fetched first (a verify pass overwrites the engine's scratch).
    pub fn draft_target(&mut self, i: usize) -> Result<SlotTarget<'_>, DriverError> {
        self.forget(i);
        self.settle()?;
        Ok(SlotTarget {
            engine: &mut self.engine,
            state: &mut self.slots[i].state,
        })
    }

    /// Sets the logits after slot `i`'s state to `row` (after a drafting step: the verify
    /// row of the state's last token, [`crate::DraftScratch::row`]).
    pub fn set_logits(&mut self, i: usize, row: &[f32]) {
        self.forget(i);
        let s = &mut self.slots[i];
        let mut buf = s.take_buf();
        buf.clear();
        buf.extend_from_slice(row);
        s.after = After::Row(buf);
    }
}

/// One slot's state on the engine ([`Slots::draft_target`]).
pub struct SlotTarget<'a> {
    engine: &'a mut Engine,
    state: &'a mut KvState,
}

impl crate::DraftTarget for SlotTarget<'_> {
    fn tokens(&self) -> &[u32] {
        self.state.tokens()
    }
    fn engine(&self) -> &Engine {
        self.engine
    }
    fn mtp_draft(
        &mut self,
        next: u32,
        k: usize,
        pick: &mut dyn FnMut(&[f32]) -> Option<u32>,
    ) -> Result<Vec<u32>, EngineError> {
        self.engine.mtp_draft(self.state, next, k, pick)
    }
    fn verify(
        &mut self,
        span: &[u32],
        rows: &mut Vec<f32>,
    ) -> Result<ds4_engine::Verify, EngineError> {
        self.engine.eval_verify(self.state, span, rows)
    }
    fn settle(&mut self, v: ds4_engine::Verify, keep: usize) -> Result<(), EngineError> {
        self.engine.settle(self.state, v, keep)
    }
}

/// The slots `ids` names, borrowed mutably in that order; naming one twice or one that
/// does not exist is an error (`what` names the call).
fn named<'s>(
    slots: &'s mut [Slot],
    ids: &[usize],
    what: &str,
) -> Result<Vec<&'s mut Slot>, DriverError> {
    let bad = |why: &str| DriverError::Engine(EngineError::Config(format!("{what} {why}")));
    let mut order = ids.to_vec();
    order.sort_unstable();
    if order.windows(2).any(|w| w[0] == w[1]) {
        return Err(bad("names a slot twice"));
    }
    let mut picked: Vec<(usize, &mut Slot)> = slots
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| order.binary_search(i).is_ok())
        .collect();
    ids.iter()
        .map(|&i| {
            let at = picked
                .iter()
                .position(|(j, _)| *j == i)
                .ok_or_else(|| bad("names a slot that does not exist"))?;
            Ok(picked.swap_remove(at).1)
        })
        .collect()
}

/// Slot `i`'s distribution for one generation step ([`Slots::step`]).
pub struct SlotStep<'a> {
    slots: &'a mut Slots,
    i: usize,
}

impl StepLogits for SlotStep<'_> {
    fn band(&self) -> Option<&LogitBand> {
        match &self.slots.slots[self.i].after {
            After::Band(b) => Some(b),
            _ => None,
        }
    }

    fn row(&mut self) -> Result<&mut [f32], DriverError> {
        self.slots.fetch(self.i)?;
        match &mut self.slots.slots[self.i].after {
            After::Row(v) => Ok(v),
            _ => Err(DriverError::NoLogits),
        }
    }
}

/// One slot's distribution for a generation step as the host holds it: its row, or the
/// band of it while the row is in the engine's scratch ([`Slots::host_steps`]).
pub struct HostStep<'a> {
    after: &'a mut After,
}

impl StepLogits for HostStep<'_> {
    fn band(&self) -> Option<&LogitBand> {
        match &*self.after {
            After::Band(b) => Some(b),
            _ => None,
        }
    }

    fn row(&mut self) -> Result<&mut [f32], DriverError> {
        match &mut *self.after {
            After::Row(v) => Ok(v),
            _ => Err(DriverError::RowOnDevice),
        }
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        for s in self.slots.drain(..) {
            self.engine.free_state(s.state);
        }
    }
}
