//! Byte-exact fingerprint checks (docs/BEHAVIOUR.md §17; conformance C002, C004, C005) against the
//! contract's golden vectors, `tests/data/golden_vectors.json` (kept byte-identical to the
//! contract's copy so the two can be diffed).

use inferencecache_fingerprint::{chain, content_hash, prefix_hashes};
use serde_json::Value;

const GOLDEN: &str = include_str!("data/golden_vectors.json");

/// Standard base64 with padding; small enough not to warrant a dependency.
fn b64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// `(dec, b64be)` pairs of a fixture list, checked for internal consistency.
fn hashes(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|h| {
            let dec: u64 = h["dec"].as_str().unwrap().parse().unwrap();
            assert_eq!(b64(&dec.to_be_bytes()), h["b64be"].as_str().unwrap());
            dec
        })
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn golden_fixture_matches_shared_copy_names() {
    let v: Value = serde_json::from_str(GOLDEN).unwrap();
    let names: Vec<&str> = v["vectors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "single_full_block",
            "partial_tail_dropped",
            "two_block_chain",
            "multi_block_chain",
            "parent_chain",
            "partial_only_no_blocks"
        ]
    );
    assert_eq!(v["scheme"]["seed"], 1337);
}

#[test]
fn golden_every_vector_content_prefix_and_wire() {
    let v: Value = serde_json::from_str(GOLDEN).unwrap();
    for vec in v["vectors"].as_array().unwrap() {
        let name = vec["name"].as_str().unwrap();
        let tokens: Vec<u32> = vec["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let bs = vec["block_size"].as_i64().unwrap() as i32;
        let parent = match &vec["parent_prefix"] {
            Value::Null => None,
            p => {
                let dec: u64 = p["dec"].as_str().unwrap().parse().unwrap();
                assert_eq!(b64(&dec.to_be_bytes()), p["b64be"].as_str().unwrap());
                Some(dec)
            }
        };
        let want_content = hashes(&vec["content_hashes"]);
        let got_content: Vec<u64> = tokens.chunks_exact(bs as usize).map(content_hash).collect();
        assert_eq!(got_content, want_content, "{name}: content hashes");

        let want_prefix = hashes(&vec["prefix_hashes"]);
        assert_eq!(
            prefix_hashes(&tokens, bs, parent),
            want_prefix,
            "{name}: prefix hashes"
        );

        if parent.is_none() {
            let (wire, counts) = chain(&tokens, bs);
            let want_wire: Vec<Vec<u8>> = want_prefix
                .iter()
                .map(|h| h.to_be_bytes().to_vec())
                .collect();
            assert_eq!(wire, want_wire, "{name}: wire chain");
            assert_eq!(counts, vec![bs; want_prefix.len()], "{name}: counts");
            for (w, h) in wire.iter().zip(vec["prefix_hashes"].as_array().unwrap()) {
                assert_eq!(b64(w), h["b64be"].as_str().unwrap(), "{name}: b64be");
            }
        }
    }
}

#[test]
fn c002_partial_tail_and_degenerate_inputs() {
    let t: Vec<u32> = (100..120).collect();
    assert_eq!(prefix_hashes(&t, 16, None), vec![10823191264391160519]);
    let short: Vec<u32> = (0..10).collect();
    assert!(prefix_hashes(&short, 16, None).is_empty());
    let full: Vec<u32> = (1..=32).collect();
    for bs in [0, -1] {
        assert!(prefix_hashes(&full, bs, None).is_empty());
        assert_eq!(chain(&full, bs), (vec![], vec![]));
    }
    assert!(prefix_hashes(&[], 16, None).is_empty());
    assert_eq!(chain(&[], 16), (vec![], vec![]));
    assert_eq!(chain(&short, 16), (vec![], vec![]));
}

#[test]
fn c004_explicit_parent_changes_block_zero() {
    let t: Vec<u32> = (50..82).collect();
    assert_eq!(
        prefix_hashes(&t, 16, Some(0xDEAD_BEEF)),
        vec![13185224009891017151, 2998384554010166533]
    );
    let no_parent = prefix_hashes(&t, 16, None);
    assert_ne!(no_parent[0], 13185224009891017151);
    assert_eq!(no_parent[0], content_hash(&t[..16]));
}

#[test]
fn c005_chain_shapes_and_computed_vectors() {
    let cases: [(std::ops::Range<u32>, i32, &[&str]); 6] = [
        (1..33, 16, &["ea06fc71a5ee6e88", "ad01835a37dd294c"]),
        (100..120, 16, &["9633b31c7a2562c7"]),
        (
            0..64,
            16,
            &[
                "d47a8f41c833328a",
                "bf15dffb16447f38",
                "a4dda066f3c1e1a0",
                "35f7c0d119848950",
            ],
        ),
        (
            1000..1064,
            16,
            &[
                "f7e6c5a1896bad24",
                "3d5ff0dd2a93fd39",
                "cf4f246cbcc8787b",
                "0a0edb4669bfb130",
            ],
        ),
        (3000..3064, 32, &["bb5254d5cd43a29f", "d6819210b0f58c7c"]),
        (2000..2032, 16, &["9d8d428b2a5abbfc", "7740d5b1af9511a2"]),
    ];
    for (range, bs, want) in cases {
        let t: Vec<u32> = range.clone().collect();
        let (hashes, counts) = chain(&t, bs);
        let got: Vec<String> = hashes.iter().map(|h| hex(h)).collect();
        assert_eq!(got, want, "tokens {range:?} @{bs}");
        assert!(hashes.iter().all(|h| h.len() == 8));
        assert_eq!(counts, vec![bs; want.len()]);
    }
}
