//! Sink attention and the KV ring (`kernels/attention.cu`).

use super::*;

impl<D: GpuApi> GpuBackend<D> {
    /// One token of each of up to ATT_SEQS sequences' ring stores in one
    /// `ds4_ring_store_seqs` launch when their kv rows follow each other; else one call at
    /// a time.
    pub(in crate::backend) fn op_ring_store_batch(
        &mut self,
        calls: &[RingStoreCall],
    ) -> BResult<()> {
        const OP: &str = "ring_store";
        for group in calls.chunks(ATT_SEQS) {
            let c0 = group[0];
            let d = c0.ring.len / c0.window.max(1);
            let rings: Vec<Slice> = group.iter().map(|c| c.ring).collect();
            let batchable = group.len() >= 2
                && group.iter().enumerate().all(|(i, c)| {
                    c.n_tok == 1
                        && c.window == c0.window
                        && c.ring.len == c0.ring.len
                        && rows_follow(c.kv, i, d, c0.kv)
                })
                && pairwise_disjoint(&rings);
            if !batchable || d == 0 {
                for c in group {
                    self.op_ring_store(c.ring, c.kv, c.pos0, c.n_tok, c.window)?;
                }
                continue;
            }
            let mut blob = vec![0u64; 2 * ATT_SEQS];
            for (i, c) in group.iter().enumerate() {
                blob[i] = self.fptr(c.ring, OP)?;
                blob[ATT_SEQS + i] = c.pos0 as u64;
            }
            self.launch_blob(
                "ds4_ring_store_seqs",
                (g32(d.div_ceil(256)), g32(group.len()), 1),
                256,
                &[
                    Arg::Ptr(self.fptr(c0.kv, OP)?),
                    i32a(OP, "window", c0.window)?,
                    i32a(OP, "dim", d)?,
                ],
                1,
                &blob,
            )?;
        }
        Ok(())
    }

    /// What the attention kernels take for `a` besides its slices: the compressed-row
    /// mode and pointers, and the split of every (token, head)'s keys over blocks.
    fn att_plan(&self, a: &AttnArgs) -> BResult<AttPlan> {
        const OP: &str = "attention";
        let (t, nh, hd, win) = (a.n_tok, a.n_head, a.head_dim, a.window);
        if hd > ATT_MAX_HD {
            return Err(BackendError::Invalid {
                op: OP,
                problem: format!("head dim {hd} (at most {ATT_MAX_HD})"),
            });
        }
        let last = a.pos0 + t;
        let (mode, crows, ratio, idx, k_sel, n_crows) = match a.comp {
            CompSel::None => (0, 0u64, 1usize, 0u64, 0usize, 0usize),
            CompSel::All { rows, ratio } => (1, self.fptr(rows, OP)?, ratio, 0, 0, rows.len / hd),
            CompSel::Top {
                rows,
                ratio,
                idx,
                k,
            } => (
                2,
                self.fptr(rows, OP)?,
                ratio,
                self.iptr(idx, OP)?,
                k,
                rows.len / hd,
            ),
        };
        // Few tokens: split every (token, head)'s keys over blocks (flash decoding).
        let n_keys = win.min(last)
            + match a.comp {
                CompSel::None => 0,
                CompSel::All { .. } => last / ratio,
                CompSel::Top { .. } => k_sel,
            };
        let kps = ATT_KEYS_PER_SPLIT.max(n_keys.div_ceil(ATT_MAX_SPLITS));
        let splits = n_keys.div_ceil(kps);
        Ok(AttPlan {
            mode,
            crows,
            ratio,
            idx,
            k_sel,
            n_crows,
            kps,
            splits,
            split: t * nh < ATT_SPLIT_BELOW_BLOCKS && splits > 1,
        })
    }

    /// Whether the tensor-core attention can run this call (docs/gpu.md §14): 512-dim heads
    /// in groups of 64, the device gives a block the kernel's shared memory, and every row
    /// the kernel reads with 16-byte loads is 16-byte aligned. (Whether it is switched on
    /// is the caller's test: `attn_mma`, for chunks that do not split their keys.)
    fn att_mma_ok(&self, a: &AttnArgs) -> BResult<bool> {
        const OP: &str = "attention";
        if a.head_dim != AMMA_HD
            || !a.n_head.is_multiple_of(AMMA_HEADS)
            || self.amma_smem > self.max_dyn_smem
        {
            return Ok(false);
        }
        let mut ptrs = vec![
            self.fptr(a.q, OP)?,
            self.fptr(a.kv, OP)?,
            self.fptr(a.ring, OP)?,
        ];
        match a.comp {
            CompSel::None => {}
            CompSel::All { rows, .. } | CompSel::Top { rows, .. } => {
                ptrs.push(self.fptr(rows, OP)?)
            }
        }
        Ok(ptrs.iter().all(|p| p % 16 == 0))
    }

    /// The leading arguments every attention kernel of one call shares, in their order:
    /// q, kv, ring, compressed rows, selection, the sinks (kernels that normalise), the
    /// first position, heads, the head dim (the single-query kernels; the tensor-core ones
    /// fix it at 512), window, row mode, ratio, k, rows and scale.
    fn att_args(
        &self,
        a: &AttnArgs,
        pl: &AttPlan,
        sinks: Option<u64>,
        with_head_dim: bool,
    ) -> BResult<Vec<Arg>> {
        const OP: &str = "attention";
        let mut v = vec![
            Arg::Ptr(self.fptr(a.q, OP)?),
            Arg::Ptr(self.fptr(a.kv, OP)?),
            Arg::Ptr(self.fptr(a.ring, OP)?),
            Arg::Ptr(pl.crows),
            Arg::Ptr(pl.idx),
        ];
        v.extend(sinks.map(Arg::Ptr));
        v.extend([u(a.pos0), i32a(OP, "heads", a.n_head)?]);
        if with_head_dim {
            v.push(i32a(OP, "head dim", a.head_dim)?);
        }
        v.extend([
            i32a(OP, "window", a.window)?,
            Arg::I32(pl.mode),
            i32a(OP, "ratio", pl.ratio)?,
            i32a(OP, "k", pl.k_sel)?,
            u(pl.n_crows),
            Arg::F32(a.scale),
        ]);
        Ok(v)
    }

    pub(in crate::backend) fn op_attention(&mut self, a: AttnArgs) -> BResult<()> {
        if a.n_tok > 1 && a.n_tok <= self.decode_rows {
            return self.attention_as_decode_rows(a);
        }
        self.attention_rows(a, 0)
    }

    /// The rows of one sequence's chunk under decode rows (a speculative verify step,
    /// docs/speculative.md §1) each get the attention a one-token decode of that row runs:
    /// its own key count picks its kernel and its split of the keys, which a chunk's plan
    /// (made for its last row) does not (measured: a chunk of four rows whose last row has
    /// more keys than a split holds gave its first row other bits). So row `i` runs as the
    /// one-token step at `pos0 + i`, after the rows before it are stored in the window ring
    /// as their own steps would have stored them (the slot of `pos0 + i − 1` held a position
    /// no later row can see; the forward pass stores every row again after attention, the
    /// same values).
    fn attention_as_decode_rows(&mut self, a: AttnArgs) -> BResult<()> {
        let (nh, hd) = (a.n_head, a.head_dim);
        for i in 0..a.n_tok {
            if i > 0 {
                let prev = a.kv.sub((i - 1) * hd, hd);
                self.op_ring_store(a.ring, prev, a.pos0 + i - 1, 1, a.window)?;
            }
            let row = AttnArgs {
                q: a.q.sub(i * nh * hd, nh * hd),
                kv: a.kv.sub(i * hd, hd),
                pos0: a.pos0 + i,
                n_tok: 1,
                out: a.out.sub(i * nh * hd, nh * hd),
                ..a
            };
            self.attention_rows(row, i)?;
        }
        Ok(())
    }

    /// Attention of `a`'s rows; `sel_row`: the row of the indexer's `[T, k]` selection that
    /// `a`'s first row reads (0 but for a row of a chunk run alone).
    fn attention_rows(&mut self, a: AttnArgs, sel_row: usize) -> BResult<()> {
        const OP: &str = "attention";
        let (t, nh, hd) = (a.n_tok, a.n_head, a.head_dim);
        let mut pl = self.att_plan(&a)?;
        if pl.idx != 0 {
            pl.idx += (4 * sel_row * pl.k_sel) as u64;
        }
        if t * nh == 0 {
            return Ok(());
        }
        let sinks = self.wvec(a.sinks, OP, nh)?;
        if !pl.split && self.attn_mma && self.att_mma_ok(&a)? {
            let mut args = self.att_args(&a, &pl, Some(sinks), false)?;
            args.extend([Arg::Ptr(self.fptr(a.out, OP)?), Arg::Ptr(self.fault_ptr())]);
            return self.launch_smem(
                "ds4_attention_mma",
                (g32(t), g32(nh / AMMA_HEADS), 1),
                AMMA_THREADS,
                self.amma_smem,
                &args,
            );
        }
        if pl.split {
            let part = self.scratch("att_part", 4 * t * nh * pl.splits * (hd + 2))?;
            let mut args = self.att_args(&a, &pl, None, true)?;
            args.extend([
                i32a(OP, "keys per split", pl.kps)?,
                Arg::Ptr(part),
                Arg::Ptr(self.fault_ptr()),
            ]);
            if self.fused {
                // One zeroed counter per (token, head); the kernel leaves them zeroed.
                if !self.has_scratch("att_count") {
                    self.upload_scratch_i32("att_count", &[0; ATT_SPLIT_BELOW_BLOCKS])?;
                }
                let counters = self.scratch("att_count", 4 * ATT_SPLIT_BELOW_BLOCKS)?;
                args.extend([
                    Arg::Ptr(sinks),
                    Arg::Ptr(self.fptr(a.out, OP)?),
                    Arg::Ptr(counters),
                ]);
                return self.launch(
                    "ds4_attention_split_combine",
                    (g32(t * nh), g32(pl.splits), 1),
                    128,
                    &args,
                );
            }
            self.launch(
                "ds4_attention_split",
                (g32(t * nh), g32(pl.splits), 1),
                128,
                &args,
            )?;
            return self.launch(
                "ds4_attention_combine",
                (g32(t * nh), 1, 1),
                256,
                &[
                    Arg::Ptr(part),
                    Arg::Ptr(sinks),
                    i32a(OP, "heads", nh)?,
                    i32a(OP, "head dim", hd)?,
                    i32a(OP, "splits", pl.splits)?,
                    Arg::Ptr(self.fptr(a.out, OP)?),
                ],
            );
        }
        let mut args = self.att_args(&a, &pl, Some(sinks), true)?;
        args.extend([Arg::Ptr(self.fptr(a.out, OP)?), Arg::Ptr(self.fault_ptr())]);
        self.launch("ds4_attention", (g32(t * nh), 1, 1), 128, &args)
    }

    /// One token of each of several sequences (a batched decode step): groups of up to
    /// ATT_SEQS sequences whose rows of q, kv and out follow each other in one buffer each
    /// and that share every shape and the sinks run as one `ds4_attention_split_seqs` +
    /// one `ds4_attention_combine_seqs` launch (each sequence with the splits it has alone:
    /// the same results bit for bit); anything else runs one sequence at a time.
    pub(in crate::backend) fn op_attention_batch(&mut self, args: &[AttnArgs]) -> BResult<()> {
        const OP: &str = "attention";
        for group in args.chunks(ATT_SEQS) {
            let plans = group
                .iter()
                .map(|a| self.att_plan(a))
                .collect::<BResult<Vec<_>>>()?;
            if !self.att_batchable(group, &plans) {
                for &a in group {
                    self.op_attention(a)?;
                }
                continue;
            }
            let a0 = group[0];
            let (n, nh, hd) = (group.len(), a0.n_head, a0.head_dim);
            let max_splits = plans.iter().map(|p| p.splits).max().unwrap_or(1);
            // Per-sequence arguments, laid out as `ds4_att_seqs` in attention.cu: ring, crows,
            // idx, pos0, n_crows (8 bytes each), then kps and splits (4 bytes each).
            let mut blob = vec![0u64; 5 * ATT_SEQS + ATT_SEQS];
            for (i, (a, p)) in group.iter().zip(&plans).enumerate() {
                blob[i] = self.fptr(a.ring, OP)?;
                blob[ATT_SEQS + i] = p.crows;
                blob[2 * ATT_SEQS + i] = p.idx;
                blob[3 * ATT_SEQS + i] = a.pos0 as u64;
                blob[4 * ATT_SEQS + i] = p.n_crows as u64;
            }
            let ints: Vec<u32> = plans
                .iter()
                .map(|p| p.kps)
                .chain((n..ATT_SEQS).map(|_| 0))
                .chain(plans.iter().map(|p| p.splits))
                .chain((n..ATT_SEQS).map(|_| 0))
                .map(|v| u32::try_from(v).unwrap_or(u32::MAX))
                .collect();
            for (j, pair) in ints.chunks_exact(2).enumerate() {
                blob[5 * ATT_SEQS + j] = u64::from(pair[0]) | (u64::from(pair[1]) << 32);
            }
            let part = self.scratch("att_part", 4 * n * nh * max_splits * (hd + 2))?;
            let sinks = self.wvec(a0.sinks, OP, nh)?;
            let p0 = &plans[0];
            let args = [
                Arg::Ptr(self.fptr(a0.q, OP)?),
                Arg::Ptr(self.fptr(a0.kv, OP)?),
                i32a(OP, "heads", nh)?,
                i32a(OP, "head dim", hd)?,
                i32a(OP, "window", a0.window)?,
                Arg::I32(p0.mode),
                i32a(OP, "ratio", p0.ratio)?,
                i32a(OP, "k", p0.k_sel)?,
                Arg::F32(a0.scale),
                i32a(OP, "splits", max_splits)?,
                Arg::Ptr(part),
                Arg::Ptr(self.fault_ptr()),
            ];
            let grid = (g32(n * nh), g32(max_splits), 1);
            self.launch_blob("ds4_attention_split_seqs", grid, 128, &args, 2, &blob)?;
            self.launch_blob(
                "ds4_attention_combine_seqs",
                (g32(n * nh), 1, 1),
                256,
                &[
                    Arg::Ptr(part),
                    Arg::Ptr(sinks),
                    i32a(OP, "heads", nh)?,
                    i32a(OP, "head dim", hd)?,
                    i32a(OP, "splits", max_splits)?,
                    Arg::Ptr(self.fptr(a0.out, OP)?),
                ],
                2,
                &blob,
            )?;
        }
        Ok(())
    }

    /// Whether `group` can run as one batched launch (see [`Self::op_attention_batch`]):
    /// at least two sequences, one token each, each on the split path alone, the same
    /// shapes, sinks and compressed-row mode, rows following each other, and partials
    /// within [`ATT_BATCH_PART_BYTES`].
    fn att_batchable(&self, group: &[AttnArgs], plans: &[AttPlan]) -> bool {
        let (a0, p0) = (&group[0], &plans[0]);
        let (nh, hd) = (a0.n_head, a0.head_dim);
        let max_splits = plans.iter().map(|p| p.splits).max().unwrap_or(0);
        // The launch writes every output row while reading every q and kv row.
        let span = |first: Slice, w: usize| Slice {
            len: group.len() * w,
            ..first
        };
        let outs = span(a0.out, nh * hd);
        group.len() >= 2
            && !outs.overlaps(span(a0.q, nh * hd))
            && !outs.overlaps(span(a0.kv, hd))
            && 4 * group.len() * nh * max_splits * (hd + 2) <= ATT_BATCH_PART_BYTES
            && group.iter().zip(plans).enumerate().all(|(i, (a, p))| {
                a.n_tok == 1
                    && p.split
                    && a.n_head == nh
                    && a.head_dim == hd
                    && a.window == a0.window
                    && a.scale.to_bits() == a0.scale.to_bits()
                    && a.sinks == a0.sinks
                    && (p.mode, p.ratio, p.k_sel) == (p0.mode, p0.ratio, p0.k_sel)
                    && rows_follow(a.q, i, nh * hd, a0.q)
                    && rows_follow(a.kv, i, hd, a0.kv)
                    && rows_follow(a.out, i, nh * hd, a0.out)
            })
    }

    pub(in crate::backend) fn op_ring_store(
        &mut self,
        ring: Slice,
        kv: Slice,
        pos0: usize,
        n_tok: usize,
        window: usize,
    ) -> BResult<()> {
        const OP: &str = "ring_store";
        let d = ring.len / window;
        let n = n_tok.min(window) * d;
        if n == 0 {
            return Ok(());
        }
        let args = [
            Arg::Ptr(self.fptr(ring, OP)?),
            Arg::Ptr(self.fptr(kv, OP)?),
            u(pos0),
            i32a(OP, "tokens", n_tok)?,
            i32a(OP, "window", window)?,
            i32a(OP, "dim", d)?,
        ];
        self.launch("ds4_ring_store", (grid_for(n), 1, 1), 256, &args)
    }
}
