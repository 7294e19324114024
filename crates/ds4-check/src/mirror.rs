//! `Mirror`: a backend that runs every op on a reference backend and on a candidate
//! backend and compares the outputs op by op — the kernel test of `ds4-engine-check ops`
//! (the CPU reference against CUDA; any two `Backend`s work, e.g. the CPU against HIP, or
//! the CPU against itself in tests).
//!
//! Why a mirror instead of hand-made inputs per kernel: driven by the real forward pass on
//! random models and random tokens, every op sees the shapes, strides, positions and value
//! ranges it meets in a model (window roll-over, compressed rows appearing, hash and top-k
//! routing, chunk boundaries), and a wrong kernel is named the moment it first diverges.
//!
//! Per op: candidate outputs that are not also inputs are first poisoned with NaN (so an
//! element a kernel forgets to write fails), both backends run, the outputs are compared
//! (relative error = max |candidate − reference| / max |reference|; NaN never passes), and
//! the reference result is copied into the candidate's buffer so the next op starts from
//! identical inputs.
//!
//! Naming inside: `c*` helpers map a mirror handle to the reference side, `g*` to the
//! candidate side (historically CPU and GPU).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use ds4_engine::backend::{
    AttnArgs, BResult, Backend, BackendError, BandJob, Buf, CompSel, CompressorArgs,
    CompressorCall, HcArgs, HcPost, IBuf, IndexerArgs, IndexerCall, MatmulPair, MoeArgs,
    NormRopeCall, RingStoreCall, RopeArgs, RouterArgs, Routing, Slice, Weight, WeightInfo,
    WeightUse,
};
use ds4_engine::device::Device;
use ds4_gguf::GgufFile;

/// The per-op verdict of a mirrored run between the CPU backend and a GPU backend (shared
/// by `ds4-engine-check ops` and the emulated-GPU tests, so both judge alike).
#[derive(Debug, Clone, Copy)]
pub struct OpRule {
    pub mode: ds4_engine::NumericMode,
    /// Int8 activations on both sides.
    pub act_q8: bool,
    /// Which multi-token matmuls the GPU ran on half-precision tiles.
    pub tiles: ds4_gpu::backend::PrefillTiles,
    /// Prefill attention on half operands (`ds4_attention_mma`,
    /// `Knobs::tensor_core_attention`).
    pub attn_half: bool,
}

impl OpRule {
    /// Per-op tolerance in exact mode (the CPU-vs-HF tolerance) ...
    pub const TOL_EXACT: f64 = crate::parity::TOL_EXACT;
    /// ... and in official mode. Each op starts from identical inputs in the mirror, so a
    /// rounding flip cannot propagate there; whole-model parity in official mode is judged
    /// by the reordered bound instead (`crate::parity`).
    pub const TOL_OFFICIAL: f64 = 1e-3;
    /// With int8 activations, `moe` and `swiglu_matmul` requantize a value they computed
    /// themselves (the down projection's input: SwiGLU, times the route weight in `moe`):
    /// the two sides differ there by f32 rounding, so a value on a rounding boundary may
    /// take the next int8 code on one side, which moves that output by one code step of
    /// its block (observed a few 1e-4 of the output scale in `moe` and the shared expert's
    /// `swiglu_matmul` with a seed that hit a boundary; BENCHMARKS.md, 2026-12-06).
    /// Every other matmul quantizes identical inputs.
    pub const TOL_Q8_REQUANT: f64 = 2e-3;
    /// Matmuls on half-precision tiles: rounding both operands to 11 significant bits moves
    /// each product by ≤ 2⁻¹⁰ of itself; summed with random signs that is a few 1e-4 of
    /// the output's scale (an indexing or decoding bug is O(1)).
    pub const TOL_TILES: f64 = 3e-3;

    /// The tolerance of `op` (relative to the output's largest value).
    pub fn tolerance(&self, op: &str) -> f64 {
        use ds4_gpu::backend::PrefillTiles;
        let mut tol = if self.mode == ds4_engine::NumericMode::Exact {
            Self::TOL_EXACT
        } else {
            Self::TOL_OFFICIAL
        };
        if self.act_q8 && (op == "moe" || op == "swiglu_matmul") {
            tol = tol.max(Self::TOL_Q8_REQUANT);
        }
        // Ops that end in (or are) a dense matmul: the fused HCPre runs its mixing matmul
        // as a matmul in prefill passes, `swiglu_matmul` is the shared expert's down,
        // `rms_norm_matmul` the query's up-projection, `rope_matmul_grouped` out_a.
        let dense = op.starts_with("matmul")
            || op == "swiglu_matmul"
            || op == "rms_norm_matmul"
            || op == "rope_matmul_grouped"
            || op == "hc_mix_pre_norm"
            || op == "hc_post_mix_pre_norm";
        let tiled = match self.tiles {
            PrefillTiles::Off => false,
            PrefillTiles::Experts => op == "moe",
            PrefillTiles::All => dense || op == "moe",
        };
        if tiled || (self.attn_half && op == "attention") {
            tol = tol.max(Self::TOL_TILES);
        }
        tol
    }

    /// Whether `op`'s statistics pass: under its tolerance, no NaN, and identical integer
    /// outputs (except the indexer's top-k, where equal scores may tie differently).
    pub fn passes(&self, op: &str, s: &OpStat) -> bool {
        let int_ok = s.int_mismatches == 0 || op == "indexer_topk" || op == "indexer_topk_batch";
        s.max_rel <= self.tolerance(op) && s.nan == 0 && int_ok
    }
}

/// What one op did over a run.
#[derive(Debug, Clone, Default)]
pub struct OpStat {
    pub calls: usize,
    pub max_rel: f64,
    /// Integer outputs (expert ids, selections) that differed.
    pub int_mismatches: usize,
    pub nan: usize,
}

/// Reference backend `R`, candidate backend `C`; the forward pass sees one backend whose
/// results are the reference's.
pub struct Mirror<R: Backend, C: Backend> {
    pub reference: R,
    pub candidate: C,
    bufs: Vec<(Buf, Buf)>,
    ibufs: Vec<(IBuf, IBuf)>,
    weights: Vec<(Weight, Weight)>,
    /// Shared so the caller keeps a handle after the engine takes the backend.
    pub stats: Arc<Mutex<BTreeMap<&'static str, OpStat>>>,
}

#[derive(Clone, Copy)]
enum Out {
    /// Written only (poisoned first).
    W(Slice),
    /// Read and written (in place).
    Rw(Slice),
    I(IBuf, usize),
}

/// max |a − b| / max |b|, infinite if `a` has a NaN where `b` does not.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let mut md = 0f64;
    let mut mb = 0f64;
    for (&x, &y) in a.iter().zip(b) {
        if x.is_nan() && !y.is_nan() {
            return f64::INFINITY;
        }
        if !y.is_nan() {
            md = md.max((x as f64 - y as f64).abs());
            mb = mb.max((y as f64).abs());
        }
    }
    if mb == 0.0 {
        md
    } else {
        md / mb
    }
}

impl<R: Backend, C: Backend> Mirror<R, C> {
    pub fn new(reference: R, candidate: C) -> Self {
        Mirror {
            reference,
            candidate,
            bufs: Vec::new(),
            ibufs: Vec::new(),
            weights: Vec::new(),
            stats: Arc::new(Mutex::new(BTreeMap::new())),
        }
    }

    fn b(&self, s: Slice) -> BResult<(Slice, Slice)> {
        let (c, g) =
            self.bufs
                .get(s.buf.id() as usize)
                .copied()
                .ok_or(BackendError::BadHandle {
                    op: "mirror",
                    id: s.buf.id(),
                })?;
        Ok((
            Slice {
                buf: c,
                off: s.off,
                len: s.len,
            },
            Slice {
                buf: g,
                off: s.off,
                len: s.len,
            },
        ))
    }

    fn ib(&self, b: IBuf) -> BResult<(IBuf, IBuf)> {
        self.ibufs
            .get(b.id() as usize)
            .copied()
            .ok_or(BackendError::BadHandle {
                op: "mirror",
                id: b.id(),
            })
    }

    fn w(&self, w: Weight) -> BResult<(Weight, Weight)> {
        self.weights
            .get(w.id() as usize)
            .copied()
            .ok_or(BackendError::BadHandle {
                op: "mirror",
                id: w.id(),
            })
    }

    fn c(&self, s: Slice) -> Slice {
        self.b(s).map(|p| p.0).unwrap_or(s)
    }
    fn g(&self, s: Slice) -> Slice {
        self.b(s).map(|p| p.1).unwrap_or(s)
    }
    fn ci(&self, b: IBuf) -> IBuf {
        self.ib(b).map(|p| p.0).unwrap_or(b)
    }
    fn gi(&self, b: IBuf) -> IBuf {
        self.ib(b).map(|p| p.1).unwrap_or(b)
    }
    /// `a` for one backend (`cpu`: the reference), every handle mapped.
    fn attn_args(&self, a: AttnArgs, cpu: bool) -> AttnArgs {
        let m = self;
        let s = |x: Slice| if cpu { m.c(x) } else { m.g(x) };
        let comp = match a.comp {
            CompSel::None => CompSel::None,
            CompSel::All { rows, ratio } => CompSel::All {
                rows: s(rows),
                ratio,
            },
            CompSel::Top {
                rows,
                ratio,
                idx,
                k,
            } => CompSel::Top {
                rows: s(rows),
                ratio,
                idx: if cpu { m.ci(idx) } else { m.gi(idx) },
                k,
            },
        };
        AttnArgs {
            q: s(a.q),
            kv: s(a.kv),
            ring: s(a.ring),
            comp,
            sinks: if cpu { m.cw(a.sinks) } else { m.gw(a.sinks) },
            out: s(a.out),
            ..a
        }
    }
    /// `a` for each backend (its row positions, if any, are a buffer of each).
    /// A [`NormRopeCall`] on the reference's and on the candidate's buffers.
    fn norm_rope_sides(&self, x: NormRopeCall) -> (NormRopeCall, NormRopeCall) {
        let (ca, ga) = self.rope_args(x.rope);
        let c = NormRopeCall {
            x: self.c(x.x),
            w: x.w.map(|w| self.cw(w)),
            rope: ca,
            ..x
        };
        let g = NormRopeCall {
            x: self.g(x.x),
            w: x.w.map(|w| self.gw(w)),
            rope: ga,
            ..x
        };
        (c, g)
    }

    fn rope_args(&self, a: RopeArgs) -> (RopeArgs, RopeArgs) {
        (
            RopeArgs {
                row_pos: a.row_pos.map(|p| self.ci(p)),
                ..a
            },
            RopeArgs {
                row_pos: a.row_pos.map(|p| self.gi(p)),
                ..a
            },
        )
    }
    fn cw(&self, w: Weight) -> Weight {
        self.w(w).map(|p| p.0).unwrap_or(w)
    }
    fn gw(&self, w: Weight) -> Weight {
        self.w(w).map(|p| p.1).unwrap_or(w)
    }

    /// Runs `cpu_op` on the reference and `gpu_op` on the candidate, compares `outs`,
    /// resyncs the candidate's outputs.
    fn run(
        &mut self,
        op: &'static str,
        outs: &[Out],
        cpu_op: impl FnOnce(&mut R) -> BResult<()>,
        gpu_op: impl FnOnce(&mut C) -> BResult<()>,
    ) -> BResult<()> {
        for o in outs {
            if let Out::W(s) = *o {
                let g = self.g(s);
                self.candidate.fill(g, f32::NAN)?;
            }
        }
        cpu_op(&mut self.reference)?;
        gpu_op(&mut self.candidate)?;
        let mut st = OpStat::default();
        st.calls += 1;
        for o in outs {
            match *o {
                Out::W(s) | Out::Rw(s) => {
                    let (c, g) = self.b(s)?;
                    let mut cv = vec![0f32; s.len];
                    let mut gv = vec![0f32; s.len];
                    self.reference.download(c, &mut cv)?;
                    self.candidate.download(g, &mut gv)?;
                    let r = rel_err(&gv, &cv);
                    if !r.is_finite() {
                        st.nan += 1;
                    }
                    st.max_rel = st.max_rel.max(r);
                    self.candidate.upload(g, &cv)?;
                }
                Out::I(b, n) => {
                    let (c, g) = self.ib(b)?;
                    let mut cv = vec![0i32; n];
                    let mut gv = vec![0i32; n];
                    self.reference.download_i32(c, 0, &mut cv)?;
                    self.candidate.download_i32(g, 0, &mut gv)?;
                    st.int_mismatches += cv.iter().zip(&gv).filter(|(a, b)| a != b).count();
                    self.candidate.upload_i32(g, 0, &cv)?;
                }
            }
        }
        let mut all = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        let e = all.entry(op).or_default();
        e.calls += st.calls;
        e.max_rel = e.max_rel.max(st.max_rel);
        e.int_mismatches += st.int_mismatches;
        e.nan += st.nan;
        Ok(())
    }
}

impl<R: Backend, C: Backend> Device for Mirror<R, C> {
    fn name(&self) -> String {
        format!(
            "mirror({} | {})",
            self.reference.name(),
            self.candidate.name()
        )
    }
    fn warms_up(&self) -> bool {
        self.candidate.warms_up()
    }
    fn set_activation_q8(&mut self, on: bool) -> BResult<()> {
        self.reference.set_activation_q8(on)?;
        self.candidate.set_activation_q8(on)
    }
    fn set_decode_rows(&mut self, n: usize) -> BResult<()> {
        self.reference.set_decode_rows(n)?;
        self.candidate.set_decode_rows(n)
    }
    fn alloc(&mut self, len: usize) -> BResult<Buf> {
        let p = (self.reference.alloc(len)?, self.candidate.alloc(len)?);
        self.bufs.push(p);
        Ok(Buf::new((self.bufs.len() - 1) as u32, len))
    }
    fn alloc_i32(&mut self, len: usize) -> BResult<IBuf> {
        let p = (
            self.reference.alloc_i32(len)?,
            self.candidate.alloc_i32(len)?,
        );
        self.ibufs.push(p);
        Ok(IBuf::new((self.ibufs.len() - 1) as u32, len))
    }
    fn free(&mut self, buf: Buf) {
        if let Ok((c, g)) = self.b(buf.all()) {
            self.reference.free(c.buf);
            self.candidate.free(g.buf);
        }
    }
    fn free_i32(&mut self, buf: IBuf) {
        if let Ok((c, g)) = self.ib(buf) {
            self.reference.free_i32(c);
            self.candidate.free_i32(g);
        }
    }
    fn upload(&mut self, dst: Slice, src: &[f32]) -> BResult<()> {
        let (c, g) = self.b(dst)?;
        self.reference.upload(c, src)?;
        self.candidate.upload(g, src)
    }
    fn download(&mut self, src: Slice, dst: &mut [f32]) -> BResult<()> {
        let (c, g) = self.b(src)?;
        let mut gv = vec![0f32; dst.len()];
        self.candidate.download(g, &mut gv)?;
        self.reference.download(c, dst)
    }
    fn upload_i32(&mut self, dst: IBuf, off: usize, src: &[i32]) -> BResult<()> {
        let (c, g) = self.ib(dst)?;
        self.reference.upload_i32(c, off, src)?;
        self.candidate.upload_i32(g, off, src)
    }
    fn download_i32(&mut self, src: IBuf, off: usize, dst: &mut [i32]) -> BResult<()> {
        let (c, _) = self.ib(src)?;
        self.reference.download_i32(c, off, dst)
    }
    fn copy(&mut self, src: Slice, dst: Slice) -> BResult<()> {
        let (cs, gs, cd, gd) = (self.c(src), self.g(src), self.c(dst), self.g(dst));
        self.run(
            "copy",
            &[Out::W(dst)],
            |b| b.copy(cs, cd),
            |b| b.copy(gs, gd),
        )
    }
    fn fill(&mut self, dst: Slice, value: f32) -> BResult<()> {
        let (c, g) = self.b(dst)?;
        self.reference.fill(c, value)?;
        self.candidate.fill(g, value)
    }
    fn load_weight(
        &mut self,
        file: &Arc<GgufFile>,
        name: &str,
        usage: WeightUse,
    ) -> BResult<Weight> {
        let c = self.reference.load_weight(file, name, usage)?;
        let g = self.candidate.load_weight(file, name, usage)?;
        self.weights.push((c, g));
        Ok(Weight::new((self.weights.len() - 1) as u32, c.info))
    }
    /// Both sides in one batch each, so the GPU side loads through its pipeline (the
    /// engine check then compares the pipeline's weights against the CPU's).
    fn load_weights(
        &mut self,
        file: &Arc<GgufFile>,
        list: &[(String, WeightUse)],
    ) -> BResult<Vec<Weight>> {
        let cs = self.reference.load_weights(file, list)?;
        let gs = self.candidate.load_weights(file, list)?;
        if cs.len() != gs.len() {
            return Err(BackendError::Invalid {
                op: "load_weights",
                problem: format!("{} CPU weights, {} GPU weights", cs.len(), gs.len()),
            });
        }
        Ok(cs
            .into_iter()
            .zip(gs)
            .map(|(c, g)| {
                self.weights.push((c, g));
                Weight::new((self.weights.len() - 1) as u32, c.info)
            })
            .collect())
    }
    fn alloc_weight(&mut self, name: &str, info: WeightInfo) -> BResult<Weight> {
        let c = self.reference.alloc_weight(name, info)?;
        let g = self.candidate.alloc_weight(name, info)?;
        self.weights.push((c, g));
        Ok(Weight::new((self.weights.len() - 1) as u32, c.info))
    }
    fn write_weight_mat(&mut self, w: Weight, mat: usize, raw: &[u8]) -> BResult<()> {
        let (cw, gw) = (self.cw(w), self.gw(w));
        self.reference.write_weight_mat(cw, mat, raw)?;
        self.candidate.write_weight_mat(gw, mat, raw)
    }
    fn matmul(&mut self, w: Weight, mat: usize, x: Slice, n_tok: usize, y: Slice) -> BResult<()> {
        let (cw, gw, cx, gx, cy, gy) = (
            self.cw(w),
            self.gw(w),
            self.c(x),
            self.g(x),
            self.c(y),
            self.g(y),
        );
        let yo = y.sub(0, n_tok * w.info.rows());
        self.run(
            "matmul",
            &[Out::W(yo)],
            |b| b.matmul(cw, mat, cx, n_tok, cy),
            |b| b.matmul(gw, mat, gx, n_tok, gy),
        )
    }
    fn matmul_grouped(
        &mut self,
        w: Weight,
        groups: usize,
        x: Slice,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()> {
        let (cw, gw, cx, gx, cy, gy) = (
            self.cw(w),
            self.gw(w),
            self.c(x),
            self.g(x),
            self.c(y),
            self.g(y),
        );
        let yo = y.sub(0, n_tok * w.info.rows());
        self.run(
            "matmul_grouped",
            &[Out::W(yo)],
            |b| b.matmul_grouped(cw, groups, cx, n_tok, cy),
            |b| b.matmul_grouped(gw, groups, gx, n_tok, gy),
        )
    }
    fn rms_norm(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        rows: usize,
        width: usize,
        eps: f32,
        out: Slice,
    ) -> BResult<()> {
        let (cw, gw) = (w.map(|w| self.cw(w)), w.map(|w| self.gw(w)));
        let (cx, gx, co, go) = (self.c(x), self.g(x), self.c(out), self.g(out));
        let o = out.sub(0, rows * width);
        let kind = if x == out { Out::Rw(o) } else { Out::W(o) };
        self.run(
            "rms_norm",
            &[kind],
            |b| b.rms_norm(cx, cw, rows, width, eps, co),
            |b| b.rms_norm(gx, gw, rows, width, eps, go),
        )
    }
    fn rope(&mut self, x: Slice, a: RopeArgs) -> BResult<()> {
        let (cx, gx) = (self.c(x), self.g(x));
        let (ca, ga) = self.rope_args(a);
        let o = x.sub(0, a.n_rows * a.n_heads * a.head_dim);
        let name = if a.inverse { "rope_inverse" } else { "rope" };
        self.run(name, &[Out::Rw(o)], |b| b.rope(cx, ca), |b| b.rope(gx, ga))
    }
    fn argmax(&mut self, x: Slice, out: IBuf) -> BResult<()> {
        let (cx, gx, co, go) = (self.c(x), self.g(x), self.ci(out), self.gi(out));
        self.run(
            "argmax",
            &[Out::I(out, 1)],
            |b| b.argmax(cx, co),
            |b| b.argmax(gx, go),
        )
    }
    fn logit_band(&mut self, x: Slice, span: f32, exclude: Option<u32>, out: IBuf) -> BResult<()> {
        let (cx, gx, co, go) = (self.c(x), self.g(x), self.ci(out), self.gi(out));
        self.run(
            "logit_band",
            &[Out::I(out, out.len())],
            |b| b.logit_band(cx, span, exclude, co),
            |b| b.logit_band(gx, span, exclude, go),
        )
    }
    fn logit_bands(&mut self, x: Slice, n: usize, jobs: &[BandJob]) -> BResult<()> {
        let (cx, gx) = (self.c(x), self.g(x));
        // The jobs for one backend (`cpu`: the reference), every buffer mapped.
        let mapped = |cpu: bool| -> Vec<BandJob> {
            jobs.iter()
                .map(|&j| BandJob {
                    out: if cpu { self.ci(j.out) } else { self.gi(j.out) },
                    ..j
                })
                .collect()
        };
        let (cj, gj) = (mapped(true), mapped(false));
        let outs: Vec<Out> = jobs.iter().map(|j| Out::I(j.out, j.out.len())).collect();
        self.run(
            "logit_bands",
            &outs,
            |b| b.logit_bands(cx, n, &cj),
            |b| b.logit_bands(gx, n, &gj),
        )
    }
    fn add(&mut self, acc: Slice, x: Slice) -> BResult<()> {
        let (ca, ga, cx, gx) = (self.c(acc), self.g(acc), self.c(x), self.g(x));
        self.run("add", &[Out::Rw(acc)], |b| b.add(ca, cx), |b| b.add(ga, gx))
    }
    fn swiglu(&mut self, gate: Slice, up: Slice, clamp: f32, out: Slice) -> BResult<()> {
        let (cg, gg, cu, gu, co, go) = (
            self.c(gate),
            self.g(gate),
            self.c(up),
            self.g(up),
            self.c(out),
            self.g(out),
        );
        self.run(
            "swiglu",
            &[Out::W(out)],
            |b| b.swiglu(cg, cu, clamp, co),
            |b| b.swiglu(gg, gu, clamp, go),
        )
    }
    fn qat_fp8(&mut self, x: Slice, rows: usize, width: usize, n_dims: usize) -> BResult<()> {
        let (cx, gx) = (self.c(x), self.g(x));
        self.run(
            "qat_fp8",
            &[Out::Rw(x.sub(0, rows * width))],
            |b| b.qat_fp8(cx, rows, width, n_dims),
            |b| b.qat_fp8(gx, rows, width, n_dims),
        )
    }
    fn qat_hadamard_fp4(&mut self, x: Slice, rows: usize, width: usize) -> BResult<()> {
        let (cx, gx) = (self.c(x), self.g(x));
        self.run(
            "qat_hadamard_fp4",
            &[Out::Rw(x.sub(0, rows * width))],
            |b| b.qat_hadamard_fp4(cx, rows, width),
            |b| b.qat_hadamard_fp4(gx, rows, width),
        )
    }
    fn rope_qat_hadamard_fp4(
        &mut self,
        x: Slice,
        rope: RopeArgs,
        rows: usize,
        width: usize,
    ) -> BResult<()> {
        let (cx, gx) = (self.c(x), self.g(x));
        let (ca, ga) = self.rope_args(rope);
        self.run(
            "rope_qat_hadamard_fp4",
            &[Out::Rw(x.sub(0, rows * width))],
            |b| b.rope_qat_hadamard_fp4(cx, ca, rows, width),
            |b| b.rope_qat_hadamard_fp4(gx, ga, rows, width),
        )
    }
    fn embed(
        &mut self,
        table: Weight,
        tokens: IBuf,
        n_tok: usize,
        n_streams: usize,
        out: Slice,
    ) -> BResult<()> {
        let (ct, gt, ck, gk, co, go) = (
            self.cw(table),
            self.gw(table),
            self.ci(tokens),
            self.gi(tokens),
            self.c(out),
            self.g(out),
        );
        let o = out.sub(0, n_tok * n_streams * table.info.cols());
        self.run(
            "embed",
            &[Out::W(o)],
            |b| b.embed(ct, ck, n_tok, n_streams, co),
            |b| b.embed(gt, gk, n_tok, n_streams, go),
        )
    }
    fn hc_pre(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        a: HcArgs,
        y: Slice,
        post: Slice,
        comb: Slice,
    ) -> BResult<()> {
        let c = (
            self.c(mix),
            self.c(x),
            self.cw(base),
            self.cw(scale),
            self.c(y),
            self.c(post),
            self.c(comb),
        );
        let g = (
            self.g(mix),
            self.g(x),
            self.gw(base),
            self.gw(scale),
            self.g(y),
            self.g(post),
            self.g(comb),
        );
        let (n, t) = (a.n_hc, a.n_tok);
        self.run(
            "hc_pre",
            &[
                Out::W(y.sub(0, t * a.dim)),
                Out::W(post.sub(0, t * n)),
                Out::W(comb.sub(0, t * n * n)),
            ],
            |b| b.hc_pre(c.0, c.1, c.2, c.3, a, c.4, c.5, c.6),
            |b| b.hc_pre(g.0, g.1, g.2, g.3, a, g.4, g.5, g.6),
        )
    }
    fn hc_pre_norm(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        a: HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()> {
        let c = (
            (self.c(mix), self.c(x), self.cw(base), self.cw(scale)),
            self.cw(norm),
            (self.c(y), self.c(post), self.c(comb), self.c(out)),
        );
        let g = (
            (self.g(mix), self.g(x), self.gw(base), self.gw(scale)),
            self.gw(norm),
            (self.g(y), self.g(post), self.g(comb), self.g(out)),
        );
        let (n, t) = (a.n_hc, a.n_tok);
        self.run(
            "hc_pre_norm",
            &[
                Out::W(y.sub(0, t * a.dim)),
                Out::W(post.sub(0, t * n)),
                Out::W(comb.sub(0, t * n * n)),
                Out::W(out.sub(0, t * a.dim)),
            ],
            |b| {
                let ((m, x, bs, sc), w, (y, p, cb, o)) = c;
                b.hc_pre_norm(m, x, bs, sc, a, w, y, p, cb, o)
            },
            |b| {
                let ((m, x, bs, sc), w, (y, p, cb, o)) = g;
                b.hc_pre_norm(m, x, bs, sc, a, w, y, p, cb, o)
            },
        )
    }
    fn hc_mix_pre_norm(
        &mut self,
        fn_: Weight,
        x: Slice,
        mix: Slice,
        base: Weight,
        scale: Weight,
        a: HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()> {
        let c = (
            (
                self.cw(fn_),
                self.c(x),
                self.c(mix),
                self.cw(base),
                self.cw(scale),
            ),
            self.cw(norm),
            (self.c(y), self.c(post), self.c(comb), self.c(out)),
        );
        let g = (
            (
                self.gw(fn_),
                self.g(x),
                self.g(mix),
                self.gw(base),
                self.gw(scale),
            ),
            self.gw(norm),
            (self.g(y), self.g(post), self.g(comb), self.g(out)),
        );
        let (n, t) = (a.n_hc, a.n_tok);
        self.run(
            "hc_mix_pre_norm",
            &[
                Out::W(mix.sub(0, t * (2 * n + n * n))),
                Out::W(y.sub(0, t * a.dim)),
                Out::W(post.sub(0, t * n)),
                Out::W(comb.sub(0, t * n * n)),
                Out::W(out.sub(0, t * a.dim)),
            ],
            |b| {
                let ((f, x, m, bs, sc), w, (y, p, cb, o)) = c;
                b.hc_mix_pre_norm(f, x, m, bs, sc, a, w, y, p, cb, o)
            },
            |b| {
                let ((f, x, m, bs, sc), w, (y, p, cb, o)) = g;
                b.hc_mix_pre_norm(f, x, m, bs, sc, a, w, y, p, cb, o)
            },
        )
    }
    fn hc_post_mix_pre_norm(
        &mut self,
        prev: HcPost,
        fn_: Weight,
        x: Slice,
        mix: Slice,
        base: Weight,
        scale: Weight,
        a: HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()> {
        let side = |m: &Self, cpu: bool| {
            let s = |x: Slice| if cpu { m.c(x) } else { m.g(x) };
            let w = |x: Weight| if cpu { m.cw(x) } else { m.gw(x) };
            let p = HcPost {
                f: s(prev.f),
                f2: prev.f2.map(s),
                post: s(prev.post),
                comb: s(prev.comb),
            };
            (
                p,
                (w(fn_), s(x), s(mix), w(base), w(scale)),
                w(norm),
                (s(y), s(post), s(comb), s(out)),
            )
        };
        let (c, g) = (side(self, true), side(self, false));
        let (n, t) = (a.n_hc, a.n_tok);
        let mut outs = vec![
            Out::Rw(x.sub(0, t * n * a.dim)),
            Out::W(mix.sub(0, t * (2 * n + n * n))),
            Out::W(y.sub(0, t * a.dim)),
            // Read as the previous sublayer's coefficients before they are rewritten.
            Out::Rw(post.sub(0, t * n)),
            Out::Rw(comb.sub(0, t * n * n)),
            Out::W(out.sub(0, t * a.dim)),
        ];
        if prev.f2.is_some() {
            outs.push(Out::Rw(prev.f.sub(0, t * a.dim)));
        }
        self.run(
            "hc_post_mix_pre_norm",
            &outs,
            |b| {
                let (p, (f, x, m, bs, sc), w, (y, po, cb, o)) = c;
                b.hc_post_mix_pre_norm(p, f, x, m, bs, sc, a, w, y, po, cb, o)
            },
            |b| {
                let (p, (f, x, m, bs, sc), w, (y, po, cb, o)) = g;
                b.hc_post_mix_pre_norm(p, f, x, m, bs, sc, a, w, y, po, cb, o)
            },
        )
    }
    fn norm_rope(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        eps: f32,
        rope: RopeArgs,
        fp8_dims: Option<usize>,
    ) -> BResult<()> {
        let (cw, gw) = (w.map(|w| self.cw(w)), w.map(|w| self.gw(w)));
        let (cx, gx) = (self.c(x), self.g(x));
        let (cr, gr) = self.rope_args(rope);
        let n = rope.n_rows * rope.n_heads * rope.head_dim;
        self.run(
            "norm_rope",
            &[Out::Rw(x.sub(0, n))],
            |b| b.norm_rope(cx, cw, eps, cr, fp8_dims),
            |b| b.norm_rope(gx, gw, eps, gr, fp8_dims),
        )
    }
    fn rope_matmul_grouped(
        &mut self,
        x: Slice,
        rope: RopeArgs,
        w: Weight,
        groups: usize,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()> {
        let (cr, gr) = self.rope_args(rope);
        let c = (self.c(x), self.cw(w), self.c(y));
        let g = (self.g(x), self.gw(w), self.g(y));
        // `x` is scratch afterwards (the candidate may rotate it in registers only): only
        // `y` is compared.
        self.run(
            "rope_matmul_grouped",
            &[Out::W(y.sub(0, n_tok * w.info.rows()))],
            |b| b.rope_matmul_grouped(c.0, cr, c.1, groups, n_tok, c.2),
            |b| b.rope_matmul_grouped(g.0, gr, g.1, groups, n_tok, g.2),
        )
    }
    fn rms_norm_matmul(
        &mut self,
        x: Slice,
        norm: Weight,
        eps: f32,
        h: Slice,
        w: Weight,
        n_tok: usize,
        out: Slice,
    ) -> BResult<()> {
        let c = (self.c(x), self.cw(norm), self.c(h), self.cw(w), self.c(out));
        let g = (self.g(x), self.gw(norm), self.g(h), self.gw(w), self.g(out));
        self.run(
            "rms_norm_matmul",
            &[
                Out::W(h.sub(0, n_tok * w.info.cols())),
                Out::W(out.sub(0, n_tok * w.info.rows())),
            ],
            |b| b.rms_norm_matmul(c.0, c.1, eps, c.2, c.3, n_tok, c.4),
            |b| b.rms_norm_matmul(g.0, g.1, eps, g.2, g.3, n_tok, g.4),
        )
    }
    fn swiglu_matmul(
        &mut self,
        gate: Slice,
        up: Slice,
        clamp: f32,
        h: Slice,
        w: Weight,
        n_tok: usize,
        out: Slice,
    ) -> BResult<()> {
        let c = (self.c(gate), self.c(up), self.c(h), self.cw(w), self.c(out));
        let g = (self.g(gate), self.g(up), self.g(h), self.gw(w), self.g(out));
        // `h` is scratch the candidate may leave unwritten: only `out` is compared.
        self.run(
            "swiglu_matmul",
            &[Out::W(out.sub(0, n_tok * w.info.rows()))],
            |b| b.swiglu_matmul(c.0, c.1, clamp, c.2, c.3, n_tok, c.4),
            |b| b.swiglu_matmul(g.0, g.1, clamp, g.2, g.3, n_tok, g.4),
        )
    }
    fn norm_rope_pair(&mut self, a: NormRopeCall, b: NormRopeCall) -> BResult<()> {
        let ((ca, ga), (cb, gb)) = (self.norm_rope_sides(a), self.norm_rope_sides(b));
        let n = |x: NormRopeCall| x.rope.n_rows * x.rope.n_heads * x.rope.head_dim;
        self.run(
            "norm_rope_pair",
            &[Out::Rw(a.x.sub(0, n(a))), Out::Rw(b.x.sub(0, n(b)))],
            |r| r.norm_rope_pair(ca, cb),
            |g| g.norm_rope_pair(ga, gb),
        )
    }
    fn norm_rope_pair_store(
        &mut self,
        a: NormRopeCall,
        b: NormRopeCall,
        store: RingStoreCall,
    ) -> BResult<()> {
        let ((ca, ga), (cb, gb)) = (self.norm_rope_sides(a), self.norm_rope_sides(b));
        let cs = RingStoreCall {
            ring: self.c(store.ring),
            kv: self.c(store.kv),
            ..store
        };
        let gs = RingStoreCall {
            ring: self.g(store.ring),
            kv: self.g(store.kv),
            ..store
        };
        let n = |x: NormRopeCall| x.rope.n_rows * x.rope.n_heads * x.rope.head_dim;
        self.run(
            "norm_rope_pair_store",
            &[
                Out::Rw(a.x.sub(0, n(a))),
                Out::Rw(b.x.sub(0, n(b))),
                Out::Rw(store.ring),
            ],
            |r| r.norm_rope_pair_store(ca, cb, cs),
            |g| g.norm_rope_pair_store(ga, gb, gs),
        )
    }
    fn matmul_pair(
        &mut self,
        wa: Weight,
        wb: Weight,
        x: Slice,
        n_tok: usize,
        ya: Slice,
        yb: Slice,
    ) -> BResult<()> {
        let c = (self.cw(wa), self.cw(wb), self.c(x), self.c(ya), self.c(yb));
        let g = (self.gw(wa), self.gw(wb), self.g(x), self.g(ya), self.g(yb));
        let (ra, rb) = (n_tok * wa.info.rows(), n_tok * wb.info.rows());
        self.run(
            "matmul_pair",
            &[Out::W(ya.sub(0, ra)), Out::W(yb.sub(0, rb))],
            |b| b.matmul_pair(c.0, c.1, c.2, n_tok, c.3, c.4),
            |b| b.matmul_pair(g.0, g.1, g.2, n_tok, g.3, g.4),
        )
    }
    fn matmul_set(
        &mut self,
        x: Slice,
        n_tok: usize,
        singles: &[(Weight, Slice)],
        pairs: &[MatmulPair],
    ) -> BResult<()> {
        let side = |m: &Self, cpu: bool| {
            let w = |w: Weight| if cpu { m.cw(w) } else { m.gw(w) };
            let b = |s: Slice| if cpu { m.c(s) } else { m.g(s) };
            let singles: Vec<(Weight, Slice)> =
                singles.iter().map(|&(a, y)| (w(a), b(y))).collect();
            let pairs: Vec<MatmulPair> = pairs
                .iter()
                .map(|p| MatmulPair {
                    wa: w(p.wa),
                    wb: w(p.wb),
                    ya: b(p.ya),
                    yb: b(p.yb),
                })
                .collect();
            (b(x), singles, pairs)
        };
        let (c, g) = (side(self, true), side(self, false));
        let mut outs: Vec<Out> = singles
            .iter()
            .map(|&(w, y)| Out::W(y.sub(0, n_tok * w.info.rows())))
            .collect();
        for p in pairs {
            outs.push(Out::W(p.ya.sub(0, n_tok * p.wa.info.rows())));
            outs.push(Out::W(p.yb.sub(0, n_tok * p.wb.info.rows())));
        }
        self.run(
            "matmul_set",
            &outs,
            |b| b.matmul_set(c.0, n_tok, &c.1, &c.2),
            |b| b.matmul_set(g.0, n_tok, &g.1, &g.2),
        )
    }
    fn hc_post(&mut self, x: Slice, f: Slice, post: Slice, comb: Slice, a: HcArgs) -> BResult<()> {
        let c = (self.c(x), self.c(f), self.c(post), self.c(comb));
        let g = (self.g(x), self.g(f), self.g(post), self.g(comb));
        self.run(
            "hc_post",
            &[Out::Rw(x.sub(0, a.n_tok * a.n_hc * a.dim))],
            |b| b.hc_post(c.0, c.1, c.2, c.3, a),
            |b| b.hc_post(g.0, g.1, g.2, g.3, a),
        )
    }
    fn hc_post_add(
        &mut self,
        x: Slice,
        f: Slice,
        f2: Slice,
        post: Slice,
        comb: Slice,
        a: HcArgs,
    ) -> BResult<()> {
        let c = (self.c(x), self.c(f), self.c(f2), self.c(post), self.c(comb));
        let g = (self.g(x), self.g(f), self.g(f2), self.g(post), self.g(comb));
        self.run(
            "hc_post_add",
            &[
                Out::Rw(x.sub(0, a.n_tok * a.n_hc * a.dim)),
                Out::Rw(f.sub(0, a.n_tok * a.dim)),
            ],
            |b| b.hc_post_add(c.0, c.1, c.2, c.3, c.4, a),
            |b| b.hc_post_add(g.0, g.1, g.2, g.3, g.4, a),
        )
    }
    fn hc_head(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        a: HcArgs,
        y: Slice,
    ) -> BResult<()> {
        let c = (
            self.c(mix),
            self.c(x),
            self.cw(base),
            self.cw(scale),
            self.c(y),
        );
        let g = (
            self.g(mix),
            self.g(x),
            self.gw(base),
            self.gw(scale),
            self.g(y),
        );
        self.run(
            "hc_head",
            &[Out::W(y.sub(0, a.n_tok * a.dim))],
            |b| b.hc_head(c.0, c.1, c.2, c.3, a, c.4),
            |b| b.hc_head(g.0, g.1, g.2, g.3, a, g.4),
        )
    }
    fn compressor(
        &mut self,
        acc: Slice,
        u: Slice,
        z: Slice,
        ape: Weight,
        a: CompressorArgs,
        rows: Slice,
    ) -> BResult<()> {
        let c = (
            self.c(acc),
            self.c(u),
            self.c(z),
            self.cw(ape),
            self.c(rows),
        );
        let g = (
            self.g(acc),
            self.g(u),
            self.g(z),
            self.gw(ape),
            self.g(rows),
        );
        self.run(
            "compressor",
            &[Out::Rw(acc), Out::Rw(rows)],
            |b| b.compressor(c.0, c.1, c.2, c.3, a, c.4),
            |b| b.compressor(g.0, g.1, g.2, g.3, a, g.4),
        )
    }
    fn compressor_pair(&mut self, a: CompressorCall, b: CompressorCall) -> BResult<()> {
        let side = |m: &Self, x: CompressorCall, cpu: bool| {
            let s = |v: Slice| if cpu { m.c(v) } else { m.g(v) };
            CompressorCall {
                acc: s(x.acc),
                u: s(x.u),
                z: s(x.z),
                ape: if cpu { m.cw(x.ape) } else { m.gw(x.ape) },
                rows: s(x.rows),
                ..x
            }
        };
        let (ca, cb) = (side(self, a, true), side(self, b, true));
        let (ga, gb) = (side(self, a, false), side(self, b, false));
        self.run(
            "compressor_pair",
            &[
                Out::Rw(a.acc),
                Out::Rw(a.rows),
                Out::Rw(b.acc),
                Out::Rw(b.rows),
            ],
            |r| r.compressor_pair(ca, cb),
            |g| g.compressor_pair(ga, gb),
        )
    }
    fn indexer_topk(
        &mut self,
        q: Slice,
        w: Slice,
        rows: Slice,
        a: IndexerArgs,
        out: IBuf,
    ) -> BResult<()> {
        let c = (self.c(q), self.c(w), self.c(rows), self.ci(out));
        let g = (self.g(q), self.g(w), self.g(rows), self.gi(out));
        self.run(
            "indexer_topk",
            &[Out::I(out, a.n_tok * a.top_k)],
            |b| b.indexer_topk(c.0, c.1, c.2, a, c.3),
            |b| b.indexer_topk(g.0, g.1, g.2, a, g.3),
        )
    }
    fn compressor_batch(&mut self, calls: &[CompressorCall]) -> BResult<()> {
        let map = |m: &Self, cpu: bool| -> Vec<CompressorCall> {
            let s = |x: Slice| if cpu { m.c(x) } else { m.g(x) };
            calls
                .iter()
                .map(|c| CompressorCall {
                    acc: s(c.acc),
                    u: s(c.u),
                    z: s(c.z),
                    ape: if cpu { m.cw(c.ape) } else { m.gw(c.ape) },
                    rows: s(c.rows),
                    ..*c
                })
                .collect()
        };
        let (cc, gc) = (map(self, true), map(self, false));
        let outs: Vec<Out> = calls
            .iter()
            .flat_map(|c| [Out::Rw(c.acc), Out::Rw(c.rows)])
            .collect();
        self.run(
            "compressor_batch",
            &outs,
            |b| b.compressor_batch(&cc),
            |b| b.compressor_batch(&gc),
        )
    }
    fn indexer_topk_batch(&mut self, calls: &[IndexerCall]) -> BResult<()> {
        let map = |m: &Self, cpu: bool| -> Vec<IndexerCall> {
            let s = |x: Slice| if cpu { m.c(x) } else { m.g(x) };
            calls
                .iter()
                .map(|c| IndexerCall {
                    q: s(c.q),
                    w: s(c.w),
                    rows: s(c.rows),
                    out: if cpu { m.ci(c.out) } else { m.gi(c.out) },
                    ..*c
                })
                .collect()
        };
        let (cc, gc) = (map(self, true), map(self, false));
        let outs: Vec<Out> = calls
            .iter()
            .map(|c| Out::I(c.out, c.args.n_tok * c.args.top_k))
            .collect();
        self.run(
            "indexer_topk_batch",
            &outs,
            |b| b.indexer_topk_batch(&cc),
            |b| b.indexer_topk_batch(&gc),
        )
    }
    fn ring_store_batch(&mut self, calls: &[RingStoreCall]) -> BResult<()> {
        let map = |m: &Self, cpu: bool| -> Vec<RingStoreCall> {
            let s = |x: Slice| if cpu { m.c(x) } else { m.g(x) };
            calls
                .iter()
                .map(|c| RingStoreCall {
                    ring: s(c.ring),
                    kv: s(c.kv),
                    ..*c
                })
                .collect()
        };
        let (cc, gc) = (map(self, true), map(self, false));
        let outs: Vec<Out> = calls.iter().map(|c| Out::Rw(c.ring)).collect();
        self.run(
            "ring_store_batch",
            &outs,
            |b| b.ring_store_batch(&cc),
            |b| b.ring_store_batch(&gc),
        )
    }
    fn attention(&mut self, a: AttnArgs) -> BResult<()> {
        let (ca, ga) = (self.attn_args(a, true), self.attn_args(a, false));
        let o = a.out.sub(0, a.n_tok * a.n_head * a.head_dim);
        self.run(
            "attention",
            &[Out::W(o)],
            |b| b.attention(ca),
            |b| b.attention(ga),
        )
    }
    fn attention_batch(&mut self, args: &[AttnArgs]) -> BResult<()> {
        let ca: Vec<AttnArgs> = args.iter().map(|&a| self.attn_args(a, true)).collect();
        let ga: Vec<AttnArgs> = args.iter().map(|&a| self.attn_args(a, false)).collect();
        let outs: Vec<Out> = args
            .iter()
            .map(|a| Out::W(a.out.sub(0, a.n_tok * a.n_head * a.head_dim)))
            .collect();
        self.run(
            "attention_batch",
            &outs,
            |b| b.attention_batch(&ca),
            |b| b.attention_batch(&ga),
        )
    }
    fn ring_store(
        &mut self,
        ring: Slice,
        kv: Slice,
        pos0: usize,
        n_tok: usize,
        window: usize,
    ) -> BResult<()> {
        let (cr, gr, ck, gk) = (self.c(ring), self.g(ring), self.c(kv), self.g(kv));
        self.run(
            "ring_store",
            &[Out::Rw(ring)],
            |b| b.ring_store(cr, ck, pos0, n_tok, window),
            |b| b.ring_store(gr, gk, pos0, n_tok, window),
        )
    }
    fn router(
        &mut self,
        logits: Slice,
        routing: Routing,
        a: RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()> {
        let rt = |m: &Self, cpu: bool| match routing {
            Routing::TopK { bias } => Routing::TopK {
                bias: bias.map(|b| if cpu { m.cw(b) } else { m.gw(b) }),
            },
            Routing::Hash { table, tokens } => Routing::Hash {
                table: if cpu { m.cw(table) } else { m.gw(table) },
                tokens: if cpu { m.ci(tokens) } else { m.gi(tokens) },
            },
        };
        let (cr, gr) = (rt(self, true), rt(self, false));
        let c = (self.c(logits), self.ci(ids), self.c(weights));
        let g = (self.g(logits), self.gi(ids), self.g(weights));
        let n = a.n_tok * a.k;
        // The call writes ids from row a.row0 on; the rows before are compared as well
        // (they must be unchanged on both sides).
        self.run(
            "router",
            &[
                Out::I(ids, (a.row0 + a.n_tok) * a.k),
                Out::W(weights.sub(0, n)),
            ],
            |b| b.router(c.0, cr, a, c.1, c.2),
            |b| b.router(g.0, gr, a, g.1, g.2),
        )
    }
    /// Mirrored as its two ops, each compared and resynchronised: run fused, the device
    /// would route on its own logits, and an expert pair within the matmul's rounding of a
    /// tie could pick differently from the CPU without either being wrong. The fused
    /// kernel equals the two launches bit for bit (`emulated_fused_launches_equal_the_separate_ones`).
    #[allow(clippy::too_many_arguments)]
    fn router_matmul(
        &mut self,
        w: Weight,
        x: Slice,
        logits: Slice,
        routing: Routing,
        a: RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()> {
        Backend::matmul(self, w, 0, x, a.n_tok, logits)?;
        Backend::router(self, logits, routing, a, ids, weights)
    }
    fn moe(
        &mut self,
        x: Slice,
        ids: IBuf,
        weights: Slice,
        gate: Weight,
        up: Weight,
        down: Weight,
        a: MoeArgs,
        out: Slice,
    ) -> BResult<()> {
        let c = (
            self.c(x),
            self.ci(ids),
            self.c(weights),
            self.cw(gate),
            self.cw(up),
            self.cw(down),
            self.c(out),
        );
        let g = (
            self.g(x),
            self.gi(ids),
            self.g(weights),
            self.gw(gate),
            self.gw(up),
            self.gw(down),
            self.g(out),
        );
        let o = out.sub(0, a.n_tok * gate.info.cols());
        self.run(
            "moe",
            &[Out::W(o)],
            |b| b.moe(c.0, c.1, c.2, c.3, c.4, c.5, a, c.6),
            |b| b.moe(g.0, g.1, g.2, g.3, g.4, g.5, a, g.6),
        )
    }
}
