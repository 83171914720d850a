//! The real gRPC front end, driven in one process without sockets: the CI instruction-count gate
//! (examples/perf_gate_frontend.rs, perf/README.md) counts whole requests through it, from the
//! HTTP/2 bytes in to the answer's bytes out. Not a public API: only the gate uses it.
//!
//! Call [`install_core`] and [`apply_update`] on a glommio executor's thread, inside the executor;
//! [`serve_http2`] then serves one connection over any in-memory stream, exactly as a `--shards 1`
//! core serves a plaintext gRPC connection dealt to it.

use std::future::Future;

use inferencecache_proto::v1alpha1 as pb;

use crate::{grpc, ingest, startup};

/// Makes the calling thread core 0 of a `--shards 1` server started with the extra flags
/// `args`: its index, policy store, metrics store, lookup configuration and services, installed
/// by the same start-up code as the server's. Once per process.
pub fn install_core(args: &[&str]) -> Result<(), String> {
    startup::install_in_process_core(args)
}

/// Serves one plaintext gRPC connection (HTTP/2) on `stream` until it closes.
pub fn serve_http2<S>(stream: S) -> impl Future<Output = ()>
where
    S: futures_lite::AsyncRead + futures_lite::AsyncWrite + Unpin + 'static,
{
    grpc::serve_http2(stream)
}

/// Applies one producer message as ReportCacheState does.
pub async fn apply_update(update: pb::CacheStateUpdate) -> Result<(), String> {
    match ingest::apply_update(update).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(why)) => Err(format!("update refused: {why:?}")),
        Err(e) => Err(format!("{e:?}")),
    }
}
