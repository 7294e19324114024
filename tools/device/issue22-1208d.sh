#!/usr/bin/env bash
# Issue 22, session of 2026-12-07 (07:30), after review: the several-column F16/F32 GEMV
# without its depth knob and the Q8_0 staging loop's bound (same sums, docs/gpu.md §35):
# correctness, then one round of the batched step against the old loads.
. tools/device/issue22-lib.sh
correctness
ab_batch 80 "-" "DS4_GEMV_DEFINES=-DDS4_PLAIN_COLS_ROWS=2 -DDS4_Q8M_STAGE=1"
date +%T
