//! The inline LookupRoute path: the hot unary call answered inside the connection's own task,
//! without tonic, a task per stream, or a boxed future.
//!
//! Why: on one core the per-request cost of the general path (a spawned task per stream, tonic's
//! codec and body adapters, one response flushed per wake-up) was several times the index work
//! (perf/RESULTS.md, issue 14's profile). Here a connection turn reads every frame h2 has
//! buffered, answers each complete LookupRoute in order, and h2 writes all the answers of the
//! turn in one flush.
//!
//! Only the plain case takes this path: `POST` of one uncompressed message that arrived whole
//! with the end of the stream, for a call the handler answers without waiting
//! ([`lookup_route_now`]). Anything else (compression, trailers, a split or oversize message, a
//! decode error, a call that needs the tokenizer or another core) is handed to the general path
//! with the bytes already read, so every answer and error stays exactly the general path's.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::{BufMut, Bytes, BytesMut};
use h2::RecvStream;
use h2::server::SendResponse;
use http::{HeaderMap, HeaderValue, Request, Response};
use inferencecache_proto::v1alpha1 as pb;
use prost::Message;

use crate::limits::{INLINE_RESPONSE_MAX_BYTES, MAX_MESSAGE_BYTES};
use crate::lookup::{LookupConfig, lookup_route_now};

use super::body::{ConnectionHeld, RequestBody};

/// The one path this module answers.
const LOOKUP_ROUTE_PATH: &str = "/inferencecache.v1alpha1.InferenceCache/LookupRoute";
/// gRPC's length-prefixed message header: a compression flag and a big-endian u32 length.
const HEADER_BYTES: usize = 5;
/// Response buffer reserved at a time; answers are cut out of it, so a connection reuses one
/// allocation while h2 copies the small answers into its write buffer.
const RESPONSE_BUFFER_CHUNK: usize = 16 * 1024;

thread_local! {
    /// This core's lookup configuration (installed with the services).
    static LOOKUP_CONFIG: RefCell<Option<Arc<LookupConfig>>> = const { RefCell::new(None) };
}

/// Installs this core's lookup configuration (with the tonic services).
pub(super) fn install(cfg: Arc<LookupConfig>) {
    LOOKUP_CONFIG.with_borrow_mut(|c| *c = Some(cfg));
}

/// A LookupRoute waiting for its message, then answered inline or handed on.
pub(super) struct InlineCall {
    parts: http::request::Parts,
    recv: RecvStream,
    respond: SendResponse<Bytes>,
}

/// What became of an accepted request.
pub(super) enum Accepted {
    /// A LookupRoute to answer inline once its message is in.
    Inline(InlineCall),
    /// Anything else: the general path.
    General(Request<RecvStream>, SendResponse<Bytes>),
}

/// Sorts an accepted stream: only a plain LookupRoute (uncompressed gRPC over POST) goes inline.
pub(super) fn accept(req: Request<RecvStream>, respond: SendResponse<Bytes>) -> Accepted {
    if !is_plain_lookup(&req) {
        return Accepted::General(req, respond);
    }
    let (parts, recv) = req.into_parts();
    Accepted::Inline(InlineCall {
        parts,
        recv,
        respond,
    })
}

fn is_plain_lookup<B>(req: &Request<B>) -> bool {
    let h = req.headers();
    req.method() == http::Method::POST
        && req.uri().path() == LOOKUP_ROUTE_PATH
        && h.get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes() == b"application/grpc")
        && h.get("grpc-encoding")
            .is_none_or(|v| v.as_bytes() == b"identity")
}

/// The calls of one connection waiting for their message. At most one per open stream, which
/// h2 bounds by `MAX_CONCURRENT_STREAMS`.
pub(super) struct InlineCalls {
    waiting: VecDeque<InlineCall>,
    out: BytesMut,
}

impl InlineCalls {
    pub(super) fn new() -> Self {
        Self {
            waiting: VecDeque::new(),
            out: BytesMut::new(),
        }
    }

    pub(super) fn push(&mut self, call: InlineCall) {
        self.waiting.push_back(call);
    }

    /// Answers every call whose message is in (in arrival order) and hands the ones that cannot
    /// be answered inline to `general`. Returns whether any stream was answered or handed on.
    pub(super) fn answer_ready(
        &mut self,
        cx: &mut Context<'_>,
        held: &ConnectionHeld,
        mut general: impl FnMut(Request<RequestBody>, SendResponse<Bytes>),
    ) -> bool {
        let mut progressed = false;
        for _ in 0..self.waiting.len() {
            let Some(mut call) = self.waiting.pop_front() else {
                break;
            };
            let Some(received) = receive(&mut call.recv, cx) else {
                self.waiting.push_back(call);
                continue;
            };
            progressed = true;
            let handed_on = match received {
                Received::End(message) => self.try_answer(call, message).err(),
                Received::Other(bytes) => Some((call, bytes)),
            };
            crate::metrics::record_inline_lookup(handed_on.is_none());
            if let Some((call, bytes)) = handed_on {
                let body = RequestBody::with_received(call.recv, held.clone(), bytes);
                general(Request::from_parts(call.parts, body), call.respond);
            }
        }
        progressed
    }

    /// Answers `call` inline when its message is whole and the handler needs no wait; else hands
    /// it back with the bytes read so far.
    #[allow(clippy::result_large_err)]
    fn try_answer(&mut self, call: InlineCall, received: Bytes) -> Result<(), (InlineCall, Bytes)> {
        if whole_message(&received).is_none() {
            return Err((call, received));
        }
        // Decoding from `Bytes` makes the block hashes slices of `received`, not copies.
        let Ok(req) = pb::LookupRouteRequest::decode(received.slice(HEADER_BYTES..)) else {
            return Err((call, received));
        };
        // Handler entry, as on the general path: the message is in (`lookup_latency_us` and the
        // caller's deadline count from here).
        let start = Instant::now();
        let deadline = super::deadline::from_headers(&call.parts.headers, start);
        let answered = LOOKUP_CONFIG.with_borrow(|cfg| {
            let cfg = cfg.as_ref().expect("lookup config installed on this core");
            lookup_route_now(cfg, req, start, deadline)
        });
        match answered {
            Ok(resp) => {
                self.send(call.respond, &resp);
                Ok(())
            }
            // Must wait (tokenizer or another core): the general path runs it again from the
            // bytes; nothing was recorded for it yet.
            Err(_) => Err((call, received)),
        }
    }

    /// Writes one success answer: headers, the message, `grpc-status: 0` trailers (what tonic
    /// writes for a unary success). A large answer goes through the flow-controlled writer.
    fn send(&mut self, mut respond: SendResponse<Bytes>, resp: &pb::LookupRouteResponse) {
        let len = resp.encoded_len();
        if self.out.capacity() < HEADER_BYTES + len {
            self.out
                .reserve(RESPONSE_BUFFER_CHUNK.max(HEADER_BYTES + len));
        }
        self.out.put_u8(0);
        self.out.put_u32(len as u32);
        resp.encode(&mut self.out)
            .expect("reserved the encoded length");
        let message = self.out.split().freeze();
        let mut head = Response::new(());
        head.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        let Ok(mut send) = respond.send_response(head, false) else {
            return;
        };
        if message.len() > INLINE_RESPONSE_MAX_BYTES {
            glommio::spawn_local(super::respond::write_message_and_ok(send, message)).detach();
            return;
        }
        if send.send_data(message, false).is_ok() {
            let _ = send.send_trailers(ok_trailers());
        }
    }
}

/// What a waiting call's stream has delivered so far.
enum Received {
    /// The body, complete: the stream ended without trailers.
    End(Bytes),
    /// Anything else (more than one DATA frame, trailers, a reset, a body still arriving): the
    /// bytes read so far, for the general path to continue from.
    Other(Bytes),
}

/// Reads what h2 has buffered for a waiting call; `None` while nothing at all arrived.
fn receive(recv: &mut RecvStream, cx: &mut Context<'_>) -> Option<Received> {
    let mut received = Bytes::new();
    loop {
        match recv.poll_data(cx) {
            Poll::Pending if received.is_empty() => return None,
            Poll::Pending => return Some(Received::Other(received)),
            Poll::Ready(Some(Ok(bytes))) => {
                let _ = recv.flow_control().release_capacity(bytes.len());
                if bytes.is_empty() {
                    continue;
                }
                if !received.is_empty() {
                    // Split across DATA frames: rare, so the copy is fine.
                    let mut joined = BytesMut::from(&received[..]);
                    joined.extend_from_slice(&bytes);
                    return Some(Received::Other(joined.freeze()));
                }
                received = bytes;
            }
            Poll::Ready(None) if recv.is_end_stream() => return Some(Received::End(received)),
            Poll::Ready(_) => return Some(Received::Other(received)),
        }
    }
}

/// The `grpc-status: 0` trailers of a success.
pub(super) fn ok_trailers() -> HeaderMap {
    let mut trailers = HeaderMap::with_capacity(1);
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    trailers
}

/// The message of a body that is exactly one uncompressed gRPC message within the size limit.
fn whole_message(body: &[u8]) -> Option<&[u8]> {
    let (header, message) = body.split_at_checked(HEADER_BYTES)?;
    let len = u32::from_be_bytes(header[1..].try_into().ok()?) as usize;
    (header[0] == 0 && len == message.len() && len <= MAX_MESSAGE_BYTES).then_some(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(flag: u8, message: &[u8]) -> Vec<u8> {
        let mut b = vec![flag];
        b.extend_from_slice(&(message.len() as u32).to_be_bytes());
        b.extend_from_slice(message);
        b
    }

    #[test]
    fn only_one_whole_uncompressed_message_is_inline() {
        assert_eq!(whole_message(&framed(0, b"abc")), Some(&b"abc"[..]));
        assert_eq!(whole_message(&framed(0, b"")), Some(&b""[..]));
        assert_eq!(whole_message(&framed(1, b"abc")), None, "compressed");
        let mut two = framed(0, b"a");
        two.extend(framed(0, b"b"));
        assert_eq!(whole_message(&two), None, "two messages");
        assert_eq!(whole_message(&framed(0, b"abc")[..6]), None, "cut short");
        assert_eq!(whole_message(&[0, 0, 0]), None, "header cut short");
        assert_eq!(whole_message(&[]), None);
    }

    #[test]
    fn only_plain_lookups_are_inline() {
        let req = |method: &str, path: &str, ct: Option<&str>, enc: Option<&str>| {
            let mut b = Request::builder().method(method).uri(path);
            if let Some(ct) = ct {
                b = b.header("content-type", ct);
            }
            if let Some(enc) = enc {
                b = b.header("grpc-encoding", enc);
            }
            b.body(()).unwrap()
        };
        let g = Some("application/grpc");
        assert!(is_plain_lookup(&req("POST", LOOKUP_ROUTE_PATH, g, None)));
        assert!(is_plain_lookup(&req(
            "POST",
            LOOKUP_ROUTE_PATH,
            g,
            Some("identity")
        )));
        assert!(!is_plain_lookup(&req(
            "POST",
            LOOKUP_ROUTE_PATH,
            g,
            Some("gzip")
        )));
        assert!(!is_plain_lookup(&req("GET", LOOKUP_ROUTE_PATH, g, None)));
        assert!(!is_plain_lookup(&req(
            "POST",
            LOOKUP_ROUTE_PATH,
            None,
            None
        )));
        assert!(!is_plain_lookup(&req(
            "POST",
            LOOKUP_ROUTE_PATH,
            Some("application/grpc+json"),
            None
        )));
        assert!(!is_plain_lookup(&req(
            "POST",
            "/inferencecache.v1alpha1.InferenceCache/LookupPDRoute",
            g,
            None
        )));
    }
}
