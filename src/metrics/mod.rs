//! The `/metrics` series (docs/BEHAVIOUR.md §16) plus per-core operator series: recording.
//!
//! Recording never takes a shared lock on the request path: each core records into its own
//! thread-local [`CoreMetrics`], and a scrape gathers those copies (see `admin::scrape`) and
//! merges them before [`exposition::encode`]. Series recorded from threads that are not cores
//! (the admin thread, tests) go to a mutex-guarded fallback that the hot path never touches; the
//! auth counters and the two plain gauges are process-wide atomics.

mod exposition;
pub mod nats;
pub mod process;
pub mod producer;
pub mod snapshot;

pub use exposition::{CONTENT_TYPE, CoreView, Scrape, encode};

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::limits::{MAX_LABEL_VALUE_BYTES, MAX_LABEL_VALUES};

/// Upper bounds of `inferencecache_lookup_route_latency_seconds` (the `+Inf` bucket is implied).
pub const LATENCY_BUCKETS: [f64; 10] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
];

/// The hasher of the per-core maps: XXH3 instead of SipHash, since the key (a model id) is
/// hashed once per LookupRoute on the hot path and is not attacker-chosen in a harmful way
/// (a flood of model ids costs the same either way: one series each).
#[derive(Clone, Copy, Debug, Default)]
pub struct FastHash;

impl std::hash::BuildHasher for FastHash {
    type Hasher = xxhash_rust::xxh3::Xxh3Default;
    fn build_hasher(&self) -> Self::Hasher {
        xxhash_rust::xxh3::Xxh3Default::new()
    }
}

/// A map keyed by label values on the recording path.
pub type FastMap<K, V> = HashMap<K, V, FastHash>;

/// Family names in `inferencecache_metrics_label_overflow_total{family}`.
const LOOKUP_FAMILY: &str = "inferencecache_lookup_route_calls_total";
const TENANT_FAMILY: &str = "inferencecache_tenant_evictions_total";

/// One latency histogram: per-bucket (non-cumulative) counts, the last slot is `+Inf`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    /// Observations per bucket; index `LATENCY_BUCKETS.len()` is the overflow (`+Inf`) bucket.
    pub buckets: [u64; LATENCY_BUCKETS.len() + 1],
    /// Sum of observed seconds.
    pub sum: f64,
    /// Number of observations.
    pub count: u64,
}

impl Histogram {
    /// Records one observation in seconds (`le` is inclusive, as in Prometheus).
    pub fn observe(&mut self, secs: f64) {
        let idx = LATENCY_BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.buckets[idx] += 1;
        self.sum += secs;
        self.count += 1;
    }

    fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.buckets.iter_mut().zip(other.buckets.iter()) {
            *a += *b;
        }
        self.sum += other.sum;
        self.count += other.count;
    }
}

/// LookupRoute series of one model.
#[derive(Clone, Debug, Default)]
pub struct ModelLookups {
    /// `(reason_code, hint_used) → calls`; a short list, since reason codes are a small set.
    pub calls: Vec<(String, bool, u64)>,
    /// Latency histogram.
    pub latency: Histogram,
}

/// The label value every value past [`MAX_LABEL_VALUES`] (or longer than
/// [`MAX_LABEL_VALUE_BYTES`]) is folded into, so a client sending endless distinct or huge ids
/// cannot grow the registry or the scrape without bound.
pub const OVERFLOW_LABEL: &str = "__overflow__";

/// Whether `value` gets its own series in a map already holding `len` values.
fn own_series(len: usize, value: &str) -> bool {
    len < MAX_LABEL_VALUES && value.len() <= MAX_LABEL_VALUE_BYTES
}

/// The entry of `value` in a label map, or of [`OVERFLOW_LABEL`] once the map is full or the
/// value too long (counted in `overflows[family]`). Looks up before allocating.
fn label_slot<'m, V: Default>(
    map: &'m mut FastMap<String, V>,
    value: &str,
    family: &'static str,
    overflows: &mut BTreeMap<&'static str, u64>,
) -> &'m mut V {
    if map.contains_key(value) {
        return map.get_mut(value).expect("present");
    }
    let own_values = map.len() - usize::from(map.contains_key(OVERFLOW_LABEL));
    let key = if value == OVERFLOW_LABEL || own_series(own_values, value) {
        value
    } else {
        *overflows.entry(family).or_default() += 1;
        OVERFLOW_LABEL
    };
    map.entry(key.to_string()).or_default()
}

/// Everything one core records; also the shape of a merged scrape.
#[derive(Clone, Debug, Default)]
pub struct CoreMetrics {
    /// LookupRoute calls and latency per model.
    pub lookups: FastMap<String, ModelLookups>,
    /// Quota evictions per tenant (`reason="over_entries"`).
    pub tenant_evictions: FastMap<String, u64>,
    /// Cap / TTL evictions per `(algorithm, reason)`.
    pub index_evictions: BTreeMap<(&'static str, &'static str), u64>,
    /// Prefix entries carried by applied ingest messages.
    pub ingest_entries: u64,
    /// Producer timestamps clamped to the allowed skew.
    pub timestamps_clamped: u64,
    /// Ingest messages refused whole, per reason.
    pub ingest_refused: BTreeMap<&'static str, u64>,
    /// Incomplete gRPC request messages given up, per reason.
    pub grpc_messages_refused: BTreeMap<&'static str, u64>,
    /// Plain LookupRoutes answered in the connection's own turn (the gRPC front end's inline
    /// path).
    pub inline_lookups_answered: u64,
    /// Plain LookupRoutes the inline path decided and sent on from the connection (to the
    /// owner core or the tokenizer), answered when that work is done.
    pub inline_lookups_awaited: u64,
    /// Plain LookupRoutes the inline path handed to the general path.
    pub inline_lookups_handed_on: u64,
    /// Bytes of HPACK dynamic-table entries evicted on the gRPC port (RFC 7541 §4.4 sizes).
    pub hpack_evicted_bytes: u64,
    /// Watched quiet connections the spinning core woke when their bytes arrived.
    pub spin_watch_woken: u64,
    /// Watched quiet connections handed back to glommio's poll when the core stopped spinning.
    pub spin_watch_released: u64,
    /// Requests answered on the core that received them (no hop).
    pub local: u64,
    /// Requests that hopped to the owner core.
    pub hopped: u64,
    /// This core's share of `inferencecache_index_entries{model}` (last published value).
    pub index_entries: FastMap<String, i64>,
    /// Storage entries in this core's index (read at scrape time).
    pub core_entries: i64,
    /// Approximate heap bytes of this core's index (read at scrape time).
    pub core_bytes: i64,
    /// Live interned names of this core's index (read at scrape time).
    pub core_strings: i64,
    /// Bytes of those names (read at scrape time).
    pub core_string_bytes: i64,
    /// Observations folded into [`OVERFLOW_LABEL`], per family.
    pub label_overflows: BTreeMap<&'static str, u64>,
    /// Calls of the RPCs other than LookupRoute, per `(rpc, reason_code)` (fixed label values).
    pub rpc_calls: BTreeMap<(&'static str, &'static str), u64>,
    /// Times a named limit (`src/limits.rs`) turned work away or cut it short.
    pub limit_hits: BTreeMap<&'static str, u64>,
    /// TTL sweep passes completed.
    pub sweeps: u64,
    /// TTL sweep slices run (each at most `SWEEP_SLICE_BUDGET` / `SWEEP_SLICE_MAX_ENTRIES`).
    pub sweep_slices: u64,
    /// Wall time of the last completed sweep pass, first slice to last (seconds; the largest
    /// over cores once merged).
    pub sweep_last_duration: f64,
    /// When that pass started, seconds since the Unix epoch (the latest over cores once
    /// merged): with its duration, the window in which lookups may have queued behind it.
    pub sweep_last_started: f64,
    /// Longest slice of the last completed sweep pass (seconds; the largest over cores once
    /// merged).
    pub sweep_last_max_slice: f64,
    /// Most thread CPU time one slice of that pass took (seconds; wall minus CPU is time the
    /// OS ran something else on the core's CPU).
    pub sweep_last_max_slice_cpu: f64,
    /// Global-cap candidate heaps built ahead of need, in slices, and installed.
    pub cap_builds: u64,
    /// Slices those builds ran in (each at most `CAP_BUILD_SLICE_BUDGET` /
    /// `CAP_BUILD_SLICE_MAX_ENTRIES`).
    pub cap_build_slices: u64,
    /// Cap candidate builds run or finished in one go by an ingest (or a cross-core candidate
    /// request) that needed victims before a build ahead of need was ready: the fallback,
    /// O(entries) on that request's path.
    pub cap_builds_sync: u64,
    /// `ALL_CLEARED` removals a core finished in one go because an operation needed the store
    /// before their slices had (the fallback).
    pub clears_sync: u64,
    /// Slices of `ALL_CLEARED` removals a core ran (the core serves queued requests between two).
    pub clear_slices: u64,
    /// Cap build (or algorithm re-resolution) slices a core ran for an ingest or a cross-core
    /// candidate request whose victims were not ready, before serving it (it waited instead of
    /// building them in one go).
    pub cap_slices_on_demand: u64,
    /// Tenant quota candidate heaps built (or finished) in one go by an ingest or a cross-core
    /// candidate request that needed victims while they were not ready: the fallback, O(keys of
    /// the core) on that request's path.
    pub quota_builds_sync: u64,
    /// Quota heap build slices a core ran for an ingest or a cross-core candidate request whose
    /// quota victims were not ready, before serving it.
    pub quota_slices_on_demand: u64,
    /// Steps of at most `CAP_ENFORCE_SLICE_MAX_EVICTIONS` global-cap evictions run after an
    /// ingest's own step (one core) or per cross-core round (several).
    pub cap_enforce_slices: u64,
    /// Cross-core cap rounds asked again because a core's heap ran out of live candidates
    /// (`MAX_CAP_CANDIDATE_ROUNDS`), counted on the core whose ingest drove the round.
    pub cap_candidate_retries: u64,
    /// Parts of large ReportCacheState messages applied one step each (`INGEST_PART_BLOCKS`).
    pub ingest_parts: u64,
    /// Steps of the check that a message's names and keyspaces fit, each a piece of its own
    /// (`ADMISSION_STEP_PREFIXES` adapters looked up at most).
    pub admission_steps: u64,
    /// Maintenance pieces that waited for a later reactor turn (the lane was taken in theirs).
    pub lane_waits: u64,
    /// Pieces run on a hop (mailbox drain task) in a turn whose lane was already taken.
    pub lane_hop_overruns: u64,
    /// ReportCacheState and PublishEvent messages over `OFFCORE_DECODE_MIN_BYTES` a core had
    /// decoded on the decode pool instead of decoding them itself.
    pub offcore_decodes: u64,
    /// Longest slice of the last completed build ahead of need (seconds; the largest over
    /// cores once merged).
    pub cap_build_last_max_slice: f64,
    /// Most thread CPU time one slice of that build took (seconds).
    pub cap_build_last_max_slice_cpu: f64,
    /// Most a heartbeat tick of the core came late since start (seconds; the largest over
    /// cores once merged).
    pub heartbeat_max_lag: f64,
    /// Every maintenance slice's wall time, per [`Maintenance`] kind: the longest a request
    /// queued on the core can have waited behind one.
    pub maintenance_slice: [Histogram; Maintenance::KINDS],
    /// Every maintenance slice's thread CPU time (wall minus CPU is time the OS ran something
    /// else on the core's CPU), per [`Maintenance`] kind.
    pub maintenance_slice_cpu: [Histogram; Maintenance::KINDS],
}

/// The index maintenance a core runs in slices between requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Maintenance {
    /// A TTL sweep pass.
    Sweep = 0,
    /// A global-cap candidate build ahead of need.
    CapBuild = 1,
}

impl Maintenance {
    /// Number of kinds (the `work` label's values).
    pub const KINDS: usize = 2;
    /// Every kind, in label order.
    pub const ALL: [Maintenance; Maintenance::KINDS] = [Maintenance::Sweep, Maintenance::CapBuild];

    /// The `work` label value.
    pub fn label(self) -> &'static str {
        match self {
            Maintenance::Sweep => "sweep",
            Maintenance::CapBuild => "cap_build",
        }
    }
}

impl CoreMetrics {
    fn record_lookup(&mut self, model: &str, reason: &str, hint_used: bool, latency: Duration) {
        let m = label_slot(
            &mut self.lookups,
            model,
            LOOKUP_FAMILY,
            &mut self.label_overflows,
        );
        match m
            .calls
            .iter_mut()
            .find(|(r, h, _)| r == reason && *h == hint_used)
        {
            Some(c) => c.2 += 1,
            None => m.calls.push((reason.to_string(), hint_used, 1)),
        }
        m.latency.observe(latency.as_secs_f64());
    }

    /// Adds `other`'s series to these.
    pub fn merge(&mut self, other: &CoreMetrics) {
        // Values folded here were counted by the core that recorded them (or are a scrape-time
        // fold of values the cores kept), so merge folds are not counted again.
        let uncounted = &mut BTreeMap::new();
        for (model, o) in &other.lookups {
            let m = label_slot(&mut self.lookups, model, LOOKUP_FAMILY, uncounted);
            for (r, h, n) in &o.calls {
                match m.calls.iter_mut().find(|(mr, mh, _)| mr == r && mh == h) {
                    Some(c) => c.2 += n,
                    None => m.calls.push((r.clone(), *h, *n)),
                }
            }
            m.latency.merge(&o.latency);
        }
        for (t, n) in &other.tenant_evictions {
            *label_slot(&mut self.tenant_evictions, t, TENANT_FAMILY, uncounted) += n;
        }
        for (family, n) in &other.label_overflows {
            *self.label_overflows.entry(family).or_default() += n;
        }
        for (k, n) in &other.index_evictions {
            *self.index_evictions.entry(*k).or_default() += n;
        }
        for (m, n) in &other.index_entries {
            *self.index_entries.entry(m.clone()).or_default() += n;
        }
        self.ingest_entries += other.ingest_entries;
        self.timestamps_clamped += other.timestamps_clamped;
        for (reason, n) in &other.ingest_refused {
            *self.ingest_refused.entry(reason).or_default() += n;
        }
        for (k, n) in &other.rpc_calls {
            *self.rpc_calls.entry(*k).or_default() += n;
        }
        for (k, n) in &other.limit_hits {
            *self.limit_hits.entry(k).or_default() += n;
        }
        for (reason, n) in &other.grpc_messages_refused {
            *self.grpc_messages_refused.entry(reason).or_default() += n;
        }
        self.inline_lookups_answered += other.inline_lookups_answered;
        self.inline_lookups_awaited += other.inline_lookups_awaited;
        self.inline_lookups_handed_on += other.inline_lookups_handed_on;
        self.hpack_evicted_bytes += other.hpack_evicted_bytes;
        self.spin_watch_woken += other.spin_watch_woken;
        self.spin_watch_released += other.spin_watch_released;
        self.sweeps += other.sweeps;
        self.sweep_slices += other.sweep_slices;
        self.sweep_last_duration = self.sweep_last_duration.max(other.sweep_last_duration);
        self.sweep_last_started = self.sweep_last_started.max(other.sweep_last_started);
        self.sweep_last_max_slice = self.sweep_last_max_slice.max(other.sweep_last_max_slice);
        self.sweep_last_max_slice_cpu = self
            .sweep_last_max_slice_cpu
            .max(other.sweep_last_max_slice_cpu);
        self.cap_builds += other.cap_builds;
        self.cap_build_slices += other.cap_build_slices;
        self.cap_builds_sync += other.cap_builds_sync;
        self.clears_sync += other.clears_sync;
        self.clear_slices += other.clear_slices;
        self.cap_slices_on_demand += other.cap_slices_on_demand;
        self.quota_builds_sync += other.quota_builds_sync;
        self.quota_slices_on_demand += other.quota_slices_on_demand;
        self.cap_enforce_slices += other.cap_enforce_slices;
        self.cap_candidate_retries += other.cap_candidate_retries;
        self.ingest_parts += other.ingest_parts;
        self.admission_steps += other.admission_steps;
        self.lane_waits += other.lane_waits;
        self.lane_hop_overruns += other.lane_hop_overruns;
        self.offcore_decodes += other.offcore_decodes;
        self.cap_build_last_max_slice = self
            .cap_build_last_max_slice
            .max(other.cap_build_last_max_slice);
        self.cap_build_last_max_slice_cpu = self
            .cap_build_last_max_slice_cpu
            .max(other.cap_build_last_max_slice_cpu);
        self.heartbeat_max_lag = self.heartbeat_max_lag.max(other.heartbeat_max_lag);
        for kind in 0..Maintenance::KINDS {
            self.maintenance_slice[kind].merge(&other.maintenance_slice[kind]);
            self.maintenance_slice_cpu[kind].merge(&other.maintenance_slice_cpu[kind]);
        }
        self.local += other.local;
        self.hopped += other.hopped;
        self.core_entries += other.core_entries;
        self.core_bytes += other.core_bytes;
        self.core_strings += other.core_strings;
        self.core_string_bytes += other.core_string_bytes;
    }
}

thread_local! {
    static LOCAL: RefCell<CoreMetrics> = RefCell::new(CoreMetrics::default());
    static IS_CORE: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread as a serving core: its series go to its own thread-local store,
/// which [`core_snapshot`] copies at scrape time. Called once by each executor at start.
pub fn register_core_thread() {
    IS_CORE.with(|c| c.set(true));
}

/// Copies the calling core's store (run on each core at scrape time).
pub fn core_snapshot() -> CoreMetrics {
    LOCAL.with(|l| l.borrow().clone())
}

/// Copies the off-core fallback store.
pub fn fallback_snapshot() -> CoreMetrics {
    FALLBACK
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .unwrap_or_default()
}

/// Series recorded off the cores (admin thread, tests); never touched by the request path.
static FALLBACK: Mutex<Option<CoreMetrics>> = Mutex::new(None);

/// Applies `f` to the calling thread's store: the core's thread-local, or the fallback.
fn with_store(f: impl FnOnce(&mut CoreMetrics)) {
    if IS_CORE.with(|c| c.get()) {
        LOCAL.with(|l| f(&mut l.borrow_mut()));
    } else {
        let mut g = FALLBACK.lock().unwrap_or_else(|e| e.into_inner());
        f(g.get_or_insert_with(CoreMetrics::default));
    }
}

/// One LookupRoute call (§10.4): `inferencecache_lookup_route_calls_total` and one latency
/// observation. `latency` zero is allowed (the probe-tenant short-circuit observes 0).
pub fn record_lookup(model: &str, reason: &str, hint_used: bool, latency: Duration) {
    with_store(|m| m.record_lookup(model, reason, hint_used, latency));
}

/// `n` prefix keys of `tenant` evicted by quota enforcement (§7.1). `n == 0` creates nothing.
pub fn record_tenant_evictions(tenant: &str, n: u64) {
    if n == 0 {
        return;
    }
    with_store(|m| {
        *label_slot(
            &mut m.tenant_evictions,
            tenant,
            TENANT_FAMILY,
            &mut m.label_overflows,
        ) += n
    });
}

/// `n` storage entries removed by the cap or the TTL sweep (§7.2, §6), labelled with the owning
/// tenant's algorithm (`"lru"`/`"lfu"`) and reason (`"cap"`/`"ttl"`). `n == 0` creates nothing.
pub fn record_index_evictions(algorithm: &'static str, reason: &'static str, n: u64) {
    if n == 0 {
        return;
    }
    with_store(|m| *m.index_evictions.entry((algorithm, reason)).or_default() += n);
}

/// One applied ingest message carrying `entries` prefix entries (operator series).
pub fn record_ingest(entries: u64) {
    with_store(|m| m.ingest_entries += entries);
}

/// One ingest message refused whole (`reason` is a fixed label value).
pub fn record_ingest_refused(reason: &'static str) {
    with_store(|m| *m.ingest_refused.entry(reason).or_default() += 1);
}

/// One call of `rpc` (RenderTemplate, LookupPDRoute, StreamCacheEvents, StreamMetrics) answered
/// with `reason_code`: `inferencecache_rpc_calls_total{rpc,reason_code}`. Both labels are fixed
/// strings, so the family is bounded by construction.
pub fn record_rpc(rpc: &'static str, reason_code: &'static str) {
    with_store(|m| *m.rpc_calls.entry((rpc, reason_code)).or_default() += 1);
}

/// One hit of the limit named `limit` (`inferencecache_limit_hits_total{limit}`): a request,
/// registration or subscriber turned away or cut short by a bound of `src/limits.rs`.
pub fn record_limit_hit(limit: &'static str) {
    with_store(|m| *m.limit_hits.entry(limit).or_default() += 1);
}

/// One completed TTL sweep pass of `slices` slices: its wall time (first slice to last), its
/// longest slice, and the most thread CPU time one slice took.
pub fn record_sweep(
    started: SystemTime,
    slices: u64,
    duration: Duration,
    max_slice: Duration,
    max_slice_cpu: Duration,
) {
    let started = started.duration_since(UNIX_EPOCH).unwrap_or_default();
    with_store(|m| {
        m.sweeps += 1;
        m.sweep_last_started = started.as_secs_f64();
        m.sweep_slices += slices;
        m.sweep_last_duration = duration.as_secs_f64();
        m.sweep_last_max_slice = max_slice.as_secs_f64();
        m.sweep_last_max_slice_cpu = max_slice_cpu.as_secs_f64();
    });
}

/// One maintenance slice of `kind` that took `wall` (and `cpu` of thread CPU time, when the
/// clock is available).
pub fn record_maintenance_slice(kind: Maintenance, wall: Duration, cpu: Option<Duration>) {
    with_store(|m| {
        m.maintenance_slice[kind as usize].observe(wall.as_secs_f64());
        if let Some(cpu) = cpu {
            m.maintenance_slice_cpu[kind as usize].observe(cpu.as_secs_f64());
        }
    });
}

/// One completed global-cap candidate build ahead of need, of `slices` slices: its longest
/// slice, and the most thread CPU time one slice took.
pub fn record_cap_build(slices: u64, max_slice: Duration, max_slice_cpu: Duration) {
    with_store(|m| {
        m.cap_builds += 1;
        m.cap_build_slices += slices;
        m.cap_build_last_max_slice = max_slice.as_secs_f64();
        m.cap_build_last_max_slice_cpu = max_slice_cpu.as_secs_f64();
    });
}

/// One heartbeat tick of the calling core came `lag` after it was due.
pub fn record_heartbeat_lag(lag: Duration) {
    with_store(|m| m.heartbeat_max_lag = m.heartbeat_max_lag.max(lag.as_secs_f64()));
}

/// `n` cap candidate builds run or finished in one go on the path that needed victims.
pub fn record_cap_builds_sync(n: u64) {
    if n > 0 {
        with_store(|m| m.cap_builds_sync += n);
    }
}

/// One cap build slice ran before an operation that needed its victims (`CoreState::cap_slice_before`).
pub fn record_cap_slice_on_demand() {
    with_store(|m| m.cap_slices_on_demand += 1);
}

/// `n` tenant quota heaps built or finished in one go on the path that needed victims.
pub fn record_quota_builds_sync(n: u64) {
    if n > 0 {
        with_store(|m| m.quota_builds_sync += n);
    }
}

/// One quota heap build slice ran before an operation that needed its victims
/// (`CoreState::cap_slice_before`).
pub fn record_quota_slice_on_demand() {
    with_store(|m| m.quota_slices_on_demand += 1);
}

/// One step of global-cap evictions ran after an ingest (`CoreState::cap_enforce_slice`,
/// `CoreState::evict_cap`).
pub fn record_cap_enforce_slice() {
    with_store(|m| m.cap_enforce_slices += 1);
}

/// A maintenance piece waited for a later reactor turn (`runtime::lane`).
pub fn record_lane_wait() {
    with_store(|m| m.lane_waits += 1);
}

/// A piece ran on a hop in a turn whose maintenance lane was already taken (`runtime::lane`).
pub fn record_lane_hop_overrun() {
    with_store(|m| m.lane_hop_overruns += 1);
}

/// One part of a large ReportCacheState message was applied (`CoreState::ingest_part`).
pub fn record_ingest_part() {
    with_store(|m| m.ingest_parts += 1);
}

/// One step of a message's admission check ran instead of a part (`CoreState::ingest_part`).
pub fn record_admission_step() {
    with_store(|m| m.admission_steps += 1);
}

/// A large message was handed to the decode pool (`grpc::ingest_rpc`).
pub fn record_offcore_decode() {
    with_store(|m| m.offcore_decodes += 1);
}

/// A cross-core cap round is asked again (`evict::cap_candidates_everywhere`).
pub fn record_cap_candidate_retry() {
    with_store(|m| m.cap_candidate_retries += 1);
}

/// One slice of a pending `ALL_CLEARED`'s removals ran.
pub fn record_clear_slice() {
    with_store(|m| m.clear_slices += 1);
}

/// Pending `ALL_CLEARED` removals finished in one go by an operation that needed the store.
pub fn record_clears_sync(n: u64) {
    if n > 0 {
        with_store(|m| m.clears_sync += n);
    }
}

/// One incomplete gRPC request message given up (budget spent or too slow).
pub fn record_grpc_message_refused(reason: &'static str) {
    with_store(|m| *m.grpc_messages_refused.entry(reason).or_default() += 1);
}

/// One plain LookupRoute taken by the gRPC front end's inline path: answered there, or handed
/// to the general path (split or trailed body, tokenizer, another core's partition).
pub fn record_inline_lookup(outcome: InlineOutcome) {
    with_store(|m| match outcome {
        InlineOutcome::Answered => m.inline_lookups_answered += 1,
        InlineOutcome::Awaited => m.inline_lookups_awaited += 1,
        InlineOutcome::HandedOn => m.inline_lookups_handed_on += 1,
    });
}

/// `bytes` of HPACK dynamic-table entries a peer's header block evicted (an entry's size as
/// RFC 7541 §4.1 counts it): the table's churn, which a client reusing its headers hardly causes
/// and an HPACK bomb's table-churn variant causes on every block.
pub fn record_hpack_evicted(bytes: u64) {
    with_store(|m| m.hpack_evicted_bytes += bytes);
}

/// What the gRPC front end's inline path did with a plain LookupRoute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InlineOutcome {
    /// Answered in the connection's turn.
    Answered,
    /// Decided in the turn and sent on (to the owner core or the tokenizer), answered later.
    Awaited,
    /// Handed to the general path.
    HandedOn,
}

/// Watched quiet connections (`runtime::watch`): `woken` when their bytes arrived while the
/// core spun, `released` to glommio's poll when it stopped spinning.
pub fn record_spin_watch(woken: u64, released: u64) {
    with_store(|m| {
        m.spin_watch_woken += woken;
        m.spin_watch_released += released;
    });
}

/// One producer timestamp (ingest or event) later than the allowed skew, clamped.
pub fn record_timestamp_clamped() {
    with_store(|m| m.timestamps_clamped += 1);
}

/// One request routed by the receiving core: answered locally (it owns the partition), or
/// hopped to its owner.
pub fn record_hop(local: bool) {
    with_store(|m| if local { m.local += 1 } else { m.hopped += 1 });
}

/// Publishes this core's count of distinct non-reserved prefix keys for `model` (its share of
/// `inferencecache_index_entries{model}`; the scrape sums the cores). Call after every ingest,
/// event and sweep for each model the operation touched, including with 0 when a model drained:
/// the series then stays at 0, as in the reference.
pub fn publish_index_entries(model: &str, count: i64) {
    with_store(|m| match m.index_entries.get_mut(model) {
        Some(c) => *c = count,
        None => {
            m.index_entries.insert(model.to_string(), count);
        }
    });
}

/// `inferencecache_server_up`: 1 while serving.
static SERVER_UP: AtomicI64 = AtomicI64::new(0);
/// `inferencecache_server_grpc_tls_enabled`.
static GRPC_TLS: AtomicI64 = AtomicI64::new(0);

/// Sets `inferencecache_server_up` (1 once serving starts, 0 on shutdown).
pub fn set_server_up(up: bool) {
    SERVER_UP.store(up as i64, Ordering::SeqCst);
}

/// Sets `inferencecache_server_grpc_tls_enabled` (at construction).
pub fn set_grpc_tls_enabled(on: bool) {
    GRPC_TLS.store(on as i64, Ordering::SeqCst);
}

/// The three authenticated controller-facing endpoints (`*_auth_total` families).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthEndpoint {
    /// `/snapshot`.
    Snapshot = 0,
    /// `/policy`.
    Policy = 1,
    /// `/probe`.
    Probe = 2,
}

/// Outcome label of an `*_auth_total` increment (§13.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthResult {
    /// Authenticated as the allowed identity.
    Ok = 0,
    /// Missing/invalid bearer token or not authenticated.
    Unauth = 1,
    /// Authenticated as someone else.
    Forbidden = 2,
    /// TokenReview unavailable.
    Error = 3,
}

const AUTH_RESULTS: [&str; 4] = ["ok", "unauth", "forbidden", "error"];
const AUTH_FAMILIES: [&str; 3] = [
    "inferencecache_snapshot_auth",
    "inferencecache_policy_auth",
    "inferencecache_probe_auth",
];

static AUTH: [[AtomicU64; 4]; 3] = [const { [const { AtomicU64::new(0) }; 4] }; 3];

/// One request reached `endpoint`'s auth middleware with `result`.
pub fn record_auth(endpoint: AuthEndpoint, result: AuthResult) {
    AUTH[endpoint as usize][result as usize].fetch_add(1, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render_local(m: CoreMetrics) -> String {
        let scrape = Scrape {
            total: m,
            ..Scrape::default()
        };
        encode(scrape)
    }

    #[test]
    fn histogram_buckets_are_inclusive() {
        let mut h = Histogram::default();
        h.observe(0.0);
        h.observe(0.0001);
        h.observe(0.00010001);
        h.observe(1.0);
        assert_eq!(h.buckets[0], 2);
        assert_eq!(h.buckets[1], 1);
        assert_eq!(h.buckets[LATENCY_BUCKETS.len()], 1);
        assert_eq!(h.count, 4);
    }

    #[test]
    fn lazily_created_series_and_label_order() {
        let mut m = CoreMetrics::default();
        let text = render_local(m.clone());
        assert!(!text.contains("inferencecache_lookup_route_calls_total"));
        assert!(!text.contains("inferencecache_tenant_evictions_total"));
        assert!(text.contains("inferencecache_server_up 0\n"));
        m.record_lookup("m", "NO_HINT", false, Duration::ZERO);
        m.tenant_evictions.insert("team-a".into(), 3);
        m.index_evictions.insert(("lfu", "cap"), 2);
        m.index_evictions.insert(("lru", "ttl"), 1);
        let text = render_local(m);
        assert!(text.contains(
            "inferencecache_lookup_route_calls_total{hint_used=\"false\",model=\"m\",reason_code=\"NO_HINT\"} 1\n"
        ), "{text}");
        assert!(text.contains(
            "inferencecache_tenant_evictions_total{reason=\"over_entries\",tenant_id=\"team-a\"} 3\n"
        ));
        assert!(text.contains(
            "inferencecache_index_evictions_total{algorithm=\"lfu\",reason=\"cap\"} 2\n"
        ));
        assert!(text.contains(
            "inferencecache_index_evictions_total{algorithm=\"lru\",reason=\"ttl\"} 1\n"
        ));
        assert!(text.contains(
            "inferencecache_lookup_route_latency_seconds_bucket{model=\"m\",le=\"0.0001\"} 1\n"
        ));
        assert!(text.contains(
            "inferencecache_lookup_route_latency_seconds_bucket{model=\"m\",le=\"+Inf\"} 1\n"
        ));
        assert!(
            text.contains("inferencecache_lookup_route_latency_seconds_count{model=\"m\"} 1\n")
        );
    }

    #[test]
    fn merge_sums_cores() {
        let mut a = CoreMetrics::default();
        a.record_lookup("m", "PREFIX_MATCH", true, Duration::from_micros(300));
        a.index_entries.insert("m".into(), 2);
        let mut b = CoreMetrics::default();
        b.record_lookup("m", "PREFIX_MATCH", true, Duration::from_millis(2));
        b.index_entries.insert("m".into(), 3);
        a.merge(&b);
        assert_eq!(a.lookups["m"].calls, vec![("PREFIX_MATCH".into(), true, 2)]);
        assert_eq!(a.lookups["m"].latency.count, 2);
        assert_eq!(a.index_entries["m"], 5);
    }

    #[test]
    fn process_stats_read() {
        let p = process::read().expect("linux /proc");
        assert!(p.resident_bytes > 0);
        assert!(p.open_fds > 0);
        assert!(p.start_time_seconds > 1.0e9);
    }

    #[test]
    fn label_values_past_the_bound_share_the_overflow_series() {
        let mut m = CoreMetrics::default();
        for i in 0..MAX_LABEL_VALUES + 10 {
            m.record_lookup(&format!("m{i}"), "NO_HINT", false, Duration::ZERO);
        }
        m.record_lookup(
            &"x".repeat(MAX_LABEL_VALUE_BYTES + 1),
            "NO_HINT",
            false,
            Duration::ZERO,
        );
        m.record_lookup("m0", "NO_HINT", false, Duration::ZERO);
        assert_eq!(m.lookups.len(), MAX_LABEL_VALUES + 1);
        assert_eq!(m.lookups[OVERFLOW_LABEL].latency.count, 11);
        assert_eq!(m.lookups["m0"].latency.count, 2);
        assert_eq!(m.label_overflows[LOOKUP_FAMILY], 11);
        let mut merged = CoreMetrics::default();
        merged.merge(&m);
        merged.merge(&m);
        assert_eq!(merged.lookups.len(), MAX_LABEL_VALUES + 1);
        assert_eq!(merged.label_overflows[LOOKUP_FAMILY], 22);
        let text = render_local(merged);
        assert!(text.contains("inferencecache_metrics_label_overflow_total{family=\"inferencecache_lookup_route_calls_total\"} 22\n"), "{}", &text[..2000]);
    }

    #[test]
    fn index_entries_gauge_folds_past_the_bound_at_exposition() {
        let mut m = CoreMetrics::default();
        for i in 0..MAX_LABEL_VALUES + 5 {
            m.index_entries.insert(format!("m{i:05}"), 1);
        }
        m.index_entries
            .insert("y".repeat(MAX_LABEL_VALUE_BYTES + 1), 7);
        let text = render_local(m);
        let series = text.matches("inferencecache_index_entries{").count();
        assert_eq!(series, MAX_LABEL_VALUES + 1);
        assert!(text.contains("inferencecache_index_entries{model=\"__overflow__\"} 12\n"));
    }
}
