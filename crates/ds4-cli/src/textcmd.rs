//! `ds4 tokenize`, `ds4 detokenize` and `ds4 render`: text ↔ token ids and chat prompt
//! rendering with a model's own tokenizer, without loading any weights.
//!
//! These are the hooks external checks use to compare ds4-rs with other implementations (HF
//! `tokenizers`, the C ds4, the official API's token counts), so their input and output formats
//! are a stable, documented interface (README "Tokenize / render"). Only the GGUF header is
//! read — the `tokenizer.ggml.*` arrays — so a vocabulary-only GGUF works as well as a model.
//!
//! Bad input (malformed JSON, an unknown role, an id that is not a number or lies outside the
//! vocabulary, a file that is not UTF-8) is an error that names the problem; nothing here panics.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use ds4_chat::render::{self, Message, ThinkingMode};
use ds4_chat::request::{self, ChatRequest};
use ds4_chat::{SpecialTokens, Tokenizer};

/// `--special`: which added-token strings in the text become single tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum SpecialChoice {
    /// Every added token of the vocabulary, leftmost-longest: what HF `tokenizers`
    /// `encode(text)` does with the V4 tokenizer.json.
    #[default]
    All,
    /// Only ds4's seven chat markers (BOS, EOS, User, Assistant, `<think>`, `</think>`,
    /// `｜DSML｜`): how ds4 tokenizes a rendered prompt.
    Chat,
    /// None: special strings are ordinary text (ds4's plain-text tokenization).
    None,
}

impl From<SpecialChoice> for SpecialTokens {
    fn from(c: SpecialChoice) -> SpecialTokens {
        match c {
            SpecialChoice::All => SpecialTokens::All,
            SpecialChoice::Chat => SpecialTokens::ChatMarkers,
            SpecialChoice::None => SpecialTokens::None,
        }
    }
}

/// Where `ds4 tokenize` reads its text: exactly one of the two.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "tokenize_input", required = true, multiple = false)]
pub struct TextInput {
    /// The text to tokenize, byte for byte (no newline is added or removed).
    #[arg(long)]
    pub text: Option<String>,
    /// A UTF-8 file to tokenize, byte for byte; `-` reads standard input.
    #[arg(long)]
    pub file: Option<PathBuf>,
}

/// `ds4 tokenize -m MODEL (--text T | --file F) [--special all|chat|none] [--json]`.
#[derive(Debug, Clone, clap::Args)]
pub struct TokenizeArgs {
    /// The GGUF whose tokenizer is used (a vocabulary-only GGUF is enough).
    #[arg(short, long)]
    pub model: PathBuf,
    #[command(flatten)]
    pub input: TextInput,
    /// Which added-token strings become single tokens.
    #[arg(long, value_enum, default_value = "all")]
    pub special: SpecialChoice,
    /// Print `{"count":N,"ids":[…]}` instead of comma-separated ids.
    #[arg(long)]
    pub json: bool,
}

/// Where `ds4 detokenize` reads its ids: exactly one of the two.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "detokenize_input", required = true, multiple = false)]
pub struct IdsInput {
    /// Token ids, e.g. "0,128803,23166" (or separated by whitespace; `[…]` brackets allowed).
    #[arg(long, allow_hyphen_values = true)]
    pub ids: Option<String>,
    /// A file of ids in the same format, or the `--json` output of `ds4 tokenize`; `-` reads
    /// standard input.
    #[arg(long)]
    pub file: Option<PathBuf>,
}

/// `ds4 detokenize -m MODEL (--ids LIST | --file F) [--json]`.
#[derive(Debug, Clone, clap::Args)]
pub struct DetokenizeArgs {
    /// The GGUF whose tokenizer is used (a vocabulary-only GGUF is enough).
    #[arg(short, long)]
    pub model: PathBuf,
    #[command(flatten)]
    pub input: IdsInput,
    /// Print `{"bytes":N,"text":"…","valid_utf8":B}` instead of the raw bytes.
    #[arg(long)]
    pub json: bool,
}

/// `--think` / `--think-max` / `--nothink` of `ds4 render` (at most one).
#[derive(Debug, Clone, Copy, Default, clap::Args)]
#[group(id = "render_thinking", multiple = false)]
pub struct RenderThinkFlags {
    /// Thinking, normal effort: the prompt ends with `<think>` (the default).
    #[arg(long)]
    pub think: bool,
    /// Think Max: the Max preamble after BOS, prompt ends with `<think>` (rendered as asked:
    /// the server's rule that downgrades it below a 393216-token context is not applied).
    #[arg(long)]
    pub think_max: bool,
    /// No thinking: the prompt ends with `</think>` and earlier reasoning is dropped.
    #[arg(long)]
    pub nothink: bool,
}

impl RenderThinkFlags {
    /// The mode the flags ask for; `None` when no flag was given.
    pub fn mode(&self) -> Option<ThinkingMode> {
        if self.nothink {
            Some(ThinkingMode::NoThink)
        } else if self.think_max {
            Some(ThinkingMode::ThinkMax)
        } else if self.think {
            Some(ThinkingMode::Think)
        } else {
            None
        }
    }
}

/// `ds4 render -m MODEL --messages FILE.json [--tools FILE.json] [--think|--think-max|--nothink]
/// [--tokens] [--json]`.
#[derive(Debug, Clone, clap::Args)]
pub struct RenderArgs {
    /// The GGUF whose tokenizer is used for `--tokens` (a vocabulary-only GGUF is enough).
    #[arg(short, long)]
    pub model: PathBuf,
    /// An OpenAI `messages` array, or a whole `/v1/chat/completions` request object (then its
    /// `tools`, `tool_choice` and thinking controls apply too); `-` reads standard input.
    #[arg(long)]
    pub messages: PathBuf,
    /// An OpenAI `tools` array (schema lines are copied from its bytes).
    #[arg(long)]
    pub tools: Option<PathBuf>,
    #[command(flatten)]
    pub thinking: RenderThinkFlags,
    /// Print the prompt's token ids (ds4's rendered-chat tokenization) instead of its bytes.
    #[arg(long)]
    pub tokens: bool,
    /// JSON output: `{"bytes":N,"prompt":"…"}`, or `{"count":N,"ids":[…]}` with `--tokens`.
    #[arg(long)]
    pub json: bool,
}

/// Reads a whole file, `-` being standard input.
fn read_input(path: &Path) -> anyhow::Result<Vec<u8>> {
    if path == Path::new("-") {
        let mut buf = Vec::new();
        std::io::stdin()
            .lock()
            .read_to_end(&mut buf)
            .context("cannot read standard input")?;
        return Ok(buf);
    }
    std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))
}

/// Checks that `bytes` are UTF-8, naming the first bad offset.
fn utf8(bytes: Vec<u8>, what: &dyn std::fmt::Display) -> anyhow::Result<String> {
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{what} is not valid UTF-8 (bad byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    })
}

/// The tokenizer of the GGUF at `model` (header only: no weights are touched).
pub fn load_tokenizer(model: &Path) -> anyhow::Result<Tokenizer> {
    let file = crate::load::open_gguf(model)?;
    crate::load::tokenizer_from_gguf(&file)
        .with_context(|| format!("{}: no usable vocabulary", model.display()))
}

/// Writes ids as one line, comma-separated, or as `{"count":N,"ids":[…]}`.
fn write_ids(out: &mut dyn Write, ids: &[u32], json: bool) -> anyhow::Result<()> {
    if json {
        let v = serde_json::json!({ "count": ids.len(), "ids": ids });
        writeln!(out, "{v}")?;
    } else {
        let mut line = String::with_capacity(ids.len() * 7 + 1);
        for (i, id) in ids.iter().enumerate() {
            if i > 0 {
                line.push(',');
            }
            line.push_str(&id.to_string());
        }
        line.push('\n');
        out.write_all(line.as_bytes())?;
    }
    Ok(())
}

/// `ds4 tokenize`: the ids of the text, one line (`1,2,3`) or JSON.
pub fn run_tokenize(args: &TokenizeArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let text = match (&args.input.text, &args.input.file) {
        (Some(t), _) => t.clone(),
        (None, Some(f)) => utf8(read_input(f)?, &f.display())?,
        (None, None) => bail!("give --text TEXT or --file FILE"),
    };
    let tok = load_tokenizer(&args.model)?;
    let ids = tok
        .encode_with(&text, args.special.into())
        .context("tokenizing")?;
    write_ids(out, &ids, args.json)?;
    out.flush()?;
    Ok(())
}

/// Parses a list of token ids: comma-separated (whitespace around entries allowed) or, with no
/// comma at all, whitespace-separated; optionally inside `[` `]` (a JSON array); or a JSON
/// object with an `ids` array (the `--json` output of `ds4 tokenize`). Blank input is no ids.
pub fn parse_ids(text: &str) -> anyhow::Result<Vec<u32>> {
    let t = text.trim();
    if t.starts_with('{') {
        let v: serde_json::Value = serde_json::from_str(t).context("the ids are not valid JSON")?;
        let Some(arr) = v.get("ids").and_then(|a| a.as_array()) else {
            bail!("the JSON object has no \"ids\" array");
        };
        return arr
            .iter()
            .enumerate()
            .map(|(i, x)| {
                x.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .with_context(|| format!("ids[{i}] = {x} is not a token id"))
            })
            .collect();
    }
    let body = match t.strip_prefix('[') {
        Some(rest) => rest
            .strip_suffix(']')
            .context("the id list opens with '[' but does not end with ']'")?,
        None => t,
    };
    if body.trim().is_empty() {
        return Ok(Vec::new());
    }
    let entries: Vec<&str> = if body.contains(',') {
        body.split(',').map(str::trim).collect()
    } else {
        body.split_whitespace().collect()
    };
    entries
        .iter()
        .enumerate()
        .map(|(i, e)| parse_id(e).with_context(|| format!("id entry {} ({e:?})", i + 1)))
        .collect()
}

fn parse_id(e: &str) -> anyhow::Result<u32> {
    if e.is_empty() {
        bail!("empty entry (two separators in a row?)");
    }
    if !e.bytes().all(|b| b.is_ascii_digit()) {
        bail!("not a token id (ids are decimal integers)");
    }
    e.parse::<u32>()
        .map_err(|_| anyhow::anyhow!("too large for a token id"))
}

/// `ds4 detokenize`: the exact bytes the ids stand for (no newline added), or JSON.
pub fn run_detokenize(args: &DetokenizeArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let ids = match (&args.input.ids, &args.input.file) {
        (Some(s), _) => parse_ids(s)?,
        (None, Some(f)) => parse_ids(&utf8(read_input(f)?, &f.display())?)
            .with_context(|| format!("reading ids from {}", f.display()))?,
        (None, None) => bail!("give --ids LIST or --file FILE"),
    };
    let tok = load_tokenizer(&args.model)?;
    let n = tok.vocab_size();
    if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= n) {
        bail!(
            "id entry {}: token id {id} is outside the vocabulary of {n} tokens",
            i + 1
        );
    }
    let bytes = tok.decode(&ids).context("decoding")?;
    if args.json {
        let (text, valid) = match std::str::from_utf8(&bytes) {
            Ok(s) => (s.to_owned(), true),
            Err(_) => (String::from_utf8_lossy(&bytes).into_owned(), false),
        };
        let v = serde_json::json!({ "bytes": bytes.len(), "text": text, "valid_utf8": valid });
        writeln!(out, "{v}")?;
    } else {
        out.write_all(&bytes)?;
    }
    out.flush()?;
    Ok(())
}

/// The roles ds4 renders; any other role would be dropped silently by the server, which in a
/// checking tool hides mistakes, so `ds4 render` refuses it.
const KNOWN_ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

/// Refuses messages with a role ds4 would drop.
fn check_roles(msgs: &[Message]) -> anyhow::Result<()> {
    for (i, m) in msgs.iter().enumerate() {
        if !KNOWN_ROLES.contains(&m.role.as_str()) {
            bail!(
                "messages[{i}]: unknown role {:?} (known: {})",
                m.role,
                KNOWN_ROLES.join(", ")
            );
        }
    }
    Ok(())
}

/// Strict JSON check first (with line and column), because ds4's own reader is lenient about
/// commas and would accept some broken files; the bytes are then read the ds4 way.
fn strict_json(text: &str, what: &str) -> anyhow::Result<serde_json::Value> {
    serde_json::from_str(text).with_context(|| format!("{what}: invalid JSON"))
}

/// Renders a prompt from the texts of a `--messages` file (an OpenAI `messages` array or a
/// whole chat request object) and an optional `--tools` file, in `mode` (the request's own
/// mode, or Think, when `None`). Exactly what the server renders for the same request, except
/// that Think Max is never downgraded for a small context.
pub fn render_json(
    messages_json: &str,
    tools_json: Option<&str>,
    mode: Option<ThinkingMode>,
) -> anyhow::Result<String> {
    let schemas = match tools_json {
        Some(t) => {
            if !strict_json(t, "tools")?.is_array() {
                bail!("tools: expected a JSON array of tools");
            }
            Some(request::tool_schemas_from_json(t)?)
        }
        None => None,
    };
    match strict_json(messages_json, "messages")? {
        serde_json::Value::Array(_) => {
            let msgs = request::messages_from_json(messages_json)?;
            check_roles(&msgs)?;
            let schemas = schemas.unwrap_or_default();
            Ok(render::render_prompt(
                &msgs,
                &schemas,
                mode.unwrap_or_default(),
            ))
        }
        serde_json::Value::Object(obj) => {
            let mut req = ChatRequest::from_openai_json(messages_json, u64::MAX)?;
            check_roles(&req.messages)?;
            if let Some(s) = schemas {
                if obj.contains_key("tools") {
                    bail!("the request in --messages has its own \"tools\"; drop --tools or them");
                }
                req.tool_schemas = s;
            }
            if let Some(m) = mode {
                req.mode = m;
            }
            Ok(req.render())
        }
        _ => bail!("messages: expected a JSON array of messages or a chat request object"),
    }
}

/// `ds4 render`: the rendered prompt's bytes (no newline added), or its ids.
pub fn run_render(args: &RenderArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let messages = utf8(read_input(&args.messages)?, &args.messages.display())?;
    let tools = match &args.tools {
        Some(p) => Some(utf8(read_input(p)?, &p.display())?),
        None => None,
    };
    let tok = load_tokenizer(&args.model)?;
    let prompt = render_json(&messages, tools.as_deref(), args.thinking.mode())?;
    if args.tokens {
        let ids = tok.encode_chat(&prompt).context("tokenizing the prompt")?;
        write_ids(out, &ids, args.json)?;
    } else if args.json {
        let v = serde_json::json!({ "bytes": prompt.len(), "prompt": prompt });
        writeln!(out, "{v}")?;
    } else {
        out.write_all(prompt.as_bytes())?;
    }
    out.flush()?;
    Ok(())
}
