//! The chat page (issue 55; `webchat.rs`): served at `/` and `/chat` with its
//! Content-Security-Policy, without the API key (the page asks for it), under the same
//! `Host` guard as the API; unknown assets are 404; `--no-webchat` turns it off.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use ds4_server::ServerConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A GET with a chosen `Host` header: (status, raw response).
async fn get_with_host(a: SocketAddr, path: &str, host: &str) -> (u16, String) {
    let mut s = TcpStream::connect(a).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut raw))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.split(' ').nth(1).unwrap().parse().unwrap();
    (status, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_is_served_with_its_csp_without_the_key_and_behind_the_host_guard() {
    let srv = start(ServerConfig {
        api_key: Some("sekrit".into()),
        ..ServerConfig::default()
    })
    .await;
    let a = srv.addr;
    for path in ["/", "/chat"] {
        let r = get(a, path).await;
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        assert!(r.header("content-type").unwrap().starts_with("text/html"));
        let csp = r.header("content-security-policy").expect("CSP header");
        assert_eq!(csp, ds4_server::webchat::CSP);
        assert!(csp.contains("script-src 'self'") && !csp.contains("unsafe-inline"));
        assert!(csp.contains("default-src 'none'"));
        assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
        assert!(r.body.contains("<div id=\"app\">"), "{}", r.body);
        assert!(!r.body.contains("sekrit"));
    }
    // The page's script and style sheet are served, without the key, with their types.
    let page = get(a, "/").await.body;
    let assets: Vec<&str> = page
        .split("\"/assets/")
        .skip(1)
        .map(|p| p.split('"').next().unwrap())
        .collect();
    assert!(assets.iter().any(|n| n.ends_with(".js")), "{page}");
    assert!(assets.iter().any(|n| n.ends_with(".css")), "{page}");
    for n in &assets {
        let r = get(a, &format!("/assets/{n}")).await;
        assert_eq!(r.status, 200, "{n}");
        let t = r.header("content-type").unwrap();
        assert!(
            (n.ends_with(".js") && t.starts_with("text/javascript"))
                || (n.ends_with(".css") && t.starts_with("text/css")),
            "{n}: {t}"
        );
        assert!(!r.body.is_empty());
    }
    // Unknown assets and paths are 404; the API still wants the key.
    for path in [
        "/assets/nope.js",
        "/assets/",
        "/assets/../Cargo.toml",
        "/chat/x",
    ] {
        let r = get(a, path).await;
        assert!(r.status == 404 || r.status == 401, "{path}: {}", r.status);
    }
    assert_eq!(get(a, "/assets/nope.js").await.status, 404);
    assert_eq!(get(a, "/v1/models").await.status, 401);
    let r = post(a, "/", &serde_json::json!({})).await;
    assert_eq!(r.status, 401, "a POST to / is not public: {}", r.body);
    // A rebinding page's Host is refused on the page and its assets too.
    for path in ["/", "/chat", &format!("/assets/{}", assets[0])] {
        let (status, raw) = get_with_host(a, path, "evil.example:8000").await;
        assert_eq!(status, 403, "{path}: {raw}");
        assert!(!raw.contains("id=\"app\""));
        let (status, _) = get_with_host(a, path, "localhost:8000").await;
        assert_eq!(status, 200, "{path}");
    }
    srv.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_webchat_leaves_the_api_only() {
    let srv = start(ServerConfig {
        webchat: false,
        ..ServerConfig::default()
    })
    .await;
    let a = srv.addr;
    for path in ["/", "/chat", "/assets/x.js"] {
        let r = get(a, path).await;
        assert_eq!(r.status, 404, "{path}: {}", r.body);
        assert!(r.header("content-security-policy").is_none());
    }
    assert_eq!(get(a, "/v1/models").await.status, 200);
    srv.shutdown().await.unwrap();
}
