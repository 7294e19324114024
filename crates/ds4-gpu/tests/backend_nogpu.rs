//! The CUDA engine backend on machines without CUDA (CI): construction fails with a clear
//! error instead of a panic, and the mirror's error metric treats NaN as a failure.

use ds4_gpu::backend::mirror::rel_err;
use ds4_gpu::backend::{CudaBackend, CudaOptions};
use ds4_gpu::cuda::CudaDevice;

#[test]
fn backend_refuses_cleanly_without_a_device() {
    if CudaDevice::count().is_ok_and(|n| n > 0) {
        // A real GPU: construction must then succeed.
        assert!(CudaBackend::new(CudaOptions::default()).is_ok());
        return;
    }
    let e = CudaBackend::new(CudaOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("CUDA"), "{e}");
}

#[test]
fn relative_error_fails_on_nan_and_scales_by_the_reference() {
    assert_eq!(rel_err(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
    assert!((rel_err(&[1.0, 2.1], &[1.0, 2.0]) - 0.05).abs() < 1e-6);
    assert!(rel_err(&[f32::NAN, 2.0], &[1.0, 2.0]).is_infinite());
    // NaN in the reference is not counted against the candidate.
    assert_eq!(rel_err(&[5.0, 2.0], &[f32::NAN, 2.0]), 0.0);
}
