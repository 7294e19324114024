#!/usr/bin/env bash
# Compile every kernels/*.cu with Debian's hipcc (ROCm 5.2, clang 15) for gfx1030, from
# the same files the CUDA and ROCm runtimes compile: the module roots (gemv.cu, ops.cu,
# tiles.cu: what hiprtc compiles) and, each on its own, the op-family files they include. A compile error fails the script.
#
# Usage: tools/gpu/hipcc-check.sh [--no-install] [ARCH...]   (default arch: gfx1030)
# Installs `hipcc` and `libamdhip64-dev` with apt-get unless --no-install is given or
# hipcc is already on PATH. Debian 12's device libraries cover gfx1030 (RDNA2, wave32),
# not gfx1100/gfx1151; see docs/gpu.md.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
install=1
archs=()
for a in "$@"; do
    case "$a" in
        --no-install) install=0 ;;
        *) archs+=("$a") ;;
    esac
done
[ ${#archs[@]} -eq 0 ] && archs=(gfx1030)

if ! command -v hipcc >/dev/null 2>&1; then
    if [ "$install" = 1 ]; then
        echo "hipcc-check: installing hipcc and libamdhip64-dev with apt-get"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q >/dev/null
        apt-get install -y -q --no-install-recommends hipcc libamdhip64-dev >/dev/null
    else
        echo "hipcc-check: hipcc not found and --no-install given" >&2
        exit 1
    fi
fi

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
status=0
shopt -s nullglob
files=("$root"/kernels/*.cu)
if [ ${#files[@]} -eq 0 ]; then
    echo "hipcc-check: no kernels/*.cu found" >&2
    exit 1
fi
for arch in "${archs[@]}"; do
    for f in "${files[@]}"; do
        name="$(basename "$f" .cu)"
        # -x hip: the files are CUDA-dialect .cu; -Werror keeps the HIP path warning-free.
        if hipcc -x hip --offload-arch="$arch" -O3 -std=c++17 -Werror -I"$root/kernels" \
            -c "$f" -o "$out/$name-$arch.o" 2>"$out/$name-$arch.log"; then
            echo "hipcc-check: ok   $arch $(basename "$f") ($(stat -c %s "$out/$name-$arch.o") bytes)"
        else
            echo "hipcc-check: FAIL $arch $(basename "$f")"
            cat "$out/$name-$arch.log"
            status=1
        fi
    done
done
exit $status
