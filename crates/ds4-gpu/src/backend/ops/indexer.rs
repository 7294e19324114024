//! The KV compressor and the lightning indexer (`kernels/compressor.cu`, `indexer.cu`).

use super::*;

impl<D: GpuApi> GpuBackend<D> {
    pub(in crate::backend) fn op_compressor(
        &mut self,
        acc: Slice,
        uu: Slice,
        z: Slice,
        ape: Weight,
        a: CompressorArgs,
        rows: Slice,
    ) -> BResult<()> {
        const OP: &str = "compressor";
        let pw = a.proj_width();
        let cap = rows.len / a.width;
        if a.n_tok == 0 {
            return Ok(());
        }
        let apep = self.wvec(ape, OP, a.ratio * pw)?;
        if a.n_tok >= COMP_WINDOWS_FROM && (!a.overlap || a.ratio <= COMP_MAX_OVERLAP_M) {
            // Every completed window pooled at once, then the accumulator's final state.
            let (accp, up, zp) = (self.fptr(acc, OP)?, self.fptr(uu, OP)?, self.fptr(z, OP)?);
            let n_win = (a.pos0 + a.n_tok) / a.ratio - a.pos0 / a.ratio;
            self.launch(
                "ds4_compressor_windows",
                (g32(n_win), g32(a.width.div_ceil(256)), 1),
                256,
                &[
                    Arg::Ptr(accp),
                    Arg::Ptr(up),
                    Arg::Ptr(zp),
                    Arg::Ptr(apep),
                    u(a.pos0),
                    i32a(OP, "ratio", a.ratio)?,
                    i32a(OP, "width", a.width)?,
                    Arg::I32(i32::from(a.overlap)),
                    Arg::Ptr(self.fptr(rows, OP)?),
                    u(cap),
                ],
            )?;
            return self.launch(
                "ds4_compressor_tail",
                (g32(pw.div_ceil(256)), 1, 1),
                256,
                &[
                    Arg::Ptr(accp),
                    Arg::Ptr(up),
                    Arg::Ptr(zp),
                    Arg::Ptr(apep),
                    u(a.pos0),
                    i32a(OP, "tokens", a.n_tok)?,
                    i32a(OP, "ratio", a.ratio)?,
                    i32a(OP, "width", a.width)?,
                    Arg::I32(i32::from(a.overlap)),
                ],
            );
        }
        let args = [
            Arg::Ptr(self.fptr(acc, OP)?),
            Arg::Ptr(self.fptr(uu, OP)?),
            Arg::Ptr(self.fptr(z, OP)?),
            Arg::Ptr(apep),
            u(a.pos0),
            i32a(OP, "tokens", a.n_tok)?,
            i32a(OP, "ratio", a.ratio)?,
            i32a(OP, "width", a.width)?,
            Arg::I32(i32::from(a.overlap)),
            Arg::Ptr(self.fptr(rows, OP)?),
            u(cap),
        ];
        self.launch("ds4_compressor", (1, 1, 1), 256, &args)
    }

    /// Two independent compressors in one `ds4_compressor2` launch (block 0 the first, block
    /// 1 the second: each `ds4_compressor`'s code) when both take the sequential kernel and
    /// their states are separate buffers; else one call after the other.
    pub(in crate::backend) fn op_compressor_pair(
        &mut self,
        a: CompressorCall,
        b: CompressorCall,
    ) -> BResult<()> {
        const OP: &str = "compressor";
        let sequential = |c: &CompressorCall| {
            c.args.n_tok > 0
                && !(c.args.n_tok >= COMP_WINDOWS_FROM
                    && (!c.args.overlap || c.args.ratio <= COMP_MAX_OVERLAP_M))
        };
        if !self.fused
            || !sequential(&a)
            || !sequential(&b)
            || !pairwise_disjoint(&[a.acc, a.rows, b.acc, b.rows])
        {
            self.op_compressor(a.acc, a.u, a.z, a.ape, a.args, a.rows)?;
            return self.op_compressor(b.acc, b.u, b.z, b.ape, b.args, b.rows);
        }
        let mut args = Vec::with_capacity(22);
        for c in [a, b] {
            let pw = c.args.proj_width();
            let apep = self.wvec(c.ape, OP, c.args.ratio * pw)?;
            args.extend([
                Arg::Ptr(self.fptr(c.acc, OP)?),
                Arg::Ptr(self.fptr(c.u, OP)?),
                Arg::Ptr(self.fptr(c.z, OP)?),
                Arg::Ptr(apep),
                u(c.args.pos0),
                i32a(OP, "tokens", c.args.n_tok)?,
                i32a(OP, "ratio", c.args.ratio)?,
                i32a(OP, "width", c.args.width)?,
                Arg::I32(i32::from(c.args.overlap)),
                Arg::Ptr(self.fptr(c.rows, OP)?),
                u(c.rows.len / c.args.width),
            ]);
        }
        self.launch("ds4_compressor2", (2, 1, 1), 256, &args)
    }

    /// One token of each of up to ATT_SEQS sequences' compressors in one
    /// `ds4_compressor_seqs` launch when their u / z rows follow each other and they share
    /// the compressor (the same code per sequence as alone); else one call at a time.
    pub(in crate::backend) fn op_compressor_batch(
        &mut self,
        calls: &[CompressorCall],
    ) -> BResult<()> {
        const OP: &str = "compressor";
        for group in calls.chunks(ATT_SEQS) {
            let c0 = group[0];
            let pw = c0.args.proj_width();
            let mut own: Vec<Slice> = Vec::new();
            for c in group {
                own.push(c.acc);
                own.push(c.rows);
            }
            let batchable = group.len() >= 2
                && group.iter().enumerate().all(|(i, c)| {
                    c.args.n_tok == 1
                        && (c.args.ratio, c.args.width, c.args.overlap)
                            == (c0.args.ratio, c0.args.width, c0.args.overlap)
                        && c.ape == c0.ape
                        && rows_follow(c.u, i, pw, c0.u)
                        && rows_follow(c.z, i, pw, c0.z)
                })
                && pairwise_disjoint(&own);
            if !batchable {
                for c in group {
                    self.op_compressor(c.acc, c.u, c.z, c.ape, c.args, c.rows)?;
                }
                continue;
            }
            // `ds4_comp_seqs`: acc, rows (pointers), pos0, cap.
            let mut blob = vec![0u64; 4 * ATT_SEQS];
            for (i, c) in group.iter().enumerate() {
                blob[i] = self.fptr(c.acc, OP)?;
                blob[ATT_SEQS + i] = self.fptr(c.rows, OP)?;
                blob[2 * ATT_SEQS + i] = c.args.pos0 as u64;
                blob[3 * ATT_SEQS + i] = (c.rows.len / c.args.width) as u64;
            }
            let apep = self.wvec(c0.ape, OP, c0.args.ratio * pw)?;
            self.launch_blob(
                "ds4_compressor_seqs",
                (g32(group.len()), 1, 1),
                256,
                &[
                    Arg::Ptr(self.fptr(c0.u, OP)?),
                    Arg::Ptr(self.fptr(c0.z, OP)?),
                    Arg::Ptr(apep),
                    i32a(OP, "ratio", c0.args.ratio)?,
                    i32a(OP, "width", c0.args.width)?,
                    Arg::I32(i32::from(c0.args.overlap)),
                ],
                3,
                &blob,
            )?;
        }
        Ok(())
    }

    /// One token of each of up to ATT_SEQS sequences' indexers in one
    /// `ds4_indexer_scores_seqs` + one `ds4_topk_select_seqs` launch when their q / w rows
    /// follow each other and they share the shapes (the same code per sequence as alone);
    /// else one call at a time.
    pub(in crate::backend) fn op_indexer_topk_batch(
        &mut self,
        calls: &[IndexerCall],
    ) -> BResult<()> {
        const OP: &str = "indexer_topk";
        for group in calls.chunks(ATT_SEQS) {
            let c0 = group[0];
            let (nh, hd, k) = (c0.args.n_heads, c0.args.head_dim, c0.args.top_k);
            let batchable = group.len() >= 2
                && group.iter().enumerate().all(|(i, c)| {
                    c.args.n_tok == 1
                        && (c.args.ratio, c.args.n_heads, c.args.head_dim, c.args.top_k)
                            == (c0.args.ratio, nh, hd, k)
                        && c.args.weight_scale.to_bits() == c0.args.weight_scale.to_bits()
                        && rows_follow(c.q, i, nh * hd, c0.q)
                        && rows_follow(c.w, i, nh, c0.w)
                })
                && (0..group.len()).all(|i| (0..i).all(|j| group[i].out.id() != group[j].out.id()));
            if !batchable {
                for c in group {
                    self.op_indexer_topk(c.q, c.w, c.rows, c.args, c.out)?;
                }
                continue;
            }
            let n_last: Vec<usize> = group
                .iter()
                .map(|c| (c.args.pos0 + 1) / c.args.ratio)
                .collect();
            let scoring: Vec<bool> = n_last.iter().map(|&n| n > k).collect();
            if scoring.iter().any(|&s| s) && (nh * hd > 8192 || nh > 64 || !hd.is_multiple_of(8)) {
                return Err(BackendError::Invalid {
                    op: OP,
                    problem: format!(
                        "{nh} heads of {hd} (at most 64 heads, 8192 values, dims a multiple of 8)"
                    ),
                });
            }
            for (c, &sc) in group.iter().zip(&scoring) {
                if sc && !self.fptr(c.rows, OP)?.is_multiple_of(16) {
                    return Err(BackendError::Invalid {
                        op: OP,
                        problem: "indexer rows must start 16-byte aligned".into(),
                    });
                }
            }
            let total: usize = n_last
                .iter()
                .zip(&scoring)
                .map(|(&n, &s)| if s { n } else { 0 })
                .sum();
            let sp = self.scratch("scores", 4 * total.max(1))?;
            // `ds4_idx_seqs`: rows, scores, out (pointers), pos0, then n_cols (4 bytes each).
            let mut blob = vec![0u64; 4 * ATT_SEQS + ATT_SEQS / 2];
            let mut at = 0u64;
            for (i, c) in group.iter().enumerate() {
                blob[i] = self.fptr(c.rows, OP)?;
                if scoring[i] {
                    blob[ATT_SEQS + i] = sp + at;
                    at += 4 * n_last[i] as u64;
                }
                blob[2 * ATT_SEQS + i] = self.iptr(c.out, OP)?;
                blob[3 * ATT_SEQS + i] = c.args.pos0 as u64;
            }
            for (i, &n) in n_last.iter().enumerate() {
                let v = u64::from(u32::try_from(n).map_err(|_| BackendError::Invalid {
                    op: OP,
                    problem: format!("{n} compressed rows"),
                })?);
                blob[4 * ATT_SEQS + i / 2] |= v << (32 * (i % 2));
            }
            let max_rows = n_last
                .iter()
                .zip(&scoring)
                .map(|(&n, &s)| if s { n } else { 0 })
                .max()
                .unwrap_or(0);
            if max_rows > 0 {
                self.launch_blob(
                    "ds4_indexer_scores_seqs",
                    (
                        g32(max_rows.div_ceil(IDX_ROWS_PER_BLOCK)),
                        g32(group.len()),
                        1,
                    ),
                    256,
                    &[
                        Arg::Ptr(self.fptr(c0.q, OP)?),
                        Arg::Ptr(self.fptr(c0.w, OP)?),
                        i32a(OP, "heads", nh)?,
                        i32a(OP, "head dim", hd)?,
                        Arg::F32(c0.args.weight_scale),
                        i32a(OP, "ratio", c0.args.ratio)?,
                    ],
                    2,
                    &blob,
                )?;
            }
            self.launch_blob(
                "ds4_topk_select_seqs",
                (g32(group.len()), 1, 1),
                1024,
                &[i32a(OP, "ratio", c0.args.ratio)?, i32a(OP, "top k", k)?],
                0,
                &blob,
            )?;
        }
        Ok(())
    }

    pub(in crate::backend) fn op_indexer_topk(
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
        if t == 0 {
            return Ok(());
        }
        let scoring = n_last > k;
        let mut sp = 0u64;
        if scoring {
            if nh * hd > 8192 || nh > 64 || !hd.is_multiple_of(8) {
                return Err(BackendError::Invalid {
                    op: OP,
                    problem: format!(
                        "{nh} heads of {hd} (at most 64 heads, 8192 values, dims a multiple of 8)"
                    ),
                });
            }
            if !self.fptr(rows, OP)?.is_multiple_of(16) {
                return Err(BackendError::Invalid {
                    op: OP,
                    problem: "indexer rows must start 16-byte aligned".into(),
                });
            }
            sp = self.scratch("scores", 4 * t * n_last)?;
            if self.idx_mma
                && t >= IMMA_MIN_TOKENS
                && (nh, hd) == (IMMA_HEADS, IMMA_DIM)
                && self.imma_smem <= self.max_dyn_smem
                && self.fptr(q, OP)?.is_multiple_of(16)
            {
                let args = [
                    Arg::Ptr(self.fptr(q, OP)?),
                    Arg::Ptr(self.fptr(w, OP)?),
                    Arg::Ptr(self.fptr(rows, OP)?),
                    Arg::F32(a.weight_scale),
                    u(a.pos0),
                    i32a(OP, "ratio", a.ratio)?,
                    i32a(OP, "tokens", t)?,
                    i32a(OP, "rows", n_last)?,
                    Arg::Ptr(sp),
                ];
                self.launch_smem(
                    "ds4_indexer_scores_mma",
                    (
                        g32(t.div_ceil(IMMA_TOKENS)),
                        g32(n_last.div_ceil(IMMA_ROWS)),
                        1,
                    ),
                    512,
                    self.imma_smem,
                    &args,
                )?;
            } else {
                let args = [
                    Arg::Ptr(self.fptr(q, OP)?),
                    Arg::Ptr(self.fptr(w, OP)?),
                    Arg::Ptr(self.fptr(rows, OP)?),
                    i32a(OP, "heads", nh)?,
                    i32a(OP, "head dim", hd)?,
                    Arg::F32(a.weight_scale),
                    u(a.pos0),
                    i32a(OP, "ratio", a.ratio)?,
                    i32a(OP, "rows", n_last)?,
                    Arg::Ptr(sp),
                ];
                self.launch(
                    "ds4_indexer_scores",
                    (g32(n_last.div_ceil(IDX_ROWS_PER_BLOCK)), g32(t), 1),
                    256,
                    &args,
                )?;
            }
        }
        let args = [
            Arg::Ptr(sp),
            i32a(OP, "rows", n_last)?,
            u(a.pos0),
            i32a(OP, "ratio", a.ratio)?,
            i32a(OP, "top k", k)?,
            Arg::Ptr(self.iptr(out, OP)?),
        ];
        self.launch("ds4_topk_select", (g32(t), 1, 1), 1024, &args)
    }
}
