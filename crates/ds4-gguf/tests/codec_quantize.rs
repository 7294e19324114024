//! Quantizer properties: error bounds on Gaussian data, exact output size, determinism,
//! zero and extreme inputs, refusals, and the importance (imatrix) paths.

use ds4_gguf::quant::{self, QuantError};
use ds4_gguf::GgmlType;

const BLOCK_TYPES: [GgmlType; 4] = [
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q4K,
    GgmlType::Iq2Xxs,
];

/// Small deterministic generator (SplitMix64 + Box-Muller); good enough for test data.
struct Rng(u64);

impl Rng {
    fn u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn gauss(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
    }
    fn gauss_vec(&mut self, n: usize, sigma: f32) -> Vec<f32> {
        (0..n).map(|_| self.gauss() * sigma).collect()
    }
}

fn roundtrip(ty: GgmlType, x: &[f32], imp: Option<&[f32]>) -> Vec<f32> {
    let q = quant::quantize(ty, x, imp).unwrap_or_else(|e| panic!("{ty}: {e}"));
    assert_eq!(
        q.len() as u64,
        ty.bytes_for(x.len() as u64).unwrap(),
        "{ty}: output size"
    );
    let mut y = vec![0f32; x.len()];
    quant::dequantize(ty, &q, &mut y).unwrap();
    y
}

/// sqrt(Σ w(x−y)² / Σ w x²).
fn rel_rmse(x: &[f32], y: &[f32], w: Option<&[f32]>) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for i in 0..x.len() {
        let wi = w.map_or(1.0, |w| f64::from(w[i]));
        num += wi * f64::from(x[i] - y[i]).powi(2);
        den += wi * f64::from(x[i]).powi(2);
    }
    (num / den).sqrt()
}

/// Measured on this data (16 rows × 4096, σ = 0.02; importance uniform in [0.05, 1.05]):
/// Q8_0 0.53%, Q4_K 7.1% (imatrix path 7.2%), Q2_K 29.5% (27.5%), IQ2_XXS 43.7% with its
/// default x² importance (which favours the large values over plain RMSE) and 35.5% with the
/// flatter importance. The bounds leave ~10–20% headroom: a real regression (a wrong search
/// parameter, a lost refit) fails, float noise does not. The bytes themselves were checked
/// identical to ds4's C quantizer (see tools/codecs/README.md).
#[test]
fn relative_rmse_on_gaussian_data_is_within_bounds() {
    let mut rng = Rng(42);
    let x = rng.gauss_vec(16 * 4096, 0.02);
    let imp: Vec<f32> = (0..x.len()).map(|_| rng.uniform() as f32 + 0.05).collect();
    let cases: [(GgmlType, bool, f64); 7] = [
        (GgmlType::Q8_0, false, 0.0065),
        (GgmlType::Q4K, false, 0.085),
        (GgmlType::Q4K, true, 0.085),
        (GgmlType::Q2K, false, 0.34),
        (GgmlType::Q2K, true, 0.32),
        (GgmlType::Iq2Xxs, false, 0.48),
        (GgmlType::Iq2Xxs, true, 0.40),
    ];
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for (ty, use_imp, bound) in cases {
        let y = roundtrip(ty, &x, use_imp.then_some(&imp[..]));
        let e = rel_rmse(&x, &y, None);
        report.push(format!("{ty} importance={use_imp}: {e:.4}"));
        if !(e < bound && e > 0.0) {
            failures.push(format!(
                "{ty} importance={use_imp}: {e:.4} not in (0, {bound})"
            ));
        }
    }
    eprintln!("relative RMSE: {}", report.join(", "));
    assert!(failures.is_empty(), "{}", failures.join("; "));
}

/// The imatrix paths exist to cut the error where importance is high: with strongly skewed
/// importance, the weighted error must be lower than the plain path's.
#[test]
fn importance_reduces_weighted_error() {
    let mut rng = Rng(7);
    let x = rng.gauss_vec(8 * 2048, 1.0);
    // A few columns matter 100x more, as in real imatrices.
    let imp: Vec<f32> = (0..x.len())
        .map(|i| if i % 2048 % 17 == 0 { 100.0 } else { 1.0 })
        .collect();
    for ty in [GgmlType::Q2K, GgmlType::Q4K] {
        let plain = rel_rmse(&x, &roundtrip(ty, &x, None), Some(&imp));
        let weighted = rel_rmse(&x, &roundtrip(ty, &x, Some(&imp)), Some(&imp));
        assert!(
            weighted < plain,
            "{ty}: weighted error {weighted:.4} not below plain {plain:.4}"
        );
    }
    // IQ2_XXS: explicit skewed importance vs its synthetic default.
    let synthetic = rel_rmse(&x, &roundtrip(GgmlType::Iq2Xxs, &x, None), Some(&imp));
    let weighted = rel_rmse(&x, &roundtrip(GgmlType::Iq2Xxs, &x, Some(&imp)), Some(&imp));
    assert!(
        weighted < synthetic,
        "IQ2_XXS: {weighted:.4} not below {synthetic:.4}"
    );
}

#[test]
fn quantizers_are_deterministic() {
    let mut rng = Rng(3);
    let x = rng.gauss_vec(8 * 256, 0.5);
    for ty in BLOCK_TYPES {
        let a = quant::quantize(ty, &x, None).unwrap();
        let b = quant::quantize(ty, &x, None).unwrap();
        assert_eq!(a, b, "{ty}");
    }
}

#[test]
fn zero_input_gives_zero_blocks_and_zero_values() {
    let x = vec![0f32; 4 * 256];
    for ty in BLOCK_TYPES {
        let q = quant::quantize(ty, &x, None).unwrap();
        let mut y = vec![1f32; x.len()];
        quant::dequantize(ty, &q, &mut y).unwrap();
        assert!(
            y.iter().all(|&v| v == 0.0),
            "{ty}: zeros did not come back as zeros"
        );
        // Every scale is zero (the bytes need not all be zero: Q2_K/Q4_K keep search codes).
        let d_off = if ty == GgmlType::Q2K { 80 } else { 0 };
        let bb = ty.block_bytes().unwrap() as usize;
        for b in q.chunks_exact(bb) {
            assert_eq!(&b[d_off..d_off + 2], &[0, 0], "{ty}: nonzero d");
        }
    }
    // Negative zeros too.
    let x = vec![-0.0f32; 256];
    for ty in BLOCK_TYPES {
        let y = roundtrip(ty, &x, None);
        assert!(y.iter().all(|&v| v == 0.0), "{ty}");
    }
}

/// Inputs at the edges of what the formats can hold: no NaN/inf out, and constant rows come
/// back close to their value.
#[test]
fn extreme_but_representable_inputs_give_finite_values() {
    let mut rng = Rng(11);
    let n = 4 * 256;
    let mut cases: Vec<(&str, Vec<f32>)> = vec![
        ("huge 1e5", rng.gauss_vec(n, 1e5)),
        ("tiny 1e-30", rng.gauss_vec(n, 1e-30)),
        ("subnormal 1e-40", rng.gauss_vec(n, 1e-40)),
        ("min subnormal", vec![f32::from_bits(1); n]),
        ("constant 0.37", vec![0.37; n]),
        ("constant -2.5", vec![-2.5; n]),
        ("constant 1000", vec![1000.0; n]),
    ];
    let mut outlier = rng.gauss_vec(n, 0.01);
    for i in (5..n).step_by(97) {
        outlier[i] = 300.0;
    }
    cases.push(("outliers", outlier));
    let mut mixed = rng.gauss_vec(n, 1.0);
    for (i, v) in mixed.iter_mut().enumerate() {
        *v *= [1e-20, 1.0, 1e4, 0.0][i % 4];
    }
    cases.push(("mixed magnitudes", mixed));
    for (name, x) in &cases {
        for ty in BLOCK_TYPES {
            for imp in [None, Some(vec![1.0f32; n])] {
                let y = roundtrip(ty, x, imp.as_deref());
                assert!(
                    y.iter().all(|v| v.is_finite()),
                    "{ty} {name}: non-finite output"
                );
                if name.starts_with("constant") {
                    let e = rel_rmse(x, &y, None);
                    assert!(e < 0.35, "{ty} {name}: rel. error {e}");
                }
            }
        }
    }
}

#[test]
fn values_too_large_for_f16_scales_are_refused() {
    let mut x = vec![0.5f32; 512];
    x[300] = 1e9;
    for ty in BLOCK_TYPES {
        match quant::quantize(ty, &x, None) {
            Err(QuantError::ScaleOverflow { ty: t, block, .. }) => {
                assert_eq!(t, ty);
                let be = ty.block_elems().unwrap() as usize;
                assert_eq!(block, 300 / be, "{ty}: block number");
            }
            other => panic!("{ty}: expected ScaleOverflow, got {other:?}"),
        }
    }
}

#[test]
fn bad_inputs_are_refused_with_a_reason() {
    for ty in BLOCK_TYPES {
        let be = ty.block_elems().unwrap() as usize;
        // Not a whole number of blocks.
        let e = quant::quantize(ty, &vec![1.0; be + 1], None).unwrap_err();
        assert!(
            matches!(e, QuantError::NotBlockMultiple { elems, .. } if elems == be + 1),
            "{e}"
        );
        // Non-finite input, with its index.
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = vec![1.0; 2 * be];
            x[be + 3] = bad;
            let e = quant::quantize(ty, &x, None).unwrap_err();
            assert!(
                matches!(e, QuantError::NonFinite { index, .. } if index == be + 3),
                "{e}"
            );
        }
        // Importance of the wrong length, or with bad values.
        let x = vec![1.0; be];
        let e = quant::quantize(ty, &x, Some(&vec![1.0; be - 1])).unwrap_err();
        assert!(
            matches!(e, QuantError::SizeMismatch { expected, found, .. } if expected == be && found == be - 1),
            "{e}"
        );
        for bad in [-1.0, f32::NAN, f32::INFINITY] {
            let mut imp = vec![1.0; be];
            imp[2] = bad;
            let e = quant::quantize(ty, &x, Some(&imp)).unwrap_err();
            assert!(
                matches!(e, QuantError::BadImportance { index: 2, .. }),
                "{e}"
            );
        }
        // The message names the type.
        assert!(e_string(quant::quantize(ty, &vec![1.0; be + 1], None)).contains(&ty.name()));
    }
    let e = quant::quantize(GgmlType::Unknown(99), &[1.0], None).unwrap_err();
    assert!(matches!(e, QuantError::Unsupported { .. }), "{e}");
    // Empty input is a valid (empty) row.
    for ty in BLOCK_TYPES {
        assert_eq!(quant::quantize(ty, &[], None).unwrap(), Vec::<u8>::new());
    }
}

fn e_string<T: std::fmt::Debug>(r: Result<T, QuantError>) -> String {
    r.unwrap_err().to_string()
}

/// IQ2_XXS without importance uses the synthetic `x²` (single row) importance.
#[test]
fn iq2_xxs_default_importance_is_x_squared() {
    let mut rng = Rng(5);
    let x = rng.gauss_vec(3 * 256, 0.1);
    let x2: Vec<f32> = x.iter().map(|v| v * v).collect();
    assert_eq!(
        quant::quantize(GgmlType::Iq2Xxs, &x, None).unwrap(),
        quant::quantize(GgmlType::Iq2Xxs, &x, Some(&x2)).unwrap()
    );
    // And it is not a no-op: uniform importance gives different bytes on this data.
    assert_ne!(
        quant::quantize(GgmlType::Iq2Xxs, &x, None).unwrap(),
        quant::quantize(GgmlType::Iq2Xxs, &x, Some(&vec![1.0; x.len()])).unwrap()
    );
}

/// `quantize_matrix` is ds4's whole-tensor behaviour: column importance shared by all rows,
/// and for IQ2_XXS without importance the column energy summed over rows.
#[test]
fn quantize_matrix_matches_row_by_row_with_column_importance() {
    let mut rng = Rng(9);
    let (rows, cols) = (5, 512);
    let x = rng.gauss_vec(rows * cols, 0.3);
    let col_imp: Vec<f32> = (0..cols).map(|_| rng.uniform() as f32).collect();
    let mut energy = vec![0f32; cols];
    for r in x.chunks_exact(cols) {
        for (e, v) in energy.iter_mut().zip(r) {
            *e += v * v;
        }
    }
    for ty in BLOCK_TYPES {
        for imp in [None, Some(&col_imp)] {
            let m = quant::quantize_matrix(ty, &x, cols, imp.map(|v| &v[..])).unwrap();
            let mut expect = Vec::new();
            for r in x.chunks_exact(cols) {
                let row_imp = match (imp, ty) {
                    (Some(v), _) => Some(v.clone()),
                    (None, GgmlType::Iq2Xxs) => Some(energy.clone()),
                    (None, _) => None,
                };
                expect.extend(quant::quantize(ty, r, row_imp.as_deref()).unwrap());
            }
            assert_eq!(m, expect, "{ty} importance={}", imp.is_some());
        }
    }
    // Errors: ragged rows, wrong importance length, block numbers counted over the matrix.
    assert!(quant::quantize_matrix(GgmlType::Q4K, &x[..cols + 1], cols, None).is_err());
    assert!(quant::quantize_matrix(GgmlType::Q4K, &x, 100, None).is_err());
    assert!(quant::quantize_matrix(GgmlType::Q4K, &x, 0, None).is_err());
    assert!(quant::quantize_matrix(GgmlType::Q4K, &x, cols, Some(&col_imp[..10])).is_err());
    let mut big = x.clone();
    big[3 * cols + 300] = 1e12;
    let e = quant::quantize_matrix(GgmlType::Q2K, &big, cols, None).unwrap_err();
    assert!(
        matches!(e, QuantError::ScaleOverflow { block, .. } if block == 3 * 2 + 1),
        "{e}"
    );
}

#[test]
fn plain_type_quantize_policies() {
    // F32: bits unchanged, including NaN payloads.
    let x = [1.5f32, -0.0, f32::from_bits(0x7fc0_1234), f32::INFINITY];
    let q = quant::quantize(GgmlType::F32, &x, None).unwrap();
    let back: Vec<u32> = q
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(back, x.map(f32::to_bits));
    // F16: round to nearest even; NaN and inf kept; finite overflow refused.
    let q = quant::quantize(
        GgmlType::F16,
        &[1.0 + 1.0 / 2048.0, 65504.0, f32::NEG_INFINITY],
        None,
    )
    .unwrap();
    assert_eq!(q, [0x00, 0x3c, 0xff, 0x7b, 0x00, 0xfc]);
    let e = quant::quantize(GgmlType::F16, &[1.0, 70000.0], None).unwrap_err();
    assert!(
        matches!(e, QuantError::NotRepresentable { index: 1, .. }),
        "{e}"
    );
    let q = quant::quantize(GgmlType::F16, &[f32::NAN], None).unwrap();
    assert_eq!(u16::from_le_bytes([q[0], q[1]]) & 0x7c00, 0x7c00);
    // BF16: ties to even, overflow refused.
    let q = quant::quantize(
        GgmlType::Bf16,
        &[f32::from_bits(0x3f80_8000), f32::from_bits(0x3f81_8000)],
        None,
    )
    .unwrap();
    assert_eq!(q, [0x80, 0x3f, 0x82, 0x3f]);
    assert!(quant::quantize(GgmlType::Bf16, &[f32::MAX], None).is_err());
    // I32: exact integers only.
    let q = quant::quantize(GgmlType::I32, &[-7.0, 2147483520.0, -2147483648.0], None).unwrap();
    let mut y = [0f32; 3];
    quant::dequantize(GgmlType::I32, &q, &mut y).unwrap();
    assert_eq!(y, [-7.0, 2147483520.0, -2147483648.0]);
    for bad in [0.5, 2147483648.0, f32::NAN, -3e9] {
        assert!(
            quant::quantize(GgmlType::I32, &[1.0, bad], None).is_err(),
            "{bad}"
        );
    }
}

/// Q8_0's defining rule, checked directly: codes round half away from zero, d = amax/127.
#[test]
fn q8_0_rounds_half_away_from_zero() {
    let mut x = [0f32; 32];
    x[0] = 127.0; // d = 1 exactly
    x[1] = 2.5;
    x[2] = -2.5;
    x[3] = 0.5;
    x[4] = -126.5;
    let q = quant::quantize(GgmlType::Q8_0, &x, None).unwrap();
    assert_eq!(&q[..2], &[0x00, 0x3c]); // f16 1.0
    assert_eq!(
        q[2..7].iter().map(|&b| b as i8).collect::<Vec<_>>(),
        [127, 3, -3, 1, -127]
    );
}
