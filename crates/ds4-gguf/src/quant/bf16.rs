//! bfloat16 (ggml BF16) conversions and rows.

use super::{plain, QuantError};
use crate::types::GgmlType;

/// Widen bf16 bits to f32 (exact: bf16 is the top half of an f32).
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// Narrow f32 to bf16 bits the way ggml (`ggml_compute_fp32_to_bf16`) and gguf-py do:
/// NaN becomes a quiet NaN keeping its sign and top payload bits; everything else rounds to
/// nearest even (so values near f32::MAX may round to ±inf).
#[inline]
pub fn f32_to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return ((bits >> 16) | 0x40) as u16;
    }
    ((u64::from(bits) + 0x7fff + u64::from((bits >> 16) & 1)) >> 16) as u16
}

pub(crate) fn dequantize_row(data: &[u8], out: &mut [f32]) {
    plain::dequantize_with(data, out, |b| bf16_to_f32(u16::from_le_bytes(b)));
}

pub(crate) fn dot_row_unchecked(data: &[u8], x: &[f32]) -> f32 {
    plain::dot_with(data, x, |b| bf16_to_f32(u16::from_le_bytes(b)))
}

pub(crate) fn quantize_row(src: &[f32]) -> Result<Vec<u8>, QuantError> {
    let mut out = Vec::with_capacity(src.len() * 2);
    for (index, &value) in src.iter().enumerate() {
        let h = f32_to_bf16(value);
        if value.is_finite() && h & 0x7fff == 0x7f80 {
            return Err(QuantError::NotRepresentable {
                ty: GgmlType::Bf16,
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

    #[test]
    fn bf16_round_trips_and_rounds_like_ggml() {
        for h in 0..=u16::MAX {
            let v = bf16_to_f32(h);
            if !v.is_nan() {
                assert_eq!(f32_to_bf16(v), h, "{h:#06x}");
            }
        }
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80); // tie → even
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f80_0001)), 0x7fc0); // sNaN → quiet
        assert_eq!(f32_to_bf16(f32::from_bits(0xff80_0001)), 0xffc0);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80); // rounds to inf
    }
}
