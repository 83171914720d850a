//! Wakes every eventfd waiter of this process once: the start-up remedy for a glommio executor
//! that parked before running its first task.
//!
//! glommio's run loop checks its preemption timer before it runs any task queue; if the timer
//! already fired (the thread was descheduled for longer than `CORE_PREEMPT_TIMER` between its
//! I/O poll and its task run, which a loaded machine does now and then), the loop runs nothing
//! and parks in `io_uring_enter` until an event arrives. At start-up no timer or I/O of the
//! core's is pending yet, so it would sleep until the start-up timeout (measured: 4 of 804
//! starts at `--shards 2` on a loaded 2-vCPU machine; perf/runs/2026-12-06-http2-dos-pinned.md).
//! Every glommio executor also waits on an eventfd for wake-ups from other threads; writing to
//! it wakes the core, which then runs its tasks. The executors' eventfds are not reachable
//! through glommio's API, so this writes to every eventfd of the process: the others are
//! wake-up fds too (tokio's), for which a spurious wake-up is harmless by design.

use std::fs;
use std::os::unix::ffi::OsStrExt;

/// Writes 1 to every eventfd this process has open; returns how many were written.
pub fn kick_all() -> usize {
    let Ok(entries) = fs::read_dir("/proc/self/fd") else {
        return 0;
    };
    let mut kicked = 0;
    for entry in entries.flatten() {
        let Ok(target) = fs::read_link(entry.path()) else {
            continue;
        };
        if target.as_os_str().as_bytes() != b"anon_inode:[eventfd]" {
            continue;
        }
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let one = 1u64.to_ne_bytes();
        // SAFETY: `fd` was listed as an open eventfd of this process a moment ago; writing 8
        // bytes from a live buffer to it at worst fails (closed since, or its counter full:
        // EAGAIN on a non-blocking fd), which is ignored. The fd is not closed here.
        let n = unsafe { libc::write(fd, one.as_ptr().cast(), one.len()) };
        if n == one.len() as isize {
            kicked += 1;
        }
    }
    kicked
}

#[cfg(test)]
mod tests {
    use super::kick_all;

    /// An eventfd of the process is written: a reader sees the count.
    #[test]
    fn an_open_eventfd_is_woken() {
        // SAFETY: plain eventfd creation; the fd is closed below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        assert!(fd >= 0);
        assert!(kick_all() >= 1);
        let mut buf = [0u8; 8];
        // SAFETY: reading 8 bytes into a live buffer from the eventfd made above.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), 8) };
        assert_eq!(n, 8);
        assert!(u64::from_ne_bytes(buf) >= 1);
        // SAFETY: closing the fd this test opened.
        unsafe { libc::close(fd) };
    }
}
