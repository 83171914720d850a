//! The two HTTP/1.1 listeners, served on the admin thread (BEHAVIOUR.md §13): the public
//! `/healthz`, `/readyz`, `/metrics` and the controller-facing `/snapshot`, `/policy`, `/probe`
//! behind the auth middleware ([`crate::auth`]). Anything else answers Go's mux 404.

pub mod gojson;
pub mod snapshot;

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use inferencecache_index::policy::MAX_POLICY_BODY_BYTES;

use crate::auth::ControllerAuth;

/// True while the index is started and serving (`/readyz`).
pub static READY: AtomicBool = AtomicBool::new(false);

/// hyper's header-read timeout, as the reference's `ReadHeaderTimeout`.
pub const READ_HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// The response type of every route.
pub type Resp = Response<Full<Bytes>>;

/// A boxed route future (the controller handler is a closure over shared state).
pub type RespFuture = std::pin::Pin<Box<dyn Future<Output = Result<Resp, Infallible>> + Send>>;

/// A plain-text response, with the headers Go's `http.Error` sets.
fn text(status: StatusCode, body: &'static str) -> Resp {
    text_owned(status, body.to_string())
}

fn text_owned(status: StatusCode, body: String) -> Resp {
    Response::builder()
        .status(status)
        .header("content-type", "text/plain; charset=utf-8")
        .header("x-content-type-options", "nosniff")
        .body(Full::new(Bytes::from(body)))
        .expect("static response")
}

fn not_found() -> Resp {
    text(StatusCode::NOT_FOUND, "404 page not found\n")
}

fn method_not_allowed(allow: &'static str) -> Resp {
    let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
    r.headers_mut()
        .insert(http::header::ALLOW, http::HeaderValue::from_static(allow));
    r
}

fn json(status: StatusCode, body: String) -> Resp {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("json response")
}

/// Reads at most `limit + 1` bytes of `body` (enough to tell "over the limit" apart) and stops.
async fn read_limited(mut body: Incoming, limit: usize) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    while out.len() <= limit {
        match body.frame().await {
            None => break,
            Some(Err(e)) => return Err(e.to_string()),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    let room = limit + 1 - out.len();
                    out.extend_from_slice(&data[..data.len().min(room)]);
                }
            }
        }
    }
    Ok(out)
}

/// The public listener's routes.
pub async fn public(req: Request<Incoming>) -> Result<Resp, Infallible> {
    Ok(match req.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" if READY.load(Ordering::SeqCst) => text(StatusCode::OK, "ok\n"),
        "/readyz" => text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n"),
        "/metrics" => Response::builder()
            .status(StatusCode::OK)
            .header("content-type", crate::metrics::CONTENT_TYPE)
            .body(Full::new(Bytes::from(crate::metrics::render().await)))
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
            Box::pin(async move { Ok(this.route(req).await) })
        }
    }

    async fn route(&self, req: Request<Incoming>) -> Resp {
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
    let parts = crate::control::gather(|st| st.index.snapshot_part()).await;
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
            crate::control::install_policy(Arc::new(store)).await;
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
    let body = match read_limited(req.into_body(), crate::probe::MAX_PROBE_BODY_BYTES).await {
        Ok(b) => b,
        Err(e) => {
            return text_owned(
                StatusCode::BAD_REQUEST,
                format!("decode probe request: {e}\n"),
            );
        }
    };
    let probe = match crate::probe::parse_request(&body) {
        Ok(p) => p,
        Err(msg) => return text_owned(StatusCode::BAD_REQUEST, msg),
    };
    json(StatusCode::OK, crate::probe::run(probe).await.to_json())
}

/// How long [`shutdown`] waits for in-flight HTTP requests (the reference's 5 s budget).
pub const SHUTDOWN_BUDGET: Duration = Duration::from_secs(5);

/// Shutdown signal of every listener and connection (`true` once shutdown began).
static STOP: std::sync::OnceLock<tokio::sync::watch::Sender<bool>> = std::sync::OnceLock::new();
/// Open HTTP connections, so [`shutdown`] knows when the last one finished.
static OPEN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static CLOSED: tokio::sync::Notify = tokio::sync::Notify::const_new();

fn stop() -> &'static tokio::sync::watch::Sender<bool> {
    STOP.get_or_init(|| tokio::sync::watch::channel(false).0)
}

/// Resolves once shutdown began (or the signal is gone).
async fn stopped(rx: &mut tokio::sync::watch::Receiver<bool>) {
    loop {
        let stop_now = *rx.borrow_and_update();
        if stop_now || rx.changed().await.is_err() {
            return;
        }
    }
}

/// Stops accepting on both listeners, lets in-flight requests finish (idle keep-alive
/// connections are closed) and waits for them for at most `budget`. Runs on the admin runtime.
pub async fn shutdown(budget: Duration) {
    let _ = stop().send(true);
    let drained = async {
        loop {
            let notified = CLOSED.notified();
            if OPEN.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    };
    let _ = tokio::time::timeout(budget, drained).await;
}

/// Serves `listener` with `handler` until [`shutdown`] (HTTP/1.1, 5 s header-read timeout).
pub async fn serve<F, Fut>(listener: tokio::net::TcpListener, handler: F)
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<Resp, Infallible>> + Send + 'static,
{
    let mut stopping = stop().subscribe();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stopped(&mut stopping) => return,
        };
        let (stream, _) = match accepted {
            Ok(s) => s,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let h = handler.clone();
        let mut stopping = stop().subscribe();
        OPEN.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            let io = TokioIo::new(stream);
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(READ_HEADER_TIMEOUT)
                .serve_connection(io, hyper::service::service_fn(h));
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = stopped(&mut stopping) => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            OPEN.fetch_sub(1, Ordering::SeqCst);
            CLOSED.notify_waiters();
        });
    }
}
