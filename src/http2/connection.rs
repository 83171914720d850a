//! One HTTP/2 server connection (RFC 9113): the preface, frames in and out, HPACK, flow
//! control, the stream table, keep-alive pings and the graceful drain, in the connection's own
//! task on its core.
//!
//! A request the [`Service`] takes inline (a plain unary call) is answered inside the turn that
//! read its last byte: no task, no shared state, no allocation; its answer joins the turn's
//! output, which leaves in one write. Every other request is handed to the service with a
//! [`RecvHalf`] and a [`Responder`] for a task of its own (the general path).
//!
//! Bounds: the streams the peer may open ([`MAX_CONCURRENT_STREAMS`]); a header block's bytes
//! ([`HTTP2_MAX_HEADER_BLOCK_BYTES`]); received body bytes (the flow-control windows, returned
//! only once read); response bytes queued per stream ([`HTTP2_MAX_SEND_BUFFER_BYTES`]); and the
//! output buffer ([`HTTP2_WRITE_BUFFER_BYTES`]): past it no input is read, so a peer that does
//! not read (PING or SETTINGS floods included) is held back by TCP, not by the server's memory;
//! the closed streams remembered for late frames
//! ([`HTTP2_RECENT_CLOSED_STREAMS`](crate::limits::HTTP2_RECENT_CLOSED_STREAMS)).
//!
//! A turn handles at most [`HTTP2_FRAMES_PER_TURN`] frames, and frames for at most
//! [`HTTP2_TURN_TIME`], before it yields, and the core polls its I/O at least every
//! [`CORE_PREEMPT_TIMER`](crate::limits::CORE_PREEMPT_TIMER) while tasks stay runnable, so a
//! flooding connection delays its core's other connections by about one bounded turn. Floods of frames that
//! move nothing forward, and the stream errors a peer provokes, are bounded per connection by
//! [`FloodGuard`] (GOAWAY ENHANCE_YOUR_CALM past a bound). The tasks of the streams a read
//! batch opens start at its end, so a stream reset in the batch that opened it (by the peer,
//! or by this server over a later frame: "MadeYouReset") never starts one.
//!
//! Stream states move only through [`transition`] (RFC 9113 §5.1, in `state.rs`): a stream in
//! the table is open or half-closed, one below the highest id used and not in it is closed (on
//! record with its cause, or forgotten), one above it idle.

use std::collections::HashMap;
use std::future::{Future, poll_fn};
use std::hash::{BuildHasherDefault, Hasher};
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use futures_lite::{AsyncRead, AsyncWrite};

use crate::limits::{
    DRAIN_TIMEOUT, HTTP2_CONNECTION_WINDOW_BYTES, HTTP2_FRAMES_PER_TURN, HTTP2_KEEPALIVE_INTERVAL,
    HTTP2_KEEPALIVE_TIMEOUT, HTTP2_MAX_HEADER_BLOCK_BYTES, HTTP2_MAX_HEADER_BYTES_PER_CORE,
    HTTP2_MAX_HEADER_LIST_BYTES, HTTP2_MAX_QUEUED_RESPONSE_BYTES, HTTP2_MAX_SEND_BUFFER_BYTES,
    HTTP2_PREFACE_TIMEOUT, HTTP2_STREAM_WINDOW_BYTES, HTTP2_TURN_CLOCK_EVERY,
    HTTP2_TURN_MIN_FRAMES, HTTP2_TURN_TIME, HTTP2_WRITE_BUFFER_BYTES, MAX_CONCURRENT_STREAMS,
};

use super::frame::{self, FrameHeader, Reason, flag, kind, setting};
use super::guard::{Exceeded, FloodGuard};
use super::headers::{Decoded, Decoder, HeaderList};
use super::state::{Cause, ClosedStreams, ContentLength, Event, Reaction, State, transition};
use super::stream::{Outgoing, RecvHalf, Responder, Shared, StreamLink, Wakeups};

/// What the connection asks of the application it serves.
pub trait Service {
    /// The header block of every inline answer (status and content type).
    const INLINE_HEAD: &'static [u8];
    /// The trailers block of every inline answer.
    const INLINE_TRAILERS: &'static [u8];

    /// Whether a new request is a candidate for the inline path: its body is then collected
    /// and offered to [`Service::answer_inline`] when it arrives whole in one DATA frame.
    fn is_inline(&mut self, head: &HeaderList) -> bool;

    /// What an inline request taken to be answered later carries (see [`Inline::Later`]).
    type Later;

    /// Answers an inline request by writing its response body into `out`, takes it to answer
    /// later, or hands it to the general path unchanged (then nothing may have been written).
    fn answer_inline(
        &mut self,
        head: &HeaderList,
        body: Bytes,
        out: &mut BytesMut,
    ) -> Inline<Self::Later>;

    /// Answers a request [`Service::answer_inline`] took to answer later (in a task of its
    /// own), on `respond`: its answer head, body and trailers as an inline answer's.
    fn answer_later(&mut self, later: Self::Later, respond: Responder);

    /// Serves a request on the general path (in a task of its own); `head` is what `req` was
    /// built from.
    fn serve_general(
        &mut self,
        head: &HeaderList,
        req: http::Request<RecvHalf>,
        respond: Responder,
    );
}

/// What became of a request offered to [`Service::answer_inline`].
pub enum Inline<L> {
    /// Answered: its response body is in the output buffer given.
    Answered,
    /// Taken whole, to be answered by [`Service::answer_later`] once what it waits for is done.
    Later(L),
    /// Not taken: the general path serves it.
    General,
}

/// Read and answer rounds of one connection turn before it yields to the core's other tasks
/// (fewer once [`HTTP2_FRAMES_PER_TURN`] frames are handled).
const ROUNDS_PER_TURN: usize = 8;
/// The last stream id a client can use (§5.1.1): past it, it needs a new connection.
const LAST_STREAM_ID: u32 = 0x7fff_ffff;
/// The ping payloads this server sends.
const KEEPALIVE_PING: [u8; 8] = *b"ic-alive";
const DRAIN_PING: [u8; 8] = *b"ic-drain";
/// A connection error's GOAWAY is given this long to leave before the socket closes.
const CLOSE_FLUSH_TIMEOUT: Duration = Duration::from_secs(1);

/// A connection error: GOAWAY with the reason, then close.
#[derive(Debug)]
struct ConnError(Reason);

/// Stream ids are small odd integers: a multiplicative hash spreads them over the table.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("stream ids hash as u32")
    }
    fn write_u32(&mut self, id: u32) {
        self.0 = u64::from(id).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type StreamTable = HashMap<u32, Stream, BuildHasherDefault<IdHasher>>;

/// A stream the peer opened that is not closed yet: its state (open or half-closed, RFC 9113
/// §5.1, moved only through [`transition`]), its request's `content-length` accounting, and
/// how it is served.
struct Stream {
    state: State,
    length: ContentLength,
    path: Path,
}

/// How an open stream is served.
enum Path {
    /// An inline candidate whose body has not arrived.
    Inline(InlineStream),
    /// Served by a task of its own, or an answer waiting for the peer's windows.
    General(General),
}

struct InlineStream {
    head: HeaderList,
    /// The head's share of the core's header budget, counted while the stream is open.
    charge: HeaderCharge,
    recv_window: i64,
    send_window: i64,
    /// The message, parked when it came in a DATA frame of its own and the end of the
    /// stream is still to come (gRPC clients send an empty END_STREAM frame after it).
    /// Parked only until the end of the read batch it arrived in.
    parked: Option<Bytes>,
}

/// Whether the peer may still send on a stream in `state` (its side is not closed).
fn recv_open(state: State) -> bool {
    matches!(state, State::Open | State::HalfClosedLocal)
}

struct General {
    link: StreamLink,
    flow: Flow,
    /// The request head's share of the core's header budget, counted while the stream is open.
    _charge: HeaderCharge,
}

thread_local! {
    /// Decoded request-head bytes of the streams open on this core's connections.
    static CORE_HEADER_BYTES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// A stream's request head counted in [`CORE_HEADER_BYTES`] until the stream leaves its
/// connection's table (however it leaves: the count goes back on drop).
struct HeaderCharge(usize);

impl HeaderCharge {
    /// Counts `bytes`, or `None` when the core is at [`HTTP2_MAX_HEADER_BYTES_PER_CORE`].
    fn take(bytes: usize) -> Option<HeaderCharge> {
        let counted = CORE_HEADER_BYTES.get();
        if counted + bytes > HTTP2_MAX_HEADER_BYTES_PER_CORE {
            return None;
        }
        CORE_HEADER_BYTES.set(counted + bytes);
        Some(HeaderCharge(bytes))
    }
}

impl Drop for HeaderCharge {
    fn drop(&mut self) {
        CORE_HEADER_BYTES.set(CORE_HEADER_BYTES.get() - self.0);
    }
}

/// A general stream's flow-control state, kept by the connection.
struct Flow {
    send_window: i64,
    recv_window: i64,
    /// Bytes read by the body and not yet returned with a stream WINDOW_UPDATE.
    unreleased: usize,
    /// Waiting in the connection's list for window.
    blocked: bool,
}

/// Where the connection is in its life.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    /// Waiting for the client preface and its SETTINGS.
    Preface,
    Open,
    /// SIGTERM: GOAWAY (all streams) and a PING sent; on its ACK the final GOAWAY follows.
    DrainAnnounced,
    /// Final GOAWAY sent: finishing the streams below it.
    Draining,
    /// Writing what is left (a GOAWAY), then closing.
    Closing,
}

/// A header block arriving in CONTINUATION frames.
struct PendingBlock {
    stream: u32,
    end_stream: bool,
    /// The HEADERS frame's priority named the stream itself (§5.3.1).
    self_dependent: bool,
    block: BytesMut,
}

/// The task a stream opened in this read batch is to get, started at the batch's end unless
/// the stream was reset by then. Held in a reused vector: the variants' sizes cost no
/// allocation, where boxing the larger would cost one per stream.
#[allow(clippy::large_enum_variant)]
enum Start<L> {
    General {
        head: HeaderList,
        req: http::Request<RecvHalf>,
        respond: Responder,
    },
    Later {
        later: L,
        respond: Responder,
    },
}

impl<L> Start<L> {
    fn respond(&self) -> &Responder {
        match self {
            Start::General { respond, .. } | Start::Later { respond, .. } => respond,
        }
    }
}

/// Serves HTTP/2 on `io` until the peer closes, a connection error, or the drain after SIGTERM.
pub async fn serve<S, H>(io: S, service: H)
where
    S: AsyncRead + AsyncWrite + Unpin,
    H: Service,
{
    let mut conn = Connection::new(io, service);
    let mut shutdown = pin!(crate::runtime::shutdown_requested());
    poll_fn(|cx| {
        if matches!(conn.phase, Phase::Open | Phase::Preface)
            && shutdown.as_mut().poll(cx).is_ready()
        {
            conn.start_drain();
        }
        conn.poll_turn(cx)
    })
    .await;
    conn.reset_all(Reason::CANCEL);
}

struct Connection<S, H: Service> {
    io: S,
    service: H,
    phase: Phase,
    read_buf: BytesMut,
    out: BytesMut,
    /// Decoded header lists are cut out of this buffer.
    arena: BytesMut,
    /// Inline answers are encoded here before framing.
    answer: BytesMut,
    hpack: Decoder,
    streams: StreamTable,
    pending_block: Option<PendingBlock>,
    last_stream: u32,
    /// Streams closed recently and how: a late frame's reaction depends on it (§5.1).
    closed: ClosedStreams,
    peer_initial_window: i64,
    peer_max_frame: usize,
    send_window: i64,
    recv_window: i64,
    /// Connection-level bytes consumed and not yet returned with a WINDOW_UPDATE.
    recv_unreleased: usize,
    wakeups: Arc<Mutex<Wakeups>>,
    /// Response body bytes queued on this connection's streams (shared with their links).
    queued: Arc<AtomicUsize>,
    visit: Vec<u32>,
    blocked: Vec<u32>,
    /// Inline candidates whose message is parked until the end of the read batch.
    parked_streams: Vec<u32>,
    /// One clone per live general-path task (bounds them, reset or not).
    tasks: Arc<()>,
    /// Tasks of streams opened in this read batch, started at its end.
    starting: Vec<Start<H::Later>>,
    /// Frames this turn may still handle.
    turn_frames_left: usize,
    /// When this turn first read the clock (at its 16th frame).
    turn_clock: Option<Instant>,
    /// This turn was cut by [`HTTP2_TURN_TIME`] (not by the frame count).
    turn_out_of_time: bool,
    guard: FloodGuard,
    /// The one timer: the earliest of the instants below.
    timer: Option<Pin<Box<glommio::timer::Timer>>>,
    timer_at: Option<Instant>,
    next_ping: Instant,
    ping_ack_by: Option<Instant>,
    /// When the connection closes if it is not over by then: the preface timeout, then the
    /// drain's or the close's.
    close_at: Option<Instant>,
    /// The preface is read and the peer's first frame, which must be SETTINGS, has not come.
    awaiting_settings: bool,
    peer_goaway: bool,
    wrote: bool,
}

impl<S: AsyncRead + AsyncWrite + Unpin, H: Service> Connection<S, H> {
    fn new(io: S, service: H) -> Self {
        let now = Instant::now();
        // Buffers start small and grow with the traffic: an idle connection costs little.
        let mut out = BytesMut::with_capacity(1024);
        frame::put_settings(
            &mut out,
            &[
                (setting::MAX_CONCURRENT_STREAMS, MAX_CONCURRENT_STREAMS),
                (setting::INITIAL_WINDOW_SIZE, HTTP2_STREAM_WINDOW_BYTES),
                (setting::MAX_HEADER_LIST_SIZE, HTTP2_MAX_HEADER_LIST_BYTES),
            ],
        );
        let grow = i64::from(HTTP2_CONNECTION_WINDOW_BYTES) - frame::DEFAULT_WINDOW;
        if grow > 0 {
            frame::put_window_update(&mut out, 0, grow as u32);
        }
        Connection {
            io,
            service,
            phase: Phase::Preface,
            read_buf: BytesMut::new(),
            out,
            arena: BytesMut::new(),
            answer: BytesMut::new(),
            hpack: Decoder::new(HTTP2_MAX_HEADER_LIST_BYTES as usize),
            streams: StreamTable::default(),
            pending_block: None,
            last_stream: 0,
            closed: ClosedStreams::default(),
            peer_initial_window: frame::DEFAULT_WINDOW,
            peer_max_frame: frame::DEFAULT_MAX_FRAME_BYTES as usize,
            send_window: frame::DEFAULT_WINDOW,
            recv_window: i64::from(HTTP2_CONNECTION_WINDOW_BYTES).max(frame::DEFAULT_WINDOW),
            recv_unreleased: 0,
            wakeups: Arc::default(),
            queued: Arc::default(),
            visit: Vec::new(),
            blocked: Vec::new(),
            parked_streams: Vec::new(),
            tasks: Arc::new(()),
            starting: Vec::new(),
            turn_frames_left: HTTP2_FRAMES_PER_TURN,
            turn_clock: None,
            turn_out_of_time: false,
            guard: FloodGuard::default(),
            timer: None,
            timer_at: None,
            next_ping: now + HTTP2_KEEPALIVE_INTERVAL,
            ping_ack_by: None,
            close_at: Some(now + HTTP2_PREFACE_TIMEOUT),
            awaiting_settings: true,
            peer_goaway: false,
            wrote: true,
        }
    }

    /// One turn: read and handle frames, serve the general streams, write; `Ready` once the
    /// connection is over.
    fn poll_turn(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.turn_frames_left = HTTP2_FRAMES_PER_TURN;
        self.turn_clock = None;
        self.turn_out_of_time = false;
        for _ in 0..ROUNDS_PER_TURN {
            let mut progressed = match self.read_and_handle(cx) {
                Ok(p) => p,
                Err(Closed) => return Poll::Ready(()),
            };
            progressed |= self.visit_streams();
            progressed |= self.visit_streams_waiting_for_room();
            self.release_connection_window();
            match self.flush(cx) {
                Ok(p) => progressed |= p,
                Err(Closed) => return Poll::Ready(()),
            }
            if self.finished() {
                return Poll::Ready(());
            }
            if self.turn_frames_left == 0 {
                // Frames may be left in the read buffer: the yield below comes back for them.
                crate::metrics::record_limit_hit(if self.turn_out_of_time {
                    "http2_turn_time"
                } else {
                    "http2_frames_per_turn"
                });
                break;
            }
            if !progressed {
                if self.has_general_streams() && self.register_wakeups(cx) {
                    continue;
                }
                return match self.poll_timers(cx) {
                    Ok(()) => Poll::Pending,
                    Err(Closed) => Poll::Ready(()),
                };
            }
        }
        // Busy: yield to the core's other tasks (its I/O is polled at least every
        // `CORE_PREEMPT_TIMER`), but keep the timers (a drain under load).
        cx.waker().wake_by_ref();
        match self.poll_timers(cx) {
            Ok(()) => Poll::Pending,
            Err(Closed) => Poll::Ready(()),
        }
    }
}

/// The connection is over (closed by the peer, an I/O error, or a finished close).
struct Closed;

impl<S, H: Service> Connection<S, H> {
    /// Whether this turn has handled frames for [`HTTP2_TURN_TIME`], `handled` frames into it;
    /// the clock is read every [`HTTP2_TURN_CLOCK_EVERY`] frames only, from the 16th on, and the
    /// turn is not cut before [`HTTP2_TURN_MIN_FRAMES`].
    fn turn_time_up(&mut self, handled: usize) -> bool {
        const CLOCK_FROM: usize = 16;
        if handled < CLOCK_FROM || !handled.is_multiple_of(HTTP2_TURN_CLOCK_EVERY) {
            return false;
        }
        let now = Instant::now();
        let started = *self.turn_clock.get_or_insert(now);
        handled >= HTTP2_TURN_MIN_FRAMES && now.duration_since(started) >= HTTP2_TURN_TIME
    }
}

/// Bytes asked of the socket per read.
const READ_CHUNK: usize = 64 * 1024;

thread_local! {
    /// This core's read scratch, borrowed only inside one read (zeroed once, not per read).
    static READ_SCRATCH: std::cell::RefCell<Box<[u8]>> =
        std::cell::RefCell::new(vec![0u8; READ_CHUNK].into_boxed_slice());
}

impl<S: AsyncRead + AsyncWrite + Unpin, H: Service> Connection<S, H> {
    /// Handles every whole frame buffered, then reads once more if the output has room.
    fn read_and_handle(&mut self, cx: &mut Context<'_>) -> Result<bool, Closed> {
        if self.phase == Phase::Closing || self.out.len() >= HTTP2_WRITE_BUFFER_BYTES {
            return Ok(false);
        }
        let mut progressed = self.handle_buffered();
        if self.phase == Phase::Closing
            || self.out.len() >= HTTP2_WRITE_BUFFER_BYTES
            || self.turn_frames_left == 0
        {
            return Ok(progressed);
        }
        let polled = READ_SCRATCH.with_borrow_mut(|scratch| {
            let polled = Pin::new(&mut self.io).poll_read(cx, scratch);
            if let Poll::Ready(Ok(n)) = polled {
                self.read_buf.extend_from_slice(&scratch[..n]);
            }
            polled
        });
        match polled {
            Poll::Pending => {}
            Poll::Ready(Err(_)) => return Err(Closed),
            Poll::Ready(Ok(0)) => {
                // The peer closed its side: what is already answered is still written.
                self.phase = Phase::Closing;
                self.close_at = Some(Instant::now() + CLOSE_FLUSH_TIMEOUT);
                self.reset_all(Reason::CANCEL);
                return Ok(true);
            }
            Poll::Ready(Ok(_)) => {
                progressed = true;
                self.handle_buffered();
            }
        }
        Ok(progressed)
    }

    /// Handles the whole frames in the read buffer. Returns whether any was handled.
    fn handle_buffered(&mut self) -> bool {
        if self.phase == Phase::Preface && !self.take_preface() {
            return false;
        }
        let handled_before = HTTP2_FRAMES_PER_TURN - self.turn_frames_left;
        let (whole, frames) = self.whole_frames_len(self.turn_frames_left);
        self.turn_frames_left -= frames;
        if whole > 0 {
            let frames = self.read_buf.split_to(whole).freeze();
            let mut at = 0;
            let mut handled = handled_before;
            while at < frames.len() && self.phase != Phase::Closing {
                if self.turn_time_up(handled) {
                    self.out_of_time(&frames[at..]);
                    // The batch goes on in the next turn: its streams' tasks start at its end.
                    return true;
                }
                let head = FrameHeader::parse(&frames[at..]);
                let body = at + frame::HEADER_BYTES;
                at = body + head.len;
                handled += 1;
                if let Err(ConnError(reason)) = self.on_frame(head, frames.slice(body..at)) {
                    self.close_with(reason);
                }
            }
            self.release_parked();
            self.start_tasks();
        }
        let oversize = self.read_buf.len() >= frame::HEADER_BYTES
            && FrameHeader::parse(&self.read_buf).len > frame::DEFAULT_MAX_FRAME_BYTES as usize;
        if oversize && self.phase != Phase::Closing {
            self.close_with(Reason::FRAME_SIZE_ERROR);
        }
        whole > 0
    }

    /// The turn's time is up with `unhandled` frames of the batch left: they go back to the
    /// front of the read buffer (a copy, on this path only) and the turn ends.
    fn out_of_time(&mut self, unhandled: &[u8]) {
        let mut rest = BytesMut::with_capacity(unhandled.len() + self.read_buf.len());
        rest.extend_from_slice(unhandled);
        rest.extend_from_slice(&self.read_buf);
        self.read_buf = rest;
        self.turn_frames_left = 0;
        self.turn_out_of_time = true;
    }

    /// Consumes the client preface once it is all in; a wrong one closes the connection.
    fn take_preface(&mut self) -> bool {
        let n = self.read_buf.len().min(frame::PREFACE.len());
        if self.read_buf[..n] != frame::PREFACE[..n] {
            self.close_with(Reason::PROTOCOL_ERROR);
            return false;
        }
        if n < frame::PREFACE.len() {
            return false;
        }
        self.read_buf.advance(n);
        self.phase = Phase::Open;
        true
    }

    /// The length and count of the whole frames at the front of the read buffer, at most
    /// `max_frames` (stopping at an oversize frame's header, which `on_frame` rejects).
    fn whole_frames_len(&self, max_frames: usize) -> (usize, usize) {
        let buf = &self.read_buf[..];
        let mut at = 0;
        let mut frames = 0;
        while buf.len() - at >= frame::HEADER_BYTES && frames < max_frames {
            let head = FrameHeader::parse(&buf[at..]);
            if head.len > frame::DEFAULT_MAX_FRAME_BYTES as usize {
                // Rejected by the caller (FRAME_SIZE_ERROR) once the frames before it are handled.
                return (at, frames);
            }
            if buf.len() - at - frame::HEADER_BYTES < head.len {
                break;
            }
            at += frame::HEADER_BYTES + head.len;
            frames += 1;
        }
        (at, frames)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin, H: Service> Connection<S, H> {
    /// Handles one frame (RFC 9113 §6); a peer past a [`FloodGuard`] bound is a connection
    /// error.
    fn on_frame(&mut self, head: FrameHeader, payload: Bytes) -> Result<(), ConnError> {
        self.dispatch_frame(head, payload)?;
        self.guard.error_resets().map_err(|limit| self.calm(limit))
    }

    fn dispatch_frame(&mut self, head: FrameHeader, payload: Bytes) -> Result<(), ConnError> {
        if let Some(pending) = &self.pending_block
            && (head.kind != kind::CONTINUATION || head.stream != pending.stream)
        {
            return Err(ConnError(Reason::PROTOCOL_ERROR));
        }
        if self.awaiting_settings && self.phase == Phase::Open {
            // The first frame after the preface must be SETTINGS (§3.4).
            if head.kind != kind::SETTINGS || head.has(flag::ACK) {
                return Err(ConnError(Reason::PROTOCOL_ERROR));
            }
            self.awaiting_settings = false;
            self.close_at = None;
        }
        match head.kind {
            kind::DATA => self.on_data(head, payload),
            kind::HEADERS => self.on_headers(head, payload),
            kind::CONTINUATION => self.on_continuation(head, payload),
            kind::PRIORITY => self.on_priority(head, &payload),
            kind::RST_STREAM => self.on_rst_stream(head, &payload),
            kind::SETTINGS => self.on_settings(head, &payload),
            kind::PING => self.on_ping(head, &payload),
            kind::GOAWAY => self.on_goaway(head, &payload),
            kind::WINDOW_UPDATE => self.on_window_update(head, &payload),
            kind::PUSH_PROMISE => Err(ConnError(Reason::PROTOCOL_ERROR)),
            // Unknown frame types are ignored (§5.5).
            _ => Ok(()),
        }
    }

    fn on_settings(&mut self, head: FrameHeader, payload: &[u8]) -> Result<(), ConnError> {
        if head.stream != 0 {
            return Err(ConnError(Reason::PROTOCOL_ERROR));
        }
        if head.has(flag::ACK) {
            return if payload.is_empty() {
                Ok(())
            } else {
                Err(ConnError(Reason::FRAME_SIZE_ERROR))
            };
        }
        if !payload.len().is_multiple_of(6) {
            return Err(ConnError(Reason::FRAME_SIZE_ERROR));
        }
        self.guard.settings().map_err(|limit| self.calm(limit))?;
        for entry in payload.chunks_exact(6) {
            let id = u16::from_be_bytes([entry[0], entry[1]]);
            let value = u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]);
            match id {
                setting::ENABLE_PUSH if value > 1 => return Err(ConnError(Reason::PROTOCOL_ERROR)),
                setting::INITIAL_WINDOW_SIZE => {
                    if i64::from(value) > frame::MAX_WINDOW {
                        return Err(ConnError(Reason::FLOW_CONTROL_ERROR));
                    }
                    self.set_peer_initial_window(i64::from(value))?;
                }
                setting::MAX_FRAME_SIZE => {
                    if !(frame::DEFAULT_MAX_FRAME_BYTES..=frame::MAX_FRAME_SIZE_LIMIT)
                        .contains(&value)
                    {
                        return Err(ConnError(Reason::PROTOCOL_ERROR));
                    }
                    self.peer_max_frame = value as usize;
                }
                // HEADER_TABLE_SIZE: responses use no dynamic table, so any size is honoured.
                // MAX_CONCURRENT_STREAMS: the server opens none. MAX_HEADER_LIST_SIZE: advisory.
                _ => {}
            }
        }
        frame::put_settings_ack(&mut self.out);
        Ok(())
    }

    /// A new SETTINGS_INITIAL_WINDOW_SIZE changes every open stream's send window (§6.9.2).
    fn set_peer_initial_window(&mut self, value: i64) -> Result<(), ConnError> {
        let delta = value - self.peer_initial_window;
        self.peer_initial_window = value;
        for (id, stream) in self.streams.iter_mut() {
            let window = match &mut stream.path {
                Path::General(g) => {
                    if delta > 0 && g.flow.blocked {
                        g.flow.blocked = false;
                        self.visit.push(*id);
                    }
                    &mut g.flow.send_window
                }
                Path::Inline(inline) => &mut inline.send_window,
            };
            *window += delta;
            if *window > frame::MAX_WINDOW {
                return Err(ConnError(Reason::FLOW_CONTROL_ERROR));
            }
        }
        Ok(())
    }

    fn on_ping(&mut self, head: FrameHeader, payload: &[u8]) -> Result<(), ConnError> {
        if head.stream != 0 {
            return Err(ConnError(Reason::PROTOCOL_ERROR));
        }
        let Ok(data) = <[u8; 8]>::try_from(payload) else {
            return Err(ConnError(Reason::FRAME_SIZE_ERROR));
        };
        if !head.has(flag::ACK) {
            self.guard.ping().map_err(|limit| self.calm(limit))?;
            frame::put_ping(&mut self.out, true, data);
        } else if data == KEEPALIVE_PING {
            self.ping_ack_by = None;
        } else if data == DRAIN_PING && self.phase == Phase::DrainAnnounced {
            self.final_goaway();
        }
        Ok(())
    }

    fn on_goaway(&mut self, head: FrameHeader, payload: &[u8]) -> Result<(), ConnError> {
        if head.stream != 0 {
            return Err(ConnError(Reason::PROTOCOL_ERROR));
        }
        if payload.len() < 8 {
            return Err(ConnError(Reason::FRAME_SIZE_ERROR));
        }
        // The peer opens no more streams; the open ones are finished, then the connection ends.
        self.peer_goaway = true;
        Ok(())
    }

    /// PRIORITY: its size and a stream depending on itself (§5.3.1) are stream errors; in
    /// any state it is otherwise taken and changes nothing (priorities are not used).
    fn on_priority(&mut self, head: FrameHeader, payload: &[u8]) -> Result<(), ConnError> {
        if head.stream == 0 {
            return Err(ConnError(Reason::PROTOCOL_ERROR));
        }
        self.guard.priority().map_err(|limit| self.calm(limit))?;
        if payload.len() != 5 {
            self.reset_stream(head.stream, Reason::FRAME_SIZE_ERROR);
            return Ok(());
        }
        if dependency(payload) == head.stream {
            self.reset_stream(head.stream, Reason::PROTOCOL_ERROR);
            return Ok(());
        }
        match self.streams.get_mut(&head.stream) {
            Some(stream) => stream.state = transition(stream.state, Event::RecvPriority).0,
            None => self.off_table(head.stream, Event::RecvPriority)?,
        }
        Ok(())
    }

    fn on_rst_stream(&mut self, head: FrameHeader, payload: &[u8]) -> Result<(), ConnError> {
        if head.stream == 0 {
            return Err(ConnError(Reason::PROTOCOL_ERROR));
        }
        if head.stream > self.last_stream {
            // Idle: a connection error (§5.1).
            return self.off_table(head.stream, Event::RecvRstStream);
        }
        let Ok(code) = <[u8; 4]>::try_from(payload) else {
            return Err(ConnError(Reason::FRAME_SIZE_ERROR));
        };
        let reason = Reason(u32::from_be_bytes(code));
        match self.streams.remove(&head.stream) {
            Some(stream) => {
                let request_ended = !recv_open(stream.state);
                self.close_removed(head.stream, stream, Event::RecvRstStream, reason);
                if !request_ended {
                    self.guard.peer_reset().map_err(|limit| self.calm(limit))?;
                }
            }
            None => self.off_table(head.stream, Event::RecvRstStream)?,
        }
        Ok(())
    }

    fn on_window_update(&mut self, head: FrameHeader, payload: &[u8]) -> Result<(), ConnError> {
        let Ok(bytes) = <[u8; 4]>::try_from(payload) else {
            return Err(ConnError(Reason::FRAME_SIZE_ERROR));
        };
        let increment = i64::from(u32::from_be_bytes(bytes) & 0x7fff_ffff);
        self.guard
            .window_update()
            .map_err(|limit| self.calm(limit))?;
        if head.stream == 0 {
            if increment == 0 {
                return Err(ConnError(Reason::PROTOCOL_ERROR));
            }
            self.send_window += increment;
            if self.send_window > frame::MAX_WINDOW {
                return Err(ConnError(Reason::FLOW_CONTROL_ERROR));
            }
            self.unblock_all();
            return Ok(());
        }
        let Some(stream) = self.streams.get_mut(&head.stream) else {
            // Idle: a connection error; closed: ignored (§6.9).
            return self.off_table(head.stream, Event::RecvWindowUpdate);
        };
        // Every open or half-closed state takes it unchanged.
        let (state, _) = transition(stream.state, Event::RecvWindowUpdate);
        stream.state = state;
        if increment == 0 {
            self.reset_stream(head.stream, Reason::PROTOCOL_ERROR);
            return Ok(());
        }
        let (window, blocked) = match &mut stream.path {
            Path::General(g) => (&mut g.flow.send_window, Some(&mut g.flow.blocked)),
            Path::Inline(inline) => (&mut inline.send_window, None),
        };
        *window += increment;
        if *window > frame::MAX_WINDOW {
            self.reset_stream(head.stream, Reason::FLOW_CONTROL_ERROR);
        } else if let Some(blocked) = blocked
            && *blocked
        {
            *blocked = false;
            self.visit.push(head.stream);
        }
        Ok(())
    }

    /// A frame on a stream that is not in the table: idle (above the highest id the peer
    /// used), or closed, as [`ClosedStreams`] remembers it or forgotten. Applies the table's
    /// reaction: a connection error, or RST_STREAM (which changes no record: the stream is
    /// closed already), or nothing.
    fn off_table(&mut self, id: u32, event: Event) -> Result<(), ConnError> {
        let state = if id > self.last_stream {
            State::Idle
        } else {
            State::Closed(self.closed.cause_of(id).unwrap_or(Cause::Forgotten))
        };
        match transition(state, event).1 {
            Reaction::Connection(reason) => Err(ConnError(reason)),
            Reaction::Stream(reason) => {
                frame::put_rst_stream(&mut self.out, id, reason);
                self.guard.reset_sent(reason);
                Ok(())
            }
            Reaction::Accept | Reaction::Ignore => Ok(()),
        }
    }

    fn unblock_all(&mut self) {
        for id in self.blocked.drain(..) {
            if let Some(Stream {
                path: Path::General(g),
                ..
            }) = self.streams.get_mut(&id)
            {
                g.flow.blocked = false;
                self.visit.push(id);
            }
        }
    }

    fn on_headers(&mut self, head: FrameHeader, payload: Bytes) -> Result<(), ConnError> {
        if head.stream == 0 || head.stream.is_multiple_of(2) {
            return Err(ConnError(Reason::PROTOCOL_ERROR));
        }
        let Some((start, end)) = frame::unpad(&payload, head.has(flag::PADDED)) else {
            return Err(ConnError(Reason::PROTOCOL_ERROR));
        };
        let (start, self_dependent) = if head.has(flag::PRIORITY) {
            let dependent = payload.get(start..start + 5).map(dependency);
            (start + 5, dependent == Some(head.stream))
        } else {
            (start, false)
        };
        if start > end {
            return Err(ConnError(Reason::PROTOCOL_ERROR));
        }
        let fragment = &payload[start..end];
        let end_stream = head.has(flag::END_STREAM);
        self.guard
            .payload_frame(fragment.is_empty() && !head.has(flag::END_HEADERS))
            .map_err(|limit| self.calm(limit))?;
        if head.has(flag::END_HEADERS) {
            return self.on_header_block(head.stream, end_stream, self_dependent, fragment);
        }
        if fragment.len() > HTTP2_MAX_HEADER_BLOCK_BYTES {
            return Err(self.calm("http2_header_block_bytes"));
        }
        self.pending_block = Some(PendingBlock {
            stream: head.stream,
            end_stream,
            self_dependent,
            block: BytesMut::from(fragment),
        });
        Ok(())
    }

    fn on_continuation(&mut self, head: FrameHeader, payload: Bytes) -> Result<(), ConnError> {
        let Some(mut pending) = self.pending_block.take() else {
            return Err(ConnError(Reason::PROTOCOL_ERROR));
        };
        self.guard
            .payload_frame(payload.is_empty() && !head.has(flag::END_HEADERS))
            .map_err(|limit| self.calm(limit))?;
        if pending.block.len() + payload.len() > HTTP2_MAX_HEADER_BLOCK_BYTES {
            return Err(self.calm("http2_header_block_bytes"));
        }
        pending.block.extend_from_slice(&payload);
        if !head.has(flag::END_HEADERS) {
            self.pending_block = Some(pending);
            return Ok(());
        }
        let PendingBlock {
            stream,
            end_stream,
            self_dependent,
            block,
        } = pending;
        self.on_header_block(stream, end_stream, self_dependent, &block)
    }

    /// A peer over a bound: counted, then GOAWAY ENHANCE_YOUR_CALM.
    fn calm(&self, limit: Exceeded) -> ConnError {
        crate::metrics::record_limit_hit(limit);
        ConnError(Reason::ENHANCE_YOUR_CALM)
    }

    /// A complete header block: a new request, or one on a stream already used (trailers, or
    /// a frame the stream's state refuses). Decoded first whatever follows: the HPACK state is
    /// the connection's (§4.3).
    fn on_header_block(
        &mut self,
        id: u32,
        end_stream: bool,
        self_dependent: bool,
        block: &[u8],
    ) -> Result<(), ConnError> {
        let is_new = id > self.last_stream;
        let decoded = self
            .hpack
            .decode(block, !is_new, &mut self.arena)
            .map_err(|_| ConnError(Reason::COMPRESSION_ERROR))?;
        if !is_new {
            return self.on_trailers(id, end_stream, self_dependent, decoded);
        }
        self.last_stream = id;
        self.guard.stream_opened();
        if id == LAST_STREAM_ID {
            // The peer spent its stream ids (a new stream needs a new connection).
            crate::metrics::record_limit_hit("http2_stream_ids");
        }
        // Idle to open, or to half-closed (remote) with END_STREAM.
        let (state, _) = transition(State::Idle, Event::RecvHeaders { end_stream });
        let list = match decoded {
            Decoded::List(list) => list,
            Decoded::Malformed => {
                self.reset_unlisted(id, state, Reason::PROTOCOL_ERROR);
                return Ok(());
            }
            Decoded::TooLarge => {
                crate::metrics::record_limit_hit("http2_header_list_bytes");
                self.answer_status(id, state, http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
                return Ok(());
            }
        };
        let length = ContentLength::new(list.content_length());
        // A stream depending on itself (§5.3.1), or a request ended with less than its
        // content-length (§8.1.1): stream errors, the request is not served.
        if self_dependent || (end_stream && !length.complete()) {
            self.reset_unlisted(id, state, Reason::PROTOCOL_ERROR);
            return Ok(());
        }
        let Some(charge) = self.admit_stream(id, state, &list) else {
            return Ok(());
        };
        if !end_stream && self.service.is_inline(&list) {
            let recv_window = i64::from(HTTP2_STREAM_WINDOW_BYTES);
            self.streams.insert(
                id,
                Stream {
                    state,
                    length,
                    path: Path::Inline(InlineStream {
                        head: list,
                        charge,
                        recv_window,
                        send_window: self.peer_initial_window,
                        parked: None,
                    }),
                },
            );
            return Ok(());
        }
        let send_window = self.peer_initial_window;
        let opened = Opened {
            state,
            length,
            send_window,
            charge,
        };
        self.start_general(id, list, Bytes::new(), opened);
        Ok(())
    }

    /// Whether a new stream may open (draining, the stream and task bounds, queued answers,
    /// the core's header budget); refused streams are reset with REFUSED_STREAM. Returns the
    /// stream's share of the header budget.
    fn admit_stream(&mut self, id: u32, state: State, list: &HeaderList) -> Option<HeaderCharge> {
        if self.phase == Phase::Draining || self.peer_goaway {
            self.reset_unlisted(id, state, Reason::REFUSED_STREAM);
            return None;
        }
        let live_tasks = Arc::strong_count(&self.tasks) - 1;
        if self.streams.len() >= MAX_CONCURRENT_STREAMS as usize
            || live_tasks >= 2 * MAX_CONCURRENT_STREAMS as usize
        {
            crate::metrics::record_limit_hit("http2_concurrent_streams");
            self.reset_unlisted(id, state, Reason::REFUSED_STREAM);
            return None;
        }
        // A peer that does not read its answers gets no new ones: past the bound, new streams
        // are refused (retryable, and a gateway fails open) until the queued answers drain.
        if self.queued.load(Ordering::Relaxed) >= HTTP2_MAX_QUEUED_RESPONSE_BYTES {
            crate::metrics::record_limit_hit("http2_queued_response_bytes");
            self.reset_unlisted(id, state, Reason::REFUSED_STREAM);
            return None;
        }
        // Streams that send a head and then nothing hold it: the heads of a core's open streams
        // are bounded together, past which new streams are refused.
        let charge = HeaderCharge::take(list.byte_len());
        if charge.is_none() {
            crate::metrics::record_limit_hit("http2_header_bytes_per_core");
            self.reset_unlisted(id, state, Reason::REFUSED_STREAM);
        }
        charge
    }

    /// A header block on a stream already used: trailers ending an open request, or what the
    /// stream's state makes of it (§5.1: STREAM_CLOSED once the peer ended its side, whether
    /// or not the answer has gone; dropped after this server's reset).
    fn on_trailers(
        &mut self,
        id: u32,
        end_stream: bool,
        self_dependent: bool,
        decoded: Decoded,
    ) -> Result<(), ConnError> {
        let event = Event::RecvHeaders { end_stream };
        let Some(stream) = self.streams.get(&id) else {
            return self.off_table(id, event);
        };
        match transition(stream.state, event).1 {
            Reaction::Stream(reason) => {
                self.reset_stream(id, reason);
                return Ok(());
            }
            Reaction::Connection(reason) => return Err(ConnError(reason)),
            Reaction::Accept | Reaction::Ignore => {}
        }
        let trailers = match decoded {
            Decoded::List(list) if !self_dependent && stream.length.complete() => {
                list.to_header_map()
            }
            _ => None,
        };
        let Some(trailers) = trailers else {
            self.reset_stream(id, Reason::PROTOCOL_ERROR);
            return Ok(());
        };
        if let Path::Inline(_) = stream.path {
            self.inline_to_general(id);
        }
        self.end_general_body(id, Some(trailers));
        Ok(())
    }

    fn on_data(&mut self, head: FrameHeader, payload: Bytes) -> Result<(), ConnError> {
        let end_stream = head.has(flag::END_STREAM);
        let event = Event::RecvData { end_stream };
        if head.stream == 0 {
            return Err(ConnError(Reason::PROTOCOL_ERROR));
        }
        if head.stream > self.last_stream {
            // Idle: a connection error.
            return self.off_table(head.stream, event);
        }
        let flow = payload.len() as i64;
        self.recv_window -= flow;
        if self.recv_window < 0 {
            return Err(ConnError(Reason::FLOW_CONTROL_ERROR));
        }
        let Some((start, end)) = frame::unpad(&payload, head.has(flag::PADDED)) else {
            return Err(ConnError(Reason::PROTOCOL_ERROR));
        };
        // Padding is consumed at once; the data when it is read.
        let padding = payload.len() - (end - start);
        self.recv_unreleased += padding;
        let data = payload.slice(start..end);
        self.guard
            .payload_frame(data.is_empty() && !end_stream)
            .map_err(|limit| self.calm(limit))?;
        let Some(stream) = self.streams.get_mut(&head.stream) else {
            // Closed: STREAM_CLOSED, or dropped after our reset (§6.1, §5.1).
            self.recv_unreleased += data.len();
            return self.off_table(head.stream, event);
        };
        let window = match &mut stream.path {
            Path::Inline(inline) => &mut inline.recv_window,
            Path::General(g) => &mut g.flow.recv_window,
        };
        *window -= flow;
        let reset = match transition(stream.state, event).1 {
            Reaction::Stream(reason) => Some(reason),
            _ if *window < 0 => Some(Reason::FLOW_CONTROL_ERROR),
            // More than the content-length, or a different total at the end: malformed.
            _ if !stream.length.on_data(data.len(), end_stream) => Some(Reason::PROTOCOL_ERROR),
            _ => None,
        };
        if let Some(reason) = reset {
            self.recv_unreleased += data.len();
            self.reset_stream(head.stream, reason);
            return Ok(());
        }
        match &mut stream.path {
            Path::Inline(_) => self.on_inline_data(head.stream, data, end_stream),
            Path::General(g) => {
                let mut s = g.link.lock();
                let dropped = s.recv_dropped;
                if dropped {
                    // Nobody reads it: its window goes back on the stream's next visit.
                    s.released += data.len();
                } else {
                    s.received.extend_from_slice(&data);
                }
                if let Some(waker) = s.recv_waker.take() {
                    waker.wake();
                }
                drop(s);
                if end_stream {
                    self.end_general_body(head.stream, None);
                }
                if dropped && !self.visit.contains(&head.stream) {
                    self.visit.push(head.stream);
                }
            }
        }
        self.return_stream_padding(head.stream, padding, end_stream);
        Ok(())
    }

    /// Padding counts against the stream's window but is never read, so it goes back to the
    /// peer at once (RFC 9113 §6.1), as it does for the connection; otherwise a stream of
    /// padded frames stalls for good.
    fn return_stream_padding(&mut self, id: u32, padding: usize, end_stream: bool) {
        if padding == 0 || end_stream {
            return;
        }
        let Some(stream) = self.streams.get_mut(&id) else {
            return;
        };
        let window = match &mut stream.path {
            Path::Inline(inline) => &mut inline.recv_window,
            Path::General(g) if recv_open(stream.state) => &mut g.flow.recv_window,
            Path::General(_) => return,
        };
        *window += padding as i64;
        frame::put_window_update(&mut self.out, id, padding as u32);
    }

    /// DATA on an inline candidate: answered now when it is the whole body; anything else
    /// moves the stream to the general path with what arrived.
    fn on_inline_data(&mut self, id: u32, data: Bytes, end_stream: bool) {
        let Some(Stream {
            path: Path::Inline(inline),
            ..
        }) = self.streams.get_mut(&id)
        else {
            unreachable!("called for inline streams")
        };
        if !end_stream && data.is_empty() {
            return;
        }
        if !end_stream && inline.parked.is_none() {
            inline.parked = Some(data);
            self.parked_streams.push(id);
            return;
        }
        let (mut opened, head, parked) = self.take_inline(id);
        let data = match parked {
            None => data,
            Some(parked) if data.is_empty() => parked,
            Some(parked) => {
                // Split over DATA frames: rare, so the copy is fine.
                let mut joined = BytesMut::from(&parked[..]);
                joined.extend_from_slice(&data);
                joined.freeze()
            }
        };
        let len = data.len();
        if !end_stream {
            self.start_general(id, head, data, opened);
            return;
        }
        // Open to half-closed (remote).
        opened.state = transition(opened.state, Event::RecvData { end_stream }).0;
        self.answer.clear();
        match self
            .service
            .answer_inline(&head, data.clone(), &mut self.answer)
        {
            Inline::Answered => {
                self.recv_unreleased += len;
                self.write_inline_answer(id, opened);
            }
            Inline::Later(later) => {
                self.recv_unreleased += len;
                self.start_later(id, later, opened);
            }
            Inline::General => self.start_general(id, head, data, opened),
        }
    }

    /// Gives an inline request the service answers later (its body read whole) a responder:
    /// from here it is a general stream whose request has ended.
    fn start_later(&mut self, id: u32, later: H::Later, opened: Opened) {
        let link = self.link(id);
        link.lock().recv_ended = true;
        let respond = Responder::new(
            link.clone(),
            HTTP2_MAX_SEND_BUFFER_BYTES,
            self.tasks.clone(),
        );
        self.insert_general(id, link, opened);
        self.starting.push(Start::Later { later, respond });
    }

    /// Writes an inline answer now when the windows allow (the stream closes), else queues it
    /// like a general stream's response.
    fn write_inline_answer(&mut self, id: u32, opened: Opened) {
        let len = self.answer.len() as i64;
        if len <= self.send_window
            && len <= opened.send_window
            && self.answer.len() <= self.peer_max_frame
        {
            self.send_window -= len;
            frame::put_headers(
                &mut self.out,
                id,
                H::INLINE_HEAD,
                false,
                self.peer_max_frame,
            );
            frame::put_data(&mut self.out, id, &self.answer, false);
            self.guard.data_frames_sent(1);
            frame::put_headers(
                &mut self.out,
                id,
                H::INLINE_TRAILERS,
                true,
                self.peer_max_frame,
            );
            self.record_closed(id, opened.state, &[Event::SendEndStream]);
            return;
        }
        let link = self.link(id);
        {
            let mut s = link.lock();
            s.recv_ended = true;
            s.send_ended = true;
            s.outgoing.push_back(Outgoing::Headers {
                block: Bytes::from_static(H::INLINE_HEAD),
                end: false,
            });
            s.queued_bytes = self.answer.len();
            self.queued.fetch_add(self.answer.len(), Ordering::Relaxed);
            s.outgoing.push_back(Outgoing::Data {
                bytes: self.answer.split().freeze(),
                end: false,
            });
            s.outgoing.push_back(Outgoing::Headers {
                block: Bytes::from_static(H::INLINE_TRAILERS),
                end: true,
            });
        }
        self.insert_general(id, link, opened);
        self.visit.push(id);
    }

    fn link(&self, id: u32) -> StreamLink {
        StreamLink {
            id,
            shared: Arc::new(Mutex::new(Shared::default())),
            wakeups: self.wakeups.clone(),
            queued: self.queued.clone(),
        }
    }

    fn insert_general(&mut self, id: u32, link: StreamLink, opened: Opened) {
        self.streams.insert(
            id,
            Stream {
                state: opened.state,
                length: opened.length,
                path: Path::General(General {
                    link,
                    flow: Flow {
                        send_window: opened.send_window,
                        recv_window: i64::from(HTTP2_STREAM_WINDOW_BYTES),
                        unreleased: 0,
                        blocked: false,
                    },
                    _charge: opened.charge,
                }),
            },
        );
    }

    /// Hands a request to the general path, with the body bytes that already arrived.
    fn start_general(&mut self, id: u32, head: HeaderList, received: Bytes, opened: Opened) {
        let Some(builder) = head.to_request() else {
            self.recv_unreleased += received.len();
            self.reset_unlisted(id, opened.state, Reason::PROTOCOL_ERROR);
            return;
        };
        let end_stream = !recv_open(opened.state);
        let link = self.link(id);
        {
            let mut s = link.lock();
            s.received.extend_from_slice(&received);
            s.recv_ended = end_stream;
        }
        let Ok(req) = builder.body(RecvHalf::new(link.clone())) else {
            self.reset_unlisted(id, opened.state, Reason::PROTOCOL_ERROR);
            return;
        };
        let respond = Responder::new(
            link.clone(),
            HTTP2_MAX_SEND_BUFFER_BYTES,
            self.tasks.clone(),
        );
        self.insert_general(id, link, opened);
        if let Some(Stream {
            path: Path::General(g),
            ..
        }) = self.streams.get_mut(&id)
        {
            g.flow.recv_window -= received.len() as i64;
        }
        self.starting.push(Start::General { head, req, respond });
    }

    /// At the end of a read batch: the tasks of the streams it opened start, but for streams
    /// reset since (by the peer, by this server over a later frame of the batch, or by the
    /// connection closing), which get none: their reset costs no work.
    fn start_tasks(&mut self) {
        if self.starting.is_empty() {
            return;
        }
        let mut starting = std::mem::take(&mut self.starting);
        for start in starting.drain(..) {
            if start.respond().is_reset() {
                continue;
            }
            match start {
                Start::General { head, req, respond } => {
                    self.service.serve_general(&head, req, respond)
                }
                Start::Later { later, respond } => self.service.answer_later(later, respond),
            }
        }
        self.starting = starting;
    }

    /// The request of a general stream ended (END_STREAM, with trailers or not): the stream
    /// is half-closed (remote).
    fn end_general_body(&mut self, id: u32, trailers: Option<http::HeaderMap>) {
        let Some(Stream {
            state,
            path: Path::General(g),
            ..
        }) = self.streams.get_mut(&id)
        else {
            return;
        };
        *state = transition(*state, Event::RecvData { end_stream: true }).0;
        let mut s = g.link.lock();
        s.recv_ended = true;
        s.trailers = trailers;
        if let Some(waker) = s.recv_waker.take() {
            waker.wake();
        }
    }

    /// A trailers-only answer with an HTTP status to a new stream in `state` (a request
    /// refused before the service).
    fn answer_status(&mut self, id: u32, state: State, status: http::StatusCode) {
        let mut block = BytesMut::new();
        super::headers::encode_response_head(status, &http::HeaderMap::new(), &mut block);
        frame::put_headers(&mut self.out, id, &block, true, self.peer_max_frame);
        if recv_open(state) {
            // The peer may stop sending the body (§8.1).
            frame::put_rst_stream(&mut self.out, id, Reason::NO_ERROR);
            self.record_closed(id, state, &[Event::SendEndStream, Event::SendReset]);
        } else {
            self.record_closed(id, state, &[Event::SendEndStream]);
        }
    }

    /// RST_STREAM: the stream ends here (its task, if any, sees the reset). On a stream not in
    /// the table only the frame is sent: it is idle or closed already.
    fn reset_stream(&mut self, id: u32, reason: Reason) {
        frame::put_rst_stream(&mut self.out, id, reason);
        self.guard.reset_sent(reason);
        if let Some(stream) = self.streams.remove(&id) {
            self.close_removed(id, stream, Event::SendReset, reason);
        }
    }

    /// RST_STREAM on a stream just opened in `state` and never put in the table.
    fn reset_unlisted(&mut self, id: u32, state: State, reason: Reason) {
        frame::put_rst_stream(&mut self.out, id, reason);
        self.guard.reset_sent(reason);
        self.record_closed(id, state, &[Event::SendReset]);
    }

    /// A stream taken out of the table on `event` (a reset either way): its task sees
    /// `reason`, the body bytes it held go back to the connection window, and how it closed is
    /// recorded.
    fn close_removed(&mut self, id: u32, stream: Stream, event: Event, reason: Reason) {
        match stream.path {
            Path::General(g) => {
                self.recv_unreleased += unreleased_of(&g);
                end_shared(&g.link, reason);
            }
            Path::Inline(inline) => {
                self.recv_unreleased += inline.parked.map_or(0, |p| p.len());
            }
        }
        self.record_closed(id, stream.state, &[event]);
    }

    /// Moves a stream in `state` through `events` and, once closed, records how (§5.1).
    fn record_closed(&mut self, id: u32, mut state: State, events: &[Event]) {
        for &event in events {
            state = transition(state, event).0;
        }
        if let State::Closed(cause) = state {
            self.closed.record(id, cause);
        }
    }

    /// At the end of a read batch: inline candidates still waiting for the end of their stream
    /// go to the general path with the message they hold, so no read buffer stays pinned.
    fn release_parked(&mut self) {
        for id in std::mem::take(&mut self.parked_streams) {
            if let Some(Stream {
                path:
                    Path::Inline(InlineStream {
                        parked: Some(_), ..
                    }),
                ..
            }) = self.streams.get(&id)
            {
                self.inline_to_general(id);
            }
        }
    }

    /// Takes an inline candidate out of the table: what opened it, its head and its parked
    /// message.
    fn take_inline(&mut self, id: u32) -> (Opened, HeaderList, Option<Bytes>) {
        let Some(Stream {
            state,
            length,
            path: Path::Inline(inline),
        }) = self.streams.remove(&id)
        else {
            unreachable!("stream {id} is an inline candidate")
        };
        let opened = Opened {
            state,
            length,
            send_window: inline.send_window,
            charge: inline.charge,
        };
        (opened, inline.head, inline.parked)
    }

    /// Moves an inline candidate to the general path, with its parked message if any.
    fn inline_to_general(&mut self, id: u32) {
        let (opened, head, parked) = self.take_inline(id);
        self.start_general(id, head, parked.unwrap_or_default(), opened);
    }
}

/// What a stream carries from one path to another: its state, its content-length accounting,
/// its send window and its share of the core's header budget.
struct Opened {
    state: State,
    length: ContentLength,
    send_window: i64,
    charge: HeaderCharge,
}

/// The stream a PRIORITY frame's (or a HEADERS frame's priority block's) five bytes depend on.
fn dependency(priority: &[u8]) -> u32 {
    u32::from_be_bytes([priority[0], priority[1], priority[2], priority[3]]) & 0x7fff_ffff
}

/// The body bytes a general stream took from the connection window and has not returned: read
/// but not yet moved to the connection's count, and received but never read. Counted once:
/// they are taken here. (`Flow::unreleased` is the stream window's share of bytes the
/// connection already counted.)
fn unreleased_of(g: &General) -> usize {
    let mut s = g.link.lock();
    let n = s.released + s.received.len();
    s.released = 0;
    s.received = BytesMut::new();
    s.recv_dropped = true;
    n
}

/// Moves the body bytes a stream's task has read into the stream's returned count, sending a
/// stream WINDOW_UPDATE once half its window is back (while the peer may still send).
/// Returns the bytes for the connection's window.
fn return_read_window(
    id: u32,
    recv_open: bool,
    flow: &mut Flow,
    s: &mut Shared,
    out: &mut BytesMut,
) -> usize {
    let released = std::mem::take(&mut s.released);
    flow.unreleased += released;
    if recv_open && flow.unreleased >= HTTP2_STREAM_WINDOW_BYTES as usize / 2 {
        frame::put_window_update(out, id, flow.unreleased as u32);
        flow.recv_window += flow.unreleased as i64;
        flow.unreleased = 0;
    }
    released
}

/// What writing a stream's queued response needs of its connection.
struct SendState<'a> {
    out: &'a mut BytesMut,
    connection_window: &'a mut i64,
    queued: &'a AtomicUsize,
    max_frame: usize,
    /// DATA frames written.
    data_frames: u64,
}

impl SendState<'_> {
    /// Frames a stream's queued response as far as the windows and the output buffer allow.
    /// Returns `Some(None)` once the response is complete, `Some(Some(reason))` once reset.
    fn write_queued(&mut self, id: u32, flow: &mut Flow, s: &mut Shared) -> Option<Option<Reason>> {
        while let Some(next) = s.outgoing.front_mut() {
            if self.out.len() >= HTTP2_WRITE_BUFFER_BYTES {
                return None;
            }
            let ended = match next {
                Outgoing::Headers { block, end } => {
                    frame::put_headers(self.out, id, block, *end, self.max_frame);
                    end.then_some(None)
                }
                Outgoing::Data { bytes, end } => {
                    let window = (*self.connection_window).min(flow.send_window).max(0) as usize;
                    let n = bytes.len().min(window).min(self.max_frame);
                    if n == 0 && !bytes.is_empty() {
                        flow.blocked = true;
                        return None;
                    }
                    let chunk = bytes.split_to(n);
                    let last = bytes.is_empty();
                    frame::put_data(self.out, id, &chunk, *end && last);
                    self.data_frames += 1;
                    *self.connection_window -= n as i64;
                    flow.send_window -= n as i64;
                    s.queued_bytes -= n;
                    let before = self.queued.fetch_sub(n, Ordering::Relaxed);
                    debug_assert!(before >= n, "queued answer bytes went below zero");
                    if !last {
                        continue;
                    }
                    end.then_some(None)
                }
                Outgoing::Reset(reason) => {
                    frame::put_rst_stream(self.out, id, *reason);
                    Some(Some(*reason))
                }
            };
            s.outgoing.pop_front();
            if ended.is_some() {
                return ended;
            }
        }
        None
    }
}

/// Ends both halves of a general stream with `reason` and wakes its task.
fn end_shared(link: &StreamLink, reason: Reason) {
    let mut s = link.lock();
    s.reset.get_or_insert(reason);
    s.outgoing.clear();
    let before = link.queued.fetch_sub(s.queued_bytes, Ordering::Relaxed);
    debug_assert!(
        before >= s.queued_bytes,
        "queued answer bytes went below zero"
    );
    s.queued_bytes = 0;
    if let Some(waker) = s.recv_waker.take() {
        waker.wake();
    }
    if let Some(waker) = s.send_waker.take() {
        waker.wake();
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin, H: Service> Connection<S, H> {
    /// Whether any general-path stream's halves are alive (each holds a clone of the wake-up
    /// list): a connection serving only inline calls never takes the wake-up lock.
    fn has_general_streams(&self) -> bool {
        Arc::strong_count(&self.wakeups) > 1
    }

    /// Leaves the connection's waker for the general streams' tasks before the connection
    /// sleeps. Returns whether a stream already has something new (then it must not sleep).
    fn register_wakeups(&mut self, cx: &mut Context<'_>) -> bool {
        let mut w = self.wakeups.lock().unwrap_or_else(|e| e.into_inner());
        if !w
            .connection
            .as_ref()
            .is_some_and(|k| k.will_wake(cx.waker()))
        {
            w.connection = Some(cx.waker().clone());
        }
        !w.streams.is_empty()
    }

    /// Serves the general streams that have something new: returned window, queued output.
    fn visit_streams(&mut self) -> bool {
        if self.has_general_streams() {
            let mut w = self.wakeups.lock().unwrap_or_else(|e| e.into_inner());
            self.visit.append(&mut w.streams);
        }
        if self.visit.is_empty() {
            return false;
        }
        let mut visit = std::mem::take(&mut self.visit);
        let mut progressed = false;
        for id in visit.drain(..) {
            if self.out.len() >= HTTP2_WRITE_BUFFER_BYTES {
                // Visited again once the output drained.
                self.visit.push(id);
                continue;
            }
            progressed |= self.visit_stream(id);
        }
        if self.visit.is_empty() {
            self.visit = visit;
        }
        progressed
    }

    /// Once the queued answers are below their bound, the streams whose task waited for room
    /// are visited (which wakes them) next round. Returns whether there were any.
    fn visit_streams_waiting_for_room(&mut self) -> bool {
        if !self.has_general_streams()
            || self.queued.load(Ordering::Relaxed) >= HTTP2_MAX_QUEUED_RESPONSE_BYTES
        {
            return false;
        }
        let mut w = self.wakeups.lock().unwrap_or_else(|e| e.into_inner());
        let any = !w.waiting_for_room.is_empty();
        for id in w.waiting_for_room.drain(..) {
            if !self.visit.contains(&id) {
                self.visit.push(id);
            }
        }
        any
    }

    /// Moves one stream's returned window and queued output to the wire. Returns whether
    /// anything was written.
    fn visit_stream(&mut self, id: u32) -> bool {
        let Some(Stream {
            state,
            path: Path::General(g),
            ..
        }) = self.streams.get_mut(&id)
        else {
            return false;
        };
        let recv_open = recv_open(*state);
        let written_before = self.out.len();
        let mut guard = g.link.lock();
        let s = &mut *guard;
        s.scheduled = false;
        self.recv_unreleased += return_read_window(id, recv_open, &mut g.flow, s, &mut self.out);
        let mut send = SendState {
            out: &mut self.out,
            connection_window: &mut self.send_window,
            queued: &self.queued,
            max_frame: self.peer_max_frame,
            data_frames: 0,
        };
        let ended = send.write_queued(id, &mut g.flow, s);
        self.guard.data_frames_sent(send.data_frames);
        if g.flow.blocked && !self.blocked.contains(&id) {
            self.blocked.push(id);
        }
        if !s.outgoing.is_empty() && self.out.len() >= HTTP2_WRITE_BUFFER_BYTES {
            // Visited again once the output drained.
            self.visit.push(id);
        }
        if s.queued_bytes < HTTP2_MAX_SEND_BUFFER_BYTES
            && let Some(waker) = s.send_waker.take()
        {
            waker.wake();
        }
        drop(guard);
        let wrote = self.out.len() > written_before;
        if let Some(reset) = ended {
            self.end_sent_stream(id, reset);
        }
        wrote
    }

    /// The response of a general stream is complete (`None`) or was reset (`Some`): the stream
    /// leaves the table, and a peer still sending is told to stop (§8.1: half-closed (local),
    /// then RST_STREAM NO_ERROR).
    fn end_sent_stream(&mut self, id: u32, reset: Option<Reason>) {
        let Some(Stream {
            path: Path::General(_),
            ..
        }) = self.streams.get(&id)
        else {
            return;
        };
        let Some(stream) = self.streams.remove(&id) else {
            return;
        };
        if let Some(reason) = reset {
            self.close_removed(id, stream, Event::SendReset, reason);
            return;
        }
        let (state, _) = transition(stream.state, Event::SendEndStream);
        if state == State::HalfClosedLocal {
            frame::put_rst_stream(&mut self.out, id, Reason::NO_ERROR);
            let stream = Stream { state, ..stream };
            self.close_removed(id, stream, Event::SendReset, Reason::NO_ERROR);
            return;
        }
        if let Path::General(g) = &stream.path {
            self.recv_unreleased += unreleased_of(g);
        }
        self.record_closed(id, state, &[]);
    }

    /// Returns consumed bytes to the peer's connection window, half a window at a time.
    fn release_connection_window(&mut self) {
        if self.recv_unreleased >= HTTP2_CONNECTION_WINDOW_BYTES as usize / 2 {
            frame::put_window_update(&mut self.out, 0, self.recv_unreleased as u32);
            self.recv_window += self.recv_unreleased as i64;
            self.recv_unreleased = 0;
        }
    }

    /// Writes the output buffer. Returns whether bytes left.
    fn flush(&mut self, cx: &mut Context<'_>) -> Result<bool, Closed> {
        let mut progressed = false;
        while !self.out.is_empty() {
            match Pin::new(&mut self.io).poll_write(cx, &self.out) {
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Err(Closed),
                Poll::Ready(Ok(n)) => {
                    self.out.advance(n);
                    self.wrote = true;
                    progressed = true;
                }
                Poll::Pending => return Ok(progressed),
            }
        }
        if self.wrote {
            match Pin::new(&mut self.io).poll_flush(cx) {
                Poll::Ready(Ok(())) => self.wrote = false,
                Poll::Ready(Err(_)) => return Err(Closed),
                Poll::Pending => {}
            }
        }
        Ok(progressed)
    }

    /// Whether the connection is done: closing with everything written, or drained.
    fn finished(&self) -> bool {
        let idle = self.out.is_empty() && !self.wrote;
        match self.phase {
            Phase::Closing => idle,
            Phase::Draining => idle && self.streams.is_empty(),
            _ => self.peer_goaway && idle && self.streams.is_empty(),
        }
    }

    /// Keep-alive pings and the close time; arms the one timer for the earliest.
    fn poll_timers(&mut self, cx: &mut Context<'_>) -> Result<(), Closed> {
        let now = Instant::now();
        if self.close_at.is_some_and(|d| now >= d) {
            if self.phase == Phase::Preface || self.phase == Phase::Open {
                tracing::debug!("grpc_preface_timeout");
            }
            return Err(Closed);
        }
        if self.ping_ack_by.is_some_and(|d| now >= d) {
            tracing::debug!("grpc_keepalive_timeout");
            return Err(Closed);
        }
        if now >= self.next_ping && self.phase != Phase::Closing {
            frame::put_ping(&mut self.out, false, KEEPALIVE_PING);
            self.next_ping = now + HTTP2_KEEPALIVE_INTERVAL;
            self.ping_ack_by
                .get_or_insert(now + HTTP2_KEEPALIVE_TIMEOUT);
            cx.waker().wake_by_ref();
        }
        let wake_at = [Some(self.next_ping), self.ping_ack_by, self.close_at]
            .into_iter()
            .flatten()
            .min()
            .expect("the next ping is always set");
        if self.timer_at != Some(wake_at) {
            let timer = self
                .timer
                .get_or_insert_with(|| Box::pin(glommio::timer::Timer::new(wake_at - now)));
            timer.reset(wake_at.saturating_duration_since(now));
            self.timer_at = Some(wake_at);
            let _ = timer.as_mut().poll(cx);
        }
        Ok(())
    }

    /// A connection error: GOAWAY, then close once it is written (or after a short bound).
    fn close_with(&mut self, reason: Reason) {
        if self.phase == Phase::Closing {
            return;
        }
        if self.phase != Phase::Preface {
            frame::put_goaway(&mut self.out, self.last_stream, reason);
        }
        self.phase = Phase::Closing;
        self.pending_block = None;
        self.close_at = Some(Instant::now() + CLOSE_FLUSH_TIMEOUT);
        self.reset_all(reason);
    }

    /// SIGTERM: announce the drain with GOAWAY for every stream and a PING; the final GOAWAY
    /// goes out with its ACK, so requests already in flight are not refused (§6.8).
    fn start_drain(&mut self) {
        if self.phase == Phase::Preface {
            self.phase = Phase::Closing;
            self.close_at = Some(Instant::now());
            return;
        }
        frame::put_goaway(&mut self.out, 0x7fff_ffff, Reason::NO_ERROR);
        frame::put_ping(&mut self.out, false, DRAIN_PING);
        self.phase = Phase::DrainAnnounced;
        self.close_at = Some(Instant::now() + DRAIN_TIMEOUT);
    }

    fn final_goaway(&mut self) {
        frame::put_goaway(&mut self.out, self.last_stream, Reason::NO_ERROR);
        self.phase = Phase::Draining;
    }

    /// Ends every open stream (the connection is going away).
    fn reset_all(&mut self, reason: Reason) {
        for (_, stream) in self.streams.drain() {
            if let Path::General(g) = stream.path {
                end_shared(&g.link, reason);
            }
        }
    }
}
