//! MXFP4 beyond the gguf cross-check vectors (`codec_crosscheck.rs`): every scale byte and
//! every code against an independent f64 formula, exact round trips of representable values,
//! the tie rule, the block/row kernels, the int8-activation dot against its exact formula,
//! and refusals.

use ds4_gguf::quant::{self, mxfp4, q8act, QuantError};
use ds4_gguf::GgmlType;

const T: GgmlType = GgmlType::Mxfp4;

/// E2M1 values by code, as real numbers (code 8 is -0).
const E2M1: [f64; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

struct Rng(u64);

impl Rng {
    fn u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
}

/// A block with scale byte `e` whose element `j` has code `codes[j]`.
fn block(e: u8, codes: &[u8; 32]) -> [u8; 17] {
    let mut b = [0u8; 17];
    b[0] = e;
    for j in 0..16 {
        b[1 + j] = codes[j] | (codes[j + 16] << 4);
    }
    b
}

/// Every scale byte with every code at every position: value = E2M1(code) · 2^(e - 127),
/// computed in f64 (exact) and rounded to f32 (inf where it overflows); code 8 reads as +0.
#[test]
fn every_scale_and_code_dequantizes_to_the_e2m1_value() {
    for e in 0..=255u8 {
        for rot in 0..16u8 {
            let codes: [u8; 32] = std::array::from_fn(|j| (j as u8 + rot) & 15);
            let b = block(e, &codes);
            let mut y = [0f32; 32];
            quant::dequantize(T, &b, &mut y).unwrap();
            for j in 0..32 {
                let want = (E2M1[usize::from(codes[j])] * 2f64.powi(i32::from(e) - 127)) as f32;
                let want = if want == 0.0 { 0.0 } else { want };
                assert_eq!(
                    y[j].to_bits(),
                    want.to_bits(),
                    "e={e} element {j} code {}",
                    codes[j]
                );
            }
        }
    }
}

/// Representable values come back bit for bit, and re-quantize to the same bytes (codes
/// other than 8, whose -0 is written as code 0): every scale byte ggml can write from a
/// normal max |x| (0..=252).
#[test]
fn representable_blocks_round_trip_exactly() {
    let mut rng = Rng(54);
    for e in 0..=252u8 {
        for _ in 0..16 {
            let mut codes: [u8; 32] = std::array::from_fn(|_| {
                let c = (rng.u64() % 15) as u8;
                if c >= 8 {
                    c + 1
                } else {
                    c
                }
            });
            // One element at ±12·2^(e-128) fixes the scale.
            codes[(rng.u64() % 32) as usize] = if rng.u64() & 1 == 0 { 7 } else { 15 };
            let b = block(e, &codes);
            let mut y = [0f32; 32];
            quant::dequantize(T, &b, &mut y).unwrap();
            assert!(y.iter().all(|v| v.is_finite()), "e={e}");
            let q = quant::quantize(T, &y, None).unwrap();
            assert_eq!(&q[..], &b[..], "e={e}: {y:?}");
        }
    }
}

/// Ties between two grid points go to the smaller magnitude (ggml's first minimum).
#[test]
fn ties_go_to_the_smaller_magnitude() {
    // amax 12 -> scale byte 128, half-scale 1: the grid is 0, 1, 2, 3, 4, 6, 8, 12 (doubled).
    let mut x = [0f32; 32];
    x[0] = 12.0;
    let cases: [(f32, u8); 10] = [
        (0.5, 0),
        (-0.5, 0),
        (1.5, 1),
        (-2.5, 10),
        (5.0, 4),
        (-5.0, 12),
        (7.0, 5),
        (10.0, 6),
        (-10.0, 14),
        (-0.0, 0),
    ];
    for (i, &(v, _)) in cases.iter().enumerate() {
        x[1 + i] = v;
    }
    let q = mxfp4::quantize_block(&x);
    assert_eq!(q[0], 128);
    for (i, &(v, want)) in cases.iter().enumerate() {
        let j = 1 + i;
        let got = (q[1 + (j & 15)] >> (4 * (j >> 4))) & 15;
        assert_eq!(got, want, "x = {v}");
    }
    // Zeros give an all-zero block.
    let q = quant::quantize(T, &[0.0; 64], None).unwrap();
    assert!(q.iter().all(|&b| b == 0));
}

/// The int8-activation dot is exact up to one rounding per block: each block's term equals
/// f32(Σ w_j · q_j · dx) computed exactly in f64 from the dequantized weights, and the terms
/// add in f32 in block order.
#[test]
fn q8_dot_is_exact_per_block() {
    let mut rng = Rng(39);
    for n in [32usize, 256, 4096] {
        for _ in 0..20 {
            let mut data: Vec<u8> = (0..n / 32 * 17).map(|_| rng.u64() as u8).collect();
            for b in data.chunks_exact_mut(17) {
                b[0] = 100 + (rng.u64() % 56) as u8;
            }
            let x: Vec<f32> = (0..n)
                .map(|_| ((rng.u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 7.0)
                .collect();
            let mut a = q8act::ActQ8::default();
            a.quantize(&x).unwrap();
            let mut w = vec![0f32; n];
            quant::dequantize(T, &data, &mut w).unwrap();
            let mut want = 0f32;
            for u in 0..n / 32 {
                let s: f64 = (32 * u..32 * u + 32)
                    .map(|j| f64::from(w[j]) * f64::from(a.q[j]))
                    .sum();
                want += (s * f64::from(a.d[u])) as f32;
            }
            let got = q8act::dot(T, &data, &a).unwrap();
            assert_eq!(got.to_bits(), want.to_bits(), "n={n}: {got} vs {want}");
        }
    }
    assert!(q8act::supports(T) && q8act::applies(T));
    let mut a = q8act::ActQ8::default();
    a.quantize(&[1.0; 64]).unwrap();
    for len in [0usize, 17, 33, 35] {
        let e = q8act::dot(T, &vec![0u8; len], &a).unwrap_err();
        assert!(
            matches!(e, QuantError::LengthMismatch { expected: 34, .. }),
            "{len}: {e}"
        );
    }
}

/// Block kernel = one-block row, and close to the dequantized sum.
#[test]
fn block_kernels_are_consistent() {
    let mut rng = Rng(7);
    for _ in 0..200 {
        let mut b: [u8; 17] = std::array::from_fn(|_| rng.u64() as u8);
        b[0] = 110 + (rng.u64() % 36) as u8;
        let x: [f32; 32] = std::array::from_fn(|_| (rng.u64() >> 40) as f32 / 1e7 - 0.8);
        let d = mxfp4::dot_block(&b, &x);
        assert_eq!(d.to_bits(), quant::dot(T, &b, &x).unwrap().to_bits());
        assert_eq!(d.to_bits(), mxfp4::dot_row(&b, &x).unwrap().to_bits());
        let mut y = [0f32; 32];
        mxfp4::dequantize_block(&b, &mut y);
        let r: f64 = y
            .iter()
            .zip(&x)
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum();
        let m: f64 = y
            .iter()
            .zip(&x)
            .map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs())
            .sum();
        assert!((f64::from(d) - r).abs() <= 4e-6 * m, "{d} vs {r}");
    }
}

#[test]
fn bad_inputs_are_refused_with_a_reason() {
    // Lengths.
    let e = quant::dequantize(T, &[0u8; 16], &mut [0f32; 32]).unwrap_err();
    assert!(
        matches!(
            e,
            QuantError::LengthMismatch {
                expected: 17,
                found: 16,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("MXFP4"), "{e}");
    let e = quant::dequantize(T, &[0u8; 17], &mut [0f32; 31]).unwrap_err();
    assert!(
        matches!(e, QuantError::NotBlockMultiple { block: 32, .. }),
        "{e}"
    );
    let e = quant::dot(T, &[0u8; 34], &[0f32; 32]).unwrap_err();
    assert!(matches!(e, QuantError::LengthMismatch { .. }), "{e}");
    let e = quant::quantize(T, &[0f32; 33], None).unwrap_err();
    assert!(matches!(e, QuantError::NotBlockMultiple { .. }), "{e}");
    // Non-finite values, with their index; importance is checked though unused.
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut x = [1f32; 64];
        x[40] = bad;
        let e = quant::quantize(T, &x, None).unwrap_err();
        assert!(matches!(e, QuantError::NonFinite { index: 40, .. }), "{e}");
    }
    let e = quant::quantize(T, &[1f32; 32], Some(&[-1f32; 32])).unwrap_err();
    assert!(
        matches!(e, QuantError::BadImportance { index: 0, .. }),
        "{e}"
    );
    assert_eq!(
        quant::quantize(T, &[1f32; 32], Some(&[1f32; 32])).unwrap(),
        quant::quantize(T, &[1f32; 32], None).unwrap()
    );
    // The largest finite inputs still quantize, to finite values (codes ±8, ±12 would
    // overflow at that scale and are never chosen).
    let mut x = [0f32; 32];
    x[0] = f32::MAX;
    x[1] = -3e38;
    let q = quant::quantize(T, &x, None).unwrap();
    let mut y = [0f32; 32];
    quant::dequantize(T, &q, &mut y).unwrap();
    assert_eq!(q[0], 253);
    assert!(y.iter().all(|v| v.is_finite()));
    assert_eq!((y[0], y[1]), (6.0 * 2f32.powi(125), -6.0 * 2f32.powi(125)));
    // quantize_matrix: rows of whole blocks only.
    let e = quant::quantize_matrix(T, &[0f32; 64], 48, None).unwrap_err();
    assert!(matches!(e, QuantError::NotBlockMultiple { .. }), "{e}");
    assert_eq!(
        quant::quantize_matrix(T, &[0.25f32; 128], 64, None).unwrap(),
        quant::quantize(T, &[0.25f32; 128], None).unwrap()
    );
}
