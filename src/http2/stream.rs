//! The state a stream served on the general path shares between the connection task and the
//! stream's own task: the received body (read by [`RecvHalf`]) and the queued response (written
//! by [`Responder`]).
//!
//! Why a mutex: tonic's services take `Send` bodies (reflection moves its request stream to the
//! admin runtime's threads), so the halves handed out must be `Send`. Only general-path streams
//! (every RPC but a plain LookupRoute) have one; the inline path shares nothing.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;

use super::frame::Reason;
use crate::limits::HTTP2_MAX_QUEUED_RESPONSE_BYTES;

/// One queued piece of a response, in the order it goes on the wire.
pub(super) enum Outgoing {
    /// An encoded header block (a response head, or trailers when `end`).
    Headers { block: Bytes, end: bool },
    /// Body bytes, cut to the flow-control windows and the peer's frame size when written.
    Data { bytes: Bytes, end: bool },
    /// Ends the stream with RST_STREAM.
    Reset(Reason),
}

/// What the connection and a stream's task share.
#[derive(Default)]
pub(super) struct Shared {
    /// Received body bytes not yet read.
    pub received: BytesMut,
    /// The peer ended its side (END_STREAM).
    pub recv_ended: bool,
    /// Trailers that ended the request.
    pub trailers: Option<HeaderMap>,
    /// The stream was reset (by the peer, or by the connection ending); ends both halves.
    pub reset: Option<Reason>,
    /// Bytes read by the body since the connection last returned them to the peer's window.
    pub released: usize,
    /// The request body was dropped: anything more that arrives is discarded.
    pub recv_dropped: bool,
    pub recv_waker: Option<Waker>,
    /// The response, queued for the connection.
    pub outgoing: VecDeque<Outgoing>,
    /// Body bytes in `outgoing`.
    pub queued_bytes: usize,
    /// The response ended (END_STREAM or a reset queued): nothing more may be queued.
    pub send_ended: bool,
    pub send_waker: Option<Waker>,
    /// Waiting in the connection's list of streams to visit.
    pub scheduled: bool,
}

/// The connection's side of a stream's task: tells it there is something to visit.
#[derive(Default)]
pub(super) struct Wakeups {
    /// Streams with something new for the connection (queued output, released window).
    pub streams: Vec<u32>,
    pub connection: Option<Waker>,
    /// Streams whose task waits because the connection's queued answers reached
    /// [`HTTP2_MAX_QUEUED_RESPONSE_BYTES`]; visited (and so woken) once they are below it.
    pub waiting_for_room: Vec<u32>,
}

/// The handle a stream's halves use to reach their connection.
#[derive(Clone)]
pub(super) struct StreamLink {
    pub id: u32,
    pub shared: Arc<Mutex<Shared>>,
    pub wakeups: Arc<Mutex<Wakeups>>,
    /// Response body bytes queued on all of the connection's streams (the connection stops
    /// taking new requests past [`HTTP2_MAX_QUEUED_RESPONSE_BYTES`]).
    pub queued: Arc<AtomicUsize>,
}

impl StreamLink {
    pub(super) fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the connection's queued answers are at their bound; if so the stream is put on
    /// the list the connection visits once they are below it. Checked under the list's lock,
    /// which the connection takes after it lowers the count, so no wake-up is lost.
    fn wait_for_room(&self) -> bool {
        let mut w = self.wakeups.lock().unwrap_or_else(|e| e.into_inner());
        let full = self.queued.load(Ordering::Relaxed) >= HTTP2_MAX_QUEUED_RESPONSE_BYTES;
        if full && !w.waiting_for_room.contains(&self.id) {
            w.waiting_for_room.push(self.id);
        }
        full
    }

    /// Puts the stream on the connection's list and wakes the connection (once per visit).
    fn schedule(&self, shared: &mut Shared) {
        if shared.scheduled {
            return;
        }
        shared.scheduled = true;
        let mut w = self.wakeups.lock().unwrap_or_else(|e| e.into_inner());
        w.streams.push(self.id);
        if let Some(waker) = w.connection.take() {
            waker.wake();
        }
    }
}

/// The request body of a general-path stream, as the connection received it.
pub struct RecvHalf {
    link: StreamLink,
}

impl RecvHalf {
    pub(super) fn new(link: StreamLink) -> Self {
        RecvHalf { link }
    }

    /// The next received bytes; `None` at the end of the body. Bytes must be handed back with
    /// [`RecvHalf::release_capacity`] once consumed, which reopens the peer's window.
    pub fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, StreamError>>> {
        let mut s = self.link.lock();
        if let Some(reason) = s.reset {
            return Poll::Ready(Some(Err(StreamError(reason))));
        }
        if !s.received.is_empty() {
            return Poll::Ready(Some(Ok(s.received.split().freeze())));
        }
        if s.recv_ended {
            return Poll::Ready(None);
        }
        s.recv_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    /// Returns `n` consumed bytes to the peer's flow-control windows.
    pub fn release_capacity(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        let mut s = self.link.lock();
        s.released += n;
        self.link.schedule(&mut s);
    }

    /// The trailers that ended the body, once it ended.
    pub fn poll_trailers(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<HeaderMap>, StreamError>> {
        let mut s = self.link.lock();
        if let Some(reason) = s.reset {
            return Poll::Ready(Err(StreamError(reason)));
        }
        if s.recv_ended && s.received.is_empty() {
            return Poll::Ready(Ok(s.trailers.take()));
        }
        s.recv_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    /// Whether the body has ended and everything was read.
    pub fn is_end_stream(&self) -> bool {
        let s = self.link.lock();
        s.recv_ended && s.received.is_empty()
    }
}

impl Drop for RecvHalf {
    fn drop(&mut self) {
        let mut s = self.link.lock();
        s.recv_dropped = true;
        // What was received and not read goes back to the peer's window.
        s.released += s.received.len();
        s.received = BytesMut::new();
        self.link.schedule(&mut s);
    }
}

/// The stream's reset, as a body or response error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamError(pub Reason);

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HTTP/2 stream reset (error code {:#x})", self.0.0)
    }
}

impl std::error::Error for StreamError {}

/// Writes a general-path stream's response: queued here, written by the connection as the
/// peer's windows allow. Queued body bytes are bounded by `max_queued` per stream.
pub struct Responder {
    link: StreamLink,
    max_queued: usize,
    /// The connection counts its live general-path tasks by this token's clones.
    _task: Arc<()>,
}

impl Responder {
    pub(super) fn new(link: StreamLink, max_queued: usize, task: Arc<()>) -> Self {
        Responder {
            link,
            max_queued,
            _task: task,
        }
    }

    fn push(&self, out: Outgoing, end: bool) -> Result<(), StreamError> {
        let mut s = self.link.lock();
        if let Some(reason) = s.reset {
            return Err(StreamError(reason));
        }
        if s.send_ended {
            return Err(StreamError(Reason::STREAM_CLOSED));
        }
        if let Outgoing::Data { bytes, .. } = &out {
            s.queued_bytes += bytes.len();
            self.link.queued.fetch_add(bytes.len(), Ordering::Relaxed);
        }
        s.send_ended = end;
        s.outgoing.push_back(out);
        self.link.schedule(&mut s);
        Ok(())
    }

    /// Queues the response head (an encoded header block); `end` for a trailers-only answer.
    pub fn send_headers(&self, block: Bytes, end: bool) -> Result<(), StreamError> {
        self.push(Outgoing::Headers { block, end }, end)
    }

    /// Queues body bytes once fewer than the per-stream bound are queued and the connection
    /// as a whole holds fewer than [`HTTP2_MAX_QUEUED_RESPONSE_BYTES`].
    pub async fn send_data(&self, bytes: Bytes, end: bool) -> Result<(), StreamError> {
        poll_fn(|cx| {
            let mut s = self.link.lock();
            if let Some(reason) = s.reset {
                return Poll::Ready(Err(StreamError(reason)));
            }
            if s.queued_bytes < self.max_queued && !self.link.wait_for_room() {
                return Poll::Ready(Ok(()));
            }
            s.send_waker = Some(cx.waker().clone());
            Poll::Pending
        })
        .await?;
        self.push(Outgoing::Data { bytes, end }, end)
    }

    /// Queues trailers (an encoded header block), ending the stream.
    pub fn send_trailers(&self, block: Bytes) -> Result<(), StreamError> {
        self.push(Outgoing::Headers { block, end: true }, true)
    }

    /// Ends the stream with RST_STREAM `reason`.
    pub fn send_reset(&self, reason: Reason) {
        let _ = self.push(Outgoing::Reset(reason), true);
    }

    /// Whether the stream was reset (by the peer or the connection closing): a task that has
    /// not begun its work need not.
    pub fn is_reset(&self) -> bool {
        self.link.lock().reset.is_some()
    }

    /// Ready with the reason once the stream was reset (by the peer or the connection closing).
    pub fn poll_reset(&self, cx: &mut Context<'_>) -> Poll<Reason> {
        let mut s = self.link.lock();
        if let Some(reason) = s.reset {
            return Poll::Ready(reason);
        }
        s.send_waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        // A response abandoned half-way is cancelled, so the peer is not left waiting.
        let ended = self.link.lock().send_ended;
        if !ended {
            self.send_reset(Reason::CANCEL);
        }
    }
}
