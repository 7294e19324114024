//! The metadata request: a HEAD on the `resolve` URL without following the redirect to the
//! CDN, because the hub's own answer carries what the CDN's does not — the LFS SHA-256 in
//! `X-Linked-Etag` and the size in `X-Linked-Size` (huggingface_hub reads the same headers).
//! Relative redirects (a renamed repository) are followed on the hub; the first absolute one
//! is where the bytes are.

use std::time::Duration;

use ureq::http::{HeaderMap, Response};
use ureq::Body;

use crate::{Options, PullError, Source};

/// What the hub says about a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteFile {
    /// Size in bytes.
    pub size: u64,
    /// Lower-case hex SHA-256 for LFS files; `None` for small files kept in git, whose ETag
    /// is a git object id rather than a content hash.
    pub sha256: Option<String>,
    /// The commit the revision resolved to (`X-Repo-Commit`), when the hub names it.
    pub commit: Option<String>,
    /// Where to GET the bytes: the CDN location of the redirect, or the resolve URL itself
    /// when the hub served the file directly.
    pub download_url: String,
}

/// Whether an error is worth another attempt.
pub(crate) enum Failure {
    /// Connection drop, timeout, 5xx, 429: try again later.
    Retry(String),
    /// Retrying cannot help (404, 401, a protocol violation, a local I/O error).
    Fatal(PullError),
}

impl From<PullError> for Failure {
    fn from(e: PullError) -> Self {
        Failure::Fatal(e)
    }
}

pub(crate) fn agent(opts: &Options, follow_redirects: bool) -> ureq::Agent {
    let config = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(if follow_redirects { 10 } else { 0 })
        .timeout_connect(Some(opts.connect_timeout))
        .timeout_per_read(Some(opts.read_timeout))
        .user_agent(concat!("ds4-pull/", env!("CARGO_PKG_VERSION")))
        .build();
    ureq::Agent::new_with_config(config)
}

/// Asks the hub for the file's size and SHA-256, retrying transport errors and 5xx answers.
pub fn remote_file(source: &Source, opts: &Options) -> Result<RemoteFile, PullError> {
    let agent = agent(opts, false);
    let url = source.resolve_url();
    let mut failures = 0;
    loop {
        match head_once(&agent, source, &url, opts) {
            Ok(r) => return Ok(r),
            Err(Failure::Fatal(e)) => return Err(e),
            Err(Failure::Retry(last)) => {
                failures += 1;
                if failures > opts.retries {
                    return Err(PullError::Unreachable {
                        url,
                        attempts: failures,
                        last,
                    });
                }
                tracing::warn!("{url}: {last}; retrying ({failures} of {})", opts.retries);
                std::thread::sleep(backoff(opts.retry_delay, failures));
            }
        }
    }
}

/// Doubling delay, capped at a minute.
pub(crate) fn backoff(base: Duration, failures: u32) -> Duration {
    (base * 2u32.saturating_pow(failures.saturating_sub(1).min(16))).min(Duration::from_secs(60))
}

fn head_once(
    agent: &ureq::Agent,
    source: &Source,
    url: &str,
    opts: &Options,
) -> Result<RemoteFile, Failure> {
    let mut current = url.to_string();
    for _ in 0..5 {
        let mut req = agent.head(&current).header("Accept-Encoding", "identity");
        if let Some(t) = &opts.token {
            req = req.header("Authorization", format!("Bearer {t}"));
        }
        // The URL is named by the caller's error unless a relative redirect changed it.
        let resp = req.call().map_err(|e| {
            Failure::Retry(if current == url {
                e.to_string()
            } else {
                format!("{current}: {e}")
            })
        })?;
        let status = resp.status().as_u16();
        if (300..400).contains(&status) {
            let Some(loc) = header(resp.headers(), "location") else {
                return Err(Failure::Fatal(PullError::Protocol {
                    url: current,
                    what: format!("HTTP {status} without a Location header"),
                }));
            };
            if loc.starts_with('/') && !loc.starts_with("//") {
                // Same host (a renamed repository): the metadata is on the next answer.
                current = format!("{}{}", source.endpoint, loc);
                continue;
            }
            let download_url = absolute(&current, &loc);
            return metadata(&resp, &current, download_url);
        }
        if (200..300).contains(&status) {
            return metadata(&resp, &current, current.clone());
        }
        return Err(status_failure(
            status,
            resp.headers(),
            source,
            &current,
            opts,
        ));
    }
    Err(Failure::Fatal(PullError::Protocol {
        url: url.to_string(),
        what: "more than 5 redirects within the hub".into(),
    }))
}

fn metadata(resp: &Response<Body>, url: &str, download_url: String) -> Result<RemoteFile, Failure> {
    let h = resp.headers();
    let size = header(h, "x-linked-size")
        .or_else(|| header(h, "content-length"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .ok_or_else(|| PullError::NoSize {
            url: url.to_string(),
        })?;
    let sha256 = header(h, "x-linked-etag")
        .or_else(|| header(h, "etag"))
        .map(|v| {
            v.trim()
                .trim_start_matches("W/")
                .trim_matches('"')
                .to_ascii_lowercase()
        })
        .filter(|v| v.len() == 64 && v.bytes().all(|b| b.is_ascii_hexdigit()));
    Ok(RemoteFile {
        size,
        sha256,
        commit: header(h, "x-repo-commit"),
        download_url,
    })
}

/// Maps an error status of the hub to a named error, or to a retry for transient ones.
pub(crate) fn status_failure(
    status: u16,
    headers: &HeaderMap,
    source: &Source,
    url: &str,
    opts: &Options,
) -> Failure {
    let url = url.to_string();
    let repo = source.repo.clone();
    match status {
        401 | 403 => Failure::Fatal(PullError::NeedsToken {
            status,
            repo,
            url,
            hint: if opts.token.is_some() {
                "the token given was refused or has no access; for a gated repository accept \
                 its terms on the repository page"
            } else {
                "none was given: pass --token or set HF_TOKEN"
            },
        }),
        404 => Failure::Fatal(match header(headers, "x-error-code").as_deref() {
            Some("RepoNotFound") => PullError::NoSuchRepo { repo, url },
            Some("RevisionNotFound") => PullError::NoSuchRevision {
                repo,
                revision: source.revision.clone(),
                url,
            },
            _ => PullError::NoSuchFile {
                repo,
                revision: source.revision.clone(),
                file: source.file.clone(),
                url,
            },
        }),
        408 | 429 | 500..=599 => Failure::Retry(format!("HTTP {status} from {url}")),
        _ => Failure::Fatal(PullError::Http { status, url }),
    }
}

pub(crate) fn header(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// Resolves a Location value against the URL it came from (absolute, or scheme-relative).
fn absolute(from: &str, loc: &str) -> String {
    if let Some(rest) = loc.strip_prefix("//") {
        let scheme = from.split("://").next().unwrap_or("https");
        format!("{scheme}://{rest}")
    } else {
        loc.to_string()
    }
}

/// `scheme://host[:port]` of a URL, to decide whether a token may be sent there.
pub(crate) fn origin(url: &str) -> &str {
    let after = url.find("://").map(|i| i + 3).unwrap_or(0);
    match url[after..].find('/') {
        Some(i) => &url[..after + i],
        None => url,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origin_stops_at_the_path() {
        assert_eq!(origin("https://a.b:8/x/y"), "https://a.b:8");
        assert_eq!(origin("http://a"), "http://a");
    }

    #[test]
    fn backoff_doubles_and_is_capped() {
        let b = Duration::from_secs(1);
        assert_eq!(backoff(b, 1), Duration::from_secs(1));
        assert_eq!(backoff(b, 3), Duration::from_secs(4));
        assert_eq!(backoff(b, 40), Duration::from_secs(60));
    }
}
