// Server-sent events: a byte-stream parser and the reducer that folds OpenAI chat-completion
// chunks (what ds4-server streams on /v1/chat/completions) into one assistant message.
// Pure functions: the unit tests (test/sse.test.js) run them under node.

/** Returns `feed(text)`, which calls `onEvent({event, data, id})` for each complete event.
 * Handles CRLF/CR/LF line ends, comment lines (`: keep-alive`), multi-line `data:` fields,
 * and events split across chunks. `feed.end()` flushes a last event with no blank line. */
export function createSSEParser(onEvent) {
  let buf = '';
  let data = [];
  let event = '';
  let id = '';
  const dispatch = () => {
    if (data.length) onEvent({ event: event || 'message', data: data.join('\n'), id });
    data = [];
    event = '';
  };
  const line = (l) => {
    if (l === '') return dispatch();
    if (l.startsWith(':')) return;
    const i = l.indexOf(':');
    const field = i < 0 ? l : l.slice(0, i);
    let value = i < 0 ? '' : l.slice(i + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    if (field === 'data') data.push(value);
    else if (field === 'event') event = value;
    else if (field === 'id') id = value;
  };
  const feed = (text) => {
    buf += text;
    for (;;) {
      const m = /\r\n|\r|\n/.exec(buf);
      if (!m) break;
      // A lone CR at the very end may be the first half of CRLF: wait for more.
      if (m[0] === '\r' && m.index === buf.length - 1) break;
      line(buf.slice(0, m.index));
      buf = buf.slice(m.index + m[0].length);
    }
  };
  feed.end = () => {
    if (buf) line(buf);
    buf = '';
    dispatch();
  };
  return feed;
}

/** A fresh assistant message as the reducer builds it. */
export function emptyAnswer() {
  return { content: '', reasoning: '', toolCalls: [], finish: null, usage: null, error: null, done: false };
}

/** Folds one SSE `data:` payload of a chat-completions stream into `msg` (mutated and
 * returned). `[DONE]` marks the end; a JSON `error` object is an in-stream error. */
export function applyChunk(msg, data) {
  if (data === '[DONE]') {
    msg.done = true;
    return msg;
  }
  let c;
  try {
    c = JSON.parse(data);
  } catch {
    msg.error = `unreadable stream chunk: ${String(data).slice(0, 80)}`;
    return msg;
  }
  if (c.error) {
    msg.error = c.error.message || JSON.stringify(c.error);
    msg.finish = msg.finish || 'error';
    return msg;
  }
  if (c.usage) msg.usage = c.usage;
  for (const ch of c.choices || []) {
    const d = ch.delta || {};
    if (typeof d.reasoning_content === 'string') msg.reasoning += d.reasoning_content;
    if (typeof d.content === 'string') msg.content += d.content;
    for (const t of d.tool_calls || []) {
      const i = Number.isInteger(t.index) ? t.index : msg.toolCalls.length;
      const slot = (msg.toolCalls[i] ||= { id: '', name: '', arguments: '' });
      if (t.id) slot.id = t.id;
      if (t.function?.name) slot.name += t.function.name;
      if (typeof t.function?.arguments === 'string') slot.arguments += t.function.arguments;
    }
    if (ch.finish_reason) msg.finish = ch.finish_reason;
  }
  return msg;
}
