//! Speculative decoding is lossless (docs/speculative.md): greedy generation with the
//! prompt-lookup drafter emits, token for token, what generation without drafting emits,
//! and leaves the same state (its snapshot, byte for byte) — on the trained demo model
//! (f32 in exact and official mode, q2 at the default precision) and the tiny-hca16
//! fixture, CPU backend. The prompts repeat a span the model continues, so drafts are
//! proposed and accepted (checked), and some are rejected (checked where they are).

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::OnceLock;

use ds4_engine::{Sampler, SamplerConfig};
use ds4_runtime::config::{Config, ConfigFlags};
use ds4_runtime::load::{load, BackendChoice, LoadOptions, ModeChoice};
use ds4_runtime::{Conversation, DraftConfig, DraftMode, DraftStats, GenLimits, GenStop};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The tiny-hca16 fixture (sliding, CSA and HCA layers) converted once per test binary.
fn tiny_gguf() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let fixture = root().join("tests/fixtures/tiny-hca16");
        let dir = tempfile::tempdir().unwrap().keep();
        let src = dir.join("hf");
        std::fs::create_dir_all(&src).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(fixture.join(f), src.join(f)).unwrap();
        }
        let out = dir.join("tiny.gguf");
        let opts = ds4_convert::HfOptions::new("f32").unwrap();
        ds4_convert::convert_hf(&src, &out, &opts, &mut ds4_convert::NoProgress).unwrap();
        out
    })
}

fn conversation(model: &Path, mode: Option<ModeChoice>, draft: DraftConfig) -> Conversation {
    let opts = LoadOptions {
        model: model.to_path_buf(),
        backend: BackendChoice::Cpu,
        mode,
        ctx: 512,
        kv_states: 1,
        prefill_chunk: 32,
        threads: 2,
        placement: Default::default(),
        report: ds4_runtime::load::LoadReport::Quiet,
        config: Config::from_flags(ConfigFlags {
            no_warmup: true,
            ..ConfigFlags::default()
        }),
    };
    let mut c = Conversation::new(load(&opts, &mut std::io::sink()).unwrap().engine).unwrap();
    c.set_draft(draft);
    c
}

/// `n` tokens generated after `prompt` with `cfg`, the drafting statistics and the state's
/// snapshot afterwards.
fn generate(
    model: &Path,
    mode: Option<ModeChoice>,
    draft: DraftConfig,
    cfg: &SamplerConfig,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, DraftStats, Vec<u8>) {
    let mut c = conversation(model, mode, draft);
    let cancel = AtomicBool::new(false);
    let (_, logits) = c.sync(prompt, &cancel, &mut |_, _| {}).unwrap();
    let mut sampler = Sampler::new(cfg.clone()).unwrap();
    let limits = GenLimits {
        max_tokens: n,
        eos: 1,
        ignore_eos: true,
        feed_all: false,
    };
    let mut seen = Vec::new();
    let out = c
        .generate(logits.unwrap(), &mut sampler, limits, &cancel, &mut |t| {
            seen.push(t)
        })
        .unwrap();
    assert_eq!(out.stop, GenStop::Length);
    assert_eq!(out.tokens, seen, "every emitted token went to the callback");
    // The state holds the prompt and every emitted token but the last.
    assert_eq!(c.live().len(), prompt.len() + n - 1);
    (out.tokens, out.draft, c.snapshot().unwrap().into_bytes())
}

fn lookup(max: usize) -> DraftConfig {
    DraftConfig {
        mode: DraftMode::Lookup,
        max,
        ngram: 3,
    }
}

/// A prompt the model continues by repeating: a seed, the model's own greedy continuation
/// of it, then the seed again (its continuation is then largely a copy, which the lookup
/// drafter proposes).
fn echo_prompt(model: &Path, mode: Option<ModeChoice>, seed: &[u32], n: usize) -> Vec<u32> {
    let greedy = SamplerConfig::default();
    let (cont, _, _) = generate(model, mode, DraftConfig::default(), &greedy, seed, n);
    let mut p = seed.to_vec();
    p.extend_from_slice(&cont);
    p.extend_from_slice(seed);
    p
}

/// Greedy with and without drafting (spans within and past the exact-rollback limit, and
/// `auto`) give the same tokens and the same final state; returns the drafting statistics
/// of `--draft-max 3`.
fn greedy_is_lossless(
    model: &Path,
    mode: Option<ModeChoice>,
    prompt: &[u32],
    n: usize,
) -> DraftStats {
    let greedy = SamplerConfig::default();
    let (plain, none, plain_state) =
        generate(model, mode, DraftConfig::default(), &greedy, prompt, n);
    assert_eq!(none, DraftStats::default());
    let mut stats = DraftStats::default();
    let auto = DraftConfig {
        mode: DraftMode::Auto,
        ..lookup(3)
    };
    for draft in [lookup(3), lookup(7), auto] {
        let (drafted, s, state) = generate(model, mode, draft, &greedy, prompt, n);
        assert_eq!(drafted, plain, "{mode:?} {draft:?}: tokens differ");
        assert!(state == plain_state, "{mode:?} {draft:?}: states differ");
        if draft == lookup(3) {
            stats = s;
        }
    }
    stats
}

#[test]
fn greedy_drafting_is_lossless_on_the_demo_model() {
    let f32_model = root().join("tests/fixtures/kjv/ds4-kjv.gguf");
    // Token ids of the demo vocabulary (any ids make a prompt; the model then writes its
    // corpus' style).
    let seed: Vec<u32> = vec![400, 1200, 77, 980, 35, 2100, 612];
    for mode in [ModeChoice::Exact, ModeChoice::Official] {
        let prompt = echo_prompt(&f32_model, Some(mode), &seed, 40);
        let s = greedy_is_lossless(&f32_model, Some(mode), &prompt, 48);
        assert!(
            s.accepted > 0 && s.drafted > s.accepted,
            "{mode:?}: drafts neither accepted nor rejected: {s:?}"
        );
    }
    // The q2 file at the default precision (int8 decode activations).
    let q2 = root().join("tests/fixtures/kjv/ds4-kjv-q2.gguf");
    let prompt = echo_prompt(&q2, None, &seed, 40);
    let s = greedy_is_lossless(&q2, None, &prompt, 48);
    assert!(s.accepted > 0, "q2: no draft accepted: {s:?}");
}

#[test]
fn greedy_drafting_is_lossless_on_a_tiny_model() {
    let model = tiny_gguf();
    let seed: Vec<u32> = (0..9).map(|i| (i * 37 + 5) % 200).collect();
    for mode in [ModeChoice::Exact, ModeChoice::Official] {
        let prompt = echo_prompt(model, Some(mode), &seed, 30);
        let s = greedy_is_lossless(model, Some(mode), &prompt, 40);
        assert!(
            s.steps > 0 && s.drafted > 0,
            "{mode:?}: nothing drafted: {s:?}"
        );
    }
}

/// Sampling with a drafter runs end to end with the sampler's filters, and a sampler that
/// can only pick one token (top-k 1) is deterministic, so it must match exactly.
#[test]
fn sampled_drafting_runs_and_top_k_one_matches() {
    let model = tiny_gguf();
    let seed: Vec<u32> = (0..9).map(|i| (i * 37 + 5) % 200).collect();
    let prompt = echo_prompt(model, None, &seed, 30);
    let top1 = SamplerConfig {
        temperature: 0.8,
        top_k: 1,
        seed: 9,
        ..SamplerConfig::default()
    };
    let (a, _, sa) = generate(model, None, DraftConfig::default(), &top1, &prompt, 30);
    let (b, s, sb) = generate(model, None, lookup(3), &top1, &prompt, 30);
    assert_eq!(a, b);
    assert!(sa == sb);
    assert!(s.drafted > 0);
    let warm = SamplerConfig {
        temperature: 0.7,
        top_p: 0.9,
        min_p: 0.05,
        repeat_penalty: 1.1,
        seed: 3,
        ..SamplerConfig::default()
    };
    let (t, _, _) = generate(model, None, lookup(3), &warm, &prompt, 30);
    assert_eq!(t.len(), 30);
}

/// A tiny synthetic model (window 8, CSA and HCA layers) and its synthetic MTP sidecar,
/// written once per test binary.
fn tiny_mtp() -> &'static (PathBuf, PathBuf) {
    static P: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    P.get_or_init(|| {
        use ds4_convert::synthetic::SyntheticModel;
        let h = ds4_model::HParams {
            n_layer: 4,
            n_embd: 64,
            n_head: 4,
            head_dim: 64,
            rope_dim: 16,
            q_lora_rank: 32,
            o_lora_rank: 32,
            o_groups: 2,
            n_vocab: 97,
            n_expert: 8,
            n_expert_used: 2,
            expert_ff: 32,
            hash_layer_count: 2,
            swiglu_clamp: vec![10.0; 4],
            sliding_window: 8,
            compress_ratios: vec![0, 0, 4, 16],
            indexer_heads: 16,
            indexer_head_dim: 32,
            indexer_top_k: 3,
            context_length: Some(4096),
            ..ds4_model::HParams::flash()
        };
        let tok = ds4_model::layout::placeholder_tokenizer(h.n_vocab);
        let model =
            SyntheticModel::from_hparams(h, ds4_model::layout::TypeRecipe::F32, 7, &tok).unwrap();
        let dir = tempfile::tempdir().unwrap().keep();
        let (main, side) = (dir.join("tiny.gguf"), dir.join("tiny-mtp.gguf"));
        let write = |m: &SyntheticModel, p: &Path| {
            let f = std::fs::File::create(p).unwrap();
            m.write_to(std::io::BufWriter::new(f), &mut ds4_convert::NoProgress)
                .unwrap();
        };
        write(&model, &main);
        write(&model.mtp_sidecar().unwrap(), &side);
        (main, side)
    })
}

fn mtp_conversation(draft: DraftConfig, mtp: Option<&Path>) -> Conversation {
    let (main, _) = tiny_mtp();
    let flags = ConfigFlags {
        no_warmup: true,
        draft: Some(draft.mode),
        ..ConfigFlags::default()
    };
    let opts = LoadOptions {
        model: main.clone(),
        backend: BackendChoice::Cpu,
        mode: Some(ModeChoice::Official),
        ctx: 512,
        kv_states: 1,
        prefill_chunk: 32,
        threads: 2,
        placement: Default::default(),
        report: ds4_runtime::load::LoadReport::Quiet,
        config: Config::from_flags(flags).with_mtp_flag(mtp.map(Path::to_path_buf)),
    };
    let mut c = Conversation::new(load(&opts, &mut std::io::sink()).unwrap().engine).unwrap();
    c.set_draft(draft);
    c
}

/// Tokens, statistics and final snapshot of `n` tokens after `prompt`.
fn mtp_generate(
    draft: DraftConfig,
    cfg: &SamplerConfig,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, DraftStats, Vec<u8>) {
    let (_, side) = tiny_mtp();
    let mut c = mtp_conversation(draft, Some(side));
    let cancel = AtomicBool::new(false);
    let (_, logits) = c.sync(prompt, &cancel, &mut |_, _| {}).unwrap();
    let mut sampler = Sampler::new(cfg.clone()).unwrap();
    let limits = GenLimits {
        max_tokens: n,
        eos: 1,
        ignore_eos: true,
        feed_all: false,
    };
    let out = c
        .generate(logits.unwrap(), &mut sampler, limits, &cancel, &mut |_| {})
        .unwrap();
    (out.tokens, out.draft, c.snapshot().unwrap().into_bytes())
}

#[test]
fn mtp_drafting_is_lossless() {
    let prompt: Vec<u32> = (0..21).map(|i| (i * 37 + 5) % 97).collect();
    let n = 40;
    let greedy = SamplerConfig::default();
    let (plain, none, plain_state) = mtp_generate(DraftConfig::default(), &greedy, &prompt, n);
    assert_eq!(none, DraftStats::default());
    for max in [1, 3, 6] {
        for mode in [DraftMode::Mtp, DraftMode::Auto] {
            let draft = DraftConfig {
                mode,
                max,
                ngram: 3,
            };
            let (tokens, stats, state) = mtp_generate(draft, &greedy, &prompt, n);
            assert_eq!(tokens, plain, "{draft:?}: tokens differ");
            assert!(state == plain_state, "{draft:?}: states differ");
            if mode == DraftMode::Mtp {
                // The block drafted at every step (chained to the depth asked for).
                assert!(
                    stats.steps > 0 && stats.drafted >= stats.steps * max.min(2) as u64,
                    "{draft:?}: {stats:?}"
                );
            }
        }
    }
}

#[test]
fn draft_mtp_without_a_block_is_refused() {
    let (main, _) = tiny_mtp();
    let flags = ConfigFlags {
        no_warmup: true,
        draft: Some(DraftMode::Mtp),
        ..ConfigFlags::default()
    };
    let opts = LoadOptions {
        model: main.clone(),
        backend: BackendChoice::Cpu,
        mode: None,
        ctx: 64,
        kv_states: 1,
        prefill_chunk: 32,
        threads: 1,
        placement: Default::default(),
        report: ds4_runtime::load::LoadReport::Quiet,
        config: Config::from_flags(flags),
    };
    let err = load(&opts, &mut std::io::sink()).err().unwrap().to_string();
    assert!(err.contains("--mtp FILE"), "{err}");
    // `auto` without a block runs prompt lookup.
    let c = mtp_conversation(
        DraftConfig {
            mode: DraftMode::Auto,
            ..DraftConfig::default()
        },
        None,
    );
    assert!(!c.engine().has_mtp());
}

/// Sampling with MTP drafts drawn from the block's distribution (the acceptance rule's `q`,
/// whose statistics `crates/ds4-engine/src/sampler/draft.rs` tests): the drafts are verified
/// and the state afterwards is the one the emitted tokens give when fed plainly.
#[test]
fn sampled_mtp_drafting_leaves_the_state_of_its_tokens() {
    let prompt: Vec<u32> = (0..21).map(|i| (i * 37 + 5) % 97).collect();
    let n = 30;
    let cfg = SamplerConfig {
        temperature: 1.5,
        seed: 9,
        ..SamplerConfig::default()
    };
    let draft = DraftConfig {
        mode: DraftMode::Mtp,
        max: 3,
        ngram: 3,
    };
    let (tokens, stats, state) = mtp_generate(draft, &cfg, &prompt, n);
    assert_eq!(tokens.len(), n);
    assert!(stats.steps > 0 && stats.drafted > 0, "{stats:?}");
    let mut fed = prompt.clone();
    fed.extend_from_slice(&tokens[..n - 1]);
    let (_, side) = tiny_mtp();
    let mut c = mtp_conversation(DraftConfig::default(), Some(side));
    let cancel = AtomicBool::new(false);
    // One token at a time, as decoding feeds them.
    for i in 1..=fed.len() {
        c.sync(&fed[..i], &cancel, &mut |_, _| {}).unwrap();
    }
    assert!(c.snapshot().unwrap().into_bytes() == state, "states differ");
}

/// The MTP block with streamed routed experts (docs/placement.md §10): the plan counts the
/// block and keeps it resident beside the expert cache, the engine loads it, and greedy
/// MTP drafting gives the tokens of plain resident decoding.
#[test]
fn mtp_drafting_with_streamed_experts_is_lossless() {
    let prompt: Vec<u32> = (0..21).map(|i| (i * 37 + 5) % 97).collect();
    let n = 30;
    let greedy = SamplerConfig::default();
    let (plain, _, _) = mtp_generate(DraftConfig::default(), &greedy, &prompt, n);
    let (main, side) = tiny_mtp();
    let draft = DraftConfig {
        mode: DraftMode::Mtp,
        max: 3,
        ngram: 3,
    };
    let flags = ConfigFlags {
        no_warmup: true,
        draft: Some(draft.mode),
        ..ConfigFlags::default()
    };
    let opts = LoadOptions {
        model: main.clone(),
        backend: BackendChoice::Cpu,
        mode: Some(ModeChoice::Official),
        ctx: 512,
        kv_states: 1,
        prefill_chunk: 32,
        threads: 2,
        placement: ds4_placement::CliOverrides {
            experts: Some("stream".into()),
            ..Default::default()
        },
        report: ds4_runtime::load::LoadReport::Summary,
        config: Config::from_flags(flags).with_mtp_flag(Some(side.clone())),
    };
    let mut log = Vec::new();
    let loaded = load(&opts, &mut log).unwrap();
    let log = String::from_utf8_lossy(&log).into_owned();
    assert!(loaded.engine.expert_stats().is_some(), "{log}");
    assert!(loaded.engine.has_mtp(), "{log}");
    assert!(
        log.contains("MTP block"),
        "the summary names the block: {log}"
    );
    let mut c = Conversation::new(loaded.engine).unwrap();
    c.set_draft(draft);
    let cancel = AtomicBool::new(false);
    let (_, logits) = c.sync(&prompt, &cancel, &mut |_, _| {}).unwrap();
    let mut sampler = Sampler::new(greedy).unwrap();
    let limits = GenLimits {
        max_tokens: n,
        eos: 1,
        ignore_eos: true,
        feed_all: false,
    };
    let out = c
        .generate(logits.unwrap(), &mut sampler, limits, &cancel, &mut |_| {})
        .unwrap();
    assert_eq!(out.tokens, plain);
    assert!(out.draft.drafted > 0, "{:?}", out.draft);
}

/// The loader's plan holds the block it will load: the sidecar's tensors in the set
/// `mtp`, its state beside the KV cache; without drafting, no block is planned.
#[test]
fn the_load_plan_counts_the_mtp_block() {
    use ds4_runtime::plan::{run, PlanArgs, Source};
    let (main, side) = tiny_mtp();
    let args = |mtp| PlanArgs {
        source: Source::File(main.clone()),
        mtp,
        ctx: 512,
        kv_states: 1,
        prefill_chunk: 32,
        machine: Some(root().join("crates/ds4-placement/machines/h200-128g.json")),
        device: None,
        overrides: Default::default(),
    };
    let p = run(&args(Some(Some(side.clone()))), |_| None)
        .unwrap()
        .result
        .unwrap();
    let m = p.mtp.as_ref().expect("the block is planned");
    let f = ds4_gguf::GgufFile::open(side).unwrap();
    let bytes: u64 = f
        .header()
        .tensors
        .iter()
        .map(|t| t.n_bytes().unwrap())
        .sum();
    assert!(m.resident);
    assert_eq!(m.weight_bytes, bytes);
    assert!(m.state_bytes > 0);
    assert!(p.render_text().contains("MTP state"));
    let p = run(&args(None), |_| None).unwrap().result.unwrap();
    assert!(p.mtp.is_none());
    // A file without a block given as the block is refused, naming it.
    let e = run(&args(Some(Some(main.clone()))), |_| None)
        .err()
        .unwrap();
    assert!(e.to_string().contains("holds no MTP block"), "{e}");
}

/// What a steer saw of a `feed_all` generation: at every [`ds4_runtime::Steer::fed`], the
/// live tokens and the logits after them.
#[derive(Default)]
struct FedLog {
    tokens: Vec<u32>,
    fed: Vec<(Vec<u32>, Vec<f32>)>,
}

impl ds4_runtime::Steer for FedLog {
    fn token(&mut self, tok: u32) -> ds4_runtime::Flow {
        self.tokens.push(tok);
        ds4_runtime::Flow::Continue
    }
    fn fed(&mut self, conv: &mut Conversation) {
        let logits = conv.logits().expect("logits after the state").to_vec();
        self.fed.push((conv.live().to_vec(), logits));
    }
}

/// `n` tokens under `feed_all` (the server's mode: every emitted token is fed, the logits
/// after the last are kept): the outcome, the steer's log, the final live tokens, logits
/// and snapshot.
fn generate_feed_all(
    mut c: Conversation,
    cfg: &SamplerConfig,
    prompt: &[u32],
    n: usize,
) -> (ds4_runtime::GenOutcome, FedLog, Vec<u32>, Vec<f32>, Vec<u8>) {
    let cancel = AtomicBool::new(false);
    c.sync(prompt, &cancel, &mut |_, _| {}).unwrap();
    let mut sampler = Sampler::new(cfg.clone()).unwrap();
    let limits = GenLimits {
        max_tokens: n,
        eos: 1,
        ignore_eos: true,
        feed_all: true,
    };
    let mut log = FedLog::default();
    let out = c
        .generate_with(&mut sampler, limits, &cancel, &mut log)
        .unwrap();
    assert_eq!(
        out.tokens, log.tokens,
        "every emitted token went to the steer"
    );
    let live = c.live().to_vec();
    let logits = c.logits().expect("feed_all keeps the logits").to_vec();
    (out, log, live, logits, c.snapshot().unwrap().into_bytes())
}

/// Drafting under `feed_all` is lossless: greedy tokens, the state (every emitted token
/// fed, the snapshot's bytes) and the logits after it are those of plain decoding, and
/// every state the steer's `fed` sees — once per verify step, holding all the tokens it
/// kept — is one plain decoding passed through, with the same logits (EOS masked for the
/// picks and put back). Prompt lookup on the demo model (drafts accepted and rejected,
/// spans within and past the exact rollback) and the MTP block on the synthetic tiny
/// model.
#[test]
fn drafting_under_feed_all_is_lossless() {
    let greedy = SamplerConfig::default();
    let kjv = root().join("tests/fixtures/kjv/ds4-kjv.gguf");
    let seed: Vec<u32> = vec![400, 1200, 77, 980, 35, 2100, 612];
    let mode = Some(ModeChoice::Official);
    let prompt = echo_prompt(&kjv, mode, &seed, 40);
    let n = 40;
    let check = |plain: &(ds4_runtime::GenOutcome, FedLog, Vec<u32>, Vec<f32>, Vec<u8>),
                 got: (ds4_runtime::GenOutcome, FedLog, Vec<u32>, Vec<f32>, Vec<u8>),
                 what: &str|
     -> DraftStats {
        assert_eq!(got.0.tokens, plain.0.tokens, "{what}: tokens differ");
        assert_eq!(got.0.stop, GenStop::Length, "{what}");
        assert_eq!(got.2, plain.2, "{what}: live tokens differ");
        assert!(got.3 == plain.3, "{what}: final logits differ");
        assert!(got.4 == plain.4, "{what}: states differ");
        let s = got.0.draft;
        assert!(s.steps > 0, "{what}: nothing drafted: {s:?}");
        // Fewer `fed` calls when drafts stood; each one a state plain decoding passed.
        assert!(
            got.1.fed.len() < plain.1.fed.len() || s.accepted == 0,
            "{what}"
        );
        for (toks, logits) in &got.1.fed {
            let same = plain.1.fed.iter().find(|(t, _)| t == toks);
            let (_, want) = same.unwrap_or_else(|| panic!("{what}: fed at {}", toks.len()));
            assert!(logits == want, "{what}: logits at {} differ", toks.len());
        }
        s
    };
    let plain = generate_feed_all(
        conversation(&kjv, mode, DraftConfig::default()),
        &greedy,
        &prompt,
        n,
    );
    assert_eq!(
        plain.2.len(),
        prompt.len() + n,
        "every emitted token is fed"
    );
    assert_eq!(plain.1.fed.len(), n, "a `fed` after every token");
    for draft in [lookup(3), lookup(7)] {
        let got = generate_feed_all(conversation(&kjv, mode, draft), &greedy, &prompt, n);
        let s = check(&plain, got, &format!("{draft:?}"));
        assert!(
            s.accepted > 0 && s.drafted > s.accepted,
            "{draft:?}: drafts neither accepted nor rejected: {s:?}"
        );
    }
    // The MTP block (its random drafts are rejected: every step rolls back).
    let prompt: Vec<u32> = (0..21).map(|i| (i * 37 + 5) % 97).collect();
    let (_, side) = tiny_mtp();
    let plain = generate_feed_all(
        mtp_conversation(DraftConfig::default(), Some(side)),
        &greedy,
        &prompt,
        n,
    );
    let draft = DraftConfig {
        mode: DraftMode::Mtp,
        max: 3,
        ngram: 3,
    };
    let got = generate_feed_all(mtp_conversation(draft, Some(side)), &greedy, &prompt, n);
    check(&plain, got, "mtp");
}
