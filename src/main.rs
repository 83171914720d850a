//! `inference-cache-server`: the InferenceCache gRPC server and its HTTP listeners. Everything
//! lives in the library (src/lib.rs); the binary adds the allocator.

/// mimalloc: per-thread heaps for the per-request allocations (prost messages, HTTP/2 frames;
/// see Cargo.toml).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (mimalloc.h's `mi_option_e`, v3).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// The environment variable mimalloc reads for the same option; when an operator sets it, it
/// wins.
const PURGE_DELAY_ENV: &str = "MIMALLOC_PURGE_DELAY";

/// mimalloc's `mi_option_allow_thp` (mimalloc.h's `mi_option_e`, v3).
const MI_OPTION_ALLOW_THP: libmimalloc_sys::mi_option_t = 43;

fn main() {
    keep_freed_memory();
    no_huge_pages();
    std::process::exit(inference_cache::run());
}

/// Freed memory stays with the allocator for reuse instead of being purged (madvise) back to
/// the OS: a TTL pass that frees millions of entries otherwise makes the core thread purge
/// gigabytes while it serves, and lookups stalled for up to tens of ms behind that kernel work.
/// The high-water mark this keeps is bounded by the entry cap (`--index-max-entries`).
fn keep_freed_memory() {
    if std::env::var_os(PURGE_DELAY_ENV).is_none() {
        // SAFETY: sets a process-wide allocator option (an integer) by its documented id; mimalloc
        // allows changing options at any time, and -1 is its documented "never purge" value.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
}

/// No transparent huge pages (see `sys::memory::no_transparent_huge_pages`): a 2 MiB first-touch
/// fault costs milliseconds inside one maintenance slice. mimalloc is told too, so it sizes its
/// purges for 4 KiB pages and stops advising huge pages on the arenas it maps from now on.
fn no_huge_pages() {
    if inference_cache::no_transparent_huge_pages() {
        // SAFETY: sets a process-wide allocator option (an integer) by its documented id;
        // mimalloc allows changing options at any time, and 0 is its documented "no THP" value.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_ALLOW_THP, 0) };
    }
}
