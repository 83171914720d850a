//! `inference-cache`: the InferenceCache gRPC server and its HTTP listeners, as a library for
//! the `inference-cache-server` binary (src/main.rs) and the in-process perf harness
//! ([`perf_harness`], examples/perf_gate_frontend.rs).
//!
//! Layers, each importing only the ones below it (docs/ARCHITECTURE.md):
//!
//! * [`perf_harness`] — the real front end driven in-process, for the CI instruction-count gate;
//! * [`startup`], [`cli`] — flags, start-up order, shutdown;
//! * [`admin`] — the HTTP listeners, controller auth, cross-core gathers (admin thread);
//! * [`grpc`] — per-connection serving, dispatch, the InferenceCache handlers;
//! * [`nats`] — the replicated event log consumer (JetStream, on the admin thread);
//! * [`producer`] — producer identity, authorization and fencing of the ingest RPCs;
//! * [`snapshot`] — warm restart: per-core snapshot files under `--state-dir` and their restore;
//! * [`lookup`] — LookupRoute: the receiving half and the owner half;
//! * [`runtime`] — pinned executors, accept loop, the cross-core mailbox, the admin thread;
//! * [`shard`] — the partition function and the per-core state over the index crate.
//!
//! Leaves usable from any layer: [`limits`], [`metrics`], [`sys`], [`logging`], [`tokenizer`].

mod admin;
mod cli;
mod feeds;
mod grpc;
mod http2;
mod ingest;
#[cfg(test)]
mod layering;
mod limits;
mod logging;
mod lookup;
mod metrics;
mod nats;
mod pd;
#[doc(hidden)]
pub mod perf_harness;
mod producer;
mod runtime;
mod shard;
mod snapshot;
mod startup;
mod sys;
mod templates;
mod tenant_registry;
mod tokenizer;

/// Runs the server with the process's arguments; returns the exit code.
pub fn run() -> i32 {
    startup::run()
}

/// Turns transparent huge pages off for the process unless the operator's environment keeps
/// them (`MIMALLOC_ALLOW_THP`); the binary calls it first thing. Returns whether it did.
pub fn no_transparent_huge_pages() -> bool {
    sys::memory::no_transparent_huge_pages()
}
