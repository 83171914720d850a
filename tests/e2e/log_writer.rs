//! The server as the event log's only writer (`--nats-log-writer`, docs/BEHAVIOUR.md §4.3,
//! docs/ARCHITECTURE.md §7 "Log writers"): a real `nats-server -js`, a writer replica reviewing
//! producer tokens under a policy, and a second replica that only consumes the log. Reported as
//! ignored by the test runner when `nats-server` was not on PATH at build time (build.rs).

use std::time::Duration;

use async_nats::jetstream;
use pb::cache_event::Type;

use crate::producers::{
    Client, accepted, holders, publish_as, refused, refused_count, report_as, token_server, update,
};
use crate::replicas::{SUBJECT, applied, nats_flags, start_replica};
use crate::support::*;

/// The token the stand-in TokenReview maps to the service account the policy binds to
/// `decode-a*` of `team-a` (producers::token_server).
const TOKEN: &str = "engine-a-token";
const OLD: &str = "1700000000000-zombie";
const NEW: &str = "1700000005000-live";

/// Every message of the stream: (subject, `x-producer-epoch` header, payload).
async fn stream_messages(js: &jetstream::Context, stream: &str) -> Vec<(String, String, Vec<u8>)> {
    let last = last_sequence(js, stream).await;
    let st = js.get_stream(stream).await.expect("get stream");
    let mut out = Vec::new();
    for seq in 1..=last {
        let m = st.get_raw_message(seq).await.expect("stream message");
        let epoch = m
            .headers
            .get("x-producer-epoch")
            .map(|v| v.as_str().to_string())
            .unwrap_or_default();
        out.push((m.subject.to_string(), epoch, m.payload.to_vec()));
    }
    out
}

/// Whether some stream message's payload contains `needle`.
fn logged(msgs: &[(String, String, Vec<u8>)], needle: &[u8]) -> bool {
    msgs.iter()
        .any(|(_, _, p)| p.windows(needle.len()).any(|w| w == needle))
}

/// Waits until `c` answers `want` as the holders of `hash` of `team-a`.
async fn eventually_held(c: &mut Client, hash: &[u8], want: &[&str]) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let got = holders(c, "team-a", hash).await;
        if got == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{hash:?}: holders {got:?}, want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Through a writer, an authorised producer's update is stored in the stream before it is
/// acknowledged (stream sequence 1, on `ic.admitted.update`, with its epoch) and reaches the
/// writer and a second replica from the log; calls the producer checks refuse (another replica,
/// another tenant, no identity, an older epoch; ReportCacheState and PublishEvent) are answered
/// with their documented reasons and are not in the stream; an authorised ALL_CLEARED is
/// published and applied on both replicas alike.
async fn the_writer_publishes_only_admitted_messages(shards: usize) {
    const STREAM: &str = "IC_E2E_WRITER";
    let nats = NatsServer::start();
    let js = nats.jetstream().await;
    create_stream(&js, STREAM, SUBJECT, -1).await;
    let mut flags = nats_flags(&nats, STREAM);
    flags.extend(["--nats-log-writer".into(), "--require-producer-auth".into()]);
    let flags_ref: Vec<&str> = flags.iter().map(String::as_str).collect();
    let (dir, writer, _reviews) = token_server(shards, &format!("writer-{shards}"), &flags_ref);
    // The reader's policy binds no identity the writer's callers have: writer-admitted messages
    // are not checked against it (the writer applied its own), only fenced.
    let policy = dir.join("reader-policy.yaml");
    std::fs::write(
        &policy,
        "bindings: [{identities: [\"nats:other\"], replicas: [x], tenants: [x]}]\n",
    )
    .unwrap();
    let mut reader_flags = nats_flags(&nats, STREAM);
    reader_flags.extend([
        "--producer-policy".into(),
        policy.display().to_string(),
        "--require-producer-auth".into(),
    ]);
    let reader = start_replica(shards, &reader_flags);
    let (mut w, mut r) = (writer.client().await, reader.client().await);

    let ok = update("decode-a1", "team-a", b"writer-ok");
    accepted(report_as(&mut w, vec![ok], Some(TOKEN), Some(NEW)).await);
    let log = stream_messages(&js, STREAM).await;
    assert_eq!(log.len(), 1, "stored before the Ack");
    assert_eq!(
        (log[0].0.as_str(), log[0].1.as_str()),
        ("ic.admitted.update", NEW)
    );
    eventually_held(&mut r, b"writer-ok", &["decode-a1"]).await;
    eventually_held(&mut w, b"writer-ok", &["decode-a1"]).await;
    assert!(wait_until(Duration::from_secs(10), || applied(&writer) == 1));

    // Allowed by the policy (decode-a*), but a name no replica would store.
    let long_replica = format!("decode-a{}", "x".repeat(1100));
    let forbidden = [
        (
            update("decode-b", "team-a", b"writer-replica"),
            Some(TOKEN),
            NEW,
        ),
        (
            update("decode-a1", "team-b", b"writer-tenant"),
            Some(TOKEN),
            NEW,
        ),
        (update("decode-a1", "team-a", b"writer-anon"), None, NEW),
        (
            update("decode-a1", "team-a", b"writer-zombie"),
            Some(TOKEN),
            OLD,
        ),
        (
            update(&long_replica, "team-a", b"writer-long"),
            Some(TOKEN),
            NEW,
        ),
    ];
    let reasons = [
        "PERMISSION_DENIED",
        "PERMISSION_DENIED",
        "UNAUTHENTICATED",
        "FENCED",
        "ID_TOO_LONG",
    ];
    for ((u, token, epoch), reason) in forbidden.into_iter().zip(reasons) {
        refused(report_as(&mut w, vec![u], token, Some(epoch)).await, reason);
    }
    let clear = |replica: &str| cache_event(Type::AllCleared, "team-a", "m", replica, b"", "");
    let st = publish_as(&mut w, clear("decode-b"), Some(TOKEN), Some(NEW))
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::PermissionDenied, "{st:?}");
    let st = publish_as(&mut w, clear("decode-a1"), Some(TOKEN), Some(OLD))
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::FailedPrecondition, "{st:?}");

    let log = stream_messages(&js, STREAM).await;
    assert_eq!(log.len(), 1, "nothing refused reached the stream: {log:?}");
    for hash in [
        &b"writer-replica"[..],
        b"writer-tenant",
        b"writer-anon",
        b"writer-zombie",
        b"writer-long",
    ] {
        assert!(!logged(&log, hash), "{hash:?} is in the stream");
    }
    let text = metrics_text(&writer);
    assert_eq!(refused_count(&text, "token", "permission_denied"), 3.0);
    assert_eq!(refused_count(&text, "none", "unauthenticated"), 1.0);
    assert_eq!(refused_count(&text, "token", "fenced"), 2.0);
    assert_eq!(
        metric_value(&text, "inferencecache_nats_writer_published_total"),
        Some(1.0)
    );

    accepted(publish_as(&mut w, clear("decode-a1"), Some(TOKEN), Some(NEW)).await);
    let log = stream_messages(&js, STREAM).await;
    assert_eq!(log.len(), 2, "stored before the Ack");
    assert_eq!(log[1].0, "ic.admitted.event");
    eventually_held(&mut r, b"writer-ok", &[]).await;
    eventually_held(&mut w, b"writer-ok", &[]).await;

    // A writer that had not yet applied the newer epoch (another replica's caller) could
    // publish a zombie's message: every replica fences it in stream order, counted as `writer`.
    let mut h = async_nats::HeaderMap::new();
    h.insert("x-producer-epoch", OLD);
    let late = update("decode-a1", "team-a", b"writer-late-zombie");
    js.publish_with_headers(
        "ic.admitted.update",
        h,
        prost::Message::encode_to_vec(&late).into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    for srv in [&writer, &reader] {
        assert!(wait_until(Duration::from_secs(10), || applied(srv) == 3));
        assert_eq!(refused_count(&metrics_text(srv), "writer", "fenced"), 1.0);
    }
    assert!(
        holders(&mut r, "team-a", b"writer-late-zombie")
            .await
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn the_writer_publishes_only_admitted_messages_shards_1() {
    the_writer_publishes_only_admitted_messages(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn the_writer_publishes_only_admitted_messages_shards_2() {
    the_writer_publishes_only_admitted_messages(2).await;
}

/// A message larger than the log's `max_payload` is refused `RESOURCE_EXHAUSTED` (it never
/// could be stored: not worth a retry) and is not in the stream. A writer whose log is gone
/// acknowledges nothing: with NATS stopped, an authorised
/// ReportCacheState fails `UNAVAILABLE` (no Ack) and is not applied on the writer; a burst of
/// PublishEvent calls larger than the publish slots fails at once beyond them with `UNAVAILABLE`
/// "event log writer saturated" (counted), never queueing, and none is acknowledged.
async fn a_writer_without_its_log_acknowledges_nothing(shards: usize) {
    const STREAM: &str = "IC_E2E_WRITER_DOWN";
    let nats = NatsServer::start_with_max_payload(4096);
    let js = nats.jetstream().await;
    create_stream(&js, STREAM, SUBJECT, -1).await;
    let mut flags = nats_flags(&nats, STREAM);
    flags.push("--nats-log-writer".into());
    let flags_ref: Vec<&str> = flags.iter().map(String::as_str).collect();
    let (_dir, writer, _reviews) =
        token_server(shards, &format!("writer-down-{shards}"), &flags_ref);
    let mut w = writer.client().await;
    accepted(
        report_as(
            &mut w,
            vec![update("decode-a1", "team-a", b"up")],
            Some(TOKEN),
            None,
        )
        .await,
    );
    eventually_held(&mut w, b"up", &["decode-a1"]).await;
    let huge = update("decode-a1", "team-a", &[7u8; 8192]);
    let st = report_as(&mut w, vec![huge], Some(TOKEN), None)
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::ResourceExhausted, "{st:?}");
    assert!(st.message().contains("event log"), "{st:?}");
    assert_eq!(last_sequence(&js, STREAM).await, 1, "only the first update");
    let text = metrics_text(&writer);
    assert_eq!(
        metric_value(
            &text,
            "inferencecache_nats_writer_failed_total{reason=\"too_large\"}"
        ),
        Some(1.0)
    );
    drop(nats);

    let lost = update("decode-a1", "team-a", b"writer-down");
    let st = report_as(&mut w, vec![lost], Some(TOKEN), None)
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::Unavailable, "{st:?}");
    assert!(st.message().contains("event log"), "{st:?}");
    assert!(holders(&mut w, "team-a", b"writer-down").await.is_empty());

    // More calls at once than NATS_WRITER_MAX_IN_FLIGHT (64), over a few connections.
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..96 {
        let mut c = if i % 24 == 0 {
            writer.client().await
        } else {
            w.clone()
        };
        let e = cache_event(Type::AllCleared, "team-a", "m", "decode-a1", b"", "");
        calls.spawn(async move { publish_as(&mut c, e, Some(TOKEN), None).await });
    }
    let mut codes = std::collections::BTreeMap::new();
    while let Some(r) = calls.join_next().await {
        let outcome = match r.unwrap() {
            Ok(_) => "Ok".to_string(),
            Err(st) if st.message().contains("saturated") => format!("{:?} saturated", st.code()),
            Err(st) => format!("{:?}", st.code()),
        };
        *codes.entry(outcome).or_insert(0) += 1;
    }
    assert!(
        !codes.contains_key("Ok"),
        "acknowledged without a log: {codes:?}"
    );
    assert!(codes.contains_key("Unavailable saturated"), "{codes:?}");
    assert_eq!(codes.len(), 2, "only UNAVAILABLE: {codes:?}");
    let text = metrics_text(&writer);
    let saturated = metric_value(
        &text,
        "inferencecache_nats_writer_failed_total{reason=\"saturated\"}",
    )
    .unwrap_or(0.0);
    assert_eq!(saturated as usize, codes["Unavailable saturated"]);
    assert_eq!(
        metric_value(&text, "inferencecache_nats_writer_in_flight"),
        Some(0.0),
        "every slot freed once its publish gave up"
    );
    assert!(
        holders(&mut w, "team-a", b"up").await == ["decode-a1"],
        "nothing cleared"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn a_writer_without_its_log_acknowledges_nothing_shards_1() {
    a_writer_without_its_log_acknowledges_nothing(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn a_writer_without_its_log_acknowledges_nothing_shards_2() {
    a_writer_without_its_log_acknowledges_nothing(2).await;
}

/// The NATS permissions docs/OPERATIONS.md "The server as the log's only writer" documents (the
/// replicas' user kept off the producer subjects, no producer user): a writer logged in as that
/// user consumes the stream and publishes admitted messages, which a second replica applies;
/// the same user publishing on a producer subject is refused by NATS (nothing reaches the
/// stream).
async fn the_documented_nats_permissions_admit_only_the_writer(shards: usize) {
    const STREAM: &str = "IC_E2E_WRITER_PERMS";
    let nats = NatsServer::start_with_users(
        "{ user: replica, password: replica-pw, permissions: { publish: { deny: \
         [\"ic.update\", \"ic.event\", \"ic.update.>\", \"ic.event.>\"] } } }",
    );
    let dir = scratch_dir(&format!("writer-perms-{shards}"));
    let pw = dir.join("replica-pw");
    std::fs::write(&pw, "replica-pw").unwrap();
    let mut flags = nats_flags(&nats, STREAM);
    flags.extend(
        [
            "--nats-user",
            "replica",
            "--nats-password-file",
            pw.to_str().unwrap(),
        ]
        .map(String::from),
    );
    let reader = start_replica(shards, &flags);
    flags.push("--nats-log-writer".into());
    let flags_ref: Vec<&str> = flags.iter().map(String::as_str).collect();
    let (_dir, writer, _reviews) =
        token_server(shards, &format!("writer-perms-w-{shards}"), &flags_ref);
    let mut w = writer.client().await;
    // The first replica to connect creates the stream; the writer retries until it is there.
    let ok = update("decode-a1", "team-a", b"perms-ok");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match report_as(&mut w, vec![ok.clone()], Some(TOKEN), None).await {
            Ok(ack) => break assert!(ack.accepted, "{ack:?}"),
            Err(st) if std::time::Instant::now() < deadline => {
                assert_eq!(st.code(), tonic::Code::Unavailable, "{st:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(st) => panic!("the writer never published: {st:?}"),
        }
    }
    let mut r = reader.client().await;
    eventually_held(&mut r, b"perms-ok", &["decode-a1"]).await;

    let client =
        async_nats::ConnectOptions::with_user_and_password("replica".into(), "replica-pw".into())
            .connect(nats.url())
            .await
            .expect("the replicas' user logs in");
    let js = jetstream::new(client);
    let before = last_sequence(&js, STREAM).await;
    let forged = prost::Message::encode_to_vec(&update("decode-b", "team-a", b"perms-forged"));
    for subject in ["ic.update", "ic.update.pool-a"] {
        let acked = tokio::time::timeout(Duration::from_secs(5), async {
            js.publish(subject, forged.clone().into())
                .await
                .ok()?
                .await
                .ok()
        })
        .await;
        assert!(!matches!(acked, Ok(Some(_))), "NATS stored {subject}");
    }
    assert_eq!(
        last_sequence(&js, STREAM).await,
        before,
        "nothing reached the stream"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn the_documented_nats_permissions_admit_only_the_writer_shards_1() {
    the_documented_nats_permissions_admit_only_the_writer(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn the_documented_nats_permissions_admit_only_the_writer_shards_2() {
    the_documented_nats_permissions_admit_only_the_writer(2).await;
}

/// The deploy/ flow end to end: the real subscriber with `--token-file` reports its engine's
/// blocks to the writer's gRPC port over its long-lived stream; the writer publishes them (each
/// stream message on `ic.admitted.update`, carrying the subscriber's `x-producer-epoch`) and a
/// second replica, which no producer calls, serves them to a gateway.
async fn the_subscriber_through_a_writer_reaches_every_replica(shards: usize) {
    use crate::kvevents::{BS, batch, prime_subscriber, publish, spawn_subscriber, stored};
    use zeromq::Socket as _;
    const STREAM: &str = "IC_E2E_WRITER_SUB";
    let nats = NatsServer::start();
    let js = nats.jetstream().await;
    create_stream(&js, STREAM, SUBJECT, -1).await;
    let mut flags = nats_flags(&nats, STREAM);
    flags.extend(["--engine-block-size".into(), BS.to_string()]);
    let reader = start_replica(shards, &flags);
    flags.extend(["--nats-log-writer".into(), "--require-producer-auth".into()]);
    let flags_ref: Vec<&str> = flags.iter().map(String::as_str).collect();
    let (dir, writer, _reviews) = token_server(shards, &format!("writer-sub-{shards}"), &flags_ref);
    let token = dir.join("producer-token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();

    let mut engine = zeromq::PubSocket::new();
    let ep = engine.bind("tcp://127.0.0.1:0").await.unwrap();
    let metrics_port = free_port();
    let args = <kvevent_subscriber::cli::Args as clap::Parser>::parse_from([
        "kvevent-subscriber",
        "--endpoint",
        &ep.to_string(),
        "--topic",
        "kv",
        "--server",
        &writer.grpc_url(),
        "--token-file",
        token.to_str().unwrap(),
        "--replica-id",
        "decode-a1",
        "--model-id",
        "m",
        "--tenant-id",
        "team-a",
        "--flush-interval",
        "10ms",
        "--metrics-bind",
        &format!("127.0.0.1:{metrics_port}"),
    ]);
    let (stop_tx, sub) = spawn_subscriber(args);
    let seq = prime_subscriber(&mut engine, metrics_port, &sub).await;
    publish(&mut engine, seq, batch(vec![stored(&[41, 42], 0..2 * BS)])).await;
    let lookup = pb::LookupRouteRequest {
        model_id: "m".into(),
        tenant_id: "team-a".into(),
        hash_scheme: "vllm".into(),
        token_ids: (0..2 * BS).collect(),
        ..Default::default()
    };
    let gateway = reader.client().await;
    poll_until(
        "the subscriber's blocks served by the replica it never called",
        Duration::from_secs(30),
        || {
            let (mut g, req) = (gateway.clone(), lookup.clone());
            async move {
                let r = g.lookup_route(req).await.unwrap().into_inner();
                r.reason_code == "PREFIX_MATCH" && r.replica_scores[0].replica_id == "decode-a1"
            }
        },
    )
    .await;
    let log = stream_messages(&js, STREAM).await;
    assert!(!log.is_empty());
    for (subject, epoch, _) in &log {
        assert_eq!(subject, "ic.admitted.update");
        assert!(
            !epoch.is_empty(),
            "the subscriber's epoch travels with its messages"
        );
    }
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(15), sub).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn the_subscriber_through_a_writer_reaches_every_replica_shards_1() {
    the_subscriber_through_a_writer_reaches_every_replica(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(has_nats_server),
    ignore = "nats-server not on PATH: apt-get install nats-server, then touch build.rs"
)]
async fn the_subscriber_through_a_writer_reaches_every_replica_shards_2() {
    the_subscriber_through_a_writer_reaches_every_replica(2).await;
}
