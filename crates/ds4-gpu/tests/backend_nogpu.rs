//! The CUDA engine backend on machines without CUDA (CI): construction fails with a clear
//! error instead of a panic.

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
