//! `PREFIX_EVICTED` reuses the last event's resolution of its names (the event memo) only while
//! it is exact: the next event must name the same tenant, model, replica and adapter, and no
//! record, name or keyspace list it summarises may have changed. Each test below removes the
//! wrong entry, or leaves one that must go, if the memo were reused when it must not be.

mod index_support;

use index_support::{Rules, T0, event, legacy, legacy_adapter, upd};
use inferencecache_index::index::{EntryDump, Index};
use inferencecache_proto::v1alpha1::{CacheEvent, cache_event::Type};

fn evicted(tenant: &str, model: &str, replica: &str, adapter: &str, hash: &[u8]) -> CacheEvent {
    let mut e = event(Type::PrefixEvicted, tenant, model, replica, hash);
    e.adapter_id = adapter.into();
    e
}

/// `(tenant, model, adapter, hash, replica)` of every entry.
fn held(ix: &Index) -> Vec<(String, String, String, Vec<u8>, String)> {
    ix.dump_entries()
        .into_iter()
        .map(|d: EntryDump| (d.tenant, d.model, d.adapter, d.hash, d.replica))
        .collect()
}

fn entry(
    t: &str,
    m: &str,
    a: &str,
    h: &[u8],
    r: &str,
) -> (String, String, String, Vec<u8>, String) {
    (t.into(), m.into(), a.into(), h.to_vec(), r.into())
}

/// The memo's model scope and keyspace were freed by the reclaim pass and their ids reused by
/// another tenant, while the names it compares stayed interned: the same names now resolve to
/// new records, and the eviction must not reach the other tenant's key.
#[test]
fn reclaimed_and_reused_records_are_not_reached_through_the_memo() {
    let rules = Rules::default();
    let mut ix = Index::default();
    // Keep the names t1, m1 and r1 interned across the reclaim pass.
    ix.ingest(
        &upd("t1", "m0", "vllm", "r1", vec![legacy(b"X", 16)]),
        T0,
        &rules,
    );
    ix.ingest(
        &upd("t0", "m1", "vllm", "r1", vec![legacy(b"X", 16)]),
        T0,
        &rules,
    );
    ix.ingest(
        &upd("t1", "m1", "vllm", "r1", vec![legacy(b"A", 16)]),
        T0,
        &rules,
    );
    let out = ix.apply_event(&evicted("t1", "m1", "r1", "", b"A"), T0, &rules);
    assert_eq!(out.entries_removed, 1);
    // (t1, m1) holds nothing: its keyspace, scope and model scope are freed...
    ix.reclaim();
    // ...and reused by (t9, m9), which then holds A for r1 under the ids the memo names.
    ix.ingest(
        &upd("t9", "m9", "vllm", "r1", vec![legacy(b"A", 16)]),
        T0,
        &rules,
    );
    ix.ingest(
        &upd("t1", "m1", "vllm", "r1", vec![legacy(b"A", 16)]),
        T0,
        &rules,
    );
    let out = ix.apply_event(&evicted("t1", "m1", "r1", "", b"A"), T0, &rules);
    assert_eq!(out.entries_removed, 1);
    assert_eq!(
        held(&ix),
        vec![
            entry("t0", "m1", "", b"X", "r1"),
            entry("t1", "m0", "", b"X", "r1"),
            entry("t9", "m9", "", b"A", "r1"),
        ]
    );
}

/// A keyspace created after the memo was filled: an event without an adapter removes its hash
/// from every keyspace of the model scope, the new one included.
#[test]
fn a_keyspace_created_after_the_memo_is_evicted_from() {
    let rules = Rules::default();
    let mut ix = Index::default();
    let prefixes = vec![legacy(b"A", 16), legacy(b"B", 16)];
    ix.ingest(&upd("t", "m", "vllm", "r1", prefixes), T0, &rules);
    let out = ix.apply_event(&evicted("t", "m", "r1", "", b"B"), T0, &rules);
    assert_eq!(out.entries_removed, 1);
    let lora = vec![legacy_adapter(b"A", 16, "lora")];
    ix.ingest(&upd("t", "m", "vllm", "r1", lora), T0, &rules);
    // A scope of another scheme, too.
    ix.ingest(
        &upd("t", "m", "sglang", "r1", vec![legacy(b"A", 16)]),
        T0,
        &rules,
    );
    let out = ix.apply_event(&evicted("t", "m", "r1", "", b"A"), T0, &rules);
    assert_eq!(out.entries_removed, 3);
    assert_eq!(held(&ix), vec![]);
}

/// Consecutive events that differ from the memo's in one name only are resolved afresh.
#[test]
fn an_event_naming_another_replica_adapter_model_or_tenant_is_resolved_afresh() {
    let rules = Rules::default();
    let mut ix = Index::default();
    for (t, m, r) in [
        ("t", "m", "r1"),
        ("t", "m", "r2"),
        ("t", "m2", "r1"),
        ("t2", "m", "r1"),
    ] {
        let prefixes = vec![
            legacy(b"A", 16),
            legacy(b"B", 16),
            legacy_adapter(b"A", 16, "lora"),
        ];
        ix.ingest(&upd(t, m, "vllm", r, prefixes), T0, &rules);
    }
    let removed = |ix: &mut Index, t, m, r, a, h: &[u8]| {
        ix.apply_event(&evicted(t, m, r, a, h), T0, &rules)
            .entries_removed
    };
    // Fills the memo for (t, m, r1, lora), then changes one name at a time.
    assert_eq!(removed(&mut ix, "t", "m", "r1", "lora", b"A"), 1);
    assert_eq!(removed(&mut ix, "t", "m", "r1", "", b"B"), 1); // adapter
    assert_eq!(removed(&mut ix, "t", "m", "r2", "", b"B"), 1); // replica
    assert_eq!(removed(&mut ix, "t", "m2", "r1", "", b"B"), 1); // model
    assert_eq!(removed(&mut ix, "t2", "m", "r1", "", b"B"), 1); // tenant
    assert_eq!(removed(&mut ix, "t2", "m", "r1", "lora", b"A"), 1); // adapter again
    assert_eq!(removed(&mut ix, "t2", "m", "r1", "nope", b"A"), 0); // unknown adapter
    assert_eq!(removed(&mut ix, "t2", "m", "r1", "", b"A"), 1);
    assert_eq!(
        held(&ix),
        vec![
            entry("t", "m", "", b"A", "r1"),
            entry("t", "m", "", b"A", "r2"),
            entry("t", "m", "lora", b"A", "r2"),
            entry("t", "m2", "", b"A", "r1"),
            entry("t", "m2", "lora", b"A", "r1"),
        ]
    );
}

/// The memo keeps the slot of its replica's serving count (and of its tenant's record and its
/// model's gauge count) and checks it against the replica before each use: here the replica
/// stops serving (its slot is freed), another replica's count takes that slot, the first serves
/// again elsewhere, and its next eviction through the memo must count against its own count,
/// not the other replica's (whose last key would then find no serving count).
#[test]
fn a_memo_slot_taken_by_another_replica_is_not_counted_against() {
    let rules = Rules::default();
    let mut ix = Index::default();
    let store = |ix: &mut Index, r: &str, h: &[u8]| {
        ix.ingest(&upd("t", "m", "vllm", r, vec![legacy(h, 16)]), T0, &rules);
    };
    let removed = |ix: &mut Index, r, h: &[u8]| {
        ix.apply_event(&evicted("t", "m", r, "", h), T0, &rules)
            .entries_removed
    };
    store(&mut ix, "ra", b"k1");
    store(&mut ix, "ra", b"k2");
    assert_eq!(removed(&mut ix, "ra", b"k1"), 1);
    assert_eq!(removed(&mut ix, "ra", b"k2"), 1); // ra serves nothing: its slot is free
    store(&mut ix, "rb", b"k3"); // rb's count takes ra's slot
    store(&mut ix, "ra", b"k4"); // ra's count in another slot
    assert_eq!(removed(&mut ix, "ra", b"k4"), 1);
    assert_eq!(held(&ix), vec![entry("t", "m", "", b"k3", "rb")]);
    assert_eq!(removed(&mut ix, "rb", b"k3"), 1);
    assert_eq!(held(&ix), vec![]);
    ix.check_catalog();
}
