//! The end-to-end suite: the real `inference-cache-server` binary on loopback ports, driven
//! through generated gRPC clients and raw HTTP, one module per capability. Scenarios named
//! `cNNN_…` / `sNN_…` pin conformance cases and docs/BEHAVIOUR.md sections (docs/CONFORMANCE.md);
//! most run twice, as `<scenario>::shards_1` and `<scenario>::shards_2` (see `shards_1_and_2!`).
//!
//! `cargo test --test e2e` runs it all; `cargo test --test e2e gates::` one capability;
//! `cargo test --test e2e c114` one case.

#[macro_use]
mod support;

/// The consistent-hash affinity fallback.
mod affinity;
/// Controller-facing authentication (TokenReview, token file).
mod auth;
/// Caller deadlines and the policy budget.
mod deadlines;
/// The Kubernetes manifests in deploy/ name flags the binaries accept.
mod deploy;
/// Result-side floors (matched floor, routing floor).
mod floors;
/// Start-up, every RPC, health, reflection, shutdown, connection bounds.
mod foundation;
/// Request-side gates and strategy switches (min prefix, requireChain, chain matching off).
mod gates;
/// Production hardness: resource bounds and visible faults.
mod hardness;
/// The HTTP listeners: public endpoints, /snapshot, /policy, /probe, shutdown.
mod http;
/// The HTTP/2 layer's conformance checklist (RFC 9113 §3–§8, RFC 7541), case by case.
mod http2_conformance;
/// The known HTTP/2 denial-of-service families, each with bounds.
mod http2_dos;
/// The gRPC port's HTTP/2 wire behaviour (RFC 9113), frame by frame.
mod http2_wire;
/// ReportCacheState / PublishEvent semantics: timestamps, REPLICA_UPDATED, PREFIX_EVICTED.
mod ingest;
/// The inline LookupRoute path and its hand-off to the general path.
mod inline_lookup;
/// Engine KV events through kvevent-subscriber.
mod kvevents;
/// The gateway SDK's lean LookupRoute client against the real server.
mod lean_client;
/// LFU crediting and the global entry cap.
mod lfu;
/// The server as the event log's only writer (`--nats-log-writer`).
mod log_writer;
/// LookupRoute basics: exact and chain matches, tenant-hot, tiers, diagnostics, the probe
/// tenant, the other RPCs, the response envelope.
mod lookup_basics;
/// The maintenance lane (one maintenance piece per reactor turn) under a flood.
mod maintenance_lane;
/// The /metrics exposition.
mod metrics;
/// LookupPDRoute with prefill/decode topologies registered on the controller-facing listener.
mod pd;
/// Producer identity (client certificates, tokens), the producer policy and epoch fencing.
mod producers;
/// `prompt_text` input through a real tokenizer: echo, fail-open, saturation, deadlines.
mod prompt_text;
/// Replicas fed through the NATS JetStream event log.
mod replicas;
/// Warm restart with --state-dir: snapshots, restore, N→M shards, damaged files.
mod restart;
/// Bad input over real sockets must not crash, wedge or corrupt the server.
mod robustness;
/// The same seeded random traffic against --shards 1, 2 and 4, compared field by field.
mod self_differential;
/// The shard-aware listener and the gateway SDK: no request hops.
mod shard_aware;
/// The seeded adversarial soak: hostile shapes mixed with a well-behaved client's traffic.
mod soak;
/// StreamCacheEvents and StreamMetrics.
mod streams;
/// RenderTemplate with tenant templates registered on the controller-facing listener.
mod templates;
/// TLS on the gRPC port, rotation.
mod tls;
/// `token_ids` input and its fingerprint.
mod tokens;
/// No client can wedge a core: maintenance in slices under hostile shapes, keyspace bounds,
/// shutdown with a stalled core.
mod wedge;
