//! The removal hook (`Index::set_removal_sink`): every entry the index removes on its own — TTL
//! sweep, global cap, tenant quota, a stretch's rest cut off at the extent bound — is reported
//! once, with its names, hash bytes, reason and
//! algorithm, before it is gone; producer-requested removals and the absence of a sink report
//! nothing.

mod index_support;

use std::sync::{Arc, Mutex};

use index_support::*;
use inferencecache_index::PROBE_TENANT;
use inferencecache_index::index::{Index, RemovalReason, Removed};
use inferencecache_index::rules::{Eviction, NoRules};
use inferencecache_proto::v1alpha1::cache_event::Type;

/// (reason, algorithm, tenant, model, scheme, adapter, replica, hash, at, reserved)
type Row = (
    RemovalReason,
    Eviction,
    String,
    String,
    String,
    String,
    String,
    Vec<u8>,
    i64,
    bool,
);

fn record(ix: &mut Index) -> Arc<Mutex<Vec<Row>>> {
    let rows = Arc::new(Mutex::new(Vec::new()));
    let sink_rows = rows.clone();
    ix.set_removal_sink(Some(Box::new(move |r: &Removed<'_>| {
        let mut buf = [0u8; 8];
        sink_rows.lock().unwrap().push((
            r.reason(),
            r.algorithm(),
            r.tenant().to_string(),
            r.model().to_string(),
            r.hash_scheme().to_string(),
            r.adapter().to_string(),
            r.replica().to_string(),
            r.prefix_hash(&mut buf).to_vec(),
            r.at_ns(),
            r.reserved(),
        ));
    })));
    rows
}

fn take(rows: &Arc<Mutex<Vec<Row>>>) -> Vec<Row> {
    std::mem::take(&mut *rows.lock().unwrap())
}

#[test]
fn sweep_reports_each_expired_entry_with_its_names_before_removing_it() {
    let mut ix = index_with(HOUR, 0);
    let rows = record(&mut ix);
    let mut u = upd_r(
        "r1",
        vec![legacy(b"old", 16), legacy_adapter(b"x", 8, "lora")],
    );
    ix.ingest(&u, T0, &NoRules);
    u.replica_id = "r2".into();
    u.prefixes = vec![legacy(b"new", 16)];
    ix.ingest(&u, T0 + 30 * MIN, &NoRules);
    // Probe entries are swept too; the sink is told they are reserved.
    ix.ingest(
        &upd(PROBE_TENANT, "m", "vllm", "p", vec![legacy(b"probe", 4)]),
        T0,
        &NoRules,
    );
    let now = T0 + HOUR + SEC;
    let out = ix.sweep(now, &NoRules);
    assert_eq!(out.ttl_evicted.total(), 3);
    let mut got = take(&rows);
    got.sort_by(|a, b| a.7.cmp(&b.7));
    let row = |hash: &[u8], adapter: &str, tenant: &str, replica: &str, reserved| {
        (
            RemovalReason::Ttl,
            Eviction::Lru,
            tenant.to_string(),
            "m".to_string(),
            "vllm".to_string(),
            adapter.to_string(),
            replica.to_string(),
            hash.to_vec(),
            now,
            reserved,
        )
    };
    assert_eq!(
        got,
        vec![
            row(b"old", "", "t", "r1", false),
            row(b"probe", "", PROBE_TENANT, "p", true),
            row(b"x", "lora", "t", "r1", false),
        ]
    );
    assert_eq!(ix.entry_count(), 1, "only the fresh entry is left");
    assert!(take(&rows).is_empty());
    // A second sweep finds nothing to report.
    ix.sweep(now, &NoRules);
    assert!(take(&rows).is_empty());
}

#[test]
fn cap_reports_its_victims_in_order_with_the_algorithm() {
    let mut ix = index_with(HOUR, 2);
    let rows = record(&mut ix);
    let rules = Rules::lfu("t");
    // 8-byte hashes go through the buffer, others through the blob table.
    ix.ingest(
        &at(upd_r("r", vec![legacy(b"12345678", 1)]), T0),
        T0,
        &rules,
    );
    ix.ingest(&at(upd_r("r", vec![legacy(b"b", 1)]), T0 + SEC), T0, &rules);
    assert!(take(&rows).is_empty(), "under the cap nothing is removed");
    let out = ix.ingest(
        &at(upd_r("r", vec![legacy(b"c", 1)]), T0 + 2 * SEC),
        T0 + 3 * SEC,
        &rules,
    );
    assert_eq!(out.cap_evicted.lfu, 1);
    let got = take(&rows);
    assert_eq!(got.len(), 1);
    let r = &got[0];
    assert_eq!((r.0, r.1), (RemovalReason::Cap, Eviction::Lfu));
    assert_eq!(r.7, b"12345678".to_vec(), "the oldest goes first");
    assert_eq!(r.8, T0 + 3 * SEC, "the ingest's now");
    assert_eq!(RemovalReason::Cap.label(), "cap");
}

#[test]
fn quota_reports_every_holder_of_each_evicted_key() {
    let mut ix = index();
    let rows = record(&mut ix);
    let rules = Rules::quota("t", 1);
    ix.ingest(&at(upd_r("r1", vec![legacy(b"a", 1)]), T0), T0, &rules);
    ix.ingest(&at(upd_r("r2", vec![legacy(b"a", 1)]), T0), T0, &rules);
    let out = ix.ingest(
        &at(upd_r("r1", vec![legacy(b"b", 1)]), T0 + SEC),
        T0 + SEC,
        &rules,
    );
    assert_eq!(out.quota_evicted_keys, 1);
    let mut got: Vec<(RemovalReason, String, Vec<u8>)> =
        take(&rows).into_iter().map(|r| (r.0, r.6, r.7)).collect();
    got.sort();
    assert_eq!(
        got,
        vec![
            (RemovalReason::Quota, "r1".to_string(), b"a".to_vec()),
            (RemovalReason::Quota, "r2".to_string(), b"a".to_vec()),
        ]
    );
    assert_eq!(RemovalReason::Quota.label(), "over_entries");
}

#[test]
fn producer_removals_and_a_removed_sink_report_nothing() {
    let mut ix = index_with(HOUR, 0);
    let rows = record(&mut ix);
    ix.ingest(
        &upd_r("r", vec![legacy(b"a", 1), legacy(b"b", 1)]),
        T0,
        &NoRules,
    );
    ix.apply_event(
        &event(Type::PrefixEvicted, "t", "m", "r", b"a"),
        T0,
        &NoRules,
    );
    ix.apply_event(&event(Type::AllCleared, "t", "m", "r", b""), T0, &NoRules);
    assert_eq!(ix.entry_count(), 0);
    assert!(
        take(&rows).is_empty(),
        "the producer's call is published as is"
    );

    ix.ingest(&upd_r("r", vec![legacy(b"c", 1)]), T0, &NoRules);
    ix.set_removal_sink(None);
    assert_eq!(ix.sweep(T0 + 2 * HOUR, &NoRules).ttl_evicted.total(), 1);
    assert!(take(&rows).is_empty(), "no sink, no report");
}

/// A replica cutting blocks out of the middle of its stretch of a run, one in two, splits the
/// stretch until it has `runstore::MAX_REPLICA_EXTENTS` there; each cut after that removes the
/// rest of the stretch with it. Each entry removed so is counted out and reported
/// (`RunExtents`, as the index's own removal); another replica's holds of the same blocks stay,
/// and refreshes that would split further are refused and counted (`extents_refused`), changing
/// nothing.
#[test]
fn a_cut_past_the_extent_bound_removes_and_reports_the_stretch_rest() {
    const LEN: u64 = 400;
    let mut ix = index_with(HOUR, 0);
    let rows = record(&mut ix);
    let hashes: Vec<[u8; 8]> = (0..LEN)
        .map(|b| (b + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes())
        .collect();
    let blocks: Vec<&[u8]> = hashes.iter().map(|h| &h[..]).collect();
    for r in ["r1", "r2"] {
        ix.ingest(&upd_r(r, vec![chain_entry(&blocks, 16)]), T0, &NoRules);
    }
    assert_eq!(ix.entry_count(), 2 * LEN);
    // r2 refreshes every third block alone with another tier: split after split, then refused.
    let mut refused = 0;
    for b in (1..LEN as usize - 1).step_by(3) {
        let mut p = legacy(&hashes[b], 16 * (b as i32 + 1));
        p.tier = 2;
        refused += ix
            .ingest(&upd_r("r2", vec![p]), T0, &NoRules)
            .extents_refused;
    }
    assert!(refused > 0, "refreshes past the bound are refused");
    assert_eq!(ix.entry_count(), 2 * LEN);
    let mut cut = 0;
    for b in (1..LEN as usize - 1).step_by(2) {
        let e = event(Type::PrefixEvicted, "t", "m", "r1", &hashes[b]);
        cut += ix.apply_event(&e, T0, &NoRules).entries_removed;
    }
    let reported = take(&rows);
    assert!(
        !reported.is_empty(),
        "cuts past the bound drop the stretch's rest"
    );
    for row in &reported {
        assert_eq!((row.0, row.6.as_str()), (RemovalReason::RunExtents, "r1"));
    }
    assert_eq!(ix.entry_count(), 2 * LEN - cut - reported.len() as u64);
    assert_eq!(ix.key_count(), LEN, "r2 still holds every block");
    assert!(ix.take_extent_tails_dropped() > 0);
    assert_eq!(ix.take_extent_tails_dropped(), 0, "taken");
    ix.check_store();
}
