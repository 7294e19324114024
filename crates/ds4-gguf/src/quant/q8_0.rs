//! Q8_0: blocks of 32 values, `d: f16 @0`, `q: i8[32] @2`; y = d·q.

use super::{f16::f32_to_f16, f16_at, hsum, QuantError};
use crate::types::GgmlType;

pub const BLOCK_ELEMS: usize = 32;
pub const BLOCK_BYTES: usize = 34;

/// Dequantize one block (bit-exact with gguf-py: `f32(q) * f32(d)`).
#[inline]
pub fn dequantize_block(block: &[u8; BLOCK_BYTES], out: &mut [f32; BLOCK_ELEMS]) {
    let d = f16_at(block, 0);
    for (o, &q) in out.iter_mut().zip(&block[2..]) {
        *o = f32::from(q as i8) * d;
    }
}

/// Dot product of one block with 32 values of `x`: each dequantized value `q·d` times x,
/// accumulated in f32 over 8 lanes (the same arithmetic as a one-block row).
#[inline]
pub fn dot_block(block: &[u8; BLOCK_BYTES], x: &[f32; BLOCK_ELEMS]) -> f32 {
    let d = f16_at(block, 0);
    let [_, _, q @ ..] = block;
    let mut acc = [0f32; 8];
    for c in 0..4 {
        for l in 0..8 {
            acc[l] += f32::from(q[8 * c + l] as i8) * d * x[8 * c + l];
        }
    }
    hsum(&acc)
}

/// Quantize one block: d = max|x|/127 (f32), q = round-half-away(x / d) computed with the
/// f32 reciprocal, d stored as f16 (nearest even). Bit-exact with gguf-py and ggml's
/// reference. The f16 `d` may be ±inf for |x| above ~8.3e6; [`super::quantize`] refuses that.
pub fn quantize_block(x: &[f32; BLOCK_ELEMS]) -> [u8; BLOCK_BYTES] {
    let mut amax = 0f32;
    for v in x {
        let a = v.abs();
        if a > amax {
            amax = a;
        }
    }
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut out = [0u8; BLOCK_BYTES];
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    for (o, v) in out[2..].iter_mut().zip(x) {
        *o = c_cast_i8((v * id).round());
    }
    out
}

/// Convert a rounded f32 to an i8 byte the way C's `(int8_t)` cast and numpy's
/// `astype(int8)` do on x86-64 (convert to i32 — `i32::MIN` when out of range or NaN — then
/// keep the low byte). Only reachable out of range when `1/d` overflows for subnormal
/// inputs, where d rounds to f16 zero and the codes do not affect the values; matching the
/// bytes keeps Q8_0 bit-exact with gguf-py even there.
#[inline(always)]
fn c_cast_i8(r: f32) -> u8 {
    let i = if r.is_nan() || r.abs() >= 2_147_483_648.0 {
        i32::MIN
    } else {
        r as i32
    };
    i as u8
}

pub(crate) fn dequantize_row(data: &[u8], out: &mut [f32]) {
    super::dequantize_blocks(data, out, dequantize_block);
}

/// Blocks per f32 partial sum in the row dot product (256 elements, like one K-quant
/// super-block); partial sums are added in f64.
const RUN_BLOCKS: usize = 8;

/// Row dot product; `data.len()` must be `x.len() / 32 * 34` (checked by the caller; any
/// excess on either side is ignored, never read out of bounds). Each element's dequantized
/// value `q·d` times x goes into 8 f32 lanes that run over 8 blocks (256 elements) before
/// one horizontal add, so the reduction does not dominate the 32-element blocks.
pub(crate) fn dot_row_unchecked(data: &[u8], x: &[f32]) -> f32 {
    super::dot_runs::<BLOCK_BYTES, BLOCK_ELEMS, 8, RUN_BLOCKS>(data, x, |b, xb, acc| {
        let d = f16_at(b, 0);
        let [_, _, q @ ..] = b;
        for c in 0..4 {
            for l in 0..8 {
                acc[l] += f32::from(q[8 * c + l] as i8) * d * xb[8 * c + l];
            }
        }
    })
}

/// Dot product of a whole Q8_0 row with `x` (see [`super::dot`] for the accumulation).
pub fn dot_row(data: &[u8], x: &[f32]) -> Result<f32, QuantError> {
    super::dot(GgmlType::Q8_0, data, x)
}

/// Quantize a row (length a multiple of 32, finite values; checked by the caller).
pub(crate) fn quantize_row(src: &[f32]) -> Result<Vec<u8>, QuantError> {
    let (blocks, _) = src.as_chunks::<BLOCK_ELEMS>();
    let mut out = Vec::with_capacity(blocks.len() * BLOCK_BYTES);
    for (i, x) in blocks.iter().enumerate() {
        let b = quantize_block(x);
        if u16::from_le_bytes([b[0], b[1]]) & 0x7c00 == 0x7c00 {
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            return Err(QuantError::ScaleOverflow {
                ty: GgmlType::Q8_0,
                block: i,
                scale: amax / 127.0,
            });
        }
        out.extend_from_slice(&b);
    }
    Ok(out)
}
