//! `kvevent-subscriber` binary: flags, JSON logs, signal handling; the work is in the library.

#![forbid(unsafe_code)]

use clap::Parser;
use kvevent_subscriber::{app, cli::Args};
use tracing_subscriber::EnvFilter;

/// Exit code of a configuration error (clap uses the same for a flag that does not parse).
const EXIT_USAGE: i32 = 2;

#[tokio::main]
async fn main() {
    // Flags first: a malformed value exits 2 with clap's message naming the flag.
    let args = Args::parse();
    tracing_subscriber::fmt()
        .json()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_current_span(false)
        .init();
    if let Err(e) = app::run(args, shutdown_signal()).await {
        // One line, no backtrace: start-up problems name their flag.
        eprintln!("error: {e:#}");
        let code = if e.downcast_ref::<app::StartupError>().is_some() {
            EXIT_USAGE
        } else {
            1
        };
        std::process::exit(code);
    }
}

/// Resolves on SIGINT or SIGTERM (the pod is being stopped).
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
