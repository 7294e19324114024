//! Streaming GGUF v3 writer. The header is written first with offsets laid out back to back
//! (ds4's layout); payloads then follow in table order, so files far larger than RAM
//! (the 80.76 GiB synthetic model) are written with bounded memory.

use std::io::Write;

use crate::error::{GgufError, Result};
use crate::header::{align_up, Header, GGUF_MAGIC, GGUF_VERSION};
use crate::value::Value;

fn io_err(context: &str) -> impl FnOnce(std::io::Error) -> GgufError + '_ {
    move |source| GgufError::Io {
        context: context.to_string(),
        source,
    }
}

/// Encodes the header (magic .. tensor infos, without the data padding) into bytes.
pub fn encode_header(h: &Header) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    out.extend_from_slice(&GGUF_MAGIC.to_le_bytes());
    out.extend_from_slice(&GGUF_VERSION.to_le_bytes());
    out.extend_from_slice(&(h.tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(h.metadata.len() as u64).to_le_bytes());
    for (k, v) in &h.metadata {
        put_str(&mut out, k);
        out.extend_from_slice(&v.value_type().code().to_le_bytes());
        put_value(&mut out, k, v)?;
    }
    for t in &h.tensors {
        put_str(&mut out, &t.name);
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&t.ty.code().to_le_bytes());
        out.extend_from_slice(&t.offset.to_le_bytes());
    }
    Ok(out)
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, key: &str, v: &Value) -> Result<()> {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Array(a) => {
            out.extend_from_slice(&a.elem_type.code().to_le_bytes());
            out.extend_from_slice(&(a.values.len() as u64).to_le_bytes());
            for e in &a.values {
                if e.value_type() != a.elem_type {
                    return Err(GgufError::Writer(format!(
                        "array {key:?} declares {} elements but holds a {}",
                        a.elem_type,
                        e.value_type()
                    )));
                }
                put_value(out, key, e)?;
            }
        }
    }
    Ok(())
}

/// Writes a GGUF file: `new` lays out offsets and writes the header; `write_tensor` is then
/// called once per tensor in table order; `finish` checks nothing is missing.
pub struct GgufWriter<W: Write> {
    out: W,
    header: Header,
    alignment: u64,
    next: usize,
    written: u64,
}

impl<W: Write> GgufWriter<W> {
    /// Assigns back-to-back offsets to `header`'s tensors and writes the header and the
    /// padding up to the data section.
    pub fn new(mut out: W, mut header: Header) -> Result<GgufWriter<W>> {
        let alignment = header.alignment()?;
        header.assign_offsets()?;
        let bytes = encode_header(&header)?;
        let data_offset = align_up(bytes.len() as u64, alignment)
            .ok_or_else(|| GgufError::Writer("header size overflows".into()))?;
        out.write_all(&bytes)
            .map_err(io_err("writing the GGUF header"))?;
        write_zeros(&mut out, data_offset - bytes.len() as u64)?;
        Ok(GgufWriter {
            out,
            header,
            alignment,
            next: 0,
            written: data_offset,
        })
    }

    /// The header as laid out (with final offsets).
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Name and expected byte size of the next tensor to write, if any.
    pub fn next_tensor(&self) -> Option<(&str, u64)> {
        let t = self.header.tensors.get(self.next)?;
        Some((&t.name, t.n_bytes().unwrap_or(0)))
    }

    /// Writes the payload of the next tensor (exactly its byte size) plus padding.
    pub fn write_tensor(&mut self, data: &[u8]) -> Result<()> {
        self.write_tensor_chunks(std::iter::once(data))
    }

    /// Writes the next tensor's payload from several chunks (streamed generation).
    pub fn write_tensor_chunks<'a>(
        &mut self,
        chunks: impl IntoIterator<Item = &'a [u8]>,
    ) -> Result<()> {
        let t =
            self.header.tensors.get(self.next).ok_or_else(|| {
                GgufError::Writer("write_tensor called after the last tensor".into())
            })?;
        let want = t.n_bytes().unwrap_or(0);
        let mut got = 0u64;
        for c in chunks {
            got += c.len() as u64;
            if got > want {
                return Err(GgufError::Writer(format!(
                    "tensor {:?}: more than its {want} bytes supplied",
                    t.name
                )));
            }
            self.out
                .write_all(c)
                .map_err(io_err(&format!("writing tensor {:?}", t.name)))?;
        }
        if got != want {
            return Err(GgufError::Writer(format!(
                "tensor {:?}: {got} bytes supplied, {want} expected",
                t.name
            )));
        }
        let padded = align_up(want, self.alignment).unwrap_or(want);
        write_zeros(&mut self.out, padded - want)?;
        self.written += padded;
        self.next += 1;
        Ok(())
    }

    /// Checks every tensor was written, flushes, and returns the sink and total bytes.
    pub fn finish(mut self) -> Result<(W, u64)> {
        if self.next != self.header.tensors.len() {
            return Err(GgufError::Writer(format!(
                "only {} of {} tensors written",
                self.next,
                self.header.tensors.len()
            )));
        }
        self.out.flush().map_err(io_err("flushing the GGUF file"))?;
        Ok((self.out, self.written))
    }
}

fn write_zeros(out: &mut impl Write, n: u64) -> Result<()> {
    const Z: [u8; 64] = [0; 64];
    let mut left = n;
    while left > 0 {
        let k = left.min(64) as usize;
        out.write_all(&Z[..k]).map_err(io_err("writing padding"))?;
        left -= k as u64;
    }
    Ok(())
}

/// Total file size a header would produce, without writing anything (`--dry-run`).
pub fn file_size(header: &Header) -> Result<u64> {
    let mut h = header.clone();
    let align = h.alignment()?;
    let data = h.assign_offsets()?;
    let head = encode_header(&h)?.len() as u64;
    align_up(head, align)
        .and_then(|d| d.checked_add(data))
        .ok_or_else(|| GgufError::Writer("file size overflows u64".into()))
}
