// Conversations as trees of messages, kept in the browser (localStorage).
//
// A conversation holds every message ever written in it, each with its `parent` (null for
// a first message). Editing a user message adds a sibling under the same parent, and
// regenerating an answer adds a sibling answer, so nothing is lost: `active` pointers
// (on the conversation for the first level, on each message for its children) pick the
// branch shown, and the shown path is followed from the top through them.
// Pure functions over plain objects (JSON round-trips), plus a small persistence layer over
// any Storage-like object, so the unit tests (test/store.test.js) run them under node.

export const FORMAT = 'ds4-webchat';
export const VERSION = 1;
const PREFIX = 'ds4chat.v1.';

let counter = 0;
export function newId(prefix = 'm') {
  counter += 1;
  const rnd = Math.random().toString(36).slice(2, 8);
  return `${prefix}${Date.now().toString(36)}${counter.toString(36)}${rnd}`;
}

export const DEFAULT_SETTINGS = Object.freeze({
  system: '',
  temperature: '',
  top_p: '',
  top_k: '',
  min_p: '',
  max_tokens: '',
  tools: '',
});

export function newConversation(now = Date.now()) {
  return {
    id: newId('c'),
    title: 'New chat',
    titled: false,
    created: now,
    updated: now,
    settings: { ...DEFAULT_SETTINGS },
    nodes: {},
    active: null,
  };
}

/** Adds a message under `parentId` (null: first level) and makes it the shown branch. */
export function addMessage(conv, parentId, fields) {
  const node = { id: newId(), parent: parentId ?? null, active: null, seq: nextSeq(conv), ...fields };
  conv.nodes[node.id] = node;
  if (node.parent == null) conv.active = node.id;
  else conv.nodes[node.parent].active = node.id;
  conv.updated = Date.now();
  if (!conv.titled && node.role === 'user' && node.parent == null) {
    conv.title = titleFrom(node.content);
  }
  return node;
}

export function titleFrom(text) {
  const t = String(text || '').replace(/\s+/g, ' ').trim();
  if (!t) return 'New chat';
  return t.length > 48 ? `${t.slice(0, 47)}…` : t;
}

/** The children of `parentId` (null: first level), oldest first. */
export function children(conv, parentId) {
  return Object.values(conv.nodes)
    .filter((n) => (n.parent ?? null) === (parentId ?? null))
    .sort((a, b) => (a.seq ?? 0) - (b.seq ?? 0) || (a.id < b.id ? -1 : 1));
}

/** The shown path, first message to last. */
export function activePath(conv) {
  const path = [];
  let id = conv.active;
  const seen = new Set();
  while (id && conv.nodes[id] && !seen.has(id)) {
    seen.add(id);
    path.push(conv.nodes[id]);
    id = conv.nodes[id].active;
  }
  return path;
}

/** The path from the first message to `id`. */
export function pathTo(conv, id) {
  const path = [];
  const seen = new Set();
  while (id && conv.nodes[id] && !seen.has(id)) {
    seen.add(id);
    path.unshift(conv.nodes[id]);
    id = conv.nodes[id].parent;
  }
  return path;
}

/** `{index, count}` of a message among its siblings (for the "‹ 2/3 ›" switch). */
export function siblingInfo(conv, id) {
  const n = conv.nodes[id];
  const sibs = children(conv, n.parent);
  return { index: sibs.findIndex((s) => s.id === id), count: sibs.length, ids: sibs.map((s) => s.id) };
}

/** Shows the sibling `delta` steps away from `id` (and the branch last shown below it). */
export function switchSibling(conv, id, delta) {
  const { index, ids } = siblingInfo(conv, id);
  const j = index + delta;
  if (j < 0 || j >= ids.length) return false;
  const n = conv.nodes[id];
  if (n.parent == null) conv.active = ids[j];
  else conv.nodes[n.parent].active = ids[j];
  return true;
}

/** Edit of a past user message: a new user message beside it, with the new text (the old
 * branch stays reachable). Returns the new message; the caller generates its answer. */
export function editUserMessage(conv, id, text) {
  const old = conv.nodes[id];
  if (!old || old.role !== 'user') throw new Error('only user messages can be edited');
  return addMessage(conv, old.parent, { role: 'user', content: text });
}

/** Regenerate: the message a new answer to `assistantId` should hang under (its parent). */
export function regenerateParent(conv, assistantId) {
  const a = conv.nodes[assistantId];
  if (!a || a.role !== 'assistant') throw new Error('only answers can be regenerated');
  return a.parent;
}

export function nextSeq(conv) {
  let m = 0;
  for (const n of Object.values(conv.nodes)) m = Math.max(m, n.seq ?? 0);
  return m + 1;
}

/** The API `messages` for a request whose prompt ends at `lastId` (inclusive). */
export function apiMessages(conv, lastId) {
  const out = [];
  const sys = conv.settings?.system?.trim();
  if (sys) out.push({ role: 'system', content: conv.settings.system });
  for (const n of pathTo(conv, lastId)) {
    if (n.role === 'user') out.push({ role: 'user', content: n.content });
    else if (n.role === 'assistant') {
      const m = { role: 'assistant', content: n.content || '' };
      if (n.reasoning) m.reasoning_content = n.reasoning;
      if (n.toolCalls?.length) {
        m.tool_calls = n.toolCalls.map((t) => ({
          id: t.id,
          type: 'function',
          function: { name: t.name, arguments: t.arguments || '{}' },
        }));
      }
      out.push(m);
    } else if (n.role === 'tool') {
      out.push({ role: 'tool', tool_call_id: n.toolCallId, content: n.content });
    }
  }
  return out;
}

/** Deletes a message and everything below it. */
export function deleteBranch(conv, id) {
  const n = conv.nodes[id];
  if (!n) return;
  const sibs = siblingInfo(conv, id).ids.filter((s) => s !== id);
  const drop = (x) => {
    for (const c of children(conv, x)) drop(c.id);
    delete conv.nodes[x];
  };
  drop(id);
  const next = sibs.length ? sibs[sibs.length - 1] : null;
  if (n.parent == null) conv.active = conv.active === id ? next : conv.active;
  else if (conv.nodes[n.parent].active === id) conv.nodes[n.parent].active = next;
}

// ---- persistence ----------------------------------------------------------------------

/** A store of conversations over a Storage-like object (`getItem`, `setItem`, `removeItem`). */
export function createStore(storage) {
  const indexKey = `${PREFIX}index`;
  const readIndex = () => {
    try {
      const v = JSON.parse(storage.getItem(indexKey) || '[]');
      return Array.isArray(v) ? v : [];
    } catch {
      return [];
    }
  };
  const writeIndex = (ix) => storage.setItem(indexKey, JSON.stringify(ix));
  return {
    /** `[{id, title, updated}]`, most recent first. */
    list() {
      return readIndex().sort((a, b) => b.updated - a.updated);
    },
    load(id) {
      try {
        const c = JSON.parse(storage.getItem(`${PREFIX}conv.${id}`));
        return c && c.id === id ? c : null;
      } catch {
        return null;
      }
    },
    save(conv) {
      storage.setItem(`${PREFIX}conv.${conv.id}`, JSON.stringify(conv));
      const ix = readIndex().filter((e) => e.id !== conv.id);
      ix.push({ id: conv.id, title: conv.title, updated: conv.updated });
      writeIndex(ix);
    },
    rename(id, title) {
      const c = this.load(id);
      if (!c) return null;
      c.title = String(title).trim() || c.title;
      c.titled = true;
      this.save(c);
      return c;
    },
    remove(id) {
      storage.removeItem(`${PREFIX}conv.${id}`);
      writeIndex(readIndex().filter((e) => e.id !== id));
    },
    exportAll() {
      return exportJson(this.list().map((e) => this.load(e.id)).filter(Boolean));
    },
    /** Imports an export; a conversation whose id is taken gets a new id. Returns the count. */
    importJson(text) {
      const convs = parseImport(text);
      const taken = new Set(readIndex().map((e) => e.id));
      for (const c of convs) {
        if (taken.has(c.id)) c.id = newId('c');
        taken.add(c.id);
        this.save(c);
      }
      return convs.length;
    },
  };
}

export function exportJson(convs) {
  return JSON.stringify({ format: FORMAT, version: VERSION, exported: new Date().toISOString(), conversations: convs }, null, 1);
}

/** Validates an export and returns its conversations (throws a readable Error if it is not one). */
export function parseImport(text) {
  let v;
  try {
    v = JSON.parse(text);
  } catch (e) {
    throw new Error(`not JSON: ${e.message}`);
  }
  if (!v || v.format !== FORMAT || !Array.isArray(v.conversations)) {
    throw new Error(`not a ${FORMAT} export (expected {"format": "${FORMAT}", "conversations": [...]})`);
  }
  if (v.version > VERSION) throw new Error(`export version ${v.version} is newer than this page (${VERSION})`);
  return v.conversations.map((c, i) => {
    if (!c || typeof c.id !== 'string' || typeof c.nodes !== 'object' || c.nodes === null) {
      throw new Error(`conversations[${i}] is not a conversation`);
    }
    for (const [k, n] of Object.entries(c.nodes)) {
      if (!n || n.id !== k || !['user', 'assistant', 'tool'].includes(n.role)) {
        throw new Error(`conversations[${i}].nodes.${k} is not a message`);
      }
      if (n.parent != null && !c.nodes[n.parent]) throw new Error(`conversations[${i}].nodes.${k} has a missing parent`);
    }
    return {
      ...newConversation(c.created || Date.now()),
      ...c,
      settings: { ...DEFAULT_SETTINGS, ...(c.settings || {}) },
      title: String(c.title || 'Imported chat'),
    };
  });
}
