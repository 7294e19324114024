import { test } from 'node:test';
import assert from 'node:assert/strict';
import { buildRequest, errorMessage, parseTools } from '../src/api.js';
import { computeStats, statsLine } from '../src/stats.js';
import { renderMarkdown } from '../src/markdown.js';

test('the request streams with usage, maps thinking, sends only the set knobs', () => {
  const b = buildRequest({ messages: [{ role: 'user', content: 'hi' }], settings: { temperature: '0.5', top_k: '40', top_p: '', max_tokens: '100' }, thinking: 'none' });
  assert.equal(b.stream, true);
  assert.deepEqual(b.stream_options, { include_usage: true });
  assert.equal(b.reasoning_effort, 'none');
  assert.equal(b.temperature, 0.5);
  assert.equal(b.top_k, 40);
  assert.equal(b.max_tokens, 100);
  assert.ok(!('top_p' in b));
  assert.equal(buildRequest({ messages: [], thinking: 'max' }).reasoning_effort, 'max');
  assert.equal(buildRequest({ messages: [], thinking: 'bogus' }).reasoning_effort, 'high');
});

test('tools: OpenAI tools or bare functions; bad JSON is a readable error', () => {
  assert.deepEqual(parseTools('[{"name":"f"}]'), [{ type: 'function', function: { name: 'f' } }]);
  const t = [{ type: 'function', function: { name: 'g', parameters: {} } }];
  assert.deepEqual(buildRequest({ messages: [], settings: { tools: JSON.stringify(t) } }).tools, t);
  assert.throws(() => parseTools('{'), /not JSON/);
  assert.throws(() => parseTools('[1]'), /tools\[0\]/);
});

test('error answers become messages', () => {
  assert.match(errorMessage(401, '{"error":{"message":"invalid or missing API key"}}'), /^401: .*API key/);
  assert.match(errorMessage(429, '{"error":{"message":"busy"}}', { 'retry-after': '1' }), /^429: .*busy.*1 s/);
  assert.match(errorMessage(413, '{"error":{"message":"request body exceeds"}}'), /^413: .*too large/);
  assert.match(errorMessage(400, '{"error":{"message":"too long","code":"context_length_exceeded"}}'), /context/);
  assert.equal(errorMessage(500, 'plain text'), '500: plain text');
});

test('stats from usage and the clock', () => {
  const s = computeStats({
    usage: { prompt_tokens: 120, completion_tokens: 11, prompt_tokens_details: { cached_tokens: 100, cache_write_tokens: 20 } },
    tStart: 0,
    tFirst: 500,
    tEnd: 1500,
    ctx: 4096,
  });
  assert.deepEqual(
    { ...s },
    { prompt: 120, reused: 100, fresh: 20, completion: 11, prefillTps: 40, genTps: 10, ctxUsed: 131, ctx: 4096 },
  );
  assert.equal(statsLine(s), 'prompt 120 (100 reused, 20 new) · 11 generated · prefill 40.0 t/s · gen 10.0 t/s · context 131 / 4096');
  assert.equal(computeStats({ usage: null }), null);
});

test('markdown: code highlighted, maths as MathML, raw HTML and script links neutralised', () => {
  const h = renderMarkdown('x $a^2$ <img src=x onerror=alert(1)>\n\n```python\nprint(1)\n```\n\n$$\\frac12$$\n\n[bad](javascript:alert(1))');
  assert.match(h, /<math/);
  assert.match(h, /hljs-built_in|hljs-number/);
  assert.match(h, /class="copy-code"/);
  assert.ok(!h.includes('<img'), h);
  assert.ok(h.includes('&lt;img'), h);
  assert.ok(!h.includes('javascript:'), h);
  assert.ok(!/ style=/.test(h), 'no inline styles (the CSP would block them)');
  assert.ok(!renderMarkdown('costs $5 and $6').includes('<math'));
});
