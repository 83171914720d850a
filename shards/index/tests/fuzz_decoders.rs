//! Fuzzing of every decoder a peer can reach in the index crate, with proptest: arbitrary and
//! mutated bytes must be refused cleanly, never panic, and whatever decodes must be safe to
//! apply. CI runs the default case count; a longer run is
//! `PROPTEST_CASES=1000000 cargo test -p inferencecache-index --test fuzz_decoders`.

use inferencecache_index::index::{Index, LookupQuery};
use inferencecache_index::policy::{PolicyStore, parse_policy_body};
use inferencecache_index::resolve::{self, Resolution};
use inferencecache_proto::v1alpha1 as pb;
use proptest::prelude::*;
use prost::Message;

const NOW: i64 = 1_700_000_000_000_000_000;

/// A valid policy body to mutate from.
const POLICY: &str = r#"{"version":7,"policies":[{"namespace":"team-a","evictionTTL":900000000000,"minimumPrefixTokens":32,"lookupTimeoutMs":25,"affinityRouting":true,"eviction":"lfu","strategy":{"enableChainMatching":true}}],"tenants":[{"tenantID":"team-a","maxIndexEntries":100,"isolationMode":"Fairness"}]}"#;

/// `seed` with a few bytes overwritten, inserted or cut: close enough to valid input to reach
/// deep into a decoder.
fn mutated(seed: &'static [u8]) -> impl Strategy<Value = Vec<u8>> {
    let edits = prop::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 0..8);
    edits.prop_map(move |edits| {
        let mut b = seed.to_vec();
        for (at, byte, kind) in edits {
            let at = at % (b.len() + 1);
            match kind {
                0 if at < b.len() => b[at] = byte,
                1 => b.insert(at, byte),
                _ => b.truncate(at),
            }
        }
        b
    })
}

/// Either arbitrary bytes or a mutation of `seed`.
fn input(seed: &'static [u8]) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![prop::collection::vec(any::<u8>(), 0..512), mutated(seed)]
}

fn valid_update() -> &'static [u8] {
    let u = pb::CacheStateUpdate {
        replica_id: "r".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        hash_scheme: "vllm".into(),
        prefixes: vec![pb::PrefixEntry {
            block_hashes: vec![vec![1; 8], vec![2; 8]],
            block_token_counts: vec![16, 16],
            prefix_hash: vec![3; 8],
            token_count: 32,
            ..Default::default()
        }],
        stats: Some(pb::ReplicaStats {
            hit_rate: 0.5,
            ..Default::default()
        }),
        ..Default::default()
    };
    Box::leak(u.encode_to_vec().into_boxed_slice())
}

fn valid_lookup() -> &'static [u8] {
    let r = pb::LookupRouteRequest {
        model_id: "m".into(),
        tenant_id: "t".into(),
        hash_scheme: "vllm".into(),
        prefix_hash: vec![3; 8],
        prefix_token_count: 32,
        block_hashes: vec![vec![1; 8].into(), vec![2; 8].into()],
        block_token_counts: vec![16, 16],
        token_ids: (0..40).collect(),
        ..Default::default()
    };
    Box::leak(r.encode_to_vec().into_boxed_slice())
}

fn valid_event() -> &'static [u8] {
    let e = pb::CacheEvent {
        r#type: pb::cache_event::Type::PrefixEvicted as i32,
        replica_id: "r".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        prefix_hash: vec![1; 8],
        ..Default::default()
    };
    Box::leak(e.encode_to_vec().into_boxed_slice())
}

/// The LookupRoute owner path: resolve the request, then ask the index.
fn lookup(ix: &mut Index, req: &pb::LookupRouteRequest, rules: &PolicyStore) {
    let resolution = resolve::resolve_inputs(&req.into(), true, 16);
    let Resolution::Resolved(inputs) = resolution else {
        return;
    };
    let q = LookupQuery {
        tenant: &req.tenant_id,
        model: &req.model_id,
        hash_scheme: &req.hash_scheme,
        adapter: &req.adapter_id,
        prefix_hash: inputs.exact_hash.as_bytes(),
        token_count: inputs.exact_tokens,
        block_hashes: (&req.block_hashes).into(),
        block_token_counts: &req.block_token_counts,
        ..Default::default()
    };
    let _ = ix.lookup_route(&q, NOW, rules);
}

proptest! {
    #[test]
    fn fuzz_policy_body(body in input(POLICY.as_bytes())) {
        let _ = parse_policy_body(&body);
    }

    #[test]
    fn fuzz_protobuf_messages_through_the_index(
        update in input(valid_update()),
        event in input(valid_event()),
        req in input(valid_lookup()),
    ) {
        let rules = PolicyStore::empty();
        let mut ix = Index::default();
        if let Ok(u) = pb::CacheStateUpdate::decode(update.as_slice()) {
            let _ = ix.ingest(&u, NOW, &rules);
        }
        if let Ok(r) = pb::LookupRouteRequest::decode(req.as_slice()) {
            lookup(&mut ix, &r, &rules);
        }
        if let Ok(e) = pb::CacheEvent::decode(event.as_slice()) {
            let _ = ix.apply_event(&e, NOW, &rules);
        }
        let _ = ix.sweep(NOW + 3_600_000_000_000, &rules);
        prop_assert_eq!(ix.entry_count(), 0, "a sweep an hour later leaves nothing");
    }
}
