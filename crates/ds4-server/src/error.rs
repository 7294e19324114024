//! Errors. [`ServerError`] is what setting up or running the server can fail with;
//! [`ApiError`] is a failed request, rendered as an HTTP response in the shape of the
//! protocol the client speaks (docs/server.md §8), so SDKs raise their own typed exceptions.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::json_out::Obj;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("model: {0}")]
    Model(String),
    #[error("engine: {0}")]
    Engine(#[from] ds4_engine::EngineError),
    #[error("tokenizer: {0}")]
    Chat(#[from] ds4_chat::ChatError),
    #[error("disk KV cache: {0}")]
    Kv(#[from] ds4_kvstore::KvError),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// Which error body shape a route answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// `{"error":{"message","type",…}}` — OpenAI routes, models, tokenize, health.
    OpenAi,
    /// `{"type":"error","error":{"type","message"}}` — `/v1/messages`.
    Anthropic,
}

/// What went wrong, independent of the wire shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidRequest,
    Authentication,
    NotFound,
    MethodNotAllowed,
    TooLarge,
    /// The queue is full (429).
    Busy,
    /// The server is stopping (503).
    ShuttingDown,
    /// A shared resource (the request-body budget) is taken for now (503 + `Retry-After`).
    Unavailable,
    /// Continuation state vanished (409).
    Conflict,
    /// The request body stalled or took too long (408; the connection is closed).
    Timeout,
    /// Host / Origin checks refused a browser-style request (403).
    Forbidden,
    /// A JSON endpoint was sent another content type (415).
    UnsupportedMediaType,
    Internal,
}

/// A failed request.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
    /// OpenAI `param` (context overflow names the field that holds the prompt).
    pub param: Option<&'static str>,
    /// OpenAI `code`.
    pub code: Option<&'static str>,
    /// Context overflow details: prompt tokens and configured context.
    pub overflow: Option<(usize, usize)>,
    /// Seconds for `Retry-After` (429).
    pub retry_after: Option<u64>,
}

/// An engine or runtime failure while serving a request: an internal error carrying its text.
pub(crate) fn engine_err(e: impl std::fmt::Display) -> ApiError {
    ApiError::internal(e.to_string())
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> ApiError {
        ApiError {
            kind,
            message: message.into(),
            param: None,
            code: None,
            overflow: None,
            retry_after: None,
        }
    }

    /// 400 `invalid_request_error`.
    pub fn bad(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorKind::InvalidRequest, message)
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorKind::Internal, message)
    }

    pub fn busy(retry_after: u64) -> ApiError {
        ApiError {
            retry_after: Some(retry_after),
            code: Some("rate_limit_exceeded"),
            ..ApiError::new(
                ErrorKind::Busy,
                "server busy: the request queue is full, retry later",
            )
        }
    }

    /// 503 with `Retry-After`: the request bodies being read already fill the body budget.
    pub fn body_budget_full(retry_after: u64, budget: usize) -> ApiError {
        ApiError {
            retry_after: Some(retry_after),
            code: Some("body_budget_exhausted"),
            ..ApiError::new(
                ErrorKind::Unavailable,
                format!("server busy: request bodies being received already fill the {budget}-byte body budget, retry later"),
            )
        }
    }

    pub fn shutting_down() -> ApiError {
        ApiError::new(ErrorKind::ShuttingDown, "server shutting down")
    }

    /// Prompt of `n` tokens does not fit a context of `ctx` tokens (docs/server.md §8).
    pub fn context_overflow(n: usize, ctx: usize, param: &'static str) -> ApiError {
        ApiError {
            param: Some(param),
            code: Some("context_length_exceeded"),
            overflow: Some((n, ctx)),
            ..ApiError::bad(format!(
                "Prompt has {n} tokens, but the configured context size is {ctx} tokens"
            ))
        }
    }

    /// A prompt that needs at least `n` tokens (a bound found before rendering) cannot fit.
    pub fn context_overflow_at_least(n: usize, ctx: usize, param: &'static str) -> ApiError {
        ApiError {
            message: format!(
                "Prompt has at least {n} tokens, but the configured context size is {ctx} tokens"
            ),
            ..ApiError::context_overflow(n, ctx, param)
        }
    }

    pub fn status(&self) -> StatusCode {
        match self.kind {
            ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Authentication => StatusCode::UNAUTHORIZED,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::Busy => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::ShuttingDown | ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Conflict => StatusCode::CONFLICT,
            ErrorKind::Timeout => StatusCode::REQUEST_TIMEOUT,
            ErrorKind::Forbidden => StatusCode::FORBIDDEN,
            ErrorKind::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn openai_type(&self) -> &'static str {
        match self.kind {
            ErrorKind::InvalidRequest
            | ErrorKind::TooLarge
            | ErrorKind::Conflict
            | ErrorKind::Timeout
            | ErrorKind::UnsupportedMediaType => "invalid_request_error",
            ErrorKind::Forbidden => "permission_error",
            ErrorKind::MethodNotAllowed | ErrorKind::NotFound => "invalid_request_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::Busy => "rate_limit_error",
            ErrorKind::ShuttingDown | ErrorKind::Unavailable | ErrorKind::Internal => {
                "server_error"
            }
        }
    }

    fn anthropic_type(&self) -> &'static str {
        match self.kind {
            ErrorKind::InvalidRequest
            | ErrorKind::Conflict
            | ErrorKind::MethodNotAllowed
            | ErrorKind::Timeout
            | ErrorKind::UnsupportedMediaType => "invalid_request_error",
            ErrorKind::Forbidden => "permission_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::TooLarge => "request_too_large",
            ErrorKind::Busy | ErrorKind::ShuttingDown | ErrorKind::Unavailable => {
                "overloaded_error"
            }
            ErrorKind::Internal => "api_error",
        }
    }

    /// The JSON body in `shape`.
    pub fn body(&self, shape: Shape) -> String {
        match shape {
            Shape::OpenAi => {
                let mut e = Obj::new()
                    .str("message", &self.message)
                    .str("type", self.openai_type());
                if let Some(p) = self.param {
                    e = e.str("param", p);
                }
                if let Some(c) = self.code {
                    e = e.str("code", c);
                }
                if let Some((n, c)) = self.overflow {
                    e = e.num("n_prompt_tokens", n as u64).num("n_ctx", c as u64);
                }
                Obj::new().raw("error", &e.end()).end()
            }
            Shape::Anthropic => {
                let mut e = Obj::new()
                    .str("type", self.anthropic_type())
                    .str("message", &self.message);
                if let Some((n, c)) = self.overflow {
                    e = e.num("n_prompt_tokens", n as u64).num("n_ctx", c as u64);
                }
                Obj::new().str("type", "error").raw("error", &e.end()).end()
            }
        }
    }

    /// The in-stream SSE error payload (docs/server.md §7.1).
    pub fn sse_payload(&self, shape: Shape) -> String {
        match shape {
            Shape::OpenAi => Obj::new()
                .raw(
                    "error",
                    &Obj::new()
                        .str("message", &self.message)
                        .str("type", "server_error")
                        .end(),
                )
                .end(),
            Shape::Anthropic => Obj::new()
                .str("type", "error")
                .raw(
                    "error",
                    &Obj::new()
                        .str("type", "api_error")
                        .str("message", &self.message)
                        .end(),
                )
                .end(),
        }
    }

    pub fn into_response(self, shape: Shape) -> Response {
        let mut body = self.body(shape);
        body.push('\n');
        let mut resp = (
            self.status(),
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        resp
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes() {
        let e = ApiError::context_overflow(10, 8, "messages");
        let v: serde_json::Value = serde_json::from_str(&e.body(Shape::OpenAi)).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "context_length_exceeded");
        assert_eq!(v["error"]["param"], "messages");
        assert_eq!(v["error"]["n_prompt_tokens"], 10);
        let v: serde_json::Value = serde_json::from_str(&e.body(Shape::Anthropic)).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["n_ctx"], 8);
        let b = ApiError::busy(1);
        assert_eq!(b.status(), StatusCode::TOO_MANY_REQUESTS);
        let v: serde_json::Value = serde_json::from_str(&b.body(Shape::Anthropic)).unwrap();
        assert_eq!(v["error"]["type"], "overloaded_error");
        let r = b.into_response(Shape::OpenAi);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
    }
}
