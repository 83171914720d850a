//! One test per [idx] conformance scenario (docs/CONFORMANCE.md sections B–L and C128),
//! named after its id, with the scenario's exact numbers; in each section, the index-level pins
//! of docs/BEHAVIOUR.md rules the scenarios leave open follow, named after their section (`sN_M_…`).

mod index_support;

use index_support::*;
use inferencecache_index::PROBE_TENANT;
use inferencecache_index::index::ranking::{
    self, distinguishing_power, freshness, pressure_factor, worst_tier,
};
use inferencecache_index::index::{LookupQuery, RankerConfig, Strategy};
use inferencecache_index::rules::NoRules;
use inferencecache_proto::v1alpha1::cache_event::Type;
use inferencecache_proto::v1alpha1::{PrefixEntry, ReplicaStats};

const NR: NoRules = NoRules;

/// A stats-only update (no prefixes) of `replica` with hit rate and pressure.
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

// ---- B. Ingest and exact lookup ----------------------------------------------------------------

#[test]
fn c006_missing_prefix_no_scores() {
    let mut ix = index();
    ix.ingest(&upd_r("r", vec![legacy(b"known", 10)]), T0, &NR);
    assert!(plain(&mut ix, &q_exact(b"missing"), T0, &NR).is_empty());
}

#[test]
fn c008_scheme_isolation() {
    let mut ix = index();
    ix.ingest(
        &upd(
            "t",
            "m",
            "vllm",
            "vllm-replica-0",
            vec![legacy(b"the quick brown fox", 32)],
        ),
        T0,
        &NR,
    );
    ix.ingest(
        &upd(
            "t",
            "m",
            "sglang",
            "sglang-replica-0",
            vec![legacy(b"the quick brown fox", 32)],
        ),
        T0,
        &NR,
    );
    let mut q = q_exact(b"the quick brown fox");
    q.hash_scheme = "sglang";
    assert_eq!(names(&plain(&mut ix, &q, T0, &NR)), ["sglang-replica-0"]);
    q.hash_scheme = "vllm";
    assert_eq!(names(&plain(&mut ix, &q, T0, &NR)), ["vllm-replica-0"]);
}

#[test]
fn c009_empty_scheme_indexes_nothing() {
    let mut ix = index();
    ix.ingest(&upd("t", "m", "", "r", vec![legacy(b"p", 10)]), T0, &NR);
    assert_eq!(ix.model_entry_count("m"), 0);
    assert_eq!(ix.entry_count(), 0);
    ix.ingest(&upd_r("r", vec![legacy(b"p", 10)]), T0, &NR);
    let mut q = q_exact(b"p");
    q.hash_scheme = "";
    assert!(plain(&mut ix, &q, T0, &NR).is_empty());
    q.hash_scheme = "vllm";
    assert_eq!(plain(&mut ix, &q, T0, &NR).len(), 1);
}

#[test]
fn c010_tenant_isolation() {
    let mut ix = index();
    ix.ingest(
        &upd("tenant-a", "m", "vllm", "r", vec![legacy(b"p", 10)]),
        T0,
        &NR,
    );
    let mut q = q_exact(b"p");
    q.tenant = "tenant-b";
    assert!(plain(&mut ix, &q, T0, &NR).is_empty());
    q.tenant = "tenant-a";
    assert_eq!(plain(&mut ix, &q, T0, &NR).len(), 1);
}

#[test]
fn c012_stored_token_count_is_matched() {
    let mut ix = index();
    ix.ingest(&upd_r("r", vec![legacy(b"p", 128)]), T0, &NR);
    let rows = plain(&mut ix, &q_exact(b"p"), T0, &NR);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].0, "r");
    assert_eq!(rows[0].2, 128);
}

#[test]
fn c013_tiers() {
    let mut ix = index();
    ix.ingest(
        &upd_r(
            "r",
            vec![
                legacy(b"p", 16),
                chain_entry(&[b"b1"], 16),
                legacy_tier(b"t2", 16, 2),
            ],
        ),
        T0,
        &NR,
    );
    assert_eq!(plain(&mut ix, &q_exact(b"p"), T0, &NR)[0].4, 1);
    let c = chain(&[b"b1"], 16);
    assert_eq!(plain(&mut ix, &c.q(), T0, &NR)[0].4, 1);
    assert_eq!(plain(&mut ix, &q_exact(b"t2"), T0, &NR)[0].4, 2);
}

#[test]
fn c014_stats_replica_id_is_top_level() {
    let mut ix = index();
    let mut u = upd_r("real-replica", vec![legacy(b"p", 10)]);
    u.stats = Some(inferencecache_proto::v1alpha1::ReplicaStats {
        replica_id: "mismatched".into(),
        cache_memory_bytes: 42,
        ..Default::default()
    });
    ix.ingest(&u, T0, &NR);
    let cs = ix.cache_state("t", "m");
    assert_eq!(cs.total_prefixes, 1);
    assert_eq!(cs.replicas.len(), 1);
    assert_eq!(cs.replicas[0].replica_id, "real-replica");
    assert_eq!(cs.replicas[0].cache_memory_bytes, 42);
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

// ---- C. Chain ingest and chain lookup ---------------------------------------------------------

#[test]
fn c016_legacy_matches_chain_block0_with_request_count() {
    let mut ix = index();
    ix.ingest(&upd_r("r", vec![legacy(b"p", 64)]), T0, &NR);
    let c = chain(&[b"p", b"x", b"y"], 16);
    let rows = plain(&mut ix, &c.q(), T0, &NR);
    assert_eq!(names(&rows), ["r"]);
    assert_eq!(rows[0].2, 16);
}

#[test]
fn c017_malformed_chain_entries_dropped() {
    let mut ix = index();
    let mut e1 = chain_entry(&[b"a", b"b", b"c"], 16);
    e1.block_token_counts = vec![16];
    let out = ix.ingest(&upd_r("r", vec![e1]), T0, &NR);
    assert_eq!(out.malformed_dropped, 1);
    ix.ingest(
        &upd("t", "m", "", "r", vec![chain_entry(&[b"a", b"b"], 16)]),
        T0,
        &NR,
    );
    let mut e3 = chain_entry(&[b"a", b"b"], 16);
    e3.block_token_counts.clear();
    ix.ingest(&upd_r("r", vec![e3]), T0, &NR);
    let e4 = inferencecache_proto::v1alpha1::PrefixEntry {
        prefix_hash: b"legacy-p".to_vec(),
        token_count: 64,
        block_token_counts: vec![16, 16],
        ..Default::default()
    };
    ix.ingest(&upd_r("r", vec![e4]), T0, &NR);
    assert_eq!(ix.model_entry_count("m"), 0);
    assert_eq!(ix.entry_count(), 0);
    assert!(plain(&mut ix, &q_exact(b"legacy-p"), T0, &NR).is_empty());
}

#[test]
fn c018_chain_with_coset_legacy_key() {
    let mut ix = index();
    let mut e = chain_entry(&[b"b1", b"b2", b"b3"], 16);
    e.prefix_hash = b"legacy-full".to_vec();
    e.token_count = 128;
    ix.ingest(&upd_r("r", vec![e]), T0, &NR);
    let c = chain(&[b"b1", b"b2", b"b3"], 16);
    assert_eq!(plain(&mut ix, &c.q(), T0, &NR)[0].2, 48);
    assert_eq!(plain(&mut ix, &q_exact(b"legacy-full"), T0, &NR)[0].2, 128);
    assert_eq!(ix.model_entry_count("m"), 4);
    assert_eq!(ix.cache_state("t", "m").total_prefixes, 4);
}

#[test]
fn c020_full_chain_single_replica() {
    let mut ix = index();
    ix.ingest(
        &upd_r("r", vec![chain_entry(&[b"b1", b"b2", b"b3", b"b4"], 16)]),
        T0,
        &NR,
    );
    let c = chain(&[b"b1", b"b2", b"b3", b"b4"], 16);
    let rows = plain(&mut ix, &c.q(), T0, &NR);
    assert_eq!(rows[0].2, 64);
    assert_eq!(rows[0].1, 64.0);
}

#[test]
fn c021_run_tier_is_coldest() {
    let mut ix = index();
    let mut a = chain_entry(&[b"b1"], 16);
    a.tier = 2;
    let mut b = chain_entry(&[b"b2"], 16);
    b.tier = 1;
    ix.ingest(&upd_r("r", vec![a, b]), T0, &NR);
    let c = chain(&[b"b1", b"b2"], 16);
    let rows = plain(&mut ix, &c.q(), T0, &NR);
    assert_eq!(rows[0].2, 32);
    assert_eq!(rows[0].4, 2);
}

#[test]
fn c022_chain_miss_and_scheme_isolation() {
    let mut ix = index();
    ix.ingest(
        &upd_r("r", vec![chain_entry(&[b"h1", b"h2", b"h3"], 16)]),
        T0,
        &NR,
    );
    let c = chain(&[b"q1", b"q2", b"q3"], 16);
    assert!(plain(&mut ix, &c.q(), T0, &NR).is_empty());
    let c = chain(&[b"h1", b"h2", b"h3"], 16);
    let mut q = c.q();
    q.hash_scheme = "sglang";
    assert!(plain(&mut ix, &q, T0, &NR).is_empty());
}

#[test]
fn c024_malformed_request_chain_no_downgrade() {
    let mut ix = index();
    ix.ingest(&upd_r("r", vec![legacy(b"legacy-p", 128)]), T0, &NR);
    let hashes = vec![b"b1".to_vec(), b"b2".to_vec()];
    let q = LookupQuery {
        tenant: "t",
        model: "m",
        hash_scheme: "vllm",
        prefix_hash: b"legacy-p",
        token_count: 128,
        block_hashes: (&hashes).into(),
        block_token_counts: &[16],
        ..Default::default()
    };
    assert!(plain(&mut ix, &q, T0, &NR).is_empty());
    assert_eq!(route(&mut ix, &q, T0, &NR), (Strategy::None, vec![]));
    let q = LookupQuery {
        block_hashes: Default::default(),
        block_token_counts: &[16, 16],
        ..q
    };
    assert!(plain(&mut ix, &q, T0, &NR).is_empty());
    assert_eq!(route(&mut ix, &q, T0, &NR), (Strategy::None, vec![]));
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

// ---- D. Ranking formula -------------------------------------------------------------------------

#[test]
fn c025_ranking_freshness_and_rereport() {
    let mut ix = index_with(HOUR, 0);
    ix.ingest(&upd_r("replica-a", vec![legacy(b"p1", 100)]), T0, &NR);
    ix.ingest(&upd_r("replica-b", vec![legacy(b"p1", 50)]), T0, &NR);
    ix.ingest(&upd_r("decoy", vec![legacy(b"d", 10)]), T0, &NR);
    let rows = plain(&mut ix, &q_exact(b"p1"), T0, &NR);
    assert_eq!(names(&rows), ["replica-a", "replica-b"]);
    assert_approx(rows[0].1, 33.333);
    assert_eq!(rows[0].2, 100);
    assert_approx(rows[1].1, 16.667);
    let t1 = T0 + 50 * MIN;
    ix.ingest(&upd_r("replica-b", vec![legacy(b"p1", 50)]), t1, &NR);
    let rows = plain(&mut ix, &q_exact(b"p1"), t1, &NR);
    assert_eq!(names(&rows), ["replica-b", "replica-a"]);
    assert_approx(rows[0].1, 16.667);
    assert_approx(rows[1].1, 5.556);
}

#[test]
fn c026_ranking_without_stats_or_slo() {
    let mut ix = index_with(HOUR, 0);
    ix.ingest(&upd_r("r1", vec![legacy(b"p", 80)]), T0, &NR);
    ix.ingest(&upd_r("r2", vec![legacy(b"p", 40)]), T0, &NR);
    ix.ingest(&upd_r("decoy", vec![legacy(b"d", 1)]), T0, &NR);
    let rows = plain(&mut ix, &q_exact(b"p"), T0, &NR);
    assert_eq!(names(&rows), ["r1", "r2"]);
    assert_approx(rows[0].1, 26.667);
    assert_approx(rows[1].1, 13.333);
    // Bit-exact evaluation order: f32(80)·1·1·1 · f32(1 − 2/3).
    assert_eq!(rows[0].1, 80.0f32 * (1.0f64 - 2.0 / 3.0) as f32);
}

#[test]
fn c028_slo_bias() {
    let run = |bias: f32, ttft: i32| {
        let mut ix = index_with(HOUR, 0);
        ix.set_ranker(RankerConfig {
            slo_tight_ttft_ms: 100,
            slo_tight_bias: bias,
            ..RankerConfig::default()
        });
        ix.ingest(&upd_r("big-old", vec![legacy(b"p", 100)]), T0, &NR);
        let t1 = T0 + 20 * MIN;
        ix.ingest(&upd_r("small-fresh", vec![legacy(b"p", 50)]), t1, &NR);
        ix.ingest(&upd_r("decoy", vec![legacy(b"d", 1)]), t1, &NR);
        let mut q = q_exact(b"p");
        q.ttft_ms = ttft;
        plain(&mut ix, &q, t1, &NR)
    };
    assert_eq!(run(5.0, 0)[0].0, "big-old");
    assert_eq!(run(5.0, 500)[0].0, "big-old");
    let rows = run(5.0, 50);
    assert_eq!(names(&rows), ["small-fresh", "big-old"]);
    assert_approx(rows[0].1, 100.0);
    assert_approx(rows[1].1, 96.3);
    assert_eq!(run(0.0, 50)[0].0, "big-old");
}

#[test]
fn c029_chain_with_pressure() {
    let mut ix = index();
    ix.ingest(
        &with_stats(
            upd_r("big-but-hot", vec![chain_entry(&[b"b1", b"b2", b"b3"], 16)]),
            0.0,
            0.9,
        ),
        T0,
        &NR,
    );
    ix.ingest(
        &with_stats(
            upd_r("small-cool", vec![chain_entry(&[b"b1", b"b2"], 16)]),
            0.0,
            0.0,
        ),
        T0,
        &NR,
    );
    ix.ingest(&upd_r("decoy", vec![legacy(b"d", 16)]), T0, &NR);
    let c = chain(&[b"b1", b"b2", b"b3"], 16);
    let rows = plain(&mut ix, &c.q(), T0, &NR);
    assert_eq!(names(&rows), ["small-cool", "big-but-hot"]);
    assert_approx(rows[0].1, 10.667);
    assert_approx(rows[1].1, 3.2);
}

#[test]
fn c030_stale_stats_pressure_ignored() {
    let mut ix = index_with(10 * MIN, 0);
    ix.ingest(&with_stats(upd_r("r", vec![]), 0.5, 0.9), T0, &NR);
    let t1 = T0 + 15 * MIN;
    ix.ingest(&upd_r("r", vec![legacy(b"p", 50)]), t1, &NR);
    let rows = plain(&mut ix, &q_exact(b"p"), t1, &NR);
    assert_eq!(rows[0].1, 50.0);
}

#[test]
fn c032_worst_tier() {
    assert_eq!(worst_tier(1, 2), 2);
    assert_eq!(worst_tier(3, 2), 3);
    assert_eq!(worst_tier(1, 1), 1);
    for t in 0..=3 {
        assert_eq!(
            worst_tier(ranking::TIER_UNSPECIFIED, t),
            ranking::TIER_UNSPECIFIED
        );
        assert_eq!(
            worst_tier(t, ranking::TIER_UNSPECIFIED),
            ranking::TIER_UNSPECIFIED
        );
    }
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

// ---- E. Distinguishing power ------------------------------------------------------------------

#[test]
fn c034_distinguishing_power_table() {
    for m in [0, 1, 5] {
        assert_eq!(distinguishing_power(m, 0), 1.0);
        assert_eq!(distinguishing_power(m, 1), 1.0);
    }
    assert_eq!(distinguishing_power(3, 3), 0.0);
    assert!((distinguishing_power(1, 3) - 2.0 / 3.0).abs() < 1e-12);
    assert!((distinguishing_power(2, 3) - 1.0 / 3.0).abs() < 1e-12);
    assert_eq!(distinguishing_power(5, 3), 0.0);
    assert_eq!(distinguishing_power(-1, 3), 1.0);
    assert_eq!(distinguishing_power(-1, 1), 1.0);
}

#[test]
fn c036_distinguishing_power_exact() {
    let mut ix = index();
    ix.ingest(&upd_r("r0", vec![legacy(b"unique-rag-ctx", 64)]), T0, &NR);
    ix.ingest(&upd_r("r1", vec![legacy(b"other-prefix", 64)]), T0, &NR);
    ix.ingest(&upd_r("r2", vec![legacy(b"other-prefix", 64)]), T0, &NR);
    let rows = plain(&mut ix, &q_exact(b"unique-rag-ctx"), T0, &NR);
    assert_eq!(rows.len(), 1);
    assert!(approx(rows[0].1, 42.67, 0.1));

    let mut ix = index();
    ix.ingest(&upd_r("r0", vec![legacy(b"partial", 48)]), T0, &NR);
    ix.ingest(&upd_r("r1", vec![legacy(b"partial", 48)]), T0, &NR);
    ix.ingest(&upd_r("r2", vec![legacy(b"else", 48)]), T0, &NR);
    let rows = plain(&mut ix, &q_exact(b"partial"), T0, &NR);
    assert_eq!(rows.len(), 2);
    assert_approx(rows[0].1, 16.0);
    assert_approx(rows[1].1, 16.0);
}

#[test]
fn c037_single_replica_baseline() {
    let mut ix = index();
    ix.ingest(&upd_r("r", vec![legacy(b"p", 64)]), T0, &NR);
    assert_eq!(plain(&mut ix, &q_exact(b"p"), T0, &NR)[0].1, 64.0);
    let mut ix = index();
    ix.ingest(&upd_r("r", vec![chain_entry(&[b"b1", b"b2"], 64)]), T0, &NR);
    let c = chain(&[b"b1", b"b2"], 64);
    assert_eq!(plain(&mut ix, &c.q(), T0, &NR)[0].1, 128.0);
}

#[test]
fn c038_depth_aware_distinguishing_power() {
    let mut ix = index();
    ix.ingest(
        &upd_r("r0", vec![chain_entry(&[b"b1", b"b2", b"b3", b"b4"], 64)]),
        T0,
        &NR,
    );
    ix.ingest(
        &upd_r("r1", vec![chain_entry(&[b"b1", b"b2"], 64)]),
        T0,
        &NR,
    );
    ix.ingest(&upd_r("r2", vec![chain_entry(&[b"b1"], 64)]), T0, &NR);
    let c = chain(&[b"b1", b"b2", b"b3", b"b4"], 64);
    let rows = plain(&mut ix, &c.q(), T0, &NR);
    assert_eq!(names(&rows), ["r0", "r1", "r2"]);
    assert_approx(rows[0].1, 170.67);
    assert_approx(rows[1].1, 42.67);
    assert_eq!(rows[2].1, 0.0);
    assert_eq!((rows[0].2, rows[1].2, rows[2].2), (256, 128, 64));
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

// ---- F. TENANT_HOT and the orchestrator --------------------------------------------------------

#[test]
fn c040_prefix_match_beats_warm_stats_only() {
    let mut ix = index();
    ix.ingest(
        &with_stats(upd_r("prefix-holder", vec![legacy(b"p", 32)]), 0.9, 0.0),
        T0,
        &NR,
    );
    ix.ingest(&with_stats(upd_r("warm-only", vec![]), 0.9, 0.0), T0, &NR);
    let (s, rows) = route(&mut ix, &q_exact(b"p"), T0, &NR);
    assert_eq!(s, Strategy::PrefixMatch);
    assert_eq!(names(&rows), ["prefix-holder"]);
}

#[test]
fn c041_tenant_hot_scores() {
    let mut ix = index();
    ix.ingest(
        &with_stats(upd_r("warm", vec![legacy(b"other", 1)]), 0.7, 0.1),
        T0,
        &NR,
    );
    ix.ingest(
        &with_stats(upd_r("cold", vec![legacy(b"other", 1)]), 0.0, 0.5),
        T0,
        &NR,
    );
    let (s, rows) = route(&mut ix, &q_exact(b"novel"), T0, &NR);
    assert_eq!(s, Strategy::TenantHot);
    assert_eq!(names(&rows), ["warm"]);
    assert_approx(rows[0].1, 0.63);
    assert_eq!(rows[0].1, 0.7f32 * 1.0 * (1.0f32 - 0.1));
    assert_eq!(rows[0].2, 0);
    assert_eq!(rows[0].3, 0.7);
    assert_eq!(rows[0].4, 0);
    assert!(
        ix.lookup_route(&q_exact(b"novel"), T0, &NR)
            .lfu_hits
            .is_empty()
    );
}

#[test]
fn c042_stats_only_or_empty_is_none() {
    let mut ix = index();
    assert_eq!(
        route(&mut ix, &q_exact(b"p"), T0, &NR),
        (Strategy::None, vec![])
    );
    ix.ingest(&with_stats(upd_r("r", vec![]), 0.9, 0.0), T0, &NR);
    assert_eq!(
        route(&mut ix, &q_exact(b"p"), T0, &NR),
        (Strategy::None, vec![])
    );
}

#[test]
fn c044_tenant_hot_thresholds() {
    let setup = |ranker: RankerConfig, hit: f32, stats_at: i64| {
        let mut ix = index();
        ix.set_ranker(ranker);
        ix.ingest(
            &at(with_stats(upd_r("r", vec![]), hit, 0.0), stats_at),
            T0,
            &NR,
        );
        ix.ingest(&upd_r("r", vec![legacy(b"other", 16)]), T0, &NR);
        route(&mut ix, &q_exact(b"novel"), T0, &NR)
    };
    let r = RankerConfig {
        tenant_hot_min_hit_rate: 0.5,
        ..RankerConfig::default()
    };
    assert_eq!(setup(r, 0.2, T0), (Strategy::None, vec![]));
    let r = RankerConfig {
        tenant_hot_max_age_ns: 0,
        ..RankerConfig::default()
    };
    assert_eq!(setup(r, 0.9, T0), (Strategy::None, vec![]));
    assert_eq!(
        setup(RankerConfig::default(), 0.9, T0 - 10 * MIN),
        (Strategy::None, vec![])
    );
    // Control: the same data with fresh stats is TENANT_HOT.
    assert_eq!(
        setup(RankerConfig::default(), 0.9, T0).0,
        Strategy::TenantHot
    );
}

#[test]
fn c045_warm_replica_other_scheme_is_unknown_scheme() {
    let mut ix = index();
    ix.ingest(
        &with_stats(
            upd("t", "m", "sglang", "warm", vec![legacy(b"x", 16)]),
            0.9,
            0.0,
        ),
        T0,
        &NR,
    );
    assert_eq!(
        route(&mut ix, &q_exact(b"novel"), T0, &NR),
        (Strategy::UnknownHashScheme, vec![])
    );
}

#[test]
fn c046_tenant_hot_needs_live_prefix() {
    let mut ix = index_with(10 * MIN, 0);
    ix.set_ranker(RankerConfig {
        tenant_hot_max_age_ns: HOUR,
        ..RankerConfig::default()
    });
    ix.ingest(
        &with_stats(upd_r("r", vec![legacy(b"other", 16)]), 0.9, 0.0),
        T0,
        &NR,
    );
    assert_eq!(
        route(&mut ix, &q_exact(b"novel"), T0, &NR).0,
        Strategy::TenantHot
    );
    let t1 = T0 + 15 * MIN;
    ix.ingest(&with_stats(upd_r("r", vec![]), 0.9, 0.0), t1, &NR);
    ix.sweep(t1, &NR);
    assert_eq!(
        route(&mut ix, &q_exact(b"novel"), t1, &NR),
        (Strategy::None, vec![])
    );
}

#[test]
fn c048_warm_replica_surfaces_tenant_hot() {
    let mut ix = index();
    ix.ingest(
        &with_stats(upd_r("warm", vec![legacy(b"other", 16)]), 0.8, 0.0),
        T0,
        &NR,
    );
    let (s, rows) = route(&mut ix, &q_exact(b"novel"), T0, &NR);
    assert_eq!(s, Strategy::TenantHot);
    assert_eq!(names(&rows), ["warm"]);
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

// ---- G. Miss classifier -------------------------------------------------------------------------

#[test]
fn c049_unknown_tenant_and_presence_helpers() {
    let mut ix = index();
    ix.ingest(
        &upd("ic-smoke", "m", "vllm", "r", vec![legacy(b"p", 10)]),
        T0,
        &NR,
    );
    let mut q = q_exact(b"p");
    q.tenant = "default";
    assert_eq!(
        route(&mut ix, &q, T0, &NR),
        (Strategy::UnknownTenant, vec![])
    );
    assert!(ix.has_tenant("ic-smoke"));
    assert!(!ix.has_tenant("default"));

    let mut ix = index();
    ix.ingest(
        &upd("t", "m1", "vllm", "r", vec![legacy(b"p", 10)]),
        T0,
        &NR,
    );
    assert!(ix.has_tenant_model("t", "m1"));
    assert!(!ix.has_tenant_model("t", "m2"));
    assert!(!ix.has_tenant_model("other-tenant", "m1"));
    ix.ingest(&upd("t", "m", "vllm", "r", vec![legacy(b"p", 10)]), T0, &NR);
    assert!(ix.has_scope("t", "m", "vllm"));
    assert!(!ix.has_scope("t", "m", "vllm-v1"));
    assert!(!ix.has_scope("t", "m", "sglang"));

    let mut ix = index();
    ix.ingest(
        &upd("t", "m", "vllm", "only", vec![legacy(b"p", 10)]),
        T0,
        &NR,
    );
    assert!(ix.has_tenant("t") && ix.has_tenant_model("t", "m") && ix.has_scope("t", "m", "vllm"));
    ix.apply_event(&event(Type::AllCleared, "t", "m", "only", b""), T0, &NR);
    assert!(!ix.has_tenant("t"));
    assert!(!ix.has_tenant_model("t", "m"));
    assert!(!ix.has_scope("t", "m", "vllm"));
}

#[test]
fn c050_unknown_model_and_scheme() {
    let mut ix = index();
    ix.ingest(
        &upd("t", "m1", "vllm", "r", vec![legacy(b"p", 10)]),
        T0,
        &NR,
    );
    let mut q = q_exact(b"p");
    q.model = "m2";
    assert_eq!(
        route(&mut ix, &q, T0, &NR),
        (Strategy::UnknownModel, vec![])
    );

    let mut ix = index();
    ix.ingest(&upd_r("r", vec![legacy(b"p", 10)]), T0, &NR);
    let mut q = q_exact(b"p");
    q.hash_scheme = "vllm-v1";
    assert_eq!(
        route(&mut ix, &q, T0, &NR),
        (Strategy::UnknownHashScheme, vec![])
    );
}

#[test]
fn c052_novel_prefix_is_none() {
    let mut ix = index();
    ix.set_ranker(RankerConfig {
        pressure_weight: 0.0,
        slo_tight_ttft_ms: 0,
        slo_tight_bias: 0.0,
        tenant_hot_min_hit_rate: 0.0,
        tenant_hot_max_age_ns: 0,
    });
    ix.ingest(
        &with_stats(upd_r("r", vec![legacy(b"p", 10)]), 0.9, 0.0),
        T0,
        &NR,
    );
    assert_eq!(
        route(&mut ix, &q_exact(b"novel"), T0, &NR),
        (Strategy::None, vec![])
    );

    let mut ix = index();
    ix.ingest(&upd_r("r", vec![legacy(b"p", 10)]), T0, &NR);
    assert_eq!(
        route(&mut ix, &q_exact(b"novel"), T0, &NR),
        (Strategy::None, vec![])
    );

    let mut ix = index();
    assert_eq!(
        route(&mut ix, &q_exact(b"novel"), T0, &NR),
        (Strategy::None, vec![])
    );
}

#[test]
fn c053_empty_request_fields_are_none() {
    let mut ix = index();
    ix.ingest(&upd_r("r", vec![legacy(b"p", 10)]), T0, &NR);
    ix.ingest(&upd("", "m", "vllm", "r", vec![legacy(b"p", 10)]), T0, &NR);
    ix.ingest(&upd("t", "", "vllm", "r", vec![legacy(b"p", 10)]), T0, &NR);
    for (t, m, s) in [("t", "m", ""), ("", "m", "vllm"), ("t", "", "vllm")] {
        let q = LookupQuery {
            tenant: t,
            model: m,
            hash_scheme: s,
            prefix_hash: b"p",
            ..Default::default()
        };
        assert_eq!(
            route(&mut ix, &q, T0, &NR),
            (Strategy::None, vec![]),
            "{t}/{m}/{s}"
        );
    }
}

#[test]
fn c054_chain_unknown_scheme() {
    let mut ix = index();
    ix.ingest(&upd_r("r", vec![chain_entry(&[b"b1", b"b2"], 16)]), T0, &NR);
    let c = chain(&[b"b1", b"b2"], 16);
    let mut q = c.q();
    q.hash_scheme = "vllm-v1";
    assert_eq!(
        route(&mut ix, &q, T0, &NR),
        (Strategy::UnknownHashScheme, vec![])
    );
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

/// §8.5 / §19.15: UNKNOWN_TENANT depends only on whether the tenant holds prefix keys now. The
/// directory's fixed-capacity tenant table (shards/index/src/directory.rs) saturates once more than
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

// ---- H. Adapter partitions ----------------------------------------------------------------------

#[test]
fn c056_adapter_partitions() {
    let mut ix = index();
    ix.ingest(&upd_r("r", vec![legacy(b"p", 16)]), T0, &NR);
    let mut q = q_exact(b"p");
    assert_eq!(plain(&mut ix, &q, T0, &NR).len(), 1);
    q.adapter = "sql-lora";
    assert!(plain(&mut ix, &q, T0, &NR).is_empty());

    let mut ix = index();
    ix.ingest(
        &upd_r("r", vec![legacy_adapter(b"p", 16, "sql-lora")]),
        T0,
        &NR,
    );
    let q = q_exact(b"p");
    assert!(plain(&mut ix, &q, T0, &NR).is_empty());
}

#[test]
fn c057_adapter_inheritance_and_override() {
    let mut ix = index();
    let mut u = upd_r(
        "r",
        vec![
            legacy(b"inherits", 16),
            legacy_adapter(b"overrides", 16, "other-lora"),
        ],
    );
    u.adapter_id = "default-lora".into();
    ix.ingest(&u, T0, &NR);
    let q = |h: &'static [u8], a: &'static str| LookupQuery {
        adapter: a,
        ..q_exact(h)
    };
    assert_eq!(
        plain(&mut ix, &q(b"inherits", "default-lora"), T0, &NR).len(),
        1
    );
    assert_eq!(
        plain(&mut ix, &q(b"overrides", "other-lora"), T0, &NR).len(),
        1
    );
    assert!(plain(&mut ix, &q(b"overrides", "default-lora"), T0, &NR).is_empty());
}

#[test]
fn c058_adapter_chain_denominator_is_adapter_blind() {
    let mut ix = index();
    let mut a = chain_entry(&[b"b0", b"b1"], 64);
    a.adapter_id = "sql-lora".into();
    let mut b = chain_entry(&[b"b0", b"b1"], 64);
    b.adapter_id = "chat-lora".into();
    ix.ingest(&upd_r("replica-sql", vec![a]), T0, &NR);
    ix.ingest(&upd_r("replica-chat", vec![b]), T0, &NR);
    let c = chain(&[b"b0", b"b1"], 64);
    let q = LookupQuery {
        adapter: "sql-lora",
        ..c.q()
    };
    let (s, rows) = route(&mut ix, &q, T0, &NR);
    assert_eq!(s, Strategy::PrefixMatch);
    assert_eq!(names(&rows), ["replica-sql"]);
    assert_eq!(rows[0].2, 128);
    assert_eq!(rows[0].1, 64.0);
}

#[test]
fn c060_unseen_adapter_is_none() {
    let mut ix = index();
    ix.ingest(
        &upd_r("r", vec![legacy_adapter(b"p", 16, "sql-lora")]),
        T0,
        &NR,
    );
    let q = LookupQuery {
        adapter: "never-seen",
        ..q_exact(b"p")
    };
    assert_eq!(route(&mut ix, &q, T0, &NR), (Strategy::None, vec![]));
    let q = LookupQuery {
        adapter: "sql-lora",
        hash_scheme: "sglang",
        ..q_exact(b"p")
    };
    assert_eq!(
        route(&mut ix, &q, T0, &NR),
        (Strategy::UnknownHashScheme, vec![])
    );
}

// ---- I. Events, TTL, global cap -----------------------------------------------------------------

#[test]
fn c062_sweep_drains_and_gauge_zero() {
    let mut ix = index_with(10 * MIN, 0);
    ix.ingest(&upd_r("r", vec![legacy(b"p", 16)]), T0, &NR);
    let mut g = Vec::new();
    ix.drain_gauge_updates(|m, c| g.push((m.to_string(), c)));
    assert_eq!(g, [("m".to_string(), 1)]);
    let t1 = T0 + 11 * MIN;
    let out = ix.sweep(t1, &NR);
    assert_eq!(out.ttl_evicted.lru, 1);
    assert!(plain(&mut ix, &q_exact(b"p"), t1, &NR).is_empty());
    assert_eq!(ix.model_entry_count("m"), 0);
    let mut g = Vec::new();
    ix.drain_gauge_updates(|m, c| g.push((m.to_string(), c)));
    assert_eq!(g, [("m".to_string(), 0)]);
    let mut g = Vec::new();
    ix.drain_gauge_updates(|m, c| g.push((m.to_string(), c)));
    assert!(g.is_empty(), "drained model reported once");
    assert_eq!(ix.model_entry_counts(), [("m".to_string(), 0)]);
}

#[test]
fn c064_prefix_evicted_and_all_cleared() {
    let mut ix = index();
    ix.ingest(
        &upd_r("r1", vec![legacy(b"p1", 16), legacy(b"p2", 16)]),
        T0,
        &NR,
    );
    ix.ingest(&upd_r("r2", vec![legacy(b"p1", 16)]), T0, &NR);
    ix.apply_event(&event(Type::PrefixEvicted, "t", "m", "r1", b"p1"), T0, &NR);
    assert_eq!(names(&plain(&mut ix, &q_exact(b"p1"), T0, &NR)), ["r2"]);
    assert_eq!(names(&plain(&mut ix, &q_exact(b"p2"), T0, &NR)), ["r1"]);
    let out = ix.apply_event(&event(Type::AllCleared, "t", "m", "r1", b""), T0, &NR);
    assert_eq!(out.entries_removed, 1);
    assert!(plain(&mut ix, &q_exact(b"p2"), T0, &NR).is_empty());
    assert_eq!(names(&plain(&mut ix, &q_exact(b"p1"), T0, &NR)), ["r2"]);
}

#[test]
fn c065_per_tenant_ttl() {
    let rules = Rules::ttl("tenant-short", 5 * MIN);
    let mut ix = index_with(HOUR, 0);
    ix.ingest(
        &upd("tenant-short", "m", "vllm", "r", vec![legacy(b"p", 16)]),
        T0,
        &rules,
    );
    ix.ingest(
        &upd("tenant-long", "m", "vllm", "r", vec![legacy(b"p", 16)]),
        T0,
        &rules,
    );
    let t1 = T0 + 10 * MIN;
    let q = |t: &'static str| LookupQuery {
        tenant: t,
        ..q_exact(b"p")
    };
    assert!(plain(&mut ix, &q("tenant-short"), t1, &rules).is_empty());
    assert_eq!(plain(&mut ix, &q("tenant-long"), t1, &rules).len(), 1);
    ix.sweep(t1, &rules);
    assert_eq!(ix.model_entry_count("m"), 1);

    let zero = Rules::ttl("t", 0);
    let mut ix = index_with(HOUR, 0);
    ix.ingest(&upd_r("r", vec![legacy(b"p", 16)]), T0, &zero);
    assert_eq!(
        plain(&mut ix, &q_exact(b"p"), T0 + 30 * MIN, &zero).len(),
        1
    );
}

#[test]
fn c066_prefix_added_refreshes_nothing() {
    let mut ix = index_with(10 * MIN, 0);
    ix.ingest(&upd("t", "m", "vllm", "r", vec![legacy(b"p", 16)]), T0, &NR);
    ix.ingest(
        &upd("t", "m", "sglang", "r", vec![legacy(b"p", 16)]),
        T0,
        &NR,
    );
    ix.apply_event(
        &event(Type::PrefixAdded, "t", "m", "r", b"p"),
        T0 + 9 * MIN,
        &NR,
    );
    let out = ix.sweep(T0 + 11 * MIN, &NR);
    assert_eq!(out.ttl_evicted.total(), 2);
    assert_eq!(ix.entry_count(), 0);
}

/// Producer timestamps in the future are clamped to `now` plus the allowed skew, so an entry
/// stamped in year 2300 or at `i64::MAX` expires at most one skew after a correctly stamped one
/// instead of never; past stamps are kept as given.
#[test]
fn future_producer_timestamps_are_clamped_to_the_skew() {
    let rules = Rules::ttl("t", 10 * MIN);
    let skew = inferencecache_index::index::DEFAULT_MAX_FUTURE_SKEW_NS;
    for stamp_us in [i64::MAX, 10_000_000_000_000_000, (T0 + HOUR) / 1000] {
        let mut ix = index();
        let mut u = upd_r("r", vec![legacy(b"future", 16)]);
        u.timestamp_us = stamp_us;
        let out = ix.ingest(&u, T0, &rules);
        assert!(out.timestamp_clamped, "{stamp_us}");
        ix.sweep(T0 + 10 * MIN + skew - 1, &rules);
        assert_eq!(ix.entry_count(), 1, "kept until ttl + skew ({stamp_us})");
        ix.sweep(T0 + 10 * MIN + skew + 1, &rules);
        assert_eq!(ix.entry_count(), 0, "expired after ttl + skew ({stamp_us})");
    }
    let mut ix = index();
    let within = at(upd_r("r", vec![legacy(b"near", 16)]), T0 + skew);
    assert!(!ix.ingest(&within, T0, &rules).timestamp_clamped);
    let past = at(upd_r("r", vec![legacy(b"old", 16)]), T0 - 5 * MIN);
    assert!(!ix.ingest(&past, T0, &rules).timestamp_clamped);
    let mut e = event(Type::ReplicaUpdated, "t", "m", "r", b"");
    e.timestamp_us = i64::MAX;
    assert!(ix.apply_event(&e, T0, &rules).timestamp_clamped);
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

// ---- J. LFU ------------------------------------------------------------------------------------

fn deliver(
    ix: &mut inferencecache_index::index::Index,
    q: &LookupQuery<'_>,
    now: i64,
    rules: &Rules,
    times: usize,
) {
    for _ in 0..times {
        assert_eq!(
            ix.lookup_route(q, now, rules).strategy,
            Strategy::PrefixMatch
        );
        ix.credit_lfu(|_| true, rules);
    }
}

fn hashes(ix: &inferencecache_index::index::Index) -> Vec<Vec<u8>> {
    let mut v: Vec<Vec<u8>> = ix.dump_entries().into_iter().map(|e| e.hash).collect();
    v.sort();
    v.dedup();
    v
}

#[test]
fn c068_lfu_cap_keeps_hot() {
    let rules = Rules::lfu("t");
    let mut ix = index_with(HOUR, 3);
    ix.ingest(&upd_r("r", vec![legacy(b"hot", 16)]), T0, &rules);
    ix.ingest(&upd_r("r", vec![legacy(b"warm", 16)]), T0 + MIN, &rules);
    ix.ingest(&upd_r("r", vec![legacy(b"cold", 16)]), T0 + 2 * MIN, &rules);
    deliver(&mut ix, &q_exact(b"hot"), T0 + 2 * MIN, &rules, 5);
    deliver(&mut ix, &q_exact(b"warm"), T0 + 2 * MIN, &rules, 2);
    let out = ix.ingest(&upd_r("r", vec![legacy(b"new", 16)]), T0 + 3 * MIN, &rules);
    assert_eq!(out.cap_evicted.lfu, 1);
    assert_eq!(
        hashes(&ix),
        [b"hot".to_vec(), b"new".to_vec(), b"warm".to_vec()]
    );
}

#[test]
fn c069_lfu_no_lookups_is_oldest_first() {
    let rules = Rules::lfu("t");
    let mut ix = index_with(HOUR, 2);
    ix.ingest(&upd_r("r", vec![legacy(b"older", 16)]), T0, &rules);
    ix.ingest(&upd_r("r", vec![legacy(b"newer", 16)]), T0 + MIN, &rules);
    ix.ingest(
        &upd_r("r", vec![legacy(b"trigger", 16)]),
        T0 + 2 * MIN,
        &rules,
    );
    assert_eq!(hashes(&ix), [b"newer".to_vec(), b"trigger".to_vec()]);
}

#[test]
fn c070_lru_vs_lfu_victims() {
    let lfu = Rules::lfu("t");
    let build = || {
        let mut ix = index_with(HOUR, 3);
        for (i, (h, n)) in [(b"A", 9), (b"B", 3), (b"C", 5)].into_iter().enumerate() {
            ix.ingest(&upd_r("r", vec![legacy(h, 16)]), T0 + i as i64 * MIN, &lfu);
            deliver(&mut ix, &q_exact(h), T0 + 3 * MIN, &lfu, n);
        }
        ix
    };
    // LRU (the policy switched away from LFU: detected before the cap sweep).
    let mut ix = build();
    ix.ingest(&upd_r("r", vec![legacy(b"D", 16)]), T0 + 3 * MIN, &NR);
    assert_eq!(hashes(&ix), [b"B".to_vec(), b"C".to_vec(), b"D".to_vec()]);
    // LFU.
    let mut ix = build();
    ix.ingest(&upd_r("r", vec![legacy(b"D", 16)]), T0 + 3 * MIN, &lfu);
    assert_eq!(hashes(&ix), [b"A".to_vec(), b"B".to_vec(), b"C".to_vec()]);
}

#[test]
fn c072_lfu_chain_credits_run_only() {
    let rules = Rules::lfu("t");
    let mut ix = index();
    ix.ingest(
        &upd_r("r", vec![chain_entry(&[b"b1", b"b2", b"b3", b"x4"], 16)]),
        T0,
        &rules,
    );
    let c = chain(&[b"b1", b"b2", b"b3"], 16);
    deliver(&mut ix, &c.q(), T0, &rules, 2);
    for e in ix.dump_entries() {
        let want = if e.hash == b"x4" { 0 } else { 2 };
        assert_eq!(e.access_count, want, "{:?}", e.hash);
    }
}

#[test]
fn c073_eviction_counters_by_algorithm() {
    let lfu = Rules::lfu("t");
    let mut ix = index_with(HOUR, 1);
    ix.ingest(&upd_r("r", vec![legacy(b"a", 16)]), T0, &lfu);
    let out = ix.ingest(&upd_r("r", vec![legacy(b"b", 16)]), T0 + SEC, &lfu);
    assert_eq!(
        out.cap_evicted,
        inferencecache_index::index::EvictionCounts { lru: 0, lfu: 1 }
    );

    let mut ix = index_with(HOUR, 1);
    ix.ingest(&upd_r("r", vec![legacy(b"a", 16)]), T0, &NR);
    let out = ix.ingest(&upd_r("r", vec![legacy(b"b", 16)]), T0 + SEC, &NR);
    assert_eq!(
        out.cap_evicted,
        inferencecache_index::index::EvictionCounts { lru: 1, lfu: 0 }
    );

    let mut ix = index_with(10 * MIN, 0);
    ix.ingest(&upd_r("r", vec![legacy(b"a", 16)]), T0, &lfu);
    let out = ix.sweep(T0 + 11 * MIN, &lfu);
    assert_eq!(
        out.ttl_evicted,
        inferencecache_index::index::EvictionCounts { lru: 0, lfu: 1 }
    );
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

// ---- K. Tenant quota ----------------------------------------------------------------------------

fn team(replica: &str, h: &[u8]) -> inferencecache_proto::v1alpha1::CacheStateUpdate {
    upd("team", "m", "vllm", replica, vec![legacy(h, 16)])
}

fn index_entries(ix: &inferencecache_index::index::Index, tenant: &str) -> u64 {
    ix.snapshot()
        .tenants
        .iter()
        .find(|t| t.tenant_id == tenant)
        .map_or(0, |t| t.index_entries)
}

#[test]
fn c077_quota_counts_distinct_keys() {
    let rules = Rules::quota("team", 2);
    let mut ix = index();
    ix.ingest(&team("r1", b"a"), T0, &rules);
    ix.ingest(&team("r2", b"a"), T0 + MIN, &rules);
    assert_eq!(index_entries(&ix, "team"), 1);
    ix.ingest(&team("r1", b"b"), T0 + 2 * MIN, &rules);
    assert_eq!(index_entries(&ix, "team"), 2);
    let out = ix.ingest(&team("r1", b"c"), T0 + 3 * MIN, &rules);
    assert_eq!(index_entries(&ix, "team"), 2);
    assert_eq!(out.quota_evicted_keys, 1);
    assert_eq!(hashes(&ix), [b"b".to_vec(), b"c".to_vec()]);
    assert_eq!(ix.entry_count(), 2, "a gone from both replicas");
}

#[test]
fn c078_quota_oldest_first() {
    let rules = Rules::quota("team", 3);
    let mut ix = index();
    let mut evicted = 0;
    for (i, h) in [b"a", b"b", b"c", b"d", b"e"].into_iter().enumerate() {
        evicted += ix
            .ingest(&team("r", h), T0 + i as i64 * MIN, &rules)
            .quota_evicted_keys;
    }
    assert_eq!(evicted, 2);
    assert_eq!(hashes(&ix), [b"c".to_vec(), b"d".to_vec(), b"e".to_vec()]);

    let rules = Rules::quota("team", 10);
    let mut ix = index();
    for (i, h) in [b"a", b"b", b"c"].into_iter().enumerate() {
        assert_eq!(
            ix.ingest(&team("r", h), T0 + i as i64 * MIN, &rules)
                .quota_evicted_keys,
            0
        );
    }
    assert_eq!(ix.key_count(), 3);
}

#[test]
fn c080_quota_zero_keeps_nothing() {
    let rules = Rules::quota("team", 0);
    let mut ix = index();
    let out = ix.ingest(
        &upd(
            "team",
            "m",
            "vllm",
            "r",
            vec![legacy(b"a", 16), legacy(b"b", 16)],
        ),
        T0,
        &rules,
    );
    assert_eq!(out.quota_evicted_keys, 2);
    assert_eq!(ix.tenant_prefix_count("team"), 0);
    assert_eq!(ix.entry_count(), 0);
}

#[test]
fn c081_quota_tie_breaks() {
    let rules = Rules::quota("team", 1);
    type Variant = (&'static str, &'static str, &'static str, &'static [u8]);
    let cases: [(Variant, Variant); 4] = [
        (("m1", "vllm", "", b"p"), ("m2", "vllm", "", b"p")),
        (("m", "vllm-a", "", b"p"), ("m", "vllm-b", "", b"p")),
        (("m", "vllm", "lora-a", b"p"), ("m", "vllm", "lora-b", b"p")),
        (("m", "vllm", "", b"p1"), ("m", "vllm", "", b"p2")),
    ];
    for (small, big) in cases {
        for order in [[small, big], [big, small]] {
            let mut ix = index();
            for (m, s, a, h) in order {
                ix.ingest(
                    &upd("team", m, s, "r", vec![legacy_adapter(h, 16, a)]),
                    T0,
                    &rules,
                );
            }
            let left = ix.dump_entries();
            assert_eq!(left.len(), 1);
            let e = &left[0];
            assert_eq!(
                (
                    e.model.as_str(),
                    e.scheme.as_str(),
                    e.adapter.as_str(),
                    e.hash.as_slice()
                ),
                big
            );
        }
    }
}

// ---- L. Aggregates, /snapshot, gauges -----------------------------------------------------------

#[test]
fn c084_snapshot_rows() {
    let mut ix = index();
    for (m, p) in [("m1", b"p1"), ("m2", b"p2")] {
        let mut u = upd("tenant-a", m, "vllm", "replica-a", vec![legacy(p, 16)]);
        u.stats = Some(inferencecache_proto::v1alpha1::ReplicaStats {
            cache_memory_bytes: 100,
            hit_rate: 0.8,
            pressure: 0.5,
            t2_hit_tokens: 600,
            t2_query_tokens: 1000,
            ..Default::default()
        });
        ix.ingest(&u, T0, &NR);
    }
    let mut u = upd(
        "tenant-b",
        "m1",
        "vllm",
        "replica-b",
        vec![legacy(b"p3", 16)],
    );
    u.stats = Some(inferencecache_proto::v1alpha1::ReplicaStats {
        cache_memory_bytes: 200,
        hit_rate: 0.6,
        pressure: 0.3,
        ..Default::default()
    });
    ix.ingest(&u, T0, &NR);
    let s = ix.snapshot();
    assert_eq!(s.total_prefixes, 3);
    assert_eq!(s.hot_prefixes, 0);
    assert_eq!(s.replicas.len(), 2);
    let a = &s.replicas[0];
    assert_eq!(
        (a.replica_id.as_str(), a.tenant.as_str(), a.prefix_count),
        ("replica-a", "tenant-a", 2)
    );
    assert!(a.stats_reported);
    assert_eq!(
        (a.cache_memory_bytes, a.hit_rate, a.pressure),
        (100, 0.8, 0.5)
    );
    assert_eq!((a.t2_hit_tokens, a.t2_query_tokens), (600, 1000));
    assert_eq!(a.last_event_at, Some(T0));
    assert_eq!(a.last_update, Some(T0));
    let b = &s.replicas[1];
    assert_eq!(
        (b.replica_id.as_str(), b.tenant.as_str(), b.prefix_count),
        ("replica-b", "tenant-b", 1)
    );
    assert_eq!(b.last_event_at, Some(T0));
    assert_eq!(s.tenants.len(), 2);
    let ta = &s.tenants[0];
    assert_eq!(
        (
            ta.tenant_id.as_str(),
            ta.index_entries,
            ta.hit_rate,
            ta.hit_rate_reported,
            ta.memory_used
        ),
        ("tenant-a", 2, 0.8, true, 0)
    );
    let tb = &s.tenants[1];
    assert_eq!(
        (
            tb.tenant_id.as_str(),
            tb.index_entries,
            tb.hit_rate,
            tb.hit_rate_reported
        ),
        ("tenant-b", 1, 0.6, true)
    );
}

#[test]
fn c085_prefix_only_replica_row() {
    let mut ix = index();
    ix.ingest(
        &upd_r("r", vec![legacy(b"a", 16), legacy(b"b", 16)]),
        T0,
        &NR,
    );
    let s = ix.snapshot();
    assert_eq!(s.replicas.len(), 1);
    let r = &s.replicas[0];
    assert!(!r.stats_reported);
    assert_eq!(
        (
            r.hit_rate,
            r.cache_memory_bytes,
            r.last_update,
            r.prefix_count
        ),
        (0.0, 0, None, 2)
    );
    let t = &s.tenants[0];
    assert_eq!(
        (t.hit_rate_reported, t.hit_rate, t.index_entries),
        (false, 0.0, 2)
    );
}

#[test]
fn c086_tenant_entries_sum_to_total() {
    let check = |ix: &inferencecache_index::index::Index, total: u64| {
        let s = ix.snapshot();
        assert_eq!(s.total_prefixes, total);
        assert_eq!(
            s.tenants.iter().map(|t| t.index_entries).sum::<u64>(),
            total
        );
    };
    check(&index(), 0);
    assert!(index().snapshot().replicas.is_empty());

    let mut ix = index();
    ix.ingest(
        &upd(
            "one",
            "m",
            "vllm",
            "r",
            vec![legacy(b"a", 1), legacy(b"b", 1)],
        ),
        T0,
        &NR,
    );
    check(&ix, 2);

    let mut ix = index();
    ix.ingest(
        &upd("team-a", "m", "vllm", "r1", vec![legacy(b"a", 1)]),
        T0,
        &NR,
    );
    ix.ingest(
        &upd("team-a", "m", "vllm", "r2", vec![legacy(b"a", 1)]),
        T0,
        &NR,
    );
    ix.ingest(
        &upd("team-b", "m", "vllm", "r1", vec![legacy(b"c", 1)]),
        T0,
        &NR,
    );
    check(&ix, 2);

    let mut ix = index();
    ix.ingest(&upd("", "m", "vllm", "r", vec![legacy(b"a", 1)]), T0, &NR);
    ix.ingest(
        &upd("team", "m", "vllm", "r", vec![legacy(b"b", 1)]),
        T0,
        &NR,
    );
    check(&ix, 2);
    let ids: Vec<String> = ix
        .snapshot()
        .tenants
        .into_iter()
        .map(|t| t.tenant_id)
        .collect();
    assert_eq!(ids, ["", "team"]);

    let rules = Rules::quota("team", 2);
    let mut ix = index();
    for (i, h) in [b"a", b"b", b"c", b"d"].into_iter().enumerate() {
        ix.ingest(&team("r", h), T0 + i as i64, &rules);
    }
    check(&ix, 2);

    // Reserved entries never appear.
    let mut ix = index();
    ix.ingest(
        &upd(
            PROBE_TENANT,
            "m",
            "vllm",
            "__probe-x",
            vec![legacy(b"a", 1)],
        ),
        T0,
        &NR,
    );
    check(&ix, 0);
    assert!(ix.snapshot().replicas.is_empty());
}

#[test]
fn c089_entries_gauge() {
    let mut ix = index();
    ix.ingest(&upd_r("r", vec![legacy(b"a", 1), legacy(b"b", 1)]), T0, &NR);
    let mut g = std::collections::HashMap::new();
    ix.drain_gauge_updates(|m, c| {
        g.insert(m.to_string(), c);
    });
    assert_eq!(g["m"], 2);

    let mut ix = index();
    for i in 0..50u32 {
        ix.ingest(
            &upd_r(&format!("r{i}"), vec![legacy(&i.to_be_bytes(), 1)]),
            T0,
            &NR,
        );
        ix.drain_gauge_updates(|m, c| {
            g.insert(m.to_string(), c);
        });
    }
    assert_eq!(ix.key_count(), 50);
    assert_eq!(g["m"], 50);
}

// ---- P. Affinity primitive ----------------------------------------------------------------------

#[test]
fn c128_affinity_primitive() {
    use sha2::{Digest, Sha256};
    let mut ix = index();
    assert_eq!(ix.affinity_hint("t", "m", "vllm", b"seed"), None);
    ix.ingest(
        &upd("t", "m", "vllm", "r-vllm", vec![legacy(b"\x01", 32)]),
        T0,
        &NR,
    );
    ix.ingest(
        &upd("t", "m", "sglang", "r-sglang", vec![legacy(b"\x02", 32)]),
        T0,
        &NR,
    );
    assert_eq!(ix.affinity_hint("t", "m", "", b"seed"), None);
    assert_eq!(ix.affinity_hint("t", "m", "vllm", b""), None);
    assert_eq!(
        ix.affinity_hint("t", "m", "vllm", b"any-seed"),
        Some("r-vllm")
    );
    assert_eq!(
        ix.affinity_hint("t", "m", "sglang", b"any-seed"),
        Some("r-sglang")
    );
    assert_eq!(ix.affinity_hint("t", "m", "unknown", b"any-seed"), None);
    assert_eq!(
        ix.affinity_hint_fed("t", "m", "vllm", |_| false),
        None,
        "no seed, no pick"
    );

    // 8 replicas × 1000 seeds from a fixed generator: roughly uniform.
    let ids: Vec<String> = (1..=8).map(|i| format!("r-{i}")).collect();
    let build = |order: &[usize]| {
        let mut ix = index();
        for &i in order {
            ix.ingest(
                &upd(
                    "tenantA",
                    "modelX",
                    "vllm",
                    &ids[i],
                    vec![legacy(&[i as u8 + 1], 32)],
                ),
                T0,
                &NR,
            );
        }
        ix
    };
    let a = build(&[0, 1, 2, 3, 4, 5, 6, 7]);
    let b = build(&[7, 3, 5, 1, 0, 6, 2, 4]);
    let mut counts = std::collections::HashMap::<String, u32>::new();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..1000 {
        let mut seed = [0u8; 32];
        for chunk in seed.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            chunk.copy_from_slice(&x.to_le_bytes());
        }
        let pa = a.affinity_hint("tenantA", "modelX", "vllm", &seed).unwrap();
        let pb = b.affinity_hint("tenantA", "modelX", "vllm", &seed).unwrap();
        assert_eq!(pa, pb);
        // The streamed seed (in uneven parts) picks what the whole seed picks.
        let fed = a.affinity_hint_fed("tenantA", "modelX", "vllm", |sink| {
            sink(&seed[..3]);
            sink(&seed[3..20]);
            sink(&seed[20..]);
            true
        });
        assert_eq!(fed, Some(pa));
        let d = Sha256::digest(seed);
        let want = u64::from_be_bytes(d[..8].try_into().unwrap()) % 8;
        let mut sorted = ids.clone();
        sorted.sort();
        assert_eq!(pa, sorted[want as usize]);
        *counts.entry(pa.to_string()).or_default() += 1;
    }
    assert_eq!(counts.len(), 8);
    for (r, c) in &counts {
        assert!((80..=220).contains(c), "{r}: {c}");
    }
    // One replica → always that replica.
    let one = build(&[2]);
    assert_eq!(
        one.affinity_hint("tenantA", "modelX", "vllm", b"x"),
        Some("r-3")
    );
    assert_eq!(
        one.affinity_hint("tenantA", "modelX", "vllm", b"yy"),
        Some("r-3")
    );
}

// ---- U. /probe, index part (C149: reserved entries never count toward or fall to the cap) -------

#[test]
fn c149_probe_entries_are_reserved() {
    let mut ix = index_with(HOUR, 1);
    ix.ingest(&upd_r("real", vec![legacy(b"real", 16)]), T0, &NR);
    for i in 0..3 {
        let now = T0 + (i + 1) * SEC;
        let probe = upd(
            PROBE_TENANT,
            "m",
            "vllm",
            "__probe-b",
            vec![chain_entry(&[&[i as u8; 32]], 16)],
        );
        let out = ix.ingest(&with_stats(probe, 1.0, 0.0), now, &NR);
        assert_eq!(out.cap_evicted.total(), 0);
        let c = chain(&[&[i as u8; 32]], 16);
        let q = LookupQuery {
            tenant: PROBE_TENANT,
            ..c.q()
        };
        assert_eq!(names(&plain(&mut ix, &q, now, &NR)), ["__probe-b"]);
        assert_eq!(route(&mut ix, &q, now, &NR).0, Strategy::PrefixMatch);
        ix.apply_event(
            &event(Type::AllCleared, PROBE_TENANT, "m", "__probe-b", b""),
            now,
            &NR,
        );
        assert_eq!(
            names(&plain(&mut ix, &q_exact(b"real"), now, &NR)),
            ["real"]
        );
    }
    assert_eq!(ix.tenant_prefix_count(PROBE_TENANT), 0);
    assert!(ix.cache_state(PROBE_TENANT, "m").replicas.is_empty());
    assert_eq!(ix.entry_count(), 1);
}
