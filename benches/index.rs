//! Criterion benches of one core's index (no I/O, no runtime): chain and exact `LookupRoute`
//! on 100K / 1M / 10M entry indexes, per-block ingest, the block
//! fingerprint and policy resolution. Index shape: `benches/common/mod.rs`.
//!
//! `cargo bench --bench index` (~75 s on the 2-vCPU box, peak RSS ~430 MB with the 10M-entry
//! index, which builds in ~2.5 s; `BENCH_LARGE=0` skips the 10M size). Filter with the usual criterion argument, e.g.
//! `cargo bench --bench index -- lookup_1m`. Results and commands: perf/RESULTS.md.

mod common;

use common::{Built, build_index};
use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use inferencecache_index::fingerprint;
use inferencecache_index::index::Strategy;
use inferencecache_index::rules::NoRules;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// Distinct prepared queries cycled through per bench (covers many chains, defeats caching of
/// a single path without making query preparation part of the measurement).
const QUERIES: usize = 4096;

fn quick(g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    g.sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
}

fn label(n: u64) -> String {
    match n {
        n if n >= 1_000_000 => format!("{}m", n / 1_000_000),
        n => format!("{}k", n / 1_000),
    }
}

fn sizes() -> Vec<u64> {
    let mut v = vec![100_000, 1_000_000];
    if std::env::var_os("BENCH_LARGE").is_none_or(|x| x != "0") {
        v.push(10_000_000);
    }
    v
}

fn build(n: u64) -> Built {
    let t = Instant::now();
    let b = build_index(n);
    eprintln!(
        "built {} index: {} entries, {} keys, {} chains in {:.2?}",
        label(n),
        b.ix.entry_count(),
        b.ix.key_count(),
        b.chains,
        t.elapsed()
    );
    b
}

fn lookups(c: &mut Criterion) {
    for n in sizes() {
        let mut b = build(n);
        let mut g = c.benchmark_group(format!("lookup_{}", label(n)));
        quick(&mut g);
        g.throughput(Throughput::Elements(1));
        for blocks in [16u64, 64, 256] {
            let qs = b.chain_queries(blocks, QUERIES, 0x5eed + blocks);
            assert_eq!(b.lookup_chain(&qs[0]), (Strategy::PrefixMatch, 2));
            g.bench_function(BenchmarkId::new("chain_blocks", blocks), |bn| {
                let mut i = 0;
                bn.iter(|| {
                    i = (i + 1) % QUERIES;
                    black_box(b.lookup_chain(&qs[i]))
                })
            });
        }
        let keys = b.exact_keys(QUERIES, 0xe4ac7);
        assert_eq!(b.lookup_exact(&keys[0]).0, Strategy::PrefixMatch);
        g.bench_function("exact", |bn| {
            let mut i = 0;
            bn.iter(|| {
                i = (i + 1) % QUERIES;
                black_box(b.lookup_exact(&keys[i]))
            })
        });
        let miss = b.miss_queries(64, QUERIES);
        assert_eq!(b.lookup_chain(&miss[0]).1, 0);
        g.bench_function("chain_miss_64", |bn| {
            let mut i = 0;
            bn.iter(|| {
                i = (i + 1) % QUERIES;
                black_box(b.lookup_chain(&miss[i]))
            })
        });
        g.finish();
    }
}

fn ingest(c: &mut Criterion) {
    let mut b = build(1_000_000);
    let mut g = c.benchmark_group("ingest_1m");
    quick(&mut g);
    g.throughput(Throughput::Elements(64));
    // Re-report of 64 stored blocks (same replica): refreshes last_seen, no new entries.
    let ups = b.refresh_updates(64, QUERIES, 0x1a9e);
    g.bench_function("refresh_64_blocks", |bn| {
        let mut i = 0;
        bn.iter(|| {
            i = (i + 1) % QUERIES;
            black_box(b.ix.ingest(&ups[i], b.now, &NoRules).upserts)
        })
    });
    // 64 new blocks into a full index: every entry evicts the LRU victim (steady state at the
    // global cap). The update is built outside the timed region.
    b.cap_here();
    let (chains, mut serial) = (b.chains, 0u64);
    g.bench_function("new_64_blocks_at_cap", |bn| {
        bn.iter_batched_ref(
            || {
                serial += 1;
                common::new_chain_update(chains, serial, 64)
            },
            |u| black_box(b.ix.ingest(u, b.now, &NoRules).cap_evicted.total()),
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

fn fingerprints(c: &mut Criterion) {
    let mut g = c.benchmark_group("fingerprint");
    quick(&mut g);
    for n in [1024usize, 16 * 1024] {
        let toks = common::tokens(n, 0x70c5);
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(BenchmarkId::new("chain_tokens", n), |bn| {
            bn.iter(|| black_box(fingerprint::chain(black_box(&toks), common::BLOCK_TOKENS)))
        });
    }
    g.finish();
}

fn policy(c: &mut Criterion) {
    let mut g = c.benchmark_group("policy_resolve");
    quick(&mut g);
    g.throughput(Throughput::Elements(1));
    // The direct snapshot build equals the server's `/policy` body path.
    assert_eq!(
        common::policy_store(100).resolve("tenant-50"),
        common::policy_store_from_body(100).resolve("tenant-50")
    );
    for n in [0usize, 100, 10_000] {
        let store = common::policy_store(n);
        let hit = format!("tenant-{}", n / 2);
        g.bench_function(BenchmarkId::new("hit", n), |bn| {
            bn.iter(|| black_box(store.resolve(black_box(&hit))))
        });
        g.bench_function(BenchmarkId::new("miss", n), |bn| {
            bn.iter(|| black_box(store.resolve(black_box("tenant-not-installed"))))
        });
    }
    g.finish();
}

criterion_group!(benches, lookups, ingest, fingerprints, policy);
criterion_main!(benches);
