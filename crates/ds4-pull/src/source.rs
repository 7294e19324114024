//! Which file to fetch: endpoint, repository, revision and path, checked before any request
//! so that a typo is reported as such and a hostile name cannot write outside the target
//! directory.

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

use crate::PullError;

/// The public hub; `HF_ENDPOINT` (read by the CLI) or [`Source::endpoint`] overrides it, as
/// in huggingface_hub, so that mirrors and the tests' local server work the same way.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Characters left unquoted in one URL path segment (RFC 3986 unreserved).
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// One file in one repository at one revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// Base URL without a trailing slash, e.g. `https://huggingface.co`.
    pub endpoint: String,
    /// `owner/name`.
    pub repo: String,
    /// A branch, tag or commit (`main` unless told otherwise).
    pub revision: String,
    /// Path of the file inside the repository, `/`-separated.
    pub file: String,
}

impl Source {
    /// Checks every part; the file path may have folders but no `..`, empty or absolute
    /// parts, because it also names the file under the target directory.
    pub fn new(endpoint: &str, repo: &str, revision: &str, file: &str) -> Result<Self, PullError> {
        let endpoint = endpoint.trim_end_matches('/');
        if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
            return Err(bad(
                "endpoint",
                endpoint,
                "must start with http:// or https://",
            ));
        }
        let parts: Vec<&str> = repo.split('/').collect();
        if parts.len() != 2 || parts.iter().any(|p| !valid_repo_part(p)) {
            return Err(bad(
                "repository",
                repo,
                "must be owner/name (letters, digits, '-', '_', '.')",
            ));
        }
        if revision.is_empty() || revision.contains("..") || revision.chars().any(char::is_control)
        {
            return Err(bad("revision", revision, "must be a branch, tag or commit"));
        }
        if file.is_empty()
            || file.starts_with('/')
            || file.contains('\\')
            || file.chars().any(char::is_control)
            || file
                .split('/')
                .any(|p| p.is_empty() || p == "." || p == "..")
        {
            return Err(bad(
                "file",
                file,
                "must be a relative path inside the repository, without '..' or empty parts",
            ));
        }
        Ok(Source {
            endpoint: endpoint.to_string(),
            repo: repo.to_string(),
            revision: revision.to_string(),
            file: file.to_string(),
        })
    }

    /// Splits `owner/name/path/to/file` (the `--hf` form) into repository and file.
    pub fn split_repo_file(spec: &str) -> Result<(String, String), PullError> {
        let mut it = spec.splitn(3, '/');
        match (it.next(), it.next(), it.next()) {
            (Some(o), Some(n), Some(f)) if !o.is_empty() && !n.is_empty() && !f.is_empty() => {
                Ok((format!("{o}/{n}"), f.to_string()))
            }
            _ => Err(bad(
                "--hf value",
                spec,
                "must be OWNER/REPO/FILE, e.g. antirez/deepseek-v4-gguf/some.gguf",
            )),
        }
    }

    /// `{endpoint}/{repo}/resolve/{revision}/{file}`, revision quoted as one segment (so
    /// `refs/pr/1` stays one) and each folder of the file quoted separately.
    pub fn resolve_url(&self) -> String {
        let rev = utf8_percent_encode(&self.revision, SEGMENT);
        let file: Vec<String> = self
            .file
            .split('/')
            .map(|p| utf8_percent_encode(p, SEGMENT).to_string())
            .collect();
        format!(
            "{}/{}/resolve/{}/{}",
            self.endpoint,
            self.repo,
            rev,
            file.join("/")
        )
    }
}

fn valid_repo_part(p: &str) -> bool {
    !p.is_empty()
        && p != "."
        && p != ".."
        && p.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn bad(what: &'static str, value: &str, why: &'static str) -> PullError {
    PullError::BadName {
        what,
        value: value.to_string(),
        why,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_url_quotes_revision_and_file_parts() {
        let s = Source::new("https://hf.example/", "o/r", "refs/pr/1", "dir/a b+c.gguf").unwrap();
        assert_eq!(
            s.resolve_url(),
            "https://hf.example/o/r/resolve/refs%2Fpr%2F1/dir/a%20b%2Bc.gguf"
        );
    }

    #[test]
    fn names_that_escape_the_directory_are_refused() {
        for f in ["../x", "/etc/passwd", "a//b", "a/./b", "", "a\\b"] {
            let e = Source::new(DEFAULT_ENDPOINT, "o/r", "main", f).unwrap_err();
            assert!(e.to_string().contains("bad file"), "{f}: {e}");
        }
        for r in ["o", "o/r/x", "o/..", "o r/x", "/r"] {
            let e = Source::new(DEFAULT_ENDPOINT, r, "main", "f").unwrap_err();
            assert!(e.to_string().contains("bad repository"), "{r}: {e}");
        }
        let e = Source::new("ftp://x", "o/r", "main", "f").unwrap_err();
        assert!(e.to_string().contains("bad endpoint"), "{e}");
    }

    #[test]
    fn split_repo_file_takes_two_parts_for_the_repo() {
        assert_eq!(
            Source::split_repo_file("o/r/dir/f.gguf").unwrap(),
            ("o/r".to_string(), "dir/f.gguf".to_string())
        );
        assert!(Source::split_repo_file("o/r").is_err());
        assert!(Source::split_repo_file("o//f").is_err());
    }
}
