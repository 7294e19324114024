//! The weight load pipeline on the HIP layer over the fake runtime: staging buffers far
//! smaller than the tensors (so every tensor spans several chunks and chunk boundaries
//! fall mid-tensor), several reader threads, device and host-visible destinations, file
//! and `WeightSource` inputs. The fake runs no kernels, so the check is byte equality of
//! every tensor read back from its buffer with the file's (or the source's) bytes.

mod common;

use common::{machine, model_file};
use std::sync::Arc;

use ds4_engine::backend::WeightUse;
use ds4_engine::{Backend, Engine, EngineConfig};
use ds4_gguf::{GgmlType, GgufFile};
use ds4_gpu::backend::{GpuBackend, GpuOptions, HipBackend, Knobs, LoadConfig, WeightSource};
use ds4_gpu::hip::device::HipSettings;
use ds4_gpu::hip::fake::{FakeHip, Faults};
use ds4_gpu::KernelCache;
use ds4_placement::{MachineFacts, MemChoice, MemKind};

fn backend(
    fake: &Arc<FakeHip>,
    m: &MachineFacts,
    weights: MemChoice,
    source: Option<Arc<dyn WeightSource>>,
) -> HipBackend {
    let settings = HipSettings {
        weights,
        ..HipSettings::default()
    };
    let dev = fake.device(m, settings);
    let opts = GpuOptions {
        cache: KernelCache::disabled(),
        knobs: Knobs {
            cublas: None,
            ..Knobs::quality()
        },
        pread_load: true,
        source,
        ..GpuOptions::default()
    };
    GpuBackend::with_device(dev, opts, None).unwrap()
}

/// Every matrix/table tensor of the file (vectors take the f32 path, not the pipeline).
fn tensor_list(file: &GgufFile) -> Vec<(String, WeightUse)> {
    file.header()
        .tensors
        .iter()
        .filter(|t| t.dims.iter().skip(1).any(|&d| d > 1))
        .map(|t| {
            let usage = if t.ty == GgmlType::I32 {
                WeightUse::Table
            } else {
                WeightUse::Matrix
            };
            (t.name.clone(), usage)
        })
        .collect()
}

/// A configuration whose chunks are not a divisor of any tensor's size.
/// Every tensor of `list` reads back from `be` exactly as `want(name)`.
fn assert_read_back(
    be: &HipBackend,
    list: &[(String, WeightUse)],
    from: &str,
    want: impl Fn(&str) -> Vec<u8>,
) {
    for (name, _) in list {
        assert!(
            be.weight_bytes(name).unwrap().unwrap() == want(name),
            "{name}: bytes differ from the {from}'s"
        );
    }
}

fn tiny_ring(threads: usize) -> LoadConfig {
    LoadConfig {
        threads,
        buffers: 3,
        buffer_bytes: 1000,
    }
}

#[test]
fn device_weights_arrive_byte_exact_through_small_staging_buffers() {
    let dir = tempfile::tempdir().unwrap();
    let file = model_file(dir.path());
    let m = machine("strix-halo-stock");
    let fake = FakeHip::for_machine(&m, Faults::default());
    let mut be = backend(&fake, &m, MemChoice::Device, None);
    be.set_load_config(tiny_ring(3));
    let list = tensor_list(&file);
    // Many tensors must span several chunks for the test to mean anything.
    let multi = list
        .iter()
        .filter(|(n, _)| file.tensor_bytes(n).unwrap().1.len() > 3000)
        .count();
    assert!(multi > 10, "only {multi} tensors span several chunks");
    let weights = be.load_weights(&file, &list).unwrap();
    assert_eq!(weights.len(), list.len());
    for ((name, _), w) in list.iter().zip(&weights) {
        let want = file.tensor_bytes(name).unwrap().1;
        assert_eq!(be.weight_kind(name), Some(MemKind::Device), "{name}");
        assert_eq!(
            w.info.dims[0] as u64,
            file.header().tensor(name).unwrap().dims[0]
        );
        let got = be.weight_bytes(name).unwrap().unwrap();
        assert!(got == want, "{name}: bytes differ from the file's");
    }
    // Device destinations went through staging: no tensor was written in one copy.
    let copies = fake.htod_copies() as usize;
    let chunks: usize = list
        .iter()
        .map(|(n, _)| file.tensor_bytes(n).unwrap().1.len().div_ceil(1000))
        .sum();
    assert!(copies >= chunks, "{copies} copies for {chunks} chunks");
    // Besides the backend's small per-token staging (a size of its own).
    let per_token = format!("hipHostMalloc {}", ds4_gpu::backend::HOST_IO_BYTES);
    let staging = fake
        .calls()
        .iter()
        .filter(|c| c.starts_with("hipHostMalloc") && **c != per_token)
        .count();
    assert_eq!(staging, 1, "one pinned staging ring");
}

#[test]
fn host_weights_are_read_in_place_byte_exact() {
    let dir = tempfile::tempdir().unwrap();
    let file = model_file(dir.path());
    let m = machine("strix-halo-stock");
    let fake = FakeHip::for_machine(&m, Faults::default());
    let mut be = backend(&fake, &m, MemChoice::Auto, None);
    be.set_load_config(tiny_ring(4));
    let list = tensor_list(&file);
    be.load_weights(&file, &list).unwrap();
    for (name, _) in &list {
        assert_eq!(be.weight_kind(name), Some(MemKind::PinnedHost), "{name}");
    }
    assert_read_back(&be, &list, "file", |n| {
        file.tensor_bytes(n).unwrap().1.to_vec()
    });
}

/// Bytes that depend on the tensor name and position, so a misplaced chunk shows.
struct Pattern;

impl WeightSource for Pattern {
    fn fill(&self, name: &str, out: &mut [u8]) -> Result<(), String> {
        let seed = name
            .bytes()
            .fold(17u32, |h, b| h.wrapping_mul(31) ^ u32::from(b));
        for (i, o) in out.iter_mut().enumerate() {
            *o = (seed.wrapping_add(i as u32).wrapping_mul(2654435761) >> 13) as u8;
        }
        Ok(())
    }
}

#[test]
fn a_weight_source_fills_device_weights_through_the_pipeline() {
    let dir = tempfile::tempdir().unwrap();
    let file = model_file(dir.path());
    let m = machine("strix-halo-stock");
    let fake = FakeHip::for_machine(&m, Faults::default());
    let mut be = backend(&fake, &m, MemChoice::Device, Some(Arc::new(Pattern)));
    be.set_load_config(tiny_ring(2));
    let list = tensor_list(&file);
    be.load_weights(&file, &list).unwrap();
    assert_read_back(&be, &list, "source", |n| {
        let mut want = vec![0u8; file.tensor_bytes(n).unwrap().1.len()];
        Pattern.fill(n, &mut want).unwrap();
        want
    });
}

/// A source that fills pieces of `granule` bytes (like rows of a generated tensor) and
/// refuses whole-tensor fills, recording the largest piece it was asked for.
struct Rows {
    granule: usize,
    largest: std::sync::atomic::AtomicUsize,
    calls: std::sync::atomic::AtomicUsize,
}

impl Rows {
    fn new(granule: usize) -> Rows {
        Rows {
            granule,
            largest: 0.into(),
            calls: 0.into(),
        }
    }
}

impl WeightSource for Rows {
    fn fill(&self, name: &str, _out: &mut [u8]) -> Result<(), String> {
        Err(format!(
            "{name}: whole-tensor fill asked of a piecewise source"
        ))
    }

    fn granule(&self, _name: &str) -> Option<usize> {
        Some(self.granule)
    }

    fn fill_range(&self, name: &str, start: usize, out: &mut [u8]) -> Result<(), String> {
        use std::sync::atomic::Ordering;
        if !start.is_multiple_of(self.granule) {
            return Err(format!("{name}: piece starts at {start}, off the granule"));
        }
        self.largest.fetch_max(out.len(), Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut whole = vec![0u8; start + out.len()];
        Pattern.fill(name, &mut whole)?;
        out.copy_from_slice(&whole[start..]);
        Ok(())
    }
}

/// A source with a granule is filled piecewise straight into the staging buffers (and
/// the host-visible destinations): no piece is larger than a staging buffer (or one
/// granule, when that is larger), so no reader stages a whole tensor on the heap.
#[test]
fn a_piecewise_source_is_filled_in_bounded_pieces() {
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().unwrap();
    let file = model_file(dir.path());
    let list = tensor_list(&file);
    let biggest = list
        .iter()
        .map(|(n, _)| file.tensor_bytes(n).unwrap().1.len())
        .max()
        .unwrap();
    // 48 does not divide the 1000-byte staging buffers; 1500 is larger than one.
    for (granule, choice) in [
        (48usize, MemChoice::Device),
        (1500, MemChoice::Device),
        (48, MemChoice::Auto),
    ] {
        let m = machine("strix-halo-stock");
        let fake = FakeHip::for_machine(&m, Faults::default());
        let src = Arc::new(Rows::new(granule));
        let mut be = backend(&fake, &m, choice, Some(src.clone()));
        be.set_load_config(tiny_ring(3));
        be.load_weights(&file, &list).unwrap();
        assert_read_back(&be, &list, "source", |n| {
            let mut want = vec![0u8; file.tensor_bytes(n).unwrap().1.len()];
            Pattern.fill(n, &mut want).unwrap();
            want
        });
        let largest = src.largest.load(Ordering::Relaxed);
        let bound = granule.max(1000 / granule * granule);
        assert!(
            largest <= bound && bound < biggest,
            "granule {granule}: largest piece {largest}, bound {bound}, tensor {biggest}"
        );
        assert!(src.calls.load(Ordering::Relaxed) > list.len());
    }
}

/// A source that fails on one tensor: the load stops with an error naming it.
struct Failing;

impl WeightSource for Failing {
    fn fill(&self, name: &str, out: &mut [u8]) -> Result<(), String> {
        if name == "blk.1.attn_q_b.weight" {
            return Err("generator refused".into());
        }
        Pattern.fill(name, out)
    }
}

#[test]
fn a_reader_error_names_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let file = model_file(dir.path());
    let m = machine("strix-halo-stock");
    let fake = FakeHip::for_machine(&m, Faults::default());
    let mut be = backend(&fake, &m, MemChoice::Device, Some(Arc::new(Failing)));
    be.set_load_config(tiny_ring(3));
    let e = be
        .load_weights(&file, &tensor_list(&file))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("blk.1.attn_q_b.weight") && e.contains("generator refused"),
        "{e}"
    );
}

#[test]
fn the_engine_loads_its_model_through_the_pipeline() {
    let dir = tempfile::tempdir().unwrap();
    let file = model_file(dir.path());
    let m = machine("strix-halo-stock");
    let fake = FakeHip::for_machine(&m, Faults::default());
    let mut be = backend(&fake, &m, MemChoice::Device, None);
    be.set_load_config(tiny_ring(3));
    let cfg = EngineConfig {
        mode: None,
        ctx: 256,
        prefill_chunk: 4,
    };
    let eng = Engine::load(file.clone(), Box::new(be), cfg).unwrap();
    assert!(eng.backend_name().starts_with("rocm"));
    drop(eng);
    assert!(fake.live().is_empty(), "{:?}", fake.live());
}
