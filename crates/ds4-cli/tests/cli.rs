//! End-to-end tests of the `ds4` binary's inspect and plan commands.

use std::path::PathBuf;
use std::process::{Command, Output};

/// `ds4` with none of the placement environment variables the plans below depend on (every
/// row of the override table), so a developer's or CI's settings cannot change a result.
fn ds4(args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ds4"));
    c.args(args).current_dir(root());
    for d in ds4_placement::OVERRIDE_TABLE {
        c.env_remove(d.env);
    }
    c.output().unwrap()
}

/// `ds4 --print-config ARGS` with only the variables in `env` of those the settings read.
fn print_config(args: &[&str], env: &[(&str, &str)]) -> Output {
    use ds4_runtime::config::*;
    let mut c = Command::new(env!("CARGO_BIN_EXE_ds4"));
    c.arg("--print-config").args(args).current_dir(root());
    let settings = [
        QUALITY_ENV,
        WARMUP_ENV,
        PREFILL_TILES_ENV,
        EXPERT_READAHEAD_ENV,
        PROFILE_ENV,
        LOAD_THREADS_ENV,
        LOAD_STAGING_ENV,
    ];
    for v in settings
        .into_iter()
        .chain(ds4_placement::OVERRIDE_TABLE.iter().map(|d| d.env))
    {
        c.env_remove(v);
    }
    c.envs(env.iter().copied());
    c.output().unwrap()
}

/// The printed row of setting `name` (`name  value  (source)`).
fn config_row(out: &str, name: &str) -> String {
    out.lines()
        .find(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with("  "))
        })
        .unwrap_or_else(|| panic!("no row {name:?} in\n{out}"))
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// `ds4 --print-config` says what each setting is and where it came from: the default, a
/// variable, or a flag over the variable; an unreadable variable is refused by name.
#[test]
fn print_config_names_each_settings_source() {
    let o = print_config(&[], &[]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let s = stdout(&o);
    assert_eq!(config_row(&s, "precision"), "precision fast (default)");
    assert_eq!(
        config_row(&s, "prefill tiles"),
        "prefill tiles experts (default)"
    );
    assert_eq!(
        config_row(&s, "weights memory"),
        "weights memory auto (default)"
    );

    let o = print_config(
        &[],
        &[
            ("DS4_QUALITY", "1"),
            ("DS4_WEIGHTS_MEM", "host"),
            ("DS4_WARMUP", "off"),
        ],
    );
    let s = stdout(&o);
    assert_eq!(
        config_row(&s, "precision"),
        "precision quality (DS4_QUALITY=1)"
    );
    assert_eq!(
        config_row(&s, "prefill tiles"),
        "prefill tiles off (DS4_QUALITY=1)"
    );
    assert_eq!(
        config_row(&s, "  tensor-core attention"),
        "tensor-core attention off (DS4_QUALITY=1)"
    );
    assert_eq!(
        config_row(&s, "weights memory"),
        "weights memory host (DS4_WEIGHTS_MEM=host)"
    );
    assert_eq!(config_row(&s, "warm-up"), "warm-up off (DS4_WARMUP=off)");

    let o = print_config(&["--quality", "--no-warmup"], &[("DS4_QUALITY", "0")]);
    let s = stdout(&o);
    assert_eq!(config_row(&s, "precision"), "precision quality (--quality)");
    assert_eq!(config_row(&s, "warm-up"), "warm-up off (--no-warmup)");

    let o = print_config(&[], &[("DS4_WARMUP", "maybe")]);
    assert_ne!(o.status.code(), Some(0));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("DS4_WARMUP"), "{e}");
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

const TINY: &str = "tests/fixtures/inspect/tiny-layout.gguf";

#[test]
fn inspect_tiny_fixture_text_and_json() {
    let o = ds4(&["inspect", TINY]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let s = stdout(&o);
    assert!(s.contains("verdict     VALID (layout rules"), "{s}");
    assert!(s.contains("deepseek4.block_count"), "{s}");
    let o = ds4(&["inspect", TINY, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["verdict"]["valid"], true);
    assert_eq!(v["n_tensors"], 116);
    let parts: u64 = v["verdict"]["per_token_parts"]
        .as_array()
        .unwrap()
        .iter()
        .take(10)
        .map(|p| p[1].as_u64().unwrap())
        .sum();
    assert_eq!(
        parts,
        v["verdict"]["bytes_per_token_short_ctx"].as_u64().unwrap()
    );
}

#[test]
fn inspect_refuses_with_reasons() {
    let dir = tempfile::tempdir().unwrap();
    // Not GGUF at all: exit 1 and the reason.
    let bad = dir.path().join("bad.gguf");
    std::fs::write(&bad, b"this is not a gguf file, just text").unwrap();
    let o = ds4(&["inspect", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("bad magic"));
    // Truncated model: exit 1, names the tensor past the end.
    let img = std::fs::read(root().join(TINY)).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &img[..img.len() - 5000]).unwrap();
    let o = ds4(&["inspect", cut.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("past the end"));
    // Valid GGUF, invalid model under ds4's rules: exit 2, with the problems listed.
    let o = ds4(&["inspect", TINY, "--rules", "ds4"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stdout(&o).contains("deepseek4.block_count = 4, expected 43"));
}

const MACHINES: &str = "crates/ds4-placement/machines";

#[test]
fn plan_stock_strix_halo_q2_puts_weights_in_pinned_host() {
    let m = format!("{MACHINES}/strix-halo-stock.json");
    let o = ds4(&[
        "plan",
        "--synthetic",
        "q2",
        "--machine",
        &m,
        "--ctx",
        "4096",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v.to_string().contains("pinned"), "{v}");
    let o = ds4(&[
        "plan",
        "--synthetic",
        "q2",
        "--machine",
        &m,
        "--ctx",
        "4096",
    ]);
    assert!(
        stdout(&o).contains("weights -> pinned host (80.76 GiB)"),
        "{}",
        stdout(&o)
    );
}

/// The native MXFP4 layout plans from its table: 145.26 GiB of weights (17 B per 32 expert
/// values) overflow an H200's budget into pinned host memory, by less than q4's.
#[test]
fn plan_synthetic_mxfp4_on_an_h200_is_hybrid() {
    let m = format!("{MACHINES}/h200-128g.json");
    let host_gib = |layout: &str| {
        let o = ds4(&["plan", "--synthetic", layout, "--machine", &m, "--json"]);
        assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["mode"], "hybrid", "{v}");
        let arenas = v["arenas"].as_array().unwrap();
        arenas
            .iter()
            .filter(|a| a["kind"] == "pinned_host")
            .map(|a| a["bytes"].as_u64().unwrap())
            .sum::<u64>() as f64
            / (1u64 << 30) as f64
    };
    let (mx, q4) = (host_gib("mxfp4"), host_gib("q4"));
    // q4's tensor data is 8.06 GiB larger (docs/gguf.md §7.1).
    assert!((q4 - mx - 8.06).abs() < 1.0, "mxfp4 {mx} GiB, q4 {q4} GiB");
    let o = ds4(&["plan", "--synthetic", "mxfp4", "--machine", &m]);
    let s = stdout(&o);
    assert!(s.contains("synthetic full-size mxfp4 layout"), "{s}");
}

#[test]
fn plan_small_discrete_gpu_is_hybrid_and_q4_on_strix_is_refused() {
    let m = format!("{MACHINES}/discrete-24g-64g.json");
    let o = ds4(&[
        "plan",
        "--synthetic",
        "q2",
        "--machine",
        &m,
        "--ctx",
        "4096",
    ]);
    assert_eq!(o.status.code(), Some(0));
    assert!(stdout(&o).contains("weights: hybrid"), "{}", stdout(&o));
    let m = format!("{MACHINES}/strix-halo-stock.json");
    // Resident only: otherwise it streams the experts (see below).
    let o = ds4(&[
        "plan",
        "--synthetic",
        "q4",
        "--machine",
        &m,
        "--experts",
        "resident",
    ]);
    assert_eq!(o.status.code(), Some(3));
    let s = stdout(&o);
    assert!(
        s.contains("REFUSED") && s.contains("q2 instead of q4"),
        "{s}"
    );
    // Overrides win and bad values are named.
    let o = ds4(&[
        "plan",
        "--synthetic",
        "q2",
        "--machine",
        &m,
        "--weights-mem",
        "sideways",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("sideways"));
    let o = ds4(&[
        "plan",
        "--synthetic",
        "q2",
        "--machine",
        &m,
        "--weights-mem",
        "device",
        "--experts",
        "resident",
    ]);
    assert_eq!(
        o.status.code(),
        Some(3),
        "forcing resident device weights on a 62 GiB pool must refuse"
    );
}

#[test]
fn plan_a_model_file_on_this_machine() {
    let o = ds4(&["plan", "-m", TINY, "--ctx", "2048", "--backend", "cpu"]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(stdout(&o).contains("CPU only"));
}

/// `ds4 plan --backend cuda` plans for the CUDA device it finds (its memory facts read
/// from the driver), and without one it fails naming CUDA instead of planning for a GPU
/// that is not there.
#[test]
fn plan_for_the_cuda_device_or_a_clear_error() {
    let o = ds4(&["plan", "-m", TINY, "--ctx", "2048", "--backend", "cuda"]);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!err.contains("panicked"), "{err}");
    let has_cuda = ds4_gpu::cuda::CudaDevice::count().is_ok_and(|n| n > 0);
    if has_cuda {
        assert_eq!(o.status.code(), Some(0), "{err}");
        assert!(stdout(&o).contains("CUDA device 0"), "{}", stdout(&o));
    } else {
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains("CUDA"), "{err}");
    }
}

#[test]
fn plan_streams_experts_where_nothing_resident_fits() {
    for (machine, cache) in [
        ("discrete-16g-32g", "GiB in device"),
        ("cpu-64g", "GiB in host (pageable)"),
    ] {
        let m = format!("{MACHINES}/{machine}.json");
        let o = ds4(&["plan", "--synthetic", "q2", "--machine", &m]);
        let s = stdout(&o);
        assert_eq!(o.status.code(), Some(0), "{machine}: {s}");
        assert!(s.contains("weights: streamed routed experts"), "{s}");
        assert!(s.contains(cache), "{machine}: {s}");
        assert!(
            s.contains("hit rate") && s.contains("ASSUMED") && s.contains("tok/s"),
            "{s}"
        );
        // Asked to keep experts resident, the same machine refuses.
        let o = ds4(&[
            "plan",
            "--synthetic",
            "q2",
            "--machine",
            &m,
            "--experts",
            "resident",
        ]);
        assert_eq!(o.status.code(), Some(3), "{machine}");
        // The cache capped by --expert-cache-gib (606 whole units of 6.75 MiB in 4 GiB);
        // below the minimum (3.70 GiB) refused.
        let capped = |gib: &str| {
            ds4(&[
                "plan",
                "--synthetic",
                "q2",
                "--machine",
                &m,
                "--expert-cache-gib",
                gib,
            ])
        };
        let o = capped("4");
        assert_eq!(o.status.code(), Some(0), "{machine}: {}", stdout(&o));
        assert!(
            stdout(&o).contains("cache 3.99 GiB") && stdout(&o).contains("(606 units)"),
            "{machine}: {}",
            stdout(&o)
        );
        assert_eq!(capped("1").status.code(), Some(3), "{machine}");
    }
}

#[test]
fn inspect_of_a_missing_file_names_the_cause_once() {
    let o = ds4(&["inspect", "no-such-file.gguf"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no-such-file.gguf"), "{err}");
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
}

/// The 24 GB + 64 GB box, routed experts forced resident: the context remedy is the largest
/// context whose plan fits (the plan re-sizes scratch for it), and that command fits.
#[test]
fn plan_refusal_offers_the_largest_context_that_fits() {
    let m = "crates/ds4-placement/machines/discrete-24g-64g.json";
    let o = ds4(&[
        "plan",
        "--synthetic",
        "q2",
        "--machine",
        m,
        "--experts",
        "resident",
    ]);
    assert_eq!(o.status.code(), Some(3));
    let text = format!("{}{}", stdout(&o), String::from_utf8_lossy(&o.stderr));
    let ctx: u64 = text
        .split("--ctx ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no --ctx remedy: {text}"));
    let fits = |c: u64| {
        ds4(&[
            "plan",
            "--synthetic",
            "q2",
            "--machine",
            m,
            "--experts",
            "resident",
            "--ctx",
            &c.to_string(),
        ])
        .status
        .code()
    };
    assert_eq!(fits(ctx), Some(0), "--ctx {ctx}");
    assert_eq!(fits(ctx + 1), Some(3), "--ctx {}", ctx + 1);
}

/// A 24 GB machine without a GPU plans the q2 model with streamed experts and the minimum
/// cache; it used to refuse with an empty reason.
#[test]
fn plan_on_a_24g_cpu_machine_streams() {
    let o = ds4(&[
        "plan",
        "--synthetic",
        "q2",
        "--machine",
        "crates/ds4-placement/machines/cpu-24g.json",
    ]);
    let out = stdout(&o);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("streamed routed experts"), "{out}");
}
