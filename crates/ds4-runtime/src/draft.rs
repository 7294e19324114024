//! Drafting for speculative decoding (docs/speculative.md): which drafter runs, how many
//! tokens it may propose per step, the prompt-lookup drafter itself and the statistics a
//! generation reports.
//!
//! The drafter only proposes; whether a draft stands is decided by the verify step
//! ([`ds4_engine::Engine::eval_verify`]) and the sampler's acceptance rule
//! ([`ds4_engine::Sampler::sample_draft`]), which keep the output exactly what decoding
//! without drafts gives (greedy: token for token; sampled: in distribution).

use std::fmt;
use std::str::FromStr;

/// Which drafter proposes tokens (`--draft`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DraftMode {
    /// No drafting: one token per forward pass.
    #[default]
    Off,
    /// Prompt lookup: the tokens that followed the latest earlier occurrence of the
    /// context's last n-gram.
    Lookup,
    /// The checkpoint's multi-token-prediction block (`--mtp FILE`, or the main file's
    /// `mtp.0.*`), chained to the draft depth (docs/speculative.md §4).
    Mtp,
    /// The MTP block when one is loaded, else prompt lookup; paused while this run's verify
    /// steps cost more time per token than plain decoding ([`Governor`]), which is where
    /// poor acceptance shows.
    Auto,
}

impl fmt::Display for DraftMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DraftMode::Off => "off",
            DraftMode::Lookup => "lookup",
            DraftMode::Mtp => "mtp",
            DraftMode::Auto => "auto",
        })
    }
}

impl FromStr for DraftMode {
    type Err = String;
    fn from_str(s: &str) -> Result<DraftMode, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" | "none" | "0" => Ok(DraftMode::Off),
            "lookup" => Ok(DraftMode::Lookup),
            "auto" => Ok(DraftMode::Auto),
            "mtp" => Ok(DraftMode::Mtp),
            _ => Err(format!("--draft {s}: expected mtp, lookup, auto or off")),
        }
    }
}

/// Default of `--draft-max`: the longest span the engine rolls back by copying alone on
/// DeepSeek V4 ([`ds4_engine::Engine::exact_draft_span`] is 4 there, its CSA ratio), so a
/// partly accepted draft never costs a second evaluation.
pub const DEFAULT_DRAFT_MAX: usize = 3;
/// The most drafts per step `--draft-max` accepts (a verify step is one chunk of decode
/// rows; past this, a rejected draft wastes more than drafting saves on any backend).
pub const MAX_DRAFT_MAX: usize = 16;
/// Default of `--draft-ngram`: the longest suffix the lookup drafter matches.
pub const DEFAULT_DRAFT_NGRAM: usize = 3;

/// The drafting settings of a generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftConfig {
    pub mode: DraftMode,
    /// Most tokens proposed per step.
    pub max: usize,
    /// Longest suffix n-gram the lookup matches (then shorter ones, down to 1).
    pub ngram: usize,
}

impl Default for DraftConfig {
    fn default() -> Self {
        DraftConfig {
            mode: DraftMode::Off,
            max: DEFAULT_DRAFT_MAX,
            ngram: DEFAULT_DRAFT_NGRAM,
        }
    }
}

impl DraftConfig {
    /// Whether any drafting happens.
    pub fn on(&self) -> bool {
        self.mode != DraftMode::Off && self.max > 0 && self.ngram > 0
    }

    /// Which drafter runs, given whether an MTP block is loaded: `mtp` and `auto` take it
    /// when there is one, prompt lookup otherwise. A model without a block is refused
    /// `--draft mtp` at load (and a server request's `"draft": "mtp"` with a 400), so `mtp`
    /// meets no block only where the placement plan left the block out for lack of room
    /// (docs/placement.md §10), which the load reported: drafting then goes on by lookup.
    pub fn drafter(&self, has_mtp: bool) -> Drafter {
        match self.mode {
            DraftMode::Off => Drafter::None,
            DraftMode::Lookup => Drafter::Lookup,
            DraftMode::Mtp | DraftMode::Auto if has_mtp => Drafter::Mtp,
            DraftMode::Mtp | DraftMode::Auto => Drafter::Lookup,
        }
    }

    /// The prompt-lookup drafts for the next step after `context`, at most `limit` (and the
    /// configured maximum): empty when nothing matches.
    pub fn propose<'a>(&self, context: &'a [u32], limit: usize) -> &'a [u32] {
        match self.mode {
            DraftMode::Off => &[],
            _ => lookup(context, self.ngram, self.max.min(limit)),
        }
    }
}

/// The drafter a generation runs ([`DraftConfig::drafter`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drafter {
    None,
    Lookup,
    Mtp,
}

/// Prompt lookup: for n from `ngram` down to 1, the context's last n tokens are searched
/// for in the context before them, latest occurrence first; the first match proposes the
/// (at most `max`) tokens that followed it. Longer suffixes first because a longer match
/// predicts its continuation better; the latest occurrence because repeated spans in
/// agents' and chat contexts are usually the recent ones (a file just read, the last
/// answer). Returns a slice of `context` (empty: no match, or `max` is 0).
///
/// Cost: one backward scan of the context per n, O(context · n) comparisons per step at
/// worst — microseconds against a forward pass even at long contexts.
pub fn lookup(context: &[u32], ngram: usize, max: usize) -> &[u32] {
    let len = context.len();
    if max == 0 {
        return &[];
    }
    for n in (1..=ngram.min(len.saturating_sub(1))).rev() {
        let pattern = &context[len - n..];
        // Start positions whose match ends before the context's end (so a token follows).
        for i in (0..len - n).rev() {
            if &context[i..i + n] == pattern {
                let from = i + n;
                return &context[from..(from + max).min(len)];
            }
        }
    }
    &[]
}

/// Plain steps measured before `--draft auto` first drafts, and verify steps measured
/// before it compares (a first step can carry one-off costs; a few smooth them out).
const AUTO_SAMPLES: u32 = 4;
/// Tokens `--draft auto` decodes plainly after finding drafting slower, before it tries
/// again (the text may start repeating itself later).
const AUTO_PAUSE: usize = 64;
/// Weight of the newest sample in the moving averages of seconds per token.
const AUTO_WEIGHT: f64 = 0.25;

/// A moving average of seconds per token, with its sample count.
#[derive(Debug, Clone, Copy, Default)]
struct Rate {
    secs_per_token: f64,
    samples: u32,
}

impl Rate {
    fn add(&mut self, secs: f64, tokens: usize) {
        let x = secs / tokens.max(1) as f64;
        self.secs_per_token = if self.samples == 0 {
            x
        } else {
            AUTO_WEIGHT * x + (1.0 - AUTO_WEIGHT) * self.secs_per_token
        };
        self.samples = self.samples.saturating_add(1);
    }
}

/// `--draft auto`'s choice per step: draft or not, from this run's own measured seconds
/// per emitted token with and without drafts. Whether drafting pays depends on the
/// backend (a verify row costs about a token on a compute-bound CPU, little on a
/// memory-bound GPU decode) and on how repetitive the text is, so it is measured, not
/// predicted from the acceptance rate. The output does not depend on it (drafting is
/// lossless either way); the constants above are choices, not measurements.
#[derive(Debug, Clone, Default)]
pub struct Governor {
    plain: Rate,
    draft: Rate,
    /// No drafts before this many tokens have been emitted.
    paused_until: usize,
}

impl Governor {
    /// Starts with [`AUTO_SAMPLES`] plain steps, the yardstick.
    pub fn new() -> Governor {
        Governor {
            paused_until: AUTO_SAMPLES as usize,
            ..Governor::default()
        }
    }

    /// Whether to draft once `emitted` tokens have been emitted.
    pub fn drafting(&self, emitted: usize) -> bool {
        emitted >= self.paused_until
    }

    /// A plain decode step took `secs`.
    pub fn plain_step(&mut self, secs: f64) {
        self.plain.add(secs, 1);
    }

    /// A verify step took `secs` and advanced `tokens` tokens (the fed token and the
    /// accepted drafts); `emitted` tokens have been emitted so far. Pauses drafting for
    /// [`AUTO_PAUSE`] tokens when it is measured slower than plain decoding, and measures it
    /// afresh afterwards.
    pub fn verify_step(&mut self, secs: f64, tokens: usize, emitted: usize) {
        self.draft.add(secs, tokens);
        if self.draft.samples >= AUTO_SAMPLES
            && self.plain.samples >= AUTO_SAMPLES
            && self.draft.secs_per_token > self.plain.secs_per_token
        {
            self.paused_until = emitted + AUTO_PAUSE;
            self.draft = Rate::default();
        }
    }
}

/// What drafting did during one generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DraftStats {
    /// Verify steps (forward passes that carried drafts).
    pub steps: u64,
    /// Tokens proposed and verified.
    pub drafted: u64,
    /// Drafts that stood.
    pub accepted: u64,
}

impl DraftStats {
    /// Accepted drafts per drafted token (0 when nothing was drafted).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// Tokens the verify steps advanced per forward pass: the token before the drafts plus
    /// the accepted ones.
    pub fn tokens_per_step(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            (self.steps + self.accepted) as f64 / self.steps as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_takes_the_longest_latest_match() {
        // "1 2 3 4 | 9 2 3 5 | 2 3": the bigram "2 3" last occurred before 5.
        let c = [1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3];
        assert_eq!(lookup(&c, 3, 4), &[5, 7, 2, 3]);
        assert_eq!(lookup(&c, 3, 1), &[5]);
        // The trigram "9 2 3" decides over the later bigram.
        let c = [9, 2, 3, 4, 4, 8, 2, 3, 6, 9, 2, 3];
        assert_eq!(lookup(&c, 3, 2), &[4, 4]);
        assert_eq!(lookup(&c, 2, 2), &[6, 9]);
        // Unigram only when nothing longer matches.
        let c = [5, 6, 7, 1, 8, 7];
        assert_eq!(lookup(&c, 3, 3), &[1, 8, 7]);
        // Nothing: no earlier occurrence, empty or one-token context, max 0.
        assert!(lookup(&[1, 2, 3], 3, 4).is_empty());
        assert!(lookup(&[], 3, 4).is_empty());
        assert!(lookup(&[1], 3, 4).is_empty());
        assert!(lookup(&[1, 1], 3, 0).is_empty());
        // A run repeats itself (overlapping match).
        assert_eq!(lookup(&[4, 4, 4], 3, 5), &[4]);
    }

    #[test]
    fn auto_pauses_while_drafting_is_slower_and_tries_again() {
        let mut g = Governor::new();
        // Plain steps first: 10 ms per token.
        for i in 0..AUTO_SAMPLES as usize {
            assert!(!g.drafting(i));
            g.plain_step(0.010);
        }
        let mut emitted = AUTO_SAMPLES as usize;
        assert!(g.drafting(emitted));
        // Verify steps of 30 ms advancing 2 tokens: 15 ms per token, slower: paused.
        for _ in 0..AUTO_SAMPLES {
            assert!(g.drafting(emitted));
            emitted += 2;
            g.verify_step(0.030, 2, emitted);
        }
        assert!(!g.drafting(emitted));
        assert!(!g.drafting(emitted + AUTO_PAUSE - 1));
        emitted += AUTO_PAUSE;
        assert!(g.drafting(emitted));
        // Now the text repeats: 30 ms for 4 tokens, faster: drafting goes on.
        for _ in 0..3 * AUTO_SAMPLES {
            emitted += 4;
            g.verify_step(0.030, 4, emitted);
            assert!(g.drafting(emitted));
        }
    }

    #[test]
    fn modes_parse_and_auto_prefers_mtp() {
        assert_eq!("lookup".parse::<DraftMode>(), Ok(DraftMode::Lookup));
        assert_eq!("off".parse::<DraftMode>(), Ok(DraftMode::Off));
        assert_eq!("mtp".parse::<DraftMode>(), Ok(DraftMode::Mtp));
        let c = |mode| DraftConfig {
            mode,
            ..DraftConfig::default()
        };
        assert_eq!(c(DraftMode::Auto).drafter(true), Drafter::Mtp);
        assert_eq!(c(DraftMode::Auto).drafter(false), Drafter::Lookup);
        assert_eq!(c(DraftMode::Mtp).drafter(false), Drafter::Lookup);
        assert_eq!(c(DraftMode::Lookup).drafter(true), Drafter::Lookup);
        assert_eq!(c(DraftMode::Off).drafter(true), Drafter::None);
        assert_eq!("auto".parse::<DraftMode>(), Ok(DraftMode::Auto));
        assert!("nope".parse::<DraftMode>().is_err());
        let s = DraftStats {
            steps: 4,
            drafted: 10,
            accepted: 6,
        };
        assert_eq!(s.tokens_per_step(), 2.5);
        assert_eq!(s.acceptance(), 0.6);
    }
}
