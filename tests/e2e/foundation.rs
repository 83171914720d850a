//! End-to-end checks of the foundation: the real binary on loopback with `--shards 1`
//! and `--shards 2`, every RPC, health and reflection through generated clients, start-up
//! refusals, and graceful shutdown.

use std::process::Command;

use crate::support::*;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

async fn every_rpc_health_and_reflection(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;

    let r = c
        .render_template(pb::RenderTemplateRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.reason_code, "OK");
    assert!(r.stable_prefix_hash.is_empty());

    let r = c
        .lookup_pd_route(pb::LookupPdRouteRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.reason_code, "NO_HINT");

    let r = c
        .lookup_route(exact_lookup("t", "m", "vllm", b"p", 10))
        .await
        .unwrap()
        .into_inner();
    assert!(!r.reason_code.is_empty());

    let ack = report(&mut c, vec![legacy_update("r", "t", "m", "vllm", b"p", 64)]).await;
    assert!(ack.accepted);
    assert_eq!(ack.reason_code, "");

    let ack = c
        .publish_event(pb::CacheEvent {
            r#type: 3,
            replica_id: "r".into(),
            tenant_id: "t".into(),
            model_id: "m".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(ack.accepted);

    let st = c
        .get_cache_state(pb::GetCacheStateRequest {
            model_id: "m".into(),
            tenant_id: "t".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(st.summary.is_some());

    let mut s = c
        .stream_cache_events(pb::StreamEventsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(s.message().await.unwrap().is_none());
    let mut s = c
        .stream_metrics(pb::StreamMetricsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(s.message().await.unwrap().is_none());

    // Health: the overall service "" is SERVING.
    let mut h = HealthClient::new(srv.channel().await);
    let resp = h
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.status, 1, "SERVING");

    reflection_lists_services(&srv).await;
}

async fn reflection_lists_services(srv: &Server) {
    use tonic_reflection::pb::v1 as r1;
    use tonic_reflection::pb::v1alpha as r1a;
    let mut c = r1::server_reflection_client::ServerReflectionClient::new(srv.channel().await);
    let req = r1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(r1::server_reflection_request::MessageRequest::ListServices(
            String::new(),
        )),
    };
    let mut out = c
        .server_reflection_info(tokio_stream::iter(vec![req]))
        .await
        .unwrap()
        .into_inner();
    let msg = out
        .message()
        .await
        .unwrap()
        .expect("reflection v1 response");
    let Some(r1::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
        msg.message_response
    else {
        panic!("unexpected reflection answer {msg:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"inferencecache.v1alpha1.InferenceCache".to_string()),
        "{names:?}"
    );
    assert!(
        names.contains(&"grpc.health.v1.Health".to_string()),
        "{names:?}"
    );

    // A client resolving a symbol gets the descriptor of our proto file.
    let req = r1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            r1::server_reflection_request::MessageRequest::FileContainingSymbol(
                "inferencecache.v1alpha1.LookupRouteRequest".into(),
            ),
        ),
    };
    let mut out = c
        .server_reflection_info(tokio_stream::iter(vec![req]))
        .await
        .unwrap()
        .into_inner();
    let msg = out.message().await.unwrap().unwrap();
    assert!(
        matches!(msg.message_response, Some(r1::server_reflection_response::MessageResponse::FileDescriptorResponse(ref f)) if !f.file_descriptor_proto.is_empty())
    );

    let mut c = r1a::server_reflection_client::ServerReflectionClient::new(srv.channel().await);
    let req = r1a::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            r1a::server_reflection_request::MessageRequest::ListServices(String::new()),
        ),
    };
    let mut out = c
        .server_reflection_info(tokio_stream::iter(vec![req]))
        .await
        .unwrap()
        .into_inner();
    let msg = out
        .message()
        .await
        .unwrap()
        .expect("reflection v1alpha response");
    assert!(matches!(
        msg.message_response,
        Some(r1a::server_reflection_response::MessageResponse::ListServicesResponse(_))
    ));
}

shards_1_and_2!(every_rpc_health_and_reflection);

#[test]
fn refuses_a_grpc_port_already_served() {
    let first = Server::start(1, &[]);
    let out = Command::new(bin())
        .args([
            "--insecure-disable-auth",
            "--grpc-bind-address",
            &format!("127.0.0.1:{}", first.grpc_port),
            "--http-bind-address",
            "127.0.0.1:0",
            "--snapshot-bind-address",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not available"), "{err}");
}

#[test]
fn flag_validation_exits_2() {
    let run = |args: &[&str]| Command::new(bin()).args(args).output().unwrap();
    let out = run(&[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing --allowed-controller-sa"));
    let out = run(&["--insecure-disable-auth", "--allowed-controller-sa", "x"]);
    assert_eq!(out.status.code(), Some(2));
    let out = run(&["--insecure-disable-auth", "--tls-cert-file", "/tmp/x.pem"]);
    assert_eq!(out.status.code(), Some(2));
    let out = run(&["--insecure-disable-auth", "--log-format", "xml"]);
    assert_eq!(out.status.code(), Some(2));
    let out = run(&["--insecure-disable-auth", "--log-level", "loud"]);
    assert_eq!(out.status.code(), Some(2));
    let out = run(&["--insecure-disable-auth", "--shards", "0"]);
    assert_eq!(out.status.code(), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_and_exits_zero() {
    let mut srv = Server::start(2, &[]);
    let mut c = srv.client().await;
    let _ = c
        .lookup_route(exact_lookup("t", "m", "vllm", b"p", 1))
        .await
        .unwrap();
    let st = srv.terminate();
    assert_eq!(st.code(), Some(0));
}

/// Reports over one connection and reads back over another, for models whose partitions are
/// owned by each core: with `--shards 2` the two connections are served by different cores
/// (round-robin dealing), so one side of every pair crosses the hop.
async fn state_reported_on_one_core_is_read_on_another(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut writer = srv.client().await;
    let mut reader = srv.client().await;
    let models = models_per_core("t", shards.max(2));
    for (i, model) in models.iter().enumerate() {
        let hash = format!("prefix-{i}");
        let ack = report(
            &mut writer,
            vec![legacy_update(
                "r1",
                "t",
                model,
                "vllm",
                hash.as_bytes(),
                128,
            )],
        )
        .await;
        assert!(ack.accepted);
        let st = reader
            .get_cache_state(pb::GetCacheStateRequest {
                model_id: model.clone(),
                tenant_id: "t".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(st.summary.unwrap().total_prefixes, 1, "model {model}");
        let r = reader
            .lookup_route(exact_lookup("t", model, "vllm", hash.as_bytes(), 128))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.reason_code, "PREFIX_MATCH", "model {model}");
        assert_eq!(r.replica_scores.len(), 1);
        assert_eq!(r.replica_scores[0].replica_id, "r1");
        assert_eq!(r.replica_scores[0].matched_tokens, 128);
    }
    // Both cores served connections and executed hops.
    if shards == 2 {
        let (_, metrics) = http_get(srv.http_port, "/metrics").unwrap();
        for core in ["0", "1"] {
            let hopped = metrics
                .lines()
                .filter(|l| l.contains(&format!("core=\"{core}\"")) && l.contains("hop"))
                .count();
            assert!(
                hopped > 0,
                "no per-core hop series for core {core}:\n{metrics}"
            );
        }
    }
}

shards_1_and_2!(state_reported_on_one_core_is_read_on_another);

/// Connections are bounded per core: past `--max-connections-per-core`, a new connection is
/// closed at once while the admitted ones keep working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_per_core_bound_are_closed() {
    let srv = Server::start(1, &["--max-connections-per-core", "2"]);
    let mut a = srv.client().await;
    let mut b = srv.client().await;
    for c in [&mut a, &mut b] {
        c.lookup_route(exact_lookup("t", "m", "vllm", b"p", 1))
            .await
            .unwrap();
    }
    let refused = tonic::transport::Channel::from_shared(srv.grpc_url())
        .unwrap()
        .connect()
        .await;
    let third_works = match refused {
        Err(_) => false,
        Ok(ch) => pb::inference_cache_client::InferenceCacheClient::new(ch)
            .lookup_route(exact_lookup("t", "m", "vllm", b"p", 1))
            .await
            .is_ok(),
    };
    assert!(!third_works, "a third connection must be refused");
    a.lookup_route(exact_lookup("t", "m", "vllm", b"p", 1))
        .await
        .unwrap();
}
