"""Streaming throughput of a running ds4-server (stdlib only, for machines without the
OpenAI SDK, e.g. the GPU machine with no network): C concurrent clients each stream one
chat completion of MAX_TOKENS tokens at the same moment; prints the aggregate generated
tokens per second (the server's usage counts over the wall time from the first request
to the last end) and the per-stream inter-token latency (gaps between content chunks,
p50 and p99 over all streams, the first chunk of each stream excluded).

usage: throughput.py URL C [MAX_TOKENS=64] [PROMPT_WORDS=20]
"""

import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse


def one_stream(url, i, max_tokens, words, out):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    prompt = " ".join(f"word{(i * 7 + j) % 97}" for j in range(words))
    body = json.dumps({
        "model": "deepseek-v4-flash",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"{prompt} (stream {i})"}],
    })
    t0 = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"stream {i}: HTTP {r.status} {r.read()[:200]!r}")
    stamps, usage = [], None
    for raw in r:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            usage = ev["usage"]
        for c in ev.get("choices", []):
            d = c.get("delta", {})
            if d.get("content") or d.get("reasoning_content"):
                stamps.append(time.monotonic())
    conn.close()
    out[i] = (t0, time.monotonic(), stamps, usage)


def main():
    url, c = sys.argv[1], int(sys.argv[2])
    max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    words = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    out = [None] * c
    threads = [threading.Thread(target=one_stream, args=(url, i, max_tokens, words, out))
               for i in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(o is None for o in out):
        sys.exit(f"{sum(o is None for o in out)} of {c} streams failed")
    start = min(o[0] for o in out)
    end = max(o[1] for o in out)
    tokens = sum((o[3] or {}).get("completion_tokens", 0) for o in out)
    gaps = [b - a for o in out for a, b in zip(o[2][1:], o[2][2:])]
    gaps.sort()
    p = lambda q: 1000 * gaps[min(len(gaps) - 1, int(q * len(gaps)))] if gaps else float("nan")
    print(f"clients {c}: {tokens} tokens in {end - start:.2f} s · aggregate "
          f"{tokens / (end - start):.1f} tok/s · per stream {tokens / c / (end - start):.1f} tok/s"
          f" · inter-token p50 {p(0.5):.1f} ms p99 {p(0.99):.1f} ms"
          f" · mean gap {1000 * statistics.fmean(gaps) if gaps else float('nan'):.1f} ms")


if __name__ == "__main__":
    main()
