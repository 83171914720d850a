//! Independent review: adversarial end-to-end tests of the LookupRoute request path and the
//! ingest/event RPCs against BEHAVIOUR.md (§4, §5, §7.4, §8, §10, §16, §19, §21). Each test is
//! named after the rule it pins and runs with `--shards 1` and `--shards 2`.

#[macro_use]
mod common;

use common::*;
use sha2::{Digest, Sha256};

const MIN_US: i64 = 60_000_000;

/// §8.6: `sorted(replicas)[BE-u64(SHA-256(seed)[0..8]) mod n]`.
fn pick<'a>(sorted: &[&'a str], seed: &[u8]) -> &'a str {
    let d = Sha256::digest(seed);
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    sorted[(u64::from_be_bytes(b) % sorted.len() as u64) as usize]
}

/// §10.7 chain seed: `u32_be(len(hash)) ‖ hash` per block.
fn chain_seed(hashes: &[Vec<u8>]) -> Vec<u8> {
    let mut s = Vec::new();
    for h in hashes {
        s.extend_from_slice(&(h.len() as u32).to_be_bytes());
        s.extend_from_slice(h);
    }
    s
}

fn with_adapter(mut r: pb::LookupRouteRequest, a: &str) -> pb::LookupRouteRequest {
    r.adapter_id = a.into();
    r
}

fn tokens_req(tenant: &str, model: &str, tokens: Vec<u32>) -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        model_id: model.into(),
        tenant_id: tenant.into(),
        hash_scheme: "vllm".into(),
        token_ids: tokens,
        ..Default::default()
    }
}

/// Subscriber-style ingest: one legacy entry per full 16-token block, cumulative counts.
fn per_block_update(
    replica: &str,
    tenant: &str,
    model: &str,
    tokens: &[u32],
) -> pb::CacheStateUpdate {
    let (hashes, _) = fingerprint_chain(tokens, 16);
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

fn ev(
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

async fn publish(
    c: &mut pb::inference_cache_client::InferenceCacheClient<tonic::transport::Channel>,
    e: pb::CacheEvent,
) {
    let ack = c.publish_event(e).await.expect("PublishEvent").into_inner();
    assert!(ack.accepted);
    assert_eq!(ack.reason_code, "");
}

// ---- §19.11 empty prefix_hash key ------------------------------------------------------------

/// §19.11 / §4.2: an empty `prefix_hash` is indexed under the empty key; a request with no
/// fingerprint at all does an exact lookup on it (PREFIX_MATCH), and on a miss can still get
/// TENANT_HOT; without warm stats there is no seed → NO_HINT (not AFFINITY_HINT).
async fn s19_11_empty_key(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let mut warm = legacy_update("warm", "t2", "m", "vllm", b"other", 100);
    warm.stats = stats(0.9, 0.0);
    assert!(
        report(
            &mut c,
            vec![
                legacy_update("r1", "t", "m", "vllm", b"", 100),
                warm,
                legacy_update("cold", "t3", "m", "vllm", b"other", 100),
            ]
        )
        .await
        .accepted
    );
    let bare = |t: &str| pb::LookupRouteRequest {
        model_id: "m".into(),
        tenant_id: t.into(),
        hash_scheme: "vllm".into(),
        ..Default::default()
    };
    let r = lookup(&mut c, with_adapter(bare("t"), "")).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r1", 100.0, 100, T1)]);
    let r = lookup(&mut c, with_adapter(bare("t2"), "lora-z")).await;
    assert_resp(&r, "TENANT_HOT", &[exp("warm", 0.9, 0, T_UNSPEC)]);
    assert_eq!(r.adapter_id, "lora-z", "TENANT_HOT echoes adapter (§10.4)");
    let r = lookup(&mut c, with_adapter(bare("t3"), "lora-z")).await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(
        r.adapter_id, "lora-z",
        "index-derived NO_HINT echoes adapter"
    );
    let s = cache_state(&mut c, "t", "m").await;
    assert_eq!(s.summary.unwrap().total_prefixes, 1, "empty key counts");
}
shards_1_and_2!(
    s19_11_empty_key,
    s19_11_empty_prefix_hash_key_shards_1,
    s19_11_empty_prefix_hash_key_shards_2
);

// ---- §19.3 / §21.8 chain matching off: token_ids exact on last block, TENANT_HOT ----------------

async fn s19_3_chain_off_tokens(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"co","strategy":{"enableChainMatching":false}},{"namespace":"ci"}]}"#,
    );
    let mut c = srv.client().await;
    let toks: Vec<u32> = (1000..1064).collect();
    let mut ups = Vec::new();
    for t in ["co", "ci"] {
        ups.push(per_block_update("holder", t, "m", &toks));
        let mut w = legacy_update("warm", t, "m", "vllm", b"other", 64);
        w.stats = stats(0.9, 0.0);
        ups.push(w);
    }
    assert!(report(&mut c, ups).await.accepted);
    // Chain off: exact key = last block hash, matched = stored cumulative count 64 (two
    // replicas serve the scope → distinguishing power 1/2).
    let r = lookup(&mut c, tokens_req("co", "m", toks.clone())).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("holder", 32.0, 64, T1)]);
    assert!(r.token_ids.is_empty(), "token_ids never echoed");
    // Chain off, 40 tokens → 2 blocks: exact key = block 2 hash, stored count 32.
    let r = lookup(&mut c, tokens_req("co", "m", toks[..40].to_vec())).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("holder", 16.0, 32, T1)]);
    // Chain off, novel tokens → exact miss → TENANT_HOT is possible (§19.3).
    let novel: Vec<u32> = (90_000_000..90_000_064).collect();
    let r = lookup(
        &mut c,
        with_adapter(tokens_req("co", "m", novel.clone()), "a"),
    )
    .await;
    assert_resp(&r, "TENANT_HOT", &[exp("warm", 0.9, 0, T_UNSPEC)]);
    assert_eq!(r.adapter_id, "a");
    // Chain on: token_ids are a chain request → never TENANT_HOT (§19.2) → affinity.
    let r = lookup(&mut c, tokens_req("ci", "m", novel.clone())).await;
    assert_eq!(r.reason_code, "AFFINITY_HINT", "{r:?}");
    let (h, _) = fingerprint_chain(&novel, 16);
    let want = pick(&["holder", "warm"], &chain_seed(&h));
    assert_resp(&r, "AFFINITY_HINT", &[affinity(want)]);
}
shards_1_and_2!(
    s19_3_chain_off_tokens,
    s19_3_chain_off_token_ids_exact_last_block_and_tenant_hot_shards_1,
    s19_3_chain_off_token_ids_exact_last_block_and_tenant_hot_shards_2
);

// ---- §21.9 / §21.10 / §10.3 chain matching off with wire chains --------------------------------

async fn s21_10_chain_off_wire_chain(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"co","strategy":{"enableChainMatching":false}}]}"#,
    );
    let mut c = srv.client().await;
    assert!(
        report(
            &mut c,
            vec![
                legacy_update("r-1", "co", "m", "vllm", b"p", 100),
                legacy_update("r-2", "co", "m", "vllm", b"\x02", 32),
                legacy_update("r-3", "co", "m", "vllm", b"\x03", 32),
            ]
        )
        .await
        .accepted
    );
    let mut req = exact_lookup("co", "m", "vllm", b"p", 100);
    req.block_hashes = vec![b"x".to_vec(), b"y".to_vec()];
    req.block_token_counts = vec![16];
    // Malformed chain ignored, exact lookup proceeds (§21.10).
    let r = lookup(&mut c, with_adapter(req.clone(), "")).await;
    assert_resp(
        &r,
        "PREFIX_MATCH",
        &[exp("r-1", 100.0 * 2.0 / 3.0, 100, T1)],
    );
    // Miss with the malformed chain: affinity refused (raw chain unbalanced) → NO_HINT, and it is
    // index-derived so the adapter is echoed.
    req.prefix_hash = b"q".to_vec();
    let r = lookup(&mut c, with_adapter(req.clone(), "lx")).await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.adapter_id, "lx", "index-derived NO_HINT echoes adapter");
    // Miss with a balanced chain: affinity seeded with the raw prefix_hash (§21.9).
    req.block_token_counts = vec![16, 16];
    let r = lookup(&mut c, with_adapter(req.clone(), "lx")).await;
    let want = pick(&["r-1", "r-2", "r-3"], b"q");
    assert_resp(&r, "AFFINITY_HINT", &[affinity(want)]);
    assert_eq!(r.adapter_id, "lx");
    // Chain fields only (no prefix_hash, no tokens) with chain matching off → fail open NO_HINT
    // before the index, adapter "" (§10.3 "chain ignored").
    let mut only_chain = req.clone();
    only_chain.prefix_hash.clear();
    let r = lookup(&mut c, with_adapter(only_chain.clone(), "lx")).await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.adapter_id, "", "resolver fail-open does not echo adapter");
    // Chain fields + token_ids, chain off: tokens win, exact on the last block hash; seed = that
    // hash raw (8 bytes).
    let novel: Vec<u32> = (5_000_000..5_000_032).collect();
    only_chain.token_ids = novel.clone();
    let r = lookup(&mut c, with_adapter(only_chain, "lx")).await;
    let (h, _) = fingerprint_chain(&novel, 16);
    let want = pick(&["r-1", "r-2", "r-3"], &h[1]);
    assert_resp(&r, "AFFINITY_HINT", &[affinity(want)]);
    assert_eq!(r.adapter_id, "lx");
}
shards_1_and_2!(
    s21_10_chain_off_wire_chain,
    s21_10_chain_off_malformed_chain_ignored_and_seed_raw_hash_shards_1,
    s21_10_chain_off_malformed_chain_ignored_and_seed_raw_hash_shards_2
);

// ---- §10.4 adapter_id / metrics on each exit, §16 hint_used ------------------------------------

async fn s10_4_adapter_and_hint_used(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"rc","strategy":{"requireChain":true}},{"namespace":"zf","routingFloorScore":0}]}"#,
    );
    let mut c = srv.client().await;
    let mut w = legacy_update("warm", "t", "m", "vllm", b"other", 64);
    w.stats = stats(0.5, 0.0);
    let mut held = legacy_update("r", "t", "m", "vllm", b"p", 128);
    held.adapter_id = "ad".into();
    assert!(
        report(
            &mut c,
            vec![
                held,
                w,
                legacy_update("a", "zf", "mz", "vllm", b"chat", 16),
                legacy_update("b", "zf", "mz", "vllm", b"chat", 16),
                legacy_update("r", "rc", "m", "vllm", b"p", 128),
            ]
        )
        .await
        .accepted
    );
    let a = |r: pb::LookupRouteRequest| with_adapter(r, "ad");
    let r = lookup(&mut c, a(exact_lookup("t", "m", "vllm", b"p", 128))).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 64.0, 128, T1)]);
    assert_eq!(r.adapter_id, "ad");
    let r = lookup(&mut c, a(exact_lookup("t", "m", "vllm", b"novel", 128))).await;
    assert_resp(&r, "TENANT_HOT", &[exp("warm", 0.5, 0, T_UNSPEC)]);
    assert_eq!(r.adapter_id, "ad");
    let r = lookup(&mut c, a(chain_lookup("t", "m", "vllm", &[b"n1"], &[16]))).await;
    assert_eq!(r.reason_code, "AFFINITY_HINT", "{r:?}");
    assert_eq!(r.adapter_id, "ad");
    let r = lookup(&mut c, a(exact_lookup("nobody", "m", "vllm", b"p", 128))).await;
    assert_resp(&r, "UNKNOWN_TENANT", &[]);
    assert_eq!(r.adapter_id, "ad", "index-derived UNKNOWN_* echoes adapter");
    let r = lookup(&mut c, a(exact_lookup("t", "m", "", b"p", 128))).await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.adapter_id, "ad", "empty scheme NONE is index-derived");
    let r = lookup(
        &mut c,
        a(chain_lookup("t", "m", "vllm", &[b"x", b"y"], &[16])),
    )
    .await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.adapter_id, "", "malformed chain fail-open");
    let r = lookup(&mut c, a(tokens_req("t", "m", (0..15).collect()))).await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.adapter_id, "", "sub-block token_ids fail-open");
    assert!(r.token_ids.is_empty());
    let r = lookup(&mut c, a(exact_lookup("rc", "m", "vllm", b"p", 128))).await;
    assert_resp(&r, "POLICY_REQUIRES_CHAIN", &[]);
    assert_eq!(r.adapter_id, "");
    let r = lookup(&mut c, exact_lookup("zf", "mz", "vllm", b"chat", 16)).await;
    assert_resp(
        &r,
        "PREFIX_MATCH",
        &[exp("a", 0.0, 16, T1), exp("b", 0.0, 16, T1)],
    );
    let m = metrics_text(&srv);
    for line in [
        r#"inferencecache_lookup_route_calls_total{hint_used="true",model="m",reason_code="PREFIX_MATCH"} 1"#,
        r#"inferencecache_lookup_route_calls_total{hint_used="true",model="m",reason_code="TENANT_HOT"} 1"#,
        r#"inferencecache_lookup_route_calls_total{hint_used="true",model="m",reason_code="AFFINITY_HINT"} 1"#,
        r#"inferencecache_lookup_route_calls_total{hint_used="false",model="m",reason_code="UNKNOWN_TENANT"} 1"#,
        r#"inferencecache_lookup_route_calls_total{hint_used="false",model="m",reason_code="NO_HINT"} 3"#,
        r#"inferencecache_lookup_route_calls_total{hint_used="false",model="m",reason_code="POLICY_REQUIRES_CHAIN"} 1"#,
        r#"inferencecache_lookup_route_calls_total{hint_used="true",model="mz",reason_code="PREFIX_MATCH"} 1"#,
    ] {
        assert_metric_line(&m, line);
    }
}
shards_1_and_2!(
    s10_4_adapter_and_hint_used,
    s10_4_s16_adapter_echo_and_hint_used_per_exit_shards_1,
    s10_4_s16_adapter_echo_and_hint_used_per_exit_shards_2
);

// ---- §19.10 legacy prefix_token_count 0 --------------------------------------------------------

/// §19.10 / §10.2 step 9 / §10.6 stage 0: prefix_token_count 0 → effective prefix tokens 0. With
/// minimumPrefixTokens 1 and affinity on, a PREFIX_MATCH is downgraded to AFFINITY_HINT; with
/// affinity off it is the pre-gate NO_HINT (adapter "").
async fn s19_10_zero_count(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"on","minimumPrefixTokens":1},{"namespace":"off","minimumPrefixTokens":1,"affinityRouting":false}]}"#,
    );
    let mut c = srv.client().await;
    assert!(
        report(
            &mut c,
            vec![
                legacy_update("r", "on", "m", "vllm", b"p", 100),
                legacy_update("r", "off", "m", "vllm", b"p", 100),
            ]
        )
        .await
        .accepted
    );
    let r = lookup(
        &mut c,
        with_adapter(exact_lookup("on", "m", "vllm", b"p", 0), "x"),
    )
    .await;
    assert_resp(&r, "AFFINITY_HINT", &[affinity("r")]);
    assert_eq!(r.adapter_id, "x");
    let r = lookup(&mut c, exact_lookup("on", "m", "vllm", b"p", 1)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 100.0, 100, T1)]);
    let r = lookup(
        &mut c,
        with_adapter(exact_lookup("off", "m", "vllm", b"p", 0), "x"),
    )
    .await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.adapter_id, "", "pre-gate exit");
}
shards_1_and_2!(
    s19_10_zero_count,
    s19_10_legacy_zero_prefix_token_count_shards_1,
    s19_10_legacy_zero_prefix_token_count_shards_2
);

// ---- §8.3 chain requests with zero / negative counts ------------------------------------------

async fn s8_3_zero_negative_counts(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"t","routingFloorScore":0}]}"#,
    );
    let mut c = srv.client().await;
    assert!(
        report(
            &mut c,
            vec![chain_update(
                "r",
                "t",
                "m",
                "vllm",
                &[b"b1", b"b2"],
                &[16, 16]
            )]
        )
        .await
        .accepted
    );
    let seed = chain_seed(&[b"b1".to_vec(), b"b2".to_vec()]);
    assert_eq!(pick(&["r"], &seed), "r");
    for counts in [[0, 0], [16, -16], [-32, 16]] {
        let r = lookup(
            &mut c,
            chain_lookup("t", "m", "vllm", &[b"b1", b"b2"], &counts),
        )
        .await;
        assert_resp(&r, "AFFINITY_HINT", &[affinity("r")]);
    }
    let r = lookup(
        &mut c,
        chain_lookup("t", "m", "vllm", &[b"b1", b"b2"], &[-16, 32]),
    )
    .await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 16.0, 16, T1)]);
    let r = lookup(
        &mut c,
        chain_lookup("t", "m", "vllm", &[b"b1", b"b2"], &[0, 16]),
    )
    .await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 16.0, 16, T1)]);
    // Empty counts list but non-empty hashes → malformed → NO_HINT fail-open.
    let r = lookup(&mut c, chain_lookup("t", "m", "vllm", &[b"b1"], &[])).await;
    assert_resp(&r, "NO_HINT", &[]);
    // Counts without hashes → malformed too.
    let r = lookup(&mut c, chain_lookup("t", "m", "vllm", &[], &[16])).await;
    assert_resp(&r, "NO_HINT", &[]);
}
shards_1_and_2!(
    s8_3_zero_negative_counts,
    s8_3_chain_zero_and_negative_request_counts_shards_1,
    s8_3_chain_zero_and_negative_request_counts_shards_2
);

// ---- §19.17 pressure > 1, NaN sanitising ------------------------------------------------------

async fn s19_17_pressure_above_one(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"z","routingFloorScore":0}]}"#,
    );
    let mut c = srv.client().await;
    let mut u = legacy_update("r", "t", "m", "vllm", b"p", 100);
    u.stats = stats(f32::NAN, 1.5);
    let mut z = legacy_update("r", "z", "m", "vllm", b"p", 100);
    z.stats = stats(0.5, 1.5);
    assert!(report(&mut c, vec![u, z]).await.accepted);
    let s = cache_state(&mut c, "t", "m").await;
    assert_eq!(s.replicas.len(), 1);
    assert_eq!(s.replicas[0].pressure, 1.5, "finite pressure stored as-is");
    assert_eq!(s.replicas[0].hit_rate, 0.0, "NaN hit rate sanitised");
    // No policy: score 0 < routing floor 0.1 → NONE → affinity.
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"p", 100)).await;
    assert_resp(&r, "AFFINITY_HINT", &[affinity("r")]);
    // Floor 0: PREFIX_MATCH with a zero score.
    let r = lookup(&mut c, exact_lookup("z", "m", "vllm", b"p", 100)).await;
    assert_resp(&r, "PREFIX_MATCH", &[expp("r", 0.0, 100, T1, 1.0)]);
    // TENANT_HOT with pressure 1.5 → score 0 but still TENANT_HOT (no floors apply).
    let r = lookup(&mut c, exact_lookup("z", "m", "vllm", b"novel", 100)).await;
    assert_resp(&r, "TENANT_HOT", &[expp("r", 0.0, 0, T_UNSPEC, 0.5)]);
}
shards_1_and_2!(
    s19_17_pressure_above_one,
    s19_17_pressure_above_one_clamps_factor_shards_1,
    s19_17_pressure_above_one_clamps_factor_shards_2
);

// ---- §19.12 producer timestamps -----------------------------------------------------------------

async fn s19_12_timestamps(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let now = now_us();
    let mut a = legacy_update("r", "t", "m", "vllm", b"p", 100);
    a.timestamp_us = now;
    let mut back = a.clone();
    back.timestamp_us = now - 15 * MIN_US;
    assert!(report(&mut c, vec![a, back]).await.accepted);
    // last_seen moved backwards: freshness ≈ 0.5 (TTL 30 min).
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"p", 100)).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH", "{r:?}");
    let p = r.replica_scores[0].estimated_cache_hit_prob;
    assert!(
        (p - 0.5).abs() < 0.01,
        "freshness after backwards re-ingest: {p}"
    );
    // Future timestamp → freshness 1.
    let mut fut = legacy_update("r", "t", "m", "vllm", b"f", 100);
    fut.timestamp_us = now + 60 * MIN_US;
    // Already stale on arrival.
    let mut old = legacy_update("r", "t", "m", "vllm", b"old", 100);
    old.timestamp_us = now - 31 * MIN_US;
    assert!(report(&mut c, vec![fut, old]).await.accepted);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"f", 100)).await;
    assert_resp(&r, "PREFIX_MATCH", &[expp("r", 100.0, 100, T1, 1.0)]);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"old", 100)).await;
    assert_resp(&r, "AFFINITY_HINT", &[affinity("r")]);
    let s = cache_state(&mut c, "t", "m").await;
    assert_eq!(
        s.summary.unwrap().total_prefixes,
        3,
        "stale entry stays until the sweep"
    );
    // A negative timestamp is trusted verbatim (stale, but indexed).
    let mut neg = legacy_update("r", "t", "m", "vllm", b"neg", 100);
    neg.timestamp_us = -5;
    assert!(report(&mut c, vec![neg]).await.accepted);
    let s = cache_state(&mut c, "t", "m").await;
    assert_eq!(s.summary.unwrap().total_prefixes, 4);
}
shards_1_and_2!(
    s19_12_timestamps,
    s19_12_producer_timestamps_trusted_and_backwards_shards_1,
    s19_12_producer_timestamps_trusted_and_backwards_shards_2
);

// ---- §19.13 REPLICA_UPDATED ------------------------------------------------------------------

async fn s19_13_replica_updated(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"t","evictionTTL":600000000000}]}"#,
    );
    let mut c = srv.client().await;
    let now = now_us();
    // Stats 6 min old (beyond TENANT_HOT's 5 min) with hit .9, pressure .9.
    let mut s = pb::CacheStateUpdate {
        replica_id: "r".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        hash_scheme: "vllm".into(),
        timestamp_us: now - 6 * MIN_US,
        stats: stats(0.9, 0.9),
        ..Default::default()
    };
    let p = legacy_update("r", "t", "m", "vllm", b"p", 100);
    assert!(report(&mut c, vec![s.clone(), p]).await.accepted);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"novel", 100)).await;
    assert_resp(&r, "AFFINITY_HINT", &[affinity("r")]);
    publish(
        &mut c,
        ev(
            pb::cache_event::Type::ReplicaUpdated,
            "t",
            "m",
            "r",
            b"",
            "whatever",
        ),
    )
    .await;
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"novel", 100)).await;
    assert_resp(&r, "AFFINITY_HINT", &[affinity("r")]);
    // Stats payload 11 min old (TTL 10 min): pressure ignored on the prefix path, also after a
    // REPLICA_UPDATED refreshed liveness.
    s.timestamp_us = now - 11 * MIN_US;
    assert!(report(&mut c, vec![s.clone()]).await.accepted);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"p", 100)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 100.0, 100, T1)]);
    publish(
        &mut c,
        ev(
            pb::cache_event::Type::ReplicaUpdated,
            "t",
            "m",
            "r",
            b"",
            "",
        ),
    )
    .await;
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"p", 100)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 100.0, 100, T1)]);
    let st = cache_state(&mut c, "t", "m").await;
    assert_eq!(st.replicas.len(), 1);
    // Fresh stats: pressure applies (score 10) and TENANT_HOT appears.
    s.timestamp_us = 0;
    assert!(report(&mut c, vec![s]).await.accepted);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"p", 100)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 10.0, 100, T1)]);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"novel", 100)).await;
    assert_resp(&r, "TENANT_HOT", &[expp("r", 0.9 * 0.1, 0, T_UNSPEC, 0.9)]);
    // REPLICA_UPDATED for an unknown replica / PREFIX_ADDED: no effect, Ack.
    publish(
        &mut c,
        ev(
            pb::cache_event::Type::ReplicaUpdated,
            "t",
            "m",
            "ghost",
            b"",
            "",
        ),
    )
    .await;
    publish(
        &mut c,
        ev(pb::cache_event::Type::PrefixAdded, "t", "m", "r", b"zz", ""),
    )
    .await;
    let mut unknown = ev(pb::cache_event::Type::AllCleared, "t", "m", "r", b"", "");
    unknown.r#type = 99;
    publish(&mut c, unknown).await;
    let st = cache_state(&mut c, "t", "m").await;
    assert_eq!(st.replicas.len(), 1);
    assert_eq!(st.summary.unwrap().total_prefixes, 1);
}
shards_1_and_2!(
    s19_13_replica_updated,
    s19_13_replica_updated_is_not_fresh_stats_shards_1,
    s19_13_replica_updated_is_not_fresh_stats_shards_2
);

// ---- §19.14 PREFIX_EVICTED across schemes with adapter narrowing --------------------------------

async fn s19_14_prefix_evicted(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(&srv, r#"{"version":7,"policies":[{"namespace":"t"}]}"#);
    let mut c = srv.client().await;
    let mk = |rep: &str, scheme: &str, adapter: &str| {
        let mut u = legacy_update(rep, "t", "m", scheme, b"p", 64);
        u.adapter_id = adapter.into();
        u
    };
    assert!(
        report(
            &mut c,
            vec![
                mk("r", "vllm", ""),
                mk("r", "vllm", "a1"),
                mk("r", "sglang", "a2"),
                mk("r2", "vllm", ""),
                legacy_update("r", "t", "m", "vllm", b"keep", 64),
            ]
        )
        .await
        .accepted
    );
    let q = |scheme: &str, adapter: &str| {
        with_adapter(exact_lookup("t", "m", scheme, b"p", 64), adapter)
    };
    assert_eq!(total_prefixes(&mut c, "t", "m").await, 4);
    // Adapter a1 only.
    publish(
        &mut c,
        ev(
            pb::cache_event::Type::PrefixEvicted,
            "t",
            "m",
            "r",
            b"p",
            "a1",
        ),
    )
    .await;
    assert_eq!(total_prefixes(&mut c, "t", "m").await, 3);
    let r = lookup(&mut c, q("vllm", "a1")).await;
    assert_ne!(r.reason_code, "PREFIX_MATCH", "{r:?}");
    let r = lookup(&mut c, q("sglang", "a2")).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 64.0, 64, T1)]);
    // Unknown adapter: no-op.
    publish(
        &mut c,
        ev(
            pb::cache_event::Type::PrefixEvicted,
            "t",
            "m",
            "r",
            b"p",
            "never",
        ),
    )
    .await;
    assert_eq!(total_prefixes(&mut c, "t", "m").await, 3);
    // Empty adapter: every partition, every scheme; r2 and other keys untouched.
    publish(
        &mut c,
        ev(
            pb::cache_event::Type::PrefixEvicted,
            "t",
            "m",
            "r",
            b"p",
            "",
        ),
    )
    .await;
    assert_eq!(total_prefixes(&mut c, "t", "m").await, 2);
    let r = lookup(&mut c, q("sglang", "a2")).await;
    assert_resp(&r, "UNKNOWN_HASH_SCHEME", &[]);
    let r = lookup(&mut c, q("vllm", "")).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r2", 32.0, 64, T1)]);
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"keep", 64)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 32.0, 64, T1)]);
}
shards_1_and_2!(
    s19_14_prefix_evicted,
    s19_14_prefix_evicted_any_scheme_adapter_narrowing_shards_1,
    s19_14_prefix_evicted_any_scheme_adapter_narrowing_shards_2
);

// ---- §7.4 LFU credit rules -----------------------------------------------------------------------

/// §7.4: no credit when the routing floor discards the result, when the min-prefix stage 0
/// downgrades it, or (exact path) for an entry with token_count 0; a delivered match does credit
/// (control). Observed through the cap victim (cap 2: lowest count, then oldest, is evicted).
async fn s7_4_lfu_no_credit(shards: usize) {
    for (policy, a_tokens, victim) in [
        (
            r#"{"namespace":"t","eviction":"lfu","routingFloorScore":1000,"affinityRouting":false}"#,
            32,
            "A",
        ),
        (
            r#"{"namespace":"t","eviction":"lfu","minimumPrefixTokens":100}"#,
            32,
            "A",
        ),
        (
            r#"{"namespace":"t","eviction":"lfu","routingFloorScore":0}"#,
            0,
            "A",
        ),
        (
            r#"{"namespace":"t","eviction":"lfu","routingFloorScore":0}"#,
            32,
            "B",
        ),
    ] {
        let srv = Server::start(shards, &["--index-max-entries", "2"]);
        install_policy(&srv, &format!(r#"{{"version":7,"policies":[{policy}]}}"#));
        let mut c = srv.client().await;
        let t0 = now_us();
        let mut a = legacy_update("r", "t", "m", "vllm", b"A", a_tokens);
        a.timestamp_us = t0;
        let mut b = legacy_update("r", "t", "m", "vllm", b"B", 32);
        b.timestamp_us = t0 + 1_000_000;
        assert!(report(&mut c, vec![a, b]).await.accepted);
        for _ in 0..3 {
            let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"A", 32)).await;
            assert_ne!(r.reason_code, "TIMEOUT", "{r:?}");
        }
        let mut n = legacy_update("r", "t", "m", "vllm", b"N", 32);
        n.timestamp_us = t0 + 2_000_000;
        assert!(report(&mut c, vec![n]).await.accepted);
        assert_eq!(total_prefixes(&mut c, "t", "m").await, 2);
        install_policy(
            &srv,
            r#"{"version":7,"policies":[{"namespace":"t","routingFloorScore":0}]}"#,
        );
        for h in ["A", "B", "N"] {
            let r = lookup(&mut c, exact_lookup("t", "m", "vllm", h.as_bytes(), 32)).await;
            let present = r.reason_code == "PREFIX_MATCH";
            assert_eq!(
                present,
                h != victim,
                "policy {policy}: key {h} present={present}, expected victim {victim}; {r:?}"
            );
        }
    }
}
shards_1_and_2!(
    s7_4_lfu_no_credit,
    s7_4_lfu_no_credit_on_discard_and_zero_token_entries_shards_1,
    s7_4_lfu_no_credit_on_discard_and_zero_token_entries_shards_2
);

// ---- §1.1 / §10.1 --engine-block-size -----------------------------------------------------------

/// `--engine-block-size 32` fingerprints token_ids with 32-token blocks; non-positive values are
/// ignored (16 kept).
async fn s1_1_engine_block_size(shards: usize) {
    let toks: Vec<u32> = (3000..3064).collect();
    for (flag, bs) in [("32", 32usize), ("0", 16), ("-4", 16)] {
        let srv = Server::start(shards, &["--engine-block-size", flag]);
        let mut c = srv.client().await;
        let (h, n) = fingerprint_chain(&toks, bs);
        let hr: Vec<&[u8]> = h.iter().map(|x| x.as_slice()).collect();
        assert!(
            report(&mut c, vec![chain_update("r", "t", "m", "vllm", &hr, &n)])
                .await
                .accepted
        );
        let r = lookup(&mut c, tokens_req("t", "m", toks.clone())).await;
        assert_resp(&r, "PREFIX_MATCH", &[exp("r", 64.0, 64, T1)]);
        // 31 tokens: sub-block with bs 32 (fail open), one 16-block with bs 16 (below the floor).
        let r = lookup(&mut c, tokens_req("t", "m", toks[..31].to_vec())).await;
        if bs == 32 {
            assert_resp(&r, "NO_HINT", &[]);
        } else {
            assert_eq!(r.reason_code, "AFFINITY_HINT", "flag {flag}: {r:?}");
        }
    }
}
shards_1_and_2!(
    s1_1_engine_block_size,
    s1_1_engine_block_size_flag_shards_1,
    s1_1_engine_block_size_flag_shards_2
);

// ---- §4.2 / §11 empty tenant and model buckets ----------------------------------------------------

/// Empty tenant/model are accepted at ingest and readable through GetCacheState's empty-key
/// buckets, but never matched by LookupRoute (index NONE → NO_HINT, adapter echoed).
async fn s11_empty_buckets(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let mut u = legacy_update("r", "", "", "vllm", b"p", 128);
    u.stats = Some(pb::ReplicaStats {
        cache_memory_bytes: 7,
        hit_rate: 0.9,
        client_version: "x==1".into(),
        ..Default::default()
    });
    assert!(report(&mut c, vec![u]).await.accepted);
    let s = cache_state(&mut c, "", "").await;
    assert_eq!(s.summary.unwrap().total_prefixes, 1);
    assert_eq!(s.replicas.len(), 1);
    assert_eq!(s.replicas[0].replica_id, "r");
    assert_eq!(s.replicas[0].cache_memory_bytes, 7);
    assert_eq!(
        s.replicas[0].client_version, "",
        "client_version is not stored"
    );
    let r = lookup(
        &mut c,
        with_adapter(exact_lookup("", "", "vllm", b"p", 128), "a"),
    )
    .await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.adapter_id, "a");
    let r = lookup(&mut c, exact_lookup("", "m", "vllm", b"p", 128)).await;
    assert_resp(&r, "NO_HINT", &[]);
}
shards_1_and_2!(
    s11_empty_buckets,
    s11_empty_tenant_model_buckets_shards_1,
    s11_empty_tenant_model_buckets_shards_2
);
