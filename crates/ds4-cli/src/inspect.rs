//! `ds4 inspect FILE`: what a GGUF holds and whether ds4-rs can run it, and why not.

use std::fmt::Write as _;
use std::path::Path;

use ds4_gguf::GgufFile;
use ds4_model::catalogue::{classify, TensorClass};
use ds4_model::{ByteAccounting, ModelError, ModelSpec, Strictness};
use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct Report {
    pub path: String,
    pub file_bytes: u64,
    pub version: u32,
    pub alignment: u64,
    pub data_offset: u64,
    pub n_metadata: usize,
    pub n_tensors: usize,
    pub metadata: Vec<(String, String)>,
    /// (type, tensors, bytes) over the whole tensor table.
    pub by_type: Vec<(String, usize, u64)>,
    /// (class, tensors, bytes) over the whole tensor table.
    pub by_class: Vec<(String, usize, u64)>,
    pub verdict: Verdict,
}

#[derive(Debug, Serialize)]
pub struct Verdict {
    pub valid: bool,
    /// "ds4" (the real Flash dims and ds4's types) or "layout" (a consistent ds4-layout
    /// model with other dims or types, e.g. a tiny test model).
    pub strictness: Option<String>,
    pub problems: Vec<String>,
    pub routed_bits: Option<u32>,
    pub tensor_bytes: Option<u64>,
    pub bytes_per_token_short_ctx: Option<u64>,
    pub bytes_per_token_long_ctx: Option<u64>,
    pub per_token_parts: Vec<(String, u64)>,
}

/// Builds the report; only a file that is not a readable GGUF at all is an error.
pub fn inspect(path: &Path, strictness: Strictness) -> Result<Report, ds4_gguf::GgufError> {
    let f = GgufFile::open(path)?;
    let h = f.header();
    let mut by_type: Vec<(String, usize, u64)> = Vec::new();
    let mut by_class: Vec<(TensorClass, usize, u64)> = Vec::new();
    for t in &h.tensors {
        let b = t.n_bytes().unwrap_or(0);
        match by_type.iter_mut().find(|x| x.0 == t.ty.name()) {
            Some(x) => {
                x.1 += 1;
                x.2 += b
            }
            None => by_type.push((t.ty.name(), 1, b)),
        }
        let c = classify(&t.name);
        match by_class.iter_mut().find(|x| x.0 == c) {
            Some(x) => {
                x.1 += 1;
                x.2 += b
            }
            None => by_class.push((c, 1, b)),
        }
    }
    by_type.sort();
    by_class.sort();
    let verdict = match ModelSpec::from_header(h, strictness) {
        Ok(spec) => {
            let acc = ByteAccounting::of(&spec);
            Verdict {
                valid: true,
                strictness: Some(
                    match spec.strictness {
                        Strictness::Ds4 => "ds4",
                        _ => "layout",
                    }
                    .into(),
                ),
                problems: vec![],
                routed_bits: Some(spec.routed_bits()),
                tensor_bytes: Some(acc.tensor_bytes),
                bytes_per_token_short_ctx: Some(acc.per_token_short),
                bytes_per_token_long_ctx: Some(acc.per_token_long),
                per_token_parts: acc.per_token_parts,
            }
        }
        Err(e) => Verdict {
            valid: false,
            strictness: None,
            problems: match e {
                ModelError::Invalid(ps) => ps.iter().map(|p| p.to_string()).collect(),
                other => vec![other.to_string()],
            },
            routed_bits: None,
            tensor_bytes: None,
            bytes_per_token_short_ctx: None,
            bytes_per_token_long_ctx: None,
            per_token_parts: vec![],
        },
    };
    Ok(Report {
        path: path.display().to_string(),
        file_bytes: f.layout().file_len,
        version: f.layout().version,
        alignment: f.layout().alignment,
        data_offset: f.layout().data_offset,
        n_metadata: h.metadata.len(),
        n_tensors: h.tensors.len(),
        metadata: h
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.display_short(8)))
            .collect(),
        by_type,
        by_class: by_class
            .into_iter()
            .map(|(c, n, b)| (c.name().to_string(), n, b))
            .collect(),
        verdict,
    })
}

pub fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// Human rendering of a report.
pub fn render(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "file        {}", r.path);
    let _ = writeln!(
        s,
        "size        {} bytes ({:.2} GiB), GGUF v{}, alignment {}, data at {}",
        r.file_bytes,
        gib(r.file_bytes),
        r.version,
        r.alignment,
        r.data_offset
    );
    let _ = writeln!(s, "\nmetadata ({} keys)", r.n_metadata);
    for (k, v) in &r.metadata {
        let _ = writeln!(s, "  {k:<50} {v}");
    }
    let _ = writeln!(s, "\ntensors ({}) by type", r.n_tensors);
    for (t, n, b) in &r.by_type {
        let _ = writeln!(
            s,
            "  {t:<10} {n:>6} tensors {b:>16} bytes {:>9.3} GiB",
            gib(*b)
        );
    }
    let _ = writeln!(s, "\ntensors by class");
    for (c, n, b) in &r.by_class {
        let _ = writeln!(
            s,
            "  {c:<10} {n:>6} tensors {b:>16} bytes {:>9.3} GiB",
            gib(*b)
        );
    }
    let v = &r.verdict;
    if v.valid {
        let _ = writeln!(
            s,
            "\nverdict     VALID ({} rules{})",
            v.strictness.as_deref().unwrap_or("?"),
            if v.strictness.as_deref() == Some("ds4") {
                ": the real DeepSeek V4 Flash layout"
            } else {
                ": consistent ds4 layout with non-Flash dims or types"
            }
        );
        let _ = writeln!(s, "routed bits {}", v.routed_bits.unwrap_or(0));
        let short = v.bytes_per_token_short_ctx.unwrap_or(0);
        let long = v.bytes_per_token_long_ctx.unwrap_or(0);
        let _ = writeln!(
            s,
            "per token   {short} bytes ({:.2} GB) of weights per decoded token at context <= 4*top_k; {long} bytes ({:.2} GB) beyond",
            short as f64 / 1e9,
            long as f64 / 1e9
        );
        for (name, b) in &v.per_token_parts {
            let _ = writeln!(s, "  {name:<36} {b:>16}");
        }
    } else {
        let _ = writeln!(s, "\nverdict     INVALID ({} problems)", v.problems.len());
        for p in &v.problems {
            let _ = writeln!(s, "  - {p}");
        }
    }
    s
}
