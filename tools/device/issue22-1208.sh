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
. tools/device/issue22-lib.sh
correctness
ab_batch 60 "-" "DS4_GEMV_DEFINES=-DDS4_PLAIN_COLS_ROWS=2 -DDS4_Q8M_STAGE=1" \
    "DS4_GEMV_DEFINES=-DDS4_PLAIN_COLS_ROWS=4 -DDS4_PLAIN_COLS_DEPTH=2" \
    "DS4_GEMV_DEFINES=-DDS4_PLAIN_COLS_DEPTH=2" "DS4_GEMV_DEFINES=-DDS4_Q8M_STAGE=1"
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
