//! A lean `LookupRoute` client: one HTTP/2 connection driven with `h2` directly.
//!
//! A gateway asks for a route on every LLM request, one call at a time per request, so the
//! client's own cost per call is part of every request's latency. tonic's channel sends a
//! unary call as three writes (HEADERS, the message, an empty END_STREAM frame), each its own
//! TCP segment that wakes the server, and moves the body through a spawned task. This client
//! queues HEADERS and the whole message (with END_STREAM) before the connection task runs, so
//! the connection writes the request in one segment, and reads the answer on the same task
//! that asked. Measured in perf/runs/2026-12-03-a-lean-lookuproute-client-in-the-gateway-sdk-and.md.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use h2::client::SendRequest;
use http::{HeaderMap, Method, Request, Uri};
use inferencecache_proto::v1alpha1::{LookupRouteRequest, LookupRouteResponse};
use prost::Message;
use tokio::net::TcpStream;
use tonic::{Code, Status};

/// Largest `LookupRoute` answer accepted, message bytes (gRPC's default receive limit).
pub const MAX_RESPONSE_BYTES: usize = 4 << 20;
/// gRPC method path of `LookupRoute`.
const LOOKUP_ROUTE_PATH: &str = "/inferencecache.v1alpha1.InferenceCache/LookupRoute";
/// Bytes of the gRPC message prefix: compressed flag and big-endian length.
const GRPC_PREFIX_BYTES: usize = 5;

/// How a [`LookupConnection`] opens its TCP connection (plain, or from a chosen source port).
pub type Dial = Arc<dyn Fn() -> DialFuture + Send + Sync>;
/// What a [`Dial`] returns.
pub type DialFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = std::io::Result<TcpStream>> + Send>>;

/// One HTTP/2 connection for `LookupRoute` calls; reopened on the next call after it fails.
/// Cheap to clone: clones share the connection, and calls on it run concurrently (one HTTP/2
/// stream each).
#[derive(Clone)]
pub struct LookupConnection {
    dial: Dial,
    uri: Uri,
    open: Arc<Mutex<Option<SendRequest<Bytes>>>>,
}

impl std::fmt::Debug for LookupConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LookupConnection")
            .field("uri", &self.uri)
            .finish_non_exhaustive()
    }
}

impl LookupConnection {
    /// A connection to `authority` (`host:port`, the HTTP/2 `:authority`) opened by `dial`.
    /// Nothing is opened until [`connect`](Self::connect) or the first call.
    pub fn new(authority: &str, dial: Dial) -> Result<Self, Status> {
        let uri = Uri::builder()
            .scheme("http")
            .authority(authority)
            .path_and_query(LOOKUP_ROUTE_PATH)
            .build()
            .map_err(|e| Status::invalid_argument(format!("bad authority {authority:?}: {e}")))?;
        Ok(Self {
            dial,
            uri,
            open: Arc::new(Mutex::new(None)),
        })
    }

    /// A connection to `authority` (`host:port`, resolved at each connect) over plain TCP.
    pub fn plain(authority: &str) -> Result<Self, Status> {
        let target = authority.to_string();
        let dial: Dial = Arc::new(move || {
            let target = target.clone();
            Box::pin(async move {
                let s = TcpStream::connect(target).await?;
                s.set_nodelay(true)?;
                Ok(s)
            })
        });
        Self::new(authority, dial)
    }

    /// Opens the connection now (otherwise the first call does), within `timeout`.
    pub async fn connect(&self, timeout: Duration) -> Result<(), Status> {
        tokio::time::timeout(timeout, self.sender())
            .await
            .map_err(|_| Status::deadline_exceeded("connect timed out"))?
            .map(|_| ())
    }

    /// `LookupRoute`, bounded by `timeout` (also sent as the gRPC deadline). A transport
    /// failure closes the connection; the next call opens a new one.
    pub async fn lookup_route(
        &self,
        req: &LookupRouteRequest,
        timeout: Duration,
    ) -> Result<LookupRouteResponse, Status> {
        match tokio::time::timeout(timeout, self.call(req, timeout)).await {
            Ok(answer) => answer,
            Err(_) => Err(Status::deadline_exceeded("lookup timed out")),
        }
    }

    async fn call(
        &self,
        req: &LookupRouteRequest,
        timeout: Duration,
    ) -> Result<LookupRouteResponse, Status> {
        let send = self.sender().await?;
        let answer = exchange(send, &self.uri, req, timeout).await;
        if let Err(CallError::Transport(_)) = &answer {
            self.forget();
        }
        answer.map_err(CallError::into_status)
    }

    /// The open connection's sender, opening the connection if there is none.
    async fn sender(&self) -> Result<SendRequest<Bytes>, Status> {
        if let Some(send) = self.lock().clone() {
            return Ok(send);
        }
        let tcp = (self.dial)()
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let (send, connection) = h2::client::Builder::new()
            .initial_window_size(1 << 20)
            .max_header_list_size(16 << 10)
            .handshake::<_, Bytes>(tcp)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        // The connection's frames are read and written by this task until it closes.
        tokio::spawn(async move {
            let _ = connection.await;
        });
        *self.lock() = Some(send.clone());
        Ok(send)
    }

    fn forget(&self) {
        *self.lock() = None;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<SendRequest<Bytes>>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Why one call failed: the connection (closed afterwards) or the server's gRPC status.
enum CallError {
    Transport(String),
    Status(Status),
}

impl CallError {
    fn into_status(self) -> Status {
        match self {
            Self::Transport(e) => Status::unavailable(e),
            Self::Status(st) => st,
        }
    }
}

impl From<h2::Error> for CallError {
    fn from(e: h2::Error) -> Self {
        if e.is_io() || e.is_go_away() {
            Self::Transport(e.to_string())
        } else {
            // A reset of this stream only: the connection stays usable.
            Self::Status(Status::unavailable(e.to_string()))
        }
    }
}

/// One request/answer exchange on a new stream of `send`.
async fn exchange(
    send: SendRequest<Bytes>,
    uri: &Uri,
    req: &LookupRouteRequest,
    timeout: Duration,
) -> Result<LookupRouteResponse, CallError> {
    let mut send = send.ready().await?;
    let head = Request::builder()
        .method(Method::POST)
        .uri(uri.clone())
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-timeout", grpc_timeout(timeout))
        .body(())
        .expect("a static request head is valid");
    let (answer, mut body_out) = send.send_request(head, false)?;
    // Queued before the connection task next runs, so HEADERS and DATA leave in one write.
    body_out.send_data(encode(req), true)?;
    let answer = answer.await?;
    if answer.status() != http::StatusCode::OK {
        return Err(CallError::Status(Status::unknown(format!(
            "HTTP status {}",
            answer.status()
        ))));
    }
    // A trailers-only answer carries grpc-status in its head.
    if let Some(st) = status_in(answer.headers()) {
        return Err(CallError::Status(st));
    }
    let mut body = answer.into_body();
    let message = read_body(&mut body).await?;
    let trailers = body.trailers().await?.unwrap_or_default();
    match status_in(&trailers) {
        None => Err(CallError::Status(Status::internal("no grpc-status"))),
        Some(st) if st.code() != Code::Ok => Err(CallError::Status(st)),
        Some(_) => decode(&message),
    }
}

/// The answer's DATA frames, at most [`MAX_RESPONSE_BYTES`] of message plus its prefix.
async fn read_body(body: &mut h2::RecvStream) -> Result<BytesMut, CallError> {
    let mut message = BytesMut::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        let _ = body.flow_control().release_capacity(chunk.len());
        if message.len() + chunk.len() > MAX_RESPONSE_BYTES + GRPC_PREFIX_BYTES {
            return Err(CallError::Status(Status::resource_exhausted(
                "answer larger than MAX_RESPONSE_BYTES",
            )));
        }
        message.extend_from_slice(&chunk);
    }
    Ok(message)
}

/// The request as one gRPC message: uncompressed flag, length, protobuf bytes.
fn encode(req: &LookupRouteRequest) -> Bytes {
    let len = req.encoded_len();
    let mut out = BytesMut::with_capacity(GRPC_PREFIX_BYTES + len);
    out.put_u8(0);
    out.put_u32(len as u32);
    req.encode(&mut out)
        .expect("the buffer was sized by encoded_len");
    out.freeze()
}

/// The single message of a unary answer.
fn decode(body: &[u8]) -> Result<LookupRouteResponse, CallError> {
    let bad = |why: &str| CallError::Status(Status::internal(why.to_string()));
    let (prefix, message) = body
        .split_at_checked(GRPC_PREFIX_BYTES)
        .ok_or_else(|| bad("answer shorter than a gRPC message prefix"))?;
    if prefix[0] != 0 {
        return Err(bad("compressed answer (no grpc-encoding was offered)"));
    }
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if len != message.len() {
        return Err(bad("answer is not exactly one gRPC message"));
    }
    LookupRouteResponse::decode(message).map_err(|e| bad(&format!("bad answer: {e}")))
}

/// `grpc-status` (and `grpc-message`) in a header block, if present.
fn status_in(headers: &HeaderMap) -> Option<Status> {
    let code = headers
        .get("grpc-status")?
        .to_str()
        .ok()?
        .parse::<i32>()
        .ok()?;
    let message = headers
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        .map(percent_decode)
        .unwrap_or_default();
    Some(Status::new(Code::from_i32(code), message))
}

/// gRPC's percent-encoding of `grpc-message` (`%XX` escapes), decoded leniently.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The `grpc-timeout` header value for `timeout`: whole milliseconds (at least 1), or
/// microseconds below a millisecond; at most 8 digits as the spec requires.
fn grpc_timeout(timeout: Duration) -> String {
    let micros = timeout.as_micros();
    if micros < 1_000 {
        format!("{}u", micros.max(1))
    } else {
        format!("{}m", (timeout.as_millis()).min(99_999_999))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_uses_milliseconds_or_microseconds() {
        assert_eq!(grpc_timeout(Duration::from_millis(5)), "5m");
        assert_eq!(grpc_timeout(Duration::from_micros(250)), "250u");
        assert_eq!(grpc_timeout(Duration::ZERO), "1u");
        assert_eq!(grpc_timeout(Duration::from_secs(10_000_000)), "99999999m");
    }

    #[test]
    fn a_message_round_trips_through_the_grpc_prefix() {
        let req = LookupRouteRequest {
            tenant_id: "t".into(),
            ..Default::default()
        };
        let wire = encode(&req);
        assert_eq!(wire[0], 0);
        assert_eq!(wire.len(), GRPC_PREFIX_BYTES + req.encoded_len());
        let answer = LookupRouteResponse {
            reason_code: "PREFIX_MATCH".into(),
            ..Default::default()
        };
        let mut body = vec![0, 0, 0, 0, answer.encoded_len() as u8];
        body.extend(answer.encode_to_vec());
        assert_eq!(decode(&body).ok(), Some(answer));
    }

    #[test]
    fn malformed_answers_are_errors() {
        assert!(decode(&[0, 0, 0]).is_err());
        assert!(decode(&[1, 0, 0, 0, 0]).is_err(), "compressed");
        assert!(decode(&[0, 0, 0, 0, 2, 0]).is_err(), "length mismatch");
    }

    #[test]
    fn grpc_message_is_percent_decoded() {
        let mut h = HeaderMap::new();
        h.insert("grpc-status", "3".parse().unwrap());
        h.insert("grpc-message", "bad%20tenant%2".parse().unwrap());
        let st = status_in(&h).unwrap();
        assert_eq!(st.code(), Code::InvalidArgument);
        assert_eq!(st.message(), "bad tenant%2");
    }
}
