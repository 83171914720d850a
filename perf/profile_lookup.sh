#!/usr/bin/env bash
# Where the instructions of one LookupRoute go (the profile behind the inline path): callgrind around N
# one-at-a-time requests (chat workload, after a preload and a warm-up, --shards 1), then the
# exclusive instruction counts summed per crate / component. User-space instructions only:
# the kernel's share (socket syscalls, io_uring) is not counted here.
#
# Usage: perf/profile_lookup.sh [requests]   (KEEP_OUT=<path> keeps the callgrind output)
# Needs: valgrind, cargo build --release -p loadgen -p inference-cache --bins
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-2000}
T=${CARGO_TARGET_DIR:-target}/release
BIN=$T/inference-cache-server; LG=$T/loadgen
P=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
OUT=${KEEP_OUT:-$(mktemp)}
valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$OUT" "$BIN" --insecure-disable-auth --log-level error --shards 1 --grpc-bind-address 127.0.0.1:$P --http-bind-address 127.0.0.1:0 --snapshot-bind-address 127.0.0.1:0 >/dev/null 2>&1 &
PID=$!
for _ in $(seq 200); do (echo >/dev/tcp/127.0.0.1/$P) 2>/dev/null && break; sleep 0.1; done
COMMON=(--addr "http://127.0.0.1:$P" --workload chat --seed 7 --population 2000 --replicas 8 --tenants 4)
"$LG" preload "${COMMON[@]}" >/dev/null 2>&1
"$LG" run "${COMMON[@]}" --no-preload --no-producers --concurrency 1 --requests 200 --quiet >/dev/null 2>&1
callgrind_control -i on $PID >/dev/null 2>&1
"$LG" run "${COMMON[@]}" --no-preload --no-producers --concurrency 1 --requests "$N" --quiet >/dev/null 2>&1
callgrind_control -i off $PID >/dev/null 2>&1
kill -TERM $PID; wait $PID 2>/dev/null || true
callgrind_annotate --auto=no --threshold=100 "$OUT"* 2>/dev/null | python3 -c '
import re, sys
n = int(sys.argv[1])
groups = [
    ("index (inferencecache_index)", r"inferencecache_index::"),
    ("lookup handler (lookup/, shard/)", r"inference_cache_server::(lookup|shard)::"),
    ("gRPC front end (grpc/, runtime/)", r"inference_cache_server::(grpc|runtime)::"),
    ("metrics", r"inference_cache_server::metrics::|metrics::"),
    ("other server code", r"inference_cache_server::"),
    ("HTTP/2 (h2)", r"\bh2::"),
    ("tonic (codec, server, body)", r"\btonic"),
    ("protobuf (prost)", r"\bprost"),
    ("HPACK / http / bytes", r"\b(http|bytes|httparse|http_body)"),
    ("glommio executor and io_uring", r"\bglommio|io_uring|iou::|uring_sys"),
    ("tokio-util / futures adapters", r"\btokio_util|\bfutures|\btokio::"),
    ("allocator (malloc/free/realloc)", r"malloc|free|realloc|calloc|_int_|tcache|mi_|memalign"),
    ("memcpy / memset / memmove", r"mem(cpy|set|move|cmp)"),
    ("hashing (xxh3)", r"xxh"),
    ("std / core", r"\b(std|core|alloc)::"),
]
tot = {}
total = 0
top = []
for line in sys.stdin:
    m = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(\S.*)$", line)
    if not m:
        continue
    ir = int(m.group(1).replace(",", ""))
    fn = m.group(2)
    if "PROGRAM TOTALS" in fn:
        total = ir
        continue
    top.append((ir, fn))
    for name, pat in groups:
        if re.search(pat, fn):
            tot[name] = tot.get(name, 0) + ir
            break
    else:
        tot["other (libc, kernel glue, unresolved)"] = tot.get("other (libc, kernel glue, unresolved)", 0) + ir
print(f"{n} requests, {total:,} Ir = {total // n:,} Ir per LookupRoute (user space)")
print("| component | Ir per request | share |")
print("|---|---|---|")
for name, ir in sorted(tot.items(), key=lambda kv: -kv[1]):
    print(f"| {name} | {ir // n:,} | {100.0 * ir / max(total, 1):.1f}% |")
print()
print("| top functions (self) | Ir per request |")
print("|---|---|")
for ir, fn in sorted(top, reverse=True)[:15]:
    fn = re.sub(r"\s*\[[^]]*\]$", "", re.sub(r"^\S*:", "", fn))[:110].replace("|", "/")
    print(f"| `{fn}` | {ir // n:,} |")
' "$N"
[ -n "${KEEP_OUT:-}" ] || rm -f "$OUT"*
