//! Q4_K: super-blocks of 256 values in 8 sub-blocks of 32.
//! Layout: `d: f16 @0`, `dmin: f16 @2`, `scales: u8[12] @4` (8 six-bit scales and 8 six-bit
//! mins, packed), `qs: u8[128] @16` (4-bit codes). y = d·sc·q − dmin·m.

use super::search::{make_qkx, make_qp, nearest_int, AffineSearch};
use super::{f16::f16_to_f32, f16_at, hsum, scale_to_f16, QuantError};
use crate::types::GgmlType;

pub const BLOCK_ELEMS: usize = 256;
pub const BLOCK_BYTES: usize = 144;

/// The 6-bit scale and min of sub-block `j` (0..8; taken mod 8) from the 12 packed bytes.
#[inline(always)]
pub fn scale_min(j: usize, s: &[u8; 12]) -> (u8, u8) {
    let j = j % 8;
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Pack 6-bit scale/min codes into the 12-byte layout that [`scale_min`] reads.
fn pack_scales(ls: &[u8; 8], lm: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            s[j] = ls[j];
            s[j + 4] = lm[j];
        } else {
            s[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4);
            s[j - 4] |= (ls[j] >> 4) << 6;
            s[j] |= (lm[j] >> 4) << 6;
        }
    }
    s
}

/// Per-sub-block multipliers `(d·sc, dmin·m)` in f32, as the dequantizer forms them.
#[inline(always)]
fn sub_scales(block: &[u8; BLOCK_BYTES]) -> ([f32; 8], [f32; 8]) {
    let d = f16_at(block, 0);
    let dmin = f16_at(block, 2);
    let s: [u8; 12] = std::array::from_fn(|i| block[4 + i]);
    let mut dl = [0f32; 8];
    let mut ml = [0f32; 8];
    for j in 0..8 {
        let (sc, m) = scale_min(j, &s);
        dl[j] = d * f32::from(sc);
        ml[j] = dmin * f32::from(m);
    }
    (dl, ml)
}

/// Dequantize one block, bit-exact with gguf-py: `(d·sc)·q − (dmin·m)` in f32.
#[inline]
pub fn dequantize_block(block: &[u8; BLOCK_BYTES], out: &mut [f32; BLOCK_ELEMS]) {
    let (dl, ml) = sub_scales(block);
    let qs = &block[16..];
    for j in 0..8 {
        let q = &qs[32 * (j / 2)..][..32];
        let shift = 4 * (j % 2);
        let o = &mut out[32 * j..][..32];
        for l in 0..32 {
            o[l] = dl[j] * f32::from((q[l] >> shift) & 0xF) - ml[j];
        }
    }
}

/// Dot product of one block with 256 values of `x`: each dequantized value (computed as
/// in [`dequantize_block`]) times x, accumulated in f32 over 16 lanes.
#[inline]
pub fn dot_block(block: &[u8; BLOCK_BYTES], x: &[f32; BLOCK_ELEMS]) -> f32 {
    let (dl, ml) = sub_scales(block);
    let qs = &block[16..];
    let mut acc = [0f32; 16];
    for j in 0..8 {
        let q = &qs[32 * (j / 2)..][..32];
        let shift = 4 * (j % 2);
        let xs = &x[32 * j..][..32];
        for h in 0..2 {
            for l in 0..16 {
                let y = dl[j] * f32::from((q[16 * h + l] >> shift) & 0xF) - ml[j];
                acc[l] += y * xs[16 * h + l];
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

/// Dot product of a whole Q4_K row with `x` (see [`super::dot`] for the accumulation).
pub fn dot_row(data: &[u8], x: &[f32]) -> Result<f32, QuantError> {
    super::dot(GgmlType::Q4K, data, x)
}

/// Given the stored f16 `d`/`dmin` and packed scales, choose each value's 4-bit code as
/// `round((x + dmin·m) / (d·sc))` clamped to 0..15 (sub-blocks with d·sc = 0 keep `l`),
/// then write the codes: byte l of chunk c holds value 64c+l (low) and 64c+32+l (high).
fn finish_block(
    x: &[f32; BLOCK_ELEMS],
    l: &mut [u8; BLOCK_ELEMS],
    d: u16,
    dmin: u16,
    scales: [u8; 12],
) -> [u8; BLOCK_BYTES] {
    let df = f16_to_f32(d);
    let mf = f16_to_f32(dmin);
    for j in 0..8 {
        let (sc, m) = scale_min(j, &scales);
        let dd = df * f32::from(sc);
        if dd == 0.0 {
            continue;
        }
        let dm = mf * f32::from(m);
        for i in 32 * j..32 * (j + 1) {
            l[i] = nearest_int((x[i] + dm) / dd).clamp(0, 15) as u8;
        }
    }
    let mut out = [0u8; BLOCK_BYTES];
    out[0..2].copy_from_slice(&d.to_le_bytes());
    out[2..4].copy_from_slice(&dmin.to_le_bytes());
    out[4..16].copy_from_slice(&scales);
    for c in 0..4 {
        for i in 0..32 {
            out[16 + 32 * c + i] = l[64 * c + i] | (l[64 * c + 32 + i] << 4);
        }
    }
    out
}

/// ggml's reference Q4_K quantizer (no importance): per sub-block, weights `rms + |x|` and
/// the qkx2 search (nmax 15, rmin −1, rdelta 0.1, 20 steps, squared error); scales and mins
/// quantized to 6 bits against the largest of each; codes re-derived from the stored values.
/// Refuses a block whose f16 `d` or `dmin` would be infinite (values beyond ~6e7).
pub fn quantize_block(x: &[f32; BLOCK_ELEMS]) -> Result<[u8; BLOCK_BYTES], QuantError> {
    let p = AffineSearch {
        nmax: 15,
        rmin: -1.0,
        rdelta: 0.1,
        nstep: 20,
        use_mad: false,
        qkx3: false,
    };
    let mut l = [0u8; BLOCK_ELEMS];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    let subs = x.as_chunks::<32>().0.iter();
    let lsubs = l.as_chunks_mut::<32>().0.iter_mut();
    for (j, (xs, lj)) in subs.zip(lsubs).enumerate() {
        let mut sum_x2 = 0f32;
        for v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let w = xs.map(|v| av_x + v.abs());
        (scales[j], mins[j]) = make_qkx(xs, &w, lj, &p);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let ls = scales.map(|s| (nearest_int(inv_scale * s) as u8).min(63));
    let lm = mins.map(|m| (nearest_int(inv_min * m) as u8).min(63));
    let d = scale_to_f16(GgmlType::Q4K, 0, max_scale / 63.0)?;
    let dmin = scale_to_f16(GgmlType::Q4K, 0, max_min / 63.0)?;
    Ok(finish_block(x, &mut l, d, dmin, pack_scales(&ls, &lm)))
}

/// ggml's imatrix Q4_K quantizer: weights `qw·sqrt(σ² + x²)` with σ² = 2·Σx²/256, the qkx3
/// search (nmax 15, rmin −0.9, rdelta 0.05, 36 steps), then scales and mins quantized to 6
/// bits by the qp search weighted by each sub-block's weight sum.
/// Refuses a block whose f16 `d` or `dmin` would be infinite.
pub fn quantize_block_weighted(
    x: &[f32; BLOCK_ELEMS],
    qw: &[f32; BLOCK_ELEMS],
) -> Result<[u8; BLOCK_BYTES], QuantError> {
    let p = AffineSearch {
        nmax: 15,
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
    let sigma2 = 2.0 * sum_x2 / 256.0;
    let mut l = [0u8; BLOCK_ELEMS];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut sw = [0f32; 8];
    let subs = x.as_chunks::<32>().0.iter().zip(qw.as_chunks::<32>().0);
    let lsubs = l.as_chunks_mut::<32>().0.iter_mut();
    for (j, ((xs, q), lj)) in subs.zip(lsubs).enumerate() {
        let mut w = [0f32; 32];
        for i in 0..32 {
            w[i] = q[i] * (sigma2 + xs[i] * xs[i]).sqrt();
        }
        let mut sumw = 0f32;
        for v in &w {
            sumw += v;
        }
        sw[j] = sumw;
        (scales[j], mins[j]) = make_qkx(xs, &w, lj, &p);
    }
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    let d_block = make_qp(&scales, 63, &mut ls, &sw);
    let m_block = make_qp(&mins, 63, &mut lm, &sw);
    let d = scale_to_f16(GgmlType::Q4K, 0, d_block)?;
    let dmin = scale_to_f16(GgmlType::Q4K, 0, m_block)?;
    Ok(finish_block(x, &mut l, d, dmin, pack_scales(&ls, &lm)))
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

    #[test]
    fn scale_min_packing_round_trips_every_code() {
        for a in 0..64u8 {
            for b in 0..64u8 {
                let ls: [u8; 8] = std::array::from_fn(|j| (a + 7 * j as u8) % 64);
                let lm: [u8; 8] = std::array::from_fn(|j| (b + 13 * j as u8) % 64);
                let s = pack_scales(&ls, &lm);
                for j in 0..8 {
                    assert_eq!(scale_min(j, &s), (ls[j], lm[j]), "j={j}");
                }
            }
        }
    }

    /// The documented formula for element i (docs/gguf.md §6): nibble of qs[32·(i/64) + i%32], low half when
    /// i%64 < 32; y = d·sc[i/32]·q − dmin·m[i/32].
    #[test]
    fn dequantize_follows_the_spec_formula() {
        let mut b = [0u8; BLOCK_BYTES];
        for (i, v) in b.iter_mut().enumerate() {
            *v = (i as u8).wrapping_mul(73).wrapping_add(5);
        }
        b[0..4].copy_from_slice(&[0x00, 0x3c, 0x00, 0x38]); // d = 1, dmin = 0.5
        let mut y = [0f32; 256];
        dequantize_block(&b, &mut y);
        for i in 0..256 {
            let byte = b[16 + 32 * (i / 64) + i % 32];
            let q = if i % 64 < 32 { byte & 15 } else { byte >> 4 };
            let (sc, m) = scale_min(i / 32, b[4..16].try_into().unwrap());
            let want = f32::from(sc) * f32::from(q) - 0.5 * f32::from(m);
            assert_eq!(y[i], want, "i={i}");
        }
    }
}
