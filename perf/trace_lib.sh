# Shared by perf/sweep_stall.sh and perf/evict_stall.sh with TRACE=1 (root, perf): uprobes on
# copies of the server and loadgen, a kernel trace of one probe, and its text for
# perf/sweep_trace.py. The caller sets SRV, LG (the binaries), TRACE_DIR (scratch, removed by the
# caller) and OUT (results), and removes the probes at exit (perf probe -d 'icprobe:*').

# File offset of the one text symbol whose mangled name contains $2 in binary $1 (for uprobes).
symbol_offset() {
  python3 - "$1" "$2" <<'PY'
import re, subprocess, sys
binary, name = sys.argv[1:]
nm = subprocess.run(["nm", binary], capture_output=True, text=True, check=True).stdout
addrs = [int(l.split()[0], 16) for l in nm.splitlines() if name in l and l.split()[1] in "tT"]
if len(addrs) != 1:
    sys.exit(f"{name}: {len(addrs)} text symbols (inlined or renamed?)")
segs = subprocess.run(["readelf", "-lW", binary], capture_output=True, text=True, check=True).stdout
for m in re.finditer(r"LOAD\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+\S+\s+(0x[0-9a-f]+)", segs):
    off, vaddr, size = (int(x, 16) for x in m.groups())
    if vaddr <= addrs[0] < vaddr + size:
        print(hex(addrs[0] - vaddr + off))
        break
else:
    sys.exit(f"{name}: not in a LOAD segment")
PY
}
# Sets the uprobes on copies of the server and loadgen (a rebuild cannot move them) and prints
# the server copy's path (loadgen's is $TRACE_DIR/loadgen).
trace_setup() {
  local bin=$TRACE_DIR/inference-cache-server sweep lookup done_at started
  cp "$SRV" "$bin"
  cp "$LG" "$TRACE_DIR/loadgen"
  started=$(symbol_offset "$TRACE_DIR/loadgen" gateway20lookup_started_probe)
  sweep=$(symbol_offset "$bin" CoreState11sweep_slice)
  lookup=$(symbol_offset "$bin" receive6decide)
  done_at=$(symbol_offset "$bin" inferencecache_maintenance_slice_done)
  perf probe -q -d 'icprobe:*' 2>/dev/null || true
  perf probe -q -x "$bin" -a "icprobe:sweep_in=$sweep" -a "icprobe:sweep_out=$sweep%return" \
    -a "icprobe:lookup=$lookup" \
    -a "icprobe:slice_done=$done_at kind=%di:u32 wall=%si:u64 cpu=%dx:u64" >&2
  perf probe -q -x "$TRACE_DIR/loadgen" -a "icprobe:lg_start=$started" >&2
  echo "$bin"
}

# Starts recording the probe of server $1 (its core 0; the rest of the arguments prefix the perf
# command, e.g. a taskset): the uprobes, client writevs of over 40 bytes (loadgen's requests), the
# core thread's context switches. Sets TRACER and CORE_TID.
trace_start() {
  CORE_TID=$(grep -l '^core-0' /proc/"$1"/task/*/comm | head -1 | cut -d/ -f5)
  shift
  "$@" perf record -q -k mono -e icprobe:sweep_in -e icprobe:sweep_out__return \
    -e icprobe:lookup -e icprobe:slice_done -e icprobe:lg_start \
    -e syscalls:sys_exit_writev --filter "ret > 40" \
    -e sched:sched_switch --filter "prev_pid == $CORE_TID || next_pid == $CORE_TID" -a \
    -o "$OUT/trace.data" 2>/dev/null &
  TRACER=$!
  sleep 3 # the probes attach before the first call (calls traced from the start pair exactly)
}

# Stops the recording; writes $OUT/trace.txt and $OUT/mono_offset (wall minus monotonic clock).
trace_stop() {
  kill -INT "$TRACER"; wait "$TRACER" 2>/dev/null || true; TRACER=
  python3 -c "import time; print(time.time() - time.clock_gettime(time.CLOCK_MONOTONIC))" >"$OUT/mono_offset"
  perf script -i "$OUT/trace.data" -F tid,time,event,trace --ns 2>/dev/null >"$OUT/trace.txt"
}
