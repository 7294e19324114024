//! Whole-model behaviour on synthetic models: prefill, decode and chunked prefill agree bit
//! for bit; snapshots restore bit for bit; thread count does not matter; official differs
//! from exact; quantized recipes run; errors instead of panics on bad input.

mod common;

use std::sync::Arc;

use common::*;
use ds4_cpu::CpuBackend;
use ds4_engine::{
    argmax, Engine, EngineConfig, EngineError, NumericMode, Sampler, SamplerConfig, Session,
    Snapshot,
};
use ds4_gguf::GgufFile;
use ds4_model::layout::TypeRecipe;

fn session(file: &Arc<GgufFile>, mode: NumericMode, chunk: usize, threads: usize) -> Session {
    let cfg = EngineConfig {
        mode: Some(mode),
        ctx: 256,
        prefill_chunk: chunk,
    };
    let be = Box::new(CpuBackend::new(threads).unwrap());
    Session::new(Engine::load(Arc::clone(file), be, cfg).unwrap()).unwrap()
}

fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut r = ds4_engine::Rng::new(seed);
    (0..n)
        .map(|_| (r.next_u64() % vocab as u64) as u32)
        .collect()
}

fn model() -> Arc<GgufFile> {
    synthetic_model(&tiny_hparams(), &TypeRecipe::F32, 11)
}

fn all_finite(x: &[f32]) -> bool {
    x.iter().all(|v| v.is_finite())
}

#[test]
fn prefill_decode_and_chunked_agree_bitwise_in_both_modes() {
    let file = model();
    // 70 tokens: window 8 rolls over, CSA selects (>3 rows from p = 15), HCA emits 4 rows.
    let toks = tokens(70, 97, 1);
    for mode in [NumericMode::Exact, NumericMode::Official] {
        let full = session(&file, mode, 128, 2).prefill_all(&toks).unwrap();
        assert!(all_finite(&full));
        let mut s = session(&file, mode, 1, 2);
        let mut dec = Vec::new();
        for &t in &toks {
            dec.extend(s.decode(t).unwrap());
        }
        assert!(
            full == dec,
            "{mode}: decode differs (max rel {:e})",
            max_rel(&dec, &full, 1.0)
        );
        for chunk in [3, 7, 64] {
            let c = session(&file, mode, chunk, 2).prefill_all(&toks).unwrap();
            assert!(full == c, "{mode}: chunk {chunk} differs");
        }
        // A continuation (second prefill call) equals one long prefill.
        let mut s = session(&file, mode, 16, 2);
        let mut two = s.prefill_all(&toks[..33]).unwrap();
        two.extend(s.prefill_all(&toks[33..]).unwrap());
        assert!(full == two, "{mode}: continued prefill differs");
        // Last-token logits equal the last row of all logits.
        let last = session(&file, mode, 16, 2).prefill(&toks).unwrap();
        assert_eq!(&last[..], &full[full.len() - 97..]);
    }
}

#[test]
fn thread_count_does_not_change_results() {
    let file = model();
    let toks = tokens(40, 97, 2);
    let one = session(&file, NumericMode::Official, 40, 1)
        .prefill_all(&toks)
        .unwrap();
    let three = session(&file, NumericMode::Official, 40, 3)
        .prefill_all(&toks)
        .unwrap();
    assert!(one == three);
}

#[test]
fn official_mode_changes_logits_and_exact_does_not_quantize() {
    let file = model();
    let toks = tokens(60, 97, 3);
    let e = session(&file, NumericMode::Exact, 64, 2)
        .prefill_all(&toks)
        .unwrap();
    let o = session(&file, NumericMode::Official, 64, 2)
        .prefill_all(&toks)
        .unwrap();
    let d = max_rel(&o, &e, 1.0);
    println!("official vs exact: max rel {d:e}");
    assert!(all_finite(&o));
    // O(1) changes on random toy models are expected (docs/forward.md §9.5).
    assert!(d > 1e-4, "the QAT simulation is not wired: {d:e}");
}

#[test]
fn default_mode_is_official_when_the_dims_allow() {
    let file = model();
    let be = Box::new(CpuBackend::new(1).unwrap());
    let e = Engine::load(file, be, EngineConfig::default()).unwrap();
    assert_eq!(e.mode(), NumericMode::Official);
    assert_eq!(e.mode().to_string(), "official");
}

#[test]
fn snapshot_restore_continues_bitwise() {
    let file = model();
    let toks = tokens(50, 97, 4);
    let mut a = session(&file, NumericMode::Official, 16, 2);
    a.prefill(&toks[..37]).unwrap();
    let snap = a.snapshot().unwrap();
    assert_eq!(snap.n_tokens(), Some(37));
    let mut cont_a = Vec::new();
    for &t in &toks[37..] {
        cont_a.extend(a.decode(t).unwrap());
    }
    // Restore through bytes into a fresh session on another engine instance.
    let bytes = snap.clone().into_bytes();
    let mut b = session(&file, NumericMode::Official, 5, 1);
    b.prefill(&toks[..3]).unwrap(); // some unrelated state first
    b.restore(&Snapshot::from_bytes(bytes.clone())).unwrap();
    assert_eq!(b.tokens(), &toks[..37]);
    let mut cont_b = Vec::new();
    for &t in &toks[37..] {
        cont_b.extend(b.decode(t).unwrap());
    }
    assert!(cont_a == cont_b);
    // Restoring again rewinds.
    b.restore(&snap).unwrap();
    assert_eq!(b.pos(), 37);
    assert_eq!(b.decode(toks[37]).unwrap(), cont_a[..97].to_vec());

    // Corruption, truncation and a different mode are refused, and the state is unchanged.
    let mut bad = bytes.clone();
    bad[100] ^= 1;
    assert!(matches!(
        b.restore(&Snapshot::from_bytes(bad)),
        Err(EngineError::Snapshot(_))
    ));
    assert!(b
        .restore(&Snapshot::from_bytes(bytes[..bytes.len() / 2].to_vec()))
        .is_err());
    assert!(b.restore(&Snapshot::from_bytes(vec![0; 3])).is_err());
    assert_eq!(b.pos(), 38);
    let mut exact = session(&file, NumericMode::Exact, 16, 1);
    assert!(matches!(
        exact.restore(&snap),
        Err(EngineError::Snapshot(_))
    ));

    // Version 1 (older builds: an FNV-1a 64 trailer instead of CRC-32) still restores, to
    // the same state; its corruption is still caught; an unknown version is named.
    assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 2);
    let mut v1 = bytes[..bytes.len() - 4].to_vec();
    v1[8..12].copy_from_slice(&1u32.to_le_bytes());
    let sum = ds4_engine::state::fnv1a(&v1);
    v1.extend_from_slice(&sum.to_le_bytes());
    b.restore(&Snapshot::from_bytes(v1.clone())).unwrap();
    assert_eq!(b.pos(), 37);
    assert_eq!(b.decode(toks[37]).unwrap(), cont_a[..97].to_vec());
    let mut bad1 = v1.clone();
    bad1[200] ^= 4;
    let e = b.restore(&Snapshot::from_bytes(bad1)).unwrap_err();
    assert!(e.to_string().contains("checksum"), "{e}");
    let mut v9 = bytes.clone();
    v9[8..12].copy_from_slice(&9u32.to_le_bytes());
    let e = b.restore(&Snapshot::from_bytes(v9)).unwrap_err();
    assert!(e.to_string().contains("version 9"), "{e}");
    assert_eq!(b.pos(), 38);
}

#[test]
fn reset_equals_a_fresh_session() {
    let file = model();
    let toks = tokens(30, 97, 5);
    let mut s = session(&file, NumericMode::Exact, 8, 2);
    let first = s.prefill_all(&toks).unwrap();
    s.reset().unwrap();
    assert_eq!(s.pos(), 0);
    assert!(s.prefill_all(&toks).unwrap() == first);
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let file = model();
    let mut s = session(&file, NumericMode::Exact, 8, 1);
    assert!(matches!(
        s.prefill(&[1, 97]),
        Err(EngineError::BadToken {
            token: 97,
            index: 1,
            ..
        })
    ));
    assert!(matches!(s.prefill(&[]), Err(EngineError::Empty)));
    assert_eq!(s.pos(), 0);
    let long = tokens(257, 97, 6);
    assert!(matches!(
        s.prefill(&long),
        Err(EngineError::ContextFull { .. })
    ));
    // Mode the model cannot run: a non-power-of-two indexer width refuses official.
    let mut hp = tiny_hparams();
    hp.indexer_head_dim = 48;
    let f = synthetic_model(&hp, &TypeRecipe::F32, 1);
    let cfg = EngineConfig {
        mode: Some(NumericMode::Official),
        ..EngineConfig::default()
    };
    let r = Engine::load(Arc::clone(&f), Box::new(CpuBackend::new(1).unwrap()), cfg);
    assert!(matches!(r, Err(EngineError::ModeUnsupported { .. })));
    let e = Engine::load(
        f,
        Box::new(CpuBackend::new(1).unwrap()),
        EngineConfig::default(),
    );
    assert_eq!(e.unwrap().mode(), NumericMode::Exact);
    assert!("fast".parse::<NumericMode>().is_err());
}

#[test]
fn seeded_sampling_is_reproducible() {
    let file = model();
    let prompt = tokens(10, 97, 8);
    let run = |seed| {
        let mut g = session(&file, NumericMode::Exact, 8, 2);
        let mut sampler = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_p: 0.9,
            seed,
            ..SamplerConfig::default()
        })
        .unwrap();
        let mut history = prompt.clone();
        let mut logits = g.prefill(&prompt).unwrap();
        for _ in 0..8 {
            let t = sampler.sample(&logits, &history).unwrap();
            history.push(t);
            logits = g.decode(t).unwrap();
        }
        history
    };
    assert_eq!(run(1), run(1));
}

#[test]
fn quantized_weights_match_their_dequantized_f32_twin() {
    let hp = quant_hparams();
    let toks = tokens(40, 97, 9);
    for (name, recipe) in [("q4", TypeRecipe::Q4), ("q2", TypeRecipe::Q2)] {
        let (q, deq) = synthetic_pair(&hp, &recipe, 21);
        let a = session(&q, NumericMode::Official, 64, 2)
            .prefill_all(&toks)
            .unwrap();
        let mut s = session(&q, NumericMode::Official, 1, 2);
        let mut b = Vec::new();
        for &t in &toks {
            b.extend(s.decode(t).unwrap());
        }
        assert!(a == b, "{name}: prefill and decode differ");
        let r = session(&deq, NumericMode::Official, 64, 2)
            .prefill_all(&toks)
            .unwrap();
        let d = max_rel(&a, &r, 1.0);
        println!("{name} vs its dequantized f32 twin: max rel {d:e}");
        assert!(d < 1e-4, "{name}: {d:e}");
    }
}

#[test]
fn eval_argmax_equals_the_argmax_of_the_downloaded_logits() {
    let file = model();
    let cfg = EngineConfig {
        mode: Some(NumericMode::Exact),
        ctx: 256,
        prefill_chunk: 7,
    };
    let mk = || {
        Engine::load(
            Arc::clone(&file),
            Box::new(CpuBackend::new(1).unwrap()),
            cfg.clone(),
        )
        .unwrap()
    };
    let (mut a, mut b) = (mk(), mk());
    let vocab = a.hparams().n_vocab;
    let prompt = tokens(19, vocab, 5);
    let (mut sa, mut sb) = (a.new_state().unwrap(), b.new_state().unwrap());
    let la = a
        .eval(&mut sa, &prompt, ds4_engine::Logits::Last, None)
        .unwrap();
    let mut next = argmax(&la);
    assert_eq!(b.eval_argmax(&mut sb, &prompt).unwrap(), next);
    for _ in 0..6 {
        let l = a
            .eval(&mut sa, &[next], ds4_engine::Logits::Last, None)
            .unwrap();
        let g = b.eval_argmax(&mut sb, &[next]).unwrap();
        assert_eq!(g, argmax(&l));
        next = g;
    }
    assert_eq!(sa.pos(), sb.pos());
}

#[test]
fn default_argmax_op_follows_the_sequential_scan_on_ties_and_nan() {
    use ds4_engine::Backend;
    let mut be = CpuBackend::new(1).unwrap();
    let cases: [&[f32]; 5] = [
        &[1.0, 3.0, 3.0, -1.0],
        &[f32::NAN, 5.0, 7.0],
        &[2.0, f32::NAN, 9.0, 9.0],
        &[-4.0, -4.0],
        &[0.5],
    ];
    for c in cases {
        let x = be.alloc(c.len()).unwrap();
        be.upload(x.all(), c).unwrap();
        let out = be.alloc_i32(1).unwrap();
        be.argmax(x.all(), out).unwrap();
        let mut got = [0i32];
        be.download_i32(out, 0, &mut got).unwrap();
        assert_eq!(got[0] as u32, argmax(c), "{c:?}");
    }
}

/// The repetition penalty reads only its window of the history: sampling with the window
/// gives the tokens of sampling with the whole history (the front ends pass the window).
#[test]
fn repetition_penalty_reads_only_its_window() {
    let file = model();
    let prompt = tokens(12, 97, 10);
    let cfg = SamplerConfig {
        temperature: 0.8,
        repeat_penalty: 1.8,
        repeat_window: 6,
        seed: 3,
        ..SamplerConfig::default()
    };
    let mut s = session(&file, NumericMode::Exact, 8, 2);
    let (mut full, mut windowed) = (
        Sampler::new(cfg.clone()).unwrap(),
        Sampler::new(cfg).unwrap(),
    );
    let mut history = prompt.clone();
    let mut logits = s.prefill(&prompt).unwrap();
    for _ in 0..10 {
        let t = full.sample(&logits, &history).unwrap();
        let w = windowed
            .sample(&logits, &history[history.len() - 6..])
            .unwrap();
        assert_eq!(t, w);
        history.push(t);
        logits = s.decode(t).unwrap();
    }
}
