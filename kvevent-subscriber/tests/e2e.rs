//! End to end over real sockets: a ZMQ publisher in the test (same `zeromq` crate) → the
//! `kvevent-subscriber` binary → a gRPC test double of the InferenceCache server that records
//! every `ReportCacheState` message and `PublishEvent` call in arrival order, and keeps an
//! in-memory index built from them.

mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use inferencecache_fingerprint::prefix_hashes;
use inferencecache_proto::v1alpha1::cache_event::Type;
use inferencecache_proto::v1alpha1::inference_cache_server::InferenceCacheServer;
use inferencecache_proto::v1alpha1::*;
use rmpv::Value;
use support::{Ingest, IngestDouble};
use tokio::net::TcpListener;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const BIG: u64 = 15_760_518_052_499_183_552;
const BIG_AS_I64: i64 = -2_686_226_021_210_368_064;

// ---------------------------------------------------------------- test double server

/// One piece of traffic the double received.
#[derive(Debug, Clone, PartialEq)]
enum Rec {
    Update(CacheStateUpdate),
    Event(CacheEvent),
}

#[derive(Clone, Default)]
struct Double {
    log: Arc<Mutex<Vec<Rec>>>,
    /// When non-zero, the next stream fails (UNAVAILABLE) after applying this many messages,
    /// like a server crashing mid-stream before its Ack.
    fail_stream_after: Arc<std::sync::atomic::AtomicUsize>,
    /// While set, every stream is refused with RESOURCE_EXHAUSTED after its first message (a
    /// server refusing the content, not a transient failure); counts the refused streams.
    refuse: Arc<std::sync::atomic::AtomicBool>,
    refused: Arc<std::sync::atomic::AtomicUsize>,
}

#[tonic::async_trait]
impl IngestDouble for Double {
    async fn report_cache_state(
        &self,
        req: Request<Streaming<CacheStateUpdate>>,
    ) -> Result<Response<Ack>, Status> {
        let mut stream = req.into_inner();
        // Applied on receipt, acknowledged at end of stream (docs/BEHAVIOUR.md §4.1).
        let mut n = 0;
        while let Some(u) = stream.message().await? {
            if self.refuse.load(std::sync::atomic::Ordering::SeqCst) {
                self.refused
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                return Err(Status::resource_exhausted("simulated refusal"));
            }
            self.log.lock().unwrap().push(Rec::Update(u));
            n += 1;
            let fail = &self.fail_stream_after;
            if fail.load(std::sync::atomic::Ordering::SeqCst) == n {
                fail.store(0, std::sync::atomic::Ordering::SeqCst);
                return Err(Status::unavailable("simulated crash before Ack"));
            }
        }
        Ok(Response::new(Ack {
            accepted: true,
            reason_code: String::new(),
        }))
    }
    async fn publish_event(&self, req: Request<CacheEvent>) -> Result<Response<Ack>, Status> {
        self.log.lock().unwrap().push(Rec::Event(req.into_inner()));
        Ok(Response::new(Ack {
            accepted: true,
            reason_code: String::new(),
        }))
    }
}

impl Double {
    fn records(&self) -> Vec<Rec> {
        self.log.lock().unwrap().clone()
    }

    /// Records without stats-only updates.
    fn traffic(&self) -> Vec<Rec> {
        self.records()
            .into_iter()
            .filter(|r| !matches!(r, Rec::Update(u) if u.stats.is_some()))
            .collect()
    }

    /// The index the traffic builds: (replica, adapter, prefix) → (token_count, tier).
    fn index(&self) -> BTreeMap<(String, String, Vec<u8>), (i32, i32)> {
        let mut idx = BTreeMap::new();
        for r in self.records() {
            match r {
                Rec::Update(u) => {
                    for p in u.prefixes {
                        idx.insert(
                            (u.replica_id.clone(), p.adapter_id, p.prefix_hash),
                            (p.token_count, p.tier),
                        );
                    }
                }
                Rec::Event(e) if e.r#type == Type::PrefixEvicted as i32 => {
                    idx.retain(|(rep, ad, h), _| {
                        !(rep == &e.replica_id
                            && h == &e.prefix_hash
                            && (e.adapter_id.is_empty() || ad == &e.adapter_id))
                    });
                }
                Rec::Event(e) if e.r#type == Type::AllCleared as i32 => {
                    idx.retain(|(rep, _, _), _| rep != &e.replica_id);
                }
                Rec::Event(_) => {}
            }
        }
        idx
    }
}

async fn start_double_on(listener: TcpListener) -> Double {
    let d = Double::default();
    let svc = InferenceCacheServer::new(Ingest(d.clone()));
    tokio::spawn(async move {
        Server::builder()
            .serve_with_incoming(svc, TcpIncoming::from(listener))
            .await
            .unwrap();
    });
    d
}

async fn start_double() -> (SocketAddr, Double) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    (addr, start_double_on(listener).await)
}

// ---------------------------------------------------------------- subscriber process

struct Subscriber {
    child: Child,
    metrics_url: String,
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn spawn_subscriber(endpoint: &str, server: SocketAddr, extra: &[&str]) -> Subscriber {
    let mport = free_port();
    let logs = std::env::var_os("KVEVENT_TEST_LOGS").is_some();
    let out = || {
        if logs {
            Stdio::inherit()
        } else {
            Stdio::null()
        }
    };
    let child = Command::new(env!("CARGO_BIN_EXE_kvevent-subscriber"))
        .args([
            "--endpoint",
            endpoint,
            "--topic",
            "kv",
            "--server",
            &format!("http://{server}"),
            "--replica-id",
            "r1",
            "--model-id",
            "m",
            "--tenant-id",
            "t",
            "--lora-adapter-names",
            "1=sql-lora,2=chat-lora",
            "--flush-interval",
            "20ms",
            "--metrics-bind",
            &format!("127.0.0.1:{mport}"),
        ])
        .args(extra)
        .stdout(out())
        .stderr(out())
        .spawn()
        .expect("spawning kvevent-subscriber");
    Subscriber {
        child,
        metrics_url: format!("http://127.0.0.1:{mport}/metrics"),
    }
}

/// Value of one sample line of the subscriber's own metrics (0 when absent).
async fn sub_metric(s: &Subscriber, series: &str) -> f64 {
    let Ok(text) = kvevent_subscriber::stats::fetch(&s.metrics_url, Duration::from_secs(2)).await
    else {
        return 0.0;
    };
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

// ---------------------------------------------------------------- publisher helpers

fn payload(ts: f64, events: Vec<Value>) -> Bytes {
    let mut out = Vec::new();
    rmpv::encode::write_value(
        &mut out,
        &Value::Array(vec![Value::F64(ts), Value::Array(events), Value::from(0)]),
    )
    .unwrap();
    Bytes::from(out)
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

/// Publishes empty batches until the subscriber has seen one (ZMQ "slow joiner"); returns
/// the next seq to use.
async fn warm_up(p: &mut PubSocket, s: &Subscriber) -> u64 {
    for seq in 0..300 {
        publish(p, seq, payload(1.0, vec![])).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        if sub_metric(s, "kvevent_batches_total").await >= 1.0 {
            return seq + 1;
        }
    }
    panic!("subscriber never received a batch");
}

async fn wait_for(d: &Double, n: usize) -> Vec<Rec> {
    for _ in 0..200 {
        let t = d.traffic();
        if t.len() >= n {
            return t;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("expected {n} records, got {:#?}", d.traffic());
}

fn map_stored(hashes: Vec<Value>, parent: Value, toks: std::ops::RangeInclusive<u32>) -> Value {
    Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        ("block_hashes".into(), Value::Array(hashes)),
        ("parent_block_hash".into(), parent),
        (
            "token_ids".into(),
            Value::Array(toks.map(Value::from).collect()),
        ),
        ("block_size".into(), Value::from(16)),
        ("lora_id".into(), Value::Nil),
        ("medium".into(), "GPU".into()),
        ("lora_name".into(), Value::Nil),
        ("extra_keys".into(), Value::Nil),
        ("group_idx".into(), Value::from(0)),
        ("kv_cache_spec_kind".into(), "full_attention".into()),
    ])
}

fn array_stored(
    hash: Value,
    parent: Value,
    toks: std::ops::RangeInclusive<u32>,
    lora: Value,
) -> Value {
    Value::Array(vec![
        "BlockStored".into(),
        Value::Array(vec![hash]),
        parent,
        Value::Array(toks.map(Value::from).collect()),
        Value::from(16),
        lora,
        "GPU".into(),
    ])
}

fn update(ts_us: i64, prefixes: Vec<PrefixEntry>) -> Rec {
    Rec::Update(CacheStateUpdate {
        replica_id: "r1".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        hash_scheme: "vllm".into(),
        timestamp_us: ts_us,
        prefixes,
        stats: None,
        adapter_id: String::new(),
    })
}

fn entry(prefix: u64, count: i32, adapter: &str) -> PrefixEntry {
    PrefixEntry {
        prefix_hash: prefix.to_be_bytes().to_vec(),
        token_count: count,
        block_hashes: vec![],
        block_token_counts: vec![],
        tier: CacheTier::T1 as i32,
        adapter_id: adapter.into(),
    }
}

fn event(t: Type, ts_us: i64, prefix: Option<u64>, adapter: &str) -> Rec {
    Rec::Event(CacheEvent {
        r#type: t as i32,
        replica_id: "r1".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        prefix_hash: prefix.map(|p| p.to_be_bytes().to_vec()).unwrap_or_default(),
        timestamp_us: ts_us,
        adapter_id: adapter.into(),
    })
}

fn u32s(r: std::ops::RangeInclusive<u32>) -> Vec<u32> {
    r.collect()
}

// ---------------------------------------------------------------- scenarios

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_removed_cleared_and_restart_produce_exact_traffic() {
    let (addr, double) = start_double().await;
    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let sub = spawn_subscriber(&ep.to_string(), addr, &[]);
    let mut seq = warm_up(&mut pub_sock, &sub).await;
    let p = prefix_hashes(&u32s(1..=48), 16, None);

    // 1. Two blocks stored (map form, one hash ≥ 2^63 as uint64) → one update, two entries.
    publish(
        &mut pub_sock,
        seq,
        payload(
            1000.5,
            vec![map_stored(
                vec![Value::from(0x1111u64), Value::from(BIG)],
                Value::Nil,
                1..=32,
            )],
        ),
    )
    .await;
    seq += 1;
    let mut want = vec![update(
        1_000_500_000,
        vec![entry(p[0], 16, ""), entry(p[1], 32, "")],
    )];
    assert_eq!(wait_for(&double, want.len()).await, want);

    // 2. A child (legacy array form, parent given as the negative int64 of BIG, LoRA 1).
    publish(
        &mut pub_sock,
        seq,
        payload(
            1001.0,
            vec![array_stored(
                Value::from(0x2222u64),
                Value::from(BIG_AS_I64),
                33..=48,
                Value::from(1),
            )],
        ),
    )
    .await;
    seq += 1;
    want.push(update(1_001_000_000, vec![entry(p[2], 48, "sql-lora")]));
    assert_eq!(wait_for(&double, want.len()).await, want);

    // 3. BlockRemoved → PREFIX_EVICTED with the content prefix hash and the adapter.
    let removed = Value::Array(vec![
        "BlockRemoved".into(),
        Value::Array(vec![Value::from(0x2222u64)]),
        "GPU".into(),
    ]);
    publish(&mut pub_sock, seq, payload(1002.0, vec![removed])).await;
    seq += 1;
    want.push(event(
        Type::PrefixEvicted,
        1_002_000_000,
        Some(p[2]),
        "sql-lora",
    ));
    assert_eq!(wait_for(&double, want.len()).await, want);

    // 4. AllBlocksCleared → ALL_CLEARED.
    let cleared = Value::Map(vec![("type".into(), "AllBlocksCleared".into())]);
    publish(&mut pub_sock, seq, payload(1003.0, vec![cleared])).await;
    seq += 1;
    want.push(event(Type::AllCleared, 1_003_000_000, None, ""));
    assert_eq!(wait_for(&double, want.len()).await, want);

    // 5. A new root after the clear.
    let q = prefix_hashes(&u32s(100..=115), 16, None);
    publish(
        &mut pub_sock,
        seq,
        payload(
            1004.0,
            vec![map_stored(
                vec![Value::from(0x3333u64)],
                Value::Nil,
                100..=115,
            )],
        ),
    )
    .await;
    want.push(update(1_004_000_000, vec![entry(q[0], 16, "")]));
    assert_eq!(wait_for(&double, want.len()).await, want);

    // 6. Publisher restart: seq back to 0 → ALL_CLEARED, then the new batch.
    let r = prefix_hashes(&u32s(200..=215), 16, None);
    publish(
        &mut pub_sock,
        0,
        payload(
            1005.0,
            vec![map_stored(
                vec![Value::from(0x4444u64)],
                Value::Nil,
                200..=215,
            )],
        ),
    )
    .await;
    want.push(event(Type::AllCleared, 1_005_000_000, None, ""));
    want.push(update(1_005_000_000, vec![entry(r[0], 16, "")]));
    assert_eq!(wait_for(&double, want.len()).await, want);

    // A quiet window is what is checked: nothing more arrives in it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(double.traffic(), want, "no further traffic");
    let idx = double.index();
    assert_eq!(
        idx.into_iter().collect::<Vec<_>>(),
        vec![(
            ("r1".to_string(), String::new(), r[0].to_be_bytes().to_vec()),
            (16, CacheTier::T1 as i32)
        )]
    );
    assert_eq!(sub_metric(&sub, "kvevent_engine_restarts_total").await, 1.0);
    assert_eq!(
        sub_metric(&sub, "kvevent_events_total{type=\"BlockStored\"}").await,
        4.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_is_filled_from_the_replay_socket() {
    let (addr, double) = start_double().await;
    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();

    // The engine's replay buffer: seq → payload, served by a ROUTER.
    let buffer: Arc<Mutex<BTreeMap<u64, Bytes>>> = Arc::default();
    let mut router = RouterSocket::new();
    let rep = router.bind("tcp://127.0.0.1:0").await.unwrap();
    let buf = buffer.clone();
    let requests: Arc<Mutex<Vec<u64>>> = Arc::default();
    let reqs = requests.clone();
    tokio::spawn(async move {
        while let Ok(msg) = router.recv().await {
            let frames = msg.into_vec();
            let id = frames[0].clone();
            let start = u64::from_be_bytes(frames.last().unwrap()[..].try_into().unwrap());
            reqs.lock().unwrap().push(start);
            let items: Vec<(u64, Bytes)> = buf
                .lock()
                .unwrap()
                .range(start..)
                .map(|(k, v)| (*k, v.clone()))
                .collect();
            for (i, (s, body)) in items.into_iter().enumerate() {
                // Alternate the two reply shapes engines use.
                let mut f = vec![id.clone(), Bytes::new()];
                if i % 2 == 0 {
                    f.push(Bytes::from_static(b"kv"));
                }
                f.push(Bytes::copy_from_slice(&s.to_be_bytes()));
                f.push(body);
                router.send(ZmqMessage::try_from(f).unwrap()).await.unwrap();
            }
            let end = vec![
                id,
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

    let sub = spawn_subscriber(
        &ep.to_string(),
        addr,
        &["--replay-endpoint", &rep.to_string()],
    );
    let seq = warm_up(&mut pub_sock, &sub).await;
    let p = prefix_hashes(&u32s(1..=64), 16, None);
    let batches: Vec<Bytes> = (0..4u32)
        .map(|i| {
            let parent = if i == 0 {
                Value::Nil
            } else {
                Value::from(0x100 + u64::from(i) - 1)
            };
            payload(
                2000.0 + f64::from(i),
                vec![map_stored(
                    vec![Value::from(0x100 + u64::from(i))],
                    parent,
                    (i * 16 + 1)..=(i * 16 + 16),
                )],
            )
        })
        .collect();
    for (i, b) in batches.iter().enumerate() {
        buffer.lock().unwrap().insert(seq + i as u64, b.clone());
    }
    // Batches 1 and 2 are "lost" on the live socket.
    publish(&mut pub_sock, seq, batches[0].clone()).await;
    wait_for(&double, 1).await;
    publish(&mut pub_sock, seq + 3, batches[3].clone()).await;
    let got = wait_for(&double, 4).await;
    let entries: Vec<PrefixEntry> = got
        .into_iter()
        .flat_map(|r| match r {
            Rec::Update(u) => u.prefixes,
            Rec::Event(e) => panic!("unexpected event {e:?}"),
        })
        .collect();
    // Block 3 chains through the replayed blocks 1 and 2.
    assert_eq!(
        entries,
        vec![
            entry(p[0], 16, ""),
            entry(p[1], 32, ""),
            entry(p[2], 48, ""),
            entry(p[3], 64, "")
        ]
    );
    assert_eq!(*requests.lock().unwrap(), vec![seq + 1]);
    assert_eq!(
        sub_metric(&sub, "kvevent_replays_total{result=\"complete\"}").await,
        1.0
    );
    assert_eq!(
        sub_metric(&sub, "kvevent_replayed_batches_total").await,
        2.0
    );
    assert_eq!(sub_metric(&sub, "kvevent_seq_gaps_total").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_coming_up_late_still_gets_everything() {
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let sub = spawn_subscriber(&ep.to_string(), addr, &[]);
    let seq = warm_up(&mut pub_sock, &sub).await;
    let p = prefix_hashes(&u32s(1..=16), 16, None);
    publish(
        &mut pub_sock,
        seq,
        payload(
            3000.0,
            vec![map_stored(vec![Value::from(7u64)], Value::Nil, 1..=16)],
        ),
    )
    .await;
    // The server comes up only after the subscriber failed to reach it at least once.
    for _ in 0..600 {
        if sub_metric(&sub, "kvevent_reconnects_total").await >= 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let double = start_double_on(TcpListener::bind(addr).await.unwrap()).await;
    let got = wait_for(&double, 1).await;
    assert_eq!(got[0], update(3_000_000_000, vec![entry(p[0], 16, "")]));
    assert!(sub_metric(&sub, "kvevent_reconnects_total").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_metrics_become_stats_only_updates() {
    // A fake engine /metrics endpoint (vLLM names).
    let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http_addr = http.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        loop {
            let (mut s, _) = http.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            let body = "vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n\
                        vllm:num_requests_running{engine=\"0\"} 32\n\
                        vllm:num_requests_waiting{engine=\"0\"} 32\n";
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(resp.as_bytes()).await;
        }
    });
    let (addr, double) = start_double().await;
    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let _sub = spawn_subscriber(
        &ep.to_string(),
        addr,
        &[
            "--metrics-url",
            &format!("http://{http_addr}/metrics"),
            "--stats-interval",
            "100ms",
            "--cache-size-bytes",
            "1000",
        ],
    );
    let mut stats = None;
    for _ in 0..100 {
        stats = double.records().into_iter().find_map(|r| match r {
            Rec::Update(u) if u.stats.is_some() => Some(u),
            _ => None,
        });
        if stats.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let u = stats.expect("a stats-only update");
    assert_eq!(u.replica_id, "r1");
    assert!(u.prefixes.is_empty());
    let s = u.stats.unwrap();
    assert_eq!(s.cache_memory_bytes, 500);
    assert_eq!(s.pressure, 0.25);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_failing_before_ack_is_resent() {
    let (addr, double) = start_double().await;
    double
        .fail_stream_after
        .store(1, std::sync::atomic::Ordering::SeqCst);
    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let sub = spawn_subscriber(&ep.to_string(), addr, &[]);
    let seq = warm_up(&mut pub_sock, &sub).await;
    let p = prefix_hashes(&u32s(1..=32), 16, None);
    publish(
        &mut pub_sock,
        seq,
        payload(
            4000.0,
            vec![map_stored(vec![Value::from(1u64)], Value::Nil, 1..=16)],
        ),
    )
    .await;
    // Applied once, then the stream died unacknowledged: the subscriber re-sends it.
    let a = update(4_000_000_000, vec![entry(p[0], 16, "")]);
    assert_eq!(wait_for(&double, 2).await, vec![a.clone(), a.clone()]);
    publish(
        &mut pub_sock,
        seq + 1,
        payload(
            4001.0,
            vec![map_stored(
                vec![Value::from(2u64)],
                Value::from(1u64),
                17..=32,
            )],
        ),
    )
    .await;
    let b = update(4_001_000_000, vec![entry(p[1], 32, "")]);
    assert_eq!(wait_for(&double, 3).await, vec![a.clone(), a, b]);
    assert_eq!(double.index().len(), 2);
    assert!(sub_metric(&sub, "kvevent_resent_messages_total").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn star_endpoint_binds_and_dp_rank_names_the_replica() {
    let (addr, double) = start_double().await;
    let port = free_port();
    let sub = spawn_subscriber(&format!("tcp://*:{port}"), addr, &["--replica-per-dp-rank"]);
    // The engine side connects (the subscriber binds).
    let mut pub_sock = PubSocket::new();
    pub_sock
        .connect(&format!("tcp://127.0.0.1:{port}"))
        .await
        .unwrap();
    let seq = warm_up(&mut pub_sock, &sub).await;
    publish(
        &mut pub_sock,
        seq,
        payload(
            5000.0,
            vec![map_stored(vec![Value::from(1u64)], Value::Nil, 1..=16)],
        ),
    )
    .await;
    let got = wait_for(&double, 1).await;
    let Rec::Update(u) = &got[0] else {
        panic!("{got:?}")
    };
    assert_eq!(u.replica_id, "r1-dp0");
    assert_eq!(u.prefixes.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_pressure_while_server_is_down_loses_nothing() {
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let sub = spawn_subscriber(
        &ep.to_string(),
        addr,
        &[
            "--queue-capacity",
            "1",
            "--max-unacked",
            "2",
            "--max-batch",
            "1",
        ],
    );
    let seq = warm_up(&mut pub_sock, &sub).await;
    const N: u32 = 30;
    for i in 0..N {
        let toks = (i * 16)..=(i * 16 + 15);
        publish(
            &mut pub_sock,
            seq + u64::from(i),
            payload(
                6000.0 + f64::from(i),
                vec![map_stored(
                    vec![Value::from(1000 + u64::from(i))],
                    Value::Nil,
                    toks,
                )],
            ),
        )
        .await;
    }
    // Everything is stuck behind the absent server: the reader had to wait.
    for _ in 0..100 {
        if sub_metric(&sub, "kvevent_backpressure_waits_total").await >= 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(sub_metric(&sub, "kvevent_backpressure_waits_total").await >= 1.0);
    let double = start_double_on(TcpListener::bind(addr).await.unwrap()).await;
    for _ in 0..300 {
        if double.index().len() == N as usize {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let idx = double.index();
    assert_eq!(
        idx.len(),
        N as usize,
        "every stored block reached the server"
    );
    for i in 0..N {
        let h = prefix_hashes(&u32s((i * 16)..=(i * 16 + 15)), 16, None)[0];
        assert!(idx.contains_key(&("r1".to_string(), String::new(), h.to_be_bytes().to_vec())));
    }
    assert_eq!(sub_metric(&sub, "kvevent_missing_batches_total").await, 0.0);
}

/// `entries_sent` / `updates_sent` count when a message is written to the
/// stream, not when the stream is acknowledged (which, on a healthy subscriber, happens only after
/// `--max-unacked` messages or before an event); acknowledgements are their own series.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sent_counters_are_true_before_the_ack() {
    let (addr, double) = start_double().await;
    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let sub = spawn_subscriber(&ep.to_string(), addr, &["--ack-interval", "60s"]);
    let seq = warm_up(&mut pub_sock, &sub).await;
    publish(
        &mut pub_sock,
        seq,
        payload(
            7000.0,
            vec![map_stored(
                vec![Value::from(1u64), Value::from(2u64)],
                Value::Nil,
                1..=32,
            )],
        ),
    )
    .await;
    wait_for(&double, 1).await;
    // The stream is still open (1 of 256 messages): sent, not yet acknowledged.
    assert_eq!(sub_metric(&sub, "kvevent_entries_sent_total").await, 2.0);
    assert_eq!(sub_metric(&sub, "kvevent_updates_sent_total").await, 1.0);
    assert_eq!(sub_metric(&sub, "kvevent_entries_acked_total").await, 0.0);
    assert_eq!(sub_metric(&sub, "kvevent_updates_acked_total").await, 0.0);
    // An eviction closes the stream first (barrier): now acknowledged too.
    let removed = Value::Array(vec![
        "BlockRemoved".into(),
        Value::Array(vec![Value::from(2u64)]),
        "GPU".into(),
    ]);
    publish(&mut pub_sock, seq + 1, payload(7001.0, vec![removed])).await;
    wait_for(&double, 2).await;
    assert_eq!(sub_metric(&sub, "kvevent_entries_acked_total").await, 2.0);
    assert_eq!(sub_metric(&sub, "kvevent_updates_acked_total").await, 1.0);
    assert_eq!(sub_metric(&sub, "kvevent_entries_sent_total").await, 2.0);
}

/// One engine event whose entries would exceed the server's 4 MiB message limit (here
/// 5,000 one-token blocks of an adapter with a 1,000-byte name, with `--max-batch` far above
/// them) is split into several messages, each well under the limit, and all of it is indexed;
/// the test double refuses messages over 4 MiB like the server (tonic's default limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_larger_than_the_message_limit_is_split() {
    let (addr, double) = start_double().await;
    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let sub = spawn_subscriber(&ep.to_string(), addr, &["--max-batch", "100000"]);
    let seq = warm_up(&mut pub_sock, &sub).await;
    const N: u64 = 5000;
    let name = "a".repeat(1000);
    let ev = Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        (
            "block_hashes".into(),
            Value::Array((0..N).map(|i| Value::from(10_000 + i)).collect()),
        ),
        ("parent_block_hash".into(), Value::Nil),
        (
            "token_ids".into(),
            Value::Array((0..N).map(|i| Value::from(i as u32)).collect()),
        ),
        ("block_size".into(), Value::from(1)),
        ("lora_id".into(), Value::Nil),
        ("medium".into(), "GPU".into()),
        ("lora_name".into(), name.as_str().into()),
    ]);
    publish(&mut pub_sock, seq, payload(8000.0, vec![ev])).await;
    let mut n = 0;
    for _ in 0..400 {
        n = double.index().len();
        if n == N as usize {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(n, N as usize, "every entry indexed");
    let updates: Vec<CacheStateUpdate> = double
        .traffic()
        .into_iter()
        .filter_map(|r| match r {
            Rec::Update(u) => Some(u),
            Rec::Event(_) => None,
        })
        .collect();
    assert!(updates.len() >= 5, "{} messages", updates.len());
    for u in &updates {
        assert!(prost::Message::encoded_len(u) <= 4 << 20);
        assert!(u.prefixes.iter().all(|p| p.adapter_id == name));
    }
    assert_eq!(sub_metric(&sub, "kvevent_resent_messages_total").await, 0.0);
}

/// An engine replay ROUTER over `buffer` (seq → payload), like the engines': every buffered
/// batch with `seq >= start`, each `[topic, seq, payload]`, then the end marker. Returns its
/// endpoint and the requested start seqs.
async fn replay_router(buffer: Arc<Mutex<BTreeMap<u64, Bytes>>>) -> (String, Arc<Mutex<Vec<u64>>>) {
    let mut router = RouterSocket::new();
    let rep = router.bind("tcp://127.0.0.1:0").await.unwrap();
    let requests: Arc<Mutex<Vec<u64>>> = Arc::default();
    let reqs = requests.clone();
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
            reqs.lock().unwrap().push(start);
            let items: Vec<(u64, Bytes)> = buffer
                .lock()
                .unwrap()
                .range(start..)
                .map(|(k, v)| (*k, v.clone()))
                .collect();
            for (s, body) in items {
                let f = vec![
                    id.clone(),
                    Bytes::new(),
                    Bytes::from_static(b"kv"),
                    Bytes::copy_from_slice(&s.to_be_bytes()),
                    body,
                ];
                router.send(ZmqMessage::try_from(f).unwrap()).await.unwrap();
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
    (rep.to_string(), requests)
}

/// Block `i` of a chain of one-block batches: tokens `16i+1 ..= 16i+16`, engine hash 0x500+i,
/// parent 0x500+i-1.
fn chain_batch(i: u32) -> Bytes {
    let parent = if i == 0 {
        Value::Nil
    } else {
        Value::from(0x500 + u64::from(i) - 1)
    };
    payload(
        9000.0 + f64::from(i),
        vec![map_stored(
            vec![Value::from(0x500 + u64::from(i))],
            parent,
            (i * 16 + 1)..=(i * 16 + 16),
        )],
    )
}

async fn wait_index(d: &Double, n: usize) -> usize {
    for _ in 0..300 {
        if d.index().len() >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    d.index().len()
}

fn chain_prefixes(n: u32) -> Vec<Vec<u8>> {
    prefix_hashes(&u32s(1..=n * 16), 16, None)
        .into_iter()
        .map(|h| h.to_be_bytes().to_vec())
        .collect()
}

/// The subscriber is killed mid-stream (SIGKILL), the engine keeps publishing,
/// the subscriber is restarted with the same `--state-file` and, without any further live
/// batch, fetches what it missed from the replay socket: every batch is indexed, chained
/// correctly, and a later live batch is in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_subscriber_catches_up_from_its_state_file() {
    let (addr, double) = start_double().await;
    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let buffer: Arc<Mutex<BTreeMap<u64, Bytes>>> = Arc::default();
    let (rep, requests) = replay_router(buffer.clone()).await;
    let dir = std::env::temp_dir().join(format!("kvevent-e2e-state-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("state");
    let _ = std::fs::remove_file(&state);
    let flags = [
        "--replay-endpoint",
        &rep,
        "--state-file",
        state.to_str().unwrap(),
        "--tail-probe-interval",
        "300ms",
        "--ack-interval",
        "100ms",
    ];
    let sub = spawn_subscriber(&ep.to_string(), addr, &flags);
    let first = warm_up(&mut pub_sock, &sub).await;
    // Batches 0..5 of the chain, live (and buffered for replay, as the engine does).
    let mut seq = first;
    for i in 0..5 {
        buffer.lock().unwrap().insert(seq, chain_batch(i));
        publish(&mut pub_sock, seq, chain_batch(i)).await;
        seq += 1;
    }
    assert_eq!(wait_index(&double, 5).await, 5);
    // The state file catches up with the acknowledgement (ack interval 100 ms).
    let want_line = format!("v1 6b76 0 {}", seq - 1);
    for _ in 0..100 {
        if std::fs::read_to_string(&state)
            .unwrap_or_default()
            .contains(&want_line)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        std::fs::read_to_string(&state)
            .unwrap()
            .contains(&want_line)
    );
    drop(sub); // SIGKILL: no drain, no final state write

    // The engine keeps publishing while no subscriber listens.
    for i in 5..10 {
        buffer.lock().unwrap().insert(seq, chain_batch(i));
        publish(&mut pub_sock, seq, chain_batch(i)).await;
        seq += 1;
    }
    let asked_before = requests.lock().unwrap().len();
    let sub = spawn_subscriber(&ep.to_string(), addr, &flags);
    assert_eq!(
        wait_index(&double, 10).await,
        10,
        "every batch indexed after the restart"
    );
    let idx = double.index();
    for (i, p) in chain_prefixes(10).into_iter().enumerate() {
        let key = ("r1".to_string(), String::new(), p);
        assert_eq!(
            idx.get(&key),
            Some(&(16 * (i as i32 + 1), CacheTier::T1 as i32)),
            "block {i}"
        );
    }
    // The first request after the restart starts at 0: batches up to the remembered seq rebuild
    // the reverse map (so block 5 chains onto block 4), the rest are indexed.
    assert_eq!(requests.lock().unwrap().get(asked_before), Some(&0));
    assert_eq!(
        sub_metric(&sub, "kvevent_lost_tail_batches_total").await,
        5.0
    );
    // A live batch after the catch-up is in order: no gap, no restart, no clear.
    buffer.lock().unwrap().insert(seq, chain_batch(10));
    publish(&mut pub_sock, seq, chain_batch(10)).await;
    assert_eq!(wait_index(&double, 11).await, 11);
    assert_eq!(sub_metric(&sub, "kvevent_seq_gaps_total").await, 0.0);
    assert_eq!(sub_metric(&sub, "kvevent_engine_restarts_total").await, 0.0);
    assert!(double.traffic().iter().all(|r| !matches!(r, Rec::Event(_))));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Batches the engine published but the subscriber never received, followed by
/// a quiet spell (a lost tail), are found by the replay probe and indexed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_tail_is_recovered_by_the_replay_probe() {
    let (addr, double) = start_double().await;
    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let buffer: Arc<Mutex<BTreeMap<u64, Bytes>>> = Arc::default();
    let (rep, _) = replay_router(buffer.clone()).await;
    let sub = spawn_subscriber(
        &ep.to_string(),
        addr,
        &["--replay-endpoint", &rep, "--tail-probe-interval", "300ms"],
    );
    let seq = warm_up(&mut pub_sock, &sub).await;
    buffer.lock().unwrap().insert(seq, chain_batch(0));
    publish(&mut pub_sock, seq, chain_batch(0)).await;
    assert_eq!(wait_index(&double, 1).await, 1);
    // Two more batches reach only the engine's buffer (dropped on the way), then silence.
    buffer.lock().unwrap().insert(seq + 1, chain_batch(1));
    buffer.lock().unwrap().insert(seq + 2, chain_batch(2));
    assert_eq!(wait_index(&double, 3).await, 3, "lost tail recovered");
    assert_eq!(
        sub_metric(&sub, "kvevent_lost_tail_batches_total").await,
        2.0
    );
    // Their live copies arriving late are duplicates, not an engine restart.
    publish(&mut pub_sock, seq + 1, chain_batch(1)).await;
    publish(&mut pub_sock, seq + 2, chain_batch(2)).await;
    buffer.lock().unwrap().insert(seq + 3, chain_batch(3));
    publish(&mut pub_sock, seq + 3, chain_batch(3)).await;
    assert_eq!(wait_index(&double, 4).await, 4);
    assert_eq!(sub_metric(&sub, "kvevent_engine_restarts_total").await, 0.0);
    assert_eq!(
        sub_metric(&sub, "kvevent_dropped_total{reason=\"duplicate_batch\"}").await,
        2.0
    );
    assert!(double.traffic().iter().all(|r| !matches!(r, Rec::Event(_))));
}

/// Content the server keeps refusing (RESOURCE_EXHAUSTED) is re-sent a bounded number
/// of times, then dropped and counted; delivery of later data continues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_content_is_not_resent_forever() {
    use std::sync::atomic::Ordering;
    let (addr, double) = start_double().await;
    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let sub = spawn_subscriber(&ep.to_string(), addr, &[]);
    let seq = warm_up(&mut pub_sock, &sub).await;
    double.refuse.store(true, Ordering::SeqCst);
    publish(
        &mut pub_sock,
        seq,
        payload(
            9500.0,
            vec![map_stored(vec![Value::from(1u64)], Value::Nil, 1..=16)],
        ),
    )
    .await;
    let dropped = "kvevent_dropped_total{reason=\"refused_by_server\"}";
    for _ in 0..200 {
        if sub_metric(&sub, dropped).await >= 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(sub_metric(&sub, dropped).await, 1.0);
    let attempts = double.refused.load(Ordering::SeqCst);
    assert!((5..=6).contains(&attempts), "{attempts} refused streams");
    // A quiet window is what is checked: no re-send arrives in it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        double.refused.load(Ordering::SeqCst),
        attempts,
        "no more re-sends"
    );
    // The server accepts again: new data flows.
    double.refuse.store(false, Ordering::SeqCst);
    publish(
        &mut pub_sock,
        seq + 1,
        payload(
            9501.0,
            vec![map_stored(vec![Value::from(2u64)], Value::Nil, 17..=32)],
        ),
    )
    .await;
    assert_eq!(wait_index(&double, 1).await, 1);
}

/// The engine restarted while the subscriber was down (its replay buffer now ends
/// below the last seq the subscriber delivered): the restarted subscriber clears the replica
/// and indexes the new engine's batches instead of taking them for already-delivered ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_restart_while_the_subscriber_was_down_clears_the_replica() {
    let (addr, double) = start_double().await;
    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let buffer: Arc<Mutex<BTreeMap<u64, Bytes>>> = Arc::default();
    let (rep, _) = replay_router(buffer.clone()).await;
    let dir = std::env::temp_dir().join(format!("kvevent-e2e-restart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("state");
    let _ = std::fs::remove_file(&state);
    let flags = [
        "--replay-endpoint",
        &rep,
        "--state-file",
        state.to_str().unwrap(),
        "--ack-interval",
        "100ms",
        "--tail-probe-interval",
        "60s",
    ];
    let sub = spawn_subscriber(&ep.to_string(), addr, &flags);
    let mut seq = warm_up(&mut pub_sock, &sub).await;
    for i in 0..3 {
        buffer.lock().unwrap().insert(seq, chain_batch(i));
        publish(&mut pub_sock, seq, chain_batch(i)).await;
        seq += 1;
    }
    assert_eq!(wait_index(&double, 3).await, 3);
    let want_line = format!("v1 6b76 0 {}", seq - 1);
    for _ in 0..100 {
        if std::fs::read_to_string(&state)
            .unwrap_or_default()
            .contains(&want_line)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(sub);
    // The engine restarts (seq from 0, empty cache) and stores two new blocks.
    buffer.lock().unwrap().clear();
    buffer.lock().unwrap().insert(0, chain_batch(10));
    buffer.lock().unwrap().insert(1, chain_batch(11));
    let sub = spawn_subscriber(&ep.to_string(), addr, &flags);
    for _ in 0..200 {
        if sub_metric(&sub, "kvevent_engine_restarts_total").await >= 1.0
            && double.index().len() == 2
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(sub_metric(&sub, "kvevent_engine_restarts_total").await, 1.0);
    let idx = double.index();
    let new = prefix_hashes(&u32s(161..=192), 16, None);
    assert_eq!(idx.len(), 2, "{idx:?}");
    assert!(idx.contains_key(&("r1".into(), String::new(), new[0].to_be_bytes().to_vec())));
    // Their live copies arriving late are duplicates, not a second restart.
    publish(&mut pub_sock, 0, chain_batch(10)).await;
    publish(&mut pub_sock, 1, chain_batch(11)).await;
    let duplicates = "kvevent_dropped_total{reason=\"duplicate_batch\"}";
    for _ in 0..600 {
        if sub_metric(&sub, duplicates).await >= 2.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(sub_metric(&sub, duplicates).await, 2.0);
    assert_eq!(sub_metric(&sub, "kvevent_engine_restarts_total").await, 1.0);
    assert_eq!(double.index().len(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------- JetStream (--nats-url)

/// A `nats-server -js` on a free loopback port with a temporary store, killed on drop. The
/// scenario that needs it is ignored when `nats-server` was not on PATH at build time (build.rs;
/// `.ci/run` installs it).
struct Nats {
    child: Child,
    port: u16,
    store: std::path::PathBuf,
}

impl Nats {
    fn start() -> Nats {
        let port = free_port();
        let store =
            std::env::temp_dir().join(format!("kvevent-nats-{}-{port}", std::process::id()));
        let child = Command::new("nats-server")
            .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(&store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nats-server");
        // Owned (killed and reaped on drop) before anything can fail.
        let nats = Nats { child, port, store };
        for _ in 0..400 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return nats;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!("nats-server did not listen");
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}

const VLLM_FRAMES: &str = include_str!("data/engines/vllm-0.34.0.frames");

/// The recorded engine messages: `[topic, seq, payload]` per line, hex.
fn fixture_frames() -> Vec<Vec<Bytes>> {
    VLLM_FRAMES
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            l.split(' ')
                .map(|h| {
                    let b: Vec<u8> = (0..h.len())
                        .step_by(2)
                        .map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap())
                        .collect();
                    Bytes::from(b)
                })
                .collect()
        })
        .collect()
}

/// Every message of `stream`, decoded by its subject suffix (the event log's encoding).
async fn stream_records(
    js: &async_nats::jetstream::Context,
    stream: &str,
    prefix: &str,
) -> Vec<Rec> {
    use prost::Message;
    let mut s = js.get_stream(stream).await.expect("stream");
    let last = s.info().await.expect("info").state.last_sequence;
    let mut out = Vec::new();
    for seq in 1..=last {
        let m = s.get_raw_message(seq).await.expect("message");
        let body = &m.payload[..];
        if m.subject.as_str() == format!("{prefix}.update") {
            out.push(Rec::Update(CacheStateUpdate::decode(body).expect("update")));
        } else {
            assert_eq!(m.subject.as_str(), format!("{prefix}.event"));
            out.push(Rec::Event(CacheEvent::decode(body).expect("event")));
        }
    }
    out
}

/// Feeds the recorded vLLM 0.34 messages to a subscriber (after a warm-up on another topic,
/// which has no index effect).
async fn feed_fixture(p: &mut PubSocket, s: &Subscriber) {
    for seq in 0..300u64 {
        let warm = ZmqMessage::try_from(vec![
            Bytes::from_static(b"warm"),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload(1.0, vec![]),
        ])
        .unwrap();
        p.send(warm).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        if sub_metric(s, "kvevent_batches_total").await >= 1.0 {
            break;
        }
    }
    for f in fixture_frames() {
        p.send(ZmqMessage::try_from(f).unwrap()).await.unwrap();
    }
}

fn nats_subscriber(endpoint: &str, server: &str, extra: &[&str]) -> Subscriber {
    let mport = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_kvevent-subscriber"))
        .args([
            "--endpoint",
            endpoint,
            "--server",
            server,
            "--replica-id",
            "r1",
            "--model-id",
            "m",
            "--tenant-id",
            "t",
            "--lora-adapter-names",
            "1=sql-lora",
            "--flush-interval",
            "20ms",
            "--metrics-bind",
            &format!("127.0.0.1:{mport}"),
        ])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawning kvevent-subscriber");
    Subscriber {
        child,
        metrics_url: format!("http://127.0.0.1:{mport}/metrics"),
    }
}

/// `--nats-url`: a recorded vLLM engine's updates and events land in the JetStream stream as
/// protobuf messages on `<subject>.update` / `<subject>.event`, in the same order and with the
/// same content as the server receives them directly; with `--nats-only` the stream gets the
/// same messages while no server is called at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn nats_url_publishes_the_engine_updates_to_the_stream() {
    let nats = Nats::start();
    let client = async_nats::connect(nats.url()).await.expect("connect nats");
    let js = async_nats::jetstream::new(client);
    for (name, subject) in [("BOTH", "both"), ("ONLY", "only")] {
        js.create_stream(async_nats::jetstream::stream::Config {
            name: name.into(),
            subjects: vec![format!("{subject}.>")],
            ..Default::default()
        })
        .await
        .expect("create stream");
    }

    // As well as the server: the stream holds exactly the direct traffic.
    let (addr, double) = start_double().await;
    let mut p = PubSocket::new();
    let ep = p.bind("tcp://127.0.0.1:0").await.unwrap();
    let url = nats.url();
    let sub = nats_subscriber(
        &ep.to_string(),
        &format!("http://{addr}"),
        &["--nats-url", &url, "--nats-subject", "both"],
    );
    feed_fixture(&mut p, &sub).await;
    // 7 additions, one eviction, one clear (tests/engine_fixtures.rs).
    let direct = wait_for(&double, 9).await;
    assert_eq!(direct.len(), 9, "{direct:?}");
    let mut logged = Vec::new();
    for _ in 0..200 {
        logged = stream_records(&js, "BOTH", "both").await;
        if logged.len() >= direct.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        logged, direct,
        "the stream holds what the server received, in order"
    );
    assert_eq!(sub_metric(&sub, "kvevent_nats_acked_total").await, 9.0);
    drop(sub);

    // Instead of the server (nothing listens at --server): the same messages.
    let mut p2 = PubSocket::new();
    let ep2 = p2.bind("tcp://127.0.0.1:0").await.unwrap();
    let nowhere = format!("http://127.0.0.1:{}", free_port());
    let only = nats_subscriber(
        &ep2.to_string(),
        &nowhere,
        &["--nats-url", &url, "--nats-subject", "only", "--nats-only"],
    );
    feed_fixture(&mut p2, &only).await;
    let mut got = Vec::new();
    for _ in 0..200 {
        got = stream_records(&js, "ONLY", "only").await;
        if got.len() >= direct.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(got, direct, "--nats-only publishes the same messages");
    assert_eq!(sub_metric(&only, "kvevent_nats_acked_total").await, 9.0);
    assert_eq!(sub_metric(&only, "kvevent_reconnects_total").await, 0.0);
}
