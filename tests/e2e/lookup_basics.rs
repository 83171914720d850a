//! End-to-end conformance over gRPC against the real binary: LookupRoute basics, diagnostics,
//! the probe tenant, other RPCs, the entries gauge under concurrency and cross-core routing
//! (docs/BEHAVIOUR.md §4, §8, §10, §11, §16; docs/CONFORMANCE.md C033, C089, C092–C102); the
//! empty prefix_hash key (§19.11), zero/negative chain counts (§8.3), pressure above 1 (§19.17),
//! adapter echo and hint_used on every exit (§10.4, §16) and empty tenant/model buckets (§11).

use std::time::{Duration, Instant};

use crate::support::*;

const PROBE: &str = "inferencecache.io/probe";

/// C033: no policy, single replica "p"=128: no SLO → 128; tight SLO (ttft 50) → 256.
/// Ingested with a future timestamp so freshness is exactly 1 (§6, §19.12) and the scores are
/// exact; a second replica-less check with a "now" timestamp uses the 1e-3 tolerance.
async fn c033_slo_tight_doubles_score(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let mut u = legacy_update("r", "t", "m", "vllm", b"p", 128);
    u.timestamp_us = now_us() + 600_000_000; // +10 min: age ≤ 0 → freshness 1
    assert!(report(&mut c, vec![u]).await.accepted);

    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"p", 128)).await;
    assert_resp(&r, "PREFIX_MATCH", &[expp("r", 128.0, 128, T1, 1.0)]);
    assert_eq!(r.replica_scores[0].score, 128.0, "exact score without SLO");

    for (ttft, want) in [
        (50, 256.0f32),
        (199, 256.0),
        (200, 128.0),
        (0, 128.0),
        (-5, 128.0),
    ] {
        let mut req = exact_lookup("t", "m", "vllm", b"p", 128);
        req.slo = Some(pb::Slo {
            ttft_ms: ttft,
            tbt_ms: 1,
        });
        let r = lookup(&mut c, req).await;
        assert_resp(&r, "PREFIX_MATCH", &[expp("r", want, 128, T1, 1.0)]);
        assert_eq!(
            r.replica_scores[0].score, want,
            "exact score with ttft_ms {ttft}"
        );
    }

    // Same with a "now" timestamp (freshness just below 1): ≈128 / ≈256.
    assert!(
        report(
            &mut c,
            vec![legacy_update("r", "t", "m2", "vllm", b"p", 128)]
        )
        .await
        .accepted
    );
    let r = lookup(&mut c, exact_lookup("t", "m2", "vllm", b"p", 128)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 128.0, 128, T1)]);
    let mut req = exact_lookup("t", "m2", "vllm", b"p", 128);
    req.slo = Some(pb::Slo {
        ttft_ms: 50,
        tbt_ms: 0,
    });
    let r = lookup(&mut c, req).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 256.0, 128, T1)]);
}
shards_1_and_2!(c033_slo_tight_doubles_score);

/// C092: no policy; r1 holds "p"=128 → PREFIX_MATCH [r1], tier T1.
async fn c092_prefix_match_no_policy(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    assert!(
        report(
            &mut c,
            vec![legacy_update("r1", "t", "m", "vllm", b"p", 128)]
        )
        .await
        .accepted
    );
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"p", 128)).await;
    assert_resp(&r, "PREFIX_MATCH", &[expp("r1", 128.0, 128, T1, 1.0)]);
    assert!(r.token_ids.is_empty(), "no token echo: {r:?}");
    assert_eq!(r.adapter_id, "");
    let m = metrics_text(&srv);
    assert_metric_line(
        &m,
        r#"inferencecache_lookup_route_calls_total{hint_used="true",model="m",reason_code="PREFIX_MATCH"} 1"#,
    );
}
shards_1_and_2!(c092_prefix_match_no_policy);

/// C093: no policy; warm holds "other"=1 with hit .8; lookup "novel" → TENANT_HOT [warm],
/// matched 0, tier UNSPECIFIED, score ≈ 0.8 (hit × recency≈1), prob 0.8. TENANT_HOT is
/// adapter-blind (§21.13): the same lookup under an unseen adapter is TENANT_HOT too and echoes
/// the request adapter_id (§10.4).
async fn c093_tenant_hot_warm_replica(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let mut u = legacy_update("warm", "t", "m", "vllm", b"other", 1);
    u.stats = stats(0.8, 0.0);
    u.timestamp_us = fresh_ts();
    assert!(report(&mut c, vec![u]).await.accepted);

    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"novel", 128)).await;
    assert_resp(&r, "TENANT_HOT", &[expp("warm", 0.8, 0, T_UNSPEC, 0.8)]);
    assert_eq!(r.adapter_id, "");

    let mut req = exact_lookup("t", "m", "vllm", b"novel", 128);
    req.adapter_id = "lora-z".into();
    let r = lookup(&mut c, req).await;
    assert_resp(&r, "TENANT_HOT", &[expp("warm", 0.8, 0, T_UNSPEC, 0.8)]);
    assert_eq!(r.adapter_id, "lora-z", "adapter echo on TENANT_HOT");

    // Pressure and the hit-rate threshold (§8.4): warm2 (hit .7, pressure .1) → 0.63; cold
    // (hit 0.05 < 0.1) is excluded; edge (hit exactly 0.1, inclusive) → 0.1.
    for (rid, hit, pressure) in [
        ("warm2", 0.7f32, 0.1f32),
        ("cold", 0.05, 0.0),
        ("edge", 0.1, 0.0),
    ] {
        let mut u = legacy_update(rid, "t2", "m", "vllm", b"other", 1);
        u.stats = stats(hit, pressure);
        u.timestamp_us = fresh_ts();
        assert!(report(&mut c, vec![u]).await.accepted);
    }
    let r = lookup(&mut c, exact_lookup("t2", "m", "vllm", b"novel", 128)).await;
    assert_resp(
        &r,
        "TENANT_HOT",
        &[
            expp("warm2", 0.63, 0, T_UNSPEC, 0.7),
            expp("edge", 0.1, 0, T_UNSPEC, 0.1),
        ],
    );
}
shards_1_and_2!(c093_tenant_hot_warm_replica);

/// C094: wire tier at ingest → tier on lookup: 1→T1, 2→T2, 0→T1, 99→UNSPECIFIED, −1→UNSPECIFIED
/// (and 3→T3).
async fn c094_wire_tier_round_trip(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let cases: [(&[u8], i32, i32); 6] = [
        (b"k-t1", 1, T1),
        (b"k-t2", 2, T2),
        (b"k-t3", 3, T3),
        (b"k-t0", 0, T1),
        (b"k-t99", 99, T_UNSPEC),
        (b"k-neg", -1, T_UNSPEC),
    ];
    let mut u = legacy_update("r", "t", "m", "vllm", b"unused", 128);
    u.prefixes = cases
        .iter()
        .map(|(h, wire, _)| pb::PrefixEntry {
            prefix_hash: h.to_vec(),
            token_count: 128,
            tier: *wire,
            ..Default::default()
        })
        .collect();
    assert!(report(&mut c, vec![u]).await.accepted);
    for (h, wire, want) in cases {
        let r = lookup(&mut c, exact_lookup("t", "m", "vllm", h, 128)).await;
        assert_resp(&r, "PREFIX_MATCH", &[exp("r", 128.0, 128, want)]);
        let _ = wire;
    }
}
shards_1_and_2!(c094_wire_tier_round_trip);

/// C096: ReportCacheState then LookupRoute over gRPC; the other scheme → UNKNOWN_HASH_SCHEME.
async fn c096_report_then_lookup_over_grpc(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let ack = report(
        &mut c,
        vec![legacy_update(
            "replica-a",
            "tenant-a",
            "llama-3-8b",
            "vllm",
            b"prefix-hash-bytes",
            128,
        )],
    )
    .await;
    assert!(ack.accepted);
    assert_eq!(ack.reason_code, "");
    let r = lookup(
        &mut c,
        exact_lookup("tenant-a", "llama-3-8b", "vllm", b"prefix-hash-bytes", 128),
    )
    .await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("replica-a", 128.0, 128, T1)]);
    let r = lookup(
        &mut c,
        exact_lookup(
            "tenant-a",
            "llama-3-8b",
            "sglang",
            b"prefix-hash-bytes",
            128,
        ),
    )
    .await;
    assert_resp(&r, "UNKNOWN_HASH_SCHEME", &[]);
}
shards_1_and_2!(c096_report_then_lookup_over_grpc);

/// C097: chain(b1,b2,b3) 64/block ingested; lookup chain(b1,b2,b3,x4,x5) → matched 192.
async fn c097_chain_longest_run_over_grpc(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let u = chain_update(
        "replica-a",
        "t",
        "m",
        "vllm",
        &[b"b1", b"b2", b"b3"],
        &[64, 64, 64],
    );
    assert!(report(&mut c, vec![u]).await.accepted);
    let r = lookup(
        &mut c,
        chain_lookup(
            "t",
            "m",
            "vllm",
            &[b"b1", b"b2", b"b3", b"x4", b"x5"],
            &[64; 5],
        ),
    )
    .await;
    assert_resp(
        &r,
        "PREFIX_MATCH",
        &[expp("replica-a", 192.0, 192, T1, 1.0)],
    );

    // matched_tokens is the sum of the *request's* counts over the run (§8.3, §19.4).
    let r = lookup(
        &mut c,
        chain_lookup(
            "t",
            "m",
            "vllm",
            &[b"b1", b"b2", b"b3", b"x4"],
            &[30, 30, 30, 30],
        ),
    )
    .await;
    assert_resp(&r, "PREFIX_MATCH", &[expp("replica-a", 90.0, 90, T1, 1.0)]);
    // Coldest tier of the run (§8.3): b1 T1, b2 T3, b3 T2 held by replica-b.
    let mut u = chain_update("replica-b", "t", "m2", "vllm", &[b"b1"], &[64]);
    u.prefixes.push(pb::PrefixEntry {
        block_hashes: vec![b"b2".to_vec()],
        block_token_counts: vec![64],
        tier: T3,
        ..Default::default()
    });
    u.prefixes.push(pb::PrefixEntry {
        block_hashes: vec![b"b3".to_vec()],
        block_token_counts: vec![64],
        tier: T2,
        ..Default::default()
    });
    assert!(report(&mut c, vec![u]).await.accepted);
    let r = lookup(
        &mut c,
        chain_lookup("t", "m2", "vllm", &[b"b1", b"b2", b"b3"], &[64; 3]),
    )
    .await;
    assert_resp(
        &r,
        "PREFIX_MATCH",
        &[expp("replica-b", 192.0, 192, T3, 1.0)],
    );
}
shards_1_and_2!(c097_chain_longest_run_over_grpc);

/// C098: diagnostics through the handler, plus their metric series on the public /metrics.
async fn c098_diagnostics_and_metric_series(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    assert!(
        report(
            &mut c,
            vec![legacy_update("r", "ic-smoke", "m", "vllm", b"p", 10)]
        )
        .await
        .accepted
    );
    let r = lookup(&mut c, exact_lookup("default", "m", "vllm", b"p", 10)).await;
    assert_resp(&r, "UNKNOWN_TENANT", &[]);
    let r = lookup(&mut c, exact_lookup("ic-smoke", "other", "vllm", b"p", 10)).await;
    assert_resp(&r, "UNKNOWN_MODEL", &[]);
    let r = lookup(&mut c, exact_lookup("ic-smoke", "m", "vllm-v1", b"p", 10)).await;
    assert_resp(&r, "UNKNOWN_HASH_SCHEME", &[]);

    let m = metrics_text(&srv);
    for line in [
        r#"inferencecache_lookup_route_calls_total{hint_used="false",model="m",reason_code="UNKNOWN_TENANT"} 1"#,
        r#"inferencecache_lookup_route_calls_total{hint_used="false",model="other",reason_code="UNKNOWN_MODEL"} 1"#,
        r#"inferencecache_lookup_route_calls_total{hint_used="false",model="m",reason_code="UNKNOWN_HASH_SCHEME"} 1"#,
    ] {
        assert_metric_line(&m, line);
    }
    assert_eq!(
        metric_value(
            &m,
            r#"inferencecache_lookup_route_latency_seconds_count{model="m"}"#
        ),
        Some(2.0),
        "two LookupRoute observations for model m"
    );
}
shards_1_and_2!(c098_diagnostics_and_metric_series);

/// C098 (cross-core): the miss classifier is global (§8.5) — with the data on one core, lookups
/// whose (tenant, model) partition lives on the other core still classify by the global index:
/// unknown tenant → UNKNOWN_TENANT (not the cold-start NO_HINT), known tenant + other model →
/// UNKNOWN_MODEL, known scope + other scheme → UNKNOWN_HASH_SCHEME.
async fn c098_diagnostics_cross_core(shards: usize) {
    let srv = Server::start(shards, &[]);
    let models = models_per_core("ic-smoke", 2); // one model per core (both on core 0 with 1 shard)
    let (data_model, other_model) = (&models[0], &models[1]);
    // An unknown tenant whose partition for `data_model` is on the other core than the data.
    let unknown = tenants_per_core("default", data_model, 2)[1].clone();
    let mut a = srv.client().await;
    assert!(
        report(
            &mut a,
            vec![legacy_update("r", "ic-smoke", data_model, "vllm", b"p", 10)]
        )
        .await
        .accepted
    );
    for _ in 0..3 {
        let mut b = srv.client().await;
        let r = lookup(&mut b, exact_lookup(&unknown, data_model, "vllm", b"p", 10)).await;
        assert_resp(&r, "UNKNOWN_TENANT", &[]);
        let r = lookup(
            &mut b,
            exact_lookup("ic-smoke", other_model, "vllm", b"p", 10),
        )
        .await;
        assert_resp(&r, "UNKNOWN_MODEL", &[]);
        let r = lookup(
            &mut b,
            exact_lookup("ic-smoke", data_model, "sglang", b"p", 10),
        )
        .await;
        assert_resp(&r, "UNKNOWN_HASH_SCHEME", &[]);
        // Index-derived answers echo the request adapter_id (§10.4, §21.3).
        let mut req = exact_lookup(&unknown, data_model, "vllm", b"p", 10);
        req.adapter_id = "lora-u".into();
        let r = lookup(&mut b, req).await;
        assert_resp(&r, "UNKNOWN_TENANT", &[]);
        assert_eq!(r.adapter_id, "lora-u");
        let mut req = exact_lookup("ic-smoke", other_model, "vllm", b"p", 10);
        req.adapter_id = "lora-u".into();
        let r = lookup(&mut b, req).await;
        assert_resp(&r, "UNKNOWN_MODEL", &[]);
        assert_eq!(r.adapter_id, "lora-u");
    }
}
shards_1_and_2!(c098_diagnostics_cross_core);

/// C100: the probe tenant short-circuits LookupRoute (NO_HINT, no scores, latency 0, adapter ""),
/// one metric observation with latency 0; GetCacheState for it is empty. A real /probe run
/// (which writes and clears probe-tenant entries) precedes the lookups.
async fn c100_probe_tenant_lookup_no_hint(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    assert!(
        report(
            &mut c,
            vec![legacy_update("r", "t", "m", "vllm", b"p", 128)]
        )
        .await
        .accepted
    );
    let (st, body) = http_request(
        srv.admin_port,
        "POST",
        "/probe",
        &[("Content-Type", "application/json")],
        br#"{"backend":"cb","model":"m","hashScheme":"vllm"}"#,
    )
    .unwrap();
    assert_eq!(st, 200, "/probe: {body}");

    let mut req = exact_lookup(PROBE, "m", "vllm", b"p", 128);
    req.adapter_id = "lora".into();
    let r = lookup(&mut c, req).await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.lookup_latency_us, 0, "probe short-circuit latency");
    assert_eq!(
        r.adapter_id, "",
        "no adapter echo on the probe short-circuit"
    );
    assert!(r.token_ids.is_empty());

    let m = metrics_text(&srv);
    assert_metric_line(
        &m,
        r#"inferencecache_lookup_route_calls_total{hint_used="false",model="m",reason_code="NO_HINT"} 1"#,
    );
    assert_eq!(
        metric_value(
            &m,
            r#"inferencecache_lookup_route_latency_seconds_count{model="m"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        metric_value(
            &m,
            r#"inferencecache_lookup_route_latency_seconds_sum{model="m"}"#
        ),
        Some(0.0),
        "the probe short-circuit observes latency 0"
    );

    let s = cache_state(&mut c, PROBE, "m").await;
    assert!(s.replicas.is_empty(), "{s:?}");
    let sum = s.summary.expect("summary present");
    assert_eq!((sum.total_prefixes, sum.hot_prefixes), (0, 0));
}
shards_1_and_2!(c100_probe_tenant_lookup_no_hint);

/// C101: ReportCacheState for the probe tenant is dropped (Ack accepted) — the index stays
/// empty, so a real lookup still sees the cold-start NO_HINT (the carve-out counts reserved
/// entries, §8.5); PublishEvent ALL_CLEARED for the probe tenant → Ack, state untouched.
async fn c101_probe_tenant_ingest_and_event_dropped(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let mut u = legacy_update("r", PROBE, "m", "vllm", b"p", 128);
    u.stats = stats(0.9, 0.0);
    let ack = report(&mut c, vec![u]).await;
    assert!(ack.accepted);
    assert_eq!(ack.reason_code, "");
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"p", 128)).await;
    assert_resp(&r, "NO_HINT", &[]);
    let snap = snapshot_json(&srv);
    assert_eq!(snap["totalPrefixes"], 0, "{snap}");

    // Real data, then a probe-tenant ALL_CLEARED for the same replica/model: nothing changes.
    let mut u = legacy_update("r", "t", "m", "vllm", b"p", 128);
    u.stats = stats(0.5, 0.0);
    assert!(report(&mut c, vec![u]).await.accepted);
    let ack = c
        .publish_event(pb::CacheEvent {
            r#type: pb::cache_event::Type::AllCleared as i32,
            replica_id: "r".into(),
            model_id: "m".into(),
            tenant_id: PROBE.into(),
            ..Default::default()
        })
        .await
        .expect("PublishEvent")
        .into_inner();
    assert!(ack.accepted);
    assert_eq!(ack.reason_code, "");
    let s = cache_state(&mut c, "t", "m").await;
    assert_eq!(s.summary.unwrap().total_prefixes, 1);
    assert_eq!(s.replicas.len(), 1);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"p", 128)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 128.0, 128, T1)]);
}
shards_1_and_2!(c101_probe_tenant_ingest_and_event_dropped);

/// C102: GetCacheState values; id-only updates are accepted; each streamed message is applied
/// as it arrives and a client-cancelled stream fails without an Ack while what was applied stays;
/// LookupPDRoute → NO_HINT; RenderTemplate → OK.
async fn c102_cache_state_and_stub_rpcs(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let mut u = legacy_update("replica-a", "t", "m", "vllm", b"p", 10);
    u.stats = Some(pb::ReplicaStats {
        replica_id: "ignored".into(),
        cache_memory_bytes: 2048,
        hit_rate: 0.5,
        pressure: 0.0,
        client_version: "lmcache==0.4.2".into(),
        t2_hit_tokens: 600,
        t2_query_tokens: 1000,
    });
    assert!(report(&mut c, vec![u]).await.accepted);
    let s = cache_state(&mut c, "t", "m").await;
    let sum = s.summary.expect("summary");
    assert_eq!((sum.total_prefixes, sum.hot_prefixes), (1, 0), "{s:?}");
    assert_eq!(
        s.replicas,
        vec![pb::ReplicaStats {
            replica_id: "replica-a".into(),
            cache_memory_bytes: 2048,
            hit_rate: 0.5,
            pressure: 0.0,
            client_version: String::new(),
            t2_hit_tokens: 600,
            t2_query_tokens: 1000,
        }]
    );

    // Stats rows are sorted by replica id; NaN/Inf are sanitised to 0 (§4.2 step 3).
    let mut u = legacy_update("replica-0", "t", "m", "vllm", b"p", 10);
    u.stats = Some(pb::ReplicaStats {
        cache_memory_bytes: 7,
        hit_rate: f32::NAN,
        pressure: f32::INFINITY,
        ..Default::default()
    });
    assert!(report(&mut c, vec![u]).await.accepted);
    let s = cache_state(&mut c, "t", "m").await;
    assert_eq!(s.summary.unwrap().total_prefixes, 1, "{s:?}");
    let ids: Vec<&str> = s.replicas.iter().map(|r| r.replica_id.as_str()).collect();
    assert_eq!(ids, ["replica-0", "replica-a"]);
    assert_eq!(
        (
            s.replicas[0].hit_rate,
            s.replicas[0].pressure,
            s.replicas[0].cache_memory_bytes
        ),
        (0.0, 0.0, 7)
    );

    // Updates that only carry replica ids.
    let ack = report(
        &mut c,
        vec![
            pb::CacheStateUpdate {
                replica_id: "x".into(),
                ..Default::default()
            },
            pb::CacheStateUpdate {
                replica_id: "y".into(),
                ..Default::default()
            },
        ],
    )
    .await;
    assert!(ack.accepted);
    assert_eq!(ack.reason_code, "");

    // A stream that never ends: its first message is applied before EOF (observed while the
    // stream is still open); then the client gives up → no Ack; the applied message stays.
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::CacheStateUpdate>(4);
    let (give_up, gave_up) = tokio::sync::oneshot::channel::<()>();
    let mut c2 = srv.client().await;
    let call =
        tokio::spawn(async move {
            let stream = futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|m| (m, rx))
            });
            let mut req = tonic::Request::new(stream);
            // Only a safety net: the test gives up itself once the update is visible.
            req.set_timeout(Duration::from_secs(120));
            tokio::select! {
                r = c2.report_cache_state(req) => Some(r),
                _ = gave_up => None, // dropping the call cancels the stream (RST_STREAM)
            }
        });
    tx.send(legacy_update(
        "replica-s",
        "t",
        "m-stream",
        "vllm",
        b"s1",
        10,
    ))
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = cache_state(&mut c, "t", "m-stream").await;
        if s.summary.unwrap().total_prefixes == 1 {
            break;
        }
        assert!(
            !call.is_finished() && Instant::now() < deadline,
            "a streamed update must be applied before the stream ends (§4.1)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = give_up.send(());
    let res = call.await.unwrap();
    drop(tx);
    match res {
        None => {} // cancelled by the client while still open: no Ack
        Some(Ok(ack)) => panic!("a stream without EOF must not produce an Ack: {ack:?}"),
        Some(Err(st)) => assert!(
            matches!(
                st.code(),
                tonic::Code::Cancelled | tonic::Code::DeadlineExceeded
            ),
            "{st:?}"
        ),
    }
    let s = cache_state(&mut c, "t", "m-stream").await;
    assert_eq!(s.summary.unwrap().total_prefixes, 1, "partial apply stays");

    let pd = c
        .lookup_pd_route(pb::LookupPdRouteRequest {
            model_id: "m".into(),
            tenant_id: "t".into(),
            prefix_hash: b"p".to_vec(),
            prefix_token_count: 10,
            pd_topology_ref: "x".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        pd,
        pb::LookupPdRouteResponse {
            reason_code: "NO_HINT".into(),
            ..Default::default()
        }
    );
    let rt = c
        .render_template(pb::RenderTemplateRequest {
            template_ref: "tpl".into(),
            tenant_id: "t".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        rt,
        pb::RenderTemplateResponse {
            reason_code: "OK".into(),
            ..Default::default()
        }
    );
    // LookupPDRoute records no LookupRoute metric (§11).
    let m = metrics_text(&srv);
    assert!(
        !m.contains("inferencecache_lookup_route_calls_total{"),
        "no LookupRoute call was made: {}",
        m.lines()
            .filter(|l| l.contains("lookup_route_calls_total"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
shards_1_and_2!(c102_cache_state_and_stub_rpcs);

/// C089: one update with "a","b" → gauge 2; 50 concurrent single-prefix ingests →
/// GetCacheState total 50 and `inferencecache_index_entries{model="m"} 50`.
async fn c089_fifty_concurrent_ingests_gauge(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let mut u = legacy_update("r", "t", "m-ab", "vllm", b"a", 16);
    u.prefixes.push(pb::PrefixEntry {
        prefix_hash: b"b".to_vec(),
        token_count: 16,
        ..Default::default()
    });
    assert!(report(&mut c, vec![u]).await.accepted);
    assert_metric_line(
        &metrics_text(&srv),
        r#"inferencecache_index_entries{model="m-ab"} 2"#,
    );

    let mut clients = Vec::new();
    for _ in 0..5 {
        clients.push(srv.client().await);
    }
    let mut tasks = Vec::new();
    for i in 0..50 {
        let mut cl = clients[i % 5].clone();
        tasks.push(tokio::spawn(async move {
            let key = format!("p{i}");
            report(
                &mut cl,
                vec![legacy_update(
                    &format!("r{}", i % 7),
                    "t",
                    "m",
                    "vllm",
                    key.as_bytes(),
                    32,
                )],
            )
            .await
        }));
    }
    for t in tasks {
        assert!(t.await.unwrap().accepted);
    }
    let s = cache_state(&mut c, "t", "m").await;
    assert_eq!(s.summary.unwrap().total_prefixes, 50);
    assert_metric_line(
        &metrics_text(&srv),
        r#"inferencecache_index_entries{model="m"} 50"#,
    );
}
shards_1_and_2!(c089_fifty_concurrent_ingests_gauge);

/// Cross-core routing: data reported over one connection (one stream carrying updates for
/// models owned by both cores) is read back over other connections with GetCacheState and
/// LookupRoute; an ALL_CLEARED over a third connection is seen everywhere; the per-model gauge
/// and /snapshot aggregate across cores (same model, tenants on different cores).
async fn cross_core_report_and_read_back_other_connection(shards: usize) {
    let srv = Server::start(shards, &[]);
    let models = models_per_core("t", 2);
    let mut a = srv.client().await;
    let mut ups = Vec::new();
    for (i, m) in models.iter().enumerate() {
        let mut u = legacy_update(&format!("r-{i}"), "t", m, "vllm", b"p", 128);
        u.stats = Some(pb::ReplicaStats {
            cache_memory_bytes: 1000 + i as i64,
            hit_rate: 0.5,
            ..Default::default()
        });
        ups.push(u);
        ups.push(chain_update(
            &format!("r-{i}"),
            "t",
            m,
            "vllm",
            &[b"c1", b"c2"],
            &[64, 64],
        ));
    }
    assert!(report(&mut a, ups).await.accepted);

    for _ in 0..4 {
        let mut b = srv.client().await;
        for (i, m) in models.iter().enumerate() {
            let rid = format!("r-{i}");
            let s = cache_state(&mut b, "t", m).await;
            assert_eq!(s.summary.unwrap().total_prefixes, 3, "model {m}: {s:?}");
            assert_eq!(s.replicas.len(), 1, "model {m}: {s:?}");
            assert_eq!(s.replicas[0].replica_id, rid);
            assert_eq!(s.replicas[0].cache_memory_bytes, 1000 + i as i64);
            let r = lookup(&mut b, exact_lookup("t", m, "vllm", b"p", 128)).await;
            assert_resp(&r, "PREFIX_MATCH", &[exp(&rid, 128.0, 128, T1)]);
            let r = lookup(
                &mut b,
                chain_lookup("t", m, "vllm", &[b"c1", b"c2", b"c3"], &[64, 64, 64]),
            )
            .await;
            assert_resp(&r, "PREFIX_MATCH", &[exp(&rid, 128.0, 128, T1)]);
        }
    }

    // ALL_CLEARED over a third connection, for the model owned by the last core.
    let last = models.len() - 1;
    let mut c = srv.client().await;
    let ack = c
        .publish_event(pb::CacheEvent {
            r#type: pb::cache_event::Type::AllCleared as i32,
            replica_id: format!("r-{last}"),
            model_id: models[last].clone(),
            tenant_id: "t".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(ack.accepted);
    for _ in 0..3 {
        let mut b = srv.client().await;
        let s = cache_state(&mut b, "t", &models[last]).await;
        assert_eq!(s.summary.unwrap().total_prefixes, 0);
        assert!(s.replicas.is_empty());
        let s = cache_state(&mut b, "t", &models[0]).await;
        assert_eq!(s.summary.unwrap().total_prefixes, 3);
    }

    // Same model, tenants on different cores: the gauge and /snapshot sum over cores.
    let tenants = tenants_per_core("ten", "shared-model", 2);
    for (i, t) in tenants.iter().enumerate() {
        let mut w = srv.client().await;
        let key = format!("k{i}");
        assert!(
            report(
                &mut w,
                vec![legacy_update(
                    "rs",
                    t,
                    "shared-model",
                    "vllm",
                    key.as_bytes(),
                    32
                )]
            )
            .await
            .accepted
        );
    }
    assert_metric_line(
        &metrics_text(&srv),
        r#"inferencecache_index_entries{model="shared-model"} 2"#,
    );
    let snap = snapshot_json(&srv);
    assert_eq!(snap["totalPrefixes"], 3 + 2, "{snap}");
    for t in &tenants {
        let mut b = srv.client().await;
        let s = cache_state(&mut b, t, "shared-model").await;
        assert_eq!(s.summary.unwrap().total_prefixes, 1);
    }
}
shards_1_and_2!(cross_core_report_and_read_back_other_connection);

// ---- §19.11 empty prefix_hash key ------------------------------------------------------------

/// §19.11 / §4.2: an empty `prefix_hash` is indexed under the empty key; a request with no
/// fingerprint at all does an exact lookup on it (PREFIX_MATCH), and on a miss can still get
/// TENANT_HOT; without warm stats there is no seed → NO_HINT (not AFFINITY_HINT).
async fn s19_11_empty_prefix_hash_key(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let mut warm = legacy_update("warm", "t2", "m", "vllm", b"other", 100);
    warm.stats = stats(0.9, 0.0);
    warm.timestamp_us = fresh_ts();
    assert!(
        report(
            &mut c,
            vec![
                legacy_update("r1", "t", "m", "vllm", b"", 100),
                warm,
                legacy_update("cold", "t3", "m", "vllm", b"other", 100),
            ]
        )
        .await
        .accepted
    );
    let bare = |t: &str| pb::LookupRouteRequest {
        model_id: "m".into(),
        tenant_id: t.into(),
        hash_scheme: "vllm".into(),
        ..Default::default()
    };
    let r = lookup(&mut c, with_adapter(bare("t"), "")).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r1", 100.0, 100, T1)]);
    let r = lookup(&mut c, with_adapter(bare("t2"), "lora-z")).await;
    assert_resp(&r, "TENANT_HOT", &[exp("warm", 0.9, 0, T_UNSPEC)]);
    assert_eq!(r.adapter_id, "lora-z", "TENANT_HOT echoes adapter (§10.4)");
    let r = lookup(&mut c, with_adapter(bare("t3"), "lora-z")).await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(
        r.adapter_id, "lora-z",
        "index-derived NO_HINT echoes adapter"
    );
    let s = cache_state(&mut c, "t", "m").await;
    assert_eq!(s.summary.unwrap().total_prefixes, 1, "empty key counts");
}
shards_1_and_2!(s19_11_empty_prefix_hash_key);

// ---- §10.4 adapter_id / metrics on each exit, §16 hint_used ------------------------------------

async fn s10_4_s16_adapter_echo_and_hint_used_per_exit(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"rc","strategy":{"requireChain":true}},{"namespace":"zf","routingFloorScore":0}]}"#,
    );
    let mut c = srv.client().await;
    let mut w = legacy_update("warm", "t", "m", "vllm", b"other", 64);
    w.stats = stats(0.5, 0.0);
    w.timestamp_us = fresh_ts();
    let mut held = legacy_update("r", "t", "m", "vllm", b"p", 128);
    held.adapter_id = "ad".into();
    assert!(
        report(
            &mut c,
            vec![
                held,
                w,
                legacy_update("a", "zf", "mz", "vllm", b"chat", 16),
                legacy_update("b", "zf", "mz", "vllm", b"chat", 16),
                legacy_update("r", "rc", "m", "vllm", b"p", 128),
            ]
        )
        .await
        .accepted
    );
    let a = |r: pb::LookupRouteRequest| with_adapter(r, "ad");
    let r = lookup(&mut c, a(exact_lookup("t", "m", "vllm", b"p", 128))).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 64.0, 128, T1)]);
    assert_eq!(r.adapter_id, "ad");
    let r = lookup(&mut c, a(exact_lookup("t", "m", "vllm", b"novel", 128))).await;
    assert_resp(&r, "TENANT_HOT", &[exp("warm", 0.5, 0, T_UNSPEC)]);
    assert_eq!(r.adapter_id, "ad");
    let r = lookup(&mut c, a(chain_lookup("t", "m", "vllm", &[b"n1"], &[16]))).await;
    assert_eq!(r.reason_code, "AFFINITY_HINT", "{r:?}");
    assert_eq!(r.adapter_id, "ad");
    let r = lookup(&mut c, a(exact_lookup("nobody", "m", "vllm", b"p", 128))).await;
    assert_resp(&r, "UNKNOWN_TENANT", &[]);
    assert_eq!(r.adapter_id, "ad", "index-derived UNKNOWN_* echoes adapter");
    let r = lookup(&mut c, a(exact_lookup("t", "m", "", b"p", 128))).await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.adapter_id, "ad", "empty scheme NONE is index-derived");
    let r = lookup(
        &mut c,
        a(chain_lookup("t", "m", "vllm", &[b"x", b"y"], &[16])),
    )
    .await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.adapter_id, "", "malformed chain fail-open");
    let r = lookup(&mut c, a(tokens_req("t", "m", (0..15).collect()))).await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.adapter_id, "", "sub-block token_ids fail-open");
    assert!(r.token_ids.is_empty());
    let r = lookup(&mut c, a(exact_lookup("rc", "m", "vllm", b"p", 128))).await;
    assert_resp(&r, "POLICY_REQUIRES_CHAIN", &[]);
    assert_eq!(r.adapter_id, "");
    let r = lookup(&mut c, exact_lookup("zf", "mz", "vllm", b"chat", 16)).await;
    assert_resp(
        &r,
        "PREFIX_MATCH",
        &[exp("a", 0.0, 16, T1), exp("b", 0.0, 16, T1)],
    );
    let m = metrics_text(&srv);
    for line in [
        r#"inferencecache_lookup_route_calls_total{hint_used="true",model="m",reason_code="PREFIX_MATCH"} 1"#,
        r#"inferencecache_lookup_route_calls_total{hint_used="true",model="m",reason_code="TENANT_HOT"} 1"#,
        r#"inferencecache_lookup_route_calls_total{hint_used="true",model="m",reason_code="AFFINITY_HINT"} 1"#,
        r#"inferencecache_lookup_route_calls_total{hint_used="false",model="m",reason_code="UNKNOWN_TENANT"} 1"#,
        r#"inferencecache_lookup_route_calls_total{hint_used="false",model="m",reason_code="NO_HINT"} 3"#,
        r#"inferencecache_lookup_route_calls_total{hint_used="false",model="m",reason_code="POLICY_REQUIRES_CHAIN"} 1"#,
        r#"inferencecache_lookup_route_calls_total{hint_used="true",model="mz",reason_code="PREFIX_MATCH"} 1"#,
    ] {
        assert_metric_line(&m, line);
    }
}
shards_1_and_2!(s10_4_s16_adapter_echo_and_hint_used_per_exit);

// ---- §8.3 chain requests with zero / negative counts ------------------------------------------

async fn s8_3_chain_zero_and_negative_request_counts(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"t","routingFloorScore":0}]}"#,
    );
    let mut c = srv.client().await;
    assert!(
        report(
            &mut c,
            vec![chain_update(
                "r",
                "t",
                "m",
                "vllm",
                &[b"b1", b"b2"],
                &[16, 16]
            )]
        )
        .await
        .accepted
    );
    let seed = chain_seed(&[b"b1".to_vec(), b"b2".to_vec()]);
    assert_eq!(pick(&["r"], &seed), "r");
    for counts in [[0, 0], [16, -16], [-32, 16]] {
        let r = lookup(
            &mut c,
            chain_lookup("t", "m", "vllm", &[b"b1", b"b2"], &counts),
        )
        .await;
        assert_resp(&r, "AFFINITY_HINT", &[affinity("r")]);
    }
    let r = lookup(
        &mut c,
        chain_lookup("t", "m", "vllm", &[b"b1", b"b2"], &[-16, 32]),
    )
    .await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 16.0, 16, T1)]);
    let r = lookup(
        &mut c,
        chain_lookup("t", "m", "vllm", &[b"b1", b"b2"], &[0, 16]),
    )
    .await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 16.0, 16, T1)]);
    // Empty counts list but non-empty hashes → malformed → NO_HINT fail-open.
    let r = lookup(&mut c, chain_lookup("t", "m", "vllm", &[b"b1"], &[])).await;
    assert_resp(&r, "NO_HINT", &[]);
    // Counts without hashes → malformed too.
    let r = lookup(&mut c, chain_lookup("t", "m", "vllm", &[], &[16])).await;
    assert_resp(&r, "NO_HINT", &[]);
}
shards_1_and_2!(s8_3_chain_zero_and_negative_request_counts);

// ---- §19.17 pressure > 1, NaN sanitising ------------------------------------------------------

async fn s19_17_pressure_above_one_clamps_factor(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"z","routingFloorScore":0}]}"#,
    );
    let mut c = srv.client().await;
    let mut u = legacy_update("r", "t", "m", "vllm", b"p", 100);
    u.stats = stats(f32::NAN, 1.5);
    let mut z = legacy_update("r", "z", "m", "vllm", b"p", 100);
    z.stats = stats(0.5, 1.5);
    assert!(report(&mut c, vec![u, z]).await.accepted);
    let s = cache_state(&mut c, "t", "m").await;
    assert_eq!(s.replicas.len(), 1);
    assert_eq!(s.replicas[0].pressure, 1.5, "finite pressure stored as-is");
    assert_eq!(s.replicas[0].hit_rate, 0.0, "NaN hit rate sanitised");
    // No policy: score 0 < routing floor 0.1 → NONE → affinity.
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"p", 100)).await;
    assert_resp(&r, "AFFINITY_HINT", &[affinity("r")]);
    // Floor 0: PREFIX_MATCH with a zero score.
    let r = lookup(&mut c, exact_lookup("z", "m", "vllm", b"p", 100)).await;
    assert_resp(&r, "PREFIX_MATCH", &[expp("r", 0.0, 100, T1, 1.0)]);
    // TENANT_HOT with pressure 1.5 → score 0 but still TENANT_HOT (no floors apply).
    let r = lookup(&mut c, exact_lookup("z", "m", "vllm", b"novel", 100)).await;
    assert_resp(&r, "TENANT_HOT", &[expp("r", 0.0, 0, T_UNSPEC, 0.5)]);
}
shards_1_and_2!(s19_17_pressure_above_one_clamps_factor);

// ---- §4.2 / §11 empty tenant and model buckets ----------------------------------------------------

/// Empty tenant/model are accepted at ingest and readable through GetCacheState's empty-key
/// buckets, but never matched by LookupRoute (index NONE → NO_HINT, adapter echoed).
async fn s11_empty_tenant_model_buckets(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let mut u = legacy_update("r", "", "", "vllm", b"p", 128);
    u.stats = Some(pb::ReplicaStats {
        cache_memory_bytes: 7,
        hit_rate: 0.9,
        client_version: "x==1".into(),
        ..Default::default()
    });
    assert!(report(&mut c, vec![u]).await.accepted);
    let s = cache_state(&mut c, "", "").await;
    assert_eq!(s.summary.unwrap().total_prefixes, 1);
    assert_eq!(s.replicas.len(), 1);
    assert_eq!(s.replicas[0].replica_id, "r");
    assert_eq!(s.replicas[0].cache_memory_bytes, 7);
    assert_eq!(
        s.replicas[0].client_version, "",
        "client_version is not stored"
    );
    let r = lookup(
        &mut c,
        with_adapter(exact_lookup("", "", "vllm", b"p", 128), "a"),
    )
    .await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.adapter_id, "a");
    let r = lookup(&mut c, exact_lookup("", "m", "vllm", b"p", 128)).await;
    assert_resp(&r, "NO_HINT", &[]);
}
shards_1_and_2!(s11_empty_tenant_model_buckets);
