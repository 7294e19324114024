//! Prefix reuse (live state, thinking-visible, turn snapshots), exact-DSML tool replay, and
//! the disk KV cache across a server restart. Every test checks the reused and the evaluated
//! token counts, both in `usage` and in the server's prefill counter.

mod common;

use common::*;
use ds4_server::{DiskCacheConfig, ServerConfig};
use serde_json::{json, Value};

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}
fn prompt(v: &Value) -> u64 {
    v["usage"]["prompt_tokens"].as_u64().unwrap()
}
fn completion(v: &Value) -> u64 {
    v["usage"]["completion_tokens"].as_u64().unwrap()
}
fn written(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cache_write_tokens"]
        .as_u64()
        .unwrap()
}
async fn prefilled(a: std::net::SocketAddr) -> u64 {
    stats(a).await["prefilled_tokens"].as_u64().unwrap()
}

async fn chat(a: std::net::SocketAddr, body: &Value) -> Value {
    let r = post(a, "/v1/chat/completions", body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_prefix_and_turn_snapshot_reuse() {
    let srv = start(scripted()).await;
    let a = srv.addr;
    let turn1 = json!({"think":false,"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"[plain] first"}]});
    let v1 = chat(a, &turn1).await;
    assert_eq!(cached(&v1), 0);
    assert_eq!(written(&v1), prompt(&v1));
    assert_eq!(prefilled(a).await, prompt(&v1));
    let reply = v1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(reply, "The answer is 42.");

    // Turn 2 extends the live state (prompt 1 + the generated reply): only the rest is evaluated.
    let turn2 = json!({"think":false,"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"[plain] first"},
                       {"role":"assistant","content":reply},{"role":"user","content":"[plain] second"}]});
    let before = prefilled(a).await;
    let v2 = chat(a, &turn2).await;
    assert_eq!(cached(&v2), prompt(&v1) + completion(&v1));
    assert_eq!(written(&v2), prompt(&v2) - cached(&v2));
    assert_eq!(prefilled(a).await - before, written(&v2));
    assert!(written(&v2) > 0 && written(&v2) < 20, "{}", written(&v2));

    // Regenerating turn 2: the live state went past the prompt; the turn snapshot serves it.
    let before = prefilled(a).await;
    let v3 = chat(a, &turn2).await;
    assert_eq!(cached(&v3), prompt(&v2));
    assert_eq!(written(&v3), 0);
    assert_eq!(prefilled(a).await, before);
    assert_eq!(stats(a).await["snapshot_hits"], 1);

    // An unrelated conversation is a cold prefill.
    let v4 = chat(
        a,
        &json!({"think":false,"messages":[{"role":"user","content":"[plain] other"}]}),
    )
    .await;
    assert_eq!(cached(&v4), 0);
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thinking_turns_reuse_the_hidden_reasoning() {
    let srv = start(scripted()).await;
    let a = srv.addr;
    let v1 = chat(
        a,
        &json!({"messages":[{"role":"user","content":"[think] hi"}]}),
    )
    .await;
    assert_eq!(
        v1["choices"][0]["message"]["reasoning_content"],
        "Let me think."
    );
    // The client replays the answer without its reasoning (thinking mode drops old reasoning),
    // which does not byte-match the live state; the thinking-visible binding still reuses it.
    let turn2 = json!({"messages":[{"role":"user","content":"[think] hi"},{"role":"assistant","content":"Hello there."},{"role":"user","content":"[plain] more"}]});
    let v2 = chat(a, &turn2).await;
    assert_eq!(cached(&v2), prompt(&v1) + completion(&v1));
    assert_eq!(written(&v2), prompt(&v2) - cached(&v2));
    srv.shutdown().await.unwrap();
}

/// Turn 1 makes the model call a tool; turn 2 sends the call back as JSON (keys reordered,
/// re-serialized) with the result. With exact replay the stored sampled DSML is rendered and
/// the whole live state is reused; canonical DSML differs (`&amp;` vs `&`), so without it
/// only the turn-1 prompt snapshot matches.
async fn tool_turns(exact: bool) -> (Value, Value, Value) {
    let cfg = ServerConfig {
        exact_dsml_replay: exact,
        ..scripted()
    };
    let srv = start(cfg).await;
    let a = srv.addr;
    let user = json!({"role":"user","content":"[tool] list"});
    let v1 = chat(
        a,
        &json!({"think":false,"tools":[bash_tool()],"messages":[user]}),
    )
    .await;
    let call = &v1["choices"][0]["message"]["tool_calls"][0];
    let id = call["id"].as_str().unwrap();
    let turn2 = json!({"think":false,"tools":[bash_tool()],"messages":[user,
        {"role":"assistant","content":"Sure.","tool_calls":[{"id":id,"type":"function","function":{"name":"bash","arguments":"{\"timeout\": 10, \"command\": \"ls -la & pwd\"}"}}]},
        {"role":"tool","tool_call_id":id,"content":"a.txt"},
        {"role":"user","content":"[plain] thanks"}]});
    let v2 = chat(a, &turn2).await;
    let s = stats(a).await;
    srv.shutdown().await.unwrap();
    (v1, v2, s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_dsml_replay_keeps_the_live_prefix() {
    let (v1, v2, s) = tool_turns(true).await;
    assert_eq!(v1["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(cached(&v2), prompt(&v1) + completion(&v1));
    assert_eq!(s["exact_replays"], 1);
    let (v1, v2, s) = tool_turns(false).await;
    assert_eq!(
        cached(&v2),
        prompt(&v1),
        "canonical DSML: only the snapshot of prompt 1 matches"
    );
    assert_eq!(s["exact_replays"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_tool_result_turn_reuses_the_live_state() {
    let srv = start(scripted()).await;
    let a = srv.addr;
    let tools = json!([{"name":"bash","input_schema":{"type":"object","properties":{"command":{"type":"string"}}}}]);
    let user = json!({"role":"user","content":"[thinktool] go"});
    let r = post(
        a,
        "/v1/messages",
        &json!({"max_tokens":300,"tools":tools,"messages":[user]}),
    )
    .await
    .json();
    assert_eq!(r["stop_reason"], "tool_use");
    let content = r["content"].as_array().unwrap();
    let tu = content.iter().find(|b| b["type"] == "tool_use").unwrap();
    let u1 = &r["usage"];
    let p1 = u1["cache_read_input_tokens"].as_u64().unwrap()
        + u1["cache_creation_input_tokens"].as_u64().unwrap();
    // Claude Code style: thinking + text + tool_use replayed, input re-serialized by the client.
    let turn2 = json!({"max_tokens":50,"tools":tools,"messages":[user,
        {"role":"assistant","content":[{"type":"thinking","thinking":"I should run ls.","signature":r["id"]},{"type":"text","text":"Sure."},
                                        {"type":"tool_use","id":tu["id"],"name":"bash","input":{"timeout":10,"command":"ls -la & pwd"}}]},
        {"role":"user","content":[{"type":"tool_result","tool_use_id":tu["id"],"content":"a.txt"},{"type":"text","text":"[think]"}]}]});
    let r2 = post(a, "/v1/messages", &turn2).await.json();
    assert_eq!(r2["content"][0]["type"], "thinking", "{r2}");
    assert_eq!(
        r2["usage"]["cache_read_input_tokens"].as_u64().unwrap(),
        p1 + u1["output_tokens"].as_u64().unwrap()
    );
    srv.shutdown().await.unwrap();
}

fn disk_cfg(dir: &std::path::Path) -> ServerConfig {
    ServerConfig {
        disk: Some(DiskCacheConfig {
            min_tokens: 8,
            continued_interval_tokens: 0,
            boundary_trim_tokens: 0,
            boundary_align_tokens: 0,
            budget_bytes: 256 << 20,
            ..DiskCacheConfig::new(dir)
        }),
        snapshot_slots: 0,
        ..scripted()
    }
}

fn kv_files(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".kv")
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_kv_cache_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let system = json!({"role":"system","content":"You are a terse assistant."});
    let turn1 = json!({"think":false,"messages":[system,{"role":"user","content":"[plain] first question"}]});

    // Server 1: a cold prompt is checkpointed at its shared system prefix; the live state is
    // saved at shutdown.
    let srv = start(disk_cfg(dir.path())).await;
    let v1 = chat(srv.addr, &turn1).await;
    assert_eq!(cached(&v1), 0);
    let sys_tokens = post(
        srv.addr,
        "/tokenize",
        &json!({"content":"<｜begin▁of▁sentence｜>You are a terse assistant."}),
    )
    .await
    .json()["count"]
        .as_u64()
        .unwrap();
    assert_eq!(stats(srv.addr).await["disk_stores"], 1, "cold checkpoint");
    srv.shutdown().await.unwrap();
    assert_eq!(kv_files(dir.path()), 2, "cold + shutdown checkpoints");

    // Server 2, same directory: turn 2 continues from the shutdown checkpoint; only the new
    // suffix is evaluated.
    let srv = start(disk_cfg(dir.path())).await;
    let a = srv.addr;
    assert_eq!(prefilled(a).await, 0);
    let turn2 = json!({"think":false,"messages":[system,{"role":"user","content":"[plain] first question"},
                       {"role":"assistant","content":"The answer is 42."},{"role":"user","content":"[plain] second"}]});
    let v2 = chat(a, &turn2).await;
    assert_eq!(cached(&v2), prompt(&v1) + completion(&v1));
    assert_eq!(written(&v2), prompt(&v2) - cached(&v2));
    assert_eq!(
        prefilled(a).await,
        written(&v2),
        "the restored prefix was not re-prefilled"
    );
    assert_eq!(stats(a).await["disk_hits"], 1);

    // Another conversation with the same system prompt starts from the cold checkpoint.
    let v3 = chat(
        a,
        &json!({"think":false,"messages":[system,{"role":"user","content":"[plain] unrelated"}]}),
    )
    .await;
    assert_eq!(cached(&v3), sys_tokens);
    assert_eq!(stats(a).await["disk_hits"], 2);
    srv.shutdown().await.unwrap();

    // A corrupt entry is never loaded: it is reported and removed, and the prompt is cold.
    for e in std::fs::read_dir(dir.path()).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "kv") {
            let mut b = std::fs::read(&p).unwrap();
            let n = b.len();
            b[n - 100] ^= 0xff;
            std::fs::write(&p, b).unwrap();
        }
    }
    let srv = start(disk_cfg(dir.path())).await;
    let v = chat(srv.addr, &turn2).await;
    assert_eq!(cached(&v), 0);
    assert!(stats(srv.addr).await["disk_rejected"].as_u64().unwrap() >= 1);
    srv.shutdown().await.unwrap();
}

/// Token counts of the disk entries in `dir` (the header's token count, bytes 64..72).
fn entry_lengths(dir: &std::path::Path) -> Vec<u64> {
    let mut out: Vec<u64> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "kv"))
        .map(|p| {
            let b = std::fs::read(p).unwrap();
            u64::from_le_bytes(b[64..72].try_into().unwrap())
        })
        .collect();
    out.sort_unstable();
    out
}

/// `continued` checkpoints land on the multiples of the step (docs/server.md §11), counted
/// from the first token whatever the slot was resumed from: they are prefill cut positions
/// (§9 "Prefill boundaries"), so a later prompt resumed from one is cut as it would be cold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continued_checkpoints_land_on_multiples_of_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = |dir: &std::path::Path| ServerConfig {
        disk: Some(DiskCacheConfig {
            min_tokens: 8,
            continued_interval_tokens: 64,
            boundary_trim_tokens: 0,
            boundary_align_tokens: 0,
            budget_bytes: 256 << 20,
            ..DiskCacheConfig::new(dir)
        }),
        snapshot_slots: 0,
        ..ServerConfig::default()
    };
    let words = |n: usize, w: &str| -> String { (0..n).map(|i| format!("{w}{i} ")).collect() };
    let complete = |a, prompt: String| async move {
        let r = post(
            a,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 3, "temperature": 0}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };

    // A cold prompt past two multiples of 64: `continued` at 64 and 128, `cold` at its
    // whole length (no trim, no alignment), `shutdown` after its answer.
    let srv = start(cfg(dir.path())).await;
    let p1 = words(52, "w");
    let v1 = complete(srv.addr, p1.clone()).await;
    let n1 = prompt(&v1);
    let live = n1 + completion(&v1);
    assert!(n1 > 128 && live < 192, "{n1} {live}");
    srv.shutdown().await.unwrap();
    assert_eq!(entry_lengths(dir.path()), vec![64, 128, n1, live]);

    // Resumed from the cold checkpoint, off the grid: the next saves are 192 and 256, not
    // that length plus 64.
    let srv = start(cfg(dir.path())).await;
    let v2 = complete(srv.addr, format!("{p1}{}", words(45, "x"))).await;
    assert_eq!(cached(&v2), n1);
    assert!(prompt(&v2) > 256, "{}", prompt(&v2));
    assert_eq!(stats(srv.addr).await["disk_stores"], 2);
    srv.shutdown().await.unwrap();
    let lens = entry_lengths(dir.path());
    assert!(
        lens.contains(&192) && lens.contains(&256) && !lens.contains(&(n1 + 64)),
        "{lens:?}"
    );
}
