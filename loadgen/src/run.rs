//! Orchestration of one measurement window and of the three subcommands: connect, optionally
//! preload, start producers, drive gateways (open or closed loop) with a live progress line,
//! stop everything within bounded time, and build the report.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

use crate::capacity::{Measurement, Outcome, Search};
use crate::cli::{
    self, CapacityArgs, ConnArgs, LookupClient, MeasureArgs, OutputFormat, PreloadArgs,
    ProducerArgs, RunArgs,
};
use crate::driver::{self, Bounds, DriveStats, Ticket};
use crate::error::{ConfigError, Error};
use crate::gateway::{self, LookupInput, LookupVia};
use crate::histogram::{Recorder, Rpc, quantile_ms};
use crate::producer::{IngestStats, ProducerConfig, Producers};
use crate::report::{Report, RunFacts};
use crate::slowlog::SlowLog;
use crate::workload::{Generator, Names, WorkloadConfig};
use inferencecache_gateway::{LookupConnection, ShardAwareClient};

/// The client type every module uses.
pub type Client = InferenceCacheClient<Channel>;

/// Normalises `--addr`: a bare `host:port` gets `http://`.
pub fn normalize_addr(addr: &str) -> String {
    if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    }
}

/// Opens `n` HTTP/2 connections to `addr` (each fails after 5 s); only ever this address.
pub async fn connect(addr: &str, n: u32) -> Result<Vec<Client>, Error> {
    let addr = normalize_addr(addr);
    let ep = Endpoint::from_shared(addr.clone())
        .map_err(|source| Error::InvalidAddr {
            addr: addr.clone(),
            source,
        })?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_while_idle(true);
    let mut out = Vec::new();
    for _ in 0..n.max(1) {
        let ch = ep.connect().await.map_err(|source| Error::Connect {
            addr: addr.clone(),
            source,
        })?;
        out.push(InferenceCacheClient::new(ch).max_decoding_message_size(64 << 20));
    }
    Ok(out)
}

/// Opens `n` lean LookupRoute connections to `addr` (`http://host:port`; each fails after 5 s).
pub async fn connect_lean(addr: &str, n: u32) -> Result<Vec<LookupConnection>, Error> {
    let addr = normalize_addr(addr);
    let lean_error = |source| Error::LeanConnect {
        addr: addr.clone(),
        source,
    };
    let authority = match addr.strip_prefix("http://") {
        Some(rest) => rest.trim_end_matches('/'),
        None => {
            return Err(lean_error(tonic::Status::invalid_argument(
                "the lean lookup client speaks plain http:// only; use --lookup-client tonic",
            )));
        }
    };
    let mut out = Vec::new();
    for _ in 0..n.max(1) {
        let conn = LookupConnection::plain(authority).map_err(lean_error)?;
        conn.connect(Duration::from_secs(5))
            .await
            .map_err(lean_error)?;
        out.push(conn);
    }
    Ok(out)
}

/// Stop flag set by Ctrl-C, so an interrupted run still prints its report.
pub fn ctrl_c_flag() -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("interrupted: finishing the current window");
            s.store(true, Ordering::Relaxed);
        }
    });
    stop
}

/// Ingests the workload's initial population through `producers` and waits until the server
/// acknowledged all of it. `wgen` is advanced to the post-preload state (chat conversations
/// already some turns in) even when nothing is sent, so runs with and without preload replay the
/// same request sequence.
pub async fn preload(
    producers: &Producers,
    wgen: &mut Generator,
    send: bool,
) -> Option<IngestStats> {
    let ops = wgen.preload_ops();
    if !send {
        return None;
    }
    for (replica, op) in ops {
        producers.store(replica, op).await;
    }
    Some(producers.sync(Arc::new(Recorder::new(&[]))).await)
}

/// Load shape of one window.
#[derive(Clone, Copy, Debug)]
pub enum Load {
    /// Fixed arrival rate (req/s).
    Open(f64),
    /// Fixed concurrency.
    Closed(u32),
}

/// Everything one measurement window needs.
#[derive(Clone, Debug)]
pub struct WindowConfig {
    /// Server address (for the report).
    pub target: String,
    /// Load shape.
    pub load: Load,
    /// Stop conditions.
    pub bounds: Bounds,
    /// Lookup input kind.
    pub input: LookupInput,
    /// `pd_topology_ref` of LookupPDRoute calls (`LookupInput::Pd`).
    pub pd_topology: String,
    /// Budgets counted.
    pub budgets: Vec<Duration>,
    /// Unary deadline.
    pub rpc_timeout: Duration,
    /// Open-loop in-flight cap.
    pub max_inflight: usize,
    /// Producer config, for the report (None = no producers during the window).
    pub producer: Option<ProducerConfig>,
    /// Print a progress line every second.
    pub progress: bool,
    /// Lookups over one connection per server core, each to the owning core (`--shard-aware-addr`).
    pub shard_aware: Option<ShardAwareClient>,
    /// `--slow-log` and its threshold (`run` only).
    pub slow_log: Option<(PathBuf, Duration)>,
    /// `--lookup-client lean`: the lean connections LookupRoute calls go over (round-robin, or
    /// the shard-aware client's own when `shard_aware` is set). Empty: tonic's clients.
    pub lean: Vec<LookupConnection>,
    /// `--busy-poll`: a task keeps the runtime polling its sockets while the window runs.
    pub busy_poll: bool,
}

/// A task that only yields, for as long as the window runs (it is aborted at the window's end).
/// A yielded task is ready again at once, so the worker running it never parks in
/// `epoll_wait`: it polls the sockets without a timeout between turns, and an answer is read
/// without a wake-up.
fn spawn_busy_poll() -> tokio::task::JoinHandle<()> {
    tokio::spawn(async {
        loop {
            tokio::task::yield_now().await;
        }
    })
}

/// Runs one window of lookups and returns its report. With `producers`, every looked-up prompt
/// is then "executed" on its replica (its blocks stored and reported), and the window ends with
/// a producer barrier so its ingest counters and latencies are complete.
pub async fn run_window(
    clients: &[Client],
    wgen: Generator,
    cfg: &WindowConfig,
    producers: Option<Arc<Producers>>,
    preload: Option<IngestStats>,
    stop: Arc<AtomicBool>,
) -> Report {
    let wl: WorkloadConfig = wgen.config().clone();
    let mut rec = Recorder::new(&cfg.budgets);
    if let Some((_, threshold)) = &cfg.slow_log {
        rec = rec.with_slow_log(SlowLog::new(*threshold));
    }
    let rec = Arc::new(rec);
    if let Some(p) = &producers {
        // Start this window's accounting: earlier background activity is not counted.
        p.sync(rec.clone()).await;
    }
    let mut maker = LookupMaker::new(clients, wgen, cfg, &rec, &producers);
    let mut make = move |t: Ticket| maker.make(t);
    let progress = cfg.progress.then(|| spawn_progress(rec.clone(), cfg.load));
    let busy_poll = cfg.busy_poll.then(spawn_busy_poll);
    let drain = cfg.rpc_timeout + Duration::from_secs(1);
    let stats: DriveStats = match cfg.load {
        Load::Open(rate) => {
            let lag_rec = rec.clone();
            let make = move |t: Ticket| {
                lag_rec.record_send_lag(t.intended.elapsed());
                make(t)
            };
            driver::open_loop(rate, cfg.bounds, cfg.max_inflight, drain, stop, make).await
        }
        Load::Closed(c) => driver::closed_loop(c as usize, cfg.bounds, stop, make).await,
    };
    if let Some(p) = progress {
        p.abort();
    }
    if let Some(b) = busy_poll {
        b.abort();
    }
    let ingest = match &producers {
        Some(p) => Some(p.sync(Arc::new(Recorder::new(&[]))).await),
        None => None,
    };
    let facts = RunFacts {
        target: cfg.target.clone(),
        rate: match cfg.load {
            Load::Open(r) => Some(r),
            Load::Closed(_) => None,
        },
        concurrency: match cfg.load {
            Load::Closed(c) => Some(c),
            Load::Open(_) => None,
        },
        connections: clients.len() as u32,
        lookup_input: format!("{:?}", cfg.input).to_lowercase(),
        workload: wl,
        producer: cfg.producer.clone(),
        elapsed_s: stats.elapsed.as_secs_f64(),
        started: stats.started,
        abandoned: stats.abandoned,
        ingest,
        preload,
    };
    if let (Some((path, _)), Some(log)) = (&cfg.slow_log, rec.slow_log())
        && let Err(e) = log.write(path)
    {
        eprintln!("loadgen: cannot write --slow-log {}: {e}", path.display());
    }
    Report::build(&rec.snapshot(), facts)
}

/// The driver's request factory: each ticket draws the workload's next request, sends it as a
/// `LookupRoute` on a round-robin connection and, with producers, stores the prompt's blocks on
/// its replica afterwards.
struct LookupMaker {
    wgen: Generator,
    names: Arc<Names>,
    clients: Arc<Vec<Client>>,
    rec: Arc<Recorder>,
    producers: Option<Arc<Producers>>,
    scheme: String,
    block_size: u32,
    input: LookupInput,
    pd_topology: Arc<str>,
    timeout: Duration,
    shard_aware: Option<ShardAwareClient>,
    lean: Arc<Vec<LookupConnection>>,
    /// Where each call's clock starts ([`clock_start`]).
    load: Load,
}

impl LookupMaker {
    fn new(
        clients: &[Client],
        wgen: Generator,
        cfg: &WindowConfig,
        rec: &Arc<Recorder>,
        producers: &Option<Arc<Producers>>,
    ) -> Self {
        let wl = wgen.config();
        LookupMaker {
            names: Arc::new(Names::new(wl)),
            scheme: wl.hash_scheme.clone(),
            block_size: wl.block_size,
            clients: Arc::new(clients.to_vec()),
            rec: rec.clone(),
            producers: producers.clone(),
            input: cfg.input,
            pd_topology: cfg.pd_topology.as_str().into(),
            timeout: cfg.rpc_timeout,
            shard_aware: cfg.shard_aware.clone(),
            lean: Arc::new(cfg.lean.clone()),
            load: cfg.load,
            wgen,
        }
    }

    /// The connection ticket `t`'s `LookupRoute` for `(tenant, model)` goes over.
    fn via(&self, t: Ticket, tenant: &str, model: &str) -> LookupVia {
        match (&self.shard_aware, self.lean.is_empty()) {
            (Some(sdk), false) => LookupVia::Lean(sdk.lookup_connection_for(tenant, model).clone()),
            (None, false) => LookupVia::Lean(self.lean[round_robin(t, self.lean.len())].clone()),
            (_, true) => self.tonic_via(t, tenant, model),
        }
    }

    /// Ticket `t`'s tonic client: the owning core's with the SDK, else round-robin.
    fn tonic_via(&self, t: Ticket, tenant: &str, model: &str) -> LookupVia {
        match &self.shard_aware {
            Some(sdk) => LookupVia::Tonic(sdk.client_for(tenant, model)),
            None => LookupVia::Tonic(self.clients[round_robin(t, self.clients.len())].clone()),
        }
    }

    /// The lookup (and store) of ticket `t`.
    fn make(&mut self, t: Ticket) -> impl Future<Output = ()> + Send + use<> {
        let bs = self.block_size;
        let spec = self.wgen.next_request();
        let req = gateway::lookup_request(&spec, &self.names, &self.scheme, bs, self.input);
        let pd = (self.input == LookupInput::Pd).then(|| self.pd_topology.clone());
        // LookupPDRoute has no lean path.
        let via = match pd {
            None => self.via(t, &req.tenant_id, &req.model_id),
            Some(_) => self.tonic_via(t, &req.tenant_id, &req.model_id),
        };
        let (rec, producers) = (self.rec.clone(), self.producers.clone());
        let prompt_tokens = (spec.n_blocks as u64) * bs as u64;
        let timeout = self.timeout;
        let load = self.load;
        async move {
            let t = Ticket {
                intended: clock_start(load, t),
                ..t
            };
            match (pd, via) {
                (Some(topology), LookupVia::Tonic(client)) => {
                    let req = gateway::pd_request(req, &topology);
                    gateway::lookup_pd(client, req, prompt_tokens, timeout, t.intended, &rec).await;
                }
                (_, via) => {
                    gateway::lookup(via, req, prompt_tokens, timeout, t.intended, &rec).await;
                }
            }
            // The prompt now "executes" on its replica, which caches its blocks.
            if let Some(p) = &producers {
                p.try_store(spec.replica, spec.store_op());
            }
        }
    }
}

/// When the latency of ticket `t`'s call starts, read as the call is sent. Open loop: the
/// ticket's due time (a late send is charged to the call). Closed loop: now, after the request
/// was generated; latency there is service time, and hashing a prompt's blocks is the client's
/// work, not the server's.
fn clock_start(load: Load, t: Ticket) -> Instant {
    match load {
        Load::Open(_) => t.intended,
        Load::Closed(_) => Instant::now(),
    }
}

/// Ticket `t`'s slot among `n` connections.
fn round_robin(t: Ticket, n: usize) -> usize {
    (t.index % n as u64) as usize
}

/// Prints one line per second on stderr: cumulative counts and this second's rate and
/// latencies.
fn spawn_progress(rec: Arc<Recorder>, load: Load) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let start = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.tick().await;
        let mut last_done = 0;
        // Bounded: the task is aborted at the end of the window; the cap is a safety net.
        for _ in 0..86_400 {
            tick.tick().await;
            let (ok, err) = rec.counts(Rpc::LookupRoute);
            let h = rec.take_interval();
            let pm = rec.reason_count("PREFIX_MATCH");
            let target = match load {
                Load::Open(r) => format!("target {r:.0}/s"),
                Load::Closed(c) => format!("concurrency {c}"),
            };
            eprintln!(
                "[{:>5.0}s] {target} lookups ok {ok} err {err} | {:.0}/s p50 {:.3} ms p99 {:.3} ms max {:.3} ms | PREFIX_MATCH {:.1}%",
                start.elapsed().as_secs_f64(),
                (ok + err - last_done) as f64,
                quantile_ms(&h, 0.5),
                quantile_ms(&h, 0.99),
                if h.is_empty() {
                    0.0
                } else {
                    h.max() as f64 / 1000.0
                },
                if ok == 0 {
                    0.0
                } else {
                    100.0 * pm as f64 / ok as f64
                },
            );
            last_done = ok + err;
        }
    })
}

fn write_json(path: &std::path::Path, body: &str) -> Result<(), Error> {
    std::fs::write(path, body).map_err(|source| Error::WriteReport {
        path: path.to_path_buf(),
        source,
    })
}

/// Writes the JSON report to `--json` if given, then prints the report in `--output` format.
pub(crate) fn emit(
    measure: &MeasureArgs,
    json: &str,
    table: impl FnOnce() -> String,
) -> Result<(), Error> {
    if let Some(p) = &measure.json {
        write_json(p, json)?;
    }
    match measure.output {
        OutputFormat::Table => print!("{}", table()),
        OutputFormat::Json => println!("{json}"),
    }
    Ok(())
}

/// What `run` and `capacity` hold once connected: validated settings, the connections, the
/// producers (started, population preloaded unless `--no-preload`) and the workload generator
/// in its post-preload state.
struct Setup {
    wl: WorkloadConfig,
    rpc_timeout: Duration,
    pcfg: ProducerConfig,
    budgets: Vec<Duration>,
    clients: Vec<Client>,
    shard_aware: Option<ShardAwareClient>,
    lean: Vec<LookupConnection>,
    stop: Arc<AtomicBool>,
    producers: Arc<Producers>,
    wgen: Generator,
    preload: Option<IngestStats>,
}

impl Setup {
    /// Validates the producer and measurement flags, connects, starts the producers and
    /// preloads.
    async fn start(
        conn: &ConnArgs,
        producer: &ProducerArgs,
        measure: &MeasureArgs,
        wl: WorkloadConfig,
    ) -> Result<Setup, Error> {
        let rpc_timeout = Duration::from_millis(conn.rpc_timeout_ms.max(1));
        let pcfg = producer.config(wl.seed, rpc_timeout)?;
        let budgets = measure.budgets()?;
        let clients = connect(&conn.addr, conn.connections).await?;
        let shard_aware = match conn.shard_aware_addr {
            Some(addr) => Some(
                ShardAwareClient::connect(addr)
                    .await
                    .map_err(Error::ShardAware)?,
            ),
            None => None,
        };
        let lean = match (conn.lookup_client, shard_aware.is_some()) {
            (LookupClient::Lean, false) => connect_lean(&conn.addr, conn.connections).await?,
            // The shard-aware client has its own lean connection per core.
            (LookupClient::Lean, true) => vec![],
            (LookupClient::Tonic, _) => vec![],
        };
        let stop = ctrl_c_flag();
        let producers = Arc::new(Producers::start(
            &wl,
            &pcfg,
            &clients,
            Arc::new(Recorder::new(&[])),
        ));
        let mut wgen = Generator::new(wl.clone());
        let preload = preload(&producers, &mut wgen, !measure.no_preload).await;
        Ok(Setup {
            wl,
            rpc_timeout,
            pcfg,
            budgets,
            clients,
            shard_aware,
            lean,
            stop,
            producers,
            wgen,
            preload,
        })
    }
}

/// The load shape of `--rate` / `--concurrency`.
fn load_of(rate: Option<f64>, concurrency: Option<u32>) -> Result<Load, ConfigError> {
    match (rate, concurrency) {
        (Some(r), _) if r.is_finite() && r > 0.0 => Ok(Load::Open(r)),
        (Some(_), _) => Err(ConfigError::NotPositive("--rate")),
        (None, Some(c)) if c > 0 => Ok(Load::Closed(c)),
        (None, Some(_)) => Err(ConfigError::NotPositive("--concurrency")),
        (None, None) => Err(ConfigError::Rule(
            "give --rate (open loop) or --concurrency (closed loop)",
        )),
    }
}

/// `loadgen run`.
pub async fn cmd_run(a: RunArgs) -> Result<Option<Report>, Error> {
    if let cli::WorkloadChoice::Trace(path) = &a.workload.workload {
        let path = path.clone();
        crate::trace::cmd_trace(&a, &path).await?;
        return Ok(None);
    }
    let wl = a.workload.config()?;
    let bounds = cli::bounds(a.requests, a.duration)?;
    let load = load_of(a.rate, a.concurrency)?;
    let s = Setup::start(&a.conn, &a.producer, &a.measure, wl).await?;
    let window_producers = (!a.measure.no_producers).then(|| s.producers.clone());
    let cfg = WindowConfig {
        target: normalize_addr(&a.conn.addr),
        load,
        bounds,
        input: a.measure.lookup_input,
        pd_topology: a.measure.pd_topology.clone(),
        budgets: s.budgets,
        rpc_timeout: s.rpc_timeout,
        max_inflight: a.measure.max_inflight,
        producer: (!a.measure.no_producers).then_some(s.pcfg),
        progress: !a.measure.quiet,
        shard_aware: s.shard_aware.clone(),
        lean: s.lean.clone(),
        busy_poll: a.measure.busy_poll,
        slow_log: match &a.measure.slow_log {
            Some(path) => Some((path.clone(), a.measure.slow_threshold()?)),
            None => None,
        },
    };
    let report = run_window(
        &s.clients,
        s.wgen,
        &cfg,
        window_producers,
        s.preload,
        s.stop,
    )
    .await;
    s.producers.finish().await;
    emit(&a.measure, &report.to_json(), || report.to_table())?;
    Ok(Some(report))
}

/// `loadgen capacity`.
pub async fn cmd_capacity(a: CapacityArgs) -> Result<Outcome, Error> {
    let wl = a.workload.config()?;
    let scfg = a.search()?;
    let s = Setup::start(&a.conn, &a.producer, &a.measure, wl).await?;
    let mut search = Search::new(scfg);
    eprintln!(
        "capacity search: p99 <= {} ms, error rate <= {}, {} s per step",
        a.p99_budget_ms, a.max_error_rate, a.step_duration
    );
    let reports = run_capacity_steps(&a, &s, &mut search).await;
    s.producers.finish().await;
    let outcome = search.outcome();
    let json = serde_json::to_string_pretty(&serde_json::json!({
        "tool": "loadgen",
        "version": env!("CARGO_PKG_VERSION"),
        "target": normalize_addr(&a.conn.addr),
        "criteria": search.config(),
        "preload": s.preload,
        "result": outcome,
        "step_reports": reports,
    }))
    .expect("capacity JSON is serializable");
    emit(&a.measure, &json, || {
        capacity_table(&outcome, a.p99_budget_ms)
    })?;
    Ok(outcome)
}

/// Runs the search's steps, one open-loop window each, until it stops or Ctrl-C; prints a line
/// per step on stderr and returns the steps' reports.
async fn run_capacity_steps(a: &CapacityArgs, s: &Setup, search: &mut Search) -> Vec<Report> {
    let window_producers = (!a.measure.no_producers).then(|| s.producers.clone());
    let mut reports = Vec::new();
    while let Some(rate) = search.next_rate() {
        if s.stop.load(Ordering::Relaxed) {
            break;
        }
        // Every step replays the same seeded sequence from the post-preload state.
        let mut g = Generator::new(s.wl.clone());
        g.preload_ops();
        let cfg = capacity_step_config(a, s, rate);
        let r = run_window(
            &s.clients,
            g,
            &cfg,
            window_producers.clone(),
            None,
            s.stop.clone(),
        )
        .await;
        let l = &r.rpcs[Rpc::LookupRoute.name()];
        let m = Measurement {
            achieved_rate: r.achieved_rate,
            p99_ms: l.p99_ms,
            error_rate: r.lookup_error_rate(),
        };
        let step = search.observe(rate, m);
        eprintln!(
            "step {:>2}: rate {:>10.1} req/s → achieved {:>10.1}, p99 {:>9.3} ms, errors {:.4}  {}{}",
            reports.len() + 1,
            rate,
            m.achieved_rate,
            m.p99_ms,
            m.error_rate,
            if step.pass { "PASS" } else { "FAIL: " },
            step.reason
        );
        reports.push(r);
    }
    reports
}

/// The window of one capacity step: open loop at `rate` for `--step-duration` seconds.
fn capacity_step_config(a: &CapacityArgs, s: &Setup, rate: f64) -> WindowConfig {
    WindowConfig {
        target: normalize_addr(&a.conn.addr),
        load: Load::Open(rate),
        bounds: Bounds {
            requests: Some((rate * a.step_duration).ceil().max(1.0) as u64),
            duration: Some(Duration::from_secs_f64(a.step_duration)),
        },
        input: a.measure.lookup_input,
        pd_topology: a.measure.pd_topology.clone(),
        budgets: s.budgets.clone(),
        rpc_timeout: s.rpc_timeout,
        max_inflight: a.measure.max_inflight,
        producer: (!a.measure.no_producers).then(|| s.pcfg.clone()),
        progress: !a.measure.quiet,
        shard_aware: s.shard_aware.clone(),
        lean: s.lean.clone(),
        busy_poll: a.measure.busy_poll,
        slow_log: None,
    }
}

/// The human summary of a capacity search: one row per step, then the answer.
fn capacity_table(outcome: &Outcome, p99_budget_ms: f64) -> String {
    let mut table =
        String::from("\nstep  target req/s  achieved req/s   p99 ms    err rate  verdict\n");
    for (i, s) in outcome.steps.iter().enumerate() {
        table.push_str(&format!(
            "{:>4}  {:>12.1}  {:>14.1}  {:>8.3}  {:>9.5}  {}\n",
            i + 1,
            s.rate,
            s.measured.achieved_rate,
            s.measured.p99_ms,
            s.measured.error_rate,
            if s.pass {
                "PASS".to_string()
            } else {
                format!("FAIL ({})", s.reason)
            }
        ));
    }
    match outcome.capacity_rate {
        Some(r) => table.push_str(&format!(
            "capacity: {r:.1} req/s with LookupRoute p99 <= {} ms ({})\n",
            p99_budget_ms, outcome.stopped
        )),
        None => table.push_str(&format!("capacity: no rate passed ({})\n", outcome.stopped)),
    }
    table
}

/// `loadgen preload`.
pub async fn cmd_preload(a: PreloadArgs) -> Result<IngestStats, Error> {
    let wl = a.workload.config()?;
    let rpc_timeout = Duration::from_millis(a.conn.rpc_timeout_ms.max(1));
    let pcfg = a.producer.config(wl.seed, rpc_timeout)?;
    let clients = connect(&a.conn.addr, a.conn.connections).await?;
    // Exactly the population: no churn, no stats.
    let pcfg = ProducerConfig {
        churn_per_sec: 0.0,
        stats_interval: None,
        ..pcfg
    };
    let producers = Producers::start(&wl, &pcfg, &clients, Arc::new(Recorder::new(&[])));
    let mut wgen = Generator::new(wl);
    let t0 = Instant::now();
    let stats = preload(&producers, &mut wgen, true)
        .await
        .unwrap_or_default();
    producers.finish().await;
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "preloaded {} prefixes in {} messages on {} streams ({} stream errors) in {:.2} s ({:.0} prefixes/s)",
        stats.prefixes_reported,
        stats.messages,
        stats.streams_opened,
        stats.stream_errors,
        secs,
        stats.prefixes_reported as f64 / secs.max(1e-9)
    );
    if let Some(p) = &a.json {
        let body = serde_json::to_string_pretty(&serde_json::json!({
            "tool": "loadgen",
            "target": normalize_addr(&a.conn.addr),
            "elapsed_s": secs,
            "preload": stats,
        }))
        .expect("preload JSON is serializable");
        write_json(p, &body)?;
    }
    if stats.stream_errors > 0 {
        return Err(Error::StreamsFailed(stats.stream_errors));
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_loop_latency_starts_at_send_and_open_loop_at_the_due_time() {
        let due = Instant::now() - Duration::from_millis(50);
        let t = Ticket {
            index: 0,
            intended: due,
        };
        assert_eq!(clock_start(Load::Open(100.0), t), due);
        // Time spent generating the request (here 50 ms) is not the server's.
        assert!(clock_start(Load::Closed(1), t) >= due + Duration::from_millis(50));
    }
}
