//! Vocabulary-only GGUF: `general.*` + `tokenizer.ggml.*` and zero tensors. It carries the
//! real V4 tokenizer tables for tokenizer tests and for `synthetic --vocab-gguf`, at ~5 MB
//! instead of the 86 GB model.

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use ds4_gguf::{Header, Value};
use ds4_model::layout::{tokenizer_metadata, TokenizerData};

use crate::convert::tmp_path;
use crate::error::{io_err, ConvertError, Result};
use crate::tokenizer;
use ds4_gguf::GgufWriter;

/// The header of a vocabulary-only file.
pub fn vocab_header(tok: &TokenizerData, name: &str) -> Header {
    let mut metadata = vec![
        (
            "general.architecture".to_string(),
            Value::String("deepseek4".into()),
        ),
        ("general.type".to_string(), Value::String("vocab".into())),
        ("general.name".to_string(), Value::String(name.into())),
    ];
    metadata.extend(tokenizer_metadata(tok));
    Header {
        metadata,
        tensors: Vec::new(),
    }
}

/// `ds4-convert vocab --tokenizer tokenizer.json OUT`. Returns the file size.
pub fn write_vocab(tokenizer_json: &Path, out: &Path, name: &str) -> Result<u64> {
    let tok = tokenizer::from_hf_json(tokenizer_json, 0)?;
    let header = vocab_header(&tok, name);
    let tmp = tmp_path(out);
    let f = File::create(&tmp).map_err(io_err(&tmp))?;
    let w = GgufWriter::new(BufWriter::new(f), header)?;
    let (buf, bytes) = w.finish()?;
    buf.into_inner().map_err(|e| ConvertError::Io {
        path: tmp.clone(),
        source: e.into_error(),
    })?;
    std::fs::rename(&tmp, out).map_err(io_err(out))?;
    Ok(bytes)
}
