//! Byte-exact prompt rendering (docs/chat.md §2): normalized messages + tool schemas +
//! thinking mode → the one UTF-8 string ds4 tokenizes. The rendered string is also cache-key
//! material (docs/server.md §9–10), so every byte here follows ds4 exactly, quirks included.

use crate::error::ChatError;
use crate::json;
use crate::tokenizer::{
    Tokenizer, ASSISTANT_TEXT, BOS_TEXT, EOS_TEXT, THINK_CLOSE_TEXT, THINK_OPEN_TEXT, USER_TEXT,
};

/// Think Max preamble, placed right after BOS (docs/chat.md §2.2; 476 bytes).
pub const MAX_PREFIX: &str = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n\
You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n\
Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

/// Text before the tool schema lines (docs/chat.md §2.2; 1183 bytes).
pub const TOOLS_HEAD: &str = "## Tools\n\n\
You have access to a set of tools to help answer the user question. You can invoke tools by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n\
<｜DSML｜tool_calls>\n\
<｜DSML｜invoke name=\"$TOOL_NAME\">\n\
<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n\
...\n\
</｜DSML｜invoke>\n\
<｜DSML｜invoke name=\"$TOOL_NAME2\">\n\
...\n\
</｜DSML｜invoke>\n\
</｜DSML｜tool_calls>\n\n\
String parameters should be specified as raw text and set `string=\"true\"`. Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string characters with XML or HTML entity escapes. Only if a string value itself contains the exact closing parameter tag `</｜DSML｜parameter>`, write that tag as `&lt;/｜DSML｜parameter>` inside the value. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n\
If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n\
Otherwise, output directly after </think> with tool calls or final response.\n\n\
### Available Tool Schemas\n\n";

/// Text after the tool schema lines (docs/chat.md §2.2; 146 bytes, no trailing newline).
pub const TOOLS_TAIL: &str = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls. Use the exact parameter names from the schemas.";

/// Default system text of `ds4 -p` and `/v1/completions` (no final period).
pub const DEFAULT_SYSTEM: &str = "You are a helpful assistant";
/// Default system text of `ds4-bench --chat-prompt-file` (with the period).
pub const BENCH_DEFAULT_SYSTEM: &str = "You are a helpful assistant.";

const PARAM_END: &str = "</｜DSML｜parameter>";
const TOOL_RESULT_END: &str = "</tool_result>";

/// A rendered prompt plus the byte ranges the renderer wrote itself (markers, wrappers, DSML
/// structure, fixed preambles). Only there may chat markers become control tokens
/// ([`Tokenizer::encode_rendered`]); message text, reasoning, tool results, tool names and
/// arguments and schemas are outside them, so a client cannot forge a turn by writing
/// `<｜Assistant｜>` into its content. The text is byte-identical to [`render_prompt`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    /// Sorted, non-overlapping, on character boundaries.
    pub trusted: Vec<std::ops::Range<usize>>,
}

impl Rendered {
    /// Appends renderer-owned text.
    pub fn ctl(&mut self, s: &str) {
        let a = self.text.len();
        self.text.push_str(s);
        let b = self.text.len();
        match self.trusted.last_mut() {
            Some(r) if r.end == a => r.end = b,
            _ if a < b => self.trusted.push(a..b),
            _ => {}
        }
    }

    /// Appends client-supplied text (never control tokens).
    pub fn raw(&mut self, s: &str) {
        self.text.push_str(s);
    }

    /// The whole text counts as trusted: ds4's behaviour, where markers anywhere in the
    /// prompt are control tokens (the server's `--content-special-tokens`).
    pub fn all_trusted(text: String) -> Rendered {
        let trusted = if text.is_empty() {
            Vec::new()
        } else {
            std::iter::once(0..text.len()).collect()
        };
        Rendered { text, trusted }
    }

    /// The token ids (markers only where trusted).
    pub fn tokens(&self, tok: &Tokenizer) -> Result<Vec<u32>, ChatError> {
        tok.encode_rendered(&self.text, &self.trusted)
    }

    /// The part from byte `from` on (a char boundary), with its trusted ranges.
    pub fn suffix(&self, from: usize) -> Rendered {
        let text = self.text.get(from..).unwrap_or("").to_string();
        let trusted = self
            .trusted
            .iter()
            .filter(|r| r.end > from)
            .map(|r| r.start.max(from) - from..r.end - from)
            .collect();
        Rendered { text, trusted }
    }
}

/// Reasoning mode of a request (docs/chat.md §2.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ThinkingMode {
    /// No reasoning: the prompt ends with `</think>`.
    NoThink,
    /// Normal thinking (effort high): the prompt ends with `<think>`. The default.
    #[default]
    Think,
    /// Think Max: like `Think` plus [`MAX_PREFIX`] after BOS.
    ThinkMax,
}

impl ThinkingMode {
    /// True for `Think` and `ThinkMax`.
    pub fn is_thinking(self) -> bool {
        !matches!(self, ThinkingMode::NoThink)
    }

    /// Context size below which ds4 downgrades Think Max to Think.
    pub const MAX_MIN_CTX: u64 = 393_216;

    /// Applies ds4's downgrade: Think Max needs a context of at least 393216 tokens.
    pub fn for_context(self, ctx: u64) -> Self {
        if self == ThinkingMode::ThinkMax && ctx < Self::MAX_MIN_CTX {
            ThinkingMode::Think
        } else {
            self
        }
    }

    /// Mode of an effort string (`max`, `xhigh|high|medium|low|minimal`, `none`); `None` for
    /// any other string (ds4 rejects the request).
    pub fn from_effort(effort: &str) -> Option<Self> {
        match effort {
            "max" => Some(ThinkingMode::ThinkMax),
            "xhigh" | "high" | "medium" | "low" | "minimal" => Some(ThinkingMode::Think),
            "none" => Some(ThinkingMode::NoThink),
            _ => None,
        }
    }
}

/// An assistant tool call in the history.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ToolCall {
    /// Client-visible call id (used by tool memory / cache logic, not rendered).
    pub id: String,
    pub name: String,
    /// The arguments text: the decoded JSON string if the client sent a string, or the raw
    /// JSON bytes if it sent an object. Rendered from its JSON object members, or as one
    /// `arguments` string parameter when it is not an object (docs/chat.md §2.5).
    pub arguments: String,
}

/// One normalized message (docs/chat.md §2.3). Roles are kept verbatim: `system`, `developer`, `user`,
/// `assistant`, `tool`, `function` are understood; other roles are dropped when rendering.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// Client-sent reasoning of an assistant turn (`reasoning_content`, thinking blocks).
    pub reasoning: String,
    pub tool_calls: Vec<ToolCall>,
    /// Ids this message answers (tool results); used by cache logic, not rendered.
    pub tool_call_ids: Vec<String>,
    /// Exact-replay DSML block (docs/chat.md §2.5a): set by the server when every call id of this assistant
    /// message resolves to the same block in tool memory. Rendered verbatim instead of the
    /// canonical DSML when the message has tool calls.
    pub exact_dsml: Option<String>,
}

impl Message {
    fn with(role: &str, content: &str) -> Self {
        Self {
            role: role.to_owned(),
            content: content.to_owned(),
            ..Self::default()
        }
    }
    /// A system message.
    pub fn system(content: &str) -> Self {
        Self::with("system", content)
    }
    /// A user message.
    pub fn user(content: &str) -> Self {
        Self::with("user", content)
    }
    /// An assistant message with optional reasoning.
    pub fn assistant(content: &str, reasoning: &str) -> Self {
        Self {
            reasoning: reasoning.to_owned(),
            ..Self::with("assistant", content)
        }
    }
    /// A tool result answering `call_id`.
    pub fn tool(call_id: &str, content: &str) -> Self {
        Self {
            tool_call_ids: vec![call_id.to_owned()],
            ..Self::with("tool", content)
        }
    }
}

fn is_system(role: &str) -> bool {
    role == "system" || role == "developer"
}

fn is_tool_result(role: &str) -> bool {
    role == "tool" || role == "function"
}

/// Replaces the `<` of every occurrence of `tag` in `s` by `repl`.
fn escape_tag(out: &mut String, s: &str, tag: &str, repl: &str) {
    let mut rest = s;
    while let Some(i) = rest.find(tag) {
        out.push_str(&rest[..i]);
        out.push_str(repl);
        out.push_str(&tag[1..]);
        rest = &rest[i + tag.len()..];
    }
    out.push_str(rest);
}

/// Tool-result text: only the exact closing wrapper tag is altered (`<` → `&lt;`).
pub fn escape_tool_result(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    escape_tag(&mut out, s, TOOL_RESULT_END, "&lt;");
    out
}

fn push_attr_escaped(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            c => out.push(c),
        }
    }
}

fn push_dsml_param(out: &mut Rendered, key: &str, value: &str, is_string: bool) {
    out.ctl("<｜DSML｜parameter name=\"");
    push_attr_escaped(&mut out.text, key);
    out.ctl(if is_string {
        "\" string=\"true\">"
    } else {
        "\" string=\"false\">"
    });
    escape_tag(
        &mut out.text,
        value,
        PARAM_END,
        if is_string { "&lt;" } else { "\\u003c" },
    );
    out.ctl(PARAM_END);
    out.ctl("\n");
}

/// The canonical DSML block for assistant tool calls (docs/chat.md §2.5b), starting with `\n\n`, ending with
/// `</｜DSML｜tool_calls>` (no newline). Empty for no calls.
pub fn render_tool_calls(calls: &[ToolCall]) -> String {
    let mut out = Rendered::default();
    render_tool_calls_into(&mut out, calls);
    out.text
}

/// [`render_tool_calls`] into `out`: the DSML structure is renderer-owned, the names and
/// argument values are client text.
fn render_tool_calls_into(out: &mut Rendered, calls: &[ToolCall]) {
    if calls.is_empty() {
        return;
    }
    out.ctl("\n\n<｜DSML｜tool_calls>\n");
    for c in calls {
        out.ctl("<｜DSML｜invoke name=\"");
        push_attr_escaped(&mut out.text, &c.name);
        out.ctl("\">\n");
        match json::parse_args(&c.arguments) {
            Some(args) => {
                for a in &args {
                    push_dsml_param(out, &a.key, &a.value, a.is_string);
                }
            }
            None => push_dsml_param(out, "arguments", &c.arguments, true),
        }
        out.ctl("</｜DSML｜invoke>\n");
    }
    out.ctl("</｜DSML｜tool_calls>");
}

/// The tools block: [`TOOLS_HEAD`] + schema lines joined by `\n` + [`TOOLS_TAIL`]; empty if
/// the joined schema text is empty.
pub fn render_tools_block<S: AsRef<str>>(schemas: &[S]) -> String {
    let joined = join_lines(schemas);
    if joined.is_empty() {
        return joined;
    }
    format!("{TOOLS_HEAD}{joined}{TOOLS_TAIL}")
}

fn join_lines<S: AsRef<str>>(lines: &[S]) -> String {
    let mut out = String::new();
    for (i, l) in lines.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        out.push_str(l.as_ref());
    }
    out
}

/// Renders a conversation exactly as ds4's server does (docs/chat.md §2.3). `tool_schemas` are the schema
/// lines (docs/chat.md §2.4, already extracted byte-exact, e.g. by [`tool_schema_lines`]); pass none when
/// tools are absent or `tool_choice` is "none". Apply [`ThinkingMode::for_context`] first.
pub fn render_prompt<S: AsRef<str>>(
    messages: &[Message],
    tool_schemas: &[S],
    mode: ThinkingMode,
) -> String {
    render_prompt_spans(messages, tool_schemas, mode).text
}

/// [`render_prompt`] with the renderer-owned byte ranges ([`Rendered`]).
pub fn render_prompt_spans<S: AsRef<str>>(
    messages: &[Message],
    tool_schemas: &[S],
    mode: ThinkingMode,
) -> Rendered {
    let think = mode.is_thinking();
    let schemas = join_lines(tool_schemas);
    let tool_context = !schemas.is_empty()
        || messages.iter().any(|m| {
            (m.role == "assistant" && !m.tool_calls.is_empty()) || is_tool_result(&m.role)
        });
    let last_user = messages
        .iter()
        .rposition(|m| m.role == "user" || is_tool_result(&m.role));

    let mut out = Rendered {
        text: String::with_capacity(
            schemas.len()
                + messages
                    .iter()
                    .map(|m| m.content.len() + m.reasoning.len() + 64)
                    .sum::<usize>(),
        ),
        trusted: Vec::new(),
    };
    out.ctl(BOS_TEXT);
    if mode == ThinkingMode::ThinkMax {
        out.ctl(MAX_PREFIX);
    }
    let system_start = out.text.len();
    if !schemas.is_empty() {
        out.ctl(TOOLS_HEAD);
        out.raw(&schemas);
        out.ctl(TOOLS_TAIL);
    }
    for m in messages.iter().filter(|m| is_system(&m.role)) {
        if out.text.len() > system_start {
            out.ctl("\n\n");
        }
        out.raw(&m.content);
    }

    let mut pending_assistant = false;
    let mut pending_tool = false;
    for (i, m) in messages.iter().enumerate() {
        let role = m.role.as_str();
        if is_system(role) {
            continue;
        } else if role == "user" {
            out.ctl(USER_TEXT);
            out.raw(&m.content);
            pending_assistant = true;
            pending_tool = false;
        } else if is_tool_result(role) {
            if !pending_tool {
                out.ctl(USER_TEXT);
            }
            out.ctl("<tool_result>");
            escape_tag(&mut out.text, &m.content, TOOL_RESULT_END, "&lt;");
            out.ctl(TOOL_RESULT_END);
            pending_assistant = true;
            pending_tool = true;
        } else if role == "assistant" {
            if pending_assistant {
                out.ctl(ASSISTANT_TEXT);
                if think && (tool_context || last_user.is_none_or(|u| i > u)) {
                    out.ctl(THINK_OPEN_TEXT);
                    out.raw(&m.reasoning);
                    out.ctl(THINK_CLOSE_TEXT);
                } else {
                    out.ctl(THINK_CLOSE_TEXT);
                }
            }
            out.raw(&m.content);
            if !m.tool_calls.is_empty() {
                match m.exact_dsml.as_deref() {
                    // The block the model itself sampled (kept by the server by call id).
                    Some(raw) if !raw.is_empty() => out.ctl(raw),
                    _ => render_tool_calls_into(&mut out, &m.tool_calls),
                }
            }
            out.ctl(EOS_TEXT);
            pending_assistant = false;
            pending_tool = false;
        }
    }
    if pending_assistant {
        out.ctl(ASSISTANT_TEXT);
        out.ctl(if think {
            THINK_OPEN_TEXT
        } else {
            THINK_CLOSE_TEXT
        });
    }
    out
}

/// `/v1/completions` rendering (docs/chat.md §2.6): BOS + [MAX_PREFIX] + `You are a helpful assistant` +
/// User + prompt + Assistant + think tag.
pub fn render_completion(prompt: &str, mode: ThinkingMode) -> String {
    render_completion_spans(prompt, mode).text
}

/// [`render_completion`] with the renderer-owned byte ranges (the prompt is client text).
pub fn render_completion_spans(prompt: &str, mode: ThinkingMode) -> Rendered {
    let mut out = Rendered::default();
    out.ctl(BOS_TEXT);
    if mode == ThinkingMode::ThinkMax {
        out.ctl(MAX_PREFIX);
    }
    out.ctl(DEFAULT_SYSTEM);
    out.ctl(USER_TEXT);
    out.raw(prompt);
    out.ctl(ASSISTANT_TEXT);
    out.ctl(if mode.is_thinking() {
        THINK_OPEN_TEXT
    } else {
        THINK_CLOSE_TEXT
    });
    out
}

/// Schema lines of one entry of a request's `tools` array, from its exact bytes (docs/chat.md §2.4), the way
/// ds4 reads them: an object with a `function` member → that member's raw bytes (OpenAI);
/// a Responses `namespace` → one synthesized line per inner function tool; a Responses
/// `tool_search` → a synthesized line; anything else → the raw object verbatim (Anthropic,
/// Responses flat functions). Errors only if the entry is not a JSON value at all.
pub fn tool_schema_lines(raw_tool: &str) -> Result<Vec<String>, ChatError> {
    let mut sc = json::Scanner::new(raw_tool);
    let raw = sc
        .raw_value()
        .ok_or_else(|| ChatError::Request("tools entry is not a JSON value".into()))?;
    let (members, complete) = object_members(raw);
    // OpenAI wrapper: the first `function` member, even if the rest does not parse.
    if let Some((_, f)) = members.iter().find(|(k, _)| k == "function") {
        return Ok(vec![(*f).to_owned()]);
    }
    if complete {
        if let Some(lines) = namespace_lines(&members) {
            return Ok(lines);
        }
        if let Ok(Some(ty)) = str_member(&members, "type") {
            if ty == "tool_search" {
                if let Ok(desc) = str_member(&members, "description") {
                    let params = last_member(&members, &["parameters"]);
                    return Ok(vec![synth_schema(
                        "tool_search",
                        &desc.unwrap_or_else(|| "Search available tools.".into()),
                        params,
                    )]);
                }
            }
        }
    }
    if raw.is_empty() {
        return Ok(Vec::new());
    }
    Ok(vec![raw.to_owned()])
}

/// Lines of a Responses namespace tool; `None` if it is not one or yields no line.
fn namespace_lines(members: &[(String, &str)]) -> Option<Vec<String>> {
    if str_member(members, "type").ok()?? != "namespace" {
        return None;
    }
    let ns = str_member(members, "name").ok()??;
    let tools = last_member(members, &["tools"])?;
    let (items, _complete) = array_items(tools);
    let mut lines = Vec::new();
    for item in items {
        let (m, ok) = object_members(item);
        if !ok {
            continue;
        }
        let (Ok(ty), Ok(Some(name)), Ok(desc)) = (
            str_member(&m, "type"),
            str_member(&m, "name"),
            str_member(&m, "description"),
        ) else {
            continue;
        };
        if ty.as_deref().is_some_and(|t| t != "function") || name.is_empty() {
            continue;
        }
        let params = last_member(&m, &["parameters", "input_schema"]);
        lines.push(synth_schema(
            &format!("{ns}{name}"),
            &desc.unwrap_or_default(),
            params,
        ));
    }
    // ds4 keeps the lines appended before a malformed tail of the array.
    (!lines.is_empty()).then_some(lines)
}

/// The last member named one of `keys` (ds4 overwrites on repeated keys).
fn last_member<'a>(members: &[(String, &'a str)], keys: &[&str]) -> Option<&'a str> {
    members
        .iter()
        .rev()
        .find(|(k, _)| keys.contains(&k.as_str()))
        .map(|(_, v)| *v)
}

/// The last member `key` as a string: `Ok(None)` if absent, `Err` if present but not a string.
fn str_member(members: &[(String, &str)], key: &str) -> Result<Option<String>, ()> {
    match last_member(members, &[key]) {
        None => Ok(None),
        Some(v) => json::Scanner::new(v).string().map(Some).ok_or(()),
    }
}

/// `{"name":N,"description":D,"parameters":P}` with D JSON-escaped and P raw (or an empty
/// object schema).
fn synth_schema(name: &str, description: &str, parameters: Option<&str>) -> String {
    let params = parameters.unwrap_or("{\"type\":\"object\",\"properties\":{}}");
    format!(
        "{{\"name\":{},\"description\":{},\"parameters\":{}}}",
        json::escape(name),
        json::escape(description),
        params
    )
}

/// (key, raw value) members of a JSON object read ds4-style (commas optional), and whether the
/// object parsed to its closing brace. Members before a syntax error are still returned.
pub(crate) fn object_members(raw: &str) -> (Vec<(String, &str)>, bool) {
    let mut out = Vec::new();
    let mut sc = json::Scanner::new(raw);
    sc.ws();
    if !raw[sc.pos..].starts_with('{') {
        return (out, false);
    }
    sc.pos += 1;
    sc.ws();
    while sc.pos < raw.len() {
        if raw[sc.pos..].starts_with('}') {
            return (out, true);
        }
        let Some(key) = sc.string() else {
            return (out, false);
        };
        sc.ws();
        if !raw[sc.pos..].starts_with(':') {
            return (out, false);
        }
        sc.pos += 1;
        let Some(v) = sc.raw_value() else {
            return (out, false);
        };
        out.push((key, v));
        sc.ws();
        if raw[sc.pos..].starts_with(',') {
            sc.pos += 1;
        }
        sc.ws();
    }
    (out, false)
}

/// Raw items of a JSON array read ds4-style, and whether it parsed to its closing bracket.
pub(crate) fn array_items(raw: &str) -> (Vec<&str>, bool) {
    let mut out = Vec::new();
    let mut sc = json::Scanner::new(raw);
    sc.ws();
    if !raw[sc.pos..].starts_with('[') {
        return (out, false);
    }
    sc.pos += 1;
    sc.ws();
    while sc.pos < raw.len() {
        if raw[sc.pos..].starts_with(']') {
            return (out, true);
        }
        let Some(v) = sc.raw_value() else {
            return (out, false);
        };
        out.push(v);
        sc.ws();
        if raw[sc.pos..].starts_with(',') {
            sc.pos += 1;
        }
        sc.ws();
    }
    (out, false)
}

/// Token-level prompt of the CLI / bench paths (docs/chat.md §2.7), where the user text is BPE'd without
/// special-marker recognition and the markers are inserted as ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CliPrompt<'a> {
    /// System text; `None` or empty for no system block.
    pub system: Option<&'a str>,
    pub prompt: &'a str,
    pub mode: ThinkingMode,
}

impl CliPrompt<'_> {
    /// `ds4 -p`: a prompt that starts with the literal BOS string is tokenized as a rendered
    /// chat string (seven markers recognised); otherwise BOS + [MAX_PREFIX] + [system] + User +
    /// BPE(prompt) + Assistant + think tag, each text piece BPE'd on its own without specials.
    pub fn tokens(&self, tok: &Tokenizer) -> Result<Vec<u32>, ChatError> {
        if self.prompt.starts_with(BOS_TEXT) {
            return tok.encode_chat(self.prompt);
        }
        let mk = tok.markers();
        let mut ids = vec![mk.bos];
        if self.mode == ThinkingMode::ThinkMax {
            ids.extend(tok.encode(MAX_PREFIX, false)?);
        }
        if let Some(sys) = self.system.filter(|s| !s.is_empty()) {
            ids.extend(tok.encode(sys, false)?);
        }
        ids.push(mk.user);
        ids.extend(tok.encode(self.prompt, false)?);
        ids.push(mk.assistant);
        ids.push(if self.mode.is_thinking() {
            mk.think_open
        } else {
            mk.think_close
        });
        Ok(ids)
    }
}

/// Official test-vector / `ds4_test` prompt (docs/chat.md §2.7, §5): BOS + User + BPE(prompt) + Assistant +
/// `</think>` (no system, non-thinking).
pub fn official_vector_tokens(tok: &Tokenizer, prompt: &str) -> Result<Vec<u32>, ChatError> {
    CliPrompt {
        system: None,
        prompt,
        mode: ThinkingMode::NoThink,
    }
    .tokens(tok)
}

/// Interactive-CLI transcript growth (docs/chat.md §2.7): the ids appended for one user turn before
/// generation (User + BPE(text) + Assistant + think tag). The caller appends every sampled
/// token and then EOS.
pub fn cli_turn_tokens(
    tok: &Tokenizer,
    text: &str,
    mode: ThinkingMode,
) -> Result<Vec<u32>, ChatError> {
    let mk = tok.markers();
    let mut ids = vec![mk.user];
    ids.extend(tok.encode(text, false)?);
    ids.push(mk.assistant);
    ids.push(if mode.is_thinking() {
        mk.think_open
    } else {
        mk.think_close
    });
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_blocks_have_spec_sizes() {
        assert_eq!(MAX_PREFIX.len(), 476);
        assert_eq!(TOOLS_HEAD.len(), 1183);
        assert_eq!(TOOLS_TAIL.len(), 146);
    }

    #[test]
    fn escapes() {
        assert_eq!(
            escape_tool_result("a </tool_result> b <tool_result> &"),
            "a &lt;/tool_result> b <tool_result> &"
        );
        let calls = vec![ToolCall {
            id: "c".into(),
            name: "a\"<&>".into(),
            arguments: "{\"k&\":\"x</｜DSML｜parameter>y\",\"n\":[\"</｜DSML｜parameter>\"]}"
                .into(),
        }];
        let r = render_tool_calls(&calls);
        assert!(r.contains("invoke name=\"a&quot;&lt;&amp;&gt;\""), "{r}");
        assert!(
            r.contains(
                "name=\"k&amp;\" string=\"true\">x&lt;/｜DSML｜parameter>y</｜DSML｜parameter>"
            ),
            "{r}"
        );
        assert!(
            r.contains("string=\"false\">[\"\\u003c/｜DSML｜parameter>\"]</｜DSML｜parameter>"),
            "{r}"
        );
    }

    #[test]
    fn schema_lines() {
        let l =
            tool_schema_lines(r#"{"type":"function","function": {"name":"f" , "x":1}}"#).unwrap();
        assert_eq!(l, vec![r#"{"name":"f" , "x":1}"#]);
        let l = tool_schema_lines(r#" {"name":"Read","input_schema":{}} "#).unwrap();
        assert_eq!(l, vec![r#"{"name":"Read","input_schema":{}}"#]);
        let l = tool_schema_lines(
            r#"{"type":"namespace","name":"ns.","tools":[{"type":"function","name":"a","description":"d\"q","parameters":{"type":"object"}},{"type":"web"},{"type":"function","name":"b"}]}"#,
        )
        .unwrap();
        assert_eq!(
            l,
            vec![
                r#"{"name":"ns.a","description":"d\"q","parameters":{"type":"object"}}"#,
                r#"{"name":"ns.b","description":"","parameters":{"type":"object","properties":{}}}"#
            ]
        );
        let l = tool_schema_lines(r#"{"type":"tool_search"}"#).unwrap();
        assert_eq!(
            l,
            vec![
                r#"{"name":"tool_search","description":"Search available tools.","parameters":{"type":"object","properties":{}}}"#
            ]
        );
        assert_eq!(tool_schema_lines("[1]").unwrap(), vec!["[1]"]);
        assert!(tool_schema_lines("{oops").is_err());
    }

    #[test]
    fn think_max_downgrade_and_efforts() {
        assert_eq!(
            ThinkingMode::ThinkMax.for_context(393_215),
            ThinkingMode::Think
        );
        assert_eq!(
            ThinkingMode::ThinkMax.for_context(393_216),
            ThinkingMode::ThinkMax
        );
        assert_eq!(
            ThinkingMode::from_effort("minimal"),
            Some(ThinkingMode::Think)
        );
        assert_eq!(
            ThinkingMode::from_effort("none"),
            Some(ThinkingMode::NoThink)
        );
        assert_eq!(ThinkingMode::from_effort("extreme"), None);
    }

    #[test]
    fn quirks() {
        // Assistant first: no marker, content glued after BOS; other roles dropped.
        let msgs = vec![
            Message::assistant("x", "r"),
            Message::with("critic", "no"),
            Message::user("u"),
        ];
        assert_eq!(
            render_prompt::<&str>(&msgs, &[], ThinkingMode::Think),
            format!("{BOS_TEXT}x{EOS_TEXT}{USER_TEXT}u{ASSISTANT_TEXT}<think>")
        );
        // Ending with an assistant: no generation prefix; reasoning kept after the last user.
        let msgs = vec![Message::user("u"), Message::assistant("a", "why")];
        assert_eq!(
            render_prompt::<&str>(&msgs, &[], ThinkingMode::Think),
            format!("{BOS_TEXT}{USER_TEXT}u{ASSISTANT_TEXT}<think>why</think>a{EOS_TEXT}")
        );
        assert_eq!(
            render_prompt::<&str>(&msgs, &[], ThinkingMode::NoThink),
            format!("{BOS_TEXT}{USER_TEXT}u{ASSISTANT_TEXT}</think>a{EOS_TEXT}")
        );
        // Exact replay block wins over canonical DSML.
        let mut a = Message::assistant("", "");
        a.tool_calls = vec![ToolCall {
            id: "1".into(),
            name: "f".into(),
            arguments: "{}".into(),
        }];
        a.exact_dsml = Some("RAW".into());
        let msgs = vec![Message::user("u"), a];
        assert_eq!(
            render_prompt::<&str>(&msgs, &[], ThinkingMode::NoThink),
            format!("{BOS_TEXT}{USER_TEXT}u{ASSISTANT_TEXT}</think>RAW{EOS_TEXT}")
        );
    }
}
