//! IEEE binary16 (ggml F16) conversions and rows.

use super::{plain, QuantError};
use crate::types::GgmlType;

/// Widen f16 bits to f32, exactly (subnormals included; NaN stays NaN).
///
/// Written with integer and f32 operations only (no table, no branch the optimizer cannot
/// turn into a select) so the loops that call it vectorize. Normal numbers: shift the
/// exponent/mantissa into f32 position and fix the exponent bias with one multiply by 2^-112
/// (which also maps f16 inf/NaN onto f32 inf/NaN). Subnormals: place the mantissa in the
/// low bits of a float with exponent 2^-1 and subtract 0.5, which is exact.
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let w = u32::from(h) << 16;
    let sign = w & 0x8000_0000;
    let two_w = w.wrapping_add(w); // drops the sign bit
    let normal = f32::from_bits((two_w >> 4) + (0xE0 << 23)) * f32::from_bits(0x0780_0000);
    let subnormal = f32::from_bits((two_w >> 17) | (126 << 23)) - 0.5;
    let mag = if two_w < (1 << 27) {
        subnormal.to_bits()
    } else {
        normal.to_bits()
    };
    f32::from_bits(sign | mag)
}

/// Narrow f32 to f16 bits, rounding to nearest even (the IEEE default that numpy's
/// `astype(float16)` and ggml's `GGML_FP32_TO_FP16` use). Out-of-range values become ±inf.
#[inline]
pub fn f32_to_f16(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

pub(crate) fn dequantize_row(data: &[u8], out: &mut [f32]) {
    plain::dequantize_with(data, out, |b| f16_to_f32(u16::from_le_bytes(b)));
}

pub(crate) fn dot_row_unchecked(data: &[u8], x: &[f32]) -> f32 {
    plain::dot_with(data, x, |b| f16_to_f32(u16::from_le_bytes(b)))
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
