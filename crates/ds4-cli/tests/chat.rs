//! One-shot generation and the interactive chat on the tiny oracle model: stdin scripts for
//! turns and every slash command, SIGINT to the child mid-generation, and a pseudo-terminal
//! for the line editor, colours and Ctrl+C keys.

mod common;

use std::io::{Read, Write};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{ds4, ds4_cmd, run_with_input, status_lines, text, tiny_gguf};

/// Greedy, no reasoning, short answers: deterministic output.
fn base_args(ctx: &str, n: &str) -> Vec<String> {
    let m = tiny_gguf().to_str().unwrap().to_string();
    [
        "-m",
        &m,
        "--backend",
        "cpu",
        "-c",
        ctx,
        "-n",
        n,
        "--temp",
        "0",
        "--nothink",
        "-q",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn chat(script: &str, extra: &[&str]) -> (Option<i32>, String, String) {
    let mut args = base_args("512", "6");
    args.extend(extra.iter().map(|s| s.to_string()));
    let o = run_with_input(ds4_cmd().args(&args), script);
    (o.status.code(), text(&o.stdout), text(&o.stderr))
}

#[test]
fn one_shot_streams_plain_text_and_reports_load_and_rates() {
    let mut args = base_args("256", "8");
    args.retain(|a| a != "-q");
    args.extend(["-p".to_string(), "Hello there".to_string()]);
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = ds4(&a);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    // By default one line per load decision: the placement in one line, not the table.
    assert!(
        err.contains("ds4: placement: CPU, no GPU, weights"),
        "{err}"
    );
    assert!(!err.contains("placement plan for"), "{err}");
    assert!(err.contains("mode official · backend cpu"), "{err}");
    assert!(err.lines().count() <= 4, "{err}");
    // -v: the whole plan; -q: nothing on stderr, the same answer on stdout.
    let mut verbose = a.clone();
    verbose.push("-v");
    let ov = ds4(&verbose);
    assert!(
        text(&ov.stderr).contains("placement plan for"),
        "{}",
        text(&ov.stderr)
    );
    let mut quiet = a.clone();
    quiet.push("-q");
    let oq = ds4(&quiet);
    let qerr = text(&oq.stderr);
    assert!(qerr.trim().is_empty(), "{qerr}");
    assert_eq!(text(&oq.stdout), text(&o.stdout));
    let st = status_lines(&err);
    assert_eq!(st.len(), 1, "{err}");
    assert_eq!(st[0].1, 0);
    assert!(
        err.contains("generated 8 tokens") || err.contains("generated"),
        "{err}"
    );
    assert!(!o.stdout.is_empty());
    // Thinking mode on a pipe: reasoning is plain text, no colour codes.
    let mut targs = base_args("256", "40");
    targs.retain(|x| x != "--nothink");
    targs.extend(["-p".to_string(), "go on".to_string()]);
    let t: Vec<&str> = targs.iter().map(String::as_str).collect();
    let th = ds4(&t);
    assert_eq!(th.status.code(), Some(0), "{}", text(&th.stderr));
    let ts = text(&th.stdout);
    assert!(
        !ts.is_empty() && !ts.contains("\x1b[90m") && !ts.contains("\x1b[0m"),
        "{ts:?}"
    );
    // Greedy is deterministic, and the chat's first turn renders the same tokens
    // (BOS + system + User + text + Assistant + </think>), so it answers the same.
    let again = ds4(&a);
    assert_eq!(again.stdout, o.stdout);
    let mut cargs = base_args("256", "8");
    cargs.retain(|x| x != "-q");
    let (code, out, err) = {
        let mut child = ds4_cmd()
            .args(&cargs)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(b"Hello there\n")
            .unwrap();
        let o = child.wait_with_output().unwrap();
        (o.status.code(), o.stdout, text(&o.stderr))
    };
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out, o.stdout);
}

#[test]
fn bad_flags_and_backends_are_refused() {
    let m = tiny_gguf().to_str().unwrap();
    // Without an AMD GPU (CI, which installs Debian's libamdhip64 for the hipcc check),
    // --backend rocm exits 1 with a clear reason and no crash: "no ROCm device" when the
    // runtime loads, "ROCm is not available" (listing the paths tried) when it does not.
    if !std::path::Path::new("/dev/kfd").exists() {
        let o = ds4(&["-m", m, "--backend", "rocm", "-p", "x"]);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
        let err = text(&o.stderr);
        let runtime = ds4_gpu::hip::HipRuntime::load().is_ok();
        if runtime {
            assert!(err.contains("no ROCm device"), "{err}");
            assert!(err.contains("no usable GPU"), "{err}");
        } else {
            assert!(err.contains("ROCm is not available"), "{err}");
            assert!(err.contains("libamdhip64"), "{err}");
        }
        assert!(!err.contains("panicked"), "{err}");
    }
    // Without a CUDA driver (CI), --backend cuda is refused with the reason; --backend
    // auto falls back to the CPU and says why.
    if ds4_gpu::cuda::CudaDevice::count().map_or(true, |n| n == 0) {
        let o = ds4(&["-m", m, "--backend", "cuda", "-p", "x"]);
        assert_eq!(o.status.code(), Some(1));
        assert!(text(&o.stderr).contains("CUDA"), "{}", text(&o.stderr));
        let o = ds4(&["-m", m, "--backend", "auto", "-n", "2", "-p", "x"]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
        assert!(
            text(&o.stderr).contains("backend auto -> cpu"),
            "{}",
            text(&o.stderr)
        );
        // The reason names both runtimes.
        if !std::path::Path::new("/dev/kfd").exists() {
            let err = text(&o.stderr);
            assert!(err.contains("ROCm"), "{err}");
        }
    }
    let o = ds4(&["-m", "/nonexistent.gguf", "-p", "x"]);
    assert!(text(&o.stderr).contains("model file /nonexistent.gguf not found"));
    let o = ds4(&["-m", m, "-n", "0", "-p", "x"]);
    assert!(text(&o.stderr).contains("-n/--tokens must be at least 1"));
    let o = ds4(&["-m", m, "--top-p", "0", "-p", "x"]);
    assert!(text(&o.stderr).contains("top_p"), "{}", text(&o.stderr));
    let o = ds4(&["--server"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("use ds4-server"));
    let o = ds4(&["-m", m, "-p", "a", "--prompt-file", "b"]);
    assert_eq!(o.status.code(), Some(2));
    // -sys is ds4's spelling of --system; the prompt no longer fits a tiny context.
    let o = ds4(&["-m", m, "-sys", &"word ".repeat(100), "-c", "64", "-p", "x"]);
    assert!(
        text(&o.stderr).contains("nothing left to generate"),
        "{}",
        text(&o.stderr)
    );
}

#[test]
fn chat_script_turns_and_every_slash_command() {
    let kv = tempfile::tempdir().unwrap();
    let file = kv.path().join("notes.txt");
    std::fs::write(&file, "The attached notes say: hello.").unwrap();
    let missing = kv.path().join("missing.txt");
    let script = format!(
        "hello there\n/help\n/nothink\nsecond turn\n/think\n/think-max\n/save early\nthird \\\nturn\n\
         /read {missing}\n/read {file}\nabout the file\n/list\n/save s1\n/ctx 400\nafter ctx\n\
         /reset\n/load s1\nafter load\n/load nope\n/frobnicate\n/ctx zero\n//slash text\n/quit\nnever sent\n",
        missing = missing.display(),
        file = file.display()
    );
    let (code, out, err) = chat(&script, &["--kv-disk-dir", kv.path().to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        !out.contains("\x1b[90m") && !out.contains("\x1b[0m"),
        "colour codes on a pipe: {out:?}"
    );
    let st = status_lines(&err);
    // hello, second, third (continued line), about the file, after ctx, after load, //slash.
    assert_eq!(st.len(), 7, "{err}");
    assert_eq!(st[0].1, 0, "first turn reuses nothing");
    for (i, s) in st.iter().enumerate().skip(1).take(3) {
        // Each turn extends the live state: only the new tokens are prefilled.
        assert!(
            s.1 > st[i - 1].1 && s.0 < 60,
            "turn {i}: {s:?} after {:?}\n{err}",
            st[i - 1]
        );
    }
    assert!(
        err.contains("Commands:") && err.contains("/read FILE"),
        "{err}"
    );
    assert!(err.contains("Thinking mode: off."));
    assert!(err.contains("Thinking mode: high."));
    assert!(err.contains("Thinking mode: high (ctx below 393216): Think Max needs a context of at least 393216 tokens; /ctx 393216 turns it on."));
    assert!(err.contains("saved session early"), "{err}");
    assert!(
        err.contains(&format!("cannot read {}", missing.display())),
        "{err}"
    );
    assert!(err.contains("No such file or directory"), "{err}");
    assert!(
        err.contains(&format!("attached {} (30 bytes)", file.display())),
        "{err}"
    );
    assert!(
        err.contains("early") && err.contains("sessions in"),
        "{err}"
    );
    assert!(err.contains("saved session s1"), "{err}");
    assert!(err.contains("context is now 400 tokens"), "{err}");
    // /ctx: a new session, so the kept transcript is prefilled again.
    assert_eq!(st[4].1, 0, "{err}");
    assert!(err.contains("new conversation"));
    assert!(err.contains("loaded session s1"), "{err}");
    // After /load the restored state is reused: only the new turn is prefilled.
    let saved: usize = err
        .split("saved session s1 (")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("saved token count");
    assert!(
        err.contains(&format!("loaded session s1 ({saved} tokens")),
        "{err}"
    );
    assert_eq!(st[5].1, saved, "{err}");
    assert!(st[5].0 < 30, "{:?}", st[5]);
    assert!(
        err.contains("no session named \"nope\" (saved: early, s1)"),
        "{err}"
    );
    assert!(err.contains("unknown command /frobnicate (type /help for the list)"));
    assert!(err.contains("/ctx needs a positive number of tokens"));
    assert!(!err.contains("never sent"));
}

#[test]
fn disk_commands_without_a_store_explain_the_flag() {
    let (code, _, err) = chat("/save x\n/list\n/load x\n", &[]);
    assert_eq!(code, Some(0));
    assert_eq!(
        err.matches("start ds4 with --kv-disk-dir DIR").count(),
        3,
        "{err}"
    );
}

/// Collects a pipe's bytes on a thread.
fn reader(mut r: impl Read + Send + 'static) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = r.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    rx
}

/// Waits until `acc` (fed from `rx`) satisfies `done`.
fn wait_for(
    rx: &mpsc::Receiver<Vec<u8>>,
    acc: &mut Vec<u8>,
    what: &str,
    done: &dyn Fn(&[u8]) -> bool,
) {
    let t0 = Instant::now();
    while !done(acc) {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(b) => acc.extend(b),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(_) => panic!("stream closed while waiting for {what}: {}", text(acc)),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "timed out waiting for {what}: {}",
            text(acc)
        );
    }
}

fn sigint(child: &Child) {
    let ok = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
}

#[test]
fn sigint_interrupts_generation_and_keeps_the_session() {
    // No EOS, -n large and a roomy context: generation runs until interrupted.
    let mut args = base_args("16384", "100000");
    args.push("--ignore-eos".into());
    args.push("--quiet".into());
    args.retain(|a| a != "-q");
    let mut child = ds4_cmd()
        .args(&args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let out = reader(child.stdout.take().unwrap());
    let err = reader(child.stderr.take().unwrap());
    let (mut o, mut e) = (Vec::new(), Vec::new());
    wait_for(&err, &mut e, "the banner", &|b| {
        text(b).contains("ds4 chat")
    });
    stdin.write_all(b"hello there\n").unwrap();
    wait_for(&out, &mut o, "generated text", &|b| b.len() >= 16);
    sigint(&child);
    wait_for(&err, &mut e, "the interrupt note", &|b| {
        text(b).contains("ds4: prefill ")
    });
    assert!(
        text(&e).contains("interrupted; the partial answer stays in the conversation"),
        "{}",
        text(&e)
    );
    // The next turn reuses everything that was live: the prompt and the partial answer.
    let first = status_lines(&text(&e))[0];
    // The first answer's last bytes were written before its status line; collect them so
    // the next wait only counts the second answer.
    std::thread::sleep(Duration::from_millis(300));
    while let Ok(b) = out.try_recv() {
        o.extend(b);
    }
    stdin.write_all(b"and now?\n").unwrap();
    let before = o.len();
    wait_for(&out, &mut o, "second answer", &|b| b.len() >= before + 16);
    sigint(&child);
    wait_for(&err, &mut e, "second status", &|b| {
        status_lines(&text(b)).len() == 2
    });
    let second = status_lines(&text(&e))[1];
    assert!(
        second.1 > first.0,
        "reused {} of a transcript that had a {}-token prompt",
        second.1,
        first.0
    );
    assert!(second.0 < 20, "{second:?}");
    // Idle at the prompt: Ctrl+C once warns, twice exits (130).
    sigint(&child);
    wait_for(&err, &mut e, "the exit hint", &|b| {
        text(b).contains("Ctrl+C again to exit")
    });
    sigint(&child);
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "did not exit after two Ctrl+C"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(130));
    drop(stdin);
}

#[test]
fn pty_chat_dims_reasoning_and_handles_ctrl_c_keys() {
    use rexpect::process::WaitStatus;
    let home = tempfile::tempdir().unwrap();
    let mut cmd = ds4_cmd();
    // Default thinking: the tiny model's output is reasoning until it samples </think>.
    cmd.args([
        "-m",
        tiny_gguf().to_str().unwrap(),
        "--backend",
        "cpu",
        "-c",
        "16384",
        "-n",
        "100000",
        "--ignore-eos",
        "--temp",
        "0",
        "-q",
    ])
    .env("TERM", "xterm")
    .env_remove("NO_COLOR")
    .env("DS4_HISTORY", home.path().join("history"));
    let mut p = rexpect::session::spawn_command(cmd, Some(60_000)).unwrap();
    p.exp_string("ds4> ").unwrap();
    p.send_line("tell me a story").unwrap();
    p.exp_string("\x1b[90m").unwrap();
    std::thread::sleep(Duration::from_millis(100));
    // Ctrl+C during generation: a signal (the terminal is cooked while generating).
    p.send_control('c').unwrap();
    let answer = p
        .exp_string("interrupted; the partial answer stays")
        .unwrap();
    // The terminal does not echo the key into the answer.
    assert!(!answer.contains("^C"), "{answer:?}");
    p.exp_string("ds4: prefill").unwrap();
    p.exp_string("ds4> ").unwrap();
    p.send_line("/help").unwrap();
    p.exp_string("/think-max").unwrap();
    p.exp_string("ds4> ").unwrap();
    // Ctrl+C at the prompt: a key read by the editor; the second one exits.
    p.send_control('c').unwrap();
    p.exp_string("Ctrl+C again to exit").unwrap();
    p.send_control('c').unwrap();
    p.exp_eof().unwrap();
    match p.process().wait().unwrap() {
        WaitStatus::Exited(_, code) => assert_eq!(code, 0),
        other => panic!("unexpected status {other:?}"),
    }
    let hist = std::fs::read_to_string(home.path().join("history")).unwrap();
    assert!(
        hist.contains("tell me a story") && hist.contains("/help"),
        "{hist}"
    );
}
