#!/usr/bin/env python3
"""Per-lookup attribution of slow lookups to the TTL sweep, from a kernel trace of the probe.

Usage: sweep_trace.py EVENTS SLOW_LOG MONO_OFFSET CORE_TID CLIENT_TIDS

perf/sweep_stall.sh with TRACE=1 records, on the clock CLOCK_MONOTONIC, for the whole probe:
  * icprobe:sweep_in / icprobe:sweep_out  uprobes on the entry and return of the core's sweep
                                          slice (CoreState::sweep_slice);
  * icprobe:slice_done                    a uprobe on inferencecache_maintenance_slice_done,
                                          which the core calls after each slice with its kind
                                          and its wall and thread-CPU nanoseconds;
  * icprobe:lookup                        a uprobe on the LookupRoute handler
                                          (lookup::receive::decide, which both
                                          front ends call first);
  * icprobe:lg_start                      a uprobe on loadgen's gateway::lookup_started_probe,
                                          called as each call begins;
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
own wait unless the core handled other requests first and ran a slice between them and it.

Per lookup: over one connection (the probe's setting under TRACE) the server handles calls in
the order they start, so the n-th call start is the n-th handler entry. Each call's request
leaves in the first client writev at or after its start (the lean client sends a call's frames
in one writev, sometimes with the call before it). The sweep work charged between that writev
and the call's handler entry is how long that very call waited behind the sweep. The pairing is
checked: the counts must match and no handler entry may come before its call's start (an
off-by-one pairing puts about half of them there at 1,000 req/s).

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
    """(sweep slices [(start, end, charged share)], the core thread's off-CPU intervals, handler
    entries, client writevs, loadgen call starts, cap-build slices, whether the sweep slices'
    shares come from their reports), times in seconds (mono)."""
    slices, off_cpu, handlers, arrivals, opened, left = [], [], [], [], None, None
    calls = []  # loadgen call starts, in order
    charged = []  # (wall_ns, cpu_ns) per sweep slice, in order
    cap = []  # cap-build slices (start, end, thread CPU / wall), from their reports alone
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
        elif event.startswith("icprobe:lg_start"):
            if not calls or calls[-1] != t:  # perf very rarely records a hit twice, same ns
                calls.append(t)
        elif tid != core_tid:
            continue
        elif event.startswith("icprobe:sweep_in"):
            opened = t
        elif event.startswith("icprobe:sweep_out") and opened is not None:
            slices.append((opened, t))
            opened = None
        elif event.startswith("icprobe:lookup"):
            if not handlers or handlers[-1] != t:
                handlers.append(t)
        elif event.startswith("icprobe:slice_done"):
            m = re.search(r"kind=(\d+) wall=(\d+) cpu=(\d+)", line)
            if m and m.group(1) == "0":
                charged.append((int(m.group(2)), int(m.group(3))))
            elif m and m.group(1) == "1":
                wall, cpu = int(m.group(2)), int(m.group(3))
                cap.append((t - wall / 1e9, t, min(cpu / wall, 1.0) if wall > 0 else 1.0))
    scaled = len(charged) == len(slices)
    if scaled:
        slices = [(s, e, min(cpu / wall, 1.0) if wall > 0 else 1.0)
                  for (s, e), (wall, cpu) in zip(slices, charged)]
    else:
        print(f"   (slice CPU reports: {len(charged)} for {len(slices)} slices; using switches)")
        slices = [(s, e, 1.0) for s, e in slices]
    return slices, off_cpu, handlers, arrivals, calls, cap, scaled


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


def per_lookup(calls, arrivals, handlers, working, starts, off_cpu, cap):
    """Pairs the n-th call start with the n-th handler entry (one connection: FIFO) and prints
    the sweep work charged while each call's request waited at the server, and for the waits
    over 1 ms what else the core was doing (off its CPU: parked and not yet woken, or
    preempted)."""
    if not calls:
        print("   per lookup: no call starts traced (loadgen's probe point not set?)")
        return
    if len(handlers) > len(calls):
        # Tracing began while the first calls were in flight; both lists are complete at the
        # end (loadgen exits before the trace stops), so pair from there.
        print(f"   per lookup: {len(handlers) - len(calls)} handler entries before the first "
              f"traced call start left out")
        handlers = handlers[len(handlers) - len(calls):]
    elif len(calls) > len(handlers):
        print(f"   per lookup: {len(calls)} call starts but {len(handlers)} handler entries: "
              f"cannot pair them")
        return
    away = [(s, e, 1.0) for s, e in off_cpu]
    away_starts = [s for s, _, _ in away]
    cap_starts = [s for s, _, _ in cap]
    early, waits, behind, long_waits, behind_cap = 0, [], [], [], []
    for start, handled in zip(calls, handlers):
        if handled < start:
            early += 1
            continue
        k = bisect.bisect_left(arrivals, start)
        sent = arrivals[k] if k < len(arrivals) and arrivals[k] <= handled else start
        waits.append(handled - sent)
        behind.append(overlap(sent, handled, working, starts))
        behind_cap.append(overlap(sent, handled, cap, cap_starts))
        if handled - sent > 1e-3:
            long_waits.append((behind[-1] + behind_cap[-1],
                               overlap(sent, handled, away, away_starts) / (handled - sent)))
    waits.sort()
    worst = sorted(behind, reverse=True)
    print(f"   per lookup ({len(calls)} calls paired with their handling, {early} handled before "
          f"they started): request sent -> handled p50 {waits[len(waits) // 2] * 1e6:.0f} us, "
          f"max {waits[-1] * 1e3:.3f} ms")
    print(f"   sweep work charged while a lookup's own request waited: max {worst[0] * 1e3:.3f} ms, "
          f"{sum(1 for b in worst if b > 1e-3)} lookups over 1 ms, "
          f"{sum(1 for b in worst if b > 0.5e-3)} over 0.5 ms, {sum(1 for b in worst if b > 0)} with any")
    if cap:
        both = sorted((a + b for a, b in zip(behind, behind_cap)), reverse=True)
        print(f"   cap-build work ({len(cap)} slices, longest {max(e - s for s, e, _ in cap) * 1e3:.3f} ms "
              f"wall) charged while a lookup's own request waited: max {max(behind_cap) * 1e3:.3f} ms, "
              f"{sum(1 for b in behind_cap if b > 1e-3)} over 1 ms; sweep and cap builds together: "
              f"max {both[0] * 1e3:.3f} ms, {sum(1 for b in both if b > 1e-3)} over 1 ms")
    if long_waits:
        shares = sorted(share for _, share in long_waits)
        print(f"   the {len(long_waits)} lookups that waited over 1 ms at the server: "
              f"{sum(1 for b, _ in long_waits if b > 0)} with any maintenance work in the wait (at most "
              f"{max(b for b, _ in long_waits) * 1e3:.3f} ms); the core thread was off its CPU for "
              f"a median {shares[len(shares) // 2]:.0%} of the wait")


def per_arrival(arrivals, handlers, working, starts):
    """Without loadgen's call starts (older traces): at every client writev, the sweep work the
    core did before it next handled a lookup (not tied to the writev's own request)."""
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


def main():
    events, slow_log, mono_offset, core_tid, client_tids = sys.argv[1:6]
    client = {int(t) for t in open(client_tids).read().split()}
    slices, off_cpu, handlers, arrivals, calls, cap, scaled = read_events(events, int(core_tid),
                                                                         client)
    if not (slices or cap) or not handlers or not arrivals:
        sys.exit(f"sweep_trace: missing events (sweep slices {len(slices)}, cap-build slices "
                 f"{len(cap)}, lookups {len(handlers)}, client writevs {len(arrivals)}): were the "
                 f"probes set?")
    working = slices if scaled else on_cpu(slices, off_cpu)
    starts = [s for s, _, _ in working]
    if slices:
        longest = max(e - s for s, e, _ in slices)
        busiest = max(overlap(s, e, working, starts) for s, e, _ in slices)
        print(f"   traced: {len(slices)} sweep slices (longest {longest * 1e3:.3f} ms wall, "
              f"{busiest * 1e3:.3f} ms of it charged to the thread)")
    print(f"   traced: core off its CPU {len(off_cpu)} times, {len(arrivals)} client writevs, "
          f"{len(calls)} call starts, {len(handlers)} lookups handled")
    if calls:
        # The preload's ingest writevs come before the first lookup.
        arrivals = arrivals[bisect.bisect_left(arrivals, calls[0]):]
        per_lookup(calls, arrivals, handlers, working, starts, off_cpu, cap)
    else:
        per_arrival(arrivals, handlers, working, starts)
    slow = read_slow(slow_log, float(mono_offset))
    in_client = sum(1 for _, lat, lag in slow if lat - lag <= 1e-3)
    print(f"   slow lookups (> 1 ms end to end): {len(slow)}; {in_client} of them within 1 ms "
          f"once the client's own start lag is taken off")


if __name__ == "__main__":
    main()
