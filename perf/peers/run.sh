#!/usr/bin/env bash
# The peer benchmark of issue 31 in one command: ours next to Dynamo's and kv-index's indexes on a
# Mooncake-format trace, every answer checked against the fleet simulator's ground truth.
#   perf/peers/run.sh TRACE_FILE [--quick] [peers-bench flags...]
# --quick: 64 workers, 3 rounds (a few minutes on 2 cores). Without it: 64 and 1,024 workers,
# 5 rounds. Each of --expand 1 (native 512-token blocks) and 32 (16-token engine blocks).
# The last line printed is the summary: `peers: mixed ops/s ours/best=...`.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ $# -lt 1 || "$1" == --* ]]; then
  echo "usage: $0 TRACE_FILE [--quick] [--workers 64,1024] [--expand 1,32] [--rounds N] [--only ours,kv-index,...]" >&2
  exit 2
fi
trace="$1"
shift
[[ -r "$trace" ]] || { echo "$0: cannot read $trace" >&2; exit 2; }
export CARGO_TARGET_DIR="$here/target"
cargo build --release --quiet --manifest-path "$here/Cargo.toml"
echo "# peers-bench $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo '?') $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, the server's allocator (mimalloc, no purge, no THP)"
exec "$CARGO_TARGET_DIR/release/peers-bench" "$trace" "$@"
