//! The receiving half of LookupRoute, on the core that received the call: the one decision
//! (steps 1–6: early answers, the tenant's policy, the deadline, the gates, the owner and the
//! input resolution, each worked out once), then for a call that must wait, tokenization and
//! the hop to the owner core with what was decided.

use std::time::{Duration, Instant};

use inferencecache_index::PROBE_TENANT;
use inferencecache_index::policy::ResolvedPolicy;
use inferencecache_index::resolve::{self, DEFAULT_TOKENIZE_TIMEOUT, Detached, LookupRouteView};
use inferencecache_proto::v1alpha1 as pb;

use super::request::LookupRequest;
use super::{LookupConfig, OwnerCall, envelope, expired, reason};
use crate::limits::MAX_ID_BYTES;
use crate::runtime::mailbox::{self, HopError};
use crate::shard::{self, owner, with_core};

/// Resolves to `None` when `deadline` fires first, else to the work's output (also used by
/// LookupPDRoute).
pub async fn deadline_race<T>(
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

/// What the first look at a LookupRoute decides, once per request.
pub enum Decision {
    /// Answered on this core (its metrics recorded): an early answer, a gate, a fail-open
    /// resolution, or the whole call when this core owns the partition and nothing waits.
    Answered(pb::LookupRouteResponse),
    /// The partition is another core's: ask it, with the inputs resolved here.
    Hop {
        /// Owner, policy and deadline.
        decided: Decided,
        /// The resolved inputs (they never need the tokenizer).
        inputs: Detached,
    },
    /// The prompt text must be tokenized before the owner can be asked.
    Tokenize(Decided),
}

/// What is decided about a call that must wait, besides its inputs.
pub struct Decided {
    /// The core owning the `(tenant, model)` partition.
    pub owner: usize,
    /// The tenant's resolved policy (one snapshot for the whole call).
    pub policy: ResolvedPolicy,
    /// Handler entry time.
    pub start: Instant,
    /// The effective deadline, if any.
    pub deadline: Option<Instant>,
    /// Engine block size for token-derived fingerprints.
    pub block_size: i32,
}

/// A call that must wait (for the tokenizer or the owner core), with its request.
pub struct Waiting {
    req: LookupRequest,
    decided: Decided,
    /// `None` until the prompt is tokenized.
    inputs: Option<Detached>,
}

impl Decision {
    /// The call that must wait for this decision, owning `req` (the request decided on), or
    /// the answer when there is nothing to wait for.
    pub fn waiting(self, req: LookupRequest) -> Result<Waiting, pb::LookupRouteResponse> {
        let (decided, inputs) = match self {
            Decision::Answered(resp) => return Err(resp),
            Decision::Hop { decided, inputs } => (decided, Some(inputs)),
            Decision::Tokenize(decided) => (decided, None),
        };
        Ok(Waiting {
            req,
            decided,
            inputs,
        })
    }
}

/// Answers one LookupRoute decoded by the general path; never fails.
pub async fn answer_request(
    cfg: &LookupConfig,
    req: pb::LookupRouteRequest,
    start: Instant,
    caller_deadline: Option<Instant>,
) -> pb::LookupRouteResponse {
    let decision = decide(cfg, &(&req).into(), start, caller_deadline);
    match decision.waiting(LookupRequest::Decoded(req)) {
        Ok(waiting) => answer_waiting(waiting).await,
        Err(answered) => answered,
    }
}

/// Decides a LookupRoute (docs/BEHAVIOUR.md §10.2 steps 1–6), answering it now when nothing in
/// it has to wait. Each input is worked out once: the policy, the deadline, the owner and the
/// resolution travel with a call that must wait.
// Out of line so both front ends' calls reach one symbol (perf/sweep_stall.sh's uprobe).
#[inline(never)]
pub fn decide(
    cfg: &LookupConfig,
    req: &LookupRouteView<'_>,
    start: Instant,
    caller_deadline: Option<Instant>,
) -> Decision {
    if let Some(early) = early_answer(req, start) {
        return Decision::Answered(early);
    }
    let policy = with_core(|st| st.policy.resolve(req.tenant_id));
    let deadline = effective_deadline(req, &policy, start, caller_deadline);
    if let Some(refusal) = gates(req, &policy, start, deadline) {
        return Decision::Answered(recorded(refusal, req.model_id, start));
    }
    let decided = Decided {
        owner: owner(req.tenant_id, req.model_id),
        policy,
        start,
        deadline,
        block_size: cfg.engine_block_size,
    };
    let chain_on = decided.policy.enable_chain_matching;
    // 6. Resolve inputs: once, here, whichever core answers.
    let resolution = resolve::resolve_inputs(req, chain_on, decided.block_size);
    if matches!(resolution, resolve::Resolution::Tokenize { .. }) {
        return Decision::Tokenize(decided);
    }
    let inputs = match super::owner::settle(resolution, start, deadline) {
        Ok(inputs) => inputs,
        Err(fail_open) => return Decision::Answered(recorded(fail_open, req.model_id, start)),
    };
    if shard::current_core() != Some(decided.owner) {
        let inputs = resolve::Resolution::Resolved(inputs).detach();
        return Decision::Hop { decided, inputs };
    }
    crate::metrics::record_hop(true);
    let resp = with_core(|st| super::owner::answer_resolved(st, req, inputs, &decided));
    Decision::Answered(recorded(resp, req.model_id, start))
}

/// Answers a call that must wait: tokenizes its prompt if it has one, then asks the owner
/// core, raced against the deadline.
pub async fn answer_waiting(waiting: Waiting) -> pb::LookupRouteResponse {
    let Waiting {
        mut req,
        decided,
        inputs,
    } = waiting;
    let start = decided.start;
    let inputs = match inputs {
        Some(inputs) => inputs,
        None => match tokenize_prompt(&mut req, &decided).await {
            Ok(inputs) => inputs,
            Err(fail_open) => return recorded(fail_open, req.view().model_id, start),
        },
    };
    let label = req.model_label();
    let call = OwnerCall {
        req,
        inputs,
        decided,
    };
    recorded(ask_owner(call).await, label.as_str(), start)
}

/// Step 1 (the probe tenant, latency 0) and names too long to match: answered before anything
/// else, without touching the index.
fn early_answer(req: &LookupRouteView<'_>, start: Instant) -> Option<pb::LookupRouteResponse> {
    if req.tenant_id == PROBE_TENANT {
        crate::metrics::record_lookup(req.model_id, reason::NO_HINT, false, Duration::ZERO);
        let mut r = envelope(reason::NO_HINT, start, Vec::new());
        r.lookup_latency_us = 0;
        return Some(r);
    }
    let ids = [
        &req.tenant_id,
        &req.model_id,
        &req.hash_scheme,
        &req.adapter_id,
    ];
    if ids.iter().any(|id| id.len() > MAX_ID_BYTES) {
        crate::metrics::record_lookup(req.model_id, reason::NO_HINT, false, start.elapsed());
        return Some(envelope(reason::NO_HINT, start, Vec::new()));
    }
    None
}

/// `resp` once the lookup metrics of it are recorded.
fn recorded(resp: pb::LookupRouteResponse, model: &str, start: Instant) -> pb::LookupRouteResponse {
    crate::metrics::record_lookup(
        model,
        &resp.reason_code,
        !resp.replica_scores.is_empty(),
        start.elapsed(),
    );
    resp
}

/// Steps 2–3: min(caller deadline, now + lookupTimeoutMs), else the default tokenize deadline
/// when the call will tokenize.
fn effective_deadline(
    req: &LookupRouteView<'_>,
    policy: &ResolvedPolicy,
    start: Instant,
    caller_deadline: Option<Instant>,
) -> Option<Instant> {
    let mut deadline = caller_deadline;
    if let Some(budget) = policy.lookup_budget() {
        let d = start + budget;
        deadline = Some(deadline.map_or(d, |c| c.min(d)));
    }
    if deadline.is_none() && resolve::will_tokenize(req, policy.enable_chain_matching) {
        deadline = Some(start + DEFAULT_TOKENIZE_TIMEOUT);
    }
    deadline
}

/// Steps 4–5: an already expired deadline, then the requireChain gate.
fn gates(
    req: &LookupRouteView<'_>,
    policy: &ResolvedPolicy,
    start: Instant,
    deadline: Option<Instant>,
) -> Option<pb::LookupRouteResponse> {
    if expired(deadline) {
        return Some(envelope(reason::TIMEOUT, start, Vec::new()));
    }
    if policy.require_chain && !resolve::has_valid_wire_chain(req) {
        return Some(envelope(reason::POLICY_REQUIRES_CHAIN, start, Vec::new()));
    }
    None
}

/// Step 6a: the prompt_text path tokenizes here, on the tokenizer pool, never on an index core,
/// then resolves the tokens. `Err` is the fail-open answer.
async fn tokenize_prompt(
    req: &mut LookupRequest,
    decided: &Decided,
) -> Result<Detached, pb::LookupRouteResponse> {
    let (start, deadline) = (decided.start, decided.deadline);
    let text = req.take_prompt_text();
    let work = crate::tokenizer::global().tokenize_for_lookup(req.view().model_id, text);
    let tokens = match deadline_race(deadline, work).await {
        None => return Err(envelope(reason::TIMEOUT, start, Vec::new())),
        Some(None) => return Err(envelope(reason::NO_HINT, start, Vec::new())),
        Some(Some(tokens)) => tokens,
    };
    let chain_on = decided.policy.enable_chain_matching;
    let resolution = resolve::resolve_tokenized(tokens, chain_on, decided.block_size);
    let inputs = super::owner::settle(resolution, start, deadline)?;
    Ok(resolve::Resolution::Resolved(inputs).detach())
}

/// Steps 7–13 on the owner core: over the hop when that is another core, raced against the
/// deadline. A full or gone owner queue sheds the call (fail open).
async fn ask_owner(call: OwnerCall) -> pb::LookupRouteResponse {
    let (start, deadline) = (call.decided.start, call.decided.deadline);
    // A TIMEOUT that fires while the owner works still echoes the server's tokens (§10.4).
    let echo_on_timeout = match &call.inputs {
        Detached::Owned(inputs) if deadline.is_some() => inputs.echo.clone(),
        _ => Vec::new(),
    };
    let work = mailbox::try_call(call.decided.owner, move |st| super::owner::answer(st, call));
    match deadline_race(deadline, work).await {
        // The request comes back to be freed on the core that allocated it.
        Some(Ok((resp, _req))) => resp,
        None => envelope(reason::TIMEOUT, start, echo_on_timeout),
        Some(Err(HopError::Full)) | Some(Err(HopError::Gone)) => {
            envelope(reason::NO_HINT, start, Vec::new())
        }
    }
}
