//! Independent review: `prompt_text` resolution precedence, echo rules and TIMEOUT during
//! tokenization (BEHAVIOUR.md §10.2 steps 3/6/9, §10.3, §10.4, §21.4), with a real tiny
//! WordLevel tokenizer (same fixture as rpc_prompt_text.rs: "wN" → 1000+N, generation prompt
//! " GEN" → 7).

#[macro_use]
mod common;

use common::tiny_model::*;
use common::*;
use sha2::{Digest, Sha256};

fn pick<'a>(sorted: &[&'a str], seed: &[u8]) -> &'a str {
    let d = Sha256::digest(seed);
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    sorted[(u64::from_be_bytes(b) % sorted.len() as u64) as usize]
}

fn chain_seed(hashes: &[Vec<u8>]) -> Vec<u8> {
    let mut s = Vec::new();
    for h in hashes {
        s.extend_from_slice(&(h.len() as u32).to_be_bytes());
        s.extend_from_slice(h);
    }
    s
}

/// §10.3 precedence and §21.4 echo: prompt_text is ignored (no echo) when a prefix_hash or
/// token_ids is present; AFFINITY_HINT and TENANT_HOT responses echo the server's tokens; with
/// chain matching off the prompt resolves to the last block hash (exact, TENANT_HOT possible,
/// affinity seeded with that raw hash); the min-prefix pre-gate (affinity off) echoes.
async fn s10_3_prompt_precedence_and_echo(shards: usize) {
    let root = model_root("prec");
    check_tokenizer(&root);
    let srv = Server::start(shards, &["--tokenizer-models-dir", root.to_str().unwrap()]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"co","strategy":{"enableChainMatching":false}},{"namespace":"gate","minimumPrefixTokens":1000,"affinityRouting":false}]}"#,
    );
    let mut c = srv.client().await;
    let toks = expected_tokens(63);
    let (h, _) = fingerprint_chain(&toks, 16);
    let mut ups = Vec::new();
    for t in ["t", "co", "gate"] {
        ups.push(legacy_update("r-1", t, MODEL, "vllm", b"\x01", 128));
        ups.push(legacy_update("r-2", t, MODEL, "vllm", b"\x02", 32));
    }
    let mut w = legacy_update("r-2", "co", MODEL, "vllm", b"\x02", 32);
    w.stats = stats(0.9, 0.0);
    ups.push(w);
    assert!(report(&mut c, ups).await.accepted);

    // Chain on, novel prompt → AFFINITY_HINT seeded with the derived chain, echo.
    let r = lookup(&mut c, prompt_lookup("t", MODEL, words(63))).await;
    assert_resp(
        &r,
        "AFFINITY_HINT",
        &[affinity(pick(&["r-1", "r-2"], &chain_seed(&h)))],
    );
    assert_eq!(r.token_ids, toks, "AFFINITY_HINT echoes tokens");

    // prefix_hash present → prompt ignored, no tokenization, no echo.
    let mut req = prompt_lookup("t", MODEL, words(63));
    req.prefix_hash = b"\x01".to_vec();
    req.prefix_token_count = 64;
    let r = lookup(&mut c, req).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r-1", 64.0, 128, T1)]);
    assert!(r.token_ids.is_empty(), "explicit fingerprint wins, no echo");

    // token_ids present → prompt ignored, no echo.
    let mut req = prompt_lookup("t", MODEL, words(63));
    req.token_ids = (7_000_000..7_000_064).collect();
    let r = lookup(&mut c, req).await;
    assert_eq!(r.reason_code, "AFFINITY_HINT");
    assert!(r.token_ids.is_empty(), "token_ids win, no echo");

    // Chain off: exact on the last block hash; warm r-2 → TENANT_HOT with echo.
    let r = lookup(&mut c, prompt_lookup("co", MODEL, words(63))).await;
    assert_resp(&r, "TENANT_HOT", &[exp("r-2", 0.9, 0, T_UNSPEC)]);
    assert_eq!(r.token_ids, toks, "TENANT_HOT echoes tokens");

    // Chain off with a (malformed) wire chain and no prefix_hash: chain ignored, prompt
    // tokenized (exact on the last block) → TENANT_HOT with echo.
    let mut req = prompt_lookup("co", MODEL, words(63));
    req.block_hashes = vec![b"x".to_vec()];
    let r = lookup(&mut c, req).await;
    assert_eq!(r.reason_code, "TENANT_HOT", "{r:?}");
    assert_eq!(r.token_ids, toks);

    // min-prefix pre-gate (affinity off): NO_HINT with echo, adapter "".
    let mut req = prompt_lookup("gate", MODEL, words(63));
    req.adapter_id = "ad".into();
    let r = lookup(&mut c, req).await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.token_ids, toks, "pre-gate echoes tokens");
    assert_eq!(r.adapter_id, "");
    let _ = std::fs::remove_dir_all(root);
}
shards_1_and_2!(
    s10_3_prompt_precedence_and_echo,
    s10_3_s21_4_prompt_text_precedence_and_echo_shards_1,
    s10_3_s21_4_prompt_text_precedence_and_echo_shards_2
);

/// §10.2 step 6 / §10.4: the policy budget fires while a large prompt is being tokenized →
/// TIMEOUT immediately (not after tokenization), no echo, adapter "", metric (TIMEOUT, false).
async fn s10_2_timeout_during_tokenize(shards: usize) {
    let root = model_root("tmo");
    check_tokenizer(&root);
    let srv = Server::start(shards, &["--tokenizer-models-dir", root.to_str().unwrap()]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"tb","lookupTimeoutMs":2}]}"#,
    );
    let mut c = srv.client().await;
    let big = "w1 ".repeat(300_000);
    assert!(big.len() < 1 << 20);
    // How long does the tokenization take without a budget?
    let t = std::time::Instant::now();
    let r = lookup(&mut c, prompt_lookup("t", MODEL, big.clone())).await;
    let full = t.elapsed();
    assert_eq!(r.reason_code, "NO_HINT", "cold index");
    assert_eq!(r.token_ids.len(), 300_001);
    if full < std::time::Duration::from_millis(40) {
        eprintln!("tokenization too fast ({full:?}) to observe the budget; skipping");
        return;
    }
    let mut req = prompt_lookup("tb", MODEL, big);
    req.adapter_id = "ad".into();
    let r = lookup(&mut c, req).await;
    assert_resp(&r, "TIMEOUT", &[]);
    assert!(r.token_ids.is_empty(), "no echo at step 6");
    assert_eq!(r.adapter_id, "");
    assert!(r.lookup_latency_us >= 2_000, "{}", r.lookup_latency_us);
    assert!(
        (r.lookup_latency_us as u128) < full.as_micros() / 2,
        "TIMEOUT returned as soon as the budget fired: {} µs vs full {:?}",
        r.lookup_latency_us,
        full
    );
    assert_metric_line(
        &metrics_text(&srv),
        &format!(
            r#"inferencecache_lookup_route_calls_total{{hint_used="false",model="{MODEL}",reason_code="TIMEOUT"}} 1"#
        ),
    );
    let _ = std::fs::remove_dir_all(root);
}
shards_1_and_2!(
    s10_2_timeout_during_tokenize,
    s10_2_budget_timeout_during_tokenize_no_echo_shards_1,
    s10_2_budget_timeout_during_tokenize_no_echo_shards_2
);
