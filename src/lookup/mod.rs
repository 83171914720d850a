//! LookupRoute (docs/BEHAVIOUR.md §10.2), split by where each step runs:
//!
//! * [`receive`] — on the core that received the call: the one decision (steps 1–6: probe
//!   tenant, budget, requireChain gate, the owner, input resolution), prompt_text
//!   tokenization, then the hop to the owner;
//! * [`owner`] — on the core owning the `(tenant, model)` partition: the index call, the
//!   floors, affinity and LFU credit;
//! * [`request`] — a request that outlives the turn it was read in.
//!
//! Every exit is a fail-open envelope (§10.4); nothing here returns an error status.

mod owner;
mod receive;
mod request;
mod spare;

use std::time::Instant;

use inferencecache_index::resolve::Detached;
use inferencecache_proto::v1alpha1 as pb;

pub use owner::{PoolQuery, rank_pool};
pub use receive::{
    Decided, Decision, Waiting, answer_request, answer_waiting, deadline_race, decide,
};
pub use request::{LookupRequest, ReceivedRequest};
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

/// What crosses the hop to the owner core: the request and what the receiving core decided.
struct OwnerCall {
    req: LookupRequest,
    /// The inputs resolved on the receiving core (wire fingerprints borrowed again from `req`).
    inputs: Detached,
    decided: Decided,
}

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

#[cfg(test)]
mod tests;
