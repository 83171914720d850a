//! Status mapping grpc-go clients expect. tonic's decoder reports a request over
//! [`MAX_MESSAGE_BYTES`](crate::limits::MAX_MESSAGE_BYTES) as OUT_OF_RANGE; grpc-go (the
//! reference's defaults, docs/BEHAVIOUR.md §1.3) answers RESOURCE_EXHAUSTED, which clients retry
//! and alert on.
//!
//! tonic has no typed decode error, so the oversize case is recognised by its status message;
//! [`is_oversize`] is the one place that knows the text, and a test pins it to tonic's actual
//! decoder output so a tonic upgrade that changes it fails here, not in production.

use tonic::{Code, Status};

/// The message tonic puts in its "message too large" decode status.
const TONIC_OVERSIZE_TEXT: &str = "message length too large";
/// grpc-go's status message for the same case.
const GRPC_GO_OVERSIZE_MESSAGE: &str = "grpc: received message larger than max";

/// Whether `code` + `message` is tonic's "message too large" decode error.
fn is_oversize(code: Code, message: &str) -> bool {
    code == Code::OutOfRange && message.contains(TONIC_OVERSIZE_TEXT)
}

/// A receive error as returned to a streaming producer: oversize becomes RESOURCE_EXHAUSTED,
/// anything else is passed on.
pub fn receive_status(s: Status) -> Status {
    if is_oversize(s.code(), s.message()) {
        Status::resource_exhausted(GRPC_GO_OVERSIZE_MESSAGE)
    } else {
        s
    }
}

/// Rewrites the oversize status in headers (trailers-only responses) and in trailers (how tonic
/// answers a unary request it could not decode).
pub fn oversize_as_resource_exhausted(headers: &mut http::HeaderMap) {
    let out_of_range = headers
        .get("grpc-status")
        .is_some_and(|v| v.as_bytes() == b"11");
    let oversize = out_of_range
        && headers
            .get("grpc-message")
            .and_then(|m| m.to_str().ok())
            .is_some_and(|m| is_oversize(Code::OutOfRange, &m.replace("%20", " ")));
    if oversize {
        headers.insert("grpc-status", http::HeaderValue::from_static("8"));
        headers.insert(
            "grpc-message",
            http::HeaderValue::from_static(GRPC_GO_OVERSIZE_MESSAGE),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::{BufMut, BytesMut};
    use tonic::codec::{Codec, Streaming};

    /// Decodes one oversize frame with tonic's own decoder and returns its status.
    async fn tonic_oversize_status() -> Status {
        let mut frame = BytesMut::new();
        frame.put_u8(0);
        frame.put_u32(64);
        frame.put_slice(&[0u8; 64]);
        let body = http_body_util::Full::new(frame.freeze());
        let mut codec = tonic_prost::ProstCodec::<(), ()>::default();
        let decoder = codec.decoder();
        let mut stream = Streaming::<()>::new_request(decoder, body, None, Some(16));
        stream.message().await.expect_err("over the limit")
    }

    #[test]
    fn tonic_oversize_message_is_recognised() {
        let status = futures_lite::future::block_on(tonic_oversize_status());
        assert!(is_oversize(status.code(), status.message()), "{status:?}");
        let mapped = receive_status(status);
        assert_eq!(mapped.code(), Code::ResourceExhausted);
        assert_eq!(mapped.message(), GRPC_GO_OVERSIZE_MESSAGE);
    }

    #[test]
    fn other_statuses_pass_through() {
        let s = receive_status(Status::out_of_range("something else"));
        assert_eq!(s.code(), Code::OutOfRange);
        let mut h = http::HeaderMap::new();
        h.insert("grpc-status", http::HeaderValue::from_static("11"));
        h.insert("grpc-message", http::HeaderValue::from_static("x"));
        oversize_as_resource_exhausted(&mut h);
        assert_eq!(h["grpc-status"], "11");
    }

    #[test]
    fn oversize_trailers_are_rewritten() {
        let mut h = http::HeaderMap::new();
        h.insert("grpc-status", http::HeaderValue::from_static("11"));
        h.insert(
            "grpc-message",
            http::HeaderValue::from_static("Error,%20decoded%20message%20length%20too%20large"),
        );
        oversize_as_resource_exhausted(&mut h);
        assert_eq!(h["grpc-status"], "8");
        assert_eq!(h["grpc-message"], GRPC_GO_OVERSIZE_MESSAGE);
    }
}
