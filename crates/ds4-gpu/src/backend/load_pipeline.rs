//! The weight load pipeline: every tensor of a batch goes from the file to its planned
//! memory at the speed of the slower of (file read, host-to-device copy), instead of one
//! synchronous pageable copy per tensor.
//!
//! * The tensors are allocated first (plan spans or their own buffers), exactly as the
//!   one-by-one path does, with the copies deferred.
//! * Reader threads take work units (a tensor, or a staging-buffer-sized piece of one) and
//!   read them with `pread` (the mapping when the file has no path; the [`WeightSource`]
//!   when one is set) — into the destination itself when it is host-visible (pinned host,
//!   managed, registered: no second copy), otherwise into a free pinned staging buffer.
//! * The calling thread queues an asynchronous host-to-device copy for each filled
//!   staging buffer, records an event after it, and hands the buffer back to the readers
//!   only once that event has completed. Completion order does not matter: every unit has
//!   its own destination range, so each byte lands exactly once.
//!
//! [`WeightSource`]: super::WeightSource

use std::collections::VecDeque;
use std::fs::File;
use std::io::IsTerminal;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ds4_engine::backend::{BResult, BackendError, Weight, WeightUse};
use ds4_gguf::GgufFile;
use ds4_placement::MemKind;

use super::{GpuBackend, Storage, WeightSource};
use crate::api::{DeviceBuffer, GpuApi};

/// Default total size of the staging ring, MiB.
pub const DEFAULT_STAGING_MIB: usize = 256;
/// Most reader threads by default (fewer on a machine with fewer cores).
pub const MAX_DEFAULT_THREADS: usize = 8;
/// Staging buffers are a whole number of these (keeps `pread` and DMA aligned).
const STAGING_ALIGN: usize = 4096;

/// How the pipeline reads and stages: reader threads, and the pinned staging ring split
/// into max(4, readers + 2) buffers, so two copies can be in flight while every reader
/// fills one. The binaries set it from `DS4_LOAD_THREADS` / `DS4_LOAD_STAGING_MIB`
/// (`ds4_runtime::config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadConfig {
    /// Reader threads (at least 1).
    pub threads: usize,
    /// Staging buffers in the ring (at least 2).
    pub buffers: usize,
    /// Bytes per staging buffer; also the largest piece one reader reads at a time.
    pub buffer_bytes: usize,
}

impl Default for LoadConfig {
    /// min(8, available cores) readers and a ring of 256 MiB.
    fn default() -> LoadConfig {
        LoadConfig::with_ring(default_load_threads(), DEFAULT_STAGING_MIB << 20)
    }
}

/// Reader threads by default: one per available core, at most [`MAX_DEFAULT_THREADS`].
pub fn default_load_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.min(MAX_DEFAULT_THREADS)
}

impl LoadConfig {
    /// `threads` readers and a ring of `total_bytes` split into max(4, threads + 2)
    /// buffers (each a multiple of 4 KiB, at least 4 KiB).
    pub fn with_ring(threads: usize, total_bytes: usize) -> LoadConfig {
        let threads = threads.max(1);
        let buffers = (threads + 2).max(4);
        let per = (total_bytes / buffers) / STAGING_ALIGN * STAGING_ALIGN;
        LoadConfig {
            threads,
            buffers,
            buffer_bytes: per.max(STAGING_ALIGN),
        }
    }
}

/// One tensor whose bytes the pipeline moves.
struct Job {
    name: String,
    /// Absolute offset of its bytes in the file.
    file_offset: u64,
    bytes: usize,
    /// Largest unit it is split into (a multiple of the source's granule when there is
    /// a source; `usize::MAX`: whole).
    piece: usize,
}

/// Where a unit's bytes go.
enum Dst<'a, B> {
    /// Host-visible memory: the reader writes it directly.
    Host(&'a mut [u8]),
    /// Device memory at this offset: through a staging buffer and an async copy.
    Device { buf: &'a B, offset: usize },
}

/// A piece of one tensor (`start..start + len` of its bytes) and its destination.
struct Unit<'a, B> {
    job: usize,
    start: usize,
    len: usize,
    dst: Dst<'a, B>,
}

/// A filled staging buffer on its way to the copy queue.
struct Filled<'a, B> {
    staging: &'a mut [u8],
    len: usize,
    dst: &'a B,
    offset: usize,
}

/// What a destination buffer is, for splitting it between units.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum BufId {
    Arena(usize),
    Own(usize),
}

/// Splits destination buffers into units (targets sorted by buffer, then offset).
struct Split<'s, 'a, B> {
    targets: &'s [(BufId, usize, usize)],
    next: &'s mut usize,
    jobs: &'s [Job],
    units: &'s mut Vec<Unit<'a, B>>,
    device_bytes: &'s mut u64,
}

impl<'a, B: DeviceBuffer> Split<'_, 'a, B> {
    /// The units of buffer `id`: device ranges by reference, host ranges as disjoint
    /// slices of its mapping (spans that overlap or leave the buffer are refused).
    fn buffer(&mut self, id: BufId, buf: &'a mut B) -> BResult<()> {
        let gerr = |e: crate::error::GpuError| BackendError::Invalid {
            op: "load_weights",
            problem: e.to_string(),
        };
        let start = *self.next;
        let mut end = start;
        while end < self.targets.len() && self.targets[end].0 == id {
            end += 1;
        }
        *self.next = end;
        let mine = &self.targets[start..end];
        if mine.is_empty() {
            return Ok(());
        }
        let host = buf.host_bytes_mut().map_err(gerr)?.is_some();
        if !host {
            let b: &'a B = buf;
            for &(_, off, j) in mine {
                let bytes = self.jobs[j].bytes;
                let piece = self.jobs[j].piece;
                *self.device_bytes += bytes as u64;
                let mut s = 0usize;
                while s < bytes {
                    let len = piece.min(bytes - s);
                    self.units.push(Unit {
                        job: j,
                        start: s,
                        len,
                        dst: Dst::Device {
                            buf: b,
                            offset: off + s,
                        },
                    });
                    s += len;
                }
            }
            return Ok(());
        }
        let len = buf.len();
        let mut rest: &'a mut [u8] = buf.host_bytes_mut().map_err(gerr)?.ok_or_else(|| {
            gerr(crate::error::GpuError::BadArgument {
                op: "load",
                detail: "a host-visible buffer lost its mapping".into(),
            })
        })?;
        let mut pos = 0usize;
        for &(_, off, j) in mine {
            let bytes = self.jobs[j].bytes;
            if off < pos || off.checked_add(bytes).is_none_or(|e| e > len) {
                return Err(werr(
                    &self.jobs[j].name,
                    format!("its span at {off} overlaps another or leaves the buffer"),
                ));
            }
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(off - pos);
            let (mut dst, tail) = tail.split_at_mut(bytes);
            rest = tail;
            pos = off + bytes;
            let piece = self.jobs[j].piece;
            let mut s = 0usize;
            while s < bytes {
                let n = piece.min(bytes - s);
                let (head, more) = std::mem::take(&mut dst).split_at_mut(n);
                dst = more;
                self.units.push(Unit {
                    job: j,
                    start: s,
                    len: n,
                    dst: Dst::Host(head),
                });
                s += n;
            }
        }
        Ok(())
    }
}

/// Reads the bytes of the file (or its mapping / the source) for the readers.
struct Reader<'a> {
    file: &'a GgufFile,
    source: Option<&'a dyn WeightSource>,
    /// The file opened for `pread`, when it has a path.
    handle: Option<(File, &'a Path)>,
    /// Drop the page cache behind reads into host-resident memory (ROCm's `pread_load`).
    drop_cache: bool,
    /// Size of one staging buffer.
    staging_bytes: usize,
}

impl Reader<'_> {
    /// Bytes `start..start + out.len()` of `job` into `out` (never a source tensor: those
    /// come from the source).
    fn read(&self, job: &Job, start: usize, out: &mut [u8], drop: bool) -> Result<(), String> {
        match &self.handle {
            Some((f, path)) => crate::loader::pread_range(
                f,
                path,
                job.file_offset + start as u64,
                out,
                drop && self.drop_cache,
            )
            .map_err(|e| e.to_string()),
            None => {
                let (_, data) = self
                    .file
                    .tensor_bytes(&job.name)
                    .map_err(|e| e.to_string())?;
                let src = data.get(start..start + out.len()).ok_or_else(|| {
                    format!("{} bytes in the file, fewer than expected", data.len())
                })?;
                out.copy_from_slice(src);
                Ok(())
            }
        }
    }
}

/// Shared state of one pipeline run.
struct Shared<'a, B> {
    jobs: &'a [Job],
    units: Mutex<std::vec::IntoIter<Unit<'a, B>>>,
    free: Mutex<mpsc::Receiver<&'a mut [u8]>>,
    abort: AtomicBool,
    error: Mutex<Option<BackendError>>,
    /// Bytes written to host destinations by the readers.
    host_done: AtomicU64,
}

impl<B> Shared<'_, B> {
    fn fail(&self, e: BackendError) {
        self.abort.store(true, Ordering::Relaxed);
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(e);
        }
    }
}

fn werr(name: &str, problem: String) -> BackendError {
    BackendError::Weight {
        name: name.to_string(),
        problem,
    }
}

/// One reader thread: takes units until none are left (or the run aborts).
fn reader_loop<'a, B: DeviceBuffer>(
    sh: &Shared<'a, B>,
    rd: &Reader<'_>,
    full: mpsc::Sender<Filled<'a, B>>,
) {
    let mut whole: Vec<u8> = Vec::new();
    loop {
        if sh.abort.load(Ordering::Relaxed) {
            return;
        }
        let next = sh.units.lock().unwrap_or_else(|p| p.into_inner()).next();
        let Some(unit) = next else { return };
        let job = &sh.jobs[unit.job];
        match unit.dst {
            Dst::Host(out) => {
                let r = match rd.source {
                    Some(s) if job.piece != usize::MAX => s.fill_range(&job.name, unit.start, out),
                    Some(s) => s.fill(&job.name, out),
                    None => rd.read(job, unit.start, out, true),
                };
                if let Err(e) = r {
                    sh.fail(werr(&job.name, e));
                    return;
                }
                sh.host_done.fetch_add(unit.len as u64, Ordering::Relaxed);
            }
            Dst::Device { buf, offset } => {
                // A source that fills whole tensors only (or pieces of one granule larger
                // than a staging buffer) is staged on the heap first; otherwise each
                // staging buffer is filled in place below.
                let mut staged = false;
                if let Some(s) = rd.source {
                    let r = if job.piece == usize::MAX {
                        whole.clear();
                        whole.resize(job.bytes, 0);
                        staged = true;
                        s.fill(&job.name, &mut whole)
                    } else if unit.len > rd.staging_bytes {
                        whole.clear();
                        whole.resize(unit.len, 0);
                        staged = true;
                        s.fill_range(&job.name, unit.start, &mut whole)
                    } else {
                        Ok(())
                    };
                    if let Err(e) = r {
                        sh.fail(werr(&job.name, e));
                        return;
                    }
                }
                let mut done = 0usize;
                while done < unit.len {
                    if sh.abort.load(Ordering::Relaxed) {
                        return;
                    }
                    let got = sh.free.lock().unwrap_or_else(|p| p.into_inner()).recv();
                    // The copy side has stopped (an error there): nothing more to do.
                    let Ok(staging) = got else { return };
                    let n = staging.len().min(unit.len - done);
                    let at = unit.start + done;
                    let r = match rd.source {
                        Some(_) if staged => {
                            // `whole` holds the tensor, or just this unit.
                            let from = if job.piece == usize::MAX { at } else { done };
                            staging[..n].copy_from_slice(&whole[from..from + n]);
                            Ok(())
                        }
                        Some(s) => s.fill_range(&job.name, at, &mut staging[..n]),
                        None => rd.read(job, at, &mut staging[..n], false),
                    };
                    if let Err(e) = r {
                        sh.fail(werr(&job.name, e));
                        return;
                    }
                    let msg = Filled {
                        staging,
                        len: n,
                        dst: buf,
                        offset: offset + done,
                    };
                    if full.send(msg).is_err() {
                        return;
                    }
                    done += n;
                }
            }
        }
    }
}

/// The copy side, on the calling thread: queues a copy per filled buffer, recycles
/// buffers whose copy has completed, and drives the progress display. Returns the bytes
/// copied to the device.
fn copy_loop<'a, D: GpuApi>(
    dev: &D,
    full: mpsc::Receiver<Filled<'a, D::Buffer>>,
    free: mpsc::Sender<&'a mut [u8]>,
    events: &[D::Event],
    progress: &mut Progress,
    host_done: &AtomicU64,
) -> crate::error::Result<u64> {
    let mut idle: Vec<usize> = (0..events.len()).collect();
    let mut pending: VecDeque<(&'a mut [u8], usize)> = VecDeque::new();
    let mut copied = 0u64;
    loop {
        while let Some((_, e)) = pending.front() {
            if !dev.event_query(&events[*e])? {
                break;
            }
            let (s, e) = pending.pop_front().expect("front exists");
            idle.push(e);
            // A send error only means every reader has finished.
            let _ = free.send(s);
        }
        progress.show(copied + host_done.load(Ordering::Relaxed));
        let msg = match full.try_recv() {
            Ok(m) => m,
            Err(TryRecvError::Empty) => {
                if let Some((s, e)) = pending.pop_front() {
                    dev.event_wait(&events[e])?;
                    idle.push(e);
                    let _ = free.send(s);
                    continue;
                }
                match full.recv_timeout(Duration::from_millis(100)) {
                    Ok(m) => m,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            }
            Err(TryRecvError::Disconnected) => break,
        };
        // Every buffer in flight holds one event, and there are as many events as
        // buffers, so one is idle here.
        let e = idle
            .pop()
            .ok_or_else(|| crate::error::GpuError::BadArgument {
                op: "load",
                detail: "more staging buffers in flight than events".into(),
            })?;
        // SAFETY: `msg.staging` goes into `pending` and back to the readers only after
        // the event recorded below has completed (or, on every exit, after the device
        // synchronisation in `load_batch`), so the device reads it unmodified.
        unsafe { dev.copy_to_device_async(msg.dst, msg.offset, &msg.staging[..msg.len])? };
        dev.record_event(&events[e])?;
        copied += msg.len as u64;
        pending.push_back((msg.staging, e));
    }
    for (_, e) in &pending {
        dev.event_wait(&events[*e])?;
    }
    progress.show(copied + host_done.load(Ordering::Relaxed));
    Ok(copied)
}

/// A progress bar on a terminal, nothing otherwise (the summary line comes at the end).
struct Progress {
    bar: Option<indicatif::ProgressBar>,
}

impl Progress {
    fn new(total: u64) -> Self {
        let bar = (std::io::stderr().is_terminal() && total > 0).then(|| {
            let b = indicatif::ProgressBar::new(total);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "loading {bar:30} {binary_bytes}/{binary_total_bytes} {decimal_bytes_per_sec} eta {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            b
        });
        Progress { bar }
    }
    fn show(&self, done: u64) {
        if let Some(b) = &self.bar {
            b.set_position(done);
        }
    }
    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

const GIB: f64 = (1u64 << 30) as f64;

impl<D: GpuApi> GpuBackend<D> {
    /// The pipeline's settings from now on instead of [`super::Knobs::load`]'s (tests give
    /// tiny rings).
    pub fn set_load_config(&mut self, cfg: LoadConfig) {
        self.load_config = cfg;
    }

    /// [`ds4_engine::Backend::load_weights`]: allocate everything, then move the bytes
    /// through the pipeline.
    pub(super) fn load_batch(
        &mut self,
        file: &Arc<GgufFile>,
        list: &[(String, WeightUse)],
    ) -> BResult<Vec<Weight>> {
        let t0 = Instant::now();
        let first = self.weights.len();
        let mut out = Vec::with_capacity(list.len());
        for (name, usage) in list {
            out.push(self.load_inner(file, name, *usage, true)?);
        }
        let cfg = self.load_config;
        let (total, device) = self.run_pipeline(file, first, cfg)?;
        for wi in first..self.weights.len() {
            self.split_q8_0(wi)?;
        }
        let secs = t0.elapsed().as_secs_f64();
        let line = format!(
            "loaded {:.2} GiB in {:.1} s ({:.1} GB/s) · device {:.2} GiB",
            total as f64 / GIB,
            secs,
            total as f64 / 1e9 / secs.max(1e-9),
            device as f64 / GIB
        );
        tracing::info!("{line}");
        eprintln!("{line}");
        Ok(out)
    }

    /// Moves the bytes of weights `first..` (allocated with deferred copies). Returns
    /// (bytes moved, of which to device memory).
    fn run_pipeline(
        &mut self,
        file: &Arc<GgufFile>,
        first: usize,
        cfg: LoadConfig,
    ) -> BResult<(u64, u64)> {
        let GpuBackend {
            dev,
            weights,
            arenas,
            source,
            pread_load,
            ..
        } = self;
        let gerr = |e: crate::error::GpuError| BackendError::Invalid {
            op: "load_weights",
            problem: e.to_string(),
        };
        // The jobs and where each goes, deduplicated by destination.
        let mut jobs: Vec<Job> = Vec::new();
        let mut targets: Vec<(BufId, usize, usize)> = Vec::new(); // (buffer, offset, job)
        let mut seen = std::collections::HashSet::new();
        for (wi, w) in weights.iter().enumerate().skip(first) {
            let (id, offset) = match &w.storage {
                None => continue,
                Some(Storage::Own(_)) => (BufId::Own(wi), 0),
                Some(Storage::Arena { arena, offset }) => (BufId::Arena(*arena), *offset),
            };
            if !seen.insert((id, offset)) {
                continue;
            }
            let bytes = w.row_bytes * w.info.dims[1] * w.info.dims[2];
            let t = file
                .header()
                .tensor(&w.name)
                .ok_or_else(|| werr(&w.name, "not in the file's tensor table".into()))?;
            if source.is_none() && t.n_bytes() != Some(bytes as u64) {
                return Err(werr(
                    &w.name,
                    format!("{:?} bytes in the file, {bytes} expected", t.n_bytes()),
                ));
            }
            let file_offset = file
                .layout()
                .data_offset
                .checked_add(t.offset)
                .ok_or_else(|| werr(&w.name, "offset overflows".into()))?;
            // File reads are split so readers share big tensors; a source is split at its
            // granule (whole tensors when it has none).
            let piece = match source.as_deref() {
                None => cfg.buffer_bytes,
                Some(s) => match s.granule(&w.name) {
                    Some(g) if g > 0 => (cfg.buffer_bytes / g).max(1) * g,
                    _ => usize::MAX,
                },
            };
            targets.push((id, offset, jobs.len()));
            jobs.push(Job {
                name: w.name.clone(),
                file_offset,
                bytes,
                piece,
            });
        }
        if jobs.is_empty() {
            return Ok((0, 0));
        }
        targets.sort_unstable_by_key(|&(id, off, _)| (id, off));
        let total: u64 = jobs.iter().map(|j| j.bytes as u64).sum();

        // Split every destination buffer into its units.
        let mut units: Vec<Unit<'_, D::Buffer>> = Vec::new();
        let mut device_bytes = 0u64;
        let mut t = 0usize;
        let mut split = Split {
            targets: &targets,
            next: &mut t,
            jobs: &jobs,
            units: &mut units,
            device_bytes: &mut device_bytes,
        };
        for (i, a) in arenas.iter_mut().enumerate() {
            split.buffer(BufId::Arena(i), a)?;
        }
        for (wi, w) in weights.iter_mut().enumerate().skip(first) {
            if let Some(Storage::Own(b)) = &mut w.storage {
                split.buffer(BufId::Own(wi), b)?;
            }
        }
        // File order: sequential reads within and across tensors.
        units.sort_by_key(|u| (jobs[u.job].file_offset, u.start));
        let dev: &D = dev;

        // The staging ring (pinned; pageable if pinned memory is refused) and its events.
        let need_staging = units.iter().any(|u| matches!(u.dst, Dst::Device { .. }));
        let ring = if need_staging { cfg.buffers.max(2) } else { 0 };
        let ring_bytes = ring * cfg.buffer_bytes;
        let mut pinned = if ring > 0 {
            match dev.alloc(MemKind::PinnedHost, ring_bytes) {
                Ok(b) => Some(b),
                Err(e) => {
                    tracing::warn!("load staging: pinned memory refused ({e}); pageable");
                    None
                }
            }
        } else {
            None
        };
        let mut pageable = Vec::new();
        let staging: &mut [u8] = match pinned.as_mut().map(|b| b.host_bytes_mut()) {
            Some(Ok(Some(h))) => &mut h[..ring_bytes],
            _ => {
                pageable.resize(ring_bytes, 0u8);
                &mut pageable[..]
            }
        };
        let events = (0..ring)
            .map(|_| dev.copy_event())
            .collect::<crate::error::Result<Vec<_>>>()
            .map_err(gerr)?;

        let handle = match (source.is_none(), file.path()) {
            (true, Some(p)) => Some((
                File::open(p).map_err(|e| BackendError::Weight {
                    name: p.display().to_string(),
                    problem: e.to_string(),
                })?,
                p,
            )),
            _ => None,
        };
        let reader = Reader {
            file,
            source: source.as_deref(),
            handle,
            drop_cache: *pread_load,
            staging_bytes: cfg.buffer_bytes,
        };
        let (free_tx, free_rx) = mpsc::channel::<&mut [u8]>();
        if ring > 0 {
            for s in staging.chunks_exact_mut(cfg.buffer_bytes) {
                let _ = free_tx.send(s);
            }
        }
        let (full_tx, full_rx) = mpsc::channel();
        let shared = Shared {
            jobs: &jobs,
            units: Mutex::new(units.into_iter()),
            free: Mutex::new(free_rx),
            abort: AtomicBool::new(false),
            error: Mutex::new(None),
            host_done: AtomicU64::new(0),
        };
        let mut progress = Progress::new(total);
        let copied = std::thread::scope(|scope| {
            for _ in 0..cfg.threads.max(1) {
                let full = full_tx.clone();
                let (sh, rd) = (&shared, &reader);
                scope.spawn(move || reader_loop(sh, rd, full));
            }
            drop(full_tx);
            let r = copy_loop(
                dev,
                full_rx,
                free_tx,
                &events,
                &mut progress,
                &shared.host_done,
            );
            if r.is_err() {
                shared.abort.store(true, Ordering::Relaxed);
            }
            r
        });
        progress.finish();
        // Every queued copy out of the staging ring completes before the ring is freed,
        // whatever happened above.
        let synced = dev.synchronize();
        if let Some(e) = shared.error.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
        let copied = copied.map_err(gerr)?;
        synced.map_err(gerr)?;
        let host = shared.host_done.load(Ordering::Relaxed);
        if copied + host != total || copied != device_bytes {
            return Err(BackendError::Invalid {
                op: "load_weights",
                problem: format!(
                    "moved {copied} bytes to the device and {host} to host memory, \
                     {device_bytes} and {} expected",
                    total - device_bytes
                ),
            });
        }
        Ok((total, device_bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_is_split_into_aligned_buffers_for_every_reader() {
        let c = LoadConfig::with_ring(8, 256 << 20);
        assert_eq!((c.threads, c.buffers), (8, 10));
        assert_eq!(c.buffer_bytes % STAGING_ALIGN, 0);
        assert!(c.buffer_bytes * c.buffers <= 256 << 20);
        assert!(c.buffer_bytes * c.buffers > 250 << 20);
        // Few readers still get a ring of four; a tiny ring still gets 4 KiB buffers.
        let c = LoadConfig::with_ring(0, 1000);
        assert_eq!(
            (c.threads, c.buffers, c.buffer_bytes),
            (1, 4, STAGING_ALIGN)
        );
    }
}
