//! `Session`: one sequence on one engine — prefill, decode, snapshots. Generation loops
//! (sampling, stop conditions, streaming) belong to the front ends (`ds4-runtime`'s driver).

use crate::engine::{Engine, Logits};
use crate::error::Result;
use crate::state::{KvState, Snapshot};

/// A sequence's KV state bound to its engine.
///
/// The state holds every token passed to `prefill`/`decode`. After [`Session::generate`],
/// it holds the prompt and every generated token except the last one, which was sampled but
/// not yet fed (feed it with `decode` to continue the conversation).
#[derive(Debug)]
pub struct Session {
    engine: Engine,
    state: Option<KvState>,
}

impl Session {
    /// A session with an empty state of `engine.config().ctx` tokens.
    pub fn new(mut engine: Engine) -> Result<Session> {
        let state = engine.new_state()?;
        Ok(Session {
            engine,
            state: Some(state),
        })
    }

    fn st(&mut self) -> (&mut Engine, &mut KvState) {
        (
            &mut self.engine,
            self.state
                .as_mut()
                .expect("state present while the session lives"),
        )
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// Tokens processed so far.
    pub fn tokens(&self) -> &[u32] {
        self.state.as_ref().map(|s| s.tokens()).unwrap_or(&[])
    }

    pub fn pos(&self) -> usize {
        self.tokens().len()
    }

    pub fn ctx(&self) -> usize {
        self.state.as_ref().map(|s| s.ctx()).unwrap_or(0)
    }

    /// Back to position 0.
    pub fn reset(&mut self) -> Result<()> {
        let (e, s) = self.st();
        e.reset_state(s)
    }

    /// Appends `tokens` and returns the logits of the last one (`n_vocab` values).
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let (e, s) = self.st();
        e.eval(s, tokens, Logits::Last, None)
    }

    /// Like [`Session::prefill`] with a progress callback `(done, total)` per chunk.
    pub fn prefill_with_progress(
        &mut self,
        tokens: &[u32],
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Vec<f32>> {
        let (e, s) = self.st();
        e.eval(s, tokens, Logits::Last, Some(progress))
    }

    /// Appends `tokens` and returns every position's logits, `[T, n_vocab]` row-major.
    pub fn prefill_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let (e, s) = self.st();
        e.eval(s, tokens, Logits::All, None)
    }

    /// Appends one token and returns its logits.
    pub fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
        let (e, s) = self.st();
        e.eval(s, &[token], Logits::Last, None)
    }

    /// Feeds `token` and returns the sampling band of the next logits
    /// ([`Engine::eval_band`]); when the band is short for the draw,
    /// [`Session::last_logits_into`] fetches the row.
    pub fn decode_band(
        &mut self,
        token: u32,
        span: f32,
        exclude: Option<u32>,
    ) -> Result<crate::sampler::LogitBand> {
        let (e, s) = self.st();
        e.eval_band(s, &[token], span, exclude)
    }

    /// The logits row of the last [`Session::decode_band`].
    pub fn last_logits_into(&mut self, logits: &mut Vec<f32>) -> Result<()> {
        self.engine.last_logits_into(logits)
    }

    /// [`Session::decode`] into a reused buffer (cleared first): no per-token allocation.
    pub fn decode_into(&mut self, token: u32, logits: &mut Vec<f32>) -> Result<()> {
        let (e, s) = self.st();
        e.eval_into(s, &[token], Logits::Last, None, logits)
    }

    /// Evaluates `tokens` (a token and drafts after it) as decode rows, every row's logits
    /// into `rows`, saving what a rollback needs ([`Engine::eval_verify`]).
    pub fn verify(&mut self, tokens: &[u32], rows: &mut Vec<f32>) -> Result<crate::Verify> {
        let (e, s) = self.st();
        e.eval_verify(s, tokens, rows)
    }

    /// Whether [`Session::verify`] can run ([`Engine::can_verify`]).
    pub fn can_verify(&mut self) -> bool {
        self.engine.can_verify()
    }

    /// Drafts up to `k` tokens after the state and `next` with the MTP block
    /// ([`Engine::mtp_draft`]); empty without one.
    pub fn mtp_draft(
        &mut self,
        next: u32,
        k: usize,
        pick: &mut dyn FnMut(&[f32]) -> Option<u32>,
    ) -> Result<Vec<u32>> {
        let (e, s) = self.st();
        e.mtp_draft(s, next, k, pick)
    }

    /// Keeps the first `keep` tokens of the last [`Session::verify`] ([`Engine::settle`]).
    pub fn settle(&mut self, v: crate::Verify, keep: usize) -> Result<()> {
        let (e, s) = self.st();
        e.settle(s, v, keep)
    }

    pub fn snapshot(&mut self) -> Result<Snapshot> {
        let (e, s) = self.st();
        e.snapshot(s)
    }

    /// Replaces the state with a snapshot taken from an engine with the same model and mode.
    pub fn restore(&mut self, snap: &Snapshot) -> Result<()> {
        let (e, s) = self.st();
        e.restore(s, snap)
    }

    /// Gives the engine back (the state's buffers are released). Dropping a session
    /// drops its engine and backend, which releases everything too.
    pub fn into_engine(self) -> Engine {
        let Session { mut engine, state } = self;
        if let Some(s) = state {
            engine.free_state(s);
        }
        engine
    }
}
