//! The `/metrics` registry (BEHAVIOUR.md §16) plus per-core operator series.
//!
//! Recording never takes a shared lock on the request path: each glommio core records into its
//! own thread-local [`CoreMetrics`], and a scrape gathers those copies over the mailbox hop and
//! merges them on the admin thread. Series recorded from non-core threads (the admin thread's
//! HTTP handlers, tests) go to a mutex-guarded fallback that the hot path never touches; the
//! auth counters and the two plain gauges are process-wide atomics.
//!
//! Exposition is prometheus-client's Prometheus text format 0.0.4, the format Go's client
//! serves: families sorted by name, label pairs in name order, counters created lazily (a family
//! with no series is omitted entirely), histograms with cumulative buckets.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::runtime::mailbox;

/// `Content-Type` of the exposition (Prometheus text 0.0.4, as Go's promhttp serves by default).
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Upper bounds of `inferencecache_lookup_route_latency_seconds` (the `+Inf` bucket is implied).
pub const LATENCY_BUCKETS: [f64; 10] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
];

/// Longest a scrape waits for the cores' copies; a core that does not answer in time (stuck, or
/// already stopped during shutdown) is left out of that scrape instead of hanging `/metrics`.
pub const GATHER_TIMEOUT: Duration = Duration::from_secs(2);

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
    /// Requests answered on the core that received them.
    pub inline: u64,
    /// Requests that hopped to the owner core.
    pub hopped: u64,
    /// This core's share of `inferencecache_index_entries{model}` (last published value).
    pub index_entries: FastMap<String, i64>,
    /// Storage entries in this core's index (read at scrape time).
    pub core_entries: i64,
    /// Approximate heap bytes of this core's index (read at scrape time).
    pub core_bytes: i64,
}

impl CoreMetrics {
    fn record_lookup(&mut self, model: &str, reason: &str, hint_used: bool, latency: Duration) {
        let m = match self.lookups.get_mut(model) {
            Some(m) => m,
            None => self.lookups.entry(model.to_string()).or_default(),
        };
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

    fn merge(&mut self, other: &CoreMetrics) {
        for (model, o) in &other.lookups {
            let m = self.lookups.entry(model.clone()).or_default();
            for (r, h, n) in &o.calls {
                match m.calls.iter_mut().find(|(mr, mh, _)| mr == r && mh == h) {
                    Some(c) => c.2 += n,
                    None => m.calls.push((r.clone(), *h, *n)),
                }
            }
            m.latency.merge(&o.latency);
        }
        for (t, n) in &other.tenant_evictions {
            *self.tenant_evictions.entry(t.clone()).or_default() += n;
        }
        for (k, n) in &other.index_evictions {
            *self.index_evictions.entry(*k).or_default() += n;
        }
        for (m, n) in &other.index_entries {
            *self.index_entries.entry(m.clone()).or_default() += n;
        }
        self.ingest_entries += other.ingest_entries;
        self.inline += other.inline;
        self.hopped += other.hopped;
        self.core_entries += other.core_entries;
        self.core_bytes += other.core_bytes;
    }
}

thread_local! {
    static LOCAL: RefCell<CoreMetrics> = RefCell::new(CoreMetrics::default());
}

/// Series recorded off the cores (admin thread, tests); never touched by the request path.
static FALLBACK: Mutex<Option<CoreMetrics>> = Mutex::new(None);

/// Applies `f` to the calling thread's store: the core's thread-local, or the fallback.
fn with_store(f: impl FnOnce(&mut CoreMetrics)) {
    if crate::core_state::current_core().is_some() {
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
    with_store(|m| match m.tenant_evictions.get_mut(tenant) {
        Some(c) => *c += n,
        None => {
            m.tenant_evictions.insert(tenant.to_string(), n);
        }
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

/// One request routed by the receiving core: answered inline, or hopped to its owner.
pub fn record_hop(inline: bool) {
    with_store(|m| if inline { m.inline += 1 } else { m.hopped += 1 });
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

/// Copies the calling core's store (run on a core through the mailbox).
fn local_copy() -> CoreMetrics {
    LOCAL.with(|l| l.borrow().clone())
}

/// Per-core operator data gathered at scrape time.
#[derive(Clone, Debug, Default)]
struct CoreView {
    core: usize,
    metrics: CoreMetrics,
    mailbox_depth: u64,
    hopped_in: u64,
}

/// Everything one scrape renders.
#[derive(Debug, Default)]
struct Scrape {
    total: CoreMetrics,
    cores: Vec<CoreView>,
    process: Option<crate::metrics::process::ProcessStats>,
}

/// Gathers every core's store (and the fallback) and renders the exposition text.
pub async fn render() -> String {
    let mut scrape = Scrape::default();
    let cores = mailbox::cores();
    let deadline = tokio::time::Instant::now() + GATHER_TIMEOUT;
    for core in 0..cores {
        let got = tokio::time::timeout_at(
            deadline,
            mailbox::call(core, |st: &mut crate::core_state::CoreState| {
                let mut m = local_copy();
                m.core_entries = st.index.entry_count() as i64;
                m.core_bytes = st.index.approx_heap_bytes() as i64;
                m
            }),
        )
        .await;
        let metrics = match got {
            Ok(Ok(m)) => m,
            _ => continue,
        };
        scrape.total.merge(&metrics);
        let inbox = mailbox::inbox(core);
        scrape.cores.push(CoreView {
            core,
            metrics,
            mailbox_depth: mailbox::depth(core) as u64,
            hopped_in: inbox.hopped_in.load(Ordering::Relaxed),
        });
    }
    if let Some(fb) = FALLBACK.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
        scrape.total.merge(fb);
    }
    scrape.process = process::read();
    encode(scrape)
}

fn encode(scrape: Scrape) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(scrape));
    let mut out = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)
        .expect("writing to a String cannot fail");
    out
}

/// One family to emit: name (without the `_total` a counter gets), help, type, series writer.
type Family<'a> = (
    &'static str,
    &'static str,
    MetricType,
    Box<dyn Fn(&mut MetricEncoder) -> Result<(), std::fmt::Error> + 'a>,
);

fn counter<V: prometheus_client::encoding::EncodeCounterValue>(
    enc: &mut MetricEncoder,
    labels: &[(&str, &str)],
    v: V,
) -> std::fmt::Result {
    ConstCounter::new(v).encode(enc.encode_family(&labels)?)
}

fn gauge<V: prometheus_client::encoding::EncodeGaugeValue + Copy>(
    enc: &mut MetricEncoder,
    labels: &[(&str, &str)],
    v: V,
) -> std::fmt::Result {
    ConstGauge::new(v).encode(enc.encode_family(&labels)?)
}

fn histogram(enc: &mut MetricEncoder, labels: &[(&str, &str)], h: &Histogram) -> std::fmt::Result {
    let buckets: Vec<(f64, u64)> = LATENCY_BUCKETS
        .iter()
        .copied()
        .chain(std::iter::once(f64::INFINITY))
        .zip(h.buckets.iter().copied())
        .collect();
    enc.encode_family(&labels)?
        .encode_histogram::<prometheus_client::encoding::NoLabelSet>(h.sum, h.count, &buckets, None)
}

impl Collector for Scrape {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let t = &self.total;
        let mut fams: Vec<Family> = Vec::new();

        // Contract families (§16).
        fams.push((
            "inferencecache_server_up",
            "1 while the server is serving, 0 otherwise.",
            MetricType::Gauge,
            Box::new(|e| gauge(e, &[], SERVER_UP.load(Ordering::SeqCst))),
        ));
        fams.push((
            "inferencecache_server_grpc_tls_enabled",
            "1 if TLS is configured on the gRPC port, else 0.",
            MetricType::Gauge,
            Box::new(|e| gauge(e, &[], GRPC_TLS.load(Ordering::SeqCst))),
        ));
        if !t.index_entries.is_empty() {
            fams.push((
                "inferencecache_index_entries",
                "Distinct prefix keys in the index, per model (all tenants).",
                MetricType::Gauge,
                Box::new(|e| {
                    let mut rows: Vec<_> = t.index_entries.iter().collect();
                    rows.sort();
                    for (model, n) in rows {
                        gauge(e, &[("model", model)], *n)?;
                    }
                    Ok(())
                }),
            ));
        }
        if !t.lookups.is_empty() {
            fams.push((
                "inferencecache_lookup_route_calls",
                "LookupRoute calls by model, reason code and whether a hint was returned.",
                MetricType::Counter,
                Box::new(|e| {
                    let mut rows: Vec<(&str, &str, &str, u64)> = Vec::new();
                    for (model, m) in &t.lookups {
                        for (r, h, n) in &m.calls {
                            rows.push((if *h { "true" } else { "false" }, model, r, *n));
                        }
                    }
                    rows.sort();
                    for (h, model, r, n) in rows {
                        counter(
                            e,
                            &[("hint_used", h), ("model", model), ("reason_code", r)],
                            n,
                        )?;
                    }
                    Ok(())
                }),
            ));
            fams.push((
                "inferencecache_lookup_route_latency_seconds",
                "LookupRoute handler latency.",
                MetricType::Histogram,
                Box::new(|e| {
                    let mut rows: Vec<_> = t.lookups.iter().collect();
                    rows.sort_by(|a, b| a.0.cmp(b.0));
                    for (model, m) in rows {
                        histogram(e, &[("model", model)], &m.latency)?;
                    }
                    Ok(())
                }),
            ));
        }
        if !t.tenant_evictions.is_empty() {
            fams.push((
                "inferencecache_tenant_evictions",
                "Prefix keys evicted by per-tenant quota enforcement.",
                MetricType::Counter,
                Box::new(|e| {
                    let mut rows: Vec<_> = t.tenant_evictions.iter().collect();
                    rows.sort();
                    for (tenant, n) in rows {
                        counter(e, &[("reason", "over_entries"), ("tenant_id", tenant)], *n)?;
                    }
                    Ok(())
                }),
            ));
        }
        if !t.index_evictions.is_empty() {
            fams.push((
                "inferencecache_index_evictions",
                "Storage entries removed by the global cap or the TTL sweep.",
                MetricType::Counter,
                Box::new(|e| {
                    for ((alg, reason), n) in &t.index_evictions {
                        counter(e, &[("algorithm", alg), ("reason", reason)], *n)?;
                    }
                    Ok(())
                }),
            ));
        }
        for (i, name) in AUTH_FAMILIES.iter().enumerate() {
            let values: Vec<u64> = AUTH[i].iter().map(|a| a.load(Ordering::Relaxed)).collect();
            if values.iter().all(|v| *v == 0) {
                continue;
            }
            fams.push((
                name,
                "Controller-facing endpoint authentication outcomes.",
                MetricType::Counter,
                Box::new(move |e| {
                    // Label values in name order: error, forbidden, ok, unauth.
                    let mut rows: Vec<(&str, u64)> = AUTH_RESULTS
                        .iter()
                        .copied()
                        .zip(values.iter().copied())
                        .filter(|(_, v)| *v > 0)
                        .collect();
                    rows.sort();
                    for (r, v) in rows {
                        counter(e, &[("result", r)], v)?;
                    }
                    Ok(())
                }),
            ));
        }

        // Operator families (not part of the reference contract).
        let tokenizing = crate::tokenizer::global().in_flight() as i64;
        fams.push((
            "inferencecache_tokenizer_in_flight",
            "prompt_text tokenizations admitted and not yet finished (at most 64; more fail open).",
            MetricType::Gauge,
            Box::new(move |e| gauge(e, &[], tokenizing)),
        ));
        if t.ingest_entries > 0 {
            fams.push((
                "inferencecache_ingest_entries",
                "Prefix entries carried by applied ReportCacheState messages.",
                MetricType::Counter,
                Box::new(|e| counter(e, &[], t.ingest_entries)),
            ));
        }
        if !self.cores.is_empty() {
            fams.push((
                "inferencecache_core_requests",
                "Requests per receiving core, answered inline or hopped to the owner core.",
                MetricType::Counter,
                Box::new(|e| {
                    for c in &self.cores {
                        let id = &c.core.to_string();
                        counter(e, &[("core", id), ("path", "hopped")], c.metrics.hopped)?;
                        counter(e, &[("core", id), ("path", "inline")], c.metrics.inline)?;
                    }
                    Ok(())
                }),
            ));
            fams.push((
                "inferencecache_core_hopped_ops",
                "Operations a core executed on behalf of other threads (hop arrivals).",
                MetricType::Counter,
                Box::new(|e| {
                    for c in &self.cores {
                        let id = &c.core.to_string();
                        counter(e, &[("core", id)], c.hopped_in)?;
                    }
                    Ok(())
                }),
            ));
            fams.push((
                "inferencecache_core_mailbox_depth",
                "Operations queued to a core, summed over senders.",
                MetricType::Gauge,
                Box::new(|e| {
                    for c in &self.cores {
                        let id = &c.core.to_string();
                        gauge(e, &[("core", id)], c.mailbox_depth)?;
                    }
                    Ok(())
                }),
            ));
            fams.push((
                "inferencecache_core_index_entries",
                "Storage entries held by a core's index partitions.",
                MetricType::Gauge,
                Box::new(|e| {
                    for c in &self.cores {
                        let id = &c.core.to_string();
                        gauge(e, &[("core", id)], c.metrics.core_entries)?;
                    }
                    Ok(())
                }),
            ));
            fams.push((
                "inferencecache_core_index_bytes",
                "Approximate heap bytes of a core's index partitions.",
                MetricType::Gauge,
                Box::new(|e| {
                    for c in &self.cores {
                        let id = &c.core.to_string();
                        gauge(e, &[("core", id)], c.metrics.core_bytes)?;
                    }
                    Ok(())
                }),
            ));
        }
        if let Some(p) = &self.process {
            process::families(p, &mut fams);
        }

        fams.sort_by(|a, b| a.0.cmp(b.0));
        for (name, help, ty, write) in fams {
            let mut me = encoder.encode_descriptor(name, help, None, ty)?;
            write(&mut me)?;
        }
        Ok(())
    }
}

/// Standard `process_*` series read from `/proc/self` (cheap; not part of the contract).
pub mod process {
    use super::{Family, MetricType, counter, gauge};

    /// One reading of the process's resource usage.
    #[derive(Clone, Debug, Default)]
    pub struct ProcessStats {
        /// User + system CPU seconds.
        pub cpu_seconds: f64,
        /// Resident set size in bytes.
        pub resident_bytes: u64,
        /// Virtual memory size in bytes.
        pub virtual_bytes: u64,
        /// Open file descriptors.
        pub open_fds: u64,
        /// Soft limit on open file descriptors.
        pub max_fds: u64,
        /// Start time, seconds since the Unix epoch.
        pub start_time_seconds: f64,
    }

    /// Reads `/proc/self/stat`, `/proc/self/fd` and `/proc/stat`; `None` off Linux.
    pub fn read() -> Option<ProcessStats> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // Fields after the parenthesised command name (which may contain spaces).
        let rest = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        // SAFETY: sysconf has no preconditions.
        let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
        // rest[0] is field 3 (state): utime = 14, stime = 15, starttime = 22, vsize = 23, rss = 24.
        let num = |i: usize| {
            f.get(i - 3)
                .and_then(|s| s.parse::<u64>().ok())
                .unwrap_or(0)
        };
        let btime = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("btime ").map(|v| v.trim().parse::<u64>()))
            })
            .and_then(|r| r.ok())
            .unwrap_or(0);
        let open_fds = std::fs::read_dir("/proc/self/fd")
            .map(|d| d.count() as u64)
            .unwrap_or(0);
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes into the struct owned by this frame.
        let max_fds = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
            lim.rlim_cur
        } else {
            0
        };
        Some(ProcessStats {
            cpu_seconds: (num(14) + num(15)) as f64 / tck,
            resident_bytes: num(24) * page,
            virtual_bytes: num(23),
            open_fds,
            max_fds,
            start_time_seconds: btime as f64 + num(22) as f64 / tck,
        })
    }

    pub(super) fn families<'a>(p: &'a ProcessStats, fams: &mut Vec<Family<'a>>) {
        fams.push((
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds.",
            MetricType::Counter,
            Box::new(|e| counter(e, &[], p.cpu_seconds)),
        ));
        fams.push((
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            MetricType::Gauge,
            Box::new(|e| gauge(e, &[], p.resident_bytes)),
        ));
        fams.push((
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            MetricType::Gauge,
            Box::new(|e| gauge(e, &[], p.virtual_bytes)),
        ));
        fams.push((
            "process_open_fds",
            "Number of open file descriptors.",
            MetricType::Gauge,
            Box::new(|e| gauge(e, &[], p.open_fds)),
        ));
        fams.push((
            "process_max_fds",
            "Maximum number of open file descriptors.",
            MetricType::Gauge,
            Box::new(|e| gauge(e, &[], p.max_fds)),
        ));
        fams.push((
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            MetricType::Gauge,
            Box::new(|e| gauge(e, &[], p.start_time_seconds)),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render_local(m: CoreMetrics) -> String {
        let scrape = Scrape {
            total: m,
            cores: Vec::new(),
            process: None,
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
}
