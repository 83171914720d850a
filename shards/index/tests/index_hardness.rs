//! Resource bounds of one core's index: interned names are reclaimed
//! once nothing refers to them and bounded in bytes; holders per key and stats rows are bounded;
//! a hot key's holders are found in O(1).

mod index_support;

use index_support::*;
use inferencecache_index::index::{Index, IndexConfig, Strategy};
use inferencecache_index::rules::NoRules;
use inferencecache_proto::v1alpha1::{CacheStateUpdate, cache_event};

const NR: NoRules = NoRules;

fn index_cfg(f: impl FnOnce(&mut IndexConfig)) -> Index {
    let mut cfg = IndexConfig {
        default_ttl_ns: 10 * MIN,
        // The reclaim an ingest runs on a full table is time-budgeted (250 µs); a test thread
        // preempted on a shared machine would see it cut short and refuse (flaky, 1 in 40).
        reclaim_on_full_budget: std::time::Duration::from_secs(5),
        ..IndexConfig::default()
    };
    f(&mut cfg);
    Index::new(cfg)
}

/// A message naming a tenant but carrying neither an applied prefix nor stats interns nothing.
#[test]
fn names_of_a_message_that_stores_nothing_are_not_kept() {
    let mut ix = index();
    for i in 0..100 {
        let tenant = format!("tenant-{i}-{}", "x".repeat(1000));
        // No prefixes at all.
        ix.ingest(&upd(&tenant, "m", "vllm", "r", vec![]), T0, &NR);
        // Prefixes but no scheme: nothing is indexed.
        ix.ingest(&upd(&tenant, "m", "", "r", vec![legacy(b"p", 16)]), T0, &NR);
        // Only malformed chains (lengths differ): dropped, nothing indexed.
        let mut bad = chain_entry(&[b"a", b"b"], 16);
        bad.block_token_counts.pop();
        let out = ix.ingest(&upd(&tenant, "m", "vllm", "r", vec![bad]), T0, &NR);
        assert_eq!(out.malformed_dropped, 1);
    }
    assert_eq!(ix.string_usage(), (0, 0));
    assert_eq!(ix.entry_count(), 0);
}

/// Every name is freed once the entries and stats rows that used it are swept; what is still
/// stored keeps its names.
#[test]
fn swept_names_are_reclaimed() {
    let mut ix = index_cfg(|_| {});
    ix.ingest(&upd_r("keep", vec![legacy(b"k", 16)]), T0 + 9 * MIN, &NR);
    let base = ix.string_usage();
    assert_eq!(
        base,
        (5, "t".len() + "m".len() + "vllm".len() + "keep".len())
    );
    for i in 0..200 {
        let u = upd(
            &format!("tenant-{i}"),
            &format!("model-{i}"),
            &format!("scheme-{i}"),
            &format!("replica-{i}"),
            vec![legacy_adapter(b"p", 16, &format!("adapter-{i}"))],
        );
        ix.ingest(&u, T0, &NR);
        let stats_only = with_stats(upd("t", "m", "", &format!("stats-{i}"), vec![]), 0.5, 0.1);
        ix.ingest(&stats_only, T0, &NR);
    }
    assert_eq!(ix.string_usage().0, 5 + 200 * 6);
    assert_eq!(ix.stats_row_count(), 200);
    // Nothing expired yet: nothing is freed.
    let out = ix.sweep(T0 + MIN, &NR);
    assert_eq!(out.strings_freed, 0);
    assert_eq!(ix.string_usage().0, 5 + 200 * 6);
    let out = ix.sweep(T0 + 10 * MIN, &NR);
    assert_eq!(out.stats_rows_removed, 200);
    // A drained model keeps its name until its 0 is published (the server publishes the
    // gauge after every sweep), then the next pass frees it.
    assert_eq!(out.strings_freed, 200 * 5);
    let mut zeros = 0;
    ix.drain_gauge_updates(|_, c| zeros += (c == 0) as usize);
    assert_eq!(zeros, 200);
    assert_eq!(ix.sweep(T0 + 10 * MIN, &NR).strings_freed, 200);
    assert_eq!(ix.string_usage(), base);
    assert_eq!(ix.stats_row_count(), 0);
    let (_, rows) = route(&mut ix, &q_exact(b"k"), T0 + 10 * MIN, &NR);
    assert_eq!(names(&rows), ["keep"]);
}

/// Names freed by ALL_CLEARED and PREFIX_EVICTED are reclaimed at the next sweep, and a freed
/// id reused by a new name never renames what is still stored.
#[test]
fn reused_ids_never_rename_live_entries() {
    let mut ix = index_cfg(|_| {});
    for r in ["a", "b", "c", "d"] {
        ix.ingest(
            &with_stats(upd_r(r, vec![legacy(b"p", 16)]), 0.5, 0.1),
            T0,
            &NR,
        );
    }
    let clear = event(cache_event::Type::AllCleared, "t", "m", "b", b"");
    assert_eq!(ix.apply_event(&clear, T0, &NR).entries_removed, 1);
    let evict = event(cache_event::Type::PrefixEvicted, "t", "m", "c", b"p");
    assert_eq!(ix.apply_event(&evict, T0, &NR).entries_removed, 1);
    // "c" still has its stats row: only "b" is unreferenced.
    assert_eq!(ix.sweep(T0 + MIN, &NR).strings_freed, 1);
    for r in ["e", "f", "g"] {
        ix.ingest(&upd_r(r, vec![legacy(b"q", 16)]), T0 + MIN, &NR);
    }
    let (_, rows) = route(&mut ix, &q_exact(b"p"), T0 + MIN, &NR);
    assert_eq!(names(&rows), ["a", "d"]);
    let (_, rows) = route(&mut ix, &q_exact(b"q"), T0 + MIN, &NR);
    assert_eq!(names(&rows), ["e", "f", "g"]);
    let st = ix.cache_state("t", "m");
    let reps: Vec<_> = st.replicas.iter().map(|r| r.replica_id.as_str()).collect();
    assert_eq!(reps, ["a", "c", "d"]);
    let snap = ix.snapshot();
    let reps: Vec<_> = snap
        .replicas
        .iter()
        .map(|r| r.replica_id.as_str())
        .collect();
    assert_eq!(reps, ["a", "c", "d", "e", "f", "g"]);
    let dump: Vec<_> = ix.dump_entries().into_iter().map(|e| e.replica).collect();
    assert_eq!(dump, ["a", "d", "e", "f", "g"]);
}

/// The string table is bounded in bytes: an update whose new names would exceed the bound is
/// refused whole; names already held still ingest; after the sweep frees names, it fits.
#[test]
fn string_table_is_bounded_in_bytes() {
    let mut ix = index_cfg(|c| c.max_string_bytes = 3500);
    let big = |i: usize| format!("{i}-{}", "x".repeat(1000));
    for i in 0..3 {
        let out = ix.ingest(&upd(&big(i), "m", "s", "r", vec![legacy(b"p", 1)]), T0, &NR);
        assert!(!out.rejected_string_table_full, "{i}");
    }
    let out = ix.ingest(&upd(&big(3), "m", "s", "r", vec![legacy(b"p", 1)]), T0, &NR);
    assert!(out.rejected_string_table_full);
    assert_eq!(out.upserts, 0);
    assert!(ix.string_usage().1 <= 3500);
    // Known names still fit.
    let out = ix.ingest(&upd(&big(0), "m", "s", "r", vec![legacy(b"q", 1)]), T0, &NR);
    assert!(!out.rejected_string_table_full);
    assert_eq!(out.upserts, 1);
    ix.sweep(T0 + 10 * MIN, &NR);
    let out = ix.ingest(
        &upd(&big(3), "m", "s", "r", vec![legacy(b"p", 1)]),
        T0 + 10 * MIN,
        &NR,
    );
    assert!(!out.rejected_string_table_full);
}

/// When the table is full, names whose entries were evicted by the cap are reclaimed at once
/// (no sweep needed), at most once per second per core.
#[test]
fn a_full_table_reclaims_before_refusing() {
    let mut ix = index_cfg(|c| {
        c.max_entries = 2;
        c.max_strings = 12;
    });
    let u = |i: usize, ts: i64| {
        at(
            upd(&format!("t{i}"), "m", "s", "r", vec![legacy(b"p", 1)]),
            ts,
        )
    };
    // t0..t9 + m + s + r + "" would be 14 names; the cap keeps 2 entries, so the table fills
    // with the names of evicted tenants.
    let mut refused = 0;
    for i in 0..40 {
        let now = T0 + i as i64 * 2 * SEC;
        let out = ix.ingest(&u(i, now), now, &NR);
        refused += out.rejected_string_table_full as usize;
        assert_eq!(ix.entry_count(), 2.min(i as u64 + 1));
    }
    assert_eq!(
        refused, 0,
        "evicted tenants' names were reclaimed when the table was full"
    );
    // Within the same second, a second reclaim is not attempted.
    let mut ix = index_cfg(|c| {
        c.max_entries = 1;
        c.max_strings = 6;
    });
    let fits = |ix: &mut Index, i, now| !ix.ingest(&u(i, now), now, &NR).rejected_string_table_full;
    assert!(fits(&mut ix, 0, T0));
    assert!(fits(&mut ix, 1, T0), "6 names; the cap evicts t0's entry");
    assert!(fits(&mut ix, 2, T0), "t0 reclaimed at once");
    assert!(
        !fits(&mut ix, 3, T0),
        "t1 is not reclaimed again within the second"
    );
    assert!(fits(&mut ix, 3, T0 + SEC));
}

/// A key keeps at most `max_holders_per_key` replicas: a further replica's upsert of that key is
/// refused (counted), the rest of its update is applied, and known holders still refresh.
#[test]
fn holders_per_key_are_bounded() {
    let mut ix = index_cfg(|c| c.max_holders_per_key = 3);
    for r in ["r1", "r2", "r3"] {
        let out = ix.ingest(&upd_r(r, vec![legacy(b"hot", 16)]), T0, &NR);
        assert_eq!((out.upserts, out.holders_refused), (1, 0));
    }
    let out = ix.ingest(
        &upd_r("r4", vec![legacy(b"hot", 16), legacy(b"cold", 16)]),
        T0,
        &NR,
    );
    assert_eq!((out.upserts, out.holders_refused), (1, 1));
    let (_, rows) = route(&mut ix, &q_exact(b"hot"), T0, &NR);
    assert_eq!(names(&rows), ["r1", "r2", "r3"]);
    let (_, rows) = route(&mut ix, &q_exact(b"cold"), T0, &NR);
    assert_eq!(names(&rows), ["r4"]);
    let out = ix.ingest(&upd_r("r2", vec![legacy(b"hot", 99)]), T0 + SEC, &NR);
    assert_eq!((out.upserts, out.holders_refused), (1, 0));
    // A chain: blocks already full refuse the new replica, the others take it.
    let out = ix.ingest(
        &upd_r("r4", vec![chain_entry(&[b"hot", b"x", b"y"], 8)]),
        T0,
        &NR,
    );
    assert_eq!((out.upserts, out.holders_refused), (2, 1));
}

/// A full key table (here one key per segment, 4,096 in all) refuses a new key's upsert and
/// counts it (`INDEX_KEYS_FULL` at the server); the rest of the update is applied: held keys
/// still refresh and take new holders, the counts stay exact, a refused key matches nothing,
/// and a key removed makes room for a new one in its place.
#[test]
fn a_full_key_table_refuses_new_keys_and_applies_the_rest() {
    let cfg = IndexConfig {
        default_ttl_ns: 10 * MIN,
        ..IndexConfig::default()
    };
    let mut ix = Index::with_key_table_segment_keys(cfg, 1);
    let key = |i: u64| (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes();
    const KEYS: u64 = 10_000;
    let (mut upserts, mut refused) = (0, 0);
    for batch in 0..KEYS / 100 {
        let prefixes = (batch * 100..(batch + 1) * 100)
            .map(|i| legacy(&key(i), 16))
            .collect();
        let out = ix.ingest(&upd_r("r1", prefixes), T0, &NR);
        upserts += out.upserts;
        refused += out.keys_refused;
    }
    assert_eq!(upserts + refused, KEYS);
    assert!(refused > 0 && ix.key_count() <= 4_096, "{refused}");
    assert_eq!((ix.key_count(), ix.entry_count()), (upserts, upserts));
    let held: Vec<u64> = (0..KEYS)
        .filter(|&i| !route(&mut ix, &q_exact(&key(i)), T0, &NR).1.is_empty())
        .collect();
    assert_eq!(
        held.len() as u64,
        upserts,
        "every applied key is found, no refused one"
    );
    // Held keys refresh and take another holder on a full table.
    let (a, b) = (held[0], held[1]);
    let out = ix.ingest(
        &upd_r("r2", vec![legacy(&key(a), 16), legacy(&key(b), 16)]),
        T0 + SEC,
        &NR,
    );
    assert_eq!((out.upserts, out.keys_refused), (2, 0));
    assert_eq!(
        names(&route(&mut ix, &q_exact(&key(a)), T0 + SEC, &NR).1),
        ["r1", "r2"]
    );
    assert_eq!(ix.entry_count(), upserts + 2);
    // Key `a` leaves: its segment takes a new key again (the same one, stored anew).
    for r in ["r1", "r2"] {
        let e = event(cache_event::Type::PrefixEvicted, "t", "m", r, &key(a));
        ix.apply_event(&e, T0 + SEC, &NR);
    }
    assert_eq!(ix.key_count(), upserts - 1);
    let out = ix.ingest(&upd_r("r3", vec![legacy(&key(a), 16)]), T0 + SEC, &NR);
    assert_eq!((out.upserts, out.keys_refused), (1, 0));
    assert_eq!(
        names(&route(&mut ix, &q_exact(&key(a)), T0 + SEC, &NR).1),
        ["r3"]
    );
}

/// A scope keeps at most `max_replicas_per_scope` serving replicas: an update of one more is
/// refused whole (nothing of it stored), the serving ones still refresh and add keys, another
/// scope takes the replica, and once a replica's last entry in the scope leaves, room is back.
/// A snapshot record of one more replica is not restored either.
#[test]
fn serving_replicas_per_scope_are_bounded() {
    let mut ix = index_cfg(|c| c.max_replicas_per_scope = 3);
    for (i, r) in ["r1", "r2", "r3"].into_iter().enumerate() {
        let out = ix.ingest(&upd_r(r, vec![legacy(&[i as u8], 16)]), T0, &NR);
        assert!(!out.rejected_scope_replicas_full, "{r}");
    }
    let out = ix.ingest(
        &upd_r("r4", vec![legacy(b"new", 16), legacy(&[0], 16)]),
        T0,
        &NR,
    );
    assert!(out.rejected_scope_replicas_full);
    assert_eq!(out.upserts, 0);
    assert_eq!(ix.entry_count(), 3);
    let (_, rows) = route(&mut ix, &q_exact(&[0]), T0, &NR);
    assert_eq!(names(&rows), ["r1"]);
    // Serving replicas refresh and add keys.
    let out = ix.ingest(
        &upd_r("r2", vec![legacy(&[0], 16), legacy(b"k", 16)]),
        T0,
        &NR,
    );
    assert!(!out.rejected_scope_replicas_full);
    assert_eq!(ix.entry_count(), 5);
    // Another scope (hash scheme) of the same model takes the replica.
    let out = ix.ingest(
        &upd("t", "m", "sglang", "r4", vec![legacy(b"new", 16)]),
        T0,
        &NR,
    );
    assert!(!out.rejected_scope_replicas_full);
    // r3's only entry leaves: it stops serving, and r4 fits.
    let e = event(cache_event::Type::PrefixEvicted, "t", "m", "r3", &[2]);
    ix.apply_event(&e, T0, &NR);
    let out = ix.ingest(&upd_r("r4", vec![legacy(b"new", 16)]), T0, &NR);
    assert!(!out.rejected_scope_replicas_full);
    let (_, rows) = route(&mut ix, &q_exact(b"new"), T0, &NR);
    assert_eq!(names(&rows), ["r4"]);
    // Restore: a fourth replica's record is refused, a serving one's restored.
    let mut cache = inferencecache_index::index::RestoreCache::default();
    let rec = |replica| inferencecache_index::index::PersistEntry {
        tenant: "t",
        model: "m",
        scheme: "vllm",
        adapter: "",
        hash: b"restored",
        replica,
        tokens: 16,
        last_seen: T0,
        tier: 0,
        access: 0,
    };
    use inferencecache_index::index::RestoreOutcome;
    assert_eq!(
        ix.restore_entry(&rec("r5"), T0, &NR, &mut cache),
        RestoreOutcome::Refused
    );
    assert_eq!(
        ix.restore_entry(&rec("r1"), T0, &NR, &mut cache),
        RestoreOutcome::Restored
    );
}

/// A hot key with thousands of holders: every holder is found, refreshed and removed, and
/// lookups rank them as for a small key.
#[test]
fn hot_key_with_many_holders() {
    let n = 3000;
    let mut ix = index_cfg(|c| c.max_holders_per_key = n);
    // As many replicas serving something else, so distinguishing power is not 0.
    for i in 0..n {
        ix.ingest(
            &upd_r(&format!("s{i:05}"), vec![legacy(b"other", 1)]),
            T0,
            &NR,
        );
    }
    for i in 0..n {
        let u = upd_r(
            &format!("r{i:05}"),
            vec![legacy(b"hot", (i % 7) as i32 + 1)],
        );
        assert_eq!(ix.ingest(&u, T0, &NR).upserts, 1);
    }
    // Refresh every holder (the upsert finds each one).
    for i in 0..n {
        let u = upd_r(
            &format!("r{i:05}"),
            vec![legacy(b"hot", (i % 7) as i32 + 1)],
        );
        ix.ingest(&u, T0 + SEC, &NR);
    }
    assert_eq!(ix.entry_count(), 2 * n as u64);
    let (s, rows) = route(&mut ix, &q_exact(b"hot"), T0 + SEC, &NR);
    assert_eq!(s, Strategy::PrefixMatch);
    assert_eq!(rows.len(), n);
    // Ranked by score (more tokens first), ties by replica id.
    assert_eq!(rows[0].0, "r00006");
    assert!(
        rows.windows(2)
            .all(|w| w[0].1 > w[1].1 || (w[0].1 == w[1].1 && w[0].0 < w[1].0))
    );
    for i in (0..n).step_by(2) {
        let e = event(
            cache_event::Type::PrefixEvicted,
            "t",
            "m",
            &format!("r{i:05}"),
            b"hot",
        );
        assert_eq!(ix.apply_event(&e, T0 + SEC, &NR).entries_removed, 1);
    }
    let (_, rows) = route(&mut ix, &q_exact(b"hot"), T0 + SEC, &NR);
    assert_eq!(rows.len(), n / 2);
    assert!(
        rows.iter()
            .all(|r| r.0[1..].parse::<usize>().unwrap() % 2 == 1)
    );
}

/// Stats rows are bounded per `(tenant, model)` and per core; existing rows still update.
#[test]
fn stats_rows_are_bounded() {
    let stats = |t: &str, r: &str| with_stats(upd(t, "m", "", r, vec![]), 0.5, 0.1);
    let mut ix = index_cfg(|c| {
        c.max_stats_rows_per_model = 2;
        c.max_stats_rows = 3;
    });
    assert!(!ix.ingest(&stats("t", "r1"), T0, &NR).stats_refused);
    assert!(!ix.ingest(&stats("t", "r2"), T0, &NR).stats_refused);
    assert!(ix.ingest(&stats("t", "r3"), T0, &NR).stats_refused);
    assert!(!ix.ingest(&stats("t", "r1"), T0 + SEC, &NR).stats_refused);
    assert!(!ix.ingest(&stats("u", "r1"), T0, &NR).stats_refused);
    assert!(ix.ingest(&stats("v", "r1"), T0, &NR).stats_refused);
    assert_eq!(ix.stats_row_count(), 3);
    let reps = ix.cache_state("t", "m").replicas;
    assert_eq!(reps.len(), 2);
    // The refused rows left no names behind once swept.
    ix.sweep(T0 + 10 * MIN + SEC, &NR);
    assert_eq!(ix.string_usage(), (0, 0));
    assert!(
        !ix.ingest(&stats("v", "r1"), T0 + 11 * MIN, &NR)
            .stats_refused
    );
}

/// The update that fills the table with names (count bound) is refused whole even when it also
/// carries stats.
#[test]
fn refused_update_stores_nothing() {
    let mut ix = index_cfg(|c| c.max_strings = 3);
    let u: CacheStateUpdate =
        with_stats(upd("t", "m", "vllm", "r", vec![legacy(b"p", 1)]), 0.5, 0.1);
    let out = ix.ingest(&u, T0, &NR);
    assert!(out.rejected_string_table_full);
    assert_eq!(ix.stats_row_count(), 0);
    assert_eq!(ix.string_usage(), (0, 0));
}

/// LFU hits carried past a reclaim pass (the `credit_hits` API) are never credited to another
/// tenant's entry that reuses a freed keyspace id, and never panic on a freed one.
#[test]
fn carried_lfu_hits_survive_a_reclaim() {
    let mut rules = Rules::lfu("t");
    rules.lfu.push("u".into());
    let mut ix = index_cfg(|_| {});
    ix.ingest(
        &upd("t", "m1", "vllm", "r", vec![legacy(b"k", 16)]),
        T0,
        &rules,
    );
    ix.ingest(
        &upd("t", "m2", "vllm", "r", vec![legacy(b"p", 16)]),
        T0,
        &rules,
    );
    let q = inferencecache_index::index::LookupQuery {
        model: "m2",
        ..q_exact(b"p")
    };
    let hits = ix.lookup_route(&q, T0, &rules).lfu_hits.to_vec();
    assert_eq!(hits.len(), 1);
    let evict = event(cache_event::Type::PrefixEvicted, "t", "m2", "r", b"p");
    assert_eq!(ix.apply_event(&evict, T0, &rules).entries_removed, 1);
    ix.sweep(T0, &rules);
    // Freed and not reused yet.
    assert_eq!(ix.credit_hits("t", &hits, |_| true, &rules), 0);
    // Reused by another tenant's key with the same hash and replica.
    ix.ingest(
        &upd("u", "m2", "vllm", "r", vec![legacy(b"p", 16)]),
        T0,
        &rules,
    );
    assert_eq!(ix.credit_hits("t", &hits, |_| true, &rules), 0);
    assert!(ix.dump_entries().iter().all(|e| e.access_count == 0));
}

/// LFU hits are collected only for a tenant whose policy is LFU (nothing else is ever credited),
/// on the chain and the exact path; an LFU tenant gets one per (block, scored holder).
#[test]
fn lfu_hits_only_under_lfu() {
    let lfu = Rules::lfu("t");
    let mut ix = index_cfg(|_| {});
    for r in ["r1", "r2"] {
        ix.ingest(
            &upd_r(r, vec![chain_entry(&[b"b1", b"b2", b"b3"], 16)]),
            T0,
            &NoRules,
        );
    }
    let c = chain(&[b"b1", b"b2", b"b3"], 16);
    for (q, per_lfu) in [(c.q(), 6), (q_exact(b"b2"), 2)] {
        let lru_view = ix.lookup_route(&q, T0, &NoRules);
        assert_eq!(lru_view.strategy, Strategy::PrefixMatch);
        assert!(lru_view.lfu_hits.is_empty());
        assert_eq!(ix.lookup_route(&q, T0, &lfu).lfu_hits.len(), per_lfu);
    }
}
