//! Steady-state lookups (exact, chain, TENANT_HOT, classifier misses, LFU credit, affinity) do
//! not allocate: counted with a per-thread counting global allocator.

mod index_support;

use index_support::*;
use inferencecache_index::index::Strategy;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so `System`'s
// guarantees hold; the thread-local counter has no effect on the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract for `l`.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` was allocated by this allocator, i.e. by `System`, with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: `p` was allocated by `System` with layout `l`; the caller guarantees `n` is a
        // valid size for `l`'s alignment.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(|c| c.get())
}

#[test]
fn steady_state_lookups_do_not_allocate() {
    let rules = Rules::lfu("t");
    let mut ix = index();
    for r in ["r1", "r2", "r3"] {
        ix.ingest(
            &with_stats(
                upd_r(
                    r,
                    vec![chain_entry(&[b"b1", b"b2", b"b3"], 16), legacy(b"p", 32)],
                ),
                0.9,
                0.2,
            ),
            T0,
            &rules,
        );
    }
    ix.ingest(
        &upd_r("r4", vec![legacy(&[7u8; 8], 16), legacy(&[9u8; 32], 16)]),
        T0,
        &rules,
    );
    let c = chain(&[b"b1", b"b2", b"b3"], 16);
    let c8 = chain(&[&[7u8; 8], &[1u8; 8]], 16);
    let run = |ix: &mut inferencecache_index::index::Index| {
        assert_eq!(
            ix.lookup_route(&c.q(), T0, &rules).strategy,
            Strategy::PrefixMatch
        );
        ix.credit_lfu(|r| r != "r2", &rules);
        assert_eq!(
            ix.lookup_route(&c8.q(), T0, &rules).strategy,
            Strategy::PrefixMatch
        );
        assert_eq!(
            ix.lookup_route(&q_exact(b"p"), T0, &rules).strategy,
            Strategy::PrefixMatch
        );
        ix.credit_lfu(|_| true, &rules);
        assert_eq!(
            ix.lookup_route(&q_exact(&[9u8; 32]), T0, &rules).strategy,
            Strategy::PrefixMatch
        );
        assert_eq!(
            ix.lookup_route(&q_exact(b"novel"), T0, &rules).strategy,
            Strategy::TenantHot
        );
        let mut q = q_exact(b"p");
        q.tenant = "nobody";
        assert_eq!(
            ix.lookup_route(&q, T0, &rules).strategy,
            Strategy::UnknownTenant
        );
        q.tenant = "t";
        q.model = "other";
        assert_eq!(
            ix.lookup_route(&q, T0, &rules).strategy,
            Strategy::UnknownModel
        );
        assert!(ix.affinity_hint("t", "m", "vllm", b"seed").is_some());
        assert!(!ix.lookup(&c.q(), T0, &rules).scores.is_empty());
    };
    run(&mut ix); // warm-up: buffers grow to their steady size
    let before = allocs();
    for _ in 0..100 {
        run(&mut ix);
    }
    assert_eq!(allocs() - before, 0, "steady-state lookups allocated");
}
