#!/usr/bin/env bash
# Downloads the client SDKs the server tests pin (tools/server-sdk-tests/requirements.txt) and
# their dependencies as wheels into .dev/wh (ignored by git), for CPython 3.10-3.13 on x86-64
# Linux, so a GPU machine without network can install them (`pip install --no-index
# --find-links .dev/wh`; tools/device/h200-checks.sh does in its `server` step). Carry `.dev`
# with the run (it counts against the 64 MiB working-tree limit: ≈ 17 MB).
set -euo pipefail
R="$(cd "$(dirname "$0")/../.." && pwd)"
mkdir -p "$R/.dev/wh"
for v in 310 311 312 313; do
    python3 -m pip download -q --only-binary=:all: --implementation cp --python-version "$v" \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_28_x86_64 -d "$R/.dev/wh" \
        -r "$R/tools/server-sdk-tests/requirements.txt"
done
du -sh "$R/.dev/wh"
