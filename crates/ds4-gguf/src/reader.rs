//! GGUF v3 parsing over a byte slice (an mmap in practice), with every count and offset
//! checked against the bytes actually present before anything is allocated.

use std::collections::HashSet;
use std::fs::File;
use std::mem::size_of;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{GgufError, Result};
use crate::header::{
    align_up, Header, TensorInfo, GGUF_MAGIC, GGUF_VERSION, MAX_DIMS, MAX_NESTING,
};
use crate::types::GgmlType;
use crate::value::{Array, Value, ValueType};

/// Heap bytes the parser may use beyond the file's own size. Parsed metadata is stored
/// packed (see [`Array`]), so a file's arrays and strings never cost more heap than the
/// bytes they occupy; what remains (key records, tensor records, the duplicate-name sets)
/// is charged against this allowance plus the file size, and a header that would need more
/// is refused before the allocation is made.
pub const PARSE_MEMORY_SLACK: u64 = 1 << 20;

/// Heap bytes charged per entry of a duplicate-name set: a hash table of `String` keys
/// (24 bytes and a control byte per slot, at most 8/7 load, doubled when it grows), rounded
/// up so the charge bounds what the table really takes.
const SET_SLOT: u64 = 64;

/// A cursor over untrusted bytes; every read is bounds-checked, and every allocation
/// sized by the file is charged to `budget` first.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Heap bytes still allowed (file size + [`PARSE_MEMORY_SLACK`] at the start).
    budget: u64,
}

impl<'a> Cursor<'a> {
    /// Takes `bytes` from the memory budget, or refuses naming what needed them.
    fn charge(&mut self, bytes: u64, what: &dyn Fn() -> String) -> Result<()> {
        if bytes > self.budget {
            return Err(GgufError::TooMuchMemory {
                what: what(),
                needed: bytes,
                file_len: self.buf.len() as u64,
                slack: PARSE_MEMORY_SLACK,
            });
        }
        self.budget -= bytes;
        Ok(())
    }

    /// [`Cursor::charge`] for `count` items of `size` bytes.
    fn charge_n(&mut self, count: u64, size: usize, what: &dyn Fn() -> String) -> Result<()> {
        self.charge(count.saturating_mul(size as u64), what)
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what.to_string(),
                offset: self.pos as u64,
                needed: n,
                available: self.remaining(),
            });
        }
        let n = n as usize;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn fixed<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.fixed(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.fixed(what)?))
    }

    /// Checks that `count` items of at least `min_len` bytes each can still fit.
    fn check_count(&self, count: u64, min_len: u64, what: &str) -> Result<()> {
        let max = self.remaining() / min_len.max(1);
        if count > max {
            return Err(GgufError::AbsurdCount {
                what: what.to_string(),
                count,
                offset: self.pos as u64,
                remaining: self.remaining(),
                max,
            });
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let at = self.pos as u64;
        let bytes = self.take(len, what)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| GgufError::InvalidUtf8 {
                what: what.to_string(),
                offset: at,
            })
    }

    fn value(&mut self, ty: ValueType, key: &str, depth: usize) -> Result<Value> {
        let what = || format!("value of {key:?}");
        Ok(match ty {
            ValueType::U8 => Value::U8(self.fixed::<1>(&what())?[0]),
            ValueType::I8 => Value::I8(self.fixed::<1>(&what())?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.fixed(&what())?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.fixed(&what())?)),
            ValueType::U32 => Value::U32(self.u32(&what())?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.fixed(&what())?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.fixed(&what())?)),
            ValueType::Bool => match self.fixed::<1>(&what())?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    return Err(GgufError::BadValue {
                        key: key.to_string(),
                        problem: format!("bool byte is {b}, expected 0 or 1"),
                    })
                }
            },
            ValueType::U64 => Value::U64(self.u64(&what())?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.fixed(&what())?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.fixed(&what())?)),
            ValueType::String => Value::String(self.string(&what())?),
            ValueType::Array => Value::Array(self.array(key, depth)?),
        })
    }

    /// An array value: element type, count, then the elements, read into packed storage
    /// whose size is charged to the budget before it is allocated.
    fn array(&mut self, key: &str, depth: usize) -> Result<Array> {
        if depth >= MAX_NESTING {
            return Err(GgufError::NestingTooDeep {
                key: key.to_string(),
                max: MAX_NESTING,
            });
        }
        let at = self.pos as u64;
        let code = self.u32(&format!("array element type of {key:?}"))?;
        let elem_type = ValueType::from_code(code).ok_or_else(|| GgufError::UnknownValueType {
            key: key.to_string(),
            code,
            offset: at,
        })?;
        let count = self.u64(&format!("array length of {key:?}"))?;
        self.check_count(
            count,
            elem_type.min_encoded_len(),
            &format!("array {key:?} element"),
        )?;
        let what = || format!("array {key:?} ({count} {elem_type} elements)");
        let n = count as usize;
        let elem = || format!("element of array {key:?}");
        macro_rules! numbers {
            ($t:ty, $make:expr) => {{
                self.charge_n(count, std::mem::size_of::<$t>(), &what)?;
                let mut v: Vec<$t> = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(<$t>::from_le_bytes(self.fixed(&elem())?));
                }
                $make(v)
            }};
        }
        Ok(match elem_type {
            ValueType::U8 => numbers!(u8, Array::from_u8s),
            ValueType::I8 => numbers!(i8, Array::from_i8s),
            ValueType::U16 => numbers!(u16, Array::from_u16s),
            ValueType::I16 => numbers!(i16, Array::from_i16s),
            ValueType::U32 => numbers!(u32, Array::from_u32s),
            ValueType::I32 => numbers!(i32, Array::i32s),
            ValueType::F32 => numbers!(f32, Array::f32s),
            ValueType::U64 => numbers!(u64, Array::from_u64s),
            ValueType::I64 => numbers!(i64, Array::from_i64s),
            ValueType::F64 => numbers!(f64, Array::from_f64s),
            ValueType::Bool => {
                self.charge_n(count, 1, &what)?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(match self.fixed::<1>(&elem())?[0] {
                        0 => false,
                        1 => true,
                        b => {
                            return Err(GgufError::BadValue {
                                key: key.to_string(),
                                problem: format!("bool byte is {b}, expected 0 or 1"),
                            })
                        }
                    });
                }
                Array::from_bools(v)
            }
            ValueType::String => {
                // First pass: the total text size, so the buffer is allocated (and charged)
                // once at its exact size.
                let start = self.pos;
                let mut total = 0u64;
                for _ in 0..n {
                    let len = self.u64(&elem())?;
                    self.take(len, &elem())?;
                    total += len;
                }
                self.pos = start;
                self.charge(total, &what)?;
                self.charge_n(count, std::mem::size_of::<usize>(), &what)?;
                let mut text = String::with_capacity(total as usize);
                let mut ends = Vec::with_capacity(n);
                for _ in 0..n {
                    let len = self.u64(&elem())?;
                    let at = self.pos as u64;
                    let bytes = self.take(len, &elem())?;
                    let s = std::str::from_utf8(bytes).map_err(|_| GgufError::InvalidUtf8 {
                        what: elem(),
                        offset: at,
                    })?;
                    text.push_str(s);
                    ends.push(text.len());
                }
                Array::from_packed_strings(text, ends).expect("ends ascend on char boundaries")
            }
            ValueType::Array => {
                self.charge_n(count, std::mem::size_of::<Array>(), &what)?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.array(key, depth + 1)?);
                }
                Array::from_arrays(v)
            }
        })
    }
}

/// Layout facts of a parsed file, beyond the header itself.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    pub version: u32,
    pub alignment: u64,
    /// Absolute file offset where the data section starts.
    pub data_offset: u64,
    /// Bytes of the whole file.
    pub file_len: u64,
}

/// Parses and validates a complete GGUF image: header, metadata, tensor table, and that
/// every tensor lies aligned, inside the file, and does not overlap another.
pub fn parse(buf: &[u8]) -> Result<(Header, Layout)> {
    let file_len = buf.len() as u64;
    if file_len < 24 {
        return Err(GgufError::TooSmall { len: file_len });
    }
    let mut c = Cursor {
        buf,
        pos: 0,
        budget: file_len.saturating_add(PARSE_MEMORY_SLACK),
    };
    let magic = c.u32("magic")?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32("version")?;
    if version != GGUF_VERSION {
        return Err(GgufError::BadVersion { found: version });
    }
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.u64("metadata count")?;
    // A KV record is at least key(8) + type(4) + 1 byte; a tensor info at least 8+4+8+4+8.
    c.check_count(n_kv, 13, "metadata key/value")?;
    let mut header = Header::default();
    let mut seen = HashSet::new();
    c.charge_n(n_kv, size_of::<(String, Value)>(), &|| {
        format!("the table of {n_kv} metadata records")
    })?;
    header.metadata.reserve(n_kv as usize);
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key #{i}"))?;
        // The key itself, its copy in the duplicate check, and that set's slot.
        c.charge(2 * key.len() as u64 + SET_SLOT, &|| {
            format!("metadata key #{i}")
        })?;
        let at = c.pos as u64;
        let code = c.u32(&format!("value type of {key:?}"))?;
        let ty = ValueType::from_code(code).ok_or_else(|| GgufError::UnknownValueType {
            key: key.clone(),
            code,
            offset: at,
        })?;
        let value = c.value(ty, &key, 0)?;
        if !seen.insert(key.clone()) {
            return Err(GgufError::DuplicateKey { key });
        }
        header.metadata.push((key, value));
    }
    c.check_count(n_tensors, 32, "tensor info")?;
    let mut names = HashSet::new();
    // The table, and the span list the overlap check builds from it.
    c.charge_n(
        n_tensors,
        size_of::<TensorInfo>() + size_of::<(u64, u64, &str)>(),
        &|| format!("the table of {n_tensors} tensor records"),
    )?;
    header.tensors.reserve(n_tensors as usize);
    for i in 0..n_tensors {
        let name = c.string(&format!("tensor name #{i}"))?;
        c.charge(2 * name.len() as u64 + SET_SLOT, &|| {
            format!("tensor name #{i}")
        })?;
        let n_dims = c.u32(&format!("dim count of tensor {name:?}"))?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            return Err(GgufError::BadTensor {
                name,
                problem: format!("has {n_dims} dims (allowed 1..={MAX_DIMS})"),
            });
        }
        c.charge_n(u64::from(n_dims), size_of::<u64>(), &|| {
            format!("dims of tensor {name:?}")
        })?;
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&format!("dims of tensor {name:?}"))?);
        }
        let ty = GgmlType::from_code(c.u32(&format!("type of tensor {name:?}"))?);
        let offset = c.u64(&format!("offset of tensor {name:?}"))?;
        if !names.insert(name.clone()) {
            return Err(GgufError::DuplicateTensor { name });
        }
        header.tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
        });
    }
    let alignment = header.alignment()?;
    let data_offset = align_up(c.pos as u64, alignment).unwrap_or(u64::MAX);
    if data_offset > file_len && !header.tensors.is_empty() {
        return Err(GgufError::Truncated {
            what: "padding before the data section".into(),
            offset: c.pos as u64,
            needed: data_offset - c.pos as u64,
            available: c.remaining(),
        });
    }
    check_tensor_spans(&header, alignment, data_offset, file_len)?;
    Ok((
        header,
        Layout {
            version,
            alignment,
            data_offset,
            file_len,
        },
    ))
}

fn check_tensor_spans(h: &Header, align: u64, data_offset: u64, file_len: u64) -> Result<()> {
    let mut spans = Vec::with_capacity(h.tensors.len());
    for t in &h.tensors {
        let bad = |problem: String| GgufError::BadTensor {
            name: t.name.clone(),
            problem,
        };
        let n = t
            .n_elements()
            .ok_or_else(|| bad(format!("dims {:?}: element count overflows u64", t.dims)))?;
        if matches!(t.ty, GgmlType::Unknown(_)) {
            return Err(bad(format!("has unknown ggml type code {}", t.ty.code())));
        }
        let be = t.ty.block_elems().unwrap_or(1);
        if t.dims[0] % be != 0 {
            return Err(bad(format!(
                "ne0 = {} is not a multiple of the {} block size {be}",
                t.dims[0], t.ty
            )));
        }
        let bytes =
            t.ty.bytes_for(n)
                .ok_or_else(|| bad("byte size overflows u64".into()))?;
        if t.offset % align != 0 {
            return Err(bad(format!(
                "data offset {} is not a multiple of the alignment {align}",
                t.offset
            )));
        }
        let end = data_offset
            .checked_add(t.offset)
            .and_then(|s| s.checked_add(bytes))
            .filter(|&e| e <= file_len)
            .ok_or_else(|| {
                bad(format!(
                    "data [{} + {}, {} bytes) lies past the end of the {file_len}-byte file",
                    data_offset, t.offset, bytes
                ))
            })?;
        spans.push((data_offset + t.offset, end, &t.name));
    }
    spans.sort();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(GgufError::Overlap {
                a: w[0].2.clone(),
                b: w[1].2.clone(),
            });
        }
    }
    Ok(())
}

/// Backing bytes of an open file: a read-only mmap (or owned bytes, for tests and fuzzing).
enum Backing {
    Mmap(Mmap),
    Owned(Vec<u8>),
}

/// An open, validated GGUF file whose tensor payloads are zero-copy views into the mapping.
pub struct GgufFile {
    path: Option<PathBuf>,
    backing: Backing,
    header: Header,
    layout: Layout,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("layout", &self.layout)
            .field("n_kv", &self.header.metadata.len())
            .field("n_tensors", &self.header.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and validates `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|source| GgufError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let len = file
            .metadata()
            .map_err(|source| GgufError::Open {
                path: path.to_path_buf(),
                source,
            })?
            .len();
        if len < 24 {
            return Err(GgufError::TooSmall { len });
        }
        // SAFETY: the mapping is read-only. A concurrent truncation of the file by another
        // process could fault on access; that is the accepted contract of mmap-based loaders
        // (ds4, llama.cpp) and documented in ARCHITECTURE.md.
        let map = unsafe { Mmap::map(&file) }.map_err(|source| GgufError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let (header, layout) = parse(&map)?;
        Ok(GgufFile {
            path: Some(path.to_path_buf()),
            backing: Backing::Mmap(map),
            header,
            layout,
        })
    }

    /// Validates an in-memory image (tests, fuzzing, embedded fixtures).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        let (header, layout) = parse(&bytes)?;
        Ok(GgufFile {
            path: None,
            backing: Backing::Owned(bytes),
            header,
            layout,
        })
    }

    /// A file that exists only as its header: tensor payloads are supplied by someone else
    /// (a synthetic model generating weights straight into device memory, where no file of
    /// that size exists). Every payload access ([`GgufFile::tensor_data`]) fails cleanly
    /// because the image holds no data section.
    pub fn header_only(header: Header) -> Result<GgufFile> {
        let bytes = crate::encode_header(&header)?;
        let layout = Layout {
            version: 3,
            alignment: header.alignment()?,
            data_offset: bytes.len() as u64,
            file_len: bytes.len() as u64,
        };
        Ok(GgufFile {
            path: None,
            backing: Backing::Owned(bytes),
            header,
            layout,
        })
    }

    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The whole file image.
    pub fn bytes(&self) -> &[u8] {
        match &self.backing {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Zero-copy payload of `t`. Tensors of this file's own table were validated at open;
    /// a foreign `TensorInfo` is bounds-checked here.
    pub fn tensor_data(&self, t: &TensorInfo) -> Result<&[u8]> {
        let bad = || GgufError::BadTensor {
            name: t.name.clone(),
            problem: "payload lies outside the file".into(),
        };
        let start = self
            .layout
            .data_offset
            .checked_add(t.offset)
            .ok_or_else(bad)?;
        let end = start
            .checked_add(t.n_bytes().ok_or_else(bad)?)
            .ok_or_else(bad)?;
        let (start, end) = (
            usize::try_from(start).map_err(|_| bad())?,
            usize::try_from(end).map_err(|_| bad())?,
        );
        self.bytes().get(start..end).ok_or_else(bad)
    }

    /// Payload of the tensor called `name`.
    pub fn tensor_bytes(&self, name: &str) -> Result<(&TensorInfo, &[u8])> {
        let t = self
            .header
            .tensor(name)
            .ok_or_else(|| GgufError::NoSuchTensor {
                name: name.to_string(),
            })?;
        Ok((t, self.tensor_data(t)?))
    }
}
