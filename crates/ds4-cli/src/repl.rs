//! `ds4` with no prompt: the interactive multi-turn chat.
//!
//! The transcript is token-level (docs/chat.md §2.7): BOS + [MAX_PREFIX] + [system], then
//! per turn User + BPE(text) + Assistant + think tag + every sampled token + EOS. Earlier
//! reasoning stays in it (unlike the server), so each turn extends the live KV state and
//! only the new tokens are prefilled. stdout carries only what the model writes; prompts,
//! command output and status lines go to stderr.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use ds4_chat::render::{cli_turn_tokens, ThinkingMode, MAX_PREFIX};
use ds4_chat::Tokenizer;
use ds4_engine::{NumericMode, Sampler};
use ds4_gguf::GgufFile;
use ds4_runtime::driver::{Conversation, GenLimits};

use crate::chat::{prefill_bar, status_line, GenStop, Printer, TurnText};
use crate::generate::{effective_mode, mode_name, GenSettings};
use crate::load::{build_engine, LoadOptions, Loaded};
use crate::sessions::{render_listing, DiskSessions};
use crate::signals::Interrupts;

pub const HELP: &str = "\
Commands:
  /help           this list
  /think          thinking on, normal effort (the default)
  /think-max      Think Max (needs a context of at least 393216 tokens, else normal thinking)
  /nothink        answer without reasoning
  /ctx N          new session with a context of N tokens; the transcript is kept and
                  re-prefilled with the next message
  /read FILE      add FILE's text to your next message
  /save NAME      save the conversation and its KV state (needs --kv-disk-dir)
  /load NAME      restore a saved conversation (or a checkpoint by its file name, e.g. one
                  ds4-server wrote to the same --kv-disk-dir)
  /list           saved conversations and checkpoints
  /reset          start a new conversation
  /quit, /exit    leave (Ctrl+D too)
A line ending in \\ continues on the next line; pasted text keeps its line breaks.
Start a message with // to send text that begins with /.
Ctrl+C stops an answer (what was written stays in the conversation); twice at the prompt exits.
";

/// Largest file `/read` accepts.
pub const MAX_READ_BYTES: u64 = 16 << 20;

/// What the chat needs besides the loaded model.
pub struct ReplOptions {
    pub settings: GenSettings,
    /// Disk sessions (`--kv-disk-dir`).
    pub kv_dir: Option<PathBuf>,
    pub kv_budget_bytes: u64,
    /// History file for the line editor (terminal input only).
    pub history: Option<PathBuf>,
    /// How the model was loaded (for `/ctx N`).
    pub load: LoadOptions,
}

/// One read from the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    Line(String),
    /// Ctrl+C at the prompt.
    Interrupted,
    Eof,
}

/// Where lines come from: a line editor on a terminal, or plain lines from a pipe.
pub trait LineSource {
    fn read(&mut self, prompt: &str) -> anyhow::Result<Input>;
    fn remember(&mut self, _entry: &str) {}
    fn close(&mut self) {}
}

/// rustyline on a terminal: editing, history (512 entries), bracketed paste (a pasted
/// block arrives as one message with its line breaks).
pub struct EditorSource {
    ed: rustyline::DefaultEditor,
    history: Option<PathBuf>,
}

impl EditorSource {
    pub fn new(history: Option<PathBuf>) -> anyhow::Result<EditorSource> {
        let cfg = rustyline::Config::builder()
            .max_history_size(512)
            .context("history size")?
            .history_ignore_dups(true)
            .context("history setting")?
            .auto_add_history(false)
            .bracketed_paste(true)
            // Prompt and editing on the terminal itself, so `ds4 > log` keeps only the model's
            // text in the file.
            .behavior(rustyline::Behavior::PreferTerm)
            .build();
        let mut ed =
            rustyline::DefaultEditor::with_config(cfg).context("starting the line editor")?;
        if let Some(h) = &history {
            // A missing history file is normal on the first run.
            let _ = ed.load_history(h);
        }
        Ok(EditorSource { ed, history })
    }
}

impl LineSource for EditorSource {
    fn read(&mut self, prompt: &str) -> anyhow::Result<Input> {
        use rustyline::error::ReadlineError;
        match self.ed.readline(prompt) {
            Ok(l) => Ok(Input::Line(l)),
            Err(ReadlineError::Interrupted) => Ok(Input::Interrupted),
            Err(ReadlineError::Eof) => Ok(Input::Eof),
            Err(e) => Err(e).context("reading input"),
        }
    }

    fn remember(&mut self, entry: &str) {
        let _ = self.ed.add_history_entry(entry);
    }

    fn close(&mut self) {
        if let Some(h) = &self.history {
            if let Err(e) = self.ed.save_history(h) {
                eprintln!("ds4: cannot save history to {}: {e}", h.display());
            }
        }
    }
}

/// Plain lines (stdin is a pipe or a file): no prompt, no control codes.
pub struct PipeSource<R: BufRead> {
    r: R,
}

impl<R: BufRead> PipeSource<R> {
    pub fn new(r: R) -> Self {
        PipeSource { r }
    }
}

impl<R: BufRead> LineSource for PipeSource<R> {
    fn read(&mut self, _prompt: &str) -> anyhow::Result<Input> {
        let mut buf = Vec::new();
        let n = self
            .r
            .read_until(b'\n', &mut buf)
            .context("reading stdin")?;
        if n == 0 {
            return Ok(Input::Eof);
        }
        while buf.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            buf.pop();
        }
        Ok(Input::Line(String::from_utf8_lossy(&buf).into_owned()))
    }
}

/// Reads one message: lines ending in `\` continue it.
pub fn read_message(src: &mut dyn LineSource) -> anyhow::Result<Input> {
    let mut msg = String::new();
    let mut prompt = "ds4> ";
    loop {
        match src.read(prompt)? {
            Input::Line(l) => {
                if let Some(head) = l.strip_suffix('\\') {
                    msg.push_str(head);
                    msg.push('\n');
                    prompt = "...> ";
                    continue;
                }
                msg.push_str(&l);
                return Ok(Input::Line(msg));
            }
            Input::Interrupted => return Ok(Input::Interrupted),
            Input::Eof if msg.is_empty() => return Ok(Input::Eof),
            Input::Eof => return Ok(Input::Line(msg)),
        }
    }
}

/// A parsed slash command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    Help,
    Think,
    ThinkMax,
    NoThink,
    Ctx(usize),
    Read(String),
    Save(String),
    Load(String),
    List,
    Reset,
    Quit,
}

/// Parses the text after `/`. Errors are messages for the user (usage or unknown command).
pub fn parse_command(s: &str) -> Result<Command, String> {
    let s = s.trim();
    let (name, arg) = match s.split_once(char::is_whitespace) {
        Some((n, a)) => (n, a.trim()),
        None => (s, ""),
    };
    let no_arg = |c: Command| {
        if arg.is_empty() {
            Ok(c)
        } else {
            Err(format!("/{name} takes no argument"))
        }
    };
    let need = |what: &str| {
        if arg.is_empty() {
            Err(format!("usage: /{name} {what}"))
        } else {
            Ok(arg.to_string())
        }
    };
    match name {
        "help" | "?" => no_arg(Command::Help),
        "think" => no_arg(Command::Think),
        "think-max" => no_arg(Command::ThinkMax),
        "nothink" => no_arg(Command::NoThink),
        "ctx" => {
            let a = need("N")?;
            match a.parse::<usize>() {
                Ok(n) if n > 0 => Ok(Command::Ctx(n)),
                _ => Err(format!("/ctx needs a positive number of tokens, not {a:?}")),
            }
        }
        "read" => need("FILE").map(Command::Read),
        "save" => need("NAME").map(Command::Save),
        "load" => need("NAME").map(Command::Load),
        "list" => no_arg(Command::List),
        "reset" => no_arg(Command::Reset),
        "quit" | "exit" => no_arg(Command::Quit),
        other => Err(format!(
            "unknown command /{other} (type /help for the list)"
        )),
    }
}

/// Reads a file for `/read`: size-capped UTF-8 text, with the path in every error.
pub fn read_attachment(path: &Path) -> anyhow::Result<String> {
    let meta =
        std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    if !meta.is_file() {
        anyhow::bail!("cannot read {}: not a regular file", path.display());
    }
    if meta.len() > MAX_READ_BYTES {
        anyhow::bail!(
            "{} is {} bytes; /read takes files up to {} MiB",
            path.display(),
            meta.len(),
            MAX_READ_BYTES >> 20
        );
    }
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    String::from_utf8(bytes).map_err(|_| anyhow::anyhow!("{} is not UTF-8 text", path.display()))
}

fn kv_mode(m: NumericMode) -> ds4_kvstore::Mode {
    match m {
        NumericMode::Exact => ds4_kvstore::Mode::Exact,
        NumericMode::Official => ds4_kvstore::Mode::Official,
    }
}

struct Repl {
    runner: Option<Conversation>,
    tok: Arc<Tokenizer>,
    file: Arc<GgufFile>,
    load: LoadOptions,
    settings: GenSettings,
    sampler: Sampler,
    requested: ThinkingMode,
    /// BOS + [MAX_PREFIX] + [system]; `None` until built for a mode.
    header: Option<(bool, Vec<u32>)>,
    /// Set after `/load` of a transcript whose header differs from ours: kept verbatim.
    header_frozen: bool,
    body: Vec<u32>,
    attachments: Vec<(String, String)>,
    kv: Option<DiskSessions>,
    intr: Interrupts,
}

enum Flow {
    Continue,
    Quit,
}

/// Runs the chat until `/quit`, end of input or a second Ctrl+C.
pub fn run(
    loaded: Loaded,
    opts: ReplOptions,
    src: &mut dyn LineSource,
    intr: &Interrupts,
) -> anyhow::Result<()> {
    let mode = loaded.engine.mode();
    let kv = opts.kv_dir.map(|dir| DiskSessions {
        dir,
        budget_bytes: opts.kv_budget_bytes,
        model_id: loaded.model_id,
        mode: kv_mode(mode),
    });
    let mut repl = Repl {
        runner: Some(Conversation::new(loaded.engine)?),
        tok: loaded.tokenizer,
        file: loaded.file,
        load: opts.load,
        sampler: Sampler::new(opts.settings.sampler.clone())?,
        requested: opts.settings.thinking,
        settings: opts.settings,
        header: None,
        header_frozen: false,
        body: Vec::new(),
        attachments: Vec::new(),
        kv,
        intr: intr.clone(),
    };
    if let (_, Some(w)) = repl.effective() {
        eprintln!("ds4: {w}");
    }
    eprintln!(
        "ds4 chat · thinking {} · type a message, /help for commands, /quit or Ctrl+D to leave",
        mode_name(repl.effective().0)
    );
    let result = repl.main_loop(src);
    src.close();
    result
}

impl Repl {
    fn runner(&mut self) -> &mut Conversation {
        self.runner
            .as_mut()
            .expect("a runner exists between commands")
    }

    fn ctx(&self) -> usize {
        self.runner.as_ref().map(|r| r.ctx()).unwrap_or(0)
    }

    fn effective(&self) -> (ThinkingMode, Option<String>) {
        effective_mode(self.requested, self.ctx())
    }

    fn main_loop(&mut self, src: &mut dyn LineSource) -> anyhow::Result<()> {
        loop {
            let line = match read_message(src)? {
                Input::Eof => return Ok(()),
                Input::Interrupted => {
                    if self.intr.prompt_interrupt() {
                        return Ok(());
                    }
                    eprintln!("(Ctrl+C again to exit, or /quit)");
                    continue;
                }
                Input::Line(l) => l,
            };
            self.intr.disarm();
            let trimmed = line.trim();
            if trimmed.is_empty() {
                continue;
            }
            src.remember(&line);
            if let Some(cmd) = trimmed.strip_prefix('/').filter(|c| !c.starts_with('/')) {
                match parse_command(cmd) {
                    Ok(c) => match self.command(c) {
                        Ok(Flow::Quit) => return Ok(()),
                        Ok(Flow::Continue) => {}
                        Err(e) => eprintln!("ds4: {e:#}"),
                    },
                    Err(msg) => eprintln!("ds4: {msg}"),
                }
                continue;
            }
            let text = match trimmed.strip_prefix("//") {
                Some(_) => line.replacen("//", "/", 1),
                None => line,
            };
            if let Err(e) = self.turn(&text) {
                eprintln!("ds4: {e:#}");
            }
        }
    }

    fn header_tokens(&self, max: bool) -> anyhow::Result<Vec<u32>> {
        let mut ids = vec![self.tok.markers().bos];
        if max {
            ids.extend(self.tok.encode(MAX_PREFIX, false)?);
        }
        if let Some(sys) = self.settings.system.as_deref().filter(|s| !s.is_empty()) {
            ids.extend(self.tok.encode(sys, false)?);
        }
        Ok(ids)
    }

    /// The header for `mode`; switching Think Max on or off rebuilds it (MAX_PREFIX sits right
    /// after BOS), which forces a full re-prefill on the next turn.
    fn ensure_header(&mut self, mode: ThinkingMode) -> anyhow::Result<()> {
        if self.header_frozen {
            return Ok(());
        }
        let max = mode == ThinkingMode::ThinkMax;
        if self.header.as_ref().is_some_and(|(m, _)| *m == max) {
            return Ok(());
        }
        let h = self.header_tokens(max)?;
        self.header = Some((max, h));
        Ok(())
    }

    fn transcript(&self) -> Vec<u32> {
        let mut t = self
            .header
            .as_ref()
            .map(|(_, h)| h.clone())
            .unwrap_or_default();
        t.extend_from_slice(&self.body);
        t
    }

    fn turn(&mut self, typed: &str) -> anyhow::Result<()> {
        let mut text = String::new();
        for (_, content) in &self.attachments {
            text.push_str(content);
            text.push_str("\n\n");
        }
        text.push_str(typed);
        // A Think Max downgrade was announced at start-up or by /think-max.
        let (mode, _) = self.effective();
        self.ensure_header(mode)?;
        let turn = cli_turn_tokens(&self.tok, &text, mode)?;
        let mut target = self.transcript();
        target.extend_from_slice(&turn);
        let ctx = self.ctx();
        // Room for at least one sampled token and the closing EOS.
        if target.len() + 2 > ctx {
            anyhow::bail!(
                "this message needs {} tokens with the conversation, the context holds {ctx}: \
                 use /ctx N (the transcript is kept) or /reset",
                target.len() + 2
            );
        }
        self.attachments.clear();
        let intr = self.intr.clone();
        intr.begin();
        let bar = prefill_bar(
            target.len() - common_prefix(self.runner().live(), &target),
            self.settings.progress,
        );
        let synced = self.runner().sync(&target, &intr.cancel, &mut |d, _| {
            if let Some(b) = &bar {
                b.set_position(d as u64);
            }
        });
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        let (sync, logits) = match synced {
            Ok(x) => x,
            Err(e) => {
                intr.end();
                return Err(e.into());
            }
        };
        let Some(logits) = logits else {
            intr.end();
            eprintln!("ds4: interrupted during prefill; the message was dropped");
            return Ok(());
        };
        let max = self.settings.max_tokens.min(ctx - target.len() - 1).max(1);
        let tok = self.tok.clone();
        let eos = tok.markers().eos;
        let mut text_stream = TurnText::new(mode.is_thinking());
        let stdout = std::io::stdout();
        let mut printer = Printer::new(stdout.lock(), self.settings.color, self.settings.terminal);
        let mut io_err = None;
        let mut sampler = self.sampler.clone();
        let ignore_eos = self.settings.ignore_eos;
        let limits = GenLimits {
            max_tokens: max,
            eos,
            ignore_eos,
            feed_all: false,
        };
        let draft = self.settings.draft;
        self.runner().set_draft(draft);
        let gen = self
            .runner()
            .generate(logits, &mut sampler, limits, &intr.cancel, &mut |id| {
                for ev in text_stream.push(&tok, id) {
                    if let Err(e) = printer.event(&ev) {
                        io_err.get_or_insert(e);
                    }
                }
            });
        self.sampler = sampler;
        let interrupted = intr.end();
        let gen = gen?;
        let (events, _) = text_stream.finish(gen.stop);
        for ev in &events {
            printer.event(ev)?;
        }
        printer.finish()?;
        drop(printer);
        if let Some(e) = io_err {
            return Err(e.into());
        }
        let interrupted = interrupted || gen.stop == GenStop::Interrupted;
        if gen.tokens.is_empty() {
            eprintln!("ds4: interrupted before the first token; the message was dropped");
            return Ok(());
        }
        self.body.extend_from_slice(&turn);
        self.body.extend_from_slice(&gen.tokens);
        if gen.tokens.last() != Some(&eos) {
            self.body.push(eos);
        }
        if interrupted {
            eprintln!("ds4: interrupted; the partial answer stays in the conversation");
        }
        let live = self.transcript().len();
        eprintln!("{}", status_line(&sync, &gen, live, ctx));
        Ok(())
    }

    fn command(&mut self, c: Command) -> anyhow::Result<Flow> {
        match c {
            Command::Help => eprint!("{HELP}"),
            Command::Think => {
                self.requested = ThinkingMode::Think;
                eprintln!("Thinking mode: high.");
            }
            Command::NoThink => {
                self.requested = ThinkingMode::NoThink;
                eprintln!("Thinking mode: off.");
            }
            Command::ThinkMax => {
                self.requested = ThinkingMode::ThinkMax;
                if self.effective().0 == ThinkingMode::ThinkMax {
                    eprintln!("Thinking mode: max.");
                } else {
                    eprintln!(
                        "Thinking mode: high (ctx below {}): Think Max needs a context of at least {} tokens; /ctx {} turns it on.",
                        ThinkingMode::MAX_MIN_CTX,
                        ThinkingMode::MAX_MIN_CTX,
                        ThinkingMode::MAX_MIN_CTX
                    );
                }
                if self.header_frozen {
                    eprintln!("(the loaded conversation keeps its own start; Think Max's preamble is not added)");
                }
            }
            Command::Ctx(n) => self.set_ctx(n)?,
            Command::Read(path) => {
                let text = read_attachment(Path::new(&path))?;
                eprintln!(
                    "attached {path} ({} bytes); it is sent with your next message",
                    text.len()
                );
                self.attachments.push((path, text));
            }
            Command::Save(name) => self.save(&name)?,
            Command::Load(name) => self.load_session(&name)?,
            Command::List => {
                let kv = self.kv()?;
                let (listing, notes) = kv.list(self.ctx())?;
                for n in notes {
                    eprintln!("ds4: {n}");
                }
                eprint!("{}", render_listing(&listing, &kv.dir));
            }
            Command::Reset => {
                self.body.clear();
                self.attachments.clear();
                self.header_frozen = false;
                self.header = None;
                self.runner().reset()?;
                eprintln!("new conversation");
            }
            Command::Quit => return Ok(Flow::Quit),
        }
        Ok(Flow::Continue)
    }

    fn kv(&self) -> anyhow::Result<&DiskSessions> {
        self.kv
            .as_ref()
            .context("disk sessions need a store: start ds4 with --kv-disk-dir DIR")
    }

    fn set_ctx(&mut self, n: usize) -> anyhow::Result<()> {
        let old = self.ctx();
        // Free the old state and engine first: a context can be most of the memory.
        self.runner = None;
        let engine = match build_engine(&self.file, &self.load, n) {
            Ok(e) => e,
            Err(e) => {
                let back = build_engine(&self.file, &self.load, old)
                    .context("restoring the previous context after a failed /ctx")?;
                self.runner = Some(Conversation::new(back)?);
                return Err(anyhow::Error::new(e)
                    .context(format!("cannot make a context of {n} tokens; kept {old}")));
            }
        };
        self.runner = Some(Conversation::new(engine)?);
        let t = self.transcript().len();
        eprintln!(
            "context is now {n} tokens; the transcript ({t} tokens) is kept and re-prefilled with the next message"
        );
        if t + 2 > n {
            eprintln!("ds4: the transcript does not fit the new context: the next message will fail (use /reset)");
        }
        Ok(())
    }

    fn save(&mut self, name: &str) -> anyhow::Result<()> {
        crate::sessions::check_name(name)?;
        self.kv()?;
        let (mode, _) = self.effective();
        self.ensure_header(mode)?;
        let target = self.transcript();
        let intr = self.intr.clone();
        intr.begin();
        let synced = self.runner().sync_state(&target, &intr.cancel);
        if intr.end() {
            anyhow::bail!("interrupted; nothing saved");
        }
        synced?;
        // The current checkpoint payload, with the logits when known: ds4-server can then
        // answer a prompt that ends exactly here without evaluating anything.
        let payload = self.runner().checkpoint()?;
        let ctx = self.ctx();
        let thinking = mode_name(self.requested);
        let kv = self.kv()?;
        let notes = kv.save(name, &target, &payload, ctx, thinking)?;
        for n in notes {
            eprintln!("ds4: {n}");
        }
        eprintln!(
            "saved session {name} ({} tokens, {:.1} MiB)",
            target.len(),
            payload.len() as f64 / 1048576.0
        );
        Ok(())
    }

    fn load_session(&mut self, name: &str) -> anyhow::Result<()> {
        let ctx = self.ctx();
        let (entry, info) = self.kv()?.load(name, ctx)?;
        let format = self
            .runner()
            .resume(&entry.payload, &entry.tokens)
            .with_context(|| format!("session {name:?} cannot be restored"))?;
        if format.is_legacy() {
            // Written before the payload formats were unified: rewritten in the current
            // one (never dropped), so the server reads it too.
            let payload = self.runner().checkpoint()?;
            match self.kv()?.rewrite(&entry, &payload, ctx) {
                Ok(()) => eprintln!(
                    "ds4: session {name} migrated from the {} format",
                    format.name()
                ),
                Err(e) => eprintln!("ds4: session {name} not migrated: {e:#}"),
            }
        }
        let tokens = entry.tokens;
        // A checkpoint without a name keeps the current thinking mode.
        if let Some(info) = &info {
            self.requested = match info.thinking.as_str() {
                "nothink" => ThinkingMode::NoThink,
                "think-max" => ThinkingMode::ThinkMax,
                _ => ThinkingMode::Think,
            };
        }
        let (mode, _) = self.effective();
        let want = self.header_tokens(mode == ThinkingMode::ThinkMax)?;
        self.attachments.clear();
        if tokens.starts_with(&want) {
            self.body = tokens[want.len()..].to_vec();
            self.header = Some((mode == ThinkingMode::ThinkMax, want));
            self.header_frozen = false;
        } else {
            // Saved with another system prompt: keep the transcript verbatim.
            self.header = Some((false, Vec::new()));
            self.body = tokens.clone();
            self.header_frozen = true;
        }
        eprintln!(
            "loaded session {name} ({} tokens, thinking {})",
            tokens.len(),
            mode_name(self.requested)
        );
        Ok(())
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    if b.starts_with(a) {
        a.len()
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_parse_with_usage_errors() {
        assert_eq!(parse_command("help"), Ok(Command::Help));
        assert_eq!(parse_command("ctx 4096"), Ok(Command::Ctx(4096)));
        assert_eq!(
            parse_command(" read  notes.txt "),
            Ok(Command::Read("notes.txt".into()))
        );
        assert_eq!(parse_command("exit"), Ok(Command::Quit));
        assert!(parse_command("ctx").unwrap_err().contains("usage: /ctx N"));
        assert!(parse_command("ctx 0").unwrap_err().contains("positive"));
        assert!(parse_command("ctx lots").unwrap_err().contains("positive"));
        assert!(parse_command("save")
            .unwrap_err()
            .contains("usage: /save NAME"));
        assert!(parse_command("think now")
            .unwrap_err()
            .contains("takes no argument"));
        let e = parse_command("frobnicate").unwrap_err();
        assert!(
            e.contains("unknown command /frobnicate") && e.contains("/help"),
            "{e}"
        );
    }

    #[test]
    fn messages_continue_after_a_backslash() {
        let mut src = PipeSource::new(&b"one \\\ntwo\r\nthree\n\\\n"[..]);
        assert_eq!(
            read_message(&mut src).unwrap(),
            Input::Line("one \ntwo".into())
        );
        assert_eq!(read_message(&mut src).unwrap(), Input::Line("three".into()));
        // A continuation cut by the end of input is still sent.
        assert_eq!(read_message(&mut src).unwrap(), Input::Line("\n".into()));
        assert_eq!(read_message(&mut src).unwrap(), Input::Eof);
    }

    #[test]
    fn attachments_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let e = format!(
            "{:#}",
            read_attachment(&dir.path().join("missing.txt")).unwrap_err()
        );
        assert!(
            e.contains("cannot read") && e.contains("missing.txt"),
            "{e}"
        );
        let e = format!("{:#}", read_attachment(dir.path()).unwrap_err());
        assert!(e.contains("not a regular file"), "{e}");
        let bin = dir.path().join("bin");
        std::fs::write(&bin, [0xff, 0xfe, 0x00]).unwrap();
        assert!(format!("{:#}", read_attachment(&bin).unwrap_err()).contains("not UTF-8"));
        let ok = dir.path().join("ok.txt");
        std::fs::write(&ok, "héllo\n").unwrap();
        assert_eq!(read_attachment(&ok).unwrap(), "héllo\n");
    }
}
