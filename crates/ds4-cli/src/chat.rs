//! The generation core shared by one-shot `ds4 -p` and the interactive chat: bring the live
//! KV state to a token sequence reusing the longest live prefix, then sample a turn.
//!
//! The live state is the only copy of the context: a new turn normally extends it, so only
//! the new tokens are prefilled. When the new sequence does not extend what is live (a
//! `/think-max` header change, a rolled-back turn, a `/load`), the state is reset and
//! refilled — the engine has no partial rewind.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use ds4_chat::stream::{EndCause, FinalOutput, OutputStream, StreamEvent, StreamOptions};
use ds4_chat::{Tokenizer, Utf8Stream};
use ds4_engine::{Sampler, Session};

/// What one [`Runner::sync`] did.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SyncStats {
    /// Tokens that were already live and kept.
    pub reused: usize,
    /// Tokens evaluated now.
    pub prefilled: usize,
    pub secs: f64,
}

impl SyncStats {
    pub fn tokens_per_sec(&self) -> f64 {
        rate(self.prefilled, self.secs)
    }
}

fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// Why a turn's sampling ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GenStop {
    /// The model sampled EOS.
    Eos,
    /// `-n` tokens were generated or the context has no more room.
    Length,
    /// Ctrl+C.
    Interrupted,
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenOutcome {
    /// Sampled tokens in order (an EOS is included).
    pub tokens: Vec<u32>,
    pub stop: GenStop,
    pub secs: f64,
}

impl GenOutcome {
    pub fn tokens_per_sec(&self) -> f64 {
        rate(self.tokens.len(), self.secs)
    }
}

/// A session plus the logits of its last evaluated token.
pub struct Runner {
    pub session: Session,
    pub tokenizer: Arc<Tokenizer>,
    /// Logits after `session.tokens()`, when known (a sync that has nothing new to evaluate
    /// needs them).
    last_logits: Option<Vec<f32>>,
}

impl Runner {
    pub fn new(session: Session, tokenizer: Arc<Tokenizer>) -> Runner {
        Runner {
            session,
            tokenizer,
            last_logits: None,
        }
    }

    pub fn ctx(&self) -> usize {
        self.session.ctx()
    }

    /// Tokens held by the live state.
    pub fn live(&self) -> &[u32] {
        self.session.tokens()
    }

    /// Empties the live state.
    pub fn reset(&mut self) -> anyhow::Result<()> {
        self.session.reset()?;
        self.last_logits = None;
        Ok(())
    }

    /// Replaces the live state with a restored snapshot (its logits are unknown).
    pub fn restore(&mut self, snap: &ds4_engine::Snapshot) -> anyhow::Result<()> {
        self.session.restore(snap)?;
        self.last_logits = None;
        Ok(())
    }

    /// Makes the live state hold exactly `target` and returns the logits after its last
    /// token, or `None` if `cancel` was raised between prefill chunks (the state then holds
    /// a prefix of `target`). `progress(done, total)` is called after every chunk.
    pub fn sync(
        &mut self,
        target: &[u32],
        cancel: &AtomicBool,
        progress: &mut dyn FnMut(usize, usize),
    ) -> anyhow::Result<(SyncStats, Option<Vec<f32>>)> {
        let t0 = Instant::now();
        if target.is_empty() {
            anyhow::bail!("nothing to evaluate: the token sequence is empty");
        }
        if target.len() > self.ctx() {
            anyhow::bail!(
                "{} tokens do not fit the context of {} (use a larger -c/--ctx or /ctx N)",
                target.len(),
                self.ctx()
            );
        }
        let extends = target.starts_with(self.live());
        if !extends {
            self.reset()?;
        }
        let reused = self.live().len();
        if reused == target.len() {
            if let Some(l) = self.last_logits.clone() {
                let stats = SyncStats {
                    reused,
                    prefilled: 0,
                    secs: t0.elapsed().as_secs_f64(),
                };
                return Ok((stats, Some(l)));
            }
            // Logits unknown (after a restore or a turn): evaluate from scratch.
            self.reset()?;
            return self.sync(target, cancel, progress);
        }
        let todo = &target[reused..];
        let chunk = self.session.engine().config().prefill_chunk.max(1);
        let mut logits = None;
        let mut done = 0;
        for piece in todo.chunks(chunk) {
            if cancel.load(Ordering::Relaxed) {
                self.last_logits = None;
                let stats = SyncStats {
                    reused,
                    prefilled: done,
                    secs: t0.elapsed().as_secs_f64(),
                };
                return Ok((stats, None));
            }
            logits = Some(self.session.prefill(piece)?);
            done += piece.len();
            progress(done, todo.len());
        }
        self.last_logits = logits.clone();
        let stats = SyncStats {
            reused,
            prefilled: todo.len(),
            secs: t0.elapsed().as_secs_f64(),
        };
        Ok((stats, logits))
    }

    /// Makes the live state hold exactly `target`, without needing logits (before a
    /// snapshot): nothing is evaluated when it already does.
    pub fn sync_state(&mut self, target: &[u32], cancel: &AtomicBool) -> anyhow::Result<()> {
        if self.live() == target {
            return Ok(());
        }
        if target.is_empty() {
            return self.reset();
        }
        let (_, logits) = self.sync(target, cancel, &mut |_, _| {})?;
        if logits.is_none() {
            anyhow::bail!("interrupted");
        }
        Ok(())
    }

    /// Samples up to `max_tokens` tokens starting from `logits` (the logits after the live
    /// state). Stops at `eos` (included in the result), at `max_tokens`, or when `cancel` is
    /// raised. Every sampled token except the last is fed to the state, so the live state
    /// afterwards holds the prompt and all but the last sampled token. `ignore_eos` masks
    /// EOS out of every distribution (`--ignore-eos`: fixed-length runs for benchmarks and
    /// tests).
    #[allow(clippy::too_many_arguments)]
    pub fn generate(
        &mut self,
        logits: Vec<f32>,
        sampler: &mut Sampler,
        max_tokens: usize,
        eos: u32,
        ignore_eos: bool,
        cancel: &AtomicBool,
        on_token: &mut dyn FnMut(u32),
    ) -> anyhow::Result<GenOutcome> {
        let t0 = Instant::now();
        let mut out = Vec::new();
        let mut logits = logits;
        self.last_logits = None;
        // Greedy decoding asks the backend for the argmax: one integer per token crosses
        // back instead of the logits row (not with --ignore-eos, which edits the row).
        let device_argmax = sampler.is_greedy() && !ignore_eos;
        let mut next = None;
        let stop = loop {
            if out.len() >= max_tokens {
                break GenStop::Length;
            }
            if cancel.load(Ordering::Relaxed) {
                break GenStop::Interrupted;
            }
            if ignore_eos {
                if let Some(l) = logits.get_mut(eos as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
            let tok = match next.take() {
                Some(t) => t,
                None => sampler.sample(&logits, &[])?,
            };
            out.push(tok);
            if tok == eos {
                break GenStop::Eos;
            }
            on_token(tok);
            if out.len() >= max_tokens {
                break GenStop::Length;
            }
            if cancel.load(Ordering::Relaxed) {
                break GenStop::Interrupted;
            }
            if device_argmax {
                next = Some(self.session.decode_argmax(tok)?);
            } else {
                self.session.decode_into(tok, &mut logits)?;
            }
        };
        Ok(GenOutcome {
            tokens: out,
            stop,
            secs: t0.elapsed().as_secs_f64(),
        })
    }
}

/// Generated token bytes → reasoning / answer events (docs/chat.md §3.4), never splitting
/// a UTF-8 character.
pub struct TurnText {
    utf8: Utf8Stream,
    stream: OutputStream,
}

impl TurnText {
    /// `thinking`: the prompt ended with `<think>`, so the output starts inside reasoning.
    pub fn new(thinking: bool) -> TurnText {
        TurnText {
            utf8: Utf8Stream::default(),
            stream: OutputStream::new(StreamOptions {
                thinking,
                tools: false,
                stop: Vec::new(),
            }),
        }
    }

    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Vec<StreamEvent> {
        let bytes = tok.token_bytes(id).unwrap_or_default();
        let text = self.utf8.push(bytes);
        self.stream.push(&text)
    }

    pub fn finish(mut self, stop: GenStop) -> (Vec<StreamEvent>, FinalOutput) {
        let rest = self.utf8.finish();
        let mut events = self.stream.push(&rest);
        let cause = match stop {
            GenStop::Eos => EndCause::Eos,
            GenStop::Length | GenStop::Interrupted => EndCause::Length,
        };
        let (more, out) = self.stream.finish(cause);
        events.extend(more);
        (events, out)
    }
}

/// Writes stream events to a terminal or a pipe: reasoning dimmed (SGR 90, like ds4) when
/// colour is on, a line break between reasoning and answer, nothing but plain text when
/// colour is off. On a terminal, control characters the model samples (ESC, BEL, …) are
/// shown as U+FFFD instead of being executed by the terminal; a pipe gets the exact text.
pub struct Printer<W: std::io::Write> {
    out: W,
    color: bool,
    sanitize: bool,
    in_reasoning: bool,
    saw_reasoning: bool,
    last_newline: bool,
    wrote: bool,
}

/// Control characters a terminal would act on (all C0/C1 but newline and tab, and DEL).
fn is_unsafe_control(c: char) -> bool {
    c.is_control() && c != '\n' && c != '\t'
}

const DIM: &str = "\x1b[90m";
const RESET: &str = "\x1b[0m";

impl<W: std::io::Write> Printer<W> {
    pub fn new(out: W, color: bool, sanitize: bool) -> Printer<W> {
        Printer {
            out,
            color,
            sanitize,
            in_reasoning: false,
            saw_reasoning: false,
            last_newline: true,
            wrote: false,
        }
    }

    fn text(&mut self, s: &str) -> std::io::Result<()> {
        if s.is_empty() {
            return Ok(());
        }
        if self.sanitize && s.chars().any(is_unsafe_control) {
            let clean: String = s
                .chars()
                .map(|c| {
                    if is_unsafe_control(c) {
                        char::REPLACEMENT_CHARACTER
                    } else {
                        c
                    }
                })
                .collect();
            self.out.write_all(clean.as_bytes())?;
        } else {
            self.out.write_all(s.as_bytes())?;
        }
        self.last_newline = s.ends_with('\n');
        self.wrote = true;
        Ok(())
    }

    fn leave_reasoning(&mut self) -> std::io::Result<()> {
        if self.in_reasoning {
            if self.color {
                self.out.write_all(RESET.as_bytes())?;
            }
            self.in_reasoning = false;
            if !self.last_newline {
                self.text("\n")?;
            }
        }
        Ok(())
    }

    pub fn event(&mut self, ev: &StreamEvent) -> std::io::Result<()> {
        match ev {
            StreamEvent::Reasoning(s) => {
                if !self.in_reasoning && !s.is_empty() {
                    if self.color {
                        self.out.write_all(DIM.as_bytes())?;
                    }
                    self.in_reasoning = true;
                    self.saw_reasoning = true;
                }
                self.text(s)?;
            }
            StreamEvent::Content(s) => {
                if !s.is_empty() {
                    self.leave_reasoning()?;
                }
                self.text(s)?;
            }
            StreamEvent::ToolCallStart { name, .. } => {
                self.leave_reasoning()?;
                self.text(&format!("\n[tool call {name}] "))?;
            }
            StreamEvent::ToolCallArguments { fragment, .. } => self.text(fragment)?,
            StreamEvent::ToolCallEnd { .. } => self.text("\n")?,
        }
        self.out.flush()
    }

    /// Ends the turn: colour reset and a final line break.
    pub fn finish(&mut self) -> std::io::Result<()> {
        self.leave_reasoning()?;
        if self.wrote && !self.last_newline {
            self.text("\n")?;
        }
        self.out.flush()
    }

    pub fn saw_reasoning(&self) -> bool {
        self.saw_reasoning
    }
}

/// A prefill progress bar (indicatif, on stderr) for long inputs. indicatif draws nothing
/// when stderr is not a terminal, so pipes and logs get no control codes.
pub fn prefill_bar(total: usize, enabled: bool) -> Option<indicatif::ProgressBar> {
    if !enabled || total < 256 {
        return None;
    }
    let pb = indicatif::ProgressBar::with_draw_target(
        Some(total as u64),
        indicatif::ProgressDrawTarget::stderr(),
    );
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "prefill {bar:30} {pos}/{len} tokens · {per_sec} · eta {eta}",
    ) {
        pb.set_style(style);
    }
    Some(pb)
}

/// The status line after a turn or a one-shot run.
pub fn status_line(sync: &SyncStats, generated: &GenOutcome, live: usize, ctx: usize) -> String {
    format!(
        "ds4: prefill {} tokens ({} reused) at {:.1} t/s · generated {} tokens at {:.1} t/s · context {}/{}",
        sync.prefilled,
        sync.reused,
        sync.tokens_per_sec(),
        generated.tokens.len(),
        generated.tokens_per_sec(),
        live,
        ctx
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(color: bool, events: &[StreamEvent]) -> String {
        let mut buf = Vec::new();
        let mut p = Printer::new(&mut buf, color, false);
        for e in events {
            p.event(e).unwrap();
        }
        p.finish().unwrap();
        String::from_utf8(buf).unwrap()
    }

    #[test]
    fn reasoning_is_dimmed_only_with_colour_and_split_from_the_answer() {
        let ev = [
            StreamEvent::Reasoning("think".into()),
            StreamEvent::Reasoning(" more".into()),
            StreamEvent::Content("answer".into()),
        ];
        assert_eq!(run(true, &ev), format!("{DIM}think more{RESET}\nanswer\n"));
        assert_eq!(run(false, &ev), "think more\nanswer\n");
        // Only reasoning (interrupted while thinking): colour is still reset.
        assert_eq!(
            run(true, &[StreamEvent::Reasoning("r\n".into())]),
            format!("{DIM}r\n{RESET}")
        );
        assert_eq!(run(false, &[StreamEvent::Content("a\n".into())]), "a\n");
        assert_eq!(run(false, &[]), "");
    }

    #[test]
    fn progress_bar_only_for_long_prefills_on_a_terminal() {
        assert!(prefill_bar(255, true).is_none());
        assert!(prefill_bar(5000, false).is_none());
        let b = prefill_bar(5000, true).expect("a bar for 5000 tokens");
        assert_eq!(b.length(), Some(5000));
    }

    #[test]
    fn terminal_output_neutralises_model_control_characters() {
        let mut buf = Vec::new();
        let mut p = Printer::new(&mut buf, false, true);
        p.event(&StreamEvent::Content("a\x1b[2Jb\x07\tc\n\u{9b}d".into()))
            .unwrap();
        p.finish().unwrap();
        assert_eq!(
            String::from_utf8(buf).unwrap(),
            "a\u{fffd}[2Jb\u{fffd}\tc\n\u{fffd}d\n"
        );
        let mut buf = Vec::new();
        let mut p = Printer::new(&mut buf, false, false);
        p.event(&StreamEvent::Content("a\x1bb".into())).unwrap();
        assert_eq!(buf, b"a\x1bb");
    }
}
