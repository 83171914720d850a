//! In-process fuzzing of the gRPC port's HTTP/2 connection (`src/http2/connection.rs`) on stable
//! Rust: seeded generators drive the real front end (`examples/frontend_harness`, the harness of
//! the inline path's allocation test) over an in-memory duplex with arbitrary frame sequences.
//!
//! Each case opens a fresh connection, sends the preface and a SETTINGS (now and then an invalid
//! one), then up to [`MAX_GARBAGE`] frames of every type with random flags, stream ids and
//! payloads (plausible ones and random ones, now and then one over the frame size), with one
//! well-formed LookupRoute (HEADERS, then DATA with END_STREAM) interleaved at random points,
//! then a SETTINGS and a WINDOW_UPDATE that open the windows. One case in eight adds a burst of
//! one denial-of-service family ([`flood`]: up to 2,600 frames or frame pairs, under or past
//! the connection's bound for it). Asserted for every case:
//!
//! * no panic, and the connection's task ends once the client hangs up (no hang, no leak);
//! * the LookupRoute is answered (a decodable answer ranking every replica), or the connection
//!   is closed with a GOAWAY; a reset of its stream, or no answer, only when the garbage itself
//!   touched that stream, a REFUSED_STREAM only after the client's own GOAWAY;
//! * bounded memory: the heap the case grows (the counting allocator below, on this thread)
//!   stays under [`PEAK_BOUND`], and the heap after a run of cases does not grow with them.
//!
//! `FUZZ_TRACE=1` prints every frame written and each case's outcome.
//!
//! The default `cargo test` runs [`SHORT_CASES`] cases from seed 0. The long mode runs for
//! `FUZZ_SECS` seconds from `FUZZ_SEED` (or the clock), printing the seed and cases run
//! (tests/http2_fuzz_long.sh). A failing case prints its seed; reproduce with
//! `FUZZ_SEED=<seed> FUZZ_CASES=1 cargo test --test http2_fuzz`.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_lite::future;
use inferencecache_proto::v1alpha1 as pb;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

#[path = "../examples/frontend_harness/mod.rs"]
mod frontend_harness;

/// Live heap bytes and their peak since the last reset (all threads; the test runs alone in
/// its binary, and the executor is this thread).
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

struct Counting;

fn grew(n: usize) {
    let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded unchanged to mimalloc, which upholds `GlobalAlloc`'s
// contract; the counting touches only atomics, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        // SAFETY: the caller's arguments, as `GlobalAlloc` requires them, passed on.
        unsafe { mimalloc::MiMalloc.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        // SAFETY: the caller's arguments, as `GlobalAlloc` requires them, passed on.
        unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        grew(new_size);
        // SAFETY: the caller's arguments, as `GlobalAlloc` requires them, passed on.
        unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's arguments, as `GlobalAlloc` requires them, passed on.
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Cases of the default (CI) run: a few seconds in a debug build.
const SHORT_CASES: u64 = 2_000;
/// Garbage frames per case, at most.
const MAX_GARBAGE: usize = 40;
/// The in-memory connection's buffer each way.
const DUPLEX_BYTES: usize = 256 * 1024;
/// How long a case waits for its outcome (an answer, a reset, a close).
const OUTCOME_WITHIN: Duration = Duration::from_secs(3);
/// How long the connection's task may take to end once the client hung up.
const END_WITHIN: Duration = Duration::from_secs(3);
/// Heap one case may grow by at its peak: the connection's output bound
/// (HTTP2_WRITE_BUFFER_BYTES, 256 KiB), its read chunk and buffer (the case's input, under
/// 1 MiB), a header block (32 KiB), the duplex buffers (2 x 256 KiB), and slack for the
/// general-path tasks the garbage may start. A connection that buffered without bound would
/// pass it quickly.
const PEAK_BOUND: usize = 8 << 20;
/// Heap the whole run may keep after its connections ended (metrics entries, the executor's
/// own growth), whatever the number of cases.
const RETAINED_BOUND: usize = 4 << 20;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const PRIORITY: u8 = 0x2;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const REFUSED_STREAM: u32 = 0x7;

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// Random bytes, fewer than `max`.
    fn some_bytes(&mut self, max: usize) -> Vec<u8> {
        let n = self.below(max);
        self.bytes(n)
    }
    /// Random bytes, `min` and fewer than `max` more.
    fn some_bytes_from(&mut self, min: usize, max: usize) -> Vec<u8> {
        let n = min + self.below(max);
        self.bytes(n)
    }
}

fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    if std::env::var_os("FUZZ_TRACE").is_some() {
        eprintln!(
            "  > type {kind} flags {flags:#x} stream {stream} length {}",
            payload.len()
        );
    }
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// One garbage frame: its type, flags, stream id and payload.
struct Garbage {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

/// A stream id: 0, a small odd or even one, one near the top, or with the reserved bit.
fn stream_id(rng: &mut Rng) -> u32 {
    match rng.below(8) {
        0 => 0,
        1 => rng.below(40) as u32,
        2 => 0x7fff_ffff - rng.below(4) as u32,
        3 => 0x8000_0000 | (2 * rng.below(40) as u32 + 1),
        _ => 2 * rng.below(40) as u32 + 1,
    }
}

/// A payload plausible for `kind` (right length, real setting ids, a real request block), or
/// random bytes; now and then one over the default frame size.
fn payload(rng: &mut Rng, kind: u8, wild: bool) -> Vec<u8> {
    if wild && rng.one_in(40) {
        return rng.bytes(16_385);
    }
    if wild && rng.one_in(4) {
        return rng.some_bytes(64);
    }
    match kind {
        HEADERS | CONTINUATION => match rng.below(3) {
            0 => frontend_harness::header_block(),
            1 => {
                let mut b = frontend_harness::header_block();
                let cut = rng.below(b.len());
                b.truncate(cut);
                b
            }
            // Indexed static entries, a size update, literals with indexing.
            _ => {
                let mut b = vec![0x20 | rng.below(32) as u8, 0x82, 0x87, 0x84];
                b.extend_from_slice(&[0x40, 0x01, b'x', 0x01, b'y', 0xbe]);
                b.extend(rng.some_bytes(8));
                b
            }
        },
        DATA => {
            if rng.one_in(2) {
                frontend_harness::lookup_body()
            } else {
                rng.some_bytes(300)
            }
        }
        PRIORITY => rng.bytes(5),
        RST_STREAM => (rng.below(16) as u32).to_be_bytes().to_vec(),
        SETTINGS => (0..rng.below(4))
            .flat_map(|_| {
                let mut e = (rng.below(8) as u16).to_be_bytes().to_vec();
                let v = match rng.below(4) {
                    0 => rng.below(70_000) as u32,
                    1 => 0x7fff_ffff,
                    2 => rng.next() as u32,
                    _ => 16_384 + rng.below(1 << 20) as u32,
                };
                e.extend_from_slice(&v.to_be_bytes());
                e
            })
            .collect(),
        PING => rng.bytes(8),
        GOAWAY => rng.some_bytes_from(8, 8),
        WINDOW_UPDATE => {
            let inc = match rng.below(4) {
                0 => 0,
                1 => 0x7fff_ffff,
                _ => rng.below(1 << 20) as u32,
            };
            inc.to_be_bytes().to_vec()
        }
        _ => rng.some_bytes(32),
    }
}

/// A frame of anything: any type, flags, stream id and payload (most are connection errors).
fn garbage(rng: &mut Rng) -> Garbage {
    let kind = if rng.one_in(10) {
        10 + rng.below(246) as u8
    } else {
        rng.below(10) as u8
    };
    let flags = match rng.below(4) {
        0 => rng.next() as u8,
        1 => 0,
        _ => [END_STREAM, END_HEADERS, END_STREAM | END_HEADERS, 0x8, 0x20][rng.below(5)],
    };
    Garbage {
        kind,
        flags,
        stream: stream_id(rng),
        payload: payload(rng, kind, true),
    }
}

/// Frames a peer could plausibly send (streams it opened, the right stream for each type,
/// header blocks split over CONTINUATION), with odd values: they reach deeper states than
/// [`garbage`], whose first frame is often a connection error.
fn plausible(rng: &mut Rng, next_new: &mut u32, opened: &mut Vec<u32>, out: &mut Vec<Garbage>) {
    let some_open = |rng: &mut Rng, opened: &Vec<u32>| match opened.len() {
        0 => 1,
        n => opened[rng.below(n)],
    };
    let kind = [
        DATA,
        HEADERS,
        HEADERS,
        PRIORITY,
        RST_STREAM,
        SETTINGS,
        PING,
        WINDOW_UPDATE,
        0x42,
    ][rng.below(9)];
    // Frames of an open stream open one first (on an idle stream they are connection errors).
    let kind = match kind {
        DATA | RST_STREAM if opened.is_empty() => HEADERS,
        k => k,
    };
    let stream = match kind {
        SETTINGS | PING => 0,
        WINDOW_UPDATE if opened.is_empty() => 0,
        // Now and then a second header block on an open stream (trailers, or not).
        HEADERS if opened.is_empty() || !rng.one_in(5) => {
            let id = *next_new;
            *next_new += 2;
            opened.push(id);
            id
        }
        WINDOW_UPDATE if rng.one_in(2) => 0,
        _ => some_open(rng, opened),
    };
    let mut payload = match kind {
        // A request head, after a table size update now and then.
        HEADERS => {
            let mut b = Vec::new();
            if rng.one_in(4) {
                b.push(0x20 | rng.below(32) as u8);
            }
            b.extend(frontend_harness::header_block());
            b
        }
        SETTINGS if rng.one_in(4) => Vec::new(),
        // Legal values (the wild frames bring the illegal ones).
        SETTINGS => valid_settings(rng),
        WINDOW_UPDATE => (1 + rng.below(1 << 16) as u32).to_be_bytes().to_vec(),
        _ => payload(rng, kind, false),
    };
    let flags = match kind {
        DATA | HEADERS => END_STREAM * rng.below(2) as u8,
        SETTINGS => u8::from(payload.is_empty()),
        PING => u8::from(rng.one_in(4)),
        _ => 0,
    };
    if kind == HEADERS && rng.one_in(3) {
        // The block split: HEADERS, then CONTINUATION frames.
        let cut = rng.below(payload.len() + 1);
        let rest = payload.split_off(cut);
        out.push(Garbage {
            kind,
            flags,
            stream,
            payload,
        });
        let mid = rng.below(rest.len() + 1);
        out.push(Garbage {
            kind: CONTINUATION,
            flags: 0,
            stream,
            payload: rest[..mid].to_vec(),
        });
        let last = rest[mid..].to_vec();
        out.push(Garbage {
            kind: CONTINUATION,
            flags: END_HEADERS,
            stream,
            payload: last,
        });
        return;
    }
    let flags = if kind == HEADERS {
        flags | END_HEADERS
    } else {
        flags
    };
    out.push(Garbage {
        kind,
        flags,
        stream,
        payload,
    });
}

/// A burst of one denial-of-service family (up to a few thousand frames, past the bound of each
/// family in `src/http2/guard.rs` or below it), so the bounds' GOAWAY and their bookkeeping meet
/// the request and the other frames: PING, SETTINGS, PRIORITY, WINDOW_UPDATE and empty-DATA
/// floods, rapid reset, server-induced resets, a header block held open by empty CONTINUATION.
fn flood(rng: &mut Rng, next_new: &mut u32, opened: &mut Vec<u32>, out: &mut Vec<Garbage>) {
    let mut push = |kind, flags, stream, payload: Vec<u8>| {
        out.push(Garbage {
            kind,
            flags,
            stream,
            payload,
        })
    };
    let mut new_id = || {
        let id = *next_new;
        *next_new += 2;
        id
    };
    let n = 1 + rng.below(2_600);
    match rng.below(8) {
        0 => (0..n).for_each(|_| push(PING, 0, 0, rng.bytes(8))),
        1 => (0..n).for_each(|_| push(SETTINGS, 0, 0, Vec::new())),
        2 => {
            for _ in 0..n {
                // On idle streams above the ones opened (they open none), depending on stream 0.
                let id = *next_new + 2 * rng.below(64) as u32;
                push(PRIORITY, 0, id, vec![0, 0, 0, 0, 16]);
            }
        }
        3 => (0..n).for_each(|_| push(WINDOW_UPDATE, 0, 0, 1u32.to_be_bytes().to_vec())),
        4 => {
            let id = new_id();
            opened.push(id);
            push(HEADERS, END_HEADERS, id, frontend_harness::header_block());
            (0..n).for_each(|_| push(DATA, 0, id, Vec::new()));
        }
        5 => {
            for _ in 0..n {
                let id = new_id();
                push(HEADERS, END_HEADERS, id, frontend_harness::header_block());
                push(RST_STREAM, 0, id, 8u32.to_be_bytes().to_vec());
            }
        }
        6 => {
            for _ in 0..n.min(1_200) {
                let id = new_id();
                push(
                    HEADERS,
                    END_HEADERS | END_STREAM,
                    id,
                    frontend_harness::header_block(),
                );
                push(WINDOW_UPDATE, 0, id, 0u32.to_be_bytes().to_vec());
            }
        }
        _ => {
            let id = new_id();
            opened.push(id);
            let mut block = frontend_harness::header_block();
            let rest = block.split_off(block.len() / 2);
            push(HEADERS, 0, id, block);
            (0..n.min(200)).for_each(|_| push(CONTINUATION, 0, id, Vec::new()));
            push(CONTINUATION, END_HEADERS, id, rest);
        }
    }
}

/// What the client wrote, and what it means for the outcome.
struct Script {
    bytes: Vec<u8>,
    /// The well-formed request's stream.
    request: u32,
    /// A garbage frame named the request's stream.
    touched: bool,
    /// The client sent a GOAWAY frame.
    client_goaway: bool,
}

/// The case's bytes: preface, SETTINGS, garbage with the request interleaved, window openers.
/// Up to three SETTINGS entries with legal values (window sizes included, so some shut the
/// peer's windows until the script's last frames open them).
fn valid_settings(rng: &mut Rng) -> Vec<u8> {
    let mut settings = Vec::new();
    for _ in 0..rng.below(4) {
        let (id, v): (u16, u32) = match rng.below(6) {
            0 => (0x1, rng.below(8192) as u32),
            1 => (0x4, rng.below(1 << 21) as u32),
            2 => (0x5, 16_384 + rng.below(1 << 16) as u32),
            3 => (0x3, rng.below(200) as u32),
            4 => (0x2, rng.below(2) as u32),
            _ => (0x6, rng.next() as u32),
        };
        settings.extend_from_slice(&id.to_be_bytes());
        settings.extend_from_slice(&v.to_be_bytes());
    }
    settings
}

fn script(rng: &mut Rng) -> Script {
    let mut bytes = PREFACE.to_vec();
    // Now and then an invalid first SETTINGS (a connection error).
    let settings = if rng.one_in(20) {
        payload(rng, SETTINGS, true)
    } else {
        valid_settings(rng)
    };
    frame(&mut bytes, SETTINGS, 0, 0, &settings);
    // Three cases in four: plausible frames with a random one now and then; else anything.
    let wild = rng.one_in(4);
    let rounds = rng.below(MAX_GARBAGE + 1);
    // One case in eight: a flood burst at one of its rounds.
    let at_flood = rng.one_in(8).then(|| rng.below(rounds + 1));
    let at_headers = rng.below(rounds + 1);
    let at_data = at_headers + rng.below(rounds - at_headers + 1);
    let mut junk: Vec<Garbage> = Vec::new();
    let mut next_new = 1;
    let mut opened = Vec::new();
    let mut request = 0;
    let mut touched = false;
    let mut client_goaway = false;
    for round in 0..=rounds {
        if round == at_headers {
            // Above every id named so far, so it is a new stream.
            let highest = junk
                .iter()
                .map(|g| g.stream & 0x7fff_ffff)
                .max()
                .unwrap_or(0);
            // Past the top (the garbage named 0x7fffffff): stream 1, an old id, then.
            touched |= highest >= 0x7fff_fffe;
            request = if highest >= 0x7fff_fffe {
                1
            } else {
                ((highest + 1) | 1).max(next_new)
            };
            next_new = request + 2;
            for g in junk.drain(..) {
                client_goaway |= g.kind == GOAWAY;
                frame(&mut bytes, g.kind, g.flags, g.stream, &g.payload);
            }
            frame(
                &mut bytes,
                HEADERS,
                END_HEADERS,
                request,
                &frontend_harness::header_block(),
            );
        }
        if round == at_data {
            for g in junk.drain(..) {
                touched |= g.stream & 0x7fff_ffff == request;
                client_goaway |= g.kind == GOAWAY;
                frame(&mut bytes, g.kind, g.flags, g.stream, &g.payload);
            }
            frame(
                &mut bytes,
                DATA,
                END_STREAM,
                request,
                &frontend_harness::lookup_body(),
            );
        }
        if round == rounds {
            break;
        }
        if at_flood == Some(round) {
            flood(rng, &mut next_new, &mut opened, &mut junk);
        } else if wild || rng.one_in(40) {
            junk.push(garbage(rng));
        } else {
            plausible(rng, &mut next_new, &mut opened, &mut junk);
        }
    }
    for g in junk {
        touched |= g.stream & 0x7fff_ffff == request;
        client_goaway |= g.kind == GOAWAY;
        frame(&mut bytes, g.kind, g.flags, g.stream, &g.payload);
    }
    // Open the windows the garbage may have shut (an overflow is a GOAWAY, also an outcome).
    frame(&mut bytes, SETTINGS, 0, 0, &[0, 4, 0, 0x10, 0, 0]);
    frame(&mut bytes, WINDOW_UPDATE, 0, 0, &(1u32 << 20).to_be_bytes());
    Script {
        bytes,
        request,
        touched,
        client_goaway,
    }
}

/// How the request fared.
#[derive(Debug, PartialEq)]
enum Outcome {
    Answered,
    /// The stream ended without a LookupRoute answer: what came instead.
    Failed(String),
    Reset(u32),
    /// GOAWAY with this code, then the connection closed.
    GoAway(u32),
    /// Closed without a GOAWAY.
    Closed,
    /// Nothing within [`OUTCOME_WITHIN`].
    Silent,
    /// A GOAWAY, and the connection still open [`OUTCOME_WITHIN`] later.
    GoAwayNotClosed(u32),
}

/// Reads the server's frames until the request's outcome; a GOAWAY read is left in `goaway`.
async fn outcome(
    io: &mut tokio::io::ReadHalf<DuplexStream>,
    request: u32,
    goaway: &Cell<Option<u32>>,
) -> Outcome {
    let mut buf = Vec::new();
    let mut body = Vec::new();
    loop {
        while buf.len() >= 9 {
            let len = u32::from_be_bytes([0, buf[0], buf[1], buf[2]]) as usize;
            if buf.len() < 9 + len {
                break;
            }
            let (kind, flags) = (buf[3], buf[4]);
            let stream = u32::from_be_bytes(buf[5..9].try_into().unwrap()) & 0x7fff_ffff;
            let payload = &buf[9..9 + len];
            match kind {
                DATA if stream == request => body.extend_from_slice(payload),
                HEADERS if stream == request && flags & END_STREAM != 0 => {
                    let answer = body
                        .get(5..)
                        .and_then(|m| pb::LookupRouteResponse::decode(m).ok());
                    if answer.is_some_and(|a| a.replica_scores.len() == frontend_harness::REPLICAS)
                    {
                        return Outcome::Answered;
                    }
                    return Outcome::Failed(format!(
                        "{} body bytes, {}",
                        body.len(),
                        fields(payload)
                    ));
                }
                RST_STREAM if stream == request => {
                    return Outcome::Reset(u32::from_be_bytes(payload[..4].try_into().unwrap()));
                }
                GOAWAY => goaway.set(Some(u32::from_be_bytes(payload[4..8].try_into().unwrap()))),
                _ => {}
            }
            buf.drain(..9 + len);
        }
        match io.read_buf(&mut buf).await {
            Ok(0) | Err(_) => return goaway.get().map_or(Outcome::Closed, Outcome::GoAway),
            Ok(_) => {}
        }
    }
}

/// A header block of the server's (literals, no dynamic table) as text, for failure messages.
fn fields(block: &[u8]) -> String {
    let mut d = loona_hpack::Decoder::new();
    match d.decode(block) {
        Ok(list) => list
            .iter()
            .map(|(n, v)| {
                format!(
                    "{}: {}",
                    String::from_utf8_lossy(n),
                    String::from_utf8_lossy(v)
                )
            })
            .collect::<Vec<_>>()
            .join(", "),
        Err(e) => format!("undecodable block {e:?}"),
    }
}

/// One case: a fresh connection, the script, its outcome checked, the connection's end awaited.
async fn case(seed: u64) -> (usize, String) {
    let mut rng = Rng(seed);
    let s = script(&mut rng);
    let start = LIVE.load(Ordering::Relaxed);
    PEAK.store(start, Ordering::Relaxed);
    let (io, task) = frontend_harness::connect(DUPLEX_BYTES);
    let (mut rd, mut wr) = tokio::io::split(io);
    let bytes = s.bytes;
    // The writer runs on its own: a server that stops reading must not stall the reader.
    let writer = glommio::spawn_local(async move {
        let _ = wr.write_all(&bytes).await;
        wr
    });
    let goaway = Cell::new(None);
    let got = future::or(outcome(&mut rd, s.request, &goaway), async {
        glommio::timer::sleep(OUTCOME_WITHIN).await;
        // A GOAWAY must be followed by the close.
        goaway
            .get()
            .map_or(Outcome::Silent, Outcome::GoAwayNotClosed)
    })
    .await;
    if std::env::var_os("FUZZ_TRACE").is_some() {
        eprintln!("seed {seed}: {got:?}");
    }
    let ok = match &got {
        Outcome::Answered | Outcome::GoAway(_) => true,
        Outcome::Failed(_) => s.touched,
        Outcome::Reset(code) => s.touched || (s.client_goaway && *code == REFUSED_STREAM),
        Outcome::Closed => s.client_goaway,
        Outcome::Silent => s.touched,
        Outcome::GoAwayNotClosed(_) => false,
    };
    assert!(
        ok,
        "request on stream {} got {got:?} (garbage touched it: {}, client GOAWAY: {})",
        s.request, s.touched, s.client_goaway
    );
    // Hang up: the connection's task must end.
    drop(writer);
    drop(rd);
    let ended = future::or(
        async {
            task.await;
            true
        },
        async {
            glommio::timer::sleep(END_WITHIN).await;
            false
        },
    )
    .await;
    assert!(
        ended,
        "the connection did not end after the client hung up ({got:?})"
    );
    let kind = match got {
        Outcome::Answered => "answered".to_string(),
        Outcome::Reset(code) => format!("reset {code:#x}"),
        Outcome::Failed(_) => "failed".to_string(),
        Outcome::GoAway(code) => format!("goaway {code:#x}"),
        Outcome::Closed => "closed".to_string(),
        _ => "silent".to_string(),
    };
    (PEAK.load(Ordering::Relaxed).saturating_sub(start), kind)
}

/// How often a long run applies the harness's preload again: well inside the index's default
/// TTL (30 minutes), past which the preloaded replicas expire and a LookupRoute no longer ranks
/// them (the first 30-minute run with flood bursts failed its last case that way).
const PRELOAD_REFRESH: Duration = Duration::from_secs(600);

/// A case that makes no progress for [`HANG_AFTER`] (its own timers bound it to a few
/// seconds, so only an executor that sleeps past them gets there) ends the run, naming its
/// seed: a hang is a failure, not a silent stall of the long run.
const HANG_AFTER: Duration = Duration::from_secs(30);
/// A case with no progress for this long (ms) gets its executor woken by the watchdog.
const KICK_MS: u64 = 10_000;
/// The waker of the running case's top future, for the watchdog's wake-up.
static KICK: std::sync::Mutex<Option<std::task::Waker>> = std::sync::Mutex::new(None);
/// Wake-ups the watchdog gave.
static KICKS: AtomicU64 = AtomicU64::new(0);

/// Never ready: leaves the case's waker in [`KICK`] each time it is polled.
async fn kickable<T>() -> T {
    std::future::poll_fn(|cx| {
        *KICK.lock().unwrap_or_else(|e| e.into_inner()) = Some(cx.waker().clone());
        std::task::Poll::Pending
    })
    .await
}

struct Watchdog {
    /// The running case's seed and when it started (ms since the watchdog started); the
    /// start is `u64::MAX` between cases.
    seed: Arc<AtomicU64>,
    started_ms: Arc<AtomicU64>,
    epoch: Instant,
}

impl Watchdog {
    fn start() -> Watchdog {
        let w = Watchdog {
            seed: Arc::default(),
            started_ms: Arc::new(AtomicU64::new(u64::MAX)),
            epoch: Instant::now(),
        };
        let (seed, started_ms, epoch) = (w.seed.clone(), w.started_ms.clone(), w.epoch);
        std::thread::spawn(move || {
            let mut kicked = u64::MAX;
            loop {
                std::thread::sleep(Duration::from_secs(1));
                let started = started_ms.load(Ordering::Relaxed);
                let stalled = (epoch.elapsed().as_millis() as u64).saturating_sub(started);
                if started != u64::MAX && stalled > KICK_MS && kicked != started {
                    // Wake the executor from here: if the case then ends, the executor had
                    // slept past its own timers (counted, reported), not the server stalled.
                    kicked = started;
                    KICKS.fetch_add(1, Ordering::Relaxed);
                    let seed = seed.load(Ordering::Relaxed);
                    eprintln!("STALL: case seed {seed}: no progress for {KICK_MS} ms, woken");
                    if let Some(w) = KICK.lock().unwrap_or_else(|e| e.into_inner()).take() {
                        w.wake();
                    }
                }
                if started != u64::MAX && stalled > HANG_AFTER.as_millis() as u64 {
                    let seed = seed.load(Ordering::Relaxed);
                    eprintln!(
                        "HANG: case seed {seed} made no progress for {HANG_AFTER:?} \
                         (reproduce with FUZZ_SEED={seed} FUZZ_CASES=1)"
                    );
                    std::process::exit(101);
                }
            }
        });
        w
    }

    fn case(&self, seed: u64) {
        self.seed.store(seed, Ordering::Relaxed);
        let now = self.epoch.elapsed().as_millis() as u64;
        self.started_ms.store(now, Ordering::Relaxed);
    }
}

/// Prints the failing case's seed on the way out of a panic.
struct SeedOnPanic(u64);

impl Drop for SeedOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "FAILED case seed {0}: reproduce with FUZZ_SEED={0} FUZZ_CASES=1",
                self.0
            );
        }
    }
}

#[test]
fn fuzz_connection_frame_sequences() {
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    let secs = env("FUZZ_SECS");
    let base = env("FUZZ_SEED").unwrap_or_else(|| match secs {
        Some(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64),
        None => 0,
    });
    let cases = env("FUZZ_CASES").unwrap_or(if secs.is_some() {
        u64::MAX
    } else {
        SHORT_CASES
    });
    let until = secs.map(|s| Instant::now() + Duration::from_secs(s));
    let ex = frontend_harness::setup_core();
    let watchdog = Watchdog::start();
    let mut n = 0u64;
    let mut peak = 0;
    let mut retained_base = None;
    let mut outcomes = std::collections::BTreeMap::new();
    let mut preloaded = Instant::now();
    while n < cases && until.is_none_or(|t| Instant::now() < t) {
        if preloaded.elapsed() >= PRELOAD_REFRESH {
            frontend_harness::refresh_preload(&ex);
            preloaded = Instant::now();
        }
        let seed = base.wrapping_add(n);
        watchdog.case(seed);
        let guard = SeedOnPanic(seed);
        let (grown, kind) = ex.run(future::or(case(seed), kickable()));
        *outcomes.entry(kind).or_insert(0u64) += 1;
        drop(guard);
        assert!(
            grown <= PEAK_BOUND,
            "case seed {seed}: the heap grew by {grown} bytes at its peak"
        );
        peak = peak.max(grown);
        let live = LIVE.load(Ordering::Relaxed);
        let base_live = *retained_base.get_or_insert(live);
        assert!(
            live <= base_live + RETAINED_BOUND,
            "after {n} cases the heap holds {} bytes more than after the first",
            live - base_live
        );
        n += 1;
    }
    eprintln!(
        "fuzz_connection_frame_sequences: {n} cases from seed {base} passed; outcomes {outcomes:?}; \
         largest heap growth in a case {peak} bytes; executor stalls woken by the watchdog {}",
        KICKS.load(Ordering::Relaxed)
    );
    assert!(n > 0);
}
