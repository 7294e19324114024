//! Streamed routed experts through the runtime (docs/placement.md §9): `--experts stream`
//! loads an engine whose expert cache is the plan's, and on every committed tiny fixture a
//! cache of three tokens' experts (smaller than all the model's experts, and than one
//! layer's where the fixture has more than that) gives the resident logits bit for bit.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ds4_engine::{Engine, EngineConfig, ExpertPlacement, Logits};
use ds4_gguf::GgufFile;
use ds4_runtime::config::{Config, ConfigFlags};
use ds4_runtime::load::{load, BackendChoice, LoadOptions};

/// Converts fixture `name` (config + checkpoint) to a GGUF of `recipe` in `dir`.
fn convert(name: &str, recipe: &str, dir: &Path) -> PathBuf {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name);
    let src = dir.join(format!("{name}-hf"));
    std::fs::create_dir_all(&src).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), src.join(f)).unwrap();
    }
    let out = dir.join(format!("{name}-{recipe}.gguf"));
    let opts = ds4_convert::HfOptions::new(recipe).unwrap();
    ds4_convert::convert_hf(&src, &out, &opts, &mut ds4_convert::NoProgress).unwrap();
    out
}

fn opts(model: &Path, experts: Option<&str>) -> LoadOptions {
    LoadOptions {
        model: model.to_path_buf(),
        backend: BackendChoice::Cpu,
        mode: None,
        ctx: 128,
        kv_states: 1,
        prefill_chunk: 32,
        threads: 2,
        placement: ds4_placement::CliOverrides {
            experts: experts.map(str::to_string),
            ..Default::default()
        },
        report: ds4_runtime::load::LoadReport::Quiet,
        config: Config::from_flags(ConfigFlags {
            no_warmup: true,
            ..ConfigFlags::default()
        }),
    }
}

fn prompt(n: usize, vocab: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 7 + seed * 13 + 1) % vocab as u32)
        .collect()
}

/// Prefill logits (all rows) and then decode logits of `toks`.
fn logits(e: &mut Engine, toks: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let mut st = e.new_state().unwrap();
    let pre = e.eval(&mut st, toks, Logits::All, None).unwrap();
    e.free_state(st);
    let mut st = e.new_state().unwrap();
    let mut dec = Vec::new();
    for &t in toks {
        dec.extend(e.eval(&mut st, &[t], Logits::Last, None).unwrap());
    }
    e.free_state(st);
    (pre, dec)
}

#[test]
fn experts_stream_loads_the_plans_cache_and_changes_no_logit() {
    let dir = tempfile::tempdir().unwrap();
    let model = convert("tiny-hca16", "f32", dir.path());
    let mut resident = load(&opts(&model, None), &mut std::io::sink())
        .unwrap()
        .engine;
    assert!(
        resident.expert_stats().is_none(),
        "auto keeps a tiny model resident"
    );
    let mut streamed = load(&opts(&model, Some("stream")), &mut std::io::sink())
        .unwrap()
        .engine;
    let hp = streamed.hparams().clone();
    let s = streamed.expert_stats().expect("--experts stream streams");
    // A tiny model's minimum cache is all of its units (the policy's extra exceeds them).
    assert_eq!(s.slots, hp.n_layer * hp.n_expert);
    let toks = prompt(24, hp.n_vocab, 1);
    assert!(logits(&mut resident, &toks) == logits(&mut streamed, &toks));
    let s = streamed.expert_stats().unwrap();
    assert_eq!(s.lookups, (2 * 24 * hp.n_layer * hp.n_expert_used) as u64);
    assert!(s.hits > 0 && s.misses > 0 && s.misses <= s.slots as u64);
}

#[test]
fn a_cache_of_three_tokens_experts_matches_resident_on_every_fixture() {
    let dir = tempfile::tempdir().unwrap();
    for (name, recipe) in [
        ("tiny-hca16", "f32"),
        ("tiny-hca128", "f32"),
        ("tiny-wide", "f32"),
        ("tiny-quant", "q2"),
    ] {
        let path = convert(name, recipe, dir.path());
        let file = Arc::new(GgufFile::open(&path).unwrap());
        let engine = |experts| {
            let mut be = ds4_cpu::CpuBackend::new(2).unwrap();
            ds4_engine::Backend::set_activation_q8(&mut be, true).unwrap();
            let cfg = EngineConfig {
                mode: None,
                ctx: 128,
                prefill_chunk: 64,
            };
            Engine::load_with(Arc::clone(&file), Box::new(be), cfg, experts).unwrap()
        };
        let mut resident = engine(ExpertPlacement::Resident);
        let hp = resident.hparams().clone();
        let slots = 3 * hp.n_expert_used;
        assert!(slots < hp.n_layer * hp.n_expert, "{name}");
        let mut streamed = engine(ExpertPlacement::streamed(slots));
        let toks = prompt(40, hp.n_vocab, 2);
        let (rp, rd) = logits(&mut resident, &toks);
        let (sp, sd) = logits(&mut streamed, &toks);
        assert!(rp.iter().all(|v| v.is_finite()), "{name}");
        assert!(rp == sp, "{name}: streamed prefill differs");
        assert!(rd == sd, "{name}: streamed decode differs");
        let s = streamed.expert_stats().unwrap();
        assert!(s.misses > slots as u64, "{name}: the cache evicted");
        // Reads: the misses the host tier did not hold, and read-ahead.
        assert_eq!(s.bytes_read, s.reads * s.slot_bytes, "{name}");
        assert!(s.reads >= s.misses - s.host_hits, "{name}: {s:?}");
        assert!(
            s.reads <= s.misses - s.host_hits + s.readahead_reads,
            "{name}: {s:?}"
        );
    }
}
