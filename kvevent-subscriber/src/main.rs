//! `kvevent-subscriber` binary: flags, JSON logs, signal handling; the work is in the library.

#![forbid(unsafe_code)]

use clap::Parser;
use kvevent_subscriber::{app, cli::Args};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .json()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_current_span(false)
        .init();
    let args = Args::parse();
    app::run(args, shutdown_signal()).await
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
