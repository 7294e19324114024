//! The engine backend on the HIP layer over the fake runtime: a whole synthetic model
//! loads (weights through ds4's integrated-GPU chain, host-resident ones read with `pread`
//! from the file), every kernel is looked up, and ops launch with the same argument lists
//! as on CUDA. The fake runs no kernels; numerics are the CUDA backend's (same sources).

mod common;

use common::{machine, model_file};
use std::sync::Arc;

use ds4_engine::{Backend, Engine, EngineConfig};
use ds4_gpu::backend::{GpuBackend, GpuOptions, HipBackend};
use ds4_gpu::hip::device::HipSettings;
use ds4_gpu::hip::fake::{FakeHip, Faults};
use ds4_gpu::KernelCache;
use ds4_placement::{MachineFacts, MemKind};

fn backend(fake: &Arc<FakeHip>, m: &MachineFacts, dir: &std::path::Path) -> HipBackend {
    let dev = fake.device(m, HipSettings::default());
    let opts = GpuOptions {
        cache: KernelCache::at(dir.join("kernels")),
        cublas: None,
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
        cublas: None,
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
    assert!(!fake.calls().iter().any(|c| c.starts_with("hipHostMalloc")));
}
