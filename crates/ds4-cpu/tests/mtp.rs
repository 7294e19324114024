//! The MTP block as a drafter (`Engine::load_mtp`, `Engine::mtp_draft`; docs/forward.md
//! §10, docs/speculative.md §4): its tensors are validated with errors naming the tensor,
//! and its draft logits depend only on the sequence, not on what was drafted, rejected or
//! evaluated before (its ring is caught up from the main model's kept streams and chained
//! rows are put back), at every depth of a chain.

mod common;

use std::sync::Arc;

use common::*;
use ds4_cpu::CpuBackend;
use ds4_engine::{Engine, EngineConfig, Logits, NumericMode, Rng};
use ds4_gguf::{GgmlType, GgufFile};
use ds4_model::layout::TypeRecipe;

fn engine(file: &Arc<GgufFile>, mode: NumericMode) -> Engine {
    let cfg = EngineConfig {
        mode: Some(mode),
        ctx: 256,
        prefill_chunk: 16,
    };
    let be = CpuBackend::new(2).unwrap();
    Engine::load(Arc::clone(file), Box::new(be), cfg).unwrap()
}

fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut r = Rng::new(seed);
    (0..n)
        .map(|_| (r.next_u64() % vocab as u64) as u32)
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn argmax(v: &[f32]) -> u32 {
    ds4_engine::argmax(v) as u32
}

/// Drafts `k` greedy tokens after `st`'s tokens and `next`, returning every depth's logits.
fn draft(
    eng: &mut Engine,
    st: &ds4_engine::KvState,
    next: u32,
    k: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut rows = Vec::new();
    let d = eng
        .mtp_draft(st, next, k, &mut |l: &[f32]| {
            rows.push(l.to_vec());
            Some(argmax(l))
        })
        .unwrap();
    (d, rows)
}

#[test]
fn draft_logits_depend_only_on_the_sequence() {
    let hp = tiny_hparams();
    let main = synthetic_model(&hp, &TypeRecipe::F32, 11);
    let side = mtp_sidecar(&hp, 21, &|_| {});
    let vocab = hp.n_vocab;
    for mode in [NumericMode::Exact, NumericMode::Official] {
        let mut a = engine(&main, mode);
        a.load_mtp(Arc::clone(&side)).unwrap();
        assert!(a.has_mtp());
        let seq = tokens(40, vocab, 5);
        let mut st = a.new_state().unwrap();
        a.eval(&mut st, &seq[..3], Logits::None, None).unwrap();
        // A continuous run: at every step draft 3 deep, verify, keep a varying number.
        let mut rows = Vec::new();
        let mut p = 3;
        let mut seen = Vec::new();
        while p + 4 < seq.len() {
            let (d, logits) = draft(&mut a, &st, seq[p], 3);
            assert_eq!(d.len(), 3);
            assert_eq!(logits.len(), 3);
            seen.push((p, d.clone(), logits));
            let mut span = vec![seq[p]];
            span.extend_from_slice(&d);
            let v = a.eval_verify(&mut st, &span, &mut rows).unwrap();
            // Keep 1..=3 tokens of the true sequence (the drafts stand in for rejected ones).
            let keep = 1 + p % 3;
            a.settle(&mut st, v, 1).unwrap();
            if keep > 1 {
                a.eval(&mut st, &seq[p + 1..p + keep], Logits::None, None)
                    .unwrap();
            }
            p += keep;
        }
        a.free_state(st);
        // Each draft again from a fresh engine that only prefilled the prefix.
        for (p, d, logits) in seen {
            let mut b = engine(&main, mode);
            b.load_mtp(Arc::clone(&side)).unwrap();
            let mut sb = b.new_state().unwrap();
            b.eval(&mut sb, &seq[..p], Logits::None, None).unwrap();
            let (db, lb) = draft(&mut b, &sb, seq[p], 3);
            assert_eq!(db, d, "{mode}: drafts after {p} tokens");
            for (j, (x, y)) in logits.iter().zip(&lb).enumerate() {
                assert_eq!(bits(x), bits(y), "{mode}: depth {} after {p} tokens", j + 1);
            }
            b.free_state(sb);
        }
    }
}

#[test]
fn a_restored_state_drafts_once_its_streams_are_kept() {
    let hp = tiny_hparams();
    let main = synthetic_model(&hp, &TypeRecipe::F32, 11);
    let side = mtp_sidecar(&hp, 21, &|_| {});
    let mut e = engine(&main, NumericMode::Exact);
    e.load_mtp(Arc::clone(&side)).unwrap();
    let seq = tokens(12, hp.n_vocab, 9);
    let mut st = e.new_state().unwrap();
    e.eval(&mut st, &seq[..10], Logits::None, None).unwrap();
    let snap = e.snapshot(&st).unwrap();
    let (d, _) = draft(&mut e, &st, seq[10], 2);
    assert_eq!(d.len(), 2);
    // Another sequence overwrites the kept streams; the restored state has no streams.
    let mut other = e.new_state().unwrap();
    e.eval(&mut other, &seq[2..9], Logits::None, None).unwrap();
    let mut back = e.new_state().unwrap();
    e.restore(&mut back, &snap).unwrap();
    assert!(draft(&mut e, &back, seq[10], 2).0.is_empty());
    // Once evaluated again it drafts (the block's own ring still holds the earlier rows),
    // as an engine that evaluated the sequence in one go does.
    e.eval(&mut back, &seq[10..11], Logits::None, None).unwrap();
    let (d, l) = draft(&mut e, &back, seq[11], 2);
    let mut f = engine(&main, NumericMode::Exact);
    f.load_mtp(Arc::clone(&side)).unwrap();
    let mut sf = f.new_state().unwrap();
    f.eval(&mut sf, &seq[..11], Logits::None, None).unwrap();
    let (df, lf) = draft(&mut f, &sf, seq[11], 2);
    assert_eq!(d, df);
    assert_eq!(bits(&l.concat()), bits(&lf.concat()));
    f.free_state(sf);
    for s in [st, other, back] {
        e.free_state(s);
    }
}

#[test]
fn bad_mtp_tensors_are_refused_by_name() {
    let hp = tiny_hparams();
    let main = synthetic_model(&hp, &TypeRecipe::F32, 11);
    type Edit = Box<dyn Fn(&mut ds4_gguf::TensorInfo)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "mtp.0.e_proj.weight",
            Box::new(|t| {
                if t.name == "mtp.0.e_proj.weight" {
                    t.dims[1] += 1;
                }
            }),
        ),
        (
            "mtp.0.hnorm.weight",
            Box::new(|t| {
                if t.name == "mtp.0.hnorm.weight" {
                    t.ty = GgmlType::Q8_0;
                }
            }),
        ),
        (
            "mtp.0.exp_probs_b.bias",
            Box::new(|t| {
                if t.name == "mtp.0.exp_probs_b.bias" {
                    t.name = "mtp.0.something_else.bias".into();
                }
            }),
        ),
    ];
    for (name, edit) in cases {
        let side = mtp_sidecar(&hp, 21, &*edit);
        let mut e = engine(&main, NumericMode::Exact);
        let err = e.load_mtp(side).unwrap_err().to_string();
        assert!(err.contains(name), "{name}: {err}");
        assert!(!e.has_mtp());
    }
    // The main file is not an MTP block.
    let mut e = engine(&main, NumericMode::Exact);
    let err = e.load_mtp(Arc::clone(&main)).unwrap_err().to_string();
    assert!(err.contains("mtp.0.e_proj.weight"), "{err}");
}

/// Little-endian values of tensor `name` of a safetensors file (F32 or I32).
fn st_values(bytes: &[u8], name: &str) -> (Vec<usize>, Vec<f64>) {
    let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
    let t = st.tensor(name).unwrap_or_else(|_| panic!("no {name}"));
    let v = t
        .data()
        .chunks_exact(4)
        .map(|c| {
            let b = c.try_into().unwrap();
            match t.dtype() {
                safetensors::Dtype::F32 => f64::from(f32::from_le_bytes(b)),
                safetensors::Dtype::I32 => f64::from(i32::from_le_bytes(b)),
                d => panic!("{name}: {d:?}"),
            }
        })
        .collect();
    (t.shape().to_vec(), v)
}

/// The block's draft logits against the float64 reference written from DeepSeek's reference
/// code (tools/oracle/make_mtp.py, `tests/fixtures/mtp-hca16`): tiny-hca16 with a random
/// MTP block, converted by `ds4-convert hf` (main file and sidecar), depth 1 at every position
/// (window 16, so the block's ring wraps) and chained depth 2 at a few, exact and official
/// mode, within the main model's bound (docs/forward.md §9.5: 1e-4·max(1, |ref|)).
#[test]
fn draft_logits_match_the_reference() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let fix = root.join("mtp-hca16");
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("hf");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::copy(root.join("tiny-hca16/config.json"), src.join("config.json")).unwrap();
    std::fs::copy(
        root.join("tiny-hca16/model.safetensors"),
        src.join("model.safetensors"),
    )
    .unwrap();
    for f in ["mtp.safetensors", "model.safetensors.index.json"] {
        std::fs::copy(fix.join(f), src.join(f)).unwrap();
    }
    let out = tmp.path().join("tiny.gguf");
    let opts = ds4_convert::HfOptions::new("f32").unwrap();
    ds4_convert::convert_hf(&src, &out, &opts, &mut ds4_convert::NoProgress).unwrap();
    let main = Arc::new(GgufFile::open(&out).unwrap());
    let side = Arc::new(GgufFile::open(tmp.path().join("tiny-mtp.gguf")).unwrap());

    let refb = std::fs::read(fix.join("reference.safetensors")).unwrap();
    let toks: Vec<u32> = st_values(&refb, "tokens")
        .1
        .iter()
        .map(|&t| t as u32)
        .collect();
    let chain = [3usize, 9, 17, 18, 25, 38];
    let vocab = main
        .header()
        .tensors
        .iter()
        .find(|t| t.name == "output.weight")
        .unwrap()
        .dims[1] as usize;
    let close = |got: &[f32], want: &[f64], what: &str| {
        let worst = got
            .iter()
            .zip(want)
            .map(|(&g, &w)| (f64::from(g) - w).abs() / w.abs().max(1.0))
            .fold(0f64, |m, e| {
                if e.is_nan() || m.is_nan() {
                    f64::NAN
                } else {
                    m.max(e)
                }
            });
        assert!(worst <= 1e-4, "{what}: {worst:.3e}");
        worst
    };
    for mode in [NumericMode::Exact, NumericMode::Official] {
        let (s1, d1) = st_values(&refb, &format!("{mode}.depth1"));
        let (_, d2) = st_values(&refb, &format!("{mode}.depth2"));
        assert_eq!(s1, [toks.len() - 1, vocab]);
        let mut e = engine(&main, mode);
        e.load_mtp(Arc::clone(&side)).unwrap();
        let mut st = e.new_state().unwrap();
        let mut worst = 0f64;
        for p in 1..toks.len() {
            e.eval(&mut st, &toks[p - 1..p], Logits::None, None)
                .unwrap();
            // Depth 1 from row p-1; where the chain is checked, depth 2 on the true token p+1.
            let deep = chain.iter().position(|&c| c == p);
            let mut rows = Vec::new();
            e.mtp_draft(
                &st,
                toks[p],
                if deep.is_some() { 2 } else { 1 },
                &mut |l: &[f32]| {
                    rows.push(l.to_vec());
                    Some(toks[(p + 1).min(toks.len() - 1)])
                },
            )
            .unwrap();
            let want = &d1[(p - 1) * vocab..p * vocab];
            worst = worst.max(close(&rows[0], want, &format!("{mode}: depth 1 at {p}")));
            if let Some(i) = deep {
                let want = &d2[i * vocab..(i + 1) * vocab];
                worst = worst.max(close(&rows[1], want, &format!("{mode}: depth 2 at {p}")));
            }
        }
        eprintln!("{mode}: worst relative error {worst:.2e}");
        e.free_state(st);
    }
}
