//! The axum application: routes, limits, auth, CORS, panic containment, and the glue from a
//! parsed request to a queued job and back to a JSON body or an SSE stream.
//!
//! Handlers parse, render and tokenize (on the blocking pool), check the context, then
//! `try_send` the job to the worker's bounded queue — a full queue is answered at once with
//! 429 + `Retry-After` instead of waiting. The handler then waits for the worker's first
//! event, so errors found before evaluation still get a proper status code; SSE headers go
//! out only once the worker has started the job.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use ds4_chat::tokenizer::SpecialTokens;
use ds4_chat::Tokenizer;
use serde_json::Value;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::sync::mpsc;
use tower_http::catch_panic::CatchPanicLayer;

use crate::api::{Endpoint, GenRequest};
use crate::config::{ServerConfig, MODEL_ID};
use crate::emit::{self, Ctx, Frame};
use crate::endpoints::{self, EventStream};
use crate::error::{ApiError, ErrorKind, Shape};
use crate::json_out::{arr, Obj};
use crate::limits;
use crate::live::ToolBinding;
use crate::prepare::Prepared;
use crate::request;
use crate::stats::Stats;
use crate::toolmem::ToolMemory;
use crate::worker::{sampler_config, Job, JobEvent, Outcome};

/// Shared by every handler.
pub struct AppState {
    pub cfg: Arc<ServerConfig>,
    pub tok: Arc<Tokenizer>,
    pub toolmem: Arc<Mutex<ToolMemory>>,
    /// The worker's latest [`ToolBinding`] (tool-output continuations are planned on it).
    pub binding: Arc<Mutex<Option<ToolBinding>>>,
    pub jobs: mpsc::Sender<Job>,
    pub stats: Arc<Stats>,
    pub shutting_down: Arc<AtomicBool>,
    pub ctx: usize,
    pub model_name: String,
    /// Whether the engine has the MTP block loaded: a request for `"draft": "mtp"` on a
    /// server without it is refused before its prompt is rendered or evaluated.
    pub has_mtp: bool,
    /// Bound to loopback: only loopback `Host` names (and `--allowed-host` ones) are served
    /// on every route, key or not (DNS rebinding would otherwise let any web page drive the
    /// server, or read `/health`).
    pub loopback_guard: bool,
    /// Longest token in bytes: turns a prompt's byte count into a lower bound on its tokens.
    pub max_token_bytes: usize,
    /// Permits to parse, render and tokenize a request (memory is bounded by permits ×
    /// the per-request bound, whatever the number of connections).
    pub prepare: Arc<tokio::sync::Semaphore>,
    /// Request-body bytes buffered at once, across all connections.
    pub body_budget: limits::BodyBudget,
    counter: AtomicU64,
}

impl AppState {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: Arc<ServerConfig>,
        tok: Arc<Tokenizer>,
        toolmem: Arc<Mutex<ToolMemory>>,
        binding: Arc<Mutex<Option<ToolBinding>>>,
        jobs: mpsc::Sender<Job>,
        stats: Arc<Stats>,
        shutting_down: Arc<AtomicBool>,
        ctx: usize,
        model_name: String,
        has_mtp: bool,
        loopback_guard: bool,
        prepare_concurrency: usize,
    ) -> AppState {
        let max_token_bytes = tok.max_token_bytes().max(1);
        let body_budget = limits::BodyBudget::new(
            cfg.body_budget_bytes,
            cfg.max_body_bytes,
            cfg.body_budget_wait,
        );
        AppState {
            body_budget,
            cfg,
            tok,
            toolmem,
            binding,
            jobs,
            stats,
            shutting_down,
            ctx,
            model_name,
            has_mtp,
            loopback_guard,
            max_token_bytes,
            prepare: Arc::new(tokio::sync::Semaphore::new(prepare_concurrency.max(1))),
            counter: AtomicU64::new(0),
        }
    }
}

type St = State<Arc<AppState>>;

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The router with every route and layer.
pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.cfg.max_body_bytes;
    let mut r = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model));
    for f in endpoints::ALL {
        let ep = f.endpoint();
        r = r.route(
            f.path(),
            post(
                move |State(st): St,
                      conn: Option<axum::Extension<limits::ConnSocket>>,
                      body: Result<Bytes, BytesRejection>| {
                    generation(st, ep, conn.map(|c| c.0), body)
                },
            ),
        );
    }
    if state.cfg.webchat {
        r = crate::webchat::routes(r);
    }
    r.route("/health", get(health))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(unknown_endpoint)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(state.clone(), read_body))
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            cors_and_options,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), guard))
        .layer(CatchPanicLayer::custom(PanicResponse(state.stats.clone())))
        .with_state(state)
}

/// A handler panic becomes a 500 (counted on `/health`); the connection and the server
/// carry on.
#[derive(Clone)]
struct PanicResponse(Arc<Stats>);

impl tower_http::catch_panic::ResponseForPanic for PanicResponse {
    type ResponseBody = axum::body::Body;

    fn response_for_panic(
        &mut self,
        _err: Box<dyn std::any::Any + Send + 'static>,
    ) -> axum::http::Response<Self::ResponseBody> {
        Stats::add(&self.0.handler_panics, 1);
        tracing::error!("a request handler panicked; answered 500");
        ApiError::internal("internal error (handler panicked)").into_response(Shape::OpenAi)
    }
}

/// The name part of a `Host` value (`name`, `name:port`, `[v6]:port`), lower-cased.
fn host_name(host: &str) -> String {
    let h = host.trim();
    let name = if let Some(rest) = h.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        match h.rsplit_once(':') {
            Some((n, port)) if port.bytes().all(|b| b.is_ascii_digit()) => n,
            _ => h,
        }
    };
    name.to_ascii_lowercase()
}

fn is_loopback_name(name: &str) -> bool {
    name == "localhost"
        || name.ends_with(".localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn host_allowed(cfg: &ServerConfig, host: &str) -> bool {
    let name = host_name(host);
    is_loopback_name(&name)
        || cfg
            .allowed_hosts
            .iter()
            .any(|a| a.eq_ignore_ascii_case(host.trim()) || host_name(a) == name)
}

/// `--cors` lets this origin call the API from a browser.
fn cors_allows(cfg: &ServerConfig, origin: &str) -> bool {
    cfg.cors_origins
        .iter()
        .any(|o| o == "*" || o.trim_end_matches('/').eq_ignore_ascii_case(origin))
}

/// An `Origin` may POST when `--cors` names it or it is the server's own origin.
fn origin_allowed(cfg: &ServerConfig, origin: &str, host: Option<&str>) -> bool {
    if cors_allows(cfg, origin) {
        return true;
    }
    let own = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    matches!((own, host), (Some(o), Some(h)) if o.eq_ignore_ascii_case(h.trim()))
}

fn is_json_type(ct: &str) -> bool {
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// Browser-attack checks before anything else runs: the `Host` name when bound to loopback
/// (DNS rebinding), then for POSTs the `Origin` (cross-site requests) and the
/// content type (a cross-site form or `text/plain` POST needs no CORS preflight).
async fn guard(State(st): St, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let h = req.headers();
    let host = h.get(header::HOST).and_then(|v| v.to_str().ok());
    let refuse = |kind: ErrorKind, msg: String| {
        Stats::add(&st.stats.rejected_origin, 1);
        ApiError::new(kind, msg).into_response(shape_for(&path))
    };
    if st.loopback_guard {
        if let Some(v) = h.get(header::HOST) {
            let ok = v.to_str().is_ok_and(|v| host_allowed(&st.cfg, v));
            if !ok {
                let shown = String::from_utf8_lossy(v.as_bytes()).into_owned();
                return refuse(
                    ErrorKind::Forbidden,
                    format!("Host {shown:?} is not a loopback name: this server listens on loopback, so it only answers requests addressed to localhost (start it with --allowed-host NAME to accept another name)"),
                );
            }
        }
    }
    if req.method() == Method::POST {
        if let Some(o) = h.get(header::ORIGIN) {
            let origin = String::from_utf8_lossy(o.as_bytes()).into_owned();
            if !origin_allowed(&st.cfg, &origin, host) {
                return refuse(
                    ErrorKind::Forbidden,
                    format!("cross-origin request from {origin:?} refused (start the server with --cors {origin} to allow that site)"),
                );
            }
        }
        if let Some(ct) = h.get(header::CONTENT_TYPE) {
            let ct = String::from_utf8_lossy(ct.as_bytes()).into_owned();
            if !is_json_type(&ct) {
                return refuse(
                    ErrorKind::UnsupportedMediaType,
                    format!("Content-Type {ct:?} is not accepted: send the JSON body as application/json"),
                );
            }
        }
    }
    next.run(req).await
}

fn content_length(h: &HeaderMap) -> Option<u64> {
    h.get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn closing(mut r: Response) -> Response {
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// Reads a POST body under the limits before any handler sees it: a declared length over
/// the limit is refused before the body is touched (so no `100 Continue` goes out), a body
/// that pauses longer than the idle timeout or takes longer than the body timeout gets 408
/// and the connection is closed. Every body first takes its share of the process-wide body
/// budget ([`limits::BodyBudget`]: the declared length up front, a chunked body piece by
/// piece); a share not granted within `--body-budget-wait-ms` is answered 503 with
/// `Retry-After` and the connection is closed. The share goes with the buffered bytes and is
/// given back when the handler drops them.
async fn read_body(State(st): St, req: Request, next: Next) -> Response {
    use http_body_util::BodyExt;
    if req.method() != Method::POST {
        return next.run(req).await;
    }
    let shape = shape_for(req.uri().path());
    let limit = st.cfg.max_body_bytes;
    let too_large = || {
        closing(
            ApiError::new(
                ErrorKind::TooLarge,
                format!("request body exceeds the {limit}-byte limit"),
            )
            .into_response(shape),
        )
    };
    let declared = content_length(req.headers());
    if declared.is_some_and(|n| n > limit as u64) {
        return too_large();
    }
    let budget_full = || {
        Stats::add(&st.stats.rejected_body_budget, 1);
        closing(
            ApiError::body_budget_full(st.cfg.retry_after_secs, st.body_budget.bytes())
                .into_response(shape),
        )
    };
    let mut share = None;
    let declared = declared.unwrap_or(0) as usize;
    if !st.body_budget.cover(&mut share, declared).await {
        return budget_full();
    }
    let (parts, mut body) = req.into_parts();
    let mut buf = Vec::with_capacity(declared);
    let deadline = tokio::time::Instant::now() + st.cfg.body_timeout;
    loop {
        let now = tokio::time::Instant::now();
        let wait = st
            .cfg
            .body_idle_timeout
            .min(deadline.saturating_duration_since(now));
        match tokio::time::timeout(wait, body.frame()).await {
            Err(_) => {
                Stats::add(&st.stats.timed_out, 1);
                let what = if tokio::time::Instant::now() >= deadline {
                    format!(
                        "the request body took longer than {:?}",
                        st.cfg.body_timeout
                    )
                } else {
                    format!(
                        "the request body stalled for {:?}",
                        st.cfg.body_idle_timeout
                    )
                };
                return closing(ApiError::new(ErrorKind::Timeout, what).into_response(shape));
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                return closing(
                    ApiError::bad(format!("bad HTTP request body: {e}")).into_response(shape),
                )
            }
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    if buf.len() + data.len() > limit {
                        return too_large();
                    }
                    if !st
                        .body_budget
                        .cover(&mut share, buf.len() + data.len())
                        .await
                    {
                        return budget_full();
                    }
                    buf.extend_from_slice(&data);
                }
            }
        }
    }
    let body = Bytes::from_owner(limits::BudgetedBody { data: buf, share });
    next.run(Request::from_parts(parts, axum::body::Body::from(body)))
        .await
}

fn shape_for(path: &str) -> Shape {
    if path.starts_with("/v1/messages") {
        Shape::Anthropic
    } else {
        Shape::OpenAi
    }
}

async fn unknown_endpoint(req: Request) -> Response {
    ApiError::new(ErrorKind::NotFound, "unknown endpoint")
        .into_response(shape_for(req.uri().path()))
}

async fn method_not_allowed(req: Request) -> Response {
    let msg = format!(
        "method {} not allowed on {}",
        req.method(),
        req.uri().path()
    );
    ApiError::new(ErrorKind::MethodNotAllowed, msg).into_response(shape_for(req.uri().path()))
}

/// `OPTIONS` → 204; CORS headers for an origin `--cors` names (`*`: any).
async fn cors_and_options(State(st): St, req: Request, next: Next) -> Response {
    let origin = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let mut resp = if req.method() == Method::OPTIONS {
        StatusCode::NO_CONTENT.into_response()
    } else {
        next.run(req).await
    };
    let any = st.cfg.cors_origins.iter().any(|o| o == "*");
    let allow = match &origin {
        _ if any => Some(HeaderValue::from_static("*")),
        Some(o) if cors_allows(&st.cfg, o) => HeaderValue::from_str(o).ok(),
        _ => None,
    };
    if let Some(allow) = allow {
        let h = resp.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow);
        if !any {
            h.insert(header::VARY, HeaderValue::from_static("Origin"));
        }
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("*"),
        );
    }
    resp
}

/// Digests before comparing, so the comparison is constant-time in the key's length too.
fn key_matches(given: &str, key: &str) -> bool {
    let a = Sha256::digest(given.as_bytes());
    let b = Sha256::digest(key.as_bytes());
    a.ct_eq(&b).into()
}

/// The key a request presents. The `Bearer` scheme name is case-insensitive (RFC 9110
/// §11.1); an empty key counts as none.
fn presented_key(h: &HeaderMap) -> Option<&str> {
    if let Some(v) = h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        let v = v.trim();
        if let Some((scheme, k)) = v.split_once([' ', '\t']) {
            if scheme.eq_ignore_ascii_case("bearer") && !k.trim().is_empty() {
                return Some(k.trim());
            }
        }
    }
    h.get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|k| !k.is_empty())
}

/// `--api-key`: `Authorization: Bearer KEY` or `x-api-key: KEY`. `/health` is open, but
/// without the key it says only whether the server is up ([`health`]); so is the chat page
/// (it holds no secret and asks for the key itself, [`crate::webchat`]).
async fn auth(State(st): St, req: Request, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        let path = req.uri().path();
        if path != "/health"
            && req.method() != Method::OPTIONS
            && !(st.cfg.webchat && crate::webchat::is_public(req.method(), path))
        {
            let ok = presented_key(req.headers()).is_some_and(|k| key_matches(k, key));
            if !ok {
                return ApiError::new(ErrorKind::Authentication, "invalid or missing API key")
                    .into_response(shape_for(path));
            }
        }
    }
    next.run(req).await
}

fn json_response(status: StatusCode, mut body: String) -> Response {
    body.push('\n');
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn model_json(st: &AppState) -> String {
    let ctx = st.ctx as u64;
    let maxc = (st.cfg.max_tokens as u64).min(ctx);
    let params = arr([
        "tools",
        "tool_choice",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "seed",
        "stream",
        "reasoning_effort",
    ]
    .iter()
    .map(|p| emit::json_str(p)));
    Obj::new()
        .str("id", MODEL_ID)
        .str("object", "model")
        .num("created", 1_767_225_600)
        .str("owned_by", "ds4.c")
        .str("name", "DeepSeek V4 Flash")
        .num("context_length", ctx)
        .raw(
            "top_provider",
            &Obj::new()
                .num("context_length", ctx)
                .num("max_completion_tokens", maxc)
                .bool("is_moderated", false)
                .end(),
        )
        .raw("supported_parameters", &params)
        .end()
}

async fn models(State(st): St) -> Response {
    let body = Obj::new()
        .str("object", "list")
        .raw("data", &arr([model_json(&st)]))
        .end();
    json_response(StatusCode::OK, body)
}

async fn model(State(st): St, Path(id): Path<String>) -> Response {
    if id == MODEL_ID {
        json_response(StatusCode::OK, model_json(&st))
    } else {
        ApiError::new(
            ErrorKind::NotFound,
            format!("model {id} not found (this server serves {MODEL_ID})"),
        )
        .into_response(Shape::OpenAi)
    }
}

/// The status, and with the key (when one is set) the model and the counters.
async fn health(State(st): St, headers: HeaderMap) -> Response {
    let status = if st.shutting_down.load(Ordering::Relaxed) {
        "shutting_down"
    } else {
        "ok"
    };
    let keyed = st
        .cfg
        .api_key
        .as_deref()
        .is_none_or(|key| presented_key(&headers).is_some_and(|k| key_matches(k, key)));
    if !keyed {
        return json_response(StatusCode::OK, Obj::new().str("status", status).end());
    }
    let body = Obj::new()
        .str("status", status)
        .str("model", MODEL_ID)
        .str("name", &st.model_name)
        .num("ctx", st.ctx as u64)
        .num("queue_capacity", st.cfg.queue_capacity as u64)
        .raw("stats", &st.stats.to_json())
        .end();
    json_response(StatusCode::OK, body)
}

fn body_bytes(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                ErrorKind::TooLarge,
                format!("request body exceeds the {limit}-byte limit"),
            )
        } else {
            ApiError::bad(format!("bad HTTP request: {e}"))
        }
    })
}

async fn tokenize(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    match tokenize_inner(&st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(Shape::OpenAi),
    }
}

/// `{"content": TEXT, "special": "chat"|"none"|"all", "with_pieces": bool}` or a chat body
/// (`messages`, …) which is rendered first → `{"tokens": [...], "count": N[, "prompt"][, "pieces"]}`.
async fn tokenize_inner(
    st: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_bytes(body, st.cfg.max_body_bytes)?;
    let _permit = prepare_permit(st).await?;
    crate::bodyscan::check(&body, st.ctx)?;
    /// Unknown members are skipped without being built (`IgnoredAny`).
    #[derive(serde::Deserialize)]
    struct TokenizeBody {
        content: Option<Box<serde_json::value::RawValue>>,
        special: Option<Box<serde_json::value::RawValue>>,
        with_pieces: Option<Box<serde_json::value::RawValue>>,
        messages: Option<serde::de::IgnoredAny>,
    }
    let b: TokenizeBody = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad(format!("invalid JSON request: {e}")))?;
    let with_pieces = match b.with_pieces.as_deref().map(|r| r.get()) {
        None | Some("null") => false,
        Some("true") => true,
        Some("false") => false,
        Some(_) => {
            return Err(ApiError::bad(
                "invalid JSON request: `with_pieces` must be a boolean",
            ))
        }
    };
    let st2 = st.clone();
    let (tokens, prompt) = if b.messages.is_some() {
        let ctx = st.ctx as u64;
        tokio::task::spawn_blocking(move || -> Result<_, ApiError> {
            let chat = endpoints::family(Endpoint::Chat);
            let mut req = chat.parse(&body, ctx)?;
            drop(body);
            let at_least = request::token_lower_bound(&req, st2.max_token_bytes);
            if at_least > st2.ctx {
                return Err(too_many_tokens_to_tokenize(at_least, true, st2.ctx));
            }
            let mut tm = st2.toolmem.lock().unwrap_or_else(|p| p.into_inner());
            let tm = st2.cfg.exact_dsml_replay.then_some(&mut *tm);
            let p = chat.prepare(&mut req, tm, None, &st2.tok, st2.cfg.content_special_tokens)?;
            Ok((p.tokens, Some(p.text)))
        })
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??
    } else {
        let content = match b
            .content
            .as_deref()
            .map(|r| serde_json::from_str::<Value>(r.get()))
        {
            Some(Ok(Value::String(s))) => s,
            _ => return Err(ApiError::bad("missing content")),
        };
        let special = b
            .special
            .as_deref()
            .map(|r| serde_json::from_str::<Value>(r.get()).unwrap_or(Value::Null));
        let mode = match special.as_ref().and_then(Value::as_str) {
            None | Some("chat") => SpecialTokens::ChatMarkers,
            Some("none") => SpecialTokens::None,
            Some("all") => SpecialTokens::All,
            Some(other) => {
                return Err(ApiError::bad(format!(
                    "`special` must be chat, none or all, not {other:?}"
                )))
            }
        };
        // No session holds more than the context: a text that needs more tokens is refused
        // before it is tokenized (by its byte count), or after.
        let at_least = content.len() / st.max_token_bytes;
        if at_least > st.ctx {
            return Err(too_many_tokens_to_tokenize(at_least, true, st.ctx));
        }
        drop(body);
        let t = tokio::task::spawn_blocking(move || st2.tok.encode_with(&content, mode))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?
            .map_err(|e| ApiError::bad(e.to_string()))?;
        (t, None)
    };
    if tokens.len() > st.ctx {
        return Err(too_many_tokens_to_tokenize(tokens.len(), false, st.ctx));
    }
    let mut out = Obj::new()
        .raw("tokens", &arr(tokens.iter().map(|t| t.to_string())))
        .num("count", tokens.len() as u64);
    if let Some(p) = prompt {
        out = out.str("prompt", &p);
    }
    if with_pieces {
        let pieces = arr(tokens.iter().map(|&t| {
            let b = st.tok.token_bytes(t).unwrap_or(&[]);
            Obj::new()
                .num("id", t as u64)
                .str("piece", &String::from_utf8_lossy(b))
                .end()
        }));
        out = out.raw("pieces", &pieces);
    }
    Ok(json_response(StatusCode::OK, out.end()))
}

fn too_many_tokens_to_tokenize(n: usize, at_least: bool, ctx: usize) -> ApiError {
    let n = if at_least {
        format!("at least {n}")
    } else {
        n.to_string()
    };
    ApiError::bad(format!(
        "the text to tokenize is {n} tokens, more than the context size ({ctx}); tokenize at most that many at once"
    ))
}

async fn detokenize(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    let run = async {
        let body = body_bytes(body, st.cfg.max_body_bytes)?;
        let _permit = prepare_permit(&st).await?;
        let st2 = st.clone();
        // Off the async threads: decoding millions of ids would stall `/health`.
        tokio::task::spawn_blocking(move || {
            let r = detokenize_body(&st2, &body);
            if body.len() >= limits::TRIM_AFTER_BYTES {
                drop(body);
                limits::release_memory();
            }
            r
        })
        .await
        .map_err(|e| ApiError::internal(format!("request task failed: {e}")))?
    };
    match run.await {
        Ok(r) => r,
        Err(e) => e.into_response(Shape::OpenAi),
    }
}

/// `{"tokens": [ids]}` → `{"content": text}`. The ids are read straight into a `Vec<u32>`
/// (a `serde_json::Value` per id took ~30 bytes each), and at most `ctx` of them are
/// decoded, which bounds the output too: no session of this server holds more.
fn detokenize_body(st: &AppState, body: &[u8]) -> Result<Response, ApiError> {
    #[derive(serde::Deserialize)]
    struct Body {
        tokens: Option<Vec<u32>>,
    }
    let b: Body = serde_json::from_slice(body).map_err(|e| {
        if e.is_data() {
            ApiError::bad("`tokens` must be an array of token ids")
        } else {
            ApiError::bad(format!("invalid JSON request: {e}"))
        }
    })?;
    let ids = b.tokens.ok_or_else(|| ApiError::bad("missing tokens"))?;
    if ids.len() > st.ctx {
        return Err(ApiError::bad(format!(
            "{} token ids exceed the context size ({}); detokenize at most that many at once",
            ids.len(),
            st.ctx
        )));
    }
    let text = st
        .tok
        .decode_lossy(&ids)
        .map_err(|e| ApiError::bad(e.to_string()))?;
    Ok(json_response(
        StatusCode::OK,
        Obj::new().str("content", &text).end(),
    ))
}

/// Waits for a preparation permit (see [`AppState::prepare`]).
async fn prepare_permit(st: &AppState) -> Result<tokio::sync::OwnedSemaphorePermit, ApiError> {
    st.prepare
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::shutting_down())
}

async fn generation(
    st: Arc<AppState>,
    ep: Endpoint,
    conn: Option<limits::ConnSocket>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match generation_inner(st, ep, conn, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(endpoints::family(ep).shape()),
    }
}

/// Sets the job's cancel flag when dropped: the SSE body goes away (a streaming client
/// disconnected), or the handler future does (hyper drops it when a non-streaming client
/// hangs up while waiting; `non_stream_disconnect_cancels_generation` checks this).
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

async fn generation_inner(
    st: Arc<AppState>,
    ep: Endpoint,
    conn: Option<limits::ConnSocket>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_bytes(body, st.cfg.max_body_bytes)?;
    if st.shutting_down.load(Ordering::Relaxed) {
        return Err(ApiError::shutting_down());
    }
    if let Some(m) = st.cfg.test_panic_marker.as_deref() {
        if !m.is_empty() && body.windows(m.len()).any(|w| w == m.as_bytes()) {
            panic!("test hook: injected handler panic");
        }
    }
    let ctx = st.ctx as u64;
    let permit = prepare_permit(&st).await?;
    let st2 = st.clone();
    let (req, prepared) = tokio::task::spawn_blocking(move || -> Result<_, ApiError> {
        let _permit = permit;
        let big = body.len() >= limits::TRIM_AFTER_BYTES;
        let r = admit_and_prepare(&st2, ep, body, ctx);
        if big {
            limits::release_memory();
        }
        r
    })
    .await
    .map_err(|e| ApiError::internal(format!("request task failed: {e}")))??;
    if prepared.tokens.len() >= st.ctx {
        return Err(ApiError::context_overflow(
            prepared.tokens.len(),
            st.ctx,
            endpoints::family(ep).prompt_param(),
        ));
    }
    Stats::add(&st.stats.exact_replays, prepared.exact_replays as u64);
    let counter = st.counter.fetch_add(1, Ordering::Relaxed) + 1;
    let seed = now_secs().wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ counter;
    let forced = st
        .cfg
        .script
        .as_ref()
        .and_then(|s| s.output_for(&prepared.text))
        .map(str::to_string);
    let ectx = Ctx::new(
        &req,
        endpoints::family(req.endpoint).response_id(counter),
        now_secs(),
    );
    let cancel = Arc::new(AtomicBool::new(false));
    let guard = CancelOnDrop(cancel.clone());
    let taken_ms = Arc::new(AtomicU64::new(limits::now_ms()));
    let (tx, mut rx) = mpsc::channel(if req.stream {
        st.cfg.stream_buffer_events.max(16)
    } else {
        16
    });
    let watch = req.stream.then(|| Arc::new(limits::StreamWatch::new(conn)));
    let job = Job {
        watch: watch.clone(),
        endpoint: ep,
        sampling: sampler_config(&req.sampling, prepared.thinking, seed),
        prepared,
        stop: req.stop.clone(),
        max_tokens: req.max_tokens,
        logprobs: req.logprobs,
        draft: req.draft.apply(st.cfg.draft),
        deltas: req.stream,
        forced,
        response_id: req
            .continuation
            .is_some_and(|c| c.response_ids)
            .then(|| ectx.id.clone()),
        continuation: req.continuation,
        prompt_param: endpoints::family(ep).prompt_param(),
        tool_id_prefix: endpoints::family(ep).tool_id_prefix(),
        events: tx,
        cancel,
        taken_ms: taken_ms.clone(),
    };
    Stats::add(&st.stats.queued, 1);
    if let Err(e) = st.jobs.try_send(job) {
        Stats::sub(&st.stats.queued, 1);
        return Err(match e {
            mpsc::error::TrySendError::Full(_) => {
                Stats::add(&st.stats.rejected_busy, 1);
                ApiError::busy(st.cfg.retry_after_secs)
            }
            mpsc::error::TrySendError::Closed(_) => ApiError::shutting_down(),
        });
    }
    Stats::add(&st.stats.requests, 1);
    let first = rx.recv().await;
    if let (Some(w), Some(ev)) = (&watch, &first) {
        w.taken(crate::worker::event_bytes(ev));
    }
    let usage = match first {
        Some(JobEvent::Started { usage, .. }) => usage,
        Some(JobEvent::Failed(e)) => return Err(e),
        Some(_) => return Err(ApiError::internal("the worker sent events out of order")),
        None => return Err(ApiError::shutting_down()),
    };
    if req.stream {
        return Ok(sse_response(
            ectx,
            usage,
            rx,
            guard,
            st.cfg.keep_alive,
            taken_ms,
            watch,
        ));
    }
    loop {
        match rx.recv().await {
            Some(JobEvent::Done(o)) => {
                drop(guard);
                if let Some(e) = endpoints::family(ep).outcome_error(&o) {
                    return Err(e);
                }
                return Ok(json_response(StatusCode::OK, final_body(&ectx, &o)));
            }
            Some(JobEvent::Failed(e)) => return Err(e),
            Some(_) => {}
            None => return Err(ApiError::internal("generation ended without a result")),
        }
    }
}

/// Parses, checks and renders a generation request. Cheap bounds come first, so a body that
/// can never fit the context is refused before it is expanded into messages, a prompt and
/// token ids (issue 24: 2.2 M tiny messages took 2.4 GB only to end in this same error).
/// The answer to `"draft": "mtp"` on a server without the MTP block.
pub(crate) const NO_MTP: &str = "`draft`: \"mtp\" needs the MTP block, which this server has not loaded (start ds4-server with --mtp FILE, or a model file that carries mtp.0.*; \"lookup\" drafts without it)";

fn admit_and_prepare(
    st: &AppState,
    ep: Endpoint,
    body: Bytes,
    ctx: u64,
) -> Result<(GenRequest, Prepared), ApiError> {
    let early = |n: usize| {
        Stats::add(&st.stats.rejected_early, 1);
        ApiError::context_overflow_at_least(n, st.ctx, endpoints::family(ep).prompt_param())
    };
    let (turns, items) = request::count_turns(&body);
    if turns >= st.ctx {
        return Err(early(turns));
    }
    // Messages that render to (almost) nothing, e.g. millions of empty system messages,
    // still cost memory to parse; no real conversation has more messages than the context
    // has tokens.
    if items > st.ctx {
        Stats::add(&st.stats.rejected_early, 1);
        return Err(ApiError::bad(format!(
            "{items} messages exceed the context size ({} tokens); send at most that many",
            st.ctx
        )));
    }
    // Before anything is built from the body: its shape must keep the parse within a small
    // multiple of its size (`bodyscan`), and it must hold no duplicate keys.
    crate::bodyscan::check(&body, st.ctx)?;
    let family = endpoints::family(ep);
    let mut req = family.parse(&body, ctx)?;
    drop(body);
    // Up front, not once the job reaches its slot: by then its prompt would have been
    // evaluated for nothing (and a streamed answer already begun). Only the request's own
    // ask: a server started with `--draft mtp` has a block, unless its placement plan left
    // the block out, and then its default drafts by lookup (docs/placement.md §10).
    if req.draft.mode == Some(ds4_runtime::DraftMode::Mtp) && !st.has_mtp {
        return Err(ApiError::bad(NO_MTP));
    }
    let bound = request::token_lower_bound(&req, st.max_token_bytes);
    if bound >= st.ctx {
        return Err(early(bound));
    }
    let binding = st.binding.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut tm = st.toolmem.lock().unwrap_or_else(|p| p.into_inner());
    let tm = st.cfg.exact_dsml_replay.then_some(&mut *tm);
    let p = family.prepare(
        &mut req,
        tm,
        binding.as_ref(),
        &st.tok,
        st.cfg.content_special_tokens,
    )?;
    Ok((req, p))
}

fn final_body(ctx: &Ctx, o: &Outcome) -> String {
    endpoints::family(ctx.endpoint).body(ctx, o)
}

/// A family's stream writer fed with worker events: (frames, whether the stream ended).
fn on_event(em: &mut dyn EventStream, ev: JobEvent) -> (Vec<Frame>, bool) {
    match ev {
        JobEvent::Delta(d) => (em.delta(&d), false),
        JobEvent::Done(o) => (em.done(&o), true),
        JobEvent::Failed(x) => (em.error(&x), true),
        JobEvent::Started { .. } => (Vec::new(), false),
    }
}

struct SseState {
    rx: mpsc::Receiver<JobEvent>,
    em: Box<dyn EventStream>,
    pending: VecDeque<Frame>,
    finished: bool,
    taken_ms: Arc<AtomicU64>,
    watch: Option<Arc<limits::StreamWatch>>,
    id: String,
    _guard: CancelOnDrop,
}

/// A stream dropped before its last event: the client went away (a chat page's Stop, a
/// closed tab), and the guard cancels the generation; the log says so.
impl Drop for SseState {
    fn drop(&mut self) {
        if !self.finished {
            tracing::info!(id = %self.id, "client closed the stream: generation cancelled");
        }
    }
}

/// axum writes an event's fields in the order they are set: the `event:` line goes first,
/// then `data:` (as `emit::frame_text` formats a frame).
pub(crate) fn to_event(f: Frame) -> Event {
    let e = Event::default();
    let e = match f.event {
        Some(name) => e.event(name),
        None => e,
    };
    e.data(f.data)
}

fn sse_response(
    ctx: Ctx,
    usage: crate::worker::Usage,
    rx: mpsc::Receiver<JobEvent>,
    guard: CancelOnDrop,
    keep_alive: Duration,
    taken_ms: Arc<AtomicU64>,
    watch: Option<Arc<limits::StreamWatch>>,
) -> Response {
    let id = ctx.id.clone();
    let mut em = endpoints::family(ctx.endpoint).stream(ctx);
    let first = em.start(&usage);
    let state = SseState {
        id,
        rx,
        em,
        pending: first.into(),
        finished: false,
        taken_ms,
        watch,
        _guard: guard,
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(f) = s.pending.pop_front() {
                return Some((Ok::<Event, Infallible>(to_event(f)), s));
            }
            if s.finished {
                return None;
            }
            match s.rx.recv().await {
                Some(ev) => {
                    s.taken_ms.store(limits::now_ms(), Ordering::Relaxed);
                    if let Some(w) = &s.watch {
                        w.taken(crate::worker::event_bytes(&ev));
                        w.refresh_peer();
                    }
                    let (frames, end) = on_event(s.em.as_mut(), ev);
                    s.pending.extend(frames);
                    s.finished = end;
                }
                None => s.finished = true,
            }
        }
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(keep_alive).text("prefill"))
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn event_name_comes_before_data() {
        use futures_util::StreamExt;
        let frames = vec![
            emit::named("message_start", "{}".into()),
            emit::data("x".into()),
        ];
        let events = futures_util::stream::iter(
            frames
                .into_iter()
                .map(|f| Ok::<Event, Infallible>(to_event(f))),
        );
        let resp = Sse::new(events).into_response();
        let mut body = resp.into_body().into_data_stream();
        let mut wire = Vec::new();
        while let Some(chunk) = body.next().await {
            wire.extend_from_slice(&chunk.unwrap());
        }
        let wire = String::from_utf8(wire).unwrap();
        assert_eq!(wire, "event: message_start\ndata: {}\n\ndata: x\n\n");
    }

    #[test]
    fn api_keys() {
        assert!(key_matches("k1", "k1"));
        assert!(!key_matches("k1", "k2"));
        assert!(!key_matches("", "k"));
        let mut h = HeaderMap::new();
        assert_eq!(presented_key(&h), None);
        h.insert("x-api-key", HeaderValue::from_static("abc"));
        assert_eq!(presented_key(&h), Some("abc"));
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer xyz"),
        );
        assert_eq!(presented_key(&h), Some("xyz"));
    }
}
