//! End-to-end conformance: caller deadlines (docs/BEHAVIOUR.md §10.2 steps 1–4, §10.4, §10.5,
//! §19.19–20; docs/CONFORMANCE.md C140). Requests are sent over a raw HTTP/2 transport
//! (`Server::raw_client`) so that an already-expired `grpc-timeout` reaches the server instead of
//! being enforced by tonic's client channel.

use std::time::Duration;

use crate::support::*;

async fn lookup_with_timeout(
    c: &mut pb::inference_cache_client::InferenceCacheClient<RawH2>,
    req: pb::LookupRouteRequest,
    timeout: Duration,
) -> pb::LookupRouteResponse {
    let mut r = tonic::Request::new(req.clone());
    r.set_timeout(timeout);
    c.lookup_route(r)
        .await
        .unwrap_or_else(|s| panic!("LookupRoute({req:?}) with deadline must not error: {s:?}"))
        .into_inner()
}

/// C140: caller deadline already in the past, "p"=100 stored → TIMEOUT, no scores, OK status,
/// adapter "", no echo, metric (TIMEOUT, false). Precedence: the probe tenant short-circuit beats
/// the deadline (NO_HINT); TIMEOUT beats the requireChain gate. A generous deadline does not
/// change the answer.
async fn c140_caller_deadline_in_past_timeout(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"rc","strategy":{"requireChain":true}}]}"#,
    );
    let mut c = srv.client().await;
    assert!(
        report(
            &mut c,
            vec![
                legacy_update("r", "t", "m", "vllm", b"p", 100),
                legacy_update("r", "rc", "m", "vllm", b"p", 100),
            ]
        )
        .await
        .accepted
    );
    let mut raw = srv.raw_client().await;
    let one_ns = Duration::from_nanos(1);

    let mut req = exact_lookup("t", "m", "vllm", b"p", 100);
    req.adapter_id = "lora".into();
    let r = lookup_with_timeout(&mut raw, req, one_ns).await;
    assert_resp(&r, "TIMEOUT", &[]);
    assert_eq!(r.adapter_id, "", "no adapter echo on TIMEOUT");
    assert!(r.token_ids.is_empty());
    assert_metric_line(
        &metrics_text(&srv),
        r#"inferencecache_lookup_route_calls_total{hint_used="false",model="m",reason_code="TIMEOUT"} 1"#,
    );

    // token_ids input: still TIMEOUT (checked before input resolution), no echo.
    let mut req = exact_lookup("t", "m", "vllm", b"", 0);
    req.token_ids = (0..64).collect();
    let r = lookup_with_timeout(&mut raw, req, one_ns).await;
    assert_resp(&r, "TIMEOUT", &[]);
    assert!(r.token_ids.is_empty());

    // Probe tenant first, then the arrival TIMEOUT, then requireChain.
    let r = lookup_with_timeout(
        &mut raw,
        exact_lookup("inferencecache.io/probe", "m", "vllm", b"p", 100),
        one_ns,
    )
    .await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.lookup_latency_us, 0);
    let r = lookup_with_timeout(&mut raw, exact_lookup("rc", "m", "vllm", b"p", 100), one_ns).await;
    assert_resp(&r, "TIMEOUT", &[]);

    // A generous caller deadline does not change the answer.
    let r = lookup_with_timeout(
        &mut raw,
        exact_lookup("t", "m", "vllm", b"p", 100),
        Duration::from_secs(30),
    )
    .await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 100.0, 100, T1)]);
    let r = lookup_with_timeout(
        &mut raw,
        exact_lookup("rc", "m", "vllm", b"p", 100),
        Duration::from_secs(30),
    )
    .await;
    assert_resp(&r, "POLICY_REQUIRES_CHAIN", &[]);
    // And through the regular tonic channel with a generous deadline.
    let mut req = tonic::Request::new(exact_lookup("t", "m", "vllm", b"p", 100));
    req.set_timeout(Duration::from_secs(30));
    let r = c.lookup_route(req).await.expect("LookupRoute").into_inner();
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 100.0, 100, T1)]);

    let m = metrics_text(&srv);
    assert_metric_line(
        &m,
        r#"inferencecache_lookup_route_calls_total{hint_used="false",model="m",reason_code="TIMEOUT"} 3"#,
    );
}
shards_1_and_2!(c140_caller_deadline_in_past_timeout);

/// §12.4 / §19.19: `lookupTimeoutMs: 0` means no deadline (not "instant"); a generous budget
/// does not time out either.
async fn c140_policy_budget_zero_or_generous_no_timeout(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[
            {"namespace":"t0","lookupTimeoutMs":0},
            {"namespace":"t5s","lookupTimeoutMs":5000}]}"#,
    );
    let mut c = srv.client().await;
    for t in ["t0", "t5s"] {
        assert!(
            report(&mut c, vec![legacy_update("r", t, "m", "vllm", b"p", 100)])
                .await
                .accepted
        );
        let r = lookup(&mut c, exact_lookup(t, "m", "vllm", b"p", 100)).await;
        assert_resp(&r, "PREFIX_MATCH", &[exp("r", 100.0, 100, T1)]);
    }
}
shards_1_and_2!(c140_policy_budget_zero_or_generous_no_timeout);
