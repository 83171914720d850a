//! The global cap's evictions in slices (`Index::set_sliced_cap`, the server with one core): an
//! ingest that takes the index over the cap evicts at most one slice's worth itself, and the
//! rest is owed to `Index::cap_enforce_step` slices the server runs before it acknowledges the
//! ingest. Run that way after every ingest, a seeded workload evicts exactly the same entries in
//! exactly the same order as with every eviction inside the ingest, and leaves the same state.
//! A cross-core candidate request (`Index::cap_candidates_ready`) that finds its heap used up by
//! stale snapshots answers `None` instead of building candidates in one go.

mod index_support;

use std::time::Duration;

use index_support::*;
use inferencecache_index::index::{
    CapSlice, EvictionCounts, Index, PART_CLOCK_EVERY, PartBudget, SweepBudget,
};
use inferencecache_proto::v1alpha1::cache_event::Type;

/// What one run produced: removal reports in order, the final state, the most evictions one
/// step made, and the number of steps run after ingests.
struct Run {
    removals: Vec<String>,
    state: Vec<String>,
    most_per_step: u64,
    steps: usize,
}

/// A seeded workload against a cap of 200: ingests of 1–60 keys (new ones and refreshes),
/// lookups crediting LFU counts, PREFIX_EVICTED events and policy pushes. With `slice`, the cap
/// is sliced and every ingest is followed by `cap_enforce_step` until nothing is owed.
fn run(seed: u64, slice: Option<usize>) -> Run {
    let rules = Rules::lfu("t1");
    let mut ix = index_with(HOUR, 200);
    ix.set_min_candidates(4);
    ix.set_sliced_cap(slice.map(|max_evictions| CapSlice {
        max_evictions,
        time: Duration::from_secs(3600),
    }));
    let rows = record_removals(&mut ix);
    let mut rng = Rng(seed);
    let now = T0 + 10 * SEC;
    let (mut most_per_step, mut steps) = (0u64, 0usize);
    for _ in 0..400 {
        let (tenant, model, replica) = (rng.below(3), rng.below(2), rng.below(3));
        let (tenant, model, replica) = (
            format!("t{tenant}"),
            format!("m{model}"),
            format!("r{replica}"),
        );
        match rng.below(10) {
            0..=6 => {
                let n = 1 + rng.below(60);
                let prefixes = (0..n)
                    .map(|_| legacy(&rng.below(600).to_be_bytes(), 16))
                    .collect();
                let u = upd(&tenant, &model, "vllm", &replica, prefixes);
                let out = ix.ingest(&at(u, T0 + rng.below(8) as i64 * SEC), now, &rules);
                most_per_step = most_per_step.max(out.cap_evicted.total());
                while let Some(max_entries) = slice.filter(|_| ix.cap_enforce_owed()) {
                    let mut c = EvictionCounts::default();
                    let budget = SweepBudget {
                        max_entries,
                        deadline: None,
                    };
                    ix.cap_enforce_step(&rules, &mut c, now, budget);
                    assert!(c.total() > 0, "a step that owes evictions makes one");
                    most_per_step = most_per_step.max(c.total());
                    steps += 1;
                }
                assert!(!ix.cap_enforce_owed());
            }
            7 => {
                let hash = rng.below(600).to_be_bytes();
                let q = inferencecache_index::index::LookupQuery {
                    tenant: &tenant,
                    model: &model,
                    hash_scheme: "vllm",
                    prefix_hash: &hash,
                    ..Default::default()
                };
                route(&mut ix, &q, now, &rules);
                ix.credit_lfu(|_| true, &rules);
            }
            8 => {
                let hash = rng.below(600).to_be_bytes();
                let e = event(Type::PrefixEvicted, &tenant, &model, &replica, &hash);
                ix.apply_event(&e, now, &rules);
            }
            _ => ix.rules_changed(),
        }
    }
    let removals = rows.lock().unwrap().clone();
    Run {
        removals,
        state: sorted_entries(&ix),
        most_per_step,
        steps,
    }
}

#[test]
fn sliced_cap_evictions_match_evicting_inside_the_ingest() {
    for seed in 1..=12u64 {
        let whole = run(seed, None);
        assert!(
            whole.most_per_step > 8,
            "seed {seed}: the workload evicts in bulk"
        );
        for slice in [1, 3, 8] {
            let sliced = run(seed, Some(slice));
            assert!(
                sliced.steps > 0,
                "seed {seed}, slice {slice}: no owed evictions"
            );
            assert!(
                sliced.most_per_step <= slice as u64,
                "seed {seed}, slice {slice}: a step evicted {}",
                sliced.most_per_step
            );
            assert_eq!(
                sliced.removals, whole.removals,
                "seed {seed}, slice {slice}: removals"
            );
            assert_eq!(
                sliced.state, whole.state,
                "seed {seed}, slice {slice}: state"
            );
        }
    }
}

/// Fills a 100-entry cap with one key per second (oldest first), builds the candidate heap,
/// then refreshes its six oldest keys: every snapshot the heap holds is stale.
fn index_with_a_stale_heap() -> Index {
    let rules = Rules::lfu("t1");
    let mut ix = index_with(HOUR, 100);
    ix.set_min_candidates(4);
    let now = T0 + 1000 * SEC;
    let ingest = |ix: &mut Index, key: u64, ts: i64| {
        let u = upd("t0", "m", "vllm", "r", vec![legacy(&key.to_be_bytes(), 16)]);
        ix.ingest(&at(u, ts), now, &rules);
    };
    for key in 0..100 {
        ingest(&mut ix, key, T0 + key as i64 * SEC);
    }
    ix.cap_prebuild_step(SweepBudget::UNBOUNDED);
    assert!(!ix.cap_victims_pending(3), "a live heap");
    for key in 0..6 {
        ingest(&mut ix, key, T0 + 500 * SEC);
    }
    ix
}

/// A cross-core candidate request that finds the heap used up by stale snapshots does not
/// build candidates in one go: it answers `None`, the heap is then seen to need a build, which
/// runs in slices, and the request asked again answers what the one-go build would have.
#[test]
fn candidates_from_a_stale_heap_are_readied_in_slices() {
    let rules = Rules::lfu("t1");
    let mut ix = index_with_a_stale_heap();
    let mut twin = index_with_a_stale_heap();
    assert_eq!(ix.cap_candidates_ready(3, &rules), None);
    assert_eq!(ix.take_cap_sync_builds(), 0);
    assert!(ix.cap_victims_pending(3));
    let budget = SweepBudget {
        max_entries: 8,
        deadline: None,
    };
    let mut slices = 0;
    while ix.cap_victims_pending(3) {
        ix.cap_victims_step(3, &rules, budget);
        slices += 1;
        assert!(slices < 1_000, "the slices make progress");
    }
    assert!(slices > 4, "{slices} slices of 8 entries over 100");
    let ready = ix.cap_candidates_ready(3, &rules).expect("readied");
    assert_eq!(ix.take_cap_sync_builds(), 0);
    let whole = twin.cap_candidates(3, &rules);
    assert_eq!(twin.take_cap_sync_builds(), 1, "the twin built in one go");
    assert_eq!(format!("{ready:?}"), format!("{whole:?}"));
    assert_eq!(ready.len(), 3);
}

/// An update applied in parts (`Index::ingest_part`, as the server applies a large message)
/// leaves the same entries and evicts the same ones in the same order as applied whole: only
/// the last part enforces the cap, after all the prefixes.
#[test]
fn an_update_in_parts_matches_the_whole_update() {
    let rules = Rules::lfu("t1");
    for seed in 1..=8u64 {
        let mut runs = Vec::new();
        for part in [usize::MAX, 7, 1] {
            let mut ix = index_with(HOUR, 150);
            ix.set_min_candidates(4);
            let rows = record_removals(&mut ix);
            let mut rng = Rng(seed);
            let now = T0 + 10 * SEC;
            for _ in 0..120 {
                let (tenant, replica) =
                    (format!("t{}", rng.below(3)), format!("r{}", rng.below(3)));
                let n = 1 + rng.below(60) as usize;
                let prefixes = (0..n)
                    .map(|_| legacy(&rng.below(400).to_be_bytes(), 16))
                    .collect();
                let u = at(
                    upd(&tenant, "m", "vllm", &replica, prefixes),
                    T0 + rng.below(8) as i64 * SEC,
                );
                let mut start = 0;
                while start < n {
                    let end = start.saturating_add(part).min(n);
                    ix.ingest_part(&u, start..end, now, &rules);
                    start = end;
                }
            }
            let removals = rows.lock().unwrap().clone();
            runs.push((removals, sorted_entries(&ix)));
        }
        assert!(!runs[0].0.is_empty(), "seed {seed}: the workload evicts");
        assert_eq!(runs[1], runs[0], "seed {seed}: parts of 7");
        assert_eq!(runs[2], runs[0], "seed {seed}: parts of 1");
    }
}

/// A part ends early by what it creates (`Index::ingest_part_within`, the server's
/// `INGEST_PART_BLOCKS` with each name or keyspace counting `INGEST_PART_BLOCKS_PER_CREATED`):
/// 1,000 new adapters (a name and a keyspace each) in parts of 4,096 blocks, 8 per creation,
/// end after at most 241 adapters each, where the block count alone would apply them in one
/// step; applied from where each part ended, the update leaves the same entries and evicts the
/// same ones in the same order as applied whole. Re-reporting the same adapters creates
/// nothing and takes one part.
#[test]
fn a_part_ends_early_by_what_it_creates() {
    const ADAPTERS: usize = 1_000;
    let budget = PartBudget {
        blocks: 4_096,
        blocks_per_created: 8,
        deadline: None,
    };
    let rules = Rules::lfu("t1");
    let now = T0 + 10 * SEC;
    let update = |seed: u64| {
        let prefixes = (0..ADAPTERS)
            .map(|i| legacy_adapter(&(i as u64 + seed).to_be_bytes(), 16, &format!("a{i}")))
            .collect();
        at(
            upd("t1", "m", "vllm", "r1", prefixes),
            T0 + seed as i64 * SEC,
        )
    };
    let mut runs = Vec::new();
    for budget in [PartBudget::UNBOUNDED, budget] {
        let mut ix = index_with(HOUR, 1_500);
        let rows = record_removals(&mut ix);
        let mut parts = Vec::new();
        for seed in [0, 1, 2_000] {
            let u = update(seed);
            let (mut start, mut n) = (0, 0);
            while start < ADAPTERS {
                let (out, end) = ix.ingest_part_within(&u, start..ADAPTERS, budget, now, &rules);
                assert!(end > start, "every part makes progress");
                // Each new adapter costs its block and two creations: 17 blocks.
                let creating = budget != PartBudget::UNBOUNDED && seed == 0;
                assert!(
                    !creating || end - start <= 4_096 / 17 + 1,
                    "{out:?} to {end}"
                );
                (start, n) = (end, n + 1);
            }
            parts.push(n);
        }
        let removals = rows.lock().unwrap().clone();
        runs.push((parts, removals, sorted_entries(&ix)));
    }
    assert_eq!(runs[0].0, [1, 1, 1]);
    // New adapters: 5 parts (the first also creates the update's names and scope); the same
    // adapters again: one; new keys for them: one.
    assert_eq!(runs[1].0, [5, 1, 1]);
    assert!(!runs[0].1.is_empty(), "the cap evicts");
    assert_eq!(runs[1].1, runs[0].1, "same evictions in the same order");
    assert_eq!(runs[1].2, runs[0].2, "same entries");
}

/// A part also ends once its deadline passed (the clock read every `PART_CLOCK_EVERY` entries),
/// whatever the blocks: with the deadline already reached, 1,000 new keys go in parts of 32,
/// and leave the same entries as one ingest.
#[test]
fn a_part_ends_at_its_deadline() {
    let rules = Rules::lfu("t1");
    let now = T0 + 10 * SEC;
    let prefixes = (0..1_000u64)
        .map(|i| legacy(&i.to_be_bytes(), 16))
        .collect();
    let u = at(upd("t1", "m", "vllm", "r1", prefixes), T0);
    let mut whole = index_with(HOUR, 0);
    whole.ingest(&u, now, &rules);
    let mut ix = index_with(HOUR, 0);
    let (mut start, mut parts) = (0, 0);
    while start < 1_000 {
        let budget = PartBudget {
            deadline: Some(std::time::Instant::now()),
            ..PartBudget::UNBOUNDED
        };
        let (_, end) = ix.ingest_part_within(&u, start..1_000, budget, now, &rules);
        assert_eq!(end, (start + PART_CLOCK_EVERY).min(1_000));
        (start, parts) = (end, parts + 1);
    }
    assert_eq!(parts, 1_000usize.div_ceil(PART_CLOCK_EVERY));
    assert_eq!(sorted_entries(&ix), sorted_entries(&whole));
}
