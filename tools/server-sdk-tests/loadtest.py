"""Loopback load test (stdlib only): N requests from C concurrent clients against a running
ds4-server; every answer must be a 200 with the expected forced text. Prints p50/p99
latency and the server's RSS before and after (pass its pid): the RSS is read after a
warm-up round of 2·C requests (slot states, snapshot and staging buffers reach their
steady size there) and after the N measured requests, and may grow by at most
RSS_GROWTH_KIB (default 4096) or 5 %, whichever is larger: a per-request leak fails.

With `stream` (the variant for a `--parallel` server): every request streams, prompts and
forced answers have mixed lengths, and every fourth client hangs up after three chunks;
every other stream must reassemble to exactly its answer (no lost, repeated or foreign
tokens).

usage: loadtest.py URL SERVER_PID [N=200] [C=16] [stream]
"""

import http.client
import json
import os
import statistics
import sys
import threading
import time
import urllib.parse

ANSWERS = {
    "[plain]": "The answer is 42.",
    "[count]": "one two three four five six seven eight nine ten eleven twelve thirteen "
               "fourteen fifteen sixteen seventeen eighteen nineteen twenty.",
}


def stream_request(conn, i):
    """One streaming request; returns None when it hung up on purpose, else raises on a
    wrong answer."""
    marker = "[count]" if i % 2 else "[plain]"
    filler = "lorem ipsum " * (i % 7 * 10)
    body = json.dumps({"model": "deepseek-v4-flash", "think": False, "stream": True,
                       "messages": [{"role": "user", "content": f"{filler}{marker} request {i}"}]})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{r.status} {r.read()[:200]!r}")
    text, chunks, done = "", 0, False
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        v = json.loads(data)
        if "error" in v:
            raise RuntimeError(f"stream error {v}")
        chunks += 1
        if i % 4 == 3 and chunks == 3:
            return None
        text += v["choices"][0]["delta"].get("content") or ""
    if not done or text != ANSWERS[marker]:
        raise RuntimeError(f"answer {text!r} (complete: {done})")
    return text


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def main():
    url, pid = sys.argv[1], int(sys.argv[2])
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    c = int(sys.argv[4]) if len(sys.argv) > 4 else 16
    stream = len(sys.argv) > 5 and sys.argv[5] == "stream"
    u = urllib.parse.urlparse(url)
    lat, errors, lock = [], [], threading.Lock()
    todo = []

    def client():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            body = json.dumps({"model": "deepseek-v4-flash", "think": False,
                               "messages": [{"role": "user", "content": f"[plain] request {i}"}]})
            t0 = time.perf_counter()
            try:
                conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
                if stream:
                    stream_request(conn, i)
                    conn.close()
                    with lock:
                        lat.append(time.perf_counter() - t0)
                    continue
                conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
                r = conn.getresponse()
                data = r.read()
                conn.close()
                ok = r.status == 200 and json.loads(data)["choices"][0]["message"]["content"] == "The answer is 42."
                if not ok:
                    raise RuntimeError(f"{r.status} {data[:200]!r}")
            except Exception as e:  # noqa: BLE001
                with lock:
                    errors.append(f"request {i}: {e}")
                continue
            with lock:
                lat.append(time.perf_counter() - t0)

    def round_of(ids):
        todo.extend(ids)
        threads = [threading.Thread(target=client) for _ in range(c)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # Warm-up: the same mix of requests (ids past the measured ones), not counted.
    round_of(range(n, n + 2 * c))
    warm_errors = list(errors)
    errors.clear()
    lat.clear()
    before = rss_kib(pid)
    t0 = time.perf_counter()
    round_of(range(n))
    wall = time.perf_counter() - t0
    after = rss_kib(pid)
    allowed = max(int(os.environ.get("RSS_GROWTH_KIB", "4096")), before // 20)
    grew = after - before > allowed
    lat.sort()
    p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000 if lat else float("nan")  # noqa: E731
    print(f"{'streaming ' if stream else ''}requests={n} clients={c} ok={len(lat)} errors={len(errors)} wall_s={wall:.2f} "
          f"p50_ms={p(0.50):.1f} p99_ms={p(0.99):.1f} mean_ms={statistics.fmean(lat) * 1000 if lat else 0:.1f} "
          f"rss_before_kib={before} rss_after_kib={after} rss_growth_allowed_kib={allowed}")
    for e in (warm_errors + errors)[:10]:
        print("  ", e)
    if grew:
        print(f"   server memory grew by {after - before} KiB over {n} requests (allowed {allowed})")
    sys.exit(1 if warm_errors or errors or len(lat) != n or grew or before < 0 else 0)


if __name__ == "__main__":
    main()
