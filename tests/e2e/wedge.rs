//! No client can wedge a core (issue 30): a producer that introduces many distinct names does
//! not make a maintenance step take the core away from its requests, and shutdown keeps its
//! bound whatever a core does.

use std::time::{Duration, Instant};

use crate::support::*;

/// The issue's stall, reproduced small: one tenant sends 100,000 distinct adapter ids (one
/// prefix each, 4,096 per message) against a 50,000-entry cap, so the cap evicts half of them
/// and the next sweep (every 2 s) reclaims 50,000 keyspaces of one scope. Before the fix that
/// reclaim removed each from the scope's list with a scan of the list, in one go (1.76 s at this
/// size in a release build, far more in a debug one): lookups hung to their deadline and
/// `/readyz` went 503. Now the reclaim runs in the sweep's slices: through three sweep passes a
/// well-behaved client's lookups are answered within 1 s each, `/readyz` stays 200, and the
/// longest sweep slice stays far below a stall.
///
/// An older build (`INFERENCECACHE_TEST_SERVER_BIN`) does not know the keyspace bounds (and has
/// none); the flags that lift them for this shape are passed only to this build.
async fn many_adapters_do_not_stall_the_sweep(shards: usize) {
    const ADAPTERS: usize = 100_000;
    const PER_MESSAGE: usize = 4096;
    let mut flags = vec![
        "--index-max-entries",
        "50000",
        "--sweep-interval-ms",
        "2000",
    ];
    if std::env::var("INFERENCECACHE_TEST_SERVER_BIN").is_err() {
        flags.extend(["--index-max-keyspaces-per-model", "200000"]);
    }
    let srv = Server::start(shards, &flags);
    let mut c = srv.client().await;
    // Older than the well-behaved tenant's entry below, so the cap evicts adapters only.
    let ts = now_us() - 60_000_000;
    let messages: Vec<pb::CacheStateUpdate> = (0..ADAPTERS)
        .step_by(PER_MESSAGE)
        .map(|first| adapter_update("t", "m", first, PER_MESSAGE.min(ADAPTERS - first), ts))
        .collect();
    let ack = report(&mut c, messages).await;
    assert!(ack.accepted, "{ack:?}");
    // The core of ("t", "m") and a well-behaved tenant on the same core.
    let core = core_of("t", "m", shards);
    let other = tenants_per_core("good", "m", shards)[core].clone();
    let good = legacy_update("r1", &other, "m", "vllm", b"good", 16);
    assert!(report(&mut c, vec![good]).await.accepted);
    // Completed sweep passes of that core (a counter: `_total` in the exposition).
    let sweeps = |srv: &Server| {
        let series = format!("inferencecache_core_sweeps_total{{core=\"{core}\"}}");
        let text = metrics_text(srv);
        let n = metric_value(&text, &series);
        n.unwrap_or_else(|| panic!("core {core} did not answer the scrape (stalled)"))
    };
    let first = sweeps(&srv);
    let until = Instant::now() + Duration::from_secs(60);
    let mut lookups = 0;
    while sweeps(&srv) < first + 3.0 {
        assert!(Instant::now() < until, "three sweep passes within a minute");
        let mut req = tonic::Request::new(exact_lookup(&other, "m", "vllm", b"good", 16));
        req.set_timeout(Duration::from_secs(1));
        let started = Instant::now();
        let r = c.lookup_route(req).await;
        let r = r.unwrap_or_else(|e| panic!("lookup {lookups} after {:?}: {e}", started.elapsed()));
        let r = r.into_inner();
        assert!(
            r.replica_scores.iter().any(|s| s.replica_id == "r1"),
            "{r:?}"
        );
        let (code, _) = http_get(srv.http_port, "/readyz").expect("readyz");
        assert_eq!(code, 200, "/readyz after {lookups} lookups");
        lookups += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let text = metrics_text(&srv);
    let series = format!("inferencecache_core_sweep_last_max_slice_cpu_seconds{{core=\"{core}\"}}");
    let slice = metric_value(&text, &series).expect("slice probe");
    // The slice budget is 250 µs; a debug build on a shared machine overruns it, a stall is
    // seconds.
    assert!(slice < 0.1, "longest sweep slice used {slice} s of CPU");
    assert!(lookups > 10, "{lookups}");
}
shards_1_and_2!(many_adapters_do_not_stall_the_sweep);

/// One message that takes the index far over the global cap is not evicted down in one step:
/// with steps of at most 64 evictions (the test hook; `CAP_ENFORCE_SLICE_MAX_EVICTIONS` in
/// production), a 3,000-entry message against a 1,000-entry cap takes at least 31 steps, the
/// core serving requests between two, and is acknowledged only once the index is back at the
/// cap. Before, the one core evicted all 2,000 inside the ingest (≈ 4 ms of core time per
/// 4,096-adapter message in a release build; lookups waited behind it), and a cross-core round
/// asked every core for all of them at once.
async fn evictions_past_the_cap_run_in_bounded_steps(shards: usize) {
    let srv = Server::start_opts(
        shards,
        StartOpts {
            flags: &["--index-max-entries", "1000"],
            env: &[("INFERENCECACHE_TEST_SWEEP_SLICE_ENTRIES", "64")],
            ..Default::default()
        },
    );
    let mut c = srv.client().await;
    let ack = report(&mut c, vec![adapter_update("t", "m", 0, 3000, now_us())]).await;
    assert!(ack.accepted, "{ack:?}");
    let text = metrics_text(&srv);
    let total = |family: &str| -> f64 {
        (0..shards)
            .filter_map(|core| metric_value(&text, &format!("{family}{{core=\"{core}\"}}")))
            .sum()
    };
    let steps = total("inferencecache_core_cap_enforce_slices_total");
    assert!(
        steps >= 31.0,
        "{steps} eviction steps for 2,000 evictions of at most 64"
    );
    let entries = metric_value(&text, r#"inferencecache_index_entries{model="m"}"#);
    assert_eq!(entries, Some(1000.0), "at the cap when acknowledged");
}
shards_1_and_2!(evictions_past_the_cap_run_in_bounded_steps);

/// Across cores, a round of global-cap evictions takes at most `CAP_ROUND_MAX_EVICTIONS` (128)
/// in production: each core's candidate request and its share of the evictions are one piece
/// each, and rounds of 1,024 made pieces of 0.76 and 0.94 ms in the adversarial soak. 2,000
/// evictions are then 16 rounds, each evicting on every core (32 steps at `--shards 2`; rounds
/// of 1,024 made 4, of 256 16).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_core_cap_rounds_are_small() {
    let shards = 2;
    let srv = Server::start(shards, &["--index-max-entries", "1000"]);
    let mut c = srv.client().await;
    let ack = report(&mut c, vec![adapter_update("t", "m", 0, 3000, now_us())]).await;
    assert!(ack.accepted, "{ack:?}");
    let text = metrics_text(&srv);
    let steps: f64 = (0..shards)
        .filter_map(|core| {
            let series = format!("inferencecache_core_cap_enforce_slices_total{{core=\"{core}\"}}");
            metric_value(&text, &series)
        })
        .sum();
    assert!(steps >= 32.0, "{steps} eviction steps for 2,000 evictions");
    let entries = metric_value(&text, r#"inferencecache_index_entries{model="m"}"#);
    assert_eq!(entries, Some(1000.0), "at the cap when acknowledged");
}

/// One ReportCacheState message of `n` prefixes, each under its own adapter `a{first + i}`.
fn adapter_update(
    tenant: &str,
    model: &str,
    first: usize,
    n: usize,
    ts: i64,
) -> pb::CacheStateUpdate {
    pb::CacheStateUpdate {
        replica_id: "r0".into(),
        model_id: model.into(),
        tenant_id: tenant.into(),
        hash_scheme: "vllm".into(),
        timestamp_us: ts,
        prefixes: (first..first + n)
            .map(|i| pb::PrefixEntry {
                prefix_hash: (i as u64).to_be_bytes().to_vec(),
                token_count: 16,
                adapter_id: format!("adapter-{i:08}"),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// Distinct keyspaces per `(tenant, model)` are bounded: a message that would create one more
/// is not applied and the stream's Ack says so (`accepted: false`, `KEYSPACES_FULL`), counted in
/// `inferencecache_ingest_refused_total{reason="keyspaces_full"}` and
/// `inferencecache_limit_hits_total{limit="index_keyspaces"}`; messages on known adapters and
/// other models are still applied.
async fn keyspaces_beyond_the_bound_are_refused(shards: usize) {
    let srv = Server::start(shards, &["--index-max-keyspaces-per-model", "100"]);
    let mut c = srv.client().await;
    let ts = fresh_ts();
    assert!(
        report(&mut c, vec![adapter_update("t", "m", 0, 100, ts)])
            .await
            .accepted
    );
    let ack = report(&mut c, vec![adapter_update("t", "m", 100, 1, ts)]).await;
    assert!(!ack.accepted, "a refused message was acknowledged");
    assert_eq!(ack.reason_code, "KEYSPACES_FULL");
    // Nothing of it was applied.
    let hash = 100u64.to_be_bytes();
    let req = with_adapter(
        exact_lookup("t", "m", "vllm", &hash, 16),
        "adapter-00000100",
    );
    let r = lookup(&mut c, req).await;
    assert_ne!(r.reason_code, "PREFIX_MATCH", "{r:?}");
    assert!(
        r.replica_scores.iter().all(|s| s.matched_tokens == 0),
        "{r:?}"
    );
    // Known adapters and another model still fit.
    assert!(
        report(&mut c, vec![adapter_update("t", "m", 0, 100, ts)])
            .await
            .accepted
    );
    assert!(
        report(&mut c, vec![adapter_update("t", "m2", 0, 100, ts)])
            .await
            .accepted
    );
    let text = metrics_text(&srv);
    let refused = metric_value(
        &text,
        "inferencecache_ingest_refused_total{reason=\"keyspaces_full\"}",
    );
    assert_eq!(refused, Some(1.0));
    let hits = metric_value(
        &text,
        "inferencecache_limit_hits_total{limit=\"index_keyspaces\"}",
    );
    assert_eq!(hits, Some(1.0));
}
shards_1_and_2!(keyspaces_beyond_the_bound_are_refused);

/// SIGTERM ends the process within the documented bound even when a core never answers again
/// (the stall-injection hook keeps core 1 in one sweep step for a minute): its final snapshot
/// is skipped with one log line, the previous complete snapshot stays (a restart restores
/// it), and one line names the core that did not stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_stalled_core_exits_within_the_bound() {
    let dir = scratch_dir("wedge-shutdown");
    let log = dir.join("server.log");
    let state = dir.join("state");
    let state_s = state.to_string_lossy().into_owned();
    let flags = [
        "--state-dir",
        state_s.as_str(),
        "--snapshot-interval-ms",
        "300",
        "--sweep-interval-ms",
        "3000",
    ];
    let mut srv = Server::start_opts(
        2,
        StartOpts {
            flags: &flags,
            env: &[("INFERENCECACHE_TEST_SWEEP_FAULT", "stall:1:60000")],
            stderr_file: Some(log.clone()),
            log_level: Some("info"),
            ..Default::default()
        },
    );
    let model = models_per_core("t", 2)[1].clone();
    let mut c = srv.client().await;
    let u = legacy_update("r-kept", "t", &model, "vllm", b"kept", 16);
    assert!(report(&mut c, vec![u]).await.accepted);
    // A periodic snapshot with the entry completes before core 1 stalls (at its first sweep).
    let snapshotted = wait_until(Duration::from_secs(2), || {
        let text = metrics_text(&srv);
        metric_value(&text, "inferencecache_snapshot_entries").is_some_and(|n| n >= 1.0)
    });
    assert!(snapshotted, "a snapshot with the entry");
    let stalled = wait_until(Duration::from_secs(20), || {
        http_get(srv.http_port, "/readyz").is_ok_and(|(s, _)| s == 503)
    });
    assert!(stalled, "core 1 never stalled");
    let start = Instant::now();
    let status = tokio::task::spawn_blocking(move || {
        let st = srv.terminate();
        drop(srv);
        st
    })
    .await
    .unwrap();
    let took = start.elapsed();
    assert!(status.success(), "exit {status}");
    assert!(took < Duration::from_secs(18), "SIGTERM took {took:?}");
    log_text_with(&log, "shutdown_cores_not_stopped");
    let text = log_text_with(&log, "snapshot_final_skipped_core_stalled");
    let lines = |what: &str| text.lines().filter(|l| l.contains(what)).count();
    assert_eq!(lines("snapshot_final_skipped_core_stalled"), 1, "{text}");
    assert_eq!(lines("shutdown_cores_not_stopped"), 1, "{text}");
    // The previous complete snapshot is restored.
    let srv = Server::start(2, &["--state-dir", state_s.as_str()]);
    let mut c = srv.client().await;
    let r = lookup(&mut c, exact_lookup("t", &model, "vllm", b"kept", 16)).await;
    assert!(
        r.replica_scores.iter().any(|s| s.replica_id == "r-kept"),
        "{r:?}"
    );
}

/// `THP_enabled` of `/proc/<pid>/status`: whether the process may get transparent huge pages.
fn thp_enabled(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("THP_enabled:"))
        .map(|v| v.trim().to_string())
        .unwrap_or_default()
}

/// The server runs without transparent huge pages (a 2 MiB first-touch fault is milliseconds of
/// system time inside one maintenance slice: perf/runs/2026-12-06-maintenance-stress.md), unless
/// the operator's environment keeps them (`MIMALLOC_ALLOW_THP`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transparent_huge_pages_are_off_unless_the_environment_keeps_them() {
    if std::fs::read_to_string("/proc/self/status").is_ok_and(|s| !s.contains("THP_enabled:")) {
        eprintln!("skipped: this kernel does not report THP_enabled");
        return;
    }
    let srv = Server::start(1, &[]);
    assert_eq!(thp_enabled(srv.child.id()), "0");
    let kept = Server::start_opts(
        1,
        StartOpts {
            env: &[("MIMALLOC_ALLOW_THP", "1")],
            ..Default::default()
        },
    );
    assert_eq!(thp_enabled(kept.child.id()), "1");
}

/// One legacy update of `n` prefixes `0..n` (8-byte hashes).
fn many_prefixes_update(tenant: &str, n: usize) -> pb::CacheStateUpdate {
    pb::CacheStateUpdate {
        replica_id: "r0".into(),
        model_id: "m".into(),
        tenant_id: tenant.into(),
        hash_scheme: "vllm".into(),
        timestamp_us: now_us(),
        prefixes: (0..n)
            .map(|i| pb::PrefixEntry {
                prefix_hash: (i as u64).to_be_bytes().to_vec(),
                token_count: 16,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// A large message is applied in parts of `INGEST_PART_BLOCKS` (4,096) blocks (or fewer, when a
/// part's `INGEST_PART_BUDGET` runs out first), the core serving requests between two: 10,000
/// prefixes are at least three parts, all acknowledged and stored. Before,
/// one 4 MiB message of 250,000 prefixes held its core 125 ms in one step (release build).
async fn a_large_message_is_applied_in_parts(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let ack = report(&mut c, vec![many_prefixes_update("t", 10_000)]).await;
    assert!(ack.accepted, "{ack:?}");
    let text = metrics_text(&srv);
    let parts: f64 = (0..shards)
        .filter_map(|core| {
            metric_value(
                &text,
                &format!("inferencecache_core_ingest_parts_total{{core=\"{core}\"}}"),
            )
        })
        .sum();
    // 4,096 + 4,096 + 1,808 blocks, or more parts when one ran out of its 250 µs.
    assert!(parts >= 3.0, "{parts} parts");
    let state = c
        .get_cache_state(pb::GetCacheStateRequest {
            model_id: "m".into(),
            tenant_id: "t".into(),
        })
        .await
        .expect("GetCacheState")
        .into_inner();
    assert_eq!(state.summary.expect("summary").total_prefixes, 10_000);
}
shards_1_and_2!(a_large_message_is_applied_in_parts);

/// A large message that cannot fit is still refused whole, before any part is applied: its
/// first part checks the whole message (here 10,000 new adapters against a bound of 100
/// keyspaces per model).
async fn a_large_message_that_does_not_fit_is_refused_whole(shards: usize) {
    let srv = Server::start(shards, &["--index-max-keyspaces-per-model", "100"]);
    let mut c = srv.client().await;
    let ack = report(&mut c, vec![adapter_update("t", "m", 0, 10_000, now_us())]).await;
    assert!(!ack.accepted);
    assert_eq!(ack.reason_code, "KEYSPACES_FULL");
    let state = c
        .get_cache_state(pb::GetCacheStateRequest {
            model_id: "m".into(),
            tenant_id: "t".into(),
        })
        .await
        .expect("GetCacheState")
        .into_inner();
    assert_eq!(state.summary.map_or(0, |s| s.total_prefixes), 0);
}
shards_1_and_2!(a_large_message_that_does_not_fit_is_refused_whole);

/// Sum over the cores of the per-core counter `name` (`_total` in the exposition).
fn per_core_total(srv: &Server, name: &str, shards: usize) -> f64 {
    let text = metrics_text(srv);
    (0..shards)
        .filter_map(|core| metric_value(&text, &format!("{name}_total{{core=\"{core}\"}}")))
        .sum()
}

/// A ReportCacheState or PublishEvent message over `OFFCORE_DECODE_MIN_BYTES` (64 KiB) is
/// decoded on the decode pool while its core serves other requests, and applied as before; a
/// smaller one is decoded on the core. Before, tonic decoded every message in the poll that
/// received it: a 4 MiB message of 250,000 prefixes held the core for tens of ms.
async fn large_messages_are_decoded_off_the_core(shards: usize) {
    const DECODES: &str = "inferencecache_core_offcore_decodes";
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let small = legacy_update("r0", "t", "m", "vllm", b"small", 16);
    assert!(report(&mut c, vec![small]).await.accepted);
    let event = |prefix_hash: Vec<u8>| pb::CacheEvent {
        r#type: pb::cache_event::Type::PrefixAdded as i32,
        replica_id: "r0".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        prefix_hash,
        timestamp_us: now_us(),
        ..Default::default()
    };
    let ack = c
        .publish_event(event(b"e".to_vec()))
        .await
        .expect("small event");
    assert!(ack.into_inner().accepted);
    assert_eq!(
        per_core_total(&srv, DECODES, shards),
        0.0,
        "small: on the core"
    );

    let large = many_prefixes_update("t", 10_000);
    assert!(prost::Message::encoded_len(&large) > 64 * 1024);
    assert!(report(&mut c, vec![large]).await.accepted);
    let ack = c
        .publish_event(event(vec![7; 100_000]))
        .await
        .expect("large event");
    assert!(ack.into_inner().accepted);
    assert_eq!(
        per_core_total(&srv, DECODES, shards),
        2.0,
        "large: on the pool"
    );
    let state = c
        .get_cache_state(pb::GetCacheStateRequest {
            model_id: "m".into(),
            tenant_id: "t".into(),
        })
        .await
        .expect("GetCacheState")
        .into_inner();
    assert_eq!(state.summary.expect("summary").total_prefixes, 10_001);
}
shards_1_and_2!(large_messages_are_decoded_off_the_core);

/// Measurement, not a check (its numbers: perf/runs/2026-12-06-h30d.md): a well-behaved client
/// does a LookupRoute every 0.5 ms while another sends one ReportCacheState message of 250,000
/// legacy prefixes (≈ 3.5 MB); prints the lookups' latencies meanwhile (p50, p99, max) and when
/// the Ack came. Each client runs on a thread and runtime of its own, so encoding the large
/// message does not delay the lookups. `INFERENCECACHE_TEST_SERVER_BIN` picks the build;
/// `cargo test --release -p inference-cache --test e2e -- --ignored one_large_message_beside_lookups --nocapture`.
fn one_large_message_beside_lookups(shards: usize) {
    let srv = Server::start(shards, &[]);
    let url = srv.grpc_url();
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    };
    let connect = |url: String| async move {
        let channel = tonic::transport::Channel::from_shared(url)
            .expect("url")
            .connect()
            .await;
        pb::inference_cache_client::InferenceCacheClient::new(channel.expect("connect"))
    };
    let (tenant, prefix) = ("good", b"good");
    runtime().block_on(async {
        let mut c = connect(url.clone()).await;
        let good = legacy_update("r1", tenant, "m", "vllm", prefix, 16);
        assert!(report(&mut c, vec![good]).await.accepted);
    });
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let lookups = {
        let (url, done) = (url.clone(), done.clone());
        std::thread::spawn(move || {
            let rt = runtime();
            let mut c = rt.block_on(connect(url));
            let mut took = Vec::new();
            let until = Instant::now() + Duration::from_secs(60);
            while !done.load(std::sync::atomic::Ordering::Acquire) && Instant::now() < until {
                let t = Instant::now();
                let req = exact_lookup(tenant, "m", "vllm", prefix, 16);
                rt.block_on(c.lookup_route(req)).expect("LookupRoute");
                took.push(t.elapsed());
                std::thread::sleep(Duration::from_micros(500));
            }
            took
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    let large = many_prefixes_update("t", 250_000);
    let acked = runtime().block_on(async {
        let mut c = connect(url).await;
        let t = Instant::now();
        let ack = report(&mut c, vec![large]).await;
        assert!(ack.accepted, "{ack:?}");
        t.elapsed()
    });
    std::thread::sleep(Duration::from_millis(50));
    done.store(true, std::sync::atomic::Ordering::Release);
    let mut took = lookups.join().expect("lookup thread");
    took.sort();
    let at = |q: f64| took[((took.len() - 1) as f64 * q) as usize];
    println!(
        "shards {shards}: ack after {acked:?}; {} lookups: p50 {:?}, p99 {:?}, max {:?}",
        took.len(),
        at(0.5),
        at(0.99),
        took.last().expect("lookups")
    );
}

mod one_large_message_beside_lookups {
    #[test]
    #[ignore = "a measurement: run on a release build (see the function's docs)"]
    fn shards_1() {
        super::one_large_message_beside_lookups(1)
    }
}
