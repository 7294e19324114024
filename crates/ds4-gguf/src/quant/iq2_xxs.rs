//! IQ2_XXS: super-blocks of 256 values in 8 groups of 32, 2.06 bits per weight.
//! Layout: `d: f16 @0`, then per group g two little-endian u32 at 2+8g and 6+8g:
//! `w0` = four 8-bit lattice indices (one per 8 values), `w1` = four 7-bit sign indices in
//! bits 7k..7k+6 and a 4-bit scale `ls` in bits 28..31. Value j of sub-group k is
//! `db · GRID[idx_k][j] · (bit j of KSIGNS[s_k] ? −1 : +1)` with `db = d·(0.5+ls)·0.25`.

use std::sync::OnceLock;

use super::iq2xxs_tables::{GRID, KGRID, KSIGNS};
use super::search::{cmax, make_qp, nearest_int, GROUP_MAX_EPS};
use super::{f16_at, hsum, scale_to_f16, QuantError};
use crate::types::GgmlType;

pub const BLOCK_ELEMS: usize = 256;
pub const BLOCK_BYTES: usize = 66;

/// GRID as f32, so the dot kernel loads lattice values without a conversion.
static GRID_F32: [[f32; 8]; 256] = {
    let mut t = [[0f32; 8]; 256];
    let mut k = 0;
    while k < 256 {
        let mut j = 0;
        while j < 8 {
            t[k][j] = GRID[k][j] as f32;
            j += 1;
        }
        k += 1;
    }
    t
};

/// KSIGNS expanded to per-value f32 sign-bit masks (XOR into a value to negate it).
static SIGN_MASKS: [[u32; 8]; 128] = {
    let mut t = [[0u32; 8]; 128];
    let mut s = 0;
    while s < 128 {
        let mut j = 0;
        while j < 8 {
            if KSIGNS[s] & (1 << j) != 0 {
                t[s][j] = 0x8000_0000;
            }
            j += 1;
        }
        s += 1;
    }
    t
};

#[inline(always)]
fn group_words(block: &[u8; BLOCK_BYTES], g: usize) -> (u32, u32) {
    let o = 2 + 8 * g;
    let w0 = u32::from_le_bytes([block[o], block[o + 1], block[o + 2], block[o + 3]]);
    let w1 = u32::from_le_bytes([block[o + 4], block[o + 5], block[o + 6], block[o + 7]]);
    (w0, w1)
}

/// Dequantize one block, bit-exact with gguf-py: `(d·(0.5+ls))·0.25`, times the lattice
/// value, times ±1.
#[inline]
pub fn dequantize_block(block: &[u8; BLOCK_BYTES], out: &mut [f32; BLOCK_ELEMS]) {
    let d = f16_at(block, 0);
    for g in 0..8 {
        let (w0, w1) = group_words(block, g);
        let db = d * (0.5 + (w1 >> 28) as f32) * 0.25;
        for k in 0..4 {
            let grid = &GRID_F32[((w0 >> (8 * k)) & 0xFF) as usize];
            let signs = &SIGN_MASKS[((w1 >> (7 * k)) & 0x7F) as usize];
            let o = &mut out[32 * g + 8 * k..][..8];
            for j in 0..8 {
                o[j] = f32::from_bits((db * grid[j]).to_bits() ^ signs[j]);
            }
        }
    }
}

/// Dot product of one block with 256 values of `x`: each dequantized value (computed as
/// in [`dequantize_block`]) times x, accumulated in f32 over 8 lanes.
#[inline]
pub fn dot_block(block: &[u8; BLOCK_BYTES], x: &[f32; BLOCK_ELEMS]) -> f32 {
    let d = f16_at(block, 0);
    let mut acc = [0f32; 8];
    for g in 0..8 {
        let (w0, w1) = group_words(block, g);
        let db = d * (0.5 + (w1 >> 28) as f32) * 0.25;
        for k in 0..4 {
            let grid = &GRID_F32[((w0 >> (8 * k)) & 0xFF) as usize];
            let signs = &SIGN_MASKS[((w1 >> (7 * k)) & 0x7F) as usize];
            let xs = &x[32 * g + 8 * k..][..8];
            for j in 0..8 {
                let y = f32::from_bits((db * grid[j]).to_bits() ^ signs[j]);
                acc[j] += y * xs[j];
            }
        }
    }
    hsum(&acc)
}

pub(crate) fn dequantize_row(data: &[u8], out: &mut [f32]) {
    super::dequantize_blocks(data, out, dequantize_block);
}

pub(crate) fn dot_row_unchecked(data: &[u8], x: &[f32]) -> f32 {
    super::dot_blocks(data, x, dot_block)
}

/// Dot product of a whole IQ2_XXS row with `x` (see [`super::dot`] for the accumulation).
pub fn dot_row(data: &[u8], x: &[f32]) -> Result<f32, QuantError> {
    super::dot(GgmlType::Iq2Xxs, data, x)
}

// ---------------------------------------------------------------------------------------
// Quantizer (ggml's `quantize_row_iq2_xxs_impl` as ds4's quants.c has it).

/// What the quantizer knows about an 8-tuple of 2-bit value indices `u` (value i in bits
/// 2i..2i+1), indexed by `u` itself.
#[derive(Clone, Copy)]
enum Slot {
    /// `u` is lattice point `idx`.
    OnGrid(u8),
    /// `u` is off the lattice; its candidates (the two nearest distance shells) are
    /// `neighbours[start..start + len]`.
    Near { start: u32, len: u16 },
    /// `u` uses index 3, which the quantizer never produces.
    Unreachable,
}

struct Search {
    /// Lattice points in quantizer units: value index l stands for 2l+1 (1, 3, 5).
    points: [[i8; 8]; 256],
    slots: Vec<Slot>,
    neighbours: Vec<u8>,
}

/// Built once (about 6,300 off-lattice tuples × 256 distances), on first use.
fn search() -> &'static Search {
    static S: OnceLock<Search> = OnceLock::new();
    S.get_or_init(build_search)
}

fn build_search() -> Search {
    let mut points = [[0i8; 8]; 256];
    for (p, &k) in points.iter_mut().zip(&KGRID) {
        for (i, v) in p.iter_mut().enumerate() {
            *v = 2 * ((k >> (2 * i)) & 3) as i8 + 1;
        }
    }
    let mut slots = vec![Slot::Unreachable; 1 << 16];
    for (idx, &k) in KGRID.iter().enumerate() {
        slots[usize::from(k)] = Slot::OnGrid(idx as u8);
    }
    let mut neighbours = Vec::new();
    let mut dist = [(0i32, 0u8); 256];
    for u in 0..=0xAAAAu32 {
        let on_lattice_alphabet = (0..8).all(|i| (u >> (2 * i)) & 3 != 3);
        if !on_lattice_alphabet || !matches!(slots[u as usize], Slot::Unreachable) {
            continue;
        }
        let pos: [i32; 8] = std::array::from_fn(|i| 2 * ((u >> (2 * i)) & 3) as i32 + 1);
        for (j, (d, p)) in dist.iter_mut().zip(&points).enumerate() {
            let d2: i32 = (0..8).map(|i| (i32::from(p[i]) - pos[i]).pow(2)).sum();
            *d = (d2, j as u8);
        }
        // Order by (distance, index) — a total order, so the list is unique.
        dist.sort_unstable();
        let start = neighbours.len() as u32;
        let mut shell_d2 = dist[0].0;
        let mut shells = 1;
        for &(d2, j) in &dist {
            if d2 > shell_d2 {
                if shells == 2 {
                    break;
                }
                shell_d2 = d2;
                shells += 1;
            }
            neighbours.push(j);
        }
        let len = (neighbours.len() as u32 - start) as u16;
        slots[u as usize] = Slot::Near { start, len };
    }
    Search {
        points,
        slots,
        neighbours,
    }
}

impl Search {
    /// Among `candidates`, the lattice point nearest to `xval` at `scale` in `w`-weighted
    /// squared distance (first one wins ties). Writes its value indices into `l`.
    fn best_of(&self, candidates: &[u8], xval: &[f32], w: &[f32], scale: f32, l: &mut [u8]) -> u8 {
        let mut best_d2 = f32::MAX;
        let mut best = candidates.first().copied().unwrap_or(0);
        for &j in candidates {
            let p = &self.points[usize::from(j)];
            let mut d2 = 0f32;
            for i in 0..8 {
                let diff = scale * f32::from(p[i]) - xval[i];
                d2 += w[i] * diff * diff;
            }
            if d2 < best_d2 {
                best_d2 = d2;
                best = j;
            }
        }
        let p = &self.points[usize::from(best)];
        for i in 0..8 {
            l[i] = ((p[i] - 1) / 2) as u8;
        }
        best
    }

    /// The lattice index for the tuple `u`; for an off-lattice tuple, snap to the best
    /// neighbour and overwrite `l` with its indices.
    fn snap(&self, u: u16, xval: &[f32], w: &[f32], scale: f32, l: &mut [u8]) -> u8 {
        match self.slots[usize::from(u)] {
            Slot::OnGrid(idx) => idx,
            Slot::Near { start, len } => {
                let c = &self.neighbours[start as usize..][..usize::from(len)];
                self.best_of(c, xval, w, scale, l)
            }
            // Never produced by the quantizer (indices are clamped to 0..=2); fall back to a
            // search over the whole lattice instead of failing.
            Slot::Unreachable => {
                let all: [u8; 256] = std::array::from_fn(|i| i as u8);
                self.best_of(&all, xval, w, scale, l)
            }
        }
    }
}

/// Pack 8 value indices (each 0..=2 after clamping) into the 16-bit tuple key.
#[inline(always)]
fn tuple_key(l: &[u8]) -> u16 {
    let mut u = 0u16;
    for (i, &v) in l.iter().enumerate().take(8) {
        u |= u16::from(v) << (2 * i);
    }
    u
}

/// Quantize one block with per-value importance `qw` (finite, ≥ 0).
///
/// Per 32-value group: weights `qw·sqrt(σ² + x²)` (σ² = Σx²/256); work on |x| with signs
/// flipped so each 8-tuple has an even number of negatives (the least important value
/// absorbs the parity); start from the qp search, try 13 inverse scales, snap each 8-tuple to
/// the lattice (nearest of two neighbour shells when off it) and keep the best weighted fit;
/// refit once. Then d = max_scale/31 and each group stores a 4-bit scale code.
/// Refuses a block whose f16 `d` would be infinite.
pub fn quantize_block(
    x: &[f32; BLOCK_ELEMS],
    qw: &[f32; BLOCK_ELEMS],
) -> Result<[u8; BLOCK_BYTES], QuantError> {
    const KMAXQ: i32 = 3;
    let s = search();
    let mut q2 = [0u32; 16];
    let mut scales = [0f32; 8];

    let mut sumx2 = 0f32;
    for v in x {
        sumx2 += v * v;
    }
    let sigma2 = sumx2 / 256.0;
    let mut max_scale = 0f32;

    let groups = x.as_chunks::<32>().0.iter().zip(qw.as_chunks::<32>().0);
    for (ib, (xb, qb)) in groups.enumerate() {
        let mut weight = [0f32; 32];
        let mut waux = [0f32; 32];
        for i in 0..32 {
            weight[i] = qb[i] * (sigma2 + xb[i] * xb[i]).sqrt();
            waux[i] = weight[i].sqrt();
        }
        let mut xval = [0f32; 32];
        let mut block_signs = [0u8; 4];
        for k in 0..4 {
            let mut nflip = 0;
            let mut sg = 0u8;
            for i in 0..8 {
                let v = xb[8 * k + i];
                if v >= 0.0 {
                    xval[8 * k + i] = v;
                } else {
                    xval[8 * k + i] = -v;
                    nflip += 1;
                    sg |= 1 << i;
                }
            }
            if nflip % 2 == 1 {
                let mut imin = 0;
                let mut min = weight[8 * k] * xb[8 * k] * xb[8 * k];
                for i in 1..8 {
                    let ax = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i];
                    if ax < min {
                        min = ax;
                        imin = i;
                    }
                }
                xval[8 * k + imin] = -xval[8 * k + imin];
                sg ^= 1 << imin;
            }
            block_signs[k] = sg & 127;
        }

        let mut max = xval[0];
        for &v in &xval[1..] {
            max = cmax(max, v);
        }
        if max < GROUP_MAX_EPS {
            scales[ib] = 0.0;
            continue;
        }

        let mut l = [0u8; 32];
        let mut scale = make_qp(&xval, KMAXQ + 1, &mut l, &weight);
        let eff_max = scale * KMAXQ as f32;
        if eff_max <= 0.0 {
            scales[ib] = 0.0;
            continue;
        }

        let mut best = 0f32;
        let mut laux = [0u8; 32];
        for is in -6i32..=6 {
            let id = ((2 * KMAXQ - 1) as f32 + is as f32 * 0.1) / eff_max;
            let this_scale = 1.0 / id;
            for k in 0..4 {
                let r = 8 * k..8 * k + 8;
                for i in r.clone() {
                    let li = nearest_int(0.5 * (id * xval[i] - 1.0)).clamp(0, KMAXQ - 1);
                    laux[i] = li as u8;
                }
                let u = tuple_key(&laux[r.clone()]);
                s.snap(
                    u,
                    &xval[r.clone()],
                    &waux[r.clone()],
                    this_scale,
                    &mut laux[r],
                );
            }
            let (mut sumqx, mut sumq2) = (0f32, 0f32);
            for i in 0..32 {
                let q = 2.0 * f32::from(laux[i]) + 1.0;
                sumqx += weight[i] * xval[i] * q;
                sumq2 += weight[i] * q * q;
            }
            if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
                scale = sumqx / sumq2;
                best = scale * sumqx;
                l = laux;
            }
        }

        let mut idx = [0u8; 4];
        let mut have_idx = false;
        if scale > 0.0 {
            let id = 1.0 / scale;
            for (k, gi) in idx.iter_mut().enumerate() {
                let r = 8 * k..8 * k + 8;
                let mut lk = [0u8; 8];
                for (j, i) in r.clone().enumerate() {
                    lk[j] = nearest_int(0.5 * (id * xval[i] - 1.0)).clamp(0, KMAXQ - 1) as u8;
                }
                let u = tuple_key(&lk);
                *gi = s.snap(u, &xval[r.clone()], &waux[r.clone()], scale, &mut lk);
                let p = &s.points[usize::from(*gi)];
                for (j, i) in r.enumerate() {
                    l[i] = ((p[j] - 1) / 2) as u8;
                }
            }
            have_idx = true;
            let (mut sumqx, mut sumq2) = (0f32, 0f32);
            for i in 0..32 {
                let q = 2.0 * f32::from(l[i]) + 1.0;
                sumqx += weight[i] * xval[i] * q;
                sumq2 += weight[i] * q * q;
            }
            if sumq2 > 0.0 {
                scale = sumqx / sumq2;
            }
        }

        if scale < 0.0 {
            scale = -scale;
            for bs in &mut block_signs {
                *bs = !*bs & 127;
            }
        }

        for k in 0..4 {
            let grid_index = if have_idx {
                idx[k]
            } else {
                // Only reachable with degenerate arithmetic; look the codes up (or snap them
                // to the lattice) rather than trusting them.
                let r = 8 * k..8 * k + 8;
                let u = tuple_key(&l[r.clone()]);
                s.snap(u, &xval[r.clone()], &waux[r.clone()], scale, &mut l[r])
            };
            q2[2 * ib] |= u32::from(grid_index) << (8 * k);
            q2[2 * ib + 1] |= u32::from(block_signs[k]) << (7 * k);
        }
        scales[ib] = scale;
        max_scale = cmax(max_scale, scale);
    }

    let mut out = [0u8; BLOCK_BYTES];
    if max_scale == 0.0 {
        return Ok(out);
    }
    let d = max_scale / 31.0;
    let hd = scale_to_f16(GgmlType::Iq2Xxs, 0, d)?;
    out[..2].copy_from_slice(&hd.to_le_bytes());
    let id = 1.0 / d;
    for ib in 0..8 {
        let l = nearest_int(0.5 * (id * scales[ib] - 1.0)).clamp(0, 15);
        q2[2 * ib + 1] |= (l as u32) << 28;
    }
    for (o, w) in out[2..].chunks_exact_mut(4).zip(&q2) {
        o.copy_from_slice(&w.to_le_bytes());
    }
    Ok(out)
}

/// Quantize a row (length a multiple of 256, finite values, importance of the same length,
/// finite and ≥ 0; checked by the caller).
pub(crate) fn quantize_row(src: &[f32], importance: &[f32]) -> Result<Vec<u8>, QuantError> {
    let (blocks, _) = src.as_chunks::<BLOCK_ELEMS>();
    let (qws, _) = importance.as_chunks::<BLOCK_ELEMS>();
    let mut out = Vec::with_capacity(blocks.len() * BLOCK_BYTES);
    for (i, (x, qw)) in blocks.iter().zip(qws).enumerate() {
        out.extend_from_slice(&quantize_block(x, qw).map_err(|e| e.at_block(i))?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_consistent_with_the_spec() {
        // Grid values are drawn from {8, 25, 43}, and the packed form says the same.
        let map = [8u8, 25, 43];
        for (k, row) in GRID.iter().enumerate() {
            for (i, &v) in row.iter().enumerate() {
                assert_eq!(
                    v,
                    map[usize::from((KGRID[k] >> (2 * i)) & 3)],
                    "k={k} i={i}"
                );
            }
        }
        // The packed points are distinct and never use index 3.
        let mut seen = std::collections::HashSet::new();
        for &k in &KGRID {
            assert!(seen.insert(k));
            assert!((0..8).all(|i| (k >> (2 * i)) & 3 != 3));
        }
        // ksigns[i] = i | 0x80 when popcount(i) is odd: every pattern has an even number of
        // minus signs.
        for (i, &s) in KSIGNS.iter().enumerate() {
            let want = i as u8
                | if (i as u8).count_ones() % 2 == 1 {
                    0x80
                } else {
                    0
                };
            assert_eq!(s, want, "i={i}");
            assert_eq!(s.count_ones() % 2, 0);
        }
    }

    /// Every reachable off-lattice tuple has candidates, and snapping picks the weighted
    /// nearest of them (checked against a brute-force scan of the same candidate list, and
    /// against the whole lattice's best distance, which the candidate shells must contain).
    #[test]
    fn neighbour_lists_contain_the_nearest_points() {
        let s = search();
        let mut n_off = 0;
        for u in 0..=0xAAAAu32 {
            if (0..8).any(|i| (u >> (2 * i)) & 3 == 3) {
                continue;
            }
            match s.slots[u as usize] {
                Slot::OnGrid(idx) => assert_eq!(u32::from(KGRID[usize::from(idx)]), u),
                Slot::Near { start, len } => {
                    n_off += 1;
                    assert!(len > 0);
                    let pos: [i32; 8] =
                        std::array::from_fn(|i| 2 * ((u >> (2 * i)) & 3) as i32 + 1);
                    let d2 = |j: usize| -> i32 {
                        (0..8)
                            .map(|i| (i32::from(s.points[j][i]) - pos[i]).pow(2))
                            .sum()
                    };
                    let best_all = (0..256).map(d2).min().unwrap();
                    let list = &s.neighbours[start as usize..][..usize::from(len)];
                    assert_eq!(d2(usize::from(list[0])), best_all, "u={u:#x}");
                }
                Slot::Unreachable => panic!("reachable tuple {u:#x} has no slot"),
            }
        }
        assert_eq!(n_off, 6561 - 256);
    }

    /// The documented formula (docs/gguf.md §6): db = d·(0.5 + ls)·0.25, value j of sub-group k =
    /// db · GRID[w0 byte k][j] · (bit j of KSIGNS[s_k] ? −1 : +1).
    #[test]
    fn dequantize_follows_the_spec_formula() {
        let mut b = [0u8; BLOCK_BYTES];
        for (i, v) in b.iter_mut().enumerate() {
            *v = (i as u8).wrapping_mul(97).wrapping_add(11);
        }
        b[0..2].copy_from_slice(&[0x00, 0x3c]); // d = 1
        let mut y = [0f32; 256];
        dequantize_block(&b, &mut y);
        for g in 0..8 {
            let w0 = u32::from_le_bytes(b[2 + 8 * g..6 + 8 * g].try_into().unwrap());
            let w1 = u32::from_le_bytes(b[6 + 8 * g..10 + 8 * g].try_into().unwrap());
            let db = (0.5 + (w1 >> 28) as f32) * 0.25;
            for k in 0..4 {
                let grid = GRID[((w0 >> (8 * k)) & 255) as usize];
                let signs = KSIGNS[((w1 >> (7 * k)) & 127) as usize];
                for j in 0..8 {
                    let sign = if signs & (1 << j) != 0 { -1.0 } else { 1.0 };
                    assert_eq!(y[32 * g + 8 * k + j], db * f32::from(grid[j]) * sign);
                }
            }
        }
    }
}
