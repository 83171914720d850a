//! Ingest and event semantics over gRPC (docs/BEHAVIOUR.md §4, §5, §19.12–§19.14): producer
//! timestamps, REPLICA_UPDATED and PREFIX_EVICTED as LookupRoute observes them.

use crate::support::*;

const MIN_US: i64 = 60_000_000;

// ---- §19.12 producer timestamps -----------------------------------------------------------------

async fn s19_12_producer_timestamps_trusted_and_backwards(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let now = now_us();
    let mut a = legacy_update("r", "t", "m", "vllm", b"p", 100);
    a.timestamp_us = now;
    let mut back = a.clone();
    back.timestamp_us = now - 15 * MIN_US;
    assert!(report(&mut c, vec![a, back]).await.accepted);
    // last_seen moved backwards: freshness ≈ 0.5 (TTL 30 min).
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"p", 100)).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH", "{r:?}");
    let p = r.replica_scores[0].estimated_cache_hit_prob;
    assert!(
        (p - 0.5).abs() < 0.01,
        "freshness after backwards re-ingest: {p}"
    );
    // Future timestamp → freshness 1.
    let mut fut = legacy_update("r", "t", "m", "vllm", b"f", 100);
    fut.timestamp_us = now + 60 * MIN_US;
    // Already stale on arrival.
    let mut old = legacy_update("r", "t", "m", "vllm", b"old", 100);
    old.timestamp_us = now - 31 * MIN_US;
    assert!(report(&mut c, vec![fut, old]).await.accepted);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"f", 100)).await;
    assert_resp(&r, "PREFIX_MATCH", &[expp("r", 100.0, 100, T1, 1.0)]);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"old", 100)).await;
    assert_resp(&r, "AFFINITY_HINT", &[affinity("r")]);
    let s = cache_state(&mut c, "t", "m").await;
    assert_eq!(
        s.summary.unwrap().total_prefixes,
        3,
        "stale entry stays until the sweep"
    );
    // A negative timestamp is trusted verbatim (stale, but indexed).
    let mut neg = legacy_update("r", "t", "m", "vllm", b"neg", 100);
    neg.timestamp_us = -5;
    assert!(report(&mut c, vec![neg]).await.accepted);
    let s = cache_state(&mut c, "t", "m").await;
    assert_eq!(s.summary.unwrap().total_prefixes, 4);
}
shards_1_and_2!(s19_12_producer_timestamps_trusted_and_backwards);

// ---- §19.13 REPLICA_UPDATED ------------------------------------------------------------------

async fn s19_13_replica_updated_is_not_fresh_stats(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"t","evictionTTL":600000000000}]}"#,
    );
    let mut c = srv.client().await;
    let now = now_us();
    // Stats 6 min old (beyond TENANT_HOT's 5 min) with hit .9, pressure .9.
    let mut s = pb::CacheStateUpdate {
        replica_id: "r".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        hash_scheme: "vllm".into(),
        timestamp_us: now - 6 * MIN_US,
        stats: stats(0.9, 0.9),
        ..Default::default()
    };
    // The entry stays exactly fresh for the whole test (evictionTTL 10 min would otherwise
    // decay its score past the 1e-3 tolerance within 0.6 s of a loaded machine).
    let mut p = legacy_update("r", "t", "m", "vllm", b"p", 100);
    p.timestamp_us = fresh_ts();
    assert!(report(&mut c, vec![s.clone(), p]).await.accepted);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"novel", 100)).await;
    assert_resp(&r, "AFFINITY_HINT", &[affinity("r")]);
    publish_event(
        &mut c,
        cache_event(
            pb::cache_event::Type::ReplicaUpdated,
            "t",
            "m",
            "r",
            b"",
            "whatever",
        ),
    )
    .await;
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"novel", 100)).await;
    assert_resp(&r, "AFFINITY_HINT", &[affinity("r")]);
    // Stats payload 11 min old (TTL 10 min): pressure ignored on the prefix path, also after a
    // REPLICA_UPDATED refreshed liveness.
    s.timestamp_us = now - 11 * MIN_US;
    assert!(report(&mut c, vec![s.clone()]).await.accepted);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"p", 100)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 100.0, 100, T1)]);
    publish_event(
        &mut c,
        cache_event(
            pb::cache_event::Type::ReplicaUpdated,
            "t",
            "m",
            "r",
            b"",
            "",
        ),
    )
    .await;
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"p", 100)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 100.0, 100, T1)]);
    let st = cache_state(&mut c, "t", "m").await;
    assert_eq!(st.replicas.len(), 1);
    // Fresh stats: pressure applies (score 10) and TENANT_HOT appears.
    s.timestamp_us = fresh_ts();
    assert!(report(&mut c, vec![s]).await.accepted);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"p", 100)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 10.0, 100, T1)]);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"novel", 100)).await;
    assert_resp(&r, "TENANT_HOT", &[expp("r", 0.9 * 0.1, 0, T_UNSPEC, 0.9)]);
    // REPLICA_UPDATED for an unknown replica / PREFIX_ADDED: no effect, Ack.
    publish_event(
        &mut c,
        cache_event(
            pb::cache_event::Type::ReplicaUpdated,
            "t",
            "m",
            "ghost",
            b"",
            "",
        ),
    )
    .await;
    publish_event(
        &mut c,
        cache_event(pb::cache_event::Type::PrefixAdded, "t", "m", "r", b"zz", ""),
    )
    .await;
    let mut unknown = cache_event(pb::cache_event::Type::AllCleared, "t", "m", "r", b"", "");
    unknown.r#type = 99;
    publish_event(&mut c, unknown).await;
    let st = cache_state(&mut c, "t", "m").await;
    assert_eq!(st.replicas.len(), 1);
    assert_eq!(st.summary.unwrap().total_prefixes, 1);
}
shards_1_and_2!(s19_13_replica_updated_is_not_fresh_stats);

// ---- §19.14 PREFIX_EVICTED across schemes with adapter narrowing --------------------------------

async fn s19_14_prefix_evicted_any_scheme_adapter_narrowing(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(&srv, r#"{"version":7,"policies":[{"namespace":"t"}]}"#);
    let mut c = srv.client().await;
    let mk = |rep: &str, scheme: &str, adapter: &str| {
        let mut u = legacy_update(rep, "t", "m", scheme, b"p", 64);
        u.adapter_id = adapter.into();
        u
    };
    assert!(
        report(
            &mut c,
            vec![
                mk("r", "vllm", ""),
                mk("r", "vllm", "a1"),
                mk("r", "sglang", "a2"),
                mk("r2", "vllm", ""),
                legacy_update("r", "t", "m", "vllm", b"keep", 64),
            ]
        )
        .await
        .accepted
    );
    let q = |scheme: &str, adapter: &str| {
        with_adapter(exact_lookup("t", "m", scheme, b"p", 64), adapter)
    };
    assert_eq!(total_prefixes(&mut c, "t", "m").await, 4);
    // Adapter a1 only.
    publish_event(
        &mut c,
        cache_event(
            pb::cache_event::Type::PrefixEvicted,
            "t",
            "m",
            "r",
            b"p",
            "a1",
        ),
    )
    .await;
    assert_eq!(total_prefixes(&mut c, "t", "m").await, 3);
    let r = lookup(&mut c, q("vllm", "a1")).await;
    assert_ne!(r.reason_code, "PREFIX_MATCH", "{r:?}");
    let r = lookup(&mut c, q("sglang", "a2")).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 64.0, 64, T1)]);
    // Unknown adapter: no-op.
    publish_event(
        &mut c,
        cache_event(
            pb::cache_event::Type::PrefixEvicted,
            "t",
            "m",
            "r",
            b"p",
            "never",
        ),
    )
    .await;
    assert_eq!(total_prefixes(&mut c, "t", "m").await, 3);
    // Empty adapter: every partition, every scheme; r2 and other keys untouched.
    publish_event(
        &mut c,
        cache_event(
            pb::cache_event::Type::PrefixEvicted,
            "t",
            "m",
            "r",
            b"p",
            "",
        ),
    )
    .await;
    assert_eq!(total_prefixes(&mut c, "t", "m").await, 2);
    let r = lookup(&mut c, q("sglang", "a2")).await;
    assert_resp(&r, "UNKNOWN_HASH_SCHEME", &[]);
    let r = lookup(&mut c, q("vllm", "")).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r2", 32.0, 64, T1)]);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"keep", 64)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 32.0, 64, T1)]);
}
shards_1_and_2!(s19_14_prefix_evicted_any_scheme_adapter_narrowing);
