//! LookupPDRoute with prefill/decode topologies registered on the controller-facing listener
//! (`PUT|GET|DELETE /pd-topologies/{tenant}/{ref}`, docs/BEHAVIOUR.md §11): the prefill pick by
//! LookupRoute's ranking within the prefill pool (policy floors included), the decode pick by
//! reported load with prefix affinity, every reason code, fail-open on errors and deadlines,
//! registration bounds, authentication, and the reference's stub while nothing is registered.

use std::time::Duration;

use crate::support::*;

type Client = pb::inference_cache_client::InferenceCacheClient<tonic::transport::Channel>;

const TOPOLOGY: &str = r#"{"prefillPool":["p1","p2","p3"],"decodePool":["d1","d2"],
    "transportHint":"nixl","hashScheme":"vllm"}"#;

fn put(srv: &Server, path: &str, body: &str) -> HttpResponse {
    http_full(srv.admin_port, "PUT", path, &[], body.as_bytes()).expect("put")
}

fn pd_req(tenant: &str, topology: &str, prefix: &[u8]) -> pb::LookupPdRouteRequest {
    pb::LookupPdRouteRequest {
        model_id: "m".into(),
        tenant_id: tenant.into(),
        prefix_hash: prefix.to_vec(),
        prefix_token_count: 128,
        pd_topology_ref: topology.into(),
    }
}

async fn pd(c: &mut Client, req: pb::LookupPdRouteRequest) -> pb::LookupPdRouteResponse {
    c.lookup_pd_route(req)
        .await
        .expect("LookupPDRoute never fails")
        .into_inner()
}

fn answer(prefill: &str, decode: &str, reason: &str) -> pb::LookupPdRouteResponse {
    pb::LookupPdRouteResponse {
        prefill_replica_id: prefill.into(),
        decode_replica_id: decode.into(),
        transport_hint: "nixl".into(),
        reason_code: reason.into(),
    }
}

fn stub() -> pb::LookupPdRouteResponse {
    pb::LookupPdRouteResponse {
        reason_code: "NO_HINT".into(),
        ..Default::default()
    }
}

fn with_stats(mut u: pb::CacheStateUpdate, pressure: f32) -> pb::CacheStateUpdate {
    u.stats = stats(0.0, pressure);
    u
}

/// Prefill = the pool's best prefix holder (by score, not pool order), decode = least loaded
/// with affinity; AFFINITY_HINT for a prefix nobody in the pool holds; NO_HINT for an unknown
/// topology, another tenant, an empty prefix; the stub again once the last topology is deleted.
async fn pd_route_picks_prefill_by_ranking_and_decode_by_load(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let mut c2 = srv.client().await;
    assert_eq!(pd(&mut c, pd_req("t", "topo", b"pfx")).await, stub());
    assert_eq!(put(&srv, "/pd-topologies/t/topo", TOPOLOGY).status, 204);

    // p2 holds the deeper prefix, p1 a shallower one, d1 (decode) holds it too; p3 and d2 hold
    // something else (they widen the distinguishing-power denominator).
    let updates = vec![
        legacy_update("p1", "t", "m", "vllm", b"pfx", 64),
        legacy_update("p2", "t", "m", "vllm", b"pfx", 128),
        legacy_update("p3", "t", "m", "vllm", b"other", 128),
        with_stats(legacy_update("d1", "t", "m", "vllm", b"pfx", 128), 0.5),
        with_stats(legacy_update("d2", "t", "m", "vllm", b"other", 128), 0.2),
    ];
    assert!(report(&mut c, updates).await.accepted);
    for client in [&mut c, &mut c2] {
        let r = pd(client, pd_req("t", "topo", b"pfx")).await;
        // d2 is less loaded than d1 even with d1's affinity bonus (0.2 < 0.5 - 0.1).
        assert_eq!(r, answer("p2", "d2", "PREFIX_MATCH"));
    }
    // Within the bonus, the decode replica that holds the prefix wins.
    let u = with_stats(legacy_update("d1", "t", "m", "vllm", b"pfx", 128), 0.25);
    assert!(report(&mut c, vec![u]).await.accepted);
    assert_eq!(
        pd(&mut c, pd_req("t", "topo", b"pfx")).await,
        answer("p2", "d1", "PREFIX_MATCH")
    );

    // Nobody in the prefill pool holds it: a stable pick over the pool.
    let first = pd(&mut c, pd_req("t", "topo", b"novel")).await;
    assert_eq!(first.reason_code, "AFFINITY_HINT");
    assert!(["p1", "p2", "p3"].contains(&first.prefill_replica_id.as_str()));
    assert!(["d1", "d2"].contains(&first.decode_replica_id.as_str()));
    assert_eq!(first.transport_hint, "nixl");
    for _ in 0..4 {
        assert_eq!(pd(&mut c2, pd_req("t", "topo", b"novel")).await, first);
    }

    // Fail-open: unknown topology, the topology of another tenant, no prefix, no model, the
    // probe tenant.
    assert_eq!(pd(&mut c, pd_req("t", "other-topo", b"pfx")).await, stub());
    assert_eq!(pd(&mut c, pd_req("t2", "topo", b"pfx")).await, stub());
    assert_eq!(pd(&mut c, pd_req("t", "topo", b"")).await, stub());
    let mut no_model = pd_req("t", "topo", b"pfx");
    no_model.model_id.clear();
    assert_eq!(pd(&mut c, no_model).await, stub());
    assert_eq!(
        put(&srv, "/pd-topologies/inferencecache.io/probe", TOPOLOGY).status,
        204
    );
    assert_eq!(
        pd(&mut c, pd_req("inferencecache.io", "probe", b"pfx"))
            .await
            .reason_code,
        "AFFINITY_HINT",
        "the tenant is the first path segment"
    );
    let probe = pd_req("inferencecache.io/probe", "x", b"pfx");
    assert_eq!(pd(&mut c, probe).await, stub());

    // Listing and reading back.
    let (st, list) = http_get(srv.admin_port, "/pd-topologies/t").unwrap();
    assert_eq!(st, 200);
    let list: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert_eq!(list["topo"]["decodePool"], serde_json::json!(["d1", "d2"]));
    assert_eq!(list["topo"]["transportHint"], "nixl");
    let (st, one) = http_get(srv.admin_port, "/pd-topologies/t/topo").unwrap();
    assert_eq!(st, 200);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&one).unwrap()["hashScheme"],
        "vllm"
    );

    let text = metrics_text(&srv);
    assert_metric_line(
        &text,
        r#"inferencecache_rpc_calls_total{reason_code="PREFIX_MATCH",rpc="LookupPDRoute"} 3"#,
    );
    assert_metric_line(
        &text,
        r#"inferencecache_rpc_calls_total{reason_code="AFFINITY_HINT",rpc="LookupPDRoute"} 6"#,
    );
    assert_metric_line(
        &text,
        r#"inferencecache_rpc_calls_total{reason_code="NO_HINT",rpc="LookupPDRoute"} 5"#,
    );

    // Delete both: the reference's stub again.
    let del = |p: &str| {
        http_full(srv.admin_port, "DELETE", p, &[], b"")
            .unwrap()
            .status
    };
    assert_eq!(del("/pd-topologies/t/topo"), 204);
    assert_eq!(del("/pd-topologies/t/topo"), 404);
    assert_eq!(del("/pd-topologies/inferencecache.io/probe"), 204);
    assert_eq!(pd(&mut c, pd_req("t", "topo", b"pfx")).await, stub());
}
shards_1_and_2!(pd_route_picks_prefill_by_ranking_and_decode_by_load);

/// The tenant's policy applies to the prefill ranking as in LookupRoute: the matched-tokens
/// floor drops shallow holders (then affinity, unless the policy turns it off).
async fn pd_route_applies_policy_floors(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    assert_eq!(put(&srv, "/pd-topologies/t/topo", TOPOLOGY).status, 204);
    let updates = vec![
        legacy_update("p1", "t", "m", "vllm", b"pfx", 256),
        legacy_update("p2", "t", "m", "vllm", b"pfx", 128),
        legacy_update("p3", "t", "m", "vllm", b"other", 128),
        legacy_update("d2", "t", "m", "vllm", b"other", 128),
    ];
    assert!(report(&mut c, updates).await.accepted);
    let r = pd(&mut c, pd_req("t", "topo", b"pfx")).await;
    assert_eq!(
        (r.prefill_replica_id.as_str(), r.reason_code.as_str()),
        ("p1", "PREFIX_MATCH")
    );

    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"t","minimumMatchedTokens":300}]}"#,
    );
    let r = pd(&mut c, pd_req("t", "topo", b"pfx")).await;
    assert_eq!(r.reason_code, "AFFINITY_HINT", "no holder passes the floor");
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"t","minimumMatchedTokens":300,"affinityRouting":false}]}"#,
    );
    assert_eq!(pd(&mut c, pd_req("t", "topo", b"pfx")).await, stub());
    // The routing floor on the pool's top score.
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"t","routingFloorScore":100000,"affinityRouting":false}]}"#,
    );
    assert_eq!(pd(&mut c, pd_req("t", "topo", b"pfx")).await, stub());
    install_policy(&srv, r#"{"version":7,"policies":[]}"#);
    let r = pd(&mut c, pd_req("t", "topo", b"pfx")).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH");
}
shards_1_and_2!(pd_route_applies_policy_floors);

/// TENANT_HOT: nobody holds the prefix, but a warm prefill replica (hit rate over the tenant-hot
/// minimum) is the pool's best by LookupRoute's TENANT_HOT ranking; a warm replica outside the
/// prefill pool is never the prefill pick.
async fn pd_route_tenant_hot(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    assert_eq!(put(&srv, "/pd-topologies/t/topo", TOPOLOGY).status, 204);
    let warm = |r: &str, hit: f32| {
        let mut u = legacy_update(r, "t", "m", "vllm", b"other", 16);
        u.stats = stats(hit, 0.0);
        u
    };
    let updates = vec![warm("d1", 0.95), warm("p3", 0.8), warm("p1", 0.05)];
    assert!(report(&mut c, updates).await.accepted);
    let r = pd(&mut c, pd_req("t", "topo", b"novel")).await;
    assert_eq!(
        (r.prefill_replica_id.as_str(), r.reason_code.as_str()),
        ("p3", "TENANT_HOT")
    );
    assert!(["d1", "d2"].contains(&r.decode_replica_id.as_str()));
}
shards_1_and_2!(pd_route_tenant_hot);

/// An expired caller deadline fails open with NO_HINT (never an error status).
async fn pd_route_deadline_fails_open(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    assert_eq!(put(&srv, "/pd-topologies/t/topo", TOPOLOGY).status, 204);
    let u = legacy_update("p1", "t", "m", "vllm", b"pfx", 128);
    assert!(report(&mut c, vec![u]).await.accepted);
    let mut raw = srv.raw_client().await;
    let mut r = tonic::Request::new(pd_req("t", "topo", b"pfx"));
    r.set_timeout(Duration::from_nanos(1));
    let resp = raw.lookup_pd_route(r).await.expect("no error").into_inner();
    assert_eq!(resp, stub());
    let mut r = tonic::Request::new(pd_req("t", "topo", b"pfx"));
    r.set_timeout(Duration::from_secs(10));
    let resp = raw.lookup_pd_route(r).await.expect("no error").into_inner();
    assert_eq!(resp.reason_code, "PREFIX_MATCH");
    // 1,024 topologies in all: the next one is refused (409); replacing one still works.
    for i in 1..1024 {
        let r = put(&srv, &format!("/pd-topologies/t{}/x{i}", i % 7), TOPOLOGY);
        assert_eq!(r.status, 204, "{i}: {}", r.body);
    }
    assert_eq!(put(&srv, "/pd-topologies/t/one-more", TOPOLOGY).status, 409);
    assert_eq!(put(&srv, "/pd-topologies/t/topo", TOPOLOGY).status, 204);
    assert_metric_line(
        &metrics_text(&srv),
        r#"inferencecache_limit_hits_total{limit="pd_topologies"} 1"#,
    );
}
shards_1_and_2!(pd_route_deadline_fails_open);

/// Registration bounds and errors, and authentication exactly like `/policy`.
fn pd_topology_registration_bounds_and_auth(shards: usize) {
    let dir = scratch_dir("pd-auth");
    let f = dir.join("controller-token");
    let token = "pd-controller-token-000000001";
    std::fs::write(&f, token).unwrap();
    let srv = Server::start_opts(
        shards,
        StartOpts {
            flags: &["--controller-token-file", f.to_str().unwrap()],
            no_insecure: true,
            ..Default::default()
        },
    );
    let p = srv.admin_port;
    let bearer = format!("Bearer {token}");
    let auth: &[(&str, &str)] = &[("Authorization", &bearer)];
    let put_auth = |path: &str, body: &str| {
        http_full(p, "PUT", path, auth, body.as_bytes())
            .unwrap()
            .status
    };
    assert_eq!(
        http_full(p, "PUT", "/pd-topologies/t/a", &[], TOPOLOGY.as_bytes())
            .unwrap()
            .status,
        401
    );
    assert_eq!(
        http_full(p, "GET", "/pd-topologies/t", &[], b"")
            .unwrap()
            .status,
        401
    );
    assert_eq!(put_auth("/pd-topologies/t/a", TOPOLOGY), 204);
    assert_eq!(
        http_full(p, "GET", "/pd-topologies/t", auth, b"")
            .unwrap()
            .status,
        200
    );

    let pool: Vec<String> = (0..257).map(|i| format!("r{i}")).collect();
    let oversize =
        serde_json::json!({"prefillPool": pool, "decodePool": ["d"], "hashScheme": "vllm"});
    assert_eq!(put_auth("/pd-topologies/t/big", &oversize.to_string()), 400);
    for bad in [
        r#"{"prefillPool":[],"decodePool":["d"],"hashScheme":"vllm"}"#,
        r#"{"prefillPool":["p"],"decodePool":["d"]}"#,
        r#"{"prefillPool":["p"],"decodePool":["d"],"hashScheme":"vllm","extra":1}"#,
        r#"{"prefillPool":[""],"decodePool":["d"],"hashScheme":"vllm"}"#,
        "not json",
    ] {
        assert_eq!(put_auth("/pd-topologies/t/bad", bad), 400, "{bad}");
    }
    assert_eq!(put_auth("/pd-topologies/t", TOPOLOGY), 405);
    let text = metrics_text(&srv);
    assert_metric_line(
        &text,
        r#"inferencecache_limit_hits_total{limit="pd_pool_replicas"} 1"#,
    );
    assert_metric_line(
        &text,
        r#"inferencecache_policy_auth_total{result="unauth"} 2"#,
    );
}
shards_1_and_2!(blocking pd_topology_registration_bounds_and_auth);
