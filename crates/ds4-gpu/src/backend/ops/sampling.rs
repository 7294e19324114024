//! Greedy argmax and the sampling band (`kernels/sampling.cu`).

use super::*;

impl<D: GpuApi> GpuBackend<D> {
    pub(in crate::backend) fn op_argmax(&mut self, x: Slice, out: IBuf) -> BResult<()> {
        const OP: &str = "argmax";
        let (xp, op_) = (self.fptr(x, OP)?, self.iptr(out, OP)?);
        self.launch(
            "ds4_argmax",
            (1, 1, 1),
            1024,
            &[Arg::Ptr(xp), i32a(OP, "values", x.len)?, Arg::Ptr(op_)],
        )
    }

    pub(in crate::backend) fn op_logit_band(
        &mut self,
        x: Slice,
        span: f32,
        exclude: Option<u32>,
        out: IBuf,
    ) -> BResult<()> {
        const OP: &str = "logit_band";
        let cap = (out.len() - ds4_engine::sampler::BAND_HEAD) / 2;
        // An index past the row excludes nothing (the definition's reading).
        let ex = exclude
            .filter(|&e| (e as usize) < x.len)
            .map_or(-1, |e| e as i32);
        let (xp, op_) = (self.fptr(x, OP)?, self.iptr(out, OP)?);
        self.launch(
            "ds4_logit_band",
            (1, 1, 1),
            1024,
            &[
                Arg::Ptr(xp),
                i32a(OP, "values", x.len)?,
                Arg::F32(span),
                Arg::I32(ex),
                i32a(OP, "capacity", cap)?,
                Arg::Ptr(op_),
            ],
        )
    }

    /// Up to `BANDS_MAX` bands of rows of `x` per launch of `ds4_logit_bands` (docs/gpu.md
    /// §31): a block per row, each the one-row kernel, side by side.
    pub(in crate::backend) fn op_logit_bands(
        &mut self,
        x: Slice,
        n: usize,
        jobs: &[BandJob],
    ) -> BResult<()> {
        const OP: &str = "logit_bands";
        let xp = self.fptr(x, OP)?;
        for group in jobs.chunks(BANDS_MAX) {
            // Laid out as Ds4BandJobs in sampling.cu: the out pointers, then rows, spans and
            // capacities (4 bytes each, two per word), then the count.
            let mut blob = vec![0u64; BANDS_MAX + 3 * BANDS_MAX / 2 + 1];
            let mut ints = [0u32; 3 * BANDS_MAX];
            for (i, j) in group.iter().enumerate() {
                blob[i] = self.iptr(j.out, OP)?;
                ints[i] = i32v(OP, "row", j.row)? as u32;
                ints[BANDS_MAX + i] = j.span.to_bits();
                ints[2 * BANDS_MAX + i] = ((j.out.len() - ds4_engine::sampler::BAND_HEAD) / 2)
                    .try_into()
                    .unwrap_or(i32::MAX as u32);
            }
            for (k, pair) in ints.chunks_exact(2).enumerate() {
                blob[BANDS_MAX + k] = u64::from(pair[0]) | (u64::from(pair[1]) << 32);
            }
            blob[BANDS_MAX + 3 * BANDS_MAX / 2] = group.len() as u64;
            self.launch_blob(
                "ds4_logit_bands",
                (g32(group.len()), 1, 1),
                1024,
                &[Arg::Ptr(xp), i32a(OP, "values", n)?],
                2,
                &blob,
            )?;
        }
        Ok(())
    }
}
