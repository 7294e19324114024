#!/usr/bin/env bash
# Issue 22, session of 2026-12-07 (07:30), first call: binaries in $BIN, logs in $OUT.
#   1. correctness of the flat-only byte permutes (5726a82) and of the several-column GEMVs'
#      rows per warp / staged loads (docs/gpu.md §35): batch --seqs 16 (batched = alone bit
#      for bit, bands as defined), the op mirror at 40- and 2-token chunks, tiny parity
#   2. the batched step at 1 and 8 sequences: default (F16/F32 columns 8 rows per warp, Q8_0
#      codes staged 4 loads at a time), the old pair (2 rows, one load at a time), 4 rows with
#      two steps in flight, 8 rows with two, the Q8_0 staging alone old; alternating
#   3. ncu sections of the 8-sequence step's kernels that are bound neither by DRAM nor by
#      their instructions: HC mixing parts, routed down (flat SwiGLU Q2_K), routed gate/up
#      (flat IQ2_XXS), several-column F16 and Q8_0 (2-layer model)
#   4. a profile of the 8-sequence step
set -u
BIN=${BIN:-./bin}; OUT=${OUT:-./out}; mkdir -p "$OUT"; export PATH=$BIN:$PATH
G=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); echo "GPU: $G"
L=36; echo "$G" | grep -q H200 && L=43
W=${W:-/tmp/w}; mkdir -p $W; V=tests/fixtures/vocab/deepseek-v4-vocab.gguf
T=$(mktemp -d); START=$(date +%s); LIMIT=${LIMIT:-560}
# before F: true while less than F percent of LIMIT seconds have passed.
before() { [ $(( ($(date +%s) - START) * 100 )) -lt $(( $1 * LIMIT )) ]; }
date +%T
[ -f $W/s4.gguf ] || ds4-convert synthetic --quiet --layout q2 --layers 4 --vocab-gguf $V $W/s4.gguf > /dev/null
echo "== batch bit-exact + bands (4-layer real dims)"
timeout 100 ds4-engine-check batch $W/s4.gguf --tiny 0 --tokens 20 --act-q8 --seqs 16 --gpu-only > $OUT/batch.log 2>&1
grep -E "cuda|PASSED|FAIL|rror|bands" $OUT/batch.log | cut -c1-300 | tail -8
echo "== op mirror + parity"; date +%T
timeout 120 ds4-engine-check ops $W/s4.gguf --tiny 0 --flash-layers 4 --tokens 40 --chunk 40 --act-q8 > $OUT/ops_c40.log 2>&1; tail -1 $OUT/ops_c40.log
timeout 120 ds4-engine-check ops $W/s4.gguf --tiny 0 --flash-layers 4 --tokens 12 --chunk 2 --act-q8 > $OUT/ops_c2.log 2>&1; tail -1 $OUT/ops_c2.log
for f in tiny-hca16 tiny-hca128; do ds4-convert hf --quiet tests/fixtures/$f $W/m-$f.gguf > /dev/null; done
timeout 120 ds4-engine-check parity $W/m-*.gguf --tiny 2 > $T/parity.log 2>&1; grep -E "PASSED|FAIL|failed" $T/parity.log | head -3
echo "== batched step A/B, --synthetic q2 L=$L --batch 1,8"; date +%T
step() { echo "[$1] $(grep -E '^batch ' $T/ab.log | sed -E 's/.*step ([0-9.]+) ms.*aggregate ([0-9.]+) tok.*/\1 ms \2 tok\/s/' | tr '\n' '|')"; }
for r in 1 2; do
  for arm in "-" "DS4_GEMV_DEFINES=-DDS4_PLAIN_COLS_ROWS=2 -DDS4_Q8M_STAGE=1" \
      "DS4_GEMV_DEFINES=-DDS4_PLAIN_COLS_ROWS=4 -DDS4_PLAIN_COLS_DEPTH=2" \
      "DS4_GEMV_DEFINES=-DDS4_PLAIN_COLS_DEPTH=2" "DS4_GEMV_DEFINES=-DDS4_Q8M_STAGE=1"; do
    before 60 || break 2
    if [ "$arm" = "-" ]; then e=""; else e="$arm"; fi
    env ${e:+"$e"} timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 512 --decode 16 --batch 1,8 > $T/ab.log 2>&1
    step "$arm"
  done
done
echo "== ncu of the 8-sequence step (2 layers)"; date +%T
KS=${KS:-ds4_gemv_cols_f16 ds4_hc_mix_part_f16 ds4_gemv_flat_swiglu_q_q2_k ds4_gemv_flat_q_iq2_xxs ds4_gemv_cols_q_q8_0}
for k in $KS; do
  before 82 || break
  timeout 100 ncu --clock-control none --kernel-name "regex:^$k\$" --launch-skip ${SKIP:-2} --launch-count 2 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
      --section ComputeWorkloadAnalysis --section InstructionStats --csv --page details \
      ds4-bench --synthetic q2 --layers 2 --frontiers 512 --decode 3 --batch 8 --warmup 0 \
      > "$OUT/ncu_$k.csv" 2> "$OUT/ncu_$k.err"
  echo "-- $k ($(grep -c . "$OUT/ncu_$k.csv") lines)"
  grep -E '"(Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Grid Size|Block Size|Waves Per SM|Memory Throughput|DRAM Throughput|L1/TEX Hit Rate|L2 Hit Rate|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Active Warps Per Scheduler|Eligible Warps Per Scheduler|Warp Cycles Per Issued Instruction|Executed Instructions|Mem Busy|Max Bandwidth|Mem Pipes Busy)"' \
      "$OUT/ncu_$k.csv" | awk -F'","' '{print $(NF-2) " = " $NF}' | tr -d '"' | head -44 | paste -sd';' | cut -c1-2500
done
before 90 || exit 0
timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 512 --decode 8 --batch 8 --profile 2 > $OUT/prof.log 2>&1
echo "-- profile:"; sed -n '/^profile batch/,$p' $OUT/prof.log | sed -n '1p;/by kernel/,/top section/p' | head -24
date +%T
