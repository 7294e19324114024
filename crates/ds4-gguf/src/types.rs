//! ggml tensor element types that ds4 files use, with their block geometry.
//!
//! Only the types the published DeepSeek V4 Flash files (and our converter) use are known,
//! plus MXFP4, the format of the official checkpoint's routed experts (issue 54);
//! any other code is carried as [`GgmlType::Unknown`] so a reader can still describe the file
//! and let the model validator refuse it with the tensor's name.

use std::fmt;

/// A ggml element type, by its on-disk code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GgmlType {
    F32,
    F16,
    Q8_0,
    Q2K,
    Q4K,
    Iq2Xxs,
    I32,
    Bf16,
    /// MXFP4 (OCP microscaling FP4): 32 E2M1 values sharing one E8M0 scale.
    Mxfp4,
    /// A type code this crate does not know: its byte size cannot be computed.
    Unknown(u32),
}

impl GgmlType {
    /// Every known type, in code order.
    pub const KNOWN: [GgmlType; 9] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q8_0,
        GgmlType::Q2K,
        GgmlType::Q4K,
        GgmlType::Iq2Xxs,
        GgmlType::I32,
        GgmlType::Bf16,
        GgmlType::Mxfp4,
    ];

    pub fn from_code(code: u32) -> GgmlType {
        match code {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2K,
            12 => GgmlType::Q4K,
            16 => GgmlType::Iq2Xxs,
            26 => GgmlType::I32,
            30 => GgmlType::Bf16,
            39 => GgmlType::Mxfp4,
            other => GgmlType::Unknown(other),
        }
    }

    pub fn code(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2K => 10,
            GgmlType::Q4K => 12,
            GgmlType::Iq2Xxs => 16,
            GgmlType::I32 => 26,
            GgmlType::Bf16 => 30,
            GgmlType::Mxfp4 => 39,
            GgmlType::Unknown(c) => c,
        }
    }

    /// Elements per block (1 for plain types); `None` for unknown types.
    pub fn block_elems(self) -> Option<u64> {
        Some(match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::I32 | GgmlType::Bf16 => 1,
            GgmlType::Q8_0 | GgmlType::Mxfp4 => 32,
            GgmlType::Q2K | GgmlType::Q4K | GgmlType::Iq2Xxs => 256,
            GgmlType::Unknown(_) => return None,
        })
    }

    /// Bytes per block; `None` for unknown types.
    pub fn block_bytes(self) -> Option<u64> {
        Some(match self {
            GgmlType::F32 | GgmlType::I32 => 4,
            GgmlType::F16 | GgmlType::Bf16 => 2,
            GgmlType::Q8_0 => 34,
            GgmlType::Q2K => 84,
            GgmlType::Q4K => 144,
            GgmlType::Iq2Xxs => 66,
            GgmlType::Mxfp4 => 17,
            GgmlType::Unknown(_) => return None,
        })
    }

    /// Whether this is a block-quantized type (as opposed to a plain scalar type).
    pub fn is_quantized(self) -> bool {
        matches!(
            self,
            GgmlType::Q8_0 | GgmlType::Q2K | GgmlType::Q4K | GgmlType::Iq2Xxs | GgmlType::Mxfp4
        )
    }

    /// Bytes taken by `n_elems` elements: `ceil(n / block) * block_bytes`, checked.
    /// `None` for unknown types or on overflow.
    pub fn bytes_for(self, n_elems: u64) -> Option<u64> {
        let be = self.block_elems()?;
        let bb = self.block_bytes()?;
        n_elems.div_ceil(be).checked_mul(bb)
    }

    /// Bytes of one row of `ne0` elements; `None` if `ne0` is not a whole number of blocks.
    pub fn row_bytes(self, ne0: u64) -> Option<u64> {
        let be = self.block_elems()?;
        if !ne0.is_multiple_of(be) {
            return None;
        }
        (ne0 / be).checked_mul(self.block_bytes()?)
    }

    /// Short upper-case name as ggml prints it.
    pub fn name(self) -> String {
        match self {
            GgmlType::F32 => "F32".into(),
            GgmlType::F16 => "F16".into(),
            GgmlType::Q8_0 => "Q8_0".into(),
            GgmlType::Q2K => "Q2_K".into(),
            GgmlType::Q4K => "Q4_K".into(),
            GgmlType::Iq2Xxs => "IQ2_XXS".into(),
            GgmlType::I32 => "I32".into(),
            GgmlType::Bf16 => "BF16".into(),
            GgmlType::Mxfp4 => "MXFP4".into(),
            GgmlType::Unknown(c) => format!("unknown({c})"),
        }
    }

    /// Parse a ggml-style name (case-insensitive), e.g. `q8_0`, `IQ2_XXS`.
    pub fn from_name(s: &str) -> Option<GgmlType> {
        let up = s.to_ascii_uppercase();
        GgmlType::KNOWN.into_iter().find(|t| t.name() == up)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_sizes_match_spec() {
        for t in GgmlType::KNOWN {
            assert_eq!(GgmlType::from_code(t.code()), t);
            assert_eq!(GgmlType::from_name(&t.name()), Some(t));
        }
        assert_eq!(GgmlType::Q8_0.row_bytes(4096), Some(4352));
        assert_eq!(GgmlType::Q2K.row_bytes(2048), Some(672));
        assert_eq!(GgmlType::Q4K.row_bytes(4096), Some(2304));
        assert_eq!(GgmlType::Iq2Xxs.row_bytes(4096), Some(1056));
        assert_eq!(GgmlType::Mxfp4.row_bytes(4096), Some(2176));
        assert_eq!(GgmlType::Mxfp4.bytes_for(33), Some(34));
        assert_eq!(GgmlType::from_code(39), GgmlType::Mxfp4);
        assert_eq!(GgmlType::from_name("mxfp4"), Some(GgmlType::Mxfp4));
        assert_eq!(GgmlType::Q2K.row_bytes(100), None);
        assert_eq!(GgmlType::Unknown(99).bytes_for(10), None);
        assert_eq!(GgmlType::F32.bytes_for(u64::MAX), None);
    }
}
