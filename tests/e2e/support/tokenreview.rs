//! A stand-in for the Kubernetes API server's TokenReview endpoint, served over HTTPS on its
//! own runtime thread (the controller-auth and producer-auth scenarios).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

use super::pki::gen_pki;

/// The bearer token the server under test presents to the stand-in.
pub const SA_TOKEN: &str = "the-servers-own-sa-token";

/// What the stand-in API server knows about a bearer token.
#[derive(Clone)]
pub struct Identity {
    pub username: String,
    pub audiences: Vec<String>,
}

/// A stand-in for the Kubernetes API server's TokenReview endpoint.
#[derive(Default)]
pub struct StandIn {
    pub tokens: Mutex<HashMap<String, Identity>>,
    pub reviews: AtomicUsize,
    pub fail: AtomicBool,
    pub last_audiences: Mutex<Option<Value>>,
    /// Answer `authenticated: true` without `status.audiences` (an audience-unaware server).
    pub omit_audiences: AtomicBool,
    /// Milliseconds each review takes.
    pub delay_ms: std::sync::atomic::AtomicU64,
    /// Reviews being answered now, and the most at once.
    pub in_flight: AtomicUsize,
    pub max_in_flight: AtomicUsize,
}

impl StandIn {
    pub fn add(&self, token: &str, username: &str, audiences: &[&str]) {
        self.tokens.lock().unwrap().insert(
            token.into(),
            Identity {
                username: username.into(),
                audiences: audiences.iter().map(|a| a.to_string()).collect(),
            },
        );
    }

    pub fn review(&self, auth: Option<&str>, body: &[u8]) -> (u16, String) {
        self.reviews.fetch_add(1, Ordering::SeqCst);
        if self.fail.load(Ordering::SeqCst) {
            return (500, r#"{"kind":"Status","status":"Failure"}"#.into());
        }
        if auth != Some(&format!("Bearer {SA_TOKEN}")) {
            return (401, r#"{"kind":"Status","status":"Failure"}"#.into());
        }
        let req: Value = serde_json::from_slice(body).unwrap();
        assert_eq!(req["apiVersion"], "authentication.k8s.io/v1");
        assert_eq!(req["kind"], "TokenReview");
        let token = req["spec"]["token"].as_str().unwrap().to_string();
        let wanted: Vec<String> = req["spec"]["audiences"]
            .as_array()
            .map(|a| a.iter().map(|v| v.as_str().unwrap().to_string()).collect())
            .unwrap_or_default();
        *self.last_audiences.lock().unwrap() = Some(req["spec"]["audiences"].clone());
        let status = match self.tokens.lock().unwrap().get(&token) {
            None => json!({"authenticated": false, "error": "invalid bearer token"}),
            Some(id) if !wanted.is_empty() && !wanted.iter().any(|w| id.audiences.contains(w)) => {
                json!({"authenticated": false,
                       "error": format!("token audiences {:?} is invalid for the target audiences {:?}", id.audiences, wanted)})
            }
            Some(id) if self.omit_audiences.load(Ordering::SeqCst) => json!({"authenticated": true,
                               "user": {"username": id.username, "groups": ["system:serviceaccounts"]}}),
            Some(id) => json!({"authenticated": true,
                               "user": {"username": id.username, "groups": ["system:serviceaccounts"]},
                               "audiences": wanted}),
        };
        let resp = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                          "metadata": {"creationTimestamp": null}, "spec": req["spec"], "status": status});
        (201, resp.to_string())
    }
}

/// Serves the stand-in over HTTPS on its own runtime thread; returns (port, CA PEM path).
pub fn start_stand_in(state: Arc<StandIn>, dir: &std::path::Path) -> (u16, String) {
    let pki = gen_pki("kube-apiserver");
    let ca_path = dir.join("kube-ca.pem");
    std::fs::write(&ca_path, &pki.ca_pem).unwrap();
    let certs: Vec<rustls::pki_types::CertificateDer<'static>> =
        rustls::pki_types::pem::PemObject::pem_slice_iter(pki.cert_pem.as_bytes())
            .collect::<Result<_, _>>()
            .unwrap();
    let key = <rustls::pki_types::PrivateKeyDer<'static> as rustls::pki_types::pem::PemObject>::from_pem_slice(
        pki.key_pem.as_bytes(),
    )
    .unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                let acceptor = acceptor.clone();
                let state = state.clone();
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let svc = hyper::service::service_fn(
                        move |req: http::Request<hyper::body::Incoming>| {
                            let state = state.clone();
                            async move {
                                let ok_path = req.uri().path()
                                    == "/apis/authentication.k8s.io/v1/tokenreviews"
                                    && req.method() == http::Method::POST;
                                let auth = req
                                    .headers()
                                    .get("authorization")
                                    .and_then(|v| v.to_str().ok())
                                    .map(str::to_string);
                                let body = req.into_body().collect().await.unwrap().to_bytes();
                                let now = state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                                state.max_in_flight.fetch_max(now, Ordering::SeqCst);
                                let delay = state.delay_ms.load(Ordering::SeqCst);
                                if delay > 0 {
                                    tokio::time::sleep(Duration::from_millis(delay)).await;
                                }
                                state.in_flight.fetch_sub(1, Ordering::SeqCst);
                                let (status, text) = if ok_path {
                                    state.review(auth.as_deref(), &body)
                                } else {
                                    (404, "{}".into())
                                };
                                Ok::<_, Infallible>(
                                    http::Response::builder()
                                        .status(status)
                                        .header("content-type", "application/json")
                                        .body(Full::new(Bytes::from(text)))
                                        .unwrap(),
                                )
                            }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                        .await;
                });
            }
        });
    });
    (port, ca_path.to_string_lossy().into_owned())
}
