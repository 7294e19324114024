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
. tools/device/issue22-lib.sh
correctness
ab_batch 40 "-" "DS4_GEMV_DEFINES=-DDS4_PLAIN_DEPTH=0" \
    "DS4_GEMV_DEFINES=-DDS4_PLAIN_DEPTH=0 -DDS4_PLAIN_COLS_ROWS=2 -DDS4_Q8M_STAGE=1"
decode_2k 50 "-" "DS4_GEMV_DEFINES=-DDS4_PLAIN_DEPTH=0"
before 55 || exit 0
user_path
before 72 || exit 0
server8
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
