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

use crate::config::{ServerConfig, MODEL_ID};
use crate::emit::{self, AnthropicStream, Ctx, Frame, OpenAiStream, ResponsesStream};
use crate::error::{ApiError, ErrorKind, Shape};
use crate::json_out::{arr, Obj};
use crate::live::ToolBinding;
use crate::request::{self, Endpoint};
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
    ) -> AppState {
        AppState {
            cfg,
            tok,
            toolmem,
            binding,
            jobs,
            stats,
            shutting_down,
            ctx,
            model_name,
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
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses))
        .route("/v1/messages", post(messages))
        .route("/health", get(health))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(unknown_endpoint)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            cors_and_options,
        ))
        .layer(CatchPanicLayer::custom(
            |_: Box<dyn std::any::Any + Send>| {
                ApiError::internal("internal error (handler panicked)").into_response(Shape::OpenAi)
            },
        ))
        .with_state(state)
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

/// `OPTIONS` → 204; with `--cors`, permissive CORS headers on every response.
async fn cors_and_options(State(st): St, req: Request, next: Next) -> Response {
    let mut resp = if req.method() == Method::OPTIONS {
        StatusCode::NO_CONTENT.into_response()
    } else {
        next.run(req).await
    };
    if st.cfg.cors {
        let h = resp.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_ORIGIN,
            HeaderValue::from_static("*"),
        );
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

fn presented_key(h: &HeaderMap) -> Option<&str> {
    if let Some(v) = h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        if let Some(k) = v
            .strip_prefix("Bearer ")
            .or_else(|| v.strip_prefix("bearer "))
        {
            return Some(k.trim());
        }
    }
    h.get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

/// `--api-key`: `Authorization: Bearer KEY` or `x-api-key: KEY` (`/health` is open).
async fn auth(State(st): St, req: Request, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        let path = req.uri().path();
        if path != "/health" && req.method() != Method::OPTIONS {
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

async fn health(State(st): St) -> Response {
    let status = if st.shutting_down.load(Ordering::Relaxed) {
        "shutting_down"
    } else {
        "ok"
    };
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
    let v: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad(format!("invalid JSON request: {e}")))?;
    let Value::Object(o) = &v else {
        return Err(ApiError::bad(
            "invalid JSON request: the body must be a JSON object",
        ));
    };
    let with_pieces = match o.get("with_pieces") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::bad(
                "invalid JSON request: `with_pieces` must be a boolean",
            ))
        }
    };
    let st2 = st.clone();
    let (tokens, prompt) = if o.contains_key("messages") {
        let ctx = st.ctx as u64;
        tokio::task::spawn_blocking(move || -> Result<_, ApiError> {
            let mut req = request::parse_chat(&body, ctx)?;
            let mut tm = st2.toolmem.lock().unwrap_or_else(|p| p.into_inner());
            let tm = st2.cfg.exact_dsml_replay.then_some(&mut *tm);
            let p = request::prepare(&mut req, tm, None, &st2.tok)?;
            Ok((p.tokens, Some(p.text)))
        })
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??
    } else {
        let content = match o.get("content") {
            Some(Value::String(s)) => s.clone(),
            _ => return Err(ApiError::bad("missing content")),
        };
        let mode = match o.get("special").and_then(Value::as_str) {
            None | Some("chat") => SpecialTokens::ChatMarkers,
            Some("none") => SpecialTokens::None,
            Some("all") => SpecialTokens::All,
            Some(other) => {
                return Err(ApiError::bad(format!(
                    "`special` must be chat, none or all, not {other:?}"
                )))
            }
        };
        let t = tokio::task::spawn_blocking(move || st2.tok.encode_with(&content, mode))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?
            .map_err(|e| ApiError::bad(e.to_string()))?;
        (t, None)
    };
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

async fn detokenize(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    let run = || -> Result<Response, ApiError> {
        let body = body_bytes(body, st.cfg.max_body_bytes)?;
        let v: Value = serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad(format!("invalid JSON request: {e}")))?;
        let Some(Value::Array(items)) = v.get("tokens") else {
            return Err(ApiError::bad("missing tokens"));
        };
        let ids = items
            .iter()
            .map(|x| x.as_u64().and_then(|i| u32::try_from(i).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| ApiError::bad("`tokens` must be an array of token ids"))?;
        let text = st
            .tok
            .decode_lossy(&ids)
            .map_err(|e| ApiError::bad(e.to_string()))?;
        Ok(json_response(
            StatusCode::OK,
            Obj::new().str("content", &text).end(),
        ))
    };
    match run() {
        Ok(r) => r,
        Err(e) => e.into_response(Shape::OpenAi),
    }
}

async fn chat(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    generation(st, Endpoint::Chat, body).await
}
async fn completions(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    generation(st, Endpoint::Completions, body).await
}
async fn responses(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    generation(st, Endpoint::Responses, body).await
}
async fn messages(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    generation(st, Endpoint::Messages, body).await
}

async fn generation(
    st: Arc<AppState>,
    ep: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match generation_inner(st, ep, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(ep.shape()),
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
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_bytes(body, st.cfg.max_body_bytes)?;
    if st.shutting_down.load(Ordering::Relaxed) {
        return Err(ApiError::shutting_down());
    }
    let ctx = st.ctx as u64;
    let st2 = st.clone();
    let (req, prepared) = tokio::task::spawn_blocking(move || -> Result<_, ApiError> {
        let mut req = match ep {
            Endpoint::Chat => request::parse_chat(&body, ctx),
            Endpoint::Completions => request::parse_completions(&body, ctx),
            Endpoint::Responses => request::parse_responses(&body, ctx),
            Endpoint::Messages => request::parse_messages(&body, ctx),
        }?;
        let binding = st2
            .binding
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut tm = st2.toolmem.lock().unwrap_or_else(|p| p.into_inner());
        let tm = st2.cfg.exact_dsml_replay.then_some(&mut *tm);
        let p = request::prepare(&mut req, tm, binding.as_ref(), &st2.tok)?;
        Ok((req, p))
    })
    .await
    .map_err(|e| ApiError::internal(format!("request task failed: {e}")))??;
    if prepared.tokens.len() >= st.ctx {
        return Err(ApiError::context_overflow(
            prepared.tokens.len(),
            st.ctx,
            ep.prompt_param(),
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
    let ectx = Ctx::new(&req, counter, now_secs());
    let cancel = Arc::new(AtomicBool::new(false));
    let guard = CancelOnDrop(cancel.clone());
    let (tx, mut rx) = mpsc::channel(if req.stream {
        st.cfg.stream_buffer_events.max(16)
    } else {
        16
    });
    let job = Job {
        endpoint: ep,
        sampling: sampler_config(&req.sampling, prepared.thinking, seed),
        prepared,
        stop: req.stop.clone(),
        max_tokens: req.max_tokens,
        deltas: req.stream,
        forced,
        response_id: (ep == Endpoint::Responses).then(|| ectx.id.clone()),
        events: tx,
        cancel,
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
    let usage = match rx.recv().await {
        Some(JobEvent::Started { usage, .. }) => usage,
        Some(JobEvent::Failed(e)) => return Err(e),
        Some(_) => return Err(ApiError::internal("the worker sent events out of order")),
        None => return Err(ApiError::shutting_down()),
    };
    if req.stream {
        return Ok(sse_response(ectx, usage, rx, guard, st.cfg.keep_alive));
    }
    loop {
        match rx.recv().await {
            Some(JobEvent::Done(o)) => {
                drop(guard);
                return Ok(json_response(StatusCode::OK, final_body(&ectx, &o)));
            }
            Some(JobEvent::Failed(e)) => return Err(e),
            Some(_) => {}
            None => return Err(ApiError::internal("generation ended without a result")),
        }
    }
}

fn final_body(ctx: &Ctx, o: &Outcome) -> String {
    match ctx.endpoint {
        Endpoint::Chat => emit::chat_body(ctx, o),
        Endpoint::Completions => emit::completion_body(ctx, o),
        Endpoint::Responses => emit::responses_body(ctx, o),
        Endpoint::Messages => emit::anthropic_body(ctx, o),
    }
}

enum Emitter {
    OpenAi(OpenAiStream),
    Anthropic(AnthropicStream),
    Responses(ResponsesStream),
}

impl Emitter {
    fn new(ctx: Ctx) -> Emitter {
        match ctx.endpoint {
            Endpoint::Chat | Endpoint::Completions => Emitter::OpenAi(OpenAiStream::new(ctx)),
            Endpoint::Messages => Emitter::Anthropic(AnthropicStream::new(ctx)),
            Endpoint::Responses => Emitter::Responses(ResponsesStream::new(ctx)),
        }
    }

    fn on(&mut self, ev: JobEvent) -> (Vec<Frame>, bool) {
        match (self, ev) {
            (Emitter::OpenAi(e), JobEvent::Delta(d)) => (e.delta(&d), false),
            (Emitter::Anthropic(e), JobEvent::Delta(d)) => (e.delta(&d), false),
            (Emitter::Responses(e), JobEvent::Delta(d)) => (e.delta(&d), false),
            (Emitter::OpenAi(e), JobEvent::Done(o)) => (e.done(&o), true),
            (Emitter::Anthropic(e), JobEvent::Done(o)) => (e.done(&o), true),
            (Emitter::Responses(e), JobEvent::Done(o)) => (e.done(&o), true),
            (Emitter::OpenAi(e), JobEvent::Failed(x)) => (e.error(&x), true),
            (Emitter::Anthropic(e), JobEvent::Failed(x)) => (e.error(&x), true),
            (Emitter::Responses(e), JobEvent::Failed(x)) => (e.error(&x), true),
            (_, JobEvent::Started { .. }) => (Vec::new(), false),
        }
    }
}

struct SseState {
    rx: mpsc::Receiver<JobEvent>,
    em: Emitter,
    pending: VecDeque<Frame>,
    finished: bool,
    _guard: CancelOnDrop,
}

fn to_event(f: Frame) -> Event {
    let e = Event::default().data(f.data);
    match f.event {
        Some(name) => e.event(name),
        None => e,
    }
}

fn sse_response(
    ctx: Ctx,
    usage: crate::worker::Usage,
    rx: mpsc::Receiver<JobEvent>,
    guard: CancelOnDrop,
    keep_alive: Duration,
) -> Response {
    let mut em = Emitter::new(ctx);
    let first = match &mut em {
        Emitter::OpenAi(e) => e.start(),
        Emitter::Anthropic(e) => e.start(&usage),
        Emitter::Responses(e) => e.start(),
    };
    let state = SseState {
        rx,
        em,
        pending: first.into(),
        finished: false,
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
                    let (frames, end) = s.em.on(ev);
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
