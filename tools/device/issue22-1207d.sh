#!/usr/bin/env bash
# Issue 22, session of 2026-12-07 (04:20), second call: the byte-permute IQ2_XXS unit in the
# flat (batched) kernels only (docs/gpu.md §32), and the batch check's bands over the
# capacity compared as the engine reads them. Binaries in $BIN, logs in $OUT.
#   1. batch --seqs 16: batched (flat, permutes) vs alone (one-token, 64-bit tables) bit for
#      bit, and every band as defined
#   2. the batched step at 1 and 8 sequences: default (flat only), -DDS4_IQ2_PRMT_ONE=1 (all
#      kernels), -DDS4_IQ2_PRMT=0 (none), alternating
#   3. decode at 2k: default and the permutes everywhere
#   4. a profile of the 8-sequence step
set -u
BIN=${BIN:-./bin}; OUT=${OUT:-./out}; mkdir -p "$OUT"; export PATH=$BIN:$PATH
G=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); echo "GPU: $G"
L=36; echo "$G" | grep -q H200 && L=43
W=${W:-/tmp/w}; mkdir -p $W; V=tests/fixtures/vocab/deepseek-v4-vocab.gguf
T=$(mktemp -d); date +%T
START=$(date +%s); LIMIT=${LIMIT:-300}
# before F: true while less than F percent of LIMIT seconds have passed.
before() { [ $(( ($(date +%s) - START) * 100 )) -lt $(( $1 * LIMIT )) ]; }
[ -f $W/s4.gguf ] || ds4-convert synthetic --quiet --layout q2 --layers 4 --vocab-gguf $V $W/s4.gguf > /dev/null
echo "== batch bit-exact + bands (4-layer real dims)"
timeout 100 ds4-engine-check batch $W/s4.gguf --tiny 0 --tokens 20 --act-q8 --seqs 16 --gpu-only > $T/b.log 2>&1
grep -E "cuda|PASSED|FAIL|rror" $T/b.log | cut -c1-300
echo "== batched step A/B, --synthetic q2 L=$L --batch 1,8"; date +%T
step() { echo "[$1] $(grep -E '^batch ' $T/ab.log | sed -E 's/.*step ([0-9.]+) ms.*aggregate ([0-9.]+) tok.*/\1 ms \2 tok\/s/' | tr '\n' '|')"; }
ARMS=("-" "DS4_GEMV_DEFINES=-DDS4_IQ2_PRMT_ONE=1" "DS4_GEMV_DEFINES=-DDS4_IQ2_PRMT=0")
for r in 1 2; do
  for arm in "${ARMS[@]}"; do
    before 85 || break 2
    if [ "$arm" = "-" ]; then e=""; else e="$arm"; fi
    env ${e:+"$e"} timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 512 --decode 16 --batch 1,8 > $T/ab.log 2>&1
    step "$arm"
  done
done
before 88 || exit 0
timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 512 --decode 8 --batch 8 --profile 2 > $OUT/prof.log 2>&1
echo "-- profile:"; sed -n '/^profile batch/,$p' $OUT/prof.log | sed -n '1p;/by kernel/,/top section/p' | head -24
date +%T
echo "== decode at 2k"; date +%T
for arm in "-" "DS4_GEMV_DEFINES=-DDS4_IQ2_PRMT_ONE=1"; do
  before 90 || break
  if [ "$arm" = "-" ]; then e=""; else e="$arm"; fi
  env ${e:+"$e"} timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 2048 --decode 32 > $T/pf2k.log 2>&1
  echo "[$arm] $(grep -E '^2048,' $T/pf2k.log | cut -d, -f1,4,7)"
done
date +%T
