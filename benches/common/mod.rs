//! Deterministic index workloads shared by the criterion benches (`benches/index.rs`) and the
//! CI instruction-count gate (`shards/index/examples/perf_gate.rs`, which includes this file by path).
//!
//! Index shape (one core's index, one tenant/model/scheme, 16 replicas, per-block entries):
//! chains of [`CHAIN_BLOCKS`] 8-byte block hashes; replica `c % 16` holds the whole chain `c`
//! and replica `(c + 1) % 16` holds its first half (a shared prefix), so a chain lookup ranks
//! two replicas with different matched tokens. Every storage entry is one (block key, replica).
//! Nothing here depends on a clock or randomness: the same calls give the same index and queries.

#![allow(dead_code)] // each includer uses a subset

use inferencecache_index::index::{Index, IndexConfig, LookupQuery, Strategy};
use inferencecache_index::policy::{
    CURRENT_POLICY_VERSION, PolicySnapshot, PolicySpec, PolicyStore, parse_policy_body,
};
use inferencecache_index::rules::NoRules;
use inferencecache_proto::v1alpha1::{CacheStateUpdate, PrefixEntry};

pub const TENANT: &str = "team-a";
pub const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
pub const SCHEME: &str = "vllm";
/// Replicas reporting into the index.
pub const REPLICAS: u64 = 16;
/// Blocks per stored chain (the longest lookup is a full chain).
pub const CHAIN_BLOCKS: u64 = 256;
/// Tokens per block (vLLM's default block size).
pub const BLOCK_TOKENS: i32 = 16;
/// Storage entries per chain: the full chain on one replica plus its first half on another.
pub const ENTRIES_PER_CHAIN: u64 = CHAIN_BLOCKS + CHAIN_BLOCKS / 2;
/// Ingest time of chain 0 (unix ns); chain `c` is ingested at `T0 + c * 1000`.
pub const T0: i64 = 1_700_000_000_000_000_000;

/// The 8-byte block hash of global block number `key` (bijective, so keys never collide).
pub fn block_hash(key: u64) -> [u8; 8] {
    (key + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes()
}

/// A small deterministic PRNG (xorshift64) for query selection.
pub struct XorShift(pub u64);

impl XorShift {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

fn replica_name(r: u64) -> String {
    format!("vllm-replica-{r}")
}

/// One per-block update: `blocks` block hashes starting at global block `first_key`.
pub fn chain_update(first_key: u64, blocks: u64, replica: u64) -> CacheStateUpdate {
    CacheStateUpdate {
        model_id: MODEL.into(),
        tenant_id: TENANT.into(),
        hash_scheme: SCHEME.into(),
        replica_id: replica_name(replica),
        prefixes: vec![PrefixEntry {
            block_hashes: (0..blocks)
                .map(|b| block_hash(first_key + b).to_vec())
                .collect(),
            block_token_counts: vec![BLOCK_TOKENS; blocks as usize],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// A built index and the facts needed to query it.
pub struct Built {
    pub ix: Index,
    pub chains: u64,
    /// A lookup time at which every entry is fresh (well inside the default 30 min TTL).
    pub now: i64,
}

/// Builds an uncapped index of about `entries` storage entries (rounded up to whole chains).
pub fn build_index(entries: u64) -> Built {
    let mut ix = Index::new(IndexConfig {
        max_entries: 0,
        ..IndexConfig::default()
    });
    let chains = entries.div_ceil(ENTRIES_PER_CHAIN).max(1);
    for c in 0..chains {
        let ts = T0 + c as i64 * 1000;
        let first = c * CHAIN_BLOCKS;
        ix.ingest(
            &chain_update(first, CHAIN_BLOCKS, c % REPLICAS),
            ts,
            &NoRules,
        );
        ix.ingest(
            &chain_update(first, CHAIN_BLOCKS / 2, (c + 1) % REPLICAS),
            ts,
            &NoRules,
        );
    }
    Built {
        ix,
        chains,
        now: T0 + chains as i64 * 1000 + 1_000_000,
    }
}

/// A chain lookup's wire inputs (owned, so a query set can be prepared before timing).
pub struct ChainQuery {
    pub hashes: Vec<Vec<u8>>,
    pub counts: Vec<i32>,
}

impl Built {
    /// `n` chain queries of the first `blocks` blocks of random stored chains (all hits).
    pub fn chain_queries(&self, blocks: u64, n: usize, seed: u64) -> Vec<ChainQuery> {
        let mut rng = XorShift(seed | 1);
        (0..n)
            .map(|_| {
                let c = rng.next() % self.chains;
                ChainQuery {
                    hashes: (0..blocks)
                        .map(|b| block_hash(c * CHAIN_BLOCKS + b).to_vec())
                        .collect(),
                    counts: vec![BLOCK_TOKENS; blocks as usize],
                }
            })
            .collect()
    }

    /// `n` chain queries of `blocks` blocks that are not in the index (miss classifier path).
    pub fn miss_queries(&self, blocks: u64, n: usize) -> Vec<ChainQuery> {
        let base = (self.chains + 1) * CHAIN_BLOCKS;
        (0..n as u64)
            .map(|i| ChainQuery {
                hashes: (0..blocks)
                    .map(|b| block_hash(base + i * blocks + b).to_vec())
                    .collect(),
                counts: vec![BLOCK_TOKENS; blocks as usize],
            })
            .collect()
    }

    /// `n` exact-lookup keys (single block hashes of random stored blocks).
    pub fn exact_keys(&self, n: usize, seed: u64) -> Vec<[u8; 8]> {
        let mut rng = XorShift(seed | 1);
        (0..n)
            .map(|_| block_hash(rng.next() % (self.chains * CHAIN_BLOCKS)))
            .collect()
    }

    /// `LookupRoute` with a block chain; returns (strategy, number of scored replicas).
    #[inline]
    pub fn lookup_chain(&mut self, q: &ChainQuery) -> (Strategy, usize) {
        let lq = LookupQuery {
            tenant: TENANT,
            model: MODEL,
            hash_scheme: SCHEME,
            block_hashes: (&q.hashes).into(),
            block_token_counts: &q.counts,
            ..Default::default()
        };
        let v = self.ix.lookup_route(&lq, self.now, &NoRules);
        (v.strategy, v.scores.len())
    }

    /// `LookupRoute` with a single `prefix_hash` (exact match).
    #[inline]
    pub fn lookup_exact(&mut self, key: &[u8]) -> (Strategy, usize) {
        let lq = LookupQuery {
            tenant: TENANT,
            model: MODEL,
            hash_scheme: SCHEME,
            prefix_hash: key,
            token_count: BLOCK_TOKENS,
            ..Default::default()
        };
        let v = self.ix.lookup_route(&lq, self.now, &NoRules);
        (v.strategy, v.scores.len())
    }

    /// Updates that re-report stored chains (the common producer pattern: refreshes
    /// `last_seen`, no new entries): `n` updates of `blocks` blocks of random chains.
    pub fn refresh_updates(&self, blocks: u64, n: usize, seed: u64) -> Vec<CacheStateUpdate> {
        let mut rng = XorShift(seed | 1);
        (0..n)
            .map(|_| {
                let c = rng.next() % self.chains;
                chain_update(c * CHAIN_BLOCKS, blocks, c % REPLICAS)
            })
            .collect()
    }

    /// Caps the index at its current size, so every later new entry evicts one (LRU).
    pub fn cap_here(&mut self) {
        let n = self.ix.entry_count();
        self.ix.set_max_entries(n);
    }
}

/// A chain of `blocks` never-seen blocks for an index of `chains` chains, numbered by `serial`
/// (give each call a new one).
pub fn new_chain_update(chains: u64, serial: u64, blocks: u64) -> CacheStateUpdate {
    let first = (chains + 1_000_000 + serial) * CHAIN_BLOCKS;
    chain_update(first, blocks, serial % REPLICAS)
}

/// Deterministic token ids (a 128K vocabulary) for the fingerprint.
pub fn tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = XorShift(seed | 1);
    (0..n).map(|_| (rng.next() % 128_000) as u32).collect()
}

/// A policy store with `n` namespaces `tenant-0..n`, half of them LFU, all with a TTL, floors
/// and a lookup budget. Built from the decoded snapshot (`PolicyStore::from_snapshot`, the last
/// step of `parse_policy_body`) because 10K such policies exceed the 1 MiB `/policy` body cap.
pub fn policy_store(n: usize) -> PolicyStore {
    let policies = (0..n)
        .map(|i| PolicySpec {
            namespace: format!("tenant-{i}"),
            eviction_ttl_ns: 600_000_000_000,
            minimum_matched_tokens: 32,
            routing_floor_score: Some(0.2),
            lookup_timeout_ms: 5,
            eviction: if i % 2 == 0 { "lfu" } else { "lru" }.into(),
            ..Default::default()
        })
        .collect();
    PolicyStore::from_snapshot(PolicySnapshot {
        version: CURRENT_POLICY_VERSION,
        policies,
        tenants: Vec::new(),
    })
    .expect("valid policy snapshot")
}

/// The same kind of store through the server's full `/policy` body path (decode, version check,
/// normalisation), for sizes under the body cap.
pub fn policy_store_from_body(n: usize) -> PolicyStore {
    let mut body = String::from(r#"{"version":7,"policies":["#);
    for i in 0..n {
        if i > 0 {
            body.push(',');
        }
        let ev = if i % 2 == 0 { "lfu" } else { "lru" };
        body.push_str(&format!(
            r#"{{"namespace":"tenant-{i}","evictionTTL":600000000000,"minimumMatchedTokens":32,"routingFloorScore":0.2,"lookupTimeoutMs":5,"eviction":"{ev}"}}"#
        ));
    }
    body.push_str("]}");
    parse_policy_body(body.as_bytes()).expect("valid policy body")
}
