//! ds4-server under hostile clients (issue 24; SECURITY.md lists what each test defends).
//! Every test drives a live in-process server over raw sockets, so it sees exactly what a
//! misbehaving client would: half-sent heads, stalled bodies, forged headers, readers that
//! stop reading.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use ds4_server::ServerConfig;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads until the peer closes (or `limit` passes): (bytes, closed).
async fn read_until_close(s: &mut TcpStream, limit: Duration) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut buf = [0u8; 4096];
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Err(_) => return (out, false),
            Ok(Ok(0)) | Ok(Err(_)) => return (out, true),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
        }
    }
}

fn status_of(raw: &[u8]) -> u16 {
    let text = String::from_utf8_lossy(raw);
    text.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn chat(content: &str) -> Value {
    json!({"messages":[{"role":"user","content":content}],"max_tokens":2,"think":false})
}

// ---- item 1: admission before work -------------------------------------------------------

/// 2.2 M tiny messages (66 MB, under the body limit) used to be parsed, rendered and
/// tokenized (2.4 GB peak) before the context check; now the turn count refuses it first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_tiny_messages_are_refused_before_rendering() {
    let srv = start(ServerConfig::default()).await;
    let n = 2_200_000;
    let mut body = String::with_capacity(n * 30 + 64);
    body.push_str("{\"messages\":[");
    for i in 0..n {
        if i > 0 {
            body.push(',');
        }
        body.push_str("{\"role\":\"user\",\"content\":\"x\"}");
    }
    body.push_str("],\"max_tokens\":1}");
    assert!(
        body.len() < 64 << 20 && body.len() > 60 << 20,
        "{}",
        body.len()
    );
    let t0 = Instant::now();
    let r = request(
        srv.addr,
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json")],
        body.as_bytes(),
    )
    .await;
    let took = t0.elapsed();
    assert_eq!(r.status, 400, "{}", r.body);
    let v = r.json();
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert!(v["error"]["message"].as_str().unwrap().contains("at least"));
    let s = stats(srv.addr).await;
    assert_eq!(s["rejected_early"], 1, "{s}");
    assert_eq!(s["requests"], 0, "{s}");
    eprintln!("2.2M-message body refused in {took:?}");
    // Messages that render to almost nothing (system) still may not outnumber the context.
    let sys: Vec<Value> = (0..CTX + 1)
        .map(|_| json!({"role": "system", "content": ""}))
        .collect();
    let r = post(
        srv.addr,
        "/v1/chat/completions",
        &json!({ "messages": sys }),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("messages exceed the context"), "{}", r.body);
    // One long message: refused from its byte count, before tokenizing.
    let long = "word ".repeat(4_000_000);
    let r = post(srv.addr, "/v1/chat/completions", &chat(&long)).await;
    assert_eq!(r.status, 400);
    assert_eq!(stats(srv.addr).await["rejected_early"], 3);
    // /detokenize: more ids than the context is refused (it was 5.3 GB for 32 M ids).
    let ids: Vec<u32> = vec![65; CTX + 1];
    let r = post(srv.addr, "/detokenize", &json!({ "tokens": ids })).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("exceed the context"), "{}", r.body);
    let r = post(srv.addr, "/detokenize", &json!({"tokens": [65, 66]})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    srv.shutdown().await.unwrap();
}

/// Bodies whose parsed form would dwarf them are refused by the pre-scan with a 400 that
/// names the problem (`tests/parse_memory.rs` measures the memory), and `/tokenize` is
/// capped by the context like every other prompt (64 MiB of text was 33 M tokens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dense_duplicated_and_oversized_bodies_are_refused_before_parsing() {
    let srv = start(ServerConfig::default()).await;
    let a = srv.addr;
    let raw = |b: String| async move {
        request(
            a,
            "POST",
            "/v1/chat/completions",
            &[("Content-Type", "application/json")],
            b.as_bytes(),
        )
        .await
    };
    // A second `messages` key.
    let r = raw(r#"{"messages":[{"role":"user","content":"a"}],"messages":[{"role":"user","content":"b"}]}"#.into()).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("appears more than once"), "{}", r.body);
    // More content parts than the context has tokens.
    let parts = vec![r#"{"type":"text","text":""}"#; CTX + 1].join(",");
    let r = raw(format!(
        r#"{{"messages":[{{"role":"user","content":[{parts}]}}]}}"#
    ))
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        r.body.contains("messages[0].content") && r.body.contains("context size"),
        "{}",
        r.body
    );
    // An ignored member dense with tiny objects, each array short: the size estimate.
    let chunk = format!("[{}]", vec![r#"{"a":""}"#; 4000].join(","));
    let junk = vec![chunk; 200].join(",");
    let r = raw(format!(
        r#"{{"messages":[{{"role":"user","content":"hi"}}],"junk":[{junk}]}}"#
    ))
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("JSON objects"), "{}", r.body);
    // /tokenize: text longer than the context, plain or as messages.
    let long = "word ".repeat(CTX * 2);
    let r = post(a, "/tokenize", &json!({ "content": long })).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("more than the context size"), "{}", r.body);
    let r = post(
        a,
        "/tokenize",
        &json!({"messages": [{"role": "user", "content": long}]}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("more than the context size"), "{}", r.body);
    let r = post(
        a,
        "/tokenize",
        &json!({"content": "word word", "x": [{"a": 1}]}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["count"].as_u64().unwrap(),
        r.json()["tokens"].as_array().unwrap().len() as u64
    );
    let r = post(
        a,
        "/tokenize",
        &json!({"content": "w", "with_pieces": "yes"}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    srv.shutdown().await.unwrap();
}

// ---- item 2: timeouts and caps -----------------------------------------------------------

fn short_timeouts() -> ServerConfig {
    ServerConfig {
        header_timeout: Duration::from_millis(800),
        body_idle_timeout: Duration::from_millis(800),
        body_timeout: Duration::from_secs(3),
        shutdown_grace: Duration::from_secs(1),
        ..ServerConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_heads_and_stalled_bodies_are_closed() {
    let srv = start(short_timeouts()).await;
    let a = srv.addr;
    // 50 half-sent heads and 50 idle connections: all closed by the head timeout.
    let mut conns = Vec::new();
    for i in 0..100 {
        let mut s = TcpStream::connect(a).await.unwrap();
        if i % 2 == 0 {
            s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                .await
                .unwrap();
        }
        conns.push(s);
    }
    let t0 = Instant::now();
    for s in &mut conns {
        let (_, closed) = read_until_close(s, Duration::from_secs(5)).await;
        assert!(closed, "a half-sent or idle connection stayed open");
    }
    eprintln!(
        "100 half-sent/idle connections closed within {:?}",
        t0.elapsed()
    );
    // A body that stops half way: 408 and the connection closes.
    let mut s = TcpStream::connect(a).await.unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"messages\":")
        .await
        .unwrap();
    let t0 = Instant::now();
    let (raw, closed) = read_until_close(&mut s, Duration::from_secs(5)).await;
    assert_eq!(status_of(&raw), 408, "{}", String::from_utf8_lossy(&raw));
    assert!(closed);
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    // A body trickled one byte at a time (never idle) still ends at the total timeout.
    let mut s = TcpStream::connect(a).await.unwrap();
    s.write_all(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\n")
        .await
        .unwrap();
    let t0 = Instant::now();
    let mut status = 0;
    while t0.elapsed() < Duration::from_secs(8) {
        if s.write_all(b" ").await.is_err() {
            break;
        }
        let mut buf = [0u8; 512];
        if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(300), s.read(&mut buf)).await
        {
            if n > 0 {
                status = status_of(&buf[..n]);
            }
            break;
        }
    }
    assert_eq!(status, 408, "trickled body not cut off");
    assert!(t0.elapsed() < Duration::from_secs(6), "{:?}", t0.elapsed());
    let s = stats(a).await;
    assert_eq!(s["timed_out"], 2, "{s}");
    // The server still serves.
    let r = get(a, "/health").await;
    assert_eq!(r.status, 200);
    srv.shutdown().await.unwrap();
}

/// A declared length over the limit is refused before the body is read: no `100 Continue`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_limit_upload_gets_no_continue() {
    let srv = start(ServerConfig {
        max_body_bytes: 1000,
        ..ServerConfig::default()
    })
    .await;
    let mut s = TcpStream::connect(srv.addr).await.unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n")
        .await
        .unwrap();
    let (raw, _) = read_until_close(&mut s, Duration::from_secs(3)).await;
    let text = String::from_utf8_lossy(&raw);
    assert!(!text.contains("100 Continue"), "{text}");
    assert_eq!(status_of(&raw), 413, "{text}");
    // Within the limit, the client is told to continue.
    let mut s = TcpStream::connect(srv.addr).await.unwrap();
    s.write_all(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 17\r\nExpect: 100-continue\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 256];
    let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).contains("100 Continue"));
    srv.shutdown().await.unwrap();
}

/// Stalled uploads hold at most the body budget: once their declared lengths fill it, the
/// next body is refused with 503 + `Retry-After` without being read (so no `100 Continue`),
/// requests without a body are still served, and the budget comes back when the stalled
/// uploads are cut off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_uploads_cannot_hold_more_than_the_body_budget() {
    let srv = start(ServerConfig {
        max_body_bytes: 1 << 20,
        body_budget_bytes: 2 << 20,
        body_budget_wait: Duration::from_millis(300),
        body_idle_timeout: Duration::from_secs(2),
        body_timeout: Duration::from_secs(4),
        ..ServerConfig::default()
    })
    .await;
    let a = srv.addr;
    let head = |len: usize, expect: bool| {
        format!(
            "POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n{}\r\n",
            if expect { "Expect: 100-continue\r\n" } else { "" }
        )
    };
    // Two uploads of 1 MiB each that send a little and stall: the whole budget.
    let mut stalled = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(a).await.unwrap();
        s.write_all(head(1 << 20, false).as_bytes()).await.unwrap();
        s.write_all(&[b' '; 1000]).await.unwrap();
        stalled.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // A third, even a small one, cannot get its share: 503 + Retry-After, not read.
    let t0 = Instant::now();
    let mut s = TcpStream::connect(a).await.unwrap();
    s.write_all(head(5000, true).as_bytes()).await.unwrap();
    let (raw, closed) = read_until_close(&mut s, Duration::from_secs(3)).await;
    let text = String::from_utf8_lossy(&raw);
    assert_eq!(status_of(&raw), 503, "{text}");
    assert!(!text.contains("100 Continue"), "{text}");
    assert!(
        text.contains("Retry-After") || text.contains("retry-after"),
        "{text}"
    );
    assert!(text.contains("body_budget_exhausted"), "{text}");
    assert!(closed);
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    // A chunked body is charged as it arrives: refused the same way.
    let mut s = TcpStream::connect(a).await.unwrap();
    s.write_all(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n{\"content\":\"abc\"\r\n")
        .await
        .unwrap();
    let (raw, _) = read_until_close(&mut s, Duration::from_secs(3)).await;
    assert_eq!(status_of(&raw), 503, "{}", String::from_utf8_lossy(&raw));
    // Requests without a body are not held up.
    assert_eq!(get(a, "/health").await.status, 200);
    // The stalled uploads get 408; their shares come back and bodies are read again.
    for s in &mut stalled {
        let (raw, _) = read_until_close(s, Duration::from_secs(6)).await;
        assert_eq!(status_of(&raw), 408, "{}", String::from_utf8_lossy(&raw));
    }
    let r = post(a, "/tokenize", &json!({"content": "hello"})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let s = stats(a).await;
    assert_eq!(s["rejected_body_budget"], 2, "{s}");
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_get_503_and_health_recovers() {
    let srv = start(ServerConfig {
        max_connections: 8,
        header_timeout: Duration::from_secs(1),
        ..ServerConfig::default()
    })
    .await;
    let a = srv.addr;
    let mut idle = Vec::new();
    for _ in 0..8 {
        idle.push(TcpStream::connect(a).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Past the cap, a few connections are kept for /health: it still answers, and
    // anything else is refused.
    let r = get(a, "/health").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = get(a, "/v1/models").await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "too_many_connections");
    // With the reserve held too, a connection gets the 503 at once.
    for _ in 0..ds4_server::limits::HEALTH_RESERVE {
        idle.push(TcpStream::connect(a).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = get(a, "/health").await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "too_many_connections");
    // The idle ones are closed by the head timeout; then /health answers again.
    let t0 = Instant::now();
    loop {
        let r = get(a, "/health").await;
        if r.status == 200 {
            assert!(r.json()["stats"]["rejected_connections"].as_u64().unwrap() >= 1);
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "/health did not recover"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(idle);
    srv.shutdown().await.unwrap();
}

/// A half-sent request used to keep graceful shutdown from ever completing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_does_not_wait_for_stalled_clients() {
    let srv = start(ServerConfig {
        header_timeout: Duration::from_secs(60),
        body_idle_timeout: Duration::from_secs(60),
        body_timeout: Duration::from_secs(60),
        shutdown_grace: Duration::from_secs(1),
        ..ServerConfig::default()
    })
    .await;
    let mut s = TcpStream::connect(srv.addr).await.unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{",
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t0 = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), srv.shutdown())
        .await
        .expect("shutdown hung on a stalled client")
        .unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

// ---- item 3: Host / Origin / Content-Type ------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browser_attacks_are_refused() {
    let srv = start(ServerConfig {
        cors_origins: vec!["http://app.example".into()],
        allowed_hosts: vec!["ds4.lan".into()],
        ..ServerConfig::default()
    })
    .await;
    let a = srv.addr;
    let body = chat("hi").to_string();
    let b = body.as_bytes();
    let json_ct = ("Content-Type", "application/json");
    // DNS rebinding: the page's own name in Host.
    let r = raw_request(a, "evil.example:8000", &[json_ct], b).await;
    assert_eq!(r.0, 403, "{}", r.1);
    assert!(r.1.contains("--allowed-host"), "{}", r.1);
    let r = raw_request(a, "evil.example", &[], b"").await;
    assert_eq!(r.0, 403, "GET with a forged Host: {}", r.1);
    // Loopback names and --allowed-host pass.
    for host in ["localhost:8000", "127.0.0.1", "[::1]:9", "ds4.lan:8000"] {
        let r = raw_request(a, host, &[json_ct], b).await;
        assert_eq!(r.0, 200, "{host}: {}", r.1);
    }
    // CSRF: a cross-site POST (text/plain needs no preflight).
    let r = raw_request(a, "127.0.0.1", &[("Origin", "http://evil.example")], b).await;
    assert_eq!(r.0, 403, "{}", r.1);
    let r = raw_request(a, "127.0.0.1", &[("Content-Type", "text/plain")], b).await;
    assert_eq!(r.0, 415, "{}", r.1);
    let r = raw_request(
        a,
        "127.0.0.1",
        &[("Content-Type", "application/x-www-form-urlencoded")],
        b,
    )
    .await;
    assert_eq!(r.0, 415, "{}", r.1);
    // An origin --cors names is allowed, and told so.
    let r = raw_request(
        a,
        "127.0.0.1",
        &[("Origin", "http://app.example"), json_ct],
        b,
    )
    .await;
    assert_eq!(r.0, 200, "{}", r.1);
    assert!(
        r.1.to_ascii_lowercase()
            .contains("access-control-allow-origin: http://app.example"),
        "{}",
        r.1
    );
    // The server's own origin may POST.
    let own = format!("http://{a}");
    let r = raw_request(a, &a.to_string(), &[("Origin", own.as_str()), json_ct], b).await;
    assert_eq!(r.0, 200, "{}", r.1);
    assert_eq!(stats(a).await["rejected_origin"], 5);
    srv.shutdown().await.unwrap();
}

/// Sends one request with the given Host: (status, whole raw response).
async fn raw_request(
    a: SocketAddr,
    host: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, String) {
    let mut s = TcpStream::connect(a).await.unwrap();
    let method = if body.is_empty() {
        "GET /health"
    } else {
        "POST /v1/chat/completions"
    };
    let mut req = format!(
        "{method} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    let (raw, _) = read_until_close(&mut s, Duration::from_secs(60)).await;
    (status_of(&raw), String::from_utf8_lossy(&raw).into_owned())
}

/// With a key set, `/health` stays open for monitoring but tells a caller without the key
/// only that the server is up; the Host guard (DNS rebinding) covers it as every route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_with_a_key_says_only_ok_and_keeps_the_host_guard() {
    let srv = start(ServerConfig {
        api_key: Some("sekrit".into()),
        ..ServerConfig::default()
    })
    .await;
    let a = srv.addr;
    let r = get(a, "/health").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json(), serde_json::json!({"status": "ok"}));
    let r = request(a, "GET", "/health", &[("x-api-key", "wrong")], b"").await;
    assert_eq!(r.json(), serde_json::json!({"status": "ok"}));
    let r = request(
        a,
        "GET",
        "/health",
        &[("Authorization", "Bearer sekrit")],
        b"",
    )
    .await;
    let v = r.json();
    assert_eq!(v["status"], "ok");
    assert_eq!(v["ctx"], CTX);
    assert!(v["stats"]["requests"].is_u64(), "{v}");
    // A rebinding page's Host is refused on /health and on the API, key or not.
    let r = raw_request(a, "evil.example:8000", &[], b"").await;
    assert_eq!(r.0, 403, "{}", r.1);
    let b = chat("hi").to_string();
    let r = raw_request(
        a,
        "evil.example",
        &[
            ("Content-Type", "application/json"),
            ("x-api-key", "sekrit"),
        ],
        b.as_bytes(),
    )
    .await;
    assert_eq!(r.0, 403, "{}", r.1);
    srv.shutdown().await.unwrap();
}

// ---- item 4: keys ------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_empty_refused_scheme_case_insensitive() {
    let m = tokio::task::spawn_blocking(|| model(CTX)).await.unwrap();
    let empty = ds4_server::Server::bind(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        ServerConfig {
            api_key: Some(String::new()),
            ..ServerConfig::default()
        },
        m,
    )
    .await;
    let err = empty.err().expect("an empty key was accepted").to_string();
    assert!(err.contains("empty"), "{err}");

    let srv = start(ServerConfig {
        api_key: Some("sekrit".into()),
        ..ServerConfig::default()
    })
    .await;
    let a = srv.addr;
    let b = chat("hi").to_string();
    for (h, v, want) in [
        ("Authorization", "BEARER sekrit", 200),
        ("Authorization", "bearer sekrit", 200),
        ("Authorization", "Bearer  sekrit ", 200),
        ("Authorization", "Bearer ", 401),
        ("x-api-key", "", 401),
        ("x-api-key", "sekri", 401),
        ("Authorization", "Basic sekrit", 401),
    ] {
        let r = request(a, "POST", "/v1/chat/completions", &[(h, v)], b.as_bytes()).await;
        assert_eq!(r.status, want, "{h}: {v:?} → {}", r.body);
    }
    srv.shutdown().await.unwrap();
}

// ---- item 5: cache directory -------------------------------------------------------------

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_cache_directory_is_refused_untouched() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("shared");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let m = tokio::task::spawn_blocking(|| model(CTX)).await.unwrap();
    let r = ds4_server::Server::bind(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        ServerConfig {
            disk: Some(ds4_server::DiskCacheConfig::new(&dir)),
            ..ServerConfig::default()
        },
        m,
    )
    .await;
    let err = r
        .err()
        .expect("a 1777 cache directory was accepted")
        .to_string();
    assert!(err.contains("writable by other users"), "{err}");
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o1777);
}

// ---- item 6: back-pressure ---------------------------------------------------------------

/// A streaming client that stops reading is cancelled about `stall_timeout` after its
/// buffers fill, and the worker serves the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_stops_is_cancelled_quickly() {
    // A forced 20k-token answer (the random tiny model may stop early on its own).
    let huge = "word ".repeat(20_000);
    let rules = json!([{"when": "[huge]", "output": huge}]).to_string();
    let srv = start_ctx(
        ServerConfig {
            send_buffer_bytes: 16 << 10,
            script: Some(std::sync::Arc::new(
                ds4_server::Script::from_json(&rules).unwrap(),
            )),
            ..ServerConfig::default()
        },
        32768,
    )
    .await;
    let a = srv.addr;
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut s = sock.connect(a).await.unwrap();
    let body = json!({"messages":[{"role":"user","content":"[huge]"}],"think":false,"stream":true,"max_tokens":30000}).to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut head = [0u8; 64];
    let n = s.read(&mut head).await.unwrap();
    assert!(String::from_utf8_lossy(&head[..n]).starts_with("HTTP/1.1 200"));
    // Stop reading now (keep the socket open).
    let t0 = Instant::now();
    let st = wait_stats(a, |s| s["stalled"].as_u64() >= Some(1) || s["running"] == 0).await;
    let took = t0.elapsed();
    let generated = st["generated_tokens"].as_u64().unwrap();
    eprintln!("stalled reader cancelled after {took:?}; {generated} tokens generated");
    assert_eq!(
        st["stalled"], 1,
        "the generation ended without a stall: {st}"
    );
    assert!(generated < 20_000, "{st}");
    // The buffers (about 36 KB here) fill at the build's token rate first: a debug build
    // under a parallel test run streams 30–50 tokens/s, which takes 4–6 s of this; a
    // client nobody cancelled would run for minutes.
    assert!(
        took < Duration::from_secs(15),
        "cancelled only after {took:?}"
    );
    let r = post(a, "/v1/chat/completions", &chat("next")).await;
    assert_eq!(r.status, 200, "{}", r.body);
    drop(s);
    srv.shutdown().await.unwrap();
}

/// A client with an ordinary socket (the kernel's default receive buffer, which grows on
/// its own) that sends a streaming request and never reads a byte: the server's side of
/// the stream stays unacknowledged, and the generation is cancelled within a bounded time
/// (a shortened stall timeout), freeing the only slot for the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_default_socket_that_never_reads_frees_the_slot() {
    let huge = "word ".repeat(40_000);
    let rules = json!([{"when": "[huge]", "output": huge}]).to_string();
    let srv = start_ctx(
        ServerConfig {
            stall_timeout: Duration::from_millis(1000),
            // Small enough for the debug build's slow stream to pass it within seconds.
            unread_cap_bytes: 16 << 10,
            script: Some(std::sync::Arc::new(
                ds4_server::Script::from_json(&rules).unwrap(),
            )),
            ..ServerConfig::default()
        },
        65536,
    )
    .await;
    let a = srv.addr;
    let mut s = TcpStream::connect(a).await.unwrap();
    let body = json!({"messages":[{"role":"user","content":"[huge]"}],"think":false,"stream":true,"max_tokens":50000}).to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    // Never read: wait for the generation to start, then for it to end.
    let _ = wait_stats(a, |s| {
        s["running"] == 1 || s["generated_tokens"].as_u64() > Some(0)
    })
    .await;
    let t0 = Instant::now();
    let st = wait_stats(a, |s| s["running"] == 0).await;
    let took = t0.elapsed();
    let generated = st["generated_tokens"].as_u64().unwrap();
    eprintln!("a default socket that never reads: cancelled after {took:?}, {generated} tokens");
    assert_eq!(
        st["stalled"], 1,
        "the generation ended without a stall: {st}"
    );
    assert!(generated < 40_000, "{st}");
    assert!(
        took < Duration::from_secs(15),
        "cancelled only after {took:?}"
    );
    let r = post(a, "/v1/chat/completions", &chat("next")).await;
    assert_eq!(r.status, 200, "{}", r.body);
    drop(s);
    srv.shutdown().await.unwrap();
}

/// A client that reads slower than the stream is behind by more than the unread cap, but it
/// keeps taking bytes: it is not cancelled. When it stops taking them, it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_is_served_and_cancelled_once_it_stops() {
    let huge = "word ".repeat(40_000);
    let rules = json!([{"when": "[huge]", "output": huge}]).to_string();
    let srv = start_ctx(
        ServerConfig {
            stall_timeout: Duration::from_millis(1000),
            unread_cap_bytes: 4 << 10,
            script: Some(std::sync::Arc::new(
                ds4_server::Script::from_json(&rules).unwrap(),
            )),
            ..ServerConfig::default()
        },
        65536,
    )
    .await;
    let a = srv.addr;
    let mut s = TcpStream::connect(a).await.unwrap();
    // 2500 tokens: a whole stream (chunks of a few hundred bytes) stays below the 1 MiB of
    // waiting events that cancels at once, so a release build, which generates it all within
    // the five seconds below, tests the progress rule and not that cap.
    let body = json!({"messages":[{"role":"user","content":"[huge]"}],"think":false,"stream":true,"max_tokens":2500}).to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    // 100 bytes every 100 ms (1 KB/s), slower than the stream even in a loaded debug build
    // (25+ tokens/s of 100+ bytes each): the backlog passes the 4 KiB cap.
    let t0 = Instant::now();
    let mut got = 0;
    while t0.elapsed() < Duration::from_secs(5) {
        let mut buf = [0u8; 100];
        let n = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf))
            .await
            .expect("the stream went quiet")
            .unwrap();
        assert!(
            n > 0,
            "the server closed a slow reader's stream after {got} bytes"
        );
        got += n;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let st = stats(a).await;
    assert_eq!(st["stalled"], 0, "a slow reader was cancelled: {st}");
    let generated = st["generated_tokens"].as_u64().unwrap();
    // Each token is a chat chunk of well over 100 bytes.
    assert!(
        generated * 100 > got as u64 + (4 << 10),
        "the stream never got ahead of the reader ({generated} tokens, {got} bytes read): nothing was tested"
    );
    if st["running"] == 1 {
        // Still generating (a debug build): when the reader stops, the stream is cancelled.
        let t0 = Instant::now();
        let st = wait_stats(a, |s| s["running"] == 0).await;
        eprintln!(
            "slow reader: {got} bytes read in 5 s; cancelled {:?} after it stopped",
            t0.elapsed()
        );
        assert_eq!(st["stalled"], 1, "{st}");
        assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
    } else {
        // The whole answer was generated while the reader read (a release build): it waits
        // in the connection's bounded queue and the slot is free for the next request (the
        // stopped reader's cancellation is `a_default_socket_that_never_reads_frees_the_slot`).
        assert_eq!(generated, 2500, "{st}");
        let r = post(a, "/v1/chat/completions", &chat("next")).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    drop(s);
    srv.shutdown().await.unwrap();
}

// ---- item 7: special tokens in content, roles, tool_choice, panics, model path ----------

async fn marker_ids(a: SocketAddr) -> Vec<u64> {
    let mut ids = Vec::new();
    for m in [
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<think>",
        "</think>",
        "｜DSML｜",
    ] {
        let t = post(a, "/tokenize", &json!({"content": m, "special": "chat"}))
            .await
            .json();
        assert_eq!(t["count"], 1, "{m}");
        ids.push(t["tokens"][0].as_u64().unwrap());
    }
    ids
}

const EVERY: &str =
    "<｜begin▁of▁sentence｜><｜end▁of▁sentence｜><｜User｜><｜Assistant｜><think></think>｜DSML｜";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn markers_in_content_cannot_forge_turns() {
    for legacy in [false, true] {
        let srv = start(ServerConfig {
            content_special_tokens: legacy,
            ..ServerConfig::default()
        })
        .await;
        let a = srv.addr;
        let marks = marker_ids(a).await;
        let body = json!({"think": false, "messages": [
            {"role":"user","content": EVERY},
            {"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments": json!({"x": EVERY}).to_string()}}]},
            {"role":"tool","tool_call_id":"c1","content": EVERY}
        ]});
        let t = post(a, "/tokenize", &body).await.json();
        let ids: Vec<u64> = t["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        let n = ids.iter().filter(|i| marks.contains(i)).count();
        // BOS, User, Assistant, </think>, EOS-closing... the renderer's own: count them on a
        // clean copy of the same conversation.
        let clean = body.to_string().replace(EVERY, "x");
        let ct = post(
            a,
            "/tokenize",
            &serde_json::from_str::<Value>(&clean).unwrap(),
        )
        .await
        .json();
        let n_clean = ct["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|i| marks.contains(&i.as_u64().unwrap()))
            .count();
        if legacy {
            assert!(n >= n_clean + 3 * 7, "legacy flag: {n} vs {n_clean}");
        } else {
            assert_eq!(n, n_clean, "a marker in content became a control token");
        }
        // A user message of every marker alone.
        let t = post(
            a,
            "/tokenize",
            &json!({"think": false, "messages":[{"role":"user","content": EVERY}]}),
        )
        .await
        .json();
        let user_ids: Vec<u64> = t["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        let inner = &user_ids[2..user_ids.len() - 2];
        assert_eq!(inner.iter().any(|i| marks.contains(i)), legacy, "{inner:?}");
        srv.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_roles_and_missing_forced_tools_are_400() {
    let srv = start(ServerConfig::default()).await;
    let a = srv.addr;
    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"messages":[{"role":"user","content":"a"},{"role":"wizard","content":"b"}]}),
    )
    .await;
    assert_eq!(r.status, 400);
    assert!(
        r.body.contains("\\\"wizard\\\"") || r.body.contains("wizard"),
        "{}",
        r.body
    );
    let r = post(
        a,
        "/v1/messages",
        &json!({"max_tokens":2,"messages":[{"role":"narrator","content":"a"}]}),
    )
    .await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("narrator"), "{}", r.body);
    let tools = json!([bash_tool()]);
    let r = post(a, "/v1/chat/completions", &json!({"messages":[{"role":"user","content":"a"}],"tools":tools,"tool_choice":{"type":"function","function":{"name":"rm_rf"}}})).await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("rm_rf"), "{}", r.body);
    let r = post(a, "/v1/chat/completions", &json!({"messages":[{"role":"user","content":"a"}],"max_tokens":1,"tools":tools,"tool_choice":{"type":"function","function":{"name":"bash"}}})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = post(a, "/v1/messages", &json!({"max_tokens":2,"messages":[{"role":"user","content":"a"}],"tools":[{"name":"bash","input_schema":{"type":"object"}}],"tool_choice":{"type":"tool","name":"nope"}})).await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("nope"), "{}", r.body);
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_panic_is_a_500_and_the_server_keeps_serving() {
    let srv = start(ServerConfig {
        test_panic_marker: Some("[panic-now]".into()),
        ..ServerConfig::default()
    })
    .await;
    let a = srv.addr;
    let r = post(a, "/v1/chat/completions", &chat("[panic-now]")).await;
    assert_eq!(r.status, 500, "{}", r.body);
    assert_eq!(r.json()["error"]["type"], "server_error");
    for _ in 0..2 {
        let r = post(a, "/v1/chat/completions", &chat("fine")).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert_eq!(stats(a).await["handler_panics"], 1);
    srv.shutdown().await.unwrap();
}

#[test]
fn a_missing_or_directory_model_says_what_to_do() {
    let d = tempfile::tempdir().unwrap();
    let missing = d.path().join("nope.gguf");
    for (path, what) in [
        (d.path(), "is a directory"),
        (missing.as_path(), "not found"),
    ] {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_ds4-server"))
            .arg("-m")
            .arg(path)
            .args(["--port", "0"])
            .env_remove("DS4_API_KEY")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains(what), "{err}");
        assert!(
            err.contains("-m PATH") && err.contains("ds4-demo.gguf"),
            "{err}"
        );
        assert!(err.contains("ds4-convert hf"), "{err}");
        assert!(!err.contains("No such device"), "{err}");
    }
    // An empty key from the environment is refused before loading anything.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_ds4-server"))
        .arg("-m")
        .arg(common::tiny_gguf())
        .args(["--port", "0"])
        .env("DS4_API_KEY", " ")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("DS4_API_KEY is empty"), "{err}");
}
