//! The owner-core half of LookupRoute (BEHAVIOUR.md §10.2 steps 6–13, §10.6, §10.7): input
//! resolution, the min-prefix gate, the index call, the strategy gate, the result-side floors,
//! the affinity fallback and LFU credit, producing the final envelope.

use std::time::Instant;

use inferencecache_proto::v1alpha1 as pb;
use inferencecache_index::index::{LookupQuery, Strategy};
use inferencecache_index::resolve::{self, Resolution, ResolvedChain};

use crate::core_state::CoreState;
use crate::lookup::{OwnerCall, reason};

/// Unix time in nanoseconds (the index's clock).
pub fn unix_now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos().min(i64::MAX as u128) as i64)
        .unwrap_or(0)
}

fn response(
    reason: &str,
    start: Instant,
    scores: Vec<pb::ReplicaScore>,
    token_ids: Vec<u32>,
    adapter_id: String,
) -> pb::LookupRouteResponse {
    pb::LookupRouteResponse {
        replica_scores: scores,
        reason_code: reason.to_string(),
        lookup_latency_us: start.elapsed().as_micros().min(i64::MAX as u128) as i64,
        token_ids,
        adapter_id,
    }
}

fn expired(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

impl CoreState {
    /// Runs steps 6–13 of LookupRoute for a call routed to this core.
    pub fn route(&mut self, call: OwnerCall) -> (pb::LookupRouteResponse, String) {
        let OwnerCall {
            req,
            model,
            tokenized,
            policy,
            start,
            deadline,
            block_size,
        } = call;
        let chain_on = policy.enable_chain_matching;
        // 6. Resolve inputs (wire fingerprints are borrowed from the request).
        let resolution = match tokenized {
            Some(tokens) => resolve::resolve_tokenized(tokens, chain_on, block_size),
            None => resolve::resolve_inputs(&req, chain_on, block_size),
        };
        // 7. The deadline after resolution wins over a fail-open answer (TIMEOUT, echoing any
        // tokens the server produced).
        if expired(deadline) {
            let echo = match &resolution {
                Resolution::Resolved(inputs) => inputs.echo.clone(),
                Resolution::FailOpen { echo, .. } => echo.clone(),
                Resolution::Tokenize { .. } => Vec::new(),
            };
            return (
                response(reason::TIMEOUT, start, Vec::new(), echo, String::new()),
                model,
            );
        }
        let inputs = match resolution {
            Resolution::Resolved(inputs) => inputs,
            // 8. Fail open (echoing the server's tokens when it produced any).
            Resolution::FailOpen { echo, .. } => {
                return (
                    response(reason::NO_HINT, start, Vec::new(), echo, String::new()),
                    model,
                );
            }
            Resolution::Tokenize { .. } => {
                // The receiving core tokenizes before the hop; reaching here means it could not.
                let r = response(
                    reason::NO_HINT,
                    start,
                    Vec::new(),
                    Vec::new(),
                    String::new(),
                );
                return (r, model);
            }
        };
        // 9. minimumPrefixTokens: a pre-gate only when affinity is off, else a downgrade.
        let min_prefix = i64::from(policy.minimum_prefix_tokens);
        let below_min = min_prefix > 0 && inputs.effective_prefix_tokens() < min_prefix;
        if below_min && !policy.affinity_routing {
            let echo = inputs.echo.clone();
            return (
                response(reason::NO_HINT, start, Vec::new(), echo, String::new()),
                model,
            );
        }
        // 10–11. The index call (chain stripped by the resolver when chain matching is off).
        let derived_hashes: Vec<Vec<u8>>;
        let derived_counts: Vec<i32>;
        let (block_hashes, block_token_counts): (&[Vec<u8>], &[i32]) = match &inputs.chain {
            ResolvedChain::None => (&[], &[]),
            ResolvedChain::Wire { hashes, counts } => (hashes, counts),
            ResolvedChain::Derived { hashes, block_size } => {
                derived_hashes = hashes.iter().map(|h| h.to_vec()).collect();
                derived_counts = vec![*block_size; hashes.len()];
                (&derived_hashes, &derived_counts)
            }
        };
        let slo = req.slo.unwrap_or_default();
        let query = LookupQuery {
            tenant: &req.tenant_id,
            model: &model,
            hash_scheme: &req.hash_scheme,
            adapter: &req.adapter_id,
            prefix_hash: inputs.exact_hash.as_bytes(),
            token_count: inputs.exact_tokens,
            block_hashes,
            block_token_counts,
            ttft_ms: slo.ttft_ms,
            tbt_ms: slo.tbt_ms,
        };
        let lookup_start = Instant::now();
        let view = self
            .index
            .lookup_route(&query, unix_now_ns(), &*self.policy);
        let mut strategy = view.strategy;
        // Stage 1 input: the matched-tokens floor keeps replicas with matched ≥ floor.
        let floor = policy.minimum_matched_tokens;
        let mut scores: Vec<pb::ReplicaScore> = view
            .scores
            .iter()
            .filter(|s| {
                strategy != Strategy::PrefixMatch || floor <= 0 || s.matched_tokens >= floor
            })
            .map(|s| pb::ReplicaScore {
                replica_id: view.replica_id(s).to_string(),
                score: s.score,
                matched_tokens: s.matched_tokens,
                estimated_cache_hit_prob: s.estimated_cache_hit_prob,
                tier: s.tier,
            })
            .collect();
        let had_scores = !view.scores.is_empty();
        // The lookup ran concurrently with the deadline in the reference: a result that arrives
        // after the deadline, or a lookup slower than the budget, is a TIMEOUT (never credited).
        let budget_blown = policy
            .lookup_budget()
            .is_some_and(|b| lookup_start.elapsed() > b);
        if expired(deadline) || budget_blown {
            let echo = inputs.echo.clone();
            return (
                response(reason::TIMEOUT, start, Vec::new(), echo, String::new()),
                model,
            );
        }
        // 12. Strategy gate.
        if strategy == Strategy::TenantHot && !policy.enable_tenant_hot {
            strategy = Strategy::None;
        }
        // Stage 0: min-prefix result downgrade.
        if below_min && matches!(strategy, Strategy::PrefixMatch | Strategy::TenantHot) {
            strategy = Strategy::None;
        }
        // Stage 1: matched-tokens floor (all dropped → NONE).
        if strategy == Strategy::PrefixMatch && floor > 0 && had_scores && scores.is_empty() {
            strategy = Strategy::None;
        }
        // Stage 2: routing floor on the top score.
        if strategy == Strategy::PrefixMatch {
            let rf = policy.routing_floor_score;
            if rf > 0.0 && scores.first().is_some_and(|s| s.score < rf) {
                strategy = Strategy::None;
            }
        }
        let echo = inputs.echo.clone();
        if strategy == Strategy::None {
            scores.clear();
            // Affinity (§10.7): eligible when the raw request is well formed and a seed exists.
            let eligible = !req.tenant_id.is_empty()
                && !model.is_empty()
                && !req.hash_scheme.is_empty()
                && req.block_hashes.len() == req.block_token_counts.len();
            if policy.affinity_routing
                && eligible
                && let Some(seed) = inputs.affinity_seed()
                && let Some(pick) =
                    self.index
                        .affinity_hint(&req.tenant_id, &model, &req.hash_scheme, &seed)
            {
                let pick = pb::ReplicaScore {
                    replica_id: pick.to_string(),
                    ..Default::default()
                };
                let adapter = req.adapter_id;
                return (
                    response(reason::AFFINITY_HINT, start, vec![pick], echo, adapter),
                    model,
                );
            }
        } else if strategy == Strategy::PrefixMatch {
            // Credit LFU only for replicas delivered in the response.
            let delivered = &scores;
            self.index.credit_lfu(
                |r| delivered.iter().any(|s| s.replica_id == r),
                &*self.policy,
            );
        } else if !matches!(strategy, Strategy::TenantHot) {
            scores.clear();
        }
        let adapter = req.adapter_id;
        (
            response(strategy.reason_code(), start, scores, echo, adapter),
            model,
        )
    }
}
