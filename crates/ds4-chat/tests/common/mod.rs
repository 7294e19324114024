//! Shared test helpers: the real V4 vocabulary from the committed vocabulary-only GGUF
//! (`tests/fixtures/vocab/deepseek-v4-vocab.gguf`, written by `ds4-convert vocab` from the
//! reference tokenizer.json) and the committed corpus.
#![allow(dead_code)]

use std::io::Read;
use std::path::PathBuf;
use std::sync::OnceLock;

use ds4_chat::Tokenizer;

/// Repository root (two levels above this crate).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn corpus_dir() -> PathBuf {
    repo_root().join("tests/corpus")
}

pub fn gunzip(path: &std::path::Path) -> Vec<u8> {
    let f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(f)
        .read_to_end(&mut out)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    out
}

/// The vocabulary-only GGUF fixture: the 129,280 tokens, merges and token types of the real
/// tokenizer, no tensors. The engine reads exactly these `tokenizer.ggml.*` keys.
pub fn vocab_gguf_path() -> PathBuf {
    repo_root().join("tests/fixtures/vocab/deepseek-v4-vocab.gguf")
}

/// The parsed fixture (header only matters: it has zero tensors).
pub fn vocab_gguf() -> &'static ds4_gguf::GgufFile {
    static F: OnceLock<ds4_gguf::GgufFile> = OnceLock::new();
    F.get_or_init(|| {
        let path = vocab_gguf_path();
        ds4_gguf::GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    })
}

/// The three `tokenizer.ggml.*` arrays of the fixture, for the HF reference pipeline and the
/// inferred-types test (which need the raw tables rather than our tokenizer).
pub struct VocabTables {
    pub tokens: Vec<String>,
    pub merges: Vec<String>,
    pub token_type: Vec<i32>,
}

pub fn vocab() -> &'static VocabTables {
    static V: OnceLock<VocabTables> = OnceLock::new();
    V.get_or_init(|| {
        let h = vocab_gguf().header();
        let array = |key: &str| {
            h.get(key)
                .and_then(ds4_gguf::Value::as_array)
                .unwrap_or_else(|| panic!("fixture lacks {key}"))
        };
        let strings = |key: &str| -> Vec<String> {
            array(key)
                .iter()
                .map(|v| v.as_str().expect("string entry").to_owned())
                .collect()
        };
        VocabTables {
            tokens: strings("tokenizer.ggml.tokens"),
            merges: strings("tokenizer.ggml.merges"),
            token_type: array("tokenizer.ggml.token_type")
                .iter()
                .map(|v| i32::try_from(v.as_int().expect("int entry")).expect("i32 type"))
                .collect(),
        }
    })
}

/// The tokenizer exactly as every binary builds it: `Tokenizer::from_gguf_header` on the
/// fixture's header.
pub fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        Tokenizer::from_gguf_header(vocab_gguf().header()).expect("V4 vocabulary builds")
    })
}

pub fn read_ids(path: &std::path::Path) -> Vec<u32> {
    let raw = gunzip(path);
    assert_eq!(raw.len() % 4, 0, "{}: not a u32 array", path.display());
    raw.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// HF's complete pipeline built from the same tables — the reference our tokenizer is compared
/// with: BPE model + the V4 pre-tokenizer sequence, exactly as in the V4 tokenizer.json.
pub fn hf_reference() -> &'static tokenizers::Tokenizer {
    use tokenizers::models::bpe::{Vocab, BPE};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::SplitDelimiterBehavior;
    static T: OnceLock<tokenizers::Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let v = vocab();
        let vocab: Vocab = v.tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let merges = v
            .merges
            .iter()
            .map(|m| {
                let (a, b) = m.split_once(' ').unwrap();
                (a.to_owned(), b.to_owned())
            })
            .collect();
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().unwrap();
        let splits = [
            r"\p{N}{1,3}",
            "[一-龥぀-ゟ゠-ヿ]+",
            "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
        ];
        let mut steps: Vec<tokenizers::PreTokenizerWrapper> = splits
            .iter()
            .map(|p| Split::new(SplitPattern::Regex((*p).to_owned()), SplitDelimiterBehavior::Isolated, false).unwrap().into())
            .collect();
        steps.push(ByteLevel::new(false, true, false).into());
        let mut t = tokenizers::Tokenizer::new(bpe);
        t.with_pre_tokenizer(Some(Sequence::new(steps)));
        t
    })
}

/// Plain-text ids from the HF reference pipeline.
pub fn hf_plain_ids(text: &str) -> Vec<u32> {
    hf_reference()
        .encode_fast(text, false)
        .unwrap()
        .get_ids()
        .to_vec()
}

/// Pre-token strings from the HF reference pre-tokenizer.
pub fn hf_pre_tokens(text: &str) -> Vec<String> {
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
    let mut pts = PreTokenizedString::from(text);
    hf_reference()
        .get_pre_tokenizer()
        .unwrap()
        .pre_tokenize(&mut pts)
        .unwrap();
    pts.get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(_, (a, b), _)| text[a..b].to_owned())
        .collect()
}
