//! One gRPC connection on the core it was dealt to: the optional TLS handshake, then the
//! server's own HTTP/2 layer (`crate::http2`) until the connection closes or the drain after
//! SIGTERM ends it. This module is where HTTP/2 meets gRPC: a plain LookupRoute is answered
//! inline (`unary`), every other request is dispatched to the tonic services in a task of its
//! own (`respond`).

use std::future::Future;
use std::pin::Pin;

use bytes::{Bytes, BytesMut};
use glommio::net::TcpStream;

use crate::http2::{self, HeaderList, Inline, RecvHalf, Responder};
use crate::lookup::Waiting;
use crate::metrics::InlineOutcome;
use crate::producer::PeerCertificate;
use crate::runtime::watch::WatchedStream;

use super::body::{ConnectionHeld, RequestBody};
use super::tls;
use super::unary;

/// The runtime's connection handler (see `runtime::ConnectionHandler`).
pub fn serve_connection(stream: TcpStream) -> Pin<Box<dyn Future<Output = ()>>> {
    Box::pin(async move {
        let _ = stream.set_nodelay(true);
        let stream = WatchedStream::new(stream);
        match tls::acceptor() {
            None => serve_http2(stream).await,
            Some(acceptor) => {
                if let Some(tls) = tls::handshake(acceptor, stream).await {
                    // The producer identity, once per connection (none for a client without a
                    // certificate, e.g. a gateway: nothing more to do on its requests).
                    let peer = crate::producer::identity::of_connection(tls.get_ref().1);
                    serve_http2_as(tls, peer).await;
                }
            }
        }
    })
}

/// Serves gRPC over HTTP/2 on one established (plaintext or TLS) stream.
pub async fn serve_http2<S>(stream: S)
where
    S: futures_lite::AsyncRead + futures_lite::AsyncWrite + Unpin + 'static,
{
    serve_http2_as(stream, None).await;
}

/// Serves gRPC over HTTP/2 on a stream whose peer presented the certificate identity `peer`.
async fn serve_http2_as<S>(stream: S, peer: Option<PeerCertificate>)
where
    S: futures_lite::AsyncRead + futures_lite::AsyncWrite + Unpin + 'static,
{
    let grpc = Grpc {
        held: ConnectionHeld::default(),
        peer,
    };
    http2::serve(stream, grpc).await;
}

/// The gRPC side of one connection.
struct Grpc {
    /// Bytes of incomplete messages held by this connection's streams (see `body`).
    held: ConnectionHeld,
    /// The verified client certificate's identity, attached to every general-path request
    /// (the ingest handlers read it; the inline LookupRoute path never looks).
    peer: Option<PeerCertificate>,
}

impl http2::Service for Grpc {
    const INLINE_HEAD: &'static [u8] = unary::GRPC_OK_HEAD;
    const INLINE_TRAILERS: &'static [u8] = unary::GRPC_OK_TRAILERS;

    fn is_inline(&mut self, head: &HeaderList) -> bool {
        unary::is_plain_lookup(head)
    }

    type Later = Box<Waiting>;

    fn answer_inline(
        &mut self,
        head: &HeaderList,
        body: Bytes,
        out: &mut BytesMut,
    ) -> Inline<Box<Waiting>> {
        let taken = unary::answer(head, body, out);
        match taken {
            Inline::Answered => crate::metrics::record_inline_lookup(InlineOutcome::Answered),
            Inline::Later(_) => crate::metrics::record_inline_lookup(InlineOutcome::Awaited),
            Inline::General => {}
        }
        taken
    }

    fn answer_later(&mut self, waiting: Box<Waiting>, respond: Responder) {
        glommio::spawn_local(unary::answer_later(waiting, respond)).detach();
    }

    fn serve_general(
        &mut self,
        head: &HeaderList,
        req: http::Request<RecvHalf>,
        respond: Responder,
    ) {
        if unary::is_plain_lookup(head) {
            // An inline candidate the inline path could not take (split, trailed, compressed,
            // not decoded...).
            crate::metrics::record_inline_lookup(InlineOutcome::HandedOn);
        }
        let mut req = req.map(|recv| RequestBody::new(recv, self.held.clone()));
        if let Some(peer) = &self.peer {
            req.extensions_mut().insert(peer.clone());
        }
        glommio::spawn_local(super::respond::serve_stream(req, respond)).detach();
    }
}
