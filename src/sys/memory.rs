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
