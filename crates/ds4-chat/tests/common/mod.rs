//! Shared test helpers: the real V4 vocabulary (GGUF-style tables dumped from the reference
//! tokenizer.json by tools/tokenizer/dump_vocab.py) and the committed corpus.
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

#[derive(serde::Deserialize)]
pub struct VocabTables {
    pub tokens: Vec<String>,
    pub merges: Vec<String>,
    pub token_type: Vec<i32>,
}

/// TODO(vocab fixture): switch to the vocabulary-only GGUF produced by `ds4-convert` once it
/// exists; these are the same three arrays.
pub fn vocab() -> &'static VocabTables {
    static V: OnceLock<VocabTables> = OnceLock::new();
    V.get_or_init(|| {
        let raw = gunzip(&corpus_dir().join("v4-vocab.json.gz"));
        serde_json::from_slice(&raw).expect("v4-vocab.json.gz is valid JSON")
    })
}

pub fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let v = vocab();
        Tokenizer::from_vocab(&v.tokens, &v.merges, &v.token_type).expect("V4 vocabulary builds")
    })
}

pub fn read_ids(path: &std::path::Path) -> Vec<u32> {
    let raw = gunzip(path);
    assert_eq!(raw.len() % 4, 0, "{}: not a u32 array", path.display());
    raw.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}
