//! StreamCacheEvents: the live feed of index changes.
//!
//! What is published (after the owner core applied it): for every ReportCacheState message, one
//! `PREFIX_ADDED` per prefix entry (its `prefix_hash`, or for a chain entry without one the last
//! block hash; the entry's adapter or the message's) and one `REPLICA_UPDATED` when the message
//! carries stats; every PublishEvent as received (`PREFIX_ADDED`, `PREFIX_EVICTED`,
//! `REPLICA_UPDATED`, `ALL_CLEARED`). The timestamp is the producer's, or the server's clock when
//! the producer sent none. Not published: messages refused or not applied, and the probe tenant.
//!
//! The entries the index removes on its own are published too, as `PREFIX_EVICTED` (one per
//! removed `(key, replica)` entry, timestamped with the server's clock of the removal), through
//! the index's removal hook ([`removal_sink`], installed on every core while the feed is on):
//! the TTL sweep's at once, from the sweeping core; the global cap's and a tenant quota's, which
//! happen inside an ingest, are held back on the owner core ([`take_removals`], at most
//! [`EVENT_REMOVAL_BURST`]) and published by the caller right after that ingest's own changes
//! ([`publish_removals`]), so an entry is never seen evicted before it was added. The contract's
//! `CacheEvent` has no reason field: why an entry went is counted in
//! `inferencecache_index_evictions_total{reason}` and `inferencecache_tenant_evictions_total`.
//! While nobody subscribes the hook returns after one relaxed load.

use std::cell::{Cell, RefCell};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};

use crossbeam_queue::ArrayQueue;
use futures_util::Stream;
use futures_util::task::AtomicWaker;
use inferencecache_index::index::{RemovalReason, RemovalSink, Removed};
use inferencecache_proto::v1alpha1 as pb;
use pb::cache_event::Type;
use tonic::Status;

use crate::limits::{EVENT_REMOVAL_BURST, EVENT_SUBSCRIBER_BUFFER};

/// The `rpc` label of `inferencecache_rpc_calls_total`.
const RPC: &str = "StreamCacheEvents";

/// One subscriber: its filter, its bounded queue, and how many changes it missed.
struct Subscriber {
    model: String,
    tenant: String,
    /// Bit `t` set = type `t` wanted (all when the request listed none).
    types: u8,
    queue: ArrayQueue<pb::CacheEvent>,
    waker: AtomicWaker,
    dropped: AtomicU64,
}

impl Subscriber {
    fn matches(&self, model: &str, tenant: &str) -> bool {
        (self.model.is_empty() || self.model == model)
            && (self.tenant.is_empty() || self.tenant == tenant)
    }

    fn wants(&self, t: Type) -> bool {
        self.types & (1 << t as u8) != 0
    }

    /// Queues `ev` without waiting; a full queue drops it and marks the subscriber lagging.
    fn offer(&self, ev: pb::CacheEvent) {
        self.offer_with(|| ev);
    }

    /// [`Self::offer`] building the event only if it can still be queued.
    fn offer_with(&self, make: impl FnOnce() -> pb::CacheEvent) {
        if self.dropped.load(Ordering::Relaxed) > 0 {
            // Lagging: its stream ends after what is queued; nothing more is queued.
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if self.queue.push(make()).is_err() && self.dropped.fetch_add(1, Ordering::Relaxed) == 0 {
            crate::metrics::record_limit_hit("event_subscriber_buffer");
        }
        self.waker.wake();
    }

    /// Marks the subscriber lagging by `n` changes it will never receive.
    fn missed(&self, n: u64) {
        self.dropped.fetch_add(n, Ordering::Relaxed);
        self.waker.wake();
    }

    fn poll_next(&self, cx: &mut Context<'_>) -> Poll<Next> {
        for _ in 0..2 {
            if let Some(ev) = self.queue.pop() {
                return Poll::Ready(Next::Event(ev));
            }
            let dropped = self.dropped.load(Ordering::Acquire);
            if dropped > 0 {
                return Poll::Ready(Next::Lagged(dropped));
            }
            self.waker.register(cx.waker());
        }
        Poll::Pending
    }
}

enum Next {
    Event(pb::CacheEvent),
    Lagged(u64),
}

/// Subscribers in a list written only on subscribe/unsubscribe; [`SUBSCRIBED`] lets publishers
/// skip it entirely (one relaxed load) while nobody listens.
static SUBSCRIBERS: RwLock<Vec<Arc<Subscriber>>> = RwLock::new(Vec::new());
static SUBSCRIBED: AtomicUsize = AtomicUsize::new(0);

fn each_subscriber(model: &str, tenant: &str, mut f: impl FnMut(&Subscriber)) {
    every_subscriber(|s| {
        if s.matches(model, tenant) {
            f(s)
        }
    });
}

fn every_subscriber(f: impl FnMut(&Subscriber)) {
    if SUBSCRIBED.load(Ordering::Relaxed) == 0 {
        return;
    }
    let subs = SUBSCRIBERS.read().unwrap_or_else(|e| e.into_inner());
    subs.iter().map(|s| &**s).for_each(f);
}

fn timestamp(us: i64) -> i64 {
    if us > 0 {
        us
    } else {
        crate::sys::clock::unix_now_ns() / 1_000
    }
}

/// Publishes the changes of one applied ReportCacheState message (see the module comment).
pub fn publish_ingest(u: &pb::CacheStateUpdate) {
    each_subscriber(&u.model_id, &u.tenant_id, |s| {
        let event = |t: Type, prefix_hash: Vec<u8>, adapter: &str| pb::CacheEvent {
            r#type: t as i32,
            replica_id: u.replica_id.clone(),
            model_id: u.model_id.clone(),
            tenant_id: u.tenant_id.clone(),
            prefix_hash,
            timestamp_us: timestamp(u.timestamp_us),
            adapter_id: adapter.to_string(),
        };
        if s.wants(Type::PrefixAdded) {
            for p in &u.prefixes {
                let hash = if p.prefix_hash.is_empty() {
                    p.block_hashes.last().cloned().unwrap_or_default()
                } else {
                    p.prefix_hash.clone()
                };
                let adapter = if p.adapter_id.is_empty() {
                    &u.adapter_id
                } else {
                    &p.adapter_id
                };
                s.offer(event(Type::PrefixAdded, hash, adapter));
            }
        }
        if u.stats.is_some() && s.wants(Type::ReplicaUpdated) {
            s.offer(event(Type::ReplicaUpdated, Vec::new(), &u.adapter_id));
        }
    });
}

/// Publishes one applied PublishEvent.
pub fn publish_event(e: &pb::CacheEvent) {
    let Ok(t) = Type::try_from(e.r#type) else {
        return;
    };
    if t == Type::Unspecified {
        return;
    }
    each_subscriber(&e.model_id, &e.tenant_id, |s| {
        if s.wants(t) {
            s.offer_with(|| {
                let mut ev = e.clone();
                ev.timestamp_us = timestamp(e.timestamp_us);
                ev
            });
        }
    });
}

thread_local! {
    /// This core's held-back cap/quota removals (see the module comment), at most
    /// [`EVENT_REMOVAL_BURST`].
    static HELD: RefCell<Vec<pb::CacheEvent>> = const { RefCell::new(Vec::new()) };
    /// Removals past [`EVENT_REMOVAL_BURST`] since the last [`take_removals`].
    static HELD_DROPPED: Cell<u64> = const { Cell::new(0) };
}

/// The index's removal hook for one core: publishes the TTL sweep's removals at once and holds
/// back the cap's and quotas' for [`take_removals`]. Installed only while the feed is on.
pub fn removal_sink() -> RemovalSink {
    Box::new(on_removed)
}

fn on_removed(r: &Removed<'_>) {
    if SUBSCRIBED.load(Ordering::Relaxed) == 0 || r.reserved() {
        return;
    }
    let (model, tenant) = (r.model(), r.tenant());
    let mut wanted = false;
    each_subscriber(model, tenant, |s| wanted |= s.wants(Type::PrefixEvicted));
    if !wanted {
        return;
    }
    let mut buf = [0u8; 8];
    let ev = pb::CacheEvent {
        r#type: Type::PrefixEvicted as i32,
        replica_id: r.replica().to_string(),
        model_id: model.to_string(),
        tenant_id: tenant.to_string(),
        prefix_hash: r.prefix_hash(&mut buf).to_vec(),
        timestamp_us: r.at_ns() / 1_000,
        adapter_id: r.adapter().to_string(),
    };
    match r.reason() {
        // Cut off with a producer's own removal: published as it happens, as a sweep's.
        RemovalReason::Ttl | RemovalReason::RunExtents => publish_event(&ev),
        RemovalReason::Cap | RemovalReason::Quota => HELD.with(|h| {
            let mut h = h.borrow_mut();
            if h.len() < EVENT_REMOVAL_BURST {
                h.push(ev);
            } else {
                let n = HELD_DROPPED.get();
                if n == 0 {
                    crate::metrics::record_limit_hit("event_removal_burst");
                }
                HELD_DROPPED.set(n + 1);
            }
        }),
    }
}

/// The cap/quota removals this core held back during the ingest it just ran (call on the owner
/// core, right after the ingest); an empty `Removals` allocates nothing.
pub fn take_removals() -> Removals {
    Removals {
        events: HELD.with(|h| std::mem::take(&mut *h.borrow_mut())),
        dropped: HELD_DROPPED.replace(0),
    }
}

/// Removals taken from an owner core by [`take_removals`], for [`publish_removals`].
#[derive(Debug, Default)]
pub struct Removals {
    events: Vec<pb::CacheEvent>,
    dropped: u64,
}

impl Removals {
    /// Appends `later`'s removals (the next eviction step of the same ingest), keeping at most
    /// [`EVENT_REMOVAL_BURST`] held in all, as one step would: one ingest's burst, whatever the
    /// steps its evictions ran in. The rest are counted as dropped (and the limit hit once).
    pub fn absorb(&mut self, later: Removals) {
        let room = EVENT_REMOVAL_BURST.saturating_sub(self.events.len());
        let over = later.events.len().saturating_sub(room);
        if over > 0 && self.dropped == 0 && later.dropped == 0 {
            crate::metrics::record_limit_hit("event_removal_burst");
        }
        let mut events = later.events;
        events.truncate(room);
        self.events.append(&mut events);
        self.dropped += later.dropped + over as u64;
    }
}

/// Publishes removals held back by an ingest, after that ingest's own changes. When some were
/// dropped past [`EVENT_REMOVAL_BURST`], every subscriber that wants evictions is told it fell
/// behind.
pub fn publish_removals(r: Removals) {
    for ev in &r.events {
        publish_event(ev);
    }
    if r.dropped > 0 {
        every_subscriber(|s| {
            if s.wants(Type::PrefixEvicted) {
                s.missed(r.dropped);
            }
        });
    }
}

/// Removes its subscriber when the stream is dropped (client gone, stream ended).
struct Registration(Arc<Subscriber>);

impl Drop for Registration {
    fn drop(&mut self) {
        let mut subs = SUBSCRIBERS.write().unwrap_or_else(|e| e.into_inner());
        subs.retain(|s| !Arc::ptr_eq(s, &self.0));
        SUBSCRIBED.store(subs.len(), Ordering::Relaxed);
    }
}

/// A boxed stream of events (or the final status).
pub type EventStream = Pin<Box<dyn Stream<Item = Result<pb::CacheEvent, Status>> + Send>>;

/// Answers one StreamCacheEvents call: the reference's stub while the feed is off, otherwise a
/// subscription (refused with `RESOURCE_EXHAUSTED` past the subscriber cap).
pub fn subscribe(req: pb::StreamEventsRequest) -> EventStream {
    let cap = super::event_cap();
    if cap == 0 {
        return Box::pin(futures_util::stream::empty());
    }
    let mut types = 0u8;
    for t in &req.types {
        if let Ok(t) = Type::try_from(*t)
            && t != Type::Unspecified
        {
            types |= 1 << t as u8;
        }
    }
    if types == 0 {
        types = u8::MAX;
    }
    let sub = Arc::new(Subscriber {
        model: req.model_id,
        tenant: req.tenant_id,
        types,
        queue: ArrayQueue::new(EVENT_SUBSCRIBER_BUFFER),
        waker: AtomicWaker::new(),
        dropped: AtomicU64::new(0),
    });
    {
        let mut subs = SUBSCRIBERS.write().unwrap_or_else(|e| e.into_inner());
        if subs.len() >= cap {
            drop(subs);
            crate::metrics::record_limit_hit("event_subscribers");
            crate::metrics::record_rpc(RPC, "TOO_MANY_SUBSCRIBERS");
            let refused =
                Status::resource_exhausted(format!("at most {cap} StreamCacheEvents subscribers"));
            return Box::pin(futures_util::stream::once(async move { Err(refused) }));
        }
        subs.push(sub.clone());
        SUBSCRIBED.store(subs.len(), Ordering::Relaxed);
    }
    crate::metrics::record_rpc(RPC, "SUBSCRIBED");
    let state = (Registration(sub), false);
    Box::pin(futures_util::stream::unfold(
        state,
        |(reg, finished)| async move {
            if finished {
                return None;
            }
            let next = {
                let sub = reg.0.clone();
                let next = futures_util::future::poll_fn(move |cx| sub.poll_next(cx));
                let ended = async {
                    crate::runtime::shutdown_requested().await;
                    None
                };
                futures_lite::future::or(async { Some(next.await) }, ended).await
            };
            match next? {
                Next::Event(ev) => Some((Ok(ev), (reg, false))),
                Next::Lagged(n) => {
                    crate::metrics::record_rpc(RPC, "LAGGED");
                    let status = Status::resource_exhausted(format!(
                        "subscriber fell behind: {n} changes dropped after the queued ones \
                         (buffer {EVENT_SUBSCRIBER_BUFFER}); resubscribe"
                    ));
                    Some((Err(status), (reg, true)))
                }
            }
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sub(types: u8) -> Subscriber {
        Subscriber {
            model: "m".into(),
            tenant: String::new(),
            types,
            queue: ArrayQueue::new(2),
            waker: AtomicWaker::new(),
            dropped: AtomicU64::new(0),
        }
    }

    #[test]
    fn filters_by_model_tenant_and_type() {
        let s = sub(1 << Type::PrefixEvicted as u8);
        assert!(s.matches("m", "any-tenant"));
        assert!(!s.matches("other", "t"));
        assert!(s.wants(Type::PrefixEvicted));
        assert!(!s.wants(Type::PrefixAdded));
    }

    #[test]
    fn a_full_queue_drops_and_reports_the_gap_after_the_queued_events() {
        let s = sub(u8::MAX);
        for i in 0..5 {
            s.offer(pb::CacheEvent {
                timestamp_us: i,
                ..Default::default()
            });
        }
        assert_eq!(s.dropped.load(Ordering::Relaxed), 3);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut seen = Vec::new();
        loop {
            match s.poll_next(&mut cx) {
                Poll::Ready(Next::Event(e)) => seen.push(e.timestamp_us),
                Poll::Ready(Next::Lagged(n)) => {
                    assert_eq!(n, 3);
                    break;
                }
                Poll::Pending => panic!("a lagging subscriber is told so"),
            }
        }
        assert_eq!(seen, vec![0, 1]);
    }
}
