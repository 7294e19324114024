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
//!
//! Reads go through a host tier ([`crate::expert_host`]) whose reader threads also fetch
//! the next layer's *predicted* units while the current layer computes: before a layer's
//! `moe`, [`ExpertStream::predict`] runs the next layer's router on this layer's input
//! (exact for hash-routed layers, whose experts depend only on the token), and `moe`
//! starts reading what that prediction names after the layer's own reads are queued.

use std::fs::File;
use std::sync::Arc;
use std::time::Instant;

use ds4_gguf::{GgmlType, GgufFile};
use ds4_model::{LayerTensor, ModelSpec};

use crate::backend::{
    Backend, Buf, IBuf, MoeArgs, RouterArgs, Routing, SlabMat, Slice, Weight, WeightInfo,
};
use crate::error::{EngineError, Result};
use crate::expert_cache::{split_runs, Access, CacheError, ExpertCache, Unit};
use crate::expert_host::{HostStats, HostTier, LayerSource, Reader, Source};
use crate::weights::LayerWeights;

/// How routed experts are placed when an engine is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertPlacement {
    /// Every routed tensor loaded whole, like every other weight.
    #[default]
    Resident,
    /// Routed tensors stay in the file and are read into an expert cache.
    Streamed(StreamConfig),
}

impl ExpertPlacement {
    /// Streamed through a cache of `slots` units, the smallest host tier, read-ahead on.
    pub fn streamed(slots: usize) -> ExpertPlacement {
        ExpertPlacement::Streamed(StreamConfig {
            slots,
            host_slots: 0,
            readahead: true,
        })
    }
}

/// Sizes and switches of a streamed engine (docs/placement.md §9).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamConfig {
    /// Units in the cache the `moe` reads from (device memory on a discrete GPU).
    pub slots: usize,
    /// Units in the host tier; raised to [`MIN_HOST_SLOTS`] (the tier holds every read
    /// in flight, so it always exists).
    pub host_slots: usize,
    /// Read the next layer's predicted experts while a layer computes.
    pub readahead: bool,
}

/// Smallest host tier: room for a decode layer's reads plus the next layer's read-ahead
/// at the largest prediction ([`PREDICT_ROWS`] tokens would need more; read-ahead then
/// takes the first units that fit).
pub const MIN_HOST_SLOTS: usize = 32;

/// Calls of at most this many tokens predict the next layer's experts (decode steps and
/// batched decode); a longer prefill chunk touches most experts of a layer anyway.
pub const PREDICT_ROWS: usize = 16;

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
    #[error("host memory of streamed experts: {0}")]
    Backend(#[from] crate::backend::BackendError),
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
    /// Units the cache had to be given (from the host tier or the file).
    pub misses: u64,
    /// Of the misses, those found in the host tier (already read, or on their way).
    pub host_hits: u64,
    /// Units read from the file (demand and read-ahead) and their bytes.
    pub reads: u64,
    pub bytes_read: u64,
    /// Units the read-ahead asked for, and how many of them a miss then used.
    pub readahead_reads: u64,
    pub readahead_used: u64,
    /// Predicted (layer, expert) entries, and how many the router then chose.
    pub predicted: u64,
    pub predicted_right: u64,
    /// Host tier units.
    pub host_slots: usize,
    /// Host tier buffers allocated so far, and how many of them are page-locked (the
    /// backend's copy engine reads those without a staging copy or a host wait).
    pub host_buffers: u64,
    pub host_pinned: u64,
    /// Seconds spent waiting for reads, and in writing slots on the backend.
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
    /// Fraction of predicted entries the router then chose.
    pub fn prediction_accuracy(&self) -> f64 {
        if self.predicted == 0 {
            0.0
        } else {
            self.predicted_right as f64 / self.predicted as f64
        }
    }
}

/// The streamed experts of one engine: pools, cache, file and counters.
pub struct ExpertStream {
    /// `[gate, up, down]` pool weights (`slots` matrices each).
    pools: [Weight; 3],
    source: Arc<Source>,
    cache: ExpertCache,
    host: HostTier,
    /// Device buffers of the next layer's predicted routing, when read-ahead is on.
    predict: Option<Prediction>,
    stats: StreamStats,
}

/// Where [`ExpertStream::predict`] leaves the next layer's predicted experts.
#[derive(Debug)]
struct Prediction {
    logits: Buf,
    ids: IBuf,
    weights: Buf,
    /// The layer and token count of the prediction made for the coming `moe`, if any.
    pending: Option<(usize, usize)>,
    /// The last prediction on the host (layer, ids), scored when that layer's router runs.
    scored: Option<(usize, Vec<i32>)>,
}

impl std::fmt::Debug for ExpertStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertStream")
            .field("slots", &self.cache.n_slots())
            .field("stats", &self.stats)
            .finish()
    }
}

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
        cfg: StreamConfig,
    ) -> Result<ExpertStream> {
        let slots = cfg.slots;
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
        let host_slots = cfg.host_slots.max(MIN_HOST_SLOTS);
        let gib = |units: usize| (slot_bytes * units as u64) as f64 / (1u64 << 30) as f64;
        tracing::info!(
            "streamed experts: {slots} slots of {:.2} MiB ({:.2} GiB), host tier {host_slots} units ({:.2} GiB), read-ahead {}",
            slot_bytes as f64 / (1u64 << 20) as f64,
            gib(slots),
            gib(host_slots),
            if cfg.readahead { "on" } else { "off" }
        );
        let source = Arc::new(Source { layers, reader });
        let host = HostTier::new(Arc::clone(&source), host_slots, slot_bytes as usize)?;
        let predict = if cfg.readahead {
            let rows = PREDICT_ROWS;
            Some(Prediction {
                logits: be.alloc(rows * hp.n_expert)?,
                ids: be.alloc_i32(rows * hp.n_expert_used)?,
                weights: be.alloc(rows * hp.n_expert_used)?,
                pending: None,
                scored: None,
            })
        } else {
            None
        };
        Ok(ExpertStream {
            pools: pools.try_into().expect("three pools"),
            source,
            cache,
            host,
            predict,
            stats: StreamStats {
                slots,
                slot_bytes,
                host_slots,
                ..StreamStats::default()
            },
        })
    }

    /// The `[gate, up, down]` pools (the layers' routed weights in a streamed engine).
    pub fn pools(&self) -> [Weight; 3] {
        self.pools
    }

    pub fn stats(&self) -> StreamStats {
        let h = self.host.stats;
        StreamStats {
            reads: h.reads,
            bytes_read: h.bytes_read,
            readahead_reads: h.readahead_reads,
            readahead_used: h.readahead_used,
            host_buffers: h.buffers,
            host_pinned: h.pinned,
            ..self.stats
        }
    }

    pub fn reset_stats(&mut self) {
        self.stats = StreamStats {
            slots: self.stats.slots,
            slot_bytes: self.stats.slot_bytes,
            host_slots: self.stats.host_slots,
            ..StreamStats::default()
        };
        // Allocation counts describe the tier, not a measured phase: they stay.
        let h = self.host.stats;
        self.host.stats = HostStats {
            buffers: h.buffers,
            pinned: h.pinned,
            ..HostStats::default()
        };
    }

    /// Frees the prediction buffers on `be` (the pools are freed with the weights) and
    /// takes back the host buffers `be` still holds, so they are freed with the tier.
    pub fn free(&mut self, be: &mut dyn Backend) {
        if let Err(e) = self.host.reclaim(be, true) {
            tracing::warn!("streamed experts: host buffers not taken back: {e}");
        }
        if let Some(p) = self.predict.take() {
            be.free(p.logits);
            be.free(p.weights);
            be.free_i32(p.ids);
        }
    }

    /// Predicts layer `next`'s experts for the `n_tok` rows of `a` (this layer's routed
    /// input) by running `next`'s router on it, so the coming [`Self::moe`] can start
    /// reading them. Hash-routed layers are predicted exactly (their experts depend only
    /// on `tokens`); a top-k layer's prediction is a guess from the previous layer's
    /// activations, which change little from one layer to the next. Does nothing when
    /// read-ahead is off or the call has more than [`PREDICT_ROWS`] tokens.
    #[allow(clippy::too_many_arguments)]
    pub fn predict(
        &mut self,
        be: &mut dyn Backend,
        next: usize,
        lw: &LayerWeights,
        a: Slice,
        tokens: IBuf,
        args: RouterArgs,
    ) -> Result<()> {
        let Some(p) = self.predict.as_mut() else {
            return Ok(());
        };
        p.pending = None;
        let t = args.n_tok;
        if t == 0 || t > PREDICT_ROWS {
            return Ok(());
        }
        let logits = p.logits.rows(0, t, args.n_expert);
        be.matmul(lw.router, 0, a, t, logits)?;
        let routing = match lw.tid2eid {
            Some(table) => Routing::Hash { table, tokens },
            None => Routing::TopK {
                bias: lw.router_bias,
            },
        };
        let weights = p.weights.rows(0, t, args.k);
        be.router(logits, routing, args, p.ids, weights)?;
        p.pending = Some((next, t));
        Ok(())
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
        let n_expert = self.source.layers.get(layer).map_or(0, |l| l.n_expert);
        if let Some(&bad) = host.iter().find(|&&e| e < 0 || e as u32 >= n_expert) {
            return Err(crate::backend::BackendError::Invalid {
                op: "moe",
                problem: format!("expert id {bad} of {n_expert}"),
            }
            .into());
        }
        let mut readahead = self.take_prediction(be, layer, &host, k)?;
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
            let slots = self.make_resident(be, &units, std::mem::take(&mut readahead))?;
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

    /// Scores the prediction made for `layer` against its router's `ids`, and returns the
    /// units of the prediction [`Self::predict`] just made for the next layer that neither
    /// cache tier holds (the read-ahead of this call).
    fn take_prediction(
        &mut self,
        be: &mut dyn Backend,
        layer: usize,
        ids: &[i32],
        k: usize,
    ) -> Result<Vec<Unit>> {
        let Some(p) = self.predict.as_mut() else {
            return Ok(Vec::new());
        };
        if let Some((l, guess)) = p.scored.take() {
            if l == layer && guess.len() == ids.len() {
                for (g, row) in guess.chunks(k.max(1)).zip(ids.chunks(k.max(1))) {
                    self.stats.predicted += g.len() as u64;
                    self.stats.predicted_right +=
                        g.iter().filter(|e| row.contains(e)).count() as u64;
                }
            }
        }
        let Some((next, t)) = p.pending.take() else {
            return Ok(Vec::new());
        };
        let mut guess = vec![0i32; t * k];
        be.download_i32(p.ids, 0, &mut guess)?;
        let n_expert = self.source.layers.get(next).map_or(0, |l| l.n_expert);
        let mut units: Vec<Unit> = Vec::new();
        for &e in &guess {
            if e < 0 || e as u32 >= n_expert {
                continue;
            }
            let u = Unit {
                layer: next as u32,
                expert: e as u32,
            };
            if self.cache.slot_of(u).is_none() && !self.host.contains(u) && !units.contains(&u) {
                units.push(u);
            }
        }
        p.scored = Some((next, guess));
        Ok(units)
    }

    /// Acquires `units` in the cache, filling the slots of misses through the host tier;
    /// returns the slot of every entry. The misses' reads are queued first, then
    /// `readahead`'s, so the reader threads serve this layer before the next. A failed
    /// read or write forgets the call's missed units, so a later call rereads them.
    fn make_resident(
        &mut self,
        be: &mut dyn Backend,
        units: &[Unit],
        readahead: Vec<Unit>,
    ) -> Result<Vec<i32>> {
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
        if let Err(e) = self.fill(be, &misses, readahead) {
            for &(u, _) in &misses {
                self.cache.forget(u);
            }
            return Err(e);
        }
        Ok(access.iter().map(|a| a.slot() as i32).collect())
    }

    /// Brings the units of `misses` (unit, cache slot) into the host tier and writes them
    /// to their slots, in chunks of half the tier; the read-ahead is queued behind the
    /// last chunk's reads, in the room that chunk leaves.
    fn fill(
        &mut self,
        be: &mut dyn Backend,
        misses: &[(Unit, usize)],
        readahead: Vec<Unit>,
    ) -> Result<()> {
        let n_host = self.host.n_slots();
        // Buffers whose copies have completed (the router's ids came back since: a host
        // wait) return to the tier before any is needed.
        self.host.reclaim(be, false)?;
        let chunk = (n_host / 2).max(1);
        let n_chunks = misses.len().div_ceil(chunk);
        let mut readahead = Some(readahead);
        for (ci, ch) in misses.chunks(chunk).enumerate() {
            let units: Vec<Unit> = ch.iter().map(|m| m.0).collect();
            let held = units.iter().filter(|&&u| self.host.contains(u)).count();
            self.stats.host_hits += held as u64;
            self.host.request(be, &units, false, n_host)?;
            // Behind the last chunk's reads: no later chunk of this call can evict it.
            if ci + 1 == n_chunks {
                if let Some(ra) = readahead.take() {
                    self.host.request(be, &ra, true, n_host - units.len())?;
                }
            }
            for &(u, slot) in ch {
                let t0 = Instant::now();
                let mut at = 0;
                let mut mats = Vec::with_capacity(3);
                for (ri, (_, _, len)) in self.source.layers[u.layer as usize]
                    .roles
                    .iter()
                    .enumerate()
                {
                    mats.push(SlabMat {
                        weight: self.pools[ri],
                        mat: slot,
                        range: at..at + len,
                    });
                    at += len;
                }
                let read = self.host.store(be, u, &mats)?;
                self.stats.read_secs += read.as_secs_f64();
                self.stats.write_secs += (t0.elapsed() - read).as_secs_f64();
            }
        }
        if let Some(ra) = readahead {
            self.host.request(be, &ra, true, n_host)?;
        }
        Ok(())
    }
}
