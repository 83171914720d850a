//! The per-core runtime: `--shards N` glommio executors pinned to CPUs, each serving its own
//! connections and owning a fixed slice of the index partitions (docs/ARCHITECTURE.md §1), plus
//! the one small admin thread for everything off the request path.
//!
//! The runtime knows nothing of gRPC: start-up hands it a connection handler, which every core
//! runs for the connections dealt to it ([`accept`]).

mod accept;
pub mod admin_thread;
pub mod decode_pool;
pub mod evict;
pub mod health;
pub mod io;
pub mod lane;
pub mod mailbox;
mod shutdown;
pub mod watch;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::os::fd::{FromRawFd, IntoRawFd};

use glommio::net::{TcpListener, TcpStream};
use glommio::{LocalExecutorBuilder, Placement};

use crate::limits::{
    CAP_PREBUILD_POLL, CORE_PREEMPT_TIMER, EXECUTOR_START_KICK, EXECUTOR_START_TIMEOUT,
    GLOMMIO_SPIN_UNDER_WATCH, IO_MEMORY_BYTES, LISTEN_BACKLOG, MAX_SHARDS, SWEEP_INGEST_WAIT_MIN,
    SWEEP_SLICE_PAUSE,
};
use crate::metrics::Maintenance;
use crate::shard::{self, CoreState};
use crate::sys::clock::thread_cpu_time;

pub use shutdown::{
    all_drained, hold_cores_after_drain, release_cores, request_shutdown, shutdown_requested,
    shutting_down, wait_for_shutdown_until,
};

/// Serves one connection on the core it was dealt to, until it closes.
pub type ConnectionHandler = fn(TcpStream) -> Pin<Box<dyn Future<Output = ()>>>;

/// Builds each core's state at start.
pub type CoreInit = Arc<dyn Fn(usize) -> CoreState + Send + Sync>;

/// Start-up parameters of the runtime.
pub struct RuntimeConfig {
    /// Number of executors.
    pub shards: usize,
    /// Listen address of the connections the cores serve.
    pub listen_addr: SocketAddr,
    /// Listen address of the shard-aware listener (connections served by the core their source
    /// port names), if any.
    pub shard_aware_addr: Option<SocketAddr>,
    /// How long an idle core spins before parking, if at all (`--busy-poll-us`).
    pub busy_poll: Option<Duration>,
    /// Builds each core's state.
    pub init: CoreInit,
    /// Per-core set-up run on the core before it serves (e.g. building its services).
    pub on_core_start: Arc<dyn Fn() + Send + Sync>,
    /// What each core runs for a connection dealt to it.
    pub serve_connection: ConnectionHandler,
    /// Connections one core serves at once; further ones are closed.
    pub max_connections_per_core: usize,
    /// Period of each core's TTL sweep (docs/BEHAVIOUR.md §6: 1 min).
    pub sweep_interval: Duration,
}

/// Why the runtime could not start.
#[derive(Debug)]
pub enum StartError {
    /// The listen address is served by another process (or cannot be bound).
    AddressInUse(SocketAddr, std::io::Error),
    /// An executor could not be created (io_uring unavailable, locked memory too small).
    Executor(usize, usize, String),
    /// The executors did not report in time.
    NotStarted,
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::AddressInUse(addr, e) => write!(
                f,
                "gRPC address {addr} is not available ({e}); is another server running on it?"
            ),
            Self::Executor(core, cpu, e) => write!(
                f,
                "cannot start executor {core} on CPU {cpu}: {e} (io_uring unavailable or locked memory too small?)"
            ),
            Self::NotStarted => f.write_str("executors did not start (io_uring unavailable?)"),
        }
    }
}

impl std::error::Error for StartError {}

/// A running set of executors.
pub struct Runtime {
    handles: Vec<glommio::ExecutorJoinHandle<()>>,
    /// The address actually bound (port 0 resolved).
    pub listen_addr: SocketAddr,
    /// The shard-aware listener's address actually bound, if any.
    pub shard_aware_addr: Option<SocketAddr>,
}

/// Binds the listener before any executor starts. SO_REUSEADDR lets a restart bind at once
/// while the previous process's connections linger in TIME_WAIT or FIN_WAIT; no SO_REUSEPORT,
/// so a port another live server listens on is refused instead of silently shared.
fn bind_listener(addr: SocketAddr) -> Result<std::net::TcpListener, StartError> {
    use socket2::{Domain, Protocol, Socket, Type};
    let bind = || -> std::io::Result<std::net::TcpListener> {
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
        socket.set_reuse_address(true)?;
        socket.bind(&addr.into())?;
        socket.listen(LISTEN_BACKLOG)?;
        Ok(socket.into())
    };
    bind().map_err(|e| StartError::AddressInUse(addr, e))
}

/// What each executor reports once it runs.
type Ready = (usize, Result<(), StartError>);

/// Starts the executors, binds the listener on core 0 and returns once every core serves.
pub fn start(cfg: RuntimeConfig) -> Result<Runtime, StartError> {
    assert!((1..=MAX_SHARDS).contains(&cfg.shards));
    let listener = bind_listener(cfg.listen_addr)?;
    let listen_addr = bound_addr(&listener, cfg.listen_addr)?;
    let shard_aware = cfg.shard_aware_addr.map(bind_listener).transpose()?;
    let shard_aware_addr = match (&shard_aware, cfg.shard_aware_addr) {
        (Some(l), Some(asked)) => Some(bound_addr(l, asked)?),
        _ => None,
    };
    // Core 0 takes the listeners over; the fds stay open until its accept loops end.
    let mut listeners = Some(Listeners {
        grpc: listener,
        shard_aware,
    });
    init_process(&cfg);
    let cpus = crate::sys::cpus::allowed_cpus();
    let cfg = Arc::new(cfg);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Ready>();
    let mut handles = Vec::with_capacity(cfg.shards);
    for core in 0..cfg.shards {
        let cpu = cpus[core % cpus.len()];
        let (cfg, ready) = (cfg.clone(), ready_tx.clone());
        let own_listeners = if core == 0 { listeners.take() } else { None };
        let mut builder = core_executor(cpu, core);
        if let Some(spin) = cfg.busy_poll {
            // The core's spin is its watcher's (`watch`); glommio's own only bridges the
            // watcher's reactor turns, so they never park the core.
            builder = builder.spin_before_park(spin.min(GLOMMIO_SPIN_UNDER_WATCH));
        }
        let handle = builder
            .spawn(move || run_core(core, cfg, own_listeners, ready))
            .map_err(|e| StartError::Executor(core, cpu, e.to_string()))?;
        handles.push(handle);
    }
    drop(ready_tx);
    wait_ready(&ready_rx, cfg.shards)?;
    Ok(Runtime {
        handles,
        listen_addr,
        shard_aware_addr,
    })
}

/// The executor of `core`, pinned to `cpu`.
fn core_executor(cpu: usize, core: usize) -> LocalExecutorBuilder {
    LocalExecutorBuilder::new(Placement::Fixed(cpu))
        .name(&format!("core-{core}"))
        .io_memory(IO_MEMORY_BYTES)
        .preempt_timer(CORE_PREEMPT_TIMER)
}

/// The process-wide state of `cfg.shards` cores; runs once, before any core starts.
fn init_process(cfg: &RuntimeConfig) {
    shard::set_cores(cfg.shards);
    mailbox::init(cfg.shards);
    health::init(cfg.shards);
    accept::init(cfg.serve_connection, cfg.max_connections_per_core);
    shutdown::set_draining(cfg.shards);
}

/// What `core` installs on its executor before it serves: its state, its metrics store, then
/// `cfg.on_core_start` (the services).
fn install_core(core: usize, cfg: &RuntimeConfig) {
    shard::install((cfg.init)(core));
    if let Some(k) = crate::sys::test_hooks::min_candidates() {
        shard::with_core(|st| st.index.set_min_candidates(k));
    }
    // A restored index already at the cap would evict on its first ingests, before a build
    // ahead of need could finish: build its candidates now, before the core serves anything.
    shard::with_core(|st| st.build_cap_candidates_at_start());
    // And the buffers builds ahead of need take, so none allocates one while serving.
    shard::with_core(|st| st.reserve_cap_buffers(cfg.shards));
    crate::metrics::register_core_thread();
    (cfg.on_core_start)();
}

/// Makes the calling thread, which must run a glommio executor, the only core of a `--shards 1`
/// process with no listener and no other thread: what [`start`] and `run_core` install for core 0,
/// without its background loops (mailbox drain, heartbeat, TTL sweep; a single core's requests
/// never hop). For the in-process perf harness (src/perf_harness.rs).
pub fn install_in_process(cfg: &RuntimeConfig) {
    assert_eq!(cfg.shards, 1, "in-process: one core");
    init_process(cfg);
    install_core(0, cfg);
}

/// The listeners core 0 accepts on.
struct Listeners {
    grpc: std::net::TcpListener,
    shard_aware: Option<std::net::TcpListener>,
}

/// The address `listener` is bound to (port 0 resolved).
fn bound_addr(
    listener: &std::net::TcpListener,
    asked: SocketAddr,
) -> Result<SocketAddr, StartError> {
    listener
        .local_addr()
        .map_err(|e| StartError::AddressInUse(asked, e))
}

/// Takes over a bound std listener on this executor.
fn glommio_listener(listener: std::net::TcpListener) -> TcpListener {
    // SAFETY: the fd is a bound, listening TCP socket this executor now owns alone
    // (`into_raw_fd` gave up the std listener's ownership).
    unsafe { TcpListener::from_raw_fd(listener.into_raw_fd()) }
}

/// Collects every core's report; the first failure stops the others.
/// A core that has not reported after [`EXECUTOR_START_KICK`] may have parked before running its
/// first task (see `sys::eventfd_kick`): every eventfd of the process is woken, again at each
/// such interval, until every core reported or [`EXECUTOR_START_TIMEOUT`] passed.
fn wait_ready(ready: &std::sync::mpsc::Receiver<Ready>, shards: usize) -> Result<(), StartError> {
    use std::sync::mpsc::RecvTimeoutError;
    let deadline = Instant::now() + EXECUTOR_START_TIMEOUT;
    let mut reported = 0;
    while reported < shards {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            request_shutdown();
            return Err(StartError::NotStarted);
        }
        match ready.recv_timeout(left.min(EXECUTOR_START_KICK)) {
            Ok((_, Ok(()))) => reported += 1,
            Ok((_, Err(e))) => {
                request_shutdown();
                return Err(e);
            }
            Err(RecvTimeoutError::Timeout) => {
                let kicked = crate::sys::eventfd_kick::kick_all();
                tracing::warn!(
                    waiting_for = shards - reported,
                    kicked,
                    "executor_start_kick"
                );
            }
            Err(RecvTimeoutError::Disconnected) => {
                request_shutdown();
                return Err(StartError::NotStarted);
            }
        }
    }
    Ok(())
}

/// The life of one executor: install its state, serve until shutdown, then drain. Core 0 gets
/// the listeners and runs the accept loops.
async fn run_core(
    core: usize,
    cfg: Arc<RuntimeConfig>,
    listeners: Option<Listeners>,
    ready: std::sync::mpsc::Sender<Ready>,
) {
    install_core(core, &cfg);
    watch::install(cfg.busy_poll);
    lane::install();
    glommio::spawn_local(mailbox::drain_loop(core)).detach();
    glommio::spawn_local(health::heartbeat_loop(core)).detach();
    glommio::spawn_local(sweep_loop(cfg.sweep_interval)).detach();
    glommio::spawn_local(cap_prebuild_loop()).detach();
    let _ = ready.send((core, Ok(())));
    match listeners {
        Some(Listeners { grpc, shard_aware }) => {
            let shard_aware = shard_aware.map(|l| {
                let l = glommio_listener(l);
                glommio::spawn_local(accept::accept_loop(l, accept::Dealing::SourcePort))
            });
            accept::accept_loop(glommio_listener(grpc), accept::Dealing::RoundRobin).await;
            if let Some(task) = shard_aware {
                task.await;
            }
        }
        None => shutdown_requested().await,
    }
    shutdown::drain_core(accept::live_connections).await;
    shutdown::set_core_finished(core);
}

impl Runtime {
    /// Waits for every executor to finish draining until `deadline`; returns the cores that had
    /// not (a core stuck in one step never reaches its drain, and shutdown must still end within
    /// its bound: the process exits without them).
    /// A core marked stalled (no heartbeat) is not waited for once every other core finished.
    pub fn join_until(self, deadline: Instant) -> Vec<usize> {
        let cores = self.handles.len();
        let waiting_for = |c: usize| !shutdown::core_finished(c) && !health::is_stalled(c);
        while !shutdown::all_cores_finished(cores)
            && (0..cores).any(waiting_for)
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut stuck = Vec::new();
        for (core, h) in self.handles.into_iter().enumerate() {
            if shutdown::core_finished(core) {
                let _ = h.join();
            } else {
                stuck.push(core);
            }
        }
        stuck
    }
}

/// Sweeps this core's partitions every `interval` until shutdown (the reference's ticker).
async fn sweep_loop(interval: Duration) {
    let interval = interval.max(Duration::from_millis(1));
    let mut first = true;
    loop {
        let tick = sleep_unless_shutdown(interval).await;
        if !tick {
            return;
        }
        if std::mem::take(&mut first) {
            inject_sweep_fault();
        }
        if !sweep_pass(interval).await {
            return;
        }
    }
}

/// Waits (bounded by what is left of `budget`) until no ingest is between its apply and its
/// cross-core evictions (evict.rs); those take a few hops, so the wait is short.
async fn wait_sweep_may_run(budget: &mut Duration) {
    const STEP: Duration = Duration::from_micros(200);
    while !evict::sweep_may_run() && !budget.is_zero() {
        glommio::timer::sleep(STEP).await;
        *budget = budget.saturating_sub(STEP);
    }
}

/// Takes the maintenance lane for a sweep slice ([`lane`]): an ingest may have reached its
/// evictions while the slice waited for its turn, so the wait for those is checked again once
/// the lane is taken (an empty turn then).
async fn take_lane_for_sweep(wait_budget: &mut Duration) {
    loop {
        lane::take().await;
        if evict::sweep_may_run() || wait_budget.is_zero() {
            return;
        }
        wait_sweep_may_run(wait_budget).await;
    }
}

/// One TTL sweep pass in slices of at most `SWEEP_SLICE_BUDGET` / `SWEEP_SLICE_MAX_ENTRIES`,
/// pausing on a timer between two so the core serves whatever arrived, each slice in a reactor
/// turn of its own ([`lane`]: a lookup waits behind at most about one slice). No slice runs between an ingest and its cross-core evictions
/// (waiting for that at most `interval` in all per pass, as a whole sweep did). Records the
/// pass's slices, wall time, longest slice (wall) and most CPU time of one slice. Returns false
/// at shutdown (the pass is abandoned; its TTL removals so far stay uncounted).
async fn sweep_pass(interval: Duration) -> bool {
    let mut wait_budget = interval.max(SWEEP_INGEST_WAIT_MIN);
    wait_sweep_may_run(&mut wait_budget).await;
    let (started, started_wall) = (Instant::now(), std::time::SystemTime::now());
    shard::with_core(|st| st.sweep_begin());
    let (mut slices, mut longest, mut longest_cpu) = (0u64, Duration::ZERO, Duration::ZERO);
    loop {
        if slices > 0 {
            let go_on = sleep_unless_shutdown(SWEEP_SLICE_PAUSE).await;
            if !go_on {
                return false;
            }
            wait_sweep_may_run(&mut wait_budget).await;
        }
        take_lane_for_sweep(&mut wait_budget).await;
        let done = timed_slice(Maintenance::Sweep, &mut longest, &mut longest_cpu, || {
            shard::with_core(|st| st.sweep_slice())
        });
        slices += 1;
        if done {
            break;
        }
    }
    let wall = started.elapsed();
    crate::metrics::record_sweep(started_wall, slices, wall, longest, longest_cpu);
    true
}

/// Builds this core's next global-cap candidate heap ahead of need (index eviction docs), so
/// no ingest pays for the O(entries) build: waits until one is wanted (the core's ingests,
/// events, evictions, policy changes and sweep slices wake it; `CAP_PREBUILD_POLL` is only a
/// safety net), then runs it in slices of at most `CAP_BUILD_SLICE_BUDGET` /
/// `CAP_BUILD_SLICE_MAX_ENTRIES`, `SWEEP_SLICE_PAUSE` apart, each in a reactor turn of its own
/// ([`lane`]: a lookup waits behind at most about one slice). A build changes nothing observable, so unlike a sweep slice it may run between
/// an ingest and its cross-core evictions. Records each build completed here (not one an
/// ingest finished, or one dropped by a policy change): its slices and longest slice (wall and
/// thread CPU). Ends at shutdown.
async fn cap_prebuild_loop() {
    loop {
        let go_on = cap_prebuild_wanted_or_shutdown().await;
        if !go_on {
            return;
        }
        if !shard::with_core(|st| st.cap_prebuild_wanted()) {
            continue;
        }
        let (mut slices, mut longest, mut longest_cpu) = (0u64, Duration::ZERO, Duration::ZERO);
        loop {
            if slices > 0 {
                let go_on = sleep_unless_shutdown(SWEEP_SLICE_PAUSE).await;
                if !go_on {
                    return;
                }
            }
            lane::take().await;
            let step = timed_slice(
                Maintenance::CapBuild,
                &mut longest,
                &mut longest_cpu,
                || shard::with_core(|st| st.cap_build_slice()),
            );
            slices += 1;
            if !step.in_progress {
                if step.finished {
                    crate::metrics::record_cap_build(slices, longest, longest_cpu);
                }
                break;
            }
        }
    }
}

/// Waits until this core wants a cap candidate build ahead of need (woken by the operation
/// that made it so), or `CAP_PREBUILD_POLL` passed (a safety net); false at shutdown.
async fn cap_prebuild_wanted_or_shutdown() -> bool {
    let wanted = std::future::poll_fn(|cx| shard::with_core(|st| st.poll_cap_prebuild_wanted(cx)));
    futures_lite::future::or(
        async {
            futures_lite::future::or(wanted, glommio::timer::sleep(CAP_PREBUILD_POLL)).await;
            true
        },
        async {
            shutdown_requested().await;
            false
        },
    )
    .await
}

/// Sleeps `d` on this core's timer; false when shutdown was requested first.
async fn sleep_unless_shutdown(d: Duration) -> bool {
    futures_lite::future::or(
        async {
            glommio::timer::sleep(d).await;
            true
        },
        async {
            shutdown_requested().await;
            false
        },
    )
    .await
}

/// Runs one maintenance slice of `kind`: records its wall and thread-CPU time, and keeps the
/// pass's longest of each.
fn timed_slice<T>(
    kind: Maintenance,
    longest: &mut Duration,
    longest_cpu: &mut Duration,
    slice: impl FnOnce() -> T,
) -> T {
    let (t, cpu) = (Instant::now(), thread_cpu_time());
    let out = slice();
    let wall = t.elapsed();
    let cpu = match (cpu, thread_cpu_time()) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    *longest = (*longest).max(wall);
    *longest_cpu = (*longest_cpu).max(cpu.unwrap_or_default());
    crate::metrics::record_maintenance_slice(kind, wall, cpu);
    let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    inferencecache_maintenance_slice_done(kind as u32, nanos(wall), cpu.map_or(u64::MAX, nanos));
    out
}

/// A probe point for `perf/sweep_stall.sh TRACE=1`: a uprobe here reads the slice's kind, wall
/// and thread-CPU nanoseconds (`u64::MAX`: unknown) from the first three argument registers
/// (`extern "C"`), so a trace can tell the host descheduling the vCPU inside a slice (wall time
/// the thread was not charged) from the slice's own work. Out of line and unmangled so the
/// probe can find it; it does nothing, once per slice.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn inferencecache_maintenance_slice_done(kind: u32, wall_ns: u64, cpu_ns: u64) {
    std::hint::black_box((kind, wall_ns, cpu_ns));
}

/// Applies `sys::test_hooks::sweep_fault` to this core (tests of the fault paths only).
fn inject_sweep_fault() {
    use crate::sys::test_hooks::{SweepFault, sweep_fault};
    let core = shard::current_core().expect("on a core");
    match sweep_fault(core) {
        Some(SweepFault::Panic) => panic!("INFERENCECACHE_TEST_SWEEP_FAULT: panic on core {core}"),
        Some(SweepFault::Stall(d)) => std::thread::sleep(d),
        None => {}
    }
}

#[cfg(test)]
mod preempt_tests {
    use std::time::{Duration, Instant};

    use super::core_executor;
    use crate::limits::CORE_PREEMPT_TIMER;

    /// A core polls its I/O (and timers) while a task stays runnable: a 5 ms timer fires
    /// within a few preemption periods of its time while another task wakes itself in a loop
    /// (a busy gRPC connection). With glommio's default timer it fired about 100 ms late.
    #[test]
    fn a_core_polls_io_while_a_task_stays_runnable() {
        let cpu = crate::sys::cpus::allowed_cpus()[0];
        let late = core_executor(cpu, 0)
            .spawn(|| async move {
                let stop = std::rc::Rc::new(std::cell::Cell::new(false));
                let spinning = stop.clone();
                let busy = glommio::spawn_local(async move {
                    let until = Instant::now() + Duration::from_millis(500);
                    while !spinning.get() && Instant::now() < until {
                        futures_lite::future::yield_now().await;
                    }
                })
                .detach();
                let start = Instant::now();
                glommio::timer::sleep(Duration::from_millis(5)).await;
                let late = start.elapsed().saturating_sub(Duration::from_millis(5));
                stop.set(true);
                busy.await;
                late
            })
            .expect("executor")
            .join()
            .expect("joined");
        assert!(
            late < 20 * CORE_PREEMPT_TIMER,
            "the timer fired {late:?} late behind a task that stayed runnable"
        );
    }
}
