//! The GPU backend with its kernels run on the CPU (`ds4_gpu::emu`: every `kernels/*.cu`
//! compiled by the host C++ compiler, each GPU thread a fiber) against the CPU backend, op
//! by op through the mirror, on a tiny random q2 model: the host logic and the kernels of
//! the CUDA/HIP backends checked in every CI run, without a GPU. Speed and the GPU's own
//! math library are out of its reach (the H200 runs of `ds4-engine-check ops` cover them).

mod common;

use std::sync::{Arc, OnceLock};

use common::{machine, model_file_from, model_file_with};
use ds4_check::mirror::{Mirror, OpRule, OpStat};
use ds4_cpu::CpuBackend;
use ds4_engine::{Backend, Engine, EngineConfig, Logits, NumericMode};
use ds4_gpu::backend::{GpuBackend, GpuOptions, HipBackend, Knobs, PrefillTiles};
use ds4_gpu::emu::EmuKernels;
use ds4_gpu::hip::device::HipSettings;
use ds4_gpu::hip::fake::{FakeHip, Faults};
use ds4_gpu::KernelCache;
use ds4_model::layout::TypeRecipe;

fn kernels(mma: bool) -> Arc<EmuKernels> {
    static K: OnceLock<Arc<EmuKernels>> = OnceLock::new();
    static NO_MMA: OnceLock<Arc<EmuKernels>> = OnceLock::new();
    let (cell, extra): (_, &[&str]) = if mma {
        (&K, &[])
    } else {
        (&NO_MMA, &["-DDS4_EMU_NO_MMA"])
    };
    cell.get_or_init(|| {
        Arc::new(EmuKernels::build_with(extra).expect("building the kernel emulation"))
    })
    .clone()
}

/// The HIP backend over a fake runtime that runs the emulated kernels: the f32 kernels
/// (`--quality`'s) but for `tiles`, which the tests choose; int8 activations are set by
/// each test.
fn emulated_backend(
    m: &ds4_placement::MachineFacts,
    dir: &std::path::Path,
    mma: bool,
    tiles: PrefillTiles,
) -> (Arc<FakeHip>, HipBackend) {
    let knobs = Knobs {
        prefill_tiles: tiles,
        ..Knobs::quality()
    };
    emulated_backend_with(m, dir, mma, knobs)
}

/// [`emulated_backend`] with these knobs.
fn emulated_backend_with(
    m: &ds4_placement::MachineFacts,
    dir: &std::path::Path,
    mma: bool,
    knobs: Knobs,
) -> (Arc<FakeHip>, HipBackend) {
    let fake = FakeHip::for_machine(m, Faults::default());
    fake.set_kernels(kernels(mma));
    let opts = GpuOptions {
        cache: KernelCache::at(dir.join("kernels")),
        pread_load: true,
        knobs: Knobs {
            cublas: None,
            ..knobs
        },
        ..GpuOptions::default()
    };
    let be = GpuBackend::with_device(fake.device(m, HipSettings::default()), opts, None).unwrap();
    (fake, be)
}

struct Run {
    /// Kernels with the tensor-core paths (CUDA) or without (HIP's paths).
    mma: bool,
    recipe: TypeRecipe,
    tiles: PrefillTiles,
    act_q8: bool,
    chunk: usize,
    mode: NumericMode,
    /// Prompt tokens prefilled before the decode steps.
    prompt: usize,
}

/// Prefill `r.prompt` tokens in chunks, two decode steps, a greedy step and a batched step of two
/// sequences, mirrored; returns the
/// per-op statistics and the emulation's refusals, on a synthetic model of `h`.
fn mirrored_on(r: &Run, h: ds4_model::HParams) -> (Vec<(&'static str, OpStat)>, Vec<String>) {
    let dir = tempfile::tempdir().unwrap();
    let file = model_file_from(dir.path(), h, r.recipe);
    let m = machine("strix-halo-stock");
    let (fake, gpu) = emulated_backend(&m, dir.path(), r.mma, r.tiles);
    let mut mirror = Mirror::new(CpuBackend::new(1).unwrap(), gpu);
    mirror.set_activation_q8(r.act_q8).unwrap();
    let stats = mirror.stats.clone();
    let cfg = EngineConfig {
        mode: Some(r.mode),
        ctx: 256,
        prefill_chunk: r.chunk,
    };
    let mut eng = Engine::load(file, Box::new(mirror), cfg).unwrap();
    let vocab = eng.hparams().n_vocab as u32;
    let n = r.prompt;
    let toks: Vec<u32> = (0..n as u32 + 2).map(|i| (i * 37 + 11) % vocab).collect();
    let mut st = eng.new_state().unwrap();
    eng.eval(&mut st, &toks[..n], Logits::Last, None).unwrap();
    for t in &toks[n..] {
        eng.eval(&mut st, std::slice::from_ref(t), Logits::Last, None)
            .unwrap();
    }
    eng.eval_argmax(&mut st, &toks[..1]).unwrap();
    eng.eval_band(&mut st, &toks[1..2], 3.0, Some(3)).unwrap();
    // A batched decode step of two sequences (decode rows: int8 row by row when on).
    let mut st2 = eng.new_state().unwrap();
    eng.eval(&mut st2, &toks[..3], Logits::Last, None).unwrap();
    eng.eval_batch(&mut [&mut st, &mut st2], &toks[3..5])
        .unwrap();
    drop(eng);
    let s = stats.lock().unwrap().clone().into_iter().collect();
    (s, fake.kernel_errors())
}

fn check(r: Run) {
    check_on(r, common::tiny_hparams())
}

/// [`check`] on a synthetic model of `h` ([`mirrored_on`]).
fn check_on(r: Run, h: ds4_model::HParams) {
    let (stats, errors) = mirrored_on(&r, h);
    assert!(errors.is_empty(), "{errors:?}");
    for (op, s) in &stats {
        eprintln!(
            "  {op:<18} {:>5} calls  max rel {:.3e}  NaN {}  int diff {}",
            s.calls, s.max_rel, s.nan, s.int_mismatches
        );
    }
    for op in [
        "matmul",
        "attention",
        "moe",
        "router",
        "hc_post_mix_pre_norm",
        "hc_post_add",
        "argmax",
        "logit_band",
    ] {
        assert!(
            stats.iter().any(|(o, s)| *o == op && s.calls > 0),
            "{op} never ran"
        );
    }
    let rule = OpRule {
        mode: r.mode,
        act_q8: r.act_q8,
        tiles: r.tiles,
        attn_half: false,
    };
    let bad: Vec<String> = stats
        .iter()
        .filter(|(op, s)| !rule.passes(op, s))
        .map(|(op, s)| {
            format!(
                "{op}: max rel {:.3e} (tol {:e}), NaN {}, int diff {}",
                s.max_rel,
                rule.tolerance(op),
                s.nan,
                s.int_mismatches
            )
        })
        .collect();
    assert!(bad.is_empty(), "{bad:#?}");
}

#[test]
fn emulated_gpu_ops_match_the_cpu_exact() {
    check(Run {
        mma: true,
        // Chunks of 36 and 4: f32 panels with the built-in GEMM and experts grouped on
        // the host (72 selections), then the small-batch kernel and the grouped GEMV.
        recipe: TypeRecipe::Q2,
        tiles: PrefillTiles::Off,
        act_q8: false,
        chunk: 36,
        mode: NumericMode::Exact,
        prompt: 40,
    });
}

/// Chunks of 10 (then 10, 10, 10): from the second chunk on a chunk starts inside a window,
/// so `ds4_compressor_windows` pools windows whose first tokens are in the accumulator and
/// `ds4_compressor_tail` rebuilds it (a CSA layer: ratio 4 with overlap, and its indexer's
/// compressor; an HCA layer: ratio 8 without); the mirror compares rows and accumulator
/// with the CPU's sequential compressor.
#[test]
fn emulated_prefill_compressor_windows_match_the_cpu() {
    let h = ds4_model::HParams {
        n_layer: 2,
        hash_layer_count: 1,
        swiglu_clamp: vec![10.0; 2],
        compress_ratios: vec![4, 8],
        ..common::tiny_hparams()
    };
    let (stats, errors) = mirrored_on(
        &Run {
            mma: true,
            recipe: TypeRecipe::Q2,
            tiles: PrefillTiles::Off,
            act_q8: false,
            chunk: 10,
            mode: NumericMode::Exact,
            prompt: 40,
        },
        h,
    );
    assert!(errors.is_empty(), "{errors:?}");
    let comp = stats
        .iter()
        .find(|(op, _)| *op == "compressor")
        .map(|(_, s)| s.clone())
        .expect("the compressor ran");
    // The parallel kernels reproduce the sequential arithmetic: no tolerance needed.
    assert!(
        comp.calls > 0 && comp.max_rel == 0.0 && comp.nan == 0,
        "{comp:?}"
    );
}

#[test]
fn emulated_gpu_ops_match_the_cpu_official_int8_q4() {
    // Q4_K experts: the Q4_K tile decode at prefill, the int8 Q4_K GEMVs at decode.
    check(Run {
        mma: true,
        recipe: TypeRecipe::Q4,
        tiles: PrefillTiles::Experts,
        act_q8: true,
        chunk: 40,
        mode: NumericMode::Official,
        prompt: 40,
    });
}

/// MXFP4 experts (issue 54): the MXFP4 tile decode at prefill (rows of 256 values: 136
/// bytes, a 4-byte multiple) and, at these widths (not multiples of 512), the int8 generic
/// GEMV at decode; official mode, as `ds4` runs.
#[test]
fn emulated_gpu_ops_match_the_cpu_official_int8_mxfp4() {
    check(Run {
        mma: true,
        recipe: TypeRecipe::MXFP4,
        tiles: PrefillTiles::Experts,
        act_q8: true,
        chunk: 40,
        mode: NumericMode::Official,
        prompt: 40,
    });
}

/// MXFP4 experts on the f32 paths (`--quality`): dequantized panels at prefill
/// (`ds4_dequant_rows`), the small-batch kernel (`ds4_matmul_generic`) for the short chunk
/// and at decode; exact mode.
#[test]
fn emulated_gpu_ops_match_the_cpu_exact_mxfp4() {
    check(Run {
        mma: true,
        recipe: TypeRecipe::MXFP4,
        tiles: PrefillTiles::Off,
        act_q8: false,
        chunk: 36,
        mode: NumericMode::Exact,
        prompt: 40,
    });
}

/// MXFP4 experts 512 wide (gate/up 512 × 512, down 512 × 512): rows the MXFP4 GEMVs take
/// (multiples of 512 values), so decode runs the grouped int8 MXFP4 GEMVs and the batched
/// step the flat ones, and the tiles see several row tiles per expert.
#[test]
fn emulated_gpu_ops_match_the_cpu_mxfp4_gemv_widths() {
    let h = ds4_model::HParams {
        n_embd: 512,
        expert_ff: 512,
        ..common::tiny_hparams()
    };
    check_on(
        Run {
            mma: true,
            recipe: TypeRecipe::MXFP4,
            tiles: PrefillTiles::Experts,
            act_q8: true,
            chunk: 40,
            mode: NumericMode::Exact,
            prompt: 40,
        },
        h,
    );
}

/// The MXFP4 tile decode on the tile kernels' HIP path (plain FMAs, no `mma.sync`).
#[test]
fn emulated_mxfp4_tiles_without_matrix_instructions_match_the_cpu() {
    check(Run {
        mma: false,
        recipe: TypeRecipe::MXFP4,
        tiles: PrefillTiles::Experts,
        act_q8: false,
        chunk: 40,
        mode: NumericMode::Exact,
        prompt: 40,
    });
}

#[test]
fn emulated_prefill_tiles_match_the_cpu() {
    // 40-token chunks: 80 expert selections, past the grouped GEMV, onto the tiles.
    check(Run {
        mma: true,
        recipe: TypeRecipe::Q2,
        tiles: PrefillTiles::All,
        act_q8: false,
        chunk: 40,
        mode: NumericMode::Exact,
        prompt: 40,
    });
}

#[test]
fn emulated_prefill_wide_tiles_match_the_cpu() {
    // One 136-token chunk: the dense matmuls take ds4_mm_tiles_wide (64 rows x 128
    // tokens per block; two token tiles, the second of 8 tokens, and 16-value decode
    // pieces), the experts ds4_mm_tiles.
    check(Run {
        mma: true,
        recipe: TypeRecipe::Q2,
        tiles: PrefillTiles::All,
        act_q8: false,
        chunk: 136,
        mode: NumericMode::Exact,
        prompt: 136,
    });
}

#[test]
fn emulated_prefill_tiles_without_matrix_instructions_match_the_cpu() {
    // The tile kernels' HIP path (plain FMAs on the same shared tiles).
    check(Run {
        mma: false,
        recipe: TypeRecipe::Q2,
        tiles: PrefillTiles::Experts,
        act_q8: false,
        chunk: 40,
        mode: NumericMode::Exact,
        prompt: 40,
    });
}

/// An expert id outside the tensor must surface as an error at the next read-back on every
/// routed-expert path (grouped GEMV, host-grouped panels, tiles sorted on the device), never
/// as a silent result or an out-of-bounds read.
#[test]
fn a_bad_expert_id_is_an_error_on_every_moe_path() {
    use ds4_engine::backend::{MoeArgs, WeightUse};
    use ds4_model::names::LayerTensor;
    let dir = tempfile::tempdir().unwrap();
    let file = model_file_with(dir.path(), TypeRecipe::Q2);
    let m = machine("strix-halo-stock");
    for (tiles, n_tok) in [
        (PrefillTiles::Off, 2),
        (PrefillTiles::Off, 40),
        (PrefillTiles::Experts, 40),
    ] {
        let (fake, mut be) = emulated_backend(&m, dir.path(), true, tiles);
        let w = |be: &mut HipBackend, t: LayerTensor| {
            be.load_weight(&file, &t.name(1), WeightUse::Matrix)
                .unwrap()
        };
        let (gate, up, down) = (
            w(&mut be, LayerTensor::GateExps),
            w(&mut be, LayerTensor::UpExps),
            w(&mut be, LayerTensor::DownExps),
        );
        let (d, k, ne) = (gate.info.cols(), 2, gate.info.mats());
        let x = be.alloc(n_tok * d).unwrap();
        be.upload(x.all(), &vec![0.5; n_tok * d]).unwrap();
        let ids = be.alloc_i32(n_tok * k).unwrap();
        let mut idv: Vec<i32> = (0..n_tok * k).map(|i| (i % ne) as i32).collect();
        idv[3] = ne as i32 + 5;
        be.upload_i32(ids, 0, &idv).unwrap();
        let wts = be.alloc(n_tok * k).unwrap();
        be.upload(wts.all(), &vec![0.5; n_tok * k]).unwrap();
        let out = be.alloc(n_tok * d).unwrap();
        let args = MoeArgs {
            n_tok,
            k,
            clamp: 10.0,
        };
        let r = be
            .moe(x.all(), ids, wts.all(), gate, up, down, args, out.all())
            .and_then(|_| be.download(out.all(), &mut vec![0.0; n_tok * d]));
        let e = r.expect_err("a bad expert id was not reported");
        assert!(e.to_string().contains("expert"), "{tiles:?} {n_tok}: {e}");
        assert!(
            fake.kernel_errors().is_empty(),
            "{:?}",
            fake.kernel_errors()
        );
    }
}

/// Bytes in a 16-byte aligned buffer (the tile kernels load float rows and activations 16
/// bytes at a time, as the GPU allocator's alignment allows).
fn aligned(bytes: &[u8]) -> Vec<u128> {
    let mut v = vec![0u128; bytes.len().div_ceil(16)];
    // SAFETY: v holds at least bytes.len() bytes; u128 has no invalid bit patterns.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr().cast(), bytes.len()) };
    v
}

/// One `ds4_mm_tiles` / `ds4_mm_tiles_wide` launch over one group (no expert offsets).
struct Tiles {
    kernel: &'static str,
    rows: usize,
    split: u32,
    ty: ds4_gguf::types::GgmlType,
    n_rows: usize,
    cols: usize,
    n_tok: usize,
}

impl Tiles {
    /// y[p][r] for the weights `w` (n_rows rows of row_bytes) and half activations `x`
    /// (n_tok rows of cols); NaN where the kernel wrote nothing.
    fn run(&self, k: &EmuKernels, w: &[u128], row_bytes: usize, x: &[u128]) -> Vec<f32> {
        use std::ffi::c_void;
        assert!(
            w.len() * 16 >= self.n_rows * row_bytes && x.len() * 16 >= self.n_tok * self.cols * 2
        );
        let mut y = vec![f32::NAN; self.n_tok * self.n_rows];
        let (mut wp, mut w2, mut mat, mut tyc, mut rb) = (
            w.as_ptr() as u64,
            0u64,
            0u64,
            self.ty.code() as i32,
            row_bytes as u64,
        );
        let (mut nr, mut nc, mut xp, mut offs, mut nt) = (
            self.n_rows as i32,
            self.cols as i32,
            x.as_ptr() as u64,
            0u64,
            self.n_tok as i32,
        );
        let (mut yp, mut y2, mut ys) = (y.as_mut_ptr() as u64, 0u64, self.n_rows as u64);
        let mut params: Vec<*mut c_void> = vec![
            (&mut wp as *mut u64).cast(),
            (&mut w2 as *mut u64).cast(),
            (&mut mat as *mut u64).cast(),
            (&mut tyc as *mut i32).cast(),
            (&mut rb as *mut u64).cast(),
            (&mut nr as *mut i32).cast(),
            (&mut nc as *mut i32).cast(),
            (&mut xp as *mut u64).cast(),
            (&mut offs as *mut u64).cast(),
            (&mut nt as *mut i32).cast(),
            (&mut yp as *mut u64).cast(),
            (&mut y2 as *mut u64).cast(),
            (&mut ys as *mut u64).cast(),
        ];
        let grid = (self.n_rows.div_ceil(self.rows) as u32, 1, self.split);
        // SAFETY: w holds n_rows rows of row_bytes, x n_tok rows of cols halves (asserted
        // above), y n_tok rows of n_rows floats; the parameters are ds4_mm_tiles' in order.
        unsafe { k.launch(self.kernel, grid, 256, &mut params) }.unwrap();
        y
    }
}

/// `ds4_mm_tiles` and `ds4_mm_tiles_wide` directly, for every weight type the host sends
/// them, on shapes with ragged edges everywhere: rows past the last full row tile, a token
/// count past the last full token tile with fewer token-tile blocks than tiles (the block's
/// token loop), and (float and Q8_0 rows) a K length that ends half way through a K step.
/// Reference: the CPU dequantizer's f32 values rounded to half, times the half activations,
/// summed in f64. Unwritten outputs stay NaN and fail.
#[test]
fn emulated_tile_kernels_decode_every_type() {
    use ds4_gguf::quant::{dequantize, f16, quantize_matrix};
    use ds4_gguf::types::GgmlType;
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let (n_rows, n_tok) = (80usize, 136usize);
    for mma in [true, false] {
        let k = kernels(mma);
        for ty in [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::Bf16,
            GgmlType::Q8_0,
            GgmlType::Q2K,
            GgmlType::Q4K,
            GgmlType::Iq2Xxs,
            GgmlType::Mxfp4,
        ] {
            // MXFP4: 12 blocks of 17 bytes per row (204 bytes, the 4-byte multiple the host
            // asks), so blocks start at every byte offset of a word.
            let cols = match ty {
                GgmlType::Q2K | GgmlType::Q4K | GgmlType::Iq2Xxs => 512,
                GgmlType::Mxfp4 => 384,
                _ => 160,
            };
            let src: Vec<f32> = (0..n_rows * cols).map(|_| rnd()).collect();
            let mut wq = quantize_matrix(ty, &src, cols, None).unwrap();
            let row_bytes = wq.len() / n_rows;
            let mut wf = vec![0f32; n_rows * cols];
            dequantize(ty, &wq, &mut wf).unwrap();
            // The device holds Q8_0 in the split layout (docs/gpu.md §7).
            if ty == GgmlType::Q8_0 {
                ds4_gpu::kernels::q8_0_split_rows(&mut wq, cols).unwrap();
            }
            let xh: Vec<u16> = (0..n_tok * cols).map(|_| f16::f32_to_f16(rnd())).collect();
            let xb: Vec<u8> = xh.iter().flat_map(|h| h.to_le_bytes()).collect();
            let (wbuf, xbuf) = (aligned(&wq), aligned(&xb));
            // ds4_mm_rtiles takes IQ2_XXS and Q2_K (K blocks of 256: two here, so both
            // stages), on targets with the MMA instruction only.
            let rt = [("ds4_mm_rtiles", 256, 64, 1u32)];
            let rt = if mma && matches!(ty, GgmlType::Iq2Xxs | GgmlType::Q2K) {
                &rt[..]
            } else {
                &[]
            };
            for (kernel, rows, tokens, split) in [
                ("ds4_mm_tiles", 128, 64, 2u32),
                ("ds4_mm_tiles_wide", 64, 128, 1),
            ]
            .iter()
            .chain(rt)
            .copied()
            {
                assert!(
                    n_tok.div_ceil(tokens) as u32 > split,
                    "the token loop must run"
                );
                let t = Tiles {
                    kernel,
                    rows,
                    split,
                    ty,
                    n_rows,
                    cols,
                    n_tok,
                };
                let y = t.run(&k, &wbuf, row_bytes, &xbuf);
                for p in 0..n_tok {
                    for r in 0..n_rows {
                        let (mut s, mut mag) = (0f64, 0f64);
                        for c in 0..cols {
                            let wv = f16::f16_to_f32(f16::f32_to_f16(wf[r * cols + c])) as f64;
                            let xv = f16::f16_to_f32(xh[p * cols + c]) as f64;
                            s += wv * xv;
                            mag += (wv * xv).abs();
                        }
                        let got = y[p * n_rows + r] as f64;
                        assert!(
                            (got - s).abs() <= 1e-5 * mag + 1e-6,
                            "{kernel} {ty:?} mma {mma}: y[{p}][{r}] = {got}, expected {s}"
                        );
                    }
                }
            }
        }
    }
}

/// The tiles' decode is exact: with one-hot activations (token p = unit vector p) the
/// output is the decoded weight matrix itself, which must equal the CPU dequantizer's f32
/// values rounded once to half, bit for bit (as values: -0 = +0), for every weight type,
/// both tile shapes (the wide one decodes 16-value pieces from the middle of 32-value
/// groups) and both MMA paths. The block scales are replaced by random halves from
/// subnormal to 2^6 (the values stay finite halves), so the half decode of IQ2_XXS and Q2_K
/// (`ds4_wdec_h`, kernels/tiles.cu) is checked where a second rounding would show. MXFP4
/// blocks are random bytes: every code (8, "-0", included) and scales 2^-28 .. 2^12, so the
/// halves run from zero (underflow) and subnormals up to 12 · 2^12.
#[test]
fn emulated_tile_decode_is_the_dequantizer_rounded_once() {
    use ds4_gguf::quant::{dequantize, f16, quantize_matrix};
    use ds4_gguf::types::GgmlType;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    // A random half: sign, exponent 0 (subnormal) ..= 20 (below 2^6, so that every
    // decoded value stays a finite half), random mantissa.
    let mut scale = move || -> u16 {
        let r = next();
        ((r & 1) << 15) as u16 | (((r >> 1) % 21) << 10) as u16 | ((r >> 8) & 0x3ff) as u16
    };
    let (n_rows, cols) = (40usize, 256usize);
    let n_tok = cols;
    let mut xh = vec![0u16; n_tok * cols];
    for p in 0..n_tok {
        xh[p * cols + p] = f16::f32_to_f16(1.0);
    }
    let xb: Vec<u8> = xh.iter().flat_map(|h| h.to_le_bytes()).collect();
    let xbuf = aligned(&xb);
    for (k, mma) in [(kernels(true), "mma"), (kernels(false), "fma")] {
        for (ty, scales) in [
            (GgmlType::Iq2Xxs, &[0usize][..]),
            (GgmlType::Q2K, &[80, 82][..]),
            (GgmlType::Q4K, &[0, 2][..]),
            (GgmlType::Q8_0, &[][..]),
            (GgmlType::F16, &[][..]),
            (GgmlType::Mxfp4, &[][..]),
        ] {
            let src: Vec<f32> = (0..n_rows * cols)
                .map(|i| ((i * 7919 % 1013) as f32 / 506.5 - 1.0) * 0.7)
                .collect();
            let mut wq = quantize_matrix(ty, &src, cols, None).unwrap();
            let row_bytes = wq.len() / n_rows;
            let block = ty.block_bytes().unwrap() as usize;
            for b in wq.chunks_exact_mut(block) {
                for &at in scales {
                    b[at..at + 2].copy_from_slice(&scale().to_le_bytes());
                }
                if ty == GgmlType::Mxfp4 {
                    // The low 8 bits of scale() are uniform (its mantissa).
                    b[0] = 100 + ((scale() & 0xff) % 41) as u8;
                    for q in &mut b[1..] {
                        *q = (scale() & 0xff) as u8;
                    }
                }
            }
            let mut wf = vec![0f32; n_rows * cols];
            dequantize(ty, &wq, &mut wf).unwrap();
            assert!(wf
                .iter()
                .all(|&v| f16::f16_to_f32(f16::f32_to_f16(v)).is_finite()));
            if ty == GgmlType::Q8_0 {
                ds4_gpu::kernels::q8_0_split_rows(&mut wq, cols).unwrap();
            }
            let wbuf = aligned(&wq);
            let rt = [("ds4_mm_rtiles", 256, 2u32)];
            let rt = if mma != "fma" && matches!(ty, GgmlType::Iq2Xxs | GgmlType::Q2K) {
                &rt[..]
            } else {
                &[]
            };
            for (kernel, rows, split) in [("ds4_mm_tiles", 128, 2u32), ("ds4_mm_tiles_wide", 64, 1)]
                .iter()
                .chain(rt)
                .copied()
            {
                let t = Tiles {
                    kernel,
                    rows,
                    split,
                    ty,
                    n_rows,
                    cols,
                    n_tok,
                };
                let y = t.run(&k, &wbuf, row_bytes, &xbuf);
                for p in 0..n_tok {
                    for r in 0..n_rows {
                        let want = f16::f16_to_f32(f16::f32_to_f16(wf[r * cols + p]));
                        let got = y[p * n_rows + r];
                        assert!(
                            got == want,
                            "{kernel} {ty:?} mma {mma}: weight [{r}][{p}] decoded as {got:e}, \
                             the dequantizer's value rounded to half is {want:e} \
                             (f32 {:e})",
                            wf[r * cols + p]
                        );
                    }
                }
            }
        }
    }
}

/// The sampling band kernel writes exactly the words of its definition
/// (`ds4_engine::sampler::band_words`) on fresh random rows: NaNs, infinities, ±0 maxima,
/// an excluded index, bands over the capacity, rows shorter and longer than the block.
#[test]
fn emulated_logit_band_equals_its_definition() {
    use ds4_engine::sampler::{band_words, BAND_HEAD};
    use std::ffi::c_void;
    let mut seed = 0x2545_f491_4f6c_dd1du64 ^ std::process::id() as u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let k = kernels(true);
    let mut runs = 0;
    for case in 0..16u64 {
        let n = [5usize, 1023, 1024, 3000, 129_280][case as usize % 5];
        let cap = [4usize, 64, 1024][case as usize % 3];
        let mut x: Vec<f32> = (0..n)
            .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 * 12.0 - 6.0)
            .collect();
        match case % 7 {
            1 => x[n / 3] = f32::NAN,
            2 => {
                x[n - 1] = f32::INFINITY;
                x[n / 2] = f32::INFINITY;
            }
            3 => x.iter_mut().for_each(|v| *v = -v.abs() - 1.0),
            4 => {
                x.iter_mut().for_each(|v| *v = -v.abs() - 1.0);
                x[n / 2] = -0.0;
                x[n / 4] = 0.0;
            }
            5 => x.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
            // Values on a grid of 0.5: ties at the maximum (greedy's span-0 band).
            0 => x.iter_mut().for_each(|v| *v = (*v * 2.0).floor() * 0.5),
            _ => {}
        }
        let span = [0.5f32, 3.0, 40.0, 0.0][case as usize % 4];
        let exclude = (case % 2 == 1).then(|| (next() % n as u64) as u32);
        let want = band_words(&x, span, exclude, cap);
        let mut out = vec![0x5a5a_5a5au32 as i32; BAND_HEAD + 2 * cap];
        let (mut xp, mut nn, mut sp, mut ex, mut cp, mut op) = (
            x.as_ptr() as u64,
            n as i32,
            span,
            exclude.map_or(-1, |e| e as i32),
            cap as i32,
            out.as_mut_ptr() as u64,
        );
        let mut params: Vec<*mut c_void> = vec![
            (&mut xp as *mut u64).cast(),
            (&mut nn as *mut i32).cast(),
            (&mut sp as *mut f32).cast(),
            (&mut ex as *mut i32).cast(),
            (&mut cp as *mut i32).cast(),
            (&mut op as *mut u64).cast(),
        ];
        // SAFETY: x holds n floats, out BAND_HEAD + 2 cap ints; the parameters are
        // ds4_logit_band's in order.
        unsafe { k.launch("ds4_logit_band", (1, 1, 1), 1024, &mut params) }.unwrap();
        assert_eq!(
            out, want,
            "case {case}: n {n} cap {cap} span {span} exclude {exclude:?}"
        );
        runs += 1;
    }
    assert_eq!(runs, 16);
}

/// A batched step's sampling bands (`Engine::eval_batch_bands`) come from one
/// `ds4_logit_bands` launch (docs/gpu.md §31), and each is its definition's words
/// (`band_words`) for the row the step left: spans differ per row, one row has none (its
/// whole row comes back), one span keeps every value (a band over the capacity, as flat
/// rows give).
#[test]
fn emulated_batched_bands_equal_their_definition() {
    use ds4_engine::sampler::{band_words, LogitBand, BAND_CAP};
    use ds4_engine::BatchRow;
    let dir = tempfile::tempdir().unwrap();
    let file = model_file_with(dir.path(), TypeRecipe::Q2);
    let m = machine("strix-halo-stock");
    let (fake, mut gpu) = emulated_backend(&m, dir.path(), true, PrefillTiles::Off);
    gpu.set_activation_q8(true).unwrap();
    let cfg = EngineConfig {
        mode: Some(NumericMode::Exact),
        ctx: 64,
        prefill_chunk: 16,
    };
    let mut eng = Engine::load(file, Box::new(gpu), cfg).unwrap();
    let vocab = eng.hparams().n_vocab;
    let mut states = Vec::new();
    for (i, len) in [5usize, 9, 3, 7].into_iter().enumerate() {
        let mut st = eng.new_state().unwrap();
        let p: Vec<u32> = (0..len)
            .map(|j| ((7 * i + 3 * j + 1) % vocab) as u32)
            .collect();
        eng.eval(&mut st, &p, Logits::Last, None).unwrap();
        states.push(st);
    }
    let spans = [Some(0.5f32), None, Some(0.0), Some(1e30)];
    let tokens = [1u32, 2, 3, 4];
    let mut refs: Vec<&mut ds4_engine::KvState> = states.iter_mut().collect();
    let before = fake.launches().len();
    let rows = eng.eval_batch_bands(&mut refs, &tokens, &spans).unwrap();
    let bands_launched = fake.launches()[before..]
        .iter()
        .filter(|l| l.0 == "ds4_logit_bands")
        .count();
    assert_eq!(bands_launched, 1, "one launch for the step's bands");
    assert!(
        fake.kernel_errors().is_empty(),
        "{:?}",
        fake.kernel_errors()
    );
    for (j, (got, span)) in rows.iter().zip(spans).enumerate() {
        let mut row = Vec::new();
        eng.batch_row_into(j, &mut row).unwrap();
        assert!(row.iter().all(|v| v.is_finite()), "row {j}");
        match (got, span) {
            (BatchRow::Band(b), Some(span)) => {
                let want = LogitBand::from_words(&band_words(&row, span, None, BAND_CAP)).unwrap();
                assert_eq!(b, &want, "row {j} span {span}");
            }
            (BatchRow::Row(r), None) => assert!(r == &row, "row {j}"),
            _ => panic!("row {j}: band and span disagree"),
        }
    }
}

/// Batched decode on the GPU path (emulated kernels): with int8 activations (the fast
/// default) every sequence's batched logits row is bit-for-bit the row it gets decoded
/// alone (the several-column GEMVs sum each column as the one-token kernels do); with f32
/// activations the multi-token matmuls take other kernels, so rows agree within 1e-6. No
/// greedy token may differ either way (`ds4_check::batch`; what `ds4-server --parallel`
/// relies on). The CPU engine is bit-for-bit in both.
#[test]
fn emulated_batched_decode_equals_decoding_alone() {
    let dir = tempfile::tempdir().unwrap();
    // The third case is wider than the several-column GEMVs (8 tokens per launch): the
    // F16/F32 matrices then run in groups, not through the generic matmul. The fourth has
    // inputs of 2048 values (the hidden size, `out_a`'s groups): more than one part per
    // row, so the GEMVs split rows over several warps, and a step whose launches chose
    // another split than one token's would sum in another order (docs/gpu.md §10); at
    // the tiny widths every launch takes one warp per row.
    let wide = ds4_model::HParams {
        n_embd: 2048,
        n_head: 64,
        o_groups: 2,
        expert_ff: 1024,
        ..common::tiny_hparams()
    };
    let cases = [
        (TypeRecipe::Q2, true, ds4_check::batch::SEQS, None),
        (TypeRecipe::Q4, false, ds4_check::batch::SEQS, None),
        (TypeRecipe::Q4, true, 10, None),
        // Short prompts: the emulation of this width is slow.
        (TypeRecipe::Q2, true, 2, Some(wide)),
    ];
    for (recipe, act_q8, seqs, h) in cases {
        let wide_case = h.is_some();
        let prompt = if wide_case { 2 } else { 9 };
        let file = match h {
            Some(h) => model_file_from(dir.path(), h, recipe),
            None => model_file_with(dir.path(), recipe),
        };
        let m = machine("strix-halo-stock");
        let (fake, mut gpu) = emulated_backend(&m, dir.path(), true, PrefillTiles::Off);
        gpu.set_activation_q8(act_q8).unwrap();
        let mut rng = ds4_engine::Rng::new(11);
        let r = ds4_check::batch::batch_vs_alone(
            &file,
            NumericMode::Exact,
            Box::new(gpu),
            prompt,
            seqs,
            &mut rng,
        )
        .unwrap();
        assert!(
            fake.kernel_errors().is_empty(),
            "{:?}",
            fake.kernel_errors()
        );
        let ok = if act_q8 { r.exact } else { r.worst <= 1e-6 };
        assert!(
            ok && r.greedy == 0,
            "{recipe:?} act_q8 {act_q8} seqs {seqs}: batched vs alone {r:?}"
        );
        if wide_case {
            // The wide rows are 16-byte multiples: the batched steps' routed experts ran on
            // the flat grids (docs/gpu.md §25), gate/up and down.
            let flat = |p: &str| {
                fake.launches()
                    .iter()
                    .filter(|l| l.0.starts_with(p))
                    .count()
            };
            assert!(
                flat("ds4_gemv_flat_q_") > 0 && flat("ds4_gemv_flat_swiglu_q_") > 0,
                "no flat routed-expert launch"
            );
        }
        let mut cpu = CpuBackend::new(1).unwrap();
        cpu.set_activation_q8(act_q8).unwrap();
        let mut rng = ds4_engine::Rng::new(11);
        let r = ds4_check::batch::batch_vs_alone(
            &file,
            NumericMode::Exact,
            Box::new(cpu),
            prompt,
            seqs,
            &mut rng,
        )
        .unwrap();
        assert!(
            r.exact && r.greedy == 0,
            "cpu {recipe:?} act_q8 {act_q8}: {r:?}"
        );
    }
}

/// Matmuls of one input at decode rows quantize it once (`Backend::matmul_set`, the
/// shared expert's pair; docs/gpu.md §29): a batched step launches fewer input
/// quantizations than several-column Q8_0 GEMVs (outside a set each launch quantizes its
/// own input), and every batched row is still bit for bit the row decoded alone.
#[test]
fn emulated_input_quantized_once_per_matmul_set() {
    let dir = tempfile::tempdir().unwrap();
    let file = model_file_with(dir.path(), TypeRecipe::Q2);
    let m = machine("strix-halo-stock");
    let (fake, mut gpu) = emulated_backend(&m, dir.path(), true, PrefillTiles::Off);
    gpu.set_activation_q8(true).unwrap();
    let mut rng = ds4_engine::Rng::new(5);
    let r =
        ds4_check::batch::batch_vs_alone(&file, NumericMode::Exact, Box::new(gpu), 6, 4, &mut rng)
            .unwrap();
    assert!(
        fake.kernel_errors().is_empty(),
        "{:?}",
        fake.kernel_errors()
    );
    assert!(r.exact && r.greedy == 0, "{r:?}");
    let ran = |k: &str| fake.launches().iter().filter(|l| l.0 == k).count();
    let (quantized, cols) = (ran("ds4_quantize_q8_rows"), ran("ds4_gemv_cols_q_q8_0"));
    assert!(cols > 0, "no several-column launch ran");
    // Per layer at least the KV projection and the shared expert's up reuse their input.
    assert!(
        quantized < cols,
        "{quantized} input quantizations for {cols} several-column launches"
    );
}

/// The warm-up at load (`Engine::warm_up`: a prefill chunk and a decode step on a state of
/// its own, then freed) leaves no trace: the same prompt and decode steps give bit-identical
/// logits with and without it, and it frees every buffer it made beyond the backend's
/// scratch. The CPU backend declines it (nothing ran).
#[test]
fn emulated_warm_up_changes_no_logit() {
    let dir = tempfile::tempdir().unwrap();
    let file = model_file_with(dir.path(), TypeRecipe::Q4);
    let m = machine("strix-halo-stock");
    let cfg = EngineConfig {
        mode: Some(NumericMode::Exact),
        ctx: 64,
        prefill_chunk: 16,
    };
    let prompt: Vec<u32> = (0..11).map(|i| (i * 31 + 5) % 97).collect();
    let run = |warm: bool| -> (usize, Vec<f32>) {
        let (fake, mut gpu) = emulated_backend(&m, dir.path(), true, PrefillTiles::Off);
        gpu.set_activation_q8(true).unwrap();
        let mut eng = Engine::load(file.clone(), Box::new(gpu), cfg.clone()).unwrap();
        let ran = if warm { eng.warm_up(16).unwrap() } else { 0 };
        let mut st = eng.new_state().unwrap();
        let mut last = eng.eval(&mut st, &prompt, Logits::Last, None).unwrap();
        let mut out = last.clone();
        for _ in 0..3 {
            let t = ds4_engine::argmax(&last);
            last = eng.eval(&mut st, &[t], Logits::Last, None).unwrap();
            out.extend_from_slice(&last);
        }
        assert!(
            fake.kernel_errors().is_empty(),
            "{:?}",
            fake.kernel_errors()
        );
        (ran, out)
    };
    let (ran, warm) = run(true);
    let (_, cold) = run(false);
    // The chunk's 16 tokens and one decode step.
    assert_eq!(ran, 17);
    assert!(warm.iter().all(|v| v.is_finite()));
    assert!(
        warm.iter()
            .zip(&cold)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "the warm-up changed a logit"
    );
    // No state outlives a warm-up: a second one finds scratch of its size and leaves the
    // same live allocations as the first.
    let (fake, gpu) = emulated_backend(&m, dir.path(), true, PrefillTiles::Off);
    let mut eng = Engine::load(file.clone(), Box::new(gpu), cfg.clone()).unwrap();
    eng.warm_up(16).unwrap();
    let first = fake.live();
    eng.warm_up(16).unwrap();
    assert_eq!(fake.live(), first, "a warm-up left an allocation behind");
    drop(eng);
    let mut cpu = Engine::load(file.clone(), Box::new(CpuBackend::new(1).unwrap()), cfg).unwrap();
    assert_eq!(cpu.warm_up(16).unwrap(), 0);
}

/// Launch fusions that must not change a value: the HCPost folded into the next sublayer's
/// mixing-matmul kernel (docs/gpu.md §11) and the query/KV head preparation in one launch.
/// A prefill (chunks of 9: decode-sized passes, so the fused kernels run) and decode steps
/// give bit-identical logits with the fusions on and off, and the fused run launches
/// exactly the expected number of kernels fewer per layer and token (docs/gpu.md §17).
#[test]
fn emulated_fused_launches_equal_the_separate_ones() {
    // q2's IQ2_XXS experts are too narrow here for the grouped GEMVs (the routed down
    // projection then takes the host-grouped path, without the SwiGLU fusion); q4's Q4_K
    // experts take them, so the routed experts' `ds4_moe_act` is folded too.
    // Inputs of 256 values give Q8_0 rows of 272 bytes, 16-byte multiples, so the int8 GEMVs
    // that form their own input run (narrower rows take the any-alignment kernel): a query
    // rank of 256 for q_b, 8 heads of 64 in 2 groups for out_a.
    // A 40-row window: the decode steps' attention sees more than 32 keys and takes the
    // split-key path (with its fused combine).
    let h = ds4_model::HParams {
        q_lora_rank: 256,
        n_head: 8,
        sliding_window: 40,
        ..common::tiny_hparams()
    };
    for (recipe, per_layer) in [(TypeRecipe::Q2, 9), (TypeRecipe::Q4, 10)] {
        let dir = tempfile::tempdir().unwrap();
        let file = model_file_from(dir.path(), h.clone(), recipe);
        let run = |fuse: bool| {
            let m = machine("strix-halo-stock");
            let (fake, mut gpu) = emulated_backend(&m, dir.path(), true, PrefillTiles::Off);
            gpu.set_fused_launches(fuse);
            gpu.set_activation_q8(true).unwrap();
            let cfg = EngineConfig {
                mode: Some(NumericMode::Official),
                ctx: 128,
                prefill_chunk: 9,
            };
            let mut eng = Engine::load(file.clone(), Box::new(gpu), cfg).unwrap();
            let vocab = eng.hparams().n_vocab as u32;
            // 40 prompt tokens fill the window.
            let toks: Vec<u32> = (0..44u32).map(|i| (i * 53 + 7) % vocab).collect();
            let mut st = eng.new_state().unwrap();
            let mut rows = eng.eval(&mut st, &toks[..40], Logits::All, None).unwrap();
            let before = eng.backend_mut().counters().launches;
            for t in &toks[40..] {
                rows.extend(
                    eng.eval(&mut st, std::slice::from_ref(t), Logits::Last, None)
                        .unwrap(),
                );
            }
            let launches = eng.backend_mut().counters().launches - before;
            let layers = eng.hparams().n_layer as u64;
            assert!(
                fake.kernel_errors().is_empty(),
                "{:?}",
                fake.kernel_errors()
            );
            (rows, launches, layers)
        };
        let (fused, fused_launches, layers) = run(true);
        let (plain, plain_launches, _) = run(false);
        assert!(fused.iter().all(|v| v.is_finite()));
        assert_eq!(fused.len(), plain.len());
        let differ = fused
            .iter()
            .zip(&plain)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ, 0,
            "{recipe:?}: {differ} logits differ with the launches fused"
        );
        // 4 decode steps; per layer two HCPost launches fewer (except the last layer's
        // second, which is applied before the head either way), the KV row's ring store,
        // the attention's combine, the router, (per CSA layer) the indexer query's RoPE,
        // one head preparation, the
        // query's RMSNorm, the output's de-rotation, the shared expert's SwiGLU and (q4)
        // the routed experts' `ds4_moe_act`; per CSA layer one compressor launch.
        let csa = (0..layers as usize)
            .filter(|&il| h.attn_kind(il) == ds4_model::AttnKind::Csa)
            .count() as u64;
        assert!(csa > 0);
        assert_eq!(
            plain_launches - fused_launches,
            4 * (per_layer * layers - 1 + 2 * csa),
            "{recipe:?}"
        );
    }
}

/// Streamed routed experts on the GPU backend (docs/placement.md §9): slot pools written
/// by queued copies out of the host tier's page-locked buffers, a cache of 6 units for 8
/// experts per layer. Decode (one token,
/// one `moe` run, the same kernels on the same bytes) gives the resident logits bit for
/// bit; a prefill split into runs of other sizes may choose other multi-token kernels, so
/// it is held to a tolerance and the same greedy tokens.
#[test]
fn emulated_streamed_experts_match_resident() {
    use ds4_engine::ExpertPlacement;
    let dir = tempfile::tempdir().unwrap();
    let file = model_file_with(dir.path(), TypeRecipe::Q2);
    let m = machine("strix-halo-stock");
    let run = |experts| {
        let (fake, mut gpu) = emulated_backend(&m, dir.path(), true, PrefillTiles::FAST);
        gpu.set_activation_q8(true).unwrap();
        let cfg = EngineConfig {
            mode: Some(NumericMode::Exact),
            ctx: 64,
            prefill_chunk: 32,
        };
        let mut eng = Engine::load_with(Arc::clone(&file), Box::new(gpu), cfg, experts).unwrap();
        let vocab = eng.hparams().n_vocab as u32;
        let toks: Vec<u32> = (0..10u32).map(|i| (i * 37 + 11) % vocab).collect();
        let mut st = eng.new_state().unwrap();
        let pre = eng.eval(&mut st, &toks, Logits::All, None).unwrap();
        let mut st = eng.new_state().unwrap();
        let mut dec = Vec::new();
        for t in &toks {
            dec.extend(
                eng.eval(&mut st, std::slice::from_ref(t), Logits::Last, None)
                    .unwrap(),
            );
        }
        assert!(
            fake.kernel_errors().is_empty(),
            "{:?}",
            fake.kernel_errors()
        );
        (pre, dec, eng.expert_stats(), vocab as usize)
    };
    let (rp, rd, none, vocab) = run(ExpertPlacement::Resident);
    assert!(none.is_none());
    let (sp, sd, stats, _) = run(ExpertPlacement::streamed(6));
    let s = stats.unwrap();
    assert!(s.misses > 6 && s.hits > 0, "{s:?}");
    // The host tier's buffers are page-locked, so the slots were written by queued
    // copies out of them (host_slabs.rs), not by waiting copies.
    assert!(
        s.host_buffers > 0 && s.host_pinned == s.host_buffers,
        "{s:?}"
    );
    // The next layer's router ran on the device and its ids came back (read-ahead).
    assert!(
        s.predicted > 0 && s.predicted_right <= s.predicted && s.readahead_reads > 0,
        "{s:?}"
    );
    assert!(rd == sd, "streamed decode differs on the GPU backend");
    let worst = rp
        .iter()
        .zip(&sp)
        .map(|(a, b)| ((a - b).abs() / a.abs().max(1.0)) as f64)
        .fold(0.0, f64::max);
    eprintln!("streamed prefill vs resident on the emulated GPU: max rel {worst:.3e}");
    assert!(worst <= 1e-3, "prefill max rel {worst:e}");
    let greedy = |v: &[f32]| v.chunks(vocab).map(ds4_engine::argmax).collect::<Vec<_>>();
    assert_eq!(greedy(&rp), greedy(&sp));
}

/// `write_weight_mat` stores a matrix as the load path does, Q8_0's split layout
/// included: a pool matrix filled with a loaded Q8_0 tensor's bytes multiplies exactly
/// like the loaded tensor, and a slot never written stays zero.
#[test]
fn emulated_weight_pool_matrices_equal_loaded_weights() {
    use ds4_engine::{WeightInfo, WeightUse};
    let dir = tempfile::tempdir().unwrap();
    let file = model_file_with(dir.path(), TypeRecipe::Q2);
    let m = machine("strix-halo-stock");
    let (fake, mut gpu) = emulated_backend(&m, dir.path(), true, PrefillTiles::Off);
    for ty in [ds4_gguf::GgmlType::Q8_0, ds4_gguf::GgmlType::Iq2Xxs] {
        let t = file
            .header()
            .tensors
            .iter()
            .find(|t| t.ty == ty && t.dims.len() >= 2)
            .unwrap_or_else(|| panic!("the q2 model has a {ty} matrix"))
            .clone();
        let (cols, rows) = (t.dims[0] as usize, t.dims[1] as usize);
        let loaded = gpu.load_weight(&file, &t.name, WeightUse::Matrix).unwrap();
        let info = WeightInfo {
            ty,
            dims: [cols, rows, 3],
        };
        let pool = gpu.alloc_weight("pool", info).unwrap();
        let (_, bytes) = file.tensor_bytes(&t.name).unwrap();
        let one = bytes.len() / (t.dims[2..].iter().product::<u64>().max(1) as usize);
        gpu.write_weight_mat(pool, 1, &bytes[..one]).unwrap();
        assert!(gpu.write_weight_mat(pool, 3, &bytes[..one]).is_err());
        assert!(gpu.write_weight_mat(pool, 0, &bytes[..one - 1]).is_err());
        let x = gpu.alloc(2 * cols).unwrap();
        let xs: Vec<f32> = (0..2 * cols)
            .map(|i| ((i * 7919) % 97) as f32 / 48.0 - 1.0)
            .collect();
        gpu.upload(x.all(), &xs).unwrap();
        let out = |gpu: &mut HipBackend, w, mat| {
            let y = gpu.alloc(2 * rows).unwrap();
            gpu.matmul(w, mat, x.all(), 2, y.all()).unwrap();
            let mut v = vec![0f32; 2 * rows];
            gpu.download(y.all(), &mut v).unwrap();
            v
        };
        let want = out(&mut gpu, loaded, 0);
        assert!(want.iter().any(|v| *v != 0.0));
        assert_eq!(out(&mut gpu, pool, 1), want, "{ty}");
        assert!(
            out(&mut gpu, pool, 2).iter().all(|v| *v == 0.0),
            "{ty}: unwritten slot"
        );

        // The same bytes through a page-locked slab (the streamed experts' host tier): a
        // queued copy into slot 2, the slab held by the backend until a host wait.
        let slab_for = |gpu: &mut HipBackend| {
            let mut slab = gpu.alloc_host_slab(one + 5).unwrap();
            assert!(
                slab.pinned(),
                "{ty}: the fake runtime grants page-locked memory"
            );
            assert!(slab.bytes().iter().all(|b| *b == 0));
            slab.bytes_mut()[5..].copy_from_slice(&bytes[..one]);
            slab
        };
        let mat = |range| ds4_engine::SlabMat {
            weight: pool,
            mat: 2,
            range,
        };
        // A range of the wrong length, or past the slab: refused, nothing queued or kept.
        for r in [4..one + 5, 6..one + 6] {
            let slab = slab_for(&mut gpu);
            assert!(gpu.write_weight_mats(slab, 8, &[mat(r)]).is_err(), "{ty}");
        }
        let slab = slab_for(&mut gpu);
        let kept = gpu.write_weight_mats(slab, 9, &[mat(5..one + 5)]).unwrap();
        assert!(
            kept.is_none(),
            "{ty}: a pinned slab stays with its queued copy"
        );
        assert!(
            gpu.reclaim_host_slabs(false).unwrap().is_empty(),
            "{ty}: handed back before any host wait"
        );
        assert_eq!(
            out(&mut gpu, pool, 2),
            want,
            "{ty}: slot written from the slab"
        );
        // `out` downloaded its result: a host wait, so the slab comes back, bytes intact.
        let back = gpu.reclaim_host_slabs(false).unwrap();
        assert_eq!(back.len(), 1, "{ty}");
        assert_eq!(back[0].0, 9);
        assert_eq!(&back[0].1.bytes()[5..], &bytes[..one]);
        assert!(gpu.reclaim_host_slabs(true).unwrap().is_empty());
    }
    assert!(
        fake.kernel_errors().is_empty(),
        "{:?}",
        fake.kernel_errors()
    );
}

/// Batched per-sequence ops: once a query's keys (window rows + compressed rows) need more
/// than one split, a batched decode step runs every sequence's compressors, indexer, split-key
/// attention and ring store in one launch each (`ds4_*_seqs`), each sequence with the code
/// it runs alone, and every batched logits row is bit for bit the row decoded alone.
#[test]
fn emulated_batched_sequence_ops_equal_decoding_alone() {
    let dir = tempfile::tempdir().unwrap();
    // A 40-row window: at 40+ tokens a sliding query sees 40 keys and a CSA query 43,
    // more than one 32-key split; the CSA layer's indexer scores (more rows than its top-k).
    let h = ds4_model::HParams {
        sliding_window: 40,
        ..common::tiny_hparams()
    };
    let file = model_file_from(dir.path(), h, TypeRecipe::Q2);
    let m = machine("strix-halo-stock");
    let (fake, mut gpu) = emulated_backend(&m, dir.path(), true, PrefillTiles::Off);
    gpu.set_activation_q8(true).unwrap();
    let mut rng = ds4_engine::Rng::new(12);
    let r =
        ds4_check::batch::batch_vs_alone(&file, NumericMode::Exact, Box::new(gpu), 40, 3, &mut rng)
            .unwrap();
    assert!(
        fake.kernel_errors().is_empty(),
        "{:?}",
        fake.kernel_errors()
    );
    let count = |k: &str| fake.launches().iter().filter(|l| l.0 == k).count();
    // Per batched step: two layers (sliding, CSA with the indexer).
    let steps = ds4_check::batch::STEPS;
    for (kernel, per_step) in [
        ("ds4_attention_split_seqs", 2),
        ("ds4_attention_combine_seqs", 2),
        ("ds4_ring_store_seqs", 2),
        ("ds4_compressor_seqs", 2),
        ("ds4_indexer_scores_seqs", 1),
        ("ds4_topk_select_seqs", 1),
    ] {
        assert_eq!(count(kernel), per_step * steps, "{kernel} launches");
    }
    assert!(r.exact && r.greedy == 0, "batched vs alone {r:?}");
}

/// `ds4_attention_mma` (docs/gpu.md §14), the tensor-core prefill attention (the fast
/// default's, [`Knobs::tensor_core_attention`]), against the CPU backend's f32 attention at
/// the real head shape (64 heads of 512), with the kernels' tensor-core path and their
/// plain path (HIP's): a sliding-only layer, an HCA layer (all
/// visible compressed rows) and a CSA layer (a top-k selection padded with −1), on a chunk
/// that starts after the window filled (ring rows of earlier positions), two or three key
/// tiles of 32 per token, and selections padded with −1. Its operands are halves (the
/// prefill tiles' class), so the bound is relative to the output's scale.
#[test]
fn emulated_tensor_core_attention_matches_the_cpu() {
    use ds4_engine::backend::{AttnArgs, CompSel};
    // Windows of 48 keys plus up to 20 compressed rows: two or three key tiles of 32, so
    // the online softmax rescales across tiles.
    let (nh, hd, window, ratio, k_sel) = (64usize, 512usize, 48usize, 4usize, 8usize);
    let (pos0, t) = (60usize, 20usize);
    let n_crows = (pos0 + t) / ratio;
    let mut rng = ds4_engine::Rng::new(91);
    let mut rand =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect() };
    let q = rand(t * nh * hd);
    let kv = rand(t * hd);
    let ring = rand(window * hd);
    let crows = rand(n_crows * hd);
    let sinks = rand(nh);
    // The sinks as a one-tensor GGUF image (backends load vectors from files).
    let sink_file = {
        let header = ds4_gguf::Header {
            metadata: Vec::new(),
            tensors: vec![ds4_gguf::TensorInfo {
                name: "sinks".into(),
                dims: vec![nh as u64],
                ty: ds4_gguf::GgmlType::F32,
                offset: 0,
            }],
        };
        let mut w = ds4_gguf::GgufWriter::new(Vec::new(), header).unwrap();
        let raw: Vec<u8> = sinks.iter().flat_map(|v| v.to_le_bytes()).collect();
        w.write_tensor(&raw).unwrap();
        Arc::new(ds4_gguf::GgufFile::from_bytes(w.finish().unwrap().0).unwrap())
    };
    // Ascending visible rows, −1 where a token sees fewer than k.
    let mut sel = Vec::new();
    for i in 0..t {
        let vis = (pos0 + i + 1) / ratio;
        let mut rows: Vec<i32> = (0..vis as i32)
            .filter(|r| (r * 7 + i as i32) % 3 != 0)
            .collect();
        rows.truncate(if i % 2 == 0 { 3 } else { k_sel });
        rows.resize(k_sel, -1);
        sel.extend(rows);
    }
    // `n` tokens from `pos0` (their rows of q, kv and the selection are the first `n`).
    let run = |be: &mut dyn Backend, mode: usize, pos0: usize, n: usize| -> Vec<f32> {
        let t = n;
        let up = |be: &mut dyn Backend, v: &[f32]| {
            let b = be.alloc(v.len()).unwrap();
            be.upload(b.slice(0, v.len()), v).unwrap();
            b.slice(0, v.len())
        };
        let (qs, kvs) = (up(be, &q[..t * nh * hd]), up(be, &kv[..t * hd]));
        let (rs, cs) = (up(be, &ring), up(be, &crows));
        let idx = be.alloc_i32(sel.len()).unwrap();
        be.upload_i32(idx, 0, &sel).unwrap();
        let sw = be
            .load_weight(&sink_file, "sinks", ds4_engine::backend::WeightUse::Vector)
            .unwrap();
        let out = be.alloc(t * nh * hd).unwrap();
        let comp = match mode {
            0 => CompSel::None,
            1 => CompSel::All { rows: cs, ratio },
            _ => CompSel::Top {
                rows: cs,
                ratio,
                idx,
                k: k_sel,
            },
        };
        be.attention(AttnArgs {
            q: qs,
            kv: kvs,
            ring: rs,
            comp,
            sinks: sw,
            pos0,
            n_tok: t,
            n_head: nh,
            head_dim: hd,
            window,
            scale: 1.0 / (hd as f32).sqrt(),
            out: out.slice(0, t * nh * hd),
        })
        .unwrap();
        let mut o = vec![0.0f32; t * nh * hd];
        be.download(out.slice(0, o.len()), &mut o).unwrap();
        o
    };
    let m = machine("strix-halo-stock");
    for mma in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let (fake, mut gpu) = emulated_backend_with(&m, dir.path(), mma, Knobs::fast());
        let mut cpu = CpuBackend::new(2).unwrap();
        // A prefill chunk (ds4_attention_mma) in each compressed-row mode.
        for mode in 0..3 {
            let (want, got) = (run(&mut cpu, mode, pos0, t), run(&mut gpu, mode, pos0, t));
            let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let worst = got
                .iter()
                .zip(&want)
                .map(|(g, w)| {
                    if g.is_nan() {
                        f32::INFINITY
                    } else {
                        (g - w).abs()
                    }
                })
                .fold(0.0f32, f32::max);
            eprintln!("mma={mma} mode {mode}: max |Δ| {worst:.3e}, outputs up to {scale:.3e}");
            assert!(scale > 0.05, "mode {mode}: the reference is all but zero");
            assert!(
                worst <= 2e-3 * scale,
                "mma={mma} mode {mode}: max |Δ| {worst:e} against outputs up to {scale:e}"
            );
        }
        let ran = |k: &str| fake.launches().iter().filter(|l| l.0 == k).count();
        assert_eq!(ran("ds4_attention_mma"), 3, "mma={mma}: every prefill call");
        assert!(
            fake.kernel_errors().is_empty(),
            "{:?}",
            fake.kernel_errors()
        );
    }
}

/// `ds4_indexer_scores_mma` (docs/gpu.md §15), the prefill indexer scores on the tensor
/// cores, through `indexer_topk` against the CPU (64 heads of 128, a 20-token chunk over
/// 600 compressed rows, top 8), tensor-core and plain paths. With quarter-integer queries, rows
/// and weights and a power-of-two weight scale every product and sum is exact in both
/// implementations, so the scores are equal and so must the selections be (ties go to the
/// lower row on both sides); with random values half-precision operands may reorder near
/// ties, which the op mirror allows, so few entries may differ.
#[test]
fn emulated_tensor_core_indexer_matches_the_cpu() {
    use ds4_engine::backend::IndexerArgs;
    // 595 to 600 visible rows: two blocks of rows, the first with 8 tiles of 64, the second
    // with a partial one.
    let (nh, hd, t, pos0, ratio, k) = (64usize, 128usize, 20usize, 2380usize, 4usize, 8usize);
    let n_rows = (pos0 + t) / ratio;
    let mut rng = ds4_engine::Rng::new(17);
    let mut quarters = |n: usize, span: i64| -> Vec<f32> {
        (0..n)
            .map(|_| ((rng.next_u64() % (2 * span as u64 + 1)) as i64 - span) as f32 / 4.0)
            .collect()
    };
    let exact = (
        quarters(t * nh * hd, 8),
        quarters(t * nh, 4),
        quarters(n_rows * hd, 8),
    );
    let mut rng2 = ds4_engine::Rng::new(29);
    let mut rand =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng2.next_f64() as f32 * 2.0 - 1.0).collect() };
    let random = (rand(t * nh * hd), rand(t * nh), rand(n_rows * hd));
    let run = |be: &mut dyn Backend, data: &(Vec<f32>, Vec<f32>, Vec<f32>), scale: f32| {
        let up = |be: &mut dyn Backend, v: &[f32]| {
            let b = be.alloc(v.len()).unwrap();
            be.upload(b.slice(0, v.len()), v).unwrap();
            b.slice(0, v.len())
        };
        let (q, w, rows) = (up(be, &data.0), up(be, &data.1), up(be, &data.2));
        let out = be.alloc_i32(t * k).unwrap();
        let args = IndexerArgs {
            pos0,
            n_tok: t,
            ratio,
            n_heads: nh,
            head_dim: hd,
            top_k: k,
            weight_scale: scale,
        };
        be.indexer_topk(q, w, rows, args, out).unwrap();
        let mut sel = vec![0i32; t * k];
        be.download_i32(out, 0, &mut sel).unwrap();
        sel
    };
    let m = machine("strix-halo-stock");
    for mma in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let (fake, mut gpu) = emulated_backend_with(&m, dir.path(), mma, Knobs::fast());
        let mut cpu = CpuBackend::new(2).unwrap();
        let want = run(&mut cpu, &exact, 0.125);
        assert!(
            want.iter().all(|&r| r >= 0 && (r as usize) < n_rows),
            "{want:?}"
        );
        assert_eq!(
            run(&mut gpu, &exact, 0.125),
            want,
            "mma={mma}: exact inputs"
        );
        let scale = 1.0 / ((hd * nh) as f32).sqrt();
        let (want, got) = (run(&mut cpu, &random, scale), run(&mut gpu, &random, scale));
        // Compare as sets per token (both are ascending).
        let differ: usize = want
            .chunks(k)
            .zip(got.chunks(k))
            .map(|(a, b)| a.iter().filter(|r| !b.contains(r)).count())
            .sum();
        eprintln!(
            "mma={mma}: random inputs, {differ} of {} selected rows differ",
            t * k
        );
        assert!(
            differ * 20 <= t * k,
            "mma={mma}: {differ} of {} differ",
            t * k
        );
        let ran = fake
            .launches()
            .iter()
            .filter(|l| l.0 == "ds4_indexer_scores_mma")
            .count();
        assert_eq!(
            ran, 2,
            "mma={mma}: the tensor-core kernel scored both calls"
        );
        assert!(
            fake.kernel_errors().is_empty(),
            "{:?}",
            fake.kernel_errors()
        );
    }
}

/// A speculative verify step's rows (`Engine::eval_verify`: one chunk of decode rows) are bit
/// for bit the logits of decoding the same tokens one at a time, on the GPU backend with int8
/// activations — the condition for drafting to change no output (docs/speculative.md §1).
/// The window and the indexer's top-k are raised so that the rows' attention splits its keys
/// over several blocks (more than 32 keys) and the indexer selects among more compressed rows
/// than it keeps, as at real dimensions.
#[test]
fn emulated_verify_rows_equal_one_token_decodes() {
    let dir = tempfile::tempdir().unwrap();
    let h = ds4_model::HParams {
        sliding_window: 64,
        indexer_top_k: 12,
        ..common::tiny_hparams()
    };
    let file = model_file_from(dir.path(), h, TypeRecipe::Q2);
    let m = machine("strix-halo-stock");
    let (fake, mut gpu) = emulated_backend(&m, dir.path(), true, PrefillTiles::Off);
    gpu.set_activation_q8(true).unwrap();
    let cfg = EngineConfig {
        mode: Some(NumericMode::Exact),
        ctx: 256,
        prefill_chunk: 16,
    };
    let mut eng = Engine::load(file, Box::new(gpu), cfg).unwrap();
    let vocab = eng.hparams().n_vocab;
    let mut rng = ds4_engine::Rng::new(5);
    let mut tok = || (rng.next_f64() * vocab as f64) as u32 % vocab as u32;
    let prompt: Vec<u32> = (0..9).map(|_| tok()).collect();
    let mut plain = eng.new_state().unwrap();
    let mut drafted = eng.new_state().unwrap();
    eng.eval(&mut plain, &prompt, Logits::Last, None).unwrap();
    eng.eval(&mut drafted, &prompt, Logits::Last, None).unwrap();
    let mut rows = Vec::new();
    let mut worst = 0usize;
    // Ten steps reach position 49: before the fix, step 5's first row (position 29, the
    // chunk's last row past 32 window keys) differed.
    for step in 0..10 {
        let toks: Vec<u32> = (0..4).map(|_| tok()).collect();
        let v = eng.eval_verify(&mut drafted, &toks, &mut rows).unwrap();
        eng.settle(&mut drafted, v, toks.len()).unwrap();
        for (i, &t) in toks.iter().enumerate() {
            let want = eng.eval(&mut plain, &[t], Logits::Last, None).unwrap();
            let got = &rows[i * vocab..(i + 1) * vocab];
            let diff = got
                .iter()
                .zip(&want)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            worst = worst.max(diff);
            assert_eq!(
                diff,
                0,
                "verify step {step} row {i} (position {}): {diff} logits differ from the one-token decode",
                plain.pos() - 1
            );
        }
    }
    assert_eq!(worst, 0);
    assert!(
        fake.kernel_errors().is_empty(),
        "{:?}",
        fake.kernel_errors()
    );
    // The rows' attention did split its keys (the case this test is for).
    assert!(
        fake.launches()
            .iter()
            .any(|l| l.0.starts_with("ds4_attention_split")),
        "no split-key attention ran"
    );
}
