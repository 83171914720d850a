//! One HTTP/2 stream from request to trailers: dispatch the request to its service, then write
//! the service's response (headers, messages, trailers) back with h2's flow control. A stream
//! the client resets is abandoned at once, whatever the handler was waiting on.

use std::future::poll_fn;
use std::pin::pin;

use bytes::Bytes;
use h2::server::SendResponse;
use h2::{Reason, SendStream};
use http::{Request, Response};
use http_body::Body as _;
use http_body_util::BodyExt;
use tonic::body::Body;

use super::body::RequestBody;
use super::dispatch::dispatch;

/// Serves one stream to completion (or until the peer resets it).
pub async fn serve_stream(req: Request<RequestBody>, mut respond: SendResponse<Bytes>) {
    let call = dispatch(req);
    let answered = futures_lite::future::or(async { Some(call.await) }, async {
        let _ = poll_fn(|cx| respond.poll_reset(cx)).await;
        None
    })
    .await;
    if let Some(Ok(resp)) = answered {
        write_response(resp, respond).await;
    }
}

/// Writes headers, then each body frame; a trailers-only answer goes out as one HEADERS frame.
async fn write_response(resp: Response<Body>, mut respond: SendResponse<Bytes>) {
    let (parts, body) = resp.into_parts();
    let head = Response::from_parts(parts, ());
    if body.is_end_stream() {
        let _ = respond.send_response(head, true);
        return;
    }
    let Ok(mut send) = respond.send_response(head, false) else {
        return;
    };
    let mut body = pin!(body);
    loop {
        let next = futures_lite::future::or(async { Some(body.frame().await) }, async {
            let _ = poll_fn(|cx| send.poll_reset(cx)).await;
            None
        })
        .await;
        let frame = match next {
            None => return,
            Some(None) => {
                let _ = send.send_data(Bytes::new(), true);
                return;
            }
            Some(Some(Err(_))) => {
                send.send_reset(Reason::INTERNAL_ERROR);
                return;
            }
            Some(Some(Ok(frame))) => frame,
        };
        match frame.into_data() {
            Ok(data) => {
                if send_data(&mut send, data).await.is_err() {
                    return;
                }
            }
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    let _ = send.send_trailers(trailers);
                }
                return;
            }
        }
    }
}

/// Writes one unary answer's message, then the success trailers, as the peer's flow-control
/// window allows (the inline path's large answers).
pub(super) async fn write_message_and_ok(mut send: SendStream<Bytes>, message: Bytes) {
    if send_data(&mut send, message).await.is_ok() {
        let _ = send.send_trailers(super::unary::ok_trailers());
    }
}

/// Sends `data` as the peer's flow-control window allows.
async fn send_data(send: &mut SendStream<Bytes>, mut data: Bytes) -> Result<(), h2::Error> {
    while !data.is_empty() {
        send.reserve_capacity(data.len());
        let granted = match poll_fn(|cx| send.poll_capacity(cx)).await {
            None => return Err(h2::Error::from(Reason::STREAM_CLOSED)),
            Some(granted) => granted?,
        };
        if granted > 0 {
            send.send_data(data.split_to(granted.min(data.len())), false)?;
        }
    }
    Ok(())
}
