//! Core liveness: each core stamps a heartbeat from its own task queue; a watchdog on the admin
//! thread marks a core stalled when its stamp is older than [`CORE_STALL_AFTER`]. `/readyz`
//! answers 503 while any core is stalled, and new work for a stalled core fails at once instead
//! of queueing behind it.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::limits::{CORE_HEARTBEAT_INTERVAL, CORE_STALL_AFTER};

struct Health {
    /// Milliseconds since `start` of each core's last heartbeat.
    beats: Box<[AtomicU64]>,
    /// Set by the watchdog; read by the hop and `/readyz`.
    stalled: Box<[AtomicBool]>,
    start: Instant,
}

static HEALTH: OnceLock<Health> = OnceLock::new();

pub(super) fn init(cores: usize) {
    let health = Health {
        beats: (0..cores).map(|_| AtomicU64::new(0)).collect(),
        stalled: (0..cores).map(|_| AtomicBool::new(false)).collect(),
        start: Instant::now(),
    };
    assert!(HEALTH.set(health).is_ok(), "core health set twice");
}

fn now_ms(h: &Health) -> u64 {
    h.start.elapsed().as_millis() as u64
}

/// Stamps `core`'s heartbeat every [`CORE_HEARTBEAT_INTERVAL`] for the executor's lifetime.
/// Each tick's lateness (how long after it was due the core's task queue got to it) is
/// recorded (`inferencecache_core_heartbeat_max_lag_seconds`).
pub(super) async fn heartbeat_loop(core: usize) {
    let h = HEALTH.get().expect("core health");
    loop {
        h.beats[core].store(now_ms(h), Ordering::Relaxed);
        let due = Instant::now() + CORE_HEARTBEAT_INTERVAL;
        glommio::timer::sleep(CORE_HEARTBEAT_INTERVAL).await;
        crate::metrics::record_heartbeat_lag(Instant::now().saturating_duration_since(due));
    }
}

/// Whether `core` is marked stalled (one relaxed load; false before start-up).
pub fn is_stalled(core: usize) -> bool {
    HEALTH
        .get()
        .is_some_and(|h| h.stalled[core].load(Ordering::Relaxed))
}

/// Whether any core is marked stalled.
pub fn any_stalled() -> bool {
    HEALTH
        .get()
        .is_some_and(|h| h.stalled.iter().any(|s| s.load(Ordering::Relaxed)))
}

/// Marks each core stalled or live from its heartbeat age; logs each transition.
fn check(h: &Health, stall_after: Duration) {
    let now = now_ms(h);
    for (core, beat) in h.beats.iter().enumerate() {
        let age = now.saturating_sub(beat.load(Ordering::Relaxed));
        let stalled = age > stall_after.as_millis() as u64;
        if h.stalled[core].swap(stalled, Ordering::Relaxed) != stalled {
            if stalled {
                tracing::error!(core, age_ms = age, "core_stalled");
            } else {
                tracing::warn!(core, "core_recovered");
            }
        }
    }
}

/// The watchdog, run on the admin thread until shutdown (draining cores stop beating, which
/// is not a stall).
pub async fn watchdog() {
    let Some(h) = HEALTH.get() else { return };
    while !super::shutting_down() {
        tokio::time::sleep(CORE_HEARTBEAT_INTERVAL).await;
        check(h, CORE_STALL_AFTER);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_heartbeats_mark_cores_stalled_and_fresh_ones_clear_it() {
        let h = Health {
            beats: (0..2).map(|_| AtomicU64::new(0)).collect(),
            stalled: (0..2).map(|_| AtomicBool::new(false)).collect(),
            start: Instant::now() - Duration::from_secs(10),
        };
        h.beats[0].store(now_ms(&h), Ordering::Relaxed);
        check(&h, Duration::from_secs(5));
        assert!(!h.stalled[0].load(Ordering::Relaxed));
        assert!(h.stalled[1].load(Ordering::Relaxed));
        h.beats[1].store(now_ms(&h), Ordering::Relaxed);
        check(&h, Duration::from_secs(5));
        assert!(!h.stalled[1].load(Ordering::Relaxed));
    }
}
