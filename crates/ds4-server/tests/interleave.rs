//! Chunked prefill interleaved with decode (docs/server.md §9): a long prompt that arrives
//! while other streams decode is evaluated one step's budget at a time, and the running
//! streams get a decode step between two of its pieces, so none of them waits for more than
//! one chunk of it. Checked on the scheduler's step log (a test hook that records every
//! forward pass), by counting prompt tokens between two tokens of a running stream, not by
//! timing; and every stream's greedy tokens are the ones it gets served alone.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use ds4_server::trace::{largest_prefill_between_tokens, StepEvent, StepTrace};
use ds4_server::ServerConfig;
use serde_json::{json, Value};

/// The tiny model's prefill chunk (`common::model`): the default step budget.
const CHUNK: usize = 64;

fn cfg(parallel: usize, trace: Option<Arc<StepTrace>>) -> ServerConfig {
    ServerConfig {
        parallel,
        // The default budget: one prefill chunk per step.
        prefill_per_step: 0,
        // Keeps the runners generating while the long prompt arrives (the outputs do not
        // depend on it; whether they overlapped is checked on the step log).
        token_delay: Some(Duration::from_millis(3)),
        step_trace: trace,
        ..ServerConfig::default()
    }
}

fn greedy(prompt: &str, max_tokens: u64) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true, "think": false,
        "temperature": 0, "stream_options": {"include_usage": true}})
}

/// Text, finish reason and token counts of a finished completions stream.
fn collect(evs: &[SseEvent]) -> (String, Value, Value, Value) {
    assert_eq!(evs.last().map(|e| e.data.as_str()), Some("[DONE]"));
    let (mut text, mut finish, mut gen, mut prompt) =
        (String::new(), Value::Null, Value::Null, Value::Null);
    for e in &evs[..evs.len() - 1] {
        let v = e.json();
        assert!(v.get("error").is_none(), "stream error: {v}");
        if let Some(c) = v["choices"].get(0) {
            text.push_str(c["text"].as_str().unwrap_or(""));
            if !c["finish_reason"].is_null() {
                finish = c["finish_reason"].clone();
            }
        }
        if !v["usage"].is_null() {
            gen = v["usage"]["completion_tokens"].clone();
            prompt = v["usage"]["prompt_tokens"].clone();
        }
    }
    (text, finish, gen, prompt)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_never_holds_running_streams_for_more_than_one_chunk() {
    let long = "The quick brown fox jumps over the lazy dog, and then it runs away. ".repeat(6);
    let reqs = [
        greedy("It was a dark and stormy night", 200),
        greedy("Dear diary, today", 200),
        greedy(&long, 8),
    ];
    // Each request served alone.
    let one = start(cfg(1, None)).await;
    let mut want = Vec::new();
    for r in &reqs {
        let sse = Sse::open(one.addr, "/v1/completions", r).await;
        assert_eq!(sse.status, 200);
        want.push(collect(&sse.all().await));
    }
    one.shutdown().await.unwrap();
    // The runners generate to their limit (so they are still decoding when it arrives).
    assert_eq!(
        (&want[0].1, &want[1].1),
        (&json!("length"), &json!("length"))
    );
    let long_tokens = want[2].3.as_u64().expect("prompt tokens") as usize;
    assert!(
        long_tokens > 3 * CHUNK,
        "the long prompt must take several chunks: {long_tokens} tokens"
    );

    let trace = Arc::new(StepTrace::default());
    let srv = start(cfg(3, Some(trace.clone()))).await;
    let a = srv.addr;
    // Jobs 1 and 2 start decoding; job 3, the long prompt, arrives while they do.
    let mut first = Sse::open(a, "/v1/completions", &reqs[0]).await;
    let mut second = Sse::open(a, "/v1/completions", &reqs[1]).await;
    let head0 = first.next().await.expect("a first chunk");
    let head1 = second.next().await.expect("a first chunk");
    wait_stats(a, |s| s["running"] == 2).await;
    let third = Sse::open(a, "/v1/completions", &reqs[2]).await;
    let mut evs0 = vec![head0];
    evs0.extend(first.all().await);
    let mut evs1 = vec![head1];
    evs1.extend(second.all().await);
    let got = [collect(&evs0), collect(&evs1), collect(&third.all().await)];
    srv.shutdown().await.unwrap();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i} differs from the same request alone");
    }

    let events = trace.events();
    // The long prompt went in pieces of at most one chunk, all of it.
    let pieces: Vec<usize> = events
        .iter()
        .filter_map(|e| match e {
            StepEvent::Prefill { job: 3, tokens } => Some(*tokens),
            _ => None,
        })
        .collect();
    assert_eq!(pieces.iter().sum::<usize>(), long_tokens, "{pieces:?}");
    assert!(pieces.iter().all(|&n| n <= CHUNK), "{pieces:?}");
    // The runners decoded while it was evaluated: between its first and last piece.
    let at = |want: &dyn Fn(&StepEvent) -> bool| events.iter().position(want);
    let is_piece = |e: &StepEvent| matches!(e, StepEvent::Prefill { job: 3, .. });
    let first_piece = at(&is_piece).unwrap();
    let last_piece = events.iter().rposition(is_piece).unwrap();
    let runner_steps = events[first_piece..last_piece]
        .iter()
        .filter(
            |e| matches!(e, StepEvent::Decode { jobs } if jobs.contains(&1) && jobs.contains(&2)),
        )
        .count();
    assert!(
        runner_steps >= pieces.len() - 1,
        "the runners must decode between the long prompt's pieces: {events:?}"
    );
    // And neither waited for more than one chunk of it between two of its tokens.
    for job in [1, 2] {
        let gap = largest_prefill_between_tokens(&events, job).expect("two tokens or more");
        assert!(
            gap <= CHUNK,
            "job {job} waited for {gap} prompt tokens between two of its tokens"
        );
    }
}
