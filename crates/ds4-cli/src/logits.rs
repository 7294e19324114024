//! `ds4 logits`: the raw next-token logits of a token sequence, for checking this engine
//! against another implementation position by position (HF transformers, ds4, another
//! backend). Samplers, chat parsing and streaming are bypassed on purpose: what comes out is
//! exactly what the forward pass produced.
//!
//! The first `decode_from` tokens are prefilled in one [`Engine::eval`] call (in chunks of
//! the engine's prefill chunk) that returns every position's logits; the rest are fed one
//! token at a time, as decoding does. So one run can compare the prefill and decode paths
//! with each other and with a reference.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context};
use ds4_engine::{Engine, Logits};
use serde::Serialize;

/// Logits of `tokens`: `[tokens.len(), n_vocab]` row-major; row `i` is the distribution
/// after token `i`. Rows `0..decode_from` come from one prefill, the rest from one-token
/// decode steps. The engine's context must hold `tokens.len()` tokens.
pub fn compute(
    engine: &mut Engine,
    tokens: &[u32],
    decode_from: usize,
) -> anyhow::Result<Vec<f32>> {
    if tokens.is_empty() {
        bail!("no tokens to evaluate");
    }
    if decode_from > tokens.len() {
        bail!(
            "--decode-from {decode_from} is past the end of the {} tokens",
            tokens.len()
        );
    }
    let mut state = engine.new_state_with_ctx(tokens.len())?;
    let result = (|| {
        let mut out = Vec::new();
        if decode_from > 0 {
            out = engine.eval(&mut state, &tokens[..decode_from], Logits::All, None)?;
        }
        for &t in &tokens[decode_from..] {
            out.extend(engine.eval(&mut state, &[t], Logits::Last, None)?);
        }
        Ok(out)
    })();
    engine.free_state(state);
    result
}

/// Writes a float32 `[rows, cols]` C-order array in NumPy's `.npy` format (version 1.0), the
/// format `numpy.load` and most array tools read without any help.
///
/// Layout: the magic `\x93NUMPY`, version bytes 1 0, a little-endian u16 header length, then
/// a Python dict literal giving dtype, order and shape, padded with spaces and ended by a
/// newline so the data starts at a multiple of 64 bytes; then the raw little-endian values.
pub fn write_npy_f32(
    out: &mut dyn Write,
    rows: usize,
    cols: usize,
    data: &[f32],
) -> std::io::Result<()> {
    if rows.checked_mul(cols) != Some(data.len()) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} values do not make a [{rows}, {cols}] array", data.len()),
        ));
    }
    let dict = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    // 6 magic + 2 version + 2 length bytes, the dict, spaces, and the final '\n'.
    let unpadded = 10 + dict.len() + 1;
    let pad = unpadded.div_ceil(64) * 64 - unpadded;
    let header_len = dict.len() + pad + 1;
    let header_len = u16::try_from(header_len).map_err(|_| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "npy header too long")
    })?;
    out.write_all(b"\x93NUMPY\x01\x00")?;
    out.write_all(&header_len.to_le_bytes())?;
    out.write_all(dict.as_bytes())?;
    out.write_all(&vec![b' '; pad])?;
    out.write_all(b"\n")?;
    let mut buf = Vec::with_capacity(data.len().min(1 << 20) * 4);
    for chunk in data.chunks(1 << 20) {
        buf.clear();
        for v in chunk {
            buf.extend_from_slice(&v.to_le_bytes());
        }
        out.write_all(&buf)?;
    }
    Ok(())
}

/// [`write_npy_f32`] to a file (created or replaced).
pub fn save_npy_f32(path: &Path, rows: usize, cols: usize, data: &[f32]) -> anyhow::Result<()> {
    let f = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = std::io::BufWriter::new(f);
    write_npy_f32(&mut w, rows, cols, data)
        .and_then(|()| w.flush())
        .with_context(|| format!("writing {}", path.display()))
}

/// One candidate of a position's top-K list.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopEntry {
    pub id: u32,
    /// Natural-log probability (log-softmax of the row, computed in f64).
    pub logprob: f64,
}

/// One position's top-K list.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopRow {
    /// Position in the token sequence (the logits after this token).
    pub pos: usize,
    /// The token at `pos`.
    pub token: u32,
    /// `"prefill"` or `"decode"`: which path produced the row.
    pub path: &'static str,
    pub top: Vec<TopEntry>,
}

/// The `k` most likely ids of every row, highest first (ties: lower id first). Non-finite
/// logits are never listed and do not enter the normalisation.
pub fn top_k(
    logits: &[f32],
    n_vocab: usize,
    tokens: &[u32],
    decode_from: usize,
    k: usize,
) -> Vec<TopRow> {
    logits
        .chunks(n_vocab.max(1))
        .zip(tokens)
        .enumerate()
        .map(|(pos, (row, &token))| {
            let finite = || row.iter().copied().filter(|v| v.is_finite());
            let max = finite().fold(f64::NEG_INFINITY, |m, v| m.max(f64::from(v)));
            let lse = max
                + finite()
                    .map(|v| (f64::from(v) - max).exp())
                    .sum::<f64>()
                    .ln();
            let mut ids: Vec<u32> = (0..row.len() as u32)
                .filter(|&i| row[i as usize].is_finite())
                .collect();
            let key = |i: &u32| row[*i as usize];
            let k = k.min(ids.len());
            if k > 0 && k < ids.len() {
                ids.select_nth_unstable_by(k - 1, |a, b| key(b).total_cmp(&key(a)).then(a.cmp(b)));
            }
            ids.truncate(k);
            ids.sort_by(|a, b| key(b).total_cmp(&key(a)).then(a.cmp(b)));
            TopRow {
                pos,
                token,
                path: if pos < decode_from {
                    "prefill"
                } else {
                    "decode"
                },
                top: ids
                    .into_iter()
                    .map(|id| TopEntry {
                        id,
                        logprob: f64::from(row[id as usize]) - lse,
                    })
                    .collect(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_header_is_aligned_and_describes_the_array() {
        let data: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
        let mut b = Vec::new();
        write_npy_f32(&mut b, 2, 3, &data).unwrap();
        assert_eq!(&b[..8], b"\x93NUMPY\x01\x00");
        let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
        assert_eq!((10 + hl) % 64, 0);
        let header = std::str::from_utf8(&b[10..10 + hl]).unwrap();
        assert!(header.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"));
        assert!(header.ends_with('\n'));
        let body = &b[10 + hl..];
        assert_eq!(body.len(), 24);
        let back: Vec<f32> = body
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(back, data);
        assert!(write_npy_f32(&mut Vec::new(), 2, 2, &data).is_err());
    }

    #[test]
    fn top_k_orders_and_normalises() {
        let row = [1.0f32, 3.0, f32::NAN, 3.0, -2.0];
        let rows = top_k(&row, 5, &[7], 0, 3);
        assert_eq!(rows.len(), 1);
        let ids: Vec<u32> = rows[0].top.iter().map(|e| e.id).collect();
        assert_eq!(ids, vec![1, 3, 0]);
        assert_eq!(rows[0].path, "decode");
        let z: f64 = [1.0f64, 3.0, 3.0, -2.0].iter().map(|v| v.exp()).sum();
        assert!((rows[0].top[0].logprob - (3.0 - z.ln())).abs() < 1e-12);
        // k larger than the finite entries: all of them.
        assert_eq!(top_k(&row, 5, &[7], 1, 10)[0].top.len(), 4);
    }
}
