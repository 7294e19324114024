//! Q2_K: super-blocks of 256 values in 16 sub-blocks of 16.
//! Layout: `scales: u8[16] @0` (low nibble scale, high nibble min per sub-block),
//! `qs: u8[64] @16` (2-bit codes), `d: f16 @80`, `dmin: f16 @82`. y = d·sc·q − dmin·m.
//! Value i = 128h + 32j + l has its code in bits 2j..2j+1 of `qs[32h + l]`.

use super::search::{make_qkx, make_qp, nearest_int, AffineSearch};
use super::{f16::f16_to_f32, f16_at, hsum, scale_to_f16, QuantError};
use crate::types::GgmlType;

pub const BLOCK_ELEMS: usize = 256;
pub const BLOCK_BYTES: usize = 84;

/// Per-sub-block multipliers `(d·sc, dmin·m)` in f32, as the dequantizer forms them.
#[inline(always)]
fn sub_scales(block: &[u8; BLOCK_BYTES]) -> ([f32; 16], [f32; 16]) {
    let d = f16_at(block, 80);
    let dmin = f16_at(block, 82);
    let mut dl = [0f32; 16];
    let mut ml = [0f32; 16];
    for s in 0..16 {
        dl[s] = d * f32::from(block[s] & 0xF);
        ml[s] = dmin * f32::from(block[s] >> 4);
    }
    (dl, ml)
}

/// Dequantize one block, bit-exact with gguf-py: `(d·sc)·q − (dmin·m)` in f32.
#[inline]
pub fn dequantize_block(block: &[u8; BLOCK_BYTES], out: &mut [f32; BLOCK_ELEMS]) {
    let (dl, ml) = sub_scales(block);
    let qs = &block[16..80];
    for h in 0..2 {
        for j in 0..4 {
            let q = &qs[32 * h..][..32];
            let o = &mut out[128 * h + 32 * j..][..32];
            for l in 0..32 {
                let s = 8 * h + 2 * j + l / 16;
                o[l] = dl[s] * f32::from((q[l] >> (2 * j)) & 3) - ml[s];
            }
        }
    }
}

/// Dot product of one block with 256 values of `x`: each dequantized value (computed as
/// in [`dequantize_block`]) times x, accumulated in f32 over 16 lanes.
#[inline]
pub fn dot_block(block: &[u8; BLOCK_BYTES], x: &[f32; BLOCK_ELEMS]) -> f32 {
    let (dl, ml) = sub_scales(block);
    let qs = &block[16..80];
    let mut acc = [0f32; 16];
    for h in 0..2 {
        for j in 0..4 {
            for half in 0..2 {
                let s = 8 * h + 2 * j + half;
                let q = &qs[32 * h + 16 * half..][..16];
                let xs = &x[128 * h + 32 * j + 16 * half..][..16];
                for l in 0..16 {
                    let y = dl[s] * f32::from((q[l] >> (2 * j)) & 3) - ml[s];
                    acc[l] += y * xs[l];
                }
            }
        }
    }
    hsum(&acc)
}

pub(crate) fn dequantize_row(data: &[u8], out: &mut [f32]) {
    super::dequantize_blocks(data, out, dequantize_block);
}

pub(crate) fn dot_row_unchecked(data: &[u8], x: &[f32]) -> f32 {
    super::dot_blocks(data, x, dot_block)
}

/// Dot product of a whole Q2_K row with `x` (see [`super::dot`] for the accumulation).
pub fn dot_row(data: &[u8], x: &[f32]) -> Result<f32, QuantError> {
    super::dot(GgmlType::Q2K, data, x)
}

/// Re-derive each value's 2-bit code from the stored f16 `d`/`dmin` and 4-bit scales as
/// `round((x + dmin·m) / (d·sc))` clamped to 0..3 (sub-blocks with d·sc = 0 keep the search's
/// codes), then assemble the block.
fn finish_block(
    x: &[f32; BLOCK_ELEMS],
    l: &mut [u8; BLOCK_ELEMS],
    scales: [u8; 16],
    d: u16,
    dmin: u16,
) -> [u8; BLOCK_BYTES] {
    let df = f16_to_f32(d);
    let mf = f16_to_f32(dmin);
    for (j, &sc) in scales.iter().enumerate() {
        let dd = df * f32::from(sc & 0xF);
        if dd == 0.0 {
            continue;
        }
        let dm = mf * f32::from(sc >> 4);
        for i in 16 * j..16 * (j + 1) {
            l[i] = nearest_int((x[i] + dm) / dd).clamp(0, 3) as u8;
        }
    }
    let mut out = [0u8; BLOCK_BYTES];
    out[..16].copy_from_slice(&scales);
    for h in 0..2 {
        for i in 0..32 {
            let b = 128 * h + i;
            out[16 + 32 * h + i] = l[b] | (l[b + 32] << 2) | (l[b + 64] << 4) | (l[b + 96] << 6);
        }
    }
    out[80..82].copy_from_slice(&d.to_le_bytes());
    out[82..84].copy_from_slice(&dmin.to_le_bytes());
    out
}

/// ggml's reference Q2_K quantizer (no importance): per 16-value sub-block, weights |x| and
/// the qkx2 search (nmax 3, rmin −0.5, rdelta 0.1, 15 steps, absolute error); d =
/// max_scale/15 and dmin = max_min/15 with 4-bit codes; codes re-derived from the stored
/// values. Refuses a block whose f16 `d` or `dmin` would be infinite (values beyond ~3e6).
pub fn quantize_block(x: &[f32; BLOCK_ELEMS]) -> Result<[u8; BLOCK_BYTES], QuantError> {
    let p = AffineSearch {
        nmax: 3,
        rmin: -0.5,
        rdelta: 0.1,
        nstep: 15,
        use_mad: true,
        qkx3: false,
    };
    let mut l = [0u8; BLOCK_ELEMS];
    let mut scales = [0f32; 16];
    let mut mins = [0f32; 16];
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    let subs = x.as_chunks::<16>().0.iter();
    let lsubs = l.as_chunks_mut::<16>().0.iter_mut();
    for (j, (xs, lj)) in subs.zip(lsubs).enumerate() {
        let w = xs.map(f32::abs);
        (scales[j], mins[j]) = make_qkx(xs, &w, lj, &p);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    // Codes are stored as the C does: the i32 truncated to a byte (no clamp), the min code
    // shifted into the high nibble.
    let mut packed = [0u8; 16];
    let d = if max_scale > 0.0 {
        let iscale = 15.0 / max_scale;
        for j in 0..16 {
            packed[j] = nearest_int(iscale * scales[j]) as u8;
        }
        scale_to_f16(GgmlType::Q2K, 0, max_scale / 15.0)?
    } else {
        0
    };
    let dmin = if max_min > 0.0 {
        let iscale = 15.0 / max_min;
        for j in 0..16 {
            packed[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
        }
        scale_to_f16(GgmlType::Q2K, 0, max_min / 15.0)?
    } else {
        0
    };
    Ok(finish_block(x, &mut l, packed, d, dmin))
}

/// ggml's imatrix Q2_K quantizer: weights `qw·sqrt(σ² + x²)` with σ² = Σx²/256, the qkx3
/// search (nmax 3, rmin −0.9, rdelta 0.05, 36 steps, squared error), then scales and mins
/// quantized to 4 bits by the qp search weighted by each sub-block's weight sum.
pub fn quantize_block_weighted(
    x: &[f32; BLOCK_ELEMS],
    qw: &[f32; BLOCK_ELEMS],
) -> Result<[u8; BLOCK_BYTES], QuantError> {
    let p = AffineSearch {
        nmax: 3,
        rmin: -0.9,
        rdelta: 0.05,
        nstep: 36,
        use_mad: false,
        qkx3: true,
    };
    let mut sum_x2 = 0f32;
    for v in x {
        sum_x2 += v * v;
    }
    let sigma2 = sum_x2 / 256.0;
    let mut l = [0u8; BLOCK_ELEMS];
    let mut scales = [0f32; 16];
    let mut mins = [0f32; 16];
    let mut sw = [0f32; 16];
    let subs = x.as_chunks::<16>().0.iter().zip(qw.as_chunks::<16>().0);
    let lsubs = l.as_chunks_mut::<16>().0.iter_mut();
    for (j, ((xs, q), lj)) in subs.zip(lsubs).enumerate() {
        let mut w = [0f32; 16];
        for i in 0..16 {
            w[i] = q[i] * (sigma2 + xs[i] * xs[i]).sqrt();
        }
        for v in &w {
            sw[j] += v;
        }
        (scales[j], mins[j]) = make_qkx(xs, &w, lj, &p);
    }
    let mut ls = [0u8; 16];
    let mut lm = [0u8; 16];
    let dm = make_qp(&scales, 15, &mut ls, &sw);
    let mm = make_qp(&mins, 15, &mut lm, &sw);
    let d = scale_to_f16(GgmlType::Q2K, 0, dm)?;
    let dmin = scale_to_f16(GgmlType::Q2K, 0, mm)?;
    let mut packed = [0u8; 16];
    for j in 0..16 {
        packed[j] = ls[j] | (lm[j] << 4);
    }
    Ok(finish_block(x, &mut l, packed, d, dmin))
}

/// Quantize a row (length a multiple of 256, finite values; importance, when given, has the
/// same length; both checked by the caller).
pub(crate) fn quantize_row(src: &[f32], importance: Option<&[f32]>) -> Result<Vec<u8>, QuantError> {
    let (blocks, _) = src.as_chunks::<BLOCK_ELEMS>();
    let mut out = Vec::with_capacity(blocks.len() * BLOCK_BYTES);
    match importance {
        None => {
            for (i, x) in blocks.iter().enumerate() {
                out.extend_from_slice(&quantize_block(x).map_err(|e| e.at_block(i))?);
            }
        }
        Some(imp) => {
            let (qws, _) = imp.as_chunks::<BLOCK_ELEMS>();
            for (i, (x, qw)) in blocks.iter().zip(qws).enumerate() {
                let b = quantize_block_weighted(x, qw).map_err(|e| e.at_block(i))?;
                out.extend_from_slice(&b);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The documented formula (docs/gguf.md §6): q = (qs[32h + l] >> 2j) & 3 with h = i/128, j = (i%128)/32,
    /// l = i%32; y = d·(sc & 15)·q − dmin·(sc >> 4) for sub-block i/16.
    #[test]
    fn dequantize_follows_the_spec_formula() {
        let mut b = [0u8; BLOCK_BYTES];
        for (i, v) in b.iter_mut().enumerate() {
            *v = (i as u8).wrapping_mul(151).wrapping_add(3);
        }
        b[80..84].copy_from_slice(&[0x00, 0x3c, 0x00, 0x38]); // d = 1, dmin = 0.5
        let mut y = [0f32; 256];
        dequantize_block(&b, &mut y);
        for i in 0..256 {
            let (h, j, l) = (i / 128, (i % 128) / 32, i % 32);
            let q = (b[16 + 32 * h + l] >> (2 * j)) & 3;
            let sc = b[i / 16];
            let want = f32::from(sc & 15) * f32::from(q) - 0.5 * f32::from(sc >> 4);
            assert_eq!(y[i], want, "i={i}");
        }
    }
}
