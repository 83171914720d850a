//! The allocator set-up of the server (src/main.rs): mimalloc that keeps freed memory (no
//! purge) and no transparent huge pages. The peer benchmark measures every index under it, ours
//! and the peers alike: ours never runs under another allocator, and the one an index gets
//! changes its time (perf/runs/2026-12-07-cold-lookups.md: under glibc's, ours' events were
//! 22% slower and kv-index's 16%). The binaries that use this module make mimalloc their
//! global allocator (directly, or under `alloc::Counting`).

/// mimalloc's `mi_option_purge_delay` (mimalloc.h's `mi_option_e`, v3), as the server sets it.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
/// mimalloc's `mi_option_allow_thp` (mimalloc.h's `mi_option_e`, v3), as the server sets it.
const MI_OPTION_ALLOW_THP: libmimalloc_sys::mi_option_t = 43;

/// Sets the process up as the server does by default: no transparent huge pages for the
/// process, mimalloc told so, and freed memory kept rather than purged. Call first in `main`.
pub fn configure() {
    // SAFETY: PR_SET_THP_DISABLE sets one flag of this process's memory descriptor; it reads no
    // pointer and changes no mapping's contents. Best effort: an error changes nothing.
    let thp_off = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0 };
    // SAFETY: each call sets a process-wide allocator option (an integer) by its documented id;
    // mimalloc allows changing options at any time (-1: never purge; 0: no huge pages).
    unsafe {
        libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1);
        if thp_off {
            libmimalloc_sys::mi_option_set(MI_OPTION_ALLOW_THP, 0);
        }
    }
}
