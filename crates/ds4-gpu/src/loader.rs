//! Reading tensor bytes from the model file into their final buffer with `pread`, in large
//! chunks, dropping the page cache behind each chunk (`posix_fadvise(DONTNEED)`).
//!
//! Why: on ROCm, copying from mmap'd pages to the device crawls past ~64 GB (hipMemcpy
//! locks and unlocks every pageable page; llama.cpp #15018), and a page-cache copy next to
//! a pinned copy doubles residency on a unified-memory machine. ds4's ROCm loader reads
//! with `pread` into the destination for the same reasons.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// Bytes per `pread` call.
pub const CHUNK: usize = 64 << 20;

/// Why a read failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: the file ends before byte {end}")]
    Short { path: String, end: u64 },
}

/// Fills `out` with the bytes of `path` at `offset`.
pub fn pread_into(path: &Path, offset: u64, out: &mut [u8]) -> Result<(), LoadError> {
    let io = |source| LoadError::Io {
        path: path.display().to_string(),
        source,
    };
    let f = File::open(path).map_err(io)?;
    pread_range(&f, path, offset, out, true)
}

/// Reads `out.len()` bytes at `offset` of the open file `f` (named `path` in errors),
/// dropping the page cache behind the read when `drop` (host-resident weights that must
/// not be resident twice). Holes in a sparse file read back as zeros.
pub(crate) fn pread_range(
    f: &File,
    path: &Path,
    offset: u64,
    out: &mut [u8],
    drop: bool,
) -> Result<(), LoadError> {
    let io = |source| LoadError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut done = 0usize;
    while done < out.len() {
        let n = CHUNK.min(out.len() - done);
        let at = offset + done as u64;
        let got = f.read_at(&mut out[done..done + n], at).map_err(io)?;
        if got == 0 {
            return Err(LoadError::Short {
                path: path.display().to_string(),
                end: offset + out.len() as u64,
            });
        }
        if drop {
            drop_cache(f, at, got);
        }
        done += got;
    }
    Ok(())
}

/// Advises the kernel to drop the page cache of `len` bytes at `offset` (best-effort).
fn drop_cache(f: &File, offset: u64, len: usize) {
    let (Ok(off), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return;
    };
    // SAFETY: a plain syscall on an open descriptor owned by `f`; it touches no memory.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), off, len, libc::POSIX_FADV_DONTNEED) };
    if r != 0 {
        tracing::debug!("posix_fadvise(DONTNEED) returned {r}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_exact_ranges_and_reports_short_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.bin");
        let data: Vec<u8> = (0..1_000_003u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        let mut out = vec![0u8; 500_000];
        pread_into(&p, 123, &mut out).unwrap();
        assert_eq!(&out[..], &data[123..500_123]);
        let mut big = vec![0u8; 10];
        let e = pread_into(&p, 1_000_000, &mut big).unwrap_err().to_string();
        assert!(e.contains("ends before byte 1000010"), "{e}");
        assert!(pread_into(&dir.path().join("none"), 0, &mut big).is_err());
    }
}
