//! The self-differential test: the same seeded random traffic is sent to
//! three servers started with `--shards 1` (the oracle: one core answers exactly like the
//! reference), `--shards 2` and `--shards 4` (more shards than this machine's CPUs), and every
//! answer is compared field by field.
//!
//! Traffic: ReportCacheState streams (legacy and chain prefixes, adapters, tiers, stats),
//! PublishEvent (PREFIX_ADDED, PREFIX_EVICTED, REPLICA_UPDATED, ALL_CLEARED, unspecified),
//! LookupRoute (exact hashes, chains, malformed chains, token_ids, adapters, SLOs, unknown
//! tenant/model/scheme), GetCacheState, LookupPDRoute, `/policy` phases (per-tenant quotas,
//! lru/lfu, floors, strategy switches, TTLs), `/snapshot` and the deterministic `/metrics`
//! series. The servers run with a small global cap (`--index-max-entries`) so the cap evicts,
//! and a short sweep interval so TTL sweeps run (in slices of at most 4 entries, through
//! `INFERENCECACHE_TEST_SWEEP_SLICE_ENTRIES`, so every pass interleaves with requests).
//!
//! Time is controlled so the three servers see the same sequence:
//! * each step goes to all three servers and completes on all before the next one starts (each
//!   server sees its requests strictly one after the other);
//! * "fresh" producer timestamps lie 40 minutes in the future (the test raises
//!   `--max-timestamp-skew-ms` so they are kept), so every freshness, pressure freshness and
//!   TENANT_HOT recency is exactly 1 whatever the wall clock does; they are drawn from a window
//!   of 400 seconds, so `last_seen` ties and backward moves happen;
//! * "stale" timestamps lie in 1970, so such entries and stats rows are expired on arrival. They
//!   are only ever ingested under replicas named `stale-*`, in a step of their own, after which
//!   the test waits until every server's sweep removed them (no `stale-*` row left in
//!   `/snapshot`), so no other request can observe the sweep's timing;
//! * timestamp 0 ("now") and `lookupTimeoutMs` are never used.
//!
//! Ignored fields, each inherently timing-dependent:
//! * `LookupRouteResponse.lookup_latency_us` (the server's measured handler time);
//! * every `/metrics` series except the index gauges and counters listed in [`METRIC_SERIES`]
//!   (latency histograms, process and per-core series depend on time and on the core count).
//!
//! `SELF_DIFF_REQUESTS` (default 2,400) is the number of requests sent to each server;
//! `SELF_DIFF_SEED` picks the seed. The full run (20,000 requests per server) is
//! `SELF_DIFF_REQUESTS=20000 cargo test --release --test e2e self_differential -- --nocapture`.

use std::fmt::Debug;
use std::time::{Duration, Instant};

use crate::support::*;
use pb::inference_cache_client::InferenceCacheClient;
use tonic::transport::Channel;

const TENANTS: &[&str] = &["ta", "tb", "tc"];
const MODELS: &[&str] = &["m0", "m1", "m2", "m3", "m4"];
const SCHEMES: &[&str] = &["s1", "s2"];
const ADAPTERS: &[&str] = &["", "a1", "a2"];
const REPLICAS: &[&str] = &["r0", "r1", "r2", "r3", "r4"];
const STALE_REPLICAS: &[&str] = &["stale-0", "stale-1"];
/// Global cap of every server (storage entries).
const CAP: &str = "120";
/// Sweep interval of every server (ms).
const SWEEP_MS: &str = "20";
/// `/metrics` series compared (by name prefix; exact label sets and values).
const METRIC_SERIES: &[&str] = &[
    "inferencecache_index_entries{",
    "inferencecache_index_evictions_total{",
    "inferencecache_tenant_evictions_total{",
    "inferencecache_lookup_route_calls_total{",
    "inferencecache_ingest_entries_total",
];

/// SplitMix64: a small, seedable generator (no dependency).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<'a, T: ?Sized>(&mut self, xs: &'a [&'a T]) -> &'a T {
        xs[self.below(xs.len() as u64) as usize]
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// The fixed universe of hashes and token chains the traffic draws from (small, so keys collide).
struct Universe {
    /// Exact-key hashes: 8-byte ones and a few of other lengths (blob keys).
    hashes: Vec<Vec<u8>>,
    /// Token sequences (4 blocks of 16) sharing prefixes, with their fingerprint chains.
    chains: Vec<(Vec<u32>, Vec<Vec<u8>>)>,
}

impl Universe {
    fn new() -> Universe {
        let mut hashes: Vec<Vec<u8>> = (0..10u64)
            .map(|i| (i * 7919 + 3).to_be_bytes().to_vec())
            .collect();
        hashes.push(b"x".to_vec());
        hashes.push(b"blob-hash-17-bytes".to_vec());
        hashes.push(Vec::new());
        let mut chains = Vec::new();
        for c in 0..4u32 {
            // Chains 0/1 share their first block, 2/3 their first two.
            let tokens: Vec<u32> = (0..64u32)
                .map(|i| match (c, i / 16) {
                    (0 | 1, 0) => i,
                    (2 | 3, 0 | 1) => 1000 + i,
                    _ => c * 10_000 + i,
                })
                .collect();
            let (h, _) = fingerprint_chain(&tokens, 16);
            chains.push((tokens, h));
        }
        Universe { hashes, chains }
    }
}

/// What each step sends to every server.
enum Step {
    Report(Vec<pb::CacheStateUpdate>, bool),
    Event(pb::CacheEvent),
    Lookup(pb::LookupRouteRequest),
    State(pb::GetCacheStateRequest),
    Pd(pb::LookupPdRouteRequest),
    Policy(String),
    Snapshot,
    Metrics,
}

struct Gen {
    rng: Rng,
    u: Universe,
    /// Base of the "fresh" producer timestamps (µs), 40 minutes ahead of the start.
    fresh_base: i64,
    stale_seq: i64,
    /// Recently ingested (update, prefix index) pairs: half of the lookups ask for one of them,
    /// so matches (scores, distinguishing power, LFU credit, floors) are frequent.
    recent: Vec<(pb::CacheStateUpdate, usize)>,
}

impl Gen {
    fn fresh_ts(&mut self) -> i64 {
        self.fresh_base + self.rng.below(400) as i64 * 1_000_000
    }

    fn tier(&mut self) -> i32 {
        [0, 1, 1, 2, 3, 7, -1][self.rng.below(7) as usize]
    }

    fn stats(&mut self) -> Option<pb::ReplicaStats> {
        let hit = [0.0f32, 0.05, 0.1, 0.25, 0.5, 0.9, 0.905_948, 1.0][self.rng.below(8) as usize];
        let pressure = [0.0f32, 0.1, 0.3, 0.7, 1.2][self.rng.below(5) as usize];
        Some(pb::ReplicaStats {
            replica_id: String::new(),
            cache_memory_bytes: self.rng.below(1 << 20) as i64,
            hit_rate: hit,
            pressure,
            client_version: "v".into(),
            t2_hit_tokens: self.rng.below(3) as i64,
            t2_query_tokens: self.rng.below(5) as i64,
        })
    }

    fn prefix(&mut self) -> pb::PrefixEntry {
        let adapter = if self.rng.chance(20) {
            self.rng.pick(ADAPTERS).to_string()
        } else {
            String::new()
        };
        let tier = self.tier();
        if self.rng.chance(50) {
            let c = self.rng.below(self.u.chains.len() as u64) as usize;
            let n = 1 + self.rng.below(4) as usize;
            let hashes: Vec<Vec<u8>> = self.u.chains[c].1[..n].to_vec();
            let mut counts = vec![16; n];
            if self.rng.chance(3) {
                counts.pop(); // malformed: dropped at ingest
            }
            let prefix_hash = if self.rng.chance(15) {
                self.u.hashes[self.rng.below(self.u.hashes.len() as u64) as usize].clone()
            } else {
                Vec::new()
            };
            pb::PrefixEntry {
                prefix_hash,
                token_count: 16 * n as i32,
                block_hashes: hashes,
                block_token_counts: counts,
                tier,
                adapter_id: adapter,
            }
        } else {
            pb::PrefixEntry {
                prefix_hash: self.u.hashes[self.rng.below(self.u.hashes.len() as u64) as usize]
                    .clone(),
                token_count: [0, 16, 32, 64, 100, 128][self.rng.below(6) as usize],
                tier,
                adapter_id: adapter,
                ..Default::default()
            }
        }
    }

    fn update(&mut self, stale: bool) -> pb::CacheStateUpdate {
        let ts = if stale {
            self.stale_seq += 1;
            1_000_000_000 + self.stale_seq * 1_000_000
        } else {
            self.fresh_ts()
        };
        let n = self.rng.below(4) as usize;
        let prefixes = (0..n).map(|_| self.prefix()).collect();
        let u = pb::CacheStateUpdate {
            replica_id: if stale {
                self.rng.pick(STALE_REPLICAS)
            } else {
                self.rng.pick(REPLICAS)
            }
            .into(),
            model_id: self.rng.pick(MODELS).into(),
            tenant_id: self.rng.pick(TENANTS).into(),
            hash_scheme: if self.rng.chance(3) {
                String::new()
            } else {
                self.rng.pick(SCHEMES).into()
            },
            timestamp_us: ts,
            prefixes,
            stats: if self.rng.chance(40) {
                self.stats()
            } else {
                None
            },
            adapter_id: if self.rng.chance(20) {
                self.rng.pick(ADAPTERS).into()
            } else {
                String::new()
            },
        };
        if !stale {
            for i in 0..u.prefixes.len() {
                if self.recent.len() >= 32 {
                    self.recent.remove(0);
                }
                self.recent.push((u.clone(), i));
            }
        }
        u
    }

    /// A lookup for a recently ingested prefix (its tenant, model, scheme and adapter).
    fn lookup_recent(&mut self) -> Option<pb::LookupRouteRequest> {
        if self.recent.is_empty() {
            return None;
        }
        let (u, i) = self.recent[self.rng.below(self.recent.len() as u64) as usize].clone();
        let p = &u.prefixes[i];
        let adapter = if p.adapter_id.is_empty() {
            u.adapter_id.clone()
        } else {
            p.adapter_id.clone()
        };
        let mut r = pb::LookupRouteRequest {
            model_id: u.model_id.clone(),
            tenant_id: u.tenant_id.clone(),
            hash_scheme: u.hash_scheme.clone(),
            adapter_id: adapter,
            slo: self.rng.chance(30).then_some(pb::Slo {
                ttft_ms: 100,
                tbt_ms: 0,
            }),
            ..Default::default()
        };
        if !p.block_hashes.is_empty() && self.rng.chance(80) {
            let n = 1 + self.rng.below(p.block_hashes.len() as u64) as usize;
            r.block_hashes = p.block_hashes[..n]
                .iter()
                .cloned()
                .map(Into::into)
                .collect();
            r.block_token_counts = vec![16; n];
            // Sometimes a longer chain than was ingested (a partial run).
            if n == p.block_hashes.len() && self.rng.chance(30) {
                let c = self.rng.below(self.u.chains.len() as u64) as usize;
                r.block_hashes.push(self.u.chains[c].1[3].clone().into());
                r.block_token_counts.push(16);
            }
        } else {
            r.prefix_hash = if p.prefix_hash.is_empty() && !p.block_hashes.is_empty() {
                p.block_hashes[p.block_hashes.len() - 1].clone()
            } else {
                p.prefix_hash.clone()
            };
            r.prefix_token_count = [16, 64, 128][self.rng.below(3) as usize];
        }
        Some(r)
    }

    fn event(&mut self) -> pb::CacheEvent {
        use pb::cache_event::Type;
        let ty = match self.rng.below(20) {
            0 => Type::PrefixAdded,
            1 => Type::Unspecified,
            2..=9 => Type::PrefixEvicted,
            10..=14 => Type::ReplicaUpdated,
            _ => Type::AllCleared,
        };
        let hash = if self.rng.chance(50) {
            let c = self.rng.below(self.u.chains.len() as u64) as usize;
            let b = self.rng.below(4) as usize;
            self.u.chains[c].1[b].clone()
        } else {
            self.u.hashes[self.rng.below(self.u.hashes.len() as u64) as usize].clone()
        };
        pb::CacheEvent {
            r#type: ty as i32,
            replica_id: self.rng.pick(REPLICAS).into(),
            model_id: self.rng.pick(MODELS).into(),
            tenant_id: self.rng.pick(TENANTS).into(),
            prefix_hash: hash,
            timestamp_us: self.fresh_ts(),
            adapter_id: if self.rng.chance(30) {
                self.rng.pick(ADAPTERS).into()
            } else {
                String::new()
            },
        }
    }

    fn lookup(&mut self) -> pb::LookupRouteRequest {
        let tenant = if self.rng.chance(5) {
            "tz"
        } else {
            self.rng.pick(TENANTS)
        };
        let model = if self.rng.chance(5) {
            "mz"
        } else {
            self.rng.pick(MODELS)
        };
        let scheme = if self.rng.chance(5) {
            "sz"
        } else {
            self.rng.pick(SCHEMES)
        };
        let mut r = pb::LookupRouteRequest {
            model_id: model.into(),
            tenant_id: tenant.into(),
            hash_scheme: scheme.into(),
            adapter_id: if self.rng.chance(25) {
                self.rng.pick(ADAPTERS).into()
            } else {
                String::new()
            },
            slo: match self.rng.below(3) {
                0 => None,
                1 => Some(pb::Slo {
                    ttft_ms: 100,
                    tbt_ms: 10,
                }),
                _ => Some(pb::Slo {
                    ttft_ms: 500,
                    tbt_ms: 0,
                }),
            },
            ..Default::default()
        };
        match self.rng.below(10) {
            0..=3 => {
                r.prefix_hash =
                    self.u.hashes[self.rng.below(self.u.hashes.len() as u64) as usize].clone();
                r.prefix_token_count = [0, 16, 64, 128][self.rng.below(4) as usize];
            }
            4..=6 => {
                let c = self.rng.below(self.u.chains.len() as u64) as usize;
                let n = 1 + self.rng.below(4) as usize;
                r.block_hashes = self.u.chains[c].1[..n]
                    .iter()
                    .cloned()
                    .map(Into::into)
                    .collect();
                r.block_token_counts = vec![16; n];
                if self.rng.chance(5) {
                    r.block_token_counts.pop();
                }
            }
            7 | 8 => {
                let c = self.rng.below(self.u.chains.len() as u64) as usize;
                let n = 1 + self.rng.below(64) as usize;
                r.token_ids = self.u.chains[c].0[..n].to_vec();
            }
            _ => {} // no fingerprint: the empty exact key
        }
        r
    }

    fn policy(&mut self) -> String {
        let mut policies = Vec::new();
        let mut tenants = Vec::new();
        for t in TENANTS {
            if self.rng.chance(25) {
                continue; // no policy: reference defaults (matched floor 64)
            }
            let mut p = format!(r#"{{"namespace":"{t}""#);
            if self.rng.chance(50) {
                p.push_str(r#","eviction":"lfu""#);
            } else if self.rng.chance(50) {
                p.push_str(r#","eviction":"lru""#);
            }
            if self.rng.chance(30) {
                p.push_str(r#","evictionTTL":3600000000000"#);
            }
            let matched = [0, 0, 16, 32, 64][self.rng.below(5) as usize];
            if matched > 0 {
                p.push_str(&format!(r#","minimumMatchedTokens":{matched}"#));
            }
            if self.rng.chance(40) {
                let f = ["0", "0.1", "5", "40"][self.rng.below(4) as usize];
                p.push_str(&format!(r#","routingFloorScore":{f}"#));
            }
            if self.rng.chance(20) {
                p.push_str(r#","minimumPrefixTokens":32"#);
            }
            if self.rng.chance(20) {
                p.push_str(r#","affinityRouting":false"#);
            }
            if self.rng.chance(30) {
                let chain = !self.rng.chance(30);
                let hot = !self.rng.chance(30);
                p.push_str(&format!(
                    r#","strategy":{{"enableChainMatching":{chain},"requireChain":false,"enableTenantHot":{hot}}}"#
                ));
            }
            p.push('}');
            policies.push(p);
            if self.rng.chance(60) {
                let quota = [0, 8, 16, 24, 32, 48][self.rng.below(6) as usize];
                tenants.push(format!(r#"{{"tenantID":"{t}","maxIndexEntries":{quota}}}"#));
            }
        }
        format!(
            r#"{{"version":7,"policies":[{}],"tenants":[{}]}}"#,
            policies.join(","),
            tenants.join(",")
        )
    }

    fn step(&mut self) -> Step {
        match self.rng.below(100) {
            0..=29 => {
                let n = 1 + self.rng.below(3) as usize;
                Step::Report((0..n).map(|_| self.update(false)).collect(), false)
            }
            30..=32 => Step::Report(vec![self.update(true)], true),
            33..=44 => Step::Event(self.event()),
            45..=64 => Step::Lookup(self.lookup()),
            65..=84 => Step::Lookup(self.lookup_recent().unwrap_or_else(|| self.lookup())),
            85..=90 => Step::State(pb::GetCacheStateRequest {
                model_id: self.rng.pick(MODELS).into(),
                tenant_id: self.rng.pick(TENANTS).into(),
            }),
            91..=92 => Step::Pd(pb::LookupPdRouteRequest {
                model_id: self.rng.pick(MODELS).into(),
                tenant_id: self.rng.pick(TENANTS).into(),
                prefix_hash: self.u.hashes[self.rng.below(self.u.hashes.len() as u64) as usize]
                    .clone(),
                prefix_token_count: 64,
                pd_topology_ref: String::new(),
            }),
            93..=94 => Step::Policy(self.policy()),
            95..=97 => Step::Snapshot,
            _ => Step::Metrics,
        }
    }
}

/// One server under test and its client.
struct Target {
    srv: Server,
    client: InferenceCacheClient<Channel>,
}

/// A comparable answer: the step's kind and the answer rendered with `{:#?}` (every field).
type Answer = String;

fn render<T: Debug>(x: &T) -> Answer {
    format!("{x:#?}")
}

fn metric_lines(text: &str) -> String {
    let mut v: Vec<&str> = text
        .lines()
        .filter(|l| METRIC_SERIES.iter().any(|p| l.starts_with(p)))
        .collect();
    v.sort();
    v.join("\n")
}

/// Runs `f` on a blocking thread (the HTTP helpers are synchronous).
async fn blocking<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    tokio::task::spawn_blocking(f).await.expect("blocking task")
}

impl Target {
    async fn send(&mut self, step: &Step) -> Answer {
        match step {
            Step::Report(updates, _) => {
                let ack = self
                    .client
                    .report_cache_state(tokio_stream::iter(updates.clone()))
                    .await
                    .expect("ReportCacheState")
                    .into_inner();
                render(&ack)
            }
            Step::Event(e) => render(
                &self
                    .client
                    .publish_event(e.clone())
                    .await
                    .expect("PublishEvent")
                    .into_inner(),
            ),
            Step::Lookup(r) => {
                let mut resp = self
                    .client
                    .lookup_route(r.clone())
                    .await
                    .expect("LookupRoute")
                    .into_inner();
                resp.lookup_latency_us = 0; // measured time: ignored
                render(&resp)
            }
            Step::State(r) => render(
                &self
                    .client
                    .get_cache_state(r.clone())
                    .await
                    .expect("GetCacheState")
                    .into_inner(),
            ),
            Step::Pd(r) => render(
                &self
                    .client
                    .lookup_pd_route(r.clone())
                    .await
                    .expect("LookupPDRoute")
                    .into_inner(),
            ),
            Step::Policy(body) => {
                let (port, body) = (self.srv.admin_port, body.clone());
                let (st, b) = blocking(move || {
                    http_request(
                        port,
                        "POST",
                        "/policy",
                        &[("Content-Type", "application/json")],
                        body.as_bytes(),
                    )
                    .expect("POST /policy")
                })
                .await;
                format!("{st} {b}")
            }
            Step::Snapshot => {
                let port = self.srv.admin_port;
                let (st, b) =
                    blocking(move || http_get(port, "/snapshot").expect("GET /snapshot")).await;
                format!("{st}\n{b}")
            }
            Step::Metrics => {
                let port = self.srv.http_port;
                let (st, b) =
                    blocking(move || http_get(port, "/metrics").expect("GET /metrics")).await;
                format!("{st}\n{}", metric_lines(&b))
            }
        }
    }

    /// Each core's completed sweep passes (`inferencecache_core_sweeps_total`), in core order.
    async fn sweeps(&self) -> Vec<u64> {
        let port = self.srv.http_port;
        let (_, body) = blocking(move || http_get(port, "/metrics").expect("GET /metrics")).await;
        body.lines()
            .filter(|l| l.starts_with("inferencecache_core_sweeps_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .map(|v| v as u64)
            .collect()
    }

    /// Waits until every core completed a sweep pass after `before` (its counts then): the TTL
    /// evictions of a pass are counted when it ends, so the pass that removed the stale entries
    /// is counted by then (it may end after `/snapshot` stopped showing them). Returns the
    /// `/metrics` requests it sent.
    async fn sweeps_after(&self, before: &[u64], deadline: Instant) -> usize {
        let mut polls = 0;
        loop {
            let now = self.sweeps().await;
            polls += 1;
            if now.len() == before.len() && now.iter().zip(before).all(|(n, b)| n > b) {
                return polls;
            }
            assert!(Instant::now() < deadline, "no sweep pass completed in 20 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Whether this server's sweep has removed every `stale-*` entry and stats row.
    async fn stale_gone(&self) -> bool {
        let port = self.srv.admin_port;
        let (_, body) = blocking(move || http_get(port, "/snapshot").expect("GET /snapshot")).await;
        !body.contains("\"stale-")
    }
}

fn describe(step: &Step) -> String {
    match step {
        Step::Report(u, stale) => format!("ReportCacheState (stale={stale}) {u:?}"),
        Step::Event(e) => format!("PublishEvent {e:?}"),
        Step::Lookup(r) => format!("LookupRoute {r:?}"),
        Step::State(r) => format!("GetCacheState {r:?}"),
        Step::Pd(r) => format!("LookupPDRoute {r:?}"),
        Step::Policy(b) => format!("POST /policy {b}"),
        Step::Snapshot => "GET /snapshot".into(),
        Step::Metrics => "GET /metrics".into(),
    }
}

/// The first differing line of two renderings, with a little context.
fn first_diff(a: &str, b: &str) -> String {
    let (la, lb): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
    for i in 0..la.len().max(lb.len()) {
        let (x, y) = (
            la.get(i).copied().unwrap_or("<end>"),
            lb.get(i).copied().unwrap_or("<end>"),
        );
        if x != y {
            let ctx = la[i.saturating_sub(3)..i.min(la.len())].join("\n");
            return format!("...\n{ctx}\n  shards 1: {x}\n  other:    {y}");
        }
    }
    "identical lines (whitespace?)".into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn self_differential_shards_1_2_4() {
    let requests: usize = std::env::var("SELF_DIFF_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2400);
    let seed: u64 = std::env::var("SELF_DIFF_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x1c_5e1f_d1ff);
    let flags = [
        "--index-max-entries",
        CAP,
        "--sweep-interval-ms",
        SWEEP_MS,
        "--max-timestamp-skew-ms",
        "7200000",
    ];
    let shard_counts = [1usize, 2, 4];
    let mut targets = Vec::new();
    for &n in &shard_counts {
        // Tiny sweep and cap-build slices: every sweep pass and every cap candidate build ahead
        // of need runs in many slices with requests between them; and tiny candidate heaps, so
        // the cap's thresholds, rebuilds and builds ahead of need happen on this small index.
        let srv = Server::start_opts(
            n,
            StartOpts {
                flags: &flags,
                env: &[
                    ("INFERENCECACHE_TEST_SWEEP_SLICE_ENTRIES", "4"),
                    ("INFERENCECACHE_TEST_MIN_CANDIDATES", "4"),
                ],
                ..Default::default()
            },
        );
        let client = srv.client().await;
        targets.push(Target { srv, client });
    }
    let mut g = Gen {
        rng: Rng(seed),
        u: Universe::new(),
        fresh_base: now_us() + 40 * 60 * 1_000_000,
        stale_seq: 0,
        recent: Vec::new(),
    };
    let started = Instant::now();
    let mut sent = 0usize;
    let mut steps = 0usize;
    let mut diffs: Vec<String> = Vec::new();
    let mut diff_count = [0usize; 3];
    let mut kinds = std::collections::BTreeMap::<&str, usize>::new();
    // LookupRoute reason codes answered by --shards 1 (coverage of the comparison).
    let mut reasons = std::collections::BTreeMap::<String, usize>::new();
    while sent < requests {
        let step = g.step();
        steps += 1;
        let kind = match &step {
            Step::Report(_, true) => "report-stale",
            Step::Report(..) => "report",
            Step::Event(_) => "event",
            Step::Lookup(_) => "lookup",
            Step::State(_) => "state",
            Step::Pd(_) => "pd",
            Step::Policy(_) => "policy",
            Step::Snapshot => "snapshot",
            Step::Metrics => "metrics",
        };
        *kinds.entry(kind).or_default() += 1;
        let [a, b, c] = &mut targets[..] else {
            unreachable!()
        };
        let (ra, rb, rc) = tokio::join!(a.send(&step), b.send(&step), c.send(&step));
        sent += 1;
        if let Step::Lookup(_) = step
            && let Some(code) = ra.split("reason_code: \"").nth(1)
            && let Some(code) = code.split('"').next()
        {
            *reasons.entry(code.to_string()).or_default() += 1;
        }
        for (i, r) in [(1usize, &rb), (2, &rc)] {
            if *r != ra {
                diff_count[i] += 1;
                if diffs.len() < 12 {
                    diffs.push(format!(
                        "step {steps} (request {sent}), shards {} vs 1: {}\n{}",
                        shard_counts[i],
                        describe(&step),
                        first_diff(&ra, r)
                    ));
                }
            }
        }
        if let Step::Report(_, true) = step {
            // Wait until every server's sweep removed the expired entries (§6).
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let (x, y, z) = tokio::join!(
                    targets[0].stale_gone(),
                    targets[1].stale_gone(),
                    targets[2].stale_gone()
                );
                sent += 1; // the /snapshot polls are requests too
                if x && y && z {
                    let before = [
                        targets[0].sweeps().await,
                        targets[1].sweeps().await,
                        targets[2].sweeps().await,
                    ];
                    // The /metrics polls are requests too (counted per server, as above).
                    let mut polls = 0;
                    for (t, b) in targets.iter().zip(&before) {
                        polls = polls.max(t.sweeps_after(b, deadline).await);
                    }
                    sent += 1 + polls;
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the sweep did not remove stale entries in 20 s"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    let elapsed = started.elapsed();
    let evictions = metric_lines(&targets[0].send(&Step::Metrics).await);
    eprintln!("self-differential: LookupRoute reasons (shards 1): {reasons:?}");
    eprintln!(
        "self-differential: evictions (shards 1):\n{}",
        evictions
            .lines()
            .filter(|l| l.contains("evictions_total"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // The cap's candidate heaps were built ahead of need, in slices, on every server (and an
    // ingest that needed victims first finished the build itself some times: `sync`).
    for (i, t) in targets.iter().enumerate() {
        let port = t.srv.http_port;
        let (_, body) = blocking(move || http_get(port, "/metrics").expect("GET /metrics")).await;
        let sum = |name: &str| -> u64 {
            body.lines()
                .filter(|l| l.starts_with(name))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>() as u64
        };
        let (built, slices, sync) = (
            sum("inferencecache_core_cap_builds_total{"),
            sum("inferencecache_core_cap_build_slices_total{"),
            sum("inferencecache_core_cap_builds_sync_total{"),
        );
        eprintln!(
            "self-differential: shards {}: cap candidate builds ahead of need {built} ({slices} slices), finished by an ingest {sync}",
            shard_counts[i]
        );
        assert!(
            built > 0,
            "shards {}: no cap build ahead of need",
            shard_counts[i]
        );
        let (clear_slices, clears_sync) = (
            sum("inferencecache_core_clear_slices_total{"),
            sum("inferencecache_core_clears_sync_total{"),
        );
        eprintln!(
            "self-differential: shards {}: ALL_CLEARED removals in {clear_slices} slices, finished in one go {clears_sync}",
            shard_counts[i]
        );
        // The answers above were compared while clears were pending between requests.
        assert!(
            clear_slices > 0,
            "shards {}: no ALL_CLEARED left its removals to slices",
            shard_counts[i]
        );
    }
    eprintln!(
        "self-differential: seed {seed:#x}, {sent} requests per server ({steps} steps: {kinds:?}) in {:.1} s; differences: shards 2 = {}, shards 4 = {}",
        elapsed.as_secs_f64(),
        diff_count[1],
        diff_count[2]
    );
    assert!(
        diffs.is_empty(),
        "{} + {} answers differ from --shards 1; first ones:\n{}",
        diff_count[1],
        diff_count[2],
        diffs.join("\n\n")
    );
}
