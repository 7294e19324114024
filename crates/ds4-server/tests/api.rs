//! Every endpoint on an in-process server over the tiny fixture model: non-stream bodies,
//! SSE event sequences (parsed from the raw bytes), and the error shapes of each protocol.

mod common;

use common::*;
use ds4_server::ServerConfig;
use serde_json::{json, Value};

async fn tokenize_count(addr: std::net::SocketAddr, body: &Value) -> u64 {
    let r = post(addr, "/tokenize", body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["count"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_tokenize_detokenize() {
    let srv = start(ServerConfig::default()).await;
    let a = srv.addr;
    let r = get(a, "/v1/models").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("application/json"));
    let v = r.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "deepseek-v4-flash");
    assert_eq!(v["data"][0]["context_length"], CTX);
    assert_eq!(v["data"][0]["top_provider"]["max_completion_tokens"], CTX);
    let one = get(a, "/v1/models/deepseek-v4-flash").await.json();
    assert_eq!(one, v["data"][0]);
    let missing = get(a, "/v1/models/gpt-4").await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.json()["error"]["type"], "invalid_request_error");

    let h = get(a, "/health").await.json();
    assert_eq!(h["status"], "ok");
    assert_eq!(h["ctx"], CTX);
    assert_eq!(h["stats"]["requests"], 0);

    // Text round-trips through the byte-level vocabulary; chat markers are single tokens.
    let text = "Hello, world! <｜User｜> ünïcode ✓";
    let t = post(
        a,
        "/tokenize",
        &json!({"content": text, "with_pieces": true}),
    )
    .await
    .json();
    let ids = t["tokens"].as_array().unwrap().clone();
    assert_eq!(t["count"], ids.len());
    assert_eq!(t["pieces"].as_array().unwrap().len(), ids.len());
    let plain = post(a, "/tokenize", &json!({"content": text, "special": "none"}))
        .await
        .json();
    assert!(
        plain["count"].as_u64().unwrap() > ids.len() as u64,
        "markers are one token only in chat mode"
    );
    let d = post(a, "/detokenize", &json!({"tokens": ids})).await.json();
    assert_eq!(d["content"], text);
    let bad = post(a, "/detokenize", &json!({"tokens": [1, 999999]})).await;
    assert_eq!(bad.status, 400);
    let bad = post(a, "/detokenize", &json!({"tokens": "x"})).await;
    assert_eq!(bad.status, 400);
    let bad = post(a, "/tokenize", &json!({"content": 5})).await;
    assert_eq!(bad.status, 400);

    // A chat body is rendered first (ds4 rendering: BOS, markers, think tag).
    let t = post(
        a,
        "/tokenize",
        &json!({"messages":[{"role":"user","content":"Hi"}],"think":false}),
    )
    .await
    .json();
    assert_eq!(
        t["prompt"],
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    );
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_on_the_real_sampler() {
    let srv = start(ServerConfig::default()).await;
    let a = srv.addr;
    let body = json!({"model":"my-model","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Say something."}],
                      "max_tokens": 6, "think": false, "temperature": 0});
    let p = tokenize_count(a, &body).await;
    let r = post(a, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "my-model");
    let c = &v["choices"][0];
    assert_eq!(c["message"]["role"], "assistant");
    let finish = c["finish_reason"].as_str().unwrap();
    assert!(finish == "stop" || finish == "length", "{finish}");
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens"], p);
    assert!(u["completion_tokens"].as_u64().unwrap() <= 6);
    assert_eq!(
        u["total_tokens"],
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(u["prompt_tokens_details"]["cache_write_tokens"], p);
    // Greedy is deterministic, and the repeat reuses the prompt's turn snapshot.
    let again = post(a, "/v1/chat/completions", &body).await.json();
    assert_eq!(
        again["choices"][0]["message"]["content"],
        c["message"]["content"]
    );
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], p);
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cache_write_tokens"],
        0
    );
    // max_tokens 0: empty output, finish length.
    let z = post(
        a,
        "/v1/chat/completions",
        &json!({"messages":[{"role":"user","content":"x"}],"max_tokens":0}),
    )
    .await
    .json();
    assert_eq!(z["choices"][0]["message"]["content"], "");
    assert_eq!(z["choices"][0]["finish_reason"], "length");
    assert_eq!(z["usage"]["completion_tokens"], 0);
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_stream_reasoning_content_and_usage() {
    let srv = start(scripted()).await;
    let a = srv.addr;
    let body = json!({"messages":[{"role":"user","content":"[think] hi"}],"stream":true,"stream_options":{"include_usage":true}});
    let sse = Sse::open(a, "/v1/chat/completions", &body).await;
    assert_eq!(sse.status, 200);
    assert_eq!(sse.header("content-type"), Some("text/event-stream"));
    let evs = sse.all().await;
    assert!(evs.iter().all(|e| e.event.is_none()));
    let d = datas(&evs);
    assert_eq!(d.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = d[..d.len() - 1]
        .iter()
        .map(|s| serde_json::from_str(s).unwrap())
        .collect();
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role":"assistant"})
    );
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(chunks
        .iter()
        .all(|c| c["id"] == id && c["object"] == "chat.completion.chunk"));
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut seen_content = false;
    for c in &chunks[1..chunks.len() - 2] {
        let delta = &c["choices"][0]["delta"];
        if let Some(r) = delta["reasoning_content"].as_str() {
            assert!(!seen_content, "reasoning after content");
            reasoning.push_str(r);
        }
        if let Some(t) = delta["content"].as_str() {
            seen_content = true;
            content.push_str(t);
        }
        assert!(c["choices"][0]["finish_reason"].is_null());
    }
    assert_eq!(reasoning, "Let me think.");
    assert_eq!(content, "Hello there.");
    let fin = &chunks[chunks.len() - 2];
    assert_eq!(fin["choices"][0]["delta"], json!({}));
    assert_eq!(fin["choices"][0]["finish_reason"], "stop");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    let p = tokenize_count(
        a,
        &json!({"messages":[{"role":"user","content":"[think] hi"}]}),
    )
    .await;
    assert_eq!(usage["usage"]["prompt_tokens"], p);
    assert!(usage["usage"]["completion_tokens"].as_u64().unwrap() > 0);

    // Non-stream: reasoning_content next to content. Without include_usage no usage chunk.
    let v = post(
        a,
        "/v1/chat/completions",
        &json!({"messages":[{"role":"user","content":"[think] hi"}]}),
    )
    .await
    .json();
    assert_eq!(
        v["choices"][0]["message"]["reasoning_content"],
        "Let me think."
    );
    assert_eq!(v["choices"][0]["message"]["content"], "Hello there.");
    let evs = Sse::open(
        a,
        "/v1/chat/completions",
        &json!({"messages":[{"role":"user","content":"[think] x"}],"stream":true}),
    )
    .await
    .all()
    .await;
    assert!(datas(&evs).iter().all(|d| !d.contains("\"usage\"")));
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_tool_calls_stream_and_body() {
    let srv = start(scripted()).await;
    let a = srv.addr;
    let body = json!({"messages":[{"role":"user","content":"[tool] list"}],"tools":[bash_tool()],"think":false,"stream":true});
    let d = datas(
        &Sse::open(a, "/v1/chat/completions", &body)
            .await
            .all()
            .await,
    );
    assert_eq!(d.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = d[..d.len() - 1]
        .iter()
        .map(|s| serde_json::from_str(s).unwrap())
        .collect();
    let mut content = String::new();
    let mut args = String::new();
    let mut header = None;
    for c in &chunks {
        let delta = &c["choices"][0]["delta"];
        if let Some(t) = delta["content"].as_str() {
            assert!(header.is_none(), "content after the tool call started");
            content.push_str(t);
        }
        if let Some(tc) = delta["tool_calls"].as_array() {
            assert_eq!(tc.len(), 1);
            assert_eq!(tc[0]["index"], 0);
            if tc[0].get("id").is_some() {
                assert!(header.is_none(), "one header per call");
                assert_eq!(tc[0]["type"], "function");
                assert_eq!(tc[0]["function"]["name"], "bash");
                assert_eq!(tc[0]["function"]["arguments"], "");
                header = Some(tc[0]["id"].as_str().unwrap().to_string());
            } else {
                assert!(header.is_some(), "arguments before the header");
                args.push_str(tc[0]["function"]["arguments"].as_str().unwrap());
            }
        }
    }
    assert_eq!(content, "Sure.");
    let id = header.expect("a streamed tool call");
    assert!(id.starts_with("call_") && id.len() == 37, "{id}");
    let parsed: Value = serde_json::from_str(&args).unwrap_or_else(|e| panic!("{args}: {e}"));
    assert_eq!(parsed, expected_args());
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );

    // Non-stream: compact arguments string, finish tool_calls.
    let mut b = body.clone();
    b["stream"] = json!(false);
    let v = post(a, "/v1/chat/completions", &b).await.json();
    let m = &v["choices"][0]["message"];
    assert_eq!(m["content"], "Sure.");
    assert_eq!(
        m["tool_calls"][0]["function"]["arguments"],
        r#"{"command":"ls -la & pwd","timeout":10}"#
    );
    assert_ne!(m["tool_calls"][0]["id"], id.as_str());
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    // tool_choice "none": the schemas are not rendered and DSML is not streamed live, but the
    // final parse still turns it into tool calls (docs/chat.md §3.2).
    b["tool_choice"] = json!("none");
    let v = post(a, "/v1/chat/completions", &b).await.json();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_sequences_cut_and_are_not_streamed() {
    let srv = start(scripted()).await;
    let a = srv.addr;
    let body =
        json!({"messages":[{"role":"user","content":"[stop]"}],"think":false,"stop":["STOP"]});
    let v = post(a, "/v1/chat/completions", &body).await.json();
    assert_eq!(v["choices"][0]["message"]["content"], "abc ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let mut b = body.clone();
    b["stream"] = json!(true);
    let d = datas(&Sse::open(a, "/v1/chat/completions", &b).await.all().await);
    let text: String = d[..d.len() - 1]
        .iter()
        .filter_map(|s| serde_json::from_str::<Value>(s).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(text, "abc ");
    // Anthropic's stop_sequences; the stop reason is end_turn.
    let m = post(a, "/v1/messages", &json!({"max_tokens":50,"messages":[{"role":"user","content":"[stop]"}],"thinking":{"type":"disabled"},"stop_sequences":["STOP"]})).await.json();
    assert_eq!(m["content"][0]["text"], "abc ");
    assert_eq!(m["stop_reason"], "end_turn");
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_plain_and_stream() {
    let srv = start(scripted()).await;
    let a = srv.addr;
    let v = post(a, "/v1/completions", &json!({"prompt":"[think] once upon"}))
        .await
        .json();
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["object"], "text_completion");
    // Raw text: reasoning, the close tag and the answer, unsplit.
    assert_eq!(v["choices"][0]["text"], "Let me think.</think>Hello there.");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    let d = datas(
        &Sse::open(a, "/v1/completions", &json!({"prompt":"[plain]","stream":true,"stream_options":{"include_usage":true},"max_tokens":3})).await.all().await,
    );
    assert_eq!(d.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = d[..d.len() - 1]
        .iter()
        .map(|s| serde_json::from_str(s).unwrap())
        .collect();
    let n = chunks.len();
    let text: String = chunks[..n - 2]
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    assert!(
        "The answer is 42.".starts_with(&text) && !text.is_empty(),
        "{text}"
    );
    assert_eq!(chunks[n - 2]["choices"][0]["text"], "");
    assert_eq!(chunks[n - 2]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[n - 1]["usage"]["completion_tokens"], 3);
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_plain_and_stream_with_tools() {
    let srv = start(scripted()).await;
    let a = srv.addr;
    let v = post(a, "/v1/messages", &json!({"model":"claude-x","max_tokens":64,"system":"Be brief.","messages":[{"role":"user","content":"[think] hi"}]})).await.json();
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["model"], "claude-x");
    let id = v["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    assert_eq!(
        v["content"][0],
        json!({"type":"thinking","thinking":"Let me think.","signature":id})
    );
    assert_eq!(
        v["content"][1],
        json!({"type":"text","text":"Hello there."})
    );
    assert_eq!(v["stop_reason"], "end_turn");
    assert!(v["stop_sequence"].is_null());
    let u = &v["usage"];
    assert_eq!(u["input_tokens"], 0);
    assert!(u["cache_creation_input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(u["cache_read_input_tokens"], 0);
    assert!(u["output_tokens"].as_u64().unwrap() > 0);

    let tools = json!([{"name":"bash","description":"Run","input_schema":{"type":"object","properties":{"command":{"type":"string"},"timeout":{"type":"integer"}}}}]);
    let body = json!({"max_tokens":256,"stream":true,"tools":tools,"messages":[{"role":"user","content":[{"type":"text","text":"[thinktool] go"}]}]});
    let evs = Sse::open(a, "/v1/messages", &body).await.all().await;
    let names: Vec<&str> = evs.iter().map(|e| e.event.as_deref().unwrap()).collect();
    for e in &evs {
        assert_eq!(
            e.json()["type"],
            e.event.as_deref().unwrap(),
            "event name = data type"
        );
    }
    assert_eq!(names[0], "message_start");
    assert_eq!(&names[names.len() - 2..], ["message_delta", "message_stop"]);
    let start = evs[0].json();
    assert_eq!(start["message"]["content"], json!([]));
    assert_eq!(start["message"]["usage"]["output_tokens"], 0);
    // Blocks: 0 thinking, 1 text, 2 tool_use; each start…deltas…stop with one index.
    let mut blocks: Vec<(String, String, Vec<Value>)> = Vec::new();
    let mut open: Option<usize> = None;
    for e in &evs[1..evs.len() - 2] {
        let j = e.json();
        match e.event.as_deref().unwrap() {
            "content_block_start" => {
                assert!(open.is_none());
                assert_eq!(j["index"], blocks.len());
                open = Some(blocks.len());
                let cb = &j["content_block"];
                blocks.push((
                    cb["type"].as_str().unwrap().to_string(),
                    String::new(),
                    vec![cb.clone()],
                ));
            }
            "content_block_delta" => {
                let i = open.expect("delta inside a block");
                assert_eq!(j["index"], i);
                let d = &j["delta"];
                let piece = match d["type"].as_str().unwrap() {
                    "thinking_delta" => d["thinking"].as_str().unwrap().to_string(),
                    "text_delta" => d["text"].as_str().unwrap().to_string(),
                    "input_json_delta" => d["partial_json"].as_str().unwrap().to_string(),
                    "signature_delta" => {
                        blocks[i].2.push(d.clone());
                        String::new()
                    }
                    other => panic!("unexpected delta {other}"),
                };
                blocks[i].1.push_str(&piece);
            }
            "content_block_stop" => {
                assert_eq!(j["index"], open.take().unwrap());
            }
            other => panic!("unexpected event {other}"),
        }
    }
    assert!(open.is_none());
    let kinds: Vec<&str> = blocks.iter().map(|b| b.0.as_str()).collect();
    assert_eq!(kinds, ["thinking", "text", "tool_use"]);
    assert_eq!(blocks[0].1, "I should run ls.");
    let msg_id = start["message"]["id"].as_str().unwrap();
    assert_eq!(blocks[0].2.last().unwrap()["signature"], msg_id);
    assert_eq!(blocks[1].1, "Sure.");
    let tu = &blocks[2].2[0];
    assert_eq!(tu["name"], "bash");
    assert!(tu["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(tu["input"], json!({}));
    assert_eq!(
        serde_json::from_str::<Value>(&blocks[2].1).unwrap(),
        expected_args()
    );
    let md = evs[evs.len() - 2].json();
    assert_eq!(md["delta"]["stop_reason"], "tool_use");
    assert!(md["delta"]["stop_sequence"].is_null());
    assert!(md["usage"]["output_tokens"].as_u64().unwrap() > 0);

    // Non-stream tool_use block carries the input object; length → max_tokens.
    let mut b = body.clone();
    b["stream"] = json!(false);
    let v = post(a, "/v1/messages", &b).await.json();
    let last = v["content"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["type"], "tool_use");
    assert_eq!(last["input"], expected_args());
    assert_eq!(v["stop_reason"], "tool_use");
    let v = post(a, "/v1/messages", &json!({"max_tokens":2,"messages":[{"role":"user","content":"[plain]"}],"thinking":{"type":"disabled"}})).await.json();
    assert_eq!(v["stop_reason"], "max_tokens");
    // Only thinking, no text: an empty text block follows.
    let v = post(
        a,
        "/v1/messages",
        &json!({"max_tokens":50,"messages":[{"role":"user","content":"[onlythink]"}]}),
    )
    .await
    .json();
    assert_eq!(
        v["content"],
        json!([{"type":"thinking","thinking":"Thinking only.","signature":v["id"]},{"type":"text","text":""}])
    );
    // Reasoning cut by max_tokens has no </think>: non-stream reports it as text (ds4 quirk).
    let v = post(
        a,
        "/v1/messages",
        &json!({"max_tokens":3,"messages":[{"role":"user","content":"[think]"}]}),
    )
    .await
    .json();
    assert_eq!(v["content"], json!([{"type":"text","text":"Let m"}]));
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_lifecycle_and_body() {
    let srv = start(scripted()).await;
    let a = srv.addr;
    let tools = json!([{"type":"function","name":"bash","description":"Run","parameters":{"type":"object","properties":{"command":{"type":"string"}}}}]);
    let body = json!({"model":"codex-model","instructions":"You are Codex.","input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"[thinktool] go"}]}],
                      "tools":tools,"reasoning":{"effort":"high","summary":"auto"},"stream":true});
    let evs = Sse::open(a, "/v1/responses", &body).await.all().await;
    assert!(
        evs.iter().all(|e| e.event.is_none()),
        "Responses events are data-only"
    );
    for (i, e) in evs.iter().enumerate() {
        assert!(
            e.data.starts_with(&format!(
                "{{\"type\":\"{}\",\"sequence_number\":{i},",
                e.json()["type"].as_str().unwrap()
            )),
            "{}",
            e.data
        );
    }
    let types: Vec<String> = evs
        .iter()
        .map(|e| e.json()["type"].as_str().unwrap().to_string())
        .collect();
    let pos = |t: &str| {
        types
            .iter()
            .position(|x| x == t)
            .unwrap_or_else(|| panic!("no {t} in {types:?}"))
    };
    assert_eq!(types[0], "response.created");
    assert_eq!(evs[0].json()["response"]["status"], "in_progress");
    assert!(
        pos("response.reasoning_summary_part.added") < pos("response.reasoning_summary_text.delta")
    );
    assert!(pos("response.reasoning_summary_text.delta") < pos("response.output_text.delta"));
    assert!(
        pos("response.output_text.delta") < pos("response.reasoning_summary_text.done"),
        "reasoning closes after the text"
    );
    assert!(pos("response.output_text.done") < pos("response.function_call_arguments.delta"));
    assert_eq!(types.last().unwrap(), "response.completed");
    let reasoning: String = evs
        .iter()
        .map(|e| e.json())
        .filter(|j| j["type"] == "response.reasoning_summary_text.delta")
        .map(|j| j["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(reasoning, "I should run ls.");
    let text: String = evs
        .iter()
        .map(|e| e.json())
        .filter(|j| j["type"] == "response.output_text.delta")
        .map(|j| j["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, "Sure.");
    let args = evs
        .iter()
        .map(|e| e.json())
        .find(|j| j["type"] == "response.function_call_arguments.done")
        .unwrap();
    assert_eq!(args["name"], "bash");
    assert_eq!(
        serde_json::from_str::<Value>(args["arguments"].as_str().unwrap()).unwrap(),
        expected_args()
    );
    let done = evs.last().unwrap().json();
    let r = &done["response"];
    assert_eq!(r["status"], "completed");
    assert_eq!(r["model"], "codex-model");
    assert!(r["id"].as_str().unwrap().starts_with("resp_"));
    let out = r["output"].as_array().unwrap();
    let kinds: Vec<&str> = out.iter().map(|o| o["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["reasoning", "message", "function_call"]);
    assert!(out[0]["id"].as_str().unwrap().starts_with("rs_"));
    assert!(out[1]["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(out[1]["content"][0]["text"], "Sure.");
    assert!(out[2]["id"].as_str().unwrap().starts_with("fc_"));
    assert!(out[2]["call_id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(out[2]["status"], "completed");
    let u = &r["usage"];
    assert_eq!(
        u["total_tokens"],
        u["input_tokens"].as_u64().unwrap() + u["output_tokens"].as_u64().unwrap()
    );
    // output_index of each item event matches its place in the final output.
    for j in evs
        .iter()
        .map(|e| e.json())
        .filter(|j| j["type"] == "response.output_item.done")
    {
        let i = j["output_index"].as_u64().unwrap() as usize;
        assert_eq!(j["item"]["id"], out[i]["id"]);
    }

    // Non-stream: no reasoning item without a summary opt-in; incomplete at max_output_tokens.
    let v = post(a, "/v1/responses", &json!({"input":"[think] hi"}))
        .await
        .json();
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    let out = v["output"].as_array().unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0]["type"], "message");
    assert_eq!(out[0]["content"][0]["type"], "output_text");
    assert_eq!(out[0]["content"][0]["text"], "Hello there.");
    let v = post(
        a,
        "/v1/responses",
        &json!({"input":"[plain]","max_output_tokens":2,"reasoning":{"effort":"none"}}),
    )
    .await
    .json();
    assert_eq!(v["status"], "incomplete");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(v["output"][0]["status"], "incomplete");
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_have_each_protocols_shape() {
    let cfg = ServerConfig {
        max_body_bytes: 4096,
        ..ServerConfig::default()
    };
    let srv = start_ctx(cfg, 256).await;
    let a = srv.addr;
    let raw = |path: &'static str, body: &'static str| async move {
        request(
            a,
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body.as_bytes(),
        )
        .await
    };
    let openai = |r: &Resp, status: u16, needle: &str| {
        assert_eq!(r.status, status, "{}", r.body);
        let v = r.json();
        assert_eq!(
            v["error"]["type"],
            if status == 404 || status < 500 {
                "invalid_request_error"
            } else {
                "server_error"
            },
            "{v}"
        );
        assert!(
            v["error"]["message"].as_str().unwrap().contains(needle),
            "{v} lacks {needle}"
        );
    };
    let anthropic = |r: &Resp, status: u16, ty: &str, needle: &str| {
        assert_eq!(r.status, status, "{}", r.body);
        let v = r.json();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], ty, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(needle),
            "{v} lacks {needle}"
        );
    };
    openai(
        &raw("/v1/chat/completions", "{").await,
        400,
        "invalid JSON request",
    );
    openai(
        &raw("/v1/chat/completions", "[1]").await,
        400,
        "JSON object",
    );
    openai(
        &raw("/v1/chat/completions", r#"{"model":"x"}"#).await,
        400,
        "missing messages",
    );
    openai(
        &raw(
            "/v1/chat/completions",
            r#"{"messages":[],"temperature":"hot"}"#,
        )
        .await,
        400,
        "temperature",
    );
    openai(
        &raw("/v1/chat/completions", r#"{"messages":[],"top_p":2}"#).await,
        400,
        "top_p",
    );
    openai(
        &raw("/v1/chat/completions", r#"{"messages":[],"max_tokens":-5}"#).await,
        400,
        "max_tokens",
    );
    openai(
        &raw(
            "/v1/chat/completions",
            r#"{"messages":[],"reasoning_effort":"extreme"}"#,
        )
        .await,
        400,
        "invalid JSON request",
    );
    openai(
        &raw("/v1/completions", r#"{"max_tokens":1}"#).await,
        400,
        "missing prompt",
    );
    openai(
        &raw("/v1/responses", r#"{"model":"x"}"#).await,
        400,
        "missing input",
    );
    openai(
        &raw("/v1/responses", r#"{"input":"x","tool_choice":"required"}"#).await,
        400,
        "tool_choice=required not supported",
    );
    openai(
        &raw(
            "/v1/responses",
            r#"{"input":"x","previous_response_id":"resp_1"}"#,
        )
        .await,
        400,
        "replay full input",
    );
    openai(
        &raw(
            "/v1/responses",
            r#"{"input":[{"type":"function_call_output","call_id":"call_gone","output":"x"}]}"#,
        )
        .await,
        400,
        "call_id call_gone",
    );
    anthropic(
        &raw("/v1/messages", "{nope").await,
        400,
        "invalid_request_error",
        "invalid JSON request",
    );
    anthropic(
        &raw("/v1/messages", r#"{"max_tokens":5}"#).await,
        400,
        "invalid_request_error",
        "missing messages",
    );
    anthropic(
        &raw("/v1/messages", r#"{"messages":[],"top_k":-1}"#).await,
        400,
        "invalid_request_error",
        "top_k",
    );
    // Unknown fields are accepted and ignored.
    let ok = raw("/v1/chat/completions", r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":1,"frobnicate":{"deep":[1,2]},"logit_bias":{}}"#).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    // Unknown endpoint, wrong method.
    let r = get(a, "/v2/nothing").await;
    openai(&r, 404, "unknown endpoint");
    let r = get(a, "/v1/chat/completions").await;
    assert_eq!(r.status, 405);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("GET"));
    // Body over the limit.
    let big = format!(
        r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(8000)
    );
    let r = request(a, "POST", "/v1/chat/completions", &[], big.as_bytes()).await;
    assert_eq!(r.status, 413);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("4096"));
    let r = request(a, "POST", "/v1/messages", &[], big.as_bytes()).await;
    anthropic(&r, 413, "request_too_large", "limit");
    // Context overflow (ctx 256): OpenAI and Anthropic shapes with the counts.
    let long = "word ".repeat(300);
    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"messages":[{"role":"user","content":long}]}),
    )
    .await;
    assert_eq!(r.status, 400);
    let v = r.json();
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert_eq!(v["error"]["param"], "messages");
    assert_eq!(v["error"]["n_ctx"], 256);
    assert!(v["error"]["n_prompt_tokens"].as_u64().unwrap() >= 256);
    let r = post(
        a,
        "/v1/messages",
        &json!({"messages":[{"role":"user","content":long}]}),
    )
    .await;
    anthropic(
        &r,
        400,
        "invalid_request_error",
        "configured context size is 256",
    );
    assert_eq!(r.json()["error"]["n_ctx"], 256);
    let r = post(a, "/v1/completions", &json!({"prompt":long})).await;
    assert_eq!(r.json()["error"]["param"], "prompt");
    // OPTIONS is 204 without CORS headers unless --cors.
    let r = request(a, "OPTIONS", "/v1/chat/completions", &[], b"").await;
    assert_eq!(r.status, 204);
    assert!(r.header("access-control-allow-origin").is_none());
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_and_cors() {
    let cfg = ServerConfig {
        api_key: Some("sekrit".into()),
        cors_origins: vec!["*".into()],
        ..ServerConfig::default()
    };
    let srv = start(cfg).await;
    let a = srv.addr;
    let body = br#"{"messages":[{"role":"user","content":"x"}],"max_tokens":1}"#;
    let r = request(a, "POST", "/v1/chat/completions", &[], body).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], "authentication_error");
    assert_eq!(r.header("access-control-allow-origin"), Some("*"));
    let r = request(
        a,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer wrong")],
        body,
    )
    .await;
    assert_eq!(r.status, 401);
    let r = request(a, "POST", "/v1/messages", &[("x-api-key", "nope")], body).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], "authentication_error");
    assert_eq!(r.json()["type"], "error");
    let r = request(
        a,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer sekrit")],
        body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = request(a, "POST", "/v1/messages", &[("x-api-key", "sekrit")], body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(get(a, "/health").await.status, 200, "health is open");
    let r = request(a, "OPTIONS", "/v1/messages", &[], b"").await;
    assert_eq!(r.status, 204);
    assert_eq!(
        r.header("access-control-allow-methods"),
        Some("GET, POST, OPTIONS")
    );
    assert_eq!(r.header("access-control-allow-headers"), Some("*"));
    srv.shutdown().await.unwrap();
}
