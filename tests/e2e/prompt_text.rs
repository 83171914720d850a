//! End-to-end conformance for the `prompt_text` path with a real (tiny) HF tokenizer loaded from
//! `--tokenizer-models-dir` (docs/BEHAVIOUR.md §10.3, §10.4, §18; docs/CONFORMANCE.md C134, C136,
//! C137). The model directory is generated per test: a WordLevel `tokenizer.json` with a
//! whitespace pre-tokenizer ("wN" → 1000+N, "GEN" → 7) and a chat template that emits the user
//! content followed by " GEN" when `add_generation_prompt` is set, so a prompt of words
//! w0..w(k-1) tokenizes to [1000, …, 1000+k-1, 7].
//!
//! Saturation and deadlines during tokenization are driven deterministically with the server's
//! test-only hook `INFERENCECACHE_TEST_TOKENIZE_GATE` (src/tokenizer/pool.rs): the tokenizer
//! workers hold every job until the gate file exists.

use crate::support::tiny_model::*;
use crate::support::*;

use std::time::Duration;

/// C136 (prompt_text parts): min prefix 1000 with affinity on, empty index: a prompt that
/// tokenizes to 64 tokens → NO_HINT echoing those 64 tokens; one that tokenizes to 8 tokens
/// (sub-block) → NO_HINT echoing the 8 tokens.
async fn c136_prompt_text_no_hint_with_echo(shards: usize) {
    let root = model_root("c136");
    check_tokenizer(&root);
    let srv = Server::start(shards, &["--tokenizer-models-dir", root.to_str().unwrap()]);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"tenant-x","minimumPrefixTokens":1000}]}"#,
    );
    let mut c = srv.client().await;
    let r = lookup(&mut c, prompt_lookup("tenant-x", MODEL, words(63))).await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.token_ids, expected_tokens(63), "64 tokens echoed");
    let r = lookup(&mut c, prompt_lookup("tenant-x", MODEL, words(7))).await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(
        r.token_ids,
        expected_tokens(7),
        "sub-block: 8 tokens echoed"
    );
    let _ = std::fs::remove_dir_all(root);
}
shards_1_and_2!(c136_prompt_text_no_hint_with_echo);

/// C134: r1 stores the fingerprint of the prompt's tokens → PREFIX_MATCH [r1] with the echo.
async fn c134_prompt_text_prefix_match_with_echo(shards: usize) {
    let root = model_root("c134");
    check_tokenizer(&root);
    let srv = Server::start(shards, &["--tokenizer-models-dir", root.to_str().unwrap()]);
    let mut c = srv.client().await;
    let toks = expected_tokens(63);
    let (h, cnt) = fingerprint_chain(&toks, 16);
    let hr: Vec<&[u8]> = h.iter().map(|x| x.as_slice()).collect();
    assert!(
        report(
            &mut c,
            vec![chain_update("r1", "t", MODEL, "vllm", &hr, &cnt)]
        )
        .await
        .accepted
    );
    let r = lookup(&mut c, prompt_lookup("t", MODEL, words(63))).await;
    assert_resp(&r, "PREFIX_MATCH", &[exp("r1", 64.0, 64, T1)]);
    assert_eq!(r.token_ids, toks);
    let _ = std::fs::remove_dir_all(root);
}
shards_1_and_2!(c134_prompt_text_prefix_match_with_echo);

/// C137 (prompt_text parts with a tokenizer loaded): prompt_text over 1 MiB → NO_HINT without
/// tokenizing (no echo, although this text would tokenize fine); a model the tokenizer does not
/// know → NO_HINT, no echo.
async fn c137_prompt_text_oversized_and_unknown_model(shards: usize) {
    let root = model_root("c137");
    check_tokenizer(&root);
    let srv = Server::start(shards, &["--tokenizer-models-dir", root.to_str().unwrap()]);
    let mut c = srv.client().await;
    let mut big = "w1 ".repeat((1 << 20) / 3 + 1);
    big.truncate((1 << 20) + 1);
    assert_eq!(big.len(), (1 << 20) + 1);
    let r = lookup(&mut c, prompt_lookup("t", MODEL, big)).await;
    assert_resp(&r, "NO_HINT", &[]);
    assert!(
        r.token_ids.is_empty(),
        "oversized prompt is never tokenized"
    );
    let r = lookup(&mut c, prompt_lookup("t", "unknown/model", words(63))).await;
    assert_resp(&r, "NO_HINT", &[]);
    assert!(r.token_ids.is_empty());
    // Control: the known model does tokenize (cold index → NO_HINT with the echo).
    let r = lookup(&mut c, prompt_lookup("t", MODEL, words(63))).await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.token_ids, expected_tokens(63));
    let _ = std::fs::remove_dir_all(root);
}
shards_1_and_2!(c137_prompt_text_oversized_and_unknown_model);

/// A server loading the tiny model from `root`, its tokenizer workers held by `gate`.
fn gated_server(shards: usize, root: &std::path::Path, gate: &TokenizeGate) -> Server {
    Server::start_opts(
        shards,
        StartOpts {
            flags: &["--tokenizer-models-dir", root.to_str().unwrap()],
            env: &[gate.env()],
            ..Default::default()
        },
    )
}

/// Waits until the tokenizer gauge reads `n` (admitted tokenizations), generous deadline.
async fn await_in_flight(srv: &Server, n: f64) {
    poll_until(
        &format!("inferencecache_tokenizer_in_flight == {n}"),
        Duration::from_secs(60),
        move || async move { tokenizer_in_flight(srv) == Some(n) },
    )
    .await;
}

/// C138: `lookupTimeoutMs: 20` and a tokenization that outlasts it → TIMEOUT (never an error
/// status), answered at the deadline rather than when the tokenizer finishes: the tokenizer is
/// held by the closed gate, so it cannot finish before the answer arrives.
async fn c138_tokenize_deadline_timeout(shards: usize) {
    let root = model_root("c138");
    let gate = TokenizeGate::closed("c138");
    let srv = gated_server(shards, &root, &gate);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"tenant-x","lookupTimeoutMs":20}]}"#,
    );
    let mut c = srv.client().await;
    let r = tokio::time::timeout(
        Duration::from_secs(60),
        lookup(&mut c, prompt_lookup("tenant-x", MODEL, words(63))),
    )
    .await
    .expect("the budget must answer while the tokenization is still held");
    assert_resp(&r, "TIMEOUT", &[]);
    assert!(
        r.token_ids.is_empty(),
        "no echo when the deadline fires during tokenization"
    );
    assert!(r.lookup_latency_us >= 20_000, "{}", r.lookup_latency_us);
    // The tokenization was still admitted when the answer came; opening the gate drains it.
    assert_eq!(tokenizer_in_flight(&srv), Some(1.0));
    gate.open();
    await_in_flight(&srv, 0.0).await;
    let _ = std::fs::remove_dir_all(root);
}
shards_1_and_2!(c138_tokenize_deadline_timeout);

/// C137 (saturation): while 64 tokenizations are admitted, the 65th fails open at once with
/// NO_HINT and no echo, instead of queueing behind them. The 64 are held by the closed gate; the
/// 65th is answered before the gate opens, then the 64 complete with their echo.
async fn c137_tokenizer_saturation_fails_open(shards: usize) {
    let root = model_root("c137s");
    let gate = TokenizeGate::closed("c137s");
    let srv = gated_server(shards, &root, &gate);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"tenant-x","lookupTimeoutMs":90000}]}"#,
    );
    let mut held = Vec::new();
    for _ in 0..64 {
        let mut c = srv.client().await;
        held.push(tokio::spawn(async move {
            lookup(&mut c, prompt_lookup("tenant-x", MODEL, words(63))).await
        }));
    }
    // All 64 hold a slot (the operator gauge shows admitted tokenizations).
    await_in_flight(&srv, 64.0).await;
    let mut c = srv.client().await;
    let r = tokio::time::timeout(
        Duration::from_secs(60),
        lookup(&mut c, prompt_lookup("tenant-x", MODEL, words(63))),
    )
    .await
    .expect("the 65th lookup must not wait for the held tokenizations");
    assert_resp(&r, "NO_HINT", &[]);
    assert!(
        r.token_ids.is_empty(),
        "a shed request is not tokenized, so nothing is echoed"
    );
    // It was shed, not admitted: the 64 are still held and still the only ones admitted.
    assert_eq!(tokenizer_in_flight(&srv), Some(64.0));
    assert!(held.iter().all(|h| !h.is_finished()));
    gate.open();
    for h in held {
        let r = tokio::time::timeout(Duration::from_secs(60), h)
            .await
            .expect("held lookups complete once the gate opens")
            .unwrap();
        assert_resp(&r, "NO_HINT", &[]);
        assert_eq!(r.token_ids, expected_tokens(63));
    }
    await_in_flight(&srv, 0.0).await;
    drop(srv);
    let _ = std::fs::remove_dir_all(root);
}
shards_1_and_2!(c137_tokenizer_saturation_fails_open);

/// A model directory holding only a `*.tiktoken` rank file (plus its
/// tokenizer_config.json) is loaded; prompt_text is rendered with its chat template, tokenized
/// with its BPE ranks and the tokens echoed (sub-block prompt on an empty index → NO_HINT).
async fn tiktoken_model_prompt_text_echo(shards: usize) {
    use base64::Engine as _;
    let root = unique_temp_path(&format!("tiktoken-e2e-{shards}"));
    let dir = root.join("org/tiny-tik");
    std::fs::create_dir_all(&dir).unwrap();
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let mut ranks = String::new();
    let mut enc = std::collections::HashMap::new();
    for b in 0u8..=255 {
        ranks.push_str(&format!("{} {}\n", b64(&[b]), b));
        enc.insert(vec![b], u32::from(b));
    }
    for (i, m) in [&b"ab"[..], b"abc"].iter().enumerate() {
        ranks.push_str(&format!("{} {}\n", b64(m), 256 + i));
        enc.insert(m.to_vec(), 256 + i as u32);
    }
    std::fs::write(dir.join("tiny.tiktoken"), ranks).unwrap();
    let cfg = serde_json::json!({
        "added_tokens_decoder": {"300": {"content": "<|gen|>", "special": true}},
        "chat_template": "{{ messages[0]['content'] }}{% if add_generation_prompt %}<|gen|>{% endif %}"
    });
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    // The CL100K split pattern the server uses for rank files without `pat_str`.
    let pattern = "'(?i:[sdmt]|ll|ve|re)|[^\\r\\n\\p{L}\\p{N}]?+\\p{L}++|\\p{N}{1,3}+| ?[^\\s\\p{L}\\p{N}]++[\\r\\n]*+|\\s++$|\\s*[\\r\\n]|\\s+(?!\\S)|\\s";
    let special = std::collections::HashMap::from([("<|gen|>".to_string(), 300u32)]);
    let bpe = tiktoken_rs::CoreBPE::new(
        enc.into_iter().collect(),
        special.into_iter().collect(),
        pattern,
    )
    .unwrap();
    let want = bpe.encode_with_special_tokens("abc abc ab<|gen|>");

    let srv = Server::start(shards, &["--tokenizer-models-dir", root.to_str().unwrap()]);
    let mut c = srv.client().await;
    let r = lookup(
        &mut c,
        prompt_lookup("t", "org/tiny-tik", "abc abc ab".into()),
    )
    .await;
    assert_resp(&r, "NO_HINT", &[]);
    assert_eq!(r.token_ids, want);
    assert_eq!(r.token_ids.last(), Some(&300));
    let _ = std::fs::remove_dir_all(root);
}
shards_1_and_2!(tiktoken_model_prompt_text_echo);

/// §10.3 precedence and §21.4 echo: prompt_text is ignored (no echo) when a prefix_hash or
/// token_ids is present; AFFINITY_HINT and TENANT_HOT responses echo the server's tokens; with
/// chain matching off the prompt resolves to the last block hash (exact, TENANT_HOT possible,
/// affinity seeded with that raw hash); the min-prefix pre-gate (affinity off) echoes.
async fn s10_3_s21_4_prompt_text_precedence_and_echo(shards: usize) {
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
    w.timestamp_us = fresh_ts();
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
    req.block_hashes = vec![b"x".to_vec().into()];
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
shards_1_and_2!(s10_3_s21_4_prompt_text_precedence_and_echo);

/// §10.2 step 6 / §10.4: the policy budget fires while a prompt is being tokenized (held by
/// the closed gate) → TIMEOUT as soon as the budget fires (not after tokenization), no echo,
/// adapter "", metric (TIMEOUT, false). Control: once the gate opens, the same prompt without a
/// budget tokenizes and is echoed.
async fn s10_2_budget_timeout_during_tokenize_no_echo(shards: usize) {
    let root = model_root("tmo");
    check_tokenizer(&root);
    let gate = TokenizeGate::closed("tmo");
    let srv = gated_server(shards, &root, &gate);
    install_policy(
        &srv,
        r#"{"version":7,"policies":[{"namespace":"tb","lookupTimeoutMs":2}]}"#,
    );
    let mut c = srv.client().await;
    let text = words(150);
    let mut req = prompt_lookup("tb", MODEL, text.clone());
    req.adapter_id = "ad".into();
    let r = tokio::time::timeout(Duration::from_secs(60), lookup(&mut c, req))
        .await
        .expect("the budget must answer while the tokenization is still held");
    assert_resp(&r, "TIMEOUT", &[]);
    assert!(r.token_ids.is_empty(), "no echo at step 6");
    assert_eq!(r.adapter_id, "");
    assert!(r.lookup_latency_us >= 2_000, "{}", r.lookup_latency_us);
    // Answered while the tokenization was still held: it had not finished.
    assert_eq!(tokenizer_in_flight(&srv), Some(1.0));
    assert_metric_line(
        &metrics_text(&srv),
        &format!(
            r#"inferencecache_lookup_route_calls_total{{hint_used="false",model="{MODEL}",reason_code="TIMEOUT"}} 1"#
        ),
    );
    gate.open();
    let r = lookup(&mut c, prompt_lookup("t", MODEL, text)).await;
    assert_eq!(r.reason_code, "NO_HINT", "cold index");
    assert_eq!(r.token_ids, expected_tokens(150));
    let _ = std::fs::remove_dir_all(root);
}
shards_1_and_2!(s10_2_budget_timeout_during_tokenize_no_echo);
