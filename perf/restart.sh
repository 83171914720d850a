#!/usr/bin/env bash
# Warm restart with --state-dir, release build:
#   perf/restart.sh restart <entries> [shards]
#       fills <entries> storage entries, records a 1,000-lookup sample, SIGTERM (final snapshot),
#       restarts on the same state dir and reports SIGTERM-to-exit, restart-to-ready (process
#       start to /readyz 200), the snapshot's write duration and size, the restore duration, and
#       whether the sample answers are identical.
#   perf/restart.sh stall <entries> [seconds] [interval_ms]
#       fills <entries>, then runs loadgen lookups (no producers; closed loop, one in flight, so
#       each lookup's own wait shows, not a queue; LOAD="--rate 2000" for open loop) against
#       --shards 1 twice: with a snapshot every <interval_ms> (default 100: back to back at 1M)
#       and without periodic snapshots; prints LookupRoute p50/p99/p99.9/max of each and how
#       many snapshots were written (lookups must not stall behind snapshot work).
# Needs: cargo build --release -p inference-cache -p loadgen --bins --examples
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:?restart|stall}
N=${2:-1000000}
T=${CARGO_TARGET_DIR:-target}/release
SRV=$T/inference-cache-server
FILL=$T/examples/fill
LG=$T/loadgen
DIR=$(mktemp -d)
OUT=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
port() { python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
G=$(port); H=$(port); A=$(port)
now() { date +%s.%N; }

run() { # shards interval_ms
  "$SRV" --insecure-disable-auth --log-level info --shards "$1" \
    --grpc-bind-address "127.0.0.1:$G" --http-bind-address "127.0.0.1:$H" \
    --snapshot-bind-address "127.0.0.1:$A" --index-max-entries 0 \
    --state-dir "$DIR" --snapshot-interval-ms "$2" 2>>"$OUT/server.log" &
  PID=$!
}
ready() {
  until [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$H/readyz")" = 200 ]; do sleep 0.01; done
}
stop() { kill -TERM "$PID"; wait "$PID"; }

case "$MODE" in
restart)
  SHARDS=${3:-1}
  run "$SHARDS" 3600000; ready
  "$FILL" --addr "http://127.0.0.1:$G" --entries "$N"
  "$FILL" --addr "http://127.0.0.1:$G" --entries "$N" --sample 1000 >"$OUT/before.txt"
  t0=$(now); stop; t1=$(now)
  SIZE=$(du -sb "$DIR" | cut -f1)
  run "$SHARDS" 3600000; ready; t2=$(now)
  "$FILL" --addr "http://127.0.0.1:$G" --entries "$N" --sample 1000 >"$OUT/after.txt"
  stop
  echo "entries=$N shards=$SHARDS state_dir_bytes=$SIZE"
  echo "sigterm_to_exit_s=$(echo "$t1 - $t0" | bc) restart_to_ready_s=$(echo "$t2 - $t1" | bc)"
  grep 'snapshot_written\|snapshot_restored' "$OUT/server.log" | tail -2
  if cmp -s "$OUT/before.txt" "$OUT/after.txt"; then
    echo "sample: identical ($(wc -l <"$OUT/before.txt") answers)"
  else
    echo "sample: DIFFERENT"; exit 1
  fi
  ;;
stall)
  SECS=${3:-20}
  INTERVAL=${4:-100}
  for interval in "$INTERVAL" 3600000; do
    : >"$OUT/server.log"
    rm -rf "${DIR:?}"/*
    run 1 "$interval"; ready
    "$FILL" --addr "http://127.0.0.1:$G" --entries "$N" 2>/dev/null
    "$LG" run --addr "http://127.0.0.1:$G" --workload chat --seed 7 --population 2000 --replicas 8 \
      --tenants 4 --no-preload --no-producers ${LOAD:---concurrency 1} --duration "$SECS" --quiet \
      --json "$OUT/lg-$interval.json" >/dev/null
    SNAPS=$(grep -c snapshot_written "$OUT/server.log" || true)
    stop
    python3 - "$OUT/lg-$interval.json" "$interval" "$SNAPS" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["rpcs"]["LookupRoute"]
print(f"snapshot-interval-ms={sys.argv[2]:>8} snapshots={sys.argv[3]:>3} lookups={r['count']} errors={r['errors']} "
      f"p50={r['p50_ms']:.3f}ms p99={r['p99_ms']:.3f}ms p99.9={r['p999_ms']:.3f}ms max={r['max_ms']:.3f}ms")
PY
  done
  grep snapshot_written "$OUT/server.log" | tail -3
  ;;
esac
