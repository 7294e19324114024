// Browser tests of the chat page (issue 55), run by tools/webchat-tests/run.sh: Debian's
// chromium, headless, driven by the pinned puppeteer-core (no browser download), against a
// live ds4-server on the demo model started with --api-key, --parallel 1, --queue 1,
// --max-body-bytes 200000 and a forced-output test script (the demo model's weights are
// random).
//
// Env: DS4_URL (http://127.0.0.1:PORT), DS4_KEY (the server's key), SERVER_LOG (its log
// file), OUT_DIR (screenshots and the page's console log go there), CHROMIUM (the browser,
// default /usr/bin/chromium).
// Each step saves OUT_DIR/NN-name.png; a failing step saves OUT_DIR/failed.png and exits 1.

import { mkdirSync, readFileSync, readdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import puppeteer from 'puppeteer-core';

const URL = process.env.DS4_URL;
const KEY = process.env.DS4_KEY;
const OUT = process.env.OUT_DIR || 'webchat-out';
const LOG = process.env.SERVER_LOG;
if (!URL || !KEY || !LOG) throw new Error('DS4_URL, DS4_KEY and SERVER_LOG are required');
mkdirSync(OUT, { recursive: true });

const browser = await puppeteer.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', '--no-first-run', '--font-render-hinting=none'],
});
const consoleLines = [];
let shot = 0;
let current = null;
const results = [];

async function newPage(name, width = 1100, height = 820) {
  const p = await browser.newPage();
  await p.setViewport({ width, height });
  p.on('console', (m) => consoleLines.push(`[${name}] ${m.type()}: ${m.text()}`));
  p.on('pageerror', (e) => consoleLines.push(`[${name}] pageerror: ${e.message}`));
  return p;
}

async function snap(p, name) {
  shot += 1;
  const f = join(OUT, `${String(shot).padStart(2, '0')}-${name}.png`);
  await p.screenshot({ path: f });
  return f;
}

async function step(name, fn) {
  const t0 = Date.now();
  try {
    await fn();
    results.push(`ok   ${name} (${Date.now() - t0} ms)`);
    console.log(`ok   ${name}`);
  } catch (e) {
    results.push(`FAIL ${name}: ${e.stack || e}`);
    console.log(`FAIL ${name}: ${e.stack || e}`);
    if (current) await current.screenshot({ path: join(OUT, 'failed.png') }).catch(() => {});
    throw e;
  }
}

function assert(cond, msg) {
  if (!cond) throw new Error(`assertion failed: ${msg}`);
}

const timeout = 60_000;
const count = (p, sel) => p.$$eval(sel, (els) => els.length);
const text = (p, sel) => p.$eval(sel, (el) => el.textContent);
const lastAssistant = '[data-testid="msg-assistant"]:last-of-type';

async function typeAndSend(p, msg) {
  await p.focus('#prompt');
  await p.keyboard.type(msg);
  await p.keyboard.press('Enter');
}

/** Waits until no answer streams (the Send button is back) and `n` answers are shown. */
async function answered(p, n) {
  await p.waitForFunction(
    (n) => document.querySelectorAll('[data-testid="msg-assistant"]').length === n && !document.querySelector('.composer .stop'),
    { timeout },
    n,
  );
}

async function enterKey(p, key) {
  await p.waitForSelector('#api-key', { timeout });
  await p.$eval('#api-key', (el) => (el.value = ''));
  await p.type('#api-key', key);
  await p.click('.dialog button[type="submit"]');
}

/** The server log's lines after character `from`. */
function logLines(from = 0) {
  return readFileSync(LOG, 'utf8').slice(from).split('\n');
}
const logSize = () => readFileSync(LOG, 'utf8').length;

async function health(p) {
  return p.evaluate(async (key) => (await fetch('/health', { headers: { Authorization: `Bearer ${key}` } })).json(), KEY);
}

let exitCode = 0;
try {
  const a = await newPage('tab1');
  current = a;
  const sent = [];
  a.on('request', (r) => {
    if (r.url().endsWith('/v1/chat/completions')) sent.push(JSON.parse(r.postData()));
  });

  await step('the page loads under its CSP and asks for the key (the server has --api-key)', async () => {
    const resp = await a.goto(`${URL}/`, { waitUntil: 'networkidle0' });
    assert(resp.status() === 200, `status ${resp.status()}`);
    assert(resp.headers()['content-security-policy']?.includes("script-src 'self'"), 'CSP header');
    await a.waitForSelector('.dialog #api-key', { timeout });
    assert((await text(a, '.dialog')).includes('401'), 'the dialog says why');
    await snap(a, 'key-dialog');
  });

  await step('a wrong key: the answer is a 401 message, not a blank page', async () => {
    await enterKey(a, 'wrong-key');
    await a.waitForSelector('.dialog #api-key', { timeout }); // /v1/models said 401 again
    await a.click('.dialog button[type="button"]'); // Cancel
    // Shift+Enter is a new line, not a send.
    await a.focus('#prompt');
    await a.keyboard.type('one');
    await a.keyboard.down('Shift');
    await a.keyboard.press('Enter');
    await a.keyboard.up('Shift');
    await a.keyboard.type('two');
    assert((await a.$eval('#prompt', (el) => el.value)) === 'one\ntwo', 'Shift+Enter inserts a new line');
    assert((await count(a, '[data-testid="msg-user"]')) === 0, 'nothing sent');
    await a.$eval('#prompt', (el) => {
      el.value = '';
      el.dispatchEvent(new Event('input', { bubbles: true }));
    });
    await typeAndSend(a, 'Hello?');
    await a.waitForSelector('[data-testid="error"]', { timeout });
    const err = await text(a, '[data-testid="error"]');
    assert(err.startsWith('401'), err);
    await a.waitForSelector('.dialog #api-key', { timeout });
    await snap(a, 'error-401');
    await enterKey(a, KEY);
    await a.waitForFunction(() => !document.querySelector('.dialog'), { timeout });
    await a.waitForFunction(() => /context \d+/.test(document.querySelector('.top .ctx').textContent), { timeout });
  });

  await step('turn 1 streams reasoning (open while it streams), then Markdown with code and maths; the reasoning collapses', async () => {
    await a.click('button.new');
    let sawOpen = false;
    await typeAndSend(a, 'Write a Python square function, and integrate x² from 0 to 1.');
    const t0 = Date.now();
    while (Date.now() - t0 < timeout) {
      const st = await a.evaluate(() => ({
        open: !!document.querySelector('details.reasoning[open]'),
        streaming: !!document.querySelector('.composer .stop'),
      }));
      if (st.open && st.streaming) {
        sawOpen = true;
        await snap(a, 'reasoning-streaming');
        break;
      }
      if (!st.streaming && (await count(a, '[data-testid="msg-assistant"]')) === 1) break;
      await new Promise((r) => setTimeout(r, 30));
    }
    await answered(a, 1);
    assert(sawOpen, 'the reasoning block was open while the reasoning streamed');
    assert((await count(a, 'details.reasoning')) === 1, 'a reasoning block');
    assert((await count(a, 'details.reasoning[open]')) === 0, 'collapsed once the answer came');
    assert((await count(a, `${lastAssistant} pre code.hljs.language-python .hljs-keyword`)) > 0, 'highlighted code');
    assert((await count(a, `${lastAssistant} math`)) >= 2, 'KaTeX maths (MathML)');
    assert((await count(a, `${lastAssistant} table`)) === 1, 'a table');
    const stats = await text(a, '[data-testid="stats"]');
    assert(/prompt \d+ \(\d+ reused, \d+ new\)/.test(stats) && /context \d+ \/ \d+/.test(stats), stats);
    assert(sent.at(-1).reasoning_effort === 'high' && sent.at(-1).stream === true, JSON.stringify(sent.at(-1)));
    await snap(a, 'turn-1');
  });

  await step('the reasoning opens and closes on click', async () => {
    await a.click('details.reasoning summary');
    assert((await count(a, 'details.reasoning[open]')) === 1, 'opened');
    await snap(a, 'reasoning-open');
    await a.click('details.reasoning summary');
    assert((await count(a, 'details.reasoning[open]')) === 0, 'closed');
  });

  await step('turn 2 with thinking off reuses the cached prefix; both turns are shown', async () => {
    await a.select('#thinking', 'none');
    await typeAndSend(a, 'Thanks! And 6 × 7?');
    await answered(a, 2);
    assert(sent.at(-1).reasoning_effort === 'none', 'thinking off sent as reasoning_effort none');
    assert(sent.at(-1).messages.length === 3, `the whole conversation is sent: ${sent.at(-1).messages.length}`);
    assert((await count(a, '[data-testid="msg-user"]')) === 2, 'two questions');
    const stats = await a.$$eval('[data-testid="stats"]', (els) => els.map((e) => e.textContent));
    const reused = Number(/\((\d+) reused/.exec(stats[1])[1]);
    assert(reused > 0, `turn 2 reused tokens: ${stats[1]}`);
    assert((await text(a, `${lastAssistant} .think-tag`)).includes('Off'), 'the answer shows its thinking mode');
    await a.select('#thinking', 'high');
    await snap(a, 'two-turns');
    // The README's picture (docs/webchat.png is a copy of it).
    await a.setViewport({ width: 1100, height: 1040 });
    await a.screenshot({ path: join(OUT, 'readme-webchat.png') });
    await a.setViewport({ width: 1100, height: 820 });
  });

  await step('copy buttons copy the code and the answer', async () => {
    const ctx = browser.defaultBrowserContext();
    await ctx.overridePermissions(URL, ['clipboard-read', 'clipboard-write', 'clipboard-sanitized-write']);
    await a.click('[data-testid="msg-assistant"] .copy-code');
    await a.waitForFunction(() => document.querySelector('.copy-code').textContent !== 'Copy', { timeout: 5000 });
    const clip = await a.evaluate(() => navigator.clipboard.readText());
    assert(clip.includes('def square(x):'), `clipboard: ${clip}`);
  });

  await step('regenerate adds a second version; the switch shows either', async () => {
    const before = await text(a, `${lastAssistant} .md`);
    const buttons = await a.$$(`${lastAssistant} .msg-actions button`);
    const regen = await (async () => {
      for (const b of buttons) if ((await b.evaluate((e) => e.textContent)) === 'Regenerate') return b;
      return null;
    })();
    assert(regen, 'a Regenerate button');
    await regen.click();
    await answered(a, 2);
    await a.waitForFunction(() => document.querySelector('[data-testid="msg-assistant"]:last-of-type .branch-pos')?.textContent === '2/2', { timeout });
    assert((await text(a, `${lastAssistant} .md`)) === before, 'scripted: the same text again');
    await snap(a, 'regenerated');
    await a.click(`${lastAssistant} button[aria-label="Previous version"]`);
    await a.waitForFunction(() => document.querySelector('[data-testid="msg-assistant"]:last-of-type .branch-pos')?.textContent === '1/2', { timeout });
    await a.click(`${lastAssistant} button[aria-label="Next version"]`);
  });

  await step('editing the first question branches there and answers the edited text', async () => {
    const firstUser = '[data-testid="msg-user"]';
    const edit = await a.$$(`${firstUser} .msg-actions button`);
    await edit[1].click(); // Copy, Edit
    await a.waitForSelector(`${firstUser} textarea`, { timeout });
    await a.$eval(`${firstUser} textarea`, (el) => {
      el.value = '';
    });
    await a.type(`${firstUser} textarea`, '[plain] the edited first question');
    await a.click(`${firstUser} button[type="submit"]`);
    await answered(a, 1);
    assert((await count(a, '[data-testid="msg-user"]')) === 1, 'the later turns are on the old branch');
    assert((await text(a, '[data-testid="msg-user"] .text')) === '[plain] the edited first question', 'edited text shown');
    assert((await text(a, '[data-testid="msg-user"] .branch-pos')) === '2/2', 'two versions of the question');
    assert((await text(a, `${lastAssistant} .md`)).includes('42'), 'answered');
    await snap(a, 'edited');
    await a.click('[data-testid="msg-user"] button[aria-label="Previous version"]');
    await a.waitForFunction(() => document.querySelectorAll('[data-testid="msg-user"]').length === 2, { timeout });
    await a.click('[data-testid="msg-user"] button[aria-label="Next version"]');
    await a.waitForFunction(() => document.querySelectorAll('[data-testid="msg-user"]').length === 1, { timeout });
  });

  await step('Esc stops a long answer; the server cancels the generation (its log and /health say so)', async () => {
    const h0 = await health(a);
    const logBefore = logSize();
    await typeAndSend(a, 'tell me a very long story');
    await a.waitForFunction(() => (document.querySelector('[data-testid="msg-assistant"]:last-of-type .reasoning-text')?.textContent.length ?? 0) > 20, { timeout });
    await a.keyboard.press('Escape');
    await a.waitForFunction(() => !document.querySelector('.composer .stop'), { timeout });
    assert((await text(a, `${lastAssistant} .note`)) === 'Stopped.', 'marked stopped');
    let h1;
    const t0 = Date.now();
    do {
      h1 = await health(a);
      if (h1.stats.cancelled > h0.stats.cancelled && h1.stats.running === 0) break;
      await new Promise((r) => setTimeout(r, 100));
    } while (Date.now() - t0 < timeout);
    assert(h1.stats.cancelled === h0.stats.cancelled + 1, `cancelled ${h0.stats.cancelled} → ${h1.stats.cancelled}`);
    // The counter moves just before the worker logs the request's end.
    let done = [];
    for (const t1 = Date.now(); Date.now() - t1 < timeout; await new Promise((r) => setTimeout(r, 100))) {
      done = logLines(logBefore).filter((l) => l.includes('request done'));
      if (done.length) break;
    }
    assert(done.length === 1, `one request done line: ${done.join('\n')}`);
    const cancelled = logLines(logBefore).filter((l) => l.includes('client closed the stream: generation cancelled'));
    assert(cancelled.length === 1, `the log says the generation was cancelled:\n${logLines(logBefore).join('\n')}`);
    assert(done[0].includes('finish="error"'), `the log shows the generation ended early: ${done[0]}`);
    const gen = Number(/generated=(\d+)/.exec(done[0])[1]);
    assert(gen > 0 && gen < 8192, `stopped after ${gen} tokens`);
    writeFileSync(join(OUT, 'cancel-log.txt'), `${cancelled[0]}\n${done[0]}\n/health stats.cancelled ${h0.stats.cancelled} -> ${h1.stats.cancelled}\n`);
    await snap(a, 'stopped');
  });

  await step('tool calls are shown as they stream, and a result continues the answer', async () => {
    await a.click('button.new');
    await a.click('.top ::-p-text(Settings)');
    await a.waitForSelector('.settings', { timeout });
    const tools = JSON.stringify([{ type: 'function', function: { name: 'bash', description: 'run a command', parameters: { type: 'object', properties: { command: { type: 'string' } }, required: ['command'] } } }]);
    await a.$eval('.settings textarea.mono', (el, v) => {
      el.value = v;
      el.dispatchEvent(new Event('input', { bubbles: true }));
    }, tools);
    await a.click('.top ::-p-text(Settings)');
    await typeAndSend(a, '[tool] what is here?');
    await answered(a, 1);
    assert((await text(a, '[data-testid="tool-call"] .tool-name')).includes('bash'), 'tool name');
    assert((await text(a, '[data-testid="tool-call"] .tool-args')).includes('ls -la'), 'tool arguments');
    assert(sent.at(-1).tools?.[0]?.function?.name === 'bash', 'tools sent');
    await snap(a, 'tool-call');
    await a.type('.tool-results textarea', 'a.txt b.txt');
    await a.click('.tool-results button[type="submit"]');
    await a.waitForSelector('[data-testid="msg-tool"]', { timeout });
    // The continuation is the demo model's own text: stop it once it streams.
    await a.waitForFunction(() => document.querySelectorAll('[data-testid="msg-assistant"]').length === 2, { timeout });
    const last = sent.at(-1).messages.at(-1);
    assert(last.role === 'tool' && last.content === 'a.txt b.txt' && last.tool_call_id, JSON.stringify(last));
    await a.keyboard.press('Escape');
    await a.waitForFunction(() => !document.querySelector('.composer .stop'), { timeout });
  });

  await step('a second tab while the only slot is busy and the queue full: a 429 message', async () => {
    // --parallel 1 --queue 1: tab 1's answer takes the slot, a request from the test
    // holds the one queue place, so tab 2's request is refused with 429.
    await a.click('button.new');
    await typeAndSend(a, 'another long story please');
    await a.waitForFunction(() => (document.querySelector('[data-testid="msg-assistant"]:last-of-type .reasoning-text')?.textContent.length ?? 0) > 5, { timeout });
    const hold = new AbortController();
    const holder = fetch(`${URL}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${KEY}` },
      body: JSON.stringify({ messages: [{ role: 'user', content: 'queued' }], max_tokens: 4, stream: true }),
      signal: hold.signal,
    }).catch(() => null);
    const t0 = Date.now();
    while ((await health(a)).stats.queued < 1 && Date.now() - t0 < timeout) await new Promise((r) => setTimeout(r, 50));
    const b = await newPage('tab2');
    current = b;
    await b.goto(`${URL}/chat`, { waitUntil: 'networkidle0' });
    await enterKey(b, KEY);
    await b.waitForFunction(() => !document.querySelector('.dialog'), { timeout });
    await b.click('button.new');
    await typeAndSend(b, '[plain] me too');
    await b.waitForSelector('[data-testid="error"]', { timeout });
    const err = await text(b, '[data-testid="error"]');
    assert(err.startsWith('429'), err);
    await snap(b, 'error-429');
    await b.close();
    current = a;
    hold.abort();
    await holder;
    await a.keyboard.press('Escape');
    await a.waitForFunction(() => !document.querySelector('.composer .stop'), { timeout });
  });

  await step('a message over the server\'s body limit: a 413 message', async () => {
    await a.click('button.new');
    await a.$eval('#prompt', (el) => {
      el.value = 'x '.repeat(150_000);
      el.dispatchEvent(new Event('input', { bubbles: true }));
    });
    await a.click('.composer button[type="submit"]');
    await a.waitForSelector('[data-testid="error"]', { timeout });
    const err = await text(a, '[data-testid="error"]');
    assert(err.startsWith('413'), err);
    await a.evaluate(() => document.querySelector('.messages').scrollTo(0, 1e9));
    await snap(a, 'error-413');
  });

  await step('conversations are listed, renamed, and deleted; they survive a reload', async () => {
    const titles = () => a.$$eval('.convs .conv', (els) => els.map((e) => e.textContent));
    const before = await titles();
    assert(before.length >= 3, `listed: ${before}`);
    await a.click('.convs li:first-child button[aria-label^="Rename"]');
    await a.waitForSelector('#rename', { timeout });
    await a.$eval('#rename', (el) => (el.value = ''));
    await a.type('#rename', 'Renamed chat');
    await a.keyboard.press('Enter');
    await a.waitForFunction(() => [...document.querySelectorAll('.convs .conv')].some((e) => e.textContent === 'Renamed chat'), { timeout });
    await a.reload({ waitUntil: 'networkidle0' });
    await a.waitForSelector('.dialog #api-key', { timeout }); // the key was not stored
    await enterKey(a, KEY);
    const after = await titles();
    assert(after.includes('Renamed chat') && after.length === before.length, `after reload: ${after}`);
    const stored = await a.evaluate(() => JSON.stringify(localStorage));
    assert(!stored.includes(KEY), 'the key is not in localStorage');
    a.once('dialog', (d) => d.accept());
    await a.click('.convs li:first-child button[aria-label^="Delete"]');
    await a.waitForFunction((n) => document.querySelectorAll('.convs .conv').length === n, { timeout }, before.length - 1);
    await snap(a, 'conversations');
  });

  await step('export to JSON, then import it back: every conversation comes in again', async () => {
    const n = await count(a, '.convs .conv');
    const cdp = await a.createCDPSession();
    await cdp.send('Browser.setDownloadBehavior', { behavior: 'allow', downloadPath: OUT });
    await a.click('.io ::-p-text(Export JSON)');
    let file = null;
    for (const t0 = Date.now(); !file && Date.now() - t0 < timeout; await new Promise((r) => setTimeout(r, 100))) {
      file = readdirSync(OUT).find((f) => /^ds4-chats-.*\.json$/.test(f));
    }
    assert(file, 'the export was downloaded');
    const exported = JSON.parse(readFileSync(join(OUT, file), 'utf8'));
    assert(exported.format === 'ds4-webchat' && exported.conversations.length === n, `${exported.conversations.length} of ${n} exported`);
    const input = await a.$('.io input[type="file"]');
    await input.uploadFile(join(OUT, file));
    await a.waitForFunction((n) => document.querySelectorAll('.convs .conv').length === 2 * n, { timeout }, n);
    assert((await text(a, '.notice')).includes(`Imported ${n} conversation`), 'a notice says what came in');
    await snap(a, 'imported');
  });

  await step('phone width: the list folds into a menu and the chat stays usable', async () => {
    const p = await newPage('phone', 390, 844);
    current = p;
    await p.goto(`${URL}/`, { waitUntil: 'networkidle0' });
    await enterKey(p, KEY);
    await p.waitForFunction(() => !document.querySelector('.dialog'), { timeout });
    const menuShown = await p.$eval('.top .menu', (e) => getComputedStyle(e).display !== 'none');
    assert(menuShown, 'menu button shown');
    const overflow = await p.evaluate(() => document.documentElement.scrollWidth <= window.innerWidth);
    assert(overflow, 'no horizontal scrolling');
    await snap(p, 'phone');
    await p.click('.top .menu');
    await p.waitForSelector('.sidebar.open', { timeout });
    await new Promise((r) => setTimeout(r, 300));
    await snap(p, 'phone-menu');
    await p.mouse.click(370, 400); // the backdrop beside the list closes it
    await p.waitForFunction(() => !document.querySelector('.sidebar.open'), { timeout });
    await p.close();
    current = a;
  });

  await step('no CSP violation or script error in any tab', async () => {
    const bad = consoleLines.filter((l) => /Content Security Policy|pageerror|Uncaught/i.test(l));
    assert(bad.length === 0, bad.join('\n'));
  });
} catch {
  exitCode = 1;
} finally {
  writeFileSync(join(OUT, 'console.log'), consoleLines.join('\n') + '\n');
  writeFileSync(join(OUT, 'results.txt'), results.join('\n') + '\n');
  await browser.close();
}
console.log(exitCode ? 'WEBCHAT BROWSER TESTS FAILED' : 'WEBCHAT BROWSER TESTS PASSED');
process.exit(exitCode);
