//! The server under test: the real `inference-cache-server` binary on loopback ports, started
//! with `--shards N`, waited for through `/readyz`, killed on drop; plus generated gRPC clients
//! (a normal tonic channel and a raw HTTP/2 one) and one-shot runs that must exit.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
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

/// An ephemeral loopback port (bound then released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether process `pid` holds a listening TCP socket on each of `ports` (Linux: the socket
/// inodes among `/proc/<pid>/fd` matched against the LISTEN rows of `/proc/net/tcp{,6}`).
fn listens_on(pid: u32, ports: &[u16]) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    let inodes: std::collections::HashSet<String> = fds
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let mut listening = std::collections::HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for row in text.lines().skip(1) {
            let cols: Vec<&str> = row.split_whitespace().collect();
            // sl, local_address (hex ip:port), rem_address, st (0A = LISTEN), ..., inode (col 9)
            if cols.len() > 9
                && cols[3] == "0A"
                && inodes.contains(cols[9])
                && let Some(port) = cols[1].rsplit(':').next()
                && let Ok(port) = u16::from_str_radix(port, 16)
            {
                listening.insert(port);
            }
        }
    }
    ports.iter().all(|p| listening.contains(p))
}

/// Sends SIGTERM to `child` (a graceful shutdown request).
pub fn sigterm(child: &Child) {
    // SAFETY: kill(2) with a pid we spawned and a valid signal number; no memory is shared.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
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

    /// Spawns the server on free loopback ports with `--shards N` (and, unless
    /// `o.no_insecure`, `--insecure-disable-auth`) plus `o.flags`, without waiting for it: for
    /// scenarios that watch start-up itself (`/readyz` before a restore or an event log).
    pub fn spawn(shards: usize, o: &StartOpts<'_>) -> Server {
        let (g, h, a) = (free_port(), free_port(), free_port());
        let mut cmd = Command::new(bin());
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
        Server {
            child: cmd.spawn().expect("spawn server"),
            grpc_port: g,
            http_port: h,
            admin_port: a,
            shards,
        }
    }

    fn try_start(shards: usize, o: &StartOpts<'_>) -> Result<Server, String> {
        let mut s = Server::spawn(shards, o);
        let (g, h, a) = (s.grpc_port, s.http_port, s.admin_port);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(st) = s.child.try_wait().unwrap() {
                return Err(format!("server exited during start-up: {st}"));
            }
            // Ready, and the listeners are this child's: a free port can be handed out twice
            // (to concurrent tests, or to another process), and then another server would
            // answer /readyz on it while this one fails to bind and exits.
            if let Ok((200, _)) = http_get(h, "/readyz")
                && listens_on(s.child.id(), &[g, h, a])
            {
                return Ok(s);
            }
            assert!(Instant::now() < deadline, "server did not become ready");
            std::thread::sleep(Duration::from_millis(20));
        }
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

/// Runs the binary with `args` on fresh loopback ports (no `KUBERNETES_SERVICE_*` inherited)
/// and `env`, expecting it to exit on its own: (exit code, stderr).
pub fn run_exit(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let mut cmd = Command::new(bin());
    cmd.args([
        "--grpc-bind-address",
        &format!("127.0.0.1:{}", free_port()),
        "--http-bind-address",
        &format!("127.0.0.1:{}", free_port()),
        "--snapshot-bind-address",
        &format!("127.0.0.1:{}", free_port()),
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
