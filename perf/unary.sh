#!/usr/bin/env bash
# Unary LookupRoute latency and server CPU per request over loopback, one call in flight:
# our server with --shards 1 and --shards 2 next to the plain single-threaded baseline
# (examples/baseline_server.rs), interleaved in one run so machine noise hits all variants.
#
# Usage: perf/unary.sh [requests-per-run] [rounds]
#        PREV=<another build of inference-cache-server> perf/unary.sh ...  adds that build with
#        --shards 1 as variant "prev-n1" (before/after comparisons in one run);
#        VARIANTS="prev-n1 n1" picks the variants to run; "n1-spin" is --shards 1 with
#        --busy-poll-us ${SPIN_US:-1000} (spin before parking, for dedicated cores), "n1-spinN"
#        the same with --busy-poll-us N;
#        LG_CPUS=1 runs loadgen on CPU 1 only (off the CPU the server's core 0 is pinned to);
#        LOOKUP_CLIENT=tonic sends through tonic's channel instead of the SDK's lean client
#        (default lean); LG_THREADS=N gives loadgen N threads (default 1; 0 = one per CPU);
#        LG_BUSY_POLL=1 runs loadgen with --busy-poll (its thread polls instead of sleeping
#        between answers, so the client's own wake-up leaves every sample)
# Needs: cargo build --release -p loadgen -p inference-cache --bins --examples
set -euo pipefail
cd "$(dirname "$0")/.."
REQ=${1:-20000}
ROUNDS=${2:-3}
T=${CARGO_TARGET_DIR:-target}/release
SRV=$T/inference-cache-server
BASE=$T/examples/baseline_server
LG=$T/loadgen
PORT=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
TICK=$(getconf CLK_TCK)
OUT=$(mktemp -d)

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

start() {
  case "$1" in
    baseline) "$BASE" "127.0.0.1:$PORT" 2>/dev/null & ;;
    n1) "$SRV" --insecure-disable-auth --log-level error --shards 1 --grpc-bind-address "127.0.0.1:$PORT" --http-bind-address 127.0.0.1:0 --snapshot-bind-address 127.0.0.1:0 & ;;
    n1-spin) "$SRV" --insecure-disable-auth --log-level error --shards 1 --busy-poll-us "${SPIN_US:-1000}" --grpc-bind-address "127.0.0.1:$PORT" --http-bind-address 127.0.0.1:0 --snapshot-bind-address 127.0.0.1:0 & ;;
    n1-spin[0-9]*) "$SRV" --insecure-disable-auth --log-level error --shards 1 --busy-poll-us "${1#n1-spin}" --grpc-bind-address "127.0.0.1:$PORT" --http-bind-address 127.0.0.1:0 --snapshot-bind-address 127.0.0.1:0 & ;;
    n2) "$SRV" --insecure-disable-auth --log-level error --shards 2 --grpc-bind-address "127.0.0.1:$PORT" --http-bind-address 127.0.0.1:0 --snapshot-bind-address 127.0.0.1:0 & ;;
    prev-n1) "$PREV" --insecure-disable-auth --log-level error --shards 1 --grpc-bind-address "127.0.0.1:$PORT" --http-bind-address 127.0.0.1:0 --snapshot-bind-address 127.0.0.1:0 & ;;
  esac
  PID=$!
  for _ in $(seq 100); do (echo >/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && return; sleep 0.05; done
  echo "server $1 did not start" >&2; exit 1
}

COMMON=(--addr "http://127.0.0.1:$PORT" --workload chat --seed 7 --population 2000 --replicas 8 --tenants 4)
printf '%-9s %5s %10s %10s %10s %12s\n' variant round p50_us p99_us rps cpu_us_per_req
for round in $(seq "$ROUNDS"); do
  for v in ${VARIANTS:-baseline ${PREV:+prev-n1} n1 n2}; do
    start "$v"
    "$LG" preload "${COMMON[@]}" >/dev/null 2>&1
    c0=$(cpu_ticks "$PID")
    ${LG_CPUS:+taskset -c "$LG_CPUS"} "$LG" run "${COMMON[@]}" --threads "${LG_THREADS:-1}" --lookup-client "${LOOKUP_CLIENT:-lean}" ${LG_BUSY_POLL:+--busy-poll} --no-preload --no-producers --concurrency 1 --requests "$REQ" --quiet --json "$OUT/$v-$round.json" >/dev/null
    c1=$(cpu_ticks "$PID")
    kill "$PID"; wait "$PID" 2>/dev/null || true
    python3 - "$OUT/$v-$round.json" "$v" "$round" "$c0" "$c1" "$TICK" "$REQ" <<'PY'
import json, sys
path, v, rnd, c0, c1, tick, req = sys.argv[1:]
r = json.load(open(path))
lk = r["rpcs"]["LookupRoute"]
cpu_us = (int(c1) - int(c0)) / int(tick) * 1e6 / int(req)
mix = ",".join(f"{k}={n}" for k, n in sorted(r["reason_codes"].items()))
print(f"{v:<9} {rnd:>5} {lk['p50_ms']*1000:>10.1f} {lk['p99_ms']*1000:>10.1f} {r['achieved_rate']:>10.0f} {cpu_us:>12.1f}  {mix}")
PY
  done
done
