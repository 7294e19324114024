// Talking to ds4-server: the request body for /v1/chat/completions and readable messages
// for the errors it answers (docs/server.md §8). Pure functions (test/api.test.js).

/** Thinking per message: `none` (off), `high` (on, the server's default) or `max`
 * (docs/chat.md §2.1: max falls back to high below a 393216-token context). */
export const THINKING = ['none', 'high', 'max'];

function num(v, int = false) {
  if (v === '' || v == null) return undefined;
  const n = Number(v);
  if (!Number.isFinite(n)) return undefined;
  return int ? Math.trunc(n) : n;
}

/** The JSON body of a streamed chat completion. Empty settings are left to the server. */
export function buildRequest({ messages, settings = {}, thinking = 'high', model = 'deepseek-v4-flash' }) {
  const body = {
    model,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    reasoning_effort: THINKING.includes(thinking) ? thinking : 'high',
  };
  const knobs = { temperature: num(settings.temperature), top_p: num(settings.top_p), top_k: num(settings.top_k, true), min_p: num(settings.min_p), max_tokens: num(settings.max_tokens, true) };
  for (const [k, v] of Object.entries(knobs)) if (v !== undefined) body[k] = v;
  if (settings.tools && String(settings.tools).trim()) {
    const tools = parseTools(settings.tools);
    if (tools.length) body.tools = tools;
  }
  return body;
}

/** The conversation's tools setting: a JSON array of OpenAI tools (or of bare functions). */
export function parseTools(text) {
  let v;
  try {
    v = JSON.parse(text);
  } catch (e) {
    throw new Error(`tools: not JSON (${e.message})`);
  }
  if (!Array.isArray(v)) throw new Error('tools: expected a JSON array');
  return v.map((t, i) => {
    if (t && t.type === 'function' && t.function?.name) return t;
    if (t && typeof t.name === 'string') return { type: 'function', function: t };
    throw new Error(`tools[${i}]: expected {"type":"function","function":{"name":…}}`);
  });
}

/** A message for an HTTP error answer (status + its body text). */
export function errorMessage(status, bodyText, headers = {}) {
  let detail = '';
  let code = '';
  try {
    const j = JSON.parse(bodyText);
    detail = j?.error?.message || j?.message || '';
    code = j?.error?.code || j?.error?.type || '';
  } catch {
    detail = String(bodyText || '').slice(0, 300);
  }
  const retry = headers['retry-after'];
  switch (status) {
    case 401:
      return `401: the server wants an API key, and this one was missing or wrong. Enter the key (the one given to ds4-server --api-key) in the key dialog.${detail ? ` (${detail})` : ''}`;
    case 403:
      return `403: the server refused the request: ${detail}`;
    case 413:
      return `413: the request is too large for the server (its body limit).${detail ? ` ${detail}` : ''}`;
    case 429:
      return `429: the server is busy — every slot and queue place is taken.${retry ? ` Try again in ${retry} s.` : ' Try again shortly.'}${detail ? ` (${detail})` : ''}`;
    case 503:
      return `503: the server is not ready (loading the model or shutting down).${retry ? ` Try again in ${retry} s.` : ''}${detail ? ` (${detail})` : ''}`;
    default:
      if (code === 'context_length_exceeded') return `${status}: the conversation is longer than the server's context. ${detail}`;
      return `${status}: ${detail || 'request failed'}`;
  }
}
