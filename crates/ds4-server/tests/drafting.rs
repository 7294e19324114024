//! Speculative decoding in the server (docs/server.md §9): a slot that decodes alone drafts
//! and verifies the drafts in one pass. Greedy output must be token for token the output
//! without drafting — through every endpoint family, with stop sequences, limits, streaming
//! and the next turn's prefix reuse — and the request's `draft` / `draft_max` are checked.

mod common;

use common::*;
use ds4_server::ServerConfig;
use serde_json::{json, Value};

fn lookup_cfg() -> ServerConfig {
    ServerConfig {
        draft: ds4_runtime::DraftConfig {
            mode: ds4_runtime::DraftMode::Lookup,
            ..Default::default()
        },
        ..ServerConfig::default()
    }
}

/// A repetitive prompt, so prompt lookup finds n-grams to propose.
fn prompt() -> String {
    "one two three four five six seven eight nine ten. ".repeat(6)
}

fn completion(max_tokens: u64, extra: Value) -> Value {
    let mut b = json!({"prompt": prompt(), "max_tokens": max_tokens, "temperature": 0,
        "think": false});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// (text, finish reason, completion tokens, usage.draft) of a completions answer.
async fn complete(a: std::net::SocketAddr, body: &Value) -> (String, Value, Value, Value) {
    let r = post(a, "/v1/completions", body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    (
        v["choices"][0]["text"].as_str().unwrap().to_string(),
        v["choices"][0]["finish_reason"].clone(),
        v["usage"]["completion_tokens"].clone(),
        v["usage"]["draft"].clone(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_drafting_changes_no_token() {
    let off = start(ServerConfig::default()).await;
    let on = start(lookup_cfg()).await;
    let mut drafted_somewhere = false;
    for (max, extra) in [
        (40, json!({})),
        (7, json!({})),
        (40, json!({"draft_max": 7})),
        (40, json!({"draft_max": 1})),
        (30, json!({"stop": ["e"]})),
        (25, json!({"logprobs": 2})),
    ] {
        let body = completion(max, extra.clone());
        let want = complete(off.addr, &body).await;
        assert!(
            want.3.is_null(),
            "no drafting, no usage.draft: {:?}",
            want.3
        );
        let got = complete(on.addr, &body).await;
        assert_eq!(
            (&got.0, &got.1, &got.2),
            (&want.0, &want.1, &want.2),
            "{extra}"
        );
        if !got.3.is_null() {
            let d = &got.3;
            assert!(d["verify_steps"].as_u64().unwrap() > 0);
            assert!(d["accepted"].as_u64().unwrap() <= d["drafted"].as_u64().unwrap());
            drafted_somewhere = true;
        }
        // The per-request field turns drafting on a server whose default is off, and off
        // on one whose default is lookup.
        let mut b = body.clone();
        b["draft"] = json!("lookup");
        let got = complete(off.addr, &b).await;
        assert_eq!(
            (&got.0, &got.1, &got.2),
            (&want.0, &want.1, &want.2),
            "{extra}"
        );
        b["draft"] = json!("off");
        let got = complete(on.addr, &b).await;
        assert_eq!(
            (&got.0, &got.1, &got.2),
            (&want.0, &want.1, &want.2),
            "{extra}"
        );
        assert!(got.3.is_null());
    }
    assert!(
        drafted_somewhere,
        "lookup never drafted on a repetitive prompt"
    );
    let s = stats(on.addr).await;
    assert!(s["draft_steps"].as_u64().unwrap() > 0, "{s}");
    assert!(s["drafted_tokens"].as_u64().unwrap() >= s["accepted_tokens"].as_u64().unwrap());
    off.shutdown().await.unwrap();
    on.shutdown().await.unwrap();
}

/// A two-turn chat, streamed: the same deltas and the same reuse of the first turn's state
/// (the state after drafting holds exactly the tokens fed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_turns_and_streams_match() {
    async fn turns(
        a: std::net::SocketAddr,
        drafted: &std::sync::atomic::AtomicBool,
    ) -> Vec<(String, Value)> {
        let mut msgs = vec![json!({"role": "user", "content": prompt()})];
        let mut out = Vec::new();
        for next in ["again: one two three", "and once more"] {
            let body = json!({"messages": msgs, "max_tokens": 24, "temperature": 0,
                "stream": true, "stream_options": {"include_usage": true},
                "thinking": {"type": "disabled"}});
            let sse = Sse::open(a, "/v1/chat/completions", &body).await;
            assert_eq!(sse.status, 200);
            let evs = sse.all().await;
            let mut text = String::new();
            let mut cached = Value::Null;
            for e in &evs[..evs.len() - 1] {
                let v = e.json();
                assert!(v.get("error").is_none(), "{v}");
                if let Some(c) = v["choices"].get(0) {
                    text.push_str(c["delta"]["content"].as_str().unwrap_or(""));
                }
                if !v["usage"].is_null() {
                    cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
                    if !v["usage"]["draft"].is_null() {
                        drafted.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
            msgs.push(json!({"role": "assistant", "content": text.clone()}));
            msgs.push(json!({"role": "user", "content": next}));
            out.push((text, cached));
        }
        out
    }
    let (no, yes) = (
        std::sync::atomic::AtomicBool::new(false),
        std::sync::atomic::AtomicBool::new(false),
    );
    let off = start(ServerConfig::default()).await;
    let want = turns(off.addr, &no).await;
    off.shutdown().await.unwrap();
    let on = start(lookup_cfg()).await;
    let got = turns(on.addr, &yes).await;
    on.shutdown().await.unwrap();
    assert_eq!(got, want);
    assert!(!no.into_inner());
    assert!(yes.into_inner(), "the streamed usage reports drafting");
}

/// Seeded sampling with drafts: a sample of the right length (what the acceptance rule
/// keeps is the sampler's business, tested in ds4-engine), and the Anthropic usage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_drafting_and_messages() {
    let on = start(lookup_cfg()).await;
    let body = completion(20, json!({"temperature": 0.8, "seed": 5, "draft_max": 4}));
    let r = post(on.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let body = json!({"model": "x", "max_tokens": 20, "temperature": 0, "draft": "lookup",
        "messages": [{"role": "user", "content": prompt()}]});
    let r = post(on.addr, "/v1/messages", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert!(v["usage"]["output_tokens"].as_u64().unwrap() > 0, "{v}");
    on.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_draft_fields_are_400() {
    let s = start(ServerConfig::default()).await;
    for (extra, says) in [
        (json!({"draft": "bogus"}), "`draft` must be"),
        (json!({"draft": 3}), "`draft` must be a string"),
        (
            json!({"draft_max": 0}),
            "`draft_max` must be between 1 and 16",
        ),
        (
            json!({"draft_max": 17}),
            "`draft_max` must be between 1 and 16",
        ),
        (json!({"draft_max": -1}), "draft_max"),
        (json!({"draft_max": "3"}), "draft_max"),
        (json!({"draft": "mtp"}), "MTP block"),
    ] {
        let r = post(s.addr, "/v1/completions", &completion(5, extra.clone())).await;
        assert_eq!(r.status, 400, "{extra}: {}", r.body);
        assert!(r.body.contains(says), "{extra}: {}", r.body);
        let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5});
        let mut b = chat.clone();
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let r = post(s.addr, "/v1/chat/completions", &b).await;
        assert_eq!(r.status, 400, "{extra}: {}", r.body);
    }
    s.shutdown().await.unwrap();
}

/// `"draft": "mtp"` on a server without the MTP block is a 400 that names the problem,
/// answered before the prompt is queued or evaluated — streamed or not, on every endpoint
/// family — while the same requests with `"lookup"` run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtp_without_a_block_is_refused_before_the_prompt_runs() {
    let s = start(ServerConfig::default()).await;
    let msgs = json!([{"role": "user", "content": prompt()}]);
    let bodies = [
        ("/v1/completions", completion(5, json!({}))),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "max_tokens": 5}),
        ),
        (
            "/v1/messages",
            json!({"model": "ds4", "messages": msgs, "max_tokens": 5}),
        ),
        (
            "/v1/responses",
            json!({"input": prompt(), "max_output_tokens": 16}),
        ),
    ];
    for (path, body) in &bodies {
        for stream in [false, true] {
            let mut b = body.clone();
            b["draft"] = json!("mtp");
            b["stream"] = json!(stream);
            let r = post(s.addr, path, &b).await;
            assert_eq!(r.status, 400, "{path} stream {stream}: {}", r.body);
            assert!(
                r.body.contains("needs the MTP block") && r.body.contains("--mtp FILE"),
                "{path}: {}",
                r.body
            );
        }
    }
    let st = stats(s.addr).await;
    assert_eq!(st["requests"], 0, "{st}");
    assert_eq!(st["prefilled_tokens"], 0, "{st}");
    for (path, body) in &bodies {
        let mut b = body.clone();
        b["draft"] = json!("lookup");
        let r = post(s.addr, path, &b).await;
        assert_eq!(r.status, 200, "{path}: {}", r.body);
    }
    s.shutdown().await.unwrap();
}

/// Two slots: while both decode, their steps are batched without drafts; a request alone
/// drafts. Either way each request's greedy text is what it is on a server that never
/// drafts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_slots_and_lone_slots_match() {
    let off = start(ServerConfig::default()).await;
    let bodies = [
        completion(30, json!({})),
        completion(
            20,
            json!({"prompt": "ten nine eight seven ten nine eight seven ten"}),
        ),
    ];
    let mut want = Vec::new();
    for b in &bodies {
        want.push(complete(off.addr, b).await);
    }
    off.shutdown().await.unwrap();
    let on = start(ServerConfig {
        parallel: 2,
        token_delay: Some(std::time::Duration::from_millis(2)),
        ..lookup_cfg()
    })
    .await;
    let (a, b) = tokio::join!(complete(on.addr, &bodies[0]), complete(on.addr, &bodies[1]));
    for (got, want) in [a, b].iter().zip(&want) {
        assert_eq!((&got.0, &got.1, &got.2), (&want.0, &want.1, &want.2));
    }
    let alone = complete(on.addr, &bodies[0]).await;
    assert_eq!(
        (&alone.0, &alone.1, &alone.2),
        (&want[0].0, &want[0].1, &want[0].2)
    );
    assert!(!alone.3.is_null(), "a lone slot drafts");
    on.shutdown().await.unwrap();
}

/// `"draft": "mtp"` on a server that loaded the MTP block (the oracle's tiny block,
/// `tests/fixtures/mtp-hca16`): greedy answers are token for token those of a server on
/// the same weights without the block (limits, a stop string, log probabilities, several
/// depths; a chat), and `usage.draft` shows the block drafted. A random block's drafts are
/// mostly rejected, so the steps exercise the rollback. A request that reuses a cached
/// prompt starts from a restored state, whose final streams the block never saw: it
/// drafts only after a window (16 here) of decode steps, so only the 30-token answers
/// must show drafts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_mtp_drafting_changes_no_token() {
    let off = start(ServerConfig::default()).await;
    let on = start_mtp(ServerConfig::default()).await;
    for (max, extra) in [
        (30, json!({})),
        (30, json!({"draft_max": 1})),
        (30, json!({"draft_max": 7})),
        (6, json!({})),
        (30, json!({"stop": ["e"]})),
        (20, json!({"logprobs": 2})),
    ] {
        let body = completion(max, extra.clone());
        let want = complete(off.addr, &body).await;
        let mut b = body.clone();
        b["draft"] = json!("mtp");
        let got = complete(on.addr, &b).await;
        assert_eq!(
            (&got.0, &got.1, &got.2),
            (&want.0, &want.1, &want.2),
            "{extra}"
        );
        let d = &got.3;
        if max == 30 && got.2 == json!(30) {
            assert!(
                d["drafted"].as_u64().is_some_and(|n| n > 0),
                "{extra}: the block drafted: {d}"
            );
            assert!(d["verify_steps"].as_u64().unwrap() > 0, "{extra}: {d}");
        }
        if !d.is_null() {
            assert!(d["accepted"].as_u64().unwrap() <= d["drafted"].as_u64().unwrap());
        }
        // Without the request's field the block is loaded but nothing drafts (the
        // server's default is off).
        let plain = complete(on.addr, &body).await;
        assert_eq!((&plain.0, &plain.1, &plain.2), (&want.0, &want.1, &want.2));
        assert!(plain.3.is_null(), "{extra}: {}", plain.3);
    }
    let chat = json!({"messages": [{"role": "user", "content": prompt()}], "max_tokens": 24,
        "temperature": 0, "thinking": {"type": "disabled"}});
    let want = post(off.addr, "/v1/chat/completions", &chat).await.json();
    let mut b = chat.clone();
    b["draft"] = json!("mtp");
    let got = post(on.addr, "/v1/chat/completions", &b).await.json();
    assert_eq!(got["choices"], want["choices"]);
    assert!(
        got["usage"]["draft"]["drafted"].as_u64().unwrap() > 0,
        "{got}"
    );
    let s = stats(on.addr).await;
    assert!(s["draft_steps"].as_u64().unwrap() > 0, "{s}");
    off.shutdown().await.unwrap();
    on.shutdown().await.unwrap();
}

/// Sampling with MTP drafts (each draft drawn from the block's distribution and accepted
/// by the speculative-sampling rule): a fixed seed gives the same text on two servers
/// whose default drafter is the block, another seed another text, and a sampler that can
/// pick only one token (top-k 1) the undrafted server's text. (Both servers answer from a
/// cold cache: a request that reuses a cached prompt drafts nothing for its first window
/// of tokens, which changes which random numbers its draws take — docs/speculative.md §6.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_mtp_drafting_is_reproducible() {
    let cfg = || ServerConfig {
        draft: ds4_runtime::DraftConfig {
            mode: ds4_runtime::DraftMode::Mtp,
            ..Default::default()
        },
        ..ServerConfig::default()
    };
    let body = completion(24, json!({"temperature": 0.9, "seed": 11, "draft_max": 3}));
    let mut runs = Vec::new();
    for _ in 0..2 {
        let on = start_mtp(cfg()).await;
        runs.push(complete(on.addr, &body).await);
        on.shutdown().await.unwrap();
    }
    let (first, again) = (&runs[0], &runs[1]);
    assert_eq!((&first.0, &first.2), (&again.0, &again.2));
    assert_eq!(first.3, again.3, "the same draws draft the same");
    assert!(first.3["drafted"].as_u64().unwrap() > 0, "{}", first.3);
    let on = start_mtp(cfg()).await;
    let mut other = body.clone();
    other["seed"] = json!(12);
    let third = complete(on.addr, &other).await;
    assert_ne!(third.0, first.0, "another seed, another sample");
    on.shutdown().await.unwrap();
    let on = start_mtp(cfg()).await;
    let top1 = completion(24, json!({"temperature": 0.9, "top_k": 1, "seed": 11}));
    let got = complete(on.addr, &top1).await;
    assert!(got.3["drafted"].as_u64().unwrap() > 0, "{}", got.3);
    on.shutdown().await.unwrap();
    let off = start(ServerConfig::default()).await;
    let want = complete(off.addr, &top1).await;
    assert_eq!((&got.0, &got.1, &got.2), (&want.0, &want.1, &want.2));
    off.shutdown().await.unwrap();
}
