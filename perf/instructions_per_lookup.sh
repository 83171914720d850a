#!/usr/bin/env bash
# Instructions per LookupRoute of a server build (all of it: socket, HTTP/2, gRPC, handler,
# index), counted by callgrind around N one-at-a-time requests after a preload and a warm-up.
# Instruction counts do not depend on machine load, so two builds compare on a noisy machine.
#
# Usage: perf/instructions_per_lookup.sh <server binary> [requests]
# Needs: valgrind, cargo build --release -p loadgen
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$1; N=${2:-2000}; LG=${CARGO_TARGET_DIR:-target}/release/loadgen
P=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
OUT=$(mktemp)
valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=$OUT "$BIN" --insecure-disable-auth --log-level error --shards 1 --grpc-bind-address 127.0.0.1:$P --http-bind-address 127.0.0.1:0 --snapshot-bind-address 127.0.0.1:0 >/dev/null 2>&1 &
PID=$!
for _ in $(seq 200); do (echo >/dev/tcp/127.0.0.1/$P) 2>/dev/null && break; sleep 0.1; done
COMMON=(--addr "http://127.0.0.1:$P" --workload chat --seed 7 --population 2000 --replicas 8 --tenants 4)
$LG preload "${COMMON[@]}" >/dev/null 2>&1
$LG run "${COMMON[@]}" --no-preload --no-producers --concurrency 1 --requests 200 --quiet >/dev/null 2>&1
callgrind_control -i on $PID >/dev/null 2>&1
$LG run "${COMMON[@]}" --no-preload --no-producers --concurrency 1 --requests $N --quiet >/dev/null 2>&1
callgrind_control -i off $PID >/dev/null 2>&1
kill -TERM $PID; wait $PID 2>/dev/null || true
IR=$(grep -hE "^totals:" $OUT* | head -1 | awk "{print \$2}")
rm -f "$OUT"
echo "$(basename "$BIN") $N requests: $IR Ir, $((IR / N)) Ir/request"
