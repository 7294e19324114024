#!/usr/bin/env bash
# Static instruction counts of a kernel's loops on a machine without a GPU (by default the
# prefill tile kernels'): compile the kernels with NVRTC for ARCH (default sm_90) through the engine's own
# compile function, disassemble it with cuobjdump (both from PyPI wheels), and print each
# tensor-core loop's instruction mix (tools/gpu/sass-loops.py), once as the sources are and
# once with the -D options given (build flags such as -DDS4_EMU_ONE_TABLE; the tunables are
# constants, so to read a variant edit the constant in a scratch copy), for before/after reading.
#
# Usage: tools/gpu/sass-loops.sh [ARCH] [-DNAME=VALUE ...]
# Env:   NVRTC_VENV (reuse this venv; default: a fresh one in a temp dir), FUNC (default
#        ds4_mm_tiles), FILE (the kernel file: tiles, gemv or ops; default tiles), ALL=1
#        (every loop, not only the tensor-core ones: e.g. FILE=gemv
#        FUNC=ds4_gemv_flat_q_iq2_xxs ALL=1 for the GEMVs, docs/gpu.md §32).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
arch="${1:-sm_90}"
shift || true
work="$(mktemp -d "${TMPDIR:-/tmp}/ds4-sass.XXXXXX")"
trap 'rm -rf "$work"' EXIT
venv="${NVRTC_VENV:-$work/venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check \
    -r "$here/nvrtc-requirements.txt" nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
lib="$(find "$venv" -name 'libnvrtc.so.*' ! -name '*builtins*' | sort | head -n 1)"
cuobjdump="$(find "$venv" -name cuobjdump -type f | head -n 1)"
# cuobjdump -sass runs nvdisasm from the PATH.
export PATH="$(dirname "$(find "$venv" -name nvdisasm -type f | head -n 1)"):$PATH"
mkdir -p "$work/lib"
ln -s "$lib" "$work/lib/libnvrtc.so"
(cd "$root" && cargo build -q --release --locked -p ds4-gpu --bin ds4-gpu-check)
bin="${CARGO_TARGET_DIR:-$root/target}/release/ds4-gpu-check"
run() {
    local out="$work/cubin$1"
    shift
    LD_LIBRARY_PATH="$work/lib:$(dirname "$lib")" "$bin" compile --arch "$arch" --out "$out" "$@" >/dev/null
    "$cuobjdump" -sass "$out/${FILE:-tiles}.$arch.cubin" > "$out.sass"
    python3 "$here/sass-loops.py" "$out.sass" "${FUNC:-ds4_mm_tiles}" ${ALL:+--all}
}
echo "== defaults"
run 0
if [ $# -gt 0 ]; then
    echo "== $*"
    run 1 "$@"
fi
