//! MXFP4 (ggml type 39): blocks of 32 values, `e: u8 @0` (an E8M0 scale), `qs: u8[16] @1`
//! (4-bit E2M1 codes, two per byte). Element `j < 16` is the low nibble of `qs[j]`, element
//! `j + 16` its high nibble (the Q4_0 order).
//!
//! ggml stores the E2M1 values **doubled** so they are integers (`kvalues_mxfp4`:
//! `0, 1, 2, 3, 4, 6, 8, 12` and their negatives; code 8 is "-0" and reads as `+0`) and
//! halves the scale to compensate: `y = e8m0_half(e) · kv[code]` with
//! `e8m0_half(e) = 2^(e - 128)` (the f32 bits `(e - 1) << 23`, or the subnormals `2^-128`,
//! `2^-127` for `e = 0, 1`; `e = 255` is `2^127`, not NaN). The product of a power of two and
//! a small integer is exact in f32 unless it overflows (`e >= 253` with `|kv| >= 8`: ±inf),
//! so dequantization is exact and bit-exact with `gguf.quants.dequantize`.
//!
//! Quantization (bit-exact with `gguf.quants.quantize(.., MXFP4)` and ggml's
//! `quantize_row_mxfp4_ref`): `amax = max |x|`; `e = floor(log2f(amax)) - 2 + 127` cast to
//! `u8` the way C and numpy do on x86-64 (through i32, keeping the low byte), or 0 when
//! `amax = 0`; each value takes the **first** code (in code order 0..15) whose
//! `|f32(kv · d) - x|` (f32 arithmetic) is smallest, so ties go to the smaller magnitude and
//! code 8 is never written. `log2f` is evaluated as the f64 `log2` rounded to f32, which equals
//! numpy's float32 `log2` on every positive finite f32 (checked exhaustively with numpy 2.4.6;
//! the boundary mantissas, where `log2f` rounds up to the next integer, are in the committed
//! vectors). Blocks whose `amax < 2^-125` get a wrapped scale byte (as ggml's C cast does)
//! and all codes 0, i.e. they read back as zeros.

use super::{hsum, QuantError};
use crate::types::GgmlType;

pub const BLOCK_ELEMS: usize = 32;
pub const BLOCK_BYTES: usize = 17;

/// ggml's `kvalues_mxfp4`: the E2M1 values times two, by code.
pub const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// The same values as f32 (`kv as f32`; code 8 is `+0.0`).
const KVALUES_F32: [f32; 16] = [
    0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0,
];

/// ggml's `ggml_e8m0_to_fp32_half`: `2^(e - 128)`, half the E8M0 value, exact.
#[inline(always)]
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits((u32::from(e) - 1) << 23)
    }
}

/// The E8M0 scale itself, `2^(e - 127)` (ggml's `ggml_e8m0_to_fp32`; `e = 255` gives `2^128`
/// = +inf there too, not the OCP NaN). Twice [`e8m0_to_f32_half`].
#[inline]
pub fn e8m0_to_f32(e: u8) -> f32 {
    if e == 0 {
        f32::from_bits(0x0040_0000)
    } else if e == 255 {
        f32::INFINITY
    } else {
        f32::from_bits(u32::from(e) << 23)
    }
}

/// The 32 codes of a block, in element order (0..16 low nibbles, 16..32 high nibbles).
#[inline(always)]
fn code(qs: &[u8], j: usize) -> usize {
    usize::from((qs[j & 15] >> (4 * (j >> 4))) & 15)
}

/// Dequantize one block: `e8m0_half(e) · kv[code]` (exact; bit-exact with gguf-py).
#[inline]
pub fn dequantize_block(block: &[u8; BLOCK_BYTES], out: &mut [f32; BLOCK_ELEMS]) {
    let d = e8m0_to_f32_half(block[0]);
    let qs = &block[1..];
    for j in 0..16 {
        out[j] = d * KVALUES_F32[usize::from(qs[j] & 15)];
        out[j + 16] = d * KVALUES_F32[usize::from(qs[j] >> 4)];
    }
}

/// Dot product of one block with 32 values of `x`: each dequantized value times x,
/// accumulated in f32 over 16 lanes (lane `l` takes elements `l` and `l + 16`).
#[inline]
pub fn dot_block(block: &[u8; BLOCK_BYTES], x: &[f32; BLOCK_ELEMS]) -> f32 {
    let mut acc = [0f32; 16];
    block_into(block, x, &mut acc);
    hsum(&acc)
}

#[inline(always)]
fn block_into(block: &[u8; BLOCK_BYTES], x: &[f32; BLOCK_ELEMS], acc: &mut [f32; 16]) {
    let d = e8m0_to_f32_half(block[0]);
    let qs = &block[1..];
    for l in 0..16 {
        acc[l] += d * KVALUES_F32[usize::from(qs[l] & 15)] * x[l];
    }
    for l in 0..16 {
        acc[l] += d * KVALUES_F32[usize::from(qs[l] >> 4)] * x[l + 16];
    }
}

/// `floor(log2f(a))` for a positive finite f32, as numpy's float32 `log2` rounds it.
#[inline]
fn floor_log2f(a: f32) -> f32 {
    ((f64::from(a)).log2() as f32).floor()
}

/// The scale byte ggml writes for a block whose largest magnitude is `amax` (finite, >= 0).
#[inline]
pub fn scale_byte(amax: f32) -> u8 {
    if amax > 0.0 {
        // floor(log2f) is in [-149, 128]: the result in [-24, 253]; C's (uint8_t) of a
        // negative float on x86-64 (and numpy's astype) wraps through i32.
        (floor_log2f(amax) as i32 - 2 + 127) as u8
    } else {
        0
    }
}

/// The code ggml picks for `x` at half-scale `d`: the first minimum of `|kv·d - x|`.
#[inline]
fn best_code(x: f32, d: f32) -> u8 {
    let mut best = 0u8;
    let mut best_err = (KVALUES_F32[0] * d - x).abs();
    for (i, &kv) in KVALUES_F32.iter().enumerate().skip(1) {
        let err = (kv * d - x).abs();
        if err < best_err {
            best = i as u8;
            best_err = err;
        }
    }
    best
}

/// Quantize one block of finite values (see the module docs; bit-exact with gguf-py). For
/// `amax` within an f32 rounding of `2^128` the scale is `2^125` and the `±8`, `±12` products
/// overflow to inf inside the search; they are then never the minimum, so such a block's
/// largest values saturate at `±6 · 2^125`, as in gguf-py.
pub fn quantize_block(x: &[f32; BLOCK_ELEMS]) -> [u8; BLOCK_BYTES] {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let e = scale_byte(amax);
    let d = e8m0_to_f32_half(e);
    let mut out = [0u8; BLOCK_BYTES];
    out[0] = e;
    for j in 0..16 {
        out[1 + j] = best_code(x[j], d) | (best_code(x[j + 16], d) << 4);
    }
    out
}

pub(crate) fn dequantize_row(data: &[u8], out: &mut [f32]) {
    super::dequantize_blocks(data, out, dequantize_block);
}

/// Blocks per f32 partial sum in the row dot product (256 elements); partial sums are added
/// in f64.
const RUN_BLOCKS: usize = 8;

/// Row dot product; `data.len()` must be `x.len() / 32 * 17` (checked by the caller; any
/// excess on either side is ignored, never read out of bounds). Each element's dequantized
/// value times x goes into 16 f32 lanes that run over 8 blocks (256 elements) before one
/// horizontal add.
pub(crate) fn dot_row_unchecked(data: &[u8], x: &[f32]) -> f32 {
    super::dot_runs::<BLOCK_BYTES, BLOCK_ELEMS, 16, RUN_BLOCKS>(data, x, block_into)
}

/// Dot product of a whole MXFP4 row with `x` (see [`super::dot`] for the accumulation).
pub fn dot_row(data: &[u8], x: &[f32]) -> Result<f32, QuantError> {
    super::dot(GgmlType::Mxfp4, data, x)
}

/// Quantize a row (length a multiple of 32, finite values; checked by the caller). Never
/// fails: every finite block has a scale byte.
pub(crate) fn quantize_row(src: &[f32]) -> Result<Vec<u8>, QuantError> {
    let (blocks, _) = src.as_chunks::<BLOCK_ELEMS>();
    let mut out = Vec::with_capacity(blocks.len() * BLOCK_BYTES);
    for x in blocks {
        out.extend_from_slice(&quantize_block(x));
    }
    Ok(out)
}

/// Integer part of the int8-activation dot of one block with 32 activation codes:
/// `Σ kv[code_j] · q_j` (the doubled E2M1 values are integers; |sum| <= 32·12·127).
#[inline]
pub fn q8_block_sum(block: &[u8], xq: &[i8]) -> i32 {
    let qs = &block[1..BLOCK_BYTES];
    let mut s = 0i32;
    for j in 0..BLOCK_ELEMS {
        s += i32::from(KVALUES[code(qs, j)]) * i32::from(xq[j]);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e8m0_half_is_two_to_the_e_minus_128() {
        for e in 0..=255u8 {
            let want = 2f64.powi(i32::from(e) - 128);
            assert_eq!(f64::from(e8m0_to_f32_half(e)), want, "e = {e}");
            if e < 255 {
                assert_eq!(f64::from(e8m0_to_f32(e)), 2.0 * want, "e = {e}");
            }
        }
        assert_eq!(e8m0_to_f32(255), f32::INFINITY);
    }

    #[test]
    fn nibble_order_is_low_then_high() {
        let mut b = [0u8; BLOCK_BYTES];
        b[0] = 128; // d = 1
        b[1] = 0x71; // element 0: code 1 (1), element 16: code 7 (12)
        b[16] = 0xF9; // element 15: code 9 (-1), element 31: code 15 (-12)
        let mut out = [0f32; 32];
        dequantize_block(&b, &mut out);
        assert_eq!(
            (out[0], out[16], out[15], out[31]),
            (1.0, 12.0, -1.0, -12.0)
        );
        assert_eq!(code(&b[1..], 0), 1);
        assert_eq!(code(&b[1..], 16), 7);
        assert_eq!(code(&b[1..], 31), 15);
    }

    #[test]
    fn scale_byte_matches_the_c_cast() {
        assert_eq!(scale_byte(0.0), 0);
        assert_eq!(scale_byte(1.0), 125);
        assert_eq!(scale_byte(12.0), 128);
        // log2f(f32::MAX) rounds up to 128: e = 253, d = 2^125, and codes ±8, ±12 overflow
        // to inf in the search (never chosen), as in gguf-py.
        assert_eq!(scale_byte(f32::MAX), 253);
        assert_eq!(scale_byte(2f32.powi(127)), 252);
        // 2^-126: floor(log2) - 2 + 127 = -1 wraps to 255; the smallest subnormal to 232.
        assert_eq!(scale_byte(f32::MIN_POSITIVE), 255);
        assert_eq!(scale_byte(f32::from_bits(1)), 232);
        assert_eq!(scale_byte(2f32.powi(-125)), 0);
    }
}
