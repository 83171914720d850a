//! The sliced reclaim pass and the keyspace bounds (issue 30: no client can wedge a core).
//!
//! * The pass is linear in what it frees and runs in the sweep's slices: a slice visits at most
//!   its budget of records and names, and interleaving any ingest, event or cap eviction between
//!   two slices never frees a name or record still referred to (the catalog check runs after
//!   every slice), and frees everything unreferenced by the end of a quiet pass.
//! * Distinct keyspaces per `(tenant, model)` and per core are bounded: an update that would
//!   create one more is refused whole (`rejected_keyspaces_full`), one on known adapters is not;
//!   the room comes back once the reclaim pass freed keyspaces without keys.

mod index_support;

use index_support::*;
use inferencecache_index::index::{
    ADMISSION_STEP_PREFIXES, Admission, Index, IndexConfig, PartBudget, SweepBudget,
};
use inferencecache_index::rules::NoRules;
use inferencecache_proto::v1alpha1::{CacheStateUpdate, cache_event::Type};

const NR: NoRules = NoRules;

fn index_cfg(f: impl FnOnce(&mut IndexConfig)) -> Index {
    let mut cfg = IndexConfig {
        default_ttl_ns: 10 * MIN,
        max_entries: 0,
        ..IndexConfig::default()
    };
    f(&mut cfg);
    Index::new(cfg)
}

/// One message of `n` prefixes, each under its own adapter `a{first + i}`.
fn adapters(tenant: &str, model: &str, first: usize, n: usize, ts: i64) -> CacheStateUpdate {
    let prefixes = (first..first + n)
        .map(|i| legacy_adapter(&(i as u64).to_be_bytes(), 16, &format!("a{i}")))
        .collect();
    at(upd(tenant, model, "vllm", "r", prefixes), ts)
}

/// The issue's shape: one tenant, many distinct adapter ids, all expired at the sweep. Driven
/// in slices of at most 64 records, every slice visits at most its budget (plus one record's
/// rows) and the pass frees every keyspace and adapter name.
#[test]
fn a_scope_full_of_dead_keyspaces_is_reclaimed_in_bounded_slices() {
    const N: usize = 50_000;
    let mut ix = index_cfg(|c| c.max_keyspaces_per_model = N);
    for first in (0..N).step_by(1000) {
        let out = ix.ingest(&adapters("t", "m", first, 1000, T0), T0, &NR);
        assert!(!out.rejected_keyspaces_full);
    }
    assert_eq!(ix.keyspace_count(), N);
    let now = T0 + HOUR;
    ix.sweep_begin(now);
    let budget = SweepBudget {
        max_entries: 64,
        deadline: None,
    };
    let mut slices = 0;
    let out = loop {
        let step = ix.sweep_step(&NR, budget);
        slices += 1;
        assert!(step.entries <= 64 + 1, "slice {slices}: {step:?}");
        if let Some(out) = step.finished {
            break out;
        }
    };
    assert!(slices > 1_000, "the reclaim ran in slices ({slices})");
    assert_eq!(
        out.strings_freed,
        N as u64 + 3,
        "adapters, tenant, scheme, replica"
    );
    assert_eq!(ix.keyspace_count(), 0);
    // The model's name goes once the entries gauge published its 0.
    assert_eq!(ix.string_usage().0, 1);
    ix.drain_gauge_updates(|_, _| {});
    assert_eq!(ix.reclaim(), 1);
    assert_eq!(ix.string_usage(), (0, 0));
    ix.check_catalog();
    // The freed ids are reused.
    ix.ingest(&adapters("t", "m", 0, 10, now), now, &NR);
    assert_eq!(ix.keyspace_count(), 10);
    ix.check_catalog();
}

/// Anything may happen between two slices of the reclaim pass: new and revived adapters,
/// scopes and tenants, stats rows, ALL_CLEARED and PREFIX_EVICTED events, other sweeps' work.
/// After every slice the catalog is consistent and no name in use was freed; once a quiet
/// pass ran, exactly the names in use are left.
#[test]
fn mutations_between_reclaim_slices_never_free_what_is_in_use() {
    for seed in 1..=6u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut ix = index_cfg(|c| c.max_holders_per_key = 4);
        let mut now = T0;
        for round in 0..4 {
            // Old and new names, so the pass both frees and keeps.
            for _ in 0..200 {
                mutate(&mut ix, &mut rng, now);
            }
            now += 6 * MIN; // part of the entries expire at the next sweep
            ix.sweep_begin(now);
            let budget = SweepBudget {
                // Small slices, yet more work than the churn between two adds (the sweep's
                // key stage, like any sliced scan, must outpace what is appended behind it).
                max_entries: 8 + rng.below(56) as usize,
                deadline: None,
            };
            let mut guard = 0;
            while ix.sweep_step(&NR, budget).finished.is_none() {
                for _ in 0..rng.below(3) {
                    mutate(&mut ix, &mut rng, now);
                }
                ix.check_catalog();
                guard += 1;
                assert!(guard < 100_000, "seed {seed} round {round}: the pass ends");
            }
            ix.check_catalog();
        }
        // A quiet pass (the gauge's zeros published): what is left is exactly what is in use.
        ix.drain_gauge_updates(|_, _| {});
        ix.reclaim();
        ix.reclaim();
        ix.check_catalog();
        let in_use = names_in_use(&ix);
        assert_eq!(ix.string_usage().0, in_use, "seed {seed}");
    }
}

/// One random operation on a small name space (tenants t0..t3, models m0..m2, adapters
/// a0..a30, replicas r0..r5), stamped up to 10 minutes in the past.
fn mutate(ix: &mut Index, rng: &mut Rng, now: i64) {
    let t = format!("t{}", rng.below(4));
    let m = format!("m{}", rng.below(3));
    let r = format!("r{}", rng.below(6));
    let ts = now - rng.below(10) as i64 * MIN;
    match rng.below(10) {
        0..=5 => {
            let prefixes = (0..1 + rng.below(4))
                .map(|_| {
                    let a = format!("a{}", rng.below(31));
                    let h = [rng.below(8) as u8];
                    legacy_adapter(&h, 16, &a)
                })
                .collect();
            let mut u = at(upd(&t, &m, "vllm", &r, prefixes), ts);
            if rng.below(3) == 0 {
                u = with_stats(u, 0.5, 0.1);
            }
            ix.ingest(&u, now, &NR);
        }
        6 => {
            let u = with_stats(at(upd(&t, &m, "vllm", &r, vec![]), ts), 0.2, 0.3);
            ix.ingest(&u, now, &NR);
        }
        7 => {
            ix.apply_event(&event(Type::AllCleared, &t, &m, &r, b""), now, &NR);
        }
        _ => {
            let h = [rng.below(8) as u8];
            ix.apply_event(&event(Type::PrefixEvicted, &t, &m, &r, &h), now, &NR);
        }
    }
}

/// Distinct names the entries and stats rows use.
fn names_in_use(ix: &Index) -> usize {
    let mut names = std::collections::BTreeSet::new();
    for e in ix.dump_entries() {
        names.extend([e.tenant, e.model, e.scheme, e.adapter, e.replica]);
    }
    for t in 0..4 {
        for m in 0..3 {
            let (t, m) = (format!("t{t}"), format!("m{m}"));
            let st = ix.cache_state(&t, &m);
            if !st.replicas.is_empty() {
                names.extend(st.replicas.iter().map(|r| r.replica_id.clone()));
                names.extend([t, m]);
            }
        }
    }
    names.len()
}

/// The per-`(tenant, model)` bound: a message that would create one keyspace too many is
/// refused whole; one naming only known adapters is applied; other models are unaffected;
/// after the keyspaces' keys expire and the sweep's reclaim ran, there is room again.
#[test]
fn keyspaces_per_model_are_bounded() {
    let mut ix = index_cfg(|c| c.max_keyspaces_per_model = 100);
    assert!(
        !ix.ingest(&adapters("t", "m", 0, 90, T0), T0, &NR)
            .rejected_keyspaces_full
    );
    let entries = ix.entry_count();
    let out = ix.ingest(&adapters("t", "m", 85, 20, T0), T0, &NR);
    assert!(out.rejected_keyspaces_full, "105 would not fit");
    assert!(!out.rejected_string_table_full);
    assert_eq!(
        (ix.entry_count(), out.upserts),
        (entries, 0),
        "refused whole"
    );
    assert_eq!(ix.model_keyspace_count("t", "m"), 90);
    // Known adapters only (more prefixes than the room): applied.
    let out = ix.ingest(&adapters("t", "m", 0, 90, T0 + SEC), T0 + SEC, &NR);
    assert!(!out.rejected_keyspaces_full);
    // Exactly to the bound: applied; one more: refused.
    assert!(
        !ix.ingest(&adapters("t", "m", 85, 15, T0), T0, &NR)
            .rejected_keyspaces_full
    );
    assert_eq!(ix.model_keyspace_count("t", "m"), 100);
    assert!(
        ix.ingest(&adapters("t", "m", 100, 1, T0), T0, &NR)
            .rejected_keyspaces_full
    );
    // Another model of the same tenant has its own bound.
    assert!(
        !ix.ingest(&adapters("t", "m2", 0, 100, T0), T0, &NR)
            .rejected_keyspaces_full
    );
    // The keys expire: the sweep's reclaim pass frees the keyspaces.
    ix.sweep(T0 + HOUR, &NR);
    assert_eq!(ix.keyspace_count(), 0);
    assert!(
        !ix.ingest(&adapters("t", "m", 200, 100, T0 + HOUR), T0 + HOUR, &NR)
            .rejected_keyspaces_full
    );
    ix.check_catalog();
}

/// The per-core bound counts every model's keyspaces; a full table runs the reclaim pass at
/// once (as for names) before refusing.
#[test]
fn keyspaces_per_core_are_bounded_and_a_full_table_reclaims_first() {
    let mut ix = index_cfg(|c| c.max_keyspaces = 50);
    assert!(
        !ix.ingest(&adapters("t0", "m", 0, 30, T0), T0, &NR)
            .rejected_keyspaces_full
    );
    assert!(
        ix.ingest(&adapters("t1", "m", 0, 30, T0), T0, &NR)
            .rejected_keyspaces_full
    );
    assert!(
        !ix.ingest(&adapters("t1", "m", 0, 20, T0), T0, &NR)
            .rejected_keyspaces_full
    );
    assert_eq!(ix.keyspace_count(), 50);
    // t0's keys go (ALL_CLEARED): its keyspaces are dead but still counted until reclaimed;
    // the next message that does not fit reclaims them at once (at most once a second: the
    // refusal above already ran a pass at T0).
    ix.apply_event(&event(Type::AllCleared, "t0", "m", "r", b""), T0, &NR);
    let now = T0 + 2 * SEC;
    let out = ix.ingest(&adapters("t2", "m", 0, 30, now), now, &NR);
    assert!(!out.rejected_keyspaces_full, "reclaimed before refusing");
    assert_eq!(ix.keyspace_count(), 50);
    ix.check_catalog();
}

/// The reclaim pass drops the quota heaps (they may name ids it frees) without visiting them:
/// their snapshots' blob references are given back afterwards in the cap build's slices, each
/// within its budget, even on an index without a global cap; the quota keeps evicting the
/// oldest keys after that (its heap is rebuilt on the next need).
#[test]
fn the_quota_heaps_the_reclaim_pass_drops_are_released_in_slices() {
    let rules = Rules::quota("t", 100);
    let mut ix = index_cfg(|_| {});
    // 300 keys of 16-byte hashes (blob keys), oldest first: the quota keeps the newest 100.
    for i in 0..300u64 {
        let mut h = [0u8; 16];
        h[..8].copy_from_slice(&i.to_be_bytes());
        let u = at(
            upd("t", "m", "vllm", "r", vec![legacy(&h, 16)]),
            T0 + i as i64 * SEC,
        );
        ix.ingest(&u, T0 + i as i64 * SEC, &rules);
    }
    assert_eq!(ix.tenant_prefix_count("t"), 100);
    // Another tenant's keys expire, so the pass frees records (and reaches its release stage).
    ix.ingest(&at(adapters("u", "m", 0, 50, T0), T0), T0, &rules);
    let now = T0 + 11 * MIN;
    ix.sweep(now, &rules);
    assert!(!ix.has_tenant_model("u", "m"));
    ix.check_catalog();
    assert!(
        ix.cap_prebuild_wanted(),
        "the dropped quota heap is left to the cap build's slices"
    );
    let mut slices = 0;
    while ix.cap_prebuild_wanted() {
        slices += 1;
        assert!(slices < 1000, "the release never ends");
        let step = ix.cap_prebuild_step(SweepBudget {
            max_entries: 16,
            deadline: None,
        });
        assert!(
            step.entries <= 16,
            "a slice handled {} snapshots",
            step.entries
        );
    }
    assert!(slices > 1, "released in {slices} slice(s)");
    // The quota still evicts the oldest key first.
    let mut h = [0u8; 16];
    h[..8].copy_from_slice(&1000u64.to_be_bytes());
    let u = at(upd("t", "m", "vllm", "r", vec![legacy(&h, 16)]), now);
    ix.ingest(&u, now, &rules);
    assert_eq!(ix.tenant_prefix_count("t"), 100);
    let oldest: Vec<_> = ix
        .dump_entries()
        .into_iter()
        .filter(|e| e.tenant == "t")
        .map(|e| u64::from_be_bytes(e.hash[..8].try_into().unwrap()))
        .min()
        .into_iter()
        .collect();
    assert_eq!(oldest, vec![201]);
    ix.check_catalog();
}

/// The cap heap may still hold stale snapshots of a tenant whose keys are all gone when the
/// reclaim pass unlinks that tenant's record (the snapshots go only at the pass's release
/// stage). A cap eviction in between pops them: it must drop them as stale, not fail looking up
/// the tenant. (The adversarial soak's hostile mix hit this on a server core.) Every cut of the
/// pass is tried: a fresh index per cut, the pass run for that budget, then an ingest at the cap.
#[test]
fn a_cap_eviction_between_a_tenant_unlinked_and_released_drops_its_stale_snapshots() {
    let rules = NoRules;
    for cut in 1..40usize {
        let mut ix = index_cfg(|c| c.max_entries = 10);
        ix.set_min_candidates(64);
        // The oldest keys belong to `gone`; `keep` fills the cap, and one more ingest builds
        // the cap heap (every entry a candidate), evicting one of `gone`'s.
        for i in 0..5u64 {
            let u = at(
                upd("gone", "m", "vllm", "r", vec![legacy(&i.to_be_bytes(), 16)]),
                T0,
            );
            ix.ingest(&u, T0, &rules);
        }
        for i in 0..6u64 {
            let u = at(
                upd(
                    "keep",
                    "m",
                    "vllm",
                    "r",
                    vec![legacy(&(100 + i).to_be_bytes(), 16)],
                ),
                T0 + SEC,
            );
            ix.ingest(&u, T0 + SEC, &rules);
        }
        assert_eq!(ix.entry_count(), 10);
        // `gone`'s replica clears: its keys leave, their snapshots stay in the heap, stale.
        let e = event(Type::AllCleared, "gone", "m", "r", b"");
        ix.apply_event(&e, T0 + 2 * SEC, &rules);
        assert!(!ix.has_tenant_model("gone", "m"));
        ix.reclaim_step(SweepBudget {
            max_entries: cut,
            deadline: None,
        });
        ix.check_catalog();
        // Over the cap: the heap's first snapshots are `gone`'s.
        for i in 0..6u64 {
            let u = at(
                upd(
                    "keep",
                    "m",
                    "vllm",
                    "r",
                    vec![legacy(&(200 + i).to_be_bytes(), 16)],
                ),
                T0 + 3 * SEC,
            );
            ix.ingest(&u, T0 + 3 * SEC, &rules);
        }
        assert_eq!(ix.entry_count(), 10, "cut {cut}");
        ix.check_catalog();
    }
}

/// The check that a message's keyspaces fit runs in bounded steps when it must look its
/// adapters up (a `(tenant, model)` at its limit): a message of many known adapters and one new
/// one is refused whole after several steps, each looking up at most `ADMISSION_STEP_PREFIXES`
/// adapters and applying nothing; the same message without the new adapter is admitted after
/// its steps and applied. Without the steps the whole message was looked up in one step
/// (7.3 ms of core time for 65,536 adapters, `examples/ingest_part_cost.rs`).
#[test]
fn a_large_message_at_the_keyspace_limit_is_checked_in_steps() {
    const LIMIT: usize = 4_096;
    const LEN: usize = 6 * ADMISSION_STEP_PREFIXES;
    let mut ix = index_cfg(|c| c.max_keyspaces_per_model = LIMIT);
    assert!(
        !ix.ingest(&adapters("t", "m", 0, LIMIT, T0), T0, &NR)
            .rejected_keyspaces_full
    );
    let entries = ix.entry_count();
    // Known adapters in turn (each a look-up), the last prefix a new one.
    let message = |last_new: bool| {
        let mut u = adapters("t", "m", 0, LEN, T0);
        for (i, p) in u.prefixes.iter_mut().enumerate() {
            p.adapter_id = format!("a{}", i % LIMIT);
            p.prefix_hash = ((1 << 40) + i as u64).to_be_bytes().to_vec();
        }
        if last_new {
            u.prefixes.last_mut().unwrap().adapter_id = "new".into();
        }
        u
    };
    let steps = |ix: &mut Index, u: &CacheStateUpdate| {
        let mut admission = Admission::default();
        for step in 1..=LEN {
            let (out, end) = ix.ingest_part_admitted(
                u,
                0..u.prefixes.len(),
                PartBudget::UNBOUNDED,
                &mut admission,
                T0,
                &NR,
            );
            if !out.admission_pending {
                return (step, out, end);
            }
            assert_eq!((end, out.upserts), (0, 0), "a pending step applies nothing");
            assert_eq!(ix.entry_count(), entries);
        }
        panic!("never decided");
    };
    let (taken, out, _) = steps(&mut ix, &message(true));
    assert!(out.rejected_keyspaces_full, "{out:?}");
    assert_eq!(ix.entry_count(), entries, "refused whole");
    // The look-ups, ADMISSION_STEP_PREFIXES per step.
    assert!(taken >= LEN / ADMISSION_STEP_PREFIXES, "{taken} steps");
    let (taken, out, end) = steps(&mut ix, &message(false));
    assert!(!out.rejected_keyspaces_full, "{out:?}");
    // The look-ups, then the part in a step of its own.
    assert!(taken > LEN / ADMISSION_STEP_PREFIXES, "{taken} steps");
    assert_eq!((end, out.upserts), (LEN, LEN as u64));
    assert_eq!(ix.entry_count(), entries + LEN as u64);
}
