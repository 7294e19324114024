//! OpenAI Responses (`POST /v1/responses`).

use super::{EventStream, Family};
use crate::api::{Endpoint, GenRequest};
use crate::emit::{self, Ctx, Frame, ResponsesStream};
use crate::error::ApiError;
use crate::request;
use crate::worker::{Delta, Outcome, Usage};

pub struct Responses;

impl Family for Responses {
    fn endpoint(&self) -> Endpoint {
        Endpoint::Responses
    }
    fn path(&self) -> &'static str {
        "/v1/responses"
    }
    fn parse(&self, body: &[u8], ctx: u64) -> Result<GenRequest, ApiError> {
        request::parse_responses(body, ctx)
    }
    fn body(&self, ctx: &Ctx, o: &Outcome) -> String {
        emit::responses_body(ctx, o)
    }
    fn stream(&self, ctx: Ctx) -> Box<dyn EventStream> {
        Box::new(ResponsesStream::new(ctx))
    }
}

impl EventStream for ResponsesStream {
    fn start(&mut self, _usage: &Usage) -> Vec<Frame> {
        ResponsesStream::start(self)
    }
    fn delta(&mut self, d: &Delta) -> Vec<Frame> {
        ResponsesStream::delta(self, d)
    }
    fn done(&mut self, o: &Outcome) -> Vec<Frame> {
        ResponsesStream::done(self, o)
    }
    fn error(&mut self, e: &ApiError) -> Vec<Frame> {
        ResponsesStream::error(self, e)
    }
}
