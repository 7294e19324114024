//! Loading a model for serving: the engine on a backend (the CPU by default; the binary
//! passes the one `--backend` chose, placed by the planner), the tokenizer from the GGUF's
//! `tokenizer.ggml.*` tables, and the model identity that keys the disk KV cache.

use std::path::Path;
use std::sync::Arc;

use ds4_chat::Tokenizer;
use ds4_engine::{Engine, EngineConfig, NumericMode};
use ds4_gguf::{GgufFile, Header, Value};

use crate::error::ServerError;

/// How to load the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelOptions {
    /// Context size of the one session (allocated once).
    pub ctx: usize,
    /// CPU threads (0 = one per core).
    pub threads: usize,
    pub prefill_chunk: usize,
    /// `None`: the engine's default for the model.
    pub mode: Option<NumericMode>,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            ctx: 32768,
            threads: 0,
            prefill_chunk: 128,
            mode: None,
        }
    }
}

/// A model ready to serve.
pub struct LoadedModel {
    pub engine: Engine,
    pub tokenizer: Arc<Tokenizer>,
    /// SHA-256 of the GGUF metadata + tensor table (disk cache entries of other files are
    /// never restored).
    pub identity: [u8; 32],
    /// `general.name`, for logs.
    pub name: String,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("name", &self.name)
            .field("engine", &self.engine)
            .finish()
    }
}

impl LoadedModel {
    /// Opens `path`, builds the tokenizer and loads the weights onto a CPU backend.
    pub fn open(path: &Path, opts: &ModelOptions) -> Result<LoadedModel, ServerError> {
        let backend = ds4_cpu::CpuBackend::new(opts.threads)
            .map_err(|e| ServerError::Model(format!("CPU backend: {e}")))?;
        Self::open_with_backend(path, opts, Box::new(backend))
    }

    /// Opens `path`, builds the tokenizer and loads the weights onto `backend` (a GPU
    /// backend built with its placement plan, or the CPU).
    pub fn open_with_backend(
        path: &Path,
        opts: &ModelOptions,
        backend: Box<dyn ds4_engine::Backend>,
    ) -> Result<LoadedModel, ServerError> {
        let file = GgufFile::open(path)
            .map_err(|e| ServerError::Model(format!("{}: {e}", path.display())))?;
        let header = file.header().clone();
        let tokenizer = tokenizer_from_header(&header)?;
        let config = EngineConfig {
            mode: opts.mode,
            ctx: opts.ctx,
            prefill_chunk: opts.prefill_chunk,
        };
        let engine = Engine::load(Arc::new(file), backend, config)?;
        if engine.hparams().n_vocab != tokenizer.vocab_size() {
            return Err(ServerError::Model(format!(
                "the tokenizer has {} tokens but the model's vocabulary is {}",
                tokenizer.vocab_size(),
                engine.hparams().n_vocab
            )));
        }
        let name = header
            .get("general.name")
            .and_then(Value::as_str)
            .unwrap_or("unnamed")
            .to_string();
        Ok(LoadedModel {
            engine,
            tokenizer: Arc::new(tokenizer),
            identity: model_identity(&header),
            name,
        })
    }
}

/// The model's tokenizer (built by `ds4_chat::Tokenizer::from_gguf_header`).
pub fn tokenizer_from_header(h: &Header) -> Result<Tokenizer, ServerError> {
    Ok(Tokenizer::from_gguf_header(h)?)
}

/// The model's identity for disk checkpoints: the same one the `ds4` CLI uses
/// (`ds4_kvstore::header_identity`), so sessions move between them.
pub fn model_identity(h: &Header) -> [u8; 32] {
    ds4_kvstore::header_identity(h)
        .unwrap_or_else(|_| ds4_kvstore::model_identity(b"unencodable header"))
}
