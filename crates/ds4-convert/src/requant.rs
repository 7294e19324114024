//! `ds4-convert requant IN.gguf OUT.gguf --types q2|q4 [--imatrix FILE]`: re-encodes a
//! ds4-layout GGUF (normally an F32 one) with another recipe.
//!
//! Why: a model whose checkpoint is gone but whose f32 GGUF is kept (the committed demo
//! model, tests/fixtures/kjv) can still be quantized with an importance matrix collected by
//! `ds4 imatrix`. The header is rebuilt exactly as `hf` builds it (same metadata, names,
//! order; the hyperparameters and vocabulary are read back from IN), and each tensor is
//! dequantized from IN and encoded as `hf` would (routed experts one expert at a time, with
//! the imatrix slice when given), so re-quantizing the f32 conversion of a checkpoint gives
//! the bytes of converting the checkpoint itself.

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use ds4_gguf::quant;
use ds4_gguf::{GgufFile, GgufWriter};
use ds4_model::layout::model_header;
use ds4_model::{ModelSpec, Strictness};
use rayon::prelude::*;

use crate::convert::{tmp_path, HfOptions};
use crate::error::{io_err, ConvertError, Result};
use crate::mapping::ExpertPart;
use crate::progress::Progress;

fn quant_err(name: String) -> impl Fn(quant::QuantError) -> ConvertError {
    move |source| ConvertError::Quant {
        name: name.clone(),
        source,
    }
}

/// Re-encodes `input` with `opts.recipe` into `out` (via `out.partial`). Returns the bytes.
pub fn requantize(
    input: &Path,
    out: &Path,
    opts: &HfOptions,
    progress: &mut dyn Progress,
) -> Result<u64> {
    let file = GgufFile::open(input)?;
    let spec = ModelSpec::from_header(file.header(), Strictness::Layout)?;
    let h = spec.hparams.clone();
    let tok = crate::tokenizer::from_gguf(input, file.header())?;
    let name = opts.name.clone().unwrap_or_else(|| {
        file.header()
            .get("general.name")
            .and_then(|v| v.as_str())
            .unwrap_or("DeepSeek V4")
            .to_string()
    });
    let mut header = model_header(&h, &opts.recipe, &name, &tok);
    crate::convert::check_block_alignment(&header, &opts.recipe_name)?;
    // Tensors the input leaves out (the optional router bias) stay out.
    header
        .tensors
        .retain(|t| file.header().tensor(&t.name).is_some());
    if let Some((path, im)) = &opts.imatrix {
        crate::convert::check_imatrix(path, im, &header, h.n_expert)?;
    }
    let total: u64 = header
        .tensors
        .iter()
        .map(|t| t.n_bytes().unwrap_or(0))
        .sum();
    progress.start(total);
    let tmp = tmp_path(out);
    let result = (|| -> Result<u64> {
        let f = File::create(&tmp).map_err(io_err(&tmp))?;
        let mut w = GgufWriter::new(BufWriter::with_capacity(1 << 22, f), header.clone())?;
        for info in &header.tensors {
            progress.tensor(&info.name);
            let (src, data) = file.tensor_bytes(&info.name)?;
            if src.dims != info.dims {
                return Err(ConvertError::BadValue {
                    name: info.name.clone(),
                    message: format!("dims {:?} in the input, {:?} expected", src.dims, info.dims),
                });
            }
            if info.ty == src.ty && !info.ty.is_quantized() {
                // Exact already (ids, or a plain type kept as it is).
                w.write(data)?;
                progress.advance(data.len() as u64);
                continue;
            }
            let n = info.n_elements().unwrap_or(0) as usize;
            let mut vals = vec![0f32; n];
            quant::dequantize(src.ty, data, &mut vals).map_err(quant_err(info.name.clone()))?;
            let ne0 = info.dims[0] as usize;
            let routed = [ExpertPart::Gate, ExpertPart::Up, ExpertPart::Down]
                .iter()
                .any(|p| info.name.ends_with(p.gguf_suffix()));
            let bytes: Vec<u8> = if routed {
                let per = (info.dims[0] * info.dims[1]) as usize;
                let parts: Vec<Result<Vec<u8>>> = vals
                    .par_chunks(per)
                    .enumerate()
                    .map(|(e, m)| {
                        let imp = match &opts.imatrix {
                            Some((_, im)) => {
                                im.importance(&info.name, ne0, Some((e, h.n_expert)))?
                            }
                            None => None,
                        };
                        quant::quantize_matrix(info.ty, m, ne0, imp.as_deref())
                            .map_err(quant_err(format!("{} (expert {e})", info.name)))
                    })
                    .collect();
                let mut all = Vec::new();
                for p in parts {
                    all.extend_from_slice(&p?);
                }
                all
            } else if info.ty.is_quantized() {
                quant::quantize_matrix(info.ty, &vals, ne0, None)
                    .map_err(quant_err(info.name.clone()))?
            } else {
                quant::quantize(info.ty, &vals, None).map_err(quant_err(info.name.clone()))?
            };
            w.write(&bytes)?;
            progress.advance(bytes.len() as u64);
        }
        let (buf, bytes) = w.finish()?;
        let f = buf.into_inner().map_err(|e| ConvertError::Io {
            path: tmp.clone(),
            source: e.into_error(),
        })?;
        f.sync_all().map_err(io_err(&tmp))?;
        Ok(bytes)
    })();
    match result {
        Ok(bytes) => {
            std::fs::rename(&tmp, out).map_err(io_err(out))?;
            progress.finish();
            Ok(bytes)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}
