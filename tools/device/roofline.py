#!/usr/bin/env python3
"""The decode roofline: bytes moved and time per kernel of one decoded token, from ncu.

Usage: roofline.py NCU.csv LAUNCHES COPY_GBPS [LAYERS_PROFILED LAYERS_REAL]

NCU.csv is `ncu --csv --page raw --metrics
gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum` of a bench run whose last
LAUNCHES launches are one decoded token (ds4-bench prints launches per token). COPY_GBPS is
the device-to-device copy bandwidth the bench measured (read + write bytes per second).

Prints one row per kernel: launches, device µs, MB moved (DRAM read + write), GB/s and that
as a share of the copy bandwidth, sorted by time; then the totals. With LAYERS_PROFILED and
LAYERS_REAL (a model of few layers profiled for one of many), launches that repeat per layer
(more than one launch) are scaled by LAYERS_REAL / LAYERS_PROFILED so the totals estimate the
full model's token; launches that occur once (the output head, the embedding) are not.
ncu replays each launch alone with cold caches, so the times exclude launch gaps: the
difference to the bench's measured token time is the device's idle time plus overlap.
"""
import collections
import csv
import sys

METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum")
SCALE = {
    "nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,
    "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6,
    "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9,
    "B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9,
}


def rows(path):
    """Launches in order: (kernel name, {metric: value in µs or bytes})."""
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    reader = csv.reader(lines)
    header = next(reader)
    units = next(reader)
    idx = {m: header.index(m) for m in METRICS if m in header}
    if len(idx) != len(METRICS):
        raise SystemExit(f"{path}: missing metrics {set(METRICS) - set(idx)}")
    name_i = header.index("Kernel Name")
    out = []
    for r in reader:
        if len(r) != len(header):
            continue
        vals = {}
        for m, i in idx.items():
            try:
                vals[m] = float(r[i].replace(",", "")) * SCALE.get(units[i], 1.0)
            except ValueError:
                vals[m] = 0.0
        out.append((r[name_i].split("(")[0][:60], vals))
    for m, i in idx.items():
        if units[i] not in SCALE:
            raise SystemExit(f"{path}: unknown unit {units[i]!r} of {m}")
    return out


def main() -> int:
    if len(sys.argv) < 4:
        print(__doc__)
        return 2
    launches = int(sys.argv[2])
    copy = float(sys.argv[3]) * 1e9
    scale_layers = 1.0
    if len(sys.argv) >= 6:
        scale_layers = float(sys.argv[5]) / float(sys.argv[4])
    all_rows = rows(sys.argv[1])
    token = all_rows[-launches:]
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for name, v in token:
        a = agg[name]
        a[0] += 1
        a[1] += v["gpu__time_duration.sum"]
        a[2] += v["dram__bytes_read.sum"] + v["dram__bytes_write.sum"]
    print(f"{len(token)} launches of one token (of {len(all_rows)} profiled); copy bandwidth "
          f"{copy / 1e9:.0f} GB/s; per-layer launches scaled x{scale_layers:.2f}")
    print("| kernel | launches | µs | MB | GB/s | % of copy |")
    print("|---|---:|---:|---:|---:|---:|")
    tot_us = tot_b = 0.0
    tot_n = 0
    for name, (n, us, b) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        k = scale_layers if n > 1 else 1.0
        n2, us2, b2 = n * k, us * k, b * k
        tot_n += n2
        tot_us += us2
        tot_b += b2
        gbs = b / (us * 1e-6) / 1e9 if us > 0 else 0.0
        print(f"| {name} | {n2:.0f} | {us2:.0f} | {b2 / 1e6:.1f} | {gbs:.0f} | "
              f"{100 * gbs * 1e9 / copy:.0f} % |")
    gbs = tot_b / (tot_us * 1e-6) / 1e9 if tot_us > 0 else 0.0
    print(f"| **total** | {tot_n:.0f} | {tot_us:.0f} | {tot_b / 1e6:.1f} | {gbs:.0f} | "
          f"{100 * gbs * 1e9 / copy:.0f} % |")
    print(f"bytes at copy bandwidth: {tot_b / copy * 1e6:.0f} µs; kernels back to back: "
          f"{tot_us:.0f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
