//! Standard `process_*` series read from `/proc/self` (cheap; not part of the contract).

use prometheus_client::metrics::MetricType;

use super::exposition::{Family, counter, gauge};

/// One reading of the process's resource usage.
#[derive(Clone, Debug, Default)]
pub struct ProcessStats {
    /// User + system CPU seconds.
    pub cpu_seconds: f64,
    /// Resident set size in bytes.
    pub resident_bytes: u64,
    /// Virtual memory size in bytes.
    pub virtual_bytes: u64,
    /// Open file descriptors.
    pub open_fds: u64,
    /// Soft limit on open file descriptors.
    pub max_fds: u64,
    /// Start time, seconds since the Unix epoch.
    pub start_time_seconds: f64,
}

/// Reads `/proc/self/stat`, `/proc/self/fd` and `/proc/stat`; `None` off Linux.
pub fn read() -> Option<ProcessStats> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name (which may contain spaces).
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // SAFETY: sysconf has no preconditions.
    let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
    // rest[0] is field 3 (state): utime = 14, stime = 15, starttime = 22, vsize = 23, rss = 24.
    let num = |i: usize| {
        f.get(i - 3)
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let btime = std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("btime ").map(|v| v.trim().parse::<u64>()))
        })
        .and_then(|r| r.ok())
        .unwrap_or(0);
    let open_fds = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count() as u64)
        .unwrap_or(0);
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct owned by this frame.
    let max_fds = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur
    } else {
        0
    };
    Some(ProcessStats {
        cpu_seconds: (num(14) + num(15)) as f64 / tck,
        resident_bytes: num(24) * page,
        virtual_bytes: num(23),
        open_fds,
        max_fds,
        start_time_seconds: btime as f64 + num(22) as f64 / tck,
    })
}

pub(super) fn families<'a>(p: &'a ProcessStats, fams: &mut Vec<Family<'a>>) {
    fams.push((
        "process_cpu_seconds",
        "Total user and system CPU time spent in seconds.",
        MetricType::Counter,
        Box::new(|e| counter(e, &[], p.cpu_seconds)),
    ));
    fams.push((
        "process_resident_memory_bytes",
        "Resident memory size in bytes.",
        MetricType::Gauge,
        Box::new(|e| gauge(e, &[], p.resident_bytes)),
    ));
    fams.push((
        "process_virtual_memory_bytes",
        "Virtual memory size in bytes.",
        MetricType::Gauge,
        Box::new(|e| gauge(e, &[], p.virtual_bytes)),
    ));
    fams.push((
        "process_open_fds",
        "Number of open file descriptors.",
        MetricType::Gauge,
        Box::new(|e| gauge(e, &[], p.open_fds)),
    ));
    fams.push((
        "process_max_fds",
        "Maximum number of open file descriptors.",
        MetricType::Gauge,
        Box::new(|e| gauge(e, &[], p.max_fds)),
    ));
    fams.push((
        "process_start_time_seconds",
        "Start time of the process since unix epoch in seconds.",
        MetricType::Gauge,
        Box::new(|e| gauge(e, &[], p.start_time_seconds)),
    ));
}
