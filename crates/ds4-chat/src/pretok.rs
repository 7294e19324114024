//! Hand-written equivalent of the V4 pre-tokenizer regex sequence (docs/chat.md §4.1).
//!
//! Why not HF's `Split` pre-tokenizers: on this three-regex sequence they run at well under
//! 1 MB/s (Oniguruma plus `NormalizedString` bookkeeping per piece), far from the issue's
//! 0.5 s per MB. This scanner does the same splits with a code-point class table. Equivalence
//! is tested, not argued: the corpus test compares final ids with the Python reference, and
//! `tests/pretok_equivalence.rs` compares pieces with HF's own pre-tokenizer for every code
//! point in many contexts and for random strings.
//!
//! The three steps, each applied to every piece of the previous one ("Isolated": matches and
//! the gaps between them both become pieces; a look-ahead sees only its own piece):
//! 1. `\p{N}{1,3}`
//! 2. `[一-龥぀-ゟ゠-ヿ]+`
//! 3. `[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+ | [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+ |
//!    ␠?[\p{P}\p{S}]+[\r\n]* | \s*[\r\n]+ | \s+(?!\S) | \s+` (first alternative that matches).

use regex_syntax::hir::{Class, HirKind};

const L: u8 = 1;
const M: u8 = 2;
const P: u8 = 4;
const S: u8 = 8;
const N: u8 = 16;
const WS: u8 = 32;
const CJK: u8 = 64;

/// Per-code-point class bits, from the Unicode 16 tables of `regex-syntax` (the same Unicode
/// version as the Oniguruma that HF `tokenizers` uses).
pub(crate) struct Classes {
    table: Vec<u8>,
}

impl Classes {
    pub(crate) fn new() -> Self {
        let mut table = vec![0u8; 0x11_0000];
        for (pattern, bit) in [
            (r"\p{L}", L),
            (r"\p{M}", M),
            (r"\p{P}", P),
            (r"\p{S}", S),
            (r"\p{N}", N),
            (r"\s", WS),
        ] {
            // These fixed patterns always parse to a Unicode class.
            let hir = regex_syntax::Parser::new().parse(pattern).ok();
            if let Some(HirKind::Class(Class::Unicode(cls))) = hir.as_ref().map(|h| h.kind()) {
                for r in cls.ranges() {
                    for t in &mut table[r.start() as usize..=r.end() as usize] {
                        *t |= bit;
                    }
                }
            }
        }
        for (lo, hi) in [(0x4E00, 0x9FA5), (0x3040, 0x309F), (0x30A0, 0x30FF)] {
            for t in &mut table[lo..=hi] {
                *t |= CJK;
            }
        }
        Self { table }
    }

    pub(crate) fn has(&self, c: char, name: &str) -> bool {
        let bit = match name {
            "L" => L,
            "M" => M,
            "P" => P,
            "S" => S,
            "N" => N,
            "WS" => WS,
            "CJK" => CJK,
            _ => return false,
        };
        self.of(c) & bit != 0
    }

    #[inline]
    fn of(&self, c: char) -> u8 {
        self.table[c as usize]
    }
}

/// A char of the piece being scanned, with its byte offset and class.
#[derive(Clone, Copy)]
pub(crate) struct Ch {
    at: usize,
    c: char,
    k: u8,
}

fn is_ascii_punct(c: char) -> bool {
    c.is_ascii_punctuation()
}

/// Calls `f` with the byte range of every final piece of `text`, in order.
pub(crate) fn pre_tokenize(
    cls: &Classes,
    text: &str,
    buf: &mut Vec<Ch>,
    mut f: impl FnMut(usize, usize),
) {
    // Steps 1 and 2 only cut at class boundaries, so they are done in one pass that yields
    // step-2 pieces; step 3 then scans each piece.
    buf.clear();
    buf.extend(text.char_indices().map(|(at, c)| Ch {
        at,
        c,
        k: cls.of(c),
    }));
    let chars = &buf[..];
    let end_of = |i: usize| {
        if i < chars.len() {
            chars[i].at
        } else {
            text.len()
        }
    };
    let mut i = 0;
    while i < chars.len() {
        if chars[i].k & N != 0 {
            // Step 1: a digit run, cut in groups of three chars.
            let mut j = i;
            while j < chars.len() && chars[j].k & N != 0 {
                j += 1;
            }
            let mut a = i;
            while a < j {
                let b = (a + 3).min(j);
                // A pure-number piece: no step-2/3 alternative can match inside it.
                f(chars[a].at, end_of(b));
                a = b;
            }
            i = j;
            continue;
        }
        // A step-1 gap: chars up to the next digit. Step 2 splits it at CJK runs.
        let mut j = i;
        while j < chars.len() && chars[j].k & N == 0 {
            j += 1;
        }
        let gap = &chars[i..j];
        let mut a = 0;
        while a < gap.len() {
            let cjk = gap[a].k & CJK != 0;
            let mut b = a;
            while b < gap.len() && (gap[b].k & CJK != 0) == cjk {
                b += 1;
            }
            let piece_end = if i + b < chars.len() {
                chars[i + b].at
            } else {
                text.len()
            };
            split_step3(&gap[a..b], piece_end, &mut f);
            a = b;
        }
        i = j;
    }
}

/// Step 3 over one piece (`end` = byte offset just past it).
fn split_step3(p: &[Ch], end: usize, f: &mut impl FnMut(usize, usize)) {
    let n = p.len();
    let at = |i: usize| if i < n { p[i].at } else { end };
    let mut gap_start = 0;
    let mut i = 0;
    while i < n {
        match match_at(p, i) {
            Some(e) => {
                if gap_start < i {
                    f(at(gap_start), at(i));
                }
                f(at(i), at(e));
                i = e;
                gap_start = e;
            }
            None => i += 1,
        }
    }
    if gap_start < n {
        f(at(gap_start), end);
    }
}

/// End (char index) of the step-3 match starting at char `i`, if any alternative matches.
fn match_at(p: &[Ch], i: usize) -> Option<usize> {
    let n = p.len();
    let k = |j: usize| p[j].k;
    let run = |mut j: usize, mask: u8| {
        while j < n && k(j) & mask != 0 {
            j += 1;
        }
        j
    };
    let c = p[i].c;
    // A: one ASCII punctuation char + ASCII letters.
    if is_ascii_punct(c) && i + 1 < n && p[i + 1].c.is_ascii_alphabetic() {
        let mut j = i + 1;
        while j < n && p[j].c.is_ascii_alphabetic() {
            j += 1;
        }
        return Some(j);
    }
    // B: optional char that is not CR/LF/letter/punct/symbol, then letters/marks.
    let not_lps = c != '\r' && c != '\n' && k(i) & (L | P | S) == 0;
    if not_lps && i + 1 < n && k(i + 1) & (L | M) != 0 {
        return Some(run(i + 1, L | M));
    }
    if k(i) & (L | M) != 0 {
        return Some(run(i, L | M));
    }
    // C: optional space, punct/symbol run, CR/LF run.
    let ps_from = if c == ' ' && i + 1 < n && k(i + 1) & (P | S) != 0 {
        i + 1
    } else {
        i
    };
    if k(ps_from) & (P | S) != 0 {
        let mut j = run(ps_from, P | S);
        while j < n && (p[j].c == '\r' || p[j].c == '\n') {
            j += 1;
        }
        return Some(j);
    }
    if k(i) & WS == 0 {
        return None;
    }
    let w = run(i, WS);
    // D: whitespace through its last CR/LF.
    if let Some(last) = (i..w).rev().find(|&j| p[j].c == '\r' || p[j].c == '\n') {
        return Some(last + 1);
    }
    // E: whitespace not followed by a non-space (all of it at the end of the piece, else all
    // but the last char); F: any whitespace run.
    if w == n {
        return Some(w);
    }
    if w - i >= 2 {
        return Some(w - 1);
    }
    Some(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str) -> Vec<&str> {
        let cls = Classes::new();
        let mut out = Vec::new();
        pre_tokenize(&cls, text, &mut Vec::new(), |a, b| out.push(&text[a..b]));
        out
    }

    #[test]
    fn spec_examples() {
        // docs/chat.md §4.3 divergence examples: the HF behaviour.
        assert_eq!(pieces("»\n"), ["»\n"]);
        assert_eq!(pieces(")–"), [")–"]);
        assert_eq!(pieces("….b"), ["….", "b"]);
        assert_eq!(pieces(" ٢"), [" ", "٢"]);
        assert_eq!(pieces(" 2048 divided"), [" ", "204", "8", " divided"]);
        assert_eq!(
            pieces("Hello  world\n\n  x"),
            ["Hello", " ", " world", "\n\n", " ", " x"]
        );
        assert_eq!(pieces("end   "), ["end", "   "]);
        assert_eq!(pieces("日本・語です"), ["日本", "・", "語です"]);
        assert_eq!(pieces(":\nreturn"), [":\n", "return"]);
        assert_eq!(pieces("(buf"), ["(buf"]);
    }
}
