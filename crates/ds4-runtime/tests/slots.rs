//! `Slots`: several conversations on one engine. Each slot, decoded in batched steps next
//! to others, must hold exactly what a lone `Conversation` on the same prompt holds (logits
//! bit for bit, on the CPU), and a slot's checkpoint must resume in a conversation.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::OnceLock;

use ds4_engine::{argmax, Sampler, SamplerConfig};
use ds4_runtime::config::{Config, ConfigFlags};
use ds4_runtime::load::{load, BackendChoice, LoadOptions};
use ds4_runtime::{
    Conversation, GenLimits, GenState, GenStop, Pick, Slots, SlotsError, Steer, StepLogits,
};

/// The tiny-hca16 fixture (every attention kind, 2 MB) converted once per test binary.
fn tiny_gguf() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-hca16");
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

fn opts() -> LoadOptions {
    LoadOptions {
        model: tiny_gguf().to_path_buf(),
        backend: BackendChoice::Cpu,
        mode: None,
        ctx: 128,
        kv_states: 3,
        prefill_chunk: 16,
        threads: 1,
        placement: Default::default(),
        report: ds4_runtime::load::LoadReport::Quiet,
        config: Config::from_flags(ConfigFlags {
            no_warmup: true,
            ..ConfigFlags::default()
        }),
    }
}

fn engine() -> ds4_engine::Engine {
    load(&opts(), &mut std::io::sink()).unwrap().engine
}

fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 7 + seed * 13 + 1) % 200)
        .collect()
}

#[test]
fn batched_slots_match_lone_conversations() {
    let mut slots = Slots::new(engine(), 3).unwrap();
    assert_eq!(slots.len(), 3);
    let prompts = [prompt(5, 1), prompt(23, 2), prompt(40, 3)];
    let mut alone: Vec<Conversation> = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        slots.prefill(i, p).unwrap();
        let mut c = Conversation::new(engine()).unwrap();
        c.prefill(p).unwrap();
        assert_eq!(slots.logits(i).unwrap(), c.logits());
        alone.push(c);
    }
    for step in 0..5 {
        // Slot 1 sits out step 2: a batch of a subset, in a shuffled order.
        let mut feeds: Vec<(usize, u32)> = (0..3)
            .rev()
            .filter(|&i| step != 2 || i != 1)
            .map(|i| (i, argmax(slots.logits(i).unwrap().unwrap())))
            .collect();
        if step == 4 {
            feeds.truncate(1);
        }
        slots.decode(&feeds).unwrap();
        for &(i, t) in &feeds {
            alone[i].advance(t).unwrap();
            assert_eq!(
                slots.logits(i).unwrap(),
                alone[i].logits(),
                "slot {i}, step {step}"
            );
            assert_eq!(slots.live(i), alone[i].live());
        }
    }
    // A slot named twice is refused before anything runs.
    assert!(slots.decode(&[(0, 1), (0, 2)]).is_err());
    assert_eq!(slots.live(0), alone[0].live());

    // A slot's checkpoint resumes in a conversation, and the reverse.
    let payload = slots.checkpoint(2).unwrap();
    let mut c = Conversation::new(engine()).unwrap();
    c.resume(&payload, slots.live(2)).unwrap();
    assert_eq!(c.logits(), slots.logits(2).unwrap());
    let payload = alone[0].checkpoint().unwrap();
    slots.resume(1, &payload, alone[0].live()).unwrap();
    assert_eq!(slots.live(1), alone[0].live());
    assert_eq!(slots.logits(1).unwrap(), alone[0].logits());
    // Wrong tokens: refused, and the slot is left empty.
    assert!(slots.resume(1, &payload, &[1, 2, 3]).is_err());
    assert_eq!(slots.pos(1), 0);
    slots.reset(0).unwrap();
    assert_eq!((slots.pos(0), slots.logits(0).unwrap()), (0, None));
    assert!(matches!(Slots::new(engine(), 0), Err(SlotsError::Zero)));
}

struct Plain;
impl Steer for Plain {
    fn token(&mut self, _: u32) -> ds4_runtime::Flow {
        ds4_runtime::Flow::Continue
    }
}

/// A generation stepped by hand over a slot (as the server's scheduler does) samples what
/// `Conversation::generate_with` samples with the same seed.
#[test]
fn stepped_generation_matches_generate_with() {
    let cfg = SamplerConfig {
        temperature: 1.0,
        seed: 7,
        ..SamplerConfig::default()
    };
    let limits = GenLimits {
        max_tokens: 12,
        eos: 100_000,
        ignore_eos: false,
        feed_all: true,
    };
    let p = prompt(19, 4);
    let mut c = Conversation::new(engine()).unwrap();
    c.prefill(&p).unwrap();
    let never = AtomicBool::new(false);
    let want = c
        .generate_with(
            &mut Sampler::new(cfg.clone()).unwrap(),
            limits,
            &never,
            &mut Plain,
        )
        .unwrap();

    let mut slots = Slots::new(engine(), 2).unwrap();
    slots.prefill(1, &p).unwrap();
    let mut sampler = Sampler::new(cfg).unwrap();
    let mut g = GenState::new(limits);
    let stop = loop {
        let pick = g
            .pick(
                &mut slots.step(1).unwrap(),
                &mut sampler,
                &never,
                &mut Plain,
            )
            .unwrap();
        match pick {
            Pick::Stop(s) => break s,
            Pick::Feed { tok, .. } => slots.decode(&[(1, tok)]).unwrap(),
        }
    };
    let got = g.finish(stop);
    assert_eq!(got.tokens, want.tokens);
    assert_eq!((got.stop, want.stop), (GenStop::Length, GenStop::Length));
    assert_eq!(slots.live(1), c.live());
}

/// The server's step pattern: one slot's prompt evaluated in pieces while another is
/// emptied, decoded alone, then batched with a slot whose prompt was evaluated between its
/// steps; the first slot stays bit for bit what a lone conversation holds.
#[test]
fn prefill_pieces_between_decode_steps_leave_other_slots_alone() {
    let eng = engine;
    let mut slots = Slots::new(eng(), 3).unwrap();
    let p0 = prompt(38, 1);
    let p1 = prompt(30, 2);
    let mut c0 = Conversation::new(eng()).unwrap();
    for piece in p0.chunks(16) {
        c0.prefill(piece).unwrap();
    }
    // slot 0 piece, reset slot 1, slot0 pieces
    slots.prefill(0, &p0[..16]).unwrap();
    slots.reset(1).unwrap();
    slots.prefill(0, &p0[16..32]).unwrap();
    slots.prefill(0, &p0[32..]).unwrap();
    assert_eq!(slots.logits(0).unwrap(), c0.logits(), "after prefill");
    let t = argmax(slots.logits(0).unwrap().unwrap());
    slots.decode(&[(0, t)]).unwrap();
    c0.advance(t).unwrap();
    assert_eq!(slots.logits(0).unwrap(), c0.logits(), "after decode 1");
    slots.prefill(1, &p1[..16]).unwrap();
    let t = argmax(slots.logits(0).unwrap().unwrap());
    slots.decode(&[(0, t)]).unwrap();
    c0.advance(t).unwrap();
    assert_eq!(
        slots.logits(0).unwrap(),
        c0.logits(),
        "after prefill of 1 + decode"
    );
    slots.prefill(1, &p1[16..]).unwrap();
    for step in 0..10 {
        let t = argmax(slots.logits(0).unwrap().unwrap());
        let t1 = argmax(slots.logits(1).unwrap().unwrap());
        slots.decode(&[(0, t), (1, t1)]).unwrap();
        c0.advance(t).unwrap();
        assert_eq!(slots.logits(0).unwrap(), c0.logits(), "batched step {step}");
    }
}

/// Pieces of three slots' prompts prefilled jointly (`Slots::prefill_joint`, named out of
/// order, one slot already holding a prompt) leave each slot, logits included, as a lone
/// conversation fed the same pieces; batched decoding then continues alike. A slot named
/// twice is an error that changes nothing.
#[test]
fn joint_prefill_pieces_match_lone_conversations() {
    let eng = || {
        let mut e = engine();
        e.set_short_prefill_rows(3);
        e
    };
    let mut slots = Slots::new(eng(), 3).unwrap();
    assert_eq!(slots.joint_min_rows(), Some(4));
    let p: Vec<Vec<u32>> = [5usize, 7, 10]
        .iter()
        .enumerate()
        .map(|(i, &n)| prompt(n, 5 + i as u32))
        .collect();
    let head = prompt(10, 9);
    let mut convs: Vec<Conversation> = (0..3).map(|_| Conversation::new(eng()).unwrap()).collect();
    slots.prefill(0, &head).unwrap();
    convs[0].prefill(&head).unwrap();
    let bad = slots.prefill_joint(&[(1, &p[1][..]), (1, &p[1][..])]);
    assert!(bad.is_err());
    assert_eq!(slots.pos(1), 0);
    slots
        .prefill_joint(&[(2, &p[2][..4]), (0, &p[0][..]), (1, &p[1][..])])
        .unwrap();
    convs[0].prefill(&p[0]).unwrap();
    convs[1].prefill(&p[1]).unwrap();
    convs[2].prefill(&p[2][..4]).unwrap();
    for (i, c) in convs.iter().enumerate() {
        assert_eq!(
            slots.logits(i).unwrap(),
            c.logits(),
            "slot {i} after the joint prefill"
        );
    }
    slots.prefill(2, &p[2][4..]).unwrap();
    convs[2].prefill(&p[2][4..]).unwrap();
    for step in 0..4 {
        let feeds: Vec<(usize, u32)> = (0..3)
            .map(|i| (i, argmax(slots.logits(i).unwrap().unwrap()) as u32))
            .collect();
        slots.decode(&feeds).unwrap();
        for (&(i, t), c) in feeds.iter().zip(convs.iter_mut()) {
            c.advance(t).unwrap();
            assert_eq!(
                slots.logits(i).unwrap(),
                c.logits(),
                "slot {i}, step {step}"
            );
        }
    }
}

/// A min-p sampler in a one-shot generation draws from the backend's logits band
/// (`Engine::eval_band`) instead of the row; with the same seed it emits the tokens the
/// row path (`feed_all`, which keeps every row) emits, with EOS masked or not.
#[test]
fn banded_generation_matches_the_row_path() {
    let p = prompt(17, 5);
    let never = AtomicBool::new(false);
    for (min_p, temperature, ignore_eos) in [
        (0.05f32, 1.0f32, false),
        (0.2, 0.8, true),
        (0.01, 1.5, true),
        (0.05, 0.0, true),
    ] {
        let cfg = SamplerConfig {
            temperature,
            min_p,
            seed: 11,
            ..SamplerConfig::default()
        };
        assert!(cfg.band_span().is_some());
        let run = |feed_all: bool| {
            let mut c = Conversation::new(engine()).unwrap();
            c.prefill(&p).unwrap();
            // An EOS id the tiny model does draw, so masking it matters.
            let limits = GenLimits {
                max_tokens: 16,
                eos: 3,
                ignore_eos,
                feed_all,
            };
            c.generate_with(
                &mut Sampler::new(cfg.clone()).unwrap(),
                limits,
                &never,
                &mut Plain,
            )
            .unwrap()
            .tokens
        };
        let (band, row) = (run(false), run(true));
        assert_eq!(
            band, row,
            "min_p {min_p} T {temperature} ignore_eos {ignore_eos}"
        );
        assert!(!band.is_empty());
    }
}

/// A steer that takes the greedy token at every third step (as the server does inside a
/// tool call's structure) and records whether it saw the row there.
struct EveryThird {
    saw_row: Vec<bool>,
}
impl Steer for EveryThird {
    fn wants_row(&mut self, step: usize) -> bool {
        step % 3 == 2
    }
    fn choose(&mut self, step: usize, logits: Option<&[f32]>) -> Option<u32> {
        if step % 3 == 2 {
            self.saw_row.push(logits.is_some());
            return logits.map(argmax);
        }
        None
    }
    fn token(&mut self, _: u32) -> ds4_runtime::Flow {
        ds4_runtime::Flow::Continue
    }
}

/// The server's lone decode steps leave a band (`Slots::set_band`) instead of the row:
/// stepped over a slot with the band on, a min-p generation emits what the row path emits
/// with the same seed, the steer's greedy steps still see the row, and the row fetched
/// later (checkpoint, another slot's prefill in between) is the row path's row.
#[test]
fn banded_slot_steps_match_the_row_steps() {
    // Min-p (the server's default) and greedy (temperature 0: a span-0 band).
    for temperature in [1.0f32, 0.0] {
        banded_slot_steps_match(temperature);
    }
}

fn banded_slot_steps_match(temperature: f32) {
    let p = prompt(21, 6);
    let never = AtomicBool::new(false);
    let cfg = SamplerConfig {
        temperature,
        min_p: 0.05,
        seed: 5,
        ..SamplerConfig::default()
    };
    let span = cfg.band_span();
    assert!(span.is_some());
    let limits = GenLimits {
        max_tokens: 14,
        eos: 100_000,
        ignore_eos: false,
        feed_all: true,
    };
    let run = |banded: bool| {
        let mut slots = Slots::new(engine(), 2).unwrap();
        slots.prefill(0, &p).unwrap();
        slots.set_band(0, if banded { span } else { None });
        let mut sampler = Sampler::new(cfg.clone()).unwrap();
        let mut g = GenState::new(limits);
        let mut steer = EveryThird {
            saw_row: Vec::new(),
        };
        let mut bands = 0;
        let mut rows = Vec::new();
        let stop = loop {
            bands += usize::from(slots.step(0).unwrap().band().is_some());
            let pick = g
                .pick(
                    &mut slots.step(0).unwrap(),
                    &mut sampler,
                    &never,
                    &mut steer,
                )
                .unwrap();
            match pick {
                Pick::Stop(s) => break s,
                Pick::Feed { tok, .. } => slots.decode(&[(0, tok)]).unwrap(),
            }
            let step = g.tokens().len();
            assert!(slots.has_logits(0));
            if step == 5 {
                // Another slot's prompt between two steps fetches this slot's row first.
                slots.prefill(1, &prompt(9, 2)).unwrap();
            }
            if step == 7 {
                let payload = slots.checkpoint(0).unwrap();
                rows.push(payload);
                rows.push(
                    slots
                        .logits(0)
                        .unwrap()
                        .unwrap()
                        .iter()
                        .flat_map(|x| x.to_le_bytes())
                        .collect(),
                );
            }
        };
        assert_eq!(stop, GenStop::Length);
        assert!(steer.saw_row.iter().all(|&s| s), "{:?}", steer.saw_row);
        assert!(!steer.saw_row.is_empty());
        (g.finish(stop).tokens, bands, rows, slots.live(0).to_vec())
    };
    let (band_toks, bands, band_rows, band_live) = run(true);
    let (row_toks, no_bands, row_rows, row_live) = run(false);
    assert_eq!(band_toks, row_toks);
    assert_eq!(band_live, row_live);
    assert_eq!(band_rows, row_rows, "checkpoint and row after step 7");
    assert_eq!(no_bands, 0);
    // 15 picks (the last one stops): all but the first (the prompt's row) and the two after
    // the prefill of slot 1 and the checkpoint (both fetched the row) met a band.
    assert_eq!(bands, 12);
}

/// Batched decode steps leave a band per slot too (`Engine::eval_batch_bands`): three slots
/// generating together (min-p, greedy, and one without a band) emit what the row path
/// emits with the same seeds, the steer's greedy steps still see the rows, and rows fetched
/// between steps (a checkpoint, another slot's logits) are the row path's rows.
#[test]
fn banded_batched_steps_match_the_row_steps() {
    let never = AtomicBool::new(false);
    let cfg = |temperature: f32, seed: u64| SamplerConfig {
        temperature,
        min_p: 0.05,
        seed,
        ..SamplerConfig::default()
    };
    let cfgs = [cfg(1.0, 5), cfg(0.0, 6), cfg(1.0, 7)];
    let limits = GenLimits {
        max_tokens: 12,
        eos: 100_000,
        ignore_eos: false,
        feed_all: true,
    };
    let run = |banded: bool| {
        let mut slots = Slots::new(engine(), 3).unwrap();
        let mut gens = Vec::new();
        for (i, c) in cfgs.iter().enumerate() {
            slots.prefill(i, &prompt(11 + 4 * i, i as u32 + 3)).unwrap();
            // Slot 2 never takes a band: its rows come back whole next to the others' bands.
            let span = if banded && i < 2 { c.band_span() } else { None };
            slots.set_band(i, span);
            gens.push((
                Sampler::new(c.clone()).unwrap(),
                GenState::new(limits),
                EveryThird {
                    saw_row: Vec::new(),
                },
            ));
        }
        let (mut bands, mut fetched) = (0, Vec::new());
        for step in 0..limits.max_tokens {
            let mut feeds = Vec::new();
            for (i, (sampler, g, steer)) in gens.iter_mut().enumerate() {
                bands += usize::from(slots.step(i).unwrap().band().is_some());
                match g
                    .pick(&mut slots.step(i).unwrap(), sampler, &never, steer)
                    .unwrap()
                {
                    Pick::Feed { tok, .. } => feeds.push((i, tok)),
                    Pick::Stop(s) => assert_eq!(s, GenStop::Length),
                }
            }
            if feeds.is_empty() {
                break;
            }
            slots.decode(&feeds).unwrap();
            if step == 4 {
                // One banded slot's checkpoint and another's row, while the third stays
                // banded.
                fetched.push(slots.checkpoint(0).unwrap());
                let row = slots.logits(2).unwrap().unwrap();
                fetched.push(row.iter().flat_map(|x| x.to_le_bytes()).collect());
            }
        }
        let mut out = Vec::new();
        for (i, (_, g, steer)) in gens.into_iter().enumerate() {
            assert!(!steer.saw_row.is_empty() && steer.saw_row.iter().all(|&s| s));
            out.push((g.finish(GenStop::Length).tokens, slots.live(i).to_vec()));
        }
        (out, bands, fetched)
    };
    let (band_out, bands, band_fetched) = run(true);
    let (row_out, no_bands, row_fetched) = run(false);
    assert_eq!(band_out, row_out);
    assert_eq!(band_fetched, row_fetched, "rows fetched after step 4");
    assert_eq!(no_bands, 0);
    // Slots 0 and 1 over 12 steps: the first picks read the prompts' rows, the steer's
    // every third step asks for the row, so some picks but not all met a band.
    assert!(bands >= 12, "{bands} picks met a band");
}

/// A repetition penalty sees the tokens generated so far: greedy decoding of the tiny
/// model repeats tokens within 24 steps, and with a strong penalty it does not.
#[test]
fn the_repetition_penalty_sees_the_generated_tokens() {
    let p = prompt(13, 8);
    let never = AtomicBool::new(false);
    let run = |repeat_penalty: f32| {
        let mut c = Conversation::new(engine()).unwrap();
        c.prefill(&p).unwrap();
        let cfg = SamplerConfig {
            temperature: 0.0,
            repeat_penalty,
            repeat_window: 64,
            ..SamplerConfig::default()
        };
        let limits = GenLimits {
            max_tokens: 24,
            eos: 100_000,
            ignore_eos: false,
            feed_all: false,
        };
        c.generate_with(&mut Sampler::new(cfg).unwrap(), limits, &never, &mut Plain)
            .unwrap()
            .tokens
    };
    let distinct = |t: &[u32]| t.iter().collect::<std::collections::HashSet<_>>().len();
    let plain = run(1.0);
    assert!(
        distinct(&plain) < plain.len(),
        "greedy never repeats: {plain:?}"
    );
    let penalised = run(1e4);
    assert_eq!(distinct(&penalised), penalised.len(), "{penalised:?}");
}

/// The server's turn snapshot writes into the buffer of the snapshot it replaces: the bytes
/// must equal a fresh snapshot's whatever that buffer held (longer, other state), and
/// restore to the same continuation.
#[test]
fn a_snapshot_into_a_reused_buffer_equals_a_fresh_one() {
    let mut slots = Slots::new(engine(), 2).unwrap();
    slots.prefill(0, &prompt(70, 1)).unwrap();
    slots.prefill(1, &prompt(23, 2)).unwrap();
    let want_long = slots.snapshot_len(0).unwrap();
    let long = slots.snapshot(0).unwrap().into_bytes();
    let fresh = slots.snapshot(1).unwrap();
    // The length the server plans with is the one written.
    assert_eq!(want_long, long.len());
    assert_eq!(slots.snapshot_len(1).unwrap(), fresh.as_bytes().len());
    let mut junk = long.clone();
    junk.iter_mut().for_each(|b| *b ^= 0x5a);
    let reused = slots.snapshot_into(1, junk).unwrap();
    assert!(long.len() > fresh.as_bytes().len());
    assert!(reused.as_bytes() == fresh.as_bytes());
    slots.restore(0, &reused, None).unwrap();
    assert_eq!(slots.live(0), slots.live(1));
    slots.decode(&[(0, 5)]).unwrap();
    slots.decode(&[(1, 5)]).unwrap();
    let a = slots.logits(0).unwrap().unwrap().to_vec();
    assert!(a == slots.logits(1).unwrap().unwrap());
}

/// Wants the row at every step (a steer inside a tool call's structure does).
struct RowReader;
impl Steer for RowReader {
    fn wants_row(&mut self, _: usize) -> bool {
        true
    }
    fn token(&mut self, _: u32) -> ds4_runtime::Flow {
        ds4_runtime::Flow::Continue
    }
}

/// `Slots::host_steps` (the server's picks of a batched step, drawn at once) picks what
/// `Slots::step` picks, for a greedy band, two min-p bands too wide for the device's
/// capacity (fetched first, in one read-back) and a full-row draw (top-p); a steer that wants a row still on
/// the device gets `RowOnDevice` before anything is drawn and the pick through `step`
/// then matches. The committed demo model has the whole vocabulary, so a flat min-p band
/// overflows `BAND_CAP`.
#[test]
fn host_steps_pick_what_slot_steps_pick() {
    let demo =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/demo/ds4-demo.gguf");
    let eng = || {
        let o = LoadOptions {
            model: demo.clone(),
            ..opts()
        };
        load(&o, &mut std::io::sink()).unwrap().engine
    };
    let cfgs = [
        SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        },
        SamplerConfig {
            temperature: 3.0,
            min_p: 0.01,
            seed: 5,
            ..SamplerConfig::default()
        },
        SamplerConfig {
            temperature: 1.0,
            top_p: 0.9,
            seed: 9,
            ..SamplerConfig::default()
        },
        SamplerConfig {
            temperature: 2.5,
            min_p: 0.02,
            seed: 11,
            ..SamplerConfig::default()
        },
    ];
    let (mut a, mut b) = (Slots::new(eng(), 4).unwrap(), Slots::new(eng(), 4).unwrap());
    let mut samplers: Vec<[Sampler; 2]> = cfgs
        .iter()
        .map(|c| {
            [
                Sampler::new(c.clone()).unwrap(),
                Sampler::new(c.clone()).unwrap(),
            ]
        })
        .collect();
    let limits = GenLimits {
        max_tokens: 100,
        eos: u32::MAX,
        ignore_eos: false,
        feed_all: true,
    };
    let mut gens: Vec<[GenState; 2]> = (0..4)
        .map(|_| [GenState::new(limits), GenState::new(limits)])
        .collect();
    for (i, c) in cfgs.iter().enumerate() {
        let p = prompt(9 + 4 * i, 20 + i as u32);
        a.prefill(i, &p).unwrap();
        b.prefill(i, &p).unwrap();
        a.set_band(i, c.band_span());
        b.set_band(i, c.band_span());
    }
    let never = AtomicBool::new(false);
    let ids = [0usize, 1, 2, 3];
    let (mut short, mut refetched) = (false, false);
    for step in 0..6 {
        // Two short bands (slots 1 and 3): one read-back of the rows they span.
        short |= [1, 3]
            .iter()
            .all(|&i| b.step(i).unwrap().band().is_some_and(|x| !x.is_complete()));
        let mut want = Vec::new();
        for &i in &ids {
            let d = &mut b.step(i).unwrap();
            let p = if step == 3 && i == 0 {
                gens[i][1].pick(d, &mut samplers[i][1], &never, &mut RowReader)
            } else {
                gens[i][1].pick(d, &mut samplers[i][1], &never, &mut Plain)
            };
            want.push(p.unwrap());
        }
        let mut got: Vec<Option<Pick>> = Vec::new();
        {
            let steps = a.host_steps(&ids).unwrap();
            for (k, st) in steps.into_iter().enumerate() {
                let mut st = st.expect("every slot has logits");
                let [g, _] = &mut gens[k];
                let [s, _] = &mut samplers[k];
                let r = if step == 3 && k == 0 {
                    g.pick(&mut st, s, &never, &mut RowReader)
                } else {
                    g.pick(&mut st, s, &never, &mut Plain)
                };
                match r {
                    Ok(p) => got.push(Some(p)),
                    Err(ds4_runtime::DriverError::RowOnDevice) => got.push(None),
                    Err(e) => panic!("step {step} slot {k}: {e}"),
                }
            }
        }
        for (k, g) in got.iter_mut().enumerate() {
            if g.is_none() {
                assert_eq!((step, k), (3, 0), "only the row reader's band pick defers");
                refetched = true;
                let d = &mut a.step(k).unwrap();
                let [gs, _] = &mut gens[k];
                let [s, _] = &mut samplers[k];
                *g = Some(gs.pick(d, s, &never, &mut RowReader).unwrap());
            }
        }
        let got: Vec<Pick> = got.into_iter().map(Option::unwrap).collect();
        assert_eq!(got, want, "step {step}");
        let feeds: Vec<(usize, u32)> = got
            .iter()
            .zip(&ids)
            .map(|(p, &i)| match p {
                Pick::Feed { tok, .. } => (i, *tok),
                Pick::Stop(s) => panic!("slot {i} stopped: {s:?}"),
            })
            .collect();
        a.decode(&feeds).unwrap();
        b.decode(&feeds).unwrap();
    }
    assert!(
        short,
        "the flat min-p band never overflowed the device's capacity"
    );
    assert!(refetched);
    assert!(a.host_steps(&[1, 1]).is_err());
    assert!(a.host_steps(&[4]).is_err());
}
