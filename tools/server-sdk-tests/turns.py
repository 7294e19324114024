"""Time to first token of chat follow-up turns (stdlib only): one conversation with a long
system prompt, then follow-up user messages of a few words, each sent with the whole history
as a client does. The server reuses the previous turn's state, so each turn prefills only the
new suffix (usually 5-20 tokens): what a short prompt chunk costs (docs/forward.md §13; to
compare with the rule off, build a server with `Engine::set_short_prefill_rows(0)`).

usage: turns.py URL [SYSTEM_WORDS=300]
"""

import http.client
import json
import sys
import time
import urllib.parse


def request(url, msgs, max_tokens):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = json.dumps({"model": "deepseek-v4-flash", "stream": True, "think": False,
                       "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
                       "temperature": 0, "messages": msgs})
    t0 = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status} {r.read()[:200]!r}")
    first, text, usage = None, "", None
    for raw in r:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        ev = json.loads(line[5:])
        if ev.get("usage"):
            usage = ev["usage"]
        for c in ev.get("choices", []):
            d = c.get("delta", {})
            if (d.get("content") or d.get("reasoning_content")) and first is None:
                first = time.monotonic() - t0
            text += d.get("content") or ""
    conn.close()
    return first, text, usage or {}


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    url = sys.argv[1]
    words = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    msgs = [{"role": "system", "content": " ".join(f"rule{i}" for i in range(words))},
            {"role": "user", "content": "hello there"}]
    _, text, _ = request(url, msgs, 4)
    msgs.append({"role": "assistant", "content": text})
    for k, q in enumerate(["and what next", "tell me more about item seven please", "ok",
                           "fine, and then what happens to the rest of the list"]):
        msgs.append({"role": "user", "content": q})
        ttft, text, u = request(url, msgs, 2)
        msgs.append({"role": "assistant", "content": text})
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        print(f"turn {k}: prompt {u.get('prompt_tokens')} tokens, {cached} reused, "
              f"{u.get('prompt_tokens', 0) - cached} new · first token after {1000 * ttft:.1f} ms")


if __name__ == "__main__":
    main()
