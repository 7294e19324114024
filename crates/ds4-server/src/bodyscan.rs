//! A bounded pre-scan of a JSON request body, run before any parser builds values from it.
//!
//! The family parsers build `serde_json::Value`s, raw-value maps and messages from the body.
//! A compact body of many tiny values — millions of `{"a":""}` in an ignored field, of empty
//! content parts, of tools — expands 20–80× when parsed that way, before any count or
//! context check could see it. The scan walks the body once with serde, building nothing (a
//! visitor that only counts, like `serde::de::IgnoredAny`), and refuses, with a 400 that
//! names the problem:
//!
//! - a body that is not one JSON object, or nests deeper than serde_json's recursion limit;
//! - a key that appears twice in one object (a second `messages` would bypass the turn count
//!   taken on the first, and parsers disagree on which copy wins);
//! - an array with more items than the context has tokens (messages, content parts, tools,
//!   system blocks, anything: each item of a prompt renders at least one token or is
//!   useless, and no prompt holds more tokens than the context);
//! - a body whose parsed form would be larger than [`PARSE_BYTES_PER_BODY_BYTE`] × its size
//!   (or [`PARSE_ALLOWANCE`] for small bodies), estimated from what it holds: see
//!   [`Counts::parse_estimate`].
//!
//! Budget: a body that passes takes at most `max(16 × its size, 64 MiB)` while it is parsed
//! (the same bound `limits::prepare_concurrency` assumes per request); the scan itself
//! allocates only for objects with more than one key (their keys, to find duplicates) and
//! frees that as it goes. `tests/parse_memory.rs` measures both with a counting allocator.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};

use crate::error::ApiError;

/// A passing body's parsed form is estimated to take at most this many bytes per body byte.
pub const PARSE_BYTES_PER_BODY_BYTE: usize = 16;

/// Bodies whose parsed form is estimated below this always pass the size rule (a small body
/// may be dense, e.g. tool schemas of many short properties).
pub const PARSE_ALLOWANCE: usize = 64 << 20;

/// Estimated bytes of one parsed JSON object (a map node of a `serde_json::Value`, its
/// copies in raw-value maps and the parsers' own records), measured by
/// `tests/parse_memory.rs`.
const OBJECT_BYTES: usize = 768;
/// Estimated bytes of one array.
const ARRAY_BYTES: usize = 96;
/// Estimated bytes of one object member or array item beyond its own value (a key string,
/// a slot in a map node or a vector).
const ITEM_BYTES: usize = 96;
/// The body's bytes are copied this many times at most while it is parsed (raw-value maps,
/// strings, the rendered text).
const BODY_COPIES: usize = 4;

/// What a body holds.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Counts {
    pub objects: usize,
    pub arrays: usize,
    /// Object members plus array items.
    pub items: usize,
    /// Items of the longest array.
    pub longest_array: usize,
}

impl Counts {
    /// Bytes the body may take once parsed: its bytes [`BODY_COPIES`] times plus a fixed
    /// cost per object, array and item (the overhead a `Value` tree and the parsers' records
    /// carry beyond the text itself).
    pub fn parse_estimate(&self, body_len: usize) -> usize {
        body_len
            .saturating_mul(BODY_COPIES)
            .saturating_add(self.objects.saturating_mul(OBJECT_BYTES))
            .saturating_add(self.arrays.saturating_mul(ARRAY_BYTES))
            .saturating_add(self.items.saturating_mul(ITEM_BYTES))
    }
}

/// The most a body of `body_len` bytes may be estimated to take once parsed.
pub fn parse_budget(body_len: usize) -> usize {
    body_len
        .saturating_mul(PARSE_BYTES_PER_BODY_BYTE)
        .max(PARSE_ALLOWANCE)
}

/// What went wrong, kept out of serde's error so the message names the place.
enum Refusal {
    Duplicate(String, String),
    LongArray(String, usize),
}

struct Scan<'a, 'de> {
    counts: &'a mut Counts,
    max_items: usize,
    /// Where the value being scanned sits (for messages), e.g. `messages[3].content`.
    path: &'a mut Vec<Seg<'de>>,
    refusal: &'a mut Option<Refusal>,
}

enum Seg<'de> {
    Key(Cow<'de, str>),
    Index(usize),
}

fn path_text(path: &[Seg<'_>]) -> String {
    let mut s = String::new();
    for seg in path {
        match seg {
            Seg::Key(k) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(k);
            }
            Seg::Index(i) => s.push_str(&format!("[{i}]")),
        }
    }
    if s.is_empty() {
        s.push_str("the body");
    }
    s
}

impl<'de> DeserializeSeed<'de> for Scan<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

/// A key borrowed from the body where it has no escapes.
struct Key<'de>(Cow<'de, str>);

impl<'de> serde::Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string key")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_string())))
            }
        }
        d.deserialize_str(V)
    }
}

/// Keys seen so far in one object: none allocated until a second key arrives, a set once
/// there are many.
enum Seen<'de> {
    None,
    One(Cow<'de, str>),
    Few(Vec<Cow<'de, str>>),
    Many(HashSet<Cow<'de, str>>),
}

impl<'de> Seen<'de> {
    /// Adds `k`; false when it was already there.
    fn insert(&mut self, k: Cow<'de, str>) -> bool {
        const FEW: usize = 16;
        match self {
            Seen::None => *self = Seen::One(k),
            Seen::One(a) => {
                if *a == k {
                    return false;
                }
                let a = std::mem::take(a);
                *self = Seen::Few(vec![a, k]);
            }
            Seen::Few(v) => {
                if v.contains(&k) {
                    return false;
                }
                if v.len() < FEW {
                    v.push(k);
                } else {
                    let mut set: HashSet<_> = std::mem::take(v).into_iter().collect();
                    set.insert(k);
                    *self = Seen::Many(set);
                }
            }
            Seen::Many(s) => return s.insert(k),
        }
        true
    }
}

impl<'de> Visitor<'de> for Scan<'_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.counts.objects += 1;
        let mut seen = Seen::None;
        while let Some(Key(k)) = map.next_key::<Key<'de>>()? {
            self.counts.items += 1;
            if !seen.insert(k.clone()) {
                *self.refusal = Some(Refusal::Duplicate(path_text(self.path), k.into_owned()));
                return Err(A::Error::custom("duplicate key"));
            }
            self.path.push(Seg::Key(k));
            map.next_value_seed(Scan {
                counts: self.counts,
                max_items: self.max_items,
                path: self.path,
                refusal: self.refusal,
            })?;
            self.path.pop();
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.counts.arrays += 1;
        let mut n = 0usize;
        loop {
            if n == self.max_items {
                // One more item is one too many.
                self.path.push(Seg::Index(n));
                let more = seq
                    .next_element_seed(Scan {
                        counts: self.counts,
                        max_items: self.max_items,
                        path: self.path,
                        refusal: self.refusal,
                    })?
                    .is_some();
                self.path.pop();
                if more {
                    *self.refusal = Some(Refusal::LongArray(path_text(self.path), n));
                    return Err(A::Error::custom("array too long"));
                }
                break;
            }
            self.path.push(Seg::Index(n));
            let got = seq
                .next_element_seed(Scan {
                    counts: self.counts,
                    max_items: self.max_items,
                    path: self.path,
                    refusal: self.refusal,
                })?
                .is_some();
            self.path.pop();
            if !got {
                break;
            }
            n += 1;
            self.counts.items += 1;
        }
        self.counts.longest_array = self.counts.longest_array.max(n);
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
}

/// Scans `body` (see the module doc): its counts, or a 400 naming what is wrong. `ctx` is
/// the context size in tokens; no array may hold more items than that.
pub fn check(body: &[u8], ctx: usize) -> Result<Counts, ApiError> {
    const INVALID: &str = "invalid JSON request";
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        return Err(ApiError::bad(format!(
            "{INVALID}: the body must be a JSON object"
        )));
    }
    let mut counts = Counts::default();
    let mut path = Vec::new();
    let mut refusal = None;
    let mut de = serde_json::Deserializer::from_slice(body);
    let scanned = Scan {
        counts: &mut counts,
        max_items: ctx,
        path: &mut path,
        refusal: &mut refusal,
    }
    .deserialize(&mut de)
    .and_then(|()| de.end());
    match (scanned, refusal) {
        (_, Some(Refusal::Duplicate(at, key))) => {
            return Err(ApiError::bad(format!(
                "{INVALID}: key {key:?} appears more than once in {at}"
            )))
        }
        (_, Some(Refusal::LongArray(at, n))) => {
            return Err(ApiError::bad(format!(
            "`{at}` has more than {n} items, more than the context size ({ctx} tokens) could hold"
        )))
        }
        (Err(e), None) => return Err(ApiError::bad(format!("{INVALID}: {e}"))),
        (Ok(()), None) => {}
    }
    let estimate = counts.parse_estimate(body.len());
    let budget = parse_budget(body.len());
    if estimate > budget {
        return Err(ApiError::bad(format!(
            "the body holds {} JSON objects, {} arrays and {} members and items in {} bytes; parsing that would take about {} MiB, more than the {} MiB allowed for a body of its size (send fewer, larger values)",
            counts.objects,
            counts.arrays,
            counts.items,
            body.len(),
            estimate >> 20,
            budget >> 20
        )));
    }
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_refusals() {
        let c = check(br#"{"a":[1,2,{"b":null}],"c":"x"}"#, 10).unwrap();
        assert_eq!(c.objects, 2);
        assert_eq!(c.arrays, 1);
        assert_eq!(c.items, 3 + 3);
        assert_eq!(c.longest_array, 3);
        let msg = |b: &[u8], ctx| check(b, ctx).unwrap_err().message;
        assert!(msg(b"[]", 10).contains("JSON object"));
        assert!(msg(b"{\"a\":", 10).contains("invalid JSON"));
        assert!(msg(b"{} {}", 10).contains("invalid JSON"));
        let m = msg(br#"{"messages":[],"x":1,"messages":[]}"#, 10);
        assert!(m.contains("\"messages\" appears more than once"), "{m}");
        let m = msg(br#"{"m":[{"role":"user","a":1,"role":"x"}]}"#, 10);
        assert!(m.contains("\"role\"") && m.contains("m[0]"), "{m}");
        // Escaped and plain spellings of one key are the same key.
        assert!(msg(br#"{"a":1,"\u0061":2}"#, 10).contains("more than once"));
        // Many keys (past the linear list) are still checked.
        let mut many: String = (0..40).map(|i| format!("\"k{i}\":0,")).collect();
        many.push_str("\"k7\":1");
        assert!(msg(format!("{{{many}}}").as_bytes(), 10).contains("\"k7\""));
        let m = msg(br#"{"messages":[{"content":[1,2,3,4]}]}"#, 3);
        assert!(
            m.contains("`messages[0].content` has more than 3 items"),
            "{m}"
        );
        assert!(check(br#"{"messages":[{"content":[1,2,3]}]}"#, 3).is_ok());
        let deep = format!("{{\"a\":{}{}}}", "[".repeat(200), "]".repeat(200));
        assert!(msg(deep.as_bytes(), 1000).contains("recursion limit"));
    }

    #[test]
    fn dense_bodies_are_refused_by_their_estimate() {
        // 200k one-member objects in 1.6 MB: about 190 MiB once parsed.
        let n = 200_000;
        let mut b = String::from("{\"x\":[");
        for i in 0..n {
            if i > 0 {
                b.push(',');
            }
            b.push_str("{\"a\":\"\"}");
        }
        b.push_str("]}");
        let m = check(b.as_bytes(), 1 << 20).unwrap_err().message;
        assert!(m.contains("200001 JSON objects"), "{m}");
        // The same bytes as one string pass.
        let s = format!("{{\"x\":\"{}\"}}", "a".repeat(b.len()));
        assert!(check(s.as_bytes(), 1 << 20).is_ok());
    }
}
