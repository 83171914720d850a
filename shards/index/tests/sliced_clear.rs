//! `ALL_CLEARED` in slices (`Index::set_sliced_clears`, the `clear` module): the event leaves
//! the replica's holders to `Index::clear_step` slices, each bounded by its budget, and every
//! answer given while they are pending (chain and exact lookups, miss classes, entry counts,
//! the entry set) is the one an index that cleared at once gives; whatever needs the store
//! after the clear finishes it first.

mod index_support;

use index_support::*;
use inferencecache_index::index::{Index, Strategy, SweepBudget};
use inferencecache_index::rules::TenantRules;
use inferencecache_proto::v1alpha1::cache_event::Type;
use inferencecache_proto::v1alpha1::{CacheStateUpdate, PrefixEntry};

/// Keys (chains of three blocks) the cleared replica holds.
const CHAINS: u32 = 3_000;

fn block(chain: u32, b: u32) -> Vec<u8> {
    (u64::from(chain) << 8 | u64::from(b))
        .to_be_bytes()
        .to_vec()
}

fn chain_of(chain: u32, blocks: u32) -> Chain {
    let hashes: Vec<Vec<u8>> = (0..blocks).map(|b| block(chain, b)).collect();
    let refs: Vec<&[u8]> = hashes.iter().map(|h| h.as_slice()).collect();
    index_support::chain(&refs, 16)
}

fn chain_update(
    model: &str,
    replica: &str,
    chains: impl Iterator<Item = u32>,
    blocks: u32,
) -> CacheStateUpdate {
    let prefixes: Vec<PrefixEntry> = chains
        .map(|c| {
            let hashes: Vec<Vec<u8>> = (0..blocks).map(|b| block(c, b)).collect();
            let refs: Vec<&[u8]> = hashes.iter().map(|h| h.as_slice()).collect();
            chain_entry(&refs, 16)
        })
        .collect();
    upd("t", model, "vllm", replica, prefixes)
}

/// Two indexes fed alike: `sliced` with sliced clears, `whole` clearing in the event.
fn pair() -> (Index, Index) {
    let mut sliced = index_with(HOUR, 0);
    sliced.set_sliced_clears(true);
    (sliced, index_with(HOUR, 0))
}

fn both(pair: &mut (Index, Index), f: impl Fn(&mut Index)) {
    f(&mut pair.0);
    f(&mut pair.1);
}

/// `rc` holds every chain (three blocks); `r1` the first two blocks of every other chain, `r2`
/// the first block of every third, so keys held by `rc` alone, shared, and runs of equal
/// holders all occur.
fn fill(ix: &mut Index) {
    let rules = NoRules;
    ix.ingest(&chain_update("m", "rc", 0..CHAINS, 3), T0, &rules);
    ix.ingest(
        &chain_update("m", "r1", (0..CHAINS).step_by(2), 2),
        T0,
        &rules,
    );
    ix.ingest(
        &chain_update("m", "r2", (0..CHAINS).step_by(3), 1),
        T0,
        &rules,
    );
}

struct NoRules;

impl TenantRules for NoRules {
    fn ttl_ns(&self, _: &str) -> i64 {
        0
    }
    fn eviction(&self, _: &str) -> inferencecache_index::rules::Eviction {
        inferencecache_index::rules::Eviction::Lru
    }
    fn quota(&self, _: &str) -> Option<u64> {
        None
    }
}

/// Everything a client can see of `(t, model)` without needing the store after the clear.
fn answers(ix: &mut Index, model: &str) -> Vec<String> {
    let mut out = Vec::new();
    for c in (0..CHAINS).step_by(7) {
        for blocks in 1..=3 {
            let ch = chain_of(c, blocks);
            let mut q = ch.q();
            q.model = model;
            out.push(format!("{c}/{blocks} {:?}", route(ix, &q, T0, &NoRules)));
        }
        let hash = block(c, 0);
        let mut q = q_exact(&hash);
        q.model = model;
        out.push(format!("{c} exact {:?}", route(ix, &q, T0, &NoRules)));
    }
    out.push(format!(
        "entries {} non-reserved {} directory {} has model {}",
        ix.entry_count(),
        ix.non_reserved_entry_count(),
        ix.directory().total_entries(),
        ix.has_tenant_model("t", model)
    ));
    out
}

fn slice(max_entries: usize) -> SweepBudget {
    SweepBudget {
        max_entries,
        deadline: None,
    }
}

#[test]
fn an_all_cleared_leaves_its_removals_to_bounded_slices_and_lookups_answer_as_after_them() {
    let mut p = pair();
    both(&mut p, fill);
    let clear = event(Type::AllCleared, "t", "m", "rc", b"");
    let removed = (
        p.0.apply_event(&clear, T0, &NoRules),
        p.1.apply_event(&clear, T0, &NoRules),
    );
    assert_eq!(removed.0.entries_removed, removed.1.entries_removed);
    assert_eq!(removed.0.entries_removed, u64::from(3 * CHAINS));
    assert!(p.0.clear_pending(), "the event left its removals to slices");
    assert!(!p.1.clear_pending());
    let want = answers(&mut p.1, "m");
    assert_eq!(answers(&mut p.0, "m"), want);
    assert_eq!(p.0.dump_entries(), p.1.dump_entries());
    let mut slices = 0;
    while !p.0.clear_step(slice(100)) {
        slices += 1;
        if slices % 16 == 0 {
            assert_eq!(answers(&mut p.0, "m"), want, "after {slices} slices");
        }
    }
    // 3 × 3,000 keys visited, 100 per slice.
    assert!(slices >= 89, "{slices} slices");
    assert!(!p.0.clear_pending());
    assert_eq!(answers(&mut p.0, "m"), want);
    assert_eq!(p.0.dump_entries(), p.1.dump_entries());
    assert_eq!(p.0.key_count(), p.1.key_count());
    assert_eq!(p.0.cache_state("t", "m"), p.1.cache_state("t", "m"));
    assert_eq!(p.0.snapshot(), p.1.snapshot());
    assert_eq!(p.0.take_clear_sync_finishes(), 0);
}

#[test]
fn a_clear_that_empties_its_model_classifies_misses_as_after_it() {
    let mut p = pair();
    both(&mut p, |ix| {
        ix.ingest(&chain_update("m2", "rc", 0..CHAINS, 3), T0, &NoRules);
    });
    let clear = event(Type::AllCleared, "t", "m2", "rc", b"");
    both(&mut p, |ix| {
        ix.apply_event(&clear, T0, &NoRules);
    });
    assert!(p.0.clear_pending());
    let want = answers(&mut p.1, "m2");
    assert!(
        want.iter()
            .any(|a| a.contains(&format!("{:?}", Strategy::None)))
    );
    assert_eq!(answers(&mut p.0, "m2"), want);
    assert!(!p.0.has_tenant("t"));
    // Another model of the tenant keeps it known.
    both(&mut p, |ix| {
        ix.finish_clear();
        ix.ingest(&chain_update("m", "r1", 0..10, 1), T0, &NoRules);
        ix.ingest(&chain_update("m2", "rc", 0..CHAINS, 3), T0, &NoRules);
        ix.apply_event(&clear, T0, &NoRules);
    });
    assert!(p.0.clear_pending());
    assert_eq!(answers(&mut p.0, "m2"), answers(&mut p.1, "m2"));
    assert!(p.0.has_tenant("t"));
}

#[test]
fn an_ingest_after_a_pending_clear_is_exact_and_finishes_it_first() {
    let mut p = pair();
    both(&mut p, fill);
    let clear = event(Type::AllCleared, "t", "m", "rc", b"");
    both(&mut p, |ix| {
        ix.apply_event(&clear, T0, &NoRules);
    });
    p.0.clear_step(slice(500));
    assert!(p.0.clear_pending());
    // The replica reports again: some of its old keys, some new.
    let again = chain_update("m", "rc", CHAINS - 100..CHAINS + 100, 2);
    both(&mut p, |ix| {
        ix.ingest(&at(again.clone(), T0 + SEC), T0 + SEC, &NoRules);
    });
    assert!(!p.0.clear_pending());
    assert_eq!(p.0.take_clear_sync_finishes(), 1);
    assert_eq!(p.0.dump_entries(), p.1.dump_entries());
    assert_eq!(answers(&mut p.0, "m"), answers(&mut p.1, "m"));
    assert_eq!(p.0.cache_state("t", "m"), p.1.cache_state("t", "m"));
    // A second clear while one is pending finishes the first.
    both(&mut p, |ix| {
        ix.apply_event(&clear, T0 + SEC, &NoRules);
    });
    let clear_r1 = event(Type::AllCleared, "t", "m", "r1", b"");
    both(&mut p, |ix| {
        ix.apply_event(&clear_r1, T0 + SEC, &NoRules);
    });
    assert_eq!(p.0.take_clear_sync_finishes(), 1);
    assert_eq!(answers(&mut p.0, "m"), answers(&mut p.1, "m"));
    p.0.finish_clear();
    assert_eq!(p.0.dump_entries(), p.1.dump_entries());
}
