//! Latency and outcome recording shared by every request task.
//!
//! Latencies go into HDR histograms (microsecond resolution, 3 significant digits) so tail
//! percentiles stay exact to 0.1 % at any sample count. The caller decides what a latency is
//! measured from: the open-loop driver passes the *intended* send time of the schedule, which
//! makes the numbers coordinated-omission-correct (a stall is charged to every request that
//! should have been sent during it, not just to the one that hit it).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use hdrhistogram::Histogram;

use crate::slowlog::SlowLog;
use tokio::time::Instant;

/// Highest latency tracked exactly (10 min); larger values are clamped, never dropped.
const MAX_TRACKABLE_US: u64 = 600_000_000;

/// The RPCs whose latencies are reported. A fixed set keeps the report shape stable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Rpc {
    /// Gateway lookups (the hot path; the only RPC with reason codes and budgets).
    LookupRoute,
    /// Producer eviction events.
    PublishEvent,
    /// Producer stream close → Ack (one sample per long-lived stream).
    ReportCacheState,
}

impl Rpc {
    /// Every RPC in report order.
    pub const ALL: [Rpc; 3] = [Rpc::LookupRoute, Rpc::PublishEvent, Rpc::ReportCacheState];

    /// gRPC method name, used as the report key.
    pub fn name(self) -> &'static str {
        match self {
            Rpc::LookupRoute => "LookupRoute",
            Rpc::PublishEvent => "PublishEvent",
            Rpc::ReportCacheState => "ReportCacheState",
        }
    }
}

/// Canonical upper-snake gRPC status name (as grpc-go and the status spec print it), so error
/// keys are stable across client libraries.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// A fresh latency histogram in microseconds.
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_TRACKABLE_US, 3).expect("static histogram bounds are valid")
}

/// Microseconds of `d`, at least 1 (the histogram's lowest value) and clamped at the top.
pub fn to_us(d: Duration) -> u64 {
    (d.as_micros() as u64).clamp(1, MAX_TRACKABLE_US)
}

/// Per-RPC accumulated results.
#[derive(Clone, Debug)]
pub struct RpcStats {
    /// Latencies of successful calls.
    pub hist: Histogram<u64>,
    /// Failed calls by gRPC status name.
    pub errors: BTreeMap<String, u64>,
}

impl Default for RpcStats {
    fn default() -> Self {
        RpcStats {
            hist: new_histogram(),
            errors: BTreeMap::new(),
        }
    }
}

impl RpcStats {
    /// Successful calls.
    pub fn ok(&self) -> u64 {
        self.hist.len()
    }

    /// Failed calls.
    pub fn failed(&self) -> u64 {
        self.errors.values().sum()
    }
}

/// LookupRoute-specific outcome counters.
#[derive(Clone, Debug, Default)]
pub struct LookupStats {
    /// Responses by `reason_code`.
    pub reasons: BTreeMap<String, u64>,
    /// Successful lookups slower than each configured budget (same order as the budgets).
    pub over_budget: Vec<u64>,
    /// Responses carrying at least one replica score.
    pub with_scores: u64,
    /// Sum of the top replica's `matched_tokens` over responses with scores.
    pub matched_tokens_sum: u64,
    /// Sum of the prompt's full-block tokens over all successful lookups (denominator of the
    /// token hit ratio).
    pub prompt_tokens_sum: u64,
}

/// Everything recorded during one measurement window.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// Per-RPC latencies and errors, indexed like [`Rpc::ALL`].
    pub rpcs: Vec<RpcStats>,
    /// Lookup outcomes.
    pub lookup: LookupStats,
    /// Budgets (µs) the `over_budget` counters refer to.
    pub budgets_us: Vec<u64>,
    /// How late the open-loop dispatcher actually sent requests versus their intended time;
    /// large values mean loadgen itself (or the in-flight cap) was the bottleneck.
    pub send_lag: Histogram<u64>,
}

/// Thread-safe recorder; one per measurement window. A single short critical section per
/// sample: cheap enough at tens of thousands of samples per second on two cores.
pub struct Recorder {
    inner: Mutex<Snapshot>,
    /// Lookup latencies since the last progress tick (for the live line).
    interval: Mutex<Histogram<u64>>,
    /// Slow lookups with their wall-clock times (`--slow-log`).
    slow: Option<SlowLog>,
}

/// The outcome of one lookup, as far as the recorder cares.
#[derive(Clone, Debug)]
pub struct LookupOutcome<'a> {
    /// `reason_code` of the response.
    pub reason: &'a str,
    /// Number of replica scores.
    pub scores: usize,
    /// `matched_tokens` of the first score (0 without scores).
    pub top_matched_tokens: i32,
    /// Full-block tokens in the request.
    pub prompt_tokens: u64,
}

impl Recorder {
    /// A recorder counting lookups over each of `budgets` as well.
    pub fn new(budgets: &[Duration]) -> Self {
        let budgets_us: Vec<u64> = budgets.iter().map(|b| b.as_micros() as u64).collect();
        Recorder {
            inner: Mutex::new(Snapshot {
                rpcs: Rpc::ALL.iter().map(|_| RpcStats::default()).collect(),
                lookup: LookupStats {
                    over_budget: vec![0; budgets_us.len()],
                    ..Default::default()
                },
                budgets_us,
                send_lag: new_histogram(),
            }),
            interval: Mutex::new(new_histogram()),
            slow: None,
        }
    }

    /// This recorder, also keeping lookups slower than `log`'s threshold.
    pub fn with_slow_log(mut self, log: SlowLog) -> Self {
        self.slow = Some(log);
        self
    }

    /// The slow lookups kept, if asked for.
    pub fn slow_log(&self) -> Option<&SlowLog> {
        self.slow.as_ref()
    }

    /// Notes a lookup due at `from`, begun at `started`, that ends now in the slow log (if
    /// any); for failures, whose latency is not otherwise recorded.
    pub fn note_failed_lookup(&self, from: Instant, started: Instant) {
        if let Some(log) = &self.slow {
            log.note(from.into_std(), started.into_std(), from.elapsed(), true);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Snapshot> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a successful call of `rpc` that started (or was due) at `from` and ended now.
    pub fn record_ok(&self, rpc: Rpc, from: Instant) -> Duration {
        let lat = from.elapsed();
        self.record_ok_latency(rpc, lat);
        lat
    }

    /// [`Recorder::record_ok`] for a lookup due at `from` and begun at `started`, which also
    /// goes to the slow log (if any).
    pub fn record_lookup_ok(&self, from: Instant, started: Instant) -> Duration {
        let lat = self.record_ok(Rpc::LookupRoute, from);
        if let Some(log) = &self.slow {
            log.note(from.into_std(), started.into_std(), lat, false);
        }
        lat
    }

    /// Records a successful call with a known latency.
    pub fn record_ok_latency(&self, rpc: Rpc, lat: Duration) {
        let us = to_us(lat);
        let mut s = self.lock();
        s.rpcs[rpc as usize].hist.saturating_record(us);
        if rpc == Rpc::LookupRoute {
            let exact_us = lat.as_micros() as u64;
            let Snapshot {
                lookup, budgets_us, ..
            } = &mut *s;
            for (i, b) in budgets_us.iter().enumerate() {
                if exact_us > *b {
                    lookup.over_budget[i] += 1;
                }
            }
            drop(s);
            self.interval
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .saturating_record(us);
        }
    }

    /// Records a lookup response's content (reason code, scores).
    pub fn record_lookup(&self, o: LookupOutcome<'_>) {
        let mut s = self.lock();
        let l = &mut s.lookup;
        match l.reasons.get_mut(o.reason) {
            Some(n) => *n += 1,
            None => {
                l.reasons.insert(o.reason.to_string(), 1);
            }
        }
        l.prompt_tokens_sum += o.prompt_tokens;
        if o.scores > 0 {
            l.with_scores += 1;
            l.matched_tokens_sum += o.top_matched_tokens.max(0) as u64;
        }
    }

    /// Records a failed call by status code.
    pub fn record_error(&self, rpc: Rpc, code: tonic::Code) {
        let mut s = self.lock();
        *s.rpcs[rpc as usize]
            .errors
            .entry(code_name(code).to_string())
            .or_default() += 1;
    }

    /// Records how late a request left versus its intended send time.
    pub fn record_send_lag(&self, lag: Duration) {
        self.lock().send_lag.saturating_record(to_us(lag));
    }

    /// Takes and resets the lookup latencies of the current progress interval.
    pub fn take_interval(&self) -> Histogram<u64> {
        let mut h = self.interval.lock().unwrap_or_else(|e| e.into_inner());
        let out = h.clone();
        h.reset();
        out
    }

    /// Calls completed so far for `rpc` as (ok, failed).
    pub fn counts(&self, rpc: Rpc) -> (u64, u64) {
        let s = self.lock();
        let r = &s.rpcs[rpc as usize];
        (r.ok(), r.failed())
    }

    /// Count of lookups answered with `reason`.
    pub fn reason_count(&self, reason: &str) -> u64 {
        self.lock().lookup.reasons.get(reason).copied().unwrap_or(0)
    }

    /// A copy of everything recorded.
    pub fn snapshot(&self) -> Snapshot {
        self.lock().clone()
    }
}

/// Quantile of `h` in milliseconds (0 for an empty histogram).
pub fn quantile_ms(h: &Histogram<u64>, q: f64) -> f64 {
    if h.is_empty() {
        0.0
    } else {
        h.value_at_quantile(q) as f64 / 1000.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_count_strictly_slower_lookups() {
        let r = Recorder::new(&[Duration::from_millis(1), Duration::from_millis(5)]);
        for ms in [0.5, 1.0, 2.0, 6.0] {
            r.record_ok_latency(Rpc::LookupRoute, Duration::from_secs_f64(ms / 1000.0));
        }
        r.record_ok_latency(Rpc::PublishEvent, Duration::from_secs(1));
        let s = r.snapshot();
        assert_eq!(s.lookup.over_budget, vec![2, 1]);
        assert_eq!(s.rpcs[Rpc::LookupRoute as usize].ok(), 4);
        assert_eq!(s.rpcs[Rpc::PublishEvent as usize].ok(), 1);
    }

    #[test]
    fn errors_are_keyed_by_canonical_code() {
        let r = Recorder::new(&[]);
        r.record_error(Rpc::LookupRoute, tonic::Code::Unavailable);
        r.record_error(Rpc::LookupRoute, tonic::Code::Unavailable);
        r.record_error(Rpc::LookupRoute, tonic::Code::DeadlineExceeded);
        let s = r.snapshot();
        let e = &s.rpcs[0].errors;
        assert_eq!(e["UNAVAILABLE"], 2);
        assert_eq!(e["DEADLINE_EXCEEDED"], 1);
        assert_eq!(s.rpcs[0].failed(), 3);
    }
}
