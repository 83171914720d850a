//! The `loadgen` binary: parses the command line, runs the subcommand on a multi-threaded tokio
//! runtime (`--threads` workers) and maps failures to exit code 1 (2 for usage errors, from clap).

#![forbid(unsafe_code)]

use clap::Parser;
use loadgen::cli::{Cli, Command};
use loadgen::run;

fn main() {
    let cli = Cli::parse();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if cli.threads > 0 {
        builder.worker_threads(cli.threads);
    }
    let rt = builder
        .enable_all()
        .build()
        .expect("cannot start the tokio runtime");
    let res = rt.block_on(async move {
        match cli.command {
            Command::Run(a) => run::cmd_run(a).await.map(|_| ()),
            Command::Capacity(a) => run::cmd_capacity(a).await.map(|_| ()),
            Command::Preload(a) => run::cmd_preload(a).await.map(|_| ()),
        }
    });
    // Abandoned in-flight calls must not keep the process alive.
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    if let Err(e) = res {
        eprintln!("loadgen: {e}");
        std::process::exit(1);
    }
}
