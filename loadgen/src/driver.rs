//! Request scheduling: open loop (fixed arrival rate, coordinated-omission-correct) and closed
//! loop (fixed concurrency). The drivers know nothing about gRPC: they hand out [`Ticket`]s to a
//! caller-supplied closure that builds the request future, which keeps them testable with fake
//! servers.
//!
//! Open loop: request `i` is *due* at `start + i / rate`, whatever happened before. A dedicated OS
//! thread (not a tokio timer, whose 1 ms wheel would add up to a millisecond of client-side skew
//! to every sample) sleeps until each due time and spawns the request onto the runtime. If the
//! client falls behind — a stall, the in-flight cap, a slow machine — requests are sent late but
//! keep their original due time in the ticket, so the latency measured from it charges the delay
//! to every request that was held up (the coordinated-omission correction).

use std::future::Future;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// When a run stops: after `requests` requests and/or after `duration`, whichever comes first.
/// At least one must be set; the CLI guarantees it (every loop is bounded).
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// Maximum number of requests to start.
    pub requests: Option<u64>,
    /// Maximum time during which requests are started.
    pub duration: Option<Duration>,
}

/// One request to send: its sequence index and the time it should have been sent.
#[derive(Clone, Copy, Debug)]
pub struct Ticket {
    /// Position in the request sequence (0-based, dense).
    pub index: u64,
    /// Intended send time. Open loop: the schedule's due time (measure latency from here).
    /// Closed loop: when the driver asked for the request; the caller restarts the clock when
    /// it sends the request it built.
    pub intended: Instant,
}

/// What a driver did, for the report.
#[derive(Clone, Copy, Debug, Default)]
pub struct DriveStats {
    /// Requests started.
    pub started: u64,
    /// Time from the first due time until the last request completed (or the drain gave up);
    /// in open loop at least `started / rate`.
    pub elapsed: Duration,
    /// Requests still running when the drain timeout expired (they are abandoned).
    pub abandoned: u64,
}

/// Due time of request `i` at `rate` req/s after `start`.
pub fn due_time(start: Instant, i: u64, rate: f64) -> Instant {
    start + Duration::from_secs_f64(i as f64 / rate)
}

/// Sends requests at `rate` req/s until `bounds` or `stop`, with at most `max_inflight` in
/// flight. `make` is called on the dispatcher thread, strictly in index order, and returns the
/// request future, which is spawned onto the current runtime; `on_lag` receives how late each
/// request left versus its due time. Waits up to `drain` for in-flight requests at the end.
pub async fn open_loop<M, F>(
    rate: f64,
    bounds: Bounds,
    max_inflight: usize,
    drain: Duration,
    stop: Arc<AtomicBool>,
    mut make: M,
) -> DriveStats
where
    M: FnMut(Ticket) -> F + Send + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    assert!(rate > 0.0 && rate.is_finite(), "rate must be positive");
    let max_inflight = max_inflight.clamp(1, Semaphore::MAX_PERMITS);
    let sem = Arc::new(Semaphore::new(max_inflight));
    let handle = tokio::runtime::Handle::current();
    let start = Instant::now();
    let end = bounds.duration.map(|d| start + d);
    let sem2 = sem.clone();
    let started = tokio::task::spawn_blocking(move || {
        let mut i: u64 = 0;
        loop {
            if stop.load(Ordering::Relaxed) || bounds.requests.is_some_and(|n| i >= n) {
                break;
            }
            let due = due_time(start, i, rate);
            if end.is_some_and(|e| due >= e) {
                break;
            }
            let now = Instant::now();
            if due > now {
                // Short sleeps so a stop request is seen promptly even at very low rates.
                std::thread::sleep((due - now).min(Duration::from_millis(50)));
                continue;
            }
            let Some(permit) = acquire_inflight(&sem2, &stop, &handle) else {
                break;
            };
            let fut = make(Ticket {
                index: i,
                intended: due,
            });
            handle.spawn(async move {
                fut.await;
                drop(permit);
            });
            i += 1;
        }
        i
    })
    .await
    .unwrap_or(0);
    let abandoned = drain_all(&sem, max_inflight, drain).await;
    // The window is at least the schedule's span (n requests occupy n / rate seconds), so a
    // client that kept up reports exactly the target rate.
    let span = Duration::from_secs_f64(started as f64 / rate);
    DriveStats {
        started,
        elapsed: start.elapsed().max(span),
        abandoned,
    }
}

/// An in-flight slot for the open-loop dispatcher thread, blocking while all are taken; None
/// once `stop` is set.
fn acquire_inflight(
    sem: &Arc<Semaphore>,
    stop: &AtomicBool,
    handle: &tokio::runtime::Handle,
) -> Option<OwnedSemaphorePermit> {
    loop {
        if let Ok(p) = sem.clone().try_acquire_owned() {
            return Some(p);
        }
        if stop.load(Ordering::Relaxed) {
            return None;
        }
        // Saturated: wake as soon as a request completes (re-checking stop every 50 ms).
        let wait = tokio::time::timeout(Duration::from_millis(50), sem.clone().acquire_owned());
        if let Ok(Ok(p)) = handle.block_on(wait) {
            return Some(p);
        }
    }
}

/// Waits until every permit is back (all requests done) or `drain` passes; returns how many
/// requests were still in flight.
async fn drain_all(sem: &Semaphore, total: usize, drain: Duration) -> u64 {
    let res = tokio::time::timeout(drain, sem.acquire_many(total as u32)).await;
    match res {
        Ok(Ok(_)) => 0,
        _ => (total - sem.available_permits()) as u64,
    }
}

/// Runs `concurrency` workers, each sending its next request as soon as the previous one
/// completed, until `bounds` or `stop`. Request indices are assigned together with the call to
/// `make` under one lock, so the sequence is deterministic. Latency in closed loop is service
/// time (the ticket's `intended` is the actual send time): a closed loop cannot observe the
/// queueing its own back-off hides; use open loop for capacity numbers.
pub async fn closed_loop<M, F>(
    concurrency: usize,
    bounds: Bounds,
    stop: Arc<AtomicBool>,
    make: M,
) -> DriveStats
where
    M: FnMut(Ticket) -> F + Send + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let make = Arc::new(Mutex::new(make));
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let end = bounds.duration.map(|d| start + d);
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let (make, next, stop) = (make.clone(), next.clone(), stop.clone());
        workers.spawn(async move {
            loop {
                if stop.load(Ordering::Relaxed) || end.is_some_and(|e| Instant::now() >= e) {
                    break;
                }
                let fut = {
                    let mut m = make.lock().unwrap_or_else(|e| e.into_inner());
                    let i = next.load(Ordering::Relaxed);
                    if bounds.requests.is_some_and(|n| i >= n) {
                        break;
                    }
                    next.store(i + 1, Ordering::Relaxed);
                    m(Ticket {
                        index: i,
                        intended: Instant::now(),
                    })
                };
                fut.await;
            }
        });
    }
    while workers.join_next().await.is_some() {}
    DriveStats {
        started: next.load(Ordering::Relaxed),
        elapsed: start.elapsed(),
        abandoned: 0,
    }
}
