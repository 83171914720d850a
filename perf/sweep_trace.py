#!/usr/bin/env python3
"""Per-lookup attribution of slow lookups to the TTL sweep, from a kernel trace of the probe.

Usage: sweep_trace.py EVENTS SLOW_LOG MONO_OFFSET CORE_TID CLIENT_TIDS

perf/sweep_stall.sh with TRACE=1 records, on the clock CLOCK_MONOTONIC, for the whole probe:
  * icprobe:sweep_in / icprobe:sweep_out  uprobes on the entry and return of the core's sweep
                                          slice (CoreState::sweep_slice);
  * icprobe:slice_done                    a uprobe on inferencecache_maintenance_slice_done,
                                          which the core calls after each slice with its kind
                                          and its wall and thread-CPU nanoseconds;
  * icprobe:lookup                        a uprobe on the inline LookupRoute handler
                                          (lookup::receive::lookup_route_now);
  * syscalls:sys_exit_writev, ret > 40    every writev of a request's size; the client's
                                          (CLIENT_TIDS, loadgen's threads) are its requests
                                          leaving (the lean client sends a call's HEADERS and
                                          DATA in one writev; control frames are smaller);
  * sched:sched_switch of the core thread  when it was off its CPU;
and `perf script -F tid,time,event,trace` of that is EVENTS. SLOW_LOG is loadgen's --slow-log (every
lookup over 1 ms: due time, latency, outcome, start lag), MONO_OFFSET the wall clock minus the
monotonic clock at the end of the probe, CORE_TID the core thread's id.

Every request leaves with a client writev (over loopback it is in the server's socket then) and
is handled at the next lookup-handler entry at the earliest (requests queued before it are
handled first, back to back). Only the sweep slices that ran between the two can have made it
wait (one core: nothing else runs while a slice does), and of those only the time the core
thread was on its CPU: while it is preempted (a kernel worker, another process) the request
would wait without a sweep too. The guest cannot see the host descheduling its vCPU inside a
slice (no context switch), but the slice's thread-CPU time excludes it: each slice counts in
proportion to the CPU time its thread was charged (thread CPU / wall; without those reports,
its time on CPU by the context switches). That slice time, per client writev, is how much sweep
work the core did while a request that had arrived waited to be picked up. It is the request's
own wait unless the core handled other requests first and ran a slice between them and it; the
trace cannot tie a writev to its own request, so that case is not covered.

The slow lookups (loadgen --slow-log, over 1 ms end to end) are then split: how many are within
1 ms once the client's own start lag (due -> the call began) is taken off.

(Not tcp:tcp_probe at the server's port: while the core is busy the kernel may hold an arriving
segment back from the socket, so that time marks the end of such a wait, not its start.)
"""
import bisect
import re
import sys

from sweep_attribution import slow_lookups


def read_events(path, core_tid, client_tids):
    """(slices [(start, end)], the core thread's off-CPU intervals, handler entries, client
    writevs), times in seconds (mono)."""
    slices, off_cpu, handlers, arrivals, opened, left = [], [], [], [], None, None
    charged = []  # (wall_ns, cpu_ns) per sweep slice, in order
    for line in open(path):
        parts = line.split()
        if len(parts) < 3:
            continue
        tid, t, event = int(parts[0]), float(parts[1].rstrip(":")), parts[2]
        if event.startswith("sched:sched_switch"):
            if f"prev_pid={core_tid} " in line:
                left = t
            elif f"next_pid={core_tid} " in line + " " and left is not None:
                off_cpu.append((left, t))
                left = None
        elif event.startswith("syscalls:sys_exit_writev"):
            if tid in client_tids:
                arrivals.append(t)
        elif tid != core_tid:
            continue
        elif event.startswith("icprobe:sweep_in"):
            opened = t
        elif event.startswith("icprobe:sweep_out") and opened is not None:
            slices.append((opened, t))
            opened = None
        elif event.startswith("icprobe:lookup"):
            handlers.append(t)
        elif event.startswith("icprobe:slice_done"):
            m = re.search(r"kind=(\d+) wall=(\d+) cpu=(\d+)", line)
            if m and m.group(1) == "0":
                charged.append((int(m.group(2)), int(m.group(3))))
    scaled = len(charged) == len(slices)
    if scaled:
        slices = [(s, e, min(cpu / wall, 1.0) if wall > 0 else 1.0)
                  for (s, e), (wall, cpu) in zip(slices, charged)]
    else:
        print(f"   (slice CPU reports: {len(charged)} for {len(slices)} slices; using switches)")
        slices = [(s, e, 1.0) for s, e in slices]
    return slices, off_cpu, handlers, arrivals, scaled


def on_cpu(slices, off_cpu):
    """The parts of `slices` during which the core thread was on its CPU, each with its slice's
    charged share (thread CPU / wall)."""
    out, j = [], 0
    for s, e, share in slices:
        while j < len(off_cpu) and off_cpu[j][1] <= s:
            j += 1
        cur, k = s, j
        while k < len(off_cpu) and off_cpu[k][0] < e:
            if off_cpu[k][0] > cur:
                out.append((cur, off_cpu[k][0], share))
            cur = max(cur, off_cpu[k][1])
            k += 1
        if cur < e:
            out.append((cur, e, share))
    return out


def read_slow(path, mono_offset):
    """(due, latency, start_lag) per slow lookup, due on the monotonic clock."""
    return [(due - mono_offset, lat, lag) for due, lat, _failed, lag in slow_lookups(path)]


def overlap(a, b, intervals, starts):
    """Total length of `intervals` (sorted, disjoint; (start, end, share)) inside [a, b], each
    part weighted by its share."""
    i = max(bisect.bisect_right(starts, a) - 1, 0)
    total = 0.0
    while i < len(intervals) and intervals[i][0] < b:
        s, e, share = intervals[i]
        total += max(0.0, min(b, e) - max(a, s)) * share
        i += 1
    return total


def main():
    events, slow_log, mono_offset, core_tid, client_tids = sys.argv[1:6]
    client = {int(t) for t in open(client_tids).read().split()}
    slices, off_cpu, handlers, arrivals, scaled = read_events(events, int(core_tid), client)
    if not slices or not handlers or not arrivals:
        sys.exit(f"sweep_trace: missing events (slices {len(slices)}, lookups {len(handlers)}, "
                 f"client writevs {len(arrivals)}): were the probes set?")
    working = slices if scaled else on_cpu(slices, off_cpu)
    starts = [s for s, _, _ in working]
    longest = max(e - s for s, e, _ in slices)
    busiest = max(overlap(s, e, working, starts) for s, e, _ in slices)
    print(f"   traced: {len(slices)} sweep slices (longest {longest * 1e3:.3f} ms wall, "
          f"{busiest * 1e3:.3f} ms of it charged to the thread; core off its CPU "
          f"{len(off_cpu)} times), "
          f"{len(arrivals)} client writevs, {len(handlers)} lookups handled")
    waits, behind = [], []
    for w in arrivals:
        k = bisect.bisect_left(handlers, w)
        if k == len(handlers):
            break
        waits.append(handlers[k] - w)
        behind.append(overlap(w, handlers[k], working, starts))
    behind.sort(reverse=True)
    print(f"   client writev -> next handler entry: max {max(waits) * 1e3:.3f} ms, "
          f"{sum(1 for x in waits if x > 1e-3)} over 1 ms")
    print(f"   sweep-slice time charged in between (sweep work while a request waited to be picked up): "
          f"max {behind[0] * 1e3:.3f} ms, {sum(1 for b in behind if b > 1e-3)} over 1 ms, "
          f"{sum(1 for b in behind if b > 0.5e-3)} over 0.5 ms, "
          f"{sum(1 for b in behind if b > 0)} with any")
    slow = read_slow(slow_log, float(mono_offset))
    in_client = sum(1 for _, lat, lag in slow if lat - lag <= 1e-3)
    print(f"   slow lookups (> 1 ms end to end): {len(slow)}; {in_client} of them within 1 ms "
          f"once the client's own start lag is taken off")


if __name__ == "__main__":
    main()
