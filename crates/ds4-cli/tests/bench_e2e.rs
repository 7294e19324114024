//! `ds4-bench --e2e` on the CPU backend with the tiny fixture: the CLI's load and one-shot
//! path runs and reports load time and rates for exactly the requested tokens.

mod common;

use std::process::Command;

use common::{root, tiny_gguf};

#[test]
fn e2e_runs_the_cli_path_on_the_cpu_and_reports_rates() {
    let o = Command::new(env!("CARGO_BIN_EXE_ds4-bench"))
        .current_dir(root())
        .env_remove("DS4_QUALITY")
        .env_remove("DS4_WEIGHTS_MEM")
        .args([
            "--e2e",
            "-m",
            tiny_gguf().to_str().unwrap(),
            "--backend",
            "cpu",
            "--ctx",
            "256",
            "-n",
            "9",
            "--prompt-words",
            "30",
            "--prefill-chunk",
            "16",
        ])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "stdout:\n{out}\nstderr:\n{err}");
    let mut lines = out.lines();
    let head: Vec<&str> = lines.next().unwrap().split(',').collect();
    let row: Vec<&str> = lines.next().unwrap().split(',').collect();
    assert_eq!(head.len(), row.len());
    let get = |k: &str| -> f64 {
        let i = head.iter().position(|h| *h == k).unwrap();
        row[i].parse().unwrap()
    };
    assert_eq!(row[0], "e2e");
    assert_eq!(row[1], "fast");
    assert_eq!(get("generated"), 9.0);
    // The rendered prompt (system block, 30 words, template) is well over 30 tokens.
    assert!(get("prompt_tokens") > 30.0);
    for k in ["load_s", "prefill_s", "prefill_tok_s", "gen_s", "gen_tok_s"] {
        assert!(get(k) > 0.0, "{k} = {}", get(k));
    }
    // The CLI's own status line went to stderr, with the same counts.
    assert!(err.contains("generated 9 tokens"), "{err}");
    assert_eq!(row[head.iter().position(|h| *h == "draft").unwrap()], "off");
    assert_eq!(get("drafted"), 0.0);
}

/// `--draft lookup`: the CSV says what drafting did, and the counts add up.
#[test]
fn e2e_reports_drafting() {
    let o = Command::new(env!("CARGO_BIN_EXE_ds4-bench"))
        .current_dir(root())
        .env_remove("DS4_DRAFT")
        .args([
            "--e2e",
            "-m",
            tiny_gguf().to_str().unwrap(),
            "--backend",
            "cpu",
            "--ctx",
            "256",
            "-n",
            "24",
            "--prompt-words",
            "30",
            "--temp",
            "0",
            "--draft",
            "lookup",
            "--draft-max",
            "4",
        ])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let mut lines = out.lines();
    let head: Vec<&str> = lines.next().unwrap().split(',').collect();
    let row: Vec<&str> = lines.next().unwrap().split(',').collect();
    let get = |k: &str| -> f64 {
        row[head.iter().position(|h| *h == k).unwrap()]
            .parse()
            .unwrap()
    };
    assert_eq!(
        row[head.iter().position(|h| *h == "draft").unwrap()],
        "lookup"
    );
    assert_eq!(get("generated"), 24.0);
    assert!(get("drafted") >= get("accepted"));
    assert!(get("drafted") <= 4.0 * get("verify_steps"));
    if get("verify_steps") > 0.0 {
        let tps = (get("verify_steps") + get("accepted")) / get("verify_steps");
        assert!((get("tokens_per_step") - tps).abs() < 1e-3);
    }
}

#[test]
fn e2e_needs_a_model_file() {
    let o = Command::new(env!("CARGO_BIN_EXE_ds4-bench"))
        .args(["--e2e", "--synthetic", "q2"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--e2e needs -m FILE"), "{err}");
}

/// The frontier benchmark times device kernels and needs CUDA; without a device it says so
/// and names the flag that measures the CPU instead of stopping at "opening CUDA device 0".
#[test]
fn the_frontier_bench_without_cuda_names_the_cpu_path() {
    let o = Command::new(env!("CARGO_BIN_EXE_ds4-bench"))
        .current_dir(root())
        .args([
            "--synthetic",
            "q2",
            "--layers",
            "1",
            "--frontiers",
            "8",
            "--decode",
            "1",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    if o.status.success() {
        // A machine with a CUDA device ran it.
        return;
    }
    assert!(err.contains("needs a CUDA GPU"), "{err}");
    assert!(err.contains("--e2e -m MODEL --backend cpu"), "{err}");
    assert_eq!(
        err.lines().filter(|l| l.starts_with("error:")).count(),
        1,
        "{err}"
    );
}
