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

/// A streaming client is cancelled when more than this many bytes of its stream are unread
/// and it takes nothing for longer than the stall timeout ([`StreamWatch`];
/// [`ServerConfig::unread_cap_bytes`], whose default this is). A client that keeps up has
/// about one round trip of output unread (at 30 KB/s of stream, 128 KiB is four seconds of
/// it).
pub const UNREAD_CAP_BYTES: u64 = 128 << 10;

/// Events waiting for one streaming connection may hold at most this many bytes (estimated
/// by [`crate::worker::event_bytes`]); past it the client is treated as gone at once.
pub const STREAM_BUFFER_CAP_BYTES: u64 = 1 << 20;

/// How often a stream's peer receive queue is looked up (`/proc/net/tcp` is read whole).
const PEER_CHECK_MS: u64 = 500;

/// The connection a request came in on, as request extension: its socket descriptor and
/// addresses, for [`StreamWatch`]. The descriptor is valid while the request's handler
/// runs (the connection owns it).
#[derive(Clone, Copy, Debug)]
pub struct ConnSocket {
    #[cfg(unix)]
    pub fd: std::os::fd::RawFd,
    pub local: Option<std::net::SocketAddr>,
    pub peer: Option<std::net::SocketAddr>,
}

/// What a streaming job knows of its client's progress. "Unread" is, as far as this host
/// can see: the events waiting for the connection, our socket's kernel send queue (Linux
/// `TIOCOUTQ`: bytes not yet sent, or sent and not acknowledged) and — when the client is
/// on this host (loopback) — the client socket's receive queue, the bytes its kernel
/// acknowledged and its program has not read (`/proc/net/tcp`). "Progress" is the bytes
/// the client has taken: acknowledged (`TCP_INFO`'s `tcpi_bytes_acked`) minus, on
/// loopback, what still sits in its receive queue. A client is stalled when more than the
/// cap stays unread and it takes nothing for the stall timeout; one that reads slower than
/// the stream still makes progress and is left alone.
///
/// The receive queue matters: a Linux receiver that does not read keeps acknowledging a
/// slow stream while its kernel grows the receive buffer (measured on 6.18: 982 KB taken
/// in 69 s at 14 KB/s, our send queue near 0, the advertised window a constant 64 KiB), so
/// acknowledgements alone show nothing until that buffer reaches `net.ipv4.tcp_rmem`'s
/// maximum. For a remote client that part cannot be seen, and nothing TCP carries tells a
/// program that stopped reading from one that reads (SECURITY.md, "Known limits").
#[derive(Debug)]
pub struct StreamWatch {
    #[cfg(target_os = "linux")]
    socket: Option<std::os::fd::OwnedFd>,
    /// `/proc/net/tcp` address pair of the client's socket (its local, then its remote
    /// address), when the client is on this host.
    #[cfg(target_os = "linux")]
    peer_key: Option<(&'static str, String)>,
    peer_checked_ms: std::sync::atomic::AtomicU64,
    peer_unread: std::sync::atomic::AtomicU64,
    /// On loopback: bytes the client's program has read, sampled with `peer_unread`.
    peer_consumed: std::sync::atomic::AtomicU64,
    /// Estimated bytes of events sent to the handler and not yet taken by it.
    pub queued: std::sync::atomic::AtomicU64,
    /// The most the client had taken at the last check, and when that last grew.
    consumed: std::sync::atomic::AtomicU64,
    progress_ms: std::sync::atomic::AtomicU64,
}

/// `/proc/net/tcp*` spelling of an address: the IP as 32-bit words in host byte order,
/// in hex, then the port.
#[cfg(target_os = "linux")]
fn proc_net_addr(a: std::net::SocketAddr) -> (&'static str, String) {
    use std::fmt::Write;
    let mut s = String::new();
    let file = match a.ip() {
        std::net::IpAddr::V4(ip) => {
            let _ = write!(s, "{:08X}", u32::from_ne_bytes(ip.octets()));
            "/proc/net/tcp"
        }
        std::net::IpAddr::V6(ip) => {
            for w in ip.octets().chunks_exact(4) {
                let _ = write!(s, "{:08X}", u32::from_ne_bytes([w[0], w[1], w[2], w[3]]));
            }
            "/proc/net/tcp6"
        }
    };
    let _ = write!(s, ":{:04X}", a.port());
    (file, s)
}

/// The receive queue of the socket whose `local rem` addresses are `key`, from a
/// `/proc/net/tcp` table.
#[cfg(target_os = "linux")]
fn proc_net_rx_queue(table: &str, key: &str) -> Option<u64> {
    table.lines().find_map(|l| {
        let mut f = l.split_whitespace().skip(1);
        let (local, rem, _state, queues) = (f.next()?, f.next()?, f.next()?, f.next()?);
        if local.len() + 1 + rem.len() != key.len()
            || !key.starts_with(local)
            || !key.ends_with(rem)
        {
            return None;
        }
        let (_tx, rx) = queues.split_once(':')?;
        u64::from_str_radix(rx, 16).ok()
    })
}

impl StreamWatch {
    /// A watch on `conn` (the handler's connection, open while it runs).
    pub fn new(conn: Option<ConnSocket>) -> StreamWatch {
        #[cfg(target_os = "linux")]
        let (socket, peer_key) = match conn {
            Some(c) => {
                // SAFETY: the descriptor belongs to the connection whose handler is
                // running now, so it is open for the duration of this borrow; we only
                // duplicate it.
                let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(c.fd) };
                let peer_key = match (c.peer, c.local) {
                    (Some(p), Some(l)) if p.ip().is_loopback() => {
                        let (file, pk) = proc_net_addr(p);
                        let (_, lk) = proc_net_addr(l);
                        Some((file, format!("{pk} {lk}")))
                    }
                    _ => None,
                };
                (fd.try_clone_to_owned().ok(), peer_key)
            }
            None => (None, None),
        };
        #[cfg(not(target_os = "linux"))]
        let _ = conn;
        StreamWatch {
            #[cfg(target_os = "linux")]
            socket,
            #[cfg(target_os = "linux")]
            peer_key,
            peer_checked_ms: std::sync::atomic::AtomicU64::new(0),
            peer_unread: std::sync::atomic::AtomicU64::new(0),
            peer_consumed: std::sync::atomic::AtomicU64::new(0),
            queued: std::sync::atomic::AtomicU64::new(0),
            consumed: std::sync::atomic::AtomicU64::new(0),
            progress_ms: std::sync::atomic::AtomicU64::new(now_ms()),
        }
    }

    /// Bytes in the socket's kernel send queue (unsent plus unacknowledged); `None` where
    /// that cannot be read (no socket, not Linux).
    pub fn unsent(&self) -> Option<u64> {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            let fd = self.socket.as_ref()?.as_raw_fd();
            let mut n: libc::c_int = 0;
            // SAFETY: TIOCOUTQ (SIOCOUTQ on a socket) writes one int through the pointer,
            // which points at `n`, alive for the call; `fd` is our own open duplicate.
            let rc = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut n) };
            (rc == 0 && n >= 0).then_some(n as u64)
        }
        #[cfg(not(target_os = "linux"))]
        {
            None
        }
    }

    /// Bytes of the connection the client's kernel has acknowledged (`TCP_INFO`); `None`
    /// where that cannot be read.
    fn acked(&self) -> Option<u64> {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            let fd = self.socket.as_ref()?.as_raw_fd();
            // SAFETY: tcp_info is plain integers, for which all-zero bytes are valid.
            let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
            // SAFETY: getsockopt writes at most `len` bytes into `info`, which is that
            // large and alive for the call, and stores the length written in `len`; `fd`
            // is our own open duplicate.
            let rc = unsafe {
                libc::getsockopt(
                    fd,
                    libc::IPPROTO_TCP,
                    libc::TCP_INFO,
                    (&mut info as *mut libc::tcp_info).cast(),
                    &mut len,
                )
            };
            let need = std::mem::offset_of!(libc::tcp_info, tcpi_bytes_acked) + 8;
            (rc == 0 && len as usize >= need).then_some(info.tcpi_bytes_acked)
        }
        #[cfg(not(target_os = "linux"))]
        {
            None
        }
    }

    /// Looks up the client's unread receive queue when it is on this host, at most every
    /// [`PEER_CHECK_MS`]. Called by the connection's side as it takes events (not by the
    /// scheduler thread: the table is read whole, and grows with the open connections).
    pub fn refresh_peer(&self) {
        #[cfg(target_os = "linux")]
        if let Some((file, key)) = &self.peer_key {
            use std::sync::atomic::Ordering::Relaxed;
            let now = now_ms();
            if now.saturating_sub(self.peer_checked_ms.load(Relaxed)) >= PEER_CHECK_MS {
                self.peer_checked_ms.store(now, Relaxed);
                let acked = self.acked().unwrap_or(0);
                let n = std::fs::read_to_string(file)
                    .ok()
                    .and_then(|t| proc_net_rx_queue(&t, key))
                    .unwrap_or(0);
                self.peer_unread.store(n, Relaxed);
                self.peer_consumed.store(acked.saturating_sub(n), Relaxed);
            }
        }
    }

    /// The handler took an event of `bytes` (estimated) off the queue.
    pub fn taken(&self, bytes: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let _ = self
            .queued
            .fetch_update(Relaxed, Relaxed, |q| Some(q.saturating_sub(bytes)));
    }

    /// Checks the client now: `Some((ms, unread))` when more than `cap` bytes are unread
    /// and the client has taken nothing for `ms`; `None` while it is under the cap (or
    /// nothing can be read: no socket, not Linux).
    pub fn stalled(&self, cap: u64) -> Option<(u64, u64)> {
        use std::sync::atomic::Ordering::Relaxed;
        let unsent = self.unsent()?;
        let now = now_ms();
        #[cfg(target_os = "linux")]
        let local = self.peer_key.is_some();
        #[cfg(not(target_os = "linux"))]
        let local = false;
        let consumed = if local {
            self.peer_consumed.load(Relaxed)
        } else {
            self.acked().unwrap_or(0)
        };
        if consumed > self.consumed.fetch_max(consumed, Relaxed) {
            self.progress_ms.store(now, Relaxed);
        }
        let unread = unsent + self.queued.load(Relaxed) + self.peer_unread.load(Relaxed);
        if unread <= cap {
            self.progress_ms.store(now, Relaxed);
            return None;
        }
        Some((now.saturating_sub(self.progress_ms.load(Relaxed)), unread))
    }
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
                let conn = ConnSocket {
                    #[cfg(unix)]
                    fd: std::os::fd::AsRawFd::as_raw_fd(&stream),
                    local: stream.local_addr().ok(),
                    peer: stream.peer_addr().ok(),
                };
                let (svc, b) = if reserved {
                    (
                        TowerToHyperService::new(health_only.clone().layer(axum::Extension(conn))),
                        &reserved_builder,
                    )
                } else {
                    (
                        TowerToHyperService::new(router.clone().layer(axum::Extension(conn))),
                        &builder,
                    )
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

    #[cfg(target_os = "linux")]
    #[test]
    fn proc_net_tcp_lookup() {
        let peer: std::net::SocketAddr = "127.0.0.1:40000".parse().unwrap();
        let local: std::net::SocketAddr = "127.0.0.1:8000".parse().unwrap();
        let (file, pk) = proc_net_addr(peer);
        let (_, lk) = proc_net_addr(local);
        assert_eq!(file, "/proc/net/tcp");
        assert_eq!(
            pk,
            format!("{:08X}:9C40", u32::from_ne_bytes([127, 0, 0, 1]))
        );
        let table = format!(
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: {lk} {pk} 01 00000010:00000000 00:00000000 00000000     0        0 1\n   1: {pk} {lk} 01 00000000:0001E240 00:00000000 00000000     0        0 2\n"
        );
        assert_eq!(
            proc_net_rx_queue(&table, &format!("{pk} {lk}")),
            Some(123456)
        );
        assert_eq!(proc_net_rx_queue(&table, &format!("{pk} {pk}")), None);
        let (file6, k6) = proc_net_addr("[::1]:80".parse().unwrap());
        assert_eq!(file6, "/proc/net/tcp6");
        assert_eq!(k6.len(), 32 + 5);
        // A live loopback pair: what the receiver has not read shows in its queue.
        use std::io::Write;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        s.write_all(&[7u8; 5000]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(100));
        let (file, ck) = proc_net_addr(c.local_addr().unwrap());
        let (_, sk) = proc_net_addr(s.local_addr().unwrap());
        let table = std::fs::read_to_string(file).unwrap();
        assert_eq!(proc_net_rx_queue(&table, &format!("{ck} {sk}")), Some(5000));
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
