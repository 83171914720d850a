//! Gateways: turn a [`RequestSpec`] into a `LookupRoute` call, the way an inference gateway asks
//! the index where to send a prompt, and record the outcome.
//!
//! The lookup covers exactly the prompt's full blocks, fingerprinted like the producers'
//! reports, so a correct server answers PREFIX_MATCH whenever a replica reported the leading
//! blocks (docs/BEHAVIOUR.md §8.3, §10.3).

use std::time::Duration;

use inferencecache_gateway::LookupConnection;
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inferencecache_proto::v1alpha1::{
    LookupPdRouteRequest, LookupPdRouteResponse, LookupRouteRequest, LookupRouteResponse,
};
use serde::Serialize;
use tokio::time::Instant;
use tonic::transport::Channel;

use crate::histogram::{LookupOutcome, Recorder, Rpc};
use crate::workload::{Names, RequestSpec};

/// How a gateway identifies the prompt in `LookupRoute`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum LookupInput {
    /// `block_hashes` + `block_token_counts` computed client-side (the fingerprint chain).
    Chain,
    /// Raw `token_ids`; the server fingerprints them with its `--engine-block-size`.
    Tokens,
    /// Legacy exact key: `prefix_hash` = last full block's hash, `prefix_token_count` = its
    /// cumulative token count.
    Exact,
    /// The exact key sent as `LookupPDRoute` (prefill/decode routing) against the topology
    /// `--pd-topology`, which must be registered on the server for every tenant. The report's
    /// `LookupRoute` row then measures the LookupPDRoute calls.
    Pd,
}

/// The `LookupRoute` request for `spec`.
pub fn lookup_request(
    spec: &RequestSpec,
    names: &Names,
    hash_scheme: &str,
    block_size: u32,
    input: LookupInput,
) -> LookupRouteRequest {
    let mut req = LookupRouteRequest {
        model_id: names.models[spec.scope.model as usize].clone(),
        tenant_id: names.tenants[spec.scope.tenant as usize].clone(),
        hash_scheme: hash_scheme.to_string(),
        adapter_id: names.adapters[spec.scope.adapter as usize].clone(),
        ..Default::default()
    };
    let n = spec.n_blocks.min(spec.hashes.len());
    match input {
        LookupInput::Chain => {
            req.block_hashes = spec.hashes[..n]
                .iter()
                .map(|h| h.to_be_bytes().to_vec().into())
                .collect();
            req.block_token_counts = vec![block_size as i32; n];
        }
        LookupInput::Tokens => {
            req.token_ids = spec.tokens[..spec.n_tokens].to_vec();
        }
        LookupInput::Exact | LookupInput::Pd => {
            if n > 0 {
                req.prefix_hash = spec.hashes[n - 1].to_be_bytes().to_vec();
                req.prefix_token_count = (n as u64 * block_size as u64) as i32;
            }
        }
    }
    req
}

/// The connection a `LookupRoute` goes over.
pub enum LookupVia {
    /// tonic's client over a tonic channel.
    Tonic(InferenceCacheClient<Channel>),
    /// The gateway SDK's lean client.
    Lean(LookupConnection),
}

impl LookupVia {
    async fn call(
        self,
        req: LookupRouteRequest,
        timeout: Duration,
    ) -> Result<LookupRouteResponse, tonic::Status> {
        match self {
            LookupVia::Tonic(mut client) => {
                let mut request = tonic::Request::new(req);
                request.set_timeout(timeout);
                match tokio::time::timeout(timeout, client.lookup_route(request)).await {
                    Ok(answer) => answer.map(tonic::Response::into_inner),
                    Err(_) => Err(tonic::Status::deadline_exceeded("lookup timed out")),
                }
            }
            LookupVia::Lean(conn) => conn.lookup_route(&req, timeout).await,
        }
    }
}

/// Sends one lookup (bounded by `timeout`, also sent as the gRPC deadline) and records latency
/// measured from `from` — the ticket's intended time — plus reason code and scores.
pub async fn lookup(
    via: LookupVia,
    req: LookupRouteRequest,
    prompt_tokens: u64,
    timeout: Duration,
    from: Instant,
    rec: &Recorder,
) -> Option<LookupRouteResponse> {
    let started = Instant::now();
    lookup_started_probe(timeout.as_micros() as u64);
    match via.call(req, timeout).await {
        Ok(resp) => {
            rec.record_lookup_ok(from, started);
            rec.record_lookup(LookupOutcome {
                reason: &resp.reason_code,
                scores: resp.replica_scores.len(),
                top_matched_tokens: resp.replica_scores.first().map_or(0, |s| s.matched_tokens),
                prompt_tokens,
            });
            Some(resp)
        }
        Err(st) => {
            rec.record_error(Rpc::LookupRoute, st.code());
            rec.note_failed_lookup(from, started);
            None
        }
    }
}

/// A probe point for `perf/sweep_stall.sh TRACE=1`: called as each LookupRoute call begins, so a
/// uprobe here marks calls in the order they leave (over one connection the server handles them
/// in that order, which pairs each call with its handling). Out of line so the probe finds one
/// symbol; it does nothing (the opaque argument keeps the call from being optimised away).
#[inline(never)]
pub fn lookup_started_probe(timeout_us: u64) {
    std::hint::black_box(timeout_us);
}

/// The `LookupPDRoute` request for an exact lookup request against `topology`.
pub fn pd_request(req: LookupRouteRequest, topology: &str) -> LookupPdRouteRequest {
    LookupPdRouteRequest {
        model_id: req.model_id,
        tenant_id: req.tenant_id,
        prefix_hash: req.prefix_hash,
        prefix_token_count: req.prefix_token_count,
        pd_topology_ref: topology.to_string(),
    }
}

/// Sends one LookupPDRoute like [`lookup`] sends a LookupRoute, recorded in the lookup series
/// (one "score" when a prefill replica is named).
pub async fn lookup_pd(
    mut client: InferenceCacheClient<Channel>,
    req: LookupPdRouteRequest,
    prompt_tokens: u64,
    timeout: Duration,
    from: Instant,
    rec: &Recorder,
) -> Option<LookupPdRouteResponse> {
    let started = Instant::now();
    let mut request = tonic::Request::new(req);
    request.set_timeout(timeout);
    match tokio::time::timeout(timeout, client.lookup_pd_route(request)).await {
        Ok(Ok(resp)) => {
            rec.record_lookup_ok(from, started);
            let resp = resp.into_inner();
            rec.record_lookup(LookupOutcome {
                reason: &resp.reason_code,
                scores: usize::from(!resp.prefill_replica_id.is_empty()),
                top_matched_tokens: 0,
                prompt_tokens,
            });
            Some(resp)
        }
        Ok(Err(st)) => {
            rec.record_error(Rpc::LookupRoute, st.code());
            None
        }
        Err(_) => {
            rec.record_error(Rpc::LookupRoute, tonic::Code::DeadlineExceeded);
            None
        }
    }
}
