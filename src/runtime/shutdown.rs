//! Shutdown signalling shared by every core: the request (SIGTERM/SIGINT), and the drain that
//! keeps each core answering hops until every core has finished its own connections.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use event_listener::Event;

use crate::limits::{DRAIN_TIMEOUT, SNAPSHOT_SHUTDOWN_BUDGET};

static SHUTTING_DOWN: AtomicBool = AtomicBool::new(false);
static SHUTDOWN: Event = Event::new();
/// Cores still draining their connections; the hop must keep working until all are done.
static DRAINING: AtomicUsize = AtomicUsize::new(0);
/// While set, drained cores keep running (serving hops) instead of exiting, so the final
/// snapshot can read them (`--state-dir`); bounded by [`SNAPSHOT_SHUTDOWN_BUDGET`].
static HOLD: AtomicBool = AtomicBool::new(false);

/// One bit per core that has finished its drain (its executor is about to end); at most 64
/// cores (`MAX_SHARDS`).
static FINISHED: AtomicU64 = AtomicU64::new(0);

const _: () = assert!(crate::limits::MAX_SHARDS <= 64, "one bit per core");

/// Records that `core` finished its drain.
pub(super) fn set_core_finished(core: usize) {
    FINISHED.fetch_or(1 << core, Ordering::SeqCst);
}

/// Whether `core` finished its drain.
pub(super) fn core_finished(core: usize) -> bool {
    FINISHED.load(Ordering::SeqCst) & (1 << core) != 0
}

/// Whether cores `0..cores` all finished their drain.
pub(super) fn all_cores_finished(cores: usize) -> bool {
    (0..cores).all(core_finished)
}

/// Keeps every core alive after its drain until [`release_cores`] (set before the runtime
/// starts; the final snapshot releases the cores when it is written).
pub fn hold_cores_after_drain() {
    HOLD.store(true, Ordering::SeqCst);
}

/// Lets drained cores exit.
pub fn release_cores() {
    HOLD.store(false, Ordering::SeqCst);
}

/// True once every core has finished draining its connections after shutdown (no more ingest
/// can arrive).
pub fn all_drained() -> bool {
    shutting_down() && DRAINING.load(Ordering::SeqCst) == 0
}

/// Sets the number of cores that will drain (at start).
pub(super) fn set_draining(cores: usize) {
    DRAINING.store(cores, Ordering::SeqCst);
}

/// Asks every core to stop accepting and drain (SIGTERM/SIGINT).
pub fn request_shutdown() {
    SHUTTING_DOWN.store(true, Ordering::SeqCst);
    SHUTDOWN.notify(usize::MAX);
}

/// True once shutdown was requested.
pub fn shutting_down() -> bool {
    SHUTTING_DOWN.load(Ordering::SeqCst)
}

/// Blocks the calling thread (never a core's) until shutdown is requested or `deadline`
/// passes; true if shutdown was requested. For threads that sleep between periodic work (the
/// snapshot writer): they wake once per period, not every few milliseconds to look at the flag.
pub fn wait_for_shutdown_until(deadline: Instant) -> bool {
    use event_listener::Listener;
    loop {
        if shutting_down() {
            return true;
        }
        let listener = SHUTDOWN.listen();
        if shutting_down() {
            return true;
        }
        if listener.wait_deadline(deadline).is_none() {
            return shutting_down();
        }
    }
}

/// Resolves once shutdown is requested.
pub async fn shutdown_requested() {
    loop {
        if shutting_down() {
            return;
        }
        let listener = SHUTDOWN.listen();
        if shutting_down() {
            return;
        }
        listener.await;
    }
}

/// After shutdown: waits for this core's connections to close (`live` counts them), then for
/// every other core, so hops from draining peers are still served, then (with `--state-dir`)
/// for the final snapshot. Bounded by the drain and snapshot budgets.
pub(super) async fn drain_core(live: fn() -> usize) {
    let deadline = Instant::now() + DRAIN_TIMEOUT + Duration::from_secs(1);
    while live() > 0 && Instant::now() < deadline {
        glommio::timer::sleep(Duration::from_millis(2)).await;
    }
    DRAINING.fetch_sub(1, Ordering::SeqCst);
    while DRAINING.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
        glommio::timer::sleep(Duration::from_millis(2)).await;
    }
    let hold_deadline = Instant::now() + SNAPSHOT_SHUTDOWN_BUDGET + Duration::from_secs(1);
    while HOLD.load(Ordering::SeqCst) && Instant::now() < hold_deadline {
        glommio::timer::sleep(Duration::from_millis(2)).await;
    }
}
