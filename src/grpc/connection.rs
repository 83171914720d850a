//! One gRPC connection on the core it was dealt to: the optional TLS handshake, then the h2
//! server until the connection closes or the drain after SIGTERM ends it.
//!
//! The server speaks `h2` directly (no hyper in between) so that every HTTP/2 budget is ours to
//! set: see [`HTTP2_DATA_FRAME_BUDGET`] for why hyper's fixed one cut producer streams off.

use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::task::Poll;

use bytes::Bytes;
use glommio::net::TcpStream;

use crate::limits::{
    DRAIN_TIMEOUT, HTTP2_CONNECTION_WINDOW_BYTES, HTTP2_DATA_FRAME_BUDGET,
    HTTP2_KEEPALIVE_INTERVAL, HTTP2_KEEPALIVE_TIMEOUT, HTTP2_MAX_HEADER_LIST_BYTES,
    HTTP2_MAX_SEND_BUFFER_BYTES, HTTP2_PREFACE_BYTES, HTTP2_PREFACE_TIMEOUT,
    HTTP2_STREAM_WINDOW_BYTES, MAX_CONCURRENT_STREAMS,
};
use crate::runtime::io::CountingIo;
use crate::runtime::shutdown_requested;

use super::body::{ConnectionHeld, RequestBody};
use super::tls;
use super::unary::{self, Accepted, InlineCalls};

/// Accept-and-answer rounds of one connection turn before it yields to the core's other tasks.
const INLINE_ROUNDS_PER_TURN: usize = 8;

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

/// The h2 server settings of every gRPC connection.
fn h2_builder() -> h2::server::Builder {
    let mut builder = h2::server::Builder::new();
    builder
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .initial_window_size(HTTP2_STREAM_WINDOW_BYTES)
        .initial_connection_window_size(HTTP2_CONNECTION_WINDOW_BYTES)
        .max_header_list_size(HTTP2_MAX_HEADER_LIST_BYTES)
        .max_send_buffer_size(HTTP2_MAX_SEND_BUFFER_BYTES)
        .data_frame_budget(HTTP2_DATA_FRAME_BUDGET);
    builder
}

/// What ended one wait of the connection loop.
enum Turn<T> {
    /// A new stream (or the end of the connection).
    Stream(Option<Result<T, h2::Error>>),
    /// SIGTERM: start the graceful drain.
    Shutdown,
    /// The peer stopped answering keep-alive pings, or the drain ran out of time.
    Close,
}

/// Serves gRPC over HTTP/2 on one established (plaintext or TLS) stream. A peer that has not
/// sent the HTTP/2 preface within [`HTTP2_PREFACE_TIMEOUT`] is dropped, so silent connections
/// cannot hold the core's connection slots; keep-alive pings reap peers that went away.
pub async fn serve_http2<S>(stream: S)
where
    S: futures_lite::AsyncRead + futures_lite::AsyncWrite + Unpin + 'static,
{
    let (io, read) = CountingIo::new(stream);
    let handshake = h2_builder().handshake::<_, Bytes>(io);
    let preface = futures_lite::future::or(async { Some(handshake.await) }, async {
        glommio::timer::sleep(HTTP2_PREFACE_TIMEOUT).await;
        None
    });
    let mut conn = match preface.await {
        Some(Ok(conn)) => conn,
        Some(Err(_)) => return,
        None => {
            tracing::debug!(read = read.get(), "grpc_preface_timeout");
            return;
        }
    };
    let keepalive = pin!(keep_alive(conn.ping_pong()));
    let silent = pin!(async {
        glommio::timer::sleep(HTTP2_PREFACE_TIMEOUT).await;
        read.get() < HTTP2_PREFACE_BYTES
    });
    serve_streams(&mut conn, keepalive, silent).await;
}

/// Accepts streams until the connection ends, the peer goes silent, or the drain after
/// SIGTERM completes (bounded by [`DRAIN_TIMEOUT`]).
async fn serve_streams<T>(
    conn: &mut h2::server::Connection<T, Bytes>,
    mut keepalive: Pin<&mut impl Future<Output = ()>>,
    mut silent: Pin<&mut impl Future<Output = bool>>,
) where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let held = ConnectionHeld::default();
    let mut inline = InlineCalls::new();
    let mut shutdown = pin!(shutdown_requested());
    let mut drain: Option<Pin<Box<glommio::timer::Timer>>> = None;
    let mut spoke = false;
    loop {
        let turn = poll_fn(|cx| {
            if drain.is_none() && shutdown.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Turn::Shutdown);
            }
            if drain
                .as_mut()
                .is_some_and(|d| d.as_mut().poll(cx).is_ready())
                || keepalive.as_mut().poll(cx).is_ready()
            {
                return Poll::Ready(Turn::Close);
            }
            if !spoke && let Poll::Ready(quiet) = silent.as_mut().poll(cx) {
                if quiet {
                    return Poll::Ready(Turn::Close);
                }
                spoke = true;
            }
            poll_streams(conn, &mut inline, &held, cx)
        })
        .await;
        match turn {
            Turn::Stream(Some(Ok((req, respond)))) => {
                let req = req.map(|recv| RequestBody::new(recv, held.clone()));
                spawn_general(req, respond);
            }
            Turn::Stream(_) | Turn::Close => return,
            Turn::Shutdown => {
                conn.graceful_shutdown();
                drain = Some(Box::pin(glommio::timer::Timer::new(DRAIN_TIMEOUT)));
            }
        }
    }
}

/// One connection turn: accepts every stream h2 has buffered, answers the inline calls whose
/// message is in, and polls h2 again so the turn's answers leave in one write. Returns a stream
/// for the general path, or the end of the connection; at most [`INLINE_ROUNDS_PER_TURN`]
/// rounds, then yields so the core's other connections get their turn.
fn poll_streams<T>(
    conn: &mut h2::server::Connection<T, Bytes>,
    inline: &mut InlineCalls,
    held: &ConnectionHeld,
    cx: &mut std::task::Context<'_>,
) -> Poll<
    Turn<(
        http::Request<h2::RecvStream>,
        h2::server::SendResponse<Bytes>,
    )>,
>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    for _ in 0..INLINE_ROUNDS_PER_TURN {
        loop {
            match conn.poll_accept(cx) {
                Poll::Ready(Some(Ok((req, respond)))) => match unary::accept(req, respond) {
                    Accepted::Inline(call) => inline.push(call),
                    Accepted::General(req, respond) => {
                        return Poll::Ready(Turn::Stream(Some(Ok((req, respond)))));
                    }
                },
                Poll::Ready(end) => return Poll::Ready(Turn::Stream(end)),
                Poll::Pending => break,
            }
        }
        if !inline.answer_ready(cx, held, spawn_general) {
            return Poll::Pending;
        }
    }
    cx.waker().wake_by_ref();
    Poll::Pending
}

/// Serves a stream on the general path, in a task of its own.
fn spawn_general(req: http::Request<RequestBody>, respond: h2::server::SendResponse<Bytes>) {
    glommio::spawn_local(super::respond::serve_stream(req, respond)).detach();
}

/// Resolves when the peer fails to answer a keep-alive ping in time. Never resolves when the
/// connection gave no ping handle (it always does, once).
async fn keep_alive(ping_pong: Option<h2::PingPong>) {
    let Some(mut ping_pong) = ping_pong else {
        return std::future::pending().await;
    };
    loop {
        glommio::timer::sleep(HTTP2_KEEPALIVE_INTERVAL).await;
        let pong = futures_lite::future::or(
            async { ping_pong.ping(h2::Ping::opaque()).await.is_ok() },
            async {
                glommio::timer::sleep(HTTP2_KEEPALIVE_TIMEOUT).await;
                false
            },
        );
        if !pong.await {
            tracing::debug!("grpc_keepalive_timeout");
            return;
        }
    }
}
