//! Transparent-huge-page advice for buffers the index fills a little at a time.

/// Asks the kernel not to back `[addr, addr + len)` with transparent huge pages (the whole
/// 4 KiB pages inside it; best effort: an error changes nothing and is ignored). The index
/// calls it for each fresh cap candidate selection buffer (`IndexConfig::gradual_buffer_hook`):
/// mimalloc advises huge pages for large allocations, and with them the first write into each
/// 2 MiB of the buffer faults the whole 2 MiB in at once (≈ 20 ms on this project's VM), inside
/// one maintenance slice; with 4 KiB pages the same faults spread over many slices.
pub fn no_huge_pages(addr: usize, len: usize) {
    const PAGE: usize = 4096;
    let Some(start) = addr.checked_next_multiple_of(PAGE) else {
        return;
    };
    let end = addr.saturating_add(len) / PAGE * PAGE;
    if start >= end {
        return;
    }
    // SAFETY: MADV_NOHUGEPAGE only changes the huge-page policy of whole pages of this
    // process's own mapping (the caller's live buffer); it does not change their contents,
    // protection or mapping, and an address that is not mapped only makes the call fail.
    unsafe {
        libc::madvise(
            start as *mut libc::c_void,
            end - start,
            libc::MADV_NOHUGEPAGE,
        );
    }
}

/// The environment variable with which an operator keeps transparent huge pages for the
/// server (any value): see [`no_transparent_huge_pages`].
pub const ALLOW_THP_ENV: &str = "MIMALLOC_ALLOW_THP";

/// Turns transparent huge pages off for the whole process (`prctl(PR_SET_THP_DISABLE)`, which
/// also covers memory mimalloc reserved and advised before `main`), unless [`ALLOW_THP_ENV`] is
/// set. mimalloc advises huge pages on its arenas, and with the kernel's `defrag=madvise` the
/// first write into each 2 MiB of fresh memory is one fault that zeroes (and may first compact)
/// 2 MiB: 3–7 ms of system time on this project's VM, landing whole inside one maintenance
/// slice of whatever task first touched the memory (a cap build's first slice, a sweep or
/// restore slice as the tables grow: perf/runs/2026-12-06-maintenance-stress.md). With 4 KiB
/// pages the same faults spread over many slices. Best effort: an old kernel's error changes
/// nothing and is ignored. Returns whether it was turned off.
pub fn no_transparent_huge_pages() -> bool {
    if std::env::var_os(ALLOW_THP_ENV).is_some() {
        return false;
    }
    // SAFETY: PR_SET_THP_DISABLE sets one flag of this process's memory descriptor; it reads no
    // pointer and changes no mapping's contents.
    unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The VmFlags line of the mapping in /proc/self/smaps that contains `addr`.
    fn vm_flags_at(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((lo, hi)) = range.split_once('-')
                && let (Ok(lo), Ok(hi)) =
                    (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                inside = (lo..hi).contains(&addr);
            } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.to_string();
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    #[test]
    fn a_buffer_advised_off_huge_pages_is_marked_so() {
        let buf: Vec<u64> = Vec::with_capacity(8 << 20); // 64 MiB: its own mapping
        let (addr, len) = (buf.as_ptr() as usize, buf.capacity() * 8);
        let middle = addr + len / 2;
        assert!(!vm_flags_at(middle).split_whitespace().any(|f| f == "nh"));
        no_huge_pages(addr, len);
        assert!(
            vm_flags_at(middle).split_whitespace().any(|f| f == "nh"),
            "{}",
            vm_flags_at(middle)
        );
    }

    /// No whole page inside: nothing to advise, and no overflow at the top of the address space.
    #[test]
    fn a_range_without_a_whole_page_is_left_alone() {
        no_huge_pages(4097, 100);
        no_huge_pages(usize::MAX - 10, 100);
    }
}
