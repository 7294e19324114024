//! The answer to a greedy request does not depend on what the caches hold (docs/server.md §9
//! "Prefill boundaries"): the same prompt evaluated cold — with no disk cache, or with an
//! empty one — resumed from a disk checkpoint that another conversation wrote at the end of
//! their shared system prefix, and resumed from in-memory turn snapshots of prompts that
//! ended at a cut position (the system prefix, a grid line after it) gives the same tokens
//! and the same log-probabilities, bit for bit, in exact and official mode.
//!
//! The demo model (q2 experts, Q8_0 attention) is used because int8 activations apply to
//! it: a prompt piece of at most 32 tokens runs as decode rows (docs/forward.md §13), so a
//! piece cut elsewhere changes the bits of its rows on the CPU. The checkpoint settings are
//! the defaults (a cold checkpoint at a system prefix of at least 512 tokens).

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use common::{post, stats};
use ds4_engine::NumericMode;
use ds4_server::{DiskCacheConfig, LoadedModel, ModelOptions, Running, Server, ServerConfig};
use serde_json::{json, Value};

const BOS: &str = "<｜begin▁of▁sentence｜>";
const USER: &str = "<｜User｜>";
const ASSISTANT: &str = "<｜Assistant｜>";

/// Tokens of one forward pass (and so the step's prefill grid).
const CHUNK: usize = 64;

fn demo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/demo/ds4-demo.gguf")
}

async fn start(cfg: ServerConfig, mode: NumericMode) -> Running {
    let m = tokio::task::spawn_blocking(move || {
        LoadedModel::open(
            &demo(),
            &ModelOptions {
                ctx: 1024,
                threads: 2,
                prefill_chunk: CHUNK,
                mode: Some(mode),
            },
        )
        .unwrap()
    })
    .await
    .unwrap();
    Server::bind(SocketAddr::from(([127, 0, 0, 1], 0)), cfg, m)
        .await
        .unwrap()
        .spawn()
}

/// A disk cache with the default checkpoint settings.
fn with_disk(dir: &Path) -> ServerConfig {
    ServerConfig {
        disk: Some(DiskCacheConfig {
            budget_bytes: 256 << 20,
            ..DiskCacheConfig::new(dir)
        }),
        ..ServerConfig::default()
    }
}

/// A system prompt of a little over 512 tokens (the checkpoints' minimum) whose end lies
/// within 32 tokens after a 64-token grid line: the piece that ends there runs as decode
/// rows.
fn system() -> String {
    let mut s = String::from("You are a careful assistant for a small shop.");
    let rules = [
        " Answer briefly and politely.",
        " Prices are in euros.",
        " The shop opens at nine and closes at six.",
        " Never invent stock that is not listed.",
        " Ask before you order anything.",
        " Keep a friendly tone with every customer.",
        " Say so when you do not know.",
        " Mention the opening hours when a customer asks to visit.",
        " Offer a discount only when the manager has approved it.",
    ];
    for k in 0..64 {
        s.push_str(rules[k % rules.len()]);
    }
    s
}

fn prompt(user: &str) -> String {
    format!("{BOS}{}{USER}{user}{ASSISTANT}</think>", system())
}

/// A greedy completion of `text`: (tokens, log-probabilities as sent, `cached_tokens`).
async fn complete(a: SocketAddr, text: &str, n: usize) -> (Vec<String>, Vec<String>, u64) {
    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt": text, "max_tokens": n, "temperature": 0, "logprobs": 1}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let lp = &v["choices"][0]["logprobs"];
    let strings = |k: &str| -> Vec<String> {
        lp[k]
            .as_array()
            .unwrap_or_else(|| panic!("no logprobs.{k}: {v}"))
            .iter()
            .map(Value::to_string)
            .collect()
    };
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    (strings("tokens"), strings("token_logprobs"), cached)
}

async fn tokens(a: SocketAddr, text: &str) -> Vec<u64> {
    post(a, "/tokenize", &json!({ "content": text }))
        .await
        .json()["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

async fn same_answer_whatever_is_cached(mode: NumericMode) {
    const N: usize = 24;
    let question = "Do you have green tea in stock, and what does a box of it cost today? \
                    I would also like to know whether you deliver to the next town, and \
                    how long a delivery usually takes in winter. My neighbour asked me to \
                    buy two boxes for her as well, so please tell me if there is a price for \
                    three boxes together and whether you can keep them for me until Friday.";
    let p = prompt(question);

    // Cold, no disk cache at all.
    let srv = start(ServerConfig::default(), mode).await;
    let s = tokens(srv.addr, &format!("{BOS}{}", system())).await.len();
    let ids = tokens(srv.addr, &p).await;
    let grid = s.next_multiple_of(CHUNK);
    assert!(
        s >= 512 && s % CHUNK > 0 && s % CHUNK <= 32 && ids.len() > grid + 8,
        "system prefix {s} / prompt {}: pick texts whose prefix ends just past a grid line",
        ids.len()
    );
    // The prompt's text up to that grid line: a prompt that ends on the grid after the
    // system prefix (its tokens are the prompt's first ones).
    let upto_grid: String = post(srv.addr, "/detokenize", &json!({"tokens": &ids[..grid]}))
        .await
        .json()["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(tokens(srv.addr, &upto_grid).await, ids[..grid]);
    let cold = complete(srv.addr, &p, N).await;
    assert_eq!(cold.2, 0);
    assert!(
        cold.0.len() >= 8,
        "{mode}: a short answer compares little: {:?}",
        cold.0
    );
    srv.shutdown().await.unwrap();

    // Cold with an empty disk cache: it checkpoints at the end of the system prefix.
    let dir = tempfile::tempdir().unwrap();
    let srv = start(with_disk(dir.path()), mode).await;
    let empty = complete(srv.addr, &p, N).await;
    assert_eq!(empty.2, 0);
    assert_eq!(stats(srv.addr).await["disk_stores"], 1);
    srv.shutdown().await.unwrap();

    // Another conversation with the same system prompt writes that checkpoint; a new
    // server resumes the prompt from it.
    let dir = tempfile::tempdir().unwrap();
    let srv = start(with_disk(dir.path()), mode).await;
    complete(srv.addr, &prompt("Hello, who are you?"), 2).await;
    srv.shutdown().await.unwrap();
    let srv = start(with_disk(dir.path()), mode).await;
    let disk = complete(srv.addr, &p, N).await;
    assert_eq!(
        disk.2 as usize, s,
        "{mode}: resumed from the system-prefix checkpoint"
    );
    assert_eq!(stats(srv.addr).await["disk_hits"], 1);
    srv.shutdown().await.unwrap();

    // In memory: a prompt that ends at the system prefix, or at the grid line after it,
    // leaves its turn snapshot there.
    let mut mem = Vec::new();
    for (q, at) in [(format!("{BOS}{}", system()), s), (upto_grid, grid)] {
        let srv = start(ServerConfig::default(), mode).await;
        complete(srv.addr, &q, 1).await;
        let run = complete(srv.addr, &p, N).await;
        assert_eq!(run.2 as usize, at, "{mode}: resumed from the turn snapshot");
        assert_eq!(stats(srv.addr).await["snapshot_hits"], 1);
        srv.shutdown().await.unwrap();
        mem.push(run);
    }

    let mut differ = Vec::new();
    for (name, run) in [
        ("an empty disk cache", &empty),
        ("a disk checkpoint", &disk),
        ("a turn snapshot at the system prefix", &mem[0]),
        ("a turn snapshot at the grid line after it", &mem[1]),
    ] {
        if run.0 != cold.0 {
            let at = run
                .0
                .iter()
                .zip(&cold.0)
                .take_while(|(a, b)| a == b)
                .count();
            differ.push(format!("tokens with {name} (from token {at})"));
        } else if run.1 != cold.1 {
            differ.push(format!("log-probabilities with {name}"));
        }
    }
    assert!(
        differ.is_empty(),
        "{mode}: the cold run without a disk cache differs from {}",
        differ.join(", ")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_answer_is_independent_of_the_cache_exact() {
    same_answer_whatever_is_cached(NumericMode::Exact).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_answer_is_independent_of_the_cache_official() {
    same_answer_whatever_is_cached(NumericMode::Official).await;
}
