#!/usr/bin/env bash
# CI performance regression gate: instruction counts (callgrind "Ir") of fixed, deterministic
# workloads compared with perf/gate-baseline.json: the index's (shards/index/examples/perf_gate.rs) and
# whole gRPC requests through the server's real front end, in process
# (examples/perf_gate_frontend.rs: HTTP/2 bytes in, h2, handler, index, answer bytes out).
# Instruction counts do not depend on machine load, so this works on a noisy shared VM where
# wall-clock benches cannot gate anything. Details and how to update: perf/README.md.
#
# Usage: perf/gate.sh [--update] [--tolerance PCT]
#   --update          rewrite perf/gate-baseline.json from this run (commit it with a reason)
#   --tolerance PCT   fail when a workload's count rises more than PCT % (default: the
#                     baseline's tolerance_pct, else 5)
# Env: CARGO_TARGET_DIR (default target), PERF_GATE_INJECT=<workload> (deliberate slowdown,
#      only to prove the gate fails), PERF_GATE_JOBS (parallel valgrind runs, default nproc).
# Exit: 0 pass, 1 regression, 2 setup error (valgrind missing, build or workload failure).
# Needs: valgrind (apt-get install -y valgrind), python3.
set -euo pipefail
cd "$(dirname "$0")/.."

BASELINE=perf/gate-baseline.json
UPDATE=0
TOL=""
while [ $# -gt 0 ]; do
  case "$1" in
    --update) UPDATE=1 ;;
    --tolerance) TOL="$2"; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

if ! command -v valgrind >/dev/null; then
  echo "perf/gate.sh: valgrind not found (apt-get install -y valgrind)" >&2
  exit 2
fi

T=${CARGO_TARGET_DIR:-target}
cargo build --release --quiet -p inferencecache-index --example perf_gate || exit 2
cargo build --release --quiet -p inference-cache --example perf_gate_frontend || exit 2
BINS=("$T/release/examples/perf_gate" "$T/release/examples/perf_gate_frontend")
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

# "<workload> <ops> <binary>" per line, in the order of the binaries' `list` output.
for bin in "${BINS[@]}"; do
  "$bin" list > "$OUT/list" || exit 2
  awk -v b="$bin" '{print $1, $2, b}' "$OUT/list" >> "$OUT/workloads"
done

# One valgrind process per workload; only code under the gate_w_* functions is counted (the
# index build, the front end's start-up and preload, input preparation are not). ASLR off keeps
# address-dependent paths stable.
run_one() {
  local w=$1 bin=$2 out=$3 norand=()
  if command -v setarch >/dev/null && setarch "$(uname -m)" -R true 2>/dev/null; then
    norand=(setarch "$(uname -m)" -R)
  fi
  if ! "${norand[@]}" valgrind --tool=callgrind --callgrind-out-file="$out/$w.cg" \
      --collect-atstart=no --toggle-collect='*gate_w_*' "$bin" "$w" >"$out/$w.log" 2>&1; then
    echo "workload $w failed:" >&2; cat "$out/$w.log" >&2; return 1
  fi
  awk -v w="$w" '/^totals:/ {print w, $2}' "$out/$w.cg" > "$out/$w.count"
}
export -f run_one
JOBS=${PERF_GATE_JOBS:-$(nproc)}
awk '{print $1, $3}' "$OUT/workloads" | xargs -P "$JOBS" -L1 bash -c 'run_one "$2" "$3" "$1"' _ "$OUT" || exit 2

python3 - "$OUT" "$BASELINE" "$UPDATE" "$TOL" "$(rustc -V)" "$(valgrind --version)" <<'EOF'
import json, os, sys
out, baseline_path, update, tol_arg, rustc, valgrind = sys.argv[1:7]
ops, counts = {}, {}
for line in open(os.path.join(out, "workloads")):
    name, n = line.split()[:2]
    ops[name] = int(n)
    f = os.path.join(out, name + ".count")
    parts = open(f).read().split() if os.path.exists(f) else []
    if len(parts) != 2:
        sys.exit(f"no instruction count for {name}")
    counts[name] = int(parts[1])

base = {}
if os.path.exists(baseline_path):
    base = json.load(open(baseline_path))
tol = float(tol_arg) if tol_arg else float(base.get("tolerance_pct", 5))
old = {k: v["ir"] for k, v in base.get("workloads", {}).items()}

print(f"{'workload':<30}{'ops':>7}{'baseline Ir':>16}{'current Ir':>16}{'Ir/op':>12}{'delta':>9}  status")
failed = []
for name in ops:
    cur, per = counts[name], counts[name] / ops[name]
    if name not in old:
        print(f"{name:<30}{ops[name]:>7}{'-':>16}{cur:>16,}{per:>12,.0f}{'':>9}  NEW")
        continue
    d = (cur - old[name]) / old[name] * 100
    status = "ok"
    if d > tol:
        status = f"REGRESSION (> +{tol:g}%)"
        failed.append(name)
    elif d < -tol:
        status = "faster (consider --update)"
    print(f"{name:<30}{ops[name]:>7}{old[name]:>16,}{cur:>16,}{per:>12,.0f}{d:>+8.2f}%  {status}")
for name in old:
    if name not in ops:
        print(f"{name:<30} in the baseline but no longer run (removed by --update)")

if base and base.get("rustc") != rustc:
    print(f"note: baseline made with {base.get('rustc')}, now {rustc}; counts may shift with the compiler")
if update == "1":
    json.dump({
        "tool": f"callgrind Ir ({valgrind}), shards/index/examples/perf_gate.rs, examples/perf_gate_frontend.rs",
        "rustc": rustc,
        "tolerance_pct": tol,
        "workloads": {k: {"ir": counts[k], "ops": ops[k]} for k in ops},
    }, open(baseline_path, "w"), indent=2)
    open(baseline_path, "a").write("\n")
    print(f"baseline written: {baseline_path}")
    sys.exit(0)
if failed:
    print(f"FAIL: instruction count regression in {', '.join(failed)} (tolerance {tol:g}%)")
    print("If the trade-off is deliberate: perf/gate.sh --update, commit perf/gate-baseline.json with the reason.")
    sys.exit(1)
if not base:
    print(f"no baseline at {baseline_path}: run perf/gate.sh --update")
    sys.exit(1)
print(f"PASS: no workload above +{tol:g}%")
EOF
