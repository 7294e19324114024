import { test } from 'node:test';
import assert from 'node:assert/strict';
import { applyChunk, createSSEParser, emptyAnswer } from '../src/sse.js';

const collect = () => {
  const evs = [];
  const feed = createSSEParser((e) => evs.push(e));
  return { evs, feed };
};

test('events split across chunks, CRLF, comments and multi-line data', () => {
  const { evs, feed } = collect();
  feed(': keep-alive\r\n\r\nda');
  feed('ta: {"a":1}\r');
  feed('\n\r\nevent: ping\ndata: x\ndata: y\n\n');
  feed('data: [DONE]\n');
  assert.equal(evs.length, 2);
  feed('\n');
  assert.deepEqual(
    evs.map((e) => [e.event, e.data]),
    [
      ['message', '{"a":1}'],
      ['ping', 'x\ny'],
      ['message', '[DONE]'],
    ],
  );
});

test('a last event without a blank line is flushed by end()', () => {
  const { evs, feed } = collect();
  feed('data: tail');
  assert.equal(evs.length, 0);
  feed.end();
  assert.deepEqual(evs.map((e) => e.data), ['tail']);
});

test('byte-by-byte feeding gives the same events', () => {
  const text = 'data: {"choices":[{"delta":{"content":"héllo"}}]}\r\n\r\ndata: [DONE]\r\n\r\n';
  const { evs, feed } = collect();
  for (const ch of text) feed(ch);
  assert.deepEqual(evs.map((e) => e.data), ['{"choices":[{"delta":{"content":"héllo"}}]}', '[DONE]']);
});

test('chunks fold into reasoning, content, tool calls, finish and usage', () => {
  const m = emptyAnswer();
  const chunks = [
    { choices: [{ index: 0, delta: { role: 'assistant' } }] },
    { choices: [{ index: 0, delta: { reasoning_content: 'Let me ' } }] },
    { choices: [{ index: 0, delta: { reasoning_content: 'think.' } }] },
    { choices: [{ index: 0, delta: { content: 'Sure.' } }] },
    { choices: [{ index: 0, delta: { tool_calls: [{ index: 0, id: 'call_1', type: 'function', function: { name: 'bash', arguments: '' } }] } }] },
    { choices: [{ index: 0, delta: { tool_calls: [{ index: 0, function: { arguments: '{"command":' } }] } }] },
    { choices: [{ index: 0, delta: { tool_calls: [{ index: 0, function: { arguments: '"ls"}' } }] } }] },
    { choices: [{ index: 0, delta: {}, finish_reason: 'tool_calls' }] },
    { choices: [], usage: { prompt_tokens: 10, completion_tokens: 5, prompt_tokens_details: { cached_tokens: 4 } } },
  ];
  for (const c of chunks) applyChunk(m, JSON.stringify(c));
  applyChunk(m, '[DONE]');
  assert.equal(m.reasoning, 'Let me think.');
  assert.equal(m.content, 'Sure.');
  assert.deepEqual(m.toolCalls, [{ id: 'call_1', name: 'bash', arguments: '{"command":"ls"}' }]);
  assert.equal(m.finish, 'tool_calls');
  assert.equal(m.usage.prompt_tokens, 10);
  assert.equal(m.done, true);
  assert.equal(m.error, null);
});

test('an in-stream error and an unreadable chunk become errors', () => {
  const m = emptyAnswer();
  applyChunk(m, JSON.stringify({ error: { message: 'shutdown requested', type: 'server_error' } }));
  assert.equal(m.error, 'shutdown requested');
  assert.equal(m.finish, 'error');
  const n = emptyAnswer();
  applyChunk(n, '{nope');
  assert.match(n.error, /unreadable/);
});
