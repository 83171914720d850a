//! Engine events end to end over real sockets: a test ZMQ publisher speaking the
//! vLLM wire format → the kvevent-subscriber pipeline → the real server binary → LookupRoute.

use std::time::{Duration, Instant};

use crate::support::*;
use bytes::Bytes;
use rmpv::Value;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

/// Tokens per engine block in this test: large enough that two blocks (128 tokens) pass the
/// server's default 64-token matched floor, so shrinking matches stay visible as PREFIX_MATCH.
pub(crate) const BS: u32 = 64;

pub(crate) fn batch(events: Vec<Value>) -> Bytes {
    let mut out = Vec::new();
    // ts 0 → timestamp_us 0 → "now" at the server.
    rmpv::encode::write_value(
        &mut out,
        &Value::Array(vec![Value::F64(0.0), Value::Array(events), Value::from(0)]),
    )
    .unwrap();
    Bytes::from(out)
}

pub(crate) fn stored(hashes: &[u64], tokens: std::ops::Range<u32>) -> Value {
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

pub(crate) async fn publish(p: &mut PubSocket, seq: u64, body: Bytes) {
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
pub(crate) async fn eventually(
    srv: &Server,
    tokens: std::ops::Range<u32>,
    reason: &str,
    matched: i32,
) {
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

pub(crate) async fn subscriber_batches(port: u16) -> f64 {
    let Ok((_, body)) = http_get(port, "/metrics") else {
        return 0.0;
    };
    body.lines()
        .find(|l| l.starts_with("kvevent_batches_total"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// The real subscriber run in this process with `args`, and the sender that stops it (a send,
/// or dropping it, ends the run).
pub(crate) fn spawn_subscriber(
    args: kvevent_subscriber::cli::Args,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<impl Sized>,
) {
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let sub = tokio::spawn(kvevent_subscriber::app::run(args, async move {
        let _ = stop_rx.await;
    }));
    (stop_tx, sub)
}

/// Publishes empty batches until the subscriber (metrics on `metrics_port`) has received one:
/// a ZMQ SUB socket misses what was published before it joined. Returns the next sequence
/// number to publish. Panics if the subscriber stops or 30 s pass.
pub(crate) async fn prime_subscriber<T>(
    pub_sock: &mut PubSocket,
    metrics_port: u16,
    sub: &tokio::task::JoinHandle<T>,
) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seq = 0u64;
    while subscriber_batches(metrics_port).await < 1.0 {
        assert!(!sub.is_finished(), "the subscriber stopped");
        assert!(
            Instant::now() < deadline,
            "subscriber never received a batch"
        );
        publish(pub_sock, seq, batch(vec![])).await;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    seq
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
    let (stop_tx, sub) = spawn_subscriber(args);

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

    // The subscriber sends its producer epoch: the server records it for (t, engine-0), and an
    // older producer of that replica (a zombie sidecar) is fenced.
    assert_eq!(
        metric_value(&metrics_text(&srv), "inferencecache_producer_epochs"),
        Some(1.0)
    );
    let mut zombie = srv.client().await;
    let mut req = tonic::Request::new(tokio_stream::iter(vec![legacy_update(
        "engine-0", "t", "m", "vllm", b"zombie", 16,
    )]));
    req.metadata_mut()
        .insert("x-producer-epoch", "1-zombie".parse().unwrap());
    let ack = zombie.report_cache_state(req).await.unwrap().into_inner();
    assert_eq!((ack.accepted, ack.reason_code.as_str()), (false, "FENCED"));

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

// ---------------------------------------------------------------- engine fixtures

/// Messages recorded from the engines' own publisher code (kvevent-subscriber/tests/data/engines,
/// regenerated by gen_fixtures.py there): `[topic, seq, payload]` per message.
fn fixture_frames(text: &str) -> Vec<Vec<Bytes>> {
    let unhex = |s: &str| -> Bytes {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect::<Vec<u8>>()
            .into()
    };
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split(' ').map(unhex).collect())
        .collect()
}

const VLLM_FRAMES: &str =
    include_str!("../../kvevent-subscriber/tests/data/engines/vllm-0.34.0.frames");
const SGLANG_FRAMES: &str =
    include_str!("../../kvevent-subscriber/tests/data/engines/sglang-0.5.23.frames");

/// What a LoRA-aware gateway asks: LookupRoute by token ids within `adapter`'s partition.
/// Returns (reason, matched tokens, replica, tier) of the top score.
async fn lookup_adapter(
    srv: &Server,
    start: u32,
    blocks: u32,
    adapter: &str,
) -> (String, i32, String, i32) {
    let mut c = srv.client().await;
    let r = c
        .lookup_route(pb::LookupRouteRequest {
            model_id: "m".into(),
            tenant_id: "t".into(),
            hash_scheme: "vllm".into(),
            token_ids: (start..start + blocks * 16).collect(),
            adapter_id: adapter.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let top = r.replica_scores.first();
    (
        r.reason_code,
        top.map_or(0, |s| s.matched_tokens),
        top.map_or_else(String::new, |s| s.replica_id.clone()),
        top.map_or(0, |s| s.tier),
    )
}

/// Polls until `check` accepts the lookup answer (events are asynchronous); 30 s bound.
async fn eventually_adapter(
    srv: &Server,
    start: u32,
    blocks: u32,
    adapter: &str,
    what: &str,
    check: impl Fn(&(String, i32, String, i32)) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let last = lookup_adapter(srv, start, blocks, adapter).await;
        if check(&last) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: tokens {start}.. adapter {adapter:?}: last answer {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A subscriber (the library pipeline the binary runs) on a fresh PUB socket, warmed up on
/// the `kv-warm` topic so the fixtures' own seqs start clean. Returns the publisher, the stop
/// handle and the metrics port.
async fn fixture_subscriber(
    srv: &Server,
    replica: &str,
    extra: &[&str],
) -> (
    PubSocket,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
    u16,
) {
    fixture_subscriber_warm(srv, replica, extra, b"kv-warm").await
}

/// [`fixture_subscriber`] warming up on topic `warm`.
async fn fixture_subscriber_warm(
    srv: &Server,
    replica: &str,
    extra: &[&str],
    warm: &'static [u8],
) -> (
    PubSocket,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
    u16,
) {
    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let metrics_port = free_port();
    let mut argv = vec![
        "kvevent-subscriber".to_string(),
        "--endpoint".into(),
        ep.to_string(),
        "--topic".into(),
        "kv".into(),
        "--server".into(),
        format!("127.0.0.1:{}", srv.grpc_port),
        "--replica-id".into(),
        replica.into(),
        "--model-id".into(),
        "m".into(),
        "--tenant-id".into(),
        "t".into(),
        "--flush-interval".into(),
        "10ms".into(),
        "--metrics-bind".into(),
        format!("127.0.0.1:{metrics_port}"),
    ];
    argv.extend(extra.iter().map(|s| s.to_string()));
    let args = <kvevent_subscriber::cli::Args as clap::Parser>::parse_from(argv);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let run = kvevent_subscriber::app::run(args, async move {
            let _ = stop_rx.await;
        });
        if let Err(e) = run.await {
            panic!("subscriber failed: {e:#}");
        }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    for seq in 0u64.. {
        let msg = ZmqMessage::try_from(vec![
            Bytes::from_static(warm),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            batch(vec![]),
        ])
        .unwrap();
        pub_sock.send(msg).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        if subscriber_batches(metrics_port).await >= 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "subscriber never received a batch"
        );
    }
    (pub_sock, stop_tx, task, metrics_port)
}

/// The recorded batch with its timestamp set to now (as if the engine published it now; the
/// server treats entries stamped months ago as expired). Both engines encode the batch as a
/// 3-element array whose first element is a float64: bytes `93 cb <8 bytes>`; every other byte
/// is left as the engine wrote it.
fn restamped(frames: &[Bytes]) -> Vec<Bytes> {
    let mut out = frames.to_vec();
    let payload = &frames[2];
    assert_eq!(
        &payload[..2],
        &[0x93, 0xcb],
        "array batch with a float64 ts"
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let mut p = payload.to_vec();
    p[2..10].copy_from_slice(&now.to_be_bytes());
    out[2] = Bytes::from(p);
    out
}

/// Sends fixture messages (restamped) and waits until the subscriber has decoded each one.
async fn send_fixture(p: &mut PubSocket, metrics_port: u16, frames: &[Vec<Bytes>]) {
    for f in frames {
        let before = subscriber_batches(metrics_port).await;
        p.send(ZmqMessage::try_from(restamped(f)).unwrap())
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while subscriber_batches(metrics_port).await < before + 1.0 {
            assert!(Instant::now() < deadline, "fixture message not received");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn full_match(a: &(String, i32, String, i32)) -> bool {
    a.0 == "PREFIX_MATCH" && a.1 == 64
}

fn no_match(a: &(String, i32, String, i32)) -> bool {
    a.0 != "PREFIX_MATCH" && a.1 == 0
}

/// vLLM 0.34.0's own messages → subscriber → real server: LoRA blocks (adapter name in
/// `extra_keys`, by number and by name) are found in their adapter's partition and not by a
/// base-model lookup; salted and multimodal blocks are not indexed; a sliding-window group does
/// not evict the full-attention blocks; CPU offload keeps blocks (tier T2); 32-byte hashes chain;
/// AllBlocksCleared empties the replica.
async fn vllm_0_34_fixtures_route_by_adapter(shards: usize) {
    let srv = Server::start(shards, &[]);
    let frames = fixture_frames(VLLM_FRAMES);
    let (mut p, stop, task, mport) =
        fixture_subscriber(&srv, "vllm-0", &["--lora-adapter-names", "1=sql-lora"]).await;
    send_fixture(&mut p, mport, &frames[..10]).await;
    let full = |a: &(String, i32, String, i32)| full_match(a) && a.2 == "vllm-0";
    eventually_adapter(&srv, 1000, 4, "", "base prompt", full).await;
    eventually_adapter(&srv, 2000, 4, "sql-lora", "LoRA by number", full).await;
    eventually_adapter(&srv, 2500, 4, "chat-lora", "LoRA by name", full).await;
    eventually_adapter(&srv, 7000, 4, "", "32-byte hashes", full).await;
    for (start, adapter, what) in [
        (2000, "", "base lookup of LoRA-only KV"),
        (2500, "", "base lookup of LoRA-only KV"),
        (2000, "chat-lora", "other adapter"),
        (3000, "", "salted"),
        (4000, "sql-lora", "salted LoRA"),
        (5000, "", "multimodal"),
        (6000, "", "sliding-window group"),
    ] {
        eventually_adapter(&srv, start, 4, adapter, what, no_match).await;
    }
    // The LoRA prompt's tail went to CPU before leaving the GPU: still matched, colder tier.
    eventually_adapter(&srv, 2000, 4, "sql-lora", "offloaded tail", |a| {
        full(a) && a.3 == pb::CacheTier::T2 as i32
    })
    .await;
    // The base prompt's last block leaves the GPU (group 0): 48 tokens remain, under the
    // 64-token floor.
    send_fixture(&mut p, mport, &frames[10..11]).await;
    eventually_adapter(&srv, 1000, 4, "", "after removal", |a| {
        a.0 != "PREFIX_MATCH"
    })
    .await;
    send_fixture(&mut p, mport, &frames[11..]).await;
    for (start, adapter) in [(2000, "sql-lora"), (2500, "chat-lora"), (7000, "")] {
        eventually_adapter(&srv, start, 4, adapter, "after AllBlocksCleared", |a| {
            a.0 != "PREFIX_MATCH"
        })
        .await;
    }
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
}

shards_1_and_2!(vllm_0_34_fixtures_route_by_adapter);

/// SGLang 0.5.23's own messages (attention-DP rank 1) → subscriber → real server: the
/// `lora_name`-only adapter lands in its partition, `cache_salt` blocks are not indexed, and
/// offload media become tiers (CPU_PINNED → T2 after the GPU copy leaves, DISK → T3).
async fn sglang_0_5_23_fixtures_route_by_adapter(shards: usize) {
    let srv = Server::start(shards, &[]);
    let frames = fixture_frames(SGLANG_FRAMES);
    let (mut p, stop, task, mport) =
        fixture_subscriber(&srv, "sg", &["--replica-per-dp-rank"]).await;
    send_fixture(&mut p, mport, &frames[..5]).await;
    let full = |a: &(String, i32, String, i32)| full_match(a) && a.2 == "sg-dp1";
    eventually_adapter(&srv, 11000, 4, "", "base prompt", full).await;
    eventually_adapter(&srv, 12000, 4, "sql-lora", "LoRA by name", full).await;
    eventually_adapter(&srv, 14000, 4, "", "disk tier", |a| {
        full(a) && a.3 == pb::CacheTier::T3 as i32
    })
    .await;
    eventually_adapter(&srv, 12000, 4, "", "base lookup of LoRA-only KV", no_match).await;
    eventually_adapter(&srv, 13000, 4, "", "cache_salt", no_match).await;
    send_fixture(&mut p, mport, &frames[5..]).await;
    eventually_adapter(&srv, 11000, 4, "", "after AllBlocksCleared", |a| {
        a.0 != "PREFIX_MATCH"
    })
    .await;
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
}

shards_1_and_2!(sglang_0_5_23_fixtures_route_by_adapter);

/// The engine's replay ROUTER over `buffer` (seq → frames as published): every buffered batch
/// with `seq >= start` as `[topic, seq, payload]`, then the end marker.
async fn replay_router(
    buffer: std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<u64, Vec<Bytes>>>>,
) -> String {
    use zeromq::{RouterSocket, SocketRecv};
    let mut router = RouterSocket::new();
    let ep = router.bind("tcp://127.0.0.1:0").await.unwrap();
    tokio::spawn(async move {
        while let Ok(msg) = router.recv().await {
            let frames = msg.into_vec();
            let id = frames[0].clone();
            let Ok(start) = frames.last().unwrap()[..]
                .try_into()
                .map(u64::from_be_bytes)
            else {
                continue;
            };
            let items: Vec<Vec<Bytes>> = buffer
                .lock()
                .unwrap()
                .range(start..)
                .map(|(_, f)| f.clone())
                .collect();
            for f in items {
                let mut out = vec![id.clone(), Bytes::new()];
                out.extend(f);
                router
                    .send(ZmqMessage::try_from(out).unwrap())
                    .await
                    .unwrap();
            }
            let end = vec![
                id,
                Bytes::new(),
                Bytes::new(),
                Bytes::from_static(&[0xFF; 8]),
                Bytes::new(),
            ];
            router
                .send(ZmqMessage::try_from(end).unwrap())
                .await
                .unwrap();
        }
    });
    ep.to_string()
}

/// The subscriber stops mid-stream (vLLM 0.34.0's own messages), the engine keeps
/// publishing, the subscriber restarts with the same `--state-file` and catches up through the
/// replay socket: every batch, including LoRA blocks chained after the restart, is in the real
/// server's index once the replay completes.
async fn restarted_subscriber_catches_up_into_the_server(shards: usize) {
    let srv = Server::start(shards, &[]);
    let frames: Vec<Vec<Bytes>> = fixture_frames(VLLM_FRAMES)
        .iter()
        .map(|f| restamped(f))
        .collect();
    let buffer = std::sync::Arc::new(std::sync::Mutex::new(std::collections::BTreeMap::new()));
    let rep = replay_router(buffer.clone()).await;
    let dir = std::env::temp_dir().join(format!("ic-e2e-resume-{}-{shards}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("state");
    let _ = std::fs::remove_file(&state);
    let state_s = state.to_string_lossy().into_owned();
    let flags = [
        "--lora-adapter-names",
        "1=sql-lora",
        "--replay-endpoint",
        rep.as_str(),
        "--state-file",
        state_s.as_str(),
        "--ack-interval",
        "100ms",
    ];
    let seq_of = |f: &Vec<Bytes>| u64::from_be_bytes(f[1][..].try_into().unwrap());
    let (mut p, stop, task, mport) = fixture_subscriber(&srv, "vllm-0", &flags).await;
    // Messages 0..3 (base, LoRA by number, LoRA by name) live, and kept by the engine.
    for f in &frames[..3] {
        buffer.lock().unwrap().insert(seq_of(f), f.clone());
    }
    send_fixture_exact(&mut p, mport, &frames[..3]).await;
    eventually_adapter(&srv, 2500, 4, "chat-lora", "before the stop", full_match).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&state)
        .unwrap_or_default()
        .contains("v1 6b76 0 2")
    {
        assert!(Instant::now() < deadline, "state file never reached seq 2");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
    drop(p);

    // While no subscriber listens the engine publishes messages 3..10 (salted, multimodal,
    // hybrid, offload, 32-byte hashes, the removal); the replay buffer keeps them.
    for f in &frames[3..11] {
        buffer.lock().unwrap().insert(seq_of(f), f.clone());
    }
    // A warm-up topic of its own, so the restarted subscriber's warm-up is not a restart of
    // the first one's warm-up publisher.
    let (_p, stop, task, mport) =
        fixture_subscriber_warm(&srv, "vllm-0", &flags, b"kv-warm2").await;
    // The offloaded LoRA tail (message 7) is now T2; the 32-byte chain (8, 9) is indexed; the
    // base prompt lost its last block (10).
    eventually_adapter(&srv, 2000, 4, "sql-lora", "offload after restart", |a| {
        full_match(a) && a.3 == pb::CacheTier::T2 as i32
    })
    .await;
    eventually_adapter(&srv, 7000, 4, "", "32-byte chain after restart", full_match).await;
    eventually_adapter(&srv, 1000, 4, "", "removal after restart", |a| {
        a.0 != "PREFIX_MATCH"
    })
    .await;
    eventually_adapter(&srv, 3000, 4, "", "salted", no_match).await;
    eventually_adapter(
        &srv,
        2500,
        4,
        "chat-lora",
        "kept from before the stop",
        full_match,
    )
    .await;
    let (_, body) = http_get(mport, "/metrics").unwrap();
    let metric = |name: &str| {
        body.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert_eq!(metric("kvevent_lost_tail_batches_total"), 8.0);
    assert_eq!(metric("kvevent_engine_restarts_total"), 0.0);
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
    let _ = std::fs::remove_dir_all(&dir);
}

shards_1_and_2!(restarted_subscriber_catches_up_into_the_server);

/// Sends already-restamped fixture messages and waits until the subscriber decoded each one.
async fn send_fixture_exact(p: &mut PubSocket, metrics_port: u16, frames: &[Vec<Bytes>]) {
    for f in frames {
        let before = subscriber_batches(metrics_port).await;
        p.send(ZmqMessage::try_from(f.clone()).unwrap())
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while subscriber_batches(metrics_port).await < before + 1.0 {
            assert!(Instant::now() < deadline, "fixture message not received");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

// ---------------------------------------------------------------- TLS and credentials

/// The subscriber against the real server over TLS (`--tls-cert-file`): `https://` with
/// `--server-ca-file`, a client certificate and a bearer token file. Engine events reach
/// LookupRoute (asked over TLS too), so the subscriber's own TLS connector, ALPN and `https`
/// origin work with the server's HTTP/2 layer, and the server's producer checks admit it: the
/// server verifies the client certificate against `--client-ca-file`, requires an identity
/// (`--require-producer-auth`) and finds the certificate's SPIFFE SAN bound to this replica and
/// tenant in `--producer-policy`; nothing is refused. (The TLS test double in
/// kvevent-subscriber/tests/credentials.rs checks that the token and epoch are presented too.)
async fn subscriber_over_tls_with_credentials(shards: usize) {
    use tonic::transport::{Certificate, Channel, ClientTlsConfig};
    const SPIFFE: &str = "spiffe://cluster.test/ns/llm/sa/engine-0";
    let all = gen_pki("server");
    let (client_ca, clients) = gen_client_certs("engines", &[&[SPIFFE]]);
    let dir = scratch_dir("kvevents-tls");
    let file = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let (ca, cert, key) = (
        file("ca.pem", &all.ca_pem),
        file("tls.crt", &all.cert_pem),
        file("tls.key", &all.key_pem),
    );
    let (ccert, ckey) = (
        file("client.crt", &clients[0].cert_pem),
        file("client.key", &clients[0].key_pem),
    );
    let client_ca = file("client-ca.pem", &client_ca);
    let policy = file(
        "producers.yaml",
        &format!(
            "bindings:\n  - identities: [\"{SPIFFE}\"]\n    replicas: [\"engine-0\"]\n    tenants: [\"t\"]\n"
        ),
    );
    let token = file("token", "producer-token\n");
    let srv = Server::start(
        shards,
        &[
            "--engine-block-size",
            &BS.to_string(),
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "--client-ca-file",
            &client_ca,
            "--producer-policy",
            &policy,
            "--require-producer-auth",
        ],
    );
    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let metrics_port = free_port();
    let server = format!("https://localhost:{}", srv.grpc_port);
    let args = <kvevent_subscriber::cli::Args as clap::Parser>::parse_from([
        "kvevent-subscriber",
        "--endpoint",
        &ep.to_string(),
        "--topic",
        "kv",
        "--server",
        &server,
        "--server-ca-file",
        &ca,
        "--client-cert-file",
        &ccert,
        "--client-key-file",
        &ckey,
        "--token-file",
        &token,
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
    let (stop_tx, sub) = spawn_subscriber(args);
    let seq = prime_subscriber(&mut pub_sock, metrics_port, &sub).await;
    publish(
        &mut pub_sock,
        seq,
        batch(vec![stored(&[41, 42], 0..2 * BS)]),
    )
    .await;

    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&all.ca_pem))
        .domain_name("localhost");
    let ch = Channel::from_shared(server.clone())
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .expect("TLS client");
    let mut client = pb::inference_cache_client::InferenceCacheClient::new(ch);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = client
            .lookup_route(pb::LookupRouteRequest {
                model_id: "m".into(),
                tenant_id: "t".into(),
                hash_scheme: "vllm".into(),
                token_ids: (0..2 * BS).collect(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let top = r.replica_scores.first().map(|s| s.matched_tokens);
        if r.reason_code == "PREFIX_MATCH" && top == Some(2 * BS as i32) {
            assert_eq!(r.replica_scores[0].replica_id, "engine-0");
            break;
        }
        assert!(Instant::now() < deadline, "never matched: {r:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let text = metrics_text(&srv);
    let refused = text
        .lines()
        .filter(|l| l.starts_with("inferencecache_producer_refused_total{"))
        .any(|l| !l.ends_with(" 0"));
    assert!(!refused, "the authorised subscriber was refused:\n{text}");
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(15), sub).await;
}

shards_1_and_2!(subscriber_over_tls_with_credentials);

/// One in-process subscriber of replica `engine-0` fed by its own engine socket.
struct EngineSidecar {
    engine: PubSocket,
    metrics_port: u16,
    seq: u64,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), String>>,
}

impl EngineSidecar {
    /// Starts it against `srv` (its producer epoch is drawn now) and waits until it listens.
    async fn start(srv: &Server) -> EngineSidecar {
        let mut engine = PubSocket::new();
        let ep = engine.bind("tcp://127.0.0.1:0").await.unwrap();
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
            "--ack-interval",
            "100ms",
            "--metrics-bind",
            &format!("127.0.0.1:{metrics_port}"),
        ]);
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let run = kvevent_subscriber::app::run(args, async move {
                let _ = stop_rx.await;
            });
            run.await.map_err(|e| format!("{e:#}"))
        });
        let seq = prime_subscriber(&mut engine, metrics_port, &task).await;
        EngineSidecar {
            engine,
            metrics_port,
            seq,
            stop,
            task,
        }
    }

    async fn send(&mut self, events: Vec<Value>) {
        publish(&mut self.engine, self.seq, batch(events)).await;
        self.seq += 1;
    }

    fn metric(&self, series: &str) -> f64 {
        http_get(self.metrics_port, "/metrics")
            .ok()
            .and_then(|(_, text)| metric_value(&text, series))
            .unwrap_or(0.0)
    }

    /// Waits (30 s at most) until `kvevent_fenced` is 1.
    async fn wait_fenced(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.metric("kvevent_fenced") != 1.0 {
            assert!(Instant::now() < deadline, "the sidecar never went idle");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn fenced_refusals(srv: &Server) -> f64 {
    metric_value(
        &metrics_text(srv),
        "inferencecache_producer_refused_total{identity=\"none\",reason=\"fenced\"}",
    )
    .unwrap_or(0.0)
}

/// Two zombie sidecars of replica engine-0 (started before the live one, so with older epochs):
/// once the server fences them — one through PublishEvent (FAILED_PRECONDITION), the other
/// through a ReportCacheState Ack (`FENCED`) — each goes idle for good: `kvevent_fenced` 1, no
/// retry of the refused message (the server's fenced count stops), later engine events dropped
/// and counted (`reason="fenced"`), never sent; the live sidecar keeps delivering.
async fn fenced_sidecars_go_idle(shards: usize) {
    let srv = Server::start(shards, &["--engine-block-size", &BS.to_string()]);
    let mut evicting = EngineSidecar::start(&srv).await;
    let mut storing = EngineSidecar::start(&srv).await;
    evicting.send(vec![stored(&[51, 52], 0..2 * BS)]).await;
    eventually(&srv, 0..2 * BS, "PREFIX_MATCH", 2 * BS as i32).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut live = EngineSidecar::start(&srv).await;
    live.send(vec![stored(&[51, 52], 0..2 * BS)]).await;
    // The live sidecar's epoch is recorded once its stream is acknowledged.
    let deadline = Instant::now() + Duration::from_secs(30);
    while live.metric("kvevent_updates_acked_total") < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the live sidecar was never acknowledged"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The zombie evicts what the live engine holds: PublishEvent is fenced, not retried.
    evicting.send(vec![removed(&[51, 52])]).await;
    evicting.wait_fenced().await;
    let refused = fenced_refusals(&srv);
    assert!(refused >= 1.0, "{refused}");
    // The other zombie stores: its stream's Ack says FENCED.
    storing
        .send(vec![stored(&[71, 72], 2000..2000 + 2 * BS)])
        .await;
    storing.wait_fenced().await;
    let refused = fenced_refusals(&srv);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(fenced_refusals(&srv), refused, "a fenced sidecar retried");
    // Later engine events are dropped and counted (one block and a clear, one block), never sent.
    const DROPPED: &str = "kvevent_dropped_total{reason=\"fenced\"}";
    let before = [evicting.metric(DROPPED), storing.metric(DROPPED)];
    evicting
        .send(vec![stored(&[91], 4000..4000 + BS), cleared()])
        .await;
    storing.send(vec![stored(&[92], 5000..5000 + BS)]).await;
    for (z, want) in [(&evicting, before[0] + 2.0), (&storing, before[1] + 1.0)] {
        let deadline = Instant::now() + Duration::from_secs(30);
        while z.metric(DROPPED) < want {
            assert!(Instant::now() < deadline, "later events not dropped");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        fenced_refusals(&srv),
        refused,
        "a fenced sidecar sent again"
    );
    eventually(&srv, 0..2 * BS, "PREFIX_MATCH", 2 * BS as i32).await;
    let (reason, _) = lookup(&srv, 2000..2000 + 2 * BS).await;
    assert_ne!(reason, "PREFIX_MATCH", "the zombie's blocks were applied");
    // The live sidecar goes on.
    live.send(vec![stored(&[81, 82], 3000..3000 + 2 * BS)])
        .await;
    eventually(&srv, 3000..3000 + 2 * BS, "PREFIX_MATCH", 2 * BS as i32).await;
    assert_eq!(live.metric("kvevent_fenced"), 0.0);
    for s in [evicting, storing, live] {
        let _ = s.stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(15), s.task).await;
    }
}

shards_1_and_2!(fenced_sidecars_go_idle);
