//! Engine events end to end over real sockets (issue 7): a test ZMQ publisher speaking the
//! vLLM wire format → the kvevent-subscriber pipeline → the real server binary → LookupRoute.

use std::time::{Duration, Instant};

use crate::support::*;
use bytes::Bytes;
use rmpv::Value;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

/// Tokens per engine block in this test: large enough that two blocks (128 tokens) pass the
/// server's default 64-token matched floor, so shrinking matches stay visible as PREFIX_MATCH.
const BS: u32 = 64;

fn batch(events: Vec<Value>) -> Bytes {
    let mut out = Vec::new();
    // ts 0 → timestamp_us 0 → "now" at the server.
    rmpv::encode::write_value(
        &mut out,
        &Value::Array(vec![Value::F64(0.0), Value::Array(events), Value::from(0)]),
    )
    .unwrap();
    Bytes::from(out)
}

fn stored(hashes: &[u64], tokens: std::ops::Range<u32>) -> Value {
    Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        (
            "block_hashes".into(),
            Value::Array(hashes.iter().map(|h| Value::from(*h)).collect()),
        ),
        ("parent_block_hash".into(), Value::Nil),
        (
            "token_ids".into(),
            Value::Array(tokens.map(Value::from).collect()),
        ),
        ("block_size".into(), Value::from(BS)),
        ("lora_id".into(), Value::Nil),
        ("medium".into(), "GPU".into()),
    ])
}

fn removed(hashes: &[u64]) -> Value {
    Value::Map(vec![
        ("type".into(), "BlockRemoved".into()),
        (
            "block_hashes".into(),
            Value::Array(hashes.iter().map(|h| Value::from(*h)).collect()),
        ),
        ("medium".into(), "GPU".into()),
    ])
}

fn cleared() -> Value {
    Value::Map(vec![("type".into(), "AllBlocksCleared".into())])
}

async fn publish(p: &mut PubSocket, seq: u64, body: Bytes) {
    let msg = ZmqMessage::try_from(vec![
        Bytes::from_static(b"kv"),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        body,
    ])
    .unwrap();
    p.send(msg).await.unwrap();
}

/// LookupRoute by token ids: (reason, matched tokens of the top score).
async fn lookup(srv: &Server, tokens: std::ops::Range<u32>) -> (String, i32) {
    let mut c = srv.client().await;
    let r = c
        .lookup_route(pb::LookupRouteRequest {
            model_id: "m".into(),
            tenant_id: "t".into(),
            hash_scheme: "vllm".into(),
            token_ids: tokens.collect(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let matched = r
        .replica_scores
        .first()
        .map(|s| s.matched_tokens)
        .unwrap_or(0);
    (r.reason_code, matched)
}

/// Polls until the lookup answers `(reason, matched)` (events are asynchronous), with a
/// generous deadline.
async fn eventually(srv: &Server, tokens: std::ops::Range<u32>, reason: &str, matched: i32) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let last = lookup(srv, tokens.clone()).await;
        if last.0 == reason && last.1 == matched {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "expected ({reason}, {matched}), last answer {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn subscriber_batches(port: u16) -> f64 {
    let Ok((_, body)) = http_get(port, "/metrics") else {
        return 0.0;
    };
    body.lines()
        .find(|l| l.starts_with("kvevent_batches_total"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

async fn engine_events_drive_lookups(shards: usize) {
    let srv = Server::start(shards, &["--engine-block-size", &BS.to_string()]);
    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let metrics_port = free_port();
    let args = <kvevent_subscriber::cli::Args as clap::Parser>::parse_from([
        "kvevent-subscriber",
        "--endpoint",
        &ep.to_string(),
        "--topic",
        "kv",
        "--server",
        &srv.grpc_url(),
        "--replica-id",
        "engine-0",
        "--model-id",
        "m",
        "--tenant-id",
        "t",
        "--flush-interval",
        "10ms",
        "--metrics-bind",
        &format!("127.0.0.1:{metrics_port}"),
    ]);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let sub = tokio::spawn(kvevent_subscriber::app::run(args, async move {
        let _ = stop_rx.await;
    }));

    // ZMQ slow joiner: publish empty batches (every 50 ms) until the subscriber's metrics show
    // it has received one; bounded by a generous deadline.
    let mut seq = 0u64;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        publish(&mut pub_sock, seq, batch(vec![])).await;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
        if subscriber_batches(metrics_port).await >= 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "subscriber never received a batch"
        );
    }

    // Four blocks stored (one engine hash ≥ 2^63) → the full 256-token prompt matches.
    let hashes = [11u64, 12, 13, u64::MAX - 5];
    publish(&mut pub_sock, seq, batch(vec![stored(&hashes, 0..4 * BS)])).await;
    seq += 1;
    eventually(&srv, 0..4 * BS, "PREFIX_MATCH", 256).await;

    // The last two blocks are evicted → the match shrinks to two blocks.
    publish(&mut pub_sock, seq, batch(vec![removed(&hashes[2..])])).await;
    seq += 1;
    eventually(&srv, 0..4 * BS, "PREFIX_MATCH", 128).await;

    // The engine clears its cache → a miss; the index is now empty, so the cold-start carve-out
    // answers NO_HINT (docs/BEHAVIOUR.md §8.5).
    publish(&mut pub_sock, seq, batch(vec![cleared()])).await;
    eventually(&srv, 0..4 * BS, "NO_HINT", 0).await;

    // Stored again, then the engine restarts (seq back to 0) and stores something else: the
    // subscriber clears the replica, so only the new prompt matches.
    publish(
        &mut pub_sock,
        seq + 1,
        batch(vec![stored(&hashes, 0..4 * BS)]),
    )
    .await;
    eventually(&srv, 0..4 * BS, "PREFIX_MATCH", 256).await;
    publish(
        &mut pub_sock,
        0,
        batch(vec![stored(&[21, 22], 1000..1000 + 2 * BS)]),
    )
    .await;
    eventually(&srv, 1000..1000 + 2 * BS, "PREFIX_MATCH", 128).await;
    let (reason, _) = lookup(&srv, 0..4 * BS).await;
    assert_ne!(
        reason, "PREFIX_MATCH",
        "entries from before the engine restart must be gone"
    );

    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(15), sub).await;
}

shards_1_and_2!(engine_events_drive_lookups);
