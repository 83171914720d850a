#!/usr/bin/env python3
"""Markdown table of criterion medians (and mean, and the median's 95% CI) from the last run.

Usage: python3 benches/criterion_table.py [${CARGO_TARGET_DIR:-target}/criterion]
Reads every <bench>/.../new/estimates.json and benchmark.json written by `cargo bench`.
"""
import json
import os
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.environ.get("CARGO_TARGET_DIR", "target"), "criterion")


def fmt(ns):
    for unit, div in (("s", 1e9), ("ms", 1e6), ("µs", 1e3), ("ns", 1.0)):
        if ns >= div:
            return f"{ns / div:.3g} {unit}"
    return f"{ns * 1e3:.3g} ps"


rows = []
for dirpath, _, files in os.walk(root):
    if os.path.basename(dirpath) != "new" or "estimates.json" not in files:
        continue
    est = json.load(open(os.path.join(dirpath, "estimates.json")))
    meta = json.load(open(os.path.join(dirpath, "benchmark.json")))
    med = est["median"]
    per = ""
    thr = meta.get("throughput") or {}
    if "Elements" in thr and thr["Elements"] > 1:
        per = fmt(med["point_estimate"] / thr["Elements"])
    rows.append((meta["full_id"], med, est["mean"]["point_estimate"], per))

print("| bench | median | median 95% CI | mean | median per element |")
print("|---|---|---|---|---|")
for name, med, mean, per in sorted(rows):
    ci = med["confidence_interval"]
    print(f"| {name} | {fmt(med['point_estimate'])} | {fmt(ci['lower_bound'])} – "
          f"{fmt(ci['upper_bound'])} | {fmt(mean)} | {per} |")
