#!/usr/bin/env python3
"""What a serving core ran between two reactor turns, from uprobes on its slice functions.

glommio polls a core's I/O (a reactor turn) only once no task is runnable or its preemption
timer fires (`CORE_PREEMPT_TIMER`); a request that arrives meanwhile waits unseen. This reads
`perf script` text of a recording of the server with uprobes (group `g`, set by
`perf/core_gaps_probes.sh SERVER`): `g:park` on glommio's `parking::Inner::park` (the reactor
turn), and entry/return probes (`g:NAME`, `g:NAME_ret`) on the functions that do the core's
bounded pieces of work (ingest parts, sweep and cap slices, cap evictions, HTTP/2 connection
turns), plus sched:sched_switch:

    perf/core_gaps_probes.sh SERVER
    perf record -e 'g:*' -e sched:sched_switch -p SERVER_PID -o OUT.data -- sleep 5
    perf script -i OUT.data -F comm,tid,cpu,time,event,trace > OUT.txt
    python3 perf/core_gaps.py OUT.txt

For each stretch between two reactor turns of the core thread: its length less the time the
thread was switched out, how many pieces of each kind ran in it and for how long (outermost
calls only), and who switched the core out while runnable and for how long.
(perf/runs/2026-12-06-hostile-volume.md)
"""
import argparse
import collections
import re

LINE = re.compile(r"^\s*(.+?)\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s*(.*)$")
SWITCH = re.compile(
    r"prev_pid=(\d+) prev_prio=\d+ prev_state=(\S+) ==> next_comm=(.+?) next_pid=(\d+)"
)


def events(path):
    for line in open(path, errors="replace"):
        m = LINE.match(line)
        if m:
            comm, tid, _, t, event, args = m.groups()
            yield comm, tid, float(t), event, args


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, len(xs) * p // 100)] if xs else 0.0


class Stretch:
    def __init__(self, t):
        self.start, self.off, self.kinds = t, 0.0, collections.defaultdict(list)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--thread", default="core-", help="name prefix of the core threads")
    ap.add_argument("--long-us", type=float, default=400.0)
    ap.add_argument(
        "--piece-min-us",
        type=float,
        default=20.0,
        help="a maintenance call counts as a piece from this long (a check that found nothing "
        "to do, e.g. cap_slice_before before every ingest part, is not one)",
    )
    a = ap.parse_args()
    evs = list(events(a.trace))
    parks = collections.Counter(tid for c, tid, _, e, _ in evs if e == "g:park" and c.startswith(a.thread))
    for tid, _ in parks.most_common():
        report(a, tid, evs)


def report(a, core, evs):
    stretches, cur, depth, entered, off_since = [], None, 0, {}, None
    preempted = collections.defaultdict(list)
    pending_switch = None
    for comm, tid, t, event, args in evs:
        if event == "sched:sched_switch":
            m = SWITCH.search(args)
            prev, state, next_comm, nxt = m.groups()
            if prev == core:
                off_since = t
                pending_switch = (t, next_comm) if state.startswith("R") else None
            elif nxt == core and off_since is not None:
                if cur:
                    cur.off += t - off_since
                if pending_switch:
                    preempted[pending_switch[1]].append((t - pending_switch[0]) * 1e6)
                off_since, pending_switch = None, None
            continue
        if tid != core or not event.startswith("g:"):
            continue
        if off_since is not None:
            # Back on the CPU after another process ran (its switch back is not recorded
            # when only the server's threads are traced): the first event of the core says so.
            if cur:
                cur.off += t - off_since
            if pending_switch:
                preempted[pending_switch[1]].append((t - pending_switch[0]) * 1e6)
            off_since, pending_switch = None, None
        name = event[2:]
        if name == "park":
            if cur:
                stretches.append((t, cur))
            cur, depth, entered = Stretch(t), 0, {}
        elif name.endswith("_ret"):
            kind = name[: -len("_ret")].rstrip("2")
            if kind in entered:
                depth -= 1
                t0 = entered.pop(kind)
                if depth == 0 and cur:
                    cur.kinds[kind].append((t - t0) * 1e6)
        else:
            kind = name.rstrip("2")
            if kind not in entered:
                entered[kind] = t
                depth += 1
    on_cpu = [(end - s.start - s.off) * 1e6 for end, s in stretches]
    long_ones = [(oc, s) for oc, (end, s) in zip(on_cpu, stretches) if oc > a.long_us]
    print(
        f"core thread {core}: {len(stretches)} stretches between reactor turns, on CPU p50 "
        f"{pct(on_cpu, 50):.0f} us, p90 {pct(on_cpu, 90):.0f} us, p99 {pct(on_cpu, 99):.0f} us, "
        f"max {max(on_cpu, default=0):.0f} us; over {a.long_us:.0f} us: {len(long_ones)}"
    )
    if long_ones:
        kinds = collections.Counter()
        time_in = collections.Counter()
        pieces = []
        for oc, s in long_ones:
            n = sum(len(v) for v in s.kinds.values())
            pieces.append(n)
            for k, v in s.kinds.items():
                kinds[k] += len(v)
                time_in[k] += sum(v)
        total = sum(oc for oc, _ in long_ones)
        print(
            f"  in those: pieces of work per stretch p50 {pct(pieces, 50):.0f}, max "
            f"{max(pieces)}; their time by kind (share of the stretches' on-CPU time):"
        )
        for k, us in time_in.most_common():
            print(f"    {k:<18} {kinds[k]:6d} pieces, {us / 1000:8.1f} ms ({100 * us / total:4.1f}%)")
        print(f"    {'(other)':<18} {(total - sum(time_in.values())) / 1000:15.1f} ms")
    # The maintenance lane's rule (src/runtime/lane.rs): at most one maintenance piece per
    # stretch; HTTP/2 turns are requests' own work, not pieces.
    per_stretch = collections.Counter(
        sum(
            1
            for k, v in s.kinds.items()
            if not k.startswith("h2_turn")
            for us in v
            if us >= a.piece_min_us
        )
        for _, s in stretches
    )
    print(
        f"  maintenance pieces (from {a.piece_min_us:.0f} us, HTTP/2 turns not counted) per "
        "stretch: " + ", ".join(f"{n}: {c}" for n, c in sorted(per_stretch.items()))
    )
    print("  switched out while runnable, by whom:")
    for who, w in sorted(preempted.items(), key=lambda kv: -sum(kv[1]))[:8]:
        print(
            f"    {who:<20} {len(w):5d} times, {sum(w) / 1000:7.1f} ms, p50 {pct(w, 50):.0f} us, "
            f"max {max(w):.0f} us"
        )


if __name__ == "__main__":
    main()
