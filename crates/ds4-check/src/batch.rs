//! Batched decode against decoding alone: the property a server that batches several
//! conversations relies on (issue 22; docs/gpu.md §10): one [`Engine::eval_batch`] row per
//! sequence must give that sequence's logits as if it were decoded by itself.

use std::sync::Arc;

use ds4_engine::sampler::{band_words, LogitBand, BAND_CAP, BAND_FIRST_READ, BAND_HEAD};
use ds4_engine::{
    Backend, BatchRow, Engine, EngineConfig, EngineError, KvState, Logits, NumericMode, Rng,
};
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
    /// Sampling bands the batched steps left (`Engine::eval_batch_bands`, one
    /// `logit_bands` call a step) that differ from their definition on the step's row.
    pub bands_bad: usize,
    /// Bands compared.
    pub bands: usize,
}

impl BatchVsAlone {
    /// Nothing compared yet.
    pub fn new() -> BatchVsAlone {
        BatchVsAlone {
            worst: 0.0,
            exact: true,
            greedy: 0,
            bands_bad: 0,
            bands: 0,
        }
    }

    /// The checks' pass rule: no greedy token differs, every row is within 1e-6 of its
    /// twin alone and every band is its definition's.
    pub fn passes(&self) -> bool {
        self.worst <= 1e-6 && self.greedy == 0 && self.bands_bad == 0
    }

    /// Counts one row against the row alone.
    pub fn add(&mut self, row: &[f32], want: &[f32]) {
        self.worst = self.worst.max(rel_err(row, want));
        self.exact &= row.len() == want.len()
            && row
                .iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        self.greedy += usize::from(ds4_engine::argmax(row) != ds4_engine::argmax(want));
    }
}

impl Default for BatchVsAlone {
    fn default() -> Self {
        Self::new()
    }
}

/// Default sequences and the decode steps of [`batch_vs_alone`].
pub const SEQS: usize = 4;
pub const STEPS: usize = 6;

fn random_tokens(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|_| (rng.next_f64() * vocab as f64) as u32 % vocab as u32)
        .collect()
}

/// The band of `row` within `span` of its maximum as the engine hands it over: the
/// definition's words (`band_words`), of which a band over the capacity (the sampler then
/// reads the whole row) brings back only the first read's items.
fn defined_band(row: &[f32], span: f32) -> Option<LogitBand> {
    let mut words = band_words(row, span, None, BAND_CAP);
    if usize::try_from(words[2]).is_ok_and(|count| count > BAND_CAP) {
        words.truncate(BAND_HEAD + 2 * BAND_FIRST_READ);
    }
    LogitBand::from_words(&words)
}

/// Decodes `seqs` sequences with random prompts of `prompt` + {0, 3, 7, 1, 5, 2, 6, 4} (then
/// again) tokens, token by
/// token alone for [`STEPS`] greedy steps, then again as batched steps with the tokens of
/// the alone run (so the two stay aligned), and compares every batched row with its twin.
/// The batched steps ask for sampling bands of several spans (one row a step none), as
/// the server's sampler does, and each band must be `band_words` of the step's row.
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
    let mut r = BatchVsAlone::new();
    for step in 0..STEPS {
        let toks: Vec<u32> = fed.iter().map(|f| f[step]).collect();
        let mut refs: Vec<&mut KvState> = states.iter_mut().collect();
        let spans: Vec<Option<f32>> = (0..seqs)
            .map(|i| [Some(2.0), Some(0.0), None, Some(1e30)][(i + step) % 4])
            .collect();
        let out = eng.eval_batch_bands(&mut refs, &toks, &spans)?;
        let mut row = Vec::with_capacity(vocab);
        for (i, (got, span)) in out.iter().zip(&spans).enumerate() {
            eng.batch_row_into(i, &mut row)?;
            r.add(&row, &alone[i][step]);
            let ok = match (got, span) {
                (BatchRow::Band(b), Some(span)) => defined_band(&row, *span).as_ref() == Some(b),
                (BatchRow::Row(whole), None) => whole == &row,
                _ => false,
            };
            r.bands += 1;
            r.bands_bad += usize::from(!ok);
        }
    }
    for st in states {
        eng.free_state(st);
    }
    Ok(r)
}

/// What [`joint_vs_alone`] found.
#[derive(Debug, Clone, Copy)]
pub struct JointVsAlone {
    /// A jointly prefilled sequence's logits rows (after the piece and after each of two
    /// decode steps) against the same rows alone.
    pub rows: BatchVsAlone,
    /// The engine's smallest joint piece ([`Engine::joint_min_rows`]).
    pub min_rows: usize,
    /// Wall time of the pieces prefilled one after another, and in one joint pass (the
    /// second of two rounds; each includes reading back the last logits rows).
    pub alone_ms: f64,
    pub joint_ms: f64,
}

/// Prefills `seqs` sequences (random prompts of `prompt` + {0, 3, 7, 1, 5, 2, 6, 4}
/// tokens) alone, then a piece of `piece` + {0, 5, 2, 7, 1, 6, 3, 4} tokens (at least
/// [`Engine::joint_min_rows`]) of each, alone and as one [`Engine::eval_joint`], and
/// compares the last logits rows and two greedy decode steps after them (docs/forward.md
/// §14). An engine without joint prefills is an error.
pub fn joint_vs_alone(
    file: &Arc<GgufFile>,
    mode: NumericMode,
    be: Box<dyn Backend>,
    (prompt, piece): (usize, usize),
    seqs: usize,
    rng: &mut Rng,
) -> Result<JointVsAlone, EngineError> {
    const EXTRA: [usize; 8] = [0, 5, 2, 7, 1, 6, 3, 4];
    // Room for pieces up to 96 tokens (the minimum is known once the engine is loaded).
    let room = piece.max(96);
    let cfg = EngineConfig {
        mode: Some(mode),
        ctx: prompt + 8 + room + 8 + 4,
        prefill_chunk: (seqs * (room + 8)).max(prompt + 8),
    };
    let mut eng = Engine::load(file.clone(), be, cfg)?;
    let min_rows = eng
        .joint_min_rows()
        .ok_or_else(|| EngineError::Config("this engine runs no joint prefills".into()))?;
    let piece = piece.max(min_rows);
    if piece > room {
        return Err(EngineError::Config(format!(
            "joint pieces of {piece} tokens (the engine's minimum {min_rows}) exceed {room}"
        )));
    }
    let vocab = eng.hparams().n_vocab;
    let heads: Vec<Vec<u32>> = (0..seqs)
        .map(|i| random_tokens(rng, prompt + [0usize, 3, 7, 1, 5, 2, 6, 4][i % 8], vocab))
        .collect();
    let pieces: Vec<Vec<u32>> = (0..seqs)
        .map(|i| random_tokens(rng, piece + EXTRA[i % 8], vocab))
        .collect();
    let mut r = JointVsAlone {
        rows: BatchVsAlone::new(),
        min_rows,
        alone_ms: 0.0,
        joint_ms: 0.0,
    };
    for round in 0..2 {
        let mut alone = Vec::new();
        let mut joint = Vec::new();
        for h in &heads {
            for v in [&mut alone, &mut joint] {
                let mut st = eng.new_state()?;
                eng.eval(&mut st, h, Logits::Last, None)?;
                v.push(st);
            }
        }
        let t = std::time::Instant::now();
        let mut want = Vec::new();
        for (st, p) in alone.iter_mut().zip(&pieces) {
            want.push(eng.eval(st, p, Logits::Last, None)?);
        }
        let alone_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = std::time::Instant::now();
        let mut refs: Vec<&mut KvState> = joint.iter_mut().collect();
        let slices: Vec<&[u32]> = pieces.iter().map(Vec::as_slice).collect();
        eng.eval_joint(&mut refs, &slices)?;
        let mut got = Vec::new();
        for i in 0..seqs {
            let mut row = Vec::new();
            eng.batch_row_into(i, &mut row)?;
            got.push(row);
        }
        let joint_ms = t.elapsed().as_secs_f64() * 1e3;
        if round == 1 {
            (r.alone_ms, r.joint_ms) = (alone_ms, joint_ms);
        }
        for i in 0..seqs {
            r.rows.add(&got[i], &want[i]);
            let mut tok = ds4_engine::argmax(&want[i]);
            for _ in 0..2 {
                let a = eng.eval(&mut alone[i], &[tok], Logits::Last, None)?;
                let b = eng.eval(&mut joint[i], &[tok], Logits::Last, None)?;
                r.rows.add(&b, &a);
                tok = ds4_engine::argmax(&a);
            }
        }
        for st in alone.into_iter().chain(joint) {
            eng.free_state(st);
        }
    }
    Ok(r)
}
