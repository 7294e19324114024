//! Shared test helpers: the tiny-hca16 oracle fixture converted to a GGUF once per test
//! binary, and `ds4` invocations on it.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `tests/fixtures/tiny-hca16` (HF transformers checkpoint) converted with `ds4-convert`
/// (f32, generated vocabulary) into a temporary directory that lives as long as the process.
pub fn tiny_gguf() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir").keep();
        let out = dir.join("tiny-hca16.gguf");
        let opts = ds4_convert::HfOptions::new("f32").expect("f32 recipe");
        ds4_convert::convert_hf(
            &root().join("tests/fixtures/tiny-hca16"),
            &out,
            &opts,
            &mut ds4_convert::NoProgress,
        )
        .expect("converting tiny-hca16");
        out
    })
}

pub fn ds4_cmd() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ds4"));
    c.current_dir(root())
        .env_remove("RUST_LOG")
        .env("DS4_HISTORY", "");
    // Every placement variable (the override table), so plans do not depend on the caller.
    for d in ds4_placement::OVERRIDE_TABLE {
        c.env_remove(d.env);
    }
    c
}

pub fn ds4(args: &[&str]) -> Output {
    ds4_cmd().args(args).output().expect("running ds4")
}

/// Runs `cmd` with `input` on its stdin and returns everything it wrote (a chat script).
pub fn run_with_input(cmd: &mut Command, input: &str) -> Output {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running ds4");
    child
        .stdin
        .take()
        .expect("a stdin pipe")
        .write_all(input.as_bytes())
        .expect("writing the script");
    child.wait_with_output().expect("waiting for ds4")
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `(prefilled, reused)` of every status line in `stderr`.
pub fn status_lines(stderr: &str) -> Vec<(usize, usize)> {
    stderr
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("ds4: prefill ")?;
            let (pre, rest) = rest.split_once(" tokens (")?;
            let (reused, _) = rest.split_once(" reused)")?;
            Some((pre.parse().ok()?, reused.parse().ok()?))
        })
        .collect()
}
