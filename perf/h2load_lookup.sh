#!/usr/bin/env bash
# LookupRoute at saturation with h2load (4 connections x 32 streams, a 32-block chain over a
# small index), our server (--shards 1) next to examples/baseline_server, interleaved round by
# round in one run. Server CPU per request = (utime + stime from /proc/<pid>/stat over the
# h2load run) / requests; h2load's own req/s and the reason code of one answer are printed too.
#
# Usage: perf/h2load_lookup.sh [requests-per-run] [rounds]
#        PREV=<another build of inference-cache-server> adds it as variant "prev-n1";
#        VARIANTS="baseline n1" picks the variants (default: baseline, prev-n1 if PREV, n1)
# Needs: cargo build --release -p inference-cache --bins --examples; h2load
#        (apt-get install -y nghttp2-client); python3.
set -euo pipefail
cd "$(dirname "$0")/.."
REQ=${1:-200000}
ROUNDS=${2:-3}
T=${CARGO_TARGET_DIR:-target}/release
SRV=$T/inference-cache-server
BASE=$T/examples/baseline_server
PORT=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
TICK=$(getconf CLK_TCK)
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
python3 perf/grpc_bodies.py "$OUT" 32 4
URL=http://127.0.0.1:$PORT/inferencecache.v1alpha1.InferenceCache
H=(-H 'content-type: application/grpc' -H 'te: trailers')

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

start() {
  local flags=(--insecure-disable-auth --log-level error --shards 1 --grpc-bind-address "127.0.0.1:$PORT"
    --http-bind-address 127.0.0.1:0 --snapshot-bind-address 127.0.0.1:0)
  case "$1" in
    baseline) "$BASE" "127.0.0.1:$PORT" 2>/dev/null & ;;
    n1) "$SRV" "${flags[@]}" & ;;
    prev-n1) "$PREV" "${flags[@]}" & ;;
  esac
  PID=$!
  for _ in $(seq 100); do (echo >/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && return; sleep 0.05; done
  echo "server $1 did not start" >&2; exit 1
}

printf '%-9s %5s %10s %12s\n' variant round req_s cpu_us_per_req
for round in $(seq "$ROUNDS"); do
  for v in ${VARIANTS:-baseline ${PREV:+prev-n1} n1}; do
    start "$v"
    h2load -n 1 -c 1 -m 1 "${H[@]}" -d "$OUT/report.bin" "$URL/ReportCacheState" >/dev/null
    h2load -n 2000 -c 4 -m 32 "${H[@]}" -d "$OUT/lookup.bin" "$URL/LookupRoute" >/dev/null
    c0=$(cpu_ticks "$PID")
    h2load -n "$REQ" -c 4 -m 32 "${H[@]}" -d "$OUT/lookup.bin" "$URL/LookupRoute" > "$OUT/h2load.txt"
    c1=$(cpu_ticks "$PID")
    kill "$PID"; wait "$PID" 2>/dev/null || true
    ok=$(awk '/^requests:/ {print $8}' "$OUT/h2load.txt")
    rps=$(awk '/^finished in/ {print $4}' "$OUT/h2load.txt")
    if [ "$ok" != "$REQ" ]; then echo "$v: only $ok of $REQ succeeded" >&2; cat "$OUT/h2load.txt" >&2; exit 1; fi
    python3 -c "import sys; c0,c1,tick,req=map(int,sys.argv[1:]); print(f'%-9s %5s %10s %12.2f' % ('$v','$round','$rps',(c1-c0)/tick*1e6/req))" "$c0" "$c1" "$TICK" "$REQ"
  done
done
