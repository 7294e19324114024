#!/usr/bin/env bash
# Issue 22, session of 2026-12-07 (04:20), first call: run from the repository root on a
# machine with an NVIDIA GPU, binaries in $BIN, logs in $OUT (few files). Measures what the
# previous session landed without a GPU: the batched step's bands in one launch (§31), the
# coalesced one-row band body, the shared HC-mixing store.
#   1. correctness: batch --seqs 16 (bands of every step against their definition), the op
#      mirror at 40-token chunks (HC four-token blocks) and 2-token chunks, tiny parity
#   2. the batched step at 1 and 8 sequences: default, the 64-bit IQ2_XXS tables
#      (-DDS4_IQ2_PRMT=0 -DDS4_PRMT_ASM=0, docs/gpu.md §32), the one-sub-block Q2_K unit
#      (-DDS4_Q2K_PLANES=0, §33), DS4_BATCH_BANDS=0, alternating;
#      a 2k prefill and decode with the tiles' __byte_perm (DS4_TILES_DEFINES=-DDS4_PRMT_ASM=0)
#      against default; a profile of the 8-sequence step
#   3. ds4-server --parallel 8 (defaults): 1 client, 8 clients, 8 greedy
#   4. a 49-token prompt piece, DS4_HC_MIX_TPB=0 / default, alternating
#   5. the user path: ds4-bench decode and the CLI's loop
set -u
BIN=${BIN:-./bin}; OUT=${OUT:-./out}; mkdir -p "$OUT"; export PATH=$BIN:$PATH
G=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); echo "GPU: $G"
L=36; echo "$G" | grep -q H200 && L=43
W=${W:-/tmp/w}; mkdir -p $W; V=tests/fixtures/vocab/deepseek-v4-vocab.gguf
T=$(mktemp -d)
START=$(date +%s)
# before S: true while fewer than S seconds of this script have passed (later sections are
# skipped rather than cut off by the call's limit).
before() { [ $(( $(date +%s) - START )) -lt $1 ]; }
date +%T
[ -f $W/s4.gguf ] || ds4-convert synthetic --quiet --layout q2 --layers 4 --vocab-gguf $V $W/s4.gguf > /dev/null
echo "== batch bit-exact + bands (4-layer real dims)"
timeout 100 ds4-engine-check batch $W/s4.gguf --tiny 0 --tokens 20 --act-q8 --seqs 16 --gpu-only > $T/b.log 2>&1
grep -E "cuda|PASSED|FAIL|rror" $T/b.log | cut -c1-300
echo "== op mirror + parity"; date +%T
if [ -z "${NO_OPS:-}" ]; then
timeout 120 ds4-engine-check ops $W/s4.gguf --tiny 0 --flash-layers 4 --tokens 40 --chunk 40 --act-q8 > $OUT/ops_c40.log 2>&1; tail -1 $OUT/ops_c40.log
timeout 120 ds4-engine-check ops $W/s4.gguf --tiny 0 --flash-layers 4 --tokens 12 --chunk 2 --act-q8 > $T/ops2.log 2>&1; tail -1 $T/ops2.log
for f in tiny-hca16 tiny-hca128; do ds4-convert hf --quiet tests/fixtures/$f $W/m-$f.gguf > /dev/null; done
timeout 120 ds4-engine-check parity $W/m-*.gguf --tiny 2 > $T/parity.log 2>&1; grep -E "PASSED|FAIL|failed" $T/parity.log | head -3
fi
echo "== batched step A/B, --synthetic q2 L=$L --batch 1,8"; date +%T
step() { echo "[$1] $(grep -E '^batch ' $T/ab.log | sed -E 's/.*step ([0-9.]+) ms.*aggregate ([0-9.]+) tok.*/\1 ms \2 tok\/s/' | tr '\n' '|')"; }
for r in 1 2; do
  before 400 || break
  for arm in "-" "DS4_GEMV_DEFINES=-DDS4_IQ2_PRMT=0 -DDS4_PRMT_ASM=0" "DS4_GEMV_DEFINES=-DDS4_Q2K_PLANES=0" "DS4_BATCH_BANDS=0"; do
    if [ "$arm" = "-" ]; then e=""; else e="$arm"; fi
    env ${e:+"$e"} timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 512 --decode 16 --batch 1,8 > $T/ab.log 2>&1
    step "$arm"
  done
done
echo "== 2k prefill + decode: tiles' prmt / __byte_perm, then the IQ2 tables old / new"; date +%T
for arm in "-" "DS4_TILES_DEFINES=-DDS4_PRMT_ASM=0" "DS4_GEMV_DEFINES=-DDS4_IQ2_PRMT=0 -DDS4_PRMT_ASM=0 -DDS4_Q2K_PLANES=0"; do
  before 480 || break
  if [ "$arm" = "-" ]; then e=""; else e="$arm"; fi
  env ${e:+"$e"} timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 2048 --decode 32 > $T/pf2k.log 2>&1
  echo "[$arm] $(grep -E '^2048,' $T/pf2k.log | cut -d, -f1,4,7)"
done
before 470 || { echo "(stopping: time)"; exit 0; }
[ -f $W/q.gguf ] || timeout 100 ds4-convert synthetic --quiet --layout q2 --layers $L --sparse-experts --vocab-gguf $V $W/q.gguf > /dev/null
echo "== user path"; date +%T
timeout 100 ds4-bench -m $W/q.gguf --frontiers 2009 --decode 64 > $T/ub.log 2>&1; grep -E "^2009|bandwidth limit" $T/ub.log | head -3 | cut -c1-200
timeout 100 ds4-bench --e2e -m $W/q.gguf --backend cuda --ctx 4096 -n 100 --prompt-words 2000 --temp 0 2>&1 | tail -1 | cut -c1-200
date +%T
before 520 || { echo "(stopping: time)"; exit 0; }
timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 512 --decode 8 --batch 8 --profile 2 > $OUT/prof.log 2>&1
echo "-- profile:"; sed -n '/^profile batch/,$p' $OUT/prof.log | sed -n '1p;/by kernel/,/top section/p' | head -24
date +%T
. tools/device/server-lib.sh
[ -n "${NO_SERVER:-}" ] || ! before 540 && { echo "(stopping: time or NO_SERVER)"; exit 0; }
echo "== server --parallel 8 (defaults)"; date +%T
ds4-server -m $W/q.gguf -c 4096 --backend cuda --parallel 8 --port 8090 > $T/srv.log 2>&1 &
sp=$!; up
timeout 40 python3 $TP http://127.0.0.1:8090 1 64
timeout 40 python3 $TP http://127.0.0.1:8090 8 64; echo "   8-client means: $(sumlog $T/srv.log 8)"
timeout 40 python3 $TP http://127.0.0.1:8090 8 64 --no-think; echo "   no-think means: $(sumlog $T/srv.log 8)"
kill $sp; wait $sp 2>/dev/null
echo "== 49-token piece after 64 (prefill_s of frontier 114), DS4_HC_MIX_TPB=0 / default"
for v in 0 "" 0 ""; do
  before 570 || break
  DS4_HC_MIX_TPB=$v timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 64,114 --decode 1 --warmup 64 > $T/pf.log 2>&1
  echo "[TPB=$v] $(grep -E '^114,' $T/pf.log | cut -d, -f1-4)"
done
