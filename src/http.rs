//! The two HTTP listeners, served on the admin thread: public `/healthz`, `/readyz`, `/metrics`
//! and the controller-facing `/snapshot`, `/policy`, `/probe` (BEHAVIOUR.md §13).

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};

/// True while the index is started and serving (`/readyz`).
pub static READY: AtomicBool = AtomicBool::new(false);

/// A plain-text response.
fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "text/plain; charset=utf-8")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .expect("static response")
}

/// The public listener's routes.
pub async fn public(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let _ = req.method() == Method::GET;
    Ok(match req.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" if READY.load(Ordering::SeqCst) => text(StatusCode::OK, "ok\n"),
        "/readyz" => text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n"),
        _ => text(StatusCode::NOT_FOUND, "404 page not found\n"),
    })
}

/// Serves `listener` with `handler` until shutdown (HTTP/1.1, 5 s header-read timeout).
pub async fn serve<F, Fut>(listener: tokio::net::TcpListener, handler: F)
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send + 'static,
{
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(_) => continue,
        };
        let h = handler.clone();
        tokio::spawn(async move {
            let io = TokioIo::new(stream);
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(5))
                .serve_connection(io, hyper::service::service_fn(h))
                .await;
        });
    }
}
