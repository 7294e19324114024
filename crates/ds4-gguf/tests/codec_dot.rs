//! `dot` against an independent reference (Σ dequantize(data)·x in f64), length refusals,
//! and a property test that no input length or byte pattern makes a codec panic.

use ds4_gguf::quant::{self, QuantError};
use ds4_gguf::GgmlType;
use proptest::prelude::*;

struct Rng(u64);

impl Rng {
    fn u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    /// Roughly N(0, 1) (sum of uniforms): enough for test vectors.
    fn normalish(&mut self) -> f32 {
        let s: f64 = (0..4)
            .map(|_| (self.u64() >> 11) as f64 / (1u64 << 53) as f64)
            .sum();
        ((s - 2.0) * 1.7) as f32
    }
}

/// Row data of `ty` with `n` elements: quantized Gaussian data, and for the block types also
/// random raw blocks with every f16 scale field forced to a finite value.
fn rows_for(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<Vec<u8>> {
    let mut x: Vec<f32> = (0..n).map(|_| rng.normalish()).collect();
    if ty == GgmlType::I32 {
        x.iter_mut().for_each(|v| *v = (*v * 1000.0).round());
    }
    let mut rows = vec![quant::quantize(ty, &x, None).unwrap()];
    if ty.is_quantized() {
        let bb = ty.block_bytes().unwrap() as usize;
        let mut raw: Vec<u8> = (0..ty.bytes_for(n as u64).unwrap())
            .map(|_| rng.u64() as u8)
            .collect();
        if ty == GgmlType::Mxfp4 {
            // E8M0 scales 2^-28 .. 2^27: finite values.
            for b in raw.chunks_exact_mut(bb) {
                b[0] = 100 + (rng.u64() % 56) as u8;
            }
            rows.push(raw);
            return rows;
        }
        let offs: &[usize] = match ty {
            GgmlType::Q2K => &[80, 82],
            GgmlType::Q4K => &[0, 2],
            _ => &[0],
        };
        for b in raw.chunks_exact_mut(bb) {
            for &o in offs {
                // exponent 0..29: finite, from subnormal to ~2^14
                let h = (rng.u64() as u16 & 0x83ff) | (((rng.u64() % 30) as u16) << 10);
                b[o..o + 2].copy_from_slice(&h.to_le_bytes());
            }
        }
        rows.push(raw);
    }
    rows
}

const ALL: [GgmlType; 9] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Bf16,
    GgmlType::I32,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q4K,
    GgmlType::Iq2Xxs,
    GgmlType::Mxfp4,
];

#[test]
fn dot_matches_dequantize_then_multiply() {
    let mut rng = Rng(2024);
    for ty in ALL {
        let ns: &[usize] = if ty.is_quantized() {
            &[256, 4096, 7 * 256]
        } else {
            &[37, 256, 300, 4096, 7 * 256]
        };
        for &n in ns {
            for data in rows_for(ty, n, &mut rng) {
                let x: Vec<f32> = (0..n).map(|_| rng.normalish()).collect();
                let mut y = vec![0f32; n];
                quant::dequantize(ty, &data, &mut y).unwrap();
                let reference: f64 = y
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum();
                let scale: f64 = y
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs())
                    .sum();
                let got = quant::dot(ty, &data, &x).unwrap();
                // f32 accumulation within a block: error ~ block length · 2^-24 relative to Σ|y·x|.
                let tol = 4e-6 * scale + 1e-30;
                assert!(
                    (f64::from(got) - reference).abs() <= tol,
                    "{ty} n={n}: dot {got} vs reference {reference} (tolerance {tol})"
                );
            }
        }
    }
}

/// The per-format entry points give the same result as the generic one.
#[test]
fn per_format_dot_rows_agree_with_dot() {
    use ds4_gguf::quant::{iq2_xxs, mxfp4, q2_k, q4_k, q8_0};
    let mut rng = Rng(77);
    let x: Vec<f32> = (0..1024).map(|_| rng.normalish()).collect();
    type RowFn = fn(&[u8], &[f32]) -> Result<f32, QuantError>;
    let fns: [(GgmlType, RowFn); 5] = [
        (GgmlType::Q8_0, q8_0::dot_row),
        (GgmlType::Q2K, q2_k::dot_row),
        (GgmlType::Q4K, q4_k::dot_row),
        (GgmlType::Iq2Xxs, iq2_xxs::dot_row),
        (GgmlType::Mxfp4, mxfp4::dot_row),
    ];
    for (ty, f) in fns {
        for data in rows_for(ty, 1024, &mut rng) {
            assert_eq!(
                f(&data, &x).unwrap().to_bits(),
                quant::dot(ty, &data, &x).unwrap().to_bits(),
                "{ty}"
            );
            assert!(f(&data[1..], &x).is_err(), "{ty}: short data accepted");
        }
    }
}

/// Per-block kernels: block dot equals the sum over the dequantized block within f32 noise,
/// and a 1-block row's `dot` is exactly the block kernel's value.
#[test]
fn block_kernels_are_consistent() {
    use ds4_gguf::quant::{iq2_xxs, q2_k, q4_k, q8_0};
    let mut rng = Rng(99);
    let x: [f32; 256] = std::array::from_fn(|_| rng.normalish());
    let b: [u8; 144] = std::array::from_fn(|_| rng.u64() as u8);
    let mut b = b;
    b[..4].copy_from_slice(&[0x00, 0x1c, 0x66, 0x1a]); // d, dmin: modest finite values
    assert_eq!(
        q4_k::dot_block(&b, &x).to_bits(),
        quant::dot(GgmlType::Q4K, &b, &x).unwrap().to_bits()
    );
    let mut y = [0f32; 256];
    q4_k::dequantize_block(&b, &mut y);
    let r: f32 = y.iter().zip(&x).map(|(a, b)| a * b).sum();
    assert!((q4_k::dot_block(&b, &x) - r).abs() < 1e-4 * r.abs().max(1.0));

    let b2: [u8; 84] = std::array::from_fn(|i| {
        if i >= 80 {
            [0x00, 0x1c, 0x66, 0x1a][i - 80]
        } else {
            rng.u64() as u8
        }
    });
    assert_eq!(
        q2_k::dot_block(&b2, &x).to_bits(),
        quant::dot(GgmlType::Q2K, &b2, &x).unwrap().to_bits()
    );
    let b3: [u8; 66] = std::array::from_fn(|i| {
        if i < 2 {
            [0x00, 0x1c][i]
        } else {
            rng.u64() as u8
        }
    });
    assert_eq!(
        iq2_xxs::dot_block(&b3, &x).to_bits(),
        quant::dot(GgmlType::Iq2Xxs, &b3, &x).unwrap().to_bits()
    );
    let b4: [u8; 34] = std::array::from_fn(|i| {
        if i < 2 {
            [0x00, 0x1c][i]
        } else {
            rng.u64() as u8
        }
    });
    let x32: [f32; 32] = std::array::from_fn(|i| x[i]);
    assert_eq!(
        q8_0::dot_block(&b4, &x32).to_bits(),
        quant::dot(GgmlType::Q8_0, &b4, &x32).unwrap().to_bits()
    );
}

#[test]
fn wrong_lengths_are_errors_not_panics() {
    for ty in ALL {
        let be = ty.block_elems().unwrap() as usize;
        let bb = ty.block_bytes().unwrap() as usize;
        let data = vec![0u8; 2 * bb];
        // data one byte short / long
        let x = vec![1f32; 2 * be];
        for d in [&data[..2 * bb - 1], &[data.as_slice(), &[0]].concat()[..]] {
            let e = quant::dot(ty, d, &x).unwrap_err();
            assert!(
                matches!(e, QuantError::LengthMismatch { expected, found, .. } if expected == 2 * bb as u64 && found == d.len()),
                "{ty}: {e}"
            );
            let mut out = vec![0f32; 2 * be];
            assert!(quant::dequantize(ty, d, &mut out).is_err());
        }
        // x not a whole number of blocks (only possible for block types)
        if be > 1 {
            let e = quant::dot(ty, &data, &x[..2 * be - 1]).unwrap_err();
            assert!(
                matches!(e, QuantError::NotBlockMultiple { .. }),
                "{ty}: {e}"
            );
            let mut out = vec![0f32; be + 1];
            assert!(quant::dequantize(ty, &data, &mut out).is_err());
        }
        // x too short for the data
        let e = quant::dot(ty, &data, &x[..be]).unwrap_err();
        assert!(e.to_string().contains(&ty.name()), "{e}");
        // empty is fine
        assert_eq!(quant::dot(ty, &[], &[]).unwrap(), 0.0);
    }
    let e = quant::dot(GgmlType::Unknown(7), &[0; 4], &[1.0]).unwrap_err();
    assert!(
        matches!(e, QuantError::Unsupported { op: "dot", .. }),
        "{e}"
    );
    let e = quant::dequantize(GgmlType::Unknown(7), &[0; 4], &mut [0.0]).unwrap_err();
    assert!(matches!(e, QuantError::Unsupported { .. }), "{e}");
}

fn any_type() -> impl Strategy<Value = GgmlType> {
    prop::sample::select(ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Any byte pattern and any lengths: Ok with the right shape, or Err — never a panic.
    #[test]
    fn codecs_never_panic(ty in any_type(), data in prop::collection::vec(any::<u8>(), 0..700), n in 0usize..600) {
        let x = vec![0.5f32; n];
        let ok_len = ty.bytes_for(n as u64) == Some(data.len() as u64)
            && (n as u64).is_multiple_of(ty.block_elems().unwrap());
        let r = quant::dot(ty, &data, &x);
        prop_assert_eq!(r.is_ok(), ok_len);
        let mut out = vec![0f32; n];
        prop_assert_eq!(quant::dequantize(ty, &data, &mut out).is_ok(), ok_len);
    }

    /// Arbitrary f32 bit patterns (NaN, inf, huge, subnormal) into every quantizer, with and
    /// without arbitrary importance: Ok or Err, never a panic, and Ok output dequantizes to
    /// finite values (block types) .
    #[test]
    fn quantize_any_floats_never_panics(
        ty in any_type(),
        bits in prop::collection::vec(any::<u32>(), 256),
        imp_bits in prop::collection::vec(any::<u32>(), 256),
        scale_exp in 0u32..255,
        use_imp in any::<bool>(),
    ) {
        // Half the time keep exponents near a chosen binade so many blocks succeed.
        let x: Vec<f32> = bits
            .iter()
            .map(|&b| if b & 1 == 0 { f32::from_bits(b) } else { f32::from_bits((b & 0x807f_ffff) | ((scale_exp.min(160)) << 23)) })
            .collect();
        let imp: Vec<f32> = imp_bits.iter().map(|&b| f32::from_bits(b & 0x7fff_ffff)).collect();
        let r = quant::quantize(ty, &x, use_imp.then_some(&imp[..]));
        if let Ok(q) = r {
            prop_assert_eq!(q.len() as u64, ty.bytes_for(256).unwrap());
            if ty.is_quantized() {
                let mut y = vec![0f32; 256];
                quant::dequantize(ty, &q, &mut y).unwrap();
                prop_assert!(y.iter().all(|v| v.is_finite()), "{} gave non-finite values", ty);
            }
        }
    }
}
