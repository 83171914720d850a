//! Workload determinism and producer/gateway key agreement.
//!
//! The second half models what a correct server does with the producers' legacy per-block
//! entries (docs/BEHAVIOUR.md §4.2 legacy form, §8.3 chain match) and checks that the gateways'
//! lookups would be PREFIX_MATCH wherever the workload says the prefix was stored.

use std::collections::{HashMap, HashSet};

use inferencecache_fingerprint as fingerprint;
use inferencecache_proto::v1alpha1::{CacheTier, LookupRouteRequest};
use loadgen::gateway::{LookupInput, lookup_request};
use loadgen::producer::block_entries;
use loadgen::workload::{
    Generator, Names, RequestSpec, Scope, StoreOp, WorkloadConfig, WorkloadKind,
};

fn cfg(kind: WorkloadKind, seed: u64) -> WorkloadConfig {
    WorkloadConfig {
        kind,
        seed,
        replicas: 6,
        tenants: 3,
        models: 2,
        adapters: 2,
        hash_scheme: "vllm".into(),
        block_size: 16,
        min_tokens: 16,
        mean_tokens: 200,
        max_tokens: 800,
        population: 40,
        system_prompts: 3,
        system_prompt_tokens: 64,
        turns: 4,
        chunk_tokens: 48,
        chunks_per_prompt: 3,
        zipf: 1.1,
        vocab: 50_000,
    }
}

const KINDS: [WorkloadKind; 3] = [WorkloadKind::Chat, WorkloadKind::Rag, WorkloadKind::Diffuse];

/// A comparable digest of one request.
fn digest(r: &RequestSpec) -> (u64, Scope, Vec<u32>, Vec<u64>, usize, u32) {
    (
        r.index,
        r.scope,
        r.tokens[..r.n_tokens].to_vec(),
        r.hashes[..r.n_blocks].to_vec(),
        r.n_blocks,
        r.replica,
    )
}

fn ops_digest(ops: &[(u32, StoreOp)]) -> Vec<(u32, Scope, Vec<u64>)> {
    ops.iter()
        .map(|(r, o)| (*r, o.scope, o.hashes[..o.n_blocks].to_vec()))
        .collect()
}

#[test]
fn same_seed_same_workload() {
    for kind in KINDS {
        let (mut a, mut b) = (Generator::new(cfg(kind, 42)), Generator::new(cfg(kind, 42)));
        assert_eq!(
            ops_digest(&a.preload_ops()),
            ops_digest(&b.preload_ops()),
            "{kind:?} preload"
        );
        for _ in 0..500 {
            assert_eq!(
                digest(&a.next_request()),
                digest(&b.next_request()),
                "{kind:?}"
            );
        }
    }
}

#[test]
fn different_seed_different_workload() {
    for kind in KINDS {
        let (mut a, mut b) = (Generator::new(cfg(kind, 1)), Generator::new(cfg(kind, 2)));
        let da: Vec<_> = (0..50).map(|_| digest(&a.next_request())).collect();
        let db: Vec<_> = (0..50).map(|_| digest(&b.next_request())).collect();
        assert_ne!(da, db, "{kind:?}");
    }
}

#[test]
fn requests_respect_population_bounds() {
    for kind in KINDS {
        let c = cfg(kind, 9);
        let mut g = Generator::new(c.clone());
        for _ in 0..300 {
            let r = g.next_request();
            assert!(r.scope.tenant < c.tenants && r.scope.model < c.models);
            assert!(r.scope.adapter <= c.adapters);
            assert_eq!(
                r.replica % c.models,
                r.scope.model,
                "replica must serve the model"
            );
            assert_eq!(r.n_blocks, r.n_tokens / 16);
            assert!(r.n_blocks > 0, "{kind:?}: every prompt has a full block");
        }
    }
}

/// What a correct index holds after ingesting the producers' entries: key → replicas, with the
/// stored cumulative token count.
#[derive(Default)]
struct ModelIndex {
    map: HashMap<(Scope, Vec<u8>), HashMap<u32, i32>>,
}

impl ModelIndex {
    fn ingest(&mut self, replica: u32, op: &StoreOp) {
        for e in block_entries(&op.hashes, 0, op.n_blocks, 16) {
            assert_eq!(e.tier, CacheTier::T1 as i32);
            assert!(
                e.block_hashes.is_empty() && e.block_token_counts.is_empty(),
                "legacy form"
            );
            self.map
                .entry((op.scope, e.prefix_hash))
                .or_default()
                .insert(replica, e.token_count);
        }
    }

    /// Longest common leading run of the chain held by `replica` (docs/BEHAVIOUR.md §8.3).
    fn chain_run(&self, scope: Scope, req: &LookupRouteRequest, replica: u32) -> usize {
        req.block_hashes
            .iter()
            .take_while(|h| {
                self.map
                    .get(&(scope, h.to_vec()))
                    .is_some_and(|m| m.contains_key(&replica))
            })
            .count()
    }
}

#[test]
fn lookups_match_what_producers_report() {
    for kind in KINDS {
        let c = cfg(kind, 5);
        let names = Names::new(&c);
        let mut g = Generator::new(c.clone());
        let mut idx = ModelIndex::default();
        for (r, op) in g.preload_ops() {
            idx.ingest(r, &op);
        }
        // The replica that holds a conversation/prompt: the blocks it stored there.
        let mut stored: HashMap<u32, HashSet<(Scope, u64)>> = HashMap::new();
        let mut hits = 0;
        let n = 400;
        for _ in 0..n {
            let spec = g.next_request();
            let chain = lookup_request(&spec, &names, "vllm", 16, LookupInput::Chain);
            assert_eq!(chain.tenant_id, names.tenants[spec.scope.tenant as usize]);
            assert_eq!(chain.block_hashes.len(), spec.n_blocks);
            assert!(chain.block_token_counts.iter().all(|&c| c == 16));

            // token_ids input fingerprints to exactly the same chain on the server.
            let tokens = lookup_request(&spec, &names, "vllm", 16, LookupInput::Tokens);
            let (bh, btc) = fingerprint::chain(&tokens.token_ids, 16);
            assert_eq!(bh, chain.block_hashes);
            assert_eq!(btc, chain.block_token_counts);

            // Exact input = last block's key with its cumulative count, as ingested.
            let exact = lookup_request(&spec, &names, "vllm", 16, LookupInput::Exact);
            assert_eq!(
                Some(&exact.prefix_hash[..]),
                chain.block_hashes.last().map(|h| &h[..])
            );
            assert_eq!(exact.prefix_token_count as usize, spec.n_blocks * 16);

            // Blocks this replica stored before must form the leading run now.
            let expect = spec.hashes[..spec.n_blocks]
                .iter()
                .take_while(|h| {
                    stored
                        .get(&spec.replica)
                        .is_some_and(|s| s.contains(&(spec.scope, **h)))
                })
                .count();
            let run = idx.chain_run(spec.scope, &chain, spec.replica);
            assert!(run >= expect, "{kind:?}: run {run} < stored {expect}");
            if run > 0 {
                hits += 1;
                // The stored count of the deepest matched block is its cumulative length.
                let key = (spec.scope, chain.block_hashes[run - 1].to_vec());
                assert_eq!(idx.map[&key][&spec.replica], (run * 16) as i32);
            }
            // Executing the prompt stores its blocks on its replica (what producers report).
            let op = spec.store_op();
            idx.ingest(spec.replica, &op);
            let s = stored.entry(spec.replica).or_default();
            s.extend(op.hashes[..op.n_blocks].iter().map(|h| (spec.scope, *h)));
        }
        let share = hits as f64 / n as f64;
        eprintln!("{kind:?}: {share:.3} of lookups hit");
        let floor = match kind {
            // Preloaded conversations hit; a fresh conversation replacing a finished one may
            // start on a replica without its system prompt (a genuine first-turn miss).
            WorkloadKind::Chat => 0.8,
            // Instruction prompt + popular leading chunks are preloaded on the home replica.
            WorkloadKind::Rag => 0.9,
            // The population is preloaded and every request repeats one of its prompts.
            WorkloadKind::Diffuse => 0.99,
        };
        assert!(
            share >= floor,
            "{kind:?}: only {share:.2} of lookups would hit"
        );
    }
}

#[test]
fn chat_next_turn_extends_the_stored_turn() {
    let mut c = cfg(WorkloadKind::Chat, 11);
    c.population = 4;
    c.zipf = 0.0;
    let mut g = Generator::new(c);
    g.preload_ops();
    let mut last: HashMap<*const u32, RequestSpec> = HashMap::new();
    let mut checked = 0;
    for _ in 0..200 {
        let r = g.next_request();
        if let Some(prev) = last.get(&r.tokens.as_ptr()) {
            // Same conversation: this turn's prompt starts with the previous turn's prompt.
            assert!(r.n_tokens > prev.n_tokens);
            assert_eq!(&r.hashes[..prev.n_blocks], &prev.hashes[..prev.n_blocks]);
            assert_eq!(r.replica, prev.replica, "conversations are sticky");
            checked += 1;
        }
        last.insert(r.tokens.as_ptr(), r);
    }
    assert!(checked > 50, "{checked}");
}
