//! Synthetic models: random weights in the exact ds4 layout, for speed benchmarks at the real
//! shapes (43 layers, 80.76 GiB for q2) where no real weights can be downloaded.
//!
//! # Determinism and random access
//! Every row of every tensor (a row = `ne0` values; a 1-D tensor is one row) is generated from
//! its own RNG stream, seeded from `(seed, tensor name, row index)`. So any row range of any
//! tensor can be materialised on its own, in any order, on any thread, straight into a
//! caller's buffer ([`SyntheticModel::fill_rows`]), and always yields the same bytes. A tensor
//! has the same bytes whatever the layer count (the seed uses its name, not its position).
//! This is what lets a benchmark on a machine whose disk cannot hold the 80.76 GiB file build
//! the weights directly in (device) memory.
//!
//! # Quantized tensors are generated as blocks, not quantized
//! Quantizing 77 GB of experts with the IQ2_XXS search would take hours on a small machine
//! and is irrelevant to speed. Quantized rows are therefore written as random *valid blocks*
//! of the target format whose dequantized values have the intended spread:
//! * Q8_0: random `i8` codes, `d = σ / 73.9` (the RMS of a uniform byte is ≈ 73.9);
//! * Q2_K: 4-bit scales `sc ∈ 1..=15` with min code `m = sc` and `dmin = 1.5·d`, so each
//!   sub-block is `d·sc·(q − 1.5)`: zero mean, RMS `d·√(1.25·E[sc²])`;
//! * Q4_K: 6-bit `sc ∈ 1..=63`, `m = sc`, `dmin = 7.5·d`: values `d·sc·(q − 7.5)`;
//! * IQ2_XXS: every byte after `d` is random (grid indices, sign patterns and the 4-bit
//!   group scales are all valid for any bit pattern), `d` chosen from the grid's mean square.
//! * MXFP4: random nibbles (every code is a value), the E8M0 scale drawn per block from the
//!   two powers of two around the target so that the mean square is exactly `σ²`
//!   ([`blocks_mxfp4`]).
//!
//! # Scales: why activations stay finite through 43 layers
//! * Matrices (every 2-D/3-D weight except the embedding): RMS `σ = 1/√ne0` (`ne0` = fan-in,
//!   the axis each row is dotted with). An RMS-normalised input then gives outputs of RMS ≈ 1
//!   at every projection, expert and head, so nothing grows multiplicatively.
//! * `token_embd`: RMS 1 (the residual starts at unit scale).
//! * Norm weights: exactly 1. `attn_sinks`: uniform ±0.5. HC base: uniform ±0.1; HC scales:
//!   uniform in [0.5, 1]. Compressor/indexer position biases (ape): uniform ±0.1. Router
//!   selection bias: uniform ±0.01. tid2eid: distinct random experts per token.
//! * The mHC mixing is bounded by construction (sigmoid pre/post weights, a doubly stochastic
//!   residual matrix), and SwiGLU is clamped at 10, so each sublayer adds an O(1) update to the
//!   residual: over 86 sublayers its RMS grows roughly like √86, never exponentially.
//!
//! Uniform (not Gaussian) draws are used for plain floats: same variance, no tails, cheaper.
//!
//! # Router skew (`--router-skew S`)
//! By default every expert is equally likely (uniform bias, uniform `tid2eid`), the worst
//! case for an expert cache. Real routers are skewed, so with
//! [`SyntheticModel::with_router_skew`] each layer ranks its experts in its own random order
//! (seeded by the tensor name) and favours low ranks, Zipf-like:
//! * top-k layers: the selection bias of the expert of rank `r` is lowered by
//!   `S · ln(1 + r)` (on top of the ±0.01 draw). Router scores `sqrtsoftplus(logit)` of
//!   these random weights spread over about one unit, so small `S` already skews hard: at
//!   256 experts, 6 per token, `S` = 0.05 puts a quarter of the picks on the top tenth of
//!   the experts and 0.3 over nine tenths, a nearly collapsed router (docs/server.md §12,
//!   measured by ds4-cpu's `the_census_sees_the_router_skew`);
//! * hash layers: each token's `tid2eid` experts are drawn (distinct) with probability
//!   ∝ `1 / (1 + r)^S`.
//!
//! `S = 0` (the default) writes exactly the bytes of a model without the option.
//! The skew changes only which experts are chosen (docs/placement.md §9 uses it to
//! measure the expert cache's hit rate).

use std::io::Write;

use ds4_gguf::quant::{bf16, f16, iq2xxs_tables};
use ds4_gguf::{GgmlType, Header};
use ds4_model::hparams::flash_schedule;
use ds4_model::layout::{model_header, placeholder_tokenizer, TokenizerData, TypeRecipe};
use ds4_model::{HParams, ModelSpec, Strictness};
use rayon::prelude::*;

use crate::error::{ConvertError, Result};
use crate::progress::Progress;
use ds4_gguf::GgufWriter;

/// `general.name` of synthetic files: the real model's name, so a synthetic file with the real
/// vocabulary has the real file's metadata byte count.
pub const SYNTHETIC_NAME: &str = "DeepSeek V4 Flash";

/// SplitMix64: tiny, fast, and good enough to make independent-looking weights.
#[derive(Clone)]
struct Rng(u64);

fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }

    /// Uniform in [-1, 1).
    fn sym(&mut self) -> [f32; 2] {
        let x = self.next_u64();
        let f = |b: u64| (b & 0xFF_FFFF) as f32 * (2.0 / 16_777_216.0) - 1.0;
        [f(x), f(x >> 32)]
    }

    fn fill_bytes(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let b = self.next_u64().to_le_bytes();
            rest.copy_from_slice(&b[..rest.len()]);
        }
    }

    /// Uniform in `0..n` (n > 0), by rejection so it is exact.
    fn below(&mut self, n: u64) -> u64 {
        let zone = u64::MAX - u64::MAX % n;
        loop {
            let x = self.next_u64();
            if x < zone {
                return x % n;
            }
        }
    }
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// What values a tensor gets (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Role {
    Ones,
    /// Uniform in [lo, hi].
    Range(f32, f32),
    /// Zero-mean with this RMS.
    Matrix(f32),
    /// tid2eid: `ne0` distinct expert ids below the bound per row.
    ExpertIds(u64),
    /// The top-k selection bias: uniform ±0.01 (lowered by the router skew).
    RouterBias,
}

fn role_of(name: &str, ne0: u64, n_expert: u64) -> Role {
    use ds4_model::{GlobalTensor as G, LayerTensor as L, TensorName as N};
    match N::parse(name) {
        Some(N::Global(G::TokenEmbd)) => return Role::Matrix(1.0),
        Some(N::Layer(_, L::Tid2Eid)) => return Role::ExpertIds(n_expert),
        Some(N::Layer(_, L::AttnSinks) | N::Mtp(_, L::AttnSinks)) => return Role::Range(-0.5, 0.5),
        Some(N::Layer(_, L::RouterBias) | N::Mtp(_, L::RouterBias)) => return Role::RouterBias,
        _ => {}
    }
    // Families by spelling: every norm weight, HC base/scale, compressor position bias.
    let leaf = match name.strip_prefix("blk.") {
        Some(r) => r.split_once('.').map(|(_, l)| l).unwrap_or(r),
        None => name,
    };
    match leaf {
        l if l.ends_with("norm.weight") => Role::Ones,
        l if l.ends_with("_base.weight") => Role::Range(-0.1, 0.1),
        l if l.ends_with("_scale.weight") => Role::Range(0.5, 1.0),
        l if l.ends_with("_ape.weight") => Role::Range(-0.1, 0.1),
        _ => Role::Matrix(1.0 / (ne0.max(1) as f32).sqrt()),
    }
}

/// Mean of `grid²` over all IQ2_XXS lattice entries (random indices pick them uniformly).
fn iq2_grid_mean_square() -> f32 {
    let (s, n) = iq2xxs_tables::GRID
        .iter()
        .flatten()
        .fold((0f64, 0u32), |(s, n), &g| {
            (s + f64::from(g) * f64::from(g), n + 1)
        });
    (s / f64::from(n)) as f32
}

/// One tensor's generation parameters.
#[derive(Debug, Clone)]
struct Gen {
    hash: u64,
    role: Role,
    ty: GgmlType,
    ne0: u64,
    rows: u64,
    row_bytes: u64,
}

/// A synthetic model: the header plus a deterministic generator for every tensor's bytes.
pub struct SyntheticModel {
    hparams: HParams,
    recipe: TypeRecipe,
    seed: u64,
    header: Header,
    gens: Vec<Gen>,
    data_offset: u64,
    file_size: u64,
    iq2_ms: f32,
    /// Zipf-like router skew (module docs); 0 = uniform.
    router_skew: f32,
}

impl SyntheticModel {
    /// The real Flash dimensions with `layers` layers (43 = the real model), the placeholder
    /// vocabulary, and `recipe` (normally [`TypeRecipe::Q2`] or [`TypeRecipe::Q4`]).
    pub fn new(recipe: TypeRecipe, layers: usize, seed: u64) -> Result<SyntheticModel> {
        let h = flash_hparams(layers)?;
        let tok = placeholder_tokenizer(h.n_vocab);
        SyntheticModel::from_hparams(h, recipe, seed, &tok)
    }

    /// As [`SyntheticModel::new`] with a given vocabulary (e.g. the real V4 one).
    pub fn with_tokenizer(
        recipe: TypeRecipe,
        layers: usize,
        seed: u64,
        tok: &TokenizerData,
    ) -> Result<SyntheticModel> {
        SyntheticModel::from_hparams(flash_hparams(layers)?, recipe, seed, tok)
    }

    /// Any dimensions (tiny synthetic models for tests). The header must pass validation
    /// (`Strictness::Auto`: ds4's exact rules at the real size, layout rules otherwise).
    pub fn from_hparams(
        h: HParams,
        recipe: TypeRecipe,
        seed: u64,
        tok: &TokenizerData,
    ) -> Result<SyntheticModel> {
        if tok.tokens.len() != h.n_vocab {
            return Err(ConvertError::Usage(format!(
                "the vocabulary has {} tokens, the model {}",
                tok.tokens.len(),
                h.n_vocab
            )));
        }
        let header = model_header(&h, &recipe, SYNTHETIC_NAME, tok);
        SyntheticModel::from_header(h, recipe, seed, header)
    }

    /// A synthetic model for a header made by [`model_header`] and then adjusted by the
    /// caller (the demo model changes two tensor types and its name). The header must still
    /// pass validation and block alignment.
    pub(crate) fn from_header(
        h: HParams,
        recipe: TypeRecipe,
        seed: u64,
        header: Header,
    ) -> Result<SyntheticModel> {
        crate::convert::check_block_alignment(&header, "synthetic")?;
        ModelSpec::from_header(&header, Strictness::Auto)?;
        SyntheticModel::unchecked(h, recipe, seed, header)
    }

    /// The MTP sidecar of this model (docs/gguf.md §3.5, §4.7): ds4's five keys and the 32
    /// `mtp.0.*` tensors with random weights of the same kinds, in the published types (all
    /// F32 for the f32 recipe, and F32 for a tensor whose rows a block type cannot split, at
    /// tiny dims), so `ds4 --draft mtp --mtp FILE` runs on a synthetic model. Its weights are
    /// not a trained predictor: drafts are mostly rejected.
    pub fn mtp_sidecar(&self) -> Result<SyntheticModel> {
        let h = &self.hparams;
        let mut tensors = ds4_model::layout::mtp_tensor_table(h);
        for t in &mut tensors {
            if self.recipe == TypeRecipe::F32 || t.ty.row_bytes(t.dims[0]).is_none() {
                t.ty = GgmlType::F32;
            }
        }
        let u32v = |n: usize| ds4_gguf::Value::U32(n as u32);
        let header = Header {
            metadata: vec![
                (
                    "general.architecture".into(),
                    ds4_gguf::Value::String("deepseek4_mtp_support".into()),
                ),
                (
                    "general.name".into(),
                    ds4_gguf::Value::String(format!("{SYNTHETIC_NAME} MTP support")),
                ),
                ("deepseek4.expert_count".into(), u32v(h.n_expert)),
                ("deepseek4.mtp_layer_count".into(), u32v(1)),
                ("deepseek4.nextn_predict_layers".into(), u32v(1)),
            ],
            tensors,
        };
        crate::convert::check_block_alignment(&header, "synthetic")?;
        ds4_model::mtp::validate_mtp(&header, h, false)?;
        // Another stream of random numbers than the main model's tensors.
        SyntheticModel::unchecked(h.clone(), self.recipe, self.seed ^ 0x4D54_5000, header)
            .map(|m| m.with_router_skew_unchecked(self.router_skew))
    }

    fn with_router_skew_unchecked(mut self, s: f32) -> SyntheticModel {
        self.router_skew = s;
        self
    }

    /// [`SyntheticModel::from_header`] without the model validation (the MTP sidecar is
    /// checked against its own rules).
    fn unchecked(
        h: HParams,
        recipe: TypeRecipe,
        seed: u64,
        mut header: Header,
    ) -> Result<SyntheticModel> {
        header.assign_offsets()?;
        let head = ds4_gguf::encode_header(&header)?.len() as u64;
        let align = header.alignment()?;
        let data_offset = ds4_gguf::header::align_up(head, align)
            .ok_or_else(|| ConvertError::Usage("header size overflows".into()))?;
        let file_size = ds4_gguf::file_size(&header)?;
        let n_expert = h.n_expert as u64;
        let gens = header
            .tensors
            .iter()
            .map(|t| {
                let ne0 = t.dims[0];
                let n = t.n_elements().unwrap_or(0);
                Gen {
                    hash: fnv1a(&t.name),
                    role: role_of(&t.name, ne0, n_expert),
                    ty: t.ty,
                    ne0,
                    rows: n / ne0.max(1),
                    row_bytes: t.ty.row_bytes(ne0).unwrap_or(0),
                }
            })
            .collect();
        Ok(SyntheticModel {
            hparams: h,
            recipe,
            seed,
            header,
            gens,
            data_offset,
            file_size,
            iq2_ms: iq2_grid_mean_square(),
            router_skew: 0.0,
        })
    }

    /// The same model with a Zipf-like router skew `s` (module docs "Router skew"):
    /// `s` must be finite and at least 0; 0 is the uniform default.
    pub fn with_router_skew(mut self, s: f32) -> Result<SyntheticModel> {
        if !(s.is_finite() && s >= 0.0) {
            return Err(ConvertError::Usage(format!(
                "--router-skew {s}: expected a finite number >= 0"
            )));
        }
        self.router_skew = s;
        Ok(self)
    }

    pub fn router_skew(&self) -> f32 {
        self.router_skew
    }

    /// Rank of every expert of the tensor with name hash `hash` (a random permutation:
    /// `rank[e]`), for the router skew.
    fn expert_ranks(&self, hash: u64, n: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..n).collect();
        let mut rng = Rng(mix64(self.seed ^ hash ^ 0x005E_ED0F_2A4C));
        for i in (1..n).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let mut rank = vec![0; n];
        for (r, &e) in order.iter().enumerate() {
            rank[e] = r;
        }
        rank
    }

    pub fn hparams(&self) -> &HParams {
        &self.hparams
    }

    pub fn recipe(&self) -> TypeRecipe {
        self.recipe
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Header with final offsets (relative to [`SyntheticModel::data_offset`]).
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Where the data section starts in the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Exact size of the file [`SyntheticModel::write_to`] produces.
    pub fn file_size(&self) -> u64 {
        self.file_size
    }

    pub fn tensor_index(&self, name: &str) -> Option<usize> {
        self.header.tensors.iter().position(|t| t.name == name)
    }

    /// Rows (`n_elements / ne0`) and bytes per row of tensor `index`.
    pub fn rows(&self, index: usize) -> Result<(u64, u64)> {
        let g = self.gen(index)?;
        Ok((g.rows, g.row_bytes))
    }

    fn gen(&self, index: usize) -> Result<&Gen> {
        self.gens.get(index).ok_or_else(|| {
            ConvertError::Usage(format!(
                "tensor index {index} out of range (the model has {})",
                self.gens.len()
            ))
        })
    }

    /// Materialises all of tensor `index` into `out` (exactly its byte size).
    pub fn fill_tensor(&self, index: usize, out: &mut [u8]) -> Result<()> {
        self.fill_rows(index, 0, out)
    }

    /// Materialises rows `first_row ..` of tensor `index` into `out`, whose length must be a
    /// whole number of rows inside the tensor. For a routed tensor, expert `e` is rows
    /// `e·ne1 .. (e+1)·ne1`. Runs on the rayon pool.
    pub fn fill_rows(&self, index: usize, first_row: u64, out: &mut [u8]) -> Result<()> {
        let g = self.gen(index)?;
        let name = &self.header.tensors[index].name;
        let rb = g.row_bytes as usize;
        if rb == 0 || !out.len().is_multiple_of(rb) {
            return Err(ConvertError::Usage(format!(
                "tensor {name}: buffer of {} bytes is not a whole number of {rb}-byte rows",
                out.len()
            )));
        }
        let n = (out.len() / rb) as u64;
        if first_row.checked_add(n).is_none_or(|end| end > g.rows) {
            return Err(ConvertError::Usage(format!(
                "tensor {name}: rows {first_row}..{} requested, it has {}",
                first_row.saturating_add(n),
                g.rows
            )));
        }
        out.par_chunks_mut(rb).enumerate().try_for_each(|(i, row)| {
            let mut rng = Rng(mix64(self.seed ^ g.hash ^ mix64(first_row + i as u64 + 1)));
            self.fill_row(g, &mut rng, row)
                .map_err(|e| ConvertError::Usage(format!("tensor {name}: {e}")))
        })
    }

    fn fill_row(&self, g: &Gen, rng: &mut Rng, out: &mut [u8]) -> std::result::Result<(), String> {
        let ne0 = g.ne0 as usize;
        if let Role::ExpertIds(n) = g.role {
            if (n as usize) < ne0 || g.ty != GgmlType::I32 {
                return Err(format!("cannot draw {ne0} distinct experts of {n}"));
            }
            let mut picked: Vec<u64> = Vec::with_capacity(ne0);
            if self.router_skew > 0.0 {
                // Zipf-like over this layer's ranks: P(rank r) ∝ 1/(1+r)^S, distinct.
                let rank = self.expert_ranks(g.hash, n as usize);
                let w: Vec<f64> = rank
                    .iter()
                    .map(|&r| (1.0 + r as f64).powf(-f64::from(self.router_skew)))
                    .collect();
                while picked.len() < ne0 {
                    let total: f64 = (0..n as usize)
                        .filter(|e| !picked.contains(&(*e as u64)))
                        .map(|e| w[e])
                        .sum();
                    let mut x = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
                    let mut choice = None;
                    for (e, &we) in w.iter().enumerate() {
                        if picked.contains(&(e as u64)) {
                            continue;
                        }
                        choice = Some(e as u64);
                        if x < we {
                            break;
                        }
                        x -= we;
                    }
                    picked.push(choice.ok_or("no expert left to draw")?);
                }
            }
            while picked.len() < ne0 {
                let e = rng.below(n);
                if !picked.contains(&e) {
                    picked.push(e);
                }
            }
            for (o, e) in out.chunks_exact_mut(4).zip(picked) {
                o.copy_from_slice(&(e as i32).to_le_bytes());
            }
            return Ok(());
        }
        match (g.ty, g.role) {
            (GgmlType::Q8_0, Role::Matrix(s)) => blocks_q8_0(rng, s, out),
            (GgmlType::Q2K, Role::Matrix(s)) => blocks_q2_k(rng, s, out),
            (GgmlType::Q4K, Role::Matrix(s)) => blocks_q4_k(rng, s, out),
            (GgmlType::Iq2Xxs, Role::Matrix(s)) => blocks_iq2_xxs(rng, s, self.iq2_ms, out),
            (GgmlType::Mxfp4, Role::Matrix(s)) => blocks_mxfp4(rng, s, out),
            (ty, role) => {
                let mut vals = vec![0f32; ne0];
                plain_values(rng, role, &mut vals);
                if role == Role::RouterBias && self.router_skew > 0.0 {
                    let rank = self.expert_ranks(g.hash, ne0);
                    for (v, r) in vals.iter_mut().zip(rank) {
                        *v -= self.router_skew * (1.0 + r as f32).ln();
                    }
                }
                match ty {
                    GgmlType::F32 => {
                        for (o, v) in out.chunks_exact_mut(4).zip(&vals) {
                            o.copy_from_slice(&v.to_le_bytes());
                        }
                    }
                    GgmlType::F16 => {
                        for (o, v) in out.chunks_exact_mut(2).zip(&vals) {
                            o.copy_from_slice(&f16::f32_to_f16(*v).to_le_bytes());
                        }
                    }
                    GgmlType::Bf16 => {
                        for (o, v) in out.chunks_exact_mut(2).zip(&vals) {
                            o.copy_from_slice(&bf16::f32_to_bf16(*v).to_le_bytes());
                        }
                    }
                    // A quantized vector (not in ds4's recipes): quantize honestly.
                    _ => {
                        let b = ds4_gguf::quant::quantize(ty, &vals, None)
                            .map_err(|e| e.to_string())?;
                        out.copy_from_slice(&b);
                    }
                }
            }
        }
        Ok(())
    }

    /// Writes the whole file, one bounded chunk of rows at a time (at most ~32 MiB buffered
    /// besides the writer's own buffer). Returns the sink and the bytes written.
    pub fn write_to<W: Write>(&self, out: W, progress: &mut dyn Progress) -> Result<(W, u64)> {
        const CHUNK: u64 = 32 << 20;
        progress.start(self.file_size - self.data_offset);
        let mut w = GgufWriter::new(out, self.header.clone())?;
        let mut buf: Vec<u8> = Vec::new();
        for (i, g) in self.gens.iter().enumerate() {
            progress.tensor(&self.header.tensors[i].name);
            let rows_per = (CHUNK / g.row_bytes.max(1)).max(1);
            let mut r = 0;
            while r < g.rows {
                let n = rows_per.min(g.rows - r);
                buf.resize((n * g.row_bytes) as usize, 0);
                self.fill_rows(i, r, &mut buf)?;
                w.write(&buf)?;
                progress.advance(buf.len() as u64);
                r += n;
            }
        }
        let r = w.finish()?;
        progress.finish();
        Ok(r)
    }
}

impl SyntheticModel {
    /// Writes the file like [`SyntheticModel::write_to`], except that the routed-expert
    /// tensors ([`is_routed_expert`]) are left as holes: nothing is written there, the file
    /// just has its full length, so those bytes read back as zeros, which are valid
    /// blocks of every quantized type (scale 0: all values 0). Why: the full-size q2 file
    /// is 80.76 GiB, of which the experts are ~77 GB; sparse, it fits a 64 GiB disk, and
    /// loading it still reads (and copies) every byte at full size. Returns the bytes
    /// actually written (header plus the dense tensors).
    pub fn write_sparse_experts(
        &self,
        f: &std::fs::File,
        path: &std::path::Path,
        progress: &mut dyn Progress,
    ) -> Result<u64> {
        use crate::error::io_err;
        use std::os::unix::fs::FileExt;
        const CHUNK: u64 = 32 << 20;
        let dense: u64 = self
            .gens
            .iter()
            .zip(&self.header.tensors)
            .filter(|(_, t)| !is_routed_expert(&t.name))
            .map(|(g, _)| g.rows * g.row_bytes)
            .sum();
        progress.start(dense);
        let head = ds4_gguf::encode_header(&self.header)?;
        f.write_all_at(&head, 0).map_err(io_err(path))?;
        let mut written = head.len() as u64;
        let mut buf: Vec<u8> = Vec::new();
        for (i, g) in self.gens.iter().enumerate() {
            let t = &self.header.tensors[i];
            if is_routed_expert(&t.name) {
                continue;
            }
            progress.tensor(&t.name);
            let rows_per = (CHUNK / g.row_bytes.max(1)).max(1);
            let mut at = self.data_offset + t.offset;
            let mut r = 0;
            while r < g.rows {
                let n = rows_per.min(g.rows - r);
                buf.resize((n * g.row_bytes) as usize, 0);
                self.fill_rows(i, r, &mut buf)?;
                f.write_all_at(&buf, at).map_err(io_err(path))?;
                progress.advance(buf.len() as u64);
                at += buf.len() as u64;
                written += buf.len() as u64;
                r += n;
            }
        }
        f.set_len(self.file_size).map_err(io_err(path))?;
        progress.finish();
        Ok(written)
    }
}

/// Whether `name` is a routed-expert tensor (`blk.N.ffn_{gate,up,down}_exps.weight`), the
/// ones [`SyntheticModel::write_sparse_experts`] leaves as holes.
pub fn is_routed_expert(name: &str) -> bool {
    use ds4_model::{LayerTensor as L, TensorName};
    matches!(
        TensorName::parse(name),
        Some(TensorName::Layer(_, L::GateExps | L::UpExps | L::DownExps))
    )
}

/// The real Flash hyper-parameters with `layers` layers (schedule and clamp vectors resized,
/// hash layers = min(3, layers)).
pub fn flash_hparams(layers: usize) -> Result<HParams> {
    if layers == 0 || layers > 4096 {
        return Err(ConvertError::Usage(format!(
            "--layers {layers} is outside 1..=4096"
        )));
    }
    let mut h = HParams::flash();
    h.n_layer = layers;
    h.compress_ratios = flash_schedule(layers);
    h.swiglu_clamp = vec![10.0; layers];
    h.hash_layer_count = h.hash_layer_count.min(layers);
    Ok(h)
}

fn plain_values(rng: &mut Rng, role: Role, out: &mut [f32]) {
    let (lo, hi) = match role {
        Role::Ones => {
            out.fill(1.0);
            return;
        }
        Role::Range(lo, hi) => (lo, hi),
        // Uniform on [-a, a] has RMS a/√3.
        Role::Matrix(s) => (-s * 3f32.sqrt(), s * 3f32.sqrt()),
        Role::ExpertIds(_) => (0.0, 0.0),
        Role::RouterBias => (-0.01, 0.01),
    };
    let (mid, half) = ((lo + hi) * 0.5, (hi - lo) * 0.5);
    let mut it = out.chunks_exact_mut(2);
    for pair in &mut it {
        let [a, b] = rng.sym();
        pair[0] = mid + half * a;
        pair[1] = mid + half * b;
    }
    for v in it.into_remainder() {
        *v = mid + half * rng.sym()[0];
    }
}

fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::f32_to_f16(v).to_le_bytes());
}

/// RMS of a uniformly random i8: √(Σ q² / 256) over −128..=127.
const I8_RMS: f32 = 73.900_6;

fn blocks_q8_0(rng: &mut Rng, s: f32, out: &mut [u8]) {
    let d = s / I8_RMS;
    for b in out.chunks_exact_mut(34) {
        put_f16(b, 0, d);
        rng.fill_bytes(&mut b[2..]);
    }
}

fn blocks_q2_k(rng: &mut Rng, s: f32, out: &mut [u8]) {
    // sc uniform in 1..=15: E[sc²] = 1240/15; q uniform in 0..=3 around 1.5: Var = 1.25.
    let d = s / (1.25f32 * 1240.0 / 15.0).sqrt();
    for b in out.chunks_exact_mut(84) {
        for sc in &mut b[..16] {
            let v = 1 + rng.below(15) as u8;
            *sc = v | (v << 4);
        }
        rng.fill_bytes(&mut b[16..80]);
        put_f16(b, 80, d);
        put_f16(b, 82, 1.5 * d);
    }
}

fn blocks_q4_k(rng: &mut Rng, s: f32, out: &mut [u8]) {
    // sc uniform in 1..=63: E[sc²] = 64·127/6; nibble uniform in 0..=15: Var = 255/12.
    let d = s / ((64.0f32 * 127.0 / 6.0) * (255.0 / 12.0)).sqrt();
    for b in out.chunks_exact_mut(144) {
        put_f16(b, 0, d);
        put_f16(b, 2, 7.5 * d);
        let mut sc = [0u8; 8];
        for v in &mut sc {
            *v = 1 + rng.below(63) as u8;
        }
        // 6-bit codes, min code = scale code (docs/gguf.md §6, Q4_K scale packing).
        let s12 = &mut b[4..16];
        s12.fill(0);
        for j in 0..4 {
            s12[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            s12[j + 4] = sc[j] | ((sc[j + 4] >> 4) << 6);
            s12[j + 8] = (sc[j + 4] & 15) | ((sc[j + 4] & 15) << 4);
        }
        rng.fill_bytes(&mut b[16..144]);
    }
}

fn blocks_iq2_xxs(rng: &mut Rng, s: f32, grid_ms: f32, out: &mut [u8]) {
    // Value = d·(0.5+ls)·0.25·grid·sign with ls uniform in 0..=15: E[(0.5+ls)²] = 85.25.
    let d = s / (0.0625 * 85.25 * grid_ms).sqrt();
    for b in out.chunks_exact_mut(66) {
        put_f16(b, 0, d);
        rng.fill_bytes(&mut b[2..]);
    }
}

/// Random MXFP4 blocks with RMS `s`. A uniform random code has `E[kv²] = 274/8 = 34.25`
/// (ggml's doubled E2M1 values 0, 1, 2, 3, 4, 6, 8, 12, each with both signs), and a block's
/// values are `2^(e−128)·kv`. The scale can only be a power of two, so a block takes
/// `2^k` or `2^(k+1)` (with `4^k ≤ t² < 4^(k+1)`, `t² = s²/34.25`) with the probability `p`
/// that makes the mean of the squared scale exactly `t²`: `p·4^(k+1) + (1−p)·4^k = t²`.
fn blocks_mxfp4(rng: &mut Rng, s: f32, out: &mut [u8]) {
    let t2 = f64::from(s) * f64::from(s) / 34.25;
    let k = (t2.log2() / 2.0).floor();
    let p = (t2 / 4f64.powf(k) - 1.0) / 3.0;
    // E8M0 byte of 2^k is k + 128 (docs/gguf.md §6: y = 2^(e−128)·kv); kept in range.
    let e_lo = (k + 128.0).clamp(0.0, 254.0) as u8;
    for b in out.chunks_exact_mut(17) {
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        b[0] = if u < p { e_lo + 1 } else { e_lo };
        rng.fill_bytes(&mut b[1..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_gguf::quant;

    fn stats(v: &[f32]) -> (f64, f64) {
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let rms = (v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / n).sqrt();
        (mean, rms)
    }

    #[test]
    fn direct_blocks_dequantize_to_the_intended_spread() {
        let s = 1.0 / 64.0;
        for ty in [
            GgmlType::Q8_0,
            GgmlType::Q2K,
            GgmlType::Q4K,
            GgmlType::Iq2Xxs,
            GgmlType::Mxfp4,
        ] {
            let n = 256 * 512;
            let mut bytes = vec![0u8; ty.bytes_for(n as u64).unwrap() as usize];
            let mut rng = Rng(42);
            match ty {
                GgmlType::Q8_0 => blocks_q8_0(&mut rng, s, &mut bytes),
                GgmlType::Q2K => blocks_q2_k(&mut rng, s, &mut bytes),
                GgmlType::Q4K => blocks_q4_k(&mut rng, s, &mut bytes),
                GgmlType::Mxfp4 => blocks_mxfp4(&mut rng, s, &mut bytes),
                _ => blocks_iq2_xxs(&mut rng, s, iq2_grid_mean_square(), &mut bytes),
            }
            let mut out = vec![0f32; n];
            quant::dequantize(ty, &bytes, &mut out).unwrap();
            assert!(out.iter().all(|x| x.is_finite()));
            let (mean, rms) = stats(&out);
            assert!(
                (rms / f64::from(s) - 1.0).abs() < 0.05,
                "{ty}: rms {rms} vs {s}"
            );
            assert!(mean.abs() < 0.02 * f64::from(s), "{ty}: mean {mean}");
        }
    }

    #[test]
    fn q4_k_scale_codes_round_trip() {
        let mut rng = Rng(7);
        let mut b = vec![0u8; 144];
        blocks_q4_k(&mut rng, 0.01, &mut b);
        for j in 0..8 {
            let s12: &[u8; 12] = b[4..16].try_into().unwrap();
            let (sc, m) = quant::q4_k::scale_min(j, s12);
            assert!((1..=63).contains(&sc), "{j}: {sc}");
            assert_eq!(sc, m, "sub-block {j}");
        }
    }

    #[test]
    fn roles() {
        assert_eq!(role_of("blk.3.attn_norm.weight", 4096, 256), Role::Ones);
        assert_eq!(role_of("output_norm.weight", 4096, 256), Role::Ones);
        assert_eq!(
            role_of("blk.3.hc_attn_scale.weight", 3, 256),
            Role::Range(0.5, 1.0)
        );
        assert_eq!(
            role_of("output_hc_base.weight", 4, 256),
            Role::Range(-0.1, 0.1)
        );
        assert_eq!(
            role_of("blk.0.ffn_gate_tid2eid.weight", 6, 256),
            Role::ExpertIds(256)
        );
        assert_eq!(
            role_of("blk.2.indexer.attn_q_b.weight", 1024, 256),
            Role::Matrix(1.0 / 32.0)
        );
        assert_eq!(role_of("token_embd.weight", 4096, 256), Role::Matrix(1.0));
    }

    #[test]
    fn rows_are_independent_of_chunking_and_seeded() {
        let m = SyntheticModel::new(TypeRecipe::Q2, 1, 5).unwrap();
        let i = m.tensor_index("blk.0.ffn_gate_exps.weight").unwrap();
        let (_, rb) = m.rows(i).unwrap();
        let mut a = vec![0u8; (rb * 8) as usize];
        m.fill_rows(i, 100, &mut a).unwrap();
        let mut b = vec![0u8; (rb * 3) as usize];
        m.fill_rows(i, 103, &mut b).unwrap();
        assert_eq!(&a[(rb * 3) as usize..(rb * 6) as usize], &b[..]);
        let other = SyntheticModel::new(TypeRecipe::Q2, 1, 6).unwrap();
        let mut c = vec![0u8; (rb * 8) as usize];
        other.fill_rows(i, 100, &mut c).unwrap();
        assert_ne!(a, c);
        // Out-of-range and ragged requests are refused.
        assert!(m.fill_rows(i, u64::MAX, &mut b).is_err());
        assert!(m.fill_rows(i, 0, &mut b[..5]).is_err());
        assert!(m.fill_tensor(99_999, &mut b).is_err());
    }

    #[test]
    fn tid2eid_rows_are_distinct_valid_experts() {
        let m = SyntheticModel::new(TypeRecipe::Q2, 1, 1).unwrap();
        let i = m.tensor_index("blk.0.ffn_gate_tid2eid.weight").unwrap();
        let (rows, rb) = m.rows(i).unwrap();
        let mut buf = vec![0u8; (rows * rb) as usize];
        m.fill_tensor(i, &mut buf).unwrap();
        for row in buf.chunks_exact(rb as usize) {
            let ids: Vec<i32> = row
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            assert!(ids.iter().all(|&e| (0..256).contains(&e)));
            let mut s = ids.clone();
            s.sort();
            s.dedup();
            assert_eq!(s.len(), 6);
        }
    }
}
