//! Renders one scrape in the Prometheus text format 0.0.4 with prometheus-client: families
//! sorted by name, label pairs in name order, a counter family with no series omitted, histograms
//! with cumulative buckets. The caller gathers the cores' copies (see `admin::scrape`); this
//! module only encodes, so a scrape never holds anything the request path needs.

use std::sync::atomic::Ordering;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use super::process::ProcessStats;
use super::{
    AUTH, AUTH_FAMILIES, AUTH_RESULTS, CoreMetrics, GRPC_TLS, Histogram, LATENCY_BUCKETS,
    Maintenance, OVERFLOW_LABEL, SERVER_UP,
};
use crate::limits::MAX_LABEL_VALUES;

/// `Content-Type` of the exposition (Prometheus text 0.0.4, as Go's promhttp serves by default).
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// One core's operator data at scrape time.
#[derive(Clone, Debug, Default)]
pub struct CoreView {
    /// Core id.
    pub core: usize,
    /// The core's recorded series (with its entry and byte counts filled in).
    pub metrics: CoreMetrics,
    /// Operations queued to the core.
    pub mailbox_depth: u64,
    /// Operations the core executed for other threads.
    pub hopped_in: u64,
}

/// Everything one scrape renders.
#[derive(Debug, Default)]
pub struct Scrape {
    /// Every core's series (and the off-core fallback) merged.
    pub total: CoreMetrics,
    /// Per-core views for the `inferencecache_core_*` families.
    pub cores: Vec<CoreView>,
    /// `process_*` readings, when available.
    pub process: Option<ProcessStats>,
    /// Tokenizations admitted and not finished.
    pub tokenizer_in_flight: i64,
}

/// Renders `scrape` as exposition text.
pub fn encode(scrape: Scrape) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(scrape));
    let mut out = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)
        .expect("writing to a String cannot fail");
    out
}

/// One family to emit: name (without the `_total` a counter gets), help, type, series writer.
pub(super) type Family<'a> = (
    &'static str,
    &'static str,
    MetricType,
    Box<dyn Fn(&mut MetricEncoder) -> Result<(), std::fmt::Error> + 'a>,
);

pub(super) fn counter<V: prometheus_client::encoding::EncodeCounterValue>(
    enc: &mut MetricEncoder,
    labels: &[(&str, &str)],
    v: V,
) -> std::fmt::Result {
    ConstCounter::new(v).encode(enc.encode_family(&labels)?)
}

pub(super) fn gauge<V: prometheus_client::encoding::EncodeGaugeValue + Copy>(
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
        let mut fams: Vec<Family> = Vec::new();
        server_families(&mut fams);
        index_families(&self.total, &mut fams);
        lookup_families(&self.total, &mut fams);
        eviction_families(&self.total, &mut fams);
        auth_families(&mut fams);
        super::nats::families(&mut fams);
        super::producer::families(&mut fams);
        operator_families(self, &mut fams);
        core_families(&self.cores, &mut fams);
        super::snapshot::families(&mut fams);
        if let Some(p) = &self.process {
            super::process::families(p, &mut fams);
        }
        fams.sort_by(|a, b| a.0.cmp(b.0));
        for (name, help, ty, write) in fams {
            let mut me = encoder.encode_descriptor(name, help, None, ty)?;
            write(&mut me)?;
        }
        Ok(())
    }
}

fn server_families(fams: &mut Vec<Family>) {
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
}

fn index_families<'a>(t: &'a CoreMetrics, fams: &mut Vec<Family<'a>>) {
    if t.index_entries.is_empty() {
        return;
    }
    fams.push((
        "inferencecache_index_entries",
        "Distinct prefix keys in the index, per model (all tenants).",
        MetricType::Gauge,
        Box::new(|e| {
            for (model, n) in fold_overflow(&t.index_entries) {
                gauge(e, &[("model", model)], n)?;
            }
            Ok(())
        }),
    ));
}

/// Rows of a gauge map in name order, the values past the label bound (or too long) summed into
/// one [`OVERFLOW_LABEL`] row. The index bounds the map itself; this bounds the scrape.
fn fold_overflow(map: &super::FastMap<String, i64>) -> Vec<(&str, i64)> {
    let mut rows: Vec<(&str, i64)> = map.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    rows.sort();
    let mut kept = Vec::with_capacity(rows.len().min(MAX_LABEL_VALUES + 1));
    let mut overflow = None;
    for (name, n) in rows {
        if name != OVERFLOW_LABEL && super::own_series(kept.len(), name) {
            kept.push((name, n));
        } else {
            *overflow.get_or_insert(0) += n;
        }
    }
    if let Some(n) = overflow {
        kept.push((OVERFLOW_LABEL, n));
        kept.sort();
    }
    kept
}

fn lookup_families<'a>(t: &'a CoreMetrics, fams: &mut Vec<Family<'a>>) {
    if t.lookups.is_empty() {
        return;
    }
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
                let labels = [("hint_used", h), ("model", model), ("reason_code", r)];
                counter(e, &labels, n)?;
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

fn eviction_families<'a>(t: &'a CoreMetrics, fams: &mut Vec<Family<'a>>) {
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
}

fn auth_families(fams: &mut Vec<Family>) {
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
}

/// Families this server adds to the reference's set; a counter family with nothing counted yet
/// is left out.
fn operator_families<'a>(scrape: &'a Scrape, fams: &mut Vec<Family<'a>>) {
    let tokenizing = scrape.tokenizer_in_flight;
    fams.push((
        "inferencecache_tokenizer_in_flight",
        "prompt_text tokenizations admitted and not yet finished (at most 64; more fail open).",
        MetricType::Gauge,
        Box::new(move |e| gauge(e, &[], tokenizing)),
    ));
    let t = &scrape.total;
    for (name, help, label, rows) in labelled_counters(t) {
        if !rows.is_empty() {
            let write = move |e: &mut MetricEncoder| {
                for (value, n) in rows {
                    counter(e, &[(label, value)], *n)?;
                }
                Ok(())
            };
            fams.push((name, help, MetricType::Counter, Box::new(write)));
        }
    }
    if !t.rpc_calls.is_empty() {
        fams.push(rpc_calls(&t.rpc_calls));
    }
    for (name, help, outcomes) in outcome_counters(t) {
        if outcomes.iter().any(|(_, n)| *n > 0) {
            let write = move |e: &mut MetricEncoder| {
                for (outcome, n) in &outcomes {
                    counter(e, &[("outcome", outcome)], *n)?;
                }
                Ok(())
            };
            fams.push((name, help, MetricType::Counter, Box::new(write)));
        }
    }
    for (name, help, n) in plain_counters(t) {
        if n > 0 {
            fams.push((
                name,
                help,
                MetricType::Counter,
                Box::new(move |e| counter(e, &[], n)),
            ));
        }
    }
}

/// Counter families with one label, from a map of fixed label values: name, help, label name,
/// rows.
type LabelledCounter<'a> = (
    &'static str,
    &'static str,
    &'static str,
    &'a std::collections::BTreeMap<&'static str, u64>,
);

fn labelled_counters(t: &CoreMetrics) -> [LabelledCounter<'_>; 4] {
    [
        (
            "inferencecache_metrics_label_overflow",
            "Observations recorded under the __overflow__ label value because a family reached its bound on distinct (or its limit on long) label values.",
            "family",
            &t.label_overflows,
        ),
        (
            "inferencecache_ingest_refused",
            "ReportCacheState messages not applied, or not in full (the stream's Ack says accepted=false).",
            "reason",
            &t.ingest_refused,
        ),
        (
            "inferencecache_limit_hits",
            "Requests, registrations or subscribers turned away or cut short by a named limit.",
            "limit",
            &t.limit_hits,
        ),
        (
            "inferencecache_grpc_messages_refused",
            "Incomplete gRPC request messages given up: the connection's or core's budget of held bytes was spent, or the message took too long.",
            "reason",
            &t.grpc_messages_refused,
        ),
    ]
}

/// `inferencecache_rpc_calls`, labelled by RPC and reason code.
fn rpc_calls<'a>(
    rows: &'a std::collections::BTreeMap<(&'static str, &'static str), u64>,
) -> Family<'a> {
    let write = move |e: &mut MetricEncoder| {
        for ((rpc, reason), n) in rows {
            counter(e, &[("reason_code", reason), ("rpc", rpc)], *n)?;
        }
        Ok(())
    };
    (
        "inferencecache_rpc_calls",
        "Calls of RenderTemplate, LookupPDRoute, StreamCacheEvents and StreamMetrics by reason code.",
        MetricType::Counter,
        Box::new(write),
    )
}

/// A counter family of a few outcomes: name, help, each outcome's label value and count.
type OutcomeCounter = (&'static str, &'static str, Vec<(&'static str, u64)>);

fn outcome_counters(t: &CoreMetrics) -> [OutcomeCounter; 2] {
    [
        (
            "inferencecache_grpc_inline_lookups",
            "Plain LookupRoutes taken by the gRPC front end's inline path: answered in the connection's turn, decided there and awaited (owner core or tokenizer), or handed on to the general path.",
            vec![
                ("answered", t.inline_lookups_answered),
                ("awaited", t.inline_lookups_awaited),
                ("handed_on", t.inline_lookups_handed_on),
            ],
        ),
        (
            "inferencecache_spin_watch_connections",
            "Quiet connections a spinning core watched instead of polling them through io_uring: woken when their bytes arrived, or released to io_uring when the core stopped spinning.",
            vec![
                ("woken", t.spin_watch_woken),
                ("released", t.spin_watch_released),
            ],
        ),
    ]
}

/// Unlabelled counter families: name, help, count.
fn plain_counters(t: &CoreMetrics) -> [(&'static str, &'static str, u64); 3] {
    [
        (
            "inferencecache_ingest_timestamps_clamped",
            "Producer timestamps later than the server clock plus the allowed skew, clamped to it.",
            t.timestamps_clamped,
        ),
        (
            "inferencecache_ingest_entries",
            "Prefix entries carried by applied ReportCacheState messages.",
            t.ingest_entries,
        ),
        (
            "inferencecache_http2_hpack_evicted_bytes",
            "Bytes of HPACK dynamic-table entries evicted to make room for a peer's new ones (or by its table size updates) on the gRPC port: the tables' churn (RFC 7541 entry sizes).",
            t.hpack_evicted_bytes,
        ),
    ]
}

/// A per-core family: one series per core, labelled `core`, valued by `value`.
fn per_core<'a>(
    cores: &'a [CoreView],
    name: &'static str,
    help: &'static str,
    ty: MetricType,
    value: fn(&CoreView) -> i64,
) -> Family<'a> {
    let write = move |e: &mut MetricEncoder| {
        for c in cores {
            let id = c.core.to_string();
            match ty {
                MetricType::Counter => counter(e, &[("core", &id)], value(c) as u64)?,
                _ => gauge(e, &[("core", &id)], value(c))?,
            }
        }
        Ok(())
    };
    (name, help, ty, Box::new(write))
}

fn core_families<'a>(cores: &'a [CoreView], fams: &mut Vec<Family<'a>>) {
    if cores.is_empty() {
        return;
    }
    fams.push(core_requests(cores));
    for (name, help, ty, value) in PER_CORE {
        fams.push(per_core(cores, name, help, ty, value));
    }
    for (name, help, value) in PER_CORE_SECONDS {
        fams.push(per_core_seconds(cores, name, help, value));
    }
    for (name, help, value) in PER_CORE_MAINTENANCE {
        fams.push(per_core_maintenance(cores, name, help, value));
    }
}

/// `inferencecache_core_requests`, labelled by core and path.
fn core_requests(cores: &[CoreView]) -> Family<'_> {
    let write = move |e: &mut MetricEncoder| {
        for c in cores {
            let id = &c.core.to_string();
            counter(e, &[("core", id), ("path", "hopped")], c.metrics.hopped)?;
            counter(e, &[("core", id), ("path", "inline")], c.metrics.local)?;
        }
        Ok(())
    };
    (
        "inferencecache_core_requests",
        "Requests per receiving core, answered there (path=\"inline\") or hopped to the owner core.",
        MetricType::Counter,
        Box::new(write),
    )
}

/// A per-core family of one whole number per core: name, help, type, value.
type PerCore = (&'static str, &'static str, MetricType, fn(&CoreView) -> i64);

/// The per-core families of one whole number per core.
const PER_CORE: [PerCore; 23] = [
    (
        "inferencecache_core_hopped_ops",
        "Operations a core executed on behalf of other threads (hop arrivals).",
        MetricType::Counter,
        |c| c.hopped_in as i64,
    ),
    (
        "inferencecache_core_mailbox_depth",
        "Operations queued to a core, summed over senders.",
        MetricType::Gauge,
        |c| c.mailbox_depth as i64,
    ),
    (
        "inferencecache_core_index_entries",
        "Storage entries held by a core's index partitions.",
        MetricType::Gauge,
        |c| c.metrics.core_entries,
    ),
    (
        "inferencecache_core_index_bytes",
        "Approximate heap bytes of a core's index partitions.",
        MetricType::Gauge,
        |c| c.metrics.core_bytes,
    ),
    (
        "inferencecache_core_index_strings",
        "Names (tenant, model, replica, scheme, adapter) a core's index holds.",
        MetricType::Gauge,
        |c| c.metrics.core_strings,
    ),
    (
        "inferencecache_core_index_string_bytes",
        "Bytes of the names a core's index holds.",
        MetricType::Gauge,
        |c| c.metrics.core_string_bytes,
    ),
    (
        "inferencecache_core_sweeps",
        "TTL sweep passes a core completed.",
        MetricType::Counter,
        |c| c.metrics.sweeps as i64,
    ),
    (
        "inferencecache_core_sweep_slices",
        "TTL sweep slices a core ran (the core serves queued requests between two).",
        MetricType::Counter,
        |c| c.metrics.sweep_slices as i64,
    ),
    (
        "inferencecache_core_cap_builds",
        "Global-cap candidate heaps a core built ahead of need, in slices.",
        MetricType::Counter,
        |c| c.metrics.cap_builds as i64,
    ),
    (
        "inferencecache_core_cap_build_slices",
        "Slices of a core's cap candidate builds ahead of need (the core serves queued requests between two).",
        MetricType::Counter,
        |c| c.metrics.cap_build_slices as i64,
    ),
    (
        "inferencecache_core_cap_builds_sync",
        "Cap candidate builds a core ran or finished in one go on an ingest that needed victims first (the fallback).",
        MetricType::Counter,
        |c| c.metrics.cap_builds_sync as i64,
    ),
    (
        "inferencecache_core_cap_slices_on_demand",
        "Cap build slices a core ran for an ingest or a cross-core candidate request whose victims were not ready, before serving it (instead of one O(entries) build on it).",
        MetricType::Counter,
        |c| c.metrics.cap_slices_on_demand as i64,
    ),
    (
        "inferencecache_core_quota_builds_sync",
        "Tenant quota candidate heaps a core built or finished in one go on an ingest or cross-core candidate request that needed victims first (the fallback).",
        MetricType::Counter,
        |c| c.metrics.quota_builds_sync as i64,
    ),
    (
        "inferencecache_core_quota_slices_on_demand",
        "Quota heap build slices a core ran for an ingest or a cross-core candidate request whose tenant quota victims were not ready, before serving it (instead of one O(keys) scan on it).",
        MetricType::Counter,
        |c| c.metrics.quota_slices_on_demand as i64,
    ),
    (
        "inferencecache_core_cap_enforce_slices",
        "Steps of at most CAP_ENFORCE_SLICE_MAX_EVICTIONS global-cap evictions a core ran after an ingest's own (one core) or per cross-core round (several).",
        MetricType::Counter,
        |c| c.metrics.cap_enforce_slices as i64,
    ),
    (
        "inferencecache_core_cap_candidate_retries",
        "Cross-core cap rounds a core's ingest asked again because a core's candidate heap ran out of live snapshots (it readied more in slices instead of building them in one go).",
        MetricType::Counter,
        |c| c.metrics.cap_candidate_retries as i64,
    ),
    (
        "inferencecache_core_ingest_parts",
        "Parts of large ReportCacheState messages a core applied one step each (about INGEST_PART_BLOCKS blocks per part), serving requests between two.",
        MetricType::Counter,
        |c| c.metrics.ingest_parts as i64,
    ),
    (
        "inferencecache_core_admission_steps",
        "Steps a core spent checking that a ReportCacheState message's new names and keyspaces fit, when it had to look its adapters up one by one (at most ADMISSION_STEP_PREFIXES per step, a piece of its own), applying nothing in them.",
        MetricType::Counter,
        |c| c.metrics.admission_steps as i64,
    ),
    (
        "inferencecache_core_lane_waits",
        "Maintenance pieces (sweep, cap and ingest slices) a core held for a later reactor turn because one already ran in theirs (at most one per turn).",
        MetricType::Counter,
        |c| c.metrics.lane_waits as i64,
    ),
    (
        "inferencecache_core_lane_hop_overruns",
        "Maintenance pieces a core ran for another core (over the hop, which must not wait) in a reactor turn that had already run one.",
        MetricType::Counter,
        |c| c.metrics.lane_hop_overruns as i64,
    ),
    (
        "inferencecache_core_offcore_decodes",
        "ReportCacheState and PublishEvent messages over OFFCORE_DECODE_MIN_BYTES a core had decoded on the decode pool instead of in one poll of its own.",
        MetricType::Counter,
        |c| c.metrics.offcore_decodes as i64,
    ),
    (
        "inferencecache_core_clear_slices",
        "Slices of ALL_CLEARED removals a core ran (the core serves queued requests between two).",
        MetricType::Counter,
        |c| c.metrics.clear_slices as i64,
    ),
    (
        "inferencecache_core_clears_sync",
        "ALL_CLEARED removals a core finished in one go because an operation needed its store before their slices had (the fallback).",
        MetricType::Counter,
        |c| c.metrics.clears_sync as i64,
    ),
];

/// A per-core gauge in seconds: name, help, value.
type PerCoreSeconds = (&'static str, &'static str, fn(&CoreView) -> f64);

/// The per-core gauges in seconds.
const PER_CORE_SECONDS: [PerCoreSeconds; 7] = [
    (
        "inferencecache_core_heartbeat_max_lag_seconds",
        "Most a core's heartbeat tick came late since start: the longest the core's task queue did not get to a due timer (a maintenance step, a request or the OS).",
        |c| c.metrics.heartbeat_max_lag,
    ),
    (
        "inferencecache_core_sweep_last_duration_seconds",
        "Wall time of a core's last completed TTL sweep pass, first slice to last.",
        |c| c.metrics.sweep_last_duration,
    ),
    (
        "inferencecache_core_sweep_last_started_seconds",
        "When a core's last completed TTL sweep pass started, seconds since the Unix epoch.",
        |c| c.metrics.sweep_last_started,
    ),
    (
        "inferencecache_core_sweep_last_max_slice_seconds",
        "Longest slice of a core's last completed TTL sweep pass.",
        |c| c.metrics.sweep_last_max_slice,
    ),
    (
        "inferencecache_core_sweep_last_max_slice_cpu_seconds",
        "Most thread CPU time one slice of a core's last completed TTL sweep pass took.",
        |c| c.metrics.sweep_last_max_slice_cpu,
    ),
    (
        "inferencecache_core_cap_build_last_max_slice_seconds",
        "Longest slice of a core's last cap candidate build ahead of need.",
        |c| c.metrics.cap_build_last_max_slice,
    ),
    (
        "inferencecache_core_cap_build_last_max_slice_cpu_seconds",
        "Most thread CPU time one slice of a core's last cap candidate build ahead of need took.",
        |c| c.metrics.cap_build_last_max_slice_cpu,
    ),
];

/// The per-core maintenance histograms: name, help, the measure.
type MaintenanceMeasure = fn(&CoreView) -> &[Histogram; Maintenance::KINDS];
const PER_CORE_MAINTENANCE: [(&str, &str, MaintenanceMeasure); 2] = [
    (
        "inferencecache_core_maintenance_slice_seconds",
        "Wall time of each index maintenance slice (TTL sweep, cap candidate build): the longest a request queued on the core waited behind one.",
        |c| &c.metrics.maintenance_slice,
    ),
    (
        "inferencecache_core_maintenance_slice_cpu_seconds",
        "Thread CPU time of each index maintenance slice; wall minus CPU is the OS running something else.",
        |c| &c.metrics.maintenance_slice_cpu,
    ),
];

/// A per-core histogram family of one [`Maintenance`] measure, labelled `core` and `work`.
fn per_core_maintenance<'a>(
    cores: &'a [CoreView],
    name: &'static str,
    help: &'static str,
    value: fn(&CoreView) -> &[Histogram; Maintenance::KINDS],
) -> Family<'a> {
    let write = move |e: &mut MetricEncoder| {
        for c in cores {
            let id = c.core.to_string();
            for kind in Maintenance::ALL {
                let labels = [("core", id.as_str()), ("work", kind.label())];
                histogram(e, &labels, &value(c)[kind as usize])?;
            }
        }
        Ok(())
    };
    (name, help, MetricType::Histogram, Box::new(write))
}

/// A per-core gauge in seconds: one series per core, labelled `core`.
fn per_core_seconds<'a>(
    cores: &'a [CoreView],
    name: &'static str,
    help: &'static str,
    value: fn(&CoreView) -> f64,
) -> Family<'a> {
    let write = move |e: &mut MetricEncoder| {
        for c in cores {
            gauge(e, &[("core", &c.core.to_string())], value(c))?;
        }
        Ok(())
    };
    (name, help, MetricType::Gauge, Box::new(write))
}
