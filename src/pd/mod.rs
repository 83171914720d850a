//! LookupPDRoute: prefill/decode topologies registered per tenant on the controller-facing
//! listener (`PUT|GET|DELETE /pd-topologies/{tenant}/{ref}`, docs/BEHAVIOUR.md §11) and the
//! prefill + decode pick for a request.
//!
//! A topology names a prefill pool, a decode pool (replica ids as producers report them), a
//! transport hint passed through verbatim (`nixl`, `mooncake`, …) and the hash scheme the
//! gateway fingerprints prefixes with. A request is answered on the core owning its
//! `(tenant, model)` partition, like LookupRoute:
//!
//! * **prefill** = the best replica of the prefill pool by LookupRoute's ranking
//!   ([`crate::lookup::rank_pool`]: policy floors, strategy switches and the tenant's budget
//!   included) → reason `PREFIX_MATCH` (or `TENANT_HOT`); when no prefill replica ranks, and the
//!   tenant's policy allows affinity, a rendezvous-hash pick over the prefill pool seeded by the
//!   prefix → `AFFINITY_HINT` (the same prefix always lands on the same prefill replica).
//! * **decode** = the least loaded replica of the decode pool by the stats its engine reports
//!   (`ReplicaStats.pressure` of the `(tenant, model)`), where a decode replica that holds the
//!   same prefix counts [`PD_DECODE_AFFINITY_BONUS`] less loaded; replicas without reported stats
//!   come after those with; ties go to the rendezvous hash of the prefix, so equal loads keep a
//!   prefix on one decode replica.
//! * everything else fails open with `NO_HINT` and no replicas: unknown topology, empty or
//!   over-long names, an empty prefix, the probe tenant, a full or gone owner queue, the caller's
//!   deadline or the tenant's lookup budget expiring, affinity disabled without a ranked replica.
//!
//! With no topology registered at all, the reference's stub (`{reason_code: "NO_HINT"}`, no
//! metric).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use inferencecache_index::PROBE_TENANT;
use inferencecache_index::index::Strategy;
use inferencecache_proto::v1alpha1 as pb;
use serde::{Deserialize, Serialize};

use crate::limits::{
    MAX_ID_BYTES, MAX_PD_POOL_REPLICAS, MAX_PD_TOPOLOGIES, PD_DECODE_AFFINITY_BONUS,
};
use crate::lookup::{PoolQuery, deadline_race, rank_pool};
use crate::runtime::mailbox;
use crate::shard::{owner, with_core};
use crate::tenant_registry::PutError;
use crate::tenant_registry::{Full, Lookup, TenantRegistry, check_name};

/// LookupPDRoute reason codes.
pub mod reason {
    /// The prefill replica holds the prefix (LookupRoute's ranking within the prefill pool).
    pub const PREFIX_MATCH: &str = "PREFIX_MATCH";
    /// The prefill replica is the best warm replica of the pool (LookupRoute's TENANT_HOT).
    pub const TENANT_HOT: &str = "TENANT_HOT";
    /// No prefill replica ranks: a stable pick over the prefill pool.
    pub const AFFINITY_HINT: &str = "AFFINITY_HINT";
    /// No hint (every fail-open path, and the reference's stub).
    pub const NO_HINT: &str = "NO_HINT";
}

/// The `rpc` label of `inferencecache_rpc_calls_total`.
const RPC: &str = "LookupPDRoute";

/// One registered topology.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Topology {
    /// Replica ids that run prefill.
    pub prefill_pool: Vec<String>,
    /// Replica ids that run decode.
    pub decode_pool: Vec<String>,
    /// Echoed as `transport_hint` (e.g. `nixl`, `mooncake`).
    #[serde(default)]
    pub transport_hint: String,
    /// The hash scheme of the request's `prefix_hash` (as producers report it, e.g. `vllm`).
    pub hash_scheme: String,
}

/// The registered topologies, [`MAX_PD_TOPOLOGIES`] in all (no separate per-tenant bound).
static REGISTRY: TenantRegistry<Topology> =
    TenantRegistry::new(MAX_PD_TOPOLOGIES, MAX_PD_TOPOLOGIES);

/// Stores `tenant/reference` from a `PUT` body (replacing any earlier one).
pub fn put(tenant: &str, reference: &str, body: &[u8]) -> Result<(), PutError> {
    check_name("tenant", tenant)?;
    check_name("topology ref", reference)?;
    let t: Topology = serde_json::from_slice(body)
        .map_err(|e| PutError::Invalid(format!("decode pd topology: {e}")))?;
    check_name("hashScheme", &t.hash_scheme)?;
    if t.transport_hint.len() > MAX_ID_BYTES {
        return Err(PutError::Invalid(format!(
            "transportHint is at most {MAX_ID_BYTES} bytes"
        )));
    }
    for (what, pool) in [
        ("prefillPool", &t.prefill_pool),
        ("decodePool", &t.decode_pool),
    ] {
        if pool.is_empty() || pool.len() > MAX_PD_POOL_REPLICAS {
            if pool.len() > MAX_PD_POOL_REPLICAS {
                crate::metrics::record_limit_hit("pd_pool_replicas");
            }
            return Err(PutError::Invalid(format!(
                "{what} must list 1 to {MAX_PD_POOL_REPLICAS} replicas"
            )));
        }
        for r in pool {
            check_name(what, r)?;
        }
    }
    REGISTRY.put(tenant, reference, t).map_err(|full| {
        crate::metrics::record_limit_hit("pd_topologies");
        let n = match full {
            Full::Tenant(n) | Full::Total(n) => n,
        };
        PutError::Full(format!("{n} topologies already registered"))
    })
}

/// Removes `tenant/reference`; whether it existed.
pub fn delete(tenant: &str, reference: &str) -> bool {
    REGISTRY.delete(tenant, reference)
}

/// `GET /pd-topologies/{tenant}`: `{ref: topology}` as a JSON object (`{}` when none).
pub fn list_json(tenant: &str) -> String {
    REGISTRY.with_tenant(tenant, |rows| {
        let m: BTreeMap<&str, &Topology> = rows.collect();
        serde_json::to_string(&m).unwrap_or_else(|_| "{}".into())
    })
}

/// `GET /pd-topologies/{tenant}/{ref}`.
pub fn get_json(tenant: &str, reference: &str) -> Option<String> {
    let t = REGISTRY.get(tenant, reference)?;
    serde_json::to_string(&*t).ok()
}

fn no_hint() -> pb::LookupPdRouteResponse {
    pb::LookupPdRouteResponse {
        reason_code: reason::NO_HINT.into(),
        ..Default::default()
    }
}

/// Answers one LookupPDRoute; never fails. `caller_deadline` is the request's `grpc-timeout`.
pub async fn lookup_pd_route(
    req: pb::LookupPdRouteRequest,
    start: Instant,
    caller_deadline: Option<Instant>,
    block_size: i32,
) -> pb::LookupPdRouteResponse {
    let resp = match REGISTRY.find(&req.tenant_id, &req.pd_topology_ref) {
        Lookup::NothingRegistered => return no_hint(),
        Lookup::Found(t) => answer(req, t, start, caller_deadline, block_size).await,
        Lookup::Missing => no_hint(),
    };
    crate::metrics::record_rpc(RPC, reason_label(&resp.reason_code));
    resp
}

fn reason_label(code: &str) -> &'static str {
    match code {
        reason::PREFIX_MATCH => reason::PREFIX_MATCH,
        reason::TENANT_HOT => reason::TENANT_HOT,
        reason::AFFINITY_HINT => reason::AFFINITY_HINT,
        _ => reason::NO_HINT,
    }
}

async fn answer(
    req: pb::LookupPdRouteRequest,
    t: Arc<Topology>,
    start: Instant,
    caller_deadline: Option<Instant>,
    block_size: i32,
) -> pb::LookupPdRouteResponse {
    let names = [&req.tenant_id, &req.model_id];
    if req.tenant_id == PROBE_TENANT
        || req.prefix_hash.is_empty()
        || names.iter().any(|n| n.is_empty() || n.len() > MAX_ID_BYTES)
    {
        return no_hint();
    }
    let policy = with_core(|st| st.policy.resolve(&req.tenant_id));
    let mut deadline = caller_deadline;
    if let Some(budget) = policy.lookup_budget() {
        let d = start + budget;
        deadline = Some(deadline.map_or(d, |c| c.min(d)));
    }
    if deadline.is_some_and(|d| Instant::now() >= d) {
        return no_hint();
    }
    let core = owner(&req.tenant_id, &req.model_id);
    let work = mailbox::try_call(core, move |st| {
        let q = PoolQuery {
            tenant: &req.tenant_id,
            model: &req.model_id,
            hash_scheme: &t.hash_scheme,
            prefix_hash: &req.prefix_hash,
            prefix_token_count: req.prefix_token_count,
            policy: &policy,
            block_size,
        };
        let in_prefill = |r: &str| t.prefill_pool.iter().any(|p| p == r);
        let (strategy, scores, holders) = rank_pool(st, &q, in_prefill);
        let (prefill, code) = match (strategy, scores.first()) {
            (Strategy::PrefixMatch, Some(s)) => (s.replica_id.clone(), reason::PREFIX_MATCH),
            (Strategy::TenantHot, Some(s)) => (s.replica_id.clone(), reason::TENANT_HOT),
            _ if policy.affinity_routing => (
                rendezvous(&t.prefill_pool, &req.prefix_hash).to_string(),
                reason::AFFINITY_HINT,
            ),
            _ => return no_hint(),
        };
        let stats = st.cache_state(&req.tenant_id, &req.model_id).replicas;
        let decode = pick_decode(&t.decode_pool, &stats, &holders, &req.prefix_hash);
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return no_hint();
        }
        pb::LookupPdRouteResponse {
            prefill_replica_id: prefill,
            decode_replica_id: decode.to_string(),
            transport_hint: t.transport_hint.clone(),
            reason_code: code.into(),
        }
    });
    match deadline_race(deadline, work).await {
        Some(Ok(resp)) => resp,
        _ => no_hint(),
    }
}

/// The rendezvous weight of `replica` for `seed`.
fn weight(replica: &str, seed: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(replica.as_bytes(), seed)
}

/// The pool member with the highest rendezvous weight for `prefix` (the pool is never empty:
/// registration refuses empty pools).
fn rendezvous<'a>(pool: &'a [String], prefix: &[u8]) -> &'a str {
    let seed = xxhash_rust::xxh3::xxh3_64(prefix);
    pool.iter()
        .max_by_key(|r| (weight(r, seed), std::cmp::Reverse(r.as_str())))
        .map_or("", String::as_str)
}

/// The least loaded decode replica (see the module comment).
fn pick_decode<'a>(
    pool: &'a [String],
    stats: &[pb::ReplicaStats],
    holders: &[String],
    prefix: &[u8],
) -> &'a str {
    let seed = xxhash_rust::xxh3::xxh3_64(prefix);
    let key = |r: &String| {
        let reported = stats.iter().find(|s| &s.replica_id == r);
        let bonus = if holders.contains(r) {
            PD_DECODE_AFFINITY_BONUS
        } else {
            0.0
        };
        let load = reported.map_or(0.0, |s| s.pressure) - bonus;
        (reported.is_none(), load, std::cmp::Reverse(weight(r, seed)))
    };
    pool.iter()
        .map(|r| (key(r), r))
        .min_by(|(a, ra), (b, rb)| {
            a.0.cmp(&b.0)
                .then(a.1.total_cmp(&b.1))
                .then(a.2.cmp(&b.2))
                .then(ra.cmp(rb))
        })
        .map_or("", |(_, r)| r.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn stat(id: &str, pressure: f32) -> pb::ReplicaStats {
        pb::ReplicaStats {
            replica_id: id.into(),
            pressure,
            ..Default::default()
        }
    }

    #[test]
    fn decode_is_the_least_pressured_reported_replica() {
        let pool = ids(&["d1", "d2", "d3"]);
        let stats = [stat("d1", 0.9), stat("d2", 0.2), stat("d3", 0.5)];
        assert_eq!(pick_decode(&pool, &stats, &[], b"p"), "d2");
    }

    #[test]
    fn a_decode_replica_holding_the_prefix_wins_within_the_bonus() {
        let pool = ids(&["d1", "d2"]);
        let stats = [stat("d1", 0.25), stat("d2", 0.2)];
        assert_eq!(pick_decode(&pool, &stats, &ids(&["d1"]), b"p"), "d1");
        // Beyond the bonus, load wins.
        let stats = [stat("d1", 0.5), stat("d2", 0.2)];
        assert_eq!(pick_decode(&pool, &stats, &ids(&["d1"]), b"p"), "d2");
    }

    #[test]
    fn unreported_decode_replicas_come_last_and_ties_are_stable_per_prefix() {
        let pool = ids(&["d1", "d2", "d3"]);
        assert_eq!(pick_decode(&pool, &[stat("d3", 0.99)], &[], b"p"), "d3");
        // No stats at all: a stable pick per prefix, spread over the pool.
        let picks: std::collections::BTreeSet<&str> = (0..64u32)
            .map(|i| pick_decode(&pool, &[], &[], &i.to_be_bytes()))
            .collect();
        assert_eq!(picks.len(), 3);
        for i in 0..16u32 {
            let seed = i.to_be_bytes();
            assert_eq!(
                pick_decode(&pool, &[], &[], &seed),
                pick_decode(&pool, &[], &[], &seed)
            );
            assert_eq!(
                pick_decode(&pool, &[], &[], &seed),
                rendezvous(&pool, &seed),
                "without stats, decode is the rendezvous pick"
            );
        }
    }

    #[test]
    fn rendezvous_is_independent_of_pool_order() {
        let a = ids(&["p1", "p2", "p3", "p4"]);
        let b = ids(&["p4", "p2", "p1", "p3"]);
        for i in 0..32u32 {
            assert_eq!(
                rendezvous(&a, &i.to_le_bytes()),
                rendezvous(&b, &i.to_le_bytes())
            );
        }
    }
}
