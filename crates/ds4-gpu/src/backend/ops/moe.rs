//! The router and the routed experts (`kernels/moe.cu`, the grouped GEMVs of gemv.cu and the
//! grouped tiles of tiles.cu).

use super::*;

impl<D: GpuApi> GpuBackend<D> {
    /// The router's matmul and the router: for one token of an F16 matrix that the plain
    /// GEMV takes, one launch (`ds4_gemv_router_f16`: its last block routes); else the two.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::backend) fn op_router_matmul(
        &mut self,
        w: Weight,
        x: Slice,
        logits: Slice,
        routing: Routing,
        a: RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()> {
        const OP: &str = "router";
        let (cols, rows) = (w.info.cols(), w.info.rows());
        let gw = self.weight(w, OP)?;
        let (ty, row_bytes) = (gw.info.ty, gw.row_bytes);
        let wp = self.wraw(w, OP)?;
        let xp = self.fptr(x, OP)?;
        let launch = self
            .gemv
            .launch_for(GemvType::F16, cols, rows)
            .ok()
            .filter(|l| l.row_bytes as usize == row_bytes);
        let fits = self.fused
            && a.n_tok == 1
            && ty == GgmlType::F16
            && rows == a.n_expert
            && a.k >= 1
            && a.k <= a.n_expert
            && a.n_expert <= ROUTER_WARP_MAX_EXPERTS
            && a.k <= ROUTER_WARP_MAX_K
            && wp.is_multiple_of(16)
            && xp.is_multiple_of(16);
        let Some(l) = launch.filter(|_| fits) else {
            self.op_matmul(w, 0, x, a.n_tok, logits)?;
            return self.op_router(logits, routing, a, ids, weights);
        };
        let (mode, bias, table, table_rows, toks) =
            self.routing_args(routing, a.n_expert, a.row0)?;
        // One zeroed counter; the kernel leaves it zeroed.
        if !self.has_scratch("router_count") {
            self.upload_scratch_i32("router_count", &[0])?;
        }
        let counter = self.scratch("router_count", 4)?;
        let args = [
            Arg::Ptr(wp),
            Arg::Ptr(xp),
            Arg::Ptr(self.fptr(logits, OP)?),
            i32a(OP, "cols", cols)?,
            i32a(OP, "rows", rows)?,
            Arg::I32(l.wpr as i32),
            i32a(OP, "k", a.k)?,
            Arg::F32(a.scale),
            Arg::I32(mode),
            Arg::Ptr(bias),
            Arg::Ptr(table),
            i32a(OP, "table rows", table_rows)?,
            Arg::Ptr(toks),
            Arg::Ptr(self.router_ids(ids, &a)?),
            Arg::Ptr(self.fptr(weights, OP)?),
            Arg::Ptr(self.fault_ptr()),
            Arg::Ptr(counter),
        ];
        self.launch_fn(
            &self.gemv.f16_router,
            "ds4_gemv_router_f16",
            (l.grid_x, 1, 1),
            l.block,
            &args,
        )
    }

    /// The router kernels' routing arguments: (mode 0 top-k / 1 hash, bias, hash table,
    /// its rows, token ids), null pointers where a mode has none.
    /// Token ids are read from row `row0` on (RouterArgs::row0).
    fn routing_args(
        &mut self,
        routing: Routing,
        e: usize,
        row0: usize,
    ) -> BResult<(i32, u64, u64, usize, u64)> {
        const OP: &str = "router";
        Ok(match routing {
            Routing::TopK { bias } => {
                let b = match bias {
                    Some(b) => self.wvec(b, OP, e)?,
                    None => 0,
                };
                (0, b, 0, 0, 0)
            }
            Routing::Hash { table, tokens } => (
                1,
                0,
                self.wraw(table, OP)?,
                table.info.rows(),
                self.iptr(tokens, OP)? + 4 * row0 as u64,
            ),
        })
    }

    /// Where a router call's expert ids start: row `row0` of `ids` (RouterArgs::row0; the
    /// validation checked the length).
    fn router_ids(&self, ids: IBuf, a: &RouterArgs) -> BResult<u64> {
        Ok(self.iptr(ids, "router")? + 4 * (a.row0 * a.k) as u64)
    }

    pub(in crate::backend) fn op_router(
        &mut self,
        logits: Slice,
        routing: Routing,
        a: RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()> {
        const OP: &str = "router";
        let (t, e, k) = (a.n_tok, a.n_expert, a.k);
        if k == 0 || k > e || e > 1024 || k > 64 {
            return Err(BackendError::Invalid {
                op: OP,
                problem: format!("{k} of {e} experts (at most 64 of 1024)"),
            });
        }
        if t == 0 {
            return Ok(());
        }
        let (mode, bias, table, table_rows, toks) = self.routing_args(routing, e, a.row0)?;
        let mut args = vec![
            Arg::Ptr(self.fptr(logits, OP)?),
            i32a(OP, "experts", e)?,
            i32a(OP, "k", k)?,
            Arg::F32(a.scale),
            Arg::I32(mode),
            Arg::Ptr(bias),
            Arg::Ptr(table),
            i32a(OP, "table rows", table_rows)?,
            Arg::Ptr(toks),
            Arg::Ptr(self.router_ids(ids, &a)?),
            Arg::Ptr(self.fptr(weights, OP)?),
            Arg::Ptr(self.fault_ptr()),
        ];
        // One warp per token where the experts fit its registers (`ds4_router_warp`).
        if e <= ROUTER_WARP_MAX_EXPERTS && k <= ROUTER_WARP_MAX_K {
            args.insert(1, i32a(OP, "tokens", t)?);
            let grid = g32(t.div_ceil(ROUTER_WARP_TOKENS));
            return self.launch("ds4_router_warp", (grid, 1, 1), 256, &args);
        }
        self.launch("ds4_router", (g32(t), 1, 1), 256, &args)
    }

    #[allow(clippy::too_many_arguments)]
    pub(in crate::backend) fn op_moe(
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
        let n_sel = t * k;
        if n_sel == 0 {
            return Ok(());
        }
        let (gw, _, dw) = (
            self.weight(gate, OP)?,
            self.weight(up, OP)?,
            self.weight(down, OP)?,
        );
        let (gty, grb, drb) = (gw.info.ty, gw.row_bytes, dw.row_bytes);
        let dty = dw.info.ty;
        let (gp, upp, dp) = (
            self.wraw(gate, OP)?,
            self.wraw(up, OP)?,
            self.wraw(down, OP)?,
        );
        let (xp, wp, ip, op_) = (
            self.fptr(x, OP)?,
            self.fptr(weights, OP)?,
            self.iptr(ids, OP)?,
            self.fptr(out, OP)?,
        );
        let sg = self.scratch("moe_g", 4 * n_sel * f)?;
        let su = self.scratch("moe_u", 4 * n_sel * f)?;
        let sh = self.scratch("moe_h", 4 * n_sel * f)?;
        let so = self.scratch("moe_o", 4 * n_sel * d)?;
        if n_sel > GROUPED_MAX_SEL && !self.q8_rows(t) && self.moe_takes_tiles(gate, up, down) {
            let sel = MoeTiles {
                x: xp,
                ids: ip,
                weights: wp,
                out: op_,
                n_tok: t,
                k,
                n_exp: ne,
            };
            return self.moe_tiles(sel, (gp, upp, gty, grb), (dp, dty, drb), (d, f), a.clamp);
        }
        // Batched decode steps (decode rows) stay on the grouped GEMVs at any width: 16
        // sequences are 96 selections, and the host-grouped path costs a synchronisation
        // per layer (BENCHMARKS.md, "Figures moved out of code comments").
        let grouped = (n_sel <= GROUPED_MAX_SEL || self.q8_rows(t))
            && self.grouped_ok(gty, d, f, gp)
            && self.grouped_ok(gty, d, f, upp)
            && self.grouped_ok(dty, f, d, dp);
        if grouped {
            // Inputs per selection: the token's x (shared when there is one token; a flat
            // grid reads each token's row for its selections, docs/gpu.md §25).
            let (xsrc, x_div) = if t == 1 {
                (xp, 0)
            } else if self
                .flat_functions(gty, n_sel, k, self.q8_rows(t))
                .is_some()
            {
                (xp, k)
            } else {
                // Each token's x once per selection, on the device (no host index list).
                let xs = self.scratch("moe_xs", 4 * n_sel * d)?;
                self.launch(
                    "ds4_repeat_rows",
                    (grid_for(n_sel * d), 1, 1),
                    256,
                    &[
                        Arg::Ptr(xp),
                        i32a(OP, "k", k)?,
                        i32a(OP, "selections", n_sel)?,
                        i32a(OP, "dim", d)?,
                        Arg::Ptr(xs),
                    ],
                )?;
                (xs, 1)
            };
            self.grouped(
                gty,
                (gp, Some(upp)),
                grb * f,
                ip,
                ne,
                xsrc,
                x_div,
                (sg, Some(su)),
                (n_sel, k),
                d,
                f,
                self.q8_rows(t),
            )?;
            if self.fused && self.q8_rows(t) {
                let (sg_, su_) = ((sg, su), (wp, a.clamp));
                if self.grouped_swiglu(
                    dty,
                    dp,
                    drb * d,
                    (ip, ne),
                    sg_,
                    su_,
                    so,
                    (n_sel, k),
                    f,
                    d,
                )? {
                    return self.sum_slots(so, t, k, d, op_);
                }
            }
            self.launch(
                "ds4_moe_act",
                (grid_for(n_sel * f), 1, 1),
                256,
                &[
                    Arg::Ptr(sg),
                    Arg::Ptr(su),
                    Arg::Ptr(wp),
                    Arg::Ptr(0),
                    i32a(OP, "selections", n_sel)?,
                    i32a(OP, "ff", f)?,
                    Arg::F32(a.clamp),
                    Arg::Ptr(sh),
                    // The id range check rides along (the grouped GEMVs read the ids).
                    Arg::Ptr(ip),
                    i32a(OP, "experts", ne)?,
                    Arg::Ptr(self.fault_ptr()),
                ],
            )?;
            self.grouped(
                dty,
                (dp, None),
                drb * d,
                ip,
                ne,
                sh,
                1,
                (so, None),
                (n_sel, k),
                f,
                d,
                self.q8_rows(t),
            )?;
        } else {
            // Host-side grouping by expert: (token, slot) pairs in token order per expert.
            let mut idv = vec![0i32; n_sel];
            ds4_engine::Backend::download_i32(self, ids, 0, &mut idv)?;
            let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); ne];
            for (i, &e) in idv.iter().enumerate() {
                let e = usize::try_from(e).ok().filter(|&e| e < ne).ok_or_else(|| {
                    BackendError::Invalid {
                        op: OP,
                        problem: format!("expert id {e} of {ne}"),
                    }
                })?;
                by_expert[e].push(i);
            }
            let mut src = Vec::with_capacity(n_sel);
            let mut slot = Vec::with_capacity(n_sel);
            let mut groups = Vec::new();
            for (e, pairs) in by_expert.iter().enumerate() {
                if pairs.is_empty() {
                    continue;
                }
                groups.push((e, slot.len(), pairs.len()));
                for &i in pairs {
                    src.push((i / k) as i32);
                    slot.push(i as i32);
                }
            }
            let srcp = self.upload_scratch_i32("moe_src", &src)?;
            let slotp = self.upload_scratch_i32("moe_slot", &slot)?;
            let xs = self.scratch("moe_xs", 4 * n_sel * d)?;
            self.launch(
                "ds4_gather_rows",
                (grid_for(n_sel * d), 1, 1),
                256,
                &[
                    Arg::Ptr(xp),
                    Arg::Ptr(srcp),
                    i32a(OP, "selections", n_sel)?,
                    i32a(OP, "dim", d)?,
                    Arg::Ptr(xs),
                ],
            )?;
            for &(e, off, n) in &groups {
                for (wbase, y) in [(gp, sg), (upp, su)] {
                    self.mm(
                        Mm {
                            w: wbase + (e * f * grb) as u64,
                            ty: gty,
                            row_bytes: grb,
                            row0: 0,
                            n_rows: f,
                            cols: d,
                            x: xs + (4 * off * d) as u64,
                            x_stride: d,
                            n_tok: n,
                            y: y + (4 * off * f) as u64,
                            y_stride: f,
                            q8: self.q8_rows(t),
                            copies: 1,
                        },
                        OP,
                    )?;
                }
            }
            self.launch(
                "ds4_moe_act",
                (grid_for(n_sel * f), 1, 1),
                256,
                &[
                    Arg::Ptr(sg),
                    Arg::Ptr(su),
                    Arg::Ptr(wp),
                    Arg::Ptr(slotp),
                    i32a(OP, "selections", n_sel)?,
                    i32a(OP, "ff", f)?,
                    Arg::F32(a.clamp),
                    Arg::Ptr(sh),
                    Arg::Ptr(0),
                    Arg::I32(0),
                    Arg::Ptr(0),
                ],
            )?;
            let ob = self.scratch("moe_ob", 4 * n_sel * d)?;
            for &(e, off, n) in &groups {
                self.mm(
                    Mm {
                        w: dp + (e * d * drb) as u64,
                        ty: dty,
                        row_bytes: drb,
                        row0: 0,
                        n_rows: d,
                        cols: f,
                        x: sh + (4 * off * f) as u64,
                        x_stride: f,
                        n_tok: n,
                        y: ob + (4 * off * d) as u64,
                        y_stride: d,
                        q8: self.q8_rows(t),
                        copies: 1,
                    },
                    OP,
                )?;
            }
            self.launch(
                "ds4_scatter_rows",
                (grid_for(n_sel * d), 1, 1),
                256,
                &[
                    Arg::Ptr(ob),
                    Arg::Ptr(slotp),
                    i32a(OP, "selections", n_sel)?,
                    i32a(OP, "dim", d)?,
                    Arg::Ptr(so),
                ],
            )?;
        }
        self.sum_slots(so, t, k, d, op_)
    }

    /// `out[t] = Σ_s per_slot[t·k + s]` in slot order (rows of d).
    fn sum_slots(&self, per_slot: u64, t: usize, k: usize, d: usize, out: u64) -> BResult<()> {
        const OP: &str = "moe";
        self.launch(
            "ds4_sum_slots",
            (grid_for(t * d), 1, 1),
            256,
            &[
                Arg::Ptr(per_slot),
                i32a(OP, "tokens", t)?,
                i32a(OP, "k", k)?,
                i32a(OP, "dim", d)?,
                Arg::Ptr(out),
            ],
        )
    }

    /// The routed experts' down projection with `ds4_moe_act` folded into its input
    /// quantization (`ds4_gemv_grouped_swiglu_q_<t>`, docs/gpu.md §17): selection s reads
    /// `route_w[s] · swiglu(g[s], u[s], clamp)`. `Ok(false)` (nothing launched) where the
    /// type, shape or alignment does not allow it.
    #[allow(clippy::too_many_arguments)]
    fn grouped_swiglu(
        &self,
        ty: GgmlType,
        w: u64,
        expert_bytes: usize,
        (ids, n_experts): (u64, usize),
        (g, u_): (u64, u64),
        (route_w, clamp): (u64, f32),
        y: u64,
        (n_sel, per_tok): (usize, usize),
        n_in: usize,
        n_out: usize,
    ) -> BResult<bool> {
        const OP: &str = "moe";
        let Ok(gt) = GemvType::from_ggml(ty) else {
            return Ok(false);
        };
        let Some(f) = self.gemv.q8_grouped_swiglu_function(gt) else {
            return Ok(false);
        };
        let Ok(l) = self.gemv.q8_launch(gt, n_in, n_out, per_tok.max(1) as u64) else {
            return Ok(false);
        };
        if n_in > self.gemv.q8_max_in
            || !n_in.is_multiple_of(32)
            || !g.is_multiple_of(16)
            || !u_.is_multiple_of(16)
        {
            return Ok(false);
        }
        let mut args = vec![
            Arg::Ptr(w),
            u(expert_bytes),
            Arg::Ptr(ids),
            i32a(OP, "experts", n_experts)?,
            Arg::Ptr(g),
            Arg::Ptr(u_),
            Arg::Ptr(route_w),
            Arg::F32(clamp),
            Arg::Ptr(y),
            i32a(OP, "n_in", n_in)?,
            i32a(OP, "n_out", n_out)?,
            Arg::I32(l.wpr as i32),
            Arg::Ptr(self.fault_ptr()),
        ];
        // A batched step: one flat grid (docs/gpu.md §25), which takes the selection count
        // after the expert count instead of a grid y.
        let (f, grid) = match self.flat_functions(ty, n_sel, per_tok, true) {
            Some((_, ff)) => {
                args.insert(4, i32a(OP, "selections", n_sel)?);
                let steps = u64::from(l.grid_x) * n_sel as u64;
                (ff, (self.gemv.q8_flat_grid_x(steps), 1, 1))
            }
            _ => (
                f,
                (self.gemv.q8_grid_x(l.grid_x, g32(n_sel)), g32(n_sel), 1),
            ),
        };
        self.launch_fn_smem(
            f,
            gt.label_q8(true),
            grid,
            (l.block, self.gemv.q8_smem(gt)),
            &args,
        )?;
        Ok(true)
    }

    /// Routed experts on tiles: selections grouped by expert on the device, gate and up
    /// in one launch, SwiGLU · route weight as halves, down, then the slot-ordered sum.
    fn moe_tiles(
        &mut self,
        s: MoeTiles,
        (gp, upp, gty, grb): (u64, u64, GgmlType, usize),
        (dp, dty, drb): (u64, GgmlType, usize),
        (d, f): (usize, usize),
        clamp: f32,
    ) -> BResult<()> {
        const OP: &str = "moe";
        let n_sel = s.n_tok * s.k;
        let offs = self.scratch("tiles_offs", 4 * (s.n_exp + 2))?;
        let order = self.scratch("tiles_order", 4 * n_sel)?;
        let inv = self.scratch("tiles_inv", 4 * n_sel)?;
        self.launch(
            "ds4_moe_sort",
            (g32(s.n_exp + 1), 1, 1),
            256,
            &[
                Arg::Ptr(s.ids),
                i32a(OP, "selections", n_sel)?,
                i32a(OP, "experts", s.n_exp)?,
                Arg::Ptr(offs),
                Arg::Ptr(order),
                Arg::Ptr(inv),
                Arg::Ptr(self.fault_ptr()),
            ],
        )?;
        let xh = self.scratch("tiles_x", 2 * n_sel * d)?;
        self.launch(
            "ds4_gather_rows_h",
            (grid_for(n_sel * d), 1, 1),
            256,
            &[
                Arg::Ptr(s.x),
                Arg::Ptr(order),
                i32a(OP, "k", s.k)?,
                i32a(OP, "selections", n_sel)?,
                i32a(OP, "dim", d)?,
                Arg::Ptr(xh),
            ],
        )?;
        // Token tiles of one expert are split over at most TILE_MAX_SPLIT blocks; blocks
        // beyond an expert's tiles return at once.
        let split = g32(n_sel.div_ceil(TILE_TOKENS).clamp(1, TILE_MAX_SPLIT));
        let sg = self.scratch("moe_g", 4 * n_sel * f)?;
        let su = self.scratch("moe_u", 4 * n_sel * f)?;
        self.launch_tiles(
            TileMm {
                w: gp,
                w2: upp,
                mat_bytes: grb * f,
                ty: gty,
                row_bytes: grb,
                n_rows: f,
                cols: d,
                x: xh,
                offs,
                groups: s.n_exp,
                n_tok: n_sel,
                split,
                y: sg,
                y2: su,
                y_stride: f,
                wide: false,
                regs: self.rtiles_for(gty, d, grb, gp, upp),
            },
            OP,
        )?;
        let hh = self.scratch("tiles_h", 2 * n_sel * f)?;
        self.launch(
            "ds4_moe_act_h",
            (grid_for(n_sel * f), 1, 1),
            256,
            &[
                Arg::Ptr(sg),
                Arg::Ptr(su),
                Arg::Ptr(s.weights),
                Arg::Ptr(order),
                i32a(OP, "selections", n_sel)?,
                i32a(OP, "ff", f)?,
                Arg::F32(clamp),
                Arg::Ptr(hh),
            ],
        )?;
        let so = self.scratch("moe_o", 4 * n_sel * d)?;
        self.launch_tiles(
            TileMm {
                w: dp,
                w2: 0,
                mat_bytes: drb * d,
                ty: dty,
                row_bytes: drb,
                n_rows: d,
                cols: f,
                x: hh,
                offs,
                groups: s.n_exp,
                n_tok: n_sel,
                split,
                y: so,
                y2: 0,
                y_stride: d,
                wide: false,
                regs: self.rtiles_for(dty, f, drb, dp, 0),
            },
            OP,
        )?;
        self.launch(
            "ds4_moe_sum_sorted",
            (grid_for(s.n_tok * d), 1, 1),
            256,
            &[
                Arg::Ptr(so),
                Arg::Ptr(inv),
                Arg::Ptr(s.ids),
                i32a(OP, "tokens", s.n_tok)?,
                i32a(OP, "k", s.k)?,
                i32a(OP, "dim", d)?,
                i32a(OP, "experts", s.n_exp)?,
                Arg::Ptr(s.out),
            ],
        )
    }

    /// Whether the grouped GEMV takes experts of `n_out × n_in` of `ty` at `w`.
    /// Device address of the i32 sequence 0, 1, …, IOTA_LEN-1 (uploaded once).
    pub(super) fn iota(&mut self) -> BResult<u64> {
        if let Some(b) = self.scratch.get("iota") {
            return Ok(b.device_address());
        }
        let v: Vec<i32> = (0..IOTA_LEN as i32).collect();
        self.upload_scratch_i32("iota", &v)
    }

    /// The flat entry points (gate/up, down) a grouped launch of `n_sel` selections
    /// (`per_tok` per token) of `ty` runs on (docs/gpu.md §25): int8 activations, a batched
    /// step, a low-bit type (the ones that have them).
    fn flat_functions(
        &self,
        ty: GgmlType,
        n_sel: usize,
        per_tok: usize,
        q8: bool,
    ) -> Option<&(D::Function, D::Function)> {
        if !(q8 && n_sel > per_tok) {
            return None;
        }
        self.gemv.q8_flat_functions(GemvType::from_ggml(ty).ok()?)
    }

    pub(super) fn grouped_ok(&self, ty: GgmlType, n_in: usize, n_out: usize, w: u64) -> bool {
        match GemvType::from_ggml(ty) {
            Ok(g) => self.gemv.launch_for(g, n_in, n_out).is_ok() && w.is_multiple_of(16),
            Err(_) => false,
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn grouped(
        &self,
        ty: GgmlType,
        w: (u64, Option<u64>),
        expert_bytes: usize,
        ids: u64,
        n_experts: usize,
        x: u64,
        x_div: usize,
        y: (u64, Option<u64>),
        (n_sel, per_tok): (usize, usize),
        n_in: usize,
        n_out: usize,
        q8: bool,
    ) -> BResult<()> {
        const OP: &str = "moe";
        let g = GemvType::from_ggml(ty).map_err(gerr(OP))?;
        let mats = if w.1.is_some() { 2 } else { 1 };
        let q8f = if q8 && ds4_gguf::quant::q8act::applies(ty) {
            self.gemv.q8_functions(g)
        } else {
            None
        };
        // Warps per row from one token's selections, never the step's: a decode row then
        // sums as it does alone (docs/gpu.md §10).
        let copies = (per_tok.max(1) as u64) * u64::from(mats);
        let l = if q8f.is_some() {
            self.gemv.q8_launch(g, n_in, n_out, copies)
        } else {
            self.gemv.launch_for_grouped(g, n_in, n_out, copies)
        }
        .map_err(gerr(OP))?;
        if q8 && q8f.is_some() && n_in > self.gemv.q8_max_in {
            return Err(BackendError::Invalid {
                op: OP,
                problem: format!(
                    "int8 activations: an input of {n_in} values (at most {})",
                    self.gemv.q8_max_in
                ),
            });
        }
        // A batched step (more selections than one token's): one flat grid (docs/gpu.md §25).
        if let Some((ff, _)) = self.flat_functions(ty, n_sel, per_tok, q8) {
            let jobs = n_sel as u64 * u64::from(mats);
            return self.launch_fn_smem(
                ff,
                g.label_q8(true),
                (self.gemv.q8_flat_grid_x(u64::from(l.grid_x) * jobs), 1, 1),
                (l.block, self.gemv.q8_smem(g)),
                &[
                    Arg::Ptr(w.0),
                    Arg::Ptr(w.1.unwrap_or(w.0)),
                    u(expert_bytes),
                    Arg::Ptr(ids),
                    i32a(OP, "experts", n_experts)?,
                    i32a(OP, "selections", n_sel)?,
                    Arg::I32(mats as i32),
                    Arg::Ptr(x),
                    u(if x_div == 0 { 0 } else { n_in }),
                    i32a(OP, "selections per input", x_div.max(1))?,
                    Arg::Ptr(y.0),
                    Arg::Ptr(y.1.unwrap_or(y.0)),
                    i32a(OP, "n_in", n_in)?,
                    i32a(OP, "n_out", n_out)?,
                    Arg::I32(l.wpr as i32),
                ],
            );
        }
        if x_div > 1 {
            return Err(BackendError::Invalid {
                op: OP,
                problem: format!("{x_div} selections per input row without a flat grid"),
            });
        }
        let (f, label, grid_x, smem) = match q8f {
            Some((_, gf)) => (
                gf,
                g.label_q8(true),
                self.gemv
                    .q8_grid_x(l.grid_x, g32(n_sel).saturating_mul(mats)),
                self.gemv.q8_smem(g),
            ),
            None => (self.gemv.grouped_function(g), g.label(true), l.grid_x, 0),
        };
        self.launch_fn_smem(
            f,
            label,
            (grid_x, g32(n_sel), mats),
            (l.block, smem),
            &[
                Arg::Ptr(w.0),
                Arg::Ptr(w.1.unwrap_or(w.0)),
                u(expert_bytes),
                Arg::Ptr(ids),
                i32a(OP, "experts", n_experts)?,
                Arg::Ptr(x),
                u(if x_div == 0 { 0 } else { n_in }),
                Arg::Ptr(y.0),
                Arg::Ptr(y.1.unwrap_or(y.0)),
                i32a(OP, "n_in", n_in)?,
                i32a(OP, "n_out", n_out)?,
                Arg::I32(l.wpr as i32),
            ],
        )
    }
}
