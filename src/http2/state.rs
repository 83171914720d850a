//! Stream states (RFC 9113 §5.1) as the server sees a client-initiated stream, the transitions
//! between them as one table ([`transition`]), the bounded record of recently closed streams
//! that tells a late frame's reaction, and a request's `content-length` accounting (§8.1.1).
//!
//! The server opens no streams and sends no PUSH_PROMISE, so "reserved" states never occur.
//! A stream lives in its connection's table while it is open or half-closed; a closed stream
//! is remembered (with how it closed) in [`ClosedStreams`] for a while; a stream id above the
//! highest the peer used is idle; one below it that is in neither place closed long ago or was
//! never used (§5.1.1: a higher id implicitly closes the idle streams below it).

use std::collections::VecDeque;

use super::frame::Reason;
use crate::limits::HTTP2_RECENT_CLOSED_STREAMS;

/// A stream's state (§5.1).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum State {
    Idle,
    Open,
    /// This server ended its side (END_STREAM sent); the peer may still send.
    HalfClosedLocal,
    /// The peer ended its side (END_STREAM received); this server is answering.
    HalfClosedRemote,
    Closed(Cause),
}

/// How a stream closed: the reaction to frames that arrive on it afterwards depends on it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Cause {
    /// Both sides sent END_STREAM.
    EndStream,
    /// The peer sent RST_STREAM.
    ResetByPeer,
    /// This server sent RST_STREAM; `peer_ended`: the peer had sent END_STREAM before.
    ResetByUs { peer_ended: bool },
    /// Not on record: closed longer ago than [`ClosedStreams`] remembers, or an id the peer
    /// skipped (implicitly closed, §5.1.1). The two cannot be told apart.
    Forgotten,
}

/// What happens to a stream: a frame received on it, or one this server sends.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Event {
    RecvHeaders {
        end_stream: bool,
    },
    RecvData {
        end_stream: bool,
    },
    RecvPriority,
    RecvRstStream,
    RecvWindowUpdate,
    /// This server sent END_STREAM (the last frame of its answer).
    SendEndStream,
    /// This server sent RST_STREAM.
    SendReset,
}

/// What the connection does with the event.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Reaction {
    /// The frame is processed.
    Accept,
    /// Minimally processed and dropped (§5.1 "closed"): a header block is still decoded (the
    /// HPACK state is shared), DATA still counts against the connection's window.
    Ignore,
    /// A stream error (§5.4.2): RST_STREAM with the reason; the frame is not processed.
    Stream(Reason),
    /// A connection error (§5.4.1): GOAWAY with the reason.
    Connection(Reason),
}

/// The transition table of RFC 9113 §5.1 (server side, client-initiated streams): the state a
/// stream moves to on `event`, and the reaction. Frame-level checks that do not depend on the
/// state (sizes, a stream depending on itself, header validity, flow control) come before it.
pub(super) fn transition(state: State, event: Event) -> (State, Reaction) {
    use Cause::*;
    use Event::*;
    use Reaction::*;
    use State::*;
    let stream_closed = Stream(Reason::STREAM_CLOSED);
    match (state, event) {
        // idle: HEADERS opens; PRIORITY is allowed; anything else is a connection error.
        (Idle, RecvHeaders { end_stream: false }) => (Open, Accept),
        (Idle, RecvHeaders { end_stream: true }) => (HalfClosedRemote, Accept),
        (Idle, RecvData { .. } | RecvRstStream | RecvWindowUpdate) => {
            (Idle, Connection(Reason::PROTOCOL_ERROR))
        }
        (Idle, RecvPriority) => (Idle, Accept),
        // The server sends nothing on a stream the peer has not opened.
        (Idle, SendEndStream | SendReset) => (Idle, Ignore),

        // open: a second header block must end the stream (trailers, §8.1).
        (Open, RecvHeaders { end_stream: false }) => (
            Closed(ResetByUs { peer_ended: false }),
            Stream(Reason::PROTOCOL_ERROR),
        ),
        (Open, RecvHeaders { end_stream: true } | RecvData { end_stream: true }) => {
            (HalfClosedRemote, Accept)
        }
        (Open, RecvData { end_stream: false } | RecvPriority | RecvWindowUpdate) => (Open, Accept),
        (Open, RecvRstStream) => (Closed(ResetByPeer), Accept),
        (Open, SendEndStream) => (HalfClosedLocal, Accept),
        (Open, SendReset) => (Closed(ResetByUs { peer_ended: false }), Accept),

        // half-closed (local): the peer may still send its body and trailers.
        (HalfClosedLocal, RecvHeaders { end_stream: false }) => (
            Closed(ResetByUs { peer_ended: false }),
            Stream(Reason::PROTOCOL_ERROR),
        ),
        (HalfClosedLocal, RecvHeaders { end_stream: true } | RecvData { end_stream: true }) => {
            (Closed(EndStream), Accept)
        }
        (HalfClosedLocal, RecvData { end_stream: false } | RecvPriority | RecvWindowUpdate) => {
            (HalfClosedLocal, Accept)
        }
        (HalfClosedLocal, RecvRstStream) => (Closed(ResetByPeer), Accept),
        (HalfClosedLocal, SendEndStream) => (HalfClosedLocal, Ignore),
        (HalfClosedLocal, SendReset) => (Closed(ResetByUs { peer_ended: false }), Accept),

        // half-closed (remote): anything but WINDOW_UPDATE, PRIORITY or RST_STREAM is a stream
        // error STREAM_CLOSED, whether or not the answer has started.
        (HalfClosedRemote, RecvHeaders { .. } | RecvData { .. }) => {
            (Closed(ResetByUs { peer_ended: true }), stream_closed)
        }
        (HalfClosedRemote, RecvPriority | RecvWindowUpdate) => (HalfClosedRemote, Accept),
        (HalfClosedRemote, RecvRstStream) => (Closed(ResetByPeer), Accept),
        (HalfClosedRemote, SendEndStream) => (Closed(EndStream), Accept),
        (HalfClosedRemote, SendReset) => (Closed(ResetByUs { peer_ended: true }), Accept),

        // closed. HEADERS or DATA after the peer ended its side or reset the stream is the
        // peer's error: STREAM_CLOSED (§5.1, §6.1). After this server reset a stream the peer
        // had not ended, its frames in flight are expected: dropped. A forgotten id: DATA is
        // STREAM_CLOSED (§6.1); HEADERS may be an attempt to open a stream below the highest,
        // a connection error PROTOCOL_ERROR (§5.1.1).
        (
            Closed(c @ (EndStream | ResetByPeer | ResetByUs { peer_ended: true })),
            RecvHeaders { .. },
        ) => (Closed(c), stream_closed),
        (Closed(c @ ResetByUs { peer_ended: false }), RecvHeaders { .. } | RecvData { .. }) => {
            (Closed(c), Ignore)
        }
        (Closed(Forgotten), RecvHeaders { .. }) => {
            (Closed(Forgotten), Connection(Reason::PROTOCOL_ERROR))
        }
        (Closed(c), RecvData { .. }) => (Closed(c), stream_closed),
        // WINDOW_UPDATE and RST_STREAM may cross this server's END_STREAM or RST_STREAM
        // (§5.1, §6.9); PRIORITY may come on any stream.
        (Closed(c), RecvPriority | RecvRstStream | RecvWindowUpdate) => (Closed(c), Ignore),
        // Nothing more is sent on a closed stream.
        (Closed(c), SendEndStream | SendReset) => (Closed(c), Ignore),
    }
}

/// The streams a connection closed most recently, with how they closed, so a late frame on
/// one gets the reaction its state calls for. Bounded by [`HTTP2_RECENT_CLOSED_STREAMS`]: an
/// id it has forgotten is [`Cause::Forgotten`] (§5.1 lets an endpoint limit how long it
/// tolerates frames on a closed stream). Grows with use, so an idle connection holds nothing.
#[derive(Default)]
pub(super) struct ClosedStreams {
    recent: VecDeque<(u32, Cause)>,
}

impl ClosedStreams {
    pub(super) fn record(&mut self, id: u32, cause: Cause) {
        if self.recent.len() == HTTP2_RECENT_CLOSED_STREAMS {
            self.recent.pop_front();
        }
        self.recent.push_back((id, cause));
    }

    /// How `id` closed, if it is still on record (the latest record wins).
    pub(super) fn cause_of(&self, id: u32) -> Option<Cause> {
        self.recent
            .iter()
            .rev()
            .find(|(i, _)| *i == id)
            .map(|&(_, cause)| cause)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.recent.len()
    }
}

/// A request's declared `content-length` and the DATA bytes received against it: a request
/// whose DATA (padding excluded) sums to anything else is malformed (§8.1.1).
#[derive(Clone, Copy, Default, Debug)]
pub(super) struct ContentLength {
    declared: Option<u64>,
    received: u64,
}

impl ContentLength {
    pub(super) fn new(declared: Option<u64>) -> Self {
        ContentLength {
            declared,
            received: 0,
        }
    }

    /// Counts a DATA frame's bytes. Returns whether the request is still well formed: never
    /// more than declared, and exactly that once the stream ends.
    pub(super) fn on_data(&mut self, len: usize, end_stream: bool) -> bool {
        self.received += len as u64;
        match self.declared {
            None => true,
            Some(declared) => {
                self.received <= declared && (!end_stream || self.received == declared)
            }
        }
    }

    /// Whether a request that ends now (END_STREAM on a header block) has its declared length.
    pub(super) fn complete(&self) -> bool {
        self.declared
            .is_none_or(|declared| declared == self.received)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Cause::*;
    use Event::*;
    use Reaction::*;
    use State::*;

    const STATES: [State; 9] = [
        Idle,
        Open,
        HalfClosedLocal,
        HalfClosedRemote,
        Closed(EndStream),
        Closed(ResetByPeer),
        Closed(ResetByUs { peer_ended: false }),
        Closed(ResetByUs { peer_ended: true }),
        Closed(Forgotten),
    ];
    const EVENTS: [Event; 9] = [
        RecvHeaders { end_stream: false },
        RecvHeaders { end_stream: true },
        RecvData { end_stream: false },
        RecvData { end_stream: true },
        RecvPriority,
        RecvRstStream,
        RecvWindowUpdate,
        SendEndStream,
        SendReset,
    ];

    /// Every row of the table, written out from RFC 9113 §5.1, §5.1.1 and §6.1: one line per
    /// state, one column per event of [`EVENTS`] (`next/reaction`). `=` is "stays", `A`
    /// accept, `I` ignore, `S:x` stream error, `C:x` connection error; `PE` PROTOCOL_ERROR,
    /// `SC` STREAM_CLOSED. Next states: `o` open, `hl`/`hr` half-closed local/remote, `ce`,
    /// `cp`, `cu`, `cU`, `cf`: closed by END_STREAM, by the peer's reset, by ours (peer had
    /// not / had ended), forgotten.
    const ROWS: [[&str; 9]; 9] = [
        //  H          H+end     D          D+end     PRIO   RST    WU     send END  send RST
        [
            "o/A", "hr/A", "=/C:PE", "=/C:PE", "=/A", "=/C:PE", "=/C:PE", "=/I", "=/I",
        ], // idle
        [
            "cu/S:PE", "hr/A", "=/A", "hr/A", "=/A", "cp/A", "=/A", "hl/A", "cu/A",
        ], // open
        [
            "cu/S:PE", "ce/A", "=/A", "ce/A", "=/A", "cp/A", "=/A", "=/I", "cu/A",
        ], // h-c local
        [
            "cU/S:SC", "cU/S:SC", "cU/S:SC", "cU/S:SC", "=/A", "cp/A", "=/A", "ce/A", "cU/A",
        ], // remote
        [
            "=/S:SC", "=/S:SC", "=/S:SC", "=/S:SC", "=/I", "=/I", "=/I", "=/I", "=/I",
        ], // end stream
        [
            "=/S:SC", "=/S:SC", "=/S:SC", "=/S:SC", "=/I", "=/I", "=/I", "=/I", "=/I",
        ], // peer reset
        [
            "=/I", "=/I", "=/I", "=/I", "=/I", "=/I", "=/I", "=/I", "=/I",
        ], // our reset
        [
            "=/S:SC", "=/S:SC", "=/S:SC", "=/S:SC", "=/I", "=/I", "=/I", "=/I", "=/I",
        ], // ours, ended
        [
            "=/C:PE", "=/C:PE", "=/S:SC", "=/S:SC", "=/I", "=/I", "=/I", "=/I", "=/I",
        ], // forgotten
    ];

    fn expected(state: State, cell: &str) -> (State, Reaction) {
        let (next, reaction) = cell.split_once('/').unwrap();
        let next = match next {
            "=" => state,
            "o" => Open,
            "hl" => HalfClosedLocal,
            "hr" => HalfClosedRemote,
            "ce" => Closed(EndStream),
            "cp" => Closed(ResetByPeer),
            "cu" => Closed(ResetByUs { peer_ended: false }),
            "cU" => Closed(ResetByUs { peer_ended: true }),
            other => panic!("next state {other}"),
        };
        let reaction = match reaction {
            "A" => Accept,
            "I" => Ignore,
            "S:PE" => Stream(Reason::PROTOCOL_ERROR),
            "S:SC" => Stream(Reason::STREAM_CLOSED),
            "C:PE" => Connection(Reason::PROTOCOL_ERROR),
            other => panic!("reaction {other}"),
        };
        (next, reaction)
    }

    #[test]
    fn every_row_of_the_transition_table() {
        for (state, row) in STATES.iter().zip(ROWS) {
            for (event, cell) in EVENTS.iter().zip(row) {
                assert_eq!(
                    transition(*state, *event),
                    expected(*state, cell),
                    "{state:?} on {event:?}"
                );
            }
        }
    }

    #[test]
    fn a_request_passes_through_the_states_of_section_5_1() {
        // HEADERS, DATA, DATA+END, then the answer's END_STREAM: closed by END_STREAM.
        let mut s = Idle;
        for event in [
            RecvHeaders { end_stream: false },
            RecvData { end_stream: false },
            RecvData { end_stream: true },
            SendEndStream,
        ] {
            let (next, reaction) = transition(s, event);
            assert_eq!(reaction, Accept, "{s:?} on {event:?}");
            s = next;
        }
        assert_eq!(s, Closed(EndStream));
        // Answered before the peer ended, then reset with NO_ERROR (§8.1): late frames dropped.
        let (s, _) = transition(Open, SendEndStream);
        let (s, _) = transition(s, SendReset);
        assert_eq!(s, Closed(ResetByUs { peer_ended: false }));
        assert_eq!(transition(s, RecvData { end_stream: true }).1, Ignore);
    }

    #[test]
    fn closed_streams_are_remembered_up_to_their_bound() {
        let mut closed = ClosedStreams::default();
        assert_eq!(closed.cause_of(1), None);
        for i in 0..HTTP2_RECENT_CLOSED_STREAMS as u32 {
            closed.record(2 * i + 1, EndStream);
        }
        closed.record(3, ResetByPeer);
        assert_eq!(closed.len(), HTTP2_RECENT_CLOSED_STREAMS);
        // The oldest (stream 1) is forgotten; the newest record of stream 3 wins.
        assert_eq!(closed.cause_of(1), None);
        assert_eq!(closed.cause_of(3), Some(ResetByPeer));
        assert_eq!(closed.cause_of(5), Some(EndStream));
    }

    #[test]
    fn content_length_is_checked_frame_by_frame_and_at_the_end() {
        // Undeclared: anything goes.
        let mut none = ContentLength::new(None);
        assert!(none.on_data(10, false) && none.on_data(5, true) && none.complete());
        // One frame, exact.
        assert!(ContentLength::new(Some(4)).on_data(4, true));
        // One frame, short or long.
        assert!(!ContentLength::new(Some(4)).on_data(3, true));
        assert!(!ContentLength::new(Some(4)).on_data(5, false));
        // Several frames summing to it; to less; past it before the end.
        let mut sum = ContentLength::new(Some(6));
        assert!(sum.on_data(2, false) && sum.on_data(0, false) && sum.on_data(4, true));
        let mut short = ContentLength::new(Some(6));
        assert!(short.on_data(2, false) && !short.on_data(2, true));
        let mut over = ContentLength::new(Some(6));
        assert!(over.on_data(4, false) && !over.on_data(4, false));
        // Ended by trailers or a HEADERS with END_STREAM.
        let mut body = ContentLength::new(Some(3));
        assert!(!body.complete());
        assert!(body.on_data(3, false) && body.complete());
        assert!(ContentLength::new(Some(0)).complete());
    }
}
