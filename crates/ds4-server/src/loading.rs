//! The port while the model loads. `ds4-server` binds its listener before loading (which
//! takes minutes on a large model), so the port is taken at once and clients and health
//! checks get an answer instead of "connection refused": `GET /health` answers 503
//! `{"status":"loading"}`, every other request 503 with an error body in its protocol's
//! shape and `Retry-After`. Each of these connections serves one request (no keep-alive),
//! so a client reconnects to the real server once the model is ready. [`Loading::finish`]
//! stops the answering and hands the listener to [`crate::Server::from_listener`].

use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Semaphore};

use crate::error::{ApiError, ErrorKind, Shape};

/// Connections answered at once while loading; more are closed unanswered.
const LOADING_CONNECTIONS: usize = 64;

/// Seconds in the `Retry-After` of a loading answer.
const RETRY_AFTER_SECS: &str = "5";

/// The answer to every request while the model loads.
async fn loading_answer(req: Request) -> Response {
    let path = req.uri().path();
    let mut r = if path == "/health" {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::CONTENT_TYPE, "application/json")],
            "{\"status\":\"loading\"}\n",
        )
            .into_response()
    } else {
        let shape = if path.starts_with("/v1/messages") {
            Shape::Anthropic
        } else {
            Shape::OpenAi
        };
        ApiError::new(
            ErrorKind::ShuttingDown,
            "the model is still loading; retry shortly",
        )
        .into_response(shape)
    };
    let h = r.headers_mut();
    h.insert(
        header::RETRY_AFTER,
        HeaderValue::from_static(RETRY_AFTER_SECS),
    );
    h.insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// The router of the loading state: every path, every method, the loading answer.
pub fn loading_router() -> Router {
    Router::new().fallback(loading_answer)
}

/// The listener answering while the model loads.
pub struct Loading {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<TcpListener>,
}

impl Loading {
    /// Starts answering on `listener` (on the current tokio runtime). `header_timeout`
    /// bounds how long a connection may take to send its request.
    pub fn start(listener: TcpListener, header_timeout: Duration) -> Loading {
        let (stop, mut stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let router = loading_router();
            let permits = Arc::new(Semaphore::new(LOADING_CONNECTIONS));
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .keep_alive(false);
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    accepted = listener.accept() => {
                        let Ok((stream, _)) = accepted else {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            continue;
                        };
                        let Ok(permit) = permits.clone().try_acquire_owned() else {
                            continue;
                        };
                        let svc = TowerToHyperService::new(router.clone());
                        let conn = builder.serve_connection(TokioIo::new(stream), svc);
                        tokio::spawn(async move {
                            // Bounded even for a client that never reads its answer.
                            let _ = tokio::time::timeout(header_timeout * 2, conn).await;
                            drop(permit);
                        });
                    }
                }
            }
            listener
        });
        Loading { stop, task }
    }

    /// Stops answering and returns the listener (connections not yet accepted wait in its
    /// backlog for the real server).
    pub async fn finish(self) -> std::io::Result<TcpListener> {
        let _ = self.stop.send(());
        self.task.await.map_err(std::io::Error::other)
    }
}
