//! Our pre-tokenizer against HF's (Oniguruma regexes from the V4 tokenizer.json): the
//! code-point classes for every Unicode scalar value, and piece boundaries for random strings
//! over an alphabet that covers every class and regex branch.

mod common;

use proptest::prelude::*;
use tokenizers::utils::SysRegex;

/// Every scalar value except NUL and surrogates, in order.
fn all_chars() -> String {
    (1u32..0x11_0000).filter_map(char::from_u32).collect()
}

/// Code points matched by `pattern` (a single-char class) according to Oniguruma.
fn onig_set(pattern: &str, text: &str) -> Vec<char> {
    let re = SysRegex::new(pattern).unwrap();
    re.find_iter(text)
        .flat_map(|(a, b)| text[a..b].chars().collect::<Vec<_>>())
        .collect()
}

#[test]
fn classes_equal_oniguruma_for_every_code_point() {
    let tok = common::tokenizer();
    let text = all_chars();
    // The class table is the only Unicode-data-dependent part of the pre-tokenizer: compare
    // it with what Oniguruma matches, over all 1.1M scalar values.
    for (pattern, probe) in [
        (r"\p{L}+", "L"),
        (r"\p{M}+", "M"),
        (r"\p{P}+", "P"),
        (r"\p{S}+", "S"),
        (r"\p{N}+", "N"),
        (r"\s+", "WS"),
    ] {
        let onig: Vec<char> = onig_set(pattern, &text);
        let ours: Vec<char> = text
            .chars()
            .filter(|&c| tok.char_has_class(c, probe))
            .collect();
        assert_eq!(
            ours.len(),
            onig.len(),
            "class {probe}: {} ours vs {} onig",
            ours.len(),
            onig.len()
        );
        assert_eq!(ours, onig, "class {probe} differs");
    }
}

#[test]
fn pieces_equal_hf_for_every_code_point_in_context() {
    // Each char between contexts that exercise every branch; long strings keep it fast.
    let tok = common::tokenizer();
    let chars: Vec<char> = (1u32..0x11_0000)
        .filter_map(char::from_u32)
        .step_by(7)
        .collect();
    for chunk in chars.chunks(4096) {
        let mut s = String::new();
        for &c in chunk {
            for ctx in ["a{}b ", " {}{} ", "{}\n", ".{}x", "1{}", "日{}"] {
                s.push_str(&ctx.replace("{}", &c.to_string()));
            }
        }
        assert_eq!(tok.pre_tokens(&s), common::hf_pre_tokens(&s));
    }
}

const ALPHABET: &[&str] = &[
    "a",
    "Z",
    "é",
    "ß",
    "Ω",
    "я",
    "ا",
    "ก",
    "한",
    "日",
    "本",
    "ア",
    "ー",
    "・",
    "゛",
    "゙",
    "ゟ",
    "゠",
    "〇",
    "一",
    "\u{0301}",
    "\u{0903}",
    "\u{20dd}",
    "1",
    "٣",
    "½",
    "Ⅻ",
    "²",
    "!",
    "'",
    "(",
    "-",
    ".",
    "/",
    ":",
    "<",
    "@",
    "[",
    "\\",
    "_",
    "`",
    "{",
    "~",
    "«",
    "»",
    "…",
    "—",
    "’",
    "¿",
    "§",
    "$",
    "€",
    "+",
    "=",
    "^",
    "|",
    "©",
    "😀",
    "🏽",
    "\u{200d}",
    "\u{fe0f}",
    " ",
    "  ",
    "\t",
    "\n",
    "\r",
    "\r\n",
    "\u{a0}",
    "\u{3000}",
    "\u{2028}",
    "\u{85}",
    "\u{b}",
    "\u{c}",
    "\u{200b}",
    "\u{feff}",
    "\u{1}",
    "\u{e000}",
    "\u{10ffff}",
    "\u{378}",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, .. ProptestConfig::default() })]

    #[test]
    fn pieces_equal_hf_on_random_strings(ix in prop::collection::vec(0..ALPHABET.len(), 0..24)) {
        let s: String = ix.into_iter().map(|i| ALPHABET[i]).collect();
        let tok = common::tokenizer();
        prop_assert_eq!(tok.pre_tokens(&s), common::hf_pre_tokens(&s), "{:?}", s);
        prop_assert_eq!(tok.encode(&s, false).unwrap(), common::hf_plain_ids(&s));
    }
}
