//! Ingest cost on one hot key held by N replicas: 1,000 messages, each a replica refreshing its
//! holder of the key (round-robin over the N replicas). Prints seconds per 1,000 messages.
use inferencecache_index::index::{Index, IndexConfig};
use inferencecache_index::rules::NoRules;
use inferencecache_proto::v1alpha1::{CacheStateUpdate, PrefixEntry};
use std::time::Instant;

fn upd(r: usize) -> CacheStateUpdate {
    CacheStateUpdate {
        replica_id: format!("replica-{r:07}"),
        model_id: "m".into(),
        tenant_id: "t".into(),
        hash_scheme: "vllm".into(),
        prefixes: vec![PrefixEntry {
            prefix_hash: b"hot-key!".to_vec(),
            token_count: 64,
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn main() {
    for n in [1_000usize, 10_000, 100_000] {
        let mut ix = Index::new(IndexConfig {
            max_entries: 0,
            max_holders_per_key: usize::MAX,
            ..Default::default()
        });
        let now = 1_700_000_000_000_000_000i64;
        for r in 0..n {
            ix.ingest(&upd(r), now, &NoRules);
        }
        let msgs: Vec<_> = (0..1000).map(|i| upd(i * 7919 % n)).collect();
        let t = Instant::now();
        for m in &msgs {
            ix.ingest(m, now, &NoRules);
        }
        println!(
            "holders {n:>7}: {:.4} s per 1,000 messages",
            t.elapsed().as_secs_f64()
        );
    }
}
