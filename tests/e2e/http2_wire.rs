//! The gRPC port's HTTP/2 wire behaviour (RFC 9113), frame by frame, as a production client and
//! a hostile peer rely on it: the handshake, requests in every framing a client may choose,
//! pipelining, flow control in both directions, the connection errors the RFC requires, stream
//! errors, the advertised limits, and abuse that must not grow memory.
//!
//! Written against RFC 9113 behaviour, not against one HTTP/2 implementation: where the RFC
//! allows a stream error or a connection error, or several error codes, every allowed outcome
//! passes. Every read is bounded in time (tests/e2e/support/frames.rs), every loop in count.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use prost::Message;

use crate::support::frames::*;
use crate::support::*;

const LOOKUP_PATH: &str = "/inferencecache.v1alpha1.InferenceCache/LookupRoute";
const REPORT_PATH: &str = "/inferencecache.v1alpha1.InferenceCache/ReportCacheState";
const STATE_PATH: &str = "/inferencecache.v1alpha1.InferenceCache/GetCacheState";

/// How long the server may take to close the connection after its GOAWAY.
const CLOSE_WITHIN: Duration = Duration::from_secs(3);

/// A LookupRoute for an index that holds nothing for it, as one gRPC message.
fn lookup_body() -> Vec<u8> {
    grpc_message(&exact_lookup("t-wire", "m-wire", "vllm", b"h", 16).encode_to_vec()).to_vec()
}

/// Asserts `reply` is one successful LookupRoute answer and returns it.
fn lookup_answer(reply: &Reply, what: &str) -> pb::LookupRouteResponse {
    let msg = reply.expect_one_message(what);
    let r = pb::LookupRouteResponse::decode(&msg[..])
        .unwrap_or_else(|e| panic!("[{what}] not a LookupRouteResponse: {e}"));
    assert!(!r.reason_code.is_empty(), "[{what}] reason code: {r:?}");
    r
}

/// Writes one complete LookupRoute on `stream` (HEADERS, then DATA with END_STREAM).
async fn send_lookup(c: &mut FrameConn, stream: u32) {
    let mut w = headers(stream, &grpc_request_block(LOOKUP_PATH), false);
    w.extend_from_slice(&data(stream, &lookup_body(), true));
    c.send(&w).await;
}

/// The server is alive and a LookupRoute on a fresh connection is answered within `within`.
async fn assert_answers_within(srv: &mut Server, within: Duration, tag: &str) {
    assert!(
        srv.child.try_wait().unwrap().is_none(),
        "[{tag}] server process exited"
    );
    let start = Instant::now();
    let call = async {
        let mut c = FrameConn::handshake(srv.grpc_port).await;
        send_lookup(&mut c, 1).await;
        c.reply(1).await
    };
    let reply = tokio::time::timeout(within, call)
        .await
        .unwrap_or_else(|_| panic!("[{tag}] a new connection's LookupRoute took over {within:?}"));
    lookup_answer(&reply, tag);
    assert!(start.elapsed() <= within);
    assert!(
        srv.child.try_wait().unwrap().is_none(),
        "[{tag}] server process exited"
    );
}

// ---------------------------------------------------------------------------------------------
// 1. Handshake

/// After the client preface and an empty SETTINGS, the server's first frame is its SETTINGS
/// (RFC 9113 §3.4) with legal values, it ACKs ours (§6.5.3), and a PING is answered by a PING
/// ACK carrying the same 8 bytes (§6.7).
async fn handshake_settings_and_ping(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    let s = &c.server_settings;
    assert_ne!(
        s.get(&setting::ENABLE_PUSH),
        Some(&1),
        "a server must not set ENABLE_PUSH to 1"
    );
    if let Some(&v) = s.get(&setting::MAX_FRAME_SIZE) {
        assert!((16_384..=16_777_215).contains(&v), "MAX_FRAME_SIZE {v}");
    }
    if let Some(&v) = s.get(&setting::INITIAL_WINDOW_SIZE) {
        assert!(v as i64 <= MAX_WINDOW, "INITIAL_WINDOW_SIZE {v}");
    }
    let mut acked = false;
    for _ in 0..64 {
        match c.next().await {
            Event::Settings { ack: true, params } => {
                assert!(params.is_empty(), "a SETTINGS ACK has no payload");
                acked = true;
                break;
            }
            Event::GoAway { .. } | Event::Closed => panic!("connection ended in the handshake"),
            _ => {}
        }
    }
    assert!(acked, "our SETTINGS was not acknowledged");
    let opaque = *b"wire\x01\x02\x03\x04";
    c.send(&ping(false, opaque)).await;
    let mut ponged = false;
    for _ in 0..64 {
        match c.next().await {
            Event::Ping {
                ack: true,
                opaque: o,
            } => {
                assert_eq!(o, opaque, "PING ACK carries the PING's bytes");
                ponged = true;
                break;
            }
            Event::GoAway { .. } | Event::Closed => panic!("connection ended after a PING"),
            _ => {}
        }
    }
    assert!(ponged, "no PING ACK");
}
shards_1_and_2!(handshake_settings_and_ping);

// ---------------------------------------------------------------------------------------------
// 2. One LookupRoute, in every framing a client may choose

/// A LookupRoute as HEADERS + one DATA with END_STREAM; with its header block split over
/// HEADERS + two CONTINUATION frames; with PADDED and PRIORITY flags on HEADERS; with a padded
/// DATA frame. Each gets `:status` 200, `content-type: application/grpc`, one DATA message that
/// decodes as a LookupRouteResponse, and trailers with END_STREAM and `grpc-status: 0`.
async fn lookup_in_every_framing(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    let block = grpc_request_block(LOOKUP_PATH);
    let body = lookup_body();

    // Plain.
    send_lookup(&mut c, 1).await;
    let plain = lookup_answer(&c.reply(1).await, "plain");
    // The cold-start answer of an empty index (docs/BEHAVIOUR.md §8.5).
    assert_eq!(plain.reason_code, "NO_HINT", "{plain:?}");
    assert!(plain.replica_scores.is_empty(), "{plain:?}");

    // Split mid-field over HEADERS + CONTINUATION + CONTINUATION.
    let (a, rest) = block.split_at(7);
    let (b, d) = rest.split_at(rest.len() / 2);
    let mut w = frame(kind::HEADERS, 0, 3, a);
    w.extend_from_slice(&frame(kind::CONTINUATION, 0, 3, b));
    w.extend_from_slice(&frame(kind::CONTINUATION, flag::END_HEADERS, 3, d));
    w.extend_from_slice(&data(3, &body, true));
    c.send(&w).await;
    let split = lookup_answer(&c.reply(3).await, "continuation");

    // PADDED + PRIORITY: pad length, exclusive bit + dependency (stream 0), weight, block, pad.
    let mut p = vec![9u8];
    p.extend_from_slice(&0u32.to_be_bytes());
    p.push(200);
    p.extend_from_slice(&block);
    p.extend_from_slice(&[0u8; 9]);
    let mut w = frame(
        kind::HEADERS,
        flag::END_HEADERS | flag::PADDED | flag::PRIORITY,
        5,
        &p,
    );
    w.extend_from_slice(&data(5, &body, true));
    c.send(&w).await;
    let padded_headers = lookup_answer(&c.reply(5).await, "padded+priority headers");

    // Padded DATA.
    let mut w = headers(7, &block, false);
    w.extend_from_slice(&padded_data(7, &body, 33, true));
    c.send(&w).await;
    let padded_data = lookup_answer(&c.reply(7).await, "padded data");

    for (what, r) in [
        ("continuation", &split),
        ("padded headers", &padded_headers),
        ("padded data", &padded_data),
    ] {
        assert_eq!(r.reason_code, plain.reason_code, "{what}");
        assert_eq!(r.replica_scores, plain.replica_scores, "{what}");
    }
}
shards_1_and_2!(lookup_in_every_framing);

// ---------------------------------------------------------------------------------------------
// 3. Pipelining

/// `calls` LookupRoutes on streams 1, 3, … written in one go: each stream gets exactly one
/// complete answer of its own.
async fn pipelined_calls_each_get_one_answer(srv: &Server, calls: u32) {
    pipelined_blocks_each_get_one_answer(srv, calls, &grpc_request_block(LOOKUP_PATH)).await;
}

/// [`pipelined_calls_each_get_one_answer`] with every request's header block `block`.
async fn pipelined_blocks_each_get_one_answer(srv: &Server, calls: u32, block: &[u8]) {
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    let body = lookup_body();
    let ids: Vec<u32> = (0..calls).map(|i| 2 * i + 1).collect();
    let mut w = Vec::new();
    for &id in &ids {
        w.extend_from_slice(&headers(id, block, false));
        w.extend_from_slice(&data(id, &body, true));
    }
    c.send(&w).await;
    let replies = c.replies(&ids).await;
    assert_eq!(replies.len(), ids.len());
    for id in ids {
        let r = lookup_answer(&replies[&id], &format!("stream {id}"));
        assert_eq!(r.reason_code, "NO_HINT", "stream {id}: {r:?}");
    }
    // Nothing more comes on any of them (one answer each).
    for ev in c.drain(Duration::from_millis(200), 1_000).await {
        match ev {
            Event::Headers { stream, .. } | Event::Data { stream, .. } => {
                panic!("a second answer on stream {stream}")
            }
            Event::GoAway { .. } | Event::Closed => panic!("connection ended: {ev:?}"),
            _ => {}
        }
    }
}

/// 64 LookupRoutes on streams 1, 3, …, 127 written in one go: one answer each.
async fn pipelined_streams_each_get_one_answer(shards: usize) {
    let srv = Server::start(shards, &[]);
    pipelined_calls_each_get_one_answer(&srv, 64).await;
}
shards_1_and_2!(pipelined_streams_each_get_one_answer);

/// 1,000 LookupRoutes (2,000 frames) written in one go: more than one turn's frames
/// (`HTTP2_FRAMES_PER_TURN`, 256; or its time, `HTTP2_TURN_TIME`), so the connection yields
/// with frames still in its read buffer (counted) and comes back for them: every stream still
/// gets exactly one answer.
async fn pipelined_past_one_turn_each_get_one_answer(shards: usize) {
    let srv = Server::start(shards, &[]);
    pipelined_calls_each_get_one_answer(&srv, 1_000).await;
    // Cut by the frame count, or first by the turn's time (`HTTP2_TURN_TIME`: a debug build).
    let text = metrics_text(&srv);
    let cut: f64 = ["http2_frames_per_turn", "http2_turn_time"]
        .iter()
        .map(|l| {
            let series = format!("inferencecache_limit_hits_total{{limit=\"{l}\"}}");
            metric_value(&text, &series).unwrap_or(0.0)
        })
        .sum();
    assert!(cut >= 1.0, "no turn was cut short ({cut})");
}
shards_1_and_2!(pipelined_past_one_turn_each_get_one_answer);

/// 100 LookupRoutes (200 frames, under the frame budget) whose header lists each hold 350 small
/// fields (12.9 KB decoded, under the 16 KiB bound; 2.5 KB encoded, so the whole batch is read
/// in one turn), written in one go: more work than one turn may take (`HTTP2_TURN_TIME`,
/// 200 µs), so a turn is cut within its batch of frames (counted, `limit="http2_turn_time"`),
/// the rest of the batch goes back to the read buffer, and every stream still gets exactly one
/// answer.
async fn costly_header_blocks_past_one_turns_time_each_get_one_answer(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut fields = grpc_request_fields(LOOKUP_PATH);
    fields.extend(std::iter::repeat_n(("x-a", "b"), 350));
    pipelined_blocks_each_get_one_answer(&srv, 100, &header_block(&fields)).await;
    let series = "inferencecache_limit_hits_total{limit=\"http2_turn_time\"}";
    let cut = metric_value(&metrics_text(&srv), series).unwrap_or(0.0);
    assert!(cut >= 1.0, "no turn was cut by its time ({cut})");
}
shards_1_and_2!(costly_header_blocks_past_one_turns_time_each_get_one_answer);

// ---------------------------------------------------------------------------------------------
// 4. The server respects the client's flow-control windows

/// Reads a response on `stream` whose DATA is held to the client's windows: the client starts
/// with `stream_window` / `conn_window` and gives back `grant` more (on the stream, or on the
/// connection if `conn_level`) only once nothing arrived for a while. Asserts the server never
/// sends more than the window it was given, and that it did stop at the window at least once.
/// Returns the reply and the DATA bytes received.
async fn read_within_windows(
    c: &mut FrameConn,
    stream: u32,
    stream_window: i64,
    conn_window: i64,
    conn_level: bool,
    grant: u32,
) -> (Reply, i64) {
    let quiet = Duration::from_millis(300);
    let mut replies = HashMap::from([(stream, Reply::default())]);
    let (mut stream_granted, mut conn_granted) = (stream_window, conn_window);
    let mut received: i64 = 0;
    let mut stalls = 0;
    for _ in 0..20_000 {
        match c.next_within(quiet).await {
            Some(Event::Data {
                stream: s,
                flow_len,
                end_stream,
                payload,
            }) => {
                assert_eq!(s, stream, "DATA on another stream");
                received += flow_len as i64;
                assert!(
                    received <= stream_granted,
                    "server sent {received} bytes on the stream, window {stream_granted}"
                );
                assert!(
                    received <= conn_granted,
                    "server sent {received} bytes on the connection, window {conn_granted}"
                );
                let r = replies.get_mut(&stream).unwrap();
                r.body.extend_from_slice(&payload);
                r.ended = end_stream;
                if end_stream {
                    break;
                }
            }
            Some(Event::Headers {
                stream: s,
                end_stream,
                fields,
            }) => {
                assert_eq!(s, stream, "HEADERS on another stream");
                let r = replies.get_mut(&stream).unwrap();
                if r.head.is_empty() {
                    r.head = fields;
                } else {
                    r.trailers = Some(fields);
                }
                r.ended = end_stream;
                if end_stream {
                    break;
                }
            }
            Some(ev @ (Event::RstStream { .. } | Event::GoAway { .. } | Event::Closed)) => {
                panic!("call ended early: {ev:?}")
            }
            Some(_) => {}
            None => {
                // Quiet: the server waits for window (or is slow). Give more.
                stalls += 1;
                if conn_level {
                    conn_granted += grant as i64;
                    c.send(&window_update(0, grant)).await;
                } else {
                    stream_granted += grant as i64;
                    c.send(&window_update(stream, grant)).await;
                }
            }
        }
    }
    let reply = replies.remove(&stream).unwrap();
    assert!(reply.ended, "call did not end: {reply:?}");
    assert!(stalls >= 1, "the server never waited for window");
    (reply, received)
}

/// Replicas `r00`… holding the same prefix under ("t-flow", "m-flow"), each with stats.
async fn preload_replicas(srv: &Server, count: usize, id_len: usize) {
    let mut c = srv.client().await;
    let updates = (0..count)
        .map(|i| {
            let mut id = format!("r{i:05}");
            while id.len() < id_len {
                id.push('x');
            }
            let mut u = legacy_update(&id, "t-flow", "m-flow", "vllm", b"flow", 16);
            u.stats = stats(0.5, 0.25);
            u
        })
        .collect();
    assert!(report(&mut c, updates).await.accepted);
}

/// Streams that send a request head and nothing else, each head ~12 KB decoded from a few bytes
/// (one 4 KB header put in the HPACK table once and referenced three times per request): 10,000
/// of them per core would hold ~120 MB (more in memory). The heads of a core's open streams
/// are bounded together (32 MiB decoded): past it new streams are refused (REFUSED_STREAM,
/// `limit="http2_header_bytes_per_core"`), and once the peers go the core serves again. Found
/// by an abuse run: 40 such connections held 740 MB.
async fn header_only_streams_are_bounded_per_core(shards: usize) {
    const STREAMS: u32 = 1000;
    let mut srv = Server::start(shards, &[]);
    let conns = 10 * shards;
    let before = rss_bytes(srv.child.id());
    let big = "v".repeat(4000);
    let mut first = grpc_request_block(STATE_PATH);
    // Literal with incremental indexing, new name (RFC 7541 §6.2.1): dynamic entry 62.
    first.push(0x40);
    first.push(5);
    first.extend_from_slice(b"x-big");
    first.extend_from_slice(&[0x7f, 0xa1, 0x1e]); // 4000 = 127 + 33 + 30 × 128
    first.extend_from_slice(big.as_bytes());
    first.extend_from_slice(&[0xbe, 0xbe]);
    let mut next = grpc_request_block(STATE_PATH);
    next.extend_from_slice(&[0xbe, 0xbe, 0xbe]);
    let mut open = Vec::new();
    for _ in 0..conns {
        let mut c = FrameConn::handshake(srv.grpc_port).await;
        let mut w = headers(1, &first, false);
        for i in 1..STREAMS {
            w.extend_from_slice(&headers(2 * i + 1, &next, false));
        }
        c.send(&w).await;
        open.push(c);
    }
    let mut refused = 0;
    for c in &mut open {
        for _ in 0..(2 * STREAMS) {
            match c.next_within(Duration::from_millis(500)).await {
                Some(Event::RstStream {
                    code: code::REFUSED_STREAM,
                    ..
                }) => refused += 1,
                Some(ev @ (Event::RstStream { .. } | Event::GoAway { .. } | Event::Closed)) => {
                    panic!("{ev:?}")
                }
                Some(_) => {}
                None => break,
            }
        }
    }
    let grown = rss_bytes(srv.child.id()).saturating_sub(before);
    let held = conns as u64 * STREAMS as u64 * 12_000;
    assert!(refused > 0, "none of {conns} × {STREAMS} heads refused");
    assert!(
        grown < shards as u64 * (100 << 20),
        "{} MiB more for {} MB of heads",
        grown >> 20,
        held >> 20
    );
    let hits = metric_value(
        &metrics_text(&srv),
        "inferencecache_limit_hits_total{limit=\"http2_header_bytes_per_core\"}",
    );
    assert!(hits.unwrap_or(0.0) >= 1.0, "{hits:?}");
    drop(open);
    assert_answers_within(&mut srv, Duration::from_secs(5), "after the heads went").await;
}
shards_1_and_2!(header_only_streams_are_bounded_per_core);

/// A peer that never opens its windows (SETTINGS_INITIAL_WINDOW_SIZE 0) and sends 120
/// LookupRoutes whose answers are ~600 KB each: the server does not hold 70 MB of answers for
/// it. Past 16 MiB queued, new streams are refused (REFUSED_STREAM, counted in
/// `inferencecache_limit_hits_total{limit="http2_queued_response_bytes"}`) and the general
/// path's handlers wait for room; once the peer opens its windows every stream it was not
/// refused completes (no handler waits for room forever). Found by an abuse run: one such
/// connection held over 1 GB.
async fn a_peer_that_never_reads_gets_no_answer_after_answer(shards: usize) {
    const STREAMS: u32 = 120;
    const HOLDERS: usize = 600;
    let mut srv = Server::start(shards, &[]);
    // 600 replicas with 1,000-byte ids holding one prefix: a ~600 KB answer.
    let mut cl = srv.client().await;
    let updates = (0..HOLDERS)
        .map(|i| {
            let id = format!("r{i:05}{}", "x".repeat(994));
            let mut u = legacy_update(&id, "t-big", "m-big", "vllm", b"big", 128);
            u.stats = stats(0.5, 0.25);
            u
        })
        .collect();
    assert!(report(&mut cl, updates).await.accepted);
    // As many replicas without it: a prefix every replica holds routes nowhere in particular.
    let others = (0..400)
        .map(|i| {
            let mut u = legacy_update(&format!("o{i:05}"), "t-big", "m-big", "vllm", b"other", 128);
            u.stats = stats(0.5, 0.25);
            u
        })
        .collect();
    let ack = report(&mut cl, others).await;
    assert!(ack.accepted, "{ack:?}");
    let lookup_req = exact_lookup("t-big", "m-big", "vllm", b"big", 128);
    let mut answer = lookup(&mut cl, lookup_req.clone()).await;
    for _ in 0..50 {
        if answer.replica_scores.len() == 1024 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        answer = lookup(&mut cl, lookup_req.clone()).await;
    }
    assert_eq!(
        answer.replica_scores.len(),
        HOLDERS,
        "{}",
        answer.reason_code
    );
    assert!(answer.encoded_len() > 500 << 10, "{}", answer.encoded_len());
    let req = grpc_message(&lookup_req.encode_to_vec());
    let mut c = FrameConn::start(srv.grpc_port, &[(setting::INITIAL_WINDOW_SIZE, 0)]).await;
    c.auto_window = false;
    c.drain(Duration::from_millis(200), 64).await;
    let answered_inline = |srv: &Server| {
        let series = "inferencecache_grpc_inline_lookups_total{outcome=\"answered\"}";
        metric_value(&metrics_text(srv), series).unwrap_or(0.0)
    };
    let inline_before = answered_inline(&srv);
    let before = rss_bytes(srv.child.id());
    let ids: Vec<u32> = (0..STREAMS).map(|i| 2 * i + 1).collect();
    let mut w = Vec::new();
    for &id in &ids {
        w.extend_from_slice(&headers(id, &grpc_request_block(LOOKUP_PATH), false));
        w.extend_from_slice(&data(id, &req, true));
    }
    c.send(&w).await;
    let mut refused = Vec::new();
    for _ in 0..10_000 {
        match c.next_within(Duration::from_secs(2)).await {
            Some(Event::RstStream {
                stream,
                code: code::REFUSED_STREAM,
            }) => refused.push(stream),
            Some(ev @ (Event::RstStream { .. } | Event::GoAway { .. } | Event::Closed)) => {
                panic!("{ev:?}")
            }
            Some(_) => {}
            None => break,
        }
    }
    let grown = rss_bytes(srv.child.id()).saturating_sub(before);
    let inline = answered_inline(&srv) - inline_before;
    // With two cores the partition may be the other core's: then every call takes the
    // general path, whose handlers each hold their encoded answer while they wait for room
    // (bounded by the streams a connection may open, not by this limit), and only liveness
    // is checked below.
    if shards == 1 || inline > 0.0 {
        assert!(
            grown < 64 << 20,
            "{} MiB more for {STREAMS} unread answers",
            grown >> 20
        );
        // Inline answers: the streams past the bound are refused as they arrive.
        assert!(
            refused.len() as u32 >= STREAMS - 40,
            "{} refused",
            refused.len()
        );
        let hits = metric_value(
            &metrics_text(&srv),
            "inferencecache_limit_hits_total{limit=\"http2_queued_response_bytes\"}",
        );
        assert!(hits.unwrap_or(0.0) >= 1.0, "{hits:?}");
    }
    // Open the windows: every stream not refused gets its whole answer.
    c.auto_window = true;
    let mut open = settings(&[(setting::INITIAL_WINDOW_SIZE, 1 << 30)]);
    open.extend_from_slice(&window_update(0, 1 << 30));
    c.send(&open).await;
    // Their HEADERS may have come already: collect the bodies up to each END_STREAM.
    let mut bodies: HashMap<u32, Vec<u8>> = ids
        .into_iter()
        .filter(|id| !refused.contains(id))
        .map(|id| (id, Vec::new()))
        .collect();
    let mut open_streams = bodies.len();
    for _ in 0..1_000_000 {
        if open_streams == 0 {
            break;
        }
        match c.next_within(Duration::from_secs(10)).await {
            Some(Event::Data {
                stream,
                payload,
                end_stream,
                ..
            }) => {
                bodies
                    .get_mut(&stream)
                    .expect("a stream of ours")
                    .extend_from_slice(&payload);
                open_streams -= usize::from(end_stream);
            }
            Some(Event::Headers {
                end_stream: true, ..
            }) => open_streams -= 1,
            Some(ev @ (Event::RstStream { .. } | Event::GoAway { .. } | Event::Closed)) => {
                panic!("{ev:?}")
            }
            Some(_) => {}
            None => panic!("{open_streams} streams never completed once the windows opened"),
        }
    }
    for (id, body) in bodies {
        let r = pb::LookupRouteResponse::decode(&body[5..]).expect("an answer");
        assert_eq!(r.replica_scores.len(), HOLDERS, "stream {id}");
    }
    assert_answers_within(&mut srv, Duration::from_secs(5), "after the unread answers").await;
}
shards_1_and_2!(a_peer_that_never_reads_gets_no_answer_after_answer);

/// SETTINGS_INITIAL_WINDOW_SIZE 10: a LookupRoute answer larger than that arrives 10 bytes at a
/// time as the client sends stream WINDOW_UPDATEs, never past the window, and completes.
async fn server_respects_the_stream_window(shards: usize) {
    let srv = Server::start(shards, &[]);
    preload_replicas(&srv, 8, 8).await;
    let mut c = FrameConn::start(srv.grpc_port, &[(setting::INITIAL_WINDOW_SIZE, 10)]).await;
    c.auto_window = false;
    let req = exact_lookup("t-flow", "m-flow", "vllm", b"flow", 16);
    let mut w = headers(1, &grpc_request_block(LOOKUP_PATH), false);
    w.extend_from_slice(&data(1, &grpc_message(&req.encode_to_vec()), true));
    c.send(&w).await;
    let (reply, received) = read_within_windows(&mut c, 1, 10, DEFAULT_WINDOW, false, 16).await;
    assert!(
        received > 10,
        "the answer ({received} bytes) fits the window"
    );
    lookup_answer(&reply, "stream window");
}
shards_1_and_2!(server_respects_the_stream_window);

/// Stream window 1 MiB but the connection window at its initial 65,535: a GetCacheState answer
/// of ~100 KB stops at the connection window until the client sends a connection
/// WINDOW_UPDATE, never passes it, and completes.
async fn server_respects_the_connection_window(shards: usize) {
    const REPLICAS: usize = 1_000;
    let srv = Server::start(shards, &[]);
    preload_replicas(&srv, REPLICAS, 80).await;
    let mut c = FrameConn::start(srv.grpc_port, &[(setting::INITIAL_WINDOW_SIZE, 1 << 20)]).await;
    c.auto_window = false;
    let req = pb::GetCacheStateRequest {
        model_id: "m-flow".into(),
        tenant_id: "t-flow".into(),
    };
    let mut w = headers(1, &grpc_request_block(STATE_PATH), false);
    w.extend_from_slice(&data(1, &grpc_message(&req.encode_to_vec()), true));
    c.send(&w).await;
    let (reply, received) =
        read_within_windows(&mut c, 1, 1 << 20, DEFAULT_WINDOW, true, 65_535).await;
    assert!(
        received > DEFAULT_WINDOW,
        "the answer ({received} bytes) fits the connection window"
    );
    let msg = reply.expect_one_message("connection window");
    let r = pb::GetCacheStateResponse::decode(&msg[..]).expect("GetCacheStateResponse");
    assert_eq!(r.replicas.len(), REPLICAS);
}
shards_1_and_2!(server_respects_the_connection_window);

// ---------------------------------------------------------------------------------------------
// 5. Request body flow control

/// A client that sends a request body past the stream window the server advertised, without
/// waiting for WINDOW_UPDATE, gets FLOW_CONTROL_ERROR: RST_STREAM on the stream or GOAWAY
/// (RFC 9113 §6.9.1) — unless the server had opened its window for those bytes by then. The
/// window + 64 KiB go out in one write right after HEADERS; a server that consumes the body as
/// it arrives may grant more window before the excess arrives, which the client cannot see
/// the timing of, so the test asserts what it can: either FLOW_CONTROL_ERROR, or WINDOW_UPDATEs
/// covering every byte sent. A server that took bytes past every window it announced, and
/// said nothing, fails.
async fn body_past_the_stream_window_is_a_flow_control_error(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    // Let the server's preface (SETTINGS, its connection WINDOW_UPDATE) arrive.
    c.drain(Duration::from_millis(200), 64).await;
    let window = c.server_initial_window();
    assert!(window <= 16 << 20, "stream window {window}");
    let total = window as usize + 64 * 1024;
    // One ReportCacheState message declared at 4 MiB (the limit), sent past the window.
    let mut body = vec![0u8];
    body.extend_from_slice(&((4 << 20) as u32 - 5).to_be_bytes());
    body.resize(total, 0x0a);
    let mut w = headers(1, &grpc_request_block(REPORT_PATH), false);
    for chunk in body.chunks(DEFAULT_MAX_FRAME) {
        w.extend_from_slice(&data(1, chunk, false));
    }
    c.count_sent(1, total);
    // The server may already be closing while this is in flight.
    let _ = c.write(&w).await;
    for _ in 0..10_000 {
        match c.next_within(Duration::from_secs(1)).await {
            Some(Event::RstStream {
                stream: 1,
                code: code::FLOW_CONTROL_ERROR,
            })
            | Some(Event::GoAway {
                code: code::FLOW_CONTROL_ERROR,
                ..
            }) => return,
            Some(
                ev @ (Event::RstStream { stream: 1, .. } | Event::GoAway { .. } | Event::Closed),
            ) => {
                panic!("sent {total} bytes against a stream window of {window}: {ev:?}")
            }
            Some(_) => {}
            None => break,
        }
    }
    // No error: the server's WINDOW_UPDATEs must cover what it took.
    assert!(
        c.stream_send_window(1) >= 0 && c.conn_send_window >= 0,
        "sent {total} bytes on a stream window of {window}; the server took them without \
         FLOW_CONTROL_ERROR and granted only {} more on the stream ({} left on the connection)",
        c.stream_send_window(1) + total as i64 - window,
        c.conn_send_window
    );
}
shards_1_and_2!(body_past_the_stream_window_is_a_flow_control_error);

/// A 3 MiB ReportCacheState message sent in 16 KiB DATA frames that obey the server's windows
/// completes: the server's WINDOW_UPDATEs keep it moving (RFC 9113 §6.9).
async fn large_body_within_windows_completes(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    let update = pb::CacheStateUpdate {
        replica_id: "r-big".into(),
        model_id: "m-big".into(),
        tenant_id: "t-big".into(),
        hash_scheme: "vllm".into(),
        prefixes: (0..30_000u32)
            .map(|i| {
                let mut h = i.to_be_bytes().to_vec();
                h.resize(100, 0x5a);
                pb::PrefixEntry {
                    prefix_hash: h,
                    token_count: 16,
                    ..Default::default()
                }
            })
            .collect(),
        ..Default::default()
    };
    let body = grpc_message(&update.encode_to_vec()).to_vec();
    assert!(
        body.len() > 3 << 20 && body.len() < 4 << 20,
        "{}",
        body.len()
    );
    c.send(&headers(1, &grpc_request_block(REPORT_PATH), false))
        .await;
    c.send_body_in_window(1, &body, DEFAULT_MAX_FRAME).await;
    let reply = c.reply(1).await;
    let msg = reply.expect_one_message("3 MiB body");
    pb::Ack::decode(&msg[..]).expect("an Ack");
}
shards_1_and_2!(large_body_within_windows_completes);

/// gRPC clients (tonic, grpc-go) end a unary request with an empty DATA frame after the message.
/// Arriving in one write, such a LookupRoute stays on the inline path; with its end arriving
/// later it is handed to the general path. The answer is the same either way.
async fn message_then_empty_end_frame(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    let block = grpc_request_block(LOOKUP_PATH);
    let body = lookup_body();
    let mut w = headers(1, &block, false);
    w.extend_from_slice(&data(1, &body, false));
    w.extend_from_slice(&data(1, &[], true));
    c.send(&w).await;
    let together = lookup_answer(&c.reply(1).await, "together");

    let mut w = headers(3, &block, false);
    w.extend_from_slice(&data(3, &body, false));
    let handed_on_before = handed_on(&srv);
    c.send(&w).await;
    // The end goes out once the server took the message without it (and handed it on).
    let taken = wait_until(Duration::from_secs(30), || {
        handed_on(&srv) > handed_on_before
    });
    assert!(taken, "the message without its end was never handed on");
    c.send(&data(3, &[], true)).await;
    let apart = lookup_answer(&c.reply(3).await, "apart");
    assert_eq!(
        (&together.reason_code, &together.replica_scores),
        (&apart.reason_code, &apart.replica_scores)
    );

    let text = metrics_text(&srv);
    let count = |outcome: &str| {
        let series = format!("inferencecache_grpc_inline_lookups_total{{outcome=\"{outcome}\"}}");
        metric_value(&text, &series).unwrap_or(0.0) as usize
    };
    let (answered, awaited, handed_on) = (count("answered"), count("awaited"), count("handed_on"));
    if shards == 1 {
        assert_eq!(
            (answered, awaited, handed_on),
            (1, 0, 1),
            "together inline, apart handed on"
        );
    } else {
        // With two cores the partition may be the other core's: then "together" is decided in
        // the turn and awaited from the owner.
        assert_eq!((answered + awaited, handed_on), (1, 1), "{text}");
    }
}
shards_1_and_2!(message_then_empty_end_frame);

/// `inferencecache_grpc_inline_lookups_total{outcome="handed_on"}` of `srv`.
fn handed_on(srv: &Server) -> f64 {
    let series = "inferencecache_grpc_inline_lookups_total{outcome=\"handed_on\"}";
    metric_value(&metrics_text(srv), series).unwrap_or(0.0)
}

/// Sends a LookupRoute with `fields` on `stream`, inline (message and end in one write) or
/// split (the end 50 ms later, so the general path answers), and returns what became of it.
async fn lookup_with_fields(
    c: &mut FrameConn,
    stream: u32,
    fields: &[(&str, &str)],
    split: bool,
) -> Failure {
    let mut w = headers(stream, &header_block(fields), false);
    w.extend_from_slice(&data(stream, &lookup_body(), !split));
    let _ = c.write(&w).await;
    if split {
        // The gap is the framing under test; were both parts read together the inline framing
        // is checked twice, never a wrong verdict.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let _ = c.write(&data(stream, &[], true)).await;
    }
    c.failure(stream).await
}

/// A request the general path cannot take (a control character in a value, an authority or a
/// scheme that does not parse) is refused the same way on the inline path: a stream error
/// PROTOCOL_ERROR whatever the framing, never an answer (RFC 9113 §8.2.1, §8.1.1; grpc-go
/// refuses the same). Found by an abuse run: the inline path answered them with success.
async fn a_malformed_field_is_refused_in_every_framing(shards: usize) {
    let mut srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    let mut stream = 1;
    for (name, value) in [
        ("x-a", "a\u{1}b"),
        ("x-a", "a\u{7f}b"),
        ("grpc-timeout", "1S\u{1}"),
        (":authority", "a b"),
        (":authority", "[zz"),
        (":scheme", "h t"),
    ] {
        let mut fields: Vec<(&str, &str)> = grpc_request_fields(LOOKUP_PATH)
            .into_iter()
            .filter(|(n, _)| *n != name)
            .collect();
        fields.push((name, value));
        for split in [false, true] {
            let f = lookup_with_fields(&mut c, stream, &fields, split).await;
            assert!(
                matches!(f, Failure::Reset(code::PROTOCOL_ERROR)),
                "{name}: {value:?}, split {split}: {f:?}"
            );
            stream += 2;
        }
    }
    send_lookup(&mut c, stream).await;
    lookup_answer(&c.reply(stream).await, "same connection");
    assert_answers_within(&mut srv, Duration::from_secs(5), "after malformed fields").await;
}
shards_1_and_2!(a_malformed_field_is_refused_in_every_framing);

/// A repeated `grpc-encoding` or `content-type` gets the general path's answer in every
/// framing (the inline path used to read the last value, tonic reads the first).
async fn repeated_grpc_fields_get_one_answer_in_every_framing(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    let mut stream = 1;
    for extra in [
        [("grpc-encoding", "gzip"), ("grpc-encoding", "identity")],
        [
            ("content-type", "application/json"),
            ("content-type", "application/grpc"),
        ],
    ] {
        let mut fields: Vec<(&str, &str)> = grpc_request_fields(LOOKUP_PATH)
            .into_iter()
            .filter(|(n, _)| *n != extra[0].0)
            .collect();
        fields.extend(extra);
        let inline = lookup_with_fields(&mut c, stream, &fields, false).await;
        let general = lookup_with_fields(&mut c, stream + 2, &fields, true).await;
        stream += 4;
        assert_eq!(
            format!("{inline:?}"),
            format!("{general:?}"),
            "{extra:?}: inline {inline:?}, general {general:?}"
        );
    }
}
shards_1_and_2!(repeated_grpc_fields_get_one_answer_in_every_framing);

/// A body sent in padded DATA frames, 100 bytes of data and 255 of padding each, within the
/// server's windows: the padding comes back to the stream's window as well as the
/// connection's (RFC 9113 §6.1), so the 1.4 MiB of padding in this body never stalls it. Found
/// by an abuse run: the stream's window never got its padding back and stalled for good.
async fn padded_body_past_the_stream_window_completes(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    c.drain(Duration::from_millis(200), 64).await;
    let update = pb::CacheStateUpdate {
        replica_id: "r-pad".into(),
        model_id: "m-pad".into(),
        tenant_id: "t-pad".into(),
        hash_scheme: "vllm".into(),
        prefixes: (0..5_000u32)
            .map(|i| pb::PrefixEntry {
                prefix_hash: i.to_be_bytes().repeat(25),
                token_count: 16,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let body = grpc_message(&update.encode_to_vec()).to_vec();
    let (chunk, pad) = (100usize, 255u8);
    let frame_flow = 1 + chunk + pad as usize;
    assert!(
        body.len() / chunk * pad as usize > 1 << 20,
        "padding must exceed the stream window"
    );
    c.send(&headers(1, &grpc_request_block(REPORT_PATH), false))
        .await;
    let mut off = 0;
    for _ in 0..100_000 {
        if off == body.len() {
            break;
        }
        let room = c.conn_send_window.min(c.stream_send_window(1));
        if room < frame_flow as i64 {
            let ev = c.next_within(Duration::from_secs(3)).await;
            assert!(
                ev.is_some(),
                "stalled at {off} of {} bytes: no window came back",
                body.len()
            );
            continue;
        }
        let n = chunk.min(body.len() - off);
        let end = off + n == body.len();
        c.send(&padded_data(1, &body[off..off + n], pad, end)).await;
        c.count_sent(1, 1 + n + pad as usize);
        off += n;
    }
    assert_eq!(off, body.len());
    let reply = c.reply(1).await;
    let msg = reply.expect_one_message("padded body");
    pb::Ack::decode(&msg[..]).expect("an Ack");
}
shards_1_and_2!(padded_body_past_the_stream_window_completes);

/// Every request body the server takes from the connection window comes back, whatever became
/// of the stream: answered inline, a message then an empty end frame, split, trailed, reset by
/// the client after its message, or reset while the server waits for the end. 3,000 streams of
/// ~4 KiB each on one connection are 12 times its 1 MiB window, 2 windows per kind, and the
/// client never sends past the window, so a leak on any one path stalls the scenario (the
/// reads time out).
async fn connection_window_comes_back_from_every_kind_of_stream(shards: usize) {
    const STREAMS: u32 = 3_000;
    const SERVER_CONNECTION_WINDOW: i64 = 1 << 20;
    let srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    let block = grpc_request_block(LOOKUP_PATH);
    let msg =
        grpc_message(&exact_lookup("t-wire", "m-wire", "vllm", &[7u8; 4000], 16).encode_to_vec())
            .to_vec();
    let mut answered = 0;
    for i in 0..STREAMS {
        let id = 2 * i + 1;
        while c.conn_send_window < msg.len() as i64 {
            // Room comes only with the server's WINDOW_UPDATEs.
            let _ = c.next().await;
        }
        let mut w = headers(id, &block, false);
        c.count_sent(id, msg.len());
        match i % 6 {
            0 => w.extend_from_slice(&data(id, &msg, true)),
            1 => {
                w.extend_from_slice(&data(id, &msg, false));
                w.extend_from_slice(&data(id, &[], true));
            }
            2 => {
                w.extend_from_slice(&data(id, &msg[..7], false));
                w.extend_from_slice(&data(id, &msg[7..], true));
            }
            3 => {
                w.extend_from_slice(&data(id, &msg, false));
                w.extend_from_slice(&headers(id, &[], true));
            }
            4 => {
                w.extend_from_slice(&data(id, &msg, false));
                w.extend_from_slice(&frame(kind::RST_STREAM, 0, id, &code::CANCEL.to_be_bytes()));
            }
            _ => w.extend_from_slice(&data(id, &msg, false)),
        }
        c.send(&w).await;
        match i % 6 {
            4 => {}
            5 => {
                // Let the server take the message on, then give up on the call (the timing
                // varies the interleaving under test; nothing is asserted on it).
                tokio::time::sleep(Duration::from_millis(2)).await;
                c.send(&frame(kind::RST_STREAM, 0, id, &code::CANCEL.to_be_bytes()))
                    .await;
            }
            _ => {
                lookup_answer(&c.reply(id).await, "every kind");
                answered += 1;
            }
        }
        // Nor does more come back than was sent: the window never grows past what the server
        // advertised (its 1 MiB connection window), or its bound on buffered bodies is gone.
        assert!(
            c.conn_send_window <= SERVER_CONNECTION_WINDOW,
            "stream {id}: window {} > {SERVER_CONNECTION_WINDOW}",
            c.conn_send_window
        );
    }
    assert_eq!(answered, 4 * STREAMS / 6);
}
shards_1_and_2!(connection_window_comes_back_from_every_kind_of_stream);

// ---------------------------------------------------------------------------------------------
// 6. Connection errors

/// Sends `bad` after the handshake (and after `before`, answered first if it is a request) and
/// asserts the server answers with GOAWAY carrying one of `allowed` (any code if empty) and
/// closes the connection.
async fn connection_error(shards: usize, before: Option<u32>, bad: Vec<u8>, allowed: &[u32]) {
    let mut srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    if let Some(stream) = before {
        send_lookup(&mut c, stream).await;
        lookup_answer(&c.reply(stream).await, "before");
    }
    let _ = c.write(&bad).await;
    let code = c.expect_goaway_and_close(CLOSE_WITHIN).await;
    assert!(
        allowed.is_empty() || allowed.contains(&code),
        "GOAWAY code {code:#x}, allowed {allowed:x?}"
    );
    drop(c);
    assert_answers_within(&mut srv, Duration::from_secs(5), "after the error").await;
}

/// DATA on stream 0: PROTOCOL_ERROR (§6.1).
async fn data_on_stream_0(shards: usize) {
    connection_error(shards, None, data(0, b"x", false), &[code::PROTOCOL_ERROR]).await;
}
shards_1_and_2!(data_on_stream_0);

/// HEADERS on an even (server-initiated) stream id: PROTOCOL_ERROR (§5.1.1).
async fn headers_on_an_even_stream(shards: usize) {
    let bad = headers(2, &grpc_request_block(LOOKUP_PATH), true);
    connection_error(shards, None, bad, &[code::PROTOCOL_ERROR]).await;
}
shards_1_and_2!(headers_on_an_even_stream);

/// A HEADERS frame one byte larger than SETTINGS_MAX_FRAME_SIZE (16,384 unless the server
/// advertised more): a frame carrying a field block, so a connection error FRAME_SIZE_ERROR
/// (§4.2).
async fn frame_over_max_frame_size(shards: usize) {
    let mut srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    let max = c
        .server_settings
        .get(&setting::MAX_FRAME_SIZE)
        .map_or(DEFAULT_MAX_FRAME, |v| *v as usize);
    // The request's fields plus one filler field, sized so the block is exactly `max + 1`
    // bytes (the filler's length prefix grows with it: size it, then correct once).
    let request = grpc_request_block(LOOKUP_PATH);
    let with_fill = |fill: usize| {
        let mut b = request.clone();
        literal_field(&mut b, b"x-fill", &vec![b'a'; fill]);
        b
    };
    let guess = max + 1 - request.len();
    let fill = guess - (with_fill(guess).len() - (max + 1));
    let block = with_fill(fill);
    assert_eq!(block.len(), max + 1);
    let _ = c.write(&headers(1, &block, true)).await;
    let code = c.expect_goaway_and_close(CLOSE_WITHIN).await;
    assert_eq!(code, code::FRAME_SIZE_ERROR, "GOAWAY code");
    drop(c);
    assert_answers_within(&mut srv, Duration::from_secs(5), "after the error").await;
}
shards_1_and_2!(frame_over_max_frame_size);

/// WINDOW_UPDATE with increment 0 on stream 0: PROTOCOL_ERROR (§6.9).
async fn window_update_of_zero_on_the_connection(shards: usize) {
    connection_error(shards, None, window_update(0, 0), &[code::PROTOCOL_ERROR]).await;
}
shards_1_and_2!(window_update_of_zero_on_the_connection);

/// A WINDOW_UPDATE that takes the server's connection send window (65,535) past 2^31 - 1:
/// FLOW_CONTROL_ERROR (§6.9.1).
async fn window_update_overflowing_the_connection_window(shards: usize) {
    let bad = window_update(0, MAX_WINDOW as u32);
    connection_error(shards, None, bad, &[code::FLOW_CONTROL_ERROR]).await;
}
shards_1_and_2!(window_update_overflowing_the_connection_window);

/// A SETTINGS frame whose length is not a multiple of 6 octets.
fn settings_of_bad_length_frame() -> Vec<u8> {
    frame(kind::SETTINGS, 0, 0, &[0, 4, 0, 0, 1, 0, 0])
}

/// A SETTINGS frame whose length is not a multiple of 6 is a connection error of type
/// FRAME_SIZE_ERROR (§6.5): GOAWAY and close.
async fn settings_of_bad_length(shards: usize) {
    let bad = settings_of_bad_length_frame();
    connection_error(shards, None, bad, &[code::FRAME_SIZE_ERROR]).await;
}
shards_1_and_2!(settings_of_bad_length);

/// SETTINGS_INITIAL_WINDOW_SIZE above 2^31 - 1 is a connection error of type
/// FLOW_CONTROL_ERROR (§6.5.2): GOAWAY and close. (h2 0.4.20 answered PROTOCOL_ERROR here.)
async fn settings_initial_window_too_large(shards: usize) {
    let bad = settings(&[(setting::INITIAL_WINDOW_SIZE, 1 << 31)]);
    connection_error(shards, None, bad, &[code::FLOW_CONTROL_ERROR]).await;
}
shards_1_and_2!(settings_initial_window_too_large);

/// CONTINUATION without a preceding HEADERS: PROTOCOL_ERROR (§6.10).
async fn continuation_without_headers(shards: usize) {
    let bad = frame(
        kind::CONTINUATION,
        flag::END_HEADERS,
        1,
        &grpc_request_block(LOOKUP_PATH),
    );
    connection_error(shards, None, bad, &[code::PROTOCOL_ERROR]).await;
}
shards_1_and_2!(continuation_without_headers);

/// After stream 5 was used, HEADERS on stream 3 (lower than one already opened): PROTOCOL_ERROR
/// (§5.1.1).
async fn decreasing_stream_ids(shards: usize) {
    let bad = headers(3, &grpc_request_block(LOOKUP_PATH), true);
    connection_error(shards, Some(5), bad, &[code::PROTOCOL_ERROR]).await;
}
shards_1_and_2!(decreasing_stream_ids);

// ---------------------------------------------------------------------------------------------
// 7. Stream-level rules

/// RST_STREAM from the client on an open stream is taken without a connection error, and a
/// later call on a new stream of the same connection is answered (§6.4).
async fn client_reset_is_tolerated(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    let body = lookup_body();
    let mut w = headers(1, &grpc_request_block(LOOKUP_PATH), false);
    w.extend_from_slice(&data(1, &body[..3], false));
    w.extend_from_slice(&rst_stream(1, code::CANCEL));
    c.send(&w).await;
    // A reset before any data of the answer, too.
    let mut w = headers(3, &grpc_request_block(REPORT_PATH), false);
    w.extend_from_slice(&rst_stream(3, code::CANCEL));
    c.send(&w).await;
    send_lookup(&mut c, 5).await;
    lookup_answer(&c.reply(5).await, "after resets");
    assert_eq!(c.goaway, None);
}
shards_1_and_2!(client_reset_is_tolerated);

/// A request without `:path` (or without `:method`) is malformed (§8.3.1): the stream fails
/// with PROTOCOL_ERROR — RST_STREAM, or a GOAWAY — or, as §8.1.1 allows for malformed
/// requests, is answered with a 4xx first; the server stays up and serves new calls.
async fn malformed_request(shards: usize, missing: &str) {
    let mut srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    let fields: Vec<(&str, &str)> = grpc_request_fields(LOOKUP_PATH)
        .into_iter()
        .filter(|(n, _)| *n != missing)
        .collect();
    let mut w = headers(1, &header_block(&fields), false);
    w.extend_from_slice(&data(1, &lookup_body(), true));
    let _ = c.write(&w).await;
    let f = c.failure(1).await;
    match &f {
        Failure::Reset(code::PROTOCOL_ERROR) | Failure::GoAway(code::PROTOCOL_ERROR) => {}
        Failure::Answered {
            status: Some(s), ..
        } if s.starts_with('4') => {}
        other => panic!("request without {missing}: {other:?}"),
    }
    if !matches!(f, Failure::GoAway(_)) {
        send_lookup(&mut c, 3).await;
        lookup_answer(&c.reply(3).await, "same connection");
    }
    assert_answers_within(&mut srv, Duration::from_secs(5), "after malformed").await;
}

async fn request_without_path(shards: usize) {
    malformed_request(shards, ":path").await;
}
shards_1_and_2!(request_without_path);

async fn request_without_method(shards: usize) {
    malformed_request(shards, ":method").await;
}
shards_1_and_2!(request_without_method);

// ---------------------------------------------------------------------------------------------
// 8. Limits

/// More streams than SETTINGS_MAX_CONCURRENT_STREAMS open at once: the streams past the limit
/// are refused with RST_STREAM REFUSED_STREAM or PROTOCOL_ERROR (§5.1.2), or the connection is
/// closed; the streams within the limit are not refused; the server stays healthy.
async fn streams_past_max_concurrent_are_refused(shards: usize) {
    const EXTRA: u32 = 8;
    let mut srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    // The SETTINGS ACK must be on the wire before the streams (the limit applies once acked):
    // FrameConn ACKed the server's SETTINGS when it read them.
    let limit = *c
        .server_settings
        .get(&setting::MAX_CONCURRENT_STREAMS)
        .expect("the server advertises SETTINGS_MAX_CONCURRENT_STREAMS");
    assert!((1..=100_000).contains(&limit), "limit {limit}");
    let block = grpc_request_block(REPORT_PATH);
    let ids: Vec<u32> = (0..limit + EXTRA).map(|i| 2 * i + 1).collect();
    let mut w = Vec::new();
    for &id in &ids {
        w.extend_from_slice(&headers(id, &block, false));
    }
    let _ = c.write(&w).await;
    let extra: Vec<u32> = ids[limit as usize..].to_vec();
    let mut refused = Vec::new();
    let mut ended = false;
    for _ in 0..10_000 {
        match c.next().await {
            Event::RstStream { stream, code } => {
                assert!(
                    code == code::REFUSED_STREAM || code == code::PROTOCOL_ERROR,
                    "stream {stream} reset with {code:#x}"
                );
                if extra.contains(&stream) {
                    refused.push(stream);
                } else {
                    assert_eq!(
                        code,
                        code::REFUSED_STREAM,
                        "stream {stream} is within the limit"
                    );
                }
                if refused.len() == extra.len() {
                    break;
                }
            }
            Event::GoAway { .. } | Event::Closed => {
                ended = true;
                break;
            }
            _ => {}
        }
    }
    assert!(
        ended || refused.len() == extra.len(),
        "refused {refused:?} of the extra {extra:?}"
    );
    drop(c);
    assert_answers_within(&mut srv, Duration::from_secs(5), "after max streams").await;
}
shards_1_and_2!(streams_past_max_concurrent_are_refused);

/// A header list larger than SETTINGS_MAX_HEADER_LIST_SIZE, sent as HEADERS + CONTINUATION
/// with a valid request body: the call does not succeed — RST_STREAM, GOAWAY, or an error
/// answer (HTTP 431, or a gRPC error status) — and a new connection still works (§10.5.1).
async fn header_list_over_the_limit_fails(shards: usize) {
    let mut srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    let limit = *c
        .server_settings
        .get(&setting::MAX_HEADER_LIST_SIZE)
        .expect("the server advertises SETTINGS_MAX_HEADER_LIST_SIZE") as usize;
    assert!(limit <= 1 << 20, "limit {limit}");
    let mut block = grpc_request_block(LOOKUP_PATH);
    // Four fields adding up past the limit (each field counts 32 bytes of overhead too).
    for i in 0..4 {
        let name = format!("x-big-{i}");
        literal_field(&mut block, name.as_bytes(), &vec![b'v'; limit / 4 + 64]);
    }
    let mut w = Vec::new();
    let chunks: Vec<&[u8]> = block.chunks(DEFAULT_MAX_FRAME).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let last = if i + 1 == chunks.len() {
            flag::END_HEADERS
        } else {
            0
        };
        let k = if i == 0 {
            kind::HEADERS
        } else {
            kind::CONTINUATION
        };
        w.extend_from_slice(&frame(k, last, 1, chunk));
    }
    w.extend_from_slice(&data(1, &lookup_body(), true));
    let _ = c.write(&w).await;
    let f = c.failure(1).await;
    match f {
        Failure::Reset(_) | Failure::GoAway(_) | Failure::Closed => {}
        Failure::Answered {
            status,
            grpc_status,
        } => assert!(
            status.as_deref() == Some("431")
                || (status.as_deref() == Some("200")
                    && grpc_status.as_deref().is_some_and(|g| g != "0")),
            "oversized header list answered: {status:?} grpc-status {grpc_status:?}"
        ),
    }
    drop(c);
    assert_answers_within(&mut srv, Duration::from_secs(5), "after big headers").await;
}
shards_1_and_2!(header_list_over_the_limit_fails);

/// HEADERS without END_HEADERS followed by up to 1,000 CONTINUATION frames of 16 KiB: the
/// server cuts the connection off (GOAWAY or close) long before all of it is sent, and its
/// RSS does not grow by more than a few tens of MiB.
async fn endless_continuation_is_cut_off(shards: usize) {
    const FRAMES: usize = 1_000;
    let mut srv = Server::start(shards, &[]);
    let before = rss_bytes(srv.child.id());
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    c.send(&frame(
        kind::HEADERS,
        0,
        1,
        &grpc_request_block(LOOKUP_PATH),
    ))
    .await;
    let mut fill = Vec::new();
    literal_field(&mut fill, b"x-fill", &vec![b'a'; DEFAULT_MAX_FRAME - 16]);
    assert!(fill.len() <= DEFAULT_MAX_FRAME);
    let cont = frame(kind::CONTINUATION, 0, 1, &fill);
    let mut sent = 0;
    while sent < FRAMES {
        if c.write(&cont).await.is_err() {
            break;
        }
        sent += 1;
    }
    let grown = rss_bytes(srv.child.id()).saturating_sub(before);
    // The connection is cut off: a GOAWAY (any code) and a close, or a close.
    let mut cut = false;
    for _ in 0..10_000 {
        match c.next().await {
            Event::GoAway { .. } => {}
            Event::Closed => {
                cut = true;
                break;
            }
            _ => {}
        }
    }
    assert!(cut, "the connection was not closed");
    assert!(
        sent < FRAMES,
        "all {FRAMES} CONTINUATION frames ({} MiB of one header block) were taken",
        (FRAMES * DEFAULT_MAX_FRAME) >> 20
    );
    assert!(
        grown < 48 << 20,
        "RSS grew by {} MiB ({sent} frames sent)",
        grown >> 20
    );
    drop(c);
    assert_answers_within(&mut srv, Duration::from_secs(5), "after continuations").await;
}
shards_1_and_2!(endless_continuation_is_cut_off);

// ---------------------------------------------------------------------------------------------
// 9. Abuse that must not grow memory

/// A PING flood from a client that never reads (and keeps a small receive buffer): the server
/// stops reading (the client's writes stall) or closes, rather than buffering PING ACKs; its
/// RSS stays bounded and a new connection is served. The flood is bounded at 1,000,000 PINGs
/// (17 MB): 100,000 (1.7 MB) fit in the loopback socket buffers alone, so a server that
/// buffered its ACKs could not be told from one that pushed back (on this machine, h2 pushes
/// back after ~410,000, ~7 MB of kernel buffers).
async fn ping_flood_without_reading(shards: usize) {
    const PINGS: usize = 1_000_000;
    const BATCH: usize = 1_000;
    let mut srv = Server::start(shards, &[]);
    let before = rss_bytes(srv.child.id());
    // A small receive buffer: the PING ACKs back up into the server at once.
    let conn = FrameConn::connect_with(srv.grpc_port, Some(4096)).await;
    let mut c = FrameConn::start_on(conn, &[]).await;
    let mut batch = Vec::with_capacity(BATCH * 17);
    for i in 0..BATCH {
        batch.extend_from_slice(&ping(false, (i as u64).to_be_bytes()));
    }
    let mut sent = 0;
    while sent < PINGS {
        // A write that blocks means the server stopped reading: what it should do.
        let w = tokio::time::timeout(Duration::from_secs(1), c.write(&batch)).await;
        if !matches!(w, Ok(Ok(()))) {
            break;
        }
        sent += BATCH;
    }
    // Stalled or closed (a failed write) before the bound.
    assert!(
        sent < PINGS,
        "the server took all {PINGS} PINGs from a client that reads nothing"
    );
    // A new connection answered means the server got past the PINGs it took.
    assert_answers_within(&mut srv, Duration::from_secs(5), "during the flood").await;
    let grown = rss_bytes(srv.child.id()).saturating_sub(before);
    assert!(
        grown < 32 << 20,
        "RSS grew by {} MiB after {sent} unread PINGs",
        grown >> 20
    );
    drop(c);
    assert_answers_within(&mut srv, Duration::from_secs(5), "after the flood").await;
}
shards_1_and_2!(ping_flood_without_reading);

/// Rapid reset: 10,000 HEADERS each followed at once by RST_STREAM. The server may GOAWAY the
/// abusive connection; it stays healthy, and a new connection's LookupRoute is answered within
/// a second.
async fn rapid_reset(shards: usize) {
    const STREAMS: u32 = 10_000;
    const BATCH: u32 = 500;
    let mut srv = Server::start(shards, &[]);
    let before = rss_bytes(srv.child.id());
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    let block = grpc_request_block(LOOKUP_PATH);
    let mut sent = 0;
    'outer: while sent < STREAMS {
        let mut w = Vec::new();
        for i in sent..sent + BATCH {
            let id = 2 * i + 1;
            w.extend_from_slice(&headers(id, &block, false));
            w.extend_from_slice(&rst_stream(id, code::CANCEL));
        }
        if c.write(&w).await.is_err() {
            break 'outer;
        }
        sent += BATCH;
    }
    assert_answers_within(&mut srv, Duration::from_secs(1), "after rapid reset").await;
    let grown = rss_bytes(srv.child.id()).saturating_sub(before);
    assert!(
        grown < 64 << 20,
        "RSS grew by {} MiB after {sent} reset streams",
        grown >> 20
    );
    // Whatever the abusive connection got, it was not a crash: drop it, check once more.
    drop(c);
    assert_answers_within(&mut srv, Duration::from_secs(1), "after dropping it").await;
}
shards_1_and_2!(rapid_reset);

// ---------------------------------------------------------------------------------------------
// 10. GOAWAY from the client

/// After the client sends GOAWAY, the stream it opened before is still answered (§6.8: the
/// GOAWAY limits the streams its receiver may initiate; this one is the client's).
async fn client_goaway_keeps_open_streams(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    c.send(&headers(1, &grpc_request_block(LOOKUP_PATH), false))
        .await;
    c.send(&goaway(0, code::NO_ERROR)).await;
    c.send(&data(1, &lookup_body(), true)).await;
    let mut replies = c.replies_through_goaway(&[1]).await;
    lookup_answer(&replies.remove(&1).unwrap(), "after client GOAWAY");
}
shards_1_and_2!(client_goaway_keeps_open_streams);

// ---------------------------------------------------------------------------------------------
// 11. Stream states, priorities and malformed requests (issue 32)

/// Reads until `stream` is reset and returns the code; the stream may be answered first (the
/// RFC's reaction does not depend on whether the answer went). Fails the scenario on a GOAWAY,
/// the connection closing, or no reset.
async fn reset_code(c: &mut FrameConn, stream: u32) -> u32 {
    for _ in 0..1_000 {
        match c.next().await {
            Event::RstStream { stream: s, code } if s == stream => return code,
            ev @ (Event::GoAway { .. } | Event::Closed) => {
                panic!("stream {stream}: connection ended instead of a stream error: {ev:?}")
            }
            _ => {}
        }
    }
    panic!("stream {stream}: no RST_STREAM within 1,000 frames");
}

/// A HEADERS frame whose priority block (exclusive bit clear, weight 16) depends on `dependency`.
fn headers_with_priority(stream: u32, dependency: u32, block: &[u8], flags: u8) -> Vec<u8> {
    let mut p = dependency.to_be_bytes().to_vec();
    p.push(15);
    p.extend_from_slice(block);
    frame(kind::HEADERS, flags | flag::PRIORITY, stream, &p)
}

/// HEADERS whose priority names the stream itself is a stream error PROTOCOL_ERROR (RFC 9113
/// §5.3.1), with the block whole or continued; the DATA after it is dropped, and the
/// connection serves the next call.
async fn headers_depending_on_their_own_stream(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    let block = grpc_request_block(LOOKUP_PATH);
    let mut w = headers_with_priority(1, 1, &block, flag::END_HEADERS);
    w.extend_from_slice(&data(1, &lookup_body(), true));
    c.send(&w).await;
    assert_eq!(c.failure(1).await, Failure::Reset(code::PROTOCOL_ERROR));
    // The same, with the header block continued (the check survives the CONTINUATION).
    let (a, b) = block.split_at(block.len() / 2);
    let mut w = headers_with_priority(3, 3, a, 0);
    w.extend_from_slice(&frame(kind::CONTINUATION, flag::END_HEADERS, 3, b));
    w.extend_from_slice(&data(3, &lookup_body(), true));
    c.send(&w).await;
    assert_eq!(c.failure(3).await, Failure::Reset(code::PROTOCOL_ERROR));
    // A priority on another stream is fine.
    let mut w = headers_with_priority(5, 1, &block, flag::END_HEADERS);
    w.extend_from_slice(&data(5, &lookup_body(), true));
    c.send(&w).await;
    lookup_answer(&c.reply(5).await, "priority on another stream");
    assert_eq!(c.goaway, None);
}
shards_1_and_2!(headers_depending_on_their_own_stream);

/// A PRIORITY frame naming its own stream is a stream error PROTOCOL_ERROR (§5.3.1), on an
/// open stream (whose request is then not answered) and on an idle one; the connection serves
/// the next call.
async fn priority_depending_on_its_own_stream(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    let self_priority = |stream: u32| {
        let mut p = stream.to_be_bytes().to_vec();
        p.push(15);
        frame(kind::PRIORITY, 0, stream, &p)
    };
    let mut w = headers(1, &grpc_request_block(LOOKUP_PATH), false);
    w.extend_from_slice(&self_priority(1));
    w.extend_from_slice(&data(1, &lookup_body(), true));
    c.send(&w).await;
    assert_eq!(c.failure(1).await, Failure::Reset(code::PROTOCOL_ERROR));
    c.send(&self_priority(3)).await;
    assert_eq!(c.failure(3).await, Failure::Reset(code::PROTOCOL_ERROR));
    send_lookup(&mut c, 5).await;
    lookup_answer(&c.reply(5).await, "after self-dependent PRIORITY");
    assert_eq!(c.goaway, None);
}
shards_1_and_2!(priority_depending_on_its_own_stream);

/// HEADERS on a stream whose request already ended (END_STREAM) is a stream error
/// STREAM_CLOSED (§5.1, half-closed (remote) and closed), whatever the timing: a general-path
/// call still being served, an inline call already answered, a general call already answered.
/// Streams the connection no longer remembers (more than HTTP2_RECENT_CLOSED_STREAMS, 128,
/// closed since) are below the highest id used: HEADERS there is a connection error
/// PROTOCOL_ERROR (§5.1.1).
async fn headers_after_end_stream_is_stream_closed(shards: usize) {
    let mut srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    let again = |stream: u32, path: &str| headers(stream, &grpc_request_block(path), true);
    // Before the answer: the general path answers in a task of its own, after this batch.
    let mut w = headers(1, &grpc_request_block(STATE_PATH), false);
    w.extend_from_slice(&data(1, &grpc_message(&[]), true));
    w.extend_from_slice(&again(1, STATE_PATH));
    c.send(&w).await;
    assert_eq!(reset_code(&mut c, 1).await, code::STREAM_CLOSED, "before");
    // After an inline answer.
    send_lookup(&mut c, 3).await;
    lookup_answer(&c.reply(3).await, "inline");
    c.send(&again(3, LOOKUP_PATH)).await;
    assert_eq!(reset_code(&mut c, 3).await, code::STREAM_CLOSED, "inline");
    // After a general-path answer.
    let mut w = headers(5, &grpc_request_block(STATE_PATH), false);
    w.extend_from_slice(&data(5, &grpc_message(&[]), true));
    c.send(&w).await;
    assert!(c.reply(5).await.ended, "general call answered");
    c.send(&again(5, STATE_PATH)).await;
    assert_eq!(reset_code(&mut c, 5).await, code::STREAM_CLOSED, "general");
    // DATA after the answer, too (§6.1).
    c.send(&data(3, &lookup_body(), true)).await;
    assert_eq!(reset_code(&mut c, 3).await, code::STREAM_CLOSED, "DATA");
    send_lookup(&mut c, 7).await;
    lookup_answer(&c.reply(7).await, "same connection");
    // Long closed: 200 calls later stream 7 is forgotten.
    let ids: Vec<u32> = (0..200).map(|i| 9 + 2 * i).collect();
    for chunk in ids.chunks(50) {
        let mut w = Vec::new();
        for &id in chunk {
            w.extend_from_slice(&headers(id, &grpc_request_block(LOOKUP_PATH), false));
            w.extend_from_slice(&data(id, &lookup_body(), true));
        }
        c.send(&w).await;
        let replies = c.replies(chunk).await;
        for id in chunk {
            lookup_answer(&replies[id], "filler");
        }
    }
    let last = *ids.last().unwrap();
    c.send(&again(last, LOOKUP_PATH)).await;
    assert_eq!(
        reset_code(&mut c, last).await,
        code::STREAM_CLOSED,
        "recent"
    );
    let _ = c.write(&again(7, LOOKUP_PATH)).await;
    let code = c.expect_goaway_and_close(CLOSE_WITHIN).await;
    assert_eq!(code, code::PROTOCOL_ERROR, "long closed");
    drop(c);
    assert_answers_within(&mut srv, Duration::from_secs(5), "after").await;
}
shards_1_and_2!(headers_after_end_stream_is_stream_closed);

/// A DATA frame as the body's bytes `from..to`, with END_STREAM if set.
type Slice = (usize, usize, bool);

/// A request whose `content-length` differs from its DATA (one frame, the sum of several,
/// DATA beyond it, a header block ending the stream with none, trailers ending it short) is
/// malformed (§8.1.1): a stream
/// error PROTOCOL_ERROR and no answer, on the inline path and the general one. An exact
/// length, in one frame or two, is answered.
async fn content_length_must_match_the_data(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = FrameConn::handshake(srv.grpc_port).await;
    let body = lookup_body();
    let n = body.len();
    let head = |path: &str, length: usize| {
        let length = length.to_string();
        let mut fields = grpc_request_fields(path);
        fields.push(("content-length", &length));
        header_block(&fields)
    };
    let mut stream = 1;
    let mut next = || {
        stream += 2;
        stream - 2
    };
    // (declared length, DATA frames as (from, to, end)) that must fail.
    let bad: [(usize, &[Slice]); 6] = [
        (n + 1, &[(0, n, true)]),
        (n - 1, &[(0, n, true)]),
        (n - 1, &[(0, n, false)]),
        (n + 3, &[(0, 4, false), (4, n, true)]),
        (n - 3, &[(0, 4, false), (4, n, false), (n, n, true)]),
        (5, &[]),
    ];
    for path in [LOOKUP_PATH, STATE_PATH] {
        for (declared, frames) in bad {
            let id = next();
            let mut w = headers(id, &head(path, declared), frames.is_empty());
            for &(from, to, end) in frames {
                w.extend_from_slice(&data(id, &body[from..to], end));
            }
            c.send(&w).await;
            assert_eq!(
                c.failure(id).await,
                Failure::Reset(code::PROTOCOL_ERROR),
                "{path}: content-length {declared} (body {n}), frames {frames:?}"
            );
        }
    }
    // A body short of its length, ended by trailers.
    for path in [LOOKUP_PATH, STATE_PATH] {
        let id = next();
        let mut w = headers(id, &head(path, n + 1), false);
        w.extend_from_slice(&data(id, &body, false));
        w.extend_from_slice(&headers(id, &header_block(&[("x-trailer", "1")]), true));
        c.send(&w).await;
        assert_eq!(
            c.failure(id).await,
            Failure::Reset(code::PROTOCOL_ERROR),
            "{path}: ended by trailers"
        );
    }
    for frames in [&[(0, n, true)][..], &[(0, 4, false), (4, n, true)]] {
        let id = next();
        let mut w = headers(id, &head(LOOKUP_PATH, n), false);
        for &(from, to, end) in frames {
            w.extend_from_slice(&data(id, &body[from..to], end));
        }
        c.send(&w).await;
        lookup_answer(&c.reply(id).await, "exact content-length");
    }
    assert_eq!(c.goaway, None);
}
shards_1_and_2!(content_length_must_match_the_data);

/// An HPACK integer longer than five bytes (`0xff` and twenty `0x80`: a shift overflow once)
/// is a connection error COMPRESSION_ERROR (RFC 7541 §5.1, RFC 9113 §4.3), and the server
/// stays up.
async fn over_long_hpack_integer(shards: usize) {
    let mut block = vec![0xffu8];
    block.extend_from_slice(&[0x80; 20]);
    block.push(0x01);
    let bad = headers(1, &block, true);
    connection_error(shards, None, bad, &[code::COMPRESSION_ERROR]).await;
}
shards_1_and_2!(over_long_hpack_integer);
