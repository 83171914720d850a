#!/usr/bin/env bash
# Cross-core hops and what they cost: --shards 1, --shards 2 over plain connections, --shards 2
# with the shard-aware gateway SDK (loadgen --shard-aware-addr), and the same two with
# --busy-poll-us, interleaved in one run so machine noise hits all variants. Per variant: the
# hopped share of requests (inferencecache_core_requests_total{path}), server CPU per request,
# p50/p99 of LookupRoute with CONC calls in flight.
#
# Usage: perf/shard_aware.sh [requests-per-run] [rounds]
#        CONC=8 VARIANTS="n2 n2-sdk" perf/shard_aware.sh 20000 3
#        LG_THREADS=1 gives loadgen one thread (default 0: one per CPU); LOOKUP_CLIENT=tonic
#        sends lookups through tonic's channel instead of the SDK's lean client (default lean)
#        SERVER_CPUS=0 LG_CPUS=1 pin the server and loadgen to those CPUs (taskset; the server's
#        cores are placed on the CPUs it is allowed, so --shards 2 then shares CPU 0): the
#        server's CPU per request without the load generator competing for its CPUs;
#        RATE=20000 paces the calls (loadgen --rate, open loop, instead of CONC in flight) so
#        every variant serves the same load
# Needs: cargo build --release -p loadgen -p inference-cache --bins
set -euo pipefail
cd "$(dirname "$0")/.."
REQ=${1:-20000}
ROUNDS=${2:-3}
CONC=${CONC:-1}
T=${CARGO_TARGET_DIR:-target}/release
SRV=$T/inference-cache-server
LG=$T/loadgen
free_port() { python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
PORT=$(free_port); SAPORT=$(free_port); HTTP=$(free_port)
TICK=$(getconf CLK_TCK)
OUT=$(mktemp -d)
trap '[ -n "${PID:-}" ] && kill "$PID" 2>/dev/null || true' EXIT
if [ -n "${RATE:-}" ]; then LOAD=(--rate "$RATE"); else LOAD=(--concurrency "$CONC"); fi

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# "inline hopped" summed over cores.
routed() {
  curl -s "http://127.0.0.1:$HTTP/metrics" | awk '
    /^inferencecache_core_requests_total\{.*path="inline"/ {i += $NF}
    /^inferencecache_core_requests_total\{.*path="hopped"/ {h += $NF}
    END {print i + 0, h + 0}'
}

start() {
  local shards=$1; shift
  ${SERVER_CPUS:+taskset -c "$SERVER_CPUS"} "$SRV" --insecure-disable-auth --log-level error --shards "$shards" \
    --grpc-bind-address "127.0.0.1:$PORT" --shard-aware-grpc-bind-address "127.0.0.1:$SAPORT" \
    --http-bind-address "127.0.0.1:$HTTP" --snapshot-bind-address 127.0.0.1:0 "$@" &
  PID=$!
  for _ in $(seq 100); do (echo >/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && return; sleep 0.05; done
  echo "server did not start" >&2; exit 1
}

COMMON=(--addr "http://127.0.0.1:$PORT" --workload chat --seed 7 --population 2000 --replicas 8 --tenants 8 --models 2)
printf '%-13s %5s %8s %9s %9s %8s %12s\n' variant round hopped p50_us p99_us rps cpu_us_per_req
for round in $(seq "$ROUNDS"); do
  for v in ${VARIANTS:-n1 n2 n2-sdk n2-busy n2-sdk-busy}; do
    case "$v" in
      n1) start 1; SDK=() ;;
      n2) start 2; SDK=() ;;
      n2-sdk) start 2; SDK=(--shard-aware-addr "127.0.0.1:$SAPORT") ;;
      n2-busy) start 2 --busy-poll-us 200; SDK=() ;;
      n2-sdk-busy) start 2 --busy-poll-us 200; SDK=(--shard-aware-addr "127.0.0.1:$SAPORT") ;;
    esac
    "$LG" preload "${COMMON[@]}" >/dev/null 2>&1
    read -r i0 h0 < <(routed)
    c0=$(cpu_ticks "$PID")
    ${LG_CPUS:+taskset -c "$LG_CPUS"} "$LG" --threads "${LG_THREADS:-0}" run "${COMMON[@]}" "${SDK[@]}" --lookup-client "${LOOKUP_CLIENT:-lean}" --no-preload --no-producers "${LOAD[@]}" \
      --requests "$REQ" --quiet --json "$OUT/$v-$round.json" >/dev/null
    c1=$(cpu_ticks "$PID")
    read -r i1 h1 < <(routed)
    kill "$PID"; wait "$PID" 2>/dev/null || true
    python3 - "$OUT/$v-$round.json" "$v" "$round" "$c0" "$c1" "$TICK" "$REQ" "$i0" "$h0" "$i1" "$h1" <<'PY'
import json, sys
path, v, rnd, c0, c1, tick, req, i0, h0, i1, h1 = sys.argv[1:]
r = json.load(open(path))
lk = r["rpcs"]["LookupRoute"]
cpu_us = (int(c1) - int(c0)) / int(tick) * 1e6 / int(req)
inline, hopped = float(i1) - float(i0), float(h1) - float(h0)
share = hopped / max(inline + hopped, 1)
print(f"{v:<13} {rnd:>5} {share:>8.3f} {lk['p50_ms']*1000:>9.1f} {lk['p99_ms']*1000:>9.1f} {r['achieved_rate']:>8.0f} {cpu_us:>12.1f}")
PY
  done
done
