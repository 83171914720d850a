"""Summary of perf/http2_dos_compare.sh output: per family, shard count and server binary, the
medians over the runs of the good client's LookupRoute p99 unloaded and under attack, and the
median of their ratio (each run's ratio; quiet and attacked come from the same run)."""
import re
import statistics as st
import sys
from collections import defaultdict

UNIT = {"ns": 1e-6, "µs": 1e-3, "ms": 1.0, "s": 1e3}
LINE = re.compile(
    r"(\d+) (\S+) http2_dos::(\S+)::shards_(\d) .*p99 ([\d.]+)(ns|µs|ms|s) unloaded, "
    r"([\d.]+)(ns|µs|ms|s) under attack"
)

runs = defaultdict(list)
for path in sys.argv[1:]:
    for line in open(path, encoding="utf-8"):
        if "panicked" in line:
            print("FAILED:", line.strip()[:240])
        m = LINE.match(line)
        if not m:
            continue
        quiet = float(m[5]) * UNIT[m[6]]
        attacked = float(m[7]) * UNIT[m[8]]
        runs[(m[3], m[4], m[2])].append((quiet, attacked, attacked / quiet))

print("| family | shards | server | runs | quiet p99 (ms) | attacked p99 (ms) | ratio | ratios |")
print("|---|---|---|---|---|---|---|---|")
for (family, shards, binary), v in sorted(runs.items()):
    q = st.median(x[0] for x in v)
    a = st.median(x[1] for x in v)
    r = st.median(x[2] for x in v)
    each = " ".join(f"{x[2]:.1f}" for x in v)
    print(f"| {family} | {shards} | {binary} | {len(v)} | {q:.2f} | {a:.2f} | {r:.2f} | {each} |")
