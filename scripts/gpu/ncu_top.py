#!/usr/bin/env python3
"""Sums an `ncu --csv --metrics gpu__time_duration.sum` log by kernel name
and prints the kernels that take the most device time (ms), for
`run.sh kernels`' Nsight Compute pass over one bench step.

    python3 scripts/gpu/ncu_top.py ncu.csv [TOP]
"""
import csv
import collections
import sys


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    rows = []
    with open(path) as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            unit = r.get("Metric Unit", "nsecond")
            v = float(r["Metric Value"].replace(",", ""))
            scale = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}.get(unit, 1e-6)
            rows.append((r["Kernel Name"], v * scale))
    total = sum(t for _, t in rows)
    by = collections.defaultdict(lambda: [0, 0.0])
    for name, t in rows:
        by[name][0] += 1
        by[name][1] += t
    print(f"{len(rows)} kernels, {total:.2f} ms of device time")
    print("| kernel | launches | ms | share |\n|---|---:|---:|---:|")
    for name, (n, t) in sorted(by.items(), key=lambda x: -x[1][1])[:top]:
        print(f"| `{name[:100]}` | {n} | {t:.3f} | {100 * t / total:.1f}% |")


if __name__ == "__main__":
    main()
