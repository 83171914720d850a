//! The chain walk follows a *stored run* (a chain's blocks kept together, each replica's
//! stretch of it one extent) without visiting each block's holders (issue 31). These tests
//! change one holder of one block in the middle of such a run (removed, expired, re-tiered,
//! its key stored again elsewhere) and check that the answer follows, block by block, as a
//! walk over every (block, holder) would; and that the store's invariants hold after every
//! change.

use inferencecache_index::index::{Index, IndexConfig, LookupQuery, Strategy};
use inferencecache_index::rules::NoRules;
use inferencecache_proto::v1alpha1::{CacheEvent, CacheStateUpdate, PrefixEntry, cache_event};

const T0: i64 = 1_700_000_000_000_000_000;
const SEC: i64 = 1_000_000_000;
const TTL: i64 = 60 * SEC;
const BLOCKS: usize = 40;
const MID: usize = 20;
const TOKENS: i32 = 16;

fn hash(chain: u64, b: usize) -> [u8; 8] {
    (chain << 32 | b as u64 | 1 << 63).to_be_bytes()
}

fn chain(c: u64) -> Vec<[u8; 8]> {
    (0..BLOCKS).map(|b| hash(c, b)).collect()
}

fn store(ix: &mut Index, replica: &str, blocks: &[[u8; 8]], tier: i32, now: i64) {
    let u = CacheStateUpdate {
        tenant_id: "t".into(),
        model_id: "m".into(),
        hash_scheme: "s".into(),
        replica_id: replica.into(),
        prefixes: vec![PrefixEntry {
            block_hashes: blocks.iter().map(|h| h.to_vec()).collect(),
            block_token_counts: vec![TOKENS; blocks.len()],
            tier,
            ..Default::default()
        }],
        ..Default::default()
    };
    ix.ingest(&u, now, &NoRules);
    ix.check_store();
}

fn evict(ix: &mut Index, replica: &str, block: [u8; 8], now: i64) {
    let e = CacheEvent {
        tenant_id: "t".into(),
        model_id: "m".into(),
        replica_id: replica.into(),
        r#type: cache_event::Type::PrefixEvicted as i32,
        prefix_hash: block.to_vec(),
        ..Default::default()
    };
    ix.apply_event(&e, now, &NoRules);
    ix.check_store();
}

/// (replica, matched tokens, wire tier) of a full-chain lookup, by replica name.
fn answer(ix: &mut Index, c: &[[u8; 8]], now: i64) -> Vec<(String, i32, i32)> {
    let counts = vec![TOKENS; c.len()];
    let q = LookupQuery {
        tenant: "t",
        model: "m",
        hash_scheme: "s",
        block_hashes: c.into(),
        block_token_counts: &counts,
        ..Default::default()
    };
    let v = ix.lookup_route(&q, now, &NoRules);
    assert_eq!(v.strategy, Strategy::PrefixMatch);
    let mut out: Vec<_> = v
        .scores
        .iter()
        .map(|s| (v.replica_id(s).to_string(), s.matched_tokens, s.tier))
        .collect();
    out.sort();
    out
}

fn row(r: &str, blocks: usize, tier: i32) -> (String, i32, i32) {
    (r.to_string(), blocks as i32 * TOKENS, tier)
}

/// Three replicas hold chain 0 (stored one after the other: each block's record holds all
/// three with the same data as its predecessor), at tier 1.
fn fleet() -> (Index, Vec<[u8; 8]>) {
    let mut ix = Index::new(IndexConfig {
        max_entries: 0,
        default_ttl_ns: TTL,
        ..IndexConfig::default()
    });
    let c = chain(0);
    for (i, r) in ["r0", "r1", "r2"].into_iter().enumerate() {
        store(&mut ix, r, &c, 1, T0 + i as i64);
    }
    let all = vec![
        row("r0", BLOCKS, 1),
        row("r1", BLOCKS, 1),
        row("r2", BLOCKS, 1),
    ];
    assert_eq!(answer(&mut ix, &c, T0 + SEC), all);
    (ix, c)
}

#[test]
fn a_block_evicted_in_the_middle_of_a_run_ends_that_holder_there() {
    let (mut ix, c) = fleet();
    evict(&mut ix, "r1", c[MID], T0 + SEC);
    let want = vec![
        row("r0", BLOCKS, 1),
        row("r1", MID, 1),
        row("r2", BLOCKS, 1),
    ];
    assert_eq!(answer(&mut ix, &c, T0 + SEC), want);
    // Stored again: the whole chain is one holder set once more.
    store(&mut ix, "r1", &c[MID..MID + 1], 1, T0 + 1);
    let all = vec![
        row("r0", BLOCKS, 1),
        row("r1", BLOCKS, 1),
        row("r2", BLOCKS, 1),
    ];
    assert_eq!(answer(&mut ix, &c, T0 + SEC), all);
}

#[test]
fn a_block_retiered_in_the_middle_of_a_run_makes_that_holder_colder() {
    let (mut ix, c) = fleet();
    store(&mut ix, "r2", &c[MID..MID + 1], 3, T0 + 2);
    let want = vec![
        row("r0", BLOCKS, 1),
        row("r1", BLOCKS, 1),
        row("r2", BLOCKS, 3),
    ];
    assert_eq!(answer(&mut ix, &c, T0 + SEC), want);
}

#[test]
fn a_block_expired_in_the_middle_of_a_run_ends_that_holder_there() {
    let (mut ix, c) = fleet();
    // r0 refreshes every block but the middle one, later: at `now` only its middle block is
    // older than the TTL.
    let later = T0 + TTL / 2;
    store(&mut ix, "r0", &c[..MID], 1, later);
    store(&mut ix, "r0", &c[MID + 1..], 1, later);
    let now = T0 + TTL + SEC;
    let want = vec![row("r0", MID, 1)];
    assert_eq!(answer(&mut ix, &c, now), want);
    // Before it expires, r0's oldest entry is the middle one: the same as r1's and r2's.
    let all = vec![
        row("r0", BLOCKS, 1),
        row("r1", BLOCKS, 1),
        row("r2", BLOCKS, 1),
    ];
    assert_eq!(answer(&mut ix, &c, T0 + SEC), all);
}

#[test]
fn a_hole_in_the_middle_of_a_run_ends_the_match_there() {
    let (mut ix, c) = fleet();
    // Chain 1, held by r3 alone, in a run of its own.
    let other = chain(1);
    store(&mut ix, "r3", &other, 1, T0 + 3);
    // Block MID of chain 0 loses every holder: its key goes, and its place in the run is a
    // hole that ends every match there.
    for r in ["r0", "r1", "r2"] {
        evict(&mut ix, r, c[MID], T0 + SEC);
    }
    let want = vec![row("r0", MID, 1), row("r1", MID, 1), row("r2", MID, 1)];
    assert_eq!(answer(&mut ix, &c, T0 + SEC), want);
    assert_eq!(
        answer(&mut ix, &other, T0 + SEC),
        vec![row("r3", BLOCKS, 1)]
    );
    // Chain 0's middle block stored again by r1 only (back into its place).
    store(&mut ix, "r1", &c[MID..MID + 1], 1, T0 + 1);
    let want = vec![row("r0", MID, 1), row("r1", BLOCKS, 1), row("r2", MID, 1)];
    assert_eq!(answer(&mut ix, &c, T0 + SEC), want);
}

#[test]
fn a_holder_added_to_part_of_a_run_splits_it() {
    let (mut ix, c) = fleet();
    // r3 stores only the first half: the run of the first half gains a holder, the second
    // half does not; r0 refreshes the second half only.
    store(&mut ix, "r3", &c[..MID], 2, T0 + 4);
    store(&mut ix, "r0", &c[MID..], 1, T0 + 5);
    let want = vec![
        row("r0", BLOCKS, 1),
        row("r1", BLOCKS, 1),
        row("r2", BLOCKS, 1),
        row("r3", MID, 2),
    ];
    assert_eq!(answer(&mut ix, &c, T0 + SEC), want);
    // A lookup of a chain that leaves the stored run in the middle (its own block MID).
    let mut fork = c.clone();
    fork[MID] = hash(9, MID);
    let want = vec![
        row("r0", MID, 1),
        row("r1", MID, 1),
        row("r2", MID, 1),
        row("r3", MID, 2),
    ];
    assert_eq!(answer(&mut ix, &fork, T0 + SEC), want);
}

/// Keyspace ids share their word in a key record with the run bits, and the largest id below
/// them marks a free record slot: the keyspace bound is clamped below both, so no configuration
/// lets an id reach a flag bit or the free mark.
#[test]
fn the_keyspace_bound_stays_below_the_record_flags() {
    let ix = Index::new(IndexConfig {
        max_keyspaces: usize::MAX,
        ..IndexConfig::default()
    });
    assert_eq!(ix.config().max_keyspaces, (1 << 29) - 1);
}

/// A request whose hash right after a stored run is not an 8-byte hash (empty, short, long:
/// blob keys, or none) ends the match there, whatever the walk loads ahead of it.
#[test]
fn a_request_hash_of_another_length_after_a_stored_run_ends_the_match() {
    let (mut ix, c) = fleet();
    for odd in [vec![], vec![7u8; 5], vec![7u8; 9]] {
        let mut hashes: Vec<Vec<u8>> = c.iter().map(|h| h.to_vec()).collect();
        hashes.push(odd);
        hashes.extend((0..10).map(|b| hash(1, b).to_vec()));
        let counts = vec![TOKENS; hashes.len()];
        let q = LookupQuery {
            tenant: "t",
            model: "m",
            hash_scheme: "s",
            block_hashes: (&hashes).into(),
            block_token_counts: &counts,
            ..Default::default()
        };
        let v = ix.lookup_route(&q, T0 + SEC, &NoRules);
        let mut got: Vec<_> = (v.scores.iter())
            .map(|s| (v.replica_id(s).to_string(), s.matched_tokens, s.tier))
            .collect();
        got.sort();
        let all = vec![
            row("r0", BLOCKS, 1),
            row("r1", BLOCKS, 1),
            row("r2", BLOCKS, 1),
        ];
        assert_eq!(
            got,
            all,
            "hash of {} bytes after the run",
            hashes[BLOCKS].len()
        );
    }
}
