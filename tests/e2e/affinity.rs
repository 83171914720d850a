//! End-to-end conformance: the consistent-hash affinity fallback (docs/BEHAVIOUR.md §8.6, §10.6,
//! §10.7; docs/CONFORMANCE.md C120–C126). Computed picks (SHA-256 of the seed, BE u64 of the
//! first 8 bytes, mod the byte-sorted replica list) are the ones given in the scenarios.

use crate::support::*;

const TA: &str = "tenantA";
const MX: &str = "modelX";

/// "replicas r-1..r-N": each holds its own 1-byte legacy key (0x01, 0x02, …) with 32 tokens and a
/// stats row without hit rate, under (tenant, modelX, vllm).
async fn setup_replicas(
    c: &mut pb::inference_cache_client::InferenceCacheClient<tonic::transport::Channel>,
    tenant: &str,
    n: u8,
) {
    let mut ups = Vec::new();
    for i in 1..=n {
        let mut u = legacy_update(&format!("r-{i}"), tenant, MX, "vllm", &[i], 32);
        u.stats = Some(pb::ReplicaStats {
            cache_memory_bytes: 1,
            ..Default::default()
        });
        ups.push(u);
    }
    assert!(report(c, ups).await.accepted);
}

/// C120: r-1..r-3; chain("prompt-block-1","prompt-block-2") [16,16] → AFFINITY_HINT [r-1]
/// (computed), all numeric fields 0; metric hint_used="true".
async fn c120_affinity_hint_on_chain_miss(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    setup_replicas(&mut c, TA, 3).await;
    let r = lookup(
        &mut c,
        chain_lookup(
            TA,
            MX,
            "vllm",
            &[b"prompt-block-1", b"prompt-block-2"],
            &[16, 16],
        ),
    )
    .await;
    assert_resp(&r, "AFFINITY_HINT", &[affinity("r-1")]);
    assert_eq!(r.adapter_id, "");
    assert!(r.token_ids.is_empty());
    assert_metric_line(
        &metrics_text(&srv),
        r#"inferencecache_lookup_route_calls_total{hint_used="true",model="modelX",reason_code="AFFINITY_HINT"} 1"#,
    );
}
shards_1_and_2!(c120_affinity_hint_on_chain_miss);

/// C121: empty index → NO_HINT; r-1 and a request with no fingerprint → NO_HINT (no seed);
/// r-1,r-2 with affinityRouting false, chain("block-A") → NO_HINT.
async fn c121_affinity_disabled_empty_or_unseeded_no_hint(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let r = lookup(&mut c, chain_lookup(TA, MX, "vllm", &[b"block-A"], &[16])).await;
    assert_resp(&r, "NO_HINT", &[]);

    setup_replicas(&mut c, TA, 1).await;
    let bare = pb::LookupRouteRequest {
        model_id: MX.into(),
        tenant_id: TA.into(),
        hash_scheme: "vllm".into(),
        ..Default::default()
    };
    let r = lookup(&mut c, bare).await;
    assert_resp(&r, "NO_HINT", &[]);
    // Control: with a fingerprint the same scope does yield the affinity pick.
    let r = lookup(&mut c, chain_lookup(TA, MX, "vllm", &[b"block-A"], &[16])).await;
    assert_resp(&r, "AFFINITY_HINT", &[affinity("r-1")]);

    setup_replicas(&mut c, TA, 2).await;
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"tenantA","affinityRouting":false}]}"#,
    );
    let r = lookup(&mut c, chain_lookup(TA, MX, "vllm", &[b"block-A"], &[16])).await;
    assert_resp(&r, "NO_HINT", &[]);
}
shards_1_and_2!(c121_affinity_disabled_empty_or_unseeded_no_hint);

/// C122: r-1..r-4, chain("identical-prompt-block") 11 times → the same pick every time (r-3,
/// computed), also over fresh connections; r-1,r-2 with chain("block") → r-1 with all zeros.
async fn c122_affinity_pick_stable_computed(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    setup_replicas(&mut c, TA, 4).await;
    setup_replicas(&mut c, "tenantB", 2).await;
    for i in 0..11 {
        let mut cl = if i % 3 == 0 {
            srv.client().await
        } else {
            c.clone()
        };
        let r = lookup(
            &mut cl,
            chain_lookup(TA, MX, "vllm", &[b"identical-prompt-block"], &[16]),
        )
        .await;
        assert_resp(&r, "AFFINITY_HINT", &[affinity("r-3")]);
    }
    let r = lookup(
        &mut c,
        chain_lookup("tenantB", MX, "vllm", &[b"block"], &[16]),
    )
    .await;
    assert_resp(&r, "AFFINITY_HINT", &[affinity("r-1")]);
}
shards_1_and_2!(c122_affinity_pick_stable_computed);

/// C124: min prefix 1024 (affinity on); r-vllm-1 holds "p"=64 under vllm; a sglang chain request
/// [8] → UNKNOWN_HASH_SCHEME (the diagnostic beats affinity and the min-prefix downgrade).
async fn c124_unknown_hash_scheme_beats_affinity(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"tenantA","minimumPrefixTokens":1024}]}"#,
    );
    let mut c = srv.client().await;
    assert!(
        report(
            &mut c,
            vec![legacy_update("r-vllm-1", TA, MX, "vllm", b"p", 64)]
        )
        .await
        .accepted
    );
    let r = lookup(
        &mut c,
        chain_lookup(TA, MX, "sglang", &[b"tiny-prompt"], &[8]),
    )
    .await;
    assert_resp(&r, "UNKNOWN_HASH_SCHEME", &[]);
}
shards_1_and_2!(c124_unknown_hash_scheme_beats_affinity);

/// C125: r-1 holds "deep"=64; min prefix 1024; request "deep" with prefix_token_count 1 → the
/// PREFIX_MATCH is downgraded (stage 0) → AFFINITY_HINT [r-1], all zeros.
async fn c125_min_prefix_downgrades_prefix_match_to_affinity(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"tenantA","minimumPrefixTokens":1024}]}"#,
    );
    let mut c = srv.client().await;
    assert!(
        report(
            &mut c,
            vec![legacy_update("r-1", TA, MX, "vllm", b"deep", 64)]
        )
        .await
        .accepted
    );
    let r = lookup(&mut c, exact_lookup(TA, MX, "vllm", b"deep", 1)).await;
    assert_resp(&r, "AFFINITY_HINT", &[affinity("r-1")]);
    // Control: at the threshold the prefix match is delivered.
    let r = lookup(&mut c, exact_lookup(TA, MX, "vllm", b"deep", 1024)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r-1", 64.0, 64, T1)]);
}
shards_1_and_2!(c125_min_prefix_downgrades_prefix_match_to_affinity);

/// C126: warm-r holds "warm-prefix"=256 with hit .9; min prefix 1024; request "novel-prefix"
/// with prefix_token_count 1 → AFFINITY_HINT [warm-r], never TENANT_HOT. Without the policy
/// (other tenant) the same request is TENANT_HOT.
async fn c126_min_prefix_downgrades_tenant_hot_to_affinity(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"tenantA","minimumPrefixTokens":1024}]}"#,
    );
    let mut c = srv.client().await;
    for t in [TA, "tenantZ"] {
        let mut u = legacy_update("warm-r", t, MX, "vllm", b"warm-prefix", 256);
        u.stats = stats(0.9, 0.0);
        u.timestamp_us = fresh_ts();
        assert!(report(&mut c, vec![u]).await.accepted);
    }
    let r = lookup(&mut c, exact_lookup(TA, MX, "vllm", b"novel-prefix", 1)).await;
    assert_resp(&r, "AFFINITY_HINT", &[affinity("warm-r")]);
    let r = lookup(
        &mut c,
        exact_lookup("tenantZ", MX, "vllm", b"novel-prefix", 1),
    )
    .await;
    assert_resp(&r, "TENANT_HOT", &[expp("warm-r", 0.9, 0, T_UNSPEC, 0.9)]);
}
shards_1_and_2!(c126_min_prefix_downgrades_tenant_hot_to_affinity);
