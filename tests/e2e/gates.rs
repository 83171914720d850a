//! End-to-end conformance: request-side gates and strategy switches (docs/BEHAVIOUR.md §10.2 steps
//! 5, 9, 10, 12, §10.3, §10.4; docs/CONFORMANCE.md C112–C118), and chain matching switched
//! off (§19.3, §19.10, §21.8–§21.10).
//!
//! "The index is never consulted" is observed through the envelope (§10.4, §21.3): the
//! pre-index exits (requireChain gate, min-prefix pre-gate, resolver fail-open) answer with an
//! empty `adapter_id`, whereas index-derived answers echo the request's adapter_id; and a model
//! the index has never seen would classify as UNKNOWN_MODEL if the index were consulted.

use crate::support::*;

/// C112: minimumPrefixTokens 200, affinity off: prefix_token_count 10 → NO_HINT without index
/// access; chain [b1,b2] counts [16,16] (sum 32) → NO_HINT without index access.
async fn c112_min_prefix_pregate_skips_index(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"team-a","minimumPrefixTokens":200,"affinityRouting":false}]}"#,
    );
    let mut c = srv.client().await;
    assert!(
        report(
            &mut c,
            vec![
                legacy_update("r", "team-a", "m", "vllm", b"p", 300),
                chain_update("r", "team-a", "m", "vllm", &[b"b1", b"b2"], &[16, 16]),
            ]
        )
        .await
        .accepted
    );
    // Stored data that would PREFIX_MATCH, adapter sent: pre-gate → NO_HINT with adapter "".
    let r = lookup(
        &mut c,
        with_adapter(exact_lookup("team-a", "m", "vllm", b"p", 10), "lora-x"),
    )
    .await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.adapter_id, "", "pre-gate exit does not echo adapter_id");
    // Never-seen model: the classifier would say UNKNOWN_MODEL if the index were consulted.
    let r = lookup(
        &mut c,
        exact_lookup("team-a", "never-seen", "vllm", b"p", 10),
    )
    .await;
    assert_resp(&r, "NO_HINT", &[]);

    let r = lookup(
        &mut c,
        with_adapter(
            chain_lookup("team-a", "m", "vllm", &[b"b1", b"b2"], &[16, 16]),
            "lora-x",
        ),
    )
    .await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.adapter_id, "");
    let r = lookup(
        &mut c,
        chain_lookup("team-a", "never-seen", "vllm", &[b"b1", b"b2"], &[16, 16]),
    )
    .await;
    assert_resp(&r, "NO_HINT", &[]);

    // Control: at the threshold the index is consulted (eff 200 ≥ 200).
    let r = lookup(&mut c, exact_lookup("team-a", "m", "vllm", b"p", 200)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 300.0, 300, T1)]);
}
shards_1_and_2!(c112_min_prefix_pregate_skips_index);

/// C113: minimumPrefixTokens 32: stored chain(b1,b2,b3) requested (sum 48) → PREFIX_MATCH.
async fn c113_min_prefix_satisfied_prefix_match(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"team-a","minimumPrefixTokens":32}]}"#,
    );
    let mut c = srv.client().await;
    assert!(
        report(
            &mut c,
            vec![chain_update(
                "r",
                "team-a",
                "m",
                "vllm",
                &[b"b1", b"b2", b"b3"],
                &[16; 3]
            )]
        )
        .await
        .accepted
    );
    let r = lookup(
        &mut c,
        chain_lookup("team-a", "m", "vllm", &[b"b1", b"b2", b"b3"], &[16; 3]),
    )
    .await;
    assert_resp(&r, "PREFIX_MATCH", &[expp("r", 48.0, 48, T1, 1.0)]);
}
shards_1_and_2!(c113_min_prefix_satisfied_prefix_match);

/// C114: requireChain → POLICY_REQUIRES_CHAIN (no scores, adapter "", no echo, no index access)
/// for a legacy prefix, a malformed chain, token_ids (32 zeros) and prompt_text; a valid wire
/// chain passes the gate.
async fn c114_require_chain_gate(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"team-a","strategy":{"requireChain":true}}]}"#,
    );
    let mut c = srv.client().await;
    assert!(
        report(
            &mut c,
            vec![
                legacy_update("r", "team-a", "m", "vllm", b"p", 128),
                chain_update("r", "team-a", "m", "vllm", &[b"b1", b"b2"], &[64, 64]),
            ]
        )
        .await
        .accepted
    );
    let legacy = exact_lookup("team-a", "m", "vllm", b"p", 128);
    let malformed = chain_lookup("team-a", "m", "vllm", &[b"b1", b"b2"], &[64]);
    let tokens = pb::LookupRouteRequest {
        model_id: "m".into(),
        tenant_id: "team-a".into(),
        hash_scheme: "vllm".into(),
        token_ids: vec![0; 32],
        ..Default::default()
    };
    let prompt = pb::LookupRouteRequest {
        model_id: "m".into(),
        tenant_id: "team-a".into(),
        hash_scheme: "vllm".into(),
        prompt_text: "hello".into(),
        ..Default::default()
    };
    for req in [legacy, malformed, tokens, prompt] {
        let r = lookup(&mut c, with_adapter(req.clone(), "lora-a")).await;
        assert_resp(&r, "POLICY_REQUIRES_CHAIN", &[]);
        assert_eq!(r.adapter_id, "", "no adapter echo on the requireChain gate");
        assert!(r.token_ids.is_empty(), "no token echo: {r:?}");
    }
    // Unknown model: still the gate (the index is never consulted).
    let r = lookup(
        &mut c,
        exact_lookup("team-a", "never-seen", "vllm", b"p", 128),
    )
    .await;
    assert_resp(&r, "POLICY_REQUIRES_CHAIN", &[]);
    let m = metrics_text(&srv);
    assert_metric_line(
        &m,
        r#"inferencecache_lookup_route_calls_total{hint_used="false",model="m",reason_code="POLICY_REQUIRES_CHAIN"} 4"#,
    );

    // A valid wire chain satisfies the gate.
    let r = lookup(
        &mut c,
        chain_lookup("team-a", "m", "vllm", &[b"b1", b"b2"], &[64, 64]),
    )
    .await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 128.0, 128, T1)]);
    // Tenants without the policy are unaffected.
    assert!(
        report(
            &mut c,
            vec![legacy_update("r", "other", "m", "vllm", b"p", 128)]
        )
        .await
        .accepted
    );
    let r = lookup(&mut c, exact_lookup("other", "m", "vllm", b"p", 128)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 128.0, 128, T1)]);
}
shards_1_and_2!(c114_require_chain_gate);

/// C116: min prefix 100, chain matching off, affinity off: prefix "legacy-exact" with
/// prefix_token_count 10 and chain counts [100,100] → NO_HINT without index access (the legacy
/// count governs: with chain matching off the chain is ignored). With prefix_token_count 100 the
/// exact lookup runs → PREFIX_MATCH on the stored 500. Effective prefix tokens with chain
/// matching on: the chain sum wins over the legacy count (16+16+16 = 48 vs 999).
async fn c116_chain_off_legacy_count_governs_pregate(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[
            {"namespace":"team-a","minimumPrefixTokens":100,"strategy":{"enableChainMatching":false},"affinityRouting":false},
            {"namespace":"team-b","minimumPrefixTokens":48,"affinityRouting":false},
            {"namespace":"team-c","minimumPrefixTokens":49,"affinityRouting":false},
            {"namespace":"team-d","minimumPrefixTokens":128,"affinityRouting":false}]}"#,
    );
    let mut c = srv.client().await;
    let mut ups = vec![legacy_update(
        "r",
        "team-a",
        "m",
        "vllm",
        b"legacy-exact",
        500,
    )];
    for t in ["team-b", "team-c"] {
        ups.push(chain_update(
            "r",
            t,
            "m",
            "vllm",
            &[b"b1", b"b2", b"b3"],
            &[16; 3],
        ));
    }
    ups.push(legacy_update("r", "team-d", "m", "vllm", b"p", 128));
    assert!(report(&mut c, ups).await.accepted);

    let mut req = exact_lookup("team-a", "m", "vllm", b"legacy-exact", 10);
    req.block_token_counts = vec![100, 100];
    let r = lookup(&mut c, with_adapter(req.clone(), "lora-q")).await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.adapter_id, "", "pre-gate exit does not echo adapter_id");
    let mut never = req.clone();
    never.model_id = "never-seen".into();
    let r = lookup(&mut c, never).await;
    assert_resp(&r, "NO_HINT", &[]);

    req.prefix_token_count = 100;
    let r = lookup(&mut c, req).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 500.0, 500, T1)]);

    // Chain matching on: effective prefix tokens = chain sum 48 (legacy 999 ignored).
    let mut chain = chain_lookup("team-b", "m", "vllm", &[b"b1", b"b2", b"b3"], &[16; 3]);
    chain.prefix_hash = b"x".to_vec();
    chain.prefix_token_count = 999;
    let r = lookup(&mut c, chain.clone()).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 48.0, 48, T1)]);
    chain.tenant_id = "team-c".into();
    let r = lookup(&mut c, with_adapter(chain, "lora-q")).await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.adapter_id, "", "48 < 49: pre-gate");

    // Legacy request, no chain: the legacy count governs (128 ≥ 128 passes, 127 does not).
    let r = lookup(&mut c, exact_lookup("team-d", "m", "vllm", b"p", 128)).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r", 128.0, 128, T1)]);
    let r = lookup(
        &mut c,
        with_adapter(exact_lookup("team-d", "m", "vllm", b"p", 127), "lora-q"),
    )
    .await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.adapter_id, "");
}
shards_1_and_2!(c116_chain_off_legacy_count_governs_pregate);

/// C117: enableTenantHot=false with affinity off → NO_HINT; with affinity left on → the NONE
/// becomes AFFINITY_HINT [warm-r] (§21.1); without a policy → TENANT_HOT [warm-r] ≈ 0.9.
async fn c117_tenant_hot_disabled(shards: usize) {
    let srv = Server::start(shards, &[]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[
            {"namespace":"t","strategy":{"enableTenantHot":false},"affinityRouting":false},
            {"namespace":"t2","strategy":{"enableTenantHot":false}}]}"#,
    );
    let mut c = srv.client().await;
    for t in ["t", "t2", "t3"] {
        let mut u = legacy_update("warm-r", t, "m", "vllm", b"unrelated", 64);
        u.stats = stats(0.9, 0.0);
        u.timestamp_us = fresh_ts();
        assert!(report(&mut c, vec![u]).await.accepted);
    }
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"miss", 64)).await;
    assert_resp(&r, "NO_HINT", &[]);
    let r = lookup(
        &mut c,
        with_adapter(exact_lookup("t2", "m", "vllm", b"miss", 64), "lora-w"),
    )
    .await;
    assert_resp(&r, "AFFINITY_HINT", &[affinity("warm-r")]);
    assert_eq!(r.adapter_id, "lora-w", "AFFINITY_HINT echoes adapter_id");
    let r = lookup(&mut c, exact_lookup("t3", "m", "vllm", b"miss", 64)).await;
    assert_resp(&r, "TENANT_HOT", &[expp("warm-r", 0.9, 0, T_UNSPEC, 0.9)]);
}
shards_1_and_2!(c117_tenant_hot_disabled);

/// C118: malformed chain (2 hashes, 1 count) with a warm replica → NO_HINT (no TENANT_HOT, no
/// affinity; resolver fail-open, adapter ""). With affinity off, a well-formed chain nobody holds
/// → NO_HINT (chains never get TENANT_HOT), index-derived so adapter_id is echoed.
async fn c118_chain_requests_never_tenant_hot(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let mut u = legacy_update("warm-r", "t", "m", "vllm", b"unrelated", 64);
    u.stats = stats(0.9, 0.0);
    u.timestamp_us = fresh_ts();
    assert!(report(&mut c, vec![u]).await.accepted);
    let r = lookup(
        &mut c,
        with_adapter(
            chain_lookup("t", "m", "vllm", &[b"q1", b"q2"], &[16]),
            "lora-m",
        ),
    )
    .await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(
        r.adapter_id, "",
        "malformed chain fail-open does not echo adapter_id"
    );

    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"t","affinityRouting":false}]}"#,
    );
    let r = lookup(
        &mut c,
        with_adapter(
            chain_lookup("t", "m", "vllm", &[b"q1", b"q2"], &[16, 16]),
            "lora-m",
        ),
    )
    .await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(
        r.adapter_id, "lora-m",
        "index-derived NO_HINT echoes adapter_id"
    );
    let r = lookup(
        &mut c,
        chain_lookup("t", "m", "vllm", &[b"q1", b"q2"], &[16, 16]),
    )
    .await;
    assert_resp(&r, "NO_HINT", &[]);
    // The same miss as an exact request does get TENANT_HOT.
    let r = lookup(&mut c, exact_lookup("t", "m", "vllm", b"q1", 32)).await;
    assert_resp(&r, "TENANT_HOT", &[expp("warm-r", 0.9, 0, T_UNSPEC, 0.9)]);
}
shards_1_and_2!(c118_chain_requests_never_tenant_hot);

// ---- §19.3 / §21.8 chain matching off: token_ids exact on last block, TENANT_HOT ----------------

async fn s19_3_chain_off_token_ids_exact_last_block_and_tenant_hot(shards: usize) {
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
        w.timestamp_us = fresh_ts();
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
shards_1_and_2!(s19_3_chain_off_token_ids_exact_last_block_and_tenant_hot);

// ---- §21.9 / §21.10 / §10.3 chain matching off with wire chains --------------------------------

async fn s21_10_chain_off_malformed_chain_ignored_and_seed_raw_hash(shards: usize) {
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
    req.block_hashes = vec![b"x".to_vec().into(), b"y".to_vec().into()];
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
shards_1_and_2!(s21_10_chain_off_malformed_chain_ignored_and_seed_raw_hash);

// ---- §19.10 legacy prefix_token_count 0 --------------------------------------------------------

/// §19.10 / §10.2 step 9 / §10.6 stage 0: prefix_token_count 0 → effective prefix tokens 0. With
/// minimumPrefixTokens 1 and affinity on, a PREFIX_MATCH is downgraded to AFFINITY_HINT; with
/// affinity off it is the pre-gate NO_HINT (adapter "").
async fn s19_10_legacy_zero_prefix_token_count(shards: usize) {
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
shards_1_and_2!(s19_10_legacy_zero_prefix_token_count);
