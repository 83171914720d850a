//! Test harness: runs the real `inference-cache-server` binary on loopback ports and hands out
//! generated gRPC clients, so end-to-end tests exercise exactly what users deploy.
#![allow(dead_code)]

pub mod tiny_model;

/// Defines `$t1` and `$t2` running the async scenario `$f(shards)` with `--shards 1` and
/// `--shards 2`, so every end-to-end scenario exercises both the inline and the hop path.
/// (Test files declare `#[macro_use] mod common;`.)
#[allow(unused_macros)]
macro_rules! shards_1_and_2 {
    ($f:ident, $t1:ident, $t2:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $t1() {
            $f(1).await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $t2() {
            $f(2).await
        }
    };
}

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub use inferencecache_proto::v1alpha1 as pb;
use pb::inference_cache_client::InferenceCacheClient;
use tonic::transport::Channel;

/// Path of the server binary built by cargo for integration tests.
pub const BIN: &str = env!("CARGO_BIN_EXE_inference-cache-server");

/// An ephemeral loopback port (bound then released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running server process, killed on drop.
pub struct Server {
    pub child: Child,
    pub grpc_port: u16,
    pub http_port: u16,
    pub admin_port: u16,
    pub shards: usize,
}

impl Server {
    /// Starts the server with `--shards N --insecure-disable-auth` plus `extra` flags and waits
    /// until `/readyz` answers 200.
    pub fn start(shards: usize, extra: &[&str]) -> Server {
        let no_insecure = extra.iter().any(|f| f.contains("allowed-controller-sa"));
        Server::start_opts(
            shards,
            StartOpts {
                flags: extra,
                no_insecure,
                ..Default::default()
            },
        )
    }

    /// The gRPC endpoint URL.
    pub fn grpc_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.grpc_port)
    }

    /// A fresh channel (one HTTP/2 connection).
    pub async fn channel(&self) -> Channel {
        Channel::from_shared(self.grpc_url())
            .unwrap()
            .connect()
            .await
            .expect("connect")
    }

    /// A fresh InferenceCache client on its own connection.
    pub async fn client(&self) -> InferenceCacheClient<Channel> {
        InferenceCacheClient::new(self.channel().await)
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "server did not exit after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A minimal HTTP/1.1 request over a raw socket: (status, body).
pub fn http_request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes())?;
    s.write_all(body)?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// GET `path` on `port`.
pub fn http_get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    http_request(port, "GET", path, &[], b"")
}

/// A legacy single-entry update.
pub fn legacy_update(
    replica: &str,
    tenant: &str,
    model: &str,
    scheme: &str,
    hash: &[u8],
    tokens: i32,
) -> pb::CacheStateUpdate {
    pb::CacheStateUpdate {
        replica_id: replica.into(),
        model_id: model.into(),
        tenant_id: tenant.into(),
        hash_scheme: scheme.into(),
        prefixes: vec![pb::PrefixEntry {
            prefix_hash: hash.to_vec(),
            token_count: tokens,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Streams `updates` over one ReportCacheState call and returns the Ack.
pub async fn report(
    client: &mut InferenceCacheClient<Channel>,
    updates: Vec<pb::CacheStateUpdate>,
) -> pb::Ack {
    client
        .report_cache_state(tokio_stream::iter(updates))
        .await
        .expect("ReportCacheState")
        .into_inner()
}

/// A legacy exact lookup request.
pub fn exact_lookup(
    tenant: &str,
    model: &str,
    scheme: &str,
    hash: &[u8],
    tokens: i32,
) -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        model_id: model.into(),
        tenant_id: tenant.into(),
        hash_scheme: scheme.into(),
        prefix_hash: hash.to_vec(),
        prefix_token_count: tokens,
        ..Default::default()
    }
}

/// Model ids whose `(tenant, model)` partitions are owned by each of `cores` cores, using the
/// server's documented partition function (xxh3(model, seed = xxh3(tenant)) mod 256 mod cores).
pub fn models_per_core(tenant: &str, cores: usize) -> Vec<String> {
    use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};
    let mut found: Vec<Option<String>> = vec![None; cores];
    for i in 0..10_000 {
        let m = format!("model-{i}");
        let p = xxh3_64_with_seed(m.as_bytes(), xxh3_64(tenant.as_bytes())) % 256;
        let c = (p as usize) % cores;
        if found[c].is_none() {
            found[c] = Some(m);
        }
        if found.iter().all(|f| f.is_some()) {
            break;
        }
    }
    found.into_iter().map(|f| f.unwrap()).collect()
}

// ---- Operations-surface helpers (HTTP endpoints, auth, TLS) ----

/// Options for [`Server::start_opts`].
#[derive(Default)]
pub struct StartOpts<'a> {
    /// Extra flags.
    pub flags: &'a [&'a str],
    /// Extra environment variables.
    pub env: &'a [(&'a str, &'a str)],
    /// Do not add `--insecure-disable-auth` (the caller configures auth itself).
    pub no_insecure: bool,
    /// Write the server's stderr (its JSON logs) to this file instead of inheriting it.
    pub stderr_file: Option<std::path::PathBuf>,
    /// Log level (default `warn`).
    pub log_level: Option<&'a str>,
}

impl Server {
    /// Like [`Server::start`], with environment, auth and log capture control.
    pub fn start_opts(shards: usize, o: StartOpts<'_>) -> Server {
        // An ephemeral port can be taken by another process between `free_port` and the
        // server's bind; a server that exits during start-up is retried on fresh ports.
        const ATTEMPTS: usize = 4;
        for attempt in 1..=ATTEMPTS {
            match Server::try_start(shards, &o) {
                Ok(s) => return s,
                Err(e) if attempt < ATTEMPTS => eprintln!("server start attempt {attempt}: {e}"),
                Err(e) => panic!("{e}"),
            }
        }
        unreachable!()
    }

    fn try_start(shards: usize, o: &StartOpts<'_>) -> Result<Server, String> {
        let (g, h, a) = (free_port(), free_port(), free_port());
        let mut cmd = Command::new(BIN);
        cmd.args([
            "--grpc-bind-address",
            &format!("127.0.0.1:{g}"),
            "--http-bind-address",
            &format!("127.0.0.1:{h}"),
            "--snapshot-bind-address",
            &format!("127.0.0.1:{a}"),
            "--shards",
            &shards.to_string(),
            "--log-level",
            o.log_level.unwrap_or("warn"),
        ]);
        if !o.no_insecure {
            cmd.arg("--insecure-disable-auth");
        }
        cmd.args(o.flags)
            .envs(o.env.iter().copied())
            .stdout(Stdio::null());
        match &o.stderr_file {
            Some(p) => cmd.stderr(std::fs::File::create(p).expect("stderr file")),
            None => cmd.stderr(Stdio::inherit()),
        };
        let child = cmd.spawn().expect("spawn server");
        let mut s = Server {
            child,
            grpc_port: g,
            http_port: h,
            admin_port: a,
            shards,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = s.child.try_wait().unwrap() {
                return Err(format!("server exited during start-up: {st}"));
            }
            if let Ok((200, _)) = http_get(h, "/readyz") {
                return Ok(s);
            }
            assert!(Instant::now() < deadline, "server did not become ready");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A full HTTP/1.1 response: status, lower-cased headers, body.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Like [`http_request`], returning headers too (the body is de-chunked if needed).
pub fn http_full(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<HttpResponse> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes())?;
    // The server may answer before reading a large body; ignore a reset while writing.
    let _ = s.write_all(body);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).to_string();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        let mut body = String::new();
        let mut rest = rest;
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            body.push_str(&tail[..n]);
            rest = &tail[n + 2..];
        }
        body
    } else {
        rest.to_string()
    };
    Ok(HttpResponse {
        status,
        headers,
        body,
    })
}

/// POSTs a JSON body to `path` on `port`.
pub fn http_post_json(port: u16, path: &str, body: &str) -> HttpResponse {
    http_full(
        port,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        body.as_bytes(),
    )
    .expect("http post")
}

/// Scrapes `/metrics` and returns the exposition text.
pub fn scrape(srv: &Server) -> String {
    let r = http_full(srv.http_port, "GET", "/metrics", &[], b"").expect("scrape");
    assert_eq!(r.status, 200, "{}", r.body);
    r.body
}

/// Polls `f` until it returns true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// A scratch directory unique to this test process and `name`, created empty.
pub fn scratch_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ic-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

// ---------------------------------------------------------------------------------------------
// Helpers for the rpc_* conformance tests (BEHAVIOUR.md §4–§12).
// ---------------------------------------------------------------------------------------------

/// `CacheTier` wire values.
pub const T_UNSPEC: i32 = 0;
pub const T1: i32 = 1;
pub const T2: i32 = 2;
pub const T3: i32 = 3;

/// Microseconds since the Unix epoch (wall clock), for `timestamp_us`.
pub fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

/// POSTs `body` to `/policy` on the controller-facing port and asserts `204`.
pub fn install_policy(srv: &Server, body: &str) {
    let (st, b) = http_request(
        srv.admin_port,
        "POST",
        "/policy",
        &[("Content-Type", "application/json")],
        body.as_bytes(),
    )
    .expect("POST /policy");
    assert_eq!(st, 204, "POST /policy {body} -> {st} {b:?}");
}

/// The public `/metrics` text.
pub fn metrics_text(srv: &Server) -> String {
    let (st, body) = http_get(srv.http_port, "/metrics").expect("GET /metrics");
    assert_eq!(st, 200, "GET /metrics -> {st}");
    body
}

/// The `/snapshot` JSON (controller-facing port) parsed with serde_json.
pub fn snapshot_json(srv: &Server) -> serde_json::Value {
    let (st, body) = http_get(srv.admin_port, "/snapshot").expect("GET /snapshot");
    assert_eq!(st, 200, "GET /snapshot -> {st} {body}");
    serde_json::from_str(body.trim()).unwrap_or_else(|e| panic!("snapshot JSON {e}: {body}"))
}

/// Asserts that `/metrics` carries exactly the line `line` (e.g.
/// `inferencecache_lookup_route_calls_total{hint_used="false",model="m",reason_code="NO_HINT"} 1`).
pub fn assert_metric_line(text: &str, line: &str) {
    if text.lines().any(|l| l.trim_end() == line) {
        return;
    }
    let name = line.split(['{', ' ']).next().unwrap_or(line);
    let related: Vec<&str> = text.lines().filter(|l| l.starts_with(name)).collect();
    panic!(
        "metric line {line:?} not found; lines for {name}:\n{}",
        related.join("\n")
    );
}

/// The numeric value of the series written exactly as `series` (`name{labels}`), if present.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(series)?;
        let v = rest.strip_prefix(' ')?;
        v.split_whitespace().next()?.parse().ok()
    })
}

/// A chain-form update: one PrefixEntry with `block_hashes`/`block_token_counts`.
pub fn chain_update(
    replica: &str,
    tenant: &str,
    model: &str,
    scheme: &str,
    hashes: &[&[u8]],
    counts: &[i32],
) -> pb::CacheStateUpdate {
    pb::CacheStateUpdate {
        replica_id: replica.into(),
        model_id: model.into(),
        tenant_id: tenant.into(),
        hash_scheme: scheme.into(),
        prefixes: vec![pb::PrefixEntry {
            block_hashes: hashes.iter().map(|h| h.to_vec()).collect(),
            block_token_counts: counts.to_vec(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// A chain lookup request.
pub fn chain_lookup(
    tenant: &str,
    model: &str,
    scheme: &str,
    hashes: &[&[u8]],
    counts: &[i32],
) -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        model_id: model.into(),
        tenant_id: tenant.into(),
        hash_scheme: scheme.into(),
        block_hashes: hashes.iter().map(|h| h.to_vec()).collect(),
        block_token_counts: counts.to_vec(),
        ..Default::default()
    }
}

/// Stats payload for an update.
pub fn stats(hit_rate: f32, pressure: f32) -> Option<pb::ReplicaStats> {
    Some(pb::ReplicaStats {
        hit_rate,
        pressure,
        ..Default::default()
    })
}

/// LookupRoute that must answer OK (the contract never returns an error status).
pub async fn lookup(
    c: &mut InferenceCacheClient<Channel>,
    req: pb::LookupRouteRequest,
) -> pb::LookupRouteResponse {
    c.lookup_route(req.clone())
        .await
        .unwrap_or_else(|s| panic!("LookupRoute({req:?}) returned an error status: {s:?}"))
        .into_inner()
}

/// GetCacheState for (tenant, model).
pub async fn cache_state(
    c: &mut InferenceCacheClient<Channel>,
    tenant: &str,
    model: &str,
) -> pb::GetCacheStateResponse {
    c.get_cache_state(pb::GetCacheStateRequest {
        model_id: model.into(),
        tenant_id: tenant.into(),
    })
    .await
    .expect("GetCacheState")
    .into_inner()
}

/// GetCacheState's `summary.total_prefixes` for (tenant, model).
pub async fn total_prefixes(
    c: &mut InferenceCacheClient<Channel>,
    tenant: &str,
    model: &str,
) -> i64 {
    cache_state(c, tenant, model)
        .await
        .summary
        .expect("summary")
        .total_prefixes
}

/// One expected replica score.
#[derive(Debug, Clone)]
pub struct Exp {
    pub replica: String,
    pub score: f32,
    pub matched: i32,
    pub tier: i32,
    /// Expected `estimated_cache_hit_prob` (None = not checked).
    pub prob: Option<f32>,
}

/// Expected score row; `prob` unchecked.
pub fn exp(replica: &str, score: f32, matched: i32, tier: i32) -> Exp {
    Exp {
        replica: replica.into(),
        score,
        matched,
        tier,
        prob: None,
    }
}

/// Expected score row with `estimated_cache_hit_prob`.
pub fn expp(replica: &str, score: f32, matched: i32, tier: i32, prob: f32) -> Exp {
    Exp {
        prob: Some(prob),
        ..exp(replica, score, matched, tier)
    }
}

/// The AFFINITY_HINT row: score, matched, prob all 0, tier UNSPECIFIED.
pub fn affinity(replica: &str) -> Exp {
    expp(replica, 0.0, 0, T_UNSPEC, 0.0)
}

/// `a ≈ b` within 1e-3 relative; an expected 0 must be exactly 0.
pub fn approx(a: f32, b: f32) -> bool {
    if b == 0.0 {
        a == 0.0
    } else {
        ((a - b) / b).abs() <= 1e-3
    }
}

/// Asserts reason code and the exact ordered replica list with matched_tokens, tier, score
/// (≈ 1e-3 relative, exact when the expectation is 0) and, when given, the hit probability.
pub fn assert_resp(resp: &pb::LookupRouteResponse, reason: &str, want: &[Exp]) {
    let ctx = || format!("response: {resp:?}\nexpected {reason} with {want:?}");
    assert_eq!(resp.reason_code, reason, "reason code\n{}", ctx());
    let got: Vec<&str> = resp
        .replica_scores
        .iter()
        .map(|s| s.replica_id.as_str())
        .collect();
    let wantids: Vec<&str> = want.iter().map(|w| w.replica.as_str()).collect();
    assert_eq!(got, wantids, "replica list/order\n{}", ctx());
    for (g, w) in resp.replica_scores.iter().zip(want) {
        assert_eq!(
            g.matched_tokens,
            w.matched,
            "matched_tokens of {}\n{}",
            w.replica,
            ctx()
        );
        assert_eq!(g.tier, w.tier, "tier of {}\n{}", w.replica, ctx());
        assert!(
            approx(g.score, w.score),
            "score of {}\n{}",
            w.replica,
            ctx()
        );
        if let Some(p) = w.prob {
            assert!(
                approx(g.estimated_cache_hit_prob, p),
                "estimated_cache_hit_prob of {}\n{}",
                w.replica,
                ctx()
            );
        }
    }
}

/// The core owning `(tenant, model)` (same partition function as [`models_per_core`]).
pub fn core_of(tenant: &str, model: &str, cores: usize) -> usize {
    use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};
    let p = xxh3_64_with_seed(model.as_bytes(), xxh3_64(tenant.as_bytes())) % 256;
    (p as usize) % cores
}

/// Tenant ids (prefix `prefix`) whose `(tenant, model)` partitions land on each of `cores` cores.
pub fn tenants_per_core(prefix: &str, model: &str, cores: usize) -> Vec<String> {
    let mut found: Vec<Option<String>> = vec![None; cores];
    for i in 0..10_000 {
        let t = format!("{prefix}-{i}");
        let c = core_of(&t, model, cores);
        if found[c].is_none() {
            found[c] = Some(t);
        }
        if found.iter().all(|f| f.is_some()) {
            break;
        }
    }
    found.into_iter().map(|f| f.unwrap()).collect()
}

/// `Chain(tokens, bs)` of BEHAVIOUR.md §17: per-block big-endian 8-byte rolling XXH3 (seed 1337)
/// prefix hashes and the per-block counts (all `bs`).
pub fn fingerprint_chain(tokens: &[u32], bs: usize) -> (Vec<Vec<u8>>, Vec<i32>) {
    use xxhash_rust::xxh3::xxh3_64_with_seed;
    let mut hashes = Vec::new();
    let mut counts = Vec::new();
    if bs == 0 {
        return (hashes, counts);
    }
    let mut prev: Option<u64> = None;
    for block in tokens.chunks_exact(bs) {
        let mut buf = Vec::with_capacity(bs * 4);
        for t in block {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        let content = xxh3_64_with_seed(&buf, 1337);
        let p = match prev {
            None => content,
            Some(parent) => {
                let mut b = [0u8; 16];
                b[..8].copy_from_slice(&parent.to_le_bytes());
                b[8..].copy_from_slice(&content.to_le_bytes());
                xxh3_64_with_seed(&b, 1337)
            }
        };
        hashes.push(p.to_be_bytes().to_vec());
        counts.push(bs as i32);
        prev = Some(p);
    }
    (hashes, counts)
}

/// A raw HTTP/2 transport for the generated client that does **not** enforce the `grpc-timeout`
/// header on the client side (tonic's `Channel` does), so a request can reach the server with a
/// deadline that has already expired (C140).
#[derive(Clone)]
pub struct RawH2(hyper::client::conn::http2::SendRequest<tonic::body::Body>);

impl tower_service::Service<http::Request<tonic::body::Body>> for RawH2 {
    type Response = http::Response<hyper::body::Incoming>;
    type Error = hyper::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(self.0.send_request(req))
    }
}

impl Server {
    /// A generated client over [`RawH2`] (no client-side deadline enforcement).
    pub async fn raw_client(&self) -> InferenceCacheClient<RawH2> {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", self.grpc_port))
            .await
            .expect("connect");
        let (send, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(tcp),
        )
        .await
        .expect("h2 handshake");
        tokio::spawn(conn);
        InferenceCacheClient::with_origin(RawH2(send), self.grpc_url().parse().unwrap())
    }
}

/// PEM files of a generated CA and a server certificate it signed (SANs localhost, 127.0.0.1).
pub struct TestPki {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

/// Generates a fresh CA and a server certificate/key pair signed by it.
pub fn gen_pki(cn: &str) -> TestPki {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("{cn} CA"));
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut params =
        CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, cn);
    let issuer = Issuer::from_params(&ca_params, &ca_key);
    let cert = params.signed_by(&key, &issuer).unwrap();
    TestPki {
        ca_pem: ca_cert.pem(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    }
}
