//! Small, lenient JSON helpers that reproduce ds4's byte behaviour where the rendered prompt or
//! the tool-call arguments depend on it.
//!
//! serde_json cannot be used for these spots: tool-call arguments must keep key order *and*
//! duplicate keys (docs/chat.md §2.5), non-string values are copied minified but with their
//! string escapes untouched, and ds4 accepts a few things strict JSON does not (a missing
//! comma between members, text after the closing brace). Every scanner here is bounded (depth
//! limit, no allocation beyond the input size) and never panics.

/// ds4's nesting ceiling for skipped values.
const MAX_NESTING: usize = 256;

/// C `isspace` on a byte: the whitespace ds4 skips everywhere.
pub(crate) fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

/// A cursor over JSON text.
pub(crate) struct Scanner<'a> {
    s: &'a str,
    pub(crate) pos: usize,
}

impl<'a> Scanner<'a> {
    pub(crate) fn new(s: &'a str) -> Self {
        Self { s, pos: 0 }
    }

    pub(crate) fn peek(&self) -> Option<u8> {
        self.s.as_bytes().get(self.pos).copied()
    }

    pub(crate) fn ws(&mut self) {
        while self.peek().is_some_and(is_space) {
            self.pos += 1;
        }
    }

    pub(crate) fn lit(&mut self, lit: &str) -> bool {
        if self.s[self.pos..].starts_with(lit) {
            self.pos += lit.len();
            true
        } else {
            false
        }
    }

    fn hex4(&mut self) -> Option<u32> {
        let bytes = self.s.as_bytes();
        if bytes.get(self.pos) != Some(&b'\\') || bytes.get(self.pos + 1) != Some(&b'u') {
            return None;
        }
        let digits = bytes.get(self.pos + 2..self.pos + 6)?;
        let mut v = 0u32;
        for &d in digits {
            v = (v << 4) | (d as char).to_digit(16)?;
        }
        self.pos += 6;
        Some(v)
    }

    /// A JSON string (after optional whitespace), decoded. Raw control characters are
    /// accepted (as ds4 does); an unpaired surrogate escape becomes U+FFFD.
    pub(crate) fn string(&mut self) -> Option<String> {
        self.ws();
        if self.peek() != Some(b'"') {
            return None;
        }
        self.pos += 1;
        let mut out = String::new();
        loop {
            let rest = &self.s[self.pos..];
            let stop = rest.find(['"', '\\'])?;
            out.push_str(&rest[..stop]);
            self.pos += stop;
            if self.peek() == Some(b'"') {
                self.pos += 1;
                return Some(out);
            }
            // Backslash escape.
            let esc = *self.s.as_bytes().get(self.pos + 1)?;
            match esc {
                b'"' => out.push('"'),
                b'\\' => out.push('\\'),
                b'/' => out.push('/'),
                b'b' => out.push('\u{8}'),
                b'f' => out.push('\u{c}'),
                b'n' => out.push('\n'),
                b'r' => out.push('\r'),
                b't' => out.push('\t'),
                b'u' => {
                    let cp = self.hex4()?;
                    let c = if (0xd800..0xdc00).contains(&cp) {
                        let save = self.pos;
                        match self.hex4() {
                            Some(lo) if (0xdc00..0xe000).contains(&lo) => {
                                char::from_u32(0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00))
                            }
                            _ => {
                                self.pos = save;
                                None
                            }
                        }
                    } else {
                        char::from_u32(cp)
                    };
                    out.push(c.unwrap_or(char::REPLACEMENT_CHARACTER));
                    continue;
                }
                _ => return None,
            }
            self.pos += 2;
        }
    }

    fn number(&mut self) -> bool {
        // strtod-like: sign, digits, fraction, exponent; needs at least one digit.
        let bytes = self.s.as_bytes();
        let start = self.pos;
        let mut p = self.pos;
        if matches!(bytes.get(p), Some(b'-' | b'+')) {
            p += 1;
        }
        let int_start = p;
        while bytes.get(p).is_some_and(u8::is_ascii_digit) {
            p += 1;
        }
        let mut digits = p > int_start;
        if bytes.get(p) == Some(&b'.') {
            let f = p + 1;
            let mut q = f;
            while bytes.get(q).is_some_and(u8::is_ascii_digit) {
                q += 1;
            }
            if q > f || digits {
                digits |= q > f;
                p = q;
            }
        }
        if !digits {
            self.pos = start;
            return false;
        }
        if matches!(bytes.get(p), Some(b'e' | b'E')) {
            let mut q = p + 1;
            if matches!(bytes.get(q), Some(b'-' | b'+')) {
                q += 1;
            }
            let e = q;
            while bytes.get(q).is_some_and(u8::is_ascii_digit) {
                q += 1;
            }
            if q > e {
                p = q;
            }
        }
        self.pos = p;
        true
    }

    /// Skips one value (after optional whitespace); false if it is not valid (ds4 rules).
    pub(crate) fn skip_value(&mut self) -> bool {
        self.skip_value_depth(0)
    }

    fn skip_value_depth(&mut self, depth: usize) -> bool {
        self.ws();
        match self.peek() {
            Some(b'"') => self.string().is_some(),
            Some(b'{') => {
                if depth >= MAX_NESTING {
                    return false;
                }
                self.pos += 1;
                self.ws();
                if self.peek() == Some(b'}') {
                    self.pos += 1;
                    return true;
                }
                loop {
                    if self.string().is_none() {
                        return false;
                    }
                    self.ws();
                    if self.peek() != Some(b':') {
                        return false;
                    }
                    self.pos += 1;
                    if !self.skip_value_depth(depth + 1) {
                        return false;
                    }
                    self.ws();
                    match self.peek() {
                        Some(b'}') => {
                            self.pos += 1;
                            return true;
                        }
                        Some(b',') => self.pos += 1,
                        _ => return false,
                    }
                }
            }
            Some(b'[') => {
                if depth >= MAX_NESTING {
                    return false;
                }
                self.pos += 1;
                self.ws();
                if self.peek() == Some(b']') {
                    self.pos += 1;
                    return true;
                }
                loop {
                    if !self.skip_value_depth(depth + 1) {
                        return false;
                    }
                    self.ws();
                    match self.peek() {
                        Some(b']') => {
                            self.pos += 1;
                            return true;
                        }
                        Some(b',') => self.pos += 1,
                        _ => return false,
                    }
                }
            }
            _ => self.lit("true") || self.lit("false") || self.lit("null") || self.number(),
        }
    }

    /// The raw text of one value (after optional whitespace).
    pub(crate) fn raw_value(&mut self) -> Option<&'a str> {
        self.ws();
        let start = self.pos;
        if self.skip_value() {
            Some(&self.s[start..self.pos])
        } else {
            None
        }
    }
}

/// ds4 `json_minify_raw_value`: the first JSON value of `json` with all whitespace outside
/// strings removed (string escapes untouched). If no valid value starts the text, the text is
/// returned unchanged.
pub fn minify(json: &str) -> String {
    let mut sc = Scanner::new(json);
    let Some(value) = sc.raw_value() else {
        return json.to_owned();
    };
    let mut out = String::with_capacity(value.len());
    let mut in_string = false;
    let mut escape = false;
    for c in value.chars() {
        if in_string {
            out.push(c);
            if escape {
                escape = false;
            } else if c == '\\' {
                escape = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
            out.push(c);
        } else if !(c.is_ascii() && is_space(c as u8)) {
            out.push(c);
        }
    }
    out
}

/// One member of a tool-call arguments object, as ds4 reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonArg {
    pub key: String,
    /// Decoded string (if `is_string`) or the minified raw JSON value.
    pub value: String,
    pub is_string: bool,
}

/// ds4 `json_args_parse`: the members of a JSON object in order, duplicates kept. Lenient like
/// ds4 (commas optional, text after the closing brace ignored). `None` if `json` does not start
/// with an object or a member is malformed.
pub fn parse_args(json: &str) -> Option<Vec<JsonArg>> {
    let mut sc = Scanner::new(json);
    sc.ws();
    if sc.peek() != Some(b'{') {
        return None;
    }
    sc.pos += 1;
    sc.ws();
    let mut args = Vec::new();
    while let Some(b) = sc.peek() {
        if b == b'}' {
            return Some(args);
        }
        let key = sc.string()?;
        sc.ws();
        if sc.peek() != Some(b':') {
            return None;
        }
        sc.pos += 1;
        sc.ws();
        let (value, is_string) = if sc.peek() == Some(b'"') {
            (sc.string()?, true)
        } else {
            (minify(sc.raw_value()?), false)
        };
        args.push(JsonArg {
            key,
            value,
            is_string,
        });
        sc.ws();
        if sc.peek() == Some(b',') {
            sc.pos += 1;
        }
        sc.ws();
    }
    None
}

/// JSON string literal with ds4's output escaping: `"` `\\` `\n` `\r` `\t`, other bytes below
/// 0x20 as `\u00xx`, everything else (UTF-8, `/`) raw.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    escape_fragment_into(s, &mut out);
    out.push('"');
    out
}

/// [`escape`] without the surrounding quotes (for streamed argument fragments).
pub fn escape_fragment_into(s: &str, out: &mut String) {
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
}

/// ds4 `append_json_object_or_empty`: re-emits an arguments object compactly
/// (`{"k":v,...}`, strings re-escaped, non-strings minified), or `{}` if it does not parse.
/// Every API response carries tool-call arguments in this form.
pub fn compact_object(json: &str) -> String {
    let Some(args) = parse_args(json) else {
        return "{}".to_owned();
    };
    let mut out = String::from("{");
    for (i, a) in args.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&escape(&a.key));
        out.push(':');
        if a.is_string {
            out.push_str(&escape(&a.value));
        } else {
            out.push_str(&a.value);
        }
    }
    out.push('}');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minify_keeps_string_bytes() {
        assert_eq!(
            minify(" { \"a\" : [1, 2], \"b\": \"x  y\\\" z\" } tail"),
            "{\"a\":[1,2],\"b\":\"x  y\\\" z\"}"
        );
        assert_eq!(minify("ten seconds"), "ten seconds");
        assert_eq!(minify("  10 "), "10");
    }

    #[test]
    fn args_keep_order_and_duplicates() {
        let a = parse_args("{\"z\":1,\"a\":\"s\\n\",\"z\":{ \"k\" : null }}").unwrap();
        assert_eq!(
            a,
            vec![
                JsonArg {
                    key: "z".into(),
                    value: "1".into(),
                    is_string: false
                },
                JsonArg {
                    key: "a".into(),
                    value: "s\n".into(),
                    is_string: true
                },
                JsonArg {
                    key: "z".into(),
                    value: "{\"k\":null}".into(),
                    is_string: false
                },
            ]
        );
        assert!(parse_args("not json").is_none());
        assert!(parse_args("[1]").is_none());
        assert!(parse_args("{\"a\":").is_none());
        assert!(parse_args("{\"a\":1").is_none());
        // ds4 leniency: no comma, trailing text.
        assert_eq!(parse_args("{\"a\":1 \"b\":2} junk").unwrap().len(), 2);
    }

    #[test]
    fn strings_decode_escapes_and_surrogates() {
        let mut s = Scanner::new(r#""a\u00e8\ud83d\ude00\ud800x\/""#);
        assert_eq!(s.string().unwrap(), "aè😀\u{fffd}x/");
        assert!(Scanner::new(r#""\q""#).string().is_none());
        assert!(Scanner::new(r#""open"#).string().is_none());
    }

    #[test]
    fn deep_nesting_is_refused_not_overflowed() {
        let deep = "[".repeat(100_000);
        assert!(!Scanner::new(&deep).skip_value());
        let ok = format!("{}{}", "[".repeat(200), "]".repeat(200));
        assert!(Scanner::new(&ok).skip_value());
    }

    #[test]
    fn escape_and_compact() {
        assert_eq!(escape("a\"b\\c\n\u{1}/è"), "\"a\\\"b\\\\c\\n\\u0001/è\"");
        assert_eq!(
            compact_object("{ \"command\": \"ls\", \"t\": { \"a\" : [1, 2] } }"),
            "{\"command\":\"ls\",\"t\":{\"a\":[1,2]}}"
        );
        assert_eq!(compact_object("nope"), "{}");
    }
}
