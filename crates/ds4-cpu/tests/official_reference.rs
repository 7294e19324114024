//! `official` mode against an independent implementation of DeepSeek's reference semantics
//! (issue 18): `tools/oracle/make_official.py` runs the tiny fixtures through a float64 NumPy
//! forward with the reference's FP8/FP4 simulations (proven against HF in exact mode first) and
//! commits the logits as `tests/fixtures/tiny-*/official.safetensors`.
//!
//! Why a two-part bound and not one tolerance: the simulations are discontinuous. A value
//! within an ulp of an FP8/FP4 rounding boundary lands on different grid points in the f32
//! engine and the f64 reference, which moves a few logits by up to ~1e-3 (the engine's own
//! one-ulp sensitivity, `examples/ulp_sensitivity.rs`). So a correct engine agrees to f32
//! noise at almost every position, and a few positions may move further; a wrong semantic
//! (no simulation, wrong block, wrong order, wrong rounding) moves logits by O(0.1..3), far
//! outside both parts. A flip early in a sequence reaches every later position that attends
//! to the row it changed, so the large errors cluster in a few sequences. The bound, on the
//! per-position error e_t = max_v |engine - ref| / max(1, |ref|):
//! * pooled over every fixture, variant, sequence and path: at least 95 % of positions have
//!   e_t <= 1e-4, and no sequence has fewer than 85 %;
//! * every position has e_t <= 5e-3;
//! * the top-1 token is identical at every position whose reference top-1/top-2 gap exceeds
//!   1e-2 (twice the second bound; a smaller gap can flip legitimately and is reported).
//!
//! Measured (CPU engine, all 10506 position-paths): 98.1 % within 1e-4, worst sequence
//! tiny-quant q4 long at 91.3 % with max 3.6e-3; tiny-wide (the fixture whose FP8 rows span
//! two blocks of 64 with slices of different magnitude, so the block size shows) 100 %, max
//! 3.7e-6. That sequence was checked to be a boundary
//! flip, not an engine error: the reference itself, with every quantizer input multiplied by
//! 1 ± 2^-23 (random signs), moves by the same amount (91.35 % within 1e-4, max 3.65e-3, first
//! position over 1e-4 is 133 in both).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ds4_cpu::CpuBackend;
use ds4_engine::{argmax, Engine, EngineConfig, NumericMode, Session};
use ds4_gguf::GgufFile;

const TIGHT: f64 = 1e-4;
const TIGHT_SHARE: f64 = 0.95;
const TIGHT_SHARE_PER_SEQ: f64 = 0.85;
const LOOSE: f64 = 5e-3;
const TOP1_GAP: f32 = 1e-2;

fn fixtures_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

struct Tensors {
    bytes: Vec<u8>,
}

impl Tensors {
    fn load(path: &Path) -> Tensors {
        Tensors {
            bytes: std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        }
    }
    fn raw(&self, name: &str) -> (Vec<usize>, Vec<u8>, safetensors::Dtype) {
        let st = safetensors::SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st
            .tensor(name)
            .unwrap_or_else(|_| panic!("no tensor {name}"));
        (t.shape().to_vec(), t.data().to_vec(), t.dtype())
    }
    fn f32s(&self, name: &str) -> Vec<f32> {
        let (_, d, ty) = self.raw(name);
        assert_eq!(ty, safetensors::Dtype::F32, "{name}");
        d.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
    fn tokens(&self, seq: &str) -> Vec<u32> {
        let (_, d, ty) = self.raw(&format!("tokens.{seq}"));
        assert_eq!(ty, safetensors::Dtype::I32);
        d.chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect()
    }
}

/// Converts a fixture's checkpoint (config.json + model.safetensors only) with ds4-convert.
fn convert(dir: &Path, types: &str, work: &Path) -> Arc<GgufFile> {
    let src = work.join("hf");
    std::fs::create_dir_all(&src).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(dir.join(f), src.join(f)).unwrap();
    }
    let out = work.join(format!("{types}.gguf"));
    let opts = ds4_convert::HfOptions::new(types).unwrap();
    ds4_convert::convert_hf(&src, &out, &opts, &mut ds4_convert::NoProgress)
        .unwrap_or_else(|e| panic!("convert {}: {e}", dir.display()));
    Arc::new(GgufFile::open(&out).unwrap())
}

fn session(file: &Arc<GgufFile>, mode: NumericMode, chunk: usize) -> Session {
    let cfg = EngineConfig {
        mode: Some(mode),
        ctx: 1024,
        prefill_chunk: chunk,
    };
    let be = Box::new(CpuBackend::new(0).unwrap());
    Session::new(Engine::load(Arc::clone(file), be, cfg).unwrap()).unwrap()
}

/// Per-position error max_v |g - w| / max(1, |w|); NaN stays NaN (and fails every bound).
fn position_errors(got: &[f32], want: &[f32], vocab: usize) -> Vec<f64> {
    assert_eq!(got.len(), want.len());
    got.chunks(vocab)
        .zip(want.chunks(vocab))
        .map(|(g, w)| {
            g.iter().zip(w).fold(0f64, |m, (a, b)| {
                let d = (*a as f64 - *b as f64).abs() / (*b as f64).abs().max(1.0);
                if d.is_nan() || m.is_nan() {
                    f64::NAN
                } else {
                    m.max(d)
                }
            })
        })
        .collect()
}

/// Outcome of one sequence against the bound.
struct Verdict {
    share_tight: f64,
    worst: f64,
    top1_mismatch: usize,
    top1_excused: usize,
}

impl Verdict {
    fn passes(&self) -> bool {
        self.share_tight >= TIGHT_SHARE_PER_SEQ && self.worst <= LOOSE && self.top1_mismatch == 0
    }
}

fn judge(got: &[f32], want: &[f32], gaps: &[f32], vocab: usize) -> (Verdict, Vec<f64>) {
    let e = position_errors(got, want, vocab);
    let tight = e.iter().filter(|&&x| x <= TIGHT).count();
    let worst = e
        .iter()
        .fold(0f64, |m, &x| if x.is_nan() { f64::NAN } else { m.max(x) });
    let (mut mismatch, mut excused) = (0, 0);
    for (t, gap) in gaps.iter().enumerate() {
        let row = t * vocab..(t + 1) * vocab;
        if argmax(&got[row.clone()]) != argmax(&want[row]) {
            if *gap > TOP1_GAP {
                mismatch += 1;
            } else {
                excused += 1;
            }
        }
    }
    let v = Verdict {
        share_tight: tight as f64 / e.len() as f64,
        worst: if worst.is_nan() { f64::INFINITY } else { worst },
        top1_mismatch: mismatch,
        top1_excused: excused,
    };
    (v, e)
}

/// Every (fixture dir, variant, sequences, chunk sizes) with committed official logits.
/// (fixture dir, variant, [(sequence, chunk size)]).
type Case = (PathBuf, String, Vec<(String, usize)>);

fn cases() -> Vec<Case> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures_root())
        .expect("tests/fixtures exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("official.json").exists())
        .collect();
    dirs.sort();
    assert!(
        dirs.len() >= 3,
        "expected official references for the tiny fixtures"
    );
    let mut out = Vec::new();
    for d in dirs {
        let meta: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.join("official.json")).unwrap()).unwrap();
        let variants = meta["variants"].as_object().expect("variants");
        for (variant, info) in variants {
            let mut seqs: Vec<(String, usize)> = info["sequences"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(s, v)| (s.clone(), v["chunk_size"].as_u64().unwrap() as usize))
                .collect();
            seqs.sort();
            out.push((d.clone(), variant.clone(), seqs));
        }
    }
    out
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

#[test]
fn official_mode_meets_the_reference_bound_on_every_fixture() {
    let tmp = tempfile::tempdir().unwrap();
    let mut all = Vec::new();
    let mut failures = Vec::new();
    for (dir, variant, seqs) in cases() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let file = convert(
            &dir,
            variant_types(&variant),
            &tmp.path().join(&name).join(&variant),
        );
        let vocab = file_vocab(&file);
        let inputs = Tensors::load(&dir.join("reference.safetensors"));
        let official = Tensors::load(&dir.join("official.safetensors"));
        for (seq, chunk) in seqs {
            let tokens = inputs.tokens(&seq);
            let want = official.f32s(&format!("{variant}.{seq}.logits"));
            let gaps = official.f32s(&format!("{variant}.{seq}.top1_gap"));
            let prefill = session(&file, NumericMode::Official, 4096)
                .prefill_all(&tokens)
                .unwrap();
            let mut s = session(&file, NumericMode::Official, 1);
            let mut decode = Vec::new();
            for &t in &tokens {
                decode.extend(s.decode(t).unwrap());
            }
            let chunked = session(&file, NumericMode::Official, chunk)
                .prefill_all(&tokens)
                .unwrap();
            for (path, got) in [
                ("prefill", &prefill),
                ("decode", &decode),
                ("chunked", &chunked),
            ] {
                let (v, e) = judge(got, &want, &gaps, vocab);
                let mut sorted = e.clone();
                sorted.sort_by(f64::total_cmp);
                println!(
                    "{name} {variant} {seq:6} {path:7}: {:5.1}% <= {TIGHT:e}, median {:.1e}, p95 {:.1e}, max {:.1e}; top-1 mismatches {} (+{} within gap {TOP1_GAP})",
                    100.0 * v.share_tight,
                    percentile(&sorted, 0.5),
                    percentile(&sorted, 0.95),
                    v.worst,
                    v.top1_mismatch,
                    v.top1_excused
                );
                if let Some(first) = e.iter().position(|&x| x.is_nan() || x > TIGHT) {
                    let margins = official.f32s(&format!("{variant}.{seq}.topk_margin"));
                    let (at, m) = margins[..=first].iter().enumerate().fold(
                        (0, f32::INFINITY),
                        |b, (i, &m)| if m < b.1 { (i, m) } else { b },
                    );
                    println!(
                        "    first position above {TIGHT:e}: {first} (error {:.1e}); smallest reference top-k margin up to it: {m:.1e} at {at}",
                        e[first]
                    );
                }
                if !v.passes() {
                    failures.push(format!("{name}/{variant}/{seq}/{path}"));
                }
                all.extend(e);
            }
        }
    }
    all.sort_by(f64::total_cmp);
    let n = all.len() as f64;
    let over = |x: f64| all.iter().filter(|&&e| e > x).count();
    println!(
        "all positions: {} ; median {:.1e}, p95 {:.1e}, p99 {:.1e}, max {:.1e}; > 1e-5: {}, > 1e-4: {} ({:.2}%), > 1e-3: {}",
        all.len(),
        percentile(&all, 0.5),
        percentile(&all, 0.95),
        percentile(&all, 0.99),
        all.last().unwrap(),
        over(1e-5),
        over(1e-4),
        100.0 * over(1e-4) as f64 / n,
        over(1e-3)
    );
    assert!(failures.is_empty(), "bound not met: {failures:?}");
    let share = 1.0 - over(TIGHT) as f64 / n;
    assert!(
        share >= TIGHT_SHARE,
        "only {:.2}% of all positions within {TIGHT:e}",
        100.0 * share
    );
}

/// The bound must reject a wrong engine: exact mode (no simulations) on the same inputs
/// fails it on the longer sequences of every fixture.
#[test]
fn the_bound_rejects_exact_mode() {
    let tmp = tempfile::tempdir().unwrap();
    for (dir, variant, seqs) in cases().into_iter().filter(|c| c.1 == "f32") {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let file = convert(&dir, "f32", &tmp.path().join(&name));
        let vocab = file_vocab(&file);
        let inputs = Tensors::load(&dir.join("reference.safetensors"));
        let official = Tensors::load(&dir.join("official.safetensors"));
        let (seq, _) = seqs.iter().find(|s| s.0 == "medium").expect("medium");
        let tokens = inputs.tokens(seq);
        let got = session(&file, NumericMode::Exact, 4096)
            .prefill_all(&tokens)
            .unwrap();
        let want = official.f32s(&format!("{variant}.{seq}.logits"));
        let gaps = official.f32s(&format!("{variant}.{seq}.top1_gap"));
        let (v, _) = judge(&got, &want, &gaps, vocab);
        println!(
            "{name} exact mode vs official reference ({seq}): {:.1}% tight, max {:.2e}, top-1 mismatches {}",
            100.0 * v.share_tight,
            v.worst,
            v.top1_mismatch
        );
        assert!(!v.passes(), "{name}: exact mode passes the official bound");
        assert!(v.worst > 10.0 * LOOSE, "{name}: {:e}", v.worst);
    }
}

fn variant_types(variant: &str) -> &str {
    match variant {
        "f32" | "q2" | "q4" => variant,
        other => panic!("unknown variant {other}"),
    }
}

fn file_vocab(file: &Arc<GgufFile>) -> usize {
    let s = session(file, NumericMode::Exact, 8);
    s.engine().hparams().n_vocab
}
