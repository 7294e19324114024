//! Importance matrices in llama.cpp's legacy `.dat` format, the one ds4's quantizer reads and
//! its published `-imatrix` files were made with (docs/gguf.md §5.4, §6.1).
//!
//! Layout (little-endian): `i32 n_entries`; per entry `i32 name_len`, the name (UTF-8, a GGUF
//! tensor name such as `blk.3.ffn_gate_exps.weight`), `i32 ncall`, `i32 nval`, `f32[nval]`;
//! then optionally `i32 chunks` and `i32 len` + the dataset's name. A stored value is the mean
//! squared activation of its input column times `ncall`, so a reader divides by `ncall` (when
//! positive) to get the importance. A routed-expert tensor's entry holds `n_expert` consecutive
//! vectors of `ne0` values, expert `e` at `e · ne0`: each expert is quantized with its own.
//!
//! Parsing is bounded by the bytes present and every value is checked (finite, ≥ 0): a
//! damaged file is refused with the entry and the problem named, never read past its end.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::{io_err, ConvertError, Result};

/// One entry as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// How many calls (chunks) the values were accumulated over; the stored values are the
    /// per-column means times this.
    pub ncall: i32,
    pub values: Vec<f32>,
}

/// A whole importance-matrix file.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Imatrix {
    /// Tensor name → entry, sorted (files are written in this order).
    pub entries: BTreeMap<String, Entry>,
    /// The trailer's chunk count and dataset name, when the file has one.
    pub chunks: Option<i32>,
    pub dataset: Option<String>,
}

/// Longest tensor name accepted (GGUF names are short; a huge length means a damaged file).
const MAX_NAME: usize = 4096;

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> std::result::Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        match end {
            Some(e) => {
                let s = &self.b[self.at..e];
                self.at = e;
                Ok(s)
            }
            None => Err(format!(
                "{what} needs {n} bytes at offset {}, the file has {}",
                self.at,
                self.b.len()
            )),
        }
    }

    fn i32(&mut self, what: &str) -> std::result::Result<i32, String> {
        let s = self.take(4, what)?;
        Ok(i32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }

    fn left(&self) -> usize {
        self.b.len() - self.at
    }
}

impl Imatrix {
    /// Reads and checks a `.dat` file.
    pub fn read(path: &Path) -> Result<Imatrix> {
        let bytes = std::fs::read(path).map_err(io_err(path))?;
        Imatrix::parse(&bytes).map_err(|message| ConvertError::Imatrix {
            path: path.to_path_buf(),
            message,
        })
    }

    /// Parses the bytes of a `.dat` file; the error says what is wrong and where.
    pub fn parse(b: &[u8]) -> std::result::Result<Imatrix, String> {
        let mut c = Cursor { b, at: 0 };
        let n = c.i32("the entry count")?;
        // Each entry takes at least 12 bytes, so a count the file cannot hold is refused
        // before anything is allocated for it.
        if n < 0 || n as usize > c.left() / 12 {
            return Err(format!(
                "entry count {n} does not fit a file of {} bytes",
                b.len()
            ));
        }
        let mut entries = BTreeMap::new();
        for i in 0..n as usize {
            let len = c.i32(&format!("entry {i}'s name length"))?;
            if len <= 0 || len as usize > MAX_NAME {
                return Err(format!("entry {i} has a name length of {len}"));
            }
            let name = std::str::from_utf8(c.take(len as usize, &format!("entry {i}'s name"))?)
                .map_err(|_| format!("entry {i}'s name is not UTF-8"))?
                .to_string();
            let ncall = c.i32(&format!("{name}'s ncall"))?;
            let nval = c.i32(&format!("{name}'s value count"))?;
            if ncall < 0 || nval < 0 {
                return Err(format!("{name}: ncall {ncall}, value count {nval}"));
            }
            let raw = c.take(4 * nval as usize, &format!("{name}'s {nval} values"))?;
            let values: Vec<f32> = raw
                .chunks_exact(4)
                .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
                .collect();
            if let Some((j, v)) = values
                .iter()
                .enumerate()
                .find(|(_, v)| !(v.is_finite() && **v >= 0.0))
            {
                return Err(format!(
                    "{name}: value {j} is {v} (a sum of squares is finite and ≥ 0)"
                ));
            }
            if entries
                .insert(name.clone(), Entry { ncall, values })
                .is_some()
            {
                return Err(format!("{name} appears twice"));
            }
        }
        let (mut chunks, mut dataset) = (None, None);
        if c.left() > 0 {
            chunks = Some(c.i32("the chunk count")?);
            let len = c.i32("the dataset name length")?;
            if len < 0 {
                return Err(format!("dataset name length {len}"));
            }
            let s = c.take(len as usize, "the dataset name")?;
            dataset = Some(String::from_utf8_lossy(s).into_owned());
            if c.left() > 0 {
                return Err(format!(
                    "{} bytes after the dataset name at offset {}",
                    c.left(),
                    c.at
                ));
            }
        }
        Ok(Imatrix {
            entries,
            chunks,
            dataset,
        })
    }

    /// The file's bytes (entries in name order; the trailer when `chunks` is set).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&(self.entries.len() as i32).to_le_bytes());
        for (name, e) in &self.entries {
            out.extend_from_slice(&(name.len() as i32).to_le_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&e.ncall.to_le_bytes());
            out.extend_from_slice(&(e.values.len() as i32).to_le_bytes());
            for v in &e.values {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        if let Some(chunks) = self.chunks {
            let d = self.dataset.as_deref().unwrap_or("");
            out.extend_from_slice(&chunks.to_le_bytes());
            out.extend_from_slice(&(d.len() as i32).to_le_bytes());
            out.extend_from_slice(d.as_bytes());
        }
        out
    }

    /// Writes the file through `path.partial`, renamed when complete.
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".partial");
        let tmp = PathBuf::from(tmp);
        std::fs::write(&tmp, self.to_bytes()).map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io_err(path))
    }

    /// The importance of `tensor`'s `ne0` input columns — of expert `e` of `n_expert` when
    /// given — as the quantizers take it (stored / ncall). `Ok(None)` when the file has no
    /// entry, or the expert's vector is all zero (never routed to while collecting: its
    /// default quantization is better than one weighted by nothing). A vector of the wrong
    /// length is an error: the file belongs to another model.
    pub fn importance(
        &self,
        tensor: &str,
        ne0: usize,
        expert: Option<(usize, usize)>,
    ) -> Result<Option<Vec<f32>>> {
        let Some(e) = self.entries.get(tensor) else {
            return Ok(None);
        };
        let (first, want) = match expert {
            Some((x, n)) if x < n => (x * ne0, n * ne0),
            Some((x, n)) => {
                return Err(ConvertError::BadValue {
                    name: tensor.to_string(),
                    message: format!("expert {x} asked of an imatrix entry for {n} experts"),
                })
            }
            None => (0, ne0),
        };
        if e.values.len() != want {
            return Err(ConvertError::BadValue {
                name: tensor.to_string(),
                message: format!(
                    "the imatrix entry has {} values, the tensor needs {want} ({} of {ne0})",
                    e.values.len(),
                    expert.map_or(1, |(_, n)| n)
                ),
            });
        }
        let v = &e.values[first..first + ne0];
        if v.iter().all(|x| *x == 0.0) {
            return Ok(None);
        }
        let div = if e.ncall > 0 { e.ncall as f32 } else { 1.0 };
        Ok(Some(v.iter().map(|x| x / div).collect()))
    }
}

/// Accumulates squared activations per input column of each matrix (per expert for routed
/// tensors), the statistics `ds4 imatrix` collects, and turns them into an [`Imatrix`].
#[derive(Debug, Default)]
pub struct Collector {
    /// name → (Σx² per column, in f64; rows seen per expert; columns).
    sums: BTreeMap<String, (Vec<f64>, Vec<u64>, usize)>,
}

impl Collector {
    /// Adds one input row `x` of `tensor` (expert `e` of `n_expert` for a routed tensor).
    pub fn add(&mut self, tensor: &str, expert: Option<(usize, usize)>, x: &[f32]) {
        let (e, n) = expert.unwrap_or((0, 1));
        let ne0 = x.len();
        let (sums, counts, _) = self
            .sums
            .entry(tensor.to_string())
            .or_insert_with(|| (vec![0.0; n * ne0], vec![0; n], ne0));
        if e >= counts.len() || sums.len() != counts.len() * ne0 {
            return;
        }
        for (s, v) in sums[e * ne0..(e + 1) * ne0].iter_mut().zip(x) {
            *s += f64::from(*v) * f64::from(*v);
        }
        counts[e] += 1;
    }

    /// The file: per column the mean of x² over the rows that reached it, stored times
    /// `chunks` as `ncall` (so a reader's division gives the mean back).
    pub fn finish(&self, chunks: i32, dataset: &str) -> Imatrix {
        let ncall = chunks.max(1);
        let entries = self
            .sums
            .iter()
            .map(|(name, (sums, counts, ne0))| {
                let values = sums
                    .chunks(*ne0.max(&1))
                    .zip(counts)
                    .flat_map(|(s, &c)| {
                        s.iter().map(move |v| {
                            if c == 0 {
                                0.0
                            } else {
                                (v / c as f64 * f64::from(ncall)) as f32
                            }
                        })
                    })
                    .collect();
                (name.clone(), Entry { ncall, values })
            })
            .collect();
        Imatrix {
            entries,
            chunks: Some(chunks),
            dataset: Some(dataset.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_importance() {
        let mut c = Collector::default();
        c.add("blk.0.ffn_down_exps.weight", Some((1, 2)), &[1.0, 2.0]);
        c.add("blk.0.ffn_down_exps.weight", Some((1, 2)), &[3.0, 0.0]);
        c.add("blk.0.attn_q_a.weight", None, &[0.5, 0.5, 1.0]);
        let m = c.finish(4, "kjv.txt");
        let bytes = m.to_bytes();
        let back = Imatrix::parse(&bytes).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.to_bytes(), bytes);
        // Expert 1: mean x² = (1+9)/2, (4+0)/2; expert 0 never reached → default path.
        let name = "blk.0.ffn_down_exps.weight";
        assert_eq!(
            back.importance(name, 2, Some((1, 2))).unwrap(),
            Some(vec![5.0, 2.0])
        );
        assert_eq!(back.importance(name, 2, Some((0, 2))).unwrap(), None);
        assert!(back.importance(name, 3, Some((0, 2))).is_err());
        assert!(back.importance(name, 2, Some((2, 2))).is_err());
        assert_eq!(back.importance("other", 2, None).unwrap(), None);
        assert_eq!(back.chunks, Some(4));
        assert_eq!(back.dataset.as_deref(), Some("kjv.txt"));
    }

    #[test]
    fn damaged_files_are_refused_with_the_reason() {
        let mut c = Collector::default();
        c.add("blk.1.ffn_gate_exps.weight", Some((0, 1)), &[1.0; 8]);
        let good = c.finish(1, "d").to_bytes();
        for cut in [0, 3, 10, 30, good.len() - 1] {
            assert!(Imatrix::parse(&good[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad = good.clone();
        bad[0..4].copy_from_slice(&i32::MAX.to_le_bytes());
        assert!(Imatrix::parse(&bad).unwrap_err().contains("entry count"));
        let mut nan = good.clone();
        let at = 4 + 4 + 26 + 8;
        nan[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        let e = Imatrix::parse(&nan).unwrap_err();
        assert!(
            e.contains("blk.1.ffn_gate_exps.weight: value 0 is NaN"),
            "{e}"
        );
        let mut extra = good;
        extra.push(0);
        assert!(Imatrix::parse(&extra)
            .unwrap_err()
            .contains("after the dataset"));
    }
}
