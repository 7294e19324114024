//! ggml block codecs for the element types ds4 files use: dequantize to f32, a reference dot
//! product with an f32 vector, and quantizers.
//!
//! Layouts and formulas follow `docs/gguf.md` §6. The dequantizers are
//! bit-exact with PyPI `gguf` 0.19 (`gguf.quants.dequantize`): each element is computed with
//! the same f32 operations in the same order (checked by `tests/codec_crosscheck.rs` on
//! committed vectors made by `tools/codecs/gen_codec_vectors.py`).
//!
//! # Dot products
//! [`dot`] and the per-format `dot_row` kernels compute each element's dequantized value
//! exactly as the dequantizer does, multiply by `x` and accumulate **in f32 over runs of 256
//! elements** (one super-block for Q2_K/Q4_K/IQ2_XXS, 8 blocks for Q8_0/MXFP4, 256 elements for
//! the plain types F32/F16/BF16/I32), in 8 or 16 independent lanes so the loop vectorizes;
//! the lanes are added at the end of the run. Run partial sums are then **added in f64** and
//! the total is rounded to f32 once, so long rows do not lose precision to a single f32
//! accumulator. No call allocates.
//!
//! # Quantizers
//! Q8_0 and MXFP4 are bit-exact with `gguf.quants.quantize`. Q2_K, Q4_K and IQ2_XXS follow
//! ggml's reference search procedures as ds4's `gguf-tools/quants.c` uses them (docs/gguf.md §6.1).
//! Inputs must be finite; a block whose scale would not fit in f16 is refused rather than
//! written as inf (see [`QuantError`]).

use crate::types::GgmlType;

pub mod bf16;
pub mod f16;
pub mod iq2_xxs;
pub mod iq2xxs_tables;
pub mod mxfp4;
pub mod plain;
pub mod q2_k;
pub mod q4_k;
pub mod q8_0;
pub mod q8act;
mod search;

/// Why a codec call was refused. Every variant names the type and the numbers involved.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuantError {
    /// The byte buffer does not hold exactly the requested number of elements.
    #[error("{ty}: {elems} elements need {expected} bytes, found {found}")]
    LengthMismatch {
        ty: GgmlType,
        elems: usize,
        expected: u64,
        found: usize,
    },
    /// The element count is not a whole number of blocks.
    #[error("{ty}: {elems} elements is not a multiple of the block size {block}")]
    NotBlockMultiple {
        ty: GgmlType,
        elems: usize,
        block: u64,
    },
    /// Two slices that must have the same length do not (e.g. `x` vs the output, or the
    /// importance vector vs the source).
    #[error("{ty}: {what} has {found} elements, expected {expected}")]
    SizeMismatch {
        ty: GgmlType,
        what: &'static str,
        expected: usize,
        found: usize,
    },
    /// The type has no codec for this operation (unknown type code, or no quantizer).
    #[error("{ty}: {op} is not supported for this type")]
    Unsupported { ty: GgmlType, op: &'static str },
    /// A quantizer input is NaN or infinite; block formats cannot carry it meaningfully.
    #[error("{ty}: input element {index} is {value}, which is not finite")]
    NonFinite {
        ty: GgmlType,
        index: usize,
        value: f32,
    },
    /// An importance value is negative or not finite.
    #[error("{ty}: importance element {index} is {value}; it must be finite and >= 0")]
    BadImportance {
        ty: GgmlType,
        index: usize,
        value: f32,
    },
    /// A block's f16 scale would overflow (the block's values are too large for the type).
    #[error("{ty}: block {block} needs a scale of {scale:e}, which does not fit in f16")]
    ScaleOverflow {
        ty: GgmlType,
        block: usize,
        scale: f32,
    },
    /// A value cannot be stored in the plain target type without becoming infinite or
    /// (for I32) without losing its value.
    #[error("{ty}: element {index} = {value:e} cannot be represented")]
    NotRepresentable {
        ty: GgmlType,
        index: usize,
        value: f32,
    },
}

impl QuantError {
    /// Re-number a block-level error for its position in a row or matrix.
    pub(crate) fn at_block(self, block: usize) -> Self {
        match self {
            QuantError::ScaleOverflow { ty, scale, .. } => {
                QuantError::ScaleOverflow { ty, block, scale }
            }
            other => other,
        }
    }
}

/// Check that `data` holds exactly `elems` elements of `ty`; returns the block count.
fn check_data(ty: GgmlType, data_len: usize, elems: usize) -> Result<usize, QuantError> {
    let (Some(be), Some(_)) = (ty.block_elems(), ty.block_bytes()) else {
        return Err(QuantError::Unsupported {
            ty,
            op: "dequantize",
        });
    };
    if !(elems as u64).is_multiple_of(be) {
        return Err(QuantError::NotBlockMultiple {
            ty,
            elems,
            block: be,
        });
    }
    // bytes_for only fails on u64 overflow, which a usize element count cannot reach on
    // 64-bit hosts; report it as a mismatch rather than panicking anyway.
    let expected = ty.bytes_for(elems as u64).unwrap_or(u64::MAX);
    if expected != data_len as u64 {
        return Err(QuantError::LengthMismatch {
            ty,
            elems,
            expected,
            found: data_len,
        });
    }
    Ok((elems as u64 / be) as usize)
}

/// Dequantize `out.len()` elements of type `ty` from `data` into `out`.
///
/// `data.len()` must equal `ty.bytes_for(out.len())` and `out.len()` must be a whole number
/// of blocks. I32 elements are converted to the nearest f32 (ties to even), as numpy's
/// `astype(float32)` does.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    check_data(ty, data.len(), out.len())?;
    match ty {
        GgmlType::F32 => plain::dequantize_f32(data, out),
        GgmlType::I32 => plain::dequantize_i32(data, out),
        GgmlType::F16 => f16::dequantize_row(data, out),
        GgmlType::Bf16 => bf16::dequantize_row(data, out),
        GgmlType::Q8_0 => q8_0::dequantize_row(data, out),
        GgmlType::Q2K => q2_k::dequantize_row(data, out),
        GgmlType::Q4K => q4_k::dequantize_row(data, out),
        GgmlType::Iq2Xxs => iq2_xxs::dequantize_row(data, out),
        GgmlType::Mxfp4 => mxfp4::dequantize_row(data, out),
        GgmlType::Unknown(_) => {
            return Err(QuantError::Unsupported {
                ty,
                op: "dequantize",
            })
        }
    }
    Ok(())
}

/// Dot product of one row of `ty` data (`x.len()` elements) with `x`.
///
/// Accumulation: f32 within each 256-element run (lane-parallel), run sums added in f64,
/// result rounded to f32 once (see the module docs). No allocation; this is the reference kernel
/// the CPU engine's matvec calls per row.
pub fn dot(ty: GgmlType, data: &[u8], x: &[f32]) -> Result<f32, QuantError> {
    check_data(ty, data.len(), x.len()).map_err(|e| match e {
        QuantError::Unsupported { ty, .. } => QuantError::Unsupported { ty, op: "dot" },
        other => other,
    })?;
    Ok(match ty {
        GgmlType::F32 => plain::dot_f32(data, x),
        GgmlType::I32 => plain::dot_i32(data, x),
        GgmlType::F16 => f16::dot_row_unchecked(data, x),
        GgmlType::Bf16 => bf16::dot_row_unchecked(data, x),
        GgmlType::Q8_0 => q8_0::dot_row_unchecked(data, x),
        GgmlType::Q2K => q2_k::dot_row_unchecked(data, x),
        GgmlType::Q4K => q4_k::dot_row_unchecked(data, x),
        GgmlType::Iq2Xxs => iq2_xxs::dot_row_unchecked(data, x),
        GgmlType::Mxfp4 => mxfp4::dot_row_unchecked(data, x),
        GgmlType::Unknown(_) => return Err(QuantError::Unsupported { ty, op: "dot" }),
    })
}

/// Validate quantizer inputs common to every quantized type.
fn check_quant_input(
    ty: GgmlType,
    src: &[f32],
    importance: Option<&[f32]>,
) -> Result<(), QuantError> {
    let be = ty
        .block_elems()
        .ok_or(QuantError::Unsupported { ty, op: "quantize" })?;
    if !(src.len() as u64).is_multiple_of(be) {
        return Err(QuantError::NotBlockMultiple {
            ty,
            elems: src.len(),
            block: be,
        });
    }
    if let Some(imp) = importance {
        if imp.len() != src.len() {
            return Err(QuantError::SizeMismatch {
                ty,
                what: "importance",
                expected: src.len(),
                found: imp.len(),
            });
        }
        check_importance(ty, imp)?;
    }
    if ty.is_quantized() {
        if let Some((index, &value)) = src.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(QuantError::NonFinite { ty, index, value });
        }
    }
    Ok(())
}

fn check_importance(ty: GgmlType, imp: &[f32]) -> Result<(), QuantError> {
    match imp
        .iter()
        .enumerate()
        .find(|(_, v)| !(v.is_finite() && **v >= 0.0))
    {
        Some((index, &value)) => Err(QuantError::BadImportance { ty, index, value }),
        None => Ok(()),
    }
}

/// Quantize `src` (a whole number of blocks, treated as **one row**) to `ty`'s bytes.
///
/// * F32: the bits as they are. F16: round to nearest even; NaN and ±inf are kept, but a
///   finite value that would round to ±inf is refused. BF16: ggml's rounding (nearest even,
///   NaN made quiet); finite values that would round to ±inf are refused. I32: only values
///   that are exact integers in i32 range are accepted (an exact cast), anything else is
///   refused.
/// * Q8_0 and MXFP4: bit-exact with `gguf.quants.quantize`; `importance` is checked but
///   unused.
/// * Q2_K / Q4_K: `None` runs ggml's plain reference search; `Some(w)` runs the imatrix
///   (weighted) search with `w` as the per-element importance.
/// * IQ2_XXS always needs importance. `None` uses ds4's synthetic default, the column energy
///   `sum over rows of x²`; for this single-row call that is `x[i]²` per element. Use
///   [`quantize_matrix`] to get ds4's behaviour over a whole matrix.
///
/// `importance`, when given, must have `src.len()` finite, non-negative values.
pub fn quantize(
    ty: GgmlType,
    src: &[f32],
    importance: Option<&[f32]>,
) -> Result<Vec<u8>, QuantError> {
    check_quant_input(ty, src, importance)?;
    match ty {
        GgmlType::F32 => Ok(plain::quantize_f32(src)),
        GgmlType::I32 => plain::quantize_i32(src),
        GgmlType::F16 => f16::quantize_row(src),
        GgmlType::Bf16 => bf16::quantize_row(src),
        GgmlType::Q8_0 => q8_0::quantize_row(src),
        GgmlType::Mxfp4 => mxfp4::quantize_row(src),
        GgmlType::Q2K => q2_k::quantize_row(src, importance),
        GgmlType::Q4K => q4_k::quantize_row(src, importance),
        GgmlType::Iq2Xxs => match importance {
            Some(imp) => iq2_xxs::quantize_row(src, imp),
            None => {
                let synthetic: Vec<f32> = src.iter().map(|v| v * v).collect();
                iq2_xxs::quantize_row(src, &synthetic)
            }
        },
        GgmlType::Unknown(_) => Err(QuantError::Unsupported { ty, op: "quantize" }),
    }
}

/// Quantize a row-major matrix of `n_cols` columns the way ds4's `deepseek4-quantize` does:
/// `column_importance` (length `n_cols`, e.g. one imatrix entry) applies to every row.
/// For IQ2_XXS without importance, ds4's synthetic column energy
/// `imp[c] = sum over rows r of src[r][c]²` (accumulated in f32, row order) is used.
pub fn quantize_matrix(
    ty: GgmlType,
    src: &[f32],
    n_cols: usize,
    column_importance: Option<&[f32]>,
) -> Result<Vec<u8>, QuantError> {
    let be = ty
        .block_elems()
        .ok_or(QuantError::Unsupported { ty, op: "quantize" })?;
    if n_cols == 0 || !(n_cols as u64).is_multiple_of(be) {
        return Err(QuantError::NotBlockMultiple {
            ty,
            elems: n_cols,
            block: be,
        });
    }
    if !src.len().is_multiple_of(n_cols) {
        return Err(QuantError::SizeMismatch {
            ty,
            what: "source (not a whole number of rows)",
            expected: src.len() / n_cols * n_cols,
            found: src.len(),
        });
    }
    if let Some(imp) = column_importance {
        if imp.len() != n_cols {
            return Err(QuantError::SizeMismatch {
                ty,
                what: "column importance",
                expected: n_cols,
                found: imp.len(),
            });
        }
        check_importance(ty, imp)?;
    }
    check_quant_input(ty, src, None)?;
    let synthetic;
    let imp: Option<&[f32]> = match (column_importance, ty) {
        (Some(imp), _) => Some(imp),
        (None, GgmlType::Iq2Xxs) => {
            let mut acc = vec![0f32; n_cols];
            for row in src.chunks_exact(n_cols) {
                for (a, v) in acc.iter_mut().zip(row) {
                    *a += v * v;
                }
            }
            synthetic = acc;
            Some(&synthetic)
        }
        (None, _) => None,
    };
    let row_bytes = ty.row_bytes(n_cols as u64).unwrap_or(0) as usize;
    let mut out = Vec::with_capacity(row_bytes * (src.len() / n_cols));
    for (r, row) in src.chunks_exact(n_cols).enumerate() {
        let bytes = match (ty, imp) {
            (GgmlType::Q2K, _) => q2_k::quantize_row(row, imp),
            (GgmlType::Q4K, _) => q4_k::quantize_row(row, imp),
            (GgmlType::Iq2Xxs, Some(imp)) => iq2_xxs::quantize_row(row, imp),
            _ => quantize(ty, row, None),
        };
        // Block numbers in errors refer to the whole matrix.
        let bytes = bytes.map_err(|e| match e {
            QuantError::ScaleOverflow { ty, block, scale } => QuantError::ScaleOverflow {
                ty,
                block: block + r * (n_cols / be as usize),
                scale,
            },
            QuantError::NotRepresentable { ty, index, value } => QuantError::NotRepresentable {
                ty,
                index: index + r * n_cols,
                value,
            },
            other => other,
        })?;
        out.extend_from_slice(&bytes);
    }
    Ok(out)
}

/// Read the little-endian f16 at `b[off..off + 2]` and widen it to f32.
#[inline(always)]
fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::f16_to_f32(u16::from_le_bytes([b[off], b[off + 1]]))
}

/// Sum of a lane-parallel accumulator's lanes, in lane order.
#[inline(always)]
fn hsum<const L: usize>(acc: &[f32; L]) -> f32 {
    acc.iter().sum()
}

/// Dequantizes a row of `B`-byte blocks of `E` elements, block by block (`out` as long as
/// the row; any excess on either side is ignored).
#[inline(always)]
fn dequantize_blocks<const B: usize, const E: usize>(
    data: &[u8],
    out: &mut [f32],
    block: impl Fn(&[u8; B], &mut [f32; E]),
) {
    let (blocks, _) = data.as_chunks::<B>();
    let (outs, _) = out.as_chunks_mut::<E>();
    for (b, o) in blocks.iter().zip(outs) {
        block(b, o);
    }
}

/// Row dot product of `B`-byte blocks of `E` elements with `x`: `block_into` adds each
/// block's products into `L` f32 lanes that run over `RUN` blocks before one horizontal add,
/// and the runs' sums are added in f64 (any excess on either side is ignored, never read out
/// of bounds).
#[inline(always)]
fn dot_runs<const B: usize, const E: usize, const L: usize, const RUN: usize>(
    data: &[u8],
    x: &[f32],
    block_into: impl Fn(&[u8; B], &[f32; E], &mut [f32; L]),
) -> f32 {
    let (blocks, _) = data.as_chunks::<B>();
    let (xs, _) = x.as_chunks::<E>();
    let mut total = 0f64;
    for (run, xrun) in blocks.chunks(RUN).zip(xs.chunks(RUN)) {
        let mut acc = [0f32; L];
        for (b, xb) in run.iter().zip(xrun) {
            block_into(b, xb, &mut acc);
        }
        total += f64::from(hsum(&acc));
    }
    total as f32
}

/// Row dot product of `B`-byte blocks of `E` elements with `x` for types whose block dot
/// (`block`) sums a whole super-block in f32: the blocks' sums are added in f64 (any excess
/// on either side is ignored, never read out of bounds).
#[inline(always)]
fn dot_blocks<const B: usize, const E: usize>(
    data: &[u8],
    x: &[f32],
    block: impl Fn(&[u8; B], &[f32; E]) -> f32,
) -> f32 {
    let (blocks, _) = data.as_chunks::<B>();
    let (xs, _) = x.as_chunks::<E>();
    let mut total = 0f64;
    for (b, xb) in blocks.iter().zip(xs) {
        total += f64::from(block(b, xb));
    }
    total as f32
}

/// Round an f32 scale to f16 bits, refusing a result that is not finite.
fn scale_to_f16(ty: GgmlType, block: usize, scale: f32) -> Result<u16, QuantError> {
    let h = f16::f32_to_f16(scale);
    if h & 0x7c00 == 0x7c00 {
        return Err(QuantError::ScaleOverflow { ty, block, scale });
    }
    Ok(h)
}
