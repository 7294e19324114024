// The chat page ds4-server serves at / and /chat (Preact + htm; no build-time JSX).
// State logic lives in store.js (conversation trees), sse.js (stream parsing), api.js
// (requests, error messages) and stats.js; this file is the view and the fetch loop.

import { h, render } from 'preact';
import { useEffect, useReducer, useRef, useState } from 'preact/hooks';
import htm from 'htm';
import {
  activePath,
  addMessage,
  apiMessages,
  createStore,
  editUserMessage,
  newConversation,
  regenerateParent,
  siblingInfo,
  switchSibling,
} from './store.js';
import { applyChunk, createSSEParser, emptyAnswer } from './sse.js';
import { buildRequest, errorMessage } from './api.js';
import { computeStats, statsLine } from './stats.js';
import { renderMarkdown } from './markdown.js';
import './style.css';

const html = htm.bind(h);
const store = createStore(window.localStorage);
const KEY_ITEM = 'ds4chat.apiKey';
const THINK_LABEL = { none: 'Off', high: 'On', max: 'Max' };

// The API key lives in memory only, unless the user ticks "remember" (then localStorage).
let apiKey = window.localStorage.getItem(KEY_ITEM) || '';

function headers() {
  const hd = { 'Content-Type': 'application/json' };
  if (apiKey) hd.Authorization = `Bearer ${apiKey}`;
  return hd;
}

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    const ta = document.createElement('textarea');
    ta.value = text;
    document.body.appendChild(ta);
    ta.select();
    const ok = document.execCommand('copy');
    ta.remove();
    return ok;
  }
}

function Markdown({ text }) {
  return html`<div class="md" dangerouslySetInnerHTML=${{ __html: renderMarkdown(text) }}></div>`;
}

function CopyButton({ text, label = 'Copy' }) {
  const [done, setDone] = useState(false);
  return html`<button type="button" class="small" aria-label=${label} onClick=${async () => {
    setDone(await copyText(text));
    setTimeout(() => setDone(false), 1200);
  }}>${done ? 'Copied' : 'Copy'}</button>`;
}

function BranchSwitch({ conv, node, onSwitch, disabled }) {
  const { index, count } = siblingInfo(conv, node.id);
  if (count < 2) return null;
  return html`<span class="branch" role="group" aria-label="Versions">
    <button type="button" class="small" aria-label="Previous version" disabled=${disabled || index === 0} onClick=${() => onSwitch(node.id, -1)}>‹</button>
    <span class="branch-pos">${index + 1}/${count}</span>
    <button type="button" class="small" aria-label="Next version" disabled=${disabled || index === count - 1} onClick=${() => onSwitch(node.id, 1)}>›</button>
  </span>`;
}

function ToolCalls({ node }) {
  if (!node.toolCalls?.length) return null;
  return html`<div class="tool-calls">${node.toolCalls.map(
    (t, i) => html`<div class="tool-call" key=${i} data-testid="tool-call">
      <div class="tool-name">Tool call: <code>${t.name || '…'}</code></div>
      <pre class="tool-args">${t.arguments}</pre>
    </div>`,
  )}</div>`;
}

function ToolResultForm({ node, onSubmit }) {
  const [vals, setVals] = useState(() => node.toolCalls.map(() => ''));
  return html`<form class="tool-results" onSubmit=${(e) => {
    e.preventDefault();
    onSubmit(vals);
  }}>
    ${node.toolCalls.map(
      (t, i) => html`<label key=${i}>Result of <code>${t.name}</code>
        <textarea rows="2" value=${vals[i]} onInput=${(e) => setVals(vals.map((v, j) => (j === i ? e.target.value : v)))}></textarea>
      </label>`,
    )}
    <button type="submit">Send tool results</button>
  </form>`;
}

function Message({ conv, node, busy, streamingId, last, ui, actions }) {
  const [editing, setEditing] = useState(false);
  const [draft, setDraft] = useState(node.content);
  const streaming = node.id === streamingId;
  if (node.role === 'tool') {
    return html`<div class="msg tool" data-testid="msg-tool">
      <div class="msg-head">Tool result</div><pre class="tool-args">${node.content}</pre></div>`;
  }
  if (node.role === 'user') {
    return html`<div class="msg user" data-testid="msg-user">
      <div class="msg-head"><span class="who">You</span>
        <${BranchSwitch} conv=${conv} node=${node} onSwitch=${actions.switchSibling} disabled=${busy} />
      </div>
      ${editing
        ? html`<form class="edit" onSubmit=${(e) => {
            e.preventDefault();
            setEditing(false);
            actions.edit(node.id, draft);
          }}>
            <label class="sr-only" for=${`edit-${node.id}`}>Edit message</label>
            <textarea id=${`edit-${node.id}`} rows="3" value=${draft} onInput=${(e) => setDraft(e.target.value)}></textarea>
            <div class="row"><button type="submit">Send edited</button>
            <button type="button" onClick=${() => setEditing(false)}>Cancel</button></div>
          </form>`
        : html`<div class="text">${node.content}</div>`}
      ${!editing &&
      html`<div class="msg-actions">
        <${CopyButton} text=${node.content} label="Copy message" />
        <button type="button" class="small" disabled=${busy} onClick=${() => {
          setDraft(node.content);
          setEditing(true);
        }}>Edit</button>
      </div>`}
    </div>`;
  }
  // assistant
  const open = ui.open[node.id] ?? (streaming && !node.content && !node.toolCalls?.length);
  const stats = node.stats ? statsLine(node.stats) : '';
  const waitingTools = last && node.finish === 'tool_calls' && !streaming;
  return html`<div class="msg assistant" data-testid="msg-assistant" aria-busy=${streaming ? 'true' : 'false'}>
    <div class="msg-head"><span class="who">DeepSeek</span>
      <span class="think-tag">thinking ${THINK_LABEL[node.thinking] || node.thinking}</span>
      <${BranchSwitch} conv=${conv} node=${node} onSwitch=${actions.switchSibling} disabled=${busy} />
    </div>
    ${node.reasoning &&
    html`<details class="reasoning" open=${open} onToggle=${(e) => {
      if (e.target.open !== open) ui.setOpen(node.id, e.target.open);
    }}>
      <summary>${streaming && !node.content ? 'Thinking…' : 'Reasoning'} <span class="muted">(${node.reasoning.length} chars)</span></summary>
      <div class="reasoning-text">${node.reasoning}</div>
    </details>`}
    ${node.content ? html`<${Markdown} text=${node.content} />` : streaming && !node.reasoning ? html`<div class="muted">…</div>` : null}
    <${ToolCalls} node=${node} />
    ${node.stopped && html`<div class="note" role="status">Stopped.</div>`}
    ${node.error && html`<div class="error" role="alert" data-testid="error">${node.error}</div>`}
    ${stats && html`<div class="stats" data-testid="stats">${stats}</div>`}
    ${waitingTools && html`<${ToolResultForm} node=${node} onSubmit=${(vals) => actions.toolResults(node.id, vals)} />`}
    ${!streaming &&
    html`<div class="msg-actions">
      <${CopyButton} text=${node.content} label="Copy answer" />
      <button type="button" class="small" disabled=${busy} onClick=${() => actions.regenerate(node.id)}>Regenerate</button>
    </div>`}
  </div>`;
}

function KeyDialog({ reason, onSave, onClose }) {
  const [key, setKey] = useState('');
  const [remember, setRemember] = useState(false);
  const ref = useRef();
  useEffect(() => ref.current?.focus(), []);
  return html`<div class="overlay"><form class="dialog" role="dialog" aria-modal="true" aria-labelledby="key-title" onSubmit=${(e) => {
    e.preventDefault();
    onSave(key.trim(), remember);
  }}>
    <h2 id="key-title">API key</h2>
    ${reason && html`<p class="error">${reason}</p>`}
    <p>This server was started with <code>--api-key</code>. The key is sent as <code>Authorization: Bearer</code> and kept in this tab's memory only, unless you tick the box.</p>
    <label for="api-key">Key</label>
    <input id="api-key" ref=${ref} type="password" autocomplete="off" value=${key} onInput=${(e) => setKey(e.target.value)} />
    <label class="check"><input type="checkbox" checked=${remember} onChange=${(e) => setRemember(e.target.checked)} /> Remember on this device (stored in localStorage)</label>
    <div class="row"><button type="submit">Use key</button><button type="button" onClick=${onClose}>Cancel</button></div>
  </form></div>`;
}

function Settings({ conv, onChange }) {
  const s = conv.settings;
  const field = (name, label, hint) => html`<label>${label}
      <input name=${name} inputmode="decimal" placeholder=${hint} value=${s[name]} onInput=${(e) => onChange(name, e.target.value)} /></label>`;
  return html`<section class="settings" aria-label="Conversation settings">
    <label>System prompt
      <textarea rows="3" value=${s.system} onInput=${(e) => onChange('system', e.target.value)}></textarea></label>
    <div class="grid">
      ${field('temperature', 'Temperature', 'server: 1')}
      ${field('top_p', 'Top p', 'server: 1')}
      ${field('top_k', 'Top k', 'server: 0')}
      ${field('min_p', 'Min p', 'server: 0.05')}
      ${field('max_tokens', 'Max tokens', 'server default')}
    </div>
    <p class="muted">With thinking on or max the server samples with its defaults (as DeepSeek's API does); these apply with thinking off.</p>
    <label>Tools (JSON array of OpenAI tools; optional)
      <textarea rows="3" class="mono" placeholder='[{"type":"function","function":{"name":"get_time","parameters":{"type":"object","properties":{}}}}]' value=${s.tools} onInput=${(e) => onChange('tools', e.target.value)}></textarea></label>
  </section>`;
}

function Sidebar({ list, currentId, onSelect, onNew, onRename, onDelete, onExport, onImport, open }) {
  const [renaming, setRenaming] = useState(null);
  const [name, setName] = useState('');
  const fileRef = useRef();
  return html`<nav class=${`sidebar${open ? ' open' : ''}`} aria-label="Conversations">
    <button type="button" class="new" onClick=${onNew}>+ New chat</button>
    <ul class="convs">
      ${list.map((c) => html`<li key=${c.id} class=${c.id === currentId ? 'current' : ''}>
        ${renaming === c.id
          ? html`<form onSubmit=${(e) => {
              e.preventDefault();
              onRename(c.id, name);
              setRenaming(null);
            }}><label class="sr-only" for="rename">New name</label>
            <input id="rename" value=${name} onInput=${(e) => setName(e.target.value)} onKeyDown=${(e) => e.key === 'Escape' && setRenaming(null)} />
            <button type="submit" class="small">Save</button></form>`
          : html`<button type="button" class="conv" aria-current=${c.id === currentId ? 'page' : undefined} onClick=${() => onSelect(c.id)}>${c.title}</button>
            <span class="conv-actions">
              <button type="button" class="small" aria-label=${`Rename ${c.title}`} onClick=${() => {
                setName(c.title);
                setRenaming(c.id);
              }}>✎</button>
              <button type="button" class="small" aria-label=${`Delete ${c.title}`} onClick=${() => onDelete(c.id)}>×</button>
            </span>`}
      </li>`)}
    </ul>
    <div class="io">
      <button type="button" onClick=${onExport}>Export JSON</button>
      <button type="button" onClick=${() => fileRef.current.click()}>Import JSON</button>
      <a class="tiny" href="/assets/third-party-licenses.txt" target="_blank" rel="noopener">Licences</a>
      <input ref=${fileRef} type="file" accept="application/json,.json" class="hidden" aria-label="Import file" onChange=${async (e) => {
        const f = e.target.files[0];
        if (f) onImport(await f.text());
        e.target.value = '';
      }} />
    </div>
  </nav>`;
}

function App() {
  const [, bump] = useReducer((x) => x + 1, 0);
  const convRef = useRef(null);
  if (!convRef.current) {
    const first = store.list()[0];
    convRef.current = (first && store.load(first.id)) || newConversation();
  }
  const conv = convRef.current;
  const [list, setList] = useState(() => store.list());
  const [input, setInput] = useState('');
  const [thinking, setThinking] = useState('high');
  const [showSettings, setShowSettings] = useState(false);
  const [sidebar, setSidebar] = useState(false);
  const [keyDialog, setKeyDialog] = useState(null);
  const [ctx, setCtx] = useState(null);
  const [notice, setNotice] = useState('');
  const [open, setOpenMap] = useState({});
  const stream = useRef(null); // {id, controller}
  const frame = useRef(0);
  const listRef = useRef();
  const stick = useRef(true);
  const busy = !!stream.current;

  const ui = { open, setOpen: (id, v) => setOpenMap((m) => ({ ...m, [id]: v })) };
  const redraw = () => {
    if (frame.current) return;
    frame.current = requestAnimationFrame(() => {
      frame.current = 0;
      bump();
    });
  };
  const persist = (c = convRef.current) => {
    try {
      if (Object.keys(c.nodes).length) store.save(c);
    } catch (e) {
      // localStorage full (about 5 MB per site): the conversation stays in this tab.
      setNotice(`Could not save the conversation in this browser (${e.name}): export or delete old conversations.`);
    }
    setList(store.list());
  };

  const loadModel = async () => {
    try {
      const r = await fetch('/v1/models', { headers: headers() });
      if (r.status === 401) {
        setKeyDialog(errorMessage(401, await r.text()));
        return;
      }
      if (r.ok) {
        const j = await r.json();
        setCtx(j?.data?.[0]?.context_length ?? null);
      }
    } catch (e) {
      setNotice(`Cannot reach the server: ${e.message}`);
    }
  };
  useEffect(() => {
    loadModel();
  }, []);

  useEffect(() => {
    const onKey = (e) => {
      if (e.key !== 'Escape') return;
      if (stream.current) {
        e.preventDefault();
        stop();
      } else {
        setSidebar(false);
      }
    };
    window.addEventListener('keydown', onKey);
    return () => window.removeEventListener('keydown', onKey);
  }, []);

  // Follow the answer as it streams, unless the reader scrolled up.
  useEffect(() => {
    const el = listRef.current;
    if (el && stick.current) el.scrollTop = el.scrollHeight;
  });

  // Copy buttons inside rendered Markdown (no inline handlers: the CSP forbids them).
  const onMdClick = (e) => {
    const b = e.target.closest?.('.copy-code');
    if (!b) return;
    const code = b.closest('.code-block')?.querySelector('code');
    if (code) {
      copyText(code.textContent).then((ok) => {
        b.textContent = ok ? 'Copied' : 'Copy failed';
        setTimeout(() => (b.textContent = 'Copy'), 1200);
      });
    }
  };

  function stop() {
    stream.current?.controller.abort();
  }

  async function generate(c, parentId, mode) {
    let body;
    const node = addMessage(c, parentId, { role: 'assistant', content: '', reasoning: '', toolCalls: [], thinking: mode });
    try {
      body = buildRequest({ messages: apiMessages(c, parentId), settings: c.settings, thinking: mode });
    } catch (e) {
      node.error = e.message;
      persist(c);
      bump();
      return;
    }
    stick.current = true;
    const controller = new AbortController();
    stream.current = { id: node.id, controller };
    persist(c);
    bump();
    const acc = emptyAnswer();
    const tStart = performance.now();
    let tFirst = null;
    try {
      const r = await fetch('/v1/chat/completions', { method: 'POST', headers: headers(), body: JSON.stringify(body), signal: controller.signal });
      if (!r.ok) {
        const text = await r.text();
        node.error = errorMessage(r.status, text, { 'retry-after': r.headers.get('retry-after') });
        if (r.status === 401) setKeyDialog(node.error);
      } else {
        const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
        const feed = createSSEParser((ev) => {
          applyChunk(acc, ev.data);
          if (tFirst == null && (acc.content || acc.reasoning || acc.toolCalls.length)) tFirst = performance.now();
          Object.assign(node, { content: acc.content, reasoning: acc.reasoning, toolCalls: acc.toolCalls.map((t) => ({ ...t })), finish: acc.finish });
          if (acc.error) node.error = `The server reported an error: ${acc.error}`;
          redraw();
        });
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          feed(value);
        }
        feed.end();
        if (!acc.done && !acc.error) node.error = 'The stream ended early (the server closed the connection).';
        node.stats = computeStats({ usage: acc.usage, tStart, tFirst, tEnd: performance.now(), ctx });
      }
    } catch (e) {
      if (e.name === 'AbortError') node.stopped = true;
      else node.error = `Network error: ${e.message}`;
    } finally {
      stream.current = null;
      persist(c);
      bump();
    }
  }

  const actions = {
    switchSibling(id, d) {
      if (switchSibling(conv, id, d)) {
        persist();
        bump();
      }
    },
    edit(id, text) {
      if (busy || !text.trim()) return;
      const u = editUserMessage(conv, id, text);
      generate(conv, u.id, thinking);
    },
    regenerate(id) {
      if (busy) return;
      // Another version of the same answer: the same thinking mode.
      generate(conv, regenerateParent(conv, id), conv.nodes[id].thinking || thinking);
    },
    toolResults(id, vals) {
      if (busy) return;
      let parent = id;
      conv.nodes[id].toolCalls.forEach((t, i) => {
        parent = addMessage(conv, parent, { role: 'tool', toolCallId: t.id, name: t.name, content: vals[i] ?? '' }).id;
      });
      generate(conv, parent, thinking);
    },
  };

  const send = () => {
    const text = input;
    if (busy || !text.trim()) return;
    const path = activePath(conv);
    const parent = path.length ? path[path.length - 1].id : null;
    const u = addMessage(conv, parent, { role: 'user', content: text, thinking });
    setInput('');
    generate(conv, u.id, thinking);
  };

  const select = (id) => {
    if (busy) return;
    const c = store.load(id);
    if (c) {
      convRef.current = c;
      setSidebar(false);
      bump();
    }
  };

  const path = activePath(conv);
  const streamingId = stream.current?.id;

  return html`<div class="app">
    <${Sidebar} list=${list} currentId=${conv.id} open=${sidebar}
      onSelect=${select}
      onNew=${() => {
        if (busy) return;
        convRef.current = newConversation();
        setSidebar(false);
        bump();
      }}
      onRename=${(id, name) => {
        const c = store.rename(id, name);
        if (c && id === conv.id) Object.assign(conv, { title: c.title, titled: true });
        setList(store.list());
      }}
      onDelete=${(id) => {
        if (busy || !window.confirm('Delete this conversation?')) return;
        store.remove(id);
        if (id === conv.id) convRef.current = newConversation();
        setList(store.list());
        bump();
      }}
      onExport=${() => {
        persist();
        const blob = new Blob([store.exportAll()], { type: 'application/json' });
        const a = document.createElement('a');
        a.href = URL.createObjectURL(blob);
        a.download = `ds4-chats-${new Date().toISOString().slice(0, 10)}.json`;
        a.click();
        setTimeout(() => URL.revokeObjectURL(a.href), 1000);
      }}
      onImport=${(text) => {
        try {
          const n = store.importJson(text);
          setList(store.list());
          setNotice(`Imported ${n} conversation${n === 1 ? '' : 's'}.`);
        } catch (e) {
          setNotice(`Import failed: ${e.message}`);
        }
      }} />
    ${sidebar && html`<div class="backdrop" aria-hidden="true" onClick=${() => setSidebar(false)}></div>`}
    <main class="main">
      <header class="top">
        <button type="button" class="menu" aria-label="Conversations" aria-expanded=${sidebar} onClick=${() => setSidebar(!sidebar)}>☰</button>
        <h1 title=${conv.title}>${conv.title}</h1>
        <span class="muted ctx">${ctx ? `context ${ctx}` : ''}</span>
        <button type="button" aria-expanded=${showSettings} onClick=${() => setShowSettings(!showSettings)}>Settings</button>
        <button type="button" onClick=${() => setKeyDialog('')}>API key</button>
      </header>
      ${notice && html`<div class="notice" role="status">${notice} <button type="button" class="small" aria-label="Dismiss" onClick=${() => setNotice('')}>×</button></div>`}
      ${showSettings &&
      html`<${Settings} conv=${conv} onChange=${(k, v) => {
        conv.settings[k] = v;
        persist();
        bump();
      }} />`}
      <section class="messages" ref=${listRef} aria-label="Messages" aria-live="polite" aria-busy=${busy ? 'true' : 'false'} onClick=${onMdClick} onScroll=${(e) => {
        const el = e.currentTarget;
        stick.current = el.scrollHeight - el.scrollTop - el.clientHeight < 80;
      }}>
        ${path.length === 0 && html`<p class="empty muted">Ask DeepSeek V4 Flash anything. Enter sends, Shift+Enter is a new line, Esc stops.</p>`}
        ${path.map((n, i) => html`<${Message} key=${n.id} conv=${conv} node=${n} busy=${busy} streamingId=${streamingId} last=${i === path.length - 1} ui=${ui} actions=${actions} />`)}
      </section>
      <form class="composer" onSubmit=${(e) => {
        e.preventDefault();
        send();
      }}>
        <label class="sr-only" for="prompt">Message</label>
        <textarea id="prompt" rows="2" placeholder="Message (Enter sends, Shift+Enter new line)" value=${input}
          onInput=${(e) => setInput(e.target.value)}
          onKeyDown=${(e) => {
            if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
              e.preventDefault();
              send();
            }
          }}></textarea>
        <div class="composer-side">
          <label for="thinking" class="tiny">Thinking</label>
          <select id="thinking" value=${thinking} onChange=${(e) => setThinking(e.target.value)}>
            <option value="none">Off</option><option value="high">On</option><option value="max">Max</option>
          </select>
          ${busy
            ? html`<button type="button" class="stop" onClick=${stop} aria-keyshortcuts="Escape">Stop</button>`
            : html`<button type="submit" class="send" disabled=${!input.trim()}>Send</button>`}
        </div>
      </form>
    </main>
    ${keyDialog !== null &&
    html`<${KeyDialog} reason=${keyDialog} onClose=${() => setKeyDialog(null)} onSave=${(k, remember) => {
      apiKey = k;
      if (remember && k) window.localStorage.setItem(KEY_ITEM, k);
      else window.localStorage.removeItem(KEY_ITEM);
      setKeyDialog(null);
      loadModel();
    }} />`}
  </div>`;
}

render(html`<${App} />`, document.getElementById('app'));
