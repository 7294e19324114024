//! Every CPU op against a straightforward scalar (mostly f64) reference written here from
//! the spec, on random inputs. NaN never passes (`assert_close` compares with `<=`).

mod common;

use std::sync::Arc;

use common::*;
use ds4_cpu::CpuBackend;
use ds4_engine::backend::{
    AttnArgs, Backend, BackendError, Buf, CompSel, CompressorArgs, HcArgs, IndexerArgs, MoeArgs,
    RopeArgs, RopeFreq, RouterArgs, Routing, Weight, WeightUse,
};
use ds4_engine::numerics::rope_freqs;
use ds4_engine::Rng;
use ds4_gguf::{quant, GgmlType, GgufFile};

fn be(threads: usize) -> CpuBackend {
    CpuBackend::new(threads).unwrap()
}

fn put(b: &mut CpuBackend, v: &[f32]) -> Buf {
    let buf = b.alloc(v.len()).unwrap();
    b.upload(buf.all(), v).unwrap();
    buf
}

fn get(b: &mut CpuBackend, buf: Buf) -> Vec<f32> {
    let mut v = vec![0f32; buf.len()];
    b.download(buf.all(), &mut v).unwrap();
    v
}

/// One weight in its own file.
fn weight(
    b: &mut CpuBackend,
    dims: &[u64],
    ty: GgmlType,
    data: &[f32],
    usage: WeightUse,
) -> (Weight, Arc<GgufFile>) {
    let f = make_file(vec![("w".into(), dims.to_vec(), ty, data.to_vec())]);
    (b.load_weight(&f, "w", usage).unwrap(), f)
}

fn dequant(f: &GgufFile) -> Vec<f32> {
    let (info, bytes) = f.tensor_bytes("w").unwrap();
    let mut out = vec![0f32; info.n_elements().unwrap() as usize];
    quant::dequantize(info.ty, bytes, &mut out).unwrap();
    out
}

fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

#[test]
fn matmul_matches_the_dequantized_reference_for_every_type() {
    let mut rng = Rng::new(1);
    let (cols, rows, mats, t) = (256, 96, 3, 3);
    let wv = randn(&mut rng, cols * rows * mats, 0.1);
    let xv = randn(&mut rng, t * cols, 1.0);
    for ty in [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Bf16,
        GgmlType::Q8_0,
        GgmlType::Q2K,
        GgmlType::Q4K,
        GgmlType::Iq2Xxs,
        GgmlType::Mxfp4,
    ] {
        let mut b = be(2);
        let (w, f) = weight(
            &mut b,
            &[cols as u64, rows as u64, mats as u64],
            ty,
            &wv,
            WeightUse::Matrix,
        );
        let deq = dequant(&f);
        let x = put(&mut b, &xv);
        let y = b.alloc(t * rows).unwrap();
        let mat = 2;
        b.matmul(w, mat, x.all(), t, y.all()).unwrap();
        let got = get(&mut b, y);
        let mut want = Vec::new();
        for ti in 0..t {
            for r in 0..rows {
                let row = &deq[(mat * rows + r) * cols..(mat * rows + r + 1) * cols];
                want.push(dot64(row, &xv[ti * cols..(ti + 1) * cols]));
            }
        }
        assert_close(&got, &want, 1e-5, &format!("matmul {ty}"));
        // One token at a time gives the same bits (batching does not change results).
        for ti in 0..t {
            let y1 = b.alloc(rows).unwrap();
            b.matmul(w, mat, x.rows(ti, 1, cols), 1, y1.all()).unwrap();
            assert_eq!(
                get(&mut b, y1),
                got[ti * rows..(ti + 1) * rows].to_vec(),
                "{ty}"
            );
        }
        // And one thread gives the same bits as two.
        let mut b1 = be(1);
        let w1 = b1.load_weight(&f, "w", WeightUse::Matrix).unwrap();
        let x1 = put(&mut b1, &xv);
        let y1 = b1.alloc(t * rows).unwrap();
        b1.matmul(w1, mat, x1.all(), t, y1.all()).unwrap();
        assert_eq!(
            get(&mut b1, y1),
            got,
            "{ty}: thread count changed the result"
        );
    }
}

/// Int8 activations (`Backend::set_activation_q8`): one-token matmuls of the block types
/// (Q8_0 and the low-bit ones) equal `q8act::dot` row by row (the GPU kernels'
/// definition), multi-token matmuls and F16 weights keep the f32 path, and the int8 result
/// stays near the f32 one.
#[test]
fn activation_q8_follows_the_rule_and_the_codec() {
    let mut rng = Rng::new(5);
    let (cols, rows, t) = (512, 64, 2);
    let wv = randn(&mut rng, cols * rows, 0.1);
    let xv = randn(&mut rng, t * cols, 1.0);
    for ty in [
        GgmlType::F16,
        GgmlType::Q8_0,
        GgmlType::Q2K,
        GgmlType::Q4K,
        GgmlType::Iq2Xxs,
        GgmlType::Mxfp4,
    ] {
        let mut b = be(2);
        let (w, f) = weight(
            &mut b,
            &[cols as u64, rows as u64],
            ty,
            &wv,
            WeightUse::Matrix,
        );
        let x = put(&mut b, &xv);
        let f32_one = {
            let y = b.alloc(rows).unwrap();
            b.matmul(w, 0, x.rows(0, 1, cols), 1, y.all()).unwrap();
            get(&mut b, y)
        };
        let f32_two = {
            let y = b.alloc(t * rows).unwrap();
            b.matmul(w, 0, x.all(), t, y.all()).unwrap();
            get(&mut b, y)
        };
        b.set_activation_q8(true).unwrap();
        let q8_one = {
            let y = b.alloc(rows).unwrap();
            b.matmul(w, 0, x.rows(0, 1, cols), 1, y.all()).unwrap();
            get(&mut b, y)
        };
        let q8_two = {
            let y = b.alloc(t * rows).unwrap();
            b.matmul(w, 0, x.all(), t, y.all()).unwrap();
            get(&mut b, y)
        };
        assert_eq!(
            q8_two, f32_two,
            "{ty}: two tokens must stay on f32 activations"
        );
        if !quant::q8act::applies(ty) {
            assert_eq!(q8_one, f32_one, "{ty}: not a q8 type");
            continue;
        }
        assert_ne!(q8_one, f32_one, "{ty}: the q8 path was not taken");
        let (info, bytes) = f.tensor_bytes("w").unwrap();
        let rb = bytes.len() / rows;
        let mut a = quant::q8act::ActQ8::default();
        a.quantize(&xv[..cols]).unwrap();
        for r in 0..rows {
            let want = quant::q8act::dot(info.ty, &bytes[r * rb..(r + 1) * rb], &a).unwrap();
            assert_eq!(q8_one[r].to_bits(), want.to_bits(), "{ty} row {r}");
        }
        let scale = f32_one.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = q8_one
            .iter()
            .zip(&f32_one)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst <= 2e-2 * scale, "{ty}: q8 vs f32 {worst} of {scale}");
    }
}

#[test]
fn grouped_matmul_is_block_diagonal() {
    let mut rng = Rng::new(2);
    let (c, r, g, t) = (32, 8, 3, 2);
    let wv = randn(&mut rng, c * r * g, 0.3);
    let xv = randn(&mut rng, t * g * c, 1.0);
    let mut b = be(2);
    let (w, _f) = weight(
        &mut b,
        &[c as u64, (r * g) as u64],
        GgmlType::F32,
        &wv,
        WeightUse::Matrix,
    );
    let x = put(&mut b, &xv);
    let y = b.alloc(t * g * r).unwrap();
    b.matmul_grouped(w, g, x.all(), t, y.all()).unwrap();
    let mut want = Vec::new();
    for ti in 0..t {
        for gi in 0..g {
            for ri in 0..r {
                let row = &wv[(gi * r + ri) * c..(gi * r + ri + 1) * c];
                want.push(dot64(
                    row,
                    &xv[ti * g * c + gi * c..ti * g * c + (gi + 1) * c],
                ));
            }
        }
    }
    assert_close(&get(&mut b, y), &want, 1e-6, "grouped");
}

#[test]
fn rms_norm_weighted_unweighted_and_in_place() {
    let mut rng = Rng::new(3);
    let (rows, width, eps) = (5, 48, 1e-6f32);
    let xv = randn(&mut rng, rows * width, 2.0);
    let gv = uniform(&mut rng, width, 0.5, 1.5);
    let mut b = be(2);
    let (g, _f) = weight(
        &mut b,
        &[width as u64],
        GgmlType::F32,
        &gv,
        WeightUse::Vector,
    );
    let reference = |weighted: bool| -> Vec<f64> {
        let mut out = Vec::new();
        for r in xv.chunks(width) {
            let ms = r.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / width as f64;
            let s = 1.0 / (ms + eps as f64).sqrt();
            for (i, v) in r.iter().enumerate() {
                out.push(*v as f64 * s * if weighted { gv[i] as f64 } else { 1.0 });
            }
        }
        out
    };
    let x = put(&mut b, &xv);
    let y = b.alloc(rows * width).unwrap();
    b.rms_norm(x.all(), Some(g), rows, width, eps, y.all())
        .unwrap();
    assert_close(&get(&mut b, y), &reference(true), 1e-6, "weighted");
    b.rms_norm(x.all(), None, rows, width, eps, x.all())
        .unwrap();
    assert_close(&get(&mut b, x), &reference(false), 1e-6, "in place");
    // Partial overlap is refused.
    let err = b.rms_norm(x.slice(0, width), None, 1, width, eps, x.slice(1, width));
    assert!(matches!(err, Err(BackendError::Aliasing { .. })));
}

#[test]
fn rope_rotates_interleaved_tail_pairs_and_inverts() {
    let mut rng = Rng::new(4);
    let (rows, heads, hd, rd) = (3, 2, 24, 8);
    let xv = randn(&mut rng, rows * heads * hd, 1.0);
    let freq = RopeFreq {
        base: 1000.0,
        yarn: Some(ds4_model::Yarn {
            factor: 4.0,
            original_context: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
        }),
        rope_dim: rd,
    };
    let args = RopeArgs {
        n_rows: rows,
        n_heads: heads,
        head_dim: hd,
        pos0: 5,
        pos_step: 4,
        freq,
        inverse: false,
        row_pos: None,
    };
    let w = rope_freqs(&freq);
    let mut want: Vec<f64> = xv.iter().map(|&v| v as f64).collect();
    for r in 0..rows {
        let p = (5 + 4 * r) as f64;
        for h in 0..heads {
            let base = (r * heads + h) * hd + (hd - rd);
            for j in 0..rd / 2 {
                let (c, s) = ((p * w[j] as f64).cos(), (p * w[j] as f64).sin());
                let (u, v) = (want[base + 2 * j], want[base + 2 * j + 1]);
                want[base + 2 * j] = u * c - v * s;
                want[base + 2 * j + 1] = u * s + v * c;
            }
        }
    }
    let mut b = be(2);
    let x = put(&mut b, &xv);
    b.rope(x.all(), args).unwrap();
    let got = get(&mut b, x);
    assert_close(&got, &want, 1e-5, "rope");
    for r in 0..rows * heads {
        assert_eq!(
            got[r * hd..r * hd + hd - rd],
            xv[r * hd..r * hd + hd - rd],
            "nope dims"
        );
    }
    b.rope(
        x.all(),
        RopeArgs {
            inverse: true,
            ..args
        },
    )
    .unwrap();
    let back: Vec<f64> = xv.iter().map(|&v| v as f64).collect();
    assert_close(&get(&mut b, x), &back, 1e-5, "inverse");
}

/// Rows at positions read from a buffer (a batched decode step: one row per sequence) are
/// rotated exactly as each row alone at its position; a negative position is an error.
#[test]
fn rope_with_row_positions_equals_each_row_at_its_position() {
    let mut rng = Rng::new(5);
    let (rows, heads, hd, rd) = (4, 3, 16, 8);
    let xv = randn(&mut rng, rows * heads * hd, 1.0);
    let freq = RopeFreq {
        base: 10000.0,
        yarn: None,
        rope_dim: rd,
    };
    let positions = [17i32, 3, 4096, 0];
    let mut b = be(2);
    let pos = b.alloc_i32(rows).unwrap();
    b.upload_i32(pos, 0, &positions).unwrap();
    for inverse in [false, true] {
        let args = RopeArgs {
            n_rows: rows,
            n_heads: heads,
            head_dim: hd,
            pos0: 999,
            pos_step: 7,
            freq,
            inverse,
            row_pos: Some(pos),
        };
        let x = put(&mut b, &xv);
        b.rope(x.all(), args).unwrap();
        let got = get(&mut b, x);
        let w = heads * hd;
        for (r, &p) in positions.iter().enumerate() {
            let one = put(&mut b, &xv[r * w..(r + 1) * w]);
            let alone = RopeArgs {
                n_rows: 1,
                pos0: p as usize,
                row_pos: None,
                ..args
            };
            b.rope(one.all(), alone).unwrap();
            assert_eq!(got[r * w..(r + 1) * w], get(&mut b, one)[..], "row {r}");
        }
    }
    b.upload_i32(pos, 0, &[1, -2, 3, 4]).unwrap();
    let x = put(&mut b, &xv);
    let bad = RopeArgs {
        n_rows: rows,
        n_heads: heads,
        head_dim: hd,
        pos0: 0,
        pos_step: 1,
        freq,
        inverse: false,
        row_pos: Some(pos),
    };
    let e = b.rope(x.all(), bad).unwrap_err();
    assert!(e.to_string().contains("-2"), "{e}");
    // Fewer positions than rows is a shape error.
    let short = b.alloc_i32(2).unwrap();
    let e = b
        .rope(
            x.all(),
            RopeArgs {
                row_pos: Some(short),
                ..bad
            },
        )
        .unwrap_err();
    assert!(matches!(e, BackendError::Shape { .. }), "{e}");
}

/// All finite E4M3-FN magnitudes with their codes.
fn e4m3_table() -> Vec<(u32, f64)> {
    (0..0x7fu32)
        .map(|c| {
            let (e, m) = (c >> 3, c & 7);
            let v = if e == 0 {
                m as f64 * 2f64.powi(-9)
            } else {
                (1.0 + m as f64 / 8.0) * 2f64.powi(e as i32 - 7)
            };
            (c, v)
        })
        .collect()
}

/// Nearest table value, ties to the even code.
fn nearest(table: &[(u32, f64)], x: f64) -> f64 {
    let a = x.abs();
    let mut best = table[0];
    for &(c, v) in table {
        let (d, bd) = ((a - v).abs(), (a - best.1).abs());
        if d < bd || (d == bd && c % 2 == 0) {
            best = (c, v);
        }
    }
    best.1.copysign(x)
}

#[test]
fn fp8_simulation_matches_a_brute_force_e4m3_rounding() {
    let table = e4m3_table();
    let mut rng = Rng::new(5);
    let (rows, width, n_dims) = (6, 96, 80); // blocks of 64 + 16, then 16 untouched
    let mut xv = randn(&mut rng, rows * width, 3.0);
    xv[7] = 0.0;
    for v in &mut xv[width..2 * width] {
        *v *= 1e-6; // tiny block: floor of the scale (1e-4) and subnormals
    }
    let mut want = Vec::new();
    for row in xv.chunks(width) {
        for (bi, blk) in row[..n_dims].chunks(64).enumerate() {
            let _ = bi;
            let amax = blk
                .iter()
                .fold(0f64, |m, v| m.max(v.abs() as f64))
                .max(1e-4);
            let s = 2f64.powf((amax * (1.0f32 / 448.0) as f64).log2().ceil());
            want.extend(
                blk.iter()
                    .map(|&v| s * nearest(&table, (v as f64 / s).clamp(-448.0, 448.0))),
            );
        }
        want.extend(row[n_dims..].iter().map(|&v| v as f64));
    }
    let mut b = be(2);
    let x = put(&mut b, &xv);
    b.qat_fp8(x.all(), rows, width, n_dims).unwrap();
    let got = get(&mut b, x);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(*g as f64, *w, "element {i} (input {})", xv[i]);
    }
}

#[test]
fn hadamard_fp4_simulation_matches_matrix_reference() {
    let e2m1: Vec<(u32, f64)> = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
        .iter()
        .enumerate()
        .map(|(c, &v)| (c as u32, v))
        .collect();
    let n = 64;
    // Sylvester Hadamard matrix.
    let mut h = vec![vec![1i32]];
    while h.len() < n {
        let k = h.len();
        let mut m = vec![vec![0; 2 * k]; 2 * k];
        for i in 0..k {
            for j in 0..k {
                m[i][j] = h[i][j];
                m[i][j + k] = h[i][j];
                m[i + k][j] = h[i][j];
                m[i + k][j + k] = -h[i][j];
            }
        }
        h = m;
    }
    let mut rng = Rng::new(6);
    let rows = 4;
    // Integer inputs: H·x is exact in f32, so the reference can apply the same f32 scale.
    let xv: Vec<f32> = (0..rows * n)
        .map(|_| (rng.next_u64() % 41) as f32 - 20.0)
        .collect();
    let s = (1.0 / (n as f64).sqrt()) as f32;
    let mut want = Vec::new();
    for row in xv.chunks(n) {
        let y: Vec<f32> = (0..n)
            .map(|i| (0..n).map(|j| h[i][j] as f32 * row[j]).sum::<f32>() * s)
            .collect();
        for blk in y.chunks(32) {
            let amax = blk
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()))
                .max(6.0 * f32::MIN_POSITIVE);
            let sc = 2f64.powf(((amax * (1.0f32 / 6.0)) as f64).log2().ceil());
            want.extend(
                blk.iter()
                    .map(|&v| sc * nearest(&e2m1, (v as f64 / sc).clamp(-6.0, 6.0))),
            );
        }
    }
    let mut b = be(2);
    let x = put(&mut b, &xv);
    b.qat_hadamard_fp4(x.all(), rows, n).unwrap();
    let got = get(&mut b, x);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(*g as f64, *w, "element {i}");
    }
    assert!(
        b.qat_hadamard_fp4(x.all(), 1, 48).is_err(),
        "non power of two"
    );
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn sinkhorn64(z: &[f64], n: usize, iters: usize, eps: f64) -> Vec<f64> {
    let mut p = vec![0f64; n * n];
    for i in 0..n {
        let m = z[i * n..(i + 1) * n]
            .iter()
            .cloned()
            .fold(f64::MIN, f64::max);
        let s: f64 = z[i * n..(i + 1) * n].iter().map(|v| (v - m).exp()).sum();
        for j in 0..n {
            p[i * n + j] = (z[i * n + j] - m).exp() / s + eps;
        }
    }
    for it in 0..iters {
        if it > 0 {
            for i in 0..n {
                let s: f64 = p[i * n..(i + 1) * n].iter().sum::<f64>() + eps;
                for j in 0..n {
                    p[i * n + j] /= s;
                }
            }
        }
        for j in 0..n {
            let s: f64 = (0..n).map(|i| p[i * n + j]).sum::<f64>() + eps;
            for i in 0..n {
                p[i * n + j] /= s;
            }
        }
    }
    p
}

#[test]
fn hc_pre_post_and_head_follow_the_spec() {
    let mut rng = Rng::new(7);
    let (n, d, t) = (4usize, 32usize, 3usize);
    let nm = 2 * n + n * n;
    let (hc_eps, rms_eps) = (1e-6f32, 1e-6f32);
    let xv = randn(&mut rng, t * n * d, 1.0);
    let mixv = randn(&mut rng, t * nm, 3.0);
    let basev = randn(&mut rng, nm, 0.5);
    let scalev = uniform(&mut rng, 3, 0.7, 1.3);
    let mut b = be(2);
    let (base, _f1) = weight(
        &mut b,
        &[nm as u64],
        GgmlType::F32,
        &basev,
        WeightUse::Vector,
    );
    let (scale, _f2) = weight(&mut b, &[3], GgmlType::F32, &scalev, WeightUse::Vector);
    let x = put(&mut b, &xv);
    let mix = put(&mut b, &mixv);
    let (y, post, comb) = (
        b.alloc(t * d).unwrap(),
        b.alloc(t * n).unwrap(),
        b.alloc(t * n * n).unwrap(),
    );
    let args = HcArgs {
        n_tok: t,
        n_hc: n,
        dim: d,
        sinkhorn_iters: 20,
        hc_eps,
        rms_eps,
    };
    b.hc_pre(
        mix.all(),
        x.all(),
        base,
        scale,
        args,
        y.all(),
        post.all(),
        comb.all(),
    )
    .unwrap();
    let (mut wy, mut wpost, mut wcomb) = (Vec::new(), Vec::new(), Vec::new());
    for ti in 0..t {
        let xs = &xv[ti * n * d..(ti + 1) * n * d];
        let rho = 1.0
            / (xs.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / (n * d) as f64 + 1e-6).sqrt();
        let mu = |i: usize| mixv[ti * nm + i] as f64 * rho;
        let pre: Vec<f64> = (0..n)
            .map(|i| sigmoid(scalev[0] as f64 * mu(i) + basev[i] as f64) + hc_eps as f64)
            .collect();
        for i in 0..n {
            wpost.push(2.0 * sigmoid(scalev[1] as f64 * mu(n + i) + basev[n + i] as f64));
        }
        let z: Vec<f64> = (0..n * n)
            .map(|k| scalev[2] as f64 * mu(2 * n + k) + basev[2 * n + k] as f64)
            .collect();
        wcomb.extend(sinkhorn64(&z, n, 20, hc_eps as f64));
        for e in 0..d {
            wy.push((0..n).map(|i| pre[i] * xs[i * d + e] as f64).sum());
        }
    }
    assert_close(&get(&mut b, y), &wy, 1e-5, "hc_pre y");
    assert_close(&get(&mut b, post), &wpost, 1e-5, "hc_pre post");
    assert_close(&get(&mut b, comb), &wcomb, 1e-5, "hc_pre comb");

    // HCPost: X'_j = post_j f + Σ_i P[i][j] X_i (P transposed: new j collects from old i).
    let fv = randn(&mut rng, t * d, 1.0);
    let f = put(&mut b, &fv);
    let (pv, cv) = (get(&mut b, post), get(&mut b, comb));
    b.hc_post(x.all(), f.all(), post.all(), comb.all(), args)
        .unwrap();
    let mut want = Vec::new();
    for ti in 0..t {
        for j in 0..n {
            for e in 0..d {
                let mut acc = pv[ti * n + j] as f64 * fv[ti * d + e] as f64;
                for i in 0..n {
                    acc += cv[ti * n * n + i * n + j] as f64 * xv[ti * n * d + i * d + e] as f64;
                }
                want.push(acc);
            }
        }
    }
    assert_close(&get(&mut b, x), &want, 1e-5, "hc_post");

    // HCHead on the original streams.
    let x0 = put(&mut b, &xv);
    let hmixv = randn(&mut rng, t * n, 3.0);
    let hbasev = randn(&mut rng, n, 0.5);
    let (hbase, _f3) = weight(
        &mut b,
        &[n as u64],
        GgmlType::F32,
        &hbasev,
        WeightUse::Vector,
    );
    let (hscale, _f4) = weight(&mut b, &[1], GgmlType::F32, &[1.2], WeightUse::Vector);
    let hmix = put(&mut b, &hmixv);
    let hy = b.alloc(t * d).unwrap();
    b.hc_head(hmix.all(), x0.all(), hbase, hscale, args, hy.all())
        .unwrap();
    let mut want = Vec::new();
    for ti in 0..t {
        let xs = &xv[ti * n * d..(ti + 1) * n * d];
        let rho = 1.0
            / (xs.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / (n * d) as f64 + 1e-6).sqrt();
        let w: Vec<f64> = (0..n)
            .map(|i| {
                sigmoid(1.2f32 as f64 * hmixv[ti * n + i] as f64 * rho + hbasev[i] as f64) + 1e-6
            })
            .collect();
        for e in 0..d {
            want.push((0..n).map(|i| w[i] * xs[i * d + e] as f64).sum());
        }
    }
    assert_close(&get(&mut b, hy), &want, 1e-5, "hc_head");
}

/// Reference pooled rows for all complete windows of `n_tok` tokens from position 0.
fn compressor_ref(
    u: &[f32],
    z: &[f32],
    ape: &[f32],
    n_tok: usize,
    m: usize,
    c: usize,
    overlap: bool,
) -> Vec<f64> {
    let pw = if overlap { 2 * c } else { c };
    let mut rows = Vec::new();
    for w in 0..n_tok / m {
        for e in 0..c {
            let mut cands: Vec<(f64, f64)> = Vec::new();
            let mut add = |tau: usize, col: usize| {
                cands.push((
                    u[tau * pw + col] as f64,
                    z[tau * pw + col] as f64 + ape[(tau % m) * pw + col] as f64,
                ))
            };
            if overlap {
                if w > 0 {
                    for tau in (w - 1) * m..w * m {
                        add(tau, e);
                    }
                }
                for tau in w * m..(w + 1) * m {
                    add(tau, c + e);
                }
            } else {
                for tau in w * m..(w + 1) * m {
                    add(tau, e);
                }
            }
            let mx = cands.iter().map(|c| c.1).fold(f64::MIN, f64::max);
            let s: f64 = cands.iter().map(|c| (c.1 - mx).exp()).sum();
            rows.push(cands.iter().map(|c| (c.1 - mx).exp() / s * c.0).sum());
        }
    }
    rows
}

#[test]
fn compressor_pools_windows_the_same_for_any_chunking() {
    for (m, c, overlap) in [(4usize, 8usize, true), (8, 6, false)] {
        let pw = if overlap { 2 * c } else { c };
        let n_tok = 26;
        let mut rng = Rng::new(8 + m as u64);
        let u = randn(&mut rng, n_tok * pw, 1.0);
        let z = randn(&mut rng, n_tok * pw, 2.0);
        let apev = randn(&mut rng, m * pw, 0.7);
        let want = compressor_ref(&u, &z, &apev, n_tok, m, c, overlap);
        for chunks in [vec![n_tok], vec![3, 1, 5, 2, 7, 8], vec![1; n_tok]] {
            let mut b = be(2);
            let (ape, _f) = weight(
                &mut b,
                &[pw as u64, m as u64],
                GgmlType::F32,
                &apev,
                WeightUse::Vector,
            );
            let proto = CompressorArgs {
                pos0: 0,
                n_tok: 0,
                ratio: m,
                width: c,
                overlap,
            };
            let acc = b.alloc(proto.acc_len()).unwrap();
            let rows = b.alloc((n_tok / m) * c).unwrap();
            let mut pos = 0;
            for n in chunks.iter().copied() {
                let ub = put(&mut b, &u[pos * pw..(pos + n) * pw]);
                let zb = put(&mut b, &z[pos * pw..(pos + n) * pw]);
                let a = CompressorArgs {
                    pos0: pos,
                    n_tok: n,
                    ..proto
                };
                b.compressor(acc.all(), ub.all(), zb.all(), ape, a, rows.all())
                    .unwrap();
                pos += n;
            }
            assert_close(
                &get(&mut b, rows),
                &want,
                1e-5,
                &format!("m={m} chunks {chunks:?}"),
            );
        }
    }
}

#[test]
fn indexer_scores_select_top_k_with_lowest_index_ties() {
    let (heads, dim, k, ratio) = (4usize, 16usize, 3usize, 4usize);
    let n_rows = 9;
    let mut rng = Rng::new(9);
    let rowsv = randn(&mut rng, n_rows * dim, 1.0);
    let (pos0, t) = (10usize, 27usize); // queries see 2 ..= 9 rows
    let qv = randn(&mut rng, t * heads * dim, 1.0);
    let wv = randn(&mut rng, t * heads, 1.0);
    let scale = 0.25f32;
    let mut b = be(2);
    let (q, w, rows) = (put(&mut b, &qv), put(&mut b, &wv), put(&mut b, &rowsv));
    let out = b.alloc_i32(t * k).unwrap();
    let args = IndexerArgs {
        pos0,
        n_tok: t,
        ratio,
        n_heads: heads,
        head_dim: dim,
        top_k: k,
        weight_scale: scale,
    };
    b.indexer_topk(q.all(), w.all(), rows.all(), args, out)
        .unwrap();
    let mut got = vec![0i32; t * k];
    b.download_i32(out, 0, &mut got).unwrap();
    for ti in 0..t {
        let n_p = (pos0 + ti + 1) / ratio;
        let mut want: Vec<i32> = if n_p <= k {
            (0..n_p as i32).collect()
        } else {
            let score = |s: usize| -> f64 {
                (0..heads)
                    .map(|h| {
                        let d = dot64(
                            &qv[(ti * heads + h) * dim..(ti * heads + h + 1) * dim],
                            &rowsv[s * dim..(s + 1) * dim],
                        );
                        wv[ti * heads + h] as f64 * scale as f64 * d.max(0.0)
                    })
                    .sum()
            };
            let mut idx: Vec<usize> = (0..n_p).collect();
            idx.sort_by(|a, b| score(*b).total_cmp(&score(*a)).then(a.cmp(b)));
            let mut sel: Vec<i32> = idx[..k].iter().map(|&i| i as i32).collect();
            sel.sort();
            sel
        };
        want.resize(k, -1);
        assert_eq!(&got[ti * k..(ti + 1) * k], &want[..], "query {ti}");
    }
    // All-zero scores (every dot product <= 0 after ReLU): the lowest indices win.
    let zq = put(&mut b, &vec![0f32; t * heads * dim]);
    b.indexer_topk(zq.all(), w.all(), rows.all(), args, out)
        .unwrap();
    b.download_i32(out, (t - 1) * k, &mut got[..k]).unwrap();
    assert_eq!(&got[..k], &[0, 1, 2]);
}

#[allow(clippy::too_many_arguments)]
fn attention_ref(qv: &[f32], keys: &[&[f32]], sink: f32, scale: f32) -> Vec<f64> {
    let l: Vec<f64> = keys.iter().map(|k| dot64(qv, k) * scale as f64).collect();
    let m = l.iter().cloned().fold(sink as f64, f64::max);
    let denom = (sink as f64 - m).exp() + l.iter().map(|v| (v - m).exp()).sum::<f64>();
    let mut o = vec![0f64; qv.len()];
    for (k, lv) in keys.iter().zip(&l) {
        let p = (lv - m).exp() / denom;
        for (oe, ke) in o.iter_mut().zip(k.iter()) {
            *oe += p * *ke as f64;
        }
    }
    o
}

#[test]
fn attention_with_sinks_over_ring_chunk_and_compressed_rows() {
    let (nh, hd, win, pos0, t) = (3usize, 16usize, 4usize, 6usize, 3usize);
    let mut rng = Rng::new(10);
    let qv = randn(&mut rng, t * nh * hd, 1.0);
    let kvv = randn(&mut rng, t * hd, 1.0);
    let ringv = randn(&mut rng, win * hd, 1.0); // positions 2..=5 at slot p % 4
    let compv = randn(&mut rng, 5 * hd, 1.0);
    let sinkv = randn(&mut rng, nh, 1.0);
    let scale = 0.25f32;
    let mut b = be(2);
    let (sinks, _f) = weight(
        &mut b,
        &[nh as u64],
        GgmlType::F32,
        &sinkv,
        WeightUse::Vector,
    );
    let (q, kv, ring, comp) = (
        put(&mut b, &qv),
        put(&mut b, &kvv),
        put(&mut b, &ringv),
        put(&mut b, &compv),
    );
    let out = b.alloc(t * nh * hd).unwrap();
    let sel = [0i32, 2, 1, -1, 3, 0];
    let idx = b.alloc_i32(t * 2).unwrap();
    b.upload_i32(idx, 0, &sel).unwrap();
    let raw_key = |p: usize| -> &[f32] {
        if p < pos0 {
            &ringv[(p % win) * hd..(p % win + 1) * hd]
        } else {
            &kvv[(p - pos0) * hd..(p - pos0 + 1) * hd]
        }
    };
    for comp_sel in [
        CompSel::None,
        CompSel::All {
            rows: comp.all(),
            ratio: 2,
        },
        CompSel::Top {
            rows: comp.all(),
            ratio: 2,
            idx,
            k: 2,
        },
    ] {
        b.attention(AttnArgs {
            q: q.all(),
            kv: kv.all(),
            ring: ring.all(),
            comp: comp_sel,
            sinks,
            pos0,
            n_tok: t,
            n_head: nh,
            head_dim: hd,
            window: win,
            scale,
            out: out.all(),
        })
        .unwrap();
        let mut want = Vec::new();
        for ti in 0..t {
            let p = pos0 + ti;
            let mut keys: Vec<&[f32]> = (p + 1 - win..=p).map(raw_key).collect();
            match comp_sel {
                CompSel::None => {}
                CompSel::All { .. } => {
                    for w in 0..p.div_ceil(2) {
                        keys.push(&compv[w * hd..(w + 1) * hd]);
                    }
                }
                CompSel::Top { .. } => {
                    for &w in &sel[ti * 2..ti * 2 + 2] {
                        if w >= 0 {
                            keys.push(&compv[w as usize * hd..(w as usize + 1) * hd]);
                        }
                    }
                }
            }
            for h in 0..nh {
                want.extend(attention_ref(
                    &qv[(ti * nh + h) * hd..(ti * nh + h + 1) * hd],
                    &keys,
                    sinkv[h],
                    scale,
                ));
            }
        }
        assert_close(&get(&mut b, out), &want, 1e-5, &format!("{comp_sel:?}"));
    }
    // A selection naming a row that is not yet visible is refused (causality).
    b.upload_i32(idx, 0, &[4, -1, 0, 1, 0, 1]).unwrap();
    let r = b.attention(AttnArgs {
        q: q.all(),
        kv: kv.all(),
        ring: ring.all(),
        comp: CompSel::Top {
            rows: comp.all(),
            ratio: 2,
            idx,
            k: 2,
        },
        sinks,
        pos0,
        n_tok: t,
        n_head: nh,
        head_dim: hd,
        window: win,
        scale,
        out: out.all(),
    });
    assert!(matches!(r, Err(BackendError::Invalid { .. })));
}

#[test]
fn ring_store_keeps_the_last_window_rows_by_slot() {
    let (win, d) = (4usize, 3usize);
    let mut b = be(1);
    let ring = b.alloc(win * d).unwrap();
    let kvv: Vec<f32> = (0..6 * d).map(|i| i as f32).collect();
    let kv = put(&mut b, &kvv);
    b.ring_store(ring.all(), kv.all(), 9, 6, win).unwrap(); // positions 9..=14
    let got = get(&mut b, ring);
    for p in 11..15usize {
        let s = p % win;
        assert_eq!(got[s * d..(s + 1) * d], kvv[(p - 9) * d..(p - 8) * d]);
    }
}

fn sqrtsoftplus(x: f64) -> f64 {
    (if x > 20.0 { x } else { x.exp().ln_1p() }).sqrt()
}

#[test]
fn router_topk_with_bias_and_hash_tables() {
    let (t, e, k, scale) = (4usize, 8usize, 3usize, 1.5f32);
    let mut rng = Rng::new(11);
    let mut lv = randn(&mut rng, t * e, 2.0);
    lv[8 + 5] = lv[8 + 2]; // a tie in token 1 (bias 0 there)
    let mut biasv = randn(&mut rng, e, 0.1);
    biasv[2] = 0.0;
    biasv[5] = 0.0;
    let mut b = be(1);
    let (bias, _f) = weight(
        &mut b,
        &[e as u64],
        GgmlType::F32,
        &biasv,
        WeightUse::Vector,
    );
    let logits = put(&mut b, &lv);
    let ids = b.alloc_i32(t * k).unwrap();
    let wts = b.alloc(t * k).unwrap();
    let args = RouterArgs {
        n_tok: t,
        n_expert: e,
        k,
        scale,
        row0: 0,
    };
    b.router(
        logits.all(),
        Routing::TopK { bias: Some(bias) },
        args,
        ids,
        wts.all(),
    )
    .unwrap();
    let mut got = vec![0i32; t * k];
    b.download_i32(ids, 0, &mut got).unwrap();
    let gw = get(&mut b, wts);
    let check = |ti: usize, chosen: &[usize], got_ids: &[i32], got_w: &[f32]| {
        let pi: Vec<f64> = chosen
            .iter()
            .map(|&x| sqrtsoftplus(lv[ti * e + x] as f64))
            .collect();
        let s: f64 = pi.iter().sum();
        let want: Vec<f64> = pi.iter().map(|p| p / s * scale as f64).collect();
        assert_eq!(
            got_ids,
            chosen
                .iter()
                .map(|&x| x as i32)
                .collect::<Vec<_>>()
                .as_slice()
        );
        assert_close(got_w, &want, 1e-6, "router weights");
    };
    for ti in 0..t {
        let sc = |x: usize| sqrtsoftplus(lv[ti * e + x] as f64) + biasv[x] as f64;
        let mut idx: Vec<usize> = (0..e).collect();
        idx.sort_by(|a, b| sc(*b).total_cmp(&sc(*a)).then(a.cmp(b)));
        check(
            ti,
            &idx[..k],
            &got[ti * k..(ti + 1) * k],
            &gw[ti * k..(ti + 1) * k],
        );
    }
    // Hash routing: tid2eid[token], weights still from the router logits.
    let n_vocab = 5;
    let table: Vec<f32> = (0..n_vocab * k).map(|i| ((i * 3) % e) as f32).collect();
    let (tw, _f2) = weight(
        &mut b,
        &[k as u64, n_vocab as u64],
        GgmlType::I32,
        &table,
        WeightUse::Table,
    );
    let toks = b.alloc_i32(t).unwrap();
    b.upload_i32(toks, 0, &[4, 0, 2, 2]).unwrap();
    b.router(
        logits.all(),
        Routing::Hash {
            table: tw,
            tokens: toks,
        },
        args,
        ids,
        wts.all(),
    )
    .unwrap();
    b.download_i32(ids, 0, &mut got).unwrap();
    let gw = get(&mut b, wts);
    for (ti, tok) in [4usize, 0, 2, 2].iter().enumerate() {
        let chosen: Vec<usize> = table[tok * k..(tok + 1) * k]
            .iter()
            .map(|&x| x as usize)
            .collect();
        check(
            ti,
            &chosen,
            &got[ti * k..(ti + 1) * k],
            &gw[ti * k..(ti + 1) * k],
        );
    }
    // A table naming a nonexistent expert is refused.
    let bad: Vec<f32> = vec![9.0; n_vocab * k];
    let (bw, _f3) = weight(
        &mut b,
        &[k as u64, n_vocab as u64],
        GgmlType::I32,
        &bad,
        WeightUse::Table,
    );
    let r = b.router(
        logits.all(),
        Routing::Hash {
            table: bw,
            tokens: toks,
        },
        args,
        ids,
        wts.all(),
    );
    assert!(matches!(r, Err(BackendError::Invalid { .. })));
}

fn swiglu64(g: f64, u: f64, c: f64) -> f64 {
    let g = g.min(c);
    g * sigmoid(g) * u.clamp(-c, c)
}

#[test]
fn moe_and_swiglu_match_the_reference() {
    let (t, k, d, f, ne, clamp) = (5usize, 2usize, 256usize, 256usize, 4usize, 10.0f32);
    let mut rng = Rng::new(12);
    let xv = randn(&mut rng, t * d, 1.0);
    let mut gv = randn(&mut rng, ne * f * d, 1.0 / 16.0);
    for v in gv.iter_mut().step_by(7) {
        *v *= 40.0; // make the clamp fire
    }
    let uv = randn(&mut rng, ne * f * d, 1.0);
    let dv = randn(&mut rng, ne * d * f, 1.0 / 16.0);
    let ids: Vec<i32> = vec![0, 3, 3, 1, 2, 0, 1, 1, 3, 2];
    let wtv = uniform(&mut rng, t * k, 0.1, 1.0);
    for ty in [GgmlType::F32, GgmlType::Q4K, GgmlType::Mxfp4] {
        let mut b = be(2);
        let (gw, gf) = weight(
            &mut b,
            &[d as u64, f as u64, ne as u64],
            ty,
            &gv,
            WeightUse::Matrix,
        );
        let (uw, uf) = weight(
            &mut b,
            &[d as u64, f as u64, ne as u64],
            ty,
            &uv,
            WeightUse::Matrix,
        );
        let (dw, df) = weight(
            &mut b,
            &[f as u64, d as u64, ne as u64],
            ty,
            &dv,
            WeightUse::Matrix,
        );
        let (g2, u2, d2) = (dequant(&gf), dequant(&uf), dequant(&df));
        let x = put(&mut b, &xv);
        let idb = b.alloc_i32(t * k).unwrap();
        b.upload_i32(idb, 0, &ids).unwrap();
        let wt = put(&mut b, &wtv);
        let out = b.alloc(t * d).unwrap();
        b.moe(
            x.all(),
            idb,
            wt.all(),
            gw,
            uw,
            dw,
            MoeArgs { n_tok: t, k, clamp },
            out.all(),
        )
        .unwrap();
        let mut want = vec![0f64; t * d];
        let mut fired = 0;
        for ti in 0..t {
            let xs = &xv[ti * d..(ti + 1) * d];
            for s in 0..k {
                let e = ids[ti * k + s] as usize;
                let h: Vec<f64> = (0..f)
                    .map(|r| {
                        let g = dot64(&g2[(e * f + r) * d..(e * f + r + 1) * d], xs);
                        let u = dot64(&u2[(e * f + r) * d..(e * f + r + 1) * d], xs);
                        fired += usize::from(g > clamp as f64 || u.abs() > clamp as f64);
                        wtv[ti * k + s] as f64 * swiglu64(g, u, clamp as f64)
                    })
                    .collect();
                for o in 0..d {
                    let row = &d2[(e * d + o) * f..(e * d + o + 1) * f];
                    want[ti * d + o] += row
                        .iter()
                        .zip(&h)
                        .map(|(w, hv)| *w as f64 * hv)
                        .sum::<f64>();
                }
            }
        }
        assert!(fired > 0, "the clamp never fired");
        assert_close(&get(&mut b, out), &want, 1e-4, &format!("moe {ty}"));
    }
    // Elementwise SwiGLU and add.
    let mut b = be(1);
    let g: Vec<f32> = vec![-20.0, -1.0, 0.5, 12.0, 30.0];
    let u: Vec<f32> = vec![3.0, -15.0, 2.0, 11.0, -0.5];
    let (gb, ub, ob) = (put(&mut b, &g), put(&mut b, &u), b.alloc(5).unwrap());
    b.swiglu(gb.all(), ub.all(), 10.0, ob.all()).unwrap();
    let want: Vec<f64> = g
        .iter()
        .zip(&u)
        .map(|(a, c)| swiglu64(*a as f64, *c as f64, 10.0))
        .collect();
    assert_close(&get(&mut b, ob), &want, 1e-6, "swiglu");
    b.add(ob.all(), gb.all()).unwrap();
    let want2: Vec<f64> = want.iter().zip(&g).map(|(w, a)| w + *a as f64).collect();
    assert_close(&get(&mut b, ob), &want2, 1e-6, "add");
}

#[test]
fn embed_copies_rows_into_every_stream() {
    let (d, v, n) = (32usize, 6usize, 4usize);
    let mut rng = Rng::new(13);
    let tab = randn(&mut rng, d * v, 1.0);
    let mut b = be(1);
    let (w, f) = weight(
        &mut b,
        &[d as u64, v as u64],
        GgmlType::F16,
        &tab,
        WeightUse::Table,
    );
    let deq = dequant(&f);
    let toks = b.alloc_i32(2).unwrap();
    b.upload_i32(toks, 0, &[5, 1]).unwrap();
    let out = b.alloc(2 * n * d).unwrap();
    b.embed(w, toks, 2, n, out.all()).unwrap();
    let got = get(&mut b, out);
    for (ti, tok) in [5usize, 1].iter().enumerate() {
        for s in 0..n {
            let o = (ti * n + s) * d;
            assert_eq!(got[o..o + d], deq[tok * d..(tok + 1) * d]);
        }
    }
    b.upload_i32(toks, 0, &[6, 1]).unwrap();
    assert!(
        b.embed(w, toks, 2, n, out.all()).is_err(),
        "token outside the table"
    );
}

#[test]
fn handles_ranges_aliasing_and_types_are_checked() {
    let mut b = be(1);
    let mut rng = Rng::new(14);
    let (w, _f) = weight(
        &mut b,
        &[32, 4],
        GgmlType::Q8_0,
        &randn(&mut rng, 128, 1.0),
        WeightUse::Matrix,
    );
    let x = b.alloc(64).unwrap();
    // Output in the input's buffer.
    let r = b.matmul(w, 0, x.slice(0, 32), 1, x.slice(32, 4));
    assert!(matches!(r, Err(BackendError::Aliasing { .. })), "{r:?}");
    // Out of range.
    let y = b.alloc(4).unwrap();
    assert!(matches!(
        b.matmul(w, 0, x.slice(40, 32), 1, y.all()),
        Err(BackendError::OutOfRange { .. })
    ));
    // Too short an output.
    assert!(matches!(
        b.matmul(w, 0, x.slice(0, 32), 1, y.slice(0, 3)),
        Err(BackendError::Shape { .. })
    ));
    assert!(
        b.matmul(w, 1, x.slice(0, 32), 1, y.all()).is_err(),
        "matrix index"
    );
    // Freed handles.
    b.free(y);
    assert!(matches!(
        b.matmul(w, 0, x.slice(0, 32), 1, y.all()),
        Err(BackendError::BadHandle { .. })
    ));
    let mut buf = [0f32; 4];
    assert!(b.download(y.all(), &mut buf).is_err());
    // A quantized tensor cannot be a vector weight; a missing tensor is named.
    let f = make_file(vec![("q".into(), vec![32], GgmlType::Q8_0, vec![0.5; 32])]);
    assert!(matches!(
        b.load_weight(&f, "q", WeightUse::Vector),
        Err(BackendError::Weight { .. })
    ));
    let e = b.load_weight(&f, "nope", WeightUse::Matrix).unwrap_err();
    assert!(e.to_string().contains("nope"), "{e}");
    // copy: two ranges of one buffer are refused even when disjoint (the aliasing rule of
    // ds4_engine::validate); between buffers it copies.
    let c = put(&mut b, &[1.0, 2.0, 3.0, 4.0]);
    assert!(matches!(
        b.copy(c.slice(0, 3), c.slice(1, 3)),
        Err(BackendError::Aliasing { op: "copy", .. })
    ));
    assert!(matches!(
        b.copy(c.slice(0, 2), c.slice(2, 2)),
        Err(BackendError::Aliasing { op: "copy", .. })
    ));
    let d = b.alloc(4).unwrap();
    b.copy(c.slice(0, 2), d.slice(2, 2)).unwrap();
    assert_eq!(get(&mut b, d), vec![0.0, 0.0, 1.0, 2.0]);
    assert_eq!(get(&mut b, c), vec![1.0, 2.0, 3.0, 4.0]);
}
