//! Client threads that stand in for another machine: an attacker or a hostile producer that
//! shares this 2-CPU box with the well-behaved client whose latency a test measures.

/// Moves the calling thread to `SCHED_IDLE`, so it runs only when its CPU has nothing else to
/// run, and a woken thread of any other policy preempts it at once.
///
/// A nice value is not enough for that: under the kernel's EEVDF scheduler nice sets a thread's
/// share of the CPU, not how soon a woken thread gets it. A running nice-19 thread keeps its CPU
/// until its slice is used (about a millisecond here, seen at the next tick), so the measuring
/// client, woken by its answer, waited that long behind the attacker on its own CPU: 3–6% of
/// its LookupRoutes under attack, which made the p99 read about 1 ms over the server's
/// (perf/runs/2026-12-06-quiet-client-p99.md).
pub fn run_in_background() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler(2) on the calling thread (pid 0) with a valid parameter; no
    // memory is involved beyond `param`, read during the call.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    assert_eq!(rc, 0, "SCHED_IDLE: {}", std::io::Error::last_os_error());
}

/// Gives this CPU to any other runnable thread (`sched_yield`): a background thread calls it
/// after each write. `SCHED_IDLE` alone did not get the measured client its CPU at once: in a
/// traced run it still waited behind the attacker's running thread for 0.5–1.1 ms at 36 of its
/// wake-ups (perf/runs/2026-12-06-quiet-client-p99.md); a yield after each write bounds that
/// wait by one write.
pub fn give_way() {
    std::thread::yield_now();
}

/// Moves the calling thread to `SCHED_FIFO` (lowest real-time priority) if this process may:
/// a woken real-time thread preempts every normal thread on its CPU at once, so a measured
/// client at this policy waits for nothing of its own machine's normal threads (the attacker's
/// included) whatever they do. Whether it was granted (root, or `RLIMIT_RTPRIO`); without it the
/// caller keeps the normal policy and its attacker must run in the background instead.
pub fn run_ahead_of_normal_threads() -> bool {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: sched_setscheduler(2) on the calling thread (pid 0) with a valid parameter.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) == 0 }
}

/// Moves the calling thread to the normal policy at nice 0 (a thread of a process started under
/// `chrt` inherits its real-time policy): an attacker beside a real-time measured client runs
/// at full speed without delaying it.
pub fn run_at_normal_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler(2) and setpriority(2) on the calling thread only.
    let rc = unsafe {
        let rc = libc::sched_setscheduler(0, libc::SCHED_OTHER, &param);
        libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 0);
        rc
    };
    assert_eq!(rc, 0, "SCHED_OTHER: {}", std::io::Error::last_os_error());
}

/// The CPUs thread or process `pid` may run on (0: the calling thread).
pub fn allowed_cpus_of(pid: u32) -> Vec<usize> {
    // SAFETY: sched_getaffinity(2) fills the zeroed cpu_set_t owned by this frame.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let rc = libc::sched_getaffinity(
            pid as libc::pid_t,
            std::mem::size_of::<libc::cpu_set_t>(),
            &mut set,
        );
        assert_eq!(
            rc,
            0,
            "sched_getaffinity: {}",
            std::io::Error::last_os_error()
        );
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}
