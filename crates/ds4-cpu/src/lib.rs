//! The CPU [`Backend`]: the reference every other backend is checked against.
//!
//! * Weights stay in the GGUF mapping in their stored type (F32, F16, BF16, Q8_0, Q2_K,
//!   Q4_K, IQ2_XXS, MXFP4); matmuls call `ds4_gguf::quant::dot` per row (f32 within a block, block
//!   sums in f64).
//! * Activations and KV state are f32.
//! * Multi-threaded with rayon over output rows / heads / tokens, on a private pool whose
//!   size is chosen at construction; results do not depend on it (fixed reduction orders).
//! * Every op first runs the shared argument checks of `ds4_engine::validate` (shapes,
//!   ranges, weight types, the aliasing rule); what stays here is the handle lookup and the
//!   checks of data only the kernels see (token ids, expert ids, selected rows).

mod kernels;
mod mem;
mod weights;

use std::sync::Arc;

use ds4_engine::backend::{
    AttnArgs, BResult, Backend, BackendError, Buf, CompSel, CompressorArgs, HcArgs, IBuf,
    IndexerArgs, MoeArgs, RopeArgs, RouterArgs, Routing, Slice, Weight, WeightInfo, WeightUse,
};
use ds4_engine::device::Device;
use ds4_engine::validate;
use ds4_gguf::GgufFile;

use mem::{range, Slab};
use weights::CpuWeight;

use kernels::{rows_mut, try_rows_mut, Par};

pub use kernels::{dot_f32, sinkhorn, top_k_lowest_tie};

/// Ops below this many multiply-adds (or elements) run inline on the caller's thread.
const PAR_WORK: usize = 1 << 16;

/// Per-query compressed-row choice inside `attention`: `(indices [T, k], k)` or all rows.
type Selection<'a> = Option<(&'a [i32], usize)>;

/// The CPU backend.
pub struct CpuBackend {
    pool: rayon::ThreadPool,
    bufs: Slab<f32>,
    ibufs: Slab<i32>,
    weights: Vec<CpuWeight>,
    /// Int8 activations for one-token matmuls ([`Backend::set_activation_q8`]).
    act_q8: bool,
    /// Rows of a batched decode step ([`Backend::set_decode_rows`]); 1 otherwise.
    decode_rows: usize,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("threads", &self.pool.current_num_threads())
            .field("weights", &self.weights.len())
            .finish()
    }
}

impl CpuBackend {
    /// A backend on `threads` worker threads (0 = one per core).
    pub fn new(threads: usize) -> Result<CpuBackend, BackendError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("ds4-cpu-{i}"))
            .build()
            .map_err(|e| BackendError::Invalid {
                op: "new",
                problem: format!("cannot start the thread pool: {e}"),
            })?;
        Ok(CpuBackend {
            pool,
            bufs: Slab::new(),
            ibufs: Slab::new(),
            weights: Vec::new(),
            act_q8: false,
            decode_rows: 1,
        })
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    fn view(&self, s: Slice, op: &'static str) -> BResult<&[f32]> {
        let v = self.bufs.get(s.buf.id(), op)?;
        Ok(&v[range(s, v.len(), op)?])
    }

    fn iview(&self, b: IBuf, op: &'static str) -> BResult<&[i32]> {
        let v = self.ibufs.get(b.id(), op)?;
        if v.len() != b.len() {
            return Err(BackendError::BadHandle { op, id: b.id() });
        }
        Ok(v)
    }

    fn weight(&self, w: Weight, op: &'static str) -> BResult<&CpuWeight> {
        let cw = self
            .weights
            .get(w.id() as usize)
            .ok_or(BackendError::BadHandle { op, id: w.id() })?;
        if cw.info != w.info {
            return Err(BackendError::BadHandle { op, id: w.id() });
        }
        Ok(cw)
    }

    /// Runs `f(self, work, par)` on the pool when `work` (≈ multiply-adds) is large enough
    /// to be worth the hand-off, else inline on the caller's thread.
    fn run<R: Send>(
        &self,
        work: usize,
        f: impl FnOnce(&CpuBackend, Par) -> BResult<R> + Send,
    ) -> BResult<R> {
        if work >= PAR_WORK && self.pool.current_num_threads() > 1 {
            self.pool.install(|| f(self, Par(true)))
        } else {
            f(self, Par(false))
        }
    }

    /// Runs `f` with the output range taken out of the slab (so inputs cannot alias it)
    /// and always puts the buffer back. `work` chooses pool or inline (see [`Self::run`]).
    fn with_out<R: Send>(
        &mut self,
        out: Slice,
        op: &'static str,
        work: usize,
        f: impl FnOnce(&CpuBackend, &mut [f32], Par) -> BResult<R> + Send,
    ) -> BResult<R> {
        let mut v = self.bufs.take(out.buf.id(), op)?;
        let r = match range(out, v.len(), op) {
            Ok(rg) => {
                let slice = &mut v[rg];
                self.run(work, move |this, par| f(this, slice, par))
            }
            Err(e) => Err(e),
        };
        self.bufs.put(out.buf.id(), v);
        r
    }

    /// Like [`Self::with_out`] for an i32 output buffer.
    fn with_iout<R: Send>(
        &mut self,
        out: IBuf,
        op: &'static str,
        work: usize,
        f: impl FnOnce(&CpuBackend, &mut [i32], Par) -> BResult<R> + Send,
    ) -> BResult<R> {
        let mut v = self.ibufs.take(out.id(), op)?;
        let r = if v.len() != out.len() {
            Err(BackendError::BadHandle { op, id: out.id() })
        } else {
            let slice = &mut v[..];
            self.run(work, move |this, par| f(this, slice, par))
        };
        self.ibufs.put(out.id(), v);
        r
    }
}

impl CpuBackend {
    /// The int8-activation rule ([`Backend::set_activation_q8`],
    /// [`Backend::set_decode_rows`]): on, and no more tokens than decode rows.
    fn q8_rows(&self, n_tok: usize) -> bool {
        self.act_q8 && n_tok <= self.decode_rows
    }
}

impl Device for CpuBackend {
    fn name(&self) -> String {
        format!("cpu ({} threads)", self.threads())
    }

    fn alloc(&mut self, len: usize) -> BResult<Buf> {
        Ok(Buf::new(self.bufs.alloc(len)?, len))
    }

    fn alloc_i32(&mut self, len: usize) -> BResult<IBuf> {
        Ok(IBuf::new(self.ibufs.alloc(len)?, len))
    }

    fn free(&mut self, buf: Buf) {
        self.bufs.free(buf.id());
    }

    fn free_i32(&mut self, buf: IBuf) {
        self.ibufs.free(buf.id());
    }

    fn upload(&mut self, dst: Slice, src: &[f32]) -> BResult<()> {
        let v = self.bufs.get_mut(dst.buf.id(), "upload")?;
        let r = range(dst, v.len(), "upload")?;
        v[r].copy_from_slice(src);
        Ok(())
    }

    fn download(&mut self, src: Slice, dst: &mut [f32]) -> BResult<()> {
        dst.copy_from_slice(self.view(src, "download")?);
        Ok(())
    }

    fn upload_i32(&mut self, dst: IBuf, off: usize, src: &[i32]) -> BResult<()> {
        let v = self.ibufs.get_mut(dst.id(), "upload_i32")?;
        if v.len() != dst.len() {
            return Err(BackendError::BadHandle {
                op: "upload_i32",
                id: dst.id(),
            });
        }
        v[off..off + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn download_i32(&mut self, src: IBuf, off: usize, dst: &mut [i32]) -> BResult<()> {
        let v = self.iview(src, "download_i32")?;
        dst.copy_from_slice(&v[off..off + dst.len()]);
        Ok(())
    }

    fn copy(&mut self, src: Slice, dst: Slice) -> BResult<()> {
        self.with_out(dst, "copy", 0, |this, out, _| {
            out.copy_from_slice(this.view(src, "copy")?);
            Ok(())
        })
    }

    fn fill(&mut self, dst: Slice, value: f32) -> BResult<()> {
        let v = self.bufs.get_mut(dst.buf.id(), "fill")?;
        let r = range(dst, v.len(), "fill")?;
        v[r].fill(value);
        Ok(())
    }

    fn load_weight(
        &mut self,
        file: &Arc<GgufFile>,
        name: &str,
        usage: WeightUse,
    ) -> BResult<Weight> {
        let w = CpuWeight::load(file, name, usage)?;
        let id = u32::try_from(self.weights.len()).map_err(|_| BackendError::Weight {
            name: name.into(),
            problem: "too many weights".into(),
        })?;
        let info = w.info;
        self.weights.push(w);
        Ok(Weight::new(id, info))
    }

    fn alloc_weight(&mut self, name: &str, info: WeightInfo) -> BResult<Weight> {
        let bytes = validate::alloc_weight(name, info)?;
        let w = CpuWeight::zeroed(name, info, bytes)?;
        let id = u32::try_from(self.weights.len()).map_err(|_| BackendError::Weight {
            name: name.into(),
            problem: "too many weights".into(),
        })?;
        self.weights.push(w);
        Ok(Weight::new(id, info))
    }

    fn write_weight_mat(&mut self, w: Weight, mat: usize, raw: &[u8]) -> BResult<()> {
        const OP: &str = "write_weight_mat";
        validate::write_weight_mat(w, mat, raw.len())?;
        self.weight(w, OP)?;
        self.weights[w.id() as usize].write_mat(mat, raw)
    }

    fn set_activation_q8(&mut self, on: bool) -> BResult<()> {
        self.act_q8 = on;
        Ok(())
    }

    /// Every row's experts are computed from that row alone (the matmul kernels sum each
    /// output in one fixed order whatever the rows beside it); only the int8 rule
    /// ([`Self::q8_rows`]) depends on the call's rows, and two rows at one decode row are
    /// past it in both calls.
    fn moe_joint_min_rows(&self, _: Weight, _: Weight, _: Weight, _: usize) -> Option<usize> {
        Some(2)
    }
    fn set_decode_rows(&mut self, n: usize) -> BResult<()> {
        self.decode_rows = n.max(1);
        Ok(())
    }

    fn matmul(&mut self, w: Weight, mat: usize, x: Slice, n_tok: usize, y: Slice) -> BResult<()> {
        const OP: &str = "matmul";
        let (cols, rows) = (w.info.cols(), w.info.rows());
        let q8 = self.q8_rows(n_tok);
        self.with_out(y, OP, rows * cols * n_tok, |this, yv, par| {
            let cw = this.weight(w, OP)?;
            let xv = this.view(x, OP)?;
            kernels::matmul(par, cw, mat, 0, rows, xv, cols, n_tok, yv, rows, q8)
        })
    }

    fn matmul_grouped(
        &mut self,
        w: Weight,
        groups: usize,
        x: Slice,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()> {
        const OP: &str = "matmul_grouped";
        let (cols, rows) = (w.info.cols(), w.info.rows());
        let r = rows / groups;
        let q8 = self.q8_rows(n_tok);
        self.with_out(y, OP, rows * cols * n_tok, |this, yv, par| {
            let cw = this.weight(w, OP)?;
            let xv = this.view(x, OP)?;
            for g in 0..groups {
                kernels::matmul(
                    par,
                    cw,
                    0,
                    g * r,
                    r,
                    &xv[g * cols..],
                    groups * cols,
                    n_tok,
                    &mut yv[g * r..],
                    rows,
                    q8,
                )?;
            }
            Ok(())
        })
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
        const OP: &str = "rms_norm";
        if width == 0 {
            return Ok(());
        }
        let in_place = x == out;
        self.with_out(out, OP, rows * width, |this, o, par| {
            let g = match w {
                Some(w) => Some(this.weight(w, OP)?.values(OP)?),
                None => None,
            };
            if !in_place {
                o[..rows * width].copy_from_slice(&this.view(x, OP)?[..rows * width]);
            }
            rows_mut(par, &mut o[..rows * width], width, |_, row| {
                kernels::rms_norm_row(row, g, eps)
            });
            Ok(())
        })
    }

    fn rope(&mut self, x: Slice, a: RopeArgs) -> BResult<()> {
        const OP: &str = "rope";
        if a.n_rows == 0 || a.n_heads == 0 {
            return Ok(());
        }
        let pos: Vec<usize> = match a.row_pos {
            None => (0..a.n_rows).map(|r| a.pos0 + r * a.pos_step).collect(),
            Some(p) => self.iview(p, OP)?[..a.n_rows]
                .iter()
                .map(|&v| {
                    usize::try_from(v).map_err(|_| BackendError::Invalid {
                        op: OP,
                        problem: format!("row position {v}"),
                    })
                })
                .collect::<BResult<_>>()?,
        };
        let work = 8 * a.n_rows * a.n_heads * a.freq.rope_dim;
        self.with_out(x, OP, work, |_, xv, par| {
            kernels::rope(par, xv, &a, &pos);
            Ok(())
        })
    }

    fn add(&mut self, acc: Slice, x: Slice) -> BResult<()> {
        const OP: &str = "add";
        self.with_out(acc, OP, acc.len, |this, a, par| {
            let xv = this.view(x, OP)?;
            rows_mut(par, a, 4096, |ci, a| {
                let x = &xv[ci * 4096..];
                a.iter_mut().zip(x).for_each(|(a, x)| *a += x)
            });
            Ok(())
        })
    }

    fn swiglu(&mut self, gate: Slice, up: Slice, clamp: f32, out: Slice) -> BResult<()> {
        const OP: &str = "swiglu";
        self.with_out(out, OP, 16 * out.len, |this, o, par| {
            let (g, u) = (this.view(gate, OP)?, this.view(up, OP)?);
            rows_mut(par, o, 4096, |ci, oc| {
                for (i, ov) in oc.iter_mut().enumerate() {
                    let k = ci * 4096 + i;
                    *ov = kernels::swiglu(g[k], u[k], clamp);
                }
            });
            Ok(())
        })
    }

    fn qat_fp8(&mut self, x: Slice, rows: usize, width: usize, n_dims: usize) -> BResult<()> {
        const OP: &str = "qat_fp8";
        if width == 0 {
            return Ok(());
        }
        self.with_out(x, OP, 16 * rows * n_dims, |_, v, par| {
            rows_mut(par, &mut v[..rows * width], width, |_, r| {
                kernels::qat_fp8_row(r, n_dims)
            });
            Ok(())
        })
    }

    fn qat_hadamard_fp4(&mut self, x: Slice, rows: usize, width: usize) -> BResult<()> {
        const OP: &str = "qat_hadamard_fp4";
        let work = rows * width * (16 + width.trailing_zeros() as usize);
        self.with_out(x, OP, work, |_, v, par| {
            rows_mut(par, &mut v[..rows * width], width, |_, r| {
                kernels::qat_h_fp4_row(r)
            });
            Ok(())
        })
    }

    fn embed(
        &mut self,
        table: Weight,
        tokens: IBuf,
        n_tok: usize,
        n_streams: usize,
        out: Slice,
    ) -> BResult<()> {
        const OP: &str = "embed";
        let (d, n_vocab) = (table.info.cols(), table.info.rows());
        self.with_out(out, OP, n_tok * n_streams * d, |this, o, par| {
            let tw = this.weight(table, OP)?;
            let toks = this.iview(tokens, OP)?;
            try_rows_mut(
                par,
                &mut o[..n_tok * n_streams * d],
                n_streams * d,
                |ti, row| {
                    let tok = toks[ti];
                    let tok = usize::try_from(tok)
                        .ok()
                        .filter(|&t| t < n_vocab)
                        .ok_or_else(|| BackendError::Invalid {
                            op: OP,
                            problem: format!("token {tok} outside the table of {n_vocab}"),
                        })?;
                    let (first, rest) = row.split_at_mut(d);
                    tw.table_row(tok, first)?;
                    for s in rest.chunks_mut(d) {
                        s.copy_from_slice(first);
                    }
                    Ok(())
                },
            )
        })
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
        const OP: &str = "hc_pre";
        let (n, d, t) = (a.n_hc, a.dim, a.n_tok);
        let nm = 2 * n + n * n;
        // Per token [pre | post | P], computed first (small), then the stream mix.
        let mut coef = vec![0f32; t * nm];
        let cref = &mut coef;
        self.with_out(y, OP, 2 * t * n * d, |this, yv, par| {
            let mv = this.view(mix, OP)?;
            let xv = this.view(x, OP)?;
            let bv = this.weight(base, OP)?.values(OP)?;
            let sv = this.weight(scale, OP)?.values(OP)?;
            rows_mut(par, cref, nm, |i, c| {
                kernels::hc_pre_coeffs(
                    &mv[i * nm..(i + 1) * nm],
                    &xv[i * n * d..(i + 1) * n * d],
                    bv,
                    sv,
                    n,
                    a.sinkhorn_iters,
                    a.hc_eps,
                    a.rms_eps,
                    c,
                )
            });
            let cv = &*cref;
            rows_mut(par, &mut yv[..t * d], d, |i, yr| {
                kernels::mix_streams(
                    &cv[i * nm..i * nm + n],
                    &xv[i * n * d..(i + 1) * n * d],
                    d,
                    yr,
                )
            });
            Ok(())
        })?;
        let mut pv = Vec::with_capacity(t * n);
        let mut cv = Vec::with_capacity(t * n * n);
        for c in coef.chunks(nm) {
            pv.extend_from_slice(&c[n..2 * n]);
            cv.extend_from_slice(&c[2 * n..]);
        }
        Backend::upload(self, post.sub(0, t * n), &pv)?;
        Backend::upload(self, comb.sub(0, t * n * n), &cv)
    }

    fn hc_post(&mut self, x: Slice, f: Slice, post: Slice, comb: Slice, a: HcArgs) -> BResult<()> {
        const OP: &str = "hc_post";
        let (n, d, t) = (a.n_hc, a.dim, a.n_tok);
        self.with_out(x, OP, t * n * n * d, |this, xv, par| {
            let (fv, pv, cv) = (
                this.view(f, OP)?,
                this.view(post, OP)?,
                this.view(comb, OP)?,
            );
            rows_mut(par, &mut xv[..t * n * d], n * d, |i, xr| {
                kernels::hc_post_token(
                    xr,
                    &fv[i * d..(i + 1) * d],
                    &pv[i * n..(i + 1) * n],
                    &cv[i * n * n..(i + 1) * n * n],
                    n,
                    d,
                )
            });
            Ok(())
        })
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
        const OP: &str = "hc_head";
        let (n, d, t) = (a.n_hc, a.dim, a.n_tok);
        self.with_out(y, OP, 2 * t * n * d, |this, yv, par| {
            let mv = this.view(mix, OP)?;
            let xv = this.view(x, OP)?;
            let bv = this.weight(base, OP)?.values(OP)?;
            let sv = this.weight(scale, OP)?.values(OP)?;
            rows_mut(par, &mut yv[..t * d], d, |i, yr| {
                let xs = &xv[i * n * d..(i + 1) * n * d];
                let w = kernels::hc_head_weights(
                    &mv[i * n..(i + 1) * n],
                    xs,
                    bv,
                    sv[0],
                    n,
                    a.hc_eps,
                    a.rms_eps,
                );
                kernels::mix_streams(&w, xs, d, yr)
            });
            Ok(())
        })
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
        const OP: &str = "compressor";
        let mut rows_v = self.bufs.take(rows.buf.id(), OP)?;
        let r = (|| {
            let rr = range(rows, rows_v.len(), OP)?;
            let rows_s = &mut rows_v[rr];
            let rows_s = &mut rows_s[..rows.len / a.width * a.width];
            let work = a.n_tok * a.width * 2 * a.ratio;
            self.with_out(acc, OP, work, |this, accv, par| {
                let uv = this.view(u, OP)?;
                let zv = this.view(z, OP)?;
                let apev = this.weight(ape, OP)?.values(OP)?;
                kernels::compressor(
                    par, accv, uv, zv, apev, a.pos0, a.n_tok, a.ratio, a.width, a.overlap, rows_s,
                )
            })
        })();
        self.bufs.put(rows.buf.id(), rows_v);
        r
    }

    fn indexer_topk(
        &mut self,
        q: Slice,
        w: Slice,
        rows: Slice,
        a: IndexerArgs,
        out: IBuf,
    ) -> BResult<()> {
        const OP: &str = "indexer_topk";
        let (t, k, hd, nh) = (a.n_tok, a.top_k, a.head_dim, a.n_heads);
        let n_last = (a.pos0 + t) / a.ratio;
        let scoring = n_last > k;
        let work = if scoring { t * n_last * nh * hd } else { 0 };
        self.with_iout(out, OP, work, |this, ov, par| {
            let rv = this.view(rows, OP)?;
            let (qv, wv) = if scoring {
                (this.view(q, OP)?, this.view(w, OP)?)
            } else {
                (&[][..], &[][..])
            };
            for (ti, o) in ov[..t * k].chunks_mut(k).enumerate() {
                let n_p = (a.pos0 + ti + 1) / a.ratio;
                o.fill(-1);
                let sel: Vec<usize> = if n_p <= k {
                    (0..n_p).collect()
                } else {
                    let s = kernels::indexer_scores(
                        par,
                        &qv[ti * nh * hd..(ti + 1) * nh * hd],
                        &wv[ti * nh..(ti + 1) * nh],
                        rv,
                        n_p,
                        nh,
                        hd,
                        a.weight_scale,
                    );
                    kernels::top_k_lowest_tie(&s, k)
                };
                for (dst, s) in o.iter_mut().zip(sel) {
                    *dst = s as i32;
                }
            }
            Ok(())
        })
    }

    fn attention(&mut self, a: AttnArgs) -> BResult<()> {
        const OP: &str = "attention";
        let (t, nh, hd, win) = (a.n_tok, a.n_head, a.head_dim, a.window);
        let last = a.pos0 + t; // exclusive end of positions
        let n_keys = win
            + match a.comp {
                CompSel::None => 0,
                CompSel::All { ratio, .. } => last / ratio.max(1),
                CompSel::Top { k, .. } => k,
            };
        self.with_out(a.out, OP, 2 * t * nh * hd * n_keys, |this, ov, par| {
            let qv = this.view(a.q, OP)?;
            let kvv = this.view(a.kv, OP)?;
            let ring = this.view(a.ring, OP)?;
            let sinks = this.weight(a.sinks, OP)?.values(OP)?;
            // Compressed rows and per-query selections.
            let (crows, ratio, sel): (&[f32], usize, Selection) = match a.comp {
                CompSel::None => (&[], 0, None),
                CompSel::All { rows, ratio } => (this.view(rows, OP)?, ratio, None),
                CompSel::Top {
                    rows,
                    ratio,
                    idx,
                    k,
                } => (this.view(rows, OP)?, ratio, Some((this.iview(idx, OP)?, k))),
            };
            let n_rows_avail = crows.len() / hd;
            // Keys per query, in a fixed order: raw window by position, then compressed rows.
            let mut keys_per_tok: Vec<Vec<&[f32]>> = Vec::with_capacity(t);
            for ti in 0..t {
                let p = a.pos0 + ti;
                let lo = (p + 1).saturating_sub(win);
                let mut keys: Vec<&[f32]> = Vec::new();
                for pos in lo..=p {
                    if pos < a.pos0 {
                        let s = pos % win;
                        keys.push(&ring[s * hd..(s + 1) * hd]);
                    } else {
                        let r = pos - a.pos0;
                        keys.push(&kvv[r * hd..(r + 1) * hd]);
                    }
                }
                if let Some(n_p) = (p + 1).checked_div(ratio) {
                    match sel {
                        None => {
                            for w in 0..n_p {
                                keys.push(&crows[w * hd..(w + 1) * hd]);
                            }
                        }
                        Some((iv, k)) => {
                            for &w in &iv[ti * k..(ti + 1) * k] {
                                if w < 0 {
                                    continue;
                                }
                                let w = w as usize;
                                if w >= n_p || w >= n_rows_avail {
                                    return Err(BackendError::Invalid {
                                        op: OP,
                                        problem: format!(
                                            "query at {p} selects row {w}, only {n_p} visible"
                                        ),
                                    });
                                }
                                keys.push(&crows[w * hd..(w + 1) * hd]);
                            }
                        }
                    }
                }
                keys_per_tok.push(keys);
            }
            rows_mut(par, &mut ov[..t * nh * hd], hd, |i, o| {
                let (ti, h) = (i / nh, i % nh);
                kernels::attend_head(
                    &qv[i * hd..(i + 1) * hd],
                    &keys_per_tok[ti],
                    sinks[h],
                    a.scale,
                    o,
                );
            });
            Ok(())
        })
    }

    fn ring_store(
        &mut self,
        ring: Slice,
        kv: Slice,
        pos0: usize,
        n_tok: usize,
        window: usize,
    ) -> BResult<()> {
        const OP: &str = "ring_store";
        let d = ring.len / window;
        self.with_out(ring, OP, 0, |this, rv, _| {
            let kvv = this.view(kv, OP)?;
            for ti in n_tok.saturating_sub(window)..n_tok {
                let s = (pos0 + ti) % window;
                rv[s * d..(s + 1) * d].copy_from_slice(&kvv[ti * d..(ti + 1) * d]);
            }
            Ok(())
        })
    }

    fn router(
        &mut self,
        logits: Slice,
        routing: Routing,
        a: RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()> {
        const OP: &str = "router";
        let (t, e, k) = (a.n_tok, a.n_expert, a.k);
        let mut idv = self.ibufs.take(ids.id(), OP)?;
        let idr = &mut idv;
        let r = self.with_out(weights, OP, 0, |this, wv, _| {
            let lv = this.view(logits, OP)?;
            for ti in 0..t {
                let l = &lv[ti * e..(ti + 1) * e];
                let chosen: Vec<usize> = match routing {
                    Routing::TopK { bias } => {
                        let b = match bias {
                            Some(b) => Some(this.weight(b, OP)?.values(OP)?),
                            None => None,
                        };
                        kernels::route_topk(l, b, k)
                    }
                    Routing::Hash { table, tokens } => {
                        let tw = this.weight(table, OP)?;
                        let toks = this.iview(tokens, OP)?;
                        let tok = toks.get(a.row0 + ti).copied().unwrap_or(-1);
                        let tok = usize::try_from(tok)
                            .ok()
                            .filter(|&x| x < tw.info.rows())
                            .ok_or_else(|| BackendError::Invalid {
                                op: OP,
                                problem: format!("token {tok} outside the hash table"),
                            })?;
                        let mut v = Vec::with_capacity(k);
                        for id in tw.i32_row(tok) {
                            let id =
                                usize::try_from(id).ok().filter(|&x| x < e).ok_or_else(|| {
                                    BackendError::Invalid {
                                        op: OP,
                                        problem: format!("hash table names expert {id} of {e}"),
                                    }
                                })?;
                            v.push(id);
                        }
                        v
                    }
                };
                kernels::route_weights(l, &chosen, a.scale, &mut wv[ti * k..(ti + 1) * k]);
                let r = a.row0 + ti;
                for (dst, c) in idr[r * k..(r + 1) * k].iter_mut().zip(&chosen) {
                    *dst = *c as i32;
                }
            }
            Ok(())
        });
        self.ibufs.put(ids.id(), idv);
        r
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
        const OP: &str = "moe";
        let (t, k) = (a.n_tok, a.k);
        let (d, f, ne) = (gate.info.cols(), gate.info.rows(), gate.info.mats());
        let q8 = self.q8_rows(t);
        self.with_out(out, OP, 3 * t * k * d * f, |this, ov, par| {
            let (gw, uw, dw) = (
                this.weight(gate, OP)?,
                this.weight(up, OP)?,
                this.weight(down, OP)?,
            );
            let xv = this.view(x, OP)?;
            let wv = this.view(weights, OP)?;
            let iv = this.iview(ids, OP)?;
            // (token, slot) pairs per expert, in token order.
            let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); ne];
            for (i, &e) in iv[..t * k].iter().enumerate() {
                let e = usize::try_from(e).ok().filter(|&e| e < ne).ok_or_else(|| {
                    BackendError::Invalid {
                        op: OP,
                        problem: format!("expert id {e} of {ne}"),
                    }
                })?;
                by_expert[e].push(i);
            }
            let mut per_slot = vec![0f32; t * k * d];
            for (e, pairs) in by_expert.iter().enumerate() {
                if pairs.is_empty() {
                    continue;
                }
                let n = pairs.len();
                let mut xs = vec![0f32; n * d];
                for (j, &i) in pairs.iter().enumerate() {
                    let ti = i / k;
                    xs[j * d..(j + 1) * d].copy_from_slice(&xv[ti * d..(ti + 1) * d]);
                }
                let mut g = vec![0f32; n * f];
                let mut u = vec![0f32; n * f];
                kernels::matmul(par, gw, e, 0, f, &xs, d, n, &mut g, f, q8)?;
                kernels::matmul(par, uw, e, 0, f, &xs, d, n, &mut u, f, q8)?;
                for (j, &i) in pairs.iter().enumerate() {
                    let wgt = wv[i];
                    for r in 0..f {
                        let h = kernels::swiglu(g[j * f + r], u[j * f + r], a.clamp);
                        g[j * f + r] = wgt * h;
                    }
                }
                let mut o = vec![0f32; n * d];
                kernels::matmul(par, dw, e, 0, d, &g, f, n, &mut o, d, q8)?;
                for (j, &i) in pairs.iter().enumerate() {
                    per_slot[i * d..(i + 1) * d].copy_from_slice(&o[j * d..(j + 1) * d]);
                }
            }
            rows_mut(par, &mut ov[..t * d], d, |ti, orow| {
                orow.fill(0.0);
                for s in 0..k {
                    let src = &per_slot[(ti * k + s) * d..(ti * k + s + 1) * d];
                    for (o, v) in orow.iter_mut().zip(src) {
                        *o += v;
                    }
                }
            });
            Ok(())
        })
    }
}
