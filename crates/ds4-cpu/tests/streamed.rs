//! Streamed routed experts (docs/placement.md §9): with the experts read from the file
//! into a cache smaller than one layer's experts, prefill (more distinct experts than
//! slots, so the chunk is split into runs) and decode give the all-resident logits bit
//! for bit, with int8 decode activations off and on.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::*;
use ds4_cpu::CpuBackend;
use ds4_engine::{
    Backend, Engine, EngineConfig, EngineError, ExpertPlacement, Logits, NumericMode, StreamError,
    StreamStats,
};
use ds4_gguf::GgufFile;
use ds4_model::layout::TypeRecipe;

fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut r = ds4_engine::Rng::new(seed);
    (0..n)
        .map(|_| (r.next_u64() % vocab as u64) as u32)
        .collect()
}

/// The logits of a prefill of `toks` (all rows), then of decoding them one by one (all
/// rows), and the streaming counters after both.
struct Run {
    prefill: Vec<f32>,
    decode: Vec<f32>,
    /// After the prefill, and after both.
    prefill_stats: Option<StreamStats>,
    stats: Option<StreamStats>,
}

fn run(
    file: &Arc<GgufFile>,
    experts: ExpertPlacement,
    q8: bool,
    chunk: usize,
    toks: &[u32],
) -> Run {
    let cfg = EngineConfig {
        mode: Some(NumericMode::Exact),
        ctx: 256,
        prefill_chunk: chunk,
    };
    let mut be = CpuBackend::new(2).unwrap();
    be.set_activation_q8(q8).unwrap();
    let mut e = Engine::load_with(Arc::clone(file), Box::new(be), cfg, experts).unwrap();
    let mut st = e.new_state().unwrap();
    let prefill = e.eval(&mut st, toks, Logits::All, None).unwrap();
    let prefill_stats = e.expert_stats();
    e.free_state(st);
    let mut st = e.new_state().unwrap();
    let mut decode = Vec::new();
    for &t in toks {
        decode.extend(e.eval(&mut st, &[t], Logits::Last, None).unwrap());
    }
    e.free_state(st);
    Run {
        prefill,
        decode,
        prefill_stats,
        stats: e.expert_stats(),
    }
}

/// The same bytes as a file on disk (so the engine streams with `pread`).
fn on_disk(file: &GgufFile, dir: &Path, name: &str) -> Arc<GgufFile> {
    let p = dir.join(name);
    std::fs::write(&p, file.bytes()).unwrap();
    Arc::new(GgufFile::open(&p).unwrap())
}

fn check_identical(file: &Arc<GgufFile>, slots: usize, toks: &[u32], what: &str) {
    let n_expert = spec_of(file).hparams.n_expert;
    assert!(
        slots < n_expert,
        "{what}: the cache must be smaller than a layer"
    );
    for q8 in [false, true] {
        let resident = run(file, ExpertPlacement::Resident, q8, 64, toks);
        assert!(resident.stats.is_none());
        assert!(resident.prefill.iter().all(|v| v.is_finite()));
        let streamed = run(file, ExpertPlacement::streamed(slots), q8, 64, toks);
        assert!(
            resident.prefill == streamed.prefill,
            "{what} q8={q8}: streamed prefill differs (max rel {:e})",
            max_rel(&streamed.prefill, &resident.prefill, 1.0)
        );
        assert!(
            resident.decode == streamed.decode,
            "{what} q8={q8}: streamed decode differs (max rel {:e})",
            max_rel(&streamed.decode, &resident.decode, 1.0)
        );
        let s = streamed.stats.expect("streamed stats");
        let k = 2 * toks.len() as u64 * n_layers(file) as u64 * k_used(file) as u64;
        assert_eq!(
            s.lookups, k,
            "{what}: one lookup per token, layer and expert"
        );
        assert_eq!(s.hits + s.misses, s.lookups);
        assert!(
            s.misses > slots as u64,
            "{what}: the cache must have evicted"
        );
        assert!(s.hits > 0, "{what}: some lookups must hit");
        check_read_counts(&s, what);
        // Every layer's prefill needed more distinct experts than slots: two runs or more
        // per layer (and in a chunk of 64 tokens, all in one chunk).
        let p = streamed.prefill_stats.expect("streamed stats");
        assert!(
            p.runs >= 2 * n_layers(file) as u64,
            "{what}: {} runs",
            p.runs
        );
    }
}

fn spec_of(file: &GgufFile) -> ds4_model::ModelSpec {
    ds4_model::ModelSpec::from_header(file.header(), ds4_model::Strictness::Auto).unwrap()
}
fn n_layers(file: &GgufFile) -> usize {
    spec_of(file).hparams.n_layer
}
fn k_used(file: &GgufFile) -> usize {
    spec_of(file).hparams.n_expert_used
}

#[test]
fn streamed_experts_give_the_resident_logits_on_tiny_models() {
    let dir = tempfile::tempdir().unwrap();
    // f32 experts, read from memory and from a file (pread).
    let mem = synthetic_model(&tiny_hparams(), &TypeRecipe::F32, 5);
    let toks = tokens(40, 97, 3);
    // 8 experts, 2 per token: 6 slots is the smallest cache (three tokens' experts).
    check_identical(&mem, 6, &toks, "tiny f32 in memory");
    let disk = on_disk(&mem, dir.path(), "tiny.gguf");
    check_identical(&disk, 7, &toks, "tiny f32 on disk");
    // q2 experts (IQ2_XXS gate/up, Q2_K down) on disk.
    let q2 = synthetic_model(&quant_hparams(), &TypeRecipe::Q2, 9);
    let q2 = on_disk(&q2, dir.path(), "q2.gguf");
    check_identical(&q2, 6, &tokens(30, 97, 4), "tiny q2 on disk");
    // Prefills of many lengths, int8 activations on: wherever the greedy split would
    // leave a one-token run (computed as decode under the int8 rule), it must not.
    for n in 5..=24 {
        let toks = tokens(n, 97, 100 + n as u64);
        let cfg = |chunk| EngineConfig {
            mode: Some(NumericMode::Exact),
            ctx: 64,
            prefill_chunk: chunk,
        };
        let prefill = |experts| {
            let mut be = CpuBackend::new(2).unwrap();
            be.set_activation_q8(true).unwrap();
            let mut e = Engine::load_with(Arc::clone(&q2), Box::new(be), cfg(64), experts).unwrap();
            let mut st = e.new_state().unwrap();
            e.eval(&mut st, &toks, Logits::All, None).unwrap()
        };
        assert!(
            prefill(ExpertPlacement::Resident) == prefill(ExpertPlacement::streamed(6)),
            "q2 prefill of {n} tokens differs"
        );
    }
}

#[test]
fn a_cache_below_three_tokens_of_experts_is_refused_and_a_changed_file_reported() {
    let dir = tempfile::tempdir().unwrap();
    let mem = synthetic_model(&tiny_hparams(), &TypeRecipe::F32, 5);
    let cfg = EngineConfig {
        mode: Some(NumericMode::Exact),
        ctx: 64,
        prefill_chunk: 16,
    };
    let be = Box::new(CpuBackend::new(1).unwrap());
    let err = Engine::load_with(
        Arc::clone(&mem),
        be,
        cfg.clone(),
        ExpertPlacement::streamed(5),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::Stream(StreamError::TooSmall { slots: 5, min: 6 })
        ),
        "{err}"
    );
    // A file that shrank after it was opened: a clear error at load, not a panic later.
    let p = dir.path().join("m.gguf");
    std::fs::write(&p, mem.bytes()).unwrap();
    let file = Arc::new(GgufFile::open(&p).unwrap());
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(mem.bytes().len() as u64 - 4096).unwrap();
    let be = Box::new(CpuBackend::new(1).unwrap());
    let err = Engine::load_with(file, be, cfg, ExpertPlacement::streamed(6)).unwrap_err();
    assert!(
        matches!(err, EngineError::Stream(StreamError::FileChanged { .. })),
        "{err}"
    );
}

/// The real expert shapes and types: Flash dims (4096 hidden, 2048 expert width, 6 of the
/// experts per token, IQ2_XXS gate/up and Q2_K down as in ds4's q2), 4 layers (3 hash-routed,
/// 1 top-k). Smaller than the real model only where a CPU unit test needs it: 32 experts per
/// layer instead of 256 (a 1.3 GB file instead of 7.6 GB) and a 1024-token vocabulary. The
/// cache holds 18 units (three tokens' experts), fewer than one layer's 32 experts, and the
/// router is skewed (`--router-skew 0.3`) as in the benchmark files.
#[test]
fn streamed_experts_give_the_resident_logits_at_real_expert_dims() {
    real_dims(32);
}

/// [`streamed_experts_give_the_resident_logits_at_real_expert_dims`] with all 256 experts
/// of the real model: a 7.6 GB temporary file and a few minutes, so run on request
/// (`cargo test --release -p ds4-cpu --test streamed -- --ignored`).
#[test]
#[ignore = "writes a 7.6 GB file; run with --ignored"]
fn streamed_experts_give_the_resident_logits_with_all_256_experts() {
    real_dims(256);
}

fn real_dims(n_expert: usize) {
    use ds4_convert::synthetic::{flash_hparams, SyntheticModel};
    let mut h = flash_hparams(4).unwrap();
    h.n_expert = n_expert;
    h.n_vocab = 1024;
    assert_eq!((h.n_embd, h.expert_ff, h.n_expert_used), (4096, 2048, 6));
    let tok = ds4_convert::tokenizer::generated_tokenizer(h.n_vocab);
    let m = SyntheticModel::from_hparams(h, TypeRecipe::Q2, 1, &tok)
        .unwrap()
        .with_router_skew(0.3)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("flash4.gguf");
    let f = std::fs::File::create(&path).unwrap();
    m.write_to(std::io::BufWriter::new(f), &mut ds4_convert::NoProgress)
        .unwrap();
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let spec = spec_of(&file);
    let gate = spec
        .layer_tensor(0, ds4_model::LayerTensor::GateExps)
        .unwrap();
    let down = spec
        .layer_tensor(0, ds4_model::LayerTensor::DownExps)
        .unwrap();
    assert_eq!(
        (gate.ty, down.ty),
        (ds4_gguf::GgmlType::Iq2Xxs, ds4_gguf::GgmlType::Q2K)
    );
    // 12 tokens: prefill needs more distinct experts per layer than the 18 slots.
    let toks = tokens(12, 1024, 8);
    let q8 = true; // the default precision (int8 decode activations)
    let resident = run(&file, ExpertPlacement::Resident, q8, 64, &toks);
    assert!(resident.prefill.iter().all(|v| v.is_finite()));
    let streamed = run(&file, ExpertPlacement::streamed(18), q8, 64, &toks);
    assert!(
        resident.prefill == streamed.prefill,
        "prefill differs (max rel {:e})",
        max_rel(&streamed.prefill, &resident.prefill, 1.0)
    );
    assert!(
        resident.decode == streamed.decode,
        "decode differs (max rel {:e})",
        max_rel(&streamed.decode, &resident.decode, 1.0)
    );
    let p = streamed.prefill_stats.unwrap();
    assert!(p.runs > 4, "the prefill was split: {} runs", p.runs);
    let s = streamed.stats.unwrap();
    assert_eq!(s.lookups, 2 * 12 * 4 * 6);
    assert!(s.misses > 18 && s.hits > 0);
    check_read_counts(&s, "real dims");
}

/// The counters of the two tiers agree: every miss the host tier did not hold was read
/// (and waited for), and the only other reads are read-ahead.
fn check_read_counts(s: &StreamStats, what: &str) {
    assert_eq!(s.bytes_read, s.reads * s.slot_bytes, "{what}");
    assert!(s.host_hits <= s.misses, "{what}: {s:?}");
    assert!(s.reads >= s.misses - s.host_hits, "{what}: {s:?}");
    assert!(
        s.reads <= s.misses - s.host_hits + s.readahead_reads,
        "{what}: {s:?}"
    );
    assert!(s.readahead_used <= s.readahead_reads, "{what}: {s:?}");
    assert!(s.predicted_right <= s.predicted, "{what}: {s:?}");
}

/// Read-ahead (docs/placement.md §9): the next layer's router run on this layer's input
/// names the units to read while the layer computes. On a model whose layers are all
/// hash-routed the prediction is exact (a hash layer's experts depend only on the token),
/// so every predicted entry is right and decode misses are served by read-ahead; the
/// logits are the resident ones with read-ahead on and off.
#[test]
fn readahead_predicts_hash_layers_exactly_and_changes_no_logit() {
    let mut hp = tiny_hparams();
    hp.hash_layer_count = hp.n_layer;
    let file = synthetic_model(&hp, &TypeRecipe::F32, 21);
    let dir = tempfile::tempdir().unwrap();
    let file = on_disk(&file, dir.path(), "hash.gguf");
    let toks = tokens(24, 97, 5);
    let resident = run(&file, ExpertPlacement::Resident, false, 64, &toks);
    let cfg = |readahead| {
        ExpertPlacement::Streamed(ds4_engine::StreamConfig {
            slots: 6,
            host_slots: 0,
            readahead,
        })
    };
    let on = run(&file, cfg(true), false, 64, &toks);
    let off = run(&file, cfg(false), false, 64, &toks);
    for (r, name) in [(&on, "on"), (&off, "off")] {
        assert!(
            r.prefill == resident.prefill,
            "read-ahead {name}: prefill differs"
        );
        assert!(
            r.decode == resident.decode,
            "read-ahead {name}: decode differs"
        );
    }
    let (s_on, s_off) = (on.stats.unwrap(), off.stats.unwrap());
    check_read_counts(&s_on, "read-ahead on");
    check_read_counts(&s_off, "read-ahead off");
    assert_eq!(s_off.predicted + s_off.readahead_reads, 0, "{s_off:?}");
    // Decode: one prediction per token for every layer after the first.
    let p = s_on.predicted - on.prefill_stats.unwrap().predicted;
    let k = k_used(&file) as u64;
    assert_eq!(
        p,
        toks.len() as u64 * (hp.n_layer as u64 - 1) * k,
        "{s_on:?}"
    );
    assert_eq!(
        s_on.predicted_right, s_on.predicted,
        "hash layers are predicted exactly"
    );
    assert!(
        s_on.readahead_reads > 0 && s_on.readahead_used > 0,
        "{s_on:?}"
    );
}

/// A model file cut short while the engine runs: the read of a missing expert fails with
/// an error naming the tensor (no panic), and no slot is left claiming the unit it failed
/// to read: once the file is whole again the engine gives the resident logits.
#[test]
fn a_short_read_is_an_error_and_leaves_no_stale_unit() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic_model(&tiny_hparams(), &TypeRecipe::F32, 5);
    // The same tensors with a routed one moved to the end of the file, so cutting the
    // file's tail touches nothing the CPU backend maps.
    let mut header = model.header().clone();
    let i = header
        .tensors
        .iter()
        .position(|t| t.name == "blk.5.ffn_down_exps.weight")
        .unwrap();
    let moved = header.tensors.remove(i);
    header.tensors.push(moved);
    let mut w = ds4_gguf::GgufWriter::new(Vec::new(), header.clone()).unwrap();
    for t in &header.tensors {
        w.write_tensor(model.tensor_bytes(&t.name).unwrap().1)
            .unwrap();
    }
    let mem = GgufFile::from_bytes(w.finish().unwrap().0).unwrap();
    let last = mem
        .header()
        .tensors
        .iter()
        .max_by_key(|t| t.offset)
        .unwrap()
        .clone();
    assert_eq!(last.name, "blk.5.ffn_down_exps.weight");
    let p = dir.path().join("m.gguf");
    std::fs::write(&p, mem.bytes()).unwrap();
    let file = Arc::new(GgufFile::open(&p).unwrap());
    let cfg = EngineConfig {
        mode: Some(NumericMode::Exact),
        ctx: 64,
        prefill_chunk: 16,
    };
    let be = Box::new(CpuBackend::new(1).unwrap());
    // A slot for every unit (6 layers × 8 experts): nothing is evicted, so a unit the
    // failed read left claimed would be met again with a slot that does not hold it.
    let slots = 48;
    let mut e = Engine::load_with(file, be, cfg, ExpertPlacement::streamed(slots)).unwrap();
    // Cut the last expert's bytes of the last tensor.
    let bytes_per_expert = last.n_bytes().unwrap() / last.dims[2];
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(mem.bytes().len() as u64 - bytes_per_expert)
        .unwrap();
    let mut st = e.new_state().unwrap();
    let toks = tokens(40, 97, 3);
    let err = e.eval(&mut st, &toks, Logits::Last, None).unwrap_err();
    match &err {
        EngineError::Stream(StreamError::Read { tensor, .. }) => assert_eq!(tensor, &last.name),
        other => panic!("expected a read error, got {other}"),
    }
    e.free_state(st);
    // The file whole again: a fresh state gives the resident logits, so no slot was left
    // claiming a unit it does not hold.
    std::fs::write(&p, mem.bytes()).unwrap();
    let mut st = e.new_state().unwrap();
    let got = e.eval(&mut st, &toks, Logits::All, None).unwrap();
    let mem = Arc::new(mem);
    let want = run(&mem, ExpertPlacement::Resident, false, 16, &toks).prefill;
    assert!(
        got == want,
        "after a failed read the streamed logits differ"
    );
}

/// Batched decode (`Engine::eval_batch`) with streamed experts: 6 sequences of 2 experts
/// each need up to 12 distinct experts per layer, more than the 6 slots, so a step runs in
/// several `moe` calls of decode rows; every sequence still gets the logits it gets in a
/// resident batched step, and the resident batched step equals decoding alone (tested in
/// batch.rs).
#[test]
fn batched_decode_with_streamed_experts_matches_resident() {
    let file = synthetic_model(&quant_hparams(), &TypeRecipe::Q2, 9);
    let steps = |experts| {
        let cfg = EngineConfig {
            mode: Some(NumericMode::Exact),
            ctx: 64,
            prefill_chunk: 16,
        };
        let mut be = CpuBackend::new(2).unwrap();
        be.set_activation_q8(true).unwrap();
        let mut e = Engine::load_with(Arc::clone(&file), Box::new(be), cfg, experts).unwrap();
        let mut states: Vec<_> = (0..6)
            .map(|i| {
                let mut st = e.new_state().unwrap();
                e.eval(
                    &mut st,
                    &tokens(3 + i, 97, 50 + i as u64),
                    Logits::Last,
                    None,
                )
                .unwrap();
                st
            })
            .collect();
        e.reset_expert_stats();
        let mut out = Vec::new();
        for step in 0..4u64 {
            let mut refs: Vec<&mut ds4_engine::KvState> = states.iter_mut().collect();
            out.extend(e.eval_batch(&mut refs, &tokens(6, 97, 900 + step)).unwrap());
        }
        (out, e.expert_stats())
    };
    let (want, _) = steps(ExpertPlacement::Resident);
    let (got, stats) = steps(ExpertPlacement::streamed(6));
    assert!(got == want, "streamed batched decode differs");
    let s = stats.unwrap();
    // 4 steps of 4 layers: steps that fit in one call per layer would make 16 calls;
    // more means steps were split.
    assert!(s.runs > 4 * 4, "{} moe calls", s.runs);
    assert_eq!(s.lookups, 4 * 4 * 6 * 2);
}
