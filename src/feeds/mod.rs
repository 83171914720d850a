//! The two server-streaming RPCs, StreamCacheEvents and StreamMetrics (docs/BEHAVIOUR.md §11).
//!
//! Both are off until configured: with `--max-event-subscribers 0` / `--max-metric-subscribers
//! 0` (the defaults) each call closes at once with OK and no messages, the reference's stub.
//!
//! * [`events`] — a live feed of the index changes the server applies, published by whichever
//!   core handled the producer's call (so every core feeds every subscriber), and of the
//!   entries the index removes on its own (TTL sweep, global cap, tenant quota), into one bounded
//!   lock-free queue per subscriber. Publishing never waits: when a subscriber's queue is full
//!   the change is dropped for it, and once it has read what was queued its stream ends with
//!   `RESOURCE_EXHAUSTED` saying how many changes it missed. Ingest never slows down.
//! * [`metrics`] — the requested series, read from the same registry as `/metrics` (a full
//!   scrape on the admin thread) at a fixed interval, into a bounded channel per subscriber.

pub mod events;
pub mod metrics;

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::limits::{MAX_EVENT_SUBSCRIBERS, MAX_METRIC_SUBSCRIBERS};

/// `--max-event-subscribers`, clamped to [`MAX_EVENT_SUBSCRIBERS`] (0 = the reference's stub).
static EVENT_SUBSCRIBER_CAP: AtomicUsize = AtomicUsize::new(0);
/// `--max-metric-subscribers`, clamped to [`MAX_METRIC_SUBSCRIBERS`] (0 = the stub).
static METRIC_SUBSCRIBER_CAP: AtomicUsize = AtomicUsize::new(0);

/// Sets the subscriber caps from the flags (at start-up, before serving).
pub fn configure(max_event_subscribers: usize, max_metric_subscribers: usize) {
    EVENT_SUBSCRIBER_CAP.store(
        max_event_subscribers.min(MAX_EVENT_SUBSCRIBERS),
        Ordering::SeqCst,
    );
    METRIC_SUBSCRIBER_CAP.store(
        max_metric_subscribers.min(MAX_METRIC_SUBSCRIBERS),
        Ordering::SeqCst,
    );
}

fn event_cap() -> usize {
    EVENT_SUBSCRIBER_CAP.load(Ordering::Relaxed)
}

fn metric_cap() -> usize {
    METRIC_SUBSCRIBER_CAP.load(Ordering::Relaxed)
}
