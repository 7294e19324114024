//! Read-only access to a directory of `*.safetensors` shards over mmap.
//!
//! Only the headers are parsed up front (the `safetensors` crate bounds and checks them);
//! tensor bytes are decoded on demand, a row range at a time, so converting a checkpoint far
//! larger than RAM needs only the working set of one tensor (or one expert).
//!
//! The official FP8/FP4 encodings (docs/gguf.md §5.5) are resolved here too: a weight stored
//! as F8_E4M3 or packed-FP4 `I8` is paired with its `<name>.scale` companion when the shards are
//! opened, and from then on it is a float tensor of its logical shape whose reads decode
//! exactly ([`crate::official`]); the scale tensors themselves disappear from the listing.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::error::{io_err, ConvertError, Result};
use crate::official::{decode_scaled, Encoding, ScaleRef, FP4_BLOCK, FP8_BLOCK};

/// One tensor of the checkpoint: where its bytes are and what they are.
#[derive(Debug, Clone)]
pub struct SourceTensor {
    pub name: String,
    /// The stored dtype (F8_E4M3 / I8 for the official scaled encodings).
    pub dtype: Dtype,
    /// PyTorch order (slowest axis first); for packed FP4 the logical shape (two values per
    /// stored byte), not the stored one.
    pub shape: Vec<u64>,
    /// Plain, or one of the official scaled encodings.
    pub encoding: Encoding,
    file: usize,
    start: usize,
    end: usize,
}

impl SourceTensor {
    pub fn n_elements(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Whether reads give real values: a float dtype, or an official scaled encoding.
    pub fn is_float(&self) -> bool {
        matches!(self.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16)
            || self.encoding != Encoding::Plain
    }

    pub fn is_int(&self) -> bool {
        matches!(self.dtype, Dtype::I64 | Dtype::I32) && self.encoding == Encoding::Plain
    }
}

/// All shards of a checkpoint directory, mapped.
pub struct Checkpoint {
    pub dir: PathBuf,
    maps: Vec<Mmap>,
    /// Sorted by name, so every walk over the tensors is deterministic.
    pub tensors: BTreeMap<String, SourceTensor>,
}

/// The shard files, and the index's `weight_map` (tensor → shard file name) when there is one.
type Shards = (Vec<PathBuf>, Option<BTreeMap<String, String>>);

fn shard_files(dir: &Path) -> Result<Shards> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read(&index).map_err(io_err(&index))?;
        let json: serde_json::Value =
            serde_json::from_slice(&text).map_err(|source| ConvertError::Json {
                path: index.clone(),
                source,
            })?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ConvertError::Safetensors {
                path: index.clone(),
                message: "no \"weight_map\" object".into(),
            })?;
        let mut names: Vec<&str> = Vec::new();
        let mut owner = BTreeMap::new();
        for (k, v) in map {
            let f = v
                .as_str()
                .filter(|f| !f.contains('/') && !f.contains('\\') && f.ends_with(".safetensors"))
                .ok_or_else(|| ConvertError::Safetensors {
                    path: index.clone(),
                    message: format!(
                        "weight_map entry {v} is not a shard file name in {}",
                        dir.display()
                    ),
                })?;
            names.push(f);
            owner.insert(k.clone(), f.to_string());
        }
        names.sort_unstable();
        names.dedup();
        return Ok((
            names.into_iter().map(|n| dir.join(n)).collect(),
            Some(owner),
        ));
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok((vec![single], None));
    }
    let mut all: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io_err(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors") && p.is_file())
        .collect();
    all.sort();
    let shards: Vec<PathBuf> = all
        .iter()
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("model-"))
        })
        .cloned()
        .collect();
    let files = if shards.is_empty() { all } else { shards };
    if files.is_empty() {
        return Err(ConvertError::NoSafetensors(dir.to_path_buf()));
    }
    Ok((files, None))
}

impl Checkpoint {
    /// Maps the checkpoint's shards, found the way transformers finds them: the files named in
    /// `model.safetensors.index.json`, else `model.safetensors`, else `model-*.safetensors`,
    /// else every `*.safetensors` (sorted by name). Other safetensors files next to a model
    /// (e.g. recorded reference outputs) are therefore not mistaken for weights. A tensor
    /// name present in two shards is refused, and so is an index whose `weight_map` does not
    /// match what the shards hold (a shard truncated or replaced after the index was written).
    /// FP8/FP4 weights are paired with their scales ([`crate::official`]).
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let (files, index) = shard_files(dir)?;
        let mut maps = Vec::new();
        let mut tensors = BTreeMap::new();
        for (fi, path) in files.iter().enumerate() {
            let f = File::open(path).map_err(io_err(path))?;
            // SAFETY: the mapping is read-only and private to this process. The checkpoint is
            // an input file that is not expected to change while we convert it; if another
            // process truncated it anyway, reads could fault, which is the documented hazard
            // of every mmap-based model loader (safetensors' own Python loader included).
            let map = unsafe { Mmap::map(&f) }.map_err(io_err(path))?;
            let (n, meta) =
                SafeTensors::read_metadata(&map).map_err(|e| ConvertError::Safetensors {
                    path: path.clone(),
                    message: e.to_string(),
                })?;
            let base = 8 + n;
            for (name, info) in meta.tensors() {
                let (s, e) = info.data_offsets;
                let t = SourceTensor {
                    name: name.clone(),
                    dtype: info.dtype,
                    shape: info.shape.iter().map(|&d| d as u64).collect(),
                    encoding: Encoding::Plain,
                    file: fi,
                    start: base + s,
                    end: base + e,
                };
                if t.end > map.len() {
                    return Err(ConvertError::Safetensors {
                        path: path.clone(),
                        message: format!("tensor {name} extends past the end of the file"),
                    });
                }
                if let Some(prev) = tensors.insert(name.clone(), t) {
                    return Err(ConvertError::Safetensors {
                        path: path.clone(),
                        message: format!(
                            "tensor {name} also appears in {}",
                            files[prev.file].display()
                        ),
                    });
                }
            }
            maps.push(map);
        }
        if let Some(index) = index {
            check_index(dir, &files, &index, &tensors)?;
        }
        let tensors = attach_scales(tensors)?;
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            maps,
            tensors,
        })
    }

    fn bytes(&self, t: &SourceTensor) -> &[u8] {
        &self.maps[t.file][t.start..t.end]
    }

    /// The MXFP4 blocks of a packed-FP4 matrix, its own codes and scales bit for bit
    /// ([`crate::official::fp4_to_mxfp4`]); `None` for another encoding or rows that are not
    /// whole 32-value blocks. Refuses what [`Self::read_f32`] refuses (NaN scales, overflow):
    /// the tensor is decoded row by row first.
    pub fn read_mxfp4(&self, t: &SourceTensor) -> Result<Option<Vec<u8>>> {
        let Encoding::Fp4 { scale } = &t.encoding else {
            return Ok(None);
        };
        let (rows, cols) = match t.shape[..] {
            [r, c] if c > 0 && c.is_multiple_of(FP4_BLOCK) && scale.cols == c / FP4_BLOCK => (r, c),
            _ => return Ok(None),
        };
        let mut row = vec![0f32; cols as usize];
        for r in 0..rows {
            self.read_f32(t, r * cols, &mut row)?;
        }
        let scales = &self.maps[scale.file][scale.start..scale.end];
        let mut out = Vec::with_capacity((rows * cols / FP4_BLOCK * 17) as usize);
        crate::official::fp4_to_mxfp4(cols, self.bytes(t), scales, &mut out);
        Ok(Some(out))
    }

    /// Decodes elements `first .. first + out.len()` (flat, row-major) of a float tensor to f32.
    pub fn read_f32(&self, t: &SourceTensor, first: u64, out: &mut [f32]) -> Result<()> {
        if let Encoding::Fp8 { scale } | Encoding::Fp4 { scale } = &t.encoding {
            let fp4 = matches!(t.encoding, Encoding::Fp4 { .. });
            let cols = t.shape.get(1).copied().unwrap_or(0);
            let end = first.checked_add(out.len() as u64);
            if cols == 0 || end.is_none_or(|e| e > t.n_elements()) {
                return Err(ConvertError::BadValue {
                    name: t.name.clone(),
                    message: format!(
                        "elements {first}..{} requested, the tensor has {}",
                        first.saturating_add(out.len() as u64),
                        t.n_elements()
                    ),
                });
            }
            let scales = &self.maps[scale.file][scale.start..scale.end];
            return decode_scaled(fp4, cols, scale.cols, self.bytes(t), scales, first, out)
                .map_err(|message| ConvertError::BadValue {
                    name: t.name.clone(),
                    message,
                });
        }
        let esize = match t.dtype {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
            other => {
                return Err(ConvertError::BadValue {
                    name: t.name.clone(),
                    message: format!("dtype {other:?} is not a float type"),
                })
            }
        };
        let bytes = self.range(t, first, out.len() as u64, esize)?;
        match t.dtype {
            Dtype::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Dtype::BF16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
            _ => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
        }
        Ok(())
    }

    /// Decodes an integer tensor (I64 or I32) to i64.
    pub fn read_ints(&self, t: &SourceTensor, first: u64, out: &mut [i64]) -> Result<()> {
        let esize = match t.dtype {
            Dtype::I64 => 8,
            Dtype::I32 => 4,
            other => {
                return Err(ConvertError::BadValue {
                    name: t.name.clone(),
                    message: format!("dtype {other:?} is not an integer type"),
                })
            }
        };
        let bytes = self.range(t, first, out.len() as u64, esize)?;
        if esize == 8 {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                *o = i64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
            }
        } else {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            }
        }
        Ok(())
    }

    fn range(&self, t: &SourceTensor, first: u64, count: u64, esize: u64) -> Result<&[u8]> {
        let all = self.bytes(t);
        let lo = first.checked_mul(esize);
        let hi = first.checked_add(count).and_then(|e| e.checked_mul(esize));
        match (lo, hi) {
            (Some(lo), Some(hi)) if hi <= all.len() as u64 => Ok(&all[lo as usize..hi as usize]),
            _ => Err(ConvertError::BadValue {
                name: t.name.clone(),
                message: format!(
                    "elements {first}..{} requested, the tensor has {} bytes",
                    first.saturating_add(count),
                    all.len()
                ),
            }),
        }
    }
}

fn safetensors_err(path: &Path, message: String) -> ConvertError {
    ConvertError::Safetensors {
        path: path.to_path_buf(),
        message,
    }
}

/// The index must name exactly the tensors the shards hold, each in the shard that holds it:
/// a mismatch means a shard was truncated, replaced or is missing, and converting anyway would
/// silently mix checkpoints.
fn check_index(
    dir: &Path,
    files: &[PathBuf],
    index: &BTreeMap<String, String>,
    tensors: &BTreeMap<String, SourceTensor>,
) -> Result<()> {
    let path = dir.join("model.safetensors.index.json");
    for (name, shard) in index {
        match tensors.get(name) {
            None => {
                return Err(safetensors_err(
                    &path,
                    format!("the index puts tensor {name} in {shard}, which does not hold it"),
                ))
            }
            Some(t) => {
                let holder = files[t.file].file_name().and_then(|n| n.to_str());
                if holder != Some(shard.as_str()) {
                    return Err(safetensors_err(
                        &path,
                        format!(
                            "the index puts tensor {name} in {shard}, but it is in {}",
                            files[t.file].display()
                        ),
                    ));
                }
            }
        }
    }
    if let Some(t) = tensors.values().find(|t| !index.contains_key(&t.name)) {
        return Err(safetensors_err(
            &path,
            format!(
                "tensor {} of {} is not in the index's weight_map",
                t.name,
                files[t.file].display()
            ),
        ));
    }
    Ok(())
}

/// The name of a weight's scale companion: `X.weight` → `X.scale`, otherwise `X.scale`.
fn scale_name(weight: &str) -> String {
    match weight.strip_suffix(".weight") {
        Some(base) => format!("{base}.scale"),
        None => format!("{weight}.scale"),
    }
}

fn scale_problem(name: &str, message: String) -> ConvertError {
    ConvertError::BadValue {
        name: name.to_string(),
        message,
    }
}

/// Pairs every F8_E4M3 weight and every packed-FP4 (`I8`) weight with its E8M0 scale tensor,
/// checks the scale's dtype and shape against the weight, and removes the scales from the
/// listing. A scale without a weight, or a weight without a scale, is refused.
fn attach_scales(
    mut tensors: BTreeMap<String, SourceTensor>,
) -> Result<BTreeMap<String, SourceTensor>> {
    let scaled: Vec<String> = tensors
        .values()
        .filter(|t| matches!(t.dtype, Dtype::F8_E4M3 | Dtype::I8))
        .map(|t| t.name.clone())
        .collect();
    for name in scaled {
        let sname = scale_name(&name);
        let Some(t) = tensors.get(&name) else {
            // Already taken as another weight's scale (and refused there for its dtype).
            continue;
        };
        let (dtype, fp4) = (t.dtype, t.dtype == Dtype::I8);
        let Some(s) = tensors.remove(&sname) else {
            return Err(scale_problem(
                &name,
                format!(
                    "{dtype:?} weight without its scale tensor {sname} (an {} checkpoint needs one E8M0 scale per {})",
                    if fp4 { "FP4" } else { "FP8" },
                    if fp4 { "32 inputs" } else { "128 × 128 tile" },
                ),
            ));
        };
        let Some(t) = tensors.get_mut(&name) else {
            continue;
        };
        if s.dtype != Dtype::F8_E8M0 {
            return Err(scale_problem(
                &sname,
                format!("scale of {name} has dtype {:?}; expected F8_E8M0", s.dtype),
            ));
        }
        if t.shape.len() != 2 {
            return Err(scale_problem(
                &name,
                format!(
                    "{:?} weight of shape {:?}; only 2-D matrices carry block scales",
                    t.dtype, t.shape
                ),
            ));
        }
        let rows = t.shape[0];
        let cols = if fp4 { t.shape[1] * 2 } else { t.shape[1] };
        let want = if fp4 {
            vec![rows, cols.div_ceil(FP4_BLOCK)]
        } else {
            vec![rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK)]
        };
        if s.shape != want {
            return Err(scale_problem(
                &sname,
                format!(
                    "scale shape {:?} does not fit {name} ({} of logical shape [{rows}, {cols}]): expected {want:?}",
                    s.shape,
                    if fp4 { "FP4, one scale per 32 inputs" } else { "FP8, one scale per 128 × 128 tile" },
                ),
            ));
        }
        let scale = ScaleRef {
            name: sname,
            rows: want[0],
            cols: want[1],
            file: s.file,
            start: s.start,
            end: s.end,
        };
        t.shape = vec![rows, cols];
        t.encoding = if fp4 {
            Encoding::Fp4 { scale }
        } else {
            Encoding::Fp8 { scale }
        };
    }
    if let Some(s) = tensors
        .values()
        .find(|t| t.dtype == Dtype::F8_E8M0 && t.name.ends_with(".scale"))
    {
        return Err(scale_problem(
            &s.name,
            "E8M0 scale tensor without an F8_E4M3 or packed-FP4 (I8) weight to scale".into(),
        ));
    }
    Ok(tensors)
}
