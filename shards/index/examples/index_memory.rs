//! Memory per storage entry of one core's index (docs/ARCHITECTURE.md §3 target: < 48 bytes).
//!
//! Builds `N` storage entries (default 1,000,000) from realistic chain ingests (64 blocks of
//! 8-byte hashes per update, 16 replicas, one tenant/model/scheme) and reports live heap bytes
//! per entry from a counting global allocator, plus the RSS growth.
//!
//! `cargo run --release -p inferencecache-index --example index_memory -- [N] [holders-per-key]`

use inferencecache_index::index::{Index, IndexConfig, LookupQuery, Strategy};
use inferencecache_index::rules::NoRules;
use inferencecache_proto::v1alpha1::{CacheStateUpdate, PrefixEntry};
use std::sync::atomic::Ordering;

#[path = "common/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::LIVE;

fn rss_bytes() -> usize {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = s
        .split_whitespace()
        .nth(1)
        .and_then(|x| x.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// Nanoseconds this thread has spent on a CPU (first field of schedstat); wall-clock times are
/// unreliable on a shared, overloaded machine.
fn cpu_ns() -> u64 {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    s.split_whitespace()
        .next()
        .and_then(|x| x.parse().ok())
        .unwrap_or(0)
}

const BLOCKS: u64 = 64;
const REPLICAS: u64 = 16;
const TENANT: &str = "team-a";
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const SCHEME: &str = "vllm";

/// The 8-byte wire hash of block number `b` (distinct per block, spread over the table).
fn block_hash(b: u64) -> [u8; 8] {
    b.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes()
}

/// A chain entry of blocks `first..first + n`, 16 tokens each.
fn chain_entry(first: u64, n: u64) -> PrefixEntry {
    PrefixEntry {
        block_hashes: (0..n).map(|b| block_hash(first + b).to_vec()).collect(),
        block_token_counts: vec![16; n as usize],
        ..Default::default()
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: u64 = args
        .get(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let holders: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(1).max(1);

    let mut ix = Index::new(IndexConfig {
        max_entries: 0,
        ..IndexConfig::default()
    });
    let now = 1_700_000_000_000_000_000i64;
    let mut upd = CacheStateUpdate {
        model_id: MODEL.into(),
        tenant_id: TENANT.into(),
        hash_scheme: SCHEME.into(),
        ..Default::default()
    };
    let keys = n / holders;
    let entries = fill(&mut ix, &mut upd, keys, holders, now);
    measure_lookups(&mut ix, keys, now);
    measure_ingest_at_cap(&mut ix, &mut upd, keys, entries, now);
}

/// Ingests `keys` prefix keys as 64-block chains, each chain held by `holders` replicas, and
/// prints heap and RSS per storage entry and the ingest cost. Returns the entry count.
fn fill(ix: &mut Index, upd: &mut CacheStateUpdate, keys: u64, holders: u64, now: i64) -> u64 {
    let live0 = LIVE.load(Ordering::Relaxed);
    let rss0 = rss_bytes();
    let mut key = 0u64;
    let mut chain_no = 0u64;
    let t = std::time::Instant::now();
    let c0 = cpu_ns();
    while key < keys {
        let blocks = BLOCKS.min(keys - key);
        upd.prefixes = vec![chain_entry(key, blocks)];
        for h in 0..holders {
            upd.replica_id = format!("vllm-replica-{}", (chain_no + h) % REPLICAS);
            ix.ingest(upd, now + key as i64, &NoRules);
        }
        key += blocks;
        chain_no += 1;
    }
    let elapsed = t.elapsed();
    let cpu = cpu_ns() - c0;
    upd.prefixes.clear();
    let entries = ix.entry_count();
    let live = LIVE.load(Ordering::Relaxed) - live0;
    let rss = rss_bytes().saturating_sub(rss0);
    println!(
        "entries={entries} keys={} holders/key={holders} heap_bytes={live} heap_bytes/entry={:.1} rss_growth/entry={:.1} ingest={:.0}ns/entry (on-cpu {:.0}ns/entry)",
        ix.key_count(),
        live as f64 / entries as f64,
        rss as f64 / entries as f64,
        elapsed.as_nanos() as f64 / entries as f64,
        cpu as f64 / entries as f64
    );
    entries
}

/// Lookup latency: full 64-block chain lookups of stored chains (steady state, no allocation).
fn measure_lookups(ix: &mut Index, keys: u64, now: i64) {
    let chains = (keys / BLOCKS).max(1);
    let mut lat = Vec::with_capacity(20_000);
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut hashes: Vec<Vec<u8>> = vec![Vec::new(); BLOCKS as usize];
    let counts = vec![16i32; BLOCKS as usize];
    for _ in 0..20_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let c = x % chains;
        let n = BLOCKS.min(keys - c * BLOCKS) as usize;
        for (b, h) in hashes.iter_mut().enumerate().take(n) {
            h.clear();
            h.extend_from_slice(&block_hash(c * BLOCKS + b as u64));
        }
        let q = LookupQuery {
            tenant: TENANT,
            model: MODEL,
            hash_scheme: SCHEME,
            block_hashes: hashes[..n].into(),
            block_token_counts: &counts[..n],
            ..Default::default()
        };
        let t = std::time::Instant::now();
        let v = ix.lookup_route(&q, now + n as i64 * 1000, &NoRules);
        let d = t.elapsed().as_nanos() as u64;
        assert_eq!(v.strategy, Strategy::PrefixMatch);
        lat.push(d);
    }
    lat.sort_unstable();
    println!(
        "chain lookup (64 blocks): p50={:.2}us p99={:.2}us max={:.2}us",
        lat[lat.len() / 2] as f64 / 1e3,
        lat[lat.len() * 99 / 100] as f64 / 1e3,
        *lat.last().unwrap() as f64 / 1e3
    );
}

/// Steady state at the global cap: every new block evicts the oldest entry.
fn measure_ingest_at_cap(
    ix: &mut Index,
    upd: &mut CacheStateUpdate,
    keys: u64,
    entries: u64,
    now: i64,
) {
    ix.set_max_entries(ix.entry_count());
    let extra = (keys / 4).max(BLOCKS);
    let mut evicted = 0;
    let t = std::time::Instant::now();
    let c0 = cpu_ns();
    let mut k = keys;
    while k < keys + extra {
        upd.prefixes = vec![chain_entry(k, BLOCKS)];
        upd.replica_id = format!("vllm-replica-{}", k % REPLICAS);
        evicted += ix.ingest(upd, now + k as i64, &NoRules).cap_evicted.total();
        k += BLOCKS;
    }
    let el = t.elapsed();
    let cpu = cpu_ns() - c0;
    assert!(ix.entry_count() <= entries);
    println!(
        "ingest at cap: {:.0}ns/entry (on-cpu {:.0}ns/entry, {} evictions)",
        el.as_nanos() as f64 / (k - keys) as f64,
        cpu as f64 / (k - keys) as f64,
        evicted
    );
}
