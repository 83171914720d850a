//! The CPUs this process may run on, so pinning respects taskset and cgroup limits.

/// Allowed CPUs in ascending order; every CPU `available_parallelism` reports if the affinity
/// mask cannot be read.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: `sched_getaffinity` writes at most `size_of::<cpu_set_t>()` bytes into the zeroed
    // set owned by this frame; `CPU_ISSET` only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
            let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect();
            if !cpus.is_empty() {
                return cpus;
            }
        }
    }
    (0..std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1))
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn at_least_one_cpu() {
        assert!(!super::allowed_cpus().is_empty());
    }
}
