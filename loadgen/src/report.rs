//! The run report: one structure rendered both as a human table and as JSON (`--json PATH`,
//! `--output json`), so CI and people read the same numbers. Field meanings are documented in
//! loadgen/README.md; the JSON shape is covered by a test.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::histogram::{Rpc, RpcStats, Snapshot, quantile_ms};
use crate::producer::{IngestStats, ProducerConfig};
use crate::workload::WorkloadConfig;

/// Latency summary and outcome counts of one RPC.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RpcReport {
    /// Calls completed (ok + failed).
    pub count: u64,
    /// Calls that returned OK.
    pub ok: u64,
    /// Calls that failed (any non-OK status, including client-side deadline).
    pub errors: u64,
    /// Failed calls by canonical gRPC status name.
    pub errors_by_code: BTreeMap<String, u64>,
    /// Latency percentiles of OK calls, milliseconds.
    pub p50_ms: f64,
    /// 90th percentile, ms.
    pub p90_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// 99.9th percentile, ms.
    pub p999_ms: f64,
    /// Largest latency, ms.
    pub max_ms: f64,
    /// Mean latency, ms.
    pub mean_ms: f64,
}

impl RpcReport {
    /// Summarises recorded stats.
    pub fn from_stats(s: &RpcStats) -> Self {
        let h = &s.hist;
        RpcReport {
            count: s.ok() + s.failed(),
            ok: s.ok(),
            errors: s.failed(),
            errors_by_code: s.errors.clone(),
            p50_ms: quantile_ms(h, 0.50),
            p90_ms: quantile_ms(h, 0.90),
            p99_ms: quantile_ms(h, 0.99),
            p999_ms: quantile_ms(h, 0.999),
            max_ms: if h.is_empty() {
                0.0
            } else {
                h.max() as f64 / 1000.0
            },
            mean_ms: if h.is_empty() { 0.0 } else { h.mean() / 1000.0 },
        }
    }
}

/// Share of successful lookups slower than one budget (mirrors a tenant's `lookupTimeoutMs`).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct BudgetReport {
    /// The budget, ms.
    pub budget_ms: f64,
    /// Successful lookups strictly slower than the budget.
    pub over: u64,
    /// `over / ok lookups` (0 when there were none).
    pub share_over: f64,
}

/// How useful the answers were.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct HitReport {
    /// Successful lookups with at least one replica score.
    pub with_scores: u64,
    /// `with_scores / ok lookups`.
    pub share_with_scores: f64,
    /// Share of OK lookups answered `PREFIX_MATCH`.
    pub prefix_match_share: f64,
    /// Mean `matched_tokens` of the top score, over lookups with scores.
    pub mean_top_matched_tokens: f64,
    /// Σ top `matched_tokens` / Σ prompt full-block tokens, over OK lookups.
    pub token_hit_ratio: f64,
}

/// Send-time lag of the open-loop dispatcher behind its schedule.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct LagReport {
    /// Median lag, ms.
    pub p50_ms: f64,
    /// 99th percentile lag, ms.
    pub p99_ms: f64,
    /// Largest lag, ms.
    pub max_ms: f64,
}

/// One run's result.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Always "loadgen".
    pub tool: &'static str,
    /// loadgen version.
    pub version: &'static str,
    /// Server address driven.
    pub target: String,
    /// `open-loop` or `closed-loop`.
    pub mode: &'static str,
    /// Open loop: requested lookups per second.
    pub target_rate: Option<f64>,
    /// Closed loop: concurrent lookups.
    pub concurrency: Option<u32>,
    /// HTTP/2 connections used.
    pub connections: u32,
    /// How lookups identified the prompt (`chain`, `tokens`, `exact`).
    pub lookup_input: String,
    /// The workload that was generated.
    pub workload: WorkloadConfig,
    /// Producer settings (absent with `--no-producers`).
    pub producer: Option<ProducerConfig>,
    /// Measurement window: first due time → last completion, seconds.
    pub elapsed_s: f64,
    /// Lookups started.
    pub lookups_started: u64,
    /// Lookups still in flight when the drain timeout gave up (not counted anywhere else).
    pub lookups_abandoned: u64,
    /// Completed lookups (ok + failed) per second of `elapsed_s`.
    pub achieved_rate: f64,
    /// Per-RPC latency and errors, keyed by method name.
    pub rpcs: BTreeMap<String, RpcReport>,
    /// LookupRoute responses by `reason_code`.
    pub reason_codes: BTreeMap<String, u64>,
    /// Errors of all RPCs by canonical gRPC status name.
    pub errors_by_code: BTreeMap<String, u64>,
    /// Share of lookups over each `--budget-ms`.
    pub budgets: Vec<BudgetReport>,
    /// Routing usefulness.
    pub hits: HitReport,
    /// Open loop only: how late requests left versus schedule.
    pub send_lag: Option<LagReport>,
    /// Producer counters during the run.
    pub ingest: Option<IngestStats>,
    /// Producer counters of the preload phase.
    pub preload: Option<IngestStats>,
}

/// Run facts the recorder does not know.
#[derive(Clone, Debug)]
pub struct RunFacts {
    /// Server address.
    pub target: String,
    /// Open-loop rate, if open loop.
    pub rate: Option<f64>,
    /// Closed-loop concurrency, if closed loop.
    pub concurrency: Option<u32>,
    /// Connections.
    pub connections: u32,
    /// Lookup input kind name.
    pub lookup_input: String,
    /// Workload.
    pub workload: WorkloadConfig,
    /// Producer config, if producers ran.
    pub producer: Option<ProducerConfig>,
    /// Window length, seconds.
    pub elapsed_s: f64,
    /// Lookups started.
    pub started: u64,
    /// Lookups abandoned at drain.
    pub abandoned: u64,
    /// Run-phase ingest counters.
    pub ingest: Option<IngestStats>,
    /// Preload ingest counters.
    pub preload: Option<IngestStats>,
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// Per-RPC reports keyed by RPC name, and failed calls of all RPCs by status code.
fn rpc_reports(snap: &Snapshot) -> (BTreeMap<String, RpcReport>, BTreeMap<String, u64>) {
    let mut rpcs = BTreeMap::new();
    let mut errors_by_code: BTreeMap<String, u64> = BTreeMap::new();
    for rpc in Rpc::ALL {
        let s = &snap.rpcs[rpc as usize];
        for (k, v) in &s.errors {
            *errors_by_code.entry(k.clone()).or_default() += v;
        }
        rpcs.insert(rpc.name().to_string(), RpcReport::from_stats(s));
    }
    (rpcs, errors_by_code)
}

/// Lookups over each `--budget-ms`, as counts and as shares of the `ok` lookups.
fn budget_reports(snap: &Snapshot, ok: u64) -> Vec<BudgetReport> {
    snap.budgets_us
        .iter()
        .zip(&snap.lookup.over_budget)
        .map(|(b, over)| BudgetReport {
            budget_ms: *b as f64 / 1000.0,
            over: *over,
            share_over: ratio(*over, ok),
        })
        .collect()
}

impl Report {
    /// Assembles the report from a recorder snapshot and run facts.
    pub fn build(snap: &Snapshot, f: RunFacts) -> Self {
        let (rpcs, errors_by_code) = rpc_reports(snap);
        let lk = &rpcs[Rpc::LookupRoute.name()];
        let ok = lk.ok;
        let done = lk.count;
        let l = &snap.lookup;
        let budgets = budget_reports(snap, ok);
        let hits = HitReport {
            with_scores: l.with_scores,
            share_with_scores: ratio(l.with_scores, ok),
            prefix_match_share: ratio(l.reasons.get("PREFIX_MATCH").copied().unwrap_or(0), ok),
            mean_top_matched_tokens: ratio(l.matched_tokens_sum, l.with_scores),
            token_hit_ratio: ratio(l.matched_tokens_sum, l.prompt_tokens_sum),
        };
        let send_lag = f.rate.map(|_| LagReport {
            p50_ms: quantile_ms(&snap.send_lag, 0.5),
            p99_ms: quantile_ms(&snap.send_lag, 0.99),
            max_ms: if snap.send_lag.is_empty() {
                0.0
            } else {
                snap.send_lag.max() as f64 / 1000.0
            },
        });
        Report {
            tool: "loadgen",
            version: env!("CARGO_PKG_VERSION"),
            target: f.target,
            mode: if f.rate.is_some() {
                "open-loop"
            } else {
                "closed-loop"
            },
            target_rate: f.rate,
            concurrency: f.concurrency,
            connections: f.connections,
            lookup_input: f.lookup_input,
            workload: f.workload,
            producer: f.producer,
            elapsed_s: f.elapsed_s,
            lookups_started: f.started,
            lookups_abandoned: f.abandoned,
            achieved_rate: if f.elapsed_s > 0.0 {
                done as f64 / f.elapsed_s
            } else {
                0.0
            },
            rpcs,
            reason_codes: l.reasons.clone(),
            errors_by_code,
            budgets,
            hits,
            send_lag,
            ingest: f.ingest,
            preload: f.preload,
        }
    }

    /// Total failed calls over all RPCs.
    pub fn total_errors(&self) -> u64 {
        self.errors_by_code.values().sum()
    }

    /// Failed lookups / completed lookups.
    pub fn lookup_error_rate(&self) -> f64 {
        let l = &self.rpcs[Rpc::LookupRoute.name()];
        ratio(l.errors, l.count)
    }

    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("report is always serializable")
    }

    /// The human-readable table.
    pub fn to_table(&self) -> String {
        let mut o = String::new();
        self.write_header(&mut o);
        self.write_rpcs(&mut o);
        self.write_lookup_outcomes(&mut o);
        self.write_errors(&mut o);
        self.write_ingest(&mut o);
        o
    }

    /// Table: target, load shape, workload and run totals.
    fn write_header(&self, o: &mut String) {
        let w = &self.workload;
        let _ = writeln!(
            o,
            "loadgen {} → {}  ({}, {}{}, {} conn, lookup input {})",
            self.version,
            self.target,
            self.mode,
            self.target_rate
                .map(|r| format!("target {r:.1} req/s"))
                .unwrap_or_default(),
            self.concurrency
                .map(|c| format!("concurrency {c}"))
                .unwrap_or_default(),
            self.connections,
            self.lookup_input
        );
        let _ = writeln!(
            o,
            "workload {:?} seed {}: {} replicas, {} tenants, {} models, {} adapters, scheme {}, block {}, tokens {}/{}/{} (min/mean/max), population {}",
            w.kind,
            w.seed,
            w.replicas,
            w.tenants,
            w.models,
            w.adapters,
            w.hash_scheme,
            w.block_size,
            w.min_tokens,
            w.mean_tokens,
            w.max_tokens,
            w.population
        );
        let _ = writeln!(
            o,
            "elapsed {:.2} s, lookups started {}, abandoned {}, achieved {:.1} req/s",
            self.elapsed_s, self.lookups_started, self.lookups_abandoned, self.achieved_rate
        );
    }

    /// Table: one latency row per RPC.
    fn write_rpcs(&self, o: &mut String) {
        let _ = writeln!(o);
        let _ = writeln!(
            o,
            "{:<18} {:>9} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "rpc", "ok", "errors", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "max ms", "mean ms"
        );
        for (name, r) in &self.rpcs {
            let _ = writeln!(
                o,
                "{:<18} {:>9} {:>7} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3}",
                name, r.ok, r.errors, r.p50_ms, r.p90_ms, r.p99_ms, r.p999_ms, r.max_ms, r.mean_ms
            );
        }
    }

    /// Table: LookupRoute reason codes, hit shares and budget overruns.
    fn write_lookup_outcomes(&self, o: &mut String) {
        let ok = self.rpcs[Rpc::LookupRoute.name()].ok;
        let _ = writeln!(o);
        let _ = writeln!(o, "reason codes (LookupRoute):");
        if self.reason_codes.is_empty() {
            let _ = writeln!(o, "  (none)");
        }
        for (k, v) in &self.reason_codes {
            let _ = writeln!(o, "  {:<22} {:>9}  {:>6.2}%", k, v, 100.0 * ratio(*v, ok));
        }
        let h = &self.hits;
        let _ = writeln!(
            o,
            "hits: {:.2}% with scores, {:.2}% PREFIX_MATCH, mean top matched tokens {:.1}, token hit ratio {:.3}",
            100.0 * h.share_with_scores,
            100.0 * h.prefix_match_share,
            h.mean_top_matched_tokens,
            h.token_hit_ratio
        );
        if !self.budgets.is_empty() {
            let _ = writeln!(o, "lookups over budget:");
            for b in &self.budgets {
                let _ = writeln!(
                    o,
                    "  > {:>8.3} ms  {:>9}  {:>8.4}%",
                    b.budget_ms,
                    b.over,
                    100.0 * b.share_over
                );
            }
        }
    }

    /// Table: failed calls by status code and the open loop's send lag.
    fn write_errors(&self, o: &mut String) {
        let _ = writeln!(o, "errors by code:");
        if self.errors_by_code.is_empty() {
            let _ = writeln!(o, "  (none)");
        }
        for (k, v) in &self.errors_by_code {
            let _ = writeln!(o, "  {k:<22} {v:>9}");
        }
        if let Some(l) = &self.send_lag {
            let _ = writeln!(
                o,
                "send lag behind schedule: p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
                l.p50_ms, l.p99_ms, l.max_ms
            );
        }
    }

    /// Table: preload and run-phase ingest counters.
    fn write_ingest(&self, o: &mut String) {
        for (label, s) in [("preload", &self.preload), ("ingest", &self.ingest)] {
            if let Some(s) = s {
                let _ = writeln!(
                    o,
                    "{label}: {} prefixes in {} messages on {} streams ({} stream errors), {} re-reports, {} evictions, {} stats updates, {} ops ({} dropped), engine block hits {} / new {}",
                    s.prefixes_reported,
                    s.messages,
                    s.streams_opened,
                    s.stream_errors,
                    s.rereported,
                    s.evictions,
                    s.stats_updates,
                    s.store_ops,
                    s.dropped_ops,
                    s.blocks_hit,
                    s.blocks_new
                );
            }
        }
    }
}
