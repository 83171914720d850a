//! A frame-level HTTP/2 client for wire-behaviour scenarios (tests/e2e/http2_wire.rs): a raw
//! TCP connection to the gRPC port on which the test writes hand-built frames (9-byte header +
//! payload, RFC 9113 §4.1) and reads the server's frames back, parsed.
//!
//! Request header blocks are HPACK "literal without indexing, new name" fields (RFC 7541 §6.2.2:
//! `0x00`, length, name, length, value; no Huffman), which is exact and needs no encoder state.
//! The server's header blocks are decoded with one `loona-hpack` decoder per connection, in the
//! order they arrive, CONTINUATION frames joined first. Every read is bounded in time
//! ([`READ_TIMEOUT`] unless the caller gives its own), every write too ([`WRITE_TIMEOUT`]), and
//! every loop here in count.
//!
//! Imported explicitly (`use crate::support::frames::*;`): its short names (`data`, `ping`, …)
//! would crowd the other modules' glob import.

use std::collections::HashMap;
use std::io;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The client connection preface (RFC 9113 §3.4).
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// How long one read waits for a frame before the scenario fails (or, where the caller asks
/// for it, concludes that nothing more is coming).
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one write may block before it is reported as [`io::ErrorKind::TimedOut`].
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest frame payload every HTTP/2 peer accepts (SETTINGS_MAX_FRAME_SIZE's initial value).
pub const DEFAULT_MAX_FRAME: usize = 16_384;
/// Every flow-control window's initial size (RFC 9113 §6.9.2).
pub const DEFAULT_WINDOW: i64 = 65_535;
/// The largest legal flow-control window (2^31 - 1).
pub const MAX_WINDOW: i64 = (1 << 31) - 1;
/// Bound on the frames any one helper reads before it gives up (no loop is unbounded).
const MAX_FRAMES_PER_WAIT: usize = 200_000;
/// Bound on the CONTINUATION frames joined into one server header block.
const MAX_CONTINUATIONS: usize = 1_024;

/// Frame types (RFC 9113 §6).
pub mod kind {
    pub const DATA: u8 = 0x0;
    pub const HEADERS: u8 = 0x1;
    pub const PRIORITY: u8 = 0x2;
    pub const RST_STREAM: u8 = 0x3;
    pub const SETTINGS: u8 = 0x4;
    pub const PUSH_PROMISE: u8 = 0x5;
    pub const PING: u8 = 0x6;
    pub const GOAWAY: u8 = 0x7;
    pub const WINDOW_UPDATE: u8 = 0x8;
    pub const CONTINUATION: u8 = 0x9;
}

/// Frame flags (RFC 9113 §6).
pub mod flag {
    pub const END_STREAM: u8 = 0x1;
    pub const ACK: u8 = 0x1;
    pub const END_HEADERS: u8 = 0x4;
    pub const PADDED: u8 = 0x8;
    pub const PRIORITY: u8 = 0x20;
}

/// Error codes (RFC 9113 §7).
pub mod code {
    pub const NO_ERROR: u32 = 0x0;
    pub const PROTOCOL_ERROR: u32 = 0x1;
    pub const INTERNAL_ERROR: u32 = 0x2;
    pub const FLOW_CONTROL_ERROR: u32 = 0x3;
    pub const SETTINGS_TIMEOUT: u32 = 0x4;
    pub const STREAM_CLOSED: u32 = 0x5;
    pub const FRAME_SIZE_ERROR: u32 = 0x6;
    pub const REFUSED_STREAM: u32 = 0x7;
    pub const CANCEL: u32 = 0x8;
    pub const COMPRESSION_ERROR: u32 = 0x9;
    pub const ENHANCE_YOUR_CALM: u32 = 0xb;
}

/// SETTINGS parameters (RFC 9113 §6.5.2).
pub mod setting {
    pub const HEADER_TABLE_SIZE: u16 = 0x1;
    pub const ENABLE_PUSH: u16 = 0x2;
    pub const MAX_CONCURRENT_STREAMS: u16 = 0x3;
    pub const INITIAL_WINDOW_SIZE: u16 = 0x4;
    pub const MAX_FRAME_SIZE: u16 = 0x5;
    pub const MAX_HEADER_LIST_SIZE: u16 = 0x6;
}

/// One frame: the 9-byte header (length, type, flags, reserved bit + stream id) and a payload
/// whose length need not match anything (so that malformed frames can be written).
pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = frame_header(payload.len(), kind, flags, stream).to_vec();
    f.extend_from_slice(payload);
    f
}

/// A frame header declaring `len` payload bytes.
pub fn frame_header(len: usize, kind: u8, flags: u8, stream: u32) -> [u8; 9] {
    let l = (len as u32).to_be_bytes();
    let s = (stream & 0x7fff_ffff).to_be_bytes();
    [l[1], l[2], l[3], kind, flags, s[0], s[1], s[2], s[3]]
}

/// A SETTINGS frame (not an ACK) with `params`.
pub fn settings(params: &[(u16, u32)]) -> Vec<u8> {
    let mut p = Vec::with_capacity(params.len() * 6);
    for (id, v) in params {
        p.extend_from_slice(&id.to_be_bytes());
        p.extend_from_slice(&v.to_be_bytes());
    }
    frame(kind::SETTINGS, 0, 0, &p)
}

/// A SETTINGS ACK.
pub fn settings_ack() -> Vec<u8> {
    frame(kind::SETTINGS, flag::ACK, 0, &[])
}

/// A PING (or PING ACK) carrying `opaque`.
pub fn ping(ack: bool, opaque: [u8; 8]) -> Vec<u8> {
    frame(kind::PING, if ack { flag::ACK } else { 0 }, 0, &opaque)
}

/// A WINDOW_UPDATE of `increment` on `stream` (0: the connection).
pub fn window_update(stream: u32, increment: u32) -> Vec<u8> {
    frame(kind::WINDOW_UPDATE, 0, stream, &increment.to_be_bytes())
}

/// A RST_STREAM with `error`.
pub fn rst_stream(stream: u32, error: u32) -> Vec<u8> {
    frame(kind::RST_STREAM, 0, stream, &error.to_be_bytes())
}

/// A GOAWAY naming `last_stream` with `error`.
pub fn goaway(last_stream: u32, error: u32) -> Vec<u8> {
    let mut p = last_stream.to_be_bytes().to_vec();
    p.extend_from_slice(&error.to_be_bytes());
    frame(kind::GOAWAY, 0, 0, &p)
}

/// A DATA frame (with END_STREAM if `end`).
pub fn data(stream: u32, payload: &[u8], end: bool) -> Vec<u8> {
    frame(
        kind::DATA,
        if end { flag::END_STREAM } else { 0 },
        stream,
        payload,
    )
}

/// A PADDED DATA frame: pad length byte, `payload`, `pad` zero bytes.
pub fn padded_data(stream: u32, payload: &[u8], pad: u8, end: bool) -> Vec<u8> {
    let mut p = vec![pad];
    p.extend_from_slice(payload);
    p.resize(p.len() + pad as usize, 0);
    let flags = flag::PADDED | if end { flag::END_STREAM } else { 0 };
    frame(kind::DATA, flags, stream, &p)
}

/// A HEADERS frame carrying the whole `block` (END_HEADERS), with END_STREAM if `end`.
pub fn headers(stream: u32, block: &[u8], end: bool) -> Vec<u8> {
    let flags = flag::END_HEADERS | if end { flag::END_STREAM } else { 0 };
    frame(kind::HEADERS, flags, stream, block)
}

/// An HPACK integer with an `n`-bit prefix whose other prefix bits are `first` (RFC 7541 §5.1).
fn hpack_int(out: &mut Vec<u8>, first: u8, n: u32, mut v: usize) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(first | v as u8);
        return;
    }
    out.push(first | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128 + 128) as u8);
        v /= 128;
    }
    out.push(v as u8);
}

/// Appends one "literal header field without indexing — new name" (RFC 7541 §6.2.2), no
/// Huffman coding.
pub fn literal_field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x00);
    hpack_int(out, 0, 7, name.len());
    out.extend_from_slice(name);
    hpack_int(out, 0, 7, value.len());
    out.extend_from_slice(value);
}

/// A header block of literal fields, in order.
pub fn header_block(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (n, v) in fields {
        literal_field(&mut out, n.as_bytes(), v.as_bytes());
    }
    out
}

/// The header fields of a gRPC call to `path`, as a production client sends them.
pub fn grpc_request_fields(path: &str) -> Vec<(&str, &str)> {
    vec![
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "127.0.0.1"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
}

/// The header block of a gRPC call to `path`.
pub fn grpc_request_block(path: &str) -> Vec<u8> {
    header_block(&grpc_request_fields(path))
}

/// A parsed frame as it came off the wire.
#[derive(Debug, Clone)]
pub struct RawFrame {
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
    pub payload: Vec<u8>,
}

/// What the server sent, frame by frame (header blocks already joined and decoded).
#[derive(Debug, Clone)]
pub enum Event {
    /// A complete header block (HEADERS + any CONTINUATION), decoded.
    Headers {
        stream: u32,
        end_stream: bool,
        fields: Vec<(String, String)>,
    },
    /// A DATA frame: `flow_len` is what it counts against flow control (padding included),
    /// `payload` the data without padding.
    Data {
        stream: u32,
        end_stream: bool,
        flow_len: usize,
        payload: Vec<u8>,
    },
    Settings {
        ack: bool,
        params: Vec<(u16, u32)>,
    },
    Ping {
        ack: bool,
        opaque: [u8; 8],
    },
    WindowUpdate {
        stream: u32,
        increment: u32,
    },
    RstStream {
        stream: u32,
        code: u32,
    },
    GoAway {
        last_stream: u32,
        code: u32,
        debug: String,
    },
    /// Any other frame type (PRIORITY, unknown extension frames).
    Other(RawFrame),
    /// The server closed the connection (EOF, or a reset after its last bytes).
    Closed,
}

/// The answer on one stream, as far as it got.
#[derive(Debug, Clone, Default)]
pub struct Reply {
    /// The response header fields (the first header block).
    pub head: Vec<(String, String)>,
    /// The DATA payloads joined (padding removed).
    pub body: Vec<u8>,
    /// The trailer fields (a second header block), if any.
    pub trailers: Option<Vec<(String, String)>>,
    /// The stream ended with END_STREAM.
    pub ended: bool,
    /// The stream was reset with this code.
    pub reset: Option<u32>,
}

/// Looks up `name` among `fields`.
pub fn field<'a>(fields: &'a [(String, String)], name: &str) -> Option<&'a str> {
    fields
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

impl Reply {
    /// The response's `:status`.
    pub fn status(&self) -> Option<&str> {
        field(&self.head, ":status")
    }

    /// `grpc-status` from the trailers, or from the head (a trailers-only response).
    pub fn grpc_status(&self) -> Option<&str> {
        self.trailers
            .as_deref()
            .and_then(|t| field(t, "grpc-status"))
            .or_else(|| field(&self.head, "grpc-status"))
    }

    /// Asserts a complete gRPC success (`:status` 200, `content-type: application/grpc`,
    /// trailers with END_STREAM and `grpc-status: 0`) and returns its one response message.
    pub fn expect_one_message(&self, what: &str) -> Vec<u8> {
        assert_eq!(self.reset, None, "[{what}] stream reset: {self:?}");
        assert!(self.ended, "[{what}] stream did not end: {self:?}");
        assert_eq!(self.status(), Some("200"), "[{what}] :status: {self:?}");
        assert_eq!(
            field(&self.head, "content-type"),
            Some("application/grpc"),
            "[{what}] content-type: {self:?}"
        );
        let trailers = self
            .trailers
            .as_deref()
            .unwrap_or_else(|| panic!("[{what}] no trailers: {self:?}"));
        assert_eq!(
            field(trailers, "grpc-status"),
            Some("0"),
            "[{what}] grpc-status: {self:?}"
        );
        let messages = super::grpc_messages(&self.body);
        assert_eq!(messages.len(), 1, "[{what}] messages: {self:?}");
        messages[0].to_vec()
    }
}

/// How a stream (or its connection) failed, for scenarios where RFC 9113 allows several.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// RST_STREAM on the stream, with this code.
    Reset(u32),
    /// GOAWAY on the connection, with this code.
    GoAway(u32),
    /// The connection closed without a GOAWAY.
    Closed,
    /// The stream was answered: its `:status` and `grpc-status` (headers or trailers).
    Answered {
        status: Option<String>,
        grpc_status: Option<String>,
    },
}

/// One raw HTTP/2 connection to the server, seen frame by frame.
pub struct FrameConn {
    tcp: TcpStream,
    /// Bytes read and not yet parsed into frames.
    buf: Vec<u8>,
    hpack: loona_hpack::Decoder<'static>,
    /// The server's SETTINGS as received so far (later values override earlier ones).
    pub server_settings: HashMap<u16, u32>,
    /// Whether DATA the server sends is given back at once (WINDOW_UPDATE on the connection,
    /// and on the stream unless it ended), so that long scenarios never stall the server on
    /// the client's receive windows. Off for the scenarios that test those windows.
    pub auto_window: bool,
    /// The client's send window on the connection (65,535 + the server's WINDOW_UPDATEs).
    pub conn_send_window: i64,
    /// Extra send window per stream granted by the server's WINDOW_UPDATEs (the initial size
    /// comes from the server's SETTINGS_INITIAL_WINDOW_SIZE).
    stream_updates: HashMap<u32, i64>,
    /// DATA bytes sent per stream (flow-controlled length).
    stream_sent: HashMap<u32, i64>,
    /// The server's GOAWAY, once one arrived.
    pub goaway: Option<u32>,
    /// EOF or a reset was seen.
    pub closed: bool,
}

impl FrameConn {
    /// A TCP connection to the gRPC port; nothing written yet.
    pub async fn connect(port: u16) -> FrameConn {
        FrameConn::connect_with(port, None).await
    }

    /// [`FrameConn::connect`] with the socket's receive buffer set to `rcvbuf` bytes (the
    /// kernel then does not grow it), for scenarios where the client stops reading and the
    /// server must feel it soon.
    pub async fn connect_with(port: u16, rcvbuf: Option<u32>) -> FrameConn {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        if let Some(n) = rcvbuf {
            socket.set_recv_buffer_size(n).expect("SO_RCVBUF");
        }
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let tcp = tokio::time::timeout(READ_TIMEOUT, socket.connect(addr))
            .await
            .expect("connect timed out")
            .expect("connect");
        let _ = tcp.set_nodelay(true);
        FrameConn {
            tcp,
            buf: Vec::new(),
            hpack: loona_hpack::Decoder::new(),
            server_settings: HashMap::new(),
            auto_window: true,
            conn_send_window: DEFAULT_WINDOW,
            stream_updates: HashMap::new(),
            stream_sent: HashMap::new(),
            goaway: None,
            closed: false,
        }
    }

    /// Connects, sends the preface and a SETTINGS frame with `params`, and reads until the
    /// server's own SETTINGS (not an ACK) arrived, which RFC 9113 §3.4 makes the first frame
    /// of its preface. The ACK of ours is not waited for.
    pub async fn start(port: u16, params: &[(u16, u32)]) -> FrameConn {
        FrameConn::start_on(FrameConn::connect(port).await, params).await
    }

    /// [`FrameConn::start`] on a connection made by the caller.
    pub async fn start_on(mut c: FrameConn, params: &[(u16, u32)]) -> FrameConn {
        let mut hello = PREFACE.to_vec();
        hello.extend_from_slice(&settings(params));
        c.write(&hello).await.expect("write preface");
        let first = c.next().await;
        assert!(
            matches!(first, Event::Settings { ack: false, .. }),
            "the server's first frame must be its SETTINGS, got {first:?}"
        );
        c
    }

    /// [`FrameConn::start`] with an empty SETTINGS frame.
    pub async fn handshake(port: u16) -> FrameConn {
        FrameConn::start(port, &[]).await
    }

    /// Writes `bytes` (bounded by [`WRITE_TIMEOUT`]).
    pub async fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        match tokio::time::timeout(WRITE_TIMEOUT, self.tcp.write_all(bytes)).await {
            Ok(r) => r,
            Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "write timed out")),
        }
    }

    /// Writes `bytes`, failing the scenario on any error.
    pub async fn send(&mut self, bytes: &[u8]) {
        self.write(bytes).await.expect("write");
    }

    /// Sends DATA on `stream` and counts it against the client's send windows.
    pub async fn send_data(&mut self, stream: u32, payload: &[u8], end: bool) {
        self.count_sent(stream, payload.len());
        self.send(&data(stream, payload, end)).await;
    }

    /// Sends `body` on `stream` as DATA frames of at most `frame_len` bytes, END_STREAM on
    /// the last, never past the server's windows: when they are spent, reads (and applies)
    /// frames until its WINDOW_UPDATEs make room. Fails the scenario if the stream is reset,
    /// the connection ends, or no room comes within [`READ_TIMEOUT`].
    pub async fn send_body_in_window(&mut self, stream: u32, body: &[u8], frame_len: usize) {
        let mut off = 0;
        for _ in 0..MAX_FRAMES_PER_WAIT {
            if off == body.len() {
                return;
            }
            let room = self
                .conn_send_window
                .min(self.stream_send_window(stream))
                .max(0) as usize;
            let n = room.min(frame_len).min(body.len() - off);
            if n == 0 {
                match self.next().await {
                    ev @ (Event::GoAway { .. } | Event::Closed) => {
                        panic!("connection ended while sending the body at {off}: {ev:?}")
                    }
                    Event::RstStream { stream: s, code } if s == stream => {
                        panic!("stream reset ({code:#x}) while sending the body at {off}")
                    }
                    _ => {}
                }
                continue;
            }
            let end = off + n == body.len();
            self.send_data(stream, &body[off..off + n], end).await;
            off += n;
        }
        panic!("send_body_in_window: frame bound reached");
    }

    /// Counts `n` flow-controlled bytes sent on `stream` (for frames written by hand).
    pub fn count_sent(&mut self, stream: u32, n: usize) {
        self.conn_send_window -= n as i64;
        *self.stream_sent.entry(stream).or_default() += n as i64;
    }

    /// The server's SETTINGS_INITIAL_WINDOW_SIZE (65,535 unless it sent one).
    pub fn server_initial_window(&self) -> i64 {
        self.server_settings
            .get(&setting::INITIAL_WINDOW_SIZE)
            .map_or(DEFAULT_WINDOW, |v| *v as i64)
    }

    /// What the client may still send on `stream` as the server's windows stand.
    pub fn stream_send_window(&self, stream: u32) -> i64 {
        self.server_initial_window() + self.stream_updates.get(&stream).copied().unwrap_or(0)
            - self.stream_sent.get(&stream).copied().unwrap_or(0)
    }

    /// The raw next frame, or `None` if none arrived within `wait`; `Err` once the connection
    /// is closed (EOF or reset).
    async fn read_raw(&mut self, wait: Duration) -> Result<Option<RawFrame>, ()> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if self.buf.len() >= 9 {
                let len = u32::from_be_bytes([0, self.buf[0], self.buf[1], self.buf[2]]) as usize;
                if self.buf.len() >= 9 + len {
                    let f = RawFrame {
                        kind: self.buf[3],
                        flags: self.buf[4],
                        stream: u32::from_be_bytes([
                            self.buf[5],
                            self.buf[6],
                            self.buf[7],
                            self.buf[8],
                        ]) & 0x7fff_ffff,
                        payload: self.buf[9..9 + len].to_vec(),
                    };
                    self.buf.drain(..9 + len);
                    return Ok(Some(f));
                }
            }
            if self.closed {
                return Err(());
            }
            // Into the heap buffer: a stack array would sit in every future awaiting this one.
            self.buf.reserve(64 * 1024);
            match tokio::time::timeout_at(deadline, self.tcp.read_buf(&mut self.buf)).await {
                Err(_) => return Ok(None),
                Ok(Ok(0)) | Ok(Err(_)) => {
                    self.closed = true;
                    return Err(());
                }
                Ok(Ok(_)) => {}
            }
        }
    }

    /// The next event within [`READ_TIMEOUT`]; fails the scenario on a timeout.
    pub async fn next(&mut self) -> Event {
        self.next_within(READ_TIMEOUT)
            .await
            .unwrap_or_else(|| panic!("no frame from the server within {READ_TIMEOUT:?}"))
    }

    /// The next event, or `None` if no frame arrived within `wait`. Header blocks are joined
    /// with their CONTINUATION frames and decoded; the server's SETTINGS are recorded and
    /// ACKed, its PINGs answered, its WINDOW_UPDATEs applied to the client's send windows,
    /// and (with [`FrameConn::auto_window`]) the DATA it sends given back.
    pub async fn next_within(&mut self, wait: Duration) -> Option<Event> {
        let f = match self.read_raw(wait).await {
            Ok(Some(f)) => f,
            Ok(None) => return None,
            Err(()) => return Some(Event::Closed),
        };
        Some(self.parse(f, wait).await)
    }

    async fn parse(&mut self, f: RawFrame, wait: Duration) -> Event {
        let p = &f.payload;
        match f.kind {
            kind::DATA => {
                let body = strip_padding(f.flags, p, 0).expect("DATA padding");
                let end_stream = f.flags & flag::END_STREAM != 0;
                if self.auto_window && !p.is_empty() && !self.closed {
                    let mut wu = window_update(0, p.len() as u32);
                    if !end_stream {
                        wu.extend_from_slice(&window_update(f.stream, p.len() as u32));
                    }
                    let _ = self.write(&wu).await;
                }
                Event::Data {
                    stream: f.stream,
                    end_stream,
                    flow_len: p.len(),
                    payload: body.to_vec(),
                }
            }
            kind::HEADERS => {
                let skip = if f.flags & flag::PRIORITY != 0 { 5 } else { 0 };
                let mut block = strip_padding(f.flags, p, skip)
                    .expect("HEADERS padding")
                    .to_vec();
                let mut end_headers = f.flags & flag::END_HEADERS != 0;
                let mut joined = 0;
                while !end_headers {
                    joined += 1;
                    assert!(
                        joined <= MAX_CONTINUATIONS,
                        "endless CONTINUATION from server"
                    );
                    let c = self
                        .read_raw(wait)
                        .await
                        .ok()
                        .flatten()
                        .expect("CONTINUATION after HEADERS without END_HEADERS");
                    assert_eq!(c.kind, kind::CONTINUATION, "expected CONTINUATION: {c:?}");
                    assert_eq!(c.stream, f.stream, "CONTINUATION on another stream");
                    block.extend_from_slice(&c.payload);
                    end_headers = c.flags & flag::END_HEADERS != 0;
                }
                let fields = self
                    .hpack
                    .decode(&block)
                    .unwrap_or_else(|e| panic!("server header block does not decode: {e:?}"))
                    .into_iter()
                    .map(|(n, v)| {
                        (
                            String::from_utf8_lossy(&n).into_owned(),
                            String::from_utf8_lossy(&v).into_owned(),
                        )
                    })
                    .collect();
                Event::Headers {
                    stream: f.stream,
                    end_stream: f.flags & flag::END_STREAM != 0,
                    fields,
                }
            }
            kind::SETTINGS => {
                let ack = f.flags & flag::ACK != 0;
                let params: Vec<(u16, u32)> = p
                    .chunks_exact(6)
                    .map(|c| {
                        (
                            u16::from_be_bytes([c[0], c[1]]),
                            u32::from_be_bytes([c[2], c[3], c[4], c[5]]),
                        )
                    })
                    .collect();
                if !ack {
                    self.server_settings.extend(params.iter().copied());
                    if !self.closed {
                        let _ = self.write(&settings_ack()).await;
                    }
                }
                Event::Settings { ack, params }
            }
            kind::PING => {
                let mut opaque = [0u8; 8];
                let n = p.len().min(8);
                opaque[..n].copy_from_slice(&p[..n]);
                let ack = f.flags & flag::ACK != 0;
                if !ack && !self.closed {
                    let _ = self.write(&ping(true, opaque)).await;
                }
                Event::Ping { ack, opaque }
            }
            kind::WINDOW_UPDATE => {
                let increment = u32::from_be_bytes([p[0], p[1], p[2], p[3]]) & 0x7fff_ffff;
                if f.stream == 0 {
                    self.conn_send_window += increment as i64;
                } else {
                    *self.stream_updates.entry(f.stream).or_default() += increment as i64;
                }
                Event::WindowUpdate {
                    stream: f.stream,
                    increment,
                }
            }
            kind::RST_STREAM => Event::RstStream {
                stream: f.stream,
                code: u32::from_be_bytes([p[0], p[1], p[2], p[3]]),
            },
            kind::GOAWAY => {
                let code = u32::from_be_bytes([p[4], p[5], p[6], p[7]]);
                self.goaway = Some(code);
                Event::GoAway {
                    last_stream: u32::from_be_bytes([p[0], p[1], p[2], p[3]]) & 0x7fff_ffff,
                    code,
                    debug: String::from_utf8_lossy(&p[8..]).into_owned(),
                }
            }
            _ => Event::Other(f),
        }
    }

    /// Reads until every stream of `ids` ended (END_STREAM or RST_STREAM) and returns their
    /// replies; frames of other streams are ignored. Fails the scenario on a timeout, a GOAWAY
    /// or the connection closing first.
    pub async fn replies(&mut self, ids: &[u32]) -> HashMap<u32, Reply> {
        self.collect(ids, false).await
    }

    /// [`FrameConn::replies`], tolerating a graceful GOAWAY (NO_ERROR) whose last stream id
    /// covers every stream of `ids` (the server may announce its own shutdown while it
    /// finishes them).
    pub async fn replies_through_goaway(&mut self, ids: &[u32]) -> HashMap<u32, Reply> {
        self.collect(ids, true).await
    }

    async fn collect(&mut self, ids: &[u32], graceful_goaway: bool) -> HashMap<u32, Reply> {
        let mut out: HashMap<u32, Reply> = ids.iter().map(|&i| (i, Reply::default())).collect();
        let mut open = ids.len();
        for _ in 0..MAX_FRAMES_PER_WAIT {
            if open == 0 {
                return out;
            }
            let ev = self.next().await;
            match &ev {
                Event::GoAway {
                    last_stream, code, ..
                } if graceful_goaway
                    && *code == code::NO_ERROR
                    && ids.iter().all(|i| i <= last_stream) => {}
                Event::GoAway { .. } | Event::Closed => {
                    panic!("connection ended before the replies: {ev:?}; so far {out:?}")
                }
                _ => {}
            }
            if let Some((_, true)) = apply_known(&mut out, ev) {
                open -= 1;
            }
        }
        panic!("replies: frame bound reached");
    }

    /// The reply on one stream ([`FrameConn::replies`]).
    pub async fn reply(&mut self, id: u32) -> Reply {
        self.replies(&[id]).await.remove(&id).unwrap()
    }

    /// Reads until `stream` fails or is answered, or the connection fails: the first of
    /// RST_STREAM on the stream, a GOAWAY, the connection closing, or the stream's complete
    /// answer. Fails the scenario if none comes within [`READ_TIMEOUT`] per frame.
    pub async fn failure(&mut self, stream: u32) -> Failure {
        let mut reply: HashMap<u32, Reply> = HashMap::from([(stream, Reply::default())]);
        for _ in 0..MAX_FRAMES_PER_WAIT {
            let ev = self.next().await;
            match ev {
                Event::RstStream { stream: s, code } if s == stream => {
                    return Failure::Reset(code);
                }
                Event::GoAway { code, .. } => return Failure::GoAway(code),
                Event::Closed => return Failure::Closed,
                ev => {
                    if let Some((s, true)) = apply_known(&mut reply, ev)
                        && s == stream
                    {
                        let r = &reply[&stream];
                        return Failure::Answered {
                            status: r.status().map(str::to_string),
                            grpc_status: r.grpc_status().map(str::to_string),
                        };
                    }
                }
            }
        }
        panic!("failure: frame bound reached");
    }

    /// Reads until a GOAWAY arrives and returns its code; then asserts that the server
    /// closes the connection within `close_within`. Fails the scenario if the connection
    /// closes without a GOAWAY or nothing comes in time.
    pub async fn expect_goaway_and_close(&mut self, close_within: Duration) -> u32 {
        let code = match self.goaway {
            Some(c) => c,
            None => self.until_goaway().await,
        };
        self.expect_close(close_within).await;
        code
    }

    /// Reads (ignoring everything else) until a GOAWAY; panics on close or timeout.
    async fn until_goaway(&mut self) -> u32 {
        for _ in 0..MAX_FRAMES_PER_WAIT {
            match self.next().await {
                Event::GoAway { code, .. } => return code,
                Event::Closed => panic!("connection closed without a GOAWAY"),
                _ => {}
            }
        }
        panic!("until_goaway: frame bound reached");
    }

    /// Asserts that the server closes the connection within `within` (frames before the close
    /// are read and dropped).
    pub async fn expect_close(&mut self, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        for _ in 0..MAX_FRAMES_PER_WAIT {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.next_within(left).await {
                Some(Event::Closed) => return,
                Some(_) => {}
                None => panic!("connection still open {within:?} after the GOAWAY"),
            }
        }
        panic!("expect_close: frame bound reached");
    }

    /// Reads whatever arrives until nothing has for `quiet` (at most `max` frames).
    pub async fn drain(&mut self, quiet: Duration, max: usize) -> Vec<Event> {
        let mut out = Vec::new();
        for _ in 0..max {
            match self.next_within(quiet).await {
                None => break,
                Some(Event::Closed) => {
                    out.push(Event::Closed);
                    break;
                }
                Some(ev) => out.push(ev),
            }
        }
        out
    }
}

/// Applies `ev` to the reply of its stream if that stream is in `replies` (others are
/// ignored). Returns the stream and whether it ended with this event.
fn apply_known(replies: &mut HashMap<u32, Reply>, ev: Event) -> Option<(u32, bool)> {
    match ev {
        Event::Headers {
            stream,
            end_stream,
            fields,
        } => {
            let r = replies.get_mut(&stream)?;
            assert!(!r.ended, "HEADERS after END_STREAM on stream {stream}");
            if r.head.is_empty() {
                r.head = fields;
            } else {
                assert!(
                    end_stream,
                    "trailers without END_STREAM on stream {stream}: {fields:?}"
                );
                r.trailers = Some(fields);
            }
            r.ended = end_stream;
            Some((stream, end_stream))
        }
        Event::Data {
            stream,
            end_stream,
            payload,
            ..
        } => {
            let r = replies.get_mut(&stream)?;
            assert!(!r.ended, "DATA after END_STREAM on stream {stream}");
            assert!(!r.head.is_empty(), "DATA before HEADERS on stream {stream}");
            r.body.extend_from_slice(&payload);
            r.ended = end_stream;
            Some((stream, end_stream))
        }
        Event::RstStream { stream, code } => {
            let r = replies.get_mut(&stream)?;
            if r.ended {
                // RST_STREAM after END_STREAM (e.g. NO_ERROR: "stop sending your body").
                return Some((stream, false));
            }
            r.reset = Some(code);
            Some((stream, true))
        }
        _ => None,
    }
}

/// The payload of a frame without its padding (and without `skip` bytes of priority fields
/// after the pad length), or `None` if the padding is longer than the frame.
fn strip_padding(flags: u8, p: &[u8], skip: usize) -> Option<&[u8]> {
    if flags & flag::PADDED == 0 {
        return p.get(skip..);
    }
    let pad = *p.first()? as usize;
    let end = p.len().checked_sub(pad)?;
    p.get(1 + skip..end)
}
