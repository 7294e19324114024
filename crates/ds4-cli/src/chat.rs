//! What the CLI draws around the conversation driver (`ds4_runtime::driver`): generated
//! tokens turned into reasoning / answer text, the terminal printer, the prefill progress
//! bar and the status line. Shared by one-shot `ds4 -p` and the interactive chat.

use ds4_chat::stream::{EndCause, FinalOutput, OutputStream, StreamEvent, StreamOptions};
use ds4_chat::{Tokenizer, Utf8Stream};
pub use ds4_runtime::driver::{GenOutcome, GenStop, SyncStats};

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
            GenStop::Length | GenStop::Interrupted | GenStop::Halted => EndCause::Length,
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
    fit_status_line(sync, generated, live, ctx, stderr_width())
}

/// The columns of the terminal stderr goes to; `None` when it is not a terminal (logs and
/// pipes get the whole line).
pub fn stderr_width() -> Option<usize> {
    let term = console::Term::stderr();
    term.is_term()
        .then(|| term.size_checked().map(|(_, cols)| usize::from(cols)))
        .flatten()
}

/// The status line in the longest of three forms that fits `width` columns (a line that
/// wraps pushes the prompt to a new row on every answer); without a width, the long one.
pub fn fit_status_line(
    sync: &SyncStats,
    generated: &GenOutcome,
    live: usize,
    ctx: usize,
    width: Option<usize>,
) -> String {
    // Drafting's effect, when it drafted (docs/speculative.md): drafts accepted of those
    // verified, and tokens per verify pass.
    let d = &generated.draft;
    let (draft_long, draft_short) = if d.drafted > 0 {
        (
            format!(
                " · drafted {}, accepted {} ({:.0} %), {:.2} tokens per verify step",
                d.drafted,
                d.accepted,
                100.0 * d.acceptance(),
                d.tokens_per_step()
            ),
            format!(" · draft {}/{}", d.accepted, d.drafted),
        )
    } else {
        (String::new(), String::new())
    };
    let long = format!(
        "ds4: prefill {} tokens ({} reused) at {:.1} t/s · generated {} tokens at {:.1} t/s{draft_long} · context {}/{}",
        sync.prefilled,
        sync.reused,
        sync.tokens_per_sec(),
        generated.tokens.len(),
        generated.tokens_per_sec(),
        live,
        ctx
    );
    let Some(width) = width else {
        return long;
    };
    let short = format!(
        "prefill {} ({} reused) {:.0} t/s · gen {} {:.1} t/s{draft_short} · ctx {}/{}",
        sync.prefilled,
        sync.reused,
        sync.tokens_per_sec(),
        generated.tokens.len(),
        generated.tokens_per_sec(),
        live,
        ctx
    );
    let shortest = format!(
        "{:.1} t/s · ctx {}/{}",
        generated.tokens_per_sec(),
        live,
        ctx
    );
    [long, short]
        .into_iter()
        .find(|l| l.chars().count() < width)
        .unwrap_or(shortest)
}

/// What the streamed-expert cache did over a run (docs/placement.md §9).
pub fn expert_line(s: &ds4_engine::StreamStats) -> String {
    let pct = |a: u64, b: u64| {
        if b == 0 {
            0.0
        } else {
            100.0 * a as f64 / b as f64
        }
    };
    format!(
        "ds4: experts: {} lookups, cache hit rate {:.1} %, {:.1} % of misses in the host tier · \
         read {:.2} GB from the file ({} units, {} read ahead, {} of those used; prediction \
         {:.1} % right) · waited {:.2} s for reads · slot writes {:.2} s · host buffers {} \
         ({} page-locked)",
        s.lookups,
        100.0 * s.hit_rate(),
        pct(s.host_hits, s.misses),
        s.bytes_read as f64 / 1e9,
        s.reads,
        s.readahead_reads,
        s.readahead_used,
        100.0 * s.prediction_accuracy(),
        s.read_secs,
        s.write_secs,
        s.host_buffers,
        s.host_pinned
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
    fn status_line_fits_the_terminal() {
        let sync = SyncStats {
            reused: 1234,
            prefilled: 56789,
            secs: 2.0,
        };
        let gen = GenOutcome {
            tokens: vec![7; 640],
            stop: GenStop::Length,
            secs: 10.0,
            draft: Default::default(),
        };
        let long = fit_status_line(&sync, &gen, 58663, 393216, None);
        assert!(
            long.starts_with("ds4: prefill 56789 tokens (1234 reused)"),
            "{long}"
        );
        assert_eq!(fit_status_line(&sync, &gen, 58663, 393216, Some(500)), long);
        for width in [20, 40, 60, 80, 100, 120] {
            let l = fit_status_line(&sync, &gen, 58663, 393216, Some(width));
            // Every form keeps the generation rate and the context use.
            assert!(l.contains("64.0 t/s") && l.contains("58663/393216"), "{l}");
            assert!(!l.contains("draft"), "{l}");
            if width >= 40 {
                assert!(l.chars().count() < width, "{width}: {l}");
            }
        }
        // With drafting the long form says what it did, the short one briefly.
        let drafted = GenOutcome {
            draft: ds4_runtime::DraftStats {
                steps: 100,
                drafted: 300,
                accepted: 150,
            },
            ..gen
        };
        let l = fit_status_line(&sync, &drafted, 58663, 393216, None);
        assert!(
            l.contains("drafted 300, accepted 150 (50 %), 2.50 tokens per verify step"),
            "{l}"
        );
        let l = fit_status_line(&sync, &drafted, 58663, 393216, Some(100));
        assert!(l.contains("draft 150/300") || !l.contains("draft"), "{l}");
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
