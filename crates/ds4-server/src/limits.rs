//! Resource limits against hostile or broken clients: the accept loop (connection cap,
//! request-head timeout, shutdown grace period), the sizing of the connection cap and of the
//! request-preparation limit, and giving freed heap back to the system.
//!
//! axum's own `serve` has no head timeout and no connection cap, and its graceful shutdown
//! waits for every connection forever, so one half-sent request kept SIGTERM from
//! completing. We drive hyper directly instead: each connection gets a head timeout (which
//! also closes idle keep-alive connections), and past the cap a connection is answered 503
//! at once and closed, so descriptors never run out and `/health` stays reachable.

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

/// The default body budget ([`ServerConfig::body_budget_bytes`] = 0), in bodies of the
/// largest accepted size.
pub const BODY_BUDGET_BODIES: usize = 4;

/// The body budget is counted in units of this many bytes (a semaphore takes at most
/// `u32::MAX` permits at once).
const BODY_UNIT: usize = 1024;

/// A process-wide budget of buffered request-body bytes. Each body takes its share before it
/// is read — its `Content-Length`, or, for a chunked body, each piece as it arrives — and
/// gives it back when the buffered body is dropped, so the bodies held at once stay under
/// the budget whatever the number of connections.
pub struct BodyBudget {
    sem: Arc<Semaphore>,
    bytes: usize,
    wait: Duration,
}

impl BodyBudget {
    /// `configured` bytes (0: [`BODY_BUDGET_BODIES`] × `max_body`), at least one body of the
    /// largest size; a share not granted within `wait` is refused.
    pub fn new(configured: usize, max_body: usize, wait: Duration) -> BodyBudget {
        let bytes = if configured > 0 {
            configured
        } else {
            max_body.saturating_mul(BODY_BUDGET_BODIES)
        }
        .max(max_body)
        .max(BODY_UNIT);
        let units = (bytes / BODY_UNIT).min(Semaphore::MAX_PERMITS);
        BodyBudget {
            sem: Arc::new(Semaphore::new(units)),
            bytes: units * BODY_UNIT,
            wait,
        }
    }

    /// The budget in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Grows `held` (a body's share so far, `None` at first) to cover `total` bytes, waiting
    /// at most the configured time. `false`: the budget stayed taken (the body is refused).
    pub async fn cover(&self, held: &mut Option<BodyShare>, total: usize) -> bool {
        let have = held.as_ref().map_or(0, |h| h.units);
        let need = total.div_ceil(BODY_UNIT);
        if need <= have {
            return true;
        }
        let Ok(more) = u32::try_from(need - have) else {
            return false;
        };
        let got = tokio::time::timeout(self.wait, self.sem.clone().acquire_many_owned(more)).await;
        match got {
            Ok(Ok(p)) => {
                match held {
                    Some(h) => {
                        h.permit.merge(p);
                        h.units = need;
                    }
                    None => {
                        *held = Some(BodyShare {
                            permit: p,
                            units: need,
                        })
                    }
                }
                true
            }
            _ => false,
        }
    }

    /// Bytes of the budget not taken now.
    pub fn available(&self) -> usize {
        self.sem.available_permits() * BODY_UNIT
    }
}

/// A body's share of the [`BodyBudget`]; given back when dropped.
pub struct BodyShare {
    permit: tokio::sync::OwnedSemaphorePermit,
    units: usize,
}

/// A buffered request body that holds its share of the body budget until the last
/// reference to its bytes is dropped (`Bytes::from_owner`).
pub struct BudgetedBody {
    pub data: Vec<u8>,
    pub share: Option<BodyShare>,
}

impl AsRef<[u8]> for BudgetedBody {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

/// Bodies at least this large trigger [`release_memory`] once their request is prepared.
pub const TRIM_AFTER_BYTES: usize = 1 << 20;

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
    let mut tasks = JoinSet::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(cfg.header_timeout);
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
                let Ok(permit) = permits.clone().try_acquire_owned() else {
                    Stats::add(&stats.rejected_connections, 1);
                    tasks.spawn(refuse(stream));
                    continue;
                };
                let _ = stream.set_nodelay(true);
                if cfg.send_buffer_bytes > 0 {
                    let _ = socket2::SockRef::from(&stream).set_send_buffer_size(cfg.send_buffer_bytes);
                }
                let svc = TowerToHyperService::new(router.clone());
                let conn = graceful.watch(builder.serve_connection(TokioIo::new(stream), svc));
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
