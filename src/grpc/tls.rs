//! TLS on the gRPC port (docs/BEHAVIOUR.md §1.1): rustls with the ring provider, TLS 1.2 and 1.3,
//! ALPN `h2`; client certificates are requested, never required, when `--client-ca-file` is set
//! (producer identity, docs/OPERATIONS.md "Hardened setup"): a presented certificate must chain
//! to that CA, and a client without one (a gateway) handshakes as before. The CA bundle is
//! re-read when its mtime advances, like the server certificate. The certificate is served through a resolver that re-reads
//! the PEM pair whenever the certificate file's mtime advances, so cert-manager style rotation
//! needs no restart; a failed reload is logged (`grpc_tls_reload`) and the cached pair keeps
//! being served.
//!
//! The handshake runs on the glommio core that owns the connection (futures-rustls over the
//! glommio socket); the resulting stream feeds the same hyper HTTP/2 adapter as plaintext.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::SystemTime;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, ServerConfig, SignatureScheme};

use crate::limits::TLS_HANDSHAKE_TIMEOUT;

/// Why a certificate/key pair could not be loaded (logged as `grpc_tls_load` at start-up and
/// `grpc_tls_reload` on rotation).
#[derive(Debug)]
pub enum TlsError {
    /// The certificate file could not be read.
    ReadCertificate(PathBuf, String),
    /// The certificate file is not valid PEM.
    ParseCertificate(PathBuf, String),
    /// The certificate file holds no certificate.
    NoCertificate(PathBuf),
    /// The private key file could not be read or parsed.
    ReadKey(PathBuf, String),
    /// The key does not fit the certificate, or is of an unsupported kind.
    KeyPair(PathBuf, PathBuf, String),
    /// rustls refused the protocol versions.
    Versions(String),
    /// The client CA bundle (`--client-ca-file`) could not be read or holds no usable CA.
    ClientCa(PathBuf, String),
}

impl std::fmt::Display for TlsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ReadCertificate(p, e) => write!(f, "read certificate {}: {e}", p.display()),
            Self::ParseCertificate(p, e) => write!(f, "parse certificate {}: {e}", p.display()),
            Self::NoCertificate(p) => write!(f, "no certificate found in {}", p.display()),
            Self::ReadKey(p, e) => write!(f, "read private key {}: {e}", p.display()),
            Self::KeyPair(c, k, e) => {
                write!(f, "load key pair ({}, {}): {e}", c.display(), k.display())
            }
            Self::Versions(e) => write!(f, "tls versions: {e}"),
            Self::ClientCa(p, e) => write!(f, "client CA {}: {e}", p.display()),
        }
    }
}

impl std::error::Error for TlsError {}

/// The acceptor every core uses; unset means plaintext gRPC.
static ACCEPTOR: OnceLock<futures_rustls::TlsAcceptor> = OnceLock::new();

/// The process-wide crypto provider (ring).
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Loads a PEM certificate chain and private key and checks that they belong together.
pub fn load_pair(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| TlsError::ReadCertificate(cert.into(), e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::ParseCertificate(cert.into(), e.to_string()))?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(cert.into()));
    }
    let key_der = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| TlsError::ReadKey(key.into(), e.to_string()))?;
    CertifiedKey::from_der(certs, key_der, &provider())
        .map_err(|e| TlsError::KeyPair(cert.into(), key.into(), e.to_string()))
}

fn mtime(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// The cached pair and the certificate mtime it was loaded at.
struct Loaded {
    mtime: Option<SystemTime>,
    key: Arc<CertifiedKey>,
    /// Certificate mtime of the last failed reload, so each bad rotation is logged once.
    failed_mtime: Option<SystemTime>,
}

/// Serves the cached pair, reloading it when the certificate file's mtime moves forward.
#[derive(Debug)]
pub struct ReloadingResolver {
    cert: PathBuf,
    key: PathBuf,
    state: RwLock<Loaded>,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("mtime", &self.mtime)
            .finish()
    }
}

impl ReloadingResolver {
    /// Loads the pair once; an error here is the start-up `grpc_tls_load` failure.
    pub fn new(cert: PathBuf, key: PathBuf) -> Result<Self, TlsError> {
        let mt = mtime(&cert);
        let loaded = load_pair(&cert, &key)?;
        Ok(Self {
            cert,
            key,
            state: RwLock::new(Loaded {
                mtime: mt,
                key: Arc::new(loaded),
                failed_mtime: None,
            }),
        })
    }

    /// The pair to serve now (reloading first if the certificate file is newer).
    pub fn current(&self) -> Arc<CertifiedKey> {
        let now_mtime = mtime(&self.cert);
        {
            let st = self.state.read().unwrap_or_else(|e| e.into_inner());
            if !advanced(st.mtime, now_mtime) {
                return st.key.clone();
            }
        }
        let mut st = self.state.write().unwrap_or_else(|e| e.into_inner());
        if !advanced(st.mtime, now_mtime) {
            return st.key.clone();
        }
        match load_pair(&self.cert, &self.key) {
            Ok(k) => {
                st.key = Arc::new(k);
                st.mtime = now_mtime;
                st.failed_mtime = None;
                tracing::info!(cert_file = %self.cert.display(), "grpc_tls_reloaded");
            }
            Err(e) => {
                // Keep the old mtime so a later handshake retries (the key file may still be
                // being written), but log each failed rotation once.
                if st.failed_mtime != now_mtime {
                    st.failed_mtime = now_mtime;
                    tracing::error!(error = %e, "grpc_tls_reload");
                }
            }
        }
        st.key.clone()
    }
}

fn advanced(cached: Option<SystemTime>, now: Option<SystemTime>) -> bool {
    match (cached, now) {
        (Some(c), Some(n)) => n > c,
        (None, Some(_)) => true,
        _ => false,
    }
}

impl ResolvesServerCert for ReloadingResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// A client-certificate verifier over the CA bundle at `path`, offering client auth without
/// requiring it (a client without a certificate is anonymous; one with a certificate the CA did
/// not sign fails the handshake).
fn client_verifier(path: &Path) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    let bad = |e: String| TlsError::ClientCa(path.into(), e);
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| bad(e.to_string()))?;
    let mut roots = rustls::RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(bad("no usable CA certificate".into()));
    }
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
        .allow_unauthenticated()
        .build()
        .map_err(|e| bad(e.to_string()))
}

/// (bundle mtime loaded, its verifier, mtime of the last failed reload).
type ClientCaState = (
    Option<SystemTime>,
    Arc<dyn ClientCertVerifier>,
    Option<SystemTime>,
);

/// The client verifier of `--client-ca-file`, rebuilt when the bundle's mtime moves forward (a
/// failed reload is logged once as `grpc_client_ca_reload` and the previous bundle kept).
#[derive(Debug)]
pub struct ReloadingClientVerifier {
    path: PathBuf,
    state: RwLock<ClientCaState>,
}

impl ReloadingClientVerifier {
    /// Loads the bundle once; an error here is the start-up `grpc_tls_load` failure.
    pub fn new(path: PathBuf) -> Result<Self, TlsError> {
        let mt = mtime(&path);
        let inner = client_verifier(&path)?;
        Ok(Self {
            path,
            state: RwLock::new((mt, inner, None)),
        })
    }

    /// The verifier to use now (reloading first if the bundle is newer).
    fn current(&self) -> Arc<dyn ClientCertVerifier> {
        let now_mtime = mtime(&self.path);
        {
            let st = self.state.read().unwrap_or_else(|e| e.into_inner());
            if !advanced(st.0, now_mtime) {
                return st.1.clone();
            }
        }
        let mut st = self.state.write().unwrap_or_else(|e| e.into_inner());
        if advanced(st.0, now_mtime) {
            match client_verifier(&self.path) {
                Ok(v) => {
                    *st = (now_mtime, v, None);
                    tracing::info!(client_ca_file = %self.path.display(), "grpc_client_ca_reloaded");
                }
                Err(e) if st.2 != now_mtime => {
                    st.2 = now_mtime;
                    tracing::error!(error = %e, "grpc_client_ca_reload");
                }
                Err(_) => {}
            }
        }
        st.1.clone()
    }
}

impl ClientCertVerifier for ReloadingClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // No hints (they would borrow from a bundle that may be swapped): a client sends the
        // certificate it is configured with.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.current()
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.current().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.current().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.current().supported_verify_schemes()
    }
}

/// Builds the gRPC server TLS config (TLS ≥ 1.2, ALPN h2, hot-reloading certificate; with
/// `client_ca`, optional client certificates verified against it).
pub fn server_config(cert: &str, key: &str, client_ca: &str) -> Result<ServerConfig, TlsError> {
    let resolver = ReloadingResolver::new(PathBuf::from(cert), PathBuf::from(key))?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| TlsError::Versions(e.to_string()))?;
    let builder = if client_ca.is_empty() {
        builder.with_no_client_auth()
    } else {
        builder.with_client_cert_verifier(Arc::new(ReloadingClientVerifier::new(PathBuf::from(
            client_ca,
        ))?))
    };
    let mut cfg = builder.with_cert_resolver(Arc::new(resolver));
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(cfg)
}

/// Loads the pair (and the client CA bundle, when set) and installs the acceptor the cores use.
/// Call before the runtime starts.
pub fn install(cert: &str, key: &str, client_ca: &str) -> Result<(), TlsError> {
    let cfg = server_config(cert, key, client_ca)?;
    let _ = ACCEPTOR.set(futures_rustls::TlsAcceptor::from(Arc::new(cfg)));
    Ok(())
}

/// The installed acceptor, or `None` for plaintext gRPC.
pub fn acceptor() -> Option<&'static futures_rustls::TlsAcceptor> {
    ACCEPTOR.get()
}

/// Runs the server handshake on the current core, bounded by [`TLS_HANDSHAKE_TIMEOUT`] and by
/// shutdown. `None` when the handshake failed, timed out or shutdown began (the connection is
/// then simply closed; a client that is not speaking TLS gets no gRPC error to read anyway).
pub async fn handshake<S>(
    acceptor: &futures_rustls::TlsAcceptor,
    stream: S,
) -> Option<futures_rustls::server::TlsStream<S>>
where
    S: futures_lite::AsyncRead + futures_lite::AsyncWrite + Unpin,
{
    let accept = async { acceptor.accept(stream).await.ok() };
    let timeout = async {
        futures_lite::future::or(glommio::timer::sleep(TLS_HANDSHAKE_TIMEOUT), async {
            crate::runtime::shutdown_requested().await
        })
        .await;
        None
    };
    let out = futures_lite::future::or(accept, timeout).await;
    if out.is_none() {
        tracing::debug!("grpc_tls_handshake_failed");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn missing_files_fail_to_load() {
        let e = load_pair(
            Path::new("/nonexistent/c.pem"),
            Path::new("/nonexistent/k.pem"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("read certificate"), "{e}");
    }

    #[test]
    fn mtime_advance_rule() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(10);
        let t1 = t0 + Duration::from_secs(1);
        assert!(advanced(Some(t0), Some(t1)));
        assert!(!advanced(Some(t1), Some(t0)));
        assert!(!advanced(Some(t0), Some(t0)));
        assert!(!advanced(Some(t0), None));
    }
}
