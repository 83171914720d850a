//! A minimal Kubernetes TokenReview client: `POST /apis/authentication.k8s.io/v1/tokenreviews`
//! with the pod's service-account token, over HTTPS verified against the cluster CA (rustls,
//! ring). One short-lived HTTP/1.1 connection per review; reviews are rare because successful
//! ones are cached for 30 s.
//!
//! Configuration follows client-go's in-cluster rules (API server from
//! `KUBERNETES_SERVICE_HOST`/`KUBERNETES_SERVICE_PORT`, token and CA from the service-account
//! mount); each part can be overridden (`--kube-api-server`, `--kube-ca-file`,
//! `--kube-token-file` or their environment variables) so tests and out-of-cluster deployments
//! can point it at another server. A plain `http://` API server URL is accepted for tests.

use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde::{Deserialize, Serialize};

use crate::limits::{MAX_TOKEN_REVIEW_RESPONSE_BYTES, TOKEN_REVIEW_TIMEOUT};

/// Service-account token mounted into every pod.
pub const IN_CLUSTER_TOKEN_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";
/// Cluster CA bundle mounted into every pod.
pub const IN_CLUSTER_CA_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";
/// TokenReview collection path.
pub const TOKENREVIEW_PATH: &str = "/apis/authentication.k8s.io/v1/tokenreviews";

/// Where the API server is and how to authenticate to it.
#[derive(Clone, Debug, Default)]
pub struct KubeConfig {
    /// API server base URL (`https://host:port`); empty = in-cluster from the environment.
    pub api_server: String,
    /// PEM CA bundle; empty = the in-cluster mount.
    pub ca_file: String,
    /// Bearer token file; empty = the in-cluster mount.
    pub token_file: String,
}

/// The TokenReview answer the middleware needs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReviewStatus {
    /// `status.authenticated`.
    pub authenticated: bool,
    /// `status.user.username`.
    pub username: String,
    /// `status.error` (may be empty).
    pub error: String,
    /// `status.audiences`: the requested audiences the token is valid for.
    pub audiences: Vec<String>,
}

/// A TokenReview client bound to one API server.
#[derive(Clone)]
pub struct TokenReviewer {
    host: String,
    port: u16,
    authority: String,
    tls: Option<(tokio_rustls::TlsConnector, ServerName<'static>)>,
    token_file: PathBuf,
}

impl std::fmt::Debug for TokenReviewer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenReviewer")
            .field("authority", &self.authority)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

#[derive(Serialize)]
struct ReviewRequest<'a> {
    #[serde(rename = "apiVersion")]
    api_version: &'static str,
    kind: &'static str,
    spec: ReviewSpec<'a>,
}

#[derive(Serialize)]
struct ReviewSpec<'a> {
    token: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    audiences: Option<[&'a str; 1]>,
}

#[derive(Deserialize, Default)]
struct ReviewResponse {
    #[serde(default)]
    status: Option<RespStatus>,
}

#[derive(Deserialize, Default)]
struct RespStatus {
    #[serde(default)]
    authenticated: bool,
    #[serde(default)]
    user: Option<RespUser>,
    #[serde(default)]
    error: String,
    #[serde(default)]
    audiences: Vec<String>,
}

#[derive(Deserialize, Default)]
struct RespUser {
    #[serde(default)]
    username: String,
}

/// Why the TokenReview client could not be built (start-up: logged, exit 1).
#[derive(Debug)]
pub enum ClientError {
    /// No `--kube-api-server` and no in-cluster environment.
    NotInCluster,
    /// The API server URL is not `http(s)://host:port`.
    InvalidUrl(String, String),
    /// The service-account token file cannot be read.
    Token(PathBuf, std::io::Error),
    /// The CA bundle cannot be read or holds no usable certificate.
    Ca(String, String),
    /// rustls refused the client configuration.
    Tls(String),
}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotInCluster => f.write_str("unable to load in-cluster configuration, KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT must be defined"),
            Self::InvalidUrl(url, why) => write!(f, "invalid API server URL {url:?}: {why}"),
            Self::Token(p, e) => write!(f, "read service-account token {}: {e}", p.display()),
            Self::Ca(ca, why) => write!(f, "CA {ca}: {why}"),
            Self::Tls(e) => write!(f, "tls: {e}"),
        }
    }
}

impl std::error::Error for ClientError {}

/// The API server base URL: the flag, else the in-cluster environment.
fn api_base(cfg: &KubeConfig) -> Result<String, ClientError> {
    if !cfg.api_server.is_empty() {
        return Ok(cfg.api_server.trim_end_matches('/').to_string());
    }
    let host = std::env::var("KUBERNETES_SERVICE_HOST").unwrap_or_default();
    let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_default();
    if host.is_empty() || port.is_empty() {
        return Err(ClientError::NotInCluster);
    }
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host
    };
    Ok(format!("https://{host}:{port}"))
}

/// A TLS connector trusting only the API server's CA bundle.
fn tls_connector(
    ca: &str,
    host: &str,
) -> Result<(tokio_rustls::TlsConnector, ServerName<'static>), ClientError> {
    let ca_error = |why: String| ClientError::Ca(ca.to_string(), why);
    let mut roots = rustls::RootCertStore::empty();
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(ca)
        .map_err(|e| ca_error(format!("read: {e}")))?
        .collect::<Result<_, _>>()
        .map_err(|e| ca_error(format!("parse: {e}")))?;
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(ca_error("no usable CA certificate".into()));
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| ClientError::Tls(e.to_string()))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = ServerName::try_from(host.to_string())
        .map_err(|e| ClientError::InvalidUrl(host.to_string(), e.to_string()))?;
    Ok((tokio_rustls::TlsConnector::from(Arc::new(config)), name))
}

/// Why a review gave no answer (the middleware answers 503 and logs it).
#[derive(Debug)]
pub enum ReviewError {
    /// No answer within [`TOKEN_REVIEW_TIMEOUT`].
    Timeout,
    /// The service-account token file cannot be read.
    ServiceAccountToken(std::io::Error),
    /// The request could not be built.
    Request(String),
    /// The API server could not be reached, or the connection failed.
    Transport(String),
    /// The API server answered with a non-2xx status.
    Status(http::StatusCode),
    /// The answer is not a TokenReview.
    Decode(String),
}

impl std::fmt::Display for ReviewError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Timeout => write!(f, "token review timed out after {TOKEN_REVIEW_TIMEOUT:?}"),
            Self::ServiceAccountToken(e) => write!(f, "read service-account token: {e}"),
            Self::Request(e) => write!(f, "token review request: {e}"),
            Self::Transport(e) => write!(f, "token review transport: {e}"),
            Self::Status(s) => write!(f, "token review failed: HTTP {s}"),
            Self::Decode(e) => write!(f, "decode TokenReview: {e}"),
        }
    }
}

impl std::error::Error for ReviewError {}

impl TokenReviewer {
    /// Builds the client (the start-up "in-cluster config" step: failure → log + exit 1).
    pub fn new(cfg: &KubeConfig) -> Result<TokenReviewer, ClientError> {
        let base = api_base(cfg)?;
        let invalid = |why: String| ClientError::InvalidUrl(base.clone(), why);
        let uri: http::Uri = base.parse().map_err(|e| invalid(format!("{e}")))?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(invalid("must be http(s)://host:port".into())),
        };
        let authority = uri
            .authority()
            .ok_or_else(|| invalid("no host".into()))?
            .clone();
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let port = authority.port_u16().unwrap_or(if https { 443 } else { 80 });
        let token_file = PathBuf::from(if cfg.token_file.is_empty() {
            IN_CLUSTER_TOKEN_FILE
        } else {
            &cfg.token_file
        });
        std::fs::read_to_string(&token_file)
            .map_err(|e| ClientError::Token(token_file.clone(), e))?;
        let ca = if cfg.ca_file.is_empty() {
            IN_CLUSTER_CA_FILE
        } else {
            &cfg.ca_file
        };
        let tls = if https {
            Some(tls_connector(ca, &host)?)
        } else {
            None
        };
        Ok(TokenReviewer {
            host,
            port,
            authority: authority.to_string(),
            tls,
            token_file,
        })
    }

    /// Reviews `token` for `audience` (omitted when `None` or empty). `Err` = transport error,
    /// non-2xx status or an unreadable answer: the caller answers 503.
    pub async fn review(
        &self,
        token: &str,
        audience: Option<&str>,
    ) -> Result<ReviewStatus, ReviewError> {
        tokio::time::timeout(TOKEN_REVIEW_TIMEOUT, self.review_inner(token, audience))
            .await
            .unwrap_or(Err(ReviewError::Timeout))
    }

    async fn review_inner(
        &self,
        token: &str,
        audience: Option<&str>,
    ) -> Result<ReviewStatus, ReviewError> {
        // Re-read on every review: projected service-account tokens rotate on disk.
        let sa_token =
            std::fs::read_to_string(&self.token_file).map_err(ReviewError::ServiceAccountToken)?;
        let body = serde_json::to_vec(&ReviewRequest {
            api_version: "authentication.k8s.io/v1",
            kind: "TokenReview",
            spec: ReviewSpec {
                token,
                audiences: audience.filter(|a| !a.is_empty()).map(|a| [a]),
            },
        })
        .map_err(|e| ReviewError::Request(e.to_string()))?;
        let req = http::Request::post(TOKENREVIEW_PATH)
            .header(http::header::HOST, &self.authority)
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::ACCEPT, "application/json")
            .header(
                http::header::AUTHORIZATION,
                format!("Bearer {}", sa_token.trim()),
            )
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| ReviewError::Request(e.to_string()))?;
        let tcp = tokio::net::TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| ReviewError::Transport(format!("connect {}: {e}", self.authority)))?;
        let _ = tcp.set_nodelay(true);
        let resp = match &self.tls {
            Some((connector, name)) => {
                let tls = connector
                    .connect(name.clone(), tcp)
                    .await
                    .map_err(|e| ReviewError::Transport(format!("tls {}: {e}", self.authority)))?;
                send(TokioIo::new(tls), req).await?
            }
            None => send(TokioIo::new(tcp), req).await?,
        };
        let (parts, body) = resp;
        if !parts.is_success() {
            return Err(ReviewError::Status(parts));
        }
        let parsed: ReviewResponse =
            serde_json::from_slice(&body).map_err(|e| ReviewError::Decode(e.to_string()))?;
        let st = parsed.status.unwrap_or_default();
        Ok(ReviewStatus {
            authenticated: st.authenticated,
            username: st.user.map(|u| u.username).unwrap_or_default(),
            error: st.error,
            audiences: st.audiences,
        })
    }
}

/// Sends one request on a fresh HTTP/1.1 connection and reads the (bounded) response.
async fn send<I>(
    io: I,
    req: http::Request<Full<Bytes>>,
) -> Result<(http::StatusCode, Bytes), ReviewError>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| ReviewError::Transport(format!("http handshake: {e}")))?;
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    let out = async {
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| ReviewError::Transport(e.to_string()))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), MAX_TOKEN_REVIEW_RESPONSE_BYTES)
            .collect()
            .await
            .map_err(|e| ReviewError::Transport(format!("response: {e}")))?
            .to_bytes();
        Ok((status, body))
    }
    .await;
    driver.abort();
    out
}
