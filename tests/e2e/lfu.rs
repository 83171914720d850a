//! End-to-end conformance: LFU crediting through LookupRoute and the global cap (docs/BEHAVIOUR.md
//! §7.2–§7.4, §10.6; docs/CONFORMANCE.md C074, C076). The cap is set with the hidden flag
//! `--index-max-entries N`. No credit for discarded, downgraded or zero-token matches (§7.4).

use crate::support::*;

/// The `prefixCount` of (tenant, replica) in /snapshot, 0 when the row is absent.
fn prefix_count(snap: &serde_json::Value, tenant: &str, replica: &str) -> i64 {
    snap["replicas"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["replicaId"] == replica && r["tenant"].as_str().unwrap_or("") == tenant)
        .map(|r| r["prefixCount"].as_i64().unwrap_or(0))
        .unwrap_or(0)
}

/// C074: LFU tenant (floor 0 because a policy is installed), cap 1: "A"=32; three delivered
/// lookups credit A; ingesting "B" (newer, count 0) evicts B and keeps A. The scenario's
/// `lookupTimeoutMs: 5` is raised to 60 s: the budget plays no part in LFU crediting, and a 5 ms
/// budget made the outcome depend on machine load (a lookup past 5 ms answers TIMEOUT and is
/// not delivered, §7.4).
async fn c074_lfu_cap_evicts_uncredited_newcomer(shards: usize) {
    let srv = Server::start(shards, &["--index-max-entries", "1"]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"t","eviction":"lfu","lookupTimeoutMs":60000}]}"#,
    );
    let mut c = srv.client().await;
    let t0 = now_us();
    let mut a = legacy_update("r", "t", "m", "vllm", b"A", 32);
    a.timestamp_us = t0;
    assert!(report(&mut c, vec![a]).await.accepted);
    for _ in 0..3 {
        let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"A", 32)).await;
        assert_resp(&r, "PREFIX_MATCH", &[exp("r", 32.0, 32, T1)]);
    }
    let mut b = legacy_update("r", "t", "m", "vllm", b"B", 32);
    b.timestamp_us = t0 + 60_000_000;
    assert!(report(&mut c, vec![b]).await.accepted);

    let s = cache_state(&mut c, "t", "m").await;
    assert_eq!(s.summary.unwrap().total_prefixes, 1, "cap 1");
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"A", 32)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 32.0, 32, T1)]);
    // B is gone: exact miss, no stats → NONE → affinity on the only serving replica.
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"B", 32)).await;
    assert_resp(&r, "AFFINITY_HINT", &[affinity("r")]);
    assert_metric_line(
        &metrics_text(&srv),
        r#"inferencecache_index_evictions_total{algorithm="lfu",reason="cap"} 1"#,
    );
}
shards_1_and_2!(c074_lfu_cap_evicts_uncredited_newcomer);

/// Control for C074: the same sequence under LRU (no policy) evicts the older A.
async fn c074_lru_control_evicts_oldest(shards: usize) {
    let srv = Server::start(shards, &["--index-max-entries", "1"]);
    let mut c = srv.client().await;
    let t0 = now_us();
    let mut a = legacy_update("r", "t", "m", "vllm", b"A", 64);
    a.timestamp_us = t0;
    assert!(report(&mut c, vec![a]).await.accepted);
    for _ in 0..3 {
        let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"A", 64)).await;
        assert_resp(&r, "PREFIX_MATCH", &[exp("r", 64.0, 64, T1)]);
    }
    let mut b = legacy_update("r", "t", "m", "vllm", b"B", 64);
    b.timestamp_us = t0 + 60_000_000;
    assert!(report(&mut c, vec![b]).await.accepted);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"B", 64)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 64.0, 64, T1)]);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"A", 64)).await;
    assert_resp(&r, "AFFINITY_HINT", &[affinity("r")]);
    assert_metric_line(
        &metrics_text(&srv),
        r#"inferencecache_index_evictions_total{algorithm="lru",reason="cap"} 1"#,
    );
}
shards_1_and_2!(c074_lru_control_evicts_oldest);

/// C076: LFU with floor 64, cap 6: rB holds chain(b1,b2) at t0, rA holds chain(b1..b4) at
/// t0+1ms (16/block); three lookups chain(b1..b4) → PREFIX_MATCH [rA] only (rB's 32 < 64, so
/// rB's blocks are not credited); ingesting "filler"=32 at t0+1s → the victim is an uncredited
/// rB block (the oldest, b1), filler survives.
async fn c076_lfu_floor_pruned_replica_not_credited(shards: usize) {
    let srv = Server::start(shards, &["--index-max-entries", "6"]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"t","eviction":"lfu","minimumMatchedTokens":64}]}"#,
    );
    let mut c = srv.client().await;
    let t0 = now_us();
    let mut ub = chain_update("rB", "t", "m", "vllm", &[b"b1", b"b2"], &[16, 16]);
    ub.timestamp_us = t0;
    let mut ua = chain_update(
        "rA",
        "t",
        "m",
        "vllm",
        &[b"b1", b"b2", b"b3", b"b4"],
        &[16; 4],
    );
    ua.timestamp_us = t0 + 1_000;
    assert!(report(&mut c, vec![ub, ua]).await.accepted);
    for _ in 0..3 {
        let r = lookup(
            &mut c,
            chain_lookup("t", "m", "vllm", &[b"b1", b"b2", b"b3", b"b4"], &[16; 4]),
        )
        .await;
        // Depth-aware dp over total 2: rA ×0.5 → 32; rB (0) is removed by the floor.
        assert_resp(&r, "PREFIX_MATCH", &[exp("rA", 32.0, 64, T1)]);
    }
    let mut f = legacy_update("rF", "t", "m", "vllm", b"filler", 32);
    f.timestamp_us = t0 + 1_000_000;
    assert!(report(&mut c, vec![f]).await.accepted);

    let snap = snapshot_json(&srv);
    assert_eq!(prefix_count(&snap, "t", "rF"), 1, "filler survives: {snap}");
    assert_eq!(
        prefix_count(&snap, "t", "rA"),
        4,
        "rA's credited blocks stay: {snap}"
    );
    assert_eq!(
        prefix_count(&snap, "t", "rB"),
        1,
        "one rB block evicted: {snap}"
    );
    assert_eq!(snap["totalPrefixes"], 5, "{snap}");
    assert_metric_line(
        &metrics_text(&srv),
        r#"inferencecache_index_evictions_total{algorithm="lfu",reason="cap"} 1"#,
    );
    // The evicted rB block is b1 (same last_seen as b2, smaller prefix_hash): rB no longer
    // starts a run at b1, so with the floor lifted only rA matches chain(b1,b2).
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"t","eviction":"lfu"}]}"#,
    );
    let r = lookup(
        &mut c,
        chain_lookup("t", "m", "vllm", &[b"b1", b"b2"], &[16, 16]),
    )
    .await;
    // total = 3 serving replicas (rA, rB, rF); rA alone matched 32 → dp(1,3) = 2/3.
    assert_resp(&r, "PREFIX_MATCH", &[exp("rA", 32.0 * 2.0 / 3.0, 32, T1)]);
}
shards_1_and_2!(c076_lfu_floor_pruned_replica_not_credited);

/// Global cap across cores (§7.2): LRU, cap 2, models owned by different cores (m0, m1 with
/// `--shards 2`). A(m0,t0), B(m1,t0+1m), C(m0,t0+2m) → A evicted (oldest overall).
/// D(m0,t0+3m) → the global oldest B goes, although it lives on the other core than the
/// ingest (the victims are chosen across cores). The global total stays at the cap and two cap
/// evictions are counted.
async fn c074_cap_global_total_across_cores(shards: usize) {
    let srv = Server::start(shards, &["--index-max-entries", "2"]);
    let models = models_per_core("t", 2);
    let (m0, m1) = (models[0].as_str(), models[1].as_str());
    let mut c = srv.client().await;
    let t0 = now_us();
    let min = 60_000_000;
    for (i, (m, key)) in [(m0, b"A"), (m1, b"B"), (m0, b"C"), (m0, b"D")]
        .into_iter()
        .enumerate()
    {
        let mut u = legacy_update("r", "t", m, "vllm", key, 64);
        u.timestamp_us = t0 + i as i64 * min;
        assert!(report(&mut c, vec![u]).await.accepted);
        let total = cache_state(&mut c, "t", m0)
            .await
            .summary
            .unwrap()
            .total_prefixes
            + cache_state(&mut c, "t", m1)
                .await
                .summary
                .unwrap()
                .total_prefixes;
        assert!(total <= 2, "cap 2 exceeded after ingest {i}: {total}");
    }
    let has = |snap: &serde_json::Value| snap["totalPrefixes"].clone();
    let snap = snapshot_json(&srv);
    assert_eq!(has(&snap), 2, "{snap}");
    let mut present = Vec::new();
    for (m, key) in [(m0, b"A"), (m1, b"B"), (m0, b"C"), (m0, b"D")] {
        let r = lookup(&mut c, exact_lookup("t", m, "vllm", key, 64)).await;
        if r.reason_code == "PREFIX_MATCH" {
            present.push(String::from_utf8_lossy(key).to_string());
        }
    }
    // Any core count: the victims are chosen across cores, so the globally oldest go.
    let _ = shards;
    assert_eq!(present, ["C", "D"], "§7.2: the globally oldest entries go");
    assert_metric_line(
        &metrics_text(&srv),
        r#"inferencecache_index_evictions_total{algorithm="lru",reason="cap"} 2"#,
    );
}
shards_1_and_2!(c074_cap_global_total_across_cores);

// ---- §7.4 LFU credit rules -----------------------------------------------------------------------

/// §7.4: no credit when the routing floor discards the result, when the min-prefix stage 0
/// downgrades it, or (exact path) for an entry with token_count 0; a delivered match does credit
/// (control). Observed through the cap victim (cap 2: lowest count, then oldest, is evicted).
async fn s7_4_lfu_no_credit_on_discard_and_zero_token_entries(shards: usize) {
    for (policy, a_tokens, victim) in [
        (
            r#"{"namespace":"t","eviction":"lfu","routingFloorScore":1000,"affinityRouting":false}"#,
            32,
            "A",
        ),
        (
            r#"{"namespace":"t","eviction":"lfu","minimumPrefixTokens":100}"#,
            32,
            "A",
        ),
        (
            r#"{"namespace":"t","eviction":"lfu","routingFloorScore":0}"#,
            0,
            "A",
        ),
        (
            r#"{"namespace":"t","eviction":"lfu","routingFloorScore":0}"#,
            32,
            "B",
        ),
    ] {
        let srv = Server::start(shards, &["--index-max-entries", "2"]);
        install_policy(&srv, &format!(r#"{{"version":7,"policies":[{policy}]}}"#));
        let mut c = srv.client().await;
        let t0 = now_us();
        let mut a = legacy_update("r", "t", "m", "vllm", b"A", a_tokens);
        a.timestamp_us = t0;
        let mut b = legacy_update("r", "t", "m", "vllm", b"B", 32);
        b.timestamp_us = t0 + 1_000_000;
        assert!(report(&mut c, vec![a, b]).await.accepted);
        for _ in 0..3 {
            let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"A", 32)).await;
            assert_ne!(r.reason_code, "TIMEOUT", "{r:?}");
        }
        let mut n = legacy_update("r", "t", "m", "vllm", b"N", 32);
        n.timestamp_us = t0 + 2_000_000;
        assert!(report(&mut c, vec![n]).await.accepted);
        assert_eq!(total_prefixes(&mut c, "t", "m").await, 2);
        install_policy(
            &srv,
            r#"{"version":7,"policies":[{"namespace":"t","routingFloorScore":0}]}"#,
        );
        for h in ["A", "B", "N"] {
            let r = lookup(&mut c, exact_lookup("t", "m", "vllm", h.as_bytes(), 32)).await;
            let present = r.reason_code == "PREFIX_MATCH";
            assert_eq!(
                present,
                h != victim,
                "policy {policy}: key {h} present={present}, expected victim {victim}; {r:?}"
            );
        }
    }
}
shards_1_and_2!(s7_4_lfu_no_credit_on_discard_and_zero_token_entries);
