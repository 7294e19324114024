//! `Engine`: a loaded model on a backend, plus the chunking driver around the forward pass.

use std::path::Path;
use std::sync::Arc;

use ds4_gguf::GgufFile;
use ds4_model::{HParams, ModelSpec, Strictness};

use crate::backend::{Backend, BandJob, IBuf};
use crate::census::RouteCensus;
use crate::config::{EngineConfig, NumericMode};
use crate::error::{EngineError, Result};
use crate::expert_stream::{ExpertPlacement, ExpertStream, StreamStats};
use crate::forward::{forward, forward_chunk, Model, Scratch, Seq, Want};
use crate::state::{fnv1a, KvState, Snapshot};
use crate::weights::ModelWeights;

/// Which logits [`Engine::eval`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// None (only advance the state).
    None,
    /// The last position's `n_vocab` logits.
    Last,
    /// Every position's, `[T, n_vocab]` row-major.
    All,
}

/// One state's result of [`Engine::eval_batch_bands`].
#[derive(Debug, Clone, PartialEq)]
pub enum BatchRow {
    /// The band of its row near the maximum; the row is in the scratch.
    Band(crate::sampler::LogitBand),
    /// The whole row.
    Row(Vec<f32>),
}

/// A model loaded onto a backend.
pub struct Engine {
    backend: Box<dyn Backend>,
    spec: ModelSpec,
    weights: ModelWeights,
    mode: NumericMode,
    config: EngineConfig,
    scratch: Option<Scratch>,
    fingerprint: u64,
    /// Routed experts streamed from the file ([`ExpertPlacement::Streamed`]).
    stream: Option<ExpertStream>,
    /// Prompt chunks of 2..=this many tokens run as decode rows ([`Engine::set_short_prefill_rows`]).
    short_rows: usize,
    /// Where a verify step saves the state ranges it overwrites (crate::speculate).
    undo: crate::speculate::UndoArea,
    /// Routing counts while [`Engine::set_route_census`] is on.
    census: Option<RouteCensus>,
    /// The MTP block, when loaded ([`Engine::load_mtp`]).
    mtp: Option<crate::mtp::Mtp>,
    _file: Arc<GgufFile>,
}

/// Default of [`Engine::set_short_prefill_rows`]: prompt chunks of at most this many tokens
/// run through the decode kernels (docs/forward.md §13).
pub const SHORT_PREFILL_ROWS: usize = 32;

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("backend", &self.backend.name())
            .field("mode", &self.mode)
            .field("config", &self.config)
            .finish()
    }
}

impl Engine {
    /// Opens and validates a GGUF file, then loads it (see [`Engine::load`]).
    pub fn open(
        path: impl AsRef<Path>,
        backend: Box<dyn Backend>,
        config: EngineConfig,
    ) -> Result<Engine> {
        let file = GgufFile::open(path)
            .map_err(|e| EngineError::Config(format!("cannot open model: {e}")))?;
        Engine::load(Arc::new(file), backend, config)
    }

    /// Validates `file` as a ds4-layout model, checks the numeric mode fits it, and loads
    /// every weight onto `backend`.
    pub fn load(
        file: Arc<GgufFile>,
        backend: Box<dyn Backend>,
        config: EngineConfig,
    ) -> Result<Engine> {
        Engine::load_with(file, backend, config, ExpertPlacement::Resident)
    }

    /// [`Engine::load`] with routed experts placed as `experts` says: with
    /// [`ExpertPlacement::Streamed`] they stay in the file and are read on demand into a
    /// cache of that many units (docs/placement.md §9); logits do not change.
    pub fn load_with(
        file: Arc<GgufFile>,
        mut backend: Box<dyn Backend>,
        config: EngineConfig,
        experts: ExpertPlacement,
    ) -> Result<Engine> {
        if config.prefill_chunk == 0 {
            return Err(EngineError::Config("prefill chunk must be positive".into()));
        }
        if config.ctx == 0 {
            return Err(EngineError::Config(
                "context length must be positive".into(),
            ));
        }
        let spec = ModelSpec::from_header(file.header(), Strictness::Auto)?;
        let hp = &spec.hparams;
        check_supported(hp)?;
        let mode = config.mode.unwrap_or_else(|| NumericMode::default_for(hp));
        if mode == NumericMode::Official {
            if let Some(reason) = NumericMode::official_unsupported(hp) {
                return Err(EngineError::ModeUnsupported {
                    mode: mode.to_string(),
                    reason,
                });
            }
        }
        let stream = match experts {
            ExpertPlacement::Resident => None,
            ExpertPlacement::Streamed(cfg) => {
                Some(ExpertStream::new(backend.as_mut(), &file, &spec, cfg)?)
            }
        };
        let routed = stream.as_ref().map(ExpertStream::pools);
        let weights = ModelWeights::load_with(backend.as_mut(), &file, &spec, routed)?;
        let fingerprint = fnv1a(format!("{:?}|{}", spec.hparams, mode).as_bytes());
        Ok(Engine {
            backend,
            spec,
            weights,
            mode,
            config,
            scratch: None,
            fingerprint,
            stream,
            short_rows: SHORT_PREFILL_ROWS,
            undo: Default::default(),
            census: None,
            mtp: None,
            _file: file,
        })
    }

    /// Loads the multi-token-prediction block (`mtp.0.*`, docs/gguf.md §4.7) from `file`
    /// (the main file itself, or ds4's sidecar), after checking every tensor against the
    /// main model. From then on the main model's final streams of the last window of
    /// positions are kept for it, and [`Engine::mtp_draft`] drafts with it.
    ///
    /// With streamed routed experts too: the block's own weights (its routed experts
    /// included) are loaded resident — the placement plan counts them (docs/placement.md
    /// §10) — and its one-layer forward pass runs without the expert stream.
    pub fn load_mtp(&mut self, file: Arc<GgufFile>) -> Result<()> {
        let m = crate::mtp::Mtp::load(
            self.backend.as_mut(),
            &file,
            &self.spec,
            &self.weights,
            &self.config,
            self.fingerprint,
        )?;
        if let Some(old) = self.mtp.replace(m) {
            old.free(self.backend.as_mut());
        }
        Ok(())
    }

    /// Whether an MTP block is loaded.
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// Drafts up to `k` tokens to follow `state`'s tokens and `next` (the token about to be
    /// fed) with the MTP block (docs/speculative.md §4): `pick` receives the draft logits of
    /// each depth and returns the draft token, or `None` to stop. Empty when no block is
    /// loaded or the main model's streams for `state` were not kept (it was restored from
    /// a snapshot or stepped in a batch since): the caller then decodes plainly. Neither
    /// `state` nor what later calls draft depends on what was drafted.
    pub fn mtp_draft(
        &mut self,
        state: &KvState,
        next: u32,
        k: usize,
        pick: &mut dyn FnMut(&[f32]) -> Option<u32>,
    ) -> Result<Vec<u32>> {
        self.check_state(state)?;
        if next as usize >= self.spec.hparams.n_vocab {
            return Err(EngineError::BadToken {
                token: next,
                index: 0,
                n_vocab: self.spec.hparams.n_vocab,
            });
        }
        let mode = self.mode;
        match self.mtp.as_mut() {
            Some(m) => m.draft(self.backend.as_mut(), mode, state.tokens(), next, k, pick),
            None => Ok(Vec::new()),
        }
    }

    pub fn hparams(&self) -> &HParams {
        &self.spec.hparams
    }

    /// Prompt chunks of 2 to `n` tokens are evaluated as decode rows
    /// ([`crate::Backend::set_decode_rows`]): with int8 activations on, their matmuls take the
    /// decode kernels row by row (each row the bits its token gets decoded alone) instead of
    /// the prefill GEMMs and tiles, whose fixed cost per chunk dominates a short prompt
    /// (docs/forward.md §13). 0 or 1: never. A backend that refuses decode rows evaluates
    /// them as before.
    pub fn set_short_prefill_rows(&mut self, n: usize) {
        self.short_rows = n;
    }
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }
    /// The active numeric mode (print it at load).
    pub fn mode(&self) -> NumericMode {
        self.mode
    }
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }
    pub fn backend_name(&self) -> String {
        self.backend.name()
    }
    /// Identifies model dims + mode; snapshots only restore into a matching engine.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// A fresh state for `config.ctx` tokens.
    pub fn new_state(&mut self) -> Result<KvState> {
        self.new_state_with_ctx(self.config.ctx)
    }

    pub fn new_state_with_ctx(&mut self, ctx: usize) -> Result<KvState> {
        KvState::new(
            self.backend.as_mut(),
            &self.spec.hparams,
            ctx,
            self.fingerprint,
        )
    }

    /// Runs one prefill chunk of `tokens` placeholder tokens and one decode step on a
    /// state of their size, then frees it, when the backend has first-use costs
    /// ([`Backend::warms_up`]) and experts are resident (a warm-up would fill a streamed
    /// cache with experts of no prompt). Returns the tokens run (0: nothing ran). The
    /// first request then runs at the speed of the ones after it (docs/gpu.md §19).
    pub fn warm_up(&mut self, tokens: usize) -> Result<usize> {
        let n = tokens
            .min(self.config.prefill_chunk)
            .min(self.config.ctx.saturating_sub(1));
        if n == 0 || !self.backend.warms_up() || self.stream.is_some() {
            return Ok(0);
        }
        let vocab = self.spec.hparams.n_vocab.max(1) as u64;
        // Spread ids (any id of the vocabulary routes somewhere; their text is irrelevant).
        let toks: Vec<u32> = (0..n as u64)
            .map(|i| ((i * 7919 + 13) % vocab) as u32)
            .collect();
        let mut st = self.new_state_with_ctx(n + 1)?;
        let run = self
            .eval(&mut st, &toks, Logits::Last, None)
            .and_then(|l| self.eval(&mut st, &[crate::argmax(&l)], Logits::Last, None));
        self.free_state(st);
        run.map(|_| n + 1)
    }

    /// Returns a state's buffers to the backend.
    pub fn free_state(&mut self, state: KvState) {
        state.free(self.backend.as_mut());
    }

    /// Empties a state (position 0) without reallocating.
    pub fn reset_state(&mut self, state: &mut KvState) -> Result<()> {
        self.check_state(state)?;
        state.reset(self.backend.as_mut())
    }

    pub fn snapshot(&mut self, state: &KvState) -> Result<Snapshot> {
        self.snapshot_into(state, Vec::new())
    }

    /// [`Engine::snapshot`] written into `buf`'s allocation (for instance the bytes of a
    /// snapshot being replaced, [`Snapshot::into_bytes`]): a caller that snapshots every
    /// prompt does not fault in a fresh buffer each time.
    pub fn snapshot_into(&mut self, state: &KvState, buf: Vec<u8>) -> Result<Snapshot> {
        self.check_state(state)?;
        state.snapshot(self.backend.as_mut(), buf)
    }

    /// The length in bytes of the snapshot [`Engine::snapshot`] would make of `state` now,
    /// computed without reading the device.
    pub fn snapshot_len(&self, state: &KvState) -> Result<usize> {
        self.check_state(state)?;
        Ok(state.snapshot_len())
    }

    pub fn restore(&mut self, state: &mut KvState, snap: &Snapshot) -> Result<()> {
        self.check_state(state)?;
        state.restore(self.backend.as_mut(), snap)
    }

    fn check_state(&self, state: &KvState) -> Result<()> {
        if state.fingerprint != self.fingerprint {
            return Err(EngineError::Config(
                "this KV state belongs to another engine".into(),
            ));
        }
        Ok(())
    }

    /// What streaming routed experts has done so far (`None`: experts are resident).
    pub fn expert_stats(&self) -> Option<StreamStats> {
        self.stream.as_ref().map(ExpertStream::stats)
    }

    /// Starts counting which experts every forward call routes to, from zero
    /// ([`RouteCensus`]; `on = false` stops and drops the counts). Each layer's ids are read
    /// back to the host while it is on, so calls are slower: measure speed with it off.
    pub fn set_route_census(&mut self, on: bool) {
        self.census = on.then(|| {
            let hp = &self.spec.hparams;
            RouteCensus::new(hp.n_layer, hp.n_expert)
        });
    }

    /// The counts since [`Engine::set_route_census`] turned the census on.
    pub fn route_census(&self) -> Option<&RouteCensus> {
        self.census.as_ref()
    }

    /// Zeroes the streaming counters (the cache keeps its contents).
    pub fn reset_expert_stats(&mut self) {
        if let Some(s) = self.stream.as_mut() {
            s.reset_stats();
        }
    }

    /// The backend, for instrumentation ([`Backend::counters`], profiling).
    /// The backend's launch and host-wait counters ([`crate::Counters`]).
    pub fn counters(&self) -> crate::Counters {
        self.backend.counters()
    }

    pub fn backend_mut(&mut self) -> &mut dyn Backend {
        self.backend.as_mut()
    }

    /// The backend and the verify steps' undo area (crate::speculate).
    pub(crate) fn undo_parts(&mut self) -> (&mut dyn Backend, &mut crate::speculate::UndoArea) {
        (self.backend.as_mut(), &mut self.undo)
    }

    /// [`Engine::eval_into`] with every chunk of `tokens` evaluated as decode rows, whatever
    /// [`Engine::set_short_prefill_rows`] says (a verify step's rows must get the bits of
    /// one-token decodes).
    pub(crate) fn eval_decode_rows(
        &mut self,
        state: &mut KvState,
        tokens: &[u32],
        want: Logits,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let short = self.short_rows;
        self.short_rows = usize::MAX;
        let r = self.eval_inner(state, tokens, want, None, Some(out));
        self.short_rows = short;
        r
    }

    /// Runs `tokens` like [`Engine::eval`] and returns only the greedy next token (the
    /// argmax of the last logits row, computed by the backend: one integer crosses back
    /// instead of the vocabulary-sized row).
    pub fn eval_argmax(&mut self, state: &mut KvState, tokens: &[u32]) -> Result<u32> {
        self.eval_inner(state, tokens, Logits::Last, None, None)?;
        let s = self.scratch.as_ref().expect("eval allocated the scratch");
        let mut id = [0i32];
        let (logits, out) = (s.logits.rows(0, 1, self.spec.hparams.n_vocab), s.argmax);
        self.backend.argmax(logits, out)?;
        self.backend.download_i32(out, 0, &mut id)?;
        Ok(id[0] as u32)
    }

    /// Times one decode step of `state` as a device graph (docs/gpu.md §18): decodes
    /// `token` once as usual (so every scratch buffer exists at this size), records a second
    /// step's launches into a graph and replays that graph `replays` times. `None` where
    /// the backend records no graphs. A measurement probe, not a decode: the replays write
    /// the same position again and again, and the state has advanced by two tokens whose
    /// rows hold whatever the replays left, so the state should be reset afterwards.
    pub fn probe_graph(
        &mut self,
        state: &mut KvState,
        token: u32,
        replays: usize,
    ) -> Result<Option<crate::backend::GraphTiming>> {
        self.eval_inner(state, &[token], Logits::Last, None, None)?;
        if !self.backend.begin_capture()? {
            return Ok(None);
        }
        let recorded = self.eval_inner(state, &[token], Logits::Last, None, None);
        let timing = self
            .backend
            .end_capture_replay(if recorded.is_ok() { replays } else { 0 });
        recorded?;
        Ok(Some(timing?))
    }

    /// Runs `tokens` like [`Engine::eval`] and returns the sampling band of the last logits
    /// row ([`crate::sampler::LogitBand`]: the values within `span` of its maximum, index
    /// `exclude` masked), computed by the backend: a min-p sampler reads back a few hundred
    /// bytes instead of the row. If the band is short for the draw, the row is still in the
    /// scratch: [`Engine::last_logits_into`].
    pub fn eval_band(
        &mut self,
        state: &mut KvState,
        tokens: &[u32],
        span: f32,
        exclude: Option<u32>,
    ) -> Result<crate::sampler::LogitBand> {
        self.eval_inner(state, tokens, Logits::Last, None, None)?;
        let s = self.scratch.as_ref().expect("eval allocated the scratch");
        let (logits, out) = (s.logits.rows(0, 1, self.spec.hparams.n_vocab), s.band);
        self.backend.logit_band(logits, span, exclude, out)?;
        self.read_band(out)
    }

    /// The band a [`Backend::logit_band`] wrote into `out`: the header and the first items,
    /// then the rest if there are more (at most the capacity).
    fn read_band(&mut self, out: IBuf) -> Result<crate::sampler::LogitBand> {
        use crate::sampler::{LogitBand, BAND_CAP, BAND_FIRST_READ, BAND_HEAD};
        let mut words = vec![0i32; BAND_HEAD + 2 * BAND_FIRST_READ];
        self.backend.download_i32(out, 0, &mut words)?;
        let count = usize::try_from(words[2]).unwrap_or(0);
        if count > BAND_FIRST_READ && count <= BAND_CAP {
            let have = words.len();
            words.resize(BAND_HEAD + 2 * count, 0);
            self.backend.download_i32(out, have, &mut words[have..])?;
        }
        LogitBand::from_words(&words).ok_or_else(|| {
            EngineError::Backend(crate::backend::BackendError::Invalid {
                op: "logit_band",
                problem: format!("the backend wrote a band header with count {}", words[2]),
            })
        })
    }

    /// The logits row the last [`Engine::eval_band`] or [`Engine::eval_argmax`] left in
    /// the scratch, into `out` (cleared first).
    pub fn last_logits_into(&mut self, out: &mut Vec<f32>) -> Result<()> {
        self.batch_row_into(0, out)
    }

    /// Row `row` of the logits a batched step left in the scratch ([`Engine::eval_batch_bands`]),
    /// into `out` (cleared first).
    pub fn batch_row_into(&mut self, row: usize, out: &mut Vec<f32>) -> Result<()> {
        self.batch_rows_into(row, 1, out)
    }

    /// Rows `first .. first + n` of the last evaluation's logits, one after another into
    /// `out` (`n · n_vocab` values): several rows of a batched step in one read-back
    /// instead of a wait per row.
    pub fn batch_rows_into(&mut self, first: usize, n: usize, out: &mut Vec<f32>) -> Result<()> {
        let v = self.spec.hparams.n_vocab;
        let s = self.scratch.as_ref().ok_or(EngineError::Empty)?;
        if first.checked_add(n).is_none_or(|end| end > s.logit_rows) {
            return Err(EngineError::Config(format!(
                "logits rows {first}..{first}+{n} of a scratch of {} rows",
                s.logit_rows
            )));
        }
        out.clear();
        out.resize(n * v, 0.0);
        self.backend.download(s.logits.rows(first, n, v), out)?;
        Ok(())
    }

    /// [`Engine::eval_batch`] that leaves the rows on the device: for each state given a
    /// span, the band of its row within `span` of the maximum (as [`Engine::eval_band`]:
    /// a sampler whose draw needs only that reads back a few hundred bytes instead of the
    /// 517 KB row); a state without a span gets its whole row. The rows stay in the
    /// scratch until the next evaluation ([`Engine::batch_row_into`] fetches one when a
    /// band is short). The same forward pass as [`Engine::eval_batch`], so the same rows.
    pub fn eval_batch_bands(
        &mut self,
        states: &mut [&mut KvState],
        tokens: &[u32],
        spans: &[Option<f32>],
    ) -> Result<Vec<BatchRow>> {
        if spans.len() != states.len() {
            return Err(EngineError::Config(format!(
                "{} band spans for {} states",
                spans.len(),
                states.len()
            )));
        }
        self.eval_batch_inner(states, tokens)?;
        let v = self.spec.hparams.n_vocab;
        let s = self.scratch.as_ref().expect("eval allocated the scratch");
        // Every band queued first (one buffer per row while they last), then read back.
        let (logits, bands, band) = (s.logits, s.bands.clone(), s.band);
        let out_of = |j: usize| bands.get(j).copied();
        let jobs: Vec<BandJob> = spans
            .iter()
            .enumerate()
            .filter_map(|(j, span)| {
                Some(BandJob {
                    row: j,
                    span: (*span)?,
                    out: out_of(j)?,
                })
            })
            .collect();
        if !jobs.is_empty() {
            self.backend
                .logit_bands(logits.rows(0, states.len(), v), v, &jobs)?;
        }
        let mut rows = Vec::with_capacity(spans.len());
        for (j, span) in spans.iter().enumerate() {
            rows.push(match (span, out_of(j)) {
                (Some(_), Some(out)) => BatchRow::Band(self.read_band(out)?),
                (Some(span), None) => {
                    // Beyond the per-row buffers: one row at a time through the scratch's.
                    self.backend
                        .logit_band(logits.rows(j, 1, v), *span, None, band)?;
                    BatchRow::Band(self.read_band(band)?)
                }
                (None, _) => {
                    let mut row = Vec::new();
                    self.batch_row_into(j, &mut row)?;
                    BatchRow::Row(row)
                }
            });
        }
        Ok(rows)
    }

    /// One batched decode step: token `tokens[i]` appended to `states[i]` for every `i`, in
    /// one forward pass (weights read once for all rows); returns one logits row per state,
    /// `[states, n_vocab]`. Each state's row equals what [`Engine::eval`] of its token
    /// alone would give (the backend applies the decode-row numerics per row:
    /// [`crate::Backend::set_decode_rows`]). At most `config.prefill_chunk` states.
    pub fn eval_batch(&mut self, states: &mut [&mut KvState], tokens: &[u32]) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.eval_batch_inner(states, tokens)?;
        let n = states.len();
        let v = self.spec.hparams.n_vocab;
        let s = self.scratch.as_ref().expect("eval allocated the scratch");
        out.resize(n * v, 0.0);
        self.backend.download(s.logits.rows(0, n, v), &mut out)?;
        Ok(out)
    }

    fn eval_batch_inner(&mut self, states: &mut [&mut KvState], tokens: &[u32]) -> Result<()> {
        let n = states.len();
        if n == 0 || tokens.len() != n {
            return Err(EngineError::Config(format!(
                "a batched decode step needs one token per state ({} states, {} tokens)",
                n,
                tokens.len()
            )));
        }
        let cap = self.config.prefill_chunk;
        if n > cap {
            return Err(EngineError::Config(format!(
                "a batched decode step of {n} states exceeds the chunk size {cap}"
            )));
        }
        let pieces: Vec<&[u32]> = tokens.chunks(1).collect();
        self.backend.set_decode_rows(n)?;
        let r = self.forward_pieces(states, &pieces);
        let reset = self.backend.set_decode_rows(1);
        r?;
        Ok(reset?)
    }

    /// Runs `pieces[i]` after `states[i]` for every `i` as one forward call leaving each
    /// state's last logits row in row `i` of the scratch, after checking every state, that
    /// every token is in the vocabulary (`index`: its row in the call) and that every piece
    /// fits its state's context; a refused call changes nothing.
    fn forward_pieces(&mut self, states: &mut [&mut KvState], pieces: &[&[u32]]) -> Result<()> {
        let n_vocab = self.spec.hparams.n_vocab;
        let mut row = 0;
        for (st, piece) in states.iter().zip(pieces) {
            self.check_state(st)?;
            if let Some((j, &token)) = piece
                .iter()
                .enumerate()
                .find(|(_, &t)| t as usize >= n_vocab)
            {
                return Err(EngineError::BadToken {
                    token,
                    index: row + j,
                    n_vocab,
                });
            }
            if piece.len() > st.ctx - st.pos() {
                return Err(EngineError::ContextFull {
                    pos: st.pos(),
                    adding: piece.len(),
                    ctx: st.ctx,
                });
            }
            row += piece.len();
        }
        self.ensure_scratch(states.len())?;
        let scratch = self.scratch.as_ref().expect("scratch allocated above");
        let mut model = Model {
            hp: &self.spec.hparams,
            w: &self.weights,
            mode: self.mode,
            stream: self.stream.as_mut(),
            census: self.census.as_mut(),
            streams_in: false,
        };
        let mut seqs: Vec<Seq> = states
            .iter_mut()
            .zip(pieces)
            .map(|(st, tokens)| Seq { state: st, tokens })
            .collect();
        forward(
            self.backend.as_mut(),
            &mut model,
            scratch,
            &mut seqs,
            Want::Last,
        )
    }

    /// [`Engine::eval_batch`] returning only each state's greedy next token, read back as a
    /// span-0 band per row (a few bytes instead of the 517 KB row).
    pub fn eval_batch_argmax(
        &mut self,
        states: &mut [&mut KvState],
        tokens: &[u32],
    ) -> Result<Vec<u32>> {
        // Span-0 bands (as the server's greedy slots take them): the first item equal to
        // the maximum is `argmax`'s first maximum; any other case reads the row.
        let spans = vec![Some(0.0); states.len()];
        let rows = self.eval_batch_bands(states, tokens, &spans)?;
        let mut out = Vec::with_capacity(rows.len());
        let mut row = Vec::new();
        for (j, r) in rows.into_iter().enumerate() {
            let first = match &r {
                BatchRow::Band(b) if b.max.is_finite() => b
                    .items
                    .first()
                    .filter(|&&(_, v)| v == b.max)
                    .map(|&(i, _)| i),
                _ => None,
            };
            out.push(match (first, r) {
                (Some(i), _) => i,
                (None, BatchRow::Row(v)) => crate::argmax(&v),
                (None, BatchRow::Band(_)) => {
                    self.batch_row_into(j, &mut row)?;
                    crate::argmax(&row)
                }
            });
        }
        Ok(out)
    }

    /// The fewest tokens a prompt piece must have to join a joint prefill
    /// ([`Engine::eval_joint`]); `None`: this engine runs pieces one at a time (the backend
    /// cannot keep a row's routed-expert bits in a joint call, or experts are streamed).
    /// Above the short-chunk rule ([`Engine::set_short_prefill_rows`]), whose pieces run
    /// as decode rows.
    pub fn joint_min_rows(&self) -> Option<usize> {
        if self.stream.is_some() {
            return None;
        }
        let k = self.spec.hparams.n_expert_used;
        let mut need = self.short_rows.saturating_add(1).max(2);
        for lw in &self.weights.layers {
            let n = self
                .backend
                .moe_joint_min_rows(lw.gate_exps, lw.up_exps, lw.down_exps, k)?;
            need = need.max(n);
        }
        Some(need)
    }

    /// Evaluates several prompts' pieces in one forward pass (docs/forward.md §14):
    /// `pieces[i]` appended to `states[i]`. Each piece's dense ops run on its rows alone
    /// and the routed experts once over all rows, so every state ends as
    /// [`Engine::eval`] of its piece alone would leave it, bit for bit; each state's last
    /// logits row is then row `i` of the scratch ([`Engine::batch_row_into`]). Every
    /// piece must have at least [`Engine::joint_min_rows`] tokens, and all of them at
    /// most `config.prefill_chunk` together.
    pub fn eval_joint(&mut self, states: &mut [&mut KvState], pieces: &[&[u32]]) -> Result<()> {
        let n = states.len();
        if n == 0 || pieces.len() != n {
            return Err(EngineError::Config(format!(
                "a joint prefill needs one piece per state ({} states, {} pieces)",
                n,
                pieces.len()
            )));
        }
        let min = self.joint_min_rows().ok_or_else(|| {
            EngineError::Config("this engine cannot run prompt pieces jointly".into())
        })?;
        let total: usize = pieces.iter().map(|p| p.len()).sum();
        let cap = self.config.prefill_chunk;
        if total > cap {
            return Err(EngineError::Config(format!(
                "a joint prefill of {total} tokens exceeds the chunk size {cap}"
            )));
        }
        if let Some(short) = pieces.iter().find(|p| p.len() < min) {
            return Err(EngineError::Config(format!(
                "a piece of {} tokens joins no joint prefill (at least {min})",
                short.len()
            )));
        }
        self.forward_pieces(states, pieces)
    }

    /// Scratch for chunks of `config.prefill_chunk` tokens with at least `logit_rows`
    /// logits rows.
    fn ensure_scratch(&mut self, logit_rows: usize) -> Result<()> {
        let need_new = match &self.scratch {
            Some(s) => s.logit_rows < logit_rows,
            None => true,
        };
        if need_new {
            if let Some(old) = self.scratch.take() {
                old.free(self.backend.as_mut());
            }
            let cap = self.config.prefill_chunk;
            let s = Scratch::new(self.backend.as_mut(), &self.spec.hparams, cap, logit_rows)?;
            self.scratch = Some(s);
        }
        Ok(())
    }

    /// Runs `tokens` (appended after the state's current position) in chunks of
    /// `config.prefill_chunk`, and returns the requested logits. `progress(done, total)` is
    /// called after every chunk.
    pub fn eval(
        &mut self,
        state: &mut KvState,
        tokens: &[u32],
        want: Logits,
        progress: Option<&mut dyn FnMut(usize, usize)>,
    ) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.eval_into(state, tokens, want, progress, &mut out)?;
        Ok(out)
    }

    /// [`Engine::eval`] into `out` (cleared first), so a decode loop reuses one logits
    /// buffer instead of allocating a vocabulary-sized vector per token.
    pub fn eval_into(
        &mut self,
        state: &mut KvState,
        tokens: &[u32],
        want: Logits,
        progress: Option<&mut dyn FnMut(usize, usize)>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.eval_inner(state, tokens, want, progress, Some(out))
    }

    /// [`Engine::eval_into`]; with `out = None` the last logits stay in the scratch
    /// (nothing is copied back: [`Engine::eval_argmax`]).
    fn eval_inner(
        &mut self,
        state: &mut KvState,
        tokens: &[u32],
        want: Logits,
        mut progress: Option<&mut dyn FnMut(usize, usize)>,
        mut out: Option<&mut Vec<f32>>,
    ) -> Result<()> {
        if let Some(o) = out.as_deref_mut() {
            o.clear();
        }
        self.check_state(state)?;
        if tokens.is_empty() {
            return Err(EngineError::Empty);
        }
        let hp = &self.spec.hparams;
        let n_vocab = hp.n_vocab;
        if let Some((index, &token)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= n_vocab)
        {
            return Err(EngineError::BadToken {
                token,
                index,
                n_vocab,
            });
        }
        let pos = state.pos();
        if tokens.len() > state.ctx - pos {
            return Err(EngineError::ContextFull {
                pos,
                adding: tokens.len(),
                ctx: state.ctx,
            });
        }
        let cap = self.config.prefill_chunk;
        let logit_rows = if want == Logits::All { cap } else { 1 };
        self.ensure_scratch(logit_rows)?;
        let hp = &self.spec.hparams;
        let scratch = self.scratch.as_ref().expect("scratch allocated above");
        let mut model = Model {
            hp,
            w: &self.weights,
            mode: self.mode,
            stream: self.stream.as_mut(),
            census: self.census.as_mut(),
            streams_in: false,
        };
        let n_chunks = tokens.len().div_ceil(cap);
        for (ci, chunk) in tokens.chunks(cap).enumerate() {
            let last = ci + 1 == n_chunks;
            let w = match want {
                Logits::All => Want::All,
                Logits::Last if last => Want::Last,
                _ => Want::None,
            };
            // A short chunk as decode rows (Engine::set_short_prefill_rows).
            let short = chunk.len() > 1
                && chunk.len() <= self.short_rows
                && self.backend.set_decode_rows(chunk.len()).is_ok();
            let pos0 = state.pos();
            let r = forward_chunk(self.backend.as_mut(), &mut model, scratch, state, chunk, w);
            if short {
                let reset = self.backend.set_decode_rows(1);
                r?;
                reset?;
            } else {
                r?;
            }
            if let Some(mtp) = self.mtp.as_mut() {
                let be = self.backend.as_mut();
                mtp.record(be, scratch.x, pos0, chunk.len(), state.tokens())?;
            }
            let rows = match w {
                Want::None => 0,
                Want::Last => 1,
                Want::All => chunk.len(),
            };
            if let (true, Some(out)) = (rows > 0, out.as_deref_mut()) {
                let start = out.len();
                out.resize(start + rows * n_vocab, 0.0);
                self.backend
                    .download(scratch.logits.rows(0, rows, n_vocab), &mut out[start..])?;
            }
            if let Some(p) = progress.as_mut() {
                p((ci * cap + chunk.len()).min(tokens.len()), tokens.len());
            }
        }
        Ok(())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.undo.free(self.backend.as_mut());
        if let Some(m) = self.mtp.take() {
            m.free(self.backend.as_mut());
        }
        if let Some(s) = self.scratch.take() {
            s.free(self.backend.as_mut());
        }
        if let Some(st) = self.stream.as_mut() {
            st.free(self.backend.as_mut());
        }
    }
}

/// Refuses dims the forward pass cannot run, naming them (beyond what `ds4-model` checks).
fn check_supported(hp: &HParams) -> Result<()> {
    let mut bad = Vec::new();
    if hp.hc_mult == 0 || hp.n_embd == 0 || hp.head_dim == 0 {
        bad.push("zero-sized hidden/head dims".to_string());
    }
    if hp.o_groups == 0 || !hp.n_head.is_multiple_of(hp.o_groups) {
        bad.push(format!(
            "{} heads do not split into {} output groups",
            hp.n_head, hp.o_groups
        ));
    }
    for (il, &r) in hp.compress_ratios.iter().enumerate() {
        if r == 4 && (hp.indexer_heads == 0 || hp.indexer_head_dim < hp.rope_dim) {
            bad.push(format!(
                "layer {il}: CSA needs indexer heads of >= rope dims"
            ));
        }
    }
    if hp.sliding_window == 0 {
        bad.push("sliding window is 0".into());
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(EngineError::Config(bad.join("; ")))
    }
}
