//! Request limits and wire details of the generation endpoints: empty conversations, the
//! default output limit, raw completion prompts, stop-sequence bounds, unsupported fields
//! (`n`, media parts), token log probabilities, the SSE field order and Anthropic streams cut short.

mod common;

use common::*;
use ds4_server::ServerConfig;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn assert_400_naming(r: &Resp, field: &str) {
    assert_eq!(r.status, 400, "{}", r.body);
    let v = r.json();
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains(field), "error does not name {field}: {msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_conversations_are_refused() {
    let srv = start(scripted()).await;
    let a = srv.addr;
    let r = post(a, "/v1/chat/completions", &json!({"messages": []})).await;
    assert_400_naming(&r, "`messages`");
    let r = post(
        a,
        "/v1/messages",
        &json!({"max_tokens": 5, "system": "Be brief.", "messages": []}),
    )
    .await;
    assert_400_naming(&r, "`messages`");
    assert_eq!(r.json()["type"], "error");
    let r = post(a, "/v1/responses", &json!({"input": []})).await;
    assert_400_naming(&r, "`input`");
    let r = post(a, "/v1/completions", &json!({"prompt": ""})).await;
    assert_400_naming(&r, "`prompt`");
    assert_eq!(stats(a).await["requests"], 0, "nothing was queued");
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_max_tokens_means_the_default_limit() {
    let srv = start(ServerConfig {
        default_max_tokens: 7,
        ..scripted()
    })
    .await;
    let a = srv.addr;
    // The scripted output is 400 words; without a client limit the default cuts it.
    let v = post(
        a,
        "/v1/chat/completions",
        &json!({"messages":[{"role":"user","content":"[long]"}],"think":false}),
    )
    .await
    .json();
    assert_eq!(v["usage"]["completion_tokens"], 7, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // A client limit above the default is honoured (up to -n).
    let v = post(
        a,
        "/v1/chat/completions",
        &json!({"messages":[{"role":"user","content":"[long]"}],"think":false,"max_tokens":9}),
    )
    .await
    .json();
    assert_eq!(v["usage"]["completion_tokens"], 9, "{v}");
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_send_the_raw_prompt() {
    let srv = start(ServerConfig::default()).await;
    let a = srv.addr;
    for prompt in [
        "Once upon a time",
        "<｜User｜>Hi<｜Assistant｜>",
        "ünïcode ✓ text",
    ] {
        let t = post(a, "/tokenize", &json!({ "content": prompt }))
            .await
            .json();
        let count = t["count"].as_u64().unwrap();
        let v = post(
            a,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 1, "temperature": 0}),
        )
        .await;
        assert_eq!(v.status, 200, "{}", v.body);
        assert_eq!(
            v.json()["usage"]["prompt_tokens"].as_u64().unwrap(),
            count,
            "{prompt:?}: the prompt is tokenized as sent, with no template around it"
        );
    }
    // One prompt per request.
    let r = post(a, "/v1/completions", &json!({"prompt": ["a", "b"]})).await;
    assert_400_naming(&r, "`prompt`");
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_sequences_are_bounded() {
    let srv = start(scripted()).await;
    let a = srv.addr;
    let many: Vec<String> = (0..ds4_server::request::MAX_STOP_SEQUENCES + 1)
        .map(|i| format!("s{i}"))
        .collect();
    let long = "x".repeat(ds4_server::request::MAX_STOP_BYTES + 1);
    let msgs = json!([{"role":"user","content":"[stop]"}]);
    for (path, field) in [
        ("/v1/chat/completions", "stop"),
        ("/v1/messages", "stop_sequences"),
    ] {
        let mut body = json!({"messages": msgs, "max_tokens": 50});
        body[field] = json!(many);
        let r = post(a, path, &body).await;
        assert_400_naming(&r, &format!("`{field}`"));
        body[field] = json!(["ok", long]);
        let r = post(a, path, &body).await;
        assert_400_naming(&r, &format!("`{field}[1]`"));
    }
    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt": "[stop]", "stop": many}),
    )
    .await;
    assert_400_naming(&r, "`stop`");
    // The most that is allowed still works (and still stops).
    let ok: Vec<String> = (0..ds4_server::request::MAX_STOP_SEQUENCES - 1)
        .map(|i| format!("never{i}"))
        .chain(["STOP".to_string()])
        .collect();
    let v = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 50, "think": false, "stop": ok}),
    )
    .await
    .json();
    assert_eq!(v["choices"][0]["message"]["content"], "abc ");
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_fields_are_refused_not_ignored() {
    let srv = start(scripted()).await;
    let a = srv.addr;
    let user = json!({"role":"user","content":"[plain]"});
    let chat = |extra: Value| {
        let mut b = json!({"messages": [user.clone()], "max_tokens": 2});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let r = post(a, "/v1/chat/completions", &chat(json!({"n": 2}))).await;
    assert_400_naming(&r, "`n`");
    // Log probabilities are reported for plain, non-streamed answers (see
    // `logprobs_are_reported_for_each_token`); elsewhere they are refused.
    let r = post(a, "/v1/chat/completions", &chat(json!({"logprobs": true}))).await;
    assert_400_naming(&r, "`logprobs` needs thinking disabled");
    let r = post(a, "/v1/chat/completions", &chat(json!({"top_logprobs": 3}))).await;
    assert_400_naming(&r, "`top_logprobs`");
    let img = json!({"messages":[{"role":"user","content":[{"type":"text","text":"what is this?"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}],"max_tokens":2});
    let r = post(a, "/v1/chat/completions", &img).await;
    assert_400_naming(&r, "`messages[0].content[1]`");
    let audio = json!({"messages":[{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}}]}],"max_tokens":2});
    let r = post(a, "/v1/chat/completions", &audio).await;
    assert_400_naming(&r, "`messages[0].content[0]`");
    let anth = json!({"max_tokens":2,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AAAA"}}]}]});
    let r = post(a, "/v1/messages", &anth).await;
    assert_400_naming(&r, "`messages[0].content[0]`");
    let resp = json!({"input":[{"role":"user","content":[{"type":"input_image","image_url":"data:image/png;base64,AAAA"}]}]});
    let r = post(a, "/v1/responses", &resp).await;
    assert_400_naming(&r, "`input[0].content[0]`");
    let r = post(a, "/v1/completions", &json!({"prompt":"[plain]","n":3})).await;
    assert_400_naming(&r, "`n`");
    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt":"[plain]","logprobs":2,"stream":true}),
    )
    .await;
    assert_400_naming(&r, "`logprobs`");
    // The neutral values are still accepted.
    let r = post(
        a,
        "/v1/chat/completions",
        &chat(json!({"n": 1, "logprobs": false, "top_logprobs": 0})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    srv.shutdown().await.unwrap();
}

/// The raw bytes of a streamed answer (headers and chunk framing included).
async fn raw_stream(addr: std::net::SocketAddr, path: &str, body: &Value) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let b = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        b.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(b.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(120), s.read_to_end(&mut raw))
        .await
        .unwrap()
        .unwrap();
    String::from_utf8(raw).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_event_line_comes_before_data() {
    let srv = start(scripted()).await;
    let a = srv.addr;
    let wire = raw_stream(
        a,
        "/v1/messages",
        &json!({"max_tokens":20,"stream":true,"thinking":{"type":"disabled"},"messages":[{"role":"user","content":"[plain]"}]}),
    )
    .await;
    assert!(
        wire.contains("event: message_start\ndata: {\"type\":\"message_start\""),
        "{wire}"
    );
    assert!(wire.contains("event: message_stop\ndata: "), "{wire}");
    assert!(
        !wire.contains("}\nevent:"),
        "an event line followed its data: {wire}"
    );
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_stream_cut_short_ends_with_an_error_event() {
    let srv = start(scripted()).await;
    let a = srv.addr;
    let tool = json!({"name":"bash","description":"Run a shell command","input_schema":{"type":"object","properties":{"command":{"type":"string"}}}});
    // The output limit falls inside the scripted tool call: the generation ends in error
    // ("unterminated tool call").
    let body = json!({"max_tokens":30,"stream":true,"thinking":{"type":"disabled"},"tools":[tool],
                      "messages":[{"role":"user","content":"[tool]"}]});
    let evs = Sse::open(a, "/v1/messages", &body).await.all().await;
    let last = evs.last().expect("events");
    assert_eq!(last.event.as_deref(), Some("error"), "{evs:?}");
    assert_eq!(last.json()["type"], "error");
    assert!(
        last.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tool call"),
        "{last:?}"
    );
    assert!(
        evs.iter().all(|e| !e.data.contains("end_turn")),
        "a failed stream claimed end_turn: {evs:?}"
    );
    assert!(evs
        .iter()
        .all(|e| e.event.as_deref() != Some("message_stop")));
    // Not streamed: an error answer in Anthropic's shape, not a message ending in end_turn.
    let mut plain = body.clone();
    plain["stream"] = json!(false);
    let r = post(a, "/v1/messages", &plain).await;
    assert_eq!(r.status, 500, "{}", r.body);
    let v = r.json();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "api_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tool call"),
        "{v}"
    );
    srv.shutdown().await.unwrap();
}

/// The binary binds before loading the model: meanwhile `/health` answers 503 "loading"
/// and every other route 503 in its protocol's shape; then the same listener serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_port_answers_503_while_the_model_loads() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = listener.local_addr().unwrap();
    let loading = ds4_server::loading::Loading::start(listener, std::time::Duration::from_secs(5));
    let r = get(a, "/health").await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json(), json!({"status": "loading"}));
    assert!(r.header("retry-after").is_some());
    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"messages":[{"role":"user","content":"x"}]}),
    )
    .await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("loading"));
    let r = post(a, "/v1/messages", &json!({"messages":[]})).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["type"], "error");
    // The model is ready: the same port serves.
    let listener = loading.finish().await.unwrap();
    let m = tokio::task::spawn_blocking(|| model(CTX)).await.unwrap();
    let srv = ds4_server::Server::from_listener(listener, ServerConfig::default(), m)
        .unwrap()
        .spawn();
    assert_eq!(srv.addr, a);
    let r = get(a, "/health").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["status"], "ok");
    srv.shutdown().await.unwrap();
}

/// Chat `logprobs`/`top_logprobs` and completions `logprobs`: one entry per generated
/// token, whose bytes make up the answer, with the most likely alternatives; a greedy
/// draw's token is its step's most likely one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_are_reported_for_each_token() {
    let srv = start(ServerConfig::default()).await;
    let a = srv.addr;
    let body = json!({"messages":[{"role":"user","content":"Say something."}],"think":false,
                      "temperature":0,"max_tokens":6,"logprobs":true,"top_logprobs":3});
    let r = post(a, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap(),
        "{v}"
    );
    assert!(!content.is_empty());
    let mut bytes = Vec::new();
    for e in content {
        let lp = e["logprob"].as_f64().unwrap();
        assert!(lp <= 0.0, "{e}");
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{e}");
        let tops: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(tops.windows(2).all(|w| w[0] >= w[1]), "{e}");
        assert!(
            tops.iter().map(|x| x.exp()).sum::<f64>() <= 1.0 + 1e-4,
            "{e}"
        );
        // Greedy: the token drawn is the most likely one.
        assert_eq!(e["token"], top[0]["token"], "{e}");
        assert!((lp - tops[0]).abs() < 1e-5, "{e}");
        let b: Vec<u8> = e["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(String::from_utf8_lossy(&b), e["token"].as_str().unwrap());
        bytes.extend(b);
    }
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        String::from_utf8_lossy(&bytes).starts_with(text),
        "the tokens do not spell the answer: {v}"
    );
    // Without the field there is none.
    let mut plain = body.clone();
    plain.as_object_mut().unwrap().remove("logprobs");
    plain.as_object_mut().unwrap().remove("top_logprobs");
    let v = post(a, "/v1/chat/completions", &plain).await.json();
    assert!(v["choices"][0].get("logprobs").is_none(), "{v}");

    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt":"Once upon a time","max_tokens":5,"temperature":0,"logprobs":2}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(
        tokens.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), tokens.len());
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    // Byte offsets: each token starts where the previous one's bytes end (a token that is
    // part of a UTF-8 character shows as U+FFFD, so only whole ones are measured).
    assert_eq!(offsets.first(), Some(&0));
    for (w, t) in offsets.windows(2).zip(&tokens) {
        assert!(w[1] > w[0], "{offsets:?}");
        if !t.contains('\u{FFFD}') {
            assert_eq!(w[1] - w[0], t.len() as u64, "{t:?} in {lp}");
        }
    }
    for (t, top) in tokens.iter().zip(lp["top_logprobs"].as_array().unwrap()) {
        let m = top.as_object().unwrap();
        assert!(!m.is_empty() && m.len() <= 2, "{top}");
        assert!(
            m.contains_key(*t),
            "greedy token {t:?} not the most likely: {top}"
        );
    }

    // Out of range or where they cannot be reported: 400 naming the field.
    let mut big = body.clone();
    big["top_logprobs"] = json!(21);
    assert_400_naming(
        &post(a, "/v1/chat/completions", &big).await,
        "`top_logprobs`",
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    assert_400_naming(
        &post(a, "/v1/chat/completions", &streamed).await,
        "`logprobs`",
    );
    let r = post(a, "/v1/completions", &json!({"prompt":"x","logprobs":6})).await;
    assert_400_naming(&r, "`logprobs`");
    srv.shutdown().await.unwrap();
}
