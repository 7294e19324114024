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

/// A typed array, stored packed by element type: numbers in a `Vec` of their own type and
/// strings as one text buffer plus end offsets. A file's bytes then never cost more heap
/// than they occupy (a `Vec<Value>` spent 32 bytes on every 1-byte element), which is what
/// keeps the parser's memory within the file's size (see `reader::PARSE_MEMORY_SLACK`).
/// `elem_type` is kept even when empty so the file's bytes can be reproduced.
#[derive(Debug, Clone, PartialEq)]
pub struct Array {
    data: ArrayData,
}

/// The packed storage of an [`Array`].
#[derive(Debug, Clone, PartialEq)]
enum ArrayData {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    /// All strings back to back; `ends[i]` is where string `i` ends in `text`.
    String {
        text: String,
        ends: Vec<usize>,
    },
    Array(Vec<Array>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

/// One element of an [`Array`], borrowed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Elem<'a> {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(&'a str),
    Array(&'a Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl<'a> Elem<'a> {
    pub fn value_type(&self) -> ValueType {
        match self {
            Elem::U8(_) => ValueType::U8,
            Elem::I8(_) => ValueType::I8,
            Elem::U16(_) => ValueType::U16,
            Elem::I16(_) => ValueType::I16,
            Elem::U32(_) => ValueType::U32,
            Elem::I32(_) => ValueType::I32,
            Elem::F32(_) => ValueType::F32,
            Elem::Bool(_) => ValueType::Bool,
            Elem::String(_) => ValueType::String,
            Elem::Array(_) => ValueType::Array,
            Elem::U64(_) => ValueType::U64,
            Elem::I64(_) => ValueType::I64,
            Elem::F64(_) => ValueType::F64,
        }
    }

    /// The element as an owned [`Value`].
    pub fn to_value(&self) -> Value {
        match *self {
            Elem::U8(v) => Value::U8(v),
            Elem::I8(v) => Value::I8(v),
            Elem::U16(v) => Value::U16(v),
            Elem::I16(v) => Value::I16(v),
            Elem::U32(v) => Value::U32(v),
            Elem::I32(v) => Value::I32(v),
            Elem::F32(v) => Value::F32(v),
            Elem::Bool(v) => Value::Bool(v),
            Elem::String(v) => Value::String(v.to_string()),
            Elem::Array(v) => Value::Array(v.clone()),
            Elem::U64(v) => Value::U64(v),
            Elem::I64(v) => Value::I64(v),
            Elem::F64(v) => Value::F64(v),
        }
    }

    pub fn as_str(&self) -> Option<&'a str> {
        match *self {
            Elem::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&'a Array> {
        match *self {
            Elem::Array(a) => Some(a),
            _ => None,
        }
    }

    /// Any integer type widened to i128; `None` for non-integers.
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            Elem::U8(v) => v.into(),
            Elem::I8(v) => v.into(),
            Elem::U16(v) => v.into(),
            Elem::I16(v) => v.into(),
            Elem::U32(v) => v.into(),
            Elem::I32(v) => v.into(),
            Elem::U64(v) => v.into(),
            Elem::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Floats, and integers converted to f64.
    pub fn as_f64_lenient(&self) -> Option<f64> {
        match *self {
            Elem::F32(v) => Some(v.into()),
            Elem::F64(v) => Some(v),
            _ => self.as_int().map(|i| i as f64),
        }
    }
}

impl Array {
    /// Builds an array, checking every element has `elem_type`.
    pub fn new(elem_type: ValueType, values: Vec<Value>) -> Option<Array> {
        if !values.iter().all(|v| v.value_type() == elem_type) {
            return None;
        }
        macro_rules! take {
            ($variant:ident) => {
                ArrayData::$variant(
                    values
                        .into_iter()
                        .map(|v| match v {
                            Value::$variant(x) => x,
                            _ => unreachable!("element types checked above"),
                        })
                        .collect(),
                )
            };
        }
        let data = match elem_type {
            ValueType::U8 => take!(U8),
            ValueType::I8 => take!(I8),
            ValueType::U16 => take!(U16),
            ValueType::I16 => take!(I16),
            ValueType::U32 => take!(U32),
            ValueType::I32 => take!(I32),
            ValueType::F32 => take!(F32),
            ValueType::Bool => take!(Bool),
            ValueType::U64 => take!(U64),
            ValueType::I64 => take!(I64),
            ValueType::F64 => take!(F64),
            ValueType::Array => take!(Array),
            ValueType::String => {
                return Some(Array::strings(values.into_iter().map(|v| match v {
                    Value::String(s) => s,
                    _ => unreachable!("element types checked above"),
                })))
            }
        };
        Some(Array { data })
    }

    pub fn strings<S: Into<String>>(items: impl IntoIterator<Item = S>) -> Array {
        let mut text = String::new();
        let mut ends = Vec::new();
        for s in items {
            text.push_str(&s.into());
            ends.push(text.len());
        }
        Array {
            data: ArrayData::String { text, ends },
        }
    }

    pub fn i32s(items: impl IntoIterator<Item = i32>) -> Array {
        Array {
            data: ArrayData::I32(items.into_iter().collect()),
        }
    }

    pub fn f32s(items: impl IntoIterator<Item = f32>) -> Array {
        Array {
            data: ArrayData::F32(items.into_iter().collect()),
        }
    }

    /// Strings from a text buffer and end offsets (the reader's packed form). `None` when
    /// the offsets do not ascend within `text` or cut a UTF-8 character.
    pub(crate) fn from_packed_strings(text: String, ends: Vec<usize>) -> Option<Array> {
        let mut start = 0;
        for &e in &ends {
            if e < start || e > text.len() || !text.is_char_boundary(e) {
                return None;
            }
            start = e;
        }
        Some(Array {
            data: ArrayData::String { text, ends },
        })
    }

    pub(crate) fn from_u8s(v: Vec<u8>) -> Array {
        Array {
            data: ArrayData::U8(v),
        }
    }
    pub(crate) fn from_i8s(v: Vec<i8>) -> Array {
        Array {
            data: ArrayData::I8(v),
        }
    }
    pub(crate) fn from_u16s(v: Vec<u16>) -> Array {
        Array {
            data: ArrayData::U16(v),
        }
    }
    pub(crate) fn from_i16s(v: Vec<i16>) -> Array {
        Array {
            data: ArrayData::I16(v),
        }
    }
    pub(crate) fn from_u32s(v: Vec<u32>) -> Array {
        Array {
            data: ArrayData::U32(v),
        }
    }
    pub(crate) fn from_bools(v: Vec<bool>) -> Array {
        Array {
            data: ArrayData::Bool(v),
        }
    }
    pub(crate) fn from_u64s(v: Vec<u64>) -> Array {
        Array {
            data: ArrayData::U64(v),
        }
    }
    pub(crate) fn from_i64s(v: Vec<i64>) -> Array {
        Array {
            data: ArrayData::I64(v),
        }
    }
    pub(crate) fn from_f64s(v: Vec<f64>) -> Array {
        Array {
            data: ArrayData::F64(v),
        }
    }
    pub(crate) fn from_arrays(v: Vec<Array>) -> Array {
        Array {
            data: ArrayData::Array(v),
        }
    }

    pub fn elem_type(&self) -> ValueType {
        match &self.data {
            ArrayData::U8(_) => ValueType::U8,
            ArrayData::I8(_) => ValueType::I8,
            ArrayData::U16(_) => ValueType::U16,
            ArrayData::I16(_) => ValueType::I16,
            ArrayData::U32(_) => ValueType::U32,
            ArrayData::I32(_) => ValueType::I32,
            ArrayData::F32(_) => ValueType::F32,
            ArrayData::Bool(_) => ValueType::Bool,
            ArrayData::String { .. } => ValueType::String,
            ArrayData::Array(_) => ValueType::Array,
            ArrayData::U64(_) => ValueType::U64,
            ArrayData::I64(_) => ValueType::I64,
            ArrayData::F64(_) => ValueType::F64,
        }
    }

    pub fn len(&self) -> usize {
        match &self.data {
            ArrayData::U8(v) => v.len(),
            ArrayData::I8(v) => v.len(),
            ArrayData::U16(v) => v.len(),
            ArrayData::I16(v) => v.len(),
            ArrayData::U32(v) => v.len(),
            ArrayData::I32(v) => v.len(),
            ArrayData::F32(v) => v.len(),
            ArrayData::Bool(v) => v.len(),
            ArrayData::String { ends, .. } => ends.len(),
            ArrayData::Array(v) => v.len(),
            ArrayData::U64(v) => v.len(),
            ArrayData::I64(v) => v.len(),
            ArrayData::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i`, if there is one.
    pub fn get(&self, i: usize) -> Option<Elem<'_>> {
        Some(match &self.data {
            ArrayData::U8(v) => Elem::U8(*v.get(i)?),
            ArrayData::I8(v) => Elem::I8(*v.get(i)?),
            ArrayData::U16(v) => Elem::U16(*v.get(i)?),
            ArrayData::I16(v) => Elem::I16(*v.get(i)?),
            ArrayData::U32(v) => Elem::U32(*v.get(i)?),
            ArrayData::I32(v) => Elem::I32(*v.get(i)?),
            ArrayData::F32(v) => Elem::F32(*v.get(i)?),
            ArrayData::Bool(v) => Elem::Bool(*v.get(i)?),
            ArrayData::String { text, ends } => {
                let end = *ends.get(i)?;
                let start = if i == 0 { 0 } else { ends[i - 1] };
                Elem::String(&text[start..end])
            }
            ArrayData::Array(v) => Elem::Array(v.get(i)?),
            ArrayData::U64(v) => Elem::U64(*v.get(i)?),
            ArrayData::I64(v) => Elem::I64(*v.get(i)?),
            ArrayData::F64(v) => Elem::F64(*v.get(i)?),
        })
    }

    /// The elements in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = Elem<'_>> + '_ {
        (0..self.len()).map(|i| self.get(i).expect("index below len"))
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
                    .iter()
                    .take(max_items)
                    .map(|v| v.to_value().display_short(0))
                    .collect();
                let more = if a.len() > max_items {
                    format!(", ... ({} items)", a.len())
                } else {
                    String::new()
                };
                format!("[{}]{} <{}>", shown.join(", "), more, a.elem_type())
            }
            Value::F32(v) => format!("{v}"),
            Value::F64(v) => format!("{v}"),
            Value::Bool(v) => format!("{v}"),
            other => other.as_int().map(|i| i.to_string()).unwrap_or_default(),
        }
    }
}
