#!/usr/bin/env python3
"""The GPU verdict: the targets of the GPU issues, each PASS or FAIL, from
the results `run.sh verdict` wrote under OUT (bench/, bench-bf16/,
bench-batches-bf16/, torch-eager/, torch-sdpa/, torch-sdpa-bf16/
results.csv, cuda-tests.txt, cuda-batches.txt).

    python3 gpu-package/verdict.py OUT     # prints the table, writes OUT/verdict.md
"""

import csv
import os
import re
import sys


def rows(path):
    try:
        with open(path) as f:
            return {r["policy"]: r for r in csv.DictReader(f)}
    except OSError:
        return {}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "gpu-results"
    bench = rows(os.path.join(out, "bench", "results.csv"))
    eager = rows(os.path.join(out, "torch-eager", "results.csv"))
    sdpa = rows(os.path.join(out, "torch-sdpa", "results.csv"))
    bench16 = rows(os.path.join(out, "bench-bf16", "results.csv"))
    sdpa16 = rows(os.path.join(out, "torch-sdpa-bf16", "results.csv"))
    batches16 = rows(os.path.join(out, "bench-batches-bf16", "results.csv"))
    lines = []

    def verdict(target, measured, ok):
        state = "n/a" if ok is None else ("PASS" if ok else "FAIL")
        lines.append(f"| {target} | {measured} | {state} |")

    def step(r, p):
        return float(r[p]["median_step_s"]) if p in r else None

    def ratio(a, b):
        return None if a is None or b is None else a / b

    def show(x, unit="x"):
        return "missing" if x is None else f"{x:.3f}{unit}"

    # Issue 33: the replay check at GPU speed.
    plain = step(bench, "none")
    for policy, limit_plain in [("full", 1.30), ("selective", None), ("budget=0.5", None)]:
        checked, unchecked = step(bench, policy), step(bench, f"{policy} (unchecked)")
        r = ratio(checked, unchecked)
        verdict(f"{policy}: check on <= 1.03x unchecked", show(r), None if r is None else r <= 1.03)
        if limit_plain:
            r = ratio(checked, plain)
            verdict(f"{policy}: check on <= {limit_plain:.2f}x plain", show(r),
                    None if r is None else r <= limit_plain)
    # The same in bf16, with the one-value checksum kernels (the default)
    # and with the batch kernels (opt-in until their CUDA test passes).
    for name, r in [("bf16", bench16), ("bf16, checksum batches", batches16)]:
        ratio_ = ratio(step(r, "full"), step(r, "full (unchecked)"))
        verdict(f"{name} full: check on <= 1.03x unchecked", show(ratio_),
                None if ratio_ is None else ratio_ <= 1.03)
    try:
        text = open(os.path.join(out, "cuda-batches.txt")).read()
        ok = re.search(r"test result: ok\. 1 passed", text) is not None
        verdict("checksum batches: their CUDA test passes (then make them the default)",
                "passed" if ok else "failed", ok)
    except OSError:
        verdict("checksum batches: their CUDA test passes", "missing", None)
    grads = [float(r["grad_max_rel_diff"]) for r in bench.values()]
    verdict("gradients of every policy equal plain candle's (max rel. diff)",
            f"{max(grads):.1e}" if grads else "missing", None if not grads else max(grads) <= 1e-5)
    try:
        text = open(os.path.join(out, "cuda-tests.txt")).read()
        m = re.search(r"test result: \w+\. (\d+) passed; (\d+) failed", text)
        failed = re.findall(r"^test (\S+) \.\.\. FAILED", text, re.M)
        measured = f"{m.group(1)} passed, {m.group(2)} failed" if m else "did not finish"
        measured += (": " + ", ".join(failed)) if failed else ""
        verdict("every CUDA test passes (kernels bitwise, pool bytes exact)", measured,
                bool(m) and m.group(2) == "0")
    except OSError:
        verdict("every CUDA test passes", "missing", None)

    # Issue 34: the fused ops against PyTorch (same card, same shape), in
    # f32 and in bf16.
    for dtype, mine, theirs in [("f32", bench, sdpa), ("bf16", bench16, sdpa16)]:
        plain_d = step(mine, "none")
        r = ratio(plain_d, step(theirs, "none"))
        verdict(f"{dtype}: plain step <= 1.2x PyTorch SDPA's", show(r), None if r is None else r <= 1.2)
        full_peak = int(mine["full"]["peak_bytes"]) if "full" in mine else None
        torch_peak = int(theirs["full"]["peak_bytes"]) if "full" in theirs else None
        r = ratio(full_peak, torch_peak)
        verdict(f"{dtype}: full-recompute peak <= 1.0x PyTorch SDPA + full AC's", show(r),
                None if r is None else r <= 1.0)
        r = ratio(step(mine, "full (unchecked)"), plain_d)
        verdict(f"{dtype}: full recompute (unchecked) <= 1.30x remat plain", show(r),
                None if r is None else r <= 1.30)

    table = ["| target | measured | verdict |", "|---|---:|---|"] + lines
    context = []
    for name, r in [("remat", bench), ("PyTorch eager", eager), ("PyTorch SDPA", sdpa),
                    ("remat bf16", bench16), ("remat bf16, checksum batches", batches16),
                    ("PyTorch SDPA bf16", sdpa16)]:
        for p, row in r.items():
            context.append(f"| {name} | {p} | {float(row['median_step_s']) * 1e3:.1f} | "
                           f"{int(row['peak_bytes']) / (1 << 20):.1f} |")
    text = "\n".join(table) + "\n\n| who | policy | step (ms) | peak (MiB) |\n|---|---|---:|---:|\n" + "\n".join(context) + "\n"
    with open(os.path.join(out, "verdict.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
