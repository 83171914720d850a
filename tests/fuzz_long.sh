#!/usr/bin/env bash
# Long fuzz run of every decoder a peer can reach (the proptest targets that `cargo test` runs
# with the default 256 cases): each target runs for SECONDS_PER_TARGET of wall time, in batches
# of BATCH cases, each batch with its own recorded seed (PROPTEST_RNG_SEED), in a release build.
# A failing batch stops the run and prints the seed that reproduces it:
#   PROPTEST_RNG_SEED=<seed> PROPTEST_CASES=<batch> <test binary> --exact <target>
#
#   bash tests/fuzz_long.sh                   # 30 minutes per target
#   SECONDS_PER_TARGET=60 bash tests/fuzz_long.sh
#   ONLY=fuzz_policy_body bash tests/fuzz_long.sh   # targets whose name contains ONLY
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_PER_TARGET=${SECONDS_PER_TARGET:-1800}
BATCH=${BATCH:-20000}

# package, cargo test selector, test name inside the binary
TARGETS=(
  "inferencecache-index|--test fuzz_decoders|fuzz_policy_body"
  "inferencecache-index|--test fuzz_decoders|fuzz_protobuf_messages_through_the_index"
  "kvevent-subscriber|--test fuzz_decode|fuzz_batch_payloads"
  "kvevent-subscriber|--test fuzz_decode|fuzz_multipart_frames"
  "inference-cache|--bin inference-cache-server|admin::probe::tests::fuzz_probe_body"
  "inference-cache|--lib|grpc::lookup_wire::tests::damaged_messages_decode_as_prost_does_or_not_at_all"
  "inference-cache|--lib|grpc::lookup_wire::tests::arbitrary_bytes_decode_as_prost_does_or_not_at_all"
)

# Prints the path of the release test executable cargo builds for `package selector`.
test_binary() {
  local package=$1 selector=$2
  # shellcheck disable=SC2086 # the selector is two words on purpose
  cargo test --release -p "$package" $selector --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])
' | tail -n 1
}

log=$(mktemp)
trap 'rm -f "$log"' EXIT
printf "%-45s %8s %12s %8s\n" target batches cases seconds
for t in "${TARGETS[@]}"; do
  IFS='|' read -r package selector name <<<"$t"
  [[ $name == *"${ONLY:-}"* ]] || continue
  bin=$(test_binary "$package" "$selector")
  [ -x "$bin" ] || { echo "no test binary for $package $selector" >&2; exit 1; }
  start=$(date +%s)
  batches=0
  while [ $(($(date +%s) - start)) -lt "$SECONDS_PER_TARGET" ]; do
    seed=$(od -An -N8 -tu8 /dev/urandom | tr -d ' ')
    if ! PROPTEST_RNG_SEED=$seed PROPTEST_CASES=$BATCH "$bin" --exact "$name" -q >"$log" 2>&1; then
      cat "$log"
      echo "FAILED: $name, reproduce with PROPTEST_RNG_SEED=$seed PROPTEST_CASES=$BATCH $bin --exact $name" >&2
      exit 1
    fi
    grep -q "1 passed" "$log" || { cat "$log"; echo "target $name did not run" >&2; exit 1; }
    batches=$((batches + 1))
  done
  printf "%-45s %8d %12d %8d\n" "$name" "$batches" $((batches * BATCH)) $(($(date +%s) - start))
done
