//! Read-only access to a directory of `*.safetensors` shards over mmap.
//!
//! Only the headers are parsed up front (the `safetensors` crate bounds and checks them);
//! tensor bytes are decoded on demand, a row range at a time, so converting a checkpoint far
//! larger than RAM needs only the working set of one tensor (or one expert).

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::error::{io_err, ConvertError, Result};

/// One tensor of the checkpoint: where its bytes are and what they are.
#[derive(Debug, Clone)]
pub struct SourceTensor {
    pub name: String,
    pub dtype: Dtype,
    /// PyTorch order (slowest axis first).
    pub shape: Vec<u64>,
    file: usize,
    start: usize,
    end: usize,
}

impl SourceTensor {
    pub fn n_elements(&self) -> u64 {
        self.shape.iter().product()
    }

    pub fn is_float(&self) -> bool {
        matches!(self.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16)
    }

    pub fn is_int(&self) -> bool {
        matches!(self.dtype, Dtype::I64 | Dtype::I32)
    }
}

/// All shards of a checkpoint directory, mapped.
pub struct Checkpoint {
    pub dir: PathBuf,
    maps: Vec<Mmap>,
    /// Sorted by name, so every walk over the tensors is deterministic.
    pub tensors: BTreeMap<String, SourceTensor>,
}

fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
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
        for v in map.values() {
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
        }
        names.sort_unstable();
        names.dedup();
        return Ok(names.into_iter().map(|n| dir.join(n)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
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
    Ok(files)
}

impl Checkpoint {
    /// Maps the checkpoint's shards, found the way transformers finds them: the files named in
    /// `model.safetensors.index.json`, else `model.safetensors`, else `model-*.safetensors`,
    /// else every `*.safetensors` (sorted by name). Other safetensors files next to a model
    /// (e.g. recorded reference outputs) are therefore not mistaken for weights. A tensor
    /// name present in two shards is refused.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let files = shard_files(dir)?;
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
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            maps,
            tensors,
        })
    }

    fn bytes(&self, t: &SourceTensor) -> &[u8] {
        &self.maps[t.file][t.start..t.end]
    }

    /// Decodes elements `first .. first + out.len()` (flat, row-major) of a float tensor to f32.
    pub fn read_f32(&self, t: &SourceTensor, first: u64, out: &mut [f32]) -> Result<()> {
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
