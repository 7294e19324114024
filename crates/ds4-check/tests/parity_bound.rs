//! `ds4-engine-check parity` in official mode (`ds4_check::parity`): the reordered bound,
//! with the CPU engine's logits as the reference, must accept a backend that differs from the
//! CPU engine only by rounding flips in the FP8/FP4 simulations, and reject a planted bug.
//! The candidates are the CPU engine under refcheck's controls: `qat-nudge` (every QAT input
//! moved by one ulp, so only values next to a rounding boundary change) and `ulps:1` (every
//! reducing op's output moved by up to one ulp, like another summation order) for the flips;
//! skipped FP8 round trips and an unrounded FP8 scale for the bugs. Random tiny q2 and q4
//! models as in `parity --tiny`, each path with its own 100 tokens.

use std::sync::Arc;

use ds4_check::mirror::rel_err;
use ds4_check::parity;
use ds4_check::refcheck::controls::{Control, Controlled};
use ds4_check::refcheck::{self, Reordered};
use ds4_convert::SyntheticModel;
use ds4_cpu::CpuBackend;
use ds4_engine::{Backend, NumericMode, Rng};
use ds4_gguf::GgufFile;
use ds4_model::layout::{placeholder_tokenizer, TypeRecipe};

/// Seeds of the random models (q2 for even indices, q4 for odd, as `parity --tiny`).
const SEEDS: [u64; 4] = [24, 25, 26, 27];

fn model(i: usize, seed: u64) -> Arc<GgufFile> {
    let h = parity::tiny_hparams();
    let tok = placeholder_tokenizer(h.n_vocab);
    let recipe = if i.is_multiple_of(2) {
        TypeRecipe::Q2
    } else {
        TypeRecipe::Q4
    };
    let m = SyntheticModel::from_hparams(h, recipe, seed, &tok).unwrap();
    let (bytes, _) = m
        .write_to(Vec::new(), &mut ds4_convert::NoProgress)
        .unwrap();
    Arc::new(GgufFile::from_bytes(bytes).unwrap())
}

fn tokens(rng: &mut Rng, vocab: usize) -> [Vec<u32>; 3] {
    std::array::from_fn(|_| {
        (0..parity::OFFICIAL_MIN_TOKENS)
            .map(|_| (rng.next_f64() * vocab as f64) as u32 % vocab as u32)
            .collect()
    })
}

fn run(file: &Arc<GgufFile>, toks: &[Vec<u32>; 3], control: Option<Control>) -> [Vec<f32>; 3] {
    std::array::from_fn(|i| {
        let mut be: Box<dyn Backend> = Box::new(CpuBackend::new(0).unwrap());
        if let Some(c) = control {
            be = Box::new(Controlled::new(be, c, 11 + i as u64));
        }
        parity::eval_path(file, NumericMode::Official, &toks[i], i, be).unwrap()
    })
}

#[test]
fn official_parity_accepts_rounding_flips_and_rejects_planted_bugs() {
    let correct = ["qat-nudge", "ulps:1"];
    let bugs = ["no-fp8-kv", "no-fp8-comp", "fp8-scale-unrounded"];
    let names: Vec<&str> = correct.iter().chain(&bugs).copied().collect();
    let mut pooled: Vec<Reordered> = vec![Reordered::default(); names.len()];
    // Correct-control paths the old fixed official tolerance (1e-3, mirror::rel_err) rejected.
    let mut over_old_tol = 0;
    let mut perturbed = vec![false; correct.len()];
    let mut rng = Rng::new(5);
    for (i, seed) in SEEDS.into_iter().enumerate() {
        let file = model(i, seed);
        let vocab = parity::tiny_hparams().n_vocab;
        let toks = tokens(&mut rng, vocab);
        let want = run(&file, &toks, None);
        for (k, name) in names.iter().enumerate() {
            let c = Control::parse(name).unwrap();
            assert_eq!(c.is_correct(), k < correct.len(), "{name}");
            let got = run(&file, &toks, Some(c));
            for p in 0..3 {
                let (e, clean) =
                    parity::add_official(&mut pooled[k], &got[p], &want[p], vocab).unwrap();
                let old = rel_err(&got[p], &want[p]);
                println!(
                    "seed {seed} {name:20} {:8} old measure {old:.1e}; {} [{}]",
                    parity::PATHS[p],
                    e.summary(),
                    clean.map_or_else(|w| format!("not clean: {w}"), |()| "clean".into())
                );
                if k < correct.len() {
                    perturbed[k] |= e.worst() > 0.0;
                    over_old_tol += usize::from(old > 1e-3);
                }
            }
        }
    }
    for (k, name) in names.iter().enumerate() {
        let p = &pooled[k];
        println!(
            "{name:20} clean {}/{} (+{}/{} short): {:?}",
            p.long.0,
            p.long.1,
            p.short.0,
            p.short.1,
            p.verdict()
        );
        assert_eq!(p.short.1, 0, "every official sequence is >= PREFIX long");
        if k < correct.len() {
            assert!(perturbed[k], "{name} changed nothing");
            p.verdict()
                .unwrap_or_else(|w| panic!("{name} (correct) rejected: {w}"));
        } else {
            assert_eq!(p.long.0, 0, "{name} (a bug) has a clean prefix");
            assert!(p.verdict().is_err(), "{name} (a bug) accepted");
        }
    }
    println!("correct-control paths over the old fixed tolerance 1e-3: {over_old_tol}");
}

/// Gaps of a run's own logits, as the parity reference uses them.
#[test]
fn top1_gaps_of_a_run() {
    let logits = [1.0f32, 3.0, 2.5, -1.0, 0.0, -0.5, 4.0, 4.0, 1.0];
    let g = refcheck::top1_gaps(&logits, 3).unwrap();
    assert_eq!(g, vec![0.5, 0.5, 0.0]);
    assert!(refcheck::top1_gaps(&logits, 2).is_err());
    assert!(refcheck::top1_gaps(&logits, 1).is_err());
    let mut nan = logits;
    nan[4] = f32::NAN;
    assert!(refcheck::top1_gaps(&nan, 3).unwrap()[1].is_nan());
    let e = refcheck::compare_runs(&logits, &logits, 3).unwrap();
    assert_eq!(e.worst(), 0.0);
}
