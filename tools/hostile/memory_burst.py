#!/usr/bin/env python3
"""Peak and idle RSS of a live ds4-server under concurrent hostile bodies (issue 24 item 1).

usage: memory_burst.py SERVER_URL SERVER_PID [N_CLIENTS] [KIND]
KIND: messages (2.2 M tiny user messages, 64 MB), system (as many empty-ish system
messages, which render to almost nothing), detok (22 M ids, 64 MB).
Prints the RSS before, the peak (VmHWM is reset first where the kernel allows) and the RSS
2 s after the burst, in MiB. Standard library only.
"""
import http.client, sys, threading, time, urllib.parse

def rss(pid, field):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0

def body(kind):
    if kind == "detok":
        n = (64 << 20) // 3 - 64
        return b'{"tokens":[' + b",".join([b"65"] * n) + b"]}", "/detokenize"
    role = b"system" if kind == "system" else b"user"
    one = b'{"role":"' + role + b'","content":"x"}'
    n = (64 << 20) // (len(one) + 1) - 16
    return b'{"messages":[' + b",".join([one] * n) + b'],"max_tokens":1}', "/v1/chat/completions"

def main():
    url, pid = urllib.parse.urlparse(sys.argv[1]), int(sys.argv[2])
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    kind = sys.argv[4] if len(sys.argv) > 4 else "messages"
    data, path = body(kind)
    try:
        open(f"/proc/{pid}/clear_refs", "w").write("5")  # reset VmHWM
    except OSError:
        pass
    before = rss(pid, "VmRSS")
    statuses, peak = [], [0.0]
    stop = threading.Event()
    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss(pid, "VmRSS"))
            time.sleep(0.005)
    def client():
        c = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
        c.request("POST", path, data, {"Content-Type": "application/json"})
        statuses.append(c.getresponse().status)
    s = threading.Thread(target=sample); s.start()
    t0 = time.time()
    ts = [threading.Thread(target=client) for _ in range(n)]
    for t in ts: t.start()
    for t in ts: t.join()
    took = time.time() - t0
    time.sleep(2)
    stop.set(); s.join()
    after = rss(pid, "VmRSS")
    hwm = max(peak[0], rss(pid, "VmHWM"))
    print(f"{kind}: {n} x {len(data)/2**20:.1f} MiB bodies, statuses {sorted(set(statuses))}, {took:.1f} s")
    print(f"RSS before {before:.0f} MiB, peak {hwm:.0f} MiB, after {after:.0f} MiB")

main()
