//! The routes of the two admin listeners (docs/BEHAVIOUR.md §13): the public `/healthz`,
//! `/readyz`, `/metrics` and the controller-facing `/snapshot`, `/policy`, `/probe` behind the
//! authenticator ([`super::auth`]). Anything else answers Go's mux 404.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;

use crate::limits::{MAX_POLICY_BODY_BYTES, MAX_PROBE_BODY_BYTES};

use super::auth::ControllerAuth;
use super::http::{
    Resp, RespFuture, json, method_not_allowed, not_found, read_limited, text, text_owned,
};
use super::{gather, probe, scrape, snapshot};

/// True while the index is started and serving (`/readyz`).
static READY: AtomicBool = AtomicBool::new(false);

/// Marks the server ready (after start-up) or not (once shutdown begins).
pub fn set_ready(ready: bool) {
    READY.store(ready, Ordering::SeqCst);
}

/// The public listener's routes.
pub async fn public(req: Request<Incoming>) -> Result<Resp, Infallible> {
    Ok(match req.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" if READY.load(Ordering::SeqCst) && !crate::runtime::health::any_stalled() => {
            text(StatusCode::OK, "ok\n")
        }
        "/readyz" => text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n"),
        "/metrics" => Response::builder()
            .status(StatusCode::OK)
            .header("content-type", crate::metrics::CONTENT_TYPE)
            .body(Full::new(Bytes::from(scrape::render().await)))
            .expect("metrics response"),
        _ => not_found(),
    })
}

/// State of the controller-facing listener.
#[derive(Debug)]
pub struct Controller {
    /// `None` = `--insecure-disable-auth`.
    pub auth: Option<ControllerAuth>,
}

impl Controller {
    /// The listener's request handler.
    pub fn handler(self: Arc<Self>) -> impl Fn(Request<Incoming>) -> RespFuture + Clone + Send {
        move |req| {
            let this = self.clone();
            Box::pin(async move { Ok(this.handle(req).await) })
        }
    }

    async fn handle(&self, req: Request<Incoming>) -> Resp {
        let auth = self.auth.as_ref();
        match req.uri().path() {
            "/snapshot" => {
                if let Some(a) = auth
                    && let Err(r) = a.snapshot.check(req.headers()).await
                {
                    return r;
                }
                handle_snapshot(req).await
            }
            "/policy" => {
                if let Some(a) = auth
                    && let Err(r) = a.policy.check(req.headers()).await
                {
                    return r;
                }
                handle_policy(req).await
            }
            "/probe" => {
                if let Some(a) = auth
                    && let Err(r) = a.probe.check(req.headers()).await
                {
                    return r;
                }
                handle_probe(req).await
            }
            _ => not_found(),
        }
    }
}

/// `GET /snapshot` (§14): gather every core's part, merge, render.
async fn handle_snapshot(req: Request<Incoming>) -> Resp {
    if req.method() != Method::GET {
        return method_not_allowed("GET");
    }
    let parts = gather::gather(|st| st.index.snapshot_part()).await;
    let rows = inferencecache_index::index::merge_snapshot_parts(&parts);
    json(StatusCode::OK, snapshot::render(&rows))
}

/// Serialises policy installs (see [`handle_policy`]).
static POLICY_INSTALL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `POST|PUT /policy` (§12.3): decode, normalise, install on every core.
async fn handle_policy(req: Request<Incoming>) -> Resp {
    if req.method() != Method::POST && req.method() != Method::PUT {
        return method_not_allowed("POST, PUT");
    }
    let body = match read_limited(req.into_body(), MAX_POLICY_BODY_BYTES).await {
        Ok(b) => b,
        Err(e) => {
            return text_owned(
                StatusCode::BAD_REQUEST,
                format!("decode policy snapshot: {e}\n"),
            );
        }
    };
    match inferencecache_index::policy::parse_policy_body(&body) {
        Ok(store) => {
            // One push at a time, so two concurrent pushes cannot interleave core by core and
            // leave the cores with different snapshots.
            let _one = POLICY_INSTALL.lock().await;
            gather::install_policy(Arc::new(store)).await;
            Response::builder()
                .status(StatusCode::NO_CONTENT)
                .body(Full::new(Bytes::new()))
                .expect("204")
        }
        Err(e) => text_owned(StatusCode::BAD_REQUEST, format!("{e}\n")),
    }
}

/// `POST /probe` (§15).
async fn handle_probe(req: Request<Incoming>) -> Resp {
    if req.method() != Method::POST {
        return method_not_allowed("POST");
    }
    let body = match read_limited(req.into_body(), MAX_PROBE_BODY_BYTES).await {
        Ok(b) => b,
        Err(e) => {
            return text_owned(
                StatusCode::BAD_REQUEST,
                format!("decode probe request: {e}\n"),
            );
        }
    };
    let probe = match probe::parse_request(&body) {
        Ok(p) => p,
        Err(msg) => return text_owned(StatusCode::BAD_REQUEST, msg),
    };
    json(StatusCode::OK, probe::run(probe).await.to_json())
}
