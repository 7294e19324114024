//! The routed experts' matmuls at decode on the one-warp-per-row engine
//! (`kernels/moe_rows.cu`, docs/gpu.md §41): gate and up of every selection in one launch,
//! the down projection with SwiGLU and the route weight in its input in a second.

use super::*;

/// The engine's entry points, by the routed matrices' types (IQ2_XXS, Q2_K).
pub(crate) struct MoeRows<D: GpuApi> {
    /// `(ds4_moe_rows_<t>, ds4_moe_rows_swiglu_<t>)` and the widest input of `<t>`.
    iq2_xxs: (D::Function, D::Function, usize),
    q2_k: (D::Function, D::Function, usize),
    /// Temporary A/B (`DS4_MOE_ROWS=0`: the staged engine), removed once measured.
    enabled: bool,
}

impl<D: GpuApi> MoeRows<D> {
    pub(crate) fn load(dev: &D, module: &D::Module) -> Result<Self, crate::GpuError> {
        let [iq2_max, q2k_max] = dev.read_i32x2_global(module, "ds4_moe_rows_max_in")?;
        let width = |v: i32| usize::try_from(v).unwrap_or(0);
        let pair = |t: &str| -> Result<_, crate::GpuError> {
            Ok((
                dev.function(module, &format!("ds4_moe_rows_{t}"))?,
                dev.function(module, &format!("ds4_moe_rows_swiglu_{t}"))?,
            ))
        };
        let (a, b) = pair("iq2_xxs")?;
        let (c, d) = pair("q2_k")?;
        Ok(MoeRows {
            iq2_xxs: (a, b, width(iq2_max)),
            q2_k: (c, d, width(q2k_max)),
            enabled: std::env::var("DS4_MOE_ROWS").map_or(true, |v| v != "0"),
        })
    }

    /// The entry points for rows of `n_in` values of `ty`, where the engine takes them: its
    /// lane units (128 IQ2_XXS or 64 Q2_K values) cover the row with at most one per lane.
    fn for_type(&self, ty: GgmlType, n_in: usize) -> Option<(&D::Function, &D::Function)> {
        if !self.enabled {
            return None;
        }
        let (e, vals) = match ty {
            GgmlType::Iq2Xxs => (&self.iq2_xxs, 128),
            GgmlType::Q2K => (&self.q2_k, 64),
            _ => return None,
        };
        // Rows are copied in 16-byte pieces.
        let whole = GemvType::from_ggml(ty)
            .ok()
            .and_then(|g| g.row_bytes(n_in as u64).ok())
            .is_some_and(|b| b.is_multiple_of(16));
        (n_in > 0 && n_in <= e.2 && n_in.is_multiple_of(vals) && whole).then_some((&e.0, &e.1))
    }
}

/// One routed-expert matrix set as the engine reads it: base address, type, bytes per expert.
pub(super) struct ExpertMats {
    pub w: (u64, Option<u64>),
    pub ty: GgmlType,
    pub expert_bytes: usize,
}

impl<D: GpuApi> GpuBackend<D> {
    /// Whether gate/up (`d` inputs) and down (`f` inputs) both run on this engine.
    pub(super) fn moe_rows_takes(
        &self,
        gate: &ExpertMats,
        down: &ExpertMats,
        d: usize,
        f: usize,
    ) -> bool {
        let aligned = |m: &ExpertMats| {
            m.w.0.is_multiple_of(16)
                && m.w.1.is_none_or(|p| p.is_multiple_of(16))
                && m.expert_bytes.is_multiple_of(16)
        };
        self.gemv.moe_rows.for_type(gate.ty, d).is_some()
            && self.gemv.moe_rows.for_type(down.ty, f).is_some()
            && aligned(gate)
            && aligned(down)
    }

    /// Blocks of one launch: one wave of two per multiprocessor, or one per step of eight
    /// rows where there are fewer.
    fn moe_rows_grid(&self, jobs: usize, n_out: usize) -> (u32, u32, u32) {
        let steps = (jobs * n_out.div_ceil(crate::kernels::GEMV_WARPS as usize)) as u64;
        (self.gemv.q8_flat_grid_x(steps), 1, 1)
    }

    /// Gate and up of `n_sel` selections (`per_tok` per token; token t's input is row t of
    /// `x`, `n_in` floats apart) into `y.0`, `y.1`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_rows_gate_up(
        &self,
        m: &ExpertMats,
        (ids, n_experts): (u64, usize),
        x: u64,
        y: (u64, u64),
        (n_sel, per_tok): (usize, usize),
        n_in: usize,
        n_out: usize,
    ) -> BResult<()> {
        const OP: &str = "moe";
        let (f, _) =
            self.gemv
                .moe_rows
                .for_type(m.ty, n_in)
                .ok_or_else(|| BackendError::Invalid {
                    op: OP,
                    problem: format!("no row engine for {:?} rows of {n_in}", m.ty),
                })?;
        let gt = GemvType::from_ggml(m.ty).map_err(gerr(OP))?;
        let mats = if m.w.1.is_some() { 2 } else { 1 };
        self.launch_fn_smem(
            f,
            if m.ty == GgmlType::Q2K {
                "moe_rows_q2_k"
            } else {
                "moe_rows_iq2_xxs"
            },
            self.moe_rows_grid(n_sel * mats, n_out),
            (crate::kernels::GEMV_THREADS, self.gemv.q8_smem(gt)),
            &[
                Arg::Ptr(m.w.0),
                Arg::Ptr(m.w.1.unwrap_or(m.w.0)),
                u(m.expert_bytes),
                Arg::Ptr(ids),
                i32a(OP, "experts", n_experts)?,
                i32a(OP, "selections", n_sel)?,
                Arg::I32(mats as i32),
                Arg::Ptr(x),
                u(n_in),
                i32a(OP, "selections per input", per_tok.max(1))?,
                Arg::Ptr(y.0),
                Arg::Ptr(y.1),
                i32a(OP, "n_in", n_in)?,
                i32a(OP, "n_out", n_out)?,
            ],
        )
    }

    /// The down projection: selection s reads `route_w[s] · swiglu(g[s], u[s], clamp)`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_rows_down(
        &self,
        m: &ExpertMats,
        (ids, n_experts): (u64, usize),
        (g, u_): (u64, u64),
        (route_w, clamp): (u64, f32),
        y: u64,
        n_sel: usize,
        n_in: usize,
        n_out: usize,
    ) -> BResult<()> {
        const OP: &str = "moe";
        let (_, f) =
            self.gemv
                .moe_rows
                .for_type(m.ty, n_in)
                .ok_or_else(|| BackendError::Invalid {
                    op: OP,
                    problem: format!("no row engine for {:?} rows of {n_in}", m.ty),
                })?;
        let gt = GemvType::from_ggml(m.ty).map_err(gerr(OP))?;
        if !g.is_multiple_of(16) || !u_.is_multiple_of(16) {
            return Err(BackendError::Invalid {
                op: OP,
                problem: "SwiGLU inputs not 16-byte aligned".into(),
            });
        }
        self.launch_fn_smem(
            f,
            if m.ty == GgmlType::Q2K {
                "moe_rows_swiglu_q2_k"
            } else {
                "moe_rows_swiglu_iq2_xxs"
            },
            self.moe_rows_grid(n_sel, n_out),
            (crate::kernels::GEMV_THREADS, self.gemv.q8_smem(gt)),
            &[
                Arg::Ptr(m.w.0),
                u(m.expert_bytes),
                Arg::Ptr(ids),
                i32a(OP, "experts", n_experts)?,
                i32a(OP, "selections", n_sel)?,
                Arg::Ptr(g),
                Arg::Ptr(u_),
                Arg::Ptr(route_w),
                Arg::F32(clamp),
                Arg::Ptr(y),
                i32a(OP, "n_in", n_in)?,
                i32a(OP, "n_out", n_out)?,
                Arg::Ptr(self.fault_ptr()),
            ],
        )
    }
}
