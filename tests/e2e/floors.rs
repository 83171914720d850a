//! End-to-end conformance: result-side floors (docs/BEHAVIOUR.md §10.6 stages 1–2, §12.4;
//! docs/CONFORMANCE.md C104–C109).

use crate::support::*;

/// C104: no policy (floor 64, inclusive): single replica "p"=64 → PREFIX_MATCH matched 64.
/// Just below the floor ("q"=63) the only score is dropped → NONE → AFFINITY_HINT on the only
/// serving replica (seed = raw "q").
async fn c104_matched_floor_inclusive(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let mut u = legacy_update("r", "t", "m", "vllm", b"p", 64);
    u.prefixes.push(pb::PrefixEntry {
        prefix_hash: b"q".to_vec(),
        token_count: 63,
        ..Default::default()
    });
    assert!(report(&mut c, vec![u]).await.accepted);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"p", 64)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 64.0, 64, T1)]);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"q", 63)).await;
    assert_resp(&r, "AFFINITY_HINT", &[affinity("r")]);
}
shards_1_and_2!(c104_matched_floor_inclusive);

/// C105: installed policy with minimumMatchedTokens 256 (affinity off): "p"=100 → NO_HINT.
/// An installed policy without the field has floor 0: "p"=1 → PREFIX_MATCH matched 1.
async fn c105_policy_matched_floor_and_absent_field(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[
            {"namespace":"team-strict","minimumMatchedTokens":256,"affinityRouting":false},
            {"namespace":"raw-recall"}]}"#,
    );
    let mut c = srv.client().await;
    assert!(
        report(
            &mut c,
            vec![
                legacy_update("r", "team-strict", "m", "vllm", b"p", 100),
                legacy_update("r", "raw-recall", "m", "vllm", b"p", 1),
            ]
        )
        .await
        .accepted
    );
    let r = lookup(&mut c, exact_lookup("team-strict", "m", "vllm", b"p", 100)).await;
    assert_resp(&r, "NO_HINT", &[]);
    let r = lookup(&mut c, exact_lookup("raw-recall", "m", "vllm", b"p", 1)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 1.0, 1, T1)]);
}
shards_1_and_2!(c105_policy_matched_floor_and_absent_field);

/// C106: floor 64 keeps the deep replica only: A holds chain(b1..b4), B holds chain(b1) (16 per
/// block); lookup chain(b1..b4) → PREFIX_MATCH exactly [A] matched 64. Depth-aware dp (§9.5):
/// A's group (right = 1 of total 2) → ×0.5 → score 32.
async fn c106_matched_floor_keeps_deep_replica(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"mixed-warmth","minimumMatchedTokens":64}]}"#,
    );
    let mut c = srv.client().await;
    let t = "mixed-warmth";
    assert!(
        report(
            &mut c,
            vec![
                chain_update("A", t, "m", "vllm", &[b"b1", b"b2", b"b3", b"b4"], &[16; 4]),
                chain_update("B", t, "m", "vllm", &[b"b1"], &[16]),
            ]
        )
        .await
        .accepted
    );
    let r = lookup(
        &mut c,
        chain_lookup(t, "m", "vllm", &[b"b1", b"b2", b"b3", b"b4"], &[16; 4]),
    )
    .await;
    assert_resp(&r, "PREFIX_MATCH", &[expp("A", 32.0, 64, T1, 1.0)]);
}
shards_1_and_2!(c106_matched_floor_keeps_deep_replica);

/// C108: no policy: r0 holds "unique"=64, r1,r2 hold "other" → PREFIX_MATCH [r0] ≈42.67
/// (64 × 2/3). Policy routingFloorScore 100 (affinity off), same data → NO_HINT.
async fn c108_routing_floor_score(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"strict","routingFloorScore":100,"affinityRouting":false}]}"#,
    );
    let mut c = srv.client().await;
    for t in ["t", "strict"] {
        assert!(
            report(
                &mut c,
                vec![
                    legacy_update("r0", t, "m", "vllm", b"unique", 64),
                    legacy_update("r1", t, "m", "vllm", b"other", 64),
                    legacy_update("r2", t, "m", "vllm", b"other", 64),
                ]
            )
            .await
            .accepted
        );
    }
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"unique", 64)).await;
    assert_resp(
        &r,
        "PREFIX_MATCH",
        &[expp("r0", 64.0 * 2.0 / 3.0, 64, T1, 1.0)],
    );
    let r = lookup(&mut c, exact_lookup("strict", "m", "vllm", b"unique", 64)).await;
    assert_resp(&r, "NO_HINT", &[]);
}
shards_1_and_2!(c108_routing_floor_score);

/// C109: routingFloorScore 0: r0,r1,r2 all hold "chat"=16 → dp 0 → PREFIX_MATCH with three
/// zero-score replicas in id order. Single replica "p"=64 without policy → PREFIX_MATCH.
async fn c109_zero_score_replicas_kept(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"raw","routingFloorScore":0}]}"#,
    );
    let mut c = srv.client().await;
    assert!(
        report(
            &mut c,
            vec![
                legacy_update("r2", "raw", "m", "vllm", b"chat", 16),
                legacy_update("r0", "raw", "m", "vllm", b"chat", 16),
                legacy_update("r1", "raw", "m", "vllm", b"chat", 16),
                legacy_update("r", "t", "m", "vllm", b"p", 64),
            ]
        )
        .await
        .accepted
    );
    let r = lookup(&mut c, exact_lookup("raw", "m", "vllm", b"chat", 16)).await;
    assert_resp(
        &r,
        "PREFIX_MATCH",
        &[
            expp("r0", 0.0, 16, T1, 1.0),
            expp("r1", 0.0, 16, T1, 1.0),
            expp("r2", 0.0, 16, T1, 1.0),
        ],
    );
    let m = metrics_text(&srv);
    assert_metric_line(
        &m,
        r#"inferencecache_lookup_route_calls_total{hint_used="true",model="m",reason_code="PREFIX_MATCH"} 1"#,
    );
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"p", 64)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 64.0, 64, T1)]);
}
shards_1_and_2!(c109_zero_score_replicas_kept);
