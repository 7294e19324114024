//! Weights as the CPU backend stores them: matrices stay in the file mapping (zero copy,
//! quantized), small vectors are widened to f32 once at load.

use std::sync::Arc;

use ds4_engine::backend::{BResult, BackendError, WeightInfo, WeightUse};
use ds4_gguf::{GgmlType, GgufFile};

/// Where a weight's bytes live.
#[derive(Debug)]
enum Bytes {
    /// Absolute byte range `start .. start + len` of the file image (zero copy).
    Mapped {
        file: Arc<GgufFile>,
        start: usize,
        len: usize,
    },
    /// Owned bytes: the slot pools of streamed experts (docs/placement.md §9).
    Owned(Vec<u8>),
}

#[derive(Debug)]
pub(crate) struct CpuWeight {
    pub name: String,
    pub info: WeightInfo,
    data: Bytes,
    row_bytes: usize,
    /// Widened copy for `WeightUse::Vector`.
    pub f32: Option<Vec<f32>>,
}

/// Matrix types the CPU matmul accepts. Every one goes through `ds4_gguf::quant::dot` (and,
/// for the block types, `quant::q8act::dot` when int8 activations are on), so adding a type
/// here only needs its codec there; MXFP4 holds the official checkpoint's routed experts.
const MATRIX_TYPES: [GgmlType; 8] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Bf16,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q4K,
    GgmlType::Iq2Xxs,
    GgmlType::Mxfp4,
];

impl CpuWeight {
    pub fn load(file: &Arc<GgufFile>, name: &str, usage: WeightUse) -> BResult<CpuWeight> {
        let werr = |problem: String| BackendError::Weight {
            name: name.to_string(),
            problem,
        };
        let (info, data) = file.tensor_bytes(name).map_err(|e| werr(e.to_string()))?;
        if info.dims.len() > 3 || info.dims.is_empty() {
            return Err(werr(format!(
                "{} dims, at most 3 supported",
                info.dims.len()
            )));
        }
        let mut dims = [1usize; 3];
        for (d, &v) in dims.iter_mut().zip(&info.dims) {
            *d = usize::try_from(v).map_err(|_| werr(format!("dim {v} too large")))?;
        }
        let ty = info.ty;
        let row_bytes = ty.row_bytes(dims[0] as u64).ok_or_else(|| {
            werr(format!(
                "type {ty} cannot hold rows of {} elements",
                dims[0]
            ))
        })? as usize;
        let ok = match usage {
            WeightUse::Matrix => MATRIX_TYPES.contains(&ty),
            WeightUse::Vector => matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16),
            WeightUse::Table => MATRIX_TYPES.contains(&ty) || ty == GgmlType::I32,
        };
        if !ok {
            return Err(werr(format!(
                "type {ty} is not supported for {usage:?} use"
            )));
        }
        let n_rows = dims[1] * dims[2];
        if row_bytes.checked_mul(n_rows) != Some(data.len()) {
            return Err(werr(format!(
                "{} bytes for {n_rows} rows of {row_bytes} bytes",
                data.len()
            )));
        }
        let start = data.as_ptr() as usize - file.bytes().as_ptr() as usize;
        let f32 = match usage {
            WeightUse::Vector => {
                let mut v = vec![0f32; dims[0] * n_rows];
                ds4_gguf::quant::dequantize(ty, data, &mut v).map_err(|e| werr(e.to_string()))?;
                Some(v)
            }
            _ => None,
        };
        Ok(CpuWeight {
            name: name.to_string(),
            info: WeightInfo { ty, dims },
            data: Bytes::Mapped {
                file: Arc::clone(file),
                start,
                len: data.len(),
            },
            row_bytes,
            f32,
        })
    }

    /// A zero-filled matrix weight of `info` (validated by the caller), owned.
    pub fn zeroed(name: &str, info: WeightInfo, bytes: usize) -> BResult<CpuWeight> {
        if !MATRIX_TYPES.contains(&info.ty) {
            return Err(BackendError::Weight {
                name: name.to_string(),
                problem: format!("type {} is not supported for Matrix use", info.ty),
            });
        }
        let row_bytes = bytes / (info.rows() * info.mats());
        let mut v = Vec::new();
        v.try_reserve_exact(bytes)
            .map_err(|e| BackendError::Alloc {
                elems: bytes,
                problem: e.to_string(),
            })?;
        v.resize(bytes, 0);
        Ok(CpuWeight {
            name: name.to_string(),
            info,
            data: Bytes::Owned(v),
            row_bytes,
            f32: None,
        })
    }

    /// Replaces matrix `mat`'s bytes (`raw` checked by the caller); only owned weights.
    pub fn write_mat(&mut self, mat: usize, raw: &[u8]) -> BResult<()> {
        let n = raw.len();
        match &mut self.data {
            Bytes::Owned(v) => {
                v[mat * n..(mat + 1) * n].copy_from_slice(raw);
                Ok(())
            }
            Bytes::Mapped { .. } => Err(BackendError::Weight {
                name: self.name.clone(),
                problem: "a weight mapped from the file cannot be written".into(),
            }),
        }
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.data {
            Bytes::Mapped { file, start, len } => &file.bytes()[*start..*start + *len],
            Bytes::Owned(v) => v,
        }
    }

    /// Row `r` of matrix `mat` (caller checked bounds).
    #[inline]
    pub fn row(&self, mat: usize, r: usize) -> &[u8] {
        let i = mat * self.info.rows() + r;
        &self.bytes()[i * self.row_bytes..(i + 1) * self.row_bytes]
    }

    /// The widened values of a `Vector` weight.
    pub fn values(&self, op: &'static str) -> BResult<&[f32]> {
        self.f32.as_deref().ok_or_else(|| BackendError::Invalid {
            op,
            problem: format!("weight {} was not loaded as a vector", self.name),
        })
    }

    /// Row `r` of a table, dequantized into `out` (`cols` values).
    pub fn table_row(&self, r: usize, out: &mut [f32]) -> BResult<()> {
        ds4_gguf::quant::dequantize(self.info.ty, self.row(0, r), out).map_err(|e| {
            BackendError::Weight {
                name: self.name.clone(),
                problem: e.to_string(),
            }
        })
    }

    /// Row `r` of an I32 table.
    pub fn i32_row(&self, r: usize) -> impl Iterator<Item = i32> + '_ {
        self.row(0, r)
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
    }
}
