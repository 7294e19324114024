//! The `ds4-server` binary's `--backend`: the same resolution and placement planning as the
//! `ds4` CLI. `auto` on a machine without a GPU serves on the CPU and says why; `cuda`
//! without a CUDA device exits with an error naming CUDA, never a panic or a half-started
//! server.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn server(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ds4-server"));
    c.arg("-m")
        .arg(common::tiny_gguf())
        .args(["--host", "127.0.0.1", "--port", "0", "-c", "512"])
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("RUST_BACKTRACE");
    // Every placement variable (the override table), so the plan does not depend on the caller.
    for d in ds4_placement::OVERRIDE_TABLE {
        c.env_remove(d.env);
    }
    c
}

#[test]
fn cuda_without_a_device_is_a_clear_error() {
    if ds4_gpu_probe() {
        // A CUDA machine would start serving; the GPU path is what the H200 runs cover.
        return;
    }
    let o = server(&["--backend", "cuda"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("CUDA"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(!err.contains("listening"), "{err}");
}

/// Whether this machine has a CUDA device (then the refusal test has nothing to refuse).
fn ds4_gpu_probe() -> bool {
    Command::new(env!("CARGO_BIN_EXE_ds4-server"))
        .args(["--backend", "cuda", "-m", "/nonexistent.gguf"])
        .output()
        .map(|o| !String::from_utf8_lossy(&o.stderr).contains("CUDA is not available"))
        .unwrap_or(false)
}

#[test]
fn auto_prints_the_placement_and_serves() {
    let mut child = server(&["--backend", "auto"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let (mut seen, mut addr) = (String::new(), None);
    let t0 = Instant::now();
    while addr.is_none() && t0.elapsed() < Duration::from_secs(60) {
        let mut line = String::new();
        if err.read_line(&mut line).unwrap() == 0 {
            break;
        }
        if let Some(a) = line.trim().strip_prefix("ds4-server: listening on http://") {
            addr = Some(a.to_string());
        }
        seen.push_str(&line);
    }
    let addr = addr.unwrap_or_else(|| {
        let _ = child.kill();
        panic!("no listening line; stderr so far:\n{seen}")
    });
    // The load says where the weights go in one line (the whole plan with -v).
    assert!(seen.contains("ds4: placement: "), "{seen}");
    assert!(!seen.contains("placement plan for"), "{seen}");
    let mut s = TcpStream::connect(&addr).unwrap();
    // A loopback Host: other names are refused on a loopback server without a key.
    write!(
        s,
        "GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    assert!(body.contains("\"status\":\"ok\""), "{body}");
}
