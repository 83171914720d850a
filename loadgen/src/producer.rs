//! Producers: one task per simulated engine replica, reporting its KV blocks the way an engine
//! event subscriber does (docs/KV-EVENTS.md §3, docs/CONFORMANCE.md §Q):
//!
//! * one legacy `PrefixEntry` per newly stored full block — `prefix_hash` = 8-byte big-endian
//!   rolling fingerprint, `token_count` cumulative (bs, 2·bs, …), tier T1 — on a **long-lived**
//!   `ReportCacheState` client stream with bounded batching (flush every `flush` or at
//!   `max_batch` entries), rotated after `stream_max_messages` messages or `stream_max_age`;
//! * churn: periodic re-reports of held blocks (refreshes, as engines re-announce on reuse);
//! * evictions: each replica holds at most `capacity_blocks` blocks, LRU; an evicted block is
//!   announced with `PublishEvent{PREFIX_EVICTED}` after pending adds are flushed;
//! * stats: every `stats_interval` a stats-only update per tenant with hit rate, pressure and
//!   cache memory.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inferencecache_proto::v1alpha1::{
    Ack, CacheEvent, CacheStateUpdate, CacheTier, PrefixEntry, ReplicaStats, cache_event,
};
use rand::RngExt;
use serde::Serialize;
use tokio::sync::{Semaphore, mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use crate::histogram::{Recorder, Rpc};
use crate::workload::{Names, Scope, StoreOp, WorkloadConfig, rng_for};

/// KV bytes one block occupies, for `cache_memory_bytes` (16 tokens × 128 KiB/token, a typical
/// 8B-parameter model in bf16).
const BYTES_PER_BLOCK: i64 = 2 << 20;

/// A fast non-cryptographic hasher for the held-block map: its keys are already well-mixed
/// 64-bit fingerprints plus small indices, and it is hit once per block of every executed
/// prompt, where SipHash showed up as loadgen's top user-space cost.
#[derive(Default, Clone, Copy)]
struct FxHasher(u64);

impl std::hash::Hasher for FxHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(*b as u64);
        }
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(v as u64);
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
}

/// Map of held blocks with [`FxHasher`].
type HeldMap = HashMap<(Scope, u64), Held, std::hash::BuildHasherDefault<FxHasher>>;

/// Concurrent `PublishEvent` calls per producer (evictions come in bursts).
const EVICT_CONCURRENCY: usize = 32;

/// Messages buffered between a producer and its open stream.
const STREAM_BUFFER: usize = 64;

/// Producer behaviour knobs.
#[derive(Clone, Debug, Serialize)]
pub struct ProducerConfig {
    /// Flush pending entries at least this often.
    pub flush: Duration,
    /// Flush as soon as this many entries are pending.
    pub max_batch: usize,
    /// Close and reopen the stream after this many messages (bounds server-side stream state).
    pub stream_max_messages: u64,
    /// Close and reopen the stream after this long.
    pub stream_max_age: Duration,
    /// Blocks each replica holds before evicting (LRU).
    pub capacity_blocks: usize,
    /// Re-reports of held blocks per replica per second (0 = no churn).
    pub churn_per_sec: f64,
    /// Stats-only update period (None = no stats).
    pub stats_interval: Option<Duration>,
    /// Deadline of unary calls and of waiting for a stream's Ack.
    pub rpc_timeout: Duration,
    /// Store operations queued per replica before new ones are dropped (run mode).
    pub queue: usize,
    /// Seed for churn picks.
    pub seed: u64,
}

/// Ingest counters, summed over replicas.
#[derive(Clone, Debug, Default, Serialize)]
pub struct IngestStats {
    /// Streams opened.
    pub streams_opened: u64,
    /// Streams that ended with an error (or whose Ack did not arrive in time).
    pub stream_errors: u64,
    /// `CacheStateUpdate` messages sent with prefixes.
    pub messages: u64,
    /// Prefix entries sent (new blocks + churn re-reports).
    pub prefixes_reported: u64,
    /// Of those, churn re-reports of already held blocks.
    pub rereported: u64,
    /// `PublishEvent{PREFIX_EVICTED}` calls made.
    pub evictions: u64,
    /// Stats-only updates sent.
    pub stats_updates: u64,
    /// Store operations applied (prompts executed).
    pub store_ops: u64,
    /// Store operations dropped because the producer's queue was full.
    pub dropped_ops: u64,
    /// Blocks of executed prompts that the replica already held (engine-side cache hits).
    pub blocks_hit: u64,
    /// Blocks of executed prompts that were new (and therefore reported).
    pub blocks_new: u64,
}

impl IngestStats {
    fn add(&mut self, o: &IngestStats) {
        self.streams_opened += o.streams_opened;
        self.stream_errors += o.stream_errors;
        self.messages += o.messages;
        self.prefixes_reported += o.prefixes_reported;
        self.rereported += o.rereported;
        self.evictions += o.evictions;
        self.stats_updates += o.stats_updates;
        self.store_ops += o.store_ops;
        self.dropped_ops += o.dropped_ops;
        self.blocks_hit += o.blocks_hit;
        self.blocks_new += o.blocks_new;
    }
}

/// Microseconds since the Unix epoch (the wire `timestamp_us`).
fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// The per-block legacy entries a subscriber sends for blocks `from..to` of `hashes`.
pub fn block_entries(hashes: &[u64], from: usize, to: usize, block_size: u32) -> Vec<PrefixEntry> {
    (from..to)
        .map(|j| entry(hashes[j], ((j + 1) as u64 * block_size as u64) as i32))
        .collect()
}

fn entry(hash: u64, token_count: i32) -> PrefixEntry {
    PrefixEntry {
        prefix_hash: hash.to_be_bytes().to_vec(),
        token_count,
        tier: CacheTier::T1 as i32,
        ..Default::default()
    }
}

/// What a producer task receives, in order.
enum Msg {
    /// Blocks to store (an executed prompt).
    Store(StoreOp),
    /// Barrier: flush, close the stream and wait for its Ack, let evictions finish, switch to
    /// `recorder`, and reply with the counters since the previous barrier.
    Sync {
        recorder: Arc<Recorder>,
        reply: oneshot::Sender<IngestStats>,
    },
}

/// All replicas' producers. They live across phases (preload, measurement windows, capacity
/// steps) so each replica's cache contents carry over, as they would on a real engine.
pub struct Producers {
    senders: Vec<mpsc::Sender<Msg>>,
    rpc_timeout: Duration,
    dropped: Arc<AtomicU64>,
    stop: watch::Sender<bool>,
    joins: std::sync::Mutex<Vec<JoinHandle<IngestStats>>>,
}

impl Producers {
    /// Starts one producer per replica; replica `r` uses `clients[r % clients.len()]`.
    pub fn start(
        wl: &WorkloadConfig,
        cfg: &ProducerConfig,
        clients: &[InferenceCacheClient<Channel>],
        recorder: Arc<Recorder>,
    ) -> Self {
        let names = Arc::new(Names::new(wl));
        let (stop, stop_rx) = watch::channel(false);
        let mut senders = Vec::new();
        let mut joins = Vec::new();
        for r in 0..wl.replicas {
            let (tx, rx) = mpsc::channel(cfg.queue.max(1));
            let p = Producer {
                replica: r,
                model: r % wl.models,
                tenants: wl.tenants,
                hash_scheme: wl.hash_scheme.clone(),
                block_size: wl.block_size,
                names: names.clone(),
                cfg: cfg.clone(),
                client: clients[r as usize % clients.len()].clone(),
                recorder: recorder.clone(),
                held: HeldMap::default(),
                order: VecDeque::new(),
                seq: 0,
                pending: BTreeMap::new(),
                pending_n: 0,
                stream: None,
                stats: IngestStats::default(),
                interval_hits: 0,
                interval_new: 0,
                churn_debt: 0.0,
                rng: rng_for(cfg.seed ^ ((r as u64) << 32)),
                evict_sem: Arc::new(Semaphore::new(EVICT_CONCURRENCY)),
            };
            joins.push(tokio::spawn(p.run(rx, stop_rx.clone())));
            senders.push(tx);
        }
        Producers {
            senders,
            rpc_timeout: cfg.rpc_timeout,
            dropped: Arc::new(AtomicU64::new(0)),
            stop,
            joins: std::sync::Mutex::new(joins),
        }
    }

    /// Hands a store operation to `replica` without waiting; dropped (and counted) when its
    /// queue is full, so a slow ingest path never throttles the measured lookups.
    pub fn try_store(&self, replica: u32, op: StoreOp) {
        if self.senders[replica as usize]
            .try_send(Msg::Store(op))
            .is_err()
        {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Hands a store operation to `replica`, waiting for queue space (preload: nothing dropped).
    pub async fn store(&self, replica: u32, op: StoreOp) {
        let _ = self.senders[replica as usize].send(Msg::Store(op)).await;
    }

    /// Barrier across all replicas: everything handed over so far is applied, reported and
    /// acknowledged by the server (stream closed, Ack received) before this returns. Later
    /// latencies go to `recorder`. Returns the counters since the previous barrier; bounded by
    /// a few RPC timeouts per replica.
    pub async fn sync(&self, recorder: Arc<Recorder>) -> IngestStats {
        let mut replies = Vec::new();
        for tx in &self.senders {
            let (reply, rx) = oneshot::channel();
            if tx
                .send(Msg::Sync {
                    recorder: recorder.clone(),
                    reply,
                })
                .await
                .is_ok()
            {
                replies.push(rx);
            }
        }
        let mut total = IngestStats::default();
        let bound = self.rpc_timeout * 4 + Duration::from_secs(1);
        for rx in replies {
            if let Ok(Ok(s)) = tokio::time::timeout(bound, rx).await {
                total.add(&s);
            }
        }
        total.dropped_ops += self.dropped.swap(0, Ordering::Relaxed);
        total
    }

    /// Stops every producer after it applied what is queued, flushed, closed its stream and got
    /// the Ack (each bounded by the RPC timeout); returns the summed counters. Store operations
    /// handed over afterwards are ignored; a second call returns only the drop counter.
    pub async fn finish(&self) -> IngestStats {
        let _ = self.stop.send(true);
        let joins = std::mem::take(&mut *self.joins.lock().unwrap_or_else(|e| e.into_inner()));
        let mut total = IngestStats::default();
        for j in joins {
            if let Ok(s) = j.await {
                total.add(&s);
            }
        }
        total.dropped_ops += self.dropped.load(Ordering::Relaxed);
        total
    }
}

/// An open `ReportCacheState` stream.
struct Stream {
    tx: mpsc::Sender<CacheStateUpdate>,
    join: JoinHandle<Result<Ack, tonic::Status>>,
    opened: Instant,
    messages: u64,
}

/// Value of a held block: cumulative token count and LRU stamp.
#[derive(Clone, Copy)]
struct Held {
    token_count: i32,
    stamp: u64,
}

/// One simulated engine replica's event subscriber.
struct Producer {
    replica: u32,
    model: u32,
    tenants: u32,
    hash_scheme: String,
    block_size: u32,
    names: Arc<Names>,
    cfg: ProducerConfig,
    client: InferenceCacheClient<Channel>,
    recorder: Arc<Recorder>,
    /// Blocks this replica holds.
    held: HeldMap,
    /// LRU order with lazy deletion: an item is live iff its stamp equals the map's.
    order: VecDeque<((Scope, u64), u64)>,
    seq: u64,
    pending: BTreeMap<Scope, Vec<PrefixEntry>>,
    pending_n: usize,
    stream: Option<Stream>,
    stats: IngestStats,
    interval_hits: u64,
    interval_new: u64,
    churn_debt: f64,
    rng: rand::rngs::Xoshiro256PlusPlus,
    evict_sem: Arc<Semaphore>,
}

impl Producer {
    async fn run(
        mut self,
        mut rx: mpsc::Receiver<Msg>,
        mut stop: watch::Receiver<bool>,
    ) -> IngestStats {
        let mut flush_tick = tokio::time::interval(self.cfg.flush.max(Duration::from_millis(1)));
        let churn_period = Duration::from_millis(100);
        let mut churn_tick = tokio::time::interval(churn_period);
        let stats_period = self.cfg.stats_interval.unwrap_or(Duration::from_secs(3600));
        let mut stats_tick = tokio::time::interval(stats_period);
        for t in [&mut flush_tick, &mut churn_tick, &mut stats_tick] {
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        }
        loop {
            tokio::select! {
                biased;
                _ = stop.changed() => if *stop.borrow_and_update() { break },
                msg = rx.recv() => match msg {
                    Some(msg) => self.handle(msg).await,
                    None => break,
                },
                _ = flush_tick.tick() => self.flush().await,
                _ = churn_tick.tick(), if self.cfg.churn_per_sec > 0.0 => {
                    self.churn(churn_period.as_secs_f64());
                }
                _ = stats_tick.tick(), if self.cfg.stats_interval.is_some() => {
                    self.send_stats().await;
                }
            }
        }
        // Apply what was queued before the stop, then flush and close cleanly.
        while let Ok(msg) = rx.try_recv() {
            self.handle(msg).await;
        }
        self.quiesce().await;
        self.stats
    }

    async fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Store(op) => self.apply(op).await,
            Msg::Sync { recorder, reply } => {
                self.quiesce().await;
                self.recorder = recorder;
                let _ = reply.send(std::mem::take(&mut self.stats));
            }
        }
    }

    /// Flushes, closes the stream (waiting for the Ack) and waits for in-flight evictions.
    async fn quiesce(&mut self) {
        self.flush().await;
        self.close_stream().await;
        let _ = tokio::time::timeout(
            self.cfg.rpc_timeout,
            self.evict_sem.acquire_many(EVICT_CONCURRENCY as u32),
        )
        .await;
    }

    fn touch(&mut self, key: (Scope, u64), token_count: i32) -> bool {
        self.seq += 1;
        let stamp = self.seq;
        let new = self.held.insert(key, Held { token_count, stamp }).is_none();
        self.order.push_back((key, stamp));
        new
    }

    async fn apply(&mut self, op: StoreOp) {
        self.stats.store_ops += 1;
        for j in 0..op.n_blocks.min(op.hashes.len()) {
            let key = (op.scope, op.hashes[j]);
            let count = ((j + 1) as u64 * self.block_size as u64) as i32;
            if self.touch(key, count) {
                self.stats.blocks_new += 1;
                self.interval_new += 1;
                self.push_pending(op.scope, entry(op.hashes[j], count));
            } else {
                self.stats.blocks_hit += 1;
                self.interval_hits += 1;
            }
        }
        if self.pending_n >= self.cfg.max_batch {
            self.flush().await;
        }
        let mut evicted = Vec::new();
        while self.held.len() > self.cfg.capacity_blocks {
            let Some((key, stamp)) = self.order.pop_front() else {
                break;
            };
            if self.held.get(&key).is_some_and(|h| h.stamp == stamp) {
                self.held.remove(&key);
                evicted.push(key);
            }
        }
        if self.order.len() > 4 * self.held.len() + 1024 {
            let held = &self.held;
            self.order
                .retain(|(k, s)| held.get(k).is_some_and(|h| h.stamp == *s));
        }
        if !evicted.is_empty() {
            // Like the reference subscriber: pending adds go out before the removals.
            self.flush().await;
            for key in evicted {
                self.publish_eviction(key).await;
            }
        }
    }

    fn push_pending(&mut self, scope: Scope, e: PrefixEntry) {
        self.pending.entry(scope).or_default().push(e);
        self.pending_n += 1;
    }

    /// Re-reports random held blocks: `churn_per_sec × dt` of them (fractions carried over).
    fn churn(&mut self, dt: f64) {
        self.churn_debt += self.cfg.churn_per_sec * dt;
        while self.churn_debt >= 1.0 {
            self.churn_debt -= 1.0;
            if self.order.is_empty() {
                self.churn_debt = 0.0;
                break;
            }
            let (key, stamp) = self.order[self.rng.random_range(0..self.order.len())];
            if let Some(h) = self.held.get(&key).copied().filter(|h| h.stamp == stamp) {
                self.stats.rereported += 1;
                self.push_pending(key.0, entry(key.1, h.token_count));
            }
        }
    }

    async fn publish_eviction(&mut self, (scope, hash): (Scope, u64)) {
        self.stats.evictions += 1;
        let Ok(permit) = self.evict_sem.clone().acquire_owned().await else {
            return;
        };
        let ev = CacheEvent {
            r#type: cache_event::Type::PrefixEvicted as i32,
            replica_id: self.names.replicas[self.replica as usize].clone(),
            model_id: self.names.models[scope.model as usize].clone(),
            tenant_id: self.names.tenants[scope.tenant as usize].clone(),
            prefix_hash: hash.to_be_bytes().to_vec(),
            timestamp_us: now_us(),
            adapter_id: self.names.adapters[scope.adapter as usize].clone(),
        };
        let mut client = self.client.clone();
        let (rec, timeout) = (self.recorder.clone(), self.cfg.rpc_timeout);
        tokio::spawn(async move {
            let t0 = Instant::now();
            match tokio::time::timeout(timeout, client.publish_event(ev)).await {
                Ok(Ok(_)) => {
                    rec.record_ok(Rpc::PublishEvent, t0);
                }
                Ok(Err(st)) => {
                    rec.record_error(Rpc::PublishEvent, st.code());
                }
                Err(_) => {
                    rec.record_error(Rpc::PublishEvent, tonic::Code::DeadlineExceeded);
                }
            }
            drop(permit);
        });
    }

    fn update(&self, scope: Scope) -> CacheStateUpdate {
        CacheStateUpdate {
            replica_id: self.names.replicas[self.replica as usize].clone(),
            model_id: self.names.models[scope.model as usize].clone(),
            tenant_id: self.names.tenants[scope.tenant as usize].clone(),
            hash_scheme: self.hash_scheme.clone(),
            timestamp_us: now_us(),
            adapter_id: self.names.adapters[scope.adapter as usize].clone(),
            ..Default::default()
        }
    }

    async fn flush(&mut self) {
        if self.pending_n == 0 {
            return;
        }
        let pending = std::mem::take(&mut self.pending);
        self.pending_n = 0;
        for (scope, prefixes) in pending {
            let n = prefixes.len() as u64;
            let msg = CacheStateUpdate {
                prefixes,
                ..self.update(scope)
            };
            if self.send(msg).await {
                self.stats.messages += 1;
                self.stats.prefixes_reported += n;
            }
        }
    }

    /// Stats-only updates, one per tenant of this replica's model (stats are keyed by
    /// (tenant, model, replica)).
    async fn send_stats(&mut self) {
        let total = self.interval_hits + self.interval_new;
        let hit_rate = if total == 0 {
            0.0
        } else {
            self.interval_hits as f32 / total as f32
        };
        self.interval_hits = 0;
        self.interval_new = 0;
        let cap = self.cfg.capacity_blocks.max(1) as f32;
        let stats = ReplicaStats {
            replica_id: self.names.replicas[self.replica as usize].clone(),
            cache_memory_bytes: self.held.len() as i64 * BYTES_PER_BLOCK,
            hit_rate,
            pressure: (self.held.len() as f32 / cap).clamp(0.0, 1.0),
            client_version: concat!("loadgen/", env!("CARGO_PKG_VERSION")).to_string(),
            t2_hit_tokens: 0,
            t2_query_tokens: 0,
        };
        for tenant in 0..self.tenants {
            let scope = Scope {
                tenant,
                model: self.model,
                adapter: 0,
            };
            let msg = CacheStateUpdate {
                stats: Some(stats.clone()),
                ..self.update(scope)
            };
            if self.send(msg).await {
                self.stats.stats_updates += 1;
            }
        }
    }

    fn open_stream(&mut self) {
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let mut client = self.client.clone();
        let join = tokio::spawn(async move {
            client
                .report_cache_state(ReceiverStream::new(rx))
                .await
                .map(|r| r.into_inner())
        });
        self.stats.streams_opened += 1;
        self.stream = Some(Stream {
            tx,
            join,
            opened: Instant::now(),
            messages: 0,
        });
    }

    /// Sends one message on the long-lived stream, reopening it once if it had failed.
    async fn send(&mut self, msg: CacheStateUpdate) -> bool {
        for attempt in 0..2 {
            if self.stream.is_none() {
                self.open_stream();
            }
            let s = self.stream.as_mut().expect("stream just opened");
            let res = tokio::time::timeout(self.cfg.rpc_timeout, s.tx.send(msg.clone())).await;
            match res {
                Ok(Ok(())) => {
                    s.messages += 1;
                    if s.messages >= self.cfg.stream_max_messages
                        || s.opened.elapsed() >= self.cfg.stream_max_age
                    {
                        self.close_stream().await;
                    }
                    return true;
                }
                _ => {
                    // The RPC ended (error) or is wedged: collect its status, then retry once.
                    self.close_stream().await;
                    if attempt == 1 {
                        return false;
                    }
                }
            }
        }
        false
    }

    /// Ends the stream (EOF) and waits for the Ack; records the close→Ack latency or the error.
    async fn close_stream(&mut self) {
        let Some(s) = self.stream.take() else { return };
        drop(s.tx);
        let t0 = Instant::now();
        let mut join = s.join;
        match tokio::time::timeout(self.cfg.rpc_timeout, &mut join).await {
            Ok(Ok(Ok(_ack))) => {
                self.recorder.record_ok(Rpc::ReportCacheState, t0);
            }
            Ok(Ok(Err(st))) => {
                self.stats.stream_errors += 1;
                self.recorder.record_error(Rpc::ReportCacheState, st.code());
            }
            Ok(Err(_)) => {
                self.stats.stream_errors += 1;
                self.recorder
                    .record_error(Rpc::ReportCacheState, tonic::Code::Internal);
            }
            Err(_) => {
                join.abort();
                self.stats.stream_errors += 1;
                self.recorder
                    .record_error(Rpc::ReportCacheState, tonic::Code::DeadlineExceeded);
            }
        }
    }
}
