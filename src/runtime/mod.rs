//! The per-core runtime: `--shards N` glommio executors pinned to CPUs, each serving its own
//! gRPC connections and owning a fixed slice of the index partitions (ARCHITECTURE.md §1).
//!
//! Core 0 accepts gRPC connections and deals them round-robin to all cores, so connections are
//! spread evenly instead of by the kernel's SO_REUSEPORT hash.

pub mod io;
pub mod mailbox;

use std::cell::Cell;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use event_listener::Event;
use glommio::net::{TcpListener, TcpStream};
use glommio::{LocalExecutorBuilder, Placement};

use crate::core_state::{self, CoreState};

/// Default bound on gRPC connections one core serves at once; beyond it new connections are
/// closed (`--max-connections-per-core`).
pub const DEFAULT_MAX_CONNECTIONS_PER_CORE: usize = 16_384;
static MAX_CONNECTIONS_PER_CORE: AtomicUsize = AtomicUsize::new(DEFAULT_MAX_CONNECTIONS_PER_CORE);

/// Sets the per-core connection bound (before [`start`]).
pub fn set_max_connections_per_core(n: usize) {
    MAX_CONNECTIONS_PER_CORE.store(n.max(1), Ordering::SeqCst);
}
/// Concurrent HTTP/2 streams allowed per gRPC connection.
pub const MAX_CONCURRENT_STREAMS: u32 = 1024;
/// io_uring registered memory per executor: small, since the cores do no file I/O and this
/// lets the server start without CAP_IPC_LOCK under the default 8 MiB `ulimit -l`.
const IO_MEMORY_BYTES: usize = 512 * 1024;
/// Longest graceful drain after SIGTERM before in-flight connections are abandoned.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

static SHUTTING_DOWN: AtomicBool = AtomicBool::new(false);
static SHUTDOWN: Event = Event::new();
/// Cores still draining their connections; the hop must keep working until all are done.
static DRAINING: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static LIVE_CONNECTIONS: Cell<usize> = const { Cell::new(0) };
}

/// Asks every core to stop accepting and drain (SIGTERM/SIGINT).
pub fn request_shutdown() {
    SHUTTING_DOWN.store(true, Ordering::SeqCst);
    SHUTDOWN.notify(usize::MAX);
}

/// True once shutdown was requested.
pub fn shutting_down() -> bool {
    SHUTTING_DOWN.load(Ordering::SeqCst)
}

/// Resolves once shutdown is requested.
pub async fn shutdown_requested() {
    loop {
        if shutting_down() {
            return;
        }
        let listener = SHUTDOWN.listen();
        if shutting_down() {
            return;
        }
        listener.await;
    }
}

/// What each core runs at start, besides serving: installs its state and services.
pub type CoreInit = Arc<dyn Fn(usize) -> CoreState + Send + Sync>;

/// Start-up parameters of the runtime.
pub struct RuntimeConfig {
    /// Number of executors.
    pub shards: usize,
    /// gRPC listen address.
    pub grpc_addr: SocketAddr,
    /// Builds each core's state.
    pub init: CoreInit,
    /// Per-core service installation (runs on the core).
    pub install_services: Arc<dyn Fn() + Send + Sync>,
    /// Period of each core's TTL sweep (BEHAVIOUR.md §6: 1 min).
    pub sweep_interval: Duration,
}

/// A running set of executors.
pub struct Runtime {
    handles: Vec<glommio::ExecutorJoinHandle<()>>,
    /// The address actually bound (port 0 resolved).
    pub grpc_addr: SocketAddr,
}

/// CPUs this process may run on, in order (so pinning respects taskset/cgroup limits).
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: plain libc call filling a zeroed cpu_set_t owned by this frame.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
            let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect();
            if !cpus.is_empty() {
                return cpus;
            }
        }
    }
    (0..std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1))
        .collect()
}

/// Refuses to start when `addr` is already served: glommio listeners always set SO_REUSEPORT,
/// so binding next to another server would silently split connections between the two.
pub fn ensure_port_free(addr: SocketAddr) -> Result<(), String> {
    std::net::TcpListener::bind(addr).map(drop).map_err(|e| {
        format!("gRPC address {addr} is not available ({e}); is another server running on it?")
    })
}

/// Starts the executors, binds the gRPC listener on core 0 and returns once serving.
pub fn start(cfg: RuntimeConfig) -> Result<Runtime, String> {
    assert!(cfg.shards >= 1 && cfg.shards <= crate::cli::MAX_SHARDS);
    ensure_port_free(cfg.grpc_addr)?;
    mailbox::init(cfg.shards);
    DRAINING.store(cfg.shards, Ordering::SeqCst);
    let cpus = allowed_cpus();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<(usize, Result<SocketAddr, String>)>();
    let mut handles = Vec::with_capacity(cfg.shards);
    for core in 0..cfg.shards {
        let cpu = cpus[core % cpus.len()];
        let init = cfg.init.clone();
        let install = cfg.install_services.clone();
        let ready = ready_tx.clone();
        let addr = cfg.grpc_addr;
        let sweep_interval = cfg.sweep_interval;
        let handle = LocalExecutorBuilder::new(Placement::Fixed(cpu))
            .name(&format!("core-{core}"))
            .io_memory(IO_MEMORY_BYTES)
            .spawn(move || async move {
                core_state::install(init(core));
                install();
                glommio::spawn_local(mailbox::drain_loop(core)).detach();
                glommio::spawn_local(sweep_loop(sweep_interval)).detach();
                if core == 0 {
                    match TcpListener::bind(addr) {
                        Ok(listener) => {
                            let bound = listener.local_addr().unwrap_or(addr);
                            let _ = ready.send((core, Ok(bound)));
                            accept_loop(listener).await;
                        }
                        Err(e) => {
                            let _ = ready.send((core, Err(format!("bind gRPC {addr}: {e}"))));
                            return;
                        }
                    }
                } else {
                    let _ = ready.send((core, Ok(addr)));
                    shutdown_requested().await;
                }
                drain_core().await;
            })
            .map_err(|e| {
                format!("cannot start executor {core} on CPU {cpu}: {e} (io_uring unavailable or locked memory too small?)")
            })?;
        handles.push(handle);
    }
    drop(ready_tx);
    let mut bound = cfg.grpc_addr;
    for _ in 0..cfg.shards {
        match ready_rx.recv_timeout(Duration::from_secs(30)) {
            Ok((0, Ok(a))) => bound = a,
            Ok((_, Ok(_))) => {}
            Ok((_, Err(e))) => {
                request_shutdown();
                return Err(e);
            }
            Err(_) => {
                request_shutdown();
                return Err("executors did not start (io_uring unavailable?)".into());
            }
        }
    }
    Ok(Runtime {
        handles,
        grpc_addr: bound,
    })
}

impl Runtime {
    /// Waits for every executor to finish draining (after [`request_shutdown`]).
    pub fn join(self) {
        for h in self.handles {
            let _ = h.join();
        }
    }
}

/// Sweeps this core's partitions every `interval` until shutdown (the reference's ticker).
async fn sweep_loop(interval: Duration) {
    let interval = interval.max(Duration::from_millis(1));
    loop {
        let tick = futures_lite::future::or(
            async {
                glommio::timer::sleep(interval).await;
                true
            },
            async {
                shutdown_requested().await;
                false
            },
        )
        .await;
        if !tick {
            return;
        }
        core_state::with_core(|st| st.sweep());
    }
}

/// Core 0's accept loop: deals accepted connections round-robin over all cores.
async fn accept_loop(listener: TcpListener) {
    let cores = mailbox::cores();
    let mut next = 0usize;
    loop {
        let accepted =
            futures_lite::future::or(async { Some(listener.shared_accept().await) }, async {
                shutdown_requested().await;
                None
            })
            .await;
        let Some(accepted) = accepted else { return };
        let stream = match accepted {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "grpc_accept_error");
                glommio::timer::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let target = next % cores;
        next = next.wrapping_add(1);
        if target == 0 {
            serve_connection(stream.bind_to_executor());
        } else if let Err(mailbox::Op::Connection(back)) =
            mailbox::try_push(target, mailbox::Op::Connection(stream))
        {
            serve_connection(back.bind_to_executor());
        }
    }
}

/// Serves one gRPC connection on the current core until it closes or the drain ends it.
pub fn serve_connection(stream: TcpStream) {
    // Bounded: past the limit a new connection is closed at once (clients retry or go
    // elsewhere) instead of growing tasks and buffers without bound.
    let limit = MAX_CONNECTIONS_PER_CORE.load(Ordering::Relaxed);
    if LIVE_CONNECTIONS.with(|c| c.get()) >= limit {
        tracing::warn!(limit, "grpc_connection_refused");
        drop(stream);
        return;
    }
    LIVE_CONNECTIONS.with(|c| c.set(c.get() + 1));
    glommio::spawn_local(async move {
        let _ = stream.set_nodelay(true);
        match crate::tls::acceptor() {
            None => serve_http2(io::GlommioIo(stream)).await,
            Some(acceptor) => {
                if let Some(tls) = crate::tls::handshake(acceptor, stream).await {
                    serve_http2(io::GlommioIo(tls)).await;
                }
            }
        }
        LIVE_CONNECTIONS.with(|c| c.set(c.get() - 1));
    })
    .detach();
}

/// Serves gRPC over HTTP/2 on one established (plaintext or TLS) stream until it closes or the
/// drain ends it.
async fn serve_http2<S>(io: io::GlommioIo<S>)
where
    S: futures_lite::AsyncRead + futures_lite::AsyncWrite + Unpin + 'static,
{
    let mut builder = hyper::server::conn::http2::Builder::new(io::LocalExec);
    builder.max_concurrent_streams(MAX_CONCURRENT_STREAMS);
    let conn = builder.serve_connection(io, crate::grpc::Router);
    let mut conn = std::pin::pin!(conn);
    let finished = futures_lite::future::or(async { Some(conn.as_mut().await) }, async {
        shutdown_requested().await;
        None
    })
    .await;
    if finished.is_none() {
        conn.as_mut().graceful_shutdown();
        let _ = futures_lite::future::or(async { conn.await.map(|_| ()) }, async {
            glommio::timer::sleep(DRAIN_TIMEOUT).await;
            Ok(())
        })
        .await;
    }
}

/// After shutdown: waits for this core's connections to close, then for every other core, so
/// hops from draining peers are still served.
async fn drain_core() {
    let deadline = Instant::now() + DRAIN_TIMEOUT + Duration::from_secs(1);
    while LIVE_CONNECTIONS.with(|c| c.get()) > 0 && Instant::now() < deadline {
        glommio::timer::sleep(Duration::from_millis(2)).await;
    }
    DRAINING.fetch_sub(1, Ordering::SeqCst);
    while DRAINING.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
        glommio::timer::sleep(Duration::from_millis(2)).await;
    }
}
