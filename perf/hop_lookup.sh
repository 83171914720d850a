#!/usr/bin/env bash
# CPU per hopped LookupRoute: --shards 2, plain connections, every request received by the core
# that does NOT own its partition, so every one crosses the hop. Two builds side by side (PREV
# and this tree's), interleaved round by round in one run. Server CPU per request = (utime +
# stime from /proc/<pid>/stat over the h2load run) / requests. Each row also prints the share
# of the measured requests that hopped (inferencecache_core_requests_total{path="hopped"}): it
# must be 1.00, or the row measures something else.
#
# How every request hops: core 0 deals plain connections round robin (connection i to core
# i mod 2), so after the readiness probe, the ingest and the warm-up (three connections) the
# measured connection is core 1's; the model is picked (MODEL, default "m") so that core 0 owns
# ("t", MODEL) with 2 cores. The hopped share checks both.
#
# Usage: PREV=<before build> perf/hop_lookup.sh [requests-per-run] [rounds]
#        BODY=lookup_tokens.bin (default lookup.bin: a 32-block wire chain; lookup_tokens.bin:
#        512 token ids, fingerprinted by the server); STREAMS=32 streams on the connection
# Needs: cargo build --release -p inference-cache --bins; h2load (apt-get install -y
#        nghttp2-client); python3; curl.
set -euo pipefail
cd "$(dirname "$0")/.."
REQ=${1:-100000}
ROUNDS=${2:-5}
BODY=${BODY:-lookup.bin}
STREAMS=${STREAMS:-32}
T=${CARGO_TARGET_DIR:-target}/release
SRV=$T/inference-cache-server
: "${PREV:?PREV=<the before build of inference-cache-server>}"
free_port() { python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
PORT=$(free_port); HTTP=$(free_port)
TICK=$(getconf CLK_TCK)
OUT=$(mktemp -d)
trap '[ -n "${PID:-}" ] && kill "$PID" 2>/dev/null; rm -rf "$OUT"' EXIT
MODEL=${MODEL:-m} python3 perf/grpc_bodies.py "$OUT" 32 4
URL=http://127.0.0.1:$PORT/inferencecache.v1alpha1.InferenceCache
H=(-H 'content-type: application/grpc' -H 'te: trailers')

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hopped() {
  curl -s "http://127.0.0.1:$HTTP/metrics" |
    awk '/^inferencecache_core_requests_total\{.*path="hopped"/ {h += $NF} END {print h + 0}'
}

start() {
  local bin=$1
  "$bin" --insecure-disable-auth --log-level error --shards 2 --busy-poll-us 0 \
    --grpc-bind-address "127.0.0.1:$PORT" --http-bind-address "127.0.0.1:$HTTP" \
    --snapshot-bind-address 127.0.0.1:0 &
  PID=$!
  for _ in $(seq 100); do (echo >/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && return; sleep 0.05; done
  echo "server $bin did not start" >&2; exit 1
}

printf '%-7s %5s %10s %7s %12s\n' variant round req_s hopped cpu_us_per_req
for round in $(seq "$ROUNDS"); do
  for v in before after; do
    case "$v" in before) start "$PREV" ;; after) start "$SRV" ;; esac
    h2load -n 1 -c 1 -m 1 "${H[@]}" -d "$OUT/report.bin" "$URL/ReportCacheState" >/dev/null
    h2load -n 2000 -c 1 -m "$STREAMS" "${H[@]}" -d "$OUT/$BODY" "$URL/LookupRoute" >/dev/null
    h0=$(hopped); c0=$(cpu_ticks "$PID")
    h2load -n "$REQ" -c 1 -m "$STREAMS" "${H[@]}" -d "$OUT/$BODY" "$URL/LookupRoute" > "$OUT/h2load.txt"
    c1=$(cpu_ticks "$PID"); h1=$(hopped)
    kill "$PID"; wait "$PID" 2>/dev/null || true; PID=
    ok=$(awk '/^requests:/ {print $8}' "$OUT/h2load.txt")
    rps=$(awk '/^finished in/ {print $4}' "$OUT/h2load.txt")
    if [ "$ok" != "$REQ" ]; then echo "$v: only $ok of $REQ succeeded" >&2; cat "$OUT/h2load.txt" >&2; exit 1; fi
    python3 -c "import sys; c0,c1,tick,req,h0,h1=map(float,sys.argv[1:]); print('%-7s %5s %10s %7.2f %12.2f' % ('$v','$round','$rps',(h1-h0)/req,(c1-c0)/tick*1e6/req))" \
      "$c0" "$c1" "$TICK" "$REQ" "$h0" "$h1"
  done
done
