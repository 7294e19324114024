//! `ds4 perplexity`: llama.cpp-style chunked perplexity of a text, and the KL divergence of
//! a run against a saved base run (docs/perplexity.md).
//!
//! The text is tokenized as plain text (no special tokens) and cut into chunks of `ctx`
//! tokens; each chunk starts from an empty KV state. The first `ctx / 2` tokens of a chunk
//! are context only; the logits after positions `ctx / 2 ..= ctx - 2` score the tokens that
//! follow them, `ctx - 1 - ctx / 2` tokens per chunk (llama.cpp's `perplexity`). When the
//! GGUF says `tokenizer.ggml.add_bos_token = true`, the first token of every chunk is
//! replaced by BOS, as llama.cpp does.
//!
//! Statistics follow llama.cpp's `tools/perplexity` (the formulas, not its code): the mean
//! negative log-likelihood and its standard error `sqrt((E[x²] - E[x]²) / (n - 1))`,
//! `PPL = exp(mean)` with error `PPL · se`; against a base, the covariance of the two runs'
//! per-token NLLs enters the errors of `ln(PPL(Q)/PPL(base))` and `PPL(Q) - PPL(base)`.
//!
//! `--save-logits` writes the base file ([`BaseWriter`]): full rows of float32
//! log-probabilities, so KL divergences against it are exact (no quantization of the base).
//! `--kl-base` streams it back one chunk at a time ([`BaseReader`]).

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use ds4_chat::{SpecialTokens, Tokenizer};
use ds4_engine::{Engine, Logits};
use rayon::prelude::*;
use serde::Serialize;
use sha2::{Digest, Sha256};

/// llama.cpp's default `--ctx-size` for perplexity.
pub const DEFAULT_CTX: usize = 512;
/// Smallest context: two context tokens, at least one scored token.
pub const MIN_CTX: usize = 4;

/// The first 8 bytes of a base file.
pub const MAGIC: [u8; 8] = *b"DS4LOGPR";
/// The format version this build writes and reads.
pub const VERSION: u32 = 1;
/// `encoding`: every row is `n_vocab` little-endian float32 natural-log probabilities.
pub const ENCODING_F32: u32 = 0;
/// `flags` bit: the first token of every chunk was replaced by BOS.
const FLAG_BOS: u32 = 1;
/// Fixed part of the header: magic, 8 u32 fields, three SHA-256 digests.
const FIXED_HEADER: usize = 8 + 8 * 4 + 3 * 32;
/// Longest model description accepted when reading (a corrupt length must not allocate).
const MAX_DESC: usize = 1 << 16;

/// The number of scored tokens of a chunk of `ctx` tokens.
pub fn scored_per_chunk(ctx: usize) -> usize {
    ctx - 1 - ctx / 2
}

/// Identity of a vocabulary: SHA-256 over the number of ids, then each id's bytes
/// (length-prefixed). Two GGUFs of the same model in different quantizations share it; a
/// model with another vocabulary does not, so a base computed with it is refused.
pub fn vocab_hash(tok: &Tokenizer) -> anyhow::Result<[u8; 32]> {
    let mut h = Sha256::new();
    h.update((tok.vocab_size() as u64).to_le_bytes());
    for id in 0..tok.vocab_size() as u32 {
        let b = tok.token_bytes(id)?;
        h.update((b.len() as u32).to_le_bytes());
        h.update(b);
    }
    Ok(h.finalize().into())
}

/// SHA-256 of a byte string.
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// FNV-1a over 64-bit little-endian words (a trailing partial word zero-padded): the
/// checksum that ends every chunk of a base file. Fast enough not to matter next to a
/// forward pass; it catches flipped bits and swapped or shifted chunks (the chunk index is
/// the first word).
#[derive(Debug, Clone)]
pub struct Checksum(u64);

impl Checksum {
    const PRIME: u64 = 0x0000_0100_0000_01b3;

    pub fn new(chunk: usize) -> Self {
        let mut c = Checksum(0xcbf2_9ce4_8422_2325);
        c.word(chunk as u64);
        c
    }

    fn word(&mut self, w: u64) {
        self.0 = (self.0 ^ w).wrapping_mul(Self::PRIME);
    }

    /// Adds bytes; callers pass whole 4-byte values, so a word never spans two calls
    /// except through the zero-padding of an odd count of values, which both the writer
    /// and the reader produce identically.
    pub fn update(&mut self, bytes: &[u8]) {
        let mut it = bytes.chunks_exact(8);
        for w in &mut it {
            self.word(u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        let rest = it.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.word(u64::from_le_bytes(w));
        }
    }

    pub fn value(&self) -> u64 {
        self.0
    }
}

/// What a base file says about the run that wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseHeader {
    pub n_vocab: usize,
    pub ctx: usize,
    pub n_chunks: usize,
    /// BOS replaced the first token of every chunk.
    pub bos: bool,
    pub vocab_hash: [u8; 32],
    /// SHA-256 of the text file's bytes.
    pub text_hash: [u8; 32],
    /// SHA-256 of the model GGUF's header (metadata and tensor table): which file it was,
    /// for the report only (another quantization of the same model is a valid comparison).
    pub model_id: [u8; 32],
    /// Model file name, size, mode, backend and precision, for the report.
    pub model: String,
}

impl BaseHeader {
    pub fn rows_per_chunk(&self) -> usize {
        scored_per_chunk(self.ctx)
    }

    /// Bytes of one chunk record: its `ctx` token ids, its rows, the checksum.
    pub fn chunk_bytes(&self) -> u64 {
        self.ctx as u64 * 4 + self.rows_per_chunk() as u64 * self.n_vocab as u64 * 4 + 8
    }

    fn header_len(&self) -> usize {
        FIXED_HEADER + 4 + self.model.len()
    }

    /// Length of a complete file.
    pub fn file_len(&self) -> u64 {
        self.header_len() as u64 + self.n_chunks as u64 * self.chunk_bytes()
    }

    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.header_len());
        b.extend_from_slice(&MAGIC);
        for v in [
            VERSION,
            self.header_len() as u32,
            ENCODING_F32,
            if self.bos { FLAG_BOS } else { 0 },
            self.n_vocab as u32,
            self.ctx as u32,
            self.n_chunks as u32,
            self.rows_per_chunk() as u32,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&self.vocab_hash);
        b.extend_from_slice(&self.text_hash);
        b.extend_from_slice(&self.model_id);
        b.extend_from_slice(&(self.model.len() as u32).to_le_bytes());
        b.extend_from_slice(self.model.as_bytes());
        b
    }
}

/// Writes a base file: the header, then one record per chunk. The data goes to
/// `FILE.partial`, renamed to `FILE` by [`BaseWriter::finish`] once every chunk is written,
/// so an interrupted run never leaves a complete-looking file behind (a dropped writer
/// removes its partial file).
pub struct BaseWriter {
    out: Option<BufWriter<File>>,
    tmp: PathBuf,
    path: PathBuf,
    header: BaseHeader,
    chunks: usize,
    buf: Vec<u8>,
}

impl BaseWriter {
    pub fn create(path: &Path, header: BaseHeader) -> anyhow::Result<Self> {
        let mut name = path.file_name().unwrap_or_default().to_os_string();
        name.push(".partial");
        let tmp = path.with_file_name(name);
        let f = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut out = BufWriter::with_capacity(1 << 20, f);
        out.write_all(&header.encode())
            .with_context(|| format!("writing {}", tmp.display()))?;
        Ok(Self {
            out: Some(out),
            tmp,
            path: path.to_path_buf(),
            header,
            chunks: 0,
            buf: Vec::new(),
        })
    }

    /// One chunk: its `ctx` tokens (as evaluated) and its `rows_per_chunk × n_vocab`
    /// log-probabilities.
    pub fn write_chunk(&mut self, tokens: &[u32], logprobs: &[f32]) -> anyhow::Result<()> {
        let h = &self.header;
        if tokens.len() != h.ctx || logprobs.len() != h.rows_per_chunk() * h.n_vocab {
            bail!("internal: a chunk of the wrong shape for the base file");
        }
        if self.chunks >= h.n_chunks {
            bail!("internal: more chunks than the base file's header announces");
        }
        let mut sum = Checksum::new(self.chunks);
        self.buf.clear();
        for t in tokens {
            self.buf.extend_from_slice(&t.to_le_bytes());
        }
        sum.update(&self.buf);
        let out = self.out.as_mut().expect("open until finish");
        out.write_all(&self.buf)?;
        // Row by row, as the reader checks it (the checksum pads each update to 8 bytes).
        for row in logprobs.chunks(h.n_vocab) {
            self.buf.clear();
            for v in row {
                self.buf.extend_from_slice(&v.to_le_bytes());
            }
            sum.update(&self.buf);
            out.write_all(&self.buf)
                .with_context(|| format!("writing {}", self.tmp.display()))?;
        }
        out.write_all(&sum.value().to_le_bytes())?;
        self.chunks += 1;
        Ok(())
    }

    /// Flushes, checks every announced chunk was written, and renames the file into place.
    pub fn finish(mut self) -> anyhow::Result<()> {
        if self.chunks != self.header.n_chunks {
            bail!(
                "internal: {} of {} chunks written",
                self.chunks,
                self.header.n_chunks
            );
        }
        let out = self.out.take().expect("open until finish");
        let f = out
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(|| format!("writing {}", self.tmp.display()))?;
        f.sync_all()
            .with_context(|| format!("writing {}", self.tmp.display()))?;
        drop(f);
        std::fs::rename(&self.tmp, &self.path)
            .with_context(|| format!("renaming {} to {}", self.tmp.display(), self.path.display()))
    }
}

impl Drop for BaseWriter {
    fn drop(&mut self) {
        if self.out.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Reads a base file chunk by chunk, row by row (the caller holds what it needs). Opening checks the
/// header and that the file is exactly as long as the header says; every chunk's checksum
/// is checked when its last row has been read.
pub struct BaseReader {
    input: BufReader<File>,
    path: PathBuf,
    pub header: BaseHeader,
    chunk: usize,
    sum: Checksum,
    rows_left: usize,
    buf: Vec<u8>,
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"))
}

impl BaseReader {
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let len = f
            .metadata()
            .with_context(|| format!("reading {}", path.display()))?
            .len();
        let mut input = BufReader::with_capacity(1 << 20, f);
        let bad =
            |what: String| anyhow::anyhow!("{} is not a usable base file: {what}", path.display());
        let mut fixed = vec![0u8; FIXED_HEADER + 4];
        input.read_exact(&mut fixed).map_err(|_| {
            bad(format!(
                "{len} bytes, shorter than a header (written by `ds4 perplexity --save-logits`?)"
            ))
        })?;
        if fixed[..8] != MAGIC {
            return Err(bad(
                "wrong magic (not written by `ds4 perplexity --save-logits`)".into(),
            ));
        }
        let version = u32_at(&fixed, 8);
        if version != VERSION {
            return Err(bad(format!(
                "format version {version}; this build reads version {VERSION}"
            )));
        }
        let header_len = u32_at(&fixed, 12) as usize;
        let encoding = u32_at(&fixed, 16);
        let flags = u32_at(&fixed, 20);
        let n_vocab = u32_at(&fixed, 24) as usize;
        let ctx = u32_at(&fixed, 28) as usize;
        let n_chunks = u32_at(&fixed, 32) as usize;
        let rows = u32_at(&fixed, 36) as usize;
        if encoding != ENCODING_F32 {
            return Err(bad(format!("unknown row encoding {encoding}")));
        }
        if flags & !FLAG_BOS != 0 {
            return Err(bad(format!("unknown flags {flags:#x}")));
        }
        if n_vocab == 0 || ctx < MIN_CTX || n_chunks == 0 || rows != scored_per_chunk(ctx) {
            return Err(bad(format!(
                "inconsistent header (vocabulary {n_vocab}, context {ctx}, {n_chunks} chunks, {rows} rows per chunk)"
            )));
        }
        let digest = |i: usize| -> [u8; 32] { fixed[i..i + 32].try_into().expect("32 bytes") };
        let (vocab_hash, text_hash, model_id) = (digest(40), digest(72), digest(104));
        let desc_len = u32_at(&fixed, FIXED_HEADER) as usize;
        if desc_len > MAX_DESC || header_len != FIXED_HEADER + 4 + desc_len {
            return Err(bad(format!(
                "inconsistent header length {header_len} (model description {desc_len} bytes)"
            )));
        }
        let mut desc = vec![0u8; desc_len];
        input
            .read_exact(&mut desc)
            .map_err(|_| bad("truncated in its header".into()))?;
        let model = String::from_utf8(desc)
            .map_err(|_| bad("the model description is not UTF-8".into()))?;
        let header = BaseHeader {
            n_vocab,
            ctx,
            n_chunks,
            bos: flags & FLAG_BOS != 0,
            vocab_hash,
            text_hash,
            model_id,
            model,
        };
        let want = header.file_len();
        if len < want {
            let whole = (len.saturating_sub(header.header_len() as u64)) / header.chunk_bytes();
            return Err(bad(format!(
                "truncated: {len} bytes, but its header announces {n_chunks} chunks ({want} bytes); {whole} whole chunks are present"
            )));
        }
        if len > want {
            return Err(bad(format!(
                "{} bytes after the {n_chunks} chunks its header announces (corrupt or not a base file)",
                len - want
            )));
        }
        Ok(Self {
            input,
            path: path.to_path_buf(),
            header,
            chunk: 0,
            sum: Checksum::new(0),
            rows_left: 0,
            buf: Vec::new(),
        })
    }

    /// The next chunk's token ids; its rows follow through [`BaseReader::read_row`].
    pub fn begin_chunk(&mut self) -> anyhow::Result<Vec<u32>> {
        if self.rows_left != 0 {
            bail!("internal: chunk {} not read to its end", self.chunk);
        }
        if self.chunk >= self.header.n_chunks {
            bail!(
                "{} has only {} chunks",
                self.path.display(),
                self.header.n_chunks
            );
        }
        self.sum = Checksum::new(self.chunk);
        self.buf.resize(self.header.ctx * 4, 0);
        self.input
            .read_exact(&mut self.buf)
            .with_context(|| format!("reading {}", self.path.display()))?;
        self.sum.update(&self.buf);
        self.rows_left = self.header.rows_per_chunk();
        Ok(self
            .buf
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }

    /// The next row of the current chunk into `row` (`n_vocab` values). After the chunk's
    /// last row its checksum is read and compared.
    pub fn read_row(&mut self, row: &mut [f32]) -> anyhow::Result<()> {
        if self.rows_left == 0 || row.len() != self.header.n_vocab {
            bail!("internal: no row left in this chunk, or a row of the wrong size");
        }
        self.buf.resize(self.header.n_vocab * 4, 0);
        self.input
            .read_exact(&mut self.buf)
            .with_context(|| format!("reading {}", self.path.display()))?;
        self.sum.update(&self.buf);
        for (v, c) in row.iter_mut().zip(self.buf.chunks_exact(4)) {
            *v = f32::from_le_bytes(c.try_into().expect("4 bytes"));
        }
        self.rows_left -= 1;
        if self.rows_left == 0 {
            let mut s = [0u8; 8];
            self.input
                .read_exact(&mut s)
                .with_context(|| format!("reading {}", self.path.display()))?;
            if u64::from_le_bytes(s) != self.sum.value() {
                bail!(
                    "{} is corrupt: the checksum of chunk {} does not match its data",
                    self.path.display(),
                    self.chunk + 1
                );
            }
            self.chunk += 1;
        }
        Ok(())
    }
}

/// Log-softmax of `row` computed in f64 and rounded to f32 into `out`; returns the index of
/// the largest value (the first one on ties). Non-finite logits are an error (`-inf` is
/// allowed: probability 0), so is a row with no finite value.
pub fn log_softmax(row: &[f32], out: &mut [f32]) -> Result<usize, String> {
    let mut max = f64::NEG_INFINITY;
    let mut imax = 0;
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() || v == f32::INFINITY {
            return Err(format!("logit {v} at id {i}"));
        }
        if f64::from(v) > max {
            max = f64::from(v);
            imax = i;
        }
    }
    if max == f64::NEG_INFINITY {
        return Err("every logit is -inf".into());
    }
    let sum: f64 = row.iter().map(|&v| (f64::from(v) - max).exp()).sum();
    let lse = max + sum.ln();
    for (o, &v) in out.iter_mut().zip(row) {
        *o = (f64::from(v) - lse) as f32;
    }
    Ok(imax)
}

/// Mean and standard error of a sample given its sum, sum of squares and size, as
/// llama.cpp computes them: `se = sqrt((E[x²] - E[x]²) / (n - 1))`, 0 for 10 values or
/// fewer (or a non-positive variance).
pub fn mean_and_uncertainty(sum: f64, sum2: f64, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 0.0);
    }
    let f = sum / n as f64;
    let var = sum2 / n as f64 - f * f;
    let se = if var > 0.0 && n > 10 {
        (var / (n - 1) as f64).sqrt()
    } else {
        0.0
    };
    (f, se)
}

/// Covariance of the means of two paired samples (llama.cpp: 0 below 10 values).
pub fn covariance(sum_a: f64, sum_b: f64, sum_ab: f64, n: usize) -> f64 {
    if n < 10 {
        return 0.0;
    }
    let n_f = n as f64;
    (sum_ab / n_f - (sum_a / n_f) * (sum_b / n_f)) / (n_f - 1.0)
}

/// The `fraction` quantile of sorted `values`, linearly interpolated between neighbours
/// (llama.cpp's `percentile`).
pub fn percentile(sorted: &[f32], fraction: f64) -> f64 {
    let Some((&first, &last)) = sorted.first().zip(sorted.last()) else {
        return f64::NAN;
    };
    if fraction <= 0.0 {
        return f64::from(first);
    }
    if fraction >= 1.0 {
        return f64::from(last);
    }
    let p = fraction * (sorted.len() - 1) as f64;
    let i = p as usize;
    let t = p - i as f64;
    let next = sorted[(i + 1).min(sorted.len() - 1)];
    (1.0 - t) * f64::from(sorted[i]) + t * f64::from(next)
}

/// Median (mean of the two middle values for an even count).
pub fn median(sorted: &[f32]) -> f64 {
    let n = sorted.len();
    match n {
        0 => f64::NAN,
        _ if n.is_multiple_of(2) => 0.5 * (f64::from(sorted[n / 2]) + f64::from(sorted[n / 2 - 1])),
        _ => f64::from(sorted[n / 2]),
    }
}

/// Running perplexity sums.
#[derive(Debug, Clone, Default)]
pub struct PplAccum {
    pub sum: f64,
    pub sum2: f64,
    pub count: usize,
}

impl PplAccum {
    pub fn add(&mut self, nll: f64) {
        self.sum += nll;
        self.sum2 += nll * nll;
        self.count += 1;
    }

    /// `exp(mean NLL)`: the running perplexity.
    pub fn ppl(&self) -> f64 {
        (self.sum / self.count.max(1) as f64).exp()
    }

    /// `(PPL, its error)` as llama.cpp's final estimate: `exp(mean)`, `PPL · se`.
    pub fn estimate(&self) -> (f64, f64) {
        let n = self.count.max(1) as f64;
        let mean = self.sum / n;
        let var = self.sum2 / n - mean * mean;
        let se = if var > 0.0 && self.count > 1 {
            (var / (n - 1.0)).sqrt()
        } else {
            0.0
        };
        let ppl = mean.exp();
        (ppl, ppl * se)
    }
}

/// One scored token compared with the base.
#[derive(Debug, Clone, Copy)]
pub struct RowKl {
    pub nll: f64,
    pub nll_base: f64,
    /// KL(base ‖ this run) over the whole row.
    pub kld: f64,
    pub same_top: bool,
}

impl RowKl {
    /// This run's log-probabilities `lq` with their argmax, the base's `lb`, and the token
    /// that came next.
    pub fn new(lq: &[f32], top_q: usize, lb: &[f32], target: usize) -> Self {
        let mut kld = 0.0f64;
        let mut top_b = 0;
        let mut best = f32::NEG_INFINITY;
        for (i, (&b, &q)) in lb.iter().zip(lq).enumerate() {
            if b > best {
                best = b;
                top_b = i;
            }
            if b != f32::NEG_INFINITY {
                let b = f64::from(b);
                kld += b.exp() * (b - f64::from(q));
            }
        }
        RowKl {
            nll: -f64::from(lq[target]),
            nll_base: -f64::from(lb[target]),
            kld,
            same_top: top_b == top_q,
        }
    }
}

/// Running sums of a comparison with a base (llama.cpp's `kl_divergence_result`), plus every
/// token's KLD and Δp for the quantiles.
#[derive(Debug, Clone, Default)]
pub struct KlAccum {
    pub sum_nll: f64,
    pub sum_nll2: f64,
    pub sum_nll_base: f64,
    pub sum_nll_base2: f64,
    pub sum_nll_nll_base: f64,
    pub sum_kld: f64,
    pub sum_kld2: f64,
    pub sum_p_diff: f64,
    pub sum_p_diff2: f64,
    pub sum_p_diff4: f64,
    pub max_p_diff: f64,
    pub n_same_top: usize,
    pub count: usize,
    pub kld: Vec<f32>,
    pub p_diff: Vec<f32>,
}

impl KlAccum {
    /// One scored token: this run's log-probabilities `lq` with their argmax, the base's
    /// `lb`, and the token that came next.
    pub fn add(&mut self, lq: &[f32], top_q: usize, lb: &[f32], target: usize) {
        self.push(RowKl::new(lq, top_q, lb, target));
    }

    /// Adds one token's comparison (rows are compared in parallel, added in order).
    pub fn push(&mut self, row: RowKl) {
        let RowKl {
            nll,
            nll_base,
            kld,
            same_top,
        } = row;
        self.sum_nll += nll;
        self.sum_nll2 += nll * nll;
        self.sum_nll_base += nll_base;
        self.sum_nll_base2 += nll_base * nll_base;
        self.sum_nll_nll_base += nll * nll_base;
        self.sum_kld += kld;
        self.sum_kld2 += kld * kld;
        let p_diff = (-nll).exp() - (-nll_base).exp();
        self.sum_p_diff += p_diff;
        self.sum_p_diff2 += p_diff * p_diff;
        self.sum_p_diff4 += p_diff * p_diff * p_diff * p_diff;
        self.max_p_diff = self.max_p_diff.max(p_diff.abs());
        self.n_same_top += usize::from(same_top);
        self.count += 1;
        self.kld.push(kld as f32);
        self.p_diff.push(p_diff as f32);
    }

    /// The running per-chunk line: PPL(Q), ln(PPL(Q)/PPL(base)), KLD, RMS Δp, same top.
    pub fn chunk_line(&self, chunk: usize) -> String {
        let n = self.count;
        let lq = mean_and_uncertainty(self.sum_nll, self.sum_nll2, n);
        let lb = mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, n);
        let cov = covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, n);
        let ratio_unc = (lq.1 * lq.1 + lb.1 * lb.1 - 2.0 * cov).max(0.0).sqrt();
        let kl = mean_and_uncertainty(self.sum_kld, self.sum_kld2, n);
        let (rms, rms_unc) = rms_p_diff(self);
        let (top, top_unc) = same_top(self);
        format!(
            "{chunk:4}    {:9.4} ± {:9.4}    {:10.5} ± {:10.5}    {:10.5} ± {:10.5}    {:6.3} ± {:6.3} %    {:6.3} ± {:6.3} %",
            lq.0.exp(),
            lq.0.exp() * lq.1,
            lq.0 - lb.0,
            ratio_unc,
            kl.0,
            kl.1,
            100.0 * rms,
            100.0 * rms_unc,
            100.0 * top,
            100.0 * top_unc
        )
    }

    /// The final statistics (sorts the per-token values).
    pub fn report(&mut self) -> KlReport {
        let n = self.count;
        self.kld.sort_by(f32::total_cmp);
        self.p_diff.sort_by(f32::total_cmp);
        let lq = mean_and_uncertainty(self.sum_nll, self.sum_nll2, n);
        let lb = mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, n);
        let cov = covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, n);
        let ppl_q = lq.0.exp();
        let ppl_q_unc = ppl_q * lq.1;
        let ppl_b = lb.0.exp();
        let ppl_b_unc = ppl_b * lb.1;
        let log_ratio = lq.0 - lb.0;
        let log_ratio_unc = (lq.1 * lq.1 + lb.1 * lb.1 - 2.0 * cov).max(0.0).sqrt();
        let ratio = log_ratio.exp();
        let ppl_cov = ppl_q * ppl_b * cov;
        let kl = mean_and_uncertainty(self.sum_kld, self.sum_kld2, n);
        let dp = mean_and_uncertainty(self.sum_p_diff, self.sum_p_diff2, n);
        let (rms, rms_unc) = rms_p_diff(self);
        let (top, top_unc) = same_top(self);
        let q = |v: &[f32], f: f64| percentile(v, f);
        KlReport {
            tokens: n,
            ppl: ppl_q,
            ppl_err: ppl_q_unc,
            ppl_base: ppl_b,
            ppl_base_err: ppl_b_unc,
            cor_ln_ppl: if lq.1 > 0.0 && lb.1 > 0.0 {
                cov / (lq.1 * lb.1)
            } else {
                f64::NAN
            },
            ln_ppl_ratio: log_ratio,
            ln_ppl_ratio_err: log_ratio_unc,
            ppl_ratio: ratio,
            ppl_ratio_err: ratio * log_ratio_unc,
            ppl_diff: ppl_q - ppl_b,
            ppl_diff_err: (ppl_q_unc * ppl_q_unc + ppl_b_unc * ppl_b_unc - 2.0 * ppl_cov)
                .max(0.0)
                .sqrt(),
            kld_mean: kl.0,
            kld_mean_err: kl.1,
            kld_max: q(&self.kld, 1.0),
            kld_p99_9: q(&self.kld, 0.999),
            kld_p99: q(&self.kld, 0.99),
            kld_p95: q(&self.kld, 0.95),
            kld_p90: q(&self.kld, 0.90),
            kld_median: median(&self.kld),
            kld_p10: q(&self.kld, 0.10),
            kld_p5: q(&self.kld, 0.05),
            kld_p1: q(&self.kld, 0.01),
            kld_p0_1: q(&self.kld, 0.001),
            kld_min: q(&self.kld, 0.0),
            dp_mean: dp.0,
            dp_mean_err: dp.1,
            dp_max: q(&self.p_diff, 1.0),
            dp_p99_9: q(&self.p_diff, 0.999),
            dp_p99: q(&self.p_diff, 0.99),
            dp_p95: q(&self.p_diff, 0.95),
            dp_p90: q(&self.p_diff, 0.90),
            dp_p75: q(&self.p_diff, 0.75),
            dp_median: median(&self.p_diff),
            dp_p25: q(&self.p_diff, 0.25),
            dp_p10: q(&self.p_diff, 0.10),
            dp_p5: q(&self.p_diff, 0.05),
            dp_p1: q(&self.p_diff, 0.01),
            dp_p0_1: q(&self.p_diff, 0.001),
            dp_min: q(&self.p_diff, 0.0),
            dp_rms: rms,
            dp_rms_err: rms_unc,
            same_top: top,
            same_top_err: top_unc,
        }
    }
}

fn rms_p_diff(a: &KlAccum) -> (f64, f64) {
    let mse = mean_and_uncertainty(a.sum_p_diff2, a.sum_p_diff4, a.count);
    let rms = mse.0.sqrt();
    let unc = if rms > 0.0 { 0.5 / rms * mse.1 } else { 0.0 };
    (rms, unc)
}

fn same_top(a: &KlAccum) -> (f64, f64) {
    let p = a.n_same_top as f64 / a.count.max(1) as f64;
    let unc = if a.count > 1 {
        (p * (1.0 - p) / (a.count - 1) as f64).sqrt()
    } else {
        0.0
    };
    (p, unc)
}

/// Statistics of a run against a base (llama.cpp's `--kl-divergence` output). KLD is
/// KL(base ‖ this run) per token, in nats; Δp = p(next token) − p_base(next token).
#[derive(Debug, Clone, Serialize)]
pub struct KlReport {
    pub tokens: usize,
    pub ppl: f64,
    pub ppl_err: f64,
    pub ppl_base: f64,
    pub ppl_base_err: f64,
    pub cor_ln_ppl: f64,
    pub ln_ppl_ratio: f64,
    pub ln_ppl_ratio_err: f64,
    pub ppl_ratio: f64,
    pub ppl_ratio_err: f64,
    pub ppl_diff: f64,
    pub ppl_diff_err: f64,
    pub kld_mean: f64,
    pub kld_mean_err: f64,
    pub kld_max: f64,
    pub kld_p99_9: f64,
    pub kld_p99: f64,
    pub kld_p95: f64,
    pub kld_p90: f64,
    pub kld_median: f64,
    pub kld_p10: f64,
    pub kld_p5: f64,
    pub kld_p1: f64,
    pub kld_p0_1: f64,
    pub kld_min: f64,
    pub dp_mean: f64,
    pub dp_mean_err: f64,
    pub dp_max: f64,
    pub dp_p99_9: f64,
    pub dp_p99: f64,
    pub dp_p95: f64,
    pub dp_p90: f64,
    pub dp_p75: f64,
    pub dp_median: f64,
    pub dp_p25: f64,
    pub dp_p10: f64,
    pub dp_p5: f64,
    pub dp_p1: f64,
    pub dp_p0_1: f64,
    pub dp_min: f64,
    pub dp_rms: f64,
    pub dp_rms_err: f64,
    /// Fraction of tokens where both runs have the same most likely id.
    pub same_top: f64,
    pub same_top_err: f64,
}

impl KlReport {
    /// The statistics as llama.cpp prints them.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let mut line = |l: String| {
            s.push_str(&l);
            s.push('\n');
        };
        line("====== Perplexity statistics ======".into());
        line(format!(
            "Mean PPL(Q)                   : {:10.6} ± {:10.6}",
            self.ppl, self.ppl_err
        ));
        line(format!(
            "Mean PPL(base)                : {:10.6} ± {:10.6}",
            self.ppl_base, self.ppl_base_err
        ));
        line(format!(
            "Cor(ln(PPL(Q)), ln(PPL(base))): {:6.2}%",
            100.0 * self.cor_ln_ppl
        ));
        line(format!(
            "Mean ln(PPL(Q)/PPL(base))     : {:10.6} ± {:10.6}",
            self.ln_ppl_ratio, self.ln_ppl_ratio_err
        ));
        line(format!(
            "Mean PPL(Q)/PPL(base)         : {:10.6} ± {:10.6}",
            self.ppl_ratio, self.ppl_ratio_err
        ));
        line(format!(
            "Mean PPL(Q)-PPL(base)         : {:10.6} ± {:10.6}",
            self.ppl_diff, self.ppl_diff_err
        ));
        line(String::new());
        line("====== KL divergence statistics ======".into());
        line(format!(
            "Mean    KLD: {:10.6} ± {:10.6}",
            self.kld_mean, self.kld_mean_err
        ));
        for (name, v) in [
            ("Maximum KLD", self.kld_max),
            ("99.9%   KLD", self.kld_p99_9),
            ("99.0%   KLD", self.kld_p99),
            ("95.0%   KLD", self.kld_p95),
            ("90.0%   KLD", self.kld_p90),
            ("Median  KLD", self.kld_median),
            ("10.0%   KLD", self.kld_p10),
            (" 5.0%   KLD", self.kld_p5),
            (" 1.0%   KLD", self.kld_p1),
            (" 0.1%   KLD", self.kld_p0_1),
            ("Minimum KLD", self.kld_min),
        ] {
            line(format!("{name}: {v:10.6}"));
        }
        line(String::new());
        line("====== Token probability statistics ======".into());
        line(format!(
            "Mean    Δp: {:6.3} ± {:5.3} %",
            100.0 * self.dp_mean,
            100.0 * self.dp_mean_err
        ));
        for (name, v) in [
            ("Maximum Δp", self.dp_max),
            ("99.9%   Δp", self.dp_p99_9),
            ("99.0%   Δp", self.dp_p99),
            ("95.0%   Δp", self.dp_p95),
            ("90.0%   Δp", self.dp_p90),
            ("75.0%   Δp", self.dp_p75),
            ("Median  Δp", self.dp_median),
            ("25.0%   Δp", self.dp_p25),
            ("10.0%   Δp", self.dp_p10),
            (" 5.0%   Δp", self.dp_p5),
            (" 1.0%   Δp", self.dp_p1),
            (" 0.1%   Δp", self.dp_p0_1),
            ("Minimum Δp", self.dp_min),
        ] {
            line(format!("{name}: {:6.3}%", 100.0 * v));
        }
        line(format!(
            "RMS Δp    : {:6.3} ± {:5.3} %",
            100.0 * self.dp_rms,
            100.0 * self.dp_rms_err
        ));
        line(format!(
            "Same top p: {:6.3} ± {:5.3} %",
            100.0 * self.same_top,
            100.0 * self.same_top_err
        ));
        s
    }
}

/// The result of a run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Tokens of the whole text.
    pub text_tokens: usize,
    pub ctx: usize,
    pub chunks: usize,
    /// Scored tokens per chunk (`ctx - 1 - ctx/2`).
    pub scored_per_chunk: usize,
    /// BOS replaced the first token of every chunk.
    pub bos: bool,
    /// The scored tokens ran as decode steps ([`Request::decode`]).
    pub decode: bool,
    /// Perplexity per chunk, running (after chunks 1..=i).
    pub running_ppl: Vec<f64>,
    pub ppl: f64,
    pub ppl_err: f64,
    /// Mean negative log-likelihood in nats.
    pub nll_mean: f64,
    /// Tokens evaluated (`chunks · (ctx - 1)`) and the forward passes' time.
    pub tokens_evaluated: usize,
    pub seconds: f64,
    pub tokens_per_second: f64,
    pub kl: Option<KlReport>,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Request {
    /// The text (UTF-8).
    pub file: PathBuf,
    /// Tokens per chunk (default: the base's, else [`DEFAULT_CTX`]).
    pub ctx: Option<usize>,
    /// At most this many chunks (default: all that fit, or all of the base's).
    pub chunks: Option<usize>,
    pub save_logits: Option<PathBuf>,
    pub kl_base: Option<PathBuf>,
    /// Print the report as JSON instead of text.
    pub json: bool,
    /// Score the second half of each chunk one token at a time (the decode path: int8
    /// activations in the one-token matmuls under the default precision), instead of as one
    /// multi-token evaluation (the prefill path). The two paths differ numerically; this is
    /// how the decode path's cost in quality is measured.
    pub decode: bool,
}

/// How a model file is described in a base file: name, size, mode, backend, precision.
fn describe_model(load: &ds4_runtime::load::LoadOptions, engine: &Engine, decode: bool) -> String {
    let name = load
        .model
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| load.model.display().to_string());
    let size = std::fs::metadata(&load.model).map(|m| m.len()).unwrap_or(0);
    format!(
        "{name} ({size} bytes) · mode {} · backend {} · precision {} · scored by {}",
        engine.mode(),
        engine.backend_name(),
        load.config.precision.value.name(),
        if decode { "decode steps" } else { "prefill" }
    )
}

/// Whether the GGUF asks for BOS at the start of a sequence.
fn add_bos(file: &ds4_gguf::GgufFile) -> bool {
    matches!(
        file.header().get("tokenizer.ggml.add_bos_token"),
        Some(ds4_gguf::Value::Bool(true))
    )
}

/// Runs `ds4 perplexity`: the per-chunk lines go to `out` as they come (stdout), progress
/// notes to `log` (stderr); the final statistics are printed and returned.
pub fn run(
    req: &Request,
    load: &ds4_runtime::load::LoadOptions,
    out: &mut dyn Write,
    log: &mut dyn Write,
) -> anyhow::Result<Report> {
    if req.save_logits.is_some() && req.kl_base.is_some() {
        bail!("--save-logits and --kl-base cannot be combined: save a base with one run, compare with another");
    }
    let text_bytes =
        std::fs::read(&req.file).with_context(|| format!("reading {}", req.file.display()))?;
    let text_hash = sha256(&text_bytes);
    let text = String::from_utf8(text_bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not valid UTF-8 (bad byte at offset {})",
            req.file.display(),
            e.utf8_error().valid_up_to()
        )
    })?;

    // The base first: a mismatch should not cost a model load.
    let mut base = match &req.kl_base {
        Some(p) => Some(BaseReader::open(p)?),
        None => None,
    };
    let ctx = match (&base, req.ctx) {
        (Some(b), Some(c)) if c != b.header.ctx => bail!(
            "--ctx {c} does not match the base {}, computed with a context of {} (leave --ctx out to use it)",
            req.kl_base.as_ref().expect("base").display(),
            b.header.ctx
        ),
        (Some(b), _) => b.header.ctx,
        (None, c) => c.unwrap_or(DEFAULT_CTX),
    };
    if ctx < MIN_CTX {
        bail!("--ctx {ctx} is too small: a chunk needs at least {MIN_CTX} tokens");
    }
    if req.chunks == Some(0) {
        bail!("--chunks 0: nothing to evaluate");
    }

    let file = ds4_runtime::load::open_gguf(&load.model)?;
    let tok = ds4_runtime::load::tokenizer_from_gguf(&file)
        .with_context(|| format!("{}: no usable vocabulary", load.model.display()))?;
    let vhash = vocab_hash(&tok)?;
    let bos = add_bos(&file).then(|| tok.markers().bos);
    if let Some(b) = &base {
        let path = req.kl_base.as_ref().expect("base").display();
        if b.header.n_vocab != tok.vocab_size() || b.header.vocab_hash != vhash {
            bail!(
                "the base {path} was computed with another model vocabulary ({} ids, {}) than {} ({} ids): \
                 its log-probabilities cannot be compared with this model's",
                b.header.n_vocab,
                b.header.model,
                load.model.display(),
                tok.vocab_size()
            );
        }
        if b.header.text_hash != text_hash {
            bail!(
                "the base {path} was computed on another text than {} (SHA-256 {} vs {})",
                req.file.display(),
                &hex(&b.header.text_hash)[..16],
                &hex(&text_hash)[..16]
            );
        }
    }

    let mut tokens = tok
        .encode_with(&text, SpecialTokens::None)
        .with_context(|| format!("tokenizing {}", req.file.display()))?;
    let available = tokens.len() / ctx;
    if available == 0 {
        bail!(
            "{} is {} tokens long; one chunk of --ctx {ctx} needs {ctx} (use a longer text or a smaller --ctx)",
            req.file.display(),
            tokens.len()
        );
    }
    let n_chunks = match &base {
        Some(b) => {
            let n = req.chunks.unwrap_or(b.header.n_chunks);
            if n > b.header.n_chunks {
                bail!(
                    "--chunks {n}: the base {} has only {} chunks",
                    req.kl_base.as_ref().expect("base").display(),
                    b.header.n_chunks
                );
            }
            if n > available {
                bail!("the base has {n} chunks but the text has only {available} (same text hash: the tokenizer changed?)");
            }
            n
        }
        None => req.chunks.map_or(available, |k| k.min(available)),
    };
    let text_tokens = tokens.len();
    tokens.truncate(n_chunks * ctx);
    if let Some(b) = bos {
        for c in tokens.chunks_mut(ctx) {
            c[0] = b;
        }
    }
    let first = ctx / 2;
    let rows = scored_per_chunk(ctx);
    writeln!(
        log,
        "ds4: perplexity of {}: {text_tokens} tokens, {n_chunks} chunk(s) of {ctx} ({rows} scored per chunk{}){}",
        req.file.display(),
        if req.decode { ", one decode step each" } else { "" },
        if bos.is_some() { ", BOS first" } else { "" }
    )?;

    let opts = ds4_runtime::load::LoadOptions {
        ctx,
        kv_states: 1,
        // All-position logits take prefill_chunk × n_vocab floats of scratch: never more
        // rows than a chunk scores.
        prefill_chunk: load.prefill_chunk.min(ctx).max(1),
        ..load.clone()
    };
    let mut loaded = ds4_runtime::load::load(&opts, log)?;
    let engine = &mut loaded.engine;
    let n_vocab = engine.hparams().n_vocab;

    let mut writer = match &req.save_logits {
        Some(p) => Some(BaseWriter::create(
            p,
            BaseHeader {
                n_vocab,
                ctx,
                n_chunks,
                bos: bos.is_some(),
                vocab_hash: vhash,
                text_hash,
                model_id: loaded.model_id,
                model: describe_model(&opts, engine, req.decode),
            },
        )?),
        None => None,
    };
    if let Some(b) = &base {
        writeln!(
            log,
            "ds4: base {}: {}",
            req.kl_base.as_ref().expect("base").display(),
            b.header.model
        )?;
    }

    let mut state = engine.new_state_with_ctx(ctx)?;
    let mut ppl = PplAccum::default();
    let mut kl = base.as_ref().map(|_| KlAccum::default());
    let mut running = Vec::with_capacity(n_chunks);
    let mut lq = vec![0f32; rows * n_vocab];
    // The base's rows of one chunk (read in order, compared in parallel).
    let mut lb = vec![0f32; if base.is_some() { rows * n_vocab } else { 0 }];
    let mut tops = vec![0usize; rows];
    let mut logits = Vec::with_capacity(rows * n_vocab);
    let mut row = Vec::with_capacity(n_vocab);
    let mut seconds = 0.0f64;
    if kl.is_some() && !req.json {
        writeln!(
            out,
            "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p"
        )?;
    }
    let result = (|| -> anyhow::Result<()> {
        for (ci, chunk) in tokens.chunks(ctx).enumerate() {
            let t0 = Instant::now();
            engine.reset_state(&mut state)?;
            engine.eval(&mut state, &chunk[..first], Logits::None, None)?;
            if req.decode {
                logits.clear();
                for t in &chunk[first..ctx - 1] {
                    engine.eval_into(
                        &mut state,
                        std::slice::from_ref(t),
                        Logits::Last,
                        None,
                        &mut row,
                    )?;
                    logits.extend_from_slice(&row);
                }
            } else {
                engine.eval_into(
                    &mut state,
                    &chunk[first..ctx - 1],
                    Logits::All,
                    None,
                    &mut logits,
                )?;
            }
            let dt = t0.elapsed().as_secs_f64();
            seconds += dt;
            if ci == 0 && n_chunks > 1 {
                writeln!(
                    log,
                    "ds4: {dt:.2} s per chunk, about {:.1} min for {n_chunks}",
                    dt * n_chunks as f64 / 60.0
                )?;
            }
            // Rows in parallel (the log-softmax and KL of a 129,280-id row cost more than a
            // GPU's forward pass of it); the sums are taken in row order, so the result does
            // not depend on the thread count.
            logits
                .par_chunks(n_vocab)
                .zip(lq.par_chunks_mut(n_vocab))
                .zip(tops.par_iter_mut())
                .enumerate()
                .try_for_each(|(r, ((row, out), top))| {
                    *top = log_softmax(row, out).map_err(|e| (r, e))?;
                    Ok(())
                })
                .map_err(|(r, e): (usize, String)| {
                    anyhow::anyhow!(
                        "chunk {} position {}: the model produced an unusable row ({e})",
                        ci + 1,
                        first + r
                    )
                })?;
            for r in 0..rows {
                ppl.add(-f64::from(lq[r * n_vocab + chunk[first + r + 1] as usize]));
            }
            if let Some(w) = writer.as_mut() {
                w.write_chunk(chunk, &lq)?;
            }
            if let (Some(b), Some(k)) = (base.as_mut(), kl.as_mut()) {
                let base_tokens = b.begin_chunk()?;
                if let Some(i) = (0..ctx).find(|&i| base_tokens[i] != chunk[i]) {
                    bail!(
                        "chunk {} token {i}: the base has id {}, this run {}: the text or the tokenizer differs from the base's",
                        ci + 1,
                        base_tokens[i],
                        chunk[i]
                    );
                }
                for row in lb.chunks_mut(n_vocab) {
                    b.read_row(row)?;
                }
                let compared: Vec<RowKl> = (0..rows)
                    .into_par_iter()
                    .map(|r| {
                        let at = r * n_vocab..(r + 1) * n_vocab;
                        RowKl::new(
                            &lq[at.clone()],
                            tops[r],
                            &lb[at],
                            chunk[first + r + 1] as usize,
                        )
                    })
                    .collect();
                for c in compared {
                    k.push(c);
                }
            }
            running.push(ppl.ppl());
            if !req.json {
                match &kl {
                    Some(k) => writeln!(out, "{}", k.chunk_line(ci + 1))?,
                    None => write!(out, "[{}]{:.4},", ci + 1, ppl.ppl())?,
                }
                out.flush()?;
            }
        }
        Ok(())
    })();
    engine.free_state(state);
    result?;
    if let Some(w) = writer {
        w.finish()?;
        writeln!(
            log,
            "ds4: wrote the base log-probabilities to {}",
            req.save_logits.as_ref().expect("save path").display()
        )?;
    }
    let (p, p_err) = ppl.estimate();
    let evaluated = n_chunks * (ctx - 1);
    let report = Report {
        text_tokens,
        ctx,
        chunks: n_chunks,
        scored_per_chunk: rows,
        bos: bos.is_some(),
        decode: req.decode,
        running_ppl: running,
        ppl: p,
        ppl_err: p_err,
        nll_mean: ppl.sum / ppl.count.max(1) as f64,
        tokens_evaluated: evaluated,
        seconds,
        tokens_per_second: evaluated as f64 / seconds.max(1e-9),
        kl: kl.as_mut().map(KlAccum::report),
    };
    if req.json {
        writeln!(out, "{}", serde_json::to_string(&report)?)?;
    } else {
        if report.kl.is_none() {
            writeln!(out)?;
        }
        writeln!(out, "Final estimate: PPL = {:.4} +/- {:.5}", p, p_err)?;
        writeln!(
            out,
            "Speed: {:.1} tokens/s ({evaluated} tokens in {:.2} s)",
            report.tokens_per_second, seconds
        )?;
        if let Some(k) = &report.kl {
            writeln!(out)?;
            write!(out, "{}", k.render())?;
        }
    }
    out.flush()?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(n_vocab: usize, ctx: usize, n_chunks: usize) -> BaseHeader {
        BaseHeader {
            n_vocab,
            ctx,
            n_chunks,
            bos: false,
            vocab_hash: [1; 32],
            text_hash: [2; 32],
            model_id: [3; 32],
            model: "m.gguf (1 bytes)".into(),
        }
    }

    fn write_base(path: &Path, h: &BaseHeader) -> Vec<Vec<f32>> {
        let mut w = BaseWriter::create(path, h.clone()).unwrap();
        let mut all = Vec::new();
        for c in 0..h.n_chunks {
            let toks: Vec<u32> = (0..h.ctx as u32).map(|i| i + c as u32).collect();
            let rows: Vec<f32> = (0..h.rows_per_chunk() * h.n_vocab)
                .map(|i| -(i as f32) * 0.25 - c as f32)
                .collect();
            w.write_chunk(&toks, &rows).unwrap();
            all.push(rows);
        }
        w.finish().unwrap();
        all
    }

    #[test]
    fn base_file_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("b.logp");
        let h = header(5, 8, 3);
        let data = write_base(&p, &h);
        assert!(!dir.path().join("b.logp.partial").exists());
        assert_eq!(std::fs::metadata(&p).unwrap().len(), h.file_len());
        let mut r = BaseReader::open(&p).unwrap();
        assert_eq!(r.header, h);
        let mut row = vec![0f32; 5];
        for (c, rows) in data.iter().enumerate() {
            let toks = r.begin_chunk().unwrap();
            assert_eq!(toks[0], c as u32);
            for i in 0..h.rows_per_chunk() {
                r.read_row(&mut row).unwrap();
                assert_eq!(row, rows[i * 5..(i + 1) * 5]);
            }
        }
        assert!(r.begin_chunk().is_err());
    }

    #[test]
    fn damaged_base_files_are_refused_with_a_reason() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("b.logp");
        let h = header(5, 8, 2);
        write_base(&p, &h);
        let good = std::fs::read(&p).unwrap();
        let err = |bytes: &[u8]| {
            let q = dir.path().join("x.logp");
            std::fs::write(&q, bytes).unwrap();
            match BaseReader::open(&q) {
                Err(e) => format!("{e:#}"),
                Ok(mut r) => {
                    let mut row = vec![0f32; 5];
                    let res = (|| -> anyhow::Result<()> {
                        for _ in 0..r.header.n_chunks {
                            r.begin_chunk()?;
                            for _ in 0..r.header.rows_per_chunk() {
                                r.read_row(&mut row)?;
                            }
                        }
                        Ok(())
                    })();
                    format!("{:#}", res.expect_err("a damaged file must fail"))
                }
            }
        };
        assert!(
            err(&good[..good.len() - 1]).contains("truncated"),
            "{}",
            err(&good[..good.len() - 1])
        );
        assert!(err(&good[..20]).contains("shorter than a header"));
        assert!(err(&[good.as_slice(), b"x"].concat()).contains("after the 2 chunks"));
        let mut magic = good.clone();
        magic[0] = b'X';
        assert!(err(&magic).contains("wrong magic"));
        let mut version = good.clone();
        version[8] = 9;
        assert!(err(&version).contains("format version 9"));
        let mut ctx = good.clone();
        ctx[28] = 9; // rows per chunk no longer matches
        assert!(err(&ctx).contains("inconsistent header"));
        // A flipped bit in the second chunk's data: found by its checksum.
        let mut flip = good.clone();
        let at = h.header_len() + h.chunk_bytes() as usize + 8 * 4 + 3;
        flip[at] ^= 0x10;
        let e = err(&flip);
        assert!(e.contains("corrupt") && e.contains("chunk 2"), "{e}");
        // A partial file is removed when the writer is dropped unfinished.
        let q = dir.path().join("unfinished.logp");
        let w = BaseWriter::create(&q, h.clone()).unwrap();
        assert!(dir.path().join("unfinished.logp.partial").exists());
        drop(w);
        assert!(!dir.path().join("unfinished.logp.partial").exists());
        assert!(!q.exists());
    }

    #[test]
    fn log_softmax_normalises_and_rejects_nan() {
        let row = [1.0f32, 3.0, f32::NEG_INFINITY, 3.0];
        let mut out = [0f32; 4];
        assert_eq!(log_softmax(&row, &mut out).unwrap(), 1);
        let z: f64 = out.iter().map(|&v| f64::from(v).exp()).sum();
        assert!((z - 1.0).abs() < 1e-6);
        assert_eq!(out[2], f32::NEG_INFINITY);
        assert!(log_softmax(&[0.0, f32::NAN], &mut out[..2]).is_err());
        assert!(log_softmax(&[f32::NEG_INFINITY; 2], &mut out[..2]).is_err());
    }

    #[test]
    fn statistics_match_their_definitions() {
        // PPL: exp(mean), error PPL * sqrt(var / (n - 1)).
        let mut p = PplAccum::default();
        let xs = [1.0, 2.0, 3.0, 4.0];
        for x in xs {
            p.add(x);
        }
        let (ppl, err) = p.estimate();
        assert!((ppl - 2.5f64.exp()).abs() < 1e-12);
        let var = xs.iter().map(|x| (x - 2.5) * (x - 2.5)).sum::<f64>() / 4.0;
        assert!((err - ppl * (var / 3.0).sqrt()).abs() < 1e-12);
        // Quantiles (llama.cpp's interpolation) and median.
        let v = [0.0f32, 1.0, 2.0, 3.0];
        assert_eq!(percentile(&v, 0.5), 1.5);
        assert_eq!(percentile(&v, 1.0), 3.0);
        assert_eq!(percentile(&v, 0.0), 0.0);
        assert!((percentile(&v, 0.9) - 2.7).abs() < 1e-12);
        assert_eq!(median(&v), 1.5);
        assert_eq!(median(&v[..3]), 1.0);
        // Standard errors vanish at 10 values or fewer, as in llama.cpp.
        assert_eq!(mean_and_uncertainty(3.0, 5.0, 3).1, 0.0);
        assert_eq!(covariance(1.0, 1.0, 1.0, 9), 0.0);
    }

    #[test]
    fn kl_of_a_row_against_itself_is_zero_and_against_another_is_exact() {
        let a = [0.5f32, -1.0, 2.0, 0.0];
        let b = [0.0f32, 0.0, 1.0, 1.5];
        let (mut la, mut lb) = ([0f32; 4], [0f32; 4]);
        let ta = log_softmax(&a, &mut la).unwrap();
        let tb = log_softmax(&b, &mut lb).unwrap();
        assert_eq!((ta, tb), (2, 3));
        let mut k = KlAccum::default();
        k.add(&la, ta, &la, 1);
        assert_eq!(k.kld[0], 0.0);
        assert_eq!(k.n_same_top, 1);
        assert_eq!(k.p_diff[0], 0.0);
        // KL(b || a) computed directly in f64.
        let ls = |r: &[f32]| {
            let m = r.iter().fold(f64::MIN, |m, &v| m.max(f64::from(v)));
            let z: f64 = r.iter().map(|&v| (f64::from(v) - m).exp()).sum();
            r.iter()
                .map(|&v| f64::from(v) - m - z.ln())
                .collect::<Vec<f64>>()
        };
        let (pa, pb) = (ls(&a), ls(&b));
        let want: f64 = (0..4).map(|i| pb[i].exp() * (pb[i] - pa[i])).sum();
        k.add(&la, ta, &lb, 2);
        assert!(
            (f64::from(k.kld[1]) - want).abs() < 1e-6,
            "{} vs {want}",
            k.kld[1]
        );
        assert_eq!(k.n_same_top, 1, "argmax 2 vs 3");
        let dp = pa[2].exp() - pb[2].exp();
        assert!((f64::from(k.p_diff[1]) - dp).abs() < 1e-6);
        let r = k.report();
        assert_eq!(r.tokens, 2);
        assert!((r.same_top - 0.5).abs() < 1e-12);
    }
}
