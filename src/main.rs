//! `inference-cache-server`: the InferenceCache gRPC server and its HTTP listeners.
//!
//! Start-up order follows the reference (BEHAVIOUR.md §1.2): validate flags (exit 2), open every
//! listener up front (exit 1 on failure), start the per-core runtime, mark ready, then serve
//! until SIGTERM/SIGINT, which drains in-flight calls and exits 0.

mod admin;
mod auth;
mod civil;
mod cli;
mod control;
mod core_state;
mod grpc;
mod http;
mod logging;
mod lookup;
mod metrics;
mod probe;
mod route;
mod runtime;
mod tls;
mod tokenizer;

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use clap::Parser;

/// mimalloc: per-thread heaps for the per-request prost/h2 allocations (see Cargo.toml).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    std::process::exit(run());
}

fn resolve(addr: &str) -> Result<SocketAddr, String> {
    cli::listen_addr(addr)
        .to_socket_addrs()
        .map_err(|e| format!("invalid address {addr:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("invalid address {addr:?}"))
}

fn run() -> i32 {
    let cli = match cli::Cli::try_parse_from(cli::normalize_args(std::env::args())) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    let json = match logging::parse_format(&cli.log_format) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("{e}");
            return 2;
        }
    };
    let level = match logging::parse_level(&cli.log_level) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("{e}");
            return 2;
        }
    };
    if let Err(e) = cli::validate_auth(&cli).and_then(|_| cli::validate_tls(&cli)) {
        eprintln!("{e}");
        return 2;
    }
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let shards = cli.shards.unwrap_or_else(|| cli::default_shards(cpus));
    if shards == 0 || shards > cli::MAX_SHARDS {
        eprintln!("--shards must be between 1 and {}", cli::MAX_SHARDS);
        return 2;
    }
    logging::init(json, level);
    // Tokenizers load eagerly, before serving, on threads that never serve lookups.
    let tokenizers = if cli.tokenizer_models_dir.is_empty() {
        tokenizer::Tokenizers::disabled()
    } else {
        tokenizer::Tokenizers::load_with(
            std::path::Path::new(&cli.tokenizer_models_dir),
            tokenizer::PoolConfig::sparing_serving_cores(shards),
        )
    };
    let _ = tokenizer::install_global(tokenizers);
    let controller_auth = match auth::setup(&cli) {
        Ok(a) => a,
        Err(e) => {
            tracing::error!(error = %e, "controller_auth_setup");
            return 1;
        }
    };
    let grpc_tls = !cli.tls_cert_file.is_empty();
    if grpc_tls && let Err(e) = tls::install(&cli.tls_cert_file, &cli.tls_key_file) {
        tracing::error!(error = %e, "grpc_tls_load");
        return 1;
    }
    metrics::set_grpc_tls_enabled(grpc_tls);

    let admin = admin::start();
    let addrs = (|| -> Result<_, String> {
        Ok((
            resolve(&cli.grpc_bind_address)?,
            resolve(&cli.http_bind_address)?,
            resolve(&cli.snapshot_bind_address)?,
        ))
    })();
    let (grpc_addr, http_addr, snapshot_addr) = match addrs {
        Ok(a) => a,
        Err(e) => {
            tracing::error!(error = %e, "listen_error");
            return 1;
        }
    };
    let listeners = admin.block_on(async {
        let h = tokio::net::TcpListener::bind(http_addr).await;
        let s = tokio::net::TcpListener::bind(snapshot_addr).await;
        (h, s)
    });
    let (http_listener, snapshot_listener) = match listeners {
        (Ok(h), Ok(s)) => (h, s),
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!(error = %e, "listen_error");
            return 1;
        }
    };

    let service_cfg = Arc::new(grpc::service::ServiceConfig {
        engine_block_size: cli::engine_block_size(&cli),
    });
    let index_config = inferencecache_index::index::IndexConfig {
        max_entries: cli.index_max_entries,
        directory: Arc::new(inferencecache_index::directory::Directory::default()),
        ..Default::default()
    };
    let (health, _) = tonic_health::server::health_reporter();
    let health = Arc::new(health);
    runtime::set_max_connections_per_core(cli.max_connections_per_core);
    let runtime = runtime::start(runtime::RuntimeConfig {
        shards,
        grpc_addr,
        init: {
            let config = index_config.clone();
            Arc::new(move |core| core_state::CoreState::new(core, config.clone()))
        },
        install_services: Arc::new(move || grpc::install(service_cfg.clone(), &health)),
        sweep_interval: std::time::Duration::from_millis(cli.sweep_interval_ms),
    });
    let runtime = match runtime {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{e}");
            tracing::error!(error = %e, "serve_error");
            return 1;
        }
    };
    http::READY.store(true, Ordering::SeqCst);
    metrics::set_server_up(true);
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        commit = option_env!("INFERENCECACHE_COMMIT").unwrap_or("unknown"),
        grpc_addr = %runtime.grpc_addr,
        grpc_tls,
        http_addr = %http_listener.local_addr().map(|a| a.to_string()).unwrap_or_default(),
        snapshot_addr = %snapshot_listener.local_addr().map(|a| a.to_string()).unwrap_or_default(),
        shards,
        "startup"
    );
    admin.spawn(http::serve(http_listener, http::public));
    let controller = Arc::new(http::Controller {
        auth: controller_auth,
    });
    admin.spawn(http::serve(snapshot_listener, controller.handler()));

    let mut signals = match signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ]) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "serve_error");
            return 1;
        }
    };
    let _ = signals.forever().next();
    tracing::info!("graceful_shutdown_started");
    http::READY.store(false, Ordering::SeqCst);
    metrics::set_server_up(false);
    runtime::request_shutdown();
    runtime.join();
    admin.block_on(http::shutdown(http::SHUTDOWN_BUDGET));
    tracing::info!("graceful_shutdown_done");
    0
}
