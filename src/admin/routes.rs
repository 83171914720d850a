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

use crate::limits::{
    MAX_PD_TOPOLOGY_BODY_BYTES, MAX_POLICY_BODY_BYTES, MAX_PROBE_BODY_BYTES,
    MAX_TEMPLATE_BODY_BYTES,
};
use crate::tenant_registry::PutError;

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
        "/readyz"
            if READY.load(Ordering::SeqCst)
                && !crate::runtime::health::any_stalled()
                && crate::metrics::nats::caught_up() =>
        {
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
    /// `--engine-block-size`, for the templates' `stable_prefix_hash`.
    pub engine_block_size: i32,
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
        let path = req.uri().path().to_string();
        match path.as_str() {
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
            path => {
                if let Some(rest) = path.strip_prefix("/templates/") {
                    // Registrations change what the server answers, like a policy: they are
                    // authenticated exactly like `/policy` (its audience and counters).
                    if let Some(a) = auth
                        && let Err(r) = a.policy.check(req.headers()).await
                    {
                        return r;
                    }
                    let block_size = self.engine_block_size;
                    let put = |t: &str, r: &str, body: &[u8]| {
                        crate::templates::put(t, r, body, block_size)
                    };
                    return handle_registry(req, rest.to_string(), &TEMPLATE_ROUTES, put).await;
                }
                if let Some(rest) = path.strip_prefix("/pd-topologies/") {
                    if let Some(a) = auth
                        && let Err(r) = a.policy.check(req.headers()).await
                    {
                        return r;
                    }
                    let put = crate::pd::put;
                    return handle_registry(req, rest.to_string(), &PD_TOPOLOGY_ROUTES, put).await;
                }
                not_found()
            }
        }
    }
}

/// Splits `{tenant}` or `{tenant}/{ref}` (the ref may contain `/`); empty parts are refused.
fn tenant_and_ref(rest: &str) -> Option<(&str, Option<&str>)> {
    match rest.split_once('/') {
        None if !rest.is_empty() => Some((rest, None)),
        Some((t, r)) if !t.is_empty() && !r.is_empty() => Some((t, Some(r))),
        _ => None,
    }
}

/// One tenant registry's routes: `/{kind}/{tenant}` (`GET`: list) and `/{kind}/{tenant}/{ref}`
/// (`GET`, `PUT`, `DELETE`).
struct RegistryRoutes {
    /// What a body decodes to, in error messages (`decode template: …`).
    what: &'static str,
    /// Largest `PUT` body, and the `limit` label counted when one is larger.
    max_body: usize,
    body_limit: &'static str,
    list_json: fn(&str) -> String,
    get_json: fn(&str, &str) -> Option<String>,
    delete: fn(&str, &str) -> bool,
}

const TEMPLATE_ROUTES: RegistryRoutes = RegistryRoutes {
    what: "template",
    max_body: MAX_TEMPLATE_BODY_BYTES,
    body_limit: "template_bytes",
    list_json: crate::templates::list_json,
    get_json: crate::templates::get_json,
    delete: crate::templates::delete,
};

const PD_TOPOLOGY_ROUTES: RegistryRoutes = RegistryRoutes {
    what: "pd topology",
    max_body: MAX_PD_TOPOLOGY_BODY_BYTES,
    body_limit: "pd_topology_bytes",
    list_json: crate::pd::list_json,
    get_json: crate::pd::get_json,
    delete: crate::pd::delete,
};

/// Serves one registry request; `put` stores a `PUT` body as `(tenant, ref)`.
async fn handle_registry(
    req: Request<Incoming>,
    rest: String,
    routes: &RegistryRoutes,
    put: impl FnOnce(&str, &str, &[u8]) -> Result<(), PutError>,
) -> Resp {
    let Some((tenant, reference)) = tenant_and_ref(&rest) else {
        return not_found();
    };
    let Some(reference) = reference else {
        if req.method() != Method::GET {
            return method_not_allowed("GET");
        }
        return json(StatusCode::OK, (routes.list_json)(tenant));
    };
    match *req.method() {
        Method::GET => match (routes.get_json)(tenant, reference) {
            Some(body) => json(StatusCode::OK, body),
            None => not_found(),
        },
        Method::DELETE => {
            if (routes.delete)(tenant, reference) {
                no_content()
            } else {
                not_found()
            }
        }
        Method::PUT => {
            let (what, max) = (routes.what, routes.max_body);
            let body = match read_body(req, max, what).await {
                Ok(b) if b.len() > max => {
                    crate::metrics::record_limit_hit(routes.body_limit);
                    return text_owned(
                        StatusCode::BAD_REQUEST,
                        format!("decode {what}: body larger than {max} bytes\n"),
                    );
                }
                Ok(b) => b,
                Err(r) => return r,
            };
            match put(tenant, reference, &body) {
                Ok(()) => no_content(),
                Err(PutError::Invalid(e)) => text_owned(StatusCode::BAD_REQUEST, format!("{e}\n")),
                Err(PutError::Full(e)) => text_owned(StatusCode::CONFLICT, format!("{e}\n")),
            }
        }
        _ => method_not_allowed("GET, PUT, DELETE"),
    }
}

/// Reads a request body of at most `limit` (+1) bytes ([`read_limited`]); a body that cannot be
/// read is answered 400 `decode {what}: …`.
async fn read_body(req: Request<Incoming>, limit: usize, what: &str) -> Result<Vec<u8>, Resp> {
    read_limited(req.into_body(), limit)
        .await
        .map_err(|e| text_owned(StatusCode::BAD_REQUEST, format!("decode {what}: {e}\n")))
}

fn no_content() -> Resp {
    Response::builder()
        .status(StatusCode::NO_CONTENT)
        .body(Full::new(Bytes::new()))
        .expect("204")
}

/// `GET /snapshot` (§14): gather every core's part, merge, render.
async fn handle_snapshot(req: Request<Incoming>) -> Resp {
    if req.method() != Method::GET {
        return method_not_allowed("GET");
    }
    let parts = gather::snapshot_parts().await;
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
    let body = match read_body(req, MAX_POLICY_BODY_BYTES, "policy snapshot").await {
        Ok(b) => b,
        Err(r) => return r,
    };
    match inferencecache_index::policy::parse_policy_body(&body) {
        Ok(store) => {
            // One push at a time, so two concurrent pushes cannot interleave core by core and
            // leave the cores with different snapshots.
            let _one = POLICY_INSTALL.lock().await;
            gather::install_policy(Arc::new(store)).await;
            // Kept for a warm restart (`--state-dir`; a no-op without it).
            crate::snapshot::save_policy(&body);
            no_content()
        }
        Err(e) => text_owned(StatusCode::BAD_REQUEST, format!("{e}\n")),
    }
}

/// `POST /probe` (§15).
async fn handle_probe(req: Request<Incoming>) -> Resp {
    if req.method() != Method::POST {
        return method_not_allowed("POST");
    }
    let body = match read_body(req, MAX_PROBE_BODY_BYTES, "probe request").await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let probe = match probe::parse_request(&body) {
        Ok(p) => p,
        Err(msg) => return text_owned(StatusCode::BAD_REQUEST, msg),
    };
    json(StatusCode::OK, probe::run(probe).await.to_json())
}
