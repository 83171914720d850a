//! End-to-end checks of TLS on the gRPC port (docs/BEHAVIOUR.md §1.1) with `--shards 1` and `2`:
//! real TLS clients (tonic with rustls, and a raw rustls client for the protocol details)
//! complete handshakes and RPCs on every core, the certificate is rotated on disk and served
//! without a restart, a broken rotation keeps the cached pair, and start-up failures exit.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::support::*;
use pb::inference_cache_client::InferenceCacheClient;
use serde_json::Value;
use tonic::transport::{Certificate, Channel, ClientTlsConfig};

fn write_pair(dir: &std::path::Path, pki: &TestPki, mtime: SystemTime) -> (String, String) {
    let cert = dir.join("tls.crt");
    let key = dir.join("tls.key");
    std::fs::write(&key, &pki.key_pem).unwrap();
    std::fs::write(&cert, &pki.cert_pem).unwrap();
    for p in [&cert, &key] {
        std::fs::File::options()
            .write(true)
            .open(p)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
    }
    (
        cert.to_string_lossy().into_owned(),
        key.to_string_lossy().into_owned(),
    )
}

async fn tls_client(port: u16, ca_pem: &str) -> Result<InferenceCacheClient<Channel>, String> {
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name("localhost");
    let ch = Channel::from_shared(format!("https://localhost:{port}"))
        .unwrap()
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))?;
    Ok(InferenceCacheClient::new(ch))
}

async fn lookup_ok(c: &mut InferenceCacheClient<Channel>) -> Result<(), String> {
    c.lookup_route(exact_lookup("t", "m", "vllm", b"p", 64))
        .await
        .map(|r| assert!(!r.into_inner().reason_code.is_empty()))
        .map_err(|e| format!("{e:?}"))
}

/// A raw rustls handshake limited to `versions`: (negotiated ALPN, protocol version).
async fn raw_handshake(
    port: u16,
    ca_pem: &str,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> Result<(Option<Vec<u8>>, Option<rustls::ProtocolVersion>), String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::pem::PemObject::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(versions)
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (_, conn) = tls.get_ref();
    Ok((
        conn.alpn_protocol().map(|a| a.to_vec()),
        conn.protocol_version(),
    ))
}

/// The JSON log events of `path`, once a line containing `needle` has been copied into it.
fn log_events(path: &std::path::Path, needle: &str) -> Vec<Value> {
    log_text_with(path, needle)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

async fn tls_serving_and_rotation(shards: usize) {
    let dir = scratch_dir(&format!("tls-{shards}"));
    let pki1 = gen_pki("server-1");
    let t0 = SystemTime::now() - Duration::from_secs(60);
    let (cert, key) = write_pair(&dir, &pki1, t0);
    let log = dir.join("server.log");
    let srv = Server::start_opts(
        shards,
        StartOpts {
            flags: &["--tls-cert-file", &cert, "--tls-key-file", &key],
            stderr_file: Some(log.clone()),
            log_level: Some("info"),
            ..Default::default()
        },
    );
    let startup = log_events(&log, "\"startup\"")
        .into_iter()
        .find(|v| v["message"] == "startup")
        .expect("startup log");
    assert_eq!(startup["grpc_tls"], true);
    assert_eq!(
        metric_value(
            &metrics_text(&srv),
            "inferencecache_server_grpc_tls_enabled"
        ),
        Some(1.0)
    );

    // Several connections, so every core terminates at least one TLS connection.
    let mut clients = Vec::new();
    for _ in 0..2 * shards {
        let mut c = tls_client(srv.grpc_port, &pki1.ca_pem).await.unwrap();
        lookup_ok(&mut c).await.unwrap();
        let ack = report(&mut c, vec![legacy_update("r", "t", "m", "vllm", b"p", 64)]).await;
        assert!(ack.accepted);
        clients.push(c);
    }
    // Plaintext gRPC against the TLS port fails.
    let plain = async {
        let ch = Channel::from_shared(srv.grpc_url())
            .unwrap()
            .connect_timeout(Duration::from_secs(3))
            .timeout(Duration::from_secs(3))
            .connect()
            .await
            .map_err(|e| e.to_string())?;
        InferenceCacheClient::new(ch)
            .lookup_route(exact_lookup("t", "m", "vllm", b"p", 64))
            .await
            .map_err(|e| e.to_string())
    }
    .await;
    assert!(
        plain.is_err(),
        "plaintext must not be served on the TLS port"
    );

    // TLS 1.2 and 1.3 both negotiate ALPN h2.
    let (alpn, ver) = raw_handshake(srv.grpc_port, &pki1.ca_pem, &[&rustls::version::TLS12])
        .await
        .unwrap();
    assert_eq!(alpn.as_deref(), Some(&b"h2"[..]));
    assert_eq!(ver, Some(rustls::ProtocolVersion::TLSv1_2));
    let (alpn, ver) = raw_handshake(srv.grpc_port, &pki1.ca_pem, &[&rustls::version::TLS13])
        .await
        .unwrap();
    assert_eq!(alpn.as_deref(), Some(&b"h2"[..]));
    assert_eq!(ver, Some(rustls::ProtocolVersion::TLSv1_3));

    // Rotation: a new pair from another CA with a later mtime is served without a restart.
    let pki2 = gen_pki("server-2");
    write_pair(&dir, &pki2, SystemTime::now());
    for _ in 0..2 * shards {
        let mut c = tls_client(srv.grpc_port, &pki2.ca_pem)
            .await
            .expect("client trusting the new CA");
        lookup_ok(&mut c).await.unwrap();
    }
    let old = match tls_client(srv.grpc_port, &pki1.ca_pem).await {
        Ok(mut c) => lookup_ok(&mut c).await,
        Err(e) => Err(e),
    };
    assert!(old.is_err(), "the old certificate is no longer served");
    // Connections established before the rotation keep working.
    for c in &mut clients {
        lookup_ok(c).await.unwrap();
    }

    // A broken rotation (garbage certificate, newer mtime): logged once, cached pair served.
    let cert_path = dir.join("tls.crt");
    std::fs::write(&cert_path, "not a certificate").unwrap();
    std::fs::File::options()
        .write(true)
        .open(&cert_path)
        .unwrap()
        .set_modified(SystemTime::now() + Duration::from_secs(5))
        .unwrap();
    for _ in 0..3 {
        let mut c = tls_client(srv.grpc_port, &pki2.ca_pem)
            .await
            .expect("cached pair still served");
        lookup_ok(&mut c).await.unwrap();
    }
    let reloads = log_events(&log, "grpc_tls_reload")
        .into_iter()
        .filter(|v| v["message"] == "grpc_tls_reload")
        .count();
    assert_eq!(reloads, 1, "each failed rotation is logged once");
}

shards_1_and_2!(tls_serving_and_rotation);

#[test]
fn tls_startup_failures() {
    let dir = scratch_dir("tls-startup");
    let pki = gen_pki("s");
    let (cert, _) = write_pair(&dir, &pki, SystemTime::now());
    // Exactly one of the pair → usage error, exit 2.
    assert_eq!(
        run_exit(&["--insecure-disable-auth", "--tls-cert-file", &cert], &[]).0,
        2
    );
    assert_eq!(
        run_exit(&["--insecure-disable-auth", "--tls-key-file", &cert], &[]).0,
        2
    );
    // A pair that does not load → `grpc_tls_load`, exit 1.
    let other = gen_pki("other");
    let bad_key = dir.join("other.key");
    std::fs::write(&bad_key, &other.key_pem).unwrap();
    for (c, k) in [
        (cert.as_str(), bad_key.to_str().unwrap()),
        ("/nonexistent/tls.crt", bad_key.to_str().unwrap()),
        (cert.as_str(), "/nonexistent/tls.key"),
    ] {
        let (code, err) = run_exit(
            &[
                "--insecure-disable-auth",
                "--tls-cert-file",
                c,
                "--tls-key-file",
                k,
            ],
            &[],
        );
        assert_eq!(code, 1, "{c} {k}: {err}");
        assert!(err.contains("grpc_tls_load"), "{err}");
    }
}
