# Steps the issue-22 device scripts share (source it from the repository root after setting
# nothing; it reads BIN, OUT, W and LIMIT from the environment). Each step prints a few
# summary lines and leaves its logs in $OUT; `before F` is true while less than F percent
# of LIMIT seconds have passed, so a script skips what no longer fits its call.
set -u
BIN=${BIN:-./bin}; OUT=${OUT:-./out}; mkdir -p "$OUT"; export PATH=$BIN:$PATH
G=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); echo "GPU: $G"
# Resident layers: the 43-layer model fits an H200, 36 an 80 GB card.
L=36; echo "$G" | grep -q H200 && L=43
W=${W:-/tmp/w}; mkdir -p "$W"; V=tests/fixtures/vocab/deepseek-v4-vocab.gguf
T=$(mktemp -d); START=$(date +%s); LIMIT=${LIMIT:-560}
before() { [ $(( ($(date +%s) - START) * 100 )) -lt $(( $1 * LIMIT )) ]; }
. tools/device/server-lib.sh
date +%T

# Batched rows against rows alone (bit for bit, bands as defined) on a 4-layer model of the
# real dimensions, the op mirror at 40- and 2-token chunks, tiny-model parity.
correctness() {
    [ -f "$W/s4.gguf" ] || ds4-convert synthetic --quiet --layout q2 --layers 4 --vocab-gguf $V "$W/s4.gguf" > /dev/null
    echo "== batch bit-exact + bands (4-layer real dims)"
    timeout 100 ds4-engine-check batch "$W/s4.gguf" --tiny 0 --tokens 20 --act-q8 --seqs 16 --gpu-only > "$OUT/batch.log" 2>&1
    grep -E "cuda|PASSED|FAIL|rror" "$OUT/batch.log" | cut -c1-300 | tail -4
    echo "== op mirror + parity"; date +%T
    timeout 120 ds4-engine-check ops "$W/s4.gguf" --tiny 0 --flash-layers 4 --tokens 40 --chunk 40 --act-q8 > "$OUT/ops_c40.log" 2>&1; tail -1 "$OUT/ops_c40.log"
    timeout 120 ds4-engine-check ops "$W/s4.gguf" --tiny 0 --flash-layers 4 --tokens 12 --chunk 2 --act-q8 > "$OUT/ops_c2.log" 2>&1; tail -1 "$OUT/ops_c2.log"
    for f in tiny-hca16 tiny-hca128; do ds4-convert hf --quiet tests/fixtures/$f "$W/m-$f.gguf" > /dev/null; done
    timeout 120 ds4-engine-check parity "$W"/m-*.gguf --tiny 2 > "$T/parity.log" 2>&1; grep -E "PASSED|FAIL|failed" "$T/parity.log" | head -3
}

# ab_batch F ARM...: the batched step at 1 and 8 sequences for each arm ("-" the default, else
# one VAR=VALUE for the environment), two alternating rounds, while before F holds.
ab_batch() {
    local f=$1; shift
    echo "== batched step A/B, --synthetic q2 L=$L --batch 1,8"; date +%T
    for r in 1 2; do
        for arm in "$@"; do
            before "$f" || return 0
            local e=""; [ "$arm" = "-" ] || e="$arm"
            env ${e:+"$e"} timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 512 --decode 16 --batch 1,8 > "$T/ab.log" 2>&1
            echo "[$arm] $(grep -E '^batch ' "$T/ab.log" | sed -E 's/.*step ([0-9.]+) ms.*aggregate ([0-9.]+) tok.*/\1 ms \2 tok\/s/' | tr '\n' '|')"
        done
    done
}

# decode_2k F ARM...: prefill and decode at 2k for each arm, while before F holds.
decode_2k() {
    local f=$1; shift
    echo "== decode at 2k"; date +%T
    for arm in "$@"; do
        before "$f" || return 0
        local e=""; [ "$arm" = "-" ] || e="$arm"
        env ${e:+"$e"} timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 2048 --decode 32 > "$T/pf2k.log" 2>&1
        echo "[$arm] $(grep -E '^2048,' "$T/pf2k.log" | head -1 | cut -d, -f1,4,7)"
    done
}

# What a user runs: ds4-bench on a sparse full-size file and the CLI's loop on it.
user_path() {
    [ -f "$W/q.gguf" ] || timeout 100 ds4-convert synthetic --quiet --layout q2 --layers $L --sparse-experts --vocab-gguf $V "$W/q.gguf" > /dev/null
    echo "== user path"; date +%T
    timeout 100 ds4-bench -m "$W/q.gguf" --frontiers 2009 --decode 64 > "$T/ub.log" 2>&1
    grep -E "^2009|bandwidth limit" "$T/ub.log" | head -2 | cut -c1-200
    timeout 100 ds4-bench --e2e -m "$W/q.gguf" --backend cuda --ctx 4096 -n 100 --prompt-words 2000 --temp 0 2>&1 | tail -1 | cut -c1-200
}

# ds4-server --parallel 8 on that file: 1 client, 8 clients, 8 greedy clients (64 tokens).
server8() {
    echo "== server --parallel 8 (defaults)"; date +%T
    ds4-server -m "$W/q.gguf" -c 4096 --backend cuda --parallel 8 --port 8090 > "$T/srv.log" 2>&1 &
    local sp=$!; up
    timeout 40 python3 $TP http://127.0.0.1:8090 1 64
    timeout 40 python3 $TP http://127.0.0.1:8090 8 64; echo "   8-client means: $(sumlog "$T/srv.log" 8)"
    timeout 40 python3 $TP http://127.0.0.1:8090 8 64 --no-think; echo "   no-think means: $(sumlog "$T/srv.log" 8)"
    kill $sp; wait $sp 2>/dev/null
}
