#!/usr/bin/env python3
"""Registers, spills and shared memory of every kernel in a kernels/*.cu file, as ptxas
reports them, without a GPU: compiles the file with NVRTC (the options the engine uses,
plus --ptxas-options=-v) through ctypes and prints the ptxas lines of the log.

Usage: tools/gpu/ptxas-info.py LIBNVRTC FILE.cu [ARCH] [FILTER]
  LIBNVRTC  path of libnvrtc.so.* (e.g. from the PyPI wheel tools/gpu/nvrtc-check.sh installs)
  ARCH      default sm_90
  FILTER    print only kernels whose mangled or plain name contains it
"""
import ctypes
import os
import re
import sys


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        sys.exit(2)
    lib = ctypes.CDLL(sys.argv[1])
    path = sys.argv[2]
    arch = sys.argv[3] if len(sys.argv) > 3 else "sm_90"
    filt = sys.argv[4] if len(sys.argv) > 4 else None
    kdir = os.path.dirname(os.path.abspath(path))
    src = open(path, "rb").read()
    names = sorted(set(re.findall(rb'#include "([^"]+)"', src)))
    headers = [open(os.path.join(kdir, n.decode()), "rb").read() for n in names]
    prog = ctypes.c_void_p()
    arr = ctypes.c_char_p * max(1, len(names))
    r = lib.nvrtcCreateProgram(ctypes.byref(prog), src, os.path.basename(path).encode(),
                               len(names), arr(*headers), arr(*names))
    if r:
        sys.exit(f"nvrtcCreateProgram: {r}")
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"--ptxas-options=-v"]
    r = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace")
    if r:
        print(text)
        sys.exit(f"nvrtcCompileProgram: {r}")
    current = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = m.group(1)
        if current and (filt is None or filt in current) and (
                "Used" in line or "spill" in line or "Compiling entry" in line):
            print(line.strip())


if __name__ == "__main__":
    main()
