#!/usr/bin/env bash
# Issue 22, session of 2026-12-07 (07:30), second call: binaries in $BIN, logs in $OUT.
#   1. correctness after the one-token F16/F32 GEMV's ring of weight vectors (docs/gpu.md §35):
#      batch --seqs 16, the op mirror at 40- and 2-token chunks, tiny parity
#   2. the batched step at 1 and 8 sequences: default, the one-token ring off
#      (-DDS4_PLAIN_DEPTH=0), all of this session's GEMV changes off; alternating
#   3. decode at 2k: default and the ring off
#   4. the user path (ds4-bench -m, the CLI's loop) and ds4-server --parallel 8
#   5. ncu of the HC mixing part at eight tokens (what its 30 µs are)
# (After this call the ring was removed: no gain, docs/gpu.md §35.)
set -u
BIN=${BIN:-./bin}; OUT=${OUT:-./out}; mkdir -p "$OUT"; export PATH=$BIN:$PATH
G=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); echo "GPU: $G"
L=36; echo "$G" | grep -q H200 && L=43
W=${W:-/tmp/w}; mkdir -p $W; V=tests/fixtures/vocab/deepseek-v4-vocab.gguf
T=$(mktemp -d); START=$(date +%s); LIMIT=${LIMIT:-560}
before() { [ $(( ($(date +%s) - START) * 100 )) -lt $(( $1 * LIMIT )) ]; }
date +%T
[ -f $W/s4.gguf ] || ds4-convert synthetic --quiet --layout q2 --layers 4 --vocab-gguf $V $W/s4.gguf > /dev/null
echo "== batch bit-exact + bands (4-layer real dims)"
timeout 100 ds4-engine-check batch $W/s4.gguf --tiny 0 --tokens 20 --act-q8 --seqs 16 --gpu-only > $OUT/batch.log 2>&1
grep -E "cuda|PASSED|FAIL|rror" $OUT/batch.log | cut -c1-300 | tail -4
echo "== op mirror + parity"; date +%T
timeout 120 ds4-engine-check ops $W/s4.gguf --tiny 0 --flash-layers 4 --tokens 40 --chunk 40 --act-q8 > $OUT/ops_c40.log 2>&1; tail -1 $OUT/ops_c40.log
timeout 120 ds4-engine-check ops $W/s4.gguf --tiny 0 --flash-layers 4 --tokens 12 --chunk 2 --act-q8 > $OUT/ops_c2.log 2>&1; tail -1 $OUT/ops_c2.log
for f in tiny-hca16 tiny-hca128; do ds4-convert hf --quiet tests/fixtures/$f $W/m-$f.gguf > /dev/null; done
timeout 120 ds4-engine-check parity $W/m-*.gguf --tiny 2 > $T/parity.log 2>&1; grep -E "PASSED|FAIL|failed" $T/parity.log | head -3
echo "== batched step A/B, --synthetic q2 L=$L --batch 1,8"; date +%T
step() { echo "[$1] $(grep -E '^batch ' $T/ab.log | sed -E 's/.*step ([0-9.]+) ms.*aggregate ([0-9.]+) tok.*/\1 ms \2 tok\/s/' | tr '\n' '|')"; }
for r in 1 2; do
  for arm in "-" "DS4_GEMV_DEFINES=-DDS4_PLAIN_DEPTH=0" \
      "DS4_GEMV_DEFINES=-DDS4_PLAIN_DEPTH=0 -DDS4_PLAIN_COLS_ROWS=2 -DDS4_Q8M_STAGE=1"; do
    before 40 || break 2
    if [ "$arm" = "-" ]; then e=""; else e="$arm"; fi
    env ${e:+"$e"} timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 512 --decode 16 --batch 1,8 > $T/ab.log 2>&1
    step "$arm"
  done
done
echo "== decode at 2k"; date +%T
for arm in "-" "DS4_GEMV_DEFINES=-DDS4_PLAIN_DEPTH=0"; do
  before 50 || break
  if [ "$arm" = "-" ]; then e=""; else e="$arm"; fi
  env ${e:+"$e"} timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 2048 --decode 32 > $T/pf2k.log 2>&1
  echo "[$arm] $(grep -E '^2048,' $T/pf2k.log | cut -d, -f1,4,7)"
done
before 55 || exit 0
[ -f $W/q.gguf ] || timeout 100 ds4-convert synthetic --quiet --layout q2 --layers $L --sparse-experts --vocab-gguf $V $W/q.gguf > /dev/null
echo "== user path"; date +%T
timeout 100 ds4-bench -m $W/q.gguf --frontiers 2009 --decode 64 > $T/ub.log 2>&1; grep -E "^2009|bandwidth limit" $T/ub.log | head -3 | cut -c1-200
timeout 100 ds4-bench --e2e -m $W/q.gguf --backend cuda --ctx 4096 -n 100 --prompt-words 2000 --temp 0 2>&1 | tail -1 | cut -c1-200
. tools/device/server-lib.sh
before 72 || exit 0
echo "== server --parallel 8 (defaults)"; date +%T
ds4-server -m $W/q.gguf -c 4096 --backend cuda --parallel 8 --port 8090 > $T/srv.log 2>&1 &
sp=$!; up
timeout 40 python3 $TP http://127.0.0.1:8090 1 64
timeout 40 python3 $TP http://127.0.0.1:8090 8 64; echo "   8-client means: $(sumlog $T/srv.log 8)"
timeout 40 python3 $TP http://127.0.0.1:8090 8 64 --no-think; echo "   no-think means: $(sumlog $T/srv.log 8)"
kill $sp; wait $sp 2>/dev/null
before 88 || exit 0
echo "== ncu ds4_hc_mix_part_f16 at eight tokens"; date +%T
timeout 60 ncu --clock-control none --kernel-name "regex:^ds4_hc_mix_part_f16\$" --launch-skip 40 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section InstructionStats --csv --page details \
    ds4-bench --synthetic q2 --layers 2 --frontiers 512 --decode 16 --batch 8 --warmup 0 > $OUT/ncu_hc.csv 2> $T/ncu_hc.err
grep -E '"(Duration|Grid Size|Achieved Occupancy|DRAM Throughput|L2 Hit Rate|No Eligible|Warp Cycles Per Issued Instruction|Executed Instructions|Issue Slots Busy)"' \
    $OUT/ncu_hc.csv | awk -F'","' '{print $(NF-2) " = " $NF}' | tr -d '"' | paste -sd';' | cut -c1-900
grep -E 'Stall|stall' $OUT/ncu_hc.csv | awk -F'","' '{print $(NF-2) " = " $NF}' | tr -d '"' | sort -t= -k2 -rn | head -8 | paste -sd';'
date +%T
