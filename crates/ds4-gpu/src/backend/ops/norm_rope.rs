//! RMSNorm, RoPE, the QAT simulations and their fused forms (`kernels/norm_rope.cu`).

use super::*;

impl<D: GpuApi> GpuBackend<D> {
    pub(in crate::backend) fn op_rms_norm(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        rows: usize,
        width: usize,
        eps: f32,
        out: Slice,
    ) -> BResult<()> {
        const OP: &str = "rms_norm";
        if width == 0 || rows == 0 {
            return Ok(());
        }
        let wp = match w {
            Some(w) => self.wvec(w, OP, width)?,
            None => 0,
        };
        let (xp, op_) = (self.fptr(x, OP)?, self.fptr(out, OP)?);
        self.launch(
            "ds4_rms_norm",
            (g32(rows), 1, 1),
            row_threads(rows),
            &[
                Arg::Ptr(xp),
                Arg::Ptr(wp),
                Arg::Ptr(op_),
                i32a(OP, "width", width)?,
                Arg::F32(eps),
            ],
        )
    }

    pub(super) fn freqs_ptr(&mut self, a: &RopeArgs) -> BResult<u64> {
        let f = &a.freq;
        let y = f.yarn;
        let key = [
            f.base.to_bits(),
            f.rope_dim as u32,
            u32::from(y.is_some()),
            y.map_or(0, |y| y.factor.to_bits()),
            y.map_or(0, |y| y.original_context as u32),
            y.map_or(0, |y| y.beta_fast.to_bits()),
            y.map_or(0, |y| y.beta_slow.to_bits()),
        ];
        if !self.freqs.contains_key(&key) {
            let v = rope_freqs(f);
            let raw: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            let mut b = self
                .dev
                .alloc(MemKind::Device, raw.len().max(4))
                .map_err(gerr("rope"))?;
            b.write(0, &raw).map_err(gerr("rope"))?;
            self.freqs.insert(key, b);
        }
        Ok(self.freqs[&key].device_address())
    }

    /// The device address of `a.row_pos` (0: positions from `pos0`/`pos_step`).
    fn row_pos_ptr(&self, a: &RopeArgs, op: &'static str) -> BResult<u64> {
        a.row_pos.map_or(Ok(0), |p| self.iptr(p, op))
    }

    pub(in crate::backend) fn op_rope(&mut self, x: Slice, a: RopeArgs) -> BResult<()> {
        const OP: &str = "rope";
        let rd = a.freq.rope_dim;
        let n = a.n_rows * a.n_heads * (rd / 2);
        if n == 0 {
            return Ok(());
        }
        let fp = self.freqs_ptr(&a)?;
        let xp = self.fptr(x, OP)?;
        let pp = self.row_pos_ptr(&a, OP)?;
        self.launch(
            "ds4_rope",
            (grid_for(n), 1, 1),
            256,
            &[
                Arg::Ptr(xp),
                Arg::Ptr(fp),
                i32a(OP, "rows", a.n_rows)?,
                i32a(OP, "heads", a.n_heads)?,
                i32a(OP, "head dim", a.head_dim)?,
                i32a(OP, "rope dim", rd)?,
                u(a.pos0),
                u(a.pos_step),
                Arg::Ptr(pp),
                Arg::I32(i32::from(a.inverse)),
            ],
        )
    }

    pub(in crate::backend) fn op_qat_fp8(
        &mut self,
        x: Slice,
        rows: usize,
        width: usize,
        n_dims: usize,
    ) -> BResult<()> {
        const OP: &str = "qat_fp8";
        let n = rows * n_dims.div_ceil(64);
        if n == 0 {
            return Ok(());
        }
        let xp = self.fptr(x, OP)?;
        // One 32-lane warp per 64-value block.
        self.launch(
            "ds4_qat_fp8",
            (grid_for(n * 32), 1, 1),
            256,
            &[
                Arg::Ptr(xp),
                i32a(OP, "rows", rows)?,
                i32a(OP, "width", width)?,
                i32a(OP, "dims", n_dims)?,
            ],
        )
    }

    pub(in crate::backend) fn op_qat_hfp4(
        &mut self,
        x: Slice,
        rows: usize,
        width: usize,
    ) -> BResult<()> {
        const OP: &str = "qat_hadamard_fp4";
        if !width.is_power_of_two() || width > 4096 {
            return Err(BackendError::Invalid {
                op: OP,
                problem: format!("width {width} is not a power of two up to 4096"),
            });
        }
        if rows == 0 {
            return Ok(());
        }
        if width < 32 {
            return Err(BackendError::Invalid {
                op: OP,
                problem: format!("width {width} is less than one FP4 block of 32"),
            });
        }
        let norm = (1.0 / (width as f64).sqrt()) as f32;
        let xp = self.fptr(x, OP)?;
        self.launch(
            "ds4_qat_hfp4",
            (g32(rows), 1, 1),
            256,
            &[Arg::Ptr(xp), i32a(OP, "width", width)?, Arg::F32(norm)],
        )
    }

    /// One block per row: RoPE, then the Hadamard FP4 simulation, when the rows are the
    /// rotated heads (one row per head, width = head dim, forward rotation); else the two
    /// launches.
    pub(in crate::backend) fn op_rope_qat_hfp4(
        &mut self,
        x: Slice,
        a: RopeArgs,
        rows: usize,
        width: usize,
    ) -> BResult<()> {
        const OP: &str = "qat_hadamard_fp4";
        let rd = a.freq.rope_dim;
        let fits = self.fused
            && !a.inverse
            && a.head_dim == width
            && a.n_rows * a.n_heads == rows
            && rd <= width
            && rd.is_multiple_of(2)
            && width.is_power_of_two()
            && (32..=4096).contains(&width);
        if !fits {
            self.op_rope(x, a)?;
            return self.op_qat_hfp4(x, rows, width);
        }
        if rows == 0 {
            return Ok(());
        }
        let norm = (1.0 / (width as f64).sqrt()) as f32;
        let fp = self.freqs_ptr(&a)?;
        let xp = self.fptr(x, OP)?;
        let pp = self.row_pos_ptr(&a, OP)?;
        self.launch(
            "ds4_rope_qat_hfp4",
            (g32(rows), 1, 1),
            256,
            &[
                Arg::Ptr(xp),
                i32a(OP, "width", width)?,
                Arg::F32(norm),
                Arg::Ptr(fp),
                i32a(OP, "heads", a.n_heads)?,
                i32a(OP, "rope dim", rd)?,
                u(a.pos0),
                u(a.pos_step),
                Arg::Ptr(pp),
            ],
        )
    }

    pub(in crate::backend) fn op_norm_rope(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        eps: f32,
        a: RopeArgs,
        fp8_dims: Option<usize>,
    ) -> BResult<()> {
        const OP: &str = "norm_rope";
        let (rows, width, rd) = (a.n_rows * a.n_heads, a.head_dim, a.freq.rope_dim);
        let n8 = fp8_dims.unwrap_or(0);
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let wp = match w {
            Some(w) => self.wvec(w, OP, width)?,
            None => 0,
        };
        let fp = self.freqs_ptr(&a)?;
        let xp = self.fptr(x, OP)?;
        let pp = self.row_pos_ptr(&a, OP)?;
        self.launch(
            "ds4_norm_rope",
            (g32(rows), 1, 1),
            256,
            &[
                Arg::Ptr(xp),
                Arg::Ptr(wp),
                i32a(OP, "width", width)?,
                Arg::F32(eps),
                Arg::Ptr(fp),
                i32a(OP, "heads", a.n_heads)?,
                i32a(OP, "rope dim", rd)?,
                u(a.pos0),
                u(a.pos_step),
                Arg::Ptr(pp),
                i32a(OP, "fp8 dims", n8)?,
            ],
        )
    }

    /// Two head preparations in one launch (`ds4_norm_rope2`) when they share the width,
    /// eps and rotation (positions, frequencies) and differ only in their heads, weight and
    /// FP8 dims — the attention's query heads and KV row; otherwise two launches.
    /// `store`: b's one row also goes to its window ring (checked by the caller), from the
    /// block that finishes it; without the paired launch, a ring-store launch after it.
    pub(in crate::backend) fn op_norm_rope_pair(
        &mut self,
        a: NormRopeCall,
        b: NormRopeCall,
        store: Option<RingStoreCall>,
    ) -> BResult<()> {
        const OP: &str = "norm_rope";
        let same_rotation = RopeArgs {
            n_heads: a.rope.n_heads,
            ..b.rope
        } == a.rope;
        let (rows_a, rows_b) = (
            a.rope.n_rows * a.rope.n_heads,
            b.rope.n_rows * b.rope.n_heads,
        );
        // Rows of one buffer go one call after the other (they could overlap).
        if !self.fused
            || a.x.buf.id() == b.x.buf.id()
            || !same_rotation
            || a.eps.to_bits() != b.eps.to_bits()
            || a.rope.inverse
            || rows_a == 0
            || rows_b == 0
            || a.rope.head_dim == 0
        {
            self.op_norm_rope(a.x, a.w, a.eps, a.rope, a.fp8_dims)?;
            self.op_norm_rope(b.x, b.w, b.eps, b.rope, b.fp8_dims)?;
            if let Some(c) = store {
                self.op_ring_store(c.ring, c.kv, c.pos0, c.n_tok, c.window)?;
            }
            return Ok(());
        }
        let width = a.rope.head_dim;
        let (ring, slot) = match store {
            Some(c) => (self.fptr(c.ring, OP)?, (c.pos0 % c.window) as u64),
            None => (0, 0),
        };
        let wptr = |be: &mut Self, w: Option<Weight>| match w {
            Some(w) => be.wvec(w, OP, width),
            None => Ok(0),
        };
        let (wa, wb) = (wptr(self, a.w)?, wptr(self, b.w)?);
        let fp = self.freqs_ptr(&a.rope)?;
        let (xa, xb) = (self.fptr(a.x, OP)?, self.fptr(b.x, OP)?);
        let pp = self.row_pos_ptr(&a.rope, OP)?;
        let rows = rows_a + rows_b;
        // One warp per row for prefill-sized launches (docs/gpu.md §21), a block per row
        // otherwise; the same values either way.
        let warps = rows >= super::NORM_ROPE_WARPS_FROM && width <= self.norm_rope_warps_width;
        let (name, grid) = if warps {
            ("ds4_norm_rope2_warps", g32(rows.div_ceil(8)))
        } else {
            ("ds4_norm_rope2", g32(rows))
        };
        let mut args = vec![
            Arg::Ptr(xa),
            Arg::Ptr(wa),
            i32a(OP, "heads", a.rope.n_heads)?,
            i32a(OP, "fp8 dims", a.fp8_dims.unwrap_or(0))?,
            i32a(OP, "rows", rows_a)?,
            Arg::Ptr(xb),
            Arg::Ptr(wb),
            i32a(OP, "heads", b.rope.n_heads)?,
            i32a(OP, "fp8 dims", b.fp8_dims.unwrap_or(0))?,
            i32a(OP, "width", width)?,
            Arg::F32(a.eps),
            Arg::Ptr(fp),
            i32a(OP, "rope dim", a.rope.freq.rope_dim)?,
            u(a.rope.pos0),
            u(a.rope.pos_step),
            Arg::Ptr(pp),
            Arg::Ptr(ring),
            Arg::U64(slot),
        ];
        if warps {
            args.push(i32a(OP, "rows", rows)?);
        }
        self.launch(name, (grid, 1, 1), 256, &args)
    }
}
