//! The inline LookupRoute path allocates nothing per request once warm: whole requests through
//! the real front end in process (`examples/frontend_harness`), counting the allocations made on
//! the thread that runs the core, the connection and the scripted client.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;

#[path = "../examples/frontend_harness/mod.rs"]
mod frontend_harness;

/// The server's allocator, counting the calls made on each thread.
struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    // `try_with`: a thread being torn down may still free and allocate.
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
}

// SAFETY: every call is forwarded unchanged to mimalloc, which upholds `GlobalAlloc`'s
// contract; counting touches only a const-initialized thread local, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's arguments, as `GlobalAlloc` requires them, passed on.
        unsafe { mimalloc::MiMalloc.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's arguments, as `GlobalAlloc` requires them, passed on.
        unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: the caller's arguments, as `GlobalAlloc` requires them, passed on.
        unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's arguments, as `GlobalAlloc` requires them, passed on.
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Requests before counting (buffers and tables reach their working sizes).
const WARM_UP: usize = 50;
/// Requests counted.
const COUNTED: usize = 200;

#[test]
fn inline_lookup_route_allocates_nothing_per_request_once_warm() {
    let (ex, mut client) = frontend_harness::setup();
    // A prefix match, then a chain nobody holds (the affinity pick).
    let prefix = counted_run(&ex, &mut client);
    assert_eq!(last_reason(&client), "PREFIX_MATCH");
    client.set_body(frontend_harness::lookup_body_for(
        frontend_harness::UNHELD_CHAIN,
    ));
    let affinity = counted_run(&ex, &mut client);
    assert_eq!(last_reason(&client), "AFFINITY_HINT");
    eprintln!(
        "allocations in {COUNTED} requests: {prefix} prefix matches, {affinity} affinity picks"
    );
    // The executor's own timers allocate now and then; a per-request allocation would be 200.
    for (what, n) in [("prefix match", prefix), ("affinity", affinity)] {
        assert!(
            n < COUNTED as u64 / 10,
            "{what}: {n} allocations in {COUNTED} requests through the inline path"
        );
    }
}

/// Serves [`WARM_UP`] requests, then returns the allocations of [`COUNTED`] more.
fn counted_run(ex: &glommio::LocalExecutor, client: &mut frontend_harness::Client) -> u64 {
    let mut serve = |n: usize| {
        ex.run(async {
            for _ in 0..n {
                client.send(1).await;
                client.answers(1).await;
            }
        })
    };
    serve(WARM_UP);
    let before = ALLOCATIONS.with(Cell::get);
    serve(COUNTED);
    ALLOCATIONS.with(Cell::get) - before
}

/// The reason code of the last answer the client read.
fn last_reason(client: &frontend_harness::Client) -> String {
    use prost::Message;
    let resp = inferencecache_proto::v1alpha1::LookupRouteResponse::decode(&client.last_data[5..])
        .expect("an answer decodes");
    resp.reason_code
}
