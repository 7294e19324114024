//! Routed experts streamed from the model file into a fixed pool of slots
//! (docs/placement.md §9 "Streamed routed experts").
//!
//! Each routed role (gate, up, down) has one pool weight on the backend: the layer
//! tensors' type, columns and rows, with `slots` matrices instead of `n_expert`. The
//! forward pass hands the router's ids to [`ExpertStream::moe`], which makes the chunk's
//! (layer, expert) units resident ([`crate::expert_cache`] decides where; misses are read
//! with `pread` and stored with [`Backend::write_weight_mat`]), rewrites the ids to slot
//! numbers and runs the backend's unchanged `moe` on the pools. The router's weights and
//! the order of a token's experts are untouched, and a slot holds the exact bytes of the
//! file's matrix, so the result is the resident run's, bit for bit, on a backend whose
//! `moe` of a token does not depend on the other tokens of the call (the CPU backend).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Instant;

use ds4_gguf::{GgmlType, GgufFile};
use ds4_model::{LayerTensor, ModelSpec};

use crate::backend::{Backend, IBuf, MoeArgs, Slice, Weight, WeightInfo};
use crate::error::{EngineError, Result};
use crate::expert_cache::{split_runs, Access, CacheError, ExpertCache, Unit};

/// How routed experts are placed when an engine is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertPlacement {
    /// Every routed tensor loaded whole, like every other weight.
    #[default]
    Resident,
    /// Routed tensors stay in the file; a cache of this many (layer, expert) units.
    Streamed { slots: usize },
}

/// Why streaming failed (reported inside [`EngineError::Stream`]).
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("the model file has no path to read experts from, and no bytes in memory")]
    NoSource,
    #[error("cannot open {path} to stream experts: {source}")]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error("the model file changed since it was opened: {found} bytes, expected {expected}")]
    FileChanged { expected: u64, found: u64 },
    #[error("reading {len} bytes of {tensor} (expert {expert}) at offset {offset}: {source}")]
    Read {
        tensor: String,
        expert: u32,
        offset: u64,
        len: usize,
        source: std::io::Error,
    },
    #[error("{tensor}: {problem}")]
    Layout { tensor: String, problem: String },
    #[error("cache of {slots} slots is too small: it must hold at least {min} units (three tokens' experts) so a prefill can be split into runs of two tokens or more")]
    TooSmall { slots: usize, min: usize },
    #[error("expert cache: {0}")]
    Cache(#[from] CacheError),
}

/// What streaming has done since the engine was loaded.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StreamStats {
    /// Cache slots (units).
    pub slots: usize,
    /// Bytes of one slot (a unit's gate + up + down slices).
    pub slot_bytes: u64,
    /// (layer, expert) lookups (one per token and chosen expert, repeats in a run counted).
    pub lookups: u64,
    pub hits: u64,
    /// Units read from the file.
    pub misses: u64,
    pub bytes_read: u64,
    /// Seconds spent in file reads, and in writing slots on the backend.
    pub read_secs: f64,
    pub write_secs: f64,
    /// `moe` calls (more than one per layer when a chunk's experts did not fit at once).
    pub runs: u64,
}

impl StreamStats {
    pub fn hit_rate(&self) -> f64 {
        if self.lookups == 0 {
            0.0
        } else {
            self.hits as f64 / self.lookups as f64
        }
    }
    /// Bytes per second of the file reads alone.
    pub fn read_bytes_per_s(&self) -> f64 {
        if self.read_secs > 0.0 {
            self.bytes_read as f64 / self.read_secs
        } else {
            0.0
        }
    }
}

/// Where the three tensors of one layer lie in the file.
#[derive(Debug, Clone)]
struct LayerSource {
    /// `[gate, up, down]`: (tensor name, absolute offset of expert 0, bytes per expert).
    roles: [(String, u64, usize); 3],
    n_expert: u32,
}

/// Reads expert slices: `pread` on the file when it has a path, else the in-memory image.
enum Reader {
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

/// The streamed experts of one engine: pools, cache, file and counters.
pub struct ExpertStream {
    /// `[gate, up, down]` pool weights (`slots` matrices each).
    pools: [Weight; 3],
    layers: Vec<LayerSource>,
    cache: ExpertCache,
    reader: Reader,
    staging: Vec<u8>,
    stats: StreamStats,
}

impl std::fmt::Debug for ExpertStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertStream")
            .field("slots", &self.cache.n_slots())
            .field("stats", &self.stats)
            .finish()
    }
}

/// Most threads reading one call's missed units at once.
const READERS: usize = 8;

const ROLES: [LayerTensor; 3] = [
    LayerTensor::GateExps,
    LayerTensor::UpExps,
    LayerTensor::DownExps,
];

impl ExpertStream {
    /// Checks that every layer's routed tensors of a role share one type and shape (one
    /// pool per role), opens the file for reading and allocates the pools on `be`.
    pub fn new(
        be: &mut dyn Backend,
        file: &Arc<GgufFile>,
        spec: &ModelSpec,
        slots: usize,
    ) -> Result<ExpertStream> {
        let hp = &spec.hparams;
        let min = 3 * hp.n_expert_used;
        if slots < min {
            return Err(StreamError::TooSmall { slots, min }.into());
        }
        let cache = ExpertCache::new(slots).map_err(StreamError::from)?;
        let data0 = file.layout().data_offset;
        let mut shapes: [Option<(GgmlType, usize, usize)>; 3] = [None; 3];
        let mut layers = Vec::with_capacity(hp.n_layer);
        for il in 0..hp.n_layer {
            let mut roles: Vec<(String, u64, usize)> = Vec::with_capacity(3);
            let mut n_expert = 0u32;
            for (ri, role) in ROLES.iter().enumerate() {
                let name = role.name(il);
                let layout = |problem: String| StreamError::Layout {
                    tensor: name.clone(),
                    problem,
                };
                let t = file
                    .header()
                    .tensor(&name)
                    .ok_or_else(|| EngineError::MissingTensor { name: name.clone() })?;
                if t.dims.len() != 3 {
                    return Err(layout(format!("{} dims, expected 3", t.dims.len())).into());
                }
                let dim = |i: usize| usize::try_from(t.dims[i]).unwrap_or(usize::MAX);
                let (cols, rows, ne) = (dim(0), dim(1), dim(2));
                let row_bytes =
                    t.ty.row_bytes(cols as u64).ok_or_else(|| {
                        layout(format!("type {} cannot hold {cols} columns", t.ty))
                    })? as usize;
                let expert_bytes = row_bytes
                    .checked_mul(rows)
                    .ok_or_else(|| layout("size overflows".into()))?;
                let shape = (t.ty, cols, rows);
                match shapes[ri] {
                    None => shapes[ri] = Some(shape),
                    Some(s) if s == shape => {}
                    Some(s) => {
                        return Err(layout(format!(
                            "{} [{cols}, {rows}] differs from layer 0's {} [{}, {}]: streamed \
                             experts need one type and shape per role",
                            t.ty, s.0, s.1, s.2
                        ))
                        .into())
                    }
                }
                if ri > 0 && ne as u32 != n_expert {
                    return Err(layout(format!("{ne} experts, gate has {n_expert}")).into());
                }
                n_expert = u32::try_from(ne).map_err(|_| layout("too many experts".into()))?;
                let at = data0
                    .checked_add(t.offset)
                    .ok_or_else(|| layout("offset overflows".into()))?;
                roles.push((name, at, expert_bytes));
            }
            let roles: [(String, u64, usize); 3] = roles.try_into().expect("three roles");
            layers.push(LayerSource { roles, n_expert });
        }
        let reader = match file.path() {
            Some(p) => {
                let f = File::open(p).map_err(|source| StreamError::Open {
                    path: p.display().to_string(),
                    source,
                })?;
                let found = f
                    .metadata()
                    .map_err(|source| StreamError::Open {
                        path: p.display().to_string(),
                        source,
                    })?
                    .len();
                let expected = file.layout().file_len;
                if found != expected {
                    return Err(StreamError::FileChanged { expected, found }.into());
                }
                Reader::File(f)
            }
            None if !file.bytes().is_empty() => Reader::Memory(Arc::clone(file)),
            None => return Err(StreamError::NoSource.into()),
        };
        let mut pools = Vec::with_capacity(3);
        for (ri, role) in ROLES.iter().enumerate() {
            let (ty, cols, rows) = shapes[ri].ok_or_else(|| StreamError::Layout {
                tensor: role.name(0),
                problem: "the model has no layers to stream".into(),
            })?;
            let info = WeightInfo {
                ty,
                dims: [cols, rows, slots],
            };
            let name = format!("expert_cache.{}", role.name(0).trim_start_matches("blk.0."));
            pools.push(be.alloc_weight(&name, info)?);
        }
        let slot_bytes = layers
            .first()
            .map_or(0, |l| l.roles.iter().map(|r| r.2 as u64).sum());
        tracing::info!(
            "streamed experts: {slots} slots of {:.2} MiB ({:.2} GiB)",
            slot_bytes as f64 / (1u64 << 20) as f64,
            (slot_bytes * slots as u64) as f64 / (1u64 << 30) as f64
        );
        Ok(ExpertStream {
            pools: pools.try_into().expect("three pools"),
            layers,
            cache,
            reader,
            staging: Vec::new(),
            stats: StreamStats {
                slots,
                slot_bytes,
                ..StreamStats::default()
            },
        })
    }

    /// The `[gate, up, down]` pools (the layers' routed weights in a streamed engine).
    pub fn pools(&self) -> [Weight; 3] {
        self.pools
    }

    pub fn stats(&self) -> StreamStats {
        self.stats
    }

    pub fn reset_stats(&mut self) {
        self.stats = StreamStats {
            slots: self.stats.slots,
            slot_bytes: self.stats.slot_bytes,
            ..StreamStats::default()
        };
    }

    /// Layer `layer`'s routed experts over `n_tok` tokens: like [`Backend::moe`] with the
    /// layer's tensors, `ids` holding the router's expert ids (`[n_tok, k]`; overwritten
    /// with slot numbers). Tokens whose experts do not fit in the cache at once run in
    /// consecutive runs of at least `min_run` tokens (see [`split_runs`]).
    #[allow(clippy::too_many_arguments)]
    pub fn moe(
        &mut self,
        be: &mut dyn Backend,
        layer: usize,
        x: Slice,
        ids: IBuf,
        weights: Slice,
        args: MoeArgs,
        out: Slice,
        min_run: usize,
    ) -> Result<()> {
        let (t, k) = (args.n_tok, args.k);
        let width = x.len.checked_div(t).unwrap_or(0);
        let mut host = vec![0i32; t * k];
        be.download_i32(ids, 0, &mut host)?;
        let n_expert = self.layers.get(layer).map_or(0, |l| l.n_expert);
        if let Some(&bad) = host.iter().find(|&&e| e < 0 || e as u32 >= n_expert) {
            return Err(crate::backend::BackendError::Invalid {
                op: "moe",
                problem: format!("expert id {bad} of {n_expert}"),
            }
            .into());
        }
        let runs =
            split_runs(&host, k, self.cache.n_slots(), min_run).map_err(StreamError::from)?;
        let [gate, up, down] = self.pools;
        for r in runs {
            let units: Vec<Unit> = host[r.start * k..r.end * k]
                .iter()
                .map(|&e| Unit {
                    layer: layer as u32,
                    expert: e as u32,
                })
                .collect();
            let slots = self.make_resident(be, &units)?;
            be.upload_i32(ids, 0, &slots)?;
            let n = r.len();
            let rows = |s: Slice, w: usize| s.sub(r.start * w, n * w);
            be.moe(
                rows(x, width),
                ids,
                rows(weights, k),
                gate,
                up,
                down,
                MoeArgs { n_tok: n, ..args },
                rows(out, width),
            )?;
            self.stats.runs += 1;
        }
        Ok(())
    }

    /// Acquires `units` in the cache, filling the slots of misses from the file; returns
    /// the slot of every entry. The misses are read in parallel (up to [`READERS`]
    /// threads: a disk serves several requests at once far faster than one after another),
    /// then written to the pools in order. A failed read or write forgets the call's
    /// missed units, so a later call rereads them.
    fn make_resident(&mut self, be: &mut dyn Backend, units: &[Unit]) -> Result<Vec<i32>> {
        let access = self.cache.acquire(units).map_err(StreamError::from)?;
        self.stats.lookups += units.len() as u64;
        let mut misses: Vec<(Unit, usize)> = Vec::new();
        for (&u, a) in units.iter().zip(&access) {
            match *a {
                Access::Hit(_) => self.stats.hits += 1,
                Access::Miss { slot, .. } => misses.push((u, slot as usize)),
            }
        }
        self.stats.misses += misses.len() as u64;
        if let Err(e) = self.fill(be, &misses) {
            for &(u, _) in &misses {
                self.cache.forget(u);
            }
            return Err(e);
        }
        Ok(access.iter().map(|a| a.slot() as i32).collect())
    }

    /// Reads the units of `misses` (unit, slot) and stores them in their slots.
    fn fill(&mut self, be: &mut dyn Backend, misses: &[(Unit, usize)]) -> Result<()> {
        if misses.is_empty() {
            return Ok(());
        }
        let slot_bytes = self.stats.slot_bytes as usize;
        if self.staging.len() < misses.len() * slot_bytes {
            self.staging.resize(misses.len() * slot_bytes, 0);
        }
        let t0 = Instant::now();
        {
            let (layers, reader) = (&self.layers, &self.reader);
            let bufs: Vec<&mut [u8]> = self.staging.chunks_mut(slot_bytes).collect();
            let mut jobs: Vec<(&(Unit, usize), &mut [u8])> = misses.iter().zip(bufs).collect();
            let read_one = |(u, _): &(Unit, usize), buf: &mut [u8]| -> Result<()> {
                let src = &layers[u.layer as usize];
                let mut at = 0;
                for (name, base, len) in &src.roles {
                    let offset = base + u64::from(u.expert) * *len as u64;
                    reader
                        .read(offset, &mut buf[at..at + len])
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
            };
            if jobs.len() == 1 {
                let (m, buf) = jobs.pop().expect("one job");
                read_one(m, buf)?;
            } else {
                let per = jobs.len().div_ceil(READERS);
                let results: Vec<Result<()>> = std::thread::scope(|sc| {
                    let handles: Vec<_> = jobs
                        .chunks_mut(per)
                        .map(|chunk| {
                            sc.spawn(|| chunk.iter_mut().try_for_each(|(m, buf)| read_one(m, buf)))
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| {
                            h.join().unwrap_or_else(|_| {
                                Err(StreamError::Layout {
                                    tensor: "expert reader".into(),
                                    problem: "a reader thread panicked".into(),
                                }
                                .into())
                            })
                        })
                        .collect()
                });
                results.into_iter().collect::<Result<()>>()?;
            }
        }
        let t1 = Instant::now();
        for (i, &(u, slot)) in misses.iter().enumerate() {
            let buf = &self.staging[i * slot_bytes..(i + 1) * slot_bytes];
            let mut at = 0;
            for (ri, (_, _, len)) in self.layers[u.layer as usize].roles.iter().enumerate() {
                be.write_weight_mat(self.pools[ri], slot, &buf[at..at + len])?;
                at += len;
            }
            self.stats.bytes_read += at as u64;
        }
        self.stats.read_secs += (t1 - t0).as_secs_f64();
        self.stats.write_secs += t1.elapsed().as_secs_f64();
        Ok(())
    }
}
