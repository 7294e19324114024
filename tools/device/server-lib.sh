# Helpers the device scripts share for ds4-server runs (source it from the repository root).
# up: wait (at most 90 s) until the server on port 8090 answers /v1/models.
up() { for i in $(seq 1 90); do python3 -c "import urllib.request;urllib.request.urlopen('http://127.0.0.1:8090/v1/models',timeout=2)" 2>/dev/null && break; sleep 1; done; echo "ready after ${i}s"; }
# sumlog LOG N: the means of the last N "request done" lines' timing fields.
sumlog() { sed -E 's/\x1b\[[0-9;]*m//g' $1 | grep "request done" | tail -$2 | grep -oE "(prefill_ms|decode_ms|snapshot_ms|pick_us|steps_ms|total_ms)=[0-9]+" | awk -F= '{s[$1]+=$2; n[$1]++} END {for (k in s) printf "%s=%.0f ", k, s[k]/n[k]; print ""}'; }
TP=tools/server-sdk-tests/throughput.py
