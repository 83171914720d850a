//! End-to-end checks of the HTTP listeners (docs/BEHAVIOUR.md §13–§15) over real sockets against the
//! real binary, with `--shards 1` and `--shards 2`: public endpoints, `/snapshot` (C088),
//! `/policy` (status codes and exact bodies, effect on every core), `/probe` (C148/C149).

use std::time::Duration;

use crate::support::*;
use serde_json::Value;

const EMPTY_SNAPSHOT: &str =
    "{\"replicas\":null,\"tenants\":null,\"totalPrefixes\":0,\"hotPrefixes\":0}\n";

fn get(port: u16, path: &str) -> HttpResponse {
    http_full(port, "GET", path, &[], b"").unwrap()
}

fn public_listener(shards: usize) {
    let srv = Server::start(shards, &[]);
    for method in ["GET", "POST", "HEAD", "DELETE"] {
        let r = http_full(srv.http_port, method, "/healthz", &[], b"").unwrap();
        assert_eq!(r.status, 200, "{method}");
        if method != "HEAD" {
            assert_eq!(r.body, "ok\n");
        }
    }
    let r = get(srv.http_port, "/readyz");
    assert_eq!((r.status, r.body.as_str()), (200, "ok\n"));
    for path in ["/", "/nope", "/snapshot", "/policy", "/probe", "/healthz/x"] {
        assert_eq!(get(srv.http_port, path).status, 404, "{path}");
    }
    // The controller listener serves only its three paths.
    for path in ["/healthz", "/readyz", "/metrics", "/"] {
        assert_eq!(get(srv.admin_port, path).status, 404, "{path}");
    }
    let m = get(srv.http_port, "/metrics");
    assert_eq!(m.status, 200);
    assert!(m.header("content-type").unwrap().starts_with("text/plain"));
    assert!(m.body.contains("inferencecache_server_up 1\n"));
    assert!(
        m.body
            .contains("inferencecache_server_grpc_tls_enabled 0\n")
    );
}

shards_1_and_2!(blocking public_listener);

async fn snapshot(shards: usize) {
    let srv = Server::start(shards, &[]);
    let r = get(srv.admin_port, "/snapshot");
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.body, EMPTY_SNAPSHOT);
    for method in ["POST", "PUT", "DELETE"] {
        let r = http_full(srv.admin_port, method, "/snapshot", &[], b"").unwrap();
        assert_eq!(r.status, 405, "{method}");
        assert_eq!(r.header("allow"), Some("GET"));
    }

    // C088: one update with stats, then the snapshot shows it.
    let mut c = srv.client().await;
    let mut u = legacy_update("replica-a", "tenant-a", "llama-3-8b", "vllm", b"p", 64);
    u.stats = Some(pb::ReplicaStats {
        cache_memory_bytes: 1234,
        hit_rate: 0.75,
        client_version: "lmcache==0.4.2".into(),
        ..Default::default()
    });
    assert!(report(&mut c, vec![u]).await.accepted);
    let r = get(srv.admin_port, "/snapshot");
    assert_eq!(r.status, 200);
    assert!(r.body.ends_with("}\n"));
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["totalPrefixes"], 1);
    assert_eq!(v["hotPrefixes"], 0);
    let reps = v["replicas"].as_array().unwrap();
    assert_eq!(reps.len(), 1);
    assert_eq!(reps[0]["replicaId"], "replica-a");
    assert_eq!(reps[0]["tenant"], "tenant-a");
    assert_eq!(reps[0]["cacheMemoryBytes"], 1234);
    assert_eq!(reps[0]["hitRate"], 0.75);
    assert_eq!(reps[0]["prefixCount"], 1);
    assert_eq!(reps[0]["statsReported"], true);
    assert!(reps[0].get("t2HitTokens").is_none());
    assert!(reps[0].get("clientVersion").is_none());
    let ts = reps[0]["lastEventAt"].as_str().unwrap();
    assert!(ts.ends_with('Z') && ts != "0001-01-01T00:00:00Z", "{ts}");
    let tenants = v["tenants"].as_array().unwrap();
    assert_eq!(tenants.len(), 1);
    assert_eq!(tenants[0]["tenantId"], "tenant-a");
    assert_eq!(tenants[0]["indexEntries"], 1);
    assert_eq!(tenants[0]["hitRateReported"], true);
    assert_eq!(tenants[0]["memoryUsed"], 0);
    // Exact key order of the rows.
    let order = [
        "\"replicaId\"",
        "\"tenant\"",
        "\"cacheMemoryBytes\"",
        "\"hitRate\"",
        "\"pressure\"",
        "\"lastUpdate\"",
        "\"prefixCount\"",
        "\"lastEventAt\"",
        "\"statsReported\"",
        "\"tenants\"",
        "\"tenantId\"",
        "\"indexEntries\"",
        "\"hitRateReported\"",
        "\"memoryUsed\"",
        "\"totalPrefixes\"",
        "\"hotPrefixes\"",
    ];
    let pos: Vec<usize> = order.iter().map(|k| r.body.find(k).unwrap()).collect();
    assert!(pos.windows(2).all(|w| w[0] < w[1]), "{}", r.body);

    // Prefix-only replicas on both cores' partitions are merged (C085 shape, over HTTP).
    let models = models_per_core("tenant-b", shards);
    for (i, m) in models.iter().enumerate() {
        let u = legacy_update(
            "replica-b",
            "tenant-b",
            m,
            "vllm",
            format!("k{i}").as_bytes(),
            16,
        );
        assert!(report(&mut c, vec![u]).await.accepted);
    }
    let v: Value = serde_json::from_str(&get(srv.admin_port, "/snapshot").body).unwrap();
    assert_eq!(v["totalPrefixes"], 1 + shards as u64);
    let rb = v["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["replicaId"] == "replica-b")
        .unwrap()
        .clone();
    assert_eq!(rb["prefixCount"], shards as u64);
    assert_eq!(rb["lastUpdate"], "0001-01-01T00:00:00Z");
    assert!(rb.get("statsReported").is_none());
}

shards_1_and_2!(snapshot);

async fn policy(shards: usize) {
    let srv = Server::start(shards, &[]);
    let p = srv.admin_port;
    // Methods.
    for method in ["GET", "DELETE", "PATCH"] {
        let r = http_full(p, method, "/policy", &[], b"").unwrap();
        assert_eq!(r.status, 405, "{method}");
        assert_eq!(r.header("allow"), Some("POST, PUT"));
        assert_eq!(r.body, "method not allowed\n");
    }
    // C142: v7 accepted with POST and PUT, 204 with an empty body.
    let v7 = r#"{"version":7,"policies":[{"namespace":"team-a","evictionTTL":420000000000,"minimumPrefixTokens":16}]}"#;
    let r = http_post_json(p, "/policy", v7);
    assert_eq!((r.status, r.body.as_str()), (204, ""));
    let r = http_full(p, "PUT", "/policy", &[], v7.as_bytes()).unwrap();
    assert_eq!(r.status, 204);
    // Errors with their exact bodies.
    for (body, want) in [
        (r#"{"version":2}"#, "unsupported policy snapshot version\n"),
        (r#"{"version":8}"#, "unsupported policy snapshot version\n"),
        (
            r#"{"policies":[]}"#,
            "unsupported policy snapshot version\n",
        ),
    ] {
        let r = http_post_json(p, "/policy", body);
        assert_eq!((r.status, r.body.as_str()), (400, want), "{body}");
    }
    for body in [
        "not json",
        r#"{"version":7,"bogus":1}"#,
        r#"{"version":7,"policies":[{"namespace":"a","strategy":{"nope":true}}]}"#,
        r#"{"version":"7"}"#,
        r#"{"version":7.5}"#,
        "",
    ] {
        let r = http_post_json(p, "/policy", body);
        assert_eq!(r.status, 400, "{body}");
        assert!(
            r.body.starts_with("decode policy snapshot: ") && r.body.ends_with('\n'),
            "{body}: {}",
            r.body
        );
    }
    // Over 1 MiB before the value ends.
    let mut big = String::from(r#"{"version":7,"policies":[{"namespace":""#);
    big.push_str(&"x".repeat((1 << 20) + 10));
    big.push_str(r#""}]}"#);
    let r = http_post_json(p, "/policy", &big);
    assert_eq!(
        (r.status, r.body.as_str()),
        (
            400,
            "decode policy snapshot: http: request body too large\n"
        )
    );

    // The installed policy reaches every core: a quota of 1 for team-q on every partition.
    let q = r#"{"version":7,"tenants":[{"tenantID":"team-q","maxIndexEntries":1}]}"#;
    assert_eq!(http_post_json(p, "/policy", q).status, 204);
    let mut c = srv.client().await;
    for m in models_per_core("team-q", shards) {
        for key in ["a", "b", "c"] {
            let u = legacy_update("r1", "team-q", &m, "vllm", key.as_bytes(), 16);
            report(&mut c, vec![u]).await;
        }
    }
    let v: Value = serde_json::from_str(&get(p, "/snapshot").body).unwrap();
    let entries = v["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tenantId"] == "team-q")
        .unwrap()["indexEntries"]
        .as_u64()
        .unwrap();
    assert_eq!(entries, 1, "quota is global across cores");
    let text = metrics_text(&srv);
    let evicted = metric_value(
        &text,
        r#"inferencecache_tenant_evictions_total{reason="over_entries",tenant_id="team-q"}"#,
    )
    .unwrap();
    assert_eq!(evicted as usize, 3 * shards - 1);
}

shards_1_and_2!(policy);

const PROBE: &str =
    r#"{"backend":"cb-happy","model":"llama-3-8b","hashScheme":"vllm","backendType":"LMCache"}"#;
const PROBE_OK: &str =
    "{\"backend\":\"cb-happy\",\"ingest\":\"ok\",\"routing\":\"ok\",\"t2\":\"skipped\"}\n";

fn core_entries(srv: &Server) -> f64 {
    let text = metrics_text(srv);
    (0..srv.shards)
        .map(|c| {
            metric_value(
                &text,
                &format!("inferencecache_core_index_entries{{core=\"{c}\"}}"),
            )
            .unwrap()
        })
        .sum()
}

async fn probe(shards: usize) {
    let srv = Server::start(shards, &[]);
    let p = srv.admin_port;
    for method in ["GET", "PUT", "DELETE"] {
        let r = http_full(p, method, "/probe", &[], b"").unwrap();
        assert_eq!(r.status, 405, "{method}");
        assert_eq!(r.header("allow"), Some("POST"));
    }
    // C149: a happy run, then nothing is left behind.
    let r = http_post_json(p, "/probe", PROBE);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.body, PROBE_OK);
    assert_eq!(core_entries(&srv), 0.0, "probe entries cleaned up");
    assert_eq!(get(p, "/snapshot").body, EMPTY_SNAPSHOT);
    let st = srv
        .client()
        .await
        .get_cache_state(pb::GetCacheStateRequest {
            model_id: "llama-3-8b".into(),
            tenant_id: "inferencecache.io/probe".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(st.replicas.is_empty());

    // 8 concurrent runs for the same backend, plus runs for other models, all pass.
    let mut handles = Vec::new();
    for i in 0..12 {
        let body = if i < 8 {
            PROBE.to_string()
        } else {
            format!(r#"{{"backend":"cb-{i}","model":"model-{i}","hashScheme":"sglang"}}"#)
        };
        handles.push(std::thread::spawn(move || {
            http_post_json(p, "/probe", &body)
        }));
    }
    for (i, h) in handles.into_iter().enumerate() {
        let r = h.join().unwrap();
        assert_eq!(r.status, 200);
        let v: Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["ingest"], "ok", "{i}: {}", r.body);
        assert_eq!(v["routing"], "ok");
        assert_eq!(v["t2"], "skipped");
        assert!(v.get("errors").is_none());
    }
    for _ in 0..3 {
        assert_eq!(http_post_json(p, "/probe", PROBE).body, PROBE_OK);
    }
    assert_eq!(core_entries(&srv), 0.0);

    // A real entry for the same model survives probes; the probe never shows in the snapshot.
    let mut c = srv.client().await;
    report(
        &mut c,
        vec![legacy_update("real", "t", "llama-3-8b", "vllm", b"x", 64)],
    )
    .await;
    assert_eq!(http_post_json(p, "/probe", PROBE).body, PROBE_OK);
    let v: Value = serde_json::from_str(&get(p, "/snapshot").body).unwrap();
    assert_eq!(v["totalPrefixes"], 1);
    assert_eq!(core_entries(&srv), 1.0);

    // Request validation (§15), exact bodies where the contract gives them.
    let missing = "probe request missing required field (backend, model, hashScheme)\n";
    for body in [
        r#"{"model":"m","hashScheme":"vllm"}"#,
        r#"{"backend":"b","hashScheme":"vllm"}"#,
        r#"{"backend":"b","model":"m"}"#,
        r#"{"backend":"","model":"m","hashScheme":"vllm"}"#,
        "{}",
    ] {
        let r = http_post_json(p, "/probe", body);
        assert_eq!((r.status, r.body.as_str()), (400, missing), "{body}");
    }
    for body in [
        "not json",
        "",
        r#"{"backend":"b","model":"m","hashScheme":"v","extra":1}"#,
        r#"{"backend":"b","model":"m","hashScheme":"v"}{}"#,
        r#"{"backend":"b","model":"m","hashScheme":"v"}]"#,
        r#"{"backend":"b","model":"m","hashScheme":"v"} garbage"#,
        r#"{"backend":1,"model":"m","hashScheme":"v"}"#,
    ] {
        let r = http_post_json(p, "/probe", body);
        assert_eq!(r.status, 400, "{body}");
        assert!(
            r.body.starts_with("decode probe request: "),
            "{body}: {}",
            r.body
        );
    }
    let big = format!(
        r#"{{"backend":"{}","model":"m","hashScheme":"v"}}"#,
        "b".repeat(5000)
    );
    let r = http_post_json(p, "/probe", &big);
    assert_eq!(r.status, 400);
    assert!(r.body.contains("too large"), "{}", r.body);
    // Trailing whitespace after the single value is fine.
    let r = http_post_json(p, "/probe", &format!("{PROBE}\n\n"));
    assert_eq!(r.status, 200);
}

shards_1_and_2!(probe);

/// `/readyz` turns 503 once shutdown starts; the server still exits 0.
#[test]
fn readyz_during_shutdown() {
    let mut srv = Server::start(1, &[]);
    assert_eq!(get(srv.http_port, "/readyz").status, 200);
    // Idle connections (one that never sent a request, one kept alive after a request) must
    // not hold the HTTP shutdown for its whole budget.
    let _idle = std::net::TcpStream::connect(("127.0.0.1", srv.http_port)).unwrap();
    let mut kept = std::net::TcpStream::connect(("127.0.0.1", srv.admin_port)).unwrap();
    std::io::Write::write_all(&mut kept, b"GET /snapshot HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut buf = [0u8; 512];
    let _ = std::io::Read::read(&mut kept, &mut buf).unwrap();
    let t0 = std::time::Instant::now();
    sigterm(&srv.child);
    // Either the 503 is observed or the listener is already gone; never a 200 after SIGTERM
    // once a 503 was seen.
    let mut saw_503 = false;
    let _ = wait_until(Duration::from_secs(5), || {
        match http_full(srv.http_port, "GET", "/readyz", &[], b"") {
            Ok(r) if r.status == 503 => {
                assert_eq!(r.body, "not ready\n");
                saw_503 = true;
                false
            }
            Ok(r) => {
                assert!(!saw_503 || r.status != 200);
                false
            }
            Err(_) => true,
        }
    });
    assert!(srv.terminate().success());
    // Not a performance threshold: a server that waited for the idle connections would wait out
    // its whole HTTP shutdown budget (5 s, src/http.rs SHUTDOWN_BUDGET) before exiting, so an
    // exit before the budget could expire shows they were closed instead of waited for.
    const SHUTDOWN_BUDGET: Duration = Duration::from_secs(5);
    assert!(
        t0.elapsed() < SHUTDOWN_BUDGET,
        "shutdown took {:?}: idle connections held it for the whole budget",
        t0.elapsed()
    );
}

/// C149 with the global cap at 1: probe entries never count towards the cap nor evict the one
/// real entry, sequentially and with 16 concurrent probe + real-ingest pairs.
async fn probe_with_cap_1(shards: usize) {
    let srv = Server::start(shards, &["--index-max-entries", "1"]);
    let p = srv.admin_port;
    let mut c = srv.client().await;
    let real = || legacy_update("real", "t", "llama-3-8b", "vllm", b"x", 64);
    report(&mut c, vec![real()]).await;
    for _ in 0..3 {
        assert_eq!(http_post_json(p, "/probe", PROBE).body, PROBE_OK);
    }
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let mut c = c.clone();
        tasks.push(tokio::spawn(async move {
            report(&mut c, vec![real()]).await;
        }));
        tasks.push(tokio::spawn(async move {
            let r = tokio::task::spawn_blocking(move || http_post_json(p, "/probe", PROBE))
                .await
                .unwrap();
            assert_eq!(r.body, PROBE_OK);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let v: Value = serde_json::from_str(&get(p, "/snapshot").body).unwrap();
    assert_eq!(v["totalPrefixes"], 1);
    assert_eq!(v["replicas"][0]["replicaId"], "real");
    assert_eq!(core_entries(&srv), 1.0);
    assert!(!metrics_text(&srv).contains("inferencecache_index_evictions_total"));
}

shards_1_and_2!(probe_with_cap_1);
