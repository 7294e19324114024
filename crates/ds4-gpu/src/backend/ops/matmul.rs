//! Matmuls: the dispatcher (`mm`: GEMV, tiles, panels or the dense half-precision GEMM),
//! the f32 panels of `dequant.cu`, and the matmul ops.

use super::*;

impl<D: GpuApi> GpuBackend<D> {
    /// The int8-activation rule (`Backend::set_activation_q8`, `set_decode_rows`): on, and
    /// no more tokens than decode rows.
    pub(in crate::backend) fn q8_rows(&self, n_tok: usize) -> bool {
        self.act_q8 && n_tok <= self.decode_rows
    }

    /// Queues one matmul by the best path for its shape.
    pub(super) fn mm(&mut self, m: Mm, op: &'static str) -> BResult<()> {
        if m.n_rows == 0 || m.n_tok == 0 {
            return Ok(());
        }
        let gty = GemvType::from_ggml(m.ty).ok();
        if m.q8 && ds4_gguf::quant::q8act::applies(m.ty) {
            // Decode rows: each token as it runs alone; Q8_0 several tokens per launch
            // (the same sums, the matrix read once for all of them).
            if m.n_tok > 1 && self.mm_q8_cols(m, op)? {
                return Ok(());
            }
            for t in 0..m.n_tok {
                self.mm_q8(
                    Mm {
                        x: m.x + (4 * t * m.x_stride) as u64,
                        y: m.y + (4 * t * m.y_stride) as u64,
                        n_tok: 1,
                        ..m
                    },
                    op,
                )?;
            }
            return Ok(());
        }
        if m.n_tok == 1 {
            if let Some(gty) = gty {
                let wbase = m.w + (m.row0 * m.row_bytes) as u64;
                if let Ok(l) = self
                    .gemv
                    .launch_for_grouped(gty, m.cols, m.n_rows, m.copies)
                {
                    if l.row_bytes as usize == m.row_bytes
                        && wbase.is_multiple_of(16)
                        && m.x.is_multiple_of(16)
                    {
                        let f = self.gemv.function(gty);
                        return self.launch_fn(
                            f,
                            gty.label(false),
                            (l.grid_x, 1, 1),
                            l.block,
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
            }
        }
        // Batched decode only for now: the several-column GEMV has been checked in the
        // kernel emulation, not yet on a GPU, so short prompt evaluations keep their kernel.
        if self.decode_rows > 1 && m.n_tok <= self.decode_rows && self.mm_plain_cols(m, op)? {
            return Ok(());
        }
        let ty = Arg::I32(m.ty.code() as i32);
        if m.n_tok < self.panel_from_tokens {
            return self.launch(
                "ds4_matmul_generic",
                (g32(m.n_rows.div_ceil(8)), g32(m.n_tok.div_ceil(4)), 1),
                256,
                &[
                    Arg::Ptr(m.w),
                    ty,
                    u(m.row_bytes),
                    u(m.row0),
                    i32a(op, "rows", m.n_rows)?,
                    i32a(op, "cols", m.cols)?,
                    Arg::Ptr(m.x),
                    u(m.x_stride),
                    i32a(op, "tokens", m.n_tok)?,
                    Arg::Ptr(m.y),
                    u(m.y_stride),
                ],
            );
        }
        if self.tiles == PrefillTiles::All && self.tiles_ok(m.ty, m.cols, m.w, m.row_bytes) {
            return self.mm_tiles(m, op);
        }
        // Q8_0 (split layout) rows with 16-byte aligned code runs take the vectorised kernel.
        let q8_fast = m.ty == GgmlType::Q8_0
            && m.cols.is_multiple_of(32)
            && m.row_bytes.is_multiple_of(16)
            && (m.w + (m.row0 * m.row_bytes) as u64).is_multiple_of(16);
        // Dequantized panels of rows, then the f32 GEMM.
        let panel_rows = (PANEL_ELEMS / m.cols.max(1)).clamp(1, m.n_rows);
        let panel = self.scratch("panel", 4 * panel_rows * m.cols)?;
        let mut r = 0;
        while r < m.n_rows {
            let n = panel_rows.min(m.n_rows - r);
            if q8_fast {
                self.q8_panel(&m, r, n, panel, op)?;
            } else {
                self.launch(
                    "ds4_dequant_rows",
                    (grid_for(n * m.cols), 1, 1),
                    256,
                    &[
                        Arg::Ptr(m.w),
                        ty,
                        u(m.row_bytes),
                        u(m.row0 + r),
                        i32a(op, "rows", n)?,
                        i32a(op, "cols", m.cols)?,
                        Arg::Ptr(panel),
                    ],
                )?;
            }
            if let Some(cb) = &self.cublas {
                // The device-time profile charges what follows to the GEMM, not to the
                // panel's dequantization before it.
                self.mark_launch("cublas_gemm_nt")?;
                // SAFETY: x holds n_tok rows of x_stride (checked by the op), the panel
                // n rows of cols, y n_tok rows of y_stride from column r; all device
                // memory of this context, alive until the stream drains.
                unsafe {
                    cb.gemm_nt(
                        m.x,
                        m.x_stride,
                        panel,
                        m.cols,
                        m.y + 4 * r as u64,
                        m.y_stride,
                        m.n_tok,
                        n,
                        m.cols,
                    )
                }
                .map_err(gerr(op))?;
                r += n;
                continue;
            }
            self.launch(
                "ds4_gemm_nt",
                (g32(n.div_ceil(64)), g32(m.n_tok.div_ceil(64)), 1),
                256,
                &[
                    Arg::Ptr(m.x),
                    u(m.x_stride),
                    Arg::Ptr(panel),
                    u(m.cols),
                    Arg::Ptr(m.y + 4 * r as u64),
                    u(m.y_stride),
                    i32a(op, "tokens", m.n_tok)?,
                    i32a(op, "rows", n)?,
                    i32a(op, "cols", m.cols)?,
                ],
            )?;
            r += n;
        }
        Ok(())
    }

    /// Rows `r..r + n` of a split-layout Q8_0 matmul decoded into the f32 `panel`
    /// (`ds4_dequant_q8_rows`, one thread per 16 codes).
    fn q8_panel(&self, m: &Mm, r: usize, n: usize, panel: u64, op: &'static str) -> BResult<()> {
        self.launch(
            "ds4_dequant_q8_rows",
            (g32(n), g32(m.cols.div_ceil(16 * 256)), 1),
            256,
            &[
                Arg::Ptr(m.w),
                u(m.row_bytes),
                u(m.row0 + r),
                i32a(op, "cols", m.cols)?,
                Arg::Ptr(panel),
            ],
        )
    }

    /// The matmul's activations (n_tok rows of cols, row stride x_stride) as contiguous
    /// halves in scratch, for the tile kernels.
    pub(super) fn x_as_half(&mut self, m: &Mm, op: &'static str) -> BResult<u64> {
        let xh = self.scratch("tiles_xd", 2 * m.n_tok * m.cols)?;
        self.launch(
            "ds4_to_half",
            (grid_for(m.n_tok * m.cols), 1, 1),
            256,
            &[
                Arg::Ptr(m.x),
                u(m.x_stride),
                i32a(op, "tokens", m.n_tok)?,
                i32a(op, "cols", m.cols)?,
                Arg::Ptr(xh),
            ],
        )?;
        Ok(xh)
    }

    pub(in crate::backend) fn op_matmul(
        &mut self,
        w: Weight,
        mat: usize,
        x: Slice,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()> {
        self.matmul_copies(w, mat, x, n_tok, y, 1)
    }

    /// [`Self::op_matmul`] with the warps per row of a one-token launch of `copies`
    /// matrices side by side ([`Mm::copies`]).
    fn matmul_copies(
        &mut self,
        w: Weight,
        mat: usize,
        x: Slice,
        n_tok: usize,
        y: Slice,
        copies: u64,
    ) -> BResult<()> {
        const OP: &str = "matmul";
        let (cols, rows) = (w.info.cols(), w.info.rows());
        let gw = self.weight(w, OP)?;
        let (ty, row_bytes) = (gw.info.ty, gw.row_bytes);
        let wp = self.wraw(w, OP)? + (mat * rows * row_bytes) as u64;
        let (xp, yp) = (self.fptr(x, OP)?, self.fptr(y, OP)?);
        self.mm(
            Mm {
                w: wp,
                ty,
                row_bytes,
                row0: 0,
                n_rows: rows,
                cols,
                x: xp,
                x_stride: cols,
                n_tok,
                y: yp,
                y_stride: rows,
                q8: self.q8_rows(n_tok),
                copies,
            },
            OP,
        )
    }

    pub(in crate::backend) fn op_matmul_grouped(
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
        let gw = self.weight(w, OP)?;
        let (ty, row_bytes) = (gw.info.ty, gw.row_bytes);
        let wp = self.wraw(w, OP)?;
        let (xp, yp) = (self.fptr(x, OP)?, self.fptr(y, OP)?);
        // One token: all groups in one launch of the grouped GEMV (group g = "expert" g of
        // r rows reading its own slice of x), instead of one launch per group. Several
        // tokens (decode rows) run per group with that launch's warps per row.
        let one_launch = groups <= IOTA_LEN
            && self.grouped_ok(ty, cols, r, wp)
            && xp.is_multiple_of(16)
            && (4 * cols).is_multiple_of(16);
        if n_tok == 1 && one_launch {
            let ids = self.iota()?;
            return self.grouped(
                ty,
                (wp, None),
                r * row_bytes,
                ids,
                groups,
                xp,
                1,
                (yp, None),
                (groups, groups),
                cols,
                r,
                self.act_q8,
            );
        }
        let copies = if one_launch { groups as u64 } else { 1 };
        // Decode rows of a Q8_0 out_a: every group in one several-column launch per 8 tokens
        // (grid y = group) with that one-token launch's warps per row.
        if n_tok > 1 && one_launch && self.q8_rows(n_tok) && ty == GgmlType::Q8_0 {
            if let Ok(l) = self.gemv.q8_launch(GemvType::Q8_0, cols, r, copies) {
                if l.row_bytes as usize == row_bytes && (r * row_bytes).is_multiple_of(16) {
                    let c = ColsQ8 {
                        w: wp,
                        group_bytes: r * row_bytes,
                        groups,
                        n_in: cols,
                        n_out: r,
                        x: xp,
                        x_stride: groups * cols,
                        n_tok,
                        y: yp,
                        y_stride: rows,
                    };
                    if self.q8_cols(c, &l, OP)? {
                        return Ok(());
                    }
                }
            }
        }
        for g in 0..groups {
            self.mm(
                Mm {
                    w: wp,
                    ty,
                    row_bytes,
                    row0: g * r,
                    n_rows: r,
                    cols,
                    x: xp + (4 * g * cols) as u64,
                    x_stride: groups * cols,
                    n_tok,
                    y: yp + (4 * g * r) as u64,
                    y_stride: rows,
                    q8: self.q8_rows(n_tok),
                    copies,
                },
                OP,
            )?;
        }
        Ok(())
    }

    /// Two same-shaped matmuls on one input: one grouped-GEMV launch (matrix z of the grid
    /// = which weight) for a single token, else two matmuls.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::backend) fn op_matmul_pair(
        &mut self,
        wa: Weight,
        wb: Weight,
        x: Slice,
        n_tok: usize,
        ya: Slice,
        yb: Slice,
    ) -> BResult<()> {
        const OP: &str = "matmul_pair";
        if wa.info != wb.info || wa.info.mats() != 1 {
            self.op_matmul(wa, 0, x, n_tok, ya)?;
            return self.op_matmul(wb, 0, x, n_tok, yb);
        }
        let (cols, rows) = (wa.info.cols(), wa.info.rows());
        let ty = self.weight(wa, OP)?.info.ty;
        let (pa, pb) = (self.wraw(wa, OP)?, self.wraw(wb, OP)?);
        let xp = self.fptr(x, OP)?;
        if !(self.grouped_ok(ty, cols, rows, pa)
            && self.grouped_ok(ty, cols, rows, pb)
            && xp.is_multiple_of(16))
        {
            self.op_matmul(wa, 0, x, n_tok, ya)?;
            return self.op_matmul(wb, 0, x, n_tok, yb);
        }
        if n_tok != 1 {
            // Decode rows: each token summed as its one-token pair launch sums it, the
            // input quantized once for both.
            return self.input_once(n_tok, |b| {
                b.matmul_copies(wa, 0, x, n_tok, ya, 2)?;
                b.matmul_copies(wb, 0, x, n_tok, yb, 2)
            });
        }
        let (ap, bp) = (self.fptr(ya, OP)?, self.fptr(yb, OP)?);
        let ids = self.iota()?;
        self.grouped(
            ty,
            (pa, Some(pb)),
            0,
            ids,
            1,
            xp,
            0,
            (ap, Some(bp)),
            (1, 1),
            cols,
            rows,
            self.act_q8,
        )
    }

    /// [`ds4_engine::Backend::matmul_set`]: each matrix as its own op would run it (pairs
    /// through [`Self::op_matmul_pair`]), the input's int8 codes made once for all of them
    /// at decode rows (docs/gpu.md §29).
    pub(in crate::backend) fn op_matmul_set(
        &mut self,
        x: Slice,
        n_tok: usize,
        singles: &[(Weight, Slice)],
        pairs: &[ds4_engine::MatmulPair],
    ) -> BResult<()> {
        self.input_once(n_tok, |b| {
            for &(w, y) in singles {
                b.op_matmul(w, 0, x, n_tok, y)?;
            }
            for p in pairs {
                b.op_matmul_pair(p.wa, p.wb, x, n_tok, p.ya, p.yb)?;
            }
            Ok(())
        })
    }

    /// Runs `f` (matmuls of one input that write no input) with the several-column GEMVs'
    /// quantized input kept between its launches: a launch whose input was quantized
    /// before in `f` reuses the codes. Nested calls join the outer one.
    fn input_once(
        &mut self,
        n_tok: usize,
        f: impl FnOnce(&mut Self) -> BResult<()>,
    ) -> BResult<()> {
        let own = n_tok > 1 && self.q8_input_memo.is_none();
        if own {
            self.q8_input_memo = Some(None);
        }
        let r = f(self);
        if own {
            self.q8_input_memo = None;
        }
        r
    }
}
