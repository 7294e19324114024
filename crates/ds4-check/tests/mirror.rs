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
use ds4_engine::backend::{
    AttnArgs, BResult, Backend, Buf, CompressorArgs, HcArgs, IBuf, IndexerArgs, MoeArgs, RopeArgs,
    RouterArgs, Routing, Slice, Weight, WeightUse,
};
use ds4_engine::{Engine, EngineConfig, Logits};
use ds4_gguf::GgufFile;

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

impl ds4_engine::device::Device for Skewed {
    fn name(&self) -> String {
        format!("skewed {}", Backend::name(&self.inner))
    }
    fn alloc(&mut self, len: usize) -> BResult<Buf> {
        Backend::alloc(&mut self.inner, len)
    }
    fn alloc_i32(&mut self, len: usize) -> BResult<IBuf> {
        Backend::alloc_i32(&mut self.inner, len)
    }
    fn free(&mut self, buf: Buf) {
        Backend::free(&mut self.inner, buf)
    }
    fn free_i32(&mut self, buf: IBuf) {
        Backend::free_i32(&mut self.inner, buf)
    }
    fn upload(&mut self, dst: Slice, src: &[f32]) -> BResult<()> {
        Backend::upload(&mut self.inner, dst, src)
    }
    fn download(&mut self, src: Slice, dst: &mut [f32]) -> BResult<()> {
        Backend::download(&mut self.inner, src, dst)
    }
    fn upload_i32(&mut self, dst: IBuf, off: usize, src: &[i32]) -> BResult<()> {
        Backend::upload_i32(&mut self.inner, dst, off, src)
    }
    fn download_i32(&mut self, src: IBuf, off: usize, dst: &mut [i32]) -> BResult<()> {
        Backend::download_i32(&mut self.inner, src, off, dst)
    }
    fn copy(&mut self, src: Slice, dst: Slice) -> BResult<()> {
        Backend::copy(&mut self.inner, src, dst)
    }
    fn fill(&mut self, dst: Slice, value: f32) -> BResult<()> {
        Backend::fill(&mut self.inner, dst, value)
    }
    fn load_weight(
        &mut self,
        file: &Arc<GgufFile>,
        name: &str,
        usage: WeightUse,
    ) -> BResult<Weight> {
        Backend::load_weight(&mut self.inner, file, name, usage)
    }
    fn matmul(&mut self, w: Weight, mat: usize, x: Slice, n_tok: usize, y: Slice) -> BResult<()> {
        Backend::matmul(&mut self.inner, w, mat, x, n_tok, y)
    }
    fn matmul_grouped(
        &mut self,
        w: Weight,
        groups: usize,
        x: Slice,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()> {
        Backend::matmul_grouped(&mut self.inner, w, groups, x, n_tok, y)
    }
    fn rms_norm(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        rows: usize,
        width: usize,
        eps: f32,
        out: Slice,
    ) -> BResult<()> {
        Backend::rms_norm(&mut self.inner, x, w, rows, width, eps, out)
    }
    fn rope(&mut self, x: Slice, args: RopeArgs) -> BResult<()> {
        Backend::rope(&mut self.inner, x, args)
    }
    fn add(&mut self, acc: Slice, x: Slice) -> BResult<()> {
        Backend::add(&mut self.inner, acc, x)
    }
    fn swiglu(&mut self, gate: Slice, up: Slice, clamp: f32, out: Slice) -> BResult<()> {
        Backend::swiglu(&mut self.inner, gate, up, clamp, out)?;
        let mut v = vec![0f32; out.len];
        Backend::download(&mut self.inner, out, &mut v)?;
        let mag = v.iter().fold(1f32, |m, x| m.max(x.abs()));
        v[0] += 0.5 * mag;
        Backend::upload(&mut self.inner, out, &v)
    }
    fn qat_fp8(&mut self, x: Slice, rows: usize, width: usize, n_dims: usize) -> BResult<()> {
        Backend::qat_fp8(&mut self.inner, x, rows, width, n_dims)
    }
    fn qat_hadamard_fp4(&mut self, x: Slice, rows: usize, width: usize) -> BResult<()> {
        Backend::qat_hadamard_fp4(&mut self.inner, x, rows, width)
    }
    fn embed(
        &mut self,
        table: Weight,
        tokens: IBuf,
        n_tok: usize,
        n_streams: usize,
        out: Slice,
    ) -> BResult<()> {
        Backend::embed(&mut self.inner, table, tokens, n_tok, n_streams, out)
    }
    fn hc_pre(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        y: Slice,
        post: Slice,
        comb: Slice,
    ) -> BResult<()> {
        Backend::hc_pre(&mut self.inner, mix, x, base, scale, args, y, post, comb)
    }
    fn hc_post(
        &mut self,
        x: Slice,
        f: Slice,
        post: Slice,
        comb: Slice,
        args: HcArgs,
    ) -> BResult<()> {
        Backend::hc_post(&mut self.inner, x, f, post, comb, args)
    }
    fn hc_head(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        y: Slice,
    ) -> BResult<()> {
        Backend::hc_head(&mut self.inner, mix, x, base, scale, args, y)
    }
    fn compressor(
        &mut self,
        acc: Slice,
        u: Slice,
        z: Slice,
        ape: Weight,
        args: CompressorArgs,
        rows: Slice,
    ) -> BResult<()> {
        Backend::compressor(&mut self.inner, acc, u, z, ape, args, rows)
    }
    fn indexer_topk(
        &mut self,
        q: Slice,
        w: Slice,
        rows: Slice,
        args: IndexerArgs,
        out: IBuf,
    ) -> BResult<()> {
        Backend::indexer_topk(&mut self.inner, q, w, rows, args, out)
    }
    fn attention(&mut self, args: AttnArgs) -> BResult<()> {
        Backend::attention(&mut self.inner, args)
    }
    fn ring_store(
        &mut self,
        ring: Slice,
        kv: Slice,
        pos0: usize,
        n_tok: usize,
        window: usize,
    ) -> BResult<()> {
        Backend::ring_store(&mut self.inner, ring, kv, pos0, n_tok, window)
    }
    fn router(
        &mut self,
        logits: Slice,
        routing: Routing,
        args: RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()> {
        Backend::router(&mut self.inner, logits, routing, args, ids, weights)
    }
    fn moe(
        &mut self,
        x: Slice,
        ids: IBuf,
        weights: Slice,
        gate: Weight,
        up: Weight,
        down: Weight,
        args: MoeArgs,
        out: Slice,
    ) -> BResult<()> {
        Backend::moe(&mut self.inner, x, ids, weights, gate, up, down, args, out)
    }
}
