//! The parsed GGUF header (metadata + tensor table) and its layout rules, shared by the
//! reader and the writer so both agree on offsets byte for byte.

use crate::error::{GgufError, Result};
use crate::types::GgmlType;
use crate::value::Value;

pub const GGUF_MAGIC: u32 = 0x4655_4747;
pub const GGUF_VERSION: u32 = 3;
pub const DEFAULT_ALIGNMENT: u64 = 32;
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// ds4 accepts 1..=8 dims per tensor.
pub const MAX_DIMS: usize = 8;
/// ds4 refuses arrays nested deeper than this.
pub const MAX_NESTING: usize = 8;

/// One tensor-info record.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ne0 first (the contiguous axis), as stored.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset relative to the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Element count, `None` on overflow.
    pub fn n_elements(&self) -> Option<u64> {
        self.dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }

    /// Payload bytes (without padding), `None` for unknown types or overflow.
    pub fn n_bytes(&self) -> Option<u64> {
        self.ty.bytes_for(self.n_elements()?)
    }
}

/// Metadata and tensor table of a GGUF file, in file order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Header {
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
}

pub fn align_up(x: u64, a: u64) -> Option<u64> {
    x.checked_add(a - 1).map(|v| v / a * a)
}

impl Header {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Sets a key, replacing an existing value in place (keeps file order stable).
    pub fn set(&mut self, key: impl Into<String>, value: Value) {
        let key = key.into();
        match self.metadata.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => self.metadata.push((key, value)),
        }
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// `general.alignment` if present (must be a nonzero power-of-two u32), else 32.
    pub fn alignment(&self) -> Result<u64> {
        match self.get(ALIGNMENT_KEY) {
            None => Ok(DEFAULT_ALIGNMENT),
            Some(Value::U32(a)) if *a != 0 && a.is_power_of_two() => Ok(u64::from(*a)),
            Some(other) => Err(GgufError::BadAlignment {
                found: format!("{other:?}"),
            }),
        }
    }

    /// Lays tensors out back to back in table order, each aligned, and rewrites their
    /// offsets. This is how ds4's writers lay out files, so a file written this way and read
    /// back yields the same header.
    pub fn assign_offsets(&mut self) -> Result<u64> {
        let align = self.alignment()?;
        let mut off = 0u64;
        for t in &mut self.tensors {
            t.offset = off;
            let bytes = t.n_bytes().ok_or_else(|| GgufError::BadTensor {
                name: t.name.clone(),
                problem: format!("size of {} x {:?} cannot be computed", t.ty, t.dims),
            })?;
            off = off
                .checked_add(bytes)
                .and_then(|e| align_up(e, align))
                .ok_or_else(|| GgufError::Writer("data section size overflows u64".into()))?;
        }
        Ok(off)
    }
}
