//! The encodings of DeepSeek's official V4 checkpoint (docs/gguf.md §5.5), decoded exactly.
//!
//! Dense matrices are FP8 E4M3 with one E8M0 scale per 128 × 128 tile (`<name>.scale`, shape
//! `(⌈out/128⌉, ⌈in/128⌉)`); routed experts are FP4 E2M1 packed two per byte in an `I8` tensor
//! of shape `(out, in/2)` (low nibble = even column) with one E8M0 scale per 32 inputs
//! (`(out, ⌈in/32⌉)`). An E8M0 scale is a bare power of two, so `code · scale` needs no rounding
//! in f32 as long as it stays finite: the converter works on exactly the values DeepSeek trained,
//! and its f32 output is bit-identical to any other exact dequantizer (the oracle's NumPy one).
//!
//! Edge values, per the spec: E4M3 has no infinities; its exponent field 0 is subnormal
//! (`m · 2⁻⁹`); its NaN codes 0x7F/0xFF decode to +0, as ds4's own converter does (a trained
//! checkpoint has none; keeping ds4's choice keeps the bytes identical to its output). E8M0
//! byte `s` is `2^(s−127)`, so `s = 0` is `2⁻¹²⁷` (an f32 subnormal, still exact); `s = 0xFF` is
//! NaN in the OCP format and is refused, as is any product that overflows f32.

/// Edge length of an FP8 scale tile (both axes).
pub const FP8_BLOCK: u64 = 128;
/// Inputs per FP4 scale.
pub const FP4_BLOCK: u64 = 32;

/// E2M1 code → value (codes 8–15 are the negatives of 0–7; code 8 is −0).
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// One E4M3 (`fn` variant: bias 7, no infinities) byte as f32; both NaN codes give +0.
pub fn e4m3_to_f32(b: u8) -> f32 {
    if b & 0x7F == 0x7F {
        return 0.0;
    }
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0x0F);
    let man = f32::from(b & 0x07);
    let mag = match exp {
        0 => man * (2f32).powi(-9),
        _ => (1.0 + man / 8.0) * (2f32).powi(exp - 7),
    };
    sign * mag
}

/// One E8M0 byte as the power of two it encodes; `None` for 0xFF (NaN).
pub fn e8m0_to_f32(s: u8) -> Option<f32> {
    match s {
        0xFF => None,
        // 2^-127 is the f32 subnormal with only bit 22 of the mantissa set.
        0 => Some(f32::from_bits(1 << 22)),
        _ => Some(f32::from_bits(u32::from(s) << 23)),
    }
}

/// How a checkpoint tensor's bytes become values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Encoding {
    /// F32, BF16, F16 or an integer type, one element per stored element.
    Plain,
    /// FP8 E4M3 codes, one byte per element, with a 128 × 128-tile E8M0 scale tensor.
    Fp8 { scale: ScaleRef },
    /// FP4 E2M1 codes, two per byte (low nibble first), with a per-32-inputs E8M0 scale tensor.
    Fp4 { scale: ScaleRef },
}

/// Where a weight's E8M0 scale tensor lies (validated against the weight's shape).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScaleRef {
    pub name: String,
    /// Scale rows and columns.
    pub rows: u64,
    pub cols: u64,
    pub(crate) file: usize,
    pub(crate) start: usize,
    pub(crate) end: usize,
}

/// Decodes flat elements `first .. first + out.len()` of a scaled tensor whose logical shape is
/// `(rows, cols)`. `codes` are the tensor's stored bytes, `scales` its scale tensor's bytes.
/// Errors name the element at fault (a NaN scale, or a value past f32's range).
pub(crate) fn decode_scaled(
    fp4: bool,
    cols: u64,
    scale_cols: u64,
    codes: &[u8],
    scales: &[u8],
    first: u64,
    out: &mut [f32],
) -> Result<(), String> {
    let (br, bc) = if fp4 {
        (1, FP4_BLOCK)
    } else {
        (FP8_BLOCK, FP8_BLOCK)
    };
    let mut i = first;
    let mut k = 0usize;
    while k < out.len() {
        let (r, c0) = (i / cols, i % cols);
        // The rest of this row, or what is left of the request.
        let n = ((cols - c0) as usize).min(out.len() - k);
        let srow = (r / br) * scale_cols;
        for (j, o) in out[k..k + n].iter_mut().enumerate() {
            let c = c0 + j as u64;
            let s_at = (srow + c / bc) as usize;
            let sbyte = *scales
                .get(s_at)
                .ok_or_else(|| format!("scale element {s_at} is past the scale tensor"))?;
            let scale = e8m0_to_f32(sbyte).ok_or_else(|| {
                format!(
                    "scale [{}, {}] (of element [{r}, {c}]) is 0xFF, NaN in E8M0",
                    s_at as u64 / scale_cols,
                    s_at as u64 % scale_cols
                )
            })?;
            let v = if fp4 {
                let flat = r * cols + c;
                let byte = *codes
                    .get((flat / 2) as usize)
                    .ok_or_else(|| format!("element [{r}, {c}] is past the stored bytes"))?;
                let nib = if flat.is_multiple_of(2) {
                    byte & 0x0F
                } else {
                    byte >> 4
                };
                E2M1[nib as usize]
            } else {
                let byte = *codes
                    .get((r * cols + c) as usize)
                    .ok_or_else(|| format!("element [{r}, {c}] is past the stored bytes"))?;
                e4m3_to_f32(byte)
            };
            let y = v * scale;
            if !y.is_finite() {
                return Err(format!(
                    "element [{r}, {c}] = {v} · 2^{} overflows f32",
                    i32::from(sbyte) - 127
                ));
            }
            *o = y;
        }
        k += n;
        i += n as u64;
    }
    Ok(())
}

/// The MXFP4 blocks (docs/gguf.md §6) of a packed-FP4 matrix of `cols` values per row
/// (a multiple of 32): the release's own codes and scales, bit for bit. The release's FP4 is
/// MXFP4: element value `E2M1(code) · 2^(s − 127)` is ggml's `kv(code) · 2^(s − 128)` with the
/// same code (ggml keeps the E2M1 values doubled) and the same scale byte `s`, so each block is
/// the row's scale byte for those 32 values, then the 32 codes re-paired: ggml's byte `j` holds
/// element `j` (low nibble) and `j + 16` (high), the release's byte `i` elements `2i` (low)
/// and `2i + 1` (high). `codes` and `scales` hold whole rows; no check of the values
/// ([`decode_scaled`] refuses NaN scales and overflow).
pub(crate) fn fp4_to_mxfp4(cols: u64, codes: &[u8], scales: &[u8], out: &mut Vec<u8>) {
    let blocks = (cols / FP4_BLOCK) as usize;
    for (row, srow) in codes
        .chunks_exact(cols as usize / 2)
        .zip(scales.chunks_exact(blocks))
    {
        for (b, &s) in row.chunks_exact(16).zip(srow) {
            let code = |k: usize| (b[k / 2] >> (4 * (k % 2))) & 0x0F;
            out.push(s);
            out.extend((0..16).map(|j| code(j) | (code(j + 16) << 4)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every E4M3 code against the format's definition written the other way round:
    /// sign · 2^(e−7) · (1 + m/8), subnormal 2^−6 · m/8.
    #[test]
    fn e4m3_matches_its_definition() {
        for b in 0..=255u8 {
            let s = if b >= 128 { -1.0f64 } else { 1.0 };
            let e = ((b >> 3) & 15) as i32;
            let m = (b & 7) as f64;
            let want = if e == 15 && m == 7.0 {
                0.0
            } else if e == 0 {
                s * (m / 8.0) * 2f64.powi(-6)
            } else {
                s * (1.0 + m / 8.0) * 2f64.powi(e - 7)
            };
            assert_eq!(e4m3_to_f32(b) as f64, want, "code {b:#04x}");
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0xFF).to_bits(), 0, "NaN codes give +0");
    }

    /// The repacked blocks dequantize (ggml's MXFP4 decode) to exactly the release's values,
    /// every code and scale byte kept.
    #[test]
    fn fp4_blocks_become_mxfp4_blocks_of_the_same_values() {
        use ds4_gguf::{quant, GgmlType};
        let cols = 64u64;
        let codes: Vec<u8> = (0..2 * cols as usize / 2)
            .map(|i| (i * 37 + 11) as u8)
            .collect();
        let scales = [120u8, 127, 131, 118];
        let mut blocks = Vec::new();
        fp4_to_mxfp4(cols, &codes, &scales, &mut blocks);
        assert_eq!(blocks.len(), 4 * 17);
        assert_eq!([blocks[0], blocks[17], blocks[34], blocks[51]], scales);
        let mut want = vec![0f32; 2 * cols as usize];
        decode_scaled(true, cols, 2, &codes, &scales, 0, &mut want).unwrap();
        let mut got = vec![0f32; want.len()];
        quant::dequantize(GgmlType::Mxfp4, &blocks, &mut got).unwrap();
        // Equal values (the release's code 8 reads -0, ggml's +0).
        assert_eq!(got, want);
        assert!(codes.iter().any(|b| b & 15 == 8 || b >> 4 == 8));
    }

    #[test]
    fn e8m0_edges() {
        assert_eq!(e8m0_to_f32(127), Some(1.0));
        assert_eq!(e8m0_to_f32(0).map(f64::from), Some(2f64.powi(-127)));
        assert_eq!(e8m0_to_f32(1).map(f64::from), Some(2f64.powi(-126)));
        assert_eq!(e8m0_to_f32(254).map(f64::from), Some(2f64.powi(127)));
        assert_eq!(e8m0_to_f32(255), None);
    }

    #[test]
    fn products_are_exact_and_overflow_is_refused() {
        // Smallest E4M3 subnormal times the smallest scale: 2^-136, an exact f32 subnormal.
        let mut out = [0f32; 2];
        decode_scaled(false, 2, 1, &[0x01, 0x81], &[0], 0, &mut out).unwrap();
        assert_eq!(out[0] as f64, 2f64.powi(-136));
        assert_eq!(out[1] as f64, -(2f64.powi(-136)));
        // 448 · 2^127 overflows.
        let err = decode_scaled(false, 2, 1, &[0x7E, 0], &[254], 0, &mut out).unwrap_err();
        assert!(err.contains("overflows"), "{err}");
        let err = decode_scaled(false, 2, 1, &[0, 0], &[255], 0, &mut out).unwrap_err();
        assert!(err.contains("NaN"), "{err}");
        // FP4: low nibble first.
        let mut out = [0f32; 4];
        decode_scaled(true, 4, 1, &[0x21, 0xF7], &[128], 0, &mut out).unwrap();
        assert_eq!(out, [1.0, 2.0, 12.0, -12.0]);
    }
}
