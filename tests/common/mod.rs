//! Test harness: runs the real `inference-cache-server` binary on loopback ports and hands out
//! generated gRPC clients, so end-to-end tests exercise exactly what users deploy.
#![allow(dead_code)]

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
            "warn",
        ]);
        if !extra.iter().any(|f| f.contains("allowed-controller-sa")) {
            cmd.arg("--insecure-disable-auth");
        }
        cmd.args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        let child = cmd.spawn().expect("spawn server");
        let s = Server {
            child,
            grpc_port: g,
            http_port: h,
            admin_port: a,
            shards,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok((200, _)) = http_get(h, "/readyz") {
                break;
            }
            assert!(Instant::now() < deadline, "server did not become ready");
            std::thread::sleep(Duration::from_millis(20));
        }
        s
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
