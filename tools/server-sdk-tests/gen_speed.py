"""Generation speed of a running ds4-server as a user sees it (stdlib only): N non-streaming
/v1/completions requests, each a fresh prompt of WORDS words (no prefix reuse between
them) and MAX_TOKENS tokens, alternating the default sampler and temperature 0. Prints the
wall time and usage per request; the server's "request done" log lines add prefill_ms,
decode_ms (time inside the engine's decode steps) and total_ms, so (total - prefill) /
generated is the user's time per token and decode_ms / generated the engine's.

usage: gen_speed.py URL [N=4] [WORDS=1500] [MAX_TOKENS=100]
"""

import json
import sys
import time
import urllib.request


def main():
    url = sys.argv[1].rstrip("/")
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    words = int(sys.argv[3]) if len(sys.argv) > 3 else 1500
    max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 100
    text = " ".join(f"word{(j * 7) % 97}" for j in range(words))
    for k in range(n):
        body = {"model": "deepseek-v4-flash", "prompt": f"{k} {text}", "max_tokens": max_tokens}
        if k % 2 == 1:
            body["temperature"] = 0
        req = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        t0 = time.monotonic()
        r = json.loads(urllib.request.urlopen(req, timeout=600).read())
        u = r.get("usage", {})
        print(
            f"request {k} ({'T=0' if k % 2 else 'default sampler'}): wall {time.monotonic() - t0:.2f} s, "
            f"prompt {u.get('prompt_tokens')} tokens, generated {u.get('completion_tokens')}"
        )


if __name__ == "__main__":
    main()
