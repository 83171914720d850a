//! LookupRoute request-side logic (docs/BEHAVIOUR.md §10.1–§10.3, §10.7, §21.9/§21.10; conformance
//! C114, C116, C118, C120, C130, C136, C137).

use inferencecache_index::fingerprint;
use inferencecache_index::index::BlockHashes;
use inferencecache_index::resolve::{
    self, DEFAULT_ENGINE_BLOCK_SIZE, ExactHash, FailOpenCause, MAX_LOOKUP_TOKENS,
    MAX_PROMPT_TEXT_BYTES, Resolution, ResolvedChain, ResolvedInputs, effective_prefix_tokens,
    resolve_tokenized,
};
use inferencecache_proto::v1alpha1::LookupRouteRequest;

// The request-side rules on a decoded request, viewed as the server's general path views it.
fn resolve_inputs(r: &LookupRouteRequest, chain_on: bool, block_size: i32) -> Resolution<'_> {
    resolve::resolve_inputs(&r.into(), chain_on, block_size)
}

fn affinity_eligible(r: &LookupRouteRequest) -> bool {
    resolve::affinity_eligible(&r.into())
}

fn has_valid_wire_chain(r: &LookupRouteRequest) -> bool {
    resolve::has_valid_wire_chain(&r.into())
}

fn will_tokenize(r: &LookupRouteRequest, chain_on: bool) -> bool {
    resolve::will_tokenize(&r.into(), chain_on)
}

const BS: i32 = DEFAULT_ENGINE_BLOCK_SIZE;

fn req() -> LookupRouteRequest {
    LookupRouteRequest {
        tenant_id: "t".into(),
        model_id: "m".into(),
        hash_scheme: "vllm".into(),
        ..Default::default()
    }
}

fn chain_req(hashes: &[&str], counts: &[i32]) -> LookupRouteRequest {
    LookupRouteRequest {
        block_hashes: hashes
            .iter()
            .map(|h| h.as_bytes().to_vec().into())
            .collect(),
        block_token_counts: counts.to_vec(),
        ..req()
    }
}

fn resolved<'a>(r: Resolution<'a>) -> ResolvedInputs<'a> {
    match r {
        Resolution::Resolved(x) => x,
        other => panic!("expected Resolved, got {other:?}"),
    }
}

fn fail_cause(r: &Resolution<'_>) -> (FailOpenCause, usize) {
    match r {
        Resolution::FailOpen { cause, echo } => (*cause, echo.len()),
        other => panic!("expected FailOpen, got {other:?}"),
    }
}

#[test]
fn constants_match_spec() {
    assert_eq!(DEFAULT_ENGINE_BLOCK_SIZE, 16);
    assert_eq!(MAX_LOOKUP_TOKENS, 1_048_576);
    assert_eq!(MAX_PROMPT_TEXT_BYTES, 1_048_576);
    assert_eq!(inferencecache_index::resolve::MAX_CONCURRENT_TOKENIZE, 64);
    assert_eq!(
        inferencecache_index::resolve::DEFAULT_TOKENIZE_TIMEOUT,
        std::time::Duration::from_secs(5)
    );
    assert_eq!(
        inferencecache_index::resolve::DEFAULT_MINIMUM_MATCHED_TOKENS,
        64
    );
    assert_eq!(
        inferencecache_index::resolve::DEFAULT_ROUTING_FLOOR_SCORE,
        0.1
    );
}

#[test]
fn c116_effective_prefix_tokens_helper_table() {
    assert_eq!(effective_prefix_tokens(&[16, 16, 16], 999), 48);
    assert_eq!(effective_prefix_tokens(&[], 128), 128);
    assert_eq!(effective_prefix_tokens(&[32, 32, 32], 0), 96);
    assert_eq!(effective_prefix_tokens(&[], 0), 0);
    assert_eq!(
        effective_prefix_tokens(&[i32::MAX, i32::MAX], 0),
        2 * i64::from(i32::MAX)
    );
}

#[test]
fn c116_chain_off_legacy_count_governs() {
    let r = LookupRouteRequest {
        prefix_hash: b"legacy-exact".to_vec(),
        prefix_token_count: 10,
        ..chain_req(&["b1", "b2"], &[100, 100])
    };
    let x = resolved(resolve_inputs(&r, false, BS));
    assert_eq!(x.chain, ResolvedChain::None);
    assert_eq!(x.exact_hash.as_bytes(), b"legacy-exact");
    assert!(x.chain_ignored);
    assert_eq!(x.effective_prefix_tokens(), 10);
    // Chain on: the chain sum wins.
    let on = resolved(resolve_inputs(&r, true, BS));
    assert_eq!(on.effective_prefix_tokens(), 200);
}

#[test]
fn c114_require_chain_gate_inputs() {
    let legacy = LookupRouteRequest {
        prefix_hash: b"p".to_vec(),
        prefix_token_count: 16,
        ..req()
    };
    let malformed = chain_req(&["b1", "b2"], &[16]);
    let tokens = LookupRouteRequest {
        token_ids: vec![0; 32],
        ..req()
    };
    let prompt = LookupRouteRequest {
        prompt_text: "hello".into(),
        ..req()
    };
    let counts_only = chain_req(&[], &[16]);
    for r in [&legacy, &malformed, &tokens, &prompt, &counts_only, &req()] {
        assert!(!has_valid_wire_chain(r), "{r:?}");
    }
    assert!(has_valid_wire_chain(&chain_req(&["b1"], &[16])));
    assert!(has_valid_wire_chain(&chain_req(&["b1", "b2"], &[16, 16])));
}

#[test]
fn will_tokenize_rule() {
    let prompt = LookupRouteRequest {
        prompt_text: "hi".into(),
        ..req()
    };
    assert!(will_tokenize(&prompt, true));
    assert!(will_tokenize(&prompt, false));
    assert!(!will_tokenize(&req(), true));
    let with_chain = LookupRouteRequest {
        prompt_text: "hi".into(),
        ..chain_req(&["b"], &[16])
    };
    assert!(!will_tokenize(&with_chain, true));
    // Chain matching off drops the chain, so the prompt becomes the input.
    assert!(will_tokenize(&with_chain, false));
    let with_ph = LookupRouteRequest {
        prefix_hash: b"p".to_vec(),
        ..prompt.clone()
    };
    assert!(!will_tokenize(&with_ph, false));
    let with_tokens = LookupRouteRequest {
        token_ids: vec![1],
        ..prompt
    };
    assert!(!will_tokenize(&with_tokens, true));
}

#[test]
fn explicit_fingerprint_borrows_from_request() {
    let r = LookupRouteRequest {
        prefix_hash: b"legacy".to_vec(),
        prefix_token_count: 99,
        token_ids: (0..64).collect(),
        prompt_text: "ignored".into(),
        ..chain_req(&["b1", "b2"], &[16, 16])
    };
    let x = resolved(resolve_inputs(&r, true, BS));
    match &x.chain {
        ResolvedChain::Wire { hashes, counts } => {
            let BlockHashes::Bytes(hashes) = hashes else {
                panic!("{hashes:?}")
            };
            assert!(std::ptr::eq(hashes.as_ptr(), r.block_hashes.as_ptr()));
            assert!(std::ptr::eq(counts.as_ptr(), r.block_token_counts.as_ptr()));
        }
        other => panic!("{other:?}"),
    }
    match x.exact_hash {
        ExactHash::Wire(b) => assert!(std::ptr::eq(b.as_ptr(), r.prefix_hash.as_ptr())),
        other => panic!("{other:?}"),
    }
    assert_eq!(x.exact_tokens, 99);
    assert!(x.echo.is_empty());
    assert_eq!(
        x.chain.iter().collect::<Vec<_>>(),
        [(&b"b1"[..], 16), (&b"b2"[..], 16)]
    );
}

#[test]
fn c118_malformed_or_one_sided_chain_fails_open_with_chain_on() {
    for r in [
        chain_req(&["b1", "b2"], &[16]),
        chain_req(&[], &[16, 16]),
        chain_req(&["b1"], &[]),
        LookupRouteRequest {
            prefix_hash: b"legacy-p".to_vec(),
            ..chain_req(&[], &[16, 16])
        },
    ] {
        assert_eq!(
            fail_cause(&resolve_inputs(&r, true, BS)),
            (FailOpenCause::MalformedChain, 0)
        );
        assert!(!affinity_eligible(&r));
    }
}

#[test]
fn prefix_hash_only_resolves_exact() {
    let r = LookupRouteRequest {
        prefix_hash: b"p".to_vec(),
        prefix_token_count: 128,
        ..req()
    };
    for chain_on in [true, false] {
        let x = resolved(resolve_inputs(&r, chain_on, BS));
        assert!(x.chain.is_empty());
        assert_eq!(x.exact_hash.as_bytes(), b"p");
        assert_eq!(x.effective_prefix_tokens(), 128);
        assert!(!x.chain_ignored);
    }
}

#[test]
fn no_fingerprint_looks_up_the_empty_key() {
    let r = LookupRouteRequest {
        prefix_token_count: 7,
        ..req()
    };
    let x = resolved(resolve_inputs(&r, true, BS));
    assert!(x.chain.is_empty());
    assert_eq!(x.exact_hash.as_bytes(), b"");
    assert_eq!(x.effective_prefix_tokens(), 7);
    assert_eq!(x.affinity_seed(), None);
    assert!(!x.feed_affinity_seed(|_| panic!("no seed expected")));
}

#[test]
fn c130_token_ids_resolve_to_the_fingerprint_chain() {
    let tokens: Vec<u32> = (1000..1064).collect();
    let r = LookupRouteRequest {
        token_ids: tokens.clone(),
        ..req()
    };
    let x = resolved(resolve_inputs(&r, true, BS));
    let (want_hashes, want_counts) = fingerprint::chain(&tokens, BS);
    assert_eq!(x.chain.len(), 4);
    let got: Vec<(Vec<u8>, i32)> = x.chain.iter().map(|(h, c)| (h.to_vec(), c)).collect();
    let want: Vec<(Vec<u8>, i32)> = want_hashes.iter().cloned().zip(want_counts).collect();
    assert_eq!(got, want);
    assert_eq!(x.exact_hash.as_bytes(), want_hashes[3].as_slice());
    assert_eq!(x.exact_tokens, 64);
    assert_eq!(x.effective_prefix_tokens(), 64);
    assert!(x.echo.is_empty(), "token_ids are never echoed");
    assert_eq!(
        hex(x.chain.hash(0)),
        "f7e6c5a1896bad24",
        "computed C005 vector"
    );

    // Explicit chain + novel token_ids: the explicit fingerprint wins.
    let explicit = LookupRouteRequest {
        token_ids: (90_000_000..90_000_064).collect(),
        block_hashes: want_hashes.iter().cloned().map(Into::into).collect(),
        block_token_counts: vec![16; 4],
        ..req()
    };
    let e = resolved(resolve_inputs(&explicit, true, BS));
    assert!(matches!(e.chain, ResolvedChain::Wire { .. }));
    assert_eq!(
        e.chain.iter().map(|(h, _)| h.to_vec()).collect::<Vec<_>>(),
        want_hashes
    );
}

#[test]
fn token_ids_with_chain_off_resolve_last_block_exactly() {
    let tokens: Vec<u32> = (1000..1070).collect(); // 4 full blocks + 6 dropped
    let r = LookupRouteRequest {
        token_ids: tokens.clone(),
        ..req()
    };
    let x = resolved(resolve_inputs(&r, false, BS));
    assert_eq!(x.chain, ResolvedChain::None);
    let (want, _) = fingerprint::chain(&tokens, BS);
    assert_eq!(
        x.exact_hash,
        ExactHash::Derived(want[3].clone().try_into().unwrap())
    );
    assert_eq!(x.exact_tokens, 64);
    // Seed is the raw last block hash (§21.9).
    assert_eq!(x.affinity_seed().unwrap().as_ref(), want[3].as_slice());
}

#[test]
fn c137_token_ids_fail_open_cases() {
    let too_many = LookupRouteRequest {
        token_ids: vec![1; MAX_LOOKUP_TOKENS + 1],
        ..req()
    };
    assert_eq!(
        fail_cause(&resolve_inputs(&too_many, true, BS)),
        (FailOpenCause::TooManyTokens, 0)
    );
    let exactly_max = LookupRouteRequest {
        token_ids: vec![1; MAX_LOOKUP_TOKENS],
        ..req()
    };
    assert_eq!(
        resolved(resolve_inputs(&exactly_max, false, BS)).exact_tokens,
        MAX_LOOKUP_TOKENS as i32
    );
    let sub_block = LookupRouteRequest {
        token_ids: (0..15).collect(),
        ..req()
    };
    for chain_on in [true, false] {
        assert_eq!(
            fail_cause(&resolve_inputs(&sub_block, chain_on, BS)),
            (FailOpenCause::SubBlockTokens, 0)
        );
    }
    let zero_bs = LookupRouteRequest {
        token_ids: (0..64).collect(),
        ..req()
    };
    assert_eq!(
        fail_cause(&resolve_inputs(&zero_bs, true, 0)),
        (FailOpenCause::SubBlockTokens, 0)
    );
}

#[test]
fn chain_matching_off_drops_chain_fields() {
    // §10.3 first bullet: prefix_hash present → exact, even a malformed chain is ignored.
    let malformed_with_ph = LookupRouteRequest {
        prefix_hash: b"p".to_vec(),
        prefix_token_count: 32,
        ..chain_req(&["b1", "b2"], &[16])
    };
    let x = resolved(resolve_inputs(&malformed_with_ph, false, BS));
    assert_eq!(x.exact_hash.as_bytes(), b"p");
    assert!(x.chain.is_empty() && x.chain_ignored);
    // §21.10: affinity still refused because the raw chain is unbalanced.
    assert!(!affinity_eligible(&malformed_with_ph));
    // §21.9: seed is the raw prefix_hash.
    assert_eq!(x.affinity_seed().unwrap().as_ref(), b"p");

    // Chain only → "chain ignored" → fail open.
    let only_chain = chain_req(&["b1", "b2"], &[16, 16]);
    assert_eq!(
        fail_cause(&resolve_inputs(&only_chain, false, BS)),
        (FailOpenCause::ChainIgnored, 0)
    );
    // Chain ignored but token_ids present → token path (exact last block).
    let with_tokens = LookupRouteRequest {
        token_ids: (0..32).collect(),
        ..chain_req(&["b1"], &[16])
    };
    let t = resolved(resolve_inputs(&with_tokens, false, BS));
    assert!(t.chain.is_empty() && t.chain_ignored);
    assert_eq!(t.exact_tokens, 32);
    // Chain ignored but prompt_text present → tokenize.
    let with_prompt = LookupRouteRequest {
        prompt_text: "hello".into(),
        ..chain_req(&["b1"], &[16])
    };
    assert_eq!(
        resolve_inputs(&with_prompt, false, BS),
        Resolution::Tokenize {
            prompt_text: "hello"
        }
    );
    // With chain on the same request uses the wire chain.
    assert!(matches!(
        resolve_inputs(&with_prompt, true, BS),
        Resolution::Resolved(ResolvedInputs {
            chain: ResolvedChain::Wire { .. },
            ..
        })
    ));
}

#[test]
fn prompt_text_path() {
    let r = LookupRouteRequest {
        prompt_text: "hello world".into(),
        ..req()
    };
    assert_eq!(
        resolve_inputs(&r, true, BS),
        Resolution::Tokenize {
            prompt_text: "hello world"
        }
    );
    let big = LookupRouteRequest {
        prompt_text: "x".repeat(MAX_PROMPT_TEXT_BYTES + 1),
        ..req()
    };
    assert_eq!(
        fail_cause(&resolve_inputs(&big, true, BS)),
        (FailOpenCause::PromptTooLarge, 0)
    );
    let max = LookupRouteRequest {
        prompt_text: "x".repeat(MAX_PROMPT_TEXT_BYTES),
        ..req()
    };
    assert!(matches!(
        resolve_inputs(&max, true, BS),
        Resolution::Tokenize { .. }
    ));
    // token_ids beat prompt_text.
    let both = LookupRouteRequest {
        token_ids: (0..16).collect(),
        ..r
    };
    assert!(matches!(
        resolve_inputs(&both, true, BS),
        Resolution::Resolved(_)
    ));
}

#[test]
fn c133_c136_c137_tokenizer_output_resolution() {
    let tokens: Vec<u32> = (77_000_000..77_000_064).collect();
    let x = resolved(resolve_tokenized(tokens.clone(), true, BS));
    assert_eq!(x.echo, tokens);
    assert_eq!(x.chain.len(), 4);
    assert_eq!(x.exact_tokens, 64);
    let off = resolved(resolve_tokenized(tokens.clone(), false, BS));
    assert!(off.chain.is_empty());
    assert_eq!(off.echo, tokens);

    // Sub-block: fail open but echo.
    assert_eq!(
        resolve_tokenized((0..8).collect(), true, BS),
        Resolution::FailOpen {
            cause: FailOpenCause::SubBlockPrompt,
            echo: (0..8).collect()
        }
    );
    // Empty or over-long output: fail open without echo.
    assert_eq!(
        fail_cause(&resolve_tokenized(vec![], true, BS)),
        (FailOpenCause::TokenizerEmpty, 0)
    );
    assert_eq!(
        fail_cause(&resolve_tokenized(vec![1; MAX_LOOKUP_TOKENS + 1], true, BS)),
        (FailOpenCause::TokenizerOutputTooLong, 0)
    );
    assert_eq!(
        fail_cause(&Resolution::fail_open(FailOpenCause::TokenizerBusy)),
        (FailOpenCause::TokenizerBusy, 0)
    );
}

#[test]
fn c120_affinity_seed_for_a_two_block_chain() {
    // Two 8-byte blocks → 12 bytes each: u32_be(8) ‖ hash.
    let tokens: Vec<u32> = (2000..2032).collect();
    let r = LookupRouteRequest {
        token_ids: tokens.clone(),
        ..req()
    };
    let x = resolved(resolve_inputs(&r, true, BS));
    let seed = x.affinity_seed().unwrap();
    assert_eq!(seed.len(), 24);
    assert_eq!(
        hex(&seed),
        "000000089d8d428b2a5abbfc000000087740d5b1af9511a2"
    );
    let mut streamed = Vec::new();
    assert!(x.feed_affinity_seed(|p| streamed.extend_from_slice(p)));
    assert_eq!(streamed, seed.as_ref());

    // Wire chain of arbitrary-length hashes: length-prefixed per block.
    let w = chain_req(&["prompt-block-1", "prompt-block-2"], &[16, 16]);
    let wx = resolved(resolve_inputs(&w, true, BS));
    let mut want = Vec::new();
    for h in ["prompt-block-1", "prompt-block-2"] {
        want.extend_from_slice(&(h.len() as u32).to_be_bytes());
        want.extend_from_slice(h.as_bytes());
    }
    assert_eq!(wx.affinity_seed().unwrap().as_ref(), want.as_slice());
}

#[test]
fn affinity_eligibility_on_raw_request() {
    assert!(affinity_eligible(&req()));
    assert!(affinity_eligible(&chain_req(&["a"], &[16])));
    for r in [
        LookupRouteRequest {
            tenant_id: String::new(),
            ..req()
        },
        LookupRouteRequest {
            model_id: String::new(),
            ..req()
        },
        LookupRouteRequest {
            hash_scheme: String::new(),
            ..req()
        },
        chain_req(&["a", "b"], &[16]),
    ] {
        assert!(!affinity_eligible(&r), "{r:?}");
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A resolution detached from its request (to cross to the owner core with it) and attached to
/// it again is the same resolution, for every kind of input, with chain matching on and off.
#[test]
fn a_detached_resolution_attaches_to_its_request_as_it_was() {
    let tokens = |n: u32| LookupRouteRequest {
        token_ids: (0..n).collect(),
        ..req()
    };
    let mut malformed = chain_req(&["aa", "bb"], &[16]);
    malformed.prefix_hash = b"p".to_vec();
    let mut chain_and_exact = chain_req(&["aa", "bb"], &[16, 16]);
    chain_and_exact.prefix_hash = b"p".to_vec();
    chain_and_exact.prefix_token_count = 32;
    let requests = [
        req(),
        chain_req(&["aa", "bb"], &[16, 16]),
        chain_and_exact,
        malformed,
        LookupRouteRequest {
            prefix_hash: b"p".to_vec(),
            prefix_token_count: 7,
            ..req()
        },
        tokens(3 * BS as u32 + 5),
        tokens(2),
        LookupRouteRequest {
            prompt_text: "hello".into(),
            ..req()
        },
        LookupRouteRequest {
            prompt_text: "x".repeat(MAX_PROMPT_TEXT_BYTES + 1),
            ..req()
        },
    ];
    for r in &requests {
        for chain_on in [true, false] {
            let once = resolve_inputs(r, chain_on, BS);
            let again = once.clone().detach().attach(&r.into());
            assert_eq!(again, once, "{r:?}, chain matching {chain_on}");
        }
    }
}
