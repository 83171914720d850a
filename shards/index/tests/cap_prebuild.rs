//! The global cap's candidate heap built ahead of need in slices (`Index::cap_prebuild_step`,
//! docs/BEHAVIOUR.md §7.2, the eviction module docs): the same seeded random workload, run once
//! with every candidate build done in one go by the ingest that needs a victim and once with
//! builds driven in slices of any size between the operations, evicts exactly the same entries
//! in exactly the same order (removal-hook reports compared line by line), leaves the same
//! state, and answers the cross-core candidate requests (`Index::cap_candidates`) identically.
//! Builds a slice could not finish in time are finished by the ingest that needs them
//! (`Index::take_cap_sync_builds`), with the same victims.

mod index_support;

use std::sync::{Arc, Mutex};

use index_support::*;
use inferencecache_index::PROBE_TENANT;
use inferencecache_index::index::{Index, Removed, SweepBudget};
use inferencecache_index::rules::TenantRules;
use inferencecache_proto::v1alpha1::cache_event::Type;

/// A small deterministic generator (xorshift64*), so failures reproduce from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// `t1` is LFU (access counts order its entries first), the others LRU.
fn rules() -> Rules {
    Rules::lfu("t1")
}

/// Records every removal-hook report as one comparable line.
fn record(ix: &mut Index) -> Arc<Mutex<Vec<String>>> {
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

/// Every entry, sorted.
fn state(ix: &Index) -> Vec<String> {
    let mut out = Vec::new();
    ix.export_entries(0, usize::MAX, |e| {
        out.push(format!(
            "{} {} {} {} {:?} {} {} {}",
            e.tenant, e.model, e.scheme, e.adapter, e.hash, e.replica, e.last_seen, e.access
        ))
    });
    out.sort();
    out
}

/// One operation of the workload.
#[derive(Clone, Debug)]
enum Op {
    /// An ingest of 1–4 keys (new ones and refreshes; stamps from a few distinct values, so
    /// many entries tie on `last_seen` and the order falls through to the names).
    Ingest {
        tenant: u64,
        model: u64,
        replica: u64,
        hashes: Vec<u64>,
        blob: bool,
        stamp: u64,
    },
    /// A lookup of one key, its hits credited (LFU access counts go up).
    Lookup { tenant: u64, model: u64, hash: u64 },
    /// PREFIX_EVICTED of one key, or ALL_CLEARED of a replica (keys leave the store and others
    /// move into their slots).
    Evict {
        tenant: u64,
        model: u64,
        replica: u64,
        hash: u64,
    },
    Clear {
        tenant: u64,
        model: u64,
        replica: u64,
    },
    /// A cross-core candidate request (pops and pushes back: changes nothing observable).
    Candidates(usize),
    /// A policy push (the server drops cached candidates on every one).
    RulesChanged,
}

impl Op {
    fn draw(rng: &mut Rng, keys: u64) -> Op {
        let (tenant, model, replica) = (rng.below(4), rng.below(2), rng.below(3));
        match rng.below(100) {
            0..=64 => Op::Ingest {
                tenant,
                model,
                replica,
                hashes: (0..1 + rng.below(4)).map(|_| rng.below(keys)).collect(),
                blob: rng.below(5) == 0,
                stamp: rng.below(6),
            },
            65..=79 => Op::Lookup {
                tenant,
                model,
                hash: rng.below(keys),
            },
            80..=87 => Op::Evict {
                tenant,
                model,
                replica,
                hash: rng.below(keys),
            },
            88..=89 => Op::Clear {
                tenant,
                model,
                replica,
            },
            90..=98 => Op::Candidates(1 + rng.below(6) as usize),
            _ => Op::RulesChanged,
        }
    }

    /// Applies the op; returns what a candidate request answered (as text).
    fn apply(&self, ix: &mut Index, now: i64, rules: &dyn TenantRules) -> Option<String> {
        // `t3` is the reserved probe tenant: never a cap candidate, never counted.
        let tenant = |t: u64| {
            if t == 3 {
                PROBE_TENANT.to_string()
            } else {
                format!("t{t}")
            }
        };
        let hash = |h: u64, blob: bool| {
            if blob {
                // Longer than 8 bytes: stored as a blob (the threshold/blob-reference paths).
                format!("blob-hash-{h:06}").into_bytes()
            } else {
                h.to_be_bytes().to_vec()
            }
        };
        match self {
            Op::Ingest {
                tenant: t,
                model,
                replica,
                hashes,
                blob,
                stamp,
            } => {
                let prefixes = hashes
                    .iter()
                    .map(|h| legacy(&hash(*h, *blob), 16))
                    .collect();
                let u = upd(
                    &tenant(*t),
                    &format!("m{model}"),
                    "vllm",
                    &format!("r{replica}"),
                    prefixes,
                );
                ix.ingest(&at(u, T0 + *stamp as i64 * SEC), now, rules);
            }
            Op::Lookup {
                tenant: t,
                model,
                hash: h,
            } => {
                let (tn, m, hb) = (tenant(*t), format!("m{model}"), hash(*h, false));
                let q = inferencecache_index::index::LookupQuery {
                    tenant: &tn,
                    model: &m,
                    hash_scheme: "vllm",
                    prefix_hash: &hb,
                    ..Default::default()
                };
                route(ix, &q, now, rules);
                ix.credit_lfu(|_| true, rules);
            }
            Op::Evict {
                tenant: t,
                model,
                replica,
                hash: h,
            } => {
                let e = event(
                    Type::PrefixEvicted,
                    &tenant(*t),
                    &format!("m{model}"),
                    &format!("r{replica}"),
                    &hash(*h, false),
                );
                ix.apply_event(&e, now, rules);
            }
            Op::Clear {
                tenant: t,
                model,
                replica,
            } => {
                let e = event(
                    Type::AllCleared,
                    &tenant(*t),
                    &format!("m{model}"),
                    &format!("r{replica}"),
                    b"",
                );
                ix.apply_event(&e, now, rules);
            }
            Op::Candidates(k) => return Some(format!("{:?}", ix.cap_candidates(*k, rules))),
            Op::RulesChanged => ix.rules_changed(),
        }
        None
    }
}

/// What one run produced: removal reports in order, candidate answers in order, final state,
/// and the builds finished in slices / run or finished by the path that needed victims.
struct Run {
    removals: Vec<String>,
    candidates: Vec<String>,
    state: Vec<String>,
    prebuilt: usize,
    sync: u64,
}

/// Runs `ops` on a fresh index with global cap `cap` and minimum candidate count `k`; with
/// `slice = Some(max_entries)`, up to `steps_between` prebuild slices of that size run after
/// every op (the count drawn from `rng`).
fn run(ops: &[Op], cap: u64, k: usize, slice: Option<(usize, u64)>, seed: u64) -> Run {
    let rules = rules();
    let mut ix = index_with(HOUR, cap);
    ix.set_min_candidates(k);
    let rows = record(&mut ix);
    let mut rng = Rng(seed ^ 0x5eed);
    let mut candidates = Vec::new();
    let (mut prebuilt, mut sync) = (0usize, 0u64);
    let now = T0 + 10 * SEC;
    for op in ops {
        if let Some(c) = op.apply(&mut ix, now, &rules) {
            candidates.push(c);
        }
        sync += ix.take_cap_sync_builds();
        ix.cap_check_invariant();
        if let Some((max_entries, steps_between)) = slice {
            for _ in 0..rng.below(steps_between + 1) {
                let step = ix.cap_prebuild_step(SweepBudget {
                    max_entries,
                    deadline: None,
                });
                // A key's holders (at most 3 replicas here) are never split.
                assert!(step.entries < max_entries + 3, "{step:?}");
                prebuilt += step.finished as usize;
                ix.cap_check_invariant();
            }
        }
    }
    let removals = rows.lock().unwrap().clone();
    Run {
        removals,
        candidates,
        state: state(&ix),
        prebuilt,
        sync,
    }
}

/// The same workload with one-go builds and with builds in slices of 1, 2, 7 and 64 entries
/// (0–3 slices between two operations): the same victims in the same order, the same candidate
/// answers, the same final state.
#[test]
fn builds_in_slices_evict_exactly_like_builds_in_one_go() {
    let mut total_prebuilt = 0;
    let mut total_fallback = 0;
    let mut total_one_go = 0;
    for seed in 1..=12u64 {
        let mut rng = Rng(seed);
        let keys = 40 + rng.below(200);
        let ops: Vec<Op> = (0..700).map(|_| Op::draw(&mut rng, keys)).collect();
        let cap = 20 + rng.below(80);
        for k in [1usize, 3, 16] {
            let want = run(&ops, cap, k, None, seed);
            assert!(
                want.removals
                    .iter()
                    .filter(|r| r.starts_with("Cap"))
                    .count()
                    > 50,
                "seed {seed}: the cap evicts"
            );
            assert_eq!(want.prebuilt, 0);
            for (max_entries, between) in [(1usize, 3u64), (2, 1), (7, 2), (64, 1)] {
                let got = run(&ops, cap, k, Some((max_entries, between)), seed);
                let what = format!("seed {seed} cap {cap} k {k} slices of {max_entries}");
                assert_eq!(got.removals.len(), want.removals.len(), "{what}");
                for (i, (g, w)) in got.removals.iter().zip(&want.removals).enumerate() {
                    assert_eq!(g, w, "{what}: removal #{i}");
                }
                assert_eq!(got.candidates, want.candidates, "{what}");
                assert_eq!(got.state, want.state, "{what}");
                total_prebuilt += got.prebuilt;
                total_fallback += got.sync;
                total_one_go += want.sync;
            }
        }
    }
    // Both paths ran: builds completed in slices, and builds an ingest had to finish itself.
    // (Pruning stale snapshots before the install adds slices to some builds: 998 here.)
    assert!(total_prebuilt > 900, "{total_prebuilt}");
    assert!(total_fallback > 100, "{total_fallback}");
    // ... and slices took most builds off the ingests (4 sliced runs per one-go run).
    assert!(
        total_fallback < 4 * total_one_go / 2,
        "{total_fallback} vs {total_one_go}"
    );
}

/// With enough slices between ingests, every build runs ahead of need: no ingest pays for one.
/// (LRU tenants only: the first enforcement after a tenant's algorithm changed drops the
/// candidates, built with the old one, and builds anew in one go.)
#[test]
fn enough_slices_leave_no_build_to_the_ingest() {
    let rules = Rules::default();
    let mut ix = index_with(HOUR, 500);
    ix.set_min_candidates(8);
    let mut rng = Rng(7);
    let now = T0 + 10 * SEC;
    let mut sync = 0;
    let mut prebuilt = 0;
    for i in 0..3000u64 {
        let u = upd(
            &format!("t{}", rng.below(3)),
            "m0",
            "vllm",
            &format!("r{}", rng.below(3)),
            vec![legacy(&i.to_be_bytes(), 16)],
        );
        ix.ingest(&at(u, T0 + (i / 10) as i64 * SEC), now, &rules);
        sync += ix.take_cap_sync_builds();
        loop {
            let s = ix.cap_prebuild_step(SweepBudget {
                max_entries: 64,
                deadline: None,
            });
            prebuilt += s.finished as usize;
            if !s.in_progress {
                break;
            }
        }
    }
    assert_eq!(ix.entry_count(), 500);
    assert!(prebuilt > 20, "{prebuilt}");
    assert_eq!(sync, 0, "no ingest built candidates");
}

/// Far below the cap (or without one) nothing is built ahead of need.
#[test]
fn no_build_far_below_the_cap() {
    let rules = rules();
    for cap in [0u64, 1000] {
        let mut ix = index_with(HOUR, cap);
        for i in 0..100u64 {
            let u = upd("t0", "m0", "vllm", "r0", vec![legacy(&i.to_be_bytes(), 16)]);
            ix.ingest(&at(u, T0), T0, &rules);
        }
        assert!(!ix.cap_prebuild_wanted(), "cap {cap}");
        let s = ix.cap_prebuild_step(SweepBudget::UNBOUNDED);
        assert_eq!(s.entries, 0);
        assert!(!s.started && !s.in_progress);
    }
}

/// Steady eviction at the cap (each ingest adds 8 keys and evicts 8), one slice after each
/// ingest: the live heap evicts the smallest entries while the next build runs, and those are
/// the build's smallest snapshots. The build drops them before it goes live, so no pop on an
/// ingest meets that backlog (it met every entry evicted during the build before).
#[test]
fn a_new_heap_goes_live_without_the_entries_evicted_while_it_was_built() {
    let cap = 4000u64;
    let mut ix = index_with(HOUR, cap);
    ix.set_min_candidates(8);
    let mut worst = 0;
    let (prebuilt, sync) = fill_building_ahead(&mut ix, |ix| {
        worst = worst.max(ix.take_cap_max_stale_pops())
    });
    assert_eq!(ix.entry_count(), cap);
    assert!(prebuilt > 5, "{prebuilt}");
    assert_eq!(sync, 0, "no build ran on an ingest");
    assert!(worst <= 8, "a pop dropped {worst} stale snapshots");
}

thread_local! {
    static FRESH_BUFFERS: std::cell::RefCell<Vec<(usize, usize)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

fn note_fresh_buffer(addr: usize, len: usize) {
    FRESH_BUFFERS.with(|b| b.borrow_mut().push((addr, len)));
}

/// An index capped at `cap` whose fresh selection buffers go to [`note_fresh_buffer`].
fn index_with_buffer_hook(cap: u64) -> Index {
    let mut ix = Index::new(inferencecache_index::index::IndexConfig {
        default_ttl_ns: HOUR,
        max_entries: cap,
        gradual_buffer_hook: Some(note_fresh_buffer),
        ..Default::default()
    });
    ix.set_min_candidates(8);
    ix
}

/// Ingests 3,000 updates of 8 keys, calling `after_ingest` after each and then taking one cap
/// build step: `(builds finished ahead of need, builds done synchronously at ingest)`.
fn fill_building_ahead(ix: &mut Index, mut after_ingest: impl FnMut(&mut Index)) -> (usize, u64) {
    let rules = Rules::default();
    let now = T0 + 10 * SEC;
    let (mut prebuilt, mut sync) = (0, 0);
    for i in 0..3000u64 {
        let keys = (0..8u64)
            .map(|b| legacy(&(i << 8 | b).to_be_bytes(), 16))
            .collect();
        let u = upd(&format!("t{}", i % 3), "m0", "vllm", "r0", keys);
        ix.ingest(&at(u, T0 + i as i64 * SEC), now, &rules);
        sync += ix.take_cap_sync_builds();
        after_ingest(ix);
        let s = ix.cap_prebuild_step(SweepBudget {
            max_entries: 512,
            deadline: None,
        });
        prebuilt += s.finished as usize;
    }
    (prebuilt, sync)
}

/// Each build ahead of need that cannot reuse the spare selection buffer allocates one, and
/// the server's hook sees its range before the first write (to keep huge pages off it); a
/// build that reuses the spare allocates nothing and calls nothing.
#[test]
fn a_fresh_selection_buffer_goes_to_the_hook_and_a_reused_one_does_not() {
    let mut ix = index_with_buffer_hook(4000);
    let (prebuilt, _) = fill_building_ahead(&mut ix, |_| {});
    let fresh = FRESH_BUFFERS.with(|b| b.borrow().clone());
    assert!(prebuilt > 5, "{prebuilt}");
    assert!(!fresh.is_empty(), "no fresh buffer reached the hook");
    assert!(
        fresh.iter().all(|&(addr, len)| addr != 0 && len > 0),
        "{fresh:?}"
    );
    assert!(
        fresh.len() < prebuilt,
        "{} fresh buffers for {prebuilt} builds: the spare was never reused",
        fresh.len()
    );
}

/// Buffers reserved before serving cover the builds ahead of need that follow: none of them
/// allocates a selection buffer of its own (the allocator's first write into a fresh block is a
/// page fault the hook cannot keep off huge pages). The two reserved buffers alternate: the
/// first build takes the spare, and the reserved live heap it replaces becomes the next spare.
#[test]
fn reserved_buffers_leave_no_build_a_fresh_allocation() {
    let mut ix = index_with_buffer_hook(4000);
    ix.reserve_cap_buffers(1);
    let reserved = FRESH_BUFFERS.with(|b| b.borrow().len());
    assert_eq!(reserved, 2, "a spare and the live heap's buffer");
    let (prebuilt, sync) = fill_building_ahead(&mut ix, |_| {});
    assert!(prebuilt > 5, "{prebuilt}");
    assert_eq!(sync, 0);
    let fresh = FRESH_BUFFERS.with(|b| b.borrow().len()) - reserved;
    assert_eq!(fresh, 0, "{fresh} builds of {prebuilt} allocated a buffer");
}
