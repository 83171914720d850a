//! The owner half of LookupRoute (docs/BEHAVIOUR.md §10.2 steps 7–13, §10.6, §10.7), run on the
//! core owning the `(tenant, model)` partition with the inputs the receiving core resolved: the
//! min-prefix gate, the index call, the strategy gate, the result-side floors, the affinity
//! fallback and LFU credit.

use std::time::Instant;

use inferencecache_index::index::{BlockHashes, LookupQuery, Strategy};
use inferencecache_index::policy::ResolvedPolicy;
use inferencecache_index::resolve::{
    self, LookupRouteView, Resolution, ResolvedChain, ResolvedInputs,
};
use inferencecache_proto::v1alpha1 as pb;

use super::receive::Decided;
use super::request::LookupRequest;
use super::spare::{self, ScoreOf};
use super::{OwnerCall, expired, reason, response};
use crate::limits::MAX_SCORES_PER_ANSWER;
use crate::shard::CoreState;
use crate::sys::clock::unix_now_ns;

/// A response with no scores and no adapter, echoing `echo`.
fn bare(reason: &str, start: Instant, echo: Vec<u32>) -> pb::LookupRouteResponse {
    response(reason, start, Vec::new(), echo, String::new())
}

/// Runs steps 7–13 for a call that crossed the hop to this core, with the inputs the receiving
/// core resolved; gives the request back (for its metric label, and to be freed where it was
/// allocated).
pub(super) fn answer(
    st: &mut CoreState,
    call: OwnerCall,
) -> (pb::LookupRouteResponse, LookupRequest) {
    let OwnerCall {
        req,
        inputs,
        decided,
    } = call;
    let view = req.view();
    let resp = match settle(inputs.attach(&view), decided.start, decided.deadline) {
        Ok(inputs) => answer_resolved(st, &view, inputs, &decided),
        Err(early) => early,
    };
    (resp, req)
}

/// Runs steps 9–13 on this core, the owner, over a borrowed request and its resolved inputs.
pub(super) fn answer_resolved(
    st: &mut CoreState,
    req: &LookupRouteView<'_>,
    inputs: ResolvedInputs<'_>,
    decided: &Decided,
) -> pb::LookupRouteResponse {
    let Decided {
        ref policy,
        start,
        deadline,
        ..
    } = *decided;
    // Echoed in every scored answer; the resolver never reads it.
    let adapter = spare::adapter(req.adapter_id);
    // 9. minimumPrefixTokens: a pre-gate only when affinity is off, else a downgrade.
    let min_prefix = i64::from(policy.minimum_prefix_tokens);
    let below_min = min_prefix > 0 && inputs.effective_prefix_tokens() < min_prefix;
    if below_min && !policy.affinity_routing {
        return bare(reason::NO_HINT, start, inputs.echo.clone());
    }
    // 10–11. The index call.
    let lookup_start = Instant::now();
    let found = query_index(st, req, &adapter, &inputs, policy);
    // The lookup ran concurrently with the deadline in the reference: a result that arrives
    // after the deadline, or a lookup slower than the budget, is a TIMEOUT (never credited).
    let budget_blown = policy
        .lookup_budget()
        .is_some_and(|b| lookup_start.elapsed() > b);
    if expired(deadline) || budget_blown {
        return bare(reason::TIMEOUT, start, inputs.echo.clone());
    }
    // 12. Strategy gate and the result-side floors.
    let strategy = gate_strategy(&found, policy, below_min);
    let scored = Scored {
        strategy,
        scores: found.scores,
        adapter,
    };
    finish(st, req, &inputs, policy, scored, start)
}

/// Steps 7–8: the deadline after resolution wins over a fail-open answer (TIMEOUT, echoing any
/// tokens the server produced); a fail-open resolution answers NO_HINT with its echo. Checked
/// where the inputs are resolved and again on the owner, after the hop.
pub(super) fn settle(
    resolution: Resolution<'_>,
    start: Instant,
    deadline: Option<Instant>,
) -> Result<ResolvedInputs<'_>, pb::LookupRouteResponse> {
    if expired(deadline) {
        let echo = match &resolution {
            Resolution::Resolved(inputs) => inputs.echo.clone(),
            Resolution::FailOpen { echo, .. } => echo.clone(),
            Resolution::Tokenize { .. } => Vec::new(),
        };
        return Err(bare(reason::TIMEOUT, start, echo));
    }
    match resolution {
        Resolution::Resolved(inputs) => Ok(inputs),
        Resolution::FailOpen { echo, .. } => Err(bare(reason::NO_HINT, start, echo)),
        // The receiving core tokenizes before the hop; reaching here means it could not.
        Resolution::Tokenize { .. } => Err(bare(reason::NO_HINT, start, Vec::new())),
    }
}

/// What the index found, with the matched-tokens floor applied to the scores.
struct Found {
    strategy: Strategy,
    /// Scores at or above the floor, in the index's order.
    scores: Vec<pb::ReplicaScore>,
    /// Whether the index returned any score before the floor.
    had_scores: bool,
}

/// Steps 10–11: the index call (chain stripped by the resolver when chain matching is off), then
/// stage 1's input: the matched-tokens floor keeps replicas with matched ≥ floor.
fn query_index(
    st: &mut CoreState,
    req: &LookupRouteView<'_>,
    adapter: &str,
    inputs: &ResolvedInputs<'_>,
    policy: &ResolvedPolicy,
) -> Found {
    let derived_counts: Vec<i32>;
    let (block_hashes, block_token_counts): (BlockHashes<'_>, &[i32]) = match &inputs.chain {
        ResolvedChain::None => (BlockHashes::default(), &[]),
        ResolvedChain::Wire { hashes, counts } => (*hashes, counts),
        ResolvedChain::Derived { hashes, block_size } => {
            derived_counts = vec![*block_size; hashes.len()];
            (hashes.as_slice().into(), &derived_counts)
        }
    };
    let slo = req.slo.unwrap_or_default();
    let query = LookupQuery {
        tenant: req.tenant_id,
        model: req.model_id,
        hash_scheme: req.hash_scheme,
        adapter,
        prefix_hash: inputs.exact_hash.as_bytes(),
        token_count: inputs.exact_tokens,
        block_hashes,
        block_token_counts,
        ttft_ms: slo.ttft_ms,
        tbt_ms: slo.tbt_ms,
    };
    let view = st.index.lookup_route(&query, unix_now_ns(), &*st.policy);
    let floor = policy.minimum_matched_tokens;
    let prefix = view.strategy == Strategy::PrefixMatch;
    // The index's order is the final order (§9.6): the first MAX_SCORES_PER_ANSWER that pass
    // the floor are the top-ranked ones.
    let kept = view
        .scores
        .iter()
        .filter(|s| !prefix || floor <= 0 || s.matched_tokens >= floor)
        .take(MAX_SCORES_PER_ANSWER);
    let mut scores = spare::scores();
    for s in kept {
        let score = ScoreOf {
            replica: view.replica_id(s),
            score: s.score,
            matched_tokens: s.matched_tokens,
            estimated_cache_hit_prob: s.estimated_cache_hit_prob,
            tier: s.tier,
        };
        spare::push_score(&mut scores, score);
    }
    Found {
        strategy: view.strategy,
        scores,
        had_scores: !view.scores.is_empty(),
    }
}

/// Step 12 and the result-side floors (§10.6): the strategy gate, then stage 0 (min-prefix
/// downgrade), stage 1 (every score under the matched-tokens floor) and stage 2 (top score
/// under the routing floor) each turn the answer into NONE.
fn gate_strategy(found: &Found, policy: &ResolvedPolicy, below_min: bool) -> Strategy {
    let mut strategy = found.strategy;
    if strategy == Strategy::TenantHot && !policy.enable_tenant_hot {
        strategy = Strategy::None;
    }
    if below_min && matches!(strategy, Strategy::PrefixMatch | Strategy::TenantHot) {
        strategy = Strategy::None;
    }
    let floor = policy.minimum_matched_tokens;
    if strategy == Strategy::PrefixMatch && floor > 0 && found.had_scores && found.scores.is_empty()
    {
        strategy = Strategy::None;
    }
    let routing_floor = policy.routing_floor_score;
    if strategy == Strategy::PrefixMatch
        && routing_floor > 0.0
        && found
            .scores
            .first()
            .is_some_and(|s| s.score < routing_floor)
    {
        strategy = Strategy::None;
    }
    strategy
}

/// The gated answer before step 13.
struct Scored {
    strategy: Strategy,
    scores: Vec<pb::ReplicaScore>,
    /// The request's adapter id, echoed in the answer.
    adapter: String,
}

/// Step 13: NONE falls back to affinity (§10.7) when eligible; PREFIX_MATCH credits LFU for the
/// replicas delivered; only PREFIX_MATCH and TENANT_HOT carry scores.
fn finish(
    st: &mut CoreState,
    req: &LookupRouteView<'_>,
    inputs: &ResolvedInputs<'_>,
    policy: &ResolvedPolicy,
    scored: Scored,
    start: Instant,
) -> pb::LookupRouteResponse {
    let Scored {
        strategy,
        mut scores,
        adapter,
    } = scored;
    let echo = inputs.echo.clone();
    match strategy {
        Strategy::None => {
            if policy.affinity_routing
                && let Some(pick) = affinity_pick(st, req, inputs)
            {
                let pick = ScoreOf {
                    replica: pick,
                    ..Default::default()
                };
                spare::clear(&mut scores);
                spare::push_score(&mut scores, pick);
                return response(reason::AFFINITY_HINT, start, scores, echo, adapter);
            }
            spare::clear(&mut scores);
        }
        Strategy::PrefixMatch => {
            let delivered = &scores;
            st.index
                .credit_lfu(|r| delivered.iter().any(|s| s.replica_id == r), &*st.policy);
        }
        Strategy::TenantHot => {}
        _ => spare::clear(&mut scores),
    }
    response(strategy.reason_code(), start, scores, echo, adapter)
}

/// The affinity pick (§10.7): eligible when the raw request is well formed and a seed exists.
fn affinity_pick<'a>(
    st: &'a CoreState,
    req: &LookupRouteView<'_>,
    inputs: &ResolvedInputs<'_>,
) -> Option<&'a str> {
    if !resolve::affinity_eligible(req) {
        return None;
    }
    st.index
        .affinity_hint_fed(req.tenant_id, req.model_id, req.hash_scheme, |sink| {
            inputs.feed_affinity_seed(sink)
        })
}

/// What [`rank_pool`] is asked: an exact-prefix request (LookupPDRoute's inputs) and the pool
/// the answer must come from.
pub struct PoolQuery<'a> {
    /// The request's tenant.
    pub tenant: &'a str,
    /// The request's model.
    pub model: &'a str,
    /// The hash scheme the prefix was fingerprinted with (the topology's).
    pub hash_scheme: &'a str,
    /// The wire prefix fingerprint.
    pub prefix_hash: &'a [u8],
    /// The request's prefix token count.
    pub prefix_token_count: i32,
    /// The tenant's resolved policy.
    pub policy: &'a ResolvedPolicy,
    /// Block size for token-derived fingerprints (unused by exact requests; kept for symmetry).
    pub block_size: i32,
}

/// LookupRoute's ranking restricted to a pool, for LookupPDRoute's prefill pick: the same input
/// resolution, min-prefix gate, index call, strategy switches and floors (§10.2 steps 6–12,
/// §10.6), with the floors applied to the scores of the replicas `in_pool` accepts. No affinity
/// fallback (the caller picks within its pool); a delivered PREFIX_MATCH credits LFU for the
/// pool's best replica only. Returns the strategy and the pool's scores, best first, plus every
/// replica holding the prefix (any pool, after the matched-tokens floor).
pub fn rank_pool(
    st: &mut CoreState,
    q: &PoolQuery<'_>,
    in_pool: impl Fn(&str) -> bool,
) -> (Strategy, Vec<pb::ReplicaScore>, Vec<String>) {
    let req = LookupRouteView {
        tenant_id: q.tenant,
        model_id: q.model,
        hash_scheme: q.hash_scheme,
        prefix_hash: q.prefix_hash,
        prefix_token_count: q.prefix_token_count,
        ..Default::default()
    };
    let policy = q.policy;
    let inputs = match resolve::resolve_inputs(&req, policy.enable_chain_matching, q.block_size) {
        Resolution::Resolved(inputs) => inputs,
        _ => return (Strategy::None, Vec::new(), Vec::new()),
    };
    let min_prefix = i64::from(policy.minimum_prefix_tokens);
    let below_min = min_prefix > 0 && inputs.effective_prefix_tokens() < min_prefix;
    if below_min && !policy.affinity_routing {
        return (Strategy::None, Vec::new(), Vec::new());
    }
    let found = query_index(st, &req, "", &inputs, policy);
    let holders: Vec<String> = found.scores.iter().map(|s| s.replica_id.clone()).collect();
    let pool = Found {
        strategy: found.strategy,
        had_scores: found.had_scores,
        scores: found
            .scores
            .into_iter()
            .filter(|s| in_pool(&s.replica_id))
            .collect(),
    };
    let strategy = gate_strategy(&pool, policy, below_min);
    match strategy {
        Strategy::PrefixMatch | Strategy::TenantHot if !pool.scores.is_empty() => {
            if strategy == Strategy::PrefixMatch {
                let best = pool.scores[0].replica_id.as_str();
                st.index.credit_lfu(|r| r == best, &*st.policy);
            }
            (strategy, pool.scores, holders)
        }
        _ => (Strategy::None, Vec::new(), holders),
    }
}
