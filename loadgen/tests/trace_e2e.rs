//! End to end: `loadgen run --workload trace:<file>` against the real `inference-cache-server`
//! binary with `--shards 1` and `2`, on fleetsim's small synthetic trace. Every event and lookup
//! must go out and be answered, and every answer must equal the simulator's ground truth.
//!
//! The server binary is the one `INFERENCECACHE_TEST_SERVER_BIN` names, else this build's
//! `inference-cache-server` next to the `loadgen` binary (`cargo build --bin
//! inference-cache-server` puts it there; `cargo test --workspace` builds it).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The server binary under test.
fn server_bin() -> PathBuf {
    if let Ok(p) = std::env::var("INFERENCECACHE_TEST_SERVER_BIN") {
        return PathBuf::from(p);
    }
    let loadgen = PathBuf::from(env!("CARGO_BIN_EXE_loadgen"));
    let bin = loadgen.with_file_name("inference-cache-server");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build --bin inference-cache-server` first, or set INFERENCECACHE_TEST_SERVER_BIN",
        bin.display()
    );
    bin
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The real server on loopback ports, killed on drop.
struct Server {
    child: Child,
    grpc: u16,
    admin: u16,
}

impl Server {
    fn start(shards: usize) -> Server {
        let (grpc, http, admin) = (free_port(), free_port(), free_port());
        let child = Command::new(server_bin())
            .args([
                "--grpc-bind-address",
                &format!("127.0.0.1:{grpc}"),
                "--http-bind-address",
                &format!("127.0.0.1:{http}"),
                "--snapshot-bind-address",
                &format!("127.0.0.1:{admin}"),
                "--shards",
                &shards.to_string(),
                "--insecure-disable-auth",
                "--log-level",
                "warn",
            ])
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn the server");
        let mut s = Server { child, grpc, admin };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !ready(http) {
            if let Some(st) = s.child.try_wait().unwrap() {
                panic!("server exited during start-up: {st}");
            }
            assert!(Instant::now() < deadline, "server did not become ready");
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether `/readyz` on `port` answers 200.
fn ready(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let req = "GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    answer.starts_with("HTTP/1.1 200")
}

/// The synthetic trace in a temporary file.
fn synthetic_trace_file(name: &str, requests: usize) -> PathBuf {
    let path = std::env::temp_dir().join(format!("loadgen-{name}-{}.jsonl", std::process::id()));
    std::fs::write(&path, fleetsim::synth::synthetic_trace(requests, 7)).unwrap();
    path
}

/// Runs the replay against `s` (bounded by the binary's own deadlines and a kill after 120 s).
fn replay(s: &Server, trace: &std::path::Path, extra: &[&str]) -> (Output, serde_json::Value) {
    let workload = format!("trace:{}", trace.display());
    let mut child = Command::new(env!("CARGO_BIN_EXE_loadgen"))
        .args(["--threads", "2", "run", "--workload", &workload])
        .args(["--addr", &format!("http://127.0.0.1:{}", s.grpc)])
        .args(["--policy-addr", &format!("127.0.0.1:{}", s.admin)])
        .args(["--output", "json", "--quiet", "--budget-ms", "5"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn loadgen");
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("loadgen did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON report ({e}): {stdout}\nstderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out, report)
}

fn n(r: &serde_json::Value, field: &str) -> u64 {
    r[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} in {r}"))
}

/// Every event and lookup sent and answered, every answer equal to the ground truth.
fn assert_exact(out: &Output, r: &serde_json::Value) {
    assert!(
        out.status.success(),
        "loadgen failed: {}\n{r:#}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(n(r, "mismatches"), 0, "{r:#}");
    assert!(n(r, "events") > 0 && n(r, "lookups") > 0, "{r:#}");
    assert_eq!(n(r, "events_sent"), n(r, "events"), "{r:#}");
    assert_eq!(n(r, "lookups_sent"), n(r, "lookups"), "{r:#}");
    assert_eq!(n(r, "checked"), n(r, "lookups"), "{r:#}");
    assert_eq!(n(r, "refused_stores"), 0, "{r:#}");
    assert!(r["stopped_early"].is_null(), "{r:#}");
    let lookups = &r["rpcs"]["LookupRoute"];
    assert_eq!(lookups["ok"].as_u64(), Some(n(r, "lookups")), "{r:#}");
    assert_eq!(lookups["errors"].as_u64(), Some(0), "{r:#}");
    assert!(
        r["reason_codes"]["PREFIX_MATCH"].as_u64().unwrap_or(0) > 0,
        "{r:#}"
    );
}

#[test]
fn the_trace_replay_matches_the_ground_truth_on_one_and_two_shards() {
    let trace = synthetic_trace_file("trace-e2e", 300);
    for shards in [1, 2] {
        let s = Server::start(shards);
        // Native blocks; small workers, so blocks are evicted (PublishEvent) and re-stored.
        let (out, r) = replay(&s, &trace, &["--workers", "8", "--worker-blocks", "24"]);
        assert_exact(&out, &r);
        assert!(n(&r, "removed_blocks") > 0, "no evictions exercised: {r:#}");
        assert_eq!(
            r["rpcs"]["PublishEvent"]["ok"].as_u64(),
            Some(n(&r, "removed_blocks")),
            "{r:#}"
        );
        // 16-token blocks, 32 per trace block, on a fresh tenant state (the policy push is
        // repeated; the previous run's blocks are under other hashes).
        let s = Server::start(shards);
        let (out, r) = replay(
            &s,
            &trace,
            &[
                "--workers",
                "8",
                "--worker-blocks",
                "512",
                "--expand",
                "32",
                "--concurrency",
                "16",
            ],
        );
        assert_exact(&out, &r);
        assert!(n(&r, "removed_blocks") > 0, "no evictions exercised: {r:#}");
    }
    let _ = std::fs::remove_file(trace);
}

#[test]
fn without_the_policy_the_servers_floors_show_as_mismatches() {
    // The check is not vacuous: with the default floors (affinity picks when every serving
    // replica holds the same prefix, no replica under 64 matched tokens) some answers carry
    // less than the ground truth, and the run says so and fails.
    let trace = synthetic_trace_file("trace-e2e-nopolicy", 200);
    let s = Server::start(1);
    let (out, r) = replay(
        &s,
        &trace,
        &[
            "--workers",
            "2",
            "--worker-blocks",
            "1024",
            "--expand",
            "32",
            "--no-policy",
        ],
    );
    assert!(!out.status.success(), "{r:#}");
    assert!(n(&r, "mismatches") > 0, "{r:#}");
    assert!(
        !r["first_mismatches"].as_array().unwrap().is_empty(),
        "{r:#}"
    );
    let _ = std::fs::remove_file(trace);
}
