//! TLS to the server's gRPC port (`--server https://…`): the server's certificate verified
//! against `--server-ca-file`, and with `--client-cert-file`/`--client-key-file` a client
//! certificate for mutual TLS. The client pair is re-read when either file changes (cert-manager
//! rotates the Secret by swapping the files), for the next connection's handshake: an open
//! connection keeps the certificate it was made with. A failed re-read keeps the last good pair
//! and is counted (`kvevent_credential_reload_errors_total{file="client_cert"}`).
//!
//! The connection is made here (TCP, then rustls) and handed to tonic as an already secure
//! stream: tonic's own TLS takes a fixed certificate, which could not rotate.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::SystemTime;

use hyper_util::rt::TokioIo;
use rustls::client::ResolvesClientCert;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, SignatureScheme};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use crate::metrics::Metrics;

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads every certificate of a PEM file (at least one).
fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let shown = path.display();
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("{shown}: cannot read: {e}"))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{shown}: not PEM certificates: {e}"))?;
    if certs.is_empty() {
        return Err(format!("{shown}: no certificate in the file"));
    }
    Ok(certs)
}

/// Loads a client certificate chain and its key, checking that they belong together. Errors
/// name the files, never the key material.
pub fn load_pair(cert: &Path, key: &Path) -> Result<CertifiedKey, String> {
    let certs = read_certs(cert)?;
    let key_der = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| format!("{}: not a PEM private key: {e}", key.display()))?;
    CertifiedKey::from_der(certs, key_der, &provider()).map_err(|e| {
        format!(
            "{} / {}: certificate and key do not match: {e}",
            cert.display(),
            key.display()
        )
    })
}

/// Modification time and length of both files: a change of either means a new pair.
type Stamp = [Option<(Option<SystemTime>, u64)>; 2];

fn stamp(cert: &Path, key: &Path) -> Stamp {
    let one = |p: &Path| {
        std::fs::metadata(p)
            .ok()
            .map(|m| (m.modified().ok(), m.len()))
    };
    [one(cert), one(key)]
}

struct PairState {
    stamp: Stamp,
    key: Arc<CertifiedKey>,
    /// Stamp of the last failed reload: each bad version is logged and counted once.
    failed: Option<Stamp>,
}

/// The client certificate presented in each handshake, re-read when its files change.
pub struct ReloadingClientCert {
    cert: PathBuf,
    key: PathBuf,
    state: Mutex<PairState>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for ReloadingClientCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReloadingClientCert")
            .field("cert", &self.cert)
            .finish_non_exhaustive()
    }
}

impl ReloadingClientCert {
    /// Loads the pair once (a failure is a start-up error).
    pub fn new(cert: PathBuf, key: PathBuf, metrics: Arc<Metrics>) -> Result<Self, String> {
        let st = stamp(&cert, &key);
        let loaded = load_pair(&cert, &key)?;
        Ok(Self {
            cert,
            key,
            state: Mutex::new(PairState {
                stamp: st,
                key: Arc::new(loaded),
                failed: None,
            }),
            metrics,
        })
    }

    /// The pair for a new handshake (re-read first when a file changed).
    pub fn current(&self) -> Arc<CertifiedKey> {
        let now = stamp(&self.cert, &self.key);
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if now == st.stamp || st.failed == Some(now) || now.iter().any(Option::is_none) {
            return st.key.clone();
        }
        match load_pair(&self.cert, &self.key) {
            Ok(k) => {
                st.key = Arc::new(k);
                st.stamp = now;
                st.failed = None;
                tracing::info!(cert_file = %self.cert.display(), "client certificate re-read");
            }
            Err(e) => {
                // The key file may still be being written: a later handshake retries.
                st.failed = Some(now);
                self.metrics
                    .credential_reload_errors
                    .get_or_create(&[("file", "client_cert")])
                    .inc();
                tracing::error!(error = %e, "client certificate re-read failed; keeping the last one");
            }
        }
        st.key.clone()
    }
}

impl ResolvesClientCert for ReloadingClientCert {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// The rustls client configuration: TLS ≥ 1.2, ALPN `h2`, the server verified against `ca`,
/// and the client certificate when given.
pub fn client_config(
    ca: &Path,
    client: Option<Arc<ReloadingClientCert>>,
) -> Result<ClientConfig, String> {
    let mut roots = RootCertStore::empty();
    for c in read_certs(ca)? {
        roots
            .add(c)
            .map_err(|e| format!("{}: not a usable CA certificate: {e}", ca.display()))?;
    }
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    let mut cfg = match client {
        Some(resolver) => {
            let mut cfg = builder.with_client_cert_resolver(resolver);
            // A resumed session keeps the identity of the handshake it resumes, so a rotated
            // certificate would never be presented: every connection makes a full handshake
            // (connections are long-lived, so this costs one handshake per reconnect).
            cfg.resumption = rustls::client::Resumption::disabled();
            cfg
        }
        None => builder.with_no_client_auth(),
    };
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(cfg)
}

/// Connects to one `host:port` over TCP and TLS; tonic's connector for an `https://` server.
#[derive(Clone)]
pub struct Connector {
    tls: TlsConnector,
    host: String,
    port: u16,
    name: ServerName<'static>,
}

impl Connector {
    /// A connector to `host:port` verifying the certificate for `host` (a DNS name or an IP).
    pub fn new(cfg: ClientConfig, host: &str, port: u16) -> Result<Self, String> {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let name = ServerName::try_from(bare.to_string())
            .map_err(|e| format!("{host:?} is not a TLS server name: {e}"))?;
        Ok(Self {
            tls: TlsConnector::from(Arc::new(cfg)),
            host: bare.to_string(),
            port,
            name,
        })
    }

    async fn connect(self) -> std::io::Result<TokioIo<TlsStream<TcpStream>>> {
        let tcp = TcpStream::connect((self.host.as_str(), self.port)).await?;
        tcp.set_nodelay(true)?;
        let tls = self.tls.connect(self.name, tcp).await?;
        Ok(TokioIo::new(tls))
    }
}

type ConnectFuture =
    Pin<Box<dyn Future<Output = std::io::Result<TokioIo<TlsStream<TcpStream>>>> + Send>>;

impl tower_service::Service<http::Uri> for Connector {
    type Response = TokioIo<TlsStream<TcpStream>>;
    type Error = std::io::Error;
    type Future = ConnectFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: http::Uri) -> Self::Future {
        Box::pin(self.clone().connect())
    }
}
