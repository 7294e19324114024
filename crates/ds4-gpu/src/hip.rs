//! ROCm/HIP groundwork: the HIP runtime and hiprtc loaded at run time with libloading.
//!
//! Search order for each library: `$ROCM_PATH/lib` (default `/opt/rocm/lib`), then the
//! system loader path. Nothing is linked at build time, so this builds everywhere.

use std::path::{Path, PathBuf};

use crate::error::{GpuError, Result};

/// Candidate paths for a ROCm library, in search order.
pub fn library_candidates(rocm_path: Option<&Path>, stem: &str) -> Vec<PathBuf> {
    let root = rocm_path
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("/opt/rocm"));
    let file = format!("lib{stem}.so");
    vec![root.join("lib").join(&file), PathBuf::from(&file)]
}

/// Open the first loadable candidate, or report every path tried.
pub(crate) fn open_first(cands: &[PathBuf], what: &str) -> Result<(libloading::Library, PathBuf)> {
    let mut tried = Vec::new();
    for c in cands {
        // SAFETY: loading a shared library runs its initialisers; the ROCm libraries'
        // initialisers only set up their own state.
        match unsafe { libloading::Library::new(c) } {
            Ok(lib) => return Ok((lib, c.clone())),
            Err(e) => tried.push(format!("{}: {e}", c.display())),
        }
    }
    Err(GpuError::HipUnavailable(format!(
        "{what} not found; tried {}",
        tried.join("; ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_follow_rocm_path_then_loader() {
        let c = library_candidates(Some(Path::new("/x/rocm")), "amdhip64");
        assert_eq!(c[0], PathBuf::from("/x/rocm/lib/libamdhip64.so"));
        assert_eq!(c[1], PathBuf::from("libamdhip64.so"));
        let d = library_candidates(None, "hiprtc");
        assert_eq!(d[0], PathBuf::from("/opt/rocm/lib/libhiprtc.so"));
    }

    #[test]
    fn missing_library_lists_what_was_tried() {
        let e = open_first(&[PathBuf::from("/nonexistent/libnothing.so")], "test lib").unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("/nonexistent/libnothing.so") && s.contains("test lib"),
            "{s}"
        );
    }
}
