//! Authenticated ingest (README "Authenticated ingest"): a ZMQ publisher in the test → the
//! `kvevent-subscriber` binary over `https://` → a TLS test double of the server that REQUIRES a
//! client certificate signed by its CA (a real mutual-TLS handshake, certificates generated
//! here) and records, per call, the `x-producer-epoch` and `authorization` metadata and the
//! client certificate presented. The double recycles connections (`max_connection_age`) so a
//! rotated client certificate shows up on a later connection.

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use inferencecache_proto::v1alpha1::inference_cache_server::InferenceCacheServer;
use inferencecache_proto::v1alpha1::*;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use rmpv::Value;
use support::{Ingest, IngestDouble};
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

// ---------------------------------------------------------------- certificates

/// A test CA that signs server and client certificates.
struct Ca {
    params: CertificateParams,
    key: KeyPair,
    pem: String,
}

impl Ca {
    fn new() -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "producers CA");
        let pem = params.self_signed(&key).unwrap().pem();
        Ca { params, key, pem }
    }

    /// (certificate PEM, key PEM, certificate DER) for `sans`, as a server or a client.
    fn sign(&self, cn: &str, sans: &[&str], client: bool) -> (String, String, Vec<u8>) {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        if client {
            params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        }
        let cert = params
            .signed_by(&key, &Issuer::from_params(&self.params, &self.key))
            .unwrap();
        (cert.pem(), key.serialize_pem(), cert.der().to_vec())
    }
}

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!(
            "kvevent-cred-{}-{name}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
    fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes a client pair into `<dir>/<version>/` and points `<dir>/current` at it by an atomic
/// symlink swap, the way the kubelet updates a mounted Secret.
fn install_pair(dir: &Path, version: &str, cert: &str, key: &str) {
    let v = dir.join(version);
    std::fs::create_dir_all(&v).unwrap();
    std::fs::write(v.join("tls.crt"), cert).unwrap();
    std::fs::write(v.join("tls.key"), key).unwrap();
    let tmp = dir.join("current.tmp");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&v, &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("current")).unwrap();
}

// ---------------------------------------------------------------- recording TLS double

/// What one call presented.
#[derive(Debug, Clone)]
struct Call {
    method: &'static str,
    epoch: Option<String>,
    authorization: Option<String>,
    cert: Option<Vec<u8>>,
}

#[derive(Clone, Default)]
struct Double {
    calls: Arc<Mutex<Vec<Call>>>,
    /// While set, PublishEvent answers PERMISSION_DENIED.
    deny_events: Arc<AtomicBool>,
}

fn seen<T>(method: &'static str, req: &Request<T>) -> Call {
    let md = req.metadata();
    let text = |k: &str| md.get(k).and_then(|v| v.to_str().ok()).map(str::to_string);
    Call {
        method,
        epoch: text("x-producer-epoch"),
        authorization: text("authorization"),
        cert: req
            .peer_certs()
            .and_then(|c| c.first().map(|d| d.as_ref().to_vec())),
    }
}

#[tonic::async_trait]
impl IngestDouble for Double {
    async fn report_cache_state(
        &self,
        req: Request<Streaming<CacheStateUpdate>>,
    ) -> Result<Response<Ack>, Status> {
        self.calls
            .lock()
            .unwrap()
            .push(seen("ReportCacheState", &req));
        let mut stream = req.into_inner();
        while stream.message().await?.is_some() {}
        Ok(Response::new(Ack {
            accepted: true,
            reason_code: String::new(),
        }))
    }
    async fn publish_event(&self, req: Request<CacheEvent>) -> Result<Response<Ack>, Status> {
        self.calls.lock().unwrap().push(seen("PublishEvent", &req));
        if self.deny_events.load(Ordering::SeqCst) {
            return Err(Status::permission_denied("not your replica"));
        }
        Ok(Response::new(Ack {
            accepted: true,
            reason_code: String::new(),
        }))
    }
}

impl Double {
    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }
}

/// Starts the double with TLS (server certificate for localhost / 127.0.0.1) requiring a client
/// certificate signed by `ca`; connections live at most 500 ms.
async fn start_double(ca: &Ca) -> (SocketAddr, Double) {
    let (cert, key, _) = ca.sign("server", &["localhost", "127.0.0.1"], false);
    let tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(cert, key))
        .client_ca_root(Certificate::from_pem(&ca.pem));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let d = Double::default();
    let svc = InferenceCacheServer::new(Ingest(d.clone()));
    let server = Server::builder()
        .tls_config(tls)
        .unwrap()
        .max_connection_age(Duration::from_millis(500));
    tokio::spawn(async move {
        server
            .serve_with_incoming(svc, TcpIncoming::from(listener))
            .await
            .unwrap();
    });
    (addr, d)
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

fn spawn_subscriber(endpoint: &str, server: &str, extra: &[&str]) -> Subscriber {
    let mport = free_port();
    let out = || {
        if std::env::var_os("KVEVENT_TEST_LOGS").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        }
    };
    let child = Command::new(env!("CARGO_BIN_EXE_kvevent-subscriber"))
        .args(["--endpoint", endpoint, "--topic", "kv", "--server", server])
        .args(["--replica-id", "r1", "--model-id", "m", "--tenant-id", "t"])
        .args(["--flush-interval", "20ms", "--ack-interval", "100ms"])
        .args(["--metrics-bind", &format!("127.0.0.1:{mport}")])
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

async fn sub_metric(s: &Subscriber, series: &str) -> f64 {
    let Ok(text) = kvevent_subscriber::stats::fetch(&s.metrics_url, Duration::from_secs(2)).await
    else {
        return 0.0;
    };
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

fn payload(events: Vec<Value>) -> Bytes {
    let mut out = Vec::new();
    rmpv::encode::write_value(
        &mut out,
        &Value::Array(vec![Value::F64(1.0), Value::Array(events), Value::from(0)]),
    )
    .unwrap();
    Bytes::from(out)
}

async fn publish(p: &mut PubSocket, seq: u64, events: Vec<Value>) {
    let msg = ZmqMessage::try_from(vec![
        Bytes::from_static(b"kv"),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        payload(events),
    ])
    .unwrap();
    p.send(msg).await.unwrap();
}

fn stored(hash: u64) -> Value {
    Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        ("block_hashes".into(), Value::Array(vec![Value::from(hash)])),
        ("parent_block_hash".into(), Value::Nil),
        (
            "token_ids".into(),
            Value::Array((1..=16u32).map(Value::from).collect()),
        ),
        ("block_size".into(), Value::from(16)),
        ("lora_id".into(), Value::Nil),
        ("medium".into(), "GPU".into()),
        ("lora_name".into(), Value::Nil),
    ])
}

fn removed(hash: u64) -> Value {
    Value::Map(vec![
        ("type".into(), "BlockRemoved".into()),
        ("block_hashes".into(), Value::Array(vec![Value::from(hash)])),
        ("medium".into(), "GPU".into()),
    ])
}

/// Publishes a stored + removed pair every 100 ms (a ReportCacheState stream and a PublishEvent
/// call each time) until `done` holds for the double's calls; bounded by 30 s.
async fn drive_until(
    p: &mut PubSocket,
    seq: &mut u64,
    d: &Double,
    what: &str,
    done: impl Fn(&[Call]) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if done(&d.calls()) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: never seen; calls {:#?}",
            d.calls()
        );
        let h = 1000 + *seq;
        publish(p, *seq, vec![stored(h), removed(h)]).await;
        *seq += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn epoch_parts(e: &str) -> (u64, &str) {
    let (ms, id) = e.split_once('-').expect("<unix_ms>-<16 hex>");
    assert_eq!(id.len(), 16, "{e}");
    assert!(
        id.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
        "{e}"
    );
    (ms.parse().expect("unix ms"), id)
}

// ---------------------------------------------------------------- scenarios

/// The certificate, the token and the epoch reach the server on both call kinds; a rotated
/// token is sent from the next call on, a rotated certificate from the next connection on;
/// the epoch is fixed for the process, and a restarted subscriber sends a newer one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificate_token_and_epoch_are_presented_and_rotate() {
    let ca = Ca::new();
    let (addr, double) = start_double(&ca).await;
    let dir = Scratch::new("rotate");
    let ca_file = dir.write("ca.pem", &ca.pem);
    let token = dir.write("token", "token-one\n");
    let (cert_a, key_a, der_a) = ca.sign("producer-a", &["producer-a.example"], true);
    let (cert_b, key_b, der_b) = ca.sign("producer-b-rotated", &["producer-b.example"], true);
    install_pair(&dir.0, "v1", &cert_a, &key_a);
    let current = dir.0.join("current");
    let args: Vec<String> = vec![
        "--server-ca-file".into(),
        ca_file.display().to_string(),
        "--client-cert-file".into(),
        current.join("tls.crt").display().to_string(),
        "--client-key-file".into(),
        current.join("tls.key").display().to_string(),
        "--token-file".into(),
        token.display().to_string(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = format!("https://127.0.0.1:{}", addr.port());

    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let sub = spawn_subscriber(&ep.to_string(), &server, &args);
    let mut seq = 0;
    drive_until(&mut pub_sock, &mut seq, &double, "both call kinds", |c| {
        c.iter().any(|c| c.method == "ReportCacheState")
            && c.iter().any(|c| c.method == "PublishEvent")
    })
    .await;
    let first = double.calls();
    let epoch = first[0]
        .epoch
        .clone()
        .expect("x-producer-epoch on every call");
    let (ms, _) = epoch_parts(&epoch);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert!(
        ms <= now_ms && now_ms - ms < 120_000,
        "{epoch}: the start time"
    );
    for c in &first {
        assert_eq!(c.epoch.as_deref(), Some(epoch.as_str()), "{c:?}");
        assert_eq!(
            c.authorization.as_deref(),
            Some("Bearer token-one"),
            "{c:?}"
        );
        assert_eq!(c.cert.as_deref(), Some(der_a.as_slice()), "{c:?}");
    }

    // A projected token is rotated by replacing the file: the next calls carry the new one.
    std::fs::write(&token, "token-two-rotated").unwrap();
    drive_until(&mut pub_sock, &mut seq, &double, "the rotated token", |c| {
        c.iter()
            .any(|c| c.authorization.as_deref() == Some("Bearer token-two-rotated"))
    })
    .await;
    // The Secret's files are swapped: a later connection presents the new certificate.
    install_pair(&dir.0, "v2", &cert_b, &key_b);
    drive_until(
        &mut pub_sock,
        &mut seq,
        &double,
        "the rotated certificate",
        |c| {
            c.iter()
                .any(|c| c.cert.as_deref() == Some(der_b.as_slice()))
        },
    )
    .await;
    let all = double.calls();
    assert!(
        all.iter()
            .all(|c| c.epoch.as_deref() == Some(epoch.as_str())),
        "one epoch per process: {all:#?}"
    );
    assert_eq!(
        sub_metric(&sub, "kvevent_credential_reload_errors_total").await,
        0.0
    );
    drop(sub);

    // A restarted subscriber (same replica) sends a newer epoch.
    let before = double.calls().len();
    let sub2 = spawn_subscriber(&ep.to_string(), &server, &args);
    drive_until(
        &mut pub_sock,
        &mut seq,
        &double,
        "the second process",
        |c| {
            c[before..]
                .iter()
                .any(|c| c.epoch.as_deref() != Some(&epoch))
        },
    )
    .await;
    let later = double.calls()[before..]
        .iter()
        .find_map(|c| c.epoch.clone().filter(|e| *e != epoch))
        .unwrap();
    let (ms2, _) = epoch_parts(&later);
    assert!(ms2 >= ms, "{later} is not newer than {epoch}");
    drop(sub2);
}

/// The double really requires the certificate: without `--client-cert-file` no call gets
/// through (the handshake fails and the subscriber keeps reconnecting).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_client_certificate_the_handshake_is_refused() {
    let ca = Ca::new();
    let (addr, double) = start_double(&ca).await;
    let dir = Scratch::new("nocert");
    let ca_file = dir.write("ca.pem", &ca.pem);
    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let sub = spawn_subscriber(
        &ep.to_string(),
        &format!("https://127.0.0.1:{}", addr.port()),
        &["--server-ca-file", ca_file.to_str().unwrap()],
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seq = 0;
    while sub_metric(&sub, "kvevent_reconnects_total").await < 2.0 {
        assert!(Instant::now() < deadline, "the subscriber never retried");
        publish(&mut pub_sock, seq, vec![stored(7 + seq)]).await;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(double.calls().is_empty(), "{:#?}", double.calls());
}

/// An event the server refuses with PERMISSION_DENIED (not this producer's replica, or fenced)
/// is dropped after a bounded number of attempts and counted, and delivery goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permission_denied_event_is_dropped_after_bounded_retries() {
    let ca = Ca::new();
    let (addr, double) = start_double(&ca).await;
    double.deny_events.store(true, Ordering::SeqCst);
    let dir = Scratch::new("denied");
    let ca_file = dir.write("ca.pem", &ca.pem);
    let (cert, key, _) = ca.sign("producer", &["producer.example"], true);
    let cert_file = dir.write("c.pem", &cert);
    let key_file = dir.write("k.pem", &key);
    let mut pub_sock = PubSocket::new();
    let ep = pub_sock.bind("tcp://127.0.0.1:0").await.unwrap();
    let sub = spawn_subscriber(
        &ep.to_string(),
        &format!("https://localhost:{}", addr.port()),
        &[
            "--server-ca-file",
            ca_file.to_str().unwrap(),
            "--client-cert-file",
            cert_file.to_str().unwrap(),
            "--client-key-file",
            key_file.to_str().unwrap(),
        ],
    );
    let mut seq = 0;
    drive_until(&mut pub_sock, &mut seq, &double, "a refused event", |c| {
        c.iter().any(|c| c.method == "PublishEvent")
    })
    .await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while sub_metric(&sub, "kvevent_dropped_total{reason=\"refused_by_server\"}").await < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the refused event was never dropped"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let denied = double
        .calls()
        .iter()
        .filter(|c| c.method == "PublishEvent")
        .count();
    assert!(denied >= 5, "{denied} attempts before the drop");
    // Delivery continues: later streams and events still reach the server.
    double.deny_events.store(false, Ordering::SeqCst);
    let before = double.calls().len();
    drive_until(
        &mut pub_sock,
        &mut seq,
        &double,
        "traffic after the drop",
        |c| c.len() > before + 2,
    )
    .await;
}
