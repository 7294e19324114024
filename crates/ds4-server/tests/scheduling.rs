//! The one-worker scheduling model: a bounded queue answered with 429 when full, client
//! disconnects cancelling their generation, and a graceful shutdown that ends the running
//! generation and drains.

mod common;

use std::time::Duration;

use common::*;
use ds4_server::ServerConfig;
use serde_json::json;

fn slow(queue: usize) -> ServerConfig {
    ServerConfig {
        queue_capacity: queue,
        token_delay: Some(Duration::from_millis(25)),
        ..scripted()
    }
}

fn long_stream() -> serde_json::Value {
    json!({"messages":[{"role":"user","content":"[long]"}],"think":false,"stream":true,"max_tokens":2000})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_is_429_in_each_protocols_shape() {
    let srv = start(slow(1)).await;
    let a = srv.addr;
    // A runs (its first chunk arrived), B waits in the one queue slot.
    let mut running = Sse::open(a, "/v1/chat/completions", &long_stream()).await;
    assert_eq!(running.status, 200);
    running.next().await.expect("first chunk");
    let waiting = tokio::spawn(async move {
        post(
            a,
            "/v1/chat/completions",
            &json!({"messages":[{"role":"user","content":"[plain]"}],"think":false}),
        )
        .await
    });
    wait_stats(a, |s| s["queued"] == 1 && s["running"] == 1).await;

    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"messages":[{"role":"user","content":"x"}]}),
    )
    .await;
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.header("retry-after"), Some("1"));
    let v = r.json();
    assert_eq!(v["error"]["type"], "rate_limit_error");
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    let r = post(
        a,
        "/v1/messages",
        &json!({"max_tokens":5,"messages":[{"role":"user","content":"x"}]}),
    )
    .await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.json()["type"], "error");
    assert_eq!(r.json()["error"]["type"], "overloaded_error");
    let r = post(a, "/v1/responses", &json!({"input":"x"})).await;
    assert_eq!(r.status, 429);
    // Metadata endpoints never queue.
    assert_eq!(get(a, "/v1/models").await.status, 200);

    // Dropping A cancels it; B then runs to completion.
    drop(running);
    let b = waiting.await.unwrap();
    assert_eq!(b.status, 200, "{}", b.body);
    assert_eq!(
        b.json()["choices"][0]["message"]["content"],
        "The answer is 42."
    );
    let s = stats(a).await;
    assert_eq!(s["rejected_busy"], 3);
    assert_eq!(s["cancelled"], 1);
    assert_eq!(s["requests"], 2);
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_generation() {
    let srv = start(slow(4)).await;
    let a = srv.addr;
    let mut sse = Sse::open(a, "/v1/chat/completions", &long_stream()).await;
    for _ in 0..5 {
        sse.next().await.expect("chunk");
    }
    drop(sse);
    let s = wait_stats(a, |s| s["cancelled"] == 1 && s["running"] == 0).await;
    let generated = s["generated_tokens"].as_u64().unwrap();
    assert!(
        generated < 200,
        "generation went on after the disconnect: {generated} tokens"
    );
    // The worker is free again and the state is still usable.
    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"messages":[{"role":"user","content":"[plain]"}],"think":false}),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.json()["choices"][0]["message"]["content"],
        "The answer is 42."
    );
    // Same for the Anthropic and Responses streams.
    for (path, body) in [
        (
            "/v1/messages",
            json!({"max_tokens":2000,"stream":true,"thinking":{"type":"disabled"},"messages":[{"role":"user","content":"[long]"}]}),
        ),
        (
            "/v1/responses",
            json!({"stream":true,"reasoning":{"effort":"none"},"input":"[long]"}),
        ),
    ] {
        let before = stats(a).await["cancelled"].as_u64().unwrap();
        let mut sse = Sse::open(a, path, &body).await;
        for _ in 0..6 {
            sse.next().await.expect("event");
        }
        drop(sse);
        wait_stats(a, |s| {
            s["cancelled"].as_u64().unwrap() == before + 1 && s["running"] == 0
        })
        .await;
    }
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_the_running_generation_and_drains_the_queue() {
    let srv = start(slow(4)).await;
    let a = srv.addr;
    let mut sse = Sse::open(a, "/v1/chat/completions", &long_stream()).await;
    sse.next().await.expect("first chunk");
    let queued = tokio::spawn(async move {
        post(
            a,
            "/v1/messages",
            &json!({"max_tokens":5,"messages":[{"role":"user","content":"[plain]"}]}),
        )
        .await
    });
    wait_stats(a, |s| s["queued"] == 1).await;
    let stopping = tokio::spawn(srv.shutdown());
    let mut last = Vec::new();
    while let Some(e) = sse.next().await {
        last.push(e.data);
    }
    assert_eq!(last.last().map(String::as_str), Some("[DONE]"));
    let fin: serde_json::Value = serde_json::from_str(&last[last.len() - 2]).unwrap();
    assert_eq!(fin["choices"][0]["finish_reason"], "error");
    let q = queued.await.unwrap();
    assert_eq!(q.status, 503, "{}", q.body);
    assert_eq!(q.json()["error"]["type"], "overloaded_error");
    stopping.await.unwrap().unwrap();
    // Nothing listens any more.
    assert!(tokio::net::TcpStream::connect(a).await.is_err());
}

/// A non-streaming client that goes away mid-generation cancels its job too: the worker
/// stops within a few tokens (not after the 2000-token limit) and the next request runs
/// at once. With a 25 ms token delay, an uncancelled job would keep the worker for 50 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_stream_disconnect_cancels_generation() {
    use tokio::io::AsyncWriteExt;
    let srv = start(slow(4)).await;
    let a = srv.addr;
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"messages":[{"role":"user","content":"[long]"}],"think":false,"max_tokens":2000}),
        ),
        (
            "/v1/messages",
            json!({"max_tokens":2000,"thinking":{"type":"disabled"},"messages":[{"role":"user","content":"[long]"}]}),
        ),
        (
            "/v1/responses",
            json!({"reasoning":{"effort":"none"},"max_output_tokens":2000,"input":"[long]"}),
        ),
    ] {
        let before = stats(a).await;
        let gen0 = before["generated_tokens"].as_u64().unwrap();
        let cancelled0 = before["cancelled"].as_u64().unwrap();
        let body = body.to_string();
        let mut s = tokio::net::TcpStream::connect(a).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {a}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(body.as_bytes()).await.unwrap();
        // Wait until it is generating, then hang up without reading anything.
        wait_stats(a, |s| {
            s["running"] == 1 && s["generated_tokens"].as_u64().unwrap() >= gen0 + 5
        })
        .await;
        drop(s);
        let t0 = std::time::Instant::now();
        let s = wait_stats(a, |s| {
            s["cancelled"].as_u64().unwrap() == cancelled0 + 1 && s["running"] == 0
        })
        .await;
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{path}: cancel took {:?}",
            t0.elapsed()
        );
        let generated = s["generated_tokens"].as_u64().unwrap() - gen0;
        assert!(
            generated < 400,
            "{path}: generation went on after the disconnect: {generated} tokens"
        );
        // The worker is free: a short request is answered promptly.
        let t0 = std::time::Instant::now();
        let r = post(
            a,
            "/v1/chat/completions",
            &json!({"messages":[{"role":"user","content":"[plain]"}],"think":false}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(t0.elapsed() < Duration::from_secs(10));
    }
    srv.shutdown().await.unwrap();
}
