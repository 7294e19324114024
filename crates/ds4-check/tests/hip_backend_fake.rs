//! The engine backend on the HIP layer over the fake runtime: a whole synthetic model
//! loads (weights through ds4's integrated-GPU chain, host-resident ones read with `pread`
//! from the file), every kernel is looked up, and ops launch with the same argument lists
//! as on CUDA. The fake runs no kernels; numerics are the CUDA backend's (same sources).

mod common;

use common::{machine, model_file, model_file_with};
use std::sync::Arc;

use ds4_engine::{Backend, Engine, EngineConfig};
use ds4_gpu::backend::{GpuBackend, GpuOptions, HipBackend, Knobs};
use ds4_gpu::hip::device::HipSettings;
use ds4_gpu::hip::fake::{FakeHip, Faults};
use ds4_gpu::KernelCache;
use ds4_placement::{MachineFacts, MemKind};

fn backend(fake: &Arc<FakeHip>, m: &MachineFacts, dir: &std::path::Path) -> HipBackend {
    let dev = fake.device(m, HipSettings::default());
    let opts = GpuOptions {
        cache: KernelCache::at(dir.join("kernels")),
        knobs: Knobs {
            cublas: None,
            ..Knobs::quality()
        },
        pread_load: true,
        ..GpuOptions::default()
    };
    GpuBackend::with_device(dev, opts, None).unwrap()
}

#[test]
fn a_model_loads_into_pinned_host_on_stock_strix_halo() {
    let dir = tempfile::tempdir().unwrap();
    let file = model_file(dir.path());
    let m = machine("strix-halo-stock");
    let fake = FakeHip::for_machine(&m, Faults::default());
    let be = backend(&fake, &m, dir.path());
    assert!(
        be.name().starts_with("rocm (AMD Radeon 8060S"),
        "{}",
        be.name()
    );
    let cfg = EngineConfig {
        mode: None,
        ctx: 256,
        prefill_chunk: 4,
    };
    let eng = Engine::load(file.clone(), Box::new(be), cfg).unwrap();
    drop(eng);
    let calls = fake.calls();
    assert!(
        calls.iter().any(|c| c.starts_with("hipHostMalloc")),
        "{calls:?}"
    );
    // Everything was freed when the engine dropped.
    assert!(fake.live().is_empty(), "{:?}", fake.live());
}

#[test]
fn weights_are_the_file_bytes_and_ops_launch_like_cuda() {
    let dir = tempfile::tempdir().unwrap();
    let file = model_file(dir.path());
    let m = machine("strix-halo-stock");
    let fake = FakeHip::for_machine(&m, Faults::default());
    let mut be = backend(&fake, &m, dir.path());
    let name = "blk.0.attn_q_a.weight";
    let w = be
        .load_weight(&file, name, ds4_engine::backend::WeightUse::Matrix)
        .unwrap();
    assert_eq!(be.weight_kind(name), Some(MemKind::PinnedHost));
    let want = file.tensor_bytes(name).unwrap().1.to_vec();
    assert_eq!(be.loaded_bytes().pinned_host, want.len() as u64);
    assert_eq!(be.weight_bytes(name).unwrap().unwrap(), want, "pread bytes");
    // Launch a matmul at batch 1 (GEMV) and an elementwise op; the fake records them.
    let n_in = w.info.dims[0];
    let n_out = w.info.dims[1];
    let x = be.alloc(n_in).unwrap();
    let y = be.alloc(n_out).unwrap();
    be.matmul(w, 0, x.all(), 1, y.all()).unwrap();
    be.fill(y.all(), 1.0).unwrap();
    let launches = fake.launches();
    let kinds: Vec<&str> = launches.iter().map(|l| l.0.as_str()).collect();
    assert!(
        kinds.iter().any(|k| k.starts_with("ds4_gemv_")),
        "{kinds:?}"
    );
    assert!(kinds.contains(&"ds4_fill"), "{kinds:?}");
    let gemv = launches
        .iter()
        .find(|l| l.0.starts_with("ds4_gemv_"))
        .unwrap();
    assert_eq!(gemv.3, 6, "ds4_gemv_<t>(W, x, y, n_in, n_out, wpr)");
    let fill = launches.iter().find(|l| l.0 == "ds4_fill").unwrap();
    assert_eq!((fill.2, fill.3), (256, 3));
}

#[test]
fn forced_device_memory_loads_through_hipmalloc() {
    let dir = tempfile::tempdir().unwrap();
    let file = model_file(dir.path());
    let m = machine("strix-halo-stock");
    let fake = FakeHip::for_machine(&m, Faults::default());
    let settings = HipSettings {
        weights: ds4_placement::MemChoice::Device,
        ..HipSettings::default()
    };
    let dev = fake.device(&m, settings);
    let opts = GpuOptions {
        cache: KernelCache::disabled(),
        knobs: Knobs {
            cublas: None,
            ..Knobs::quality()
        },
        pread_load: true,
        ..GpuOptions::default()
    };
    let mut be = GpuBackend::with_device(dev, opts, None).unwrap();
    let name = "blk.0.attn_q_a.weight";
    be.load_weight(&file, name, ds4_engine::backend::WeightUse::Matrix)
        .unwrap();
    assert_eq!(be.weight_kind(name), Some(MemKind::Device));
    let want = file.tensor_bytes(name).unwrap().1.to_vec();
    assert_eq!(
        be.weight_bytes(name).unwrap().unwrap(),
        want,
        "staged bytes"
    );
    // No weight went to pinned host memory; the backend's own per-token staging does.
    let staging = format!("hipHostMalloc {}", ds4_gpu::backend::HOST_IO_BYTES);
    let calls = fake.calls();
    assert!(
        !calls
            .iter()
            .any(|c| c.starts_with("hipHostMalloc") && *c != staging),
        "{calls:?}"
    );
}

/// A model loaded on the fake runtime, with a state that has seen a short prompt. Q4_K
/// experts, so that a one-token MoE takes the grouped GEMV as at full size (the
/// per-expert fallback reads the expert ids back: a wait of its own).
fn decoding_engine(dir: &std::path::Path) -> (Arc<FakeHip>, Engine, ds4_engine::KvState) {
    let file = model_file_with(dir, ds4_model::layout::TypeRecipe::Q4);
    let m = machine("strix-halo-stock");
    let fake = FakeHip::for_machine(&m, Faults::default());
    let be = backend(&fake, &m, dir);
    let cfg = EngineConfig {
        mode: None,
        ctx: 256,
        prefill_chunk: 4,
    };
    let mut eng = Engine::load(file, Box::new(be), cfg).unwrap();
    let mut st = eng.new_state().unwrap();
    eng.eval_argmax(&mut st, &[1, 2, 3, 4, 5]).unwrap();
    (fake, eng, st)
}

/// Issue 16: a greedy decode step waits for the device once (the argmax read-back, which
/// also brings the fault word back); the token id goes up through a queued copy. Checked
/// both in the backend's counters and in the runtime calls that make the host wait.
#[test]
fn a_decode_step_waits_for_the_device_once() {
    let dir = tempfile::tempdir().unwrap();
    let (fake, mut eng, mut st) = decoding_engine(dir.path());
    let steps = 12u64;
    let c0 = eng.backend_mut().counters();
    let (w0, a0) = (fake.host_waits(), fake.async_copies());
    let mut next = 0u32;
    for _ in 0..steps {
        next = eng.eval_argmax(&mut st, &[next]).unwrap();
    }
    let c1 = eng.backend_mut().counters();
    assert_eq!(c1.syncs - c0.syncs, steps, "backend syncs per step");
    assert_eq!(fake.host_waits() - w0, steps, "runtime host waits per step");
    // Per step: the token-id upload and the fault word's copy, both queued.
    assert_eq!(fake.async_copies() - a0, 2 * steps);
    assert!(c1.launches - c0.launches >= steps * 10, "{c0:?} {c1:?}");
    // The time blocked in those waits is counted too (a device still busy for 3 ms).
    fake.set_wait_delay(Some(std::time::Duration::from_millis(3)));
    let t = std::time::Instant::now();
    for _ in 0..4 {
        next = eng.eval_argmax(&mut st, &[next]).unwrap();
    }
    let wall_ns = t.elapsed().as_nanos() as u64;
    fake.set_wait_delay(None);
    let waited = eng.backend_mut().counters().wait_ns - c1.wait_ns;
    assert!(
        (12_000_000..=wall_ns).contains(&waited),
        "waited {waited} ns of {wall_ns}"
    );
}

/// A fault a kernel reports during a decode step (here the embedding's "token id outside
/// the table") fails that very step, although its check now costs no wait of its own; the
/// word is cleared, so the next step runs again.
#[test]
fn a_kernel_fault_still_fails_its_decode_step() {
    let dir = tempfile::tempdir().unwrap();
    let (fake, mut eng, mut st) = decoding_engine(dir.path());
    eng.eval_argmax(&mut st, &[7]).unwrap();
    // ds4_embed(table, type, row_bytes, vocab, ids, streams, width, out, fault).
    fake.set_kernel_fault(Some(("ds4_embed", 8, 1)));
    let w0 = fake.host_waits();
    let e = eng.eval_argmax(&mut st, &[7]).unwrap_err().to_string();
    assert!(e.contains("a token id outside the embedding"), "{e}");
    // Still one wait for the step (plus none for the check itself); the error path's
    // clearing of the device word is a queued fill.
    assert_eq!(fake.host_waits() - w0, 1);
    fake.set_kernel_fault(None);
    let mut st2 = eng.new_state().unwrap();
    eng.eval_argmax(&mut st2, &[1, 2]).unwrap();
    eng.eval_argmax(&mut st2, &[3]).unwrap();
}

/// Uploads between waits reuse the pinned ring only after a wait: with more uploads than
/// slots and no read-back, the backend waits before overwriting a slot, and every upload
/// lands.
#[test]
fn the_upload_ring_waits_before_reusing_a_slot() {
    let dir = tempfile::tempdir().unwrap();
    let m = machine("strix-halo-stock");
    let fake = FakeHip::for_machine(&m, Faults::default());
    let mut be = backend(&fake, &m, dir.path());
    let buf = be.alloc_i32(64).unwrap();
    let c0 = be.counters();
    for i in 0..10 {
        be.upload_i32(buf, i, &[100 + i as i32]).unwrap();
    }
    let c1 = be.counters();
    // Four slots: uploads 5 and 9 each found the ring full and waited first.
    assert_eq!(c1.syncs - c0.syncs, 2);
    let mut back = [0i32; 10];
    be.download_i32(buf, 0, &mut back).unwrap();
    let want: Vec<i32> = (100..110).collect();
    assert_eq!(back.to_vec(), want);
    // A larger upload than a slot takes the waiting path, and lands too.
    let big: Vec<i32> = (0..2000).collect();
    let buf2 = be.alloc_i32(2000).unwrap();
    be.upload_i32(buf2, 0, &big).unwrap();
    let mut back2 = vec![0i32; 2000];
    be.download_i32(buf2, 0, &mut back2).unwrap();
    assert_eq!(back2, big);
}

/// Without pinned memory (hipHostMalloc refused) the backend falls back to waiting copies
/// and its own fault read: more waits per step, the same results and the same errors.
#[test]
fn without_pinned_memory_decode_falls_back_to_waiting_copies() {
    let dir = tempfile::tempdir().unwrap();
    let file = model_file_with(dir.path(), ds4_model::layout::TypeRecipe::Q4);
    let m = machine("strix-halo-stock");
    let faults = Faults {
        host_malloc_fails: true,
        ..Faults::default()
    };
    let fake = FakeHip::for_machine(&m, faults);
    let be = backend(&fake, &m, dir.path());
    let cfg = EngineConfig {
        mode: None,
        ctx: 256,
        prefill_chunk: 4,
    };
    let mut eng = Engine::load(file, Box::new(be), cfg).unwrap();
    let mut st = eng.new_state().unwrap();
    eng.eval_argmax(&mut st, &[1, 2, 3]).unwrap();
    let (c0, a0) = (eng.backend_mut().counters(), fake.async_copies());
    eng.eval_argmax(&mut st, &[4]).unwrap();
    let c1 = eng.backend_mut().counters();
    // Upload, read-back, fault read: three waits, nothing queued.
    assert_eq!(c1.syncs - c0.syncs, 3);
    assert_eq!(fake.async_copies(), a0);
    fake.set_kernel_fault(Some(("ds4_embed", 8, 1)));
    let e = eng.eval_argmax(&mut st, &[4]).unwrap_err().to_string();
    assert!(e.contains("a token id outside the embedding"), "{e}");
}
