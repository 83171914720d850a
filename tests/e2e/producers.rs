//! Producer identity, authorization and fencing on the ingest RPCs (docs/BEHAVIOUR.md §4.3,
//! docs/OPERATIONS.md "Hardened setup"), with `--shards 1` and `2`: client certificates from a
//! generated CA on a TLS gRPC port, producer tokens reviewed by the stand-in TokenReview server,
//! the `--producer-policy` bindings and their reload, `x-producer-epoch` fencing across a
//! restart with `--state-dir`; and gateways' LookupRoute with no credentials at all.

use std::time::{Duration, Instant, SystemTime};

use crate::support::*;
use pb::cache_event::Type;
use pb::inference_cache_client::InferenceCacheClient;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

pub(crate) type Client = InferenceCacheClient<Channel>;

const ENGINE_A: &str = "spiffe://cluster.test/ns/llm/sa/engine-a";
const ENGINE_B_DNS: &str = "engine-b.llm.svc";
pub(crate) const PRODUCER_AUD: &str = "inferencecache.io/producer";
const ENGINE_SA: &str = "system:serviceaccount:llm:engine-a";

/// engine-a (by SPIFFE URI) may report `decode-a*` of team-a; engine-b (by DNS name) `decode-b`
/// of team-a and team-b; the engine-a service account (tokens) `decode-a*` of team-a.
const POLICY_YAML: &str = "bindings:
  - identities: [\"spiffe://cluster.test/ns/llm/sa/engine-a\"]
    replicas: [\"decode-a*\"]
    tenants: [\"team-a\"]
  - identities: [\"engine-b.llm.svc\"]
    replicas: [\"decode-b\"]
    tenants: [\"team-a\", \"team-b\"]
  - identities: [\"system:serviceaccount:llm:engine-a\"]
    replicas: [\"decode-a*\"]
    tenants: [\"team-a\"]
";

/// Writes `text` to `path` with an mtime `age_s` seconds from now (a reload needs a new mtime).
fn write_at(path: &std::path::Path, text: &str, age_s: i64) {
    std::fs::write(path, text).unwrap();
    let t = if age_s >= 0 {
        SystemTime::now() + Duration::from_secs(age_s as u64)
    } else {
        SystemTime::now() - Duration::from_secs((-age_s) as u64)
    };
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(t)
        .unwrap();
}

async fn tls_client(port: u16, ca_pem: &str, id: Option<&ClientCert>) -> Result<Client, String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name("localhost");
    if let Some(c) = id {
        tls = tls.identity(Identity::from_pem(&c.cert_pem, &c.key_pem));
    }
    let ch = Channel::from_shared(format!("https://localhost:{port}"))
        .unwrap()
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))?;
    let mut c = InferenceCacheClient::new(ch);
    // A client certificate the CA did not sign fails the handshake; with TLS 1.3 the client
    // learns it on its first request.
    c.get_cache_state(pb::GetCacheStateRequest::default())
        .await
        .map_err(|e| format!("{e:?}"))?;
    Ok(c)
}

/// Adds call metadata: `authorization: Bearer <token>` and/or `x-producer-epoch`.
pub(crate) fn with_meta<T>(msg: T, token: Option<&str>, epoch: Option<&str>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(t) = token {
        r.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    if let Some(e) = epoch {
        r.metadata_mut()
            .insert("x-producer-epoch", e.parse().unwrap());
    }
    r
}

pub(crate) fn update(replica: &str, tenant: &str, hash: &[u8]) -> pb::CacheStateUpdate {
    let mut u = legacy_update(replica, tenant, "m", "vllm", hash, 64);
    u.timestamp_us = fresh_ts();
    u
}

/// ReportCacheState of `updates` with metadata: the Ack, or the call's status.
pub(crate) async fn report_as(
    c: &mut Client,
    updates: Vec<pb::CacheStateUpdate>,
    token: Option<&str>,
    epoch: Option<&str>,
) -> Result<pb::Ack, tonic::Status> {
    c.report_cache_state(with_meta(tokio_stream::iter(updates), token, epoch))
        .await
        .map(|r| r.into_inner())
}

pub(crate) async fn publish_as(
    c: &mut Client,
    e: pb::CacheEvent,
    token: Option<&str>,
    epoch: Option<&str>,
) -> Result<pb::Ack, tonic::Status> {
    c.publish_event(with_meta(e, token, epoch))
        .await
        .map(|r| r.into_inner())
}

/// A call without an identity: its ReportCacheState of `hash` for `replica` of `tenant` is
/// refused with `UNAUTHENTICATED`, and its ALL_CLEARED for that replica fails `Unauthenticated`.
async fn anonymous_refused(c: &mut Client, replica: &str, tenant: &str, hash: &[u8]) {
    refused(
        report_as(c, vec![update(replica, tenant, hash)], None, None).await,
        "UNAUTHENTICATED",
    );
    let st = publish_as(
        c,
        cache_event(Type::AllCleared, tenant, "m", replica, b"", ""),
        None,
        None,
    )
    .await
    .unwrap_err();
    assert_eq!(st.code(), tonic::Code::Unauthenticated, "{st:?}");
}

pub(crate) fn refused(ack: Result<pb::Ack, tonic::Status>, reason: &str) {
    let ack = ack.expect("an Ack");
    assert!(!ack.accepted, "{ack:?}");
    assert_eq!(ack.reason_code, reason);
}

pub(crate) fn accepted(ack: Result<pb::Ack, tonic::Status>) {
    let ack = ack.expect("an Ack");
    assert!(ack.accepted, "{ack:?}");
    assert_eq!(ack.reason_code, "");
}

/// The replicas LookupRoute names as holding `hash` of `(tenant, m)` (a PREFIX_MATCH; a miss
/// may still name an affinity pick, and a key every serving replica holds distinguishes none,
/// docs/BEHAVIOUR.md §9.4), sorted.
pub(crate) async fn holders(c: &mut Client, tenant: &str, hash: &[u8]) -> Vec<String> {
    let resp = lookup(c, exact_lookup(tenant, "m", "vllm", hash, 64)).await;
    if resp.reason_code != "PREFIX_MATCH" {
        return Vec::new();
    }
    let mut out: Vec<String> = resp
        .replica_scores
        .into_iter()
        .map(|s| s.replica_id)
        .collect();
    out.sort();
    out
}

pub(crate) fn refused_count(text: &str, identity: &str, reason: &str) -> f64 {
    metric_value(
        text,
        &format!(
            "inferencecache_producer_refused_total{{identity=\"{identity}\",reason=\"{reason}\"}}"
        ),
    )
    .unwrap_or(0.0)
}

/// The next change-feed event within 10 s.
async fn next_event(s: &mut tonic::Streaming<pb::CacheEvent>) -> pb::CacheEvent {
    tokio::time::timeout(Duration::from_secs(10), s.message())
        .await
        .expect("an event within 10 s")
        .expect("stream ok")
        .expect("stream open")
}

/// Client certificates on a TLS port with a policy and `--require-producer-auth`: authorised
/// producers apply, anonymous ones and ones outside their binding are refused (nothing reaches
/// the index or the change feed), LookupRoute needs no credentials, a certificate from another CA
/// cannot connect, and the policy reloads (a bad file keeps the last good one).
async fn certificates_and_policy(shards: usize) {
    let dir = scratch_dir(&format!("producers-mtls-{shards}"));
    let server_pki = gen_pki("server");
    let (client_ca, certs) = gen_client_certs(
        "engines",
        &[&[ENGINE_A, "engine-a.llm.svc"], &[ENGINE_B_DNS]],
    );
    let (_, rogue) = gen_client_certs("rogue", &[&[ENGINE_A]]);
    let path = |n: &str| dir.join(n).to_string_lossy().into_owned();
    std::fs::write(dir.join("tls.crt"), &server_pki.cert_pem).unwrap();
    std::fs::write(dir.join("tls.key"), &server_pki.key_pem).unwrap();
    std::fs::write(dir.join("clients-ca.pem"), &client_ca).unwrap();
    let policy = dir.join("producers.yaml");
    write_at(&policy, POLICY_YAML, -60);
    let log = dir.join("server.log");
    let (crt, key, ca, pol) = (
        path("tls.crt"),
        path("tls.key"),
        path("clients-ca.pem"),
        path("producers.yaml"),
    );
    let srv = Server::start_opts(
        shards,
        StartOpts {
            flags: &[
                "--tls-cert-file",
                &crt,
                "--tls-key-file",
                &key,
                "--client-ca-file",
                &ca,
                "--producer-policy",
                &pol,
                "--require-producer-auth",
                "--max-event-subscribers",
                "4",
            ],
            stderr_file: Some(log.clone()),
            log_level: Some("info"),
            ..Default::default()
        },
    );
    let port = srv.grpc_port;
    // A gateway: no client certificate, LookupRoute as ever; its ingest is refused.
    let mut gateway = tls_client(port, &server_pki.ca_pem, None).await.unwrap();
    assert!(holders(&mut gateway, "team-a", b"h-a").await.is_empty());
    let mut feed = gateway
        .stream_cache_events(pb::StreamEventsRequest::default())
        .await
        .unwrap()
        .into_inner();
    anonymous_refused(&mut gateway, "decode-a1", "team-a", b"h-anon").await;
    let mut a = tls_client(port, &server_pki.ca_pem, Some(&certs[0]))
        .await
        .unwrap();
    let mut b = tls_client(port, &server_pki.ca_pem, Some(&certs[1]))
        .await
        .unwrap();
    // engine-a: its replicas of team-a apply; another replica or another tenant does not.
    accepted(
        report_as(
            &mut a,
            vec![update("decode-a1", "team-a", b"h-a")],
            None,
            None,
        )
        .await,
    );
    let first = next_event(&mut feed).await;
    assert_eq!(
        (first.replica_id.as_str(), first.prefix_hash.as_slice()),
        ("decode-a1", &b"h-a"[..]),
        "the refused anonymous update never reached the feed"
    );
    refused(
        report_as(
            &mut a,
            vec![update("decode-b", "team-a", b"h-x")],
            None,
            None,
        )
        .await,
        "PERMISSION_DENIED",
    );
    refused(
        report_as(
            &mut a,
            vec![update("decode-a1", "team-b", b"h-x")],
            None,
            None,
        )
        .await,
        "PERMISSION_DENIED",
    );
    // A stream mixing both: the allowed message applies, the Ack names the refusal.
    refused(
        report_as(
            &mut a,
            vec![
                update("decode-b", "team-a", b"h-y"),
                update("decode-a2", "team-a", b"h-y"),
            ],
            None,
            None,
        )
        .await,
        "PERMISSION_DENIED",
    );
    let second = next_event(&mut feed).await;
    assert_eq!(
        (second.replica_id.as_str(), second.prefix_hash.as_slice()),
        ("decode-a2", &b"h-y"[..]),
        "refused updates never reached the feed"
    );
    // engine-b (bound by DNS name): decode-b of team-a and team-b.
    accepted(
        report_as(
            &mut b,
            vec![update("decode-b", "team-a", b"h-b")],
            None,
            None,
        )
        .await,
    );
    accepted(
        report_as(
            &mut b,
            vec![update("decode-b", "team-b", b"h-b")],
            None,
            None,
        )
        .await,
    );
    // engine-a cannot clear engine-b's replica.
    let st = publish_as(
        &mut a,
        cache_event(Type::AllCleared, "team-a", "m", "decode-b", b"", ""),
        None,
        None,
    )
    .await
    .unwrap_err();
    assert_eq!(st.code(), tonic::Code::PermissionDenied, "{st:?}");
    assert_eq!(holders(&mut gateway, "team-a", b"h-a").await, ["decode-a1"]);
    assert_eq!(holders(&mut gateway, "team-a", b"h-b").await, ["decode-b"]);
    assert_eq!(holders(&mut gateway, "team-b", b"h-b").await, ["decode-b"]);
    assert!(holders(&mut gateway, "team-a", b"h-x").await.is_empty());
    assert!(holders(&mut gateway, "team-b", b"h-x").await.is_empty());
    assert!(holders(&mut gateway, "team-a", b"h-anon").await.is_empty());
    assert_eq!(holders(&mut gateway, "team-a", b"h-y").await, ["decode-a2"]);
    let text = metrics_text(&srv);
    assert_eq!(refused_count(&text, "none", "unauthenticated"), 2.0);
    assert_eq!(
        refused_count(&text, "certificate", "permission_denied"),
        4.0
    );
    // A certificate from another CA cannot connect.
    assert!(
        tls_client(port, &server_pki.ca_pem, Some(&rogue[0]))
            .await
            .is_err()
    );
    // Reload: engine-a may now report decode-b too.
    let wider = POLICY_YAML.replace("replicas: [\"decode-a*\"]\n    tenants: [\"team-a\"]\n  - identities: [\"engine-b", "replicas: [\"decode-a*\", \"decode-b\"]\n    tenants: [\"team-a\"]\n  - identities: [\"engine-b");
    assert_ne!(wider, POLICY_YAML);
    write_at(&policy, &wider, -30);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ack = report_as(
            &mut a,
            vec![update("decode-b", "team-a", b"h-r")],
            None,
            None,
        )
        .await
        .unwrap();
        if ack.accepted {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the changed policy was not picked up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    log_text_with(&log, "producer_policy_reloaded");
    // A bad file: logged, counted, the last good policy stays.
    write_at(&policy, "bindings: [ {identities: ", -10);
    poll_until(
        "policy reload error counted",
        Duration::from_secs(10),
        || async {
            metric_value(
                &metrics_text(&srv),
                "inferencecache_producer_policy_reload_errors_total",
            ) == Some(1.0)
        },
    )
    .await;
    accepted(
        report_as(
            &mut a,
            vec![update("decode-b", "team-a", b"h-s")],
            None,
            None,
        )
        .await,
    );
    refused(
        report_as(
            &mut a,
            vec![update("decode-c", "team-a", b"h-s")],
            None,
            None,
        )
        .await,
        "PERMISSION_DENIED",
    );
    assert!(log_text_with(&log, "\"producer_policy_reload\"").contains("producer_policy_reload"));
    // The client CA rotates on disk: certificates of the new CA connect, those of the old one
    // no longer do; connections already open keep their identity.
    let (new_ca, new_certs) = gen_client_certs("engines-2", &[&[ENGINE_A]]);
    write_at(&dir.join("clients-ca.pem"), &new_ca, 30);
    poll_until(
        "the new client CA is in force",
        Duration::from_secs(10),
        || async {
            tls_client(port, &server_pki.ca_pem, Some(&new_certs[0]))
                .await
                .is_ok()
        },
    )
    .await;
    let mut rotated = tls_client(port, &server_pki.ca_pem, Some(&new_certs[0]))
        .await
        .unwrap();
    accepted(
        report_as(
            &mut rotated,
            vec![update("decode-a9", "team-a", b"h-rot")],
            None,
            None,
        )
        .await,
    );
    assert!(
        tls_client(port, &server_pki.ca_pem, Some(&certs[0]))
            .await
            .is_err()
    );
    accepted(
        report_as(
            &mut a,
            vec![update("decode-a1", "team-a", b"h-old-conn")],
            None,
            None,
        )
        .await,
    );
    log_text_with(&log, "grpc_client_ca_reloaded");
}

shards_1_and_2!(certificates_and_policy);

/// A server reviewing producer tokens with the stand-in TokenReview, under a policy binding
/// `ENGINE_SA` to `decode-a*` of `team-a`, started with `extra` flags too.
pub(crate) fn token_server(
    shards: usize,
    name: &str,
    extra: &[&str],
) -> (ScratchDir, Server, std::sync::Arc<StandIn>) {
    let dir = scratch_dir(name);
    let state = std::sync::Arc::new(StandIn::default());
    state.add("engine-a-token", ENGINE_SA, &[PRODUCER_AUD]);
    state.add("engine-a-token-2", ENGINE_SA, &[PRODUCER_AUD]);
    state.add("engine-a-token-3", ENGINE_SA, &[PRODUCER_AUD]);
    state.add(
        "controller-token",
        ENGINE_SA,
        &["inferencecache.io/controller"],
    );
    let (port, ca) = start_stand_in(state.clone(), &dir);
    let sa_token = dir.join("sa-token");
    std::fs::write(&sa_token, format!("{SA_TOKEN}\n")).unwrap();
    let policy = dir.join("producers.json");
    std::fs::write(
        &policy,
        format!(r#"{{"bindings":[{{"identities":["{ENGINE_SA}"],"replicas":["decode-a*"],"tenants":["team-a"]}}]}}"#),
    )
    .unwrap();
    let url = format!("https://127.0.0.1:{port}");
    let mut flags = vec![
        "--producer-token-audience",
        PRODUCER_AUD,
        "--kube-api-server",
        &url,
        "--kube-ca-file",
        &ca,
        "--kube-token-file",
        sa_token.to_str().unwrap(),
        "--producer-policy",
        policy.to_str().unwrap(),
    ];
    flags.extend_from_slice(extra);
    let srv = Server::start_opts(
        shards,
        StartOpts {
            flags: &flags,
            ..Default::default()
        },
    );
    (dir, srv, state)
}

/// Producer tokens reviewed under the producer audience: the reviewed service account is the
/// identity the policy binds; a token for another audience, or none, is refused; reviews are
/// cached; a slow review delays only the call that needs it and a failing one answers
/// UNAVAILABLE with a clear message.
async fn tokens_and_policy(shards: usize) {
    let (_dir, srv, state) = token_server(shards, &format!("producers-token-{shards}"), &[]);
    let mut c = srv.client().await;
    accepted(
        report_as(
            &mut c,
            vec![update("decode-a1", "team-a", b"t-a")],
            Some("engine-a-token"),
            None,
        )
        .await,
    );
    assert_eq!(holders(&mut c, "team-a", b"t-a").await, ["decode-a1"]);
    refused(
        report_as(
            &mut c,
            vec![update("decode-b", "team-a", b"t-x")],
            Some("engine-a-token"),
            None,
        )
        .await,
        "PERMISSION_DENIED",
    );
    refused(
        report_as(
            &mut c,
            vec![update("decode-a1", "team-b", b"t-x")],
            Some("engine-a-token"),
            None,
        )
        .await,
        "PERMISSION_DENIED",
    );
    // The audience is part of the review: a controller token is not a producer token.
    let st = report_as(
        &mut c,
        vec![update("decode-a1", "team-a", b"t-x")],
        Some("controller-token"),
        None,
    )
    .await
    .unwrap_err();
    assert_eq!(st.code(), tonic::Code::Unauthenticated, "{st:?}");
    assert_eq!(
        *state.last_audiences.lock().unwrap(),
        Some(serde_json::json!([PRODUCER_AUD]))
    );
    let st = publish_as(
        &mut c,
        cache_event(Type::AllCleared, "team-a", "m", "decode-a1", b"", ""),
        Some("no-such-token"),
        None,
    )
    .await
    .unwrap_err();
    assert_eq!(st.code(), tonic::Code::Unauthenticated, "{st:?}");
    // No token with a policy: anonymous, refused.
    refused(
        report_as(
            &mut c,
            vec![update("decode-a1", "team-a", b"t-x")],
            None,
            None,
        )
        .await,
        "UNAUTHENTICATED",
    );
    assert!(holders(&mut c, "team-a", b"t-x").await.is_empty());
    // Cached: the same token again costs no review.
    let reviews = state.reviews.load(std::sync::atomic::Ordering::SeqCst);
    accepted(
        report_as(
            &mut c,
            vec![update("decode-a2", "team-a", b"t-a2")],
            Some("engine-a-token"),
            None,
        )
        .await,
    );
    assert_eq!(
        state.reviews.load(std::sync::atomic::Ordering::SeqCst),
        reviews
    );
    // A slow review holds its own call only: LookupRoute on the same server stays prompt.
    state
        .delay_ms
        .store(2_000, std::sync::atomic::Ordering::SeqCst);
    let mut slow_client = srv.client().await;
    let slow = tokio::spawn(async move {
        let started = Instant::now();
        let ack = report_as(
            &mut slow_client,
            vec![update("decode-a3", "team-a", b"t-slow")],
            Some("engine-a-token-2"),
            None,
        )
        .await;
        (ack, started.elapsed())
    });
    poll_until(
        "the slow review started",
        Duration::from_secs(10),
        || async { state.in_flight.load(std::sync::atomic::Ordering::SeqCst) > 0 },
    )
    .await;
    for _ in 0..20 {
        let t = Instant::now();
        assert_eq!(holders(&mut c, "team-a", b"t-a").await, ["decode-a1"]);
        assert_eq!(holders(&mut c, "team-a", b"t-a2").await, ["decode-a2"]);
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "LookupRoute waited {:?} behind a token review",
            t.elapsed()
        );
    }
    let (ack, took) = slow.await.unwrap();
    accepted(ack);
    assert!(took >= Duration::from_millis(1_500), "{took:?}");
    // A failing reviewer: UNAVAILABLE with the reason; nothing applied.
    state.delay_ms.store(0, std::sync::atomic::Ordering::SeqCst);
    state.fail.store(true, std::sync::atomic::Ordering::SeqCst);
    let st = report_as(
        &mut c,
        vec![update("decode-a1", "team-a", b"t-fail")],
        Some("engine-a-token-3"),
        None,
    )
    .await
    .unwrap_err();
    assert_eq!(st.code(), tonic::Code::Unavailable, "{st:?}");
    assert!(
        st.message().contains("producer token review unavailable"),
        "{st:?}"
    );
    assert!(holders(&mut c, "team-a", b"t-fail").await.is_empty());
    let text = metrics_text(&srv);
    assert_eq!(refused_count(&text, "token", "permission_denied"), 2.0);
    assert_eq!(refused_count(&text, "none", "unauthenticated"), 1.0);
    assert_eq!(
        metric_value(&text, "inferencecache_producer_tokens_rejected_total"),
        Some(2.0)
    );
    assert_eq!(
        metric_value(
            &text,
            "inferencecache_producer_token_reviews_unavailable_total"
        ),
        Some(1.0)
    );
}

shards_1_and_2!(tokens_and_policy);

fn fencing_server(shards: usize, state_dir: &std::path::Path) -> Server {
    Server::start_opts(
        shards,
        StartOpts {
            flags: &["--state-dir", state_dir.to_str().unwrap()],
            ..Default::default()
        },
    )
}

/// `x-producer-epoch`: the newest epoch per (tenant, replica) wins, an older one is fenced
/// (ReportCacheState `FENCED`, PublishEvent FAILED_PRECONDITION), other replicas and tenants are
/// independent, a malformed epoch is INVALID_ARGUMENT; and the table survives a restart with
/// `--state-dir`.
async fn fencing_survives_restart(shards: usize) {
    let dir = scratch_dir(&format!("producers-fence-{shards}"));
    let old = "1700000000000-zombie";
    let new = "1700000005000-live";
    let mut srv = fencing_server(shards, &dir);
    let mut c = srv.client().await;
    accepted(report_as(&mut c, vec![update("r1", "t", b"f-old")], None, Some(old)).await);
    accepted(report_as(&mut c, vec![update("r1", "t", b"f-new")], None, Some(new)).await);
    // The zombie comes back: refused, so it cannot re-add what the live producer evicted.
    publish_event(
        &mut c,
        cache_event(Type::PrefixEvicted, "t", "m", "r1", b"f-old", ""),
    )
    .await;
    refused(
        report_as(&mut c, vec![update("r1", "t", b"f-old")], None, Some(old)).await,
        "FENCED",
    );
    let st = publish_as(
        &mut c,
        cache_event(Type::AllCleared, "t", "m", "r1", b"", ""),
        None,
        Some(old),
    )
    .await
    .unwrap_err();
    assert_eq!(st.code(), tonic::Code::FailedPrecondition, "{st:?}");
    assert!(holders(&mut c, "t", b"f-old").await.is_empty());
    assert_eq!(holders(&mut c, "t", b"f-new").await, ["r1"]);
    // Per replica and per tenant.
    accepted(report_as(&mut c, vec![update("r2", "t", b"f-2")], None, Some(old)).await);
    accepted(report_as(&mut c, vec![update("r1", "u", b"f-2")], None, Some(old)).await);
    let st = report_as(
        &mut c,
        vec![update("r1", "t", b"f-bad")],
        None,
        Some("yesterday"),
    )
    .await
    .unwrap_err();
    assert_eq!(st.code(), tonic::Code::InvalidArgument, "{st:?}");
    let text = metrics_text(&srv);
    assert_eq!(refused_count(&text, "none", "fenced"), 2.0);
    assert_eq!(
        metric_value(&text, "inferencecache_producer_epochs"),
        Some(3.0)
    );
    assert!(srv.terminate().success());
    // After a restart on the same state directory the zombie is still fenced.
    let srv = fencing_server(shards, &dir);
    let mut c = srv.client().await;
    assert_eq!(
        metric_value(&metrics_text(&srv), "inferencecache_producer_epochs"),
        Some(3.0)
    );
    refused(
        report_as(&mut c, vec![update("r1", "t", b"f-old")], None, Some(old)).await,
        "FENCED",
    );
    assert!(holders(&mut c, "t", b"f-old").await.is_empty());
    accepted(report_as(&mut c, vec![update("r1", "t", b"f-3")], None, Some(new)).await);
    assert_eq!(holders(&mut c, "t", b"f-3").await, ["r1"]);
}

shards_1_and_2!(fencing_survives_restart);

/// `--require-producer-auth` without a policy: a caller without an identity is refused, reads
/// are unaffected; an identity (here a reviewed token) may report for any replica.
async fn required_without_policy(shards: usize) {
    let dir = scratch_dir(&format!("producers-require-{shards}"));
    let state = std::sync::Arc::new(StandIn::default());
    state.add("engine-a-token", ENGINE_SA, &[PRODUCER_AUD]);
    let (port, ca) = start_stand_in(state.clone(), &dir);
    let sa_token = dir.join("sa-token");
    std::fs::write(&sa_token, format!("{SA_TOKEN}\n")).unwrap();
    let url = format!("https://127.0.0.1:{port}");
    let srv = Server::start_opts(
        shards,
        StartOpts {
            flags: &[
                "--producer-token-audience",
                PRODUCER_AUD,
                "--kube-api-server",
                &url,
                "--kube-ca-file",
                &ca,
                "--kube-token-file",
                sa_token.to_str().unwrap(),
                "--require-producer-auth",
            ],
            ..Default::default()
        },
    );
    let mut c = srv.client().await;
    anonymous_refused(&mut c, "any-replica", "any-tenant", b"q").await;
    assert!(holders(&mut c, "any-tenant", b"q").await.is_empty());
    accepted(
        report_as(
            &mut c,
            vec![update("any-replica", "any-tenant", b"q")],
            Some("engine-a-token"),
            None,
        )
        .await,
    );
    assert_eq!(holders(&mut c, "any-tenant", b"q").await, ["any-replica"]);
    assert_eq!(
        refused_count(&metrics_text(&srv), "none", "unauthenticated"),
        2.0
    );
}

shards_1_and_2!(required_without_policy);

/// Flags that cannot work are refused at start-up; a policy that does not load fails it.
#[test]
fn producer_startup_failures() {
    let dir = scratch_dir("producers-startup");
    let (code, err) = run_exit(
        &[
            "--insecure-disable-auth",
            "--client-ca-file",
            "/nonexistent",
        ],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--client-ca-file requires --tls-cert-file"),
        "{err}"
    );
    let (code, err) = run_exit(&["--insecure-disable-auth", "--require-producer-auth"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--require-producer-auth requires"), "{err}");
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, "bindings: 3").unwrap();
    let (code, err) = run_exit(
        &[
            "--insecure-disable-auth",
            "--producer-policy",
            bad.to_str().unwrap(),
            "--producer-token-audience",
            PRODUCER_AUD,
            "--kube-api-server",
            "http://127.0.0.1:1",
            "--kube-token-file",
            bad.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("producer_policy_load"), "{err}");
}

/// The real subscriber with `--token-file` against the real server reviewing producer tokens
/// (the stand-in TokenReview) under a policy that binds the token's service account to this
/// replica and tenant: its engine's blocks are admitted and served by LookupRoute, which a
/// gateway calls with no credentials. With the token's service account bound to another
/// replica, the same run is refused (checked below by a second subscriber).
async fn subscriber_with_a_token(shards: usize) {
    use crate::kvevents::{BS, batch, prime_subscriber, publish, spawn_subscriber, stored};
    use zeromq::Socket as _;
    let bs = BS.to_string();
    let (dir, srv, _state) = token_server(
        shards,
        &format!("producers-subscriber-token-{shards}"),
        &["--engine-block-size", &bs, "--require-producer-auth"],
    );
    let token = dir.join("producer-token");
    std::fs::write(&token, "engine-a-token\n").unwrap();
    let token = token.display().to_string();
    let run = |replica: &'static str, first_block: u64| {
        let (grpc, token) = (srv.grpc_port, token.clone());
        async move {
            let mut pub_sock = zeromq::PubSocket::new();
            let ep = zeromq::Socket::bind(&mut pub_sock, "tcp://127.0.0.1:0")
                .await
                .unwrap();
            let metrics_port = free_port();
            let args = <kvevent_subscriber::cli::Args as clap::Parser>::parse_from([
                "kvevent-subscriber",
                "--endpoint",
                &ep.to_string(),
                "--topic",
                "kv",
                "--server",
                &format!("http://127.0.0.1:{grpc}"),
                "--token-file",
                &token,
                "--replica-id",
                replica,
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
            let seq = prime_subscriber(&mut pub_sock, metrics_port, &sub).await;
            let blocks = [first_block, first_block + 1];
            let tokens = first_block as u32 * BS..(first_block as u32 + 2) * BS;
            publish(&mut pub_sock, seq, batch(vec![stored(&blocks, tokens)])).await;
            // The socket lives as long as the subscriber: dropped now, it could go before the
            // subscriber has read the event.
            (stop_tx, sub, pub_sock)
        }
    };
    let lookup = |first_block: u32| pb::LookupRouteRequest {
        model_id: "m".into(),
        tenant_id: "team-a".into(),
        hash_scheme: "vllm".into(),
        token_ids: (first_block * BS..(first_block + 2) * BS).collect(),
        ..Default::default()
    };
    let mut gateway = srv.client().await;
    // Bound to decode-a*: admitted.
    let (stop_a, sub_a, _pub_a) = run("decode-a1", 41).await;
    poll_until(
        "the token producer's blocks served",
        Duration::from_secs(30),
        || {
            let mut g = gateway.clone();
            async move {
                let r = g.lookup_route(lookup(41)).await.unwrap().into_inner();
                r.reason_code == "PREFIX_MATCH" && r.replica_scores[0].replica_id == "decode-a1"
            }
        },
    )
    .await;
    // The same token for a replica its service account is not bound to: refused and counted.
    let (stop_b, sub_b, _pub_b) = run("decode-b", 141).await;
    poll_until(
        "the unbound replica refused",
        Duration::from_secs(30),
        || {
            let text = metrics_text(&srv);
            async move {
                text.lines().any(|l| {
                    l.starts_with("inferencecache_producer_refused_total{")
                        && l.contains("permission_denied")
                        && !l.ends_with(" 0")
                })
            }
        },
    )
    .await;
    let r = gateway
        .lookup_route(lookup(141))
        .await
        .unwrap()
        .into_inner();
    // A miss: at most an affinity pick among admitted replicas, never decode-b's blocks.
    assert!(
        r.reason_code != "PREFIX_MATCH"
            && r.replica_scores.iter().all(|s| s.replica_id != "decode-b"),
        "a refused producer's blocks served: {r:?}"
    );
    for (stop, sub) in [(stop_a, sub_a), (stop_b, sub_b)] {
        let _ = stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(15), sub).await;
    }
}

shards_1_and_2!(subscriber_with_a_token);
