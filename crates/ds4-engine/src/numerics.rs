//! Scalar definitions every backend must compute identically: RoPE frequencies, the QAT
//! round trips (docs/forward.md §2.7), and the small activation functions.
//!
//! They live in the engine (not in a backend) because they *are* the model's math: the CPU
//! backend calls them directly and a GPU kernel must reproduce them; the CPU backend's tests
//! check them against brute-force definitions.

use crate::backend::RopeFreq;

/// Per-pair RoPE frequencies `ω_j`, `j < rope_dim/2` (docs/forward.md §2.3), rounded to f32.
///
/// Computed in f64 and rounded once, which matches the f32 tables HF and the official code
/// build up to an ulp. Compressed layers blend towards `ω/factor` with YaRN's linear ramp
/// between `lo = ⌊c(β_fast)⌋` and `hi = ⌈c(β_slow)⌉`; no magnitude scale is applied anywhere.
pub fn rope_freqs(f: &RopeFreq) -> Vec<f32> {
    let dim = f.rope_dim as f64;
    let half = f.rope_dim / 2;
    let base = f.base as f64;
    let plain = |j: usize| base.powf(-(2.0 * j as f64) / dim);
    match f.yarn {
        None => (0..half).map(|j| plain(j) as f32).collect(),
        Some(y) => {
            let c = |beta: f64| {
                dim * ((y.original_context as f64) / (2.0 * std::f64::consts::PI * beta)).ln()
                    / (2.0 * base.ln())
            };
            let lo = c(y.beta_fast as f64).floor().max(0.0);
            let hi = c(y.beta_slow as f64).ceil().min(dim - 1.0);
            let span = if hi == lo { 0.001 } else { hi - lo };
            let s = y.factor as f64;
            (0..half)
                .map(|j| {
                    let g = ((j as f64 - lo) / span).clamp(0.0, 1.0);
                    let w = plain(j);
                    (w * (1.0 - g) + (w / s) * g) as f32
                })
                .collect()
        }
    }
}

/// The rotation angle of pair frequency `w` at position `p`: an f32 product, as HF and the
/// official code form it (so angles round the same way); cos/sin are then taken in f64.
#[inline]
pub fn rope_angle(p: usize, w: f32) -> f64 {
    ((p as f32) * w) as f64
}

/// `2^⌈log₂ t⌉` for a positive finite `t`, exact (from the f32 bits for normal `t`).
pub fn pow2_ceil(t: f32) -> f32 {
    let bits = t.to_bits();
    let exp = ((bits >> 23) & 0xff) as i32;
    let mant = bits & 0x7f_ffff;
    if exp == 0 {
        // Subnormal: log2 of an exact f64 is exact for powers of two.
        let e = (t as f64).log2().ceil();
        return (2f64).powf(e) as f32;
    }
    let e = exp - 127 + i32::from(mant != 0);
    if (-126..=127).contains(&e) {
        f32::from_bits(((e + 127) as u32) << 23)
    } else {
        (2f64).powi(e) as f32
    }
}

/// Largest finite E4M3-FN value.
pub const E4M3_MAX: f32 = 448.0;

/// Nearest E4M3-FN value to `x` (|x| ≤ 448), ties to even mantissa; subnormal step 2⁻⁹.
pub fn e4m3_round(x: f32) -> f32 {
    let a = x.abs();
    if a == 0.0 {
        return x;
    }
    let q = if a < 2f32.powi(-6) {
        2f32.powi(-9)
    } else {
        let e = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
        2f32.powi(e - 3)
    };
    let r = (a / q).round_ties_even() * q;
    r.min(E4M3_MAX).copysign(x)
}

/// FP8 simulation of one block (docs/forward.md §2.7 "Q8"): power-of-two scale from the block max.
pub fn fp8_roundtrip(v: &mut [f32]) {
    let amax = v.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-4);
    let s = pow2_ceil(amax * (1.0 / E4M3_MAX));
    for x in v {
        *x = s * e4m3_round((*x / s).clamp(-E4M3_MAX, E4M3_MAX));
    }
}

/// E2M1 magnitudes by code.
pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Nearest E2M1 value to `x` (|x| ≤ 6); ties go to the even code.
pub fn e2m1_round(x: f32) -> f32 {
    let a = x.abs();
    let mut best = 0usize;
    let mut best_d = f32::INFINITY;
    for (code, &v) in E2M1_VALUES.iter().enumerate() {
        let d = (a - v).abs();
        if d < best_d || (d == best_d && code % 2 == 0) {
            best = code;
            best_d = d;
        }
    }
    E2M1_VALUES[best].copysign(x)
}

/// FP4 simulation of one block (docs/forward.md §2.7 "Q4").
pub fn fp4_roundtrip(v: &mut [f32]) {
    let amax = v
        .iter()
        .fold(0f32, |m, x| m.max(x.abs()))
        .max(6.0 * f32::MIN_POSITIVE);
    let s = pow2_ceil(amax * (1.0 / 6.0));
    for x in v {
        *x = s * e2m1_round((*x / s).clamp(-6.0, 6.0));
    }
}

/// In-place normalised Walsh–Hadamard transform (Sylvester order), `v.len()` a power of two.
pub fn hadamard(v: &mut [f32]) {
    let n = v.len();
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (v[j], v[j + h]);
                v[j] = a + b;
                v[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let s = (1.0 / (n as f64).sqrt()) as f32;
    for x in v {
        *x *= s;
    }
}

/// Logistic sigmoid.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `x·σ(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `ln(1+eˣ)` with torch's threshold (x > 20 returns x).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Router score `√softplus(x)` (docs/forward.md §6).
#[inline]
pub fn sqrtsoftplus(x: f32) -> f32 {
    softplus(x).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_model::Yarn;

    #[test]
    fn flash_yarn_frequencies_follow_the_spec_ramp() {
        let f = RopeFreq {
            base: 160_000.0,
            yarn: Some(Yarn {
                factor: 16.0,
                original_context: 65_536,
                beta_fast: 32.0,
                beta_slow: 1.0,
            }),
            rope_dim: 64,
        };
        let w = rope_freqs(&f);
        assert_eq!(w.len(), 32);
        let w0 = |j: usize| 160_000f64.powf(-(j as f64) / 32.0);
        // lo = 15, hi = 25 (docs/forward.md §2.3): pairs <= 15 unchanged, >= 25 divided by 16.
        for (j, &wj) in w.iter().enumerate() {
            let want = match j {
                0..=15 => w0(j),
                25.. => w0(j) / 16.0,
                _ => continue,
            };
            assert!(((wj as f64) - want).abs() <= 1e-7 * w0(j), "pair {j}");
        }
        let g = 0.5; // j = 20
        let want = w0(20) * (1.0 - g) + w0(20) / 16.0 * g;
        assert!(((w[20] as f64) - want).abs() <= 1e-7 * want);
    }

    #[test]
    fn pow2_ceil_is_exact() {
        assert_eq!(pow2_ceil(1.0), 1.0);
        assert_eq!(pow2_ceil(1.0000001), 2.0);
        assert_eq!(pow2_ceil(0.75), 1.0);
        assert_eq!(pow2_ceil(0.5), 0.5);
        assert_eq!(pow2_ceil(3e-39), f32::from_bits(1 << 22)); // subnormal input -> 2^-127
    }

    #[test]
    fn e2m1_ties_go_to_even_codes() {
        let cases = [
            (0.25, 0.0),
            (0.75, 1.0),
            (1.25, 1.0),
            (1.75, 2.0),
            (2.5, 2.0),
            (3.5, 4.0),
            (5.0, 4.0),
            (-5.0, -4.0),
            (5.1, 6.0),
        ];
        for (x, want) in cases {
            assert_eq!(e2m1_round(x), want, "{x}");
        }
    }

    #[test]
    fn e4m3_rounds_to_representable_values() {
        assert_eq!(e4m3_round(448.0), 448.0);
        assert_eq!(e4m3_round(1.0625), 1.0); // tie between 1.0 and 1.125 -> even mantissa
        assert_eq!(e4m3_round(1.1875), 1.25);
        assert_eq!(e4m3_round(2f32.powi(-10)), 0.0); // half the subnormal step, tie to 0
        assert_eq!(e4m3_round(3.0 * 2f32.powi(-10)), 2.0 * 2f32.powi(-9));
    }

    #[test]
    fn hadamard_is_orthonormal() {
        let mut v = vec![0f32; 8];
        v[3] = 1.0;
        hadamard(&mut v);
        let n: f32 = v.iter().map(|x| x * x).sum();
        assert!((n - 1.0).abs() < 1e-6);
        hadamard(&mut v);
        assert!(
            (v[3] - 1.0).abs() < 1e-6
                && v.iter().enumerate().all(|(i, x)| i == 3 || x.abs() < 1e-6)
        );
    }
}
