//! The host tier of streamed experts (docs/placement.md §9 "Host tier and read-ahead"):
//! (layer, expert) units held in host memory, filled from the model file by a pool of
//! reader threads.
//!
//! Every read of a streamed engine goes through this tier, for two reasons. A unit the
//! device cache evicted may still be here, so a second miss costs a memory copy instead of
//! a disk read (the plan sizes the tier from the RAM a discrete GPU leaves free). And the
//! reads are asynchronous: the forward pass asks for the next layer's *predicted* units
//! while the current layer computes ([`HostTier::request`] with `readahead`), and only
//! waits ([`HostTier::wait`]) for a unit it actually needs. Bookkeeping is the same LRU
//! as the device cache ([`ExpertCache`]); a slot whose read is still in flight has lent
//! its buffer to a reader thread and is never reused before the buffer comes back.
//!
//! The buffers come from the backend ([`Backend::alloc_host_slab`]): page-locked memory on
//! a GPU, so the readers' `pread`s land where the copy engine reads from, and a unit
//! reaches its device slot as queued asynchronous copies ([`Backend::write_weight_mats`])
//! instead of a host wait and a staging copy per matrix. While such copies are in flight
//! the backend holds the buffer; the tier takes it back ([`Backend::reclaim_host_slabs`])
//! before it lets a reader refill it.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use ds4_gguf::GgufFile;

use crate::backend::{Backend, HostSlab, SlabMat, TaggedSlabs};
use crate::expert_cache::{Access, ExpertCache, Unit};
use crate::expert_stream::StreamError;

/// Where the three routed tensors of one layer lie in the file.
#[derive(Debug, Clone)]
pub(crate) struct LayerSource {
    /// `[gate, up, down]`: (tensor name, absolute offset of expert 0, bytes per expert).
    pub roles: [(String, u64, usize); 3],
    pub n_expert: u32,
}

/// Reads expert slices: `pread` on the file when it has a path, else the in-memory image.
pub(crate) enum Reader {
    File(File),
    Memory(Arc<GgufFile>),
}

impl Reader {
    fn read(&self, at: u64, out: &mut [u8]) -> std::io::Result<()> {
        match self {
            Reader::File(f) => f.read_exact_at(out, at),
            Reader::Memory(g) => {
                let b = g.bytes();
                let src = usize::try_from(at)
                    .ok()
                    .and_then(|s| b.get(s..s.checked_add(out.len())?));
                match src {
                    Some(s) => {
                        out.copy_from_slice(s);
                        Ok(())
                    }
                    None => Err(std::io::ErrorKind::UnexpectedEof.into()),
                }
            }
        }
    }
}

/// The file and where every layer's units lie in it; shared with the reader threads.
pub(crate) struct Source {
    pub layers: Vec<LayerSource>,
    pub reader: Reader,
}

impl Source {
    /// Reads unit `u` (its gate, up and down slices, in that order) into `buf`.
    fn read_unit(&self, u: Unit, buf: &mut [u8]) -> Result<(), StreamError> {
        let src = self
            .layers
            .get(u.layer as usize)
            .ok_or_else(|| StreamError::Layout {
                tensor: format!("blk.{}", u.layer),
                problem: "no such layer".into(),
            })?;
        let mut at = 0;
        for (name, base, len) in &src.roles {
            let offset = base + u64::from(u.expert) * *len as u64;
            let out = buf
                .get_mut(at..at + len)
                .ok_or_else(|| StreamError::Layout {
                    tensor: name.clone(),
                    problem: format!("a unit of {} bytes does not fit a slot", at + len),
                })?;
            self.reader
                .read(offset, out)
                .map_err(|source| StreamError::Read {
                    tensor: name.clone(),
                    expert: u.expert,
                    offset,
                    len: *len,
                    source,
                })?;
            at += len;
        }
        Ok(())
    }
}

/// Reader threads of one tier: a disk serves several requests at once far faster than
/// one after another.
pub(crate) const READERS: usize = 8;

struct Job {
    unit: Unit,
    slot: u32,
    gen: u64,
    buf: Box<dyn HostSlab>,
}

struct Done {
    unit: Unit,
    slot: u32,
    gen: u64,
    buf: Box<dyn HostSlab>,
    result: Result<(), StreamError>,
}

/// What the tier needs from a backend: memory for its slots, and stores that may keep a
/// slot's memory for a while ([`Backend`]'s slab methods; tests give a backend-free one).
pub(crate) trait SlabStore {
    fn alloc_slab(&mut self, bytes: usize) -> Result<Box<dyn HostSlab>, StreamError>;
    fn store(
        &mut self,
        slab: Box<dyn HostSlab>,
        tag: u64,
        mats: &[SlabMat],
    ) -> Result<Option<Box<dyn HostSlab>>, StreamError>;
    fn reclaim(&mut self, wait: bool) -> Result<TaggedSlabs, StreamError>;
}

impl SlabStore for dyn Backend + '_ {
    fn alloc_slab(&mut self, bytes: usize) -> Result<Box<dyn HostSlab>, StreamError> {
        Ok(self.alloc_host_slab(bytes)?)
    }
    fn store(
        &mut self,
        slab: Box<dyn HostSlab>,
        tag: u64,
        mats: &[SlabMat],
    ) -> Result<Option<Box<dyn HostSlab>>, StreamError> {
        Ok(self.write_weight_mats(slab, tag, mats)?)
    }
    fn reclaim(&mut self, wait: bool) -> Result<TaggedSlabs, StreamError> {
        Ok(self.reclaim_host_slabs(wait)?)
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct SlotState {
    /// Bumped whenever the slot is given a new unit: a finished read of an older
    /// generation only returns its buffer.
    gen: u64,
    ready: bool,
    /// Filled by read-ahead and not used since (counted once when first used).
    readahead: bool,
}

/// What the tier has done (merged into `StreamStats`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct HostStats {
    /// Units read from the file (demand and read-ahead) and their bytes.
    pub reads: u64,
    pub bytes_read: u64,
    pub readahead_reads: u64,
    /// Read-ahead units that a device miss then used.
    pub readahead_used: u64,
    /// Slot buffers allocated, and how many of them are page-locked.
    pub buffers: u64,
    pub pinned: u64,
}

/// Units in host memory and the reader threads that fill them.
pub(crate) struct HostTier {
    lru: ExpertCache,
    /// `None` while the slot's buffer is with a reader thread or the backend (or was never
    /// allocated: see `allocated`).
    bufs: Vec<Option<Box<dyn HostSlab>>>,
    allocated: Vec<bool>,
    /// The slot's buffer is with the backend (copies out of it may be in flight).
    lent: Vec<bool>,
    state: Vec<SlotState>,
    slot_bytes: usize,
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    workers: Vec<JoinHandle<()>>,
    /// Reads handed to the threads and not yet collected.
    in_flight: usize,
    pub stats: HostStats,
}

impl std::fmt::Debug for HostTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTier")
            .field("slots", &self.lru.n_slots())
            .field("in_flight", &self.in_flight)
            .field("stats", &self.stats)
            .finish()
    }
}

impl HostTier {
    /// A tier of `slots` units of `slot_bytes` each (buffers allocated on first use) with
    /// [`READERS`] threads reading from `source`.
    pub fn new(source: Arc<Source>, slots: usize, slot_bytes: usize) -> Result<Self, StreamError> {
        let lru = ExpertCache::new(slots)?;
        let (job_tx, job_rx) = channel::<Job>();
        let (done_tx, done_rx) = channel::<Done>();
        let job_rx = Arc::new(Mutex::new(job_rx));
        let mut workers = Vec::with_capacity(READERS);
        for i in 0..READERS {
            let (rx, tx, src) = (Arc::clone(&job_rx), done_tx.clone(), Arc::clone(&source));
            let spawned = std::thread::Builder::new()
                .name(format!("ds4-expert-reader-{i}"))
                .spawn(move || reader_loop(&rx, &tx, &src));
            match spawned {
                Ok(h) => workers.push(h),
                // Fewer threads only make reads slower; none at all is an error.
                Err(e) if workers.is_empty() => {
                    return Err(StreamError::Layout {
                        tensor: "expert reader".into(),
                        problem: format!("cannot start a reader thread: {e}"),
                    })
                }
                Err(e) => tracing::warn!("expert reader thread {i} not started: {e}"),
            }
        }
        Ok(HostTier {
            lru,
            bufs: (0..slots).map(|_| None).collect(),
            allocated: vec![false; slots],
            lent: vec![false; slots],
            state: vec![SlotState::default(); slots],
            slot_bytes,
            jobs: Some(job_tx),
            done: done_rx,
            workers,
            in_flight: 0,
            stats: HostStats::default(),
        })
    }

    pub fn n_slots(&self) -> usize {
        self.lru.n_slots()
    }

    /// Whether `u` is here or on its way (a read in flight).
    pub fn contains(&self, u: Unit) -> bool {
        self.lru.slot_of(u).is_some()
    }

    /// Marks the distinct units of `units` (the first `limit` of them, and never more
    /// than the tier holds) as wanted now, so no later request evicts them before older
    /// units, and starts reading those that are neither here nor on their way. Returns
    /// how many reads started. `readahead` marks the reads as speculative (statistics).
    pub fn request<S: SlabStore + ?Sized>(
        &mut self,
        st: &mut S,
        units: &[Unit],
        readahead: bool,
        limit: usize,
    ) -> Result<usize, StreamError> {
        let mut want: Vec<Unit> = Vec::new();
        for &u in units {
            if !want.contains(&u) {
                want.push(u);
            }
        }
        want.truncate(limit.min(self.n_slots()));
        if want.is_empty() {
            return Ok(0);
        }
        let access = self.lru.acquire(&want)?;
        let mut started = 0;
        for (&u, a) in want.iter().zip(&access) {
            let Access::Miss { slot, .. } = *a else {
                continue;
            };
            let buf = match self.take_buffer(st, slot) {
                Ok(b) => b,
                Err(e) => {
                    self.lru.forget(u);
                    return Err(e);
                }
            };
            let state = &mut self.state[slot as usize];
            state.gen += 1;
            state.ready = false;
            state.readahead = readahead;
            let job = Job {
                unit: u,
                slot,
                gen: state.gen,
                buf,
            };
            let sent = self.jobs.as_ref().is_some_and(|tx| tx.send(job).is_ok());
            if !sent {
                self.lru.forget(u);
                return Err(reader_gone());
            }
            self.in_flight += 1;
            started += 1;
            if readahead {
                self.stats.readahead_reads += 1;
            }
        }
        Ok(started)
    }

    /// Waits until `u` is here (reading it now if it is neither here nor on its way) and
    /// returns its bytes (gate, up, down slices in that order). For tests: the stream
    /// hands the bytes to the backend with [`Self::store`].
    #[cfg(test)]
    pub fn wait<S: SlabStore + ?Sized>(
        &mut self,
        st: &mut S,
        u: Unit,
    ) -> Result<&[u8], StreamError> {
        let s = self.ready_slot(st, u)?;
        Ok(self.bufs[s].as_deref().ok_or_else(reader_gone)?.bytes())
    }

    /// Waits until `u` is here, then stores its `mats` (ranges of its bytes) on the
    /// backend, which may keep the buffer while its copies run. Returns how long it waited
    /// for the bytes (the read, statistics).
    pub fn store<S: SlabStore + ?Sized>(
        &mut self,
        st: &mut S,
        u: Unit,
        mats: &[SlabMat],
    ) -> Result<std::time::Duration, StreamError> {
        let t0 = std::time::Instant::now();
        let s = self.ready_slot(st, u)?;
        let waited = t0.elapsed();
        let slab = self.bufs[s].take().ok_or_else(reader_gone)?;
        match st.store(slab, s as u64, mats) {
            Ok(Some(slab)) => self.bufs[s] = Some(slab),
            Ok(None) => self.lent[s] = true,
            Err(e) => {
                // The buffer went with the failed store: the slot starts over.
                self.allocated[s] = false;
                self.state[s].ready = false;
                self.lru.forget(u);
                return Err(e);
            }
        }
        Ok(waited)
    }

    /// Takes back the buffers the backend has finished with (all of them, waiting, with
    /// `wait`).
    pub fn reclaim<S: SlabStore + ?Sized>(
        &mut self,
        st: &mut S,
        wait: bool,
    ) -> Result<(), StreamError> {
        for (tag, slab) in st.reclaim(wait)? {
            let s = usize::try_from(tag).unwrap_or(usize::MAX);
            if self.lent.get(s) == Some(&true) {
                self.lent[s] = false;
                self.bufs[s] = Some(slab);
            }
        }
        Ok(())
    }

    /// The slot of `u` once its bytes are here and its buffer is back in the tier.
    fn ready_slot<S: SlabStore + ?Sized>(
        &mut self,
        st: &mut S,
        u: Unit,
    ) -> Result<usize, StreamError> {
        loop {
            let Some(slot) = self.lru.slot_of(u) else {
                self.request(st, &[u], false, 1)?;
                continue;
            };
            let s = slot as usize;
            if self.state[s].ready {
                // Stamp it as used (LRU) and count a read-ahead that paid off.
                self.lru.acquire(&[u])?;
                if std::mem::take(&mut self.state[s].readahead) {
                    self.stats.readahead_used += 1;
                }
                self.back(st, s)?;
                return Ok(s);
            }
            let done = self.recv()?;
            if let Err(e) = self.collect(done) {
                if self.lru.slot_of(u).is_none() {
                    // The failed read was this unit's.
                    return Err(e);
                }
                tracing::debug!("an expert read-ahead failed: {e}");
            }
        }
    }

    /// Brings slot `s`'s buffer back from the backend if it is lent.
    fn back<S: SlabStore + ?Sized>(&mut self, st: &mut S, s: usize) -> Result<(), StreamError> {
        if self.lent[s] {
            self.reclaim(st, false)?;
        }
        if self.lent[s] {
            self.reclaim(st, true)?;
        }
        if self.lent[s] {
            return Err(StreamError::Layout {
                tensor: "expert host tier".into(),
                problem: "the backend did not give a slot's buffer back after waiting".into(),
            });
        }
        Ok(())
    }

    /// The buffer of `slot`, waiting for its read in flight or its copies to come back
    /// first.
    fn take_buffer<S: SlabStore + ?Sized>(
        &mut self,
        st: &mut S,
        slot: u32,
    ) -> Result<Box<dyn HostSlab>, StreamError> {
        let s = slot as usize;
        if !self.allocated[s] {
            let slab = st.alloc_slab(self.slot_bytes)?;
            if slab.bytes().len() != self.slot_bytes {
                return Err(StreamError::Layout {
                    tensor: "expert host tier".into(),
                    problem: format!(
                        "the backend gave {} bytes for a slot of {}",
                        slab.bytes().len(),
                        self.slot_bytes
                    ),
                });
            }
            self.stats.buffers += 1;
            self.stats.pinned += u64::from(slab.pinned());
            self.allocated[s] = true;
            return Ok(slab);
        }
        self.back(st, s)?;
        while self.bufs[s].is_none() {
            let done = self.recv()?;
            if let Err(e) = self.collect(done) {
                tracing::debug!("an expert read failed while its slot was reused: {e}");
            }
        }
        self.bufs[s].take().ok_or_else(reader_gone)
    }

    fn recv(&mut self) -> Result<Done, StreamError> {
        if self.in_flight == 0 {
            return Err(reader_gone());
        }
        let d = self.done.recv().map_err(|_| reader_gone())?;
        self.in_flight -= 1;
        Ok(d)
    }

    /// Takes a finished read back: the buffer returns to its slot; the unit becomes
    /// ready, or is forgotten when its read failed (that error is returned).
    fn collect(&mut self, d: Done) -> Result<(), StreamError> {
        let s = d.slot as usize;
        self.bufs[s] = Some(d.buf);
        let current = self.state[s].gen == d.gen && self.lru.slot_of(d.unit) == Some(d.slot);
        match d.result {
            Ok(()) => {
                self.stats.reads += 1;
                self.stats.bytes_read += self.slot_bytes as u64;
                if current {
                    self.state[s].ready = true;
                }
                Ok(())
            }
            Err(e) => {
                if current {
                    self.lru.forget(d.unit);
                    self.state[s].readahead = false;
                }
                Err(e)
            }
        }
    }
}

impl Drop for HostTier {
    fn drop(&mut self) {
        // Closing the job channel ends every reader after its current read.
        self.jobs = None;
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

fn reader_gone() -> StreamError {
    StreamError::Layout {
        tensor: "expert reader".into(),
        problem: "the reader threads stopped".into(),
    }
}

fn reader_loop(jobs: &Mutex<Receiver<Job>>, done: &Sender<Done>, src: &Source) {
    loop {
        let job = {
            let Ok(rx) = jobs.lock() else { return };
            match rx.recv() {
                Ok(j) => j,
                Err(_) => return,
            }
        };
        let Job {
            unit,
            slot,
            gen,
            mut buf,
        } = job;
        let result = src.read_unit(unit, buf.bytes_mut());
        let sent = done.send(Done {
            unit,
            slot,
            gen,
            buf,
            result,
        });
        if sent.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_gguf::GgmlType;

    /// A file of 2 layers × 4 experts whose every byte names its unit and place, and the
    /// source describing it (roles of 3, 5 and 2 bytes per expert).
    fn source(name: &str) -> (Arc<Source>, std::path::PathBuf) {
        let lens = [3usize, 5, 2];
        let mut bytes = Vec::new();
        let mut layers = Vec::new();
        for layer in 0..2u8 {
            let mut roles = Vec::new();
            for (ri, &len) in lens.iter().enumerate() {
                roles.push((format!("blk.{layer}.role{ri}"), bytes.len() as u64, len));
                for e in 0..4u8 {
                    bytes.extend((0..len as u8).map(|i| layer * 64 + e * 16 + ri as u8 * 4 + i));
                }
            }
            layers.push(LayerSource {
                roles: roles.try_into().unwrap(),
                n_expert: 4,
            });
        }
        let path =
            std::env::temp_dir().join(format!("ds4-host-tier-{}-{name}.bin", std::process::id()));
        std::fs::write(&path, &bytes).unwrap();
        let reader = Reader::File(File::open(&path).unwrap());
        (Arc::new(Source { layers, reader }), path)
    }

    fn want(u: Unit) -> Vec<u8> {
        let (l, e) = (u.layer as u8, u.expert as u8);
        [3u8, 5, 2]
            .iter()
            .enumerate()
            .flat_map(|(ri, &len)| (0..len).map(move |i| l * 64 + e * 16 + ri as u8 * 4 + i))
            .collect()
    }

    fn u(layer: u32, expert: u32) -> Unit {
        Unit { layer, expert }
    }

    /// A backend stand-in: heap buffers; with `keep`, every stored buffer stays "in
    /// flight" until a waiting reclaim, as a GPU's queued copies would hold it.
    #[derive(Default)]
    struct Store {
        keep: bool,
        held: Vec<(u64, Box<dyn HostSlab>)>,
        /// (tag, bytes of each matrix) of every store.
        stored: Vec<(u64, Vec<Vec<u8>>)>,
        allocs: usize,
    }

    impl SlabStore for Store {
        fn alloc_slab(&mut self, bytes: usize) -> Result<Box<dyn HostSlab>, StreamError> {
            self.allocs += 1;
            Ok(Box::new(crate::backend::HeapSlab::zeroed(bytes)))
        }
        fn store(
            &mut self,
            slab: Box<dyn HostSlab>,
            tag: u64,
            mats: &[SlabMat],
        ) -> Result<Option<Box<dyn HostSlab>>, StreamError> {
            let m = mats
                .iter()
                .map(|m| slab.bytes()[m.range.clone()].to_vec())
                .collect();
            self.stored.push((tag, m));
            if self.keep {
                self.held.push((tag, slab));
                return Ok(None);
            }
            Ok(Some(slab))
        }
        fn reclaim(&mut self, wait: bool) -> Result<TaggedSlabs, StreamError> {
            Ok(if wait {
                std::mem::take(&mut self.held)
            } else {
                Vec::new()
            })
        }
    }

    fn mats(w: crate::backend::Weight) -> Vec<SlabMat> {
        [0..3, 3..8, 8..10]
            .into_iter()
            .map(|range| SlabMat {
                weight: w,
                mat: 0,
                range,
            })
            .collect()
    }

    /// Stored units whose buffers the backend keeps (copies in flight) are taken back
    /// before their slots are refilled or read again: every store and every later read
    /// sees the unit's own bytes, and the tier never allocates more buffers than slots.
    #[test]
    fn buffers_lent_to_the_backend_come_back_before_reuse() {
        let (src, path) = source("lent");
        let mut t = HostTier::new(src, 3, 10).unwrap();
        let mut st = Store {
            keep: true,
            ..Store::default()
        };
        let w = crate::backend::Weight::new(
            0,
            crate::backend::WeightInfo {
                ty: GgmlType::F32,
                dims: [1, 1, 1],
            },
        );
        let order: Vec<Unit> = (0..4)
            .flat_map(|e| [u(0, e), u(1, 3 - e)])
            .chain([u(0, 0), u(1, 3), u(0, 0)])
            .collect();
        for &x in &order {
            t.store(&mut st, x, &mats(w)).unwrap();
            let (_, m) = st.stored.last().unwrap();
            assert_eq!(m.concat(), want(x), "{x:?}");
            assert!(!st.held.is_empty());
        }
        // Every slot's buffer is with the backend or back; a read of a held unit waits.
        assert_eq!(t.wait(&mut st, u(0, 0)).unwrap(), want(u(0, 0)).as_slice());
        assert!(
            st.allocs <= 3 && t.stats.buffers == st.allocs as u64,
            "{}",
            st.allocs
        );
        assert_eq!(t.stats.pinned, 0);
        t.reclaim(&mut st, true).unwrap();
        assert!(st.held.is_empty());
        drop(t);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn units_come_back_exact_through_eviction_of_reads_in_flight() {
        let (src, path) = source("evict");
        let mut t = HostTier::new(src, 3, 10).unwrap();
        let st = &mut Store::default();
        // Five read-ahead units into three slots: only the first three start.
        let all: Vec<Unit> = (0..4).map(|e| u(1, e)).chain([u(0, 2)]).collect();
        assert_eq!(t.request(st, &all, true, usize::MAX).unwrap(), 3);
        assert!(t.contains(u(1, 0)) && !t.contains(u(1, 3)));
        // Two more units evict the two oldest while their reads may still be in flight.
        assert_eq!(
            t.request(st, &[u(0, 0), u(0, 1)], false, usize::MAX)
                .unwrap(),
            2
        );
        for x in [u(0, 0), u(0, 1), u(1, 3), u(1, 2)] {
            assert_eq!(t.wait(st, x).unwrap(), want(x).as_slice(), "{x:?}");
        }
        // A unit already here starts no read; a limit of 1 takes only the first unit.
        assert_eq!(t.request(st, &[u(1, 2)], false, usize::MAX).unwrap(), 0);
        assert_eq!(t.request(st, &[u(0, 3), u(1, 1)], false, 1).unwrap(), 1);
        assert!(t.contains(u(0, 3)) && !t.contains(u(1, 1)));
        assert_eq!(t.wait(st, u(0, 3)).unwrap(), want(u(0, 3)).as_slice());
        assert_eq!(t.stats.bytes_read, t.stats.reads * 10);
        assert_eq!(t.stats.readahead_reads, 3);
        assert!(t.stats.readahead_used <= 1, "{:?}", t.stats);
        drop(t);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_failed_read_is_the_waiters_error_and_the_unit_is_forgotten() {
        let (src, path) = source("fail");
        let mut t = HostTier::new(src, 4, 10).unwrap();
        let st = &mut Store::default();
        // Cut the file inside layer 1's last role: its experts 2 and 3 cannot be read.
        let len = std::fs::metadata(&path).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len - 3)
            .unwrap();
        t.request(st, &[u(1, 3), u(1, 0)], true, usize::MAX)
            .unwrap();
        match t.wait(st, u(1, 3)) {
            Err(StreamError::Read { tensor, expert, .. }) => {
                assert_eq!((tensor.as_str(), expert), ("blk.1.role2", 3))
            }
            other => panic!("expected a read error, got {other:?}"),
        }
        assert!(!t.contains(u(1, 3)));
        assert_eq!(t.wait(st, u(1, 0)).unwrap(), want(u(1, 0)).as_slice());
        // Waiting again reads again (and fails again): nothing stale was kept.
        assert!(matches!(t.wait(st, u(1, 3)), Err(StreamError::Read { .. })));
        drop(t);
        std::fs::remove_file(path).unwrap();
    }
}
