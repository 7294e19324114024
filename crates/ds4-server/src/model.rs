//! The model a server serves. It is loaded by `ds4_runtime::load::load`, the function the
//! `ds4` CLI loads with (backend choice, placement plan, GPU weights by the plan, tokenizer
//! from the GGUF's own tables, the identity that keys disk checkpoints), so the two binaries
//! cannot drift apart on what a loaded model is; this module only adds the name for logs.

use std::path::Path;
use std::sync::Arc;

use ds4_chat::Tokenizer;
use ds4_engine::{Engine, NumericMode};
use ds4_gguf::Value;
use ds4_runtime::load::{BackendChoice, LoadOptions, Loaded, ModeChoice};

use crate::error::ServerError;

/// How [`LoadedModel::open`] loads the engine (on the CPU).
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
            prefill_chunk: ds4_engine::DEFAULT_PREFILL_CHUNK,
            mode: None,
        }
    }
}

impl ModelOptions {
    /// The runtime's load options for these, on `backend`.
    pub fn load_options(&self, model: &Path, backend: BackendChoice) -> LoadOptions {
        LoadOptions {
            model: model.to_path_buf(),
            backend,
            mode: self.mode.map(ModeChoice::from),
            ctx: self.ctx,
            kv_states: 1,
            prefill_chunk: self.prefill_chunk,
            threads: self.threads,
            placement: Default::default(),
            report: ds4_runtime::load::LoadReport::Quiet,
            config: ds4_runtime::config::Config::from_flags(ds4_runtime::config::ConfigFlags {
                no_warmup: true,
                ..Default::default()
            }),
        }
    }
}

/// A model ready to serve.
pub struct LoadedModel {
    pub engine: Engine,
    pub tokenizer: Arc<Tokenizer>,
    /// SHA-256 of the GGUF metadata + tensor table (disk cache entries of other files are
    /// never restored); the same identity the CLI keys its sessions with.
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

impl From<Loaded> for LoadedModel {
    fn from(l: Loaded) -> LoadedModel {
        let name = l
            .file
            .header()
            .get("general.name")
            .and_then(Value::as_str)
            .unwrap_or("unnamed")
            .to_string();
        LoadedModel {
            engine: l.engine,
            tokenizer: l.tokenizer,
            identity: l.model_id,
            name,
        }
    }
}

impl LoadedModel {
    /// Loads `path` on the CPU through the runtime's loader (tests and embedders; the
    /// binary loads with its `--backend` and placement flags).
    pub fn open(path: &Path, opts: &ModelOptions) -> Result<LoadedModel, ServerError> {
        let loaded = ds4_runtime::load::load(
            &opts.load_options(path, BackendChoice::Cpu),
            &mut std::io::sink(),
        )
        .map_err(|e| ServerError::Model(ds4_runtime::error_chain(&e)))?;
        Ok(loaded.into())
    }
}
