//! What one core's index maintenance costs in one step at N entries (the bar: "no lookup waits
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
//! the thread's CPU clock). Ingests and the steady-eviction slices also report the longest on
//! this thread's CPU clock (Linux), which excludes that.
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

/// This thread's CPU time (Linux `CLOCK_THREAD_CPUTIME_ID`; zero elsewhere).
fn thread_cpu() -> Duration {
    #[cfg(target_os = "linux")]
    {
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
        // SAFETY: `ts` is a valid, writable timespec for the call's duration.
        if unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0 {
            return Duration::new(ts.sec as u64, ts.nsec as u32);
        }
    }
    Duration::ZERO
}

/// The longest of some operations, on the wall clock and on this thread's CPU clock.
#[derive(Default)]
struct Longest {
    wall: Duration,
    cpu: Duration,
}

impl Longest {
    /// Runs `f`, keeping its times if longest.
    fn time<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let (w, c) = (Instant::now(), thread_cpu());
        let r = f();
        self.cpu = self.cpu.max(thread_cpu().saturating_sub(c));
        self.wall = self.wall.max(w.elapsed());
        r
    }
}

impl std::fmt::Display for Longest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.3} ms wall ({:.3} ms on-CPU)",
            self.wall.as_secs_f64() * 1e3,
            self.cpu.as_secs_f64() * 1e3
        )
    }
}

/// An index of `n` entries, and the longest single ingest that filled it (its key table grows
/// on the way).
fn build(n: usize, old_stamp: bool) -> (Index, Longest) {
    let mut longest = Longest::default();
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
        longest.time(|| ix.ingest(&u, NOW - MIN, &Ttl));
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
        "built {} entries in {:.1} s, longest ingest {longest}",
        ix.entry_count(),
        t.elapsed().as_secs_f64(),
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
    let (mut slices, mut builds) = (0u64, 0u64);
    let (mut longest, mut longest_ingest) = (Longest::default(), Longest::default());
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
        longest_ingest.time(|| ix.ingest(&u, NOW, &Ttl));
        let mut slice = Longest::default();
        let step = slice.time(|| {
            ix.cap_prebuild_step(SweepBudget {
                max_entries: 16_384,
                deadline: Some(Instant::now() + Duration::from_micros(500)),
            })
        });
        if step.entries > 0 {
            slices += 1;
            longest.wall = longest.wall.max(slice.wall);
            longest.cpu = longest.cpu.max(slice.cpu);
        }
        builds += step.finished as u64;
    }
    println!(
        "steady eviction, {} ingests at the cap: {:.1} s, {builds} builds ahead in {slices} slices, longest slice {longest}, longest ingest {longest_ingest}, {} built in one go, at most {} stale snapshots in one pop",
        chains / 2,
        t.elapsed().as_secs_f64(),
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
