//! Start-up and shutdown, in the reference's order (docs/BEHAVIOUR.md §1.2): validate flags
//! (exit 2), open every listener up front (exit 1 on failure), start the per-core runtime, mark
//! ready, then serve until SIGTERM/SIGINT, which drains in-flight calls and exits 0.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use inferencecache_index::directory::Directory;
use inferencecache_index::index::IndexConfig;

use crate::admin::{self, auth};
use crate::cli::{self, Cli};
use crate::limits::{DRAIN_TIMEOUT, HTTP_SHUTDOWN_BUDGET, MAX_STRINGS, SNAPSHOT_SHUTDOWN_BUDGET};
use crate::lookup::LookupConfig;
use crate::runtime::{self, Runtime, RuntimeConfig, admin_thread};
use crate::shard::{self, CoreState};
use crate::{feeds, grpc, logging, metrics, nats, producer, snapshot, tokenizer};

/// Why the server did not start; each maps to the reference's exit code.
#[derive(Debug)]
pub enum StartupError {
    /// Bad flags: printed to stderr, exit 2.
    Usage(String),
    /// A resource could not be opened: logged as `event`, exit 1.
    Fatal {
        /// The log event name.
        event: &'static str,
        /// What failed.
        error: String,
    },
}

impl StartupError {
    fn usage(e: impl std::fmt::Display) -> Self {
        Self::Usage(e.to_string())
    }

    fn fatal(event: &'static str, e: impl std::fmt::Display) -> Self {
        Self::Fatal {
            event,
            error: e.to_string(),
        }
    }

    /// Reports the error and returns the process exit code.
    fn report(self) -> i32 {
        match self {
            Self::Usage(msg) => {
                eprintln!("{msg}");
                2
            }
            Self::Fatal { event, error } => {
                tracing::error!(error = %error, "{event}");
                1
            }
        }
    }
}

/// A panic anywhere but on a thread that contains panics by design (the tokenizer workers)
/// aborts the whole process after the panic message is printed: a core that died alone would
/// leave a half-dead server whose queued requests never complete, while an abort lets the
/// orchestrator restart it.
fn abort_on_panic() {
    let print = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        print(info);
        if !tokenizer::contains_panics_on_this_thread() {
            std::process::abort();
        }
    }));
}

/// Runs the server; returns the process exit code.
pub fn run() -> i32 {
    abort_on_panic();
    let cli = match Cli::try_parse_from(cli::normalize_args(std::env::args())) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    match start(&cli) {
        Ok(server) => server.serve_until_signal(),
        Err(e) => e.report(),
    }
}

/// The effective settings derived from the flags.
struct Settings {
    shards: usize,
    grpc_tls: bool,
    /// TLS and credentials of the event log's NATS connection (password read once, here).
    nats_auth: nats::NatsAuth,
}

/// Checks every flag before anything starts, then installs logging.
fn validate(cli: &Cli) -> Result<Settings, StartupError> {
    let json = logging::parse_format(&cli.log_format).map_err(StartupError::usage)?;
    let level = logging::parse_level(&cli.log_level).map_err(StartupError::usage)?;
    cli::validate_auth(cli).map_err(StartupError::usage)?;
    cli::validate_tls(cli).map_err(StartupError::usage)?;
    cli::validate_producer(cli).map_err(StartupError::usage)?;
    cli::validate_snapshots(cli).map_err(StartupError::usage)?;
    let cpus = available_cpus();
    let shards = cli::shards(cli, cpus).map_err(StartupError::usage)?;
    if !cli.nats_url.is_empty() {
        nats::parse_urls(&cli.nats_url).map_err(StartupError::usage)?;
    }
    let nats_flags = nats::AuthFlags {
        url: &cli.nats_url,
        ca_file: &cli.nats_ca_file,
        client_cert_file: &cli.nats_client_cert_file,
        client_key_file: &cli.nats_client_key_file,
        creds_file: &cli.nats_creds_file,
        user: &cli.nats_user,
        password_file: &cli.nats_password_file,
    };
    let nats_auth = nats::NatsAuth::from_flags(nats_flags, std::env::var(nats::PASSWORD_ENV).ok())
        .map_err(StartupError::usage)?;
    cli::busy_poll(cli, shards, cpus).map_err(StartupError::usage)?;
    logging::init(json, level, asks_port_zero(cli));
    Ok(Settings {
        shards,
        grpc_tls: !cli.tls_cert_file.is_empty(),
        nats_auth,
    })
}

/// A started server: the runtime serving gRPC, the admin thread serving HTTP, the snapshot
/// thread with `--state-dir`.
struct Server {
    runtime: Runtime,
    admin: tokio::runtime::Handle,
    snapshots: Option<snapshot::Writer>,
}

fn start(cli: &Cli) -> Result<Server, StartupError> {
    let settings = validate(cli)?;
    load_tokenizers(cli, settings.shards);
    // Its threads start before the cores take their CPUs (and not on a serving core later).
    runtime::decode_pool::start(settings.shards);
    let controller_auth = auth::setup(&auth_flags(cli))
        .map_err(|e| StartupError::fatal("controller_auth_setup", e))?;
    if settings.grpc_tls {
        grpc::tls::install(&cli.tls_cert_file, &cli.tls_key_file, &cli.client_ca_file)
            .map_err(|e| StartupError::fatal("grpc_tls_load", e))?;
    }
    configure_producers(cli)?;
    if cli.nats_log_writer {
        // Before serving: no ingest call is applied here directly, only from the log.
        nats::writer::enable();
    }
    metrics::set_grpc_tls_enabled(settings.grpc_tls);
    feeds::configure(cli.max_event_subscribers, cli.max_metric_subscribers);
    feeds::metrics::set_scraper(|| Box::pin(admin::render_metrics()));
    let admin = admin_thread::start();
    if let Some(policy) = producer::watched_policy() {
        admin.spawn(async move {
            loop {
                tokio::time::sleep(crate::limits::PRODUCER_POLICY_POLL_INTERVAL).await;
                policy.poll();
            }
        });
    }
    let (http_listener, snapshot_listener) = bind_http(cli, &admin)?;
    let http_addr = addr_of(&http_listener);
    tracing::info!(
        target: logging::LISTENING,
        http_addr = %http_addr,
        snapshot_addr = %addr_of(&snapshot_listener),
        "listening_http"
    );
    // /healthz and /readyz answer from here on: /readyz is 503 until the restore is done and
    // every core serves.
    admin.spawn(admin::http::serve(http_listener, admin::public));
    let snapshot::Restored {
        states,
        next_generation,
        stream_sequence,
    } = initial_states(cli, settings.shards)?;
    let runtime = start_runtime(cli, settings.shards, states)?;
    tracing::info!(
        target: logging::LISTENING,
        grpc_addr = %runtime.listen_addr,
        shard_aware_grpc_addr = %runtime.shard_aware_addr.map(|a| a.to_string()).unwrap_or_default(),
        "listening_grpc"
    );
    if !cli.nats_url.is_empty() {
        // After the runtime: the consumer applies through the cores' mailboxes.
        nats::spawn(
            &admin,
            nats::NatsConfig {
                url: cli.nats_url.clone(),
                stream: cli.nats_stream.clone(),
                subject: cli.nats_subject.clone(),
                // What the restored snapshot includes is not replayed.
                start_sequence: stream_sequence + 1,
                ready_max_lag: cli.nats_ready_max_lag,
                auth: settings.nats_auth.clone(),
            },
        );
    }
    admin::set_ready(true);
    metrics::set_server_up(true);
    log_startup(
        &runtime,
        &http_addr,
        &addr_of(&snapshot_listener),
        &settings,
    );
    admin.spawn(runtime::health::watchdog());
    let snapshots = (!cli.state_dir.is_empty()).then(|| {
        snapshot::start_writer(
            cli.state_dir.clone().into(),
            settings.shards,
            Duration::from_millis(cli.snapshot_interval_ms),
            admin.clone(),
            next_generation,
        )
    });
    let controller = Arc::new(admin::Controller {
        auth: controller_auth,
        engine_block_size: cli::engine_block_size(cli),
    });
    admin.spawn(admin::http::serve(snapshot_listener, controller.handler()));
    Ok(Server {
        runtime,
        admin,
        snapshots,
    })
}

fn addr_of(l: &tokio::net::TcpListener) -> String {
    l.local_addr().map(|a| a.to_string()).unwrap_or_default()
}

/// The index configuration every core starts from (each core's state gets its id; all share
/// one directory).
fn index_config(cli: &Cli, shards: usize) -> IndexConfig {
    IndexConfig {
        max_entries: cli.index_max_entries,
        max_future_skew_ns: (cli.max_timestamp_skew_ms.min(i64::MAX as u64 / 1_000_000) * 1_000_000)
            as i64,
        directory: Arc::new(Directory::default()),
        max_strings: cli.index_max_strings.unwrap_or(MAX_STRINGS),
        max_string_bytes: cli.index_max_string_bytes,
        max_holders_per_key: cli.index_max_holders_per_key,
        max_replicas_per_scope: cli.index_max_replicas_per_scope,
        max_keyspaces_per_model: cli.index_max_keyspaces_per_model,
        max_keyspaces: cli.index_max_keyspaces,
        // Several cores pick quota and cap victims across cores (runtime::evict).
        cross_core_eviction: shards > 1,
        gradual_buffer_hook: Some(crate::sys::memory::no_huge_pages),
        // Every policy install calls `rules_changed` (CoreState::set_policy).
        rules_change_notified: true,
        ..Default::default()
    }
}

/// Every core's state at start: restored from `--state-dir` when there is a usable snapshot,
/// else empty; with the generation the next snapshot writes and the event-log sequence the
/// restored snapshot includes.
fn initial_states(cli: &Cli, shards: usize) -> Result<snapshot::Restored, StartupError> {
    let base = index_config(cli, shards);
    let fresh = move || {
        let config = IndexConfig {
            directory: Arc::new(Directory::default()),
            ..base.clone()
        };
        (0..shards)
            .map(|core| CoreState::new(core, config.clone()))
            .collect::<Vec<_>>()
    };
    if cli.state_dir.is_empty() {
        return Ok(snapshot::Restored {
            states: fresh(),
            next_generation: 1,
            stream_sequence: 0,
        });
    }
    let dir = std::path::PathBuf::from(&cli.state_dir);
    snapshot::prepare_dir(&dir).map_err(|e| {
        StartupError::fatal(
            "state_dir_error",
            format!("--state-dir {}: {e}", dir.display()),
        )
    })?;
    metrics::snapshot::set_snapshots_enabled();
    snapshot::set_state_dir(dir.clone());
    // Drained cores stay alive until the final snapshot at SIGTERM has read them.
    runtime::hold_cores_after_drain();
    Ok(snapshot::restore(&dir, shards, &fresh))
}

/// Tokenizers load eagerly, before serving, on threads that never serve lookups.
fn load_tokenizers(cli: &Cli, shards: usize) {
    let tokenizers = if cli.tokenizer_models_dir.is_empty() {
        tokenizer::Tokenizers::disabled()
    } else {
        tokenizer::Tokenizers::load_with(
            std::path::Path::new(&cli.tokenizer_models_dir),
            tokenizer::PoolConfig::sparing_serving_cores(shards),
        )
    };
    let _ = tokenizer::install_global(tokenizers);
}

/// Installs the producer checks (docs/OPERATIONS.md "Hardened setup"): the policy file and the
/// producer token reviewer (the controller endpoints' TokenReview client settings, caches and
/// concurrency bound). A policy that does not load, or a review client that cannot be built,
/// fails start-up.
fn configure_producers(cli: &Cli) -> Result<(), StartupError> {
    let policy = if cli.producer_policy.is_empty() {
        None
    } else {
        Some(
            producer::policy::Watched::load(&cli.producer_policy)
                .map_err(|e| StartupError::fatal("producer_policy_load", e))?,
        )
    };
    let tokens: Option<&'static dyn producer::TokenReview> =
        if cli.producer_token_audience.is_empty() {
            None
        } else {
            let reviewer = auth::tokenreview::TokenReviewer::new(&auth_flags(cli).kube)
                .map_err(|e| StartupError::fatal("producer_auth_setup", e))?;
            Some(Box::leak(Box::new(auth::producer::ProducerReviews::new(
                reviewer,
                &cli.producer_token_audience,
            ))))
        };
    if cli.require_producer_auth
        || policy.is_some()
        || tokens.is_some()
        || !cli.client_ca_file.is_empty()
    {
        tracing::info!(
            require = cli.require_producer_auth,
            policy = policy.is_some(),
            client_certificates = !cli.client_ca_file.is_empty(),
            tokens = tokens.is_some(),
            "producer_auth_enabled"
        );
    }
    producer::configure(producer::Config {
        require: cli.require_producer_auth,
        policy,
        tokens,
    });
    Ok(())
}

fn auth_flags(cli: &Cli) -> auth::AuthFlags {
    auth::AuthFlags {
        insecure_disable_auth: cli.insecure_disable_auth,
        allowed_controller_sa: cli.allowed_controller_sa.clone(),
        controller_audience: cli.controller_audience.clone(),
        policy_audience: cli.policy_audience.clone(),
        controller_token_file: cli.controller_token_file.clone(),
        kube: auth::tokenreview::KubeConfig {
            api_server: cli.kube_api_server.clone(),
            ca_file: cli.kube_ca_file.clone(),
            token_file: cli.kube_token_file.clone(),
        },
    }
}

fn resolve(addr: &str) -> Result<SocketAddr, StartupError> {
    let invalid = |detail: String| {
        StartupError::fatal("listen_error", format!("invalid address {addr:?}{detail}"))
    };
    cli::listen_addr(addr)
        .to_socket_addrs()
        .map_err(|e| invalid(format!(": {e}")))?
        .next()
        .ok_or_else(|| invalid(String::new()))
}

/// Whether a listen address asks for port 0 (any free port), so the port bound must be logged.
fn asks_port_zero(cli: &Cli) -> bool {
    [
        &cli.grpc_bind_address,
        &cli.shard_aware_grpc_bind_address,
        &cli.http_bind_address,
        &cli.snapshot_bind_address,
    ]
    .into_iter()
    .filter(|a| !a.is_empty())
    .any(|a| resolve(a).is_ok_and(|a| a.port() == 0))
}

/// An optional listen address: empty means off.
fn optional_addr(addr: &str) -> Result<Option<SocketAddr>, StartupError> {
    (!addr.is_empty()).then(|| resolve(addr)).transpose()
}

/// Opens both HTTP listeners on the admin runtime (exit 1 when either cannot be bound).
fn bind_http(
    cli: &Cli,
    admin: &tokio::runtime::Handle,
) -> Result<(tokio::net::TcpListener, tokio::net::TcpListener), StartupError> {
    // The gRPC addresses are checked here too, so a bad one fails before anything is bound.
    resolve(&cli.grpc_bind_address)?;
    optional_addr(&cli.shard_aware_grpc_bind_address)?;
    let http_addr = resolve(&cli.http_bind_address)?;
    let snapshot_addr = resolve(&cli.snapshot_bind_address)?;
    let (h, s) = admin.block_on(async {
        let h = tokio::net::TcpListener::bind(http_addr).await;
        let s = tokio::net::TcpListener::bind(snapshot_addr).await;
        (h, s)
    });
    let listen_error = |e| StartupError::fatal("listen_error", e);
    Ok((h.map_err(listen_error)?, s.map_err(listen_error)?))
}

/// Starts the executors serving gRPC, each installing its prepared state.
fn start_runtime(
    cli: &Cli,
    shards: usize,
    states: Vec<CoreState>,
) -> Result<Runtime, StartupError> {
    runtime::start(runtime_config(cli, shards, states)?).map_err(|e| {
        eprintln!("{e}");
        StartupError::fatal("serve_error", e)
    })
}

/// Makes the calling thread (running a glommio executor) core 0 of a server started with `args`
/// and `--shards 1`, installed as [`start`] installs it (index configuration, tokenizers, lookup
/// configuration, services, metrics store), without listeners, admin thread or background loops:
/// the in-process front end of the perf harness. Once per process.
pub(crate) fn install_in_process_core(args: &[&str]) -> Result<(), String> {
    let argv = ["inference-cache-server", "--shards", "1"];
    let cli = Cli::try_parse_from(cli::normalize_args(
        argv.iter().chain(args).map(|a| a.to_string()),
    ))
    .map_err(|e| e.to_string())?;
    let shards = 1;
    configure_producers(&cli).map_err(|e| format!("{e:?}"))?;
    feeds::configure(cli.max_event_subscribers, cli.max_metric_subscribers);
    load_tokenizers(&cli, shards);
    let restored = initial_states(&cli, shards).map_err(|e| format!("{e:?}"))?;
    let cfg = runtime_config(&cli, shards, restored.states).map_err(|e| format!("{e:?}"))?;
    runtime::install_in_process(&cfg);
    Ok(())
}

/// The runtime configuration of `cli`: each core installs its prepared state, then its services.
fn runtime_config(
    cli: &Cli,
    shards: usize,
    states: Vec<CoreState>,
) -> Result<RuntimeConfig, StartupError> {
    let lookup_cfg = Arc::new(LookupConfig {
        engine_block_size: cli::engine_block_size(cli),
    });
    let slots = std::sync::Mutex::new(states.into_iter().map(Some).collect::<Vec<_>>());
    grpc::set_message_receive_timeout(Duration::from_millis(cli.grpc_message_timeout_ms));
    let event_feed = cli.max_event_subscribers > 0;
    let (health, _) = tonic_health::server::health_reporter();
    let health = Arc::new(health);
    Ok(RuntimeConfig {
        shards,
        listen_addr: resolve(&cli.grpc_bind_address)?,
        shard_aware_addr: optional_addr(&cli.shard_aware_grpc_bind_address)?,
        busy_poll: cli::busy_poll(cli, shards, available_cpus()).map_err(StartupError::usage)?,
        init: Arc::new(move |core| {
            let mut slots = slots.lock().unwrap_or_else(|e| e.into_inner());
            let state = slots[core].take().expect("one prepared state per core");
            // The change feed learns of the index's own removals only while it is on.
            state.with_removal_sink(event_feed.then(feeds::events::removal_sink))
        }),
        on_core_start: Arc::new(move || {
            shard::with_core(|st| st.publish_restored_gauge());
            grpc::install_services(lookup_cfg.clone(), &health)
        }),
        serve_connection: grpc::serve_connection,
        max_connections_per_core: cli.max_connections_per_core,
        sweep_interval: Duration::from_millis(cli.sweep_interval_ms),
    })
}

fn log_startup(runtime: &Runtime, http_addr: &str, snapshot_addr: &str, settings: &Settings) {
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        commit = option_env!("INFERENCECACHE_COMMIT").unwrap_or("unknown"),
        grpc_addr = %runtime.listen_addr,
        shard_aware_grpc_addr = %runtime.shard_aware_addr.map(|a| a.to_string()).unwrap_or_default(),
        grpc_tls = settings.grpc_tls,
        http_addr = %http_addr,
        snapshot_addr = %snapshot_addr,
        shards = settings.shards,
        "startup"
    );
}

impl Server {
    /// Serves until SIGTERM/SIGINT, then drains: gRPC first, then the HTTP listeners.
    fn serve_until_signal(self) -> i32 {
        let signals = signal_hook::iterator::Signals::new([
            signal_hook::consts::SIGTERM,
            signal_hook::consts::SIGINT,
        ]);
        let mut signals = match signals {
            Ok(s) => s,
            Err(e) => return StartupError::fatal("serve_error", e).report(),
        };
        let _ = signals.forever().next();
        tracing::info!("graceful_shutdown_started");
        admin::set_ready(false);
        metrics::set_server_up(false);
        runtime::request_shutdown();
        // With --state-dir the cores stay up after their drain until the snapshot thread has
        // written the final snapshot (bounded by SNAPSHOT_SHUTDOWN_BUDGET). A core stuck in one
        // step never gets there: the process exits without it once the bound has passed.
        let snapshot_budget = match self.snapshots {
            Some(_) => SNAPSHOT_SHUTDOWN_BUDGET + Duration::from_secs(1),
            None => Duration::ZERO,
        };
        let stop_by = Instant::now() + DRAIN_TIMEOUT + Duration::from_secs(1) + snapshot_budget;
        let stuck = self.runtime.join_until(stop_by);
        if !stuck.is_empty() {
            tracing::error!(cores = ?stuck, "shutdown_cores_not_stopped");
        }
        if let Some(w) = self.snapshots {
            w.join();
        }
        self.admin
            .block_on(admin::http::shutdown(HTTP_SHUTDOWN_BUDGET));
        tracing::info!("graceful_shutdown_done");
        0
    }
}

/// CPUs this process may use (affinity and cgroup quota), at least 1.
fn available_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}
