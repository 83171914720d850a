//! Replicas fed through the NATS JetStream event log (docs/ARCHITECTURE.md "Replicas"): a real
//! `nats-server -js`, several server replicas consuming one stream, a producer publishing
//! protobuf CacheStateUpdate / CacheEvent messages with JetStream acks. Reported as ignored by the
//! test runner when `nats-server` was not on PATH at build time (build.rs); `.ci/run` installs it.

use std::time::{Duration, Instant};

use crate::support::*;

pub(crate) const SUBJECT: &str = "ic";

pub(crate) fn nats_flags(nats: &NatsServer, stream: &str) -> Vec<String> {
    vec![
        "--nats-url".into(),
        nats.url(),
        "--nats-stream".into(),
        stream.into(),
        "--nats-subject".into(),
        SUBJECT.into(),
    ]
}

pub(crate) fn start_replica(shards: usize, flags: &[String]) -> Server {
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    Server::start(shards, &flags)
}

/// `inferencecache_nats_applied_sequence` of `srv`.
pub(crate) fn applied(srv: &Server) -> u64 {
    metric_value(&metrics_text(srv), "inferencecache_nats_applied_sequence").unwrap_or(0.0) as u64
}

/// Deterministic xorshift, so every run publishes and asks the same things.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const TENANTS: [&str; 3] = ["t0", "t1", "t2"];
const MODELS: [&str; 4] = ["m0", "m1", "m2", "m3"];
const REPLICAS: u64 = 6;
const DOCS: u64 = 40;

fn block(t: &str, m: &str, doc: u64, k: u64) -> Vec<u8> {
    format!("{t}/{m}/d{doc}/b{k}").into_bytes()
}

/// The producer's messages: chain updates (with replica stats now and then), per-key
/// evictions and one ALL_CLEARED, all with one timestamp inside the allowed skew, so entry
/// freshness does not depend on when a replica applied them.
fn workload(n: usize, ts_us: i64) -> Vec<LogMsg> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let t = TENANTS[rng.below(3) as usize];
        let m = MODELS[rng.below(4) as usize];
        let replica = format!("r{}", rng.below(REPLICAS));
        let doc = rng.below(DOCS);
        let len = 1 + rng.below(6);
        if i % 97 == 96 {
            out.push(LogMsg::Event(pb::CacheEvent {
                r#type: pb::cache_event::Type::PrefixEvicted as i32,
                replica_id: replica,
                model_id: m.into(),
                tenant_id: t.into(),
                prefix_hash: block(t, m, doc, 0),
                timestamp_us: ts_us,
                adapter_id: String::new(),
            }));
            continue;
        }
        if i == n / 2 {
            out.push(LogMsg::Event(pb::CacheEvent {
                r#type: pb::cache_event::Type::AllCleared as i32,
                replica_id: "r5".into(),
                model_id: m.into(),
                tenant_id: t.into(),
                timestamp_us: ts_us,
                ..Default::default()
            }));
            continue;
        }
        let hashes: Vec<Vec<u8>> = (0..len).map(|k| block(t, m, doc, k)).collect();
        let stats = (i % 10 == 0).then(|| pb::ReplicaStats {
            replica_id: replica.clone(),
            hit_rate: (rng.below(100) as f32) / 100.0,
            pressure: (rng.below(100) as f32) / 100.0,
            ..Default::default()
        });
        out.push(LogMsg::Update(pb::CacheStateUpdate {
            replica_id: replica,
            model_id: m.into(),
            tenant_id: t.into(),
            hash_scheme: "vllm".into(),
            timestamp_us: ts_us,
            prefixes: vec![pb::PrefixEntry {
                block_token_counts: vec![16; hashes.len()],
                block_hashes: hashes,
                tier: 1 + (i % 3) as i32,
                ..Default::default()
            }],
            stats,
            adapter_id: String::new(),
        }));
    }
    out
}

/// 1,000 chain lookups over the published documents (and some never published).
fn lookups() -> Vec<pb::LookupRouteRequest> {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    (0..1000)
        .map(|_| {
            let t = TENANTS[rng.below(3) as usize];
            let m = MODELS[rng.below(4) as usize];
            let doc = rng.below(DOCS + 10);
            let len = 1 + rng.below(8);
            let hashes: Vec<Vec<u8>> = (0..len).map(|k| block(t, m, doc, k)).collect();
            pb::LookupRouteRequest {
                model_id: m.into(),
                tenant_id: t.into(),
                hash_scheme: "vllm".into(),
                block_token_counts: vec![16; hashes.len()],
                block_hashes: hashes.into_iter().map(Into::into).collect(),
                ..Default::default()
            }
        })
        .collect()
}

/// Three replicas (`--shards 1`, `--shards 1`, `--shards 2`) consume one stream while a
/// producer publishes through JetStream; one is SIGKILLed mid-stream and restarted (it replays
/// the stream from its start); after catch-up all three give field-identical answers to the
/// same 1,000 LookupRoute requests and to GetCacheState for every (tenant, model).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn three_replicas_converge_after_a_kill_mid_stream() {
    const STREAM: &str = "IC_E2E_REPLICAS";
    const N: usize = 3000;
    let nats = NatsServer::start();
    let js = nats.jetstream().await;
    create_stream(&js, STREAM, SUBJECT, -1).await;
    let flags = nats_flags(&nats, STREAM);
    let a = start_replica(1, &flags);
    let mut b = start_replica(1, &flags);
    let c = start_replica(2, &flags);

    // Inside the default 2-minute skew, so no replica clamps it to its own clock.
    let msgs = workload(N, now_us() + 90 * 1_000_000);
    publish_all(&js, SUBJECT, msgs[..N / 2].to_vec(), 64).await;
    let rest = msgs[N / 2..].to_vec();
    let js2 = js.clone();
    // The second half is paced (50 messages every 50 ms, at least 1.5 s), so the kill lands
    // mid-stream: B is killed as soon as it applies second-half messages.
    let producer = tokio::spawn(async move {
        for chunk in rest.chunks(50) {
            publish_all(&js2, SUBJECT, chunk.to_vec(), 16).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    // Kill B while the producer is still publishing and B is applying.
    let mut b_at_kill = 0;
    let killed = wait_until(Duration::from_secs(30), || {
        b_at_kill = applied(&b);
        b_at_kill > (N / 2 + 20) as u64
    });
    assert!(killed, "replica B never got past the first half");
    b.child.kill().expect("SIGKILL replica B");
    let _ = b.child.wait();
    let producing_at_kill = !producer.is_finished();
    let a_at_kill = applied(&a);
    producer.await.expect("producer");
    let last = last_sequence(&js, STREAM).await;
    assert_eq!(last, N as u64, "every published message is in the stream");

    let restarted = Instant::now();
    let b = start_replica(1, &flags);
    let ready = restarted.elapsed();
    let caught = wait_until(Duration::from_secs(30), || applied(&b) == last);
    let catch_up = restarted.elapsed();
    assert!(
        caught,
        "replica B did not catch up: {} of {last}",
        applied(&b)
    );
    println!(
        "replica catch-up after SIGKILL: {N} stream messages replayed, /readyz 200 after {} ms, \
         all {last} applied after {} ms (B had applied {b_at_kill} and A {a_at_kill} when B was \
         killed; producer still publishing then: {producing_at_kill})",
        ready.as_millis(),
        catch_up.as_millis()
    );
    for (name, srv) in [("A", &a), ("C", &c)] {
        let ok = wait_until(Duration::from_secs(30), || applied(srv) == last);
        assert!(ok, "replica {name} did not apply the whole stream");
    }
    let m = metrics_text(&b);
    assert_eq!(
        metric_value(&m, "inferencecache_nats_messages_applied_total"),
        Some(N as f64)
    );
    assert_eq!(
        metric_value(&m, "inferencecache_nats_gaps_total"),
        Some(0.0)
    );
    assert_eq!(
        metric_value(&m, "inferencecache_nats_decode_errors_total"),
        Some(0.0)
    );

    let mut clients = [a.client().await, b.client().await, c.client().await];
    let mut hits = 0;
    for req in lookups() {
        let mut answers = Vec::new();
        for cl in clients.iter_mut() {
            let mut r = lookup(cl, req.clone()).await;
            r.lookup_latency_us = 0;
            answers.push(r);
        }
        if answers[0]
            .replica_scores
            .iter()
            .any(|s| s.matched_tokens > 0)
        {
            hits += 1;
        }
        assert_eq!(answers[0], answers[1], "A and B differ on {req:?}");
        assert_eq!(answers[0], answers[2], "A and C differ on {req:?}");
    }
    assert!(hits > 300, "the lookups should mostly hit: {hits} of 1000");
    for t in TENANTS {
        for m in MODELS {
            let mut states = Vec::new();
            for cl in clients.iter_mut() {
                states.push(cache_state(cl, t, m).await);
            }
            assert!(states[0].summary.as_ref().unwrap().total_prefixes > 0);
            assert_eq!(
                states[0], states[1],
                "GetCacheState {t}/{m}: A and B differ"
            );
            assert_eq!(
                states[0], states[2],
                "GetCacheState {t}/{m}: A and C differ"
            );
        }
    }
}

/// A stream that has expired past the replica's start (max_msgs 50 of 200 published): the
/// replica starts from the first available message, and the gap is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn expired_stream_starts_from_the_first_available_and_counts_the_gap() {
    const STREAM: &str = "IC_E2E_GAP";
    let nats = NatsServer::start();
    let js = nats.jetstream().await;
    create_stream(&js, STREAM, SUBJECT, 50).await;
    let ts = now_us() + 90 * 1_000_000;
    let msgs: Vec<LogMsg> = (0..200)
        .map(|i| {
            let replica = format!("r{i:03}");
            let mut u = legacy_update(&replica, "t", "m", "vllm", b"h", 16);
            u.timestamp_us = ts;
            // GetCacheState lists the replicas with stats.
            u.stats = Some(pb::ReplicaStats {
                replica_id: replica,
                hit_rate: 0.5,
                ..Default::default()
            });
            LogMsg::Update(u)
        })
        .collect();
    publish_all(&js, SUBJECT, msgs, 32).await;
    assert_eq!(last_sequence(&js, STREAM).await, 200);

    let srv = start_replica(1, &nats_flags(&nats, STREAM));
    assert!(wait_until(Duration::from_secs(20), || applied(&srv) == 200));
    let m = metrics_text(&srv);
    assert_eq!(
        metric_value(&m, "inferencecache_nats_gaps_total"),
        Some(1.0)
    );
    assert_eq!(
        metric_value(&m, "inferencecache_nats_gap_messages_total"),
        Some(150.0)
    );
    assert_eq!(
        metric_value(&m, "inferencecache_nats_messages_applied_total"),
        Some(50.0)
    );
    let st = cache_state(&mut srv.client().await, "t", "m").await;
    let mut replicas: Vec<String> = st.replicas.iter().map(|r| r.replica_id.clone()).collect();
    replicas.sort();
    let want: Vec<String> = (150..200).map(|i| format!("r{i:03}")).collect();
    assert_eq!(
        replicas, want,
        "only the messages still in the stream are applied"
    );
}

/// A replica whose event log at `port` is unreachable (nothing listens there yet): it comes up
/// (`/healthz` 200) without crashing, and once its consumer has failed against the log (a
/// consumer restart counted) `/readyz` still answers 503.
fn replica_without_its_event_log(port: u16) -> Server {
    let url = format!("nats://127.0.0.1:{port}");
    let flags = [
        "--nats-url",
        &url,
        "--nats-stream",
        "IC_E2E_LATE",
        "--nats-subject",
        SUBJECT,
        "--nats-ready-max-lag",
        "0",
    ];
    let mut srv = Server::spawn(
        1,
        &StartOpts {
            flags: &flags,
            log_level: Some("error"),
            ..Default::default()
        },
    );
    let h = srv.http_port;
    let healthy = wait_until(Duration::from_secs(30), || {
        matches!(http_get(h, "/healthz"), Ok((200, _)))
    });
    assert!(healthy, "server did not come up");
    let failed = wait_until(Duration::from_secs(30), || {
        http_get(h, "/metrics").is_ok_and(|(_, m)| {
            metric_value(&m, "inferencecache_nats_consumer_restarts_total") >= Some(1.0)
        })
    });
    assert!(
        failed,
        "the consumer never failed against the unreachable event log"
    );
    let (st, _) = http_get(h, "/readyz").expect("GET /readyz");
    assert_eq!(st, 503, "not ready while the event log is unreachable");
    assert!(
        srv.child.try_wait().unwrap().is_none(),
        "NATS down must not crash the server"
    );
    srv
}

/// `/readyz` stays 503 while a replica cannot reach the event log (NATS down at start, which
/// must not crash it). Needs no nats-server.
#[test]
fn readyz_is_503_while_the_event_log_is_unreachable() {
    replica_without_its_event_log(free_port());
}

/// `/readyz` stays 503 while a replica cannot reach the event log; once NATS comes up the
/// consumer reconnects on its own, replays the stream and the replica turns ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn readyz_is_503_until_nats_comes_up_and_the_replica_caught_up() {
    let port = free_port(); // nothing listens there yet
    let mut srv = replica_without_its_event_log(port);
    let h = srv.http_port;
    let nats = NatsServer::start_on(port);
    let js = nats.jetstream().await;
    // The replica may have created the stream already (same configuration).
    js.get_or_create_stream(async_nats::jetstream::stream::Config {
        name: "IC_E2E_LATE".into(),
        subjects: vec![format!("{SUBJECT}.>")],
        ..Default::default()
    })
    .await
    .expect("stream");
    let ts = now_us() + 90 * 1_000_000;
    let msgs = (0..20)
        .map(|i| {
            let mut u = legacy_update(&format!("r{i}"), "t", "m", "vllm", b"h", 16);
            u.timestamp_us = ts;
            LogMsg::Update(u)
        })
        .collect();
    publish_all(&js, SUBJECT, msgs, 8).await;
    let applied_all = wait_until(Duration::from_secs(40), || {
        http_get(h, "/metrics").is_ok_and(|(_, m)| {
            metric_value(&m, "inferencecache_nats_applied_sequence") == Some(20.0)
        })
    });
    let ready = wait_until(Duration::from_secs(10), || {
        matches!(http_get(h, "/readyz"), Ok((200, _)))
    });
    let (_, metrics) = http_get(h, "/metrics").expect("GET /metrics");
    let _ = srv.child.kill();
    let _ = srv.child.wait();
    assert!(
        applied_all,
        "the stream was not replayed after NATS came up:\n{metrics}"
    );
    assert!(ready, "not ready after catching up");
    assert_eq!(
        metric_value(&metrics, "inferencecache_nats_messages_applied_total"),
        Some(20.0)
    );
}

/// Log-applied updates go through the same eviction as gRPC ingest: with the global cap, a
/// `--shards 2` replica picks its victims across cores and ends with exactly the answers of a
/// `--shards 1` replica (without the cross-core step it would keep every entry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn log_applied_updates_are_evicted_across_cores_like_one_core() {
    const STREAM: &str = "IC_E2E_CAP";
    const CAP: usize = 40;
    let nats = NatsServer::start();
    let js = nats.jetstream().await;
    create_stream(&js, STREAM, SUBJECT, 10_000).await;
    let msgs = workload(300, now_us() + 90 * 1_000_000);
    let total = msgs.len() as u64;
    publish_all(&js, SUBJECT, msgs, 32).await;
    let mut flags = nats_flags(&nats, STREAM);
    flags.extend(["--index-max-entries".to_string(), CAP.to_string()]);
    let one = start_replica(1, &flags);
    let two = start_replica(2, &flags);
    for srv in [&one, &two] {
        assert!(wait_until(Duration::from_secs(30), || applied(srv) == total));
    }
    let entries = |srv: &Server| -> f64 {
        let text = metrics_text(srv);
        text.lines()
            .filter(|l| l.starts_with("inferencecache_core_index_entries{"))
            .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
            .sum()
    };
    assert_eq!(entries(&one), CAP as f64, "the cap holds on one core");
    assert_eq!(entries(&two), CAP as f64, "the cap holds across two cores");
    assert_same_answers(&one, &two).await;
}

/// A replica restarted from its snapshot (`--state-dir`) replays only what the snapshot does not
/// include: the manifest records the stream sequence applied before it began, and the consumer
/// resumes after it. The answers then equal a replica's that replayed the whole stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn a_restored_replica_replays_only_the_rest_of_the_stream() {
    const STREAM: &str = "IC_E2E_RESUME";
    let nats = NatsServer::start();
    let js = nats.jetstream().await;
    create_stream(&js, STREAM, SUBJECT, 10_000).await;
    let mut msgs = workload(400, now_us() + 90 * 1_000_000);
    let rest = msgs.split_off(200);
    publish_all(&js, SUBJECT, msgs, 32).await;

    let dir = scratch_dir("replica-resume");
    let mut flags = nats_flags(&nats, STREAM);
    flags.extend([
        "--state-dir".to_string(),
        dir.to_string_lossy().into_owned(),
        "--snapshot-interval-ms".to_string(),
        "3600000".to_string(),
    ]);
    let mut a = start_replica(1, &flags);
    assert!(wait_until(Duration::from_secs(30), || applied(&a) == 200));
    assert!(
        a.terminate().success(),
        "the final snapshot is written at SIGTERM"
    );
    publish_all(&js, SUBJECT, rest, 32).await;

    let a = start_replica(2, &flags);
    assert!(wait_until(Duration::from_secs(30), || applied(&a) == 400));
    let applied_after_restart = metric_value(
        &metrics_text(&a),
        "inferencecache_nats_messages_applied_total",
    );
    assert_eq!(
        applied_after_restart,
        Some(200.0),
        "only the rest is replayed"
    );
    let whole = start_replica(1, &nats_flags(&nats, STREAM));
    assert!(wait_until(Duration::from_secs(30), || applied(&whole) == 400));
    assert_same_answers(&a, &whole).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// `a` and `b` answer the 1,000 [`lookups`] and GetCacheState for every (tenant, model) field by
/// field alike (the latency aside).
async fn assert_same_answers(a: &Server, b: &Server) {
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    for req in lookups() {
        let mut x = lookup(&mut ca, req.clone()).await;
        let mut y = lookup(&mut cb, req).await;
        (x.lookup_latency_us, y.lookup_latency_us) = (0, 0);
        assert_eq!(x, y);
    }
    for t in TENANTS {
        for m in MODELS {
            let mut x = cache_state(&mut ca, t, m).await;
            let mut y = cache_state(&mut cb, t, m).await;
            x.replicas.sort_by(|p, q| p.replica_id.cmp(&q.replica_id));
            y.replicas.sort_by(|p, q| p.replica_id.cmp(&q.replica_id));
            assert_eq!(x, y, "GetCacheState({t}, {m})");
        }
    }
}

/// The event log over TLS with a client certificate and a user and password: a nats-server
/// that requires all three; the server's consumer and kvevent-subscriber's publisher
/// (`--nats-only`, no direct gRPC) connect with `--nats-ca-file`, `--nats-client-cert-file`,
/// `--nats-client-key-file`, `--nats-user` and `--nats-password-file`, and an engine's events reach
/// LookupRoute through the stream. A wrong password is refused loudly, never silently: the
/// subscriber fails at start-up naming the refusal, and a server replica logs
/// `nats_connect_refused`, counts `inferencecache_nats_connect_refused_total{reason="auth"}` and
/// stays unready.
async fn event_log_over_tls_with_credentials(shards: usize) {
    use crate::kvevents::{BS, batch, eventually, prime_subscriber, publish, stored};
    use zeromq::{PubSocket, Socket};
    const STREAM: &str = "IC_E2E_SECURED";
    let nats = NatsServer::start_secured("producer", "pa55-w0rd");
    let sec = nats.secured.as_ref().unwrap();
    let dir = scratch_dir("nats-creds");
    let pw = dir.join("password");
    std::fs::write(&pw, "pa55-w0rd\n").unwrap();
    let wrong = dir.join("wrong");
    std::fs::write(&wrong, "not-the-password").unwrap();
    let (cc, ck) = (
        sec.client_cert.display().to_string(),
        sec.client_key.display().to_string(),
    );
    let (ca, pw, wrong) = (
        sec.ca_file.display().to_string(),
        pw.display().to_string(),
        wrong.display().to_string(),
    );
    let js = nats.jetstream().await;
    create_stream(&js, STREAM, SUBJECT, -1).await;
    let secured = |password_file: &str| -> Vec<String> {
        let mut f = nats_flags(&nats, STREAM);
        f.extend(
            [
                "--nats-ca-file",
                &ca,
                "--nats-client-cert-file",
                &cc,
                "--nats-client-key-file",
                &ck,
                "--nats-user",
                "producer",
                "--nats-password-file",
                password_file,
            ]
            .map(String::from),
        );
        f
    };
    // The replica checks log messages against a policy: the subscriber publishes as producer
    // `engine-pool` (its subject's last token), bound to its replica.
    let policy = dir.join("producers.yaml");
    std::fs::write(
        &policy,
        "bindings: [{identities: [\"nats:engine-pool\"], replicas: [engine-0], tenants: [t]}]\n",
    )
    .unwrap();
    let mut flags = secured(&pw);
    flags.extend(["--engine-block-size".to_string(), BS.to_string()]);
    flags.extend(["--producer-policy".into(), policy.display().to_string()]);
    let srv = start_replica(shards, &flags);

    // The subscriber publishes only to the stream; the server applies it from there.
    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let metrics_port = free_port();
    let sub_args = |password_file: &str, metrics_bind: &str| {
        let mut a: Vec<String> = [
            "kvevent-subscriber",
            "--endpoint",
            &ep.to_string(),
            "--topic",
            "kv",
            "--server",
            "http://127.0.0.1:1",
            "--replica-id",
            "engine-0",
            "--model-id",
            "m",
            "--tenant-id",
            "t",
            "--flush-interval",
            "10ms",
            "--metrics-bind",
            metrics_bind,
            "--nats-url",
            &nats.url(),
            "--nats-subject",
            SUBJECT,
            "--nats-only",
            "--nats-producer",
            "engine-pool",
        ]
        .map(String::from)
        .to_vec();
        a.extend(
            [
                "--nats-ca-file",
                &ca,
                "--nats-client-cert-file",
                &cc,
                "--nats-client-key-file",
                &ck,
                "--nats-user",
                "producer",
                "--nats-password-file",
                password_file,
            ]
            .map(String::from),
        );
        <kvevent_subscriber::cli::Args as clap::Parser>::parse_from(a)
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let sub = tokio::spawn(kvevent_subscriber::app::run(
        sub_args(&pw, &format!("127.0.0.1:{metrics_port}")),
        async move {
            let _ = stop_rx.await;
        },
    ));
    let seq = prime_subscriber(&mut pub_sock, metrics_port, &sub).await;
    publish(
        &mut pub_sock,
        seq,
        batch(vec![stored(&[31, 32], 0..2 * BS)]),
    )
    .await;
    eventually(&srv, 0..2 * BS, "PREFIX_MATCH", 2 * BS as i32).await;
    assert!(
        last_sequence(&js, STREAM).await >= 1,
        "it went through the stream"
    );
    assert_eq!(
        crate::producers::refused_count(&metrics_text(&srv), "nats", "permission_denied"),
        0.0
    );
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(15), sub).await;

    // Without the client certificate NATS requires: refused at the TLS handshake, at start-up.
    let mut no_cert = sub_args(&pw, "");
    no_cert.nats_client_cert_file = None;
    no_cert.nats_client_key_file = None;
    let err = tokio::time::timeout(
        Duration::from_secs(30),
        kvevent_subscriber::app::run(no_cert, std::future::pending()),
    )
    .await
    .expect("a refused TLS handshake must not be retried silently")
    .expect_err("a refused TLS handshake must fail the start-up");
    assert!(format!("{err:#}").contains("(tls)"), "{err:#}");

    // A wrong password: the subscriber does not start.
    let err = kvevent_subscriber::app::run(sub_args(&wrong, ""), std::future::pending())
        .await
        .expect_err("a refused NATS login must fail the start-up");
    assert!(
        err.downcast_ref::<kvevent_subscriber::app::StartupError>()
            .is_some(),
        "{err:#}"
    );
    let text = format!("{err:#}");
    assert!(text.contains("refused") && text.contains("auth"), "{text}");
    assert!(
        !text.contains("not-the-password"),
        "the password is never shown: {text}"
    );

    // ... and a server replica says so instead of waiting silently.
    let log = dir.join("wrong-replica.log");
    let wrong_flags = secured(&wrong);
    let wrong_flags: Vec<&str> = wrong_flags.iter().map(String::as_str).collect();
    let bad = Server::spawn(
        shards,
        &StartOpts {
            flags: &wrong_flags,
            stderr_file: Some(log.clone()),
            log_level: Some("warn"),
            ..Default::default()
        },
    );
    let logs = log_text_with(&log, "nats_connect_refused");
    assert!(
        !logs.contains("not-the-password"),
        "the password is never logged"
    );
    let h = bad.http_port;
    let counted = wait_until(Duration::from_secs(30), || {
        http_get(h, "/metrics").is_ok_and(|(_, m)| {
            metric_value(
                &m,
                "inferencecache_nats_connect_refused_total{reason=\"auth\"}",
            ) >= Some(1.0)
        })
    });
    assert!(counted, "the refusal is counted");
    let (st, _) = http_get(h, "/readyz").expect("GET /readyz");
    assert_eq!(st, 503, "not ready without its event log");

    // A replica without the client certificate is refused at the handshake: counted as tls.
    let no_cert: Vec<String> = secured(&pw)
        .chunks(2)
        .filter(|kv| !kv[0].starts_with("--nats-client-"))
        .flatten()
        .cloned()
        .collect();
    let no_cert: Vec<&str> = no_cert.iter().map(String::as_str).collect();
    let bad = Server::spawn(
        shards,
        &StartOpts {
            flags: &no_cert,
            log_level: Some("error"),
            ..Default::default()
        },
    );
    let h = bad.http_port;
    let counted = wait_until(Duration::from_secs(30), || {
        http_get(h, "/metrics").is_ok_and(|(_, m)| {
            metric_value(
                &m,
                "inferencecache_nats_connect_refused_total{reason=\"tls\"}",
            ) >= Some(1.0)
        })
    });
    assert!(counted, "the TLS refusal is counted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn event_log_over_tls_with_credentials_shards_1() {
    event_log_over_tls_with_credentials(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn event_log_over_tls_with_credentials_shards_2() {
    event_log_over_tls_with_credentials(2).await;
}

/// `--nats-creds-file` on both ends: a nats-server in operator mode (JWT authentication) and a
/// user credentials file; the server's consumer and the subscriber's publisher log in with it and
/// the engine's blocks reach LookupRoute through the stream. Without it the server counts the
/// refusal.
async fn event_log_with_a_creds_file(shards: usize) {
    use crate::kvevents::{
        BS, batch, eventually, prime_subscriber, publish, spawn_subscriber, stored,
    };
    use zeromq::{PubSocket, Socket};
    const STREAM: &str = "IC_E2E_CREDS";
    let (nats, creds) = NatsServer::start_operator_mode();
    let dir = scratch_dir("nats-creds-file");
    let creds_file = dir.join("user.creds");
    std::fs::write(&creds_file, &creds).unwrap();
    let creds_file = creds_file.display().to_string();
    let client = async_nats::ConnectOptions::new()
        .credentials(&creds)
        .unwrap()
        .connect(nats.url())
        .await
        .expect("the test's own login with the creds");
    let js = async_nats::jetstream::new(client);
    create_stream(&js, STREAM, SUBJECT, -1).await;
    let mut flags = nats_flags(&nats, STREAM);
    flags.extend(["--nats-creds-file".into(), creds_file.clone()]);
    flags.extend(["--engine-block-size".to_string(), BS.to_string()]);
    let srv = start_replica(shards, &flags);

    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let metrics_port = free_port();
    let args = <kvevent_subscriber::cli::Args as clap::Parser>::parse_from([
        "kvevent-subscriber",
        "--endpoint",
        &ep.to_string(),
        "--topic",
        "kv",
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
        "--nats-url",
        &nats.url(),
        "--nats-subject",
        SUBJECT,
        "--nats-only",
        "--nats-creds-file",
        &creds_file,
    ]);
    let (stop_tx, sub) = spawn_subscriber(args);
    let seq = prime_subscriber(&mut pub_sock, metrics_port, &sub).await;
    publish(
        &mut pub_sock,
        seq,
        batch(vec![stored(&[51, 52], 0..2 * BS)]),
    )
    .await;
    eventually(&srv, 0..2 * BS, "PREFIX_MATCH", 2 * BS as i32).await;
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(15), sub).await;

    // No credentials at all: refused, counted.
    let bare = nats_flags(&nats, STREAM);
    let bare: Vec<&str> = bare.iter().map(String::as_str).collect();
    let bad = Server::spawn(
        shards,
        &StartOpts {
            flags: &bare,
            log_level: Some("error"),
            ..Default::default()
        },
    );
    let h = bad.http_port;
    let counted = wait_until(Duration::from_secs(30), || {
        http_get(h, "/metrics").is_ok_and(|(_, m)| {
            metric_value(
                &m,
                "inferencecache_nats_connect_refused_total{reason=\"auth\"}",
            ) >= Some(1.0)
        })
    });
    assert!(
        counted,
        "a login without credentials is refused and counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn event_log_with_a_creds_file_shards_1() {
    event_log_with_a_creds_file(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn event_log_with_a_creds_file_shards_2() {
    event_log_with_a_creds_file(2).await;
}

/// Log messages obey the producer policy and fencing like gRPC ingest (docs/BEHAVIOUR.md §4.3):
/// under a policy binding `nats:pool-a` to replica `r-a` of tenant `t`, a message published on
/// `ic.update.pool-a` for `r-a` applies; one for another replica or tenant, one from another
/// producer token, one on the plain subject (no identity) and one under an older
/// `x-producer-epoch` (an update, then an ALL_CLEARED) are skipped and counted, and the messages
/// after them still apply, on every core layout alike.
async fn log_messages_obey_the_producer_policy_and_fencing(shards: usize) {
    use crate::producers::{holders, refused_count, update};
    const STREAM: &str = "IC_E2E_LOG_POLICY";
    const OLD: &str = "1700000000000-zombie";
    const NEW: &str = "1700000005000-live";
    let dir = scratch_dir(&format!("log-policy-{shards}"));
    let policy = dir.join("producers.yaml");
    std::fs::write(
        &policy,
        "bindings:\n  - identities: [\"nats:pool-a\"]\n    replicas: [\"r-a\"]\n    tenants: [\"t\"]\n",
    )
    .unwrap();
    let nats = NatsServer::start();
    let js = nats.jetstream().await;
    create_stream(&js, STREAM, SUBJECT, -1).await;
    let as_pool_a = |u: pb::CacheStateUpdate, epoch: &'static str| {
        (Some("pool-a"), Some(epoch), LogMsg::Update(u))
    };
    let cleared = pb::CacheEvent {
        r#type: pb::cache_event::Type::AllCleared as i32,
        replica_id: "r-a".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        timestamp_us: fresh_ts(),
        ..Default::default()
    };
    let log = vec![
        as_pool_a(update("r-a", "t", b"log-ok"), NEW),
        as_pool_a(update("r-b", "t", b"log-other-replica"), NEW),
        as_pool_a(update("r-a", "u", b"log-other-tenant"), NEW),
        (
            None,
            Some(NEW),
            LogMsg::Update(update("r-a", "t", b"log-anonymous")),
        ),
        (
            Some("pool-b"),
            Some(NEW),
            LogMsg::Update(update("r-a", "t", b"log-pool-b")),
        ),
        as_pool_a(update("r-a", "t", b"log-zombie"), OLD),
        (Some("pool-a"), Some(OLD), LogMsg::Event(cleared)),
        as_pool_a(update("r-a", "t", b"log-late"), NEW),
    ];
    let total = log.len() as u64;
    for (producer, epoch, msg) in log {
        publish_log_as(&js, SUBJECT, producer, epoch, msg).await;
    }
    let mut flags = nats_flags(&nats, STREAM);
    flags.extend(["--producer-policy".into(), policy.display().to_string()]);
    let srv = start_replica(shards, &flags);
    assert!(
        wait_until(Duration::from_secs(30), || applied(&srv) == total),
        "the whole log is consumed"
    );
    let mut c = srv.client().await;
    assert_eq!(
        holders(&mut c, "t", b"log-ok").await,
        ["r-a"],
        "not cleared"
    );
    assert_eq!(holders(&mut c, "t", b"log-late").await, ["r-a"]);
    for hash in [
        &b"log-other-replica"[..],
        b"log-anonymous",
        b"log-pool-b",
        b"log-zombie",
    ] {
        assert!(holders(&mut c, "t", hash).await.is_empty(), "{hash:?}");
    }
    assert!(holders(&mut c, "u", b"log-other-tenant").await.is_empty());
    let text = metrics_text(&srv);
    assert_eq!(refused_count(&text, "nats", "permission_denied"), 3.0);
    assert_eq!(refused_count(&text, "none", "unauthenticated"), 1.0);
    assert_eq!(refused_count(&text, "nats", "fenced"), 2.0);
    assert_eq!(
        metric_value(&text, "inferencecache_nats_messages_applied_total"),
        Some(2.0),
        "refused messages are not counted as applied"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn log_messages_obey_the_producer_policy_and_fencing_shards_1() {
    log_messages_obey_the_producer_policy_and_fencing(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn log_messages_obey_the_producer_policy_and_fencing_shards_2() {
    log_messages_obey_the_producer_policy_and_fencing(2).await;
}

/// The set-up docs/OPERATIONS.md "Securing the event log" documents, end to end: NATS lets user
/// `pool-a` publish only under its producer name (`ic.*.pool-a`) and the replica's user publish
/// no index message; the subscriber logs in as `pool-a` with `--nats-producer pool-a`, and the
/// replica's policy binds `nats:pool-a` to its replica, so its blocks are served. The same user
/// publishing under another producer's name is refused by NATS at the publish: nothing reaches
/// the stream, nothing is refused (or applied) by the replica.
async fn log_producer_names_are_bound_by_nats_permissions(shards: usize) {
    use crate::kvevents::{
        BS, batch, eventually, prime_subscriber, publish, spawn_subscriber, stored,
    };
    use zeromq::{PubSocket, Socket};
    const STREAM: &str = "IC_E2E_NAMES";
    let nats = NatsServer::start_with_users(
        "{ user: replica, password: replica-pw, permissions: { publish: { deny: [\"ic.>\"] } } }\n\
         { user: pool-a, password: pool-a-pw, permissions: { publish: { allow: [\"ic.*.pool-a\"] },\n\
           subscribe: { allow: [\"_INBOX.>\"] } } }",
    );
    let dir = scratch_dir(&format!("log-names-{shards}"));
    let file = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let (replica_pw, pool_pw) = (
        file("replica-pw", "replica-pw"),
        file("pool-pw", "pool-a-pw"),
    );
    let policy = file(
        "producers.yaml",
        "bindings: [{identities: [\"nats:pool-a\"], replicas: [engine-0], tenants: [t]}]\n",
    );
    let mut flags = nats_flags(&nats, STREAM);
    flags.extend(
        [
            "--nats-user",
            "replica",
            "--nats-password-file",
            &replica_pw,
            "--producer-policy",
            &policy,
            "--require-producer-auth",
            "--engine-block-size",
            &BS.to_string(),
        ]
        .map(String::from),
    );
    let srv = start_replica(shards, &flags);

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
        "http://127.0.0.1:1",
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
        "--nats-url",
        &nats.url(),
        "--nats-subject",
        SUBJECT,
        "--nats-only",
        "--nats-producer",
        "pool-a",
        "--nats-user",
        "pool-a",
        "--nats-password-file",
        &pool_pw,
    ]);
    let (stop_tx, sub) = spawn_subscriber(args);
    let seq = prime_subscriber(&mut engine, metrics_port, &sub).await;
    publish(&mut engine, seq, batch(vec![stored(&[41, 42], 0..2 * BS)])).await;
    eventually(&srv, 0..2 * BS, "PREFIX_MATCH", 2 * BS as i32).await;

    // The same NATS user under another producer's name: NATS refuses the publish.
    let client =
        async_nats::ConnectOptions::with_user_and_password("pool-a".into(), "pool-a-pw".into())
            .connect(nats.url())
            .await
            .expect("pool-a logs in");
    let js = async_nats::jetstream::new(client);
    let admin =
        async_nats::ConnectOptions::with_user_and_password("replica".into(), "replica-pw".into())
            .connect(nats.url())
            .await
            .expect("the replica's user logs in");
    let admin = async_nats::jetstream::new(admin);
    let before = last_sequence(&admin, STREAM).await;
    let forged = crate::producers::update("engine-0", "t", b"forged");
    let acked = tokio::time::timeout(Duration::from_secs(5), async {
        js.publish(
            format!("{SUBJECT}.update.pool-b"),
            prost::Message::encode_to_vec(&forged).into(),
        )
        .await
        .ok()?
        .await
        .ok()
    })
    .await;
    assert!(
        !matches!(acked, Ok(Some(_))),
        "NATS stored a forged producer name"
    );
    assert_eq!(
        last_sequence(&admin, STREAM).await,
        before,
        "nothing reached the stream"
    );
    let text = metrics_text(&srv);
    assert_eq!(
        crate::producers::refused_count(&text, "nats", "permission_denied"),
        0.0
    );
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(15), sub).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn log_producer_names_are_bound_by_nats_permissions_shards_1() {
    log_producer_names_are_bound_by_nats_permissions(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn log_producer_names_are_bound_by_nats_permissions_shards_2() {
    log_producer_names_are_bound_by_nats_permissions(2).await;
}
