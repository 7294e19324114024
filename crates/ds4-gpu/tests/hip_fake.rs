//! The HIP allocation and policy layer against the fake runtime: Strix Halo stock
//! (~62 GiB pool) and raised-GTT (124 GiB) profiles from `ds4-placement/machines`, a
//! discrete card, and injected faults (hipHostMalloc failing, managed memory missing as
//! on Windows, hipMemGetInfo failing, host memory unreadable).

#[path = "../../ds4-placement/tests/common/mod.rs"]
mod common;

use std::sync::Arc;

use ds4_gpu::api::{DeviceBuffer, GpuApi};
use ds4_gpu::hip::device::{HipSettings, KernelCompiler};
use ds4_gpu::hip::fake::{FakeCompiler, FakeHip, Faults};
use ds4_gpu::hip::HipDevice;
use ds4_gpu::GpuError;
use ds4_placement::{plan, MachineFacts, MemChoice, MemKind, Policy, WeightsMode};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn machine(name: &str) -> MachineFacts {
    let path = format!(
        "{}/../ds4-placement/machines/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap();
    MachineFacts::from_json(&text).unwrap()
}

fn setup(name: &str, faults: Faults, settings: HipSettings) -> (Arc<FakeHip>, HipDevice) {
    let m = machine(name);
    let fake = FakeHip::for_machine(&m, faults);
    let dev = fake.device(&m, settings);
    (fake, dev)
}

fn env_settings(pairs: &[(&str, &str)]) -> HipSettings {
    let pairs: Vec<(String, String)> = pairs
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    HipSettings::from_env(move |k| pairs.iter().find(|(a, _)| a == k).map(|(_, b)| b.clone()))
        .unwrap()
}

/// Flash q2's resident size (80.76 GiB) as ds4's spans: 528 MiB expert stacks.
fn load_flash_q2(dev: &HipDevice) -> Result<Vec<ds4_gpu::hip::HipBuffer>, GpuError> {
    let mut out = Vec::new();
    let span = 528 * MIB as usize;
    let n = (80.76 * GIB as f64 / span as f64).ceil() as usize;
    for _ in 0..n {
        out.push(dev.alloc_weights(span)?);
    }
    Ok(out)
}

#[test]
fn stock_strix_halo_weights_go_to_pinned_host_past_the_62_gib_pool() {
    let (fake, dev) = setup(
        "strix-halo-stock",
        Faults::default(),
        HipSettings::default(),
    );
    let bufs = load_flash_q2(&dev).expect("80.76 GiB must load on a stock Strix Halo");
    assert!(bufs.iter().all(|b| b.kind() == MemKind::PinnedHost));
    let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
    assert!(total > 80 * GIB && total < 82 * GIB);
    assert!(dev.alloc_stats().fallbacks.is_empty());
    assert!(fake.calls().iter().all(|c| c.starts_with("hipHostMalloc")));
    // mem-get-info clamp: the pool still reports 61.5 GiB free, but only ~38 GiB of host
    // memory is left to pin.
    let (free, total_pool) = dev.mem_info().unwrap();
    assert_eq!(total_pool, 62 * GIB);
    assert_eq!(free, fake.usable_host());
    assert!(free < 40 * GIB);
    drop(bufs);
    assert!(
        fake.live().is_empty(),
        "everything freed: {:?}",
        fake.live()
    );
    assert_eq!(dev.mem_info().unwrap().0, 61 * GIB + GIB / 2);
}

#[test]
fn forced_device_memory_reproduces_the_stock_oom_and_works_with_raised_gtt() {
    let force = env_settings(&[("DS4_ROCM_FORCE_DEVICE_MEM", "1")]);
    assert_eq!(force.weights, MemChoice::Device);
    let (fake, dev) = setup("strix-halo-stock", Faults::default(), force.clone());
    assert_eq!(dev.weights_chain(), vec![(MemKind::Device, false)]);
    let e = load_flash_q2(&dev).unwrap_err().to_string();
    assert!(
        e.contains("hipMalloc") && e.contains("hipErrorOutOfMemory"),
        "{e}"
    );
    assert!(fake.live().is_empty(), "partial load freed");
    assert!(!fake.calls().iter().any(|c| c.starts_with("hipHostMalloc")));

    let (_fake, dev) = setup("strix-halo-gtt124", Faults::default(), force);
    let bufs = load_flash_q2(&dev).unwrap();
    assert!(bufs.iter().all(|b| b.kind() == MemKind::Device));
}

#[test]
fn raised_gtt_still_uses_pinned_host_by_default() {
    let (_fake, dev) = setup(
        "strix-halo-gtt124",
        Faults::default(),
        HipSettings::default(),
    );
    let bufs = load_flash_q2(&dev).unwrap();
    assert!(bufs.iter().all(|b| b.kind() == MemKind::PinnedHost));
}

#[test]
fn host_malloc_failure_falls_back_to_managed_then_device() {
    let faults = Faults {
        host_malloc_fails: true,
        ..Faults::default()
    };
    let (fake, dev) = setup("strix-halo-stock", faults, HipSettings::default());
    let b = dev.alloc_weights(528 * MIB as usize).unwrap();
    assert_eq!(b.kind(), MemKind::Managed);
    let calls = fake.calls();
    assert_eq!(
        calls[0],
        format!("hipHostMalloc {} -> out of memory", 528 * MIB)
    );
    assert_eq!(calls[1], format!("hipMallocManaged {}", 528 * MIB));
    let notes = dev.alloc_stats().fallbacks;
    assert_eq!(notes.len(), 1);
    assert!(
        notes[0].contains("managed memory after: pinned host: hipHostMalloc failed"),
        "{}",
        notes[0]
    );

    // Windows-like: no managed memory either → the device pool (raw hipMalloc).
    let faults = Faults {
        host_malloc_fails: true,
        managed_unsupported: true,
        ..Faults::default()
    };
    let (_fake, dev) = setup("strix-halo-stock", faults.clone(), HipSettings::default());
    let b = dev.alloc_weights(528 * MIB as usize).unwrap();
    assert_eq!(b.kind(), MemKind::Device);
    assert!(dev.alloc_stats().fallbacks[0].contains("managed"));
    // ... and the whole model then hits the 62 GiB pool, with every step named.
    let (fake, dev) = setup("strix-halo-stock", faults, HipSettings::default());
    let e = load_flash_q2(&dev).unwrap_err().to_string();
    assert!(
        e.contains("hipHostMalloc")
            && e.contains("managed memory is not supported")
            && e.contains("hipMalloc"),
        "{e}"
    );
    drop(dev);
    assert!(fake.live().is_empty());
}

#[test]
fn admission_refuses_what_would_eat_the_os_reserve() {
    let (fake, dev) = setup(
        "strix-halo-stock",
        Faults::default(),
        HipSettings::default(),
    );
    let usable = fake.usable_host();
    assert_eq!(usable, 121 * GIB - 64 * MIB);
    // Exactly usable − 2 GiB is admitted, one byte more is not.
    assert!(dev.admit(MemKind::PinnedHost, usable - 2 * GIB).is_ok());
    let e = dev
        .admit(MemKind::PinnedHost, usable - 2 * GIB + 1)
        .unwrap_err();
    assert!(matches!(e, GpuError::NotAdmitted { .. }), "{e}");
    assert!(e.to_string().contains("2.00 GiB OS reserve"), "{e}");
    // Integrated: device allocations are admission-checked too; discrete: never.
    assert!(dev.admit(MemKind::Device, usable).is_err());
    let (_f, discrete) = setup(
        "discrete-24g-64g",
        Faults::default(),
        HipSettings::default(),
    );
    assert!(discrete.admit(MemKind::Device, 1 << 50).is_ok());
    assert!(discrete.admit(MemKind::PinnedHost, 1 << 50).is_err());
    // A bigger reserve from DS4_OS_RESERVE_GIB.
    let s = env_settings(&[("DS4_OS_RESERVE_GIB", "110")]);
    let (_f, dev) = setup("strix-halo-stock", Faults::default(), s);
    assert!(dev.admit(MemKind::PinnedHost, 20 * GIB).is_err());
}

#[test]
fn admission_near_full_host_moves_weights_to_the_device_pool() {
    // Pin until the host is nearly full: the seed's last step is the raw hipMalloc.
    let (fake, dev) = setup(
        "strix-halo-gtt124",
        Faults::default(),
        HipSettings::default(),
    );
    let mut held = Vec::new();
    while fake.usable_host() > 3 * GIB {
        held.push(dev.alloc_weights(GIB as usize / 2).unwrap());
    }
    let b = dev.alloc_weights(GIB as usize).unwrap();
    assert_eq!(b.kind(), MemKind::Device, "{:?}", dev.alloc_stats());
    let note = dev.alloc_stats().fallbacks.pop().unwrap();
    assert!(note.contains("not admitted"), "{note}");
}

#[test]
fn unreadable_host_memory_refuses_host_allocations_and_mem_info() {
    let m = machine("strix-halo-stock");
    let fake = FakeHip::for_machine(&m, Faults::default());
    let info = fake.device(&m, HipSettings::default()).info().clone();
    let dev = HipDevice::with_calls(
        fake.clone(),
        Arc::new(FakeCompiler),
        info,
        "gfx1151".into(),
        1,
        Arc::new(|| Err("/proc/meminfo: permission denied".to_string())),
        HipSettings::default(),
    );
    let e = dev.admit(MemKind::PinnedHost, 1).unwrap_err().to_string();
    assert!(e.contains("cannot read usable host memory"), "{e}");
    assert!(dev.mem_info().is_err());
    // The seed still tries the device pool last.
    assert_eq!(dev.alloc_weights(4096).unwrap().kind(), MemKind::Device);
}

#[test]
fn mem_info_failure_is_an_error_not_a_guess() {
    let faults = Faults {
        mem_info_fails: true,
        ..Faults::default()
    };
    let (_f, dev) = setup("strix-halo-stock", faults, HipSettings::default());
    let e = dev.mem_info().unwrap_err().to_string();
    assert!(e.contains("hipMemGetInfo"), "{e}");
}

#[test]
fn discrete_cards_keep_weights_in_device_memory() {
    let (fake, dev) = setup(
        "discrete-24g-64g",
        Faults::default(),
        HipSettings::default(),
    );
    let b = dev.alloc_weights(GIB as usize).unwrap();
    assert_eq!(b.kind(), MemKind::Device);
    assert_eq!(fake.calls(), vec![format!("hipMalloc {}", GIB)]);
    // mem-get-info is not clamped on discrete devices.
    assert_eq!(dev.mem_info().unwrap().0, fake.mem_info_free());
}

#[test]
fn managed_scratch_with_ds4_cuda_managed() {
    let s = env_settings(&[("DS4_CUDA_MANAGED", "1")]);
    assert_eq!(s.scratch, MemChoice::Managed);
    let (_f, dev) = setup("strix-halo-carveout96", Faults::default(), s.clone());
    assert_eq!(dev.alloc_scratch(1 << 20).unwrap().kind(), MemKind::Managed);
    let (_f, dev) = setup(
        "strix-halo-stock",
        Faults::default(),
        HipSettings::default(),
    );
    assert_eq!(dev.alloc_scratch(1 << 20).unwrap().kind(), MemKind::Device);
    // Managed missing (Windows): device memory instead of failing.
    let faults = Faults {
        managed_unsupported: true,
        ..Faults::default()
    };
    let (_f, dev) = setup("strix-halo-stock", faults, s);
    assert_eq!(dev.alloc_scratch(1 << 20).unwrap().kind(), MemKind::Device);
    // A typo never silently does nothing (on/off words read as every switch's:
    // ds4_placement::parse_switch).
    let yes = HipSettings::from_env(|k| (k == "DS4_CUDA_MANAGED").then(|| "yes".to_string()));
    assert_eq!(yes.unwrap().scratch, MemChoice::Managed);
    let bad = HipSettings::from_env(|k| (k == "DS4_CUDA_MANAGED").then(|| "2".to_string()));
    assert!(bad.is_err());
}

#[test]
fn buffers_copy_fill_and_map_like_the_real_runtime() {
    let (fake, dev) = setup(
        "strix-halo-stock",
        Faults::default(),
        HipSettings::default(),
    );
    for kind in [
        MemKind::Device,
        MemKind::PinnedHost,
        MemKind::Managed,
        MemKind::HostRegistered,
    ] {
        let mut b = dev.alloc_raw(kind, 4096).unwrap();
        assert_eq!(b.kind(), kind);
        b.fill_u32(0xdead_beef).unwrap();
        let mut out = [0u8; 8];
        b.read(100, &mut out).unwrap();
        assert_eq!(out, [0xef, 0xbe, 0xad, 0xde, 0xef, 0xbe, 0xad, 0xde]);
        b.write(4090, &[1, 2, 3, 4, 5, 6]).unwrap();
        assert!(b.write(4091, &[0; 6]).is_err(), "out of bounds refused");
        match b.host_bytes_mut().unwrap() {
            Some(h) => {
                assert_ne!(kind, MemKind::Device);
                assert_eq!(&h[4090..], &[1, 2, 3, 4, 5, 6]);
            }
            None => assert_eq!(kind, MemKind::Device),
        }
    }
    assert!(dev.alloc_raw(MemKind::Pageable, 16).is_err());
    assert!(dev.alloc_raw(MemKind::Device, 0).is_err());
    assert!(fake.live().is_empty());
}

#[test]
fn registration_failure_is_reported_and_cleaned_up() {
    let faults = Faults {
        host_register_fails: true,
        ..Faults::default()
    };
    let (fake, dev) = setup("strix-halo-stock", faults, HipSettings::default());
    let e = dev
        .alloc_raw(MemKind::HostRegistered, 1 << 20)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("hipHostRegister") && e.contains("hipErrorNotSupported"),
        "{e}"
    );
    assert!(fake.live().is_empty());
}

/// The planner's plan for Flash q2 on the Strix Halo profiles, executed through the HIP
/// allocator: pinned-host arenas on stock, fallbacks re-admitted live when hipHostMalloc
/// fails, rollback when nothing fits.
#[test]
fn planner_plans_execute_on_the_fake_runtime() {
    let inv = common::flash(common::Quant::Q2);
    let req = common::request(4096, common::scratch_for(4096));
    for (name, faults, want) in [
        ("strix-halo-stock", Faults::default(), MemKind::PinnedHost),
        ("strix-halo-gtt124", Faults::default(), MemKind::PinnedHost),
        (
            "strix-halo-stock",
            Faults {
                host_malloc_fails: true,
                ..Faults::default()
            },
            MemKind::Managed,
        ),
    ] {
        let m = machine(name);
        let p = plan(&m.host, &m.device, &inv, &req, &Policy::default()).unwrap();
        assert_eq!(p.mode, WeightsMode::PinnedHost);
        let fake = FakeHip::for_machine(&m, faults);
        let dev = fake.device(&m, HipSettings::default());
        let mut arenas_only = p.clone();
        arenas_only.buffers.clear();
        let done = dev
            .execute_plan(&arenas_only)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(done.arenas.len(), p.arenas.len());
        assert!(done.actual.entries.iter().all(|e| e.used == want), "{name}");
        let bytes: u64 = done.arenas.iter().map(|a| a.len() as u64).sum();
        assert_eq!(bytes, p.weights_bytes());
        drop(done);
        assert!(fake.live().is_empty());
    }
    // Nothing but the device pool (host pinning and managed both broken) on stock: the
    // plan's device fallback runs out at ~61.5 GiB and everything is rolled back.
    let m = machine("strix-halo-stock");
    let p = plan(&m.host, &m.device, &inv, &req, &Policy::default()).unwrap();
    let fake = FakeHip::for_machine(
        &m,
        Faults {
            host_malloc_fails: true,
            managed_unsupported: true,
            ..Faults::default()
        },
    );
    let dev = fake.device(&m, HipSettings::default());
    let mut arenas_only = p.clone();
    arenas_only.buffers.clear();
    let Err(e) = dev.execute_plan(&arenas_only) else {
        panic!("must not fit");
    };
    assert!(
        e.freed > 0 && e.to_string().contains("hipErrorOutOfMemory"),
        "{e}"
    );
    assert!(fake.live().is_empty());
}

#[test]
fn modules_compile_once_then_come_from_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let cache = ds4_gpu::KernelCache::at(dir.path());
    let (fake, dev) = setup(
        "strix-halo-stock",
        Faults::default(),
        HipSettings::default(),
    );
    let m = dev
        .load_module(&ds4_gpu::kernels::OPS, &cache, &[])
        .unwrap();
    let f = dev.function(&m, "ds4_fill").unwrap();
    assert_eq!(f.name, "ds4_fill");
    let files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
    assert_eq!(files.len(), 1);
    let name = files[0].file_name().to_string_lossy().into_owned();
    assert!(
        name.contains("hip") && name.contains("gfx1151") && name.ends_with(".hsaco"),
        "{name}"
    );
    // A corrupt cached image is evicted and recompiled.
    std::fs::write(files[0].path(), b"garbage").unwrap();
    dev.load_module(&ds4_gpu::kernels::OPS, &cache, &[])
        .unwrap();
    assert!(std::fs::read(files[0].path()).unwrap().starts_with(b"FAKE"));
    let g = dev
        .load_module(&ds4_gpu::kernels::GEMV, &cache, &[])
        .unwrap();
    assert_eq!(
        dev.read_i32x2_global(&g, "ds4_gemv_config_q8_0").unwrap(),
        [2, 32]
    );
    assert_eq!(FakeCompiler.version().unwrap(), "fake");
    let _ = fake;
}
