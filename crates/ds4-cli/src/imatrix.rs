//! `ds4 imatrix`: the routed-expert activation statistics of a text, collected with this
//! engine on the backend `--backend` chooses (CPU, CUDA or ROCm), written as llama.cpp's
//! legacy `.dat` importance matrix that `ds4-convert --imatrix` reads (docs/gguf.md §5.4).
//!
//! A [`Collecting`] backend wraps the backend the runtime loads (`ds4_runtime::load`, the
//! same plan, settings and report as `ds4`) and forwards every op unchanged; on each
//! routed-expert call ([`Backend::moe`]) it also reads the input rows and the expert ids and
//! adds, per expert, the squares of the inputs each matrix of that expert sees: `x` for the
//! gate and up matrices, `SwiGLU(W1·x, W3·x)` (before the routing weight) for the down matrix,
//! which it recomputes through the wrapped backend for the rows routed to the expert. Only
//! the routed experts are collected: they are the only tensors ds4's recipes quantize with
//! importance (Q8_0, F16 and F32 take none). The text is cut into chunks of `--ctx` tokens,
//! each evaluated from an empty state, as `ds4 perplexity` does.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use ds4_chat::SpecialTokens;
use ds4_convert::imatrix::{Collector, Imatrix};
use ds4_engine::backend::*;
use ds4_engine::device::Forward;
use ds4_engine::{Engine, Logits};
use ds4_gguf::GgufFile;
use ds4_runtime::load::LoadOptions;

/// A backend that forwards every op to `inner` and records the routed experts' inputs.
///
/// It reads the inputs back from wherever the wrapped backend keeps them, through
/// [`Backend::download`] / [`Backend::download_i32`]: on a GPU the rows, the expert ids and
/// the recomputed SwiGLU rows live in device memory, and these are the only calls that copy
/// them to the host (waiting for the queued work first). That costs a host wait and
/// `T · (cols + k + k · ff)` floats per layer and chunk — on Flash at `--ctx 512` about 33 MB
/// per layer, a few tens of milliseconds per chunk over PCIe — which is acceptable because
/// `ds4 imatrix` is an offline collection run once per model, and the host's sums of squares
/// over the same values (`T · k · (2 · cols + ff)` multiply-adds per layer) cost more than
/// the copies.
pub struct Collecting {
    inner: Box<dyn Backend>,
    names: HashMap<u32, String>,
    stats: Arc<Mutex<Collector>>,
    /// Whether the wrapped backend runs one-row matmuls with int8 activations
    /// ([`Backend::set_activation_q8`]), as last set through this wrapper or as the loader
    /// set it before wrapping.
    q8: bool,
}

impl Collecting {
    /// Wraps `inner`, adding to `stats`. `q8` is the int8-activation setting `inner` has
    /// now (the runtime sets it before the wrapper is put around the backend).
    pub fn new(inner: Box<dyn Backend>, stats: Arc<Mutex<Collector>>, q8: bool) -> Collecting {
        Collecting {
            inner,
            names: HashMap::new(),
            stats,
            q8,
        }
    }

    fn name(&self, w: Weight) -> String {
        self.names
            .get(&w.id())
            .cloned()
            .unwrap_or_else(|| format!("weight#{}", w.id()))
    }

    /// The statistics of one routed call: `x [T, cols]`, `ids [T, k]`.
    ///
    /// The SwiGLU rows are recomputed with f32 activations: a prefill's `moe` call has
    /// many rows and runs in f32 whatever the precision, while an expert that one token
    /// reached would otherwise get a one-row matmul with int8 activations, and the
    /// statistics would be of the rounding rather than of what the down matrix saw.
    #[allow(clippy::too_many_arguments)]
    fn record(
        &mut self,
        x: Slice,
        ids: IBuf,
        gate: Weight,
        up: Weight,
        down: Weight,
        args: MoeArgs,
    ) -> BResult<()> {
        let (t, k) = (args.n_tok, args.k);
        let cols = gate.info.cols();
        let (ff, n_exp) = (gate.info.rows(), gate.info.mats());
        if t == 0 || k == 0 || cols == 0 || x.len < t * cols || ids.len() < t * k {
            return Ok(());
        }
        let mut xs = vec![0f32; t * cols];
        self.inner.download(x.sub(0, t * cols), &mut xs)?;
        let mut eids = vec![0i32; t * k];
        self.inner.download_i32(ids, 0, &mut eids)?;
        // Rows per expert, in token order.
        let mut rows: Vec<Vec<usize>> = vec![Vec::new(); n_exp];
        for (i, &e) in eids.iter().enumerate() {
            if e >= 0 && (e as usize) < n_exp {
                rows[e as usize].push(i / k);
            }
        }
        // Every routed row once, grouped by expert: one upload, one download, four
        // buffers per call (not per expert: allocations and copies are what a GPU pays).
        let n: usize = rows.iter().map(Vec::len).sum();
        if n == 0 {
            return Ok(());
        }
        let mut xe = Vec::with_capacity(n * cols);
        for toks in &rows {
            for &tk in toks {
                xe.extend_from_slice(&xs[tk * cols..(tk + 1) * cols]);
            }
        }
        let h = self.swiglu_rows(&rows, &xe, gate, up, args.clamp)?;
        let (gname, uname, dname) = (self.name(gate), self.name(up), self.name(down));
        let mut st = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        let mut r0 = 0;
        for (e, toks) in rows.iter().enumerate() {
            for r in r0..r0 + toks.len() {
                let row = &xe[r * cols..(r + 1) * cols];
                st.add(&gname, Some((e, n_exp)), row);
                st.add(&uname, Some((e, n_exp)), row);
                st.add(&dname, Some((e, n_exp)), &h[r * ff..(r + 1) * ff]);
            }
            r0 += toks.len();
        }
        Ok(())
    }

    /// `SwiGLU(W1_e·x, W3_e·x)` of the rows `xe` (grouped by expert as `rows` lists them),
    /// computed by the wrapped backend with f32 activations; the int8 setting is put back
    /// whatever happens.
    fn swiglu_rows(
        &mut self,
        rows: &[Vec<usize>],
        xe: &[f32],
        gate: Weight,
        up: Weight,
        clamp: f32,
    ) -> BResult<Vec<f32>> {
        let (cols, ff) = (gate.info.cols(), gate.info.rows());
        let n = xe.len() / cols;
        if self.q8 {
            self.inner.set_activation_q8(false)?;
        }
        let mut bufs = Vec::new();
        let res = (|| -> BResult<Vec<f32>> {
            for len in [n * cols, n * ff, n * ff, n * ff] {
                bufs.push(self.inner.alloc(len)?);
            }
            let (xb, gb, ub, hb) = (bufs[0], bufs[1], bufs[2], bufs[3]);
            self.inner.upload(xb.all(), xe)?;
            let mut r0 = 0;
            for (e, toks) in rows.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
                let m = toks.len();
                let (xs, g, u, h) = (
                    xb.rows(r0, m, cols),
                    gb.rows(r0, m, ff),
                    ub.rows(r0, m, ff),
                    hb.rows(r0, m, ff),
                );
                self.inner.matmul(gate, e, xs, m, g)?;
                self.inner.matmul(up, e, xs, m, u)?;
                self.inner.swiglu(g, u, clamp, h)?;
                r0 += m;
            }
            let mut h = vec![0f32; n * ff];
            self.inner.download(hb.all(), &mut h)?;
            Ok(h)
        })();
        for b in bufs {
            self.inner.free(b);
        }
        if self.q8 {
            self.inner.set_activation_q8(true)?;
        }
        res
    }
}

impl Forward for Collecting {
    fn inner(&self) -> &dyn Backend {
        &*self.inner
    }
    fn inner_mut(&mut self) -> &mut dyn Backend {
        &mut *self.inner
    }
    fn name(&self) -> String {
        format!("{}+imatrix", self.inner.name())
    }
    fn load_weight(
        &mut self,
        file: &Arc<GgufFile>,
        name: &str,
        usage: WeightUse,
    ) -> BResult<Weight> {
        let w = self.inner.load_weight(file, name, usage)?;
        self.names.insert(w.id(), name.to_string());
        Ok(w)
    }
    fn load_weights(
        &mut self,
        file: &Arc<GgufFile>,
        list: &[(String, WeightUse)],
    ) -> BResult<Vec<Weight>> {
        let ws = self.inner.load_weights(file, list)?;
        for (w, (n, _)) in ws.iter().zip(list) {
            self.names.insert(w.id(), n.clone());
        }
        Ok(ws)
    }
    fn alloc_weight(&mut self, name: &str, info: WeightInfo) -> BResult<Weight> {
        let w = self.inner.alloc_weight(name, info)?;
        self.names.insert(w.id(), name.to_string());
        Ok(w)
    }
    fn set_activation_q8(&mut self, on: bool) -> BResult<()> {
        self.inner.set_activation_q8(on)?;
        self.q8 = on;
        Ok(())
    }
    fn moe(
        &mut self,
        x: Slice,
        ids: IBuf,
        weights: Slice,
        gate: Weight,
        up: Weight,
        down: Weight,
        args: MoeArgs,
        out: Slice,
    ) -> BResult<()> {
        self.inner.moe(x, ids, weights, gate, up, down, args, out)?;
        self.record(x, ids, gate, up, down, args)
    }
}

/// Evaluates every whole chunk of `ctx` tokens of `tokens` from an empty state on
/// `engine`, whose backend is a [`Collecting`] adding to `stats`, and returns the
/// importance matrix of those chunks (`dataset` is the name the file records). The
/// collector is emptied first, so what the load's warm-up ran through it is not counted.
pub fn collect(
    engine: &mut Engine,
    stats: &Mutex<Collector>,
    tokens: &[u32],
    ctx: usize,
    dataset: &str,
    log: &mut dyn std::io::Write,
) -> anyhow::Result<Imatrix> {
    if ctx == 0 {
        bail!("a chunk of 0 tokens");
    }
    let n_chunks = tokens.len() / ctx;
    *stats.lock().unwrap_or_else(|p| p.into_inner()) = Collector::default();
    let mut state = engine.new_state_with_ctx(ctx)?;
    for (i, chunk) in tokens.chunks_exact(ctx).enumerate() {
        engine.reset_state(&mut state)?;
        engine.eval(&mut state, chunk, Logits::None, None)?;
        writeln!(log, "ds4 imatrix: chunk {}/{n_chunks}", i + 1)?;
    }
    let st = stats.lock().unwrap_or_else(|p| p.into_inner());
    Ok(st.finish(i32::try_from(n_chunks).unwrap_or(i32::MAX), dataset))
}

/// What `ds4 imatrix` was asked (the model and backend are in the [`LoadOptions`]).
pub struct Request {
    pub file: PathBuf,
    pub out: PathBuf,
    pub ctx: usize,
    pub chunks: Option<usize>,
}

/// Runs the text through the model loaded as `load` says (backend, mode, placement,
/// settings; its context and prefill chunk are this request's) and writes the importance
/// matrix. Returns the number of chunks and entries.
///
/// The routed experts must be resident: a streamed plan (docs/placement.md §9) hands the
/// `moe` op slot numbers of an expert cache instead of expert ids, so the plan is made with
/// `--experts resident` and an explicit `--experts stream` is refused.
pub fn run(
    req: &Request,
    load: &LoadOptions,
    log: &mut dyn std::io::Write,
) -> anyhow::Result<(usize, usize)> {
    if req.ctx < 2 {
        bail!("--ctx {} is too small", req.ctx);
    }
    if req.chunks == Some(0) {
        bail!("--chunks 0: nothing to evaluate");
    }
    let mut placement = load.placement.clone();
    match placement.experts.as_deref() {
        None | Some("auto") | Some("resident") => placement.experts = Some("resident".into()),
        Some(other) => bail!(
            "ds4 imatrix needs the routed experts resident (--experts {other} was given): with \
             streamed experts the moe op sees cache slots instead of expert ids"
        ),
    }
    let text = std::fs::read_to_string(&req.file)
        .with_context(|| format!("reading {} (UTF-8 text)", req.file.display()))?;
    let file = ds4_runtime::load::open_gguf(&load.model)?;
    let tok = ds4_runtime::load::tokenizer_from_gguf(&file)
        .with_context(|| format!("{}: no usable vocabulary", load.model.display()))?;
    drop(file);
    let mut tokens = tok
        .encode_with(&text, SpecialTokens::None)
        .with_context(|| format!("tokenizing {}", req.file.display()))?;
    let mut n_chunks = tokens.len() / req.ctx;
    if let Some(c) = req.chunks {
        n_chunks = n_chunks.min(c);
    }
    if n_chunks == 0 {
        bail!(
            "{} is {} tokens long; one chunk of --ctx {} needs {} (use a longer text or a smaller --ctx)",
            req.file.display(),
            tokens.len(),
            req.ctx,
            req.ctx
        );
    }
    tokens.truncate(n_chunks * req.ctx);
    let opts = LoadOptions {
        ctx: req.ctx,
        kv_states: 1,
        prefill_chunk: load.prefill_chunk.min(req.ctx).max(1),
        placement,
        ..load.clone()
    };
    let stats = Arc::new(Mutex::new(Collector::default()));
    let q8 = opts.config.precision.value.activation_q8();
    let mut loaded = ds4_runtime::load::load_wrapped(&opts, log, &mut |be| {
        Box::new(Collecting::new(be, stats.clone(), q8))
    })?;
    if loaded.engine.expert_stats().is_some() {
        bail!("ds4 imatrix needs the routed experts resident, but the model was loaded with streamed experts");
    }
    let dataset = req
        .file
        .file_name()
        .map_or_else(String::new, |f| f.to_string_lossy().into_owned());
    let im = collect(&mut loaded.engine, &stats, &tokens, req.ctx, &dataset, log)?;
    drop(loaded);
    im.write(&req.out)?;
    Ok((n_chunks, im.entries.len()))
}
