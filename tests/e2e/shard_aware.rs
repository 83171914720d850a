//! The shard-aware listener (`--shard-aware-grpc-bind-address`) with the gateway SDK
//! (`inferencecache-gateway`): each connection is served by the core its source port names, the
//! SDK sends every LookupRoute to the owning core, and no request hops; the same traffic over
//! plain connections does hop. Answers are the same either way.

use std::time::Duration;

use inferencecache_gateway::{ShardAwareClient, request_from_tokens};

use crate::support::*;

/// A server with the shard-aware listener on loopback port 0; returns it and the port it got.
fn shard_aware_server(shards: usize, extra: &[&str]) -> (Server, u16) {
    let mut flags = vec!["--shard-aware-grpc-bind-address", "127.0.0.1:0"];
    flags.extend_from_slice(extra);
    let srv = Server::start(shards, &flags);
    let port = srv
        .shard_aware_port
        .expect("the shard-aware listener's port");
    (srv, port)
}

/// `inferencecache_core_requests_total` summed over cores, per path.
fn routed(srv: &Server) -> (f64, f64) {
    let text = metrics_text(srv);
    let sum = |path: &str| -> f64 {
        (0..srv.shards)
            .map(|core| {
                metric_value(
                    &text,
                    &format!(
                        "inferencecache_core_requests_total{{core=\"{core}\",path=\"{path}\"}}"
                    ),
                )
                .unwrap_or(0.0)
            })
            .sum()
    };
    (sum("inline"), sum("hopped"))
}

const BLOCK: usize = 16;
const MODELS: usize = 24;

/// Tokens of model `m`'s cached prompt: 8 blocks (over the default minimum prefix).
fn tokens(m: usize) -> Vec<u32> {
    (0..8 * BLOCK as u32).map(|t| t + 1000 * m as u32).collect()
}

/// Reports one 8-block prompt per model (spread over every core), held by replica `r-<m>`
/// (and another prompt held by replica `idle`).
async fn populate(srv: &Server) {
    let mut c = srv.client().await;
    for m in 0..MODELS {
        let (hashes, counts) = fingerprint_chain(&tokens(m), BLOCK);
        let hashes: Vec<&[u8]> = hashes.iter().map(|h| h.as_slice()).collect();
        let model = format!("model-{m}");
        let mut u = chain_update(&format!("r-{m}"), "t", &model, "vllm", &hashes, &counts);
        u.timestamp_us = fresh_ts();
        // A second replica holding something else, so the match distinguishes.
        let (other, _) = fingerprint_chain(&tokens(MODELS + m), BLOCK);
        let other: Vec<&[u8]> = other.iter().map(|h| h.as_slice()).collect();
        let mut o = chain_update("idle", "t", &model, "vllm", &other, &counts);
        o.timestamp_us = fresh_ts();
        let ack = report(&mut c, vec![u, o]).await;
        assert!(ack.accepted, "{ack:?}");
    }
}

async fn sdk_lookups_never_hop(shards: usize) {
    let (srv, port) = shard_aware_server(shards, &[]);
    populate(&srv).await;
    let sdk = ShardAwareClient::connect(format!("127.0.0.1:{port}").parse().unwrap())
        .await
        .expect("shard-aware connect");
    assert_eq!(sdk.shards(), shards);
    let mut plain = srv.client().await;

    let before = routed(&srv);
    let mut sdk_answers = Vec::new();
    for round in 0..4 {
        for m in 0..MODELS {
            let req =
                request_from_tokens("t", &format!("model-{m}"), "vllm", &tokens(m), BLOCK as i32);
            let a = sdk
                .try_lookup_route(req, Duration::from_secs(5))
                .await
                .unwrap();
            if round == 0 {
                sdk_answers.push(a);
            }
        }
    }
    let after_sdk = routed(&srv);
    let n = (4 * MODELS) as f64;
    assert_eq!(after_sdk.1 - before.1, 0.0, "no SDK request hops");
    assert_eq!(after_sdk.0 - before.0, n, "every SDK request runs inline");

    for (m, sdk_answer) in sdk_answers.iter().enumerate() {
        let req = request_from_tokens("t", &format!("model-{m}"), "vllm", &tokens(m), BLOCK as i32);
        let mut plain_answer = lookup(&mut plain, req).await;
        assert_eq!(sdk_answer.reason_code, "PREFIX_MATCH");
        assert_eq!(sdk_answer.replica_scores[0].replica_id, format!("r-{m}"));
        plain_answer.lookup_latency_us = sdk_answer.lookup_latency_us;
        assert_eq!(
            &plain_answer, sdk_answer,
            "the same answer over either listener"
        );
    }
    let after_plain = routed(&srv);
    if shards > 1 {
        assert!(
            after_plain.1 > after_sdk.1,
            "plain connections do hop (the metric sees hops): {after_sdk:?} -> {after_plain:?}"
        );
    }
}
shards_1_and_2!(sdk_lookups_never_hop);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_lookups_never_hop_with_more_shards_than_cpus() {
    sdk_lookups_never_hop(4).await
}

/// Health answers on either listener name the shard count and the serving core.
async fn health_names_the_sharding(shards: usize) {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let (srv, _) = shard_aware_server(shards, &[]);
    let answer = HealthClient::new(srv.channel().await)
        .check(HealthCheckRequest::default())
        .await
        .unwrap();
    let header = |name: &str| {
        answer
            .metadata()
            .get(name)
            .unwrap()
            .to_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(header("inferencecache-shards"), shards.to_string());
    assert!(header("inferencecache-shard").parse::<usize>().unwrap() < shards);
    assert_eq!(header("inferencecache-partitions"), "256");
    assert_eq!(
        header("inferencecache-partition-function"),
        inferencecache_gateway::PARTITION_FUNCTION
    );
}
shards_1_and_2!(health_names_the_sharding);

/// The SDK fails open: once the server is gone, a lookup answers NO_HINT within its timeout.
async fn sdk_fails_open(shards: usize) {
    let (mut srv, port) = shard_aware_server(shards, &[]);
    let sdk = ShardAwareClient::connect(format!("127.0.0.1:{port}").parse().unwrap())
        .await
        .unwrap();
    srv.terminate();
    let started = std::time::Instant::now();
    let req = request_from_tokens("t", "m", "vllm", &tokens(0), BLOCK as i32);
    let a = sdk.lookup_route(req, Duration::from_millis(300)).await;
    assert_eq!(a.reason_code, "NO_HINT");
    assert!(a.replica_scores.is_empty());
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}
shards_1_and_2!(sdk_fails_open);

/// Busy-poll: cores spin before parking and still answer; an over-long spin is refused.
async fn busy_poll_serves(shards: usize) {
    let (srv, port) = shard_aware_server(shards, &["--busy-poll-us", "50"]);
    populate(&srv).await;
    let sdk = ShardAwareClient::connect(format!("127.0.0.1:{port}").parse().unwrap())
        .await
        .unwrap();
    let req = request_from_tokens("t", "model-1", "vllm", &tokens(1), BLOCK as i32);
    let a = sdk
        .try_lookup_route(req, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(a.reason_code, "PREFIX_MATCH");
}
shards_1_and_2!(busy_poll_serves);

#[test]
fn an_over_long_busy_poll_is_refused() {
    let out = std::process::Command::new(bin())
        .args(["--insecure-disable-auth", "--busy-poll-us", "5000"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--busy-poll-us"));
}
