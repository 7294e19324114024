//! HF checkpoint → ds4-layout GGUF.
//!
//! The header comes from `ds4_model::layout::model_header`, so a converted file has exactly
//! the keys, key types, tensor names, dims and order that validation (and ds4) expect. The
//! checkpoint is matched against that table *before* anything is written: every unknown,
//! missing, mis-shaped or wrongly typed tensor is collected and reported together.
//!
//! Payloads are streamed in table order. A plain tensor is read, encoded and written a chunk
//! of rows at a time; routed experts one batch of experts at a time (each expert quantized
//! independently, with IQ2_XXS importance = that expert's column energy, docs/gguf.md §5.4). Encoding
//! runs on rayon but results are written in a fixed order, so two conversions of the same
//! checkpoint are byte-identical.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use ds4_gguf::quant;
use ds4_gguf::{GgmlType, Header, TensorInfo};
use ds4_model::layout::{model_header, TokenizerData, TypeRecipe};
use ds4_model::{HParams, ModelSpec, Strictness};
use rayon::prelude::*;

use crate::checkpoint::{Checkpoint, SourceTensor};
use crate::config::hparams_from_config;
use crate::error::{io_err, CheckpointProblem, ConvertError, Result};
use crate::imatrix::Imatrix;
use crate::mapping::{self, map_name, ExpertPart, Mapped, PackedPart, Scheme};
use crate::progress::Progress;
use crate::tokenizer;
use ds4_gguf::GgufWriter;

/// Options of `ds4-convert hf`.
#[derive(Debug, Clone)]
pub struct HfOptions {
    pub recipe: TypeRecipe,
    /// `f32`, `q2`, `q4` or `mxfp4`: only used in messages.
    pub recipe_name: String,
    /// A HF `tokenizer.json` to embed; without it a generated vocabulary is used.
    pub tokenizer: Option<PathBuf>,
    /// `general.name`; defaults to "DeepSeek V4 (converted from DIR)".
    pub name: Option<String>,
    /// Where the MTP sidecar goes when the checkpoint has an MTP block; `None`: beside the
    /// output, [`mtp_path`].
    pub mtp_out: Option<PathBuf>,
    /// Leave the MTP block out even when the checkpoint has one.
    pub skip_mtp: bool,
    /// An importance matrix for the routed experts (`--imatrix`), and the file it came from.
    pub imatrix: Option<(PathBuf, std::sync::Arc<Imatrix>)>,
}

impl HfOptions {
    pub fn new(recipe_name: &str) -> Option<HfOptions> {
        Some(HfOptions {
            recipe: TypeRecipe::from_name(recipe_name)?,
            recipe_name: recipe_name.to_string(),
            tokenizer: None,
            name: None,
            mtp_out: None,
            skip_mtp: false,
            imatrix: None,
        })
    }
}

/// Where one GGUF tensor's payload comes from.
#[derive(Debug, Clone)]
enum Source {
    Direct(String),
    /// Per-expert matrices, expert order.
    Experts(Vec<String>),
    /// A packed tensor; `part` selects the gate or up half of `gate_up_proj`.
    Packed {
        name: String,
        part: ExpertPart,
    },
}

/// A checked conversion: the header to write and, per tensor, its source.
pub struct Plan {
    pub hparams: HParams,
    pub header: Header,
    pub scheme: Scheme,
    /// Checkpoint tensors deliberately left out (the MTP block).
    pub skipped: Vec<String>,
    sources: Vec<Source>,
    /// Weights the routed experts' quantization when set.
    imatrix: Option<std::sync::Arc<Imatrix>>,
}

/// What a finished conversion did.
#[derive(Debug, Clone)]
pub struct Report {
    pub bytes: u64,
    pub tensors: usize,
    pub scheme: Scheme,
    pub skipped: Vec<String>,
    /// The most dequantized f32 bytes held at once (the memory bound of a conversion: a chunk of
    /// one tensor, one whole tensor for IQ2_XXS, or one batch of experts; never a shard).
    pub peak_f32_bytes: u64,
    /// The MTP sidecar written beside the model: its path, bytes and tensor count.
    pub mtp: Option<(PathBuf, u64, usize)>,
}

/// The default MTP sidecar path for `out`: `X.gguf` → `X-mtp.gguf` (else `out` + `-mtp.gguf`).
pub fn mtp_path(out: &Path) -> PathBuf {
    let s = out.to_string_lossy();
    match s.strip_suffix(".gguf") {
        Some(stem) => PathBuf::from(format!("{stem}-mtp.gguf")),
        None => PathBuf::from(format!("{s}-mtp.gguf")),
    }
}

fn float_problem(t: &SourceTensor) -> Option<CheckpointProblem> {
    use safetensors::Dtype as D;
    let low_precision = matches!(
        t.dtype,
        D::F8_E5M2 | D::F8_E8M0 | D::F4 | D::F6_E2M3 | D::F6_E3M2
    );
    (!t.is_float()).then(|| CheckpointProblem::Dtype {
        name: t.name.clone(),
        dtype: format!("{:?}", t.dtype),
        accepted: if low_precision {
            "F32, BF16, F16, and the official release's F8_E4M3 and packed-FP4 I8 weights with \
             their F8_E8M0 .scale tensors (other low-precision encodings are not DeepSeek V4's)"
        } else {
            "F32, BF16, F16, and F8_E4M3 / packed-FP4 I8 weights with F8_E8M0 .scale tensors"
        },
    })
}

fn torch_shape(dims: &[u64]) -> Vec<u64> {
    dims.iter().rev().copied().collect()
}

/// Reads `config.json` of `dir`.
pub fn read_config(dir: &Path) -> Result<HParams> {
    let path = dir.join("config.json");
    let text = std::fs::read(&path).map_err(io_err(&path))?;
    let json: serde_json::Value =
        serde_json::from_slice(&text).map_err(|source| ConvertError::Json {
            path: path.clone(),
            source,
        })?;
    hparams_from_config(&json)
}

/// Checks that every tensor's ne0 is a whole number of blocks of its target type.
pub(crate) fn check_block_alignment(header: &Header, recipe_name: &str) -> Result<()> {
    for t in &header.tensors {
        let ne0 = t.dims.first().copied().unwrap_or(0);
        if t.ty.row_bytes(ne0).is_none() {
            return Err(ConvertError::NotBlockAligned {
                name: t.name.clone(),
                ty: t.ty.name(),
                ne0,
                block: t.ty.block_elems().unwrap_or(0),
                recipe: recipe_name.to_string(),
            });
        }
    }
    Ok(())
}

/// Matches a checkpoint against the layout its config implies.
pub fn plan(ckpt: &Checkpoint, hparams: HParams, opts: &HfOptions) -> Result<Plan> {
    let h = hparams;
    let tok: TokenizerData = match &opts.tokenizer {
        Some(p) => {
            let t = tokenizer::from_hf_json(p, h.n_vocab)?;
            if t.tokens.len() != h.n_vocab {
                return Err(ConvertError::Tokenizer {
                    path: p.clone(),
                    message: format!(
                        "has {} tokens but config.json says vocab_size = {}",
                        t.tokens.len(),
                        h.n_vocab
                    ),
                });
            }
            t
        }
        None => tokenizer::generated_tokenizer(h.n_vocab),
    };
    let name = opts.name.clone().unwrap_or_else(|| {
        let d = ckpt
            .dir
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        format!("DeepSeek V4 (converted from {d})")
    });
    let mut header = model_header(&h, &opts.recipe, &name, &tok);
    check_block_alignment(&header, &opts.recipe_name)?;
    let scheme = Scheme::detect(ckpt.tensors.keys().map(String::as_str));
    let (sources, skipped) = match_block(ckpt, &mut header, Block::Main, &h, scheme)?;
    ModelSpec::from_header(&header, Strictness::Layout)?;
    let imatrix = match &opts.imatrix {
        Some((path, im)) => {
            check_imatrix(path, im, &header, h.n_expert)?;
            // The provenance keys ds4's quantizer adds (docs/gguf.md §3.4); nothing reads them.
            let file = path
                .file_name()
                .map_or_else(String::new, |f| f.to_string_lossy().into_owned());
            header.set("quantize.imatrix.file", ds4_gguf::Value::String(file));
            header.set(
                "quantize.imatrix.entries_count",
                ds4_gguf::Value::U64(im.entries.len() as u64),
            );
            if let Some(d) = &im.dataset {
                header.set(
                    "quantize.imatrix.dataset",
                    ds4_gguf::Value::String(d.clone()),
                );
            }
            if let Some(c) = im.chunks {
                header.set(
                    "quantize.imatrix.chunks_count",
                    ds4_gguf::Value::U64(c.max(0) as u64),
                );
            }
            Some(im.clone())
        }
        None => None,
    };
    Ok(Plan {
        hparams: h,
        header,
        scheme,
        skipped,
        sources,
        imatrix,
    })
}

/// An imatrix must cover every routed tensor the recipe quantizes with importance (IQ2_XXS,
/// Q2_K, Q4_K), with `n_expert · ne0` values each: a file missing some, or sized for another
/// model, is refused with the tensors named rather than silently half-applied.
pub(crate) fn check_imatrix(
    path: &Path,
    im: &Imatrix,
    header: &Header,
    n_expert: usize,
) -> Result<()> {
    let mut missing = Vec::new();
    for t in &header.tensors {
        let routed = [ExpertPart::Gate, ExpertPart::Up, ExpertPart::Down]
            .iter()
            .any(|p| t.name.ends_with(p.gguf_suffix()));
        if !routed || !matches!(t.ty, GgmlType::Iq2Xxs | GgmlType::Q2K | GgmlType::Q4K) {
            continue;
        }
        match im.entries.get(&t.name) {
            None => missing.push(t.name.clone()),
            Some(e) => {
                let want = n_expert * t.dims[0] as usize;
                if e.values.len() != want {
                    return Err(ConvertError::Imatrix {
                        path: path.to_path_buf(),
                        message: format!(
                            "entry {} has {} values; the model needs {want} ({n_expert} experts × {})",
                            t.name,
                            e.values.len(),
                            t.dims[0]
                        ),
                    });
                }
            }
        }
    }
    if !missing.is_empty() {
        return Err(ConvertError::Imatrix {
            path: path.to_path_buf(),
            message: format!(
                "no entry for {} routed tensor(s): {}",
                missing.len(),
                missing.join(", ")
            ),
        });
    }
    Ok(())
}

/// Which part of the checkpoint a header is matched against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    /// The model: every key but `mtp.*`.
    Main,
    /// The MTP sidecar (docs/gguf.md §4.7): the `mtp.0.*` keys only.
    Mtp,
}

/// The MTP sidecar's header when the checkpoint has `mtp.*` tensors (the official release
/// does; transformers drops them): the five keys and 32 tensors of docs/gguf.md §3.5/§4.7, in
/// the published types for q2/q4 (ds4 ships one Q4_K sidecar for both) and all F32 for `f32`.
pub fn plan_mtp(ckpt: &Checkpoint, hparams: HParams, opts: &HfOptions) -> Result<Option<Plan>> {
    if !ckpt
        .tensors
        .keys()
        .any(|k| k.strip_prefix("model.").unwrap_or(k).starts_with("mtp."))
    {
        return Ok(None);
    }
    let h = hparams;
    let mut tensors = ds4_model::layout::mtp_tensor_table(&h);
    if opts.recipe_name == "f32" {
        for t in &mut tensors {
            t.ty = GgmlType::F32;
        }
    }
    let u32v = |n: usize| ds4_gguf::Value::U32(n as u32);
    let mut header = Header {
        metadata: vec![
            (
                "general.architecture".into(),
                ds4_gguf::Value::String("deepseek4_mtp_support".into()),
            ),
            (
                "general.name".into(),
                ds4_gguf::Value::String(match &opts.name {
                    Some(n) => format!("{n} MTP support"),
                    None => "DeepSeek V4 Flash MTP support".into(),
                }),
            ),
            ("deepseek4.expert_count".into(), u32v(h.n_expert)),
            ("deepseek4.mtp_layer_count".into(), u32v(1)),
            ("deepseek4.nextn_predict_layers".into(), u32v(1)),
        ],
        tensors,
    };
    check_block_alignment(&header, &opts.recipe_name)?;
    let scheme = Scheme::detect(ckpt.tensors.keys().map(String::as_str));
    let (sources, skipped) = match_block(ckpt, &mut header, Block::Mtp, &h, scheme)?;
    Ok(Some(Plan {
        hparams: h,
        header,
        scheme,
        skipped,
        sources,
        // The MTP experts use the file's entries when it has them (`mtp.0.*`), else the
        // default search.
        imatrix: opts.imatrix.as_ref().map(|(_, im)| im.clone()),
    }))
}

/// Matches the checkpoint's tensors of `block` against `header`: the source of every header
/// tensor, and the keys of the other block (left to its own plan). All problems are collected
/// and refused together.
fn match_block(
    ckpt: &Checkpoint,
    header: &mut Header,
    block: Block,
    h: &HParams,
    scheme: Scheme,
) -> Result<(Vec<Source>, Vec<String>)> {
    let mut problems = Vec::new();
    let mut skipped = Vec::new();
    let mut direct: HashMap<String, &SourceTensor> = HashMap::new();
    let mut experts: BTreeMap<(usize, ExpertPart), BTreeMap<usize, &SourceTensor>> =
        BTreeMap::new();
    let mut packed: HashMap<(usize, PackedPart), &SourceTensor> = HashMap::new();
    for (key, t) in &ckpt.tensors {
        let mapped = match block {
            Block::Main => map_name(key),
            Block::Mtp => mapping::map_mtp_name(key),
        };
        match mapped {
            Mapped::Tensor(g) => {
                if let Some(prev) = direct.insert(g.clone(), t) {
                    problems.push(CheckpointProblem::Duplicate {
                        name: key.clone(),
                        other: prev.name.clone(),
                        gguf: g,
                    });
                }
            }
            Mapped::Expert {
                layer,
                expert,
                part,
            } => {
                experts.entry((layer, part)).or_default().insert(expert, t);
            }
            Mapped::Packed { layer, part } => {
                packed.insert((layer, part), t);
            }
            Mapped::Skipped => skipped.push(key.clone()),
            Mapped::Unknown => problems.push(CheckpointProblem::Unexpected { name: key.clone() }),
        }
    }

    let n_exp = h.n_expert;
    let mut sources = Vec::with_capacity(header.tensors.len());
    let mut keep = Vec::with_capacity(header.tensors.len());
    let mut used_experts: Vec<(usize, ExpertPart)> = Vec::new();
    let mut used_packed: Vec<(usize, PackedPart)> = Vec::new();
    for info in &header.tensors {
        let want = torch_shape(&info.dims);
        let layer: Option<usize> = info
            .name
            .strip_prefix("blk.")
            .or_else(|| info.name.strip_prefix("mtp."))
            .and_then(|r| r.split_once('.'))
            .and_then(|(l, _)| l.parse().ok());
        let part = [ExpertPart::Gate, ExpertPart::Up, ExpertPart::Down]
            .into_iter()
            .find(|p| info.name.ends_with(p.gguf_suffix()));
        if let (Some(il), Some(part)) = (layer, part) {
            // Routed experts: per expert, or packed.
            let pk = if part == ExpertPart::Down {
                PackedPart::Down
            } else {
                PackedPart::GateUp
            };
            let per = experts.get(&(il, part));
            let pack = packed.get(&(il, pk));
            used_experts.push((il, part));
            used_packed.push((il, pk));
            match (per, pack) {
                (Some(_), Some(_)) => {
                    problems.push(CheckpointProblem::MixedExperts { layer: il });
                    sources.push(Source::Experts(Vec::new()));
                }
                (None, Some(p)) => {
                    // (N, 2F, E) for gate_up, (N, E, F) for down.
                    let expect = if pk == PackedPart::GateUp {
                        vec![want[0], 2 * want[1], want[2]]
                    } else {
                        want.clone()
                    };
                    if p.shape != expect {
                        problems.push(CheckpointProblem::Shape {
                            name: p.name.clone(),
                            found: p.shape.clone(),
                            expected: expect,
                        });
                    }
                    problems.extend(float_problem(p));
                    sources.push(Source::Packed {
                        name: p.name.clone(),
                        part,
                    });
                }
                (per, None) => {
                    let empty = BTreeMap::new();
                    let per = per.unwrap_or(&empty);
                    let one = want[1..].to_vec();
                    let mut names = Vec::with_capacity(n_exp);
                    for e in 0..n_exp {
                        match per.get(&e) {
                            Some(t) => {
                                if t.shape != one {
                                    problems.push(CheckpointProblem::Shape {
                                        name: t.name.clone(),
                                        found: t.shape.clone(),
                                        expected: one.clone(),
                                    });
                                }
                                problems.extend(float_problem(t));
                                names.push(t.name.clone());
                            }
                            None => problems.push(CheckpointProblem::Missing {
                                source: match block {
                                    Block::Main => mapping::expert_source_name(il, e, part, scheme),
                                    Block::Mtp => mapping::expert_source_name(il, e, part, scheme)
                                        .replacen("layers.0.", "mtp.0.", 1),
                                },
                                gguf: format!("{} (expert {e})", info.name),
                                shape: one.clone(),
                            }),
                        }
                    }
                    for (&e, t) in per.range(n_exp..) {
                        let _ = e;
                        problems.push(CheckpointProblem::Unexpected {
                            name: t.name.clone(),
                        });
                    }
                    sources.push(Source::Experts(names));
                }
            }
            keep.push(true);
            continue;
        }
        match direct.remove(&info.name) {
            Some(t) => {
                if t.shape != want {
                    problems.push(CheckpointProblem::Shape {
                        name: t.name.clone(),
                        found: t.shape.clone(),
                        expected: want.clone(),
                    });
                }
                if info.ty == GgmlType::I32 {
                    if !t.is_int() {
                        problems.push(CheckpointProblem::Dtype {
                            name: t.name.clone(),
                            dtype: format!("{:?}", t.dtype),
                            accepted: "I64 and I32",
                        });
                    }
                } else {
                    problems.extend(float_problem(t));
                }
                sources.push(Source::Direct(t.name.clone()));
                keep.push(true);
            }
            None if block == Block::Main
                && info
                    .name
                    .ends_with(ds4_model::LayerTensor::RouterBias.suffix()) =>
            {
                // ds4 treats the selection bias as optional: leave it out of the file.
                sources.push(Source::Direct(String::new()));
                keep.push(false);
            }
            None => {
                problems.push(CheckpointProblem::Missing {
                    source: match block {
                        Block::Main => mapping::source_name(&info.name, scheme),
                        Block::Mtp => mapping::mtp_source_name(&info.name),
                    },
                    gguf: info.name.clone(),
                    shape: want,
                });
                sources.push(Source::Direct(String::new()));
                keep.push(true);
            }
        }
    }
    // Whatever was not consumed does not belong to this config.
    for t in direct.values() {
        problems.push(CheckpointProblem::Unexpected {
            name: t.name.clone(),
        });
    }
    for (k, per) in &experts {
        if !used_experts.contains(k) {
            problems.extend(per.values().map(|t| CheckpointProblem::Unexpected {
                name: t.name.clone(),
            }));
        }
    }
    for (k, t) in &packed {
        if !used_packed.contains(k) {
            problems.push(CheckpointProblem::Unexpected {
                name: t.name.clone(),
            });
        }
    }
    if !problems.is_empty() {
        problems.sort_by_key(|p| p.to_string());
        problems.dedup();
        return Err(ConvertError::Checkpoint {
            dir: ckpt.dir.clone(),
            problems,
        });
    }
    let mut it = keep.iter();
    header.tensors.retain(|_| *it.next().unwrap_or(&true));
    let mut it = keep.iter();
    sources.retain(|_| *it.next().unwrap_or(&true));
    Ok((sources, skipped))
}

/// Elements decoded per chunk of a plain tensor (16 MiB of f32).
const CHUNK_ELEMS: usize = 1 << 22;

fn quant_err(name: &str) -> impl Fn(quant::QuantError) -> ConvertError + '_ {
    move |source| ConvertError::Quant {
        name: name.to_string(),
        source,
    }
}

/// Encodes whole rows of `ne0` values to `ty`, splitting rows over threads.
/// `importance` (IQ2_XXS) is per column and shared by all rows.
fn encode_rows(
    name: &str,
    ty: GgmlType,
    src: &[f32],
    ne0: usize,
    importance: Option<&[f32]>,
) -> Result<Vec<u8>> {
    let rows = src.len() / ne0;
    let threads = rayon::current_num_threads().max(1);
    let per = rows.div_ceil(threads).max(1);
    let parts: Vec<Result<Vec<u8>>> = src
        .par_chunks(per * ne0)
        .map(|part| {
            if ty.is_quantized() {
                quant::quantize_matrix(ty, part, ne0, importance)
            } else {
                quant::quantize(ty, part, None)
            }
            .map_err(quant_err(name))
        })
        .collect();
    let mut out = Vec::with_capacity(ty.bytes_for(src.len() as u64).unwrap_or(0) as usize);
    for p in parts {
        out.extend_from_slice(&p?);
    }
    Ok(out)
}

/// `imp[c] = Σ_rows x[r][c]²`, accumulated in f32 in row order (ds4's synthetic importance).
fn column_energy(src: &[f32], ne0: usize) -> Vec<f32> {
    let mut acc = vec![0f32; ne0];
    for row in src.chunks_exact(ne0) {
        for (a, v) in acc.iter_mut().zip(row) {
            *a += v * v;
        }
    }
    acc
}

fn write_direct<W: Write>(
    ckpt: &Checkpoint,
    info: &TensorInfo,
    src: &SourceTensor,
    n_expert: usize,
    w: &mut GgufWriter<W>,
    progress: &mut dyn Progress,
    peak: &mut u64,
) -> Result<()> {
    let ne0 = info.dims[0] as usize;
    let total = src.n_elements() as usize;
    if info.ty == GgmlType::I32 {
        let mut vals = vec![0i64; total];
        ckpt.read_ints(src, 0, &mut vals)?;
        let mut out = Vec::with_capacity(total * 4);
        for (i, v) in vals.iter().enumerate() {
            if *v < 0 || *v >= n_expert as i64 {
                return Err(ConvertError::BadValue {
                    name: src.name.clone(),
                    message: format!(
                        "element {i} (token {}, slot {}) is expert id {v}, outside 0..{n_expert}",
                        i / ne0.max(1),
                        i % ne0.max(1)
                    ),
                });
            }
            out.extend_from_slice(&(*v as i32).to_le_bytes());
        }
        w.write(&out)?;
        progress.advance(out.len() as u64);
        return Ok(());
    }
    if info.ty == GgmlType::Iq2Xxs {
        // Column importance needs every row first: whole tensor in memory (no recipe puts
        // a non-routed tensor in IQ2_XXS; this keeps arbitrary recipes correct).
        let mut all = vec![0f32; total];
        *peak = (*peak).max(4 * total as u64);
        ckpt.read_f32(src, 0, &mut all)?;
        let imp = column_energy(&all, ne0);
        let bytes = encode_rows(&info.name, info.ty, &all, ne0, Some(&imp))?;
        w.write(&bytes)?;
        progress.advance(bytes.len() as u64);
        return Ok(());
    }
    let rows_per_chunk = (CHUNK_ELEMS / ne0).max(1);
    let mut buf = vec![0f32; (rows_per_chunk * ne0).min(total)];
    *peak = (*peak).max(4 * buf.len() as u64);
    let mut first = 0usize;
    while first < total {
        let n = (total - first).min(buf.len());
        ckpt.read_f32(src, first as u64, &mut buf[..n])?;
        let bytes = encode_rows(&info.name, info.ty, &buf[..n], ne0, None)?;
        w.write(&bytes)?;
        progress.advance(bytes.len() as u64);
        first += n;
    }
    Ok(())
}

fn write_experts<W: Write>(
    info: &TensorInfo,
    load: &(dyn Fn(usize, &mut [f32]) -> Result<()> + Sync),
    imatrix: Option<&Imatrix>,
    n_expert: usize,
    w: &mut GgufWriter<W>,
    progress: &mut dyn Progress,
    peak: &mut u64,
) -> Result<()> {
    let ne0 = info.dims[0] as usize;
    let per_expert = (info.dims[0] * info.dims[1]) as usize;
    let batch = rayon::current_num_threads().max(1);
    *peak = (*peak).max(4 * (batch.min(n_expert) * per_expert) as u64);
    for start in (0..n_expert).step_by(batch) {
        let end = (start + batch).min(n_expert);
        let parts: Vec<Result<Vec<u8>>> = (start..end)
            .into_par_iter()
            .map(|e| {
                let mut m = vec![0f32; per_expert];
                load(e, &mut m)?;
                // One expert = one matrix. With an imatrix entry, its slice for this expert
                // weights the search (docs/gguf.md §5.4); otherwise IQ2_XXS importance is the
                // expert's own column energy and Q2_K/Q4_K use the plain search, as ds4 does
                // without --imatrix; MXFP4 has no search (block max → E8M0 scale, nearest
                // E2M1 code).
                let imp = match imatrix {
                    Some(im) => im.importance(&info.name, ne0, Some((e, n_expert)))?,
                    None => None,
                };
                quant::quantize_matrix(info.ty, &m, ne0, imp.as_deref()).map_err(|source| {
                    ConvertError::Quant {
                        name: format!("{} (expert {e})", info.name),
                        source,
                    }
                })
            })
            .collect();
        for p in parts {
            let p = p?;
            w.write(&p)?;
            progress.advance(p.len() as u64);
        }
    }
    Ok(())
}

/// MXFP4 experts from the release's packed FP4 (docs/gguf.md §5.5): each expert's blocks are
/// its own codes and scales ([`Checkpoint::read_mxfp4`]), not a requantization, so the
/// conversion is lossless. False (nothing written) unless every expert is packed FP4 of
/// the planned shape; the caller then quantizes the decoded values as for any source.
fn write_experts_mxfp4<W: Write>(
    ckpt: &Checkpoint,
    info: &TensorInfo,
    srcs: &[&SourceTensor],
    w: &mut GgufWriter<W>,
    progress: &mut dyn Progress,
) -> Result<bool> {
    let per_expert = GgmlType::Mxfp4
        .bytes_for(info.dims[0] * info.dims[1])
        .unwrap_or(0);
    let copyable = |t: &SourceTensor| match &t.encoding {
        crate::official::Encoding::Fp4 { scale } => {
            t.shape[..] == [info.dims[1], info.dims[0]]
                && info.dims[0].is_multiple_of(crate::official::FP4_BLOCK)
                && scale.cols == info.dims[0] / crate::official::FP4_BLOCK
        }
        _ => false,
    };
    if !srcs.iter().all(|t| copyable(t)) {
        return Ok(false);
    }
    for src in srcs {
        let blocks = ckpt
            .read_mxfp4(src)?
            .filter(|b| b.len() as u64 == per_expert)
            .ok_or_else(|| ConvertError::BadValue {
                name: src.name.clone(),
                message: "packed FP4 that does not make whole MXFP4 blocks".into(),
            })?;
        w.write(&blocks)?;
        progress.advance(blocks.len() as u64);
    }
    Ok(true)
}

/// Writes a planned conversion to `out`. Returns the writer, the bytes written and the most
/// dequantized f32 bytes held at once ([`Report::peak_f32_bytes`]).
pub fn write<W: Write>(
    ckpt: &Checkpoint,
    plan: &Plan,
    out: W,
    progress: &mut dyn Progress,
) -> Result<(W, u64, u64)> {
    let mut peak = 0u64;
    let total: u64 = plan
        .header
        .tensors
        .iter()
        .map(|t| t.n_bytes().unwrap_or(0))
        .sum();
    progress.start(total);
    let mut w = GgufWriter::new(out, plan.header.clone())?;
    let n_expert = plan.hparams.n_expert;
    let imatrix = plan.imatrix.as_deref();
    for (info, source) in plan.header.tensors.iter().zip(&plan.sources) {
        progress.tensor(&info.name);
        let get = |n: &str| -> Result<&SourceTensor> {
            ckpt.tensors.get(n).ok_or_else(|| ConvertError::BadValue {
                name: n.to_string(),
                message: "vanished from the checkpoint index".into(),
            })
        };
        match source {
            Source::Direct(n) => {
                write_direct(ckpt, info, get(n)?, n_expert, &mut w, progress, &mut peak)?
            }
            Source::Experts(names) => {
                let srcs: Vec<&SourceTensor> =
                    names.iter().map(|n| get(n)).collect::<Result<_>>()?;
                if info.ty == GgmlType::Mxfp4
                    && write_experts_mxfp4(ckpt, info, &srcs, &mut w, progress)?
                {
                    continue;
                }
                let load = |e: usize, m: &mut [f32]| ckpt.read_f32(srcs[e], 0, m);
                write_experts(info, &load, imatrix, n_expert, &mut w, progress, &mut peak)?;
            }
            Source::Packed { name, part } => {
                let src = get(name)?;
                let per = info.dims[0] * info.dims[1];
                let load = |e: usize, m: &mut [f32]| {
                    let first = match part {
                        // gate_up_proj[e] = [gate (F rows); up (F rows)]
                        ExpertPart::Gate => 2 * per * e as u64,
                        ExpertPart::Up => 2 * per * e as u64 + per,
                        ExpertPart::Down => per * e as u64,
                    };
                    ckpt.read_f32(src, first, m)
                };
                write_experts(info, &load, imatrix, n_expert, &mut w, progress, &mut peak)?;
            }
        }
    }
    let (out, bytes) = w.finish()?;
    progress.finish();
    Ok((out, bytes, peak))
}

/// Writes a plan to `path`'s `.partial` file (not renamed yet). Returns bytes and peak f32 bytes.
fn write_partial(
    ckpt: &Checkpoint,
    plan: &Plan,
    path: &Path,
    progress: &mut dyn Progress,
) -> Result<(u64, u64)> {
    let tmp = tmp_path(path);
    let file = File::create(&tmp).map_err(io_err(&tmp))?;
    let (buf, bytes, peak) = write(
        ckpt,
        plan,
        BufWriter::with_capacity(1 << 22, file),
        progress,
    )?;
    let f = buf.into_inner().map_err(|e| ConvertError::Io {
        path: tmp.clone(),
        source: e.into_error(),
    })?;
    f.sync_all().map_err(io_err(&tmp))?;
    Ok((bytes, peak))
}

/// `ds4-convert hf DIR OUT` (also `official`): plans the model and, when the checkpoint has an
/// MTP block, its sidecar, both before writing anything; then writes each to a `.partial` file
/// and renames both only when both are complete, so a failed conversion never leaves a
/// truncated (or a model without its sidecar) GGUF behind.
pub fn convert_hf(
    dir: &Path,
    out: &Path,
    opts: &HfOptions,
    progress: &mut dyn Progress,
) -> Result<Report> {
    let hparams = read_config(dir)?;
    let ckpt = Checkpoint::open(dir)?;
    let main = plan(&ckpt, hparams.clone(), opts)?;
    let mtp = if opts.skip_mtp {
        None
    } else {
        plan_mtp(&ckpt, hparams, opts)?
    };
    let mtp_out = opts.mtp_out.clone().unwrap_or_else(|| mtp_path(out));
    let mut result = write_partial(&ckpt, &main, out, progress);
    let mut mtp_written = None;
    if let (Ok(_), Some(p)) = (&result, &mtp) {
        match write_partial(&ckpt, p, &mtp_out, progress) {
            Ok(r) => mtp_written = Some(r),
            Err(e) => result = Err(e),
        }
    }
    let (bytes, mut peak) = match result {
        Ok(r) => r,
        Err(e) => {
            let _ = std::fs::remove_file(tmp_path(out));
            let _ = std::fs::remove_file(tmp_path(&mtp_out));
            return Err(e);
        }
    };
    std::fs::rename(tmp_path(out), out).map_err(io_err(out))?;
    let mut mtp_report = None;
    if let (Some((b, pk)), Some(p)) = (mtp_written, &mtp) {
        std::fs::rename(tmp_path(&mtp_out), &mtp_out).map_err(io_err(&mtp_out))?;
        peak = peak.max(pk);
        mtp_report = Some((mtp_out, b, p.header.tensors.len()));
    }
    Ok(Report {
        bytes,
        tensors: main.header.tensors.len(),
        scheme: main.scheme,
        skipped: if mtp_report.is_some() {
            Vec::new()
        } else {
            main.skipped
        },
        peak_f32_bytes: peak,
        mtp: mtp_report,
    })
}

/// The exact size of one layout's output, from [`dry_run`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutSize {
    /// The whole GGUF: header, alignment padding and tensor data.
    pub file_bytes: u64,
    /// The tensor data alone (every tensor padded to the alignment).
    pub tensor_bytes: u64,
    /// The MTP sidecar's file size, when the checkpoint has an MTP block and it is kept.
    pub mtp_bytes: Option<u64>,
}

/// `ds4-convert official --dry-run`: plans every named layout (q2, q4, mxfp4, f32, in
/// [`TypeRecipe::NAMED`] order) against the checkpoint exactly as a conversion would (same
/// checks, same header, `opts`' tokenizer, name and imatrix keys) and returns, per layout, the
/// sizes its files would have or why that layout cannot be made from these dims (e.g. a
/// block size that does not divide a row). Reads `config.json` and the safetensors headers
/// only, never a tensor's data. A checkpoint that no layout accepts is an error (the first
/// layout's).
pub fn dry_run(dir: &Path, opts: &HfOptions) -> Result<Vec<(&'static str, Result<LayoutSize>)>> {
    let hparams = read_config(dir)?;
    let ckpt = Checkpoint::open(dir)?;
    let size = |h: &Header| -> Result<(u64, u64)> {
        let mut h = h.clone();
        let data = h.assign_offsets()?;
        Ok((ds4_gguf::file_size(&h)?, data))
    };
    let one = |name: &str, recipe: TypeRecipe| -> Result<LayoutSize> {
        let mut o = opts.clone();
        o.recipe = recipe;
        o.recipe_name = name.to_string();
        let main = plan(&ckpt, hparams.clone(), &o)?;
        let (file_bytes, tensor_bytes) = size(&main.header)?;
        let mtp_bytes = if o.skip_mtp {
            None
        } else {
            match plan_mtp(&ckpt, hparams.clone(), &o)? {
                Some(p) => Some(size(&p.header)?.0),
                None => None,
            }
        };
        Ok(LayoutSize {
            file_bytes,
            tensor_bytes,
            mtp_bytes,
        })
    };
    let mut out: Vec<(&'static str, Result<LayoutSize>)> = TypeRecipe::NAMED
        .iter()
        .map(|(name, recipe)| (*name, one(name, *recipe)))
        .collect();
    if out.iter().all(|(_, r)| r.is_err()) {
        return Err(out.swap_remove(0).1.unwrap_err());
    }
    Ok(out)
}

pub(crate) fn tmp_path(out: &Path) -> PathBuf {
    let mut s = out.as_os_str().to_owned();
    s.push(".partial");
    PathBuf::from(s)
}
