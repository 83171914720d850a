//! Production hardness: every resource a client can grow has a bound, and faults are visible
//! instead of leaving a half-dead server. Each scenario reproduces one way a hostile or buggy
//! peer (or a crash) hurt the server, and asserts the bound or the fault's outcome.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::support::*;

/// The HTTP/2 client preface plus an empty SETTINGS frame.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// Distinct, huge and endless `model_id` values share one `__overflow__` series instead of
/// growing the registry: the scrape stays small (it was 1.47 GB for 100 × 1 MiB ids).
async fn metrics_label_values_are_bounded(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let huge = "m".repeat(1 << 20);
    for i in 0..8 {
        lookup(
            &mut c,
            exact_lookup("t", &format!("{huge}{i}"), "vllm", b"h", 16),
        )
        .await;
    }
    for i in 0..1_100 {
        lookup(
            &mut c,
            exact_lookup("t", &format!("model-{i:05}"), "vllm", b"h", 16),
        )
        .await;
    }
    let text = metrics_text(&srv);
    assert!(text.len() < 4 << 20, "scrape of {} bytes", text.len());
    assert!(
        text.contains("model=\"__overflow__\""),
        "no overflow series"
    );
    let folded = metric_value(
        &text,
        "inferencecache_metrics_label_overflow_total{family=\"inferencecache_lookup_route_calls_total\"}",
    )
    .expect("overflow counter");
    assert!(folded >= 8.0 + 76.0, "folded {folded}");
    let (st, _) = http_get(srv.http_port, "/healthz").expect("healthz");
    assert_eq!(st, 200);
}
shards_1_and_2!(metrics_label_values_are_bounded);

/// Starts the binary on the given ports (0: any) with `extra` flags, without waiting for it.
fn spawn_on(ports: (u16, u16, u16), extra: &[&str], env: &[(&str, &str)]) -> std::process::Child {
    let (grpc, http, admin) = ports;
    Command::new(bin())
        .args([
            "--insecure-disable-auth",
            "--log-level",
            "error",
            "--grpc-bind-address",
            &format!("127.0.0.1:{grpc}"),
            "--http-bind-address",
            &format!("127.0.0.1:{http}"),
            "--snapshot-bind-address",
            &format!("127.0.0.1:{admin}"),
        ])
        .args(extra)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn server")
}

fn ready(http: u16) -> bool {
    matches!(http_get(http, "/readyz"), Ok((200, _)))
}

/// A restart on the same port binds at once while the previous process's connections linger
/// (FIN_WAIT/TIME_WAIT); a port a live server listens on is still refused.
#[test]
fn restart_binds_at_once_and_a_live_port_is_refused() {
    let mut first = Server::start(1, &[]);
    let (g, h, a) = (first.grpc_port, first.http_port, first.admin_port);
    // A connected client keeps the server's side open while the server closes first.
    let mut client = TcpStream::connect(("127.0.0.1", g)).expect("connect");
    client.write_all(H2_PREFACE).expect("preface");
    let status = first.terminate();
    assert!(status.success(), "first exit {status}");

    let mut second = spawn_on((g, h, a), &[], &[]);
    let started = wait_until(Duration::from_secs(10), || {
        ready(h) || second.try_wait().ok().flatten().is_some()
    });
    assert!(
        started && ready(h),
        "restart on the same port did not become ready"
    );

    let mut third = spawn_on((g, 0, 0), &[], &[]);
    let exited = wait_until(Duration::from_secs(20), || {
        third.try_wait().ok().flatten().is_some()
    });
    assert!(exited, "a second server started on a port in use");
    assert_eq!(third.wait().unwrap().code(), Some(1));
    drop(client);
    let _ = second.kill();
    let _ = second.wait();
}

/// Reads until the peer closes; `None` when it is still open after `limit`.
fn closed_within(s: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    let mut buf = [0u8; 4096];
    while start.elapsed() < limit {
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        match s.read(&mut buf) {
            Ok(0) => return Some(start.elapsed()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return Some(start.elapsed()),
        }
    }
    None
}

/// Connections that never send the HTTP/2 preface are closed (10 s), so they cannot hold every
/// connection slot of a core; a connection that spoke HTTP/2 stays open.
#[test]
fn silent_connections_are_closed_and_free_their_slots() {
    let srv = Server::start(1, &["--max-connections-per-core", "3"]);
    let mut spoken = TcpStream::connect(("127.0.0.1", srv.grpc_port)).unwrap();
    spoken.write_all(H2_PREFACE).unwrap();
    let mut silent: Vec<TcpStream> = (0..2)
        .map(|_| TcpStream::connect(("127.0.0.1", srv.grpc_port)).unwrap())
        .collect();
    // Every slot is taken: a further connection is closed at once.
    let mut refused = TcpStream::connect(("127.0.0.1", srv.grpc_port)).unwrap();
    assert!(closed_within(&mut refused, Duration::from_secs(5)).is_some());
    for s in &mut silent {
        let closed = closed_within(s, Duration::from_secs(30));
        assert!(closed.is_some(), "a silent connection was never closed");
    }
    assert!(
        closed_within(&mut spoken, Duration::from_millis(500)).is_none(),
        "a connection that spoke HTTP/2 was closed"
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = srv.client().await;
        let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"h", 16)).await;
        assert_eq!(r.reason_code, "NO_HINT");
    });
}

/// A panic on one core takes the whole process down (SIGABRT), so the orchestrator restarts
/// it, instead of leaving the other cores serving while requests for the dead one hang.
#[test]
fn a_panic_on_a_core_aborts_the_process() {
    let ports = (0, 0, 0);
    let flags = ["--shards", "2", "--sweep-interval-ms", "300"];
    let env = [
        ("INFERENCECACHE_TEST_SWEEP_FAULT", "panic:1"),
        ("RUST_BACKTRACE", "0"),
    ];
    let mut child = spawn_on(ports, &flags, &env);
    let exited = wait_until(Duration::from_secs(30), || {
        child.try_wait().ok().flatten().is_some()
    });
    if !exited {
        let _ = child.kill();
    }
    assert!(exited, "the process survived a panic on core 1");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGABRT));
}

/// A core that stops making progress turns `/readyz` to 503 until it recovers, so a load
/// balancer stops sending traffic to a wedged replica.
#[test]
fn a_stalled_core_turns_readyz_503_until_it_recovers() {
    let srv = Server::start_opts(
        2,
        StartOpts {
            flags: &["--sweep-interval-ms", "300"],
            env: &[("INFERENCECACHE_TEST_SWEEP_FAULT", "stall:1:8000")],
            ..Default::default()
        },
    );
    let status = || http_get(srv.http_port, "/readyz").map(|(s, _)| s).ok();
    assert!(
        wait_until(Duration::from_secs(20), || status() == Some(503)),
        "/readyz stayed 200 while core 1 was stalled"
    );
    assert_eq!(http_get(srv.http_port, "/healthz").unwrap().0, 200);
    assert!(
        wait_until(Duration::from_secs(30), || status() == Some(200)),
        "/readyz did not recover"
    );
}

/// A producer timestamp in the future (year 2300, `i64::MAX`) is clamped to the server's clock
/// plus the allowed skew, so the entry expires at most one skew after a correctly stamped one
/// instead of never; the clamp is counted.
async fn future_timestamps_expire_after_ttl_plus_skew(shards: usize) {
    let srv = Server::start(
        shards,
        &[
            "--max-timestamp-skew-ms",
            "500",
            "--sweep-interval-ms",
            "100",
        ],
    );
    let ttl_1s = r#"{"version":7,"policies":[{"namespace":"t","evictionTTL":1000000000}]}"#;
    install_policy(&srv, ttl_1s);
    let mut c = srv.client().await;
    for (hash, stamp_us) in [
        (b"y2300".as_slice(), 10_500_000_000_000_000),
        (b"max", i64::MAX),
    ] {
        let mut u = legacy_update("r-future", "t", "m", "vllm", hash, 16);
        u.timestamp_us = stamp_us;
        assert!(report(&mut c, vec![u]).await.accepted);
    }
    let hit =
        |r: &pb::LookupRouteResponse| r.replica_scores.iter().any(|s| s.replica_id == "r-future");
    for hash in [b"y2300".as_slice(), b"max"] {
        let r = lookup(&mut c, exact_lookup("t", "m", "vllm", hash, 16)).await;
        assert!(hit(&r), "fresh right after ingest: {r:?}");
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    for hash in [b"y2300".as_slice(), b"max"] {
        loop {
            let r = lookup(&mut c, exact_lookup("t", "m", "vllm", hash, 16)).await;
            if !hit(&r) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "a future-stamped entry never expired"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let clamped = metric_value(
        &metrics_text(&srv),
        "inferencecache_ingest_timestamps_clamped_total",
    );
    assert_eq!(clamped, Some(2.0));
}
shards_1_and_2!(future_timestamps_expire_after_ttl_plus_skew);

/// When a core's string table is full, an update introducing a new name is not applied, and the
/// stream's Ack says so (`accepted: false`, `STRING_TABLE_FULL`) instead of acknowledging it;
/// updates that fit are still applied and the refusals are counted.
async fn refused_updates_are_not_acknowledged(shards: usize) {
    let srv = Server::start(shards, &["--index-max-strings", "16"]);
    let mut c = srv.client().await;
    let fits = legacy_update("r0", "t", "m", "vllm", b"fits", 16);
    assert!(report(&mut c, vec![fits]).await.accepted);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"fits", 16)).await;
    assert!(
        r.replica_scores.iter().any(|s| s.replica_id == "r0"),
        "before: {r:?}"
    );
    let flood: Vec<_> = (0..40)
        .map(|i| legacy_update(&format!("replica-{i}"), "t", "m", "vllm", b"flood", 16))
        .collect();
    let ack = report(&mut c, flood).await;
    assert!(!ack.accepted, "an update that was dropped was acknowledged");
    assert_eq!(ack.reason_code, "STRING_TABLE_FULL");
    // Names the table already holds still fit.
    let known = legacy_update("r0", "t", "m", "vllm", b"again", 16);
    assert!(report(&mut c, vec![known]).await.accepted);
    let refused = metric_value(
        &metrics_text(&srv),
        "inferencecache_ingest_refused_total{reason=\"string_table_full\"}",
    )
    .expect("refusals counted");
    assert!(refused >= 1.0, "{refused}");
}
shards_1_and_2!(refused_updates_are_not_acknowledged);

/// A request body that trickles in is cut off after the body read timeout (10 s) with a 400,
/// so a client cannot hold an admin connection (and its buffer) forever.
#[test]
fn a_trickling_admin_body_is_cut_off() {
    let srv = Server::start(1, &[]);
    let mut s = TcpStream::connect(("127.0.0.1", srv.admin_port)).unwrap();
    s.write_all(b"POST /policy HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"version\"")
        .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let start = Instant::now();
    let mut buf = [0u8; 512];
    let n = s.read(&mut buf).unwrap_or(0);
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(
        head.starts_with("HTTP/1.1 400"),
        "got {head:?} after {:?}",
        start.elapsed()
    );
    assert!(start.elapsed() < Duration::from_secs(25));
    assert_eq!(http_get(srv.http_port, "/healthz").unwrap().0, 200);
}

/// Work queued to a core that then stalls fails once the stall is detected (UNAVAILABLE for an
/// ingest stream) instead of hanging until the core comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_queued_to_a_stalled_core_fails_fast() {
    let srv = Server::start_opts(
        2,
        StartOpts {
            flags: &["--sweep-interval-ms", "300"],
            env: &[("INFERENCECACHE_TEST_SWEEP_FAULT", "stall:1:20000")],
            ..Default::default()
        },
    );
    // Core 1 is stalled once a scrape can no longer gather its series.
    let stalled = wait_until(Duration::from_secs(20), || {
        !metrics_text(&srv).contains("inferencecache_core_index_entries{core=\"1\"}")
    });
    assert!(stalled, "core 1 never stalled");
    // The first gRPC connection is dealt to core 0; the model is owned by core 1.
    let model = &models_per_core("t", 2)[1];
    let mut c = srv.client().await;
    let start = Instant::now();
    let update = legacy_update("r", "t", model, "vllm", b"h", 16);
    let sent = tokio::time::timeout(
        Duration::from_secs(30),
        c.report_cache_state(tokio_stream::iter(vec![update])),
    )
    .await
    .expect("the ingest call hung");
    let status = sent.expect_err("acknowledged while its owner core was stalled");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "failed only after {:?}",
        start.elapsed()
    );
}

/// SIGTERM completes within the documented bound (10 s gRPC drain + 1 s, then at most 5 s for
/// HTTP) even while a producer keeps a ReportCacheState stream open and busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_completes_within_the_drain_bound_under_a_live_producer() {
    let mut srv = Server::start(2, &[]);
    let mut c = srv.client().await;
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let producer = tokio::spawn(async move {
        for i in 0..10_000u32 {
            let u = legacy_update("r", "t", "m", "vllm", &i.to_be_bytes(), 16);
            if tx.send(u).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let stream = tokio::spawn(async move {
        let _ = c
            .report_cache_state(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await;
    });
    // The stream is open and busy: its updates are being applied.
    let mut reader = srv.client().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while cache_state(&mut reader, "t", "m")
        .await
        .summary
        .map_or(0, |s| s.total_prefixes)
        == 0
    {
        assert!(
            Instant::now() < deadline,
            "the producer's updates were never applied"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let start = Instant::now();
    let status = tokio::task::spawn_blocking(move || srv.terminate())
        .await
        .unwrap();
    let took = start.elapsed();
    assert!(status.success(), "exit {status}");
    assert!(took < Duration::from_secs(18), "SIGTERM took {took:?}");
    producer.abort();
    stream.abort();
}

/// The values of a per-core series (`name{core="…"} value`), one per core.
fn per_core_values(text: &str, name: &str) -> Vec<f64> {
    text.lines()
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix('{'))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect()
}

fn name_bytes(srv: &Server) -> f64 {
    per_core_values(&metrics_text(srv), "inferencecache_core_index_string_bytes")
        .iter()
        .sum()
}

/// Interned names are freed once nothing refers to them, and bounded in bytes.
/// Messages that store nothing keep no names; names of swept entries are reclaimed, so unique
/// tenants whose entries expire are accepted for ever under a 64 KiB table (without the reclaim
/// the third round would not fit); fresh names beyond the bound are refused
/// (`STRING_TABLE_FULL`, counted) and the table stays within it.
async fn interned_names_are_reclaimed_and_bounded_in_bytes(shards: usize) {
    let srv = Server::start(
        shards,
        &[
            "--sweep-interval-ms",
            "100",
            "--index-max-string-bytes",
            "65536",
        ],
    );
    let mut c = srv.client().await;
    let tenant = |tag: &str, i: usize| format!("{tag}-{i:04}-{}", "x".repeat(1000));
    // No prefixes, no stats: accepted, nothing kept.
    let empty: Vec<_> = (0..300)
        .map(|i| pb::CacheStateUpdate {
            tenant_id: tenant("empty", i),
            model_id: "m".into(),
            replica_id: "r".into(),
            hash_scheme: "vllm".into(),
            ..Default::default()
        })
        .collect();
    assert!(report(&mut c, empty).await.accepted);
    assert_eq!(name_bytes(&srv), 0.0);
    // Entries stamped so that they expire 300 ms after arrival.
    let ttl_us: i64 = 30 * 60 * 1_000_000;
    for round in 0..5 {
        let ts = now_us() - ttl_us + 300_000;
        let updates: Vec<_> = (0..40)
            .map(|i| {
                let mut u = legacy_update(
                    "r",
                    &tenant(&format!("round{round}"), i),
                    "m",
                    "vllm",
                    b"h",
                    16,
                );
                u.timestamp_us = ts;
                u
            })
            .collect();
        let ack = report(&mut c, updates).await;
        assert!(ack.accepted, "round {round}: {ack:?}");
        assert!(name_bytes(&srv) > 0.0);
        let s = &srv;
        poll_until(
            "names of swept entries reclaimed",
            Duration::from_secs(20),
            || async move { name_bytes(s) == 0.0 },
        )
        .await;
    }
    // Fresh unique names: the table fills up to its byte bound, then refuses.
    let updates: Vec<_> = (0..200)
        .map(|i| legacy_update("r", &tenant("fresh", i), "m", "vllm", b"h", 16))
        .collect();
    let ack = report(&mut c, updates).await;
    assert!(!ack.accepted);
    assert_eq!(ack.reason_code, "STRING_TABLE_FULL");
    let text = metrics_text(&srv);
    let per_core = per_core_values(&text, "inferencecache_core_index_string_bytes");
    assert_eq!(per_core.len(), shards);
    assert!(per_core.iter().all(|b| *b <= 65536.0), "{per_core:?}");
    let refused = metric_value(
        &text,
        "inferencecache_ingest_refused_total{reason=\"string_table_full\"}",
    );
    assert!(refused.is_some_and(|n| n >= 1.0), "{refused:?}");
}
shards_1_and_2!(interned_names_are_reclaimed_and_bounded_in_bytes);

/// A key keeps at most `--index-max-holders-per-key` replicas. A further
/// replica is not added to it, the rest of its message is applied, and the stream's Ack says
/// `accepted: false`, `KEY_HOLDERS_FULL` (counted); known holders still refresh.
async fn a_key_keeps_at_most_its_holder_bound(shards: usize) {
    let srv = Server::start(shards, &["--index-max-holders-per-key", "8"]);
    let mut c = srv.client().await;
    let updates: Vec<_> = (0..10)
        .map(|i| {
            let mut u = legacy_update(&format!("r{i:02}"), "t", "m", "vllm", b"hot", 128);
            let own = u.prefixes[0].clone();
            u.prefixes.push(pb::PrefixEntry {
                prefix_hash: format!("own-{i}").into_bytes(),
                ..own
            });
            u
        })
        .collect();
    let ack = report(&mut c, updates).await;
    assert!(!ack.accepted);
    assert_eq!(ack.reason_code, "KEY_HOLDERS_FULL");
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"hot", 128)).await;
    let mut got: Vec<_> = r
        .replica_scores
        .iter()
        .map(|s| s.replica_id.clone())
        .collect();
    got.sort();
    let want: Vec<_> = (0..8).map(|i| format!("r{i:02}")).collect();
    assert_eq!(got, want);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"own-9", 128)).await;
    let got: Vec<_> = r
        .replica_scores
        .iter()
        .map(|s| s.replica_id.as_str())
        .collect();
    assert_eq!(
        got,
        ["r09"],
        "the rest of a partly refused message is applied"
    );
    let refresh = legacy_update("r03", "t", "m", "vllm", b"hot", 256);
    assert!(report(&mut c, vec![refresh]).await.accepted);
    let refused = metric_value(
        &metrics_text(&srv),
        "inferencecache_ingest_refused_total{reason=\"key_holders_full\"}",
    );
    assert_eq!(refused, Some(2.0));
}
shards_1_and_2!(a_key_keeps_at_most_its_holder_bound);

/// A replica keeps at most 32 separate stretches of one run of chain blocks
/// (`runstore::MAX_REPLICA_EXTENTS`): single blocks of a stored 100-block chain refreshed with
/// another tier split its stretch two more each, until a refresh that would split it past the
/// bound is not applied and the stream's Ack says `accepted: false`, `RUN_EXTENTS_FULL`
/// (counted). A block then removed from the middle of the last stretch takes the stretch's
/// rest out with it: those blocks follow the removed one, so the chain's match ends there
/// either way; the blocks before it are still held.
async fn a_replica_keeps_at_most_its_stretches_of_a_run(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let hashes: Vec<[u8; 8]> = (0..100u64)
        .map(|b| (b + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes())
        .collect();
    let blocks: Vec<&[u8]> = hashes.iter().map(|h| &h[..]).collect();
    let counts = vec![16; blocks.len()];
    let chain = chain_update("r1", "t", "m", "vllm", &blocks, &counts);
    assert!(report(&mut c, vec![chain]).await.accepted);
    let refreshes: Vec<_> = (1..blocks.len() - 1)
        .step_by(3)
        .map(|b| {
            let mut u = legacy_update("r1", "t", "m", "vllm", blocks[b], 16 * (b as i32 + 1));
            u.prefixes[0].tier = 2;
            u
        })
        .collect();
    let ack = report(&mut c, refreshes).await;
    assert!(!ack.accepted);
    assert_eq!(ack.reason_code, "RUN_EXTENTS_FULL");
    // Held: r1 answers with the block's tokens matched (a miss may still name r1 as a
    // tenant-hot candidate, with none).
    let holders = |r: &pb::LookupRouteResponse| {
        let held = r.replica_scores.iter().filter(|s| s.matched_tokens > 0);
        held.map(|s| s.replica_id.clone()).collect::<Vec<_>>()
    };
    // Blocks 1, 4, .., 43 refreshed (31 stretches), the 16th refresh and those after it
    // (18) refused; the chain's last block refreshed alone makes the 32nd stretch, 44..99 the
    // 31st; cut block 90 out of its middle.
    let mut last = legacy_update("r1", "t", "m", "vllm", blocks[99], 1600);
    last.prefixes[0].tier = 2;
    assert!(report(&mut c, vec![last]).await.accepted);
    let cut = cache_event(
        pb::cache_event::Type::PrefixEvicted,
        "t",
        "m",
        "r1",
        blocks[90],
        "",
    );
    publish_event(&mut c, cut).await;
    for (b, held) in [
        (80, true),
        (89, true),
        (90, false),
        (95, false),
        (98, false),
        (99, true),
    ] {
        let r = lookup(&mut c, exact_lookup("t", "m", "vllm", blocks[b], 16)).await;
        assert_eq!(holders(&r) == ["r1"], held, "block {b}");
    }
    let r = lookup(&mut c, chain_lookup("t", "m", "vllm", &blocks, &counts)).await;
    assert_eq!(r.replica_scores.len(), 1);
    assert_eq!(r.replica_scores[0].matched_tokens, 90 * 16);
    let text = metrics_text(&srv);
    let refused = "inferencecache_ingest_refused_total{reason=\"run_extents_full\"}";
    assert_eq!(metric_value(&text, refused), Some(18.0));
    let hits = "inferencecache_limit_hits_total{limit=\"index_run_extents\"}";
    assert_eq!(
        metric_value(&text, hits),
        Some(19.0),
        "the refusals and the cut"
    );
}
shards_1_and_2!(a_replica_keeps_at_most_its_stretches_of_a_run);

/// A scope `(tenant, model, hash scheme)` keeps at most `--index-max-replicas-per-scope`
/// serving replicas. A message of one more is not applied and the stream's Ack says
/// `accepted: false`, `SCOPE_REPLICAS_FULL` (counted, and in `inferencecache_limit_hits_total`);
/// everything acknowledged before is still answered, the serving replicas still refresh, and
/// another scheme takes the refused replica.
async fn a_scope_keeps_at_most_its_replica_bound(shards: usize) {
    let srv = Server::start(shards, &["--index-max-replicas-per-scope", "8"]);
    let mut c = srv.client().await;
    let update = |r: usize, scheme: &str| {
        legacy_update(
            &format!("r{r:02}"),
            "t",
            "m",
            scheme,
            format!("own-{r}").as_bytes(),
            128,
        )
    };
    let acked: Vec<_> = (0..8).map(|r| update(r, "vllm")).collect();
    assert!(report(&mut c, acked).await.accepted);
    let ack = report(&mut c, vec![update(8, "vllm")]).await;
    assert!(!ack.accepted);
    assert_eq!(ack.reason_code, "SCOPE_REPLICAS_FULL");
    for r in 0..8 {
        let q = exact_lookup("t", "m", "vllm", format!("own-{r}").as_bytes(), 128);
        let got = lookup(&mut c, q).await;
        let ids: Vec<_> = got
            .replica_scores
            .iter()
            .map(|s| s.replica_id.clone())
            .collect();
        assert_eq!(ids, [format!("r{r:02}")], "acknowledged entries are kept");
    }
    // A miss (answered by affinity among the serving replicas, if at all): r08 is not one.
    let got = lookup(&mut c, exact_lookup("t", "m", "vllm", b"own-8", 128)).await;
    assert!(
        got.replica_scores.iter().all(|s| s.replica_id != "r08"),
        "the refused message was not applied: {got:?}"
    );
    let refresh = legacy_update("r03", "t", "m", "vllm", b"more", 256);
    assert!(report(&mut c, vec![refresh]).await.accepted);
    assert!(report(&mut c, vec![update(8, "sglang")]).await.accepted);
    let text = metrics_text(&srv);
    let refused = metric_value(
        &text,
        "inferencecache_ingest_refused_total{reason=\"scope_replicas_full\"}",
    );
    assert_eq!(refused, Some(1.0));
    let hits = metric_value(
        &text,
        "inferencecache_limit_hits_total{limit=\"index_scope_replicas\"}",
    );
    assert_eq!(hits, Some(1.0));
}
shards_1_and_2!(a_scope_keeps_at_most_its_replica_bound);

/// A LookupRoute answer carries at most 1,024 replica scores, the top-ranked
/// ones in the final order (score descending, replica id ascending), even for a key held by
/// more replicas (here 1,100, allowed by raising the holder bound).
async fn lookup_answers_keep_the_top_ranked_scores(shards: usize) {
    let srv = Server::start(shards, &["--index-max-holders-per-key", "2000"]);
    let mut c = srv.client().await;
    let ts = fresh_ts();
    let n = 1100;
    // At least the default matched-tokens floor (64).
    let tokens = |i: usize| 64 + (i * 7 % 100) as i32;
    let mut updates: Vec<_> = (0..n)
        .map(|i| {
            let mut u = legacy_update(&format!("r{i:04}"), "t", "m", "vllm", b"hot", tokens(i));
            u.timestamp_us = ts;
            u
        })
        .collect();
    // One more serving replica, so distinguishing power is not 0 and scores follow tokens.
    updates.push(legacy_update("other", "t", "m", "vllm", b"cold", 16));
    assert!(report(&mut c, updates).await.accepted);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"hot", 16)).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH");
    let mut want: Vec<(i32, String)> = (0..n).map(|i| (tokens(i), format!("r{i:04}"))).collect();
    want.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    want.truncate(1024);
    let got: Vec<(i32, String)> = r
        .replica_scores
        .iter()
        .map(|s| (s.matched_tokens, s.replica_id.clone()))
        .collect();
    assert_eq!(got.len(), 1024);
    assert_eq!(got, want);
}
shards_1_and_2!(lookup_answers_keep_the_top_ranked_scores);

/// Stats rows are bounded per `(tenant, model)` (1,024 replicas): a further replica's stats are
/// not stored and the stream's Ack says `accepted: false`, `STATS_ROWS_FULL` (counted); known
/// replicas still update theirs.
async fn stats_rows_per_model_are_bounded(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let row = |i: usize| pb::CacheStateUpdate {
        tenant_id: "t".into(),
        model_id: "m".into(),
        replica_id: format!("r{i:04}"),
        stats: stats(0.5, 0.1),
        ..Default::default()
    };
    assert!(report(&mut c, (0..1024).map(row).collect()).await.accepted);
    let ack = report(&mut c, vec![row(1024)]).await;
    assert!(!ack.accepted);
    assert_eq!(ack.reason_code, "STATS_ROWS_FULL");
    assert!(report(&mut c, vec![row(7)]).await.accepted);
    let st = cache_state(&mut c, "t", "m").await;
    assert_eq!(st.replicas.len(), 1024);
    let refused = metric_value(
        &metrics_text(&srv),
        "inferencecache_ingest_refused_total{reason=\"stats_rows_full\"}",
    );
    assert_eq!(refused, Some(1.0));
}
shards_1_and_2!(stats_rows_per_model_are_bounded);
const REPORT_PATH: &str = "/inferencecache.v1alpha1.InferenceCache/ReportCacheState";

/// A long producer stream of small messages, each its own DATA frame and sent faster than the
/// server applies them, is slowed by flow control and runs to the end: h2's automatic frame
/// budget used to answer GOAWAY `too_many_data_frames` after ~9–13k messages.
async fn small_message_producer_streams_run_to_the_end(shards: usize) {
    const MESSAGES: usize = 40_000;
    let srv = Server::start(shards, &[]);
    let mut conn = raw_connection(srv.grpc_port).await;
    let mut call = raw_call(&mut conn, REPORT_PATH).await;
    for i in 0..MESSAGES as u64 {
        let u = legacy_update("r1", "t", "m", "vllm", &i.to_be_bytes(), 16);
        let sent = call.send(grpc_message(&prost::Message::encode_to_vec(&u)));
        sent.await
            .unwrap_or_else(|e| panic!("stream cut off after {i} messages: {e}"));
    }
    let end = tokio::time::timeout(Duration::from_secs(120), call.finish(true))
        .await
        .expect("answered in time")
        .expect("stream not cut off");
    assert_eq!(end.grpc_status.as_deref(), Some("0"), "{end:?}");
    let ack: pb::Ack = prost::Message::decode(&end.body[5..]).expect("an Ack");
    assert!(ack.accepted, "{ack:?}");
    let applied = metric_value(&metrics_text(&srv), "inferencecache_ingest_entries_total");
    assert_eq!(applied, Some(MESSAGES as f64));
}
shards_1_and_2!(small_message_producer_streams_run_to_the_end);

/// The first `sent` bytes of a message declaring `declared` bytes.
fn partial_message(declared: usize, sent: usize) -> Bytes {
    let mut m = vec![0u8];
    m.extend_from_slice(&(declared as u32).to_be_bytes());
    m.resize(5 + sent, 0x0a);
    m.into()
}

/// Streams that declare a 4 MiB message and send 16 KiB of it cost what they sent, not what
/// they declared: 512 such streams used to take ~2 MB each (1,024 → 2 GB, a second connection
/// aborted the process).
async fn held_partial_messages_cost_what_arrived(shards: usize) {
    const STREAMS: usize = 512;
    const SENT: usize = 16 * 1024;
    let srv = Server::start(shards, &[]);
    let before = rss_bytes(srv.child.id());
    let mut conn = raw_connection(srv.grpc_port).await;
    let mut calls = Vec::new();
    for _ in 0..STREAMS {
        let mut call = raw_call(&mut conn, REPORT_PATH).await;
        call.send(partial_message(4 * 1024 * 1024, SENT))
            .await
            .expect("send");
        calls.push(call);
    }
    // The server read everything that was sent: nothing is left in flight on the connection
    // (checked a few times in a row, so bytes the client was still writing are not missed).
    let mut drained_polls = 0;
    let drained = wait_until(Duration::from_secs(30), || {
        drained_polls = if loopback_bytes_in_flight(srv.grpc_port) == 0 {
            drained_polls + 1
        } else {
            0
        };
        drained_polls >= 4
    });
    assert!(drained, "the server did not read what was sent");
    let grown = rss_bytes(srv.child.id()).saturating_sub(before);
    assert!(
        grown < 64 * 1024 * 1024,
        "{STREAMS} streams holding {SENT} bytes each grew RSS by {} MiB",
        grown >> 20
    );
    assert!(srv.child.id() > 0);
    drop(calls);
}
shards_1_and_2!(held_partial_messages_cost_what_arrived);

/// One connection may hold at most 4 largest messages' worth of incomplete messages: of five
/// streams that each hold almost a largest message, exactly one (whichever crosses the budget
/// first: the client may interleave their frames) fails at once with RESOURCE_EXHAUSTED and is
/// counted; the other four are unaffected and end only at the receive timeout.
async fn a_connection_holds_a_bounded_number_of_incomplete_bytes(shards: usize) {
    const ALMOST: usize = 4 * 1024 * 1024 - 1024;
    let srv = Server::start(shards, &["--grpc-message-timeout-ms", "15000"]);
    let mut conn = raw_connection(srv.grpc_port).await;
    let mut calls = Vec::new();
    for _ in 0..5 {
        let mut call = raw_call(&mut conn, REPORT_PATH).await;
        let _ = call.send(partial_message(4 * 1024 * 1024, ALMOST)).await;
        calls.push(tokio::spawn(async move {
            let end = call.finish(false).await.expect("an answer");
            end.grpc_status.unwrap_or_default()
        }));
    }
    let mut statuses = Vec::new();
    for call in calls {
        let status = tokio::time::timeout(Duration::from_secs(60), call)
            .await
            .expect("answered in time")
            .expect("the call's task");
        statuses.push(status);
    }
    statuses.sort();
    assert_eq!(statuses, ["4", "4", "4", "4", "8"], "{statuses:?}");
    let refused = metric_value(
        &metrics_text(&srv),
        "inferencecache_grpc_messages_refused_total{reason=\"connection_budget\"}",
    );
    assert_eq!(refused, Some(1.0));
}
shards_1_and_2!(a_connection_holds_a_bounded_number_of_incomplete_bytes);

/// A message that stops arriving halfway fails its stream with DEADLINE_EXCEEDED after the
/// receive timeout, instead of holding its bytes (and the stream) forever.
async fn an_incomplete_message_times_out(shards: usize) {
    let srv = Server::start(shards, &["--grpc-message-timeout-ms", "500"]);
    let mut conn = raw_connection(srv.grpc_port).await;
    let mut call = raw_call(&mut conn, REPORT_PATH).await;
    call.send(partial_message(1000, 10)).await.expect("send");
    let end = tokio::time::timeout(Duration::from_secs(20), call.finish(false))
        .await
        .expect("answered after the receive timeout, not never")
        .expect("an answer");
    assert_eq!(end.grpc_status.as_deref(), Some("4"), "{end:?}");
    let refused = metric_value(
        &metrics_text(&srv),
        "inferencecache_grpc_messages_refused_total{reason=\"timeout\"}",
    );
    assert_eq!(refused, Some(1.0));
}
shards_1_and_2!(an_incomplete_message_times_out);
