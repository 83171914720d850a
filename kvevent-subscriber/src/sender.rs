//! Delivery of index operations to the server.
//!
//! Unlike the reference subscriber (one stream per flush), additions go over ONE long-lived
//! `ReportCacheState` client stream, batched by size (`--max-batch` entries) or time
//! (`--flush-interval`). The server applies each stream message on receipt but acknowledges
//! only at end of stream, so:
//!
//! * every message sent on the open stream is kept (`unacked`, at most `--max-unacked`) until
//!   the stream is closed and acknowledged; when a stream fails, a new one is opened (with
//!   exponential backoff) and the unacknowledged messages are re-sent — upserts are idempotent,
//!   so a duplicate is harmless while a loss would not be;
//! * an event (`PREFIX_EVICTED`, `ALL_CLEARED`) must not overtake the additions before it, so it
//!   is preceded by a *barrier*: pending adds are flushed, the stream is half-closed and its Ack
//!   awaited; then the unary `PublishEvent` is sent (retried until it succeeds) and the next add
//!   opens a fresh stream on the same HTTP/2 connection.
//!
//! Nothing here drops data: a slow or absent server blocks this task, which fills the bounded
//! operation queue and so slows the ZMQ reader (back-pressure).
//!
//! Except once **fenced**: when the server refuses this process's messages because a newer
//! producer epoch was reported for its replica (a ReportCacheState Ack `FENCED`, a PublishEvent
//! `FAILED_PRECONDITION`), this process is the zombie of a restarted or duplicated sidecar. It
//! logs that once, sets `kvevent_fenced` to 1, and from then on sends nothing (neither to the
//! server nor to JetStream) and writes no checkpoint: every later operation is dropped and counted
//! (`kvevent_dropped_total{reason="fenced"}`), so the ZMQ reader is never blocked and the live
//! producer is never disturbed. It does not exit: a restarted process would start with a new,
//! newer epoch and fence the live producer in turn; an operator removes the duplicate.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use inferencecache_proto::v1alpha1::cache_event::Type;
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inferencecache_proto::v1alpha1::{Ack, CacheEvent, CacheStateUpdate, PrefixEntry};
use prost::Message;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, timeout};
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::auth::CallCredentials;
use crate::mapping::Op;
use crate::metrics::Metrics;
use crate::nats::NatsPublisher;
use crate::state::{self, PublisherKey, Resume};

/// Largest encoded `CacheStateUpdate` this sender builds: a quarter of the server's 4 MiB
/// receive limit (docs/BEHAVIOUR.md §1.3), leaving room for gRPC framing and any estimate slack.
pub const MAX_UPDATE_BYTES: usize = 1 << 20;
/// Upper bound of the bytes one repeated-field entry adds besides its own encoding (tag +
/// length prefix).
const ENTRY_FRAMING_BYTES: usize = 6;

/// Delivery knobs, from the flags.
#[derive(Debug, Clone)]
pub struct SenderConfig {
    /// Model id of every message.
    pub model_id: String,
    /// Tenant id of every message.
    pub tenant_id: String,
    /// Hash scheme of every update.
    pub hash_scheme: String,
    /// Flush pending entries at this many.
    pub max_batch: usize,
    /// Flush pending entries at least this often.
    pub flush_interval: Duration,
    /// Messages per stream before it is closed and acknowledged.
    pub max_unacked: usize,
    /// Timeout of one unary call / one stream acknowledgement.
    pub call_timeout: Duration,
    /// Close and acknowledge the stream once its oldest unacknowledged message is this old.
    pub ack_interval: Duration,
    /// Where acknowledged checkpoints are written (`--state-file`).
    pub state_file: Option<PathBuf>,
}

/// Least time between two writes of the state file.
const STATE_WRITE_INTERVAL: Duration = Duration::from_millis(250);

/// Exponential backoff with a little time-derived jitter (100 ms → 10 s).
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
}

impl Backoff {
    const MIN: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(10);

    /// Starts at the minimum delay.
    pub fn new() -> Self {
        Self { next: Self::MIN }
    }

    /// The delay to wait now; doubles the next one up to the cap.
    pub fn step(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |t| t.subsec_nanos());
        d + d.mul_f64(f64::from(nanos % 1000) / 10_000.0)
    }

    /// Back to the minimum after a success.
    pub fn reset(&mut self) {
        self.next = Self::MIN;
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

/// The gRPC client: every call carries the producer epoch and, when configured, the token.
pub type Client = InferenceCacheClient<InterceptedService<Channel, CallCredentials>>;

struct OpenStream {
    tx: mpsc::Sender<CacheStateUpdate>,
    call: JoinHandle<Result<Ack, tonic::Status>>,
}

/// The delivery task's state.
pub struct Sender {
    cfg: SenderConfig,
    client: Client,
    metrics: Arc<Metrics>,
    stream: Option<OpenStream>,
    unacked: Vec<CacheStateUpdate>,
    pending: Vec<CacheStateUpdate>,
    pending_entries: usize,
    pending_since: Option<Instant>,
    /// Encoded size (upper bound) of the last pending update.
    last_pending_bytes: usize,
    backoff: Backoff,
    /// When the oldest unacknowledged message was sent.
    unacked_since: Option<Instant>,
    /// Messages sent (first sends only) and how many of them are acknowledged.
    sent_total: u64,
    acked_total: u64,
    /// Checkpoints waiting for their messages' Ack: (sent count that must be acked, key, seq).
    marks: VecDeque<(u64, PublisherKey, u64)>,
    /// Acknowledged checkpoints (the state file's content) and whether it is unwritten.
    committed: Resume,
    dirty: bool,
    last_write: Option<Instant>,
    /// Consecutive stream failures that refused the content (see [`MAX_REFUSALS`]).
    refusals: u32,
    /// With `--nats-url`: every update and event is also (or only) published to JetStream.
    nats: Option<NatsPublisher>,
    /// Whether updates go to the server directly (false with `--nats-only`).
    direct: bool,
    /// The server fenced this producer: nothing more is sent (module docs).
    fenced: bool,
}

/// Consecutive refusals (RESOURCE_EXHAUSTED, INVALID_ARGUMENT, OUT_OF_RANGE, PERMISSION_DENIED)
/// of the same unacknowledged messages (or of one event) after which they are dropped
/// (`reason="refused_by_server"`) instead of being re-sent forever; transient failures
/// (UNAVAILABLE, timeouts, UNAUTHENTICATED: a rotated token may fix it) are retried without limit.
pub const MAX_REFUSALS: u32 = 5;

/// A failure whose status says the content itself is refused (too large, invalid, not allowed
/// for this producer or fenced by a newer epoch): it does not heal by waiting, unlike an
/// unavailable server.
pub fn is_refusal(status: &tonic::Status) -> bool {
    use tonic::Code;
    matches!(
        status.code(),
        Code::ResourceExhausted | Code::InvalidArgument | Code::OutOfRange | Code::PermissionDenied
    )
}

impl Sender {
    /// A sender over `channel` (lazily connected; reconnects are handled by tonic + backoff),
    /// each call carrying `creds`.
    pub fn new(
        cfg: SenderConfig,
        channel: Channel,
        creds: CallCredentials,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            cfg,
            client: InferenceCacheClient::with_interceptor(channel, creds),
            metrics,
            stream: None,
            unacked: Vec::new(),
            pending: Vec::new(),
            pending_entries: 0,
            pending_since: None,
            last_pending_bytes: 0,
            backoff: Backoff::new(),
            unacked_since: None,
            sent_total: 0,
            acked_total: 0,
            marks: VecDeque::new(),
            committed: Resume::new(),
            dirty: false,
            last_write: None,
            refusals: 0,
            nats: None,
            direct: true,
            fenced: false,
        }
    }

    /// Also publishes every update and event to JetStream through `nats`; with `direct` false
    /// only there (nothing is sent to the server, and an update counts as acknowledged once the
    /// stream acknowledged it).
    pub fn with_nats(mut self, nats: NatsPublisher, direct: bool) -> Self {
        self.nats = Some(nats);
        self.direct = direct;
        self
    }

    /// Consumes operations until the queue closes, then flushes and acknowledges everything.
    pub async fn run(mut self, mut rx: mpsc::Receiver<Op>) {
        // Notices a stream that failed while idle, so what it carried is re-sent promptly
        // instead of waiting for the next operation.
        let mut health =
            tokio::time::interval(self.cfg.flush_interval.max(Duration::from_millis(100)));
        health.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let deadline = self.pending_since.map(|t| t + self.cfg.flush_interval);
            tokio::select! {
                op = rx.recv() => match op {
                    Some(op) => self.handle(op).await,
                    None => break,
                },
                _ = sleep_until_opt(deadline), if deadline.is_some() => self.flush_pending().await,
                _ = health.tick() => {
                    if self.stream.as_ref().is_some_and(|s| s.call.is_finished()) {
                        self.recover().await;
                    }
                    // A quiet stream is acknowledged after `ack_interval`, so checkpoints (and
                    // the acked counters) never lag further behind.
                    if self.unacked_since.is_some_and(|t| t.elapsed() >= self.cfg.ack_interval) {
                        self.barrier().await;
                    }
                    self.commit_marks();
                    self.write_state(false);
                }
            }
        }
        self.flush_pending().await;
        self.barrier().await;
        self.commit_marks();
        self.write_state(true);
        tracing::info!("sender drained");
    }

    /// Applies one operation (see module docs for the ordering rules).
    pub async fn handle(&mut self, op: Op) {
        if self.fenced {
            self.drop_fenced(&op);
            return;
        }
        match op {
            Op::Add {
                replica,
                ts_us,
                entries,
            } => self.add(replica, ts_us, entries).await,
            Op::Evict {
                replica,
                ts_us,
                keys,
            } => self.evict(replica, ts_us, keys).await,
            Op::Clear { replica, ts_us } => self.clear(replica, ts_us).await,
            Op::Checkpoint { key, seq } => {
                let must_ack = self.sent_total + self.pending.len() as u64;
                self.marks.push_back((must_ack, key, seq));
                self.commit_marks();
                self.write_state(false);
            }
            Op::Stats { replica, stats } => {
                self.flush_pending().await;
                let u = CacheStateUpdate {
                    stats: Some(stats),
                    ..self.update(replica, 0)
                };
                self.send(u).await;
            }
        }
    }

    /// Goes idle for good: the server reported a newer producer for this process's replica.
    fn fence(&mut self) {
        if self.fenced {
            return;
        }
        self.fenced = true;
        self.metrics.fenced.set(1);
        let dropped = self.pending_entries as u64;
        self.pending.clear();
        self.pending_entries = 0;
        self.pending_since = None;
        self.metrics.drop_n("fenced", dropped);
        tracing::error!(
            "fenced: the server saw a newer producer epoch for this replica (a restarted or \
             duplicated subscriber); sending nothing more"
        );
    }

    /// What a fenced sender does with an operation: drops it, counting the data it carried.
    fn drop_fenced(&mut self, op: &Op) {
        let n = match op {
            Op::Add { entries, .. } => entries.len(),
            Op::Evict { keys, .. } => keys.len(),
            Op::Clear { .. } | Op::Stats { .. } => 1,
            Op::Checkpoint { .. } => 0,
        };
        self.metrics.drop_n("fenced", n as u64);
    }

    /// Queues entries, merged into the last pending update when it has the same replica and
    /// timestamp; flushes once `max_batch` entries are pending.
    async fn add(&mut self, replica: String, ts_us: i64, entries: Vec<PrefixEntry>) {
        // One engine event can carry any number of blocks: entries go into updates of at most
        // `max_batch` entries and MAX_UPDATE_BYTES encoded, so no message reaches the server's
        // 4 MiB receive limit (a refused message would otherwise be re-sent forever).
        for e in entries {
            let len = e.encoded_len() + ENTRY_FRAMING_BYTES;
            let fits = matches!(self.pending.last(), Some(last)
                if last.replica_id == replica
                    && last.timestamp_us == ts_us
                    && last.prefixes.len() < self.cfg.max_batch
                    && self.last_pending_bytes + len <= MAX_UPDATE_BYTES);
            if fits {
                self.pending.last_mut().expect("checked").prefixes.push(e);
                self.last_pending_bytes += len;
            } else {
                let u = CacheStateUpdate {
                    prefixes: vec![e],
                    ..self.update(replica.clone(), ts_us)
                };
                self.last_pending_bytes = u.encoded_len() + ENTRY_FRAMING_BYTES;
                self.pending.push(u);
            }
            self.pending_entries += 1;
            self.pending_since.get_or_insert_with(Instant::now);
            if self.pending_entries >= self.cfg.max_batch {
                self.flush_pending().await;
            }
        }
    }

    /// PREFIX_EVICTED per key, after everything queued before it is acknowledged.
    async fn evict(&mut self, replica: String, ts_us: i64, keys: Vec<(Vec<u8>, String)>) {
        self.flush_pending().await;
        self.barrier().await;
        let events = keys
            .into_iter()
            .map(|(prefix_hash, adapter_id)| CacheEvent {
                r#type: Type::PrefixEvicted as i32,
                replica_id: replica.clone(),
                model_id: self.cfg.model_id.clone(),
                tenant_id: self.cfg.tenant_id.clone(),
                prefix_hash,
                timestamp_us: ts_us,
                adapter_id,
            })
            .collect();
        self.publish_all(events, "PREFIX_EVICTED").await;
    }

    /// ALL_CLEARED: drops the replica's pending adds (counted), then publishes after the
    /// barrier.
    async fn clear(&mut self, replica: String, ts_us: i64) {
        let before = self.pending_entries;
        self.pending.retain(|u| u.replica_id != replica);
        self.pending_entries = self.pending.iter().map(|u| u.prefixes.len()).sum();
        self.last_pending_bytes = self.pending.last().map_or(0, |u| {
            u.encoded_len() + u.prefixes.len() * ENTRY_FRAMING_BYTES
        });
        if before > self.pending_entries {
            let dropped = (before - self.pending_entries) as u64;
            self.metrics.drop_n("cleared_before_send", dropped);
        }
        self.flush_pending().await;
        self.barrier().await;
        let ev = CacheEvent {
            r#type: Type::AllCleared as i32,
            replica_id: replica,
            model_id: self.cfg.model_id.clone(),
            tenant_id: self.cfg.tenant_id.clone(),
            prefix_hash: Vec::new(),
            timestamp_us: ts_us,
            adapter_id: String::new(),
        };
        self.publish_all(vec![ev], "ALL_CLEARED").await;
    }

    fn update(&self, replica: String, ts_us: i64) -> CacheStateUpdate {
        CacheStateUpdate {
            replica_id: replica,
            model_id: self.cfg.model_id.clone(),
            tenant_id: self.cfg.tenant_id.clone(),
            hash_scheme: self.cfg.hash_scheme.clone(),
            timestamp_us: ts_us,
            prefixes: Vec::new(),
            stats: None,
            adapter_id: String::new(),
        }
    }

    /// Counts a stream failure whose status says the content itself is refused (see
    /// [`is_refusal`]).
    fn note_failure(&mut self, status: &tonic::Status) {
        if is_refusal(status) {
            self.refusals += 1;
        }
    }

    /// Moves checkpoints whose messages are all acknowledged into the committed state. With
    /// nothing pending or unacknowledged every checkpoint is covered (messages it counted on may
    /// have been dropped by a clear).
    fn commit_marks(&mut self) {
        let idle = self.pending.is_empty() && self.unacked.is_empty();
        while let Some((must_ack, _, _)) = self.marks.front() {
            if *must_ack > self.acked_total && !idle {
                break;
            }
            let (_, key, seq) = self.marks.pop_front().expect("front exists");
            self.committed.insert(key, seq);
            self.dirty = true;
        }
    }

    /// Writes the committed state when it changed (at most every 250 ms unless `now`).
    fn write_state(&mut self, now: bool) {
        let Some(path) = &self.cfg.state_file else {
            return;
        };
        if !self.dirty
            || (!now
                && self
                    .last_write
                    .is_some_and(|t| t.elapsed() < STATE_WRITE_INTERVAL))
        {
            return;
        }
        match state::save(path, &self.committed) {
            Ok(()) => self.dirty = false,
            Err(e) => {
                tracing::warn!(error = %e, "writing the state file failed");
                self.metrics.state_write_errors.inc();
            }
        }
        self.last_write = Some(Instant::now());
    }

    /// Moves every pending update onto the stream.
    pub async fn flush_pending(&mut self) {
        if self.fenced {
            return;
        }
        self.pending_since = None;
        self.pending_entries = 0;
        for u in std::mem::take(&mut self.pending) {
            self.send(u).await;
        }
    }

    fn open_stream(&mut self) -> &mut OpenStream {
        self.stream.get_or_insert_with(|| {
            let (tx, rx) = mpsc::channel(64);
            let mut client = self.client.clone();
            let call = tokio::spawn(async move {
                client
                    .report_cache_state(ReceiverStream::new(rx))
                    .await
                    .map(tonic::Response::into_inner)
            });
            OpenStream { tx, call }
        })
    }

    /// Sends one message on the stream, recovering from stream failures; keeps it until acked.
    async fn send(&mut self, u: CacheStateUpdate) {
        // JetStream first: its order is the publish order, and a barrier below flushes it
        // before anything that must follow.
        if let Some(n) = self.nats.as_mut() {
            n.update(&u).await;
        }
        while self.direct {
            let s = self.open_stream();
            if !s.call.is_finished() && s.tx.send(u.clone()).await.is_ok() {
                break;
            }
            self.recover().await;
        }
        self.metrics.updates_sent.inc();
        self.metrics.entries_sent.inc_by(u.prefixes.len() as u64);
        self.sent_total += 1;
        self.unacked_since.get_or_insert_with(Instant::now);
        self.unacked.push(u);
        if self.unacked.len() >= self.cfg.max_unacked {
            self.barrier().await;
        }
    }

    /// Replaces a failed stream: waits out the backoff, opens a new stream and re-sends every
    /// unacknowledged message on it.
    async fn recover(&mut self) {
        'retry: loop {
            if let Some(s) = self.stream.take() {
                drop(s.tx);
                let err = match s.call.await {
                    Ok(Ok(_)) => "stream ended early".to_string(),
                    Ok(Err(status)) => {
                        self.note_failure(&status);
                        status.to_string()
                    }
                    Err(join) => join.to_string(),
                };
                tracing::warn!(error = %err, unacked = self.unacked.len(), "ReportCacheState stream failed; reconnecting");
            }
            if self.refusals >= MAX_REFUSALS {
                // The server keeps refusing this content (not a transient failure): re-sending
                // it forever would stop all delivery, so it is dropped and counted.
                let n = self.unacked.len() as u64;
                tracing::error!(
                    messages = n,
                    "server refused the same unacknowledged messages {MAX_REFUSALS} times; dropping them"
                );
                self.metrics.drop_n("refused_by_server", n);
                self.unacked.clear();
                self.unacked_since = None;
                self.acked_total = self.sent_total;
                self.refusals = 0;
                self.commit_marks();
                return;
            }
            self.metrics.reconnects.inc();
            sleep(self.backoff.step()).await;
            let unacked = std::mem::take(&mut self.unacked);
            for u in &unacked {
                let s = self.open_stream();
                if s.call.is_finished() || s.tx.send(u.clone()).await.is_err() {
                    self.unacked = unacked;
                    continue 'retry;
                }
                self.metrics.resent.inc();
            }
            self.unacked = unacked;
            return;
        }
    }

    /// Closes the stream and waits for its Ack, so that everything sent so far is applied on
    /// the server before anything that follows; re-sends on failure.
    pub async fn barrier(&mut self) {
        if let Some(n) = self.nats.as_mut() {
            n.flush().await;
        }
        if !self.direct {
            // Everything sent is acknowledged by the stream.
            self.acknowledged();
            return;
        }
        loop {
            let Some(s) = self.stream.take() else {
                if self.unacked.is_empty() {
                    return;
                }
                // Defensive: unacknowledged messages without a stream are re-sent first.
                self.recover().await;
                continue;
            };
            drop(s.tx);
            match timeout(self.cfg.call_timeout, s.call).await {
                Ok(Ok(Ok(ack))) => {
                    if !ack.accepted {
                        self.metrics.streams_refused.inc();
                        tracing::warn!(reason = %ack.reason_code, messages = self.unacked.len(), "server refused a ReportCacheState stream; not re-sending");
                    }
                    self.acknowledged();
                    if ack.reason_code == FENCED_REASON {
                        self.fence();
                    }
                    return;
                }
                res => {
                    let err = match res {
                        Ok(Ok(Err(status))) => {
                            self.note_failure(&status);
                            status.to_string()
                        }
                        Ok(Err(join)) => join.to_string(),
                        Err(_) => "ack timeout".to_string(),
                        Ok(Ok(Ok(_))) => unreachable!(),
                    };
                    tracing::warn!(error = %err, unacked = self.unacked.len(), "ReportCacheState not acknowledged; re-sending");
                    self.recover().await;
                }
            }
        }
    }

    /// Every unacknowledged message is acknowledged (by the server's Ack, or by the stream).
    fn acknowledged(&mut self) {
        let entries: usize = self.unacked.iter().map(|u| u.prefixes.len()).sum();
        self.metrics.entries_acked.inc_by(entries as u64);
        self.metrics.updates_acked.inc_by(self.unacked.len() as u64);
        self.unacked.clear();
        self.unacked_since = None;
        self.acked_total = self.sent_total;
        self.refusals = 0;
        self.backoff.reset();
        self.commit_marks();
    }

    /// Sends events concurrently (at most [`MAX_IN_FLIGHT_EVENTS`] at once; their mutual order
    /// does not matter — they are evictions of distinct keys), each retried with backoff until
    /// the server accepts it. Returns when all are accepted.
    async fn publish_all(&mut self, events: Vec<CacheEvent>, kind: &'static str) {
        if let Some(n) = self.nats.as_mut() {
            // In order, after every update published before them (the barrier flushed those).
            for ev in &events {
                n.event(ev).await;
            }
            n.flush().await;
        }
        if !self.direct {
            let sent = self
                .metrics
                .cache_events_sent
                .get_or_create(&[("type", kind)]);
            sent.inc_by(events.len() as u64);
            return;
        }
        let mut queue = events.into_iter();
        let mut running = tokio::task::JoinSet::new();
        let mut fenced = false;
        loop {
            while running.len() < MAX_IN_FLIGHT_EVENTS && !fenced {
                let Some(ev) = queue.next() else { break };
                running.spawn(publish_one(
                    self.client.clone(),
                    ev,
                    kind,
                    self.cfg.call_timeout,
                    self.metrics.clone(),
                ));
            }
            match running.join_next().await {
                None => break,
                Some(Ok(Delivery::Fenced)) => fenced = true,
                Some(_) => {}
            }
        }
        if fenced {
            let n = queue.len() as u64;
            self.metrics.drop_n("fenced", n);
            self.fence();
        }
        self.backoff.reset();
    }
}

/// `Ack.reason_code` of a ReportCacheState stream with a message from a fenced producer.
pub const FENCED_REASON: &str = "FENCED";

/// Whether a PublishEvent status is the server fencing this producer (docs/BEHAVIOUR.md §4.3:
/// a newer `x-producer-epoch` for the event's replica).
pub fn is_fenced(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::FailedPrecondition
}

/// How one event's delivery ended.
#[derive(Debug, PartialEq, Eq)]
enum Delivery {
    /// Accepted, or dropped after repeated refusals.
    Done,
    /// The server fenced this producer: not retried.
    Fenced,
}

/// Unary `PublishEvent` calls in flight at once during an eviction burst.
pub const MAX_IN_FLIGHT_EVENTS: usize = 32;

/// One `PublishEvent`, retried with its own backoff until accepted.
async fn publish_one(
    mut client: Client,
    ev: CacheEvent,
    kind: &'static str,
    call_timeout: Duration,
    metrics: Arc<Metrics>,
) -> Delivery {
    let mut backoff = Backoff::new();
    let mut refusals = 0;
    loop {
        match timeout(call_timeout, client.publish_event(ev.clone())).await {
            Ok(Ok(_)) => {
                metrics
                    .cache_events_sent
                    .get_or_create(&[("type", kind)])
                    .inc();
                return Delivery::Done;
            }
            res => {
                let err = match res {
                    Ok(Err(status)) if is_fenced(&status) => {
                        metrics.drop_n("fenced", 1);
                        return Delivery::Fenced;
                    }
                    Ok(Err(status)) => {
                        if is_refusal(&status) {
                            refusals += 1;
                        }
                        status.to_string()
                    }
                    _ => "timeout".to_string(),
                };
                if refusals >= MAX_REFUSALS {
                    tracing::error!(error = %err, event = kind, "server refused the event {MAX_REFUSALS} times; dropping it");
                    metrics.drop_n("refused_by_server", 1);
                    return Delivery::Done;
                }
                tracing::warn!(error = %err, event = kind, "PublishEvent failed; retrying");
                metrics.reconnects.inc();
                sleep(backoff.step()).await;
            }
        }
    }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
