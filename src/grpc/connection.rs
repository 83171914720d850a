//! One gRPC connection on the core it was dealt to: the optional TLS handshake, then hyper's
//! HTTP/2 server until the connection closes or the drain after SIGTERM ends it.

use std::future::Future;
use std::pin::Pin;

use glommio::net::TcpStream;

use crate::limits::{
    DRAIN_TIMEOUT, HTTP2_KEEPALIVE_INTERVAL, HTTP2_KEEPALIVE_TIMEOUT, HTTP2_PREFACE_BYTES,
    HTTP2_PREFACE_TIMEOUT, MAX_CONCURRENT_STREAMS,
};
use crate::runtime::io::{CountingIo, GlommioIo, LocalExec, LocalTimer};
use crate::runtime::shutdown_requested;

use super::dispatch::Router;
use super::tls;

/// The runtime's connection handler (see `runtime::ConnectionHandler`).
pub fn serve_connection(stream: TcpStream) -> Pin<Box<dyn Future<Output = ()>>> {
    Box::pin(async move {
        let _ = stream.set_nodelay(true);
        match tls::acceptor() {
            None => serve_http2(stream).await,
            Some(acceptor) => {
                if let Some(tls) = tls::handshake(acceptor, stream).await {
                    serve_http2(tls).await;
                }
            }
        }
    })
}

/// Serves gRPC over HTTP/2 on one established (plaintext or TLS) stream. A peer that has not
/// sent the HTTP/2 preface within [`HTTP2_PREFACE_TIMEOUT`] is dropped, so silent connections
/// cannot hold the core's connection slots; keep-alive pings reap peers that went away.
async fn serve_http2<S>(stream: S)
where
    S: futures_lite::AsyncRead + futures_lite::AsyncWrite + Unpin + 'static,
{
    let (io, read) = CountingIo::new(stream);
    let mut builder = hyper::server::conn::http2::Builder::new(LocalExec);
    builder
        .timer(LocalTimer)
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .keep_alive_interval(Some(HTTP2_KEEPALIVE_INTERVAL))
        .keep_alive_timeout(HTTP2_KEEPALIVE_TIMEOUT);
    let conn = builder.serve_connection(GlommioIo(io), Router);
    let mut conn = std::pin::pin!(conn);
    let silent = async {
        glommio::timer::sleep(HTTP2_PREFACE_TIMEOUT).await;
        if read.get() < HTTP2_PREFACE_BYTES {
            tracing::debug!("grpc_preface_timeout");
            return;
        }
        std::future::pending::<()>().await
    };
    let served = futures_lite::future::or(async { Some(conn.as_mut().await) }, async {
        futures_lite::future::or(shutdown_requested(), silent).await;
        None
    });
    let finished = served.await;
    if finished.is_none() && !crate::runtime::shutting_down() {
        return;
    }
    if finished.is_none() {
        conn.as_mut().graceful_shutdown();
        let _ = futures_lite::future::or(async { conn.await.map(|_| ()) }, async {
            glommio::timer::sleep(DRAIN_TIMEOUT).await;
            Ok(())
        })
        .await;
    }
}
