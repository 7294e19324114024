//! Anthropic messages (`POST /v1/messages`).

use super::{EventStream, Family};
use crate::api::{Endpoint, GenRequest};
use crate::emit::{self, AnthropicStream, Ctx, Frame};
use crate::error::ApiError;
use crate::request;
use crate::worker::{Delta, Outcome, Usage};

pub struct Messages;

impl Family for Messages {
    fn endpoint(&self) -> Endpoint {
        Endpoint::Messages
    }
    fn path(&self) -> &'static str {
        "/v1/messages"
    }
    fn parse(&self, body: &[u8], ctx: u64) -> Result<GenRequest, ApiError> {
        request::parse_messages(body, ctx)
    }
    fn body(&self, ctx: &Ctx, o: &Outcome) -> String {
        emit::anthropic_body(ctx, o)
    }
    fn stream(&self, ctx: Ctx) -> Box<dyn EventStream> {
        Box::new(AnthropicStream::new(ctx))
    }
}

/// `message_start` carries the prompt's usage.
impl EventStream for AnthropicStream {
    fn start(&mut self, usage: &Usage) -> Vec<Frame> {
        AnthropicStream::start(self, usage)
    }
    fn delta(&mut self, d: &Delta) -> Vec<Frame> {
        AnthropicStream::delta(self, d)
    }
    fn done(&mut self, o: &Outcome) -> Vec<Frame> {
        AnthropicStream::done(self, o)
    }
    fn error(&mut self, e: &ApiError) -> Vec<Frame> {
        AnthropicStream::error(self, e)
    }
}
