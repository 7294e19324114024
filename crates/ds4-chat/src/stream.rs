//! Streaming output parser (docs/chat.md §3.3–3.4): decoded text chunks in, events out
//! (reasoning deltas, content deltas, tool-call headers and argument fragments), plus the stop
//! decision and the final message.
//!
//! The rules are ds4's (what may be emitted when, what is held back), applied as if text
//! arrived one char at a time. That makes the result independent of how the text is chunked:
//! any chunking yields the same events once adjacent deltas of the same kind are joined, and
//! the same final message. ds4 applies some rules per token, so it can differ from us when one
//! token completes two markers at once (e.g. a stop string right after a tool-call end tag).
//!
//! One deliberate difference from ds4: when a tool-call block turns out malformed and no tool
//! call was announced yet, the held text is released as content at the end (ds4 drops it from
//! the stream; the final message has it either way).

use crate::json;
use crate::parse::{self, ParsedMessage, Syntax, SYNTAXES, THINK_CLOSE, THINK_OPEN};

/// What the request enables.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StreamOptions {
    /// The prompt ended with `<think>`: output starts inside reasoning.
    pub thinking: bool,
    /// Tools are active: DSML is recognised live, streamed as tool calls, and an end tag stops
    /// generation.
    pub tools: bool,
    /// Client stop sequences (empty strings are ignored).
    pub stop: Vec<String>,
}

/// One thing to send to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    /// Reasoning text.
    Reasoning(String),
    /// Visible answer text.
    Content(String),
    /// A tool call was recognised (the invoke tag is complete).
    ToolCallStart { index: usize, name: String },
    /// A fragment of the call's JSON arguments; all fragments of one call concatenate to its
    /// arguments as streamed (string values escaped, non-string values raw, not minified).
    ToolCallArguments { index: usize, fragment: String },
    /// The call's invoke tag closed.
    ToolCallEnd { index: usize },
}

/// Why the stream asks the engine to stop sampling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Halt {
    /// A client stop sequence was produced (the text is cut before it).
    StopSequence,
    /// Tools are active and a tool-call block was closed.
    ToolCalls,
}

/// Why the engine stopped feeding text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndCause {
    /// The model sampled EOS (or the stream asked to halt).
    Eos,
    /// `max_tokens` or the context was exhausted.
    Length,
    /// Decoding failed or the server is shutting down.
    Error(String),
}

/// API finish reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    ToolCalls,
    Error,
}

impl FinishReason {
    /// The OpenAI spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::Error => "error",
        }
    }
}

/// Everything known once generation is over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinalOutput {
    /// The generated text as kept (cut at a stop sequence or after a tool-call end tag).
    pub text: String,
    pub message: ParsedMessage,
    pub finish: FinishReason,
    /// `unterminated tool call`, `invalid tool call` or the engine's error.
    pub error: Option<String>,
    /// A tool block was started but could not be parsed; the message is plain content.
    pub tool_parse_failed: bool,
}

/// Where generation is inside DSML, for the sampler (docs/chat.md §3.4: structure is sampled at
/// temperature 0, string bodies and JSON string literals with the request's settings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DsmlState {
    Outside,
    Structural,
    StringBody,
    JsonStructural,
    JsonString,
}

impl DsmlState {
    /// Inside a tool-call block at all.
    pub fn in_tool_call(self) -> bool {
        self != DsmlState::Outside
    }
    /// Payload text: the request's own sampling applies.
    pub fn uses_payload_sampling(self) -> bool {
        matches!(self, DsmlState::StringBody | DsmlState::JsonString)
    }
}

const TOOL_MARKER_HOLD: usize = 80;

fn find_from(hay: &[u8], from: usize, needle: &[u8]) -> Option<usize> {
    if from > hay.len() || needle.is_empty() {
        return None;
    }
    hay[from..]
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|i| i + from)
}

/// `hay[pos..]` is a strict prefix of `lit`.
fn partial_lit(hay: &[u8], pos: usize, lit: &str) -> bool {
    pos <= hay.len() && hay.len() - pos < lit.len() && lit.as_bytes().starts_with(&hay[pos..])
}

fn floor_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Earliest start marker of any family in `hay[from..]`.
fn find_any_start(hay: &[u8], from: usize) -> Option<(usize, &'static Syntax)> {
    SYNTAXES
        .iter()
        .filter_map(|syn| find_from(hay, from, syn.start.as_bytes()).map(|p| (p, syn)))
        .min_by_key(|(p, _)| *p)
}

fn max_start_len() -> usize {
    SYNTAXES.iter().map(|s| s.start.len()).max().unwrap_or(0)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Thinking,
    Text,
    Tool,
    Suppress,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ToolState {
    BetweenInvokes,
    BetweenParams,
    ParamValue,
    Done,
    Failed,
}

/// Live tool-call block reader (ds4's OpenAI tool stream).
#[derive(Debug, Clone)]
struct ToolStream {
    syn: &'static Syntax,
    state: ToolState,
    pos: usize,
    index: usize,
    args_open: bool,
    first_param: bool,
    param_is_string: bool,
    /// No `>` was found in `pos..gt_scan` while waiting for a tag to close.
    gt_scan: usize,
    announced: bool,
}

impl ToolStream {
    fn new(syn: &'static Syntax, marker: usize) -> Self {
        Self {
            syn,
            state: ToolState::BetweenInvokes,
            pos: marker + syn.start.len(),
            index: 0,
            args_open: false,
            first_param: true,
            param_is_string: false,
            gt_scan: 0,
            announced: false,
        }
    }

    fn active(&self) -> bool {
        !matches!(self.state, ToolState::Done | ToolState::Failed)
    }

    /// The `>` closing the tag at `self.pos`, remembering how far we looked.
    fn tag_end(&mut self, raw: &[u8]) -> Option<usize> {
        let from = self.gt_scan.max(self.pos);
        match raw[from..].iter().position(|&b| b == b'>') {
            Some(i) => {
                self.gt_scan = 0;
                Some(from + i)
            }
            None => {
                self.gt_scan = raw.len();
                None
            }
        }
    }

    fn emit_value(&self, raw: &str, a: usize, b: usize, out: &mut Vec<StreamEvent>) {
        if b <= a {
            return;
        }
        let fragment = if self.param_is_string {
            let mut f = String::new();
            json::escape_fragment_into(&parse::unescape_entities(&raw[a..b]), &mut f);
            f
        } else {
            raw[a..b].to_owned()
        };
        if !fragment.is_empty() {
            out.push(StreamEvent::ToolCallArguments {
                index: self.index,
                fragment,
            });
        }
    }

    /// How much of a parameter value may be emitted: hold a partial closing tag and, in string
    /// values, a partial entity.
    fn safe_value_end(&self, raw: &[u8], start: usize) -> usize {
        let len = raw.len();
        let end_tag = self.syn.param_end.as_bytes();
        let mut limit = len;
        let scan = if len > start + end_tag.len() {
            len - end_tag.len()
        } else {
            start
        };
        if let Some(m) = (scan..len).rev().find(|&i| raw[i] == b'<') {
            if end_tag.starts_with(&raw[m..len]) && len - m < end_tag.len() {
                limit = m;
            }
        }
        if self.param_is_string {
            const ENTS: [&str; 5] = ["&amp;", "&lt;", "&gt;", "&quot;", "&apos;"];
            let scan = if limit > start + 6 { limit - 6 } else { start };
            if let Some(amp) = (scan..limit).rev().find(|&i| raw[i] == b'&') {
                let tail = &raw[amp..limit];
                if ENTS
                    .iter()
                    .any(|e| tail.len() < e.len() && e.as_bytes().starts_with(tail))
                {
                    limit = amp;
                }
            }
        }
        limit
    }

    fn fail(&mut self) {
        self.state = ToolState::Failed;
    }

    fn update(&mut self, raw: &str, out: &mut Vec<StreamEvent>) {
        let b = raw.as_bytes();
        while self.active() && self.pos < b.len() {
            match self.state {
                ToolState::BetweenInvokes => {
                    self.pos = parse::skip_ws(raw, self.pos);
                    if self.pos >= b.len() {
                        return;
                    }
                    let rest = &b[self.pos..];
                    if rest.starts_with(self.syn.end.as_bytes()) {
                        self.pos += self.syn.end.len();
                        self.state = ToolState::Done;
                        return;
                    }
                    if partial_lit(b, self.pos, self.syn.end)
                        || partial_lit(b, self.pos, self.syn.invoke_start)
                    {
                        return;
                    }
                    if !rest.starts_with(self.syn.invoke_start.as_bytes()) {
                        return self.fail();
                    }
                    let Some(gt) = self.tag_end(b) else { return };
                    let Some(name) = parse::attr(&raw[self.pos..=gt], "name") else {
                        return self.fail();
                    };
                    out.push(StreamEvent::ToolCallStart {
                        index: self.index,
                        name,
                    });
                    out.push(StreamEvent::ToolCallArguments {
                        index: self.index,
                        fragment: "{".into(),
                    });
                    self.announced = true;
                    self.args_open = true;
                    self.first_param = true;
                    self.pos = gt + 1;
                    self.state = ToolState::BetweenParams;
                }
                ToolState::BetweenParams => {
                    self.pos = parse::skip_ws(raw, self.pos);
                    if self.pos >= b.len() {
                        return;
                    }
                    let rest = &b[self.pos..];
                    if rest.starts_with(self.syn.invoke_end.as_bytes()) {
                        if self.args_open {
                            out.push(StreamEvent::ToolCallArguments {
                                index: self.index,
                                fragment: "}".into(),
                            });
                        }
                        out.push(StreamEvent::ToolCallEnd { index: self.index });
                        self.args_open = false;
                        self.pos += self.syn.invoke_end.len();
                        self.index += 1;
                        self.state = ToolState::BetweenInvokes;
                        continue;
                    }
                    if partial_lit(b, self.pos, self.syn.invoke_end)
                        || partial_lit(b, self.pos, self.syn.param_start)
                    {
                        return;
                    }
                    if !rest.starts_with(self.syn.param_start.as_bytes()) {
                        return self.fail();
                    }
                    let Some(gt) = self.tag_end(b) else { return };
                    let tag = &raw[self.pos..=gt];
                    let (Some(name), Some(is_string)) =
                        (parse::attr(tag, "name"), parse::attr(tag, "string"))
                    else {
                        return self.fail();
                    };
                    self.param_is_string = is_string == "true";
                    let mut f = String::new();
                    if !self.first_param {
                        f.push(',');
                    }
                    self.first_param = false;
                    f.push_str(&json::escape(&name));
                    f.push(':');
                    if self.param_is_string {
                        f.push('"');
                    }
                    out.push(StreamEvent::ToolCallArguments {
                        index: self.index,
                        fragment: f,
                    });
                    self.pos = gt + 1;
                    self.state = ToolState::ParamValue;
                }
                ToolState::ParamValue => {
                    if let Some(e) = find_from(b, self.pos, self.syn.param_end.as_bytes()) {
                        self.emit_value(raw, self.pos, e, out);
                        if self.param_is_string {
                            out.push(StreamEvent::ToolCallArguments {
                                index: self.index,
                                fragment: "\"".into(),
                            });
                        }
                        self.pos = e + self.syn.param_end.len();
                        self.state = ToolState::BetweenParams;
                        continue;
                    }
                    let limit = self.safe_value_end(b, self.pos);
                    self.emit_value(raw, self.pos, limit, out);
                    self.pos = self.pos.max(limit);
                    return;
                }
                ToolState::Done | ToolState::Failed => return,
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TrackMode {
    Search,
    Structural,
    StringBody,
    JsonParam,
    Done,
}

/// ds4's DSML decode tracker: a forgiving recogniser of where sampling is inside DSML.
#[derive(Debug, Clone)]
struct DsmlTracker {
    mode: TrackMode,
    state: DsmlState,
    syn: &'static Syntax,
    pos: usize,
    json_in_string: bool,
    json_escaped: bool,
    gt_scan: usize,
}

impl DsmlTracker {
    fn new() -> Self {
        Self {
            mode: TrackMode::Search,
            state: DsmlState::Outside,
            syn: &SYNTAXES[0],
            pos: 0,
            json_in_string: false,
            json_escaped: false,
            gt_scan: 0,
        }
    }

    fn partial_min2(&self, b: &[u8], lit: &str) -> bool {
        b.len() - self.pos >= 2 && partial_lit(b, self.pos, lit)
    }

    fn tag_end(&mut self, b: &[u8]) -> Option<usize> {
        let from = self.gt_scan.max(self.pos);
        match b[from..].iter().position(|&c| c == b'>') {
            Some(i) => {
                self.gt_scan = 0;
                Some(from + i)
            }
            None => {
                self.gt_scan = b.len();
                None
            }
        }
    }

    fn update(&mut self, raw: &str) {
        let b = raw.as_bytes();
        loop {
            match self.mode {
                TrackMode::Done => {
                    self.state = DsmlState::Outside;
                    return;
                }
                TrackMode::Search => match find_any_start(b, self.pos) {
                    None => {
                        self.pos = b
                            .len()
                            .saturating_sub(max_start_len())
                            .max(self.pos.min(b.len()));
                        self.state = DsmlState::Outside;
                        return;
                    }
                    Some((p, syn)) => {
                        self.syn = syn;
                        self.pos = p + syn.start.len();
                        self.mode = TrackMode::Structural;
                        self.state = DsmlState::Structural;
                    }
                },
                TrackMode::StringBody => {
                    while self.pos < b.len() {
                        if b[self.pos..].starts_with(self.syn.param_end.as_bytes()) {
                            self.pos += self.syn.param_end.len();
                            self.mode = TrackMode::Structural;
                            self.state = DsmlState::Structural;
                            break;
                        }
                        if self.partial_min2(b, self.syn.param_end) {
                            self.state = DsmlState::Structural;
                            return;
                        }
                        self.pos += 1;
                    }
                    if self.mode == TrackMode::StringBody {
                        self.state = DsmlState::StringBody;
                        return;
                    }
                }
                TrackMode::JsonParam => {
                    while self.pos < b.len() {
                        if !self.json_in_string {
                            if b[self.pos..].starts_with(self.syn.param_end.as_bytes()) {
                                self.pos += self.syn.param_end.len();
                                self.mode = TrackMode::Structural;
                                self.state = DsmlState::Structural;
                                break;
                            }
                            if self.partial_min2(b, self.syn.param_end) {
                                self.state = DsmlState::Structural;
                                return;
                            }
                        }
                        let c = b[self.pos];
                        self.pos += 1;
                        if self.json_in_string {
                            if self.json_escaped {
                                self.json_escaped = false;
                            } else if c == b'\\' {
                                self.json_escaped = true;
                            } else if c == b'"' {
                                self.json_in_string = false;
                            }
                        } else if c == b'"' {
                            self.json_in_string = true;
                        }
                    }
                    if self.mode == TrackMode::JsonParam {
                        self.state = if self.json_in_string {
                            DsmlState::JsonString
                        } else {
                            DsmlState::JsonStructural
                        };
                        return;
                    }
                }
                TrackMode::Structural => {
                    while self.pos < b.len() && json::is_space(b[self.pos]) {
                        self.pos += 1;
                    }
                    self.state = DsmlState::Structural;
                    if self.pos >= b.len() {
                        return;
                    }
                    let rest = &b[self.pos..];
                    if rest.starts_with(self.syn.end.as_bytes()) {
                        self.mode = TrackMode::Done;
                        self.pos += self.syn.end.len();
                        self.state = DsmlState::Outside;
                        return;
                    }
                    if rest.starts_with(self.syn.invoke_end.as_bytes()) {
                        self.pos += self.syn.invoke_end.len();
                        continue;
                    }
                    if rest.starts_with(self.syn.invoke_start.as_bytes()) {
                        let Some(gt) = self.tag_end(b) else { return };
                        self.pos = gt + 1;
                        continue;
                    }
                    if rest.starts_with(self.syn.param_start.as_bytes()) {
                        let start = self.pos;
                        let Some(gt) = self.tag_end(b) else { return };
                        let string =
                            parse::attr(&raw[start..=gt], "string").is_some_and(|s| s == "true");
                        self.pos = gt + 1;
                        if string {
                            self.mode = TrackMode::StringBody;
                            self.state = DsmlState::StringBody;
                        } else {
                            self.mode = TrackMode::JsonParam;
                            self.json_in_string = false;
                            self.json_escaped = false;
                            self.state = DsmlState::JsonStructural;
                        }
                        continue;
                    }
                    // Unknown or partial structure: stay structural until more text arrives.
                    return;
                }
            }
        }
    }
}

/// The streaming parser. Feed decoded text with [`OutputStream::push`] (any chunking; use
/// [`crate::StreamDecoder`] so chunks are whole chars), stop sampling when
/// [`OutputStream::halted`] says so, then call [`OutputStream::finish`].
#[derive(Debug, Clone)]
pub struct OutputStream {
    opts: StreamOptions,
    max_stop: usize,
    text: String,
    halt: Option<Halt>,
    // Tool-marker watch for the stop decision (ds4's decode loop).
    think_inside: bool,
    waiting_think_close: bool,
    tool_scan_from: usize,
    saw_start: bool,
    saw_end: bool,
    // Emission.
    phase: Phase,
    emit: usize,
    checked_think_prefix: bool,
    marker_scan: usize,
    ws_cache: (usize, usize),
    content_end: usize,
    tool: Option<ToolStream>,
    dsml: DsmlTracker,
}

impl OutputStream {
    /// A parser for one generation.
    pub fn new(opts: StreamOptions) -> Self {
        let mut opts = opts;
        opts.stop.retain(|s| !s.is_empty());
        let max_stop = opts.stop.iter().map(String::len).max().unwrap_or(0);
        let thinking = opts.thinking;
        Self {
            opts,
            max_stop,
            text: String::new(),
            halt: None,
            think_inside: thinking,
            waiting_think_close: thinking,
            tool_scan_from: 0,
            saw_start: false,
            saw_end: false,
            phase: if thinking {
                Phase::Thinking
            } else {
                Phase::Text
            },
            emit: 0,
            checked_think_prefix: false,
            marker_scan: 0,
            ws_cache: (0, 0),
            content_end: 0,
            tool: None,
            dsml: DsmlTracker::new(),
        }
    }

    /// The generated text kept so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Set once a stop sequence or (with tools) a tool-call end tag was produced: sample no more.
    pub fn halted(&self) -> Option<Halt> {
        self.halt
    }

    /// A tool-call start marker was seen outside reasoning (tools only).
    pub fn saw_tool_start(&self) -> bool {
        self.saw_start
    }

    /// Where sampling is inside DSML (always `Outside` without tools).
    pub fn dsml_state(&self) -> DsmlState {
        if self.opts.tools {
            self.dsml.state
        } else {
            DsmlState::Outside
        }
    }

    /// Adds decoded text; returns what may be sent now. Text after a halt is ignored.
    pub fn push(&mut self, chunk: &str) -> Vec<StreamEvent> {
        if self.halt.is_some() || chunk.is_empty() {
            return Vec::new();
        }
        for c in chunk.chars() {
            self.text.push(c);
            self.on_char();
            if self.halt.is_some() {
                break;
            }
        }
        if self.opts.tools {
            self.dsml.update(&self.text);
        }
        let mut out = Vec::new();
        self.emit_update(false, &mut out);
        out
    }

    /// Per-char checks of ds4's decode loop: reasoning gate, stop sequences, tool markers.
    fn on_char(&mut self) {
        let t = &self.text;
        let len = t.len();
        if t.ends_with(THINK_OPEN) {
            self.think_inside = true;
        } else if t.ends_with(THINK_CLOSE) {
            self.think_inside = false;
        }
        // Stop sequences: the first to complete wins; on a tie the one starting first.
        if let Some(pos) = self
            .opts
            .stop
            .iter()
            .filter(|s| t.ends_with(s.as_str()))
            .map(|s| len - s.len())
            .min()
        {
            self.text.truncate(pos);
            self.halt = Some(Halt::StopSequence);
            return;
        }
        if !self.opts.tools {
            return;
        }
        if self.opts.thinking && self.think_inside {
            self.waiting_think_close = true;
            self.tool_scan_from = len;
            return;
        }
        if self.waiting_think_close {
            self.tool_scan_from = t.rfind(THINK_CLOSE).map_or(len, |i| i + THINK_CLOSE.len());
            self.waiting_think_close = false;
        }
        let completes = |lit: &str| t.ends_with(lit) && len - lit.len() >= self.tool_scan_from;
        if !self.saw_start {
            self.saw_start = SYNTAXES.iter().any(|s| completes(s.start));
        } else if !self.saw_end && SYNTAXES.iter().any(|s| completes(s.end)) {
            self.saw_end = true;
            self.halt = Some(Halt::ToolCalls);
        }
        self.tool_scan_from = self
            .tool_scan_from
            .max(len.saturating_sub(TOOL_MARKER_HOLD));
    }

    /// Start of the whitespace run that ends at `end` (not before `floor`), cached so long
    /// runs are not rescanned on every push.
    fn trailing_ws_start(&mut self, floor: usize, end: usize) -> usize {
        let b = self.text.as_bytes();
        // Cache: the whitespace run ending at `cend` starts at `cstart`.
        let (cend, cstart) = self.ws_cache;
        let start = if cend <= end {
            match b[cend..end].iter().rposition(|&c| !json::is_space(c)) {
                None => cstart,
                Some(k) => cend + k + 1,
            }
        } else {
            let mut s = end;
            while s > 0 && json::is_space(b[s - 1]) {
                s -= 1;
            }
            s
        };
        self.ws_cache = (end, start);
        start.max(floor)
    }

    fn emit_update(&mut self, final_: bool, out: &mut Vec<StreamEvent>) {
        let len = self.text.len();
        let stream_len = if final_ || self.halt == Some(Halt::StopSequence) || self.max_stop <= 1 {
            len
        } else {
            floor_boundary(&self.text, len.saturating_sub(self.max_stop - 1))
        };

        if self.phase == Phase::Thinking {
            let raw = &self.text[..stream_len];
            if !self.checked_think_prefix {
                if raw.len() < THINK_OPEN.len() && THINK_OPEN.starts_with(raw) && !final_ {
                    return;
                }
                if raw.starts_with(THINK_OPEN) {
                    self.emit = THINK_OPEN.len();
                }
                self.checked_think_prefix = true;
            }
            let close = find_from(raw.as_bytes(), self.emit, THINK_CLOSE.as_bytes());
            let limit = match close {
                Some(c) => c,
                None if final_ => stream_len,
                None => floor_boundary(raw, stream_len.saturating_sub(THINK_CLOSE.len() - 1))
                    .max(self.emit),
            };
            if limit > self.emit {
                out.push(StreamEvent::Reasoning(raw[self.emit..limit].to_owned()));
                self.emit = limit;
            }
            match close {
                Some(c) => {
                    self.emit = c + THINK_CLOSE.len();
                    self.content_end = self.emit;
                    self.marker_scan = self.emit;
                    self.phase = Phase::Text;
                }
                None if final_ => {
                    self.phase = Phase::Suppress;
                    return;
                }
                None => return,
            }
        }

        if self.phase == Phase::Text {
            let mut limit = stream_len;
            let mut marker = None;
            if self.opts.tools {
                let from = floor_boundary(&self.text, self.marker_scan.max(self.emit));
                marker = find_any_start(&self.text.as_bytes()[..stream_len], from);
                match marker {
                    Some((m, _)) => limit = parse::trim_ws_end(&self.text, self.emit, m),
                    None => {
                        self.marker_scan = stream_len.saturating_sub(max_start_len() - 1);
                        if !final_ {
                            limit = self.trailing_ws_start(self.emit, stream_len);
                            let b = self.text.as_bytes();
                            let scan = if stream_len - self.emit > TOOL_MARKER_HOLD {
                                stream_len - TOOL_MARKER_HOLD
                            } else {
                                self.emit
                            };
                            if let Some(lt) = (scan..stream_len).rev().find(|&i| b[i] == b'<') {
                                limit = limit.min(lt);
                            }
                            limit = parse::trim_ws_end(&self.text, self.emit, limit);
                        }
                    }
                }
            }
            if limit > self.emit {
                out.push(StreamEvent::Content(self.text[self.emit..limit].to_owned()));
                self.emit = limit;
                self.content_end = limit;
            }
            if let Some((m, syn)) = marker {
                self.emit = m;
                self.tool = Some(ToolStream::new(syn, m));
                self.phase = Phase::Tool;
            } else if final_ {
                self.phase = Phase::Suppress;
            }
        }

        if self.phase == Phase::Tool {
            if let Some(tool) = self.tool.as_mut() {
                tool.update(&self.text[..stream_len], out);
                if !tool.active() {
                    self.phase = Phase::Suppress;
                }
            }
        }
    }

    /// Ends the generation: flushes held text and returns the last events and the final
    /// message. `cause` is why the engine stopped (ignored if the stream halted itself).
    pub fn finish(mut self, cause: EndCause) -> (Vec<StreamEvent>, FinalOutput) {
        let mut error = None;
        let mut finish = match (self.halt, &cause) {
            (Some(Halt::StopSequence), _) => FinishReason::Stop,
            (Some(Halt::ToolCalls), _) => FinishReason::ToolCalls,
            (None, EndCause::Eos) => FinishReason::Stop,
            (None, EndCause::Length) => FinishReason::Length,
            (None, EndCause::Error(e)) => {
                error = Some(e.clone());
                FinishReason::Error
            }
        };
        if self.opts.tools && self.saw_start && !self.saw_end && finish != FinishReason::Error {
            finish = FinishReason::Error;
            error = Some("unterminated tool call".into());
        }
        let mut events = Vec::new();
        self.emit_update(true, &mut events);

        let parsed = parse::parse_output(&self.text, self.opts.thinking);
        let mut tool_parse_failed = false;
        if parsed.tool_parse_failed {
            tool_parse_failed = true;
            if self.opts.tools && self.saw_start && finish != FinishReason::Error {
                if finish != FinishReason::Length {
                    finish = FinishReason::Stop;
                }
                error = Some("invalid tool call".into());
            }
        }
        let announced = self.tool.as_ref().is_some_and(|t| t.announced);
        if tool_parse_failed
            && !announced
            && self.tool.is_some()
            && self.content_end < self.text.len()
        {
            // Release the held block as ordinary text (see the module note).
            events.push(StreamEvent::Content(
                self.text[self.content_end..].to_owned(),
            ));
        }
        if !parsed.message.tool_calls.is_empty() {
            finish = FinishReason::ToolCalls;
            if !announced {
                for (index, call) in parsed.message.tool_calls.iter().enumerate() {
                    events.push(StreamEvent::ToolCallStart {
                        index,
                        name: call.name.clone(),
                    });
                    events.push(StreamEvent::ToolCallArguments {
                        index,
                        fragment: call.arguments_compact(),
                    });
                    events.push(StreamEvent::ToolCallEnd { index });
                }
            }
        }
        let out = FinalOutput {
            text: self.text,
            message: parsed.message,
            finish,
            error,
            tool_parse_failed,
        };
        (events, out)
    }
}

/// Joins adjacent deltas of the same kind (and argument fragments of the same call): the
/// chunking-independent view of an event sequence.
pub fn coalesce(events: &[StreamEvent]) -> Vec<StreamEvent> {
    let mut out: Vec<StreamEvent> = Vec::with_capacity(events.len());
    for e in events {
        match (out.last_mut(), e) {
            (Some(StreamEvent::Reasoning(a)), StreamEvent::Reasoning(b)) => a.push_str(b),
            (Some(StreamEvent::Content(a)), StreamEvent::Content(b)) => a.push_str(b),
            (
                Some(StreamEvent::ToolCallArguments {
                    index: i,
                    fragment: a,
                }),
                StreamEvent::ToolCallArguments {
                    index: j,
                    fragment: b,
                },
            ) if i == j => a.push_str(b),
            _ => out.push(e.clone()),
        }
    }
    out
}
