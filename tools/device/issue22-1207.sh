#!/usr/bin/env bash
# Issue 22's measurements of the session of 2026-12-07 (01:05–04:05): run from the
# repository root on a machine with an NVIDIA GPU, the stripped binaries (ds4-bench,
# ds4-engine-check, ds4-convert, ds4-server, ds4) in $BIN (default ./bin), logs into $OUT
# (default ./out). Build them as tools/device/h200-checks.sh says (add -p ds4-server).
#   1. ds4-engine-check batch (batched rows = rows decoded alone), default, with four rows
#      per warp in the several-column Q8_0 GEMV (-DDS4_Q8M_ROWS=4) and with the butterfly per
#      value (-DDS4_FINISH_SPREAD=0; docs/gpu.md §30)
#   2. whole-model parity and the op mirror on the tiny models (the fixtures that travel)
#   2b. four-token HC-mixing blocks at prompt pieces (docs/gpu.md §11): prompt logits
#      bit-identical on and off, op mirror with 40-token chunks, joint = alone, a 49-token
#      piece's time on and off, the 49-token prefill's profile
#   3. the batched step at 1 and 8 sequences: default (spreading reduction, docs/gpu.md §30),
#      -DDS4_FINISH_SPREAD=0 (a butterfly per value) and -DDS4_Q8M_ROWS=4, alternating; then
#      a profile of the 8-sequence step with the several-column launches named by shape
#   4. ds4-server --parallel 8, the old path (DS4_SKIP_PUSHED_OUT_TURNS=0 DS4_HC_MIX_TPB=0),
#      the defaults, the skip alone, alternating: 8 clients (thinking default) and 8 greedy;
#      1 client in the first two
#   5. the CLI's loop (ds4-bench --e2e, greedy) beside the bench
set -u
BIN=${BIN:-./bin}; OUT=${OUT:-./out}; mkdir -p "$OUT"; export PATH=$BIN:$PATH
G=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); echo "GPU: $G"
L=36; echo "$G" | grep -q H200 && L=43
W=${W:-/tmp/w}; mkdir -p $W; V=tests/fixtures/vocab/deepseek-v4-vocab.gguf
R4="-DDS4_Q8M_ROWS=4"
date +%T
ds4-convert synthetic --quiet --layout q2 --layers 4 --vocab-gguf $V $W/s4.gguf > /dev/null
echo "== batch bit-exact (4-layer real dims)"
for D in "" "$R4" "-DDS4_FINISH_SPREAD=0"; do
  DS4_GEMV_DEFINES="$D" timeout 100 ds4-engine-check batch $W/s4.gguf --tiny 0 --tokens 20 --act-q8 --seqs 16 --gpu-only > $OUT/b.log 2>&1
  echo "[$D]"; grep -E "cuda|PASSED|FAIL|rror" $OUT/b.log | cut -c1-300
done
if [ -z "${NO_PARITY:-}" ]; then
  echo "== parity + op mirror (tiny-hca16, tiny-hca128; 4-layer real dims)"; date +%T
  for f in tiny-hca16 tiny-hca128; do ds4-convert hf --quiet tests/fixtures/$f $W/m-$f.gguf > /dev/null; done
  timeout 120 ds4-engine-check parity $W/m-*.gguf --tiny 2 > $OUT/parity.log 2>&1; grep -E "PASSED|FAIL|failed" $OUT/parity.log | head -5
  timeout 120 ds4-engine-check parity $W/s4.gguf --tokens 12 > $OUT/parity_s4.log 2>&1; grep -E "max rel|PASSED|FAIL|failed" $OUT/parity_s4.log | head -8
  timeout 120 ds4-engine-check ops $W/m-*.gguf --tiny 2 --tokens 40 > $OUT/ops.log 2>&1; tail -1 $OUT/ops.log
  timeout 120 ds4-engine-check ops $W/m-*.gguf --tiny 2 --tokens 40 --act-q8 > $OUT/ops_q8.log 2>&1; tail -1 $OUT/ops_q8.log
  timeout 120 ds4-engine-check ops $W/s4.gguf --tiny 0 --flash-layers 4 --tokens 12 --chunk 2 --act-q8 > $OUT/ops_s4.log 2>&1; tail -1 $OUT/ops_s4.log
fi
echo "== four-token HC-mixing blocks at prompt pieces (DS4_HC_MIX_TPB=0 against default)"
p="$(head -c 200 README.md)"
for v in 0 ""; do
  DS4_HC_MIX_TPB=$v timeout 60 ds4 logits -m $W/s4.gguf --backend cuda --prompt "$p" --out $W/hc$v.npy > /dev/null 2>> $OUT/hc.log
done
cmp -s $W/hc0.npy $W/hc.npy && echo "prompt logits bit-identical with and without" || echo "prompt logits DIFFER (FAIL)"
timeout 120 ds4-engine-check ops $W/s4.gguf --tiny 0 --flash-layers 4 --tokens 40 --chunk 40 --act-q8 > $OUT/ops_s4c40.log 2>&1; tail -1 $OUT/ops_s4c40.log
timeout 120 ds4-engine-check joint $W/s4.gguf --tiny 0 --tokens 40 --chunk 49 --seqs 8 --act-q8 --gpu-only > $OUT/joint.log 2>&1; grep -E "PASSED|FAIL|rror|jointly" $OUT/joint.log | head -4 | cut -c1-250
for v in 0 "" 0 ""; do
  DS4_HC_MIX_TPB=$v timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 64,114 --decode 1 --warmup 64 > $OUT/pf.log 2>&1
  echo "[DS4_HC_MIX_TPB=$v] $(grep -E '^(64|114),' $OUT/pf.log | tr '\n' ' ' | cut -c1-220)"
done
timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 64 --decode 1 --profile-prefill 49 > $OUT/pp.log 2>&1; grep -E "profile prefill" $OUT/pp.log; grep -A10 "by kernel" $OUT/pp.log | head -10
echo "== batched step A/B, --synthetic q2 L=$L --batch 1,8"; date +%T
for D in "" "-DDS4_FINISH_SPREAD=0" "$R4" "" "-DDS4_FINISH_SPREAD=0" "$R4"; do
  DS4_GEMV_DEFINES="$D" timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 512 --decode 16 --batch 1,8 > $OUT/ab.log 2>&1
  echo "[$D] $(grep -E '^batch ' $OUT/ab.log | sed -E 's/.*step ([0-9.]+) ms.*aggregate ([0-9.]+) tok.*/\1 ms \2 tok\/s/' | tr '\n' '|')"
done
for D in "" "$R4"; do
  DS4_GEMV_DEFINES="$D" timeout 100 ds4-bench --synthetic q2 --layers $L --frontiers 512 --decode 8 --batch 8 --profile 2 > "$OUT/prof${D:+_r4}.log" 2>&1
  echo "-- profile [$D]:"; grep -E "^profile batch" "$OUT/prof${D:+_r4}.log"; grep -A16 "by kernel" "$OUT/prof${D:+_r4}.log" | head -16
done
date +%T
timeout 100 ds4-convert synthetic --quiet --layout q2 --layers $L --sparse-experts --vocab-gguf $V $W/q.gguf > /dev/null
. tools/device/server-lib.sh
echo "== server A/B (--parallel 8): turn-snapshot skip, four-token HC blocks"; date +%T
n=0
for cfg in "0 0" "1 " "1 0" "0 0" "1 "; do
  set -- $cfg; sk=$1; tpb=${2:-}
  n=$((n+1))
  DS4_SKIP_PUSHED_OUT_TURNS=$sk DS4_HC_MIX_TPB=$tpb ds4-server -m $W/q.gguf -c 4096 --backend cuda --parallel 8 --port 8090 > $OUT/srv$n.log 2>&1 &
  sp=$!; echo -n "-- DS4_SKIP_PUSHED_OUT_TURNS=$sk DS4_HC_MIX_TPB=$tpb "; up
  [ $n -le 2 ] && timeout 40 python3 $TP http://127.0.0.1:8090 1 64
  timeout 40 python3 $TP http://127.0.0.1:8090 8 64; echo "   8-client means: $(sumlog $OUT/srv$n.log 8)"
  timeout 40 python3 $TP http://127.0.0.1:8090 8 64 --no-think; echo "   no-think means: $(sumlog $OUT/srv$n.log 8)"
  python3 -c "import json,urllib.request;print('   skipped', json.load(urllib.request.urlopen('http://127.0.0.1:8090/health'))['turn_snapshots_skipped'])" 2>&1 | tail -1
  kill $sp; wait $sp 2>/dev/null
done
echo "== CLI path"; date +%T
timeout 100 ds4-bench -m $W/q.gguf --frontiers 2009 --decode 64 > $OUT/ub.log 2>&1; grep -E "^2009|decode|limit" $OUT/ub.log | head -4 | cut -c1-200
timeout 100 ds4-bench --e2e -m $W/q.gguf --backend cuda --ctx 4096 -n 100 --prompt-words 2000 --temp 0 > $OUT/ue.log 2>&1; tail -2 $OUT/ue.log | cut -c1-200
date +%T
