#!/usr/bin/env bash
# LookupRoute with producer auth off and on (issue 33), side by side: h2load at saturation
# (4 connections x 32 streams, the 32-block chain of perf/grpc_bodies.py over 4 replicas) against
# the server (--shards 1), variants interleaved round by round in one run, as in
# perf/h2load_lookup.sh. Server CPU per request = (utime + stime from /proc/<pid>/stat over the
# h2load run) / requests.
#
# Variants (the gateway side never has credentials):
#   off      plain text, no producer flags (the README quick start)
#   on       plain text, --producer-token-audience + --producer-policy + --require-producer-auth
#   tls-off  TLS (--tls-cert-file/--tls-key-file), no producer flags
#   tls-on   TLS with --client-ca-file + token audience + policy + --require-producer-auth (the
#            hardened setup: every handshake asks for a client certificate, h2load sends none)
# The index is primed with one ReportCacheState carrying a bearer token that a stand-in
# TokenReview (python3, loopback) accepts as the policy's service account; the script checks that
# every variant's index holds the primed entries and that nothing was refused.
#
# Usage: perf/h2load_producer_auth.sh [requests-per-run] [rounds]
# Needs: cargo build --release -p inference-cache --bin inference-cache-server; h2load
#        (apt-get install -y nghttp2-client); openssl; python3.
set -euo pipefail
cd "$(dirname "$0")/.."
REQ=${1:-200000}
ROUNDS=${2:-3}
T=${CARGO_TARGET_DIR:-target}
SRV=$T/release/inference-cache-server
free_port() { python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
PORT=$(free_port)
HTTP_PORT=$(free_port)
REVIEW_PORT=$(free_port)
TICK=$(getconf CLK_TCK)
OUT=$(mktemp -d)
REVIEW_PID=""
trap '[ -n "$REVIEW_PID" ] && kill "$REVIEW_PID" 2>/dev/null; rm -rf "$OUT"' EXIT
python3 perf/grpc_bodies.py "$OUT" 32 4
AUD=inferencecache.io/producer
SA=system:serviceaccount:perf:producer

# A CA, the server's certificate from it (the client CA is the same CA, for brevity).
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=perf-ca -keyout "$OUT/ca.key" \
  -out "$OUT/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout "$OUT/tls.key" -out "$OUT/tls.csr" 2>/dev/null
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > "$OUT/san.ext"
openssl x509 -req -in "$OUT/tls.csr" -CA "$OUT/ca.crt" -CAkey "$OUT/ca.key" -CAcreateserial \
  -days 1 -extfile "$OUT/san.ext" -out "$OUT/tls.crt" 2>/dev/null
printf '{"bindings":[{"identities":["%s"],"replicas":["replica-*"],"tenants":["t"]}]}\n' "$SA" \
  > "$OUT/producers.json"
echo perf-kube-token > "$OUT/kube-token"

# The stand-in TokenReview: every token is the policy's service account, for the producer audience.
cat > "$OUT/review.py" <<PY
import http.server, json
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
            "status": {"authenticated": True, "user": {"username": "$SA"},
                       "audiences": ["$AUD"]}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", $REVIEW_PORT), H).serve_forever()
PY
python3 "$OUT/review.py" & REVIEW_PID=$!

H=(-H 'content-type: application/grpc' -H 'te: trailers')
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

start() {
  local flags=(--insecure-disable-auth --log-level error --shards 1 --grpc-bind-address "127.0.0.1:$PORT"
    --http-bind-address "127.0.0.1:$HTTP_PORT" --snapshot-bind-address 127.0.0.1:0)
  local tls=(--tls-cert-file "$OUT/tls.crt" --tls-key-file "$OUT/tls.key")
  local auth=(--producer-token-audience "$AUD" --kube-api-server "http://127.0.0.1:$REVIEW_PORT"
    --kube-token-file "$OUT/kube-token" --producer-policy "$OUT/producers.json" --require-producer-auth)
  case "$1" in
    off) "$SRV" "${flags[@]}" & ;;
    on) "$SRV" "${flags[@]}" "${auth[@]}" & ;;
    tls-off) "$SRV" "${flags[@]}" "${tls[@]}" & ;;
    tls-on) "$SRV" "${flags[@]}" "${tls[@]}" --client-ca-file "$OUT/ca.crt" "${auth[@]}" & ;;
  esac
  PID=$!
  for _ in $(seq 100); do (echo >/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && return; sleep 0.05; done
  echo "server $1 did not start" >&2; exit 1
}

# The primed index holds 4 replicas' chains and nothing was refused.
check_primed() {
  local m
  m=$(curl -s "http://127.0.0.1:$HTTP_PORT/metrics")
  if echo "$m" | grep -q '^inferencecache_producer_refused_total'; then
    echo "$1: the priming report was refused" >&2; echo "$m" | grep producer_refused >&2; exit 1
  fi
  local entries
  entries=$(echo "$m" | awk '/^inferencecache_core_index_entries\{/ {s += $NF} END {print s + 0}')
  if [ "$entries" -lt 1 ]; then echo "$1: the index is empty after priming" >&2; exit 1; fi
}

printf '%-8s %5s %10s %12s\n' variant round req_s cpu_us_per_req
for round in $(seq "$ROUNDS"); do
  for v in ${VARIANTS:-off on tls-off tls-on}; do
    start "$v"
    case "$v" in tls-*) URL=https://127.0.0.1:$PORT/inferencecache.v1alpha1.InferenceCache ;;
                 *) URL=http://127.0.0.1:$PORT/inferencecache.v1alpha1.InferenceCache ;; esac
    h2load -n 1 -c 1 -m 1 "${H[@]}" -H 'authorization: Bearer perf-producer-token' \
      -H "x-producer-epoch: $(date +%s%3N)-perf" -d "$OUT/report.bin" "$URL/ReportCacheState" >/dev/null
    check_primed "$v"
    h2load -n 2000 -c 4 -m 32 "${H[@]}" -d "$OUT/lookup.bin" "$URL/LookupRoute" >/dev/null
    c0=$(cpu_ticks "$PID")
    h2load -n "$REQ" -c 4 -m 32 "${H[@]}" -d "$OUT/lookup.bin" "$URL/LookupRoute" > "$OUT/h2load.txt"
    c1=$(cpu_ticks "$PID")
    kill "$PID"; wait "$PID" 2>/dev/null || true
    ok=$(awk '/^requests:/ {print $8}' "$OUT/h2load.txt")
    rps=$(awk '/^finished in/ {print $4}' "$OUT/h2load.txt")
    if [ "$ok" != "$REQ" ]; then echo "$v: only $ok of $REQ succeeded" >&2; cat "$OUT/h2load.txt" >&2; exit 1; fi
    python3 -c "import sys; c0,c1,tick,req=map(int,sys.argv[1:]); print(f'%-8s %5s %10s %12.2f' % ('$v','$round','$rps',(c1-c0)/tick*1e6/req))" "$c0" "$c1" "$TICK" "$REQ"
  done
done
