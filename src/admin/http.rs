//! The HTTP/1.1 server both admin listeners run on the admin thread: accept, serve with a
//! header-read timeout, and a bounded graceful shutdown. Plus the response helpers the routes
//! share (Go's `http.Error` headers, JSON, bounded body reads).

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};

use crate::limits::{HTTP_BODY_READ_TIMEOUT, HTTP_READ_HEADER_TIMEOUT, MAX_HTTP_CONNECTIONS};

/// The response type of every route.
pub type Resp = Response<Full<Bytes>>;

/// A boxed route future (the controller handler is a closure over shared state).
pub type RespFuture = std::pin::Pin<Box<dyn Future<Output = Result<Resp, Infallible>> + Send>>;

/// A plain-text response, with the headers Go's `http.Error` sets.
pub(super) fn text(status: StatusCode, body: &'static str) -> Resp {
    plain_text(status, Bytes::from_static(body.as_bytes()))
}

pub(super) fn text_owned(status: StatusCode, body: String) -> Resp {
    plain_text(status, Bytes::from(body))
}

fn plain_text(status: StatusCode, body: Bytes) -> Resp {
    Response::builder()
        .status(status)
        .header("content-type", "text/plain; charset=utf-8")
        .header("x-content-type-options", "nosniff")
        .body(Full::new(body))
        .expect("static response")
}

pub(super) fn not_found() -> Resp {
    text(StatusCode::NOT_FOUND, "404 page not found\n")
}

pub(super) fn method_not_allowed(allow: &'static str) -> Resp {
    let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
    r.headers_mut()
        .insert(http::header::ALLOW, http::HeaderValue::from_static(allow));
    r
}

pub(super) fn json(status: StatusCode, body: String) -> Resp {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("json response")
}

/// Reads at most `limit + 1` bytes of `body` (enough to tell "over the limit" apart) and stops;
/// a body that does not arrive within [`HTTP_BODY_READ_TIMEOUT`] is an error, so a client that
/// trickles its body cannot hold a connection forever.
pub(super) async fn read_limited(body: Incoming, limit: usize) -> Result<Vec<u8>, String> {
    tokio::time::timeout(HTTP_BODY_READ_TIMEOUT, read_up_to(body, limit))
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "body not received within {HTTP_BODY_READ_TIMEOUT:?}"
            ))
        })
}

async fn read_up_to(mut body: Incoming, limit: usize) -> Result<Vec<u8>, String> {
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
        if OPEN.load(Ordering::SeqCst) >= MAX_HTTP_CONNECTIONS {
            // Closed at once: idle connections are reaped by the header-read timeout, so the
            // probes of a healthy load balancer get a slot again within seconds.
            tracing::warn!(limit = MAX_HTTP_CONNECTIONS, "http_connection_refused");
            drop(stream);
            continue;
        }
        let h = handler.clone();
        let mut stopping = stop().subscribe();
        OPEN.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            let io = TokioIo::new(stream);
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HTTP_READ_HEADER_TIMEOUT)
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
