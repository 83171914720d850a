//! HTTP/2 frames (RFC 9113 §4, §6): the 9-byte header, the frame types and flags this server
//! handles, and writers that append whole frames to a connection's output buffer.

use bytes::{BufMut, BytesMut};

/// Length of every frame header.
pub const HEADER_BYTES: usize = 9;
/// The client connection preface (RFC 9113 §3.4).
pub const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// SETTINGS_MAX_FRAME_SIZE's initial value, and the largest frame this server accepts.
pub const DEFAULT_MAX_FRAME_BYTES: u32 = 16_384;
/// Largest SETTINGS_MAX_FRAME_SIZE a peer may announce (2^24 - 1).
pub const MAX_FRAME_SIZE_LIMIT: u32 = (1 << 24) - 1;
/// The initial flow-control window of every stream and of the connection (RFC 9113 §6.9.2).
pub const DEFAULT_WINDOW: i64 = 65_535;
/// Largest flow-control window (2^31 - 1).
pub const MAX_WINDOW: i64 = (1 << 31) - 1;

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

/// SETTINGS identifiers (RFC 9113 §6.5.2).
pub mod setting {
    pub const ENABLE_PUSH: u16 = 0x2;
    pub const MAX_CONCURRENT_STREAMS: u16 = 0x3;
    pub const INITIAL_WINDOW_SIZE: u16 = 0x4;
    pub const MAX_FRAME_SIZE: u16 = 0x5;
    pub const MAX_HEADER_LIST_SIZE: u16 = 0x6;
}

/// Error codes (RFC 9113 §7).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reason(pub u32);

impl Reason {
    pub const NO_ERROR: Reason = Reason(0x0);
    pub const PROTOCOL_ERROR: Reason = Reason(0x1);
    pub const INTERNAL_ERROR: Reason = Reason(0x2);
    pub const FLOW_CONTROL_ERROR: Reason = Reason(0x3);
    pub const STREAM_CLOSED: Reason = Reason(0x5);
    pub const FRAME_SIZE_ERROR: Reason = Reason(0x6);
    pub const REFUSED_STREAM: Reason = Reason(0x7);
    pub const CANCEL: Reason = Reason(0x8);
    pub const COMPRESSION_ERROR: Reason = Reason(0x9);
    pub const ENHANCE_YOUR_CALM: Reason = Reason(0xb);
}

/// A parsed frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub len: usize,
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
}

impl FrameHeader {
    /// Parses the header at the start of `buf` (at least [`HEADER_BYTES`] long).
    pub fn parse(buf: &[u8]) -> FrameHeader {
        debug_assert!(buf.len() >= HEADER_BYTES);
        FrameHeader {
            len: (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]),
            kind: buf[3],
            flags: buf[4],
            stream: u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]) & 0x7fff_ffff,
        }
    }

    pub fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }
}

/// Appends a frame header.
pub fn put_header(out: &mut BytesMut, len: usize, kind: u8, flags: u8, stream: u32) {
    debug_assert!(len <= MAX_FRAME_SIZE_LIMIT as usize);
    debug_assert!(stream <= 0x7fff_ffff);
    out.put_u8((len >> 16) as u8);
    out.put_u16(len as u16);
    out.put_u8(kind);
    out.put_u8(flags);
    out.put_u32(stream);
}

/// Appends a header block as HEADERS plus CONTINUATION frames of at most `max_frame` bytes.
pub fn put_headers(
    out: &mut BytesMut,
    stream: u32,
    block: &[u8],
    end_stream: bool,
    max_frame: usize,
) {
    let mut chunks = block.chunks(max_frame.max(1)).peekable();
    let first = chunks.next().unwrap_or(&[]);
    let end = if end_stream { flag::END_STREAM } else { 0 };
    let last = chunks.peek().is_none();
    let end_headers = if last { flag::END_HEADERS } else { 0 };
    put_header(out, first.len(), kind::HEADERS, end | end_headers, stream);
    out.put_slice(first);
    while let Some(chunk) = chunks.next() {
        let end_headers = if chunks.peek().is_none() {
            flag::END_HEADERS
        } else {
            0
        };
        put_header(out, chunk.len(), kind::CONTINUATION, end_headers, stream);
        out.put_slice(chunk);
    }
}

/// Appends one DATA frame.
pub fn put_data(out: &mut BytesMut, stream: u32, data: &[u8], end_stream: bool) {
    let flags = if end_stream { flag::END_STREAM } else { 0 };
    put_header(out, data.len(), kind::DATA, flags, stream);
    out.put_slice(data);
}

pub fn put_rst_stream(out: &mut BytesMut, stream: u32, reason: Reason) {
    put_header(out, 4, kind::RST_STREAM, 0, stream);
    out.put_u32(reason.0);
}

pub fn put_window_update(out: &mut BytesMut, stream: u32, increment: u32) {
    debug_assert!(increment > 0 && i64::from(increment) <= MAX_WINDOW);
    put_header(out, 4, kind::WINDOW_UPDATE, 0, stream);
    out.put_u32(increment);
}

pub fn put_ping(out: &mut BytesMut, ack: bool, payload: [u8; 8]) {
    put_header(out, 8, kind::PING, if ack { flag::ACK } else { 0 }, 0);
    out.put_slice(&payload);
}

pub fn put_goaway(out: &mut BytesMut, last_stream: u32, reason: Reason) {
    put_header(out, 8, kind::GOAWAY, 0, 0);
    out.put_u32(last_stream);
    out.put_u32(reason.0);
}

pub fn put_settings(out: &mut BytesMut, settings: &[(u16, u32)]) {
    put_header(out, settings.len() * 6, kind::SETTINGS, 0, 0);
    for (id, value) in settings {
        out.put_u16(*id);
        out.put_u32(*value);
    }
}

pub fn put_settings_ack(out: &mut BytesMut) {
    put_header(out, 0, kind::SETTINGS, flag::ACK, 0);
}

/// The payload of a frame with the PADDED flag, without its pad-length byte and padding;
/// `None` when the padding does not fit (a PROTOCOL_ERROR).
pub fn unpad(payload: &[u8], padded: bool) -> Option<(usize, usize)> {
    if !padded {
        return Some((0, payload.len()));
    }
    let pad = usize::from(*payload.first()?);
    let end = payload.len().checked_sub(pad)?;
    (end >= 1).then_some((1, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let mut out = BytesMut::new();
        put_header(&mut out, 0x01_02_03, kind::HEADERS, 0x25, 0x7fff_fffe);
        let h = FrameHeader::parse(&out);
        assert_eq!(
            h,
            FrameHeader {
                len: 0x01_02_03,
                kind: kind::HEADERS,
                flags: 0x25,
                stream: 0x7fff_fffe
            }
        );
    }

    #[test]
    fn the_reserved_stream_bit_is_ignored() {
        let buf = [0, 0, 0, kind::DATA, 0, 0x80, 0, 0, 3];
        assert_eq!(FrameHeader::parse(&buf).stream, 3);
    }

    #[test]
    fn large_header_blocks_continue() {
        let mut out = BytesMut::new();
        let block = vec![7u8; 25];
        put_headers(&mut out, 1, &block, true, 10);
        let first = FrameHeader::parse(&out);
        assert_eq!((first.len, first.kind), (10, kind::HEADERS));
        assert!(first.has(flag::END_STREAM) && !first.has(flag::END_HEADERS));
        let second = FrameHeader::parse(&out[19..]);
        assert_eq!(
            (second.len, second.kind, second.flags),
            (10, kind::CONTINUATION, 0)
        );
        let third = FrameHeader::parse(&out[38..]);
        assert_eq!((third.len, third.kind), (5, kind::CONTINUATION));
        assert!(third.has(flag::END_HEADERS));
        assert_eq!(out.len(), 3 * 9 + 25);
    }

    #[test]
    fn padding_is_checked() {
        assert_eq!(unpad(b"abc", false), Some((0, 3)));
        assert_eq!(unpad(&[2, b'a', 0, 0], true), Some((1, 2)));
        assert_eq!(unpad(&[3, b'a', 0, 0], true), Some((1, 1)), "all padding");
        assert_eq!(
            unpad(&[4, b'a', 0, 0], true),
            None,
            "pad reaches the length byte"
        );
        assert_eq!(unpad(&[0], true), Some((1, 1)));
        assert_eq!(unpad(&[], true), None);
    }
}
