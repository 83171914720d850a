//! What one core's index maintenance costs in one step at N entries (issue 14: "no lookup waits
//! more than 1 ms behind index maintenance"): the one-call TTL sweep against the sliced one
//! (0.5 ms / 16,384-entry slices, the server's limits), with nothing and with half the entries
//! expiring, and the first cap-candidate build (an O(entries) scan): in one go (what the ingest
//! that first pushes the index over `--index-max-entries` runs when no build is ready) and ahead
//! of need in the server's slices (`Index::cap_prebuild_step`, 0.5 ms / 16,384 entries).
//!
//! `cargo run --release -p inferencecache-index --example sweep_cost -- [N]` (default 10,000,000)
//!
//! Slice times are wall clock: on a loaded shared machine the longest includes time the OS ran
//! something else (the server's `inferencecache_core_sweep_last_max_slice_cpu_seconds` reads
//! the thread's CPU clock).
//!
//! Entries: 64-block chains (8-byte hashes) over 8 tenants × 8 models × 4 replicas, one holder per
//! key, like loadgen's `fill`. Tenants t0..t3 have a 10-minute TTL and are stamped 20 minutes
//! before the sweep's `now` when "half expiring", t4..t7 the default 30 minutes.

use std::time::{Duration, Instant};

use inferencecache_index::index::{Index, IndexConfig, SweepBudget};
use inferencecache_index::rules::{Eviction, TenantRules};
use inferencecache_proto::v1alpha1::{CacheStateUpdate, PrefixEntry};

const SEC: i64 = 1_000_000_000;
const MIN: i64 = 60 * SEC;
const NOW: i64 = 1_700_000_000 * SEC;
const BLOCKS: usize = 64;

struct Ttl;

impl TenantRules for Ttl {
    fn ttl_ns(&self, tenant: &str) -> i64 {
        if ["t0", "t1", "t2", "t3"].contains(&tenant) {
            10 * MIN
        } else {
            0
        }
    }
    fn eviction(&self, _: &str) -> Eviction {
        Eviction::Lru
    }
    fn quota(&self, _: &str) -> Option<u64> {
        None
    }
}

/// An index of `n` entries, and the longest single ingest that filled it (its key table grows
/// on the way).
fn build(n: usize, old_stamp: bool) -> (Index, Duration) {
    let mut longest = Duration::ZERO;
    let mut ix = Index::new(IndexConfig {
        max_entries: 0,
        ..IndexConfig::default()
    });
    for c in 0..n / BLOCKS {
        let tenant = c % 8;
        let ts = if old_stamp && tenant < 4 {
            NOW - 20 * MIN
        } else {
            NOW - MIN
        };
        let u = CacheStateUpdate {
            replica_id: format!("r{}", c % 4),
            tenant_id: format!("t{tenant}"),
            model_id: format!("m{}", (c / 8) % 8),
            hash_scheme: "vllm".into(),
            timestamp_us: ts / 1000,
            prefixes: vec![PrefixEntry {
                block_hashes: (0..BLOCKS)
                    .map(|b| ((c as u64) << 16 | b as u64).to_be_bytes().to_vec())
                    .collect(),
                block_token_counts: vec![16; BLOCKS],
                ..Default::default()
            }],
            ..Default::default()
        };
        let t = Instant::now();
        ix.ingest(&u, NOW - MIN, &Ttl);
        longest = longest.max(t.elapsed());
    }
    (ix, longest)
}

fn one_call(ix: &mut Index, label: &str) {
    let t = Instant::now();
    let out = ix.sweep(NOW, &Ttl);
    println!(
        "{label:<34} one call: {:>8.1} ms, removed {}",
        t.elapsed().as_secs_f64() * 1e3,
        out.ttl_evicted.total()
    );
}

fn sliced(ix: &mut Index, label: &str) {
    let t = Instant::now();
    ix.sweep_begin(NOW);
    let (mut slices, mut longest, mut busy) = (0u64, Duration::ZERO, Duration::ZERO);
    let mut longest_at = 0u64;
    let removed = loop {
        let s = Instant::now();
        let step = ix.sweep_step(
            &Ttl,
            SweepBudget {
                max_entries: 16_384,
                deadline: Some(s + Duration::from_micros(500)),
            },
        );
        let took = s.elapsed();
        if took > longest {
            (longest, longest_at) = (took, slices);
        }
        busy += took;
        slices += 1;
        if let Some(out) = step.finished {
            println!(
                "{label:<34} last slice (stats rows, reclaim pass): {:.3} ms",
                took.as_secs_f64() * 1e3
            );
            break out.ttl_evicted.total();
        }
    };
    println!(
        "{label:<34} sliced:   {:>8.1} ms in {slices} slices (work {:.1} ms), longest slice {:.3} ms wall (#{longest_at}), removed {removed}",
        t.elapsed().as_secs_f64() * 1e3,
        busy.as_secs_f64() * 1e3,
        longest.as_secs_f64() * 1e3
    );
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("N"))
        .unwrap_or(10_000_000);
    let t = Instant::now();
    let (mut ix, longest) = build(n, false);
    println!(
        "built {} entries in {:.1} s, longest ingest {:.3} ms",
        ix.entry_count(),
        t.elapsed().as_secs_f64(),
        longest.as_secs_f64() * 1e3
    );
    one_call(&mut ix, "nothing expiring");
    sliced(&mut ix, "nothing expiring");
    let t = Instant::now();
    let c = ix.cap_candidates(1, &Ttl);
    println!(
        "first cap-candidate build (scan):  {:>8.1} ms ({} candidate, one go)",
        t.elapsed().as_secs_f64() * 1e3,
        c.len()
    );
    // The same build ahead of need, in slices (a cap at the current size makes it wanted; a
    // policy change drops the heap just built).
    ix.take_cap_sync_builds();
    ix.rules_changed();
    ix.set_max_entries(ix.entry_count());
    let t = Instant::now();
    let (mut slices, mut longest, mut busy) = (0u64, Duration::ZERO, Duration::ZERO);
    loop {
        let s = Instant::now();
        let step = ix.cap_prebuild_step(SweepBudget {
            max_entries: 16_384,
            deadline: Some(s + Duration::from_micros(500)),
        });
        let took = s.elapsed();
        longest = longest.max(took);
        busy += took;
        slices += 1;
        if !step.in_progress {
            assert!(step.finished);
            break;
        }
    }
    let wall = t.elapsed();
    let t = Instant::now();
    let c = ix.cap_candidates(1, &Ttl);
    println!(
        "cap-candidate build ahead of need:  {:>8.1} ms in {slices} slices (work {:.1} ms), longest slice {:.3} ms wall; then the first pop {:.3} ms ({} candidate, {} built in one go)",
        wall.as_secs_f64() * 1e3,
        busy.as_secs_f64() * 1e3,
        longest.as_secs_f64() * 1e3,
        t.elapsed().as_secs_f64() * 1e3,
        c.len(),
        ix.take_cap_sync_builds()
    );
    // Steady eviction at the cap: fresh 64-entry ingests (each evicts 64 old entries), one
    // build slice after each, as the server interleaves them.
    let t = Instant::now();
    let (mut slices, mut longest, mut builds, mut longest_ingest) =
        (0u64, Duration::ZERO, 0u64, Duration::ZERO);
    ix.take_cap_max_stale_pops();
    let chains = ix.entry_count() as usize / BLOCKS;
    for c in 0..chains / 2 {
        let u = CacheStateUpdate {
            replica_id: "r9".into(),
            tenant_id: format!("t{}", c % 8),
            model_id: "m9".into(),
            hash_scheme: "vllm".into(),
            timestamp_us: NOW / 1000,
            prefixes: vec![PrefixEntry {
                block_hashes: (0..BLOCKS)
                    .map(|b| {
                        ((1u64 << 40 | c as u64) << 16 | b as u64)
                            .to_be_bytes()
                            .to_vec()
                    })
                    .collect(),
                block_token_counts: vec![16; BLOCKS],
                ..Default::default()
            }],
            ..Default::default()
        };
        let s = Instant::now();
        ix.ingest(&u, NOW, &Ttl);
        longest_ingest = longest_ingest.max(s.elapsed());
        let s = Instant::now();
        let step = ix.cap_prebuild_step(SweepBudget {
            max_entries: 16_384,
            deadline: Some(s + Duration::from_micros(500)),
        });
        if step.entries > 0 {
            slices += 1;
            longest = longest.max(s.elapsed());
        }
        builds += step.finished as u64;
    }
    println!(
        "steady eviction, {} ingests at the cap: {:.1} s, {builds} builds ahead in {slices} slices, longest slice {:.3} ms, longest ingest {:.3} ms, {} built in one go, at most {} stale snapshots in one pop",
        chains / 2,
        t.elapsed().as_secs_f64(),
        longest.as_secs_f64() * 1e3,
        longest_ingest.as_secs_f64() * 1e3,
        ix.take_cap_sync_builds(),
        ix.take_cap_max_stale_pops()
    );
    drop(ix);
    let (mut ix, _) = build(n, true);
    sliced(&mut ix, "half expiring");
    drop(ix);
    let (mut ix, _) = build(n, true);
    one_call(&mut ix, "half expiring");
}
