#!/usr/bin/env bash
# Issue 22, session of 2026-12-07 (07:30), third call (for an H200: 43 layers): the session's
# several-column GEMV changes (docs/gpu.md §35) against the old code in one binary, then the
# user path and the server. Binaries in $BIN, logs in $OUT.
. tools/device/issue22-lib.sh
correctness
ab_batch 45 "-" "DS4_GEMV_DEFINES=-DDS4_PLAIN_COLS_ROWS=2 -DDS4_Q8M_STAGE=1"
decode_2k 52 "-"
before 60 && user_path
before 75 && server8
date +%T
