//! Buffer slabs: backend-owned vectors addressed by handle id.
//!
//! An op takes its output vector *out of* the slab while it runs, so reading the same
//! buffer as an input during the op is detected (the slot is `Taken`) and refused as
//! aliasing rather than silently reading half-written data.

use ds4_engine::backend::{BResult, BackendError, Slice};

#[derive(Debug)]
enum Slot<T> {
    Free,
    Live(Vec<T>),
    Taken,
}

#[derive(Debug)]
pub(crate) struct Slab<T> {
    slots: Vec<Slot<T>>,
}

impl<T: Clone + Default> Slab<T> {
    pub fn new() -> Self {
        Slab { slots: Vec::new() }
    }

    /// A zero-filled vector; ids are never reused, so a stale handle cannot alias a new buffer.
    pub fn alloc(&mut self, len: usize) -> BResult<u32> {
        let id = u32::try_from(self.slots.len()).map_err(|_| BackendError::Alloc {
            elems: len,
            problem: "too many buffers".into(),
        })?;
        let mut v = Vec::new();
        v.try_reserve_exact(len).map_err(|e| BackendError::Alloc {
            elems: len,
            problem: e.to_string(),
        })?;
        v.resize(len, T::default());
        self.slots.push(Slot::Live(v));
        Ok(id)
    }

    pub fn free(&mut self, id: u32) {
        if let Some(s) = self.slots.get_mut(id as usize) {
            *s = Slot::Free;
        }
    }

    pub fn get(&self, id: u32, op: &'static str) -> BResult<&[T]> {
        match self.slots.get(id as usize) {
            Some(Slot::Live(v)) => Ok(v),
            Some(Slot::Taken) => Err(BackendError::Aliasing { op, id }),
            _ => Err(BackendError::BadHandle { op, id }),
        }
    }

    pub fn get_mut(&mut self, id: u32, op: &'static str) -> BResult<&mut Vec<T>> {
        match self.slots.get_mut(id as usize) {
            Some(Slot::Live(v)) => Ok(v),
            Some(Slot::Taken) => Err(BackendError::Aliasing { op, id }),
            _ => Err(BackendError::BadHandle { op, id }),
        }
    }

    pub fn take(&mut self, id: u32, op: &'static str) -> BResult<Vec<T>> {
        let slot = self
            .slots
            .get_mut(id as usize)
            .ok_or(BackendError::BadHandle { op, id })?;
        match std::mem::replace(slot, Slot::Taken) {
            Slot::Live(v) => Ok(v),
            Slot::Taken => Err(BackendError::Aliasing { op, id }),
            Slot::Free => {
                *slot = Slot::Free;
                Err(BackendError::BadHandle { op, id })
            }
        }
    }

    pub fn put(&mut self, id: u32, v: Vec<T>) {
        if let Some(s) = self.slots.get_mut(id as usize) {
            *s = Slot::Live(v);
        }
    }
}

/// The element range of `s` inside a vector of `have` elements.
pub(crate) fn range(s: Slice, have: usize, op: &'static str) -> BResult<std::ops::Range<usize>> {
    let end = s.off.saturating_add(s.len);
    if end > have || s.buf.len() != have {
        return Err(BackendError::OutOfRange {
            op,
            id: s.buf.id(),
            off: s.off,
            end,
            len: have,
        });
    }
    Ok(s.off..end)
}
