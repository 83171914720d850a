//! The run-record store (`runstore`) against a model of per-entry records: random chains stored
//! (shared prefixes, branches, continuations, refreshes with other times, tiers and token
//! counts) and released (leaves first, roots first, from the middle), in two keyspaces by a
//! few replicas. After every operation each key of the universe must be found exactly when
//! the model holds it, with exactly the model's entries, the counts must agree, and a walk
//! along every chain must give each replica the leading stretch it holds, with the oldest
//! `last_seen` and the worst tier over it. LFU counts are set on random entries and must stay
//! with their entry through refreshes and go with it; releases go by key or by place; a scan
//! in small slices must visit every held key once.

use inferencecache_index::runstore::{
    Entry, Hint, Loc, Matched, Refused, RunStore, Scan, Upserted, WalkScratch,
};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};

/// Chains of the universe: chain `c` shares its first `SHARED[c]` blocks with chain 0.
const CHAINS: usize = 5;
const CHAIN_LEN: usize = 10;
const SHARED: [usize; CHAINS] = [CHAIN_LEN, 3, 3, 6, 0];
const REPLICAS: u32 = 4;
const KEYSPACES: u32 = 2;

/// The hash of block `b` of chain `c`: chains sharing a prefix share its blocks' hashes.
fn hash(c: usize, b: usize) -> u64 {
    let owner = if b < SHARED[c] { 0 } else { c };
    // A fixed mixing of (owner, b): distinct, and far from small integers.
    ((owner as u64) << 32 | b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5555
}

/// The cumulative token count a store reports for block `b`: 16 per block, shifted by 0 or
/// 1, or (`shift` 2) irregular, as blocks of several sizes give.
fn block_tokens(b: usize, shift: i32) -> i32 {
    let irregular = if shift == 2 {
        (b * b % 7) as i32
    } else {
        shift
    };
    (b as i32 + 1) * 16 + irregular
}

#[derive(Clone, Debug)]
enum Op {
    /// Blocks `from..to` of chain `c` upserted in order by `replica`.
    Store {
        ks: u32,
        c: usize,
        from: usize,
        to: usize,
        replica: u32,
        tier: u8,
        ts: i64,
        tokens_shift: i32,
    },
    /// Blocks `from..to` of chain `c` released by `replica`, leaves first or roots first,
    /// by key or by place.
    Release {
        ks: u32,
        c: usize,
        from: usize,
        to: usize,
        replica: u32,
        leaves_first: bool,
        by_place: bool,
    },
    /// The LFU count of `replica`'s entry of block `b` of chain `c` set to `count`.
    Count {
        ks: u32,
        c: usize,
        b: usize,
        replica: u32,
        count: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let range = (0..CHAIN_LEN, 0..=CHAIN_LEN).prop_map(|(a, b)| (a.min(b), a.max(b)));
    prop_oneof![
        3 => (0..KEYSPACES, 0..CHAINS, range.clone(), 0..REPLICAS, 0u8..4, 1i64..4, 0i32..3)
            .prop_map(|(ks, c, (from, to), replica, tier, ts, tokens_shift)| Op::Store {
                ks, c, from, to, replica, tier, ts, tokens_shift
            }),
        2 => (0..KEYSPACES, 0..CHAINS, range, 0..REPLICAS, any::<bool>(), any::<bool>())
            .prop_map(|(ks, c, (from, to), replica, leaves_first, by_place)| Op::Release {
                ks, c, from, to, replica, leaves_first, by_place
            }),
        1 => (0..KEYSPACES, 0..CHAINS, 0..CHAIN_LEN, 0..REPLICAS, 0u32..3)
            .prop_map(|(ks, c, b, replica, count)| Op::Count { ks, c, b, replica, count }),
    ]
}

/// Per key, per replica: the entry and its LFU count.
type Model = HashMap<(u32, u64), BTreeMap<u32, (Entry, u32)>>;

fn apply(store: &mut RunStore, model: &mut Model, op: &Op) {
    match *op {
        Op::Store {
            ks,
            c,
            from,
            to,
            replica,
            tier,
            ts,
            tokens_shift,
        } => {
            let mut after: Option<Loc> =
                from.checked_sub(1).and_then(|b| store.find(ks, hash(c, b)));
            let mut hint = Hint::default();
            for b in from..to {
                let h = hash(c, b);
                let e = Entry {
                    replica,
                    tier,
                    last_seen: ts,
                    tokens: block_tokens(b, tokens_shift),
                };
                let (loc, _) = store.upsert(ks, h, after, e, &mut hint).expect("room");
                after = Some(loc);
                let held = model.entry((ks, h)).or_default().entry(replica);
                held.and_modify(|(old, _)| *old = e).or_insert((e, 0));
            }
        }
        Op::Release {
            ks,
            c,
            from,
            to,
            replica,
            leaves_first,
            by_place,
        } => {
            let blocks: Vec<usize> = if leaves_first {
                (from..to).rev().collect()
            } else {
                (from..to).collect()
            };
            for b in blocks {
                let h = hash(c, b);
                let got = if by_place {
                    store
                        .find(ks, h)
                        .and_then(|loc| store.release_at(loc, replica))
                        .map(|r| r.entry)
                } else {
                    store.release(ks, h, replica)
                };
                let want = (model.get_mut(&(ks, h)))
                    .and_then(|m| m.remove(&replica))
                    .map(|(e, _)| e);
                assert_eq!(got, want, "release of block {b} of chain {c} by {replica}");
                if model.get(&(ks, h)).is_some_and(BTreeMap::is_empty) {
                    model.remove(&(ks, h));
                }
            }
        }
        Op::Count {
            ks,
            c,
            b,
            replica,
            count,
        } => {
            let h = hash(c, b);
            let held = model.get_mut(&(ks, h)).and_then(|m| m.get_mut(&replica));
            let set = store
                .find(ks, h)
                .is_some_and(|loc| store.set_access(loc, replica, count));
            assert_eq!(set, held.is_some(), "count of block {b} of chain {c}");
            if let Some((_, n)) = held {
                *n = count;
            }
        }
    }
}

fn check(store: &RunStore, model: &Model, scratch: &mut WalkScratch) {
    let mut entries = 0;
    for ks in 0..KEYSPACES {
        for c in 0..CHAINS {
            for b in 0..CHAIN_LEN {
                let h = hash(c, b);
                let want = model.get(&(ks, h));
                match (store.find(ks, h), want) {
                    (None, None) => {}
                    (Some(loc), Some(want)) => {
                        assert_eq!(store.key_at(loc), (ks, h));
                        let mut got: Vec<(Entry, u32)> = (store.entries_at(loc))
                            .map(|e| (e, store.access(loc, e.replica)))
                            .collect();
                        got.sort_by_key(|(e, _)| e.replica);
                        let want: Vec<(Entry, u32)> = want.values().copied().collect();
                        assert_eq!(
                            got, want,
                            "entries of block {b} of chain {c}, keyspace {ks}"
                        );
                    }
                    (got, want) => panic!("block {b} of chain {c}: found {got:?}, model {want:?}"),
                }
            }
            // The walk along the whole chain against each replica's leading stretch.
            // Every other word, as a request's hashes may lie (here between filler words).
            let words: Vec<u64> = (0..CHAIN_LEN)
                .flat_map(|i| [hash(c, i), u64::MAX])
                .collect();
            store.walk(ks, &words, 0, 2, |a, b| a.max(b), scratch);
            let mut got = scratch.matched.clone();
            got.sort_by_key(|m| m.replica);
            let mut want = Vec::new();
            for replica in 0..REPLICAS {
                let held: Vec<Entry> = (0..CHAIN_LEN)
                    .map_while(|b| Some(model.get(&(ks, hash(c, b)))?.get(&replica)?.0))
                    .collect();
                if let Some(first) = held.first() {
                    want.push(Matched {
                        replica,
                        blocks: held.len() as u32,
                        oldest: held.iter().map(|e| e.last_seen).min().unwrap(),
                        tier: held.iter().map(|e| e.tier).max().unwrap_or(first.tier),
                    });
                }
            }
            assert_eq!(got, want, "walk of chain {c} in keyspace {ks}");
        }
    }
    for held in model.values() {
        entries += held.len();
    }
    // Each run's extents are sorted by (replica, first offset), a replica's disjoint.
    for id in 0..store.run_slots() {
        for pair in store.run(id).extents().windows(2) {
            let (a, b) = (pair[0], pair[1]);
            assert!(
                (a.replica, a.lo) < (b.replica, b.lo),
                "extents out of order: {pair:?}"
            );
            assert!(
                a.replica != b.replica || a.hi <= b.lo,
                "overlapping extents: {pair:?}"
            );
        }
    }
    assert_eq!(store.key_count(), model.len(), "keys");
    assert_eq!(store.entry_count(), entries, "entries");
    let counted = model
        .values()
        .flat_map(|m| m.values())
        .filter(|(_, n)| *n > 0);
    assert_eq!(store.counted_entries(), counted.count(), "LFU counts");
    // A scan in slices of 3 places visits every held key once.
    let mut seen = Vec::new();
    let mut at = Loc { run: 0, off: 0 };
    loop {
        match store.scan(at, 3) {
            Scan::Held(loc) => {
                seen.push(store.key_at(loc));
                at = RunStore::after(loc);
            }
            Scan::Paused(loc) => at = loc,
            Scan::End => break,
        }
    }
    seen.sort_unstable();
    let mut want: Vec<(u32, u64)> = model.keys().copied().collect();
    want.sort_unstable();
    assert_eq!(seen, want, "the keys a scan visits");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn the_run_store_holds_what_per_entry_records_hold(ops in prop::collection::vec(op(), 1..60)) {
        let mut store = RunStore::new();
        let mut model = Model::new();
        let mut scratch = WalkScratch::default();
        for op in &ops {
            apply(&mut store, &mut model, op);
            store.check();
            check(&store, &model, &mut scratch);
        }
        // Everything released: nothing is left, and every run went back to the free list.
        for ((ks, h), held) in model.clone() {
            for replica in held.keys() {
                prop_assert!(store.release(ks, h, *replica).is_some());
            }
        }
        prop_assert_eq!(store.key_count(), 0);
        prop_assert_eq!(store.entry_count(), 0);
    }
}

/// A chain stored in one go is one run, and a walk of it probes the table once: the whole
/// chain is the run's hashes from its first block.
#[test]
fn a_chain_stored_in_order_is_one_run() {
    let mut store = RunStore::new();
    let mut hint = Hint::default();
    let mut after = None;
    for b in 0..CHAIN_LEN {
        let e = Entry {
            replica: 1,
            tier: 1,
            last_seen: 5,
            tokens: 16 * (b as i32 + 1),
        };
        after = Some(store.upsert(0, hash(0, b), after, e, &mut hint).unwrap().0);
    }
    let first = store.find(0, hash(0, 0)).unwrap();
    assert_eq!(store.along(first).len(), CHAIN_LEN);
    assert_eq!(
        store.run(first.run).extents().len(),
        1,
        "one extent for the chain"
    );
    // A continuation by another replica stored later grows no hole and joins the run.
    let loc = store.find(0, hash(0, 4)).unwrap();
    assert_eq!(loc.run, first.run);
}

/// A block released from the middle of a run bounds the walk there; stored again after its
/// predecessor, it goes back into its place.
#[test]
fn a_hole_bounds_the_walk_and_is_filled_again() {
    let mut store = RunStore::new();
    let mut hint = Hint::default();
    let mut after = None;
    let e = |b: usize| Entry {
        replica: 2,
        tier: 1,
        last_seen: 7,
        tokens: 16 * (b as i32 + 1),
    };
    for b in 0..6 {
        after = Some(
            store
                .upsert(0, hash(0, b), after, e(b), &mut hint)
                .unwrap()
                .0,
        );
    }
    let first = store.find(0, hash(0, 0)).unwrap();
    assert_eq!(store.release(0, hash(0, 3), 2), Some(e(3)));
    assert_eq!(store.along(first).len(), 3, "the walk stops at the hole");
    assert!(store.find(0, hash(0, 3)).is_none());
    let before = store.find(0, hash(0, 2));
    let (loc, _) = (store.upsert(0, hash(0, 3), before, e(3), &mut Hint::default())).unwrap();
    assert_eq!(
        loc,
        Loc {
            run: first.run,
            off: 3
        }
    );
    assert_eq!(store.along(first).len(), 6);
}

/// A full table segment refuses a new key and changes nothing; keys already held are still
/// refreshed, and a release makes room again.
#[test]
fn a_full_table_refuses_new_keys_and_counts_them() {
    let mut store = RunStore::with_segment_keys(1);
    let e = Entry {
        replica: 0,
        tier: 0,
        last_seen: 1,
        tokens: 16,
    };
    let mut held = Vec::new();
    let attempts = 20_000u64;
    for k in 0..attempts {
        let h = hash(4, 0) ^ k.wrapping_mul(0x2545_f491_4f6c_dd1d);
        match store.upsert(0, h, None, e, &mut Hint::default()) {
            Ok((_, Upserted::CreatedKey)) => held.push(h),
            Ok(other) => panic!("a new key was {other:?}"),
            Err(Refused::TableFull) => {
                assert!(store.find(0, h).is_none(), "a refused key is absent")
            }
            Err(other) => panic!("refused: {other:?}"),
        }
    }
    assert!(held.len() <= inferencecache_index::runstore::SEGMENTS);
    assert_eq!(store.key_count(), held.len());
    assert_eq!(store.entry_count(), held.len());
    assert_eq!(store.refusals(), attempts - held.len() as u64);
    // A held key is refreshed whatever the table's load.
    let newer = Entry { last_seen: 2, ..e };
    let refreshed = store.upsert(0, held[0], None, newer, &mut Hint::default());
    assert_eq!(refreshed.map(|(_, u)| u), Ok(Upserted::Refreshed));
    // Releasing every key empties the store and makes room again.
    for &h in &held {
        assert!(store.release(0, h, 0).is_some());
    }
    assert_eq!(store.key_count(), 0);
    let again = store.upsert(0, held[0], None, e, &mut Hint::default());
    assert_eq!(again.map(|(_, u)| u), Ok(Upserted::CreatedKey));
}

/// Keys that follow no run's last block (a prefix-only report's, a branch's first) share
/// their keyspace's open run instead of each taking a run: 1,000 such keys of one replica and
/// time fill runs of 16, and with a time each (an extent each) runs of 8. Another keyspace's
/// keys never join them, and every key is still found and walked alone.
#[test]
fn keys_of_no_chain_share_short_runs() {
    let key = |k: usize| (k as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let entry = |t: i64| Entry {
        replica: 3,
        tier: 1,
        last_seen: t,
        tokens: 16,
    };
    for (distinct_times, per_run) in [(false, 16), (true, 8)] {
        let mut store = RunStore::new();
        for k in 0..1_000usize {
            let t = if distinct_times { k as i64 } else { 9 };
            for ks in [0, 1] {
                let mut hint = Hint::default();
                store.upsert(ks, key(k), None, entry(t), &mut hint).unwrap();
            }
        }
        store.check();
        assert_eq!(store.live_runs(), 2 * 1_000usize.div_ceil(per_run));
        for k in 0..1_000usize {
            for ks in [0, 1] {
                let loc = store.find(ks, key(k)).expect("held");
                assert_eq!(store.run(loc.run).keyspace(), ks);
                assert_eq!(store.key_at(loc), (ks, key(k)));
            }
        }
        // A walk matches what the replica holds, wherever the keys lie: a key found apart
        // from the one before, and an unheld one ending the match.
        let mut scratch = WalkScratch::default();
        let words = [key(5), key(900), key(5_000)];
        store.walk(0, &words, 0, 1, |a, b| a.max(b), &mut scratch);
        assert_eq!(scratch.matched.len(), 1);
        assert_eq!(scratch.matched[0].blocks, 2);
    }
}

/// Blocks of irregular sizes (cumulative counts off any one step) do not split a replica's
/// stretch: a 300-block chain is one extent, and every entry reads back its own count, after
/// refreshes of single counts and a release from the middle too.
#[test]
fn irregular_counts_keep_one_extent() {
    let mut store = RunStore::new();
    let (mut hint, mut after) = (Hint::default(), None);
    let h = |b: usize| (b as u64 + 7).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut tokens: Vec<i32> = (0..300).map(|b| block_tokens(b, 2)).collect();
    for (b, &t) in tokens.iter().enumerate() {
        let e = Entry {
            replica: 1,
            tier: 0,
            last_seen: 5,
            tokens: t,
        };
        after = Some(store.upsert(0, h(b), after, e, &mut hint).unwrap().0);
    }
    let first = store.find(0, h(0)).unwrap();
    assert_eq!(store.run(first.run).extents().len(), 1);
    // One count changed alone (same tier and time): still one extent.
    tokens[40] += 3;
    let e = Entry {
        replica: 1,
        tier: 0,
        last_seen: 5,
        tokens: tokens[40],
    };
    store
        .upsert(0, h(40), None, e, &mut Hint::default())
        .unwrap();
    assert_eq!(store.run(first.run).extents().len(), 1);
    assert_eq!(
        store.release(0, h(150), 1).map(|e| e.tokens),
        Some(tokens[150])
    );
    store.check();
    for (b, &t) in tokens.iter().enumerate().filter(|&(b, _)| b != 150) {
        let loc = store.find(0, h(b)).unwrap();
        let got: Vec<i32> = store.entries_at(loc).map(|e| e.tokens).collect();
        assert_eq!(got, [t], "block {b}");
    }
}

/// A replica has at most `MAX_REPLICA_EXTENTS` extents in a run, whatever it does, so no step
/// on a run moves more than a bounded number of extents. Two replicas hold a 600-block chain;
/// the first refreshes single blocks with another tier (each split: +2 extents) until refused,
/// and cuts blocks out of the middle one in two: past the bound each cut takes the rest of its
/// stretch out with it (handed to the caller, the other replica's holds untouched); a new key
/// of the first replica continuing the run goes to another run. Without the bound the cuts
/// leave 300 extents.
#[test]
fn a_replica_fragmenting_a_run_keeps_its_extents_bounded() {
    use inferencecache_index::runstore::{MAX_REPLICA_EXTENTS, RUN_LEN_LIMIT};
    const LEN: usize = 600;
    let h = |b: usize| (b as u64 + 11).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let entry = |replica: u32, tier: u8, b: usize| Entry {
        replica,
        tier,
        last_seen: 5,
        tokens: 16 * (b as i32 + 1),
    };
    let mut store = RunStore::new();
    for replica in [1, 2] {
        let (mut hint, mut after) = (Hint::default(), None);
        for b in 0..LEN {
            let e = entry(replica, 0, b);
            after = Some(store.upsert(0, h(b), after, e, &mut hint).unwrap().0);
        }
    }
    let run = store.find(0, h(0)).unwrap().run;
    let extents_of = |s: &RunStore, r: u32| {
        (s.run(run).extents().iter())
            .filter(|x| x.replica == r)
            .count()
    };
    let mut refused = 0;
    for b in (1..LEN - 1).step_by(3) {
        match store.upsert(0, h(b), None, entry(1, 2, b), &mut Hint::default()) {
            Ok(_) => {}
            Err(Refused::ExtentsFull) => refused += 1,
            Err(other) => panic!("{other:?}"),
        }
        assert!(extents_of(&store, 1) <= MAX_REPLICA_EXTENTS);
    }
    assert!(refused > 0, "refreshes past the bound are refused");
    store.check();
    // Cuts from the middle, every other block.
    let mut dropped = 0;
    for b in (1..LEN - 1).step_by(2) {
        if let Some(loc) = store.find(0, h(b))
            && store.entries_at(loc).any(|e| e.replica == 1)
        {
            assert!(store.release(0, h(b), 1).is_some());
        }
        for d in store.take_dropped() {
            assert_eq!(d.released.entry.replica, 1);
            assert!(!d.released.key_gone, "replica 2 still holds block");
            dropped += 1;
        }
        assert!(extents_of(&store, 1) <= MAX_REPLICA_EXTENTS);
        store.check();
    }
    assert!(dropped > 0, "cuts past the bound drop the stretch's rest");
    assert_eq!(
        extents_of(&store, 2),
        1,
        "the other replica keeps its stretch"
    );
    for b in 0..LEN {
        let loc = store.find(0, h(b)).expect("replica 2 holds every block");
        assert!(store.entries_at(loc).any(|e| e.replica == 2));
    }
    assert!(LEN < RUN_LEN_LIMIT as usize);
    // A chain whose every block has another tier than the one before: one extent per block,
    // so its block past the bound starts another run instead of splitting this one further.
    let mut store = RunStore::new();
    let (mut hint, mut after) = (Hint::default(), None);
    for b in 0..MAX_REPLICA_EXTENTS + 5 {
        let e = entry(1, (b % 2) as u8, b);
        after = Some(store.upsert(0, h(b), after, e, &mut hint).unwrap().0);
    }
    store.check();
    let first = store.find(0, h(0)).unwrap().run;
    assert_eq!(store.run(first).extents().len(), MAX_REPLICA_EXTENTS);
    assert_ne!(store.find(0, h(MAX_REPLICA_EXTENTS)).unwrap().run, first);
    // At the bound a block that continues the replica's last stretch still joins the run: a
    // chain of exactly that many stretches of 4 blocks is one run.
    let mut store = RunStore::new();
    let (mut hint, mut after) = (Hint::default(), None);
    for b in 0..4 * MAX_REPLICA_EXTENTS {
        let e = entry(1, (b / 4 % 2) as u8, b);
        after = Some(store.upsert(0, h(b), after, e, &mut hint).unwrap().0);
    }
    let first = store.find(0, h(0)).unwrap();
    assert_eq!(store.along(first).len(), 4 * MAX_REPLICA_EXTENTS);
}

/// A chain longer than `RUN_LEN_LIMIT` continues in another run.
#[test]
fn runs_end_at_their_length_limit() {
    use inferencecache_index::runstore::RUN_LEN_LIMIT;
    let n = RUN_LEN_LIMIT as usize + 10;
    let h = |b: usize| (b as u64 + 3).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut store = RunStore::new();
    let (mut hint, mut after) = (Hint::default(), None);
    for b in 0..n {
        let e = Entry {
            replica: 1,
            tier: 0,
            last_seen: 5,
            tokens: 16 * (b as i32 + 1),
        };
        after = Some(store.upsert(0, h(b), after, e, &mut hint).unwrap().0);
    }
    store.check();
    let first = store.find(0, h(0)).unwrap();
    assert_eq!(store.along(first).len(), RUN_LEN_LIMIT as usize);
    assert_ne!(store.find(0, h(n - 1)).unwrap().run, first.run);
}

/// A refresh refused at the bound changes nothing, an odd count included: a replica holding a
/// chain of blocks of several sizes in `MAX_REPLICA_EXTENTS` stretches keeps each block's own
/// count after a refused refresh of it.
#[test]
fn a_refused_refresh_keeps_the_entry_as_it_was() {
    use inferencecache_index::runstore::MAX_REPLICA_EXTENTS;
    let h = |b: usize| (b as u64 + 5).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let entry = |b: usize, tier: u8| Entry {
        replica: 1,
        tier,
        last_seen: 5,
        tokens: block_tokens(b, 2),
    };
    let mut store = RunStore::new();
    let (mut hint, mut after) = (Hint::default(), None);
    for b in 0..4 * MAX_REPLICA_EXTENTS {
        let e = entry(b, (b / 4 % 2) as u8);
        after = Some(store.upsert(0, h(b), after, e, &mut hint).unwrap().0);
    }
    let loc = store.find(0, h(2)).unwrap();
    let before: Vec<Entry> = store.entries_at(loc).collect();
    assert_eq!(before[0].tokens, block_tokens(2, 2));
    let refused = store.upsert(0, h(2), None, entry(2, 3), &mut Hint::default());
    assert_eq!(refused.err(), Some(Refused::ExtentsFull));
    assert_eq!(store.entries_at(loc).collect::<Vec<_>>(), before);
    store.check();
}
