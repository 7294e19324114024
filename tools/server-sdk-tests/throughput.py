"""Streaming throughput of a running ds4-server (stdlib only, for machines without the
OpenAI SDK, e.g. the GPU machine with no network): C concurrent clients each stream one
chat completion of MAX_TOKENS tokens at the same moment; prints the aggregate generated
tokens per second (the server's usage counts over the wall time from the first request
to the last end) and the per-stream inter-token latency (gaps between content chunks,
p50 and p99 over all streams, the first chunk of each stream excluded).

With --long-prompt-words N [--long-after S] (issue 22's prefill interference): S seconds
(default 1) after the C streams start, one more request with an N-word prompt and one
output token arrives; prints its time to the first token (its prefill, as the running
streams see it) and the streams' largest inter-token gap while it was being served, against
their p50 gap.

With --sdk the clients are the OpenAI Python SDK's (`openai`, pinned in requirements.txt;
one client object per stream, its streaming iterator timed per chunk) instead of http.client:
the same requests and measures through the SDK users run.

By default the requests use the chat's default thinking mode, where the server applies
DeepSeek's recommended sampler (temperature 1, min-p 0.05) whatever the request says; with
--no-think they send `"thinking": false`, so their temperature 0 holds (greedy draws: a
few bytes of band per token, as a real model's peaked distributions mostly need; the
synthetic models' nearly flat logits make every min-p draw a full-row draw, docs/server.md
§9).

usage: throughput.py URL C [MAX_TOKENS=64] [PROMPT_WORDS=20] [--long-prompt-words N] [--long-after S] [--sdk] [--no-think]
"""

import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse


EXTRA = {}


def one_stream(url, i, max_tokens, words, out):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=1200)
    prompt = " ".join(f"word{(i * 7 + j) % 97}" for j in range(words))
    body = json.dumps({
        "model": "deepseek-v4-flash",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"{prompt} (stream {i})"}],
        **EXTRA,
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


def one_stream_sdk(url, i, max_tokens, words, out):
    import openai  # only with --sdk (the GPU machine's stdlib runs have no SDK)

    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused", timeout=1200)
    prompt = " ".join(f"word{(i * 7 + j) % 97}" for j in range(words))
    t0 = time.monotonic()
    stream = client.chat.completions.create(
        model="deepseek-v4-flash",
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=max_tokens,
        temperature=0,
        messages=[{"role": "user", "content": f"{prompt} (stream {i})"}],
        extra_body=EXTRA or None,
    )
    stamps, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            if c.delta.content or extra.get("reasoning_content"):
                stamps.append(time.monotonic())
    out[i] = (t0, time.monotonic(), stamps, usage)


def main():
    args = sys.argv[1:]
    stream_fn = one_stream
    if "--sdk" in args:
        args.remove("--sdk")
        stream_fn = one_stream_sdk
    if "--no-think" in args:
        args.remove("--no-think")
        EXTRA["thinking"] = False
    opts = {}
    for flag in ("--long-prompt-words", "--long-after"):
        if flag in args:
            k = args.index(flag)
            if k + 1 >= len(args):
                sys.exit(f"{flag} needs a value")
            opts[flag] = float(args[k + 1])
            del args[k:k + 2]
    if len(args) < 2:
        sys.exit(__doc__)
    url, c = args[0], int(args[1])
    max_tokens = int(args[2]) if len(args) > 2 else 64
    words = int(args[3]) if len(args) > 3 else 20
    long_words = int(opts.get("--long-prompt-words", 0))
    out = [None] * (c + 1)
    threads = [threading.Thread(target=stream_fn, args=(url, i, max_tokens, words, out))
               for i in range(c)]
    for t in threads:
        t.start()
    if long_words:
        time.sleep(opts.get("--long-after", 1.0))
        lt = threading.Thread(target=stream_fn, args=(url, c, 1, long_words, out))
        lt.start()
        lt.join()
    for t in threads:
        t.join()
    failed = sum(o is None for o in out[:c]) + (1 if long_words and out[c] is None else 0)
    if failed:
        sys.exit(f"{failed} of {c + (1 if long_words else 0)} requests failed")
    streams = out[:c]
    start = min(o[0] for o in streams)
    end = max(o[1] for o in streams)
    tokens = sum((o[3] or {}).get("completion_tokens", 0) for o in streams)
    gaps = sorted(b - a for o in streams for a, b in zip(o[2][1:], o[2][2:]))
    p = lambda q: 1000 * gaps[min(len(gaps) - 1, int(q * len(gaps)))] if gaps else float("nan")
    print(f"clients {c}: {tokens} tokens in {end - start:.2f} s · aggregate "
          f"{tokens / (end - start):.1f} tok/s · per stream {tokens / c / (end - start):.1f} tok/s"
          f" · inter-token p50 {p(0.5):.1f} ms p99 {p(0.99):.1f} ms"
          f" · mean gap {1000 * statistics.fmean(gaps) if gaps else float('nan'):.1f} ms")
    if long_words:
        t0, t1, stamps, usage = out[c]
        ttft = (stamps[0] if stamps else t1) - t0
        during = [b - a for o in streams for a, b in zip(o[2][1:], o[2][2:]) if b > t0 and a < t1]
        worst = 1000 * max(during) if during else float("nan")
        print(f"long prompt: {(usage or {}).get('prompt_tokens', '?')} tokens, first token after "
              f"{1000 * ttft:.0f} ms · streams' largest gap while it ran {worst:.1f} ms "
              f"({len(during)} gaps) against p50 {p(0.5):.1f} ms")


if __name__ == "__main__":
    main()
