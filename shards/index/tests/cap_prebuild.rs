//! The global cap's candidate heap built ahead of need in slices (`Index::cap_prebuild_step`,
//! docs/BEHAVIOUR.md §7.2, the eviction module docs): the same seeded random workload, run once
//! with every candidate build done in one go by the ingest that needs a victim and once with
//! builds driven in slices of any size between the operations, evicts exactly the same entries
//! in exactly the same order (removal-hook reports compared line by line), leaves the same
//! state, and answers the cross-core candidate requests (`Index::cap_candidates`) identically.
//! Builds a slice could not finish in time are finished by the ingest that needs them
//! (`Index::take_cap_sync_builds`), with the same victims.

mod index_support;

use index_support::*;
use inferencecache_index::PROBE_TENANT;
use inferencecache_index::index::{Index, IndexConfig, SweepBudget};
use inferencecache_index::rules::TenantRules;
use inferencecache_proto::v1alpha1::cache_event::Type;

/// `t1` is LFU (access counts order its entries first), the others LRU.
fn rules() -> Rules {
    Rules::lfu("t1")
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
        Op::draw_among(rng, keys, 3)
    }

    /// [`Op::draw`] with `replicas` replicas (above 9 a key's holders form a wide set).
    fn draw_among(rng: &mut Rng, keys: u64, replicas: u64) -> Op {
        let (tenant, model, replica) = (rng.below(4), rng.below(2), rng.below(replicas));
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
    let rows = record_removals(&mut ix);
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
                // A slice overruns its budget by at most one small key's holders (up to 9) or
                // one chunk of a wide key's (32, and its inline holder).
                assert!(step.entries <= max_entries + 33, "{step:?}");
                prebuilt += step.finished as usize;
                ix.cap_check_invariant();
            }
        }
    }
    let removals = rows.lock().unwrap().clone();
    Run {
        removals,
        candidates,
        state: sorted_entries(&ix),
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
    // (Pruning stale snapshots before the install adds slices to some builds; the free slots
    // removed keys leave are visited too: 868 here.)
    assert!(total_prebuilt > 800, "{total_prebuilt}");
    assert!(total_fallback > 100, "{total_fallback}");
    // ... and slices took most builds off the ingests (4 sliced runs per one-go run).
    assert!(
        total_fallback < 4 * total_one_go / 2,
        "{total_fallback} vs {total_one_go}"
    );
}

/// Keys held by up to 40 replicas (wide holder sets, split across slices of 1–40 entries) and
/// holders added, refreshed, credited and removed between two slices, also of the key a slice
/// stopped inside: the same victims in the same order as builds in one go.
#[test]
fn builds_splitting_keys_of_many_holders_evict_exactly_like_builds_in_one_go() {
    let mut prebuilt = 0;
    for seed in 1..=6u64 {
        let mut rng = Rng(seed);
        let keys = 2 + rng.below(4);
        let ops: Vec<Op> = (0..700)
            .map(|_| Op::draw_among(&mut rng, keys, 40))
            .collect();
        let cap = 150 + rng.below(150);
        for k in [1usize, 16] {
            let want = run(&ops, cap, k, None, seed);
            assert!(
                want.removals
                    .iter()
                    .filter(|r| r.starts_with("Cap"))
                    .count()
                    > 50,
                "seed {seed}: the cap evicts"
            );
            for (max_entries, between) in [(1usize, 3u64), (7, 2), (40, 1)] {
                let got = run(&ops, cap, k, Some((max_entries, between)), seed);
                let what = format!("seed {seed} cap {cap} k {k} slices of {max_entries}");
                assert_eq!(got.removals.len(), want.removals.len(), "{what}");
                for (i, (g, w)) in got.removals.iter().zip(&want.removals).enumerate() {
                    assert_eq!(g, w, "{what}: removal #{i}");
                }
                assert_eq!(got.candidates, want.candidates, "{what}");
                assert_eq!(got.state, want.state, "{what}");
                prebuilt += got.prebuilt;
            }
        }
    }
    assert!(prebuilt > 50, "{prebuilt}");
}

/// One key of 1,024 holders (the most a key may have) is more than a slice's work: a slice of
/// 100 entries stops inside it, and the key is finished over the next slices while its holders
/// are refreshed, removed and added between them. The heap then evicts exactly what a build in
/// one go evicts, in the same order.
#[test]
fn a_slice_stops_inside_a_key_of_many_holders() {
    const HOLDERS: u64 = 1024;
    let rules = Rules::default();
    let now = T0 + 10 * SEC;
    let fill = |ix: &mut Index| {
        for r in 0..HOLDERS {
            // Stamps in reverse of the replica number: the order is not the set's order.
            let stamp = T0 + (HOLDERS - r) as i64 * SEC;
            let keys = vec![legacy(b"hot", 16), legacy(&r.to_be_bytes(), 16)];
            ix.ingest(
                &at(upd("t", "m", "vllm", &format!("r{r}"), keys), stamp),
                now,
                &rules,
            );
        }
    };
    let between = |ix: &mut Index, i: u64| {
        let r = format!("r{}", (i * 37) % HOLDERS);
        match i % 3 {
            0 => {
                let e = event(Type::PrefixEvicted, "t", "m", &r, b"hot");
                ix.apply_event(&e, now, &rules);
            }
            1 => {
                let u = upd("t", "m", "vllm", &r, vec![legacy(b"hot", 16)]);
                ix.ingest(&at(u, T0 + (i as i64 % 7) * SEC), now, &rules);
            }
            _ => {
                let u = upd(
                    "t",
                    "m",
                    "vllm",
                    &format!("new{i}"),
                    vec![legacy(b"hot", 16)],
                );
                ix.ingest(&at(u, T0 + (i as i64 % 5) * SEC), now, &rules);
            }
        }
    };
    let evict_all = |ix: &mut Index| {
        for i in 0..100u64 {
            let u = upd(
                "t",
                "m",
                "vllm",
                "late",
                vec![legacy(&(1 << 20 | i).to_be_bytes(), 16)],
            );
            ix.ingest(&at(u, now), now, &rules);
        }
    };
    let mut runs = Vec::new();
    for sliced in [false, true] {
        let mut ix = index_with(HOUR, 0);
        ix.set_min_candidates(64);
        fill(&mut ix);
        ix.set_max_entries(ix.entry_count());
        let rows = record_removals(&mut ix);
        let (mut slices, mut building) = (0u64, sliced);
        for i in 1..=60 {
            if building {
                let step = ix.cap_prebuild_step(SweepBudget {
                    max_entries: 100,
                    deadline: None,
                });
                // The slice that meets the hot key stops inside it.
                assert!(step.entries < 200, "{step:?}: the key was not split");
                slices += 1;
                ix.cap_check_invariant();
                building = step.in_progress;
            }
            between(&mut ix, i);
        }
        assert!(!building, "{slices} slices");
        assert!(slices > 15 || !sliced, "{slices} slices");
        evict_all(&mut ix);
        assert_eq!(
            ix.take_cap_sync_builds(),
            u64::from(!sliced),
            "sliced: {sliced}"
        );
        let removals = rows.lock().unwrap().clone();
        assert!(removals.len() >= 90, "{}", removals.len());
        runs.push((removals, sorted_entries(&ix)));
    }
    assert_eq!(runs[0], runs[1]);
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

/// The policy flips which of `t1`/`t2` is LFU on every `RulesChanged`.
fn flipping_rules(flips: usize) -> Rules {
    Rules::lfu(if flips.is_multiple_of(2) { "t1" } else { "t2" })
}

/// Runs `ops` with rules that really change on every `RulesChanged` (see [`flipping_rules`]).
/// `notified = Some((max_entries, steps_between))`: the index relies on `rules_changed`
/// (`IndexConfig::rules_change_notified`) and re-resolves its tenants' algorithms in slices of
/// that size, run between the operations like the server's maintenance loop does
/// (`algorithms_step` while pending, else a cap build slice). `None`: the index checks every
/// tenant before every enforcement, builds run in one go (the reference).
fn run_flipping(ops: &[Op], cap: u64, k: usize, notified: Option<(usize, u64)>, seed: u64) -> Run {
    let mut ix = Index::new(IndexConfig {
        default_ttl_ns: HOUR,
        max_entries: cap,
        rules_change_notified: notified.is_some(),
        ..IndexConfig::default()
    });
    ix.set_min_candidates(k);
    let rows = record_removals(&mut ix);
    let mut rng = Rng(seed ^ 0xf11b);
    let mut candidates = Vec::new();
    let (mut flips, mut prebuilt, mut sync) = (0usize, 0usize, 0u64);
    let now = T0 + 10 * SEC;
    for op in ops {
        let rules = flipping_rules(flips);
        if let Op::RulesChanged = op {
            flips += 1;
        }
        let rules_after = flipping_rules(flips);
        // The rules in force change with the push, before the index is told.
        let in_force = if matches!(op, Op::RulesChanged) {
            &rules_after
        } else {
            &rules
        };
        if let Some(c) = op.apply(&mut ix, now, in_force) {
            candidates.push(c);
        }
        sync += ix.take_cap_sync_builds();
        if let Some((max_entries, steps_between)) = notified {
            for _ in 0..rng.below(steps_between + 1) {
                let budget = SweepBudget {
                    max_entries,
                    deadline: None,
                };
                if ix.algorithms_pending() {
                    let visited = ix.algorithms_step(&rules_after, budget);
                    assert!(visited <= max_entries, "{visited}");
                } else {
                    prebuilt += ix.cap_prebuild_step(budget).finished as usize;
                }
                ix.cap_check_invariant();
            }
        }
    }
    let removals = rows.lock().unwrap().clone();
    Run {
        removals,
        candidates,
        state: sorted_entries(&ix),
        prebuilt,
        sync,
    }
}

/// Policy pushes that really change algorithms: an index told of each push
/// (`rules_change_notified`), re-resolving its tenants in slices between operations (or, when
/// an enforcement comes first, finishing that itself), evicts exactly what the index that
/// checks every tenant before every enforcement evicts, in the same order.
#[test]
fn algorithms_resolved_in_slices_after_a_push_evict_exactly_like_checking_every_time() {
    let (mut prebuilt, mut finished_by_ingest) = (0, 0);
    for seed in 1..=8u64 {
        let mut rng = Rng(seed);
        let keys = 40 + rng.below(200);
        let ops: Vec<Op> = (0..700).map(|_| Op::draw(&mut rng, keys)).collect();
        let cap = 20 + rng.below(80);
        for k in [1usize, 16] {
            let want = run_flipping(&ops, cap, k, None, seed);
            assert!(
                want.removals.iter().any(|r| r.contains("Lfu")),
                "seed {seed}: LFU victims"
            );
            for (max_entries, between) in [(1usize, 2u64), (3, 1), (64, 1)] {
                let got = run_flipping(&ops, cap, k, Some((max_entries, between)), seed);
                let what = format!("seed {seed} cap {cap} k {k} slices of {max_entries}");
                assert_eq!(got.removals.len(), want.removals.len(), "{what}");
                for (i, (g, w)) in got.removals.iter().zip(&want.removals).enumerate() {
                    assert_eq!(g, w, "{what}: removal #{i}");
                }
                assert_eq!(got.candidates, want.candidates, "{what}");
                assert_eq!(got.state, want.state, "{what}");
                prebuilt += got.prebuilt;
                finished_by_ingest += got.sync;
            }
        }
    }
    assert!(prebuilt > 100, "{prebuilt}");
    assert!(finished_by_ingest > 10, "{finished_by_ingest}");
}

/// Counts the rules' eviction lookups.
struct Counting {
    inner: Rules,
    evictions: std::cell::Cell<u64>,
}

impl TenantRules for Counting {
    fn ttl_ns(&self, tenant: &str) -> i64 {
        self.inner.ttl_ns(tenant)
    }
    fn eviction(&self, tenant: &str) -> inferencecache_index::rules::Eviction {
        self.evictions.set(self.evictions.get() + 1);
        self.inner.eviction(tenant)
    }
    fn quota(&self, tenant: &str) -> Option<u64> {
        self.inner.quota(tenant)
    }
}

/// A client decides how many tenants a core holds. With `rules_change_notified` an ingest at the
/// cap looks up one tenant's algorithm (its own), not every tenant's; after a push, the
/// re-resolution visits each tenant record once, in slices of its budget.
#[test]
fn an_ingest_at_the_cap_does_not_visit_every_tenant() {
    const TENANTS: u64 = 5000;
    let rules = Counting {
        inner: Rules::lfu("t7"),
        evictions: std::cell::Cell::new(0),
    };
    let mut ix = Index::new(IndexConfig {
        default_ttl_ns: HOUR,
        max_entries: TENANTS,
        rules_change_notified: true,
        ..IndexConfig::default()
    });
    for i in 0..TENANTS {
        let u = upd(
            &format!("t{i}"),
            "m",
            "vllm",
            "r",
            vec![legacy(&i.to_be_bytes(), 16)],
        );
        ix.ingest(&at(u, T0 + i as i64), T0 + SEC, &rules);
    }
    rules.evictions.set(0);
    for i in TENANTS..TENANTS + 100 {
        let u = upd("t1", "m", "vllm", "r", vec![legacy(&i.to_be_bytes(), 16)]);
        ix.ingest(&at(u, T0 + SEC), T0 + SEC, &rules);
    }
    assert_eq!(ix.entry_count(), TENANTS);
    assert!(
        rules.evictions.get() <= 200,
        "{} eviction lookups for 100 ingests",
        rules.evictions.get()
    );
    // A push: re-resolved in slices of at most 256 records, each tenant about once.
    ix.rules_changed();
    rules.evictions.set(0);
    let mut slices = 0;
    while ix.algorithms_pending() {
        slices += 1;
        assert!(slices <= 100);
        let visited = ix.algorithms_step(
            &rules,
            SweepBudget {
                max_entries: 256,
                deadline: None,
            },
        );
        assert!(visited <= 256);
    }
    assert!(slices >= TENANTS as usize / 256, "{slices}");
    assert!(rules.evictions.get() <= TENANTS + 100);
}
