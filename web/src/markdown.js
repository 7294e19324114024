// Markdown → HTML for answers: marked (GFM), highlight.js for fenced code, KaTeX for
// `$…$`, `$$…$$`, `\(…\)` and `\[…\]`. Raw HTML in the text is shown as text (escaped), link
// targets other than http(s)/mailto are dropped, and KaTeX writes MathML only (no inline
// `style` attributes, so the page's Content-Security-Policy needs no 'unsafe-inline').

import { Marked } from 'marked';
import hljs from 'highlight.js/lib/core';
import bash from 'highlight.js/lib/languages/bash';
import c from 'highlight.js/lib/languages/c';
import cpp from 'highlight.js/lib/languages/cpp';
import css from 'highlight.js/lib/languages/css';
import diff from 'highlight.js/lib/languages/diff';
import go from 'highlight.js/lib/languages/go';
import java from 'highlight.js/lib/languages/java';
import javascript from 'highlight.js/lib/languages/javascript';
import json from 'highlight.js/lib/languages/json';
import markdown from 'highlight.js/lib/languages/markdown';
import python from 'highlight.js/lib/languages/python';
import rust from 'highlight.js/lib/languages/rust';
import shell from 'highlight.js/lib/languages/shell';
import sql from 'highlight.js/lib/languages/sql';
import typescript from 'highlight.js/lib/languages/typescript';
import xml from 'highlight.js/lib/languages/xml';
import yaml from 'highlight.js/lib/languages/yaml';
import katex from 'katex';

const LANGS = { bash, c, cpp, css, diff, go, java, javascript, json, markdown, python, rust, shell, sql, typescript, xml, yaml };
for (const [name, lang] of Object.entries(LANGS)) hljs.registerLanguage(name, lang);

export function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, (ch) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' })[ch]);
}

function renderMath(tex, displayMode) {
  try {
    return katex.renderToString(tex, { displayMode, output: 'mathml', throwOnError: false, strict: 'ignore', trust: false, maxExpand: 1000, maxSize: 50 });
  } catch {
    return `<code>${escapeHtml(tex)}</code>`;
  }
}

const blockMath = {
  name: 'blockMath',
  level: 'block',
  start: (src) => src.match(/\$\$|\\\[/)?.index,
  tokenizer(src) {
    const m = /^(?:\$\$([\s\S]+?)\$\$|\\\[([\s\S]+?)\\\])(?:\n|$)/.exec(src);
    if (m) return { type: 'blockMath', raw: m[0], text: (m[1] ?? m[2]).trim() };
    return undefined;
  },
  renderer: (t) => `<div class="math-block">${renderMath(t.text, true)}</div>\n`,
};

const inlineMath = {
  name: 'inlineMath',
  level: 'inline',
  start: (src) => src.match(/\$|\\\(/)?.index,
  tokenizer(src) {
    // $$…$$ inline, \(…\), or $…$ with no space just inside the dollars (so "$5 and $6"
    // stays text) and not followed by a digit.
    const m =
      /^\$\$([^$]+?)\$\$/.exec(src) ||
      /^\\\(([\s\S]+?)\\\)/.exec(src) ||
      /^\$(?![\s$])((?:\\\$|[^$\n])+?)(?<![\s\\])\$(?!\d)/.exec(src);
    if (m) return { type: 'inlineMath', raw: m[0], text: m[1], display: m[0].startsWith('$$') };
    return undefined;
  },
  renderer: (t) => renderMath(t.text, t.display),
};

function safeHref(href) {
  const h = String(href || '').trim();
  if (/^(https?:|mailto:)/i.test(h) || h.startsWith('#')) return h;
  return null;
}

const md = new Marked({ gfm: true, breaks: false });
md.use({
  extensions: [blockMath, inlineMath],
  renderer: {
    html({ text }) {
      return escapeHtml(text);
    },
    code({ text, lang }) {
      const l = String(lang || '').trim().split(/\s+/)[0].toLowerCase();
      let body;
      if (l && hljs.getLanguage(l)) body = hljs.highlight(text, { language: l, ignoreIllegals: true }).value;
      else body = escapeHtml(text);
      const label = l ? `<span class="code-lang">${escapeHtml(l)}</span>` : '';
      return `<div class="code-block"><div class="code-head">${label}<button type="button" class="copy-code" aria-label="Copy code">Copy</button></div><pre><code class="hljs${l ? ` language-${escapeHtml(l)}` : ''}">${body}</code></pre></div>\n`;
    },
    link({ href, title, tokens }) {
      const text = this.parser.parseInline(tokens);
      const h = safeHref(href);
      if (!h) return text;
      const t = title ? ` title="${escapeHtml(title)}"` : '';
      return `<a href="${escapeHtml(h)}"${t} target="_blank" rel="noopener noreferrer">${text}</a>`;
    },
    image({ href, text }) {
      // No remote fetches from a chat page: an image is shown as its link.
      const h = safeHref(href);
      return h ? `<a href="${escapeHtml(h)}" target="_blank" rel="noopener noreferrer">${escapeHtml(text || h)}</a>` : escapeHtml(text || '');
    },
  },
});

/** Markdown text → HTML (safe to put in innerHTML: see the header). */
export function renderMarkdown(text) {
  return md.parse(String(text ?? ''), { async: false });
}
