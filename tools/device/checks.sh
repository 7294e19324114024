#!/usr/bin/env bash
# The device script: checks and measurements on a machine with an NVIDIA GPU and no Rust.
# Run it from the repository root with the stripped binaries (ds4, ds4-bench,
# ds4-engine-check, ds4-convert, ds4-server) in $BIN (default ./bin); logs go to $OUT
# (default ./out). STEPS names the steps to run, in order (default: correctness bench
# userpath); each prints a few summary lines, and a failing step does not stop the next.
#
# Build the binaries on a machine with Rust:
#   cargo build --release -p ds4-cli -p ds4-check -p ds4-convert -p ds4-server --bins
#   mkdir -p bin; for b in ds4 ds4-bench ds4-engine-check ds4-convert ds4-server; do
#       strip -o bin/$b target/release/$b; done
#
# Steps:
#   correctness  batched rows against rows alone (bit for bit, bands as defined) on a 4-layer
#                model of the real dimensions, the op mirror at 40- and 2-token chunks, the
#                tiny models' whole-model parity (ds4-engine-check batch|ops|parity)
#   logits       whole-model logits of a 4-layer real-dimension q2 file (prefill and decode
#                positions, default and --quality), written to $OUT/logits-*.npy so two
#                builds can be compared with cmp (BIN2: a second build, compared in the call)
#   bench        ds4-bench --synthetic q2 at 2k and 32k (decode and prefill, fraction of the
#                bandwidth limit)
#   profile      the bench's --profile 4 at 2k: device time by layer kind and by kernel
#   roofline     ncu of one decoded token on a 2-layer model (time and DRAM bytes per
#                kernel, tools/device/roofline.py; per-layer kernels scaled to the card's
#                layer count): bytes / time per kernel against the copy bandwidth
#   batch        the batched step at 1, 8 and 16 sequences (step ms, aggregate tok/s)
#   userpath     ds4-bench on a sparse full-size file beside the CLI's loop on it
#                (ds4-bench --e2e, greedy)
#   server       ds4-server --parallel 8 on that file: 1 client, 8 clients, 8 greedy ones
#
# Resident layers: the 43-layer model fits an H200; 36 is the limit for an 80 GB card.
set -uo pipefail
BIN=${BIN:-$PWD/bin}; OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"; export PATH=$BIN:$PATH
STEPS=${STEPS:-correctness bench userpath}
G=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); echo "GPU: $G"
L=36; echo "$G" | grep -q H200 && L=43
W=${W:-/tmp/w}; mkdir -p "$W"; V=tests/fixtures/vocab/deepseek-v4-vocab.gguf
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
TP=tools/server-sdk-tests/throughput.py
date +%T

s4() {
    [ -f "$W/s4.gguf" ] || ds4-convert synthetic --quiet --layout q2 --layers 4 --vocab-gguf $V "$W/s4.gguf" > /dev/null
}

correctness() {
    s4
    echo "== batch bit-exact + bands (4-layer real dims)"
    timeout 100 ds4-engine-check batch "$W/s4.gguf" --tiny 0 --tokens 20 --act-q8 --seqs 16 --gpu-only > "$OUT/batch.log" 2>&1
    grep -E "cuda|PASSED|FAIL|rror" "$OUT/batch.log" | cut -c1-300 | tail -4
    echo "== op mirror + parity"; date +%T
    timeout 120 ds4-engine-check ops "$W/s4.gguf" --tiny 0 --flash-layers 4 --tokens 40 --chunk 40 --act-q8 > "$OUT/ops_c40.log" 2>&1; tail -1 "$OUT/ops_c40.log"
    timeout 120 ds4-engine-check ops "$W/s4.gguf" --tiny 0 --flash-layers 4 --tokens 12 --chunk 2 --act-q8 > "$OUT/ops_c2.log" 2>&1; tail -1 "$OUT/ops_c2.log"
    for f in tiny-hca16 tiny-hca128; do ds4-convert hf --quiet tests/fixtures/$f "$W/m-$f.gguf" > /dev/null; done
    timeout 120 ds4-engine-check parity "$W"/m-*.gguf --tiny 2 > "$OUT/parity.log" 2>&1; grep -E "PASSED|FAIL|failed" "$OUT/parity.log" | head -3
}

# logits_of DIR TAG: ds4 logits of the 4-layer file from the build in DIR.
logits_of() {
    local b=$1 tag=$2 ids
    ids=$(seq -s, 1000 1300)
    for q in fast quality; do
        local e=""; [ $q = quality ] && e=DS4_QUALITY=1
        env ${e:+"$e"} timeout 100 "$b/ds4" logits -m "$W/s4.gguf" --backend cuda --tokens "$ids" \
            --decode-from 280 --out "$OUT/logits-$tag-$q.npy" > /dev/null 2> "$OUT/logits-$tag-$q.log" \
            || tail -2 "$OUT/logits-$tag-$q.log"
    done
}

logits() {
    s4
    echo "== logits (4-layer real dims, 280 prefilled + 21 decoded positions)"
    logits_of "$BIN" a
    if [ -n "${BIN2:-}" ]; then
        logits_of "$BIN2" b
        for q in fast quality; do
            cmp -s "$OUT/logits-a-$q.npy" "$OUT/logits-b-$q.npy" && echo "$q: identical" || echo "$q: DIFFERENT"
        done
    fi
    ls -la "$OUT"/logits-*.npy | awk '{print $5, $9}'
}

bench() {
    echo "== bench --synthetic q2, $L layers, 2k and 32k"; date +%T
    timeout 300 ds4-bench --synthetic q2 --layers $L --frontiers 2048,32768 --decode 32 > "$OUT/bench.log" 2>&1
    grep -E "^(frontier|2048|32768),|bandwidth limit|launches" "$OUT/bench.log" | cut -c1-220 | head -8
}

profile() {
    echo "== decode attribution at 2k (--profile 4)"; date +%T
    timeout 200 ds4-bench --synthetic q2 --layers $L --frontiers 2048 --decode 16 --profile 4 > "$OUT/profile.log" 2>&1
    grep -A40 "profile" "$OUT/profile.log" | head -60
}

roofline() {
    echo "== roofline of one decoded token (ncu, 2 layers, scaled to $L)"; date +%T
    timeout 100 ds4-bench --synthetic q2 --layers 2 --frontiers 2048 --decode 4 > "$OUT/roofline_bench.log" 2>&1
    local n bw
    # "decode @2048: 52.0 launches, ..." and "device copy bandwidth 3025 GB/s · ..."
    n=$(grep -oE "decode @[0-9]+: [0-9]+" "$OUT/roofline_bench.log" | head -1 | awk '{print $3}')
    bw=$(grep -oE "device copy bandwidth [0-9]+" "$OUT/roofline_bench.log" | head -1 | awk '{print $4}')
    echo "launches per token: ${n:-?}; copy bandwidth: ${bw:-?} GB/s"
    grep -E "launches|bandwidth" "$OUT/roofline_bench.log" | head -4 | cut -c1-200
    timeout 400 ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
        --csv --page raw ds4-bench --synthetic q2 --layers 2 --frontiers 2048 --decode 1 --warmup 0 \
        > "$OUT/roofline_ncu.csv" 2> "$OUT/roofline_ncu.err"
    echo "ncu rows: $(grep -c '^"' "$OUT/roofline_ncu.csv")"; tail -2 "$OUT/roofline_ncu.err"
    [ -n "$n" ] && [ -n "$bw" ] && python3 tools/device/roofline.py "$OUT/roofline_ncu.csv" "$n" "$bw" 2 $L
}

batch() {
    echo "== batched step, --batch 1,8,16"; date +%T
    timeout 200 ds4-bench --synthetic q2 --layers $L --frontiers 512 --decode 16 --batch 1,8,16 > "$OUT/batch_bench.log" 2>&1
    grep -E "^batch " "$OUT/batch_bench.log" | cut -c1-200
}

sparse() {
    [ -f "$W/q.gguf" ] || timeout 100 ds4-convert synthetic --quiet --layout q2 --layers $L --sparse-experts --vocab-gguf $V "$W/q.gguf" > /dev/null
}

userpath() {
    sparse
    echo "== user path"; date +%T
    timeout 100 ds4-bench -m "$W/q.gguf" --frontiers 2009 --decode 64 > "$OUT/user_bench.log" 2>&1
    grep -E "^2009|bandwidth limit" "$OUT/user_bench.log" | head -2 | cut -c1-200
    timeout 100 ds4-bench --e2e -m "$W/q.gguf" --backend cuda --ctx 4096 -n 100 --prompt-words 2000 --temp 0 2>&1 | tail -1 | cut -c1-200
}

# up: wait (at most 90 s) until the server on port 8090 answers /v1/models.
up() { for i in $(seq 1 90); do python3 -c "import urllib.request;urllib.request.urlopen('http://127.0.0.1:8090/v1/models',timeout=2)" 2>/dev/null && break; sleep 1; done; echo "ready after ${i}s"; }

server() {
    sparse
    echo "== server --parallel 8"; date +%T
    ds4-server -m "$W/q.gguf" -c 4096 --backend cuda --parallel 8 --port 8090 > "$OUT/server.log" 2>&1 &
    local sp=$!; up
    timeout 40 python3 $TP http://127.0.0.1:8090 1 64
    timeout 40 python3 $TP http://127.0.0.1:8090 8 64
    timeout 40 python3 $TP http://127.0.0.1:8090 8 64 --no-think
    kill $sp; wait $sp 2>/dev/null
}

for s in $STEPS; do
    "$s"
done
date +%T
