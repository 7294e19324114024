//! Batched decode against decoding alone: the property a server that batches several
//! conversations relies on (issue 22; docs/gpu.md §10): one [`Engine::eval_batch`] row per
//! sequence must give that sequence's logits as if it were decoded by itself.

use std::sync::Arc;

use ds4_engine::{Backend, Engine, EngineConfig, EngineError, KvState, Logits, NumericMode, Rng};
use ds4_gguf::GgufFile;

use crate::mirror::rel_err;

/// What [`batch_vs_alone`] found.
#[derive(Debug, Clone, Copy)]
pub struct BatchVsAlone {
    /// Largest relative difference of a batched logits row to the same row alone.
    pub worst: f64,
    /// Whether every batched row was bit-for-bit the row alone.
    pub exact: bool,
    /// Rows whose greedy token differed.
    pub greedy: usize,
}

/// Default sequences and the decode steps of [`batch_vs_alone`].
pub const SEQS: usize = 4;
pub const STEPS: usize = 6;

fn random_tokens(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|_| (rng.next_f64() * vocab as f64) as u32 % vocab as u32)
        .collect()
}

/// Decodes `seqs` sequences with random prompts of `prompt` + {0, 3, 7, 1, 5, 2, 6, 4} (then
/// again) tokens, token by
/// token alone for [`STEPS`] greedy steps, then again as batched steps with the tokens of
/// the alone run (so the two stay aligned), and compares every batched row with its twin.
pub fn batch_vs_alone(
    file: &Arc<GgufFile>,
    mode: NumericMode,
    be: Box<dyn Backend>,
    prompt: usize,
    seqs: usize,
    rng: &mut Rng,
) -> Result<BatchVsAlone, EngineError> {
    let cfg = EngineConfig {
        mode: Some(mode),
        ctx: prompt + 16 + STEPS,
        // A batched step takes at most a chunk's worth of states.
        prefill_chunk: seqs.max(16),
    };
    let mut eng = Engine::load(file.clone(), be, cfg)?;
    let vocab = eng.hparams().n_vocab;
    let prompts: Vec<Vec<u32>> = [0usize, 3, 7, 1, 5, 2, 6, 4]
        .iter()
        .cycle()
        .take(seqs)
        .map(|extra| random_tokens(rng, prompt + extra, vocab))
        .collect();
    let mut alone: Vec<Vec<Vec<f32>>> = Vec::new();
    let mut fed: Vec<Vec<u32>> = Vec::new();
    for p in &prompts {
        let mut st = eng.new_state()?;
        let mut logits = eng.eval(&mut st, p, Logits::Last, None)?;
        let (mut rows, mut toks) = (Vec::new(), Vec::new());
        for _ in 0..STEPS {
            let t = ds4_engine::argmax(&logits);
            toks.push(t);
            logits = eng.eval(&mut st, &[t], Logits::Last, None)?;
            rows.push(logits.clone());
        }
        eng.free_state(st);
        alone.push(rows);
        fed.push(toks);
    }
    let mut states: Vec<KvState> = Vec::new();
    for p in &prompts {
        let mut st = eng.new_state()?;
        eng.eval(&mut st, p, Logits::Last, None)?;
        states.push(st);
    }
    let mut r = BatchVsAlone {
        worst: 0.0,
        exact: true,
        greedy: 0,
    };
    for step in 0..STEPS {
        let toks: Vec<u32> = fed.iter().map(|f| f[step]).collect();
        let mut refs: Vec<&mut KvState> = states.iter_mut().collect();
        let out = eng.eval_batch(&mut refs, &toks)?;
        for (i, row) in out.chunks(vocab).enumerate() {
            let want = &alone[i][step];
            r.worst = r.worst.max(rel_err(row, want));
            r.exact &= row.len() == want.len()
                && row
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            r.greedy += usize::from(ds4_engine::argmax(row) != ds4_engine::argmax(want));
        }
    }
    for st in states {
        eng.free_state(st);
    }
    Ok(r)
}
