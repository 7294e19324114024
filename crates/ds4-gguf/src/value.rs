//! GGUF metadata values: the 13 scalar/string/array types of GGUF v3.

use std::fmt;

/// The on-disk value type codes of GGUF v3.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    pub fn from_code(code: u32) -> Option<ValueType> {
        Some(match code {
            0 => ValueType::U8,
            1 => ValueType::I8,
            2 => ValueType::U16,
            3 => ValueType::I16,
            4 => ValueType::U32,
            5 => ValueType::I32,
            6 => ValueType::F32,
            7 => ValueType::Bool,
            8 => ValueType::String,
            9 => ValueType::Array,
            10 => ValueType::U64,
            11 => ValueType::I64,
            12 => ValueType::F64,
            _ => return None,
        })
    }

    pub fn code(self) -> u32 {
        match self {
            ValueType::U8 => 0,
            ValueType::I8 => 1,
            ValueType::U16 => 2,
            ValueType::I16 => 3,
            ValueType::U32 => 4,
            ValueType::I32 => 5,
            ValueType::F32 => 6,
            ValueType::Bool => 7,
            ValueType::String => 8,
            ValueType::Array => 9,
            ValueType::U64 => 10,
            ValueType::I64 => 11,
            ValueType::F64 => 12,
        }
    }

    /// Smallest number of bytes one encoded value of this type can take; used to bound
    /// counts read from untrusted files before allocating anything.
    pub fn min_encoded_len(self) -> u64 {
        match self {
            ValueType::U8 | ValueType::I8 | ValueType::Bool => 1,
            ValueType::U16 | ValueType::I16 => 2,
            ValueType::U32 | ValueType::I32 | ValueType::F32 => 4,
            ValueType::U64 | ValueType::I64 | ValueType::F64 => 8,
            ValueType::String => 8,
            ValueType::Array => 12,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ValueType::U8 => "u8",
            ValueType::I8 => "i8",
            ValueType::U16 => "u16",
            ValueType::I16 => "i16",
            ValueType::U32 => "u32",
            ValueType::I32 => "i32",
            ValueType::F32 => "f32",
            ValueType::Bool => "bool",
            ValueType::String => "string",
            ValueType::Array => "array",
            ValueType::U64 => "u64",
            ValueType::I64 => "i64",
            ValueType::F64 => "f64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A metadata value. Floats keep their exact bits, so a read → write round trip is byte-identical.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A typed array. `elem_type` is kept even when empty so the file's bytes can be reproduced.
#[derive(Debug, Clone, PartialEq)]
pub struct Array {
    pub elem_type: ValueType,
    pub values: Vec<Value>,
}

impl Array {
    /// Builds an array, checking every element has `elem_type`.
    pub fn new(elem_type: ValueType, values: Vec<Value>) -> Option<Array> {
        values
            .iter()
            .all(|v| v.value_type() == elem_type)
            .then_some(Array { elem_type, values })
    }

    pub fn strings<S: Into<String>>(items: impl IntoIterator<Item = S>) -> Array {
        Array {
            elem_type: ValueType::String,
            values: items.into_iter().map(|s| Value::String(s.into())).collect(),
        }
    }

    pub fn i32s(items: impl IntoIterator<Item = i32>) -> Array {
        Array {
            elem_type: ValueType::I32,
            values: items.into_iter().map(Value::I32).collect(),
        }
    }

    pub fn f32s(items: impl IntoIterator<Item = f32>) -> Array {
        Array {
            elem_type: ValueType::F32,
            values: items.into_iter().map(Value::F32).collect(),
        }
    }
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// Any integer type widened to i128 (so u64 and i64 both fit); `None` for non-integers.
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Floats, and integers converted to f64 (ds4's "float-ish" acceptance).
    pub fn as_f64_lenient(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_int().map(|i| i as f64),
        }
    }

    /// A short human rendering; long arrays are summarised.
    pub fn display_short(&self, max_items: usize) -> String {
        match self {
            Value::String(s) => {
                if s.chars().count() > 80 {
                    let head: String = s.chars().take(77).collect();
                    format!("{head:?}...")
                } else {
                    format!("{s:?}")
                }
            }
            Value::Array(a) => {
                let shown: Vec<String> = a
                    .values
                    .iter()
                    .take(max_items)
                    .map(|v| v.display_short(0))
                    .collect();
                let more = if a.values.len() > max_items {
                    format!(", ... ({} items)", a.values.len())
                } else {
                    String::new()
                };
                format!("[{}]{} <{}>", shown.join(", "), more, a.elem_type)
            }
            Value::F32(v) => format!("{v}"),
            Value::F64(v) => format!("{v}"),
            Value::Bool(v) => format!("{v}"),
            other => other.as_int().map(|i| i.to_string()).unwrap_or_default(),
        }
    }
}
