//! The op mirror on backends available everywhere: the CPU against itself must agree on
//! every op the forward pass runs, and a candidate that gets one op slightly wrong must be
//! named at exactly that op. Together they show the mirror is generic over its two
//! backends and that it can fail.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use common::model_file;
use ds4_check::mirror::{rel_err, Mirror, OpStat};
use ds4_cpu::CpuBackend;
use ds4_engine::backend::{BResult, Backend, Slice};
use ds4_engine::device::Forward;
use ds4_engine::{Engine, EngineConfig, Logits};

type Stats = Arc<Mutex<BTreeMap<&'static str, OpStat>>>;

/// Runs a short prefill in chunks, two decode steps and a greedy step through `mirror`.
fn drive<R: Backend + 'static, C: Backend + 'static>(mirror: Mirror<R, C>) -> Stats {
    let dir = tempfile::tempdir().unwrap();
    let file = model_file(dir.path());
    let stats = mirror.stats.clone();
    let cfg = EngineConfig {
        mode: None,
        ctx: 256,
        prefill_chunk: 5,
    };
    let mut eng = Engine::load(file, Box::new(mirror), cfg).unwrap();
    let vocab = eng.hparams().n_vocab as u32;
    let toks: Vec<u32> = (0..14).map(|i| (i * 31 + 7) % vocab).collect();
    let mut st = eng.new_state().unwrap();
    eng.eval(&mut st, &toks[..12], Logits::Last, None).unwrap();
    for t in &toks[12..] {
        eng.eval(&mut st, std::slice::from_ref(t), Logits::Last, None)
            .unwrap();
    }
    eng.eval_argmax(&mut st, &toks[..1]).unwrap();
    eng.eval_band(&mut st, &toks[1..2], 2.0, None).unwrap();
    stats
}

fn snapshot(stats: &Stats) -> BTreeMap<&'static str, OpStat> {
    stats.lock().unwrap().clone()
}

#[test]
fn relative_error_fails_on_nan_and_scales_by_the_reference() {
    assert_eq!(rel_err(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
    assert!((rel_err(&[1.0, 2.1], &[1.0, 2.0]) - 0.05).abs() < 1e-6);
    assert!(rel_err(&[f32::NAN, 2.0], &[1.0, 2.0]).is_infinite());
    // NaN in the reference is not counted against the candidate.
    assert_eq!(rel_err(&[5.0, 2.0], &[f32::NAN, 2.0]), 0.0);
}

#[test]
fn the_cpu_mirrored_against_itself_agrees_on_every_op() {
    // Different thread counts: the CPU's results must not depend on them.
    let m = Mirror::new(CpuBackend::new(1).unwrap(), CpuBackend::new(2).unwrap());
    let stats = snapshot(&drive(m));
    for op in [
        "matmul",
        "attention",
        "moe",
        "router",
        "hc_post_mix_pre_norm",
        "hc_post_add",
        "norm_rope_pair",
        "norm_rope_pair_store",
        "rope_qat_hadamard_fp4",
        "rms_norm_matmul",
        "rope_matmul_grouped",
        "compressor_pair",
        "swiglu_matmul",
        "argmax",
        "logit_band",
    ] {
        assert!(stats.get(op).is_some_and(|s| s.calls > 0), "{op} never ran");
    }
    for (op, s) in &stats {
        assert_eq!(s.max_rel, 0.0, "{op}");
        assert_eq!(s.nan, 0, "{op}");
        assert_eq!(s.int_mismatches, 0, "{op}");
    }
}

#[test]
fn a_candidate_wrong_at_one_op_is_named_at_that_op() {
    let skewed = Skewed {
        inner: CpuBackend::new(1).unwrap(),
    };
    let m = Mirror::new(CpuBackend::new(1).unwrap(), skewed);
    let stats = snapshot(&drive(m));
    // The shared expert's SwiGLU runs inside the mirrored `swiglu_matmul` op: the skew
    // (half the activation's magnitude on one value) reaches its output through the down
    // projection, diluted but far above every tolerance.
    let sw = &stats["swiglu_matmul"];
    assert!(sw.calls > 0);
    assert!(sw.max_rel >= 0.05, "swiglu error {} not caught", sw.max_rel);
    // The mirror resyncs the candidate after every op, so the error stays where it was made.
    for (op, s) in stats.iter().filter(|(op, _)| **op != "swiglu_matmul") {
        assert_eq!(s.max_rel, 0.0, "{op}");
        assert_eq!(s.int_mismatches, 0, "{op}");
    }
}

/// The CPU backend with one deliberate bug: `swiglu` shifts its first output by half the
/// output's magnitude (at least 0.5).
struct Skewed {
    inner: CpuBackend,
}

impl Forward for Skewed {
    fn inner(&self) -> &dyn Backend {
        &self.inner
    }
    fn inner_mut(&mut self) -> &mut dyn Backend {
        &mut self.inner
    }
    fn name(&self) -> String {
        format!("skewed {}", self.inner.name())
    }
    fn swiglu(&mut self, gate: Slice, up: Slice, clamp: f32, out: Slice) -> BResult<()> {
        self.inner.swiglu(gate, up, clamp, out)?;
        let mut v = vec![0f32; out.len];
        self.inner.download(out, &mut v)?;
        let mag = v.iter().fold(1f32, |m, x| m.max(x.abs()));
        v[0] += 0.5 * mag;
        self.inner.upload(out, &v)
    }
}
