//! gRPC request builders, calls that must succeed, and the expected-response assertions of the
//! conformance scenarios (docs/BEHAVIOUR.md §4–§12).

use super::pb;
use pb::inference_cache_client::InferenceCacheClient;
use sha2::{Digest, Sha256};
use tonic::transport::Channel;

/// `CacheTier` wire values.
pub const T_UNSPEC: i32 = 0;
pub const T1: i32 = 1;
pub const T2: i32 = 2;
pub const T3: i32 = 3;

/// Microseconds since the Unix epoch (wall clock), for `timestamp_us`.
pub fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

/// A producer timestamp 10 minutes ahead, for updates whose scores a scenario asserts as fresh.
/// Producer timestamps are trusted (docs/BEHAVIOUR.md §19.12), so TENANT_HOT recency and entry
/// freshness stay exactly 1 until then, however long a loaded machine takes between ingest and
/// lookup. (Timestamp 0 means the server's receive time: a TENANT_HOT score then decays by the
/// assertions' 1e-3 tolerance within 0.3 s.)
pub fn fresh_ts() -> i64 {
    now_us() + 10 * 60 * 1_000_000
}

/// A legacy single-entry update.
pub fn legacy_update(
    replica: &str,
    tenant: &str,
    model: &str,
    scheme: &str,
    hash: &[u8],
    tokens: i32,
) -> pb::CacheStateUpdate {
    pb::CacheStateUpdate {
        replica_id: replica.into(),
        model_id: model.into(),
        tenant_id: tenant.into(),
        hash_scheme: scheme.into(),
        prefixes: vec![pb::PrefixEntry {
            prefix_hash: hash.to_vec(),
            token_count: tokens,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Streams `updates` over one ReportCacheState call and returns the Ack.
pub async fn report(
    client: &mut InferenceCacheClient<Channel>,
    updates: Vec<pb::CacheStateUpdate>,
) -> pb::Ack {
    client
        .report_cache_state(tokio_stream::iter(updates))
        .await
        .expect("ReportCacheState")
        .into_inner()
}

/// A legacy exact lookup request.
pub fn exact_lookup(
    tenant: &str,
    model: &str,
    scheme: &str,
    hash: &[u8],
    tokens: i32,
) -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        model_id: model.into(),
        tenant_id: tenant.into(),
        hash_scheme: scheme.into(),
        prefix_hash: hash.to_vec(),
        prefix_token_count: tokens,
        ..Default::default()
    }
}

/// A chain-form update: one PrefixEntry with `block_hashes`/`block_token_counts`.
pub fn chain_update(
    replica: &str,
    tenant: &str,
    model: &str,
    scheme: &str,
    hashes: &[&[u8]],
    counts: &[i32],
) -> pb::CacheStateUpdate {
    pb::CacheStateUpdate {
        replica_id: replica.into(),
        model_id: model.into(),
        tenant_id: tenant.into(),
        hash_scheme: scheme.into(),
        prefixes: vec![pb::PrefixEntry {
            block_hashes: hashes.iter().map(|h| h.to_vec()).collect(),
            block_token_counts: counts.to_vec(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// A chain lookup request.
pub fn chain_lookup(
    tenant: &str,
    model: &str,
    scheme: &str,
    hashes: &[&[u8]],
    counts: &[i32],
) -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        model_id: model.into(),
        tenant_id: tenant.into(),
        hash_scheme: scheme.into(),
        block_hashes: hashes.iter().map(|h| h.to_vec().into()).collect(),
        block_token_counts: counts.to_vec(),
        ..Default::default()
    }
}

/// Stats payload for an update.
pub fn stats(hit_rate: f32, pressure: f32) -> Option<pb::ReplicaStats> {
    Some(pb::ReplicaStats {
        hit_rate,
        pressure,
        ..Default::default()
    })
}

/// LookupRoute that must answer OK (the contract never returns an error status).
pub async fn lookup(
    c: &mut InferenceCacheClient<Channel>,
    req: pb::LookupRouteRequest,
) -> pb::LookupRouteResponse {
    c.lookup_route(req.clone())
        .await
        .unwrap_or_else(|s| panic!("LookupRoute({req:?}) returned an error status: {s:?}"))
        .into_inner()
}

/// GetCacheState for (tenant, model).
pub async fn cache_state(
    c: &mut InferenceCacheClient<Channel>,
    tenant: &str,
    model: &str,
) -> pb::GetCacheStateResponse {
    c.get_cache_state(pb::GetCacheStateRequest {
        model_id: model.into(),
        tenant_id: tenant.into(),
    })
    .await
    .expect("GetCacheState")
    .into_inner()
}

/// GetCacheState's `summary.total_prefixes` for (tenant, model).
pub async fn total_prefixes(
    c: &mut InferenceCacheClient<Channel>,
    tenant: &str,
    model: &str,
) -> i64 {
    cache_state(c, tenant, model)
        .await
        .summary
        .expect("summary")
        .total_prefixes
}

/// One expected replica score.
#[derive(Debug, Clone)]
pub struct Exp {
    pub replica: String,
    pub score: f32,
    pub matched: i32,
    pub tier: i32,
    /// Expected `estimated_cache_hit_prob` (None = not checked).
    pub prob: Option<f32>,
}

/// Expected score row; `prob` unchecked.
pub fn exp(replica: &str, score: f32, matched: i32, tier: i32) -> Exp {
    Exp {
        replica: replica.into(),
        score,
        matched,
        tier,
        prob: None,
    }
}

/// Expected score row with `estimated_cache_hit_prob`.
pub fn expp(replica: &str, score: f32, matched: i32, tier: i32, prob: f32) -> Exp {
    Exp {
        prob: Some(prob),
        ..exp(replica, score, matched, tier)
    }
}

/// The AFFINITY_HINT row: score, matched, prob all 0, tier UNSPECIFIED.
pub fn affinity(replica: &str) -> Exp {
    expp(replica, 0.0, 0, T_UNSPEC, 0.0)
}

/// `a ≈ b` within 1e-3 relative; an expected 0 must be exactly 0.
pub fn approx(a: f32, b: f32) -> bool {
    if b == 0.0 {
        a == 0.0
    } else {
        ((a - b) / b).abs() <= 1e-3
    }
}

/// Asserts reason code and the exact ordered replica list with matched_tokens, tier, score
/// (≈ 1e-3 relative, exact when the expectation is 0) and, when given, the hit probability.
pub fn assert_resp(resp: &pb::LookupRouteResponse, reason: &str, want: &[Exp]) {
    let ctx = || format!("response: {resp:?}\nexpected {reason} with {want:?}");
    assert_eq!(resp.reason_code, reason, "reason code\n{}", ctx());
    let got: Vec<&str> = resp
        .replica_scores
        .iter()
        .map(|s| s.replica_id.as_str())
        .collect();
    let wantids: Vec<&str> = want.iter().map(|w| w.replica.as_str()).collect();
    assert_eq!(got, wantids, "replica list/order\n{}", ctx());
    for (g, w) in resp.replica_scores.iter().zip(want) {
        assert_eq!(
            g.matched_tokens,
            w.matched,
            "matched_tokens of {}\n{}",
            w.replica,
            ctx()
        );
        assert_eq!(g.tier, w.tier, "tier of {}\n{}", w.replica, ctx());
        assert!(
            approx(g.score, w.score),
            "score of {}\n{}",
            w.replica,
            ctx()
        );
        if let Some(p) = w.prob {
            assert!(
                approx(g.estimated_cache_hit_prob, p),
                "estimated_cache_hit_prob of {}\n{}",
                w.replica,
                ctx()
            );
        }
    }
}

/// A token_ids lookup request (hash scheme `vllm`).
pub fn tokens_req(tenant: &str, model: &str, tokens: Vec<u32>) -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        model_id: model.into(),
        tenant_id: tenant.into(),
        hash_scheme: "vllm".into(),
        token_ids: tokens,
        ..Default::default()
    }
}

/// `r` with `adapter_id` set to `a`.
pub fn with_adapter(mut r: pb::LookupRouteRequest, a: &str) -> pb::LookupRouteRequest {
    r.adapter_id = a.into();
    r
}

/// Subscriber-style ingest of `tokens` (docs/BEHAVIOUR.md §17): one legacy entry per full 16-token
/// block, prefix_hash = BE fingerprint, cumulative token_count, tier T1, timestamp 0.
pub fn per_block_update(
    replica: &str,
    tenant: &str,
    model: &str,
    tokens: &[u32],
) -> pb::CacheStateUpdate {
    let (hashes, _) = super::fingerprint_chain(tokens, 16);
    pb::CacheStateUpdate {
        replica_id: replica.into(),
        model_id: model.into(),
        tenant_id: tenant.into(),
        hash_scheme: "vllm".into(),
        prefixes: hashes
            .iter()
            .enumerate()
            .map(|(i, h)| pb::PrefixEntry {
                prefix_hash: h.clone(),
                token_count: 16 * (i as i32 + 1),
                tier: T1,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// A single-hash CacheEvent.
pub fn cache_event(
    ty: pb::cache_event::Type,
    tenant: &str,
    model: &str,
    replica: &str,
    hash: &[u8],
    adapter: &str,
) -> pb::CacheEvent {
    pb::CacheEvent {
        r#type: ty as i32,
        replica_id: replica.into(),
        model_id: model.into(),
        tenant_id: tenant.into(),
        prefix_hash: hash.to_vec(),
        adapter_id: adapter.into(),
        ..Default::default()
    }
}

/// PublishEvent that must be accepted.
pub async fn publish_event(c: &mut InferenceCacheClient<Channel>, e: pb::CacheEvent) {
    let ack = c.publish_event(e).await.expect("PublishEvent").into_inner();
    assert!(ack.accepted);
    assert_eq!(ack.reason_code, "");
}

/// The affinity pick of docs/BEHAVIOUR.md §8.6: `sorted(replicas)[BE-u64(SHA-256(seed)[0..8]) mod n]`.
pub fn pick<'a>(sorted: &[&'a str], seed: &[u8]) -> &'a str {
    let d = Sha256::digest(seed);
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    sorted[(u64::from_be_bytes(b) % sorted.len() as u64) as usize]
}

/// The chain affinity seed of docs/BEHAVIOUR.md §10.7: `u32_be(len(hash)) ‖ hash` per block.
pub fn chain_seed(hashes: &[Vec<u8>]) -> Vec<u8> {
    let mut s = Vec::new();
    for h in hashes {
        s.extend_from_slice(&(h.len() as u32).to_be_bytes());
        s.extend_from_slice(h);
    }
    s
}
