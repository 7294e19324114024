#!/usr/bin/env bash
# Issue 22, session of 2026-12-07, second call: run from the repository root on a machine with
# an NVIDIA GPU, binaries in $BIN, logs in $OUT (few files: the device tool returns a limited
# number). Same binaries for every arm; each change's old path by its switch.
#   1. batch bit-exact (default)
#   2. the batched step at 1 and 8 sequences: default, DS4_BATCH_BANDS=0 (§31),
#      -DDS4_FINISH_SPREAD=0 (§30), DS4_COLS_SPLIT=4 / 16 (§23), -DDS4_Q8M_ROWS=4, alternating;
#      profiles of the 8-sequence step, default and DS4_BATCH_BANDS=0
#   3. ds4-server --parallel 8: every change of the session off (DS4_SKIP_PUSHED_OUT_TURNS=0
#      DS4_HC_MIX_TPB=0 DS4_BATCH_BANDS=0 -DDS4_FINISH_SPREAD=0) against the defaults,
#      alternating, 8 clients (thinking default) and 8 greedy, 1 client
#   4. a 49-token prompt piece with DS4_HC_MIX_TPB=0 and default (docs/gpu.md §11)
#   5. the user path: ds4-bench decode, the CLI's loop greedy and with the default sampler
set -u
BIN=${BIN:-./bin}; OUT=${OUT:-./out}; mkdir -p "$OUT"; export PATH=$BIN:$PATH
G=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); echo "GPU: $G"
L=36; echo "$G" | grep -q H200 && L=43
W=${W:-/tmp/w}; mkdir -p $W; V=tests/fixtures/vocab/deepseek-v4-vocab.gguf
T=$(mktemp -d)
date +%T
[ -f $W/s4.gguf ] || ds4-convert synthetic --quiet --layout q2 --layers 4 --vocab-gguf $V $W/s4.gguf > /dev/null
if [ -z "${LEAN:-}" ]; then
echo "== batch bit-exact (4-layer real dims)"
timeout 100 ds4-engine-check batch $W/s4.gguf --tiny 0 --tokens 20 --act-q8 --seqs 16 --gpu-only 2>&1 | grep -E "cuda|PASSED|FAIL|rror" | cut -c1-200
fi
echo "== batched step A/B, --synthetic q2 L=$L --batch 1,8"; date +%T
step() { echo "[$1 ${2:-}] $(grep -E '^batch ' $T/ab.log | sed -E 's/.*step ([0-9.]+) ms.*aggregate ([0-9.]+) tok.*/\1 ms \2 tok\/s/' | tr '\n' '|')"; }
for r in 1 2; do
  ARMS=("-" "DS4_BATCH_BANDS=0" "DS4_GEMV_DEFINES=-DDS4_FINISH_SPREAD=0")
  [ -z "${LEAN:-}" ] && ARMS+=("DS4_COLS_SPLIT=4" "DS4_COLS_SPLIT=16" "DS4_GEMV_DEFINES=-DDS4_Q8M_ROWS=4")
  for arm in "${ARMS[@]}"; do
    if [ "$arm" = "-" ]; then e=""; else e="$arm"; fi
    env $e timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 512 --decode 16 --batch 1,8 > $T/ab.log 2>&1
    step "$arm"
  done
done
PA=("-" "DS4_BATCH_BANDS=0"); [ -n "${LEAN:-}" ] && PA=("-")
for arm in "${PA[@]}"; do
  if [ "$arm" = "-" ]; then e=""; else e="$arm"; fi
  env $e timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 512 --decode 8 --batch 8 --profile 2 > $T/prof.log 2>&1
  echo "-- profile [$arm]:"; sed -n '/^profile batch/,$p' $T/prof.log | sed -n '1p;/by kernel/,/top section/p' | head -24
  cp $T/prof.log "$OUT/prof_${arm//[^A-Za-z0-9]/_}.log"
done
date +%T
[ -f $W/q.gguf ] || timeout 100 ds4-convert synthetic --quiet --layout q2 --layers $L --sparse-experts --vocab-gguf $V $W/q.gguf > /dev/null
. tools/device/server-lib.sh
OLD="DS4_SKIP_PUSHED_OUT_TURNS=0 DS4_HC_MIX_TPB=0 DS4_BATCH_BANDS=0 DS4_GEMV_DEFINES=-DDS4_FINISH_SPREAD=0"
echo "== server (--parallel 8): the session's changes off / on"; date +%T
n=0
for arm in old new old new; do
  n=$((n+1)); if [ $arm = old ]; then e="$OLD"; else e=""; fi
  env $e ds4-server -m $W/q.gguf -c 4096 --backend cuda --parallel 8 --port 8090 > $T/srv$n.log 2>&1 &
  sp=$!; echo -n "-- $arm "; up
  [ $n -le 2 ] && timeout 40 python3 $TP http://127.0.0.1:8090 1 64
  timeout 40 python3 $TP http://127.0.0.1:8090 8 64; echo "   8-client means: $(sumlog $T/srv$n.log 8)"
  timeout 40 python3 $TP http://127.0.0.1:8090 8 64 --no-think; echo "   no-think means: $(sumlog $T/srv$n.log 8)"
  kill $sp; wait $sp 2>/dev/null
done
[ -n "${SWEEP:-}" ] && {
  ds4-server -m $W/q.gguf -c 4096 --backend cuda --parallel 8 --port 8090 > $T/srvs.log 2>&1 &
  sp=$!; echo -n "-- sweep "; up
  for c in 1 2 4 8 16; do timeout 60 python3 $TP http://127.0.0.1:8090 $c 64; done
  kill $sp; wait $sp 2>/dev/null
}
echo "== 49-token piece after 64 (prefill_s of frontier 114), DS4_HC_MIX_TPB=0 / default"
HC=(0 "" 0 ""); [ -n "${LEAN:-}" ] && HC=(0 "")
for v in "${HC[@]}"; do
  DS4_HC_MIX_TPB=$v timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 64,114 --decode 1 --warmup 64 > $T/pf.log 2>&1
  echo "[TPB=$v] $(grep -E '^114,' $T/pf.log | cut -d, -f1-4)"
done
echo "== user path"; date +%T
timeout 100 ds4-bench -m $W/q.gguf --frontiers 2009 --decode 64 > $T/ub.log 2>&1; grep -E "^2009|bandwidth limit" $T/ub.log | head -3 | cut -c1-200
timeout 100 ds4-bench --e2e -m $W/q.gguf --backend cuda --ctx 4096 -n 100 --prompt-words 2000 --temp 0 2>&1 | tail -1 | cut -c1-200
timeout 100 ds4-bench --e2e -m $W/q.gguf --backend cuda --ctx 4096 -n 100 --prompt-words 2000 2>&1 | tail -1 | cut -c1-200
date +%T
