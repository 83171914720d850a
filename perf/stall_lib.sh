# Shared by perf/sweep_stall.sh and perf/evict_stall.sh: the binaries, scratch folders removed
# at exit (with the trace's probes), free ports, and starting and stopping the server under test
# on one core with a state dir. The caller sets `set -euo pipefail` and cds to the repository.

T=${CARGO_TARGET_DIR:-target}/release
SRV=$T/inference-cache-server
FILL=$T/examples/fill
LG=$T/loadgen
SNAP=$(mktemp -d)
RUN=$(mktemp -d)
OUT=$(mktemp -d)
TRACE_DIR=$(mktemp -d)
cleanup() {
  [ -n "${PID:-}" ] && kill -TERM "$PID" 2>/dev/null
  [ -n "${TRACE:-}" ] && perf probe -q -d 'icprobe:*' 2>/dev/null
  rm -rf "$SNAP" "$RUN" "$TRACE_DIR"
}
trap cleanup EXIT
port() { python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
G=$(port); H=$(port); A=$(port)
now_s() { date +%s; }
# Every entry's stamp: 5 minutes ago (well inside the default 30 min TTL for the whole script).
STAMP_S=$(( $(now_s) - 300 ))

# start BINARY STATE_DIR CAP SWEEP_INTERVAL_MS: one core, snapshots only at SIGTERM; waits
# (at most 120 s) until /readyz answers.
start() {
  "$1" --insecure-disable-auth --log-level info --log-format text --shards 1 \
    --grpc-bind-address "127.0.0.1:$G" --http-bind-address "127.0.0.1:$H" \
    --snapshot-bind-address "127.0.0.1:$A" --index-max-entries "$3" \
    --state-dir "$2" --snapshot-interval-ms 3600000 --sweep-interval-ms "$4" 2>>"$OUT/server.log" &
  PID=$!
  for _ in $(seq 1 1200); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$H/readyz")" = 200 ] && return 0
    sleep 0.1
  done
  echo "server not ready" >&2; exit 1
}
stop() { kill -TERM "$PID"; wait "$PID" || true; PID=; }
