//! The `ds4-server` binary's `--parallel N` / `DS4_PARALLEL`: the placement plan budgets N KV
//! states, the startup report lists the slots, `/health` shows them, and a bad value is a
//! clear error naming the flag or the variable.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn server(args: &[&str]) -> Command {
    server_ctx("512", args)
}

fn server_ctx(ctx: &str, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ds4-server"));
    c.arg("-m")
        .arg(common::tiny_gguf())
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "-c",
            ctx,
            "--backend",
            "cpu",
        ])
        .args(args)
        .env_remove("DS4_PARALLEL")
        .env_remove("RUST_LOG")
        .env_remove("RUST_BACKTRACE");
    for d in ds4_placement::OVERRIDE_TABLE {
        c.env_remove(d.env);
    }
    c
}

/// Starts the server, returns its startup stderr and its `/health` body.
fn start_and_health(mut cmd: Command) -> (String, String) {
    let mut child = cmd
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
    let Some(addr) = addr else {
        let _ = child.kill();
        panic!("no listening line; stderr so far:\n{seen}")
    };
    let mut s = TcpStream::connect(&addr).unwrap();
    write!(
        s,
        "GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    (seen, body)
}

#[test]
fn the_flag_sizes_the_plan_and_the_slots() {
    let (seen, health) = start_and_health(server(&["--parallel", "3"]));
    assert!(seen.contains("3 KV states of ctx 512"), "{seen}");
    assert!(seen.contains("KV slots allocated"), "{seen}");
    assert!(
        seen.contains("ds4-server: 3 slots × 512 ctx, KV "),
        "{seen}"
    );
    assert!(health.contains("\"slots\":3"), "{health}");
}

/// 64 conversations at once (issue 51's upper end): planned, allocated and served.
#[test]
fn sixty_four_slots_start() {
    let (seen, health) = start_and_health(server(&["--parallel", "64"]));
    assert!(seen.contains("64 KV states of ctx 512"), "{seen}");
    assert!(
        seen.contains("ds4-server: 64 slots × 512 ctx, KV "),
        "{seen}"
    );
    assert!(health.contains("\"slots\":64"), "{health}");
}

/// More slots than the machine holds at this context: refused by the placement plan
/// before anything is allocated, naming the numbers and how many slots would fit (the
/// count itself is checked on a described machine in ds4-runtime's plan tests).
#[test]
fn slots_that_do_not_fit_are_refused_with_what_fits() {
    // More KV than any machine's memory: 64 states of a billion tokens each.
    let o = server_ctx("1000000000", &["--parallel", "64"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    for want in [
        "--parallel 64",
        "64 KV states of ctx 1000000000",
        "64 KV states of this context do not fit",
        "nothing was allocated",
    ] {
        assert!(err.contains(want), "{want:?} missing from {err}");
    }
    // Either the count that fits is named, or that not even one does.
    let fits = err
        .split("do (--parallel ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .and_then(|n| n.parse::<usize>().ok());
    match fits {
        Some(n) => assert!((1..64).contains(&n), "{err}"),
        None => assert!(err.contains("nor does one"), "{err}"),
    }
}
#[test]
fn the_variable_sets_the_slots_and_the_flag_wins() {
    let mut c = server(&[]);
    c.env("DS4_PARALLEL", "2");
    let (_, health) = start_and_health(c);
    assert!(health.contains("\"slots\":2"), "{health}");
    let mut c = server(&["--parallel", "1"]);
    c.env("DS4_PARALLEL", "2");
    let (seen, health) = start_and_health(c);
    assert!(health.contains("\"slots\":1"), "{health}");
    assert!(!seen.contains("KV states of"), "{seen}");
}

#[test]
fn bad_values_are_clear_errors() {
    let o = server(&["--parallel", "0"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("--parallel must be at least 1"), "{err}");
    let o = server(&[]).env("DS4_PARALLEL", "four").output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("DS4_PARALLEL"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
