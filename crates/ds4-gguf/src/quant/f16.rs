//! IEEE binary16 (ggml F16) conversions and rows.

use super::{plain, QuantError};
use crate::types::GgmlType;

/// Widen f16 bits to f32, exactly (subnormals included; NaN stays NaN).
///
/// Written with integer operations and one f32 subtraction on normal numbers, with selects
/// instead of branches, so loops that call it vectorize and never touch f32 subnormals
/// (which cost a microcode assist on x86). Normal numbers and inf/NaN: move exponent and
/// mantissa into f32 position and re-bias the exponent by an integer add (+112, or +224 for
/// the all-ones exponent). Subnormals: put the 10-bit mantissa m in the low bits of a float
/// whose exponent means 0.5, giving 0.5 + m·2^-24, and subtract 0.5, which is exact.
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let w = u32::from(h) << 16;
    let sign = w & 0x8000_0000;
    let two_w = w.wrapping_add(w); // drops the sign bit; exponent now in bits 27..31
    let rebias = if two_w >= 0xF800_0000 {
        224 << 23
    } else {
        112 << 23
    };
    let normal = (two_w >> 4) + rebias;
    let subnormal = (f32::from_bits((two_w >> 17) | (126 << 23)) - 0.5).to_bits();
    let mag = if two_w < (1 << 27) { subnormal } else { normal };
    f32::from_bits(sign | mag)
}

/// Narrow f32 to f16 bits, rounding to nearest even (the IEEE default that numpy's
/// `astype(float16)` and ggml's `GGML_FP32_TO_FP16` use). Out-of-range values become ±inf.
#[inline]
pub fn f32_to_f16(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

/// Copy a run of little-endian f16 values into a `u16` buffer (a plain copy on
/// little-endian hosts, which LLVM vectorizes); returns how many were copied.
#[inline(always)]
fn load_run(run: &[[u8; 2]], h: &mut [u16; plain::RUN]) -> usize {
    for (d, e) in h.iter_mut().zip(run) {
        *d = u16::from_le_bytes(*e);
    }
    run.len().min(plain::RUN)
}

pub(crate) fn dequantize_row(data: &[u8], out: &mut [f32]) {
    let (elems, _) = data.as_chunks::<2>();
    let mut h = [0u16; plain::RUN];
    for (run, o) in elems.chunks(plain::RUN).zip(out.chunks_mut(plain::RUN)) {
        let n = load_run(run, &mut h);
        for (o, &v) in o.iter_mut().zip(&h[..n]) {
            *o = f16_to_f32(v);
        }
    }
}

/// Row dot product: per run of 256 values, 16 f32 lanes of `f16_to_f32(w)·x`, then the
/// runs' sums added in f64.
pub(crate) fn dot_row_unchecked(data: &[u8], x: &[f32]) -> f32 {
    const LANES: usize = 16;
    let (elems, _) = data.as_chunks::<2>();
    let mut h = [0u16; plain::RUN];
    let mut total = 0f64;
    for (run, xs) in elems.chunks(plain::RUN).zip(x.chunks(plain::RUN)) {
        let n = load_run(run, &mut h);
        let mut acc = [0f32; LANES];
        let (h_full, h_rest) = h[..n].as_chunks::<LANES>();
        let (x_full, x_rest) = xs.as_chunks::<LANES>();
        for (hv, xv) in h_full.iter().zip(x_full) {
            for l in 0..LANES {
                acc[l] += f16_to_f32(hv[l]) * xv[l];
            }
        }
        let mut s = super::hsum(&acc);
        for (&hv, xv) in h_rest.iter().zip(x_rest) {
            s += f16_to_f32(hv) * xv;
        }
        total += f64::from(s);
    }
    total as f32
}

pub(crate) fn quantize_row(src: &[f32]) -> Result<Vec<u8>, QuantError> {
    let mut out = Vec::with_capacity(src.len() * 2);
    for (index, &value) in src.iter().enumerate() {
        let h = f32_to_f16(value);
        if value.is_finite() && h & 0x7fff == 0x7c00 {
            return Err(QuantError::NotRepresentable {
                ty: GgmlType::F16,
                index,
                value,
            });
        }
        out.extend_from_slice(&h.to_le_bytes());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Our branch-light widening agrees with the `half` crate on all 65536 patterns (NaN
    /// compared as NaN) — an independent implementation, unlike the round trip below.
    #[test]
    fn f16_to_f32_is_exact_for_every_pattern() {
        for h in 0..=u16::MAX {
            let ours = f16_to_f32(h);
            let theirs = half::f16::from_bits(h).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{h:#06x}");
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{h:#06x}");
                // Finite and infinite values round-trip through the narrowing.
                assert_eq!(f32_to_f16(ours), h, "{h:#06x}");
            }
        }
    }

    #[test]
    fn f32_to_f16_rounds_to_nearest_even() {
        assert_eq!(f32_to_f16(1.0 + 1.0 / 2048.0), 0x3c00); // tie → even (down)
        assert_eq!(f32_to_f16(1.0 + 3.0 / 2048.0), 0x3c02); // tie → even (up)
        assert_eq!(f32_to_f16(65519.0), 0x7bff);
        assert_eq!(f32_to_f16(65520.0), 0x7c00); // rounds to inf
        assert_eq!(f32_to_f16(f32::from_bits(0x3300_0000)), 0x0000); // 2^-25: tie → 0
        assert_eq!(f32_to_f16(f32::from_bits(0x33c0_0000)), 0x0002); // 1.5·2^-24: tie → 2
        assert_eq!(f32_to_f16(f32::from_bits(0x3420_0000)), 0x0002); // 2.5·2^-24: tie → 2
    }
}
