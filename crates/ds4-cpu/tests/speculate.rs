//! Verifying drafts in one pass and rolling back (`Engine::eval_verify`, `Engine::settle`,
//! docs/speculative.md): after verifying `k` drafts and keeping `keep` tokens, every state
//! buffer (rings, accumulators, compressed rows, tokens) equals, bit for bit, the state of
//! a run that decoded only the kept tokens one at a time; the verify's logits rows are the
//! one-token decodes' logits; and both states continue alike. Around compressor windows
//! (ratios 4 and 16), past the sliding window (8 on the synthetic model, 64 on the demo
//! model) and with spans longer than the ratio-4 windows (the re-evaluating path).

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::*;
use ds4_cpu::CpuBackend;
use ds4_engine::{Backend, Engine, EngineConfig, KvState, Logits, NumericMode, Rng};
use ds4_gguf::GgufFile;
use ds4_model::layout::TypeRecipe;

fn engine(file: &Arc<GgufFile>, mode: Option<NumericMode>, q8: bool) -> Engine {
    let cfg = EngineConfig {
        mode,
        ctx: 256,
        prefill_chunk: 16,
    };
    let mut be = CpuBackend::new(2).unwrap();
    be.set_activation_q8(q8).unwrap();
    Engine::load(Arc::clone(file), Box::new(be), cfg).unwrap()
}

fn kjv(name: &str) -> Arc<GgufFile> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/kjv")
        .join(name);
    Arc::new(GgufFile::open(p).unwrap())
}

fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut r = Rng::new(seed);
    (0..n)
        .map(|_| (r.next_u64() % vocab as u64) as u32)
        .collect()
}

/// Every state buffer's bits, in a fixed order, and the tokens.
fn dump(eng: &mut Engine, st: &KvState) -> (Vec<u32>, Vec<u32>) {
    let mut bits = Vec::new();
    let mut tmp = Vec::new();
    for l in st.layers().to_vec() {
        let mut bufs = vec![l.ring];
        for c in [l.comp, l.index].into_iter().flatten() {
            bufs.push(c.acc);
            bufs.push(c.rows);
        }
        for b in bufs {
            tmp.resize(b.len(), 0f32);
            eng.backend_mut().download(b.all(), &mut tmp).unwrap();
            bits.extend(tmp.iter().map(|x| x.to_bits()));
        }
    }
    (st.tokens().to_vec(), bits)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// For each prefix length in `prefixes` and each span `1 + k` for `k` in `drafts`, every
/// `keep`: verify then settle against decoding the kept tokens alone.
fn rollback_is_exact(eng: &mut Engine, prefixes: &[usize], drafts: &[usize], what: &str) {
    let vocab = eng.hparams().n_vocab;
    let longest = prefixes.iter().max().unwrap();
    let prompt = tokens(*longest, vocab, 3);
    let mut base = eng.new_state().unwrap();
    let mut a = eng.new_state().unwrap();
    let mut b = eng.new_state().unwrap();
    let mut rows = Vec::new();
    let mut done = 0;
    for &p in prefixes {
        if p > done {
            eng.eval(&mut base, &prompt[done..p], Logits::None, None)
                .unwrap();
            done = p;
        }
        let snap = eng.snapshot(&base).unwrap();
        for &k in drafts {
            let span = tokens(k + 1, vocab, 1000 + (p * 31 + k) as u64);
            for keep in 1..=k + 1 {
                eng.restore(&mut a, &snap).unwrap();
                eng.restore(&mut b, &snap).unwrap();
                let v = eng.eval_verify(&mut a, &span, &mut rows).unwrap();
                assert_eq!(rows.len(), (k + 1) * vocab);
                eng.settle(&mut a, v, keep).unwrap();
                let mut alone = Vec::new();
                for &t in &span[..keep] {
                    alone.extend(eng.eval(&mut b, &[t], Logits::Last, None).unwrap());
                }
                let ctx = format!("{what}: prefix {p}, {k} drafts, keep {keep}");
                assert_eq!(
                    bits(&rows[..keep * vocab]),
                    bits(&alone),
                    "{ctx}: verify rows differ from one-token decodes"
                );
                assert!(dump(eng, &a) == dump(eng, &b), "{ctx}: states differ");
                // And the next step agrees.
                let t = span[0];
                let la = eng.eval(&mut a, &[t], Logits::Last, None).unwrap();
                let lb = eng.eval(&mut b, &[t], Logits::Last, None).unwrap();
                assert_eq!(bits(&la), bits(&lb), "{ctx}: next logits differ");
            }
        }
    }
    for s in [base, a, b] {
        eng.free_state(s);
    }
}

#[test]
fn rollback_equals_decoding_only_the_kept_tokens_synthetic() {
    // Window 8, CSA ratio 4 with top-3 selection (scoring from 16 tokens on), HCA ratio 16.
    let f32_model = synthetic_model(&tiny_hparams(), &TypeRecipe::F32, 11);
    let prefixes = [0, 3, 6, 13, 15, 29, 45];
    for mode in [NumericMode::Exact, NumericMode::Official] {
        let mut eng = engine(&f32_model, Some(mode), false);
        assert_eq!(eng.exact_draft_span(), 4);
        rollback_is_exact(&mut eng, &prefixes, &[1, 3, 4, 6], &format!("{mode}"));
    }
    // Quantized weights with int8 activations (the default precision), with short prompt
    // chunks set to take the prefill matmuls (whose logits differ from one-token decodes
    // there): a verify still runs its rows as decode rows.
    let q2 = synthetic_model(&quant_hparams(), &TypeRecipe::Q2, 5);
    let mut eng = engine(&q2, Some(NumericMode::Official), true);
    eng.set_short_prefill_rows(0);
    rollback_is_exact(&mut eng, &[0, 6, 15, 29], &[3, 5], "q2 int8");
}

#[test]
fn rollback_equals_decoding_only_the_kept_tokens_kjv() {
    // The trained demo model: window 64, CSA ratio 4 (indexer top 32), HCA ratio 16.
    let prefixes = [63, 129];
    let mut eng = engine(&kjv("ds4-kjv.gguf"), Some(NumericMode::Exact), false);
    rollback_is_exact(&mut eng, &prefixes, &[3, 5], "kjv f32 exact");
    let mut eng = engine(&kjv("ds4-kjv-q2.gguf"), None, true);
    rollback_is_exact(&mut eng, &[62], &[3], "kjv q2 default");
}

#[test]
fn bad_settles_are_errors() {
    let file = synthetic_model(&tiny_hparams(), &TypeRecipe::F32, 11);
    let mut eng = engine(&file, Some(NumericMode::Exact), false);
    let mut st = eng.new_state().unwrap();
    let mut rows = Vec::new();
    eng.eval(&mut st, &[1, 2, 3], Logits::None, None).unwrap();
    let v = eng.eval_verify(&mut st, &[4, 5, 6], &mut rows).unwrap();
    assert!(eng.settle(&mut st, v, 0).is_err());
    let v = eng.eval_verify(&mut st, &[4, 5, 6], &mut rows).unwrap();
    assert!(eng.settle(&mut st, v, 4).is_err());
    // A record of an older verify is refused.
    let old = eng.eval_verify(&mut st, &[4, 5], &mut rows).unwrap();
    let new = eng.eval_verify(&mut st, &[7], &mut rows).unwrap();
    assert!(eng.settle(&mut st, old, 1).is_err());
    eng.settle(&mut st, new, 1).unwrap();
    // A verify past the context or the chunk is refused and changes nothing.
    let pos = st.pos();
    assert!(eng.eval_verify(&mut st, &[1; 17], &mut rows).is_err());
    assert!(eng.eval_verify(&mut st, &[], &mut rows).is_err());
    assert!(eng.eval_verify(&mut st, &[1, 500], &mut rows).is_err());
    assert_eq!(st.pos(), pos);
    eng.free_state(st);
}

/// With the MTP block loaded and drafting every step (docs/speculative.md §4.1), verify and
/// settle leave every buffer of the main state as a run that never drafted leaves it: the
/// block keeps its own state and only reads the main model's streams.
#[test]
fn mtp_drafts_leave_the_main_state_of_a_run_that_never_drafted() {
    let hp = tiny_hparams();
    let file = synthetic_model(&hp, &TypeRecipe::F32, 11);
    let side = mtp_sidecar(&hp, 21, &|_| {});
    for mode in [NumericMode::Exact, NumericMode::Official] {
        let mut eng = engine(&file, Some(mode), false);
        eng.load_mtp(Arc::clone(&side)).unwrap();
        let seq = tokens(44, hp.n_vocab, 17);
        let (mut a, mut b) = (eng.new_state().unwrap(), eng.new_state().unwrap());
        eng.eval(&mut a, &seq[..5], Logits::None, None).unwrap();
        eng.eval(&mut b, &seq[..5], Logits::None, None).unwrap();
        let mut rows = Vec::new();
        let mut p = 5;
        while p + 4 < seq.len() {
            let d = eng
                .mtp_draft(&a, seq[p], 3, &mut |l: &[f32]| Some(ds4_engine::argmax(l)))
                .unwrap();
            assert_eq!(d.len(), 3);
            // The true sequence stands in for accepted drafts: keep 1 to 4 tokens.
            let keep = 1 + p % 4;
            let mut span = seq[p..p + keep].to_vec();
            span.extend_from_slice(&d[keep - 1..]);
            let v = eng.eval_verify(&mut a, &span, &mut rows).unwrap();
            eng.settle(&mut a, v, keep).unwrap();
            for &t in &seq[p..p + keep] {
                eng.eval(&mut b, &[t], Logits::None, None).unwrap();
            }
            let what = format!("{mode}: after {} tokens", p + keep);
            assert!(
                dump(&mut eng, &a) == dump(&mut eng, &b),
                "{what}: states differ"
            );
            p += keep;
        }
        for s in [a, b] {
            eng.free_state(s);
        }
    }
}
