//! Shutdown signalling shared by every core: the request (SIGTERM/SIGINT), and the drain that
//! keeps each core answering hops until every core has finished its own connections.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use event_listener::Event;

use crate::limits::DRAIN_TIMEOUT;

static SHUTTING_DOWN: AtomicBool = AtomicBool::new(false);
static SHUTDOWN: Event = Event::new();
/// Cores still draining their connections; the hop must keep working until all are done.
static DRAINING: AtomicUsize = AtomicUsize::new(0);

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
/// every other core, so hops from draining peers are still served. Bounded by the drain budget.
pub(super) async fn drain_core(live: fn() -> usize) {
    let deadline = Instant::now() + DRAIN_TIMEOUT + Duration::from_secs(1);
    while live() > 0 && Instant::now() < deadline {
        glommio::timer::sleep(Duration::from_millis(2)).await;
    }
    DRAINING.fetch_sub(1, Ordering::SeqCst);
    while DRAINING.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
        glommio::timer::sleep(Duration::from_millis(2)).await;
    }
}
