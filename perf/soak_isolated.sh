#!/bin/bash
# The long adversarial soak (tests/e2e/soak.rs, issue 30) with the server isolated from the
# test, so that its strict bar (the well-behaved client's p99 in the hostile windows within 2x
# of the quiet windows') measures the server, not the test's threads competing with it:
#   * the server alone on CPU 0, at the normal policy, as deployed;
#   * the test on CPU 1, its well-behaved client at SCHED_FIFO, the producer at full speed.
# The server's core thread is not put at SCHED_FIFO (as earlier runs did with `chrt -f 1`): it
# then livelocked for 0.6-0.9 s in 4 of 8 runs, spinning in sched_yield inside glommio's
# foreign-wake channel (crossbeam's list channel waits for a sender mid-write) while that
# sender, a decode-pool thread at the normal policy on the same CPU, could not run until the
# kernel's real-time throttling let it (perf/runs/2026-12-07-soak-windows.md).
# Needs root (or RLIMIT_RTPRIO) and 2 CPUs; SERVER_CPUS (default 0) and CLIENT_CPUS (default 1)
# place them on a larger machine (`--shards 2` isolated needs 3 CPUs: SERVER_CPUS=0,1
# CLIENT_CPUS=2). Usage:
#   perf/soak_isolated.sh [RUNS=1] [SHARDS=1]
# Prints each run's `soak --shards` line; exits non-zero when a run fails. SERVERS="a b" runs
# those server binaries in turn instead of this tree's (an A/B on the same machine state).
set -euo pipefail
runs=${1:-1}
shards=${2:-1}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cargo build --release -q -p inference-cache --bin inference-cache-server
e2e=$(cargo test --release -q -p inference-cache --test e2e --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "e2e":
        print(m["executable"])')
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
servers=${SERVERS:-$root/target/release/inference-cache-server}
n=0
for server in $servers; do
  n=$((n + 1))
  cat >"$work/server$n.sh" <<WRAP
#!/bin/bash
exec taskset -c ${SERVER_CPUS:-0} "$server" "\$@"
WRAP
  chmod +x "$work/server$n.sh"
done
status=0
for i in $(seq 1 "$runs"); do
 for s in $(seq 1 "$n"); do
  rc=0
  echo "run $i server $s: $(uptime | sed 's/.*load/load/')"
  INFERENCECACHE_TEST_SERVER_BIN="$work/server$s.sh" taskset -c "${CLIENT_CPUS:-1}" "$e2e" \
    "soak::soak_long::shards_$shards" --exact --ignored --nocapture --test-threads 1 \
    >"$work/out" 2>&1 || rc=$?
  grep -E '^soak|SKIPPED|panicked|test result' "$work/out" || true
  [ "$rc" -eq 0 ] || status=1
 done
done
exit $status
