//! The download itself: free-space check, resume, retries, hashing, verification, rename.

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, ErrorKind, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::remote::{self, backoff, header, origin, status_failure, Failure};
use crate::{
    remote_file, FreeSpace, Options, Phase, Progress, PullError, Pulled, RemoteFile, Source,
};

/// Bytes read from the network or the `.part` at a time.
const CHUNK: usize = 1 << 20;

/// Downloads `source` to `dir/{source.file}` (folders of the file's path are created).
///
/// A file already under the final name with the hub's size is taken as done (not re-hashed:
/// only this function puts files there, after verifying them). See the crate documentation
/// for the guarantees.
pub fn pull(
    source: &Source,
    dir: &Path,
    opts: &Options,
    space: &dyn FreeSpace,
    progress: &mut dyn Progress,
) -> Result<Pulled, PullError> {
    let path = dir.join(&source.file);
    let parent = path.parent().unwrap_or(dir).to_path_buf();
    fs::create_dir_all(&parent)
        .map_err(|e| PullError::io("cannot create directory", &parent, e))?;
    let part = part_path(&path);

    let mut remote = remote_file(source, opts)?;
    match fs::metadata(&path) {
        Ok(m) if m.len() == remote.size => {
            return Ok(Pulled {
                path,
                size: remote.size,
                sha256: remote.sha256,
                already_present: true,
                fetched: 0,
            })
        }
        Ok(m) => {
            return Err(PullError::ExistingDiffers {
                path,
                size: m.len(),
                expected: remote.size,
            })
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(PullError::io("cannot inspect", &path, e)),
    }

    let mut have = match fs::metadata(&part) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == ErrorKind::NotFound => 0,
        Err(e) => return Err(PullError::io("cannot inspect", &part, e)),
    };
    if have > remote.size {
        progress.note(&format!(
            "{} has {have} bytes, more than the {} of the file on the hub: starting over",
            part.display(),
            remote.size
        ));
        have = 0;
    }

    let needed = remote.size - have;
    let available = space
        .available(&parent)
        .map_err(|e| PullError::io("cannot read the free space of", &parent, e))?;
    if available < needed {
        return Err(PullError::NoSpace {
            dir: parent,
            needed,
            needed_gib: gib(needed),
            available,
            available_gib: gib(available),
        });
    }

    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&part)
        .map_err(|e| PullError::io("cannot open", &part, e))?;
    // Two runs appending to one .part would interleave bytes; the second one stops here.
    file.try_lock().map_err(|e| {
        let e = match e {
            std::fs::TryLockError::WouldBlock => std::io::Error::new(
                ErrorKind::WouldBlock,
                "another download of this file is running",
            ),
            std::fs::TryLockError::Error(e) => e,
        };
        PullError::io("cannot lock", &part, e)
    })?;
    file.set_len(have)
        .map_err(|e| PullError::io("cannot truncate", &part, e))?;

    let mut st = State {
        file,
        part: part.clone(),
        hasher: Sha256::new(),
        have,
        fetched: 0,
        size: remote.size,
    };
    if have > 0 {
        st.rehash(progress)?;
    }

    let agent = remote::agent(opts, true);
    let mut failures = 0u32;
    progress.begin(Phase::Download, st.size, st.have);
    while st.have < st.size {
        let before = st.have;
        let token = if origin(&remote.download_url) == origin(&source.endpoint) {
            opts.token.as_deref()
        } else {
            None
        };
        match st.fetch(&agent, &remote.download_url, token, source, opts, progress) {
            Ok(()) => {}
            Err(Failure::Fatal(e)) => {
                progress.end();
                return Err(e);
            }
            Err(Failure::Retry(msg)) => {
                if st.have > before {
                    failures = 0;
                }
                failures += 1;
                if failures > opts.retries {
                    progress.end();
                    return Err(PullError::RetriesExhausted {
                        file: source.file.clone(),
                        attempts: failures,
                        have: st.have,
                        size: st.size,
                        part,
                        last: msg,
                    });
                }
                progress.note(&format!(
                    "{msg}; retrying from byte {} ({failures} of {} retries)",
                    st.have, opts.retries
                ));
                std::thread::sleep(backoff(opts.retry_delay, failures));
                // A fresh CDN location (signed URLs expire), and proof the file is the same.
                let fresh = remote_file(source, opts)?;
                if fresh.size != remote.size || fresh.sha256 != remote.sha256 {
                    progress.end();
                    return Err(PullError::RemoteChanged {
                        file: source.file.clone(),
                        before: describe(&remote),
                        after: describe(&fresh),
                    });
                }
                remote = fresh;
            }
        }
    }
    progress.end();

    st.file
        .sync_all()
        .map_err(|e| PullError::io("cannot sync", &part, e))?;
    let State {
        file,
        hasher,
        fetched,
        ..
    } = st;
    drop(file);
    let actual = hex(&hasher.finalize());
    if let Some(expected) = &remote.sha256 {
        if &actual != expected {
            return Err(PullError::Mismatch {
                file: source.file.clone(),
                expected: expected.clone(),
                actual,
                part: part.clone(),
                fate: match fs::remove_file(&part) {
                    Ok(()) => "was deleted".to_string(),
                    Err(e) => format!("could not be deleted ({e}): delete it by hand"),
                },
            });
        }
    } else {
        tracing::warn!(file = %source.file, "the hub gives no SHA-256 for this file; not verified");
    }
    fs::rename(&part, &path)
        .map_err(|e| PullError::io("cannot rename the download to", &path, e))?;
    // The rename is durable only once the directory is synced (best effort: not on Windows).
    if let Ok(d) = File::open(&parent) {
        let _ = d.sync_all();
    }
    Ok(Pulled {
        path,
        size: remote.size,
        sha256: remote.sha256,
        already_present: false,
        fetched,
    })
}

/// `FILE.part` beside `FILE`.
pub fn part_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".part");
    path.with_file_name(name)
}

/// The open `.part` and how far it and its hash have got.
struct State {
    file: File,
    part: PathBuf,
    hasher: Sha256,
    /// Bytes in the `.part` (and in `hasher`).
    have: u64,
    /// Bytes fetched by this run.
    fetched: u64,
    size: u64,
}

impl State {
    /// Hashes the bytes an earlier run left, so that the final check covers the whole file.
    fn rehash(&mut self, progress: &mut dyn Progress) -> Result<(), PullError> {
        progress.begin(Phase::Rehash, self.have, 0);
        self.file
            .seek(SeekFrom::Start(0))
            .map_err(|e| PullError::io("cannot read", &self.part, e))?;
        let mut buf = vec![0u8; CHUNK];
        let mut left = self.have;
        while left > 0 {
            let want = left.min(CHUNK as u64) as usize;
            self.file
                .read_exact(&mut buf[..want])
                .map_err(|e| PullError::io("cannot read", &self.part, e))?;
            self.hasher.update(&buf[..want]);
            left -= want as u64;
            progress.advance(want as u64);
        }
        progress.end();
        Ok(())
    }

    /// Starts over at byte 0 (the server ignored the range).
    fn restart(&mut self) -> Result<(), PullError> {
        self.file
            .set_len(0)
            .map_err(|e| PullError::io("cannot truncate", &self.part, e))?;
        self.hasher = Sha256::new();
        self.have = 0;
        Ok(())
    }

    /// One GET from `self.have` on; `Ok` only when the file is complete.
    fn fetch(
        &mut self,
        agent: &ureq::Agent,
        url: &str,
        token: Option<&str>,
        source: &Source,
        opts: &Options,
        progress: &mut dyn Progress,
    ) -> Result<(), Failure> {
        let mut req = agent.get(url).header("Accept-Encoding", "identity");
        if self.have > 0 {
            req = req.header("Range", format!("bytes={}-", self.have));
        }
        if let Some(t) = token {
            req = req.header("Authorization", format!("Bearer {t}"));
        }
        let resp = req
            .call()
            .map_err(|e| Failure::Retry(format!("{url}: {e}")))?;
        let status = resp.status().as_u16();
        match status {
            206 => {
                let range = header(resp.headers(), "content-range").unwrap_or_default();
                if range_start(&range) != Some(self.have) {
                    return Err(Failure::Fatal(PullError::Protocol {
                        url: url.to_string(),
                        what: format!(
                            "asked for bytes from {}, got Content-Range {range:?}",
                            self.have
                        ),
                    }));
                }
            }
            200 => {
                if self.have > 0 {
                    progress
                        .note("the server ignored the range request: starting over from byte 0");
                    self.restart()?;
                    progress.end();
                    progress.begin(Phase::Download, self.size, 0);
                }
            }
            416 => {
                return Err(Failure::Fatal(PullError::Protocol {
                    url: url.to_string(),
                    what: format!(
                        "range from byte {} refused (HTTP 416) though the file has {} bytes",
                        self.have, self.size
                    ),
                }))
            }
            s => {
                return Err(match status_failure(s, resp.headers(), source, url, opts) {
                    // After a good HEAD an error from the CDN is most likely an expired
                    // signed URL: a retry asks the hub for a fresh one.
                    Failure::Fatal(_) if origin(url) != origin(&source.endpoint) => {
                        Failure::Retry(format!("HTTP {s} from {url}"))
                    }
                    f => f,
                });
            }
        }
        self.file
            .seek(SeekFrom::Start(self.have))
            .map_err(|e| PullError::io("cannot seek in", &self.part, e))?;
        let mut reader = resp.into_body().into_reader();
        let mut out = BufWriter::with_capacity(4 * CHUNK, &mut self.file);
        let mut buf = vec![0u8; CHUNK];
        let mut broke = None;
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    broke = Some(e);
                    break;
                }
            };
            if self.have + n as u64 > self.size {
                return Err(Failure::Fatal(PullError::Protocol {
                    url: url.to_string(),
                    what: format!("more bytes than the {} the hub announced", self.size),
                }));
            }
            out.write_all(&buf[..n])
                .map_err(|e| PullError::io("cannot write", &self.part, e))?;
            self.hasher.update(&buf[..n]);
            self.have += n as u64;
            self.fetched += n as u64;
            progress.advance(n as u64);
        }
        // Whatever was counted must be on disk before the next attempt resumes after it.
        out.flush()
            .map_err(|e| PullError::io("cannot write", &self.part, e))?;
        if let Some(e) = broke {
            return Err(Failure::Retry(format!(
                "transfer from {url} broke off at byte {}: {e}",
                self.have
            )));
        }
        if self.have < self.size {
            return Err(Failure::Retry(format!(
                "transfer from {url} ended at byte {} of {}",
                self.have, self.size
            )));
        }
        Ok(())
    }
}

/// The first byte of `bytes START-END/TOTAL`.
fn range_start(v: &str) -> Option<u64> {
    v.trim()
        .strip_prefix("bytes ")?
        .split('-')
        .next()?
        .trim()
        .parse()
        .ok()
}

fn describe(r: &RemoteFile) -> String {
    format!(
        "{} bytes, SHA-256 {}",
        r.size,
        r.sha256.as_deref().unwrap_or("unknown")
    )
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_start_reads_the_first_byte() {
        assert_eq!(range_start("bytes 100-199/200"), Some(100));
        assert_eq!(range_start("bytes */200"), None);
        assert_eq!(range_start(""), None);
    }

    #[test]
    fn part_path_appends_to_the_name() {
        assert_eq!(
            part_path(Path::new("/m/a.gguf")),
            PathBuf::from("/m/a.gguf.part")
        );
    }
}
