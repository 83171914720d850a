//! End-to-end checks of `/metrics` (docs/BEHAVIOUR.md §16) with `--shards 1` and `--shards 2`: the
//! exposition parsed by a real Prometheus text parser, histogram buckets cumulative and agreeing
//! with `_count`/`_sum`, label pairs in name order, lazily created counters (C090), the entries
//! gauge (C089) summed over cores, and the per-core operator series.

use std::collections::HashMap;
use std::time::Duration;

use crate::support::*;
use prometheus_parse::{Scrape, Value};

const BUCKETS: [f64; 11] = [
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    f64::INFINITY,
];

fn parse(text: &str) -> Scrape {
    // Every line is a comment or `name[{labels}] value`: the parser skips what it cannot read,
    // so check the shape first.
    for line in text.lines() {
        if line.starts_with('#') {
            assert!(
                line.starts_with("# HELP ") || line.starts_with("# TYPE "),
                "{line}"
            );
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect(line);
        assert!(
            value == "+Inf" || value == "NaN" || value.parse::<f64>().is_ok(),
            "{line}"
        );
        let name = series.split('{').next().unwrap();
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "{line}"
        );
        if let Some(labels) = series.strip_prefix(name) {
            assert!(labels.is_empty() || (labels.starts_with('{') && labels.ends_with('}')));
        }
    }
    Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).expect("prometheus text")
}

/// Checks every latency histogram; returns model → count.
fn check_histograms(s: &Scrape) -> HashMap<String, f64> {
    let name = "inferencecache_lookup_route_latency_seconds";
    let mut counts = HashMap::new();
    let singles: HashMap<(String, String), f64> = s
        .samples
        .iter()
        .filter_map(|x| {
            let v = match x.value {
                Value::Untyped(v) | Value::Counter(v) | Value::Gauge(v) => v,
                _ => return None,
            };
            Some(((x.metric.clone(), x.labels.get("model")?.to_string()), v))
        })
        .collect();
    for sample in s.samples.iter().filter(|x| x.metric == name) {
        let Value::Histogram(buckets) = &sample.value else {
            panic!("{name} is not a histogram: {sample:?}")
        };
        let model = sample.labels.get("model").unwrap().to_string();
        let bounds: Vec<f64> = buckets.iter().map(|b| b.less_than).collect();
        assert_eq!(bounds, BUCKETS, "bucket bounds of {model}");
        assert!(
            buckets.windows(2).all(|w| w[0].count <= w[1].count),
            "buckets are cumulative: {buckets:?}"
        );
        let count = singles[&(format!("{name}_count"), model.clone())];
        let sum = singles[&(format!("{name}_sum"), model.clone())];
        assert_eq!(buckets.last().unwrap().count, count, "+Inf == _count");
        assert!(sum >= 0.0 && sum <= count * 10.0, "plausible _sum {sum}");
        // _sum is consistent with the buckets: each observation in bucket i is ≤ bound i.
        let mut max_sum = 0.0;
        let mut prev = 0.0;
        for b in buckets.iter().take(10) {
            max_sum += (b.count - prev) * b.less_than;
            prev = b.count;
        }
        if buckets[9].count == count {
            assert!(sum <= max_sum + 1e-9, "sum {sum} vs bucket bound {max_sum}");
        }
        counts.insert(model, count);
    }
    counts
}

fn calls_per_model(s: &Scrape) -> HashMap<String, f64> {
    let mut out = HashMap::new();
    for x in s
        .samples
        .iter()
        .filter(|x| x.metric == "inferencecache_lookup_route_calls_total")
    {
        let Value::Counter(v) = x.value else {
            panic!("calls_total is a counter: {x:?}")
        };
        *out.entry(x.labels.get("model").unwrap().to_string())
            .or_default() += v;
    }
    out
}

async fn histograms_and_lazy_counters(shards: usize) {
    let srv = Server::start(shards, &[]);
    let text = metrics_text(&srv);
    parse(&text);
    for absent in [
        "inferencecache_lookup_route_calls_total",
        "inferencecache_lookup_route_latency_seconds",
        "inferencecache_tenant_evictions_total",
        "inferencecache_index_evictions_total",
        "inferencecache_index_entries",
        "inferencecache_snapshot_auth_total",
        "inferencecache_policy_auth_total",
        "inferencecache_probe_auth_total",
    ] {
        assert!(!text.contains(absent), "{absent} before first use:\n{text}");
    }
    assert_eq!(metric_value(&text, "inferencecache_server_up"), Some(1.0));
    assert_eq!(
        metric_value(&text, "inferencecache_server_grpc_tls_enabled"),
        Some(0.0)
    );

    // Lookups on models owned by every core, over several connections (some hop).
    let models = models_per_core("t", shards);
    let mut n = 0;
    for conn in 0..3 {
        let mut c = srv.client().await;
        for m in &models {
            for i in 0..5 {
                let _ = c
                    .lookup_route(exact_lookup(
                        "t",
                        m,
                        "vllm",
                        format!("{conn}{i}").as_bytes(),
                        64,
                    ))
                    .await
                    .unwrap();
                n += 1;
            }
        }
    }
    // The probe tenant's short-circuit observes latency 0 with (NO_HINT, false).
    let mut c = srv.client().await;
    for _ in 0..2 {
        let _ = c
            .lookup_route(exact_lookup(
                "inferencecache.io/probe",
                "m",
                "vllm",
                b"x",
                1,
            ))
            .await
            .unwrap();
    }

    let text = metrics_text(&srv);
    let s = parse(&text);
    assert!(
        text.contains("inferencecache_lookup_route_calls_total{hint_used=\"false\",model=\"m\",reason_code=\"NO_HINT\"} 2\n"),
        "{text}"
    );
    assert!(text.contains(
        "inferencecache_lookup_route_latency_seconds_bucket{model=\"m\",le=\"0.0001\"} 2\n"
    ));
    assert_eq!(
        metric_value(
            &text,
            "inferencecache_lookup_route_latency_seconds_sum{model=\"m\"}"
        ),
        Some(0.0)
    );
    assert!(text.contains("# TYPE inferencecache_lookup_route_latency_seconds histogram\n"));
    assert!(text.contains("# TYPE inferencecache_lookup_route_calls_total counter\n"));
    let hist = check_histograms(&s);
    let calls = calls_per_model(&s);
    assert_eq!(hist, calls, "one observation per call");
    assert_eq!(hist["m"], 2.0);
    let total: f64 = models.iter().map(|m| hist[m]).sum();
    assert_eq!(total, n as f64);

    // Operator series: every core reports, and requests were counted.
    let mut routed = 0.0;
    for core in 0..shards {
        for path in ["inline", "hopped"] {
            routed += metric_value(
                &text,
                &format!("inferencecache_core_requests_total{{core=\"{core}\",path=\"{path}\"}}"),
            )
            .unwrap();
        }
        assert!(
            metric_value(
                &text,
                &format!("inferencecache_core_mailbox_depth{{core=\"{core}\"}}")
            )
            .is_some()
        );
    }
    assert!(routed > 0.0);
    assert!(metric_value(&text, "process_resident_memory_bytes").unwrap() > 0.0);
    assert!(metric_value(&text, "process_open_fds").unwrap() > 0.0);
}

shards_1_and_2!(histograms_and_lazy_counters);

async fn entries_gauge(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    // C089: one update with "a","b" → gauge m = 2.
    let mut u = legacy_update("r1", "t", "m", "vllm", b"a", 16);
    u.prefixes.push(pb::PrefixEntry {
        prefix_hash: b"b".to_vec(),
        token_count: 32,
        ..Default::default()
    });
    report(&mut c, vec![u]).await;
    let text = metrics_text(&srv);
    assert!(
        text.contains("inferencecache_index_entries{model=\"m\"} 2\n"),
        "{text}"
    );
    // The gauge is per model across tenants on every core: 50 concurrent single-prefix ingests
    // for model "g" from tenants spread over the cores.
    let mut tasks = Vec::new();
    for i in 0..50 {
        let mut c = c.clone();
        tasks.push(tokio::spawn(async move {
            let u = legacy_update("r", &format!("tenant-{i}"), "g", "vllm", b"p", 16);
            report(&mut c, vec![u]).await
        }));
    }
    for t in tasks {
        assert!(t.await.unwrap().accepted);
    }
    let text = metrics_text(&srv);
    assert!(
        text.contains("inferencecache_index_entries{model=\"g\"} 50\n"),
        "{text}"
    );
    // Draining a model leaves its series at 0.
    let ack = c
        .publish_event(pb::CacheEvent {
            r#type: 4,
            replica_id: "r1".into(),
            tenant_id: "t".into(),
            model_id: "m".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(ack.accepted);
    let text = metrics_text(&srv);
    assert!(
        text.contains("inferencecache_index_entries{model=\"m\"} 0\n"),
        "{text}"
    );
    // Ingest counter (operator series).
    assert_eq!(
        metric_value(&text, "inferencecache_ingest_entries_total"),
        Some(52.0)
    );
    parse(&text);
}

shards_1_and_2!(entries_gauge);

/// C090 over the real paths: quota evictions, cap evictions (LFU tenant) and TTL evictions
/// (LRU tenant) appear only after they happen, with label pairs in name order.
async fn eviction_counters(shards: usize) {
    let srv = Server::start(
        shards,
        &["--index-max-entries", "1", "--sweep-interval-ms", "50"],
    );
    let policy = r#"{"version":7,
        "policies":[{"namespace":"team-l","eviction":"lfu"},
                    {"namespace":"team-t","evictionTTL":1000000}],
        "tenants":[{"tenantID":"team-a","maxIndexEntries":0}]}"#;
    assert_eq!(
        http_post_json(srv.admin_port, "/policy", policy).status,
        204
    );
    let mut c = srv.client().await;

    // TTL: team-t's entry expires after 1 ms and the 50 ms sweep removes it (LRU tenant).
    report(
        &mut c,
        vec![legacy_update("r", "team-t", "m", "vllm", b"t", 16)],
    )
    .await;
    let series = "inferencecache_index_evictions_total{algorithm=\"lru\",reason=\"ttl\"} 1\n";
    assert!(
        wait_until(Duration::from_secs(30), || metrics_text(&srv)
            .contains(series)),
        "{}",
        metrics_text(&srv)
    );
    assert!(!metrics_text(&srv).contains("inferencecache_tenant_evictions_total"));

    // Quota 0: all three keys of team-a are evicted at ingest (reserved for nothing).
    let mut u = legacy_update("r", "team-a", "m", "vllm", b"a", 16);
    for k in [b"b", b"c"] {
        u.prefixes.push(pb::PrefixEntry {
            prefix_hash: k.to_vec(),
            token_count: 16,
            ..Default::default()
        });
    }
    report(&mut c, vec![u]).await;
    let text = metrics_text(&srv);
    assert!(
        text.contains(
            "inferencecache_tenant_evictions_total{reason=\"over_entries\",tenant_id=\"team-a\"} 3\n"
        ),
        "{text}"
    );
    assert!(!text.contains("reason=\"cap\""));

    // Cap 1 with an LFU tenant: three entries on one model → two cap evictions.
    for k in [b"x", b"y", b"z"] {
        report(
            &mut c,
            vec![legacy_update("r", "team-l", "m", "vllm", k, 16)],
        )
        .await;
    }
    let text = metrics_text(&srv);
    assert!(
        text.contains("inferencecache_index_evictions_total{algorithm=\"lfu\",reason=\"cap\"} 2\n"),
        "{text}"
    );
    assert!(text.contains(series));
    parse(&text);
}

shards_1_and_2!(eviction_counters);

/// Every TTL sweep slice is timed per core (wall and CPU histograms, `work="sweep"`), and the
/// last pass's start is a recent Unix time: together the window lookups may have queued in.
async fn maintenance_slices_are_timed(shards: usize) {
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let srv = Server::start(shards, &["--sweep-interval-ms", "20"]);
    let count = |text: &str, family: &str, core: usize| {
        metric_value(
            text,
            &format!("{family}_count{{core=\"{core}\",work=\"sweep\"}}"),
        )
        .unwrap_or(0.0)
    };
    let every_core_swept = || {
        let text = metrics_text(&srv);
        (0..shards).all(|core| {
            count(&text, "inferencecache_core_maintenance_slice_seconds", core) >= 2.0
                && count(
                    &text,
                    "inferencecache_core_maintenance_slice_cpu_seconds",
                    core,
                ) >= 2.0
        })
    };
    assert!(
        wait_until(Duration::from_secs(30), every_core_swept),
        "{}",
        metrics_text(&srv)
    );
    let text = metrics_text(&srv);
    parse(&text);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    for core in 0..shards {
        let wall = "inferencecache_core_maintenance_slice_seconds";
        let inf = metric_value(
            &text,
            &format!("{wall}_bucket{{core=\"{core}\",work=\"sweep\",le=\"+Inf\"}}"),
        );
        assert_eq!(inf, Some(count(&text, wall, core)), "+Inf bucket = count");
        let started = metric_value(
            &text,
            &format!("inferencecache_core_sweep_last_started_seconds{{core=\"{core}\"}}"),
        )
        .unwrap();
        assert!(
            before <= started && started <= now,
            "{before} <= {started} <= {now}"
        );
    }
}
shards_1_and_2!(maintenance_slices_are_timed);
