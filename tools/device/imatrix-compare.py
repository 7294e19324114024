#!/usr/bin/env python3
"""Compare two importance matrices (llama.cpp's legacy .dat, as `ds4 imatrix` writes them).

    imatrix-compare.py A.dat B.dat [--bound X]

Prints, per entry, the largest difference relative to that entry's largest value in A, and
overall: the worst such difference, the share of values that differ by more than 1e-3 of
their entry's largest, and PASS/FAIL against --bound (default 1e-3). Entries (names,
ncall, lengths) must be the same in both files. The device step `imatrix` of
tools/device/h200-checks.sh uses it on a CUDA and a CPU collection of the same text; the
forward passes differ by summation order (and TF32 prefill GEMMs without --quality), and an
expert chosen differently for one token in one layer shows as a large difference in that
expert's vectors only, so the share is printed beside the maximum.
"""
import struct
import sys


def read(path):
    b = open(path, "rb").read()
    at = 0

    def i32():
        nonlocal at
        if at + 4 > len(b):
            raise SystemExit(f"{path}: truncated at byte {at}")
        (v,) = struct.unpack_from("<i", b, at)
        at += 4
        return v

    n = i32()
    if n < 0 or n > 1 << 20:
        raise SystemExit(f"{path}: entry count {n} is not plausible")
    out = {}
    for _ in range(n):
        ln = i32()
        if ln <= 0 or at + ln > len(b):
            raise SystemExit(f"{path}: bad name length {ln} at byte {at}")
        name = b[at:at + ln].decode("utf-8", "replace")
        at += ln
        ncall = i32()
        nval = i32()
        if nval < 0 or at + 4 * nval > len(b):
            raise SystemExit(f"{path}: {name}: bad value count {nval}")
        vals = struct.unpack_from(f"<{nval}f", b, at)
        at += 4 * nval
        out[name] = (ncall, vals)
    return out


def main():
    args = sys.argv[1:]
    bound = 1e-3
    if "--bound" in args:
        i = args.index("--bound")
        bound = float(args[i + 1])
        del args[i:i + 2]
    if len(args) != 2:
        raise SystemExit(__doc__)
    a, b = read(args[0]), read(args[1])
    if sorted(a) != sorted(b):
        only = sorted(set(a) ^ set(b))[:5]
        print(f"FAIL: the entries differ ({len(a)} vs {len(b)}; e.g. {only})")
        return 1
    worst, worst_name, over, total = 0.0, "", 0, 0
    for name in sorted(a):
        (na, va), (nb, vb) = a[name], b[name]
        if na != nb or len(va) != len(vb):
            print(f"FAIL: {name}: ncall {na} vs {nb}, {len(va)} vs {len(vb)} values")
            return 1
        scale = max((abs(v) for v in va), default=0.0)
        if scale == 0.0:
            scale = 1.0
        d = 0.0
        for x, y in zip(va, vb):
            r = abs(x - y) / scale
            d = max(d, r)
            over += r > 1e-3
        total += len(va)
        print(f"{name}: max diff {d:.3e} of the entry's largest {scale:.4g}")
        if d >= worst:
            worst, worst_name = d, name
    verdict = "PASS" if worst <= bound else "FAIL"
    print(f"{verdict}: {len(a)} entries, {total} values; max relative difference {worst:.3e} "
          f"({worst_name}), {over} values ({100.0 * over / max(total, 1):.3f} %) above 1e-3; bound {bound:g}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
