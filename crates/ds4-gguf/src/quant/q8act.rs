//! Int8 activations: an f32 vector quantized to int8 blocks of 32 (a scale and 32 codes per
//! block), and dot products of block-quantized weight rows with it in integer arithmetic.
//!
//! Why: a decode step reads each weight once; converting every weight to f32 and
//! multiplying with f32 activations costs more instructions than the memory system gives
//! time for (IQ2_XXS and Q2_K run compute-bound that way). With int8 activations a GPU does
//! four multiply-adds per `dp4a` instruction on the raw codes and applies the block scales
//! once per 8–32 values, as llama.cpp and ds4 do. The CPU engine implements the same
//! quantization and the same integer sums so the two backends agree bit for bit in the
//! integer part (the kernels are `kernels/gemv_q8.cu`, `ds4_quantize_x` and
//! `ds4_q8_unit_term`); only the float scaling and the order of the float sum differ.
//!
//! Quantization of each block of 32 values `x`: `amax = max |x|` (NaN if any value is NaN),
//! `d = amax / 127` (f32 division), `q = round_half_away(x · (1 / d))` as i8 (one f32
//! division per block, then f32 products), and `q = 0` when `d`
//! is not positive (all zeros, or NaN: the NaN then reaches the output through `d`).
//!
//! Dot product term of one 32-value unit (one Q8_0 block, one IQ2_XXS group, two Q2_K
//! sub-blocks, one Q4_K sub-block, one MXFP4 block), with `dx` the unit's activation scale and integer sums:
//! - Q8_0: `(d · dx) · Σ q_w q_x`
//! - IQ2_XXS: `(db · dx) · Σ ±grid · q_x`, `db = d · (0.5 + scale) · 0.25`
//! - Q2_K: `dx · (d · Σ_sb sc_sb Σ c q_x − dmin · Σ_sb m_sb Σ q_x)` over its two sub-blocks
//! - Q4_K: `dx · (d · sc · Σ c q_x − dmin · m · Σ q_x)`
//! - MXFP4: `(e8m0_half(e) · dx) · Σ kv q_x`, `kv` the doubled E2M1 values (integers in
//!   `{0, ±1, ±2, ±3, ±4, ±6, ±8, ±12}`); `e8m0_half(e) · dx` is exact (a power of two times
//!   `dx`) unless it leaves the f32 range
//!
//! The row's terms are added in f32 in unit order.

use super::{f16::f16_to_f32, iq2xxs_tables, mxfp4, q4_k, QuantError};
use crate::types::GgmlType;

/// Values per activation block.
pub const BLOCK: usize = 32;

/// Whether `ty` has an int8-activation dot product (the block-quantized types ds4 files use).
pub fn supports(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q8_0 | GgmlType::Q2K | GgmlType::Q4K | GgmlType::Iq2Xxs | GgmlType::Mxfp4
    )
}

/// Whether the engine multiplies weights of `ty` with int8 activations (the rule of
/// `Backend::set_activation_q8`): every type with an integer dot product ([`supports`]).
/// The low-bit formats' f32 dot products are compute-bound on a GPU; Q8_0's f32 GEMV reads
/// 4 bytes of activations per byte of weight, which int8 activations in shared memory
/// remove (docs/gpu.md §8; the decode gain is in BENCHMARKS.md's progression).
pub fn applies(ty: GgmlType) -> bool {
    supports(ty)
}

/// A quantized activation vector.
#[derive(Debug, Clone, Default)]
pub struct ActQ8 {
    /// Codes, one per value.
    pub q: Vec<i8>,
    /// Scales, one per block of 32.
    pub d: Vec<f32>,
}

impl ActQ8 {
    /// Quantizes `x` (its length a multiple of 32) into `self`, reusing the buffers.
    pub fn quantize(&mut self, x: &[f32]) -> Result<(), QuantError> {
        if !x.len().is_multiple_of(BLOCK) {
            return Err(QuantError::NotBlockMultiple {
                ty: GgmlType::Q8_0,
                elems: x.len(),
                block: BLOCK as u64,
            });
        }
        self.q.resize(x.len(), 0);
        self.d.resize(x.len() / BLOCK, 0.0);
        for ((xb, qb), d) in x
            .chunks_exact(BLOCK)
            .zip(self.q.chunks_exact_mut(BLOCK))
            .zip(self.d.iter_mut())
        {
            let amax = xb.iter().fold(0f32, |m, v| {
                if m.is_nan() || v.is_nan() {
                    f32::NAN
                } else {
                    m.max(v.abs())
                }
            });
            let db = amax / 127.0;
            *d = db;
            // One division per block, then products (as the GPU kernels: bit-equal codes).
            let id = if db > 0.0 { 1.0 / db } else { 0.0 };
            for (q, &v) in qb.iter_mut().zip(xb) {
                // `as` saturates and maps NaN to 0, as the GPU's conversion does.
                *q = if db > 0.0 { (v * id).round() as i8 } else { 0 };
            }
        }
        Ok(())
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.q.len()
    }

    /// Whether the vector is empty.
    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// Dot product of one row of `ty` data with the quantized activations `x`.
pub fn dot(ty: GgmlType, data: &[u8], x: &ActQ8) -> Result<f32, QuantError> {
    if !supports(ty) {
        return Err(QuantError::Unsupported { ty, op: "q8 dot" });
    }
    super::check_data(ty, data.len(), x.len())?;
    let mut acc = 0f32;
    for u in 0..x.len() / BLOCK {
        acc += unit_term(ty, data, u, &x.q[u * BLOCK..(u + 1) * BLOCK], x.d[u]);
    }
    Ok(acc)
}

/// Term of 32-value unit `u` of a row (see the module docs); `xq` its 32 codes.
fn unit_term(ty: GgmlType, row: &[u8], u: usize, xq: &[i8], dx: f32) -> f32 {
    let (b, i) = (u / 8, u % 8);
    match ty {
        GgmlType::Q8_0 => {
            let blk = &row[34 * u..34 * (u + 1)];
            let is: i32 = blk[2..]
                .iter()
                .zip(xq)
                .map(|(&w, &x)| i32::from(w as i8) * i32::from(x))
                .sum();
            (f16_at(blk, 0) * dx) * is as f32
        }
        GgmlType::Q2K => {
            let blk = &row[84 * b..84 * (b + 1)];
            let (d, dmin) = (f16_at(blk, 80), f16_at(blk, 82));
            let (mut a, mut bsum) = (0i32, 0i32);
            for half in 0..2 {
                let sb = 2 * i + half;
                let (h, j) = (sb >> 3, (sb >> 1) & 3);
                let qs = &blk[16 + 32 * h + 16 * half..16 + 32 * h + 16 * half + 16];
                let xs = &xq[16 * half..16 * half + 16];
                let is: i32 = qs
                    .iter()
                    .zip(xs)
                    .map(|(&c, &x)| i32::from((c >> (2 * j)) & 3) * i32::from(x))
                    .sum();
                let xsum: i32 = xs.iter().map(|&x| i32::from(x)).sum();
                a += i32::from(blk[sb] & 15) * is;
                bsum += i32::from(blk[sb] >> 4) * xsum;
            }
            dx * (d * a as f32 - dmin * bsum as f32)
        }
        GgmlType::Q4K => {
            let blk = &row[144 * b..144 * (b + 1)];
            let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
            let scales: &[u8; 12] = blk[4..16].try_into().expect("12 scale bytes");
            let (sc, mn) = q4_k::scale_min(i, scales);
            let qs = &blk[16 + 32 * (i >> 1)..16 + 32 * (i >> 1) + 32];
            let shift = 4 * (i & 1);
            let is: i32 = qs
                .iter()
                .zip(xq)
                .map(|(&c, &x)| i32::from((c >> shift) & 15) * i32::from(x))
                .sum();
            let xsum: i32 = xq.iter().map(|&x| i32::from(x)).sum();
            dx * (d * (i32::from(sc) * is) as f32 - dmin * (i32::from(mn) * xsum) as f32)
        }
        GgmlType::Iq2Xxs => {
            let blk = &row[66 * b..66 * (b + 1)];
            let d = f16_at(blk, 0);
            let gp = &blk[2 + 8 * i..2 + 8 * i + 8];
            let w1 = u32::from_le_bytes([gp[4], gp[5], gp[6], gp[7]]);
            let db = d * (0.5 + (w1 >> 28) as f32) * 0.25;
            let mut is = 0i32;
            for k in 0..4 {
                let grid = &iq2xxs_tables::GRID[usize::from(gp[k])];
                let sg = iq2xxs_tables::KSIGNS[((w1 >> (7 * k)) & 127) as usize];
                for e in 0..8 {
                    let v = i32::from(grid[e]);
                    let v = if (sg >> e) & 1 == 1 { -v } else { v };
                    is += v * i32::from(xq[8 * k + e]);
                }
            }
            (db * dx) * is as f32
        }
        GgmlType::Mxfp4 => {
            let blk = &row[17 * u..17 * (u + 1)];
            let is = mxfp4::q8_block_sum(blk, xq);
            (mxfp4::e8m0_to_f32_half(blk[0]) * dx) * is as f32
        }
        _ => f32::NAN,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn quantization_is_round_half_away_with_amax_scale() {
        let mut x = vec![0f32; 64];
        x[0] = 1.27;
        x[1] = -1.27;
        x[2] = 0.005; // 0.005 / 0.01 = 0.5 -> rounds away from zero
        x[3] = -0.005;
        let mut a = ActQ8::default();
        a.quantize(&x).unwrap();
        assert_eq!(a.d[0], 1.27f32 / 127.0);
        let id = 1.0 / a.d[0];
        assert_eq!(
            &a.q[..4],
            &[
                127,
                -127,
                (0.005f32 * id).round() as i8,
                -(0.005f32 * id).round() as i8
            ]
        );
        // An all-zero block has scale 0 and codes 0.
        assert_eq!(a.d[1], 0.0);
        assert!(a.q[32..].iter().all(|&q| q == 0));
        // NaN propagates into the scale.
        x[40] = f32::NAN;
        a.quantize(&x).unwrap();
        assert!(a.d[1].is_nan());
        assert!(a.quantize(&x[..33]).is_err());
    }

    /// Against the f32 reference dot: the int8 rounding error is bounded (each code is off
    /// by at most half a step), so the two agree to a few parts in a thousand of the
    /// magnitude Σ|w·x|; a wrong layout would be off by O(1).
    #[test]
    fn q8_dot_tracks_the_f32_dot_for_every_type() {
        let mut seed = 7u64;
        for ty in [
            GgmlType::Q8_0,
            GgmlType::Q2K,
            GgmlType::Q4K,
            GgmlType::Iq2Xxs,
            GgmlType::Mxfp4,
        ] {
            for _ in 0..20 {
                let n = 512;
                let w: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
                let x: Vec<f32> = (0..n).map(|_| lcg(&mut seed) * 3.0).collect();
                let data = quant::quantize(ty, &w, None).unwrap();
                let mut deq = vec![0f32; n];
                quant::dequantize(ty, &data, &mut deq).unwrap();
                let exact: f64 = deq
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| (*a as f64) * (*b as f64))
                    .sum();
                let mag: f64 = deq
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                let mut a = ActQ8::default();
                a.quantize(&x).unwrap();
                let got = dot(ty, &data, &a).unwrap() as f64;
                assert!(
                    (got - exact).abs() <= 6e-3 * mag,
                    "{ty}: q8 {got} vs f32 {exact} (magnitude {mag})"
                );
            }
        }
        let mut a = ActQ8::default();
        a.quantize(&[0.0; 32]).unwrap();
        assert!(dot(GgmlType::F16, &[0u8; 64], &a).is_err());
        assert!(dot(GgmlType::Q8_0, &[0u8; 33], &a).is_err());
    }
}
