//! The server under test: the real `inference-cache-server` binary on loopback ports, started
//! with `--shards N`, waited for through `/readyz`, killed on drop; plus generated gRPC clients
//! (a normal tonic channel and a raw HTTP/2 one) and one-shot runs that must exit.
//!
//! The server binds port 0 and the harness reads the ports it got from its `listening_http` /
//! `listening_grpc` log lines, so concurrent tests never race for a free port.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::{Child, ChildStderr, Command, Stdio};
use std::sync::Mutex;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

use super::http::http_get;
use super::pb;
use pb::inference_cache_client::InferenceCacheClient;
use tonic::transport::Channel;

/// Path of the server binary built by cargo for integration tests.
const BUILT_BIN: &str = env!("CARGO_BIN_EXE_inference-cache-server");

/// The server binary under test: this build's, or `INFERENCECACHE_TEST_SERVER_BIN` (to check
/// that a new test fails against an older build).
pub fn bin() -> String {
    std::env::var("INFERENCECACHE_TEST_SERVER_BIN").unwrap_or_else(|_| BUILT_BIN.to_string())
}

/// An ephemeral loopback port (bound then released), for processes that cannot bind port 0
/// and report it (nats-server, kvevent-subscriber's metrics listener) or for an address where
/// nothing must listen yet. The server under test binds port 0 instead.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// What a server reports in its `listening_*` log lines (the addresses actually bound).
#[derive(Debug)]
enum Listening {
    Http { http: u16, snapshot: u16 },
    Grpc { grpc: u16, shard_aware: Option<u16> },
}

/// The `listening_*` event in one JSON log line, if it is one.
fn parse_listening(line: &str) -> Option<Listening> {
    if !line.contains("\"listening_") {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let port = |field: &str| -> Option<u16> {
        let addr: std::net::SocketAddr = v.get(field)?.as_str()?.parse().ok()?;
        Some(addr.port())
    };
    if line.contains("\"listening_http\"") {
        Some(Listening::Http {
            http: port("http_addr")?,
            snapshot: port("snapshot_addr")?,
        })
    } else {
        Some(Listening::Grpc {
            grpc: port("grpc_addr")?,
            shard_aware: port("shard_aware_grpc_addr"),
        })
    }
}

/// Where the server's log lines go: the test's captured output, or a file.
enum LogSink {
    Captured,
    File(std::fs::File),
}

/// Reads the server's stderr on a thread of its own until the server exits (always draining
/// it, so the server never blocks on a full pipe): reports the `listening_*` events on the
/// returned channel and passes every line on to `sink`.
fn read_logs(stderr: ChildStderr, mut sink: LogSink) -> Receiver<Listening> {
    let (tx, rx): (Sender<Listening>, _) = channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stderr);
        let mut bytes = Vec::new();
        while reader.read_until(b'\n', &mut bytes).is_ok_and(|n| n > 0) {
            let text = String::from_utf8_lossy(&bytes);
            let line = text.trim_end_matches('\n');
            if let Some(l) = parse_listening(line) {
                let _ = tx.send(l);
            }
            match &mut sink {
                LogSink::Captured => eprintln!("{line}"),
                LogSink::File(f) => {
                    let _ = writeln!(f, "{line}");
                }
            }
            bytes.clear();
        }
    });
    rx
}

/// Sends SIGTERM to `child` (a graceful shutdown request).
pub fn sigterm(child: &Child) {
    // SAFETY: kill(2) with a pid we spawned and a valid signal number; no memory is shared.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
}

/// A running server process, killed on drop.
pub struct Server {
    pub child: Child,
    /// Known once the server serves gRPC ([`Server::start`], or [`Server::wait_for_grpc`]
    /// after [`Server::spawn`]); 0 before.
    pub grpc_port: u16,
    pub http_port: u16,
    pub admin_port: u16,
    /// The shard-aware listener's port, when `--shard-aware-grpc-bind-address` was given.
    pub shard_aware_port: Option<u16>,
    pub shards: usize,
    /// The `listening_*` events the log reader reports.
    listening: Mutex<Receiver<Listening>>,
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
        sigterm(&self.child);
        let deadline = Instant::now() + Duration::from_secs(60);
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
        let mut s = Server::spawn(shards, &o);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(st) = s.child.try_wait().unwrap() {
                panic!("server exited during start-up: {st}");
            }
            if s.http_port != 0
                && let Ok((200, _)) = http_get(s.http_port, "/readyz")
            {
                break;
            }
            assert!(Instant::now() < deadline, "server did not become ready");
            std::thread::sleep(Duration::from_millis(20));
        }
        s.wait_for_grpc();
        s
    }

    /// Spawns the server on loopback port 0 with `--shards N` (and, unless `o.no_insecure`,
    /// `--insecure-disable-auth`) plus `o.flags`, and returns once its HTTP listeners are bound
    /// (their ports known) without waiting for it to be ready: for scenarios that watch start-up
    /// itself (`/readyz` before a restore or an event log). The gRPC port is learnt with
    /// [`Server::wait_for_grpc`]. A server that exits before binding has every port 0.
    pub fn spawn(shards: usize, o: &StartOpts<'_>) -> Server {
        let mut cmd = Command::new(bin());
        cmd.args([
            "--grpc-bind-address",
            "127.0.0.1:0",
            "--http-bind-address",
            "127.0.0.1:0",
            "--snapshot-bind-address",
            "127.0.0.1:0",
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
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let sink = match &o.stderr_file {
            Some(p) => LogSink::File(std::fs::File::create(p).expect("stderr file")),
            None => LogSink::Captured,
        };
        let mut child = cmd.spawn().expect("spawn server");
        let listening = read_logs(child.stderr.take().expect("piped stderr"), sink);
        let mut s = Server {
            child,
            grpc_port: 0,
            http_port: 0,
            admin_port: 0,
            shard_aware_port: None,
            shards,
            listening: Mutex::new(listening),
        };
        if let Some(Listening::Http { http, snapshot }) = s.next_listening() {
            (s.http_port, s.admin_port) = (http, snapshot);
        }
        s
    }

    /// Waits for the `listening_grpc` line (logged once every core serves, before `/readyz`
    /// turns 200) and records the gRPC ports.
    pub fn wait_for_grpc(&mut self) {
        while self.grpc_port == 0 {
            match self.next_listening() {
                Some(Listening::Grpc { grpc, shard_aware }) => {
                    (self.grpc_port, self.shard_aware_port) = (grpc, shard_aware);
                }
                Some(_) => {}
                None => panic!("the server never reported its gRPC port"),
            }
        }
    }

    /// The next `listening_*` event; `None` when the server exited first or after 60 s.
    fn next_listening(&self) -> Option<Listening> {
        let rx = self.listening.lock().unwrap();
        rx.recv_timeout(Duration::from_secs(60)).ok()
    }
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

/// Runs the binary with `args` on loopback port 0 (no `KUBERNETES_SERVICE_*` inherited)
/// and `env`, expecting it to exit on its own: (exit code, stderr).
pub fn run_exit(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let mut cmd = Command::new(bin());
    cmd.args([
        "--grpc-bind-address",
        "127.0.0.1:0",
        "--http-bind-address",
        "127.0.0.1:0",
        "--snapshot-bind-address",
        "127.0.0.1:0",
    ])
    .args(args)
    .env_remove("KUBERNETES_SERVICE_HOST")
    .env_remove("KUBERNETES_SERVICE_PORT")
    .envs(env.iter().copied());
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A process's resident memory in bytes (VmRSS), for tests that bound the server's memory.
pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb * 1024
}

/// Bytes written on loopback TCP connections to or from `port` that the receiving end has not
/// read yet (Linux: the tx_queue and rx_queue columns of `/proc/net/tcp` for every established
/// socket whose local or remote port is `port`); 0 once the server read everything its clients
/// sent that reached the kernel.
pub fn loopback_bytes_in_flight(port: u16) -> u64 {
    let text = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let port_of = |addr: &str| {
        addr.rsplit(':')
            .next()
            .and_then(|p| u16::from_str_radix(p, 16).ok())
    };
    text.lines()
        .skip(1)
        .filter_map(|row| {
            // sl, local_address, rem_address, st (01 = ESTABLISHED), tx_queue:rx_queue, ...
            let cols: Vec<&str> = row.split_whitespace().collect();
            let ours = cols.len() > 4
                && cols[3] == "01"
                && (port_of(cols[1]) == Some(port) || port_of(cols[2]) == Some(port));
            let (tx, rx) = cols.get(4)?.split_once(':')?;
            ours.then(|| {
                u64::from_str_radix(tx, 16).unwrap_or(0) + u64::from_str_radix(rx, 16).unwrap_or(0)
            })
        })
        .sum()
}
