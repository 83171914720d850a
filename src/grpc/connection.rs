//! One gRPC connection on the core it was dealt to: the optional TLS handshake, then hyper's
//! HTTP/2 server until the connection closes or the drain after SIGTERM ends it.

use std::future::Future;
use std::pin::Pin;

use glommio::net::TcpStream;

use crate::limits::{DRAIN_TIMEOUT, MAX_CONCURRENT_STREAMS};
use crate::runtime::io::{GlommioIo, LocalExec};
use crate::runtime::shutdown_requested;

use super::dispatch::Router;
use super::tls;

/// The runtime's connection handler (see `runtime::ConnectionHandler`).
pub fn serve_connection(stream: TcpStream) -> Pin<Box<dyn Future<Output = ()>>> {
    Box::pin(async move {
        let _ = stream.set_nodelay(true);
        match tls::acceptor() {
            None => serve_http2(GlommioIo(stream)).await,
            Some(acceptor) => {
                if let Some(tls) = tls::handshake(acceptor, stream).await {
                    serve_http2(GlommioIo(tls)).await;
                }
            }
        }
    })
}

/// Serves gRPC over HTTP/2 on one established (plaintext or TLS) stream.
async fn serve_http2<S>(io: GlommioIo<S>)
where
    S: futures_lite::AsyncRead + futures_lite::AsyncWrite + Unpin + 'static,
{
    let mut builder = hyper::server::conn::http2::Builder::new(LocalExec);
    builder.max_concurrent_streams(MAX_CONCURRENT_STREAMS);
    let conn = builder.serve_connection(io, Router);
    let mut conn = std::pin::pin!(conn);
    let finished = futures_lite::future::or(async { Some(conn.as_mut().await) }, async {
        shutdown_requested().await;
        None
    })
    .await;
    if finished.is_none() {
        conn.as_mut().graceful_shutdown();
        let _ = futures_lite::future::or(async { conn.await.map(|_| ()) }, async {
            glommio::timer::sleep(DRAIN_TIMEOUT).await;
            Ok(())
        })
        .await;
    }
}
