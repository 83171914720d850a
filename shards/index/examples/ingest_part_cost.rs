//! What one part of a large ReportCacheState message costs its core (issue 30: no step over a
//! slice): the thread CPU of one `Index::ingest_part_within` for a part of 4,096 legacy prefixes
//! in one adapter, and for a message of 4,096 new adapters (a name and a keyspace each) in one
//! part (no budget) and in parts of the server's `INGEST_PART_BLOCKS` (4,096) with each
//! creation counting W blocks (`INGEST_PART_BLOCKS_PER_CREATED`), for a few W, and with the
//! server's 250 µs deadline per part (`INGEST_PART_BUDGET`).
//!
//! `cargo run --release -p inferencecache-index --example ingest_part_cost [-- ROUNDS]`
//! (default 20 rounds per shape, each into a fresh `(tenant, model)` of an index that already
//! holds 200,000 entries; the server's allocator, transparent huge pages off as in the server).

use std::time::{Duration, Instant};

use inferencecache_index::index::{Admission, Index, IndexConfig, PartBudget};
use inferencecache_index::rules::{Eviction, TenantRules};
use inferencecache_proto::v1alpha1::{CacheStateUpdate, PrefixEntry};

/// The server's allocator (src/main.rs), so the parts pay what they pay in the server.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SEC: i64 = 1_000_000_000;
const NOW: i64 = 1_700_000_000 * SEC;
const PART: usize = 4_096;

struct Lru;

impl TenantRules for Lru {
    fn ttl_ns(&self, _: &str) -> i64 {
        0
    }
    fn eviction(&self, _: &str) -> Eviction {
        Eviction::Lru
    }
    fn quota(&self, _: &str) -> Option<u64> {
        None
    }
}

/// This thread's CPU time (Linux `CLOCK_THREAD_CPUTIME_ID`).
fn thread_cpu() -> Duration {
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    unsafe extern "C" {
        fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut ts = Timespec { sec: 0, nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into the valid local `ts`.
    unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.sec as u64, ts.nsec as u32)
}

/// `n` legacy prefixes of `tenant`, each in adapter `a<i>` when `adapters`, else in none.
fn update(tenant: &str, n: usize, adapters: bool) -> CacheStateUpdate {
    CacheStateUpdate {
        replica_id: "r0".into(),
        model_id: "m".into(),
        tenant_id: tenant.into(),
        hash_scheme: "vllm".into(),
        timestamp_us: NOW / 1_000,
        prefixes: (0..n)
            .map(|i| PrefixEntry {
                prefix_hash: (i as u64).to_be_bytes().to_vec(),
                token_count: 16,
                adapter_id: if adapters {
                    format!("a{i}")
                } else {
                    String::new()
                },
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// An index holding `entries` entries of another tenant.
fn filled(entries: usize) -> Index {
    let mut ix = Index::new(IndexConfig::default());
    let mut start = 0;
    while start < entries {
        let mut u = update("filler", PART, false);
        for (i, p) in u.prefixes.iter_mut().enumerate() {
            p.prefix_hash = ((start + i) as u64).to_be_bytes().to_vec();
        }
        ix.ingest(&u, NOW, &Lru);
        start += PART;
    }
    ix
}

/// Applies `u` in parts, each within the budget `budget()` makes; returns each part's thread
/// CPU.
fn parts(ix: &mut Index, u: &CacheStateUpdate, budget: impl Fn() -> PartBudget) -> Vec<Duration> {
    let (mut start, mut times) = (0, Vec::new());
    while start < u.prefixes.len() {
        let before = thread_cpu();
        let (out, end) = ix.ingest_part_within(u, start..u.prefixes.len(), budget(), NOW, &Lru);
        times.push(thread_cpu() - before);
        assert!(!out.rejected_keyspaces_full && !out.rejected_string_table_full);
        start = end;
    }
    times
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// As the server does (src/sys/memory.rs), unless `MIMALLOC_ALLOW_THP` is set: no transparent
/// huge pages, whose 2 MiB first-touch faults cost milliseconds of system time inside one part.
fn no_transparent_huge_pages() {
    unsafe extern "C" {
        fn prctl(option: i32, a: u64, b: u64, c: u64, d: u64) -> i32;
    }
    const PR_SET_THP_DISABLE: i32 = 41;
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        // SAFETY: PR_SET_THP_DISABLE sets one flag of this process's memory descriptor.
        unsafe { prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) };
    }
}

fn main() {
    no_transparent_huge_pages();
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(20, |a| a.parse().expect("ROUNDS"));
    let mut ix = filled(200_000);
    println!("shape | parts per message (most) | part CPU median (us) | part CPU max (us)");
    let shapes: [(&str, bool, Budget); 7] = [
        (
            "4,096 legacy prefixes, one part",
            false,
            (usize::MAX, 0, false),
        ),
        ("4,096 legacy prefixes, 250 us", false, (PART, 0, true)),
        ("4,096 new adapters, one part", true, (usize::MAX, 0, false)),
        ("4,096 new adapters, W = 1", true, (PART, 1, false)),
        ("4,096 new adapters, W = 2", true, (PART, 2, false)),
        ("4,096 new adapters, W = 8", true, (PART, 8, false)),
        (
            "4,096 new adapters, W = 8, 250 us (the server)",
            true,
            (PART, 8, true),
        ),
    ];
    for (round_set, (name, adapters, budget)) in shapes.into_iter().enumerate() {
        let mut all = Vec::new();
        let mut per_message = 0;
        for round in 0..rounds {
            let u = update(&format!("t{round_set}-{round}"), PART, adapters);
            let times = parts(&mut ix, &u, || part_budget(budget));
            per_message = per_message.max(times.len());
            all.extend(times);
        }
        all.sort();
        println!(
            "{name} | {per_message} | {:.0} | {:.0}",
            us(all[all.len() / 2]),
            us(*all.last().expect("a part"))
        );
    }
    for n in [PART, 65_536, 262_144] {
        refused_at_keyspace_limit(&mut ix, n, rounds);
    }
}

/// Messages of `n` adapters into a `(tenant, model)` already at its keyspace limit, the last of
/// them new (so the index must look each up, then refuses the message whole,
/// `KEYSPACES_FULL`), checked in steps as the server does (`Index::ingest_part_admitted`, the
/// server's budget): each step's thread CPU, median and max over `rounds`, and the most steps
/// one message took.
fn refused_at_keyspace_limit(ix: &mut Index, n: usize, rounds: usize) {
    let full = update("at-limit", PART, true);
    ix.ingest(&full, NOW, &Lru);
    let mut times = Vec::new();
    let mut most = 0;
    for round in 0..rounds {
        let mut u = update("at-limit", n, true);
        for (i, p) in u.prefixes.iter_mut().enumerate() {
            p.adapter_id = format!("a{}", i % PART);
        }
        u.prefixes.last_mut().expect("a prefix").adapter_id = format!("new-{round}");
        let mut admission = Admission::default();
        let mut steps = 0;
        loop {
            let before = thread_cpu();
            let (out, _) = ix.ingest_part_admitted(
                &u,
                0..u.prefixes.len(),
                part_budget((PART, 8, true)),
                &mut admission,
                NOW,
                &Lru,
            );
            times.push(thread_cpu() - before);
            steps += 1;
            if !out.admission_pending {
                assert!(out.rejected_keyspaces_full);
                break;
            }
        }
        most = most.max(steps);
    }
    times.sort();
    println!(
        "{n} adapters refused at the keyspace limit, in steps | {most} | {:.0} | {:.0}",
        us(times[times.len() / 2]),
        us(*times.last().expect("a step"))
    );
}

/// Blocks per part, blocks per creation, and whether a part ends after 250 µs.
type Budget = (usize, usize, bool);

fn part_budget((blocks, blocks_per_created, timed): Budget) -> PartBudget {
    PartBudget {
        blocks,
        blocks_per_created,
        deadline: timed.then(|| Instant::now() + Duration::from_micros(250)),
    }
}
