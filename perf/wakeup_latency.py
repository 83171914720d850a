#!/usr/bin/env python3
"""How long threads waited for their CPU after being woken, and who held it meanwhile.

Reads the text of `perf script -F comm,tid,cpu,time,event,trace` over a recording with
sched:sched_wakeup and sched:sched_switch (and, to name a client-side attacker,
syscalls:sys_enter_sendto), e.g. one run of an e2e DoS test, the server pinned to CPU 0 and the
test process to CPU 1:

    perf record -a -e sched:sched_switch,sched:sched_wakeup,syscalls:sys_enter_sendto \\
        -o OUT.data -- taskset -c 1 E2E_BINARY http2_dos::priority_flood::shards_1 --exact
    perf script -i OUT.data -F comm,tid,cpu,time,event,trace > OUT.txt
    python3 perf/wakeup_latency.py OUT.txt --cpu 1 --threads tokio-rt-worker,http2_dos

For each wake-up of a thread whose name starts with one of `--threads` on `--cpu`, the time until
it ran, and the thread that was running until then. The "attacker" is the thread outside
`--server` that sent the most writes over 1,000 bytes (sendto), counted apart from the threads
named like it (a test thread and its attacker share a name). perf/runs/2026-12-06-quiet-client-p99.md
"""
import argparse
import collections
import re

LINE = re.compile(r"^\s*(.+?)\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s*(.*)$")
WAKEUP = re.compile(r"comm=(.+?) pid=(\d+) prio=\d+ target_cpu=(\d+)")
SWITCH = re.compile(r"prev_comm=(.+?) prev_pid=(\d+) .*next_pid=(\d+)")
SEND_LEN = re.compile(r"len: 0x([0-9a-f]+)")


def events(path):
    for line in open(path, errors="replace"):
        m = LINE.match(line)
        if m:
            comm, tid, cpu, t, event, args = m.groups()
            yield comm, int(tid), int(cpu), float(t), event, args


def attacker_tid(path, server):
    sends = collections.Counter()
    for comm, tid, _, _, event, args in events(path):
        if event == "syscalls:sys_enter_sendto" and not comm.startswith(server):
            m = SEND_LEN.search(args)
            if m and int(m.group(1), 16) > 1000:
                sends[tid] += 1
    return sends.most_common(1)[0][0] if sends else None


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, len(xs) * p // 100)] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--cpu", type=int, required=True)
    ap.add_argument("--threads", required=True, help="comma-separated name prefixes")
    ap.add_argument("--server", default="core-", help="name prefix of the server's threads")
    ap.add_argument("--slow-us", type=float, default=500.0)
    a = ap.parse_args()
    prefixes = tuple(a.threads.split(","))
    attacker = attacker_tid(a.trace, a.server)
    waiting = {}
    waits = []
    slow = collections.Counter()
    slow_ms = collections.Counter()
    slow_max = collections.defaultdict(float)
    for _, _, cpu, t, event, args in events(a.trace):
        if event == "sched:sched_wakeup":
            m = WAKEUP.search(args)
            tid = int(m.group(2))
            if int(m.group(3)) == a.cpu and m.group(1).startswith(prefixes) and tid != attacker:
                waiting.setdefault(tid, t)
        elif event == "sched:sched_switch" and cpu == a.cpu:
            m = SWITCH.search(args)
            woken = waiting.pop(int(m.group(3)), None)
            if woken is None:
                continue
            us = (t - woken) * 1e6
            waits.append(us)
            if us > a.slow_us:
                who = "the attacker" if int(m.group(2)) == attacker else m.group(1)
                slow[who] += 1
                slow_ms[who] += us / 1000
                slow_max[who] = max(slow_max[who], us)
    print(
        f"{len(waits)} wake-ups on CPU {a.cpu}: p50 {percentile(waits, 50):.0f} us, "
        f"p99 {percentile(waits, 99):.0f} us; over {a.slow_us:.0f} us: {sum(slow.values())}"
    )
    for who, n in slow.most_common(8):
        print(f"  behind {who:<24} {n:5d} ({slow_ms[who]:.1f} ms, longest {slow_max[who]:.0f} us)")


if __name__ == "__main__":
    main()
