//! The event path's batching is exact: a long chain stored in one `PrefixEntry` (looked up and
//! created per batch of blocks, counters updated once per chain) leaves the index exactly as the
//! same blocks upserted one at a time do, across batch boundaries, with repeated hashes within a
//! chain, blob (not 8-byte) hashes, keys already held by other replicas, full keys (the
//! per-key holder bound), and blocks removed leaves first by `PREFIX_EVICTED` events in between.

mod index_support;

use index_support::{Rules, event, legacy, upd_r};
use inferencecache_index::index::{Index, IndexConfig};
use inferencecache_proto::v1alpha1::{PrefixEntry, cache_event};

const T0: i64 = 1_700_000_000_000_000_000;

/// A small deterministic generator (no dependency, reproducible).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn new_index() -> Index {
    Index::new(IndexConfig {
        max_entries: 0,
        max_holders_per_key: 3,
        ..IndexConfig::default()
    })
}

/// Block `i` of conversation `c`: mostly 8-byte hashes (shared prefixes: conversations 0..4
/// share their first blocks), sometimes a 5- or 12-byte blob hash.
fn block(c: u64, i: u64) -> Vec<u8> {
    let base = if i < 40 { c % 4 } else { c };
    let h = (base << 20 | i).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    match (base + i) % 29 {
        0 => h.to_be_bytes()[..5].to_vec(),
        1 => [h.to_be_bytes(), (!h).to_be_bytes()].concat()[..12].to_vec(),
        _ => h.to_be_bytes().to_vec(),
    }
}

#[test]
fn a_chain_equals_its_blocks_one_at_a_time() {
    let rules = Rules::default();
    let (mut chained, mut single) = (new_index(), new_index());
    let mut rng = Rng(7);
    let mut held: Vec<(String, Vec<Vec<u8>>)> = Vec::new();
    let mut now = T0;
    for step in 0..160 {
        now += 1_000_000;
        let replica = format!("r{}", rng.below(6));
        let conv = rng.below(12);
        let (from, len) = (rng.below(50), 1 + rng.below(110));
        let mut hashes: Vec<Vec<u8>> = (from..from + len).map(|i| block(conv, i)).collect();
        if step % 3 == 0 && hashes.len() > 40 {
            // A hash repeated within the chain, in another batch of 32 than its first copy.
            let again = hashes[rng.below(20) as usize].clone();
            hashes.insert(35 + rng.below(5) as usize, again);
        }
        let counts: Vec<i32> = hashes.iter().map(|_| rng.below(20) as i32).collect();
        let chain = PrefixEntry {
            block_hashes: hashes.clone(),
            block_token_counts: counts.clone(),
            tier: step % 3,
            ..Default::default()
        };
        let mut cum = 0i32;
        let blocks: Vec<PrefixEntry> = hashes
            .iter()
            .zip(&counts)
            .map(|(h, c)| {
                cum += c;
                PrefixEntry {
                    tier: step % 3,
                    ..legacy(h, cum)
                }
            })
            .collect();
        let a = chained.ingest(&upd_r(&replica, vec![chain]), now, &rules);
        let b = single.ingest(&upd_r(&replica, blocks), now, &rules);
        assert_eq!(a, b, "step {step}");
        held.push((replica, hashes));
        if step % 4 == 3 {
            // A replica evicts a stored chain's tail, leaves first.
            let (replica, hashes) = held.swap_remove(rng.below(held.len() as u64) as usize);
            let keep = rng.below(hashes.len() as u64) as usize;
            for h in hashes[keep..].iter().rev() {
                let e = event(cache_event::Type::PrefixEvicted, "t", "m", &replica, h);
                let a = chained.apply_event(&e, now, &rules);
                let b = single.apply_event(&e, now, &rules);
                assert_eq!(a, b, "step {step}");
            }
        }
        assert_eq!(chained.dump_entries(), single.dump_entries(), "step {step}");
        chained.check_store();
        single.check_store();
        assert_eq!(chained.key_count(), single.key_count());
        assert_eq!(chained.entry_count(), single.entry_count());
        assert_eq!(
            chained.tenant_prefix_count("t"),
            single.tenant_prefix_count("t")
        );
        assert_eq!(chained.cache_state("t", "m"), single.cache_state("t", "m"));
        assert_eq!(
            chained.directory().total_entries(),
            single.directory().total_entries()
        );
    }
    assert!(chained.entry_count() > 1000, "{}", chained.entry_count());
}
