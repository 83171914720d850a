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

use std::cell::RefCell;
use std::time::Instant;

use inferencecache_index::policy::ResolvedPolicy;
use inferencecache_proto::v1alpha1 as pb;

use crate::limits::{LOOKUP_SPARE_SCORES, MAX_ID_BYTES};

pub use owner::{PoolQuery, rank_pool};
pub use receive::{deadline_race, lookup_route, lookup_route_now};

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
        reason_code: spare_text(|s| &mut s.reason_code, reason),
        lookup_latency_us: elapsed_us(start),
        token_ids,
        adapter_id,
    }
}

thread_local! {
    /// This core's last inline answer, once encoded: its score slots and strings are reused
    /// by the next answer ([`recycle`]).
    static SPARE: RefCell<pb::LookupRouteResponse> = RefCell::default();
}

/// Hands an encoded answer back to this core, so the next answer built here reuses its score
/// slots, replica ids, reason code and adapter instead of allocating them. The inline path
/// does this after encoding; answers sent by the general path belong to the transport. What is
/// kept is bounded: [`LOOKUP_SPARE_SCORES`] slots, strings of at most [`MAX_ID_BYTES`].
pub fn recycle(mut resp: pb::LookupRouteResponse) {
    resp.replica_scores.truncate(LOOKUP_SPARE_SCORES);
    resp.replica_scores
        .retain(|s| s.replica_id.capacity() <= MAX_ID_BYTES);
    resp.token_ids = Vec::new();
    for text in [&mut resp.reason_code, &mut resp.adapter_id] {
        if text.capacity() > MAX_ID_BYTES {
            *text = String::new();
        }
    }
    SPARE.with_borrow_mut(|spare| *spare = resp);
}

/// The spare score slots (their contents are stale: [`set_score`] overwrites each one used).
fn spare_scores() -> Vec<pb::ReplicaScore> {
    SPARE.with_borrow_mut(|spare| std::mem::take(&mut spare.replica_scores))
}

/// `text` in the spare answer's string `field`, reusing its buffer.
fn spare_text(field: fn(&mut pb::LookupRouteResponse) -> &mut String, text: &str) -> String {
    let mut out = SPARE.with_borrow_mut(|spare| std::mem::take(field(spare)));
    out.clear();
    out.push_str(text);
    out
}

/// Writes score `i` of an answer into `scores` (slot `i` if it exists, reusing its replica-id
/// buffer; else a new slot); slots past the last one written are cut by the caller.
fn set_score(scores: &mut Vec<pb::ReplicaScore>, i: usize, score: ScoreOf<'_>) {
    debug_assert!(i <= scores.len(), "scores are written in order");
    if i == scores.len() {
        scores.push(pb::ReplicaScore::default());
    }
    let slot = &mut scores[i];
    let mut replica_id = std::mem::take(&mut slot.replica_id);
    replica_id.clear();
    replica_id.push_str(score.replica);
    // Every field is named: a field added to the message cannot keep a stale value.
    *slot = pb::ReplicaScore {
        replica_id,
        score: score.score,
        matched_tokens: score.matched_tokens,
        estimated_cache_hit_prob: score.estimated_cache_hit_prob,
        tier: score.tier,
    };
}

/// One score of an answer, borrowed from the index.
#[derive(Default)]
struct ScoreOf<'a> {
    replica: &'a str,
    score: f32,
    matched_tokens: i32,
    estimated_cache_hit_prob: f32,
    tier: i32,
}

/// An envelope with no scores and no adapter.
fn envelope(reason: &str, start: Instant, token_ids: Vec<u32>) -> pb::LookupRouteResponse {
    response(reason, start, Vec::new(), token_ids, String::new())
}

/// Whether `deadline` has passed.
fn expired(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}
