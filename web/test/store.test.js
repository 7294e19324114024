import { test } from 'node:test';
import assert from 'node:assert/strict';
import {
  activePath,
  addMessage,
  apiMessages,
  createStore,
  deleteBranch,
  editUserMessage,
  newConversation,
  parseImport,
  regenerateParent,
  siblingInfo,
  switchSibling,
} from '../src/store.js';

function memoryStorage() {
  const m = new Map();
  return {
    getItem: (k) => (m.has(k) ? m.get(k) : null),
    setItem: (k, v) => m.set(k, String(v)),
    removeItem: (k) => m.delete(k),
    map: m,
  };
}

function twoTurns() {
  const c = newConversation();
  const u1 = addMessage(c, null, { role: 'user', content: 'first question' });
  const a1 = addMessage(c, u1.id, { role: 'assistant', content: 'first answer', reasoning: 'hmm' });
  const u2 = addMessage(c, a1.id, { role: 'user', content: 'second' });
  const a2 = addMessage(c, u2.id, { role: 'assistant', content: 'second answer' });
  return { c, u1, a1, u2, a2 };
}

const texts = (c) => activePath(c).map((n) => n.content);

test('a conversation is a path; the title comes from the first question', () => {
  const { c } = twoTurns();
  assert.deepEqual(texts(c), ['first question', 'first answer', 'second', 'second answer']);
  assert.equal(c.title, 'first question');
});

test('regenerate adds a sibling answer; the switch shows either', () => {
  const { c, a2, u2 } = twoTurns();
  const parent = regenerateParent(c, a2.id);
  assert.equal(parent, u2.id);
  const b2 = addMessage(c, parent, { role: 'assistant', content: 'other answer' });
  assert.deepEqual(texts(c).slice(-1), ['other answer']);
  assert.deepEqual(siblingInfo(c, b2.id), { index: 1, count: 2, ids: [a2.id, b2.id] });
  assert.ok(switchSibling(c, b2.id, -1));
  assert.deepEqual(texts(c).slice(-1), ['second answer']);
  assert.ok(!switchSibling(c, a2.id, -1), 'no version before the first');
  assert.throws(() => regenerateParent(c, u2.id));
});

test('editing a past user message branches there and keeps the old branch', () => {
  const { c, u1, a2 } = twoTurns();
  const e = editUserMessage(c, u1.id, 'edited question');
  assert.equal(e.parent, null);
  assert.deepEqual(texts(c), ['edited question']);
  addMessage(c, e.id, { role: 'assistant', content: 'new answer' });
  assert.deepEqual(texts(c), ['edited question', 'new answer']);
  // Back to the first version: the whole old branch, down to its last answer, is shown.
  assert.ok(switchSibling(c, e.id, -1));
  assert.deepEqual(texts(c), ['first question', 'first answer', 'second', 'second answer']);
  assert.equal(activePath(c).at(-1).id, a2.id);
  assert.throws(() => editUserMessage(c, a2.id, 'x'), /only user/);
});

test('the API messages follow the path up to the given message, with system, reasoning and tools', () => {
  const { c, a1, u2 } = twoTurns();
  c.settings.system = 'Be brief.';
  a1.toolCalls = [{ id: 'call_1', name: 'bash', arguments: '{"command":"ls"}' }];
  const t = addMessage(c, a1.id, { role: 'tool', toolCallId: 'call_1', content: 'a.txt' });
  const m = apiMessages(c, t.id);
  assert.deepEqual(m, [
    { role: 'system', content: 'Be brief.' },
    { role: 'user', content: 'first question' },
    {
      role: 'assistant',
      content: 'first answer',
      reasoning_content: 'hmm',
      tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'bash', arguments: '{"command":"ls"}' } }],
    },
    { role: 'tool', tool_call_id: 'call_1', content: 'a.txt' },
  ]);
  assert.equal(apiMessages(c, u2.id).length, 4);
});

test('deleting a branch shows its sibling', () => {
  const { c, u2, a2 } = twoTurns();
  const b2 = addMessage(c, u2.id, { role: 'assistant', content: 'other' });
  deleteBranch(c, b2.id);
  assert.equal(c.nodes[b2.id], undefined);
  assert.equal(activePath(c).at(-1).id, a2.id);
});

test('the store lists, renames, deletes, exports and imports', () => {
  const st = createStore(memoryStorage());
  const { c } = twoTurns();
  st.save(c);
  const d = newConversation(c.updated + 10);
  addMessage(d, null, { role: 'user', content: 'another' });
  d.updated = c.updated + 10;
  st.save(d);
  assert.deepEqual(st.list().map((e) => e.title), ['another', 'first question']);
  st.rename(c.id, 'Renamed');
  assert.equal(st.load(c.id).title, 'Renamed');
  assert.equal(st.load(c.id).titled, true);
  const json = st.exportAll();
  st.remove(d.id);
  assert.deepEqual(st.list().map((e) => e.id), [c.id]);
  // Importing the export: the kept one gets a new id, the deleted one comes back.
  assert.equal(st.importJson(json), 2);
  const titles = st.list().map((e) => e.title).sort();
  assert.deepEqual(titles, ['Renamed', 'Renamed', 'another']);
  const again = st.list().find((e) => e.title === 'Renamed' && e.id !== c.id);
  assert.deepEqual(texts(st.load(again.id)), texts(c));
});

test('a broken import is refused with a reason', () => {
  assert.throws(() => parseImport('nope'), /not JSON/);
  assert.throws(() => parseImport('{"format":"other"}'), /not a ds4-webchat export/);
  assert.throws(
    () => parseImport(JSON.stringify({ format: 'ds4-webchat', version: 1, conversations: [{ id: 'c', nodes: { x: { id: 'x', role: 'robot' } } }] })),
    /not a message/,
  );
  assert.throws(
    () => parseImport(JSON.stringify({ format: 'ds4-webchat', version: 1, conversations: [{ id: 'c', nodes: { x: { id: 'x', role: 'user', parent: 'gone' } } }] })),
    /missing parent/,
  );
});

test('a corrupt stored index reads as empty', () => {
  const s = memoryStorage();
  s.setItem('ds4chat.v1.index', '{broken');
  assert.deepEqual(createStore(s).list(), []);
});
