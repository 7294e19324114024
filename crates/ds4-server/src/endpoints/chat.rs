//! OpenAI chat completions (`POST /v1/chat/completions`).

use super::{EventStream, Family};
use crate::api::{Endpoint, GenRequest};
use crate::emit::{self, Ctx, Frame, OpenAiStream};
use crate::error::ApiError;
use crate::request;
use crate::worker::{Delta, Outcome, Usage};

pub struct Chat;

impl Family for Chat {
    fn endpoint(&self) -> Endpoint {
        Endpoint::Chat
    }
    fn path(&self) -> &'static str {
        "/v1/chat/completions"
    }
    fn parse(&self, body: &[u8], ctx: u64) -> Result<GenRequest, ApiError> {
        request::parse_chat(body, ctx)
    }
    fn body(&self, ctx: &Ctx, o: &Outcome) -> String {
        emit::chat_body(ctx, o)
    }
    fn stream(&self, ctx: Ctx) -> Box<dyn EventStream> {
        Box::new(OpenAiStream::new(ctx))
    }
}

/// Chat and completions stream the same chunk objects (the `object` field differs, by
/// the context's endpoint).
impl EventStream for OpenAiStream {
    fn start(&mut self, _usage: &Usage) -> Vec<Frame> {
        OpenAiStream::start(self)
    }
    fn delta(&mut self, d: &Delta) -> Vec<Frame> {
        OpenAiStream::delta(self, d)
    }
    fn done(&mut self, o: &Outcome) -> Vec<Frame> {
        OpenAiStream::done(self, o)
    }
    fn error(&mut self, e: &ApiError) -> Vec<Frame> {
        OpenAiStream::error(self, e)
    }
}
