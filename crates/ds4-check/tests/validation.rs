//! The shared op validation (`ds4_engine::validate`) seen from both backends: the same bad
//! calls are refused by the CPU backend and by the GPU backend (on the fake HIP runtime,
//! which runs no kernels but records launches) with the same error, and the GPU launches
//! nothing for a refused call. Two of the calls — an output in a disjoint range of its
//! input's buffer, a copy between two ranges of one buffer — were accepted by the GPU
//! before the aliasing rule was made one.

mod common;

use std::sync::Arc;

use common::{machine, model_file};
use ds4_cpu::CpuBackend;
use ds4_engine::backend::{BResult, Backend, BackendError, RouterArgs, Routing, Weight, WeightUse};
use ds4_gguf::GgufFile;
use ds4_gpu::backend::{GpuBackend, GpuOptions, Knobs};
use ds4_gpu::hip::device::HipSettings;
use ds4_gpu::hip::fake::{FakeHip, Faults};
use ds4_gpu::KernelCache;

struct Weights {
    matrix: Weight,
    norm: Weight,
}

fn weights<B: Backend>(be: &mut B, file: &Arc<GgufFile>) -> Weights {
    Weights {
        matrix: be
            .load_weight(file, "blk.0.attn_q_a.weight", WeightUse::Matrix)
            .unwrap(),
        norm: be
            .load_weight(file, "output_norm.weight", WeightUse::Vector)
            .unwrap(),
    }
}

/// A call every backend must accept (so the refusals below are not a backend refusing
/// everything): one matmul of the right shapes.
fn accepted<B: Backend>(be: &mut B, w: &Weights) -> BResult<()> {
    let (cols, rows) = (w.matrix.info.cols(), w.matrix.info.rows());
    let (x, y) = (be.alloc(cols)?, be.alloc(rows)?);
    be.matmul(w.matrix, 0, x.all(), 1, y.all())
}

/// Bad calls, each with the error it must get, in a fixed order (so buffer ids match
/// between backends).
fn refusals<B: Backend>(be: &mut B, w: &Weights) -> Vec<BackendError> {
    let (cols, rows) = (w.matrix.info.cols(), w.matrix.info.rows());
    let width = w.norm.info.n_elements();
    let big = be.alloc(4 * (cols + rows)).unwrap();
    let other = be.alloc(4 * (cols + rows)).unwrap();
    let toks = be.alloc_i32(2).unwrap();
    let ids = be.alloc_i32(4).unwrap();
    let calls: Vec<BResult<()>> = vec![
        // Too short an input.
        be.matmul(w.matrix, 0, big.slice(0, cols - 1), 1, other.all()),
        // The output in a disjoint range of the input's buffer.
        be.matmul(w.matrix, 0, big.slice(0, cols), 1, big.slice(cols, rows)),
        // A matrix index past the weight's matrices.
        be.matmul(w.matrix, 1, big.slice(0, cols), 1, other.all()),
        // A norm weight of the wrong length.
        be.rms_norm(big.all(), Some(w.norm), 2, width / 2, 1e-6, other.all()),
        // In place is allowed only exactly: a shifted output is refused.
        be.rms_norm(big.slice(0, 8), None, 1, 8, 1e-6, big.slice(1, 8)),
        be.add(big.slice(0, 8), other.slice(0, 9)),
        be.swiglu(big.slice(0, 8), other.slice(0, 8), 10.0, big.slice(8, 8)),
        be.copy(big.slice(0, 8), big.slice(8, 8)),
        be.fill(big.slice(4 * (cols + rows) - 2, 4), 0.0),
        be.qat_fp8(big.slice(0, 64), 1, 32, 64),
        // A hash-routing table that is not an integer table.
        be.router(
            big.slice(0, 16),
            Routing::Hash {
                table: w.matrix,
                tokens: toks,
            },
            RouterArgs {
                n_tok: 2,
                n_expert: 8,
                k: 2,
                scale: 1.0,
                row0: 0,
            },
            ids,
            other.slice(0, 4),
        ),
        be.embed(w.matrix, toks, 3, 1, other.all()),
    ];
    calls
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            r.err()
                .unwrap_or_else(|| panic!("bad call #{i} was accepted"))
        })
        .collect()
}

#[test]
fn both_backends_refuse_the_same_bad_calls_with_the_same_errors() {
    let dir = tempfile::tempdir().unwrap();
    let file = model_file(dir.path());

    let mut cpu = CpuBackend::new(1).unwrap();
    let cw = weights(&mut cpu, &file);
    let cpu_errors = refusals(&mut cpu, &cw);
    accepted(&mut cpu, &cw).unwrap();

    let m = machine("strix-halo-stock");
    let fake = FakeHip::for_machine(&m, Faults::default());
    let opts = GpuOptions {
        cache: KernelCache::at(dir.path().join("kernels")),
        knobs: Knobs {
            cublas: None,
            ..Knobs::quality()
        },
        pread_load: true,
        ..GpuOptions::default()
    };
    let mut gpu =
        GpuBackend::with_device(fake.device(&m, HipSettings::default()), opts, None).unwrap();
    let gw = weights(&mut gpu, &file);
    let before = fake.launches().len();
    let gpu_errors = refusals(&mut gpu, &gw);
    assert_eq!(fake.launches().len(), before, "a refused call launched");
    accepted(&mut gpu, &gw).unwrap();
    assert!(
        fake.launches().len() > before,
        "the accepted matmul launched nothing"
    );

    assert_eq!(cpu_errors, gpu_errors);
    let (cols, rows) = (cw.matrix.info.cols(), cw.matrix.info.rows());
    let kinds: Vec<String> = cpu_errors.iter().map(|e| e.to_string()).collect();
    assert_eq!(
        kinds[0],
        format!("matmul: input length is {}, expected {cols}", cols - 1)
    );
    assert_eq!(
        kinds[1],
        "matmul: an output shares buffer #0 with another operand of the op"
    );
    assert!(kinds[2].contains("matrix 1 of 1"), "{}", kinds[2]);
    assert!(
        kinds[3].starts_with("rms_norm: weight length is"),
        "{}",
        kinds[3]
    );
    assert!(matches!(
        cpu_errors[4],
        BackendError::Aliasing { op: "rms_norm", .. }
    ));
    assert_eq!(kinds[5], "add: input length is 9, expected 8");
    assert!(matches!(
        cpu_errors[6],
        BackendError::Aliasing { op: "swiglu", .. }
    ));
    assert!(matches!(
        cpu_errors[7],
        BackendError::Aliasing { op: "copy", .. }
    ));
    let len = 4 * (cols + rows);
    assert!(
        matches!(cpu_errors[8], BackendError::OutOfRange { op: "fill", len: l, .. } if l == len)
    );
    assert!(matches!(
        cpu_errors[9],
        BackendError::Invalid { op: "qat_fp8", .. }
    ));
    assert!(matches!(
        cpu_errors[10],
        BackendError::UnsupportedType { op: "router", .. }
    ));
    assert_eq!(kinds[11], "embed: token count is 2, expected 3");
}
