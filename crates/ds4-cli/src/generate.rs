//! `ds4 -p PROMPT`: one-shot generation (docs/server.md §2, docs/chat.md §2.7).
//!
//! The model's text goes to stdout as it is sampled; everything else (load report, progress,
//! the final rate line) to stderr, so `ds4 -p … > answer.txt` captures only the answer.

use std::io::Write;

use ds4_chat::render::{CliPrompt, ThinkingMode};
use ds4_engine::{Sampler, SamplerConfig};
use ds4_runtime::driver::{Conversation, GenLimits};

use crate::chat::{prefill_bar, status_line, GenStop, Printer, TurnText};
use crate::load::Loaded;
use crate::signals::Interrupts;

/// Generation settings shared by one-shot runs and the chat.
#[derive(Debug, Clone)]
pub struct GenSettings {
    /// System text; `None` or empty: no system block.
    pub system: Option<String>,
    /// Requested thinking mode (Think Max is downgraded below ctx 393216).
    pub thinking: ThinkingMode,
    pub sampler: SamplerConfig,
    /// `-n`: most tokens per answer (clamped to the context room).
    pub max_tokens: usize,
    /// `--ignore-eos`: never stop at EOS.
    pub ignore_eos: bool,
    /// Colour on stdout (a terminal and no `NO_COLOR`).
    pub color: bool,
    /// stdout is a terminal: neutralise control characters in the model's text.
    pub terminal: bool,
    /// Progress bar for long prefills (stderr is a terminal).
    pub progress: bool,
    /// Speculative decoding (`--draft`, docs/speculative.md).
    pub draft: ds4_runtime::DraftConfig,
}

/// The effective thinking mode for a context, with the warning ds4 prints on a downgrade.
pub fn effective_mode(requested: ThinkingMode, ctx: usize) -> (ThinkingMode, Option<String>) {
    let eff = requested.for_context(ctx as u64);
    let warn = (eff != requested).then(|| {
        format!(
            "Think Max needs a context of at least {} tokens (ctx is {ctx}); using normal thinking",
            ThinkingMode::MAX_MIN_CTX
        )
    });
    (eff, warn)
}

pub fn mode_name(m: ThinkingMode) -> &'static str {
    match m {
        ThinkingMode::NoThink => "nothink",
        ThinkingMode::Think => "think",
        ThinkingMode::ThinkMax => "think-max",
    }
}

/// What a one-shot run ended with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OneShotEnd {
    Done,
    Interrupted,
}

/// The CLI's default sampling (`ds4` without sampling flags; `ds4-bench --e2e` measures
/// exactly this): temperature 1, top-p 1, top-k off, min-p 0.05.
pub const DEFAULT_TEMP: f32 = 1.0;
pub const DEFAULT_TOP_P: f32 = 1.0;
pub const DEFAULT_TOP_K: usize = 0;
pub const DEFAULT_MIN_P: f32 = 0.05;

/// [`SamplerConfig`] with the CLI's defaults and `seed`.
pub fn default_sampler(seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature: DEFAULT_TEMP,
        top_k: DEFAULT_TOP_K,
        top_p: DEFAULT_TOP_P,
        min_p: DEFAULT_MIN_P,
        seed,
        ..SamplerConfig::default()
    }
}

/// A one-shot run's end and its measured rates (what the status line prints).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OneShotStats {
    pub end: OneShotEnd,
    /// Prompt tokens evaluated, and the seconds it took.
    pub prefilled: usize,
    pub prefill_secs: f64,
    /// Tokens sampled, and the seconds from the first sample to the last.
    pub generated: usize,
    pub gen_secs: f64,
    /// What drafting did (zero without it).
    pub draft: ds4_runtime::DraftStats,
}

/// Renders `prompt`, prefills it, and streams the answer to `out`.
pub fn one_shot(
    loaded: Loaded,
    prompt: &str,
    s: &GenSettings,
    intr: &Interrupts,
    out: &mut dyn Write,
    log: &mut dyn Write,
) -> anyhow::Result<OneShotStats> {
    let tok = loaded.tokenizer.clone();
    let mut runner = Conversation::new(loaded.engine)?;
    runner.set_draft(s.draft);
    let ctx = runner.ctx();
    let (mode, warn) = effective_mode(s.thinking, ctx);
    if let Some(w) = warn {
        writeln!(log, "ds4: {w}")?;
    }
    let tokens = CliPrompt {
        system: s.system.as_deref(),
        prompt,
        mode,
    }
    .tokens(&tok)?;
    if tokens.len() >= ctx {
        anyhow::bail!(
            "the prompt has {} tokens but the context is {ctx}: nothing left to generate (raise -c/--ctx)",
            tokens.len()
        );
    }
    let mut sampler = Sampler::new(s.sampler.clone())?;
    intr.begin();
    let bar = prefill_bar(tokens.len(), s.progress);
    let (sync, logits) = runner.sync(&tokens, &intr.cancel, &mut |d, _| {
        if let Some(b) = &bar {
            b.set_position(d as u64);
        }
    })?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let Some(logits) = logits else {
        intr.end();
        writeln!(log, "ds4: interrupted during prefill")?;
        return Ok(OneShotStats {
            end: OneShotEnd::Interrupted,
            prefilled: sync.prefilled,
            prefill_secs: sync.secs,
            generated: 0,
            gen_secs: 0.0,
            draft: Default::default(),
        });
    };
    let room = ctx - tokens.len();
    let max = s.max_tokens.min(room.saturating_sub(1)).max(1);
    let mut text = TurnText::new(mode.is_thinking());
    let mut printer = Printer::new(&mut *out, s.color, s.terminal);
    let mut io_err = None;
    let eos = tok.markers().eos;
    let limits = GenLimits {
        max_tokens: max,
        eos,
        ignore_eos: s.ignore_eos,
        feed_all: false,
    };
    let gen = runner.generate(logits, &mut sampler, limits, &intr.cancel, &mut |id| {
        for ev in text.push(&tok, id) {
            if let Err(e) = printer.event(&ev) {
                io_err.get_or_insert(e);
            }
        }
    })?;
    let interrupted = intr.end() || gen.stop == GenStop::Interrupted;
    let (events, _) = text.finish(gen.stop);
    for ev in &events {
        printer.event(ev)?;
    }
    printer.finish()?;
    if let Some(e) = io_err {
        return Err(e.into());
    }
    let live = tokens.len() + gen.tokens.len();
    if interrupted {
        writeln!(log, "ds4: interrupted")?;
    }
    writeln!(log, "{}", status_line(&sync, &gen, live, ctx))?;
    if let Some(st) = runner.engine().expert_stats() {
        writeln!(log, "{}", crate::chat::expert_line(&st))?;
    }
    Ok(OneShotStats {
        end: if interrupted {
            OneShotEnd::Interrupted
        } else {
            OneShotEnd::Done
        },
        prefilled: sync.prefilled,
        prefill_secs: sync.secs,
        generated: gen.tokens.len(),
        gen_secs: gen.secs,
        draft: gen.draft,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn think_max_downgrades_below_its_context() {
        let (m, w) = effective_mode(ThinkingMode::ThinkMax, 32768);
        assert_eq!(m, ThinkingMode::Think);
        assert!(w.unwrap().contains("393216"));
        assert_eq!(
            effective_mode(ThinkingMode::ThinkMax, 393216),
            (ThinkingMode::ThinkMax, None)
        );
        assert_eq!(
            effective_mode(ThinkingMode::NoThink, 16),
            (ThinkingMode::NoThink, None)
        );
    }
}
