//! Resource limits against hostile or broken clients: the accept loop (connection cap,
//! request-head timeout, shutdown grace period), the sizing of the connection cap and of the
//! request-preparation limit, and giving freed heap back to the system.
//!
//! axum's own `serve` has no head timeout and no connection cap, and its graceful shutdown
//! waits for every connection forever, so one half-sent request kept SIGTERM from
//! completing. We drive hyper directly instead: each connection gets a head timeout (which
//! also closes idle keep-alive connections), and past the cap a connection is answered 503
//! at once and closed, so descriptors never run out. A few connections past the cap
//! ([`HEALTH_RESERVE`]) may still ask `/health`, so monitoring sees the server while other
//! clients hold every connection.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::config::ServerConfig;
use crate::stats::Stats;

/// The connection cap: `configured`, or half the descriptors the process may open (minus a
/// reserve for the model, the disk cache and the runtime), between 16 and 4096.
pub fn max_connections(configured: usize) -> usize {
    if configured > 0 {
        return configured;
    }
    let soft = nofile_soft_limit().unwrap_or(1024);
    (soft.saturating_sub(64) / 2).clamp(16, 4096) as usize
}

fn nofile_soft_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit only writes the struct we pass, which lives for the call.
        let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) };
        // rlim_t is not u64 on every unix.
        #[allow(clippy::unnecessary_cast)]
        let cur = r.rlim_cur as u64;
        (rc == 0).then_some(cur)
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// Bytes one request may need while it is parsed, rendered and tokenized, as a multiple of
/// its body: the body, its parsed form, the rendered prompt and the token ids together stay
/// well under this for every endpoint (measured in SECURITY.md).
const PREPARE_BYTES_PER_BODY_BYTE: u64 = 16;

/// How many requests are prepared at once: `configured`, or as many as both the cores and
/// the available memory (at the per-request bound) allow, at least one.
pub fn prepare_concurrency(configured: usize, max_body_bytes: usize) -> usize {
    if configured > 0 {
        return configured;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let per = (max_body_bytes as u64)
        .saturating_mul(PREPARE_BYTES_PER_BODY_BYTE)
        .max(64 << 20);
    let mem = mem_available().unwrap_or(u64::MAX);
    (mem / per).clamp(1, cores) as usize
}

fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Returns free heap pages to the system. glibc keeps what a large request freed in its
/// per-thread arenas, so without this an idle server kept gigabytes after a burst of big
/// bodies (issue 24); trimming after each large request brings RSS back near its base.
pub fn release_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only walks the allocator's own free lists; it is thread-safe
        // and has no preconditions.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

/// Milliseconds since the first call (a process-wide monotonic clock for atomics).
pub fn now_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

/// Bodies at least this large trigger [`release_memory`] once their request is prepared.
pub const TRIM_AFTER_BYTES: usize = 1 << 20;

/// Connections past the cap that are still served, for one `GET /health` each (no
/// keep-alive; any other request gets the 503 of a refused connection).
pub const HEALTH_RESERVE: usize = 4;

const REFUSED_BODY: &str = "{\"error\":{\"message\":\"too many open connections\",\"type\":\"server_error\",\"code\":\"too_many_connections\"}}";

const REFUSED: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\nRetry-After: 1\r\nContent-Length: 101\r\n\r\n{\"error\":{\"message\":\"too many open connections\",\"type\":\"server_error\",\"code\":\"too_many_connections\"}}";

/// Answers a connection past the cap with 503 and closes it (bounded in time, so a client
/// that does not read cannot pin the task).
async fn refuse(mut s: TcpStream) {
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        s.write_all(REFUSED).await?;
        s.shutdown().await
    })
    .await;
}

/// What a connection served from [`HEALTH_RESERVE`] may ask: `GET /health`, nothing else.
async fn only_health(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::http::{header, HeaderValue, Method, StatusCode};
    use axum::response::IntoResponse;
    if req.method() == Method::GET && req.uri().path() == "/health" {
        return next.run(req).await;
    }
    let mut r = (StatusCode::SERVICE_UNAVAILABLE, REFUSED_BODY).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    h.insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// Decrements the open-connection counter however the connection task ends (including
/// being aborted at the end of the grace period).
struct ConnGuard(Arc<Stats>);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        Stats::sub(&self.0.connections, 1);
    }
}

/// Accepts connections until `signal` resolves, then lets open ones finish for at most
/// [`ServerConfig::shutdown_grace`] and drops the rest.
pub async fn serve_connections(
    listener: TcpListener,
    router: axum::Router,
    cfg: &ServerConfig,
    max_connections: usize,
    stats: Arc<Stats>,
    signal: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let graceful = GracefulShutdown::new();
    let permits = Arc::new(Semaphore::new(max_connections));
    let reserve = Arc::new(Semaphore::new(HEALTH_RESERVE));
    let health_only = router.clone().layer(axum::middleware::from_fn(only_health));
    let mut tasks = JoinSet::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(cfg.header_timeout);
    let mut reserved_builder = builder.clone();
    reserved_builder.keep_alive(false);
    tokio::pin!(signal);
    loop {
        tokio::select! {
            _ = &mut signal => break,
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((s, _)) => s,
                    Err(e) => {
                        // Out of descriptors or a reset before accept: keep serving.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                let (permit, reserved) = match permits.clone().try_acquire_owned() {
                    Ok(p) => (p, false),
                    Err(_) => {
                        Stats::add(&stats.rejected_connections, 1);
                        match reserve.clone().try_acquire_owned() {
                            Ok(p) => (p, true),
                            Err(_) => {
                                tasks.spawn(refuse(stream));
                                continue;
                            }
                        }
                    }
                };
                let _ = stream.set_nodelay(true);
                if cfg.send_buffer_bytes > 0 {
                    let _ = socket2::SockRef::from(&stream).set_send_buffer_size(cfg.send_buffer_bytes);
                }
                let (svc, b) = if reserved {
                    (TowerToHyperService::new(health_only.clone()), &reserved_builder)
                } else {
                    (TowerToHyperService::new(router.clone()), &builder)
                };
                let conn = graceful.watch(b.serve_connection(TokioIo::new(stream), svc));
                Stats::add(&stats.connections, 1);
                let guard = ConnGuard(stats.clone());
                tasks.spawn(async move {
                    let _ = conn.await;
                    drop(permit);
                    drop(guard);
                });
            }
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(cfg.shutdown_grace) => {
            tracing::warn!(
                open = Stats::get(&stats.connections),
                "shutdown grace period over; dropping the connections still open"
            );
        }
    }
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_is_well_formed() {
        let text = std::str::from_utf8(REFUSED).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("Content-Length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(len, body.len());
        assert_eq!(body, REFUSED_BODY);
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "too_many_connections");
    }

    #[test]
    fn sizing_is_bounded() {
        assert_eq!(max_connections(7), 7);
        let auto = max_connections(0);
        assert!((16..=4096).contains(&auto));
        assert_eq!(prepare_concurrency(3, 1 << 20), 3);
        let auto = prepare_concurrency(0, 64 << 20);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert!(auto >= 1 && auto <= cores);
    }
}
