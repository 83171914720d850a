//! The request body tonic reads: an HTTP/2 stream's body re-cut so that tonic only ever sees whole gRPC
//! messages (or bytes it will reject at once).
//!
//! tonic's decoder reserves a message's declared length as soon as it sees the 5-byte header,
//! so a peer that declares 4 MiB and sends 16 KiB would cost 4 MiB per stream, forever. Here an
//! incomplete message is held in a buffer that grows only with the bytes that actually arrived,
//! charged to a per-connection and a per-core budget, and failed after
//! [`MESSAGE_RECEIVE_TIMEOUT`] (docs/BEHAVIOUR.md §1.3, docs/OPERATIONS.md "Limits").

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use tonic::Status;

use crate::http2::{RecvHalf, StreamError};

use crate::limits::{
    MAX_HELD_MESSAGE_BYTES_PER_CONNECTION, MAX_HELD_MESSAGE_BYTES_PER_CORE, MAX_MESSAGE_BYTES,
    MESSAGE_RECEIVE_TIMEOUT,
};

/// The receive timeout in force (`--grpc-message-timeout-ms`), in milliseconds.
static RECEIVE_TIMEOUT_MS: AtomicU64 = AtomicU64::new(MESSAGE_RECEIVE_TIMEOUT.as_millis() as u64);

/// Sets how long a request message may take to arrive once its first byte did (at start).
pub fn set_message_receive_timeout(timeout: Duration) {
    RECEIVE_TIMEOUT_MS.store(timeout.as_millis() as u64, Ordering::Relaxed);
}

/// gRPC's length-prefixed message header: a compression flag and a big-endian u32 length.
const HEADER_BYTES: usize = 5;

thread_local! {
    /// Bytes of incomplete messages held on this core, across all its connections.
    static CORE_HELD: Cell<usize> = const { Cell::new(0) };
}

/// Bytes of incomplete messages held by one connection's streams (shared by its streams).
#[derive(Clone, Debug, Default)]
pub struct ConnectionHeld(Arc<AtomicUsize>);

/// Why a held message was given up; the label of `inferencecache_grpc_messages_refused_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeldRefusal {
    /// The connection's budget of incomplete-message bytes is spent.
    ConnectionBudget,
    /// The core's budget of incomplete-message bytes is spent.
    CoreBudget,
    /// The message did not complete within the receive timeout ([`MESSAGE_RECEIVE_TIMEOUT`]).
    Timeout,
}

impl HeldRefusal {
    /// The metric label.
    pub fn metric_label(self) -> &'static str {
        match self {
            Self::ConnectionBudget => "connection_budget",
            Self::CoreBudget => "core_budget",
            Self::Timeout => "timeout",
        }
    }

    /// The status the stream ends with.
    fn status(self) -> Status {
        match self {
            Self::ConnectionBudget | Self::CoreBudget => Status::resource_exhausted(
                "grpc: too many bytes of incomplete messages held on this connection or core",
            ),
            Self::Timeout => Status::deadline_exceeded(
                "grpc: message not completed within the server's receive timeout",
            ),
        }
    }
}

/// An error of the request body as tonic sees it: the peer's stream failed, or a held message
/// was refused. tonic finds the `Status` in the error chain and answers with it.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// A one-shot timer that is `Send` (it is only ever polled on its core).
type Timer = Pin<Box<dyn Future<Output = ()> + Send>>;

/// An HTTP/2 request body that yields whole gRPC messages.
pub struct RequestBody {
    recv: RecvHalf,
    /// Received bytes not yet cut into messages.
    carry: Bytes,
    /// The incomplete message being assembled (header included).
    partial: BytesMut,
    /// Bytes of `partial` charged to the budgets.
    charged: usize,
    connection: ConnectionHeld,
    /// Fires when the message in `partial` has taken too long.
    timer: Option<Timer>,
    /// After a header declaring more than the limit: bytes go to tonic as they come (it rejects
    /// the message at its header, before reserving anything).
    passthrough: bool,
    data_done: bool,
}

impl RequestBody {
    /// Wraps one accepted stream of a connection.
    pub fn new(recv: RecvHalf, connection: ConnectionHeld) -> Self {
        Self {
            recv,
            carry: Bytes::new(),
            partial: BytesMut::new(),
            charged: 0,
            connection,
            timer: None,
            passthrough: false,
            data_done: false,
        }
    }

    /// The next chunk for tonic out of `carry` (whole messages, or anything in passthrough),
    /// holding an incomplete tail in `partial`. `Ok(None)`: everything was held.
    fn cut(&mut self) -> Result<Option<Bytes>, HeldRefusal> {
        if self.passthrough {
            return Ok(Some(std::mem::take(&mut self.carry)));
        }
        if self.partial.is_empty() {
            let whole = whole_messages(&self.carry);
            if whole.len > 0 {
                return Ok(Some(self.carry.split_to(whole.len)));
            }
            if whole.oversize {
                self.passthrough = true;
                return Ok(Some(std::mem::take(&mut self.carry)));
            }
        }
        self.hold_from_carry()
    }

    /// Moves bytes of `carry` into the incomplete message; returns it once complete.
    fn hold_from_carry(&mut self) -> Result<Option<Bytes>, HeldRefusal> {
        let missing = match declared_len(&self.partial) {
            None => HEADER_BYTES - self.partial.len(),
            Some(len) if len > MAX_MESSAGE_BYTES => {
                self.passthrough = true;
                return Ok(Some(self.release_partial()));
            }
            Some(len) => HEADER_BYTES + len - self.partial.len(),
        };
        let take = missing.min(self.carry.len());
        self.charge(take)?;
        self.partial.extend_from_slice(&self.carry[..take]);
        self.carry.advance(take);
        let complete =
            declared_len(&self.partial).is_some_and(|len| self.partial.len() == HEADER_BYTES + len);
        if complete {
            return Ok(Some(self.release_partial()));
        }
        if self.timer.is_none() {
            let timeout = Duration::from_millis(RECEIVE_TIMEOUT_MS.load(Ordering::Relaxed));
            self.timer = Some(Box::pin(crate::runtime::io::sleep(timeout)));
        }
        Ok(None)
    }

    /// Charges `n` more held bytes to the connection and the core, or refuses them.
    fn charge(&mut self, n: usize) -> Result<(), HeldRefusal> {
        let conn = self.connection.0.load(Ordering::Relaxed);
        if conn + n > MAX_HELD_MESSAGE_BYTES_PER_CONNECTION {
            return Err(HeldRefusal::ConnectionBudget);
        }
        let core = CORE_HELD.get();
        if core + n > MAX_HELD_MESSAGE_BYTES_PER_CORE {
            return Err(HeldRefusal::CoreBudget);
        }
        self.connection.0.fetch_add(n, Ordering::Relaxed);
        CORE_HELD.set(core + n);
        self.charged += n;
        Ok(())
    }

    /// Hands the held bytes on and returns their charge to the budgets.
    fn release_partial(&mut self) -> Bytes {
        self.uncharge();
        self.timer = None;
        self.partial.split().freeze()
    }

    fn uncharge(&mut self) {
        if self.charged > 0 {
            self.connection.0.fetch_sub(self.charged, Ordering::Relaxed);
            CORE_HELD.set(CORE_HELD.get() - self.charged);
            self.charged = 0;
        }
    }

    /// Ends the stream for tonic with `why`'s status, and counts it.
    fn refuse(&mut self, why: HeldRefusal) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        crate::metrics::record_grpc_message_refused(why.metric_label());
        self.uncharge();
        self.partial = BytesMut::new();
        self.carry = Bytes::new();
        self.timer = None;
        self.data_done = true;
        Poll::Ready(Some(Err(Box::new(why.status()))))
    }

    /// Polls the stream for more data, releasing the flow-control window it used.
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, StreamError>>> {
        let polled = ready!(self.recv.poll_data(cx));
        if let Some(Ok(data)) = &polled {
            self.recv.release_capacity(data.len());
        }
        Poll::Ready(polled)
    }
}

/// What a run of bytes starts with: `len` bytes of whole messages, and whether the message
/// right after them declares more than [`MAX_MESSAGE_BYTES`].
struct WholeMessages {
    len: usize,
    oversize: bool,
}

fn whole_messages(buf: &[u8]) -> WholeMessages {
    let mut at = 0;
    while let Some(len) = declared_len(&buf[at..]) {
        if len > MAX_MESSAGE_BYTES {
            return WholeMessages {
                len: at,
                oversize: true,
            };
        }
        if buf.len() - at - HEADER_BYTES < len {
            break;
        }
        at += HEADER_BYTES + len;
    }
    WholeMessages {
        len: at,
        oversize: false,
    }
}

/// The declared length of the message `buf` starts with, once its header is complete.
fn declared_len(buf: &[u8]) -> Option<usize> {
    let header: [u8; 4] = buf.get(1..HEADER_BYTES)?.try_into().ok()?;
    Some(u32::from_be_bytes(header) as usize)
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        while !this.data_done {
            if !this.carry.is_empty() {
                match this.cut() {
                    Ok(Some(chunk)) if !chunk.is_empty() => {
                        return Poll::Ready(Some(Ok(Frame::data(chunk))));
                    }
                    Ok(_) => continue,
                    Err(why) => return this.refuse(why),
                }
            }
            if let Some(timer) = this.timer.as_mut()
                && timer.as_mut().poll(cx).is_ready()
            {
                return this.refuse(HeldRefusal::Timeout);
            }
            match ready!(this.poll_recv(cx)) {
                Some(Ok(data)) => this.carry = data,
                Some(Err(e)) => return Poll::Ready(Some(Err(Box::new(e)))),
                None => {
                    this.data_done = true;
                    // A message cut short by the end of the stream goes to tonic as it is, so
                    // tonic answers it exactly as before.
                    if !this.partial.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(this.release_partial()))));
                    }
                }
            }
        }
        match ready!(this.recv.poll_trailers(cx)) {
            Ok(Some(trailers)) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
            Ok(None) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(Box::new(e)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.data_done && self.recv.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        self.uncharge();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(len: usize) -> Vec<u8> {
        let mut m = vec![0u8];
        m.extend_from_slice(&(len as u32).to_be_bytes());
        m.extend(std::iter::repeat_n(7u8, len));
        m
    }

    #[test]
    fn whole_messages_stops_at_the_first_incomplete_one() {
        let mut buf = message(3);
        buf.extend(message(0));
        let whole = buf.len();
        buf.extend(&message(10)[..7]);
        let w = whole_messages(&buf);
        assert_eq!(w.len, whole);
        assert!(!w.oversize);
        assert_eq!(whole_messages(&buf[..4]).len, 0);
    }

    #[test]
    fn whole_messages_flags_an_oversize_header() {
        let mut buf = message(1);
        buf.push(0);
        buf.extend_from_slice(&((MAX_MESSAGE_BYTES + 1) as u32).to_be_bytes());
        let w = whole_messages(&buf);
        assert_eq!(w.len, 6);
        assert!(w.oversize);
    }
}
