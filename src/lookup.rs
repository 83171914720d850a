//! The LookupRoute handler algorithm (BEHAVIOUR.md §10.2), split by where each step runs:
//! steps 1–5 and tokenization on the core that received the call; input resolution, the index
//! call, the floors, affinity and LFU credit on the core owning the `(tenant, model)` partition.
//! Every exit is a fail-open envelope (§10.4); nothing here returns an error status.

use std::time::{Duration, Instant};

use inferencecache_proto::v1alpha1 as pb;
use inferencecache_index::PROBE_TENANT;
use inferencecache_index::policy::ResolvedPolicy;
use inferencecache_index::resolve::{self, DEFAULT_TOKENIZE_TIMEOUT};

use crate::core_state::{owner, with_core};
use crate::grpc::service::ServiceConfig;
use crate::runtime::mailbox::{self, HopError};

/// Reason codes the handler emits itself (the index's strategies name the others).
pub mod reason {
    /// Consistent-hash pick over the serving replicas.
    pub const AFFINITY_HINT: &str = "AFFINITY_HINT";
    /// No hint.
    pub const NO_HINT: &str = "NO_HINT";
    /// The tenant's policy requires a wire chain.
    pub const POLICY_REQUIRES_CHAIN: &str = "POLICY_REQUIRES_CHAIN";
    /// The caller's deadline or the tenant's budget expired.
    pub const TIMEOUT: &str = "TIMEOUT";
}

/// Microseconds since `start`, truncated (the `lookup_latency_us` field).
fn elapsed_us(start: Instant) -> i64 {
    start.elapsed().as_micros().min(i64::MAX as u128) as i64
}

/// An envelope with no scores.
fn envelope(reason: &str, start: Instant, token_ids: Vec<u32>) -> pb::LookupRouteResponse {
    pb::LookupRouteResponse {
        replica_scores: Vec::new(),
        reason_code: reason.to_string(),
        lookup_latency_us: elapsed_us(start),
        token_ids,
        adapter_id: String::new(),
    }
}

/// Whether `deadline` has passed.
fn expired(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

/// Resolves to `None` when `deadline` fires first, else to the work's output.
async fn race<T>(
    deadline: Option<Instant>,
    work: impl std::future::Future<Output = T> + Send,
) -> Option<T> {
    match deadline {
        None => Some(work.await),
        Some(d) => {
            let timer = async move {
                let left = d.saturating_duration_since(Instant::now());
                if !left.is_zero() {
                    crate::runtime::io::sleep(left).await;
                }
                None
            };
            futures_lite::future::or(async { Some(work.await) }, timer).await
        }
    }
}

/// The inputs that cross the hop to the owner core.
pub struct OwnerCall {
    /// The request (its `model_id` moved to `model`); wire fingerprints are resolved on the
    /// owner, which borrows them without copying.
    pub req: pb::LookupRouteRequest,
    /// The request's model id.
    pub model: String,
    /// Tokens produced by the server's tokenizer for `prompt_text`, when that path ran.
    pub tokenized: Option<Vec<u32>>,
    /// The tenant's resolved policy (one snapshot for the whole call).
    pub policy: ResolvedPolicy,
    /// Handler entry time.
    pub start: Instant,
    /// The effective deadline, if any.
    pub deadline: Option<Instant>,
    /// Engine block size for token-derived fingerprints.
    pub block_size: i32,
}

/// Answers one LookupRoute; never fails.
pub async fn lookup_route(
    cfg: &ServiceConfig,
    req: pb::LookupRouteRequest,
    start: Instant,
    caller_deadline: Option<Instant>,
) -> pb::LookupRouteResponse {
    // 1. Probe tenant: before anything else, latency 0.
    if req.tenant_id == PROBE_TENANT {
        crate::metrics::record_lookup(&req.model_id, reason::NO_HINT, false, Duration::ZERO);
        let mut r = envelope(reason::NO_HINT, start, Vec::new());
        r.lookup_latency_us = 0;
        return r;
    }
    let (resp, model) = lookup_route_inner(cfg, req, start, caller_deadline).await;
    crate::metrics::record_lookup(
        &model,
        &resp.reason_code,
        !resp.replica_scores.is_empty(),
        start.elapsed(),
    );
    resp
}

/// Steps 2–13; returns the response and the request's model id (for the metric labels).
async fn lookup_route_inner(
    cfg: &ServiceConfig,
    mut req: pb::LookupRouteRequest,
    start: Instant,
    caller_deadline: Option<Instant>,
) -> (pb::LookupRouteResponse, String) {
    let policy = with_core(|st| st.policy.resolve(&req.tenant_id));
    // 2. Budget: min(caller deadline, now + lookupTimeoutMs).
    let mut deadline = caller_deadline;
    if let Some(budget) = policy.lookup_budget() {
        let d = start + budget;
        deadline = Some(deadline.map_or(d, |c| c.min(d)));
    }
    // 3. Default tokenize deadline.
    if deadline.is_none() && resolve::will_tokenize(&req, policy.enable_chain_matching) {
        deadline = Some(start + DEFAULT_TOKENIZE_TIMEOUT);
    }
    let model = std::mem::take(&mut req.model_id);
    // 4. Already expired?
    if expired(deadline) {
        return (envelope(reason::TIMEOUT, start, Vec::new()), model);
    }
    // 5. requireChain gate.
    if policy.require_chain && !resolve::has_valid_wire_chain(&req) {
        return (
            envelope(reason::POLICY_REQUIRES_CHAIN, start, Vec::new()),
            model,
        );
    }
    // 6a. The prompt_text path tokenizes here, on the tokenizer pool, never on an index core.
    let mut tokenized = None;
    if matches!(
        resolve::resolve_inputs(&req, policy.enable_chain_matching, cfg.engine_block_size),
        resolve::Resolution::Tokenize { .. }
    ) {
        // The text is only needed by the tokenizer: move it instead of copying up to 1 MiB.
        let text = std::mem::take(&mut req.prompt_text);
        let work = crate::tokenizer::global().tokenize_for_lookup(&model, text);
        match race(deadline, work).await {
            None => return (envelope(reason::TIMEOUT, start, Vec::new()), model),
            Some(None) => return (envelope(reason::NO_HINT, start, Vec::new()), model),
            Some(Some(tokens)) => tokenized = Some(tokens),
        }
    }
    // A TIMEOUT that fires while the owner works still echoes the server's tokens (§10.4).
    let echo_on_timeout = if deadline.is_some() {
        tokenized.clone()
    } else {
        None
    };
    // 6b–13 on the owner core.
    let core = owner(&req.tenant_id, &model);
    let call = OwnerCall {
        req,
        model,
        tokenized,
        policy,
        start,
        deadline,
        block_size: cfg.engine_block_size,
    };
    let fallback_model = call.model.clone();
    match race(deadline, mailbox::try_call(core, move |st| st.route(call))).await {
        Some(Ok(done)) => done,
        None => (
            envelope(reason::TIMEOUT, start, echo_on_timeout.unwrap_or_default()),
            fallback_model,
        ),
        // The owner's queue is full: shed load instead of queueing (fail open).
        Some(Err(HopError::Full)) | Some(Err(HopError::Gone)) => {
            (envelope(reason::NO_HINT, start, Vec::new()), fallback_model)
        }
    }
}
