//! The receiving half of LookupRoute: steps 1–5 and tokenization on the core that received the
//! call, then the hop (or inline call) to the owner core.

use std::time::{Duration, Instant};

use inferencecache_index::PROBE_TENANT;
use inferencecache_index::policy::ResolvedPolicy;
use inferencecache_index::resolve::{self, DEFAULT_TOKENIZE_TIMEOUT, LookupRouteView};
use inferencecache_proto::v1alpha1 as pb;

use super::owner::Ask;
use super::{Answer, LookupConfig, OwnerCall, envelope, expired, reason};
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

/// Answers one LookupRoute; never fails.
pub async fn lookup_route(
    cfg: &LookupConfig,
    req: pb::LookupRouteRequest,
    start: Instant,
    caller_deadline: Option<Instant>,
) -> pb::LookupRouteResponse {
    if let Some(answered) = lookup_route_now(cfg, &(&req).into(), start, caller_deadline) {
        return answered;
    }
    let (resp, model) = lookup_route_inner(cfg, req, start, caller_deadline).await;
    record(&resp, &model, start);
    resp
}

/// Answers a LookupRoute without waiting when nothing in it has to: the owner is this core and
/// no prompt needs the tokenizer (the gRPC front end's inline path, and the first step of
/// [`lookup_route`]). `None` when the call must wait, before any side effect: the caller then
/// answers it with [`lookup_route`].
// Out of line so both front ends' calls reach one symbol (perf/sweep_stall.sh's uprobe).
#[inline(never)]
pub fn lookup_route_now(
    cfg: &LookupConfig,
    req: &LookupRouteView<'_>,
    start: Instant,
    caller_deadline: Option<Instant>,
) -> Option<pb::LookupRouteResponse> {
    if let Some(early) = early_answer(req, start) {
        return Some(early);
    }
    let policy = with_core(|st| st.policy.resolve(req.tenant_id));
    let deadline = effective_deadline(req, &policy, start, caller_deadline);
    let local = shard::current_core() == Some(owner(req.tenant_id, req.model_id));
    let tokenizes = matches!(
        resolve::resolve_inputs(req, policy.enable_chain_matching, cfg.engine_block_size),
        resolve::Resolution::Tokenize { .. }
    );
    let gated = gates(req, &policy, start, deadline);
    if gated.is_none() && (!local || tokenizes) {
        return None;
    }
    let resp = match gated {
        Some(refusal) => refusal,
        None => {
            crate::metrics::record_hop(true);
            let ask = Ask {
                model: req.model_id,
                tokenized: None,
                policy: &policy,
                start,
                deadline,
                block_size: cfg.engine_block_size,
            };
            with_core(|st| super::owner::answer_view(st, req, ask))
        }
    };
    record(&resp, req.model_id, start);
    Some(resp)
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

/// The lookup metrics of one answer.
fn record(resp: &pb::LookupRouteResponse, model: &str, start: Instant) {
    crate::metrics::record_lookup(
        model,
        &resp.reason_code,
        !resp.replica_scores.is_empty(),
        start.elapsed(),
    );
}

/// Steps 2–13; returns the response and the request's model id (for the metric labels).
async fn lookup_route_inner(
    cfg: &LookupConfig,
    mut req: pb::LookupRouteRequest,
    start: Instant,
    caller_deadline: Option<Instant>,
) -> Answer {
    let policy = with_core(|st| st.policy.resolve(&req.tenant_id));
    let deadline = effective_deadline(&(&req).into(), &policy, start, caller_deadline);
    let model = std::mem::take(&mut req.model_id);
    if let Some(refusal) = gates(&(&req).into(), &policy, start, deadline) {
        return (refusal, model);
    }
    let tokenized = match tokenize_prompt(cfg, &mut req, &model, &policy, start, deadline).await {
        Ok(tokens) => tokens,
        Err(fail_open) => return (fail_open, model),
    };
    ask_owner(OwnerCall {
        req,
        model,
        tokenized,
        policy,
        start,
        deadline,
        block_size: cfg.engine_block_size,
    })
    .await
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

/// Step 6a: the prompt_text path tokenizes here, on the tokenizer pool, never on an index core.
/// `Ok(None)` when the call carries no prompt to tokenize; `Err` is the fail-open answer.
async fn tokenize_prompt(
    cfg: &LookupConfig,
    req: &mut pb::LookupRouteRequest,
    model: &str,
    policy: &ResolvedPolicy,
    start: Instant,
    deadline: Option<Instant>,
) -> Result<Option<Vec<u32>>, pb::LookupRouteResponse> {
    let chain_on = policy.enable_chain_matching;
    if !matches!(
        resolve::resolve_inputs(&(&*req).into(), chain_on, cfg.engine_block_size),
        resolve::Resolution::Tokenize { .. }
    ) {
        return Ok(None);
    }
    // The text is only needed by the tokenizer: move it instead of copying up to 1 MiB.
    let text = std::mem::take(&mut req.prompt_text);
    let work = crate::tokenizer::global().tokenize_for_lookup(model, text);
    match deadline_race(deadline, work).await {
        None => Err(envelope(reason::TIMEOUT, start, Vec::new())),
        Some(None) => Err(envelope(reason::NO_HINT, start, Vec::new())),
        Some(Some(tokens)) => Ok(Some(tokens)),
    }
}

/// Steps 6b–13 on the owner core: inline when that is this core, else over the hop, raced
/// against the deadline. A full or gone owner queue sheds the call (fail open).
async fn ask_owner(call: OwnerCall) -> Answer {
    let (start, deadline) = (call.start, call.deadline);
    // A TIMEOUT that fires while the owner works still echoes the server's tokens (§10.4).
    let echo_on_timeout = if deadline.is_some() {
        call.tokenized.clone()
    } else {
        None
    };
    let core = owner(&call.req.tenant_id, &call.model);
    let fallback_model = call.model.clone();
    let work = mailbox::try_call(core, move |st| super::owner::answer(st, call));
    match deadline_race(deadline, work).await {
        Some(Ok(done)) => done,
        None => (
            envelope(reason::TIMEOUT, start, echo_on_timeout.unwrap_or_default()),
            fallback_model,
        ),
        Some(Err(HopError::Full)) | Some(Err(HopError::Gone)) => {
            (envelope(reason::NO_HINT, start, Vec::new()), fallback_model)
        }
    }
}
