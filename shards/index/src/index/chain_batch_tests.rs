//! The batched chain upsert ([`Index::upsert_chain`]: keys found or created per batch before
//! the rest of each upsert) against the upserts one after another with one run cursor (the
//! reference below): the same entries, outcomes and, record by record, the same run bits,
//! through stored chains of several batches, repeated hashes, blob hashes, full keys, partial
//! refreshes, and chains evicted leaves first (records moving, also below a sliced scan's
//! visited mark).

use super::*;

const T0: i64 = 1_700_000_000_000_000_000;

/// The chain's blocks, then its `prefix_hash`, one upsert after another through one cursor.
fn ingest_prefix_one_by_one(ix: &mut Index, ks: u32, p: &PrefixEntry, replica: u32, ts: i64) {
    let tier = ranking::tier_from_wire(p.tier);
    let mut out = IngestOutcome::default();
    let mut count = |applied: bool| {
        if applied {
            out.upserts += 1;
        } else {
            out.holders_refused += 1;
        }
    };
    let mut run = RunCursor::new();
    let mut cum: i32 = 0;
    for (h, c) in p.block_hashes.iter().zip(&p.block_token_counts) {
        cum = cum.wrapping_add(*c);
        count(ix.upsert(&mut run, ks, h, replica, cum, tier, ts));
    }
    if !p.prefix_hash.is_empty() {
        let (h, n) = (&p.prefix_hash, p.token_count);
        count(ix.upsert(&mut run, ks, h, replica, n, tier, ts));
    }
    ix.store.end_run(run);
    ix.flush();
}

fn ingest_prefix_batched(ix: &mut Index, ks: u32, p: &PrefixEntry, replica: u32, ts: i64) {
    let mut out = IngestOutcome::default();
    ix.ingest_prefix(ks, p, replica, ts, &mut out);
    ix.flush();
}

/// A small deterministic generator.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// Block `i` of conversation `c` (conversations share their first 40 blocks four ways);
/// sometimes a 5-byte blob hash.
fn block(c: u64, i: u64) -> Vec<u8> {
    let base = if i < 40 { c % 4 } else { c };
    let h = (base << 20 | i).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    if (base + i).is_multiple_of(31) {
        h.to_be_bytes()[..5].to_vec()
    } else {
        h.to_be_bytes().to_vec()
    }
}

fn new_index() -> (Index, u32, Vec<u32>) {
    let mut ix = Index::new(IndexConfig {
        max_entries: 0,
        max_holders_per_key: 3,
        ..IndexConfig::default()
    });
    let mut name = |s: &str| ix.cat.strings.intern(s);
    let (t, m, s, a) = (name("t"), name("m"), name("s"), name(""));
    let replicas = (0..5).map(|r| name(&format!("r{r}"))).collect();
    let scope = ix.ensure_scope(t, m, s);
    let ks = ix.ensure_keyspace(scope, a);
    (ix, ks, replicas)
}

#[test]
fn batched_chains_keep_the_run_bits_of_one_upsert_after_another() {
    let (mut batched, ks, replicas) = new_index();
    let (mut single, _, _) = new_index();
    let mut rng = Rng(3);
    let mut held: Vec<(usize, Vec<Vec<u8>>)> = Vec::new();
    let mut most_runs = 0;
    for step in 0..240u64 {
        // A few distinct times, so that chains stored alike form runs and others split them.
        let ts = T0 + rng.below(3) as i64;
        let r = rng.below(replicas.len() as u64) as usize;
        let conv = rng.below(10);
        let (from, len) = (rng.below(30), 1 + rng.below(100));
        let mut hashes: Vec<Vec<u8>> = (from..from + len).map(|i| block(conv, i)).collect();
        if step.is_multiple_of(5) && hashes.len() > 40 {
            let again = hashes[rng.below(20) as usize].clone();
            hashes.insert(33, again);
        }
        let p = PrefixEntry {
            block_token_counts: hashes.iter().map(|_| 1 + rng.below(16) as i32).collect(),
            block_hashes: hashes.clone(),
            prefix_hash: if step.is_multiple_of(7) {
                block(conv + 100, 0)
            } else {
                Vec::new()
            },
            token_count: 5,
            tier: (step % 2) as i32,
            ..Default::default()
        };
        ingest_prefix_batched(&mut batched, ks, &p, replicas[r], ts);
        ingest_prefix_one_by_one(&mut single, ks, &p, replicas[r], ts);
        held.push((r, hashes));
        if step % 3 == 2 {
            if step % 30 == 8 {
                for ix in [&mut batched, &mut single] {
                    ix.store.set_visited(ix.store.key_count() as u32 / 2);
                }
            }
            let (r, hashes) = held.swap_remove(rng.below(held.len() as u64) as usize);
            let keep = rng.below(hashes.len() as u64) as usize;
            let replica = format!("r{r}");
            for h in hashes[keep..].iter().rev() {
                let e = CacheEvent {
                    r#type: cache_event::Type::PrefixEvicted as i32,
                    replica_id: replica.clone(),
                    model_id: "m".into(),
                    tenant_id: "t".into(),
                    prefix_hash: h.clone(),
                    ..Default::default()
                };
                let a = batched.apply_event(&e, ts, &crate::rules::NoRules);
                let b = single.apply_event(&e, ts, &crate::rules::NoRules);
                assert_eq!(a, b, "step {step}");
            }
            for ix in [&mut batched, &mut single] {
                ix.store.set_visited(0);
            }
        }
        assert_eq!(batched.dump_entries(), single.dump_entries(), "step {step}");
        assert_eq!(
            batched.store.run_bits(),
            single.store.run_bits(),
            "step {step}"
        );
        batched.store.check_runs();
        most_runs = most_runs.max(batched.store.runs());
    }
    assert!(most_runs > 200, "chains formed runs: {most_runs}");
}
