//! Several conversations on one engine: the weights are loaded once and each slot owns a
//! KV state and the logits after it. A scheduler (the server's `--parallel N`) prefills one
//! slot at a time and decodes every generating slot in one batched forward step
//! ([`Slots::decode`] over [`Engine::eval_batch`]), so N streams cost one weight read per
//! token instead of N.
//!
//! Each slot offers the moves [`crate::Conversation`] offers on its one state (prefill,
//! snapshot, restore, checkpoint, resume) with the same meaning, so the payloads and
//! snapshots of either restore into the other.

use ds4_engine::{Engine, EngineError, KvState, Logits, Snapshot};
use thiserror::Error;

use crate::checkpoint::{self, Format};
use crate::driver::DriverError;

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

struct Slot {
    state: KvState,
    /// Logits after the state's tokens, when known.
    logits: Option<Vec<f32>>,
}

/// One engine and its slots. Slot indices are `0..len()`; an index out of range is a
/// caller bug and panics, as a slice index does.
pub struct Slots {
    engine: Engine,
    slots: Vec<Slot>,
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
                    logits: None,
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
        Ok(Slots { engine, slots })
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

    /// The logits after slot `i`'s tokens, when known.
    pub fn logits(&self, i: usize) -> Option<&[f32]> {
        self.slots[i].logits.as_deref()
    }

    /// Takes slot `i`'s logits out (a generation step edits them in place); give them back
    /// with [`Slots::put_logits`].
    pub fn take_logits(&mut self, i: usize) -> Option<Vec<f32>> {
        self.slots[i].logits.take()
    }

    pub fn put_logits(&mut self, i: usize, logits: Vec<f32>) {
        self.slots[i].logits = Some(logits);
    }

    /// Empties slot `i`.
    pub fn reset(&mut self, i: usize) -> Result<(), DriverError> {
        let s = &mut self.slots[i];
        s.logits = None;
        self.engine.reset_state(&mut s.state)?;
        Ok(())
    }

    /// Evaluates `tokens` after slot `i`'s state and keeps the logits. On an engine error
    /// the state is partial and the logits are forgotten.
    pub fn prefill(&mut self, i: usize, tokens: &[u32]) -> Result<(), DriverError> {
        let s = &mut self.slots[i];
        let mut buf = s.logits.take().unwrap_or_default();
        self.engine
            .eval_into(&mut s.state, tokens, Logits::Last, None, &mut buf)?;
        s.logits = Some(buf);
        Ok(())
    }

    pub fn snapshot(&mut self, i: usize) -> Result<Snapshot, DriverError> {
        Ok(self.engine.snapshot(&self.slots[i].state)?)
    }

    /// Replaces slot `i`'s state with a snapshot; `logits` are the ones after it, if known.
    pub fn restore(
        &mut self,
        i: usize,
        snap: &Snapshot,
        logits: Option<Vec<f32>>,
    ) -> Result<(), DriverError> {
        let s = &mut self.slots[i];
        s.logits = None;
        self.engine.restore(&mut s.state, snap)?;
        s.logits = logits;
        Ok(())
    }

    /// Slot `i` as a checkpoint payload (as [`crate::Conversation::checkpoint`]).
    pub fn checkpoint(&mut self, i: usize) -> Result<Vec<u8>, DriverError> {
        let snap = self.snapshot(i)?;
        Ok(checkpoint::encode(self.logits(i), snap.as_bytes()))
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
    /// plain decode; more run batched forward steps of at most [`Slots::batch_max`] slots,
    /// whose rows equal the plain decode's ([`Engine::eval_batch`]). On an engine error the
    /// logits of every slot of the failed step are forgotten (their states may be partial).
    pub fn decode(&mut self, feeds: &[(usize, u32)]) -> Result<(), DriverError> {
        if let [(i, tok)] = feeds {
            let s = &mut self.slots[*i];
            let mut buf = s.logits.take().unwrap_or_default();
            self.engine
                .eval_into(&mut s.state, &[*tok], Logits::Last, None, &mut buf)?;
            s.logits = Some(buf);
            return Ok(());
        }
        let n_vocab = self.engine.hparams().n_vocab;
        for group in feeds.chunks(self.batch_max()) {
            let mut order: Vec<usize> = group.iter().map(|&(i, _)| i).collect();
            order.sort_unstable();
            if order.windows(2).any(|w| w[0] == w[1]) {
                return Err(DriverError::Engine(EngineError::Config(
                    "a batched decode step names a slot twice".into(),
                )));
            }
            // Borrow the named states mutably, in the order of `group`.
            let mut picked: Vec<(usize, &mut Slot)> = self
                .slots
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| order.binary_search(i).is_ok())
                .collect();
            let mut states: Vec<&mut KvState> = Vec::with_capacity(group.len());
            let mut tokens = Vec::with_capacity(group.len());
            for &(i, tok) in group {
                let at = picked
                    .iter()
                    .position(|(j, _)| *j == i)
                    .ok_or(DriverError::Engine(EngineError::Config(
                        "a batched decode step names a slot that does not exist".into(),
                    )))?;
                let (_, Slot { state, logits }) = picked.swap_remove(at);
                *logits = None;
                states.push(state);
                tokens.push(tok);
            }
            let rows = self.engine.eval_batch(&mut states, &tokens)?;
            drop((states, picked));
            for (&(i, _), row) in group.iter().zip(rows.chunks(n_vocab)) {
                self.slots[i].logits = Some(row.to_vec());
            }
        }
        Ok(())
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        for s in self.slots.drain(..) {
            self.engine.free_state(s.state);
        }
    }
}
