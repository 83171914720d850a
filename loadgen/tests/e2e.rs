//! End-to-end smoke test: the real `loadgen` binary against a tiny in-test InferenceCache server
//! (a test double with a trivial in-memory map, not an implementation of the contract's ranking)
//! on a loopback port, bounded to a few seconds per run.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inferencecache_fingerprint as fingerprint;
use inferencecache_proto::v1alpha1::inference_cache_server::{
    InferenceCache, InferenceCacheServer,
};
use inferencecache_proto::v1alpha1::*;
use tonic::{Request, Response, Status};

/// (tenant, model, scheme, adapter, key) → replicas holding it.
type Key = (String, String, String, String, Vec<u8>);

#[derive(Default)]
struct Double {
    map: Mutex<HashMap<Key, BTreeSet<String>>>,
    updates: AtomicU64,
    evictions: AtomicU64,
    stats: AtomicU64,
    /// LookupPDRoute calls, and the topology refs they named.
    pd_calls: AtomicU64,
    pd_refs: Mutex<BTreeSet<String>>,
}

/// The service handle: shares the state with the test body.
struct Svc(Arc<Double>);

impl std::ops::Deref for Svc {
    type Target = Double;
    fn deref(&self) -> &Double {
        &self.0
    }
}

#[tonic::async_trait]
impl InferenceCache for Svc {
    async fn render_template(
        &self,
        _: Request<RenderTemplateRequest>,
    ) -> Result<Response<RenderTemplateResponse>, Status> {
        Ok(Response::new(RenderTemplateResponse {
            reason_code: "OK".into(),
            ..Default::default()
        }))
    }

    async fn lookup_route(
        &self,
        req: Request<LookupRouteRequest>,
    ) -> Result<Response<LookupRouteResponse>, Status> {
        let r = req.into_inner();
        let (hashes, counts) = if !r.block_hashes.is_empty() {
            (
                r.block_hashes.iter().map(|h| h.to_vec()).collect(),
                r.block_token_counts.clone(),
            )
        } else if !r.token_ids.is_empty() {
            fingerprint::chain(&r.token_ids, 16)
        } else {
            (vec![r.prefix_hash.clone()], vec![r.prefix_token_count])
        };
        let map = self.map.lock().unwrap();
        let mut running: Option<BTreeSet<String>> = None;
        let mut matched = 0;
        for (h, c) in hashes.iter().zip(&counts) {
            let key = (
                r.tenant_id.clone(),
                r.model_id.clone(),
                r.hash_scheme.clone(),
                r.adapter_id.clone(),
                h.clone(),
            );
            let holders = map.get(&key).cloned().unwrap_or_default();
            let next: BTreeSet<String> = match &running {
                None => holders,
                Some(run) => run.intersection(&holders).cloned().collect(),
            };
            if next.is_empty() {
                break;
            }
            matched += c;
            running = Some(next);
        }
        let resp = match running {
            Some(reps) if matched > 0 => LookupRouteResponse {
                replica_scores: vec![ReplicaScore {
                    replica_id: reps.iter().next().unwrap().clone(),
                    score: matched as f32,
                    matched_tokens: matched,
                    estimated_cache_hit_prob: 1.0,
                    tier: CacheTier::T1 as i32,
                }],
                reason_code: "PREFIX_MATCH".into(),
                ..Default::default()
            },
            _ => LookupRouteResponse {
                reason_code: "NO_HINT".into(),
                ..Default::default()
            },
        };
        Ok(Response::new(resp))
    }

    async fn lookup_pd_route(
        &self,
        req: Request<LookupPdRouteRequest>,
    ) -> Result<Response<LookupPdRouteResponse>, Status> {
        let r = req.into_inner();
        self.pd_calls.fetch_add(1, Ordering::Relaxed);
        let exact = !r.prefix_hash.is_empty() && r.prefix_token_count > 0;
        self.pd_refs.lock().unwrap().insert(r.pd_topology_ref);
        Ok(Response::new(LookupPdRouteResponse {
            prefill_replica_id: if exact { "p".into() } else { String::new() },
            decode_replica_id: if exact { "d".into() } else { String::new() },
            transport_hint: String::new(),
            reason_code: if exact { "PREFIX_MATCH" } else { "NO_HINT" }.into(),
        }))
    }

    async fn get_cache_state(
        &self,
        _: Request<GetCacheStateRequest>,
    ) -> Result<Response<GetCacheStateResponse>, Status> {
        Ok(Response::new(GetCacheStateResponse::default()))
    }

    async fn report_cache_state(
        &self,
        req: Request<tonic::Streaming<CacheStateUpdate>>,
    ) -> Result<Response<Ack>, Status> {
        let mut s = req.into_inner();
        while let Some(u) = s.message().await? {
            self.updates.fetch_add(1, Ordering::Relaxed);
            if u.stats.is_some() {
                self.stats.fetch_add(1, Ordering::Relaxed);
            }
            let mut map = self.map.lock().unwrap();
            for p in u.prefixes {
                let adapter = if p.adapter_id.is_empty() {
                    u.adapter_id.clone()
                } else {
                    p.adapter_id
                };
                let key = (
                    u.tenant_id.clone(),
                    u.model_id.clone(),
                    u.hash_scheme.clone(),
                    adapter,
                    p.prefix_hash,
                );
                map.entry(key).or_default().insert(u.replica_id.clone());
            }
        }
        Ok(Response::new(Ack {
            accepted: true,
            reason_code: String::new(),
        }))
    }

    async fn publish_event(&self, req: Request<CacheEvent>) -> Result<Response<Ack>, Status> {
        let e = req.into_inner();
        if e.r#type == cache_event::Type::PrefixEvicted as i32 {
            self.evictions.fetch_add(1, Ordering::Relaxed);
            let mut map = self.map.lock().unwrap();
            for (k, v) in map.iter_mut() {
                if k.0 == e.tenant_id
                    && k.1 == e.model_id
                    && k.4 == e.prefix_hash
                    && (e.adapter_id.is_empty() || k.3 == e.adapter_id)
                {
                    v.remove(&e.replica_id);
                }
            }
        }
        Ok(Response::new(Ack {
            accepted: true,
            reason_code: String::new(),
        }))
    }

    type StreamCacheEventsStream = tokio_stream::Empty<Result<CacheEvent, Status>>;

    async fn stream_cache_events(
        &self,
        _: Request<StreamEventsRequest>,
    ) -> Result<Response<Self::StreamCacheEventsStream>, Status> {
        Ok(Response::new(tokio_stream::empty()))
    }

    type StreamMetricsStream = tokio_stream::Empty<Result<Metric, Status>>;

    async fn stream_metrics(
        &self,
        _: Request<StreamMetricsRequest>,
    ) -> Result<Response<Self::StreamMetricsStream>, Status> {
        Ok(Response::new(tokio_stream::empty()))
    }
}

/// Starts the double on a free loopback port in a background runtime.
fn start_double() -> (SocketAddr, Arc<Double>) {
    let double = Arc::new(Double::default());
    let d = double.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            let incoming = tonic::transport::server::TcpIncoming::from(listener);
            // Bounded: the test process exits after the runs; this also caps it at 2 minutes.
            let serve = tonic::transport::Server::builder()
                .add_service(InferenceCacheServer::new(Svc(d)))
                .serve_with_incoming(incoming);
            let _ = tokio::time::timeout(Duration::from_secs(120), serve).await;
        });
    });
    (rx.recv_timeout(Duration::from_secs(10)).unwrap(), double)
}

/// Runs `loadgen run` with `args` (bounded by a 60 s kill) and returns the JSON report.
fn loadgen(addr: SocketAddr, name: &str, args: &[&str]) -> serde_json::Value {
    loadgen_cmd("run", addr, name, args)
}

/// Runs `loadgen <cmd> --json … args` (bounded by a 60 s kill) and returns the JSON written.
fn loadgen_cmd(cmd: &str, addr: SocketAddr, name: &str, args: &[&str]) -> serde_json::Value {
    let path = std::env::temp_dir().join(format!("loadgen-e2e-{}-{name}.json", std::process::id()));
    let quiet: &[&str] = if cmd == "preload" { &[] } else { &["--quiet"] };
    // LOADGEN_E2E_WRAP="/usr/bin/time -v" (or a profiler command line) wraps the binary, to
    // see loadgen's own cost.
    let mut command = match std::env::var("LOADGEN_E2E_WRAP") {
        Ok(w) if !w.trim().is_empty() => {
            let mut parts = w.split_whitespace();
            let mut c = Command::new(parts.next().unwrap());
            c.args(parts).arg(env!("CARGO_BIN_EXE_loadgen"));
            c
        }
        _ => Command::new(env!("CARGO_BIN_EXE_loadgen")),
    };
    let mut child = command
        .arg(cmd)
        .args(["--addr", &format!("http://{addr}")])
        .args(["--json", path.to_str().unwrap()])
        .args(quiet)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("loadgen {name} did not finish in 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = std::io::read_to_string(child.stdout.take().unwrap()).unwrap();
    assert!(status.success(), "loadgen {name} failed: {status}\n{out}");
    eprintln!("--- loadgen {name} ---\n{out}");
    assert!(!out.is_empty(), "loadgen {name} printed nothing");
    let body = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    serde_json::from_str(&body).unwrap()
}

fn check(r: &serde_json::Value, name: &str) {
    let lk = &r["rpcs"]["LookupRoute"];
    assert!(lk["ok"].as_u64().unwrap() > 0, "{name}: no lookups: {r:#}");
    assert_eq!(lk["errors"], 0, "{name}: lookup errors: {r:#}");
    assert_eq!(
        r["errors_by_code"].as_object().unwrap().len(),
        0,
        "{name}: errors: {r:#}"
    );
    let pm = r["reason_codes"]["PREFIX_MATCH"].as_u64().unwrap_or(0);
    assert!(
        pm > 0,
        "{name}: the double should see prefix matches: {r:#}"
    );
}

#[test]
fn loadgen_runs_against_an_in_test_server() {
    let (addr, double) = start_double();
    let small = [
        "--replicas",
        "4",
        "--tenants",
        "2",
        "--population",
        "64",
        "--mean-tokens",
        "256",
        "--max-tokens",
        "1024",
        "--stats-interval-ms",
        "200",
        "--churn-per-sec",
        "20",
    ];

    // Open loop, chain lookups, chat; tiny replica capacity forces evictions.
    let mut args = small.to_vec();
    args.extend([
        "--rate",
        "200",
        "--duration",
        "2",
        "--budget-ms",
        "1",
        "--budget-ms",
        "50",
    ]);
    args.extend(["--capacity-blocks", "100"]);
    let r = loadgen(addr, "chat", &args);
    check(&r, "chat");
    assert_eq!(r["mode"], "open-loop");
    assert_eq!(r["budgets"].as_array().unwrap().len(), 2);
    let started = r["lookups_started"].as_u64().unwrap();
    assert!(
        (300..=401).contains(&started),
        "≈400 lookups due in 2 s at 200/s, got {started}"
    );
    let ingest = &r["ingest"];
    assert!(ingest["prefixes_reported"].as_u64().unwrap() > 0);
    assert!(ingest["stats_updates"].as_u64().unwrap() > 0);
    assert!(r["preload"]["prefixes_reported"].as_u64().unwrap() > 0);
    assert!(
        double.evictions.load(Ordering::Relaxed) > 0,
        "capacity 100 blocks should evict"
    );
    assert!(r["rpcs"]["PublishEvent"]["ok"].as_u64().unwrap() > 0);
    assert!(r["rpcs"]["ReportCacheState"]["ok"].as_u64().unwrap() > 0);

    // Closed loop, token_ids lookups, RAG, request-bounded.
    let mut args = small.to_vec();
    args.extend([
        "--workload",
        "rag",
        "--lookup-input",
        "tokens",
        "--concurrency",
        "4",
        "--requests",
        "300",
    ]);
    let r = loadgen(addr, "rag", &args);
    check(&r, "rag");
    assert_eq!(r["mode"], "closed-loop");
    assert_eq!(r["lookups_started"], 300);
    assert_eq!(r["rpcs"]["LookupRoute"]["count"], 300);

    // Diffuse with exact keys.
    let mut args = small.to_vec();
    args.extend([
        "--workload",
        "diffuse",
        "--lookup-input",
        "exact",
        "--rate",
        "300",
        "--requests",
        "300",
    ]);
    let r = loadgen(addr, "diffuse", &args);
    check(&r, "diffuse");
    assert!(double.updates.load(Ordering::Relaxed) > 0);
    assert!(double.stats.load(Ordering::Relaxed) > 0);

    // Prefill/decode routing: the exact key sent as LookupPDRoute against the named topology.
    let mut args = small.to_vec();
    args.extend([
        "--lookup-input",
        "pd",
        "--pd-topology",
        "my-pd",
        "--concurrency",
        "2",
        "--requests",
        "100",
    ]);
    let r = loadgen(addr, "pd", &args);
    check(&r, "pd");
    assert_eq!(r["lookup_input"], "pd");
    assert_eq!(
        r["rpcs"]["LookupRoute"]["count"], 100,
        "the lookup row measures LookupPDRoute"
    );
    assert_eq!(double.pd_calls.load(Ordering::Relaxed), 100);
    assert_eq!(
        *double.pd_refs.lock().unwrap(),
        BTreeSet::from(["my-pd".to_string()])
    );

    // Capacity: every step passes a generous budget, so the search climbs to --max-rate.
    let mut args = small.to_vec();
    args.extend([
        "--p99-budget-ms",
        "2000",
        "--start-rate",
        "50",
        "--max-rate",
        "200",
        "--step-duration",
        "0.5",
    ]);
    let c = loadgen_cmd("capacity", addr, "capacity", &args);
    let rates: Vec<f64> = c["result"]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["rate"].as_f64().unwrap())
        .collect();
    assert_eq!(rates, vec![50.0, 100.0, 200.0], "{c:#}");
    assert_eq!(c["result"]["capacity_rate"], 200.0, "{c:#}");
    assert_eq!(c["step_reports"].as_array().unwrap().len(), 3);

    // Preload only.
    let p = loadgen_cmd(
        "preload",
        addr,
        "preload",
        &[
            "--workload",
            "diffuse",
            "--population",
            "32",
            "--replicas",
            "2",
        ],
    );
    assert!(
        p["preload"]["prefixes_reported"].as_u64().unwrap() > 0,
        "{p:#}"
    );
    assert_eq!(p["preload"]["stream_errors"], 0);
}

/// `--busy-poll` keeps the client's thread polling instead of sleeping until each answer:
/// measured as the voluntary context switches of a one-in-flight run, with and without it.
#[test]
fn busy_poll_keeps_the_client_from_sleeping_between_answers() {
    let (addr, _double) = start_double();
    let sleeping = switches_during_lone_calls(addr, &[]);
    let polling = switches_during_lone_calls(addr, &["--busy-poll"]);
    eprintln!("voluntary switches in 1.5 s: {sleeping} sleeping, {polling} polling");
    assert!(
        sleeping > 300,
        "without --busy-poll each answer should wake the client: {sleeping} switches"
    );
    assert!(
        polling * 10 < sleeping,
        "--busy-poll should not sleep per answer: {polling} against {sleeping} switches"
    );
}

/// Starts a 2 s closed-loop run with one call in flight on one client thread and returns its
/// voluntary context switches after 1.5 s (the run then ends on its own, or is killed).
fn switches_during_lone_calls(addr: SocketAddr, extra: &[&str]) -> u64 {
    let mut child = Command::new(env!("CARGO_BIN_EXE_loadgen"))
        .args(["run", "--addr", &format!("http://{addr}"), "--threads", "1"])
        .args(["--concurrency", "1", "--duration", "2", "--no-preload"])
        .args(["--no-producers", "--quiet", "--population", "64"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    // The 1.5 s window is the behaviour under test: the context switches counted over it.
    std::thread::sleep(Duration::from_millis(1500));
    let switches = voluntary_switches(child.id());
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("loadgen {extra:?} did not finish in 30 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "loadgen {extra:?} failed: {status}");
    switches
}

/// The voluntary context switches of all of `pid`'s threads so far (Linux `/proc`).
fn voluntary_switches(pid: u32) -> u64 {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
    let mut total = 0;
    for task in tasks {
        let status = std::fs::read_to_string(task.unwrap().path().join("status")).unwrap();
        let line = status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .unwrap();
        total += line.trim().parse::<u64>().unwrap();
    }
    total
}

/// Manual check of loadgen's own headroom (run with `--release -- --ignored --nocapture`):
/// a high open-loop rate against the trivial double, 3 s, printing the table.
#[test]
#[ignore = "manual benchmark; timing-dependent"]
fn loadgen_headroom_against_the_double() {
    let (addr, _double) = start_double();
    let rate = std::env::var("LOADGEN_HEADROOM_RATE").unwrap_or_else(|_| "20000".into());
    // Extra flags, e.g. LOADGEN_HEADROOM_ARGS="--no-producers --lookup-input tokens".
    let extra = std::env::var("LOADGEN_HEADROOM_ARGS").unwrap_or_default();
    let r = loadgen(
        addr,
        "headroom",
        &[
            &["--rate", &rate, "--duration", "3", "--connections", "4"][..],
            &["--budget-ms", "1", "--capacity-blocks", "1000000"],
            &extra.split_whitespace().collect::<Vec<_>>(),
        ]
        .concat(),
    );
    assert_eq!(r["rpcs"]["LookupRoute"]["errors"], 0);
}
