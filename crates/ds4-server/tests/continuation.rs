//! Tool-output continuations on the live KV state (docs/server.md §9 steps 2–4, §8): a client answers
//! a tool call by sending only the results (Responses `function_call_output` items, with or
//! without `previous_response_id`; an Anthropic last message of `tool_result` blocks), or by
//! replaying everything. Each test checks the reused token count against the first turn's
//! prompt + output, the evaluated count in the server's prefill counter, and the error
//! statuses when the live state cannot serve the request (400 unknown id, 409 moved).

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use ds4_server::ServerConfig;
use serde_json::{json, Value};

fn responses_tools() -> Value {
    json!([{"type":"function","name":"bash","description":"Run","parameters":{"type":"object","properties":{"command":{"type":"string"},"timeout":{"type":"integer"}}}}])
}

fn anthropic_tools() -> Value {
    json!([{"name":"bash","input_schema":{"type":"object","properties":{"command":{"type":"string"}}}}])
}

/// Without exact DSML replay a full replay of the tool-call turn does not match the live
/// tokens (canonical `&` vs sampled `&amp;`), so only the tool binding can reuse all of it.
fn canonical() -> ServerConfig {
    ServerConfig {
        exact_dsml_replay: false,
        ..scripted()
    }
}

async fn prefilled(a: SocketAddr) -> u64 {
    stats(a).await["prefilled_tokens"].as_u64().unwrap()
}

async fn ok(a: SocketAddr, path: &str, body: &Value) -> Value {
    let r = post(a, path, body).await;
    assert_eq!(r.status, 200, "{path}: {}", r.body);
    r.json()
}

fn u64_at(v: &Value, ptr: &str) -> u64 {
    v.pointer(ptr)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("no {ptr} in {v}"))
}

/// Responses usage: (input P, cached R, output C).
fn resp_usage(v: &Value) -> (u64, u64, u64) {
    (
        u64_at(v, "/usage/input_tokens"),
        u64_at(v, "/usage/input_tokens_details/cached_tokens"),
        u64_at(v, "/usage/output_tokens"),
    )
}

fn output_text(v: &Value) -> String {
    v["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["type"] == "message")
        .flat_map(|o| o["content"].as_array().unwrap().iter())
        .map(|c| c["text"].as_str().unwrap().to_string())
        .collect()
}

/// Turn 1 on `/v1/responses`: the model calls `bash`. Returns (response, call id).
async fn responses_tool_turn(a: SocketAddr) -> (Value, String) {
    let v = ok(
        a,
        "/v1/responses",
        &json!({"reasoning":{"effort":"none"},"tools":responses_tools(),"input":"[tool] list"}),
    )
    .await;
    let call = v["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["type"] == "function_call")
        .unwrap_or_else(|| panic!("no function_call in {v}"));
    let id = call["call_id"].as_str().unwrap().to_string();
    (v, id)
}

fn output_only(id: &str, output: &str) -> Value {
    json!({"reasoning":{"effort":"none"},"tools":responses_tools(),
           "input":[{"type":"function_call_output","call_id":id,"output":output}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_function_call_output_only_and_previous_response_id() {
    let srv = start(canonical()).await;
    let a = srv.addr;
    let (v1, id) = responses_tool_turn(a).await;
    let (p1, r1, c1) = resp_usage(&v1);
    assert_eq!(r1, 0);

    // Only the output: the live state (prompt 1 + the sampled call) is reused as is.
    let before = prefilled(a).await;
    let v2 = ok(a, "/v1/responses", &output_only(&id, "[plain] a.txt")).await;
    assert_eq!(output_text(&v2), "The answer is 42.");
    let (p2, r2, c2) = resp_usage(&v2);
    assert_eq!(r2, p1 + c1, "{v2}");
    let suffix = p2 - r2;
    assert_eq!(prefilled(a).await - before, suffix);
    assert!(suffix > 0 && suffix < 40, "suffix {suffix}");
    assert_eq!(
        u64_at(&v2, "/usage/input_tokens_details/cache_write_tokens"),
        suffix
    );

    // `previous_response_id` of the latest response: a new user turn on the live state.
    let rid2 = v2["id"].as_str().unwrap().to_string();
    let before = prefilled(a).await;
    let v3 = ok(
        a,
        "/v1/responses",
        &json!({"reasoning":{"effort":"none"},"previous_response_id":rid2,"input":"[plain] more"}),
    )
    .await;
    assert_eq!(output_text(&v3), "The answer is 42.");
    let (p3, r3, _) = resp_usage(&v3);
    assert_eq!(r3, p2 + c2);
    assert_eq!(prefilled(a).await - before, p3 - r3);

    // Older responses, unknown ids and ids no longer live: 400 naming what is missing.
    let r = post(
        a,
        "/v1/responses",
        &json!({"previous_response_id":rid2,"input":"[plain] again"}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with(&format!("previous_response_id {rid2} is not available")),
        "{}",
        r.body
    );
    for bad in ["call_nope", id.as_str()] {
        let r = post(a, "/v1/responses", &output_only(bad, "x")).await;
        assert_eq!(r.status, 400, "{}", r.body);
        let e = &r.json()["error"];
        assert_eq!(e["type"], "invalid_request_error");
        assert_eq!(
            e["message"],
            format!("Responses continuation state is not available for call_id {bad}; retry by replaying the full input history")
        );
    }
    srv.shutdown().await.unwrap();
}

/// A full replay of the tool-call turn (re-serialized by the client) still continues the
/// live state when its call ids are the live ones; without the binding (canonical DSML, no
/// byte match) only the snapshot of prompt 1 would match.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_full_replay_uses_the_live_binding() {
    let srv = start(canonical()).await;
    let a = srv.addr;
    let (v1, id) = responses_tool_turn(a).await;
    let (p1, _, c1) = resp_usage(&v1);
    let replay = json!({"reasoning":{"effort":"none"},"tools":responses_tools(),"input":[
        {"type":"message","role":"user","content":"[tool] list"},
        {"type":"message","role":"assistant","content":[{"type":"output_text","text":"Sure."}]},
        {"type":"function_call","call_id":id,"name":"bash","arguments":"{\"timeout\": 10, \"command\": \"ls -la & pwd\"}"},
        {"type":"function_call_output","call_id":id,"output":"[plain] a.txt"}]});
    let v2 = ok(a, "/v1/responses", &replay).await;
    assert_eq!(resp_usage(&v2).1, p1 + c1, "{v2}");
    assert_eq!(stats(a).await["snapshot_hits"], 0);

    // The same replay again: the binding was used up (the live state moved on), so it is
    // served like any other full prompt. The one turn snapshot holds turn 2's prompt (with
    // the sampled DSML), which the canonical replay does not match: a cold prefill.
    let before = prefilled(a).await;
    let v3 = ok(a, "/v1/responses", &replay).await;
    let (p3, r3, _) = resp_usage(&v3);
    assert_eq!(r3, 0, "{v3}");
    assert_eq!(prefilled(a).await - before, p3);
    assert_eq!(stats(a).await["snapshot_hits"], 0);
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_tool_result_only_message() {
    let srv = start(canonical()).await;
    let a = srv.addr;
    let v1 = ok(
        a,
        "/v1/messages",
        &json!({"max_tokens":300,"thinking":{"type":"disabled"},"tools":anthropic_tools(),
                "messages":[{"role":"user","content":"[tool] go"}]}),
    )
    .await;
    assert_eq!(v1["stop_reason"], "tool_use");
    let tu = v1["content"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["type"] == "tool_use")
        .unwrap();
    let id = tu["id"].as_str().unwrap().to_string();
    let p1 = u64_at(&v1, "/usage/cache_read_input_tokens")
        + u64_at(&v1, "/usage/cache_creation_input_tokens");
    let c1 = u64_at(&v1, "/usage/output_tokens");

    let only = |id: &str| {
        json!({"max_tokens":50,"thinking":{"type":"disabled"},"tools":anthropic_tools(),
               "messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":id,"content":"[plain] a.txt"}]}]})
    };
    let before = prefilled(a).await;
    let v2 = ok(a, "/v1/messages", &only(&id)).await;
    assert_eq!(v2["content"][0]["text"], "The answer is 42.", "{v2}");
    assert_eq!(u64_at(&v2, "/usage/cache_read_input_tokens"), p1 + c1);
    let written = u64_at(&v2, "/usage/cache_creation_input_tokens");
    assert_eq!(prefilled(a).await - before, written);
    assert!(written > 0 && written < 40, "{written}");
    assert_eq!(u64_at(&v2, "/usage/input_tokens"), 0);

    // Answered already (the live state moved on) or never issued: 400.
    for bad in [id.as_str(), "toolu_nope"] {
        let r = post(a, "/v1/messages", &only(bad)).await;
        assert_eq!(r.status, 400, "{}", r.body);
        let v = r.json();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(
            v["error"]["message"],
            format!("Anthropic continuation state is not available for tool_use_id {bad}; retry by replaying the full messages history")
        );
    }
    srv.shutdown().await.unwrap();
}

/// The tool output was accepted while its call was live, but another request ran first and
/// moved the live state: 409 in the protocol's shape, and nothing is generated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuation_whose_live_state_moved_is_409() {
    let srv = start(ServerConfig {
        token_delay: Some(Duration::from_millis(25)),
        ..canonical()
    })
    .await;
    let a = srv.addr;
    for ep in ["/v1/responses", "/v1/messages"] {
        let continuation = if ep == "/v1/responses" {
            let (_, id) = responses_tool_turn(a).await;
            output_only(&id, "[plain] a.txt")
        } else {
            let v = ok(
                a,
                ep,
                &json!({"max_tokens":300,"thinking":{"type":"disabled"},"tools":anthropic_tools(),
                        "messages":[{"role":"user","content":"[tool] go"}]}),
            )
            .await;
            let id = v["content"]
                .as_array()
                .unwrap()
                .iter()
                .find(|b| b["type"] == "tool_use")
                .unwrap()["id"]
                .clone();
            json!({"max_tokens":50,"thinking":{"type":"disabled"},"tools":anthropic_tools(),
                   "messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":id,"content":"[plain] a.txt"}]}]})
        };
        // Another client's long generation is running …
        let mut other = Sse::open(
            a,
            "/v1/chat/completions",
            &json!({"messages":[{"role":"user","content":"[long]"}],"think":false,"stream":true,"max_tokens":2000}),
        )
        .await;
        assert_eq!(other.status, 200);
        other.next().await.expect("first chunk");
        // … when the tool output arrives: accepted (its call is still live) and queued.
        let gen0 = stats(a).await["generated_tokens"].as_u64().unwrap();
        let body = continuation.clone();
        let waiting = tokio::spawn(async move { post(a, ep, &body).await });
        wait_stats(a, |s| s["queued"] == 1).await;
        drop(other);
        let r = waiting.await.unwrap();
        assert_eq!(r.status, 409, "{ep}: {}", r.body);
        let v = r.json();
        let (e, msg) = if ep == "/v1/messages" {
            assert_eq!(v["type"], "error");
            (&v["error"], "Anthropic continuation state is not available; retry by replaying the full messages history")
        } else {
            (&v["error"], "Responses continuation state is not available; retry by replaying the full input history")
        };
        assert_eq!(e["type"], "invalid_request_error");
        assert_eq!(e["message"], msg);
        // Nothing after the cancelled generation was generated for the 409.
        let s = wait_stats(a, |s| s["running"] == 0 && s["queued"] == 0).await;
        assert!(s["generated_tokens"].as_u64().unwrap() - gen0 < 400);
        // Now the handler knows the call is gone: 400.
        let r = post(a, ep, &continuation).await;
        assert_eq!(r.status, 400, "{ep}: {}", r.body);
    }
    srv.shutdown().await.unwrap();
}
