//! The inline LookupRoute path: the hot unary call answered inside the connection's own turn,
//! without tonic, a task per stream, or a boxed future.
//!
//! Why: on one core the per-request cost of the general path (a spawned task per stream, tonic's
//! codec and body adapters, one response flushed per wake-up) was several times the index work
//! (perf/runs/2026-12-03-where-a-lookuproute-s-instructions-go.md). Here the HTTP/2 layer (`crate::http2`) offers each
//! plain LookupRoute whose message arrived whole in one DATA frame with the end of the stream;
//! it is decoded from the received bytes, answered, and its answer is framed into the turn's
//! output, which leaves in one write.
//!
//! Only the plain case takes this path: `POST` of one uncompressed message. A call the handler
//! answers without waiting is answered in the turn; a call that must wait (for the owner core
//! or the tokenizer) is decided here once and its decoded request sent on from the
//! connection, answered by a task of its own ([`answer_later`]). Anything else (compression,
//! trailers, a split or oversize message, a decode error) goes to the general path with the
//! bytes already read, so every answer and error stays exactly the general path's.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Instant;

use bytes::{BufMut, Bytes, BytesMut};
use inferencecache_proto::v1alpha1 as pb;
use prost::Message;

use super::lookup_wire::{self, DecodeScratch};
use crate::http2::{HeaderList, Inline, Reason, Responder};
use crate::limits::MAX_MESSAGE_BYTES;
use crate::lookup::{Decision, LookupConfig, LookupRequest, ReceivedRequest, Waiting, decide};

/// The one path this module answers.
const LOOKUP_ROUTE_PATH: &[u8] = b"/inferencecache.v1alpha1.InferenceCache/LookupRoute";
/// gRPC's length-prefixed message header: a compression flag and a big-endian u32 length.
const HEADER_BYTES: usize = 5;

/// `:status: 200` (HPACK static index 8) and `content-type: application/grpc` (a literal with
/// the static name index 31): the head of every inline answer.
pub(super) const GRPC_OK_HEAD: &[u8] = b"\x88\x0f\x10\x10application/grpc";
/// `grpc-status: 0` as a literal without indexing: the trailers of every inline answer (what
/// tonic writes for a unary success).
pub(super) const GRPC_OK_TRAILERS: &[u8] = b"\x00\x0bgrpc-status\x010";

thread_local! {
    /// This core's lookup configuration (installed with the services).
    static LOOKUP_CONFIG: RefCell<Option<Arc<LookupConfig>>> = const { RefCell::new(None) };
    /// This core's reused decode buffers.
    static DECODE_SCRATCH: RefCell<DecodeScratch> = RefCell::new(DecodeScratch::default());
}

/// Installs this core's lookup configuration (with the tonic services).
pub(super) fn install(cfg: Arc<LookupConfig>) {
    LOOKUP_CONFIG.with_borrow_mut(|c| *c = Some(cfg));
}

/// Whether a request is a plain LookupRoute (uncompressed gRPC over POST). A repeated
/// `content-type` or `grpc-encoding` is left to the general path (which reads the first).
pub(super) fn is_plain_lookup(head: &HeaderList) -> bool {
    let (mut post, mut path) = (false, false);
    let (mut content_types, mut grpc, mut encodings, mut identity) = (0, false, 0, true);
    for (name, value) in head.iter() {
        match name {
            b":method" => post = value == b"POST",
            b":path" => path = value == LOOKUP_ROUTE_PATH,
            b"content-type" => {
                content_types += 1;
                grpc = value == b"application/grpc";
            }
            b"grpc-encoding" => {
                encodings += 1;
                identity = value == b"identity";
            }
            _ => {}
        }
    }
    post && path && grpc && identity && content_types == 1 && encodings <= 1
}

/// Answers a plain LookupRoute whose body is `received`, writing the length-prefixed answer
/// into `out`, or takes it to answer later when it must wait; `General` when the general path
/// must decode it (nothing recorded, nothing written).
pub(super) fn answer(
    head: &HeaderList,
    received: Bytes,
    out: &mut BytesMut,
) -> Inline<Box<Waiting>> {
    let Some(message) = whole_message(&received) else {
        return Inline::General;
    };
    let decided = DECODE_SCRATCH.with_borrow_mut(|scratch| {
        let mut slices = Vec::new();
        let decided = decide_message(head, &received, message, scratch, &mut slices);
        scratch.trim();
        decided
    });
    match decided {
        None => Inline::General,
        Some(Err(resp)) => {
            put_message(&resp, out);
            crate::lookup::recycle(resp);
            Inline::Answered
        }
        Some(Ok(waiting)) => Inline::Later(waiting),
    }
}

/// Answers a call [`answer`] took because it must wait, on `respond`, unless the peer resets
/// the stream first; the answer is framed as an inline one.
pub(super) async fn answer_later(waiting: Box<Waiting>, respond: Responder) {
    let call = crate::lookup::answer_waiting(*waiting);
    let answered = futures_lite::future::or(async { Some(call.await) }, async {
        std::future::poll_fn(|cx| respond.poll_reset(cx)).await;
        None
    })
    .await;
    let Some(resp) = answered else { return };
    let mut body = BytesMut::new();
    put_message(&resp, &mut body);
    crate::lookup::recycle(resp);
    if respond
        .send_headers(Bytes::from_static(GRPC_OK_HEAD), false)
        .is_err()
    {
        return;
    }
    if respond.send_data(body.freeze(), false).await.is_err() {
        return;
    }
    if respond
        .send_trailers(Bytes::from_static(GRPC_OK_TRAILERS))
        .is_err()
    {
        respond.send_reset(Reason::INTERNAL_ERROR);
    }
}

/// Writes `resp` as one length-prefixed gRPC message.
fn put_message(resp: &pb::LookupRouteResponse, out: &mut BytesMut) {
    let len = resp.encoded_len();
    out.reserve(HEADER_BYTES + len);
    out.put_u8(0);
    out.put_u32(len as u32);
    resp.encode(out).expect("reserved the encoded length");
}

/// Decodes `message`, a slice of `received`, into a view (`None`: the general path decodes it
/// with prost) and decides it: `Ok` the call that must wait, its request kept from the view
/// (sharing `received`; boxed, so the answered path moves only small values), else `Err` the
/// answer.
fn decide_message<'a>(
    head: &HeaderList,
    received: &Bytes,
    message: &'a [u8],
    scratch: &'a mut DecodeScratch,
    slices: &'a mut Vec<&'a [u8]>,
) -> Option<Result<Box<Waiting>, pb::LookupRouteResponse>> {
    let req = lookup_wire::decode(message, scratch, slices)?;
    // Handler entry, as on the general path: the message is in (`lookup_latency_us` and the
    // caller's deadline count from here).
    let start = Instant::now();
    let deadline = head
        .get(b"grpc-timeout")
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(super::deadline::parse_grpc_timeout)
        .and_then(|timeout| start.checked_add(timeout));
    let decision = LOOKUP_CONFIG.with_borrow(|cfg| {
        let cfg = cfg.as_ref().expect("lookup config installed on this core");
        decide(cfg, &req, start, deadline)
    });
    if let Decision::Answered(resp) = decision {
        return Some(Err(resp));
    }
    let kept = ReceivedRequest::new(received.slice_ref(message), &req);
    let kept = LookupRequest::Received(kept);
    Some(decision.waiting(kept).map(Box::new))
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

    /// A header list as the HTTP/2 layer decodes it (literal fields, no Huffman).
    fn head(method: &str, path: &str, ct: Option<&str>, enc: Option<&str>) -> HeaderList {
        let mut fields = vec![(":method", method), (":scheme", "http"), (":path", path)];
        fields.extend(ct.map(|v| ("content-type", v)));
        fields.extend(enc.map(|v| ("grpc-encoding", v)));
        let mut block = Vec::new();
        for (n, v) in fields {
            block.push(0);
            block.push(n.len() as u8);
            block.extend_from_slice(n.as_bytes());
            block.push(v.len() as u8);
            block.extend_from_slice(v.as_bytes());
        }
        let mut decoder = crate::http2::headers::Decoder::new(16 * 1024);
        match decoder.decode(&block, false, &mut BytesMut::new()).unwrap() {
            crate::http2::headers::Decoded::List(list) => list,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn only_plain_lookups_are_inline() {
        let path = std::str::from_utf8(LOOKUP_ROUTE_PATH).unwrap();
        let g = Some("application/grpc");
        assert!(is_plain_lookup(&head("POST", path, g, None)));
        assert!(is_plain_lookup(&head("POST", path, g, Some("identity"))));
        assert!(!is_plain_lookup(&head("POST", path, g, Some("gzip"))));
        assert!(!is_plain_lookup(&head("GET", path, g, None)));
        assert!(!is_plain_lookup(&head("POST", path, None, None)));
        assert!(!is_plain_lookup(&head(
            "POST",
            path,
            Some("application/grpc+json"),
            None
        )));
        let pd = "/inferencecache.v1alpha1.InferenceCache/LookupPDRoute";
        assert!(!is_plain_lookup(&head("POST", pd, g, None)));
    }

    #[test]
    fn the_inline_blocks_decode_as_a_grpc_success() {
        let ok = loona_hpack::Decoder::new().decode(GRPC_OK_HEAD).unwrap();
        assert_eq!(
            ok,
            vec![
                (b":status".to_vec(), b"200".to_vec()),
                (b"content-type".to_vec(), b"application/grpc".to_vec())
            ]
        );
        let trailers = loona_hpack::Decoder::new()
            .decode(GRPC_OK_TRAILERS)
            .unwrap();
        assert_eq!(trailers, vec![(b"grpc-status".to_vec(), b"0".to_vec())]);
    }
}
