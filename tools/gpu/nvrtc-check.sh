#!/usr/bin/env bash
# Compile the kernel modules (kernels/gemv.cu, ops.cu and tiles.cu; the first two include
# every other kernels/*.cu) with NVRTC for real NVIDIA architectures (default sm_80 and
# sm_90), through the engine's own run-time compile function and options
# (`ds4-gpu-check compile`), on a machine without a GPU or a CUDA install: NVRTC comes from
# the pinned PyPI wheel in nvrtc-requirements.txt. Any compile error fails the script.
#
# Usage: tools/gpu/nvrtc-check.sh [ARCH,ARCH...]
# Env:   NVRTC_VENV (reuse this venv; default: a fresh one in a temp dir),
#        NVRTC_LIB_DIR (use the libnvrtc in this directory; no venv, no PyPI),
#        CARGO_TARGET_DIR (default <repo>/target), DS4_GPU_CHECK_BIN (skip the cargo build).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
archs="${1:-sm_80,sm_90}"
work="$(mktemp -d "${TMPDIR:-/tmp}/ds4-nvrtc-check.XXXXXX")"
trap 'rm -rf "$work"' EXIT

lib_dir="${NVRTC_LIB_DIR:-}"
if [ -z "$lib_dir" ]; then
    venv="${NVRTC_VENV:-$work/venv}"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv"
    fi
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$here/nvrtc-requirements.txt"
    # The wheel puts the library under site-packages/nvidia/<cuXX or cuda_nvrtc>/lib.
    lib="$(find "$venv" -name 'libnvrtc.so.*' ! -name '*builtins*' | sort | head -n 1)"
    if [ -z "$lib" ]; then
        echo "nvrtc-check: no libnvrtc.so.* in the installed wheel" >&2
        exit 1
    fi
    lib_dir="$(dirname "$lib")"
else
    lib="$(find "$lib_dir" -maxdepth 1 -name 'libnvrtc.so*' ! -name '*builtins*' | sort | head -n 1)"
    [ -n "$lib" ] || { echo "nvrtc-check: no libnvrtc.so* in $lib_dir" >&2; exit 1; }
fi
# The CUDA runtime loader (cudarc) looks for libnvrtc.so and a few versioned names
# (.so.12, ...); a CUDA 13 wheel ships only libnvrtc.so.13, so give it the plain name.
mkdir -p "$work/lib"
ln -s "$lib" "$work/lib/libnvrtc.so"
echo "nvrtc-check: NVRTC from $lib_dir"

bin="${DS4_GPU_CHECK_BIN:-}"
if [ -z "$bin" ]; then
    (cd "$root" && cargo build -q --release --locked -p ds4-gpu --bin ds4-gpu-check)
    bin="${CARGO_TARGET_DIR:-$root/target}/release/ds4-gpu-check"
fi
LD_LIBRARY_PATH="$work/lib:$lib_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$bin" compile --arch "$archs"
