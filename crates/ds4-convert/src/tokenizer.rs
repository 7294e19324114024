//! Tokenizer tables for `tokenizer.ggml.*`: from a HF `tokenizer.json`, from an existing
//! GGUF, or generated for tiny test vocabularies.

use std::collections::HashMap;
use std::path::Path;

use ds4_gguf::{Header, Value, ValueType};
use ds4_model::layout::{placeholder_tokenizer, TokenizerData};

use crate::error::{io_err, ConvertError, Result};

/// ggml token types.
pub const TOKEN_NORMAL: i32 = 1;
pub const TOKEN_CONTROL: i32 = 3;
pub const TOKEN_USER_DEFINED: i32 = 4;
pub const TOKEN_UNUSED: i32 = 5;

/// The seven strings ds4 requires (docs/gguf.md §3.3), at their V4 ids.
pub const DS4_SPECIALS: [(&str, usize); 7] = [
    ("<｜begin▁of▁sentence｜>", 0),
    ("<｜end▁of▁sentence｜>", 1),
    ("<｜User｜>", 128_803),
    ("<｜Assistant｜>", 128_804),
    ("<think>", 128_821),
    ("</think>", 128_822),
    ("｜DSML｜", 128_825),
];

/// Largest vocabulary accepted from a tokenizer file (ids are i32 in ggml; this also keeps a
/// hostile file from making us allocate by an id it names).
const MAX_VOCAB: usize = 1 << 24;

fn tok_err(path: &Path, message: impl Into<String>) -> ConvertError {
    ConvertError::Tokenizer {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Whether llama.cpp's converter marks an added token CONTROL although `tokenizer.json` does
/// not call it special (its `does_token_look_special`): in the V4 vocabulary this makes the
/// `<｜…｜>` chat markers control tokens, as in the published GGUFs.
fn looks_special(s: &str) -> bool {
    matches!(s, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (s.starts_with("<|") && s.ends_with("|>") && s.len() >= 4)
        || (s.starts_with("<｜") && s.ends_with("｜>") && s.len() >= 8)
        || (s.starts_with("<unused") && s.ends_with('>'))
}

/// Reads a HF `tokenizer.json` (BPE model) into GGUF tables.
///
/// id → text is `model.vocab` inverted and overridden by `added_tokens[].content`; merges are
/// written `"left right"`; types are NORMAL for the BPE vocabulary, CONTROL for added tokens
/// that are special (or look special, as llama.cpp decides), USER_DEFINED for other added
/// tokens. Ids missing from both tables become `[PAD{id}]` with type UNUSED, as llama.cpp
/// fills them. `min_vocab` pads the table up to a model's `vocab_size`.
pub fn from_hf_json(path: &Path, min_vocab: usize) -> Result<TokenizerData> {
    let text = std::fs::read(path).map_err(io_err(path))?;
    let json: serde_json::Value =
        serde_json::from_slice(&text).map_err(|source| ConvertError::Json {
            path: path.to_path_buf(),
            source,
        })?;
    from_hf_value(path, &json, min_vocab)
}

pub fn from_hf_value(
    path: &Path,
    json: &serde_json::Value,
    min_vocab: usize,
) -> Result<TokenizerData> {
    let model = json
        .get("model")
        .ok_or_else(|| tok_err(path, "no \"model\" object"))?;
    if let Some(t) = model.get("type").and_then(|t| t.as_str()) {
        if t != "BPE" {
            return Err(tok_err(
                path,
                format!(
                    "model.type is {t:?}; only BPE tokenizers map to tokenizer.ggml.model = gpt2"
                ),
            ));
        }
    }
    let vocab = model
        .get("vocab")
        .and_then(|v| v.as_object())
        .ok_or_else(|| tok_err(path, "model.vocab is not an object"))?;
    let mut by_id: HashMap<usize, (String, i32)> = HashMap::with_capacity(vocab.len());
    let id_of = |v: &serde_json::Value, what: &str| -> Result<usize> {
        v.as_u64()
            .filter(|&i| (i as usize) < MAX_VOCAB)
            .map(|i| i as usize)
            .ok_or_else(|| {
                tok_err(
                    path,
                    format!("{what}: id {v} is not an integer below {MAX_VOCAB}"),
                )
            })
    };
    for (s, id) in vocab {
        let id = id_of(id, &format!("model.vocab[{s:?}]"))?;
        if let Some((prev, _)) = by_id.insert(id, (s.clone(), TOKEN_NORMAL)) {
            return Err(tok_err(
                path,
                format!("model.vocab gives id {id} to both {prev:?} and {s:?}"),
            ));
        }
    }
    if let Some(added) = json.get("added_tokens") {
        let added = added
            .as_array()
            .ok_or_else(|| tok_err(path, "added_tokens is not an array"))?;
        for (i, a) in added.iter().enumerate() {
            let id = id_of(
                a.get("id").unwrap_or(&serde_json::Value::Null),
                &format!("added_tokens[{i}]"),
            )?;
            let content = a
                .get("content")
                .and_then(|c| c.as_str())
                .ok_or_else(|| tok_err(path, format!("added_tokens[{i}] has no string content")))?;
            let special = a.get("special").and_then(|s| s.as_bool()).unwrap_or(false);
            let ty = if special || looks_special(content) {
                TOKEN_CONTROL
            } else {
                TOKEN_USER_DEFINED
            };
            by_id.insert(id, (content.to_string(), ty));
        }
    }
    let n = by_id
        .keys()
        .max()
        .map(|m| m + 1)
        .unwrap_or(0)
        .max(min_vocab);
    if n > MAX_VOCAB {
        return Err(tok_err(path, format!("vocabulary of {n} ids is too large")));
    }
    let mut tokens = Vec::with_capacity(n);
    let mut token_types = Vec::with_capacity(n);
    for id in 0..n {
        match by_id.remove(&id) {
            Some((s, t)) => {
                tokens.push(s);
                token_types.push(t);
            }
            None => {
                tokens.push(format!("[PAD{id}]"));
                token_types.push(TOKEN_UNUSED);
            }
        }
    }
    let merges = match model.get("merges") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::Array(ms)) => ms
            .iter()
            .enumerate()
            .map(|(i, m)| match m {
                serde_json::Value::String(s) => Ok(s.clone()),
                serde_json::Value::Array(p) if p.len() == 2 => match (p[0].as_str(), p[1].as_str())
                {
                    (Some(a), Some(b)) => Ok(format!("{a} {b}")),
                    _ => Err(tok_err(
                        path,
                        format!("model.merges[{i}] is not a pair of strings"),
                    )),
                },
                _ => Err(tok_err(
                    path,
                    format!("model.merges[{i}] is neither \"a b\" nor [a, b]"),
                )),
            })
            .collect::<Result<_>>()?,
        Some(_) => return Err(tok_err(path, "model.merges is not an array")),
    };
    let find = |s: &str, default: u32| {
        tokens
            .iter()
            .position(|t| t == s)
            .map(|i| i as u32)
            .unwrap_or(default)
    };
    let bos = find(DS4_SPECIALS[0].0, 0);
    let eos = find(DS4_SPECIALS[1].0, 1);
    Ok(TokenizerData {
        tokens,
        merges,
        token_types,
        bos,
        eos,
        pad: eos,
    })
}

/// Reads `tokenizer.ggml.*` back from a GGUF header (e.g. the vocabulary-only fixture).
pub fn from_gguf(path: &Path, h: &Header) -> Result<TokenizerData> {
    let strings = |key: &str| -> Result<Vec<String>> {
        let a = h
            .get(key)
            .and_then(Value::as_array)
            .filter(|a| a.elem_type() == ValueType::String)
            .ok_or_else(|| tok_err(path, format!("{key} is missing or not an array of strings")))?;
        Ok(a.iter()
            .map(|v| v.as_str().unwrap_or_default().to_string())
            .collect())
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?;
    let token_types = match h.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
        Some(a) => a
            .iter()
            .map(|v| v.as_int().and_then(|i| i32::try_from(i).ok()))
            .collect::<Option<Vec<i32>>>()
            .filter(|t| t.len() == tokens.len())
            .ok_or_else(|| {
                tok_err(
                    path,
                    "tokenizer.ggml.token_type must hold one integer per token",
                )
            })?,
        None => vec![TOKEN_NORMAL; tokens.len()],
    };
    let id = |key: &str, default: u32| {
        h.get(key)
            .and_then(Value::as_int)
            .and_then(|v| u32::try_from(v).ok())
            .unwrap_or(default)
    };
    Ok(TokenizerData {
        bos: id("tokenizer.ggml.bos_token_id", 0),
        eos: id("tokenizer.ggml.eos_token_id", 1),
        pad: id("tokenizer.ggml.padding_token_id", 1),
        tokens,
        merges,
        token_types,
    })
}

/// GPT-2's byte-level alphabet: byte `b` → the printable char it is spelled with.
pub fn byte_level_char(b: u8) -> char {
    let printable = |c: u8| (b'!'..=b'~').contains(&c) || (0xA1..=0xAC).contains(&c) || c >= 0xAE;
    if printable(b) {
        return char::from(b);
    }
    let n = (0u8..b).filter(|&c| !printable(c)).count() as u32;
    char::from_u32(256 + n).unwrap_or('?')
}

/// A small but working vocabulary for tiny test models: BOS/EOS at ids 0/1, the 256
/// byte-level tokens (so every text is encodable), the other ds4 markers, then merged tokens
/// built from the byte tokens with matching merge rules, until `n_vocab` ids are used.
/// Deterministic. Vocabularies too small for the 263 fixed entries fall back to
/// [`placeholder_tokenizer`] (strings only, no merges).
pub fn generated_tokenizer(n_vocab: usize) -> TokenizerData {
    let fixed = 2 + 256 + (DS4_SPECIALS.len() - 2);
    if n_vocab < fixed {
        return placeholder_tokenizer(n_vocab);
    }
    let mut tokens: Vec<String> = Vec::with_capacity(n_vocab);
    let mut types = Vec::with_capacity(n_vocab);
    tokens.push(DS4_SPECIALS[0].0.to_string());
    tokens.push(DS4_SPECIALS[1].0.to_string());
    types.extend([TOKEN_CONTROL, TOKEN_CONTROL]);
    for b in 0..=255u8 {
        tokens.push(byte_level_char(b).to_string());
        types.push(TOKEN_NORMAL);
    }
    for (s, _) in &DS4_SPECIALS[2..] {
        tokens.push(s.to_string());
        types.push(if looks_special(s) {
            TOKEN_CONTROL
        } else {
            TOKEN_USER_DEFINED
        });
    }
    // Merges over a fixed alphabet: "Ġ"+letter first (word starts), then letter pairs.
    let letters: Vec<String> = "etaoinshrdlucmfwypvbgkjqxz"
        .chars()
        .map(String::from)
        .collect();
    let space = byte_level_char(b' ').to_string();
    let mut merges = Vec::new();
    let mut pairs = letters.iter().map(|l| (space.clone(), l.clone())).chain(
        letters
            .iter()
            .flat_map(|a| letters.iter().map(move |b| (a.clone(), b.clone()))),
    );
    while tokens.len() < n_vocab {
        match pairs.next() {
            Some((a, b)) => {
                merges.push(format!("{a} {b}"));
                tokens.push(format!("{a}{b}"));
                types.push(TOKEN_NORMAL);
            }
            None => {
                let id = tokens.len();
                tokens.push(format!("[PAD{id}]"));
                types.push(TOKEN_UNUSED);
            }
        }
    }
    TokenizerData {
        tokens,
        merges,
        token_types: types,
        bos: 0,
        eos: 1,
        pad: 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_alphabet_is_a_bijection_with_gpt2_anchors() {
        let chars: std::collections::HashSet<char> = (0..=255u8).map(byte_level_char).collect();
        assert_eq!(chars.len(), 256);
        assert_eq!(byte_level_char(b' '), 'Ġ');
        assert_eq!(byte_level_char(b'\n'), 'Ċ');
        assert_eq!(byte_level_char(b'A'), 'A');
        assert_eq!(byte_level_char(0), 'Ā');
    }

    #[test]
    fn generated_vocab_is_consistent() {
        let t = generated_tokenizer(512);
        assert_eq!(t.tokens.len(), 512);
        assert_eq!(t.token_types.len(), 512);
        let set: std::collections::HashSet<&String> = t.tokens.iter().collect();
        assert_eq!(set.len(), 512, "token strings must be unique");
        for (s, _) in DS4_SPECIALS {
            assert!(t.tokens.iter().any(|x| x == s), "{s}");
        }
        // Every merge joins two existing tokens into an existing token.
        for m in &t.merges {
            let (a, b) = m.split_once(' ').unwrap();
            assert!(set.contains(&a.to_string()) && set.contains(&b.to_string()));
            assert!(set.contains(&format!("{a}{b}")));
        }
        assert_eq!(t.merges.len(), 512 - 263);
        // Tiny vocabularies fall back to the placeholder.
        assert_eq!(generated_tokenizer(100).tokens.len(), 100);
    }

    #[test]
    fn hf_json_tables() {
        let j = serde_json::json!({
            "model": {"type": "BPE", "vocab": {"a": 3, "b": 4, "ab": 5},
                      "merges": ["a b", ["ab", "b"]]},
            "added_tokens": [
                {"id": 0, "content": "<｜begin▁of▁sentence｜>", "special": true},
                {"id": 1, "content": "<｜end▁of▁sentence｜>", "special": true},
                {"id": 6, "content": "<think>", "special": false},
                {"id": 7, "content": "<｜User｜>", "special": false}
            ]
        });
        let t = from_hf_value(Path::new("t.json"), &j, 10).unwrap();
        assert_eq!(t.tokens.len(), 10);
        assert_eq!(t.tokens[2], "[PAD2]");
        assert_eq!(t.tokens[5], "ab");
        assert_eq!(t.merges, vec!["a b", "ab b"]);
        assert_eq!(t.token_types, vec![3, 3, 5, 1, 1, 1, 4, 3, 5, 5]);
        let bad = serde_json::json!({"model": {"vocab": {"a": -1}}});
        let e = from_hf_value(Path::new("t.json"), &bad, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("model.vocab[\"a\"]"), "{e}");
    }
}
