//! One general-path stream from request to trailers: dispatch the request to its service, then
//! queue the service's response (headers, messages, trailers) on the stream's [`Responder`]. A
//! stream the client resets is abandoned at once, whatever the handler was waiting on.

use std::future::poll_fn;
use std::pin::pin;

use bytes::{Bytes, BytesMut};
use http::{Request, Response};
use http_body::Body as _;
use http_body_util::BodyExt;
use tonic::body::Body;

use crate::http2::headers::{encode_fields, encode_response_head};
use crate::http2::{Reason, Responder};

use super::body::RequestBody;
use super::dispatch::dispatch;

/// Serves one stream to completion (or until the peer resets it).
pub async fn serve_stream(req: Request<RequestBody>, respond: Responder) {
    // Reset between the task's start and its first run (by the peer, or by the server over a
    // later frame): the call is not made.
    if respond.is_reset() {
        return;
    }
    let call = dispatch(req);
    let answered = futures_lite::future::or(async { Some(call.await) }, async {
        poll_fn(|cx| respond.poll_reset(cx)).await;
        None
    })
    .await;
    if let Some(Ok(resp)) = answered {
        write_response(resp, &respond).await;
    }
}

/// Queues headers, then each body frame; a trailers-only answer goes out as one HEADERS frame.
async fn write_response(resp: Response<Body>, respond: &Responder) {
    let (parts, body) = resp.into_parts();
    let mut head = BytesMut::new();
    encode_response_head(parts.status, &parts.headers, &mut head);
    if body.is_end_stream() {
        let _ = respond.send_headers(head.freeze(), true);
        return;
    }
    if respond.send_headers(head.freeze(), false).is_err() {
        return;
    }
    let mut body = pin!(body);
    loop {
        let next = futures_lite::future::or(async { Some(body.frame().await) }, async {
            poll_fn(|cx| respond.poll_reset(cx)).await;
            None
        })
        .await;
        let frame = match next {
            None => return,
            Some(None) => {
                let _ = respond.send_data(Bytes::new(), true).await;
                return;
            }
            Some(Some(Err(_))) => {
                respond.send_reset(Reason::INTERNAL_ERROR);
                return;
            }
            Some(Some(Ok(frame))) => frame,
        };
        match frame.into_data() {
            Ok(data) => {
                if respond.send_data(data, false).await.is_err() {
                    return;
                }
            }
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    let mut block = BytesMut::new();
                    encode_fields(&trailers, &mut block);
                    let _ = respond.send_trailers(block.freeze());
                }
                return;
            }
        }
    }
}
