//! `ds4 pull` end to end against a loopback stand-in for the hub (the download logic itself is
//! tested in ds4-pull): names, defaults, the printed path and the next command.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::{Command, Output};

fn ds4(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ds4"));
    c.args(args)
        .env_remove("HF_TOKEN")
        .env_remove("HF_ENDPOINT")
        .env("HF_TOKEN_PATH", "/nonexistent/ds4-test-token");
    for (k, v) in envs {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// Serves `body` for every HEAD and GET of `path` (200, with the hub's `X-Linked-*` headers),
/// 404 for anything else; records the request lines.
fn hub(
    path: &'static str,
    body: Vec<u8>,
    sha: String,
) -> (String, std::sync::mpsc::Receiver<String>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut first = String::new();
            let _ = r.read_line(&mut first);
            loop {
                let mut line = String::new();
                if r.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
                    break;
                }
            }
            let _ = tx.send(first.trim().to_string());
            let mut it = first.split_whitespace();
            let (method, p) = (it.next().unwrap_or(""), it.next().unwrap_or(""));
            let head = if p == path {
                format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {n}\r\nX-Linked-Size: {n}\r\n\
                     X-Linked-Etag: \"{sha}\"\r\nConnection: close\r\n\r\n",
                    n = body.len()
                )
            } else {
                "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".into()
            };
            let _ = s.write_all(head.as_bytes());
            if method == "GET" && p == path {
                let _ = s.write_all(&body);
            }
        }
    });
    (url, rx)
}

fn sha256(d: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(d)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn pull_hf_downloads_prints_the_path_and_the_next_command() {
    let body: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
    let (url, rx) = hub("/o/r/resolve/main/x.gguf", body.clone(), sha256(&body));
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_str().unwrap();
    // The endpoint from HF_ENDPOINT, as huggingface_hub reads it.
    let out = ds4(
        &["pull", "--hf", "o/r/x.gguf", "--dir", dir],
        &[("HF_ENDPOINT", &url)],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let path = tmp.path().join("x.gguf");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        path.to_str().unwrap()
    );
    assert_eq!(std::fs::read(&path).unwrap(), body);
    assert!(stderr.contains("verified"), "{stderr}");
    assert!(
        stderr.contains(&format!("next: ds4 -m {}", path.display())),
        "{stderr}"
    );
    let reqs: Vec<String> = rx.try_iter().collect();
    assert_eq!(reqs[0], "HEAD /o/r/resolve/main/x.gguf HTTP/1.1");
    assert_eq!(reqs[1], "GET /o/r/resolve/main/x.gguf HTTP/1.1");

    // --endpoint wins over HF_ENDPOINT; the second run finds the file and fetches nothing.
    let out = ds4(
        &[
            "pull",
            "--hf",
            "o/r/x.gguf",
            "--dir",
            dir,
            "--endpoint",
            &url,
            "-q",
        ],
        &[("HF_ENDPOINT", "http://127.0.0.1:1")],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.stderr.is_empty(),
        "-q printed {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(rx.try_iter().count(), 1, "only the HEAD");
}

#[test]
fn pull_names_a_missing_file() {
    let (url, _rx) = hub(
        "/o/r/resolve/main/x.gguf",
        vec![1, 2, 3],
        sha256(&[1, 2, 3]),
    );
    let tmp = tempfile::tempdir().unwrap();
    let out = ds4(
        &[
            "pull",
            "--hf",
            "o/r/y.gguf",
            "--endpoint",
            &url,
            "--dir",
            tmp.path().to_str().unwrap(),
        ],
        &[],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no file y.gguf in repository o/r at revision main"),
        "{stderr}"
    );
}

#[test]
fn pull_q2_asks_the_published_repository() {
    let tmp = tempfile::tempdir().unwrap();
    let out = ds4(
        &[
            "pull",
            "q2",
            "--endpoint",
            "http://127.0.0.1:1",
            "--retries",
            "0",
            "--dir",
            tmp.path().to_str().unwrap(),
        ],
        &[],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "could not reach http://127.0.0.1:1/antirez/deepseek-v4-gguf/resolve/main/DeepSeek-V4-Flash-IQ2XXS-"
        ),
        "{stderr}"
    );
}

#[test]
fn pull_refuses_bad_names() {
    let out = ds4(&["pull"], &[]);
    assert!(!out.status.success());
    let out = ds4(&["pull", "--hf", "only/repo"], &[]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("bad --hf value \"only/repo\""), "{stderr}");
    let out = ds4(&["pull", "--hf", "o/r/../../etc/passwd"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("bad file"), "{stderr}");
    let out = ds4(&["pull", "q3"], &[]);
    assert!(!out.status.success());
}
