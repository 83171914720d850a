#!/usr/bin/env bash
# Side-by-side runs of the HTTP/2 DoS suite (tests/e2e/http2_dos.rs) against two or more server
# binaries: for each repetition, each test, each binary in turn (so a burst of load on this
# shared machine hits all of them alike), one run of the test with
# INFERENCECACHE_TEST_SERVER_BIN set; then the medians per family, shard count and binary of the
# good client's LookupRoute p99 unloaded and under attack, and of their ratio.
#
#   perf/http2_dos_compare.sh REPS OUT BIN... [-- TEST...]
#
# TEST defaults to every http2_dos test. OUT collects one line per run (appended; summarise
# again with `python3 perf/http2_dos_compare.py OUT`). NICE (default 0) runs the test and the
# server at that nice value (-20: other processes on the machine disturb it less; the attacker
# thread still sets itself to 19). Each run is bounded by a 120 s timeout.
# SERVER_CPUS / CLIENT_CPUS (taskset lists, e.g. 0 and 1): pin the server to the first and the
# test process (the good client and the attacker) to the second, so the attacking client does
# not take the server's CPU; the server is started through a wrapper in a temporary directory.
# Use with the `shards_1` tests: at `--shards 2` a 2-CPU machine has no CPU left for the clients.
set -uo pipefail
cd "$(dirname "$0")/.."
reps=$1 out=$2
shift 2
bins=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do bins+=("$(realpath "$1")"); shift; done
[ $# -gt 0 ] && shift
tests=("$@")
pin_dir=""
if [ -n "${SERVER_CPUS:-}" ]; then
  pin_dir=$(mktemp -d)
  trap 'rm -rf "$pin_dir"' EXIT
  pinned=()
  for b in "${bins[@]}"; do
    w="$pin_dir/$(basename "$b")"
    printf '#!/bin/sh\nexec taskset -c %s %s "$@"\n' "$SERVER_CPUS" "$b" > "$w"
    chmod +x "$w"
    pinned+=("$w")
  done
  bins=("${pinned[@]}")
fi
client=()
[ -n "${CLIENT_CPUS:-}" ] && client=(taskset -c "$CLIENT_CPUS")
e2e=$(cargo test -p inference-cache --test e2e --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])
' | tail -n 1)
[ -x "$e2e" ] || { echo "no e2e test binary" >&2; exit 2; }
if [ ${#tests[@]} -eq 0 ]; then
  mapfile -t tests < <("$e2e" --list 2>/dev/null | sed -n 's/^\(http2_dos::[^:]*::shards_[12]\): test$/\1/p')
fi
for r in $(seq 1 "$reps"); do
  for t in "${tests[@]}"; do
    for b in "${bins[@]}"; do
      line=$(INFERENCECACHE_TEST_SERVER_BIN=$b timeout 120 nice -n "${NICE:-0}" "${client[@]}" "$e2e" "$t" \
        --exact --test-threads 1 --nocapture 2>&1 |
        grep -E 'good client p99|panicked' | head -2 | tr '\n' ' ')
      echo "$r $(basename "$b") $t $line" | tee -a "$out"
    done
  done
done
python3 "$(dirname "$0")/http2_dos_compare.py" "$out"
