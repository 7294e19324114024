//! `--parallel N`: several conversations served at once by one engine, their tokens decoded
//! together in batched steps and prompts evaluated a piece per step between them. Each
//! request must get exactly what it gets alone on a one-slot server (greedy: the same text;
//! seeded sampling: the same samples), whatever runs beside it, arrives during it or is
//! cancelled in the middle of it.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use ds4_server::ServerConfig;
use serde_json::{json, Value};

/// Both servers of a comparison run the same settings but the slot count: prompts are
/// evaluated in the same pieces, so the only difference is what runs beside a request.
fn cfg(parallel: usize) -> ServerConfig {
    ServerConfig {
        parallel,
        prefill_per_step: 16,
        // Keeps the streams overlapping on a fast machine (outputs do not depend on it).
        token_delay: Some(Duration::from_millis(2)),
        ..ServerConfig::default()
    }
}

/// A completion request on the real (random-weight) tiny model: greedy without a seed,
/// else sampled at temperature 0.9 with that seed.
fn completion(prompt: &str, max_tokens: u64, seed: Option<u64>) -> Value {
    // Without thinking: in a thinking mode the client's sampling knobs are ignored.
    let mut b = json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true, "think": false,
        "stream_options": {"include_usage": true}});
    match seed {
        None => b["temperature"] = json!(0),
        Some(s) => {
            b["temperature"] = json!(0.9);
            b["seed"] = json!(s);
        }
    }
    b
}

/// Text and usage of a finished completions stream.
#[derive(Debug, Clone, PartialEq)]
struct Got {
    text: String,
    finish: Value,
    completion_tokens: Value,
    prompt_tokens: Value,
}

fn collect(evs: &[SseEvent]) -> Got {
    let mut g = Got {
        text: String::new(),
        finish: Value::Null,
        completion_tokens: Value::Null,
        prompt_tokens: Value::Null,
    };
    assert_eq!(evs.last().map(|e| e.data.as_str()), Some("[DONE]"));
    for e in &evs[..evs.len() - 1] {
        let v = e.json();
        assert!(v.get("error").is_none(), "stream error: {v}");
        if let Some(c) = v["choices"].get(0) {
            g.text.push_str(c["text"].as_str().unwrap_or(""));
            if !c["finish_reason"].is_null() {
                g.finish = c["finish_reason"].clone();
            }
        }
        if !v["usage"].is_null() {
            g.completion_tokens = v["usage"]["completion_tokens"].clone();
            g.prompt_tokens = v["usage"]["prompt_tokens"].clone();
        }
    }
    g
}

async fn run_alone(a: SocketAddr, body: &Value) -> Got {
    let sse = Sse::open(a, "/v1/completions", body).await;
    assert_eq!(sse.status, 200);
    collect(&sse.all().await)
}

/// The requests of the comparisons: prompts of 1 to ~200 tokens (several prefill pieces
/// of 16), outputs of 5 to 48 tokens, greedy and seeded.
fn requests() -> Vec<Value> {
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(4);
    vec![
        completion("Once upon a time", 40, None),
        completion("x", 12, Some(7)),
        completion(&long, 30, None),
        completion("1, 2, 3, 4, 5,", 48, Some(99)),
        completion(&format!("{long} and then"), 5, Some(3)),
        completion("Dear diary, today", 25, None),
    ]
}

async fn references(reqs: &[Value]) -> Vec<Got> {
    let one = start(cfg(1)).await;
    let mut out = Vec::new();
    for r in reqs {
        out.push(run_alone(one.addr, r).await);
    }
    one.shutdown().await.unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_get_what_they_get_alone() {
    let reqs = requests();
    let want = references(&reqs).await;
    for w in &want {
        assert!(
            !w.text.is_empty() && w.completion_tokens.as_u64() > Some(0),
            "{w:?}"
        );
    }

    let srv = start(cfg(3)).await;
    let a = srv.addr;
    // 0 and 1 arrive together; 2 and 3 (the long prompt) arrive while they decode; the
    // rest queue until a slot frees (three slots for six requests).
    let mut first = Sse::open(a, "/v1/completions", &reqs[0]).await;
    let mut second = Sse::open(a, "/v1/completions", &reqs[1]).await;
    let mut head0 = vec![first.next().await.expect("a first chunk")];
    let head1 = vec![second.next().await.expect("a first chunk")];
    wait_stats(a, |s| s["running"] == 2).await;
    let mut later = Vec::new();
    for r in &reqs[2..] {
        let r = r.clone();
        later.push(tokio::spawn(async move { run_alone(a, &r).await }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    head0.push(first.next().await.expect("more of stream 0"));
    let mut evs0 = head0;
    evs0.extend(first.all().await);
    let mut evs1 = head1;
    evs1.extend(second.all().await);
    let mut got = vec![collect(&evs0), collect(&evs1)];
    for h in later {
        got.push(h.await.unwrap());
    }
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i} differs from the same request alone");
    }
    let s = stats(a).await;
    assert_eq!(s["slots"], 3);
    assert_eq!(s["requests"], 6);
    assert_eq!(
        (s["running"].clone(), s["queued"].clone()),
        (json!(0), json!(0))
    );
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_stream_leaves_the_others_intact() {
    let reqs = vec![
        completion("Once upon a time", 40, None),
        completion("It was a dark and stormy night", 60, Some(5)),
        completion("1, 2, 3, 4, 5,", 40, Some(11)),
    ];
    let want = references(&reqs).await;
    let srv = start(cfg(3)).await;
    let a = srv.addr;
    let mut streams = Vec::new();
    for r in &reqs {
        streams.push(Sse::open(a, "/v1/completions", r).await);
    }
    wait_stats(a, |s| s["running"] == 3).await;
    // The middle one goes away after a few chunks, while the other two decode.
    let mut middle = streams.remove(1);
    for _ in 0..4 {
        middle.next().await.expect("a chunk before cancelling");
    }
    drop(middle);
    wait_stats(a, |s| s["cancelled"] == 1).await;
    let mut got = Vec::new();
    for s in streams {
        got.push(collect(&s.all().await));
    }
    assert_eq!(got[0], want[0]);
    assert_eq!(got[1], want[2]);
    // The freed slot serves the next request as if nothing had happened there.
    assert_eq!(run_alone(a, &reqs[1]).await, want[1]);
    let s = wait_stats(a, |s| s["running"] == 0).await;
    assert_eq!(s["cancelled"], 1);
    srv.shutdown().await.unwrap();
}

/// A tool call of client `k`: its own command and timeout, streamed as argument fragments.
fn tool_answer(k: usize) -> String {
    DSML.replace("ls -la &amp; pwd", &format!("echo client{k}"))
        .replace(">10<", &format!(">{k}<"))
}

/// The loopback load test's parallel variant (BENCHMARKS.md "ds4-server load test"): 16
/// streaming clients on four slots, mixed prompt and answer lengths, every fourth client
/// hanging up mid-stream, two answering with a streamed tool call. Each client's answer is
/// forced and distinct (the engine still evaluates every token), so a lost, duplicated or
/// misrouted token shows as a wrong text or wrong tool arguments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_streaming_clients_on_four_slots() {
    const CLIENTS: usize = 16;
    let answer = |k: usize| -> String {
        (0..(2 + 3 * (k % 5)))
            .map(|i| format!("c{k}w{i} "))
            .collect::<String>()
    };
    let tools = |k: usize| k % 8 == 1;
    let rules: Vec<Value> = (0..CLIENTS)
        .map(|k| {
            let output = if tools(k) {
                format!("{}{}", answer(k), tool_answer(k))
            } else {
                answer(k)
            };
            json!({"when": format!("[client{k}]"), "output": output})
        })
        .collect();
    let script = ds4_server::Script::from_json(&Value::Array(rules).to_string()).unwrap();
    let srv = start(ServerConfig {
        parallel: 4,
        script: Some(std::sync::Arc::new(script)),
        ..ServerConfig::default()
    })
    .await;
    let a = srv.addr;
    let mut handles = Vec::new();
    for k in 0..CLIENTS {
        handles.push(tokio::spawn(async move {
            let filler = "lorem ipsum ".repeat(k * 2);
            let mut body = json!({
                "messages": [{"role": "user", "content": format!("{filler}[client{k}]")}],
                "think": false, "stream": true, "max_tokens": 400,
                "stream_options": {"include_usage": true}
            });
            if tools(k) {
                body["tools"] = json!([bash_tool()]);
            }
            tokio::time::sleep(Duration::from_millis(10 * (k as u64 % 5))).await;
            let mut sse = Sse::open(a, "/v1/chat/completions", &body).await;
            assert_eq!(sse.status, 200, "client {k}");
            if k % 4 == 3 {
                // Hang up after the role chunk and two deltas.
                for _ in 0..3 {
                    sse.next().await.expect("chunks before hanging up");
                }
                return None;
            }
            let evs = sse.all().await;
            assert_eq!(evs.last().map(|e| e.data.as_str()), Some("[DONE]"));
            let mut text = String::new();
            let mut args = String::new();
            let mut finish = Value::Null;
            let mut usage = Value::Null;
            for e in &evs[..evs.len() - 1] {
                let v = e.json();
                assert!(v.get("error").is_none(), "client {k}: {v}");
                if let Some(c) = v["choices"].get(0) {
                    text.push_str(c["delta"]["content"].as_str().unwrap_or(""));
                    if let Some(tc) = c["delta"]["tool_calls"].get(0) {
                        args.push_str(tc["function"]["arguments"].as_str().unwrap_or(""));
                    }
                    if !c["finish_reason"].is_null() {
                        finish = c["finish_reason"].clone();
                    }
                }
                if !v["usage"].is_null() {
                    usage = v["usage"].clone();
                }
            }
            if tools(k) {
                assert_eq!(finish, "tool_calls", "client {k}: {text:?} {args:?}");
                let parsed: Value = serde_json::from_str(&args)
                    .unwrap_or_else(|e| panic!("client {k}: {args}: {e}"));
                assert_eq!(
                    parsed,
                    json!({"command": format!("echo client{k}"), "timeout": k}),
                    "client {k}"
                );
            } else {
                assert_eq!(finish, "stop", "client {k}");
                assert!(args.is_empty(), "client {k}: {args}");
            }
            Some((k, text, usage))
        }));
    }
    let mut done = 0;
    for h in handles {
        if let Some((k, text, usage)) = h.await.unwrap() {
            // Before a tool call the text's trailing whitespace belongs to the DSML block.
            assert_eq!(
                text.trim_end(),
                answer(k).trim_end(),
                "client {k} got another client's tokens or lost some"
            );
            assert!(
                usage["completion_tokens"].as_u64().unwrap() > 0,
                "client {k}"
            );
            done += 1;
        }
    }
    assert_eq!(done, CLIENTS - CLIENTS / 4);
    let s = wait_stats(a, |s| s["running"] == 0 && s["queued"] == 0).await;
    assert_eq!(s["requests"], CLIENTS as u64);
    assert_eq!(s["worker_panics"], 0);
    // A hung-up client is cancelled unless its short answer was already complete.
    assert!(s["cancelled"].as_u64().unwrap() <= (CLIENTS / 4) as u64);
    srv.shutdown().await.unwrap();
}

/// A client that keeps up is never taken for stalled, however long the model goes without
/// an event (here a tool call's structure, forced one slow token at a time, before the
/// call's name is known): the stall clock starts when an event waits, not at the last one
/// taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_silent_stretch_is_not_a_stall() {
    let srv = start(ServerConfig {
        parallel: 2,
        stall_timeout: Duration::from_millis(250),
        token_delay: Some(Duration::from_millis(100)),
        ..scripted()
    })
    .await;
    let body = json!({"messages":[{"role":"user","content":"[tool] list"}],"tools":[bash_tool()],
        "think":false,"stream":true});
    let evs = Sse::open(srv.addr, "/v1/chat/completions", &body)
        .await
        .all()
        .await;
    let d = datas(&evs);
    let last: Value = serde_json::from_str(&d[d.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls", "{d:?}");
    assert_eq!(stats(srv.addr).await["stalled"], 0);
    srv.shutdown().await.unwrap();
}

/// Two conversations alternating on two slots: each follow-up lands in the slot that holds
/// its conversation and reuses all of it (prompt and answer), which only the live state can
/// give (the one turn snapshot holds the other conversation's prompt by then; on one slot
/// the follow-ups are cold).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_conversation_keeps_its_slot() {
    let srv = start(ServerConfig {
        parallel: 2,
        ..scripted()
    })
    .await;
    let a = srv.addr;
    let turn = |user: &str, history: &[(&str, &str)]| {
        let mut msgs: Vec<Value> = Vec::new();
        for (u, asst) in history {
            msgs.push(json!({"role": "user", "content": u}));
            msgs.push(json!({"role": "assistant", "content": asst}));
        }
        msgs.push(json!({"role": "user", "content": user}));
        json!({"messages": msgs, "think": false})
    };
    let usage = |v: &Value| {
        (
            v["usage"]["prompt_tokens"].as_u64().unwrap(),
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        )
    };
    let first_a = post(a, "/v1/chat/completions", &turn("[plain] alpha", &[]))
        .await
        .json();
    let first_b = post(
        a,
        "/v1/chat/completions",
        &turn("[plain] beta, a longer opening", &[]),
    )
    .await
    .json();
    let answer = "The answer is 42.";
    assert_eq!(first_a["choices"][0]["message"]["content"], answer);
    for (first, user) in [
        (&first_a, "[plain] alpha"),
        (&first_b, "[plain] beta, a longer opening"),
    ] {
        let (prompt, _) = usage(first);
        let next = post(
            a,
            "/v1/chat/completions",
            &turn("[plain] and then?", &[(user, answer)]),
        )
        .await
        .json();
        let (_, cached) = usage(&next);
        assert!(
            cached > prompt,
            "{user}: reused {cached} of a {prompt}-token first turn"
        );
    }
    let s = stats(a).await;
    assert_eq!(s["snapshot_hits"], 0);
    srv.shutdown().await.unwrap();
}

/// The disk KV cache with two slots: both live states are checkpointed at shutdown, and after
/// a restart each conversation's next turn is restored from its own checkpoint into the slot
/// it lands in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_slot_is_checkpointed_and_restored() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = || ServerConfig {
        parallel: 2,
        disk: Some(ds4_server::DiskCacheConfig {
            min_tokens: 8,
            continued_interval_tokens: 0,
            boundary_trim_tokens: 0,
            boundary_align_tokens: 0,
            budget_bytes: 256 << 20,
            ..ds4_server::DiskCacheConfig::new(dir.path())
        }),
        snapshot_slots: 0,
        ..scripted()
    };
    let system = json!({"role":"system","content":"You are a terse assistant."});
    let first = |q: &str| json!({"think":false,"messages":[system,{"role":"user","content":q}]});
    let second = |q: &str| {
        json!({"think":false,"messages":[system,{"role":"user","content":q},
            {"role":"assistant","content":"The answer is 42."},{"role":"user","content":"[plain] more"}]})
    };
    let questions = ["[plain] first question", "[plain] another, longer question"];
    let srv = start(cfg()).await;
    let mut lengths = Vec::new();
    for q in questions {
        let v = post(srv.addr, "/v1/chat/completions", &first(q))
            .await
            .json();
        lengths.push(
            v["usage"]["prompt_tokens"].as_u64().unwrap()
                + v["usage"]["completion_tokens"].as_u64().unwrap(),
        );
    }
    srv.shutdown().await.unwrap();

    let srv = start(cfg()).await;
    for (q, live) in questions.iter().zip(lengths) {
        let v = post(srv.addr, "/v1/chat/completions", &second(q))
            .await
            .json();
        assert_eq!(
            v["usage"]["prompt_tokens_details"]["cached_tokens"], live,
            "{q}: {v}"
        );
    }
    assert_eq!(stats(srv.addr).await["disk_hits"], 2);
    srv.shutdown().await.unwrap();
}

/// A server on the tiny model whose short prompt chunks stop at 4 tokens, so pieces of 5
/// tokens or more join a joint prefill (docs/server.md §9); pieces of 64 per step.
async fn start_joint(parallel: usize) -> ds4_server::Running {
    let mut m = tokio::task::spawn_blocking(|| model(CTX)).await.unwrap();
    m.engine.set_short_prefill_rows(4);
    let cfg = ServerConfig {
        parallel,
        prefill_per_step: 64,
        token_delay: Some(Duration::from_millis(30)),
        ..ServerConfig::default()
    };
    ds4_server::Server::bind(SocketAddr::from(([127, 0, 0, 1], 0)), cfg, m)
        .await
        .unwrap()
        .spawn()
}

/// Two prompts evaluated in one forward pass (the second arrives while the first's first
/// piece runs; the next step holds the first's last piece and the whole second prompt, so
/// both start generating from rows of one joint pass): each request gets what it gets
/// alone on a one-slot server, and the joint path ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jointly_prefilled_prompts_get_what_they_get_alone() {
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(2);
    let reqs = [
        completion("Once upon a time", 40, None),
        completion(&long, 20, Some(4)),
        completion("Dear me", 20, None),
    ];
    let one = start_joint(1).await;
    let mut want = Vec::new();
    for r in &reqs {
        want.push(run_alone(one.addr, r).await);
    }
    assert_eq!(stats(one.addr).await["joint_pieces"], 0);
    one.shutdown().await.unwrap();
    let prompt = |g: &Got| g.prompt_tokens.as_u64().unwrap();
    assert!(prompt(&want[1]) > 64, "{:?}", want[1]);
    // The long prompt's last piece and the whole short one fit one step's 64 tokens.
    assert!(prompt(&want[1]) - 64 + prompt(&want[2]) <= 64, "{want:?}");

    let srv = start_joint(3).await;
    let a = srv.addr;
    // A stream decoding (30 ms between its steps), then the long prompt, then the short
    // one as soon as the long one has started.
    let mut first = Sse::open(a, "/v1/completions", &reqs[0]).await;
    let head = first.next().await.expect("a first chunk");
    let mut long_stream = Sse::open(a, "/v1/completions", &reqs[1]).await;
    let short_stream = Sse::open(a, "/v1/completions", &reqs[2]).await;
    let mut evs0 = vec![head];
    evs0.extend(first.all().await);
    let mut evs1 = vec![long_stream.next().await.expect("a chunk")];
    evs1.extend(long_stream.all().await);
    let got = [
        collect(&evs0),
        collect(&evs1),
        collect(&short_stream.all().await),
    ];
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i} differs from the same request alone");
    }
    let s = stats(a).await;
    assert!(s["joint_pieces"].as_u64() >= Some(2), "{s}");
    // Both prompts ended in the joint step, so their turn snapshots finish in the same
    // decode step; with one snapshot kept, the earlier one is not serialised.
    assert_eq!(s["turn_snapshots_skipped"], 1, "{s}");
    srv.shutdown().await.unwrap();
}
