#!/usr/bin/env python3
"""Summarises one perf/sweep_stall.sh variant and lines its slow lookups up with sweep passes.

Usage: sweep_attribution.py OUT VARIANT ENTRIES_BEFORE ENTRIES_AFTER LOAD_BEFORE LOAD_AFTER

Reads from OUT: lg-VARIANT.json (loadgen's report), slow-VARIANT.txt (loadgen --slow-log: every
lookup over 1 ms with the wall-clock time it was due), scrape-VARIANT.txt (the server's
inferencecache_core_sweep_* series, one scrape a second) and slices-VARIANT.txt (the
maintenance slice histograms at the end).

A slow lookup is *during a pass* when [due, due + latency] overlaps a sweep pass's window
[started, started + duration]. A lookup can only have waited behind the sweep if it was during
a pass; and it waited behind at most one slice, so the slice histograms bound that wait. The
rate of slow lookups outside passes is this host's own noise at the same moment.
"""
import json
import re
import sys


def passes_from_scrape(path):
    """(number, started, duration_s, slices, longest_ms, longest_cpu_ms) per completed pass."""
    out, seen, prev_slices = [], None, 0
    for line in open(path):
        m = dict(re.findall(r"(inferencecache_core_sweep\w*)\{[^}]*\} (\S+)", line))
        n = m.get("inferencecache_core_sweeps_total")
        if n is None or float(n) == 0 or n == seen:
            continue
        seen = n
        slices = int(float(m["inferencecache_core_sweep_slices_total"]))
        out.append((
            int(float(n)),
            float(m.get("inferencecache_core_sweep_last_started_seconds", "nan")),
            float(m["inferencecache_core_sweep_last_duration_seconds"]),
            slices - prev_slices,
            float(m["inferencecache_core_sweep_last_max_slice_seconds"]) * 1e3,
            float(m.get("inferencecache_core_sweep_last_max_slice_cpu_seconds", "nan")) * 1e3,
        ))
        prev_slices = slices
    return out


def slow_lookups(path):
    """(due_s, latency_s, failed, start_lag_s) per lookup over the threshold; the start lag (the
    client's own lateness before the call began) is 0 in logs of older loadgens."""
    out = []
    for line in open(path):
        if line.startswith("#"):
            continue
        due_us, lat_us, outcome, *lag = line.split()
        lag_s = int(lag[0]) / 1e6 if lag else 0.0
        out.append((int(due_us) / 1e6, int(lat_us) / 1e6, outcome == "failed", lag_s))
    return out


def after_start(slow, threshold_s=1e-3):
    """The slow lookups still over `threshold_s` once the client's start lag is taken off: the
    ones that could have waited on the server (or on the way back)."""
    return [x for x in slow if x[1] - x[3] > threshold_s]


def slice_histograms(path):
    """{(family, work): [(le, cumulative count)]} of the sweep's slice histograms."""
    out = {}
    for line in open(path):
        m = re.match(r'(\w+)_bucket\{core="\d+",work="(\w+)",le="([^"]+)"\} (\S+)', line)
        if m:
            fam, work, le, n = m.groups()
            out.setdefault((fam, work), []).append((float(le), float(n)))
    return out


def main():
    out_dir, v, e0, e1, l0, l1 = sys.argv[1:7]
    r = json.load(open(f"{out_dir}/lg-{v}.json"))
    lk = r["rpcs"]["LookupRoute"]
    print(f"{v:>8}: lookups={lk['count']} errors={lk['errors']} p50={lk['p50_ms']:.3f}ms "
          f"p99={lk['p99_ms']:.3f}ms p99.9={lk['p999_ms']:.3f}ms max={lk['max_ms']:.3f}ms "
          f"entries {e0} -> {e1} load1 {l0} -> {l1}")
    passes = passes_from_scrape(f"{out_dir}/scrape-{v}.txt")
    for n, started, dur, slices, longest, longest_cpu in passes:
        print(f"          sweep pass #{n}: {dur * 1e3:.1f} ms wall in {slices} slices, "
              f"longest slice {longest:.3f} ms wall / {longest_cpu:.3f} ms CPU")
    windows = [(s, s + d) for _, s, d, *_ in passes if s == s]  # skip NaN (older servers)
    slow = slow_lookups(f"{out_dir}/slow-{v}.txt")
    during = [x for x in slow if any(x[0] <= b and x[0] + x[1] >= a for a, b in windows)]
    in_pass_s = sum(b - a for a, b in windows)
    elapsed = r.get("elapsed_s") or 1.0
    out_s = max(elapsed - in_pass_s, 1e-9)
    print(f"          lookups over 1 ms: {len(slow)} in all; {len(during)} during a pass "
          f"({in_pass_s:.1f} s of passes: {len(during) / max(in_pass_s, 1e-9):.2f}/s), "
          f"{len(slow) - len(during)} outside ({out_s:.1f} s: {(len(slow) - len(during)) / out_s:.2f}/s)")
    d1, o1 = after_start(during), after_start([x for x in slow if x not in during])
    print(f"          over 1 ms after the client's start lag: {len(d1)} during a pass "
          f"({len(d1) / max(in_pass_s, 1e-9):.2f}/s), {len(o1)} outside ({len(o1) / out_s:.2f}/s)")
    if during:
        worst = sorted(during, key=lambda x: -x[1])[:5]
        print("          slowest during a pass (start lag): " +
              ", ".join(f"{lat * 1e3:.2f} ms ({lag * 1e3:.2f})" + (" (failed)" if failed else "")
                        for _, lat, failed, lag in worst))
    for (fam, work), buckets in sorted(slice_histograms(f"{out_dir}/slices-{v}.txt").items()):
        total = buckets[-1][1]
        if total == 0:
            continue
        within_1ms = max((n for le, n in buckets if le <= 0.001), default=0)
        top = next(le for le, n in buckets if n == total)
        print(f"          {fam}{{work={work}}}: {int(total)} slices, "
              f"{int(total - within_1ms)} over 1 ms, all within le={top:g} s")


if __name__ == "__main__":
    main()
