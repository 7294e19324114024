//! Batch-1 and several-column GEMV launches (the GEMV module, `kernels/gemv.cu`), plain and
//! fused with their input (SwiGLU, RMSNorm, RoPE).

use super::*;

impl<D: GpuApi> GpuBackend<D> {
    /// Queues `m` (several decode rows of a Q8_0 matrix) through the several-column int8
    /// GEMV in groups of at most `cols_max` tokens; false (nothing queued) when the
    /// shape or alignment does not suit it. The warps per row are the one-token launch's,
    /// so every row is summed exactly as [`Self::mm_q8`] sums it alone.
    pub(super) fn mm_q8_cols(&mut self, m: Mm, op: &'static str) -> BResult<bool> {
        if m.ty != GgmlType::Q8_0 {
            return Ok(false);
        }
        let Ok(l) = self
            .gemv
            .q8_launch(GemvType::Q8_0, m.cols, m.n_rows, m.copies)
        else {
            return Ok(false);
        };
        let Some(w) = m.columns_base(&l) else {
            return Ok(false);
        };
        let c = ColsQ8 {
            w,
            group_bytes: 0,
            groups: 1,
            n_in: m.cols,
            n_out: m.n_rows,
            x: m.x,
            x_stride: m.x_stride,
            n_tok: m.n_tok,
            y: m.y,
            y_stride: m.y_stride,
        };
        self.q8_cols(c, &l, op)
    }

    /// Queues `c` through `ds4_quantize_q8_rows` (every input row quantized once) and the
    /// several-column Q8_0 GEMV in groups of at most `cols_max` tokens, launched as `l`
    /// (the one-token launch's warps per row); false (nothing queued) when the shape does not
    /// suit it: inputs wider than the kernel's shared memory takes for two tokens or not a
    /// multiple of 32, or a group's inputs not following each other.
    pub(super) fn q8_cols(&mut self, c: ColsQ8, l: &GemvLaunch, op: &'static str) -> BResult<bool> {
        let n_in = c.n_in;
        let per = self
            .gemv
            .cols_max
            .min(self.gemv.q8_cols_codes / n_in.max(1));
        if per < 2
            || n_in > self.gemv.q8_max_in
            || !n_in.is_multiple_of(32)
            || c.groups == 0
            || (c.groups > 1 && c.x_stride != c.groups * n_in)
        {
            return Ok(false);
        }
        // Rows (token, group): contiguous when grouped, else x_stride apart.
        let rows = c.n_tok * c.groups;
        let row_stride = if c.groups > 1 { n_in } else { c.x_stride };
        let q = self.scratch("q8c_codes", rows * n_in)?;
        let d = self.scratch("q8c_scales", 4 * rows * (n_in / 32))?;
        let s16 = self.scratch("q8c_sums", 4 * rows * (n_in / 16))?;
        // Within a matmul set the scratch may already hold this input's codes (only these
        // launches write it, and the set's matmuls write no input; docs/gpu.md §29). The
        // codes do not depend on the launch's block size.
        let key = (c.x, row_stride, n_in, rows);
        if self.q8_input_memo != Some(Some(key)) {
            self.launch_fn(
                &self.gemv.q8_quantize_rows,
                "quantize_q8_rows",
                (g32(rows), 1, 1),
                l.block,
                &[
                    Arg::Ptr(c.x),
                    u(row_stride),
                    i32a(op, "cols", n_in)?,
                    Arg::Ptr(q),
                    Arg::Ptr(d),
                    Arg::Ptr(s16),
                ],
            )?;
            if self.q8_input_memo.is_some() {
                self.q8_input_memo = Some(Some(key));
            }
        }
        let grid = (
            self.gemv.q8_grid_x(l.grid_x, g32(c.groups)),
            g32(c.groups),
            1,
        );
        let mut t = 0;
        while t < c.n_tok {
            let n = per.min(c.n_tok - t);
            let first = t * c.groups;
            let smem = self.gemv.q8_cols_smem(n * n_in);
            self.launch_fn_smem(
                &self.gemv.q8_cols,
                self.shape_name("gemvq_cols_q8_0", c.n_out, n_in, c.groups),
                grid,
                (l.block, smem),
                &[
                    Arg::Ptr(c.w),
                    u(c.group_bytes),
                    Arg::Ptr(q + (first * n_in) as u64),
                    Arg::Ptr(d + (4 * first * (n_in / 32)) as u64),
                    i32a(op, "groups", c.groups)?,
                    Arg::Ptr(c.y + (4 * t * c.y_stride) as u64),
                    u(c.y_stride),
                    i32a(op, "cols", n_in)?,
                    i32a(op, "rows", c.n_out)?,
                    i32a(op, "tokens", n)?,
                    Arg::I32(l.wpr as i32),
                ],
            )?;
            t += n;
        }
        Ok(true)
    }

    /// Queues `m` (decode rows of an F32 or F16 matrix: batched decode) through the
    /// several-column plain GEMV in groups of at most `cols_max` tokens, with the one-token
    /// launch's warps per row (its own rows per warp and grid, docs/gpu.md §35), so each
    /// token's row is summed as the one-token GEMV sums it; false when it does not apply.
    /// (Wider steps had gone to the generic matmul, whose other summation order broke
    /// batched-equals-alone at 16 sequences.)
    pub(super) fn mm_plain_cols(&mut self, m: Mm, op: &'static str) -> BResult<bool> {
        let idx = match m.ty {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            _ => return Ok(false),
        };
        let Ok(gty) = GemvType::from_ggml(m.ty) else {
            return Ok(false);
        };
        let Ok(l) = self
            .gemv
            .launch_for_grouped(gty, m.cols, m.n_rows, m.copies)
        else {
            return Ok(false);
        };
        let Some(wbase) = m.columns_base(&l) else {
            return Ok(false);
        };
        let per = self.gemv.cols_max;
        if per == 0 {
            return Ok(false);
        }
        self.launch_column_groups(idx, &l, wbase, m, per, op)?;
        Ok(true)
    }

    /// Launches `m`'s tokens through the several-column plain GEMV `idx` (0: F32, 1: F16)
    /// in groups of at most `per`, as `l`.
    fn launch_column_groups(
        &self,
        idx: usize,
        l: &GemvLaunch,
        wbase: u64,
        m: Mm,
        per: usize,
        op: &'static str,
    ) -> BResult<()> {
        let f = &self.gemv.plain_cols[idx];
        let label = if idx == 0 {
            "gemv_cols_f32"
        } else {
            "gemv_cols_f16"
        };
        let grid_x = crate::kernels::cols_grid_x(m.n_rows as u64, l.wpr, self.gemv.plain_cols_rows)
            .map_err(gerr(op))?;
        let mut t = 0;
        while t < m.n_tok {
            let n = per.min(m.n_tok - t);
            self.launch_fn(
                f,
                self.shape_name(label, m.n_rows, m.cols, n),
                (grid_x, 1, 1),
                l.block,
                &[
                    Arg::Ptr(wbase),
                    Arg::Ptr(m.x + (4 * t * m.x_stride) as u64),
                    u(m.x_stride),
                    Arg::Ptr(m.y + (4 * t * m.y_stride) as u64),
                    u(m.y_stride),
                    i32a(op, "cols", m.cols)?,
                    i32a(op, "rows", m.n_rows)?,
                    i32a(op, "tokens", n)?,
                    Arg::I32(l.wpr as i32),
                ],
            )?;
            t += n;
        }
        Ok(())
    }

    pub(super) fn mm_q8(&mut self, m: Mm, op: &'static str) -> BResult<()> {
        if m.cols > self.gemv.q8_max_in || !m.cols.is_multiple_of(32) {
            return Err(BackendError::Invalid {
                op,
                problem: format!(
                    "int8 activations: an input of {} values (at most {}, a multiple of 32)",
                    m.cols, self.gemv.q8_max_in
                ),
            });
        }
        let gty = GemvType::from_ggml(m.ty).map_err(gerr(op))?;
        let wbase = m.w + (m.row0 * m.row_bytes) as u64;
        if let (Ok(l), Some((f, _))) = (
            self.gemv.q8_launch(gty, m.cols, m.n_rows, m.copies),
            self.gemv.q8_functions(gty),
        ) {
            if l.row_bytes as usize == m.row_bytes
                && wbase.is_multiple_of(16)
                && m.x.is_multiple_of(16)
            {
                return self.launch_fn_smem(
                    f,
                    gty.label_q8(false),
                    (self.gemv.q8_grid_x(l.grid_x, 1), 1, 1),
                    (l.block, self.gemv.q8_smem(gty)),
                    &[
                        Arg::Ptr(wbase),
                        Arg::Ptr(m.x),
                        Arg::Ptr(m.y),
                        i32a(op, "cols", m.cols)?,
                        i32a(op, "rows", m.n_rows)?,
                        Arg::I32(l.wpr as i32),
                    ],
                );
            }
        }
        self.launch_fn(
            &self.gemv.q8_generic,
            "gemvq_generic",
            (g32(m.n_rows.div_ceil(8)), 1, 1),
            256,
            &[
                Arg::Ptr(wbase),
                Arg::I32(m.ty.code() as i32),
                u(m.row_bytes),
                Arg::Ptr(m.x),
                Arg::Ptr(m.y),
                i32a(op, "cols", m.cols)?,
                i32a(op, "rows", m.n_rows)?,
            ],
        )
    }

    /// One decode row of `out = W · swiglu(gate, up, clamp)` through the int8 GEMV that
    /// computes SwiGLU while it quantizes its input (`ds4_gemv_swiglu_q_<t>`, docs/gpu.md
    /// §17); `Ok(false)` (nothing launched) where the type, shape or alignment does not
    /// allow it. The caller has validated the shapes and checked the int8 rule.
    pub(in crate::backend) fn op_swiglu_gemv(
        &mut self,
        gate: Slice,
        up: Slice,
        clamp: f32,
        w: Weight,
        out: Slice,
    ) -> BResult<bool> {
        const OP: &str = "swiglu_matmul";
        let (gp, up_) = (self.fptr(gate, OP)?, self.fptr(up, OP)?);
        self.input_stage_gemv(OP, w, out, [gp, up_], Arg::F32(clamp), None, |g, t| {
            g.q8_swiglu_function(t)
        })
    }

    /// One decode row of `out = W · (rms_norm(x) · norm)` through the int8 GEMV that
    /// normalizes its input itself (`ds4_gemv_rmsnorm_q_<t>`, docs/gpu.md §17: the same
    /// scale as the one-row `ds4_rms_norm` launch, bit for bit), the normalized row also
    /// written to `h`; `Ok(false)` where it does not apply. The caller has validated the
    /// shapes and checked the int8 rule.
    pub(in crate::backend) fn op_rms_norm_gemv(
        &mut self,
        x: Slice,
        norm: Weight,
        eps: f32,
        h: Slice,
        w: Weight,
        out: Slice,
    ) -> BResult<bool> {
        const OP: &str = "rms_norm_matmul";
        let xp = self.fptr(x, OP)?;
        let np = self.wvec(norm, OP, w.info.cols())?;
        let hp = self.fptr(h, OP)?;
        if !hp.is_multiple_of(16) {
            return Ok(false);
        }
        self.input_stage_gemv(OP, w, out, [xp, np], Arg::F32(eps), Some(hp), |g, t| {
            g.q8_rmsnorm_function(t)
        })
    }

    /// One decode row of `out_a` with the attention output's de-rotation in its input
    /// stage (`ds4_gemv_grouped_rope_q_q8_0`, docs/gpu.md §17): all groups in one launch as
    /// `op_matmul_grouped`'s one-token path, each block rotating its heads on the way in;
    /// `Ok(false)` (nothing launched) where the weight is not Q8_0 in a grouped-GEMV shape,
    /// a group does not start at a head, or a pointer is misaligned.
    pub(in crate::backend) fn op_rope_grouped_gemv(
        &mut self,
        x: Slice,
        a: RopeArgs,
        w: Weight,
        groups: usize,
        y: Slice,
    ) -> BResult<bool> {
        const OP: &str = "rope_matmul_grouped";
        let (cols, rows) = (w.info.cols(), w.info.rows());
        let r = rows / groups.max(1);
        let gw = self.weight(w, OP)?;
        let (ty, row_bytes) = (gw.info.ty, gw.row_bytes);
        let (hd, rd) = (a.head_dim, a.freq.rope_dim);
        let wp = self.wraw(w, OP)?;
        let (xp, yp) = (self.fptr(x, OP)?, self.fptr(y, OP)?);
        let shape_ok = ty == GgmlType::Q8_0
            && groups > 0
            && a.n_rows == 1
            && a.row_pos.is_none()
            && hd > 0
            && a.n_heads * hd == groups * cols
            && cols.is_multiple_of(hd)
            && (hd - rd).is_multiple_of(4)
            && rd.is_multiple_of(4)
            && cols <= self.gemv.q8_max_in
            && cols.is_multiple_of(32)
            && self.grouped_ok(ty, cols, r, wp)
            && xp.is_multiple_of(16);
        if !shape_ok {
            return Ok(false);
        }
        let Ok(l) = self.gemv.q8_launch(GemvType::Q8_0, cols, r, groups as u64) else {
            return Ok(false);
        };
        if l.row_bytes as usize != row_bytes {
            return Ok(false);
        }
        let fp = self.freqs_ptr(&a)?;
        let grid = (self.gemv.q8_grid_x(l.grid_x, g32(groups)), g32(groups), 1);
        self.launch_fn(
            &self.gemv.q8_grouped_rope,
            GemvType::Q8_0.label_q8(true),
            grid,
            l.block,
            &[
                Arg::Ptr(wp),
                u(r * row_bytes),
                Arg::Ptr(xp),
                Arg::Ptr(fp),
                i32a(OP, "head dim", hd)?,
                i32a(OP, "rope dim", rd)?,
                Arg::F32(a.pos0 as f32),
                Arg::I32(i32::from(a.inverse)),
                Arg::Ptr(yp),
                i32a(OP, "n_in", cols)?,
                i32a(OP, "n_out", r)?,
                Arg::I32(l.wpr as i32),
            ],
        )?;
        Ok(true)
    }

    /// Launches a one-row int8 GEMV whose input stage forms the input from two vectors
    /// `inputs` and a constant (`(W, in0, in1, constant, y, n_in, n_out, wpr[, tail])`),
    /// picked by `pick`; `Ok(false)` (nothing launched) where the weight type has no such
    /// kernel, the input is too wide or not a multiple of 32, or a pointer is not 16-byte
    /// aligned.
    #[allow(clippy::too_many_arguments)]
    fn input_stage_gemv(
        &mut self,
        op: &'static str,
        w: Weight,
        out: Slice,
        inputs: [u64; 2],
        constant: Arg,
        tail: Option<u64>,
        pick: impl for<'a> Fn(&'a crate::backend::GemvSet<D>, GemvType) -> Option<&'a D::Function>,
    ) -> BResult<bool> {
        let (cols, rows) = (w.info.cols(), w.info.rows());
        let gw = self.weight(w, op)?;
        let (ty, row_bytes) = (gw.info.ty, gw.row_bytes);
        let Ok(gt) = GemvType::from_ggml(ty) else {
            return Ok(false);
        };
        if !ds4_gguf::quant::q8act::applies(ty)
            || cols > self.gemv.q8_max_in
            || !cols.is_multiple_of(32)
        {
            return Ok(false);
        }
        let (Ok(l), Some(f)) = (self.gemv.q8_launch(gt, cols, rows, 1), pick(&self.gemv, gt))
        else {
            return Ok(false);
        };
        let wp = self.wraw(w, op)?;
        let yp = self.fptr(out, op)?;
        if l.row_bytes as usize != row_bytes
            || !wp.is_multiple_of(16)
            || inputs.iter().any(|p| !p.is_multiple_of(16))
        {
            return Ok(false);
        }
        let mut args = vec![
            Arg::Ptr(wp),
            Arg::Ptr(inputs[0]),
            Arg::Ptr(inputs[1]),
            constant,
            Arg::Ptr(yp),
            i32a(op, "cols", cols)?,
            i32a(op, "rows", rows)?,
            Arg::I32(l.wpr as i32),
        ];
        args.extend(tail.map(Arg::Ptr));
        let grid = (self.gemv.q8_grid_x(l.grid_x, 1), 1, 1);
        self.launch_fn(f, gt.label_q8(false), grid, l.block, &args)?;
        Ok(true)
    }
}
