//! Independent review: adversarial index-level tests (injected clock) for BEHAVIOUR.md §3–§9 and
//! the §19 items that are easiest to pin without the server.

mod index_support;

use index_support::*;
use inferencecache_index::PROBE_TENANT;
use inferencecache_index::index::ranking::{distinguishing_power, freshness, pressure_factor};
use inferencecache_index::index::{LookupQuery, Strategy};
use inferencecache_index::rules::NoRules;
use inferencecache_proto::v1alpha1::cache_event::Type;
use inferencecache_proto::v1alpha1::{PrefixEntry, ReplicaStats};

const NR: NoRules = NoRules;

fn hashes(ix: &inferencecache_index::index::Index) -> Vec<Vec<u8>> {
    let mut v: Vec<Vec<u8>> = ix.dump_entries().into_iter().map(|e| e.hash).collect();
    v.sort();
    v.dedup();
    v
}

fn stats_upd(
    replica: &str,
    hit: f32,
    pressure: f32,
) -> inferencecache_proto::v1alpha1::CacheStateUpdate {
    let mut u = upd_r(replica, vec![]);
    u.stats = Some(ReplicaStats {
        hit_rate: hit,
        pressure,
        ..Default::default()
    });
    u
}

/// §19.13 / §5 / §6: REPLICA_UPDATED advances only stats liveness: the sweep keeps the row, but
/// neither TENANT_HOT nor the prefix-path pressure treats it as fresh stats. Control: without
/// the event the sweep deletes the row.
#[test]
fn s19_13_replica_updated_keeps_row_alive_but_not_fresh() {
    let rules = Rules::ttl("t", 10 * MIN);
    for with_event in [true, false] {
        let mut ix = index();
        ix.ingest(&at(stats_upd("r", 0.9, 0.9), T0), T0, &rules);
        ix.ingest(
            &at(upd_r("r", vec![legacy(b"other", 64)]), T0 + 9 * MIN),
            T0 + 9 * MIN,
            &rules,
        );
        if with_event {
            let mut e = event(Type::ReplicaUpdated, "t", "m", "r", b"");
            e.timestamp_us = (T0 + 9 * MIN) / 1000;
            ix.apply_event(&e, T0 + 9 * MIN, &rules);
        }
        let now = T0 + 11 * MIN;
        ix.sweep(now, &rules);
        let rows = ix.cache_state("t", "m").replicas.len();
        assert_eq!(
            rows, with_event as usize,
            "stats row kept alive only by the event"
        );
        // Prefix path: payload 11 min old under TTL 10 min → pressure ignored.
        let (s, rows) = route(&mut ix, &q_exact(b"other"), now, &rules);
        assert_eq!(s, Strategy::PrefixMatch);
        let f = freshness(now, T0 + 9 * MIN, 10 * MIN);
        assert_eq!(rows[0].1, 64.0 * f, "pressure of a stale payload is 0");
        // TENANT_HOT: payload 11 min old > 5 min → no candidates.
        let (s, _) = route(&mut ix, &q_exact(b"novel"), now, &rules);
        assert_eq!(s, Strategy::None);
    }
}

/// §19.12 / §3.3: a re-ingest with an older timestamp moves last_seen backwards; the sweep then
/// removes the entry by the older time.
#[test]
fn s19_12_last_seen_moves_backwards() {
    let mut ix = index();
    ix.ingest(
        &at(upd_r("r", vec![legacy(b"p", 64)]), T0 + 10 * MIN),
        T0,
        &NR,
    );
    ix.ingest(&at(upd_r("r", vec![legacy(b"p", 64)]), T0), T0, &NR);
    let d = ix.dump_entries();
    assert_eq!(d[0].last_seen, T0);
    let (_, rows) = route(&mut ix, &q_exact(b"p"), T0 + 15 * MIN, &NR);
    assert_approx(rows[0].3, 0.5);
    ix.sweep(T0 + 30 * MIN, &NR);
    assert!(ix.dump_entries().is_empty());
}

/// §4.1 / §7.2 / §7.1: hashes of any length (empty, 1, 8, 9 bytes) are distinct opaque keys,
/// and victim tie-breaks compare the raw bytes lexicographically across lengths.
#[test]
fn non_8_byte_hashes_and_byte_order_tie_breaks() {
    let keys: [&[u8]; 6] = [
        b"b",
        b"abcdefgh",
        b"a",
        b"abcdefghi",
        b"\0\0\0\0\0\0\0\0",
        b"",
    ];
    let entries: Vec<PrefixEntry> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| legacy(k, 10 + i as i32))
        .collect();
    // Every key is matchable with its own count.
    let mut ix = index();
    ix.ingest(&upd_r("r", entries.clone()), T0, &NR);
    for (i, k) in keys.iter().enumerate() {
        let rows = plain(&mut ix, &q_exact(k), T0, &NR);
        assert_eq!(rows.len(), 1, "{k:?}");
        assert_eq!(rows[0].2, 10 + i as i32, "{k:?}");
    }
    assert!(plain(&mut ix, &q_exact(b"abcdefg"), T0, &NR).is_empty());
    // Cap 2, identical timestamps: the two byte-wise largest keys survive.
    let want = vec![b"abcdefghi".to_vec(), b"b".to_vec()];
    let mut ix = index_with(HOUR, 2);
    ix.ingest(&upd_r("r", entries.clone()), T0, &NR);
    assert_eq!(hashes(&ix), want, "cap victims by bytes");
    // Quota 2: same order.
    let rules = Rules::quota("t", 2);
    let mut ix = index();
    ix.ingest(&upd_r("r", entries), T0, &rules);
    assert_eq!(hashes(&ix), want, "quota victims by bytes");
}

/// §8.3: a frozen replica can never rejoin; a stale block mid-run freezes the run; the run's
/// freshness is that of its oldest block.
#[test]
fn s8_3_chain_freeze_and_oldest() {
    let mut ix = index();
    ix.ingest(
        &upd_r("r1", vec![chain_entry(&[b"b1", b"b3"], 16)]),
        T0,
        &NR,
    );
    ix.ingest(
        &upd_r("r2", vec![chain_entry(&[b"b1", b"b2", b"b3"], 16)]),
        T0,
        &NR,
    );
    let c = chain(&[b"b1", b"b2", b"b3"], 16);
    let (s, rows) = route(&mut ix, &c.q(), T0, &NR);
    assert_eq!(s, Strategy::PrefixMatch);
    assert_eq!(names(&rows), ["r2", "r1"]);
    assert_eq!((rows[0].1, rows[0].2), (24.0, 48));
    assert_eq!((rows[1].1, rows[1].2), (0.0, 16));

    let mut ix = index();
    ix.ingest(
        &at(upd_r("r", vec![chain_entry(&[b"b1"], 16)]), T0),
        T0,
        &NR,
    );
    ix.ingest(
        &at(upd_r("r", vec![chain_entry(&[b"b2"], 16)]), T0 - 40 * MIN),
        T0,
        &NR,
    );
    ix.ingest(
        &at(upd_r("r", vec![chain_entry(&[b"b3"], 16)]), T0),
        T0,
        &NR,
    );
    let (_, rows) = route(&mut ix, &c.q(), T0, &NR);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].2, 16, "stale block 2 freezes the run at block 1");

    let mut ix = index();
    ix.ingest(
        &at(upd_r("r", vec![chain_entry(&[b"b1"], 16)]), T0 - 15 * MIN),
        T0,
        &NR,
    );
    ix.ingest(
        &at(upd_r("r", vec![chain_entry(&[b"b2"], 16)]), T0),
        T0,
        &NR,
    );
    let c2 = chain(&[b"b1", b"b2"], 16);
    let (_, rows) = route(&mut ix, &c2.q(), T0, &NR);
    assert_eq!(rows[0].2, 32);
    assert_eq!(rows[0].3, 0.5, "freshness of the oldest block");
    assert_eq!(rows[0].1, 16.0);
}

/// §4.2: chain ingest stores cumulative counts (including zero/negative per-block counts), and
/// tiers are normalised per entry.
#[test]
fn s4_2_cumulative_counts_with_negative_blocks() {
    let mut ix = index();
    let e = PrefixEntry {
        block_hashes: vec![b"b1".to_vec(), b"b2".to_vec(), b"b3".to_vec()],
        block_token_counts: vec![16, -8, 0],
        ..Default::default()
    };
    ix.ingest(&upd_r("r", vec![e]), T0, &NR);
    let mut got: Vec<(Vec<u8>, i32, i32)> = ix
        .dump_entries()
        .into_iter()
        .map(|d| (d.hash, d.token_count, d.tier))
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![
            (b"b1".to_vec(), 16, 1),
            (b"b2".to_vec(), 8, 1),
            (b"b3".to_vec(), 8, 1)
        ]
    );
}

/// §9.2 / §22: float32 evaluation order, bit-exact: `f32(tokens)·f·pf·sb` then `*= f32(dp)`.
#[test]
fn s9_2_exact_score_bit_exact() {
    let mut ix = index();
    let now = T0 + 7 * MIN + 123_456_789;
    ix.ingest(&at(upd_r("a", vec![legacy(b"p", 100)]), T0), now, &NR);
    ix.ingest(&at(stats_upd("a", 0.0, 0.3), T0), now, &NR);
    ix.ingest(&at(upd_r("b", vec![legacy(b"x", 1)]), T0), now, &NR);
    ix.ingest(&at(upd_r("c", vec![legacy(b"y", 1)]), T0), now, &NR);
    let mut q = q_exact(b"p");
    q.ttft_ms = 50;
    let (_, rows) = route(&mut ix, &q, now, &NR);
    let f = freshness(now, T0, 30 * MIN);
    assert_eq!(f, (1.0 - (now - T0) as f64 / (30 * MIN) as f64) as f32);
    let pf = pressure_factor(1.0, 0.3);
    let sb = 1.0f32 + f * 1.0;
    let mut want = 100f32 * f * pf * sb;
    want *= distinguishing_power(1, 3) as f32;
    assert_eq!(
        rows[0].1.to_bits(),
        want.to_bits(),
        "{} vs {}",
        rows[0].1,
        want
    );
    assert_eq!(rows[0].3, f);
}

/// §8.4 / §21.5: hit_rate ≥ 0.1 inclusive, age < 5 min strict, recency in f32, TENANT_HOT
/// pressure taken from the row directly (no TTL freshness check), ties by replica id.
#[test]
fn s21_5_tenant_hot_thresholds() {
    let rules = Rules::ttl("t", MIN);
    let mut ix = index();
    let now = T0 + 10 * MIN;
    // All replicas hold a (stale but unswept) prefix so they are "serving".
    for r in ["at-floor", "below", "edge-in", "edge-out", "tie-a", "tie-b"] {
        ix.ingest(&at(upd_r(r, vec![legacy(b"other", 1)]), T0), now, &rules);
    }
    let mut put = |r: &str, hit: f32, p: f32, ts: i64| {
        ix.ingest(&at(stats_upd(r, hit, p), ts), now, &rules);
    };
    put("at-floor", 0.1, 0.0, now);
    put("below", 0.099_999, 0.0, now);
    put("edge-in", 0.8, 0.5, now - 5 * MIN + 1000);
    put("edge-out", 0.8, 0.0, now - 5 * MIN);
    put("tie-b", 0.5, 0.0, now - 4 * MIN);
    put("tie-a", 0.5, 0.0, now - 4 * MIN);
    let (s, rows) = route(&mut ix, &q_exact(b"novel"), now, &rules);
    assert_eq!(s, Strategy::TenantHot);
    let rec4 = 1.0f32 - (4 * MIN) as f32 / (5 * MIN) as f32;
    let rec_edge = 1.0f32 - (5 * MIN - 1000) as f32 / (5 * MIN) as f32;
    let want: Vec<(&str, f32)> = vec![
        ("tie-a", 0.5 * rec4),
        ("tie-b", 0.5 * rec4),
        ("at-floor", 0.1),
        ("edge-in", 0.8 * rec_edge * 0.5),
    ];
    let mut want = want;
    want.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(b.0)));
    let got: Vec<(&str, u32)> = rows.iter().map(|r| (r.0.as_str(), r.1.to_bits())).collect();
    let want: Vec<(&str, u32)> = want.iter().map(|(n, s)| (*n, s.to_bits())).collect();
    assert_eq!(got, want);
}

/// §19.15 / §8.5: the cold-start carve-out counts reserved (probe) entries: with only probe
/// entries indexed, an unknown tenant is UNKNOWN_TENANT, not NONE.
#[test]
fn s19_15_cold_start_counts_reserved() {
    let mut ix = index();
    let (s, _) = route(&mut ix, &q_exact(b"p"), T0, &NR);
    assert_eq!(s, Strategy::None);
    ix.ingest(
        &upd(
            PROBE_TENANT,
            "m",
            "vllm",
            "__probe-x",
            vec![legacy(b"h", 16)],
        ),
        T0,
        &NR,
    );
    let (s, _) = route(&mut ix, &q_exact(b"p"), T0, &NR);
    assert_eq!(s, Strategy::UnknownTenant);
}

/// §19.5: the denominator ignores stats-only replicas and replicas of other schemes.
#[test]
fn s19_5_denominator_scope_only() {
    let mut ix = index();
    ix.ingest(&upd_r("r0", vec![legacy(b"p", 64)]), T0, &NR);
    ix.ingest(&stats_upd("r1", 0.9, 0.0), T0, &NR);
    ix.ingest(
        &upd("t", "m", "sglang", "r2", vec![legacy(b"q", 64)]),
        T0,
        &NR,
    );
    let (_, rows) = route(&mut ix, &q_exact(b"p"), T0, &NR);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].1, 64.0);
    // A replica holding only another adapter's key in the scope counts (adapter-blind).
    let mut u = upd_r("r3", vec![legacy(b"z", 64)]);
    u.adapter_id = "lora".into();
    ix.ingest(&u, T0, &NR);
    let (_, rows) = route(&mut ix, &q_exact(b"p"), T0, &NR);
    assert_eq!(rows[0].1, 32.0);
}

/// §5 ALL_CLEARED: removes the replica across schemes and adapters of (tenant, model) and its
/// stats row; other models untouched; the replica leaves the affinity candidates.
#[test]
fn s5_all_cleared_across_schemes_and_adapters() {
    let mut ix = index();
    let mut ua = upd_r("r", vec![legacy(b"p", 64)]);
    ua.adapter_id = "lora".into();
    ix.ingest(&ua, T0, &NR);
    ix.ingest(
        &with_stats(
            upd("t", "m", "sglang", "r", vec![legacy(b"p", 64)]),
            0.5,
            0.0,
        ),
        T0,
        &NR,
    );
    ix.ingest(
        &upd("t", "m2", "vllm", "r", vec![legacy(b"p", 64)]),
        T0,
        &NR,
    );
    ix.ingest(&upd_r("o", vec![legacy(b"o", 64)]), T0, &NR);
    ix.apply_event(&event(Type::AllCleared, "t", "m", "r", b""), T0, &NR);
    let left: Vec<(String, String)> = ix
        .dump_entries()
        .into_iter()
        .map(|d| (d.model, d.replica))
        .collect();
    assert_eq!(
        left,
        vec![("m".into(), "o".into()), ("m2".into(), "r".into())]
    );
    assert!(ix.cache_state("t", "m").replicas.is_empty());
    assert_eq!(ix.affinity_hint("t", "m", "vllm", b"seed"), Some("o"));
    assert_eq!(ix.affinity_hint("t", "m", "sglang", b"seed"), None);
}

/// §7.4 exact path: an entry with token_count ≤ 0 is not credited even when delivered.
#[test]
fn s7_4_exact_zero_token_entry_not_credited() {
    let rules = Rules::lfu("t");
    let mut ix = index();
    ix.ingest(&upd_r("a", vec![legacy(b"p", 0)]), T0, &rules);
    ix.ingest(&upd_r("b", vec![legacy(b"p", 16)]), T0, &rules);
    let q = q_exact(b"p");
    assert_eq!(
        ix.lookup_route(&q, T0, &rules).strategy,
        Strategy::PrefixMatch
    );
    ix.credit_lfu(|_| true, &rules);
    let got: Vec<(String, u64)> = ix
        .dump_entries()
        .into_iter()
        .map(|d| (d.replica, d.access_count))
        .collect();
    assert_eq!(got, vec![("a".into(), 0), ("b".into(), 1)]);
}

/// §8.1: a chain request whose counts make every run ≤ 0 is a chain miss → classifier (never
/// TENANT_HOT even with warm stats).
#[test]
fn s8_1_chain_nonpositive_runs_never_tenant_hot() {
    let mut ix = index();
    ix.ingest(
        &with_stats(upd_r("r", vec![chain_entry(&[b"b1"], 16)]), 0.9, 0.0),
        T0,
        &NR,
    );
    let c = Chain {
        hashes: vec![b"b1".to_vec()],
        counts: vec![0],
    };
    let (s, rows) = route(&mut ix, &c.q(), T0, &NR);
    assert_eq!(s, Strategy::None);
    assert!(rows.is_empty());
    let q = LookupQuery {
        block_token_counts: &[16],
        ..c.q()
    };
    let (s, _) = route(&mut ix, &q, T0, &NR);
    assert_eq!(s, Strategy::PrefixMatch);
}

/// §4.2 step 3: a prefixes-only update does not refresh the stats row (TENANT_HOT recency and
/// the sweep both see the older stats time).
#[test]
fn s4_2_prefixes_only_update_does_not_refresh_stats() {
    let mut ix = index();
    ix.ingest(
        &with_stats(upd_r("r", vec![legacy(b"other", 8)]), 0.9, 0.0),
        T0,
        &NR,
    );
    ix.ingest(&upd_r("r", vec![legacy(b"other", 8)]), T0 + 6 * MIN, &NR);
    let (s, _) = route(&mut ix, &q_exact(b"novel"), T0 + 6 * MIN, &NR);
    assert_eq!(s, Strategy::None, "stats are 6 min old");
    ix.ingest(&upd_r("r", vec![legacy(b"other", 8)]), T0 + 29 * MIN, &NR);
    ix.sweep(T0 + 30 * MIN, &NR);
    assert!(
        ix.cache_state("t", "m").replicas.is_empty(),
        "stats row swept"
    );
    assert_eq!(ix.dump_entries().len(), 1, "prefix kept");
}

/// §8.5 / §19.15: UNKNOWN_TENANT depends only on whether the tenant holds prefix keys now. The
/// directory's fixed-capacity tenant table (index/src/directory.rs) saturates once more than
/// `capacity` tenants were live at the same time and then stays saturated for the life of the
/// process: from then on an unknown tenant is classified as known (UNKNOWN_MODEL instead of
/// UNKNOWN_TENANT) even after the tenant count dropped back.
#[test]
fn s8_5_unknown_tenant_after_tenant_table_saturation() {
    use inferencecache_index::directory::Directory;
    use inferencecache_index::index::{Index, IndexConfig};
    use std::sync::Arc;
    let mut ix = Index::new(IndexConfig {
        directory: Arc::new(Directory::new(8)),
        ..IndexConfig::default()
    });
    for i in 0..9 {
        let t = format!("tenant-{i}");
        ix.ingest(&upd(&t, "m", "vllm", "r", vec![legacy(b"p", 16)]), T0, &NR);
    }
    // Drain all but one tenant.
    for i in 1..9 {
        let t = format!("tenant-{i}");
        ix.apply_event(&event(Type::AllCleared, &t, "m", "r", b""), T0, &NR);
    }
    let q = LookupQuery {
        tenant: "never-seen",
        ..q_exact(b"p")
    };
    let (s, _) = route(&mut ix, &q, T0, &NR);
    assert_eq!(s, Strategy::UnknownTenant);
}

/// §8.3: "a run with matched ≤ 0 is dropped" and matched_tokens is the int32 run sum. Hostile
/// per-block counts whose sum exceeds i32::MAX must not surface as a scored replica whose wire
/// matched_tokens is ≤ 0 (the index sums in i64 and truncates to i32 only when emitting).
#[test]
fn s8_3_run_sum_overflow_never_emits_nonpositive_matched() {
    let mut ix = index();
    ix.ingest(&upd_r("r", vec![chain_entry(&[b"b1", b"b2"], 16)]), T0, &NR);
    let c = Chain {
        hashes: vec![b"b1".to_vec(), b"b2".to_vec()],
        counts: vec![i32::MAX, 2],
    };
    let (s, rows) = route(&mut ix, &c.q(), T0, &NR);
    for r in &rows {
        assert!(
            r.2 > 0,
            "strategy {s:?}: scored replica with matched_tokens {} (score {})",
            r.2,
            r.1
        );
    }
}

/// Bad input never crashes the server: once a core's string table is full, an update that would
/// intern new strings is refused whole (and reported), while updates using known strings apply.
#[test]
fn full_string_table_refuses_updates_instead_of_panicking() {
    use inferencecache_index::index::Index;
    use inferencecache_index::rules::NoRules;
    use inferencecache_proto::v1alpha1::{CacheStateUpdate, PrefixEntry};
    let mut ix = Index::default();
    ix.set_string_capacity(5);
    let upd = |replica: &str, hash: &[u8]| CacheStateUpdate {
        replica_id: replica.into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        hash_scheme: "vllm".into(),
        prefixes: vec![PrefixEntry {
            prefix_hash: hash.to_vec(),
            token_count: 16,
            ..Default::default()
        }],
        ..Default::default()
    };
    // t, m, vllm, r1, "" = 5 strings: fits exactly.
    let out = ix.ingest(&upd("r1", b"a"), 1, &NoRules);
    assert!(!out.rejected_string_table_full);
    assert_eq!(out.upserts, 1);
    // A new replica id would be a 6th string: refused, nothing applied.
    let out = ix.ingest(&upd("r2", b"b"), 1, &NoRules);
    assert!(out.rejected_string_table_full);
    assert_eq!(out.upserts, 0);
    assert_eq!(ix.key_count(), 1);
    // Known strings still ingest.
    let out = ix.ingest(&upd("r1", b"c"), 1, &NoRules);
    assert!(!out.rejected_string_table_full);
    assert_eq!(ix.key_count(), 2);
}
