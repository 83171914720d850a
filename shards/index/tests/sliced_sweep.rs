//! The sliced TTL sweep (`Index::sweep_begin` / `Index::sweep_step`, docs/BEHAVIOUR.md §6):
//! driven in slices of any size it removes exactly what the one-call sweep removes at the same
//! `now` (same entries and stats rows, same counters, same removal-hook reports in the same
//! order), also when ingests and producer removals reshuffle the key store between two slices;
//! and no slice examines more than its budget.

mod index_support;

use std::sync::{Arc, Mutex};

use index_support::*;
use inferencecache_index::index::{
    EntryCursor, Index, Removed, SweepBudget, SweepOutcome, SweepStep,
};
use inferencecache_index::rules::TenantRules;
use inferencecache_proto::v1alpha1::cache_event::Type;

/// The sweep's one `now`.
const NOW: i64 = T0 + 2 * HOUR;

/// Tenant `t0` has a 10-minute TTL, `t1` LFU and the default (1 h), `t2` the default.
fn rules() -> Rules {
    let mut r = Rules::ttl("t0", 10 * MIN);
    r.lfu.push("t1".into());
    r
}

fn fresh_index() -> Index {
    index_with(HOUR, 0)
}

/// Records every removal-hook report as one comparable line.
fn record(ix: &mut Index) -> Arc<Mutex<Vec<String>>> {
    let rows = Arc::new(Mutex::new(Vec::new()));
    let sink = rows.clone();
    ix.set_removal_sink(Some(Box::new(move |r: &Removed<'_>| {
        let mut buf = [0u8; 8];
        sink.lock().unwrap().push(format!(
            "{:?} {:?} {} {} {} {} {} {:?} {} {}",
            r.reason(),
            r.algorithm(),
            r.tenant(),
            r.model(),
            r.hash_scheme(),
            r.adapter(),
            r.replica(),
            r.prefix_hash(&mut buf),
            r.at_ns(),
            r.reserved()
        ));
    })));
    rows
}

/// Every entry and stats row, sorted (a comparable picture of the state).
fn state(ix: &Index) -> Vec<String> {
    let mut out = Vec::new();
    ix.export_entries(EntryCursor::START, usize::MAX, |e| {
        out.push(format!(
            "e {} {} {} {} {:?} {} {} {} {} {}",
            e.tenant,
            e.model,
            e.scheme,
            e.adapter,
            e.hash,
            e.replica,
            e.tokens,
            e.last_seen,
            e.tier,
            e.access
        ))
    });
    ix.export_stats(0, usize::MAX, |s| {
        out.push(format!(
            "s {} {} {} {} {}",
            s.tenant, s.model, s.replica, s.last_seen, s.stats_reported
        ))
    });
    out.sort();
    out
}

/// Entries in store order (the one-call and the sliced sweep must leave the same order when
/// nothing changes between slices).
fn store_order(ix: &Index) -> Vec<String> {
    let mut out = Vec::new();
    ix.export_entries(EntryCursor::START, usize::MAX, |e| {
        out.push(format!(
            "{} {} {:?} {}",
            e.tenant, e.model, e.hash, e.replica
        ))
    });
    out
}

/// Ingests `n` random updates: three tenants, a few models, schemes and adapters, up to four
/// replicas per key, stamps spread over the two hours before `NOW` (so part of every tenant's
/// entries is expired at `NOW`), and stats rows.
fn populate(ix: &mut Index, rng: &mut Rng, n: usize, rules: &dyn TenantRules) {
    for i in 0..n {
        let tenant = format!("t{}", rng.below(3));
        let model = format!("m{}", rng.below(3));
        let replica = format!("r{}", rng.below(4));
        let ts = NOW - (rng.below(2 * HOUR as u64 / SEC as u64) as i64) * SEC;
        let mut prefixes = Vec::new();
        for _ in 0..1 + rng.below(4) {
            let h = rng.below(400).to_be_bytes();
            let mut p = legacy(&h, 16);
            if rng.below(4) == 0 {
                p.adapter_id = "lora".into();
            }
            prefixes.push(p);
        }
        if rng.below(3) == 0 {
            let a = rng.below(50).to_be_bytes();
            let b = (1000 + rng.below(50)).to_be_bytes();
            prefixes.push(chain_entry(&[&a, &b], 8));
        }
        let scheme = if rng.below(5) == 0 { "sglang" } else { "vllm" };
        let mut u = at(upd(&tenant, &model, scheme, &replica, prefixes), ts);
        if i % 7 == 0 {
            u = with_stats(u, 0.5, 0.1);
        }
        ix.ingest(&u, NOW, rules);
    }
}

/// Runs a whole pass in slices of `max_entries`, calling `between` after every unfinished
/// slice; returns the outcome and every step.
fn sliced(
    ix: &mut Index,
    rules: &dyn TenantRules,
    max_entries: usize,
    mut between: impl FnMut(&mut Index, usize),
) -> (SweepOutcome, Vec<SweepStep>) {
    ix.sweep_begin(NOW);
    let mut steps = Vec::new();
    for i in 0.. {
        assert!(i < 1_000_000, "the pass does not finish");
        let step = ix.sweep_step(
            rules,
            SweepBudget {
                max_entries,
                deadline: None,
            },
        );
        steps.push(step);
        if let Some(out) = step.finished {
            assert!(!ix.sweep_in_progress());
            return (out, steps);
        }
        assert!(step.cut_short);
        between(ix, i);
    }
    unreachable!()
}

/// Without changes between slices, any slice size gives exactly the one-call sweep: the same
/// outcome, the same removal reports in the same order, the same state, the same store order.
#[test]
fn sliced_sweep_equals_one_call_sweep() {
    let rules = rules();
    for seed in 1..=8u64 {
        for max in [1usize, 3, 17, 256, 100_000] {
            let build = || {
                let mut ix = fresh_index();
                populate(&mut ix, &mut Rng(seed), 600, &rules);
                ix
            };
            let mut one = build();
            let one_rows = record(&mut one);
            let want = one.sweep(NOW, &rules);
            let mut ix = build();
            let rows = record(&mut ix);
            let (got, _) = sliced(&mut ix, &rules, max, |_, _| {});
            assert!(want.ttl_evicted.total() > 0 && want.stats_rows_removed > 0);
            assert_eq!(got, want, "seed {seed} max {max}");
            assert_eq!(*rows.lock().unwrap(), *one_rows.lock().unwrap());
            assert_eq!(state(&ix), state(&one));
            assert_eq!(store_order(&ix), store_order(&one));
            assert_eq!(ix.entry_count(), one.entry_count());
            assert_eq!(ix.stats_row_count(), one.stats_row_count());
            for t in ["t0", "t1", "t2"] {
                for m in ["m0", "m1", "m2"] {
                    assert_eq!(ix.cache_state(t, m), one.cache_state(t, m));
                }
            }
        }
    }
}

/// Between slices, fresh ingests (new keys appended to the store, refreshes) and producer
/// removals of fresh entries (PREFIX_EVICTED, ALL_CLEARED: keys leave the visited and the
/// unvisited part of the store and others move into their slots) change nothing about what the
/// pass removes: the same expired entries and stats rows as a one-call sweep (before or after
/// those changes, which commute with it), the same counters, and the same final state. Removal
/// reports may come in another order (the store's order changed), so they compare as sets.
#[test]
fn sliced_sweep_under_interleaved_changes_removes_what_one_call_removes() {
    let rules = rules();
    for seed in 1..=12u64 {
        for max in [1usize, 5, 40] {
            let mut ix = fresh_index();
            let mut rng = Rng(seed);
            populate(&mut ix, &mut rng, 500, &rules);
            // The interleaved changes, drawn once so both runs apply the same list.
            let changes: Vec<Change> = (0..400).map(|_| Change::draw(&mut rng)).collect();
            let mut one = fresh_index();
            populate(&mut one, &mut Rng(seed), 500, &rules);
            for c in &changes {
                c.apply(&mut one, &rules);
            }
            let one_rows = record(&mut one);
            let want = one.sweep(NOW, &rules);
            let rows = record(&mut ix);
            let mut next = changes.iter();
            let (got, steps) = sliced(&mut ix, &rules, max, |ix, _| {
                if let Some(c) = next.next() {
                    c.apply(ix, &rules);
                }
            });
            for c in next {
                c.apply(&mut ix, &rules);
            }
            assert!(steps.len() > 10, "seed {seed}: the pass ran in slices");
            assert_eq!(got, want, "seed {seed} max {max}");
            let sorted = |r: &Arc<Mutex<Vec<String>>>| {
                let mut v = r.lock().unwrap().clone();
                v.sort();
                v
            };
            assert_eq!(sorted(&rows), sorted(&one_rows), "seed {seed} max {max}");
            assert_eq!(state(&ix), state(&one), "seed {seed} max {max}");
            assert_eq!(ix.entry_count(), one.entry_count());
        }
    }
}

/// One change made between two slices; none touches an entry expired at `NOW`, so it commutes
/// with the sweep.
#[derive(Clone, Debug)]
enum Change {
    /// A fresh ingest by replica `rf` (new keys and refreshes of its own keys), with stats.
    Fresh { tenant: u64, model: u64, hash: u64 },
    /// PREFIX_EVICTED of one of `rf`'s keys.
    Evict { tenant: u64, model: u64, hash: u64 },
    /// ALL_CLEARED of `rf` in one model scope.
    Clear { tenant: u64, model: u64 },
}

impl Change {
    fn draw(rng: &mut Rng) -> Change {
        let (tenant, model, hash) = (rng.below(3), rng.below(3), 5000 + rng.below(60));
        match rng.below(10) {
            0..=5 => Change::Fresh {
                tenant,
                model,
                hash,
            },
            6..=8 => Change::Evict {
                tenant,
                model,
                hash,
            },
            _ => Change::Clear { tenant, model },
        }
    }

    fn apply(&self, ix: &mut Index, rules: &dyn TenantRules) {
        match *self {
            Change::Fresh {
                tenant,
                model,
                hash,
            } => {
                let u = upd(
                    &format!("t{tenant}"),
                    &format!("m{model}"),
                    "vllm",
                    "rf",
                    vec![legacy(&hash.to_be_bytes(), 4)],
                );
                ix.ingest(&with_stats(at(u, NOW), 0.1, 0.2), NOW, rules);
            }
            Change::Evict {
                tenant,
                model,
                hash,
            } => {
                let e = event(
                    Type::PrefixEvicted,
                    &format!("t{tenant}"),
                    &format!("m{model}"),
                    "rf",
                    &hash.to_be_bytes(),
                );
                ix.apply_event(&e, NOW, rules);
            }
            Change::Clear { tenant, model } => {
                let e = event(
                    Type::AllCleared,
                    &format!("t{tenant}"),
                    &format!("m{model}"),
                    "rf",
                    b"",
                );
                ix.apply_event(&e, NOW, rules);
            }
        }
    }
}

/// The case a plain position cursor gets wrong: a key removed from the already visited part of
/// the store is replaced by the last key, which the pass has not visited yet. The pass must
/// still visit (and here remove) it.
#[test]
fn a_key_moved_into_the_visited_part_is_still_swept() {
    let rules = rules();
    let mut ix = fresh_index();
    // Store order: the fresh key `rf` holds first, then 99 fresh keys, then one expired key.
    ix.ingest(
        &at(upd_r("rf", vec![legacy(b"first", 4)]), NOW),
        NOW,
        &rules,
    );
    for i in 0..99u32 {
        let u = at(upd_r("r1", vec![legacy(&i.to_be_bytes(), 4)]), NOW);
        ix.ingest(&u, NOW, &rules);
    }
    let stale = at(upd_r("r2", vec![legacy(b"stale", 4)]), NOW - 2 * HOUR);
    ix.ingest(&stale, NOW, &rules);
    ix.sweep_begin(NOW);
    let budget = SweepBudget {
        max_entries: 50,
        deadline: None,
    };
    let step = ix.sweep_step(&rules, budget);
    assert!(step.cut_short && step.keys == 50);
    // The visited key `first` leaves; the last key (`stale`) would take its slot.
    ix.apply_event(&event(Type::AllCleared, "t", "m", "rf", b""), NOW, &rules);
    let mut out = None;
    for _ in 0..10 {
        if let Some(o) = ix.sweep_step(&rules, budget).finished {
            out = Some(o);
            break;
        }
    }
    let out = out.expect("the pass finished");
    assert_eq!(out.ttl_evicted.total(), 1, "the expired key was visited");
    assert_eq!(ix.entry_count(), 99);
}

/// A stretch of free key slots (keys removed side by side) longer than a slice's budget is
/// passed over in slices: each slice resumes after the free slots the last one counted, so the
/// pass finishes and sweeps the expired key after them. (A slice that counted free slots
/// without moving the resume mark re-counted the same ones for ever.)
#[test]
fn a_stretch_of_free_slots_longer_than_a_slice_is_passed() {
    let rules = rules();
    let mut ix = fresh_index();
    for i in 0..60u32 {
        let u = at(upd_r("r1", vec![legacy(&i.to_be_bytes(), 4)]), NOW);
        ix.ingest(&u, NOW, &rules);
    }
    let stale = at(upd_r("r2", vec![legacy(b"stale", 4)]), NOW - 2 * HOUR);
    ix.ingest(&stale, NOW, &rules);
    for i in 5..55u32 {
        let e = event(Type::PrefixEvicted, "t", "m", "r1", &i.to_be_bytes());
        ix.apply_event(&e, NOW, &rules);
    }
    assert_eq!(ix.entry_count(), 11);
    ix.sweep_begin(NOW);
    let budget = SweepBudget {
        max_entries: 4,
        deadline: None,
    };
    let mut out = None;
    for _ in 0..100 {
        if let Some(o) = ix.sweep_step(&rules, budget).finished {
            out = Some(o);
            break;
        }
    }
    let out = out.expect("the pass finished");
    assert_eq!(
        out.ttl_evicted.total(),
        1,
        "the expired key after the free slots was swept"
    );
    assert_eq!(ix.entry_count(), 10);
}

/// No slice examines more than its entry budget (plus the rest of the key it stopped in: a key's
/// holders are never split), every slice but the last is cut short, and the slices together
/// visit every key once. Without slicing the first step would do the whole pass.
#[test]
fn no_slice_exceeds_its_entry_budget() {
    let rules = rules();
    let mut ix = fresh_index();
    let mut rng = Rng(99);
    populate(&mut ix, &mut rng, 4000, &rules);
    let keys = ix.key_count() as usize;
    let entries = ix.entry_count() as usize;
    let stats = ix.stats_row_count();
    const MAX: usize = 64;
    const MAX_HOLDERS: usize = 4; // replicas r0..r3
    let (_, steps) = sliced(&mut ix, &rules, MAX, |_, _| {});
    for s in &steps {
        assert!(s.entries < MAX + MAX_HOLDERS, "{s:?}");
    }
    assert!(steps.len() >= (entries + stats) / (MAX + MAX_HOLDERS));
    assert_eq!(steps.iter().map(|s| s.keys).sum::<usize>(), keys);
    assert!(steps[..steps.len() - 1].iter().all(|s| s.cut_short));
}

/// The time budget ends a slice too: with a deadline already past, a slice still makes progress
/// (a whole clock period of keys) and then stops.
#[test]
fn a_slice_stops_at_its_deadline() {
    let rules = rules();
    let mut ix = fresh_index();
    populate(&mut ix, &mut Rng(5), 2000, &rules);
    ix.sweep_begin(NOW);
    let past = std::time::Instant::now();
    let step = ix.sweep_step(
        &rules,
        SweepBudget {
            max_entries: usize::MAX,
            deadline: Some(past),
        },
    );
    assert!(step.cut_short && step.finished.is_none());
    assert!(step.keys > 0 && step.keys < ix.key_count() as usize);
    assert!(ix.sweep_in_progress());
}

/// Removals count towards the clock reads: when every key visited loses its entry, a slice past
/// its deadline stops after a few keys, not after a whole clock period of them (at 10M entries
/// 64 keys' removals overran a 0.5 ms slice by another 0.5 ms).
#[test]
fn removals_bring_the_deadline_check_forward() {
    let rules = rules();
    let mut ix = fresh_index();
    for i in 0u32..500 {
        let p = legacy(&i.to_be_bytes(), 16);
        let u = at(upd("t0", "m0", "vllm", "r0", vec![p]), NOW - HOUR);
        ix.ingest(&u, NOW - HOUR, &rules);
    }
    assert_eq!(ix.key_count(), 500);
    ix.sweep_begin(NOW);
    let step = ix.sweep_step(
        &rules,
        SweepBudget {
            max_entries: usize::MAX,
            deadline: Some(std::time::Instant::now()),
        },
    );
    assert!(step.cut_short, "{step:?}");
    assert!((1..=8).contains(&step.keys), "{step:?}");
    assert_eq!(
        ix.key_count() as usize,
        500 - step.keys,
        "each key visited was removed"
    );
}

/// A new pass abandons an unfinished one and starts over (the store's visited mark included).
#[test]
fn begin_restarts_an_unfinished_pass() {
    let rules = rules();
    let build = || {
        let mut ix = fresh_index();
        populate(&mut ix, &mut Rng(3), 800, &rules);
        ix
    };
    let mut one = build();
    let want = one.sweep(NOW, &rules);
    let mut ix = build();
    ix.sweep_begin(NOW - HOUR);
    let small = SweepBudget {
        max_entries: 10,
        deadline: None,
    };
    let before = ix.entry_count();
    assert!(ix.sweep_step(&rules, small).cut_short);
    let early = before - ix.entry_count();
    let got = ix.sweep(NOW, &rules);
    assert_eq!(early + got.ttl_evicted.total(), want.ttl_evicted.total());
    assert_eq!(state(&ix), state(&one));
}
