//! Why loading or planning a model failed. A library error type (the binaries wrap it in
//! `anyhow`): each variant names what it was about — the file, the device, the machine
//! file, the override, the plan — and keeps the lower layer's error as its `source`, so a
//! binary printing the chain shows both the step and the cause.

use std::path::PathBuf;

use thiserror::Error;

/// An error of [`crate::load`] or [`crate::plan`].
#[derive(Debug, Error)]
pub enum LoadError {
    /// The model file does not exist (the message says what file is wanted and where one
    /// comes from).
    #[error("{}", crate::load::missing_model_message(.0))]
    MissingModel(PathBuf),
    #[error("cannot read {}", .path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: ds4_gguf::GgufError,
    },
    #[error("{} is not a model ds4-rs can run", .path.display())]
    NotAModel {
        path: PathBuf,
        #[source]
        source: ds4_model::ModelError,
    },
    #[error("building the tokenizer (no usable vocabulary)")]
    Tokenizer(#[source] ds4_chat::ChatError),
    #[error("{}: the tokenizer has {tokenizer} tokens but the model's vocabulary is {model}", .path.display())]
    VocabMismatch {
        path: PathBuf,
        tokenizer: usize,
        model: usize,
    },
    #[error("encoding the model header (its identity for disk sessions)")]
    Identity(#[source] ds4_gguf::GgufError),
    #[error("--draft mtp needs the MTP block: {} has no mtp.0.* tensors; give its file with --mtp FILE (ds4-convert writes it as OUT-mtp.gguf)", .0.display())]
    NoMtp(PathBuf),
    #[error("{} holds no MTP block (no mtp.* tensors): give the MTP file ds4-convert writes as OUT-mtp.gguf", .0.display())]
    NotAnMtpFile(PathBuf),
    #[error("the context must be at least 1 token")]
    ZeroContext,
    #[error("starting the CPU backend")]
    Cpu(#[source] ds4_engine::BackendError),
    /// A GPU runtime step failed; `step` says which ("starting the CUDA backend", ...).
    #[error("{step}")]
    Gpu {
        step: &'static str,
        #[source]
        source: ds4_gpu::GpuError,
    },
    #[error("selecting the activation precision")]
    ActivationPrecision(#[source] ds4_engine::BackendError),
    #[error("invalid placement override")]
    Override(#[source] ds4_placement::request::OverrideError),
    #[error("cannot read machine file {}", .path.display())]
    MachineFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("machine file {} is not valid", .path.display())]
    MachineInvalid {
        path: PathBuf,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("reading this machine's memory facts")]
    HostFacts(#[source] ds4_placement::probe::ProbeError),
    /// The planner refused: the model does not fit this machine under the request (the
    /// refusal names the shortfall and the flag that would change it).
    #[error("placement refused for {what}: {refusal}{}", states_note(*.states, *.fewer_states))]
    Refused {
        what: String,
        refusal: Box<ds4_placement::Refusal>,
        /// KV states of the context asked for (the server's `--parallel`).
        states: u64,
        /// The most states of that context that fit, when more than one was asked for
        /// ([`crate::plan::Planned::fewer_states`]).
        fewer_states: Option<u64>,
    },
    #[error("cannot load {}", .path.display())]
    Engine {
        path: PathBuf,
        #[source]
        source: ds4_engine::EngineError,
    },
    #[error("writing the load report")]
    Report(#[from] std::io::Error),
}

/// An error and its causes on one line ("step: cause: cause"), for logs and for the
/// binaries' `error:` line. A cause whose text the line already ends with is not repeated:
/// many library errors spell out their `source` in their own message as well as chaining
/// it, and a user should read "No such file or directory" once.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let text = c.to_string();
        if !text.is_empty() && !s.ends_with(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cur = c.source();
    }
    s
}

/// What a refusal of several KV states adds: how many of them the machine does fit at that
/// context, so the server's `--parallel` is corrected in one step (empty for one state).
fn states_note(states: u64, fewer: Option<u64>) -> String {
    match (states, fewer) {
        (0 | 1, _) => String::new(),
        (n, Some(m)) => format!(
            "\n{n} KV states of this context do not fit; {m} do (--parallel {m}), or keep {n} at a smaller context"
        ),
        (n, None) => format!("\n{n} KV states of this context do not fit, nor does one"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chain_names_the_step_and_the_cause() {
        let e = LoadError::MachineFile {
            path: PathBuf::from("box.json"),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
        };
        assert_eq!(
            error_chain(&e),
            "cannot read machine file box.json: no such file"
        );
        // A cause the message already spells out is printed once.
        let e = LoadError::Read {
            path: PathBuf::from("m.gguf"),
            source: ds4_gguf::GgufError::Open {
                path: PathBuf::from("m.gguf"),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
            },
        };
        assert_eq!(
            error_chain(&e),
            "cannot read m.gguf: cannot open m.gguf: no such file"
        );
        let e = LoadError::MissingModel(PathBuf::from("m.gguf"));
        assert!(
            e.to_string().starts_with("model file m.gguf not found"),
            "{e}"
        );
    }
}
