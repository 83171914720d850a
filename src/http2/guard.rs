//! Per-connection bounds on what a peer makes the server do for nothing: frames that cost a
//! turn's work and move no request forward (the HTTP/2 denial-of-service families: SETTINGS,
//! PING, PRIORITY, WINDOW_UPDATE and empty-frame floods, rapid reset), and the stream errors
//! it provokes (server-induced resets, "MadeYouReset"). Each check returns the name of the
//! limit once its bound is passed; the connection counts it
//! (`inferencecache_limit_hits_total{limit=...}`) and closes with GOAWAY ENHANCE_YOUR_CALM.
//!
//! Rates that a well-behaved client may reach over a long connection's life (control frames,
//! resets) are bounded per second; frames that only make sense alongside useful work
//! (PRIORITY, WINDOW_UPDATE) by their ratio to it, as Envoy does.

use std::time::{Duration, Instant};

use crate::limits::{
    HTTP2_MAX_CONSECUTIVE_EMPTY_FRAMES, HTTP2_MAX_PEER_RESETS_PER_SECOND,
    HTTP2_MAX_PINGS_PER_SECOND, HTTP2_MAX_PRIORITY_FRAMES_PER_STREAM,
    HTTP2_MAX_SETTINGS_PER_SECOND, HTTP2_MAX_STREAM_ERROR_RESETS,
    HTTP2_MAX_WINDOW_UPDATES_PER_DATA_FRAME,
};

use super::frame::Reason;

/// A bound passed: the limit's name (the metric's label).
pub(super) type Exceeded = &'static str;

/// WINDOW_UPDATE frames allowed before this server sent any DATA (a client's initial
/// connection and stream window increases).
const WINDOW_UPDATES_BASE: u64 = 100;

/// One connection's counts of what its peer sent and provoked.
#[derive(Default)]
pub(super) struct FloodGuard {
    streams_opened: u64,
    data_frames_sent: u64,
    priority_frames: u64,
    window_updates: u64,
    /// Frames in a row with an empty payload that ended nothing.
    empty_run: u32,
    /// Stream errors this server sent (RST_STREAM for the peer's fault).
    error_resets: u32,
    /// [`FloodGuard::data_frames_sent`] when the last PING came.
    data_frames_at_ping: u64,
    settings: PerSecond,
    pings: PerSecond,
    peer_resets: PerSecond,
}

impl FloodGuard {
    /// The peer opened a stream.
    pub(super) fn stream_opened(&mut self) {
        self.streams_opened += 1;
    }

    /// This server sent `n` DATA frames.
    pub(super) fn data_frames_sent(&mut self, n: u64) {
        self.data_frames_sent += n;
    }

    /// A SETTINGS frame (not an ACK).
    pub(super) fn settings(&mut self) -> Result<(), Exceeded> {
        over(
            self.settings.count(HTTP2_MAX_SETTINGS_PER_SECOND),
            "http2_settings_frames",
        )
    }

    /// A PING frame (not an ACK). One after this server sent DATA is not counted: a client
    /// measuring its bandwidth (grpc-go's BDP probe) pings once per round trip while it
    /// receives, as often as answers flow (grpc-go's own server forgives those pings the same
    /// way).
    pub(super) fn ping(&mut self) -> Result<(), Exceeded> {
        if self.data_frames_sent > self.data_frames_at_ping {
            self.data_frames_at_ping = self.data_frames_sent;
            return Ok(());
        }
        over(
            self.pings.count(HTTP2_MAX_PINGS_PER_SECOND),
            "http2_ping_frames",
        )
    }

    /// The peer reset a stream whose request it had not ended (rapid reset, CVE-2023-44487).
    /// A client cancelling a call it sent whole (a deadline) is not counted: the request's
    /// cost was that of any request.
    pub(super) fn peer_reset(&mut self) -> Result<(), Exceeded> {
        over(
            self.peer_resets.count(HTTP2_MAX_PEER_RESETS_PER_SECOND),
            "http2_peer_resets",
        )
    }

    /// A PRIORITY frame: allowed [`HTTP2_MAX_PRIORITY_FRAMES_PER_STREAM`] per stream opened,
    /// and as many before the first.
    pub(super) fn priority(&mut self) -> Result<(), Exceeded> {
        self.priority_frames += 1;
        let allowed = HTTP2_MAX_PRIORITY_FRAMES_PER_STREAM * (1 + self.streams_opened);
        over(self.priority_frames > allowed, "http2_priority_frames")
    }

    /// A WINDOW_UPDATE frame: allowed [`HTTP2_MAX_WINDOW_UPDATES_PER_DATA_FRAME`] per DATA
    /// frame sent, two per stream opened, and [`WINDOW_UPDATES_BASE`].
    pub(super) fn window_update(&mut self) -> Result<(), Exceeded> {
        self.window_updates += 1;
        let allowed = WINDOW_UPDATES_BASE
            + 2 * self.streams_opened
            + HTTP2_MAX_WINDOW_UPDATES_PER_DATA_FRAME * self.data_frames_sent;
        over(self.window_updates > allowed, "http2_window_update_frames")
    }

    /// A DATA, HEADERS or CONTINUATION frame: `idle` when its payload is empty and it ends
    /// nothing (no END_STREAM, no END_HEADERS). A run of idle frames longer than
    /// [`HTTP2_MAX_CONSECUTIVE_EMPTY_FRAMES`] is a flood.
    pub(super) fn payload_frame(&mut self, idle: bool) -> Result<(), Exceeded> {
        if !idle {
            self.empty_run = 0;
            return Ok(());
        }
        self.empty_run += 1;
        over(
            self.empty_run > HTTP2_MAX_CONSECUTIVE_EMPTY_FRAMES,
            "http2_empty_frames",
        )
    }

    /// This server reset a stream with `reason`: a stream error counts against the peer
    /// (refusals, cancellations and NO_ERROR after an answer are the server's own doing).
    pub(super) fn reset_sent(&mut self, reason: Reason) {
        if !matches!(
            reason,
            Reason::REFUSED_STREAM | Reason::CANCEL | Reason::NO_ERROR
        ) {
            self.error_resets = self.error_resets.saturating_add(1);
        }
    }

    /// Whether the peer provoked more than [`HTTP2_MAX_STREAM_ERROR_RESETS`] stream errors
    /// (server-induced resets, "MadeYouReset", CVE-2025-8671).
    pub(super) fn error_resets(&self) -> Result<(), Exceeded> {
        over(
            self.error_resets > HTTP2_MAX_STREAM_ERROR_RESETS,
            "http2_stream_error_resets",
        )
    }
}

fn over(exceeded: bool, limit: Exceeded) -> Result<(), Exceeded> {
    if exceeded { Err(limit) } else { Ok(()) }
}

/// Events counted in one-second windows (the clock is read only when one happens).
#[derive(Default)]
struct PerSecond {
    since: Option<Instant>,
    count: u32,
}

impl PerSecond {
    /// Counts one event. Returns whether more than `limit` fell in the current window.
    fn count(&mut self, limit: u32) -> bool {
        let now = Instant::now();
        if self
            .since
            .is_none_or(|since| now.duration_since(since) >= Duration::from_secs(1))
        {
            self.since = Some(now);
            self.count = 0;
        }
        self.count += 1;
        self.count > limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_second_counts_within_a_window() {
        let mut w = PerSecond::default();
        for _ in 0..10 {
            assert!(!w.count(10));
        }
        assert!(w.count(10));
        // A new window starts over.
        w.since = Some(Instant::now() - Duration::from_secs(2));
        assert!(!w.count(10));
    }

    #[test]
    fn a_ping_after_data_sent_is_not_counted() {
        let mut g = FloodGuard::default();
        for _ in 0..10 * HTTP2_MAX_PINGS_PER_SECOND {
            g.data_frames_sent(1);
            g.ping().unwrap();
        }
        for _ in 0..HTTP2_MAX_PINGS_PER_SECOND {
            g.ping().unwrap();
        }
        assert_eq!(g.ping(), Err("http2_ping_frames"));
    }

    #[test]
    fn priority_frames_scale_with_streams_opened() {
        let mut g = FloodGuard::default();
        for _ in 0..HTTP2_MAX_PRIORITY_FRAMES_PER_STREAM {
            g.priority().unwrap();
        }
        assert_eq!(g.priority(), Err("http2_priority_frames"));
        g.stream_opened();
        g.priority().unwrap();
    }

    #[test]
    fn window_updates_scale_with_data_frames_sent() {
        let mut g = FloodGuard::default();
        for _ in 0..WINDOW_UPDATES_BASE {
            g.window_update().unwrap();
        }
        assert_eq!(g.window_update(), Err("http2_window_update_frames"));
        g.data_frames_sent(1);
        for _ in 0..HTTP2_MAX_WINDOW_UPDATES_PER_DATA_FRAME - 1 {
            g.window_update().unwrap();
        }
        assert!(g.window_update().is_err());
    }

    #[test]
    fn an_empty_frame_run_ends_with_a_frame_that_carries_something() {
        let mut g = FloodGuard::default();
        for _ in 0..HTTP2_MAX_CONSECUTIVE_EMPTY_FRAMES {
            g.payload_frame(true).unwrap();
        }
        g.payload_frame(false).unwrap();
        for _ in 0..HTTP2_MAX_CONSECUTIVE_EMPTY_FRAMES {
            g.payload_frame(true).unwrap();
        }
        assert_eq!(g.payload_frame(true), Err("http2_empty_frames"));
    }

    #[test]
    fn only_stream_errors_count_as_error_resets() {
        let mut g = FloodGuard::default();
        for _ in 0..2 * HTTP2_MAX_STREAM_ERROR_RESETS {
            g.reset_sent(Reason::REFUSED_STREAM);
            g.reset_sent(Reason::CANCEL);
            g.reset_sent(Reason::NO_ERROR);
        }
        g.error_resets().unwrap();
        for _ in 0..HTTP2_MAX_STREAM_ERROR_RESETS {
            g.reset_sent(Reason::PROTOCOL_ERROR);
        }
        g.error_resets().unwrap();
        g.reset_sent(Reason::STREAM_CLOSED);
        assert_eq!(g.error_resets(), Err("http2_stream_error_resets"));
    }
}
