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
}

impl fmt::Display for DraftMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DraftMode::Off => "off",
            DraftMode::Lookup => "lookup",
        })
    }
}

impl FromStr for DraftMode {
    type Err = String;
    fn from_str(s: &str) -> Result<DraftMode, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" | "none" | "0" => Ok(DraftMode::Off),
            "lookup" => Ok(DraftMode::Lookup),
            "mtp" | "auto" => Err(format!(
                "--draft {s}: not yet (the MTP block is not implemented; issue 53); use lookup or off"
            )),
            _ => Err(format!("--draft {s}: expected lookup or off")),
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

    /// The drafts for the next step after `context`, at most `limit` (and the configured
    /// maximum): empty when the drafter has nothing.
    pub fn propose<'a>(&self, context: &'a [u32], limit: usize) -> &'a [u32] {
        match self.mode {
            DraftMode::Off => &[],
            DraftMode::Lookup => lookup(context, self.ngram, self.max.min(limit)),
        }
    }
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
    fn modes_parse_and_reserved_ones_say_not_yet() {
        assert_eq!("lookup".parse::<DraftMode>(), Ok(DraftMode::Lookup));
        assert_eq!("off".parse::<DraftMode>(), Ok(DraftMode::Off));
        assert!("mtp".parse::<DraftMode>().unwrap_err().contains("not yet"));
        assert!("auto".parse::<DraftMode>().unwrap_err().contains("not yet"));
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
