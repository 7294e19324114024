//! Plain (non-block) element types: F32 and I32, plus the shared row loops that F16 and BF16
//! also use. A "block" for the dot product's accumulation is a run of [`RUN`] elements.

use super::{hsum, QuantError};
use crate::types::GgmlType;

/// Elements per f32 partial sum in the plain-type dot products (then added in f64).
pub const RUN: usize = 256;
/// Independent accumulator lanes (lets LLVM keep the sum in vector registers).
const LANES: usize = 16;

/// Decode every `W`-byte element of `data` with `decode` into `out` (lengths pre-checked).
#[inline(always)]
pub(crate) fn dequantize_with<const W: usize>(
    data: &[u8],
    out: &mut [f32],
    decode: impl Fn([u8; W]) -> f32,
) {
    let (elems, _) = data.as_chunks::<W>();
    for (o, e) in out.iter_mut().zip(elems) {
        *o = decode(*e);
    }
}

/// Dot product of `W`-byte elements decoded by `decode` with `x`: f32 lanes per run of
/// [`RUN`] elements, runs added in f64.
#[inline(always)]
pub(crate) fn dot_with<const W: usize>(
    data: &[u8],
    x: &[f32],
    decode: impl Fn([u8; W]) -> f32,
) -> f32 {
    let (elems, _) = data.as_chunks::<W>();
    let mut total = 0f64;
    for (run, xs) in elems.chunks(RUN).zip(x.chunks(RUN)) {
        let mut acc = [0f32; LANES];
        // Fixed-size chunks so the inner loop has no bounds checks and vectorizes.
        let (e_full, e_rest) = run.as_chunks::<LANES>();
        let (x_full, x_rest) = xs.as_chunks::<LANES>();
        for (e, xv) in e_full.iter().zip(x_full) {
            for l in 0..LANES {
                acc[l] += decode(e[l]) * xv[l];
            }
        }
        let mut s = hsum(&acc);
        for (e, xv) in e_rest.iter().zip(x_rest) {
            s += decode(*e) * xv;
        }
        total += f64::from(s);
    }
    total as f32
}

pub(crate) fn dequantize_f32(data: &[u8], out: &mut [f32]) {
    dequantize_with(data, out, f32::from_le_bytes);
}

pub(crate) fn dequantize_i32(data: &[u8], out: &mut [f32]) {
    dequantize_with(data, out, |b| i32::from_le_bytes(b) as f32);
}

pub(crate) fn dot_f32(data: &[u8], x: &[f32]) -> f32 {
    dot_with(data, x, f32::from_le_bytes)
}

pub(crate) fn dot_i32(data: &[u8], x: &[f32]) -> f32 {
    dot_with(data, x, |b| i32::from_le_bytes(b) as f32)
}

pub(crate) fn quantize_f32(src: &[f32]) -> Vec<u8> {
    src.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Exact cast: every value must be an integer in i32 range (so no rounding happens).
pub(crate) fn quantize_i32(src: &[f32]) -> Result<Vec<u8>, QuantError> {
    let mut out = Vec::with_capacity(src.len() * 4);
    for (index, &value) in src.iter().enumerate() {
        // 2^31 is exactly representable; the valid range is [-2^31, 2^31).
        let ok = value.is_finite()
            && value.fract() == 0.0
            && (-2_147_483_648.0..2_147_483_648.0).contains(&value);
        if !ok {
            return Err(QuantError::NotRepresentable {
                ty: GgmlType::I32,
                index,
                value,
            });
        }
        out.extend_from_slice(&(value as i32).to_le_bytes());
    }
    Ok(out)
}
