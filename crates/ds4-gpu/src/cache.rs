//! On-disk cache of compiled kernel images.
//!
//! Compiling gemv.cu with NVRTC takes tens of milliseconds to seconds; the engine loads
//! the same kernels on every start, so the image (a CUBIN on CUDA, a code object on ROCm)
//! is stored under a key made of everything that changes the result: the source hash
//! (file and headers), the target architecture, the driver version, the compiler version
//! and the compile options. A stale or corrupt entry is never trusted: the loader falls
//! back to compiling when the driver rejects a cached image, and rewrites the entry.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{GpuError, Result};
use crate::kernels::KernelSource;

/// What a compiled image depends on, besides the source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheKeyParts<'a> {
    /// `cuda` or `hip`: images of the two never mix.
    pub runtime: &'a str,
    /// `sm_90`, `gfx1151`, ...
    pub arch: &'a str,
    /// Driver (or HIP runtime) version as the runtime reports it.
    pub driver_version: i64,
    /// Compiler (NVRTC/hiprtc) version, e.g. `12.9`.
    pub compiler_version: &'a str,
    /// Compile options, in order.
    pub options: &'a [String],
}

/// The cache key: `<kernel stem>-<arch>-<first 24 hex digits of a SHA-256>` (readable
/// and collision-safe).
pub fn cache_key(src: &KernelSource, parts: &CacheKeyParts<'_>) -> String {
    let mut h = Sha256::new();
    h.update(src.hash());
    for field in [parts.runtime, parts.arch, parts.compiler_version] {
        h.update((field.len() as u64).to_le_bytes());
        h.update(field.as_bytes());
    }
    h.update(parts.driver_version.to_le_bytes());
    for o in parts.options {
        h.update((o.len() as u64).to_le_bytes());
        h.update(o.as_bytes());
    }
    let digest = h.finalize();
    let hex: String = digest[..12].iter().map(|b| format!("{b:02x}")).collect();
    let stem = src.name.split('.').next().unwrap_or(src.name);
    let arch: String = parts
        .arch
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!("{stem}-{}-{arch}-{hex}", parts.runtime)
}

/// A directory of compiled images, or no cache at all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelCache {
    dir: Option<PathBuf>,
}

impl KernelCache {
    /// Cache in `dir` (created on first store).
    pub fn at(dir: impl Into<PathBuf>) -> Self {
        KernelCache {
            dir: Some(dir.into()),
        }
    }

    /// No caching: every load compiles.
    pub fn disabled() -> Self {
        KernelCache { dir: None }
    }

    /// `$XDG_CACHE_HOME/ds4-rs/kernels`, else `$HOME/.cache/ds4-rs/kernels`, else disabled.
    pub fn default_location() -> Self {
        Self::from_env_values(
            std::env::var_os("XDG_CACHE_HOME").as_deref(),
            std::env::var_os("HOME").as_deref(),
        )
    }

    /// [`Self::default_location`] with the variables given (testable).
    pub fn from_env_values(
        xdg_cache_home: Option<&std::ffi::OsStr>,
        home: Option<&std::ffi::OsStr>,
    ) -> Self {
        // XDG says a relative value is invalid and must be ignored.
        let xdg = xdg_cache_home
            .map(PathBuf::from)
            .filter(|p| p.is_absolute());
        let base = xdg.or_else(|| {
            home.map(PathBuf::from)
                .filter(|p| p.is_absolute())
                .map(|h| h.join(".cache"))
        });
        KernelCache {
            dir: base.map(|b| b.join("ds4-rs").join("kernels")),
        }
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    fn path(&self, key: &str, ext: &str) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(format!("{key}.{ext}")))
    }

    /// The cached image for `key`, if present. A read error other than "not found" is
    /// reported, so a broken cache directory is visible rather than silently slow.
    pub fn load(&self, key: &str, ext: &str) -> Result<Option<Vec<u8>>> {
        let Some(path) = self.path(key, ext) else {
            return Ok(None);
        };
        match fs::read(&path) {
            Ok(bytes) if !bytes.is_empty() => Ok(Some(bytes)),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(GpuError::Cache { path, source }),
        }
    }

    /// Store an image atomically (write a temporary file, then rename), so a concurrent
    /// reader never sees half an image. Returns the path written, if caching is on.
    pub fn store(&self, key: &str, ext: &str, image: &[u8]) -> Result<Option<PathBuf>> {
        let (Some(dir), Some(path)) = (self.dir.as_ref(), self.path(key, ext)) else {
            return Ok(None);
        };
        let err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| GpuError::Cache { path, source }
        };
        fs::create_dir_all(dir).map_err(err(dir))?;
        let tmp = dir.join(format!(".{key}.{ext}.{}.tmp", std::process::id()));
        let mut f = fs::File::create(&tmp).map_err(err(&tmp))?;
        f.write_all(image).map_err(err(&tmp))?;
        f.sync_all().map_err(err(&tmp))?;
        drop(f);
        fs::rename(&tmp, &path).map_err(err(&path))?;
        Ok(Some(path))
    }

    /// Remove an entry (after the driver rejected it).
    pub fn evict(&self, key: &str, ext: &str) {
        if let Some(path) = self.path(key, ext) {
            let _ = fs::remove_file(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::GEMV;
    use std::ffi::OsStr;

    fn parts<'a>(arch: &'a str, driver: i64, opts: &'a [String]) -> CacheKeyParts<'a> {
        CacheKeyParts {
            runtime: "cuda",
            arch,
            driver_version: driver,
            compiler_version: "12.9",
            options: opts,
        }
    }

    #[test]
    fn key_depends_on_every_part() {
        let o = vec!["-std=c++17".to_string()];
        let base = cache_key(&GEMV, &parts("sm_90", 13000, &o));
        assert!(base.starts_with("gemv-cuda-sm_90-"), "{base}");
        assert_ne!(base, cache_key(&GEMV, &parts("sm_89", 13000, &o)));
        assert_ne!(base, cache_key(&GEMV, &parts("sm_90", 12080, &o)));
        assert_ne!(base, cache_key(&GEMV, &parts("sm_90", 13000, &[])));
        let mut p = parts("sm_90", 13000, &o);
        p.compiler_version = "13.0";
        assert_ne!(base, cache_key(&GEMV, &p));
        p = parts("sm_90", 13000, &o);
        p.runtime = "hip";
        assert_ne!(base, cache_key(&GEMV, &p));
        assert_eq!(base, cache_key(&GEMV, &parts("sm_90", 13000, &o)));
        // Architecture names with odd characters stay file-name safe.
        let k = cache_key(&GEMV, &parts("gfx90a:sramecc+:xnack-", 1, &o));
        assert!(
            k.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
            "{k}"
        );
    }

    #[test]
    fn store_then_load_roundtrips_and_evicts() {
        let dir = tempfile::tempdir().unwrap();
        let c = KernelCache::at(dir.path().join("k"));
        assert_eq!(c.load("a", "cubin").unwrap(), None);
        let p = c.store("a", "cubin", b"image").unwrap().unwrap();
        assert!(p.ends_with("a.cubin"));
        assert_eq!(
            c.load("a", "cubin").unwrap().as_deref(),
            Some(&b"image"[..])
        );
        // No temporary files left behind.
        let names: Vec<_> = fs::read_dir(dir.path().join("k")).unwrap().collect();
        assert_eq!(names.len(), 1);
        c.evict("a", "cubin");
        assert_eq!(c.load("a", "cubin").unwrap(), None);
        // An empty file counts as absent.
        c.store("e", "cubin", b"").unwrap();
        assert_eq!(c.load("e", "cubin").unwrap(), None);
    }

    #[test]
    fn disabled_cache_stores_nothing() {
        let c = KernelCache::disabled();
        assert_eq!(c.store("a", "cubin", b"x").unwrap(), None);
        assert_eq!(c.load("a", "cubin").unwrap(), None);
    }

    #[test]
    fn unreadable_entry_is_an_error_not_a_miss() {
        let dir = tempfile::tempdir().unwrap();
        // A directory where the file should be: read fails with something other than
        // NotFound.
        fs::create_dir_all(dir.path().join("a.cubin")).unwrap();
        let c = KernelCache::at(dir.path());
        assert!(matches!(c.load("a", "cubin"), Err(GpuError::Cache { .. })));
    }

    #[test]
    fn default_location_follows_xdg() {
        let c = KernelCache::from_env_values(Some(OsStr::new("/x/cache")), Some(OsStr::new("/h")));
        assert_eq!(c.dir(), Some(Path::new("/x/cache/ds4-rs/kernels")));
        let c = KernelCache::from_env_values(Some(OsStr::new("rel")), Some(OsStr::new("/h")));
        assert_eq!(c.dir(), Some(Path::new("/h/.cache/ds4-rs/kernels")));
        let c = KernelCache::from_env_values(None, None);
        assert_eq!(c.dir(), None);
    }
}
