//! A GGUF writer that takes each tensor's payload in arbitrarily small pieces.
//!
//! `ds4_gguf::GgufWriter` wants a tensor's chunks in one call; the converter and the synthetic
//! generator produce a 0.5 GB expert tensor a few MB at a time and must not hold it whole.
//! This writer lays the file out exactly as `GgufWriter` and `ds4_gguf::file_size` do
//! (header, zero padding to the alignment, payloads back to back in table order, each padded
//! with zeros to the alignment), so sizes and bytes agree with them.

use std::io::Write;

use ds4_gguf::header::align_up;
use ds4_gguf::{encode_header, GgufError, Header};

use crate::error::{ConvertError, Result};

pub struct StreamWriter<W: Write> {
    out: W,
    header: Header,
    alignment: u64,
    /// Index of the tensor being written.
    next: usize,
    /// Bytes of the current tensor written so far.
    in_tensor: u64,
    written: u64,
}

fn io(context: &str) -> impl FnOnce(std::io::Error) -> ConvertError + '_ {
    move |source| {
        ConvertError::Gguf(GgufError::Io {
            context: context.to_string(),
            source,
        })
    }
}

fn zeros(out: &mut impl Write, n: u64) -> Result<()> {
    const Z: [u8; 256] = [0; 256];
    let mut left = n;
    while left > 0 {
        let k = left.min(Z.len() as u64) as usize;
        out.write_all(&Z[..k]).map_err(io("writing padding"))?;
        left -= k as u64;
    }
    Ok(())
}

impl<W: Write> StreamWriter<W> {
    /// Assigns back-to-back offsets, writes the header and the padding before the data.
    pub fn new(mut out: W, mut header: Header) -> Result<StreamWriter<W>> {
        let alignment = header.alignment()?;
        header.assign_offsets()?;
        let bytes = encode_header(&header)?;
        let data = align_up(bytes.len() as u64, alignment)
            .ok_or_else(|| ConvertError::Usage("header size overflows".into()))?;
        out.write_all(&bytes)
            .map_err(io("writing the GGUF header"))?;
        zeros(&mut out, data - bytes.len() as u64)?;
        let mut w = StreamWriter {
            out,
            header,
            alignment,
            next: 0,
            in_tensor: 0,
            written: data,
        };
        w.skip_empty()?;
        Ok(w)
    }

    /// The header with its final offsets.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Index of the tensor the next bytes belong to (`None` when all are complete).
    pub fn current(&self) -> Option<usize> {
        (self.next < self.header.tensors.len()).then_some(self.next)
    }

    fn size(&self, i: usize) -> u64 {
        self.header.tensors[i].n_bytes().unwrap_or(0)
    }

    /// Zero-byte tensors complete immediately.
    fn skip_empty(&mut self) -> Result<()> {
        while self.next < self.header.tensors.len() && self.size(self.next) == 0 {
            self.next += 1;
        }
        Ok(())
    }

    /// Appends payload bytes to the current tensor. A piece may not cross into the next
    /// tensor; when a tensor is complete its padding is written and the next one begins.
    pub fn write(&mut self, data: &[u8]) -> Result<()> {
        let Some(i) = self.current() else {
            return Err(ConvertError::Usage(format!(
                "{} bytes written after the last tensor",
                data.len()
            )));
        };
        let want = self.size(i);
        if self.in_tensor + data.len() as u64 > want {
            return Err(ConvertError::Usage(format!(
                "tensor {}: {} bytes supplied, it has {want}",
                self.header.tensors[i].name,
                self.in_tensor + data.len() as u64
            )));
        }
        self.out
            .write_all(data)
            .map_err(io("writing tensor data"))?;
        self.in_tensor += data.len() as u64;
        if self.in_tensor == want {
            let padded = align_up(want, self.alignment).unwrap_or(want);
            zeros(&mut self.out, padded - want)?;
            self.written += padded;
            self.in_tensor = 0;
            self.next += 1;
            self.skip_empty()?;
        }
        Ok(())
    }

    /// Checks every tensor is complete, flushes, and returns the sink and the file size.
    pub fn finish(mut self) -> Result<(W, u64)> {
        if let Some(i) = self.current() {
            return Err(ConvertError::Usage(format!(
                "tensor {} is incomplete ({} of {} bytes) and {} more follow",
                self.header.tensors[i].name,
                self.in_tensor,
                self.size(i),
                self.header.tensors.len() - i - 1
            )));
        }
        self.out.flush().map_err(io("flushing the GGUF file"))?;
        Ok((self.out, self.written))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_gguf::{GgmlType, GgufWriter, TensorInfo, Value};

    fn header() -> Header {
        let t = |name: &str, dims: Vec<u64>, ty| TensorInfo {
            name: name.into(),
            dims,
            ty,
            offset: 0,
        };
        Header {
            metadata: vec![("a".into(), Value::U32(7))],
            tensors: vec![
                t("x", vec![3], GgmlType::F32),
                t("y", vec![64, 2], GgmlType::Q8_0),
                t("z", vec![5], GgmlType::F16),
            ],
        }
    }

    #[test]
    fn same_bytes_as_ggufwriter_and_file_size() {
        let payload: Vec<Vec<u8>> = header()
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| vec![i as u8 + 1; t.n_bytes().unwrap() as usize])
            .collect();
        let mut a = GgufWriter::new(Vec::new(), header()).unwrap();
        for p in &payload {
            a.write_tensor(p).unwrap();
        }
        let (a, na) = a.finish().unwrap();
        let mut b = StreamWriter::new(Vec::new(), header()).unwrap();
        for p in &payload {
            for c in p.chunks(5) {
                b.write(c).unwrap();
            }
        }
        let (b, nb) = b.finish().unwrap();
        assert_eq!(a, b);
        assert_eq!(na, nb);
        assert_eq!(nb, ds4_gguf::file_size(&header()).unwrap());
        assert_eq!(b.len() as u64, nb);
    }

    #[test]
    fn refuses_overflow_and_incomplete() {
        let mut w = StreamWriter::new(Vec::new(), header()).unwrap();
        let e = w.write(&[0; 13]).unwrap_err().to_string();
        assert!(e.contains("tensor x: 13 bytes supplied, it has 12"), "{e}");
        w.write(&[0; 12]).unwrap();
        let e = w.finish().unwrap_err().to_string();
        assert!(e.contains("tensor y is incomplete"), "{e}");
    }
}
