//! Batched decode (`Engine::eval_batch`): several sequences of different lengths decoded in
//! one forward pass must get, bit for bit, the logits each gets decoded alone — in exact
//! and official mode, with f32 and with int8 activations — and bad batches are errors.

mod common;

use std::sync::Arc;

use common::*;
use ds4_cpu::CpuBackend;
use ds4_engine::{argmax, Backend, Engine, EngineConfig, EngineError, Logits, NumericMode};
use ds4_gguf::GgufFile;
use ds4_model::layout::TypeRecipe;

fn engine(file: &Arc<GgufFile>, mode: NumericMode, q8: bool) -> Engine {
    let cfg = EngineConfig {
        mode: Some(mode),
        ctx: 256,
        prefill_chunk: 16,
    };
    let mut be = CpuBackend::new(2).unwrap();
    be.set_activation_q8(q8).unwrap();
    Engine::load(Arc::clone(file), Box::new(be), cfg).unwrap()
}

fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut r = ds4_engine::Rng::new(seed);
    (0..n)
        .map(|_| (r.next_u64() % vocab as u64) as u32)
        .collect()
}

/// Prompts of 3, 9, 21 and 34 tokens (inside and past the sliding window, around
/// compressor windows of 4 and 16), then 6 greedy steps: batched vs one by one.
fn batched_equals_alone(file: &Arc<GgufFile>, mode: NumericMode, q8: bool) {
    let mut eng = engine(file, mode, q8);
    let vocab = eng.hparams().n_vocab;
    let prompts: Vec<Vec<u32>> = [3usize, 9, 21, 34]
        .iter()
        .enumerate()
        .map(|(i, &n)| tokens(n, vocab, 100 + i as u64))
        .collect();
    let mut batch = Vec::new();
    let mut alone = Vec::new();
    let mut next = Vec::new();
    for p in &prompts {
        let mut a = eng.new_state().unwrap();
        let mut b = eng.new_state().unwrap();
        let la = eng.eval(&mut a, p, Logits::Last, None).unwrap();
        eng.eval(&mut b, p, Logits::Last, None).unwrap();
        next.push(argmax(&la) as u32);
        batch.push(a);
        alone.push(b);
    }
    for step in 0..6 {
        let mut refs: Vec<&mut ds4_engine::KvState> = batch.iter_mut().collect();
        let got = eng.eval_batch(&mut refs, &next).unwrap();
        let mut want = Vec::new();
        for (st, &t) in alone.iter_mut().zip(&next) {
            want.extend(eng.eval(st, &[t], Logits::Last, None).unwrap());
        }
        assert_eq!(got.len(), want.len());
        let same = got
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "{mode} q8 {q8}: step {step} differs from decoding alone"
        );
        next = got.chunks(vocab).map(|r| argmax(r) as u32).collect();
    }
    // The argmax form agrees with the logits form.
    let mut refs: Vec<&mut ds4_engine::KvState> = batch.iter_mut().collect();
    let ids = eng.eval_batch_argmax(&mut refs, &next).unwrap();
    let mut want = Vec::new();
    for (st, &t) in alone.iter_mut().zip(&next) {
        want.push(argmax(&eng.eval(st, &[t], Logits::Last, None).unwrap()) as u32);
    }
    assert_eq!(ids, want);
}

#[test]
fn batched_decode_equals_decoding_alone() {
    let f32_model = synthetic_model(&tiny_hparams(), &TypeRecipe::F32, 11);
    batched_equals_alone(&f32_model, NumericMode::Exact, false);
    batched_equals_alone(&f32_model, NumericMode::Official, false);
    // K-quant experts: int8 activations apply, row by row.
    let q2 = synthetic_model(&quant_hparams(), &TypeRecipe::Q2, 5);
    batched_equals_alone(&q2, NumericMode::Official, true);
}

#[test]
fn bad_batches_are_errors() {
    let file = synthetic_model(&tiny_hparams(), &TypeRecipe::F32, 11);
    let mut eng = engine(&file, NumericMode::Exact, false);
    let mut a = eng.new_state().unwrap();
    let mut b = eng.new_state().unwrap();
    eng.eval(&mut a, &[1, 2], Logits::Last, None).unwrap();
    // One token per state.
    let r = eng.eval_batch(&mut [&mut a, &mut b], &[1]);
    assert!(matches!(r, Err(EngineError::Config(_))), "{r:?}");
    assert!(eng.eval_batch(&mut [], &[]).is_err());
    // A token outside the vocabulary.
    let r = eng.eval_batch(&mut [&mut a, &mut b], &[1, 10_000]);
    assert!(
        matches!(r, Err(EngineError::BadToken { index: 1, .. })),
        "{r:?}"
    );
    // More states than the chunk holds.
    let mut many: Vec<_> = (0..17).map(|_| eng.new_state().unwrap()).collect();
    let mut refs: Vec<&mut ds4_engine::KvState> = many.iter_mut().collect();
    assert!(eng.eval_batch(&mut refs, &[3; 17]).is_err());
    // Nothing moved: both states continue as if the bad calls never happened.
    assert_eq!(a.pos(), 2);
    assert_eq!(b.pos(), 0);
    eng.eval_batch(&mut [&mut a, &mut b], &[3, 4]).unwrap();
    assert_eq!((a.pos(), b.pos()), (3, 1));
}

/// A short prompt chunk runs as decode rows (`Engine::set_short_prefill_rows`,
/// docs/forward.md §13): with int8 activations its logits are, bit for bit, the logits of
/// feeding its tokens one at a time; with the rule off the chunk takes the f32 prefill
/// matmuls and its logits differ. Longer chunks keep the prefill path either way.
#[test]
fn short_prefill_chunks_are_decode_rows() {
    let q2 = synthetic_model(&quant_hparams(), &TypeRecipe::Q2, 5);
    let run = |short: usize, prompt: &[u32], one_by_one: bool| -> Vec<f32> {
        let mut eng = engine(&q2, NumericMode::Official, true);
        eng.set_short_prefill_rows(short);
        let mut st = eng.new_state().unwrap();
        if one_by_one {
            let mut last = Vec::new();
            for &t in prompt {
                last = eng.eval(&mut st, &[t], Logits::Last, None).unwrap();
            }
            last
        } else {
            eng.eval(&mut st, prompt, Logits::Last, None).unwrap()
        }
    };
    let vocab = engine(&q2, NumericMode::Official, true).hparams().n_vocab;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let short = tokens(11, vocab, 7);
    let decoded = bits(&run(16, &short, true));
    assert_eq!(
        bits(&run(16, &short, false)),
        decoded,
        "short chunk vs one by one"
    );
    assert_ne!(
        bits(&run(0, &short, false)),
        decoded,
        "the rule off changed nothing"
    );
    // A 12-token chunk with the limit at 11 takes the prefill path again.
    let long = tokens(12, vocab, 8);
    assert_ne!(
        bits(&run(11, &long, false)),
        bits(&run(11, &long, true)),
        "a chunk past the limit ran as decode rows"
    );
}

/// A joint prefill (`Engine::eval_joint`, docs/forward.md §14): pieces of three prompts
/// after states at different positions (empty, inside and past the sliding window, around
/// compressor windows) in one forward pass leave each state and its last logits row, bit
/// for bit, as prefilling its piece alone does; the states then decode alike.
fn joint_equals_alone(file: &Arc<GgufFile>, mode: NumericMode, q8: bool) {
    let cfg = EngineConfig {
        mode: Some(mode),
        ctx: 256,
        prefill_chunk: 64,
    };
    let mut be = CpuBackend::new(2).unwrap();
    be.set_activation_q8(q8).unwrap();
    let mut eng = Engine::load(Arc::clone(file), Box::new(be), cfg).unwrap();
    eng.set_short_prefill_rows(4);
    assert_eq!(eng.joint_min_rows(), Some(5));
    let vocab = eng.hparams().n_vocab;
    let before = [0usize, 9, 21];
    let pieces: Vec<Vec<u32>> = [13usize, 5, 22]
        .iter()
        .enumerate()
        .map(|(i, &n)| tokens(n, vocab, 300 + i as u64))
        .collect();
    let mut joint = Vec::new();
    let mut alone = Vec::new();
    for (i, &n) in before.iter().enumerate() {
        let mut a = eng.new_state().unwrap();
        let mut b = eng.new_state().unwrap();
        if n > 0 {
            let p = tokens(n, vocab, 200 + i as u64);
            eng.eval(&mut a, &p, Logits::Last, None).unwrap();
            eng.eval(&mut b, &p, Logits::Last, None).unwrap();
        }
        joint.push(a);
        alone.push(b);
    }
    let mut refs: Vec<&mut ds4_engine::KvState> = joint.iter_mut().collect();
    let slices: Vec<&[u32]> = pieces.iter().map(|p| p.as_slice()).collect();
    eng.eval_joint(&mut refs, &slices).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut got = Vec::new();
    let mut next = Vec::new();
    for i in 0..pieces.len() {
        eng.batch_row_into(i, &mut got).unwrap();
        let want = eng
            .eval(&mut alone[i], &pieces[i], Logits::Last, None)
            .unwrap();
        assert_eq!(bits(&got), bits(&want), "{mode} q8 {q8}: piece {i}");
        next.push(argmax(&want) as u32);
    }
    for (a, b) in joint.iter().zip(&alone) {
        assert_eq!(a.pos(), b.pos());
    }
    // The states continue alike.
    for step in 0..3 {
        for (i, &t) in next.clone().iter().enumerate() {
            let x = eng.eval(&mut joint[i], &[t], Logits::Last, None).unwrap();
            let y = eng.eval(&mut alone[i], &[t], Logits::Last, None).unwrap();
            assert_eq!(bits(&x), bits(&y), "{mode} q8 {q8}: step {step} of {i}");
            next[i] = argmax(&y) as u32;
        }
    }
}

#[test]
fn joint_prefill_equals_prefilling_alone() {
    let f32_model = synthetic_model(&tiny_hparams(), &TypeRecipe::F32, 11);
    joint_equals_alone(&f32_model, NumericMode::Exact, false);
    joint_equals_alone(&f32_model, NumericMode::Official, false);
    let q2 = synthetic_model(&quant_hparams(), &TypeRecipe::Q2, 5);
    joint_equals_alone(&q2, NumericMode::Official, true);
}

#[test]
fn bad_joint_prefills_are_errors() {
    let file = synthetic_model(&tiny_hparams(), &TypeRecipe::F32, 11);
    let mut eng = engine(&file, NumericMode::Exact, false);
    eng.set_short_prefill_rows(2);
    let mut a = eng.new_state().unwrap();
    let mut b = eng.new_state().unwrap();
    eng.eval(&mut a, &[1, 2], Logits::Last, None).unwrap();
    let (p3, p9): (Vec<u32>, Vec<u32>) = ((1..4).collect(), (1..10).collect());
    // A piece below the minimum (the short-chunk rule's pieces run as decode rows).
    let r = eng.eval_joint(&mut [&mut a, &mut b], &[&p9, &[5, 6]]);
    assert!(matches!(r, Err(EngineError::Config(_))), "{r:?}");
    // More tokens than the chunk holds (16).
    let r = eng.eval_joint(&mut [&mut a, &mut b], &[&p9, &p9]);
    assert!(matches!(r, Err(EngineError::Config(_))), "{r:?}");
    // One piece per state; a token outside the vocabulary.
    assert!(eng.eval_joint(&mut [&mut a, &mut b], &[&p9]).is_err());
    assert!(eng.eval_joint(&mut [], &[]).is_err());
    // (`index` counts the call's rows: the second piece's third token is row 5.)
    let r = eng.eval_joint(&mut [&mut a, &mut b], &[&p3, &[1, 2, 10_000]]);
    assert!(
        matches!(r, Err(EngineError::BadToken { index: 5, .. })),
        "{r:?}"
    );
    // Nothing moved.
    assert_eq!((a.pos(), b.pos()), (2, 0));
    eng.eval_joint(&mut [&mut a, &mut b], &[&p3, &p9]).unwrap();
    assert_eq!((a.pos(), b.pos()), (5, 9));
}

/// The routing census (`Engine::set_route_census`, what `ds4-bench --batch` bounds a step
/// by): one batched step of B sequences counts, per layer, between k (all chose the same
/// experts) and min(B·k, E) distinct experts, B·k assignments in all; one sequence counts
/// exactly its k distinct ones; and counting changes no logits.
#[test]
fn the_route_census_counts_each_steps_distinct_experts() {
    let file = synthetic_model(&tiny_hparams(), &TypeRecipe::F32, 11);
    let mut eng = engine(&file, NumericMode::Exact, false);
    let hp = eng.hparams().clone();
    let (k, e) = (hp.n_expert_used, hp.n_expert);
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| tokens(5 + 3 * i, hp.n_vocab, 40 + i as u64))
        .collect();
    let mut states = Vec::new();
    let mut next = Vec::new();
    for p in &prompts {
        let mut st = eng.new_state().unwrap();
        next.push(argmax(&eng.eval(&mut st, p, Logits::Last, None).unwrap()) as u32);
        states.push(st);
    }
    let mut twins: Vec<_> = states.iter().map(|s| eng.snapshot(s).unwrap()).collect();
    assert!(eng.route_census().is_none());
    let mut refs: Vec<&mut ds4_engine::KvState> = states.iter_mut().collect();
    let off = eng.eval_batch(&mut refs, &next).unwrap();

    // The same step again from the same states, counted.
    for (st, snap) in states.iter_mut().zip(twins.drain(..)) {
        eng.restore(st, &snap).unwrap();
    }
    eng.set_route_census(true);
    let mut refs: Vec<&mut ds4_engine::KvState> = states.iter_mut().collect();
    let on = eng.eval_batch(&mut refs, &next).unwrap();
    assert!(
        on.iter().zip(&off).all(|(a, b)| a.to_bits() == b.to_bits()),
        "the census changed the logits"
    );
    let c = eng.route_census().unwrap().clone();
    assert_eq!(c.calls, 1);
    assert_eq!(c.distinct.len(), hp.n_layer);
    for il in 0..hp.n_layer {
        let d = c.distinct[il] as usize;
        assert!(d >= k && d <= (3 * k).min(e), "layer {il}: {d} distinct");
        assert_eq!(c.load[il].iter().sum::<u64>() as usize, 3 * k, "layer {il}");
    }

    // One sequence's token: exactly k distinct per layer.
    eng.set_route_census(true);
    let t = next[0];
    eng.eval(&mut states[0], &[t], Logits::Last, None).unwrap();
    let c = eng.route_census().unwrap();
    assert_eq!(c.calls, 1);
    assert!(
        c.distinct.iter().all(|&d| d as usize == k),
        "{:?}",
        c.distinct
    );
    eng.set_route_census(false);
    assert!(eng.route_census().is_none());
}

/// What the synthetic router skew (`ds4-bench --router-skew S`) does to a step's routing, at
/// Flash's 256 experts and 6 per token (tiny widths: the router's logits have unit variance
/// at any width under the synthetic weights' scaling, so the skew's effect carries over).
/// Prints, per S, the top-k layers' distinct experts of a 64-sequence step, the hottest
/// expert's load over the mean and the top 10 % of experts' share of the picks
/// (docs/server.md §12 quotes them: `-- --nocapture`). The census must see the uniform
/// router spread like the uniform expectation and each larger S concentrate it more.
#[test]
fn the_census_sees_the_router_skew() {
    let mut h = tiny_hparams();
    h.n_expert = 256;
    h.n_expert_used = 6;
    h.n_vocab = 1024;
    let (b, steps) = (64usize, 8);
    let hash = h.hash_layer_count;
    let tok = ds4_convert::tokenizer::generated_tokenizer(h.n_vocab);
    let dir = tempfile::tempdir().unwrap();
    let mut rows = Vec::new();
    for s in [0.0f32, 0.05, 0.1, 0.3] {
        let m = ds4_convert::SyntheticModel::from_hparams(h.clone(), TypeRecipe::F32, 7, &tok)
            .unwrap()
            .with_router_skew(s)
            .unwrap();
        let path = dir.path().join(format!("skew{s}.gguf"));
        let f = std::fs::File::create(&path).unwrap();
        m.write_to(std::io::BufWriter::new(f), &mut ds4_convert::NoProgress)
            .unwrap();
        let file = Arc::new(GgufFile::open(&path).unwrap());
        // A chunk of at least the batch: one forward pass per step.
        let cfg = EngineConfig {
            mode: Some(NumericMode::Exact),
            ctx: 64,
            prefill_chunk: b,
        };
        let mut eng = Engine::load(file, Box::new(CpuBackend::new(2).unwrap()), cfg).unwrap();
        let mut states = Vec::new();
        let mut next = Vec::new();
        for i in 0..b {
            let p = tokens(8, h.n_vocab, 500 + i as u64);
            let mut st = eng.new_state().unwrap();
            next.push(argmax(&eng.eval(&mut st, &p, Logits::Last, None).unwrap()) as u32);
            states.push(st);
        }
        eng.set_route_census(true);
        for _ in 0..steps {
            let mut refs: Vec<&mut ds4_engine::KvState> = states.iter_mut().collect();
            next = eng.eval_batch_argmax(&mut refs, &next).unwrap();
        }
        let mut c = eng.route_census().unwrap().clone();
        // The top-k layers (the hash layers' tid2eid skew is milder and token-driven).
        c.distinct.drain(..hash);
        c.load.drain(..hash);
        let d = c.mean_distinct();
        let distinct = d.iter().sum::<f64>() / d.len() as f64;
        let (max_mean, top10) = (c.max_over_mean(), c.top_share(0.1));
        eprintln!(
            "router skew {s}: {b} sequences, top-k layers: {distinct:.1} distinct experts a \
             step, hottest {max_mean:.2}x the mean, top 10 % of experts {:.1} % of picks",
            100.0 * top10
        );
        rows.push((distinct, top10));
    }
    let uniform = 256.0 * (1.0 - (1.0f64 - 6.0 / 256.0).powi(b as i32));
    assert!(
        rows[0].0 > 0.9 * uniform,
        "{rows:?} vs uniform {uniform:.1}"
    );
    for w in rows.windows(2) {
        assert!(w[1].0 < w[0].0 && w[1].1 > w[0].1, "{rows:?}");
    }
    assert!(rows[3].1 > 0.5, "{rows:?}");
}
