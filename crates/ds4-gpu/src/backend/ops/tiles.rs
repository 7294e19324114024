//! Prefill matmuls from quantized tiles (`kernels/tiles.cu`).

use super::*;

impl<D: GpuApi> GpuBackend<D> {
    /// Whether `ds4_mm_tiles` decodes `ty` rows of `cols` values at `w` (row starts
    /// aligned for its loads: 16-byte loads of float rows, u16 loads of Q8_0 blocks, u32
    /// of the K-quants, so that the raw bytes prefetched across the tensor-core step take
    /// few registers; the K step needs `cols` in whole 32-value groups). MXFP4's 17-byte
    /// blocks are read as the aligned u32 words that hold them, so its matrix and rows must
    /// be 4-byte multiples (rows of a multiple of 128 values) for those words to stay inside
    /// the matrix. GGUF tensors are 32-byte aligned, so real models always qualify.
    pub(super) fn tiles_ok(&self, ty: GgmlType, cols: usize, w: u64, row_bytes: usize) -> bool {
        let align = match ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => 16,
            GgmlType::Q2K | GgmlType::Q4K | GgmlType::Mxfp4 => 4,
            GgmlType::Iq2Xxs | GgmlType::Q8_0 => 2,
            _ => return false,
        };
        cols.is_multiple_of(32)
            && cols > 0
            && w.is_multiple_of(align)
            && row_bytes.is_multiple_of(align as usize)
    }

    /// Whether a prefill's routed experts (more than [`GROUPED_MAX_SEL`] selections, not
    /// decode rows) take the tiles: on, and every matrix as [`Self::tiles_ok`] asks.
    pub(in crate::backend) fn moe_takes_tiles(
        &self,
        gate: Weight,
        up: Weight,
        down: Weight,
    ) -> bool {
        let ok = |w: Weight, cols: usize| {
            let (Ok(gw), Ok(p)) = (self.weight(w, "moe"), self.wraw(w, "moe")) else {
                return false;
            };
            self.tiles_ok(gw.info.ty, cols, p, gw.row_bytes)
        };
        let (d, f) = (gate.info.cols(), gate.info.rows());
        self.tiles != PrefillTiles::Off && ok(gate, d) && ok(up, d) && ok(down, f)
    }

    /// Whether a routed-expert matmul takes `ds4_mm_rtiles` (tiles.cu: the weights decoded
    /// straight into the MMA registers; faster than `ds4_mm_tiles` for these formats, see
    /// BENCHMARKS.md, prefill tiles): IQ2_XXS or Q2_K rows of a multiple of 256 values,
    /// aligned as [`Self::tiles_ok`] asks, and the device allowing the kernel's shared memory
    /// (0 bytes: a build without `mma.sync`, whose kernel is a NaN stub).
    pub(super) fn rtiles_for(
        &self,
        ty: GgmlType,
        cols: usize,
        row_bytes: usize,
        w: u64,
        w2: u64,
    ) -> bool {
        // 0 bytes: a build without mma.sync, whose ds4_mm_rtiles is a NaN stub (tiles.cu).
        self.rtiles_smem > 0
            && matches!(ty, GgmlType::Iq2Xxs | GgmlType::Q2K)
            && cols >= 256
            && cols.is_multiple_of(256)
            && self.tiles_ok(ty, cols, w, row_bytes)
            && (w2 == 0 || self.tiles_ok(ty, cols, w2, row_bytes))
            && self.rtiles_smem <= self.max_dyn_smem
    }

    /// One `ds4_mm_tiles` launch: `y = W·x` for every group (see tiles.cu), with a second
    /// matrix of the same shape when `t.w2`/`t.y2` are set.
    pub(super) fn launch_tiles(&mut self, t: TileMm, op: &'static str) -> BResult<()> {
        let groups = t.groups * if t.w2 != 0 { 2 } else { 1 };
        let (kernel, rows, smem) = if t.regs {
            ("ds4_mm_rtiles", RTILE_ROWS, self.rtiles_smem)
        } else if t.wide {
            ("ds4_mm_tiles_wide", WIDE_ROWS, 0)
        } else {
            ("ds4_mm_tiles", TILE_ROWS, 0)
        };
        if smem > self.max_dyn_smem {
            return Err(BackendError::Invalid {
                op,
                problem: format!(
                    "{kernel} was built for {smem} bytes of shared memory; this device allows {}",
                    self.max_dyn_smem
                ),
            });
        }
        self.launch_smem(
            kernel,
            (g32(t.n_rows.div_ceil(rows)), g32(groups), t.split),
            256,
            smem,
            &[
                Arg::Ptr(t.w),
                Arg::Ptr(t.w2),
                u(t.mat_bytes),
                Arg::I32(t.ty.code() as i32),
                u(t.row_bytes),
                i32a(op, "rows", t.n_rows)?,
                i32a(op, "cols", t.cols)?,
                Arg::Ptr(t.x),
                Arg::Ptr(t.offs),
                i32a(op, "tokens", t.n_tok)?,
                Arg::Ptr(t.y),
                Arg::Ptr(t.y2),
                u(t.y_stride),
            ],
        )
    }

    /// A dense multi-token matmul on tiles: the activations as halves, then one launch.
    pub(super) fn mm_tiles(&mut self, m: Mm, op: &'static str) -> BResult<()> {
        let xh = self.x_as_half(&m, op)?;
        // More than one token tile of 64: blocks of 128 tokens (half the weight decoding).
        let wide = m.n_tok > TILE_TOKENS;
        let tokens = if wide { WIDE_TOKENS } else { TILE_TOKENS };
        self.launch_tiles(
            TileMm {
                w: m.w + (m.row0 * m.row_bytes) as u64,
                w2: 0,
                mat_bytes: 0,
                ty: m.ty,
                row_bytes: m.row_bytes,
                n_rows: m.n_rows,
                cols: m.cols,
                x: xh,
                offs: 0,
                groups: 1,
                n_tok: m.n_tok,
                split: g32(m.n_tok.div_ceil(tokens)),
                y: m.y,
                y2: 0,
                y_stride: m.y_stride,
                wide,
                regs: false,
            },
            op,
        )
    }
}
