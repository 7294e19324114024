//! Tokenizer API behaviour on the real V4 vocabulary: special-token policies, streaming
//! decode of cut UTF-8, CLI token-level rendering, and refusals of bad vocabularies.

mod common;

use ds4_chat::render::{CliPrompt, ThinkingMode, MAX_PREFIX};
use ds4_chat::{ChatError, SpecialTokens, Tokenizer};
use proptest::prelude::*;

#[test]
fn markers_have_spec_ids() {
    let m = common::tokenizer().markers();
    assert_eq!(
        (
            m.bos,
            m.eos,
            m.user,
            m.assistant,
            m.think_open,
            m.think_close,
            m.dsml
        ),
        (0, 1, 128803, 128804, 128821, 128822, 128825)
    );
    assert_eq!(common::tokenizer().vocab_size(), 129_280);
}

#[test]
fn special_policies() {
    let tok = common::tokenizer();
    let text = "a<｜User｜>b<｜tool▁sep｜>c</think>";
    let all = tok.encode_with(text, SpecialTokens::All).unwrap();
    let chat = tok.encode_with(text, SpecialTokens::ChatMarkers).unwrap();
    let none = tok.encode_with(text, SpecialTokens::None).unwrap();
    assert!(all.contains(&128803) && all.contains(&128814) && all.contains(&128822));
    assert!(chat.contains(&128803) && !chat.contains(&128814) && chat.contains(&128822));
    assert!(none.iter().all(|&i| i < 128_000));
    for ids in [&all, &chat, &none] {
        assert_eq!(tok.decode(ids).unwrap(), text.as_bytes());
    }
    assert_eq!(tok.encode(text, true).unwrap(), all);
    assert_eq!(tok.encode(text, false).unwrap(), none);
    assert_eq!(tok.encode_chat(text).unwrap(), chat);
    assert!(tok.encode("", true).unwrap().is_empty());
}

#[test]
fn stream_decoder_holds_cut_utf8() {
    let tok = common::tokenizer();
    // Emoji, CJK and ZWJ sequences are split across byte-level tokens.
    let text = "😀👨‍👩‍👧‍👦 日本語 🇮🇹 é ‍";
    let ids = tok.encode(text, false).unwrap();
    let mut dec = tok.stream_decoder();
    let mut out = String::new();
    let mut saw_hold = false;
    for &id in &ids {
        let piece = dec.push(id).unwrap();
        saw_hold |= !dec.pending().is_empty();
        assert!(dec.pending().len() <= 3);
        out.push_str(&piece);
    }
    out.push_str(&dec.finish());
    assert_eq!(out, text);
    assert!(saw_hold, "test text should cut a UTF-8 sequence somewhere");
    assert!(matches!(
        tok.stream_decoder().push(129_280),
        Err(ChatError::UnknownTokenId { id: 129_280, .. })
    ));
    assert!(tok.decode(&[5, 1_000_000]).is_err());
}

#[test]
fn cli_prompt_tokens() {
    let tok = common::tokenizer();
    let p = CliPrompt {
        system: Some("You are a helpful assistant"),
        prompt: "Hi </think>",
        mode: ThinkingMode::Think,
    };
    let ids = p.tokens(tok).unwrap();
    let mut expected = vec![0];
    expected.extend(tok.encode("You are a helpful assistant", false).unwrap());
    expected.push(128803);
    expected.extend(tok.encode("Hi </think>", false).unwrap());
    expected.extend([128804, 128821]);
    assert_eq!(ids, expected);
    assert!(
        !ids[1..ids.len() - 1].contains(&128822),
        "prompt text must not turn into markers"
    );
    let max = CliPrompt {
        system: None,
        prompt: "x",
        mode: ThinkingMode::ThinkMax,
    }
    .tokens(tok)
    .unwrap();
    assert_eq!(
        &max[1..max.len() - 4],
        &tok.encode(MAX_PREFIX, false).unwrap()[..]
    );
    // A prompt starting with the BOS string is a rendered chat string.
    let raw = CliPrompt {
        system: Some("ignored"),
        prompt: "<｜begin▁of▁sentence｜><｜User｜>x<｜Assistant｜></think>",
        mode: ThinkingMode::Think,
    };
    let x = tok.encode("x", false).unwrap();
    assert_eq!(x.len(), 1);
    assert_eq!(
        raw.tokens(tok).unwrap(),
        vec![0, 128803, x[0], 128804, 128822]
    );
}

#[test]
fn bad_vocabularies_are_refused() {
    let toks = ["a", "b", "ab"];
    let err = |r: Result<Tokenizer, ChatError>| r.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err(Tokenizer::from_vocab::<&str, &str>(&[], &[], &[])).contains("empty"));
    assert!(err(Tokenizer::from_vocab(&toks, &["a b"], &[1, 1])).contains("token_type has 2"));
    assert!(err(Tokenizer::from_vocab(&toks, &["ab"], &[])).contains("no space"));
    assert!(err(Tokenizer::from_vocab(&toks, &["a c"], &[])).contains("is not in the vocabulary"));
    assert!(
        err(Tokenizer::from_vocab(&toks, &["a b"], &[1, 1, 9])).contains("unknown token type 9")
    );
    // A vocabulary without the chat markers is refused like ds4 does.
    assert!(
        err(Tokenizer::from_vocab(&toks, &["a b"], &[1, 1, 1])).contains("<｜begin▁of▁sentence｜>")
    );
}

#[test]
fn tiny_vocabulary_with_markers_works() {
    // Byte-level alphabet + a merge + the seven markers: a self-contained vocabulary.
    let mut toks: Vec<String> = (33u8..=126).map(|b| (b as char).to_string()).collect();
    toks.push("Ġ".into());
    toks.push("ab".into());
    for m in [
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<think>",
        "</think>",
        "｜DSML｜",
    ] {
        toks.push(m.into());
    }
    let n = toks.len();
    let mut types = vec![1; n];
    for t in &mut types[n - 7..] {
        *t = 3;
    }
    let tok = Tokenizer::from_vocab(&toks, &["a b"], &types).unwrap();
    let ab = toks.iter().position(|t| t == "ab").unwrap() as u32;
    let space = toks.iter().position(|t| t == "Ġ").unwrap() as u32;
    let a = toks.iter().position(|t| t == "a").unwrap() as u32;
    assert_eq!(tok.encode("ab a", false).unwrap(), vec![ab, space, a]);
    assert_eq!(
        tok.encode_chat("<think>ab").unwrap(),
        vec![(n - 3) as u32, ab]
    );
    assert_eq!(
        tok.decode(&[ab, space, (n - 1) as u32]).unwrap(),
        "ab ｜DSML｜".as_bytes()
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    /// Random text: encode/decode round trip in every mode and chunk-free streaming decode.
    #[test]
    fn round_trip(text in "\\PC{0,64}") {
        let tok = common::tokenizer();
        for mode in [SpecialTokens::None, SpecialTokens::ChatMarkers, SpecialTokens::All] {
            let ids = tok.encode_with(&text, mode).unwrap();
            prop_assert_eq!(tok.decode(&ids).unwrap(), text.as_bytes());
        }
        let ids = tok.encode(&text, false).unwrap();
        let mut dec = tok.stream_decoder();
        let mut s: String = ids.iter().map(|&i| dec.push(i).unwrap()).collect();
        s.push_str(&dec.finish());
        prop_assert_eq!(s, text);
    }
}
