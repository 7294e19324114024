//! Safe launchers for the GEMV kernels of `kernels/gemv.cu`: every shape, size,
//! alignment and device check happens here, before the one `unsafe` launch.

use std::ffi::c_void;

use super::device::CudaDevice;
use super::memory::{View, ViewMut};
use super::module::{CudaFunction, CudaModule};
use crate::cache::KernelCache;
use crate::error::{GpuError, Result};
use crate::kernels::{gemv_launch, GemvConfig, GemvLaunch, GemvType, GEMV};

/// Warps per multiprocessor the launch heuristics aim to keep busy.
const WARPS_PER_SM_TARGET: u64 = 48;

/// The loaded GEMV module with one function per weight type (plain and grouped).
pub struct GemvKernels {
    pub module: CudaModule,
    plain: Vec<CudaFunction>,
    grouped: Vec<CudaFunction>,
    configs: Vec<GemvConfig>,
    target_warps: u64,
    /// Per type, the int8-activation grouped entry points decode uses for the routed
    /// experts at one token (`ds4_gemv_grouped_q_<t>`, `ds4_gemv_grouped_swiglu_q_<t>`), for
    /// the low-bit types.
    routed_q: Vec<Option<(CudaFunction, CudaFunction)>>,
    /// Dynamic shared memory of the int8 IQ2_XXS launches (`ds4_gemvq_iq2_smem`).
    iq2_smem: u32,
    sms: u64,
}

/// The routed experts' down projection as decode runs it at one token
/// ([`GemvKernels::gemv_grouped_swiglu_q`]): selection s multiplies expert `ids[s]` of `w`
/// by `route_w[s] · swiglu(g[s], u[s], clamp)`.
pub struct GroupedSwiglu<'a> {
    pub w: View<'a>,
    pub n_experts: usize,
    /// `n_sel` i32 expert ids.
    pub ids: View<'a>,
    pub n_sel: usize,
    /// `n_sel × n_in` f32 each (16-byte aligned).
    pub g: View<'a>,
    pub u: View<'a>,
    /// `n_sel` f32 route weights.
    pub route_w: View<'a>,
    pub clamp: f32,
    /// `n_sel × n_out` f32.
    pub y: ViewMut<'a>,
    /// One i32: the fault bits (a bad expert id sets one).
    pub fault: ViewMut<'a>,
    pub n_in: usize,
    pub n_out: usize,
}

/// Routed-expert GEMV arguments: `n_sel` experts chosen by `ids` (i32 on the device) out
/// of `n_experts` stacked matrices of `n_out × n_in`.
pub struct GroupedGemv<'a> {
    /// First stacked expert tensor (gate, or down).
    pub w0: View<'a>,
    /// Optional second tensor of the same type and shape (up); computed in the same launch.
    pub w1: Option<View<'a>>,
    pub n_experts: usize,
    /// `n_sel` i32 expert ids.
    pub ids: View<'a>,
    pub n_sel: usize,
    /// One input of `n_in` f32 shared by all selections, or `n_sel` inputs back to back
    /// when `x_per_selection` (the down projection).
    pub x: View<'a>,
    pub x_per_selection: bool,
    /// `n_sel × n_out` f32 outputs for w0 (and w1).
    pub y0: ViewMut<'a>,
    pub y1: Option<ViewMut<'a>>,
    pub n_in: usize,
    pub n_out: usize,
}

fn index(ty: GemvType) -> usize {
    GemvType::ALL.iter().position(|t| *t == ty).unwrap_or(0)
}

fn need(op: &'static str, what: &'static str, have: usize, bytes: u64) -> Result<()> {
    if (have as u64) < bytes {
        return Err(GpuError::OutOfBounds {
            op,
            what,
            needed: bytes,
            offset: 0,
            len: have as u64,
        });
    }
    Ok(())
}

fn aligned(op: &'static str, what: &str, ptr: u64, align: u64) -> Result<()> {
    if !ptr.is_multiple_of(align) {
        return Err(GpuError::BadArgument {
            op,
            detail: format!("{what} at {ptr:#x} is not {align}-byte aligned"),
        });
    }
    Ok(())
}

fn same_device(op: &'static str, f: &CudaFunction, ctxs: &[usize]) -> Result<()> {
    if ctxs.iter().any(|c| *c != f.ctx_id()) {
        return Err(GpuError::BadArgument {
            op,
            detail: "a buffer belongs to a different device than the kernel".into(),
        });
    }
    Ok(())
}

fn i32_arg(op: &'static str, what: &str, v: u64) -> Result<i32> {
    i32::try_from(v).map_err(|_| GpuError::BadArgument {
        op,
        detail: format!("{what} = {v} exceeds the kernels' i32 range"),
    })
}

impl GemvKernels {
    /// Compile (or load from `cache`) gemv.cu for `dev` and look up every entry point.
    pub fn load(dev: &CudaDevice, cache: &KernelCache) -> Result<GemvKernels> {
        Self::load_with(dev, cache, &[])
    }

    /// [`Self::load`] with extra NVRTC options (build flags; the tunables are constants).
    pub fn load_with(
        dev: &CudaDevice,
        cache: &KernelCache,
        extra: &[String],
    ) -> Result<GemvKernels> {
        let module = dev.load_module_with(&GEMV, cache, extra)?;
        let mut plain = Vec::new();
        let mut grouped = Vec::new();
        let mut configs = Vec::new();
        for t in GemvType::ALL {
            plain.push(module.function(&format!("ds4_gemv_{}", t.suffix()))?);
            grouped.push(module.function(&format!("ds4_gemv_grouped_{}", t.suffix()))?);
            let [rows, cb] =
                module.read_i32_global::<2>(&format!("ds4_gemv_config_{}", t.suffix()))?;
            configs.push(GemvConfig {
                rows: u32::try_from(rows).unwrap_or(0),
                chunk_blocks: u32::try_from(cb).unwrap_or(0),
            });
        }
        let mut routed_q = Vec::new();
        for t in GemvType::ALL {
            let low_bit = ds4_gguf::quant::q8act::applies(t.ggml()) && t != GemvType::Q8_0;
            routed_q.push(if low_bit {
                Some((
                    module.function(&format!("ds4_gemv_grouped_q_{}", t.suffix()))?,
                    module.function(&format!("ds4_gemv_grouped_swiglu_q_{}", t.suffix()))?,
                ))
            } else {
                None
            });
        }
        // As the backend: the IQ2_XXS tables' shared memory where the device allows it (a
        // launch without it writes NaN rows).
        let [iq2_smem, _] = module.read_i32_global::<2>("ds4_gemvq_iq2_smem")?;
        let iq2_smem = u32::try_from(iq2_smem)
            .ok()
            .filter(|&b| u64::from(b) <= dev.info().max_shared_per_block_optin)
            .unwrap_or(0);
        let sms = u64::from(dev.info().multiprocessors.max(1));
        Ok(GemvKernels {
            module,
            plain,
            grouped,
            configs,
            target_warps: sms * WARPS_PER_SM_TARGET,
            routed_q,
            iq2_smem,
            sms,
        })
    }

    /// The backend's launch of a one-token int8-activation grouped GEMV (docs/gpu.md §25):
    /// warps per row for `copies` matrices, and one persistent wave of
    /// `Q8_RESIDENT_BLOCKS` per multiprocessor split over the grid's `others` y·z blocks.
    fn routed_q_launch(
        &self,
        op: &'static str,
        ty: GemvType,
        n_in: usize,
        n_out: usize,
        others: u64,
    ) -> Result<(&(CudaFunction, CudaFunction), GemvLaunch, u32, u32)> {
        let Some(f) = self.routed_q[index(ty)].as_ref() else {
            return Err(GpuError::BadArgument {
                op,
                detail: format!("no int8-activation routed kernel for {}", ty.suffix()),
            });
        };
        let l = gemv_launch(
            ty,
            self.config(ty),
            n_in as u64,
            n_out as u64,
            (self.target_warps / others.max(1)).max(1),
        )?;
        let wave = (self.sms * crate::backend::Q8_RESIDENT_BLOCKS).div_ceil(others.max(1));
        let grid_x = l.grid_x.min(u32::try_from(wave.max(1)).unwrap_or(u32::MAX));
        let smem = if ty == GemvType::Iq2Xxs {
            self.iq2_smem
        } else {
            0
        };
        Ok((f, l, grid_x, smem))
    }

    /// The plain entry point for `ty` (for attribute reports).
    pub fn function(&self, ty: GemvType) -> &CudaFunction {
        &self.plain[index(ty)]
    }

    /// The grouped entry point for `ty`.
    pub fn grouped_function(&self, ty: GemvType) -> &CudaFunction {
        &self.grouped[index(ty)]
    }

    /// The configuration compiled into the loaded kernels for `ty`.
    pub fn config(&self, ty: GemvType) -> GemvConfig {
        self.configs[index(ty)]
    }

    /// Launch geometry this device uses for a shape.
    pub fn launch_for(&self, ty: GemvType, n_in: usize, n_out: usize) -> Result<GemvLaunch> {
        gemv_launch(
            ty,
            self.config(ty),
            n_in as u64,
            n_out as u64,
            self.target_warps,
        )
    }

    /// Queue `y[n_out] = W[n_out][n_in] · x[n_in]` (f32 x and y, W of type `ty`).
    pub fn gemv(
        &self,
        ty: GemvType,
        w: View<'_>,
        x: View<'_>,
        y: ViewMut<'_>,
        n_in: usize,
        n_out: usize,
    ) -> Result<GemvLaunch> {
        const OP: &str = "gemv";
        let f = &self.plain[index(ty)];
        let l = self.launch_for(ty, n_in, n_out)?;
        same_device(OP, f, &[w.ctx, x.ctx, y.ctx])?;
        let w_bytes = l.row_bytes * n_out as u64;
        need(OP, "weights", w.len, w_bytes)?;
        need(OP, "x", x.len, 4 * n_in as u64)?;
        need(OP, "y", y.len, 4 * n_out as u64)?;
        aligned(OP, "weights", w.ptr, 16)?;
        aligned(OP, "x", x.ptr, 16)?;
        aligned(OP, "y", y.ptr, 4)?;
        let (mut wp, mut xp, mut yp) = (w.ptr, x.ptr, y.ptr);
        let mut a_in = i32_arg(OP, "n_in", n_in as u64)?;
        let mut a_out = i32_arg(OP, "n_out", n_out as u64)?;
        let mut a_wpr = l.wpr as i32;
        let mut params: [*mut c_void; 6] = [
            (&mut wp as *mut u64).cast(),
            (&mut xp as *mut u64).cast(),
            (&mut yp as *mut u64).cast(),
            (&mut a_in as *mut i32).cast(),
            (&mut a_out as *mut i32).cast(),
            (&mut a_wpr as *mut i32).cast(),
        ];
        // SAFETY: parameter types and order match ds4_gemv_<t>(const u8*, const float*,
        // float*, int, int, int); the kernel reads row_bytes·n_out bytes of W, n_in floats
        // of x and writes n_out floats of y, all checked above against live views of
        // buffers on this kernel's device, with the alignment the kernel's vector loads need.
        unsafe { f.launch((l.grid_x, 1, 1), l.block, &mut params)? };
        Ok(l)
    }

    /// Queue the grouped routed-expert GEMV (see [`GroupedGemv`]).
    pub fn gemv_grouped(&self, ty: GemvType, g: GroupedGemv<'_>) -> Result<GemvLaunch> {
        const OP: &str = "gemv_grouped";
        let f = &self.grouped[index(ty)];
        let l = self.launch_for(ty, g.n_in, g.n_out)?;
        if g.n_sel == 0 || g.n_sel > 65535 || g.n_experts == 0 {
            return Err(GpuError::BadArgument {
                op: OP,
                detail: format!("{} selections of {} experts", g.n_sel, g.n_experts),
            });
        }
        if g.w1.is_some() != g.y1.is_some() {
            return Err(GpuError::BadArgument {
                op: OP,
                detail: "w1 and y1 must be given together".into(),
            });
        }
        let mut ctxs = vec![g.w0.ctx, g.ids.ctx, g.x.ctx, g.y0.ctx];
        ctxs.extend(g.w1.map(|v| v.ctx));
        ctxs.extend(g.y1.as_ref().map(|v| v.ctx));
        same_device(OP, f, &ctxs)?;
        let expert_bytes = l.row_bytes * g.n_out as u64;
        let total = expert_bytes
            .checked_mul(g.n_experts as u64)
            .ok_or_else(|| GpuError::BadArgument {
                op: OP,
                detail: "expert tensor size overflows".into(),
            })?;
        need(OP, "w0", g.w0.len, total)?;
        aligned(OP, "w0", g.w0.ptr, 16)?;
        if let Some(w1) = g.w1 {
            need(OP, "w1", w1.len, total)?;
            aligned(OP, "w1", w1.ptr, 16)?;
        }
        need(OP, "ids", g.ids.len, 4 * g.n_sel as u64)?;
        aligned(OP, "ids", g.ids.ptr, 4)?;
        let x_inputs = if g.x_per_selection { g.n_sel as u64 } else { 1 };
        need(OP, "x", g.x.len, 4 * g.n_in as u64 * x_inputs)?;
        aligned(OP, "x", g.x.ptr, 16)?;
        let y_bytes = 4 * (g.n_sel * g.n_out) as u64;
        need(OP, "y0", g.y0.len, y_bytes)?;
        aligned(OP, "y0", g.y0.ptr, 4)?;
        if let Some(y1) = &g.y1 {
            need(OP, "y1", y1.len, y_bytes)?;
            aligned(OP, "y1", y1.ptr, 4)?;
        }
        let mats = if g.w1.is_some() { 2 } else { 1 };
        let mut w0 = g.w0.ptr;
        let mut w1 = g.w1.map_or(g.w0.ptr, |v| v.ptr);
        let mut eb = expert_bytes;
        let mut ids = g.ids.ptr;
        let mut ne = i32_arg(OP, "n_experts", g.n_experts as u64)?;
        let mut xp = g.x.ptr;
        let mut xs = if g.x_per_selection { g.n_in as u64 } else { 0 };
        let mut y0 = g.y0.ptr;
        let mut y1 = g.y1.as_ref().map_or(g.y0.ptr, |v| v.ptr);
        let mut a_in = i32_arg(OP, "n_in", g.n_in as u64)?;
        let mut a_out = i32_arg(OP, "n_out", g.n_out as u64)?;
        let mut a_wpr = l.wpr as i32;
        let mut params: [*mut c_void; 12] = [
            (&mut w0 as *mut u64).cast(),
            (&mut w1 as *mut u64).cast(),
            (&mut eb as *mut u64).cast(),
            (&mut ids as *mut u64).cast(),
            (&mut ne as *mut i32).cast(),
            (&mut xp as *mut u64).cast(),
            (&mut xs as *mut u64).cast(),
            (&mut y0 as *mut u64).cast(),
            (&mut y1 as *mut u64).cast(),
            (&mut a_in as *mut i32).cast(),
            (&mut a_out as *mut i32).cast(),
            (&mut a_wpr as *mut i32).cast(),
        ];
        // SAFETY: parameter types and order match ds4_gemv_grouped_<t>; the kernel reads
        // at most n_experts·expert_bytes of each weight tensor (ids are range-checked in
        // the kernel, bad ids produce NaN rows), n_sel ids, x of the checked size, and
        // writes n_sel·n_out floats of y0 (and y1 when grid z = 2), all checked above.
        unsafe { f.launch((l.grid_x, g.n_sel as u32, mats), l.block, &mut params)? };
        Ok(l)
    }

    /// Queue the routed gate/up (or any one-token grouped GEMV with a shared input) as
    /// decode runs it: `ds4_gemv_grouped_q_<t>` (int8 activations) with the backend's
    /// launch. Low-bit types only; `g.x_per_selection` must be false.
    pub fn gemv_grouped_q(&self, ty: GemvType, g: GroupedGemv<'_>) -> Result<GemvLaunch> {
        const OP: &str = "gemv_grouped_q";
        if g.x_per_selection || g.n_sel == 0 || g.n_sel > 65535 || g.n_experts == 0 {
            return Err(GpuError::BadArgument {
                op: OP,
                detail: format!(
                    "{} selections of {} experts (per-selection inputs: {})",
                    g.n_sel, g.n_experts, g.x_per_selection
                ),
            });
        }
        if g.w1.is_some() != g.y1.is_some() {
            return Err(GpuError::BadArgument {
                op: OP,
                detail: "w1 and y1 must be given together".into(),
            });
        }
        let mats: u32 = if g.w1.is_some() { 2 } else { 1 };
        let others = g.n_sel as u64 * u64::from(mats);
        let ((f, _), l, grid_x, smem) = self.routed_q_launch(OP, ty, g.n_in, g.n_out, others)?;
        let mut ctxs = vec![g.w0.ctx, g.ids.ctx, g.x.ctx, g.y0.ctx];
        ctxs.extend(g.w1.map(|v| v.ctx));
        ctxs.extend(g.y1.as_ref().map(|v| v.ctx));
        same_device(OP, f, &ctxs)?;
        let expert_bytes = l.row_bytes * g.n_out as u64;
        let total = expert_bytes
            .checked_mul(g.n_experts as u64)
            .ok_or_else(|| GpuError::BadArgument {
                op: OP,
                detail: "expert tensor size overflows".into(),
            })?;
        need(OP, "w0", g.w0.len, total)?;
        aligned(OP, "w0", g.w0.ptr, 16)?;
        if let Some(w1) = g.w1 {
            need(OP, "w1", w1.len, total)?;
            aligned(OP, "w1", w1.ptr, 16)?;
        }
        need(OP, "ids", g.ids.len, 4 * g.n_sel as u64)?;
        aligned(OP, "ids", g.ids.ptr, 4)?;
        need(OP, "x", g.x.len, 4 * g.n_in as u64)?;
        aligned(OP, "x", g.x.ptr, 16)?;
        let y_bytes = 4 * (g.n_sel * g.n_out) as u64;
        need(OP, "y0", g.y0.len, y_bytes)?;
        aligned(OP, "y0", g.y0.ptr, 4)?;
        if let Some(y1) = &g.y1 {
            need(OP, "y1", y1.len, y_bytes)?;
            aligned(OP, "y1", y1.ptr, 4)?;
        }
        let mut w0 = g.w0.ptr;
        let mut w1 = g.w1.map_or(g.w0.ptr, |v| v.ptr);
        let mut eb = expert_bytes;
        let mut ids = g.ids.ptr;
        let mut ne = i32_arg(OP, "n_experts", g.n_experts as u64)?;
        let mut xp = g.x.ptr;
        let mut xs = 0u64;
        let mut y0 = g.y0.ptr;
        let mut y1 = g.y1.as_ref().map_or(g.y0.ptr, |v| v.ptr);
        let mut a_in = i32_arg(OP, "n_in", g.n_in as u64)?;
        let mut a_out = i32_arg(OP, "n_out", g.n_out as u64)?;
        let mut a_wpr = l.wpr as i32;
        let mut params: [*mut c_void; 12] = [
            (&mut w0 as *mut u64).cast(),
            (&mut w1 as *mut u64).cast(),
            (&mut eb as *mut u64).cast(),
            (&mut ids as *mut u64).cast(),
            (&mut ne as *mut i32).cast(),
            (&mut xp as *mut u64).cast(),
            (&mut xs as *mut u64).cast(),
            (&mut y0 as *mut u64).cast(),
            (&mut y1 as *mut u64).cast(),
            (&mut a_in as *mut i32).cast(),
            (&mut a_out as *mut i32).cast(),
            (&mut a_wpr as *mut i32).cast(),
        ];
        // SAFETY: parameter types and order match ds4_gemv_grouped_q_<t> (the arguments of
        // ds4_gemv_grouped_<t>); it reads at most n_experts·expert_bytes of each weight
        // tensor (ids range-checked in the kernel), n_sel ids and n_in floats of x, and
        // writes n_sel·n_out floats of y0 (and y1 when grid z = 2), all checked above; the
        // dynamic shared memory is at most the device's opt-in maximum (checked at load).
        unsafe { f.launch_smem((grid_x, g.n_sel as u32, mats), l.block, smem, &mut params)? };
        Ok(l)
    }

    /// Queue the routed down projection as decode runs it at one token:
    /// `ds4_gemv_grouped_swiglu_q_<t>` (SwiGLU and the route weight in the input stage, int8
    /// activations) with the backend's launch. Low-bit types only.
    pub fn gemv_grouped_swiglu_q(&self, ty: GemvType, a: GroupedSwiglu<'_>) -> Result<GemvLaunch> {
        const OP: &str = "gemv_grouped_swiglu_q";
        if a.n_sel == 0 || a.n_sel > 65535 || a.n_experts == 0 || !a.n_in.is_multiple_of(32) {
            return Err(GpuError::BadArgument {
                op: OP,
                detail: format!(
                    "{} selections of {} experts, {} inputs",
                    a.n_sel, a.n_experts, a.n_in
                ),
            });
        }
        let ((_, f), l, grid_x, smem) =
            self.routed_q_launch(OP, ty, a.n_in, a.n_out, a.n_sel as u64)?;
        same_device(
            OP,
            f,
            &[
                a.w.ctx,
                a.ids.ctx,
                a.g.ctx,
                a.u.ctx,
                a.route_w.ctx,
                a.y.ctx,
                a.fault.ctx,
            ],
        )?;
        let expert_bytes = l.row_bytes * a.n_out as u64;
        let total = expert_bytes
            .checked_mul(a.n_experts as u64)
            .ok_or_else(|| GpuError::BadArgument {
                op: OP,
                detail: "expert tensor size overflows".into(),
            })?;
        need(OP, "w", a.w.len, total)?;
        aligned(OP, "w", a.w.ptr, 16)?;
        need(OP, "ids", a.ids.len, 4 * a.n_sel as u64)?;
        aligned(OP, "ids", a.ids.ptr, 4)?;
        let x_bytes = 4 * (a.n_sel * a.n_in) as u64;
        need(OP, "g", a.g.len, x_bytes)?;
        aligned(OP, "g", a.g.ptr, 16)?;
        need(OP, "u", a.u.len, x_bytes)?;
        aligned(OP, "u", a.u.ptr, 16)?;
        need(OP, "route_w", a.route_w.len, 4 * a.n_sel as u64)?;
        aligned(OP, "route_w", a.route_w.ptr, 4)?;
        need(OP, "y", a.y.len, 4 * (a.n_sel * a.n_out) as u64)?;
        aligned(OP, "y", a.y.ptr, 4)?;
        need(OP, "fault", a.fault.len, 4)?;
        aligned(OP, "fault", a.fault.ptr, 4)?;
        let mut w = a.w.ptr;
        let mut eb = expert_bytes;
        let mut ids = a.ids.ptr;
        let mut ne = i32_arg(OP, "n_experts", a.n_experts as u64)?;
        let mut gp = a.g.ptr;
        let mut up = a.u.ptr;
        let mut rw = a.route_w.ptr;
        let mut c = a.clamp;
        let mut y = a.y.ptr;
        let mut a_in = i32_arg(OP, "n_in", a.n_in as u64)?;
        let mut a_out = i32_arg(OP, "n_out", a.n_out as u64)?;
        let mut a_wpr = l.wpr as i32;
        let mut fault = a.fault.ptr;
        let mut params: [*mut c_void; 13] = [
            (&mut w as *mut u64).cast(),
            (&mut eb as *mut u64).cast(),
            (&mut ids as *mut u64).cast(),
            (&mut ne as *mut i32).cast(),
            (&mut gp as *mut u64).cast(),
            (&mut up as *mut u64).cast(),
            (&mut rw as *mut u64).cast(),
            (&mut c as *mut f32).cast(),
            (&mut y as *mut u64).cast(),
            (&mut a_in as *mut i32).cast(),
            (&mut a_out as *mut i32).cast(),
            (&mut a_wpr as *mut i32).cast(),
            (&mut fault as *mut u64).cast(),
        ];
        // SAFETY: parameter types and order match ds4_gemv_grouped_swiglu_q_<t>(const u8*,
        // size_t, const i32*, int, const float*, const float*, const float*, float, float*,
        // int, int, int, int*); it reads at most n_experts·expert_bytes of w (ids
        // range-checked in the kernel), n_sel ids and route weights, n_sel·n_in floats of g
        // and u, and writes n_sel·n_out floats of y and one i32 of fault, all checked above;
        // the dynamic shared memory is at most the device's opt-in maximum (checked at load).
        unsafe { f.launch_smem((grid_x, a.n_sel as u32, 1), l.block, smem, &mut params)? };
        Ok(l)
    }
}
