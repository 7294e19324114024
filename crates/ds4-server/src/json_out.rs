//! An ordered JSON object writer. Wire bodies keep the key order of the spec's examples
//! (clients do not care, but diffs against ds4 output and humans reading traces do), and
//! strings use ds4's output escaping (`ds4_chat::json::escape`: UTF-8 and `/` stay raw).
//! `serde_json`'s `preserve_order` would do the same but is a workspace-wide feature switch.

use ds4_chat::json::escape;

/// Builds one JSON object, key by key, in insertion order.
#[derive(Debug, Clone)]
pub struct Obj {
    buf: String,
    first: bool,
}

impl Default for Obj {
    fn default() -> Self {
        Self::new()
    }
}

impl Obj {
    pub fn new() -> Obj {
        Obj {
            buf: String::from("{"),
            first: true,
        }
    }

    fn key(&mut self, k: &str) {
        if !self.first {
            self.buf.push(',');
        }
        self.first = false;
        self.buf.push_str(&escape(k));
        self.buf.push(':');
    }

    /// A string member.
    pub fn str(mut self, k: &str, v: &str) -> Obj {
        self.key(k);
        self.buf.push_str(&escape(v));
        self
    }

    /// A member whose value is already serialized JSON.
    pub fn raw(mut self, k: &str, v: &str) -> Obj {
        self.key(k);
        self.buf.push_str(v);
        self
    }

    pub fn num(mut self, k: &str, v: u64) -> Obj {
        self.key(k);
        self.buf.push_str(&v.to_string());
        self
    }

    pub fn int(mut self, k: &str, v: i64) -> Obj {
        self.key(k);
        self.buf.push_str(&v.to_string());
        self
    }

    pub fn bool(mut self, k: &str, v: bool) -> Obj {
        self.key(k);
        self.buf.push_str(if v { "true" } else { "false" });
        self
    }

    pub fn null(mut self, k: &str) -> Obj {
        self.key(k);
        self.buf.push_str("null");
        self
    }

    /// A string member, or `null` when absent.
    pub fn opt_str(self, k: &str, v: Option<&str>) -> Obj {
        match v {
            Some(v) => self.str(k, v),
            None => self.null(k),
        }
    }

    /// Adds the member only when `v` is `Some`.
    pub fn maybe_raw(self, k: &str, v: Option<&str>) -> Obj {
        match v {
            Some(v) => self.raw(k, v),
            None => self,
        }
    }

    pub fn end(mut self) -> String {
        self.buf.push('}');
        self.buf
    }
}

/// A JSON array of already-serialized values.
pub fn arr<I: IntoIterator<Item = String>>(items: I) -> String {
    let mut out = String::from("[");
    for (i, it) in items.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&it);
    }
    out.push(']');
    out
}

/// A JSON string literal (ds4 escaping).
pub fn s(v: &str) -> String {
    escape(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_order_and_escapes() {
        let o = Obj::new()
            .str("b", "x\"y\n/é")
            .num("a", 3)
            .raw("c", &arr(["1".to_string(), s("z")]))
            .null("d")
            .bool("e", false)
            .int("f", -2)
            .opt_str("g", None)
            .maybe_raw("h", None)
            .end();
        assert_eq!(
            o,
            r#"{"b":"x\"y\n/é","a":3,"c":[1,"z"],"d":null,"e":false,"f":-2,"g":null}"#
        );
        let v: serde_json::Value = serde_json::from_str(&o).unwrap();
        assert_eq!(v["b"], "x\"y\n/é");
        assert_eq!(Obj::new().end(), "{}");
        assert_eq!(arr(Vec::<String>::new()), "[]");
    }
}
