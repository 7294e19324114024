mod common;
use common::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smoke() {
    let t = std::time::Instant::now();
    let srv = start(ds4_server::ServerConfig::default()).await;
    eprintln!("start {:?}", t.elapsed());
    let t = std::time::Instant::now();
    let r = post(srv.addr, "/v1/chat/completions", &json!({"messages":[{"role":"user","content":"Hello there, how are you?"}],"max_tokens":32,"think":false})).await;
    eprintln!("chat {:?} {} {}", t.elapsed(), r.status, r.body);
    srv.shutdown().await.unwrap();
}
