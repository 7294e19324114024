//! Final (non-streaming) parsing of generated text (docs/chat.md §3.1–3.2): reasoning vs
//! content, and DSML tool-call blocks → tool calls with JSON arguments. Byte behaviour follows
//! ds4's parser, including its leniency (loose nesting, three tag spellings) and its quirks
//! (text after the end tag is dropped; a malformed block turns the *whole* output into content).

use crate::json;

pub(crate) const THINK_OPEN: &str = "<think>";
pub(crate) const THINK_CLOSE: &str = "</think>";

/// One spelling family of the DSML tags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Syntax {
    pub start: &'static str,
    pub end: &'static str,
    pub invoke_start: &'static str,
    pub invoke_end: &'static str,
    pub param_start: &'static str,
    pub param_end: &'static str,
}

/// `<｜DSML｜…>`: what the model is taught.
pub(crate) const FULL: Syntax = Syntax {
    start: "<｜DSML｜tool_calls>",
    end: "</｜DSML｜tool_calls>",
    invoke_start: "<｜DSML｜invoke",
    invoke_end: "</｜DSML｜invoke>",
    param_start: "<｜DSML｜parameter",
    param_end: "</｜DSML｜parameter>",
};
/// `<DSML｜…>`: first bar missing (a frequent sampling slip).
pub(crate) const SHORT: Syntax = Syntax {
    start: "<DSML｜tool_calls>",
    end: "</DSML｜tool_calls>",
    invoke_start: "<DSML｜invoke",
    invoke_end: "</DSML｜invoke>",
    param_start: "<DSML｜parameter",
    param_end: "</DSML｜parameter>",
};
/// Plain XML tags.
pub(crate) const PLAIN: Syntax = Syntax {
    start: "<tool_calls>",
    end: "</tool_calls>",
    invoke_start: "<invoke",
    invoke_end: "</invoke>",
    param_start: "<parameter",
    param_end: "</parameter>",
};
pub(crate) const SYNTAXES: [Syntax; 3] = [FULL, SHORT, PLAIN];

/// A tool call recognised in generated text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedToolCall {
    pub name: String,
    /// Arguments as ds4 builds them: `{"k": v, "k2": v2}` (`, ` and `: ` separators). Not
    /// validated: a non-string value that is not JSON is copied as is.
    pub arguments: String,
}

impl ParsedToolCall {
    /// The arguments as every API response carries them: compact JSON, or `{}` if they do not
    /// parse (e.g. `string="false">ten seconds<`).
    pub fn arguments_compact(&self) -> String {
        json::compact_object(&self.arguments)
    }
}

/// The assistant message recovered from generated text.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ParsedMessage {
    /// Text before the first `</think>` (after a leading `<think>`); `None` without `</think>`.
    pub reasoning: Option<String>,
    pub content: String,
    pub tool_calls: Vec<ParsedToolCall>,
    /// The sampled DSML block, from its start (including a leading `\n\n`) through the end tag:
    /// what tool memory stores for exact replay (docs/chat.md §2.5a).
    pub raw_dsml: Option<String>,
}

/// Result of [`parse_output`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ParsedOutput {
    pub message: ParsedMessage,
    /// A start marker was found but the block was malformed: the message is the whole text as
    /// content with no tool calls.
    pub tool_parse_failed: bool,
}

/// docs/chat.md §3.1: skip a leading `<think>`; before the first `</think>` is reasoning, after it content.
/// Without `</think>` the whole text (a leading `<think>` included) is content.
pub fn split_reasoning(text: &str) -> (Option<String>, String) {
    let body = text.strip_prefix(THINK_OPEN).unwrap_or(text);
    match body.find(THINK_CLOSE) {
        Some(i) => (
            Some(body[..i].to_owned()),
            body[i + THINK_CLOSE.len()..].to_owned(),
        ),
        None => (None, text.to_owned()),
    }
}

pub(crate) fn skip_ws(s: &str, mut p: usize) -> usize {
    let b = s.as_bytes();
    while p < b.len() && json::is_space(b[p]) {
        p += 1;
    }
    p
}

pub(crate) fn trim_ws_end(s: &str, start: usize, mut limit: usize) -> usize {
    let b = s.as_bytes();
    while limit > start && json::is_space(b[limit - 1]) {
        limit -= 1;
    }
    limit
}

/// Undoes the five DSML entities (`&amp; &lt; &gt; &quot; &apos;`); any other `&` stays.
pub fn unescape_entities(s: &str) -> String {
    const ENTS: [(&str, char); 5] = [
        ("&amp;", '&'),
        ("&lt;", '<'),
        ("&gt;", '>'),
        ("&quot;", '"'),
        ("&apos;", '\''),
    ];
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('&') {
        out.push_str(&rest[..i]);
        rest = &rest[i..];
        match ENTS.iter().find(|(e, _)| rest.starts_with(e)) {
            Some((e, c)) => {
                out.push(*c);
                rest = &rest[e.len()..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// ds4 `dsml_attr`: the first `name="…"` inside the tag text, entity-decoded.
pub(crate) fn attr(tag: &str, name: &str) -> Option<String> {
    let pat = format!("{name}=\"");
    let i = tag.find(&pat)? + pat.len();
    let j = tag[i..].find('"')? + i;
    Some(unescape_entities(&tag[i..j]))
}

/// ds4 `tool_call_json_args_add`.
fn args_add(args: &mut String, name: &str, value: &str, is_string: bool) {
    if !args.is_empty() {
        args.push_str(", ");
    }
    args.push_str(&json::escape(name));
    args.push_str(": ");
    if is_string {
        args.push_str(&json::escape(value));
    } else {
        let min = json::minify(if value.is_empty() { "null" } else { value });
        args.push_str(if min.is_empty() { "null" } else { &min });
    }
}

/// One `<parameter …>value</parameter>` at `p`; appends to `out`, returns the position after.
fn leaf_param(text: &str, p: usize, syn: &Syntax, out: &mut String) -> Option<usize> {
    if !text[p..].starts_with(syn.param_start) {
        return None;
    }
    let tag_end = text[p..].find('>')? + p;
    let tag = &text[p..=tag_end];
    let name = attr(tag, "name")?;
    let is_string = attr(tag, "string");
    let vs = tag_end + 1;
    let ve = text[vs..].find(syn.param_end)? + vs;
    let raw = &text[vs..ve];
    let string = is_string.as_deref().is_none_or(|s| s == "true");
    if string {
        args_add(out, &name, &unescape_entities(raw), true);
    } else {
        args_add(out, &name, raw, false);
    }
    Some(ve + syn.param_end.len())
}

/// Parses the block whose start marker is at `start`; `None` on any structural failure.
fn parse_block(text: &str, start: usize, syn: &Syntax) -> Option<(Vec<ParsedToolCall>, usize)> {
    let mut p = text[start..].find(syn.start)? + start + syn.start.len();
    let mut calls = Vec::new();
    loop {
        p = skip_ws(text, p);
        if text[p..].starts_with(syn.end) {
            return Some((calls, p + syn.end.len()));
        }
        if !text[p..].starts_with(syn.invoke_start) {
            return None;
        }
        let tag_end = text[p..].find('>')? + p;
        let name = attr(&text[p..=tag_end], "name")?;
        p = tag_end + 1;
        let mut args = String::new();
        loop {
            p = skip_ws(text, p);
            if text[p..].starts_with(syn.invoke_end) {
                p += syn.invoke_end.len();
                break;
            }
            if !text[p..].starts_with(syn.param_start) {
                return None;
            }
            let tag_end = text[p..].find('>')? + p;
            let tag = &text[p..=tag_end];
            let pname = attr(tag, "name")?;
            let is_string = attr(tag, "string");
            let vs = tag_end + 1;
            if is_string.is_none() && text[skip_ws(text, vs)..].starts_with(syn.param_start) {
                // Loose nesting: leaf parameters inside an untyped parameter become an object.
                let mut members = String::new();
                let mut q = vs;
                let mut any = false;
                loop {
                    q = skip_ws(text, q);
                    if !text[q..].starts_with(syn.param_start) {
                        break;
                    }
                    q = leaf_param(text, q, syn, &mut members)?;
                    any = true;
                }
                if !any {
                    return None;
                }
                args_add(&mut args, &pname, &format!("{{{members}}}"), false);
                p = skip_ws(text, q);
                if text[p..].starts_with(syn.param_end) {
                    p += syn.param_end.len();
                }
                continue;
            }
            let ve = text[vs..].find(syn.param_end)? + vs;
            let raw = &text[vs..ve];
            if is_string.as_deref().is_none_or(|s| s == "true") {
                args_add(&mut args, &pname, &unescape_entities(raw), true);
            } else {
                args_add(&mut args, &pname, raw, false);
            }
            p = ve + syn.param_end.len();
        }
        calls.push(ParsedToolCall {
            name,
            arguments: format!("{{{args}}}"),
        });
    }
}

/// ds4 `parse_generated_message_ex`: `Err(())` on a malformed tool block.
fn parse_message(text: &str, require_thinking_closed: bool) -> Result<ParsedMessage, ()> {
    let plain = |t: &str| {
        let (reasoning, content) = split_reasoning(t);
        ParsedMessage {
            reasoning,
            content,
            ..ParsedMessage::default()
        }
    };
    let mut search_from = 0;
    if require_thinking_closed {
        match text.rfind(THINK_CLOSE) {
            Some(i) => search_from = i + THINK_CLOSE.len(),
            None => return Ok(plain(text)),
        }
    }
    let region = &text[search_from..];
    let candidates: [(String, &Syntax); 6] = [
        (format!("\n\n{}", FULL.start), &FULL),
        (FULL.start.to_owned(), &FULL),
        (format!("\n\n{}", SHORT.start), &SHORT),
        (SHORT.start.to_owned(), &SHORT),
        (format!("\n\n{}", PLAIN.start), &PLAIN),
        (PLAIN.start.to_owned(), &PLAIN),
    ];
    let Some((start, syn)) = candidates
        .iter()
        .find_map(|(m, syn)| region.find(m.as_str()).map(|i| (search_from + i, *syn)))
    else {
        return Ok(plain(text));
    };
    let content_len = trim_ws_end(text, 0, start);
    let (calls, block_end) = parse_block(text, start, syn).ok_or(())?;
    let mut msg = plain(&text[..content_len]);
    msg.tool_calls = calls;
    msg.raw_dsml = Some(text[start..block_end].to_owned());
    Ok(msg)
}

/// Parses a finished generation. `thinking` = the request was in a thinking mode: tool calls
/// are then only searched after the last `</think>` (DSML inside reasoning is just text).
pub fn parse_output(text: &str, thinking: bool) -> ParsedOutput {
    match parse_message(text, thinking) {
        Ok(message) => ParsedOutput {
            message,
            tool_parse_failed: false,
        },
        Err(()) => ParsedOutput {
            message: ParsedMessage {
                content: text.to_owned(),
                ..ParsedMessage::default()
            },
            tool_parse_failed: true,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasoning_split() {
        assert_eq!(
            split_reasoning("<think>a</think>b</think>c"),
            (Some("a".into()), "b</think>c".into())
        );
        assert_eq!(split_reasoning("r</think>"), (Some("r".into()), "".into()));
        assert_eq!(
            split_reasoning("<think>never closed"),
            (None, "<think>never closed".into())
        );
    }

    #[test]
    fn spec_entity_example() {
        let text = "ok\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"bash\">\n<｜DSML｜parameter name=\"command\" string=\"true\">ls &amp;&amp; echo &lt;/｜DSML｜parameter> \"hi\"</｜DSML｜parameter>\n<｜DSML｜parameter name=\"timeout\" string=\"false\">{ \"a\" : [1, 2] }</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>ignored";
        let out = parse_output(text, false);
        assert!(!out.tool_parse_failed);
        let m = out.message;
        assert_eq!(m.content, "ok");
        assert_eq!(m.reasoning, None);
        assert_eq!(m.tool_calls.len(), 1);
        assert_eq!(m.tool_calls[0].name, "bash");
        assert_eq!(
            m.tool_calls[0].arguments_compact(),
            r#"{"command":"ls && echo </｜DSML｜parameter> \"hi\"","timeout":{"a":[1,2]}}"#
        );
        assert_eq!(
            m.raw_dsml.as_deref(),
            Some(&text[2..text.len() - "ignored".len()])
        );
    }

    #[test]
    fn loose_nesting_and_bad_values() {
        let text = "<tool_calls><invoke name=\"f\"><parameter name=\"opts\"><parameter name=\"a\" string=\"false\">1</parameter><parameter name=\"b\" string=\"true\">x</parameter></parameter><parameter name=\"t\" string=\"false\">ten seconds</parameter></invoke></tool_calls>";
        let m = parse_output(text, false).message;
        assert_eq!(
            m.tool_calls[0].arguments,
            r#"{"opts": {"a":1,"b":"x"}, "t": ten seconds}"#
        );
        assert_eq!(m.tool_calls[0].arguments_compact(), "{}");
    }

    #[test]
    fn thinking_gates_tool_search() {
        let dsml =
            "<｜DSML｜tool_calls><｜DSML｜invoke name=\"f\"></｜DSML｜invoke></｜DSML｜tool_calls>";
        let inside = format!("reason {dsml}");
        let m = parse_output(&inside, true).message;
        assert!(m.tool_calls.is_empty());
        assert_eq!(m.content, inside);
        let after = format!("r</think>c {dsml}");
        let m = parse_output(&after, true).message;
        assert_eq!(
            (
                m.reasoning.as_deref(),
                m.content.as_str(),
                m.tool_calls.len()
            ),
            (Some("r"), "c", 1)
        );
        assert_eq!(m.tool_calls[0].arguments, "{}");
        // Non-thinking mode searches everywhere.
        assert_eq!(parse_output(&inside, false).message.tool_calls.len(), 1);
    }

    #[test]
    fn malformed_block_is_whole_text() {
        for bad in [
            "a</think>b\n\n<｜DSML｜tool_calls><｜DSML｜invoke name=\"f\">",
            "a</think><｜DSML｜tool_calls>junk</｜DSML｜tool_calls>",
            "a</think><｜DSML｜tool_calls><｜DSML｜invoke x=\"f\"></｜DSML｜invoke></｜DSML｜tool_calls>",
            "a</think><｜DSML｜tool_calls><｜DSML｜invoke name=\"f\"><｜DSML｜parameter string=\"true\">v</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>",
        ] {
            let out = parse_output(bad, true);
            assert!(out.tool_parse_failed, "{bad}");
            assert_eq!(out.message.content, bad);
            assert_eq!(out.message.reasoning, None);
        }
    }

    #[test]
    fn entities() {
        assert_eq!(
            unescape_entities("&amp;lt; &lt;&gt;&quot;&apos;&x &"),
            "&lt; <>\"'&x &"
        );
        assert_eq!(
            attr("<x name=\"a&amp;b\" string=\"true\">", "string").as_deref(),
            Some("true")
        );
        assert_eq!(attr("<x name=\"open>", "name"), None);
    }
}
