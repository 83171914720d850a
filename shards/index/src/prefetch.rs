//! A hint to the CPU that a cache line will be read soon.
#![allow(unsafe_code)]

/// Asks the CPU to bring the line holding `at` into the caches, without waiting for it.
#[inline(always)]
pub(crate) fn prefetch<T>(at: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 is a hint: it never faults and changes no state a program can
    // observe; `at` is a valid reference, and SSE is part of the x86_64 baseline.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            (at as *const T).cast(),
        )
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}
