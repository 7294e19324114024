//! `ds4 imatrix`: the routed-expert activation statistics of a text, collected with this
//! engine, written as llama.cpp's legacy `.dat` importance matrix that `ds4-convert
//! --imatrix` reads (docs/gguf.md §5.4).
//!
//! A [`Collecting`] backend wraps the CPU backend and forwards every op unchanged; on each
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
use ds4_convert::imatrix::Collector;
use ds4_engine::backend::*;
use ds4_engine::device::Forward;
use ds4_engine::{Engine, EngineConfig, Logits};
use ds4_gguf::GgufFile;

/// A backend that forwards every op to `inner` and records the routed experts' inputs.
pub struct Collecting {
    inner: Box<dyn Backend>,
    names: HashMap<u32, String>,
    stats: Arc<Mutex<Collector>>,
}

impl Collecting {
    pub fn new(inner: Box<dyn Backend>, stats: Arc<Mutex<Collector>>) -> Collecting {
        Collecting {
            inner,
            names: HashMap::new(),
            stats,
        }
    }

    fn name(&self, w: Weight) -> String {
        self.names
            .get(&w.id())
            .cloned()
            .unwrap_or_else(|| format!("weight#{}", w.id()))
    }

    /// The statistics of one routed call: `x [T, cols]`, `ids [T, k]`.
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
        if t == 0 || cols == 0 || x.len < t * cols {
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
        let (gname, uname, dname) = (self.name(gate), self.name(up), self.name(down));
        for (e, toks) in rows.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
            let m = toks.len();
            let mut xe = Vec::with_capacity(m * cols);
            for &tk in toks {
                xe.extend_from_slice(&xs[tk * cols..(tk + 1) * cols]);
            }
            let xb = self.inner.alloc(m * cols)?;
            let (gb, ub, hb) = (
                self.inner.alloc(m * ff)?,
                self.inner.alloc(m * ff)?,
                self.inner.alloc(m * ff)?,
            );
            let s = |b: Buf, n: usize| Slice {
                buf: b,
                off: 0,
                len: n,
            };
            self.inner.upload(s(xb, m * cols), &xe)?;
            self.inner
                .matmul(gate, e, s(xb, m * cols), m, s(gb, m * ff))?;
            self.inner
                .matmul(up, e, s(xb, m * cols), m, s(ub, m * ff))?;
            self.inner
                .swiglu(s(gb, m * ff), s(ub, m * ff), args.clamp, s(hb, m * ff))?;
            let mut h = vec![0f32; m * ff];
            self.inner.download(s(hb, m * ff), &mut h)?;
            for b in [xb, gb, ub, hb] {
                self.inner.free(b);
            }
            let mut st = self.stats.lock().unwrap_or_else(|p| p.into_inner());
            for (row, hrow) in xe.chunks_exact(cols).zip(h.chunks_exact(ff)) {
                st.add(&gname, Some((e, n_exp)), row);
                st.add(&uname, Some((e, n_exp)), row);
                st.add(&dname, Some((e, n_exp)), hrow);
            }
        }
        Ok(())
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

/// What `ds4 imatrix` was asked.
pub struct Request {
    pub model: PathBuf,
    pub file: PathBuf,
    pub out: PathBuf,
    pub ctx: usize,
    pub chunks: Option<usize>,
    pub threads: usize,
}

/// Runs the text through the model on the CPU and writes the importance matrix. Returns the
/// number of chunks and entries.
pub fn run(req: &Request, log: &mut dyn std::io::Write) -> anyhow::Result<(usize, usize)> {
    if req.ctx < 2 {
        bail!("--ctx {} is too small", req.ctx);
    }
    let text = std::fs::read_to_string(&req.file)
        .with_context(|| format!("reading {} (UTF-8 text)", req.file.display()))?;
    let file = Arc::new(
        GgufFile::open(&req.model).with_context(|| format!("opening {}", req.model.display()))?,
    );
    let tok = ds4_runtime::load::tokenizer_from_gguf(&file)
        .with_context(|| format!("{}: no usable vocabulary", req.model.display()))?;
    let tokens = tok
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
    let stats = Arc::new(Mutex::new(Collector::default()));
    let cpu = ds4_cpu::CpuBackend::new(req.threads)?;
    let be = Box::new(Collecting::new(Box::new(cpu), stats.clone()));
    let cfg = EngineConfig {
        mode: None,
        ctx: req.ctx,
        prefill_chunk: req.ctx,
    };
    let mut engine = Engine::load(file, be, cfg)?;
    let mut state = engine.new_state_with_ctx(req.ctx)?;
    for (i, chunk) in tokens.chunks_exact(req.ctx).take(n_chunks).enumerate() {
        engine.reset_state(&mut state)?;
        engine.eval(&mut state, chunk, Logits::None, None)?;
        writeln!(log, "ds4 imatrix: chunk {}/{n_chunks}", i + 1)?;
    }
    drop(engine);
    let dataset = req
        .file
        .file_name()
        .map_or_else(String::new, |f| f.to_string_lossy().into_owned());
    let im = stats
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .finish(n_chunks as i32, &dataset);
    im.write(&req.out)?;
    Ok((n_chunks, im.entries.len()))
}
