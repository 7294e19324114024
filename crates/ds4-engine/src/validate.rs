//! Argument checks of every [`Backend`](crate::Backend) op, written once for all backends.
//!
//! Every backend calls the function of the same name first thing in each op (the trait's
//! default methods do too), so its own code only ever sees arguments that passed here, and
//! every backend refuses the same calls with the same [`BackendError`]. What stays in a
//! backend is what only it can know: whether a handle is live, and its own capacity limits
//! (a GPU kernel's largest head dim, a 32-bit launch argument).
//!
//! What is checked, per op: every slice lies inside its buffer; every operand holds the
//! elements the op reads or writes (`need`), lengths that must match do; weights have the
//! shape and type the op uses (vector weights their exact length, matrices a type the
//! matmuls multiply, hash tables I32); counts that divide or index are positive; and the
//! aliasing rule below.
//!
//! # The aliasing rule
//!
//! **An operand an op writes shares no buffer with any other operand of that op.** The one
//! exception is an output an op documents as allowed to be *exactly* one of its inputs (the
//! same buffer, offset and length): `rms_norm`'s `out` may be `x`, `hc_pre_norm`'s `out` may
//! be `y`. Operands an op reads and writes itself (`rope`'s `x`, `add`'s `acc`, `hc_post`'s
//! `x`, the compressor's accumulator) are one operand, so the rule is about the others.
//! f32 and i32 buffers are separate spaces and never alias each other.
//!
//! Why the whole buffer and not only overlapping ranges:
//! * The CPU backend lends an op's output buffer out of its buffer table while it reads the
//!   inputs (that is how it writes one buffer and reads others with no `unsafe`), so it
//!   cannot serve an input from the output's buffer. Under a range rule the GPU would
//!   accept calls the reference refuses, and a forward pass checked on one backend could
//!   fail on the other.
//! * A kernel may round its writes up to whole tiles or use the rest of its output buffer
//!   as room, and a backend may order its work by buffer; disjoint ranges of one buffer
//!   would make each of those a silent data race. Whole buffers keep every kernel correct
//!   without reasoning about its exact write set.
//! * It costs nothing: the forward pass gives every activation its own buffer.
//!
//! The two in-place exceptions are safe on every backend because both kernels read a
//! whole row before they write it, and the CPU handles them explicitly.

use ds4_gguf::GgmlType;

use crate::backend::{
    AttnArgs, BResult, BackendError, CompSel, CompressorArgs, CompressorCall, HcArgs, HcPost, IBuf,
    IndexerArgs, IndexerCall, MoeArgs, NormRopeCall, RingStoreCall, RopeArgs, RouterArgs, Routing,
    Slice, Weight,
};

/// `expected == found`, else a [`BackendError::Shape`] naming `what`.
pub fn shape(op: &'static str, what: &str, expected: usize, found: usize) -> BResult<()> {
    if expected != found {
        return Err(BackendError::Shape {
            op,
            what: what.to_string(),
            expected,
            found,
        });
    }
    Ok(())
}

/// `s` lies inside its buffer.
pub fn in_range(s: Slice, op: &'static str) -> BResult<()> {
    let end = s.off.checked_add(s.len);
    if end.is_none_or(|e| e > s.buf.len()) {
        return Err(BackendError::OutOfRange {
            op,
            id: s.buf.id(),
            off: s.off,
            end: end.unwrap_or(usize::MAX),
            len: s.buf.len(),
        });
    }
    Ok(())
}

/// `s` lies inside its buffer and holds at least `n` elements.
pub fn need(s: Slice, n: usize, op: &'static str, what: &str) -> BResult<()> {
    in_range(s, op)?;
    if s.len < n {
        return Err(BackendError::Shape {
            op,
            what: format!("{what} length"),
            expected: n,
            found: s.len,
        });
    }
    Ok(())
}

/// An i32 buffer holds at least `n` values.
fn need_i(b: IBuf, n: usize, op: &'static str, what: &str) -> BResult<()> {
    if b.len() < n {
        return Err(BackendError::Shape {
            op,
            what: what.to_string(),
            expected: n,
            found: b.len(),
        });
    }
    Ok(())
}

fn invalid(op: &'static str, problem: impl Into<String>) -> BackendError {
    BackendError::Invalid {
        op,
        problem: problem.into(),
    }
}

fn positive(op: &'static str, what: &str, v: usize) -> BResult<()> {
    if v == 0 {
        return Err(invalid(op, format!("{what} must be positive")));
    }
    Ok(())
}

/// The aliasing rule: no written slice shares a buffer with any other operand.
pub fn disjoint(op: &'static str, writes: &[Slice], reads: &[Slice]) -> BResult<()> {
    for (i, w) in writes.iter().enumerate() {
        let others = writes[i + 1..].iter().chain(reads);
        if let Some(o) = others.into_iter().find(|o| o.buf.id() == w.buf.id()) {
            return Err(BackendError::Aliasing { op, id: o.buf.id() });
        }
    }
    Ok(())
}

/// A vector weight of exactly `len` values.
fn vector(w: Weight, len: usize, op: &'static str, what: &str) -> BResult<()> {
    shape(op, &format!("{what} length"), len, w.info.n_elements())
}

/// A weight the matmul ops multiply (anything but an integer table).
fn matrix(w: Weight, op: &'static str) -> BResult<()> {
    if w.info.ty == GgmlType::I32 {
        return Err(BackendError::UnsupportedType { op, ty: w.info.ty });
    }
    Ok(())
}

// ---- memory ----------------------------------------------------------------------------

pub fn upload(dst: Slice, src_len: usize) -> BResult<()> {
    in_range(dst, "upload")?;
    shape("upload", "source length", dst.len, src_len)
}

pub fn download(src: Slice, dst_len: usize) -> BResult<()> {
    in_range(src, "download")?;
    shape("download", "destination length", src.len, dst_len)
}

fn i32_range(op: &'static str, b: IBuf, off: usize, n: usize) -> BResult<()> {
    let end = off.saturating_add(n);
    if end > b.len() {
        return Err(BackendError::OutOfRange {
            op,
            id: b.id(),
            off,
            end,
            len: b.len(),
        });
    }
    Ok(())
}

pub fn upload_i32(dst: IBuf, off: usize, src_len: usize) -> BResult<()> {
    i32_range("upload_i32", dst, off, src_len)
}

pub fn download_i32(src: IBuf, off: usize, dst_len: usize) -> BResult<()> {
    i32_range("download_i32", src, off, dst_len)
}

pub fn copy(src: Slice, dst: Slice) -> BResult<()> {
    const OP: &str = "copy";
    in_range(src, OP)?;
    in_range(dst, OP)?;
    shape(OP, "destination length", src.len, dst.len)?;
    disjoint(OP, &[dst], &[src])
}

pub fn fill(dst: Slice) -> BResult<()> {
    in_range(dst, "fill")
}

// ---- dense algebra ---------------------------------------------------------------------

/// [`crate::Backend::alloc_weight`]: a matrix type and three positive dims.
pub fn alloc_weight(name: &str, info: crate::backend::WeightInfo) -> BResult<usize> {
    let bad = |problem: String| BackendError::Weight {
        name: name.to_string(),
        problem,
    };
    if info.ty == GgmlType::I32 || info.dims.contains(&0) {
        return Err(bad(format!("cannot allocate {} {:?}", info.ty, info.dims)));
    }
    let row = info.ty.row_bytes(info.cols() as u64).ok_or_else(|| {
        bad(format!(
            "type {} cannot hold rows of {}",
            info.ty,
            info.cols()
        ))
    })?;
    usize::try_from(row)
        .ok()
        .and_then(|r| r.checked_mul(info.rows())?.checked_mul(info.mats()))
        .ok_or_else(|| bad("size overflows".into()))
}

/// [`crate::Backend::write_weight_mat`]: `mat` exists and `raw` is one matrix's bytes.
/// Returns the matrix's byte size.
pub fn write_weight_mat(w: Weight, mat: usize, raw_len: usize) -> BResult<usize> {
    const OP: &str = "write_weight_mat";
    let (cols, rows, mats) = (w.info.cols(), w.info.rows(), w.info.mats());
    if mat >= mats {
        return Err(invalid(OP, format!("matrix {mat} of {mats}")));
    }
    let bytes = w
        .info
        .ty
        .row_bytes(cols as u64)
        .and_then(|r| usize::try_from(r).ok())
        .and_then(|r| r.checked_mul(rows))
        .ok_or_else(|| invalid(OP, format!("type {} rows of {cols}", w.info.ty)))?;
    shape(OP, "matrix bytes", bytes, raw_len)?;
    Ok(bytes)
}

pub fn matmul(w: Weight, mat: usize, x: Slice, n_tok: usize, y: Slice) -> BResult<()> {
    const OP: &str = "matmul";
    let (cols, rows, mats) = (w.info.cols(), w.info.rows(), w.info.mats());
    if mat >= mats {
        return Err(invalid(OP, format!("matrix {mat} of {mats}")));
    }
    matrix(w, OP)?;
    need(x, n_tok * cols, OP, "input")?;
    need(y, n_tok * rows, OP, "output")?;
    disjoint(OP, &[y], &[x])
}

pub fn matmul_grouped(w: Weight, groups: usize, x: Slice, n_tok: usize, y: Slice) -> BResult<()> {
    const OP: &str = "matmul_grouped";
    let (cols, rows) = (w.info.cols(), w.info.rows());
    if groups == 0 || !rows.is_multiple_of(groups) || w.info.mats() != 1 {
        return Err(invalid(
            OP,
            format!("{rows} rows do not split into {groups} groups"),
        ));
    }
    matrix(w, OP)?;
    need(x, n_tok * groups * cols, OP, "input")?;
    need(y, n_tok * rows, OP, "output")?;
    disjoint(OP, &[y], &[x])
}

pub fn matmul_pair(
    wa: Weight,
    wb: Weight,
    x: Slice,
    n_tok: usize,
    ya: Slice,
    yb: Slice,
) -> BResult<()> {
    const OP: &str = "matmul_pair";
    for w in [wa, wb] {
        matrix(w, OP)?;
        need(x, n_tok * w.info.cols(), OP, "input")?;
    }
    need(ya, n_tok * wa.info.rows(), OP, "first output")?;
    need(yb, n_tok * wb.info.rows(), OP, "second output")?;
    disjoint(OP, &[ya, yb], &[x])
}

pub fn matmul_set(
    x: Slice,
    n_tok: usize,
    singles: &[(Weight, Slice)],
    pairs: &[crate::backend::MatmulPair],
) -> BResult<()> {
    const OP: &str = "matmul_set";
    let mut outs = Vec::with_capacity(singles.len() + 2 * pairs.len());
    for &(w, y) in singles {
        matrix(w, OP)?;
        if w.info.mats() != 1 {
            return Err(invalid(
                OP,
                format!("{} matrices in one weight", w.info.mats()),
            ));
        }
        need(x, n_tok * w.info.cols(), OP, "input")?;
        need(y, n_tok * w.info.rows(), OP, "output")?;
        outs.push(y);
    }
    for p in pairs {
        matmul_pair(p.wa, p.wb, x, n_tok, p.ya, p.yb)?;
        outs.extend([p.ya, p.yb]);
    }
    disjoint(OP, &outs, &[x])
}

pub fn rms_norm(x: Slice, w: Option<Weight>, rows: usize, width: usize, out: Slice) -> BResult<()> {
    const OP: &str = "rms_norm";
    need(out, rows * width, OP, "output")?;
    need(x, rows * width, OP, "input")?;
    if let Some(w) = w {
        vector(w, width, OP, "weight")?;
    }
    if out == x {
        return Ok(());
    }
    disjoint(OP, &[out], &[x])
}

pub fn rope(x: Slice, a: &RopeArgs) -> BResult<()> {
    const OP: &str = "rope";
    let rd = a.freq.rope_dim;
    if !rd.is_multiple_of(2) || rd > a.head_dim {
        return Err(invalid(
            OP,
            format!("rope dim {rd} vs head dim {}", a.head_dim),
        ));
    }
    if let Some(p) = a.row_pos {
        need_i(p, a.n_rows, OP, "row positions")?;
    }
    need(x, a.n_rows * a.n_heads * a.head_dim, OP, "input")
}

pub fn add(acc: Slice, x: Slice) -> BResult<()> {
    const OP: &str = "add";
    in_range(acc, OP)?;
    in_range(x, OP)?;
    shape(OP, "input length", acc.len, x.len)?;
    disjoint(OP, &[acc], &[x])
}

pub fn swiglu(gate: Slice, up: Slice, out: Slice) -> BResult<()> {
    const OP: &str = "swiglu";
    for s in [gate, up, out] {
        in_range(s, OP)?;
    }
    shape(OP, "up length", gate.len, up.len)?;
    shape(OP, "output length", gate.len, out.len)?;
    disjoint(OP, &[out], &[gate, up])
}

pub fn qat_fp8(x: Slice, rows: usize, width: usize, n_dims: usize) -> BResult<()> {
    const OP: &str = "qat_fp8";
    if n_dims > width {
        return Err(invalid(OP, format!("{n_dims} dims of a {width}-wide row")));
    }
    need(x, rows * width, OP, "input")
}

pub fn qat_hadamard_fp4(x: Slice, rows: usize, width: usize) -> BResult<()> {
    const OP: &str = "qat_hadamard_fp4";
    if !width.is_power_of_two() {
        return Err(invalid(OP, format!("width {width} is not a power of two")));
    }
    need(x, rows * width, OP, "input")
}

// ---- model-specific ops ----------------------------------------------------------------

pub fn embed(
    table: Weight,
    tokens: IBuf,
    n_tok: usize,
    n_streams: usize,
    out: Slice,
) -> BResult<()> {
    const OP: &str = "embed";
    if table.info.ty == GgmlType::I32 {
        return Err(BackendError::UnsupportedType {
            op: OP,
            ty: table.info.ty,
        });
    }
    need(out, n_tok * n_streams * table.info.cols(), OP, "output")?;
    need_i(tokens, n_tok, OP, "token count")
}

fn hc_streams(op: &'static str, a: &HcArgs) -> BResult<()> {
    positive(op, "stream count", a.n_hc)
}

#[allow(clippy::too_many_arguments)]
pub fn hc_pre(
    mix: Slice,
    x: Slice,
    base: Weight,
    scale: Weight,
    a: &HcArgs,
    y: Slice,
    post: Slice,
    comb: Slice,
) -> BResult<()> {
    hc_pre_as("hc_pre", mix, x, base, scale, a, y, post, comb)
}

#[allow(clippy::too_many_arguments)]
fn hc_pre_as(
    op: &'static str,
    mix: Slice,
    x: Slice,
    base: Weight,
    scale: Weight,
    a: &HcArgs,
    y: Slice,
    post: Slice,
    comb: Slice,
) -> BResult<()> {
    let (n, d, t) = (a.n_hc, a.dim, a.n_tok);
    hc_streams(op, a)?;
    let nm = 2 * n + n * n;
    need(mix, t * nm, op, "mix")?;
    need(x, t * n * d, op, "streams")?;
    need(y, t * d, op, "y")?;
    need(post, t * n, op, "post")?;
    need(comb, t * n * n, op, "comb")?;
    vector(base, nm, op, "base")?;
    vector(scale, 3, op, "scale")?;
    disjoint(op, &[y, post, comb], &[mix, x])
}

#[allow(clippy::too_many_arguments)]
pub fn hc_pre_norm(
    mix: Slice,
    x: Slice,
    base: Weight,
    scale: Weight,
    a: &HcArgs,
    norm: Weight,
    y: Slice,
    post: Slice,
    comb: Slice,
    out: Slice,
) -> BResult<()> {
    const OP: &str = "hc_pre_norm";
    hc_pre_as(OP, mix, x, base, scale, a, y, post, comb)?;
    need(out, a.n_tok * a.dim, OP, "normed output")?;
    vector(norm, a.dim, OP, "norm weight")?;
    if out == y {
        return Ok(());
    }
    disjoint(OP, &[out], &[mix, x, y, post, comb])
}

pub fn norm_rope(
    x: Slice,
    w: Option<Weight>,
    rope: &RopeArgs,
    fp8_dims: Option<usize>,
) -> BResult<()> {
    const OP: &str = "norm_rope";
    let (rows, width, rd) = (
        rope.n_rows * rope.n_heads,
        rope.head_dim,
        rope.freq.rope_dim,
    );
    if !rd.is_multiple_of(2) || rd > width {
        return Err(invalid(OP, format!("rope dim {rd} vs head dim {width}")));
    }
    let n8 = fp8_dims.unwrap_or(0);
    if n8 > width {
        return Err(invalid(OP, format!("{n8} FP8 dims of a {width}-wide row")));
    }
    if let Some(w) = w {
        vector(w, width, OP, "weight")?;
    }
    if let Some(p) = rope.row_pos {
        need_i(p, rope.n_rows, OP, "row positions")?;
    }
    need(x, rows * width, OP, "input")
}

fn hc_post_as(
    op: &'static str,
    x: Slice,
    f: Slice,
    post: Slice,
    comb: Slice,
    a: &HcArgs,
) -> BResult<()> {
    let (n, d, t) = (a.n_hc, a.dim, a.n_tok);
    hc_streams(op, a)?;
    need(x, t * n * d, op, "streams")?;
    need(f, t * d, op, "f")?;
    need(post, t * n, op, "post")?;
    need(comb, t * n * n, op, "comb")
}

pub fn hc_post(x: Slice, f: Slice, post: Slice, comb: Slice, a: &HcArgs) -> BResult<()> {
    const OP: &str = "hc_post";
    hc_post_as(OP, x, f, post, comb, a)?;
    disjoint(OP, &[x], &[f, post, comb])
}

pub fn hc_post_add(
    x: Slice,
    f: Slice,
    f2: Slice,
    post: Slice,
    comb: Slice,
    a: &HcArgs,
) -> BResult<()> {
    const OP: &str = "hc_post_add";
    hc_post_as(OP, x, f, post, comb, a)?;
    in_range(f2, OP)?;
    shape(OP, "f2 length", f.len, f2.len)?;
    disjoint(OP, &[x, f], &[f2, post, comb])
}

pub fn hc_head(
    mix: Slice,
    x: Slice,
    base: Weight,
    scale: Weight,
    a: &HcArgs,
    y: Slice,
) -> BResult<()> {
    const OP: &str = "hc_head";
    let (n, d, t) = (a.n_hc, a.dim, a.n_tok);
    hc_streams(OP, a)?;
    need(mix, t * n, OP, "mix")?;
    need(x, t * n * d, OP, "streams")?;
    need(y, t * d, OP, "y")?;
    vector(base, n, OP, "base")?;
    vector(scale, 1, OP, "scale")?;
    disjoint(OP, &[y], &[mix, x])
}

pub fn compressor(
    acc: Slice,
    u: Slice,
    z: Slice,
    ape: Weight,
    a: &CompressorArgs,
    rows: Slice,
) -> BResult<()> {
    const OP: &str = "compressor";
    if a.ratio == 0 || a.width == 0 {
        return Err(invalid(OP, "ratio and width must be positive"));
    }
    let pw = a.proj_width();
    in_range(acc, OP)?;
    shape(OP, "accumulator length", a.acc_len(), acc.len)?;
    need(u, a.n_tok * pw, OP, "u")?;
    need(z, a.n_tok * pw, OP, "z")?;
    in_range(rows, OP)?;
    shape(OP, "ape row width", pw, ape.info.cols())?;
    shape(OP, "ape rows", a.ratio, ape.info.rows())?;
    // The last window this chunk completes must have a row.
    let cap = rows.len / a.width;
    let end = a.pos0 + a.n_tok;
    if end / a.ratio > a.pos0 / a.ratio {
        let w_last = end / a.ratio - 1;
        if w_last >= cap {
            return Err(invalid(
                OP,
                format!("row {w_last} is beyond the {cap} rows of the cache"),
            ));
        }
    }
    disjoint(OP, &[acc, rows], &[u, z])
}

pub fn indexer_topk(q: Slice, w: Slice, rows: Slice, a: &IndexerArgs, out: IBuf) -> BResult<()> {
    const OP: &str = "indexer_topk";
    let (t, k, hd, nh) = (a.n_tok, a.top_k, a.head_dim, a.n_heads);
    if a.ratio == 0 || k == 0 || hd == 0 {
        return Err(invalid(OP, "ratio, top_k and head dim must be positive"));
    }
    need_i(out, t * k, OP, "output length")?;
    let n_last = (a.pos0 + t) / a.ratio;
    need(rows, n_last * hd, OP, "rows")?;
    // Scoring happens only when some query sees more rows than it keeps.
    if n_last > k {
        need(q, t * nh * hd, OP, "q")?;
        need(w, t * nh, OP, "w")?;
    }
    Ok(())
}

pub fn attention(a: &AttnArgs) -> BResult<()> {
    const OP: &str = "attention";
    let (t, nh, hd, win) = (a.n_tok, a.n_head, a.head_dim, a.window);
    if win == 0 || hd == 0 {
        return Err(invalid(OP, "window and head dim must be positive"));
    }
    need(a.q, t * nh * hd, OP, "q")?;
    need(a.kv, t * hd, OP, "kv")?;
    need(a.ring, win * hd, OP, "ring")?;
    need(a.out, t * nh * hd, OP, "out")?;
    vector(a.sinks, nh, OP, "sinks")?;
    let last = a.pos0 + t;
    let rows = match a.comp {
        CompSel::None => None,
        CompSel::All { rows, ratio } => {
            positive(OP, "compression ratio", ratio)?;
            need(rows, last / ratio * hd, OP, "compressed rows")?;
            Some(rows)
        }
        CompSel::Top {
            rows,
            ratio,
            idx,
            k,
        } => {
            positive(OP, "compression ratio", ratio)?;
            in_range(rows, OP)?;
            need_i(idx, t * k, OP, "selection length")?;
            Some(rows)
        }
    };
    match rows {
        Some(r) => disjoint(OP, &[a.out], &[a.q, a.kv, a.ring, r]),
        None => disjoint(OP, &[a.out], &[a.q, a.kv, a.ring]),
    }
}

pub fn ring_store(ring: Slice, kv: Slice, n_tok: usize, window: usize) -> BResult<()> {
    const OP: &str = "ring_store";
    positive(OP, "window", window)?;
    in_range(ring, OP)?;
    let d = ring.len / window;
    shape(OP, "ring length", window * d, ring.len)?;
    need(kv, n_tok * d, OP, "kv")?;
    disjoint(OP, &[ring], &[kv])
}

pub fn router(
    logits: Slice,
    routing: &Routing,
    a: &RouterArgs,
    ids: IBuf,
    weights: Slice,
) -> BResult<()> {
    const OP: &str = "router";
    let (t, e, k) = (a.n_tok, a.n_expert, a.k);
    if k == 0 || k > e {
        return Err(invalid(OP, format!("{k} of {e} experts")));
    }
    need(logits, t * e, OP, "logits")?;
    need(weights, t * k, OP, "weights")?;
    let rows = a.row0.checked_add(t);
    let (rows, id_len) = rows
        .zip(rows.and_then(|r| r.checked_mul(k)))
        .ok_or_else(|| invalid(OP, format!("first row {} overflows", a.row0)))?;
    need_i(ids, id_len, OP, "ids length")?;
    match *routing {
        Routing::TopK { bias } => {
            if let Some(b) = bias {
                vector(b, e, OP, "bias")?;
            }
        }
        Routing::Hash { table, tokens } => {
            if table.info.ty != GgmlType::I32 {
                return Err(BackendError::UnsupportedType {
                    op: OP,
                    ty: table.info.ty,
                });
            }
            shape(OP, "hash table width", k, table.info.cols())?;
            need_i(tokens, rows, OP, "token count")?;
            if tokens.id() == ids.id() {
                return Err(BackendError::Aliasing {
                    op: OP,
                    id: ids.id(),
                });
            }
        }
    }
    disjoint(OP, &[weights], &[logits])
}

#[allow(clippy::too_many_arguments)]
pub fn moe(
    x: Slice,
    ids: IBuf,
    weights: Slice,
    gate: Weight,
    up: Weight,
    down: Weight,
    a: &MoeArgs,
    out: Slice,
) -> BResult<()> {
    const OP: &str = "moe";
    let (t, k) = (a.n_tok, a.k);
    let (d, f, ne) = (gate.info.cols(), gate.info.rows(), gate.info.mats());
    if up.info.dims != gate.info.dims {
        return Err(invalid(
            OP,
            format!("gate {:?} vs up {:?}", gate.info.dims, up.info.dims),
        ));
    }
    if down.info.dims != [f, d, ne] {
        return Err(invalid(
            OP,
            format!("down {:?}, expected {:?}", down.info.dims, [f, d, ne]),
        ));
    }
    if up.info.ty != gate.info.ty {
        return Err(invalid(OP, "gate and up differ in type"));
    }
    for w in [gate, down] {
        matrix(w, OP)?;
    }
    need(x, t * d, OP, "x")?;
    need(weights, t * k, OP, "weights")?;
    need(out, t * d, OP, "out")?;
    need_i(ids, t * k, OP, "ids length")?;
    disjoint(OP, &[out], &[x, weights])
}

pub fn argmax(x: Slice, out: IBuf) -> BResult<()> {
    const OP: &str = "argmax";
    in_range(x, OP)?;
    if x.len == 0 || out.is_empty() {
        return Err(invalid(
            OP,
            format!("{} values into {} slots", x.len, out.len()),
        ));
    }
    Ok(())
}

pub fn logit_band(x: Slice, span: f32, out: IBuf) -> BResult<()> {
    const OP: &str = "logit_band";
    in_range(x, OP)?;
    if x.len == 0 || x.len > i32::MAX as usize {
        return Err(invalid(OP, format!("{} values", x.len)));
    }
    if out.len() < crate::sampler::BAND_HEAD {
        return Err(invalid(
            OP,
            format!(
                "{} words cannot hold the {}-word header",
                out.len(),
                crate::sampler::BAND_HEAD
            ),
        ));
    }
    if span.is_nan() || span < 0.0 {
        return Err(invalid(OP, format!("span {span} must be >= 0")));
    }
    Ok(())
}

/// [`crate::Backend::logit_bands`]: `x` holds whole rows of `n` values, every job's row is
/// one of them and every job's band is valid as [`logit_band`]'s; no two jobs write one
/// buffer.
pub fn logit_bands(x: Slice, n: usize, jobs: &[crate::backend::BandJob]) -> BResult<()> {
    const OP: &str = "logit_bands";
    in_range(x, OP)?;
    if n == 0 || !x.len.is_multiple_of(n) {
        return Err(invalid(
            OP,
            format!("{} values are not whole rows of {n}", x.len),
        ));
    }
    for (i, j) in jobs.iter().enumerate() {
        if j.row >= x.len / n {
            return Err(invalid(OP, format!("row {} of {} rows", j.row, x.len / n)));
        }
        logit_band(x.sub(j.row * n, n), j.span, j.out)?;
        if jobs[..i].iter().any(|k| k.out.id() == j.out.id()) {
            return Err(invalid(OP, "two bands into one buffer".to_string()));
        }
    }
    Ok(())
}

// ---- fused ops: the checks of the ops each one stands for (crate::fused) -----------------

pub fn compressor_batch(calls: &[CompressorCall]) -> BResult<()> {
    calls
        .iter()
        .try_for_each(|c| compressor(c.acc, c.u, c.z, c.ape, &c.args, c.rows))
}

pub fn indexer_topk_batch(calls: &[IndexerCall]) -> BResult<()> {
    calls
        .iter()
        .try_for_each(|c| indexer_topk(c.q, c.w, c.rows, &c.args, c.out))
}

pub fn attention_batch(args: &[AttnArgs]) -> BResult<()> {
    args.iter().try_for_each(attention)
}

pub fn ring_store_batch(calls: &[RingStoreCall]) -> BResult<()> {
    calls
        .iter()
        .try_for_each(|c| ring_store(c.ring, c.kv, c.n_tok, c.window))
}

#[allow(clippy::too_many_arguments)]
pub fn hc_mix_pre_norm(
    fn_: Weight,
    x: Slice,
    mix: Slice,
    base: Weight,
    scale: Weight,
    a: &HcArgs,
    norm: Weight,
    y: Slice,
    post: Slice,
    comb: Slice,
    out: Slice,
) -> BResult<()> {
    matmul(fn_, 0, x, a.n_tok, mix)?;
    hc_pre_norm(mix, x, base, scale, a, norm, y, post, comb, out)
}

/// The previous sublayer's HCPost, then [`hc_mix_pre_norm`]: checked apart, since `prev`'s
/// `post` / `comb` may be the buffers the HCPre writes (the op reads them first).
#[allow(clippy::too_many_arguments)]
pub fn hc_post_mix_pre_norm(
    prev: &HcPost,
    fn_: Weight,
    x: Slice,
    mix: Slice,
    base: Weight,
    scale: Weight,
    a: &HcArgs,
    norm: Weight,
    y: Slice,
    post: Slice,
    comb: Slice,
    out: Slice,
) -> BResult<()> {
    match prev.f2 {
        Some(f2) => hc_post_add(x, prev.f, f2, prev.post, prev.comb, a)?,
        None => hc_post(x, prev.f, prev.post, prev.comb, a)?,
    }
    hc_mix_pre_norm(fn_, x, mix, base, scale, a, norm, y, post, comb, out)
}

pub fn compressor_pair(a: &CompressorCall, b: &CompressorCall) -> BResult<()> {
    compressor_batch(&[*a, *b])
}

pub fn norm_rope_pair(a: &NormRopeCall, b: &NormRopeCall) -> BResult<()> {
    norm_rope(a.x, a.w, &a.rope, a.fp8_dims)?;
    norm_rope(b.x, b.w, &b.rope, b.fp8_dims)
}

pub fn router_matmul(
    w: Weight,
    x: Slice,
    logits: Slice,
    routing: &Routing,
    a: &RouterArgs,
    ids: IBuf,
    weights: Slice,
) -> BResult<()> {
    matmul(w, 0, x, a.n_tok, logits)?;
    router(logits, routing, a, ids, weights)
}

pub fn rope_qat_hadamard_fp4(x: Slice, r: &RopeArgs, rows: usize, width: usize) -> BResult<()> {
    rope(x, r)?;
    qat_hadamard_fp4(x, rows, width)
}

pub fn norm_rope_pair_store(a: &NormRopeCall, b: &NormRopeCall, s: &RingStoreCall) -> BResult<()> {
    norm_rope_pair(a, b)?;
    ring_store(s.ring, s.kv, s.n_tok, s.window)
}

pub fn rope_matmul_grouped(
    x: Slice,
    r: &RopeArgs,
    w: Weight,
    groups: usize,
    n_tok: usize,
    y: Slice,
) -> BResult<()> {
    rope(x, r)?;
    matmul_grouped(w, groups, x, n_tok, y)
}

pub fn rms_norm_matmul(
    x: Slice,
    norm: Weight,
    h: Slice,
    w: Weight,
    n_tok: usize,
    out: Slice,
) -> BResult<()> {
    rms_norm(x, Some(norm), n_tok, w.info.cols(), h)?;
    matmul(w, 0, h, n_tok, out)
}

pub fn swiglu_matmul(
    gate: Slice,
    up: Slice,
    h: Slice,
    w: Weight,
    n_tok: usize,
    out: Slice,
) -> BResult<()> {
    swiglu(gate, up, h)?;
    matmul(w, 0, h, n_tok, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Buf, WeightInfo};

    fn w(id: u32, ty: GgmlType, dims: [usize; 3]) -> Weight {
        Weight::new(id, WeightInfo { ty, dims })
    }

    #[test]
    fn logit_bands_name_a_row_outside_and_a_shared_buffer() {
        use crate::backend::BandJob;
        let x = Slice {
            buf: Buf::new(0, 40),
            off: 0,
            len: 40,
        };
        let out = |id| IBuf::new(id, crate::sampler::BAND_HEAD + 8);
        let job = |row, id| BandJob {
            row,
            span: 1.0,
            out: out(id),
        };
        assert!(logit_bands(x, 10, &[job(0, 1), job(3, 2)]).is_ok());
        let e = logit_bands(x, 10, &[job(4, 1)]).unwrap_err().to_string();
        assert!(e.contains("row 4 of 4 rows"), "{e}");
        let e = logit_bands(x, 10, &[job(0, 1), job(2, 1)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("one buffer"), "{e}");
        let e = logit_bands(x, 12, &[job(0, 1)]).unwrap_err().to_string();
        assert!(e.contains("whole rows"), "{e}");
    }

    #[test]
    fn matmul_accepts_its_shapes_and_names_a_short_operand() {
        let m = w(0, GgmlType::Q8_0, [32, 4, 1]);
        let (x, y) = (Buf::new(0, 64), Buf::new(1, 8));
        matmul(m, 0, x.all(), 2, y.all()).unwrap();
        let e = matmul(m, 0, x.slice(0, 40), 2, y.all()).unwrap_err();
        assert_eq!(
            e,
            BackendError::Shape {
                op: "matmul",
                what: "input length".into(),
                expected: 64,
                found: 40
            }
        );
        assert_eq!(e.to_string(), "matmul: input length is 40, expected 64");
        let e = matmul(m, 1, x.all(), 2, y.all()).unwrap_err();
        assert!(e.to_string().contains("matrix 1 of 1"), "{e}");
    }

    #[test]
    fn a_slice_past_its_buffer_is_out_of_range() {
        let (x, y) = (Buf::new(0, 8), Buf::new(1, 8));
        let e = add(x.slice(4, 8), y.slice(0, 8)).unwrap_err();
        assert!(
            matches!(
                e,
                BackendError::OutOfRange {
                    op: "add",
                    end: 12,
                    len: 8,
                    ..
                }
            ),
            "{e:?}"
        );
        // An offset that overflows is out of range, not a wrap-around.
        let e = fill(x.slice(usize::MAX, 2)).unwrap_err();
        assert!(matches!(e, BackendError::OutOfRange { .. }), "{e:?}");
    }

    #[test]
    fn an_output_may_not_share_a_buffer_with_an_input_even_without_overlap() {
        let m = w(0, GgmlType::F32, [32, 4, 1]);
        let x = Buf::new(7, 64);
        let e = matmul(m, 0, x.slice(0, 32), 1, x.slice(32, 4)).unwrap_err();
        assert_eq!(
            e,
            BackendError::Aliasing {
                op: "matmul",
                id: 7
            }
        );
        assert!(swiglu(x.slice(0, 8), Buf::new(1, 8).all(), x.slice(16, 8)).is_err());
        assert!(copy(x.slice(0, 8), x.slice(8, 8)).is_err());
        // Two outputs of one op may not share a buffer either.
        let (mix, xs) = (Buf::new(1, 24), Buf::new(2, 8));
        let hc = HcArgs {
            n_tok: 1,
            n_hc: 4,
            dim: 2,
            sinkhorn_iters: 1,
            hc_eps: 0.0,
            rms_eps: 0.0,
        };
        let (base, scale) = (
            w(1, GgmlType::F32, [24, 1, 1]),
            w(2, GgmlType::F32, [3, 1, 1]),
        );
        let shared = Buf::new(3, 64);
        let e = hc_pre(
            mix.all(),
            xs.all(),
            base,
            scale,
            &hc,
            shared.slice(0, 2),
            shared.slice(2, 4),
            Buf::new(4, 16).all(),
        )
        .unwrap_err();
        assert_eq!(
            e,
            BackendError::Aliasing {
                op: "hc_pre",
                id: 3
            }
        );
    }

    #[test]
    fn documented_in_place_forms_are_allowed_exactly() {
        let x = Buf::new(0, 16);
        rms_norm(x.all(), None, 2, 8, x.all()).unwrap();
        // The same buffer shifted by one is neither in place nor disjoint.
        let e = rms_norm(x.slice(0, 8), None, 1, 8, x.slice(1, 8)).unwrap_err();
        assert!(matches!(e, BackendError::Aliasing { .. }), "{e:?}");
        let hc = HcArgs {
            n_tok: 1,
            n_hc: 1,
            dim: 4,
            sinkhorn_iters: 1,
            hc_eps: 0.0,
            rms_eps: 0.0,
        };
        let (base, scale, norm) = (
            w(0, GgmlType::F32, [3, 1, 1]),
            w(1, GgmlType::F32, [3, 1, 1]),
            w(2, GgmlType::F32, [4, 1, 1]),
        );
        let (mix, xs, y, post, comb) = (
            Buf::new(1, 3),
            Buf::new(2, 4),
            Buf::new(3, 4),
            Buf::new(4, 1),
            Buf::new(5, 1),
        );
        let call = |out: Slice| {
            hc_pre_norm(
                mix.all(),
                xs.all(),
                base,
                scale,
                &hc,
                norm,
                y.all(),
                post.all(),
                comb.all(),
                out,
            )
        };
        call(y.all()).unwrap();
        call(Buf::new(6, 4).all()).unwrap();
        assert!(call(xs.all()).is_err());
    }

    #[test]
    fn weights_of_the_wrong_type_or_length_are_refused() {
        let toks = IBuf::new(0, 2);
        let table = w(0, GgmlType::I32, [8, 10, 1]);
        let e = embed(table, toks, 2, 1, Buf::new(0, 16).all()).unwrap_err();
        assert!(
            matches!(e, BackendError::UnsupportedType { op: "embed", .. }),
            "{e:?}"
        );
        let a = RouterArgs {
            n_tok: 2,
            n_expert: 8,
            k: 2,
            scale: 1.0,
            row0: 0,
        };
        let (logits, wts, ids) = (Buf::new(0, 16), Buf::new(1, 4), IBuf::new(1, 4));
        // Rows from a first row on need the ids (and token ids) up to that row's end.
        let late = RouterArgs { row0: 1, ..a };
        let topk = Routing::TopK { bias: None };
        let e = router(logits.all(), &topk, &late, ids, wts.all()).unwrap_err();
        assert_eq!(e.to_string(), "router: ids length is 4, expected 6");
        router(logits.all(), &topk, &late, IBuf::new(1, 6), wts.all()).unwrap();
        let e = router(
            logits.all(),
            &Routing::Hash {
                table: w(0, GgmlType::I32, [2, 10, 1]),
                tokens: toks,
            },
            &late,
            IBuf::new(1, 6),
            wts.all(),
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "router: token count is 2, expected 3");
        let huge = RouterArgs {
            row0: usize::MAX,
            ..a
        };
        let e = router(logits.all(), &topk, &huge, ids, wts.all()).unwrap_err();
        assert!(e.to_string().contains("overflows"), "{e}");
        let hash = |table| Routing::Hash {
            table,
            tokens: toks,
        };
        router(
            logits.all(),
            &hash(w(0, GgmlType::I32, [2, 10, 1])),
            &a,
            ids,
            wts.all(),
        )
        .unwrap();
        let e = router(
            logits.all(),
            &hash(w(0, GgmlType::F32, [2, 10, 1])),
            &a,
            ids,
            wts.all(),
        )
        .unwrap_err();
        assert!(
            matches!(e, BackendError::UnsupportedType { op: "router", .. }),
            "{e:?}"
        );
        let bias = Routing::TopK {
            bias: Some(w(1, GgmlType::F32, [7, 1, 1])),
        };
        let e = router(logits.all(), &bias, &a, ids, wts.all()).unwrap_err();
        assert_eq!(e.to_string(), "router: bias length is 7, expected 8");
        // Token ids and expert ids in one i32 buffer.
        let e = router(
            logits.all(),
            &Routing::Hash {
                table: w(0, GgmlType::I32, [2, 10, 1]),
                tokens: IBuf::new(1, 4),
            },
            &a,
            ids,
            wts.all(),
        )
        .unwrap_err();
        assert!(
            matches!(e, BackendError::Aliasing { op: "router", .. }),
            "{e:?}"
        );
    }

    #[test]
    fn moe_experts_must_agree_in_shape_and_type() {
        let a = MoeArgs {
            n_tok: 1,
            k: 2,
            clamp: 10.0,
        };
        let (x, wts, out, ids) = (
            Buf::new(0, 4),
            Buf::new(1, 2),
            Buf::new(2, 4),
            IBuf::new(0, 2),
        );
        let g = w(0, GgmlType::Q8_0, [4, 6, 3]);
        let d = w(2, GgmlType::Q8_0, [6, 4, 3]);
        moe(x.all(), ids, wts.all(), g, g, d, &a, out.all()).unwrap();
        let up_f32 = w(1, GgmlType::F32, [4, 6, 3]);
        let e = moe(x.all(), ids, wts.all(), g, up_f32, d, &a, out.all()).unwrap_err();
        assert!(e.to_string().contains("differ in type"), "{e}");
        let e = moe(x.all(), ids, wts.all(), g, g, g, &a, out.all()).unwrap_err();
        assert!(e.to_string().contains("down [4, 6, 3]"), "{e}");
    }
}
