//! The answer's order and the depth-aware distinguishing power with many holders
//! (docs/BEHAVIOUR.md §9.5, §9.6): score descending, ties by replica name ascending, whichever
//! way the index orders them (a walk over the scope's name-ordered replicas when the answer is a
//! large part of the scope, a comparison sort by name otherwise), and the §9.5 groups of equal
//! matched tokens whether or not a run's matched tokens grow with its last block.

mod index_support;

use index_support::*;
use inferencecache_index::index::ranking::{distinguishing_power, pressure_factor};
use inferencecache_index::index::{LookupQuery, RankerConfig, Strategy};
use inferencecache_index::rules::NoRules;

const NR: NoRules = NoRules;

/// A permutation of `0..n` (deterministic), so names are interned out of name order.
fn scrambled(n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

/// Asserts rows are in the answer's order: score descending, then name ascending (strictly).
#[track_caller]
fn assert_answer_order(rows: &[Row]) {
    for w in rows.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        let ok = a.1 > b.1 || (a.1 == b.1 && a.0 < b.0);
        assert!(ok, "{a:?} before {b:?}");
    }
}

const BLOCKS: [&[u8]; 5] = [b"b0", b"b1", b"b2", b"b3", b"b4"];

/// `n` replicas (interned in scrambled order), replica `i` holding the first `i % 5 + 1` blocks
/// of the chain, some under pressure; every fifth also holds a key of its own.
fn many_holders(n: usize) -> (inferencecache_index::index::Index, Vec<(String, i32, f32)>) {
    let mut ix = index();
    let mut expect = Vec::new();
    for i in scrambled(n) {
        let name = format!("rep-{i:04}");
        let depth = i % 5 + 1;
        let pressure = [0.0, 0.25, 0.0, 0.5][i % 4];
        let mut prefixes = vec![chain_entry(&BLOCKS[..depth], 16)];
        if i % 5 == 0 {
            prefixes.push(legacy(name.as_bytes(), 7));
        }
        ix.ingest(&with_stats(upd_r(&name, prefixes), 0.5, pressure), T0, &NR);
        expect.push((name, 16 * depth as i32, pressure));
    }
    (ix, expect)
}

/// The §8.3/§9.5/§9.6 answer computed directly: fresh entries (f = 1), no SLO.
fn reference(expect: &[(String, i32, f32)], total: usize) -> Vec<Row> {
    let mut rows: Vec<Row> = expect
        .iter()
        .map(|(name, matched, p)| {
            let right = expect.iter().filter(|e| e.1 >= *matched).count();
            let mut score = *matched as f32 * 1.0 * pressure_factor(1.0, *p) * 1.0;
            let dp = distinguishing_power(right as i64, total as i64);
            if dp != 1.0 {
                score *= dp as f32;
            }
            (name.clone(), score, *matched, 1.0, 1)
        })
        .collect();
    rows.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then_with(|| a.0.cmp(&b.0)));
    rows
}

#[test]
fn many_holders_are_ordered_by_score_then_name() {
    // 600 holders of one chain in a scope of 600: the answer is the whole scope.
    let (mut ix, expect) = many_holders(600);
    let c = chain(&BLOCKS, 16);
    let (strategy, rows) = route(&mut ix, &c.q(), T0, &NR);
    assert_eq!(strategy, Strategy::PrefixMatch);
    assert_eq!(rows.len(), 600);
    assert_answer_order(&rows);
    assert_eq!(rows, reference(&expect, 600));
    // Hundreds of ties: the pressure-free replicas of one depth share a score.
    let ties = rows.windows(2).filter(|w| w[0].1 == w[1].1).count();
    assert!(ties > 400, "{ties} ties");

    // The exact path: every fifth replica's own key, one holder each, and a key held by all.
    let (_, rows) = route(&mut ix, &q_exact(b"rep-0005"), T0, &NR);
    assert_eq!(names(&rows), ["rep-0005"]);
}

#[test]
fn a_few_holders_in_a_large_scope_are_ordered_by_name() {
    // 2,000 replicas serve the scope (each its own key) and 3 of them, interned in reverse name
    // order, hold the chain with equal scores: the answer is a small part of the scope.
    let mut ix = index();
    for i in scrambled(2000) {
        let name = format!("other-{i:04}");
        ix.ingest(&upd_r(&name, vec![legacy(name.as_bytes(), 7)]), T0, &NR);
    }
    for name in ["c", "b", "a"] {
        ix.ingest(&upd_r(name, vec![chain_entry(&BLOCKS[..2], 16)]), T0, &NR);
    }
    ix.ingest(&upd_r("d", vec![chain_entry(&BLOCKS[..1], 16)]), T0, &NR);
    let c = chain(&BLOCKS[..2], 16);
    let (_, rows) = route(&mut ix, &c.q(), T0, &NR);
    assert_eq!(names(&rows), ["a", "b", "c", "d"]);
    assert_answer_order(&rows);
    assert_eq!(rows[0].1, rows[2].1);
    assert_eq!(rows.len(), 4);
}

#[test]
fn negative_and_positive_zero_scores_tie_by_name() {
    // TENANT_HOT with full pressure: replicas with a negative hit rate (stored as reported)
    // score -0, the others +0. They are equal scores (Go's `>`), so the answer is in name order;
    // 20 of them, interned out of order, so the answer is ordered by the walk over the names.
    let mut ix = index();
    ix.set_ranker(RankerConfig {
        tenant_hot_min_hit_rate: -1.0,
        ..RankerConfig::default()
    });
    for i in scrambled(20) {
        let hit = if i % 2 == 0 { -0.5 } else { 0.5 };
        let name = format!("z{i:02}");
        ix.ingest(
            &with_stats(upd_r(&name, vec![legacy(b"p", 10)]), hit, 1.0),
            T0,
            &NR,
        );
    }
    let (strategy, rows) = route(&mut ix, &q_exact(b"novel"), T0, &NR);
    assert_eq!(strategy, Strategy::TenantHot);
    let expect: Vec<String> = (0..20).map(|i| format!("z{i:02}")).collect();
    assert_eq!(names(&rows), expect);
    assert!(rows[0].1 == 0.0 && rows[0].1.is_sign_negative());
    assert!(rows[1].1 == 0.0 && rows[1].1.is_sign_positive());
}

/// A lookup of `hashes` (the first three of [`BLOCKS`]) with per-block counts `counts`.
fn three_blocks<'a>(hashes: &'a Vec<Vec<u8>>, counts: &'a [i32; 3]) -> LookupQuery<'a> {
    LookupQuery {
        tenant: "t",
        model: "m",
        hash_scheme: "vllm",
        block_hashes: hashes.into(),
        block_token_counts: counts,
        ..Default::default()
    }
}

/// Replicas `x` (block 0 only), `y` (blocks 0..=1), `z` (blocks 0..=2) and `w` (another key),
/// looked up with per-block request counts `counts`.
fn depth_case(counts: [i32; 3]) -> Vec<Row> {
    let mut ix = index();
    for (name, depth) in [("x", 1), ("y", 2), ("z", 3)] {
        ix.ingest(
            &upd_r(name, vec![chain_entry(&BLOCKS[..depth], 16)]),
            T0,
            &NR,
        );
    }
    ix.ingest(&upd_r("w", vec![legacy(b"other", 7)]), T0, &NR);
    let hashes: Vec<Vec<u8>> = BLOCKS[..3].iter().map(|h| h.to_vec()).collect();
    let q = three_blocks(&hashes, &counts);
    route(&mut ix, &q, T0, &NR).1
}

#[test]
fn depth_power_groups_are_equal_matched_tokens_not_blocks() {
    let dp = |m: i64| distinguishing_power(m, 4) as f32;
    // Positive counts: one group per block. z: right 1; y: 2; x: 3.
    let rows = depth_case([16, 16, 16]);
    assert_eq!(names(&rows), ["z", "y", "x"]);
    assert_eq!(rows[0].1, 48.0 * dp(1));
    assert_eq!(rows[1].1, 32.0 * dp(2));
    assert_eq!(rows[2].1, 16.0 * dp(3));

    // A zero count: x and y both match 16 tokens, one group of right 3 (not 2 and 3).
    let rows = depth_case([16, 0, 16]);
    assert_eq!(names(&rows), ["z", "x", "y"]);
    assert_eq!(rows[0].1, 32.0 * dp(1));
    assert_eq!(rows[1].1, 16.0 * dp(3));
    assert_eq!(rows[2].1, 16.0 * dp(3));

    // Wrapping sums: z's run (blocks 0..=2) matches less than x's (block 0 alone), so x's group
    // is the top one (right 1) and z's is below it (right 2); y's sum is negative, dropped.
    let m = i32::MAX;
    let rows = depth_case([m, m, m]);
    let z = m.wrapping_add(m).wrapping_add(m);
    assert!(0 < z && z < m);
    assert_eq!(names(&rows), ["x", "z"]);
    assert_eq!((rows[0].2, rows[1].2), (m, z));
    assert_eq!(rows[0].1, m as f32 * dp(1));
    assert_eq!(rows[1].1, z as f32 * dp(2));
}

/// Nine blocks, for answers with up to nine groups.
const NINE: [&[u8]; 9] = [
    b"n0", b"n1", b"n2", b"n3", b"n4", b"n5", b"n6", b"n7", b"n8",
];

/// `n` replicas (interned in scrambled order), replica `i` holding the first `i % groups + 1`
/// of [`NINE`], stored `i % ages` minutes before the lookup and under pressure `i % 2 / 4`
/// when `pressured`. Returns the answer to the whole chain at `T0` and the expected rows
/// computed from §8.3/§9.2/§9.5/§9.6 directly (the default 30-minute TTL, no SLO).
fn grouped_answer(n: usize, groups: usize, ages: usize, pressured: bool) -> (Vec<Row>, Vec<Row>) {
    let mut ix = index();
    let mut expect = Vec::new();
    for i in scrambled(n) {
        let name = format!("g-{i:03}");
        let depth = i % groups + 1;
        let age = (i % ages) as i64 * MIN;
        let pressure = if pressured { (i % 2) as f32 / 4.0 } else { 0.0 };
        let u = at(
            upd_r(&name, vec![chain_entry(&NINE[..depth], 16)]),
            T0 - age,
        );
        ix.ingest(&with_stats(u, 0.5, pressure), T0 - age, &NR);
        let fresh = ranking_freshness(age);
        expect.push((name, 16 * depth as i32, pressure, fresh));
    }
    let rows: Vec<Row> = expect
        .iter()
        .map(|(name, matched, p, f)| {
            let right = expect.iter().filter(|e| e.1 >= *matched).count();
            let mut score = *matched as f32 * f * pressure_factor(1.0, *p) * 1.0;
            let dp = distinguishing_power(right as i64, n as i64);
            if dp != 1.0 {
                score *= dp as f32;
            }
            (name.clone(), score, *matched, *f, 1)
        })
        .collect();
    let mut reference = rows;
    reference.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then_with(|| a.0.cmp(&b.0)));
    let c = chain(&NINE, 16);
    let (strategy, got) = route(&mut ix, &c.q(), T0, &NR);
    assert_eq!(strategy, Strategy::PrefixMatch);
    (got, reference)
}

fn ranking_freshness(age: i64) -> f32 {
    inferencecache_index::index::ranking::freshness(T0, T0 - age, 30 * MIN)
}

#[test]
fn answers_with_few_and_many_groups_are_ordered_and_scaled_exactly() {
    // Up to 8 distinct depths and scores (grouped by comparison), then 9 (the histogram and
    // the sort), with 40 holders: the order walks the names.
    for groups in [1, 2, 3, 8, 9] {
        let (got, reference) = grouped_answer(40, groups, 1, false);
        assert_eq!(got, reference, "{groups} groups");
        assert_answer_order(&got);
    }
    // Equal depths, different scores: pressure doubles the distinct scores (8 depths → 16).
    for groups in [4, 8] {
        let (got, reference) = grouped_answer(40, groups, 1, true);
        assert_eq!(got, reference, "{groups} groups under pressure");
    }
}

#[test]
fn equal_runs_stored_at_different_times_score_by_their_own_freshness() {
    // Runs with the same matched tokens but another age (or pressure): each scores by its own
    // freshness and pressure, whichever way the groups are ordered and scaled.
    for (groups, ages) in [(1, 3), (2, 5), (3, 7)] {
        let (got, reference) = grouped_answer(30, groups, ages, false);
        assert_eq!(got, reference, "{groups} groups, {ages} ages");
        let (got, reference) = grouped_answer(30, groups, ages, true);
        assert_eq!(got, reference, "{groups} groups, {ages} ages, pressure");
    }
}

#[test]
fn holders_stored_at_many_different_times_are_ordered_and_scaled_exactly() {
    // Up to 29 ages (all within the 30-minute TTL) × 8 depths × 2 pressures: far more
    // distinct scores than the few a fleet's shared prefix gets when its holders stored it at
    // one moment, as when each replica stored it at its own; equal ones among them (ties by
    // name).
    for (n, groups, ages) in [(200, 1, 29), (200, 3, 29), (300, 8, 29), (64, 2, 13)] {
        for pressured in [false, true] {
            let (got, reference) = grouped_answer(n, groups, ages, pressured);
            assert_eq!(got, reference, "{n} holders, {groups} groups, {ages} ages");
            assert_answer_order(&got);
        }
    }
}

/// [`depth_case`] with enough holders for the answer to be built straight from the runs (16 or
/// more): `per` replicas at each of the three depths, looked up with per-block counts `counts`.
/// Returns the answer and the rows computed from §8.3/§9.5/§9.6 directly (fresh entries).
fn many_depth_case(per: usize, counts: [i32; 3]) -> (Vec<Row>, Vec<Row>) {
    let mut ix = index();
    let mut expect = Vec::new();
    for i in scrambled(3 * per) {
        let name = format!("d-{i:03}");
        let depth = i % 3 + 1;
        ix.ingest(
            &upd_r(&name, vec![chain_entry(&BLOCKS[..depth], 16)]),
            T0,
            &NR,
        );
        let matched = counts[..depth].iter().fold(0i32, |a, c| a.wrapping_add(*c));
        if matched > 0 {
            expect.push((name, matched));
        }
    }
    let total = 3 * per;
    let mut reference: Vec<Row> = expect
        .iter()
        .map(|(name, matched)| {
            let right = expect.iter().filter(|e| e.1 >= *matched).count();
            let dp = distinguishing_power(right as i64, total as i64) as f32;
            (name.clone(), *matched as f32 * dp, *matched, 1.0, 1)
        })
        .collect();
    reference.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then_with(|| a.0.cmp(&b.0)));
    let hashes: Vec<Vec<u8>> = BLOCKS[..3].iter().map(|h| h.to_vec()).collect();
    let q = three_blocks(&hashes, &counts);
    (route(&mut ix, &q, T0, &NR).1, reference)
}

#[test]
fn many_holders_group_by_equal_matched_tokens_not_blocks() {
    // 18 holders: the answer is built from the runs unless matched tokens do not grow with the
    // block (a zero count, wrapping sums); either way the groups are equal matched tokens.
    let m = i32::MAX;
    for counts in [
        [16, 16, 16],
        [16, 0, 16],
        [0, 16, 16],
        [m, m, m],
        [16, -16, 32],
    ] {
        let (got, reference) = many_depth_case(6, counts);
        assert_eq!(got, reference, "counts {counts:?}");
        assert_answer_order(&got);
    }
}
