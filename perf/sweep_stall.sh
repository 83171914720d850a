#!/usr/bin/env bash
# Lookups while the TTL sweep runs on a 10M-entry index (the bar: "no lookup waits more than
# 1 ms behind index maintenance"), release build:
#   perf/sweep_stall.sh [entries] [seconds] [before-server-binary]
# Fills <entries> (default 10,000,000) storage entries once (loadgen's `fill` example: 64-block
# chains over 8 tenants, every entry stamped at one fixed time in the past), snapshots them
# (--state-dir), then for each variant restores that snapshot into a fresh `--shards 1` server
# with `--sweep-interval-ms 10000`, pushes a policy giving tenants t0..t3 (half the entries) a
# TTL that expires them 40 s later, and runs a paced 1,000 req/s LookupRoute probe for <seconds>
# (default 130; loadgen open loop, no producers; loadgen first preloads its own chat prompts,
# so the probe's lookups find prefixes in the 10M-entry index). Variants (VARIANTS, default "after nosweep"),
# one after the other (never two servers at once):
#   before   the binary given as the third argument (default /tmp/sweep-before-server: a
#            pre-change build, e.g. the one-call sweep)
#   after    this tree's server (sliced sweep)
#   nosweep  this tree's server with --sweep-interval-ms 3600000 (no sweep in the window: the
#            probe's own noise on this host)
# Prints p50/p99/p99.9/max of each, the entries left, the load average, every sweep pass's wall
# time, slices and longest slice in wall and thread-CPU time (the server's
# inferencecache_core_sweep_* series, scraped every second; passes that end less than a second
# apart may be missed), and perf/sweep_attribution.py's line-up of the lookups over 1 ms
# (loadgen --slow-log) with the passes' windows, plus the slice histograms
# (inferencecache_core_maintenance_slice_seconds / _cpu_seconds) over the whole run.
# SCRAPE_S=5 scrapes every 5 s instead of every second. PROBE_CPUS=1 runs loadgen and the
# scraper on CPU 1 only (taskset), off CPU 0 where the server's core 0 is pinned, so the
# probe's own processes do not time-slice the core thread.
# TRACE=1 (root, perf) also traces the "after" variant's whole probe: uprobes on the core's sweep
# slice, on the probe point that reports each slice's thread-CPU time, on the LookupRoute
# handler (set on a copy of the server binary) and on loadgen's probe point at each call's start
# (on a copy of loadgen; all removed at exit), writev calls of over 40 bytes (loadgen's
# requests) and the core thread's context switches. The probe then uses one connection, so the
# server handles calls in the order they start; perf/sweep_trace.py pairs each call with its
# handling and takes the sweep work the core did while that call's request waited.
# Needs: cargo build --release -p inference-cache -p loadgen --bins --examples
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-10000000}
SECS=${2:-130}
BEFORE=${3:-/tmp/sweep-before-server}
. perf/stall_lib.sh
entries() { curl -s "http://127.0.0.1:$H/metrics" | awk '/^inferencecache_core_index_entries\{/ {print $2}'; }

. perf/trace_lib.sh
[ -n "${TRACE:-}" ] && TRACE_BIN=$(trace_setup)

# 1. Fill once and snapshot (the final snapshot at SIGTERM).
start "$SRV" "$SNAP" 0 3600000
"$FILL" --addr "http://127.0.0.1:$G" --entries "$N" --timestamp-us "$((STAMP_S * 1000000))" 2>&1 | tail -1
echo "filled: $(entries) entries"
stop

for variant in ${VARIANTS:-after nosweep}; do
  case $variant in
  before) BIN=$BEFORE; SWEEP=10000 ;;
  after) BIN=${TRACE_BIN:-$SRV}; SWEEP=10000 ;;
  nosweep) BIN=$SRV; SWEEP=3600000 ;;
  esac
  rm -rf "${RUN:?}"/*; cp -r "$SNAP"/. "$RUN"/
  start "$BIN" "$RUN" 0 "$SWEEP"
  # Tenants t0..t3 expire 40 s from now (TTL = their age then).
  TTL_NS=$(( ($(now_s) + 40 - STAMP_S) * 1000000000 ))
  POL=""
  for t in t0 t1 t2 t3; do POL="$POL${POL:+,}{\"namespace\":\"$t\",\"evictionTTL\":$TTL_NS}"; done
  curl -sf -X POST -H 'Content-Type: application/json' \
    --data "{\"version\":7,\"policies\":[$POL],\"tenants\":[]}" "http://127.0.0.1:$A/policy"
  E0=$(entries)
  LOAD0=$(cut -d' ' -f1 /proc/loadavg)
  # Scrape the sweep gauges every second while the probe runs (bounded: SECS + 30 scrapes).
  PIN=(${PROBE_CPUS:+taskset -c "$PROBE_CPUS"})
  ( for _ in $(seq 1 $((SECS + 30))); do
      curl -s "http://127.0.0.1:$H/metrics" | grep -E '^inferencecache_core_sweep' | tr '\n' ' ' || true
      echo; sleep "${SCRAPE_S:-1}"
    done ) >"$OUT/scrape-$variant.txt" 2>/dev/null &
  SCRAPER=$!
  if [ -n "${PROBE_CPUS:-}" ]; then taskset -pc "$PROBE_CPUS" "$SCRAPER" >/dev/null; fi
  if [ -n "${TRACE:-}" ] && [ "$variant" = after ]; then trace_start "$PID" "${PIN[@]}"; fi
  LGBIN=$LG; CONNS=()
  if [ -n "${TRACER:-}" ]; then LGBIN=$TRACE_DIR/loadgen; CONNS=(--connections 1); fi
  "${PIN[@]}" "$LGBIN" --threads 1 run --addr "http://127.0.0.1:$G" "${CONNS[@]}" --workload chat --seed 7 \
    --population 2000 --replicas 8 --tenants 4 --no-producers --rate 1000 --duration "$SECS" --quiet \
    --slow-log "$OUT/slow-$variant.txt" --slow-ms 1 --json "$OUT/lg-$variant.json" >/dev/null &
  LGPID=$!
  sleep 1; ls "/proc/$LGPID/task" >"$OUT/loadgen-tids-$variant" 2>/dev/null || true
  wait "$LGPID"
  kill "$SCRAPER" 2>/dev/null || true; wait "$SCRAPER" 2>/dev/null || true
  if [ -n "${TRACER:-}" ]; then trace_stop; fi
  E1=$(entries)
  curl -s "http://127.0.0.1:$H/metrics" | grep -E '^inferencecache_core_maintenance_slice' >"$OUT/slices-$variant.txt" || true
  LOAD1=$(cut -d' ' -f1 /proc/loadavg)
  stop
  python3 perf/sweep_attribution.py "$OUT" "$variant" "$E0" "$E1" "$LOAD0" "$LOAD1"
  if [ -s "$OUT/trace.txt" ] && [ "$variant" = after ]; then
    python3 perf/sweep_trace.py "$OUT/trace.txt" "$OUT/slow-$variant.txt" "$(cat "$OUT/mono_offset")" \
      "$CORE_TID" "$OUT/loadgen-tids-$variant"
  fi
done
