#!/usr/bin/env bash
# Quantization quality of ds4-rs's q2/q4 encoders against ds4's own quantizer (issue 54 item 4).
#
# ds4 (github.com/antirez/ds4) is fetched and built here, into a scratch directory, at run
# time: nothing of it is committed to this repository or linked into a product.
#
#   tools/quantcmp/run.sh                      # shallow-clones antirez/ds4 into $WORK
#   DS4_SRC=/path/to/ds4 tools/quantcmp/run.sh # a checkout you already have
#   DS4_GIT=/path/to/ds4.git tools/quantcmp/run.sh [REV]  # a bare/mirror repository (default HEAD)
#
# Environment: WORK (scratch, default /tmp/quantcmp), CARGO_TARGET_DIR (as usual), DS4_BIN (a
# built `ds4` for the collected imatrix; default: cargo builds ds4-cli). Extra arguments after
# the optional REV go to the comparison (e.g. --synthetic-rows 2048). Exit status 1 when ours
# is more than 2 % above ds4's RMSE on any class (--max-excess-pct).
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-/tmp/quantcmp}
REV=HEAD
if [[ $# -gt 0 && $1 != -* ]]; then REV=$1; shift; fi
mkdir -p "$WORK/ds4/gguf-tools"
SRC=$WORK/ds4/gguf-tools
FILES=(deepseek4-quantize.c quants.c quants.h)
if [[ -n ${DS4_SRC:-} ]]; then
  for f in "${FILES[@]}"; do cp "$DS4_SRC/gguf-tools/$f" "$SRC/$f"; done
  echo "ds4 source: $DS4_SRC ($(git -C "$DS4_SRC" rev-parse HEAD 2>/dev/null || echo 'not a git checkout'))"
else
  if [[ -z ${DS4_GIT:-} ]]; then
    DS4_GIT=$WORK/ds4.git
    [[ -d $DS4_GIT ]] || git clone --bare --depth 1 --filter=blob:none \
      https://github.com/antirez/ds4 "$DS4_GIT"
  fi
  for f in "${FILES[@]}"; do git --git-dir="$DS4_GIT" show "$REV:gguf-tools/$f" >"$SRC/$f"; done
  echo "ds4 source: $DS4_GIT at $(git --git-dir="$DS4_GIT" rev-parse "$REV")"
fi
${CC:-cc} -O2 -std=c11 -D_GNU_SOURCE -w -I"$SRC" -o "$WORK/ds4q_driver" \
  tools/quantcmp/ds4q_driver.c "$SRC/quants.c" -lm -pthread

TGT=${CARGO_TARGET_DIR:-target}
if [[ -z ${DS4_BIN:-} ]]; then
  cargo build --release -q -p ds4-cli --bin ds4
  DS4_BIN=$TGT/release/ds4
fi
MODEL=tests/fixtures/kjv/ds4-kjv.gguf
"$DS4_BIN" imatrix -m "$MODEL" -f tests/fixtures/kjv/heldout.txt -o "$WORK/kjv-imatrix.dat" \
  --chunks 8 --threads 1 2>&1 | tail -1
cargo build --release -q -p ds4-convert --example quantcmp
"$TGT/release/examples/quantcmp" --driver "$WORK/ds4q_driver" --model "$MODEL" \
  --imatrix "$WORK/kjv-imatrix.dat" --work "$WORK" "$@" 2> >(grep -v '^loaded imatrix' >&2)
