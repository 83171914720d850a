//! StreamCacheEvents and StreamMetrics (docs/BEHAVIOUR.md §11): the live change feed from every
//! core with its filters, the subscriber cap, a lagging subscriber that is told so while ingest
//! goes on; the metrics stream from the `/metrics` registry with its bounds. The reference's stub
//! (streams close at once) without the flags is pinned by `foundation` and checked here too.

use std::time::{Duration, Instant};

use pb::cache_event::Type;
use tonic::Streaming;

use crate::support::*;

type Client = pb::inference_cache_client::InferenceCacheClient<tonic::transport::Channel>;

async fn subscribe(c: &mut Client, model: &str, types: &[Type]) -> Streaming<pb::CacheEvent> {
    c.stream_cache_events(pb::StreamEventsRequest {
        model_id: model.into(),
        tenant_id: String::new(),
        types: types.iter().map(|t| *t as i32).collect(),
    })
    .await
    .expect("subscribe")
    .into_inner()
}

async fn next<T>(s: &mut Streaming<T>) -> Result<Option<T>, tonic::Status> {
    tokio::time::timeout(Duration::from_secs(10), s.message())
        .await
        .expect("a message or the end within 10 s")
}

/// (type, model, replica, prefix) of an event.
fn key(e: &pb::CacheEvent) -> (i32, String, String, Vec<u8>) {
    (
        e.r#type,
        e.model_id.clone(),
        e.replica_id.clone(),
        e.prefix_hash.clone(),
    )
}

/// One update of `n` prefixes `p0`, `p1`, … of `(t, m)` by replica `r`.
fn many_prefixes(n: usize) -> pb::CacheStateUpdate {
    let mut u = legacy_update("r", "t", "m", "vllm", b"p0", 16);
    u.prefixes = (0..n)
        .map(|i| pb::PrefixEntry {
            prefix_hash: format!("p{i}").into_bytes(),
            token_count: 16,
            ..Default::default()
        })
        .collect();
    u
}

/// Changes applied on every core reach every subscriber, filtered by model and type; the
/// subscriber cap refuses one more; a closed subscription frees its slot.
async fn stream_cache_events_from_every_core(shards: usize) {
    let srv = Server::start(shards, &["--max-event-subscribers", "2"]);
    let mut c = srv.client().await;
    let models = models_per_core("t", shards.max(2));
    let (m0, m1) = (&models[0], &models[1]);
    let mut all = subscribe(&mut c, "", &[]).await;
    let mut evictions_m1 = subscribe(&mut c, m1, &[Type::PrefixEvicted]).await;

    // The cap: a third subscriber is refused at once.
    let mut third = subscribe(&mut c, "", &[]).await;
    let refused = next(&mut third).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);

    let mut u0 = legacy_update("r0", "t", m0, "vllm", b"a", 16);
    u0.prefixes.push(pb::PrefixEntry {
        prefix_hash: b"b".to_vec(),
        token_count: 32,
        adapter_id: "lora".into(),
        ..Default::default()
    });
    u0.stats = stats(0.5, 0.1);
    u0.timestamp_us = 42;
    let u1 = legacy_update("r1", "t", m1, "vllm", b"c", 16);
    assert!(report(&mut c, vec![u0, u1]).await.accepted);
    publish_event(
        &mut c,
        cache_event(Type::PrefixEvicted, "t", m1, "r1", b"c", ""),
    )
    .await;
    publish_event(
        &mut c,
        cache_event(Type::AllCleared, "t", m0, "r0", b"", ""),
    )
    .await;

    let want = [
        (
            Type::PrefixAdded as i32,
            m0.clone(),
            "r0".to_string(),
            b"a".to_vec(),
        ),
        (
            Type::PrefixAdded as i32,
            m0.clone(),
            "r0".to_string(),
            b"b".to_vec(),
        ),
        (
            Type::ReplicaUpdated as i32,
            m0.clone(),
            "r0".to_string(),
            vec![],
        ),
        (
            Type::PrefixAdded as i32,
            m1.clone(),
            "r1".to_string(),
            b"c".to_vec(),
        ),
        (
            Type::PrefixEvicted as i32,
            m1.clone(),
            "r1".to_string(),
            b"c".to_vec(),
        ),
        (
            Type::AllCleared as i32,
            m0.clone(),
            "r0".to_string(),
            vec![],
        ),
    ];
    let mut got = Vec::new();
    for _ in 0..want.len() {
        got.push(next(&mut all).await.unwrap().expect("an event"));
    }
    assert_eq!(got.iter().map(key).collect::<Vec<_>>(), want);
    assert_eq!(got[0].timestamp_us, 42, "the producer's timestamp");
    assert_eq!(got[1].adapter_id, "lora");
    assert!(
        got[3].timestamp_us > 1_000_000_000_000_000,
        "now when the producer sent none"
    );
    assert!(got.iter().all(|e| e.tenant_id == "t"));

    let e = next(&mut evictions_m1)
        .await
        .unwrap()
        .expect("the eviction");
    assert_eq!(key(&e), want[4]);
    // Nothing else matches its filter.
    let quiet = tokio::time::timeout(Duration::from_millis(300), evictions_m1.message()).await;
    assert!(quiet.is_err(), "only PREFIX_EVICTED of {m1}: {quiet:?}");

    // Closing a subscription frees its slot.
    drop(evictions_m1);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut s = subscribe(&mut c, "", &[]).await;
        let probe = tokio::time::timeout(Duration::from_millis(200), s.message()).await;
        match probe {
            Err(_) => break, // open and waiting: accepted
            Ok(r) => assert!(Instant::now() < deadline, "slot never freed: {r:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // At least the refusal above (the slot-freeing loop may have been refused too).
    let text = metrics_text(&srv);
    let hits = metric_value(
        &text,
        r#"inferencecache_limit_hits_total{limit="event_subscribers"}"#,
    );
    assert!(hits.is_some_and(|n| n >= 1.0), "{hits:?}");
}
shards_1_and_2!(stream_cache_events_from_every_core);

/// A subscriber that does not read falls behind: ingest is never slowed, the subscriber gets
/// what was queued and then RESOURCE_EXHAUSTED with the number of changes it missed.
async fn stream_cache_events_lagging_subscriber(shards: usize) {
    let srv = Server::start(shards, &["--max-event-subscribers", "4"]);
    let mut c = srv.client().await;
    let mut slow = subscribe(&mut c, "", &[]).await;
    let n = 6000;
    let u = many_prefixes(n);
    let started = Instant::now();
    assert!(report(&mut c, vec![u.clone()]).await.accepted);
    assert!(report(&mut c, vec![u]).await.accepted);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "ingest is not slowed"
    );
    let mut received = 0;
    let status = loop {
        match next(&mut slow).await {
            Ok(Some(_)) => received += 1,
            Ok(None) => panic!("a lagging subscriber is told so"),
            Err(st) => break st,
        }
    };
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert!(status.message().contains("fell behind"), "{status:?}");
    assert!((1..=4096).contains(&received), "{received}");
    assert_eq!(next(&mut slow).await.unwrap(), None);
    let text = metrics_text(&srv);
    assert_metric_line(
        &text,
        r#"inferencecache_limit_hits_total{limit="event_subscriber_buffer"} 1"#,
    );
    assert_metric_line(
        &text,
        r#"inferencecache_rpc_calls_total{reason_code="LAGGED",rpc="StreamCacheEvents"} 1"#,
    );

    // An open subscription ends with the server's shutdown instead of holding the drain.
    let mut srv = srv;
    let mut open = subscribe(&mut c, "", &[]).await;
    let started = Instant::now();
    assert!(srv.terminate().success());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let end = tokio::time::timeout(Duration::from_secs(5), open.message()).await;
    assert!(matches!(end, Ok(Ok(None)) | Ok(Err(_))), "{end:?}");
}
shards_1_and_2!(stream_cache_events_lagging_subscriber);

/// The requested series from the /metrics registry, every second; the cap and the name bound;
/// without the flags both streams close at once (the reference's stub).
async fn stream_metrics_sends_the_requested_series(shards: usize) {
    let srv = Server::start(shards, &["--max-metric-subscribers", "1"]);
    let mut c = srv.client().await;
    let names = vec![
        "inferencecache_server_up".to_string(),
        "inferencecache_core_requests_total".to_string(),
    ];
    let mut s = c
        .stream_metrics(pb::StreamMetricsRequest {
            names: names.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut stamps = std::collections::BTreeSet::new();
    let mut up_seen = false;
    while stamps.len() < 2 {
        let m = next(&mut s).await.unwrap().expect("a series");
        assert!(names.contains(&m.name), "{m:?}");
        if m.name == "inferencecache_server_up" {
            assert_eq!((m.value, m.r#type.as_str()), (1.0, "gauge"));
            up_seen = true;
            stamps.insert(m.timestamp_us);
        }
    }
    assert!(up_seen);
    let stamps: Vec<i64> = stamps.into_iter().collect();
    assert!(
        stamps[1] - stamps[0] >= 900_000,
        "one interval apart: {stamps:?}"
    );

    // The cap, and the bound on names.
    let mut c2 = srv.client().await;
    let mut refused = c2
        .stream_metrics(pb::StreamMetricsRequest { names: vec![] })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        next(&mut refused).await.unwrap_err().code(),
        tonic::Code::ResourceExhausted
    );
    let many: Vec<String> = (0..65).map(|i| format!("n{i}")).collect();
    let mut bad = c2
        .stream_metrics(pb::StreamMetricsRequest { names: many })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        next(&mut bad).await.unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
    let text = metrics_text(&srv);
    assert_metric_line(
        &text,
        r#"inferencecache_limit_hits_total{limit="metric_subscribers"} 1"#,
    );
    assert_metric_line(
        &text,
        r#"inferencecache_limit_hits_total{limit="metric_stream_names"} 1"#,
    );

    // Unconfigured: the reference's stub.
    let plain = Server::start(shards, &[]);
    let mut c = plain.client().await;
    let mut s = c
        .stream_metrics(pb::StreamMetricsRequest { names })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(next(&mut s).await.unwrap(), None);
    let mut e = subscribe(&mut c, "", &[]).await;
    assert_eq!(next(&mut e).await.unwrap(), None);
}
shards_1_and_2!(stream_metrics_sends_the_requested_series);

/// Reads events until `n` arrived (each within 10 s).
async fn take_events(s: &mut Streaming<pb::CacheEvent>, n: usize) -> Vec<pb::CacheEvent> {
    let mut got = Vec::with_capacity(n);
    while got.len() < n {
        got.push(next(s).await.unwrap().expect("an event"));
    }
    got
}

/// Nothing more arrives on `s` for a while.
async fn assert_quiet(s: &mut Streaming<pb::CacheEvent>, what: &str) {
    let quiet = tokio::time::timeout(Duration::from_millis(400), s.message()).await;
    assert!(quiet.is_err(), "{what}: {quiet:?}");
}

/// The TTL sweep's removals reach subscribers as PREFIX_EVICTED (one per removed entry, from
/// the core that swept it, with the entry's names, hash and adapter and the server's clock),
/// through the model/tenant/type filters; entries of other tenants stay and are not published.
async fn stream_cache_events_publishes_ttl_sweep_removals(shards: usize) {
    let srv = Server::start(
        shards,
        &["--max-event-subscribers", "3", "--sweep-interval-ms", "50"],
    );
    // team-t's entries expire after 300 ms; tenant "keep" has the 30 min default.
    let policy = r#"{"version":7,"policies":[{"namespace":"team-t","evictionTTL":300000000}]}"#;
    install_policy(&srv, policy);
    let mut c = srv.client().await;
    let models = models_per_core("team-t", shards.max(2));
    let (m0, m1) = (&models[0], &models[1]);
    let mut all = subscribe(&mut c, "", &[]).await;
    let mut evicted_m1 = subscribe(&mut c, m1, &[Type::PrefixEvicted]).await;
    let mut added_only = subscribe(&mut c, "", &[Type::PrefixAdded]).await;

    let mut u1 = legacy_update("r1", "team-t", m1, "vllm", b"b", 16);
    u1.prefixes[0].adapter_id = "lora".into();
    let updates = vec![
        legacy_update("r0", "team-t", m0, "vllm", b"a", 16),
        u1,
        legacy_update("rk", "keep", m0, "vllm", b"k", 16),
    ];
    let before = now_us();
    assert!(report(&mut c, updates).await.accepted);

    let added = take_events(&mut all, 3).await;
    assert!(added.iter().all(|e| e.r#type == Type::PrefixAdded as i32));
    let mut evicted = take_events(&mut all, 2).await;
    evicted.sort_by(|a, b| a.model_id.cmp(&b.model_id));
    let mut want = vec![
        (
            Type::PrefixEvicted as i32,
            m0.clone(),
            "r0".to_string(),
            b"a".to_vec(),
        ),
        (
            Type::PrefixEvicted as i32,
            m1.clone(),
            "r1".to_string(),
            b"b".to_vec(),
        ),
    ];
    want.sort_by(|a, b| a.1.cmp(&b.1));
    assert_eq!(evicted.iter().map(key).collect::<Vec<_>>(), want);
    for e in &evicted {
        assert_eq!(e.tenant_id, "team-t");
        assert_eq!(e.adapter_id, if e.model_id == *m1 { "lora" } else { "" });
        assert!(
            e.timestamp_us >= before + 300_000,
            "the server's clock of the sweep, at least one TTL after ingest: {e:?}"
        );
    }
    assert_quiet(&mut all, "the other tenant's entry is not swept").await;

    let e = next(&mut evicted_m1).await.unwrap().expect("m1's eviction");
    assert_eq!(
        key(&e),
        (
            Type::PrefixEvicted as i32,
            m1.clone(),
            "r1".into(),
            b"b".to_vec()
        )
    );
    assert_eq!(e.adapter_id, "lora");
    assert_quiet(&mut evicted_m1, "only m1's evictions").await;

    assert_eq!(take_events(&mut added_only, 3).await.len(), 3);
    assert_quiet(
        &mut added_only,
        "a PREFIX_ADDED-only subscriber sees no eviction",
    )
    .await;

    let text = metrics_text(&srv);
    assert_metric_line(
        &text,
        r#"inferencecache_index_evictions_total{algorithm="lru",reason="ttl"} 2"#,
    );
}
shards_1_and_2!(stream_cache_events_publishes_ttl_sweep_removals);

/// The global cap's and a tenant quota's evictions reach subscribers as PREFIX_EVICTED right
/// after the ingest that caused them — after its PREFIX_ADDED, even when the new entry is itself
/// the victim — in the victim order.
async fn stream_cache_events_publishes_cap_and_quota_evictions(shards: usize) {
    // The cap: 2 entries. One model, so every entry is on the ingesting core.
    let srv = Server::start(
        shards,
        &["--max-event-subscribers", "2", "--index-max-entries", "2"],
    );
    let mut c = srv.client().await;
    let mut all = subscribe(&mut c, "", &[]).await;
    let mut evictions = subscribe(&mut c, "m", &[Type::PrefixEvicted]).await;
    let t0 = now_us();
    let at = |hash: &[u8], ts: i64| {
        let mut u = legacy_update("r", "t", "m", "vllm", hash, 16);
        u.timestamp_us = ts;
        u
    };
    assert!(
        report(&mut c, vec![at(b"a", t0), at(b"b", t0 + 1)])
            .await
            .accepted
    );
    assert!(report(&mut c, vec![at(b"c", t0 + 2)]).await.accepted);
    // Older than everything held: the new entry is the cap's victim itself.
    assert!(
        report(&mut c, vec![at(b"old", t0 - 1_000_000)])
            .await
            .accepted
    );
    let (added, evicted) = (Type::PrefixAdded as i32, Type::PrefixEvicted as i32);
    let got: Vec<(i32, Vec<u8>)> = take_events(&mut all, 6)
        .await
        .iter()
        .map(|e| (e.r#type, e.prefix_hash.clone()))
        .collect();
    let want: Vec<(i32, Vec<u8>)> = vec![
        (added, b"a".to_vec()),
        (added, b"b".to_vec()),
        (added, b"c".to_vec()),
        (evicted, b"a".to_vec()),
        (added, b"old".to_vec()),
        (evicted, b"old".to_vec()),
    ];
    assert_eq!(got, want);
    assert_quiet(&mut all, "nothing else changed").await;
    let e = take_events(&mut evictions, 2).await;
    assert_eq!(key(&e[0]), (evicted, "m".into(), "r".into(), b"a".to_vec()));
    assert_eq!(e[0].tenant_id, "t");
    assert!(e[0].timestamp_us >= t0, "the server's clock: {:?}", e[0]);
    assert_eq!(e[1].prefix_hash, b"old");
    assert_quiet(&mut evictions, "two cap evictions").await;
    assert_metric_line(
        &metrics_text(&srv),
        r#"inferencecache_index_evictions_total{algorithm="lru",reason="cap"} 2"#,
    );
    drop(srv);

    // A quota of one key: every holder of the evicted key is published.
    let srv = Server::start(shards, &["--max-event-subscribers", "1"]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[],"tenants":[{"tenantID":"q","maxIndexEntries":1}]}"#,
    );
    let mut c = srv.client().await;
    let mut s = subscribe(&mut c, "", &[Type::PrefixEvicted]).await;
    let mut x2 = legacy_update("r2", "q", "m", "vllm", b"x", 16);
    x2.timestamp_us = t0;
    let mut x1 = x2.clone();
    x1.replica_id = "r1".into();
    let mut y = legacy_update("r1", "q", "m", "vllm", b"y", 16);
    y.timestamp_us = t0 + 1;
    assert!(report(&mut c, vec![x1, x2, y]).await.accepted);
    let mut got: Vec<(String, Vec<u8>)> = take_events(&mut s, 2)
        .await
        .iter()
        .map(|e| {
            assert_eq!((e.r#type, e.tenant_id.as_str()), (evicted, "q"));
            (e.replica_id.clone(), e.prefix_hash.clone())
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![("r1".into(), b"x".to_vec()), ("r2".into(), b"x".to_vec())]
    );
    assert_quiet(&mut s, "one key evicted").await;
}
shards_1_and_2!(stream_cache_events_publishes_cap_and_quota_evictions);

/// A StreamMetrics subscriber that never reads (a raw HTTP/2 call whose window is never
/// released) is bounded: its series queue fills (8,192), the server stops producing for it
/// (`limit_hits{limit="metric_subscriber_buffer"}`) and, when it finally reads, it gets what was
/// queued and then RESOURCE_EXHAUSTED "fell behind". Meanwhile /healthz, LookupRoute and a
/// second subscriber on another connection are served as usual.
async fn stream_metrics_slow_subscriber_is_cut_off_alone(shards: usize) {
    use prost::Message as _;
    const BUFFER: usize = 8192; // METRIC_STREAM_BUFFER
    const PER_INTERVAL: usize = 4096; // MAX_METRIC_STREAM_SERIES
    let srv = Server::start(shards, &["--max-metric-subscribers", "2"]);
    let mut c = srv.client().await;
    // Many series per scrape: each model's LookupRoute latency histogram and calls counter.
    for i in 0..400 {
        lookup(
            &mut c,
            exact_lookup("t", &format!("m{i}"), "vllm", b"p", 16),
        )
        .await;
    }
    let series = metrics_text(&srv)
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .count();
    assert!(series > PER_INTERVAL, "{series} series per scrape");

    let mut conn = raw_connection(srv.grpc_port).await;
    let mut call = raw_call(
        &mut conn,
        "/inferencecache.v1alpha1.InferenceCache/StreamMetrics",
    )
    .await;
    // An empty StreamMetricsRequest: every series.
    call.send(grpc_message(&[])).await.expect("request");
    let slow = call.open(true).await.expect("response head");
    assert_eq!(slow.headers.get("grpc-status"), None, "subscribed");

    let mut normal = srv
        .client()
        .await
        .stream_metrics(pb::StreamMetricsRequest {
            names: vec!["inferencecache_server_up".into()],
        })
        .await
        .expect("second subscriber")
        .into_inner();
    let hit = r#"inferencecache_limit_hits_total{limit="metric_subscriber_buffer"}"#;
    let started = Instant::now();
    let mut ticks = 0;
    loop {
        let m = next(&mut normal).await.unwrap().expect("a tick");
        assert_eq!(m.name, "inferencecache_server_up");
        ticks += 1;
        let t = Instant::now();
        let (code, _) = http_get(srv.http_port, "/healthz").expect("/healthz");
        assert_eq!(code, 200);
        lookup(&mut c, exact_lookup("t", "m0", "vllm", b"p", 16)).await;
        // Generous for a loaded debug build; a server stalled by the slow subscriber never
        // answers.
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "served promptly: {:?}",
            t.elapsed()
        );
        if metric_value(&metrics_text(&srv), hit) == Some(1.0) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the slow subscriber was never cut off"
        );
    }
    // The second subscriber keeps getting its ticks once a second after the cut-off.
    let cut_off = Instant::now();
    for _ in 0..2 {
        next(&mut normal)
            .await
            .unwrap()
            .expect("a tick after the cut-off");
        ticks += 1;
    }
    assert!(cut_off.elapsed() < Duration::from_secs(10), "{ticks} ticks");
    // Nothing more is produced for the slow one: the bound was hit once.
    assert_eq!(metric_value(&metrics_text(&srv), hit), Some(1.0));

    // Reading at last: the queued series, then the final status.
    let end = tokio::time::timeout(Duration::from_secs(30), slow.read_to_end())
        .await
        .expect("the slow subscriber's stream ends")
        .expect("read");
    assert_eq!(end.grpc_status.as_deref(), Some("8"), "{end:?}");
    let message = end.grpc_message.clone().unwrap_or_default();
    assert!(
        message.contains("fell") && message.contains("behind"),
        "{message}"
    );
    let messages = grpc_messages(&end.body);
    assert!(
        (BUFFER..=BUFFER + 2 * PER_INTERVAL).contains(&messages.len()),
        "the queued series and no more: {}",
        messages.len()
    );
    let first = pb::Metric::decode(messages[0]).expect("a Metric");
    assert!(!first.name.is_empty());
    assert_metric_line(
        &metrics_text(&srv),
        r#"inferencecache_rpc_calls_total{reason_code="LAGGED",rpc="StreamMetrics"} 1"#,
    );
}
shards_1_and_2!(stream_metrics_slow_subscriber_is_cut_off_alone);

/// One ingest whose cap evictions are more than one burst holds (4,096): the held ones are
/// published, the rest dropped, and a subscriber that wants evictions is told it fell behind
/// (`limit="event_removal_burst"`), not left with a silent gap.
async fn stream_cache_events_removal_burst_is_bounded(shards: usize) {
    const BURST: usize = 4096; // EVENT_REMOVAL_BURST
    let srv = Server::start(
        shards,
        &["--max-event-subscribers", "1", "--index-max-entries", "1"],
    );
    let mut c = srv.client().await;
    let mut s = subscribe(&mut c, "", &[Type::PrefixEvicted]).await;
    let n = BURST + 904; // 904 + 4096 entries, the cap keeps one
    let u = many_prefixes(n);
    assert!(report(&mut c, vec![u]).await.accepted);
    let mut received = 0;
    let status = loop {
        match next(&mut s).await {
            Ok(Some(e)) => {
                assert_eq!(e.r#type, Type::PrefixEvicted as i32);
                received += 1;
            }
            Ok(None) => panic!("a subscriber that missed evictions is told so"),
            Err(st) => break st,
        }
    };
    assert_eq!(received, BURST, "the burst's held evictions");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert!(
        status.message().contains("903 changes dropped"),
        "{status:?}"
    );
    let text = metrics_text(&srv);
    assert_metric_line(
        &text,
        r#"inferencecache_limit_hits_total{limit="event_removal_burst"} 1"#,
    );
    assert_metric_line(
        &text,
        r#"inferencecache_index_evictions_total{algorithm="lru",reason="cap"} 4999"#,
    );
    assert_eq!(
        metric_value(
            &text,
            r#"inferencecache_limit_hits_total{limit="event_subscriber_buffer"}"#
        ),
        None,
        "the subscriber's own queue never overflowed"
    );
}
shards_1_and_2!(stream_cache_events_removal_burst_is_bounded);
