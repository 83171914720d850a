//! Robustness: bad input over real sockets must not crash, wedge or corrupt the server
//! (docs/BEHAVIOUR.md §1.2 read-header timeout, §1.3 4 MiB receive limit, §4.1 partial streams,
//! §10 LookupRoute never errors, §13 admin endpoints). Every scenario ends by checking that the
//! process is alive and still answers a normal LookupRoute.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::support::*;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};

const LOOKUP_PATH: &str = "/inferencecache.v1alpha1.InferenceCache/LookupRoute";

/// Seeds one entry and asserts the server answers a normal LookupRoute with it and is alive.
async fn assert_healthy(srv: &mut Server, tag: &str) {
    assert!(
        srv.child.try_wait().unwrap().is_none(),
        "[{tag}] server process exited"
    );
    let mut c = tokio::time::timeout(Duration::from_secs(10), srv.client())
        .await
        .unwrap_or_else(|_| panic!("[{tag}] connect timed out (server wedged?)"));
    let call = async {
        let ack = report(
            &mut c,
            vec![legacy_update("r-ok", "t-ok", "m-ok", "vllm", b"ok", 100)],
        )
        .await;
        assert!(ack.accepted);
        lookup(&mut c, exact_lookup("t-ok", "m-ok", "vllm", b"ok", 100)).await
    };
    let r = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .unwrap_or_else(|_| panic!("[{tag}] normal LookupRoute timed out (server wedged?)"));
    assert!(
        r.replica_scores.iter().any(|s| s.replica_id == "r-ok"),
        "[{tag}] normal lookup lost its hit: {r:?}"
    );
    let (st, _) = http_get(srv.http_port, "/healthz").expect("healthz");
    assert_eq!(st, 200, "[{tag}] /healthz");
    assert!(
        srv.child.try_wait().unwrap().is_none(),
        "[{tag}] server process exited"
    );
}

/// gRPC length-prefixed frame (uncompressed).
fn grpc_frame(payload: &[u8]) -> Vec<u8> {
    grpc_message(payload).to_vec()
}

/// Protobuf length-delimited field (wire type 2).
fn pb_bytes_field(tag: u32, v: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut key = ((tag << 3) | 2) as u64;
    let mut len = v.len() as u64;
    loop {
        let b = (key & 0x7f) as u8;
        key >>= 7;
        if key == 0 {
            out.push(b);
            break;
        }
        out.push(b | 0x80);
    }
    loop {
        let b = (len & 0x7f) as u8;
        len >>= 7;
        if len == 0 {
            out.push(b);
            break;
        }
        out.push(b | 0x80);
    }
    out.extend_from_slice(v);
    out
}

/// Outcome of a raw gRPC call: HTTP status, grpc-status (headers or trailers), response body.
#[derive(Debug)]
struct RawOutcome {
    http_status: u16,
    grpc_status: Option<String>,
    grpc_message: Option<String>,
    body: Vec<u8>,
}

/// One unary gRPC call with a hand-made body and extra headers over a fresh HTTP/2 connection.
async fn raw_grpc(port: u16, path: &str, headers: &[(&str, &str)], body: Vec<u8>) -> RawOutcome {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .expect("h2 handshake");
    tokio::spawn(conn);
    let mut b = http::Request::builder()
        .method("POST")
        .uri(format!("http://127.0.0.1:{port}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(Full::new(Bytes::from(body))).unwrap();
    let resp = send.send_request(req).await.expect("send_request");
    let http_status = resp.status().as_u16();
    let hget = |h: &http::HeaderMap, k: &str| {
        h.get(k)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).to_string())
    };
    let mut grpc_status = hget(resp.headers(), "grpc-status");
    let mut grpc_message = hget(resp.headers(), "grpc-message");
    let collected = resp.into_body().collect().await.expect("body");
    if let Some(t) = collected.trailers() {
        grpc_status = grpc_status.or_else(|| hget(t, "grpc-status"));
        grpc_message = grpc_message.or_else(|| hget(t, "grpc-message"));
    }
    RawOutcome {
        http_status,
        grpc_status,
        grpc_message,
        body: collected.to_bytes().to_vec(),
    }
}

/// Decodes the single LookupRouteResponse frame of a raw body.
fn decode_lookup(body: &[u8]) -> pb::LookupRouteResponse {
    use prost::Message;
    assert!(body.len() >= 5, "no gRPC frame in {body:?}");
    assert_eq!(body[0], 0, "compressed frame");
    let n = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
    pb::LookupRouteResponse::decode(&body[5..5 + n]).expect("decode LookupRouteResponse")
}

// ---------------------------------------------------------------------------------------------

/// A >4 MiB message → RESOURCE_EXHAUSTED (unary and client stream); the server keeps serving.
async fn oversized_message(shards: usize) {
    let mut srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let big = vec![0xabu8; 5 << 20];
    let err = c
        .lookup_route(exact_lookup("t", "m", "vllm", &big, 100))
        .await
        .expect_err("a 5 MiB LookupRoute must be rejected");
    // grpc-go answers RESOURCE_EXHAUSTED for a message over the receive limit (§1.3); the
    // code is checked at the end so the rest of the scenario still runs.
    let mut wrong_codes = Vec::new();
    if err.code() != tonic::Code::ResourceExhausted {
        wrong_codes.push(format!("unary: {err:?}"));
    }

    // Just under the limit is accepted (and answered OK).
    let ok = vec![0xcdu8; (4 << 20) - 1024];
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", &ok, 100)).await;
    assert_eq!(r.reason_code, "NO_HINT", "{:?}", r.reason_code);

    // ReportCacheState: one normal message, then an oversized one.
    let mut c2 = srv.client().await;
    let res = c2
        .report_cache_state(tokio_stream::iter(vec![
            legacy_update("r1", "t", "m", "vllm", b"small", 100),
            legacy_update("r1", "t", "m", "vllm", &big, 100),
        ]))
        .await;
    let err = res.expect_err("an oversized stream message must fail the call");
    if err.code() != tonic::Code::ResourceExhausted {
        wrong_codes.push(format!("client stream: {err:?}"));
    }
    // The message before it stayed applied (§4.1).
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"small", 100)).await;
    assert!(
        r.replica_scores.iter().any(|s| s.replica_id == "r1"),
        "{r:?}"
    );

    // A frame header declaring 2^32-1 bytes with no body behind it.
    let mut bogus = vec![0u8, 0xff, 0xff, 0xff, 0xff];
    bogus.extend_from_slice(&[1, 2, 3]);
    let out = tokio::time::timeout(
        Duration::from_secs(10),
        raw_grpc(srv.grpc_port, LOOKUP_PATH, &[], bogus),
    )
    .await
    .expect("bogus length frame: no answer within 10 s");
    if out.grpc_status.as_deref() != Some("8") {
        wrong_codes.push(format!("declared 4 GiB frame: {out:?}"));
    }

    // A truncated frame (declares 100 bytes, sends 3, then ends the stream).
    let mut trunc = vec![0u8, 0, 0, 0, 100];
    trunc.extend_from_slice(&[1, 2, 3]);
    let out = tokio::time::timeout(
        Duration::from_secs(10),
        raw_grpc(srv.grpc_port, LOOKUP_PATH, &[], trunc),
    )
    .await
    .expect("truncated frame: no answer within 10 s");
    assert!(
        out.grpc_status.as_deref().is_some_and(|s| s != "0"),
        "truncated frame must fail: {out:?}"
    );
    assert_healthy(&mut srv, "oversized").await;
    assert!(
        wrong_codes.is_empty(),
        "oversized messages must fail with RESOURCE_EXHAUSTED (8):\n{}",
        wrong_codes.join("\n")
    );
}
shards_1_and_2!(oversized_message);

/// Garbage, HTTP/1, a truncated preface and idle half-open connections on the gRPC port do
/// not take the server down or block other connections.
async fn garbage_on_grpc_port(shards: usize) {
    let mut srv = Server::start(shards, &[]);
    let port = srv.grpc_port;
    let payloads: Vec<Vec<u8>> = vec![
        (0..4096u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect(),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        b"POST /inferencecache.v1alpha1.InferenceCache/LookupRoute HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n\0\0\0\0\0".to_vec(),
        b"PRI * HTTP/2.0\r\n".to_vec(),
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\xff\xff\xff\xff\xff\xff\xff\xff\xff".to_vec(),
        // Valid preface, then a SETTINGS frame with an absurd length.
        {
            let mut v = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
            v.extend_from_slice(&[0xff, 0xff, 0xff, 0x04, 0, 0, 0, 0, 0]);
            v
        },
        vec![],
    ];
    let held = tokio::task::spawn_blocking(move || {
        let mut held = Vec::new();
        for p in payloads {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(300)))
                .unwrap();
            let _ = s.write_all(&p);
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf);
            held.push(s);
        }
        // A connection that sent only half the preface, kept open.
        let mut half = TcpStream::connect(("127.0.0.1", port)).unwrap();
        half.write_all(b"PRI * HT").unwrap();
        held.push(half);
        // A connection that sent nothing, kept open.
        held.push(TcpStream::connect(("127.0.0.1", port)).unwrap());
        held
    })
    .await
    .unwrap();
    // Healthy while the bad connections are still open.
    assert_healthy(&mut srv, "garbage (held open)").await;
    drop(held);
    assert_healthy(&mut srv, "garbage (closed)").await;
}
shards_1_and_2!(garbage_on_grpc_port);

/// A client cancelling ReportCacheState mid-stream: already-sent messages stay applied and the
/// server keeps serving.
async fn cancel_report_midstream(shards: usize) {
    let mut srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::CacheStateUpdate>(8);
    let mut c2 = srv.client().await;
    // A second handle on the same HTTP/2 connection as the stream that gets cancelled.
    let mut same_conn = c2.clone();
    let call = tokio::spawn(async move {
        c2.report_cache_state(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
    });
    for i in 0..2 {
        tx.send(legacy_update(
            "rc",
            "tc",
            "mc",
            "vllm",
            format!("p{i}").as_bytes(),
            100,
        ))
        .await
        .unwrap();
    }
    let hit = |hash: &'static [u8]| {
        let mut c = c.clone();
        async move {
            lookup(&mut c, exact_lookup("tc", "mc", "vllm", hash, 100))
                .await
                .replica_scores
                .iter()
                .any(|s| s.replica_id == "rc")
        }
    };
    poll_until(
        "the streamed messages to be applied before EOF",
        Duration::from_secs(30),
        || async { hit(b"p0").await && hit(b"p1").await },
    )
    .await;
    call.abort(); // client cancel: RST_STREAM, no EOF
    let _ = call.await;
    drop(tx);
    // Instead of sleeping: a complete stream opened after the reset on the same connection. The
    // server reads a connection's frames in order, so once this stream's update is visible the
    // cancellation has been processed too.
    assert!(
        report(
            &mut same_conn,
            vec![legacy_update("rc", "tc", "mc", "vllm", b"after", 100)]
        )
        .await
        .accepted
    );
    poll_until(
        "the update sent after the cancel to be applied",
        Duration::from_secs(30),
        || hit(b"after"),
    )
    .await;
    for p in [&b"p0"[..], b"p1"] {
        let r = lookup(&mut c, exact_lookup("tc", "mc", "vllm", p, 100)).await;
        assert!(
            r.replica_scores.iter().any(|s| s.replica_id == "rc"),
            "partial messages must stay applied: {r:?}"
        );
    }

    // Also: many streams cancelled abruptly by dropping their connections mid-stream, each
    // once its first message is applied (observed, not slept for).
    for i in 0..20 {
        let key = format!("x{i}");
        let mut cx = srv.client().await;
        let (tx, rx) = tokio::sync::mpsc::channel::<pb::CacheStateUpdate>(2);
        let h = tokio::spawn(async move {
            cx.report_cache_state(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
        });
        tx.send(legacy_update("rx", "tx", "mx", "vllm", key.as_bytes(), 16))
            .await
            .unwrap();
        let applied = || {
            let mut c = c.clone();
            let key = key.clone();
            async move {
                !lookup(&mut c, exact_lookup("tx", "mx", "vllm", key.as_bytes(), 16))
                    .await
                    .replica_scores
                    .is_empty()
            }
        };
        poll_until(
            &format!("{key} to be applied"),
            Duration::from_secs(30),
            applied,
        )
        .await;
        h.abort();
        let _ = h.await;
        drop(tx);
    }
    for i in 0..20 {
        let key = format!("x{i}");
        let r = lookup(&mut c, exact_lookup("tx", "mx", "vllm", key.as_bytes(), 16)).await;
        assert!(
            !r.replica_scores.is_empty(),
            "{key} must stay applied: {r:?}"
        );
    }
    assert_healthy(&mut srv, "cancel").await;
}
shards_1_and_2!(cancel_report_midstream);

/// 2,000 concurrent LookupRoute calls over 4 connections: all answered OK.
async fn many_concurrent_lookups(shards: usize) {
    let mut srv = Server::start(shards, &[]);
    let mut seed = srv.client().await;
    let models = models_per_core("tl", shards.max(2));
    let ups: Vec<_> = models
        .iter()
        .map(|m| legacy_update("r", "tl", m, "vllm", b"h", 100))
        .collect();
    assert!(report(&mut seed, ups).await.accepted);
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(srv.client().await);
    }
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for i in 0..2000usize {
        let mut c = clients[i % clients.len()].clone();
        let m = models[i % models.len()].clone();
        set.spawn(async move {
            c.lookup_route(exact_lookup("tl", &m, "vllm", b"h", 100))
                .await
                .map(|r| r.into_inner())
        });
    }
    let all = tokio::time::timeout(Duration::from_secs(30), async {
        let mut ok = 0usize;
        let mut errs = Vec::new();
        while let Some(r) = set.join_next().await {
            match r.unwrap() {
                Ok(resp) if resp.replica_scores.iter().any(|s| s.replica_id == "r") => ok += 1,
                Ok(resp) => errs.push(format!("no hit: {resp:?}")),
                Err(s) => errs.push(format!("{s:?}")),
            }
        }
        (ok, errs)
    })
    .await;
    let (ok, errs) = all.expect("2,000 concurrent lookups not all answered within 30 s");
    assert!(
        errs.is_empty(),
        "{} of 2000 failed, first: {:?}",
        errs.len(),
        errs.first()
    );
    assert_eq!(ok, 2000);
    eprintln!("2000 concurrent lookups in {:?}", start.elapsed());
    assert_healthy(&mut srv, "concurrency").await;
}
shards_1_and_2!(many_concurrent_lookups);

/// Huge (100 KB) and non-UTF-8 tenant / model ids.
async fn huge_and_non_utf8_ids(shards: usize) {
    let mut srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    // Names up to the 1 KiB limit round trip.
    let long_t = "t".repeat(1024);
    let long_m = "m".repeat(1024);
    let ack = report(
        &mut c,
        vec![legacy_update("rh", &long_t, &long_m, "vllm", b"h", 100)],
    )
    .await;
    assert!(ack.accepted);
    let r = lookup(&mut c, exact_lookup(&long_t, &long_m, "vllm", b"h", 100)).await;
    assert!(
        r.replica_scores.iter().any(|s| s.replica_id == "rh"),
        "long ids round trip: {:?}",
        r.reason_code
    );
    // Longer names are refused (not acknowledged) and their lookups fail open.
    let huge_t = "t".repeat(100 * 1024);
    let huge_m = "m".repeat(100 * 1024);
    let ack = report(
        &mut c,
        vec![legacy_update("rh", &huge_t, &huge_m, "vllm", b"h", 100)],
    )
    .await;
    assert_eq!(
        (ack.accepted, ack.reason_code.as_str()),
        (false, "ID_TOO_LONG")
    );
    let r = lookup(&mut c, exact_lookup(&huge_t, &huge_m, "vllm", b"h", 100)).await;
    assert_eq!(r.reason_code, "NO_HINT");
    assert!(r.replica_scores.is_empty());
    // Snapshot and metrics still render with the huge ids in them.
    let _ = snapshot_json(&srv);
    let (st, _) = http_get(srv.http_port, "/metrics").unwrap();
    assert_eq!(st, 200);
    let gs = cache_state(&mut c, &huge_t, &huge_m).await;
    let _ = gs;
    // Odd but valid UTF-8 (NUL, RTL, emoji, quotes) in ids.
    let odd = "\u{0}\u{202e}\"\\\n😀";
    assert!(
        report(
            &mut c,
            vec![legacy_update(odd, odd, odd, "vllm", b"o", 100)]
        )
        .await
        .accepted
    );
    let r = lookup(&mut c, exact_lookup(odd, odd, "vllm", b"o", 100)).await;
    assert!(
        r.replica_scores.iter().any(|s| s.replica_id == odd),
        "{r:?}"
    );
    let _ = snapshot_json(&srv);

    // Non-UTF-8 bytes in string fields, hand-encoded: answered (OK or a decode error), no crash.
    let mut msg = pb_bytes_field(1, b"m\xff\xfe");
    msg.extend(pb_bytes_field(2, b"\xc3\x28t"));
    msg.extend(pb_bytes_field(3, b"h"));
    msg.extend(pb_bytes_field(5, b"vllm\x80"));
    let out = tokio::time::timeout(
        Duration::from_secs(10),
        raw_grpc(srv.grpc_port, LOOKUP_PATH, &[], grpc_frame(&msg)),
    )
    .await
    .expect("non-UTF-8 lookup: no answer");
    assert_eq!(out.http_status, 200, "{out:?}");
    assert!(
        out.grpc_status.is_some(),
        "non-UTF-8 lookup: no grpc-status {out:?}"
    );
    eprintln!(
        "non-UTF-8 LookupRoute -> grpc-status {:?} ({:?})",
        out.grpc_status, out.grpc_message
    );
    // Garbage protobuf (invalid wire type / truncated varint).
    for junk in [
        vec![0x0f, 0xff],
        vec![
            0x0a, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
        ],
    ] {
        let out = tokio::time::timeout(
            Duration::from_secs(10),
            raw_grpc(srv.grpc_port, LOOKUP_PATH, &[], grpc_frame(&junk)),
        )
        .await
        .expect("junk protobuf: no answer");
        assert!(out.grpc_status.is_some(), "{out:?}");
    }
    assert_healthy(&mut srv, "ids").await;
}
shards_1_and_2!(huge_and_non_utf8_ids);

/// Garbage `grpc-timeout` values are treated as "no deadline" (a normal answer, not TIMEOUT).
async fn garbage_grpc_timeout(shards: usize) {
    let mut srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    assert!(
        report(
            &mut c,
            vec![legacy_update("rg", "tg", "mg", "vllm", b"g", 100)]
        )
        .await
        .accepted
    );
    use prost::Message;
    let body = grpc_frame(&exact_lookup("tg", "mg", "vllm", b"g", 100).encode_to_vec());
    for v in [
        "abc",
        "1x",
        "-1S",
        "S",
        "",
        "999999999S",
        "99999999H",
        "18446744073709551616n",
        "1.5S",
        " 5S",
    ] {
        let out = tokio::time::timeout(
            Duration::from_secs(10),
            raw_grpc(
                srv.grpc_port,
                LOOKUP_PATH,
                &[("grpc-timeout", v)],
                body.clone(),
            ),
        )
        .await
        .unwrap_or_else(|_| panic!("grpc-timeout {v:?}: no answer"));
        assert_eq!(
            out.grpc_status.as_deref(),
            Some("0"),
            "grpc-timeout {v:?}: {out:?}"
        );
        let r = decode_lookup(&out.body);
        assert!(
            r.replica_scores.iter().any(|s| s.replica_id == "rg"),
            "grpc-timeout {v:?} must mean no deadline: {r:?}"
        );
    }
    assert_healthy(&mut srv, "grpc-timeout").await;
}
shards_1_and_2!(garbage_grpc_timeout);

/// Admin HTTP: a 2 MiB /policy body → 400; slow headers are cut off by the 5 s read-header
/// timeout while other requests keep being served; garbage HTTP/1 is survived.
async fn admin_http_abuse(shards: usize) {
    let mut srv = Server::start(shards, &[]);
    let admin = srv.admin_port;
    let http_port = srv.http_port;

    // Slow-header clients on both HTTP listeners, in the background.
    let slow = |port: u16| {
        std::thread::spawn(move || {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(32))).unwrap();
            s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                .unwrap();
            let t0 = Instant::now();
            let mut buf = Vec::new();
            // Trickle a header byte every 500 ms; the server must close regardless (its 5 s
            // read-header timeout bounds the whole header, not the gap between bytes). The 30 s
            // limit only bounds the test: a server that never closes fails, whatever the load.
            let mut closed = false;
            while t0.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(500));
                if s.write_all(b"X").is_err() {
                    closed = true;
                    break;
                }
                s.set_nonblocking(true).unwrap();
                let mut b = [0u8; 512];
                match s.read(&mut b) {
                    Ok(0) => {
                        closed = true;
                        s.set_nonblocking(false).unwrap();
                        break;
                    }
                    Ok(n) => buf.extend_from_slice(&b[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(_) => {
                        closed = true;
                        s.set_nonblocking(false).unwrap();
                        break;
                    }
                }
                s.set_nonblocking(false).unwrap();
            }
            (
                closed,
                t0.elapsed(),
                String::from_utf8_lossy(&buf).to_string(),
            )
        })
    };
    let slow_admin = slow(admin);
    let slow_public = slow(http_port);

    // 2 MiB policy body.
    let big = format!(
        "{{\"version\":7,\"policies\":[],\"pad\":\"{}\"}}",
        "x".repeat(2 << 20)
    );
    let r = tokio::task::spawn_blocking(move || http_post_json(admin, "/policy", &big))
        .await
        .unwrap();
    assert_eq!(r.status, 400, "2 MiB /policy: {} {:?}", r.status, r.body);
    // Exactly-at-limit garbage and non-JSON bodies → 400.
    for body in ["\u{0}\u{1}garbage", "{\"version\":", "[]", "null"] {
        let b = body.to_string();
        let r = tokio::task::spawn_blocking(move || http_post_json(admin, "/policy", &b))
            .await
            .unwrap();
        assert_eq!(r.status, 400, "/policy {body:?}: {} {:?}", r.status, r.body);
    }
    // Lying Content-Length (declares 1 MiB, sends 10 bytes, then closes the write side).
    tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(("127.0.0.1", admin)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        s.write_all(
            b"POST /policy HTTP/1.1\r\nHost: x\r\nContent-Length: 1048576\r\n\r\n0123456789",
        )
        .unwrap();
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        // Garbage request lines.
        for junk in [
            &b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"[..],
            b"GARBAGE\r\n\r\n",
            b"GET /snapshot HTTP/9.9\r\n\r\n",
            b"GET /snapshot HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        ] {
            let mut s = TcpStream::connect(("127.0.0.1", admin)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
            let _ = s.write_all(junk);
            let mut out = Vec::new();
            let _ = s.read_to_end(&mut out);
        }
        // Huge header (1 MiB).
        let mut s = TcpStream::connect(("127.0.0.1", http_port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let _ = s.write_all(
            format!(
                "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
                "a".repeat(1 << 20)
            )
            .as_bytes(),
        );
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
    })
    .await
    .unwrap();

    // While the slow clients are still attached, both listeners answer.
    let (st, _) = http_get(http_port, "/healthz").unwrap();
    assert_eq!(st, 200);
    let _ = snapshot_json(&srv);
    install_policy(&srv, r#"{"version":7,"policies":[]}"#);

    for (name, h) in [("admin", slow_admin), ("public", slow_public)] {
        let (closed, after, got) = h.join().unwrap();
        assert!(
            closed,
            "{name}: slow-header connection not closed by the server after {after:?} (got {got:?})"
        );
        eprintln!("{name}: slow-header connection closed after {after:?}, got {got:?}");
    }
    assert_healthy(&mut srv, "admin http").await;
}
shards_1_and_2!(admin_http_abuse);
