//! Streaming GGUF v3 writer. The header is written first with offsets laid out back to back
//! (ds4's layout); payloads then follow in table order, so files far larger than RAM
//! (the 80.76 GiB synthetic model) are written with bounded memory.

use std::io::Write;

use crate::error::{GgufError, Result};
use crate::header::{align_up, Header, GGUF_MAGIC, GGUF_VERSION};
use crate::value::{Array, Elem, Value};

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
        put_value(&mut out, v);
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

fn put_value(out: &mut Vec<u8>, v: &Value) {
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
        Value::Array(a) => put_array(out, a),
    }
}

/// An array's element type, count and elements (the packed storage guarantees every
/// element has the declared type, so nothing can fail).
fn put_array(out: &mut Vec<u8>, a: &Array) {
    out.extend_from_slice(&a.elem_type().code().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    for e in a.iter() {
        match e {
            Elem::U8(x) => out.push(x),
            Elem::I8(x) => out.push(x as u8),
            Elem::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            Elem::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            Elem::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Elem::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Elem::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Elem::Bool(x) => out.push(u8::from(x)),
            Elem::String(s) => put_str(out, s),
            Elem::Array(inner) => put_array(out, inner),
            Elem::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Elem::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Elem::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        }
    }
}

/// Writes a GGUF file: `new` lays out offsets and writes the header; payload bytes then
/// follow in table order, either a whole tensor at a time (`write_tensor`) or in pieces of
/// any size (`write`, for streamed generation); `finish` checks nothing is missing.
/// Zero-byte tensors need no payload and are passed over automatically.
pub struct GgufWriter<W: Write> {
    out: W,
    header: Header,
    alignment: u64,
    next: usize,
    /// Bytes of the current tensor written so far.
    in_tensor: u64,
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
        let mut w = GgufWriter {
            out,
            header,
            alignment,
            next: 0,
            in_tensor: 0,
            written: data_offset,
        };
        w.skip_empty();
        Ok(w)
    }

    /// The header as laid out (with final offsets).
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Index of the tensor the next bytes belong to, if any remain.
    pub fn current(&self) -> Option<usize> {
        (self.next < self.header.tensors.len()).then_some(self.next)
    }

    /// Name and remaining byte count of the tensor being written, if any.
    pub fn next_tensor(&self) -> Option<(&str, u64)> {
        let t = self.header.tensors.get(self.next)?;
        Some((&t.name, self.size(self.next) - self.in_tensor))
    }

    fn size(&self, i: usize) -> u64 {
        self.header.tensors[i].n_bytes().unwrap_or(0)
    }

    fn skip_empty(&mut self) {
        while self.next < self.header.tensors.len() && self.size(self.next) == 0 {
            self.next += 1;
        }
    }

    /// Appends payload bytes to the current tensor; when it is complete its padding is
    /// written and the next tensor begins. A piece may not run past the current tensor.
    pub fn write(&mut self, data: &[u8]) -> Result<()> {
        let Some(i) = self.current() else {
            return Err(GgufError::Writer(format!(
                "{} bytes written after the last tensor",
                data.len()
            )));
        };
        let want = self.size(i);
        let got = self.in_tensor + data.len() as u64;
        if got > want {
            return Err(GgufError::Writer(format!(
                "tensor {:?}: {got} bytes supplied, it has {want}",
                self.header.tensors[i].name
            )));
        }
        self.out.write_all(data).map_err(io_err(&format!(
            "writing tensor {:?}",
            self.header.tensors[i].name
        )))?;
        self.in_tensor = got;
        if got == want {
            let padded = align_up(want, self.alignment).unwrap_or(want);
            write_zeros(&mut self.out, padded - want)?;
            self.written += padded;
            self.in_tensor = 0;
            self.next += 1;
            self.skip_empty();
        }
        Ok(())
    }

    /// Writes the whole payload of the next tensor (exactly its byte size) plus padding.
    pub fn write_tensor(&mut self, data: &[u8]) -> Result<()> {
        if let Some(i) = self.current() {
            let want = self.size(i);
            if self.in_tensor != 0 || data.len() as u64 != want {
                return Err(GgufError::Writer(format!(
                    "tensor {:?}: {} bytes supplied, {want} expected",
                    self.header.tensors[i].name,
                    data.len()
                )));
            }
        }
        self.write(data)
    }

    /// Checks every tensor was written, flushes, and returns the sink and total bytes.
    pub fn finish(mut self) -> Result<(W, u64)> {
        if let Some(i) = self.current() {
            return Err(GgufError::Writer(format!(
                "tensor {:?} is incomplete ({} of {} bytes): only {} of {} tensors written",
                self.header.tensors[i].name,
                self.in_tensor,
                self.size(i),
                i,
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
