//! `inference-cache-server`: the InferenceCache gRPC server and its HTTP listeners.
//!
//! Layers, each importing only the ones below it (docs/ARCHITECTURE.md):
//!
//! * [`startup`], [`cli`] — flags, start-up order, shutdown;
//! * [`admin`] — the HTTP listeners, controller auth, cross-core gathers (admin thread);
//! * [`grpc`] — per-connection serving, dispatch, the InferenceCache handlers;
//! * [`nats`] — the replicated event log consumer (JetStream, on the admin thread);
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
mod ingest;
#[cfg(test)]
mod layering;
mod limits;
mod logging;
mod lookup;
mod metrics;
mod nats;
mod pd;
mod runtime;
mod shard;
mod snapshot;
mod startup;
mod sys;
mod templates;
mod tenant_registry;
mod tokenizer;

/// mimalloc: per-thread heaps for the per-request prost/h2 allocations (see Cargo.toml).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    std::process::exit(startup::run());
}
