//! LookupRoute (docs/BEHAVIOUR.md §10.2), split by where each step runs:
//!
//! * [`receive`] — on the core that received the call: steps 1–5 (probe tenant, budget,
//!   requireChain gate) and prompt_text tokenization, then the hop to the owner;
//! * [`owner`] — on the core owning the `(tenant, model)` partition: input resolution, the
//!   index call, the floors, affinity and LFU credit.
//!
//! Every exit is a fail-open envelope (§10.4); nothing here returns an error status.

mod owner;
mod receive;
mod spare;

use std::time::Instant;

use inferencecache_index::policy::ResolvedPolicy;
use inferencecache_proto::v1alpha1 as pb;

pub use owner::{PoolQuery, rank_pool};
pub use receive::{deadline_race, lookup_route, lookup_route_now};
pub use spare::recycle;

/// Process-wide, immutable configuration of the lookup path.
#[derive(Debug, Clone)]
pub struct LookupConfig {
    /// Tokens per block for the token_ids / prompt_text fingerprint.
    pub engine_block_size: i32,
}

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

/// A LookupRoute answer and the request's model id (the metric label).
type Answer = (pb::LookupRouteResponse, String);

/// Microseconds since `start`, truncated (the `lookup_latency_us` field).
fn elapsed_us(start: Instant) -> i64 {
    start.elapsed().as_micros().min(i64::MAX as u128) as i64
}

/// A response envelope.
fn response(
    reason: &str,
    start: Instant,
    scores: Vec<pb::ReplicaScore>,
    token_ids: Vec<u32>,
    adapter_id: String,
) -> pb::LookupRouteResponse {
    pb::LookupRouteResponse {
        replica_scores: scores,
        reason_code: spare::reason(reason),
        lookup_latency_us: elapsed_us(start),
        token_ids,
        adapter_id,
    }
}

/// An envelope with no scores and no adapter.
fn envelope(reason: &str, start: Instant, token_ids: Vec<u32>) -> pb::LookupRouteResponse {
    response(reason, start, Vec::new(), token_ids, String::new())
}

/// Whether `deadline` has passed.
fn expired(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}
