//! Shared builders for the index conformance tests (docs/CONFORMANCE.md conventions: tenant `t`,
//! model `m`, scheme `vllm`, adapter "", fixed clock).
#![allow(dead_code)]

use inferencecache_index::index::{
    EntryCursor, Index, IndexConfig, LookupQuery, RankerConfig, Removed, Strategy,
};
use inferencecache_index::rules::{Eviction, TenantRules};
use inferencecache_proto::v1alpha1::{
    CacheEvent, CacheStateUpdate, PrefixEntry, ReplicaStats, cache_event,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A fixed "now" (2023-11-14T22:13:20Z) in unix ns.
pub const T0: i64 = 1_700_000_000_000_000_000;
pub const SEC: i64 = 1_000_000_000;
pub const MIN: i64 = 60 * SEC;
pub const HOUR: i64 = 60 * MIN;

/// Policy-like rules for tests.
#[derive(Clone, Debug, Default)]
pub struct Rules {
    pub ttl: HashMap<String, i64>,
    pub lfu: Vec<String>,
    pub quota: HashMap<String, u64>,
}

impl Rules {
    pub fn lfu(tenant: &str) -> Rules {
        Rules {
            lfu: vec![tenant.into()],
            ..Default::default()
        }
    }
    pub fn ttl(tenant: &str, ttl: i64) -> Rules {
        let mut r = Rules::default();
        r.ttl.insert(tenant.into(), ttl);
        r
    }
    pub fn quota(tenant: &str, budget: u64) -> Rules {
        let mut r = Rules::default();
        r.quota.insert(tenant.into(), budget);
        r
    }
}

impl TenantRules for Rules {
    fn ttl_ns(&self, tenant: &str) -> i64 {
        self.ttl.get(tenant).copied().unwrap_or(0)
    }
    fn eviction(&self, tenant: &str) -> Eviction {
        if self.lfu.iter().any(|t| t == tenant) {
            Eviction::Lfu
        } else {
            Eviction::Lru
        }
    }
    fn quota(&self, tenant: &str) -> Option<u64> {
        self.quota.get(tenant).copied()
    }
}

/// An index with the given default TTL and cap, default ranker.
pub fn index_with(ttl: i64, cap: u64) -> Index {
    Index::new(IndexConfig {
        default_ttl_ns: ttl,
        max_entries: cap,
        ..IndexConfig::default()
    })
}

pub fn index() -> Index {
    Index::default()
}

pub fn ranker() -> RankerConfig {
    RankerConfig::default()
}

pub fn legacy(hash: &[u8], tokens: i32) -> PrefixEntry {
    PrefixEntry {
        prefix_hash: hash.to_vec(),
        token_count: tokens,
        ..Default::default()
    }
}

pub fn legacy_tier(hash: &[u8], tokens: i32, tier: i32) -> PrefixEntry {
    PrefixEntry {
        prefix_hash: hash.to_vec(),
        token_count: tokens,
        tier,
        ..Default::default()
    }
}

pub fn legacy_adapter(hash: &[u8], tokens: i32, adapter: &str) -> PrefixEntry {
    PrefixEntry {
        prefix_hash: hash.to_vec(),
        token_count: tokens,
        adapter_id: adapter.into(),
        ..Default::default()
    }
}

/// `chain(a, b, …)` with `per` tokens per block.
pub fn chain_entry(hashes: &[&[u8]], per: i32) -> PrefixEntry {
    PrefixEntry {
        block_hashes: hashes.iter().map(|h| h.to_vec()).collect(),
        block_token_counts: vec![per; hashes.len()],
        ..Default::default()
    }
}

pub fn upd(
    tenant: &str,
    model: &str,
    scheme: &str,
    replica: &str,
    prefixes: Vec<PrefixEntry>,
) -> CacheStateUpdate {
    CacheStateUpdate {
        replica_id: replica.into(),
        model_id: model.into(),
        tenant_id: tenant.into(),
        hash_scheme: scheme.into(),
        timestamp_us: 0,
        prefixes,
        stats: None,
        adapter_id: String::new(),
    }
}

/// Default scope `(t, m, vllm)`.
pub fn upd_r(replica: &str, prefixes: Vec<PrefixEntry>) -> CacheStateUpdate {
    upd("t", "m", "vllm", replica, prefixes)
}

pub fn with_stats(mut u: CacheStateUpdate, hit: f32, pressure: f32) -> CacheStateUpdate {
    u.stats = Some(ReplicaStats {
        replica_id: u.replica_id.clone(),
        hit_rate: hit,
        pressure,
        ..Default::default()
    });
    u
}

pub fn at(mut u: CacheStateUpdate, ts_ns: i64) -> CacheStateUpdate {
    u.timestamp_us = ts_ns / 1000;
    u
}

pub fn event(
    ty: cache_event::Type,
    tenant: &str,
    model: &str,
    replica: &str,
    hash: &[u8],
) -> CacheEvent {
    CacheEvent {
        r#type: ty as i32,
        replica_id: replica.into(),
        model_id: model.into(),
        tenant_id: tenant.into(),
        prefix_hash: hash.to_vec(),
        timestamp_us: 0,
        adapter_id: String::new(),
    }
}

/// An exact query on `(t, m, vllm)`.
pub fn q_exact(hash: &[u8]) -> LookupQuery<'_> {
    LookupQuery {
        tenant: "t",
        model: "m",
        hash_scheme: "vllm",
        prefix_hash: hash,
        ..Default::default()
    }
}

/// An owned chain for queries.
pub struct Chain {
    pub hashes: Vec<Vec<u8>>,
    pub counts: Vec<i32>,
}

pub fn chain(hashes: &[&[u8]], per: i32) -> Chain {
    Chain {
        hashes: hashes.iter().map(|h| h.to_vec()).collect(),
        counts: vec![per; hashes.len()],
    }
}

impl Chain {
    pub fn q(&self) -> LookupQuery<'_> {
        LookupQuery {
            tenant: "t",
            model: "m",
            hash_scheme: "vllm",
            block_hashes: (&self.hashes).into(),
            block_token_counts: &self.counts,
            ..Default::default()
        }
    }
}

/// `(replica, score, matched, prob, tier)` of a lookup, owned.
pub type Row = (String, f32, i32, f32, i32);

pub fn route(
    ix: &mut Index,
    q: &LookupQuery<'_>,
    now: i64,
    rules: &dyn TenantRules,
) -> (Strategy, Vec<Row>) {
    let v = ix.lookup_route(q, now, rules);
    let rows = v
        .scores
        .iter()
        .map(|s| {
            (
                v.replica_id(s).to_string(),
                s.score,
                s.matched_tokens,
                s.estimated_cache_hit_prob,
                s.tier,
            )
        })
        .collect();
    (v.strategy, rows)
}

pub fn plain(ix: &mut Index, q: &LookupQuery<'_>, now: i64, rules: &dyn TenantRules) -> Vec<Row> {
    let v = ix.lookup(q, now, rules);
    v.scores
        .iter()
        .map(|s| {
            (
                v.replica_id(s).to_string(),
                s.score,
                s.matched_tokens,
                s.estimated_cache_hit_prob,
                s.tier,
            )
        })
        .collect()
}

pub fn names(rows: &[Row]) -> Vec<&str> {
    rows.iter().map(|r| r.0.as_str()).collect()
}

pub fn approx(a: f32, b: f32, tol: f32) -> bool {
    (a - b).abs() <= tol
}

#[track_caller]
pub fn assert_approx(a: f32, b: f32) {
    assert!(approx(a, b, b.abs() * 1e-3 + 1e-6), "{a} !≈ {b}");
}

/// A small deterministic generator (xorshift64*), so a seeded workload's failure reproduces
/// from its seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Records every removal-hook report as one comparable line (all its fields).
pub fn record_removals(ix: &mut Index) -> Arc<Mutex<Vec<String>>> {
    let rows = Arc::new(Mutex::new(Vec::new()));
    let sink = rows.clone();
    ix.set_removal_sink(Some(Box::new(move |r: &Removed<'_>| {
        let mut buf = [0u8; 8];
        sink.lock().unwrap().push(format!(
            "{:?} {:?} {} {} {} {} {} {:?} {}",
            r.reason(),
            r.algorithm(),
            r.tenant(),
            r.model(),
            r.hash_scheme(),
            r.adapter(),
            r.replica(),
            r.prefix_hash(&mut buf),
            r.at_ns(),
        ));
    })));
    rows
}

/// Every entry of the index as one comparable line each, sorted.
pub fn sorted_entries(ix: &Index) -> Vec<String> {
    let mut out = Vec::new();
    ix.export_entries(EntryCursor::START, usize::MAX, |e| {
        out.push(format!(
            "{} {} {} {} {:?} {} {} {}",
            e.tenant, e.model, e.scheme, e.adapter, e.hash, e.replica, e.last_seen, e.access
        ))
    });
    out.sort();
    out
}
