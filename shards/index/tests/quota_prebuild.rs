//! The tenant quota's candidate heap readied in slices (`Index::quota_victims_step`,
//! docs/BEHAVIOUR.md §7.1, the eviction module docs) before the ingest that needs it, instead of
//! one scan of every key of the core inside the ingest: the same seeded workload evicts exactly
//! the same keys in exactly the same order as with every quota heap built in one go, and leaves
//! the same state, however the builds were sliced and whatever changed between two slices.

mod index_support;

use index_support::*;
use inferencecache_index::index::{Index, SweepBudget};
use inferencecache_index::rules::TenantRules;
use inferencecache_proto::v1alpha1::cache_event::Type;

/// `t0` and `t1` have quotas; `t2` has none.
fn rules() -> Rules {
    let mut r = Rules::quota("t0", 30);
    r.quota.insert("t1".into(), 50);
    r
}

/// What one run produced: removal reports in order, candidate answers, final state, and the
/// quota builds done in one go on the path that needed victims.
#[derive(Debug, PartialEq)]
struct Run {
    removals: Vec<String>,
    candidates: Vec<String>,
    state: Vec<String>,
    sync: u64,
}

/// A seeded workload: ingests of 1–12 keys (new ones and refreshes, few distinct stamps, so the
/// order often falls through to the names), PREFIX_EVICTED and ALL_CLEARED events, cross-core
/// style candidate requests. With `slice = Some((max_entries, between))`, every ingest of a
/// tenant with a quota first readies its victims in slices of `max_entries`, and up to
/// `between` slices of some tenant's build run between two operations.
fn run(seed: u64, k: usize, slice: Option<(usize, u64)>) -> Run {
    let rules = rules();
    let mut ix = index_with(HOUR, 0);
    ix.set_min_candidates(k);
    let rows = record_removals(&mut ix);
    let mut rng = Rng(seed);
    let mut steps = Rng(seed ^ 0x51ce);
    let mut candidates = Vec::new();
    let now = T0 + 10 * SEC;
    let mut sync = 0;
    let budget = |max_entries| SweepBudget {
        max_entries,
        deadline: None,
    };
    for _ in 0..600 {
        let (t, m, r) = (rng.below(3), rng.below(2), rng.below(12));
        let (tenant, model, replica) = (format!("t{t}"), format!("m{m}"), format!("r{r}"));
        match rng.below(20) {
            0..=13 => {
                let n = 1 + rng.below(12) as usize;
                let blob = rng.below(4) == 0;
                let prefixes = (0..n)
                    .map(|_| {
                        let h = rng.below(120);
                        if blob {
                            legacy(format!("blob-hash-{h:06}").as_bytes(), 16)
                        } else {
                            legacy(&h.to_be_bytes(), 16)
                        }
                    })
                    .collect();
                let stamp = T0 + rng.below(5) as i64 * SEC;
                if let (Some((max_entries, _)), Some(b)) = (slice, rules.quota(&tenant)) {
                    let need = ix.quota_victims_for_ingest(&tenant, b, n);
                    let mut slices = 0;
                    while ix.quota_victims_pending(&tenant, need) {
                        let work = ix.quota_victims_step(&tenant, need, budget(max_entries));
                        assert!(work <= max_entries + 1, "{work}");
                        slices += 1;
                        assert!(slices < 100_000, "the slices make progress");
                    }
                }
                let u = upd(&tenant, &model, "vllm", &replica, prefixes);
                ix.ingest(&at(u, stamp), now, &rules);
            }
            14..=15 => {
                let h = rng.below(120).to_be_bytes();
                let e = event(Type::PrefixEvicted, &tenant, &model, &replica, &h);
                ix.apply_event(&e, now, &rules);
            }
            16 => {
                let e = event(Type::AllCleared, &tenant, &model, &replica, b"");
                ix.apply_event(&e, now, &rules);
            }
            _ => {
                let k = 1 + rng.below(5) as usize;
                candidates.push(format!("{:?}", ix.quota_candidates(&tenant, k)));
            }
        }
        sync += ix.take_quota_sync_builds();
        if let Some((max_entries, between)) = slice {
            for _ in 0..steps.below(between + 1) {
                let t = format!("t{}", steps.below(3));
                let need = 1 + steps.below(40) as usize;
                ix.quota_victims_step(&t, need, budget(max_entries));
            }
        }
    }
    let removals = rows.lock().unwrap().clone();
    Run {
        removals,
        candidates,
        state: sorted_entries(&ix),
        sync,
    }
}

/// Quota heaps readied in slices of 1, 3, 7 and 64 keys, with slices of any tenant's build
/// between operations: the same victims in the same order, the same candidate answers, the
/// same final state as heaps built in one go by the ingest; and far fewer builds on the ingest.
#[test]
fn quota_heaps_readied_in_slices_evict_exactly_like_builds_in_one_go() {
    let (mut sync_sliced, mut sync_one_go) = (0, 0);
    for seed in 1..=8u64 {
        for k in [1usize, 4, 32] {
            let want = run(seed, k, None);
            let quota_evictions = want
                .removals
                .iter()
                .filter(|r| r.starts_with("Quota"))
                .count();
            assert!(quota_evictions > 50, "seed {seed}: {quota_evictions}");
            sync_one_go += want.sync;
            for slice in [(1usize, 3u64), (3, 1), (7, 2), (64, 1)] {
                let got = run(seed, k, Some(slice));
                let what = format!("seed {seed} k {k} slices {slice:?}");
                assert_eq!(got.removals.len(), want.removals.len(), "{what}");
                for (i, (g, w)) in got.removals.iter().zip(&want.removals).enumerate() {
                    assert_eq!(g, w, "{what}: removal #{i}");
                }
                assert_eq!(got.candidates, want.candidates, "{what}");
                assert_eq!(got.state, want.state, "{what}");
                sync_sliced += got.sync;
            }
        }
    }
    // Builds left to the ingest: only heaps run out of live snapshots while in use, and the
    // candidate requests (not readied here).
    assert!(sync_one_go > 100, "{sync_one_go}");
    assert!(sync_sliced < sync_one_go, "{sync_sliced} vs {sync_one_go}");
}

/// A tenant at its quota on a core of many keys (most of other tenants): once its victims are
/// readied in slices, each bounded, its ingest evicts without scanning the core.
#[test]
fn an_ingest_at_the_quota_after_its_victims_are_readied_builds_nothing() {
    let rules = Rules::quota("t", 1000);
    let now = T0 + 10 * SEC;
    let mut ix = index_with(HOUR, 0);
    for i in 0..20u64 {
        let keys = (0..1000u64)
            .map(|j| legacy(&(i << 32 | j).to_be_bytes(), 16))
            .collect();
        ix.ingest(&at(upd("other", "m", "vllm", "r", keys), T0), now, &rules);
    }
    let keys = (0..1000u64).map(|j| legacy(&j.to_be_bytes(), 16)).collect();
    ix.ingest(&at(upd("t", "m", "vllm", "r", keys), T0), now, &rules);
    assert_eq!(ix.take_quota_sync_builds(), 0, "under the quota: no build");
    let need = ix.quota_victims_for_ingest("t", 1000, 10);
    assert_eq!(need, 10);
    let mut slices = 0;
    while ix.quota_victims_pending("t", need) {
        let work = ix.quota_victims_step(
            "t",
            need,
            SweepBudget {
                max_entries: 1024,
                deadline: None,
            },
        );
        assert!(work <= 1025, "{work}");
        slices += 1;
        assert!(slices < 1000);
    }
    // 21,000 key records, 1,024 a slice.
    assert!(slices >= 20, "{slices} slices");
    let keys = (5000..5010u64)
        .map(|j| legacy(&j.to_be_bytes(), 16))
        .collect();
    let out = ix.ingest(&at(upd("t", "m", "vllm", "r", keys), T0 + SEC), now, &rules);
    assert_eq!(out.quota_evicted_keys, 10);
    assert_eq!(ix.take_quota_sync_builds(), 0, "no build on the ingest");
    assert!(!ix.quota_victims_pending("t", 10), "the heap holds more");
}

/// A build of one tenant's heap in progress is dropped whole by the reclaim pass (whose
/// release stage may hand the tenant's id to another): nothing of it survives, and the next
/// readiness starts over.
#[test]
fn the_reclaim_pass_drops_a_quota_build_in_progress() {
    let rules = Rules::quota("t", 10);
    let mut filling = Rules::ttl("gone", SEC);
    let now = T0 + 10 * SEC;
    let mut ix: Index = index_with(HOUR, 0);
    ix.set_min_candidates(2);
    for j in 0..40u64 {
        let u = upd("gone", "m", "vllm", "r", vec![legacy(&j.to_be_bytes(), 16)]);
        ix.ingest(&at(u, now), now, &filling);
        let key = format!("blob-hash-{j:06}");
        let u = upd("t", "m", "vllm", "r", vec![legacy(key.as_bytes(), 16)]);
        ix.ingest(&at(u, now + j as i64), now, &filling);
    }
    let need = ix.quota_victims_for_ingest("t", 10, 1);
    assert_eq!(need, 31);
    let budget = SweepBudget {
        max_entries: 8,
        deadline: None,
    };
    ix.quota_victims_step("t", need, budget);
    assert!(ix.quota_victims_pending("t", need));
    // The sweep expires `gone`; its reclaim pass frees the tenant record (and drops the build).
    ix.sweep(now + 20 * SEC, &filling);
    filling.ttl.clear();
    while ix.cap_prebuild_wanted() {
        ix.cap_prebuild_step(budget);
    }
    while ix.quota_victims_pending("t", need) {
        ix.quota_victims_step("t", need, budget);
    }
    let u = upd(
        "t",
        "m",
        "vllm",
        "r",
        vec![legacy(b"one more blob key", 16)],
    );
    let out = ix.ingest(&at(u, now + SEC), now + SEC, &rules);
    assert_eq!(out.quota_evicted_keys, 31);
    assert_eq!(ix.take_quota_sync_builds(), 0);
    assert_eq!(ix.entry_count(), 10);
}
