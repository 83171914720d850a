//! A busy connection leaves its core's reactor a turn between two of its own: a batch of
//! pipelined LookupRoutes, many turns' worth, through the real front end in process
//! (`examples/frontend_harness`), while a probe task counts the core's reactor turns.
//!
//! A connection that woke itself after a cut turn stayed runnable, and glommio polls the core's
//! I/O and fires its timers only once no task is runnable or its preemption timer fires: a
//! flooding connection took turn after turn for that long before another connection's request
//! was even seen (perf/runs/2026-12-06-quiet-client-p99.md).

use std::cell::Cell;
use std::rc::Rc;

#[path = "../examples/frontend_harness/mod.rs"]
mod frontend_harness;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Requests written at once: 4,000 frames, over fifteen turns of `HTTP2_FRAMES_PER_TURN`.
const BATCH: usize = 2_000;

#[test]
fn a_busy_connection_lets_the_reactor_turn_between_its_turns() {
    let (ex, mut client) = frontend_harness::setup();
    let turns = ex.run(async {
        let (turns, stop) = (Rc::new(Cell::new(0u64)), Rc::new(Cell::new(false)));
        let probe = glommio::spawn_local(reactor_turns(turns.clone(), stop.clone()));
        // The probe is armed before the batch arrives.
        glommio::timer::sleep(std::time::Duration::from_millis(1)).await;
        let before = turns.get();
        client.send(BATCH).await;
        client.answers(BATCH).await;
        let during = turns.get() - before;
        stop.set(true);
        probe.await;
        during
    });
    eprintln!("{BATCH} pipelined requests: {turns} reactor turns");
    // Fifteen cut turns or more, each followed by a reactor turn; with a self-wake the batch
    // ran through in one or two (the executor's preemption timer is glommio's 100 ms here).
    assert!(
        turns >= 8,
        "{turns} reactor turns while a connection served {BATCH} pipelined requests"
    );
}

/// Counts the core's reactor turns until `stop`: waits, again and again, on a timer due in a
/// microsecond, which only a reactor turn fires (reset if already due when polled).
async fn reactor_turns(turns: Rc<Cell<u64>>, stop: Rc<Cell<bool>>) {
    use std::future::Future;
    let turn = std::time::Duration::from_micros(1);
    let mut timer = glommio::timer::Timer::new(turn);
    while !stop.get() {
        let mut armed = false;
        std::future::poll_fn(|cx| {
            if armed {
                return std::pin::Pin::new(&mut timer).poll(cx).map(drop);
            }
            for _ in 0..4 {
                timer.reset(turn);
                if std::pin::Pin::new(&mut timer).poll(cx).is_pending() {
                    armed = true;
                    return std::task::Poll::Pending;
                }
            }
            std::task::Poll::Ready(())
        })
        .await;
        turns.set(turns.get() + 1);
    }
}
