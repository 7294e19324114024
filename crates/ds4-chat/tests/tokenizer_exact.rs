//! Exactness against HF `tokenizers` on the real V4 tokenizer.json: every corpus file, three
//! special-token modes, ids identical and decode an exact inverse. Our tokenizer is built the
//! way the engine builds it, `Tokenizer::from_gguf_header` on the vocabulary-only GGUF fixture;
//! the expected ids come from Python HF `tokenizers` on the original tokenizer.json.

mod common;

use ds4_chat::tokenizer::SpecialTokens;
use std::time::Instant;

#[derive(serde::Deserialize)]
struct Manifest {
    files: Vec<Entry>,
    total_bytes: usize,
}

#[derive(serde::Deserialize)]
struct Entry {
    name: String,
    bytes: usize,
    sha1: String,
}

#[test]
fn corpus_ids_match_hf_reference_exactly() {
    let dir = common::corpus_dir();
    let manifest: Manifest =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected/manifest.json")).unwrap())
            .unwrap();
    assert!(
        manifest.total_bytes >= 2_000_000,
        "corpus must be >= 2 MB, is {}",
        manifest.total_bytes
    );
    let t0 = Instant::now();
    let tok = common::tokenizer();
    eprintln!(
        "tokenizer built from {} in {:?}",
        common::vocab_gguf_path().display(),
        t0.elapsed()
    );
    assert_eq!(tok.vocab_size(), 129_280);

    let (mut files, mut bytes, mut tokens, mut mismatched_files) = (0, 0, 0usize, Vec::new());
    for e in &manifest.files {
        let data = std::fs::read(dir.join("text").join(format!("{}.txt", e.name))).unwrap();
        assert_eq!(
            data.len(),
            e.bytes,
            "{}: size changed, rerun make_expected.py",
            e.name
        );
        assert_eq!(
            sha1_smol::Sha1::from(&data).digest().to_string(),
            e.sha1,
            "{}: content changed, rerun make_expected.py",
            e.name
        );
        let text = std::str::from_utf8(&data).unwrap();
        let all = common::read_ids(&dir.join("expected").join(format!("{}.all.u32.gz", e.name)));
        for (mode, suffix) in [
            (SpecialTokens::All, "all"),
            (SpecialTokens::None, "plain"),
            (SpecialTokens::ChatMarkers, "markers"),
        ] {
            let path = dir
                .join("expected")
                .join(format!("{}.{suffix}.u32.gz", e.name));
            let expected = if path.exists() {
                common::read_ids(&path)
            } else {
                all.clone()
            };
            let got = tok.encode_with(text, mode).unwrap();
            if got != expected {
                let i = got
                    .iter()
                    .zip(&expected)
                    .position(|(a, b)| a != b)
                    .unwrap_or(got.len().min(expected.len()));
                mismatched_files.push(format!(
                    "{} [{suffix}]: first difference at token {i}: got {:?} expected {:?}",
                    e.name,
                    &got[i..(i + 8).min(got.len())],
                    &expected[i..(i + 8).min(expected.len())]
                ));
                continue;
            }
            // Exact inverse, byte for byte.
            assert_eq!(
                tok.decode(&got).unwrap(),
                data,
                "{} [{suffix}]: decode is not the inverse",
                e.name
            );
            tokens += got.len();
        }
        files += 1;
        bytes += data.len();
    }
    eprintln!("corpus: {files} files, {bytes} bytes, {tokens} tokens checked over 3 modes, {} mismatching", mismatched_files.len());
    assert!(
        mismatched_files.is_empty(),
        "mismatches:\n{}",
        mismatched_files.join("\n")
    );
}

#[test]
fn inferred_added_tokens_equal_token_types() {
    // A GGUF without tokenizer.ggml.token_type: added tokens are inferred from the merges.
    let v = common::vocab();
    let inferred = ds4_chat::Tokenizer::from_vocab(&v.tokens, &v.merges, &[]).unwrap();
    let tok = common::tokenizer();
    let text =
        std::fs::read_to_string(common::corpus_dir().join("text/gen_all_added.txt")).unwrap();
    assert_eq!(
        inferred.encode(&text, true).unwrap(),
        tok.encode(&text, true).unwrap()
    );
}
