#!/usr/bin/env python3
"""The same greedy request gives the same answer whatever the caches hold (docs/server.md §9
"Prefill boundaries"), through the ds4-server binary on any backend.

One prompt (a system prefix of about --system-tokens tokens, then a question) is answered
greedily with log-probabilities:
  cold        a server without a disk cache
  empty       a server with an empty disk cache (it checkpoints at the system prefix)
  disk        another conversation with the same system prompt writes that checkpoint; a new
              server resumes the prompt from it
  snapshot    a server without a disk cache answers a prompt that ends at the system prefix
              first; the prompt resumes from that turn snapshot
Every run's tokens and log-probabilities must equal the cold run's, bit for bit (the JSON
numbers as sent). Prints one line per run and exits 1 if any differs.

  cache-check.py --server ds4-server --model m.gguf --backend cuda [--mode official]

Standard library only (the GPU machines have no network).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

BOS = "<｜begin▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SENTENCES = [
    "You are a careful assistant for a small shop.",
    " Answer briefly and politely.",
    " Prices are in euros.",
    " The shop opens at nine and closes at six.",
    " Never invent stock that is not listed.",
    " Ask before you order anything.",
    " Keep a friendly tone with every customer.",
    " Say so when you do not know.",
    " Mention the opening hours when a customer asks to visit.",
    " Offer a discount only when the manager has approved it.",
]
QUESTION = (
    "Do you have green tea in stock, and what does a box of it cost today? I would also like "
    "to know whether you deliver to the next town, and how long a delivery usually takes in "
    "winter."
)


def post(url, path, body, timeout=600):
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    def __init__(self, a, extra, log):
        self.url = f"http://127.0.0.1:{a.port}"
        cmd = [a.server, "-m", a.model, "--backend", a.backend, "-c", str(a.ctx),
               "--port", str(a.port), "--prefill-chunk", str(a.prefill_chunk)]
        if a.mode:
            cmd += ["--mode", a.mode]
        self.log = open(log, "ab")
        self.p = subprocess.Popen(cmd + extra, stdout=self.log, stderr=self.log)
        for _ in range(300):
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=2)
                return
            except Exception:
                if self.p.poll() is not None:
                    sys.exit(f"ds4-server exited ({self.p.returncode}); see {log}")
                time.sleep(1)
        sys.exit(f"ds4-server did not answer in 300 s; see {log}")

    def stop(self):
        # SIGTERM: a graceful stop that saves the shutdown checkpoints.
        self.p.send_signal(signal.SIGTERM)
        self.p.wait(timeout=120)
        self.log.close()

    def complete(self, text, n):
        v = post(self.url, "/v1/completions",
                 {"prompt": text, "max_tokens": n, "temperature": 0, "logprobs": 1})
        lp = v["choices"][0]["logprobs"]
        cached = v["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        return [json.dumps(t) for t in lp["tokens"]], [json.dumps(x) for x in lp["token_logprobs"]], cached

    def count(self, text):
        return post(self.url, "/tokenize", {"content": text})["count"]

    def stats(self):
        with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
            return json.loads(r.read()).get("stats", {})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default="ds4-server")
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--mode", default="")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--port", type=int, default=8095)
    ap.add_argument("--system-tokens", type=int, default=600,
                    help="about this many tokens of system prefix (at least --kv-cache-min-tokens)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per answer")
    ap.add_argument("--log", default="cache-check.log")
    a = ap.parse_args()

    work = tempfile.mkdtemp(prefix="ds4-cache-check-")
    disk = lambda name: ["--kv-disk-dir", os.path.join(work, name)]
    for d in ("empty", "disk"):
        os.makedirs(os.path.join(work, d), mode=0o700)

    srv = Server(a, [], a.log)
    system, k = "", 0
    while srv.count(BOS + system) < a.system_tokens:
        system += SENTENCES[k % len(SENTENCES)]
        k += 1
    s = srv.count(BOS + system)
    prompt = lambda q: f"{BOS}{system}{USER}{q}{ASSISTANT}</think>"
    p = prompt(QUESTION)
    print(f"system prefix {s} tokens, prompt {srv.count(p)} tokens, {a.tokens} generated")
    runs = {"cold": srv.complete(p, a.tokens)}
    srv.stop()

    srv = Server(a, disk("empty"), a.log)
    runs["empty"] = srv.complete(p, a.tokens)
    srv.stop()

    srv = Server(a, disk("disk"), a.log)
    srv.complete(prompt("Hello, who are you?"), 2)
    srv.stop()
    srv = Server(a, disk("disk"), a.log)
    runs["disk"] = srv.complete(p, a.tokens)
    hits = srv.stats().get("disk_hits")
    srv.stop()

    srv = Server(a, [], a.log)
    srv.complete(BOS + system, 1)
    runs["snapshot"] = srv.complete(p, a.tokens)
    srv.stop()

    cold = runs["cold"]
    bad = 0
    expect = {"cold": 0, "empty": 0, "disk": s, "snapshot": s}
    for name, (toks, lps, cached) in runs.items():
        why = []
        if cached != expect[name]:
            why.append(f"reused {cached} tokens, expected {expect[name]}")
        if toks != cold[0]:
            at = next((i for i, (x, y) in enumerate(zip(toks, cold[0])) if x != y), min(len(toks), len(cold[0])))
            why.append(f"tokens differ from token {at}")
        elif lps != cold[1]:
            why.append("log-probabilities differ")
        bad += bool(why)
        print(f"{name:9} {'FAIL: ' + '; '.join(why) if why else 'identical to cold'}")
    if hits != 1:
        print(f"disk      FAIL: {hits} disk hits, expected 1")
        bad += 1
    print("CACHE INDEPENDENCE PASSED" if not bad else "CACHE INDEPENDENCE FAILED")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
