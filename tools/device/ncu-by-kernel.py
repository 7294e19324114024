#!/usr/bin/env python3
"""Sums `ncu --csv --metrics gpu__time_duration.sum` output per kernel name.

Usage: ncu-by-kernel.py NCU.csv [TOP]

Prints the total device time, then the TOP (default 30) kernels by time with their share
and launch count. cuBLAS kernels appear under their own names (the engine's `--profile`
event timing cannot see them), so this is the attribution to use for the prefill GEMMs.
"""
import collections
import csv
import sys


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    header = None
    agg = collections.defaultdict(lambda: [0.0, 0])
    with open(sys.argv[1], newline="") as f:
        for row in csv.reader(f):
            if header is None:
                if "Kernel Name" in row and "Metric Value" in row:
                    header = row
                continue
            if len(row) != len(header):
                continue
            d = dict(zip(header, row))
            if d.get("Metric Name") != "gpu__time_duration.sum":
                continue
            try:
                v = float(d["Metric Value"].replace(",", ""))
            except ValueError:
                continue
            scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}
            us = v * scale.get(d.get("Metric Unit", "nsecond"), 1e-3)
            name = d["Kernel Name"][:80]
            agg[name][0] += us
            agg[name][1] += 1
    if not agg:
        print("no gpu__time_duration.sum rows found")
        return 1
    total = sum(a[0] for a in agg.values())
    launches = sum(a[1] for a in agg.values())
    print(f"total {total / 1000:.2f} ms of device time over {launches} launches")
    for name, (us, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{us / 1000:9.3f} ms {100 * us / total:5.1f} % {n:6d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
