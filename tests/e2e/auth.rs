//! End-to-end checks of controller-facing authentication (docs/BEHAVIOUR.md §13.2, C147) against a
//! stand-in Kubernetes TokenReview API served over HTTPS inside the test, plus the static
//! token-file mode and the start-up failures. Every server runs with `--shards 1` and `2`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;
use serde_json::{Value, json};

const SA: &str = "system:serviceaccount:inference-cache-system:inference-cache-controller-manager";
const CTRL_AUD: &str = "inferencecache.io/controller";
const POLICY_AUD: &str = "inferencecache.io/policy";
const PROBE: &str = r#"{"backend":"b","model":"m","hashScheme":"vllm"}"#;
const POLICY: &str = r#"{"version":7,"policies":[{"namespace":"team-a"}]}"#;

fn req(port: u16, method: &str, path: &str, token: Option<&str>, body: &str) -> HttpResponse {
    let bearer = token.map(|t| format!("Bearer {t}"));
    let mut headers = vec![("Content-Type", "application/json")];
    if let Some(b) = &bearer {
        headers.push(("Authorization", b.as_str()));
    }
    http_full(port, method, path, &headers, body.as_bytes()).unwrap()
}

fn snapshot(p: u16, t: Option<&str>) -> HttpResponse {
    req(p, "GET", "/snapshot", t, "")
}
fn policy(p: u16, t: Option<&str>) -> HttpResponse {
    req(p, "POST", "/policy", t, POLICY)
}
fn probe(p: u16, t: Option<&str>) -> HttpResponse {
    req(p, "POST", "/probe", t, PROBE)
}

fn counter(text: &str, endpoint: &str, result: &str) -> f64 {
    metric_value(
        text,
        &format!("inferencecache_{endpoint}_auth_total{{result=\"{result}\"}}"),
    )
    .unwrap_or(0.0)
}

fn tokenreview_server(shards: usize, name: &str) -> (ScratchDir, Server, Arc<StandIn>) {
    let dir = scratch_dir(name);
    let state = Arc::new(StandIn::default());
    state.add("ctrl-token", SA, &[CTRL_AUD]);
    state.add("policy-token", SA, &[POLICY_AUD]);
    state.add(
        "other-sa-policy-token",
        "system:serviceaccount:x:intruder",
        &[POLICY_AUD],
    );
    let (port, ca) = start_stand_in(state.clone(), &dir);
    let sa_token = dir.join("sa-token");
    std::fs::write(&sa_token, format!("{SA_TOKEN}\n")).unwrap();
    let url = format!("https://127.0.0.1:{port}");
    let log = dir.join("server.log");
    let srv = Server::start_opts(
        shards,
        StartOpts {
            flags: &[
                "--allowed-controller-sa",
                SA,
                "--kube-api-server",
                &url,
                "--kube-ca-file",
                &ca,
                "--kube-token-file",
                sa_token.to_str().unwrap(),
            ],
            no_insecure: true,
            stderr_file: Some(log),
            log_level: Some("info"),
            ..Default::default()
        },
    );
    (dir, srv, state)
}

fn c147_tokenreview(shards: usize) {
    let (dir, srv, state) = tokenreview_server(shards, &format!("auth-tr-{shards}"));
    let p = srv.admin_port;

    // Without a bearer token: 401 everywhere, and no review is made.
    for r in [snapshot(p, None), policy(p, None), probe(p, None)] {
        assert_eq!((r.status, r.body.as_str()), (401, "unauthorized\n"));
    }
    assert_eq!(state.reviews.load(Ordering::SeqCst), 0);
    // With the right audience tokens: served.
    let r = snapshot(p, Some("ctrl-token"));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        *state.last_audiences.lock().unwrap(),
        Some(json!([CTRL_AUD]))
    );
    let r = policy(p, Some("policy-token"));
    assert_eq!(r.status, 204, "{}", r.body);
    assert_eq!(
        *state.last_audiences.lock().unwrap(),
        Some(json!([POLICY_AUD]))
    );
    let r = probe(p, Some("ctrl-token"));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("\"routing\":\"ok\""));
    let text = metrics_text(&srv);
    for ep in ["snapshot", "policy", "probe"] {
        assert_eq!(counter(&text, ep, "unauth"), 1.0, "{ep}\n{text}");
        assert_eq!(counter(&text, ep, "ok"), 1.0, "{ep}");
    }
    assert!(text.contains("inferencecache_snapshot_auth_total{result=\"ok\"} 1\n"));

    // Another service account: 403.
    let r = policy(p, Some("other-sa-policy-token"));
    assert_eq!((r.status, r.body.as_str()), (403, "forbidden\n"));
    assert_eq!(counter(&metrics_text(&srv), "policy", "forbidden"), 1.0);

    // Audience mismatch: the controller-audience token is refused on /policy.
    let r = policy(p, Some("ctrl-token"));
    assert_eq!((r.status, r.body.as_str()), (401, "unauthorized\n"));
    // Malformed headers.
    for h in ["Basic ctrl-token", "Bearer", "Bearer   ", "ctrl-token"] {
        let r = http_full(p, "GET", "/snapshot", &[("Authorization", h)], b"").unwrap();
        assert_eq!(r.status, 401, "{h}");
    }
    // Scheme is case-insensitive and the token trimmed.
    let r = http_full(
        p,
        "GET",
        "/snapshot",
        &[("Authorization", "bEaReR  ctrl-token ")],
        b"",
    )
    .unwrap();
    assert_eq!(r.status, 200);

    // Successful reviews are cached per endpoint for 30 s.
    let before = state.reviews.load(Ordering::SeqCst);
    for _ in 0..3 {
        assert_eq!(snapshot(p, Some("ctrl-token")).status, 200);
        assert_eq!(probe(p, Some("ctrl-token")).status, 200);
    }
    assert_eq!(state.reviews.load(Ordering::SeqCst), before);
    // Unknown token: reviewed once, then remembered as denied for a few seconds (this
    // server's negative cache; the reference reviews it every time).
    assert_eq!(snapshot(p, Some("nope")).status, 401);
    assert_eq!(snapshot(p, Some("nope")).status, 401);
    assert_eq!(state.reviews.load(Ordering::SeqCst), before + 1);
    // Concurrent requests with one new token share one review (single flight).
    let parallel: Vec<_> = (0..6)
        .map(|_| std::thread::spawn(move || snapshot(p, Some("nope-2")).status))
        .collect();
    for t in parallel {
        assert_eq!(t.join().unwrap(), 401);
    }
    assert_eq!(state.reviews.load(Ordering::SeqCst), before + 2);

    // API server failing: 503, result "error"; a cached token still works.
    state.fail.store(true, Ordering::SeqCst);
    state.add("fresh-token", SA, &[CTRL_AUD]);
    let r = snapshot(p, Some("fresh-token"));
    assert_eq!(
        (r.status, r.body.as_str()),
        (503, "token review unavailable\n")
    );
    assert_eq!(snapshot(p, Some("ctrl-token")).status, 200);
    state.fail.store(false, Ordering::SeqCst);
    assert_eq!(snapshot(p, Some("fresh-token")).status, 200);

    // Each request reaching the middleware counted exactly once (404s never reach it).
    assert_eq!(req(p, "GET", "/other", Some("ctrl-token"), "").status, 404);
    let text = metrics_text(&srv);
    let total = |ep: &str| -> f64 {
        ["ok", "unauth", "forbidden", "error"]
            .iter()
            .map(|r| counter(&text, ep, r))
            .sum()
    };
    assert_eq!(counter(&text, "snapshot", "error"), 1.0);
    // snapshot: none, ctrl, 4 malformed, case-insensitive, 3 cached, 2 unknown, 6 concurrent
    // unknown, fresh 503, cached during failure, fresh ok.
    assert_eq!(total("snapshot"), 21.0, "{text}");
    assert_eq!(total("policy"), 4.0);
    assert_eq!(total("probe"), 5.0);
    // The unauthenticated review with an error string is logged as a WARN with `error`.
    let log = std::fs::read_to_string(dir.join("server.log")).unwrap();
    let warn = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["message"] == "auth_token_review_unauthenticated")
        .unwrap_or_else(|| panic!("no auth warning in:\n{log}"));
    assert_eq!(warn["level"], "WARN");
    assert!(
        warn["error"].as_str().unwrap().contains("invalid"),
        "{warn}"
    );
    assert!(!log.contains("ctrl-token"), "tokens are never logged");
    let enabled = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["message"] == "controller_auth_enabled")
        .unwrap();
    assert_eq!(enabled["expected_sa"], SA);
    assert_eq!(enabled["controller_audience"], CTRL_AUD);
    assert_eq!(enabled["policy_audience"], POLICY_AUD);
}

shards_1_and_2!(blocking c147_tokenreview);

fn token_file(shards: usize) {
    let dir = scratch_dir(&format!("auth-file-{shards}"));
    let f = dir.join("controller-token");
    std::fs::write(&f, "s3cr3t-controller-token-0001\n").unwrap();
    let srv = Server::start_opts(
        shards,
        StartOpts {
            flags: &["--controller-token-file", f.to_str().unwrap()],
            no_insecure: true,
            ..Default::default()
        },
    );
    let p = srv.admin_port;
    let good = Some("s3cr3t-controller-token-0001");
    assert_eq!(snapshot(p, None).status, 401);
    assert_eq!(snapshot(p, Some("wrong-token-wrong-token")).status, 401);
    assert_eq!(snapshot(p, good).status, 200);
    assert_eq!(policy(p, good).status, 204);
    assert_eq!(probe(p, good).status, 200);
    assert_eq!(policy(p, Some("s3cr3t-controller-token-000")).status, 401);
    let text = metrics_text(&srv);
    assert_eq!(counter(&text, "snapshot", "unauth"), 2.0);
    assert_eq!(counter(&text, "snapshot", "ok"), 1.0);
    assert_eq!(counter(&text, "policy", "unauth"), 1.0);
    assert_eq!(counter(&text, "probe", "ok"), 1.0);

    // Rotation in place: the new token is accepted, the old one no longer.
    std::fs::write(&f, "rotated-controller-token-0002").unwrap();
    let later = std::time::SystemTime::now() + Duration::from_secs(2);
    std::fs::File::options()
        .write(true)
        .open(&f)
        .unwrap()
        .set_modified(later)
        .unwrap();
    assert_eq!(
        snapshot(p, Some("rotated-controller-token-0002")).status,
        200
    );
    assert_eq!(snapshot(p, good).status, 401);
}

shards_1_and_2!(blocking token_file);

/// Both sources of trust at once: either is accepted.
fn token_file_with_tokenreview(shards: usize) {
    let dir = scratch_dir(&format!("auth-both-{shards}"));
    let state = Arc::new(StandIn::default());
    state.add("ctrl-token", SA, &[CTRL_AUD]);
    let (port, ca) = start_stand_in(state.clone(), &dir);
    let sa_token = dir.join("sa-token");
    std::fs::write(&sa_token, SA_TOKEN).unwrap();
    let f = dir.join("controller-token");
    std::fs::write(&f, "static-controller-token-1234").unwrap();
    let url = format!("https://127.0.0.1:{port}");
    let srv = Server::start_opts(
        shards,
        StartOpts {
            flags: &[
                "--allowed-controller-sa",
                SA,
                "--controller-token-file",
                f.to_str().unwrap(),
                "--kube-api-server",
                &url,
                "--kube-ca-file",
                &ca,
                "--kube-token-file",
                sa_token.to_str().unwrap(),
            ],
            no_insecure: true,
            ..Default::default()
        },
    );
    let p = srv.admin_port;
    assert_eq!(
        snapshot(p, Some("static-controller-token-1234")).status,
        200
    );
    assert_eq!(state.reviews.load(Ordering::SeqCst), 0);
    assert_eq!(snapshot(p, Some("ctrl-token")).status, 200);
    assert_eq!(snapshot(p, Some("bogus")).status, 401);
    assert_eq!(state.reviews.load(Ordering::SeqCst), 2);
}

shards_1_and_2!(blocking token_file_with_tokenreview);

#[test]
fn startup_failures() {
    let dir = scratch_dir("auth-startup");
    // No in-cluster environment and no override: the client cannot be built → exit 1.
    let (code, err) = run_exit(&["--allowed-controller-sa", SA], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("KUBERNETES_SERVICE_HOST"), "{err}");
    // In-cluster environment but no service-account mount here → exit 1.
    let (code, _) = run_exit(
        &["--allowed-controller-sa", SA],
        &[
            ("KUBERNETES_SERVICE_HOST", "127.0.0.1"),
            ("KUBERNETES_SERVICE_PORT", "1"),
            ("INFERENCECACHE_KUBE_TOKEN_FILE", "/nonexistent/token"),
        ],
    );
    assert_eq!(code, 1);
    // Token file problems → exit 1; combined with --insecure-disable-auth → exit 2.
    let (code, err) = run_exit(&["--controller-token-file", "/nonexistent/tok"], &[]);
    assert_eq!(code, 1, "{err}");
    let short = dir.join("short");
    std::fs::write(&short, "abc").unwrap();
    let (code, _) = run_exit(&["--controller-token-file", short.to_str().unwrap()], &[]);
    assert_eq!(code, 1);
    let (code, err) = run_exit(
        &[
            "--controller-token-file",
            short.to_str().unwrap(),
            "--insecure-disable-auth",
        ],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("mutually exclusive"));
    // Nothing configured at all → exit 2 (fail closed).
    let (code, err) = run_exit(&[], &[]);
    assert_eq!(code, 2);
    assert!(err.contains("missing --allowed-controller-sa"));
}

/// TokenReview hardening: a review that does not name the endpoint's audience is not trusted,
/// and at most a bounded number of reviews run at once (the rest answer 503 at once instead of
/// flooding the API server).
fn tokenreview_audiences_and_concurrency(shards: usize) {
    let (_dir, srv, state) = tokenreview_server(shards, &format!("auth-tr-hard-{shards}"));
    let p = srv.admin_port;
    state.omit_audiences.store(true, Ordering::SeqCst);
    let r = snapshot(p, Some("ctrl-token"));
    assert_eq!(
        (r.status, r.body.as_str()),
        (401, "unauthorized\n"),
        "a review without status.audiences was trusted"
    );
    state.omit_audiences.store(false, Ordering::SeqCst);

    state.delay_ms.store(3_000, Ordering::SeqCst);
    let flood: Vec<_> = (0..16)
        .map(|i| std::thread::spawn(move || snapshot(p, Some(&format!("bad-{i}"))).status))
        .collect();
    let statuses: Vec<u16> = flood.into_iter().map(|t| t.join().unwrap()).collect();
    let shed = statuses.iter().filter(|s| **s == 503).count();
    let most = state.max_in_flight.load(Ordering::SeqCst);
    assert!(shed >= 1, "statuses {statuses:?}");
    assert!(most <= 8, "{most} reviews ran at once");
    assert!(
        statuses.iter().all(|s| *s == 401 || *s == 503),
        "{statuses:?}"
    );
}
shards_1_and_2!(blocking tokenreview_audiences_and_concurrency);
