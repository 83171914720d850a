#!/usr/bin/env bash
# Long run of the HTTP/2 fuzz targets (issue 32): HPACK decoding (src/http2/fuzz_hpack.rs, two
# targets) and the connection driven by arbitrary frame sequences (tests/http2_fuzz.rs), all in
# parallel, each for FUZZ_SECS of wall time from a seed taken from the clock (printed; set
# FUZZ_SEED to repeat a run). The default `cargo test` runs a short fixed-seed run of each.
#
# Built with the test profile (debug assertions and overflow checks on, as a fuzzer wants them:
# an integer overflow is a failure, not a wrapped value); RELEASE=1 builds with --release.
# A failing case prints its seed; reproduce with FUZZ_SEED=<seed> FUZZ_CASES=1 <binary> --exact
# <target> --nocapture.
#
#   bash tests/http2_fuzz_long.sh                 # 30 minutes per target
#   FUZZ_SECS=60 bash tests/http2_fuzz_long.sh
#   ONLY=connection bash tests/http2_fuzz_long.sh   # targets whose name contains ONLY
set -euo pipefail
cd "$(dirname "$0")/.."

FUZZ_SECS=${FUZZ_SECS:-1800}
profile=()
[ "${RELEASE:-0}" = 1 ] && profile=(--release)

# Prints the path of the test executable cargo builds for `selector...`.
test_binary() {
  cargo test "${profile[@]}" -p inference-cache "$@" --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])
' | tail -n 1
}

lib=$(test_binary --lib)
conn=$(test_binary --test http2_fuzz)
for b in "$lib" "$conn"; do
  [ -x "$b" ] || { echo "no test binary ($b)" >&2; exit 1; }
done

# binary|target
TARGETS=(
  "$lib|http2::fuzz_hpack::fuzz_hpack_blocks"
  "$lib|http2::fuzz_hpack::fuzz_hpack_header_lists"
  "$conn|fuzz_connection_frame_sequences"
)
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
pids=()
for i in "${!TARGETS[@]}"; do
  IFS='|' read -r bin name <<<"${TARGETS[$i]}"
  [[ $name == *"${ONLY:-}"* ]] || continue
  FUZZ_SECS=$FUZZ_SECS "$bin" --exact "$name" --nocapture >"$logs/$i" 2>&1 &
  pids[$i]=$!
done
failed=0
for i in "${!TARGETS[@]}"; do
  IFS='|' read -r _ name <<<"${TARGETS[$i]}"
  [[ $name == *"${ONLY:-}"* ]] || continue
  if wait "${pids[$i]}" && grep -q "1 passed" "$logs/$i"; then
    grep -h "cases from seed" "$logs/$i"
  else
    failed=1
    echo "FAILED: $name" >&2
    grep -h -E -A2 "FAILED|panicked|seed|HANG" "$logs/$i" >&2 || cat "$logs/$i" >&2
  fi
done
exit $failed
