#!/usr/bin/env bash
# Issue 22's A/Bs of 2026-12-06 (21:49–00:49), prepared without a GPU: run from the
# repository root on a machine with an NVIDIA GPU, the stripped binaries (ds4-bench,
# ds4-engine-check, ds4-convert, ds4-server) in $BIN (default ./bin), logs into $OUT
# (default ./out). Build them as tools/device/h200-checks.sh says (add -p ds4-server).
#   1. ds4-engine-check batch: batched rows the bits of rows decoded alone
#   2. the batched step at 1 and 8 sequences: default and the IQ2_XXS sign masks by
#      integer ops (docs/gpu.md §20), alternating (the 2026-12-06 run also had a
#      four-token HC-mixing block, since removed: docs/gpu.md §11)
#   3. ds4-server --parallel 8 with DS4_PARALLEL_PICKS=0 and default (docs/server.md §9):
#      1 and 8 clients (thinking default: full-row draws on the synthetic model; --no-think:
#      greedy), then 2, 4, 16 clients; the "request done" means of pick_us and steps_ms
#   4. the CLI's loop (ds4-bench --e2e, greedy)
set -u
BIN=${BIN:-./bin}; OUT=${OUT:-./out}; mkdir -p "$OUT"; export PATH=$BIN:$PATH
G=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); echo "GPU: $G"
L=36; echo "$G" | grep -q H200 && L=43
W=${W:-/tmp/w}; mkdir -p $W; V=tests/fixtures/vocab/deepseek-v4-vocab.gguf
date +%T
ds4-convert synthetic --quiet --layout q2 --layers 4 --vocab-gguf $V $W/s4.gguf > /dev/null
echo "== batch bit-exact (4-layer real dims)"
timeout 100 ds4-engine-check batch $W/s4.gguf --tiny 0 --tokens 20 --act-q8 --seqs 16 --gpu-only > $OUT/b.log 2>&1; grep -E "cuda|PASSED|FAIL|rror" $OUT/b.log | cut -c1-300
echo "== batched step A/B, --synthetic q2 L=$L --batch 1,8"; date +%T
for D in "" "-DDS4_IQ2_MASK_TABLE=0 -DDS4_IQ2_SIGNS_ALU=1" "" "-DDS4_IQ2_MASK_TABLE=0 -DDS4_IQ2_SIGNS_ALU=1"; do
  DS4_GEMV_DEFINES="$D" timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 512 --decode 16 --batch 1,8 > $OUT/ab.log 2>&1
  echo "[$D] $(grep -E '^batch ' $OUT/ab.log | sed -E 's/.*step ([0-9.]+) ms.*aggregate ([0-9.]+) tok.*/\1 ms \2 tok\/s/' | tr '\n' '|')"
done
date +%T
timeout 100 ds4-convert synthetic --quiet --layout q2 --layers $L --sparse-experts --vocab-gguf $V $W/q.gguf > /dev/null
. tools/device/server-lib.sh
echo "== server picks A/B (--parallel 8)"; date +%T
for pp in 0 1; do
  DS4_PARALLEL_PICKS=$pp ds4-server -m $W/q.gguf -c 4096 --backend cuda --parallel 8 --port 8090 > $OUT/srvp$pp.log 2>&1 &
  sp=$!; echo -n "-- DS4_PARALLEL_PICKS=$pp "; up
  timeout 40 python3 $TP http://127.0.0.1:8090 1 64
  timeout 40 python3 $TP http://127.0.0.1:8090 8 64; echo "   8-client means: $(sumlog $OUT/srvp$pp.log 8)"
  timeout 40 python3 $TP http://127.0.0.1:8090 8 64 --no-think; echo "   no-think means: $(sumlog $OUT/srvp$pp.log 8)"
  [ $pp = 1 ] && for c in 2 4 16; do timeout 60 python3 $TP http://127.0.0.1:8090 $c 64; done
  kill $sp; wait $sp 2>/dev/null
done
echo "== CLI path"; date +%T
timeout 100 ds4-bench --e2e -m $W/q.gguf --backend cuda --ctx 4096 -n 100 --prompt-words 2000 --temp 0 > $OUT/ue.log 2>&1; tail -3 $OUT/ue.log | cut -c1-200
date +%T
