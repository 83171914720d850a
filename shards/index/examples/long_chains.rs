//! Long-chain lookups (issue 31, item 6): the synthetic fleet of the peer comparison, in process.
//!
//! 64 workers, 2,000 conversations; conversation `c` starts with system prompt `c % 8` (the
//! first eighth of its blocks, shared by every conversation with that prompt, so each prompt's
//! blocks are held by nearly every worker) followed by its own blocks. Worker `w` holds the
//! full chains of conversations `(w + 64 j) % 2000` for `j < 40` (2,560 chains; the first 560
//! conversations are held twice). Then 20,000 full-chain lookups of random conversations.
//! Hashes are 8-byte prefix hashes (a block's hash names its whole prefix).
//!
//! Reports, per chain length: store ns/block (ingest of all chains, one update per chain),
//! lookup p50/p99 µs (wall clock per `lookup_route`), live heap bytes per block-hold (a
//! counting allocator; block-holds = the index's (block, worker) entries) and a digest of every answer, so two
//! builds can be checked for identical answers.
//!
//! `taskset -c 1 long_chains [blocks...] [--reps N]` (default blocks 32 256 750, 3 reps; the
//! medians of the reps are printed last).

use inferencecache_index::index::{Index, IndexConfig, LookupQuery, Strategy};
use inferencecache_index::rules::NoRules;
use inferencecache_proto::v1alpha1::{CacheStateUpdate, PrefixEntry};
use std::hash::{Hash, Hasher};
use std::sync::atomic::Ordering;
use std::time::Instant;

#[path = "common/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::LIVE;

const WORKERS: u64 = 64;
const CONVERSATIONS: u64 = 2_000;
const CHAINS_PER_WORKER: u64 = 40;
const PROMPTS: u64 = 8;
const LOOKUPS: usize = 20_000;
const BLOCK_TOKENS: i32 = 16;
const TENANT: &str = "team-a";
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const SCHEME: &str = "vllm";
const T0: i64 = 1_700_000_000_000_000_000;

/// A bijective mix, so distinct block identities never collide.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The block hashes of conversation `c`'s full chain of `blocks` blocks.
fn chain(c: u64, blocks: u64) -> Vec<[u8; 8]> {
    let prompt_len = (blocks / 8).max(1);
    (0..blocks)
        .map(|b| {
            let id = if b < prompt_len {
                (1 << 62) | (c % PROMPTS) << 20 | b
            } else {
                (2 << 62) | c << 20 | b
            };
            mix(id).to_be_bytes()
        })
        .collect()
}

/// One measurement of one chain length.
struct Sample {
    store_ns_per_block: f64,
    p50_us: f64,
    p99_us: f64,
    bytes_per_hold: f64,
    digest: u64,
}

fn run(blocks: u64) -> Sample {
    let mut ix = Index::new(IndexConfig {
        max_entries: 0,
        ..IndexConfig::default()
    });
    let chains: Vec<Vec<[u8; 8]>> = (0..CONVERSATIONS).map(|c| chain(c, blocks)).collect();
    // The updates are built before the clock and the heap count start.
    let mut updates = Vec::new();
    for j in 0..CHAINS_PER_WORKER {
        for w in 0..WORKERS {
            let c = (w + WORKERS * j) % CONVERSATIONS;
            updates.push(CacheStateUpdate {
                model_id: MODEL.into(),
                tenant_id: TENANT.into(),
                hash_scheme: SCHEME.into(),
                replica_id: format!("worker-{w}"),
                prefixes: vec![PrefixEntry {
                    block_hashes: chains[c as usize].iter().map(|h| h.to_vec()).collect(),
                    block_token_counts: vec![BLOCK_TOKENS; blocks as usize],
                    ..Default::default()
                }],
                ..Default::default()
            });
        }
    }
    let stored_blocks = updates.len() as u64 * blocks;
    let live0 = LIVE.load(Ordering::Relaxed);
    let t = Instant::now();
    for (i, u) in updates.iter().enumerate() {
        ix.ingest(u, T0 + i as i64 * 1_000, &NoRules);
    }
    let store_ns = t.elapsed().as_nanos() as f64;
    let heap = LIVE.load(Ordering::Relaxed) - live0;
    drop(updates);
    // A worker holding two conversations of one prompt holds the prompt's blocks once.
    let holds = ix.entry_count();

    let now = T0 + 1_000_000_000;
    let counts = vec![BLOCK_TOKENS; blocks as usize];
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut lat = Vec::with_capacity(LOOKUPS);
    let mut digest = std::collections::hash_map::DefaultHasher::new();
    for _ in 0..LOOKUPS {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let c = x % CONVERSATIONS;
        let q = LookupQuery {
            tenant: TENANT,
            model: MODEL,
            hash_scheme: SCHEME,
            block_hashes: chains[c as usize][..].into(),
            block_token_counts: &counts,
            ..Default::default()
        };
        let t = Instant::now();
        let v = ix.lookup_route(&q, now, &NoRules);
        lat.push(t.elapsed().as_nanos() as u64);
        assert_eq!(v.strategy, Strategy::PrefixMatch);
        for s in v.scores {
            v.replica_id(s).hash(&mut digest);
            s.score.to_bits().hash(&mut digest);
            s.matched_tokens.hash(&mut digest);
            s.estimated_cache_hit_prob.to_bits().hash(&mut digest);
            s.tier.hash(&mut digest);
        }
    }
    lat.sort_unstable();
    Sample {
        store_ns_per_block: store_ns / stored_blocks as f64,
        p50_us: lat[lat.len() / 2] as f64 / 1e3,
        p99_us: lat[lat.len() * 99 / 100] as f64 / 1e3,
        bytes_per_hold: heap as f64 / holds as f64,
        digest: digest.finish(),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut lens = Vec::new();
    let mut reps = 3usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--reps" {
            reps = args.next().and_then(|r| r.parse().ok()).unwrap_or(3).max(1);
        } else if let Ok(n) = a.parse::<u64>() {
            lens.push(n.max(2));
        }
    }
    if lens.is_empty() {
        lens = vec![32, 256, 750];
    }
    let mut table = Vec::new();
    for &blocks in &lens {
        let samples: Vec<Sample> = (0..reps).map(|_| run(blocks)).collect();
        for s in &samples {
            println!(
                "rep blocks={blocks} store_ns/block={:.1} p50_us={:.2} p99_us={:.2} bytes/hold={:.1} digest={:016x}",
                s.store_ns_per_block, s.p50_us, s.p99_us, s.bytes_per_hold, s.digest
            );
        }
        assert!(
            samples.iter().all(|s| s.digest == samples[0].digest),
            "answers differ between repetitions"
        );
        let col = |f: fn(&Sample) -> f64| median(samples.iter().map(f).collect());
        table.push((
            blocks,
            col(|s| s.store_ns_per_block),
            col(|s| s.p50_us),
            col(|s| s.p99_us),
            col(|s| s.bytes_per_hold),
            samples[0].digest,
        ));
    }
    println!(
        "| blocks | store ns/block | lookup p50 µs | p99 µs | bytes per block-hold | answers digest |"
    );
    println!("|---|---|---|---|---|---|");
    for (b, st, p50, p99, bytes, d) in table {
        println!("| {b} | {st:.1} | {p50:.2} | {p99:.2} | {bytes:.1} | {d:016x} |");
    }
}
