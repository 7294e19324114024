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

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use ds4_gguf::GgufFile;

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
    buf: Box<[u8]>,
}

struct Done {
    unit: Unit,
    slot: u32,
    gen: u64,
    buf: Box<[u8]>,
    result: Result<(), StreamError>,
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
}

/// Units in host memory and the reader threads that fill them.
pub(crate) struct HostTier {
    lru: ExpertCache,
    /// `None` while the slot's buffer is with a reader thread (or was never allocated:
    /// see `allocated`).
    bufs: Vec<Option<Box<[u8]>>>,
    allocated: Vec<bool>,
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
    pub fn request(
        &mut self,
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
            let buf = self.take_buffer(slot)?;
            let st = &mut self.state[slot as usize];
            st.gen += 1;
            st.ready = false;
            st.readahead = readahead;
            let job = Job {
                unit: u,
                slot,
                gen: st.gen,
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
    /// returns its bytes (gate, up, down slices in that order).
    pub fn wait(&mut self, u: Unit) -> Result<&[u8], StreamError> {
        loop {
            let Some(slot) = self.lru.slot_of(u) else {
                self.request(&[u], false, 1)?;
                continue;
            };
            let s = slot as usize;
            if self.state[s].ready {
                // Stamp it as used (LRU) and count a read-ahead that paid off.
                self.lru.acquire(&[u])?;
                if std::mem::take(&mut self.state[s].readahead) {
                    self.stats.readahead_used += 1;
                }
                return self.bufs[s].as_deref().ok_or_else(reader_gone);
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

    /// The buffer of `slot`, waiting for its read in flight to come back first.
    fn take_buffer(&mut self, slot: u32) -> Result<Box<[u8]>, StreamError> {
        let s = slot as usize;
        if !self.allocated[s] {
            self.allocated[s] = true;
            return Ok(vec![0u8; self.slot_bytes].into_boxed_slice());
        }
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
        let result = src.read_unit(unit, &mut buf);
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

    #[test]
    fn units_come_back_exact_through_eviction_of_reads_in_flight() {
        let (src, path) = source("evict");
        let mut t = HostTier::new(src, 3, 10).unwrap();
        // Five read-ahead units into three slots: only the first three start.
        let all: Vec<Unit> = (0..4).map(|e| u(1, e)).chain([u(0, 2)]).collect();
        assert_eq!(t.request(&all, true, usize::MAX).unwrap(), 3);
        assert!(t.contains(u(1, 0)) && !t.contains(u(1, 3)));
        // Two more units evict the two oldest while their reads may still be in flight.
        assert_eq!(
            t.request(&[u(0, 0), u(0, 1)], false, usize::MAX).unwrap(),
            2
        );
        for x in [u(0, 0), u(0, 1), u(1, 3), u(1, 2)] {
            assert_eq!(t.wait(x).unwrap(), want(x).as_slice(), "{x:?}");
        }
        // A unit already here starts no read; a limit of 1 takes only the first unit.
        assert_eq!(t.request(&[u(1, 2)], false, usize::MAX).unwrap(), 0);
        assert_eq!(t.request(&[u(0, 3), u(1, 1)], false, 1).unwrap(), 1);
        assert!(t.contains(u(0, 3)) && !t.contains(u(1, 1)));
        assert_eq!(t.wait(u(0, 3)).unwrap(), want(u(0, 3)).as_slice());
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
        // Cut the file inside layer 1's last role: its experts 2 and 3 cannot be read.
        let len = std::fs::metadata(&path).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len - 3)
            .unwrap();
        t.request(&[u(1, 3), u(1, 0)], true, usize::MAX).unwrap();
        match t.wait(u(1, 3)) {
            Err(StreamError::Read { tensor, expert, .. }) => {
                assert_eq!((tensor.as_str(), expert), ("blk.1.role2", 3))
            }
            other => panic!("expected a read error, got {other:?}"),
        }
        assert!(!t.contains(u(1, 3)));
        assert_eq!(t.wait(u(1, 0)).unwrap(), want(u(1, 0)).as_slice());
        // Waiting again reads again (and fails again): nothing stale was kept.
        assert!(matches!(t.wait(u(1, 3)), Err(StreamError::Read { .. })));
        drop(t);
        std::fs::remove_file(path).unwrap();
    }
}
