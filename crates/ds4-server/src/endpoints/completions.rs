//! OpenAI text completions (`POST /v1/completions`): a prompt string rendered as one user
//! turn; streamed with the chat family's chunk writer.

use super::{EventStream, Family};
use crate::api::{Endpoint, GenRequest};
use crate::emit::{self, Ctx, OpenAiStream};
use crate::error::ApiError;
use crate::request;
use crate::worker::Outcome;

pub struct Completions;

impl Family for Completions {
    fn endpoint(&self) -> Endpoint {
        Endpoint::Completions
    }
    fn path(&self) -> &'static str {
        "/v1/completions"
    }
    fn parse(&self, body: &[u8], ctx: u64) -> Result<GenRequest, ApiError> {
        request::parse_completions(body, ctx)
    }
    fn body(&self, ctx: &Ctx, o: &Outcome) -> String {
        emit::completion_body(ctx, o)
    }
    fn stream(&self, ctx: Ctx) -> Box<dyn EventStream> {
        Box::new(OpenAiStream::new(ctx))
    }
}
