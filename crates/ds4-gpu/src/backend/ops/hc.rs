//! The embedding into the streams and mHC: HCPre, the fused HC mix, HCPost and the HC head
//! (`kernels/hc.cu`).

use super::*;

impl<D: GpuApi> GpuBackend<D> {
    pub(in crate::backend) fn op_embed(
        &mut self,
        table: Weight,
        tokens: IBuf,
        n_tok: usize,
        n_streams: usize,
        out: Slice,
    ) -> BResult<()> {
        const OP: &str = "embed";
        let (d, n_vocab) = (table.info.cols(), table.info.rows());
        if n_tok == 0 {
            return Ok(());
        }
        // The embedding starts every forward pass: overlapped launches for decode-sized
        // passes, plain ones for prefill chunks, where overlap measured slower (see
        // BENCHMARKS.md, overlapped launches; docs/gpu.md §6).
        self.dev
            .set_overlapped_launches(n_tok <= OVERLAP_MAX_TOKENS);
        let gw = self.weight(table, OP)?;
        let (ty, rb) = (gw.info.ty, gw.row_bytes);
        let tp = self.wraw(table, OP)?;
        let (ip, op_) = (self.iptr(tokens, OP)?, self.fptr(out, OP)?);
        self.launch(
            "ds4_embed",
            (g32(n_tok), 1, 1),
            256,
            &[
                Arg::Ptr(tp),
                Arg::I32(ty.code() as i32),
                u(rb),
                i32a(OP, "vocab", n_vocab)?,
                Arg::Ptr(ip),
                i32a(OP, "streams", n_streams)?,
                i32a(OP, "width", d)?,
                Arg::Ptr(op_),
                Arg::Ptr(self.fault_ptr()),
            ],
        )
    }

    #[allow(clippy::too_many_arguments)]
    /// HCPre; with `norm = Some((w, out))` also `out = rms_norm(y) · w` in the same kernel.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::backend) fn op_hc_pre(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        a: HcArgs,
        y: Slice,
        post: Slice,
        comb: Slice,
        norm: Option<(Weight, Slice)>,
    ) -> BResult<()> {
        const OP: &str = "hc_pre";
        let (n, d, t) = (a.n_hc, a.dim, a.n_tok);
        if n == 0 || n > 8 {
            return Err(BackendError::Invalid {
                op: OP,
                problem: format!("{n} streams (1..=8 supported)"),
            });
        }
        let nm = 2 * n + n * n;
        if t == 0 {
            return Ok(());
        }
        let (bp, sp) = (self.wvec(base, OP, nm)?, self.wvec(scale, OP, 3)?);
        let (nw, np) = match norm {
            Some((w, out)) => (self.wvec(w, OP, d)?, self.fptr(out.sub(0, t * d), OP)?),
            None => (0, 0),
        };
        let args = [
            Arg::Ptr(self.fptr(mix, OP)?),
            Arg::Ptr(self.fptr(x, OP)?),
            Arg::Ptr(bp),
            Arg::Ptr(sp),
            i32a(OP, "streams", n)?,
            i32a(OP, "dim", d)?,
            i32a(OP, "iterations", a.sinkhorn_iters)?,
            Arg::F32(a.hc_eps),
            Arg::F32(a.rms_eps),
            Arg::Ptr(self.fptr(y, OP)?),
            Arg::Ptr(self.fptr(post, OP)?),
            Arg::Ptr(self.fptr(comb, OP)?),
            Arg::Ptr(nw),
            Arg::Ptr(np),
        ];
        // Decode-sized passes of the model's shape: everything in registers (one global
        // round trip, one block reduction; `ds4_hc_pre_regs`). Prefill keeps the general
        // kernel.
        if t <= OVERLAP_MAX_TOKENS && n <= HC_REGS_MAX_STREAMS && d <= HC_REGS_MAX_DIM {
            return self.launch("ds4_hc_pre_regs", (g32(t), 1, 1), HC_REGS_THREADS, &args);
        }
        self.launch("ds4_hc_pre", (g32(t), 1, 1), row_threads(t), &args)
    }

    /// The mixing matmul and HCPre + RMSNorm in two kernels (`ds4_hc_mix_part`,
    /// `ds4_hc_mix_apply`; docs/gpu.md §11) for decode-sized passes of the model's shape;
    /// `Ok(false)` (nothing launched) where they do not apply, for the caller's two ops.
    /// With `prev`, the part kernel first applies the previous sublayer's HCPost to the
    /// columns it reads (one launch and one pass over `x` fewer).
    #[allow(clippy::too_many_arguments)]
    pub(in crate::backend) fn op_hc_mix_pre(
        &mut self,
        prev: Option<HcPost>,
        fn_: Weight,
        x: Slice,
        mix: Slice,
        base: Weight,
        scale: Weight,
        a: HcArgs,
        y: Slice,
        post: Slice,
        comb: Slice,
        (norm, out): (Weight, Slice),
    ) -> BResult<bool> {
        const OP: &str = "hc_mix_pre_norm";
        let (n, d, t) = (a.n_hc, a.dim, a.n_tok);
        let nm = 2 * n + n * n;
        let gw = self.weight(fn_, OP)?;
        let tpb = t >= super::HC_MIX_TPB_FROM;
        let kernel = match (gw.info.ty, tpb) {
            (GgmlType::F16, false) => "ds4_hc_mix_part_f16",
            (GgmlType::F32, false) => "ds4_hc_mix_part_f32",
            (GgmlType::F16, true) => "ds4_hc_mix_part_tpb_f16",
            (GgmlType::F32, true) => "ds4_hc_mix_part_tpb_f32",
            _ => return Ok(false),
        };
        let fits = t > 0
            && t <= OVERLAP_MAX_TOKENS
            && (1..=HC_REGS_MAX_STREAMS).contains(&n)
            && d.is_multiple_of(2)
            && fn_.info.rows() == nm
            && fn_.info.cols() == n * d;
        if !fits {
            return Ok(false);
        }
        let wp = self.wraw(fn_, OP)?;
        if !wp.is_multiple_of(8) {
            return Ok(false);
        }
        let nb = d.div_ceil(HC_MIX_COLS);
        if nb > HC_MIX_MAX_PARTS {
            return Ok(false);
        }
        let (fbytes, dbytes) = (t * nb * nm * 4, t * nb * HC_MIX_GRAM * 8);
        let foff = dbytes.next_multiple_of(8);
        let part = self.scratch("hc_mix", foff + fbytes)?;
        let (pd, pf) = (part, part + foff as u64);
        let (xp, nb32) = (self.fptr(x, OP)?, i32a(OP, "blocks", nb)?);
        let dims = [
            i32a(OP, "streams", n)?,
            i32a(OP, "dim", d)?,
            i32a(OP, "mix", nm)?,
        ];
        let prev_ptrs = match prev {
            Some(p) => [
                self.fptr(p.f, OP)?,
                match p.f2 {
                    Some(f2) => self.fptr(f2, OP)?,
                    None => 0,
                },
                self.fptr(p.post, OP)?,
                self.fptr(p.comb, OP)?,
            ],
            None => [0; 4],
        };
        let mut args = vec![Arg::Ptr(wp), Arg::Ptr(xp)];
        args.extend(dims);
        args.extend([Arg::Ptr(pf), Arg::Ptr(pd)]);
        args.extend(prev_ptrs.map(Arg::Ptr));
        if tpb {
            args.push(i32a(OP, "tokens", t)?);
            let rows = g32(t.div_ceil(HC_MIX_TPB));
            self.launch(kernel, (g32(nb), rows, 1), HC_MIX_THREADS, &args)?;
        } else {
            self.launch(kernel, (g32(nb), g32(t), 1), HC_MIX_THREADS, &args)?;
        }
        let (bp, sp) = (self.wvec(base, OP, nm)?, self.wvec(scale, OP, 3)?);
        let (nw, np) = (self.wvec(norm, OP, d)?, self.fptr(out.sub(0, t * d), OP)?);
        let args = [
            Arg::Ptr(pf),
            Arg::Ptr(pd),
            nb32,
            Arg::Ptr(xp),
            Arg::Ptr(bp),
            Arg::Ptr(sp),
            dims[0],
            dims[1],
            dims[2],
            i32a(OP, "iterations", a.sinkhorn_iters)?,
            Arg::F32(a.hc_eps),
            Arg::F32(a.rms_eps),
            Arg::Ptr(self.fptr(mix, OP)?),
            Arg::Ptr(self.fptr(y, OP)?),
            Arg::Ptr(self.fptr(post, OP)?),
            Arg::Ptr(self.fptr(comb, OP)?),
            Arg::Ptr(nw),
            Arg::Ptr(np),
        ];
        let grid = g32(d.div_ceil(HC_MIX_THREADS as usize) + 1);
        self.launch("ds4_hc_mix_apply", (grid, g32(t), 1), HC_MIX_THREADS, &args)?;
        Ok(true)
    }

    /// HCPost; with `f2 = Some(s)`, `f += s` first in the same kernel.
    pub(in crate::backend) fn op_hc_post(
        &mut self,
        x: Slice,
        f: Slice,
        f2: Option<Slice>,
        post: Slice,
        comb: Slice,
        a: HcArgs,
    ) -> BResult<()> {
        const OP: &str = "hc_post";
        let (n, d, t) = (a.n_hc, a.dim, a.n_tok);
        if n == 0 || n > 8 {
            return Err(BackendError::Invalid {
                op: OP,
                problem: format!("{n} streams (1..=8 supported)"),
            });
        }
        if t * d == 0 {
            return Ok(());
        }
        let f2p = match f2 {
            Some(s) => self.fptr(s, OP)?,
            None => 0,
        };
        let mut args = vec![
            Arg::Ptr(self.fptr(x, OP)?),
            Arg::Ptr(self.fptr(f, OP)?),
            Arg::Ptr(f2p),
            Arg::Ptr(self.fptr(post, OP)?),
            Arg::Ptr(self.fptr(comb, OP)?),
            i32a(OP, "tokens", t)?,
        ];
        if n == self.hc_post4 {
            // Tokens on the grid's y (docs/gpu.md §21): no per-element division; the stream
            // count is the kernel's own.
            args.push(i32a(OP, "dim", d)?);
            let grid = (g32(d.div_ceil(256)), g32(t.min(65_535)), 1);
            return self.launch("ds4_hc_post4", grid, 256, &args);
        }
        args.extend([i32a(OP, "streams", n)?, i32a(OP, "dim", d)?]);
        self.launch("ds4_hc_post", (grid_for(t * d), 1, 1), 256, &args)
    }

    pub(in crate::backend) fn op_hc_head(
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
        if n == 0 || n > 8 {
            return Err(BackendError::Invalid {
                op: OP,
                problem: format!("{n} streams (1..=8 supported)"),
            });
        }
        if t == 0 {
            return Ok(());
        }
        let (bp, sp) = (self.wvec(base, OP, n)?, self.wvec(scale, OP, 1)?);
        let args = [
            Arg::Ptr(self.fptr(mix, OP)?),
            Arg::Ptr(self.fptr(x, OP)?),
            Arg::Ptr(bp),
            Arg::Ptr(sp),
            i32a(OP, "streams", n)?,
            i32a(OP, "dim", d)?,
            Arg::F32(a.hc_eps),
            Arg::F32(a.rms_eps),
            Arg::Ptr(self.fptr(y, OP)?),
        ];
        self.launch("ds4_hc_head", (g32(t), 1, 1), 256, &args)
    }
}
