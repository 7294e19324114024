//! The scale/min searches shared by ggml's K-quant and IQ2 reference quantizers.
//!
//! These reproduce the f32 arithmetic of ggml's `make_qkx2_quants`, `make_qkx3_quants` and
//! `make_qp_quants` as ds4's `gguf-tools/quants.c` uses them, operation for operation (Rust
//! never fuses a multiply and an add, matching a C build with `-ffp-contract=off`, which
//! is GCC's default for `-std=c11`), so our bytes can match ds4's. Integer conversions
//! truncate like the C (`as u8`), including in the corner cases the C reaches.

/// Round to the nearest integer, ties to even, for |v| ≤ 2^22, by adding 1.5·2^23 and
/// reading the mantissa (ggml's `nearest_int`). Outside that range (or for NaN) the result
/// is meaningless but deterministic and never panics; callers clamp it.
#[inline(always)]
pub(crate) fn nearest_int(v: f32) -> i32 {
    let t = v + 12_582_912.0;
    (t.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// `a > b ? a : b`, the C macro (not `f32::max`, which treats NaN differently).
#[inline(always)]
pub(crate) fn cmax(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// Weighted squared or absolute error of reconstructing `x` as `scale·l + min`.
#[inline(always)]
fn recon_error<const N: usize>(
    x: &[f32; N],
    w: &[f32; N],
    l: &[u8; N],
    scale: f32,
    min: f32,
    use_mad: bool,
) -> f32 {
    let mut err = 0f32;
    for i in 0..N {
        let diff = scale * f32::from(l[i]) + min - x[i];
        let diff = if use_mad { diff.abs() } else { diff * diff };
        err += w[i] * diff;
    }
    err
}

/// Parameters of the affine (scale + min) search.
pub(crate) struct AffineSearch {
    pub nmax: i32,
    pub rmin: f32,
    pub rdelta: f32,
    pub nstep: i32,
    pub use_mad: bool,
    /// `true`: ggml's qkx3 variant (degenerate when `max <= min`); `false`: qkx2 (`max == min`).
    /// With finite inputs the two tests agree; kept for fidelity.
    pub qkx3: bool,
}

/// Find `scale` and `min` (returned as `(scale, -min)`, the "the_min" convention) and codes
/// `l[i] ∈ [0, nmax]` so that `x ≈ scale·l + min` in weighted error. Start from the plain
/// min/max fit, then try `nstep + 1` slightly different inverse scales, refit scale and min by
/// weighted least squares for each, and keep the best.
pub(crate) fn make_qkx<const N: usize>(
    x: &[f32; N],
    w: &[f32; N],
    l: &mut [u8; N],
    p: &AffineSearch,
) -> (f32, f32) {
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..N {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    let degenerate = if p.qkx3 { max <= min } else { max == min };
    if degenerate {
        l.fill(0);
        return (0.0, -min);
    }
    let nmax_f = p.nmax as f32;
    let mut iscale = nmax_f / (max - min);
    let mut scale = 1.0 / iscale;
    for i in 0..N {
        l[i] = nearest_int(iscale * (x[i] - min)).clamp(0, p.nmax) as u8;
    }
    let mut best_error = recon_error(x, w, l, scale, min, p.use_mad);
    if p.nstep < 1 {
        return (scale, -min);
    }
    let mut laux = [0u8; N];
    for is in 0..=p.nstep {
        iscale = (p.rmin + p.rdelta * is as f32 + nmax_f) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..N {
            let li = nearest_int(iscale * (x[i] - min)).clamp(0, p.nmax);
            laux[i] = li as u8;
            let lf = li as f32;
            sum_l += w[i] * lf;
            sum_l2 += w[i] * lf * lf;
            sum_xl += w[i] * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let cur = recon_error(x, w, &laux, this_scale, this_min, p.use_mad);
            if cur < best_error {
                *l = laux;
                best_error = cur;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Symmetric (no min) weighted search: codes `l[i] ∈ [0, nmax]` with `x ≈ scale·l`
/// (ggml's `make_qp_quants`). Used to quantize sub-block scales and mins to few bits, and as
/// IQ2_XXS's starting point. Tries 9 inverse scales around `nmax/max`, then up to 5 rounds of
/// coordinate descent on single codes; returns the least-squares scale for the final codes.
pub(crate) fn make_qp<const N: usize>(
    x: &[f32; N],
    nmax: i32,
    l: &mut [u8; N],
    qw: &[f32; N],
) -> f32 {
    let mut max = 0f32;
    for &v in x {
        max = cmax(max, v);
    }
    if max < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let nmax_f = nmax as f32;
    let mut iscale = nmax_f / max;
    for i in 0..N {
        l[i] = nearest_int(iscale * x[i]) as u8;
    }
    let scale = 1.0 / iscale;
    let mut best_mse = 0f32;
    for i in 0..N {
        let diff = x[i] - scale * f32::from(l[i]);
        best_mse += qw[i] * diff * diff;
    }
    for is in -4i32..=4 {
        if is == 0 {
            continue;
        }
        let iscale_is = (0.1 * is as f32 + nmax_f) / max;
        let scale_is = 1.0 / iscale_is;
        let mut mse = 0f32;
        for i in 0..N {
            let li = nearest_int(iscale_is * x[i]).min(nmax);
            let diff = x[i] - scale_is * li as f32;
            mse += qw[i] * diff * diff;
        }
        if mse < best_mse {
            best_mse = mse;
            iscale = iscale_is;
        }
    }
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..N {
        let li = nearest_int(iscale * x[i]).min(nmax);
        l[i] = li as u8;
        let lf = li as f32;
        sumlx += qw[i] * x[i] * lf;
        suml2 += qw[i] * lf * lf;
    }
    for _ in 0..5 {
        let mut changed = false;
        for i in 0..N {
            let w = qw[i];
            let cur = f32::from(l[i]);
            let mut slx = sumlx - w * x[i] * cur;
            let mut sl2 = suml2 - w * cur * cur;
            if slx > 0.0 && sl2 > 0.0 {
                let new_l = nearest_int(x[i] * sl2 / slx).min(nmax);
                if new_l != i32::from(l[i]) {
                    let nf = new_l as f32;
                    slx += w * x[i] * nf;
                    sl2 += w * nf * nf;
                    if slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l as u8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// Groups whose largest value is below this are treated as all-zero (ggml's
/// `GROUP_MAX_EPS`).
pub(crate) const GROUP_MAX_EPS: f32 = 1e-15;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_half_to_even_and_never_panics() {
        let cases = [
            (0.0, 0),
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (3.49, 3),
            (-7.51, -8),
            (4_194_303.0, 4_194_303),
        ];
        for (v, want) in cases {
            assert_eq!(nearest_int(v), want, "nearest_int({v})");
        }
        // Out of range: any value, but no panic.
        for v in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30, -1e30] {
            let _ = nearest_int(v);
        }
    }

    #[test]
    fn qp_search_recovers_exact_multiples() {
        // x = 0.25 · l exactly: the search must find the codes and the scale.
        let codes: [u8; 16] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];
        let x = codes.map(|c| 0.25 * f32::from(c));
        let w = [1.0f32; 16];
        let mut l = [0u8; 16];
        let scale = make_qp(&x, 15, &mut l, &w);
        assert_eq!(l, codes);
        assert!((scale - 0.25).abs() < 1e-6, "scale {scale}");
    }

    #[test]
    fn affine_search_recovers_exact_grid() {
        // x = 0.5 · l − 1 on a 4-level grid.
        let codes: [u8; 16] = [0, 1, 2, 3, 3, 2, 1, 0, 0, 1, 2, 3, 3, 2, 1, 0];
        let x = codes.map(|c| 0.5 * f32::from(c) - 1.0);
        let w = [1.0f32; 16];
        let mut l = [0u8; 16];
        let p = AffineSearch {
            nmax: 3,
            rmin: -0.5,
            rdelta: 0.1,
            nstep: 15,
            use_mad: true,
            qkx3: false,
        };
        let (scale, neg_min) = make_qkx(&x, &w, &mut l, &p);
        assert_eq!(l, codes);
        assert!((scale - 0.5).abs() < 1e-6 && (neg_min - 1.0).abs() < 1e-6);
    }
}
