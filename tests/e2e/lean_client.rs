//! The gateway SDK's lean `LookupRoute` client (`inferencecache_gateway::LookupConnection`)
//! against the real server: the same answers as tonic's client, gRPC errors as statuses on a
//! connection that stays usable, deadlines, and a new connection after the old one failed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inferencecache_gateway::{Dial, LookupConnection, request_from_tokens};

use crate::support::*;

const BLOCK: usize = 16;

fn tokens(m: u32) -> Vec<u32> {
    (0..8 * BLOCK as u32).map(|t| t + 1000 * m).collect()
}

/// Reports one 8-block prompt per model `m < models`, held by replica `r-<m>`.
async fn populate(srv: &Server, models: u32) {
    let mut c = srv.client().await;
    for m in 0..models {
        let (hashes, counts) = fingerprint_chain(&tokens(m), BLOCK);
        let hashes: Vec<&[u8]> = hashes.iter().map(|h| h.as_slice()).collect();
        let mut u = chain_update(
            &format!("r-{m}"),
            "t",
            &format!("model-{m}"),
            "vllm",
            &hashes,
            &counts,
        );
        u.timestamp_us = fresh_ts();
        assert!(report(&mut c, vec![u]).await.accepted);
    }
}

/// A dial to `127.0.0.1:port` that counts the connections it opens.
fn counting_dial(port: u16) -> (Dial, Arc<AtomicUsize>) {
    let dials = Arc::new(AtomicUsize::new(0));
    let counter = dials.clone();
    let dial: Dial = Arc::new(move || {
        counter.fetch_add(1, Ordering::Relaxed);
        Box::pin(tokio::net::TcpStream::connect(("127.0.0.1", port)))
    });
    (dial, dials)
}

fn lean(srv: &Server) -> LookupConnection {
    LookupConnection::plain(&format!("127.0.0.1:{}", srv.grpc_port)).unwrap()
}

/// Every answer equals tonic's for the same request (hits, misses, raw token ids).
async fn answers_equal_tonics(shards: usize) {
    let srv = Server::start(shards, &[]);
    populate(&srv, 8).await;
    let conn = lean(&srv);
    let mut tonic_client = srv.client().await;
    for m in 0..12 {
        let mut requests = vec![request_from_tokens(
            "t",
            &format!("model-{m}"),
            "vllm",
            &tokens(m),
            BLOCK as i32,
        )];
        let mut raw = requests[0].clone();
        raw.block_hashes.clear();
        raw.block_token_counts.clear();
        raw.token_ids = tokens(m);
        requests.push(raw);
        for req in requests {
            let mut ours = conn
                .lookup_route(&req, Duration::from_secs(5))
                .await
                .unwrap();
            let theirs = lookup(&mut tonic_client, req).await;
            if m < 8 {
                assert_eq!(ours.reason_code, "PREFIX_MATCH");
            }
            ours.lookup_latency_us = theirs.lookup_latency_us;
            assert_eq!(ours, theirs, "model-{m}");
        }
    }
}
shards_1_and_2!(answers_equal_tonics);

/// A request over the 4 MiB receive limit gets RESOURCE_EXHAUSTED as a status, and the same
/// connection then answers the next lookup.
async fn a_grpc_error_is_a_status_and_the_connection_stays(shards: usize) {
    let srv = Server::start(shards, &[]);
    populate(&srv, 1).await;
    let (dial, dials) = counting_dial(srv.grpc_port);
    let conn = LookupConnection::new("127.0.0.1", dial).unwrap();
    let mut big = request_from_tokens("t", "model-0", "vllm", &tokens(0), BLOCK as i32);
    big.prefix_hash = vec![0xab; 5 << 20];
    let err = conn
        .lookup_route(&big, Duration::from_secs(10))
        .await
        .expect_err("a 5 MiB LookupRoute is refused");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    let ok = request_from_tokens("t", "model-0", "vllm", &tokens(0), BLOCK as i32);
    let a = conn
        .lookup_route(&ok, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(a.reason_code, "PREFIX_MATCH");
    assert_eq!(
        dials.load(Ordering::Relaxed),
        1,
        "one connection for both calls"
    );
}
shards_1_and_2!(a_grpc_error_is_a_status_and_the_connection_stays);

/// A call that cannot finish within its timeout ends with DEADLINE_EXCEEDED at about the
/// timeout: here the peer accepts the connection but never speaks HTTP/2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_times_out() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let conn = LookupConnection::plain(&format!("127.0.0.1:{port}")).unwrap();
    let req = request_from_tokens("t", "m", "vllm", &tokens(0), BLOCK as i32);
    let started = Instant::now();
    let err = conn
        .lookup_route(&req, Duration::from_millis(300))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "{took:?}"
    );
    drop(listener);
}

/// After the server goes away a call fails UNAVAILABLE; the next call dials again and
/// reaches the new server.
async fn a_failed_connection_is_reopened(shards: usize) {
    let mut first = Server::start(shards, &[]);
    let target = Arc::new(Mutex::new(first.grpc_port));
    let dial_target = target.clone();
    let dial: Dial = Arc::new(move || {
        let port = *dial_target.lock().unwrap();
        Box::pin(tokio::net::TcpStream::connect(("127.0.0.1", port)))
    });
    let conn = LookupConnection::new("127.0.0.1", dial).unwrap();
    let req = request_from_tokens("t", "model-0", "vllm", &tokens(0), BLOCK as i32);
    let a = conn
        .lookup_route(&req, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(a.reason_code, "NO_HINT", "empty index");

    first.terminate();
    let err = conn
        .lookup_route(&req, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");

    let second = Server::start(shards, &[]);
    populate(&second, 1).await;
    *target.lock().unwrap() = second.grpc_port;
    // The first call after a failure may still meet the old connection's remains; within a
    // few calls the new server answers.
    let mut answered = None;
    for _ in 0..3 {
        if let Ok(a) = conn.lookup_route(&req, Duration::from_secs(5)).await {
            answered = Some(a);
            break;
        }
    }
    assert_eq!(answered.expect("reconnected").reason_code, "PREFIX_MATCH");
}
shards_1_and_2!(a_failed_connection_is_reopened);
