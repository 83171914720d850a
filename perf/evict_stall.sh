#!/usr/bin/env bash
# Lookups while the global cap evicts on a 10M-entry index (the bar: "no lookup waits more than
# 1 ms behind index maintenance"): the cap's candidate-heap builds (an O(entries) scan), in one
# go on the ingest that needs victims ("before") or ahead of need in slices ("after"). Release
# build:
#   perf/evict_stall.sh [entries] [seconds] [before-server-binary] [variants]
# Fills <entries> (default 10,000,000) storage entries once (loadgen's `fill` example: 64-block
# chains over 8 tenants, every entry stamped 5 minutes in the past), snapshots them
# (--state-dir), then for each variant restores that snapshot into a fresh `--shards 1` server
# (no TTL sweep in the window: --sweep-interval-ms 3600000) and runs loadgen for <seconds>
# (default 100): a paced 1,000 req/s LookupRoute probe (open loop) *with* its 8 producers, whose
# fresh entries push the index over the cap, so every new entry evicts one of the old ones
# (all tied on their stamp, so every comparison falls through to the names: the slow case).
# Variants (default "before after nocap"), one after the other (never two servers at once):
#   before   the binary given as the third argument (default /tmp/evict-before-server: the
#            pre-change build), --index-max-entries <entries>
#   after    this tree's server, --index-max-entries <entries>
#   nocap    this tree's server, --index-max-entries 0 (the same ingest, no eviction: the
#            probe's own noise on this host under that load)
# Prints p50/p99/p99.9/max of each, the cap evictions, the load average, and (this tree's
# server) the cap-build counters: builds ahead of need, their slices, builds an ingest ran or
# finished in one go (the fallback), the last build's longest slice (wall / thread CPU).
# TRACE=1 (root, perf) also traces the "after" variant's whole probe as perf/sweep_stall.sh does
# (perf/trace_lib.sh; loadgen then runs on one thread with one connection for lookups and one
# for its producers): perf/sweep_trace.py pairs each lookup with its handling and takes the
# cap-build work the core did while that lookup's request waited. PROBE_CPUS=1 runs loadgen on
# CPU 1 only (off core 0's CPU).
# Needs: cargo build --release -p inference-cache -p loadgen --bins --examples
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-10000000}
SECS=${2:-100}
BEFORE=${3:-/tmp/evict-before-server}
VARIANTS=${4:-before after nocap}
. perf/stall_lib.sh
metric() { curl -s "http://127.0.0.1:$H/metrics" | awk -v n="$1" 'index($0, n) == 1 {s += $2} END {print s + 0}'; }

. perf/trace_lib.sh
[ -n "${TRACE:-}" ] && TRACE_BIN=$(trace_setup)

# 1. Fill once and snapshot (the final snapshot at SIGTERM).
start "$SRV" "$SNAP" 0 3600000
"$FILL" --addr "http://127.0.0.1:$G" --entries "$N" --timestamp-us "$((STAMP_S * 1000000))" 2>&1 | tail -1
echo "filled: $(metric 'inferencecache_core_index_entries{') entries"
stop

for variant in $VARIANTS; do
  case $variant in
  before) BIN=$BEFORE; CAP=$N ;;
  after) BIN=${TRACE_BIN:-$SRV}; CAP=$N ;;
  nocap) BIN=$SRV; CAP=0 ;;
  *) echo "unknown variant $variant" >&2; exit 2 ;;
  esac
  rm -rf "${RUN:?}"/*; cp -r "$SNAP"/. "$RUN"/
  start "$BIN" "$RUN" "$CAP" 3600000
  E0=$(metric 'inferencecache_core_index_entries{')
  LOAD0=$(cut -d' ' -f1 /proc/loadavg)
  PIN=(${PROBE_CPUS:+taskset -c "$PROBE_CPUS"})
  LGBIN=$LG; TRACED=()
  if [ -n "${TRACE:-}" ] && [ "$variant" = after ]; then
    trace_start "$PID" "${PIN[@]}"
    LGBIN=$TRACE_DIR/loadgen; TRACED=(--threads 1)
  fi
  "${PIN[@]}" "$LGBIN" "${TRACED[@]}" run --addr "http://127.0.0.1:$G" ${TRACER:+--connections 1} \
    --workload chat --seed 7 --population 2000 --replicas 8 --tenants 4 --no-preload --rate 1000 \
    --duration "$SECS" --quiet --slow-log "$OUT/slow-$variant.txt" --slow-ms 1 \
    --json "$OUT/lg-$variant.json" >/dev/null &
  LGPID=$!
  sleep 1; ls "/proc/$LGPID/task" >"$OUT/loadgen-tids-$variant" 2>/dev/null || true
  wait "$LGPID"
  if [ -n "${TRACER:-}" ]; then trace_stop; fi
  E1=$(metric 'inferencecache_core_index_entries{')
  LOAD1=$(cut -d' ' -f1 /proc/loadavg)
  EV=$(metric 'inferencecache_index_evictions_total{')
  BUILDS="builds ahead $(metric inferencecache_core_cap_builds_total) in $(metric inferencecache_core_cap_build_slices_total) slices, in one go (fallback) $(metric inferencecache_core_cap_builds_sync_total), last build's longest slice $(metric inferencecache_core_cap_build_last_max_slice_seconds) s wall / $(metric inferencecache_core_cap_build_last_max_slice_cpu_seconds) s CPU"
  stop
  python3 - "$OUT/lg-$variant.json" "$variant" "$E0" "$E1" "$LOAD0" "$LOAD1" "$EV" "$BUILDS" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["rpcs"]["LookupRoute"]
v, e0, e1, l0, l1, ev, builds = sys.argv[2:9]
print(f"{v:>8}: lookups={r['count']} errors={r['errors']} p50={r['p50_ms']:.3f}ms p99={r['p99_ms']:.3f}ms "
      f"p99.9={r['p999_ms']:.3f}ms max={r['max_ms']:.3f}ms entries {e0} -> {e1} evicted {ev} load1 {l0} -> {l1}")
if v != "before":
    print(f"          {builds}")
PY
  if [ -s "$OUT/trace.txt" ] && [ "$variant" = after ]; then
    python3 perf/sweep_trace.py "$OUT/trace.txt" "$OUT/slow-$variant.txt" "$(cat "$OUT/mono_offset")" \
      "$CORE_TID" "$OUT/loadgen-tids-$variant"
  fi
done
